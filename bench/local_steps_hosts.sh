#!/usr/bin/env bash
# Time to a target loss across test hosts with a capped link (issue #29; docs/launching.md, "Test
# hosts"): bench/local_steps_bench trains the same model with synchronous data parallelism,
# LocalSGD, DiLoCo and Streaming DiLoCo, one mode after another in one run, with one rank per
# host, for every host count and link rate asked. Needs root (ddp-run --hosts); prints SKIPPED
# otherwise.
#
#   bench/local_steps_hosts.sh [--build DIR] [--hosts "2 3"] [--rates "1gbit 100mbit"]
#                              [--timeout S] [-- BENCH OPTIONS...]
#
# Prints each run's table (steps and training seconds to the target, bytes, time / sync, and the
# cost model's step time for the measured compute and the rate), then a summary: per host count
# and rate, each mode's seconds to the target and its share of sync's. Options after `--` go to
# the bench (`-- --comm mpi`, `-- --sync-every 60`).
# The hosts are made for each run and removed when it ends (ddp-run), also when this script is
# interrupted or killed with SIGTERM; `scripts/ddp-hosts list` shows none afterwards.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=$root/build/default host_counts="2" rates="1gbit 100mbit" timeout=900
while [ $# -gt 0 ]; do
  case "$1" in
    --build) build=$2; shift 2 ;;
    --hosts) host_counts=$2; shift 2 ;;
    --rates) rates=$2; shift 2 ;;
    --timeout) timeout=$2; shift 2 ;;
    --) shift; break ;;
    -h | --help) sed -n '2,/^set -uo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "local_steps_hosts.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done
bench=$build/bench/local_steps_bench
[ -x "$bench" ] || { echo "local_steps_hosts.sh: $bench not built (cmake --build $build --target local_steps_bench)" >&2; exit 2; }
if ! why=$("$root/scripts/ddp-hosts" check 2>&1); then
  echo "SKIPPED: $why"
  exit 0
fi
gbit() {  # tc rate -> Gbit/s, for the cost model's column
  local n=${1%%[a-z]*}
  case "${1#"$n"}" in gbit) echo "$n" ;; mbit) awk -v n="$n" 'BEGIN { print n / 1000 }' ;; *) echo 0 ;; esac
}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_pml=ob1

out=$(mktemp) summary=$(mktemp) child=""
# ddp-run removes its hosts when it gets a signal: pass ours on and wait for it to finish.
# shellcheck disable=SC2317  # reached through the trap
stop() {
  if [ -n "$child" ]; then
    kill -TERM "$child" 2>/dev/null
    wait "$child"
  fi
  rm -f "$out" "$summary"
  exit 130
}
trap stop INT TERM HUP
trap 'rm -f "$out" "$summary"' EXIT

echo "# local steps across test hosts, one rank per host; load: $(cut -d' ' -f1-3 /proc/loadavg) (1/5/15 min), $(nproc) cores"
failed=0
for h in $host_counts; do
  for rate in $rates; do
    flag=() model=()
    [ "$rate" != none ] && flag=(--link-rate "$rate") && model=(--link-gbit "$(gbit "$rate")")
    echo
    echo "## $h hosts, link $rate"
    "$root/scripts/ddp-run" --hosts "$h" --ranks-per-host 1 "${flag[@]}" --timeout "$timeout" "$bench" "${model[@]}" "$@" >"$out" 2>&1 &
    child=$!
    wait "$child"
    rc=$?
    child=""
    cat "$out"
    if [ "$rc" -ne 0 ]; then
      echo "local_steps_hosts.sh: $h hosts at $rate failed (exit $rc)"
      failed=1
      continue
    fi
    # Table rows: mode reached steps loss seconds ms/step compute-ms model-ms collectives payload sent
    # link-tx time/sync.
    awk -v h="$h" -v rate="$rate" '$1 ~ /^(sync|localsgd|diloco|streaming)$/ && NF == 13 {
      printf "%-5s %-8s %-10s %-7s %6s %8s %8s %8s %9s %9s\n", h, rate, $1, $2, $3, $5, $6, $8, $11, $13 }' "$out" >>"$summary"
  done
done
echo
echo "# summary: seconds to the target (training steps, slowest rank) and their share of sync's"
printf '%-5s %-8s %-10s %-7s %6s %8s %8s %8s %9s %9s\n' hosts link mode reached steps seconds ms/step \
  "model ms" "sent MB" time/sync
cat "$summary"
exit "$failed"
