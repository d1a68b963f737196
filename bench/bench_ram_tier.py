#!/usr/bin/python3
"""bench_ram_tier.py - the host RAM tier (issue 15) through the drop-in API.

In one process and one run, alternating per round, for Llama-3-8B-shaped fp16
entries (32 KV layers, 8 KV heads, head dim 128: 128 KiB per token, 128 MiB at
the default 1024 tokens):

  reference   ssd_cache_ref (tests/reference/reference_loader.py assembles it
              from ../shared/seed/ssd_cache_reference.txt): spill N entries, wait until
              written, promote them twice; the second pass is the figure (the
              reference reads through the page cache, which still holds the
              files it just wrote).
  kvtier RAM  kvtier.ssd_cache with the host RAM tier on (host_cache_bytes:
              --host-cache-mb, default derived from RAM and the cgroup
              limit): same spill, same two passes, second pass.
  page cache  kvtier with the host cache off (0), the entry files read once
              into the page cache first: one promote pass.
  cold        kvtier with the host cache off, the files' pages dropped
              (posix_fadvise DONTNEED): one promote pass (O_DIRECT reads),
              next to fio's O_DIRECT read (1 MiB blocks, io_uring, --depth)
              of a file of the same total size measured right before.

Targets (issue 15): kvtier RAM second pass >= 1.5x the reference's; cold >=
0.85x fio O_DIRECT read. Prints one line per figure with the memory bound and
MemAvailable at the start of each round (both tiers see the same free memory:
they run alternately in the same process and each frees its entries before the
other runs). A timing is never asserted by a test; this program only reports.

Scratch data: --dir DIR (default $KVT_BENCH_DIR, else /var/tmp), a fresh
kvt-bench-* directory removed at exit. Run with Debian's /usr/bin/python3
(numpy) from the source tree, after building (KVTIER_LIBRARY or build/).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (os.path.join(_ROOT, "bindings", "python"),
           os.path.join(_ROOT, "tests", "reference")):
    if _p not in sys.path:
        sys.path.insert(0, _p)
if "KVTIER_LIBRARY" not in os.environ:
    for cand in ("build/libkvtier.so", "build-rel/libkvtier.so"):
        p = os.path.join(_ROOT, cand)
        if os.path.exists(p):
            os.environ["KVTIER_LIBRARY"] = p
            break

import numpy as np  # noqa: E402

import mlx_standin  # noqa: E402,F401  (the reference imports mlx through it)
import ssd_cache_ref as ref  # noqa: E402
from kvtier import ssd_cache as kv  # noqa: E402

LAYERS, HEADS, DIM = 32, 8, 128


class KV:
    """A duck-typed KV cache layer (keys/values/offset), as mlx_lm's."""

    def __init__(self, k: np.ndarray, v: np.ndarray) -> None:
        self.keys, self.values, self.offset = k, v, k.shape[2]


