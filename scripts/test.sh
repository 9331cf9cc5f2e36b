#!/usr/bin/env bash
# The whole test suite in one command: installs missing Debian packages, configures, builds
# everything (library checks, tests, examples, benchmarks) and runs every ctest test, MPI runs with
# 1-4 ranks included.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/install-deps.sh"
build="${DDP_BUILD_DIR:-$root/build/default}"
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@"
cmake --build "$build" -j "$(nproc)"
# MPI tests oversubscribe 2 cores already: run them one at a time, the rest in parallel.
ctest --test-dir "$build" --output-on-failure -j "$(nproc)" -LE mpi
ctest --test-dir "$build" --output-on-failure -L mpi
