"""Differential test: the same sequence of operations on the reference's
SSDCacheTier (assembled from the seed by tests/reference/reference_loader.py) and on kvtier's drop-in SSDCacheTier gives the same
return values (lookups, prefix lookups, promoted layers, budget calls,
reconcile counts, the reference's counters), in both storage modes."""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np
import pytest

import make_ref_cache
import ssd_cache_ref as ref
from conftest import Budget, tier_kw
from kvtier import ssd_cache as kv

pytestmark = pytest.mark.tier_profiles  # defaults and the bare disk path (conftest)


def _wait_written(tier, tokens, present=True, timeout=30.0):
    end = time.time() + timeout
    while (tier.lookup_ssd(tokens) is not None) != present:
        if time.time() > end:
            raise AssertionError(f"spill of {len(tokens)} tokens not visible")
        time.sleep(0.005)


def _eq(a, b, path="r"):
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray), path
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (path, a.keys(), b.keys())
        for k in a:
            _eq(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _eq(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


COUNTERS = ("spill_count", "ssd_hits", "ssd_misses", "promotion_failures")


@pytest.mark.parametrize("mode,kinds", [
    ("compat", ("kv", "rotating", "arrays", "quantized")),
    ("native", ("kv", "rotating", "arrays")),
])
@pytest.mark.parametrize("bf16", [False, True])
def test_same_operations_same_results(tmp_path, mode, kinds, bf16):
    rd, kd = str(tmp_path / "ref"), str(tmp_path / "kv")
    rt = ref.SSDCacheTier(ref.SSDCacheConfig(cache_dir=rd, max_entries=4))
    kt = kv.SSDCacheTier(kv.SSDCacheConfig(cache_dir=kd, **tier_kw(max_entries=4,
                                                                   storage_mode=mode)))
    rt.start_writer()
    kt.start_writer()
    tiers = (rt, kt)

    def both(fn):
        a, b = fn(rt), fn(kt)
        _eq(b, a)
        return a

    def both_async(fn):
        ra, rb = Budget(), Budget()
        a = asyncio.run(fn(rt, ra))
        b = asyncio.run(fn(kt, rb))
        _eq(b, a)
        assert rb.calls == ra.calls
        return a

    try:
        # Fresh, identical layer objects for each side (the reference's
        # quantized path mutates layers in place).
        def entries():
            return make_ref_cache.build_entries(seed=21, entries=6, layers=3,
                                                kinds=kinds, bf16=bf16)

        for i, (er, ek) in enumerate(zip(entries(), entries())):
            assert rt.enqueue_spill(er["tokens"], er["layers"], er["memory_bytes"]) is True
            assert kt.enqueue_spill(ek["tokens"], ek["layers"], ek["memory_bytes"]) is True
            for t in tiers:
                _wait_written(t, er["tokens"])
            # An entry is visible before its writer has enforced the capacity
            # (both libraries evict after the index row): wait for that too,
            # or a slow writer still holds the entry the other evicted.
            kt.flush()
            end = time.time() + 30
            while rt._index.get_entry_count() > 4 and time.time() < end:
                time.sleep(0.005)
            time.sleep(0.01)  # distinct accessed_at for the LRU order
        ents = entries()
        toks = [e["tokens"] for e in ents]
        for t in toks:
            both(lambda x: x.lookup_ssd(t))
            both(lambda x: x.lookup_ssd_prefix(t + (5, 6)))
            both(lambda x: x.lookup_ssd_prefix(t[:-1]))
        assert sum(rt.lookup_ssd(t) is not None for t in toks) == 4  # two evicted
        # Promote everything (hits and evicted misses), a refused budget, a miss.
        for t in toks:
            both_async(lambda x, b: x.async_promote(t, b.reserve, b.release))
        live = [t for t in toks if rt.lookup_ssd(t) is not None]

        async def refused(x, b):
            b.allow = False
            return await x.async_promote(live[0], b.reserve, b.release)

        both_async(refused)
        both_async(lambda x, b: x.async_promote((1, 2, 3), b.reserve, b.release))
        # A missing layer file: None, budget released, entry dropped.
        for t, d in ((rt, rd), (kt, kd)):
            os.remove(os.path.join(d, "data", ref._tokens_hash(live[1]), "layer_1.safetensors"))
        both_async(lambda x, b: x.async_promote(live[1], b.reserve, b.release))
        both(lambda x: x.lookup_ssd(live[1]))
        # Reconcile: a dir without manifest, and an orphan directory.
        for t, d in ((rt, rd), (kt, kd)):
            os.remove(os.path.join(d, "data", ref._tokens_hash(live[2]), "manifest.json"))
            os.mkdir(os.path.join(d, "data", "a" * 64), 0o700)
        both(lambda x: x.reconcile())
        both(lambda x: x.lookup_ssd(live[2]))
        both(lambda x: {k: x.get_stats()[k] for k in COUNTERS})
    finally:
        rt.close()
        kt.close()
