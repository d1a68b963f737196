"""Zero-copy spills through the drop-in (kvtier.ssd_cache) and kvtier.Tier:
which buffers are held until written (the MLX stand-in's arrays, numpy
arrays read-only down to an immutable owner) and which are copied on the
caller's thread (anything the caller may still change); the held bytes
against spill_queue_bytes; close() and interpreter exit with spills held.

The MLX arrays are the real-client harness's stand-in (tests/realclient/mlx),
whose buffer export and copy.copy/view model MLX's; real MLX cannot run here.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
import weakref

import numpy as np
import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
_STANDIN = os.path.join(os.path.dirname(_HERE), "realclient")
sys.path.insert(0, _STANDIN)

import mlx.core as mx  # noqa: E402  (the stand-in)

import kvtier  # noqa: E402
from kvtier import _convert  # noqa: E402
from kvtier import ssd_cache as kv  # noqa: E402

SHAPE = (1, 2, 32, 16)


class KV:
    """A KV layer as mlx-lm's KVCache holds it (keys, values, offset)."""

    def __init__(self, keys, values, offset=None):
        self.keys, self.values = keys, values
        self.offset = SHAPE[2] if offset is None else offset


def toks(i, n=SHAPE[2]):
    return tuple(range(1000 * i, 1000 * i + n))


def arrays(seed, dtype=np.float16):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(SHAPE).astype(dtype),
            rng.standard_normal(SHAPE).astype(dtype))


def tier(cache_dir, **kw):
    return kv.SSDCacheTier(kv.SSDCacheConfig(cache_dir=str(cache_dir), **kw))


def stored(t, tokens):
    """(keys, values) of the stored entry, read back from the tier."""
    meta = t.lookup_ssd(tokens)
    assert meta is not None
    layers = t._read_entry(tokens, meta["file_path"])
    assert layers is not None
    return np.asarray(layers[0]["keys"]), np.asarray(layers[0]["values"])


def road(t):
    s = t.get_stats()
    return s["spill_nocopy"], s["spill_copied"]


# -- which buffers are frozen ------------------------------------------------


def test_frozen_numpy_rules():
    w = np.zeros(8, np.float32)
    ro_view = w.view()
    ro_view.flags.writeable = False
    assert not _convert.frozen_numpy(w)
    # A read-only view of a writable base: the base's owner still writes it.
    assert not _convert.frozen_numpy(ro_view)
    assert not _convert.frozen_numpy(np.frombuffer(bytearray(32), np.float32))
    assert _convert.frozen_numpy(np.frombuffer(bytes(32), np.float32))
    assert _convert.frozen_numpy(np.frombuffer(memoryview(bytes(32)), np.float32))
    own = np.zeros(8, np.float32)
    own.flags.writeable = False
    assert _convert.frozen_numpy(own)
    sub = own[2:6]
    assert _convert.frozen_numpy(sub)
    # Memory numpy does not own (a ctypes buffer here) is never frozen.
    import ctypes
    cbuf = (ctypes.c_float * 8)()
    ext = np.frombuffer(cbuf, np.float32)
    ext.flags.writeable = False
    assert not _convert.frozen_numpy(ext)


def test_standin_export_models_mlx():
    """The stand-in exports its data zero-copy through a writable buffer (as
    MLX's getbuffer does), and copy.copy / view share the data."""
    a = mx.array(np.arange(12, dtype=np.float16).reshape(3, 4))
    mv = memoryview(a)
    assert not mv.readonly and mv.format == "e" and mv.nbytes == a.nbytes
    pin = __import__("copy").copy(a)
    assert np.shares_memory(np.asarray(pin), np.asarray(a))
    with pytest.raises(RuntimeError, match="copy-on-write|new buffer"):
        a[0, 0] = 7  # MLX would rebind a; the stand-in refuses instead
    del pin, mv
    gc.collect()
    a[0, 0] = 7  # no sharer left
    b = mx.array(np.ones((2, 4), np.float32)).astype(mx.bfloat16)
    bits = mx.view(b, mx.uint16)
    assert np.asarray(bits).dtype == np.uint16
    assert (np.asarray(bits) == 0x3F80).all()


# -- (a) the stand-in's MLX arrays take the zero-copy road ---------------------


