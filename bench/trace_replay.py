#!/usr/bin/python3
"""trace_replay.py - replays a Mooncake-style request trace through the drop-in
SSD tier (kvtier.ssd_cache, and the reference ssd_cache_ref side by side) as
vllm-mlx's scheduler drives it, and reports hit rate against the ideal and the
bytes the device was asked to write.

Each trace line gives a request's arrival time (ms), input length and the ids
of its consecutive 512-token blocks (equal ids at equal positions = equal
content; the last block may be partial).  A block's tokens are derived from its
id alone, so equal ids give equal tokens; each KV row is derived from a
position-weighted hash of the whole token prefix up to it, so two prompts share
rows exactly as far as they share a prefix.  Per request, in trace order:

  check    lookup_ssd(prompt), then lookup_ssd_prefix(prompt) (what
           MemoryAwarePrefixCache.check_ssd does), matched = the prompt's
           length or the entry's num_tokens;
  promote  _read_entry(prompt[:matched], file_path) then _index.touch (the
           scheduler's synchronous path), or async_promote with an always
           granting budget (--promote async); every returned row is compared
           bit for bit with the rows the replay derives for that prefix;
  spill    enqueue_spill(prompt, layers) - every prompt is spilled, as if no
           RAM cache stood in front - then the writer is drained (kvtier:
           flush(); the reference: its queued item written synchronously with
           _write_entry), so a run is deterministic; refused spills are counted.

With --spills client the spills come instead from the real client in front of
the tier (bench/trace_client.py): vllm-mlx's MemoryAwarePrefixCache with a RAM
budget of --ram-prompts of the window's longest prompts spills its LRU
evictions, and the scheduler's own methods build the tier and promote what
check_ssd finds (RAM hits are counted apart).

Time follows the trace through TraceClock, which the replay advances to each
request's timestamp before it is served.  Neither tier takes a clock today; the
clock is handed to make_tier so a tier that accepts one (a write budget per
day) can be driven by trace time without code changes here.

The ideal is an infinite block cache over the same requests: a block hits when
the same chain of (position, id) blocks was seen in an earlier prompt.  Disk
budgets (max_size_gb) are fractions of the trace's unique KV (each distinct
chain block once, at --kv-bytes-per-token).  Every (implementation, budget)
runs in its own child process, which reports the kernel's write_bytes minus
cancelled_write_bytes of /proc/self/io from just before the tier is opened to
after it is closed and the file system synced (data, SQLite index, WAL and
directories alike; None where /proc/self/io does not exist), and the bytes
allocated under the cache directory at the end.  A file deleted before the
kernel wrote it back costs nothing (cancelled_write_bytes), so a tier that never
fsyncs (the reference) would be charged by how fast the replay ran against the
kernel's writeback delay; by default (--writeback request) the cache's file
system is therefore synced after every request, as if writeback kept pace with
arrivals: what outlives a request is counted, what is deleted within it is not,
and the figure repeats from run to run.  It is on the high side for pages
rewritten in place (SQLite's database, journal and WAL pages are charged once
per request that dirties them, where the kernel's 30 s writeback would merge
them); --writeback kernel leaves it to the kernel (then the figure depends on
the replay's speed).  The tiers' own spill_bytes counters are printed beside.

Scratch data: --dir DIR (default $KVT_BENCH_DIR, else /var/tmp), one fresh
kvt-trace-* directory per configuration, removed after it.  Run with Debian's
/usr/bin/python3 (numpy) from the source tree after building the library
(KVTIER_LIBRARY, else build/libkvtier.so).  Timings on a shared machine mean
little; hit rates, row checks and byte counts are the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
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
    _cand = os.path.join(_ROOT, "build", "libkvtier.so")
    if os.path.exists(_cand):
        os.environ["KVTIER_LIBRARY"] = _cand

import numpy as np  # noqa: E402

BLOCK_TOKENS = 512
VOCAB = 151_936          # a Qwen-sized vocabulary; any bound below 2**31 works
IMPLS = ("kvtier", "reference")
_GIB = 1024 ** 3          # both tiers' max_size_gb unit
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def default_trace() -> str:
    return os.path.join(os.path.dirname(_ROOT), "shared", "traces", "synthetic_trace.jsonl")


def load_trace(path: str, n: int, skip: int = 0) -> list[dict]:
    """n requests after the first `skip`; a line whose blocks cannot hold its input length
    (or hold more than one partial block) is an error, not silently fixed."""
    out = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if len(out) >= n:
                break
            if not line.strip():
                continue
            if skip > 0:
                skip -= 1
                continue
            r = json.loads(line)
            ids = [int(x) for x in r["hash_ids"]]
            length = int(r["input_length"])
            if not ids or not (BLOCK_TOKENS * (len(ids) - 1) < length <= BLOCK_TOKENS * len(ids)):
                raise ValueError(f"{path}:{lineno}: input_length {length} does not fit "
                                 f"{len(ids)} blocks of {BLOCK_TOKENS}")
            out.append({"timestamp": float(r["timestamp"]), "length": length, "ids": ids,
                        "output": int(r.get("output_length", 0))})
    return out


def block_lengths(req: dict) -> list[int]:
    k = len(req["ids"])
    return [BLOCK_TOKENS] * (k - 1) + [req["length"] - BLOCK_TOKENS * (k - 1)]


# ---------------------------------------------------------------- derivation

def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def prompt_tokens(req: dict) -> np.ndarray:
    """The prompt's tokens: block j of id b holds mix(b * 512 + j) mod VOCAB,
    so a block's content is a function of its id alone."""
    parts = []
    for bid, blen in zip(req["ids"], block_lengths(req)):
        j = np.arange(blen, dtype=np.uint64)
        parts.append(_mix(np.uint64(bid) * np.uint64(BLOCK_TOKENS) + j + np.uint64(1)))
    t = np.concatenate(parts) % np.uint64(VOCAB)
    return t.astype(np.int64)


