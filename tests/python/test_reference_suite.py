"""Differential tests of SSDIndex: kvtier.ssd_cache.SSDIndex and the
reference's (ssd_cache_ref, assembled from the seed) each get a directory of
their own and receive the same calls, and every answer - return value or
exception type - must be the same.  The scenarios aim at what an index can
get subtly wrong: the 16-token boundary of the prefix filter, rows whose
stored prefix_hash or tokens_blob no longer match their tokens, tables from
before the prefix_hash column, num_tokens that differ from the key's length,
replace/delete/touch interleavings and the LRU order they leave, and a
directory written by one implementation and read by the other."""

from __future__ import annotations

import os
import random
import sqlite3
import time

import pytest

import ssd_cache_ref as ref
from kvtier import ssd_cache as kv

PREFIX = 16  # tokens hashed into prefix_hash (the reference's _PREFIX_FILTER_TOKENS)


def _outcome(fn, *args, **kw):
    try:
        return ("ok", fn(*args, **kw))
    except Exception as e:  # the type is what both must agree on
        return ("raised", type(e))


class Twin:
    """One SSDIndex of each implementation, each over its own directory.
    ``twin.<method>(...)`` calls the method on both and returns the common
    answer, failing the test when the answers (or exception types) differ."""

    def __init__(self, base, open_ref=None, open_kv=None):
        self.dirs = {"reference": os.path.join(base, "reference"),
                     "kvtier": os.path.join(base, "kvtier")}
        for d in self.dirs.values():
            os.makedirs(d, exist_ok=True)
        self.ref = (open_ref or ref.SSDIndex)(self.dirs["reference"])
        self.kv = (open_kv or kv.SSDIndex)(self.dirs["kvtier"])
        self.calls = 0

    def __getattr__(self, name):
        def both(*args, **kw):
            self.calls += 1
            want = _outcome(getattr(self.ref, name), *args, **kw)
            got = _outcome(getattr(self.kv, name), *args, **kw)
            assert got == want, f"{name}{args}: kvtier {got!r}, reference {want!r}"
            if want[0] == "raised":
                raise want[1](f"both raised on {name}{args}")
            return want[1]
        return both

    def sql(self, statement, params=()):
        """Run one statement on both index.db files (outside the indexes)."""
        for d in self.dirs.values():
            conn = sqlite3.connect(os.path.join(d, "index.db"))
            try:
                conn.execute(statement, params)
                conn.commit()
            finally:
                conn.close()

    def column(self, query):
        """The same query on both files; the answers must agree."""
        out = {}
        for who, d in self.dirs.items():
            conn = sqlite3.connect(os.path.join(d, "index.db"))
            try:
                out[who] = sorted(conn.execute(query).fetchall(), key=repr)
            finally:
                conn.close()
        assert out["kvtier"] == out["reference"], query
        return out["reference"]

    def close(self):
        self.ref.close()
        self.kv.close()


@pytest.fixture
def twin(tmp_path):
    t = Twin(str(tmp_path))
    yield t
    t.close()


def tick():
    """Let the clock move, so access times (LRU order) are distinct."""
    time.sleep(0.002)


def chain(rng, n, lo=-5000, hi=150000):
    return tuple(rng.randint(lo, hi) for _ in range(n))


def test_fresh_files_have_the_same_tables_and_version(twin):
    cols = twin.column("SELECT name, type, \"notnull\", pk FROM pragma_table_info('entries')")
    assert {c[0] for c in cols} >= {"token_hash", "tokens_blob", "prefix_hash", "num_tokens",
                                    "file_path", "memory_bytes", "created_at", "accessed_at"}
    twin.column("SELECT name, type FROM pragma_table_info('schema_version')")
    assert twin.column("SELECT version FROM schema_version") == [(1,)]
    assert twin.get_entry_count() == 0 and twin.get_total_bytes() == 0
    assert twin.get_lru() == [] and twin.all_entries() == []


def test_exact_lookup_of_keys_near_stored_ones(twin):
    rng = random.Random(41)
    stored = []
    for i in range(25):
        key = chain(rng, rng.choice((1, 2, 15, 16, 17, 90)))
        twin.insert_entry(key, f"blk/{i:03d}-{rng.random():.6f}", rng.randint(0, 1 << 40),
                          len(key))
        stored.append(key)
    probes = []
    for key in stored:
        probes += [key, key[:-1], key + (0,), key[1:], tuple(reversed(key))]
    probes += [(), (2 ** 31 - 1,), (-(2 ** 31),)]
    hits = [twin.lookup_exact(p) for p in probes]
    assert sum(h is not None for h in hits) >= len(stored)  # the keys themselves


