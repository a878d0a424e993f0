//! Max, average and adaptive average pooling over NCHW planes, forward and
//! backward, with PyTorch's window rules. Planes are independent: the work
//! is split over them, so results never depend on the thread count.

use super::work::{check_len, for_each_unit, product, SharedMut};
use super::{NnError, NnFloat, NnResult};

/// Windows of `kernel` (dilated) every `stride` over `size` elements padded
/// by `pad` on both sides, as PyTorch counts them (ceil_mode keeps a last
/// window that starts inside the input or the left padding).
fn pool_out(size: usize, kernel: usize, pad: usize, stride: usize, dilation: usize, ceil: bool) -> Option<usize> {
    // In i128 with checked steps: every term of usizes fits, a product of two may not.
    let (size, kernel, pad, stride, dilation) = (size as i128, kernel as i128, pad as i128, stride as i128, dilation as i128);
    let span = dilation.checked_mul(kernel - 1)?;
    let num = (size + 2 * pad).checked_sub(span)? - 1 + if ceil { stride - 1 } else { 0 };
    let mut out = num.div_euclid(stride) + 1;
    if ceil && (out - 1).checked_mul(stride)? >= size + pad {
        out -= 1;
    }
    (out >= 1 && out <= (isize::MAX as i128) / 4).then_some(out as usize)
}

#[allow(clippy::too_many_arguments)]
fn pool_shape(
    op: &'static str,
    [n, c]: [usize; 2],
    input: [usize; 2],
    kernel: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
    ceil: bool,
) -> NnResult<[usize; 4]> {
    if kernel.contains(&0) {
        return Err(NnError::invalid(op, format!("kernel_size must be positive, got {kernel:?}")));
    }
    if stride.contains(&0) {
        return Err(NnError::invalid(op, format!("stride must be positive, got {stride:?}")));
    }
    if dilation.contains(&0) {
        return Err(NnError::invalid(op, format!("dilation must be positive, got {dilation:?}")));
    }
    if c == 0 || input.contains(&0) {
        return Err(NnError::invalid(op, format!("the input [{n}, {c}, {}, {}] is empty: only the batch may be 0", input[0], input[1])));
    }
    if padding[0] > kernel[0] / 2 || padding[1] > kernel[1] / 2 {
        return Err(NnError::invalid(op, format!("padding {padding:?} must be at most half the kernel_size {kernel:?}")));
    }
    let mut out = [0usize; 2];
    for i in 0..2 {
        out[i] = pool_out(input[i], kernel[i], padding[i], stride[i], dilation[i], ceil).ok_or_else(|| {
            NnError::invalid(
                op,
                format!(
                    "input {input:?} with kernel_size {kernel:?}, stride {stride:?}, padding {padding:?} and dilation {dilation:?} \
                     gives an output smaller than 1"
                ),
            )
        })?;
    }
    let shape = [n, c, out[0], out[1]];
    product(op, "the output shape", &shape)?;
    product(op, "the input shape", &[n, c, input[0], input[1]])?;
    Ok(shape)
}

/// Planes per unit of work: enough elements per task to pay for it.
fn planes_per_unit(plane_work: usize) -> usize {
    ((1 << 14) / plane_work.max(1)).max(1)
}

/// Runs `f(plane_index, in_plane, out_plane)` over every (image, channel)
/// plane, split over threads in runs of planes.
fn over_planes<T: NnFloat, U: Copy + Send + Sync>(
    planes: usize,
    in_len: usize,
    out_len: usize,
    src: &[U],
    dst: &mut [T],
    threads: usize,
    f: impl Fn(&[U], &mut [T]) + Sync,
) -> NnResult<()> {
    let per = planes_per_unit(in_len + out_len);
    let units = planes.div_ceil(per);
    let out = SharedMut::new(dst);
    for_each_unit(
        threads,
        units,
        || Ok(()),
        |_, u| {
            let (a, b) = (u * per, ((u + 1) * per).min(planes));
            // SAFETY: unit u alone writes planes a..b of the output.
            let d = unsafe { out.slice(a * out_len, (b - a) * out_len) };
            for (i, o) in d.chunks_mut(out_len.max(1)).enumerate() {
                f(&src[(a + i) * in_len..(a + i + 1) * in_len], o);
            }
            Ok(())
        },
    )
}

