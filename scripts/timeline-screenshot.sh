#!/usr/bin/env bash
# Renders the timeline of examples/train_mlp (2 MPI ranks, rank 1 made a straggler with
# --slow-rank 1) to a PNG with headless Chromium: docs/img/timeline.png (docs/observability.md).
#
#   scripts/timeline-screenshot.sh [out.png]     (DDP_BUILD_DIR: build dir with train_mlp and ddp-trace-merge)
#
# The window shown is the last two steps of rank 0. The HTML view (tools/trace_view.html with the
# trace embedded) needs no network; the merged JSON opens in https://ui.perfetto.dev as well.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build="${DDP_BUILD_DIR:-$root/build/default}"
out=$(realpath -m "${1:-$root/docs/img/timeline.png}")
command -v chromium >/dev/null || { echo "timeline-screenshot.sh: chromium is not installed (Debian: apt-get install chromium)" >&2; exit 2; }
cmake --build "$build" --target train_mlp ddp-trace-merge >/dev/null
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_pml=ob1 OMPI_MCA_btl=self,vader
"$root/scripts/ddp-run" --mpi-flags --oversubscribe -n 2 "$build/examples/train_mlp" --trace "$dir" --slow-rank 1 \
  | grep -E "last step: step|timeline:"
"$build/tools/ddp-trace-merge" -o "$dir/merged.json" --html "$dir/view.html" "$dir/trace.0.json" "$dir/trace.1.json"
window=$(python3 - "$dir/merged.json" <<'PY'
import json, sys
steps = sorted((e for e in json.load(open(sys.argv[1]))["traceEvents"] if e["name"] == "step" and e["pid"] == 0),
               key=lambda e: e["ts"])[-2:]
a, b = steps[0]["ts"], steps[-1]["ts"] + steps[-1]["dur"]
pad = (b - a) * 0.03
print("%.3f,%.3f" % ((a - pad) / 1000, (b + pad) / 1000))
PY
)
chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1600,560 \
  --screenshot="$out" "file://$dir/view.html#$window" 2>/dev/null | grep -v '^$' || true
test -s "$out"
echo "timeline-screenshot.sh: $out (window $window ms)"
