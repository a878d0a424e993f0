//! The binary family: elementwise functions of two operands with numpy
//! broadcasting, each one entry of the list below (name, dtypes, host
//! expression, CUDA expression, gradient). The family shares its loops, the
//! CPU's small-operand path and one CUDA module, `binary`; `Tensor::binary`
//! is its front end.

mod family;

use super::{need, zero_where};
use crate::backends::host::loops::{Apply2, Dense2, Mapped2};
use crate::backends::host::num::{elems, slice_of, Float, Num};
use crate::base::buffer::CpuBuffer;
use crate::base::dtype::DType;
use crate::base::error::{Error, Result};
use crate::base::shape::{broadcast_shapes, Layout};
use crate::kernel::cuda::{c_type, dtype_tag, BinaryArgs, CudaModule, FamilyCall};
use crate::kernel::{BinaryKernel, Kernel, OpRef};
use crate::tensor::{check_compute, check_same_device};
use crate::Tensor;
use family::{binary_family, Kind};
use std::borrow::Cow;
use std::sync::Arc;

binary_family! {
    num {
        /// a + b
        Add => "add", host |x, y| x.add(y), cuda "Ar<T>::add(x, y)", grad |g, a, b| Ok((need(a, || Ok(g.clone()))?, need(b, || Ok(g.clone()))?));
        /// a − b
        Sub => "sub", host |x, y| x.sub(y), cuda "Ar<T>::sub(x, y)", grad |g, a, b| Ok((need(a, || Ok(g.clone()))?, need(b, || g.neg())?));
        /// a · b
        Mul => "mul", host |x, y| x.mul(y), cuda "Ar<T>::mul(x, y)", grad |g, a, b| Ok((need(a, || g.mul(b))?, need(b, || g.mul(a))?));
        /// a / b (integers: the front end divides in f32, as PyTorch's true division)
        Div => "div", host |x, y| x.div(y), cuda "Ar<T>::div(x, y)",
            grad |g, a, b| Ok((need(a, || g.div(b))?, need(b, || g.mul(a)?.div(&b.sqr()?)?.neg())?));
        /// max(a, b); NaN propagates; a tie splits the gradient 0.5/0.5 (PyTorch).
        Maximum => "maximum", host |x, y| x.max(y), cuda "Ar<T>::mx(x, y)", grad |g, a, b| extremum_grad(g, a, b, true);
        /// min(a, b); as maximum.
        Minimum => "minimum", host |x, y| x.min(y), cuda "Ar<T>::mn(x, y)", grad |g, a, b| extremum_grad(g, a, b, false);
    }
    float {
        /// aᵇ (floats). PyTorch's pow_backward: the base gets 0 where the
        /// exponent is 0 (not 0 · 0⁻¹ = NaN); the exponent gets 0 where the
        /// base is 0 and the exponent ≥ 0 (not 0ᵇ · log 0).
        Pow => "pow", host |x, y| x.pow(y), cuda "Fl<T>::pow(x, y)",
            grad |g, a, b| {
                let ga = need(a, || {
                    let ga = g.mul(b)?.mul(&a.pow(&b.sub(&b.ones_like()?)?)?)?;
                    zero_where(&b.binary(&b.scalar_like(0.0)?, BinaryOp::Eq)?, &ga)
                })?;
                let gb = need(b, || {
                    let gb = g.mul(&a.pow(b)?)?.mul(&a.log()?)?;
                    let zero_base = a.binary(&a.scalar_like(0.0)?, BinaryOp::Eq)?;
                    zero_where(&zero_base.mul(&b.binary(&b.scalar_like(0.0)?, BinaryOp::Ge)?)?, &gb)
                })?;
                Ok((ga, gb))
            };
        /// g · y(1 − y): the gradient of sigmoid from its output `y`, in one
        /// pass (PyTorch's `sigmoid_backward`; as `g * (y * (1 - y))`, the
        /// same bits). Its own gradient: y(1 − y) for g, g(1 − 2y) for y.
        SigmoidBackward => "sigmoid_backward", host |x, y| x.mul(y.mul(T::ONE.sub(y))),
            cuda "Ar<T>::mul(x, Ar<T>::mul(y, Ar<T>::sub(Cv<T>::from(1.0), y)))",
            grad |g, a, b| Ok((
                need(a, || g.binary(b, BinaryOp::SigmoidBackward))?,
                need(b, || g.mul(a)?.mul(&b.affine(-2.0, 1.0)?))?,
            ));
        /// g · (1 − y²): the gradient of tanh from its output `y`, in one
        /// pass (PyTorch's `tanh_backward`; as `g * (1 - y * y)`, the same
        /// bits). Its own gradient: 1 − y² for g, −2gy for y.
        TanhBackward => "tanh_backward", host |x, y| x.mul(T::ONE.sub(y.mul(y))),
            cuda "Ar<T>::mul(x, Ar<T>::sub(Cv<T>::from(1.0), Ar<T>::mul(y, y)))",
            grad |g, a, b| Ok((need(a, || g.binary(b, BinaryOp::TanhBackward))?, need(b, || g.mul(a)?.mul(&b.mul_scalar(-2.0)?))?));
    }
    cmp {
        /// a == b, as u8 0/1.
        Eq => "eq", host |x, y| (x == y) as u8, cuda "(u8)(x == y)";
        /// a != b
        Ne => "ne", host |x, y| (x != y) as u8, cuda "(u8)(x != y)";
        /// a < b
        Lt => "lt", host |x, y| (x < y) as u8, cuda "(u8)(x < y)";
        /// a <= b
        Le => "le", host |x, y| (x <= y) as u8, cuda "(u8)(x <= y)";
        /// a > b
        Gt => "gt", host |x, y| (x > y) as u8, cuda "(u8)(x > y)";
        /// a >= b
        Ge => "ge", host |x, y| (x >= y) as u8, cuda "(u8)(x >= y)";
    }
}

