#!/usr/bin/python3
"""bench_spill_caller.py - what enqueue_spill costs the engine's thread: the
time the call takes on the caller's thread through the drop-in
(kvtier.ssd_cache on its default SSDCacheConfig), for a Llama-3-8B-shaped
entry (32 KV layers, 8 KV heads, head dim 128, fp16: 128 KiB per token;
--tokens 1024 = 128 MiB), on the two roads a spill can take:

  copy    the layers are writable numpy arrays: the caller may still change
          them, so they are copied before the call returns;
  nocopy  the layers are MLX arrays - here the real-client harness's numpy
          stand-in (tests/realclient/mlx), which exports its data through
          the buffer protocol as MLX does - held until the writer has
          written them (kvt_tier_spill_nocopy).

Each of --runs rounds spills one entry per road (alternating which goes
first), timing the enqueue_spill call alone, then waits until the writer has
written it (the disk's time, which the caller does not wait for).  Prints
p50/p90/min/max of each road in ms side by side, the ratio of the p50s, the
target (nocopy p50 <= 2 ms) as met or not, and the command line.  The
stand-in's export costs about what MLX's does (a reference, a buffer export,
a numpy view); real MLX adds evaluation of lazy arrays, which the engine pays
anyway, and is not measured here.  A timing is never asserted by a test.

Scratch data: --dir DIR (default $KVT_BENCH_DIR, else /var/tmp), a fresh
kvt-bench-* directory removed at exit.  Run with Debian's /usr/bin/python3
(numpy) from the source tree, after building (KVTIER_LIBRARY or build/).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)
for _p in (os.path.join(_REPO, "bindings", "python"), os.path.join(_REPO, "tests", "realclient")):
    if _p not in sys.path:
        sys.path.insert(0, _p)
if "KVTIER_LIBRARY" not in os.environ:
    for _cand in ("build/libkvtier.so", "build-release/libkvtier.so"):
        _lib = os.path.join(_REPO, _cand)
        if os.path.exists(_lib):
            os.environ["KVTIER_LIBRARY"] = _lib
            break

import numpy as np  # noqa: E402

import mlx.core as mx  # noqa: E402  (the stand-in)
from kvtier import ssd_cache as kv  # noqa: E402

LAYERS, HEADS, DIM = 32, 8, 128
TARGET_MS = 2.0


class KV:
    """A KV layer as mlx-lm's KVCache holds it."""

    def __init__(self, k, v) -> None:
        self.keys, self.values, self.offset = k, v, k.shape[2]


def make_layers(tokens: int, seed: int, mlx: bool) -> list:
    """LAYERS distinct fp16 layers of `tokens` rows each (made before the
    timed call, as the engine's arrays exist before it evicts them)."""
    base = np.random.default_rng(seed).standard_normal(
        (1, HEADS, tokens, DIM)).astype(np.float16)
    out = []
    for i in range(LAYERS):
        k, v = base + np.float16(i), base - np.float16(i)
        out.append(KV(mx.array(k), mx.array(v)) if mlx else KV(k, v))
    return out


def wait_written(tier, n: int, timeout: float = 600) -> None:
    end = time.monotonic() + timeout
    while tier.get_stats()["spill_count"] < n:
        if time.monotonic() > end:
            raise TimeoutError(f"{n} spills not written after {timeout}s")
        time.sleep(0.005)


def pct(xs: list, q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=os.environ.get("KVT_BENCH_DIR", "/var/tmp"))
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=20)
    a = ap.parse_args()
    if a.runs < 1 or a.tokens < 1:
        ap.error("--runs and --tokens must be >= 1")
    scratch = tempfile.mkdtemp(prefix="kvt-bench-", dir=a.dir)
    times = {"copy": [], "nocopy": []}
    roads = {"copy": (0, 0), "nocopy": (0, 0)}
    try:
        t = kv.SSDCacheTier(kv.SSDCacheConfig(cache_dir=os.path.join(scratch, "kv")))
        t.start_writer()
        entry_bytes = 2 * LAYERS * HEADS * a.tokens * DIM * 2
        written = 0
        for r in range(a.runs):
            order = ("copy", "nocopy") if r % 2 == 0 else ("nocopy", "copy")
            for j, name in enumerate(order):
                layers = make_layers(a.tokens, 1000 + 2 * r + j, name == "nocopy")
                toks = tuple(range(10**6 * (2 * r + j + 1), 10**6 * (2 * r + j + 1) + a.tokens))
                s0 = t.get_stats()
                t0 = time.perf_counter()
                ok = t.enqueue_spill(toks, layers, entry_bytes)
                dt = time.perf_counter() - t0
                if not ok:
                    raise RuntimeError(f"{name}: spill refused: {t.get_stats()}")
                s1 = t.get_stats()
                roads[name] = (roads[name][0] + s1["spill_nocopy"] - s0["spill_nocopy"],
                               roads[name][1] + s1["spill_copied"] - s0["spill_copied"])
                times[name].append(dt * 1e3)
                del layers
                written += 1
                wait_written(t, written)  # the writer's time, off the clock
        t.close()
        print(f"enqueue_spill on the caller's thread, drop-in defaults, "
              f"{entry_bytes / 2**20:.0f} MiB entry ({a.tokens} tokens, {LAYERS} layers "
              f"fp16, {HEADS} KV heads, dim {DIM}), {a.runs} runs per road")
        print(f"{'road':8} {'p50 ms':>9} {'p90 ms':>9} {'min ms':>9} {'max ms':>9}  spills "
              "(nocopy, copied)")
        for name in ("copy", "nocopy"):
            xs = times[name]
            print(f"{name:8} {statistics.median(xs):9.3f} {pct(xs, 0.9):9.3f} "
                  f"{min(xs):9.3f} {max(xs):9.3f}  {roads[name]}")
        p_copy, p_nc = statistics.median(times["copy"]), statistics.median(times["nocopy"])
        print(f"copy p50 / nocopy p50 = {p_copy / p_nc:.1f}x; nocopy p50 {p_nc:.3f} ms vs "
              f"target <= {TARGET_MS} ms: {'met' if p_nc <= TARGET_MS else 'NOT met'}")
        if roads["nocopy"][1] or roads["copy"][0]:
            print("WARNING: a spill took the other road than its name says")
        print("command:", shlex.join([sys.executable] + sys.argv))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
