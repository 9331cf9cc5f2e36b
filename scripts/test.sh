#!/usr/bin/env bash
# The whole test suite in one command: installs missing Debian packages, configures, builds
# everything (library checks, tests, examples, benchmarks) and runs every ctest test, MPI runs with
# 1-4 ranks included.
#
#   scripts/test.sh [--multi-process-in-stress] [cmake configure arguments...]
#
# --multi-process-in-stress: run the single-process tests (and, once, beside them, the jobs across
# test hosts, label hosts) here and leave the multi-process ones (labels mpi, gloo, launcher) to
# scripts/stress.sh, which runs each of them three times beside a busy core. CI does this (.ci/run), so no multi-process test runs a fourth, quiet time there.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
multi_process=here
if [ "${1:-}" = "--multi-process-in-stress" ]; then
  multi_process=stress
  shift
fi
"$root/scripts/install-deps.sh"
build="${DDP_BUILD_DIR:-$root/build/default}"
# Ninja for a new build tree (it keeps both cores busier than make); an existing tree keeps its own.
generator=()
[ -f "$build/CMakeCache.txt" ] || ! command -v ninja > /dev/null || generator=(-G Ninja)
cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_EXPORT_COMPILE_COMMANDS=ON "$@"
build_start=$(date +%s)
cmake --build "$build" -j "$(nproc)"
echo "test.sh: the build took $(($(date +%s) - build_start)) s on $(nproc) cores"
# MPI tests (and jobs across test hosts, label hosts: docs/launching.md) oversubscribe 2 cores
# already: run them one at a time, the rest in parallel.
if [ "$multi_process" = stress ]; then
  # The jobs across test hosts mostly wait on their rate-limited links: they run (one at a time)
  # beside the single-process tests, their output printed after them.
  hosts_log="$build/hosts-tests.log"
  ctest --test-dir "$build" --output-on-failure -L hosts > "$hosts_log" 2>&1 &
  hosts_pid=$!
  single=0
  ctest --test-dir "$build" --output-on-failure -j "$(nproc)" -LE 'mpi|gloo|launcher|hosts' || single=$?
  hosts=0
  wait "$hosts_pid" || hosts=$?
  cat "$hosts_log"
  [ "$single" = 0 ] || { echo "test.sh: single-process tests failed" >&2; exit "$single"; }
  [ "$hosts" = 0 ] || { echo "test.sh: jobs across test hosts failed" >&2; exit "$hosts"; }
  exit 0
fi
ctest --test-dir "$build" --output-on-failure -j "$(nproc)" -LE 'mpi|hosts'
ctest --test-dir "$build" --output-on-failure -L 'mpi|hosts'
