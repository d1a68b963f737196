#!/bin/sh
# test_install.sh CMAKE BUILD_DIR SRC_DIR CC HAVE_URING HAVE_REDIS
# Installs BUILD_DIR into a fresh prefix and checks the three ways a user consumes it (see
# CMakeLists.txt here): pkg-config (shared), pkg-config --static (libkvtier.a plus every
# Requires.private/Libs.private library), find_package(kvtier) with kvtier::kvtier and
# kvtier::kvtier_static, both installed headers (prog.c uses <kvtier.h>, prog_sys.c
# <kvtier_sys.h>, built warning-free as C11), the installed CLI, and the Python package
# pip-installed into the same prefix, imported with only PYTHONPATH set. Everything lives under
# one mktemp directory that is removed on every exit path.
set -eu
CMAKE=$1 BUILD=$2 SRC=$3 CC=$4 HAVE_URING=$5 HAVE_REDIS=$6
command -v pkg-config >/dev/null || { echo "SKIP: no pkg-config"; exit 77; }
T=$(mktemp -d "${TMPDIR:-/tmp}/kvtier-install-XXXXXX")
trap 'rm -rf "$T"' EXIT INT TERM
P=$T/prefix
fail() { echo "FAIL: $*" >&2; exit 1; }

echo "== cmake --install $BUILD --prefix $P"
"$CMAKE" --install "$BUILD" --prefix "$P" >"$T/install.log" || { cat "$T/install.log"; fail install; }
PCDIR=$(dirname "$(find "$P" -name kvtier.pc | head -n1)")
[ -f "$PCDIR/kvtier.pc" ] || fail "no kvtier.pc installed"
LIBDIR=$(dirname "$PCDIR")
[ -f "$LIBDIR/libkvtier.a" ] || fail "no libkvtier.a in $LIBDIR"
[ -f "$P/include/kvtier.h" ] || fail "no kvtier.h in $P/include"
[ -f "$P/include/kvtier_sys.h" ] || fail "no kvtier_sys.h in $P/include"
export PKG_CONFIG_PATH="$PCDIR"
unset PKG_CONFIG_LIBDIR KVTIER_LIBRARY LD_LIBRARY_PATH 2>/dev/null || true

# The .pc file names the prefix it was installed to, not the configure-time one.
[ "$(pkg-config --variable=includedir kvtier | xargs realpath)" = "$(realpath "$P/include")" ] ||
  fail "includedir $(pkg-config --variable=includedir kvtier) is not under $P"
[ "$(pkg-config --modversion kvtier)" = "$(sed -n 's/.*KVT_VERSION_STRING "\(.*\)"/\1/p' "$P/include/kvtier.h")" ] ||
  fail "kvtier.pc version differs from kvtier.h"
static_libs=$(pkg-config --static --libs kvtier)
if [ "$HAVE_URING" = 1 ]; then
  echo "$static_libs" | grep -q -- -luring || fail "--static lacks -luring: $static_libs"
fi
if [ "$HAVE_REDIS" = 1 ]; then
  echo "$static_libs" | grep -q -- -lhiredis || fail "--static lacks -lhiredis: $static_libs"
  echo "$static_libs" | grep -q -- -lssl || fail "--static lacks -lssl: $static_libs"
fi

run() { # name binary: runs it on its own cache directory, expects "kvtier X ok"
  out=$("$2" "$T/cache-$1") || fail "$1 exited $?"
  echo "$out" | grep -q "^kvtier .* ok$" || fail "$1 printed: $out"
  echo "$1: $out"
}

echo "== pkg-config (shared)"
# shellcheck disable=SC2046
"$CC" -o "$T/prog_pc" "$SRC/tests/install/prog.c" -I"$SRC/tests" $(pkg-config --cflags --libs kvtier) \
  -Wl,-rpath,"$LIBDIR"
ldd "$T/prog_pc" | grep -q "$LIBDIR/libkvtier.so" || fail "prog_pc does not load $LIBDIR/libkvtier.so"
run pkg-config "$T/prog_pc"

echo "== pkg-config (shared), <kvtier_sys.h>"
# Strict C11 and warnings as errors: the installed headers must compile cleanly for a user.
# shellcheck disable=SC2046
"$CC" -std=c11 -Wall -Wextra -Wpedantic -Werror -o "$T/prog_sys" "$SRC/tests/install/prog_sys.c" \
  -I"$SRC/tests" $(pkg-config --cflags --libs kvtier) -Wl,-rpath,"$LIBDIR"
run pkg-config-sys "$T/prog_sys"

