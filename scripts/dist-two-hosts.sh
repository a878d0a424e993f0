#!/usr/bin/env bash
# Training across two machines, on this one: two network namespaces joined
# by a veth pair, each with a hostname of its own (a UTS namespace), and
# mpirun started in the first launching the second's ranks through an rsh
# agent that enters it (what ssh does between real hosts). MPI's TCP
# transport only (`--mca btl tcp,self`): every byte between the two hosts
# crosses the veth, as it would cross a network.
#
#     bash scripts/dist-two-hosts.sh DIST_LENET [DIST_TEST]
#
# runs DIST_LENET (target/<profile>/examples/dist_lenet, built with
# `--features mpi`) on 4 ranks, 2 per host, and checks that it trained on 4
# processes; with DIST_TEST (the binary of kiln/tests/dist.rs) also runs its
# collectives and seeded random calls on the same 4 ranks. Needs root (`ip netns`,
# `unshare`); where namespaces cannot be made it says why and exits 0
# (skipped), unless KILN_REQUIRE_NETNS=1 (CI), where that is a failure.
set -euo pipefail
lenet="${1:?usage: dist-two-hosts.sh DIST_LENET [DIST_TEST]}"
dist_test="${2:-}"
# Namespaces and links named after this run, so that two runs on one
# machine do not take each other's; the hostnames inside are fixed.
a="kiln-a-$$"
b="kiln-b-$$"
veth_a="vka$$"
veth_b="vkb$$"
host_a=kiln-host-a
host_b=kiln-host-b
ip_a=10.77.0.1
ip_b=10.77.0.2

skip() {
    if [ "${KILN_REQUIRE_NETNS:-}" = 1 ]; then
        echo "dist-two-hosts: KILN_REQUIRE_NETNS=1 but $1" >&2
        exit 1
    fi
    echo "dist-two-hosts: skipped: $1"
    exit 0
}
command -v ip >/dev/null 2>&1 || skip "no \`ip\` command (Debian: iproute2)"
command -v unshare >/dev/null 2>&1 || skip "no \`unshare\` command (util-linux)"
command -v mpirun >/dev/null 2>&1 || skip "no mpirun (Debian: openmpi-bin)"

work="$(mktemp -d)"
cleanup() {
    ip netns del "$a" 2>/dev/null || true
    ip netns del "$b" 2>/dev/null || true
    ip link del "$veth_a" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
ip netns add "$a" 2>"$work/err" || skip "cannot make a network namespace ($(cat "$work/err")); run as root"
ip netns add "$b"
ip link add "$veth_a" type veth peer name "$veth_b"
ip link set "$veth_a" netns "$a"
ip link set "$veth_b" netns "$b"
ip -n "$a" addr add "$ip_a/24" dev "$veth_a"
ip -n "$b" addr add "$ip_b/24" dev "$veth_b"
for ns in "$a" "$b"; do
    ip -n "$ns" link set lo up
done
ip -n "$a" link set "$veth_a" up
ip -n "$b" link set "$veth_b" up

# The rsh agent: Open MPI calls it as `agent HOST COMMAND...` to start its
# daemon on HOST, as it would call ssh.
cat >"$work/agent" <<AGENT
#!/bin/sh
host="\$1"; shift
case "\$host" in
    $ip_a|$host_a) ns=$a; name=$host_a ;;
    $ip_b|$host_b) ns=$b; name=$host_b ;;
    *) echo "dist-two-hosts agent: unknown host \$host" >&2; exit 1 ;;
esac
exec ip netns exec "\$ns" unshare --uts sh -c 'hostname "\$0"; exec sh -c "\$*"' "\$name" "\$@"
AGENT
chmod +x "$work/agent"

# mpirun on host a; ranks 0-1 on a, 2-3 on b.
run_on_two_hosts() {
    ip netns exec "$a" unshare --uts sh -c 'hostname "$0"; exec "$@"' "$host_a" \
        timeout -k 10 300 mpirun --host "$ip_a:2,$ip_b:2" -np 4 \
        --mca plm_rsh_agent "$work/agent" --mca btl tcp,self --mca btl_tcp_if_include 10.77.0.0/24 \
        --mca oob_tcp_if_include 10.77.0.0/24 \
        -x OMPI_ALLOW_RUN_AS_ROOT=1 -x OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 -x KILN_TEST_DIST_SCENARIO -x KILN_DIST_TIMEOUT \
        --tag-output "$@"
}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export KILN_DIST_TIMEOUT="${KILN_DIST_TIMEOUT:-60}"

echo "== dist-two-hosts: where each rank runs"
KILN_TEST_DIST_SCENARIO=none run_on_two_hosts sh -c 'echo "$(hostname): rank ${OMPI_COMM_WORLD_RANK} of ${OMPI_COMM_WORLD_SIZE}, local rank ${OMPI_COMM_WORLD_LOCAL_RANK}"' | sort | tee "$work/hosts"
grep -q "$host_a: rank 0 of 4" "$work/hosts" && grep -q "$host_b: rank 3 of 4" "$work/hosts" \
    || { echo "dist-two-hosts: the ranks did not land 2 per host" >&2; exit 1; }

echo "== dist-two-hosts: LeNet on 4 ranks over 2 hosts (TCP between them)"
out="$(KILN_TEST_DIST_SCENARIO=none run_on_two_hosts "$lenet" 2)"
echo "$out"
grep -q "LeNet on 4 process(es) (mpi engine)" <<<"$out" || { echo "dist-two-hosts: dist_lenet did not train on 4 ranks" >&2; exit 1; }
# The same curve as one process on the whole batches (printed to 4
# decimals: within one rounding step and 1e-4).
alone="$("$lenet" 2)"
curve() { sed -n 's/.*epoch \([0-9]*\)  train loss \([0-9.]*\).*/\1 \2/p'; }
paste <(curve <<<"$out") <(curve <<<"$alone") | awk '
    { n++; d = $2 - $4; if (d < 0) d = -d; if ($1 != $3 || d > 0.00015) bad = 1; printf "epoch %s: train loss %s on 2 hosts, %s in one process\n", $1, $2, $4 }
    END { if (n != 2 || bad) { print "dist-two-hosts: the curve over two hosts is not one process curve" > "/dev/stderr"; exit 1 } }'

if [ -n "$dist_test" ]; then
    echo "== dist-two-hosts: every collective on 4 ranks over 2 hosts"
    out="$(KILN_TEST_DIST_SCENARIO=collectives run_on_two_hosts "$dist_test")"
    echo "$out"
    [ "$(grep -c 'collectives ok' <<<"$out")" = 4 ] || { echo "dist-two-hosts: not every rank finished the collectives" >&2; exit 1; }
    echo "== dist-two-hosts: seeded random calls on 4 ranks over 2 hosts, against a reference"
    out="$(KILN_TEST_DIST_SCENARIO=fuzz run_on_two_hosts "$dist_test")"
    echo "$out"
    [ "$(grep -c 'fuzz ok' <<<"$out")" = 4 ] || { echo "dist-two-hosts: not every rank finished the random calls" >&2; exit 1; }
fi
echo "dist-two-hosts: passed"
