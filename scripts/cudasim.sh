#!/usr/bin/env bash
# Runs COMMAND with kiln's CUDA backend on the CUDA simulator (cudasim/):
#
#   scripts/cudasim.sh cargo test -p kiln --test conformance
#   scripts/cudasim.sh target/release/kiln devices --json
#
# It builds the simulator (cargo build -p kiln-cudasim), installs NVRTC from
# PyPI into a cached venv when none is there (the real NVRTC compiles the
# kernels, so a compile error still fails), puts a folder with libcuda.so and
# libcublas.so (both the simulator) first on LD_LIBRARY_PATH, sets
# KILN_CUDASIM=1 (without it the simulator reports no device), and runs
# COMMAND. Nothing is installed system-wide; outside this script kiln never
# loads the simulator.
#
# Environment (defaults): KILN_CUDASIM_DEVICES=2, KILN_CUDASIM_MEMORY=1GiB per
# device, KILN_CUDASIM_RESERVED=0 (held by "another process"),
# KILN_CUDASIM_SMS=2, KILN_CUDASIM_PINNED (no limit), KILN_CUDASIM_FAIL
# (name:N: the first N calls of that driver or cuBLAS function fail),
# KILN_CUDASIM_QUIET=1 silences the simulator's diagnostics,
# KILN_CUDASIM_NO_NVRTC=1 leaves NVRTC off the library path,
# KILN_CUDA_VENV (~/.cache/kiln-cuda-venv).
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

export KILN_CUDASIM=1
export KILN_CUDASIM_DEVICES="${KILN_CUDASIM_DEVICES:-2}"
if [ "${KILN_CUDASIM_NO_NVRTC:-0}" = 1 ]; then
    # For the check that a device without NVRTC is not listed.
    export LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
else
    export LD_LIBRARY_PATH="$libdir:$nvrtc_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
exec "$@"
