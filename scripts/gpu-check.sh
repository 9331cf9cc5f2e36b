#!/usr/bin/env bash
# Builds and runs ddp's GPU tests on a machine with CUDA, CMake and NCCL, and writes a report:
# date, commit, GPU, driver, CUDA and NCCL versions, each test's result, the device-copy bandwidth
# of ddp::cuda::runtime::copy against cudaMemcpyAsync, and cuda_trainer's convergence.
#
#   scripts/gpu-check.sh [--no-gpu-ok] [--build-dir DIR] [--output FILE] [--jobs N]
#
# Needs no MPI, no Catch2 (tests/CMakeLists.txt falls back to third_party/catch2) and no network.
# NCCL: $NCCL_ROOT if set, else a system install (nccl.h beside CUDA or in /usr), else the one of
# Python's nvidia-nccl wheel (what PyTorch ships). A single GPU runs NCCL at world size 1.
#
# Builds only the programs of the tests labelled gpu, nccl or device (tests/gpu, tests/nccl,
# tests/device, ..., examples/cuda_trainer) in build/gpu, runs `ctest -L 'gpu|nccl|device'` and
# cuda_trainer without compression and with fp16 and bf16 compression.
#
# Report: $OUT/gpu-validation.md when OUT is set (the device tool's output folder), else
# docs/gpu-validation.md on a GPU machine, else build/gpu/gpu-validation.md (a run without a
# GPU never overwrites the docs); --output FILE overrides. The log of every step lands beside it
# (gpu-check.log). The commit is read from git, or from $GPU_CHECK_COMMIT where the working tree
# has no git metadata. Extra configure arguments: $GPU_CHECK_CMAKE_ARGS (split on spaces), e.g.
# "-DCMAKE_CUDA_ARCHITECTURES=90" for a faster build on an H100.
#
# Without a GPU the script stops (exit 2) unless --no-gpu-ok: then it still configures, builds
# and runs everything (the GPU tests skip) and reports "no GPU: skipped".
# Exit status: 0 all passed (or skipped without a GPU), 1 a test failed, 2 setup failed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$(pwd)

no_gpu_ok=0
build_dir=build/gpu
output=""
jobs=$(nproc 2>/dev/null || echo 4)
while [ $# -gt 0 ]; do
  case "$1" in
    --no-gpu-ok) no_gpu_ok=1 ;;
    --build-dir) build_dir=$2; shift ;;
    --output) output=$2; shift ;;
    --jobs) jobs=$2; shift ;;
    -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
    *) echo "gpu-check: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done

say() { printf 'gpu-check: %s\n' "$*"; }
die() { printf 'gpu-check: error: %s\n' "$*" >&2; exit 2; }
started=$(date +%s)

# ---- the GPU ---------------------------------------------------------------------------------
gpu_name="none" driver="n/a" gpu_count=0 gpu_memory="n/a"
smi=$(command -v nvidia-smi || true)
for candidate in /usr/local/nvidia/bin/nvidia-smi /usr/bin/nvidia-smi; do
  if [ -z "$smi" ] && [ -x "$candidate" ]; then smi=$candidate; fi
done
if [ -n "$smi" ] && "$smi" -L >/dev/null 2>&1; then
  gpu_count=$("$smi" -L | grep -c '^GPU ' || true)
  if [ "$gpu_count" -gt 0 ]; then
    IFS=',' read -r gpu_name driver gpu_memory < <("$smi" --query-gpu=name,driver_version,memory.total \
      --format=csv,noheader | head -n 1)
    gpu_name=$(echo "$gpu_name" | xargs); driver=$(echo "$driver" | xargs); gpu_memory=$(echo "$gpu_memory" | xargs)
  fi
elif [ -e /dev/nvidiactl ] && [ -e /dev/nvidia0 ]; then
  gpu_count=$(ls /dev/nvidia[0-9]* 2>/dev/null | wc -l)
  gpu_name="unknown (no nvidia-smi; see gpu.device_paths' output)"
  driver=$(sed -n 's/.*Kernel Module *\([0-9.]*\).*/\1/p' /proc/driver/nvidia/version 2>/dev/null | head -n 1)
  driver=${driver:-unknown}
