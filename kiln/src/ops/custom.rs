//! Custom ops: a user's op with its own host kernel, optional CUDA kernel
//! and gradient, run by kiln as one of its own (candle's `CustomOp1/2/3`,
//! PyTorch's `torch.library.custom_op` with `register_autograd`).
//!
//! [`CustomOp`] is the public face of the crate's own `CustomKernel`: the
//! front end checks devices, asks the op for its output's dims and dtype,
//! makes strided inputs contiguous, and runs the op through the same path as
//! every built-in op (the device's queue, the memory ledger, poisoned
//! results after a fault). A simulated GPU runs the host kernel; a CUDA
//! device compiles the op's source once per process and device (NVRTC, after
//! kiln's prelude) and launches the function the op names.

use crate::base::buffer::CpuBuffer;
use crate::base::buffer::WithDType;
use crate::base::dtype::DType;
use crate::base::error::{Error, Result};
use crate::base::shape::Shape;
use crate::kernel::cuda::{CudaDevice, CudaModule, KernelArgs};
use crate::kernel::storage::Storage;
use crate::kernel::{CustomKernel, HostIn, Kernel, OpRef, Src};
use crate::Tensor;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The dims and dtype of a custom op's input or output, as
/// [`CustomOp::output`] and [`CustomOp::cuda_launch`] see them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Operand {
    /// The dimensions (row-major, contiguous when the kernel sees them).
    pub dims: Vec<usize>,
    /// The element type.
    pub dtype: DType,
}

impl Operand {
    /// Number of elements.
    pub fn elem_count(&self) -> usize {
        self.dims.iter().product()
    }
}

/// An input of a custom op's host kernel: contiguous, row-major elements.
pub struct HostInput<'a> {
    op: &'static str,
    buf: &'a CpuBuffer,
    start: usize,
    dims: &'a [usize],
}

impl<'a> HostInput<'a> {
    /// The dimensions.
    pub fn dims(&self) -> &[usize] {
        self.dims
    }
    /// The element type.
    pub fn dtype(&self) -> DType {
        self.buf.dtype()
    }
    /// The elements as `T`; an error naming both dtypes when the input
    /// holds another type.
    pub fn data<T: WithDType>(&self) -> Result<&'a [T]> {
        let len: usize = self.dims.iter().product();
        let all = T::slice(self.buf).ok_or_else(|| wrong_type(self.op, self.buf.dtype(), T::DTYPE, "an input"))?;
        all.get(self.start..self.start + len).ok_or_else(|| Error::invalid(self.op, "an input is shorter than its dims"))
    }
}

/// The output of a custom op's host kernel: contiguous, row-major, zeroed
/// before the kernel runs (as a CUDA kernel's is), to be written whole.
pub struct HostOutput<'a> {
    op: &'static str,
    buf: &'a mut CpuBuffer,
    dims: &'a [usize],
}

impl HostOutput<'_> {
    /// The dimensions.
    pub fn dims(&self) -> &[usize] {
        self.dims
    }
    /// The element type.
    pub fn dtype(&self) -> DType {
        self.buf.dtype()
    }
    /// The elements as `T`, to write; an error naming both dtypes when the
    /// output is of another type.
    pub fn data_mut<T: WithDType>(&mut self) -> Result<&mut [T]> {
        let dtype = self.buf.dtype();
        T::slice_mut(self.buf).ok_or_else(|| wrong_type(self.op, dtype, T::DTYPE, "the output"))
    }
}

fn wrong_type(op: &str, has: DType, asked: DType, what: &str) -> Error {
    Error::invalid(
        op,
        format!("{what} holds {has}, not {asked}: read it as its own dtype (`data::<{has}>()`), or convert it before the op"),
    )
}

/// One field of a custom CUDA kernel's argument struct.
///
/// The kernel takes one parameter, a struct whose fields are these, in
/// order, each 8 bytes: a device pointer (`const float*`, `double*`, ...)
/// for an input or the output, `unsigned long long`, `long long` or
/// `double` for a number.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub enum CudaArg {
    /// The device address of input `i` (contiguous, its first element).
    Input(usize),
    /// The device address of the output (contiguous).
    Output,
    /// An `unsigned long long`.
    U64(u64),
    /// A `long long`.
    I64(i64),
    /// A `double`.
    F64(f64),
}

/// How to launch a custom op's CUDA kernel: the `extern "C"` function of
/// [`CustomOp::cuda_source`], a 1-d grid of `grid` blocks of `block`
/// threads, and its argument struct's fields.
#[derive(Clone, Debug, PartialEq)]
pub struct CudaLaunch {
    /// The kernel's name in the source (`extern "C" __global__ void name(Args a)`).
    pub function: String,
    /// Blocks (at least 1).
    pub grid: u32,
    /// Threads per block (1 to 1024).
    pub block: u32,
    /// The argument struct's fields, in order.
    pub args: Vec<CudaArg>,
}

