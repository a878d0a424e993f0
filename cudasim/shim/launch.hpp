// Launch glue, pasted after the module's source by the simulator
// (src/hostcc.rs), which then appends the table of the module's kernels
// (kiln_sim_table). Every kernel's argument list is deduced by the C++
// compiler from its own signature, so the simulator needs to know nothing
// about a kernel but its name. The module is a dlopened library: everything
// is hidden (-fvisibility=hidden) except the KILN_SIM_EXPORT functions below,
// which the simulator looks up by name; their layout is the simulator's
// `KernelEntry` and `kiln_sim_abi` names its version.
//
// The launch census (KILN_CUDASIM_CENSUS=1, src/census.rs) compiles the
// module with -fsanitize-coverage=trace-pc: g++ then calls
// __sanitizer_cov_trace_pc at the start of every basic block of the
// optimised code, and the simulator reads kiln_sim_work() before and after
// each resume of a GPU thread's fiber. The callback is always defined, so a
// plain build links the same (-Wl,-z,defs) and simply never calls it. The
// glue's own functions are not instrumented (KILN_SIM_NO_COVERAGE): the
// callback must not call itself, and reading the counter must not move it.
#pragma once
#include <cstddef>
#include <type_traits>
#include <utility>

#define KILN_SIM_EXPORT extern "C" __attribute__((visibility("default")))
// GCC 12 or newer (which the shim needs anyway for _Float16 on x86-64).
#define KILN_SIM_NO_COVERAGE __attribute__((no_sanitize_coverage))

// Basic blocks executed by instrumented code on this OS thread (a stream's
// worker runs one fiber at a time, so the simulator's reads around a resume
// measure that GPU thread alone).
static thread_local unsigned long long kiln_sim_work_count;
extern "C" __attribute__((visibility("hidden"))) KILN_SIM_NO_COVERAGE void __sanitizer_cov_trace_pc(void) { ++kiln_sim_work_count; }

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

// Defined by the generated part that follows.
static const KilnSimKernel* kiln_sim_table();
static int kiln_sim_table_len();

KILN_SIM_EXPORT int kiln_sim_abi(void) { return 3; }
KILN_SIM_EXPORT int kiln_sim_kernel_count(void) { return kiln_sim_table_len(); }
KILN_SIM_EXPORT const KilnSimKernel* kiln_sim_kernel(int i) { return &kiln_sim_table()[i]; }
KILN_SIM_EXPORT KILN_SIM_NO_COVERAGE void kiln_sim_run_thread(int i, void* const* params) {
    const KilnSimKernel& k = kiln_sim_table()[i];
    k.invoke(k.fn, params);
}
KILN_SIM_EXPORT KILN_SIM_NO_COVERAGE void kiln_sim_set_ids(unsigned int tx, unsigned int bx, unsigned int bdim, unsigned int gdim) {
    threadIdx = kiln_sim_dim3{tx, 0, 0};
    blockIdx = kiln_sim_dim3{bx, 0, 0};
    blockDim = kiln_sim_dim3{bdim, 1, 1};
    gridDim = kiln_sim_dim3{gdim, 1, 1};
}
KILN_SIM_EXPORT void kiln_sim_bind(void (*syncthreads)(void)) { kiln_sim_syncthreads = syncthreads; }
// The census's counter on the calling thread (see above).
KILN_SIM_EXPORT KILN_SIM_NO_COVERAGE unsigned long long kiln_sim_work(void) { return kiln_sim_work_count; }
