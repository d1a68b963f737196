"""SSDIndex.lookup_prefix (kvt_index_lookup_prefix over its candidate map)
answers exactly as the reference's SSDIndex on the same index.db: the rows it
returns, their order (longest first), and every column as stored - any
file_path, tampered prefix_hash / num_tokens / tokens_blob rows included -
also after the map was built and the rows changed underneath it, through the
reference's own connection or a raw SQLite one."""

from __future__ import annotations

import random
import sqlite3

import pytest

import ssd_cache_ref as ref
from kvtier import ssd_cache as kv


def _canon(rows):
    # Rows of equal num_tokens (only a hand-written table holds them: equal
    # blobs under different token_hash) come in SQLite's order in the
    # reference and in rowid order here: compared as sets per length.
    return sorted(rows, key=lambda r: (-r["num_tokens"], r["token_hash"],
                                       r["file_path"], r["memory_bytes"]))


def _same(ri, ki, q):
    r = ri.lookup_prefix(q)
    k = ki.lookup_prefix(q)
    assert [x["num_tokens"] for x in k] == [x["num_tokens"] for x in r], (q, k, r)
    assert _canon(k) == _canon(r), (q, k, r)
    return k


@pytest.fixture
def pair(tmp_path):
    d = tmp_path / "idx"
    d.mkdir(mode=0o700)
    ri = ref.SSDIndex(str(d))
    ki = kv.SSDIndex(str(d))
    yield ri, ki, str(d / "index.db")
    ri.close()
    ki.close()


def _rows(rng, n, prompt):
    out, seen = [], set()
    for i in range(n):
        own = tuple(rng.randrange(1000) for _ in range(rng.randint(0, 24)))
        cut = rng.randint(1, len(prompt))
        toks = prompt[:cut] + own
        if toks in seen:  # one row per token sequence (insert replaces)
            continue
        seen.add(toks)
        paths = [f"p{i}.bin", "../../outside", "", "entrée ☃", "x" * 300,
                 kv._tokens_hash(toks), "/abs/" + str(i)]
        out.append((toks, paths[i % len(paths)], rng.randrange(10**12),
                    len(toks)))
    return out


def _queries(rng, rows, prompt):
    qs = [prompt, prompt[:1], prompt[:15], prompt[:16], prompt[:17], (7,)]
    for _ in range(40):
        t = rows[rng.randrange(len(rows))][0]
        qs.append(t + tuple(rng.randrange(1000)
                            for _ in range(rng.randint(0, 20))))
        qs.append(t[:rng.randint(1, len(t))])
    return qs


def test_differential_as_stored_through_both_connections(pair):
    ri, ki, _ = pair
    rng = random.Random(11)
    prompt = tuple(rng.randrange(1000) for _ in range(40))
    rows = _rows(rng, 300, prompt)
    for i, r in enumerate(rows):
        (ri if i % 2 else ki).insert_entry(*r)
    qs = _queries(rng, rows, prompt)
    hits = sum(len(_same(ri, ki, q)) for q in qs)
    assert hits > 50
    # Rows of every file_path come back as stored.
    for toks, fp, mb, n in rows[:20]:
        got = ki.lookup_prefix(toks)
        assert any(x["file_path"] == fp and x["memory_bytes"] == mb
                   for x in got if x["num_tokens"] == n), (toks, got)
    # The map is built now: writes through the reference's connection (a
    # commit kvtier's connection did not make) are seen at once.
    extra = _rows(random.Random(12), 60, prompt)
    for r in extra:
        ri.insert_entry(*r)
    for toks, *_ in rows[:40]:
        ri.delete_entry(toks)
    for q in _queries(rng, rows + extra, prompt):
        _same(ri, ki, q)
    # And through its own: inserts, replaces (a new file_path for the same
    # tokens) and deletes, interleaved with lookups.
    for i, (toks, fp, mb, n) in enumerate(extra):
        if i % 3 == 0:
            ki.insert_entry(toks, "replaced-" + fp, mb + 1, n)
        elif i % 3 == 1:
            ki.delete_entry(toks)
        _same(ri, ki, toks + (1, 2))
    for q in _queries(rng, rows + extra, prompt):
        _same(ri, ki, q)


