"""A small inference server around the upstream client code, for the
real-client tests: a deterministic "model" whose KV rows depend on the whole
prefix, filled through mlx-lm's own cache classes (update_and_fetch and
friends); vllm-mlx's MemoryAwarePrefixCache with a small RAM budget, so its own
LRU and prefix eviction spill; the scheduler's SSD methods (loader.py) for
check_ssd -> promote -> _reconstruct_ssd_layers.

Every spill the prefix cache makes is also given, unchanged, to a shadow tier
of the reference module (written synchronously), and every promote is checked
against what the same scheduler code makes of the shadow's entry: the reference's
answer for the same cache objects.  Findings are collected in Server.events and
Server.problems (a list of strings; empty when everything matched).
"""

from __future__ import annotations

import asyncio
import copy
import types
from typing import Any, Optional

import numpy as np

import loader

HEADS, DIM = 2, 64
KV_KINDS = ("kv", "chunked")  # layers whose promoted rows are model rows


_HASHES: dict = {}


def prefix_hashes(tokens: Any) -> np.ndarray:
    """h[t] depends on tokens[0..t] (all of them): a rolling hash.  Memoised
    (a decode step extends the previous step's answer by one)."""
    key = tuple(int(t) for t in tokens)
    got = _HASHES.get(key)
    if got is not None:
        return got
    head = _HASHES.get(key[:-1]) if key else None
    out = np.empty(len(key), dtype=np.int64)
    start, h = 0, 17
    if head is not None:
        out[:-1] = head
        start, h = len(key) - 1, int(head[-1]) if len(head) else 17
    for i in range(start, len(key)):
        h = (h * 1000003 + key[i] + 1) % 2147483647
        out[i] = h
    if len(_HASHES) > 4096:
        _HASHES.clear()
    _HASHES[key] = out
    return out


def model_rows(tokens: Any, start: int, stop: int, layer: int, sub: int = 0,
               dtype: Any = np.float16) -> tuple:
    """Keys and values [1, HEADS, stop-start, DIM] of positions start..stop-1."""
    h = prefix_hashes(tokens[:stop])[start:stop]
    head = np.arange(HEADS, dtype=np.int64)[:, None, None]
    d = np.arange(DIM, dtype=np.int64)[None, None, :]
    mult = d * 2 + 1 + layer * 7919 + sub * 104729 + head * 131
    x = (h[None, :, None] * mult) % 65521
    k = (x / 65521.0 - 0.5).astype(dtype)[None]
    v = ((x * 7 % 65521) / 65521.0 - 0.5).astype(dtype)[None]
    return k, v


class Model:
    """Layer specs: "kv", "rot:<max_size>:<keep>", "q4"/"q8" (mlx-lm's
    QuantizedKVCache, group_size 64), "chunked:<chunk_size>", "arrays"
    (ArraysCache of two state arrays), "list" (CacheList of a KVCache and a
    RotatingKVCache of 512)."""

    def __init__(self, client: Any, specs: list, bf16: bool = False) -> None:
        self.c = client
        self.specs = list(specs)
        self.bf16 = bf16  # KV rows in bfloat16 (MLX's usual dtype) instead of fp16
        self.config = types.SimpleNamespace(num_hidden_layers=len(specs), hidden_size=HEADS * DIM,
                                            model_type="standin-" + "-".join(specs))

    def _make(self, spec: str) -> Any:
        cm = self.c.cache
        kind, *args = spec.split(":")
        if kind == "kv":
            return cm.KVCache()
        if kind == "rot":
            return cm.RotatingKVCache(max_size=int(args[0]), keep=int(args[1]))
        if kind in ("q4", "q8"):
            return cm.QuantizedKVCache(group_size=64, bits=int(kind[1]))
        if kind == "chunked":
            return cm.ChunkedKVCache(int(args[0]))
        if kind == "arrays":
            return cm.ArraysCache(2)
        if kind == "list":
            return cm.CacheList(cm.KVCache(), cm.RotatingKVCache(max_size=512, keep=0))
        raise ValueError(spec)

    def make_cache(self) -> list:
        return [self._make(s) for s in self.specs]

    def _feed(self, layer: Any, tokens: Any, start: int, stop: int, li: int, sub: int) -> None:
        mx = self.c.mx
        cm = self.c.cache
        if isinstance(layer, cm.CacheList):
            for j, child in enumerate(layer.caches):
                self._feed(child, tokens, start, stop, li, sub + j + 1)
            return
        if isinstance(layer, cm.ArraysCache):
            h = int(prefix_hashes(tokens[:stop])[-1])
            conv = ((np.arange(3 * DIM).reshape(1, 3, DIM) * (h % 977 + li)) % 1009) / 1009.0
            ssm = ((np.arange(HEADS * 16 * 16).reshape(1, HEADS, 16, 16) * (h % 983 + li))
                   % 1013) / 1013.0
            layer[0] = mx.array(conv.astype(np.float16))
            layer[1] = mx.array(ssm.astype(np.float32))
            return
        if isinstance(layer, cm.ChunkedKVCache):
            layer.maybe_trim_front()
        k, v = model_rows(tokens, start, stop, li, sub)
        dt = mx.bfloat16 if self.bf16 else None
        layer.update_and_fetch(mx.array(k, dtype=dt), mx.array(v, dtype=dt))

    def forward(self, cache: list, tokens: Any, start: int, step: Optional[int] = None) -> None:
        """Runs positions start..len(tokens)-1 through every layer: one
        prefill call (or calls of `step` tokens), as an engine does."""
        n = len(tokens)
        step = step or max(1, n - start)
        for li, layer in enumerate(cache):
            pos = start
            while pos < n:
                end = min(n, pos + step)
                self._feed(layer, tokens, pos, end, li, 0)
                pos = end


