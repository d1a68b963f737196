"""Smoke run of bench/trace_replay.py, the trace replay through the drop-in
tier: its row check, its derivation and its ideal are tested on their own, then
the program replays a handmade trace (exact, prefix and partial-block reuse,
known answers) and a 20-request window of the shared Mooncake trace on kvtier
and the reference, each configuration in its own child process as the bench
runs them: every promoted row exact, no spill dropped, hit rate <= the ideal
and > 0 where reuse is there to be found."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_BENCH = os.path.join(_ROOT, "bench", "trace_replay.py")
_TRACE = os.path.join(os.path.dirname(_ROOT), "shared", "traces", "synthetic_trace.jsonl")


def _load():
    spec = importlib.util.spec_from_file_location("trace_replay", _BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


tr = _load()


def _req(ids, length, ts=0):
    return {"timestamp": float(ts), "length": length, "ids": list(ids)}


def test_check_rows_catches_a_flipped_bit_a_short_read_and_a_wrong_offset():
    shape = tr.KVShape(16)
    toks = tr.prompt_tokens(_req([7, 8], 900))
    k, v = shape.rows(toks)
    good = [{"keys": k[:, :, :600, :].copy(), "values": v[:, :, :600, :].copy(), "offset": 600}]
    assert tr.check_rows(good, k, v, 600) is None
    flipped = [dict(good[0])]
    flipped[0]["values"] = good[0]["values"].copy()
    flipped[0]["values"].view(np.uint16)[0, 1, 599, 0] ^= 1
    assert "values differ first at row 599" in tr.check_rows(flipped, k, v, 600)
    assert "shape" in tr.check_rows(good, k, v, 601)
    assert "offset" in tr.check_rows([dict(good[0], offset=601)], k, v, 600)
    assert tr.check_rows(None, k, v, 600) is not None


def test_rows_depend_on_the_whole_prefix_and_only_on_it():
    shape = tr.KVShape(256)
    assert (shape.heads, shape.dim) == (2, 32)
    a = tr.prompt_tokens(_req([1, 2, 3], 1400))
    b = tr.prompt_tokens(_req([1, 2, 4], 1536))
    c = tr.prompt_tokens(_req([5, 2, 3], 1400))
    assert np.array_equal(a[:1024], b[:1024]) and not np.array_equal(a[1024:1100], b[1024:1100])
    assert np.array_equal(a[512:], c[512:])            # block 2, 3 same tokens ...
    ka, va = shape.rows(a)
    kb, _ = shape.rows(b)
    kc, _ = shape.rows(c)
    assert ka.shape == (1, 2, 1400, 32) and ka.nbytes + va.nbytes == 1400 * 256
    assert np.array_equal(ka[:, :, :1024].view(np.uint16), kb[:, :, :1024].view(np.uint16))
    assert not np.array_equal(ka[:, :, 1024:1100].view(np.uint16),
                              kb[:, :, 1024:1100].view(np.uint16))
    # ... but after a different first block no row is shared.
    assert not (ka[:, :, 512:].view(np.uint16) == kc[:, :, 512:].view(np.uint16)).all(axis=-1).any()
    assert np.isfinite(ka.astype(np.float32)).all() and np.isfinite(va.astype(np.float32)).all()


HANDMADE = [
    _req([1, 2, 3], 1300, 0),         # miss
    _req([1, 2, 3, 4], 2000, 1000),   # r0's whole prompt is its prefix: 1300
    _req([1, 2, 3, 4], 2000, 2000),   # exact repeat: 2000
    _req([1, 5], 700, 3000),          # shares block 1 only: 512
    _req([9], 100, 4000),             # miss
    _req([6, 2, 3], 1536, 5000),      # same ids as r0 after a different first block: miss
]


def test_ideal_of_a_handmade_trace():
    ide = tr.ideal(HANDMADE)
    assert ide["hit_tokens"] == 1300 + 2000 + 512
    assert ide["input_tokens"] == 1300 + 2000 + 2000 + 700 + 100 + 1536
    # blocks 1, 2, 3 (512 each, once full), 4 (464), 5 (188), 9 (100), 6, 2', 3' (1536)
    assert ide["unique_blocks"] == 9
    assert ide["unique_tokens"] == 3 * 512 + 464 + 188 + 100 + 1536


def _run(args, tmp_path):
    env = dict(os.environ)
    env.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    p = subprocess.run([sys.executable, _BENCH, "--json", "--dir", str(tmp_path), *args],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                       timeout=500)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


def _common_checks(out):
    for r in out["results"]:
        what = f"{r['impl']} at {r['budget_fraction']}x"
        assert r["row_mismatches"] == 0, (what, r["first_mismatch"])
        assert r["spill_drops"] == 0 and r["promote_failures"] == 0, what
        assert r["requests"] == out["requests"], what
        assert r["hit_tokens"] <= out["ideal"]["hit_tokens"], what
        assert r["rows_checked"] == r["hit_tokens"], what
        assert r["disk_bytes"] > 0 and r["tier_spill_bytes"] > 0, what
        if os.path.exists("/proc/self/io"):
            assert r["device_bytes_written"] > 0, what
    return {(r["impl"], r["budget_fraction"]): r for r in out["results"]}


def test_handmade_trace_on_both_tiers(tmp_path):
    trace = tmp_path / "trace.jsonl"
    _write_handmade(trace)
    work = tmp_path / "work"
    work.mkdir()
    out = _run(["--trace", str(trace), "--requests", "100", "--kv-bytes-per-token", "16",
                "--budgets", "4"], work)
    assert out["requests"] == len(HANDMADE)
    by = _common_checks(out)
    ref = by[("reference", 4.0)]
    # The reference finds a stored prompt only when it is a prefix of the new one.
    assert ref["hit_tokens"] == 1300 + 2000 and ref["exact_hits"] == 1
    kvt = by[("kvtier", 4.0)]
    assert kvt["hit_tokens"] > 0
    assert kvt["trace_seconds"] == 5.0
    assert os.listdir(work) == []            # scratch directories removed


@pytest.mark.skipif(not os.path.exists(_TRACE), reason="../shared/traces not beside the repo")
def test_window_of_the_shared_trace_on_both_tiers(tmp_path):
    # Requests 42..61: the earliest 20-request window with reuse (the first 40 have none).
    out = _run(["--skip", "42", "--requests", "20", "--kv-bytes-per-token", "16",
                "--budgets", "1.0"], tmp_path)
    assert out["ideal"]["hit_tokens"] > 0
    by = _common_checks(out)
    kvt = by[("kvtier", 1.0)]
    assert kvt["hit_tokens"] > 0 and kvt["rows_checked"] > 0
    assert by[("reference", 1.0)]["hit_rate"] <= out["ideal_hit_rate"]


def _write_handmade(path):
    path.write_text("".join(json.dumps({"timestamp": r["timestamp"], "input_length": r["length"],
                                        "output_length": 1, "hash_ids": r["ids"]}) + "\n"
                            for r in HANDMADE))


# check_ssd offers chunk-aligned prefixes no spill ended at (request 3: 512 of [1, 5]);
# async_promote of prompt[:matched], the scheduler's promote_from_ssd call, serves them.
def test_handmade_trace_async_promote_serves_what_check_ssd_found(tmp_path):
    trace = tmp_path / "trace.jsonl"
    _write_handmade(trace)
    work = tmp_path / "work"
    work.mkdir()
    out = _run(["--trace", str(trace), "--impl", "kvtier", "--kv-bytes-per-token", "16",
                "--budgets", "4", "--promote", "async"], work)
    r = out["results"][0]
    assert r["row_mismatches"] == 0, r["first_mismatch"]
    assert r["promote_failures"] == 0


# Admission and the write budget in the replay: every policy's promoted rows are exact, the
# ratios against write_all are printed, second_sighting declines the first sighting of every
# prompt (and writes less), and a budget of a quarter of write_all's own bytes declines spills.
def test_handmade_trace_with_policies_and_a_budget(tmp_path):
    trace = tmp_path / "trace.jsonl"
    _write_handmade(trace)
    work = tmp_path / "work"
    work.mkdir()
    out = _run(["--trace", str(trace), "--impl", "kvtier", "--kv-bytes-per-token", "16",
                "--budgets", "4", "--policies", "write_all,second_sighting,adaptive",
                "--write-budget", "0.25"], work)
    rows = out["results"]
    assert [(r["policy"], bool(r["write_budget_per_day"])) for r in rows] == [
        ("write_all", False), ("second_sighting", False), ("adaptive", False),
        ("write_all", True), ("second_sighting", True), ("adaptive", True)]
    for r in rows:
        assert r["row_mismatches"] == 0, (r["policy"], r["first_mismatch"])
        assert r["promote_failures"] == 0 and r["hit_tokens"] <= out["ideal"]["hit_tokens"]
    wa, ss, ad = rows[0], rows[1], rows[2]
    assert wa["admission"]["admission_admitted"] == len(HANDMADE)
    assert ss["admission"]["admission_declined_unseen"] >= 1
    assert ss["tier_spill_bytes"] < wa["tier_spill_bytes"]
    assert ad["hit_tokens"] == wa["hit_tokens"]      # never full at 4x: as write_all
    assert ss["hit_vs_write_all"] is not None and ss["tier_written_vs_write_all"] < 1
    # Six requests: a bucket of a quarter of write_all's bytes cannot take them all; the budget
    # declines the spills that would carry it over.
    bw = rows[3]
    assert bw["admission"]["admission_declined_budget"] >= 1
    assert bw["tier_spill_bytes"] < wa["tier_spill_bytes"]
    for r in rows[3:]:
        assert r["budget_allowance"] > 0
        # kvtier's own count of what it wrote stays within the bucket's allowance: every
        # spill let in reserved the most it could write.
        assert r["budget_held"] and r["tier_spill_bytes"] <= r["budget_allowance"], r


# --spills client: vllm-mlx's MemoryAwarePrefixCache (loaded unchanged from ../shared/upstream)
# spills its LRU evictions. RAM is 1.5 of the longest prompt (3 MB at 256 B/token): A's prompt
# entry is evicted by A + its decoded token, both by B and B + its token; A' shares A's first
# three blocks. Only a tier that serves a chunk-aligned prefix of a longer entry finds them,
# and the promote of 1536 tokens fits beside B + its token in RAM.
CLIENT_TRACE = [
    {"timestamp": 0, "length": 8192, "ids": list(range(1, 17))},
    {"timestamp": 1000, "length": 8192, "ids": list(range(17, 33))},
    {"timestamp": 2000, "length": 2048, "ids": [1, 2, 3, 50]},
]


def _client_replay(tmp_path, rows):
    """Replays rows with --spills client, 1.5 of the longest prompt of RAM, a 4x disk."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": r["timestamp"], "input_length": r["length"],
                                         "output_length": 1, "hash_ids": r["ids"]}) + "\n"
                             for r in rows))
    work = tmp_path / "work"
    work.mkdir()
    return _run(["--trace", str(trace), "--spills", "client", "--ram-prompts", "1.5",
                 "--budgets", "4"], work)