@pytest.mark.parametrize("bf16", [False, True])
def test_mlx_arrays_are_held_not_copied(tmp_path, bf16):
    k, v = arrays(1, np.float32 if bf16 else np.float16)
    if bf16:
        mk, mv_ = mx.array(k).astype(mx.bfloat16), mx.array(v).astype(mx.bfloat16)
    else:
        mk, mv_ = mx.array(k), mx.array(v)
    t = tier(tmp_path / "kv")
    try:
        assert t.enqueue_spill(toks(1), [KV(mk, mv_)], 100)
        s = t.get_stats()
        assert (s["spill_nocopy"], s["spill_copied"]) == (1, 0)
        assert s["spill_nocopy_copied_bytes"] == 0
        # Held (the writer is not started): the caller's data, not a copy.
        assert s["spill_held"] == 1 and s["spill_held_bytes"] == 2 * k.size * (
            2 if bf16 else k.itemsize)
        t.start_writer()
        t.flush()
        assert t.get_stats()["spill_held_bytes"] == 0  # released once written
        gk, gv = stored(t, toks(1))
        if bf16:
            want_k = np.asarray(mk.astype(mx.float32))
            want_v = np.asarray(mv_.astype(mx.float32))
        else:
            want_k, want_v = k, v
        assert gk.tobytes() == want_k.tobytes() and gv.tobytes() == want_v.tobytes()
    finally:
        t.close()


def test_frozen_numpy_is_held(tmp_path):
    k, v = arrays(2)
    fk = np.frombuffer(k.tobytes(), k.dtype).reshape(SHAPE)
    fv = np.frombuffer(v.tobytes(), v.dtype).reshape(SHAPE)
    t = tier(tmp_path / "kv")
    t.start_writer()
    try:
        assert t.enqueue_spill(toks(2), [KV(fk, fv)], 100)
        assert road(t) == (1, 0)
        t.flush()
        gk, gv = stored(t, toks(2))
        assert gk.tobytes() == k.tobytes() and gv.tobytes() == v.tobytes()
    finally:
        t.close()


# -- (b) buffers the caller may still change are copied -----------------------


def test_writable_numpy_is_copied(tmp_path):
    """Mutating a writable array (or the writable base of a read-only view)
    after enqueue_spill, before the writer runs, does not change what is
    stored."""
    k, v = arrays(3)
    k0, v0 = k.copy(), v.copy()
    rk = k.view()
    rk.flags.writeable = False  # read-only view of a writable base
    t = tier(tmp_path / "kv")
    try:
        assert t.enqueue_spill(toks(3), [KV(rk, v)], 100)
        assert road(t) == (0, 1)
        assert t.get_stats()["spill_held_bytes"] == 0
        k[...] = 0  # through the writable base
        v[...] = 0
        t.start_writer()
        t.flush()
        gk, gv = stored(t, toks(3))
        assert gk.tobytes() == k0.tobytes() and gv.tobytes() == v0.tobytes()
    finally:
        t.close()


def test_mixed_spill_copies_only_the_shared_buffer(tmp_path):
    k, v = arrays(4)
    v0 = v.copy()
    t = tier(tmp_path / "kv")
    try:
        assert t.enqueue_spill(toks(4), [KV(mx.array(k), v)], 100)
        s = t.get_stats()
        assert (s["spill_nocopy"], s["spill_copied"]) == (1, 0)
        assert s["spill_nocopy_copied_bytes"] == v.nbytes  # the numpy one only
        v[...] = 0
        t.start_writer()
        t.flush()
        gk, gv = stored(t, toks(4))
        assert gk.tobytes() == k.tobytes() and gv.tobytes() == v0.tobytes()
    finally:
        t.close()


# -- (c) held bytes count against spill_queue_bytes ----------------------------