fi
have_gpu=0
[ "$gpu_count" -gt 0 ] && have_gpu=1
if [ $have_gpu = 1 ]; then
  say "GPU: $gpu_count x $gpu_name ($gpu_memory), driver $driver"
elif [ $no_gpu_ok = 1 ]; then
  say "no GPU (nvidia-smi finds none): building and running anyway, the GPU tests will skip (--no-gpu-ok)"
else
  die "no GPU found (nvidia-smi -L lists none). Run on a GPU machine, or pass --no-gpu-ok to build and run without one."
fi

# Where the report and the log go.
if [ -z "$output" ]; then
  if [ -n "${OUT:-}" ]; then
    output="$OUT/gpu-validation.md"
  elif [ $have_gpu = 1 ]; then
    output="docs/gpu-validation.md"
  else
    output="$build_dir/gpu-validation.md"
  fi
fi
mkdir -p "$(dirname "$output")" "$build_dir"
log="$(dirname "$output")/gpu-check.log"
: > "$log"
say "report: $output; log: $log"
# Runs a step with its output in the log (and on the terminal); returns the step's status.
step() { say "$*"; echo "== $*" >> "$log"; "$@" 2>&1 | tee -a "$log"; }

# ---- CUDA and NCCL ---------------------------------------------------------------------------
if ! command -v nvcc >/dev/null 2>&1; then
  for d in "${CUDA_HOME:-}" /usr/local/cuda /opt/cuda; do
    if [ -n "$d" ] && [ -x "$d/bin/nvcc" ]; then export PATH="$d/bin:$PATH"; break; fi
  done
fi
command -v nvcc >/dev/null 2>&1 || die "nvcc not found (put the CUDA toolkit's bin/ on PATH or set CUDA_HOME)"
command -v cmake >/dev/null 2>&1 || die "cmake not found"
nvcc_version=$(nvcc --version | sed -n 's/.*release \([0-9.]*\), V\([0-9.]*\).*/\2/p')
cuda_prefix=$(cd "$(dirname "$(command -v nvcc)")/.." && pwd)
say "nvcc $nvcc_version ($cuda_prefix)"

nccl_args=()
nccl_source=""
if [ -n "${NCCL_ROOT:-}" ]; then
  nccl_source="NCCL_ROOT=$NCCL_ROOT"
  nccl_args+=("-DNCCL_ROOT=$NCCL_ROOT")
else
  for inc in "$cuda_prefix/include" /usr/include /usr/local/include; do
    if [ -f "$inc/nccl.h" ]; then nccl_source="system ($inc/nccl.h)"; break; fi
  done
  if [ -z "$nccl_source" ] && command -v python3 >/dev/null 2>&1; then
    # nvidia is a namespace package: search all of its folders for the header and the library.
    wheel=$(python3 - <<'EOF' 2>/dev/null || true
import os
try:
    import nvidia
except Exception:
    raise SystemExit(0)
header = library = None
for base in list(getattr(nvidia, "__path__", [])):
    for dirpath, _, files in os.walk(base):
        if header is None and "nccl.h" in files and "nccl" in dirpath:
            header = dirpath
        if library is None and "libnccl.so.2" in files:
            library = os.path.join(dirpath, "libnccl.so.2")
if header and library:
    print(header)
    print(library)
EOF
    )
    if [ -n "$wheel" ]; then
      wheel_include=$(echo "$wheel" | sed -n 1p)
      wheel_library=$(echo "$wheel" | sed -n 2p)
      nccl_source="Python wheel nvidia-nccl ($wheel_library)"
      nccl_args+=("-DNCCL_INCLUDE_DIR=$wheel_include" "-DNCCL_LIBRARY=$wheel_library")
      export LD_LIBRARY_PATH="$(dirname "$wheel_library")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
  fi
fi
[ -n "$nccl_source" ] || die "NCCL not found: no nccl.h beside CUDA or in /usr, no Python nvidia-nccl wheel; set NCCL_ROOT"
say "NCCL: $nccl_source"

