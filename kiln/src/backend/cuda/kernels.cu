// kiln's CUDA kernels, compiled at run time by NVRTC for the device's
// architecture (and in CI for sm_90 by NVRTC + ptxas). Every kernel takes
// strided operands as `Lay` (rank <= KILN_MAXD after the host merged what
// can be merged) and reproduces the CPU kernels' arithmetic: scalars are
// converted to the operand's dtype first, integers wrap, integer division by
// zero gives 0, NaN propagates through max/min (relu, clamp, reductions) and
// wins argmax/argmin (the first one), conversions from floats go through f64
// like the CPU's `from_f64` (saturating to integers), conversions from
// integers round once to a float and wrap to a narrower integer (numpy and
// PyTorch), and random numbers are the same Philox 4x32-10 counters. The module is compiled
// with --fmad=false so that a*b+c rounds twice, as on the CPU.
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

#define KILN_MAXD 8

struct Lay {
    i64 rank;
    i64 off;
    i64 dims[KILN_MAXD];
    i64 strides[KILN_MAXD];
};

// Storage offset of the i-th element (row-major) of a strided view.
__device__ __forceinline__ i64 lay_off(const Lay& l, u64 i) {
    if (l.rank == 1) return l.off + (i64)i * l.strides[0];
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

// ---- creation ------------------------------------------------------------

template <typename T> __device__ void fill_impl(T* out, u64 n, double value) {
    T v = Cv<T>::from(value);
    GRID_LOOP(i, n) out[i] = v;
}

template <typename T> __device__ void arange_impl(T* out, u64 n, double start, double step) {
    GRID_LOOP(i, n) out[i] = Cv<T>::from(start + (double)i * step);
}

// Philox 4x32-10, as kiln::philox4x32.
__device__ __forceinline__ void philox(u32 c[4], u32 k0, u32 k1) {
    const u32 M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
    for (int round = 0; round < 10; ++round) {
        if (round > 0) { k0 += W0; k1 += W1; }
        u32 hi0 = __umulhi(M0, c[0]), lo0 = M0 * c[0];
        u32 hi1 = __umulhi(M1, c[2]), lo1 = M1 * c[2];
        u32 n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
        c[0] = n0; c[1] = lo1; c[2] = n2; c[3] = lo0;
    }
}

// dist 0: uniform in [a, b); dist 1: normal with mean a and std b.
template <typename T>
__device__ void random_impl(T* out, u64 n, u64 seed, u64 offset, int dist, double a, double b) {
    GRID_LOOP(i, n) {
        u64 idx = offset + i;
        u32 c[4] = {(u32)idx, (u32)(idx >> 32), 0u, 0u};
        philox(c, (u32)seed, (u32)(seed >> 32));
        double v;
        if (dist == 0) {
            u64 bits = (((u64)c[0]) << 21) ^ (((u64)c[1]) >> 11);
            double u = (double)(bits & ((1ull << 53) - 1)) * (1.0 / 9007199254740992.0);
            v = a + (b - a) * u;
        } else {
            double u1 = ((double)c[2] + 0.5) * (1.0 / 4294967296.0);
            double u2 = (double)c[3] * (1.0 / 4294967296.0);
            double z = ::sqrt(-2.0 * ::log(u1)) * ::cos(6.283185307179586 * u2);
            v = a + b * z;
        }
        T x = Cv<T>::from(v);
        // Rounding to a narrower type can reach the excluded upper bound: a
        // uniform draw never returns it (the CPU does the same).
        if (dist == 0 && Cv<T>::to(x) >= b) x = Cv<T>::from(a);
        out[i] = x;
    }
}

// ---- elementwise -----------------------------------------------------------

template <typename T> __device__ __forceinline__ T unary_op(int op, T x, T a, T b, int n) {
    switch (op) {
    case 0: return Ar<T>::neg(x);
    case 1: return Ar<T>::abs(x);
    case 2: return Ar<T>::mul(x, x);
    case 3: return Ar<T>::mx(x, Cv<T>::from(0.0));
    case 4:
        if (n == 2) return Ar<T>::mul(x, x);
        if (n == 3) return Ar<T>::mul(Ar<T>::mul(x, x), x);
        return powi(x, n);
    case 5: return Ar<T>::add(x, a);
    case 6: return Ar<T>::sub(x, a);
    case 7: return Ar<T>::sub(a, x);
    case 8: return Ar<T>::mul(x, a);
    case 9: return Ar<T>::div(x, a);
    case 10: return Ar<T>::mx(x, a);
    case 11: return Ar<T>::mn(x, a);
    case 12: return Ar<T>::add(Ar<T>::mul(x, a), b);
    case 20: return Fl<T>::exp(x);
    case 21: return Fl<T>::log(x);
    case 22: return Fl<T>::sqrt(x);
    case 23: return Ar<T>::div(Cv<T>::from(1.0), x);
    case 24: return Fl<T>::sin(x);
    case 25: return Fl<T>::cos(x);
    case 26: return Fl<T>::tanh(x);
    case 27: {
        T one = Cv<T>::from(1.0);
        return Ar<T>::div(one, Ar<T>::add(one, Fl<T>::exp(Ar<T>::neg(x))));
    }
    case 28: return Fl<T>::pow(x, a);
    case 29: return Ar<T>::div(a, x);
    default: return x;
    }
}

template <typename T>
__device__ void unary_impl(const T* src, Lay sl, T* out, u64 n, int op, double da, double db, int pn) {
    T a = Cv<T>::from(da), b = Cv<T>::from(db);
    if (sl.rank == 1 && sl.strides[0] == 1) {
        const T* s = src + sl.off;
        GRID_LOOP(i, n) out[i] = unary_op<T>(op, s[i], a, b, pn);
    } else {
        GRID_LOOP(i, n) out[i] = unary_op<T>(op, src[lay_off(sl, i)], a, b, pn);
    }
}

template <typename T> __device__ __forceinline__ T binary_op(int op, T x, T y) {
    switch (op) {
    case 0: return Ar<T>::add(x, y);
    case 1: return Ar<T>::sub(x, y);
    case 2: return Ar<T>::mul(x, y);
    case 3: return Ar<T>::div(x, y);
    case 4: return Fl<T>::pow(x, y);
    case 5: return Ar<T>::mx(x, y);
    case 6: return Ar<T>::mn(x, y);
    default: return x;
    }
}

template <typename T> __device__ __forceinline__ u8 compare_op(int op, T x, T y) {
    switch (op) {
    case 0: return x == y;
    case 1: return x != y;
    case 2: return x < y;
    case 3: return x <= y;
    case 4: return x > y;
    case 5: return x >= y;
    default: return 0;
    }
}

template <typename T>
__device__ void binary_impl(const T* a, Lay la, const T* b, Lay lb, T* out, u64 n, int op) {
    if (la.rank == 1 && lb.rank == 1 && la.strides[0] == 1 && lb.strides[0] == 1) {
        const T* x = a + la.off;
        const T* y = b + lb.off;
        GRID_LOOP(i, n) out[i] = binary_op<T>(op, x[i], y[i]);
    } else {
        GRID_LOOP(i, n) out[i] = binary_op<T>(op, a[lay_off(la, i)], b[lay_off(lb, i)]);
    }
}

template <typename T>
__device__ void compare_impl(const T* a, Lay la, const T* b, Lay lb, u8* out, u64 n, int op) {
    GRID_LOOP(i, n) out[i] = compare_op<T>(op, a[lay_off(la, i)], b[lay_off(lb, i)]);
}

// From an integer, as the CPU's `from_i64` (numpy and PyTorch): one rounding
// to f32 or f64 (through f64 an i64 above 2^53 would round twice), two's
// complement truncation to a narrower integer; half types through f64.
template <typename D> struct FromInt {
    static __device__ __forceinline__ D go(i64 v) { return Cv<D>::from((double)v); }
};
template <> struct FromInt<float> {
    static __device__ __forceinline__ float go(i64 v) { return (float)v; }
};
template <> struct FromInt<i64> {
    static __device__ __forceinline__ i64 go(i64 v) { return v; }
};
template <> struct FromInt<i32> {
    static __device__ __forceinline__ i32 go(i64 v) { return (i32)(u32)(u64)v; }
};
template <> struct FromInt<u8> {
    static __device__ __forceinline__ u8 go(i64 v) { return (u8)(u64)v; }
};

// From a float: through f64 (saturating to integers), as the CPU's `from_f64`.
template <typename S> struct ConvFrom {
    template <typename D> static __device__ __forceinline__ D go(S x) { return Cv<D>::from(Cv<S>::to(x)); }
};
template <> struct ConvFrom<i64> {
    template <typename D> static __device__ __forceinline__ D go(i64 x) { return FromInt<D>::go(x); }
};
template <> struct ConvFrom<i32> {
    template <typename D> static __device__ __forceinline__ D go(i32 x) { return FromInt<D>::go((i64)x); }
};
template <> struct ConvFrom<u8> {
    template <typename D> static __device__ __forceinline__ D go(u8 x) { return FromInt<D>::go((i64)x); }
};

// Same dtype: the bits are copied.
template <typename S, typename D> struct Conv {
    static __device__ __forceinline__ D go(S x) { return ConvFrom<S>::template go<D>(x); }
};
template <typename S> struct Conv<S, S> {
    static __device__ __forceinline__ S go(S x) { return x; }
};

template <typename S, typename D>
__device__ void copy_impl(const S* src, Lay sl, D* dst, Lay dl, u64 n) {
    if (sl.rank == 1 && dl.rank == 1 && sl.strides[0] == 1 && dl.strides[0] == 1) {
        const S* s = src + sl.off;
        D* d = dst + dl.off;
        GRID_LOOP(i, n) d[i] = Conv<S, D>::go(s[i]);
    } else {
        GRID_LOOP(i, n) dst[lay_off(dl, i)] = Conv<S, D>::go(src[lay_off(sl, i)]);
    }
}

template <typename C, typename T>
__device__ void where_impl(const C* c, Lay lc, const T* a, Lay la, const T* b, Lay lb, T* out, u64 n) {
    GRID_LOOP(i, n) {
        bool m = Cv<C>::to(c[lay_off(lc, i)]) != 0.0;
        out[i] = m ? a[lay_off(la, i)] : b[lay_off(lb, i)];
    }
}

// ---- reductions ------------------------------------------------------------

// Floats accumulate in f64 (sums hardly depend on the order), integers wrap.
template <typename T> struct Acc { typedef T type; };
template <> struct Acc<float> { typedef double type; };

template <typename T> __device__ __forceinline__ typename Acc<T>::type red_init(int op) {
    typedef typename Acc<T>::type A;
    if (op == 0) return Cv<A>::from(0.0);
    if (op == 1) return (A)Ar<T>::lowest();
    return (A)Ar<T>::highest();
}
template <typename T>
__device__ __forceinline__ typename Acc<T>::type red_comb(int op, typename Acc<T>::type a, typename Acc<T>::type b) {
    typedef typename Acc<T>::type A;
    if (op == 0) return Ar<A>::add(a, b);
    if (op == 1) return Ar<A>::mx(a, b);
    return Ar<A>::mn(a, b);
}

// One block per output: threads stride over the reduced elements, then a
// shared-memory tree. `outer` maps an output index to the first source
// element, `inner` a reduced index to its distance from there.
template <typename T>
__device__ void reduce_block_impl(const T* src, Lay outer, Lay inner, T* out, u64 n_out, u64 n_in, int op) {
    typedef typename Acc<T>::type A;
    __shared__ A sh[256];
    for (u64 o = blockIdx.x; o < n_out; o += gridDim.x) {
        i64 base = lay_off(outer, o);
        A acc = red_init<T>(op);
        for (u64 r = threadIdx.x; r < n_in; r += blockDim.x) acc = red_comb<T>(op, acc, (A)src[base + lay_off(inner, r)]);
        sh[threadIdx.x] = acc;
        __syncthreads();
        for (unsigned int s = blockDim.x / 2; s > 0; s >>= 1) {
            if (threadIdx.x < s) sh[threadIdx.x] = red_comb<T>(op, sh[threadIdx.x], sh[threadIdx.x + s]);
            __syncthreads();
        }
        if (threadIdx.x == 0) out[o] = (T)sh[0];
        __syncthreads();
    }
}

// Long reductions over few outputs (sum_all, norm, mean_all), pass 1: block
// b reduces part (b % parts) of output (b / parts) into its accumulator.
template <typename T>
__device__ void reduce_partial_impl(const T* src, Lay outer, Lay inner, typename Acc<T>::type* part, u64 n_out, u64 n_in,
                                    u64 parts, int op) {
    typedef typename Acc<T>::type A;
    __shared__ A sh[256];
    u64 chunk = (n_in + parts - 1) / parts;
    for (u64 b = blockIdx.x; b < n_out * parts; b += gridDim.x) {
        u64 o = b / parts, p = b % parts;
        u64 lo = p * chunk, hi = lo + chunk < n_in ? lo + chunk : n_in;
        i64 base = lay_off(outer, o);
        A acc = red_init<T>(op);
        for (u64 r = lo + threadIdx.x; r < hi; r += blockDim.x) acc = red_comb<T>(op, acc, (A)src[base + lay_off(inner, r)]);
        sh[threadIdx.x] = acc;
        __syncthreads();
        for (unsigned int s = blockDim.x / 2; s > 0; s >>= 1) {
            if (threadIdx.x < s) sh[threadIdx.x] = red_comb<T>(op, sh[threadIdx.x], sh[threadIdx.x + s]);
            __syncthreads();
        }
        if (threadIdx.x == 0) part[b] = sh[0];
        __syncthreads();
    }
}

// Pass 2: one thread per output combines its parts in order.
template <typename T>
__device__ void reduce_final_impl(const typename Acc<T>::type* part, T* out, u64 n_out, u64 parts, int op) {
    typedef typename Acc<T>::type A;
    GRID_LOOP(o, n_out) {
        A acc = red_init<T>(op);
        for (u64 p = 0; p < parts; ++p) acc = red_comb<T>(op, acc, part[o * parts + p]);
        out[o] = (T)acc;
    }
}

// One thread per output, for short reductions over many outputs.
template <typename T>
__device__ void reduce_thread_impl(const T* src, Lay outer, Lay inner, T* out, u64 n_out, u64 n_in, int op) {
    typedef typename Acc<T>::type A;
    GRID_LOOP(o, n_out) {
        i64 base = lay_off(outer, o);
        A acc = red_init<T>(op);
        for (u64 r = 0; r < n_in; ++r) acc = red_comb<T>(op, acc, (A)src[base + lay_off(inner, r)]);
        out[o] = (T)acc;
    }
}

// The value argmax/argmin compares: exact for integers (i64 above 2^53 must
// not tie through f64), f64 for the float types (the first NaN wins).
template <typename T> struct ArgKey {
    typedef double type;
    static __device__ __forceinline__ double get(T x) { return Cv<T>::to(x); }
    static __device__ __forceinline__ bool nan(double v) { return v != v; }
};
template <> struct ArgKey<i64> {
    typedef i64 type;
    static __device__ __forceinline__ i64 get(i64 x) { return x; }
    static __device__ __forceinline__ bool nan(i64) { return false; }
};
template <> struct ArgKey<i32> {
    typedef i32 type;
    static __device__ __forceinline__ i32 get(i32 x) { return x; }
    static __device__ __forceinline__ bool nan(i32) { return false; }
};
template <> struct ArgKey<u8> {
    typedef int type;
    static __device__ __forceinline__ int get(u8 x) { return (int)x; }
    static __device__ __forceinline__ bool nan(int) { return false; }
};

// Merges candidate (v, j) into (best, idx): a NaN beats every number (the
// first NaN wins, as in PyTorch and the CPU), else the extreme value, the
// first index among equals; idx < 0 means no candidate yet.
template <typename K>
__device__ __forceinline__ void arg_take(K& best, i64& idx, K v, i64 j, int is_max) {
    if (j < 0) return;
    if (idx < 0) { best = v; idx = j; return; }
    bool vn = v != v, bn = best != best;
    if (vn || bn) {
        if (vn && (!bn || j < idx)) { best = v; idx = j; }
        return;
    }
    if ((is_max ? v > best : v < best) || (v == best && j < idx)) { best = v; idx = j; }
}

// Block-wide (best, idx) over the reduced indices [lo, hi) of output `o`,
// left in sk[0], si[0].
template <typename T>
__device__ void arg_block(const T* src, i64 base, i64 stride, u64 lo, u64 hi, int is_max,
                          typename ArgKey<T>::type* sk, i64* si) {
    typedef typename ArgKey<T>::type K;
    K best = K();
    i64 idx = -1;
    for (u64 r = lo + threadIdx.x; r < hi; r += blockDim.x) {
        arg_take<K>(best, idx, ArgKey<T>::get(src[base + (i64)r * stride]), (i64)r, is_max);
    }
    sk[threadIdx.x] = best;
    si[threadIdx.x] = idx;
    __syncthreads();
    for (unsigned int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            K b = sk[threadIdx.x];
            i64 i = si[threadIdx.x];
            arg_take<K>(b, i, sk[threadIdx.x + s], si[threadIdx.x + s], is_max);
            sk[threadIdx.x] = b;
            si[threadIdx.x] = i;
        }
        __syncthreads();
    }
}

