//! Convolution arguments, checked as PyTorch checks them.

use super::geom::Geom;
use crate::host_nn::work::{add, mul, product};
use crate::host_nn::{NnError, NnResult};

/// Zero padding on each side of the image. PyTorch's `padding=(ph, pw)` is
/// [`Padding2d::symmetric`]; `padding="same"` is [`Padding2d::same`], which
/// puts the odd element on the bottom and right as PyTorch does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Padding2d {
    /// Rows above.
    pub top: usize,
    /// Rows below.
    pub bottom: usize,
    /// Columns on the left.
    pub left: usize,
    /// Columns on the right.
    pub right: usize,
}

impl Padding2d {
    /// `ph` rows above and below, `pw` columns left and right.
    pub fn symmetric([ph, pw]: [usize; 2]) -> Padding2d {
        Padding2d { top: ph, bottom: ph, left: pw, right: pw }
    }

    /// PyTorch's `padding="same"`: the output is as large as the input.
    /// Refused for strides other than 1, as PyTorch refuses it.
    pub fn same(kernel: [usize; 2], dilation: [usize; 2], stride: [usize; 2]) -> NnResult<Padding2d> {
        const OP: &str = "conv2d";
        if stride != [1, 1] {
            return Err(NnError::invalid(OP, format!("padding=\"same\" needs stride 1, got stride {stride:?}")));
        }
        let mut total = [0usize; 2];
        for i in 0..2 {
            total[i] = mul(OP, "dilation · (kernel_size − 1)", dilation[i], kernel[i].saturating_sub(1))?;
        }
        Ok(Padding2d { top: total[0] / 2, bottom: total[0] - total[0] / 2, left: total[1] / 2, right: total[1] - total[1] / 2 })
    }
}

/// The arguments of a 2-D convolution over an NCHW batch with an OIHW
/// weight of shape `[out_channels, in_channels / groups, kernel[0], kernel[1]]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv2dParams {
    /// Images in the batch (0 is allowed).
    pub batch: usize,
    /// Channels of the input (0 is allowed, as PyTorch allows it).
    pub in_channels: usize,
    /// Channels of the output (the weight's first dimension).
    pub out_channels: usize,
    /// Height and width of the input.
    pub input: [usize; 2],
    /// Height and width of the kernel.
    pub kernel: [usize; 2],
    /// Vertical and horizontal stride.
    pub stride: [usize; 2],
    /// Zero padding, possibly asymmetric.
    pub padding: Padding2d,
    /// Vertical and horizontal dilation.
    pub dilation: [usize; 2],
    /// Channel groups: both channel counts must be multiples of it.
    pub groups: usize,
}

/// The largest padded extent accepted: positions inside it fit an `isize`
/// with room to add a kernel's reach.
const SIZE_LIMIT: usize = (isize::MAX as usize) / 4;

/// The output's height and width of a strided window over `size` padded
/// elements, or None when the window does not fit.
fn window_count(padded: usize, kernel: usize, dilation: usize, stride: usize) -> Option<usize> {
    let span = dilation.checked_mul(kernel - 1)?.checked_add(1)?;
    padded.checked_sub(span).map(|d| d / stride + 1)
}

pub(super) fn check_common(op: &'static str, kernel: [usize; 2], stride: [usize; 2], dilation: [usize; 2], groups: usize) -> NnResult<()> {
    if kernel.contains(&0) {
        return Err(NnError::invalid(op, format!("kernel_size must be positive, got {kernel:?}")));
    }
    if stride.contains(&0) {
        return Err(NnError::invalid(op, format!("stride must be positive, got {stride:?}")));
    }
    if dilation.contains(&0) {
        return Err(NnError::invalid(op, format!("dilation must be positive, got {dilation:?}")));
    }
    if groups == 0 {
        return Err(NnError::invalid(op, "groups must be positive, got 0"));
    }
    Ok(())
}

pub(super) fn check_channels(op: &'static str, in_channels: usize, out_channels: usize, groups: usize, weight_first: &str) -> NnResult<()> {
    let (first, first_name, second, second_name) = if weight_first == "out_channels" {
        (out_channels, "out_channels", in_channels, "in_channels")
    } else {
        (in_channels, "in_channels", out_channels, "out_channels")
    };
    if first < groups {
        return Err(NnError::invalid(
            op,
            format!("{first_name} ({first}, the weight's first dimension) must be at least groups ({groups})"),
        ));
    }
    if first % groups != 0 {
        return Err(NnError::invalid(op, format!("{first_name} ({first}) must be divisible by groups ({groups})")));
    }
    if second % groups != 0 {
        return Err(NnError::invalid(op, format!("{second_name} ({second}) must be divisible by groups ({groups})")));
    }
    Ok(())
}

