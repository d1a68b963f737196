"""Interop on one directory, both ways: a directory written by the
reference (loaded from the seed) is read by kvtier with identical results, and a
directory written by kvtier in compat mode is read by the reference with the
same results as if the reference had written it.  bf16 and quantized layers
included."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import make_ref_cache
import read_ref_cache
import reference_loader
import ssd_cache_ref as ref
from conftest import make_tier, run
from kvtier import ssd_cache as kv

ALL = ("kv", "rotating", "arrays", "quantized")
REF_DIR = os.path.dirname(os.path.abspath(make_ref_cache.__file__))


def _cmp_value(a, b):
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.shape == b.shape
        assert a.dtype == b.dtype, (a.dtype, b.dtype)
        assert np.array_equal(a, b)
    elif isinstance(a, (list, tuple)) and a and isinstance(a[0], np.ndarray):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _cmp_value(x, y)
    else:
        assert a == b, (a, b)


def _cmp_layers(got, exp):
    assert len(got) == len(exp)
    for i, (g, e) in enumerate(zip(got, exp)):
        assert set(g) == set(e), (i, set(g), set(e))
        for k in e:
            _cmp_value(g[k], e[k])


def _ref_read_all(cache_dir):
    t = ref.SSDCacheTier(ref.SSDCacheConfig(cache_dir=cache_dir))
    try:
        return {ref._blob_to_tokens(r["tokens_blob"]): t._read_entry(
            ref._blob_to_tokens(r["tokens_blob"]), r["file_path"])
            for r in t._index.all_entries()}
    finally:
        t.close()


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("storage_mode", ["native", "compat"])
def test_reference_directory_read_by_kvtier(tmp_path, bf16, storage_mode):
    d = str(tmp_path / "refdir")
    ents = make_ref_cache.build_entries(seed=11, entries=5, layers=4, kinds=ALL, bf16=bf16)
    make_ref_cache.write_cache(d, ents)
    expected = _ref_read_all(d)
    assert all(v is not None for v in expected.values())

    t = make_tier(d, storage_mode=storage_mode)
    try:
        assert t.reconcile() == 0  # nothing in a reference directory is foreign
        for toks, exp in expected.items():
            meta = t.lookup_ssd(toks)
            assert meta is not None and meta["file_path"] == kv._tokens_hash(toks)
            got = run(t.async_promote(toks, lambda n: True, lambda n: None))
            _cmp_layers(got, exp)
            _cmp_layers(t._read_entry(toks, meta["file_path"]), exp)
        longest = max(expected, key=len)
        assert t.lookup_ssd_prefix(longest + (1,))["num_tokens"] == len(longest)
        assert t.get_stats()["ssd_hits"] == len(expected)
    finally:
        t.close()
    # kvtier's visit left the directory readable by the reference.
    s = read_ref_cache.read_cache(d)
    assert s["count"] == 5 and s["failed"] == 0


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("kinds", [("kv", "rotating", "arrays"), ALL])
def test_kvtier_compat_directory_read_by_reference(tmp_path, bf16, kinds):
    kd = str(tmp_path / "kvdir")
    rd = str(tmp_path / "refdir")
    # Same seed -> same data (building fresh: the reference's spill path
    # mutates bf16 layers in place).
    t = make_tier(kd, storage_mode="compat")
    t.start_writer()
    try:
        for e in make_ref_cache.build_entries(seed=5, entries=4, layers=4, kinds=kinds, bf16=bf16):
            assert t.enqueue_spill(e["tokens"], e["layers"], e["memory_bytes"])
        t.flush(timeout=60)
    finally:
        t.close()
    make_ref_cache.write_cache(rd, make_ref_cache.build_entries(
        seed=5, entries=4, layers=4, kinds=kinds, bf16=bf16))
    got = _ref_read_all(kd)
    exp = _ref_read_all(rd)
    assert set(got) == set(exp) and all(v is not None for v in got.values())
    # Exact, quantized layers included: kvtier's C dequantization (MLX's affine
    # formula, float32 then one rounding) and its reference quirks (bf16 KV
    # layers of an entry holding a quantized layer stored as fp16 + hint) give
    # the very bytes the reference writes.
    for toks in exp:
        _cmp_layers(got[toks], exp[toks])
    # Manifests carry every key the reference writes.
    for toks in exp:
        h = ref._tokens_hash(toks)
        mk = json.load(open(os.path.join(kd, "data", h, "manifest.json")))
        mr = json.load(open(os.path.join(rd, "data", h, "manifest.json")))
        for k in ("num_layers", "memory_bytes", "num_tokens"):
            assert mk[k] == mr[k]
        for lk, lr in zip(mk["layers"], mr["layers"]):
            for k, v in lr.items():
                if k.endswith("original_dtype") or k == "state_original_dtypes":
                    continue  # compared through the read results above
                assert lk[k] == v, (k, lk, lr)
        assert open(os.path.join(kd, "data", h, "tokens.bin"), "rb").read() == \
            open(os.path.join(rd, "data", h, "tokens.bin"), "rb").read()


def test_one_directory_both_writers(tmp_path):
    d = str(tmp_path / "shared")
    ents = make_ref_cache.build_entries(seed=2, entries=3, layers=2, kinds=("kv", "arrays"))
    make_ref_cache.write_cache(d, ents)
    t = make_tier(d, storage_mode="compat")
    t.start_writer()
    more = make_ref_cache.build_entries(seed=3, entries=3, layers=2, kinds=("rotating", "kv"))
    try:
        for e in more:
            assert t.enqueue_spill(e["tokens"], e["layers"], e["memory_bytes"])
        t.flush(timeout=60)
    finally:
        t.close()
    # The reference sees all six, reads them, and writes a seventh.
    s = read_ref_cache.read_cache(d)
    assert s["count"] == 6 and s["failed"] == 0
    extra = make_ref_cache.build_entries(seed=4, entries=1, layers=1, kinds=("kv",))
    make_ref_cache.write_cache(d, extra)
    t = make_tier(d)
    try:
        for e in ents + more + extra:
            assert t.lookup_ssd(e["tokens"]) is not None
            assert t._read_entry(e["tokens"], kv._tokens_hash(e["tokens"])) is not None
    finally:
        t.close()


def test_scripts_run(tmp_path):
    reference_loader.require()  # the scripts below need it too
    d = str(tmp_path / "scripted")
    py = sys.executable
    r = subprocess.run([py, os.path.join(REF_DIR, "make_ref_cache.py"), d, "--seed", "9",
                        "--entries", "3", "--layers", "2", "--kinds", "kv,quantized", "--bf16"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["entries"]) == 3
    r = subprocess.run([py, os.path.join(REF_DIR, "read_ref_cache.py"), d],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["count"] == 3 and s["failed"] == 0


@pytest.mark.parametrize("kinds,bf16", [(("kv",), True), (("quantized",), False), (("arrays",), True)])
def test_native_lossless_entries_are_refused_not_misread_by_reference(tmp_path, kinds, bf16):
    # Native mode keeps BF16 / packed quantized data, which the reference
    # cannot load: it must fail (and would quarantine), never return wrong data.
    # Plain fp16/fp32 layers in native mode stay readable by the reference.
    d = str(tmp_path / "native")
    t = make_tier(d, storage_mode="native")
    t.start_writer()
    try:
        lossless = make_ref_cache.build_entries(seed=8, entries=1, layers=2, kinds=kinds, bf16=bf16)[0]
        plain = make_ref_cache.build_entries(seed=9, entries=1, layers=2, kinds=("kv", "arrays"))[0]
        plain["tokens"] = plain["tokens"] + (77777,)  # distinct from the first
        assert t.enqueue_spill(lossless["tokens"], lossless["layers"], 1)
        assert t.enqueue_spill(plain["tokens"], plain["layers"], 1)
        t.flush(timeout=60)
    finally:
        t.close()
    s = read_ref_cache.read_cache(d)
    by_tokens = {tuple(e["tokens"]): e for e in s["entries"]}
    assert by_tokens[tuple(lossless["tokens"])]["ok"] is False
    assert by_tokens[tuple(plain["tokens"])]["ok"] is True