// ---- max pooling ------------------------------------------------------------

/// The arguments of `max_pool2d` over an NCHW batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MaxPool2dParams {
    /// Images (0 is allowed).
    pub batch: usize,
    /// Channels.
    pub channels: usize,
    /// Height and width of the input.
    pub input: [usize; 2],
    /// Window height and width.
    pub kernel: [usize; 2],
    /// Window step (PyTorch's default is the kernel size).
    pub stride: [usize; 2],
    /// Implicit −∞ padding on both sides, at most half the kernel.
    pub padding: [usize; 2],
    /// Spacing of the window's elements.
    pub dilation: [usize; 2],
    /// Count a last partial window (PyTorch's `ceil_mode`).
    pub ceil_mode: bool,
}

impl MaxPool2dParams {
    /// The output's shape `[batch, channels, out_h, out_w]`, or why PyTorch
    /// would refuse these arguments.
    pub fn validate(&self) -> NnResult<[usize; 4]> {
        pool_shape(
            "max_pool2d",
            [self.batch, self.channels],
            self.input,
            self.kernel,
            self.stride,
            self.padding,
            self.dilation,
            self.ceil_mode,
        )
    }
}

/// `max_pool2d` with indices: each output is the largest element of its
/// window, and `indices` its position `y·w + x` within the input plane, as
/// PyTorch's `return_indices=True`. The first of equal maxima wins; a NaN
/// wins over everything, the last NaN of the window if several. A window
/// that covers no input element (a dilation that steps over the input) is
/// −∞ with PyTorch's index, `first_row·w + first_column`, which may lie
/// outside the plane.
pub fn max_pool2d_forward<T: NnFloat>(
    p: &MaxPool2dParams,
    input: &[T],
    output: &mut [T],
    indices: &mut [i64],
    threads: usize,
) -> NnResult<()> {
    const OP: &str = "max_pool2d";
    let [n, c, oh, ow] = p.validate()?;
    let (h, w) = (p.input[0], p.input[1]);
    check_len(OP, "input", input.len(), n * c * h * w)?;
    check_len(OP, "output", output.len(), n * c * oh * ow)?;
    check_len(OP, "indices", indices.len(), n * c * oh * ow)?;
    let (planes, ip, op) = (n * c, h * w, oh * ow);
    let per = planes_per_unit(ip + op);
    let units = planes.div_ceil(per);
    let (out, idx) = (SharedMut::new(output), SharedMut::new(indices));
    for_each_unit(
        threads,
        units,
        || Ok(()),
        |_, u| {
            let (a, b) = (u * per, ((u + 1) * per).min(planes));
            // SAFETY: unit u alone writes planes a..b of the output and indices.
            let (o, ix) = unsafe { (out.slice(a * op, (b - a) * op), idx.slice(a * op, (b - a) * op)) };
            for pl in a..b {
                let src = &input[pl * ip..(pl + 1) * ip];
                let (o, ix) = (&mut o[(pl - a) * op..(pl - a + 1) * op], &mut ix[(pl - a) * op..(pl - a + 1) * op]);
                for oy in 0..oh {
                    let ys = window(oy, p.stride[0], p.padding[0], p.dilation[0], p.kernel[0], h);
                    for ox in 0..ow {
                        let xs = window(ox, p.stride[1], p.padding[1], p.dilation[1], p.kernel[1], w);
                        let (mut best, mut at) = (T::NEG_INFINITY, ys.first * w + xs.first);
                        let mut y = ys.first;
                        for _ in 0..ys.count {
                            let mut x = xs.first;
                            for _ in 0..xs.count {
                                let v = src[y * w + x];
                                if v > best || v.is_nan() {
                                    best = v;
                                    at = y * w + x;
                                }
                                x += p.dilation[1];
                            }
                            y += p.dilation[0];
                        }
                        o[oy * ow + ox] = best;
                        ix[oy * ow + ox] = at as i64;
                    }
                }
            }
            Ok(())
        },
    )
}

