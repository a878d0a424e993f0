#!/usr/bin/env bash
# Runs COMMAND with kiln's CUDA backend on the CUDA simulator (cudasim/):
#
#   scripts/cudasim.sh cargo test -p kiln --test conformance
#   scripts/cudasim.sh target/release/kiln devices --json
#
# It builds the simulator (cargo build -p kiln-cudasim), installs NVRTC from
# PyPI into a cached venv when none is there, and makes four folders of
# links to the simulator: target/cudasim-lib (libcuda.so, libcublas.so),
# target/cudasim-nccl (libnccl.so.2, libnccl.so: NCCL's collectives over the
# simulated devices, one process), target/cudasim-cudnn (libcudnn.so.9,
# libcudnn.so: cuDNN's convolutions) and target/cudasim-nvrtc (libnvrtc.so,
# libnvrtc.so.12). They go first on LD_LIBRARY_PATH; the NVRTC one
# forwards every call to the real NVRTC (KILN_CUDASIM_NVRTC, its path in the
# venv, so a compile error still fails) and remembers each program's source,
# which the simulated driver compiles for the host with g++ when kiln loads
# the module. It sets KILN_CUDASIM=1
# (without it the simulator reports no device) and runs COMMAND. Nothing is
# installed system-wide; outside this script kiln never loads the simulator.
#
# Environment (defaults): KILN_CUDASIM_DEVICES=2, KILN_CUDASIM_MEMORY=1GiB per
# device, KILN_CUDASIM_RESERVED=0 (held by "another process"),
# KILN_CUDASIM_SMS=2, KILN_CUDASIM_PINNED (no limit), KILN_CUDASIM_FAIL
# (name:N[@S]: N calls of that driver, cuBLAS or NCCL function fail, after
# S that succeed),
# KILN_CUDASIM_QUIET=1 silences the simulator's diagnostics,
# KILN_CUDASIM_NO_NVRTC=1 leaves NVRTC off the library path,
# KILN_CUDASIM_NO_NCCL=1 leaves NCCL off it (KILN_DISABLE_NCCL=1 instead
# keeps it there and tells kiln not to use it), KILN_CUDASIM_NO_CUDNN=1
# leaves cuDNN off it (KILN_DISABLE_CUDNN=1 instead keeps it there and tells
# kiln not to use it),
# KILN_CUDASIM_NCCL_TIMEOUT (120 s a rank waits for the others of a
# collective before its device faults; on a GPU that hangs),
# KILN_CUDASIM_CACHE (~/.cache/kiln-cudasim: the host-compiled kernels and
# which source each NVRTC image came from), KILN_CACHE_DIR (kiln's own kernel
# cache; $KILN_CUDASIM_CACHE/kiln-1 unless set, so that the two are cleared
# together), KILN_CUDASIM_CXX (g++), KILN_NVRTC_LIB (when set, that NVRTC is
# the one forwarded to), KILN_CUDA_VENV (~/.cache/kiln-cuda-venv).
set -euo pipefail