// argmax/argmin over one dimension: the index of the first NaN if any, else
// the first index of the extreme value (the CPU's scan).
template <typename T>
__device__ void arg_reduce_impl(const T* src, Lay outer, i64 stride, i64* out, u64 n_out, u64 n_in, int is_max) {
    __shared__ typename ArgKey<T>::type sk[256];
    __shared__ i64 si[256];
    for (u64 o = blockIdx.x; o < n_out; o += gridDim.x) {
        i64 base = lay_off(outer, o);
        arg_block<T>(src, base, stride, 0, n_in, is_max, sk, si);
        if (threadIdx.x == 0) out[o] = si[0] < 0 ? 0 : si[0];
        __syncthreads();
    }
}

// Long argmax/argmin over few outputs, pass 1: block b handles part
// (b % parts) of output (b / parts) and writes its (value, index).
template <typename T>
__device__ void arg_partial_impl(const T* src, Lay outer, i64 stride, typename ArgKey<T>::type* pk, i64* pi, u64 n_out,
                                 u64 n_in, u64 parts, int is_max) {
    __shared__ typename ArgKey<T>::type sk[256];
    __shared__ i64 si[256];
    u64 chunk = (n_in + parts - 1) / parts;
    for (u64 b = blockIdx.x; b < n_out * parts; b += gridDim.x) {
        u64 o = b / parts, p = b % parts;
        u64 lo = p * chunk, hi = lo + chunk < n_in ? lo + chunk : n_in;
        arg_block<T>(src, lay_off(outer, o), stride, lo, hi, is_max, sk, si);
        if (threadIdx.x == 0) { pk[b] = sk[0]; pi[b] = si[0]; }
        __syncthreads();
    }
}