/// The gradient of [`max_pool2d_forward`]: each output's gradient goes to
/// the input element its index names (summed where windows share one); an
/// index outside the plane (only an empty window's) adds nothing.
pub fn max_pool2d_backward<T: NnFloat>(
    p: &MaxPool2dParams,
    grad_output: &[T],
    indices: &[i64],
    grad_input: &mut [T],
    threads: usize,
) -> NnResult<()> {
    const OP: &str = "max_pool2d_backward";
    let [n, c, oh, ow] = p.validate()?;
    let (h, w) = (p.input[0], p.input[1]);
    check_len(OP, "grad_output", grad_output.len(), n * c * oh * ow)?;
    check_len(OP, "indices", indices.len(), n * c * oh * ow)?;
    check_len(OP, "grad_input", grad_input.len(), n * c * h * w)?;
    let (ip, op) = (h * w, oh * ow);
    let planes = n * c;
    let per = planes_per_unit(ip + op);
    let units = planes.div_ceil(per);
    let gin = SharedMut::new(grad_input);
    for_each_unit(
        threads,
        units,
        || Ok(()),
        |_, u| {
            let (a, b) = (u * per, ((u + 1) * per).min(planes));
            // SAFETY: unit u alone writes planes a..b of the input gradient.
            let d = unsafe { gin.slice(a * ip, (b - a) * ip) };
            d.fill(T::ZERO);
            for pl in a..b {
                let dst = &mut d[(pl - a) * ip..(pl - a + 1) * ip];
                for (&g, &i) in grad_output[pl * op..(pl + 1) * op].iter().zip(&indices[pl * op..(pl + 1) * op]) {
                    if let Some(d) = usize::try_from(i).ok().and_then(|i| dst.get_mut(i)) {
                        *d += g;
                    }
                }
            }
            Ok(())
        },
    )
}

/// The valid positions of one window along one axis: `count` of them from
/// `first`, every `d`. With none, `first` is still where PyTorch starts
/// looking (the first position at or after 0), which names the index of an
/// empty window's −∞.
struct Span {
    first: usize,
    count: usize,
}

/// The input positions `o·s − pad + k·d` (k < kernel) inside `0..size`.
#[inline]
fn window(o: usize, s: usize, pad: usize, d: usize, kernel: usize, size: usize) -> Span {
    let start = (o * s) as isize - pad as isize;
    // First k with start + k·d ≥ 0.
    let k0 = if start >= 0 { 0 } else { start.unsigned_abs().div_ceil(d) };
    // Ks with start + k·d < size.
    let k1 = if start >= size as isize { 0 } else { ((size as isize - start) as usize).div_ceil(d).min(kernel) };
    Span { first: (start + (k0 * d) as isize) as usize, count: k1.saturating_sub(k0) }
}

// ---- average pooling --------------------------------------------------------

/// The arguments of `avg_pool2d` over an NCHW batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AvgPool2dParams {
    /// Images (0 is allowed).
    pub batch: usize,
    /// Channels.
    pub channels: usize,
    /// Height and width of the input.
    pub input: [usize; 2],
    /// Window height and width.
    pub kernel: [usize; 2],
    /// Window step (PyTorch's default is the kernel size).
    pub stride: [usize; 2],
    /// Implicit zero padding on both sides, at most half the kernel.
    pub padding: [usize; 2],
    /// Count a last partial window (PyTorch's `ceil_mode`).
    pub ceil_mode: bool,
    /// Divide by the window including its padding (PyTorch's default) or
    /// by the input elements it covers.
    pub count_include_pad: bool,
    /// Divide every window by this instead (nonzero; may be negative, as PyTorch allows).
    pub divisor_override: Option<i64>,
}

impl AvgPool2dParams {
    /// The output's shape `[batch, channels, out_h, out_w]`, or why PyTorch
    /// would refuse these arguments.
    pub fn validate(&self) -> NnResult<[usize; 4]> {
        if self.divisor_override == Some(0) {
            return Err(NnError::invalid("avg_pool2d", "divisor_override must not be zero"));
        }
        pool_shape("avg_pool2d", [self.batch, self.channels], self.input, self.kernel, self.stride, self.padding, [1, 1], self.ceil_mode)
    }

