"""trace_client.py - the trace replay's second source of spills (trace_replay.py
--spills client): the real client in front of the tier.  vllm-mlx's
MemoryAwarePrefixCache, with a RAM budget of a few of the window's longest prompts,
holds mlx-lm's own KVCache objects, and its LRU eviction spills into the tier
through enqueue_spill, as in a server.  The scheduler's own SSD methods build
the tier (ensure_ssd_tier) and promote a check_ssd match
(_try_promote_ssd_pending). All of this upstream code is loaded unchanged from
../shared/upstream over the project's numpy MLX stand-in (tests/realclient).

Per request the server does what tests/realclient/server.py does: fetch from
RAM; on a miss check_ssd, then the scheduler's promote; prefill the rest; store
the prompt's cache; decode a few tokens; store prompt + output with
evict_prefixes=False.  KV rows are the harness model's, which depend on the
whole prefix, and every row a promote hands back is compared with them bit for
bit.  The tier's configuration is what ensure_ssd_tier passes (directory and
max_size_gb) plus, for kvtier, the replay's clock, policy and write budget.

The reference's writer thread is not started: the replay writes its queued
spills on this thread with the reference's own _write_entry, as
trace_replay.py's other mode does. For kvtier the writer runs and flush() waits
for it. Either way a run is deterministic.
"""

from __future__ import annotations

import copy
import logging
import os
import sys
import types

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_HARNESS = os.path.join(_ROOT, "tests", "realclient")


def _harness():
    if _HARNESS not in sys.path:
        sys.path.insert(0, _HARNESS)
    import loader
    import server
    if loader.upstream_dir() is None:
        raise RuntimeError("--spills client: ../shared/upstream (vllm-mlx and mlx-lm's client "
                           "code) not found")
    return loader, server, loader.load_client()


def heads_for(bytes_per_token: int, dim: int) -> int:
    """The harness model's heads for one fp16 layer of `dim` at this many
    bytes of keys and values per token."""
    per_head = 4 * dim
    if bytes_per_token < per_head or bytes_per_token % per_head:
        raise ValueError(f"--spills client needs --kv-bytes-per-token a multiple of {per_head} "
                         f"(fp16 keys and values of {dim}-wide heads)")
    return bytes_per_token // per_head


class _Reference:
    """The reference's SSDCacheTier with start_writer left out (see above)."""

    def __init__(self, ref_module):
        class Tier(ref_module.SSDCacheTier):
            def start_writer(self) -> None:  # the replay writes its queue itself
                return None
        self.SSDCacheConfig = ref_module.SSDCacheConfig
        self.SSDCacheTier = Tier


class _Counted:
    """Passes every call to the tier; counts the spills the client makes and
    those the tier refuses."""

    def __init__(self, tier) -> None:
        self.tier = tier
        self.made = self.refused = 0

    def __getattr__(self, name):
        return getattr(self.tier, name)

    def enqueue_spill(self, tokens, cache, memory_bytes):
        ok = self.tier.enqueue_spill(tokens, cache, memory_bytes)
        self.made += 1
        self.refused += not ok
        return ok


