//! Convolution and pooling layers: [`Conv2d`], [`LazyConv2d`] (its input
//! channels found at the first forward), [`MaxPool2d`], [`AvgPool2d`],
//! [`AdaptiveAvgPool2d`].

use super::lazy::{Lazy, LazySpec};
use super::module::{input_device_mismatch, Module, ParamVisitor};
use crate::{Conv2dArgs, DType, Device, Error, Pair, Pool2dArgs, Result, Tensor};

/// A 2-D convolution layer, PyTorch's `nn.Conv2d`: weight `[out, in /
/// groups, kh, kw]` and bias `[out]`, both drawn from U(−k, k) with
/// `k = 1/√(in / groups · kh · kw)` as PyTorch's default initialisation.
///
/// ```
/// use kiln::nn::{Conv2d, Module};
/// use kiln::{Conv2dArgs, DType, Tensor, cpu};
/// let conv = Conv2d::new(1, 6, 5, Conv2dArgs::default().padding(2), &cpu())?;
/// let y = conv.forward(&Tensor::zeros((2, 1, 28, 28), DType::F32, &cpu())?)?;
/// assert_eq!(y.dims(), &[2, 6, 28, 28]);
/// # Ok::<(), kiln::Error>(())
/// ```
#[derive(Clone)]
pub struct Conv2d {
    weight: Tensor,
    bias: Option<Tensor>,
    args: Conv2dArgs,
}

impl std::fmt::Debug for Conv2d {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

impl Conv2d {
    /// `in_channels → out_channels` with a `kernel` window, f32, with a bias.
    pub fn new(in_channels: usize, out_channels: usize, kernel: impl Into<Pair>, args: Conv2dArgs, device: &Device) -> Result<Conv2d> {
        Conv2d::with_options(in_channels, out_channels, kernel, args, true, DType::F32, device)
    }

    /// With or without a bias, in `dtype`.
    pub fn with_options(
        in_channels: usize,
        out_channels: usize,
        kernel: impl Into<Pair>,
        args: Conv2dArgs,
        bias: bool,
        dtype: DType,
        device: &Device,
    ) -> Result<Conv2d> {
        let [kh, kw] = kernel.into().0;
        let g = args.groups;
        if in_channels == 0
            || out_channels == 0
            || g == 0
            || !in_channels.is_multiple_of(g)
            || !out_channels.is_multiple_of(g)
            || kh == 0
            || kw == 0
        {
            return Err(Error::invalid(
                "Conv2d",
                format!(
                    "in_channels ({in_channels}) and out_channels ({out_channels}) must be positive multiples of groups ({g}), \
                     and kernel_size [{kh}, {kw}] positive"
                ),
            ));
        }
        let fan_in = (in_channels / g) * kh * kw;
        let k = 1.0 / (fan_in as f64).sqrt();
        let weight = Tensor::rand_uniform(-k, k, (out_channels, in_channels / g, kh, kw), dtype, device)?.requires_grad_();
        let bias = if bias { Some(Tensor::rand_uniform(-k, k, out_channels, dtype, device)?.requires_grad_()) } else { None };
        Ok(Conv2d { weight, bias, args })
    }

    /// The weight `[out, in / groups, kh, kw]`.
    pub fn weight(&self) -> Tensor {
        self.weight.clone()
    }

    /// The bias `[out]`, if any.
    pub fn bias(&self) -> Option<Tensor> {
        self.bias.clone()
    }
}

impl Module for Conv2d {
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
    fn boxed_clone(&self) -> Option<Box<dyn Module>> {
        Some(Box::new(self.clone()))
    }
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if x.device() != self.weight.device() {
            return Err(input_device_mismatch(x.device(), "weight", self.weight.device()));
        }
        x.conv2d(&self.weight, self.bias.as_ref(), self.args).map_err(|e| in_module(e, &self.describe()))
    }
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut v = vec![("weight".to_string(), self.weight.clone())];
        if let Some(b) = &self.bias {
            v.push(("bias".to_string(), b.clone()));
        }
        v
    }
    fn visit_parameters_mut(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> {
        f("weight", &mut self.weight)?;
        if let Some(b) = &mut self.bias {
            f("bias", b)?;
        }
        Ok(())
    }
    fn describe(&self) -> String {
        let d = self.weight.dims();
        format!(
            "Conv2d(in={}, out={}, kernel={:?}, stride={:?}, padding={:?}, groups={}, bias={}, {})",
            d[1] * self.args.groups,
            d[0],
            [d[2], d[3]],
            self.args.stride,
            self.args.padding,
            self.args.groups,
            self.bias.is_some(),
            self.weight.device()
        )
    }
}

/// An op's invalid-argument error prefixed with the layer that ran it.
pub(crate) fn in_module(e: Error, layer: &str) -> Error {
    match e {
        Error::InvalidArgument { op, msg } => Error::InvalidArgument { op: format!("{layer}: {op}"), msg },
        Error::ShapeMismatch { op, lhs, rhs } => Error::ShapeMismatch { op: format!("{layer}: {op}"), lhs, rhs },
        other => other,
    }
}

