#!/usr/bin/env bash
# ThreadSanitizer over kiln's thread suites: soundness.rs (first writers,
# rayon re-entrancy, index_add beside kernels, the mixed stress) and
# stress_threads.rs. TSan needs the nightly toolchain and the standard
# library rebuilt with it (-Zbuild-std, from the rust-src component), so that
# std's own synchronisation is instrumented too; both are installed here when
# missing. A data race fails the run (halt_on_error).
#
# The fork test is skipped: TSan's runtime does not support a child that
# keeps running after a fork of a multi-threaded process.
#
# Environment: KILN_TSAN_TARGET_DIR (default target/tsan), KILN_STRESS_SECS
# (default 2 here), extra arguments go to `cargo test`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

if ! rustup run nightly rustc --version >/dev/null 2>&1; then
    echo "tsan: installing the nightly toolchain"
    rustup toolchain install nightly --profile minimal --component rust-src
fi
if ! rustup component list --toolchain nightly --installed 2>/dev/null | grep -q '^rust-src'; then
    echo "tsan: adding rust-src to nightly"
    rustup component add rust-src --toolchain nightly
fi

host="$(rustc -vV | sed -n 's/^host: //p')"
# Line tables are enough for a report to name files and lines, at a fraction
# of the disk of full debug info.
export RUSTFLAGS="-Zsanitizer=thread -Cdebuginfo=line-tables-only"
export RUSTDOCFLAGS="-Zsanitizer=thread"
export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 report_signal_unsafe=0 ${TSAN_OPTIONS:-}"
export KILN_STRESS_SECS="${KILN_STRESS_SECS:-2}"
# CUDA is not what is checked here; skip probing its driver library.
export KILN_DISABLE_CUDA=1
cargo +nightly test -Zbuild-std --target "$host" --target-dir "${KILN_TSAN_TARGET_DIR:-target/tsan}" \
    -p kiln --test soundness --test stress_threads "$@" -- --skip fork_while
