"""Single layers of mlx-lm's own cache classes (loaded from ../shared/upstream
over the numpy MLX stand-in, tests/realclient) through kvtier.ssd_cache on its
default configuration: what the real client hands over is classified as the
reference classifies it, spilled, and comes back in a form the scheduler's
_reconstruct_ssd_layers (scheduler.py's own code) rebuilds; a chunk-aligned
prefix that check_ssd offers is promoted by both scheduler paths."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import types

import numpy as np
import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "realclient"))

import loader  # noqa: E402

if loader.upstream_dir() is None:
    pytest.skip("upstream: ../shared/upstream (the vllm-mlx / mlx-lm client code) not found",
                allow_module_level=True)

C = loader.load_client()
mx, cm, mc = C.mx, C.cache, C.memory_cache

import kvtier.ssd_cache as kv  # noqa: E402
import ssd_cache_ref as ref  # noqa: E402
import server as srv  # noqa: E402

TOKENS = [int(x) for x in np.random.default_rng(3).integers(1000, 30000, 600)]


def filled(layer, n=300, li=0):
    """layer after a prefill of TOKENS[:n] through its own update_and_fetch."""
    srv.Model(C, ["kv"])._feed(layer, TOKENS, 0, n, li, 0)
    return layer


def default_tier(d):
    """The tier ensure_ssd_tier builds: cache_dir and max_size_gb only."""
    t = kv.SSDCacheTier(kv.SSDCacheConfig(cache_dir=d, max_size_gb=10.0))
    t.start_writer()
    return t


def scheduler(d, tier, budget_mb=64):
    pc = mc.MemoryAwarePrefixCache(types.SimpleNamespace(),
                                   mc.MemoryCacheConfig(max_memory_mb=budget_mb))
    s = loader.make_scheduler_class(kv, C)(d, pc)
    s._ssd_tier = tier
    pc.set_ssd_tier(tier)
    return s, pc


def every_class():
    wrapped = cm.RotatingKVCache(max_size=128, keep=4)
    filled(wrapped, 300)
    return {
        "KVCache": filled(cm.KVCache()),
        "RotatingKVCache": filled(cm.RotatingKVCache(max_size=4096, keep=4)),
        "RotatingKVCache-wrapped": wrapped,
        "QuantizedKVCache": filled(cm.QuantizedKVCache(group_size=64, bits=4)),
        "ChunkedKVCache": filled(cm.ChunkedKVCache(4096)),
        "ArraysCache": filled(cm.ArraysCache(2)),
        "CacheList": filled(cm.CacheList(cm.KVCache(), cm.KVCache())),
        "_QuantizedCacheWrapper": mc._QuantizedCacheWrapper(filled(cm.KVCache()), 8, 64),
    }


def serializer_name(mod, layer):
    try:
        return type(mod.get_serializer_for_layer(layer)).__name__
    except ValueError:
        return "refused"


@pytest.mark.parametrize("name", list(every_class()))
def test_classes_get_the_reference_serializer(name):
    layer = every_class()[name]
    assert serializer_name(kv, layer) == serializer_name(ref, layer)


def test_kvcache_snapshot_keeps_step_and_serializes(tmp_path):
    # mlx-lm's KVCache carries step = 256 (a class attribute): the snapshot
    # records it as the reference's does, and the layer is written as a plain
    # KV layer (the old classification took it for a rotating one and
    # refused it: "rotating layer needs max_size").
    layer = filled(cm.KVCache())
    ser = kv.get_serializer_for_layer(layer)
    snap = ser.snapshot_layer(layer)
    assert snap["step"] == 256 and "max_size" not in snap
    assert list(snap) == list(ref.KVCacheSerializer().snapshot_layer(layer))
    meta = ser.serialize_layer(snap, 0, str(tmp_path / "layer_0.safetensors"))
    assert meta["layer_type"] == "KVCache" and meta["step"] == 256 and "max_size" not in meta
    back = ser.deserialize_layer(str(tmp_path / "layer_0.safetensors"), meta)
    assert np.array_equal(back["keys"], np.asarray(layer.keys)) and back["step"] == 256
    json.dumps(meta)


@pytest.mark.parametrize("name", ["KVCache", "RotatingKVCache", "RotatingKVCache-wrapped",
                                  "ChunkedKVCache"])
def test_kv_classes_spill_and_rebuild(tmp_path, name):
    layer = every_class()[name]
    t = default_tier(str(tmp_path / "c"))
    try:
        toks = tuple(TOKENS[:300])
        assert t.enqueue_spill(toks, [layer], 1000) is True
        t.flush(timeout=60)
        got = t._read_entry(toks, t.lookup_ssd(toks)["file_path"])
        d = got[0]
        assert np.array_equal(d["keys"], np.asarray(layer.keys))
        assert np.array_equal(d["values"], np.asarray(layer.values))
        for a in ("offset", "max_size", "keep", "step", "_idx"):
            assert d.get(a) == (getattr(layer, a) if hasattr(layer, a) else None), a
        s, _ = scheduler(str(tmp_path / "c"), t)
        rebuilt = s._reconstruct_ssd_layers(got)
        assert rebuilt is not None and rebuilt[0].offset == layer.offset
    finally:
        t.close()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("wrapper", [False, True])
def test_native_quantized_layer_rebuilds(tmp_path, bits, wrapper):
    # Stored packed (storage_mode "native", the default), promoted dense:
    # the scheduler rebuilds it (a (packed, scales, biases) tuple made
    # mx.array fail and every such hit a miss).
    if wrapper:
        layer = mc._QuantizedCacheWrapper(filled(cm.KVCache()), bits, 64)
        layer.keys = tuple(a[..., :300, :] for a in layer.keys)  # as store() trims
        layer.values = tuple(a[..., :300, :] for a in layer.values)
    else:
        layer = filled(cm.QuantizedKVCache(group_size=64, bits=bits))
        assert layer.keys[0].shape[-2] == 512 and layer.offset == 300  # padded
    want_k = np.asarray(mx.dequantize(*layer.keys, group_size=64, bits=bits))[..., :300, :]
    want_v = np.asarray(mx.dequantize(*layer.values, group_size=64, bits=bits))[..., :300, :]
    t = default_tier(str(tmp_path / "c"))
    try:
        toks = tuple(TOKENS[:300])
        assert t.enqueue_spill(toks, [layer], 1000) is True
        t.flush(timeout=60)
        s, pc = scheduler(str(tmp_path / "c"), t)
        for path in ("sync", "async"):
            pc.clear()
            req = types.SimpleNamespace(request_id=f"r-{path}", prompt_token_ids=list(toks),
                                        cache_hit_type="ssd_pending",
                                        _ssd_candidate=pc.check_ssd(list(toks)))
            if path == "sync":
                s.waiting = [req]
                s._try_promote_ssd_pending()
            else:
                asyncio.run(s.promote_from_ssd(req))
            assert req.cache_hit_type == "ssd_hit", path
            got = req.prompt_cache[0]
            assert type(got).__name__ == "KVCache" and got.offset == 300
            assert np.asarray(got.keys).dtype == want_k.dtype
            assert np.array_equal(np.asarray(got.keys), want_k)
            assert np.array_equal(np.asarray(got.values), want_v)
    finally:
        t.close()


@pytest.mark.parametrize("path", ["sync", "async"])
def test_chain_prefix_candidate_is_promoted(tmp_path, path):
    # One 600-token spill; a prompt sharing its first 530 tokens: check_ssd
    # offers the chunk-aligned 512-token prefix (no spill ended there), and
    # both scheduler paths must serve it, memory_bytes being what is loaded.
    layers = [filled(cm.KVCache(), 600, li) for li in range(2)]
    t = default_tier(str(tmp_path / "c"))
    try:
        assert t.enqueue_spill(tuple(TOKENS), layers, 123456) is True
        t.flush(timeout=60)
        s, pc = scheduler(str(tmp_path / "c"), t)
        prompt = TOKENS[:530] + [7] * 40
        cand = pc.check_ssd(prompt)
        assert cand is not None and cand["matched_tokens"] == 512
        req = types.SimpleNamespace(request_id="r", prompt_token_ids=prompt,
                                    cache_hit_type="ssd_pending", _ssd_candidate=cand)
        if path == "sync":
            s.waiting = [req]
            s._try_promote_ssd_pending()
        else:
            asyncio.run(s.promote_from_ssd(req))
        assert req.cache_hit_type == "ssd_hit"
        assert req.cached_tokens == 512 and req.remaining_tokens == prompt[512:]
        loaded = 0
        for li, lay in enumerate(req.prompt_cache):
            k, v = srv.model_rows(TOKENS, 0, 512, li)
            assert lay.offset == 512
            assert np.array_equal(np.asarray(lay.keys), k)
            assert np.array_equal(np.asarray(lay.values), v)
            loaded += np.asarray(lay.keys).nbytes + np.asarray(lay.values).nbytes
        assert cand["memory_bytes"] == loaded
        assert t.get_stats()["ssd_hits"] == 1
    finally:
        t.close()


def _promote(s, pc, prompt, path):
    cand = pc.check_ssd(prompt)
    req = types.SimpleNamespace(request_id=f"r-{path}", prompt_token_ids=prompt,
                                cache_hit_type="ssd_pending", _ssd_candidate=cand)
    if path == "sync":
        s.waiting = [req]
        s._try_promote_ssd_pending()
        s.waiting = []
    else:
        asyncio.run(s.promote_from_ssd(req))
    return cand, req


@pytest.mark.parametrize("path", ["sync", "async"])
@pytest.mark.parametrize("kind", ["q4", "q8", "wrapper", "mixed"])
def test_quantized_chain_prefix_reserves_what_it_loads(tmp_path, kind, path):
    # A quantized layer is chunked packed and promoted dense (dequantized,
    # so _reconstruct_ssd_layers rebuilds a KVCache): a chain prefix's
    # memory_bytes (computed by kvtier from the chain, nobody spilled it) is
    # the dense bytes the promote loads, before and after a reopen - the
    # packed size under-reserved the budget by up to 3.6x.  Both paths also
    # release what they reserved.
    def quantized(li, bits):
        if kind == "wrapper":
            lay = mc._QuantizedCacheWrapper(filled(cm.KVCache(), 600, li), 8, 64)
            lay.keys = tuple(a[..., :600, :] for a in lay.keys)  # as store() trims
            lay.values = tuple(a[..., :600, :] for a in lay.values)
            return lay
        return filled(cm.QuantizedKVCache(group_size=64, bits=bits), 600, li)

    if kind == "mixed":
        layers = [filled(cm.KVCache(), 600, 0), quantized(1, 4), quantized(2, 8)]
    else:
        layers = [quantized(li, 4 if kind == "q4" else 8) for li in range(2)]
    d = str(tmp_path / "c")
    t = default_tier(d)
    try:
        assert t.enqueue_spill(tuple(TOKENS), layers, 4321) is True
        t.flush(timeout=60)
        for round_ in ("written", "reopened"):
            if round_ == "reopened":
                t.close()
                t = default_tier(d)
            s, pc = scheduler(d, t)
            prompt = TOKENS[:530] + [7] * 40
            assert t.lookup_ssd(tuple(TOKENS[:512])) is None  # no spill ended there
            before = pc._current_memory
            cand, req = _promote(s, pc, prompt, path)
            assert cand is not None and cand["matched_tokens"] == 512
            assert req.cache_hit_type == "ssd_hit", (round_, path)
            loaded = 0
            for lay in req.prompt_cache:
                assert type(lay).__name__ == "KVCache" and lay.offset == 512
                loaded += lay.keys.nbytes + lay.values.nbytes
            assert cand["memory_bytes"] == loaded, round_
            # store() accounted the entry; the reservation was given back whole.
            assert pc._current_memory - before == mc.estimate_kv_cache_memory(req.prompt_cache)
    finally:
        t.close()


def test_front_trimmed_chunked_kvcache_is_refused_with_its_reason(tmp_path, caplog):
    # Past chunk_size mlx-lm's ChunkedKVCache drops its oldest rows (row i is
    # then token start_position + i): stored as a KV layer it would be cut
    # into chunks and prefixes serving other tokens' rows.  The reference
    # stores it (and rebuilds a KVCache whose rows are misaligned); kvtier
    # refuses it and says why.
    layer = cm.ChunkedKVCache(128)
    model = srv.Model(C, ["chunked:128"])
    for a in range(0, 300, 50):
        model._feed(layer, TOKENS, a, a + 50, 0, 0)
    assert layer.start_position > 0
    t = default_tier(str(tmp_path / "c"))
    try:
        with caplog.at_level("WARNING"):
            assert t.enqueue_spill(tuple(TOKENS[:300]), [layer], 1) is False
        assert "start_position" in caplog.text
        assert t.lookup_ssd(tuple(TOKENS[:300])) is None
    finally:
        t.close()
