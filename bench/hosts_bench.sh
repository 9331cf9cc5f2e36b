#!/usr/bin/env bash
# Allreduce across test hosts (docs/launching.md, "Test hosts"): MPI_Allreduce, ddp::mpi and the
# node-aware path (ddp::shm::mpi::world, what ddp::world builds: shared memory within a host,
# leaders over MPI between hosts), side by side in one run per layout, through
# bench/shm_allreduce_bench. Needs root (ddp-run --hosts); prints SKIPPED otherwise.
#
#   bench/hosts_bench.sh [--build DIR] [--layouts "2x1 2x2 3x1"] [--rates "1gbit none"]
#                        [--min-bytes 1MiB] [--max-bytes 64MiB] [--reps 3]
#
# One table: per layout (hosts x ranks per host), link rate and size, each variant's time and
# its bandwidth per host link, link GB/s = bytes x 2 (h - 1) / h / time (h hosts: what each host
# sends across its link in a bandwidth-optimal allreduce among the hosts), and that as a share
# of the link rate. Timings are medians of interleaved repetitions of the slowest rank's time.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=$root/build/default layouts="2x1 2x2 3x1" rates="1gbit none" min=1MiB max=64MiB reps=3
while [ $# -gt 0 ]; do
  case "$1" in
    --build) build=$2; shift 2 ;;
    --layouts) layouts=$2; shift 2 ;;
    --rates) rates=$2; shift 2 ;;
    --min-bytes) min=$2; shift 2 ;;
    --max-bytes) max=$2; shift 2 ;;
    --reps) reps=$2; shift 2 ;;
    -h | --help) sed -n '2,/^set -uo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "hosts_bench.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done
bench=$build/bench/shm_allreduce_bench
[ -x "$bench" ] || { echo "hosts_bench.sh: $bench not built (cmake --build $build --target shm_allreduce_bench)" >&2; exit 2; }
if ! why=$("$root/scripts/ddp-hosts" check 2>&1); then
  echo "SKIPPED: $why"
  exit 0
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_pml=ob1

bits() {  # tc rate -> bits per second
  local n=${1%%[a-z]*}
  case "${1#"$n"}" in gbit) echo $((n * 1000000000)) ;; mbit) echo $((n * 1000000)) ;; *) echo 0 ;; esac
}
echo "# allreduce f32 sum in place across test hosts; load: $(cut -d' ' -f1-3 /proc/loadavg) (1/5/15 min), $(nproc) cores"
printf '%-7s %-7s %9s %11s %11s %11s %9s %9s %9s %7s\n' layout link size "mpi us" "ddp us" "world us" \
  "mpi GB/s" "ddp GB/s" "world GB/s" "world %"
for layout in $layouts; do
  h=${layout%x*} r=${layout#*x}
  for rate in $rates; do
    flag=()
    [ "$rate" != none ] && flag=(--link-rate "$rate")
    out=$("$root/scripts/ddp-run" --hosts "$h" --ranks-per-host "$r" "${flag[@]}" --timeout 600 \
      "$bench" --min-bytes "$min" --max-bytes "$max" --reps "$reps" --skip-models 2>&1) ||
      { echo "hosts_bench.sh: $layout at $rate failed:"; echo "$out" | tail -20; continue; }
    # Rows of the bandwidth table: bytes, size (two words), batch, mpi us, ddp us, shm us, ...
    echo "$out" | awk -v layout="$layout" -v rate="$rate" -v h="$h" -v link="$(bits "$rate")" '
      $1 ~ /^[0-9]+$/ && NF >= 8 {
        f = $1 * 2 * (h - 1) / h / 1e3  # bytes over each host link / 1e3: divided by us, GB/s
        share = link > 0 ? sprintf("%6.0f%%", 100 * (f / $7) * 8e9 / link) : "     -"
        printf "%-7s %-7s %9s %11.1f %11.1f %11.1f %9.3f %9.3f %9.3f %7s\n", layout, rate, $2 " " $3, $5, $6, $7,
               f / $5, f / $6, f / $7, share
      }'
  done
done
