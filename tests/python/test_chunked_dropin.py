"""The chunked native store through kvtier.ssd_cache, driven the way
vllm-mlx's scheduler drives it: spill the whole prompt on every eviction
(enqueue_spill), lookup_ssd then lookup_ssd_prefix, _read_entry(prompt[:m],
file_path), _index.touch(prompt[:m]).  Asserts issue 13's drop-in figures on
8-layer fp16 KV: 16 conversations sharing a 1024-token system prompt take at
most 1.25x the unique KV on disk; 8 turns of +512 tokens write at most 1.25x
the unique KV; a new prompt = the system prompt + 300 new tokens is served at
least 768 tokens, bit for bit; with chunking off the same prompt gets nothing
(the reference's behaviour), and a hybrid model (an arrays layer) never gets a
prefix whose state was not stored.  KV rows depend only on (token, position),
as the shared part of a real model's KV does.
"""

from __future__ import annotations

import os

import pytest
import numpy as np

import kvtier.ssd_cache

from conftest import ArraysLayer, kv_positional, make_tier

pytestmark = pytest.mark.tier_profiles  # defaults and the bare disk path (conftest)

C = 256
LAYERS, HEADS, DIM = 8, 4, 32
TOKB = LAYERS * 2 * HEADS * DIM * 2  # bytes of KV per token
WAIT = 60.0


def kv_for(tokens, hybrid=False):
    n = len(tokens)
    out = kv_positional(tokens, LAYERS, HEADS, DIM)
    if hybrid:
        st = np.full((1, 3, 8), float(n), dtype=np.float32)
        out.append(ArraysLayer([st]))
    return out


def disk_bytes(cache_dir):
    total = 0
    for sub in ("data", "chunks"):
        for root, _dirs, files in os.walk(os.path.join(cache_dir, sub)):
            total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def spill(t, tokens, hybrid=False):
    layers = kv_for(tokens, hybrid)
    assert t.enqueue_spill(tuple(tokens), layers, len(tokens) * TOKB)


SYS = list(range(100, 100 + 1024))


def test_shared_system_prompt_disk_and_prefix_served(cache_dir):
    t = make_tier(cache_dir, chunk_tokens=C)
    t.start_writer()
    try:
        for c in range(16):
            spill(t, SYS + [20000 + c * 300 + i for i in range(256)])
        t.flush(timeout=WAIT)
        unique = (1024 + 16 * 256) * TOKB
        ratio = disk_bytes(cache_dir) / unique
        print(f"shared-prompt disk / unique KV = {ratio:.3f}x")
        assert ratio <= 1.25
        # A new prompt: the system prompt + 300 new tokens.
        prompt = tuple(SYS + [90000 + i for i in range(300)])
        assert t.lookup_ssd(prompt) is None
        hit = t.lookup_ssd_prefix(prompt)
        assert hit is not None
        m = hit["num_tokens"]
        print(f"tokens served from SSD: {m} of 1024 shared")
        assert m >= 768 and m % C == 0
        import hashlib
        import array
        want = hashlib.sha256(array.array("i", prompt[:m]).tobytes()).hexdigest()
        assert hit["file_path"] == want
        layers = t._read_entry(prompt[:m], hit["file_path"])
        assert layers is not None and len(layers) == LAYERS
        ref = kv_for(prompt[:m])
        alloc = 0
        for got, exp in zip(layers, ref):
            k = np.asarray(got["keys"])
            v = np.asarray(got["values"])
            assert k.dtype == np.float16 and k.shape == exp.keys.shape
            assert np.array_equal(k.view(np.uint16), exp.keys.view(np.uint16))
            assert np.array_equal(v.view(np.uint16), exp.values.view(np.uint16))
            assert got["offset"] == m
            alloc += k.nbytes + v.nbytes
        assert hit["memory_bytes"] == alloc  # what the scheduler reserves
        t._index.touch(prompt[:m])  # the scheduler's only touch
        # Another namespace (model) sees nothing.
    finally:
        t.close()
    other = make_tier(cache_dir, chunk_tokens=C, model_id="another-model")
    try:
        assert other.lookup_ssd_prefix(prompt) is None
    finally:
        other.close()


