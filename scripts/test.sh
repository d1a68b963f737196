#!/usr/bin/env bash
# Builds kvtier and runs every test: the plain build (unit, integration, CLI and Python tests),
# the same suite under ASan+UBSan, the threaded tests under TSan, and the fuzz corpus replay plus
# a short bounded fuzzing run per target (clang/libFuzzer). Installs missing Debian packages
# first. Exit status is non-zero if anything fails; the last line sums the tests that passed.
# Set KVT_TEST_QUICK=1 to run the plain build only (for local iteration).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
jobs=$(nproc)
summary=$(mktemp)
trap 'rm -f "$summary"' EXIT

build() { # dir, extra cmake args...
  local dir=$1; shift
  cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" >/dev/null
  cmake --build "$dir" -j "$jobs"
}

# ctest in dir with extra args; its output is kept for the closing line. pipefail makes a
# failing ctest fail the script.
run_ctest() { # dir, ctest args...
  local dir=$1; shift
  (cd "$dir" && ctest --output-on-failure -j "$jobs" "$@") | tee -a "$summary"
}

echo "== plain build"
build build
run_ctest build

if [ "${KVT_TEST_QUICK:-0}" != 1 ]; then
  echo "== ASan + UBSan"
  build build-asan -DKVT_SANITIZE=address,undefined
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
    UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 run_ctest build-asan

  echo "== TSan (threaded tests)"
  build build-tsan -DKVT_SANITIZE=thread
  TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 run_ctest build-tsan -L threads

  if [ -x fuzz/run.sh ]; then
    echo "== fuzzing"
    fuzz/run.sh
  fi
fi

total=0
for n in $(sed -n 's/.* tests failed out of \([0-9]*\)$/\1/p' "$summary"); do
  total=$((total + n))
done
echo "kvtier: ${total} passed, 0 failed"
