"""index_reference_check.py - runs the reference SSDIndex's exact SQL (schema script, migration
checks, and every query it issues) with Python's sqlite3 over an index.db written by kvtier, and
checks the answers. Called by test_index with the cache directory; exits non-zero on mismatch.
Expected content: tokens t = [-20, -13, ...] (40 tokens, step 7), entries t[:40] (memory 1234)
and t[:10] (memory 99)."""
import array
import hashlib
import os
import sqlite3
import sys

PREFIX = 16


def blob(tokens):
    return array.array("i", tokens).tobytes()


def thash(tokens):
    return hashlib.sha256(blob(tokens)).hexdigest()


def main():
    cache_dir = sys.argv[1]
    conn = sqlite3.connect(os.path.join(cache_dir, "index.db"))
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.row_factory = sqlite3.Row
    # _create_tables on an existing kvtier DB must be a no-op.
    conn.executescript("""
        CREATE TABLE IF NOT EXISTS schema_version (
            version INTEGER NOT NULL
        );

        CREATE TABLE IF NOT EXISTS entries (
            token_hash   TEXT PRIMARY KEY,
            tokens_blob  BLOB NOT NULL,
            prefix_hash  TEXT,
            num_tokens   INTEGER NOT NULL,
            file_path    TEXT NOT NULL,
            memory_bytes INTEGER NOT NULL,
            created_at   REAL NOT NULL,
            accessed_at  REAL NOT NULL
        );

        """)
    cols = {r["name"] for r in conn.execute("PRAGMA table_info(entries)").fetchall()}
    assert "prefix_hash" in cols, cols
    assert conn.execute("SELECT COUNT(*) FROM schema_version").fetchone()[0] == 1
    assert conn.execute(
        "SELECT COUNT(*) FROM entries WHERE prefix_hash IS NULL").fetchone()[0] == 0
    t = tuple(-20 + 7 * i for i in range(40))
    # lookup_exact
    row = conn.execute(
        "SELECT file_path, memory_bytes, num_tokens FROM entries WHERE token_hash = ?",
        (thash(t),)).fetchone()
    assert row is not None and row["file_path"] == thash(t), row
    assert row["memory_bytes"] == 1234 and row["num_tokens"] == 40
    # lookup_prefix, verbatim
    query = t + (5, 6, 7)
    qblob = blob(query)
    hashes = {thash(query[:n]) for n in range(1, min(len(query), PREFIX) + 1)}
    ph = ",".join("?" for _ in hashes)
    rows = conn.execute(
        "SELECT token_hash, tokens_blob, num_tokens, file_path, memory_bytes "
        f"FROM entries WHERE num_tokens <= ? AND prefix_hash IN ({ph}) "
        "ORDER BY num_tokens DESC", (len(query), *hashes)).fetchall()
    got = [r["num_tokens"] for r in rows if r["tokens_blob"] == qblob[:r["num_tokens"] * 4]]
    assert got == [40, 10], got
    # get_lru / all_entries / totals
    lru = conn.execute(
        "SELECT token_hash, tokens_blob, num_tokens, file_path, memory_bytes "
        "FROM entries ORDER BY accessed_at ASC LIMIT ?", (10,)).fetchall()
    assert [r["num_tokens"] for r in lru] == [40, 10]
    assert tuple(array.array("i", lru[0]["tokens_blob"])) == t
    assert conn.execute("SELECT COALESCE(SUM(memory_bytes), 0) FROM entries").fetchone()[0] == 1333
    assert conn.execute("SELECT COUNT(*) FROM entries").fetchone()[0] == 2
    for r in conn.execute("SELECT created_at, accessed_at FROM entries"):
        assert isinstance(r[0], float) and isinstance(r[1], float)
    conn.close()
    print("reference queries OK")


if __name__ == "__main__":
    main()