impl Conv2dParams {
    const OP: &'static str = "conv2d";

    /// The output's shape `[batch, out_channels, out_h, out_w]`, or why
    /// PyTorch would refuse these arguments.
    pub fn validate(&self) -> NnResult<[usize; 4]> {
        let op = Self::OP;
        check_common(op, self.kernel, self.stride, self.dilation, self.groups)?;
        check_channels(op, self.in_channels, self.out_channels, self.groups, "out_channels")?;
        let p = self.padding;
        let padded = [
            add(op, "padded input height", add(op, "padded input height", self.input[0], p.top)?, p.bottom)?,
            add(op, "padded input width", add(op, "padded input width", self.input[1], p.left)?, p.right)?,
        ];
        if padded.iter().any(|&v| v > SIZE_LIMIT) {
            return Err(NnError::invalid(op, format!("the padded input {padded:?} is too large")));
        }
        let mut out = [0usize; 2];
        for i in 0..2 {
            out[i] = window_count(padded[i], self.kernel[i], self.dilation[i], self.stride[i]).ok_or_else(|| {
                NnError::invalid(
                    op,
                    format!(
                        "the padded input is {} x {} (input {:?} with padding {:?}) but the dilated kernel is {} x {}: \
                         the kernel cannot be larger than the padded input",
                        padded[0],
                        padded[1],
                        self.input,
                        p,
                        self.dilation[0].saturating_mul(self.kernel[0] - 1).saturating_add(1),
                        self.dilation[1].saturating_mul(self.kernel[1] - 1).saturating_add(1),
                    ),
                )
            })?;
        }
        if self.input.contains(&0) && self.batch != 0 && self.in_channels != 0 {
            return Err(NnError::invalid(
                op,
                format!("an input of spatial size {:?} is empty: only the batch or the channels may be 0", self.input),
            ));
        }
        let shape = [self.batch, self.out_channels, out[0], out[1]];
        product(op, "the output shape", &shape)?;
        product(op, "the input shape", &self.input_shape())?;
        product(op, "the weight shape", &self.weight_shape())?;
        Ok(shape)
    }

    /// `[batch, in_channels, h, w]`.
    pub fn input_shape(&self) -> [usize; 4] {
        [self.batch, self.in_channels, self.input[0], self.input[1]]
    }

    /// `[out_channels, in_channels / groups, kh, kw]` (groups must be positive).
    pub fn weight_shape(&self) -> [usize; 4] {
        [self.out_channels, self.in_channels / self.groups.max(1), self.kernel[0], self.kernel[1]]
    }

    /// The geometry the kernels run (after [`Self::validate`]).
    pub(crate) fn geom(&self, out: [usize; 4]) -> Geom {
        Geom {
            n: self.batch,
            groups: self.groups,
            icg: self.in_channels / self.groups,
            ocg: self.out_channels / self.groups,
            h: self.input[0],
            w: self.input[1],
            oh: out[2],
            ow: out[3],
            kh: self.kernel[0],
            kw: self.kernel[1],
            sh: self.stride[0],
            sw: self.stride[1],
            dh: self.dilation[0],
            dw: self.dilation[1],
            pt: self.padding.top as isize,
            pl: self.padding.left as isize,
        }
    }
}

/// The arguments of a 2-D transposed convolution (PyTorch's
/// `conv_transpose2d`) over an NCHW batch with a weight of shape
/// `[in_channels, out_channels / groups, kernel[0], kernel[1]]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvTranspose2dParams {
    /// Images in the batch (0 is allowed).
    pub batch: usize,
    /// Channels of the input (the weight's first dimension).
    pub in_channels: usize,
    /// Channels of the output.
    pub out_channels: usize,
    /// Height and width of the input.
    pub input: [usize; 2],
    /// Height and width of the kernel.
    pub kernel: [usize; 2],
    /// Vertical and horizontal stride.
    pub stride: [usize; 2],
    /// Implicit padding removed from both sides of the output.
    pub padding: [usize; 2],
    /// Extra rows and columns added to the bottom and right of the output
    /// (smaller than the stride or the dilation).
    pub output_padding: [usize; 2],
    /// Vertical and horizontal dilation.
    pub dilation: [usize; 2],
    /// Channel groups.
    pub groups: usize,
}

