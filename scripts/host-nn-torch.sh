#!/usr/bin/env bash
# The on-demand differential test of kiln's convolutional-network host
# kernels against PyTorch (kiln/tests/host_nn_torch.rs with
# scripts/host_nn_torch.py). Needs a Python with torch: KILN_TORCH_VENV
# (default /tmp/kiln-torch, which scripts/diff-torch.sh creates).
#
# Environment: KILN_TORCH_CASES (cases per op, default 200), KILN_TORCH_SEED
# (default 1), KILN_TORCH_KEEP=path (keep the cases file).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${KILN_TORCH_VENV:-/tmp/kiln-torch}"
if ! "$venv/bin/python" -c "import torch" >/dev/null 2>&1; then
    echo "host-nn-torch: no torch in $venv (scripts/diff-torch.sh installs it)" >&2
    exit 2
fi
KILN_TORCH_PYTHON="$venv/bin/python" cargo test -p kiln --test host_nn_torch -- --nocapture "$@"
