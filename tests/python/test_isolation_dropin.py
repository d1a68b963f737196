"""Namespaces through kvtier.ssd_cache on the real client's configuration
(cache_dir and max_size_gb only, so chunk_tokens = 256 and no model_id):
the directory is the namespace, as in the reference.  Another model pointed
at the same directory - another layer count, head count or dtype - is never
served the first model's 700- and 768-token entries, exact or by prefix: the
scheduler's check_ssd flow (lookup_ssd / lookup_ssd_prefix, then
_read_entry) ends in a miss (_read_entry returns None), counted in
layout_misses, with no exception and nothing removed.  The names stay the
reference's (SHA-256 of the tokens), so a renamed directory keeps serving
its entries and its chunk-aligned prefixes, and a directory an older drop-in
wrote (chunks namespaced by the directory's name) keeps serving its entries.
"""

from __future__ import annotations

import array
import hashlib
import os

import numpy as np
import pytest

from conftest import KVLayer, kv_positional, make_tier

pytestmark = pytest.mark.tier_profiles

WAIT = 60.0
A_TOKENS = [(i * 7919 + 13) % 30000 for i in range(768)]
PROMPTS = (tuple(A_TOKENS[:700]), tuple(A_TOKENS))


def layers_of(tokens, n_layers=4, heads=2, dim=16, dtype=np.float16):
    out = kv_positional(tokens, n_layers, heads, dim)
    if dtype != np.float16:
        out = [KVLayer(la.keys.astype(dtype), la.values.astype(dtype), la.offset)
               for la in out]
    return out


def spill(t, tokens, **layout):
    layers = layers_of(tokens, **layout)
    mem = sum(la.keys.nbytes + la.values.nbytes for la in layers)
    assert t.enqueue_spill(tuple(tokens), layers, mem)


def check_ssd(t, prompt):
    """The scheduler's flow: the layers it would install, or None."""
    hit = t.lookup_ssd(prompt)
    if hit is None:
        hit = t.lookup_ssd_prefix(prompt)
    if hit is None:
        return None
    m = hit.get("matched_tokens", hit["num_tokens"])
    return t._read_entry(tuple(prompt[:m]), hit["file_path"])


def name(tokens):
    return hashlib.sha256(array.array("i", tokens).tobytes()).hexdigest()


@pytest.mark.parametrize("other", [dict(n_layers=6), dict(heads=4),
                                   dict(dtype=np.float32)],
                         ids=["layers", "heads", "dtype"])
def test_other_layout_never_served(cache_dir, other):
    a = make_tier(cache_dir)
    a.start_writer()
    try:
        for p in PROMPTS:
            spill(a, p)
        a.flush(timeout=WAIT)
        assert check_ssd(a, PROMPTS[0]) is not None  # the control
    finally:
        a.close()
    b = make_tier(cache_dir)  # another model, the same directory
    b.start_writer()
    try:
        own = tuple(range(50000, 50300))
        spill(b, own, **other)
        b.flush(timeout=WAIT)
        queries = list(PROMPTS) + [tuple(A_TOKENS) + (1, 2, 3),
                                   tuple(A_TOKENS[:512]) + (9,) * 40]
        for q in queries:
            assert check_ssd(b, q) is None
        stats = b.get_stats()
        assert stats["layout_misses"] >= len(queries)
        assert stats["quarantined"] == 0
        got = check_ssd(b, own)  # its own entry is served
        assert got is not None and len(got) == len(layers_of(own, **other))
    finally:
        b.close()
    a = make_tier(cache_dir)  # model A again: everything still there
    a.start_writer()
    try:
        spill(a, tuple(range(60000, 60020)))
        a.flush(timeout=WAIT)
        for p in PROMPTS:
            got = check_ssd(a, p)
            assert got is not None
            exp = layers_of(p)
            k = np.asarray(got[0]["keys"])
            assert np.array_equal(k.view(np.uint16), exp[0].keys.view(np.uint16))
        assert a.get_stats()["layout_misses"] == 0
    finally:
        a.close()


def test_directory_is_the_namespace(tmp_path):
    """No model_id is derived from the directory: the names are the
    reference's, and a renamed directory serves its entries and its
    chunk-aligned prefixes (a namespace taken from the directory's old name
    lost the prefixes)."""
    old = str(tmp_path / "model-x")
    t = make_tier(old)
    t.start_writer()
    try:
        spill(t, PROMPTS[1])
        t.flush(timeout=WAIT)
        assert t.lookup_ssd(PROMPTS[1])["file_path"] == name(PROMPTS[1])
    finally:
        t.close()
    new = str(tmp_path / "renamed")
    os.rename(old, new)
    t = make_tier(new)
    t.start_writer()
    try:
        assert check_ssd(t, PROMPTS[1]) is not None
        q = tuple(A_TOKENS[:600]) + (7,) * 30  # its 512-token chain prefix
        hit = t.lookup_ssd_prefix(q)
        assert hit is not None and hit["num_tokens"] == 512
        assert t._read_entry(q[:512], hit["file_path"]) is not None
    finally:
        t.close()


def test_older_dropin_directory_still_served(tmp_path):
    """A directory an older drop-in wrote - entries named by their tokens,
    chunks namespaced by the directory's name (what model_name gives) - is
    served by today's drop-in on its defaults."""
    d = str(tmp_path / "older")
    t = make_tier(d, model_name="older")
    t.start_writer()
    try:
        for p in PROMPTS:
            spill(t, p)
        t.flush(timeout=WAIT)
    finally:
        t.close()
    t = make_tier(d)
    t.start_writer()
    try:
        for p in PROMPTS:
            got = check_ssd(t, p)
            assert got is not None
            exp = layers_of(p)
            k = np.asarray(got[-1]["keys"])
            assert np.array_equal(k.view(np.uint16), exp[-1].keys.view(np.uint16))
    finally:
        t.close()
