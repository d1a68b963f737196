"""SSDIndex through kvt_index_*: the same operations give the same answers as
the reference's SSDIndex, and either opens the other's index.db (including a
legacy table without prefix_hash)."""

from __future__ import annotations

import sqlite3
import time

import numpy as np
import pytest

import ssd_cache_ref as ref
from kvtier import ssd_cache as kv


def _strip(rows):
    return [dict(r) for r in rows]


def _pair(tmp_path):
    a = tmp_path / "ref"
    b = tmp_path / "kv"
    a.mkdir(mode=0o700)
    b.mkdir(mode=0o700)
    return ref.SSDIndex(str(a)), kv.SSDIndex(str(b))


def _both(ri, ki, method, *args):
    r = getattr(ri, method)(*args)
    k = getattr(ki, method)(*args)
    assert k == r, (method, args, k, r)
    return k


def test_random_operations_match_reference(tmp_path):
    ri, ki = _pair(tmp_path)
    rng = np.random.default_rng(7)
    seqs = []
    base = tuple(int(x) for x in rng.integers(0, 50000, size=40))
    for i in range(30):
        if i % 3 == 0:
            t = base[: int(rng.integers(1, 40))]
        else:
            t = tuple(int(x) for x in rng.integers(0, 50000, size=int(rng.integers(1, 30))))
        seqs.append(t)
    for step in range(200):
        op = int(rng.integers(0, 7))
        t = seqs[int(rng.integers(0, len(seqs)))]
        if op in (0, 1):
            fp = kv._tokens_hash(t)
            mb = int(rng.integers(0, 10**9))
            _both(ri, ki, "insert_entry", t, fp, mb, len(t))
        elif op == 2:
            _both(ri, ki, "lookup_exact", t)
        elif op == 3:
            q = t + tuple(int(x) for x in rng.integers(0, 50000, size=int(rng.integers(0, 5))))
            _both(ri, ki, "lookup_prefix", q)
        elif op == 4:
            _both(ri, ki, "delete_entry", t)
        elif op == 5:
            _both(ri, ki, "touch", t)
        else:
            _both(ri, ki, "get_lru", int(rng.integers(1, 5)))
        _both(ri, ki, "get_entry_count")
        _both(ri, ki, "get_total_bytes")
        time.sleep(0.002)  # distinct accessed_at so LRU order is defined
    _both(ri, ki, "all_entries")
    _both(ri, ki, "get_lru")
    _both(ri, ki, "lookup_prefix", ())
    ri.close()
    ki.close()


def test_prefix_lookup_longest_first(tmp_path):
    _, ki = _pair(tmp_path)
    long = tuple(range(100, 140))
    for n in (3, 10, 16, 17, 40):
        ki.insert_entry(long[:n], kv._tokens_hash(long[:n]), n * 10, n)
    res = ki.lookup_prefix(long + (1, 2))
    assert [r["num_tokens"] for r in res] == [40, 17, 16, 10, 3]
    assert set(res[0]) == {"token_hash", "file_path", "memory_bytes", "num_tokens"}
    assert ki.lookup_prefix(long[:12]) and ki.lookup_prefix(long[:12])[0]["num_tokens"] == 10
    assert ki.lookup_prefix((999,)) == []
    ki.close()


def test_cross_open_both_ways(tmp_path):
    d = tmp_path / "shared"
    d.mkdir(mode=0o700)
    r = ref.SSDIndex(str(d))
    r.insert_entry((1, 2, 3), ref._tokens_hash((1, 2, 3)), 10, 3)
    r.insert_entry(tuple(range(20)), ref._tokens_hash(tuple(range(20))), 20, 20)
    r.close()
    k = kv.SSDIndex(str(d))
    assert k.lookup_exact((1, 2, 3)) == {"file_path": ref._tokens_hash((1, 2, 3)),
                                         "memory_bytes": 10, "num_tokens": 3}
    assert k.lookup_prefix(tuple(range(25)))[0]["file_path"] == ref._tokens_hash(tuple(range(20)))
    k.insert_entry((4, 5), kv._tokens_hash((4, 5)), 30, 2)
    k.delete_entry((1, 2, 3))
    k.close()
    r = ref.SSDIndex(str(d))
    assert r.lookup_exact((1, 2, 3)) is None
    assert r.lookup_exact((4, 5)) == {"file_path": kv._tokens_hash((4, 5)),
                                      "memory_bytes": 30, "num_tokens": 2}
    assert r.lookup_prefix((4, 5, 6))[0]["file_path"] == kv._tokens_hash((4, 5))
    assert r.get_total_bytes() == 50
    r.close()