/// The gradient of maximum (`max`) or minimum: the operand that lost gets
/// 0, a tie splits it 0.5/0.5, and where a NaN is involved neither lost, so
/// both get all of it (PyTorch).
fn extremum_grad(g: &Tensor, a: &Tensor, b: &Tensor, max: bool) -> Result<(Option<Tensor>, Option<Tensor>)> {
    let (a_lost, b_lost) = if max { (BinaryOp::Lt, BinaryOp::Gt) } else { (BinaryOp::Gt, BinaryOp::Lt) };
    let shared = a.binary(b, BinaryOp::Eq)?.where_cond(&g.mul_scalar(0.5)?, g)?;
    Ok((need(a, || zero_where(&a.binary(b, a_lost)?, &shared))?, need(b, || zero_where(&a.binary(b, b_lost)?, &shared))?))
}

impl BinaryKernel for BinaryOp {
    fn name(&self) -> &'static str {
        BinaryOp::name(*self)
    }
    fn host(&self, a: &CpuBuffer, la: &Layout, b: &CpuBuffer, lb: &Layout, out: &mut CpuBuffer, threads: usize) -> bool {
        macro_rules! go {
            ($a:expr, $b:expr, $arith:ident) => {{
                let (a, b) = ($a, $b);
                if self.is_comparison() {
                    match slice_of::<u8>(out) {
                        Some(out) => self.compare(Mapped2 { a, la, b, lb, out, threads }),
                        None => false,
                    }
                } else {
                    match slice_of(out) {
                        Some(out) => self.$arith(Mapped2 { a, la, b, lb, out, threads }),
                        None => false,
                    }
                }
            }};
        }
        match (a, b) {
            (CpuBuffer::F32(a), CpuBuffer::F32(b)) => go!(a, b, arith_float),
            (CpuBuffer::F64(a), CpuBuffer::F64(b)) => go!(a, b, arith_float),
            (CpuBuffer::I64(a), CpuBuffer::I64(b)) => go!(a, b, arith_num),
            (CpuBuffer::I32(a), CpuBuffer::I32(b)) => go!(a, b, arith_num),
            (CpuBuffer::U8(a), CpuBuffer::U8(b)) => go!(a, b, arith_num),
            // Half types and mixed dtypes are refused by the front end.
            _ => false,
        }
    }
    #[inline]
    fn host_dense(&self, a: &CpuBuffer, a0: usize, b: &CpuBuffer, b0: usize, out: &mut CpuBuffer) -> bool {
        let n = out.len();
        macro_rules! go {
            ($t:ty, $arith:ident) => {{
                let (Some(a), Some(b)) = (elems::<$t>(a), elems::<$t>(b)) else { return false };
                let (Some(a), Some(b)) = (a.get(a0..a0.saturating_add(n)), b.get(b0..b0.saturating_add(n))) else { return false };
                if self.is_comparison() {
                    match slice_of::<u8>(out) {
                        Some(out) => self.compare(Dense2 { a, b, out }),
                        None => false,
                    }
                } else {
                    match slice_of::<$t>(out) {
                        Some(out) => self.$arith(Dense2 { a, b, out }),
                        None => false,
                    }
                }
            }};
        }
        match a.dtype() {
            DType::F32 => go!(f32, arith_float),
            DType::F64 => go!(f64, arith_float),
            DType::I64 => go!(i64, arith_num),
            DType::I32 => go!(i32, arith_num),
            DType::U8 => go!(u8, arith_num),
            DType::F16 | DType::BF16 => false,
        }
    }
    fn cuda(&self, dtype: DType) -> FamilyCall {
        FamilyCall { module: &MODULE, kernel: format!("binary_{}_{}", self.name(), dtype_tag(dtype)), a: 0.0, b: 0.0, n: 0 }
    }
    fn to_shared(&self) -> Arc<dyn BinaryKernel> {
        Arc::new(*self)
    }
}

