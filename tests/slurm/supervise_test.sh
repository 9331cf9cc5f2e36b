#!/usr/bin/env bash
# Fault-tolerant jobs under ddp-supervise inside a Slurm allocation (issue #46): 3 replicas, one
# job step each, spread over 3 hosts, gloo across hosts on each host's eth0, a file store on the
# shared directory; `replicas`: examples/fault_tolerant_training, one process per replica;
# `groups`: examples/replica_groups_training, replica groups of 2 ranks (--group-size 2, one step
# of 2 tasks per group). Once the job trains, replica 1 loses a process to SIGKILL: the supervisor
# starts it again (a group as a whole, with a fresh incarnation) and it heals. Then the host of
# replica 2 dies outright (every process on it, slurmd too): srun returns without the replica's
# status, the supervisor starts it again on a host that is left, and it heals. The job ends by
# itself; every rank ends bit-identical. Prints the time from the host's loss to the replica
# started again elsewhere and healed.
# Run by `ddp-run --hosts 3 [--ranks-per-host 4] --slurm --hosts-only`, which made the cluster and
# gives SLURM_CONF, DDP_SLURM_TOOL, DDP_HOSTS_TOOL and DDP_HOSTS_ID.
# Usage: supervise_test.sh <path to ddp-supervise> replicas <path to fault_tolerant_training>
#        supervise_test.sh <path to ddp-supervise> groups <path to replica_groups_training>
set -u
sup=$1
mode=$2
trainer=$3
: "${DDP_SLURM_TOOL:?run me with ddp-run --hosts 3 --slurm --hosts-only}"
work=$(mktemp -d)
trap 'pkill -KILL -f -- "^$work/trainer-" 2>/dev/null; rm -rf "$work"' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
ms() { echo $(( $(date +%s%N) / 1000000 )); }
seconds() { echo "$(($1 / 1000)).$(($1 % 1000 / 100))"; }
out=$work/job.out

if [ "$mode" = groups ]; then
  # A replica's events and lines come from its group's leader, rank 0 ("g1.0").
  name() { echo "g$1.0"; }
  committed="^g1: committed step"
  victim="^$work/trainer-g1.1-i0"
  ranks=6 per_host=4 hash_after=momentum group_flags=(--group-size 2)
  cat > "$work/start.sh" <<R
#!/usr/bin/env bash
echo "g\$DDP_REPLICA_ID.\$DDP_GROUP_RANK incarnation \$DDP_REPLICA_INCARNATION on \$(hostname)"
exec -a "$work/trainer-g\$DDP_REPLICA_ID.\$DDP_GROUP_RANK-i\$DDP_REPLICA_INCARNATION" "$trainer" --interface eth0
R
else
  name() { echo "r$1"; }
  committed="^r1: committed step"
  victim="^$work/trainer-r1-i0"
  ranks=3 per_host=2 hash_after=parameters group_flags=()
  cat > "$work/start.sh" <<R
#!/usr/bin/env bash
echo "r\$DDP_REPLICA_ID incarnation \$DDP_REPLICA_INCARNATION on \$(hostname)"
exec -a "$work/trainer-r\$DDP_REPLICA_ID-i\$DDP_REPLICA_INCARNATION" "$trainer" --interface eth0
R
fi
# Room on every host for a replica that moves there.
cat > "$work/job.sh" <<JOB
#!/usr/bin/env bash
#SBATCH --nodes=3 --ntasks-per-node=$per_host --no-kill --job-name=ft-$mode
#SBATCH --output=$out
exec "$sup" --srun -n 3 ${group_flags[*]} --min-interval 0.5 --restarts 4 --timeout 200 --store "file:$work/store" \
  -- "$work/start.sh"
JOB
chmod +x "$work/start.sh" "$work/job.sh"
source "$(dirname "$0")/job_lib.sh"
submit_job "$work/job.sh"

heals() { grep -cE "^$(name "$1") step [0-9]+: healed" "$out"; }
if await_count "$committed" 1 90; then
  before=$(heals 1)
  pkill -KILL -f -- "$victim" || fail "no process of replica 1 to kill"
  # It heals once more than before (the first quorum may have healed it already).
  await_count "^$(name 1) step [0-9]+: healed" $((before + 1)) 90 || fail "the restarted replica 1 did not heal"
else
  fail "replica 1 was never seen training"
fi
host=$(grep -oE "^$(name 2) incarnation 0 on h[0-9]+" "$out" | awk '{print $NF}')
if [ -z "$host" ] || [ "$host" = h1 ]; then
  fail "replica 2 is on '${host}', not on a host of its own (the supervisor runs on h1)"
else
  before=$(heals 2)
  killed_at=$(ms)
  "$DDP_HOSTS_TOOL" kill "$DDP_HOSTS_ID" "$host"
  if await_count "^$(name 2) incarnation 1 on h" 1 90; then
    restarted_at=$(ms)
    await_count "^$(name 2) step [0-9]+: healed" $((before + 1)) 60 && healed_at=$(ms)
    moved=$(grep -oE "^$(name 2) incarnation 1 on h[0-9]+" "$out" | awk '{print $NF}')
    echo "host $host lost: replica 2 started again on $moved after $(seconds $((restarted_at - killed_at))) s," \
      "healed after $(seconds $((${healed_at:-$killed_at} - killed_at))) s"
    [ "$moved" != "$host" ] || fail "replica 2 was started again on its dead host $host"
  else
    fail "replica 2 was not started again after its host died"
  fi
fi
wait "$job"
rc=$?
cat "$out"
[ "$rc" = 0 ] || fail "sbatch --wait returned $rc"
grep -qE "replica 1 \(incarnation 0\) (exited|killed)" "$out" || fail "no restart line for replica 1"
grep -q "replica 2 (incarnation 0): its job step ended .* lost with its node" "$out" || fail "no lost-node line for replica 2"
[ "$(grep -c ": finished at step" "$out")" = $ranks ] || fail "$(grep -c ": finished at step" "$out") of $ranks ranks finished"
hashes=$(grep -o "finished at step .*$hash_after .*" "$out" | sed "s/.*$hash_after //" | sort -u)
[ "$(wc -l <<< "$hashes")" = 1 ] || fail "the ranks' bits differ: $hashes"
for r in 1 2; do  # the restarted processes healed (their own counters)
  grep -q "^$(name $r): finished.*healed [1-9]" "$out" || fail "replica $r did not heal: $(grep "^$(name $r): finished" "$out")"
done
if [ $failures = 0 ]; then
  echo "$mode under Slurm: a SIGKILLed replica and a lost host's replica restarted, healed, all bit-identical: passed"
fi
[ $failures = 0 ]
