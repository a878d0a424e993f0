//! The unary family: elementwise functions of one operand, each one entry of
//! the list below (name, dtypes, host expression, CUDA expression, scalars,
//! gradient), or an entry naming its own file when it needs more room
//! (`in erf`). The family shares its loops (dense, strided, parallel, in
//! place), the CPU's small-operand path and one CUDA module, `unary`,
//! generated from the entries; `Tensor::unary` is its front end.

mod family;

use super::{mask_scalar, zero_where};
use crate::backends::host::loops::{Apply, InPlace, Mapped};
use crate::backends::host::num::{powi, Float, Num};
use crate::base::buffer::CpuBuffer;
use crate::base::dtype::DType;
use crate::base::error::{Error, Result};
use crate::base::shape::Layout;
use crate::kernel::cuda::{c_type, dtype_tag, CudaModule, FamilyCall, UnaryArgs};
use crate::kernel::{Kernel, OpRef, UnaryKernel};
use crate::ops::binary::BinaryOp;
use crate::tensor::check_compute;
use crate::Tensor;
use family::unary_family;
use std::sync::Arc;

unary_family! {
    num {
        /// −x
        Neg => "neg", host |x| x.neg(), cuda "Ar<T>::neg(x)", grad |g, _x| g.neg();
        /// |x|; the gradient is sign(x) (0 at 0).
        Abs => "abs", host |x| x.abs(), cuda "Ar<T>::abs(x)",
            grad |g, x| g.mul(&mask_scalar(x, BinaryOp::Gt, 0.0)?.sub(&mask_scalar(x, BinaryOp::Lt, 0.0)?)?);
        /// x²
        Sqr => "sqr", host |x| x.mul(x), cuda "Ar<T>::mul(x, x)", grad |g, x| g.mul(&x.mul_scalar(2.0)?);
        /// max(x, 0); the gradient is 0 where x ≤ 0 (PyTorch's threshold_backward: a NaN input passes it).
        Relu => "relu", host |x| x.max(T::ZERO), cuda "Ar<T>::mx(x, Cv<T>::from(0.0))",
            grad |g, x| zero_where(&x.binary(&x.scalar_like(0.0)?, BinaryOp::Le)?, g);
        /// xⁿ by repeated multiplication, never through powf.
        Powi(n: i32) => "powi", host |x| match n { 2 => x.mul(x), 3 => x.mul(x).mul(x), _ => powi(x, n) },
            cuda "(n == 2 ? Ar<T>::mul(x, x) : n == 3 ? Ar<T>::mul(Ar<T>::mul(x, x), x) : powi(x, (int)n))" scalars (0.0, 0.0, n),
            // d/dx x⁰ = 0 everywhere, 0 included (not 0 · x⁻¹ = NaN).
            grad |g, x| match n.checked_sub(1) {
                _ if n == 0 => g.zeros_like(),
                Some(m) => g.mul(&x.powi(m)?.mul_scalar(n as f64)?),
                None => g.mul(&x.powf(n as f64 - 1.0)?.mul_scalar(n as f64)?),
            };
        /// x + s
        AddScalar(s: f64) => "add_scalar", host |x| x.add(T::from_f64(s)), cuda "Ar<T>::add(x, a)" scalars (s, 0.0, 0),
            grad |g, _x| Ok(g.clone());
        /// x − s
        SubScalar(s: f64) => "sub_scalar", host |x| x.sub(T::from_f64(s)), cuda "Ar<T>::sub(x, a)" scalars (s, 0.0, 0),
            grad |g, _x| Ok(g.clone());
        /// s − x
        RSubScalar(s: f64) => "rsub_scalar", host |x| T::from_f64(s).sub(x), cuda "Ar<T>::sub(a, x)" scalars (s, 0.0, 0),
            grad |g, _x| g.neg();
        /// x · s
        MulScalar(s: f64) => "mul_scalar", host |x| x.mul(T::from_f64(s)), cuda "Ar<T>::mul(x, a)" scalars (s, 0.0, 0),
            grad |g, _x| g.mul_scalar(s);
        /// x / s
        DivScalar(s: f64) => "div_scalar", host |x| x.div(T::from_f64(s)), cuda "Ar<T>::div(x, a)" scalars (s, 0.0, 0),
            grad |g, _x| g.div_scalar(s);
        /// max(x, s); the gradient passes strictly above s (PyTorch 2.x's clamp_min backward).
        MaxScalar(s: f64) => "maximum_scalar", host |x| x.max(T::from_f64(s)), cuda "Ar<T>::mx(x, a)" scalars (s, 0.0, 0),
            grad |g, x| g.mul(&mask_scalar(x, BinaryOp::Gt, s)?);
        /// min(x, s); the gradient passes strictly below s.
        MinScalar(s: f64) => "minimum_scalar", host |x| x.min(T::from_f64(s)), cuda "Ar<T>::mn(x, a)" scalars (s, 0.0, 0),
            grad |g, x| g.mul(&mask_scalar(x, BinaryOp::Lt, s)?);
        /// x · a + b in one pass.
        Affine(m: f64, b: f64) => "affine", host |x| x.mul(T::from_f64(m)).add(T::from_f64(b)),
            cuda "Ar<T>::add(Ar<T>::mul(x, a), b)" scalars (m, b, 0), grad |g, _x| g.mul_scalar(m);
    }
    float {
        /// eˣ; the gradient reuses it: g · eˣ.
        Exp => "exp", host |x| x.exp(), cuda "Fl<T>::exp(x)", grad |g, _x, y| g.mul(y);
        /// Natural logarithm.
        Log => "log", host |x| x.ln(), cuda "Fl<T>::log(x)", grad |g, x| g.div(x);
        /// Square root; the gradient reuses it: g / (2√x).
        Sqrt => "sqrt", host |x| x.sqrt(), cuda "Fl<T>::sqrt(x)", grad |g, _x, y| g.div(&y.mul_scalar(2.0)?);
        /// 1/x; the gradient reuses it: −g · (1/x)².
        Recip => "recip", host |x| T::ONE.div(x), cuda "Ar<T>::div(Cv<T>::from(1.0), x)", grad |g, _x, y| g.neg()?.mul(&y.sqr()?);
        /// Sine.
        Sin => "sin", host |x| x.sin(), cuda "Fl<T>::sin(x)", grad |g, x| g.mul(&x.cos()?);
        /// Cosine.
        Cos => "cos", host |x| x.cos(), cuda "Fl<T>::cos(x)", grad |g, x| g.mul(&x.sin()?.neg()?);
        /// Hyperbolic tangent; the gradient reuses it: g · (1 − tanh²).
        Tanh => "tanh", host |x| x.tanh(), cuda "Fl<T>::tanh(x)", grad |g, _x, y| g.binary(y, BinaryOp::TanhBackward);
        /// Logistic sigmoid 1/(1+e⁻ˣ); the gradient reuses it: g · σ(1 − σ).
        Sigmoid => "sigmoid", host |x| T::ONE.div(T::ONE.add(x.neg().exp())),
            cuda "Ar<T>::div(Cv<T>::from(1.0), Ar<T>::add(Cv<T>::from(1.0), Fl<T>::exp(Ar<T>::neg(x))))",
            grad |g, _x, y| g.binary(y, BinaryOp::SigmoidBackward);
        /// The error function 2/√π ∫₀ˣ e^(−t²) dt (exact GELU needs it); its gradient is 2/√π · e^(−x²).
        Erf => "erf", host |x| x.via(libm::erff, libm::erf), cuda "erff(x)" | "erf(x)",
            grad |g, x| g.mul(&x.sqr()?.neg()?.exp()?.mul_scalar(std::f64::consts::FRAC_2_SQRT_PI)?);
        /// xᵖ for a real p; d/dx x⁰ = 0 everywhere.
        Powf(p: f64) => "powf", host |x| x.pow(T::from_f64(p)), cuda "Fl<T>::pow(x, a)" scalars (p, 0.0, 0),
            grad |g, x| if p == 0.0 { g.zeros_like() } else { g.mul(&x.powf(p - 1.0)?.mul_scalar(p)?) };
        /// s / x
        RDivScalar(s: f64) => "rdiv_scalar", host |x| T::from_f64(s).div(x), cuda "Ar<T>::div(a, x)" scalars (s, 0.0, 0),
            grad |g, x| g.mul(&x.sqr()?.unary(UnaryOp::RDivScalar(-s))?);
    }
}

