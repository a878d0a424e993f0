#!/usr/bin/env bash
# Proves kiln's CUDA backend on a machine with an NVIDIA GPU, from binaries
# built elsewhere (such a machine may have no Rust toolchain and no registry).
#
# On an x86-64 build machine (no GPU needed), from the repository root:
#     cargo build --release                      # target/release/kiln
#     cargo test --workspace --profile release-tests --no-run   # target/release-tests/deps/<test>-<hash>
# (--workspace: the default member is the kiln command alone. release-tests
# has the release settings; `cargo test --workspace --release` works too,
# and the profile whose newest harness is newest is the one that runs)
# then carry the repository (or at least target/release/kiln,
# target/release-tests/kiln, which the command's tests run,
# target/release-tests/deps/*, which holds libkiln_cudasim.so for the simulator's
# own tests, skipped without it) to the GPU machine, at the path it was built at or
# with a link from there (test binaries name the `kiln` binary and their
# data files by that path), and run there:
#     bash scripts/gpu-check.sh                  # everything
#     bash scripts/gpu-check.sh --tests-only     # conformance + CUDA tests only
#     bash scripts/gpu-check.sh --bench-only     # kiln bench on cuda and cpu only
#     bash scripts/gpu-check.sh --list-tests     # only list the test binaries it would run
#
# With two GPUs or more it also runs the collectives' suites (comm, cuda)
# again with KILN_DISABLE_NCCL=1 (the peer-copy path; the first pass uses
# NCCL when it is found: pip's nvidia-nccl-cu12 beside PyTorch, or apt's
# libnccl2), and measures all-reduce bus bandwidth with the allreduce_bw
# example (target/release-tests/examples/allreduce_bw, built by `cargo test
# --workspace --profile release-tests --no-run`), to set beside nccl-tests'
# all_reduce_perf busbw.
#
# It prints the GPU (nvidia-smi), finds the CUDA user-space libraries the
# machine has (NVRTC and cuBLAS: a CUDA toolkit's lib64, or the lib folders
# of the nvidia-* Python packages that come with PyTorch), runs every test
# binary it finds (the conformance suite then runs on every CUDA device as
# well as on the CPU and simulated GPUs), then `kiln devices` and
# `kiln bench` on the first CUDA device and on the CPU. Everything goes to
# stdout; the exit status is non-zero when a test binary failed.
#
# After kiln bench on the GPU it runs scripts/gpu_peer_torch.py (PyTorch, the
# same workloads on cuda:0) and `kiln train` of LeNet and ResNet-18 on the GPU
# (epoch times beside PyTorch's).
#
# Environment: KILN_TARGET_DIR (default: target), KILN_TEST_TIMEOUT (seconds
# per test binary, 600), KILN_TRAIN_TIMEOUT (seconds per training run, 300),
# KILN_TRAIN_EPOCHS (4), KILN_BENCH_CPU=0 (skip the CPU bench), KILN_BENCH_ARGS (extra
# arguments for `kiln bench`, e.g. "--quick" or "W1 W3"), KILN_ALLREDUCE_MAX
# (largest all-reduce measured, 256MiB), CUDA_HOME.
set -u

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
target="${KILN_TARGET_DIR:-target}"
mode="${1:-all}"

section() { printf '\n===== %s =====\n' "$*"; }

# "<mtime> <path>" of each test harness in a deps folder, newest first.
harnesses() {
    [ -d "$1" ] || return 0
    find "$1" -maxdepth 1 -type f -perm -u+x -regextype posix-extended \
        -regex '.*/[a-z_0-9]+-[0-9a-f]{16}' -printf '%T@ %p\n' | sort -rn
}