/// The family's CUDA module: one kernel per member and dtype.
pub(crate) static MODULE: CudaModule = CudaModule::generated("binary", cuda_source);
inventory::submit! { crate::kernel::cuda::DeclaredModule(&MODULE) }

fn cuda_source() -> String {
    let mut s = String::from(BinaryArgs::C_DECL);
    s.push_str(
        r#"
template <typename T, typename O, typename F> __device__ __forceinline__ void binary_map(const BinaryArgs& p, F f) {
    const T* a = (const T*)p.a;
    const T* b = (const T*)p.b;
    O* out = (O*)p.out;
    if (p.la.rank == 1 && p.lb.rank == 1 && p.la.strides[0] == 1 && p.lb.strides[0] == 1) {
        const T* __restrict__ x = a + p.la.off;
        const T* __restrict__ y = b + p.lb.off;
        O* __restrict__ o = out;
        constexpr int N = PackOf<T>::N;
        if (N > 1 && aligned_to(x, sizeof(T) * N) && aligned_to(y, sizeof(T) * N) && aligned_to(o, sizeof(O) * N)) {
            u64 packs = p.n / N;
            GRID_LOOP(v, packs) {
                Pack<T, N> xv = ((const Pack<T, N>*)x)[v], yv = ((const Pack<T, N>*)y)[v];
                Pack<O, N> ov;
#pragma unroll
                for (int k = 0; k < N; ++k) ov.e[k] = f(xv.e[k], yv.e[k]);
                ((Pack<O, N>*)o)[v] = ov;
            }
            GRID_LOOP(i, p.n - packs * N) o[packs * N + i] = f(x[packs * N + i], y[packs * N + i]);
        } else {
            GRID_LOOP(i, p.n) o[i] = f(x[i], y[i]);
        }
    } else {
        GRID_LOOP(i, p.n) out[i] = f(a[lay_off(p.la, i)], b[lay_off(p.lb, i)]);
    }
}
"#,
    );
    let all = [DType::F32, DType::F64, DType::I64, DType::I32, DType::U8];
    for &(name, kind, expr) in MEMBERS {
        let dtypes: &[DType] = if kind == Kind::Float { &all[..2] } else { &all };
        for &dt in dtypes {
            let (tag, ty) = (dtype_tag(dt), c_type(dt));
            let out = if kind == Kind::Cmp { "u8" } else { ty };
            s.push_str(&format!(
                "struct binary_{name}_{tag}_fn {{ typedef {ty} T; __device__ __forceinline__ {out} operator()(T x, T y) const {{ return {expr}; }} }};\n\
                 extern \"C\" __global__ void binary_{name}_{tag}(BinaryArgs p) {{ binary_map<{ty}, {out}>(p, binary_{name}_{tag}_fn()); }}\n"
            ));
        }
    }
    s
}