def test_prefix_lookup_around_the_filter_boundary(twin):
    rng = random.Random(7)
    trunk = chain(rng, 3 * PREFIX + 5)
    for n in (1, PREFIX - 1, PREFIX, PREFIX + 1, 2 * PREFIX, 3 * PREFIX + 5):
        twin.insert_entry(trunk[:n], f"trunk{n}", n * 3, n)
    branch = trunk[:PREFIX + 3] + chain(rng, 12)  # leaves the trunk after the filter
    twin.insert_entry(branch, "branch", 1, len(branch))
    early = trunk[:PREFIX - 4] + chain(rng, 30)   # leaves it inside the filter
    twin.insert_entry(early, "early", 1, len(early))
    answers = {}
    for cut in range(0, len(trunk) + 1, 3):
        for tail in ((), (99,), chain(rng, 20)):
            q = trunk[:cut] + tail
            answers[q] = twin.lookup_prefix(q)
    answers[branch + (1, 2)] = twin.lookup_prefix(branch + (1, 2))
    answers[early] = twin.lookup_prefix(early)
    full = answers[trunk[:len(trunk) - len(trunk) % 3]]
    assert [r["num_tokens"] for r in full] == sorted(
        (r["num_tokens"] for r in full), reverse=True) and len(full) >= 4
    assert [r["file_path"] for r in answers[branch + (1, 2)]][:1] == ["branch"]


def test_rows_with_a_tampered_prefix_hash_or_blob_are_not_candidates(twin):
    rng = random.Random(3)
    base = chain(rng, 40)
    for n in (6, PREFIX, 25, 33, 40):
        twin.insert_entry(base[:n], f"b{n}", n, n)
    before = [r["file_path"] for r in twin.lookup_prefix(base + (1,))]
    assert before == ["b40", "b33", "b25", f"b{PREFIX}", "b6"]
    # A row whose prefix_hash says it starts elsewhere is filtered out even
    # though its tokens match the query ...
    twin.sql("UPDATE entries SET prefix_hash = 'not-a-hash' WHERE file_path = 'b25'")
    # ... and so is a row whose tokens_blob no longer matches the query.
    blob = bytearray(ref._tokens_to_blob(base[:33]))
    blob[-1] ^= 0x40
    twin.sql("UPDATE entries SET tokens_blob = ? WHERE file_path = 'b33'", (bytes(blob),))
    after = [r["file_path"] for r in twin.lookup_prefix(base + (1,))]
    assert after == ["b40", f"b{PREFIX}", "b6"]
    # The exact lookup goes by token_hash and still finds both.
    assert twin.lookup_exact(base[:25])["file_path"] == "b25"
    assert twin.lookup_exact(base[:33])["file_path"] == "b33"


def _legacy_db(d, rows):
    conn = sqlite3.connect(os.path.join(d, "index.db"))
    conn.executescript("""
        CREATE TABLE schema_version (version INTEGER NOT NULL);
        INSERT INTO schema_version (version) VALUES (1);
        CREATE TABLE entries (
            token_hash TEXT PRIMARY KEY, tokens_blob BLOB NOT NULL,
            num_tokens INTEGER NOT NULL, file_path TEXT NOT NULL,
            memory_bytes INTEGER NOT NULL, created_at REAL NOT NULL,
            accessed_at REAL NOT NULL);
    """)
    now = 1.7e9
    for i, (toks, fp) in enumerate(rows):
        conn.execute("INSERT INTO entries VALUES (?, ?, ?, ?, ?, ?, ?)",
                     (ref._tokens_hash(toks), ref._tokens_to_blob(toks), len(toks), fp,
                      10 + i, now + i, now + i))
    conn.commit()
    conn.close()


