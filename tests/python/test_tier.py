"""SSDCacheTier through libkvtier: the reference's documented behaviours
(spill, lookups, prefix, promote with reserve-before-read and release on
failure, cancellation, queue full, reconcile, close/aclose/timeout), the
scheduler's private hooks, and the returned layer dicts."""

from __future__ import annotations

import asyncio
import glob
import os
import shutil

import numpy as np
import pytest

import mlx_standin
import ssd_cache_ref as ref
from conftest import (ArraysLayer, Budget, KVLayer, QuantizedLayer, RotatingLayer, drop_ram_copies,
                      kv_layer, make_tier, run)
from kvtier import ssd_cache as kv

pytestmark = pytest.mark.tier_profiles  # defaults and the bare disk path (conftest)


def ref_stat_keys():
    return list(ref.SSDCacheStats().to_dict())


def _spill_and_flush(tier, tokens, layers, mem=1000):
    assert tier.enqueue_spill(tokens, layers, mem) is True
    tier.flush(timeout=30)


@pytest.fixture
def tier(cache_dir):
    t = make_tier(cache_dir)
    t.start_writer()
    yield t
    t.close()


def test_spill_lookup_promote_roundtrip(tier, rng):
    toks = tuple(range(10, 30))
    layers = [kv_layer(rng, 20), kv_layer(rng, 20, np.float32),
              ArraysLayer([rng.standard_normal((1, 4)).astype(np.float32)]),
              RotatingLayer(rng.standard_normal((1, 2, 4, 8)).astype(np.float16),
                            rng.standard_normal((1, 2, 4, 8)).astype(np.float16),
                            20, 4, 2, 256, 3)]
    _spill_and_flush(tier, toks, layers, mem=123456)
    assert tier.lookup_ssd(toks) == {"file_path": kv._tokens_hash(toks),
                                     "memory_bytes": 123456, "num_tokens": 20}
    assert tier.lookup_ssd(toks[:-1]) is None
    b = Budget()
    got = run(tier.async_promote(toks, b.reserve, b.release))
    assert b.calls == [("reserve", 123456)] and b.reserved == 123456
    assert len(got) == 4
    assert set(got[0]) == {"keys", "values", "offset"}
    assert got[0]["offset"] == 20 and got[0]["keys"].dtype == np.float16
    assert np.array_equal(got[0]["keys"], layers[0].keys)
    assert np.array_equal(got[1]["values"], layers[1].values)
    assert set(got[2]) == {"state"} and np.array_equal(got[2]["state"][0], layers[2].state[0])
    assert {k: got[3][k] for k in ("offset", "max_size", "keep", "step", "_idx")} == \
        {"offset": 20, "max_size": 4, "keep": 2, "step": 256, "_idx": 3}
    st = tier.get_stats()
    assert list(st)[: len(ref_stat_keys())] == ref_stat_keys()
    assert st["ssd_hits"] == 1 and st["spill_count"] == 1 and st["ssd_misses"] == 0
    assert st["reload_bytes"] > 0 and st["spill_bytes"] > 0


def test_prefix_lookup(tier, rng):
    base = tuple(range(100, 150))
    for n in (5, 20, 40):
        _spill_and_flush(tier, base[:n], [kv_layer(rng, n)])
    r = tier.lookup_ssd_prefix(base + (1, 2, 3))
    assert r == {"token_hash": kv._tokens_hash(base[:40]), "file_path": kv._tokens_hash(base[:40]),
                 "memory_bytes": 1000, "num_tokens": 40}
    assert tier.lookup_ssd_prefix(base[:30])["num_tokens"] == 20
    assert tier.lookup_ssd_prefix(base[:5])["num_tokens"] == 5
    assert tier.lookup_ssd_prefix(base[:4]) is None
    assert tier.lookup_ssd_prefix(()) is None


