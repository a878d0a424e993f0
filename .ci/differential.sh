#!/usr/bin/env bash
# The differential test against numpy (kiln/tests/differential.rs with
# scripts/diff_numpy.py): installs numpy from PyPI into a cached venv, then
# runs the seeded cases (CPU and a simulated GPU) and fails on any difference
# outside the README's table "Where kiln differs from PyTorch". Also runs the
# chapter's tests with one and two simulated GPUs, since what the chapter
# states depends on how many GPUs there are.
#
# Environment: KILN_NUMPY_VENV (default ~/.cache/kiln-numpy-venv),
# KILN_DIFF_CASES (default 20000), KILN_DIFF_SEED (default 1).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

NUMPY_VERSION=2.2.6
venv="${KILN_NUMPY_VENV:-$HOME/.cache/kiln-numpy-venv}"
if ! "$venv/bin/python" -c "import numpy" >/dev/null 2>&1; then
    echo "differential: installing numpy $NUMPY_VERSION into $venv"
    mkdir -p "$(dirname "$venv")"
    "${PYTHON:-python3}" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "numpy==$NUMPY_VERSION" \
        || "$venv/bin/python" -m pip install --quiet --disable-pip-version-check numpy
fi

echo "== differential test against numpy"
KILN_REQUIRE_NUMPY=1 KILN_NUMPY_PYTHON="$venv/bin/python" KILN_DIFF_CASES="${KILN_DIFF_CASES:-20000}" \
    cargo test -p kiln --test differential -- --nocapture 2>&1 | grep -E "differential|DIFF|test result|panicked|^  [a-z]"

echo "== chapter tests with one and two simulated GPUs"
KILN_SIM_GPUS=1 cargo test -p kiln --test chapter --test chapter_fixes --test chapter_cells --test chapter_exercises
KILN_SIM_GPUS=2 cargo test -p kiln --test chapter --test chapter_fixes --test chapter_cells --test chapter_exercises