// Pass 2: one thread per output merges its parts in order.
template <typename T>
__device__ void arg_final_impl(const T* src, Lay outer, const typename ArgKey<T>::type* pk, const i64* pi, i64* out, u64 n_out,
                               u64 parts, int is_max) {
    typedef typename ArgKey<T>::type K;
    GRID_LOOP(o, n_out) {
        K best = K();
        i64 idx = -1;
        for (u64 p = 0; p < parts; ++p) arg_take<K>(best, idx, pk[o * parts + p], pi[o * parts + p], is_max);
        out[o] = idx < 0 ? 0 : idx;
    }
}

// ---- matmul (integers, and floats when cuBLAS is missing) -----------------

template <typename T> struct MAcc { typedef T type; };
template <> struct MAcc<f16_t> { typedef float type; };

template <typename T>
__device__ void matmul_impl(const T* a, Lay ba, i64 a_rs, i64 a_cs, const T* b, Lay bb, i64 b_rs, i64 b_cs, T* out,
                            u64 batch, u64 m, u64 n, u64 k) {
    typedef typename MAcc<T>::type A;
    GRID_LOOP(t, batch * m * n) {
        u64 bi = t / (m * n);
        u64 ij = t % (m * n);
        u64 i = ij / n, j = ij % n;
        i64 oa = lay_off(ba, bi) + (i64)i * a_rs;
        i64 ob = lay_off(bb, bi) + (i64)j * b_cs;
        A acc = Cv<A>::from(0.0);
        for (u64 p = 0; p < k; ++p) {
            A x = Cv<A>::from(Cv<T>::to(a[oa + (i64)p * a_cs]));
            A y = Cv<A>::from(Cv<T>::to(b[ob + (i64)p * b_rs]));
            acc = Ar<A>::add(acc, Ar<A>::mul(x, y));
        }
        out[t] = Cv<T>::from(Cv<A>::to(acc));
    }
}
template <>
__device__ void matmul_impl<i64>(const i64* a, Lay ba, i64 a_rs, i64 a_cs, const i64* b, Lay bb, i64 b_rs, i64 b_cs, i64* out,
                                 u64 batch, u64 m, u64 n, u64 k) {
    GRID_LOOP(t, batch * m * n) {
        u64 bi = t / (m * n);
        u64 ij = t % (m * n);
        u64 i = ij / n, j = ij % n;
        i64 oa = lay_off(ba, bi) + (i64)i * a_rs;
        i64 ob = lay_off(bb, bi) + (i64)j * b_cs;
        i64 acc = 0;
        for (u64 p = 0; p < k; ++p) acc = Ar<i64>::add(acc, Ar<i64>::mul(a[oa + (i64)p * a_cs], b[ob + (i64)p * b_rs]));
        out[t] = acc;
    }
}

