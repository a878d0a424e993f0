//! The reduction family: folds over some dimensions, each one entry of the
//! list below (name, identity, host combination, CUDA identity and
//! combination, gradient). The family shares its loops (dense lanes,
//! strided rows, parallel), and one CUDA module, `reduce`, with one block
//! per output, one thread per output, or two passes for long folds over few
//! outputs. `Tensor::reduce` is its front end; the arg-reductions named in
//! the list run as their own op (`ops/argreduce.rs`).

mod family;

use crate::backends::host::loops::{reduce, Fold};
use crate::backends::host::num::{Accumulate, Num};
use crate::base::buffer::CpuBuffer;
use crate::base::dtype::DType;
use crate::base::error::{Error, Result};
use crate::base::shape::{Dims, Layout, Shape};
use crate::kernel::cuda::{c_type, dtype_tag, CudaModule, FamilyCall, ReduceArgs, ReduceFinalArgs, ReducePartialArgs};
use crate::kernel::{Kernel, OpRef, ReduceKernel};
use crate::ops::binary::BinaryOp;
use crate::tensor::{check_compute, Dim};
use crate::Tensor;
use family::reduce_family;
use std::sync::Arc;

reduce_family! {
    fold {
        /// Sum.
        Sum => "sum", init ZERO, host |a, b| a.add(b), cuda init "Cv<A>::from(0.0)" combine "Ar<A>::add(a, b)",
            grad |g, x, _dims| g.broadcast_to(x.shape());
        /// Maximum. NaN propagates; ties share the gradient equally, and a
        /// slice holding NaNs gives it to its NaNs (the README's table).
        Max => "max", init LOWEST, host |a, b| a.max(b), cuda init "Ar<A>::lowest()" combine "Ar<A>::mx(a, b)",
            grad |g, x, dims, y| extremum_grad(g, x, y, dims);
        /// Minimum, as maximum.
        Min => "min", init HIGHEST, host |a, b| a.min(b), cuda init "Ar<A>::highest()" combine "Ar<A>::mn(a, b)",
            grad |g, x, dims, y| extremum_grad(g, x, y, dims);
        /// Sum of squares, Σx² (0 for an empty slice; integers wrap): the
        /// fold of [`Tensor::norm`](crate::Tensor::norm). A primitive rather
        /// than `sqr` then `sum` because it pays: one pass over the data
        /// instead of a squared copy written and read back (W2's norm of a
        /// 100×100 product, read to the host: 3.1 µs to 1.9 µs), and floats square in f64,
        /// as numpy's and PyTorch's f64 references do. The gradient is 2·x·g.
        SumSquares => "sum_squares", init ZERO, host |a, b| a.add(b), map |x| x.mul(x),
            cuda init "Cv<A>::from(0.0)" combine "Ar<A>::add(a, b)" map "Ar<A>::mul(x, x)",
            grad |g, x, _dims| g.broadcast_to(x.shape())?.mul(x)?.mul_scalar(2.0);
        /// The Euclidean norm √(Σx²) (floats only: [`Tensor::norm`](crate::Tensor::norm)
        /// refuses integers). The squares sum in f64 and the root is taken
        /// there, before the one rounding to the dtype, so an f32 norm is
        /// exact where its squares would overflow or underflow f32 (‖[2e19]‖
        /// is 2e19, ‖[1e-25]‖ 1e-25, as in PyTorch). The gradient is g·x/y,
        /// and 0 where the norm is 0 (PyTorch's choice of subgradient).
        Norm => "norm", init ZERO, host |a, b| a.add(b), map |x| x.mul(x), finish |x| x.square_root(),
            cuda init "Cv<A>::from(0.0)" combine "Ar<A>::add(a, b)" map "Ar<A>::mul(x, x)" finish "(A)sqrt((double)x)",
            grad |g, x, _dims, y| norm_grad(g, x, y);
        /// Product (1 for an empty slice); integers wrap.
        Prod => "prod", init ONE, host |a, b| a.mul(b), cuda init "Cv<A>::from(1.0)" combine "Ar<A>::mul(a, b)",
            grad |g, x, dims, y| prod_grad(g, x, y, dims);
    }
    arg {
        /// Index of the maximum (first one on ties; the first NaN wins), as i64; one dim only.
        ArgMax => "argmax";
        /// Index of the minimum, as i64; one dim only.
        ArgMin => "argmin";
    }
}