find_tests() {
    # Test binaries are executables named <name>-<16 hex digits> in deps/;
    # when a name was built several times, only the newest runs. Three
    # files share the name of the library's unit tests (deps/kiln-<hash>):
    # the `kiln` command itself and its unit-test harness, which has no
    # tests, beside the library's; the newest of them used to hide the
    # others. So the command (which answers `--version` with "kiln ...")
    # and harnesses that list no tests are passed over; any other binary
    # counts, even one whose `--list` fails: it then fails when it runs,
    # rather than an older build of it running in its place.
    local profile found f n list seen=" " picked
    # The profile folders in order of their newest harness, newest first, so
    # that an old build in one profile cannot shadow a fresh one in another.
    for profile in $(for p in release-tests release debug; do
        harnesses "$target/$p/deps" | head -1 | sed "s|^\([^ ]*\) .*|\1 $p|"
    done | sort -rn | cut -d' ' -f2); do
        found="$(harnesses "$target/$profile/deps" | cut -d' ' -f2-)"
        [ -n "$found" ] || continue
        picked="$(
            while IFS= read -r f; do
                n="$(basename "$f")"
                n="${n%-*}"
                case "$seen" in *" $n "*) continue ;; esac
                if list="$(timeout 60 "$f" --list </dev/null 2>/dev/null)"; then
                    printf '%s\n' "$list" | grep -q ': test$' || continue
                elif timeout 10 "$f" --version </dev/null 2>/dev/null | grep -q '^kiln '; then
                    continue
                fi
                seen="$seen$n "
                echo "$f"
            done <<<"$found" | sort
        )"
        if [ -n "$picked" ]; then
            echo "$picked"
            return 0
        fi
    done
}

# The simulator's own tests (cudasim/tests: jit, nccl) load the simulator
# library from the folder they were built in; without it they cannot run.
needs_sim_library() {
    case "$(basename "$1")" in jit-* | nccl-*) return 0 ;; *) return 1 ;; esac
}

# --list-tests: only print the test binaries that would run (CI checks it).
if [ "$mode" = "--list-tests" ]; then
    find_tests
    exit 0
fi

section "machine"
uname -a
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi || true
    nvidia-smi --query-gpu=index,name,compute_cap,memory.total,driver_version --format=csv 2>/dev/null || true
else
    echo "nvidia-smi not found: is there an NVIDIA driver on this machine?"
fi

# ---- CUDA libraries ------------------------------------------------------
# libcuda.so.1 comes with the driver and is on the loader's path already.
# NVRTC (kernels), cuBLAS (matmul), cuDNN (convolutions) and NCCL may live in
# a toolkit or in pip wheels.
# PyTorch brings its own CUDA libraries; it runs with the caller's path.
caller_ld_path="${LD_LIBRARY_PATH:-}"
lib_dirs=()
has_cuda_libs() {
    compgen -G "$1/libnvrtc*.so*" >/dev/null || compgen -G "$1/libcublas*.so*" >/dev/null || compgen -G "$1/libnccl.so*" >/dev/null ||
        compgen -G "$1/libcudnn.so*" >/dev/null
}
add_dir() {
    local d="$1"
    [ -d "$d" ] || return 0
    for x in "${lib_dirs[@]:-}"; do [ "$x" = "$d" ] && return 0; done
    lib_dirs+=("$d")
}
for d in "${CUDA_HOME:-}/lib64" "${CUDA_PATH:-}/lib64" /usr/local/cuda/lib64 /usr/local/cuda-*/lib64 /usr/lib/x86_64-linux-gnu; do
    if has_cuda_libs "$d"; then add_dir "$d"; fi
done
# Python environments: site-packages/nvidia/<pkg>/lib (PyTorch's CUDA wheels)
# and site-packages/torch/lib.
for py in python3 python; do
    command -v "$py" >/dev/null 2>&1 || continue
    sites="$("$py" - <<'EOF' 2>/dev/null