def test_miss_counts_and_returns_none(tier):
    b = Budget()
    assert run(tier.async_promote((1, 2, 3), b.reserve, b.release)) is None
    assert b.calls == []
    assert tier.get_stats()["ssd_misses"] == 1


def test_budget_refused_means_no_read(tier, rng):
    toks = (5, 6, 7)
    _spill_and_flush(tier, toks, [kv_layer(rng, 3)], mem=777)
    before = tier.get_stats()
    b = Budget(allow=False)
    assert run(tier.async_promote(toks, b.reserve, b.release)) is None
    assert b.calls == [("reserve", 777)]
    after = tier.get_stats()
    assert after["promotion_failures"] == before["promotion_failures"] + 1
    assert after["reload_bytes"] == before["reload_bytes"]  # nothing was read
    assert after["ssd_hits"] == before["ssd_hits"]


def test_reserve_exception_propagates_without_counting(tier, rng):
    toks = (8, 9)
    _spill_and_flush(tier, toks, [kv_layer(rng, 2)])

    def boom(n):
        raise RuntimeError("budget service down")

    with pytest.raises(RuntimeError, match="budget service down"):
        run(tier.async_promote(toks, boom, lambda n: None))
    assert tier.get_stats()["promotion_failures"] == 0


def test_corrupt_entry_releases_budget_and_quarantines(tier, rng, cache_dir):
    toks = tuple(range(40))
    _spill_and_flush(tier, toks, [kv_layer(rng, 40), kv_layer(rng, 40)], mem=4242)
    drop_ram_copies(tier)
    path = glob.glob(os.path.join(cache_dir, "data", kv._tokens_hash(toks), "layer_1.safetensors"))[0]
    with open(path, "r+b") as f:
        f.seek(-16, os.SEEK_END)
        f.write(b"\x00\x01" * 8)
    b = Budget()
    assert run(tier.async_promote(toks, b.reserve, b.release)) is None
    assert b.calls == [("reserve", 4242), ("release", 4242)] and b.reserved == 0
    st = tier.get_stats()
    assert st["promotion_failures"] == 1 and st["ssd_hits"] == 0
    assert tier.lookup_ssd(toks) is None  # quarantined and dropped from the index
    assert not os.path.exists(os.path.join(cache_dir, "data", kv._tokens_hash(toks)))


def test_missing_files_release_budget(tier, rng, cache_dir):
    toks = tuple(range(7))
    _spill_and_flush(tier, toks, [kv_layer(rng, 7)], mem=99)
    shutil.rmtree(os.path.join(cache_dir, "data", kv._tokens_hash(toks)))
    b = Budget()
    assert run(tier.async_promote(toks, b.reserve, b.release)) is None
    assert b.reserved == 0 and ("release", 99) in b.calls


def test_cancellation_waits_then_releases(tier, rng):
    # Big enough that the read is usually still running when the task is
    # cancelled; the contract must hold either way.
    toks = tuple(range(1000, 1064))
    layers = [KVLayer(rng.standard_normal((1, 8, 64, 256)).astype(np.float32),
                      rng.standard_normal((1, 8, 64, 256)).astype(np.float32), 64)
              for _ in range(4)]
    _spill_and_flush(tier, toks, layers, mem=5_000_000)
    # A read of 4 MiB from the page cache can finish before the cancel lands
    # (the worker thread races the event loop), so each trial accepts either
    # outcome but checks the budget contract of the one that happened; over
    # the trials a cancel after the reservation must have happened.
    cancels_after_reserve = 0
    for trial in range(12):
        delay_steps = trial % 3
        b = Budget()
        outcome = {}

        async def main():
            task = asyncio.ensure_future(tier.async_promote(toks, b.reserve, b.release))
            for _ in range(delay_steps):
                await asyncio.sleep(0)
            task.cancel()
            try:
                outcome["result"] = await task
            except asyncio.CancelledError:
                outcome["cancelled"] = True

        run(main())
        if delay_steps == 0:
            # Cancelled before the coroutine ran: nothing reserved or read.
            assert outcome == {"cancelled": True}
            assert b.calls == []
        elif outcome.get("cancelled"):
            # Reserved before the read; released exactly once after it stopped.
            assert b.calls == [("reserve", 5_000_000), ("release", 5_000_000)]
            assert b.reserved == 0
            cancels_after_reserve += 1
        else:
            # The read completed first: the reservation now belongs to the caller.
            assert outcome["result"] is not None
            assert b.calls == [("reserve", 5_000_000)]
            assert b.reserved == 5_000_000
    assert cancels_after_reserve > 0
    # The entry is intact and promotable afterwards.
    b = Budget()
    got = run(tier.async_promote(toks, b.reserve, b.release))
    assert got is not None and np.array_equal(got[3]["values"], layers[3].values)