    /// The divisor of every window when all windows lie whole inside the
    /// input and none overlaps (no padding, stride ≥ kernel, no partial
    /// last window), as LeNet's 2×2 pooling every 2: then each output's
    /// window is a plain `kh × kw` block and each input element is in at
    /// most one. `None` otherwise.
    fn disjoint_divisor(&self, oh: usize, ow: usize) -> Option<i64> {
        let ([kh, kw], [sh, sw], [h, w]) = (self.kernel, self.stride, self.input);
        let whole =
            self.padding == [0, 0] && sh >= kh && sw >= kw && oh >= 1 && ow >= 1 && (oh - 1) * sh + kh <= h && (ow - 1) * sw + kw <= w;
        whole.then(|| self.divisor_override.unwrap_or((kh * kw) as i64))
    }

    /// Window (oy, ox)'s input rows, columns and divisor, as PyTorch's
    /// `avg_pool2d`: the window is cut at the far padding edge, the divisor
    /// counts the padding only when `count_include_pad`.
    #[inline]
    fn window(&self, oy: usize, ox: usize) -> (std::ops::Range<usize>, std::ops::Range<usize>, i64) {
        let axis = |o: usize, i: usize| {
            let start = (o * self.stride[i]) as isize - self.padding[i] as isize;
            let end = (start + self.kernel[i] as isize).min((self.input[i] + self.padding[i]) as isize);
            let pooled = end - start;
            (start.max(0) as usize..end.clamp(0, self.input[i] as isize) as usize, pooled)
        };
        let ((ys, ph), (xs, pw)) = (axis(oy, 0), axis(ox, 1));
        let divisor = match self.divisor_override {
            Some(d) => d,
            None if self.count_include_pad => (ph * pw) as i64,
            None => (ys.len() * xs.len()) as i64,
        };
        (ys, xs, divisor)
    }
}

/// `avg_pool2d`: each output is its window's sum over its divisor (zero for
/// a window that covers no input element).
pub fn avg_pool2d_forward<T: NnFloat>(p: &AvgPool2dParams, input: &[T], output: &mut [T], threads: usize) -> NnResult<()> {
    const OP: &str = "avg_pool2d";
    let [n, c, oh, ow] = p.validate()?;
    let (h, w) = (p.input[0], p.input[1]);
    check_len(OP, "input", input.len(), n * c * h * w)?;
    check_len(OP, "output", output.len(), n * c * oh * ow)?;
    if let Some(div) = p.disjoint_divisor(oh, ow) {
        let div = T::from_f64(div as f64);
        return over_planes(n * c, h * w, oh * ow, input, output, threads, |src, dst| avg_disjoint_plane(p, div, ow, src, dst));
    }
    over_planes(n * c, h * w, oh * ow, input, output, threads, |src, dst| avg_any_plane(p, oh, ow, src, dst))
}

/// One plane of [`avg_pool2d_forward`], any windows.
fn avg_any_plane<T: NnFloat>(p: &AvgPool2dParams, oh: usize, ow: usize, src: &[T], dst: &mut [T]) {
    let w = p.input[1];
    for oy in 0..oh {
        for ox in 0..ow {
            let (ys, xs, div) = p.window(oy, ox);
            if ys.is_empty() || xs.is_empty() {
                dst[oy * ow + ox] = T::ZERO;
                continue;
            }
            let mut sum = T::ZERO;
            for y in ys {
                for &v in &src[y * w + xs.start..y * w + xs.end] {
                    sum += v;
                }
            }
            dst[oy * ow + ox] = sum / T::from_f64(div as f64);
        }
    }
}

