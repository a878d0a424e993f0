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
cargo test --workspace ${CARGO_PROFILE_ARGS:-} --test cuda -- --nocapture

# Optional: the "driver present, no device" path, with the CUDA driver library
# of Debian's libcuda1 (non-free) unpacked, not installed. Skipped when it
# cannot be fetched.
libcuda_dir="$(dirname "$venv")/kiln-libcuda1"
if [ ! -e "$libcuda_dir/lib/libcuda.so.1" ] && command -v apt-get >/dev/null && command -v dpkg >/dev/null; then
    tmp="$(mktemp -d)"
    mkdir -p "$tmp/lists/partial" "$tmp/cache/archives/partial"
    # The machine's own Debian mirror and release, with the non-free component.
    mirror="$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)"
    [ -n "$mirror" ] || mirror="$(awk '/^deb / {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)"
    codename="$(. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}")"
    echo "deb $mirror $codename non-free" >"$tmp/sources.list"
    apt_opts=(-o "Dir::Etc::SourceList=$tmp/sources.list" -o Dir::Etc::SourceParts=/dev/null
        -o "Dir::State::Lists=$tmp/lists" -o "Dir::Cache=$tmp/cache" -o APT::Sandbox::User=root)
    if (cd "$tmp" && apt-get "${apt_opts[@]}" update -qq >/dev/null 2>&1 && apt-get "${apt_opts[@]}" download libcuda1 >/dev/null 2>&1); then
        dpkg -x "$tmp"/libcuda1_*.deb "$tmp/root"
        mkdir -p "$libcuda_dir/lib"
        cp -a "$tmp"/root/usr/lib/x86_64-linux-gnu/nvidia/current/libcuda.so* "$libcuda_dir/lib/"
    fi
    rm -rf "$tmp"
fi
if [ -e "$libcuda_dir/lib/libcuda.so.1" ]; then
    echo "cuda-check: again with Debian's libcuda1 and no GPU (driver present, no device)"
    # shellcheck disable=SC2086
    LD_LIBRARY_PATH="$libcuda_dir/lib:$LD_LIBRARY_PATH" cargo test --workspace ${CARGO_PROFILE_ARGS:-} --test cuda -- --nocapture no_device
else
    echo "cuda-check: libcuda1 could not be fetched; the driver-present-no-device path is not checked"
fi
