"""The public SSDIndex class as the reference's own test suite uses it -
insert/lookup with a free-form file_path, prefix lookup, bounded prefix
candidates, legacy backfill, delete, LRU, total bytes, entry count, duplicate
replace, touch - written the way a user writes them, and run against both the
transcribed reference (tests/reference/ssd_cache_ref.py) and kvtier.ssd_cache,
so any difference shows as a failure of one parametrization."""

from __future__ import annotations

import os
import sqlite3
import time

import pytest

import ssd_cache_ref
from kvtier import ssd_cache as kvtier_ssd_cache


@pytest.fixture(params=[ssd_cache_ref, kvtier_ssd_cache], ids=["reference", "kvtier"])
def mod(request):
    return request.param


@pytest.fixture
def index_dir(tmp_path):
    d = str(tmp_path / "index")
    os.makedirs(d, exist_ok=True)
    return d


@pytest.fixture
def index(mod, index_dir):
    idx = mod.SSDIndex(index_dir)
    yield idx
    idx.close()


def test_open_creates_index_db(index, index_dir):
    assert os.path.isfile(os.path.join(index_dir, "index.db"))


def test_insert_then_lookup_exact(index):
    key = (11, 22, 33, 44, 55)
    index.insert_entry(tokens_key=key, file_path="entry_abc123.safetensors",
                       memory_bytes=4096, num_tokens=5)
    assert index.lookup_exact(key) == {"file_path": "entry_abc123.safetensors",
                                       "memory_bytes": 4096, "num_tokens": 5}
    assert index.lookup_exact((11, 22, 33, 44)) is None
    assert index.lookup_exact((55, 44, 33)) is None


def test_lookup_prefix_returns_stored_prefixes_longest_first(index):
    index.insert_entry((1, 2, 3), "short.safetensors", 1000, 3)
    index.insert_entry((1, 2, 3, 4, 5), "mid.safetensors", 2000, 5)
    index.insert_entry((1, 2, 3, 4, 5, 6, 7), "long.safetensors", 3000, 7)
    index.insert_entry((9, 8, 7), "other.safetensors", 1000, 3)
    index.insert_entry((1, 2, 3, 4, 5, 6, 7, 8, 9), "longer.safetensors", 1, 9)
    res = index.lookup_prefix((1, 2, 3, 4, 5, 6, 7, 8))
    assert [r["file_path"] for r in res] == ["long.safetensors", "mid.safetensors",
                                              "short.safetensors"]
    assert [r["num_tokens"] for r in res] == [7, 5, 3]
    assert res[0]["memory_bytes"] == 3000
    assert res[0]["token_hash"] == ssd_cache_ref._tokens_hash((1, 2, 3, 4, 5, 6, 7))
    assert index.lookup_prefix((2, 3)) == []
    assert index.lookup_prefix(()) == []


def test_prefix_candidates_are_bounded_by_the_prefix_hash(index, index_dir):
    # Entries longer than 16 tokens share the query's first 16; the filter is
    # the stored prefix_hash of those 16, so a row whose prefix_hash says it
    # starts differently is never a candidate, even though its tokens match.
    base = tuple(range(100, 140))
    for n in (8, 16, 24, 32):
        index.insert_entry(base[:n], f"p{n}.safetensors", n, n)
    diverged = base[:20] + (-1,) * 10
    index.insert_entry(diverged, "diverged.safetensors", 1, len(diverged))
    conn = sqlite3.connect(os.path.join(index_dir, "index.db"))
    stored = dict(conn.execute("SELECT file_path, prefix_hash FROM entries"))
    assert stored["p24.safetensors"] == ssd_cache_ref._prefix_hash(base[:24])
    assert stored["p8.safetensors"] == ssd_cache_ref._tokens_hash(base[:8])
    conn.execute("UPDATE entries SET prefix_hash = 'elsewhere' WHERE file_path = "
                 "'p24.safetensors'")
    conn.commit()
    conn.close()
    res = index.lookup_prefix(base)
    assert [r["file_path"] for r in res] == ["p32.safetensors", "p16.safetensors",
                                              "p8.safetensors"]
    assert [r["file_path"] for r in index.lookup_prefix(diverged + (5,))] == [
        "diverged.safetensors", "p16.safetensors", "p8.safetensors"]