def test_legacy_table_without_prefix_hash_is_migrated(tmp_path):
    d = tmp_path / "legacy"
    d.mkdir(mode=0o700)
    conn = sqlite3.connect(str(d / "index.db"))
    conn.executescript("""
        CREATE TABLE schema_version (version INTEGER NOT NULL);
        INSERT INTO schema_version VALUES (1);
        CREATE TABLE entries (
            token_hash TEXT PRIMARY KEY, tokens_blob BLOB NOT NULL,
            num_tokens INTEGER NOT NULL, file_path TEXT NOT NULL,
            memory_bytes INTEGER NOT NULL, created_at REAL NOT NULL,
            accessed_at REAL NOT NULL);
    """)
    toks = tuple(range(30))
    conn.execute("INSERT INTO entries VALUES (?,?,?,?,?,?,?)",
                 (kv._tokens_hash(toks), kv._tokens_to_blob(toks), 30, kv._tokens_hash(toks), 5,
                  time.time(), time.time()))
    conn.commit()
    conn.close()
    k = kv.SSDIndex(str(d))
    assert k.lookup_prefix(toks + (7,))[0]["file_path"] == kv._tokens_hash(toks)
    k.close()
    conn = sqlite3.connect(str(d / "index.db"))
    cols = {r[1] for r in conn.execute("PRAGMA table_info(entries)")}
    ph = conn.execute("SELECT prefix_hash FROM entries").fetchone()[0]
    conn.close()
    assert "prefix_hash" in cols and ph == kv._prefix_hash(toks)


def test_any_file_path_and_num_tokens_stored_as_the_reference(tmp_path):
    # The reference's SSDIndex is a general table: whatever file_path and
    # num_tokens are inserted come back (a tier ignores such rows).
    ri, ki = _pair(tmp_path)
    rows = [((1, 2), "../../elsewhere", 1, 2), ((1, 2, 3), "x" * 500, 2, 3),
            ((4,), "entrée ☃.safetensors", 3, 1), ((5, 6), "", 4, 7),
            (tuple(range(20)), "/abs/path", 5, 20)]
    for r in rows:
        _both(ri, ki, "insert_entry", *r)
    for t, *_ in rows:
        _both(ri, ki, "lookup_exact", t)
    _both(ri, ki, "lookup_prefix", tuple(range(25)))
    _both(ri, ki, "lookup_prefix", (5, 6, 7))  # num_tokens 7 != 2: no match
    _both(ri, ki, "lookup_prefix", (1, 2, 3, 4))
    _both(ri, ki, "all_entries")
    _both(ri, ki, "get_total_bytes")
    with pytest.raises(ValueError):
        ki.insert_entry((1,), "nul\0inside", 1, 1)
    ri.close()
    ki.close()


def test_closed_index_raises_like_sqlite(tmp_path):
    _, ki = _pair(tmp_path)
    ki.close()
    ki.close()  # idempotent, as sqlite3's close
    with pytest.raises(sqlite3.ProgrammingError):
        ki.lookup_exact((1,))


def test_index_in_missing_directory_fails(tmp_path):
    with pytest.raises(Exception) as e_ref:
        ref.SSDIndex(str(tmp_path / "missing" / "deeper"))
    with pytest.raises(Exception) as e_kv:
        kv.SSDIndex(str(tmp_path / "missing" / "deeper"))
    assert isinstance(e_ref.value, sqlite3.OperationalError)
    assert isinstance(e_kv.value, (sqlite3.DatabaseError, OSError))