def test_multi_turn_writes(cache_dir):
    t = make_tier(cache_dir, chunk_tokens=C)
    t.start_writer()
    try:
        conv = [30000 + (i * 7) % 9000 for i in range(8 * 512)]
        for turn in range(1, 9):
            spill(t, conv[: turn * 512])
            t.flush(timeout=WAIT)
        written = t._h.stats().spill_bytes
        ratio = written / (8 * 512 * TOKB)
        print(f"8 turns of +512: bytes written / unique KV = {ratio:.3f}x")
        assert ratio <= 1.25
        # Every turn still reads back whole (tail + chain).
        for turn in (1, 5, 8):
            toks = tuple(conv[: turn * 512])
            info = t.lookup_ssd(toks)
            assert info is not None
            layers = t._read_entry(toks, info["file_path"])
            assert layers is not None
            exp = kv_for(toks)
            assert np.array_equal(np.asarray(layers[3]["keys"]).view(np.uint16),
                                  exp[3].keys.view(np.uint16))
    finally:
        t.close()


def test_on_by_default_off_and_compat_as_the_reference_and_hybrid_never_wrong(tmp_path):
    prompt = tuple(SYS + [90000 + i for i in range(300)])
    # Default options: chunked at 256 tokens, the shared prefix is served.
    assert kvtier.ssd_cache.SSDCacheConfig().chunk_tokens == 256
    on = str(tmp_path / "on")
    t = make_tier(on)
    t.start_writer()
    try:
        spill(t, SYS + [5, 6, 7])
        t.flush(timeout=WAIT)
        info = t.lookup_ssd_prefix(prompt)
        assert info is not None and info["num_tokens"] == 1024
        assert os.path.isdir(os.path.join(on, "chunks"))
    finally:
        t.close()
    # chunk_tokens=0, and compat mode with the default: the reference's layout.
    for name, kw in (("off", {"chunk_tokens": 0}), ("compat", {"storage_mode": "compat"})):
        off = str(tmp_path / name)
        t = make_tier(off, **kw)
        t.start_writer()
        try:
            spill(t, SYS + [5, 6, 7])
            t.flush(timeout=WAIT)
            assert t.lookup_ssd_prefix(prompt) is None  # the reference: 0 tokens
            assert not os.path.exists(os.path.join(off, "chunks"))
        finally:
            t.close()
    hyb = str(tmp_path / "hyb")
    t = make_tier(hyb, chunk_tokens=C)
    t.start_writer()
    try:
        full = SYS + [5, 6, 7]
        spill(t, full, hybrid=True)
        t.flush(timeout=WAIT)
        # The arrays state exists only at 1027 tokens: no chunk-aligned hit.
        assert t.lookup_ssd_prefix(prompt) is None
        info = t.lookup_ssd(tuple(full))
        layers = t._read_entry(tuple(full), info["file_path"])
        assert layers is not None and len(layers) == LAYERS + 1
        st = np.asarray(layers[-1]["state"][0])
        assert st.shape == (1, 3, 8) and float(st.flat[0]) == float(len(full))
    finally:
        t.close()


def test_unaligned_multi_turn_writes(cache_dir):
    t = make_tier(cache_dir, chunk_tokens=C)
    t.start_writer()
    try:
        rng = np.random.default_rng(20)
        conv = []
        for _turn in range(20):
            add = int(rng.integers(50, 301))
            conv += [40000 + (len(conv) + i) * 13 % 9000 for i in range(add)]
            spill(t, conv)
            t.flush(timeout=WAIT)
        ratio = t._h.stats().spill_bytes / (len(conv) * TOKB)
        print(f"20 turns of 50-300 tokens: bytes written / unique KV = "
              f"{ratio:.3f}x")
        assert ratio <= 2.0
        info = t.lookup_ssd(tuple(conv))
        layers = t._read_entry(tuple(conv), info["file_path"])
        exp = kv_for(conv)
        assert np.array_equal(np.asarray(layers[7]["values"]).view(np.uint16),
                              exp[7].values.view(np.uint16))
    finally:
        t.close()
