#!/usr/bin/env bash
# The on-demand differential test of gradients against PyTorch
# (kiln/tests/diff_torch.rs with scripts/diff_torch.py). PyTorch is several
# GB, so CI does not run this: it creates a venv (KILN_TORCH_VENV, default
# /tmp/kiln-torch), installs torch and numpy from PyPI if they are missing,
# then runs the seeded cases (CPU and a simulated GPU) and fails on any
# difference outside the README's table "Where kiln differs from PyTorch".
#
# Environment: KILN_TORCH_VENV, KILN_TORCH_CASES (default 4000),
# KILN_TORCH_SEED (default 1), KILN_TORCH_KEEP=path (keep the cases file).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

venv="${KILN_TORCH_VENV:-/tmp/kiln-torch}"
if ! "$venv/bin/python" -c "import torch" >/dev/null 2>&1; then
    echo "diff-torch: installing torch into $venv (several GB)"
    "${PYTHON:-python3}" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check torch numpy
fi

KILN_TORCH_PYTHON="$venv/bin/python" cargo test -p kiln --test diff_torch -- --nocapture "$@"
