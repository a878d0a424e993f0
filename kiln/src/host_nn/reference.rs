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