// ---- indexing ---------------------------------------------------------------

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

// out (outer, n, inner) = src (outer, d, inner) at the ids; out-of-range ids
// give zeros.
template <typename T, typename I>
__device__ void index_select_impl(const T* src, Lay sl, const I* ids, Lay li, T* out, u64 outer, u64 d, u64 n, u64 inner) {
    GRID_LOOP(t, outer * n * inner) {
        u64 q = t % inner;
        u64 j = (t / inner) % n;
        u64 i = t / (inner * n);
        u64 id = read_id(ids, li, j);
        if (id < d) {
            out[t] = src[lay_off(sl, (i * d + id) * inner + q)];
        } else {
            out[t] = Cv<T>::from(0.0);
        }
    }
}

// dst (outer, d, inner) += src (outer, n, inner) at the ids. One thread per
// (outer, inner) position walks the ids in order: no atomics, and repeated
// indices accumulate in the CPU's order.
template <typename T, typename I>
__device__ void index_add_impl(const T* src, Lay sl, const I* ids, Lay li, T* dst, u64 outer, u64 d, u64 n, u64 inner) {
    GRID_LOOP(t, outer * inner) {
        u64 q = t % inner;
        u64 i = t / inner;
        for (u64 j = 0; j < n; ++j) {
            u64 id = read_id(ids, li, j);
            if (id >= d) continue;
            u64 o = (i * d + id) * inner + q;
            dst[o] = Ar<T>::add(dst[o], src[lay_off(sl, (i * n + j) * inner + q)]);
        }
    }
}

