#!/usr/bin/python3
"""trace_bounds.py - how much of a trace's ideal hit rate any admission rule
could reach at a given disk budget, so that a hit-rate target can be judged
against what the trace allows before a tier is blamed for missing it.  It
models the disk as a token-weighted LRU over the trace's chain blocks (the
same (parent, id) chains and lengths as trace_replay.py's ideal, which it
imports) and replays the requests through it under several admission rules:
write everything; the oracle that writes only blocks some later request will
hit; the best fixed input-length threshold, chosen with hindsight among the
trace's own length fortieths;
the same with the output length too (which the replay's spills do not carry);
and an online rule that learns each class's reuse from a record of every
block seen (kvtier's admission record, with unlimited memory), the class
being the length class or the output and length classes together.  Only the
admission differs between those rules, so the gap between the oracle and the
others is what the trace's visible signals fail to predict.  Two more rows
write everything and change the eviction instead: the shorter prompts' blocks
go first (by kvtier's length classes, and by the best of a few fixed-width
length buckets, chosen with hindsight); and, online, blocks hit since
written are kept over the rest up to half the disk, each by recency plus its
length class's learnt worth (simulate_by_reuse).  Nothing here touches a
tier or a disk: it is a model, and its figures bound, not measure, kvtier.

    /usr/bin/python3 bench/trace_bounds.py --requests 1000 --budgets 0.25,1.0 [--json]
"""

from __future__ import annotations

import argparse
import collections
import heapq
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trace_replay as tr  # noqa: E402  (bench/ is not a package)


def chains(requests: list[dict]) -> list[list[tuple[int, int]]]:
    """Each request as its list of (node, tokens): node numbers name equal
    (parent, id) chains, as in trace_replay.ideal."""
    node_of: dict[tuple[int, int], int] = {}
    out = []
    for req in requests:
        parent, row = -1, []
        for bid, blen in zip(req["ids"], tr.block_lengths(req)):
            node = node_of.setdefault((parent, bid), len(node_of))
            row.append((node, blen))
            parent = node
        out.append(row)
    return out


def simulate(rows: list[list[tuple[int, int]]], capacity: int, admit,
             priority=lambda i: 0) -> dict:
    """A token-weighted disk of `capacity` tokens: per request, the prefix held
    (each block at least as long as asked) hits and is touched; then, if
    admit(i, hit_blocks) says so, the request's blocks are written (a block
    held shorter is rewritten at the longer length). A full disk evicts the
    block of the lowest priority(i) of the request that wrote it, the least
    recently used among equals (plain LRU by default). admit is told nothing
    else: a rule decides from what it learned itself."""
    held: dict[int, tuple[int, int, int]] = {}  # node -> (tokens, priority, stamp)
    heap: list[tuple[int, int, int]] = []
    used = hit = written = stamp = 0

    def touch(node: int, tokens: int, pr: int) -> None:
        nonlocal stamp
        stamp += 1
        held[node] = (tokens, pr, stamp)
        heapq.heappush(heap, (pr, stamp, node))

    for i, row in enumerate(rows):
        k = 0
        for node, blen in row:
            h = held.get(node)
            if h is None or h[0] < blen:
                break
            touch(node, h[0], h[1])
            hit += blen
            k += 1
        if not admit(i, k):
            continue
        pr = priority(i)
        for node, blen in row[k:]:
            h = held.get(node)
            have = h[0] if h else 0
            if have >= blen:
                touch(node, have, h[1])
                continue
            touch(node, blen, pr)
            used += blen - have
            written += blen - have
        while used > capacity and heap:
            _, st, node = heapq.heappop(heap)
            h = held.get(node)
            if h is None or h[2] != st:
                continue  # a stale heap entry: the block was touched since
            used -= h[0]
            del held[node]
    return {"hit_tokens": hit, "written_tokens": written}