def as_numpy(x: Any) -> np.ndarray:
    """An array's values as numpy: bf16 exactly as float32."""
    if str(getattr(x, "dtype", "")).endswith("bfloat16"):
        return np.asarray(x.astype(np.float32))
    return np.asarray(x)


def _picture(a: Any) -> tuple:
    dt = "bfloat16" if str(getattr(a, "dtype", "")).endswith("bfloat16") else str(np.asarray(a).dtype)
    v = as_numpy(a)
    return (dt, v.shape, v.tobytes())


def loaded_bytes(layers: list) -> int:
    """Bytes of the arrays the scheduler's reconstruction holds: a KVCache's
    keys and values, an ArraysCache's state arrays."""
    total = 0
    for lay in layers:
        if hasattr(lay, "keys") and hasattr(lay, "values") and not callable(lay.keys):
            total += int(lay.keys.nbytes) + int(lay.values.nbytes)
        else:
            total += sum(int(a.nbytes) for a in lay.state if a is not None)
    return total


def describe(layers: Optional[list]) -> Any:
    """A comparable picture of reconstructed layers: class, integers and
    arrays (dtype, shape, bytes)."""
    if layers is None:
        return None
    out = []
    for lay in layers:
        d: dict = {"class": type(lay).__name__}
        for a in ("offset", "max_size", "keep", "step", "_idx"):
            d[a] = getattr(lay, a, None)
        if hasattr(lay, "keys") and not callable(getattr(lay, "keys")):
            arrs = [lay.keys, lay.values]
        else:
            arrs = list(getattr(lay, "cache", []) or [])
        d["arrays"] = [None if a is None else _picture(a) for a in arrs]
        out.append(d)
    return out


def trim_description(desc: list, m: int) -> list:
    """desc of KV layers cut to their first m rows (offset m)."""
    out = []
    for d in desc:
        d = dict(d)
        arrays = []
        for item in d["arrays"]:
            dt, shape, raw = item
            a = np.frombuffer(raw, dtype=np.float32 if dt == "bfloat16" else dt)
            a = a.reshape(shape)[..., :m, :]
            arrays.append((dt, a.shape, np.ascontiguousarray(a).tobytes()))
        d["arrays"], d["offset"] = arrays, m
        out.append(d)
    return out


