//! The CUDA side of the kernel contract: what an op's CUDA kernel may ask of
//! a CUDA device ([`CudaDevice`]), how its source is named ([`CudaModule`]),
//! and how its arguments are declared once for Rust and C
//! ([`kernel_args!`](crate::kernel_args)).
//!
//! Every kernel takes one argument, a struct declared with `kernel_args!`:
//! the macro writes the `#[repr(C)]` Rust struct and the C declaration the
//! kernel's source includes, from one list of fields, so the two cannot
//! disagree (there is no positional argument list to keep in sync by hand).
//! Kernels are found by name (`unary_erf_f32`), never by an integer code.

use crate::base::dtype::DType;
use crate::base::error::{Error, Result};
use crate::base::shape::Layout;
use crate::kernel::storage::Storage;
use smallvec::SmallVec;

/// Most dimensions a strided operand may have after merging (`KILN_MAXD`
/// in the kernels' prelude, which is generated from this).
pub(crate) const MAX_DIMS: usize = 8;

/// A strided view as kernels read it (`struct Lay` in the prelude).
///
/// `magic[d]` divides an element index by `dims[d]` with a multiply and a
/// shift (`lay_off` in the prelude) instead of a 64-bit divide and modulo
/// per dimension: the multiplier in the low 32 bits, the shift above. All
/// zero when a dimension does not fit 32 bits; the kernels then divide in
/// 64 bits, as they do for an index past `u32::MAX`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Lay {
    pub rank: i64,
    pub off: i64,
    pub dims: [i64; MAX_DIMS],
    pub strides: [i64; MAX_DIMS],
    pub magic: [u64; MAX_DIMS],
}

impl Lay {
    /// The C declaration of `Lay` and of `KILN_MAXD`, for the prelude.
    pub(crate) fn c_decl() -> String {
        format!(
            "#define KILN_MAXD {MAX_DIMS}\nstruct Lay {{ i64 rank; i64 off; i64 dims[KILN_MAXD]; i64 strides[KILN_MAXD]; u64 magic[KILN_MAXD]; }};\n"
        )
    }
}

/// The multiply-shift pair that divides any 32-bit `n` by `d` (Granlund and
/// Montgomery, "Division by invariant integers using multiplication", 1994,
/// figure 4.1): with `s = ceil(log2 d)` and `m = floor(2^32 (2^s - d) / d) + 1`,
/// `n / d = (mulhi32(n, m) + n) >> s`, the sum taken in 64 bits. Packed as
/// `m | s << 32`; `None` when `d` is 0 or does not fit 32 bits.
pub(crate) fn magic_divisor(d: u64) -> Option<u64> {
    if d == 0 || d > u64::from(u32::MAX) {
        return None;
    }
    let s = 64 - (d - 1).leading_zeros() as u64; // ceil(log2 d); 0 for d = 1
    let m = ((1u128 << 32) * ((1u128 << s) - u128::from(d)) / u128::from(d) + 1) as u64;
    debug_assert!(m <= u64::from(u32::MAX));
    Some(m | s << 32)
}

/// `n / d` as the kernels compute it from `magic_divisor(d)` (the prelude's
/// `div_magic`); the unit tests check it against `/`.
#[cfg(test)]
fn div_magic(n: u32, magic: u64) -> u32 {
    let (m, s) = (magic & 0xFFFF_FFFF, magic >> 32);
    let hi = (u64::from(n) * m) >> 32;
    ((hi + u64::from(n)) >> s) as u32
}

/// The argument struct of a kernel, passed by value as its one parameter.
pub(crate) trait KernelArgs {
    /// The struct's bytes (no padding: `kernel_args!` checks it).
    fn bytes(&self) -> &[u8];
}

