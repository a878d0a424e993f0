// The prelude of kiln's CUDA kernels: put before every module's source
// (each op family, each op with kernels of its own), which NVRTC compiles
// at run time for the device's architecture (and CI for sm_90 with NVRTC +
// ptxas). It reproduces the CPU kernels' arithmetic: scalars are converted
// to the operand's dtype first, integers wrap, integer division by zero
// gives 0, NaN propagates through max/min and wins argmax/argmin,
// conversions from floats go through f64 like the CPU's `from_f64`
// (saturating to integers), conversions from integers round once to a
// float and wrap to a narrower integer (numpy and PyTorch). Modules are
// compiled with --fmad=false so that a*b+c rounds twice, as on the CPU.
//
// No headers are included: f16 conversions use PTX `cvt`, bf16 ones are bit
// manipulations that mirror the `half` crate.

typedef unsigned char u8;
typedef long long i64;
typedef int i32;
typedef unsigned long long u64;
typedef unsigned int u32;

struct f16_t { unsigned short bits; };
struct bf16_t { unsigned short bits; };

// `struct Lay` and KILN_MAXD are generated from the Rust side
// (kernel/cuda.rs, `Lay::c_decl`) and replace the next line.
// @LAY@

// n / d from d's multiplier and shift (kernel/cuda.rs, `magic_divisor`):
// a multiply-high, an add and a shift where a 32-bit divide is a dozen
// instructions and a 64-bit one a call.
__device__ __forceinline__ u32 div_magic(u32 n, u64 magic) {
    u64 hi = (u64)__umulhi(n, (u32)magic);
    return (u32)((hi + (u64)n) >> (u32)(magic >> 32));
}

// Storage offset of the i-th element (row-major) of a strided view: in
// 32 bits with multiply-shift division while the index fits (magic[0] is
// 0 when a dimension does not), else with 64-bit divides.
__device__ __forceinline__ i64 lay_off(const Lay& l, u64 i) {
    if (l.rank == 1) return l.off + (i64)i * l.strides[0];
    if (l.magic[0] != 0 && i <= 0xFFFFFFFFull) {
        u32 j = (u32)i;
        i64 off = l.off;
        for (int d = (int)l.rank - 1; d >= 0; --d) {
            u32 q = div_magic(j, l.magic[d]);
            off += (i64)(j - q * (u32)l.dims[d]) * l.strides[d];
            j = q;
        }
        return off;
    }
    i64 off = l.off;
    for (int d = (int)l.rank - 1; d >= 0; --d) {
        u64 n = (u64)l.dims[d];
        off += (i64)(i % n) * l.strides[d];
        i /= n;
    }
    return off;
}

#define GRID_LOOP(i, n) \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (u64)blockDim.x * gridDim.x)

// ---- 16-byte packs: elementwise kernels over contiguous operands ---------
// A thread loads and stores PACK_BYTES at a time (LDG.128/STG.128 on the
// GPU) when every operand is aligned, PackOf<T>::N elements a pack; the
// elements are computed one by one with the same expression as the scalar
// path, so the results are the same bits.
#define PACK_BYTES 16
template <typename T, int N> struct alignas(sizeof(T) * N) Pack { T e[N]; };
template <typename T> struct PackOf { static constexpr int N = PACK_BYTES / sizeof(T) > 0 ? PACK_BYTES / sizeof(T) : 1; };
__device__ __forceinline__ bool aligned_to(const void* p, u64 bytes) { return ((u64)p % bytes) == 0; }

// ---- conversions: to/from f64, as the CPU's WithDType -------------------

