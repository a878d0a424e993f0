#!/usr/bin/env bash
# CI check of the CUDA backend on a machine without a GPU:
#   1. installs NVRTC and ptxas from PyPI (pinned; once, into a cached venv);
#   2. runs kiln's `cuda` test binary with KILN_REQUIRE_NVRTC=1, which
#      - compiles every kernel family the backend uses with NVRTC for
#        compute_90 and assembles the PTX with ptxas for sm_90, failing on any
#        error or warning-as-error;
#      - checks the no-driver paths (num_gpus counts simulated GPUs only,
#        try_gpu falls back with "no CUDA driver library found", no panic);
#      - skips, saying so, the tests that need a CUDA device.
#
# Environment: KILN_CUDA_VENV (default ~/.cache/kiln-cuda-venv),
# KILN_CUDA_ARCHS (default 90; e.g. "80,90"), CARGO_PROFILE_ARGS (e.g. --release).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

# Versions no newer than the drivers kiln is expected to meet (CUDA 12.x and 13).
NVRTC_VERSION=12.9.86
NVCC_VERSION=12.9.86
venv="${KILN_CUDA_VENV:-$HOME/.cache/kiln-cuda-venv}"
python="${PYTHON:-python3}"

have_tools() {
    local site
    site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null)" || return 1
    [ -e "$site/nvidia/cuda_nvrtc/lib/libnvrtc.so.12" ] && [ -x "$site/nvidia/cuda_nvcc/bin/ptxas" ] || return 1
    "$venv/bin/python" -m pip show nvidia-cuda-nvrtc-cu12 2>/dev/null | grep -x "Version: $NVRTC_VERSION" >/dev/null || return 1
    "$venv/bin/python" -m pip show nvidia-cuda-nvcc-cu12 2>/dev/null | grep -x "Version: $NVCC_VERSION" >/dev/null || return 1
}

if ! have_tools; then
    echo "cuda-check: installing NVRTC $NVRTC_VERSION and ptxas $NVCC_VERSION into $venv"
    mkdir -p "$(dirname "$venv")"
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
        "nvidia-cuda-nvrtc-cu12==$NVRTC_VERSION" "nvidia-cuda-nvcc-cu12==$NVCC_VERSION"
    have_tools || { echo "cuda-check: NVRTC or ptxas missing after the install" >&2; exit 1; }
fi

site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
export LD_LIBRARY_PATH="$site/nvidia/cuda_nvrtc/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export KILN_PTXAS="$site/nvidia/cuda_nvcc/bin/ptxas"
export KILN_REQUIRE_NVRTC=1
export KILN_CUDA_ARCHS="${KILN_CUDA_ARCHS:-90}"
echo "cuda-check: NVRTC from $site/nvidia/cuda_nvrtc/lib, $("$KILN_PTXAS" --version | tail -1)"

# shellcheck disable=SC2086
cargo test -p kiln ${CARGO_PROFILE_ARGS:-} --test cuda -- --nocapture