def test_legacy_table_gets_prefix_hashes_backfilled(mod, index_dir):
    conn = sqlite3.connect(os.path.join(index_dir, "index.db"))
    conn.executescript("""
        CREATE TABLE schema_version (version INTEGER NOT NULL);
        INSERT INTO schema_version (version) VALUES (1);
        CREATE TABLE entries (
            token_hash TEXT PRIMARY KEY, tokens_blob BLOB NOT NULL,
            num_tokens INTEGER NOT NULL, file_path TEXT NOT NULL,
            memory_bytes INTEGER NOT NULL, created_at REAL NOT NULL,
            accessed_at REAL NOT NULL);
    """)
    rows = [(tuple(range(5, 25)), "legacy_long.safetensors"), ((5, 6, 7), "legacy_short.safetensors")]
    for toks, fp in rows:
        conn.execute("INSERT INTO entries VALUES (?, ?, ?, ?, ?, ?, ?)",
                     (ssd_cache_ref._tokens_hash(toks), ssd_cache_ref._tokens_to_blob(toks),
                      len(toks), fp, 64, time.time(), time.time()))
    conn.commit()
    conn.close()
    index = mod.SSDIndex(index_dir)
    try:
        res = index.lookup_prefix(tuple(range(5, 30)))
        assert [r["file_path"] for r in res] == ["legacy_long.safetensors",
                                                  "legacy_short.safetensors"]
    finally:
        index.close()
    conn = sqlite3.connect(os.path.join(index_dir, "index.db"))
    got = dict(conn.execute("SELECT file_path, prefix_hash FROM entries"))
    conn.close()
    assert got == {fp: ssd_cache_ref._prefix_hash(toks) for toks, fp in rows}


def test_delete_entry(index):
    index.insert_entry((10, 20, 30), "x.safetensors", 500, 3)
    index.insert_entry((10, 20), "y.safetensors", 500, 2)
    index.delete_entry((10, 20, 30))
    assert index.lookup_exact((10, 20, 30)) is None
    assert index.lookup_exact((10, 20))["file_path"] == "y.safetensors"
    index.delete_entry((10, 20, 30))  # absent: silent
    assert index.get_entry_count() == 1


def test_get_lru_oldest_first(index):
    for i, name in enumerate(("first", "second", "third")):
        index.insert_entry((i,), f"{name}.safetensors", 100 * (i + 1), 1)
        time.sleep(0.01)
    lru = index.get_lru(limit=2)
    assert [r["file_path"] for r in lru] == ["first.safetensors", "second.safetensors"]
    assert lru[0]["tokens_blob"] == ssd_cache_ref._tokens_to_blob((0,))
    assert lru[1]["memory_bytes"] == 200
    assert [r["file_path"] for r in index.get_lru()] == [
        "first.safetensors", "second.safetensors", "third.safetensors"]


def test_total_bytes(index):
    assert index.get_total_bytes() == 0
    index.insert_entry((1,), "a.safetensors", 1000, 1)
    index.insert_entry((2,), "b.safetensors", 2000, 1)
    assert index.get_total_bytes() == 3000


def test_entry_count(index):
    assert index.get_entry_count() == 0
    index.insert_entry((1,), "a.safetensors", 100, 1)
    index.insert_entry((2,), "b.safetensors", 200, 1)
    assert index.get_entry_count() == 2


def test_duplicate_insert_replaces(index):
    index.insert_entry((1, 2, 3), "old.safetensors", 100, 3)
    index.insert_entry((1, 2, 3), "new.safetensors", 200, 3)
    assert index.lookup_exact((1, 2, 3)) == {"file_path": "new.safetensors",
                                             "memory_bytes": 200, "num_tokens": 3}
    assert index.get_entry_count() == 1
    assert index.get_total_bytes() == 200


def test_touch_makes_an_entry_recently_used(index):
    index.insert_entry((1,), "a.safetensors", 100, 1)
    time.sleep(0.01)
    index.insert_entry((2,), "b.safetensors", 100, 1)
    time.sleep(0.01)
    index.touch((1,))
    assert [r["file_path"] for r in index.get_lru(limit=2)] == ["b.safetensors",
                                                                 "a.safetensors"]
    assert index.all_entries()[0]["file_path"] == "a.safetensors"
    index.touch((3,))  # absent: silent


def test_num_tokens_is_stored_as_given(index):
    # The reference stores num_tokens independently of the key's length.
    index.insert_entry((1, 2), "odd.safetensors", 1, 5)
    assert index.lookup_exact((1, 2))["num_tokens"] == 5
    assert index.lookup_prefix((1, 2, 3, 4, 5, 6)) == []
