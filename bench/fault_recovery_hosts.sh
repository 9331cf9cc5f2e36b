#!/usr/bin/env bash
# Fault to full speed across test hosts (issue #28; docs/launching.md, "Test hosts"):
# bench/fault_recovery_bench with one replica per host and each host's link capped, for every host
# count and link rate asked. A replica is killed with SIGKILL mid-step and restarted at once on
# the same host; the bench prints, per run, the time until the job commits at full speed again and
# until the restarted replica took part in a commit, against 2 s + state bytes / heal bandwidth.
# Needs root (ddp-run --hosts); prints SKIPPED otherwise.
#
#   bench/fault_recovery_hosts.sh [--build DIR] [--hosts "2 3"] [--rates "1gbit"] [--timeout S]
#                                 [-- BENCH OPTIONS...]
#
# Options after `--` go to the bench (`-- --state-mib 64,256 --presets default,tuned --reps 2`).
# The hosts are made for each run and removed when it ends (ddp-run), also when this script is
# interrupted or killed with SIGTERM; `scripts/ddp-hosts list` shows none afterwards.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=$root/build/default host_counts="2 3" rates="1gbit" timeout=900
while [ $# -gt 0 ]; do
  case "$1" in
    --build) build=$2; shift 2 ;;
    --hosts) host_counts=$2; shift 2 ;;
    --rates) rates=$2; shift 2 ;;
    --timeout) timeout=$2; shift 2 ;;
    --) shift; break ;;
    -h | --help) sed -n '2,/^set -uo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "fault_recovery_hosts.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done
bench=$build/bench/fault_recovery_bench
[ -x "$bench" ] || { echo "fault_recovery_hosts.sh: $bench not built (cmake --build $build --target fault_recovery_bench)" >&2; exit 2; }
if ! why=$("$root/scripts/ddp-hosts" check 2>&1); then
  echo "SKIPPED: $why"
  exit 0
fi

child=""
# ddp-run removes its hosts (and every process on them) when it gets a signal: pass ours on and
# wait for it to finish.
# shellcheck disable=SC2317  # reached through the trap
stop() {
  if [ -n "$child" ]; then
    kill -TERM "$child" 2>/dev/null
    wait "$child"
  fi
  exit 130
}
trap stop INT TERM HUP

echo "# fault recovery across test hosts, one replica per host; load: $(cut -d' ' -f1-3 /proc/loadavg) (1/5/15 min), $(nproc) cores"
failed=0
for h in $host_counts; do
  for rate in $rates; do
    flag=()
    [ "$rate" != none ] && flag=(--link-rate "$rate")
    echo
    echo "## $h hosts, link $rate"
    "$root/scripts/ddp-run" --hosts "$h" --hosts-only "${flag[@]}" --timeout "$timeout" \
      "$bench" --on-hosts --replicas "$h" "$@" &
    child=$!
    wait "$child"
    rc=$?
    child=""
    if [ "$rc" -ne 0 ]; then
      echo "fault_recovery_hosts.sh: $h hosts at $rate failed (exit $rc)"
      failed=1
    fi
  done
done
echo
echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"
exit "$failed"
