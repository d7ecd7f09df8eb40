#!/usr/bin/env bash
# `conveyor train` over two "hosts": two network namespaces joined by a veth pair
# (10.77.0.1/24 and 10.77.0.2/24), one MPI process in each, OpenMPI over TCP between them.
#   mpi_netns.sh CONVEYOR   per-step losses and gradient norms (--log-json) and the final
#                           weights' checksum equal the one-process runs, bit for bit
# Exit status 77 (skipped) with the reason where namespaces cannot be made (not root, no
# CAP_SYS_ADMIN, a container that forbids them). The namespaces go away on any exit.
set -uo pipefail
cli=$1
work=$(mktemp -d)
# Names of this run's own (a parallel run makes its own), veth names within 15 characters.
tag=cvy$$
ns=("${tag}h0" "${tag}h1") veth=("${tag}v0" "${tag}v1") addr=(10.77.0.1 10.77.0.2)
cleanup() {
  for n in "${ns[@]}"; do ip netns del "$n" 2>/dev/null; done
  rm -rf "$work"
}
trap cleanup EXIT
# fail, skip, numbers, checksum, same_run
source "$(dirname "${BASH_SOURCE[0]}")/mpi_compare.sh"

command -v ip >/dev/null || skip "the ip command (iproute2) is not installed"
command -v mpirun >/dev/null || skip "mpirun is not installed"
ip netns add "${ns[0]}" 2>"$work/err" ||
  skip "ip netns add is not permitted here: $(cat "$work/err")"
ip netns add "${ns[1]}" || fail "a second namespace could not be made"
join_namespaces "${ns[@]}" "${veth[@]}" "${addr[@]}"

# OpenMPI's rsh launcher starts its daemon on each "host" through this agent: the host name
# is a namespace, the command (one shell line, as ssh would pass it) runs inside it. The
# "hosts" share one /tmp and one host name, so each daemon gets a session folder of its own:
# in the shared one, the two daemons and mpirun make the same job's folder at once, and
# OpenMPI 4.1.4's session_dir refuses the loser of that race ("mkdir ... File exists"), which
# failed about one launch in twenty on a loaded machine.
cat >"$work/agent" <<'AGENT'
#!/usr/bin/env bash
while [[ $# -gt 0 && $1 == -* ]]; do shift; done
host=$1
shift
export OMPI_MCA_orte_tmpdir_base="$(dirname "$0")/session.$host"
mkdir -p "$OMPI_MCA_orte_tmpdir_base" || exit 1
exec ip netns exec "$host" sh -c "$*"
AGENT
chmod +x "$work/agent"
printf '%s slots=1\n' "${ns[@]}" >"$work/hosts"

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# The remote daemon (orted) otherwise shares its hwloc topology through a segment mapped at
# a guessed hole of its address space, and OpenMPI 4.1.4's orted crashed there in about one
# launch of six (hwloc_shmem_topology_write, SIGSEGV); `rtc_hwloc_vmhole none` skips that
# sharing, which only saves the ranks re-reading the topology.
# mpirun itself runs in the first namespace, so its daemons reach it over the veth pair;
# btl self,tcp: no shared memory between the ranks, although they share one kernel.
mpirun=(ip netns exec "${ns[0]}" mpirun --allow-run-as-root -np 2 --hostfile "$work/hosts"
        --map-by node --bind-to none --mca plm_rsh_agent "$work/agent"
        --mca oob_tcp_if_include 10.77.0.0/24 --mca btl self,tcp
        --mca btl_tcp_if_include 10.77.0.0/24
        --mca rtc_hwloc_vmhole none)
common=(train --device cpu --layers 4 --microbatches 4 --batch-tokens 512 --steps 4 --seed 7
        --quiet --weights-checksum --timeout 20)

"$cli" "${common[@]}" --stages 1 --log-json "$work/one.jsonl" >"$work/one.out" 2>&1 ||
  fail "one-process --stages 1 run failed: $(cat "$work/one.out")"
"$cli" "${common[@]}" --stages 2 --transport inproc --log-json "$work/threads.jsonl" \
  >"$work/threads.out" 2>&1 || fail "one-process --stages 2 run failed: $(cat "$work/threads.out")"
# Bytes the first namespace's end of the pair has sent, before and after: the ranks' traffic.
sent_before=$(ip netns exec "${ns[0]}" cat "/sys/class/net/${veth[0]}/statistics/tx_bytes")
# Each rank notes the network namespace it runs in, then becomes conveyor.
timeout 120 "${mpirun[@]}" bash -c \
  'readlink /proc/self/ns/net >"$0/netns.$OMPI_COMM_WORLD_RANK"; exec "$@"' "$work" \
  "$cli" "${common[@]}" --stages 2 --log-json "$work/mpi.jsonl" >"$work/mpi.out" 2>&1 ||
  fail "mpirun over the two namespaces failed: $(cat "$work/mpi.out")"
for i in 0 1; do
  want=$(ip netns exec "${ns[i]}" readlink /proc/self/ns/net)
  [ "$(cat "$work/netns.$i" 2>/dev/null)" = "$want" ] ||
    fail "rank $i did not run in ${ns[i]} ($want): $(cat "$work/netns.$i" 2>/dev/null)"
done
sent_after=$(ip netns exec "${ns[0]}" cat "/sys/class/net/${veth[0]}/statistics/tx_bytes")
# Rank 0 sends 4 steps x 4 micro-batches of activations, 128 tokens x 64 floats each: 512 KiB.
sent=$((sent_after - sent_before))
[ "$sent" -gt 524288 ] || fail "only $sent bytes crossed the veth pair: the ranks did not talk over it"
grep -q "transport mpi" "$work/mpi.out" || fail "the run did not use MPI: $(cat "$work/mpi.out")"
[ "$(numbers "$work/mpi.jsonl" | wc -l)" = 4 ] || fail "expected 4 steps in --log-json"
for ref in one threads; do same_run "$work" "$ref" mpi "over the two namespaces"; done
echo "two namespaces (${addr[*]}), OpenMPI over TCP ($sent bytes out of ${ns[0]}): $(numbers "$work/mpi.jsonl" | wc -l) steps and $(checksum "$work/mpi.out") equal to the one-process runs"
