"""The host RAM tier over the chunked native store (chunk_tokens=256) through
kvtier.ssd_cache, driven the way vllm-mlx's scheduler drives it: spill on
eviction (enqueue_spill), lookup_ssd then lookup_ssd_prefix,
_read_entry(prompt[:matched], file_path), _index.touch(prompt[:matched]).  The
host RAM tier holds chunks: the system prompt two spills share is held once
(bytes held within 1.1x the unique KV), and a chunk-aligned prefix of it no
spill ended at is served from those chunks, bit for bit; so is a chained
entry (chain + tail) spilled a moment ago, through _read_entry and
async_promote.
Dropping the system prompt's chunks (a capacity gc) drops the cached prefix
too; the bound and trim hold over chained entries; a hybrid model's chained
entry (arrays state in the tail) comes back from RAM whole.  No timings are
asserted."""

from __future__ import annotations

import ctypes
import gc
import os

import pytest
import numpy as np

from conftest import Budget, make_tier, run
from kvtier import _lib as L
from test_chunked_dropin import C, LAYERS, SYS, TOKB, WAIT, kv_for, spill

pytestmark = pytest.mark.tier_profiles  # defaults and the bare disk path (conftest)


def _same_bits(layers, tokens):
    assert layers is not None and len(layers) == LAYERS
    for got, exp in zip(layers, kv_for(tokens)[:LAYERS]):
        k, v = np.asarray(got["keys"]), np.asarray(got["values"])
        assert k.shape == exp.keys.shape and v.shape == exp.values.shape
        assert np.array_equal(k.view(np.uint16), exp.keys.view(np.uint16))
        assert np.array_equal(v.view(np.uint16), exp.values.view(np.uint16))
        assert got["offset"] == len(tokens)


def _read(t, tokens, file_path):
    """One scheduler read: the layers are checked, then dropped (the entry is
    freed, which hands its buffers back to the RAM tier)."""
    layers = t._read_entry(tokens, file_path)
    _same_bits(layers, tokens)
    del layers
    gc.collect()


def test_prefix_and_entry_second_read_from_ram(cache_dir):
    t = make_tier(cache_dir, chunk_tokens=C, host_cache_bytes=256 << 20)
    t.start_writer()
    try:
        convs = [SYS + [20000 + c * 300 + i for i in range(300)] for c in range(2)]
        for conv in convs:
            spill(t, conv)
        t.flush(timeout=WAIT)
        s0 = t.get_stats()
        assert s0["host_cache_entries"] == 2  # the copy-mode spills
        # Their tails, and the system prompt's chunks once (4 of them) plus
        # each conversation's own chunk (1024 + 300 tokens: 5 chunks each).
        assert s0["host_cache_chunks"] == 4 + 2
        assert s0["host_cache_chunk_bytes"] >= 6 * C * TOKB
        assert s0["host_cache_bytes_used"] < 2 * (len(SYS) + 300) * TOKB
        # A new prompt: the system prompt + 300 new tokens.
        prompt = tuple(SYS + [90000 + i for i in range(300)])
        assert t.lookup_ssd(prompt) is None
        hit = t.lookup_ssd_prefix(prompt)
        assert hit is not None
        m = hit["num_tokens"]
        assert m == len(SYS) and m % C == 0
        hits = []
        for _ in range(2):
            _read(t, prompt[:m], hit["file_path"])
            t._index.touch(prompt[:m])  # the scheduler's only touch
            hits.append(t.get_stats()["host_cache_hits"])
        # Both reads: the system prompt's chunks, cached by the spills.
        assert hits[0] == s0["host_cache_hits"] + 1
        assert hits[1] == hits[0] + 1
        s = t.get_stats()
        assert s["host_cache_entries"] == 2  # a prefix is its chunks
        assert s["host_cache_chunks"] == s0["host_cache_chunks"]
        assert s["host_cache_verify_failures"] == 0
        assert 0 < s["host_cache_bytes_used"] <= s["host_cache_bytes_bound"]
        # A chained entry (4 chunks + 44 tail rows) spilled a moment ago.
        conv = tuple(convs[1])
        info = t.lookup_ssd(conv)
        assert info is not None
        _read(t, conv, info["file_path"])
        b = Budget()
        got = run(t.async_promote(conv, b.reserve, b.release))
        _same_bits(got, conv)
        del got
        gc.collect()
        s = t.get_stats()
        assert s["host_cache_hits"] == hits[1] + 2
        assert s["promotes_from_ram"] == 1 and s["promotes_from_disk"] == 0
        # Capacity: everything evicted, the cached prefix with its chain.
        o = L.GcOpts(1, 1, 0, -1, 0)  # max_bytes=1: kvt_tier_gc
        L.check(L.kvt_tier_gc(t._h.ptr, ctypes.byref(o), None, None), "gc")
        s = t.get_stats()
        assert s["host_cache_entries"] == 0
        assert s["host_cache_chunks"] == 0 and s["host_cache_bytes_used"] == 0
        assert t.lookup_ssd_prefix(prompt) is None
        assert t._read_entry(prompt[:m], hit["file_path"]) is None
    finally:
        t.close()


