#!/usr/bin/env bash
# The multi-process suites under load: MPI (the early-leaver cases, seed004, included), gloo and the launcher, each test
# repeated until it fails (at most N times), while a busy process keeps one core busy.
#
#   scripts/stress.sh [build-dir (default build/default)] [repeats (default 3)]
#
# DDP_STRESS_HOG_FIRST="command": the busy process runs this single-threaded command first (CI: the
# fuzzers, scripts/fuzz.sh --no-build), then a busy loop until the tests end; the run fails if the
# command failed. Its output goes to <build-dir>/stress-hog.log, printed at the end.
# DDP_STRESS_HOG_THEN="command": runs after that command instead of the busy loop (CI: the next
# stages' builds with one job), is stopped (SIGTERM) when the tests end, and its outcome is not
# judged: whoever needs its work finishes it. The busy loop takes over if it ends first. Its output
# goes to <build-dir>/stress-hog-then.log.
#
# DDP_STRESS_ONCE="regex": the tests whose names match run once, beside the same busy process,
# after the repeated ones (CI: the seed004 reproductions, the examples and the benchmarks' smoke
# runs, whose code the repeated suites already cover).
#
# Needs a built tree (scripts/test.sh builds one). Exits non-zero if any run of any test fails.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${1:-$root/build/default}
repeats=${2:-3}
hog_first=${DDP_STRESS_HOG_FIRST:-}
hog_then=${DDP_STRESS_HOG_THEN:-}
hog_log="$build/stress-hog.log"
hog_then_log="$build/stress-hog-then.log"
hog_status="$build/stress-hog.status"
rm -f "$hog_log" "$hog_status" "$hog_then_log"
hog_pid=""
# Stops the whole group and waits until every process of it is gone: a build stopped here must
# have removed its half-written outputs before anyone builds in that tree again.
stop_hog() {
  [ -n "$hog_pid" ] || return 0
  kill -- -"$hog_pid" 2>/dev/null || true
  wait "$hog_pid" 2>/dev/null || true
  while kill -0 -- -"$hog_pid" 2>/dev/null; do sleep 0.2; done
  hog_pid=""
}
trap stop_hog EXIT
# Its own process group (set -m), so that stopping it stops the command it runs too.
set -m
HOG_FIRST="$hog_first" HOG_LOG="$hog_log" HOG_STATUS="$hog_status" \
HOG_THEN="$hog_then" HOG_THEN_LOG="$hog_then_log" bash -c '
  if [ -n "$HOG_FIRST" ]; then
    rc=0
    bash -c "$HOG_FIRST" >"$HOG_LOG" 2>&1 || rc=$?
    echo "$rc" >"$HOG_STATUS"
  fi
  if [ -n "$HOG_THEN" ]; then
    bash -c "$HOG_THEN" >"$HOG_THEN_LOG" 2>&1 || true
  fi
  while :; do :; done' &
hog_pid=$!
set +m
start=$(date +%s)
echo "stress: $repeats repeats of the mpi, gloo and launcher tests beside a busy process (pid $hog_pid${hog_first:+, first: $hog_first}${hog_then:+, then: $hog_then});" \
     "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
# One at a time: MPI runs already oversubscribe the 2 cores.
once=${DDP_STRESS_ONCE:-}
if [ -n "$once" ]; then
  ctest --test-dir "$build" --output-on-failure -L 'mpi|gloo|launcher' -E "$once" --repeat "until-fail:$repeats"
  echo "stress: the repeated tests passed in $(( $(date +%s) - start )) s; now once each: $once"
  ctest --test-dir "$build" --output-on-failure -L 'mpi|gloo|launcher' -R "$once"
else
  ctest --test-dir "$build" --output-on-failure -L 'mpi|gloo|launcher' --repeat "until-fail:$repeats"
fi
echo "stress: passed in $(( $(date +%s) - start )) s; load after: $(cut -d' ' -f1-3 /proc/loadavg)"
if [ -n "$hog_first" ]; then
  if [ ! -f "$hog_status" ]; then
    # The tests ended first: let the command finish (the busy loop has not started yet).
    while [ ! -f "$hog_status" ] && kill -0 "$hog_pid" 2>/dev/null; do sleep 1; done
  fi
  cat "$hog_log"
  rc=$(cat "$hog_status" 2>/dev/null || echo "missing")
  if [ "$rc" != 0 ]; then
    echo "stress: the busy process's command failed (exit $rc): $hog_first" >&2
    exit 1
  fi
fi
if [ -n "$hog_then" ]; then
  stop_hog
  echo "stress: the busy process's second command was stopped with the tests; its last lines:"
  tail -n 3 "$hog_then_log" 2>/dev/null || true
fi