# ---- libcrypto and xxhash.h (ddp::ddp needs both) ----------------------------------------------
# A bare CUDA image may lack their headers and has no network: scripts/gpu-deps.sh packs them
# into build/gpu-deps on the development machine; carry that path here.
dep_args=()
if [ -d "$root/build/gpu-deps" ]; then
  dep_args+=("-DOPENSSL_ROOT_DIR=$root/build/gpu-deps" "-DOPENSSL_USE_STATIC_LIBS=OFF"
    "-DDDP_XXHASH_INCLUDE_DIR=$root/build/gpu-deps/include")
  export LD_LIBRARY_PATH="$root/build/gpu-deps/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  say "libcrypto and xxhash.h: carried (build/gpu-deps)"
elif [ ! -f /usr/include/openssl/evp.h ] || [ ! -f /usr/include/xxhash.h ]; then
  say "no OpenSSL headers or xxhash.h here: run scripts/gpu-deps.sh on the development machine and carry build/gpu-deps"
fi

# gloo, for the replica processes of gpu.staged_replicas: installed here, or carried in build/gpu-deps.
gloo_args=(-DDDP_ENABLE_GLOO=OFF)
if [ -f "$root/build/gpu-deps/include/gloo/allreduce.h" ] && [ -e "$root/build/gpu-deps/lib/libgloo.so" ]; then
  gloo_args=(-DDDP_ENABLE_GLOO=ON "-DDDP_GLOO_INCLUDE_DIR=$root/build/gpu-deps/include"
    "-DDDP_GLOO_LIBRARY=$root/build/gpu-deps/lib/libgloo.so")
  say "gloo: carried (build/gpu-deps)"
elif [ -f /usr/include/gloo/allreduce.h ]; then
  gloo_args=(-DDDP_ENABLE_GLOO=ON)
  say "gloo: installed"
else
  say "no gloo: gpu.staged_replicas is not built (scripts/gpu-deps.sh packs gloo where it is installed)"
fi

# ---- configure and build ---------------------------------------------------------------------
generator=()
if command -v ninja >/dev/null 2>&1 && [ ! -f "$build_dir/CMakeCache.txt" ]; then generator=(-G Ninja); fi
step cmake -S . -B "$build_dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DDDP_ENABLE_MPI=OFF "${gloo_args[@]}" -DDDP_ENABLE_TORCH=OFF -DDDP_ENABLE_EIGEN=OFF \
  -DDDP_BUILD_TESTS=ON -DDDP_BUILD_EXAMPLES=ON -DDDP_BUILD_BENCH=OFF -DDDP_INSTALL=OFF \
  -DDDP_NCCL_GPU_TESTS=ON "${nccl_args[@]}" "${dep_args[@]}" ${GPU_CHECK_CMAKE_ARGS:-} || die "cmake configure failed (see $log)"
cache="$build_dir/CMakeCache.txt"
cache_value() { sed -n "s/^$1:[A-Z]*=//p" "$cache" | head -n 1; }
grep -q '^CMAKE_CUDA_COMPILER:.*nvcc' "$cache" || die "CMake did not enable CUDA (see $log)"
[ -n "$(cache_value NCCL_LIBRARY)" ] && [ "$(cache_value NCCL_LIBRARY)" != "NCCL_LIBRARY-NOTFOUND" ] ||
  die "CMake did not find NCCL (see $log)"
nccl_header="$(cache_value NCCL_INCLUDE_DIR)/nccl.h"
nccl_header_version=$(sed -n 's/^#define NCCL_\(MAJOR\|MINOR\|PATCH\) *\([0-9]*\).*/\2/p' "$nccl_header" 2>/dev/null |
  paste -sd. - || true)

