//! 2-D convolution and transposed convolution, forward and backward.
//!
//! The ways to compute one, picked by geometry and element type:
//! - 1×1, stride 1, unpadded ([`pointwise`]): each image is one product of
//!   the weight with the input as it lies, no copy;
//! - stride 1, any kernel, padding or dilation ([`shifted`]): a band of
//!   the zero-padded input, laid out `ow + (kw − 1)·dw` wide, makes every
//!   kernel tap a plain strided matrix, so the convolution is a sum of
//!   per-tap products with no unfolding (its input gradient is the same
//!   thing with the flipped kernel). In f32 on CPUs with AVX-512 or AVX2
//!   these run as register-tiled kernels ([`direct`]), and 3×3 undilated
//!   layers of 16+ channels by Winograd's F(2×2, 3×3) ([`winograd`]);
//!   f64 and other CPUs take per-tap `gemm` products;
//! - anything else ([`im2col`]): the input unfolded one tile of output
//!   columns at a time.
//!
//! The rooms, bottom up: [`band`] (the padded input band every stride-1
//! path reads) and [`tiles`] (the instruction-set row kernels: the direct
//! register tiles and Winograd's transforms); then the algorithms
//! ([`pointwise`], [`shifted`], [`direct`], [`winograd`], [`im2col`]), which
//! never call each other; the choice among them is made here only
//! (`which`, `stride_one_forward`, `stride_one_weight`).
//!
//! As in PyTorch, padding takes part in the products as zeros: an infinite
//! weight or output gradient meets it as ∞ · 0 = NaN.
//!
//! Weight gradients are summed over the batch either in a fixed number of
//! partial sums added in a fixed order (small weights: the same bits for any
//! thread count) or split over blocks of input channels (large weights:
//! the order of the sums within a block depends on its size, so the last
//! bits may differ between thread counts).

mod band;
mod direct;
mod geom;
mod im2col;
mod params;
mod pointwise;
mod shifted;
mod tiles;
mod winograd;

pub use params::{Conv2dParams, ConvTranspose2dParams, Padding2d};

use crate::host_nn::vector::{level, Level};
use crate::host_nn::work::{check_len, for_each_unit, part, zeroed, SharedMut};
use crate::host_nn::{NnFloat, NnResult};
pub(crate) use geom::Geom;
use tiles::Kernels;

/// Target workspace per thread, in bytes.
pub(crate) const WORKSPACE_BYTES: usize = 1 << 20;

/// Weight gradients no larger than this many elements are summed over the
/// batch in [`BATCH_PARTS`] partial sums.
const SMALL_WEIGHT: usize = 1 << 16;
/// Partial sums of a small weight's gradient (a constant, so that the order
/// of the sums never depends on the thread count).
const BATCH_PARTS: usize = 8;

