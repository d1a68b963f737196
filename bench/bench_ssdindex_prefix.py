#!/usr/bin/env python3
"""The standalone SSDIndex's lookup_prefix (kvtier.ssd_cache.SSDIndex over
kvt_index_lookup_prefix) against the reference's SSDIndex (ssd_cache_ref), on
the same rows, in one process: ROWS rows sharing a PROMPT-token system prompt,
each with its own 8..64 more tokens and a file_path string of its own (not a
token hash: the standalone index returns any path as stored). Every row
shares the query's first 16 tokens, so the reference's prefix_hash filter
keeps all of them as candidates and reads, sorts and compares ROWS blobs per
lookup. Each round times LOOKUPS lookups of each index (alternating which
goes first), every query one row's tokens plus 16 more, and checks both
answers are equal; the line printed is the median over rounds of the
per-round ratio reference time / kvtier time, with its spread.

Target (issue 27): >= 100x the reference at 10,000 rows sharing a prompt.

  /usr/bin/python3 bench/bench_ssdindex_prefix.py [--rows N] [--prompt N]
      [--lookups N] [--rounds N] [--seed N]

Run after building (the library is build/libkvtier.so unless KVTIER_LIBRARY
says otherwise).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (os.path.join(_ROOT, "bindings", "python"),
           os.path.join(_ROOT, "tests", "reference")):
    if _p not in sys.path:
        sys.path.insert(0, _p)
if "KVTIER_LIBRARY" not in os.environ:
    for cand in ("build/libkvtier.so", "build-rel/libkvtier.so"):
        p = os.path.join(_ROOT, cand)
        if os.path.exists(p):
            os.environ["KVTIER_LIBRARY"] = p
            break

import ssd_cache_ref as ref  # noqa: E402
from kvtier import ssd_cache as kv  # noqa: E402


def make_rows(n: int, prompt: int, seed: int) -> list:
    rng = random.Random(seed)
    sys_prompt = tuple(rng.randrange(128000) for _ in range(prompt))
    rows = []
    for i in range(n):
        own = tuple(rng.randrange(128000) for _ in range(rng.randint(8, 64)))
        toks = sys_prompt + own
        rows.append((toks, f"conv-{i:05d}/entry.bin", 1000 + i, len(toks)))
    return rows


def timed(index, queries) -> tuple[float, list]:
    out = []
    t0 = time.perf_counter()
    for q in queries:
        out.append(index.lookup_prefix(q))
    return time.perf_counter() - t0, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=10000)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--lookups", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    base = tempfile.mkdtemp(prefix="kvt-bench-ssdindex-")
    try:
        rows = make_rows(a.rows, a.prompt, a.seed)
        dirs = []
        for name in ("ref", "kv"):
            d = os.path.join(base, name)
            os.mkdir(d, 0o700)
            dirs.append(d)
        ri, ki = ref.SSDIndex(dirs[0]), kv.SSDIndex(dirs[1])
        for r in rows:
            ri.insert_entry(*r)
            ki.insert_entry(*r)
        rng = random.Random(a.seed + 1)
        # One untimed lookup each: the reference's page cache of index.db,
        # kvtier's candidate map (built at the first lookup) - both steady.
        warm = rows[0][0] + (1,)
        if ri.lookup_prefix(warm) != ki.lookup_prefix(warm):
            print("MISMATCH on the warm-up query", file=sys.stderr)
            return 1
        ratios, t_ref, t_kv = [], [], []
        for k in range(a.rounds):
            qs = []
            for _ in range(a.lookups):
                toks = rows[rng.randrange(len(rows))][0]
                qs.append(toks + tuple(rng.randrange(128000)
                                       for _ in range(16)))
            if k % 2 == 0:
                tr, rr = timed(ri, qs)
                tk, kr = timed(ki, qs)
            else:
                tk, kr = timed(ki, qs)
                tr, rr = timed(ri, qs)
            if kr != rr:
                print("MISMATCH: kvtier and the reference answered "
                      "differently", file=sys.stderr)
                return 1
            if any(len(x) != 1 for x in kr):
                print("MISMATCH: a query did not find its one row",
                      file=sys.stderr)
                return 1
            t_ref.append(tr / a.lookups)
            t_kv.append(tk / a.lookups)
            ratios.append(tr / tk if tk > 0 else 0.0)
        ri.close()
        ki.close()
        med = statistics.median(ratios)
        print(f"# bench_ssdindex_prefix: {a.rows} rows sharing a "
              f"{a.prompt}-token prompt (+8..64 own tokens, own file_path), "
              f"{a.lookups} lookups x {a.rounds} rounds, answers compared")
        print(f"{'ssdindex_lookup_prefix':<34} "
              f"{statistics.median(t_kv) * 1e6:10.1f} us   reference "
              f"{statistics.median(t_ref) * 1e6:10.1f} us   ratio "
              f"{med:8.1f}x (spread {min(ratios):.1f}..{max(ratios):.1f})  "
              f"target >= 100  {'PASS' if med >= 100 else 'MISS'}  "
              f"[the reference's SSDIndex.lookup_prefix on the same rows]")
        return 0
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