/// One plane of [`avg_pool2d_forward`] when every window is a whole
/// `kh × kw` block of the input ([`AvgPool2dParams::disjoint_divisor`]):
/// the same sums in the same order as [`avg_any_plane`] (row by row from
/// +0, then one division), so the same bits, without working out each
/// window; 2×2 windows every 2 columns (LeNet's) in a loop the compiler
/// vectorises.
fn avg_disjoint_plane<T: NnFloat>(p: &AvgPool2dParams, div: T, ow: usize, src: &[T], dst: &mut [T]) {
    let ([kh, kw], [sh, sw], w) = (p.kernel, p.stride, p.input[1]);
    for (oy, out) in dst.chunks_exact_mut(ow).enumerate() {
        let top = oy * sh * w;
        if kh == 2 && kw == 2 && sw == 2 {
            let (r0, r1) = (&src[top..top + 2 * ow], &src[top + w..top + w + 2 * ow]);
            for ((o, a), b) in out.iter_mut().zip(r0.chunks_exact(2)).zip(r1.chunks_exact(2)) {
                *o = (T::ZERO + a[0] + a[1] + b[0] + b[1]) / div;
            }
            continue;
        }
        for (ox, o) in out.iter_mut().enumerate() {
            let mut sum = T::ZERO;
            for ky in 0..kh {
                let row = top + ky * w + ox * sw;
                for &v in &src[row..row + kw] {
                    sum += v;
                }
            }
            *o = sum / div;
        }
    }
}

/// The gradient of [`avg_pool2d_forward`].
pub fn avg_pool2d_backward<T: NnFloat>(p: &AvgPool2dParams, grad_output: &[T], grad_input: &mut [T], threads: usize) -> NnResult<()> {
    const OP: &str = "avg_pool2d_backward";
    let [n, c, oh, ow] = p.validate()?;
    let (h, w) = (p.input[0], p.input[1]);
    check_len(OP, "grad_output", grad_output.len(), n * c * oh * ow)?;
    check_len(OP, "grad_input", grad_input.len(), n * c * h * w)?;
    if let Some(div) = p.disjoint_divisor(oh, ow) {
        let div = T::from_f64(div as f64);
        return over_planes(n * c, oh * ow, h * w, grad_output, grad_input, threads, |src, dst| {
            avg_disjoint_plane_backward(p, div, [oh, ow], src, dst)
        });
    }
    over_planes(n * c, oh * ow, h * w, grad_output, grad_input, threads, |src, dst| avg_any_plane_backward(p, [oh, ow], src, dst))
}

/// One plane of [`avg_pool2d_backward`], any windows: each window's share
/// of its gradient summed into zeros.
fn avg_any_plane_backward<T: NnFloat>(p: &AvgPool2dParams, [oh, ow]: [usize; 2], src: &[T], dst: &mut [T]) {
    let w = p.input[1];
    dst.fill(T::ZERO);
    for oy in 0..oh {
        for ox in 0..ow {
            let (ys, xs, div) = p.window(oy, ox);
            let g = src[oy * ow + ox] / T::from_f64(div as f64);
            for y in ys {
                for d in &mut dst[y * w + xs.start..y * w + xs.end] {
                    *d += g;
                }
            }
        }
    }
}

/// One plane of [`avg_pool2d_backward`] for disjoint whole windows: each
/// input element gets its window's gradient (+0 + g, as the general path's
/// sum into zeros gives) or, outside every window, zero.
fn avg_disjoint_plane_backward<T: NnFloat>(p: &AvgPool2dParams, div: T, [oh, ow]: [usize; 2], src: &[T], dst: &mut [T]) {
    let ([kh, kw], [sh, sw], [h, w]) = (p.kernel, p.stride, p.input);
    if oh.checked_mul(sh) != Some(h) || ow.checked_mul(sw) != Some(w) || sh != kh || sw != kw {
        dst.fill(T::ZERO);
    }
    for (oy, grads) in src.chunks_exact(ow).enumerate() {
        for ky in 0..kh {
            let row = &mut dst[(oy * sh + ky) * w..(oy * sh + ky + 1) * w];
            if kw == 2 && sw == 2 {
                for (d, &g) in row.chunks_exact_mut(2).zip(grads) {
                    let g = T::ZERO + g / div;
                    d[0] = g;
                    d[1] = g;
                }
                continue;
            }
            for (ox, &g) in grads.iter().enumerate() {
                let g = T::ZERO + g / div;
                row[ox * sw..ox * sw + kw].fill(g);
            }
        }
    }
}

// ---- adaptive average pooling ----------------------------------------------