/// The gradient of max or min: shared equally by the elements equal to the
/// output (PyTorch's amax/amin), or by the NaNs where the output is NaN.
fn extremum_grad(g: &Tensor, x: &Tensor, y: &Tensor, dims: &[usize]) -> Result<Tensor> {
    // x != x only for NaN.
    let x_nan = x.binary(x, BinaryOp::Ne)?;
    let out_nan = y.binary(y, BinaryOp::Ne)?;
    let hits = out_nan.where_cond(&x_nan, &x.binary(y, BinaryOp::Eq)?)?.to_dtype(x.dtype())?;
    let share = hits.div(&hits.sum_over(dims, true)?)?;
    g.broadcast_to(x.shape())?.mul(&share)
}

/// The gradient of a norm: x·g/y, with g/y read as 0 where the norm is 0
/// (a zero vector, where √ has no derivative; PyTorch's masked_fill).
fn norm_grad(g: &Tensor, x: &Tensor, y: &Tensor) -> Result<Tensor> {
    let zero = y.binary(&y.scalar_like(0.0)?, BinaryOp::Eq)?;
    let scale = crate::ops::zero_where(&zero, &g.div(y)?)?;
    x.mul(&scale.broadcast_to(x.shape())?)
}

/// The gradient of a product: y/x where the slice holds no zero (reusing
/// the output, as PyTorch does); at the one zero of a slice with exactly
/// one, the product of the others; 0 everywhere else.
fn prod_grad(g: &Tensor, x: &Tensor, y: &Tensor, dims: &[usize]) -> Result<Tensor> {
    if dims.iter().all(|&d| x.dims()[d] == 1) {
        // A product of one element is the identity (y/x would be NaN at ±inf).
        return g.reshape(x.dims());
    }
    let is_zero = x.binary(&x.scalar_like(0.0)?, BinaryOp::Eq)?;
    let zeros = is_zero.to_dtype(x.dtype())?.sum_over(dims, true)?;
    let no_zero = zeros.binary(&zeros.scalar_like(0.0)?, BinaryOp::Eq)?;
    let one_zero = zeros.binary(&zeros.scalar_like(1.0)?, BinaryOp::Eq)?;
    // x with its zeros as ones: y / it is unused where x is 0, and its
    // product is the product of the others at a slice's only zero.
    let unzeroed = is_zero.where_cond(&x.scalar_like(1.0)?, x)?;
    let others = y.div(&unzeroed)?;
    let rest = unzeroed.reduce(Reduction::Prod, dims, true)?;
    let zero = x.scalar_like(0.0)?;
    let at_nonzero = no_zero.where_cond(&others, &zero)?;
    let at_zero = one_zero.where_cond(&rest, &zero)?;
    g.broadcast_to(x.shape())?.mul(&is_zero.where_cond(&at_zero, &at_nonzero)?)
}

impl ReduceKernel for Reduction {
    fn name(&self) -> &'static str {
        Reduction::name(*self)
    }
    fn host(&self, src: &CpuBuffer, layout: &Layout, dims: &[usize], out: &mut CpuBuffer, threads: usize) -> bool {
        match (src, out) {
            (CpuBuffer::F32(s), CpuBuffer::F32(o)) => self.fold(s, layout, dims, o, threads),
            (CpuBuffer::F64(s), CpuBuffer::F64(o)) => self.fold(s, layout, dims, o, threads),
            (CpuBuffer::I64(s), CpuBuffer::I64(o)) => self.fold(s, layout, dims, o, threads),
            (CpuBuffer::I32(s), CpuBuffer::I32(o)) => self.fold(s, layout, dims, o, threads),
            (CpuBuffer::U8(s), CpuBuffer::U8(o)) => self.fold(s, layout, dims, o, threads),
            // Half types are refused by the front end.
            _ => false,
        }
    }
    fn cuda(&self, dtype: DType) -> FamilyCall {
        FamilyCall { module: &MODULE, kernel: format!("reduce_{}_{}", self.name(), dtype_tag(dtype)), a: 0.0, b: 0.0, n: 0 }
    }
    fn to_shared(&self) -> Arc<dyn ReduceKernel> {
        Arc::new(*self)
    }
}

/// The family's CUDA module: four launch shapes per member and dtype.
pub(crate) static MODULE: CudaModule = CudaModule::generated("reduce", cuda_source);
inventory::submit! { crate::kernel::cuda::DeclaredModule(&MODULE) }

