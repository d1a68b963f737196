"""Per-request cache salts through kvtier.ssd_cache (the drop-in's cache_salt=
keyword on enqueue_spill, lookup_ssd, lookup_ssd_prefix, _read_entry,
_index.touch, _index.delete_entry and async_promote) and kvtier.Tier, in the default chunked
native mode: the multi-tenant cases of SGLang PR #37058 and vLLM #44701 (a
tenant's prompt, or any prefix of it, must never be a hit for another tenant
or for a request without a salt; a namespace and a salt that concatenate
alike must not collide), with the tenant's own hits served bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

import kvtier
from conftest import Budget, KVLayer, make_tier, run

pytestmark = pytest.mark.tier_profiles  # defaults and the bare disk path (conftest)

HEADS, DIM = 2, 16
WAIT = 60.0


def kv_for(tokens, tenant):
    """KV depending on (token, position, tenant): each tenant's own data."""
    t = np.asarray(tokens, dtype=np.int64)
    seed = (t * 1000003 + np.arange(len(t)) * 7919 + tenant * 7)[None, None, :, None]
    h = np.arange(HEADS)[None, :, None, None]
    d = np.arange(DIM)[None, None, None, :]
    x = (seed * 31 + h * 131 + d * 17) % 65521
    return [KVLayer((x / 65521.0).astype(np.float16),
                    (((x * 7) % 65521) / 65521.0).astype(np.float16), len(t))]


PROMPT = tuple(range(10_000, 10_600))  # 600 tokens: 2 chunks of 256 + a tail


def test_dropin_tenants_never_see_each_other(cache_dir):
    t = make_tier(cache_dir)
    try:
        t.start_writer()
        for tenant, salt in ((1, "tenant-a"), (2, b"tenant-b")):
            assert t.enqueue_spill(PROMPT, kv_for(PROMPT, tenant), 1000, cache_salt=salt)
        t.flush(WAIT)
        query = PROMPT[:300] + tuple(range(-1, -50, -1))
        # No salt, or a salt nobody used: nothing, exact or prefix.
        for salt in (None, "tenant-c", "tenant-ab", ""):
            assert t.lookup_ssd(PROMPT, cache_salt=salt) is None
            assert t.lookup_ssd_prefix(query, cache_salt=salt) is None
            assert t.lookup_ssd_prefix(PROMPT + (1, 2), cache_salt=salt) is None
        a = t.lookup_ssd(PROMPT, cache_salt="tenant-a")
        b = t.lookup_ssd(PROMPT, cache_salt=b"tenant-b")
        assert a and b and a["file_path"] != b["file_path"]
        assert a["file_path"] != kvtier.token_hash(PROMPT)
        for tenant, salt, hit in ((1, "tenant-a", a), (2, b"tenant-b", b)):
            layers = t._read_entry(PROMPT, hit["file_path"], cache_salt=salt)
            assert np.array_equal(layers[0]["keys"], kv_for(PROMPT, tenant)[0].keys)
            # Another salt (or none) never reads this name.
            other = b"tenant-b" if tenant == 1 else "tenant-a"
            assert t._read_entry(PROMPT, hit["file_path"], cache_salt=other) is None
            assert t._read_entry(PROMPT, hit["file_path"]) is None
            # A chunk-aligned prefix no spill ended at: the tenant's chunks.
            p = t.lookup_ssd_prefix(query, cache_salt=salt)
            assert p["num_tokens"] == 256
            layers = t._read_entry(query[:256], p["file_path"], cache_salt=salt)
            assert np.array_equal(layers[0]["keys"],
                                  kv_for(PROMPT, tenant)[0].keys[:, :, :256, :])
            t._index.touch(query[:256], cache_salt=salt)
            budget = Budget()
            got = run(t.async_promote(PROMPT, budget.reserve, budget.release,
                                      cache_salt=salt))
            assert np.array_equal(got[0]["values"], kv_for(PROMPT, tenant)[0].values)
        budget = Budget()
        assert run(t.async_promote(PROMPT, budget.reserve, budget.release)) is None
        # _index.delete_entry takes the salt too: a salted entry is removed
        # only with its own salt.
        t._index.delete_entry(PROMPT)
        t._index.delete_entry(PROMPT, cache_salt=b"tenant-b")
        assert t.lookup_ssd(PROMPT, cache_salt="tenant-a") is not None
        t._index.delete_entry(PROMPT, cache_salt="tenant-a")
        assert t.lookup_ssd(PROMPT, cache_salt="tenant-a") is None
        assert t.lookup_ssd(PROMPT, cache_salt=b"tenant-b") is None
        with pytest.raises(TypeError):
            t.lookup_ssd(PROMPT, cache_salt=5)
        assert not t.enqueue_spill(PROMPT, kv_for(PROMPT, 1), 1000, cache_salt="x" * 5000)
    finally:
        t.close()


def test_namespace_and_salt_never_concatenate(tmp_path):
    """model_id "lora-a" + salt "b" against model_id "lora-ab" without one
    (the anchors' "a LoRA name and a salt hashing alike")."""
    d = str(tmp_path / "c")
    t = kvtier.Tier(d, durability="none", chunk_tokens=16, model_id="lora-a")
    toks = tuple(range(100, 164))
    t.spill(toks, kv_for(toks, 1), cache_salt="b")
    t.flush(WAIT)
    assert t.lookup(toks, cache_salt="b").num_tokens == 64
    e = t.promote(toks[:40] + (-1,), prefix=True, cache_salt="b")
    assert e is not None and len(e.tokens) == 32
    assert np.array_equal(e.layers[0]["keys"], kv_for(toks, 1)[0].keys[:, :, :32, :])
    assert t.read_entry(toks, t.lookup(toks, cache_salt="b").token_hash) is None
    assert t.touch(toks, cache_salt="b") and not t.touch(toks)
    t.spill_prefix(toks, 48, kv_for(toks, 1), cache_salt="b")
    t.flush(WAIT)
    assert t.lookup(toks[:48], cache_salt="b").num_tokens == 48
    assert t.lookup(toks[:48]) is None
    t.close()
    u = kvtier.Tier(d, durability="none", chunk_tokens=16, model_id="lora-ab")
    try:
        assert u.lookup(toks) is None
        assert u.lookup_prefix(toks[:40] + (-1,)) is None
        assert u.lookup_prefix(toks[:40] + (-1,), cache_salt="b") is None  # other namespace
    finally:
        u.close()