fn which(g: &Geom) -> Path {
    if g.kh == 1 && g.kw == 1 && g.sh == 1 && g.sw == 1 && g.pt == 0 && g.pl == 0 && g.oh == g.h && g.ow == g.w {
        Path::Pointwise
    } else if g.sh == 1 && g.sw == 1 {
        Path::Shifted
    } else {
        Path::Im2col
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Path {
    Pointwise,
    Shifted,
    Im2col,
}

// Which stride-1 algorithm computes a convolution: the f32 row kernels of
// this CPU (Winograd where it applies, else the direct tiles) or the
// per-tap products of `shifted` for everything else.

/// A stride-1 forward (and input gradient: the forward of the flipped
/// geometry).
fn stride_one_forward<T: NnFloat>(
    g: &Geom,
    input: &[T],
    tw: TapWeights<'_, T>,
    bias: Option<&[T]>,
    out: &mut [T],
    threads: usize,
) -> NnResult<()> {
    if let (Some(x), Some(o)) = (T::as_f32(input), T::as_f32_mut(out)) {
        #[cfg(target_arch = "x86_64")]
        match level() {
            Level::Avx512 => return forward_f32::<crate::host_nn::vector::Avx512, T>(g, x, tw, bias, o, threads),
            Level::Avx2 => return forward_f32::<crate::host_nn::vector::Avx2, T>(g, x, tw, bias, o, threads),
            Level::Portable => {}
        }
        let _ = (x, o);
    }
    shifted::forward(g, input, tw, bias, out, threads)
}

/// A stride-1 weight gradient of group `grp`'s input channels `c` over
/// images `n`, added to `acc`.
#[allow(clippy::too_many_arguments)]
fn stride_one_weight<T: NnFloat>(
    g: &Geom,
    input: &[T],
    dout: &[T],
    n: (usize, usize),
    grp: usize,
    c: (usize, usize),
    acc: &mut [T],
    ws: &mut Workspace<T>,
) -> NnResult<()> {
    if let (Some(x), Some(d), Some(a)) = (T::as_f32(input), T::as_f32(dout), T::as_f32_mut(acc)) {
        #[cfg(target_arch = "x86_64")]
        match level() {
            Level::Avx512 => return accumulate_weight_f32::<crate::host_nn::vector::Avx512, T>(g, x, d, n, grp, c, a, ws),
            Level::Avx2 => return accumulate_weight_f32::<crate::host_nn::vector::Avx2, T>(g, x, d, n, grp, c, a, ws),
            Level::Portable => {}
        }
        let _ = (x, d, a);
    }
    shifted::accumulate_weight(g, input, dout, n, grp, c, acc, ws)
}

/// The f32 forward: Winograd where it applies and the input is finite,
/// else the direct tiles.
fn forward_f32<I: Kernels, T: NnFloat>(
    g: &Geom,
    input: &[f32],
    tw: TapWeights<'_, T>,
    bias: Option<&[T]>,
    out: &mut [f32],
    threads: usize,
) -> NnResult<()> {
    if winograd::applies(g) && winograd::forward::<I, T>(g, input, tw, bias, out, threads)? {
        return Ok(());
    }
    direct::forward::<I, T>(g, input, tw, bias, out, threads)
}

/// The f32 weight gradient: Winograd where it applies and the values are
/// finite, else the direct tiles.
#[allow(clippy::too_many_arguments)]
fn accumulate_weight_f32<I: Kernels, T: NnFloat>(
    g: &Geom,
    input: &[f32],
    dout: &[f32],
    n: (usize, usize),
    grp: usize,
    c: (usize, usize),
    acc: &mut [f32],
    ws: &mut Workspace<T>,
) -> NnResult<()> {
    if winograd::applies(g) && winograd::accumulate_weight::<I, T>(g, input, dout, n, grp, c, acc, ws)? {
        return Ok(());
    }
    direct::accumulate_weight::<I, T>(g, input, dout, n, grp, c, acc, ws)
}

/// The weight of group `grp` at kernel tap `tap` as an `ocg × icg` matrix,
/// or for the flipped geometry (input gradient) the transposed matrix of
/// the mirrored tap.
#[derive(Clone, Copy)]
pub(crate) struct TapWeights<'a, T> {
    w: &'a [T],
    group_stride: usize,
    rs: usize,
    cs: usize,
    taps: usize,
    flip: bool,
}

impl<'a, T> TapWeights<'a, T> {
    fn plain(g: &Geom, w: &'a [T]) -> Self {
        TapWeights { w, group_stride: g.ocg * g.k_len(), rs: g.k_len(), cs: g.taps(), taps: g.taps(), flip: false }
    }
    /// For the flipped geometry of `g`.
    fn flipped(g: &Geom, w: &'a [T]) -> Self {
        TapWeights { w, group_stride: g.ocg * g.k_len(), rs: g.taps(), cs: g.k_len(), taps: g.taps(), flip: true }
    }
    pub(crate) fn matrix(&self, grp: usize, tap: usize) -> crate::host_nn::matmul::MatRef<'a, T> {
        let t = if self.flip { self.taps - 1 - tap } else { tap };
        crate::host_nn::matmul::MatRef { data: &self.w[grp * self.group_stride + t..], rs: self.rs, cs: self.cs }
    }
}

/// Refuses a geometry whose padded bands could not even be sized: a
/// dilated kernel that reaches across an enormous padding makes the rows of
/// a band (`ow + (kw − 1)·dw` wide) as long as the padded input even when
/// the output is small. The limit is far beyond anything that fits in memory.
fn check_reach(op: &'static str, g: &Geom) -> NnResult<()> {
    const LIMIT: usize = 1 << 56;
    let rows = g.oh.checked_add((g.kh - 1).saturating_mul(g.dh));
    let cols = g.ow.checked_add((g.kw - 1).saturating_mul(g.dw));
    let fits = rows
        .zip(cols)
        .and_then(|(r, c)| r.checked_mul(c))
        .and_then(|rc| rc.checked_mul(g.icg.max(g.ocg).max(1)))
        .and_then(|v| v.checked_mul(64))
        .is_some_and(|v| v <= LIMIT);
    if fits {
        Ok(())
    } else {
        Err(crate::host_nn::NnError::invalid(
            op,
            format!("the dilated kernel {}x{} (dilation {}x{}) spans more than can be computed", g.kh, g.kw, g.dh, g.dw),
        ))
    }
}