def test_concurrent_promotes(tier, rng):
    entries = {}
    for i in range(6):
        toks = tuple(range(i * 100, i * 100 + 10 + i))
        layer = kv_layer(rng, len(toks))
        _spill_and_flush(tier, toks, [layer], mem=10 + i)
        entries[toks] = layer
    b = Budget()

    async def main():
        return await asyncio.gather(*(tier.async_promote(t, b.reserve, b.release)
                                      for t in entries))

    results = run(main())
    for (toks, layer), got in zip(entries.items(), results):
        assert np.array_equal(got[0]["keys"], layer.keys)
    assert b.reserved == sum(10 + i for i in range(6))
    assert tier.get_stats()["ssd_hits"] == 6


def test_queue_full_returns_false(cache_dir, rng):
    t = make_tier(cache_dir, spill_queue_size=2)
    try:
        layers = [kv_layer(rng, 4)]
        assert t.enqueue_spill((1,), layers, 10) is True
        assert t.enqueue_spill((2,), layers, 10) is True
        assert t.enqueue_spill((3,), layers, 10) is False
        assert t.get_stats()["spill_drops"] == 1
        t.start_writer()
        t.flush(timeout=30)
        assert t.lookup_ssd((1,)) and t.lookup_ssd((2,)) and t.lookup_ssd((3,)) is None
    finally:
        t.close()


def test_unsupported_layer_returns_false(tier):
    class Nope:
        pass

    assert tier.enqueue_spill((1, 2), [Nope()], 10) is False
    assert tier.enqueue_spill((1, 2), [KVLayer(np.array([object()]), np.zeros(1), 1)], 10) is False


def test_spill_replaces_existing_entry(tier, rng):
    toks = (42, 43, 44)
    _spill_and_flush(tier, toks, [kv_layer(rng, 3)], mem=1)
    second = kv_layer(rng, 3)
    _spill_and_flush(tier, toks, [second], mem=2)
    assert tier.lookup_ssd(toks)["memory_bytes"] == 2
    got = tier._read_entry(toks, tier.lookup_ssd(toks)["file_path"])
    assert np.array_equal(got[0]["keys"], second.keys)


def test_capacity_evicts_lru(cache_dir, rng):
    # The LRU order of write_all; the default declines new prompts once full.
    t = make_tier(cache_dir, max_entries=3, admission_policy="write_all")
    t.start_writer()
    try:
        for i in range(5):
            _spill_and_flush(t, (i, i + 1), [kv_layer(rng, 2)])
        assert t.lookup_ssd((0, 1)) is None and t.lookup_ssd((1, 2)) is None
        assert all(t.lookup_ssd((i, i + 1)) for i in (2, 3, 4))
    finally:
        t.close()