def largest_prompt_bytes(requests: list, bytes_per_token: int) -> int:
    """KV bytes of the window's longest prompt, as the prefix cache counts it:
    mlx-lm's KVCache grows in steps of 256 rows."""
    longest = max((r["length"] for r in requests), default=1)
    return -(-longest // 256) * 256 * bytes_per_token


def replay_client(impl: str, requests: list, prompt_tokens, bytes_per_token: int,
                  cache_dir: str, max_size_gb: float, clock, ram_prompts: float,
                  kvtier_options: dict, decode_tokens: int = 4, on_request=None) -> dict:
    """Serves the requests through the real client (kvtier_options: the
    SSDCacheConfig fields kvtier gets beyond ensure_ssd_tier's); returns trace_replay's
    counters plus ram_hit_tokens, budget_denied (a match the RAM budget could
    not take) and tier_stats (the tier's get_stats() before it closed)."""
    loader, server, client = _harness()
    # The client's own log lines (an entry too large for RAM, a spill) are
    # its business; the replay counts what matters.
    logging.getLogger("vllm_mlx").setLevel(logging.ERROR)
    server.HEADS = heads_for(bytes_per_token, server.DIM)  # the harness model's width
    if impl == "kvtier":
        import kvtier.ssd_cache as module
        overrides = dict(kvtier_options)  # on top of what ensure_ssd_tier passes
    else:
        import ssd_cache_ref
        module, overrides = _Reference(ssd_cache_ref), None
    mc = client.memory_cache
    model = server.Model(client, ["kv"])
    # In units of the longest prompt: the prefix cache refuses (and so never
    # spills) an entry larger than its whole budget.
    ram_mb = max(1, int(-(-ram_prompts * largest_prompt_bytes(requests, bytes_per_token)
                          // 2**20)))
    pc = mc.MemoryAwarePrefixCache(model, mc.MemoryCacheConfig(max_memory_mb=ram_mb))
    refusals = _tap_reservations(pc)
    sched = loader.make_scheduler_class(module, client, overrides)(cache_dir, pc,
                                                                    max_gb=max_size_gb)
    sched.ensure_ssd_tier()
    tier = sched._ssd_tier
    counted = _Counted(tier)
    pc.set_ssd_tier(counted)
    st = {"requests": 0, "input_tokens": 0, "hit_tokens": 0, "ram_hit_tokens": 0, "hits": 0,
          "exact_hits": 0, "rows_checked": 0, "row_mismatches": 0, "first_mismatch": None,
          "promote_failures": 0, "budget_denied": 0, "spills": 0, "spill_drops": 0,
          "ram_mb": ram_mb}

    def drain() -> None:
        if impl == "kvtier":
            tier.flush()
            return
        while not tier._spill_queue.empty():
            tier._write_entry(*tier._spill_queue.get_nowait())

    try:
        for n, req in enumerate(requests):
            clock.advance_to(req["timestamp"])
            prompt = [int(t) for t in prompt_tokens(req)]
            st["requests"] += 1
            st["input_tokens"] += len(prompt)
            cache, remaining = pc.fetch(prompt)
            if cache:
                st["ram_hit_tokens"] += len(prompt) - len(remaining)
                cache = copy.deepcopy(cache)  # the engine's own copy
            else:
                cache = None
                cand = pc.check_ssd(prompt)
                if cand is not None:
                    cache, remaining = _promote(sched, server, prompt, cand, n, st,
                                                refusals)
            start = len(prompt) - len(remaining) if cache else 0
            if cache is None:
                cache = model.make_cache()
            model.forward(cache, prompt, start)
            pc.store(list(prompt), copy.deepcopy(cache))
            full = list(prompt)
            for t in server.prefix_hashes(prompt)[-max(1, min(decode_tokens,
                                                               req.get("output", 1))):]:
                full.append(int(t % 30000 + 1000))
                model.forward(cache, full, len(full) - 1)
            pc.store(full, cache, evict_prefixes=False)
            drain()
            if on_request is not None:
                on_request(st)
        drain()
        st["tier_stats"] = dict(tier.get_stats())
    finally:
        st["spills"] = counted.made - counted.refused
        st["spill_drops"] = counted.refused
        pc.set_ssd_tier(None)
        sched.close_ssd_tier()
    st["trace_seconds"] = clock.trace_seconds()
    return st


def _tap_reservations(pc) -> list:
    """Counts the RAM reservations the prefix cache refuses, by wrapping the
    instance's own try_reserve_memory (the scheduler calls it through the
    instance, so its logic runs unchanged).  Returns the list refusals are
    appended to."""
    refused = []
    reserve = pc.try_reserve_memory

    def tapped(nbytes):
        ok = reserve(nbytes)
        if not ok:
            refused.append(nbytes)
        return ok

    pc.try_reserve_memory = tapped
    return refused


def _promote(sched, server, prompt, cand, n, st, refusals):
    """The scheduler's synchronous promote of a check_ssd match; the layers
    handed back are checked row for row.  Returns (cache, remaining)."""
    m = int(cand["matched_tokens"])
    req = types.SimpleNamespace(request_id=f"trace-{n:06d}", prompt_token_ids=list(prompt),
                                cache_hit_type="ssd_pending", _ssd_candidate=cand,
                                prompt_cache=None, cached_tokens=0,
                                remaining_tokens=list(prompt))
    refused_before = len(refusals)
    sched.waiting = [req]
    sched._try_promote_ssd_pending()
    sched.waiting = []
    if req.cache_hit_type != "ssd_hit":
        if len(refusals) > refused_before:
            st["budget_denied"] += 1
        else:
            st["promote_failures"] += 1
        return None, prompt
    lay = req.prompt_cache[0]
    off = int(lay.offset)
    k, v = server.model_rows(prompt[:m], 0, off, 0)
    st["rows_checked"] += off
    ok = off == m and np.array_equal(server.as_numpy(lay.keys)[..., :off, :], k) and \
        np.array_equal(server.as_numpy(lay.values)[..., :off, :], v)
    if not ok:
        st["row_mismatches"] += 1
        if st["first_mismatch"] is None:
            st["first_mismatch"] = f"request {n}: {m} tokens matched, {off} rows, rows differ"
        return None, prompt
    st["hits"] += 1
    st["exact_hits"] += m == len(prompt)
    st["hit_tokens"] += m
    return copy.deepcopy(req.prompt_cache), list(req.remaining_tokens)
