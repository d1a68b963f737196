"""No C memory leaks across 1,000 spill/promote cycles: resident memory
(/proc/self/statm) stays bounded while far more data than the allowed growth
passes through the C library, and Python-side allocations (tracemalloc)
stay flat."""

from __future__ import annotations

import gc
import os
import tracemalloc

import pytest
import numpy as np

from conftest import KVLayer, make_tier, run

pytestmark = pytest.mark.tier_profiles  # defaults and the bare disk path (conftest)

CYCLES = 1000
PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def test_spill_promote_cycles_do_not_leak(tmp_path):
    rng = np.random.default_rng(0)
    # 2 layers x (keys + values) x 1x4x32x64 float32 = 256 KiB per entry.
    layers = [KVLayer(rng.standard_normal((1, 4, 32, 64)).astype(np.float32),
                      rng.standard_normal((1, 4, 32, 64)).astype(np.float32), 32)
              for _ in range(2)]
    per_entry = sum(l.keys.nbytes + l.values.nbytes for l in layers)
    # write_all: every cycle's spill is written and promoted back (the
    # default's admission would decline the new ones once the tier evicts).
    t = make_tier(str(tmp_path / "c"), max_entries=8, admission_policy="write_all")
    t.start_writer()

    async def cycles(n, start):
        for i in range(start, start + n):
            toks = (i % 16, 7, 7)
            assert t.enqueue_spill(toks, layers, per_entry)
            t.flush(timeout=30)
            got = await t.async_promote(toks, lambda b: True, lambda b: None)
            assert got is not None and got[1]["values"][0, 3, 31, 63] == layers[1].values[0, 3, 31, 63]
            del got
            if i % 3 == 0:
                got = t._read_entry(toks, t.lookup_ssd(toks)["file_path"])
                assert got is not None
                del got

    try:
        run(cycles(100, 0))  # warm up pools, SQLite cache, allocator arenas
        gc.collect()
        tracemalloc.start()
        rss0 = _rss()
        snap0 = tracemalloc.take_snapshot()
        run(cycles(CYCLES, 100))
        gc.collect()
        rss1 = _rss()
        snap1 = tracemalloc.take_snapshot()
        tracemalloc.stop()
    finally:
        t.close()
    growth = rss1 - rss0
    moved = CYCLES * per_entry * 2  # spilled and promoted
    py_growth = sum(s.size_diff for s in snap1.compare_to(snap0, "filename"))
    # A leak of even one entry per cycle would be >= 256 MiB.
    assert growth < 24 * 1024 * 1024, f"RSS grew {growth} bytes over {CYCLES} cycles ({moved} moved)"
    assert py_growth < 2 * 1024 * 1024, f"Python heap grew {py_growth} bytes"
    st = t.get_stats()
    assert st["ssd_hits"] == CYCLES + 100
