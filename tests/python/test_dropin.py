"""Drop-in fidelity of kvtier.ssd_cache (issue 14): code written against the
reference's SSDCacheTier - including its tests' habits - runs unchanged.
Patches the way a user does (pytest's monkeypatch on the instance or on the
module's names): a hostile file_path in index.db touches nothing outside the
cache; tier._spill_queue reports the C queue; tier._write_entry replaced on
one instance blocks or fails one write without stalling promotes or
quarantine, and the C writer never calls out when it is not replaced;
close()/aclose()/_WRITER_JOIN_TIMEOUT_S behave as the reference's; __init__
closes the index when a later setup step fails (checked against the
reference too)."""

from __future__ import annotations

import asyncio
import glob
import logging
import os
import queue
import sqlite3
import threading
import time

import pytest

import ssd_cache_ref as ref
from conftest import Budget, drop_ram_copies, kv_layer, make_tier, run, tier_kw
from kvtier import ssd_cache as kv

pytestmark = pytest.mark.tier_profiles  # defaults and the bare disk path (conftest)

WAIT = 20.0  # seconds: bound on any wait for another thread


def _wait_until(pred, what):
    deadline = time.monotonic() + WAIT
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


class Gate:
    """A replacement _write_entry that blocks the writes of chosen tokens
    until released, then writes through the original."""

    def __init__(self, tier, block=None):
        self.original = tier._write_entry
        self.block = block  # None: block every write
        self.entered = threading.Event()
        self.release = threading.Event()
        self.calls = []

    def __call__(self, tokens_key, layer_snapshots, memory_bytes):
        self.calls.append((tokens_key, memory_bytes))
        if self.block is None or tokens_key in self.block:
            self.entered.set()
            assert self.release.wait(WAIT)
        return self.original(tokens_key, layer_snapshots, memory_bytes)


# ---- 1. a hostile file_path touches nothing outside ----


def _tree(root):
    out = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(d, name)
            st = os.lstat(p)
            data = open(p, "rb").read() if os.path.isfile(p) else None
            out[os.path.relpath(p, root)] = (st.st_mode, st.st_mtime_ns, data)
    return out


def test_hostile_file_paths_touch_nothing_outside(tmp_path, rng):
    outside = tmp_path / "outside"
    (outside / "victim").mkdir(parents=True)
    (outside / "victim" / "manifest.json").write_text('{"num_layers": 0}')
    (outside / "canary.txt").write_text("keep me")
    before = _tree(str(outside))
    cache = str(tmp_path / "cache")
    a, b, c, d = tuple(range(30)), (7, 7, 7), (1, 2, 3, 4), (9,) * 20
    t = make_tier(cache)
    t.start_writer()
    assert t.enqueue_spill(a, [kv_layer(rng, 30)], 10)
    assert t.enqueue_spill(b, [kv_layer(rng, 3)], 10)
    t.close()
    # Rows the reference's SSDIndex would store: a's own row replaced by one
    # pointing outside, and rows with relative, absolute and empty paths.
    idx = kv.SSDIndex(cache)
    idx.insert_entry(a, "../outside/victim", 10, len(a))
    idx.insert_entry(c, "../../outside", 10, len(c))
    idx.insert_entry(d, str(outside / "victim"), 10, len(d))
    idx.insert_entry(c + (5,), "", 10, 5)
    assert idx.lookup_exact(a)["file_path"] == "../outside/victim"
    idx.close()
    t = make_tier(cache)
    try:
        t.start_writer()
        # Not its own rows: ignored by every operation; b is served. a's own,
        # genuine directory lost its row to the hostile one: reconcile at open
        # adopted it again from its files (never a path from the row).
        assert t.lookup_ssd(a)["file_path"] == kv._tokens_hash(a)
        for toks in (c, d, c + (5,)):
            assert t.lookup_ssd(toks) is None
            assert t.lookup_ssd_prefix(toks + (99,)) is None
            bud = Budget()
            assert run(t.async_promote(toks, bud.reserve, bud.release)) is None
            assert bud.calls == []  # a miss: nothing reserved, nothing read
        for p in ("../outside/victim", "../../outside", str(outside / "victim"), ""):
            assert t._read_entry(a, p) is None
        assert t.lookup_ssd(b)["file_path"] == kv._tokens_hash(b)
        got = run(t.async_promote(b, Budget().reserve, Budget().release))
        assert got is not None and len(got) == 1
        t.reconcile()
        assert t.enqueue_spill(c, [kv_layer(rng, 4)], 10)  # its own row now
        t.flush(timeout=WAIT)
        assert t.lookup_ssd(c)["file_path"] == kv._tokens_hash(c)
    finally:
        t.close()
    assert _tree(str(outside)) == before
    assert sorted(os.listdir(str(tmp_path))) == ["cache", "outside"]