/// The arguments of `adaptive_avg_pool2d` over an NCHW batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AdaptivePool2dParams {
    /// Images (0 is allowed).
    pub batch: usize,
    /// Channels (0 is allowed).
    pub channels: usize,
    /// Height and width of the input (positive).
    pub input: [usize; 2],
    /// Height and width of the output (0 gives an empty output).
    pub output: [usize; 2],
}

impl AdaptivePool2dParams {
    /// The output's shape, or why PyTorch would refuse these arguments.
    pub fn validate(&self) -> NnResult<[usize; 4]> {
        const OP: &str = "adaptive_avg_pool2d";
        if self.input.contains(&0) {
            return Err(NnError::invalid(
                OP,
                format!("the input's spatial size {:?} is empty: only the batch or channels may be 0", self.input),
            ));
        }
        let shape = [self.batch, self.channels, self.output[0], self.output[1]];
        product(OP, "the output shape", &shape)?;
        product(OP, "the input shape", &[self.batch, self.channels, self.input[0], self.input[1]])?;
        Ok(shape)
    }
}

/// Output `o` of `out` over `size` inputs pools `floor(o·size/out) ..
/// ceil((o + 1)·size/out)`.
#[inline]
fn adaptive_range(o: usize, out: usize, size: usize) -> std::ops::Range<usize> {
    let (o, out, size) = (o as u128, out as u128, size as u128);
    ((o * size / out) as usize)..((((o + 1) * size).div_ceil(out)) as usize)
}

/// `adaptive_avg_pool2d`: each output the mean of its window.
pub fn adaptive_avg_pool2d_forward<T: NnFloat>(p: &AdaptivePool2dParams, input: &[T], output: &mut [T], threads: usize) -> NnResult<()> {
    const OP: &str = "adaptive_avg_pool2d";
    let [n, c, oh, ow] = p.validate()?;
    let (h, w) = (p.input[0], p.input[1]);
    check_len(OP, "input", input.len(), n * c * h * w)?;
    check_len(OP, "output", output.len(), n * c * oh * ow)?;
    if output.is_empty() {
        return Ok(());
    }
    over_planes(n * c, h * w, oh * ow, input, output, threads, |src, dst| {
        for oy in 0..oh {
            let ys = adaptive_range(oy, oh, h);
            for ox in 0..ow {
                let xs = adaptive_range(ox, ow, w);
                let mut sum = T::ZERO;
                for y in ys.clone() {
                    for &v in &src[y * w + xs.start..y * w + xs.end] {
                        sum += v;
                    }
                }
                dst[oy * ow + ox] = sum / T::from_usize(ys.len() * xs.len());
            }
        }
    })
}