def test_tables_without_prefix_hash_are_migrated_alike(tmp_path):
    rng = random.Random(12)
    trunk = chain(rng, 50)
    rows = [(trunk[:n], f"old{n}") for n in (3, PREFIX, PREFIX + 9, 50)]
    rows.append((chain(rng, 20), "unrelated"))
    for who in ("reference", "kvtier"):
        os.makedirs(tmp_path / who)
        _legacy_db(str(tmp_path / who), rows)
    twin = Twin(str(tmp_path))
    try:
        hashes = twin.column("SELECT file_path, prefix_hash FROM entries")
        assert all(h for _, h in hashes)
        found = twin.lookup_prefix(trunk + (0,))
        assert [r["file_path"] for r in found] == ["old50", f"old{PREFIX + 9}",
                                                   f"old{PREFIX}", "old3"]
        assert [r["file_path"] for r in twin.get_lru()] == [fp for _, fp in rows]
    finally:
        twin.close()


def test_replacing_and_deleting_keep_counts_and_totals_alike(twin):
    rng = random.Random(5)
    keys = [chain(rng, rng.randint(1, 30)) for _ in range(12)]
    for round_ in range(3):
        for k in keys:
            twin.insert_entry(k, f"r{round_}", rng.randint(1, 5000), rng.randint(0, 64))
        assert twin.get_entry_count() == len(keys)
        twin.get_total_bytes()
        for k in keys[round_::3]:
            twin.delete_entry(k)
            twin.delete_entry(k)  # already gone
        twin.delete_entry(chain(rng, 4))  # never there
        twin.get_entry_count()
        twin.get_total_bytes()
        assert sorted(e["token_hash"] for e in twin.all_entries()) == sorted(
            ref._tokens_hash(k) for k in keys if k not in keys[round_::3])


def test_touch_and_insert_order_the_lru_alike(twin):
    rng = random.Random(9)
    keys = [chain(rng, 5 + i) for i in range(8)]
    for k in keys:
        twin.insert_entry(k, "x", 1, len(k))
        tick()
    for k in (keys[2], keys[0], keys[5], chain(rng, 3), keys[2]):
        twin.touch(k)
        tick()
    twin.insert_entry(keys[7], "again", 2, 12)  # a replace is a use too
    tick()
    for limit in (0, 1, 3, 8, 50):
        twin.get_lru(limit=limit)
    order = [ref._blob_to_tokens(r["tokens_blob"]) for r in twin.get_lru(limit=8)]
    assert order[-3:] == [keys[5], keys[2], keys[7]]
    assert [ref._blob_to_tokens(r["tokens_blob"]) for r in twin.all_entries()] == \
        list(reversed(order))


def test_num_tokens_other_than_the_key_length(twin):
    key = tuple(range(500, 530))
    twin.insert_entry(key, "claims-more", 8, 64)
    twin.insert_entry(key[:20], "claims-less", 8, 2)
    twin.insert_entry(key[:10], "claims-none", 8, 0)
    for q in (key, key + (1,) * 40, key[:20], key[:12], key[:2]):
        twin.lookup_prefix(q)
        twin.lookup_exact(q)
    assert twin.lookup_exact(key)["num_tokens"] == 64
    twin.get_lru()


def test_bad_keys_and_closed_indexes_fail_alike(tmp_path):
    twin = Twin(str(tmp_path))
    for bad in ((2 ** 31,), (-(2 ** 31) - 1,), ("7",), (1.5,)):
        with pytest.raises(Exception):
            twin.lookup_exact(bad)
        with pytest.raises(Exception):
            twin.insert_entry(bad, "x", 1, 1)
    twin.close()
    for call, args in (("lookup_exact", ((1,),)), ("lookup_prefix", ((1, 2),)),
                       ("get_entry_count", ()), ("insert_entry", ((1,), "x", 1, 1))):
        with pytest.raises(Exception):
            getattr(twin, call)(*args)


