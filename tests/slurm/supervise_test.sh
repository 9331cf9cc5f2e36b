#!/usr/bin/env bash
# A fault-tolerant job under ddp-supervise inside a Slurm allocation (issue #46): 3 replicas of
# examples/fault_tolerant_training, one job step each, spread over 3 hosts, gloo on each host's
# eth0, a file store on the shared directory. Once the job trains, replica 1 is SIGKILLed: the
# supervisor starts it again and it heals. Then the host of replica 2 dies outright (every process
# on it, slurmd too): srun returns without the replica's status, the supervisor starts it again on
# a host that is left, and it heals. The job ends by itself; all three end bit-identical.
# Run by `ddp-run --hosts 3 --slurm --hosts-only`, which made the cluster and gives SLURM_CONF,
# DDP_SLURM_TOOL, DDP_HOSTS_TOOL and DDP_HOSTS_ID.
# Usage: supervise_test.sh <path to ddp-supervise> <path to fault_tolerant_training>
set -u
sup=$1
trainer=$2
: "${DDP_SLURM_TOOL:?run me with ddp-run --hosts 3 --slurm --hosts-only}"
work=$(mktemp -d)
trap 'pkill -KILL -f -- "--dir $work/store" 2>/dev/null; rm -rf "$work"' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
ms() { echo $(( $(date +%s%N) / 1000000 )); }
out=$work/job.out

cat > "$work/replica.sh" <<R
#!/usr/bin/env bash
echo "r\$DDP_REPLICA_ID incarnation \$DDP_REPLICA_INCARNATION on \$(hostname)"
exec "$trainer" --trainer r\$DDP_REPLICA_ID --store file --dir "\${DDP_STORE#file:}" --port 0 --diloco 0 --spares 0 \
  --interface eth0
R
cat > "$work/job.sh" <<JOB
#!/usr/bin/env bash
#SBATCH --nodes=3 --ntasks-per-node=2 --no-kill --job-name=ft-supervised
#SBATCH --output=$out
exec "$sup" --srun -n 3 --min-interval 0.5 --restarts 4 --timeout 150 --store "file:$work/store" -- "$work/replica.sh"
JOB
chmod +x "$work/replica.sh" "$work/job.sh"
"$DDP_SLURM_TOOL" on "$DDP_HOSTS_ID" sbatch --wait --quiet "$work/job.sh" &
job=$!

# Waits until the job's output matches $1, at most $2 seconds; false if it did not.
await() {
  local i
  for ((i = 0; i < $2 * 20; i++)); do
    grep -qE "$1" "$out" 2> /dev/null && return 0
    kill -0 "$job" 2> /dev/null || return 1
    sleep 0.05
  done
  return 1
}

if await "^r1: committed step" 60; then
  pkill -KILL -f -- "--trainer r1 " || fail "no r1 process to kill"
else
  fail "r1 was never seen training"
fi
# Every replica but r0 heals once as the first quorum forms; the restarted r1's heal is its second.
for ((i = 0; i < 1200; i++)); do
  [ "$(grep -cE "^r1 step [0-9]+: healed" "$out")" -ge 2 ] && break
  sleep 0.05
done
[ "$(grep -cE "^r1 step [0-9]+: healed" "$out")" -ge 2 ] || fail "the restarted r1 did not heal"
host=$(grep -oE "^r2 incarnation 0 on h[0-9]+" "$out" | awk '{print $NF}')
if [ -z "$host" ] || [ "$host" = h1 ]; then
  fail "replica 2 is on '${host}', not on a host of its own (the supervisor runs on h1)"
else
  killed_at=$(ms)
  "$DDP_HOSTS_TOOL" kill "$DDP_HOSTS_ID" "$host"
  if await "^r2 incarnation 1 on h" 90; then
    restarted_at=$(ms)
    for ((i = 0; i < 1200; i++)); do
      [ "$(grep -cE "^r2 step [0-9]+: healed" "$out")" -ge 2 ] && { healed_at=$(ms); break; }
      sleep 0.05
    done
    moved=$(grep -oE "^r2 incarnation 1 on h[0-9]+" "$out" | awk '{print $NF}')
    echo "host $host lost: replica 2 started again on $moved after $(( (restarted_at - killed_at) / 1000 )).$(( (restarted_at - killed_at) % 1000 / 100 )) s, healed after $(( (${healed_at:-0} - killed_at) / 1000 )).$(( (${healed_at:-0} - killed_at) % 1000 / 100 )) s"
    [ "$moved" != "$host" ] || fail "replica 2 was started again on its dead host $host"
  else
    fail "replica 2 was not started again after its host died"
  fi
fi
wait "$job"
rc=$?
cat "$out"
[ "$rc" = 0 ] || fail "sbatch --wait returned $rc"
grep -q "replica 1 (incarnation 0) killed by SIGKILL; restarting" "$out" || fail "no restart line for replica 1"
grep -q "replica 2 (incarnation 0): its job step ended .* lost with its node" "$out" || fail "no lost-node line for replica 2"
[ "$(grep -c "finished at step" "$out")" = 3 ] || fail "$(grep -c "finished at step" "$out") of 3 trainers finished"
hashes=$(grep -o "finished at step .*parameters .*" "$out" | sed 's/.*parameters //' | sort -u)
[ "$(wc -l <<< "$hashes")" = 1 ] || fail "parameters differ: $hashes"
for r in r1 r2; do
  grep -q "^$r: finished.*healed [1-9]" "$out" || fail "$r did not heal: $(grep "^$r: finished" "$out")"
done
if [ $failures = 0 ]; then
  echo "supervised under Slurm: a SIGKILLed replica and a lost host's replica restarted, healed, all bit-identical: passed"
fi
[ $failures = 0 ]
