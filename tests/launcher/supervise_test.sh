#!/usr/bin/env bash
# Tests of scripts/ddp-supervise (issue #46): a replica that dies is started again with the next
# incarnation and the same id; the environment each replica gets; the restart budget and the
# rate bound; SIGTERM reaches every replica and leaves no process; the Redis store with a
# password; replica groups restarted as a whole; and a real fault-tolerant job
# (examples/fault_tolerant_training's trainers) whose
# replica is SIGKILLed from outside: it is restarted, heals, and all three end bit-identical.
# Usage: supervise_test.sh <path to ddp-supervise>            the supervisor's own cases (1-7)
#        supervise_test.sh <path to ddp-supervise> --job <path to fault_tolerant_training>   case 8
set -u
sup=$1
trainer=""
[ "${2:-}" = --job ] && trainer=$3
work=$(mktemp -d)
trap 'pkill -KILL -f "ddp-supervise-test-$$" 2>/dev/null; rm -rf "$work"' EXIT
failures=0
passed=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
ok() { echo "ok: $*"; passed=$((passed + 1)); }
ms() { echo $(( $(date +%s%N) / 1000000 )); }

# A replica: logs "<id> <incarnation> <ms>", then does what $MODE says.
cat > "$work/replica.sh" <<'R'
#!/usr/bin/env bash
# ddp-supervise-test marker: $0
echo "$DDP_REPLICA_ID $DDP_REPLICA_INCARNATION $(( $(date +%s%N) / 1000000 ))" >> "$LOG"
[ -n "${DDP_GROUP_RANK:-}" ] && echo "$DDP_REPLICA_ID $DDP_REPLICA_INCARNATION $DDP_GROUP_RANK/$DDP_GROUP_SIZE" >> "$LOG.group"
case "$MODE" in
  kill-once) [ "$DDP_REPLICA_ID" = 1 ] && [ "$DDP_REPLICA_INCARNATION" = 0 ] && kill -KILL $$ ;;
  always-fail) exit 3 ;;
  group) if [ "$DDP_REPLICA_ID" = 1 ] && [ "$DDP_REPLICA_INCARNATION" = 0 ]; then
           [ "$DDP_GROUP_RANK" = 1 ] && { sleep 0.3; kill -KILL $$; }
           sleep 30  # its group-mate: the supervisor must stop it
         fi ;;
  env) echo "$DDP_REPLICA_ID ${#DDP_JOB_SECRET} $DDP_REPLICAS $DDP_STORE" >> "$LOG.env"
       [[ "$DDP_JOB_SECRET" =~ ^[0-9a-f]{64}$ ]] || exit 4
       [ -d "${DDP_STORE#file:}" ] || exit 5 ;;
  sleep) trap 'echo "term $DDP_REPLICA_ID" >> "$LOG.term"; exit 0' TERM
         sleep 60 & wait ;;
  redis) [ "$(redis-cli -p "${DDP_STORE##*:}" --no-auth-warning -a "$DDP_REDIS_PASSWORD" ping)" = PONG ] || exit 6
         redis-cli -p "${DDP_STORE##*:}" ping 2>&1 | grep -q NOAUTH || exit 7 ;;
esac
exit 0
R
chmod +x "$work/replica.sh"
cp "$work/replica.sh" "$work/ddp-supervise-test-$$.sh"
replica="$work/ddp-supervise-test-$$.sh"

if [ -z "$trainer" ]; then
# 1. A replica killed by SIGKILL is started again as incarnation 1; the job ends 0.
out=$(LOG=$work/l1 MODE=kill-once "$sup" -n 3 --min-interval 0.1 -- "$replica" 2>&1); rc=$?
[ $rc = 0 ] || fail "kill-once: exit $rc: $out"
[ "$(cut -d' ' -f1,2 "$work/l1" | sort | tr '\n' ,)" = "0 0,1 0,1 1,2 0," ] || fail "kill-once: starts $(cat "$work/l1")"
grep -q "replica 1 (incarnation 0) killed by SIGKILL; restarting" <<< "$out" || fail "kill-once: no line: $out"
[ $failures = 0 ] && ok "a killed replica is restarted as incarnation 1"

# 2. What every replica is given: its id, the job's size, a 64-hex-digit secret, a file store.
f=$failures
out=$(LOG=$work/l2 MODE=env "$sup" -n 2 -- "$replica" 2>&1); rc=$?
[ $rc = 0 ] || fail "env: exit $rc: $out $(cat "$work/l2.env" 2>/dev/null)"
grep -q "^0 64 2 file:/" "$work/l2.env" && grep -q "^1 64 2 file:/" "$work/l2.env" || fail "env: $(cat "$work/l2.env")"
secret_on_cmdline=$(LOG=$work/l2b MODE=env DDP_JOB_SECRET=$(printf 'ab%.0s' {1..32}) "$sup" -n 1 -- "$replica" 2>&1; echo "rc=$?")
grep -q "rc=0" <<< "$secret_on_cmdline" || fail "env: the caller's secret is not passed on: $secret_on_cmdline"
[ $failures = $f ] && ok "replicas get their id, the job's size, the secret and the store"

# 3. The restart budget: a replica that always fails is restarted twice, then everything stops.
f=$failures
out=$(LOG=$work/l3 MODE=always-fail "$sup" -n 1 --restarts 2 --min-interval 0.05 -- "$replica" 2>&1); rc=$?
[ $rc = 1 ] || fail "budget: exit $rc, expected 1: $out"
[ "$(wc -l < "$work/l3")" = 3 ] || fail "budget: $(wc -l < "$work/l3") starts, expected 3"
grep -q "the restart budget (2) is spent" <<< "$out" || fail "budget: no line: $out"
[ $failures = $f ] && ok "the restart budget ends the job with exit 1"

# 4. The rate bound: starts of one replica at least --min-interval apart.
f=$failures
LOG=$work/l4 MODE=always-fail "$sup" -q -n 1 --restarts 2 --min-interval 0.4 -- "$replica"
times=($(cut -d' ' -f3 "$work/l4"))
for i in 1 2; do
  gap=$(( times[i] - times[i - 1] ))
  [ $gap -ge 390 ] || fail "rate: start $i came $gap ms after the one before (min 400)"
done
[ $failures = $f ] && ok "restarts of one replica are at least --min-interval apart"

# 5. SIGTERM to the supervisor reaches every replica; it exits 143; no replica is left.
f=$failures
LOG=$work/l5 MODE=sleep "$sup" -n 3 --grace 3 -- "$replica" 2> "$work/l5.err" &
pid=$!
for _ in $(seq 100); do [ "$(wc -l < "$work/l5" 2>/dev/null || echo 0)" = 3 ] && break; sleep 0.05; done
sleep 0.2
kill -TERM $pid
wait $pid; rc=$?
[ $rc = 143 ] || fail "sigterm: exit $rc, expected 143: $(cat "$work/l5.err")"
[ "$(sort "$work/l5.term" 2>/dev/null | tr '\n' ,)" = "term 0,term 1,term 2," ] || fail "sigterm: $(cat "$work/l5.term" 2>/dev/null)"
sleep 0.2
pgrep -f "ddp-supervise-test-$$" > /dev/null && fail "sigterm: a replica is left: $(pgrep -af "ddp-supervise-test-$$")"
[ $failures = $f ] && ok "SIGTERM stops every replica, exit 143"

# 6. --store redis: a redis-server with a password, stopped at the end.
f=$failures
if command -v redis-server > /dev/null && command -v redis-cli > /dev/null; then
  out=$(LOG=$work/l6 MODE=redis "$sup" -n 2 --store redis -- "$replica" 2>&1); rc=$?
  [ $rc = 0 ] || fail "redis: exit $rc: $out"
  port=$(grep -o "127.0.0.1:[0-9]*" <<< "$out" | head -1 | cut -d: -f2)
  [ -n "$port" ] && redis-cli -p "$port" ping > /dev/null 2>&1 && fail "redis: the server on $port outlived the job"
  [ $failures = $f ] && ok "--store redis: a password-protected server for the job, gone after it"
else
  ok "--store redis: skipped (no redis-server/redis-cli)"
fi

fi

# 7. Replica groups (--group-size 2): a group's rank SIGKILLed; its group-mate is stopped and the
#    group starts again as a whole, as incarnation 1, each process with its group rank.
if [ -z "$trainer" ]; then
f=$failures
t0=$(ms)
out=$(LOG=$work/l6 MODE=group "$sup" -n 2 --group-size 2 --grace 1 --min-interval 0.1 -- "$replica" 2>&1); rc=$?
took=$(( $(ms) - t0 ))
[ $rc = 0 ] || fail "group: exit $rc: $out"
[ "$(sort "$work/l6.group" | tr '\n' ,)" = "0 0 0/2,0 0 1/2,1 0 0/2,1 0 1/2,1 1 0/2,1 1 1/2," ] ||
  fail "group: starts $(sort "$work/l6.group" | tr '\n' ,)"
grep -q "replica 1 (incarnation 0) killed by SIGKILL; restarting" <<< "$out" || fail "group: no restart line: $out"
[ "$took" -lt 20000 ] || fail "group: the killed rank's group-mate was not stopped (took $took ms)"
[ $failures = $f ] && ok "--group-size 2: a dead rank's group is stopped and started again as a whole"
fi

# 8. A real fault-tolerant job: three trainers of examples/fault_tolerant_training under the
#    supervisor, one SIGKILLed from outside once the job trains: restarted, it heals; all three end
#    with the same parameters.
f=$failures
if [ -n "$trainer" ]; then
  cat > "$work/ft-replica.sh" <<R
#!/usr/bin/env bash
exec -a "$work/trainer-r\$DDP_REPLICA_ID-i\$DDP_REPLICA_INCARNATION" "$trainer"  # a name pkill can find
R
  chmod +x "$work/ft-replica.sh"
  "$sup" -n 3 --min-interval 0.2 --timeout 90 --store "file:$work/store" -- "$work/ft-replica.sh" > "$work/l7" 2> "$work/l7.err" &
  pid=$!
  killed=0
  for _ in $(seq 600); do  # once r1 has printed a step, kill it
    if grep -q "^r1: committed step" "$work/l7" 2>/dev/null; then
      pkill -KILL -f -- "^$work/trainer-r1-i0" && killed=1
      break
    fi
    sleep 0.05
  done
  wait $pid; rc=$?
  [ $killed = 1 ] || fail "ft job: r1 was never seen training: $(tail -5 "$work/l7")"
  [ $rc = 0 ] || fail "ft job: exit $rc: $(tail -20 "$work/l7.err") $(tail -5 "$work/l7")"
  grep -q "replica 1 (incarnation 0) killed by SIGKILL; restarting" "$work/l7.err" || fail "ft job: no restart line: $(cat "$work/l7.err")"
  hashes=$(grep -o "finished at step .*parameters .*" "$work/l7" | sed 's/.*parameters //' | sort -u)
  [ "$(grep -c "finished at step" "$work/l7")" = 3 ] || fail "ft job: $(grep -c "finished at step" "$work/l7") trainers finished: $(tail -8 "$work/l7")"
  [ "$(wc -l <<< "$hashes")" = 1 ] || fail "ft job: parameters differ: $hashes"
  grep -q "^r1: finished.*healed [1-9]" "$work/l7" || fail "ft job: the restarted r1 did not heal: $(grep '^r1: finished' "$work/l7")"
  [ $failures = $f ] && ok "a real Manager job: the SIGKILLed replica is restarted, heals, all end bit-identical"
fi

echo "$passed passed, $failures failed"
[ $failures = 0 ]