impl CudaLaunch {
    /// A launch for a grid-stride loop over `n` elements: blocks of 256
    /// threads, as many blocks as cover `n` (at most 65,535; the loop
    /// covers the rest).
    pub fn elementwise(function: impl Into<String>, n: usize, args: Vec<CudaArg>) -> CudaLaunch {
        CudaLaunch { function: function.into(), grid: n.div_ceil(256).clamp(1, 65_535) as u32, block: 256, args }
    }
}

/// A user's op, run by kiln on every device kind: a host kernel (the CPU
/// and simulated GPUs), optionally a CUDA kernel (CUDA devices, and the CUDA
/// simulator), and optionally a gradient. Apply it with [`custom_op`] or
/// [`Tensor::apply_op`].
///
/// The host kernel sees contiguous inputs and writes a contiguous output
/// whose dims and dtype [`output`](CustomOp::output) decides (by default the
/// first input's). The CUDA source is compiled once per process and device,
/// after kiln's prelude (`u64`, `i64`, the `GRID_LOOP(i, n)` grid-stride
/// loop); an op without one refuses CUDA inputs by name. The gradient is
/// written with tensor ops, so it runs on the inputs' device and can itself
/// be differentiated; an op without one fails at `backward`, naming itself.
///
/// ```
/// use kiln::{custom_op, CustomOp, HostInput, HostOutput, Result, Tensor, cpu};
///
/// /// y = x³, with dy/dx = 3x².
/// struct Cube;
///
/// impl CustomOp for Cube {
///     fn name(&self) -> &'static str {
///         "cube"
///     }
///     fn host(&self, inputs: &[HostInput<'_>], out: &mut HostOutput<'_>) -> Result<()> {
///         let x = inputs[0].data::<f32>()?;
///         for (y, x) in out.data_mut::<f32>()?.iter_mut().zip(x) {
///             *y = x * x * x;
///         }
///         Ok(())
///     }
///     fn backward(&self, inputs: &[Tensor], _output: &Tensor, grad: &Tensor) -> Result<Vec<Option<Tensor>>> {
///         let x = &inputs[0];
///         Ok(vec![Some((((x * x)? * 3.0)? * grad)?)])
///     }
/// }
///
/// let x = Tensor::new(&[1f32, 2., -3.], &cpu())?.requires_grad_();
/// let y = custom_op(Cube, &[&x])?;
/// assert_eq!(y.to_vec::<f32>()?, [1., 8., -27.]);
/// y.sum_all()?.backward()?;
/// assert_eq!(x.grad().unwrap().to_vec::<f32>()?, [3., 12., 27.]);
/// # Ok::<(), kiln::Error>(())
/// ```
pub trait CustomOp: Send + Sync + 'static {
    /// The op's name: errors, the memory ledger and the CUDA module name it.
    /// Ops with different CUDA sources need different names.
    fn name(&self) -> &'static str;

    /// The output's dims and dtype from the inputs' (never empty). By
    /// default, the first input's.
    fn output(&self, inputs: &[Operand]) -> Result<Operand> {
        Ok(inputs[0].clone())
    }

    /// Computes the output on the host (the CPU, simulated GPUs).
    fn host(&self, inputs: &[HostInput<'_>], out: &mut HostOutput<'_>) -> Result<()>;

    /// CUDA C++ source defining the kernel that [`cuda_launch`]
    /// (CustomOp::cuda_launch) names; `None` (the default): the op has no
    /// CUDA kernel and refuses inputs on a CUDA device.
    fn cuda_source(&self) -> Option<&'static str> {
        None
    }

    /// The launch of the CUDA kernel for these inputs and output.
    fn cuda_launch(&self, inputs: &[Operand], out: &Operand) -> Result<CudaLaunch> {
        let _ = (inputs, out);
        Err(Error::invalid(self.name(), "the op gives `cuda_source` but no `cuda_launch`: implement CustomOp::cuda_launch"))
    }

    /// The gradient of each input (`None`: none to it) from the inputs, the
    /// output and the output's gradient, written with tensor ops. By
    /// default, an error: the op has no gradient.
    fn backward(&self, inputs: &[Tensor], output: &Tensor, grad: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let _ = (inputs, output, grad);
        Err(Error::invalid(
            self.name(),
            "the custom op has no gradient: implement CustomOp::backward, or compute it under `kiln::no_grad()` or on detached inputs",
        ))
    }
}