@pytest.mark.skipif(not os.path.isdir(os.path.join(os.path.dirname(_ROOT), "shared",
                                                   "upstream")),
                    reason="upstream: ../shared/upstream not beside the repo")
def test_client_spills_are_served_back_through_the_scheduler(tmp_path):
    out = _client_replay(tmp_path, CLIENT_TRACE)
    assert out["ideal"]["hit_tokens"] == 1536
    by = _common_checks(out)
    kvt, ref = by[("kvtier", 4.0)], by[("reference", 4.0)]
    for r in (kvt, ref):
        assert r["ram_mb"] == 3 and r["budget_denied"] == 0
        assert r["spills"] == 4, r        # A, A + 1, B, B + 1 (the last stays in RAM)
    assert kvt["hit_tokens"] == 1536 and kvt["hits"] == 1 and kvt["exact_hits"] == 0
    assert ref["hit_tokens"] == 0         # no stored prompt is a prefix of A'
    assert kvt["admission"]["admission_admitted"] == 4


# The same RAM, but A'' shares A's first 15 blocks: the 7,680-token match does not fit beside
# B + its token, and vllm-mlx's own try_reserve_memory refuses it. The replay counts the refusal
# it observed (not a guess from the cache's fields); the reference finds no match to refuse.
@pytest.mark.skipif(not os.path.isdir(os.path.join(os.path.dirname(_ROOT), "shared",
                                                   "upstream")),
                    reason="upstream: ../shared/upstream not beside the repo")
def test_client_spills_count_the_ram_budgets_refusals(tmp_path):
    rows = CLIENT_TRACE[:2] + [{"timestamp": 2000, "length": 8192,
                                "ids": list(range(1, 16)) + [50]}]
    out = _client_replay(tmp_path, rows)
    by = _common_checks(out)
    kvt, ref = by[("kvtier", 4.0)], by[("reference", 4.0)]
    assert kvt["budget_denied"] == 1 and kvt["promote_failures"] == 0, kvt
    assert kvt["hits"] == 0 and kvt["hit_tokens"] == 0
    assert ref["budget_denied"] == 0 and ref["hits"] == 0


def test_client_spills_refuse_what_they_cannot_do(tmp_path):
    for bad, why in ((["--kv-bytes-per-token", "16"], "multiple of 256"),
                     (["--promote", "async"], "--promote read only"),
                     (["--ram-prompts", "0"], "--ram-prompts")):
        p = subprocess.run([sys.executable, _BENCH, "--spills", "client", "--dir", str(tmp_path),
                            *bad], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           timeout=120)
        assert p.returncode == 2 and why in p.stderr, (bad, p.stderr[-500:])