def test_scheduler_private_hooks(tier, rng):
    toks = tuple(range(50, 60))
    layer = kv_layer(rng, 10)
    _spill_and_flush(tier, toks, [layer])
    # vllm-mlx: with tier._lock: tier._stats.ssd_hits += 1
    with tier._lock:
        tier._stats.ssd_hits += 1
    tier._stats.promotion_failures += 1
    tier._stats.promotion_failures += 2
    st = tier.get_stats()
    assert st["ssd_hits"] == 1 and st["promotion_failures"] == 3
    assert st["ssd_hit_rate"] == 1.0
    assert tier._stats.ssd_hits == 1
    # Synchronous read by file path (no stats, no budget).
    meta = tier.lookup_ssd(toks)
    got = tier._read_entry(toks, meta["file_path"])
    assert np.array_equal(got[0]["values"], layer.values)
    assert tier.get_stats()["reload_bytes"] == st["reload_bytes"]
    assert tier._read_entry(toks, "0" * 64) is None
    assert tier._read_entry(toks, "../../etc") is None
    # Touch marks recently used: touched entry survives the next eviction.
    tier._index.touch(toks)
    tier._index.touch((123456,))  # unknown: no error, as the reference


def test_touch_protects_from_eviction(cache_dir, rng):
    t = make_tier(cache_dir, max_entries=2)
    t.start_writer()
    try:
        _spill_and_flush(t, (1,), [kv_layer(rng, 1)])
        _spill_and_flush(t, (2,), [kv_layer(rng, 1)])
        t._index.touch((1,))
        _spill_and_flush(t, (3,), [kv_layer(rng, 1)])
        assert t.lookup_ssd((1,)) is not None
        assert t.lookup_ssd((2,)) is None
    finally:
        t.close()


def test_reconcile(tier, rng, cache_dir):
    a, b = (1, 1, 1), (2, 2, 2)
    _spill_and_flush(tier, a, [kv_layer(rng, 3)])
    _spill_and_flush(tier, b, [kv_layer(rng, 3)])
    os.remove(os.path.join(cache_dir, "data", kv._tokens_hash(a), "manifest.json"))
    orphan = os.path.join(cache_dir, "data", "f" * 64)
    os.mkdir(orphan, 0o700)
    # As the reference counts: a's row, then a's now unindexed directory, then the orphan.
    assert tier.reconcile() == 3
    assert tier.lookup_ssd(a) is None and tier.lookup_ssd(b) is not None
    assert not os.path.exists(orphan)
    assert tier.reconcile() == 0


def test_close_drains_and_rejects_later_spills(cache_dir, rng):
    t = make_tier(cache_dir)
    assert t._writer_thread is None
    t.start_writer()
    writer = t._writer_thread
    assert writer.is_alive()
    for i in range(8):
        assert t.enqueue_spill((7, i), [kv_layer(rng, 2)], 5)
    t.close()
    t.close()  # idempotent
    assert not writer.is_alive() and t._writer_thread is None  # as the reference
    assert t.enqueue_spill((9, 9), [kv_layer(rng, 2)], 5) is False
    t2 = make_tier(cache_dir)
    try:
        assert all(t2.lookup_ssd((7, i)) for i in range(8))
    finally:
        t2.close()


def test_close_timeout_keeps_tier_usable(cache_dir, rng):
    # Durable writes of a few MB cannot finish in 0 ms.
    t = make_tier(cache_dir, durability="fsync")
    big = [KVLayer(rng.standard_normal((1, 4, 64, 256)).astype(np.float32),
                   rng.standard_normal((1, 4, 64, 256)).astype(np.float32), 64)]
    for i in range(6):  # writer not started: close must start and drain it
        assert t.enqueue_spill((3, i), big, 5)
    with pytest.raises(TimeoutError):
        t.close(timeout=0)
    assert t.enqueue_spill((4, 4), big, 5) is False  # refuses spills from now on
    t.lookup_ssd((3, 0))  # still usable for lookups
    t.close(timeout=60)  # retry: drains the rest
    t.close()
    t2 = make_tier(cache_dir)
    try:
        assert all(t2.lookup_ssd((3, i)) for i in range(6))
        assert t2.lookup_ssd((4, 4)) is None
    finally:
        t2.close()