/// Forward of geometry `g` (bias added when given).
fn forward_geom<T: NnFloat>(g: &Geom, input: &[T], weight: &[T], bias: Option<&[T]>, out: &mut [T], threads: usize) -> NnResult<()> {
    if out.is_empty() {
        return Ok(());
    }
    check_reach("conv2d", g)?;
    if g.k_len() == 0 {
        // No input channels: the output is the bias alone.
        fill_bias(g, bias, out);
        return Ok(());
    }
    match which(g) {
        Path::Pointwise => pointwise::forward(g, input, weight, bias, out, threads),
        Path::Shifted => stride_one_forward(g, input, TapWeights::plain(g, weight), bias, out, threads),
        Path::Im2col => {
            im2col::forward(g, input, weight, out, threads)?;
            add_bias(g, bias, out);
            Ok(())
        }
    }
}

/// Input gradient of geometry `g`.
fn backward_input_geom<T: NnFloat>(g: &Geom, weight: &[T], dout: &[T], gin: &mut [T], threads: usize) -> NnResult<()> {
    if gin.is_empty() {
        return Ok(());
    }
    if g.ocg == 0 || g.out_plane() == 0 {
        gin.fill(T::ZERO);
        return Ok(());
    }
    check_reach("conv2d_backward", g)?;
    match which(g) {
        Path::Pointwise => pointwise::backward_input(g, weight, dout, gin, threads),
        Path::Shifted => stride_one_forward(&g.flipped(), dout, TapWeights::flipped(g, weight), None, gin, threads),
        Path::Im2col => im2col::backward_input(g, weight, dout, gin, threads),
    }
}

/// Weight gradient of geometry `g`: the batch summed either in a fixed
/// number of partial sums (small weights) or per block of input channels.
fn backward_weight_geom<T: NnFloat>(g: &Geom, input: &[T], dout: &[T], gw: &mut [T], threads: usize) -> NnResult<()> {
    const OP: &str = "conv2d_backward";
    if gw.is_empty() {
        return Ok(());
    }
    if g.n == 0 || g.out_plane() == 0 {
        gw.fill(T::ZERO);
        return Ok(());
    }
    check_reach(OP, g)?;
    let path = which(g);
    let (k_len, taps) = (g.k_len(), g.taps());
    let accumulate = |acc: &mut [T], ws: &mut Workspace<T>, n0: usize, n1: usize, grp: usize, c0: usize, c1: usize| -> NnResult<()> {
        match path {
            Path::Pointwise => pointwise::accumulate_weight(g, input, dout, (n0, n1), grp, (c0, c1), acc),
            Path::Shifted => stride_one_weight(g, input, dout, (n0, n1), grp, (c0, c1), acc, ws),
            Path::Im2col => im2col::accumulate_weight(g, input, dout, (n0, n1), grp, (c0, c1), acc, ws),
        }
    };
    if gw.len() <= SMALL_WEIGHT && g.n > 1 {
        // Fixed partial sums over the batch, added in order.
        let parts = BATCH_PARTS.min(g.n);
        let mut partials = zeroed::<T>(OP, parts * gw.len())?;
        let dst = SharedMut::new(&mut partials);
        let len = gw.len();
        for_each_unit(
            threads,
            parts,
            || Ok(Workspace::new()),
            |ws, u| {
                // SAFETY: unit u alone writes partial sum u.
                let acc = unsafe { dst.slice(u * len, len) };
                let r = part(g.n, parts, u);
                for grp in 0..g.groups {
                    accumulate(&mut acc[grp * g.ocg * k_len..(grp + 1) * g.ocg * k_len], ws, r.start, r.end, grp, 0, g.icg)?;
                }
                Ok(())
            },
        )?;
        gw.copy_from_slice(&partials[..len]);
        for p in 1..parts {
            for (d, &s) in gw.iter_mut().zip(&partials[p * len..(p + 1) * len]) {
                *d += s;
            }
        }
        return Ok(());
    }
    // Blocks of input channels, each summing the whole batch.
    let blocks = threads.div_ceil(g.groups).clamp(1, g.icg.max(1));
    let units = g.groups * blocks;
    let dst = SharedMut::new(gw);
    for_each_unit(
        threads,
        units,
        || Ok(Workspace::new()),
        |ws, u| {
            let (grp, b) = (u / blocks, u % blocks);
            let r = part(g.icg, blocks, b);
            let cb = r.len() * taps;
            if blocks == 1 {
                // SAFETY: unit u alone writes group grp's rows.
                let acc = unsafe { dst.slice(grp * g.ocg * k_len, g.ocg * k_len) };
                acc.fill(T::ZERO);
                return accumulate(acc, ws, 0, g.n, grp, r.start, r.end);
            }
            let mut acc = zeroed::<T>(OP, g.ocg * cb)?;
            accumulate(&mut acc, ws, 0, g.n, grp, r.start, r.end)?;
            for o in 0..g.ocg {
                // SAFETY: unit u alone writes channels r of group grp's rows.
                let row = unsafe { dst.slice((grp * g.ocg + o) * k_len + r.start * taps, cb) };
                row.copy_from_slice(&acc[o * cb..(o + 1) * cb]);
            }
            Ok(())
        },
    )
}

