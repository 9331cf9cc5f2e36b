#!/usr/bin/env bash
# Builds and runs the main example: a small MLP trained data-parallel on 2 MPI ranks on localhost.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/install-deps.sh"
build="${DDP_BUILD_DIR:-$root/build/default}"
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build "$build" -j "$(nproc)" --target train_mlp
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_pml=ob1 OMPI_MCA_btl=self,vader
# ddp-run: returns when both ranks are done, even if mpiexec hangs in its teardown (docs/launching.md).
"$root/scripts/ddp-run" --mpi-flags --oversubscribe -n 2 "$build/examples/train_mlp"