def test_held_bytes_count_against_spill_queue_bytes(tmp_path):
    """A spill being written has left the C queue but is still held: the
    next one that would pass spill_queue_bytes beside it is refused as a
    full queue, at once, and accepted again once the first is released."""
    k, v = arrays(5)
    entry = k.nbytes + v.nbytes
    t = tier(tmp_path / "kv", spill_queue_bytes=entry + entry // 2)
    started, go = threading.Event(), threading.Event()
    orig = t._write_entry

    def slow_write(tokens_key, snaps, mem):
        started.set()
        go.wait(30)
        orig(tokens_key, snaps, mem)

    t._write_entry = slow_write
    t.start_writer()
    try:
        assert t.enqueue_spill(toks(5), [KV(mx.array(k), mx.array(v))], 100)
        assert started.wait(30)  # taken off the C queue, in the write
        assert t._spill_queue.qsize() == 0
        assert t.get_stats()["spill_held_bytes"] == entry
        before = t.get_stats()
        assert not t.enqueue_spill(toks(6), [KV(mx.array(k), mx.array(v))], 100)
        after = t.get_stats()
        assert after["spill_refused_queue_full"] == before["spill_refused_queue_full"] + 1
        assert after["spill_drops"] == before["spill_drops"] + 1
        assert after["spill_refused_held"] == 1
        go.set()
        t.flush()
        assert t.get_stats()["spill_held_bytes"] == 0
        assert t.enqueue_spill(toks(6), [KV(mx.array(k), mx.array(v))], 100)
        t.flush()
        assert t.lookup_ssd(toks(5)) is not None and t.lookup_ssd(toks(6)) is not None
    finally:
        go.set()
        t.close()


def test_tier_held_bytes_bound_raises_queue_full(tmp_path):
    k, v = arrays(6)
    entry = k.nbytes + v.nbytes
    t = kvtier.Tier(str(tmp_path / "kv"), spill_queue_bytes=entry + entry // 2,
                    start_writer=False)
    try:
        t.spill(toks(7), [KV(mx.array(k), mx.array(v))])
        with pytest.raises(kvtier.QueueFull):
            t.spill(toks(8), [KV(mx.array(k), mx.array(v))])
        s = t.stats()
        assert s["spill_nocopy"] == 1 and s["spill_held_bytes"] == entry
        assert s["spill_refused_queue_full"] == 1
    finally:
        t.close()
    assert t.stats()["spill_held_bytes"] == 0


def test_tier_copies_writable_numpy(tmp_path):
    k, v = arrays(7)
    k0 = k.copy()
    t = kvtier.Tier(str(tmp_path / "kv"), start_writer=False)
    try:
        t.spill(toks(9), [KV(k, v)])
        k[...] = 1
        s = t.stats()
        assert (s["spill_nocopy"], s["spill_copied"]) == (0, 1)
        kvtier._lib.check(kvtier._lib.kvt_tier_start_writer(t._h.ptr))
        t.flush()
        e = t.promote(toks(9))
        assert np.asarray(e.layers[0]["keys"]).tobytes() == k0.tobytes()
    finally:
        t.close()


# -- (d) close() with spills held -----------------------------------------------


@pytest.mark.parametrize("timeout", [None, 120.0])
def test_close_writes_held_spills_and_releases_them(tmp_path, timeout):
    """close() (the reference's, or close(timeout=s)) with zero-copy spills
    still queued (the writer never started) writes them all, releases every
    buffer, and the entries are there for the next process."""
    d = tmp_path / "kv"
    t = tier(d)
    data = {}
    pins = []
    for i in range(4):
        k, v = arrays(10 + i)
        mk, mv_ = mx.array(k), mx.array(v)
        assert t.enqueue_spill(toks(10 + i), [KV(mk, mv_)], 100)
        data[toks(10 + i)] = (k, v)
        pins.append((mk, mv_))
    assert t.get_stats()["spill_held"] == 4
    if timeout is None:
        t.close()
    else:
        t.close(timeout=timeout)
    assert t._holds.pending() == 0 and t._holds.held_bytes() == 0
    gc.collect()
    for mk, mv_ in pins:  # nobody shares their data any more
        mk[0, 0, 0, 0] = 0
        mv_[0, 0, 0, 0] = 0
    t2 = tier(d)
    try:
        for tk, (k, v) in data.items():
            gk, gv = stored(t2, tk)
            assert gk.tobytes() == k.tobytes() and gv.tobytes() == v.tobytes()
    finally:
        t2.close()


def test_failed_nocopy_spill_releases_at_once(tmp_path):
    k, v = arrays(20)
    mk = mx.array(k)
    t = tier(tmp_path / "kv")
    try:
        # offset beyond the rows: libkvtier refuses (EINVAL) and releases.
        assert not t.enqueue_spill(toks(20), [KV(mk, mx.array(v), offset=SHAPE[2] + 5)], 1)
        assert t.get_stats()["spill_held"] == 0
        gc.collect()
        mk[0, 0, 0, 0] = 1  # the pin is gone
    finally:
        t.close()


@pytest.mark.parametrize("writer", [False, True])
def test_interpreter_exit_with_held_spills(tmp_path, writer):
    """A process that exits with zero-copy spills held, never closed, exits
    cleanly (no hang, no crash, no error printed): the tier's finalizer
    frees it at exit, dropping what was queued (writer not started) or
    writing what the writer has taken, releasing every buffer while threads
    can still take the GIL."""
    d = tmp_path / "kv"
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {_STANDIN!r})
        import numpy as np
        import mlx.core as mx
        from kvtier import ssd_cache as kv
        class KV:
            def __init__(self, k, v):
                self.keys, self.values, self.offset = k, v, k.shape[2]
        t = kv.SSDCacheTier(kv.SSDCacheConfig(cache_dir={str(d)!r}))
        if {writer!r}:
            t.start_writer()
        rng = np.random.default_rng(0)
        for i in range(8):
            k = mx.array(rng.standard_normal((1, 8, 256, 64)).astype(np.float16))
            assert t.enqueue_spill(tuple(range(i * 1000, i * 1000 + 256)), [KV(k, k + 0)], 1)
        s = t.get_stats()
        print("held", s["spill_held"], "nocopy", s["spill_nocopy"], flush=True)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[2:] == ["nocopy", "8"], r.stdout
    if not writer:
        assert r.stdout.split()[:2] == ["held", "8"], r.stdout
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr


