//! Naive direct-loop definitions of every op, in f64, written from the
//! formulas and not from the fast kernels: what the tests compare against.

#![allow(clippy::too_many_arguments, clippy::needless_range_loop)]

use super::{Conv2dParams, ConvTranspose2dParams};

/// Input row/column of output index `o` at tap `k`, when inside.
fn src(o: usize, k: usize, stride: usize, dil: usize, pad: usize, size: usize) -> Option<usize> {
    let v = (o * stride + k * dil) as isize - pad as isize;
    (v >= 0 && (v as usize) < size).then_some(v as usize)
}

/// conv2d forward; returns the output.
pub fn conv2d(p: &Conv2dParams, x: &[f64], w: &[f64], b: Option<&[f64]>) -> Vec<f64> {
    let [n, oc, oh, ow] = p.validate().unwrap();
    let (ic, [h, wd], [kh, kw], g) = (p.in_channels, p.input, p.kernel, p.groups);
    let (icg, ocg) = (ic / g, oc / g);
    let mut out = vec![0.0; n * oc * oh * ow];
    for i in 0..n {
        for o in 0..oc {
            let grp = o / ocg;
            for y in 0..oh {
                for xx in 0..ow {
                    let mut acc = b.map_or(0.0, |b| b[o]);
                    for c in 0..icg {
                        for ky in 0..kh {
                            let Some(iy) = src(y, ky, p.stride[0], p.dilation[0], p.padding.top, h) else { continue };
                            for kx in 0..kw {
                                let Some(ix) = src(xx, kx, p.stride[1], p.dilation[1], p.padding.left, wd) else { continue };
                                acc += x[((i * ic + grp * icg + c) * h + iy) * wd + ix] * w[((o * icg + c) * kh + ky) * kw + kx];
                            }
                        }
                    }
                    out[((i * oc + o) * oh + y) * ow + xx] = acc;
                }
            }
        }
    }
    out
}

/// conv2d backward: (grad input, grad weight, grad bias).
pub fn conv2d_backward(p: &Conv2dParams, x: &[f64], w: &[f64], dy: &[f64]) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let [n, oc, oh, ow] = p.validate().unwrap();
    let (ic, [h, wd], [kh, kw], g) = (p.in_channels, p.input, p.kernel, p.groups);
    let (icg, ocg) = (ic / g, oc / g);
    let mut gx = vec![0.0; x.len()];
    let mut gw = vec![0.0; w.len()];
    let mut gb = vec![0.0; oc];
    for i in 0..n {
        for o in 0..oc {
            let grp = o / ocg;
            for y in 0..oh {
                for xx in 0..ow {
                    let d = dy[((i * oc + o) * oh + y) * ow + xx];
                    gb[o] += d;
                    for c in 0..icg {
                        for ky in 0..kh {
                            let Some(iy) = src(y, ky, p.stride[0], p.dilation[0], p.padding.top, h) else { continue };
                            for kx in 0..kw {
                                let Some(ix) = src(xx, kx, p.stride[1], p.dilation[1], p.padding.left, wd) else { continue };
                                let xi = ((i * ic + grp * icg + c) * h + iy) * wd + ix;
                                let wi = ((o * icg + c) * kh + ky) * kw + kx;
                                gx[xi] += d * w[wi];
                                gw[wi] += d * x[xi];
                            }
                        }
                    }
                }
            }
        }
    }
    (gx, gw, gb)
}

/// conv_transpose2d forward from its own definition: every input element
/// scatters `x · w` into the output.
pub fn conv_transpose2d(p: &ConvTranspose2dParams, x: &[f64], w: &[f64], b: Option<&[f64]>) -> Vec<f64> {
    let [n, oc, oh, ow] = p.validate().unwrap();
    let (ic, [h, wd], [kh, kw], g) = (p.in_channels, p.input, p.kernel, p.groups);
    let (icg, ocg) = (ic / g, oc / g);
    let mut out = vec![0.0; n * oc * oh * ow];
    for i in 0..n {
        for o in 0..oc {
            let v = b.map_or(0.0, |b| b[o]);
            out[(i * oc + o) * oh * ow..(i * oc + o + 1) * oh * ow].fill(v);
        }
        for c in 0..ic {
            let grp = c / icg;
            for y in 0..h {
                for xx in 0..wd {
                    let v = x[((i * ic + c) * h + y) * wd + xx];
                    for o in 0..ocg {
                        for ky in 0..kh {
                            let Some(oy) = src(y, ky, p.stride[0], p.dilation[0], p.padding[0], oh) else { continue };
                            for kx in 0..kw {
                                let Some(ox) = src(xx, kx, p.stride[1], p.dilation[1], p.padding[1], ow) else { continue };
                                out[((i * oc + grp * ocg + o) * oh + oy) * ow + ox] += v * w[((c * ocg + o) * kh + ky) * kw + kx];
                            }
                        }
                    }
                }
            }
        }
    }
    out
}