# The executables of the tests to run (label gpu, nccl or device, wherever they are defined), read
# from ctest's listing: the program of each test command inside the build folder (also
# ddpRunExpect's -DCOMMAND=...); a test whose program is not built yet has no command there and
# is taken as a target of its own name (ddp_add_unit_test's rule), or with '.' read as '_', if that
# target exists. Without
# python3: the GPU test programs and the example.
labels='gpu|nccl|device'
targets=()
if command -v python3 >/dev/null 2>&1; then
  known_targets=$(cmake --build "$build_dir" --target help 2>/dev/null | sed -nE 's/^(\.\.\. )?([A-Za-z0-9_.+-]+)(: .*)?$/\2/p')
  mapfile -t targets < <(cd "$build_dir" && ctest -N -L "$labels" --show-only=json-v1 2>/dev/null |
    KNOWN="$known_targets" python3 -c '
import json, os, sys
build = os.path.realpath(".")
known = set(os.environ.get("KNOWN", "").split())
names = set()
for t in json.load(sys.stdin).get("tests", []):
    command = t.get("command")
    if not command:
        # Not built yet: a target named as the test, "." read as "_" (gpu.device_paths).
        for name in (t["name"], t["name"].replace(".", "_")):
            if name in known:
                names.add(name)
        continue
    for arg in command:
        if arg.startswith("-DCOMMAND="):
            arg = arg[len("-DCOMMAND="):]
        for part in arg.split(";"):
            if part.startswith("/") and os.path.realpath(part).startswith(build + os.sep):
                names.add(os.path.basename(part))
print("\n".join(sorted(names)))' | sed '/^$/d' || true)
fi
if [ ${#targets[@]} -eq 0 ]; then targets=(gpu_device_paths nccl_gpu cuda_trainer); fi
targets+=(cuda_trainer)
step cmake --build "$build_dir" -j "$jobs" --target "${targets[@]}" || die "build failed (see $log)"
built=$(date +%s)

# ---- run -------------------------------------------------------------------------------------
ctest_log="$build_dir/gpu-check-ctest.log"
set +e
(cd "$build_dir" && ctest -L "$labels" -V) > "$ctest_log" 2>&1
ctest_status=$?
set -e
cat "$ctest_log" >> "$log"
grep -E 'Test +#[0-9]+:|tests passed|RESULT |BANDWIDTH |OVERHEAD |VERSIONS ' "$ctest_log" | sed -E 's/^[0-9]+: //' || true

trainer="$build_dir/examples/cuda_trainer"
declare -A trainer_line
for mode in none fp16 bf16; do
  set +e
  out=$(timeout 120 "$trainer" --compress "$mode" 2>&1)
  status=$?
  set -e
  { echo "== cuda_trainer --compress $mode (exit $status)"; echo "$out"; } >> "$log"
  sum=$(echo "$out" | sed -n 's/^parameters identical.*(sum \(.*\))$/\1/p' | tail -n 1)
  trainer_line[$mode]="$(echo "$out" | grep -E '^cuda_trainer: ([0-9]+ GPU|no CUDA)' | tail -n 1)${sum:+, parameter sum $sum} (exit $status)"
  say "cuda_trainer --compress $mode: ${trainer_line[$mode]}"
done
finished=$(date +%s)

# ---- report ----------------------------------------------------------------------------------
# name<TAB>labels of every registered test (needs python3; empty labels without it).
test_labels=$(cd "$build_dir" && ctest -N --show-only=json-v1 2>/dev/null | python3 -c '
import json, sys
for t in json.load(sys.stdin).get("tests", []):
    labels = next((p["value"] for p in t.get("properties", []) if p["name"] == "LABELS"), [])
    print(t["name"] + "\t" + ", ".join(labels))' 2>/dev/null || true)
labels_of() { printf '%s\n' "$test_labels" | awk -F'\t' -v n="$1" '$1 == n { print $2 }'; }
commit="${GPU_CHECK_COMMIT:-}"
tree_state=""
if [ -z "$commit" ] && git rev-parse HEAD >/dev/null 2>&1; then
  commit=$(git rev-parse HEAD)
  changed=$(git status --porcelain --untracked-files=no 2>/dev/null | wc -l)
  [ "$changed" -gt 0 ] && tree_state=" plus uncommitted changes to $changed tracked file(s)"
fi
[ -n "$commit" ] || commit="unknown (no git metadata here; set GPU_CHECK_COMMIT)"
versions=$(grep -m1 -o 'VERSIONS .*' "$ctest_log" | sed 's/^VERSIONS //' || true)
device_line=$(grep -m1 -o 'gpu.device_paths: [0-9]* device(s), device 0: .*' "$ctest_log" || true)
nccl_runtime=$(echo "$versions" | sed -n 's/.*nccl=\([0-9.]*\).*/\1/p')
cuda_runtime=$(echo "$versions" | sed -n 's/.*cuda_runtime=\([0-9.]*\).*/\1/p')
cuda_driver_api=$(echo "$versions" | sed -n 's/.*cuda_driver_api=\([0-9.]*\).*/\1/p')
archs=$(cache_value CMAKE_CUDA_ARCHITECTURES)

failed=0
[ $ctest_status = 0 ] || failed=1
if [ $have_gpu = 1 ]; then
  for mode in none fp16 bf16; do
    echo "${trainer_line[$mode]}" | grep -qE ': converged(, parameter sum [^ ]+)? \(exit 0\)' || failed=1
  done
fi

{
  echo "# GPU validation"
  echo
  if [ $have_gpu = 1 ]; then
    echo "Results of \`scripts/gpu-check.sh\` on a GPU machine (the script writes this file; rerun it to refresh)."
  else
    echo "**No GPU: skipped.** \`scripts/gpu-check.sh --no-gpu-ok\` built everything on a machine without a GPU;"
    echo "the GPU tests skipped. This is not a GPU validation."
  fi
  echo
  echo "| | |"
  echo "| --- | --- |"
  echo "| date | $(date -u '+%Y-%m-%d %H:%M UTC') |"
  echo "| commit tested | \`$commit\`$tree_state |"
  echo "| GPU | $([ $have_gpu = 1 ] && echo "$gpu_count x $gpu_name ($gpu_memory)" || echo "none: skipped") |"
  [ -n "$device_line" ] && echo "| seen by the tests | ${device_line#gpu.device_paths: } |"
  echo "| driver | $driver (CUDA driver API ${cuda_driver_api:-n/a}) |"
  echo "| CUDA | nvcc $nvcc_version, runtime ${cuda_runtime:-n/a}; kernels for sm_${archs//;/, sm_} |"
  echo "| NCCL | ${nccl_runtime:-n/a} at run time (ncclGetVersion), header ${nccl_header_version:-n/a}; $nccl_source |"
  echo "| world size | one rank per visible GPU, at most 4 ($gpu_count visible); ranks are threads of one process |"
  echo "| build | CMake $(cmake --version | sed -n 's/cmake version //p'), Release, no MPI, $([ -f "$root/third_party/catch2/catch2/catch.hpp" ] && grep -q 'third_party/catch2' "$log" && echo 'vendored Catch2' || echo 'installed Catch2'); built in $((built - started)) s, tests and trainer ran in $((finished - built)) s |"
  echo
  echo "## Tests (\`ctest -L 'gpu|nccl|device'\`)"
  echo
  echo "| test | labels | result | time |"
  echo "| --- | --- | --- | --- |"
  # "  3/9 Test  #12: nccl_gpu .........................   Passed    3.21 sec"
  sed -nE 's/^ *[0-9]+\/[0-9]+ Test +#[0-9]+: ([^ ]+) \.*[ *]*([A-Za-z][^0-9]*[A-Za-z])[ ]+([0-9.]+) sec.*/\1|\2|\3/p' \
    "$ctest_log" | while IFS='|' read -r name result secs; do
      echo "| $name | $(labels_of "$name") | $result | $secs s |"
    done
  echo
  echo "ctest: $(grep -E 'tests passed' "$ctest_log" | tail -n 1 || echo 'no summary (see the log)')"
  if grep -q 'RESULT ' "$ctest_log"; then
    echo
    echo "### gpu.device_paths, case by case"
    echo
    echo "| case | result |"
    echo "| --- | --- |"
    grep -o 'RESULT .*' "$ctest_log" | sed -E 's/\|/\\|/g; s/^RESULT ([^ ]+) (.*)$/| \1 | \2 |/'
  fi
  echo
  echo "## Device-copy bandwidth"
  echo
  if grep -q 'BANDWIDTH ' "$ctest_log"; then
    echo "256 MiB device to device, split into equal regions: \`ddp::cuda::runtime::copy\` (for several"
    echo "regions in device memory, launches of its copy kernel: how a Bucketer copies gradients into a"
    echo "bucket and back) against one \`cudaMemcpyBatchAsync\` of the same regions (the copy engines; what"
    echo "the runtime used before the kernel) and one \`cudaMemcpyAsync\` of all the bytes. GB/s counts each"
    echo "byte copied once; mean of 10 copies timed with CUDA events after 2 warm-ups."
    echo "ratio = runtime copy / cudaMemcpyAsync."
    echo
    echo "| regions | bytes per region | runtime copy GB/s | cudaMemcpyBatchAsync GB/s | cudaMemcpyAsync GB/s | ratio |"
    echo "| --- | --- | --- | --- | --- | --- |"
    grep -o 'BANDWIDTH .*' "$ctest_log" | sed -E \
      's/.*regions=([0-9]+) region_bytes=([0-9]+) runtime_copy_GBps=([0-9.]+) cudaMemcpyBatchAsync_GBps=([0-9.inf]+) cudaMemcpyAsync_GBps=([0-9.]+) ratio=([0-9.]+).*/| \1 | \2 | \3 | \4 | \5 | \6 |/'
  else
    echo "Not measured (no GPU)."
  fi
  echo
  echo "## The Manager's overhead per step"
  echo
  if grep -q 'OVERHEAD ' "$ctest_log"; then
    echo "One Bucketer step (mark_ready of 4 gradients, finalize) over a plain NCCL communicator, and the"
    echo "same step over a Manager of one replica (start_quorum, the step, should_commit's vote) with"
    echo "\`nccl::manager_factory\` on a \`replica_stream\`; world size 1, mean of 20 steps after 3 warm-ups,"
    echo "the device drained after each (gpu.device_paths, case manager.overhead_per_step)."
    echo
    echo "| gradient bytes | NCCL, blocking mode, ms | NCCL, non-blocking (default), ms | Manager ms | Manager / non-blocking |"
    echo "| --- | --- | --- | --- | --- |"
    grep -o 'OVERHEAD .*' "$ctest_log" | sed -E \
      's/.*bytes=([0-9]+) blocking_nccl_ms=([0-9.]+) plain_nccl_ms=([0-9.]+) manager_ms=([0-9.]+) ratio=([0-9.]+).*/| \1 | \2 | \3 | \4 | \5 |/'
  else
    echo "Not measured (no GPU)."
  fi
  echo
  echo "## cuda_trainer (examples/cuda_trainer.cu)"
  echo
  echo "A 2-layer MLP with hand-written kernels, gradients in one device allocation, four buckets,"
  echo "\`Bucketer::finalize()\` without a host wait; 300 steps, one rank per GPU."
  echo
  echo "| compression | result |"
  echo "| --- | --- |"
  for mode in none fp16 bf16; do echo "| $mode | \`${trainer_line[$mode]}\` |"; done
  echo
  echo "## What this run does not cover"
  echo
  if [ "$gpu_count" -lt 2 ]; then
    echo "- Collectives between GPUs: with $gpu_count GPU the NCCL cases ran at world size 1 (NCCL copies"
    echo "  within the device). Rings across 2-4 GPUs have run only on the emulated device."
  fi
  if grep -q NCCL_REVOKE_DEFAULT "$nccl_header" 2>/dev/null; then
    echo "- Fault tolerance (\`revoke\`/\`shrink\`) needs failing ranks: not exercised here."
  else
    echo "- \`nccl::communicator::revoke\` is not compiled: this \`nccl.h\` (${nccl_header_version:-?}) does not declare"
    echo "  \`ncclCommRevoke\` (\`DDP_NCCL_HAS_REVOKE\` is 0)."
  fi
  echo "- MPI, gloo and the test hosts: no MPI or network on the GPU machines."
  echo
  echo "## How to reproduce"
  echo
  echo "On a machine with a GPU, CUDA (nvcc), CMake and NCCL (a system install, or PyTorch's"
  echo "\`nvidia-nccl\` wheel), from the repository root:"
  echo
  echo '```sh'
  echo "scripts/gpu-check.sh            # writes docs/gpu-validation.md (\$OUT/gpu-validation.md if OUT is set)"
  echo '```'
  echo
  echo "The full log of the run is \`gpu-check.log\` beside the report."
} > "$output"

say "wrote $output ($((finished - started)) s)"
if [ $failed = 0 ]; then
  say "$([ $have_gpu = 1 ] && echo 'all passed' || echo 'no GPU: built and ran, GPU tests skipped')"
  exit 0
fi
say "FAILED: see $output and $log"
exit 1
