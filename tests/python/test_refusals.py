"""Refused spills through kvtier.ssd_cache and kvtier.Tier are never silent:
each one counts in get_stats() under its reason (spill_refused_<reason>, the
library's kvt_stats version 3 counters) - a layer the binding cannot convert,
a layer the library refuses (a rotating layer without max_size), an entry
larger than the spill queue, a full queue, a closed tier - and the drop-in's
WARNING is logged once per reason and interval, not once per eviction: 100
refusals of one reason log one line; after the interval the next one logs
again and says how many went unlogged.  The counters are also in
kvtier.Tier's stats() and prometheus()."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from conftest import KVLayer, make_tier

TOK = tuple(range(1, 17))


class _Opaque:
    """A cache object no converter knows (no keys/values, no state)."""


def _kv(n=16):
    k = np.ones((1, 2, n, 8), dtype=np.float16)
    return [KVLayer(k, k.copy(), n)]


def _refusal_lines(caplog):
    return [r for r in caplog.records
            if r.levelno == logging.WARNING and "spill refused" in r.getMessage()]


def test_each_reason_counts(cache_dir):
    t = make_tier(cache_dir, spill_queue_size=1, max_size_gb=1.0)
    try:
        # Python-side: the binding cannot convert the layer.
        assert t.enqueue_spill(TOK, [_Opaque()], 100) is False
        assert t.get_stats()["spill_refused_unsupported"] == 1
        # Python-side: a bad argument.
        assert t.enqueue_spill(TOK, _kv(), -1) is False
        # Library-side: an offset past the layer's token rows.
        k = np.ones((1, 2, 16, 8), dtype=np.float16)
        assert t.enqueue_spill(TOK, [KVLayer(k, k.copy(), 32)], 100) is False
        s = t.get_stats()
        assert s["spill_refused_invalid"] == 2
        # A full queue (the writer is not started: the first stays queued).
        assert t.enqueue_spill(TOK, _kv(), 100) is True
        assert t.enqueue_spill(TOK[:8], _kv(8), 100) is False
        s = t.get_stats()
        assert s["spill_refused_queue_full"] == 1
        assert s["spill_drops"] == 1
        assert s["spill_refused"] == 4
        t.start_writer()
        t.flush(timeout=30)
    finally:
        t.close()
    # Closed: refused and counted.
    assert t.enqueue_spill(TOK, _kv(), 100) is False
    assert t.get_stats()["spill_refused_closed"] == 1


def test_too_big_counts(cache_dir):
    t = make_tier(cache_dir, spill_queue_bytes=1024)
    try:
        assert t.enqueue_spill(TOK, _kv(), 100) is False
        assert t.get_stats()["spill_refused_too_big"] == 1
    finally:
        t.close()


def test_hundred_refusals_log_once(cache_dir, caplog, monkeypatch):
    t = make_tier(cache_dir)
    caplog.set_level(logging.WARNING, logger="kvtier.ssd_cache")
    now = [1000.0]
    monkeypatch.setattr("kvtier.ssd_cache.time.monotonic", lambda: now[0])
    try:
        for i in range(100):
            assert t.enqueue_spill(TOK, [_Opaque()], 100) is False
            now[0] += 0.1  # 10 s in all: inside one interval
        lines = _refusal_lines(caplog)
        assert len(lines) == 1
        assert "(unsupported)" in lines[0].getMessage()
        assert t.get_stats()["spill_refused_unsupported"] == 100
        # Another reason has its own budget.
        assert t.enqueue_spill(TOK, _kv(), -5) is False
        assert len(_refusal_lines(caplog)) == 2
        # After the interval: one more line, with the unlogged count.
        now[0] += t._REFUSAL_LOG_INTERVAL_S
        assert t.enqueue_spill(TOK, [_Opaque()], 100) is False
        lines = _refusal_lines(caplog)
        assert len(lines) == 3
        assert "99 more refused" in lines[2].getMessage()
        assert t.get_stats()["spill_refused_unsupported"] == 101
    finally:
        t.close()


def test_tier_counts_refusals(cache_dir):
    import kvtier

    with kvtier.Tier(cache_dir, durability="none") as t:
        with pytest.raises(Exception):
            t.spill(TOK, [_Opaque()])
        k = np.ones((1, 2, 16, 8), dtype=np.float16)
        with pytest.raises(ValueError):
            t.spill(TOK, [KVLayer(k, k.copy(), 32)])
        st = t.stats()
        assert st["spill_refused_unsupported"] == 1
        assert st["spill_refused_invalid"] == 1
        assert "kvtier_spill_refused_invalid_total 1" in t.prometheus()