/// conv_transpose2d backward: (grad input, grad weight, grad bias).
pub fn conv_transpose2d_backward(p: &ConvTranspose2dParams, x: &[f64], w: &[f64], dy: &[f64]) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let [n, oc, oh, ow] = p.validate().unwrap();
    let (ic, [h, wd], [kh, kw], g) = (p.in_channels, p.input, p.kernel, p.groups);
    let (icg, ocg) = (ic / g, oc / g);
    let mut gx = vec![0.0; x.len()];
    let mut gw = vec![0.0; w.len()];
    let mut gb = vec![0.0; oc];
    for i in 0..n {
        for o in 0..oc {
            gb[o] += dy[(i * oc + o) * oh * ow..(i * oc + o + 1) * oh * ow].iter().sum::<f64>();
        }
        for c in 0..ic {
            let grp = c / icg;
            for y in 0..h {
                for xx in 0..wd {
                    let xi = ((i * ic + c) * h + y) * wd + xx;
                    for o in 0..ocg {
                        for ky in 0..kh {
                            let Some(oy) = src(y, ky, p.stride[0], p.dilation[0], p.padding[0], oh) else { continue };
                            for kx in 0..kw {
                                let Some(ox) = src(xx, kx, p.stride[1], p.dilation[1], p.padding[1], ow) else { continue };
                                let d = dy[((i * oc + grp * ocg + o) * oh + oy) * ow + ox];
                                let wi = ((c * ocg + o) * kh + ky) * kw + kx;
                                gx[xi] += d * w[wi];
                                gw[wi] += d * x[xi];
                            }
                        }
                    }
                }
            }
        }
    }
    (gx, gw, gb)
}

// ---- pooling ----------------------------------------------------------------

/// The input positions a pooling window covers along one axis (None for
/// padding).
fn taps(o: usize, stride: usize, pad: usize, dil: usize, kernel: usize, size: usize) -> Vec<Option<usize>> {
    (0..kernel)
        .map(|k| {
            let v = (o * stride + k * dil) as isize - pad as isize;
            (v >= 0 && (v as usize) < size).then_some(v as usize)
        })
        .collect()
}

/// max_pool2d: (output, indices). A NaN anywhere in the window wins (the
/// last one), else the largest value (the first of ties), else (all −∞)
/// the first element of the window inside the input; a window with no
/// element inside is −∞ at PyTorch's index (its first row and column at or
/// after 0, wherever they are).
pub fn max_pool2d(p: &super::MaxPool2dParams, x: &[f64]) -> (Vec<f64>, Vec<i64>) {
    let [n, c, oh, ow] = p.validate().unwrap();
    let [h, w] = p.input;
    let (mut out, mut idx) = (vec![0.0; n * c * oh * ow], vec![0i64; n * c * oh * ow]);
    for pl in 0..n * c {
        for oy in 0..oh {
            for ox in 0..ow {
                let mut cells = vec![];
                for iy in taps(oy, p.stride[0], p.padding[0], p.dilation[0], p.kernel[0], h).into_iter().flatten() {
                    for ix in taps(ox, p.stride[1], p.padding[1], p.dilation[1], p.kernel[1], w).into_iter().flatten() {
                        cells.push((iy * w + ix, x[pl * h * w + iy * w + ix]));
                    }
                }
                let first = |o: usize, s: usize, pad: usize, d: usize| {
                    let mut v = (o * s) as isize - pad as isize;
                    while v < 0 {
                        v += d as isize;
                    }
                    v as usize
                };
                let empty_at =
                    first(oy, p.stride[0], p.padding[0], p.dilation[0]) * w + first(ox, p.stride[1], p.padding[1], p.dilation[1]);
                let pick = if cells.is_empty() {
                    (empty_at, f64::NEG_INFINITY)
                } else if let Some(&nan) = cells.iter().rev().find(|c| c.1.is_nan()) {
                    nan
                } else {
                    let best = cells.iter().fold(f64::NEG_INFINITY, |m, c| m.max(c.1));
                    cells.iter().copied().find(|c| c.1 == best).unwrap_or((cells.first().map_or(0, |c| c.0), f64::NEG_INFINITY))
                };
                out[pl * oh * ow + oy * ow + ox] = pick.1;
                idx[pl * oh * ow + oy * ow + ox] = pick.0 as i64;
            }
        }
    }
    (out, idx)
}

