// Host shim for the CUDA C++ that kiln compiles with NVRTC: just enough of
// CUDA C++ for g++ to compile each module's unchanged source for the CPU. The
// simulator pastes it before the source (src/hostcc.rs) when cuModuleLoadData
// gets the image NVRTC made of that source. It runs every thread of a block
// as a fiber on one OS thread, so `__shared__` is a thread_local static
// (shared by the fibers of the block that runs, private to each stream's
// worker) and `__syncthreads()` suspends the fiber until every thread of the
// block has reached it. Sources can tell they are on the simulator by
// KILN_CUDASIM.
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

#define KILN_CUDASIM 1
#ifndef __global__
#define __global__
#endif
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static thread_local
#define __launch_bounds__(...)

struct kiln_sim_dim3 {
    unsigned int x, y, z;
};
// Set by the simulator (kiln_sim_set_ids) before it resumes each thread's
// fiber. Defined here, before the kernels, so that reading them is a plain
// thread-local access (an extern one costs a wrapper call per read).
static thread_local kiln_sim_dim3 threadIdx, blockIdx, blockDim, gridDim;

// The simulator's fiber switch, handed over at load (kiln_sim_bind): the
// module is a dlopened library that links against nothing of the simulator.
static void (*kiln_sim_syncthreads)(void);
#define __syncthreads() kiln_sim_syncthreads()
// Every block runs on one OS thread, but two streams may run kernels at once
// on shared (peer) memory, so atomics are real ones.
#define __threadfence() __atomic_thread_fence(__ATOMIC_SEQ_CST)
#define __threadfence_system() __atomic_thread_fence(__ATOMIC_SEQ_CST)
template <typename T>
static inline T atomicAdd(T* p, T v) {
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
static inline float atomicAdd(float* p, float v) {
    unsigned int* u = (unsigned int*)p;
    unsigned int old = __atomic_load_n(u, __ATOMIC_SEQ_CST), next;
    do {
        float f;
        memcpy(&f, &old, sizeof f);
        f += v;
        memcpy(&next, &f, sizeof f);
    } while (!__atomic_compare_exchange_n(u, &old, next, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST));
    memcpy(&v, &old, sizeof v);
    return v;
}
static inline double atomicAdd(double* p, double v) {
    unsigned long long* u = (unsigned long long*)p;
    unsigned long long old = __atomic_load_n(u, __ATOMIC_SEQ_CST), next;
    do {
        double f;
        memcpy(&f, &old, sizeof f);
        f += v;
        memcpy(&next, &f, sizeof f);
    } while (!__atomic_compare_exchange_n(u, &old, next, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST));
    memcpy(&v, &old, sizeof v);
    return v;
}
template <typename T>
static inline T atomicExch(T* p, T v) {
    return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST);
}
template <typename T>
static inline T atomicCAS(T* p, T expected, T desired) {
    __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return expected;
}
template <typename T>
static inline T atomicMax(T* p, T v) {
    T old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    while (old < v && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
    }
    return old;
}
template <typename T>
static inline T atomicMin(T* p, T v) {
    T old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    while (v < old && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
    }
    return old;
}

static inline unsigned int __umulhi(unsigned int a, unsigned int b) {
    return (unsigned int)(((unsigned long long)a * (unsigned long long)b) >> 32);
}
static inline long long __double_as_longlong(double d) {
    long long r;
    memcpy(&r, &d, sizeof r);
    return r;
}
static inline double __longlong_as_double(long long v) {
    double r;
    memcpy(&r, &v, sizeof r);
    return r;
}
static inline float __int_as_float(int v) {
    float r;
    memcpy(&r, &v, sizeof r);
    return r;
}
static inline int __float_as_int(float f) {
    int r;
    memcpy(&r, &f, sizeof r);
    return r;
}
// The PTX `cvt.f32.f16` / `cvt.rn.f16.f32` of kernels.cu (round to nearest even).
static inline float kiln_sim_h2f(unsigned short h) {
    _Float16 x;
    memcpy(&x, &h, sizeof x);
    return (float)x;
}
static inline unsigned short kiln_sim_f2h(float f) {
    _Float16 x = (_Float16)f;
    unsigned short h;
    memcpy(&h, &x, sizeof h);
    return h;
}
