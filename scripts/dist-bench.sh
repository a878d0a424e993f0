#!/usr/bin/env bash
# kiln's all-reduce across processes beside raw MPI_Allreduce: interleaved
# runs of examples/dist_allreduce_bench.rs (raw, kiln, raw, kiln, ...) on
# NP ranks (default 2), ROUNDS rounds (default 3); prints for each size the
# median over the rounds of each side's median time, and kiln's
# throughput as a fraction of raw MPI's.
#
#     bash scripts/dist-bench.sh            # 2 ranks
#     NP=4 bash scripts/dist-bench.sh
set -euo pipefail
cd "$(dirname "$0")/.."
np="${NP:-2}"
rounds="${ROUNDS:-3}"
# The release settings (the copies and MPI's work dominate).
profile="${PROFILE:-release}"
cargo build --profile "$profile" -p kiln --features mpi --example dist_allreduce_bench >&2
bin="${CARGO_TARGET_DIR:-target}/$profile/examples/dist_allreduce_bench"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
out="$(mktemp)"
trap 'rm -f "$out"' EXIT
for _ in $(seq "$rounds"); do
    for side in raw kiln; do
        mpirun --oversubscribe -np "$np" "$bin" "$side" >>"$out"
    done
done
python3 - "$out" "$np" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1]) if l.strip()]
t = {}
for side, size, sec in rows:
    t.setdefault((side, int(size)), []).append(float(sec))
print(f"all-reduce of f32 on {sys.argv[2]} ranks (medians of {len(t[rows[0][0], int(rows[0][1])])} interleaved runs)")
print(f"{'size':>8} {'raw MPI':>12} {'all_reduce':>12} {'kiln/raw':>9} {'all_reduce_':>12} {'kiln/raw':>9}")
for size in sorted({s for _, s in t}):
    raw, kiln, inplace = (statistics.median(t[side, size]) for side in ("raw", "kiln", "kiln_"))
    print(f"{size >> 20:>5} MiB {raw * 1e3:>9.2f} ms {kiln * 1e3:>9.2f} ms {raw / kiln:>8.2f}x {inplace * 1e3:>9.2f} ms {raw / inplace:>8.2f}x")
PY