/// avg_pool2d forward and the weight each input element gets from each
/// output (for the backward): (output, grad_input for `dy`).
pub fn avg_pool2d(p: &super::AvgPool2dParams, x: &[f64], dy: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let [n, c, oh, ow] = p.validate().unwrap();
    let [h, w] = p.input;
    let (mut out, mut gx) = (vec![0.0; n * c * oh * ow], vec![0.0; x.len()]);
    for pl in 0..n * c {
        for oy in 0..oh {
            for ox in 0..ow {
                // The window in padded coordinates, cut at the far padding edge.
                let ys: Vec<isize> = (0..p.kernel[0] as isize)
                    .map(|k| (oy * p.stride[0]) as isize - p.padding[0] as isize + k)
                    .filter(|&v| v < (h + p.padding[0]) as isize)
                    .collect();
                let xs: Vec<isize> = (0..p.kernel[1] as isize)
                    .map(|k| (ox * p.stride[1]) as isize - p.padding[1] as isize + k)
                    .filter(|&v| v < (w + p.padding[1]) as isize)
                    .collect();
                let inside = |v: isize, size: usize| v >= 0 && (v as usize) < size;
                let cells: Vec<(usize, usize)> = ys
                    .iter()
                    .filter(|&&y| inside(y, h))
                    .flat_map(|&y| xs.iter().filter(|&&x| inside(x, w)).map(move |&x| (y as usize, x as usize)))
                    .collect();
                if cells.is_empty() {
                    continue;
                }
                let div = match p.divisor_override {
                    Some(d) => d as f64,
                    None if p.count_include_pad => (ys.len() * xs.len()) as f64,
                    None => cells.len() as f64,
                };
                let o = pl * oh * ow + oy * ow + ox;
                out[o] = cells.iter().map(|&(y, xx)| x[pl * h * w + y * w + xx]).sum::<f64>() / div;
                for &(y, xx) in &cells {
                    gx[pl * h * w + y * w + xx] += dy[o] / div;
                }
            }
        }
    }
    (out, gx)
}

/// adaptive_avg_pool2d: (output, grad_input for `dy`).
pub fn adaptive_avg_pool2d(p: &super::AdaptivePool2dParams, x: &[f64], dy: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let [n, c, oh, ow] = p.validate().unwrap();
    let [h, w] = p.input;
    let range = |o: usize, out: usize, size: usize| (o * size / out)..((o + 1) * size).div_ceil(out);
    let (mut out, mut gx) = (vec![0.0; n * c * oh * ow], vec![0.0; x.len()]);
    for pl in 0..n * c {
        for oy in 0..oh {
            for ox in 0..ow {
                let (ys, xs) = (range(oy, oh, h), range(ox, ow, w));
                let cnt = (ys.len() * xs.len()) as f64;
                let o = pl * oh * ow + oy * ow + ox;
                for y in ys {
                    for xx in xs.clone() {
                        out[o] += x[pl * h * w + y * w + xx] / cnt;
                        gx[pl * h * w + y * w + xx] += dy[o] / cnt;
                    }
                }
            }
        }
    }
    (out, gx)
}

// ---- normalisation ----------------------------------------------------------