/// Buffers a thread keeps between its units of work (grown on demand,
/// fallibly).
pub(crate) struct Workspace<T> {
    bufs: [Vec<T>; 2],
    /// Offsets (the direct kernels' table of kernel taps).
    pub(crate) offsets: Vec<usize>,
}

impl<T: NnFloat> Workspace<T> {
    pub(crate) fn new() -> Self {
        Workspace { bufs: [Vec::new(), Vec::new()], offsets: Vec::new() }
    }
    /// Two buffers of at least `a` and `b` elements (contents unspecified).
    pub(crate) fn two(&mut self, a: usize, b: usize) -> NnResult<(&mut [T], &mut [T])> {
        Ok(self.two_and_offsets(a, b, 0)?.0)
    }
    /// Two buffers of at least `a` and `b` elements and an offset table of
    /// `n` entries (contents unspecified).
    #[allow(clippy::type_complexity)]
    pub(crate) fn two_and_offsets(&mut self, a: usize, b: usize, n: usize) -> NnResult<((&mut [T], &mut [T]), &mut [usize])> {
        for (buf, len) in self.bufs.iter_mut().zip([a, b]) {
            if buf.len() < len {
                *buf = zeroed("conv2d", len)?;
            }
        }
        if self.offsets.len() < n {
            self.offsets.clear();
            self.offsets.try_reserve_exact(n).map_err(|_| crate::host_nn::NnError::OutOfMemory {
                op: "conv2d",
                bytes: n.saturating_mul(std::mem::size_of::<usize>()),
            })?;
            self.offsets.resize(n, 0);
        }
        let [x, y] = &mut self.bufs;
        Ok(((&mut x[..a], &mut y[..b]), &mut self.offsets[..n]))
    }
}

fn fill_bias<T: NnFloat>(g: &Geom, bias: Option<&[T]>, out: &mut [T]) {
    let plane = g.out_plane();
    for (i, chunk) in out.chunks_mut(plane.max(1)).enumerate() {
        chunk.fill(bias.map_or(T::ZERO, |b| b[i % g.c_out()]));
    }
}

fn add_bias<T: NnFloat>(g: &Geom, bias: Option<&[T]>, out: &mut [T]) {
    let Some(b) = bias else { return };
    let plane = g.out_plane();
    for (i, chunk) in out.chunks_mut(plane.max(1)).enumerate() {
        let v = b[i % g.c_out()];
        chunk.iter_mut().for_each(|x| *x += v);
    }
}