def make_entries(n: int, tokens: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((1, HEADS, tokens, DIM)).astype(np.float16)
    out = []
    for e in range(n):
        toks = tuple(int(x) for x in rng.integers(0, 32000, size=tokens))
        # Distinct data per layer and entry without generating 128 MiB of
        # random numbers each time.
        layers = [KV(base + np.float16(e * LAYERS + i), base - np.float16(i))
                  for i in range(LAYERS)]
        out.append((toks, layers, 2 * LAYERS * base.nbytes))
    return out


def mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Budget:
    def reserve(self, n: int) -> bool:
        return True

    def release(self, n: int) -> None:
        pass


def wait_written(tier, n: int, timeout: float = 600) -> None:
    t_end = time.monotonic() + timeout
    while tier.get_stats()["spill_count"] < n:
        if time.monotonic() > t_end:
            raise RuntimeError("spills not written in time")
        time.sleep(0.01)


async def promote_pass(tier, entries) -> float:
    """Promotes every entry once, dropping each result; returns bytes/s."""
    b = Budget()
    total = 0
    t0 = time.perf_counter()
    for toks, _, mem in entries:
        layers = await tier.async_promote(toks, b.reserve, b.release)
        if layers is None:
            raise RuntimeError("promote missed")
        total += mem
        del layers
    dt = time.perf_counter() - t0
    gc.collect()
    return total / dt


def entry_files(cache_dir: str):
    """The entries' files: data/ and (chunked native store, the default)
    the chunk files under chunks/."""
    for sub in ("data", "chunks"):
        for root, _, files in os.walk(os.path.join(cache_dir, sub)):
            for f in files:
                yield os.path.join(root, f)


def drop_cache(cache_dir: str) -> None:
    for p in entry_files(cache_dir):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_cache(cache_dir: str) -> None:
    for p in entry_files(cache_dir):
        with open(p, "rb") as f:
            while f.read(8 << 20):
                pass


def fio_read(path: str, size: int, depth: int) -> float:
    cmd = ["fio", "--name=kvtbench", f"--filename={path}", "--rw=write",
           "--bs=1M", f"--size={size}", "--direct=1", "--ioengine=io_uring",
           "--iodepth=8", "--end_fsync=1", "--numjobs=1", "--output-format=json"]
    subprocess.run(cmd, check=True, capture_output=True)
    cmd = ["fio", "--name=kvtbench", f"--filename={path}", "--rw=read",
           "--bs=1M", f"--size={size}", "--direct=1", "--ioengine=io_uring",
           f"--iodepth={depth}", "--invalidate=1", "--numjobs=1",
           "--output-format=json"]
    r = subprocess.run(cmd, check=True, capture_output=True, text=True)
    js = json.loads(r.stdout[r.stdout.index("{"):])
    return float(js["jobs"][0]["read"]["bw_bytes"])


async def run_ref(work: str, entries) -> float:
    d = tempfile.mkdtemp(prefix="ref-", dir=work)
    cfg = ref.SSDCacheConfig(cache_dir=d, max_size_gb=1000.0,
                             spill_queue_size=len(entries) + 1)
    tier = ref.SSDCacheTier(cfg)
    tier.start_writer()
    for toks, layers, mem in entries:
        assert tier.enqueue_spill(toks, layers, mem)
    wait_written(tier, len(entries))
    await promote_pass(tier, entries)
    second = await promote_pass(tier, entries)
    tier.close()
    shutil.rmtree(d)
    return second


async def run_kvt(work: str, entries, host_cache: int | None, depth: int,
                  with_fio: bool) -> dict:
    d = tempfile.mkdtemp(prefix="kvt-", dir=work)
    cfg = kv.SSDCacheConfig(cache_dir=d, max_size_gb=1000.0,
                            spill_queue_size=len(entries) + 1,
                            host_cache_bytes=host_cache)
    tier = kv.SSDCacheTier(cfg)
    tier.start_writer()
    for toks, layers, mem in entries:
        assert tier.enqueue_spill(toks, layers, mem)
    tier.flush()
    out = {}
    await promote_pass(tier, entries)
    out["ram"] = await promote_pass(tier, entries)
    st = tier.get_stats()
    out["bound"] = st["host_cache_bytes_bound"]
    out["used"] = st["host_cache_bytes_used"]
    out["from_ram"] = st["promotes_from_ram"]
    # Host cache off: page-cache and cold passes read the files.
    tier.set_host_cache_bytes(0)
    warm_cache(d)
    out["page_cache"] = await promote_pass(tier, entries)
    drop_cache(d)
    if with_fio:
        total = sum(e[2] for e in entries)
        f = os.path.join(work, "fio.dat")
        out["fio"] = fio_read(f, total, depth)
        os.unlink(f)
    out["cold"] = await promote_pass(tier, entries)
    tier.close()
    shutil.rmtree(d)
    return out


def line(name: str, value: float, limit: float, target: float | None) -> None:
    ratio = value / limit if limit > 0 else 0.0
    verdict = "info" if target is None else ("PASS" if ratio >= target else "MISS")
    t = "" if target is None else f">= {target:.2f}"
    print(f"{name:<44} {value / 1e9:7.2f} GB/s  limit {limit / 1e9:7.2f} GB/s  "
          f"ratio {ratio:5.2f} {t:<8} {verdict}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=os.environ.get("KVT_BENCH_DIR", "/var/tmp"))
    ap.add_argument("--entries", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--host-cache-mb", type=int, default=None,
                    help="host_cache_bytes in MiB (default: derived)")
    ap.add_argument("--no-fio", action="store_true")
    a = ap.parse_args()
    with_fio = not a.no_fio and shutil.which("fio") is not None
    work = tempfile.mkdtemp(prefix="kvt-bench-", dir=a.dir)
    hc = None if a.host_cache_mb is None else a.host_cache_mb << 20
    try:
        entries = make_entries(a.entries, a.tokens, seed=15)
        size = entries[0][2]
        print(f"# machine: {os.cpu_count()} CPUs, MemAvailable "
              f"{mem_available() / 2**30:.1f} GiB, {os.uname().release}, "
              f"load {os.getloadavg()[0]:.2f}; dir {a.dir}")
        print(f"# {a.entries} entries x {size / 2**20:.0f} MiB "
              f"({a.tokens} tokens, {LAYERS} layers fp16), {a.rounds} rounds")
        rows = {k: [] for k in ("ref", "ram", "page_cache", "cold", "fio",
                                "r_ram", "r_cold")}
        for r in range(a.rounds):
            avail = mem_available()
            order = ("ref", "kvt") if r % 2 == 0 else ("kvt", "ref")
            for who in order:
                gc.collect()
                if who == "ref":
                    rv = asyncio.run(run_ref(work, entries))
                else:
                    kvr = asyncio.run(run_kvt(work, entries, hc, a.depth, with_fio))
            rows["ref"].append(rv)
            for k in ("ram", "page_cache", "cold"):
                rows[k].append(kvr[k])
            rows["r_ram"].append(kvr["ram"] / rv)
            if with_fio:
                rows["fio"].append(kvr["fio"])
                rows["r_cold"].append(kvr["cold"] / kvr["fio"])
            print(f"# round {r + 1}: MemAvailable {avail / 2**30:.1f} GiB, "
                  f"host_cache_bytes bound {kvr['bound'] / 2**20:.0f} MiB "
                  f"(used {kvr['used'] / 2**20:.0f} MiB after pass 2, "
                  f"{kvr['from_ram']} promotes from RAM); ref 2nd "
                  f"{rv / 1e9:.2f}, RAM 2nd {kvr['ram'] / 1e9:.2f}, page cache "
                  f"{kvr['page_cache'] / 1e9:.2f}, cold {kvr['cold'] / 1e9:.2f}"
                  + (f", fio {kvr['fio'] / 1e9:.2f}" if with_fio else "")
                  + " GB/s")
        med = {k: statistics.median(v) if v else 0.0 for k, v in rows.items()}
        print("# medians over rounds; ratio = median of per-round ratios")
        print(f"{'figure':<44} {'value':>12}  {'limit':>17}  ratio")
        line("second promote pass, kvtier RAM tier vs ref", med["ram"], med["ref"], None)
        print(f"  (per-round ratio median {med['r_ram']:.2f}, target >= 1.50: "
              f"{'PASS' if med['r_ram'] >= 1.5 else 'MISS'})")
        line("promote, page cache (host cache off) vs ref", med["page_cache"],
             med["ref"], None)
        if with_fio:
            line("cold promote (O_DIRECT) vs fio O_DIRECT read", med["cold"],
                 med["fio"], None)
            print(f"  (per-round ratio median {med['r_cold']:.2f}, target >= 0.85: "
                  f"{'PASS' if med['r_cold'] >= 0.85 else 'MISS'})")
        else:
            line("cold promote (O_DIRECT)", med["cold"], 0, None)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