def test_bound_with_chunked_entries(cache_dir):
    """Three chained entries sharing the system prompt hold it once;
    set_host_cache_bytes and trim shrink the cache before they return;
    bytes used never exceed the bound."""
    t = make_tier(cache_dir, chunk_tokens=C, host_cache_bytes=256 << 20)
    t.start_writer()
    try:
        for c in range(3):
            spill(t, SYS + [40000 + c * 300 + i for i in range(100)])
        t.flush(timeout=WAIT)
        s = t.get_stats()
        assert s["host_cache_entries"] == 3
        assert s["host_cache_chunks"] == 4  # 1124 tokens: 4 chunks, shared
        unique = (len(SYS) + 3 * 100) * TOKB
        assert unique <= s["host_cache_bytes_used"] <= unique * 11 // 10
        one = (len(SYS) + 100) * TOKB * 5 // 4
        t.set_host_cache_bytes(one // 2)
        s = t.get_stats()
        assert s["host_cache_chunks"] < 4
        assert s["host_cache_bytes_used"] <= one // 2 == s["host_cache_bytes_bound"]
        assert t.trim(0) > 0
        assert t.get_stats()["host_cache_bytes_used"] == 0
    finally:
        t.close()


def test_hybrid_entry_second_read_from_ram(cache_dir):
    """A chained entry of a hybrid model (KV layers chunked, an arrays layer
    in the tail): the second read comes from RAM with the KV and the arrays
    state exactly as spilled."""
    t = make_tier(cache_dir, chunk_tokens=C, host_cache_bytes=256 << 20)
    t.start_writer()
    try:
        full = tuple(SYS + [5, 6, 7])
        spill(t, full, hybrid=True)
        t.flush(timeout=WAIT)
        info = t.lookup_ssd(full)
        assert info is not None
        for _ in range(2):
            layers = t._read_entry(full, info["file_path"])
            assert layers is not None and len(layers) == LAYERS + 1
            _same_bits(layers[:LAYERS], full)
            st = np.asarray(layers[-1]["state"][0])
            assert st.shape == (1, 3, 8) and float(st.flat[0]) == float(len(full))
            del layers, st  # the entry is freed: back into the RAM tier
            gc.collect()
        s = t.get_stats()
        assert s["host_cache_hits"] == 2  # both reads: the spill was cached
        assert s["host_cache_verify_failures"] == 0
        assert s["host_cache_entries"] == 1
    finally:
        t.close()


def test_pure_chain_entry_served_from_ram_on_defaults(cache_dir):
    """An entry whose length is a multiple of chunk_tokens is stored as its
    chain record alone (no tail files).  On the default SSDCacheConfig (chunks,
    RAM tier, fsync) its second promote and read are served from host RAM,
    bit for bit, with no RAM copy failing its check."""
    from kvtier.ssd_cache import SSDCacheConfig, SSDCacheTier

    cfg = SSDCacheConfig(cache_dir=cache_dir)
    assert cfg.chunk_tokens and 1024 % cfg.chunk_tokens == 0
    t = SSDCacheTier(cfg)
    t.start_writer()
    try:
        toks = tuple(range(5000, 5000 + 1024))
        spill(t, toks)
        t.flush(timeout=WAIT)
        hit = t.lookup_ssd(toks)
        assert hit is not None
        assert os.path.exists(os.path.join(cache_dir, "data", hit["file_path"], "chain.kvr"))
        for _ in range(2):
            b = Budget()
            layers = run(t.async_promote(toks, b.reserve, b.release))
            _same_bits(layers, toks)
            del layers
            gc.collect()
        _read(t, toks, hit["file_path"])
        s = t.get_stats()
        assert s["host_cache_verify_failures"] == 0
        assert s["host_cache_hits"] == 3
        assert s["promotes_from_ram"] == 2 and s["promotes_from_disk"] == 0
    finally:
        t.close()