/// Sum over the batch and the plane of each channel of `dout`
/// (`[n, channels, plane]`), one channel per unit.
fn bias_grad<T: NnFloat>(n: usize, channels: usize, plane: usize, dout: &[T], gb: &mut [T], threads: usize) -> NnResult<()> {
    let dst = SharedMut::new(gb);
    let threads = if n * channels * plane < 1 << 16 { 1 } else { threads };
    for_each_unit(
        threads,
        channels,
        || Ok(()),
        |_, c| {
            let mut total = 0.0f64;
            for i in 0..n {
                total += crate::host_nn::sums::sum(&dout[(i * channels + c) * plane..][..plane]);
            }
            // SAFETY: unit c alone writes element c.
            unsafe { dst.slice(c, 1)[0] = T::from_f64(total) };
            Ok(())
        },
    )
}

// ---- the public entry points ------------------------------------------------

fn check_bias<T>(op: &'static str, bias: Option<&[T]>, channels: usize) -> NnResult<()> {
    match bias {
        Some(b) => check_len(op, "bias", b.len(), channels),
        None => Ok(()),
    }
}

/// `output = conv2d(input, weight) + bias`, PyTorch's `F.conv2d`.
/// `input` is `p.input_shape()`, `weight` `p.weight_shape()`, `bias`
/// `[out_channels]`, `output` the shape [`Conv2dParams::validate`] returns.
pub fn conv2d_forward<T: NnFloat>(
    p: &Conv2dParams,
    input: &[T],
    weight: &[T],
    bias: Option<&[T]>,
    output: &mut [T],
    threads: usize,
) -> NnResult<()> {
    geom_forward(&p.geom(p.validate()?), input, weight, bias, output, threads)
}

// ---- the kernels over an explicit geometry ------------------------------------
//
// What `ops/conv/` runs: a transposed convolution's input may have fewer
// rows and columns than the windows of the convolution it transposes
// (output_padding ≥ stride), so its kernels take the geometry itself, not
// the convolution's arguments. Every slice is checked against the geometry
// before anything is read or written.

/// Forward of geometry `g`: `input` `[n, c_in, h, w]`, `weight` `[c_out,
/// icg, kh, kw]`, `output` `[n, c_out, oh, ow]`.
pub(crate) fn geom_forward<T: NnFloat>(
    g: &Geom,
    input: &[T],
    weight: &[T],
    bias: Option<&[T]>,
    output: &mut [T],
    threads: usize,
) -> NnResult<()> {
    const OP: &str = "conv2d";
    check_len(OP, "input", input.len(), g.input_len())?;
    check_len(OP, "weight", weight.len(), g.weight_len())?;
    check_bias(OP, bias, g.c_out())?;
    check_len(OP, "output", output.len(), g.output_len())?;
    forward_geom(g, input, weight, bias, output, threads)
}

/// Input gradient of geometry `g` (shapes as [`geom_forward`]'s).
pub(crate) fn geom_backward_input<T: NnFloat>(
    g: &Geom,
    weight: &[T],
    grad_output: &[T],
    grad_input: &mut [T],
    threads: usize,
) -> NnResult<()> {
    const OP: &str = "conv2d_backward";
    check_len(OP, "weight", weight.len(), g.weight_len())?;
    check_len(OP, "grad_output", grad_output.len(), g.output_len())?;
    check_len(OP, "grad_input", grad_input.len(), g.input_len())?;
    backward_input_geom(g, weight, grad_output, grad_input, threads)
}

/// Weight gradient of geometry `g` (shapes as [`geom_forward`]'s).
pub(crate) fn geom_backward_weight<T: NnFloat>(
    g: &Geom,
    input: &[T],
    grad_output: &[T],
    grad_weight: &mut [T],
    threads: usize,
) -> NnResult<()> {
    const OP: &str = "conv2d_backward";
    check_len(OP, "input", input.len(), g.input_len())?;
    check_len(OP, "grad_output", grad_output.len(), g.output_len())?;
    check_len(OP, "grad_weight", grad_weight.len(), g.weight_len())?;
    backward_weight_geom(g, input, grad_output, grad_weight, threads)
}

/// The gradient of [`conv2d_forward`] with respect to its input.
pub fn conv2d_backward_input<T: NnFloat>(
    p: &Conv2dParams,
    weight: &[T],
    grad_output: &[T],
    grad_input: &mut [T],
    threads: usize,
) -> NnResult<()> {
    geom_backward_input(&p.geom(p.validate()?), weight, grad_output, grad_input, threads)
}

/// The gradient of [`conv2d_forward`] with respect to its weight.
pub fn conv2d_backward_weight<T: NnFloat>(
    p: &Conv2dParams,
    input: &[T],
    grad_output: &[T],
    grad_weight: &mut [T],
    threads: usize,
) -> NnResult<()> {
    geom_backward_weight(&p.geom(p.validate()?), input, grad_output, grad_weight, threads)
}

