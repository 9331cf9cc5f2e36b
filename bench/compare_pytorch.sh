#!/usr/bin/env bash
# ddp vs PyTorch DDP, side by side in one run (docs/benchmarks.md).
#
#   bench/compare_pytorch.sh [--rounds 3] [--models resnet50,bert_base] [--csv out.csv] [--quick] ...
#
# Finds a Python interpreter that imports torch with gloo (Debian's python3-torch imports only
# with /usr/bin/python3, not necessarily the first python3 on PATH), then runs
# bench/pytorch/compare.py with it; every option is passed on (--help lists them). Where no
# interpreter has torch it prints a SKIPPED line and exits 0. Set DDP_TORCH_PYTHON to choose the
# interpreter.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

candidates=()
[ -n "${DDP_TORCH_PYTHON:-}" ] && candidates+=("$DDP_TORCH_PYTHON")
candidates+=(/usr/bin/python3)
for name in python3 python; do
  p=$(command -v "$name" 2>/dev/null) && candidates+=("$p")
done

probe='import torch, torch.distributed as d; assert d.is_available() and d.is_gloo_available()'
for py in "${candidates[@]}"; do
  if [ -x "$py" ] && "$py" -c "$probe" >/dev/null 2>&1; then
    exec "$py" "$here/pytorch/compare.py" --torch-python "$py" "$@"
  fi
done

echo "SKIPPED: no Python interpreter here imports torch with gloo (tried: ${candidates[*]});" \
     "the PyTorch comparison needs it (Debian: apt-get install python3-torch)"
exit 0
