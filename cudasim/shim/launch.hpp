// Launch glue, included after kernels.cu by the generated table: every
// kernel's argument list is deduced from its own signature, so a new kernel
// in kernels.cu needs no change here.
#pragma once
#include <cstddef>
#include <type_traits>
#include <utility>

struct KilnSimKernel {
    const char* name;
    void (*fn)();
    void (*invoke)(void (*)(), void* const*);
    int nargs;
    const size_t* sizes;
    const unsigned char* is_ptr;
};

template <typename... A, size_t... I>
static void kiln_sim_call(void (*f)(A...), void* const* p, std::index_sequence<I...>) {
    f(*static_cast<typename std::remove_cv<typename std::remove_reference<A>::type>::type*>(p[I])...);
}

template <typename... A>
static void kiln_sim_invoke(void (*fv)(), void* const* p) {
    kiln_sim_call(reinterpret_cast<void (*)(A...)>(fv), p, std::index_sequence_for<A...>{});
}

template <typename... A>
static KilnSimKernel kiln_sim_entry(const char* name, void (*f)(A...)) {
    static const size_t sizes[] = {sizeof(A)..., 0};
    static const unsigned char ptrs[] = {(unsigned char)std::is_pointer<A>::value..., 0};
    return KilnSimKernel{name, reinterpret_cast<void (*)()>(f), &kiln_sim_invoke<A...>, (int)sizeof...(A), sizes, ptrs};
}

thread_local kiln_sim_dim3 threadIdx, blockIdx, blockDim, gridDim;

extern "C" void kiln_sim_set_ids(unsigned int tx, unsigned int bx, unsigned int bdim, unsigned int gdim) {
    threadIdx = kiln_sim_dim3{tx, 0, 0};
    blockIdx = kiln_sim_dim3{bx, 0, 0};
    blockDim = kiln_sim_dim3{bdim, 1, 1};
    gridDim = kiln_sim_dim3{gdim, 1, 1};
}