@pytest.mark.parametrize("writer", ["reference", "kvtier"])
def test_one_writes_the_other_reads(tmp_path, writer):
    d = str(tmp_path / "shared")
    os.makedirs(d)
    rng = random.Random(77)
    write_mod, read_mod = (ref, kv) if writer == "reference" else (kv, ref)
    w = write_mod.SSDIndex(d)
    keys = []
    trunk = chain(rng, 45)
    for n in (4, PREFIX, 30, 45):
        w.insert_entry(trunk[:n], f"{writer}-{n}", n * 100, n)
        keys.append(trunk[:n])
        tick()
    w.touch(trunk[:4])
    w.delete_entry(trunk[:30])
    expect = {"prefix": w.lookup_prefix(trunk + (3,)), "lru": w.get_lru(),
              "all": w.all_entries(), "count": w.get_entry_count(),
              "bytes": w.get_total_bytes(),
              "exact": [w.lookup_exact(k) for k in keys]}
    w.close()
    r = read_mod.SSDIndex(d)
    try:
        got = {"prefix": r.lookup_prefix(trunk + (3,)), "lru": r.get_lru(),
               "all": r.all_entries(), "count": r.get_entry_count(),
               "bytes": r.get_total_bytes(),
               "exact": [r.lookup_exact(k) for k in keys]}
    finally:
        r.close()
    assert got == expect
    assert expect["count"] == 3 and expect["exact"][2] is None


@pytest.mark.parametrize("file_path", ["", "ü/ß/☃.bin", "a" * 4000, "../../etc/x",
                                       "with\nnewline", "quote'\"mark"])
def test_file_paths_and_sizes_are_stored_as_given(twin, file_path):
    for i, size in enumerate((0, 1, 2 ** 31, 2 ** 53 + 1, 2 ** 62)):
        twin.insert_entry((i, 1, 2), file_path, size, 3)
    assert twin.lookup_exact((4, 1, 2)) == {"file_path": file_path,
                                            "memory_bytes": 2 ** 62, "num_tokens": 3}
    twin.lookup_prefix((0, 1, 2, 3))
    twin.get_lru()
    assert twin.get_total_bytes() == 1 + 2 ** 31 + 2 ** 53 + 1 + 2 ** 62


def test_reopening_keeps_every_row(tmp_path):
    rng = random.Random(21)
    twin = Twin(str(tmp_path))
    keys = [chain(rng, rng.randint(1, 40)) for _ in range(15)]
    for k in keys:
        twin.insert_entry(k, "p", len(k), len(k))
        tick()
    twin.delete_entry(keys[3])
    twin.touch(keys[0])
    listing = twin.get_lru(limit=100)
    twin.close()
    again = Twin(str(tmp_path))
    try:
        assert again.get_lru(limit=100) == listing
        assert again.get_entry_count() == 14
        for k in keys:
            again.lookup_exact(k)
            again.lookup_prefix(k + (1,))
    finally:
        again.close()


def test_long_keys(twin):
    rng = random.Random(8)
    trunk = chain(rng, 20000)
    for n in (PREFIX, 4096, 19999, 20000):
        twin.insert_entry(trunk[:n], f"long{n}", n, n)
    got = twin.lookup_prefix(trunk + chain(rng, 100))
    assert [r["num_tokens"] for r in got] == [20000, 19999, 4096, PREFIX]
    assert twin.lookup_prefix(trunk[:19998])[0]["num_tokens"] == 4096
    assert twin.lookup_exact(trunk)["file_path"] == "long20000"


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5, 6])
def test_random_operation_sequences(twin, seed):
    rng = random.Random(seed)
    pool = [chain(rng, rng.randint(1, 3 * PREFIX), lo=0, hi=60) for _ in range(6)]
    for _ in range(200):
        op = rng.random()
        if op < 0.25 or not pool:
            base = rng.choice(pool) if pool and rng.random() < 0.7 else ()
            key = base[:rng.randint(0, len(base))] + chain(rng, rng.randint(1, 20), lo=0, hi=60)
            pool.append(key)
            twin.insert_entry(key, f"f{len(pool)}", rng.randint(1, 10 ** 6), len(key))
        elif op < 0.35:
            twin.insert_entry(rng.choice(pool), "replaced", rng.randint(1, 99),
                              rng.randint(1, 80))
        elif op < 0.45:
            twin.delete_entry(rng.choice(pool))
        elif op < 0.55:
            twin.touch(rng.choice(pool))
        elif op < 0.8:
            q = rng.choice(pool)
            twin.lookup_prefix(q[:rng.randint(0, len(q))] + chain(rng, rng.randint(0, 8),
                                                                  lo=0, hi=60))
        elif op < 0.9:
            twin.lookup_exact(rng.choice(pool))
        else:
            twin.get_lru(limit=rng.randint(1, 12))
            twin.get_total_bytes()
            twin.get_entry_count()
        tick() if rng.random() < 0.1 else None
    assert twin.calls >= 200
    twin.all_entries()
