#!/usr/bin/python3
"""Reads every entry of a cache directory with the reference (ssd_cache_ref,
assembled from the seed by reference_loader) and prints a JSON summary, to prove that directories
written by kvtier (compat mode) are readable by the reference.

Usage: read_ref_cache.py DIR [--quarantine]

For each index row (most recently used first) it calls the reference's
SSDCacheTier._read_entry(tokens, file_path) and reports every layer: its
keys (layer_type-dependent), and for each array the dtype, shape, the
SHA-256 of its little-endian C-order bytes and its float64 sum.  By default
the reference's quarantine on a corrupt entry is suppressed (recorded in
"errors" instead) so reading never changes the directory; --quarantine keeps
the reference's behaviour.  Exit status: 0 when every entry was read, 1 when
any failed, 2 on usage errors, 3 when the reference cannot be loaded (no seed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import reference_loader  # noqa: E402
import ssd_cache_ref as ref  # noqa: E402


def describe_array(a):
    """dtype/shape/sha256/sum of a numpy array (bytes little-endian, C order)."""
    a = np.asarray(a)
    le = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))
    return {"dtype": str(a.dtype), "shape": list(a.shape),
            "sha256": hashlib.sha256(le.tobytes()).hexdigest(),
            "sum": float(a.astype(np.float64).sum()) if a.size else 0.0}


def describe_layer(layer):
    out = {}
    for k, v in layer.items():
        if isinstance(v, np.ndarray):
            out[k] = describe_array(v)
        elif isinstance(v, list) and v and isinstance(v[0], np.ndarray):
            out[k] = [describe_array(x) for x in v]
        else:
            out[k] = v
    return out


def read_cache(cache_dir, quarantine=False):
    """Summary dict of every entry in cache_dir as the reference reads it."""
    tier = ref.SSDCacheTier(ref.SSDCacheConfig(cache_dir=cache_dir))
    errors = []
    if not quarantine:
        def _no_quarantine(tokens, relative_path):
            errors.append(relative_path)
        tier._quarantine_entry = _no_quarantine
    entries = []
    failed = 0
    try:
        for row in tier._index.all_entries():
            tokens = ref._blob_to_tokens(row["tokens_blob"])
            layers = tier._read_entry(tokens, row["file_path"])
            ent = {"token_hash": row["token_hash"], "file_path": row["file_path"],
                   "num_tokens": row["num_tokens"], "memory_bytes": row["memory_bytes"],
                   "tokens": list(tokens), "ok": layers is not None}
            if layers is None:
                failed += 1
            else:
                ent["layers"] = [describe_layer(l) for l in layers]
            entries.append(ent)
    finally:
        tier.close()
    return {"cache_dir": cache_dir, "count": len(entries), "failed": failed,
            "errors": errors, "entries": entries}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--quarantine", action="store_true",
                    help="quarantine corrupt entries as the reference does")
    args = ap.parse_args(argv)
    if not os.path.isdir(args.dir):
        print(f"read_ref_cache: {args.dir}: not a directory", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.ERROR)
    try:
        summary = read_cache(args.dir, args.quarantine)
    except reference_loader.ReferenceUnavailable as e:
        print(f"read_ref_cache: {e}", file=sys.stderr)
        return reference_loader.EXIT_UNAVAILABLE
    json.dump(summary, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
