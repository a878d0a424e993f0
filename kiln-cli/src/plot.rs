//! PNG plots with plotters: Ex1's GFLOP/s against matrix size, and the
//! training curves of `kiln train`.

use crate::fail;
use crate::util::Result;
use plotters::prelude::*;
use std::path::Path;

const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

type DrawResult = std::result::Result<(), Box<dyn std::error::Error>>;

/// Draws GFLOP/s against matrix size (log2 axis), one line per device.
pub fn gflops_vs_size(path: &Path, series: &[(String, Vec<(usize, f64)>)], threads: usize) -> Result<()> {
    const SIZE: (u32, u32) = (900, 600);
    let draw = |labels: bool, rgb: &mut [u8]| -> DrawResult {
        let root = BitMapBackend::with_buffer(rgb, SIZE).into_drawing_area();
        root.fill(&WHITE)?;
        let max_size = series.iter().flat_map(|(_, p)| p.iter().map(|q| q.0)).max().unwrap_or(16).max(32);
        let min_size = series.iter().flat_map(|(_, p)| p.iter().map(|q| q.0)).min().unwrap_or(16).min(max_size / 2).max(1);
        let max_rate = series.iter().flat_map(|(_, p)| p.iter().map(|q| q.1)).fold(1.0f64, f64::max) * 1.1;
        let (lo, hi) = ((min_size as f64).log2(), (max_size as f64).log2());
        let mut builder = ChartBuilder::on(&root);
        builder.margin(20);
        if labels {
            builder
                .caption(format!("kiln bench Ex1: matmul GFLOP/s by size ({threads} CPU thread(s))"), ("sans-serif", 24))
                .x_label_area_size(45)
                .y_label_area_size(60);
        }
        let mut chart = builder.build_cartesian_2d(lo..hi, 0f64..max_rate)?;
        if labels {
            chart
                .configure_mesh()
                .x_desc("matrix size n (n x n @ n x n, f32)")
                .y_desc("GFLOP/s")
                .x_labels((hi - lo) as usize + 1)
                .x_label_formatter(&|v| format!("{}", 2f64.powf(v.round()) as usize))
                .draw()?;
        } else {
            chart.configure_mesh().disable_x_mesh().disable_y_mesh().x_labels(0).y_labels(0).draw()?;
        }
        for (i, (name, points)) in series.iter().enumerate() {
            let color = COLORS[i % COLORS.len()];
            let pts: Vec<(f64, f64)> = points.iter().map(|&(s, r)| ((s as f64).log2(), r)).collect();
            let line = chart.draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))?;
            if labels {
                line.label(name.clone()).legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
            }
            chart.draw_series(pts.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
        }
        if labels {
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .position(SeriesLabelPosition::UpperLeft)
                .draw()?;
        }
        root.present()?;
        Ok(())
    };
    save(path, SIZE, draw)
}

/// Draws training curves: each named series against the epoch, on one chart per metric group.
pub fn curves(path: &Path, title: &str, left: &[(String, Vec<f64>)], right: &[(String, Vec<f64>)]) -> Result<()> {
    const SIZE: (u32, u32) = (1000, 450);
    let draw = |labels: bool, rgb: &mut [u8]| -> DrawResult {
        let root = BitMapBackend::with_buffer(rgb, SIZE).into_drawing_area();
        root.fill(&WHITE)?;
        let areas = root.split_evenly((1, 2));
        for (area, (group, desc)) in areas.iter().zip([(left, "loss"), (right, "accuracy")]) {
            let epochs = group.iter().map(|(_, v)| v.len()).max().unwrap_or(1).max(2);
            let ymax = if desc == "accuracy" {
                1.0
            } else {
                group.iter().flat_map(|(_, v)| v.iter().copied()).filter(|v| v.is_finite()).fold(0.0f64, f64::max).max(1e-3) * 1.1
            };
            let mut builder = ChartBuilder::on(area);
            builder.margin(15);
            if labels {
                builder.caption(format!("{title}: {desc}"), ("sans-serif", 20)).x_label_area_size(40).y_label_area_size(55);
            }
            let mut chart = builder.build_cartesian_2d(1f64..epochs as f64, 0f64..ymax)?;
            if labels {
                chart.configure_mesh().x_desc("epoch").y_desc(desc).draw()?;
            } else {
                chart.configure_mesh().x_labels(0).y_labels(0).draw()?;
            }
            for (i, (name, values)) in group.iter().enumerate() {
                let color = COLORS[i % COLORS.len()];
                let pts: Vec<(f64, f64)> = values.iter().enumerate().map(|(e, &v)| ((e + 1) as f64, v)).collect();
                chart.draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
                let line = chart.draw_series(LineSeries::new(pts, color.stroke_width(2)))?;
                if labels {
                    line.label(name.clone()).legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
                }
            }
            if labels && !group.is_empty() {
                chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
            }
        }
        root.present()?;
        Ok(())
    };
    save(path, SIZE, draw)
}

/// Draws into memory with text in kiln's bundled font, or without text
/// should that font fail to load, so that a plot is always written; then
/// writes the PNG (`kiln::io::write_png_rgb`).
fn save(path: &Path, (width, height): (u32, u32), draw: impl Fn(bool, &mut [u8]) -> DrawResult) -> Result<()> {
    kiln::trainer::register_plot_font();
    let mut rgb = vec![0u8; width as usize * height as usize * 3];
    match draw(true, &mut rgb) {
        Ok(()) => {}
        Err(first) => {
            rgb.fill(0);
            match draw(false, &mut rgb) {
                Ok(()) => eprintln!("kiln: drew {} without text ({first})", path.display()),
                Err(e) => return Err(fail!("cannot draw the plot {}: {e}", path.display())),
            }
        }
    }
    kiln::io::write_png_rgb(path, width, height, &rgb).map_err(|e| fail!("cannot write the plot: {e}"))
}