def simulate_by_reuse(requests: list[dict], rows: list[list[tuple[int, int]]], capacity: int,
                      guard: float = 0.5, horizon: float = 4.0, prior: float = 8.0) -> dict:
    """Everything written; a full disk evicts by expected reuse, online: two
    pools, blocks hit since they were written and the rest, the hit pool
    giving up a block only while it holds more than `guard` of the tokens
    held (or the other pool is empty); within a pool the lowest last touch
    (counted in block touches) plus `horizon` times the blocks held times
    the block's length class's worth relative to the mean (online_rule's
    learning, from every block seen) goes first."""
    owner: dict[int, int] = {}
    brought: collections.Counter = collections.Counter()
    reread: collections.Counter = collections.Counter()
    held: dict[int, list] = {}  # node -> [tokens, class, stamp, hit]
    pools: tuple[list, list] = ([], [])
    used = hit = written = stamp = hit_used = 0

    def worth(c: int) -> float:
        total = sum(brought.values())
        mean = sum(reread.values()) / total if total else 0.0
        if mean <= 0:
            return 1.0
        return (reread[c] + prior * mean) / (brought[c] + prior) / mean

    def touch(node: int, tokens: int, c: int, was_hit: bool) -> None:
        nonlocal stamp, hit_used
        stamp += 1
        old = held.get(node)
        now_hit = bool(old and old[3]) or was_hit
        if now_hit and not (old and old[3]):
            hit_used += tokens
        held[node] = [tokens, c, stamp, now_hit]
        key = stamp + horizon * len(held) * worth(c)
        heapq.heappush(pools[now_hit], (key, stamp, node))

    for i, row in enumerate(rows):
        c = length_class(requests[i]["length"])
        k = 0
        for node, blen in row:
            h = held.get(node)
            if h is None or h[0] < blen:
                break
            touch(node, h[0], h[1], True)
            hit += blen
            k += 1
        j = 0
        while j < len(row) and row[j][0] in owner:
            j += 1
        if j:
            reread[owner[row[j - 1][0]]] += 1
        new = [n for n, _ in row[j:] if n not in owner]
        for n in new:
            owner[n] = c
        if new:
            brought[c] += 1
        for node, blen in row[k:]:
            h = held.get(node)
            have = h[0] if h else 0
            if have >= blen:
                touch(node, have, h[1], False)
                continue
            if h and h[3]:
                hit_used += blen - have
            touch(node, blen, h[1] if h else c, False)
            used += blen - have
            written += blen - have
        while used > capacity and (pools[0] or pools[1]):
            p = 1 if (hit_used > guard * used and pools[1]) or not pools[0] else 0
            _, st, node = heapq.heappop(pools[p])
            h = held.get(node)
            if h is None or h[2] != st or h[3] != bool(p):
                continue  # stale: touched since, or moved to the hit pool
            used -= h[0]
            if h[3]:
                hit_used -= h[0]
            del held[node]
    return {"hit_tokens": hit, "written_tokens": written}


def simulate_by_priority(rows: list[list[tuple[int, int]]], capacity: int, priority) -> dict:
    """Everything written; a full disk evicts by priority (simulate)."""
    return simulate(rows, capacity, lambda i, k: True, priority)


def length_class(n: int) -> int:
    """Half-octaves from 256 tokens, 16 classes (kvtier's kvti_len_class)."""
    return max(0, min(15, int(2 * math.log2(max(n, 256) / 256))))


def output_class(n: int) -> int:
    """Octaves of the output length, 1 token and below in class 0."""
    return max(0, int(math.log2(max(n, 1))))


def online_rule(requests, rows, threshold: float, prior: float, key=None):
    """Admit a request whose class has earned, per block it brought, at
    least `threshold` times the mean reuse so far (shrunk toward the mean by
    `prior` blocks): learned from every block ever seen, stored or not.  The
    class is the prompt's length class unless key(request) says otherwise."""
    if key is None:
        def key(r):
            return length_class(r["length"])
    owner: dict[int, int] = {}
    brought: collections.Counter = collections.Counter()
    reread: collections.Counter = collections.Counter()

    def admit(i: int, _k: int) -> bool:
        row, c = rows[i], key(requests[i])
        k = 0
        while k < len(row) and row[k][0] in owner:
            k += 1
        if k:
            reread[owner[row[k - 1][0]]] += k
        new = [n for n, _ in row[k:] if n not in owner]
        for n in new:
            owner[n] = c
        brought[c] += len(new)
        total = sum(brought.values())
        mean = sum(reread.values()) / total if total else 0.0
        value = (reread[c] + prior * mean) / (brought[c] + prior)
        return value >= threshold * mean

    return admit


