#!/usr/bin/env bash
# The multi-process suites under load: MPI (seed 004 included), gloo and the launcher, each test
# repeated until it fails (at most N times), while a busy loop keeps one core busy.
#
#   scripts/stress.sh [build-dir (default build/default)] [repeats (default 3)]
#
# Needs a built tree (scripts/test.sh builds one). Exits non-zero if any run of any test fails.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${1:-$root/build/default}
repeats=${2:-3}
hog_pid=""
stop_hog() { [ -n "$hog_pid" ] && kill "$hog_pid" 2>/dev/null; wait "$hog_pid" 2>/dev/null || true; }
trap stop_hog EXIT
bash -c 'while :; do :; done' &
hog_pid=$!
start=$(date +%s)
echo "stress: $repeats repeats of the mpi, gloo and launcher tests beside a busy loop (pid $hog_pid);" \
     "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
# One at a time: MPI runs already oversubscribe the 2 cores.
ctest --test-dir "$build" --output-on-failure -L 'mpi|gloo|launcher' --repeat "until-fail:$repeats"
echo "stress: passed in $(( $(date +%s) - start )) s; load after: $(cut -d' ' -f1-3 /proc/loadavg)"