fn missing_output(op: UnaryOp) -> Error {
    Error::KernelFailed {
        device: crate::Device::Cpu,
        op: op.name().into(),
        msg: "the gradient needs the forward output, which was not kept (a kiln bug: please report it)".into(),
    }
}

impl UnaryOp {
    /// powi(2) and powi(3) in loops of their own, for every dtype; `a` back
    /// for any other op. The member's expression matches on n at every
    /// element, which keeps its loop scalar (W3's y³ took four instructions
    /// an element). The same arithmetic as the member's arms, so the same
    /// bits.
    #[inline(always)]
    fn small_powi<T: Num, A: Apply<T>>(self, a: A) -> std::result::Result<(), A> {
        match self {
            UnaryOp::Powi(2) => a.apply(|x: T| x.mul(x)),
            UnaryOp::Powi(3) => a.apply(|x: T| x.mul(x).mul(x)),
            _ => return Err(a),
        }
        Ok(())
    }

    /// [`UnaryOp::host_float`], after [`UnaryOp::small_powi`].
    #[inline(always)]
    fn float_loop<T: Float, A: Apply<T>>(self, a: A) -> bool {
        self.small_powi(a).map_or_else(|a| self.host_float(a), |()| true)
    }

    /// [`UnaryOp::host_num`], after [`UnaryOp::small_powi`].
    #[inline(always)]
    fn num_loop<T: Num, A: Apply<T>>(self, a: A) -> bool {
        self.small_powi(a).map_or_else(|a| self.host_num(a), |()| true)
    }
}

