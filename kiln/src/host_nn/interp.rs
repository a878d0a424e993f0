//! `interpolate` in 2-D, nearest and bilinear, forward and backward, with
//! PyTorch's index rules: `nearest` takes `floor(o·scale)` computed in f32
//! (as PyTorch computes it for every dtype), bilinear the half-pixel or
//! corner-aligned source position. Planes are independent: the work is
//! split over them, so results never depend on the thread count.

use super::work::{check_len, for_each_unit, product, try_collect, SharedMut};
use super::{NnError, NnFloat, NnResult};

/// How outputs are made from the input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum InterpMode {
    /// The input element at `floor(o · in/out)` (PyTorch's `"nearest"`).
    Nearest,
    /// Bilinear between the four neighbours of the source position.
    Bilinear {
        /// Map the corner pixels' centres onto each other (`(in − 1)/(out − 1)`)
        /// instead of the images' edges.
        align_corners: bool,
    },
}

/// The arguments of a 2-D `interpolate` over an NCHW batch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct InterpParams {
    /// Images (0 is allowed).
    pub batch: usize,
    /// Channels (positive, as PyTorch requires).
    pub channels: usize,
    /// Height and width of the input.
    pub input: [usize; 2],
    /// Height and width of the output.
    pub output: [usize; 2],
    /// The interpolation.
    pub mode: InterpMode,
    /// PyTorch's `scale_factor` per axis when the caller gave one (and did
    /// not ask to recompute it): the source position then uses `1/scale`
    /// instead of `in/out`. None when an output size was given.
    pub scales: [Option<f64>; 2],
}

impl InterpParams {
    /// The output's shape, or why PyTorch would refuse these arguments.
    pub fn validate(&self) -> NnResult<[usize; 4]> {
        const OP: &str = "interpolate";
        if self.input.contains(&0) || self.output.contains(&0) {
            return Err(NnError::invalid(
                OP,
                format!("input and output sizes must be positive, got input {:?} and output {:?}", self.input, self.output),
            ));
        }
        if self.channels == 0 {
            return Err(NnError::invalid(OP, "the input has no channels: only the batch may be 0"));
        }
        let shape = [self.batch, self.channels, self.output[0], self.output[1]];
        product(OP, "the output shape", &shape)?;
        product(OP, "the input shape", &[self.batch, self.channels, self.input[0], self.input[1]])?;
        Ok(shape)
    }
}

/// PyTorch's `nearest` source index, in f32 whatever the dtype.
fn nearest_index(o: usize, input: usize, output: usize, scale: Option<f64>) -> usize {
    if output == input {
        o
    } else if output == 2 * input {
        o >> 1
    } else {
        let scale = match scale {
            Some(s) if s > 0.0 => (1.0 / s) as f32,
            _ => input as f32 / output as f32,
        };
        ((o as f32 * scale).floor() as usize).min(input - 1)
    }
}

/// One output position's two source indices and their weights.
#[derive(Clone, Copy)]
struct Taps<T> {
    i0: usize,
    i1: usize,
    l0: T,
    l1: T,
}

/// PyTorch's bilinear source indices and weights along one axis, computed
/// in `T` (its `opmath_t`).
fn linear_taps<T: NnFloat>(o: usize, input: usize, output: usize, align_corners: bool, scale: Option<f64>) -> Taps<T> {
    if output == input {
        return Taps { i0: o, i1: o, l0: T::ONE, l1: T::ZERO };
    }
    let ratio = if align_corners {
        if output > 1 {
            T::from_usize(input - 1) / T::from_usize(output - 1)
        } else {
            T::ZERO
        }
    } else {
        match scale {
            Some(s) if s > 0.0 => T::from_f64(1.0 / s),
            _ => T::from_usize(input) / T::from_usize(output),
        }
    };
    let real = if align_corners {
        ratio * T::from_usize(o)
    } else {
        let src = ratio * (T::from_usize(o) + T::from_f64(0.5)) - T::from_f64(0.5);
        if src < T::ZERO {
            T::ZERO
        } else {
            src
        }
    };
    // PyTorch floors through f32 (`floorf`) for every dtype.
    let i0 = ((real.to_f64() as f32).floor() as usize).min(input - 1);
    let l1 = (real - T::from_usize(i0)).max(T::ZERO).min(T::ONE);
    let i1 = if i0 < input - 1 { i0 + 1 } else { i0 };
    Taps { i0, i1, l0: T::ONE - l1, l1 }
}