if [ $# -eq 0 ]; then
    echo "usage: scripts/cudasim.sh COMMAND [ARGS...]" >&2
    exit 2
fi
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

NVRTC_VERSION=12.9.86
venv="${KILN_CUDA_VENV:-$HOME/.cache/kiln-cuda-venv}"
python="${PYTHON:-python3}"
site_of() { "$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null; }
site="$(site_of || true)"
if [ -z "$site" ] || [ ! -e "$site/nvidia/cuda_nvrtc/lib/libnvrtc.so.12" ]; then
    echo "cudasim: installing NVRTC $NVRTC_VERSION into $venv" >&2
    mkdir -p "$(dirname "$venv")"
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "nvidia-cuda-nvrtc-cu12==$NVRTC_VERSION" >&2
    site="$(site_of)"
fi
nvrtc_dir="$site/nvidia/cuda_nvrtc/lib"
[ -e "$nvrtc_dir/libnvrtc.so.12" ] || { echo "cudasim: NVRTC missing from $nvrtc_dir after the install" >&2; exit 1; }

target_dir="${CARGO_TARGET_DIR:-$root/target}"
(cd "$root" && cargo build --quiet -p kiln-cudasim) >&2
lib="$target_dir/debug/libkiln_cudasim.so"
[ -e "$lib" ] || { echo "cudasim: $lib was not built" >&2; exit 1; }
libdir="$target_dir/cudasim-lib"
mkdir -p "$libdir"
# Not libcuda.so.1: NVRTC dlopens that name itself (to ask the driver), and must
# not get the simulator.
rm -f "$libdir/libcuda.so.1"
for name in libcuda.so libcublas.so libcublas.so.12 libcublas.so.13; do
    ln -sfn "$lib" "$libdir/$name"
done
# NVRTC's names in a folder of their own, left off the path for
# KILN_CUDASIM_NO_NVRTC=1 (concurrent runs with and without it share these
# folders). libnvrtc.so is the first name kiln tries; the real NVRTC's folder
# is not on the path at all, so no other name can reach it unseen. (The real
# NVRTC finds its builtins library next to itself, through its RUNPATH.)
shimdir="$target_dir/cudasim-nvrtc"
mkdir -p "$shimdir"
for name in libnvrtc.so libnvrtc.so.12; do
    ln -sfn "$lib" "$shimdir/$name"
done

# NCCL's names in a folder of their own too, left off the path for
# KILN_CUDASIM_NO_NCCL=1 (kiln then reports NCCL missing and runs collectives
# through peer copies). libnccl.so.2 is the name kiln tries first.
nccldir="$target_dir/cudasim-nccl"
mkdir -p "$nccldir"
for name in libnccl.so.2 libnccl.so; do
    ln -sfn "$lib" "$nccldir/$name"
done

# cuDNN's names in a folder of their own, left off the path for
# KILN_CUDASIM_NO_CUDNN=1 (kiln then reports cuDNN missing and runs
# convolutions through im2col + cuBLAS). libcudnn.so.9 is the name kiln tries first.
dnndir="$target_dir/cudasim-cudnn"
mkdir -p "$dnndir"
for name in libcudnn.so.9 libcudnn.so; do
    ln -sfn "$lib" "$dnndir/$name"
done

command -v "${KILN_CUDASIM_CXX:-g++}" >/dev/null 2>&1 ||
    echo "cudasim: ${KILN_CUDASIM_CXX:-g++} not found: the simulator compiles kiln's kernels for the host with it when they are loaded (apt-get install g++)" >&2

export KILN_CUDASIM=1
# A cuDNN named for real GPU work would be loaded against the simulated
# driver: the simulator's stand-in (or none) instead.
unset KILN_CUDNN_LIB
export KILN_CUDASIM_DEVICES="${KILN_CUDASIM_DEVICES:-2}"
export KILN_CUDASIM_CACHE="${KILN_CUDASIM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kiln-cudasim}"
# kiln-1 follows RECORDS (images-1) in cudasim/src/sources.rs: the simulator
# knows an image kiln cached only by a record keyed the same way.
export KILN_CACHE_DIR="${KILN_CACHE_DIR:-$KILN_CUDASIM_CACHE/kiln-1}"
libpath="$libdir"
if [ "${KILN_CUDASIM_NO_NCCL:-0}" != 1 ]; then
    libpath="$libpath:$nccldir"
fi
if [ "${KILN_CUDASIM_NO_CUDNN:-0}" != 1 ]; then
    libpath="$libpath:$dnndir"
fi
if [ "${KILN_CUDASIM_NO_NVRTC:-0}" = 1 ]; then
    # For the check that a device without NVRTC is not listed.
    export LD_LIBRARY_PATH="$libpath${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
else
    # An NVRTC named by KILN_NVRTC_LIB is the one forwarded to; kiln then
    # opens the simulator's stand-in, which remembers what it compiles.
    export KILN_CUDASIM_NVRTC="${KILN_NVRTC_LIB:-$nvrtc_dir/libnvrtc.so.12}"
    if [ -n "${KILN_NVRTC_LIB:-}" ]; then
        export KILN_NVRTC_LIB="$shimdir/libnvrtc.so"
    fi
    export LD_LIBRARY_PATH="$libpath:$shimdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
exec "$@"
