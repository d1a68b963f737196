"""The drop-in module's public surface matches the reference's: names,
signatures, defaults, dataclass fields, ValueError messages, stats keys,
serializer dispatch, and the help text is useful."""

from __future__ import annotations

import dataclasses
import inspect
import pydoc

import numpy as np
import pytest

import kvtier
import kvtier._lib as L
import ssd_cache_ref as ref
from kvtier import ssd_cache as kv

PUBLIC = ["SSDCacheConfig", "SSDCacheStats", "SSDIndex", "LayerSerializer",
          "KVCacheSerializer", "ArraysCacheSerializer", "get_serializer_for_layer",
          "SERIALIZER_SUPPORT_MATRIX", "SSDCacheTier"]


def test_public_names_exist():
    for name in PUBLIC:
        assert hasattr(kv, name), name
    assert kv.SERIALIZER_SUPPORT_MATRIX == ref.SERIALIZER_SUPPORT_MATRIX
    assert kv._PREFIX_FILTER_TOKENS == ref._PREFIX_FILTER_TOKENS
    assert kv._BYTES_PER_GB == ref._BYTES_PER_GB


def test_options_struct_matches_c_layout():
    import ctypes

    assert ctypes.sizeof(L.Options) == L.kvt_options_size()


def test_library_discovery_reports_what_it_tried(tmp_path):
    import subprocess
    import sys

    env = dict(__import__("os").environ, KVTIER_LIBRARY=str(tmp_path / "nope.so"))
    r = subprocess.run([sys.executable, "-c", "import kvtier"], env=env,
                       capture_output=True, text=True)
    assert r.returncode != 0
    assert "nope.so" in r.stderr and "LibraryNotFoundError" in r.stderr