/// Every plane of `src` (`in_len` each) to the same plane of `dst`.
fn over_planes<T: NnFloat>(
    planes: usize,
    (in_len, out_len): (usize, usize),
    src: &[T],
    dst: &mut [T],
    threads: usize,
    f: impl Fn(&[T], &mut [T]) + Sync,
) -> NnResult<()> {
    let per = ((1 << 14) / (in_len + out_len).max(1)).max(1);
    let out = SharedMut::new(dst);
    for_each_unit(
        threads,
        planes.div_ceil(per),
        || Ok(()),
        |_, u| {
            let (a, b) = (u * per, ((u + 1) * per).min(planes));
            // SAFETY: unit u alone writes planes a..b.
            let d = unsafe { out.slice(a * out_len, (b - a) * out_len) };
            for (i, o) in d.chunks_mut(out_len).enumerate() {
                f(&src[(a + i) * in_len..(a + i + 1) * in_len], o);
            }
            Ok(())
        },
    )
}

/// `interpolate` forward.
pub fn interpolate_forward<T: NnFloat>(p: &InterpParams, input: &[T], output: &mut [T], threads: usize) -> NnResult<()> {
    const OP: &str = "interpolate";
    let [n, c, oh, ow] = p.validate()?;
    let [h, w] = p.input;
    check_len(OP, "input", input.len(), n * c * h * w)?;
    check_len(OP, "output", output.len(), n * c * oh * ow)?;
    if output.is_empty() {
        return Ok(());
    }
    match p.mode {
        InterpMode::Nearest => over_planes(n * c, (h * w, oh * ow), input, output, threads, |src, dst| {
            for oy in 0..oh {
                let row = &src[nearest_index(oy, h, oh, p.scales[0]) * w..][..w];
                for (ox, d) in dst[oy * ow..(oy + 1) * ow].iter_mut().enumerate() {
                    *d = row[nearest_index(ox, w, ow, p.scales[1])];
                }
            }
        }),
        InterpMode::Bilinear { align_corners } => {
            let cols = try_collect(OP, ow, |ox| linear_taps::<T>(ox, w, ow, align_corners, p.scales[1]))?;
            over_planes(n * c, (h * w, oh * ow), input, output, threads, |src, dst| {
                for oy in 0..oh {
                    let t = linear_taps::<T>(oy, h, oh, align_corners, p.scales[0]);
                    let (r0, r1) = (&src[t.i0 * w..][..w], &src[t.i1 * w..][..w]);
                    for (d, cx) in dst[oy * ow..(oy + 1) * ow].iter_mut().zip(&cols) {
                        let top = r0[cx.i0] * cx.l0 + r0[cx.i1] * cx.l1;
                        let bottom = r1[cx.i0] * cx.l0 + r1[cx.i1] * cx.l1;
                        *d = top * t.l0 + bottom * t.l1;
                    }
                }
            })
        }
    }
}

/// The gradient of [`interpolate_forward`] with respect to its input.
pub fn interpolate_backward<T: NnFloat>(p: &InterpParams, grad_output: &[T], grad_input: &mut [T], threads: usize) -> NnResult<()> {
    const OP: &str = "interpolate_backward";
    let [n, c, oh, ow] = p.validate()?;
    let [h, w] = p.input;
    check_len(OP, "grad_output", grad_output.len(), n * c * oh * ow)?;
    check_len(OP, "grad_input", grad_input.len(), n * c * h * w)?;
    if grad_input.is_empty() {
        return Ok(());
    }
    match p.mode {
        InterpMode::Nearest => over_planes(n * c, (oh * ow, h * w), grad_output, grad_input, threads, |src, dst| {
            dst.fill(T::ZERO);
            for oy in 0..oh {
                let iy = nearest_index(oy, h, oh, p.scales[0]);
                for ox in 0..ow {
                    dst[iy * w + nearest_index(ox, w, ow, p.scales[1])] += src[oy * ow + ox];
                }
            }
        }),
        InterpMode::Bilinear { align_corners } => {
            let cols = try_collect(OP, ow, |ox| linear_taps::<T>(ox, w, ow, align_corners, p.scales[1]))?;
            over_planes(n * c, (oh * ow, h * w), grad_output, grad_input, threads, |src, dst| {
                dst.fill(T::ZERO);
                for oy in 0..oh {
                    let t = linear_taps::<T>(oy, h, oh, align_corners, p.scales[0]);
                    for (ox, cx) in cols.iter().enumerate() {
                        let g = src[oy * ow + ox];
                        dst[t.i0 * w + cx.i0] += t.l0 * cx.l0 * g;
                        dst[t.i0 * w + cx.i1] += t.l0 * cx.l1 * g;
                        dst[t.i1 * w + cx.i0] += t.l1 * cx.l0 * g;
                        dst[t.i1 * w + cx.i1] += t.l1 * cx.l1 * g;
                    }
                }
            })
        }
    }
}