impl UnaryKernel for UnaryOp {
    fn name(&self) -> &'static str {
        UnaryOp::name(*self)
    }
    fn host(&self, src: &CpuBuffer, layout: &Layout, out: &mut CpuBuffer, threads: usize) -> bool {
        match (src, out) {
            (CpuBuffer::F32(s), CpuBuffer::F32(o)) => self.float_loop(Mapped { src: s, layout, out: o, threads }),
            (CpuBuffer::F64(s), CpuBuffer::F64(o)) => self.float_loop(Mapped { src: s, layout, out: o, threads }),
            (CpuBuffer::I64(s), CpuBuffer::I64(o)) => self.num_loop(Mapped { src: s, layout, out: o, threads }),
            (CpuBuffer::I32(s), CpuBuffer::I32(o)) => self.num_loop(Mapped { src: s, layout, out: o, threads }),
            (CpuBuffer::U8(s), CpuBuffer::U8(o)) => self.num_loop(Mapped { src: s, layout, out: o, threads }),
            // f16/bf16 are refused by the front end, as are mixed dtypes.
            _ => false,
        }
    }
    fn host_in_place(&self, buf: &mut CpuBuffer, threads: usize) -> bool {
        match buf {
            CpuBuffer::F32(v) => self.float_loop(InPlace { buf: v, threads }),
            CpuBuffer::F64(v) => self.float_loop(InPlace { buf: v, threads }),
            CpuBuffer::I64(v) => self.num_loop(InPlace { buf: v, threads }),
            CpuBuffer::I32(v) => self.num_loop(InPlace { buf: v, threads }),
            CpuBuffer::U8(v) => self.num_loop(InPlace { buf: v, threads }),
            CpuBuffer::F16(_) | CpuBuffer::BF16(_) => false,
        }
    }
    fn cuda(&self, dtype: DType) -> FamilyCall {
        let (a, b, n) = self.scalars();
        FamilyCall { module: &MODULE, kernel: format!("unary_{}_{}", self.name(), dtype_tag(dtype)), a, b, n }
    }
    fn to_shared(&self) -> Arc<dyn UnaryKernel> {
        Arc::new(*self)
    }
}

/// The family's CUDA module: one kernel per member and dtype.
pub(crate) static MODULE: CudaModule = CudaModule::generated("unary", cuda_source);
inventory::submit! { crate::kernel::cuda::DeclaredModule(&MODULE) }