def test_tampered_rows_follow_the_reference(pair):
    ri, ki, db = pair
    rng = random.Random(5)
    prompt = tuple(range(100, 150))
    rows = _rows(rng, 80, prompt)
    for r in rows:
        ki.insert_entry(*r)
    q = prompt + (1, 2, 3)
    _same(ri, ki, q)  # the map is built before the rows are changed
    c = sqlite3.connect(db)
    c.execute("PRAGMA busy_timeout = 5000")
    hs = [r[0] for r in c.execute("SELECT token_hash FROM entries")]
    other = kv._tokens_hash(prompt[:5])  # a hash of another query prefix
    updates = [
        ("UPDATE entries SET prefix_hash = ? WHERE token_hash = ?", (other, hs[0])),
        ("UPDATE entries SET prefix_hash = ? WHERE token_hash = ?",
         ("0" * 64, hs[1])),
        ("UPDATE entries SET prefix_hash = NULL WHERE token_hash = ?", (hs[2],)),
        ("UPDATE entries SET prefix_hash = upper(prefix_hash) WHERE token_hash = ?",
         (hs[3],)),
        ("UPDATE entries SET prefix_hash = CAST(prefix_hash AS BLOB) "
         "WHERE token_hash = ?", (hs[4],)),
        ("UPDATE entries SET num_tokens = num_tokens + 1 WHERE token_hash = ?",
         (hs[5],)),
        ("UPDATE entries SET num_tokens = 2, tokens_blob = ? WHERE token_hash = ?",
         (kv._tokens_to_blob(prompt[:2]), hs[6])),
        ("UPDATE entries SET tokens_blob = ? WHERE token_hash = ?",
         (kv._tokens_to_blob(prompt[:3]) + b"\x01", hs[7])),
        ("UPDATE entries SET file_path = 'moved/elsewhere', memory_bytes = 7 "
         "WHERE token_hash = ?", (hs[8],)),
        ("UPDATE entries SET token_hash = ? WHERE token_hash = ?",
         ("f" * 64, hs[9])),
    ]
    for sql, args in updates:
        c.execute(sql, args)
    # Equal blobs under other token_hashes (ties), and a row whose
    # prefix_hash names a longer prefix of the query than its own tokens.
    for i in range(3):
        c.execute("INSERT INTO entries SELECT ?, tokens_blob, prefix_hash, "
                  "num_tokens, 'dup' || ?, memory_bytes, created_at, "
                  "accessed_at FROM entries WHERE token_hash = ?",
                  (f"{i:064x}", i, hs[10]))
    c.execute("INSERT INTO entries VALUES (?,?,?,?,?,?,?,?)",
              ("e" * 64, kv._tokens_to_blob(prompt[:4]),
               kv._tokens_hash(prompt[:12]), 4, "short-row", 1, 1.0, 1.0))
    c.execute("INSERT INTO entries VALUES (?,?,?,?,?,?,?,?)",
              ("d" * 64, b"", kv._tokens_hash(prompt[:3]), 0, "empty", 2,
               1.0, 1.0))
    c.commit()
    c.close()
    for q in [q, prompt, prompt[:4], prompt[:12], prompt[:3]] + \
            _queries(rng, rows, prompt):
        _same(ri, ki, q)
    got = ki.lookup_prefix(prompt + (9,))
    assert "short-row" in {x["file_path"] for x in got}
    assert "empty" in {x["file_path"] for x in got}


def test_many_rows_sharing_a_prompt(pair):
    # The bench's shape, small: every row shares the first 16 tokens, so the
    # reference reads them all; the answer is still its one row.
    ri, ki, _ = pair
    rng = random.Random(3)
    prompt = tuple(rng.randrange(128000) for _ in range(64))
    rows = []
    for i in range(500):
        t = prompt + tuple(rng.randrange(128000)
                           for _ in range(rng.randint(1, 8)))
        rows.append(t)
        ki.insert_entry(t, f"c{i}", i, len(t))
    ki.insert_entry(prompt, "the-prompt", 1, len(prompt))
    for t in rows[::25]:
        got = _same(ri, ki, t + (5,))
        assert [x["num_tokens"] for x in got] == [len(t), len(prompt)]
        assert got[1]["file_path"] == "the-prompt"