/// Declares a kernel's argument struct once: the `#[repr(C)]` Rust struct,
/// its `KernelArgs` impl, and `NAME::C_DECL`, the C declaration that the
/// kernel's source puts before the kernel. Fields are `u64`, `i64`, `f64`
/// or `Lay` (8-byte multiples, so neither side pads).
#[macro_export]
#[doc(hidden)]
macro_rules! kernel_args {
    ($(#[$m:meta])* $name:ident { $($(#[$fm:meta])* $field:ident : $ty:tt),* $(,)? }) => {
        $(#[$m])*
        #[repr(C)]
        #[derive(Clone, Copy, Debug)]
        pub(crate) struct $name {
            $($(#[$fm])* pub(crate) $field: $crate::kernel_rust_type!($ty),)*
        }
        impl $name {
            /// The C declaration of this struct, for the kernel's source.
            pub(crate) const C_DECL: &'static str =
                concat!("struct ", stringify!($name), " { ", $($crate::kernel_c_type!($ty), " ", stringify!($field), "; ",)* "};\n");
        }
        const _: () = assert!(
            ::std::mem::size_of::<$name>() == 0 $(+ ::std::mem::size_of::<$crate::kernel_rust_type!($ty)>())*,
            "kernel argument structs must have no padding"
        );
        impl $crate::kernel::cuda::KernelArgs for $name {
            fn bytes(&self) -> &[u8] {
                // SAFETY: a repr(C) struct of u64/i64/f64/Lay fields without
                // padding (asserted above): every byte is initialised.
                unsafe { ::std::slice::from_raw_parts((self as *const $name).cast::<u8>(), ::std::mem::size_of::<$name>()) }
            }
        }
    };
}

/// The Rust type of a kernel argument field.
#[macro_export]
#[doc(hidden)]
macro_rules! kernel_rust_type {
    (Lay) => {
        $crate::kernel::cuda::Lay
    };
    ($t:ty) => {
        $t
    };
}

/// The C name of a kernel argument field's type.
#[macro_export]
#[doc(hidden)]
macro_rules! kernel_c_type {
    (u64) => {
        "u64"
    };
    (i64) => {
        "i64"
    };
    (f64) => {
        "double"
    };
    (Lay) => {
        "Lay"
    };
}

crate::kernel_args! {
    /// A unary family kernel's argument: out[i] = f(src[sl(i)]), with the
    /// op's scalars (`a`, `b`, an integer `pn`).
    UnaryArgs { src: u64, sl: Lay, out: u64, n: u64, a: f64, b: f64, pn: i64 }
}

crate::kernel_args! {
    /// A binary family kernel's argument: out[i] = f(a[la(i)], b[lb(i)]).
    BinaryArgs { a: u64, la: Lay, b: u64, lb: Lay, out: u64, n: u64 }
}

crate::kernel_args! {
    /// A reduction's argument: output o folds src at `outer(o) + inner(r)`
    /// for r in 0..n_in (the `block` and `thread` kernels).
    ReduceArgs { src: u64, outer: Lay, inner: Lay, out: u64, n_out: u64, n_in: u64 }
}

crate::kernel_args! {
    /// A long reduction over few outputs, pass 1: block b folds part
    /// (b % parts) of output (b / parts) into `part` (accumulator type).
    ReducePartialArgs { src: u64, outer: Lay, inner: Lay, part: u64, n_out: u64, n_in: u64, parts: u64 }
}

crate::kernel_args! {
    /// Pass 2: each output folds its `parts` accumulators.
    ReduceFinalArgs { part: u64, out: u64, n_out: u64, parts: u64 }
}

/// One NVRTC module: a name (the backend compiles each once per device, on
/// first use) and its source after the shared prelude.
pub(crate) struct CudaModule {
    pub name: &'static str,
    source: ModuleSource,
}

/// Where a module's source comes from.
enum ModuleSource {
    /// Generated by kiln (an op family's kernels for each dtype).
    Generated(fn() -> String),
    /// Given as text (a custom op's, [`crate::CustomOp::cuda_source`]).
    Text(&'static str),
}

impl CudaModule {
    /// A module whose source `source` generates.
    pub(crate) const fn generated(name: &'static str, source: fn() -> String) -> CudaModule {
        CudaModule { name, source: ModuleSource::Generated(source) }
    }
    /// A module with the source `text`.
    pub(crate) const fn text(name: &'static str, text: &'static str) -> CudaModule {
        CudaModule { name, source: ModuleSource::Text(text) }
    }
    /// The module's source, after the shared prelude.
    pub(crate) fn source(&self) -> String {
        match self.source {
            ModuleSource::Generated(f) => f(),
            ModuleSource::Text(t) => t.to_string(),
        }
    }
}

/// A module an op declares (`inventory::submit!`), so that the compile
/// check (`kiln::cuda_check`) compiles every module the backend may load.
pub(crate) struct DeclaredModule(pub &'static CudaModule);
inventory::collect!(DeclaredModule);

/// Every declared module, sorted by name.
pub(crate) fn declared_modules() -> Vec<&'static CudaModule> {
    let mut all: Vec<&'static CudaModule> = inventory::iter::<DeclaredModule>.into_iter().map(|m| m.0).collect();
    all.sort_by_key(|m| m.name);
    all
}

/// A family member's kernel: the family's module, the kernel's name, and
/// the scalars a unary op passes (`a`, `b`, `n`; zero for other families).
pub(crate) struct FamilyCall {
    pub module: &'static CudaModule,
    pub kernel: String,
    pub a: f64,
    pub b: f64,
    pub n: i64,
}

/// The suffix kernels use for a dtype.
pub(crate) fn dtype_tag(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "f32",
        DType::F64 => "f64",
        DType::I64 => "i64",
        DType::I32 => "i32",
        DType::U8 => "u8",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
    }
}

/// The C type of a dtype in the kernels' prelude.
pub(crate) fn c_type(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "float",
        DType::F64 => "double",
        DType::I64 => "i64",
        DType::I32 => "i32",
        DType::U8 => "u8",
        DType::F16 => "f16_t",
        DType::BF16 => "bf16_t",
    }
}

/// A matrix product as cuBLAS takes it (row-major C = A·B, batched with
/// strides): see `ops/matmul.rs`.
pub(crate) struct GemmCall {
    pub dtype: DType,
    pub a: u64,
    pub b: u64,
    pub c: u64,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    /// (transposed, leading dimension) of A and B as column-major cuBLAS sees them.
    pub a_form: (bool, usize),
    pub b_form: (bool, usize),
    pub stride_a: usize,
    pub stride_b: usize,
    /// Row stride of C (at least `n`) and the distance between its batches.
    pub ldc: usize,
    pub stride_c: usize,
    /// C = A·B (false) or C += A·B (true).
    pub accumulate: bool,
    pub count: usize,
}

/// How CUDA convolutions run (`KILN_CUDA_CONV`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ConvPath {
    /// cuDNN when it loads and takes the convolution, else im2col + cuBLAS
    /// when cuBLAS loads, else the direct kernels (default).
    Auto,
    /// Always cuDNN (an error where it does not load or declines).
    Dnn,
    /// Always im2col + cuBLAS (an error where cuBLAS does not load).
    Gemm,
    /// Always kiln's direct kernels.
    Direct,
}

/// The convolution path `KILN_CUDA_CONV` asks for: `auto` (default),
/// `cudnn`, `gemm` or `direct` (read at every convolution, so a test can
/// switch it).
pub(crate) fn conv_path() -> ConvPath {
    crate::base::env::env_setting("KILN_CUDA_CONV", "auto, cudnn, gemm or direct", |v| match v.to_ascii_lowercase().as_str() {
        "auto" => Some(ConvPath::Auto),
        "cudnn" => Some(ConvPath::Dnn),
        "gemm" | "im2col" => Some(ConvPath::Gemm),
        "direct" => Some(ConvPath::Direct),
        _ => None,
    })
    .unwrap_or(ConvPath::Auto)
}

/// The most workspace one convolution call holds, on either library path
/// (im2col + cuBLAS takes fewer images at a time; cuDNN an algorithm that
/// needs less).
pub(crate) const CONV_WORKSPACE_BYTES: usize = 256 << 20;

/// Which of a convolution's three products cuDNN is asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum DnnDirection {
    /// y = conv(x, w).
    Forward,
    /// dx from dy and w (also the transposed convolution's forward).
    BackwardData,
    /// dw from x and dy.
    BackwardFilter,
}

/// A convolution's sizes as a library takes them (NCHW images, OIHW
/// weights): padding on the top and left only (what the other side gets
/// follows from the output size).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct ConvDims {
    pub n: usize,
    pub c_in: usize,
    pub h: usize,
    pub w: usize,
    pub c_out: usize,
    pub oh: usize,
    pub ow: usize,
    pub kh: usize,
    pub kw: usize,
    pub stride: (usize, usize),
    pub dilation: (usize, usize),
    pub groups: usize,
    /// Top and left padding (negative where the geometry crops).
    pub pad: (isize, isize),
}