# ---- 2. _spill_queue ----


def test_spill_queue_reports_the_c_queue(cache_dir, rng):
    t = make_tier(cache_dir, spill_queue_size=3)
    try:
        q = t._spill_queue
        assert q.maxsize == 3 and q.qsize() == 0 and q.empty() and not q.full()
        for i in range(3):
            assert t.enqueue_spill((i,), [kv_layer(rng, 1)], 1)
            assert q.qsize() == i + 1
        assert q.full() and not q.empty()
        assert t.enqueue_spill((9,), [kv_layer(rng, 1)], 1) is False  # dropped
        assert q.qsize() == 3
        t.start_writer()
        t.flush(timeout=WAIT)
        assert q.qsize() == 0 and q.empty() and not q.full()
    finally:
        t.close()


def test_spill_queue_excludes_the_spill_being_written(cache_dir, rng, monkeypatch):
    t = make_tier(cache_dir, spill_queue_size=4)
    gate = Gate(t)
    monkeypatch.setattr(t, "_write_entry", gate)
    t.start_writer()
    try:
        assert t.enqueue_spill((1,), [kv_layer(rng, 1)], 1)
        assert gate.entered.wait(WAIT)
        assert t._spill_queue.qsize() == 0  # taken off the queue, as get() does
        assert t.enqueue_spill((2,), [kv_layer(rng, 1)], 1)
        assert t._spill_queue.qsize() == 1
    finally:
        gate.release.set()
        t.close()


# ---- 3. _write_entry replaced per instance ----


def _corrupt(cache_dir, toks):
    path = glob.glob(os.path.join(cache_dir, "data", kv._tokens_hash(toks), "layer_0.safetensors"))[0]
    with open(path, "r+b") as f:
        f.seek(-16, os.SEEK_END)
        f.write(b"\x00\x01" * 8)


def test_blocked_write_entry_stalls_neither_promotes_nor_quarantine(cache_dir, rng, monkeypatch):
    t = make_tier(cache_dir)
    t.start_writer()
    good, bad, late = (1, 2, 3), (4, 5, 6), (7, 8, 9)
    assert t.enqueue_spill(good, [kv_layer(rng, 3)], 30)
    assert t.enqueue_spill(bad, [kv_layer(rng, 3)], 30)
    t.flush(timeout=WAIT)
    drop_ram_copies(t)
    _corrupt(cache_dir, bad)
    gate = Gate(t)
    monkeypatch.setattr(t, "_write_entry", gate)
    try:
        assert t.enqueue_spill(late, [kv_layer(rng, 3)], 42)
        assert gate.entered.wait(WAIT)

        async def while_blocked():
            ok = await asyncio.wait_for(t.async_promote(good, Budget().reserve, Budget().release), WAIT)
            corrupt = await asyncio.wait_for(t.async_promote(bad, Budget().reserve, Budget().release), WAIT)
            return ok, corrupt

        ok, corrupt = run(while_blocked())
        assert ok is not None and corrupt is None
        assert t.lookup_ssd(bad) is None  # quarantined while the writer waits
        assert os.path.isdir(os.path.join(cache_dir, "quarantine", kv._tokens_hash(bad)))
        assert not gate.release.is_set() and t.lookup_ssd(late) is None
    finally:
        gate.release.set()
    t.flush(timeout=WAIT)
    assert gate.calls == [(late, 42)]
    assert t.lookup_ssd(late)["memory_bytes"] == 42
    t.close()