macro_rules! binary_fns {
    ($($(#[$doc:meta])* $name:ident => $op:expr;)*) => {
        $( $(#[$doc])* pub fn $name(&self, rhs: &Tensor) -> Result<Tensor> { self.binary(rhs, $op) } )*
    };
}

impl Tensor {
    /// Applies a member of the binary family with numpy broadcasting.
    ///
    /// Operands of two dtypes are promoted as PyTorch does
    /// ([`Tensor::result_type`]: u8 with i32 is i32, an integer with a
    /// float is the float, f16 with bf16 is f32; a 0-d tensor counts as a
    /// scalar): each is cast to the result type first, and its gradient
    /// comes back in its own dtype. Comparisons compare in the result type
    /// and give u8. Integer `/` divides in f32 (true division).
    ///
    /// ```
    /// use kiln::{Tensor, BinaryOp, cpu};
    /// let a = Tensor::new(&[[1f32], [2.]], &cpu())?;
    /// let b = Tensor::new(&[10f32, 20., 30.], &cpu())?;
    /// assert_eq!(a.binary(&b, BinaryOp::Add)?.dims(), &[2, 3]);
    /// assert_eq!(a.binary(&b, BinaryOp::Lt)?.to_vec::<u8>()?, vec![1; 6]);
    /// // u8 and f32 promote to f32.
    /// let v0 = Tensor::new(&[3u8, 250], &cpu())?;
    /// let v1 = v0.sub_scalar(-2.0)?; // f32: -2.0 does not fit u8
    /// assert_eq!(v1.minimum(&v0)?.to_vec::<f32>()?, vec![3., 250.]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn binary(&self, rhs: &Tensor, op: BinaryOp) -> Result<Tensor> {
        let name = op.name();
        check_same_device(name, self, rhs)?;
        if self.dtype() != rhs.dtype() {
            // PyTorch's promotion: both operands are cast to the result
            // type first (their casts carry each one's gradient back in its
            // own dtype). Shapes are checked before anything is launched.
            if self.shape() != rhs.shape() {
                broadcast_shapes(name, self.shape(), rhs.shape())?;
            }
            let dtype = Tensor::result_type(&[self, rhs]);
            check_compute(name, dtype)?;
            return self.to_dtype(dtype)?.binary(&rhs.to_dtype(dtype)?, op);
        }
        check_compute(name, self.dtype())?;
        if op.float_only() && !self.dtype().is_float() {
            return Err(Error::UnsupportedDType { op: name.into(), dtype: self.dtype() });
        }
        if op == BinaryOp::Div && !self.dtype().is_float() {
            // PyTorch: `/` of integer tensors is true division, in floats.
            return self.to_dtype(DType::F32)?.binary(&rhs.to_dtype(DType::F32)?, op);
        }
        let dtype = if op.is_comparison() { DType::U8 } else { self.dtype() };
        let t = if self.shape() == rhs.shape() {
            self.run_new_same_shape(Kernel::Binary { op: OpRef::Borrowed(&op), lhs: self.src(), rhs: rhs.src() }, dtype)?
        } else {
            let shape = broadcast_shapes(name, self.shape(), rhs.shape())?;
            let mut l = self.src();
            l.layout = Cow::Owned(self.layout.broadcast_as(&shape)?);
            let mut r = rhs.src();
            r.layout = Cow::Owned(rhs.layout.broadcast_as(&shape)?);
            self.run_new(Kernel::Binary { op: OpRef::Borrowed(&op), lhs: l, rhs: r }, dtype, shape)?
        };
        if op.is_comparison() {
            return Ok(t);
        }
        Ok(crate::autograd::record(t, &[self, rhs], false, || {
            Box::new(move |c| {
                let (a, b) = (&c.inputs[0], &c.inputs[1]);
                let (ga, gb) = op.grad(c.g, a, b)?;
                let back = |g: Option<Tensor>, x: &Tensor| g.map(|g| super::sum_to(&g, x.dims())).transpose();
                Ok(smallvec::smallvec![back(ga, a)?, back(gb, b)?])
            })
        }))
    }

    binary_fns! {
        /// a + b, broadcasting.
        add => BinaryOp::Add;
        /// a − b, broadcasting.
        sub => BinaryOp::Sub;
        /// a · b, broadcasting.
        mul => BinaryOp::Mul;
        /// a / b, broadcasting.
        div => BinaryOp::Div;
        /// aᵇ, broadcasting (floats).
        pow => BinaryOp::Pow;
        /// Elementwise maximum.
        maximum => BinaryOp::Maximum;
        /// Elementwise minimum.
        minimum => BinaryOp::Minimum;
        /// a == b as u8 0/1.
        eq => BinaryOp::Eq;
        /// a != b as u8 0/1.
        ne => BinaryOp::Ne;
        /// a < b as u8 0/1.
        lt => BinaryOp::Lt;
        /// a <= b as u8 0/1.
        le => BinaryOp::Le;
        /// a > b as u8 0/1.
        gt => BinaryOp::Gt;
        /// a >= b as u8 0/1.
        ge => BinaryOp::Ge;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_member_has_a_kernel_per_dtype_in_the_cuda_module() {
        let src = cuda_source();
        for &(name, kind, _) in MEMBERS {
            assert!(src.contains(&format!("void binary_{name}_f32(BinaryArgs p)")), "{name}");
            assert_eq!(src.contains(&format!("void binary_{name}_u8(BinaryArgs p)")), kind != Kind::Float, "{name}");
        }
    }
}
