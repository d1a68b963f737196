"""Shared pytest fixtures for the kvtier Python binding tests.

Puts the package (bindings/python) and tests/reference (the stand-ins and
the loader of the reference module) on sys.path when PYTHONPATH does not (ctest sets both and
KVTIER_LIBRARY; run by hand the build tree's library is found).  Provides
cache-directory fixtures, seeded layer factories (the duck-typed layer classes
of tests/reference/make_ref_cache.py) and small helpers.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys

import numpy as np
import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for _p in (os.path.join(_ROOT, "bindings", "python"), os.path.join(_ROOT, "tests", "reference")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import mlx_standin  # noqa: E402
from make_ref_cache import (  # noqa: E402,F401  (re-exported to the tests)
    ArraysLayer, KVLayer, QuantizedLayer, RotatingLayer)


@pytest.fixture
def cache_dir(tmp_path):
    d = tmp_path / "cache"
    return str(d)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def kv_positional(tokens, layers, heads, dim):
    """fp16 KV layers whose rows depend only on (token, position), as the
    shared part of a real model's KV does: two processes (nodes) that see the
    same prefix compute the same rows."""
    t = np.asarray(tokens, dtype=np.int64)
    n = len(t)
    seed = (t * 1000003 + np.arange(n) * 7919)[None, None, :, None]
    h = np.arange(heads)[None, :, None, None]
    d = np.arange(dim)[None, None, None, :]
    out = []
    for layer in range(layers):
        x = (seed * 31 + h * 131 + d * 17 + layer * 1009) % 65521
        keys = (x / 65521.0).astype(np.float16)
        values = (((x * 7) % 65521) / 65521.0).astype(np.float16)
        out.append(KVLayer(keys, values, n))
    return out


def kv_layer(rng, n_tokens, dtype=np.float16, heads=2, dim=16):
    shape = (1, heads, n_tokens, dim)
    if dtype == "bf16":
        return KVLayer(mlx_standin.BF16Array(rng.standard_normal(shape)),
                       mlx_standin.BF16Array(rng.standard_normal(shape)), n_tokens)
    return KVLayer(rng.standard_normal(shape).astype(dtype),
                   rng.standard_normal(shape).astype(dtype), n_tokens)


def make_tier(cache_dir, **kw):
    from kvtier.ssd_cache import SSDCacheConfig, SSDCacheTier

    kw.setdefault("durability", "none")
    # The disk path is what most tests look at (corruption, faults): the host
    # RAM tier would serve fresh spills from memory. test_ram_tier turns it on.
    kw.setdefault("host_cache_bytes", 0)
    return SSDCacheTier(SSDCacheConfig(cache_dir=cache_dir, **kw))


def run(coro):
    return asyncio.run(coro)


class Budget:
    """A RAM budget recording every reserve/release call."""

    def __init__(self, allow=True):
        self.allow = allow
        self.reserved = 0
        self.calls = []

    def reserve(self, n):
        self.calls.append(("reserve", n))
        if not self.allow:
            return False
        self.reserved += n
        return True

    def release(self, n):
        self.calls.append(("release", n))
        self.reserved -= n


__all__ = ["ArraysLayer", "KVLayer", "QuantizedLayer", "RotatingLayer", "Budget",
           "kv_layer", "make_tier", "run"]


def pytest_terminal_summary(terminalreporter):
    """One line per skipped test, in the form scripts/test.sh counts (see
    tests/testutil.h): ``SKIP(<tag>): <test>: <reason>``, the tag being the
    skip reason's ``<tag>:`` prefix (e.g. ``redis: redis-server not
    installed``); a reason without one is reported as ``untagged``."""
    for rep in terminalreporter.stats.get("skipped", []):
        lr = rep.longrepr
        reason = lr[2] if isinstance(lr, tuple) and len(lr) == 3 else str(lr)
        if reason.startswith("Skipped: "):
            reason = reason[len("Skipped: "):]
        m = re.match(r"([a-z0-9-]+): (.*)", reason, re.S)
        tag, text = (m.group(1), m.group(2)) if m else ("untagged", reason)
        terminalreporter.write_line(f"SKIP({tag}): {rep.nodeid}: {text}")
