#!/usr/bin/env bash
# The differential test against numpy (kiln/tests/differential.rs with
# scripts/diff_numpy.py): installs numpy (and ml_dtypes, numpy's bfloat16)
# from PyPI into a cached venv, then runs the seeded cases (CPU and a
# simulated GPU) and fails on any difference outside the README's table
# "Where kiln differs from PyTorch". Then .npy/.npz files checked against
# numpy both ways (kiln/tests/io_numpy.rs with scripts/io_numpy.py). Also
# runs the chapter's tests with one and two simulated GPUs, since what the
# chapter states depends on how many GPUs there are.
#
# Environment: KILN_NUMPY_VENV (default ~/.cache/kiln-numpy-venv),
# KILN_DIFF_CASES (default 20000), KILN_DIFF_SEED (default 1).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

NUMPY_VERSION=2.2.6
ML_DTYPES_VERSION=0.5.1
venv="${KILN_NUMPY_VENV:-$HOME/.cache/kiln-numpy-venv}"
if ! "$venv/bin/python" -c "import numpy, ml_dtypes" >/dev/null 2>&1; then
    echo "differential: installing numpy $NUMPY_VERSION and ml_dtypes $ML_DTYPES_VERSION into $venv"
    mkdir -p "$(dirname "$venv")"
    [ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "numpy==$NUMPY_VERSION" "ml_dtypes==$ML_DTYPES_VERSION" \
        || "$venv/bin/python" -m pip install --quiet --disable-pip-version-check numpy ml_dtypes
fi

echo "== differential test against numpy"
KILN_REQUIRE_NUMPY=1 KILN_NUMPY_PYTHON="$venv/bin/python" KILN_DIFF_CASES="${KILN_DIFF_CASES:-20000}" \
    cargo test --workspace --test differential -- --nocapture 2>&1 | grep -E "differential|DIFF|test result|panicked|^  [a-z]"

echo "== .npy/.npz against numpy, both ways"
KILN_REQUIRE_NUMPY=1 KILN_NUMPY_PYTHON="$venv/bin/python" cargo test --workspace --test io_numpy -- --nocapture

echo "== chapter tests with one and two simulated GPUs"
KILN_SIM_GPUS=1 cargo test --workspace --test chapter --test chapter_cells --test chapter_exercises
KILN_SIM_GPUS=2 cargo test --workspace --test chapter --test chapter_cells --test chapter_exercises