fn cuda_source() -> String {
    let mut s = String::from(UnaryArgs::C_DECL);
    s.push_str(
        r#"
template <typename T, typename F> __device__ __forceinline__ void unary_map(const UnaryArgs& p, F f) {
    const T* src = (const T*)p.src;
    T* out = (T*)p.out;
    T a = Cv<T>::from(p.a), b = Cv<T>::from(p.b);
    i64 n = p.pn;
    if (p.sl.rank == 1 && p.sl.strides[0] == 1) {
        const T* __restrict__ s = src + p.sl.off;
        T* __restrict__ o = out;
        constexpr int N = PackOf<T>::N;
        if (N > 1 && aligned_to(s, sizeof(T) * N) && aligned_to(o, sizeof(T) * N)) {
            u64 packs = p.n / N;
            GRID_LOOP(v, packs) {
                Pack<T, N> sv = ((const Pack<T, N>*)s)[v], ov;
#pragma unroll
                for (int k = 0; k < N; ++k) ov.e[k] = f(sv.e[k], a, b, n);
                ((Pack<T, N>*)o)[v] = ov;
            }
            GRID_LOOP(i, p.n - packs * N) o[packs * N + i] = f(s[packs * N + i], a, b, n);
        } else {
            GRID_LOOP(i, p.n) o[i] = f(s[i], a, b, n);
        }
    } else {
        GRID_LOOP(i, p.n) out[i] = f(src[lay_off(p.sl, i)], a, b, n);
    }
}
"#,
    );
    for &(name, float_only, expr32, expr64) in MEMBERS {
        let dtypes: &[DType] =
            if float_only { &[DType::F32, DType::F64] } else { &[DType::F32, DType::F64, DType::I64, DType::I32, DType::U8] };
        for &dt in dtypes {
            let (tag, ty) = (dtype_tag(dt), c_type(dt));
            let expr = if dt == DType::F64 { expr64 } else { expr32 };
            s.push_str(&format!(
                "struct unary_{name}_{tag}_fn {{ typedef {ty} T; __device__ __forceinline__ T operator()(T x, T a, T b, i64 n) const {{ return {expr}; }} }};\n\
                 extern \"C\" __global__ void unary_{name}_{tag}(UnaryArgs p) {{ unary_map<{ty}>(p, unary_{name}_{tag}_fn()); }}\n"
            ));
        }
    }
    s
}

/// Whether an integer tensor of `dtype` must compute `op` in f32: a float
/// function, true division, or a scalar that an integer of the dtype cannot
/// hold (the scalars of every member are checked, so a new member needs no
/// entry here).
fn promotes_integers(op: UnaryOp, dtype: DType) -> bool {
    if op.float_only() || matches!(op, UnaryOp::DivScalar(_)) {
        return true;
    }
    let (lo, hi) = match dtype {
        DType::U8 => (0.0, 255.0),
        DType::I32 => (i32::MIN as f64, i32::MAX as f64),
        _ => (i64::MIN as f64, i64::MAX as f64),
    };
    let fits = |s: f64| s.is_finite() && s.fract() == 0.0 && s >= lo && s <= hi;
    let (a, b, _) = op.scalars();
    !fits(a) || !fits(b)
}

