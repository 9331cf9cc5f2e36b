#!/usr/bin/env bash
# A stand-in for mpiexec with Open MPI 4.1's teardown hang: starts `-n N` copies of the command
# with OMPI_COMM_WORLD_RANK set, waits for them, then (FAKE_MPIEXEC_HANG=1) ignores SIGTERM and
# never exits, as the real one did in PMIx_server_finalize.
set -u
[ "$1" = "-n" ] || { echo "fake_mpiexec: -n N first" >&2; exit 2; }
np=$2
shift 2
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done  # drop flags such as --oversubscribe
pids=()
for ((r = 0; r < np; r++)); do
  OMPI_COMM_WORLD_RANK=$r "$@" &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
if [ "${FAKE_MPIEXEC_HANG:-0}" = 1 ]; then
  trap '' TERM INT HUP
  while :; do sleep 1; done
fi
exit "$rc"