def test_failing_write_entry_loses_only_that_spill(cache_dir, rng, monkeypatch, caplog):
    t = make_tier(cache_dir)
    original = t._write_entry

    def flaky(tokens_key, layer_snapshots, memory_bytes):
        if tokens_key == (2,):
            raise OSError("disk on fire")
        original(tokens_key, layer_snapshots, memory_bytes)

    monkeypatch.setattr(t, "_write_entry", flaky)
    t.start_writer()
    with caplog.at_level(logging.ERROR, logger="kvtier.ssd_cache"):
        for i in range(4):
            assert t.enqueue_spill((i,), [kv_layer(rng, 1)], 1)
        t.flush(timeout=WAIT)
    assert [t.lookup_ssd((i,)) is not None for i in range(4)] == [True, True, False, True]
    st = t.get_stats()
    assert st["spill_count"] == 3 and st["write_failures"] == 1
    assert any("failed to write entry" in r.getMessage() for r in caplog.records)
    t.close()


def test_writer_calls_out_only_while_write_entry_is_replaced(cache_dir, rng, monkeypatch):
    t = make_tier(cache_dir)
    t.start_writer()
    for i in range(3):
        assert t.enqueue_spill((i,), [kv_layer(rng, 1)], 1)
    t.flush(timeout=WAIT)
    assert t._hook_calls == 0  # the C writer wrote without entering Python
    seen = []
    original = t._write_entry
    monkeypatch.setattr(t, "_write_entry",
                        lambda k, s, m: (seen.append(k), original(k, s, m)))
    for i in range(3, 6):
        assert t.enqueue_spill((i,), [kv_layer(rng, 1)], 1)
    t.flush(timeout=WAIT)
    assert seen == [(3,), (4,), (5,)] and t._hook_calls == 3
    monkeypatch.undo()
    assert t._write_entry == original
    for i in range(6, 9):
        assert t.enqueue_spill((i,), [kv_layer(rng, 1)], 1)
    t.flush(timeout=WAIT)
    assert t._hook_calls == 3 and seen == [(3,), (4,), (5,)]
    assert all(t.lookup_ssd((i,)) for i in range(9))
    t.close()


def test_subclass_write_entry_is_called(cache_dir, rng):
    seen = []

    class Recording(kv.SSDCacheTier):
        def _write_entry(self, tokens_key, layer_snapshots, memory_bytes):
            seen.append(tokens_key)
            super()._write_entry(tokens_key, layer_snapshots, memory_bytes)

    t = Recording(kv.SSDCacheConfig(cache_dir=cache_dir, **tier_kw()))
    t.start_writer()
    assert t.enqueue_spill((5, 5), [kv_layer(rng, 2)], 1)
    t.flush(timeout=WAIT)
    assert seen == [(5, 5)] and t.lookup_ssd((5, 5))
    t.close()


def test_original_write_entry_refuses_foreign_or_stale_arguments(cache_dir, rng, monkeypatch):
    t = make_tier(cache_dir)
    kept = []
    original = t._write_entry
    monkeypatch.setattr(t, "_write_entry", lambda k, s, m: kept.append(s))
    t.start_writer()
    assert t.enqueue_spill((1,), [kv_layer(rng, 1)], 1)
    t.flush(timeout=WAIT)
    assert t.lookup_ssd((1,)) is None  # the replacement wrote nothing
    with pytest.raises(ValueError):
        original((1,), kept[0], 1)  # that spill left the replacement's hands
    with pytest.raises(TypeError):
        original((1,), [], 1)
    t.close()


# ---- 4. close / aclose / _WRITER_JOIN_TIMEOUT_S ----


def test_close_writes_the_accepted_spills_before_the_sentinel(cache_dir, rng, monkeypatch):
    assert kv.SSDCacheTier._WRITER_JOIN_TIMEOUT_S == 5.0
    t = make_tier(cache_dir, spill_queue_size=8)
    gate = Gate(t, block={(0,)})
    monkeypatch.setattr(t, "_write_entry", gate)
    t.start_writer()
    for i in range(5):
        assert t.enqueue_spill((i,), [kv_layer(rng, 1)], 1)
    assert gate.entered.wait(WAIT)
    t._WRITER_JOIN_TIMEOUT_S = WAIT
    closer = threading.Thread(target=t.close)
    closer.start()
    _wait_until(lambda: t._spill_queue.qsize() == 5, "the sentinel behind 4 spills")
    assert t.enqueue_spill((9,), [kv_layer(rng, 1)], 1) is False  # behind the sentinel
    gate.release.set()
    closer.join(WAIT)
    assert not closer.is_alive()
    assert [k for k, _ in gate.calls] == [(0,), (1,), (2,), (3,), (4,)]  # FIFO, all of them
    t.close()  # after success: nothing
    t2 = make_tier(cache_dir)
    try:
        assert all(t2.lookup_ssd((i,)) for i in range(5)) and t2.lookup_ssd((9,)) is None
    finally:
        t2.close()


