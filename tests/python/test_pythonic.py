"""kvtier.Tier, the Pythonic interface: exceptions instead of False/None,
sync/async/prefix promote, maintenance calls and metrics."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

import kvtier
from conftest import ArraysLayer, Budget, kv_layer


@pytest.fixture
def tier(cache_dir):
    t = kvtier.Tier(cache_dir, durability="none")
    yield t
    t.close()


def test_spill_promote_entry_object(tier, rng):
    toks = tuple(range(12))
    layer = kv_layer(rng, 12, np.float32)
    tier.spill(toks, [layer])
    tier.flush(30)
    info = tier.lookup(toks)
    assert info.num_tokens == 12 and info.memory_bytes == layer.keys.nbytes * 2
    assert toks in tier and (1, 2) not in tier and len(tier) == 1
    e = tier.promote(toks)
    assert e.tokens == toks and e.token_hash == info.token_hash and len(e) == 1
    assert np.array_equal(e.layers[0]["keys"], layer.keys)
    assert e.storage_mode == "native" and e.disk_bytes > 0
    assert tier.promote((9, 9)) is None
    assert tier.promote(toks + (5,), prefix=True).tokens == toks
    assert tier.stats()["ssd_hits"] == 2


def test_promote_keep_trims_to_a_prefix(tier, rng):
    toks = tuple(range(100, 140))
    layer = kv_layer(rng, 40, np.float16)
    tier.spill(toks, [layer, kv_layer(rng, 40, np.float16)], 4000)
    tier.flush(30)
    b = Budget()
    e = tier.promote(toks, keep=10, reserve=b.reserve, release=b.release)
    assert e.tokens == toks[:10] and len(e) == 2
    assert b.reserved == 1000 and e.reserved_bytes == 1000  # 4000 * 10 / 40
    assert e.layers[0]["keys"].shape[-2] == 10
    assert np.array_equal(e.layers[0]["keys"], layer.keys[..., :10, :])
    assert np.array_equal(e.layers[0]["values"], layer.values[..., :10, :])
    # keep == len(tokens) is a plain promote; the stored entry is unchanged
    assert tier.promote(toks, keep=40).tokens == toks
    assert tier.promote(toks[:-1], keep=5) is None  # no entry for exactly these
    with pytest.raises(ValueError):
        tier.promote(toks, keep=41)
    # out of range however large: never taken modulo 2**64 (2**64 + 5 once
    # promoted 5 tokens)
    for bad in (2**64 + 5, 2**64, -1, -(2**64) + 5):
        with pytest.raises(ValueError):
            tier.promote(toks, keep=bad)
    with pytest.raises(ValueError):
        tier.promote(toks, keep=5, prefix=True)
    arr = ArraysLayer([rng.standard_normal((1, 4)).astype(np.float32)])
    tier.spill((7, 7, 7), [arr])
    tier.flush(30)
    with pytest.raises(NotImplementedError):
        tier.promote((7, 7, 7), keep=1)


def test_budget_refused_and_reserved_bytes(tier, rng):
    tier.spill((1, 2), [kv_layer(rng, 2)], 500)
    tier.flush(30)
    with pytest.raises(kvtier.BudgetRefused):
        tier.promote((1, 2), reserve=lambda n: False, release=lambda n: None)
    # reserve and release are each optional: a reserve alone is an admission
    # check (nothing is handed back), not an error
    asked = []
    e = tier.promote((1, 2), reserve=lambda n: asked.append(n) or True)
    assert e is not None and asked == [500] and e.reserved_bytes == 500
    asked.clear()
    with pytest.raises(kvtier.BudgetRefused):
        tier.promote((1, 2), reserve=lambda n: asked.append(n) and False)
    assert asked == [500]
    b = Budget()
    e = tier.promote((1, 2), reserve=b.reserve, release=b.release)
    assert e.reserved_bytes == 500 and b.reserved == 500


def test_promote_async(tier, rng):
    layer = kv_layer(rng, 5)
    tier.spill((5,) * 5, [layer])
    tier.flush(30)
    e = asyncio.run(tier.promote_async((5,) * 5))
    assert np.array_equal(e.layers[0]["values"], layer.values)


def _front_end_promote(which, cache_dir):
    """An open tier of either front end and its async promote as
    promote(tokens, budget) -> the layers' values array of layer 0 or None."""
    if which == "Tier":
        t = kvtier.Tier(cache_dir, durability="none")

        async def promote(toks, b):
            e = await t.promote_async(toks, reserve=b.reserve, release=b.release)
            return None if e is None else e.layers[0]["values"]
        return t, t.spill, promote
    t = kvtier.ssd_cache.SSDCacheTier(kvtier.ssd_cache.SSDCacheConfig(
        cache_dir=cache_dir, durability="none"))
    t.start_writer()

    async def promote(toks, b):
        got = await t.async_promote(toks, b.reserve, b.release)
        return None if got is None else got[0]["values"]
    return t, lambda toks, layers: t.enqueue_spill(toks, layers, 1000), promote