/// A convolution as cuDNN takes it, without bias. `x`, `w` and `y` are the
/// input, weight and output, or their gradients where the direction writes
/// or reads those.
pub(crate) struct DnnConvCall {
    pub direction: DnnDirection,
    pub dtype: DType,
    pub dims: ConvDims,
    pub x: u64,
    pub w: u64,
    pub y: u64,
}

/// What became of work offered to a library that may decline it.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Offload {
    /// Queued on the device's stream.
    Ran,
    /// Not run, and why (the library is missing, or does not take this
    /// call): the caller runs another path, or reports why.
    Declined(String),
}

/// Device memory held for the duration of one launch sequence.
pub(crate) trait TempBuffer {
    fn ptr(&self) -> u64;
}

/// What an op's CUDA kernel may ask of the device it runs on. The calls go
/// to the device's stream, in order, after the work queued before.
pub(crate) trait CudaDevice {
    /// Launches `kernel` of `module` (compiled on first use) on `grid`
    /// blocks of `block` threads, with `args` as its one parameter.
    fn launch(&self, module: &'static CudaModule, kernel: &str, grid: u32, block: u32, args: &dyn KernelArgs) -> Result<()>;
    /// Blocks of [`BLOCK`] threads for a grid-stride loop over `n` elements.
    fn grid_for(&self, n: usize) -> u32;
    /// Multiprocessors of the device.
    fn sm_count(&self) -> u32;
    /// The device address of a storage on this device.
    fn ptr(&self, s: &Storage) -> Result<u64>;
    /// Temporary device memory, freed (in stream order) when dropped.
    fn temp(&self, bytes: usize) -> Result<Box<dyn TempBuffer + '_>>;
    /// Copies `bytes` between device addresses.
    fn copy_d2d(&self, dst: u64, src: u64, bytes: usize) -> Result<()>;
    /// Sets `bytes` at `ptr` to zero.
    fn memset_zero(&self, ptr: u64, bytes: usize) -> Result<()>;
    /// A matrix product through cuBLAS: `Ok(false)` when cuBLAS is missing
    /// (the op then runs its own kernel).
    fn gemm(&self, call: &GemmCall) -> Result<bool>;
    /// Whether [`CudaDevice::gemm`] runs (cuBLAS loads on this device).
    fn has_gemm(&self) -> Result<bool>;
    /// A convolution through cuDNN, workspace from the device's allocator:
    /// [`Offload::Declined`] when cuDNN is missing or does not take it.
    fn conv_dnn(&self, call: &DnnConvCall) -> Result<Offload>;
    /// An error of this device (`Error::Backend` naming it).
    fn err(&self, msg: String) -> Error;
    /// The device address of this device's fault record (`struct
    /// KilnFault` of the prelude), where a kernel that reads indices
    /// records the first bad one (see `kernel::index_check`).
    fn fault_record(&self) -> Result<u64>;
}

/// Threads per block of elementwise kernels.
pub(crate) const BLOCK: u32 = 256;

/// Blocks per output for a reduction: one when there are outputs enough to
/// fill the device, else enough to give each multiprocessor several blocks
/// of at least 4096 elements each.
pub(crate) fn split_parts(sm_count: u32, n_out: usize, n_in: usize) -> usize {
    const MIN_PER_BLOCK: usize = 4096;
    let target_blocks = sm_count as usize * 4;
    if n_out >= target_blocks || n_in < 2 * MIN_PER_BLOCK {
        return 1;
    }
    (target_blocks / n_out.max(1)).min(n_in / MIN_PER_BLOCK).clamp(1, 1024)
}

/// Blocks for a launch of one block per item (at most 2^20).
pub(crate) fn grid_for_blocks(blocks: usize) -> u32 {
    blocks.clamp(1, 1 << 20) as u32
}

/// Threads of a block that folds `n_in` elements (a power of two).
pub(crate) fn block_for(n_in: usize) -> u32 {
    (n_in.next_power_of_two() as u32).clamp(32, BLOCK)
}

/// Merges dimensions that every layout walks contiguously
/// (stride[d] == stride[d+1] · dims[d+1]) and drops size-1 dimensions: the
/// row-major order of elements, and so each element's offset, is unchanged.
pub(crate) fn merge_dims(dims: &[usize], strides: &[&[usize]]) -> (Vec<usize>, Vec<Vec<usize>>) {
    let mut out_dims: Vec<usize> = Vec::new();
    let mut out_strides: Vec<Vec<usize>> = vec![Vec::new(); strides.len()];
    for d in 0..dims.len() {
        if dims[d] == 1 {
            continue;
        }
        if let Some(last) = out_dims.last_mut() {
            let mergeable = strides.iter().zip(&out_strides).all(|(s, o)| o.last().copied() == Some(s[d] * dims[d]));
            if mergeable {
                *last *= dims[d];
                for (o, s) in out_strides.iter_mut().zip(strides) {
                    if let Some(x) = o.last_mut() {
                        *x = s[d];
                    }
                }
                continue;
            }
        }
        out_dims.push(dims[d]);
        for (o, s) in out_strides.iter_mut().zip(strides) {
            o.push(s[d]);
        }
    }
    (out_dims, out_strides)
}

/// A `Lay` of merged dimensions, or an error naming the limit.
pub(crate) fn make_lay(dims: &[usize], strides: &[usize], offset: usize) -> std::result::Result<Lay, String> {
    if dims.len() > MAX_DIMS {
        return Err(format!(
            "a strided operand has {} dimensions that cannot be merged; kiln's CUDA kernels take at most {MAX_DIMS}: \
             make it contiguous first (e.g. `.contiguous()`), or reshape it to fewer dimensions",
            dims.len()
        ));
    }
    let mut l = Lay { rank: dims.len() as i64, off: offset as i64, dims: [1; MAX_DIMS], strides: [0; MAX_DIMS], magic: [0; MAX_DIMS] };
    for (i, (&d, &s)) in dims.iter().zip(strides).enumerate() {
        l.dims[i] = d as i64;
        l.strides[i] = s as i64;
    }
    let magic: Option<Vec<u64>> = dims.iter().map(|&d| magic_divisor(d as u64)).collect();
    if let Some(magic) = magic {
        l.magic[..magic.len()].copy_from_slice(&magic);
    }
    Ok(l)
}

/// `Lay`s for layouts of one shape, merged together.
pub(crate) fn lays(dev: &dyn CudaDevice, layouts: &[&Layout]) -> Result<SmallVec<[Lay; 3]>> {
    let dims = layouts[0].dims();
    let strides: SmallVec<[&[usize]; 3]> = layouts.iter().map(|l| l.strides()).collect();
    let (md, ms) = merge_dims(dims, &strides);
    layouts.iter().zip(&ms).map(|(l, s)| make_lay(&md, s, l.offset()).map_err(|m| dev.err(m))).collect()
}

/// One `Lay` of a layout.
pub(crate) fn lay(dev: &dyn CudaDevice, l: &Layout) -> Result<Lay> {
    Ok(lays(dev, &[l])?[0])
}

#[cfg(test)]
mod tests {
    use super::*;