class Shadow:
    """The reference module's tier fed the same spills, written at once."""

    def __init__(self, ref: Any, client: Any, cache_dir: str) -> None:
        self.ref = ref
        self.tier = ref.SSDCacheTier(ref.SSDCacheConfig(cache_dir=cache_dir))
        pc = client.memory_cache.MemoryAwarePrefixCache(
            types.SimpleNamespace(), client.memory_cache.MemoryCacheConfig(max_memory_mb=4096))
        self.pc = pc
        self.sched = loader.make_scheduler_class(ref, client)(cache_dir, pc)
        self.sched._ssd_tier = self.tier
        pc.set_ssd_tier(self.tier)
        self.keys: dict = {}

    def spill(self, tokens: tuple, cache: list, memory_bytes: int) -> bool:
        ok = self.tier.enqueue_spill(tokens, cache, memory_bytes)
        if ok:
            item = self.tier._spill_queue.get_nowait()
            self.tier._write_entry(*item)
            self.keys[tuple(tokens)] = memory_bytes
        return ok

    def candidate(self, prompt: list) -> Optional[dict]:
        return self.pc.check_ssd(prompt)

    def expected(self, tokens: tuple) -> tuple:
        """(description, how): what the scheduler's reconstruction makes of
        the reference's entry for exactly these tokens ("exact"), or of the
        longest reference entry they are a prefix of, cut to them
        ("prefix-of"); (None, "none") without either."""
        hit = self.tier.lookup_ssd(tokens)
        if hit is not None:
            layers = self.tier._read_entry(tokens, hit["file_path"])
            rec = None if layers is None else self.sched._reconstruct_ssd_layers(layers)
            return describe(rec), "exact"
        longer = [k for k in self.keys if len(k) > len(tokens) and k[:len(tokens)] == tokens]
        if not longer:
            return None, "none"
        k = max(longer, key=len)
        layers = self.tier._read_entry(k, self.tier._entry_hash(k))
        rec = None if layers is None else self.sched._reconstruct_ssd_layers(layers)
        return (None if rec is None else trim_description(describe(rec), len(tokens))), "prefix-of"

    def close(self) -> None:
        self.tier.close()


class _SpillTap:
    """Stands between the prefix cache and the tier it spills into: passes
    every call on, and gives each spill to the shadow too."""

    def __init__(self, tier: Any, server: "Server") -> None:
        self._tier = tier
        self._server = server

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tier, name)

    def enqueue_spill(self, tokens: Any, cache: list, memory_bytes: int) -> bool:
        ok = self._tier.enqueue_spill(tokens, cache, memory_bytes)
        ref_ok = self._server.shadow.spill(tuple(tokens), cache, memory_bytes)
        self._server.spills.append((len(tokens), ok, ref_ok))
        if ok:
            self._server.spilled[tuple(tokens)] = memory_bytes
        if ok != ref_ok:
            self._server.problems.append(
                f"spill of {len(tokens)} tokens: kvtier {ok}, reference {ref_ok}")
        return ok


