#!/usr/bin/env bash
# Campaign-sized runs of the crash tests, kept out of the suite (which runs them
# seeded and small): TRIALS SIGKILL trials of test_crash_kill_tier in both variants
# (plain, and salted + chunked + evicting), then the evicting-spill crash simulator
# (test_crashsim_evict_tier, every cut point) and the chunk crash simulator with
# FATES fates per crash point. Usage: scripts/crash-campaign.sh [TRIALS] [SEED]
# [FATES] (defaults 500, 2026, 24); BUILD=dir picks the build directory (default
# build; it is configured and the three tests built if missing). Exits non-zero
# when any test fails; each prints its own counts (trials, acknowledged spills,
# lost, wrong, evicted, quarantined; cut points and violations).
set -euo pipefail
cd "$(dirname "$0")/.."
trials=${1:-500}
seed=${2:-2026}
fates=${3:-24}
build=${BUILD:-build}
case "$trials$seed$fates" in *[!0-9]*) echo "usage: $0 [TRIALS] [SEED] [FATES] (integers)" >&2; exit 2;; esac
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVT_WERROR=ON >/dev/null
fi
cmake --build "$build" -j2 --target test_crash_kill_tier test_crashsim_evict_tier \
  test_crashsim_chunks >/dev/null
# Wall-time budgets scale with the trial count (about 0.2 s a trial on a loaded
# 2-core machine), so the trial count, not the clock, ends the run.
secs=$((trials / 2 + 60))
echo "== test_crash_kill_tier: $trials trials per variant, seed $seed" >&2
KVT_CRASH_TRIALS=$trials KVT_CRASH_SECONDS=$secs KVT_CRASH_EVICT_TRIALS=$trials \
  KVT_CRASH_EVICT_SECONDS=$secs KVT_CRASH_BATCH_TRIALS=$trials \
  KVT_CRASH_BATCH_SECONDS=$secs KVT_CRASH_SEED=$seed \
  "$build/tests/fault/test_crash_kill_tier"
echo "== test_crashsim_evict_tier" >&2
"$build/tests/fault/test_crashsim_evict_tier"
echo "== test_crashsim_chunks: $fates fates per crash point" >&2
KVT_CRASHSIM_FATES=$fates "$build/tests/fault/test_crashsim_chunks"