def _params(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_config_fields_and_defaults_match():
    ref_fields = [(f.name, f.default) for f in dataclasses.fields(ref.SSDCacheConfig)]
    our_fields = [(f.name, f.default) for f in dataclasses.fields(kv.SSDCacheConfig)]
    # Same fields, same order, same defaults; kvtier's extras come after.
    assert our_fields[: len(ref_fields)] == ref_fields
    c = kv.SSDCacheConfig()
    assert c.cache_dir is None and c.max_size_gb == 10.0 and c.max_entries == 10000
    assert c.file_permissions == 0o600 and c.dir_permissions == 0o700
    assert c.spill_queue_size == 64 and c.retention_seconds is None
    assert kv.SSDCacheConfig(max_size_gb=1.5).max_size_bytes == \
        ref.SSDCacheConfig(max_size_gb=1.5).max_size_bytes == int(1.5 * 2**30)
    # Positional construction works identically.
    assert kv.SSDCacheConfig("/d", 2.0, 5).max_entries == ref.SSDCacheConfig("/d", 2.0, 5).max_entries


@pytest.mark.parametrize("kwargs", [
    {"max_size_gb": 0}, {"max_size_gb": -1.5}, {"max_entries": 0},
    {"max_entries": -3}, {"spill_queue_size": 0},
])
def test_config_value_errors_match(kwargs):
    with pytest.raises(ValueError) as e_ref:
        ref.SSDCacheConfig(**kwargs)
    with pytest.raises(ValueError) as e_kv:
        kv.SSDCacheConfig(**kwargs)
    assert str(e_kv.value) == str(e_ref.value)


def test_config_kvtier_fields_validated():
    with pytest.raises(ValueError, match="storage_mode"):
        kv.SSDCacheConfig(storage_mode="lossy")
    with pytest.raises(ValueError, match="durability"):
        kv.SSDCacheConfig(durability="sometimes")


def test_stats_dataclass_matches():
    ref_fields = [(f.name, f.default) for f in dataclasses.fields(ref.SSDCacheStats)]
    our_fields = [(f.name, f.default) for f in dataclasses.fields(kv.SSDCacheStats)]
    assert our_fields == ref_fields
    for vals in [{}, {"ssd_hits": 3, "ssd_misses": 1, "reload_latency_sum": 0.123456,
                      "spill_count": 2, "spill_bytes": 10, "reload_bytes": 7,
                      "promotion_failures": 1}]:
        assert kv.SSDCacheStats(**vals).to_dict() == ref.SSDCacheStats(**vals).to_dict()
        assert list(kv.SSDCacheStats(**vals).to_dict()) == list(ref.SSDCacheStats(**vals).to_dict())
    # Inputs where rounding to 3 and to 4 decimals differ (7/9 -> 0.7778, not
    # 0.778; 0.123456 s -> 0.1235; 0.123456/7 s -> 17.64 ms, not 17.6), each
    # checked against the value itself, not only against the reference.
    vals = {"ssd_hits": 7, "ssd_misses": 2, "reload_latency_sum": 0.123456}
    for d in (kv.SSDCacheStats(**vals).to_dict(), ref.SSDCacheStats(**vals).to_dict()):
        assert d["ssd_hit_rate"] == 0.7778
        assert d["reload_latency_sum_s"] == 0.1235
        assert d["avg_reload_latency_ms"] == 17.64


def test_method_signatures_match():
    pairs = [
        (kv.SSDIndex, ref.SSDIndex, ["__init__", "insert_entry", "lookup_exact",
                                     "lookup_prefix", "delete_entry", "get_lru",
                                     "get_total_bytes", "get_entry_count", "touch",
                                     "all_entries", "close"]),
        (kv.KVCacheSerializer, ref.KVCacheSerializer,
         ["snapshot_layer", "serialize_layer", "deserialize_layer"]),
        (kv.ArraysCacheSerializer, ref.ArraysCacheSerializer,
         ["snapshot_layer", "serialize_layer", "deserialize_layer"]),
        (kv.SSDCacheTier, ref.SSDCacheTier,
         ["__init__", "get_stats", "start_writer", "enqueue_spill", "lookup_ssd",
          "lookup_ssd_prefix", "async_promote", "_read_entry", "reconcile"]),
    ]
    for ours, theirs, names in pairs:
        for n in names:
            mine = _params(getattr(ours, n))
            # kvtier's one extra: a trailing keyword-only cache_salt=None.
            if mine and mine[-1][0] == "cache_salt":
                assert mine[-1][1:] == (inspect.Parameter.KEYWORD_ONLY, None), (ours, n)
                mine = mine[:-1]
            assert mine == _params(getattr(theirs, n)), (ours, n)
    assert inspect.iscoroutinefunction(kv.SSDCacheTier.async_promote)
    assert _params(kv.get_serializer_for_layer) == _params(ref.get_serializer_for_layer)
    # close() keeps the reference's no-argument call and adds an optional timeout.
    p = inspect.signature(kv.SSDCacheTier.close).parameters
    assert list(p) == ["self", "timeout"] and p["timeout"].default is None
    assert inspect.iscoroutinefunction(kv.SSDCacheTier.aclose)


class _Weird:
    pass


class _StateTuple:
    state = (np.zeros(2),)


def test_get_serializer_dispatch_and_error_text():
    kvl = type("KVCache", (), {"keys": 1, "values": 2, "offset": 0})()
    arr = type("ArraysCache", (), {"state": [np.zeros(2)]})()
    assert isinstance(kv.get_serializer_for_layer(kvl), kv.KVCacheSerializer)
    assert isinstance(kv.get_serializer_for_layer(arr), kv.ArraysCacheSerializer)
    for bad in (_Weird(), _StateTuple()):
        with pytest.raises(ValueError) as e_ref:
            ref.get_serializer_for_layer(bad)
        with pytest.raises(ValueError) as e_kv:
            kv.get_serializer_for_layer(bad)
        assert str(e_kv.value) == str(e_ref.value)
    assert issubclass(kv.KVCacheSerializer, kv.LayerSerializer)
    with pytest.raises(TypeError):
        kv.LayerSerializer()


def test_tier_requires_cache_dir():
    with pytest.raises(ValueError) as e_ref:
        ref.SSDCacheTier(ref.SSDCacheConfig())
    with pytest.raises(ValueError) as e_kv:
        kv.SSDCacheTier(kv.SSDCacheConfig())
    assert str(e_kv.value) == str(e_ref.value)


def test_help_is_useful():
    text = pydoc.render_doc(kv.SSDCacheTier, renderer=pydoc.plaintext)
    for word in ("async_promote", "enqueue_spill", "reserve_budget_fn", "TimeoutError",
                 "lookup_ssd_prefix", "close"):
        assert word in text
    assert "drop-in" in (kv.__doc__ or "").lower()
    assert kvtier.library_version() == "0.1.0"


def test_token_hash_matches_reference():
    for toks in [(), (1,), tuple(range(100)), (2**31 - 1, -(2**31), 0)]:
        assert kvtier.token_hash(toks) == ref._tokens_hash(toks) == kv._tokens_hash(toks)
    with pytest.raises(OverflowError):
        kvtier.token_hash((2**31,))


@pytest.mark.parametrize("kwargs,says", [
    ({"promote_threads": 300}, "promote_threads must be in 1..256, got 300"),
    ({"promote_threads": 257}, "promote_threads must be in 1..256, got 257"),
    ({"promote_threads": 0}, "promote_threads must be in 1..256, got 0"),
    ({"chunk_tokens": 24}, "chunk_tokens"),
    ({"file_permissions": 0o400}, "file_permissions must include 0600 (owner rw), got 0o400"),
    ({"quarantine_max": -1}, "quarantine_max must be in 0..4294967295, got -1"),
    ({"spill_queue_size": 2 ** 40}, "spill_queue_size must be in 0..4294967295"),
])
def test_config_refused_at_construction_by_the_c_rules(kwargs, says):
    """SSDCacheConfig is judged by kvt_options_validate, the check the tier's
    open applies, so a value the tier would refuse (or one that does not fit
    its C field) raises ValueError when the config is made."""
    with pytest.raises(ValueError) as e:
        kv.SSDCacheConfig(cache_dir="/tmp/x", **kwargs)
    assert says in str(e.value)


@pytest.mark.parametrize("bad", [0, 257])
def test_promote_threads_is_judged_by_c_alone_in_both_front_ends(bad, tmp_path):
    """promote_threads has no Python range check: kvt_options_validate
    (1..256) refuses 0 and 257 with its own message in SSDCacheConfig and in
    kvtier.Tier alike, and takes both ends of its range."""
    says = f"promote_threads must be in 1..256, got {bad}"
    with pytest.raises(ValueError, match=says):
        kv.SSDCacheConfig(cache_dir=str(tmp_path / "a"), promote_threads=bad)
    with pytest.raises(ValueError, match=says):
        kvtier.Tier(str(tmp_path / "b"), promote_threads=bad)
    assert not (tmp_path / "b").exists()  # refused before the open
    for good in (1, 256):
        kv.SSDCacheConfig(cache_dir=str(tmp_path / "a"), promote_threads=good)
        kvtier.Tier(str(tmp_path / f"c{good}"), promote_threads=good,
                    start_writer=False).close()


def test_tier_chunk_tokens_rule_is_cs_and_only_the_field_width_is_pythons(tmp_path):
    """kvtier.Tier refuses in Python only a chunk_tokens its uint32 field
    cannot hold (ctypes would store it modulo 2**32); every value the field
    holds is judged by kvt_options_validate, with its message."""
    with pytest.raises(ValueError, match=r"chunk_tokens must be 0 or a power of two "
                                         r"in 16\.\.4096, got 24"):
        kvtier.Tier(str(tmp_path / "a"), chunk_tokens=24)
    for bad in (2**32 + 256, -1):
        with pytest.raises(ValueError, match=f"chunk_tokens must be an integer in "
                                             f"0..4294967295, got {bad}"):
            kvtier.Tier(str(tmp_path / "b"), chunk_tokens=bad)