fn cuda_source() -> String {
    let mut s = String::new();
    for decl in [ReduceArgs::C_DECL, ReducePartialArgs::C_DECL, ReduceFinalArgs::C_DECL] {
        s.push_str(decl);
    }
    s.push_str(REDUCE_CU);
    for &(name, init, comb, map, finish) in MEMBERS {
        for dt in [DType::F32, DType::F64, DType::I64, DType::I32, DType::U8] {
            let (tag, ty) = (dtype_tag(dt), c_type(dt));
            s.push_str(&format!(
                "struct reduce_{name}_{tag}_op {{ typedef Acc<{ty}>::type A; \
                 static __device__ __forceinline__ A init() {{ return {init}; }} \
                 static __device__ __forceinline__ A comb(A a, A b) {{ return {comb}; }} \
                 static __device__ __forceinline__ A map(A x) {{ return {map}; }} \
                 static __device__ __forceinline__ A finish(A x) {{ return {finish}; }} }};\n"
            ));
            for (shape, args) in
                [("block", "ReduceArgs"), ("thread", "ReduceArgs"), ("partial", "ReducePartialArgs"), ("final", "ReduceFinalArgs")]
            {
                s.push_str(&format!(
                    "extern \"C\" __global__ void reduce_{name}_{tag}_{shape}({args} p) {{ reduce_{shape}_impl<{ty}, reduce_{name}_{tag}_op>(p); }}\n"
                ));
            }
        }
    }
    s
}

/// The launch shapes of a fold, over any member (`Op` gives the
/// accumulator type, identity and combination).
const REDUCE_CU: &str = r#"
// One block per output: threads stride over the reduced elements, then a
// shared-memory tree. `outer` maps an output index to the first source
// element, `inner` a reduced index to its distance from there.
template <typename T, typename Op> __device__ void reduce_block_impl(const ReduceArgs& p) {
    typedef typename Op::A A;
    const T* src = (const T*)p.src;
    T* out = (T*)p.out;
    __shared__ A sh[256];
    for (u64 o = blockIdx.x; o < p.n_out; o += gridDim.x) {
        i64 base = lay_off(p.outer, o);
        A acc = Op::init();
        for (u64 r = threadIdx.x; r < p.n_in; r += blockDim.x) acc = Op::comb(acc, Op::map((A)src[base + lay_off(p.inner, r)]));
        sh[threadIdx.x] = acc;
        __syncthreads();
        for (unsigned int s = blockDim.x / 2; s > 0; s >>= 1) {
            if (threadIdx.x < s) sh[threadIdx.x] = Op::comb(sh[threadIdx.x], sh[threadIdx.x + s]);
            __syncthreads();
        }
        if (threadIdx.x == 0) out[o] = (T)Op::finish(sh[0]);
        __syncthreads();
    }
}

// One thread per output, for short folds over many outputs.
template <typename T, typename Op> __device__ void reduce_thread_impl(const ReduceArgs& p) {
    typedef typename Op::A A;
    const T* src = (const T*)p.src;
    T* out = (T*)p.out;
    GRID_LOOP(o, p.n_out) {
        i64 base = lay_off(p.outer, o);
        A acc = Op::init();
        for (u64 r = 0; r < p.n_in; ++r) acc = Op::comb(acc, Op::map((A)src[base + lay_off(p.inner, r)]));
        out[o] = (T)Op::finish(acc);
    }
}

// Long folds over few outputs (sum_all, norm, mean_all), pass 1: block b
// folds part (b % parts) of output (b / parts) into its accumulator.
template <typename T, typename Op> __device__ void reduce_partial_impl(const ReducePartialArgs& p) {
    typedef typename Op::A A;
    const T* src = (const T*)p.src;
    A* part = (A*)p.part;
    __shared__ A sh[256];
    u64 chunk = (p.n_in + p.parts - 1) / p.parts;
    for (u64 b = blockIdx.x; b < p.n_out * p.parts; b += gridDim.x) {
        u64 o = b / p.parts, q = b % p.parts;
        u64 lo = q * chunk, hi = lo + chunk < p.n_in ? lo + chunk : p.n_in;
        i64 base = lay_off(p.outer, o);
        A acc = Op::init();
        for (u64 r = lo + threadIdx.x; r < hi; r += blockDim.x) acc = Op::comb(acc, Op::map((A)src[base + lay_off(p.inner, r)]));
        sh[threadIdx.x] = acc;
        __syncthreads();
        for (unsigned int s = blockDim.x / 2; s > 0; s >>= 1) {
            if (threadIdx.x < s) sh[threadIdx.x] = Op::comb(sh[threadIdx.x], sh[threadIdx.x + s]);
            __syncthreads();
        }
        if (threadIdx.x == 0) part[b] = sh[0];
        __syncthreads();
    }
}