/// Applies `op` to `inputs` (at least one, all on one device) on their
/// device: see [`CustomOp`]. Strided inputs are made contiguous first; the
/// result is recorded for autograd when an input requires gradients.
///
/// ```
/// use kiln::{custom_op, CustomOp, HostInput, HostOutput, Operand, Result, Tensor, cpu};
///
/// /// out = a·x + y, two inputs of one shape.
/// struct Axpy(f64);
///
/// impl CustomOp for Axpy {
///     fn name(&self) -> &'static str {
///         "axpy"
///     }
///     fn output(&self, inputs: &[Operand]) -> Result<Operand> {
///         if inputs.len() != 2 || inputs[0] != inputs[1] {
///             return Err(kiln::Error::InvalidArgument { op: "axpy".into(), msg: format!("needs two inputs of one shape and dtype, got {inputs:?}") });
///         }
///         Ok(inputs[0].clone())
///     }
///     fn host(&self, inputs: &[HostInput<'_>], out: &mut HostOutput<'_>) -> Result<()> {
///         let (x, y) = (inputs[0].data::<f64>()?, inputs[1].data::<f64>()?);
///         for ((o, x), y) in out.data_mut::<f64>()?.iter_mut().zip(x).zip(y) {
///             *o = self.0 * x + y;
///         }
///         Ok(())
///     }
/// }
///
/// let x = Tensor::new(&[1f64, 2.], &cpu())?;
/// let y = Tensor::new(&[10f64, 20.], &cpu())?;
/// assert_eq!(custom_op(Axpy(3.0), &[&x, &y])?.to_vec::<f64>()?, [13., 26.]);
/// # Ok::<(), kiln::Error>(())
/// ```
#[track_caller]
pub fn custom_op(op: impl CustomOp, inputs: &[&Tensor]) -> Result<Tensor> {
    run(Arc::new(op), inputs)
}

impl Tensor {
    /// Applies the one-input custom op `op` to this tensor:
    /// [`custom_op`]`(op, &[self])`.
    #[track_caller]
    pub fn apply_op(&self, op: impl CustomOp) -> Result<Tensor> {
        run(Arc::new(op), &[self])
    }
}

fn run(op: Arc<dyn CustomOp>, inputs: &[&Tensor]) -> Result<Tensor> {
    let name = op.name();
    let Some(first) = inputs.first() else {
        return Err(Error::invalid(name, "a custom op needs at least one input (it runs on its inputs' device)"));
    };
    for t in &inputs[1..] {
        crate::tensor::check_same_device(name, first, t)?;
    }
    let operands: Vec<Operand> = inputs.iter().map(|t| Operand { dims: t.dims().to_vec(), dtype: t.dtype() }).collect();
    let out = op.output(&operands)?;
    let contiguous: Vec<Tensor> =
        inputs.iter().map(|t| if t.is_contiguous() { Ok((*t).clone()) } else { t.contiguous() }).collect::<Result<_>>()?;
    let kernel_op = UserKernel { op: op.clone(), operands, out: out.clone() };
    let kernel = Kernel::Custom { op: OpRef::Borrowed(&kernel_op), inputs: contiguous.iter().map(|t| t.src()).collect() };
    let t = contiguous[0].run_new(kernel, out.dtype, Shape::from(out.dims.clone()))?;
    Ok(crate::autograd::record(t, inputs, true, move || {
        Box::new(move |c| {
            let output = c.output.ok_or_else(|| Error::invalid(op.name(), "the forward output was not kept"))?;
            let grads = op.backward(c.inputs, output, c.g)?;
            check_grads(op.name(), c.inputs, &grads)?;
            Ok(grads.into_iter().collect())
        })
    }))
}

/// A gradient per input, each of its input's dims and on its device.
fn check_grads(name: &str, inputs: &[Tensor], grads: &[Option<Tensor>]) -> Result<()> {
    if grads.len() != inputs.len() {
        return Err(Error::invalid(
            name,
            format!("backward returned {} gradients for {} inputs: return one per input (`None` for none)", grads.len(), inputs.len()),
        ));
    }
    for (i, (x, g)) in inputs.iter().zip(grads).enumerate() {
        let Some(g) = g else { continue };
        if g.dims() != x.dims() {
            return Err(Error::invalid(
                name,
                format!("backward returned a gradient of dims {:?} for input {i} of dims {:?}", g.dims(), x.dims()),
            ));
        }
        crate::tensor::check_same_device(name, x, g)?;
    }
    Ok(())
}

/// A custom op as the crate's kernels see it, with the operands it was
/// applied to.
#[derive(Clone)]
struct UserKernel {
    op: Arc<dyn CustomOp>,
    operands: Vec<Operand>,
    out: Operand,
}