def test_aclose_and_async_context(cache_dir, rng):
    async def main():
        async with make_tier(cache_dir) as t:
            t.start_writer()
            assert t.enqueue_spill((1, 2), [kv_layer(rng, 2)], 5)
        assert t.enqueue_spill((1, 3), [kv_layer(rng, 2)], 5) is False
        t3 = make_tier(cache_dir)
        t3.start_writer()
        t3.enqueue_spill((5,), [kv_layer(rng, 1)], 5)
        await t3.aclose(timeout=30)
        return t3

    run(main())
    t2 = make_tier(cache_dir)
    try:
        assert t2.lookup_ssd((1, 2)) and t2.lookup_ssd((5,))
    finally:
        t2.close()


def test_promoted_layers_outlive_the_tier(cache_dir, rng):
    t = make_tier(cache_dir)
    t.start_writer()
    layer = kv_layer(rng, 16, np.float32)
    _spill_and_flush(t, (1, 2, 3), [layer])
    got = run(t.async_promote((1, 2, 3), lambda n: True, lambda n: None))
    t.close()
    del t
    import gc

    gc.collect()
    assert np.array_equal(got[0]["keys"], layer.keys)


@pytest.mark.parametrize("mode", ["native", "compat"])
def test_bf16_layers(cache_dir, rng, mode):
    t = make_tier(cache_dir, storage_mode=mode)
    t.start_writer()
    try:
        layer = kv_layer(rng, 9, "bf16")
        arr = ArraysLayer([mlx_standin.BF16Array(rng.standard_normal((2, 3))),
                           rng.standard_normal((4,)).astype(np.float32)])
        _spill_and_flush(t, (1, 9), [layer, arr])
        got = run(t.async_promote((1, 9), lambda n: True, lambda n: None))
        assert got[0]["keys"].dtype == np.float32
        assert got[0]["keys_original_dtype"] == "bfloat16"
        assert got[0]["values_original_dtype"] == "bfloat16"
        assert np.array_equal(got[0]["keys"], layer.keys.astype(np.float32))
        assert got[1]["state_original_dtypes"] == ["bfloat16", None]
        assert np.array_equal(got[1]["state"][0], arr.state[0].astype(np.float32))
        assert np.array_equal(got[1]["state"][1], arr.state[1])
    finally:
        t.close()
    files = glob.glob(os.path.join(cache_dir, "data", "*", "layer_0.safetensors"))
    import safetensors_np

    hdr = safetensors_np.parse_header(open(files[0], "rb").read())[0]
    assert hdr["layer_0_keys"]["dtype"] == ("BF16" if mode == "native" else "F32")


@pytest.mark.parametrize("mode", ["native", "compat"])
@pytest.mark.parametrize("scale_dtype", ["f16", "bf16"])
def test_quantized_layers(cache_dir, rng, mode, scale_dtype):
    sd = mlx_standin.bfloat16 if scale_dtype == "bf16" else np.float16
    n, s = 10, 13
    k = mlx_standin.quantize(rng.standard_normal((1, 2, s, 64)), 32, 4, sd)
    v = mlx_standin.quantize(rng.standard_normal((1, 2, s, 64)), 32, 4, sd)
    q = QuantizedLayer(k, v, n, 4, 32)
    t = make_tier(cache_dir, storage_mode=mode)
    t.start_writer()
    try:
        _spill_and_flush(t, (3, 1, 4), [q])
        got = run(t.async_promote((3, 1, 4), lambda n_: True, lambda n_: None))[0]
    finally:
        t.close()
    exp_k = mlx_standin.dequantize(*k, group_size=32, bits=4)[..., :n, :]
    exp_v = mlx_standin.dequantize(*v, group_size=32, bits=4)[..., :n, :]
    if mode == "native":
        # Stored packed, promoted dense as the reference promotes it (the
        # scheduler's _reconstruct_ssd_layers only rebuilds dense layers):
        # MLX's dequantization of the first offset rows, in the scales'
        # dtype (bf16 as float32 + hint, as every bf16 tensor comes back).
        assert "bits" not in got and got["offset"] == n
        for side, exp in (("keys", exp_k), ("values", exp_v)):
            if scale_dtype == "bf16":
                exp = exp.astype(np.float32)
                assert got[side + "_original_dtype"] == "bfloat16"
            assert got[side].dtype == exp.dtype and got[side].shape == (1, 2, n, 64)
            assert np.array_equal(got[side], exp)
    else:
        # compat: what the reference stores (dequantized, trimmed to offset).
        ek = exp_k.astype(np.float16) if scale_dtype == "bf16" else exp_k
        ev = exp_v.astype(np.float16) if scale_dtype == "bf16" else exp_v
        assert got["keys"].shape == (1, 2, n, 64) and got["offset"] == n
        assert got["keys"].dtype == ek.dtype and np.array_equal(got["keys"], ek)
        assert got["values"].dtype == ev.dtype and np.array_equal(got["values"], ev)
        if scale_dtype == "bf16":
            assert got["keys_original_dtype"] == "bfloat16"


