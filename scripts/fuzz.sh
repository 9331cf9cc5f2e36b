#!/usr/bin/env bash
# Fuzzes every decoder of bytes another process wrote (stores, membership, Manager records; see
# docs/fuzzing.md) for a bounded time, with libFuzzer under AddressSanitizer and UBSan.
#
#   scripts/fuzz.sh [--build-only | --no-build] [seconds-per-target]        (default 60)
#
# --build-only builds the fuzzers and stops; --no-build runs the ones built before (CI builds them,
# then runs them as the stress stage's busy core: scripts/stress.sh, DDP_STRESS_HOG_FIRST).
#
# Configures and builds build/fuzz with clang++ (-DDDP_BUILD_FUZZERS=ON, fuzz targets only), then
# runs each target for the given time over a scratch copy of its seed corpus (tests/fuzz/corpus/
# <target>, never modified: new inputs stay in the scratch copy). Every seed, regression inputs
# included, runs first. Prints, per target, the executions run (libFuzzer's
# stat::number_of_executed_units), the coverage reached and the time taken; exits 1 if any target
# crashed, hit UB, timed out on an input (-timeout=10 s) or ran out of memory (2 GiB), naming the
# saved input (under build/fuzz/fuzz-runs/<target>/artifacts/).
#
# Environment: DDP_FUZZ_BUILD_DIR (default build/fuzz), DDP_FUZZ_TARGETS (space-separated subset
# of the targets), DDP_FUZZ_JOBS (build parallelism, default 2).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mode=all
case "${1:-}" in
  --build-only) mode=build; shift ;;
  --no-build) mode=run; shift ;;
esac
secs=${1:-60}
if ! [[ $secs =~ ^[1-9][0-9]*$ ]]; then
  echo "fuzz.sh: seconds per target must be a positive integer, got '$secs'" >&2
  exit 2
fi
command -v clang++ >/dev/null || { echo "fuzz.sh: clang++ is needed (libFuzzer)" >&2; exit 2; }
build=${DDP_FUZZ_BUILD_DIR:-$root/build/fuzz}
jobs=${DDP_FUZZ_JOBS:-2}
start=$(date +%s)

# 1. Configure (first time: Ninja when available) and build the fuzz targets only.
if [ "$mode" != run ]; then
generator=()
if [ ! -f "$build/CMakeCache.txt" ] && command -v ninja >/dev/null; then generator=(-G Ninja); fi
mkdir -p "$build"
if ! cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DCMAKE_CXX_COMPILER=clang++ -DDDP_BUILD_FUZZERS=ON -DDDP_BUILD_EXAMPLES=OFF -DDDP_BUILD_BENCH=OFF \
      -DDDP_ENABLE_MPI=OFF -DDDP_ENABLE_NCCL=OFF -DDDP_INSTALL=OFF -DDDP_WARNINGS_AS_ERRORS=ON \
      >"$build/fuzz-configure.log" 2>&1; then
  cat "$build/fuzz-configure.log" >&2
  echo "fuzz.sh: configuring $build failed" >&2
  exit 1
fi
cmake --build "$build" -j "$jobs" --target ddp_fuzzers
fi
built=$(date +%s)
echo "== fuzz.sh: built in $((built - start)) s"
[ "$mode" = build ] && exit 0
if [ ! -f "$build/tests/fuzz/fuzzers.txt" ]; then
  echo "fuzz.sh: no fuzzers built in $build (run scripts/fuzz.sh --build-only first)" >&2
  exit 2
fi

read -r -a targets <<<"${DDP_FUZZ_TARGETS:-$(tr '\n' ' ' <"$build/tests/fuzz/fuzzers.txt")}"
runs="$build/fuzz-runs"
rm -rf "$runs"
mkdir -p "$runs"

# 2. Each target in turn (the machine's cores are shared: one at a time).
failed=()
summary=()
for t in "${targets[@]}"; do
  exe="$build/tests/fuzz/${t}_fuzz"
  seeds="$root/tests/fuzz/corpus/$t"
  if [ ! -x "$exe" ] || [ ! -d "$seeds" ]; then
    echo "fuzz.sh: no fuzzer or corpus for target '$t'" >&2
    exit 2
  fi
  dir="$runs/$t"
  mkdir -p "$dir/corpus" "$dir/artifacts"
  cp -R "$seeds/." "$dir/corpus/"
  args=(-max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1
        -artifact_prefix="$dir/artifacts/")
  if [ -f "$root/tests/fuzz/$t.dict" ]; then args+=(-dict="$root/tests/fuzz/$t.dict"); fi
  t0=$(date +%s)
  rc=0
  # The outer limit only guards against the fuzzer itself getting stuck.
  (cd "$dir" && timeout --kill-after=10 $((secs + 120)) "$exe" "${args[@]}" "$dir/corpus") >"$dir/log" 2>&1 || rc=$?
  t1=$(date +%s)
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$dir/log" | tail -n 1)
  cov=$(grep -Eo 'cov: [0-9]+ ft: [0-9]+' "$dir/log" | tail -n 1 || true)
  status=ok
  if [ "$rc" -ne 0 ]; then
    status="FAILED (exit $rc)"
    failed+=("$t")
  fi
  line=$(printf '%-16s %12s executions in %4d s  %-22s %s' "$t" "${execs:-?}" $((t1 - t0)) "${cov:-}" "$status")
  summary+=("$line")
  echo "$line"
  if [ "$rc" -ne 0 ]; then
    grep -E 'ERROR: |SUMMARY: |runtime error|FUZZ_CHECK|what\(\)|terminate called' "$dir/log" | head -n 10 >&2 || true
    for a in "$dir"/artifacts/*; do [ -e "$a" ] && echo "   input saved: $a" >&2; done
    echo "   log: $dir/log" >&2
  fi
done

end=$(date +%s)
echo "== fuzz.sh: ${#targets[@]} targets, $secs s each; $((end - start)) s in all (build $((built - start)) s)"
printf '%s\n' "${summary[@]}"
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz.sh: FAILED: ${failed[*]} (reproduce: <build>/tests/fuzz/<target>_fuzz <saved input>)" >&2
  exit 1
fi
echo "fuzz.sh: no crash"