/// Normalises groups of values: `groups[g]` lists the indices of group g;
/// returns (y, mean, invstd) with `y = (x − mean)·invstd·w + b` and the
/// gradients (dx, dw, db) for `dy` of the training-mode function, where
/// `param[i]` is the weight/bias index of element i.
#[allow(clippy::type_complexity)]
pub fn normalise(
    x: &[f64],
    groups: &[Vec<usize>],
    param: &dyn Fn(usize) -> usize,
    w: &[f64],
    b: &[f64],
    eps: f64,
    dy: &[f64],
) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
    let (mut y, mut dx) = (vec![0.0; x.len()], vec![0.0; x.len()]);
    let (mut dw, mut db) = (vec![0.0; w.len()], vec![0.0; b.len()]);
    let (mut means, mut invs) = (vec![], vec![]);
    for g in groups {
        let n = g.len() as f64;
        let mean = g.iter().map(|&i| x[i]).sum::<f64>() / n;
        let var = g.iter().map(|&i| (x[i] - mean).powi(2)).sum::<f64>() / n;
        let inv = 1.0 / (var + eps).sqrt();
        means.push(mean);
        invs.push(inv);
        // x̂ = (x − mean)·inv; y = x̂·w + b; with g_i = dy_i·w_i:
        // dx = inv·(g − mean(g) − x̂·mean(g·x̂))
        let xhat: Vec<f64> = g.iter().map(|&i| (x[i] - mean) * inv).collect();
        let gg: Vec<f64> = g.iter().map(|&i| dy[i] * w[param(i)]).collect();
        let mg = gg.iter().sum::<f64>() / n;
        let mgx = gg.iter().zip(&xhat).map(|(a, b)| a * b).sum::<f64>() / n;
        for (k, &i) in g.iter().enumerate() {
            y[i] = xhat[k] * w[param(i)] + b[param(i)];
            dx[i] = inv * (gg[k] - mg - xhat[k] * mgx);
            dw[param(i)] += dy[i] * xhat[k];
            db[param(i)] += dy[i];
        }
    }
    (y, means, invs, dx, dw, db)
}

// ---- interpolation ----------------------------------------------------------

/// interpolate: (output, grad_input for `dy`), from the source-position
/// formulas.
pub fn interpolate(p: &super::InterpParams, x: &[f64], dy: &[f64], f32_positions: bool) -> (Vec<f64>, Vec<f64>) {
    let [n, c, oh, ow] = p.validate().unwrap();
    let [h, w] = p.input;
    // (index, weight) pairs of output o along an axis.
    let axis = |o: usize, size: usize, out: usize, scale: Option<f64>| -> Vec<(usize, f64)> {
        match p.mode {
            super::InterpMode::Nearest => {
                if out == size {
                    return vec![(o, 1.0)];
                }
                if out == 2 * size {
                    return vec![(o / 2, 1.0)];
                }
                let s = scale.filter(|&s| s > 0.0).map_or(size as f32 / out as f32, |s| (1.0 / s) as f32);
                vec![(((o as f32 * s).floor() as usize).min(size - 1), 1.0)]
            }
            super::InterpMode::Bilinear { align_corners } => {
                if out == size {
                    return vec![(o, 1.0)];
                }
                let round = |v: f64| if f32_positions { v as f32 as f64 } else { v };
                let ratio = if align_corners {
                    if out > 1 {
                        round((size - 1) as f64 / (out - 1) as f64)
                    } else {
                        0.0
                    }
                } else {
                    round(scale.filter(|&s| s > 0.0).map_or(size as f64 / out as f64, |s| 1.0 / s))
                };
                let src = if align_corners { ratio * o as f64 } else { (ratio * (o as f64 + 0.5) - 0.5).max(0.0) };
                let i0 = (src.floor() as usize).min(size - 1);
                let i1 = (i0 + 1).min(size - 1);
                let l1 = (src - i0 as f64).clamp(0.0, 1.0);
                vec![(i0, 1.0 - l1), (i1, l1)]
            }
        }
    };
    let (mut out, mut gx) = (vec![0.0; n * c * oh * ow], vec![0.0; x.len()]);
    for pl in 0..n * c {
        for oy in 0..oh {
            for ox in 0..ow {
                let o = pl * oh * ow + oy * ow + ox;
                for (iy, wy) in axis(oy, h, oh, p.scales[0]) {
                    for (ix, wx) in axis(ox, w, ow, p.scales[1]) {
                        out[o] += wy * wx * x[pl * h * w + iy * w + ix];
                        gx[pl * h * w + iy * w + ix] += wy * wx * dy[o];
                    }
                }
            }
        }
    }
    (out, gx)
}