def test_close_raises_without_joining_when_the_sentinel_cannot_be_queued(cache_dir, rng, monkeypatch):
    t = make_tier(cache_dir, spill_queue_size=2)
    gate = Gate(t, block={(0,)})
    monkeypatch.setattr(t, "_write_entry", gate)
    t.start_writer()
    assert t.enqueue_spill((0,), [kv_layer(rng, 1)], 1)
    assert gate.entered.wait(WAIT)
    assert t.enqueue_spill((1,), [kv_layer(rng, 1)], 1)
    assert t.enqueue_spill((2,), [kv_layer(rng, 1)], 1)
    assert t._spill_queue.full()
    monkeypatch.setattr(t, "_WRITER_JOIN_TIMEOUT_S", 0.2)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="sentinel"):
        t.close()
    assert time.monotonic() - t0 >= 0.15
    assert kv.SSDCacheTier._WRITER_JOIN_TIMEOUT_S == 5.0  # only this instance's
    assert t._writer_thread.is_alive() and t._spill_queue.qsize() == 2
    gate.release.set()
    t.flush(timeout=WAIT)
    # Nothing was closed: spills are still accepted, then close finishes.
    assert t.enqueue_spill((3,), [kv_layer(rng, 1)], 1)
    t.close()
    assert t._writer_thread is None
    t2 = make_tier(cache_dir)
    try:
        assert all(t2.lookup_ssd((i,)) for i in range(4))
    finally:
        t2.close()


def test_close_timeout_keeps_the_writer_and_index_open_until_a_later_close(cache_dir, rng, monkeypatch):
    t = make_tier(cache_dir)
    t.start_writer()
    assert t.enqueue_spill((1,), [kv_layer(rng, 1)], 7)
    t.flush(timeout=WAIT)
    gate = Gate(t)
    monkeypatch.setattr(t, "_write_entry", gate)
    assert t.enqueue_spill((2,), [kv_layer(rng, 1)], 8)
    assert gate.entered.wait(WAIT)
    monkeypatch.setattr(t, "_WRITER_JOIN_TIMEOUT_S", 0.2)
    with pytest.raises(TimeoutError, match="writer thread did not stop"):
        t.close()
    writer = t._writer_thread
    assert writer is not None and writer.is_alive()
    assert t.lookup_ssd((1,))["memory_bytes"] == 7  # the index is open
    assert run(t.async_promote((1,), Budget().reserve, Budget().release)) is not None
    assert t.enqueue_spill((3,), [kv_layer(rng, 1)], 9) is False
    with pytest.raises(TimeoutError, match="writer thread did not stop"):
        t.close()  # still blocked: the same answer, nothing lost
    gate.release.set()
    t.close()  # finishes the job
    assert not writer.is_alive() and t._writer_thread is None
    t.close()
    t2 = make_tier(cache_dir)
    try:
        assert t2.lookup_ssd((2,))["memory_bytes"] == 8 and t2.lookup_ssd((3,)) is None
    finally:
        t2.close()


def test_aclose_runs_the_instances_close_off_the_event_loop(cache_dir, monkeypatch):
    t = make_tier(cache_dir)
    ran = []
    real_close = t.close

    def slow_close():
        ran.append(threading.get_ident())
        time.sleep(0.3)
        real_close()

    monkeypatch.setattr(t, "close", slow_close)

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        tk = asyncio.ensure_future(ticker())
        await t.aclose()
        tk.cancel()
        return ticks

    ticks = run(main())
    assert ran and ran[0] != threading.get_ident()
    assert ticks >= 10  # the loop kept running while close slept
    assert t._closed