def test_tokens_out_of_int32_range(tier, rng):
    assert tier.enqueue_spill((2**31,), [kv_layer(rng, 1)], 1) is False
    with pytest.raises(OverflowError):
        tier.lookup_ssd((2**40,))


def test_stats_keys_match_reference_and_rounding(tier):
    st = tier.get_stats()
    ref_d = ref.SSDCacheStats().to_dict()
    assert {k: st[k] for k in ref_d} == ref_d
    for k in ("spill_drops", "evictions", "quarantined", "entries"):
        assert k in st


def test_threads_spill_and_read_concurrently(tier):
    import threading

    errors = []

    def worker(k):
        try:
            r = np.random.default_rng(k)
            for i in range(20):
                toks = (k, i, 99)
                layer = kv_layer(r, 3, np.float32)
                while not tier.enqueue_spill(toks, [layer], 10):
                    tier.flush(timeout=30)
                tier.flush(timeout=30)
                got = tier._read_entry(toks, kv._tokens_hash(toks))
                assert got is not None and np.array_equal(got[0]["keys"], layer.keys)
                with tier._lock:
                    tier._stats.ssd_hits += 1
        except BaseException as e:  # reported below
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    assert tier.get_stats()["ssd_hits"] == 80
    assert tier.get_stats()["spill_count"] == 80


def test_unsafe_directory_refused_with_permission_error(tmp_path):
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o777)  # writable by everyone: kvtier refuses it
    with pytest.raises(PermissionError):
        make_tier(str(d))


@pytest.mark.parametrize("mode", ["native", "compat"])
def test_original_dtype_sentinels_survive_spill_per_side(cache_dir, rng, mode):
    # vllm-mlx casts bf16 KV to fp16 before the snapshot and leaves
    # _ssd_keys_original_dtype / _ssd_values_original_dtype on the layer so
    # the reload can cast back. Each side's hint is its own: a layer hinting
    # only its values, one hinting only its keys, and a quantized layer
    # hinting only its values come back with exactly those hints.
    only_v = kv_layer(rng, 9, np.float16)
    only_v._ssd_values_original_dtype = "bfloat16"
    only_k = kv_layer(rng, 9, np.float16)
    only_k._ssd_keys_original_dtype = "bfloat16"
    layers = [only_v, only_k]
    t = make_tier(cache_dir, storage_mode=mode)
    t.start_writer()
    try:
        _spill_and_flush(t, (4, 2, 9), layers)
        got = run(t.async_promote((4, 2, 9), lambda n: True, lambda n: None))
    finally:
        t.close()
    assert got[0].get("values_original_dtype") == "bfloat16", got[0].keys()
    assert got[0].get("keys_original_dtype") is None
    assert got[1].get("keys_original_dtype") == "bfloat16", got[1].keys()
    assert got[1].get("values_original_dtype") is None
    assert np.array_equal(got[0]["values"], only_v.values)
