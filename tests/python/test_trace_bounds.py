"""bench/trace_bounds.py, the admission bounds model: its LRU and rules on
handmade traces whose answers are worked out by hand (a reuse beyond the
budget is lost to write-everything and kept by the oracle; a length threshold
admits only long prompts; the online rule learns a class only from blocks it
saw), its agreement with trace_replay's ideal at a budget that holds
everything, and its command line on a window of the shared trace (text and
--json, bad budgets refused)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "bench")
_BENCH = os.path.join(_BENCH_DIR, "trace_bounds.py")
sys.path.insert(0, _BENCH_DIR)
import trace_bounds as tb  # noqa: E402  (bench/ is not a package)

_TRACE = tb.tr.default_trace()


def _req(ids, length, out=0):
    return {"timestamp": 0.0, "length": length, "ids": list(ids), "output": out}


def test_lru_hits_only_what_it_still_holds():
    # A = 2 blocks, then 3 one-block prompts that fill a 3-block disk, then A again.
    reqs = [_req([1, 2], 1024), _req([3], 512), _req([4], 512), _req([5], 512),
            _req([1, 2], 1024)]
    rows = tb.chains(reqs)
    everything = tb.simulate(rows, 10 * 512, lambda i, k: True)
    assert everything == {"hit_tokens": 1024, "written_tokens": 3 * 512 + 1024}
    small = tb.simulate(rows, 3 * 512, lambda i, k: True)
    assert small["hit_tokens"] == 0  # A was evicted before it came back
    # Declining the one-block prompts keeps A.
    keep = tb.simulate(rows, 3 * 512, lambda i, k: reqs[i]["length"] >= 1024)
    assert keep["hit_tokens"] == 1024


def test_a_partial_block_hits_only_as_far_as_it_was_stored():
    reqs = [_req([1, 2], 700), _req([1, 2], 1024)]
    res = tb.simulate(tb.chains(reqs), 4096, lambda i, k: True)
    assert res["hit_tokens"] == 512  # block 2 held 188 tokens, asked for 512
    assert res["written_tokens"] == 1024  # block 2 rewritten longer


def test_bounds_on_a_handmade_trace():
    reqs = [_req([1, 2], 1024), _req([3], 512), _req([4], 512), _req([5], 512),
            _req([1, 2], 1024)]
    # Unique KV 5 blocks: at 0.6x (3 blocks) write_all loses the reuse and the
    # oracle (writes only blocks 1 and 2) keeps it.
    b = tb.bounds(reqs, 0.6)
    assert b["ideal_hit_tokens"] == 1024
    assert b["write_all"]["of_ideal"] == 0.0
    assert b["oracle"]["of_ideal"] == 1.0 and b["oracle"]["written_tokens"] == 1024
    assert b["best_length_threshold"]["of_ideal"] == 1.0
    assert b["best_length_threshold"]["min_input_tokens"] == 1024


def test_online_rule_learns_only_from_reuse_it_saw():
    # Class of 1024-token prompts reused, class of 512-token prompts never.
    reqs = [_req([1, 2], 1024), _req([3], 512), _req([1, 2], 1024), _req([6, 7], 1024),
            _req([8], 512)]
    rows = tb.chains(reqs)
    admit = tb.online_rule(reqs, rows, 1.0, 1.0)
    got = [admit(i, 0) for i in range(len(reqs))]
    # Nothing learned yet: value == mean == 0 admits; after the reuse of
    # request 0's class, the 512-token class falls below the mean.
    assert got[0] and got[2] and got[3]
    assert not got[4]


def test_online_rule_by_output_class_tells_apart_what_length_cannot():
    # Same lengths; the short-output prompt is reused, the long-output one
    # never.  By length both share a class and are admitted; keyed by the
    # output class too, the long-output class falls below the mean.
    reqs = [_req([1], 512, out=4), _req([2], 512, out=900), _req([1], 512, out=4),
            _req([3], 512, out=900), _req([4], 512, out=900)]
    rows = tb.chains(reqs)
    by_len = tb.online_rule(reqs, rows, 1.0, 1.0)
    assert all(by_len(i, 0) for i in range(len(reqs)))
    by_out = tb.online_rule(reqs, rows, 1.0, 1.0, key=lambda r: (
        tb.output_class(r["output"]), tb.length_class(r["length"])))
    got = [by_out(i, 0) for i in range(len(reqs))]
    assert got[0] and got[2]
    assert not got[4]
    assert tb.output_class(0) == 0 and tb.output_class(4) == 2 and tb.output_class(900) == 9


def test_eviction_by_reuse_keeps_a_block_a_request_came_back_for():
    # A is asked for twice, then three one-block prompts fill a 3-block disk,
    # then A again: LRU evicted A for the last newcomer, reuse evicts the
    # oldest block nobody came back for.
    reqs = [_req([1], 512), _req([1], 512), _req([2], 512), _req([3], 512), _req([4], 512),
            _req([1], 512)]
    rows = tb.chains(reqs)
    assert tb.simulate(rows, 3 * 512, lambda i, k: True)["hit_tokens"] == 512
    res = tb.simulate_by_reuse(reqs, rows, 3 * 512)
    assert res == {"hit_tokens": 1024, "written_tokens": 4 * 512}
    # A guard of nothing hands the hit pool's block over first: A is lost.
    assert tb.simulate_by_reuse(reqs, rows, 3 * 512, guard=0.0)["hit_tokens"] == 512


def test_full_budget_matches_the_replays_ideal_on_the_shared_trace():
    if not os.path.exists(_TRACE):
        pytest.skip(f"{_TRACE} not present")
    reqs = tb.tr.load_trace(_TRACE, 60)
    b = tb.bounds(reqs, 1.0)
    assert b["ideal_hit_tokens"] == tb.tr.ideal(reqs)["hit_tokens"]
    assert b["write_all"]["hit_tokens"] == b["ideal_hit_tokens"]
    for name in ("best_length_threshold", "best_length_and_output_threshold",
                 "best_online_length_class", "best_online_length_output_class"):
        assert 0.0 <= b[name]["of_ideal"] <= b["oracle"]["of_ideal"] + 1e-12


def test_command_line_text_json_and_refusals():
    if not os.path.exists(_TRACE):
        pytest.skip(f"{_TRACE} not present")
    run = [sys.executable, _BENCH, "--trace", _TRACE, "--requests", "40"]
    out = subprocess.run(run + ["--budgets", "0.5", "--json"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    doc = json.loads(out)
    assert doc["requests"] == 40 and doc["budgets"][0]["fraction"] == 0.5
    txt = subprocess.run(run + ["--budgets", "0.5"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert "oracle" in txt and "of ideal" in txt
    for bad in ("0", "x", "-1"):
        r = subprocess.run(run + ["--budgets", bad], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 2 and "--budgets" in r.stderr


def test_eviction_by_priority_keeps_the_long_prompt_lru_loses():
    reqs = [_req([1, 2], 1024), _req([3], 512), _req([4], 512), _req([5], 512),
            _req([1, 2], 1024)]
    rows = tb.chains(reqs)
    by_len = tb.simulate_by_priority(rows, 3 * 512, lambda i: reqs[i]["length"])
    assert by_len["hit_tokens"] == 1024 and by_len["written_tokens"] == 1024 + 3 * 512
    flat = tb.simulate_by_priority(rows, 3 * 512, lambda i: 0)  # LRU among equals
    assert flat == tb.simulate(rows, 3 * 512, lambda i, k: True)
    b = tb.bounds(reqs, 0.6)
    assert b["best_evict_shorter_first"]["of_ideal"] == 1.0
