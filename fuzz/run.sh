#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (+ASan/UBSan, library instrumented with
# -fsanitize=fuzzer-no-link) in build-fuzz/ and fuzzes each target for a bounded time, starting
# from the committed seed corpus (copied, so new inputs never touch the repository). Fails on
# any crash, leak, timeout or out-of-memory. Environment: KVT_FUZZ_SECONDS (per target,
# default 30), KVT_FUZZ_TARGETS (default: all), KVT_FUZZ_JOBS (build parallelism, default 2).
# Prints the executions per target and writes them to build-fuzz/fuzz-summary.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${KVT_FUZZ_SECONDS:-30}
targets=${KVT_FUZZ_TARGETS:-"safetensors manifest tokens entry chunk"}
jobs=${KVT_FUZZ_JOBS:-2}
command -v clang >/dev/null || { echo "fuzz/run.sh: clang not found" >&2; exit 1; }

CC=clang cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVT_BUILD_FUZZ=ON -DKVT_WERROR=ON \
  -DKVT_SANITIZE=address,undefined -DKVT_WITH_URING=OFF \
  -DCMAKE_C_FLAGS="-fsanitize=fuzzer-no-link" >/dev/null
cmake --build build-fuzz -j "$jobs" --target $(for t in $targets; do printf 'fuzz_%s ' "$t"; done)

summary=build-fuzz/fuzz-summary.txt
: >"$summary"
status=0
for t in $targets; do
  work=build-fuzz/corpus/$t art=build-fuzz/artifacts/$t/
  mkdir -p "$work" "$art"
  cp -n fuzz/corpus/"$t"/* "$work"/ 2>/dev/null || true
  log=build-fuzz/fuzz-$t.log
  echo "== fuzz_$t for ${secs}s"
  if ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=1 \
     UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
     build-fuzz/fuzz/fuzz_"$t" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 \
       -malloc_limit_mb=1024 -max_len=65536 -print_final_stats=1 \
       -artifact_prefix="$art" "$work" >"$log" 2>&1; then
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    echo "fuzz_$t: ${execs:-?} executions in ${secs}s, no findings" | tee -a "$summary"
  else
    echo "fuzz_$t: FAILED (see $log; reproducer in $art)" | tee -a "$summary"
    tail -40 "$log" >&2
    status=1
  fi
done
exit $status
