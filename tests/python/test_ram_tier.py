"""The host RAM tier through the Python APIs (issue 15): SSDCacheTier's
host_cache_bytes option, get_stats' host-cache and RAM/disk promote figures,
set_host_cache_bytes and trim (the cache shrinks before they return), and
kvtier.Tier's stats()/prometheus()/set_host_cache_bytes/trim. Data promoted
from RAM equals what was spilled. No timings are asserted."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import Budget, kv_layer, make_tier, run
import kvtier

pytestmark = pytest.mark.tier_profiles  # defaults and the bare disk path (conftest)


def _layers(rng, n=3, t=64):
    return [kv_layer(rng, t, np.float16, heads=2, dim=64) for _ in range(n)]


def _same(got, layers):
    assert len(got) == len(layers)
    for g, l in zip(got, layers):
        np.testing.assert_array_equal(g["keys"], l.keys)
        np.testing.assert_array_equal(g["values"], l.values)


def test_second_promote_served_from_ram(cache_dir, rng):
    t = make_tier(cache_dir, host_cache_bytes=64 << 20)
    t.start_writer()
    try:
        entries = [(tuple(range(i * 100, i * 100 + 40)), _layers(rng)) for i in range(3)]
        for toks, layers in entries:
            assert t.enqueue_spill(toks, layers, 1000)
        t.flush(timeout=30)
        s = t.get_stats()
        assert s["host_cache_entries"] == 3
        assert 0 < s["host_cache_bytes_used"] <= s["host_cache_bytes_bound"] == 64 << 20
        b = Budget()
        for _ in range(2):
            for toks, layers in entries:
                got = run(t.async_promote(toks, b.reserve, b.release))
                _same(got, layers)
                del got
        s = t.get_stats()
        assert s["promotes_from_ram"] == 6
        assert s["promotes_from_disk"] == 0
        assert s["host_cache_hits"] == 6
        assert s["promote_ram_bytes"] > 0
        assert s["ssd_hits"] == 6  # the reference's counters unchanged in meaning
        # Pressure: a lower bound, then a trim, each done when the call returns.
        one = s["host_cache_bytes_used"] // 3
        t.set_host_cache_bytes(one)
        s = t.get_stats()
        assert s["host_cache_bytes_used"] <= one
        assert s["host_cache_entries"] == 1
        assert t.trim(0) > 0
        assert t.get_stats()["host_cache_bytes_used"] == 0
        # Off: promotes read the disk.
        t.set_host_cache_bytes(0)
        got = run(t.async_promote(entries[0][0], b.reserve, b.release))
        _same(got, entries[0][1])
        del got
        s = t.get_stats()
        assert s["promotes_from_disk"] == 1
        assert s["host_cache_entries"] == 0
        with pytest.raises(ValueError):
            t.set_host_cache_bytes(-1)
    finally:
        t.close()


def test_disabled_by_config(cache_dir, rng):
    t = make_tier(cache_dir, host_cache_bytes=0)
    t.start_writer()
    try:
        toks = tuple(range(40))
        layers = _layers(rng)
        assert t.enqueue_spill(toks, layers, 1000)
        t.flush(timeout=30)
        b = Budget()
        for _ in range(2):
            _same(run(t.async_promote(toks, b.reserve, b.release)), layers)
        s = t.get_stats()
        assert s["host_cache_bytes_bound"] == 0
        assert s["promotes_from_ram"] == 0 and s["promotes_from_disk"] == 2
    finally:
        t.close()
    with pytest.raises(ValueError):
        make_tier(cache_dir, host_cache_bytes=-5)


def test_default_bound_is_derived(cache_dir):
    t = make_tier(cache_dir, host_cache_bytes=None)
    try:
        assert t.get_stats()["host_cache_bytes_bound"] > 0
    finally:
        t.close()


def test_tier_api(tmp_path, rng):
    with kvtier.Tier(str(tmp_path / "c"), durability="none",
                     host_cache_bytes=32 << 20) as t:
        toks = list(range(50))
        layers = _layers(rng)
        t.spill(toks, layers)
        t.flush()
        for _ in range(2):
            e = t.promote(toks)
            assert e is not None
            del e
        st = t.stats()
        assert st["promotes_from_ram"] == 2
        assert st["host_cache_bytes_bound"] == 32 << 20
        assert "kvtier_promotes_from_ram_total 2" in t.prometheus()
        t.set_host_cache_bytes(None)  # the derived default
        assert t.stats()["host_cache_bytes_bound"] > 0
        t.trim()
        assert t.stats()["host_cache_bytes_used"] == 0