def bounds(requests: list[dict], fraction: float) -> dict:
    rows = chains(requests)
    ide = tr.ideal(requests)
    capacity = int(fraction * ide["unique_tokens"])
    ideal_hit = max(1, ide["hit_tokens"])

    def rate(res):
        return res["hit_tokens"] / ideal_hit

    # Blocks some later request hits in the ideal: the oracle writes a
    # request only where it brings such a block, and then only up to it.
    later_hit: set[int] = set()
    seen: set[int] = set()
    for row in rows:
        for node, _ in row:
            if node not in seen:
                break
            later_hit.add(node)
        seen.update(n for n, _ in row)
    oracle_rows = []
    for row in rows:
        last = max((j for j, (n, _) in enumerate(row) if n in later_hit), default=-1)
        oracle_rows.append(row[:last + 1])

    out = {"fraction": fraction, "capacity_tokens": capacity,
           "ideal_hit_tokens": ide["hit_tokens"]}
    res = simulate(rows, capacity, lambda i, k: True)
    out["write_all"] = {"of_ideal": rate(res), **res}
    res = simulate(oracle_rows, capacity, lambda i, k: True)
    out["oracle"] = {"of_ideal": rate(res), **res}

    # Thresholds at the trace's own input-length fortieths (the shortest
    # included, which admits everything).
    by_len = sorted(r["length"] for r in requests)
    lengths = sorted({by_len[(len(by_len) * j) // 40] for j in range(40)})
    best = None
    for t in lengths:
        res = simulate(rows, capacity, lambda i, k, t=t: requests[i]["length"] >= t)
        if best is None or rate(res) > best["of_ideal"]:
            best = {"of_ideal": rate(res), "min_input_tokens": t, **res}
    out["best_length_threshold"] = best

    best = None
    for t in lengths:
        for o in (10, 20, 50, 100, 200, 500, 1000):
            res = simulate(rows, capacity, lambda i, k, t=t, o=o:
                           requests[i]["length"] >= t and requests[i].get("output", 0) < o)
            if best is None or rate(res) > best["of_ideal"]:
                best = {"of_ideal": rate(res), "min_input_tokens": t, "max_output_tokens": o,
                        **res}
    out["best_length_and_output_threshold"] = best

    best = None
    for thr in (0.5, 0.8, 1.0, 1.2, 1.5, 2.0):
        for prior in (1.0, 8.0, 64.0):
            res = simulate(rows, capacity, online_rule(requests, rows, thr, prior))
            if best is None or rate(res) > best["of_ideal"]:
                best = {"of_ideal": rate(res), "threshold": thr, "prior_blocks": prior, **res}
    out["best_online_length_class"] = best

    # The same learning over (output class, length class): the replay's
    # spills carry prompts only, but the real scheduler stores prompt plus
    # output, so a tier that remembers each prompt's lookup could learn the
    # output length at spill time.  Its figure bounds what that signal adds.
    best = None
    for thr in (0.5, 0.8, 1.0, 1.2, 1.5, 2.0):
        for prior in (1.0, 8.0, 64.0):
            rule = online_rule(requests, rows, thr, prior,
                               key=lambda r: (output_class(r.get("output", 0)),
                                              length_class(r["length"])))
            res = simulate(rows, capacity, rule)
            if best is None or rate(res) > best["of_ideal"]:
                best = {"of_ideal": rate(res), "threshold": thr, "prior_blocks": prior, **res}
    out["best_online_length_output_class"] = best

    # Eviction instead of admission: everything written, the shorter
    # prompts' blocks evicted first (by kvtier's half-octave classes, or by
    # fixed-width length buckets chosen with hindsight).
    best = None
    for width in (0, 1000, 2000, 3000, 4000, 8000):
        res = simulate_by_priority(rows, capacity, lambda i, w=width: (
            length_class(requests[i]["length"]) if w == 0 else requests[i]["length"] // w))
        r = {"of_ideal": rate(res), "bucket_tokens": width or "half-octave classes", **res}
        if width == 0:
            out["evict_shorter_first_classes"] = r
        if best is None or r["of_ideal"] > best["of_ideal"]:
            best = r
    out["best_evict_shorter_first"] = best
    res = simulate_by_reuse(requests, rows, capacity)
    out["evict_by_reuse_online"] = {"of_ideal": rate(res), "guard": 0.5, "horizon": 4.0, **res}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=tr.default_trace())
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--skip", type=int, default=0)
    ap.add_argument("--budgets", default="0.25,1.0",
                    help="disk budgets as fractions of the trace's unique KV")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    a = ap.parse_args(argv)
    try:
        fractions = [float(x) for x in a.budgets.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--budgets {a.budgets!r}: comma-separated numbers expected")
    if not fractions or any(not (f > 0) for f in fractions):
        ap.error("--budgets: every fraction must be > 0")
    if a.requests <= 0:
        ap.error("--requests must be > 0")
    requests = tr.load_trace(a.trace, a.requests, a.skip)
    result = {"trace": a.trace, "requests": len(requests),
              "budgets": [bounds(requests, f) for f in fractions]}
    if a.json:
        json.dump(result, sys.stdout, indent=1)
        print()
        return 0
    print(f"{len(requests)} requests of {a.trace}: hit tokens as a fraction of the ideal "
          f"(an infinite cache), token-weighted block LRU")
    for b in result["budgets"]:
        print(f"\ndisk budget {b['fraction']}x the unique KV ({b['capacity_tokens']} tokens), "
              f"ideal {b['ideal_hit_tokens']} hit tokens")
        for name in ("write_all", "oracle", "best_length_threshold",
                     "best_length_and_output_threshold", "best_online_length_class",
                     "best_online_length_output_class",
                     "evict_shorter_first_classes", "best_evict_shorter_first",
                     "evict_by_reuse_online"):
            r = b[name]
            extra = ", ".join(f"{k}={v}" for k, v in r.items()
                              if k not in ("of_ideal", "hit_tokens", "written_tokens"))
            print(f"  {name:34s} {r['of_ideal']:.3f} of ideal, writes {r['written_tokens']} "
                  f"tokens{'  (' + extra + ')' if extra else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