#ifdef KILN_CUDASIM
// The CUDA simulator (cudasim/) compiles this file for the host.
__device__ __forceinline__ float h2f(unsigned short h) { return kiln_sim_h2f(h); }
__device__ __forceinline__ unsigned short f2h(float f) { return kiln_sim_f2h(f); }
#else
__device__ __forceinline__ float h2f(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ unsigned short f2h(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#endif

// The `half` crate's f64 -> bf16 (it rounds on the upper 32 bits of the f64).
__device__ __forceinline__ unsigned short d2bf(double value) {
    u64 val = (u64)__double_as_longlong(value);
    u32 x = (u32)(val >> 32);
    u32 sign = x & 0x80000000u;
    u32 exp = x & 0x7FF00000u;
    u32 man = x & 0x000FFFFFu;
    if (exp == 0x7FF00000u) {
        u32 nan_bit = (man == 0 && (u32)val == 0) ? 0u : 0x0040u;
        return (unsigned short)((sign >> 16) | 0x7F80u | nan_bit | (man >> 13));
    }
    u32 half_sign = sign >> 16;
    i64 unbiased_exp = (i64)(exp >> 20) - 1023;
    i64 half_exp = unbiased_exp + 127;
    if (half_exp >= 0xFF) return (unsigned short)(half_sign | 0x7F80u);
    if (half_exp <= 0) {
        if (7 - half_exp > 21) return (unsigned short)half_sign;
        u32 m = man | 0x00100000u;
        u32 half_man = m >> (14 - half_exp);
        u32 round_bit = 1u << (13 - half_exp);
        if ((m & round_bit) != 0 && (m & (3 * round_bit - 1)) != 0) half_man += 1;
        return (unsigned short)(half_sign | half_man);
    }
    u32 he = ((u32)half_exp) << 7;
    u32 half_man = man >> 13;
    u32 round_bit = 0x00001000u;
    if ((man & round_bit) != 0 && (man & (3 * round_bit - 1)) != 0) {
        return (unsigned short)((half_sign | he | half_man) + 1);
    }
    return (unsigned short)(half_sign | he | half_man);
}

template <typename T> struct Cv;
template <> struct Cv<float> {
    static __device__ __forceinline__ double to(float x) { return (double)x; }
    static __device__ __forceinline__ float from(double v) { return (float)v; }
};
template <> struct Cv<double> {
    static __device__ __forceinline__ double to(double x) { return x; }
    static __device__ __forceinline__ double from(double v) { return v; }
};
template <> struct Cv<i64> {
    static __device__ __forceinline__ double to(i64 x) { return (double)x; }
    // Rust's saturating `as`: NaN -> 0.
    static __device__ __forceinline__ i64 from(double v) {
        if (v != v) return 0;
        if (v >= 9223372036854775807.0) return (i64)0x7FFFFFFFFFFFFFFFull;
        if (v <= -9223372036854775808.0) return (i64)0x8000000000000000ull;
        return (i64)v;
    }
};
template <> struct Cv<i32> {
    static __device__ __forceinline__ double to(i32 x) { return (double)x; }
    // Rust's saturating `as`: NaN -> 0.
    static __device__ __forceinline__ i32 from(double v) {
        if (v != v) return 0;
        if (v >= 2147483647.0) return 2147483647;
        if (v <= -2147483648.0) return (i32)0x80000000u;
        return (i32)v;
    }
};
template <> struct Cv<u8> {
    static __device__ __forceinline__ double to(u8 x) { return (double)x; }
    static __device__ __forceinline__ u8 from(double v) {
        if (v != v || v <= 0.0) return 0;
        if (v >= 255.0) return 255;
        return (u8)(int)v;
    }
};
template <> struct Cv<f16_t> {
    static __device__ __forceinline__ double to(f16_t x) { return (double)h2f(x.bits); }
    // Through f32, as `half` does on x86 with F16C.
    static __device__ __forceinline__ f16_t from(double v) { f16_t r; r.bits = f2h((float)v); return r; }
};
template <> struct Cv<bf16_t> {
    static __device__ __forceinline__ double to(bf16_t x) {
        return (double)__int_as_float((int)(((u32)x.bits) << 16));
    }
    static __device__ __forceinline__ bf16_t from(double v) { bf16_t r; r.bits = d2bf(v); return r; }
};

// ---- arithmetic of the compute dtypes -----------------------------------

template <typename T> struct Ar;
template <> struct Ar<float> {
    static __device__ __forceinline__ float add(float a, float b) { return a + b; }
    static __device__ __forceinline__ float sub(float a, float b) { return a - b; }
    static __device__ __forceinline__ float mul(float a, float b) { return a * b; }
    static __device__ __forceinline__ float div(float a, float b) { return a / b; }
    // NaN propagates (PyTorch, numpy and the CPU); fmaxf would drop it.
    static __device__ __forceinline__ float mx(float a, float b) {
        return (a != a || b != b) ? __int_as_float(0x7fc00000) : fmaxf(a, b);
    }
    static __device__ __forceinline__ float mn(float a, float b) {
        return (a != a || b != b) ? __int_as_float(0x7fc00000) : fminf(a, b);
    }
    static __device__ __forceinline__ float neg(float a) { return -a; }
    static __device__ __forceinline__ float abs(float a) { return fabsf(a); }
    static __device__ __forceinline__ float lowest() { return -__int_as_float(0x7f800000); }
    static __device__ __forceinline__ float highest() { return __int_as_float(0x7f800000); }
};
template <> struct Ar<double> {
    static __device__ __forceinline__ double add(double a, double b) { return a + b; }
    static __device__ __forceinline__ double sub(double a, double b) { return a - b; }
    static __device__ __forceinline__ double mul(double a, double b) { return a * b; }
    static __device__ __forceinline__ double div(double a, double b) { return a / b; }
    static __device__ __forceinline__ double mx(double a, double b) {
        return (a != a || b != b) ? __longlong_as_double(0x7ff8000000000000ll) : fmax(a, b);
    }
    static __device__ __forceinline__ double mn(double a, double b) {
        return (a != a || b != b) ? __longlong_as_double(0x7ff8000000000000ll) : fmin(a, b);
    }
    static __device__ __forceinline__ double neg(double a) { return -a; }
    static __device__ __forceinline__ double abs(double a) { return fabs(a); }
    static __device__ __forceinline__ double lowest() { return -__longlong_as_double(0x7ff0000000000000ll); }
    static __device__ __forceinline__ double highest() { return __longlong_as_double(0x7ff0000000000000ll); }
};
template <> struct Ar<i64> {
    static __device__ __forceinline__ i64 add(i64 a, i64 b) { return (i64)((u64)a + (u64)b); }
    static __device__ __forceinline__ i64 sub(i64 a, i64 b) { return (i64)((u64)a - (u64)b); }
    static __device__ __forceinline__ i64 mul(i64 a, i64 b) { return (i64)((u64)a * (u64)b); }
    static __device__ __forceinline__ i64 div(i64 a, i64 b) {
        if (b == 0) return 0;
        if (b == -1) return (i64)(0ull - (u64)a);
        return a / b;
    }
    static __device__ __forceinline__ i64 mx(i64 a, i64 b) { return b > a ? b : a; }
    static __device__ __forceinline__ i64 mn(i64 a, i64 b) { return b < a ? b : a; }
    static __device__ __forceinline__ i64 neg(i64 a) { return (i64)(0ull - (u64)a); }
    static __device__ __forceinline__ i64 abs(i64 a) { return a < 0 ? (i64)(0ull - (u64)a) : a; }
    static __device__ __forceinline__ i64 lowest() { return (i64)0x8000000000000000ull; }
    static __device__ __forceinline__ i64 highest() { return (i64)0x7FFFFFFFFFFFFFFFull; }
};
template <> struct Ar<i32> {
    static __device__ __forceinline__ i32 add(i32 a, i32 b) { return (i32)((u32)a + (u32)b); }
    static __device__ __forceinline__ i32 sub(i32 a, i32 b) { return (i32)((u32)a - (u32)b); }
    static __device__ __forceinline__ i32 mul(i32 a, i32 b) { return (i32)((u32)a * (u32)b); }
    static __device__ __forceinline__ i32 div(i32 a, i32 b) {
        if (b == 0) return 0;
        if (b == -1) return (i32)(0u - (u32)a);
        return a / b;
    }
    static __device__ __forceinline__ i32 mx(i32 a, i32 b) { return b > a ? b : a; }
    static __device__ __forceinline__ i32 mn(i32 a, i32 b) { return b < a ? b : a; }
    static __device__ __forceinline__ i32 neg(i32 a) { return (i32)(0u - (u32)a); }
    static __device__ __forceinline__ i32 abs(i32 a) { return a < 0 ? (i32)(0u - (u32)a) : a; }
    static __device__ __forceinline__ i32 lowest() { return (i32)0x80000000u; }
    static __device__ __forceinline__ i32 highest() { return 2147483647; }
};
template <> struct Ar<u8> {
    static __device__ __forceinline__ u8 add(u8 a, u8 b) { return (u8)(a + b); }
    static __device__ __forceinline__ u8 sub(u8 a, u8 b) { return (u8)(a - b); }
    static __device__ __forceinline__ u8 mul(u8 a, u8 b) { return (u8)(a * b); }
    static __device__ __forceinline__ u8 div(u8 a, u8 b) { return b == 0 ? (u8)0 : (u8)(a / b); }
    static __device__ __forceinline__ u8 mx(u8 a, u8 b) { return b > a ? b : a; }
    static __device__ __forceinline__ u8 mn(u8 a, u8 b) { return b < a ? b : a; }
    static __device__ __forceinline__ u8 neg(u8 a) { return (u8)(0 - a); }
    static __device__ __forceinline__ u8 abs(u8 a) { return a; }
    static __device__ __forceinline__ u8 lowest() { return 0; }
    static __device__ __forceinline__ u8 highest() { return 255; }
};

// x^n by squaring, as the CPU's `powi`.
template <typename T> __device__ __forceinline__ T powi(T x, int n) {
    T base = x;
    unsigned int e = n < 0 ? (unsigned int)(-(long long)n) : (unsigned int)n;
    T acc = Cv<T>::from(1.0);
    while (e > 0) {
        if (e & 1u) acc = Ar<T>::mul(acc, base);
        base = Ar<T>::mul(base, base);
        e >>= 1;
    }
    return n < 0 ? Ar<T>::div(Cv<T>::from(1.0), acc) : acc;
}

// Float-only functions; integers never reach them (the front end refuses).
template <typename T> struct Fl {
    static __device__ __forceinline__ T exp(T x) { return x; }
    static __device__ __forceinline__ T log(T x) { return x; }
    static __device__ __forceinline__ T sqrt(T x) { return x; }
    static __device__ __forceinline__ T sin(T x) { return x; }
    static __device__ __forceinline__ T cos(T x) { return x; }
    static __device__ __forceinline__ T tanh(T x) { return x; }
    static __device__ __forceinline__ T pow(T x, T y) { return powi(x, (int)y); }
};
template <> struct Fl<float> {
    static __device__ __forceinline__ float exp(float x) { return expf(x); }
    static __device__ __forceinline__ float log(float x) { return logf(x); }
    static __device__ __forceinline__ float sqrt(float x) { return sqrtf(x); }
    static __device__ __forceinline__ float sin(float x) { return sinf(x); }
    static __device__ __forceinline__ float cos(float x) { return cosf(x); }
    static __device__ __forceinline__ float tanh(float x) { return tanhf(x); }
    static __device__ __forceinline__ float pow(float x, float y) { return powf(x, y); }
};
template <> struct Fl<double> {
    static __device__ __forceinline__ double exp(double x) { return ::exp(x); }
    static __device__ __forceinline__ double log(double x) { return ::log(x); }
    static __device__ __forceinline__ double sqrt(double x) { return ::sqrt(x); }
    static __device__ __forceinline__ double sin(double x) { return ::sin(x); }
    static __device__ __forceinline__ double cos(double x) { return ::cos(x); }
    static __device__ __forceinline__ double tanh(double x) { return ::tanh(x); }
    static __device__ __forceinline__ double pow(double x, double y) { return ::pow(x, y); }
};

// ---- accumulators and indices, shared by several ops ----------------------

// Floats accumulate in f64 (sums hardly depend on the order), integers wrap.
template <typename T> struct Acc { typedef T type; };
template <> struct Acc<float> { typedef double type; };

// Indices as the CPU reads them (`host_kernels::index_list`): a negative
// index is out of range (it selects zeros and adds nothing), never index 0.
template <typename I> __device__ __forceinline__ u64 read_id(const I* ids, Lay li, u64 j) {
    double v = Cv<I>::to(ids[lay_off(li, j)]);
    if (!(v >= 0.0)) return 0xFFFFFFFFFFFFFFFFull;
    if (v >= 18446744073709551615.0) return 0xFFFFFFFFFFFFFFFFull;
    return (u64)v;
}
template <> __device__ __forceinline__ u64 read_id<i64>(const i64* ids, Lay li, u64 j) {
    i64 v = ids[lay_off(li, j)];
    return v < 0 ? 0xFFFFFFFFFFFFFFFFull : (u64)v;
}
template <> __device__ __forceinline__ u64 read_id<i32>(const i32* ids, Lay li, u64 j) {
    i32 v = ids[lay_off(li, j)];
    return v < 0 ? 0xFFFFFFFFFFFFFFFFull : (u64)v;
}
template <> __device__ __forceinline__ u64 read_id<u8>(const u8* ids, Lay li, u64 j) { return (u64)ids[lay_off(li, j)]; }

// The value of an index (i64, i32 or u8) as it is, for a check that names it.
template <typename I> __device__ __forceinline__ i64 read_raw(const I* ids, Lay li, u64 j) { return (i64)ids[lay_off(li, j)]; }

// ---- device-side index checks (kernel/index_check.rs) --------------------
// The device's fault record, in mapped pinned host memory: the first kernel
// thread that meets a bad index claims it (state 0 -> 1), writes what it
// found and publishes it (state 2); the host reads it when it synchronises
// and reports it as KernelFailed naming the op of `site`.
struct KilnFault { u32 state; u32 pad; u64 site; i64 value; u64 bound; i64 dim; };

// Whether `value` lies in [0, bound); records it in the fault record when not.
__device__ __forceinline__ bool kiln_index_ok(u64 fault, u64 site, i64 value, u64 bound, i64 dim) {
    if (value >= 0 && (u64)value < bound) return true;
    KilnFault* f = (KilnFault*)fault;
    if (atomicCAS(&f->state, 0u, 1u) == 0u) {
        f->site = site;
        f->value = value;
        f->bound = bound;
        f->dim = dim;
        __threadfence_system();
        atomicExch(&f->state, 2u);
    }
    return false;
}