impl ConvTranspose2dParams {
    const OP: &'static str = "conv_transpose2d";

    /// The output's shape `[batch, out_channels, out_h, out_w]`, or why
    /// PyTorch would refuse these arguments.
    pub fn validate(&self) -> NnResult<[usize; 4]> {
        let op = Self::OP;
        check_common(op, self.kernel, self.stride, self.dilation, self.groups)?;
        check_channels(op, self.in_channels, self.out_channels, self.groups, "in_channels")?;
        for i in 0..2 {
            if self.output_padding[i] >= self.stride[i] && self.output_padding[i] >= self.dilation[i] {
                return Err(NnError::invalid(
                    op,
                    format!(
                        "output_padding {:?} must be smaller than the stride {:?} or the dilation {:?}",
                        self.output_padding, self.stride, self.dilation
                    ),
                ));
            }
        }
        if self.out_channels == 0 {
            return Err(NnError::invalid(op, "out_channels must be positive (the weight would be empty), got 0"));
        }
        // (in − 1)·stride − 2·padding + dilation·(kernel − 1) + output_padding + 1,
        // exactly (in i128, where no term of usizes can overflow).
        let mut out = [0usize; 2];
        for (i, o) in out.iter_mut().enumerate() {
            let size = (|| {
                let grown = (self.input[i] as i128 - 1).checked_mul(self.stride[i] as i128)?;
                let reach = (self.dilation[i] as i128).checked_mul(self.kernel[i] as i128 - 1)?;
                grown.checked_add(reach)?.checked_add(self.output_padding[i] as i128 + 1)?.checked_sub(2 * self.padding[i] as i128)
            })()
            .ok_or_else(|| NnError::invalid(op, format!("the output size overflows for input {:?}", self.input)))?;
            if size < 1 {
                return Err(NnError::invalid(
                    op,
                    format!(
                        "input {:?} with stride {:?}, padding {:?}, dilation {:?}, kernel {:?} and output_padding {:?} \
                         gives an output smaller than 1",
                        self.input, self.stride, self.padding, self.dilation, self.kernel, self.output_padding
                    ),
                ));
            }
            if size > SIZE_LIMIT as i128 {
                return Err(NnError::invalid(op, format!("the output size {size} is too large")));
            }
            *o = size as usize;
        }
        if self.input.contains(&0) && self.batch != 0 && self.in_channels != 0 {
            return Err(NnError::invalid(
                op,
                format!("an input of spatial size {:?} is empty: only the batch or the channels may be 0", self.input),
            ));
        }
        let shape = [self.batch, self.out_channels, out[0], out[1]];
        product(op, "the output shape", &shape)?;
        product(op, "the input shape", &self.input_shape())?;
        product(op, "the weight shape", &self.weight_shape())?;
        Ok(shape)
    }

    /// `[batch, in_channels, h, w]`.
    pub fn input_shape(&self) -> [usize; 4] {
        [self.batch, self.in_channels, self.input[0], self.input[1]]
    }

    /// `[in_channels, out_channels / groups, kh, kw]` (groups must be positive).
    pub fn weight_shape(&self) -> [usize; 4] {
        [self.in_channels, self.out_channels / self.groups.max(1), self.kernel[0], self.kernel[1]]
    }

    /// The convolution this one transposes: its input is our output, its
    /// output our input (which may be smaller than that convolution's own
    /// output when output_padding ≥ stride).
    pub(crate) fn geom(&self, out: [usize; 4]) -> Geom {
        Geom {
            n: self.batch,
            groups: self.groups,
            icg: self.out_channels / self.groups,
            ocg: self.in_channels / self.groups,
            h: out[2],
            w: out[3],
            oh: self.input[0],
            ow: self.input[1],
            kh: self.kernel[0],
            kw: self.kernel[1],
            sh: self.stride[0],
            sw: self.stride[1],
            dh: self.dilation[0],
            dw: self.dilation[1],
            pt: self.padding[0] as isize,
            pl: self.padding[1] as isize,
        }
    }
}
