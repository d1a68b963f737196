"""index_reference_check.py - opens an index.db written by kvtier with the
reference's own SSDIndex (tests/reference/ssd_cache_ref, assembled from the
seed at run time) and checks what the reference answers: its open (schema
creation, column migration, prefix-hash backfill) leaves kvtier's file as it
was, and its lookups, LRU listing and totals find kvtier's rows.  Called by
test_index with the cache directory; exit 0 when every check holds, 1 on a
mismatch, 3 (reference_loader.EXIT_UNAVAILABLE) when the reference cannot be
loaded, which test_index reports as a skip tagged seed.

The directory is expected to hold what test_index wrote: tokens
t = (-20, -13, ..., 253) (40 tokens, step 7), entries t[:40] with
memory_bytes 1234 and t[:10] with memory_bytes 99, each with file_path equal
to its token hash and num_tokens equal to its length.
"""

import os
import sqlite3
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "reference"))

import reference_loader  # noqa: E402


def snapshot(db_path):
    """Everything a reader could see in the file: schema objects and rows."""
    conn = sqlite3.connect(db_path)
    try:
        schema = sorted(conn.execute(
            "SELECT type, name, tbl_name, sql FROM sqlite_master").fetchall(),
            key=repr)
        entries = sorted(conn.execute("SELECT * FROM entries").fetchall(), key=repr)
        versions = conn.execute("SELECT * FROM schema_version").fetchall()
    finally:
        conn.close()
    return schema, entries, versions


def check(ok, what, failures):
    if not ok:
        failures.append(what)


def main():
    if len(sys.argv) != 2:
        print("usage: index_reference_check.py CACHE_DIR", file=sys.stderr)
        return 2
    cache_dir = sys.argv[1]
    try:
        ref = reference_loader.require()
    except reference_loader.ReferenceUnavailable as e:
        print(f"index_reference_check: {e}", file=sys.stderr)
        return reference_loader.EXIT_UNAVAILABLE

    db_path = os.path.join(cache_dir, "index.db")
    before = snapshot(db_path)
    failures = []
    t = tuple(range(-20, -20 + 7 * 40, 7))
    long_hash, short_hash = ref._tokens_hash(t), ref._tokens_hash(t[:10])

    index = ref.SSDIndex(cache_dir)
    try:
        got = index.lookup_exact(t)
        check(got == {"file_path": long_hash, "memory_bytes": 1234, "num_tokens": 40},
              f"lookup_exact(t) = {got}", failures)
        got = index.lookup_exact(t[:10])
        check(got == {"file_path": short_hash, "memory_bytes": 99, "num_tokens": 10},
              f"lookup_exact(t[:10]) = {got}", failures)
        check(index.lookup_exact(t[:11]) is None, "lookup_exact(t[:11]) found a row",
              failures)

        # A longer query finds both stored prefixes, the longer first; one
        # that leaves the stored tokens inside the first 16 finds none.
        got = [(r["num_tokens"], r["token_hash"]) for r in index.lookup_prefix(t + (5, 6, 7))]
        check(got == [(40, long_hash), (10, short_hash)],
              f"lookup_prefix(t + 3 tokens) = {got}", failures)
        got = index.lookup_prefix(t[:9] + (0,) * 40)
        check(got == [], f"lookup_prefix(diverging at 9) = {got}", failures)
        got = [r["num_tokens"] for r in index.lookup_prefix(t[:10] + (0,) * 40)]
        check(got == [10], f"lookup_prefix(diverging at 10) = {got}", failures)

        lru = index.get_lru(limit=10)
        check([r["num_tokens"] for r in lru] == [40, 10], f"get_lru = {lru}", failures)
        check(bool(lru) and ref._blob_to_tokens(lru[0]["tokens_blob"]) == t,
              "get_lru's tokens_blob does not decode to t", failures)
        every = index.all_entries()
        check(sorted(r["token_hash"] for r in every) == sorted((long_hash, short_hash)),
              f"all_entries = {every}", failures)
        check(index.get_total_bytes() == 1333, "get_total_bytes != 1333", failures)
        check(index.get_entry_count() == 2, "get_entry_count != 2", failures)
    finally:
        index.close()

    after = snapshot(db_path)
    check(after == before, "the reference's open changed kvtier's index.db: "
          f"schema {before[0]} -> {after[0]}, rows {before[1]} -> {after[1]}", failures)
    conn = sqlite3.connect(db_path)
    try:
        for row in conn.execute("SELECT created_at, accessed_at FROM entries"):
            check(all(isinstance(v, float) for v in row),
                  f"created_at/accessed_at not REAL: {row}", failures)
    finally:
        conn.close()

    for f in failures:
        print(f"index_reference_check: {f}", file=sys.stderr)
    if failures:
        return 1
    print("reference SSDIndex reads kvtier's index.db")
    return 0


if __name__ == "__main__":
    sys.exit(main())
