#!/usr/bin/env bash
# Renders the benchmark plots (PNG) from the benchmarks' CSV files.
#
#   bench/plots/make_plots.sh --compare compare.csv --sweep sweep.csv \
#                             (--allreduce-bench allreduce.csv | --busbw busbw.csv) \
#                             [--out docs/img] [--subtitle "2 cores, load 2.1, 2026-11-22"]
#
# compare.csv: bench/compare_pytorch.sh --csv;  sweep.csv / busbw.csv: ddp_vs_pytorch sweep|busbw --csv;
# allreduce.csv: bench/allreduce_bench --csv (2 ranks), preferred for the bandwidth plot.
# Any input may be left out. Needs gnuplot with the pngcairo terminal.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out="$here/../../docs/img"
compare="" sweep="" busbw="" allreduce="" subtitle=""
while [ $# -gt 0 ]; do
  case "$1" in
    --compare) compare=$2; shift 2 ;;
    --sweep) sweep=$2; shift 2 ;;
    --busbw) busbw=$2; shift 2 ;;
    --allreduce-bench) allreduce=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --subtitle) subtitle=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
command -v gnuplot >/dev/null || { echo "SKIPPED: gnuplot is not installed"; exit 0; }
mkdir -p "$out"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

if [ -n "$compare" ]; then
  # One line per model: the median ms of each bar (see ddp_vs_pytorch.gp); "?" when missing.
  # The CSV quotes fields with commas, so it is read with Python's csv module.
  python3 - "$compare" > "$tmp/sync.dat" <<'PY'
import csv, sys
bars = ["pytorch/DDP sync (DDP - plain backward)", "ddp/Bucketer, README path (ddp::world)",
        "ddp/Bucketer, contiguous gradients (ddp::world)", "ddp/Bucketer (MPI)", "ddp/Bucketer zero-copy (MPI)",
        "ddp/Bucketer, contiguous gradients (MPI)", "ddp/flat allreduce (ddp shm)", "limit/memcpy of the same bytes"]
values, models = {}, []
for row in csv.DictReader(open(sys.argv[1])):
    if row["table"] != "sync":
        continue
    if row["model"] not in models:
        models.append(row["model"])
    values[row["model"], row["stack"] + "/" + row["measured"]] = row["median_ms"] or "?"
for m in models:
    print(m, " ".join(values.get((m, k), "?") for k in bars))
PY
  gnuplot -e "datafile='$tmp/sync.dat'; outfile='$out/ddp_vs_pytorch.png'; subtitle='$subtitle'" "$here/ddp_vs_pytorch.gp"
  echo "wrote $out/ddp_vs_pytorch.png"
fi
if [ -n "$sweep" ]; then
  gnuplot -e "datafile='$sweep'; outfile='$out/bucket_sweep.png'; subtitle='$subtitle'" "$here/bucket_sweep.gp"
  echo "wrote $out/bucket_sweep.png"
fi
if [ -n "$allreduce" ]; then
  # allreduce_bench columns: bytes,size,ddp path,iters,raw us,raw-nb us,ddp us,ddp/raw,ddp-raw us,raw GB/s,ddp GB/s
  # -> bytes,ddp us,ddp busbw,raw us,raw busbw,-,raw-nb busbw (2 ranks: busbw = bytes / time).
  awk -F, 'NR == 1 { print "bytes,ddp_us,ddp_busbw,mpi_us,mpi_busbw,reps,mpi_nb_busbw"; next }
           { printf "%s,%s,%.6f,%s,%.6f,%s,%.6f\n", $1, $7, $1 / $7 / 1e3, $5, $1 / $5 / 1e3, $4, $1 / $6 / 1e3 }' \
    "$allreduce" > "$tmp/busbw.csv"
  gnuplot -e "datafile='$tmp/busbw.csv'; outfile='$out/busbw.png'; subtitle='$subtitle'; has_nb=1" "$here/busbw.gp"
  echo "wrote $out/busbw.png (from allreduce_bench)"
elif [ -n "$busbw" ]; then
  gnuplot -e "datafile='$busbw'; outfile='$out/busbw.png'; subtitle='$subtitle'; has_nb=0" "$here/busbw.gp"
  echo "wrote $out/busbw.png"
fi