/// A [`Conv2d`] whose input channels are taken from the first input it
/// sees (PyTorch's `nn.LazyConv2d`).
///
/// ```
/// use kiln::nn::{LazyConv2d, Module};
/// use kiln::{Conv2dArgs, DType, Tensor, cpu};
/// let conv = LazyConv2d::new(4, 3, Conv2dArgs::default().padding(1));
/// let y = conv.forward(&Tensor::zeros((1, 2, 5, 5), DType::F32, &cpu())?)?;
/// assert_eq!((y.dims(), conv.parameter("weight")?.dims()), (&[1, 4, 5, 5][..], &[4, 2, 3, 3][..]));
/// # Ok::<(), kiln::Error>(())
/// ```
pub type LazyConv2d = Lazy<Conv2dSpec>;

/// What a [`LazyConv2d`] is made from: output channels, window, arguments
/// and bias; the input channels are the input's (C of (N, C, H, W) or
/// (C, H, W)).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Conv2dSpec {
    /// Output channels.
    pub out_channels: usize,
    /// The window (height, width).
    pub kernel: [usize; 2],
    /// Stride, padding, dilation and groups.
    pub args: Conv2dArgs,
    /// Whether the layer has a bias.
    pub bias: bool,
}

impl LazyConv2d {
    /// `out_channels` with a `kernel` window and a bias.
    pub fn new(out_channels: usize, kernel: impl Into<Pair>, args: Conv2dArgs) -> LazyConv2d {
        Lazy::from_spec(Conv2dSpec { out_channels, kernel: kernel.into().0, args, bias: true })
    }

    /// Without a bias (before a batch normalisation).
    pub fn without_bias(self) -> LazyConv2d {
        self.map_spec(|s| s.bias = false)
    }
}

impl LazySpec for Conv2dSpec {
    type Module = Conv2d;
    fn name(&self) -> &'static str {
        "LazyConv2d"
    }
    fn pending(&self) -> String {
        format!("LazyConv2d(in=?, out={}, kernel={:?})", self.out_channels, self.kernel)
    }
    fn make(&self, x: &Tensor) -> Result<Conv2d> {
        if !(3..=4).contains(&x.rank()) {
            return Err(Error::invalid("LazyConv2d", format!("input must be 3-D (C, H, W) or 4-D (N, C, H, W), got shape {}", x.shape())));
        }
        Conv2d::with_options(x.dims()[x.rank() - 3], self.out_channels, self.kernel, self.args, self.bias, x.dtype(), &x.device())
    }
}

/// Max pooling, PyTorch's `nn.MaxPool2d`.
#[derive(Clone, Copy, Debug)]
pub struct MaxPool2d(pub Pool2dArgs);

impl MaxPool2d {
    /// A `kernel` window with stride `stride` and padding `padding`.
    pub fn new(kernel: impl Into<Pair>, stride: impl Into<Pair>, padding: impl Into<Pair>) -> MaxPool2d {
        MaxPool2d(Pool2dArgs::new(kernel).stride(stride).padding(padding))
    }
}

impl Module for MaxPool2d {
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
    fn boxed_clone(&self) -> Option<Box<dyn Module>> {
        Some(Box::new(*self))
    }
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.max_pool2d(self.0).map_err(|e| in_module(e, &self.describe()))
    }
    fn describe(&self) -> String {
        format!("MaxPool2d(kernel={:?}, stride={:?}, padding={:?})", self.0.kernel, self.0.stride.unwrap_or(self.0.kernel), self.0.padding)
    }
}

/// Average pooling, PyTorch's `nn.AvgPool2d`.
#[derive(Clone, Copy, Debug)]
pub struct AvgPool2d(pub Pool2dArgs);

impl AvgPool2d {
    /// A `kernel` window with stride `stride` and padding `padding`.
    pub fn new(kernel: impl Into<Pair>, stride: impl Into<Pair>, padding: impl Into<Pair>) -> AvgPool2d {
        AvgPool2d(Pool2dArgs::new(kernel).stride(stride).padding(padding))
    }
}

impl Module for AvgPool2d {
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
    fn boxed_clone(&self) -> Option<Box<dyn Module>> {
        Some(Box::new(*self))
    }
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.avg_pool2d(self.0).map_err(|e| in_module(e, &self.describe()))
    }
    fn describe(&self) -> String {
        format!("AvgPool2d(kernel={:?}, stride={:?}, padding={:?})", self.0.kernel, self.0.stride.unwrap_or(self.0.kernel), self.0.padding)
    }
}

/// Adaptive average pooling to a fixed output size, PyTorch's
/// `nn.AdaptiveAvgPool2d`.
#[derive(Clone, Copy, Debug)]
pub struct AdaptiveAvgPool2d(pub [usize; 2]);

impl AdaptiveAvgPool2d {
    /// Pools to `output` (height, width).
    pub fn new(output: impl Into<Pair>) -> AdaptiveAvgPool2d {
        AdaptiveAvgPool2d(output.into().0)
    }
}

impl Module for AdaptiveAvgPool2d {
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
    fn boxed_clone(&self) -> Option<Box<dyn Module>> {
        Some(Box::new(*self))
    }
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.adaptive_avg_pool2d(self.0).map_err(|e| in_module(e, &self.describe()))
    }
    fn describe(&self) -> String {
        format!("AdaptiveAvgPool2d({:?})", self.0)
    }
}
