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
# A second table holds the alpha-beta model (include/ddp/allreduce_model.hpp) against the world
# column: the network's latency and bandwidth fitted from the 2x1 rows of each capped rate, the
# ring across hosts (plus the model's shared-memory terms with 2 ranks per host) predicted for
# every row.
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
# The model's ring across h hosts, with the shared-memory terms of r ranks per host, fitted from
# the 2x1 rows of each capped rate (rows: layout rate bytes world_us).
fit_model() {
  python3 - "$1" <<'PY'
import math, sys
rows = [l.split() for l in open(sys.argv[1]) if l.strip()]
gamma, seg = 1 / 8000.0, 4 << 20                # the model's defaults: reduce 8 GB/s, 4 MiB ring segments
node_a, node_b = 0.5, 1 / 10000.0                # shared memory inside a host: 0.5 us, 10 GB/s
def segs(b, p): return max(1, math.ceil(b / p / seg))
def ring(b, p, a, beta): return 2 * (p - 1) * segs(b, p) * a + 2 * (p - 1) / p * b * beta + (p - 1) / p * b * gamma
print("\n# the alpha-beta model against the world column (fitted per link rate from the 2x1 rows)")
print("%-7s %-7s %9s %12s %12s %9s" % ("layout", "link", "MiB", "world us", "model us", "model/meas"))
for rate in sorted({r[1] for r in rows if r[1] != "none"}):
    fit = [(float(r[2]), float(r[3])) for r in rows if r[0] == "2x1" and r[1] == rate]
    if len(fit) < 2: continue
    # least squares of t - b/2 gamma = (2 segs) alpha + b beta
    xs = [(2 * segs(b, 2), b, t - b / 2 * gamma) for b, t in fit]
    s11 = sum(x * x for x, _, _ in xs); s12 = sum(x * y for x, y, _ in xs); s22 = sum(y * y for _, y, _ in xs)
    t1 = sum(x * t for x, _, t in xs); t2 = sum(y * t for _, y, t in xs)
    det = s11 * s22 - s12 * s12
    a = (t1 * s22 - t2 * s12) / det; beta = (s11 * t2 - s12 * t1) / det
    if a < 0:  # tbf's burst lets a small message through faster than the rate: no latency to fit
        a, beta = 0.0, t2 / s22
    print("# %s: alpha %.1f us, bandwidth %.1f MB/s" % (rate, a, 1 / beta))
    for r in rows:
        if r[1] != rate: continue
        h, q = map(int, r[0].split("x")); b, t = float(r[2]), float(r[3])
        m = ring(b, h, a, beta)
        if q > 1: m += 3 * node_a + 3 * b * node_b + (q - 1) / q * b * gamma
        print("%-7s %-7s %9.0f %12.1f %12.1f %9.2f" % (r[0], rate, b / 2**20, t, m, m / t))
PY
}
raw=$(mktemp)
trap 'rm -f "$raw"' EXIT

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
        printf "%s %s %s %s\n", layout, rate, $1, $7 > "/dev/stderr"
      }' 2>>"$raw"
  done
done
fit_model "$raw"