    crate::kernel_args! {
        /// A test struct.
        Probe { src: u64, l: Lay, n: i64, x: f64 }
    }

    #[test]
    fn argument_structs_declare_the_same_fields_to_c() {
        assert_eq!(Probe::C_DECL, "struct Probe { u64 src; Lay l; i64 n; double x; };\n");
        let p = Probe { src: 7, l: make_lay(&[2], &[1], 0).unwrap(), n: -1, x: 0.5 };
        assert_eq!(p.bytes().len(), 8 + std::mem::size_of::<Lay>() + 16);
        assert_eq!(&p.bytes()[..8], &7u64.to_le_bytes());
        assert!(Lay::c_decl().contains("#define KILN_MAXD 8"));
    }

    #[test]
    fn multiply_shift_division_is_exact_for_every_32_bit_index() {
        // Divisors: all small ones, each power of two and its neighbours,
        // and a seeded spread; numerators: the edges of each quotient and of
        // the 32-bit range, and a seeded spread.
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut divisors: Vec<u64> = (1..=2048).collect();
        for p in 1..=32u32 {
            let v = 1u64 << p;
            divisors.extend([v - 1, v, v + 1].into_iter().filter(|&d| d <= u64::from(u32::MAX)));
        }
        divisors.extend((0..2000).map(|_| next() % u64::from(u32::MAX) + 1));
        for d in divisors {
            let magic = magic_divisor(d).expect("a 32-bit divisor has a multiplier");
            let d32 = d as u32;
            let mut ns = vec![0u32, 1, u32::MAX, u32::MAX - 1, 1 << 31, (1 << 31) - 1, d32, d32 - 1, d32.wrapping_add(1)];
            ns.extend((0..64).map(|_| next() as u32));
            let q = u32::MAX / d32;
            ns.extend([q * d32, (q * d32).wrapping_sub(1), (q / 2) * d32, ((q / 2) * d32).wrapping_sub(1)]);
            for n in ns {
                assert_eq!(div_magic(n, magic), n / d32, "{n} / {d} with multiplier {magic:#x}");
            }
        }
        assert_eq!(magic_divisor(0), None);
        assert_eq!(magic_divisor(1 << 32), None);
        let lay = make_lay(&[3, 1 << 33], &[1, 1], 0).unwrap();
        assert_eq!(lay.magic, [0; MAX_DIMS], "a dimension past 32 bits turns the fast path off for the whole view");
        let lay = make_lay(&[3, 5], &[5, 1], 0).unwrap();
        assert_eq!(&lay.magic[..2], &[magic_divisor(3).unwrap(), magic_divisor(5).unwrap()]);
    }

    #[test]
    fn reductions_split_long_and_few_and_keep_many_in_one_pass() {
        assert_eq!(split_parts(100, 1, 1 << 20), 256);
        assert_eq!(split_parts(100, 1000, 1 << 20), 1);
        assert_eq!(split_parts(100, 1, 100), 1);
        assert_eq!(block_for(0), 32);
        assert_eq!(block_for(1000), 256);
    }

    #[test]
    fn merge_contiguous_to_one_dim_and_keep_transpose_and_broadcast_apart() {
        let (d, s) = merge_dims(&[2, 3, 4], &[&[12, 4, 1]]);
        assert_eq!((d, s), (vec![24], vec![vec![1]]));
        let (d, s) = merge_dims(&[2, 3], &[&[1, 2], &[3, 1]]);
        assert_eq!((d, s), (vec![2, 3], vec![vec![1, 2], vec![3, 1]]));
        let (d, s) = merge_dims(&[4, 5], &[&[0, 1], &[5, 1]]);
        assert_eq!((d, s), (vec![4, 5], vec![vec![0, 1], vec![5, 1]]));
    }
}