# -- with a remote tier: the upload thread releases ---------------------------


@pytest.mark.skipif(__import__("shutil").which("redis-server") is None,
                    reason="redis: redis-server not installed")
@pytest.mark.parametrize("mode", ["local+remote", "remote"])
def test_remote_upload_releases_held_spill(tmp_path, mode):
    """A zero-copy spill to a tier with a remote store is held until the
    upload is done too (libkvtier releases it from the upload thread), then
    released; another node promotes what was uploaded, bit for bit."""
    import asyncio

    import redis_servers as rs
    proc, port = rs.start(str(tmp_path / "srv"))
    url = f"redis://127.0.0.1:{port}"
    try:
        try:
            a = tier(tmp_path / "a", remote_url=url, remote_mode=mode, remote_prefix="nc:")
        except Exception as e:  # builds without hiredis
            if "no Redis support" in str(e):
                pytest.skip("hiredis: libkvtier built without hiredis")
            raise
        b = tier(tmp_path / "b", remote_url=url, remote_mode="local+remote",
                 remote_prefix="nc:")
        k, v = arrays(30)
        try:
            a.start_writer()
            assert a.enqueue_spill(toks(30), [KV(mx.array(k), mx.array(v))], 77)
            assert road(a) == (1, 0)
            a.flush(timeout=60)  # written and uploaded
            s = a.get_stats()
            assert s["remote_spill_count"] == 1 and s["spill_held_bytes"] == 0
            got = None
            for _ in range(500):  # b learns of it asynchronously
                if b.lookup_ssd(toks(30)) is not None:
                    got = asyncio.run(b.async_promote(toks(30), lambda n: True,
                                                      lambda n: None))
                    break
                __import__("time").sleep(0.02)
            assert got is not None
            assert np.asarray(got[0]["keys"]).tobytes() == k.tobytes()
            assert np.asarray(got[0]["values"]).tobytes() == v.tobytes()
        finally:
            a.close()
            b.close()
        assert a._holds.pending() == 0
    finally:
        rs.stop([proc])


# -- a zero-copy spill is in the RAM tier once written ---------------------


@pytest.mark.parametrize("n", [SHAPE[2], 600])
def test_nocopy_spill_then_promote_is_a_ram_hit(tmp_path, n):
    """The writer copies what RAM lacks of a zero-copy spill (the entry, or
    its tail and chunks) before it releases the MLX arrays, so the first
    promote after the spill is served from RAM, bit for bit (defaults: the
    600-token entry is chunked, the 32-token one stored whole)."""
    import asyncio

    rng = np.random.default_rng(n)
    shape = (1, 2, n, 16)
    k = rng.standard_normal(shape).astype(np.float16)
    v = rng.standard_normal(shape).astype(np.float16)
    tokens = tuple(range(7000, 7000 + n))
    t = tier(tmp_path / "kv")
    try:
        t.start_writer()
        assert t.enqueue_spill(tokens, [KV(mx.array(k), mx.array(v), n)], 100)
        t.flush()
        s0 = t.get_stats()
        assert (s0["spill_nocopy"], s0["spill_copied"]) == (1, 0)
        assert s0["spill_held_bytes"] == 0

        async def run():
            return await t.async_promote(tokens, lambda b: True, lambda b: None)

        got = asyncio.run(run())
        assert got is not None
        s = t.get_stats()
        assert s["host_cache_hits"] == s0["host_cache_hits"] + 1
        assert s["promotes_from_ram"] == s0["promotes_from_ram"] + 1
        assert s["promotes_from_disk"] == s0["promotes_from_disk"]
        assert np.asarray(got[0]["keys"]).tobytes() == k.tobytes()
        assert np.asarray(got[0]["values"]).tobytes() == v.tobytes()
    finally:
        t.close()