// ---- entry points, one family per NVRTC module (compiled on first use) ----
#define KILN_ALL(X) X(f32, float) X(f64, double) X(i64, i64) X(i32, i32) X(u8, u8) X(f16, f16_t) X(bf16, bf16_t)
#define KILN_ALL_B(X, A, B) \
    X(A, B, f32, float) X(A, B, f64, double) X(A, B, i64, i64) X(A, B, i32, i32) X(A, B, u8, u8) X(A, B, f16, f16_t) X(A, B, bf16, bf16_t)
#define KILN_NUM(X) X(f32, float) X(f64, double) X(i64, i64) X(i32, i32) X(u8, u8)


//@family create
#define KILN_CREATE(N, T)                                                                                        \
    extern "C" __global__ void fill_##N(T* out, u64 n, double v) { fill_impl<T>(out, n, v); }                  \
    extern "C" __global__ void arange_##N(T* out, u64 n, double s, double st) { arange_impl<T>(out, n, s, st); } \
    extern "C" __global__ void random_##N(T* out, u64 n, u64 seed, u64 off, int dist, double a, double b) {     \
        random_impl<T>(out, n, seed, off, dist, a, b);                                                           \
    }
KILN_ALL(KILN_CREATE)

//@family elementwise
#define KILN_ELEMENTWISE(N, T)                                                                                           \
    extern "C" __global__ void unary_##N(const T* s, Lay sl, T* o, u64 n, int op, double a, double b, int pn) {          \
        unary_impl<T>(s, sl, o, n, op, a, b, pn);                                                                        \
    }                                                                                                                    \
    extern "C" __global__ void binary_##N(const T* a, Lay la, const T* b, Lay lb, T* o, u64 n, int op) {                 \
        binary_impl<T>(a, la, b, lb, o, n, op);                                                                          \
    }                                                                                                                    \
    extern "C" __global__ void compare_##N(const T* a, Lay la, const T* b, Lay lb, u8* o, u64 n, int op) {               \
        compare_impl<T>(a, la, b, lb, o, n, op);                                                                         \
    }                                                                                                                    \
    extern "C" __global__ void reduce_block_##N(const T* s, Lay outer, Lay inner, T* o, u64 no, u64 ni, int op) {        \
        reduce_block_impl<T>(s, outer, inner, o, no, ni, op);                                                            \
    }                                                                                                                    \
    extern "C" __global__ void reduce_thread_##N(const T* s, Lay outer, Lay inner, T* o, u64 no, u64 ni, int op) {       \
        reduce_thread_impl<T>(s, outer, inner, o, no, ni, op);                                                           \
    }                                                                                                                    \
    extern "C" __global__ void arg_reduce_##N(const T* s, Lay outer, i64 stride, i64* o, u64 no, u64 ni, int mx) {       \
        arg_reduce_impl<T>(s, outer, stride, o, no, ni, mx);                                                             \
    }                                                                                                                    \
    extern "C" __global__ void reduce_partial_##N(const T* s, Lay outer, Lay inner, Acc<T>::type* p, u64 no, u64 ni,     \
                                                  u64 parts, int op) {                                                   \
        reduce_partial_impl<T>(s, outer, inner, p, no, ni, parts, op);                                                   \
    }                                                                                                                    \
    extern "C" __global__ void reduce_final_##N(const Acc<T>::type* p, T* o, u64 no, u64 parts, int op) {               \
        reduce_final_impl<T>(p, o, no, parts, op);                                                                       \
    }                                                                                                                    \
    extern "C" __global__ void arg_partial_##N(const T* s, Lay outer, i64 stride, ArgKey<T>::type* pk, i64* pi, u64 no,  \
                                               u64 ni, u64 parts, int mx) {                                              \
        arg_partial_impl<T>(s, outer, stride, pk, pi, no, ni, parts, mx);                                                \
    }                                                                                                                    \
    extern "C" __global__ void arg_final_##N(const T* s, Lay outer, const ArgKey<T>::type* pk, const i64* pi, i64* o,    \
                                             u64 no, u64 parts, int mx) {                                                \
        arg_final_impl<T>(s, outer, pk, pi, o, no, parts, mx);                                                           \
    }                                                                                                                    \
    extern "C" __global__ void index_add_##N##_i64(const T* s, Lay sl, const i64* ids, Lay li, T* d, u64 outer, u64 dd, \
                                                   u64 n, u64 inner) {                                                   \
        index_add_impl<T, i64>(s, sl, ids, li, d, outer, dd, n, inner);                                                  \
    }                                                                                                                    \
    extern "C" __global__ void index_add_##N##_i32(const T* s, Lay sl, const i32* ids, Lay li, T* d, u64 outer, u64 dd, \
                                                   u64 n, u64 inner) {                                                   \
        index_add_impl<T, i32>(s, sl, ids, li, d, outer, dd, n, inner);                                                  \
    }                                                                                                                    \
    extern "C" __global__ void index_add_##N##_u8(const T* s, Lay sl, const u8* ids, Lay li, T* d, u64 outer, u64 dd,   \
                                                  u64 n, u64 inner) {                                                    \
        index_add_impl<T, u8>(s, sl, ids, li, d, outer, dd, n, inner);                                                   \
    }
