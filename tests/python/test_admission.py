"""Admission and the write budget through the drop-in (kvtier.ssd_cache) and
kvtier.Tier: on SSDCacheConfig's defaults ("adaptive", no budget) every spill
is written on its first sighting while the disk has room, and only a sample of
first sightings once it is full, and get_stats() shows the decision and the
bytes written today and in all; "second_sighting" declines a prompt until it
comes back, and cuts a spill to the prefix seen before; a daily budget driven
by an injected clock stops writes when its bucket is full and lets them in
again a trace-day later, and a spill larger than the whole bucket is counted
apart (admission_declined_oversize); bad policy and budget values are refused with
ValueError naming the field."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import kv_positional

from kvtier.ssd_cache import SSDCacheConfig, SSDCacheTier
import kvtier

TOK = tuple(range(100, 612))  # 512 tokens: two segments of 256


def _tier(cache_dir, **kw):
    t = SSDCacheTier(SSDCacheConfig(cache_dir=cache_dir, host_cache_bytes=0, **kw))
    t.start_writer()
    return t


def _spill(t, tokens):
    layers = kv_positional(tokens, 2, 2, 8)
    assert t.enqueue_spill(tokens, layers, sum(x.keys.nbytes * 2 for x in layers))
    t.flush(timeout=60)


def test_defaults_write_while_there_is_room_and_show_the_counters(cache_dir):
    cfg = SSDCacheConfig(cache_dir=cache_dir)
    assert cfg.admission_policy == "adaptive" and cfg.write_budget_bytes_per_day == 0
    t = _tier(cache_dir)
    try:
        _spill(t, TOK)
        assert t.lookup_ssd(TOK) is not None  # room: written on its first sighting
        s = t.get_stats()
        assert s["admission_admitted"] == 1
        assert s["admission_declined_unseen"] == s["admission_declined_budget"] == 0
        assert s["spill_bytes"] > 0
        assert s["bytes_written_today"] == s["bytes_written_total"] == s["spill_bytes"]
        assert s["write_budget_bytes_per_day"] == 0 and s["write_budget_left"] == 0
        assert s["ssd_lifetime_years"] == 0.0
    finally:
        t.close()


def test_full_disk_declines_most_first_sightings_on_the_default(cache_dir):
    # 512 tokens x 128 B (fp16): 64 KiB a prompt; the disk holds about eight.
    t = _tier(cache_dir, max_size_gb=0.5 / 1024)
    try:
        prompts = [tuple(range(10_000 * (i + 1), 10_000 * (i + 1) + 512)) for i in range(52)]
        for p in prompts[:12]:  # fills the disk: it evicts, and so learns it is full
            _spill(t, p)
        s = t.get_stats()
        assert s["evictions"] > 0 and s["admission_admitted"] >= 8  # written while room
        for p in prompts[12:]:
            _spill(t, p)
        s = t.get_stats()
        # Only a fixed 1-in-8 sample of new prompts is let in now.
        declined = [p for p in prompts[12:] if t.lookup_ssd(p) is None]
        assert s["admission_declined_unseen"] >= 25 and len(declined) >= 25
        assert s["admission_admitted"] + s["admission_declined_unseen"] == len(prompts)
        again = declined[-1]
        # The same prompt spilled again with its answer and no request in
        # between (what vllm-mlx's prefix cache evicts for one request): not
        # a second request, so still declined.
        answered = again + (7, 8, 9, 10)
        _spill(t, answered)
        assert t.lookup_ssd(answered) is None and t.lookup_ssd(again) is None
        assert t.get_stats()["admission_declined_unseen"] == s["admission_declined_unseen"] + 1
        # A request comes back for it (check_ssd: lookup_ssd, then
        # lookup_ssd_prefix): a prompt seen before and asked for again is
        # worth its bytes.
        assert t.lookup_ssd_prefix(again) is None
        _spill(t, again)
        assert t.lookup_ssd(again) is not None
        got = t._read_entry(again, t.lookup_ssd(again)["file_path"])
        want = kv_positional(again, 2, 2, 8)
        for lay, w in zip(got, want):
            assert np.array_equal(np.asarray(lay["keys"]), w.keys)
    finally:
        t.close()


def test_second_sighting_declines_then_writes_then_cuts(cache_dir):
    t = _tier(cache_dir, admission_policy="second_sighting")
    try:
        _spill(t, TOK)
        assert t.lookup_ssd(TOK) is None and t.lookup_ssd_prefix(TOK) is None
        assert t.get_stats()["admission_declined_unseen"] == 1
        _spill(t, TOK)  # it came back
        assert t.lookup_ssd(TOK) is not None
        other = TOK[:256] + tuple(range(5000, 5256))  # same first segment
        _spill(t, other)
        got = t.lookup_ssd_prefix(other)
        assert got is not None and got["num_tokens"] == 256
        layers = t._read_entry(other[:256], got["file_path"])
        want = kv_positional(other, 2, 2, 8)
        for lay, w in zip(layers, want):
            assert np.array_equal(np.asarray(lay["keys"]), w.keys[:, :, :256, :])
        s = t.get_stats()
        assert (s["admission_admitted"], s["admission_truncated"],
                s["admission_tokens_declined"]) == (1, 1, 512 + 256)
    finally:
        t.close()


def test_budget_follows_the_injected_clock(cache_dir):
    now = [1000.0]
    per_day = 24 * 200_000  # the bucket holds an hour: 200 kB
    t = _tier(cache_dir, write_budget_bytes_per_day=per_day, clock=lambda: now[0])
    try:
        for i in range(12):  # 64 kB of KV each: the bucket fills
            _spill(t, tuple(range(i * 1000, i * 1000 + 512)))
        s = t.get_stats()
        assert s["admission_declined_budget"] > 0
        assert s["admission_admitted"] + s["admission_declined_budget"] == 12
        assert s["admission_declined_oversize"] == 0  # full for now, not too big
        assert s["write_budget_bytes_per_day"] == per_day
        assert s["spill_bytes"] <= 200_000 + s["spill_bytes"] // max(1, s["spill_count"])
        written = s["spill_bytes"]
        now[0] += 86400  # a day of trace time: drained, and a new day
        _spill(t, tuple(range(90_000, 90_512)))
        s = t.get_stats()
        assert s["spill_bytes"] > written
        assert s["bytes_written_today"] == s["spill_bytes"] - written
        assert 0 < s["write_budget_left"] < 200_000
    finally:
        t.close()


def test_spill_larger_than_the_bucket_is_counted(cache_dir):
    # A 20 kB bucket and 64 kB spills: none can ever be written under it.
    t = _tier(cache_dir, write_budget_bytes_per_day=24 * 20_000,
              clock=lambda: 5000.0)
    try:
        _spill(t, TOK)
        _spill(t, tuple(range(7000, 7512)))
        s = t.get_stats()
        assert s["spill_bytes"] == 0
        assert s["admission_declined_budget"] == 2
        assert s["admission_declined_oversize"] == 2
    finally:
        t.close()


def test_rating_projects_the_lifetime(cache_dir):
    now = [0.0]
    t = _tier(cache_dir, write_budget_tbw=600.0, write_budget_years=5.0,
              clock=lambda: now[0])
    try:
        t.get_stats()  # the budget's clock starts
        now[0] = 3600.0
        _spill(t, TOK)
        s = t.get_stats()
        per_year = s["spill_bytes"] * 24 * 365.25
        assert s["write_budget_bytes_per_day"] == int(600e12 / (5 * 365.25))
        assert s["ssd_lifetime_years"] == pytest.approx(600e12 / per_year, rel=1e-2)
    finally:
        t.close()


@pytest.mark.parametrize("kw, words", [
    ({"admission_policy": "bogus"}, "admission_policy must be one of"),
    ({"admission_memory_bytes": 10}, "admission_memory_bytes must be 0"),
    ({"write_budget_bytes_per_day": -1}, "write_budget_bytes_per_day must be >= 0"),
    ({"write_budget_bytes_per_day": 10**19}, "write_budget_bytes_per_day must be at most"),
    ({"write_budget_bytes_per_day": 1.5}, "write_budget_bytes_per_day must be an integer"),
    ({"write_budget_tbw": -3.0, "write_budget_years": 5}, "write_budget_tbw must be"),
    ({"write_budget_tbw": float("nan"), "write_budget_years": 5}, "write_budget_tbw must be"),
    ({"write_budget_tbw": 600}, "go together"),
    ({"write_budget_years": 200, "write_budget_tbw": 1}, "write_budget_years must be"),
    ({"write_budget_tbw": 600, "write_budget_years": 5,
      "write_budget_bytes_per_day": 10}, "not both"),
    ({"clock": 5}, "clock must be a callable"),
])
def test_bad_values_are_refused(cache_dir, kw, words):
    with pytest.raises(ValueError, match=words):
        SSDCacheConfig(cache_dir=cache_dir, **kw)
    with pytest.raises(ValueError, match=words):
        kvtier.Tier(cache_dir, **kw)