def test_async_context_manager_closes(cache_dir, rng):
    async def main():
        async with make_tier(cache_dir) as t:
            t.start_writer()
            assert t.enqueue_spill((1, 2), [kv_layer(rng, 2)], 5)
        return t

    t = run(main())
    assert t._closed and t.enqueue_spill((3,), [kv_layer(rng, 1)], 1) is False


# ---- 4b. __init__ failure handling (checked against the reference too) ----


@pytest.fixture(params=[ref, kv], ids=["reference", "kvtier"])
def mod(request):
    return request.param


def _config(mod, cache_dir):
    return mod.SSDCacheConfig(cache_dir=cache_dir)


def test_init_closes_the_index_when_queue_creation_fails(mod, cache_dir, monkeypatch):
    closed = []

    class TrackingIndex(mod.SSDIndex):
        def close(self):
            closed.append(self)
            super().close()

    def no_queue(*args, **kwargs):
        raise RuntimeError("queue boom")

    monkeypatch.setattr(mod, "SSDIndex", TrackingIndex)
    monkeypatch.setattr(mod.queue, "Queue", no_queue)
    with pytest.raises(RuntimeError, match="queue boom"):
        mod.SSDCacheTier(_config(mod, cache_dir))
    assert len(closed) == 1 and isinstance(closed[0], TrackingIndex)
    monkeypatch.undo()
    t = mod.SSDCacheTier(_config(mod, cache_dir))  # nothing left holding the directory
    t.close()


def test_init_reraises_the_original_error_when_closing_the_index_fails(mod, cache_dir, monkeypatch, caplog):
    class BrokenCloseIndex(mod.SSDIndex):
        def close(self):
            super().close()
            raise OSError("close boom")

    def no_queue(*args, **kwargs):
        raise ValueError("queue boom")

    monkeypatch.setattr(mod, "SSDIndex", BrokenCloseIndex)
    monkeypatch.setattr(mod.queue, "Queue", no_queue)
    with caplog.at_level(logging.ERROR):
        with pytest.raises(ValueError, match="queue boom"):
            mod.SSDCacheTier(_config(mod, cache_dir))
    assert any("failed to close index during init cleanup" in r.getMessage()
               for r in caplog.records)
    monkeypatch.undo()
    mod.SSDCacheTier(_config(mod, cache_dir)).close()


def test_init_propagates_an_index_failure(mod, cache_dir, monkeypatch):
    def no_index(cache_dir):
        raise sqlite3.OperationalError("index boom")

    monkeypatch.setattr(mod, "SSDIndex", no_index)
    with pytest.raises(sqlite3.OperationalError, match="index boom"):
        mod.SSDCacheTier(_config(mod, cache_dir))
    monkeypatch.undo()
    mod.SSDCacheTier(_config(mod, cache_dir)).close()


def test_tier_index_is_an_ssdindex_bound_to_the_tier(cache_dir, rng):
    t = make_tier(cache_dir)
    try:
        assert isinstance(t._index, kv.SSDIndex)
        t.start_writer()
        assert t.enqueue_spill((4, 4), [kv_layer(rng, 2)], 3)
        t.flush(timeout=WAIT)
        assert t._index.lookup_exact((4, 4)) == {"file_path": kv._tokens_hash((4, 4)),
                                                 "memory_bytes": 3, "num_tokens": 2}
        assert t._index.get_entry_count() == 1 and t._index.get_total_bytes() == 3
        t._index.touch((4, 4))
        with pytest.raises(NotImplementedError):
            t._index.insert_entry((5,), "x", 1, 1)
        t._index.delete_entry((4, 4))
        assert t.lookup_ssd((4, 4)) is None
    finally:
        t.close()


# ---- 5. the profiles reach the tier ----


def test_each_profile_reaches_the_tier(cache_dir, tier_profile):
    """The [defaults] run of every test here is SSDCacheConfig's defaults as a
    user gets them (fsync, the host RAM tier at its derived size, chunks);
    the [disk] run is the bare disk path.  Guards the profile plumbing: were
    make_tier to ignore it, every [defaults] run would repeat [disk]."""
    t = make_tier(cache_dir)
    try:
        c = t._config
        bound = t.get_stats()["host_cache_bytes_bound"]
        if tier_profile == "defaults":
            d = kv.SSDCacheConfig(cache_dir=cache_dir)
            assert c == d and c.durability == "fsync" and c.chunk_tokens == 256
            assert c.host_cache_bytes is None and bound > 0
        else:
            assert c.durability == "none" and c.host_cache_bytes == 0 and bound == 0
    finally:
        t.close()


