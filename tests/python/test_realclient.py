"""The real client: vllm-mlx's MemoryAwarePrefixCache and the scheduler's SSD
methods, holding mlx-lm's own cache classes, loaded unchanged from
../shared/upstream over the numpy MLX stand-in (tests/realclient), driven like
a server against kvtier.ssd_cache on the configuration ensure_ssd_tier builds
(cache_dir and max_size_gb only) and on chunk_tokens=0.  Every promote is
compared with what the same scheduler code makes of the reference's entry for
the same spills (tests/realclient/server.py); every cache class vllm-mlx can
hand over goes through both promote paths."""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "realclient"))

import loader  # noqa: E402

if loader.upstream_dir() is None:
    pytest.skip("upstream: ../shared/upstream (the vllm-mlx / mlx-lm client code) not found",
                allow_module_level=True)

CLIENT = loader.load_client()

import kvtier.ssd_cache as kv  # noqa: E402
import ssd_cache_ref as ref  # noqa: E402
import server as srv  # noqa: E402

# name -> (layer specs, kv_quantize): every object vllm-mlx can hand over.
MODELS = {
    "KVCache": (["kv", "kv", "kv"], False),
    "RotatingKVCache-unwrapped": (["rot:4096:4", "rot:4096:4"], False),
    "RotatingKVCache-wrapped": (["rot:256:4", "rot:256:4"], False),
    "QuantizedKVCache-4bit": (["q4", "q4"], False),
    "QuantizedKVCache-8bit": (["q8", "q8"], False),
    "ChunkedKVCache": (["chunked:4096", "chunked:4096"], False),
    "ArraysCache-hybrid": (["arrays", "kv"], False),
    "CacheList": (["list", "kv"], False),
    "vllm-mlx-quantized-wrapper": (["kv", "kv"], True),
    "mixed": (["kv", "rot:256:4", "q8", "chunked:4096"], False),
    # bfloat16 KV (what MLX models usually run): native storage keeps bf16.
    "KVCache-bf16": (["kv", "kv"], False),
    "mixed-bf16": (["kv", "rot:256:4", "chunked:4096"], False),
}
STORAGE = {"default": None, "chunk_tokens=0": {"chunk_tokens": 0}}


def workload(seed: int = 7):
    """(system prompts, questions, chat turns, order): single questions after
    one of three system prompts (several asked again later, when the RAM
    budget has long evicted them), and two multi-turn chats whose next prompt
    is the previous prompt + answer + a new user turn."""
    rng = np.random.default_rng(seed)

    def toks(n):
        return [int(x) for x in rng.integers(1000, 30000, int(n))]

    systems = [toks(300), toks(280), toks(520)]
    qs = [systems[i % 3] + toks(rng.integers(20, 70)) for i in range(9)]
    users = {c: [toks(rng.integers(30, 90)) for _ in range(3)] for c in "AB"}
    order = ["q0", "q1", "q2", "A", "q3", "q4", "B", "q5", "q0", "q6", "A", "q1", "q7", "B",
             "q2", "q8", "A", "q3", "B", "q0", "q4"]
    return systems, qs, users, order


def run_server(tmp_path, name, path, storage):
    specs, kvq = MODELS[name]
    model = srv.Model(CLIENT, specs, bf16=name.endswith("-bf16"))
    systems, qs, users, order = workload()
    # A RAM budget of a few entries: the prefix cache's own LRU and prefix
    # eviction spill most of what it stores.
    sample = model.make_cache()
    model.forward(sample, qs[0], 0)
    est = CLIENT.memory_cache.estimate_kv_cache_memory(sample)
    budget_mb = max(1, math.ceil(3 * est / 2**20))
    s = srv.Server(CLIENT, kv, ref, model, str(tmp_path / "kv"), str(tmp_path / "ref"),
                   budget_mb=budget_mb, path=path, overrides=STORAGE[storage],
                   kv_quantize=kvq)
    chats = {c: [] for c in "AB"}  # prompt so far
    turn = {c: 0 for c in "AB"}
    for item in order:
        if item.startswith("q"):
            s.serve(qs[int(item[1:])])
        else:
            prompt = (chats[item] or list(systems["AB".index(item)])) + users[item][turn[item]]
            out = s.serve(prompt)
            chats[item] = prompt + out
            turn[item] += 1
    return s, qs


@pytest.mark.parametrize("path", ["sync", "async"])
@pytest.mark.parametrize("name", list(MODELS))
def test_real_client(tmp_path, name, path):
    """On the configuration ensure_ssd_tier builds (chunks, RAM tier, fsync);
    test_realclient_nochunks runs the same with chunk_tokens=0."""
    check_real_client(tmp_path, name, path, "default")


def check_real_client(tmp_path, name, path, storage):
    s, qs = run_server(tmp_path, name, path, storage)
    try:
        s.flush()
        assert s.problems == []
        refs = [n for n, _ok, ref_ok in s.spills if not ref_ok]
        # A class the reference refuses is refused (same spills, checked
        # one by one by the server); the rest are all taken.
        assert all(ok for _n, ok, ref_ok in s.spills if ref_ok)
        stats = s.sched._ssd_tier.get_stats()
        # The stand-in's arrays are MLX values exported through the buffer
        # protocol: every spill taken went to libkvtier without a copy on
        # the engine's thread, and the writer released them all.
        taken = sum(1 for _n, ok, _r in s.spills if ok)
        assert stats["spill_nocopy"] == taken, stats
        assert stats["spill_copied"] == 0 and stats["spill_held_bytes"] == 0
        # The scheduler's own _stats mutations (sync path) and kvtier's
        # counting (async path) agree with what the requests saw.
        assert stats["ssd_hits"] == s.expected_ssd_hits()
        assert stats["promotion_failures"] == s.fails
        # A reopened tier (close_ssd_tier, ensure_ssd_tier) still holds
        # every spill; with the RAM tier emptied before each request, every
        # candidate it offers fits the budget and is promoted (or, where the
        # scheduler cannot rebuild the reference's entry either, missed).
        s.reopen()
        tier = s.sched._ssd_tier
        for toks in s.spilled:
            assert tier.lookup_ssd(toks) is not None, len(toks)
        first = len(s.events)
        hits_before = s.expected_ssd_hits()
        for q in qs:
            s.pc.clear()
            s.serve(q)
        assert s.problems == []
        cands = [e for e in s.events[first:] if e[0] == "candidate"]
        assert all(e[4] for e in cands)
        if not refs:
            assert cands, "no SSD candidate after the reopen"
        assert all((e[3] == "ssd_hit") == e[5] for e in cands)
        stats = s.sched._ssd_tier.get_stats()
        assert stats["ssd_hits"] == s.expected_ssd_hits() - hits_before
        print("SUMMARY", name, path, storage, s.summary())
    finally:
        s.finish()
