//! A custom op written outside kiln: a fused SiLU (y = x·sigmoid(x), one
//! pass instead of two kernels and a temporary), with a host kernel, a CUDA
//! kernel and its gradient, run on the CPU, a simulated GPU and any CUDA
//! device, its gradient checked against finite differences.
//!
//!     cargo run --release -p kiln --example custom_op
//!     KILN_SIM_GPUS=1 cargo run --release -p kiln --example custom_op
//!     scripts/cudasim.sh cargo run -p kiln --example custom_op   # CUDA, simulated

use kiln::{custom_op, num_gpus, CudaArg, CudaLaunch, CustomOp, DType, Device, Error, HostInput, HostOutput, Operand, Result, Tensor};

/// y = x / (1 + e^(−x)), for f32 and f64.
struct FusedSilu;

/// The CUDA kernels: one thread per element over a grid-stride loop
/// (`GRID_LOOP` and `u64` come from kiln's prelude). The argument struct's
/// fields are the launch's `CudaArg`s, in order.
const SILU_CUDA: &str = r#"
struct SiluArgs { const void* x; void* y; u64 n; };
extern "C" __global__ void silu_f32(SiluArgs a) {
    const float* x = (const float*)a.x;
    float* y = (float*)a.y;
    GRID_LOOP(i, a.n) { float v = x[i]; y[i] = v / (1.0f + expf(-v)); }
}
extern "C" __global__ void silu_f64(SiluArgs a) {
    const double* x = (const double*)a.x;
    double* y = (double*)a.y;
    GRID_LOOP(i, a.n) { double v = x[i]; y[i] = v / (1.0 + exp(-v)); }
}
"#;

impl CustomOp for FusedSilu {
    fn name(&self) -> &'static str {
        "fused_silu"
    }
    fn output(&self, inputs: &[Operand]) -> Result<Operand> {
        match (inputs.len(), inputs[0].dtype) {
            (1, DType::F32 | DType::F64) => Ok(inputs[0].clone()),
            _ => Err(Error::InvalidArgument { op: "fused_silu".into(), msg: format!("takes one f32 or f64 tensor, got {inputs:?}") }),
        }
    }
    fn host(&self, inputs: &[HostInput<'_>], out: &mut HostOutput<'_>) -> Result<()> {
        match inputs[0].dtype() {
            DType::F32 => out.data_mut::<f32>()?.iter_mut().zip(inputs[0].data::<f32>()?).for_each(|(y, &x)| *y = x / (1.0 + (-x).exp())),
            _ => out.data_mut::<f64>()?.iter_mut().zip(inputs[0].data::<f64>()?).for_each(|(y, &x)| *y = x / (1.0 + (-x).exp())),
        }
        Ok(())
    }
    fn cuda_source(&self) -> Option<&'static str> {
        Some(SILU_CUDA)
    }
    fn cuda_launch(&self, inputs: &[Operand], out: &Operand) -> Result<CudaLaunch> {
        let function = if out.dtype == DType::F32 { "silu_f32" } else { "silu_f64" };
        let n = inputs[0].elem_count();
        Ok(CudaLaunch::elementwise(function, n, vec![CudaArg::Input(0), CudaArg::Output, CudaArg::U64(n as u64)]))
    }
    /// dy/dx = s + x·s·(1 − s), s = sigmoid(x) (and 1 − s = sigmoid(−x)).
    fn backward(&self, inputs: &[Tensor], _output: &Tensor, grad: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let x = &inputs[0];
        let s = x.sigmoid()?;
        let slope = (&s + &((x * &s)? * &x.neg()?.sigmoid()?)?)?;
        Ok(vec![Some((grad * &slope)?)])
    }
}

fn main() -> Result<()> {
    let mut devices = vec![Device::Cpu];
    devices.extend((0..num_gpus()).map(kiln::gpu));
    for device in devices {
        kiln::manual_seed(0);
        let x = Tensor::randn((3, 4), &device)?.to_dtype(DType::F64)?.requires_grad_();
        let fused = custom_op(FusedSilu, &[&x])?;
        let composed = (&x * &x.sigmoid()?)?;
        let diff = (&fused - &composed)?.abs()?.max_all()?.to_scalar::<f64>()?;
        fused.sum_all()?.backward()?;
        let grad = x.grad().expect("x requires grad").to_vec::<f64>()?;
        // Central differences of the op itself, element by element.
        let (values, h) = (x.to_vec::<f64>()?, 1e-6);
        let mut worst = 0f64;
        for (i, &v) in values.iter().enumerate() {
            let silu = |v: f64| -> Result<f64> {
                let mut at = values.clone();
                at[i] = v;
                custom_op(FusedSilu, &[&Tensor::from_vec(at, (3, 4), &device)?])?.sum_all()?.to_scalar::<f64>()
            };
            let numeric = (silu(v + h)? - silu(v - h)?) / (2.0 * h);
            worst = worst.max((numeric - grad[i]).abs());
        }
        println!("fused_silu on {device}: |fused − composed| ≤ {diff:.1e}, |gradient − finite differences| ≤ {worst:.1e}");
        if diff > 1e-12 || worst > 1e-6 {
            return Err(Error::InvalidArgument { op: "fused_silu".into(), msg: format!("disagrees on {device}: {diff:e}, {worst:e}") });
        }
    }
    Ok(())
}