// Pass 2: one thread per output folds its parts in order.
template <typename T, typename Op> __device__ void reduce_final_impl(const ReduceFinalArgs& p) {
    typedef typename Op::A A;
    const A* part = (const A*)p.part;
    T* out = (T*)p.out;
    GRID_LOOP(o, p.n_out) {
        A acc = Op::init();
        for (u64 q = 0; q < p.parts; ++q) acc = Op::comb(acc, part[o * p.parts + q]);
        out[o] = (T)Op::finish(acc);
    }
}
"#;

/// The dimensions `dims` as indices in `0..rank` (negative ones count from
/// the end), or an error naming `op` and the rank. Inline up to rank 4.
pub(crate) fn resolve_dims(op: &str, dims: &[impl Dim], rank: usize) -> Result<smallvec::SmallVec<[usize; 4]>> {
    // A loop, not `collect` into a `Result`: that goes through SmallVec's
    // general `extend` behind an adapter, a large body of code for one or
    // two dimensions, run by every reduction of a training step.
    let mut out = smallvec::SmallVec::new();
    for &d in dims {
        out.push(d.index(op, rank)?);
    }
    Ok(out)
}

/// The dimensions of a reduction, as PyTorch resolves them: each in range
/// and named once (`dim 0 appears multiple times`, also when named as 0 and
/// −1); an empty list means every dimension (PyTorch's `sum(x, dim=[])`); a
/// 0-d tensor takes 0 and −1 as if it had one dimension and reduces over
/// none (it is its own sum, max, mean...).
pub(crate) fn resolve_reduce_dims(op: &str, dims: &[impl Dim], rank: usize) -> Result<smallvec::SmallVec<[usize; 4]>> {
    let resolved = resolve_dims(op, dims, rank.max(1))?;
    for (i, &d) in resolved.iter().enumerate() {
        if resolved[..i].contains(&d) {
            return Err(Error::invalid(op, format!("dim {d} appears multiple times in the list of dims {:?}", resolved.as_slice())));
        }
    }
    if rank == 0 {
        return Ok(smallvec::SmallVec::new());
    }
    if resolved.is_empty() {
        return Ok((0..rank).collect());
    }
    Ok(resolved)
}