@pytest.mark.parametrize("which", ["Tier", "SSDCacheTier"])
@pytest.mark.parametrize("no_watch", ["no fd", "no add_reader"])
def test_async_promote_polls_when_the_loop_cannot_watch_the_promise(
        which, no_watch, cache_dir, rng, monkeypatch):
    """Without a promise fd, or on a loop without add_reader, both front ends
    wait by polling the promise and return the entry all the same."""
    t, spill, promote = _front_end_promote(which, cache_dir)
    try:
        layer = kv_layer(rng, 6)
        spill((6,) * 6, [layer])
        t.flush(30)
        if no_watch == "no fd":
            monkeypatch.setattr(kvtier._lib, "kvt_promise_fd", lambda p: -1)

        async def main(b):
            if no_watch == "no add_reader":
                def refuse(*_a):
                    raise NotImplementedError
                asyncio.get_running_loop().add_reader = refuse
            return await promote((6,) * 6, b)

        b = Budget()
        assert np.array_equal(asyncio.run(main(b)), layer.values)
        assert b.calls == [("reserve", b.reserved)] and b.reserved > 0
    finally:
        t.close()


@pytest.mark.parametrize("which", ["Tier", "SSDCacheTier"])
def test_cancelled_async_promote_cancels_and_frees_the_promise_once(
        which, cache_dir, rng, monkeypatch):
    """A task cancelled while it awaits the promise cancels it and frees it,
    each exactly once, never collects it, and gets the reservation back once
    on its own thread; the CancelledError reaches the caller."""
    t, spill, promote = _front_end_promote(which, cache_dir)
    r, w = os.pipe()  # never written: the promise never looks ready
    calls = []
    for name in ("kvt_promise_fd", "kvt_promise_cancel", "kvt_promise_free",
                 "kvt_promise_result"):
        real = getattr(kvtier._lib, name)

        def spy(*a, _real=real, _name=name):
            calls.append(_name)
            rc = _real(*a)
            return r if _name == "kvt_promise_fd" else rc
        monkeypatch.setattr(kvtier._lib, name, spy)
    try:
        spill((7,) * 7, [kv_layer(rng, 7)])
        t.flush(30)
        b = Budget()

        async def main():
            task = asyncio.ensure_future(promote((7,) * 7, b))
            while "kvt_promise_fd" not in calls:
                await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(main())
        assert calls == ["kvt_promise_fd", "kvt_promise_cancel", "kvt_promise_free"]
        assert [c for c, _n in b.calls] == ["reserve", "release"] and b.reserved == 0
    finally:
        os.close(r)
        os.close(w)
        t.close()


