#!/bin/sh
# Runs the Python binding tests against an ASan/UBSan build of libkvtier by preloading the
# sanitizer runtimes into Debian's python3 (ctest does not register the python tests in
# sanitizer builds because a sanitized .so cannot be dlopen'ed into a plain interpreter).
# Leak detection is off (it would report the interpreter's own allocations) and the ASan
# quarantine is disabled so the RSS-based leak test measures the library, not ASan.
# Usage: tests/python/run_sanitized.sh [BUILD_DIR (default build-asan)] [pytest args...]
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
build=${1:-build-asan}
[ $# -gt 0 ] && shift
case $build in /*) ;; *) build="$root/$build" ;; esac
lib="$build/libkvtier.so"
[ -f "$lib" ] || { echo "run_sanitized.sh: $lib not found (configure with -DKVT_SANITIZE=address,undefined and build)" >&2; exit 2; }
LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)" \
ASAN_OPTIONS=detect_leaks=0:quarantine_size_mb=0:abort_on_error=1 \
UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
KVTIER_LIBRARY="$lib" PYTHONPATH="$root/bindings/python:$root/tests/reference" \
PYTHONDONTWRITEBYTECODE=1 \
exec /usr/bin/python3 -m pytest -q -p no:cacheprovider "$here" "$@"
