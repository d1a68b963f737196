#!/usr/bin/python3
"""bench_dropin_promote.py - cold and warm promote passes through the drop-in
API, kvtier.ssd_cache on its DEFAULT configuration against the reference.

The reference is vllm-mlx's ssd_cache module as tests/reference/ssd_cache_ref.py
assembles it from the seed (../shared/seed/ssd_cache_reference.txt).  For each
of --reps repetitions, alternating which of the two goes first, each tier:

  spill       --entries Llama-3-8B-shaped fp16 entries (32 KV layers, 8 KV
              heads, head dim 128: 128 KiB per token; --tokens 1024 = 128 MiB,
              a multiple of the default chunk_tokens, so kvtier stores each as
              a pure chain), enqueue_spill on the default SSDCacheConfig
              (chunked store, host RAM tier, fsync), then drain (the writer
              has written all of them);
  cold pass   the page cache of every file an entry reads - data/ and the
              chunk files under chunks/ - dropped (fsync, then
              posix_fadvise(DONTNEED)), kvtier's host RAM tier emptied
              (trim(0): what a restarted server has); residency of those
              files (mincore) printed before the pass; one async_promote of
              every entry;
  warm pass   a second async_promote of every entry right after: the
              reference reads the page cache the cold pass filled, kvtier is
              served by its host RAM tier (the copies the cold pass lent it);
              residency and kvtier's host-cache hits and verification
              failures printed.

Prints each pass's GB/s, then the ratio kvtier / reference of the warm pass
(target: median >= 3.0) and of the cold pass, each as median and spread
(min..max) of the per-repetition ratios, and the command line that printed
them.  A timing is never asserted by a test; this program only reports.

Scratch data: --dir DIR (default $KVT_BENCH_DIR, else /var/tmp), a fresh
kvt-bench-* directory removed at exit.  Run with Debian's /usr/bin/python3
(numpy) from the source tree, after building (KVTIER_LIBRARY or build/).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import ctypes.util
import gc
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

# Paths, library discovery, the reference and the drop-in come with the RAM
# tier bench, as do its entry maker and promote pass.
import bench_ram_tier as brt  # noqa: E402

ref, kv = brt.ref, brt.kv

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                       ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t,
                          ctypes.POINTER(ctypes.c_ubyte)]
_PAGE = os.sysconf("SC_PAGE_SIZE")
_MAP_FAILED = ctypes.c_void_p(-1).value


def residency(cache_dir: str) -> tuple[int, int]:
    """(resident bytes, total bytes) of the entries' files (data/, chunks/),
    from mincore over a read-only mapping of each (the mapping itself faults
    nothing in)."""
    res = total = 0
    for p in brt.entry_files(cache_dir):
        size = os.path.getsize(p)
        if size == 0:
            continue
        total += size
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = _libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
            if addr in (None, _MAP_FAILED):
                continue
            try:
                n = (size + _PAGE - 1) // _PAGE
                vec = (ctypes.c_ubyte * n)()
                if _libc.mincore(addr, size, vec) == 0:
                    res += min(size, sum(b & 1 for b in vec) * _PAGE)
            finally:
                _libc.munmap(addr, size)
        finally:
            os.close(fd)
    return res, total


def pct(rt: tuple[int, int]) -> str:
    r, t = rt
    return f"{100.0 * r / t:.1f}% of {t / 2**20:.0f} MiB" if t else "no files"


async def one_tier(who: str, work: str, entries) -> dict:
    d = tempfile.mkdtemp(prefix=f"{who}-", dir=work)
    if who == "ref":
        tier = ref.SSDCacheTier(ref.SSDCacheConfig(cache_dir=d))
    else:
        tier = kv.SSDCacheTier(kv.SSDCacheConfig(cache_dir=d))
    out = {}
    try:
        tier.start_writer()
        t0 = time.perf_counter()
        for toks, layers, mem in entries:
            if not tier.enqueue_spill(toks, layers, mem):
                raise RuntimeError(f"{who}: spill refused")
        brt.wait_written(tier, len(entries))
        out["spill_s"] = time.perf_counter() - t0
        if who == "kvt":
            tier.trim(0)  # an empty host RAM tier, as after a restart
        brt.drop_cache(d)
        out["res_cold"] = residency(d)
        out["cold"] = await brt.promote_pass(tier, entries)
        out["res_warm"] = residency(d)
        s0 = tier.get_stats() if who == "kvt" else None
        out["warm"] = await brt.promote_pass(tier, entries)
        if who == "kvt":
            s1 = tier.get_stats()
            out["hits"] = s1["host_cache_hits"] - s0["host_cache_hits"]
            out["verify_failures"] = s1["host_cache_verify_failures"]
            out["from_ram"] = s1["promotes_from_ram"] - s0["promotes_from_ram"]
    finally:
        tier.close()
        shutil.rmtree(d, ignore_errors=True)
    return out


def spread(v: list) -> str:
    return f"median {statistics.median(v):6.2f}  spread {min(v):.2f}..{max(v):.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=os.environ.get("KVT_BENCH_DIR", "/var/tmp"))
    ap.add_argument("--entries", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    if a.entries < 1 or a.tokens < 1 or a.reps < 1:
        ap.error("--entries, --tokens and --reps must be >= 1")
    cmd = shlex.join([sys.executable, os.path.relpath(__file__)] + sys.argv[1:])
    work = tempfile.mkdtemp(prefix="kvt-bench-", dir=a.dir)
    try:
        entries = brt.make_entries(a.entries, a.tokens, seed=24)
        size = entries[0][2]
        cfg = kv.SSDCacheConfig(cache_dir=os.path.join(work, "probe"))
        print(f"# machine: {os.cpu_count()} CPUs, MemAvailable "
              f"{brt.mem_available() / 2**30:.1f} GiB, {os.uname().release}, "
              f"load {os.getloadavg()[0]:.2f}; dir {a.dir}")
        print(f"# {a.entries} entries x {size / 2**20:.0f} MiB ({a.tokens} tokens, "
              f"{brt.LAYERS} layers fp16), {a.reps} repetitions; kvtier on the "
              f"default SSDCacheConfig (chunk_tokens {cfg.chunk_tokens}, host "
              f"RAM tier {'on' if cfg.host_cache_bytes != 0 else 'off'})")
        rows = {k: [] for k in ("ref_cold", "ref_warm", "kvt_cold", "kvt_warm",
                                "r_warm", "r_cold")}
        for r in range(a.reps):
            order = ("ref", "kvt") if r % 2 == 0 else ("kvt", "ref")
            res = {}
            for who in order:
                gc.collect()
                res[who] = asyncio.run(one_tier(who, work, entries))
            rf, kt = res["ref"], res["kvt"]
            for who, x in (("ref", rf), ("kvt", kt)):
                rows[f"{who}_cold"].append(x["cold"])
                rows[f"{who}_warm"].append(x["warm"])
            rows["r_warm"].append(kt["warm"] / rf["warm"])
            rows["r_cold"].append(kt["cold"] / rf["cold"])
            print(f"# rep {r + 1} ({' then '.join(order)}):")
            for who, x in (("reference", rf), ("kvtier", kt)):
                extra = ""
                if who == "kvtier":
                    extra = (f"; warm: {x['hits']} host-cache hits, "
                             f"{x['from_ram']} promotes from RAM, "
                             f"{x['verify_failures']} verification failures")
                print(f"    {who:<9} spill {x['spill_s']:6.2f} s  cold "
                      f"{x['cold'] / 1e9:6.2f} GB/s (resident before: "
                      f"{pct(x['res_cold'])})  warm {x['warm'] / 1e9:6.2f} GB/s "
                      f"(resident before: {pct(x['res_warm'])}){extra}")
            print(f"    ratio kvtier/reference: warm {rows['r_warm'][-1]:.2f}, "
                  f"cold {rows['r_cold'][-1]:.2f}")
        print(f"# {a.reps} repetitions; ratios are per repetition")
        for k, name in (("ref_cold", "reference cold pass GB/s"),
                        ("kvt_cold", "kvtier cold pass GB/s"),
                        ("ref_warm", "reference warm pass GB/s"),
                        ("kvt_warm", "kvtier warm pass GB/s")):
            print(f"{name:<36} {spread([v / 1e9 for v in rows[k]])}")
        mw = statistics.median(rows["r_warm"])
        print(f"{'warm ratio kvtier/reference':<36} {spread(rows['r_warm'])}  "
              f"target >= 3.00 {'PASS' if mw >= 3.0 else 'MISS'}")
        print(f"{'cold ratio kvtier/reference':<36} {spread(rows['r_cold'])}  info")
        print(f"# command: {cmd}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