def test_queue_full_raises(cache_dir, rng):
    t = kvtier.Tier(cache_dir, spill_queue_size=1, start_writer=False, durability="none")
    try:
        t.spill((1,), [kv_layer(rng, 1)])
        with pytest.raises(kvtier.QueueFull):
            t.spill((2,), [kv_layer(rng, 1)])
    finally:
        t.close()


def test_maintenance(tier, rng, cache_dir):
    for i in range(4):
        tier.spill((i, i), [kv_layer(rng, 2)])
    tier.flush(30)
    ents = tier.entries()
    assert len(ents) == 4 and all(isinstance(x, kvtier.EntryInfo) for x in ents)
    h = tier.lookup((1, 1)).token_hash
    d = tier.describe(h)
    assert isinstance(d, dict) and "layers" in str(d)
    tier.verify(h)
    path = os.path.join(cache_dir, "data", h, "layer_0.safetensors")
    with open(path, "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\x7f\x7f\x7f\x7f")
    with pytest.raises(kvtier.KvtierCorrupt):
        tier.verify(h)
    assert tier.touch((2, 2)) and not tier.touch((8, 8))
    assert tier.remove((3, 3)) and not tier.remove((3, 3))
    removed, nbytes = tier.gc(max_entries=1)
    assert removed >= 1 and len(tier) == 1
    assert "kvtier_" in tier.prometheus()
    assert tier.path == os.path.abspath(cache_dir)


def test_buffers_pool_controls(cache_dir, rng):
    # The host RAM tier off: a promoted entry's tensors would go to it, not
    # back to the pool, once freed.
    tier = kvtier.Tier(cache_dir, durability="none", host_cache_bytes=0)
    before = kvtier.buffers()
    assert set(before) == {"idle_bytes", "out_bytes", "idle_cap"}
    try:
        assert kvtier.buffers(idle_cap=256 << 20)["idle_cap"] == 256 << 20
        toks = tuple(range(2048))
        tier.spill(toks, [kv_layer(rng, 2048, np.float16, heads=8, dim=128)])
        tier.flush(30)
        e = tier.promote(toks)
        del e  # the entry's tensors go back to the pool
        import gc
        gc.collect()
        assert kvtier.buffers()["idle_bytes"] >= 2 * 8 * 2048 * 128 * 2
        assert kvtier.buffers(trim=True)["idle_bytes"] == 0
        with pytest.raises(ValueError):
            kvtier.buffers(idle_cap=-1)
    finally:
        kvtier.buffers(idle_cap=before["idle_cap"])
        tier.close()


def test_tier_chunk_options_and_hybrid_prefix_states(cache_dir, rng):
    """kvtier.Tier takes chunk_tokens/model_id; a hybrid model (KV + state)
    gets prefix hits only where spill_prefix stored the state of that length,
    with exactly that state."""
    with pytest.raises(ValueError):
        kvtier.Tier(cache_dir, chunk_tokens=24)
    t = kvtier.Tier(cache_dir, durability="none", chunk_tokens=16, model_id="hyb")
    try:
        toks = tuple(range(1000, 1100))
        kv = kv_layer(rng, 100, np.float16)
        states = {m: ArraysLayer([np.full((1, 4), m, np.float32)]) for m in (32, 64, 100)}
        t.spill(toks, [kv, states[100]])
        for m in (32, 64):
            t.spill_prefix(toks, m, [kv, states[m]])
        with pytest.raises(ValueError):
            t.spill_prefix(toks, 0, [kv, states[32]])
        t.flush(30)
        for shared, want in ((100, 100), (80, 64), (50, 32), (20, None)):
            q = toks[:shared] + tuple(-i for i in range(1, 20))
            info = t.lookup_prefix(q)
            if want is None:
                assert info is None
                continue
            assert info.num_tokens == want
            e = t.promote(q, prefix=True)
            assert e.tokens == toks[:want]
            assert np.array_equal(e.layers[1]["state"][0], states[want].state[0])
            assert np.array_equal(e.layers[0]["keys"], kv.keys[:, :, :want, :])
    finally:
        t.close()