echo "== pkg-config --static"
# libkvtier.a by path (both archives share a directory), every other library as listed.
# shellcheck disable=SC2046
"$CC" -o "$T/prog_static" "$SRC/tests/install/prog.c" -I"$SRC/tests" $(pkg-config --cflags kvtier) \
  $(echo "$static_libs" | sed "s|-lkvtier\b|$LIBDIR/libkvtier.a|")
if readelf -d "$T/prog_static" | grep NEEDED | grep -q libkvtier; then
  fail "prog_static needs libkvtier.so"
fi
run pkg-config-static "$T/prog_static"

echo "== find_package(kvtier)"
mkdir "$T/consumer"
cat >"$T/consumer/CMakeLists.txt" <<EOC
cmake_minimum_required(VERSION 3.18)
project(consumer LANGUAGES C)
find_package(kvtier 0.1 CONFIG REQUIRED)
add_executable(prog_cmake $SRC/tests/install/prog.c)
target_link_libraries(prog_cmake PRIVATE kvtier::kvtier)
add_executable(prog_cmake_static $SRC/tests/install/prog.c)
target_link_libraries(prog_cmake_static PRIVATE kvtier::kvtier_static)
add_executable(prog_cmake_sys $SRC/tests/install/prog_sys.c)
target_link_libraries(prog_cmake_sys PRIVATE kvtier::kvtier)
# tests/public_entry.h only (it includes nothing but <kvtier.h>).
include_directories($SRC/tests)
EOC
"$CMAKE" -S "$T/consumer" -B "$T/consumer/build" -DCMAKE_C_COMPILER="$CC" \
  -DCMAKE_PREFIX_PATH="$P" -DCMAKE_BUILD_TYPE=Release >"$T/consumer.log" 2>&1 ||
  { cat "$T/consumer.log"; fail "find_package configure"; }
"$CMAKE" --build "$T/consumer/build" >>"$T/consumer.log" 2>&1 ||
  { cat "$T/consumer.log"; fail "find_package build"; }
run find_package "$T/consumer/build/prog_cmake"
readelf -d "$T/consumer/build/prog_cmake_static" | grep NEEDED | grep -q libkvtier &&
  fail "prog_cmake_static needs libkvtier.so"
run find_package-static "$T/consumer/build/prog_cmake_static"
run find_package-sys "$T/consumer/build/prog_cmake_sys"

echo "== installed CLI"
if [ -x "$P/bin/kvtier" ]; then
  env -u LD_LIBRARY_PATH "$P/bin/kvtier" --version | grep -q . || fail "installed kvtier --version"
fi

echo "== Python package"
PY=/usr/bin/python3
if ! "$PY" -c "import numpy, setuptools, pip" 2>/dev/null; then
  echo "SKIP: python: numpy, setuptools or pip missing for $PY (scripts/install-deps.sh)"
  exit 77
fi
# Installed from a copy: pip builds in the source directory (build/, *.egg-info).
cp -r "$SRC/bindings/python" "$T/pysrc"
rm -rf "$T/pysrc/build" "$T/pysrc/"*.egg-info
PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INDEX=1 PIP_NO_WARN_SCRIPT_LOCATION=1 \
  "$PY" -m pip install -q --no-build-isolation --no-index --prefix "$P" "$T/pysrc" \
  >"$T/pip.log" 2>&1 || { cat "$T/pip.log"; fail "pip install"; }
init=$(find "$P" -path '*/kvtier/__init__.py' | head -n1)
[ -n "$init" ] || fail "pip installed no kvtier package under $P"
site=$(dirname "$(dirname "$init")")
cd "$T"
env -i PATH=/usr/bin:/bin PYTHONPATH="$site" "$PY" - "$P" <<'EOPY' || fail "import kvtier.ssd_cache"
import os, sys, tempfile
import kvtier.ssd_cache
import kvtier
prefix = os.path.realpath(sys.argv[1])
lib = os.path.realpath(kvtier.library_path)
assert lib.startswith(prefix + os.sep), f"loaded {lib}, not the library under {prefix}"
assert kvtier.__version__ == kvtier.library_version(), (kvtier.__version__, kvtier.library_version())
with tempfile.TemporaryDirectory(dir=os.path.dirname(prefix)) as d:
    cfg = kvtier.ssd_cache.SSDCacheConfig(cache_dir=d)
    tier = kvtier.ssd_cache.SSDCacheTier(cfg)
    tier.close()
print("python: kvtier", kvtier.__version__, "from", lib)
EOPY
echo "install test: ok"