macro_rules! unary_fns {
    ($($(#[$doc:meta])* $name:ident => $op:expr;)*) => {
        $( $(#[$doc])* pub fn $name(&self) -> Result<Tensor> { self.unary($op) } )*
    };
}

impl Tensor {
    /// Applies a member of the unary family.
    ///
    /// Type promotion follows PyTorch for a tensor and a Rust scalar: an
    /// integer tensor gives an f32 result for float functions (`exp`,
    /// `sqrt`...), for `div_scalar` (true division), and for a scalar that
    /// an integer of its dtype cannot hold (fractional, non-finite or out of
    /// range: `i64 · 0.5`, `u8 + (−1.0)`). An integral scalar in range keeps
    /// the integer dtype (Rust scalars are all f64, so kiln cannot tell
    /// `2` from `2.0` as Python does; see the README's table of differences).
    ///
    /// ```
    /// use kiln::{Tensor, DType, cpu};
    /// let x = Tensor::new(&[1i64, 2, 3], &cpu())?;
    /// assert_eq!(x.div_scalar(0.5)?.to_vec::<f32>()?, vec![2., 4., 6.]);
    /// assert_eq!(x.add_scalar(1.0)?.dtype(), DType::I64);
    /// let b = Tensor::new(&[0u8, 5], &cpu())?;
    /// assert_eq!((&b + -1.0)?.to_vec::<f32>()?, vec![-1., 4.]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn unary(&self, op: UnaryOp) -> Result<Tensor> {
        let dtype = self.dtype();
        check_compute(op.name(), dtype)?;
        if !dtype.is_float() && promotes_integers(op, dtype) {
            return self.to_dtype(DType::F32)?.unary(op);
        }
        let t = self.run_new_same_shape(Kernel::Unary { op: OpRef::Borrowed(&op), src: self.src() }, dtype)?;
        Ok(crate::autograd::record(t, &[self], op.saves_output(), || {
            Box::new(move |c| Ok(smallvec::smallvec![Some(op.grad(c.g, &c.inputs[0], c.output)?)]))
        }))
    }

    /// [`unary`](Self::unary) of a tensor given by value, as in
    /// `(x.sqr()? - 0.5)?`: when nothing else can see its storage (no other
    /// tensor, view or autograd node holds it) and the op keeps its dtype,
    /// the result is written over it on the CPU, saving an allocation and a
    /// pass over memory (numpy's temporary elision). Otherwise as `unary`.
    pub(crate) fn unary_owned(mut self, op: UnaryOp) -> Result<Tensor> {
        let dtype = self.dtype();
        let keeps_dtype = !matches!(dtype, DType::F16 | DType::BF16) && (dtype.is_float() || !promotes_integers(op, dtype));
        let whole = self.layout.offset == 0 && self.layout.is_contiguous() && self.layout.elem_count() == self.storage.len;
        if keeps_dtype
            && whole
            && self.node.is_none()
            && self.storage.device == crate::Device::Cpu
            && let Some(buf) = self.storage.get_mut().and_then(|s| s.host_mut())
            && op.host_in_place(buf, crate::runtime::pool::threads())
        {
            return Ok(self);
        }
        self.unary(op)
    }

    unary_fns! {
        /// −x
        neg => UnaryOp::Neg;
        /// |x|
        abs => UnaryOp::Abs;
        /// eˣ
        exp => UnaryOp::Exp;
        /// Natural logarithm.
        log => UnaryOp::Log;
        /// Square root.
        sqrt => UnaryOp::Sqrt;
        /// x²
        sqr => UnaryOp::Sqr;
        /// 1/x
        recip => UnaryOp::Recip;
        /// Sine.
        sin => UnaryOp::Sin;
        /// Cosine.
        cos => UnaryOp::Cos;
        /// Hyperbolic tangent.
        tanh => UnaryOp::Tanh;
        /// Logistic sigmoid.
        sigmoid => UnaryOp::Sigmoid;
        /// max(x, 0)
        relu => UnaryOp::Relu;
        /// The error function erf(x) = 2/√π ∫₀ˣ e^(−t²) dt.
        erf => UnaryOp::Erf;
    }

    /// xⁿ by repeated multiplication (never through `powf`).
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let x = Tensor::new(&[2f32, -3.], &cpu())?;
    /// assert_eq!(x.powi(3)?.to_vec::<f32>()?, vec![8., -27.]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn powi(&self, n: i32) -> Result<Tensor> {
        if n < 0 && !self.dtype().is_float() {
            return Err(Error::invalid(
                "powi",
                format!("a negative power ({n}) of an integer tensor is not an integer; cast to a float dtype first"),
            ));
        }
        self.unary(UnaryOp::Powi(n))
    }
    /// xᵖ for a real p.
    pub fn powf(&self, p: f64) -> Result<Tensor> {
        self.unary(UnaryOp::Powf(p))
    }
    /// x·a + b in one pass.
    pub fn affine(&self, mul: f64, add: f64) -> Result<Tensor> {
        self.unary(UnaryOp::Affine(mul, add))
    }
    /// x + s
    pub fn add_scalar(&self, s: f64) -> Result<Tensor> {
        self.unary(UnaryOp::AddScalar(s))
    }
    /// x − s
    pub fn sub_scalar(&self, s: f64) -> Result<Tensor> {
        self.unary(UnaryOp::SubScalar(s))
    }
    /// x · s
    pub fn mul_scalar(&self, s: f64) -> Result<Tensor> {
        self.unary(UnaryOp::MulScalar(s))
    }
    /// x / s
    pub fn div_scalar(&self, s: f64) -> Result<Tensor> {
        self.unary(UnaryOp::DivScalar(s))
    }
    /// max(x, s). NaN propagates; the gradient is 1 where x > s and 0 at
    /// and below the boundary (PyTorch 2.x's `clamp_min` backward).
    pub fn maximum_scalar(&self, s: f64) -> Result<Tensor> {
        self.unary(UnaryOp::MaxScalar(s))
    }
    /// min(x, s). NaN propagates; the gradient is 1 where x < s and 0 at
    /// and above the boundary.
    pub fn minimum_scalar(&self, s: f64) -> Result<Tensor> {
        self.unary(UnaryOp::MinScalar(s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_member_has_a_kernel_per_dtype_in_the_cuda_module() {
        let src = cuda_source();
        for &(name, float_only, ..) in MEMBERS {
            assert!(src.contains(&format!("void unary_{name}_f32(UnaryArgs p)")), "{name}");
            assert!(src.contains(&format!("void unary_{name}_f64(UnaryArgs p)")), "{name}");
            assert_eq!(src.contains(&format!("void unary_{name}_i64(UnaryArgs p)")), !float_only, "{name}");
        }
    }
}
