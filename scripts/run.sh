#!/usr/bin/env bash
# The main job of the README: installs missing Debian packages, builds kvtier (library + CLI)
# and runs a quick `kvtier bench`: a seeded Llama-3-8B-shaped workload spilled durably and
# promoted back warm and cold, lookups timed, every figure printed next to the disk's own
# sequential limits (fio) measured in the same run. Takes well under two minutes on a small
# machine. Extra arguments go to `kvtier bench` (e.g. `--preset hybrid`, `--json`, a DIR on
# the SSD you care about); drop `--quick` by running build/tools/kvtier bench yourself.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVT_WERROR=ON >/dev/null
cmake --build build -j "$(nproc)"
echo "== kvtier bench --quick $*" >&2
exec ./build/tools/kvtier bench --quick "$@"