/// The gradient of [`conv2d_forward`] with respect to its bias.
pub fn conv2d_backward_bias<T: NnFloat>(p: &Conv2dParams, grad_output: &[T], grad_bias: &mut [T], threads: usize) -> NnResult<()> {
    const OP: &str = "conv2d_backward";
    let out = p.validate()?;
    let g = p.geom(out);
    check_len(OP, "grad_output", grad_output.len(), g.output_len())?;
    check_len(OP, "grad_bias", grad_bias.len(), g.c_out())?;
    bias_grad(g.n, g.c_out(), g.out_plane(), grad_output, grad_bias, threads)
}

/// Every gradient of [`conv2d_forward`] that is asked for, in one call.
#[allow(clippy::too_many_arguments)]
pub fn conv2d_backward<T: NnFloat>(
    p: &Conv2dParams,
    input: &[T],
    weight: &[T],
    grad_output: &[T],
    grad_input: Option<&mut [T]>,
    grad_weight: Option<&mut [T]>,
    grad_bias: Option<&mut [T]>,
    threads: usize,
) -> NnResult<()> {
    if let Some(gi) = grad_input {
        conv2d_backward_input(p, weight, grad_output, gi, threads)?;
    }
    if let Some(gw) = grad_weight {
        conv2d_backward_weight(p, input, grad_output, gw, threads)?;
    }
    if let Some(gb) = grad_bias {
        conv2d_backward_bias(p, grad_output, gb, threads)?;
    }
    Ok(())
}

/// `output = conv_transpose2d(input, weight) + bias`, PyTorch's
/// `F.conv_transpose2d`: the input gradient of the convolution it
/// transposes. `weight` is `p.weight_shape()`.
pub fn conv_transpose2d_forward<T: NnFloat>(
    p: &ConvTranspose2dParams,
    input: &[T],
    weight: &[T],
    bias: Option<&[T]>,
    output: &mut [T],
    threads: usize,
) -> NnResult<()> {
    const OP: &str = "conv_transpose2d";
    let out = p.validate()?;
    let g = p.geom(out);
    check_len(OP, "input", input.len(), g.output_len())?;
    check_len(OP, "weight", weight.len(), g.weight_len())?;
    check_bias(OP, bias, g.c_in())?;
    check_len(OP, "output", output.len(), g.input_len())?;
    backward_input_geom(&g, weight, input, output, threads)?;
    if let Some(b) = bias {
        let plane = g.in_plane();
        for (i, chunk) in output.chunks_mut(plane.max(1)).enumerate() {
            let v = b[i % g.c_in()];
            chunk.iter_mut().for_each(|x| *x += v);
        }
    }
    Ok(())
}

/// Every gradient of [`conv_transpose2d_forward`] that is asked for.
#[allow(clippy::too_many_arguments)]
pub fn conv_transpose2d_backward<T: NnFloat>(
    p: &ConvTranspose2dParams,
    input: &[T],
    weight: &[T],
    grad_output: &[T],
    grad_input: Option<&mut [T]>,
    grad_weight: Option<&mut [T]>,
    grad_bias: Option<&mut [T]>,
    threads: usize,
) -> NnResult<()> {
    const OP: &str = "conv_transpose2d_backward";
    let out = p.validate()?;
    let g = p.geom(out);
    check_len(OP, "input", input.len(), g.output_len())?;
    check_len(OP, "weight", weight.len(), g.weight_len())?;
    check_len(OP, "grad_output", grad_output.len(), g.input_len())?;
    if let Some(gi) = grad_input {
        check_len(OP, "grad_input", gi.len(), g.output_len())?;
        forward_geom(&g, grad_output, weight, None, gi, threads)?;
    }
    if let Some(gw) = grad_weight {
        check_len(OP, "grad_weight", gw.len(), g.weight_len())?;
        backward_weight_geom(&g, grad_output, input, gw, threads)?;
    }
    if let Some(gb) = grad_bias {
        check_len(OP, "grad_bias", gb.len(), g.c_in())?;
        bias_grad(g.n, g.c_in(), g.in_plane(), grad_output, gb, threads)?;
    }
    Ok(())
}