impl CustomKernel for UserKernel {
    fn name(&self) -> &'static str {
        self.op.name()
    }
    fn host(&self, inputs: &[HostIn<'_>], out: &mut CpuBuffer, _threads: usize) -> Result<()> {
        // The front end made every input contiguous (`run`): each is its
        // buffer from its offset.
        let mut host_inputs = Vec::with_capacity(inputs.len());
        for (i, operand) in inputs.iter().zip(&self.operands) {
            if !i.layout.is_contiguous() {
                return Err(Error::invalid(self.op.name(), "internal: a custom op's input reached its kernel strided"));
            }
            host_inputs.push(HostInput { op: self.op.name(), buf: i.buf, start: i.layout.offset(), dims: &operand.dims });
        }
        // A fresh output may be a recycled buffer: zero it, so that what the
        // op leaves unwritten reads as zeros, never as another tensor's data.
        crate::map_buffer!(&mut *out, v => v.iter_mut().for_each(|x| *x = WithDType::from_f64(0.0)));
        self.op.host(&host_inputs, &mut HostOutput { op: self.op.name(), buf: out, dims: &self.out.dims })
    }
    fn cuda(&self, dev: &dyn CudaDevice, inputs: &[Src<'_>], out: &Storage) -> Result<()> {
        let name = self.op.name();
        let source = self.op.cuda_source().ok_or_else(|| {
            Error::invalid(name, "the custom op has no CUDA kernel (`CustomOp::cuda_source`): move its inputs to the CPU first (`x.to(&kiln::cpu())?`), or give it one")
        })?;
        let module = module_for(name, source)?;
        let launch = self.op.cuda_launch(&self.operands, &self.out)?;
        if launch.grid == 0 || launch.block == 0 || launch.block > 1024 {
            return Err(Error::invalid(
                name,
                format!("a CUDA launch needs 1 or more blocks of 1 to 1024 threads, got {} blocks of {}", launch.grid, launch.block),
            ));
        }
        if launch.function.is_empty() || !launch.function.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(Error::invalid(name, format!("`{}` is not a C function name", launch.function)));
        }
        let mut bytes = Vec::with_capacity(8 * launch.args.len());
        for arg in &launch.args {
            let field = match *arg {
                CudaArg::Input(i) => {
                    let src =
                        inputs.get(i).ok_or_else(|| Error::invalid(name, format!("the launch names input {i} of {}", inputs.len())))?;
                    let offset = (src.layout.offset() * src.storage.dtype.size_in_bytes()) as u64;
                    (dev.ptr(&src.storage)? + offset).to_ne_bytes()
                }
                CudaArg::Output => dev.ptr(out)?.to_ne_bytes(),
                CudaArg::U64(v) => v.to_ne_bytes(),
                CudaArg::I64(v) => v.to_ne_bytes(),
                CudaArg::F64(v) => v.to_ne_bytes(),
            };
            bytes.extend_from_slice(&field);
        }
        // As on the host: the output starts zeroed (device memory is reused).
        dev.memset_zero(dev.ptr(out)?, self.out.elem_count() * self.out.dtype.size_in_bytes())?;
        dev.launch(module, &launch.function, launch.grid, launch.block, &ArgBytes(bytes))
    }
    fn to_shared(&self) -> Arc<dyn CustomKernel> {
        Arc::new(self.clone())
    }
}

/// A custom kernel's argument struct, as bytes.
struct ArgBytes(Vec<u8>);

impl KernelArgs for ArgBytes {
    fn bytes(&self) -> &[u8] {
        &self.0
    }
}

/// The CUDA module of each custom op name, with the source it was made from:
/// made once (the backends cache compiled modules by module name, for the
/// life of the process).
type Modules = HashMap<&'static str, (&'static str, &'static CudaModule)>;
static MODULES: Mutex<Option<Modules>> = Mutex::new(None);

fn module_for(name: &'static str, source: &'static str) -> Result<&'static CudaModule> {
    let mut modules = MODULES.lock().unwrap_or_else(|e| e.into_inner());
    let modules = modules.get_or_insert_with(HashMap::new);
    if let Some(&(known, m)) = modules.get(name) {
        // Every launch asks: the same text is usually the same pointer.
        if !std::ptr::eq(known, source) && known != source {
            return Err(Error::invalid(name, "two custom ops of this name give different CUDA sources: give each op a name of its own"));
        }
        return Ok(m);
    }
    // Leaked once per op name: the module lives as long as the backends'
    // caches, which key on its name.
    let module_name: &'static str = Box::leak(format!("custom_{name}").into_boxed_str());
    let module: &'static CudaModule = Box::leak(Box::new(CudaModule::text(module_name, source)));
    modules.insert(name, (source, module));
    Ok(module)
}