impl Tensor {
    /// Reduces over `dims` (all distinct, in range); keeps them as size 1
    /// when `keepdim`. A dimension is a `usize` or, as in PyTorch, a signed
    /// integer counting from the end (`-1` is the last). An empty list
    /// reduces every dimension, as PyTorch's `sum(x, dim=[])` does (argmax
    /// and argmin need exactly one).
    ///
    /// ```
    /// use kiln::{Tensor, Reduction, cpu};
    /// let x = Tensor::new(&[[1f32, 5.], [3., 2.]], &cpu())?;
    /// assert_eq!(x.reduce(Reduction::Max, &[-1], false)?.to_vec::<f32>()?, vec![5., 3.]);
    /// assert_eq!(x.reduce(Reduction::Max, &[0usize], true)?.dims(), &[1, 2]);
    /// // Out of range names the rank; naming a dimension twice is an error.
    /// assert!(x.reduce(Reduction::Sum, &[-3], false).unwrap_err().to_string().contains("rank 2"));
    /// assert!(x.reduce(Reduction::Sum, &[1, -1], false).is_err());
    /// let none: [usize; 0] = [];
    /// assert_eq!(x.reduce(Reduction::Sum, &none, false)?.to_scalar::<f32>()?, 11.0);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn reduce(&self, op: Reduction, dims: &[impl Dim], keepdim: bool) -> Result<Tensor> {
        let name = op.name();
        check_compute(name, self.dtype())?;
        let named = dims.len();
        let dims = resolve_reduce_dims(name, dims, self.rank())?;
        let dims = dims.as_slice();
        if op.is_arg() && self.rank() == 0 && named == 1 {
            // The only element of a 0-d tensor is at index 0 (PyTorch).
            return Tensor::zeros((), DType::I64, &self.device());
        }
        if op == Reduction::Norm && !self.dtype().is_float() {
            // Summing squares in an integer dtype would wrap: PyTorch refuses it too.
            return Err(Error::UnsupportedDType { op: name.into(), dtype: self.dtype() });
        }
        if op.is_arg() && named == 0 {
            return Err(Error::invalid(name, "reduces exactly one dimension, and none was named; flatten first to search everything"));
        }
        if op.is_arg() {
            if dims.len() != 1 {
                return Err(Error::invalid(name, "reduces exactly one dimension; flatten first to search everything"));
            }
            return self.arg_reduce(op == Reduction::ArgMax, dims[0], keepdim);
        }
        if matches!(op, Reduction::Max | Reduction::Min) && dims.iter().any(|&d| self.dims()[d] == 0) {
            return Err(Error::invalid(name, format!("cannot reduce an empty dimension of shape {}", self.shape())));
        }
        let mut kept = Dims::from_slice(self.dims());
        for &d in dims {
            kept[d] = 1;
        }
        let kept = Shape(kept);
        let kernel = Kernel::Reduce { op: OpRef::Borrowed(&op), src: self.src(), dims: Dims::from_slice(dims) };
        let t = self.run_new(kernel, self.dtype(), kept)?;
        let dims_kept: smallvec::SmallVec<[usize; 4]> = dims.into();
        let t = crate::autograd::record(t, &[self], op.saves_output(), || {
            Box::new(move |c| Ok(smallvec::smallvec![Some(op.grad(c.g, &c.inputs[0], c.output, &dims_kept)?)]))
        });
        if keepdim {
            Ok(t)
        } else {
            let squeezed: Vec<usize> = (0..self.rank()).filter(|d| !dims.contains(d)).map(|d| self.dims()[d]).collect();
            t.reshape(squeezed)
        }
    }

    pub(crate) fn all_dims(&self) -> Vec<usize> {
        (0..self.rank()).collect()
    }

    /// The sum over exactly `dims`, which may be none (then `self`): for
    /// gradients that sum over a computed list, where the public meaning of
    /// an empty list (every dimension) would be wrong.
    pub(crate) fn sum_over(&self, dims: &[usize], keepdim: bool) -> Result<Tensor> {
        if dims.is_empty() {
            return Ok(self.clone());
        }
        self.sum_dims(dims, keepdim)
    }

    /// Sum of every element, as a 0-d tensor.
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let x = Tensor::new(&[[1f32, 2.], [3., 4.]], &cpu())?;
    /// assert_eq!(x.sum_all()?.to_scalar::<f32>()?, 10.0);
    /// assert_eq!(x.sum(0)?.to_vec::<f32>()?, vec![4., 6.]);
    /// assert_eq!(x.sum_keepdim(1)?.dims(), &[2, 1]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn sum_all(&self) -> Result<Tensor> {
        self.reduce(Reduction::Sum, &self.all_dims(), false)
    }
    /// Sum over one dimension, dropping it.
    pub fn sum(&self, dim: impl Dim) -> Result<Tensor> {
        self.reduce(Reduction::Sum, &[dim], false)
    }
    /// Sum over one dimension, keeping it as size 1.
    pub fn sum_keepdim(&self, dim: impl Dim) -> Result<Tensor> {
        self.reduce(Reduction::Sum, &[dim], true)
    }
    /// Sum over several dimensions; negative ones count from the end, as in
    /// PyTorch.
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let x = Tensor::new(&[[1f32, 2.], [3., 4.]], &cpu())?;
    /// assert_eq!(x.sum_dims(&[-1], false)?.to_vec::<f32>()?, vec![3., 7.]);
    /// assert_eq!(x.sum_dims(&[0, -1], true)?.dims(), &[1, 1]);
    /// let dims: Vec<usize> = vec![0];
    /// assert_eq!(x.sum_dims(&dims, false)?.to_vec::<f32>()?, vec![4., 6.]);
    /// assert!(x.sum_dims(&[2], false).unwrap_err().to_string().contains("rank 2"));
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn sum_dims(&self, dims: &[impl Dim], keepdim: bool) -> Result<Tensor> {
        self.reduce(Reduction::Sum, dims, keepdim)
    }
    /// Largest element.
    pub fn max_all(&self) -> Result<Tensor> {
        self.reduce(Reduction::Max, &self.all_dims(), false)
    }
    /// Maximum over one dimension.
    ///
    /// NaN propagates (the result is NaN where the slice holds one). The
    /// gradient of a slice that holds NaNs goes to its NaNs, shared, and 0 to
    /// the rest, where PyTorch's `amax`/`amin` give NaN to every element; ties
    /// share the gradient equally. See the README's "Where kiln differs from
    /// PyTorch".
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let x = Tensor::new(&[[1f32, f32::NAN], [3., 2.]], &cpu())?;
    /// let m = x.max(1)?.to_vec::<f32>()?;
    /// assert!(m[0].is_nan());
    /// assert_eq!(m[1], 3.0);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn max(&self, dim: impl Dim) -> Result<Tensor> {
        self.reduce(Reduction::Max, &[dim], false)
    }
    /// Maximum over one dimension, keeping it.
    pub fn max_keepdim(&self, dim: impl Dim) -> Result<Tensor> {
        self.reduce(Reduction::Max, &[dim], true)
    }
    /// Smallest element.
    pub fn min_all(&self) -> Result<Tensor> {
        self.reduce(Reduction::Min, &self.all_dims(), false)
    }
    /// Minimum over one dimension; NaN and the gradient as [`max`](Self::max).
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let x = Tensor::new(&[[1f32, f32::NAN], [3., 2.]], &cpu())?;
    /// let m = x.min(1)?.to_vec::<f32>()?;
    /// assert!(m[0].is_nan());
    /// assert_eq!(m[1], 2.0);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn min(&self, dim: impl Dim) -> Result<Tensor> {
        self.reduce(Reduction::Min, &[dim], false)
    }
    /// Minimum over one dimension, keeping it.
    pub fn min_keepdim(&self, dim: impl Dim) -> Result<Tensor> {
        self.reduce(Reduction::Min, &[dim], true)
    }
    /// Product of every element, as a 0-d tensor (1 for an empty tensor).
    /// Floats multiply in f64 and round once; integers wrap and keep their
    /// dtype (PyTorch gives i64 for every integer input).
    ///
    /// The gradient is y/x where a slice has no zero; at the only zero of a
    /// slice, the product of the others; 0 where a slice has two zeros.
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let x = Tensor::new(&[[1f32, 2.], [3., 4.]], &cpu())?.requires_grad_();
    /// assert_eq!(x.prod_all()?.to_scalar::<f32>()?, 24.0);
    /// assert_eq!(x.prod(1)?.to_vec::<f32>()?, vec![2., 12.]);
    /// x.prod_all()?.backward()?;
    /// assert_eq!(x.grad().unwrap().to_vec::<f32>()?, vec![24., 12., 8., 6.]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn prod_all(&self) -> Result<Tensor> {
        self.reduce(Reduction::Prod, &self.all_dims(), false)
    }
    /// Product over one dimension, dropping it.
    pub fn prod(&self, dim: impl Dim) -> Result<Tensor> {
        self.reduce(Reduction::Prod, &[dim], false)
    }
    /// Product over one dimension, keeping it as size 1.
    pub fn prod_keepdim(&self, dim: impl Dim) -> Result<Tensor> {
        self.reduce(Reduction::Prod, &[dim], true)
    }
    /// Product over several dimensions.
    pub fn prod_dims(&self, dims: &[impl Dim], keepdim: bool) -> Result<Tensor> {
        self.reduce(Reduction::Prod, dims, keepdim)
    }
    /// Index of the maximum along `dim` (first on ties), i64.
    ///
    /// ```
    /// use kiln::{Tensor, cpu};
    /// let x = Tensor::new(&[[1f32, 5., 2.], [7., 0., 7.]], &cpu())?;
    /// assert_eq!(x.argmax(1)?.to_vec::<i64>()?, vec![1, 0]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn argmax(&self, dim: impl Dim) -> Result<Tensor> {
        self.reduce(Reduction::ArgMax, &[dim], false)
    }
    /// Index of the maximum, keeping the dimension.
    pub fn argmax_keepdim(&self, dim: impl Dim) -> Result<Tensor> {
        self.reduce(Reduction::ArgMax, &[dim], true)
    }
    /// Index of the minimum along `dim`, i64.
    pub fn argmin(&self, dim: impl Dim) -> Result<Tensor> {
        self.reduce(Reduction::ArgMin, &[dim], false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_member_has_four_launch_shapes_per_dtype() {
        let src = cuda_source();
        for &(name, ..) in MEMBERS {
            for shape in ["block", "thread", "partial", "final"] {
                assert!(src.contains(&format!("void reduce_{name}_f32_{shape}(")), "{name} {shape}");
                assert!(src.contains(&format!("void reduce_{name}_u8_{shape}(")), "{name} {shape}");
            }
        }
    }
}