import site, sys
paths = set(site.getsitepackages() + [site.getusersitepackages()] + [p for p in sys.path if p.endswith("-packages")])
print("\n".join(sorted(paths)))
EOF
)"
    while IFS= read -r s; do
        [ -n "$s" ] || continue
        for d in "$s"/nvidia/*/lib "$s"/torch/lib; do
            if has_cuda_libs "$d"; then add_dir "$d"; fi
        done
    done <<<"$sites"
done
if [ "${#lib_dirs[@]}" -gt 0 ]; then
    joined="$(IFS=:; echo "${lib_dirs[*]}")"
    export LD_LIBRARY_PATH="${joined}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
section "CUDA libraries"
echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
for d in "${lib_dirs[@]:-}"; do
    [ -n "$d" ] && ls "$d" 2>/dev/null | grep -E '^lib(nvrtc|cublas|cublasLt|nccl|cudnn)[.-].*so' | sed "s|^|  $d/|"
done
[ "${#lib_dirs[@]}" -gt 0 ] || echo "no NVRTC/cuBLAS found outside the default loader path; kernels need libnvrtc (pip install nvidia-cuda-nvrtc-cu12)"

# The kernel cache lives next to the binaries, so repeated runs skip NVRTC.
case "$target" in /*) target_abs="$target" ;; *) target_abs="$here/$target" ;; esac
export KILN_CACHE_DIR="${KILN_CACHE_DIR:-$target_abs/kiln-cache}"
status=0

# GPUs the driver sees (0 without nvidia-smi).
gpus="$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | grep -c . || true)"
gpus="${gpus:-0}"

# ---- tests -------------------------------------------------------------------
if [ "$mode" != "--bench-only" ]; then
    tests="$(find_tests)"
    if [ -z "$tests" ]; then
        echo "no test binaries under $target/{release-tests,release,debug}/deps: build them with 'cargo test --workspace --profile release-tests --no-run'"
        status=1
    fi
    # Every suite that runs on CUDA devices must find one here (a skip
    # would be a silent pass); the report counts what ran on the GPU.
    report="$(mktemp)"
    export KILN_TEST_REPORT="$report" KILN_REQUIRE_CUDA=1
    for t in $tests; do
        name="$(basename "$t")"
        section "test $name"
        # The simulator's tests look for its library beside them in deps/,
        # then in the profile's folder.
        deps_dir="$(dirname "$t")"
        if needs_sim_library "$t" && [ ! -f "$deps_dir/libkiln_cudasim.so" ] && [ ! -f "$(dirname "$deps_dir")/libkiln_cudasim.so" ]; then
            echo "SKIPPED: $name needs libkiln_cudasim.so (the CUDA simulator's library) in $deps_dir or its parent: carry it with the test binaries to run the simulator's own tests"
            echo "SKIPPED: $name: needs libkiln_cudasim.so beside it" >>"$report"
            continue
        fi
        # A hung binary is stopped (10 minutes) and counted as failed.
        if ! timeout "${KILN_TEST_TIMEOUT:-600}" "$t" --test-threads=4 2>&1; then
            echo "FAILED: $name"
            status=1
        fi
    done
    section "tests on CUDA"
    ran_cuda="$(grep '^RAN-CUDA ' "$report" | awk '{print $3}' | sort -u | wc -l)"
    echo "$ran_cuda tests ran on a CUDA device ($(grep -c '^RAN-CUDA ' "$report") test x device runs); skipped, with reasons:"
    grep '^SKIPPED: ' "$report" | sort -u | sed 's/^/  /'
    # A GPU machine on which no test reached the GPU proves nothing: most
    # likely only the command's harnesses were built (no --workspace).
    if [ "$gpus" -ge 1 ] && [ "$ran_cuda" -eq 0 ]; then
        echo "FAILED: $gpus GPU(s) present but no test ran on a CUDA device; build the harnesses with 'cargo test --workspace --profile release-tests --no-run'"
        status=1
    fi
    unset KILN_TEST_REPORT KILN_REQUIRE_CUDA
    # With cuDNN there the runs above took it for convolutions: the CNN
    # suites again through im2col + cuBLAS.
    has_cudnn=0
    for d in "${lib_dirs[@]:-}"; do [ -n "$d" ] && compgen -G "$d/libcudnn.so*" >/dev/null && has_cudnn=1; done
    ldconfig -p 2>/dev/null | grep -q 'libcudnn\.so' && has_cudnn=1
    if [ "$gpus" -ge 1 ] && [ "$has_cudnn" = 1 ]; then
        for t in $tests; do
            name="$(basename "$t")"
            # The CUDA suite's CNN fuzz, every test of the CNN suite.
            case "$name" in cnn-*) filter=() ;; cuda-*) filter=(cnn) ;; *) continue ;; esac
            section "test $name ${filter[*]:-} with KILN_CUDA_CONV=gemm"
            if ! KILN_CUDA_CONV=gemm timeout "${KILN_TEST_TIMEOUT:-600}" "$t" --test-threads=4 "${filter[@]}" 2>&1; then
                echo "FAILED: $name with KILN_CUDA_CONV=gemm"
                status=1
            fi
        done
    fi
    # Collectives again through peer copies, when there are two GPUs.
    if [ "$gpus" -ge 2 ]; then
        for t in $tests; do
            name="$(basename "$t")"
            case "$name" in comm-* | cuda-*) ;; *) continue ;; esac
            section "test $name with KILN_DISABLE_NCCL=1"
            if ! KILN_DISABLE_NCCL=1 "$t" --test-threads=4 2>&1; then
                echo "FAILED: $name with KILN_DISABLE_NCCL=1"
                status=1
            fi
        done
    fi
fi

# ---- kiln devices and bench ---------------------------------------------------
if [ "$mode" != "--tests-only" ]; then
    kiln="$target/release/kiln"
    [ -x "$kiln" ] || kiln="$target/release-tests/kiln"
    [ -x "$kiln" ] || kiln="$target/debug/kiln"
    if [ -x "$kiln" ]; then
        section "kiln devices"
        "$kiln" devices 2>&1 || status=1
        # Real GPUs are numbered first: gpu(0) is the first CUDA device.
        gpu="gpu(0)"
        # shellcheck disable=SC2086
        section "kiln bench --device $gpu ${KILN_BENCH_ARGS:-}"
        "$kiln" bench --device "$gpu" ${KILN_BENCH_ARGS:-} 2>&1 || status=1
        # PyTorch on the same GPU, the same workloads and sizes (skipped
        # without a python3 whose torch sees CUDA).
        section "PyTorch beside kiln: W1-W5 and training epochs on cuda:0"
        quick=""
        case " ${KILN_BENCH_ARGS:-} " in *" --quick "*) quick="--quick" ;; esac
        # (with the caller's LD_LIBRARY_PATH: a system cuDNN older than the one
        # PyTorch was built with stops it)
        LD_LIBRARY_PATH="$caller_ld_path" timeout "${KILN_TRAIN_TIMEOUT:-300}" python3 "$here/scripts/gpu_peer_torch.py" $quick 2>&1 || echo "PyTorch peer did not finish (status $?)"
        # kiln's training epochs on the GPU, for the PyTorch rows above.
        train_out="$(mktemp -d)"
        for model in lenet resnet18; do
            section "kiln train --model $model on gpu(0), synthetic images"
            if ! timeout "${KILN_TRAIN_TIMEOUT:-300}" "$kiln" train --model "$model" --epochs "${KILN_TRAIN_EPOCHS:-4}" --out "$train_out/$model" 2>&1; then
                echo "FAILED: kiln train --model $model"
                status=1
            fi
        done
        rm -rf "$train_out"
        if [ "${KILN_BENCH_CPU:-1}" != 0 ]; then
            # shellcheck disable=SC2086
            section "kiln bench --device cpu ${KILN_BENCH_ARGS:-}"
            "$kiln" bench --device cpu ${KILN_BENCH_ARGS:-} 2>&1 || status=1
        fi
        if [ "$gpus" -ge 2 ]; then
            # The newest build of the example, from either optimised profile.
            bw="$(ls -t "$target/release-tests/examples/allreduce_bw" "$target/release/examples/allreduce_bw" 2>/dev/null | head -1)"
            bw="${bw:-$target/release-tests/examples/allreduce_bw}"
            if [ -x "$bw" ]; then
                section "all-reduce bus bandwidth over $gpus GPUs (compare nccl-tests: all_reduce_perf -b 1K -e 256M -f 4 -g $gpus)"
                "$bw" --max "${KILN_ALLREDUCE_MAX:-256MiB}" 2>&1 || status=1
                section "all-reduce bus bandwidth with KILN_DISABLE_NCCL=1 (peer copies)"
                KILN_DISABLE_NCCL=1 "$bw" --max 64MiB --iters 5 2>&1 || status=1
            else
                echo "no $bw: build it with 'cargo test --workspace --profile release-tests --no-run' (or cargo build --release -p kiln --examples)"
            fi
        fi
    else
        echo "no kiln binary under $target/{release,release-tests,debug}: build it with 'cargo build --release'"
        status=1
    fi
fi

section "done (status $status)"
exit "$status"
