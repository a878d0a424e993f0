// Host shim for kiln's kernels.cu: just enough of CUDA C++ for g++ to compile
// the unchanged kernels for the CPU. The simulator runs every thread of a
// block as a fiber on one OS thread, so `__shared__` is a thread_local static
// (shared by the fibers of the block that runs, private to each stream's
// worker) and `__syncthreads()` suspends the fiber until every thread of the
// block has reached it.
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

struct kiln_sim_dim3 {
    unsigned int x, y, z;
};
// Set by the simulator before it resumes each thread's fiber.
extern thread_local kiln_sim_dim3 threadIdx, blockIdx, blockDim, gridDim;

extern "C" void kiln_sim_syncthreads(void);
#define __syncthreads() kiln_sim_syncthreads()

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