/// The gradient of [`adaptive_avg_pool2d_forward`].
pub fn adaptive_avg_pool2d_backward<T: NnFloat>(
    p: &AdaptivePool2dParams,
    grad_output: &[T],
    grad_input: &mut [T],
    threads: usize,
) -> NnResult<()> {
    const OP: &str = "adaptive_avg_pool2d_backward";
    let [n, c, oh, ow] = p.validate()?;
    let (h, w) = (p.input[0], p.input[1]);
    check_len(OP, "grad_output", grad_output.len(), n * c * oh * ow)?;
    check_len(OP, "grad_input", grad_input.len(), n * c * h * w)?;
    if grad_output.is_empty() {
        grad_input.fill(T::ZERO);
        return Ok(());
    }
    over_planes(n * c, oh * ow, h * w, grad_output, grad_input, threads, |src, dst| {
        dst.fill(T::ZERO);
        for oy in 0..oh {
            let ys = adaptive_range(oy, oh, h);
            for ox in 0..ow {
                let xs = adaptive_range(ox, ow, w);
                let g = src[oy * ow + ox] / T::from_usize(ys.len() * xs.len());
                for y in ys.clone() {
                    for d in &mut dst[y * w + xs.start..y * w + xs.end] {
                        *d += g;
                    }
                }
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The disjoint-window loops give the general loops' bits, in both
    /// directions and both float types, on values with NaN, ±∞ and −0.
    #[test]
    fn disjoint_windows_give_the_general_paths_bits() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % n) as usize
        };
        let edge = [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, -0.0, 0.0, 1e300, -3.5, 0.1];
        let mut checked = 0;
        for _ in 0..3000 {
            let kernel = [1 + next(3), 1 + next(3)];
            let p = AvgPool2dParams {
                batch: 1,
                channels: 1 + next(2),
                input: [1 + next(9), 1 + next(9)],
                kernel,
                stride: [kernel[0] + next(2), kernel[1] + next(2)],
                padding: [0, 0],
                ceil_mode: next(2) == 0,
                count_include_pad: next(2) == 0,
                divisor_override: [None, None, Some(3), Some(-2)][next(4)],
            };
            let Ok([n, c, oh, ow]) = p.validate() else { continue };
            let Some(div) = p.disjoint_divisor(oh, ow) else { continue };
            checked += 1;
            let plane = p.input[0] * p.input[1];
            let x: Vec<f64> =
                (0..n * c * plane).map(|_| if next(4) == 0 { edge[next(8)] } else { next(1000) as f64 / 7.0 - 70.0 }).collect();
            let dy: Vec<f64> =
                (0..n * c * oh * ow).map(|_| if next(4) == 0 { edge[next(8)] } else { next(1000) as f64 / 3.0 - 100.0 }).collect();
            fn bits<T: NnFloat>(v: &[T]) -> Vec<u64> {
                v.iter().map(|x| x.to_f64().to_bits()).collect()
            }
            fn both<T: NnFloat>(p: &AvgPool2dParams, div: i64, [oh, ow]: [usize; 2], x: &[T], dy: &[T]) {
                let plane = p.input[0] * p.input[1];
                for (src, g) in x.chunks_exact(plane).zip(dy.chunks_exact(oh * ow)) {
                    let (mut fast, mut general) = (vec![T::from_f64(7.0); oh * ow], vec![T::from_f64(9.0); oh * ow]);
                    avg_disjoint_plane(p, T::from_f64(div as f64), ow, src, &mut fast);
                    avg_any_plane(p, oh, ow, src, &mut general);
                    assert_eq!(bits(&fast), bits(&general), "forward of {p:?}");
                    let (mut fast, mut general) = (vec![T::from_f64(7.0); plane], vec![T::from_f64(9.0); plane]);
                    avg_disjoint_plane_backward(p, T::from_f64(div as f64), [oh, ow], g, &mut fast);
                    avg_any_plane_backward(p, [oh, ow], g, &mut general);
                    assert_eq!(bits(&fast), bits(&general), "backward of {p:?}");
                }
            }
            both::<f64>(&p, div, [oh, ow], &x, &dy);
            let (x32, dy32): (Vec<f32>, Vec<f32>) = (x.iter().map(|&v| v as f32).collect(), dy.iter().map(|&v| v as f32).collect());
            both::<f32>(&p, div, [oh, ow], &x32, &dy32);
        }
        assert!(checked > 500, "only {checked} shapes had disjoint windows");
    }

    #[test]
    fn overlapping_padded_or_partial_windows_take_the_general_path() {
        let p = |kernel: [usize; 2], stride: [usize; 2], padding: [usize; 2], input: [usize; 2], ceil_mode: bool| AvgPool2dParams {
            batch: 1,
            channels: 1,
            input,
            kernel,
            stride,
            padding,
            ceil_mode,
            count_include_pad: true,
            divisor_override: None,
        };
        let disjoint = |q: AvgPool2dParams| q.validate().ok().and_then(|[_, _, oh, ow]| q.disjoint_divisor(oh, ow));
        assert_eq!(disjoint(p([2, 2], [2, 2], [0, 0], [28, 28], false)), Some(4));
        assert_eq!(disjoint(p([3, 3], [2, 2], [0, 0], [9, 9], false)), None, "overlapping");
        assert_eq!(disjoint(p([2, 2], [2, 2], [1, 1], [4, 4], false)), None, "padded");
        assert_eq!(disjoint(p([2, 2], [2, 2], [0, 0], [5, 5], true)), None, "a partial last window");
        assert_eq!(disjoint(p([2, 2], [2, 2], [0, 0], [5, 5], false)), Some(4), "the last row and column in no window");
    }
}
