#!/usr/bin/python3
"""Writes a cache directory with the reference (ssd_cache_ref, assembled from
the seed by reference_loader), so kvtier's CLI, C and Python tests can check
they read reference-written directories.  Data is generated from a seed; ``build_entries`` is importable
so a test can regenerate exactly what was written and compare values.

Usage: make_ref_cache.py DIR [--seed N] [--entries K] [--layers L]
                         [--kinds kv,rotating,arrays,quantized] [--bf16]
                         [--bits 4] [--group-size 32]

Layer i of every entry has kind kinds[i % len(kinds)].  Shapes are small
(keys/values [1, 2, S, 64]).  Entries share prefixes (every other entry
extends the previous one's tokens) so prefix lookups have something to find.
With --bf16, float tensors are bf16 stand-ins (mlx_standin.BF16Array), which
the reference stores as F32 with "*_original_dtype": "bfloat16" hints; for
quantized layers the scales/biases are bf16, so the reference dequantizes to
bf16, casts to F16 and records the "bfloat16" sentinel.  Spills go through
SSDCacheTier.enqueue_spill (snapshot + dequantization path) and are then
written synchronously with _write_entry (the reference's close() would stop
the writer before draining).  Prints a JSON summary (tokens, hashes) on stdout.
Exit status 3 when the reference cannot be loaded (no seed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mlx_standin  # noqa: E402
import reference_loader  # noqa: E402
import ssd_cache_ref as ref  # noqa: E402

HEADS = 2
HEAD_DIM = 64
ALL_KINDS = ("kv", "rotating", "arrays", "quantized")


class KVLayer:
    """Duck-typed mlx_lm KVCache: keys, values, offset."""

    def __init__(self, keys, values, offset):
        self.keys = keys
        self.values = values
        self.offset = offset


class RotatingLayer(KVLayer):
    """Duck-typed RotatingKVCache: + max_size, keep, step, _idx."""

    def __init__(self, keys, values, offset, max_size, keep, step, idx):
        super().__init__(keys, values, offset)
        self.max_size = max_size
        self.keep = keep
        self.step = step
        self._idx = idx


class ArraysLayer:
    """Duck-typed ArraysCache/MambaCache: a list .state."""

    def __init__(self, state):
        self.state = state


class QuantizedLayer:
    """Duck-typed mlx_lm QuantizedKVCache: keys/values are
    (packed, scales, biases) tuples, plus bits and group_size."""

    def __init__(self, keys, values, offset, bits, group_size):
        self.keys = keys
        self.values = values
        self.offset = offset
        self.bits = bits
        self.group_size = group_size


def _float(rng, shape, bf16):
    x = rng.standard_normal(shape).astype(np.float32)
    if bf16:
        return mlx_standin.BF16Array(x)
    return x.astype(np.float16)


def make_layer(rng, kind, n_tokens, bf16=False, bits=4, group_size=32):
    """One seeded layer of the given kind for an entry of n_tokens tokens."""
    if kind == "kv":
        shape = (1, HEADS, n_tokens, HEAD_DIM)
        return KVLayer(_float(rng, shape, bf16), _float(rng, shape, bf16), n_tokens)
    if kind == "rotating":
        max_size = 16
        s = min(n_tokens, max_size)
        shape = (1, HEADS, s, HEAD_DIM)
        return RotatingLayer(_float(rng, shape, bf16), _float(rng, shape, bf16),
                             n_tokens, max_size, 4, 256, s % max_size)
    if kind == "arrays":
        return ArraysLayer([_float(rng, (1, 3, 32), bf16),
                            _float(rng, (1, HEADS, 16, 8), bf16)])
    if kind == "quantized":
        # Buffer a few slots longer than offset, as mlx_lm allocates in steps,
        # so the reference's offset trim runs.
        s = n_tokens + 3
        sd = mlx_standin.bfloat16 if bf16 else np.float16
        w_k = rng.standard_normal((1, HEADS, s, HEAD_DIM)).astype(np.float32)
        w_v = rng.standard_normal((1, HEADS, s, HEAD_DIM)).astype(np.float32)
        k = mlx_standin.quantize(w_k, group_size=group_size, bits=bits, scale_dtype=sd)
        v = mlx_standin.quantize(w_v, group_size=group_size, bits=bits, scale_dtype=sd)
        return QuantizedLayer(k, v, n_tokens, bits, group_size)
    raise ValueError(f"unknown kind {kind}")


def build_entries(seed=0, entries=4, layers=2, kinds=ALL_KINDS, bf16=False,
                  bits=4, group_size=32):
    """Seeded entries: list of dicts {tokens, layers, memory_bytes}."""
    rng = np.random.default_rng(seed)
    out = []
    prev = None
    for i in range(entries):
        if prev is not None and i % 2 == 1:
            extra = [int(t) for t in rng.integers(0, 32000, size=int(rng.integers(1, 9)))]
            tokens = tuple(prev + extra)
        else:
            n = int(rng.integers(4, 24))
            tokens = tuple(int(t) for t in rng.integers(0, 32000, size=n))
        prev = list(tokens)
        lay = [make_layer(rng, kinds[j % len(kinds)], len(tokens), bf16, bits, group_size)
               for j in range(layers)]
        out.append({"tokens": tokens, "layers": lay,
                    "memory_bytes": int(rng.integers(1000, 100000))})
    return out


def write_cache(cache_dir, entries_list, max_entries=10000, max_size_gb=10.0):
    """Writes entries with the reference: enqueue_spill, then drain the queue
    synchronously through _write_entry.  Returns the summary dict."""
    cfg = ref.SSDCacheConfig(cache_dir=cache_dir, max_entries=max_entries,
                             max_size_gb=max_size_gb,
                             spill_queue_size=max(1, len(entries_list)))
    tier = ref.SSDCacheTier(cfg)
    summary = []
    try:
        for e in entries_list:
            ok = tier.enqueue_spill(e["tokens"], e["layers"], e["memory_bytes"])
            if not ok:
                raise RuntimeError("reference enqueue_spill refused an entry")
            item = tier._spill_queue.get_nowait()
            tier._write_entry(*item)
            summary.append({"tokens": list(e["tokens"]),
                            "token_hash": ref._tokens_hash(e["tokens"]),
                            "num_tokens": len(e["tokens"]),
                            "memory_bytes": e["memory_bytes"]})
        stats = tier.get_stats()
    finally:
        tier.close()
    return {"cache_dir": cache_dir, "entries": summary, "stats": stats}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--entries", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--kinds", default="kv,rotating,arrays,quantized")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--bits", type=int, default=4, choices=(2, 4, 8))
    ap.add_argument("--group-size", type=int, default=32, choices=(32, 64))
    args = ap.parse_args(argv)
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    for k in kinds:
        if k not in ALL_KINDS:
            ap.error(f"unknown kind {k!r} (known: {','.join(ALL_KINDS)})")
    ents = build_entries(args.seed, args.entries, args.layers, kinds, args.bf16,
                         args.bits, args.group_size)
    try:
        summary = write_cache(args.dir, ents)
    except reference_loader.ReferenceUnavailable as e:
        print(f"make_ref_cache: {e}", file=sys.stderr)
        return reference_loader.EXIT_UNAVAILABLE
    json.dump(summary, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
