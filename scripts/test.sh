#!/usr/bin/env bash
# Builds kvtier and runs every test: the plain build (unit, integration, CLI and Python tests),
# the same suite under ASan+UBSan, the threaded tests under TSan, and the fuzz corpus replay plus
# a short bounded fuzzing run per target (clang/libFuzzer). Installs missing Debian packages
# first. Exit status is non-zero if anything fails. Set KVT_TEST_QUICK=1 to run the plain build
# only (for local iteration).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
jobs=$(nproc)

build() { # dir, extra cmake args...
  local dir=$1; shift
  cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" >/dev/null
  cmake --build "$dir" -j "$jobs"
}

echo "== plain build"
build build
(cd build && ctest --output-on-failure -j "$jobs")
[ "${KVT_TEST_QUICK:-0}" = 1 ] && exit 0

echo "== ASan + UBSan"
build build-asan -DKVT_SANITIZE=address,undefined
(cd build-asan && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 ctest --output-on-failure -j "$jobs")

echo "== TSan (threaded tests)"
build build-tsan -DKVT_SANITIZE=thread
(cd build-tsan && TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 \
  ctest --output-on-failure -L threads -j "$jobs")

if [ -x fuzz/run.sh ]; then
  echo "== fuzzing"
  fuzz/run.sh
fi
