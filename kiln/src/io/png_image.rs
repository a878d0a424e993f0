//! PNG images of plots: 8-bit RGB pixels, as plotters' `BitMapBackend`
//! draws them into a buffer, encoded by the `png` crate.

use crate::{Error, Result};
use std::path::Path;

/// Writes `rgb` (rows of `width` pixels, 3 bytes each, top row first) as a
/// PNG image at `path`. The file is written beside `path` and renamed over
/// it, so a reader never sees half an image. Needs the `plot` feature.
///
/// ```
/// let path = std::env::temp_dir().join(format!("kiln-doc-{}.png", std::process::id()));
/// let red_and_blue = [255, 0, 0, 0, 0, 255];
/// kiln::io::write_png_rgb(&path, 2, 1, &red_and_blue)?;
/// assert!(std::fs::read(&path).unwrap().starts_with(b"\x89PNG"));
/// # std::fs::remove_file(&path).unwrap();
/// // Pixels that do not fill the image are an error, and nothing is written.
/// assert!(kiln::io::write_png_rgb(&path, 2, 2, &red_and_blue).is_err());
/// assert!(!path.exists());
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn write_png_rgb(path: impl AsRef<Path>, width: u32, height: u32, rgb: &[u8]) -> Result<()> {
    let path = path.as_ref();
    let fail = |msg: String| Error::Io { path: path.display().to_string(), msg };
    let want = (width as u64).saturating_mul(height as u64).saturating_mul(3);
    if rgb.len() as u64 != want {
        return Err(fail(format!("a {width}×{height} RGB image needs {want} bytes of pixels, got {}", rgb.len())));
    }
    let mut bytes = Vec::new();
    let mut encoder = png::Encoder::new(&mut bytes, width, height);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    encoder
        .write_header()
        .and_then(|mut w| w.write_image_data(rgb).and_then(|()| w.finish()))
        .map_err(|e| fail(format!("cannot encode the image: {e}")))?;
    // A name of its own per call: two writers of one path (two threads, or
    // two ranks with the same process id on a shared file system) never
    // write into each other's file; the last rename wins whole.
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.kiln-tmp-{}-{call}-{nanos}", std::process::id()));
    std::fs::write(&tmp, &bytes).and_then(|()| std::fs::rename(&tmp, path)).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        fail(format!("cannot write the image: {e}"))
    })
}