class KVShape:
    """One fp16 KV layer of `heads` x `dim` for keys and for values:
    4 * heads * dim bytes per token (256 B/token = 2 heads x 32)."""

    def __init__(self, bytes_per_token: int) -> None:
        if bytes_per_token < 4 or bytes_per_token % 4:
            raise ValueError("--kv-bytes-per-token must be a positive multiple of 4 "
                             "(keys and values, fp16)")
        per = bytes_per_token // 4          # heads * dim
        self.heads = 2 if per % 2 == 0 else 1
        self.dim = per // self.heads
        self.bytes_per_token = bytes_per_token
        self._pow = np.ones(1, dtype=np.uint64)
        self._salt = _mix(np.arange(1, 2 * per + 1, dtype=np.uint64) *
                          np.uint64(0x9E3779B97F4A7C15))

    def _powers(self, n: int) -> np.ndarray:
        if len(self._pow) < n:
            p = np.full(max(n, 2 * len(self._pow)), np.uint64(0x100000001B3), dtype=np.uint64)
            p[0] = 1
            self._pow = np.cumprod(p, dtype=np.uint64)
        return self._pow[:n]

    def rows(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """keys, values of shape (1, heads, n, dim), fp16.  Row i is a function
        of h_i = sum_{j<=i} (t_j + 1) * B^j mod 2^64, i.e. of tokens[:i+1] only.
        The fp16 bit patterns leave the top exponent bit clear: every value is
        finite, so no layer of either tier may treat them specially."""
        n = len(tokens)
        h = np.cumsum((tokens.astype(np.uint64) + np.uint64(1)) * self._powers(n),
                      dtype=np.uint64)
        x = _mix(h[:, None] ^ self._salt[None, :])
        bits = ((x >> np.uint64(48)).astype(np.uint16) & np.uint16(0xBFFF))
        v = bits.view(np.float16)
        hd = self.heads * self.dim
        keys = np.ascontiguousarray(v[:, :hd].reshape(n, self.heads, self.dim)
                                    .transpose(1, 0, 2))[None]
        values = np.ascontiguousarray(v[:, hd:].reshape(n, self.heads, self.dim)
                                      .transpose(1, 0, 2))[None]
        return keys, values


class KVLayer:
    """What enqueue_spill reads from an mlx-lm KVCache: keys, values, offset."""

    def __init__(self, keys, values, offset: int) -> None:
        self.keys, self.values, self.offset = keys, values, offset


def check_rows(layers, keys: np.ndarray, values: np.ndarray, n: int) -> str | None:
    """None when `layers` (a promote's result) is one KV layer whose first n
    rows equal keys/values bit for bit and which holds exactly n rows; else
    what differs."""
    if layers is None or len(layers) != 1:
        return f"expected 1 layer, got {None if layers is None else len(layers)}"
    lay = layers[0]
    for name, want in (("keys", keys), ("values", values)):
        got = np.asarray(lay[name])
        if got.dtype != np.float16:
            return f"{name} dtype {got.dtype}"
        if got.shape != want.shape[:2] + (n,) + want.shape[3:]:
            return f"{name} shape {got.shape}, want {want.shape[:2] + (n,) + want.shape[3:]}"
        a = got.view(np.uint16)
        b = want[:, :, :n, :].view(np.uint16)
        if not np.array_equal(a, b):
            bad = np.argwhere(a != b)[0]
            return (f"{name} differ first at row {int(bad[2])} "
                    f"(head {int(bad[1])}, col {int(bad[3])})")
    if int(lay.get("offset", n)) != n:
        return f"offset {lay.get('offset')} != {n}"
    return None


# ---------------------------------------------------------------- the ideal

def ideal(requests: list[dict]) -> dict:
    """Infinite block cache over the requests: a block hits when its
    (position, id) chain appeared in an earlier prompt, for as many of its
    tokens as the longest earlier occurrence held; the first miss ends the
    request's hit.  Also the trace's unique KV tokens (each chain block once,
    at its longest length)."""
    node_of: dict[tuple[int, int], int] = {}
    seen_len: list[int] = []
    hit = total = 0
    for req in requests:
        total += req["length"]
        parent, hitting = -1, True
        for bid, blen in zip(req["ids"], block_lengths(req)):
            key = (parent, bid)
            node = node_of.get(key)
            if node is None:
                node = node_of[key] = len(seen_len)
                seen_len.append(0)
                hitting = False
            elif hitting:
                hit += min(blen, seen_len[node])
                hitting = seen_len[node] >= blen
            parent = node
        # Recorded after the walk: a prompt never hits on its own blocks.
        parent = -1
        for bid, blen in zip(req["ids"], block_lengths(req)):
            node = node_of[(parent, bid)]
            seen_len[node] = max(seen_len[node], blen)
            parent = node
    return {"hit_tokens": hit, "input_tokens": total, "unique_blocks": len(seen_len),
            "unique_tokens": sum(seen_len)}


# ---------------------------------------------------------------- the replay

class TraceClock:
    """Trace time in seconds since the first request, advanced by the replay
    (never by the wall clock), times `scale`: the tier's time source
    (kvtier's clock option) gets `clock.now`, so a trace of minutes can span
    the days of a daily write budget."""

    def __init__(self, scale: float = 1.0) -> None:
        self._t0: float | None = None
        self._now = 0.0
        self.scale = scale

    def advance_to(self, timestamp_ms: float) -> None:
        if self._t0 is None:
            self._t0 = timestamp_ms
        t = (timestamp_ms - self._t0) / 1000.0
        if t > self._now:           # traces may carry equal or unsorted stamps
            self._now = t

    def trace_seconds(self) -> float:
        return self._now

    def now(self) -> float:
        return self._now * self.scale


def kvtier_options(clock: TraceClock, policy: str | None, budget_per_day: int) -> dict:
    """SSDCacheConfig fields the replay sets for kvtier beyond the client's
    own: the trace clock, and the policy and write budget when given."""
    extra = {"clock": clock.now}
    if policy is not None:
        extra["admission_policy"] = policy
    if budget_per_day:
        extra["write_budget_bytes_per_day"] = int(budget_per_day)
    return extra


def make_tier(impl: str, cache_dir: str, max_size_gb: float, clock: TraceClock,
              policy: str | None = None, budget_per_day: int = 0):
    """The tier under test with the client's default configuration except the
    directory and disk budget, and for kvtier the admission policy and write
    budget when given (None / 0: the defaults), timed by `clock`.  The
    reference takes neither and no clock."""
    if impl == "kvtier":
        from kvtier.ssd_cache import SSDCacheConfig, SSDCacheTier
        tier = SSDCacheTier(SSDCacheConfig(cache_dir=cache_dir, max_size_gb=max_size_gb,
                                           **kvtier_options(clock, policy, budget_per_day)))
        tier.start_writer()
        return tier
    if impl == "reference":
        from ssd_cache_ref import SSDCacheConfig, SSDCacheTier
        return SSDCacheTier(SSDCacheConfig(cache_dir=cache_dir, max_size_gb=max_size_gb))
    raise ValueError(f"unknown implementation {impl!r}")


def drain(impl: str, tier) -> None:
    """Every accepted spill written before the next request is served."""
    if impl == "kvtier":
        tier.flush()
        return
    # The reference's writer thread is never started: its queued item is
    # written here, on this thread, by the reference's own _write_entry.
    while not tier._spill_queue.empty():
        item = tier._spill_queue.get_nowait()
        tier._write_entry(*item)


def replay(impl: str, tier, requests: list[dict], shape: KVShape, clock: TraceClock,
           promote: str = "read", on_request=None) -> dict:
    """Serves the requests in order; returns the counters.  on_request(st) runs
    after each request's spill is drained."""
    st = {"requests": 0, "input_tokens": 0, "hit_tokens": 0, "hits": 0,
          "exact_hits": 0, "rows_checked": 0, "row_mismatches": 0, "first_mismatch": None,
          "promote_failures": 0, "spills": 0, "spill_drops": 0}
    loop = asyncio.new_event_loop() if promote == "async" else None
    try:
        for req in requests:
            clock.advance_to(req["timestamp"])
            toks = prompt_tokens(req)
            prompt = tuple(int(t) for t in toks)
            keys, values = shape.rows(toks)
            st["requests"] += 1
            st["input_tokens"] += len(prompt)

            cand = tier.lookup_ssd(prompt)
            if cand is not None:
                matched, exact = len(prompt), True
            else:
                cand = tier.lookup_ssd_prefix(prompt)
                matched, exact = (int(cand["num_tokens"]), False) if cand else (0, False)
            if cand is not None and matched > 0:
                mt = prompt[:matched]
                if promote == "async":
                    layers = loop.run_until_complete(
                        tier.async_promote(mt, lambda nbytes: True, lambda nbytes: None))
                else:
                    layers = tier._read_entry(mt, cand["file_path"])
                if layers is None:
                    st["promote_failures"] += 1
                else:
                    why = check_rows(layers, keys, values, matched)
                    st["rows_checked"] += matched
                    if why is not None:
                        st["row_mismatches"] += 1
                        if st["first_mismatch"] is None:
                            st["first_mismatch"] = f"request {st['requests'] - 1}: {why}"
                    else:
                        st["hits"] += 1
                        st["exact_hits"] += exact
                        st["hit_tokens"] += matched
                        if promote != "async":
                            tier._stats.ssd_hits += 1
                            tier._index.touch(mt)
                del layers

            layer = KVLayer(keys, values, len(prompt))
            if tier.enqueue_spill(prompt, [layer], keys.nbytes + values.nbytes):
                st["spills"] += 1
            else:
                st["spill_drops"] += 1
            drain(impl, tier)
            if on_request is not None:
                on_request(st)
    finally:
        if loop is not None:
            loop.close()
    st["trace_seconds"] = clock.trace_seconds()
    return st


# ---------------------------------------------------------------- measuring

def proc_io_written() -> int | None:
    """Bytes this process had the block layer write (write_bytes) less those
    it dirtied and then truncated before writeback (cancelled_write_bytes)."""
    try:
        with open("/proc/self/io") as f:
            kv = dict(line.split(":", 1) for line in f if ":" in line)
        return int(kv["write_bytes"]) - int(kv["cancelled_write_bytes"])
    except (OSError, KeyError, ValueError):
        return None


def make_syncer(path: str):
    """A function that writes back the dirty pages of the file system holding
    path: syncfs(2) where libc has it, else sync(2) (every file system)."""
    try:
        import ctypes
        import ctypes.util
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        syncfs = libc.syncfs
    except (OSError, AttributeError):
        return os.sync
    fd = os.open(path, os.O_RDONLY)

    def sync() -> None:
        if syncfs(fd) != 0:
            os.sync()
    return sync


def disk_bytes(path: str) -> int:
    """Bytes allocated to everything under path (st_blocks, as du)."""
    total = 0
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                pass
    return total


def child_main(spec: dict) -> None:
    """One configuration in this (fresh) process; prints one JSON line."""
    requests = load_trace(spec["trace"], spec["requests"], spec["skip"])
    shape = KVShape(spec["kv_bytes_per_token"])
    clock = TraceClock(spec.get("clock_scale", 1.0))
    import kvtier.ssd_cache  # noqa: F401  (imports and library load before the baseline)
    import ssd_cache_ref  # noqa: F401
    w0 = proc_io_written()
    t0 = time.monotonic()
    os.makedirs(spec["cache_dir"], exist_ok=True)
    sync = make_syncer(spec["cache_dir"]) if spec["writeback"] == "request" else None
    each = (lambda _st: sync()) if sync else None
    if spec.get("spills", "every") == "client":
        import trace_client
        st = trace_client.replay_client(
            spec["impl"], requests, prompt_tokens, spec["kv_bytes_per_token"],
            spec["cache_dir"], spec["max_size_gb"], clock, spec["ram_prompts"],
            kvtier_options(clock, spec.get("policy"), spec.get("budget_per_day", 0)),
            on_request=each)
        ts = st.pop("tier_stats")
    else:
        tier = make_tier(spec["impl"], spec["cache_dir"], spec["max_size_gb"], clock,
                         spec.get("policy"), spec.get("budget_per_day", 0))
        try:
            st = replay(spec["impl"], tier, requests, shape, clock, spec["promote"],
                        on_request=each)
            ts = tier.get_stats()
        finally:
            tier.close()
    # The tier's own count of what it wrote, next to the kernel's: the
    # figure a portable write budget will have to go by.
    st["tier_spill_count"] = int(ts.get("spill_count", 0))
    st["tier_spill_bytes"] = int(ts.get("spill_bytes", 0))
    st["admission"] = {k: ts[k] for k in (
        "admission_admitted", "admission_truncated", "admission_declined_unseen",
        "admission_declined_budget", "admission_declined_oversize",
        "admission_tokens_declined",
        "bytes_written_today", "write_budget_left") if k in ts}
    os.sync()
    w1 = proc_io_written()
    st["seconds"] = time.monotonic() - t0
    st["device_bytes_written"] = None if w0 is None or w1 is None else w1 - w0
    st["disk_bytes"] = disk_bytes(spec["cache_dir"])
    print(json.dumps(st), flush=True)


def run_config(spec: dict) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{spec['impl']} at {spec['max_size_gb']:.4f} GiB: child exited "
                           f"{p.returncode}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=default_trace())
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--skip", type=int, default=0, help="start after this many requests")
    ap.add_argument("--budgets", default="0.25,1.0",
                    help="disk budgets as fractions of the trace's unique KV")
    ap.add_argument("--kv-bytes-per-token", type=int, default=256)
    ap.add_argument("--impl", default="kvtier,reference")
    ap.add_argument("--promote", choices=("read", "async"), default="read")
    ap.add_argument("--writeback", choices=("request", "kernel"), default="request",
                    help="sync the cache's file system after every request (default) "
                         "or leave writeback to the kernel")
    ap.add_argument("--policies", default="write_all",
                    help="kvtier admission policies to run (write_all, second_sighting, "
                         "adaptive); the first is the reference point of the ratios")
    ap.add_argument("--write-budget", type=float, default=0.0,
                    help="also run each policy under a daily write budget of this fraction "
                         "of write_all's own byte count (spill_bytes) at the same disk "
                         "budget, spread over --budget-days (0: none)")
    ap.add_argument("--budget-base", type=int, default=0,
                    help="write_all's own byte count at this disk budget from an earlier "
                         "run of the same window: --write-budget is a fraction of it and "
                         "write_all is not run again (one disk budget only)")
    ap.add_argument("--budget-days", type=float, default=1.0,
                    help="days the trace's span is stretched to by the tier's clock")
    ap.add_argument("--spills", choices=("every", "client"), default="every", help=(
        "every: each prompt is spilled (no RAM cache in front); client: vllm-mlx's "
        "MemoryAwarePrefixCache spills its LRU evictions (bench/trace_client.py)"))
    ap.add_argument("--ram-prompts", type=float, default=4.0, help=(
        "--spills client: the prefix cache's RAM budget in the window's longest prompts"))
    ap.add_argument("--dir", default=os.environ.get("KVT_BENCH_DIR", "/var/tmp"))
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        child_main(json.loads(a.child))
        return 0

    impls = [s.strip() for s in a.impl.split(",") if s.strip()]
    for i in impls:
        if i not in IMPLS:
            ap.error(f"--impl: unknown {i!r} (kvtier, reference)")
    try:
        budgets = [float(b) for b in a.budgets.split(",") if b.strip()]
    except ValueError:
        ap.error("--budgets: comma-separated numbers")
    if not budgets or any(b <= 0 for b in budgets):
        ap.error("--budgets: fractions > 0")
    if a.requests < 1 or a.skip < 0:
        ap.error("--requests must be >= 1, --skip >= 0")
    policies = [p.strip() for p in a.policies.split(",") if p.strip()]
    for p in policies:
        if p not in ("write_all", "second_sighting", "adaptive"):
            ap.error(f"--policies: unknown {p!r}")
    if not policies:
        ap.error("--policies: at least one")
    if a.write_budget < 0 or a.budget_days <= 0:
        ap.error("--write-budget must be >= 0 and --budget-days > 0")
    if a.budget_base < 0 or (a.budget_base and (not a.write_budget or len(budgets) != 1)):
        ap.error("--budget-base needs --write-budget and a single --budgets value")
    if a.write_budget and not a.budget_base and "write_all" not in policies:
        policies.insert(0, "write_all")   # the budget is a fraction of its bytes
    KVShape(a.kv_bytes_per_token)  # validates
    if a.spills == "client":
        import trace_client
        try:
            trace_client.heads_for(a.kv_bytes_per_token, 64)
        except ValueError as e:
            ap.error(str(e))
        if a.promote != "read":
            ap.error("--spills client promotes through the scheduler's synchronous path: "
                     "--promote read only")
        if not a.ram_prompts > 0:
            ap.error("--ram-prompts must be > 0")
    requests = load_trace(a.trace, a.requests, a.skip)
    if not requests:
        ap.error(f"{a.trace}: no requests after the first {a.skip}")
    ide = ideal(requests)
    unique_kv = ide["unique_tokens"] * a.kv_bytes_per_token
    ideal_rate = ide["hit_tokens"] / max(1, ide["input_tokens"])
    log = sys.stderr if a.json else sys.stdout
    print(f"# trace {os.path.basename(a.trace)}: {len(requests)} requests, "
          f"{ide['input_tokens']} input tokens, {ide['unique_blocks']} unique blocks, "
          f"unique KV {unique_kv / 2**20:.1f} MiB at {a.kv_bytes_per_token} B/token; "
          f"ideal hit rate {ideal_rate:.4f}; promote={a.promote} writeback={a.writeback} "
          f"spills={a.spills}",
          file=log, flush=True)

    span_s = max(1e-3, (requests[-1]["timestamp"] - requests[0]["timestamp"]) / 1000.0)
    results = []

    def run_one(impl: str, frac: float, policy: str | None, budget_per_day: int = 0,
                base: dict | None = None) -> dict:
        d = tempfile.mkdtemp(prefix="kvt-trace-", dir=a.dir)
        spec = {"impl": impl, "trace": a.trace, "requests": a.requests, "skip": a.skip,
                "kv_bytes_per_token": a.kv_bytes_per_token, "promote": a.promote,
                "writeback": a.writeback, "cache_dir": os.path.join(d, "cache"),
                "max_size_gb": frac * unique_kv / _GIB, "policy": policy,
                "budget_per_day": budget_per_day, "spills": a.spills,
                "ram_prompts": a.ram_prompts,
                "clock_scale": a.budget_days * 86400.0 / span_s}
        try:
            st = run_config(spec)
        finally:
            shutil.rmtree(d, ignore_errors=True)
        rate = st["hit_tokens"] / max(1, st["input_tokens"])
        wb = st["device_bytes_written"]
        row = {"impl": impl, "budget_fraction": frac, "max_size_gb": spec["max_size_gb"],
               "policy": policy, "write_budget_per_day": budget_per_day,
               "hit_rate": rate, "ideal_hit_rate": ideal_rate,
               "of_ideal": rate / ideal_rate if ideal_rate else None,
               "written_over_unique": wb / unique_kv if wb is not None and unique_kv else None,
               "hit_tokens_per_byte": st["hit_tokens"] / wb if wb else None, **st}
        if budget_per_day:
            # A leaky bucket of an hour's budget: over the span it lets through
            # the days' budget plus that hour.
            row["budget_allowance"] = budget_per_day * (a.budget_days + 1 / 24)
            row["budget_held"] = st["tier_spill_bytes"] <= row["budget_allowance"]
        if base is not None:
            row["hit_vs_write_all"] = (st["hit_tokens"] / base["hit_tokens"]
                                       if base["hit_tokens"] else None)
            bw = base["device_bytes_written"]
            row["device_written_vs_write_all"] = wb / bw if wb is not None and bw else None
            row["tier_written_vs_write_all"] = (st["tier_spill_bytes"] /
                                                base["tier_spill_bytes"]
                                                if base["tier_spill_bytes"] else None)
        results.append(row)
        name = impl if impl != "kvtier" else f"kvtier/{policy or 'default'}"
        if budget_per_day:
            name += f"+budget {budget_per_day / 2**20:.1f} MiB/day"
        rel = ""
        if base is not None:
            rel = (f"  vs write_all: hit {row['hit_vs_write_all'] or 0:.3f}x, written "
                   f"{row['device_written_vs_write_all'] or 0:.3f}x (device) "
                   f"{row['tier_written_vs_write_all'] or 0:.3f}x (own count)")
        if budget_per_day:
            rel += (f"  budget allowance {row['budget_allowance'] / 2**20:.1f} MiB "
                    f"{'held' if row['budget_held'] else 'EXCEEDED'}")
        print(f"{name:<24} budget {frac:5.2f}x  requests {st['requests']:5d}  "
              f"hit {rate:.4f} ({row['of_ideal'] or 0:.3f} of ideal)  "
              f"written {(wb or 0) / 2**20:9.1f} MiB "
              f"({row['written_over_unique'] or 0:.2f}x unique)  "
              f"on disk {st['disk_bytes'] / 2**20:8.1f} MiB  "
              f"hit tok/B {row['hit_tokens_per_byte'] or 0:.5f}  "
              f"rows {st['rows_checked']} checked, {st['row_mismatches']} bad  "
              f"drops {st['spill_drops']}  promote fails {st['promote_failures']}  "
              f"tier counted {st['tier_spill_bytes'] / 2**20:.1f} MiB  "
              f"{st['seconds']:.0f}s{rel}", file=log, flush=True)
        if "ram_hit_tokens" in st:
            both = (st["hit_tokens"] + st["ram_hit_tokens"]) / max(1, st["input_tokens"])
            row["ram_and_ssd_of_ideal"] = both / ideal_rate if ideal_rate else None
            print(f"  client: RAM {st['ram_mb']} MB, RAM hit tokens {st['ram_hit_tokens']}, "
                  f"RAM + SSD {row['ram_and_ssd_of_ideal'] or 0:.3f} of ideal, "
                  f"{st['spills'] + st['spill_drops']} spills made by the client, "
                  f"{st['budget_denied']} matches the RAM budget could not take",
                  file=log, flush=True)
        if st.get("admission"):
            print(f"  admission {st['admission']}", file=log, flush=True)
        if st["first_mismatch"]:
            print(f"  first mismatch: {st['first_mismatch']}", file=log, flush=True)
        return row

    for frac in budgets:
        for impl in impls:
            if impl != "kvtier":
                run_one(impl, frac, None)
                continue
            # One policy alone runs as the default (no option passed), the
            # figures of the configuration a user gets.
            if len(policies) == 1 and not a.write_budget and policies[0] == "write_all":
                run_one(impl, frac, None)
                continue
            base = None
            if a.budget_base:   # write_all's figures of an earlier run
                base = {"hit_tokens": 0, "device_bytes_written": None,
                        "tier_spill_bytes": a.budget_base}
            for p in policies if not a.budget_base else []:
                row = run_one(impl, frac, p, base=base)
                if p == "write_all":
                    base = row
            if a.write_budget and base is not None:
                per_day = int(a.write_budget * base["tier_spill_bytes"] / a.budget_days)
                for p in policies:
                    run_one(impl, frac, p, max(1, per_day), base=base)
    if a.json:
        print(json.dumps({"trace": a.trace, "requests": len(requests), "skip": a.skip,
                          "kv_bytes_per_token": a.kv_bytes_per_token, "promote": a.promote,
                          "writeback": a.writeback, "ideal": ide, "ideal_hit_rate": ideal_rate,
                          "policies": policies, "write_budget": a.write_budget,
                          "budget_days": a.budget_days,
                          "unique_kv_bytes": unique_kv, "results": results}, indent=1))
    bad = any(r["row_mismatches"] for r in results)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
