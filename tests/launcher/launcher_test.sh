#!/usr/bin/env bash
# Tests of scripts/ddp-run against a stand-in mpiexec (fake_mpiexec.sh) that reproduces Open MPI
# 4.1's teardown hang: the launcher must return the ranks' result soon after the last rank
# exits, kill the stuck mpiexec, and leave no process behind.
# Usage: launcher_test.sh <path to ddp-run>
set -u
run=$1
here=$(cd "$(dirname "$0")" && pwd)
fake=$here/fake_mpiexec.sh
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
ok() { echo "ok: $*"; }
ms() { echo $(( $(date +%s%N) / 1000000 )); }

cat > "$work/rank.sh" <<'R'
#!/usr/bin/env bash
echo "rank $OMPI_COMM_WORLD_RANK says hello"
[ "$OMPI_COMM_WORLD_RANK" = "${FAIL_RANK:--1}" ] && { echo "rank $OMPI_COMM_WORLD_RANK: failing" >&2; exit 3; }
[ "$OMPI_COMM_WORLD_RANK" = "${SLEEP_RANK:--1}" ] && exec sleep 300
exit 0
R
chmod +x "$work/rank.sh"

# 1. mpiexec hangs after every rank exited 0: result 0, within the grace period plus slack.
t0=$(ms)
out=$(FAKE_MPIEXEC_HANG=1 "$run" --grace 1 --mpiexec "$fake" -n 3 "$work/rank.sh" 2>&1); rc=$?
dt=$(( $(ms) - t0 ))
[ $rc = 0 ] || fail "hang, all ranks 0: exit $rc, expected 0: $out"
[ $dt -lt 15000 ] || fail "hang, all ranks 0: took $dt ms"
grep -q "rank 2 says hello" <<< "$out" || fail "hang: rank output missing: $out"
grep -q "teardown hang" <<< "$out" || fail "hang: no explanation printed: $out"
ok "mpiexec teardown hang, ranks passed: exit $rc after $dt ms"

# 2. The same with a failing rank: its status comes back, its message was printed.
out=$(FAKE_MPIEXEC_HANG=1 FAIL_RANK=1 "$run" --grace 1 --mpiexec "$fake" -n 3 "$work/rank.sh" 2>&1); rc=$?
[ $rc = 3 ] || fail "hang, rank 1 fails: exit $rc, expected 3: $out"
grep -q "rank 1: failing" <<< "$out" || fail "hang, rank 1 fails: its message is missing: $out"
grep -q "rank 1 exited with status 3" <<< "$out" || fail "no summary naming rank 1: $out"
ok "mpiexec teardown hang, rank 1 failed: exit $rc"

# 3. A well-behaved mpiexec: its ranks' status, no grace wait.
t0=$(ms)
FAIL_RANK=0 "$run" --grace 30 --mpiexec "$fake" -n 2 "$work/rank.sh" > /dev/null 2>&1; rc=$?
dt=$(( $(ms) - t0 ))
[ $rc = 3 ] || fail "normal exit, rank 0 fails: exit $rc, expected 3"
[ $dt -lt 10000 ] || fail "normal exit waited for the grace period: $dt ms"
ok "normal mpiexec exit: exit $rc after $dt ms"

# 4. --timeout: a rank that never ends; exit 124, nothing left running.
marker="ddp-run-test-$$"
cp "$work/rank.sh" "$work/$marker.sh"
t0=$(ms)
out=$(SLEEP_RANK=1 "$run" --timeout 2 --mpiexec "$fake" -n 2 "$work/$marker.sh" 2>&1); rc=$?
dt=$(( $(ms) - t0 ))
[ $rc = 124 ] || fail "timeout: exit $rc, expected 124: $out"
grep -q "ranks still running: 1" <<< "$out" || fail "timeout: the running rank is not named: $out"
sleep 0.5
left=$(pgrep -f "$marker" | wc -l)
[ "$left" = 0 ] || fail "timeout: $left processes left running"
[ $dt -lt 12000 ] || fail "timeout of 2 s took $dt ms"
ok "timeout: exit $rc after $dt ms, $left processes left"

# 5. A program that cannot be started: non-zero, with a message.
out=$("$run" --mpiexec "$fake" -n 2 "$work/does-not-exist" 2>&1); rc=$?
[ $rc != 0 ] || fail "missing program: exit 0"
grep -q "cannot execute" <<< "$out" || fail "missing program: no message: $out"
ok "missing program: exit $rc"

# 6. Usage errors.
"$run" -n 2 > /dev/null 2>&1; rc=$?
[ $rc = 2 ] || fail "no program: exit $rc, expected 2"
ok "usage error: exit $rc"

# 7. A deadline longer than 2^31 ns must not fire early (a 32-bit conversion once cut 25 s to 2.1 s).
cat > "$work/slow.sh" <<'R'
#!/usr/bin/env bash
sleep 3
R
chmod +x "$work/slow.sh"
t0=$(ms)
"$run" --timeout 20 --mpiexec "$fake" -n 2 "$work/slow.sh" > /dev/null 2>&1; rc=$?
dt=$(( $(ms) - t0 ))
[ $rc = 0 ] || fail "3 s ranks under a 20 s deadline: exit $rc, expected 0 (after $dt ms)"
ok "long deadline respected: exit $rc after $dt ms"

echo "$(( 7 - failures )) passed, $failures failed"
[ $failures = 0 ]