KILN_NUM(KILN_ELEMENTWISE)

//@family matmul
#define KILN_MATMUL(N, T)                                                                                               \
    extern "C" __global__ void matmul_##N(const T* a, Lay ba, i64 ars, i64 acs, const T* b, Lay bb, i64 brs, i64 bcs,  \
                                          T* o, u64 batch, u64 m, u64 n, u64 k) {                                       \
        matmul_impl<T>(a, ba, ars, acs, b, bb, brs, bcs, o, batch, m, n, k);                                            \
    }
KILN_MATMUL(f32, float)
KILN_MATMUL(f64, double)
KILN_MATMUL(i64, i64)
KILN_MATMUL(i32, i32)
KILN_MATMUL(u8, u8)
KILN_MATMUL(f16, f16_t)

//@family index
#define KILN_INDEX(N, T)                                                                                                \
    extern "C" __global__ void index_select_##N##_i64(const T* s, Lay sl, const i64* ids, Lay li, T* o, u64 outer,     \
                                                      u64 d, u64 n, u64 inner) {                                        \
        index_select_impl<T, i64>(s, sl, ids, li, o, outer, d, n, inner);                                              \
    }                                                                                                                   \
    extern "C" __global__ void index_select_##N##_i32(const T* s, Lay sl, const i32* ids, Lay li, T* o, u64 outer,     \
                                                      u64 d, u64 n, u64 inner) {                                        \
        index_select_impl<T, i32>(s, sl, ids, li, o, outer, d, n, inner);                                              \
    }                                                                                                                   \
    extern "C" __global__ void index_select_##N##_u8(const T* s, Lay sl, const u8* ids, Lay li, T* o, u64 outer, u64 d, \
                                                     u64 n, u64 inner) {                                                \
        index_select_impl<T, u8>(s, sl, ids, li, o, outer, d, n, inner);                                               \
    }
KILN_ALL(KILN_INDEX)

//@family copy
#define KILN_COPY_PAIR(SN, ST, DN, DT)                                                                 \
    extern "C" __global__ void copy_##SN##_##DN(const ST* s, Lay sl, DT* d, Lay dl, u64 n) {          \
        copy_impl<ST, DT>(s, sl, d, dl, n);                                                           \
    }
#define KILN_COPY_FROM(SN, ST) KILN_ALL_B(KILN_COPY_PAIR, SN, ST)
KILN_ALL(KILN_COPY_FROM)

//@family where
#define KILN_WHERE_PAIR(CN, CT, TN, TT)                                                                          \
    extern "C" __global__ void where_##CN##_##TN(const CT* c, Lay lc, const TT* a, Lay la, const TT* b, Lay lb, \
                                                 TT* o, u64 n) {                                                 \
        where_impl<CT, TT>(c, lc, a, la, b, lb, o, n);                                                          \
    }
#define KILN_WHERE_FROM(CN, CT) KILN_ALL_B(KILN_WHERE_PAIR, CN, CT)
KILN_ALL(KILN_WHERE_FROM)
