#!/usr/bin/env bash
# Builds kvtier and runs every test: the plain build (unit, integration, CLI and Python tests),
# the same suite under ASan+UBSan, the threaded tests under TSan, a gcc Release build, the suite
# built with clang, the suite of the portable build (-DKVT_PORTABLE=ON), and the fuzz corpus
# replay plus a short bounded fuzzing run per target (clang/libFuzzer). Warnings are errors
# (-DKVT_WERROR=ON) in every build here. Installs missing Debian packages
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
  cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVT_WERROR=ON "$@" >/dev/null
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

  # Packagers' configurations (issue 17): an optimised gcc Release build (its inliner finds
  # warnings RelWithDebInfo does not) and the library + tests built with clang, both with
  # -Werror; the clang build's suite runs too.
  echo "== Release (gcc), build only"
  build build-release -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_COMPILER=gcc

  echo "== clang build"
  build build-clang -DCMAKE_C_COMPILER=clang
  run_ctest build-clang

  # Portable configuration (issue 17): no io_uring, no O_DIRECT, no Linux-only calls - the
  # code paths macOS users run - with the whole suite.
  echo "== portable build (-DKVT_PORTABLE=ON)"
  build build-portable -DKVT_PORTABLE=ON
  run_ctest build-portable

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