# ---- 6. internals replaced the way the reference's own tests replace them ----


class _SeenSentinelQueue(queue.Queue):
    def __init__(self, maxsize=0):
        super().__init__(maxsize=maxsize)
        self.sentinel_put = threading.Event()

    def put(self, item, block=True, timeout=None):
        if item is None:
            self.sentinel_put.set()
        return super().put(item, block=block, timeout=timeout)


def test_replaced_spill_queue_is_served_and_drained_by_close(cache_dir):
    t = make_tier(cache_dir)
    q = _SeenSentinelQueue(maxsize=4)
    t._spill_queue = q
    hold, seen = threading.Event(), []

    def write(tokens, snaps, mem):
        if tokens == ("a",):
            assert hold.wait(WAIT)
        seen.append((tokens, snaps, mem))

    t._write_entry = write
    t.start_writer()
    q.put((("a",), "s1", 1))
    q.put((("b",), "s2", 2))
    closer = threading.Thread(target=t.close)
    closer.start()
    assert q.sentinel_put.wait(WAIT)
    assert closer.is_alive() and seen == []  # close waits for the writer
    hold.set()
    closer.join(WAIT)
    assert not closer.is_alive() and t._closed
    assert seen == [(("a",), "s1", 1), (("b",), "s2", 2)] and q.empty()


def test_replaced_spill_queue_that_stays_full_times_out_before_anything_closes(cache_dir):
    t = make_tier(cache_dir)
    q = queue.Queue(maxsize=1)
    q.put(((1,), None, 1))  # nobody serves it: the writer is a stand-in
    t._spill_queue = q

    class NeverJoined:
        def join(self, timeout=None):
            raise AssertionError("no join without a sentinel")

        def is_alive(self):
            return True

    t._writer_thread = NeverJoined()
    t._WRITER_JOIN_TIMEOUT_S = 0.05
    with pytest.raises(TimeoutError, match="shutdown sentinel"):
        t.close()
    assert not t._closed and t.lookup_ssd((1,)) is None  # the tier still answers
    t._writer_thread = None  # no writer: close starts the Python one
    q.get_nowait()
    t._WRITER_JOIN_TIMEOUT_S = 5.0
    t.close()
    assert t._closed and q.empty() and t._writer_thread is None


def test_replaced_writer_thread_still_alive_keeps_the_index_open(cache_dir, rng):
    t = make_tier(cache_dir)
    joined = []

    class Alive:
        alive = True

        def join(self, timeout=None):
            joined.append(timeout)

        def is_alive(self):
            return self.alive

    w = Alive()
    t._writer_thread = w
    t._WRITER_JOIN_TIMEOUT_S = 0.05
    with pytest.raises(TimeoutError, match="writer thread did not stop"):
        t.close()
    assert len(joined) == 1 and 0 < joined[0] <= 0.05
    assert t._writer_thread is w and not t._closed
    assert t.enqueue_spill((5,), [kv_layer(rng, 1)], 1) is False  # closing
    w.alive = False
    t.close()
    assert t._closed and t._writer_thread is None


def test_standalone_index_conn_queries_index_db(tmp_path):
    d = str(tmp_path / "ix")
    os.makedirs(d)
    ix = kv.SSDIndex(d)
    ix.insert_entry((1, 2, 3, 4), "m", 10, 4)
    with ix._db_lock:
        row = ix._conn.execute("SELECT file_path, prefix_hash FROM entries").fetchone()
    assert row["file_path"] == "m" and row["prefix_hash"] == kv._prefix_hash((1, 2, 3, 4))
    ix.close()
    with pytest.raises(sqlite3.ProgrammingError):
        ix._conn


def test_tier_index_has_no_python_connection(cache_dir):
    t = make_tier(cache_dir)
    try:
        with pytest.raises(AttributeError, match="SSDIndex\\(cache_dir\\)"):
            t._index._conn
    finally:
        t.close()