class Server:
    def __init__(self, client: Any, ssd: Any, ref: Any, model: Model, cache_dir: str,
                 shadow_dir: str, budget_mb: int, path: str,
                 overrides: Optional[dict] = None, kv_quantize: bool = False) -> None:
        mc = client.memory_cache
        self.c, self.model, self.path = client, model, path
        self.chains = not (overrides and overrides.get("chunk_tokens") == 0)
        cfg = mc.MemoryCacheConfig(max_memory_mb=budget_mb, kv_quantize=kv_quantize,
                                   kv_bits=8, kv_group_size=64, kv_min_quantize_tokens=0)
        self.pc = mc.MemoryAwarePrefixCache(model, cfg)
        self.sched = loader.make_scheduler_class(ssd, client, overrides)(cache_dir, self.pc)
        self.shadow = Shadow(ref, client, shadow_dir)
        self.events: list = []
        self.problems: list = []
        self.quantized = kv_quantize or any(sp[0] == "q" for sp in model.specs)
        self.spills: list = []
        self.spilled: dict = {}
        self.hits = self.fails = self.unrebuilt = 0
        self.n = 0
        # Every reservation the scheduler's promote paths make (a tap on the
        # prefix cache's own method; the cache's logic runs unchanged).
        self.reserved: list = []
        reserve = self.pc.try_reserve_memory

        def tapped_reserve(nbytes: int) -> bool:
            self.reserved.append(int(nbytes))
            return reserve(nbytes)

        self.pc.try_reserve_memory = tapped_reserve
        self.open()

    def open(self) -> None:
        self.sched.ensure_ssd_tier()
        self.pc.set_ssd_tier(_SpillTap(self.sched._ssd_tier, self))

    def close(self) -> None:
        self.sched.close_ssd_tier()

    def reopen(self) -> None:
        self.close()
        self.open()

    def flush(self) -> None:
        tier = self.sched._ssd_tier
        if hasattr(tier, "flush"):
            tier.flush(timeout=60)

    def _promote(self, req: Any) -> None:
        if self.path == "sync":
            self.sched.waiting = [req]
            self.sched._try_promote_ssd_pending()
            self.sched.waiting = []
        else:
            asyncio.run(self.sched.promote_from_ssd(req))

    def serve(self, prompt: list, n_gen: int = 6) -> list:
        """One request: RAM fetch; on a miss check_ssd and the promote path;
        prefill what is left; store the prompt's cache; decode n_gen tokens
        one at a time; store prompt+output (evict_prefixes=False), as
        vllm-mlx does.  Returns the generated tokens."""
        self.n += 1
        self.flush()
        cache, remaining = self.pc.fetch(prompt)
        how = "ram" if cache else "miss"
        if cache:
            cache = copy.deepcopy(cache)  # the engine's own copy
        else:
            cache = None
            cand = self.pc.check_ssd(prompt)
            if cand is not None:
                how = self._ssd(prompt, cand)
                if how == "ssd_hit":
                    cache = copy.deepcopy(self._req.prompt_cache)
                    remaining = self._req.remaining_tokens
        start = len(prompt) - len(remaining) if cache else 0
        if cache is None:
            cache = self.model.make_cache()
        try:
            self.model.forward(cache, prompt, start)
        except Exception as e:  # the engine cannot continue this cache
            self.events.append(("engine_error", len(prompt), type(e).__name__))
            cache = self.model.make_cache()
            self.model.forward(cache, prompt, 0)
        self.pc.store(list(prompt), copy.deepcopy(cache))
        out = [int(x) for x in (prefix_hashes(prompt)[-n_gen:] % 30000 + 1000)]
        full = list(prompt)
        for t in out:
            full.append(t)
            self.model.forward(cache, full, len(full) - 1)
        self.pc.store(full, cache, evict_prefixes=False)
        self.events.append((how, len(prompt)))
        return out

    def _ssd(self, prompt: list, cand: dict) -> str:
        m = cand["matched_tokens"]
        toks = tuple(prompt[:m])
        req = types.SimpleNamespace(request_id=f"req-{self.n:06d}", prompt_token_ids=list(prompt),
                                    cache_hit_type="ssd_pending", _ssd_candidate=cand,
                                    prompt_cache=None, cached_tokens=0,
                                    remaining_tokens=list(prompt))
        self._req = req
        want, how = self.shadow.expected(toks)
        ref_cand = self.shadow.candidate(prompt)
        ref_m = None if ref_cand is None else ref_cand["matched_tokens"]
        if not self.chains and ref_m != m:
            self.problems.append(f"request {self.n}: kvtier offers {m} tokens, reference {ref_m}")
        if ref_m is not None and m < ref_m:
            self.problems.append(f"request {self.n}: kvtier offers {m} < reference's {ref_m}")
        # An exact entry reports the spill's memory_bytes, as the reference's
        # does, unless it holds a quantized layer: the spill's figure is then
        # the packed size, and kvtier reports what the promote loads (dense).
        if (how == "exact" and not self.quantized
                and cand["memory_bytes"] != self.shadow.keys[toks]):
            self.problems.append(f"request {self.n}: memory_bytes {cand['memory_bytes']} for an "
                                 f"entry spilled with {self.shadow.keys[toks]}")
        before = self.pc._current_memory
        budget_ok = before + cand["memory_bytes"] <= self.pc._max_memory
        self.reserved = []
        self._promote(req)
        got = describe(req.prompt_cache) if req.cache_hit_type == "ssd_hit" else None
        self.events.append(("candidate", m, how, req.cache_hit_type, budget_ok,
                            want is not None))
        if req.cache_hit_type == "ssd_hit":
            self.hits += 1
            # The scheduler reserved memory_bytes once, and that is exactly
            # the bytes of the arrays it was handed (exact entries and chain
            # prefixes, quantized layers included: stored packed, promoted
            # dense).
            nbytes = loaded_bytes(req.prompt_cache)
            if nbytes != cand["memory_bytes"] or self.reserved != [cand["memory_bytes"]]:
                self.problems.append(f"request {self.n}: {how} candidate of {m} tokens: "
                                     f"memory_bytes {cand['memory_bytes']}, reserved "
                                     f"{self.reserved}, loaded {nbytes}")
            self._check_rows(toks, req.prompt_cache)
        elif budget_ok and self._reconstruct_fails(want, how):
            self.unrebuilt += 1  # read, then not rebuilt (the reference's too)
        elif budget_ok:
            self.problems.append(f"request {self.n}: candidate of {m} tokens ({how}) not served: "
                                 f"{req.cache_hit_type}")
        if budget_ok and want != got and not (want is None and got is None):
            self.problems.append(f"request {self.n}: promoted layers of {m} tokens differ from "
                                 f"the reference's ({how}): {_diff(want, got)}")
        if not budget_ok:
            self.fails += 1
        return req.cache_hit_type

    @staticmethod
    def _reconstruct_fails(want: Any, how: str) -> bool:
        return how != "none" and want is None

    def _check_rows(self, toks: tuple, layers: list) -> None:
        for li, (spec, lay) in enumerate(zip(self.model.specs, layers)):
            if spec.split(":")[0] not in KV_KINDS or self.pc._config.kv_quantize:
                continue
            off = lay.offset
            k, v = model_rows(list(toks), 0, off, li)
            if self.model.bf16:
                mx = self.c.mx
                k = as_numpy(mx.array(k, dtype=mx.bfloat16))
                v = as_numpy(mx.array(v, dtype=mx.bfloat16))
                if not (str(lay.keys.dtype).endswith("bfloat16") and
                        str(lay.values.dtype).endswith("bfloat16")):
                    self.problems.append(f"request {self.n}: layer {li} is not bf16 any more")
            if not (np.array_equal(as_numpy(lay.keys)[..., :off, :], k) and
                    np.array_equal(as_numpy(lay.values)[..., :off, :], v)):
                self.problems.append(f"request {self.n}: layer {li} rows differ from the model's")

    def summary(self) -> dict:
        """Counts for a report: spills (refused by kvtier / by the
        reference), candidates (served, denied by the RAM budget, not
        reconstructed by the scheduler in either), engine errors."""
        cands = [e for e in self.events if e[0] == "candidate"]
        return {
            "spills": len(self.spills),
            "refused": sum(1 for _, ok, _r in self.spills if not ok),
            "ref_refused": sum(1 for _, _o, r in self.spills if not r),
            "candidates": len(cands),
            "served": sum(1 for e in cands if e[3] == "ssd_hit"),
            "chain_prefix": sum(1 for e in cands if e[2] == "prefix-of"),
            "budget_denied": sum(1 for e in cands if not e[4]),
            "not_reconstructed": sum(1 for e in cands if e[4] and not e[5]),
            "engine_errors": sum(1 for e in self.events if e[0] == "engine_error"),
        }

    def expected_ssd_hits(self) -> int:
        """ssd_hits as the scheduler's path counts them: the sync path counts
        a hit once the layers are rebuilt (scheduler's += 1); the async path
        when the tier's promote returns them (the tier counts, rebuilt or
        not), as the reference's async_promote does."""
        return self.hits + (self.unrebuilt if self.path == "async" else 0)

    def finish(self) -> None:
        self.close()
        self.shadow.close()


def _diff(a: Any, b: Any) -> str:
    if a is None or b is None:
        return f"reference {'None' if a is None else 'layers'}, kvtier {'None' if b is None else 'layers'}"
    if len(a) != len(b):
        return f"{len(a)} vs {len(b)} layers"
    for i, (x, y) in enumerate(zip(a, b)):
        for key in x:
            if x[key] != y.get(key):
                if key == "arrays":
                    return f"layer {i}: arrays " + "; ".join(
                        f"{p[:2] if p else None} vs {q[:2] if q else None}"
                        for p, q in zip(x[key], y[key]))
                return f"layer {i}: {key} {x[key]!r} vs {y.get(key)!r}"
    return "?"
