"""Loads the upstream client code (../shared/upstream beside the repository)
for the real-client tests, with its logic unchanged:

- mlx-lm's ``mlx_lm.models.cache`` and vllm-mlx's ``vllm_mlx.memory_cache``
  are imported as they are, from the upstream directory, over the numpy MLX
  stand-in in this directory (``mlx``);
- the scheduler's SSD methods are compiled from scheduler.py's own source
  (taken out with ``ast``) into a small scheduler class, whose globals are what
  those methods use: ``mx`` (the stand-in), ``logger``, and ``SSDCacheConfig``
  / ``SSDCacheTier`` from the module under test (the ``.ssd_cache`` import of
  scheduler.py).  The scheduler's other imports (BatchGenerator, paged caches,
  sampling, ...) are not needed by these methods and are never executed.

``upstream_dir()`` is None when the directory is absent; the tests then skip
with the tag ``upstream`` (a failure in CI's strict mode).
"""

from __future__ import annotations

import ast
import functools
import logging
import os
import sys
import types
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

SCHEDULER_SSD_METHODS = ("ensure_ssd_tier", "close_ssd_tier", "_try_promote_ssd_pending",
                         "promote_from_ssd", "_reconstruct_ssd_layers")
UPSTREAM_FILES = ("vllm_mlx/memory_cache.py", "vllm_mlx/scheduler.py",
                  "mlx_lm/models/cache.py", "mlx_lm/models/base.py")


def upstream_dir() -> Optional[str]:
    """<shared>/upstream when it holds the client files, else None; <shared>
    is $KVT_SHARED_DIR or ../shared beside the repository (as for the seed)."""
    shared = os.environ.get("KVT_SHARED_DIR") or os.path.join(os.path.dirname(REPO), "shared")
    d = os.path.join(shared, "upstream")
    if all(os.path.isfile(os.path.join(d, f)) for f in UPSTREAM_FILES):
        return d
    return None


def _put_first(path: str) -> None:
    if path in sys.path:
        sys.path.remove(path)
    sys.path.insert(0, path)


def load_client() -> types.SimpleNamespace:
    """The upstream modules over the stand-in: .mx, .cache (mlx_lm's),
    .memory_cache (vllm-mlx's).  Raises RuntimeError without upstream_dir()."""
    up = upstream_dir()
    if up is None:
        raise RuntimeError("upstream client code not found")
    stale = [m for m in sys.modules if m == "mlx" or m.startswith("mlx.")]
    for m in stale:
        if not getattr(sys.modules[m], "__file__", "").startswith(HERE):
            raise RuntimeError(f"a module named {m} that is not the stand-in is loaded")
    _put_first(up)    # mlx_lm and vllm_mlx as namespace packages (no __init__ files)
    _put_first(HERE)  # the mlx stand-in
    import mlx.core as mx
    import mlx_lm.models.cache as cache
    import vllm_mlx.memory_cache as memory_cache
    for mod, rel in ((cache, "mlx_lm/models/cache.py"),
                     (memory_cache, "vllm_mlx/memory_cache.py")):
        if os.path.realpath(mod.__file__) != os.path.realpath(os.path.join(up, rel)):
            raise RuntimeError(f"{mod.__name__} was imported from {mod.__file__}, not {up}")
    return types.SimpleNamespace(mx=mx, cache=cache, memory_cache=memory_cache, dir=up)


@functools.lru_cache(maxsize=None)
def _methods_code() -> Any:
    return compile(scheduler_methods_source(),
                   os.path.join(upstream_dir() or "", "vllm_mlx", "scheduler.py"), "exec")


def scheduler_methods_source() -> str:
    """The source of the SSD methods of scheduler.py's Scheduler class, as
    written there (dedented to module level)."""
    path = os.path.join(upstream_dir() or "", "vllm_mlx", "scheduler.py")
    with open(path, encoding="utf-8") as f:
        src = f.read()
    tree = ast.parse(src)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Scheduler")
    found = {}
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                node.name in SCHEDULER_SSD_METHODS:
            found[node.name] = node
    missing = [m for m in SCHEDULER_SSD_METHODS if m not in found]
    if missing:
        raise RuntimeError(f"scheduler.py has no {missing}")
    module = ast.Module(body=[found[m] for m in SCHEDULER_SSD_METHODS], type_ignores=[])
    return ast.unparse(module)


def make_scheduler_class(ssd_module: Any, client: types.SimpleNamespace,
                         config_overrides: Optional[dict] = None) -> type:
    """A class holding the scheduler's SSD methods, bound to ssd_module
    (kvtier.ssd_cache or the reference) as scheduler.py's ``.ssd_cache``.
    config_overrides: extra SSDCacheConfig fields given on top of the two
    ensure_ssd_tier passes (e.g. chunk_tokens=0); None for its defaults."""
    cfg_cls = ssd_module.SSDCacheConfig
    if config_overrides:
        base = cfg_cls

        def cfg_cls(**kw: Any) -> Any:  # noqa: F811
            return base(**{**config_overrides, **kw})

    g = {"__name__": "vllm_mlx.scheduler", "mx": client.mx,
         "logger": logging.getLogger("vllm_mlx.scheduler"),
         "SSDCacheConfig": cfg_cls, "SSDCacheTier": ssd_module.SSDCacheTier,
         "MemoryAwarePrefixCache": client.memory_cache.MemoryAwarePrefixCache}
    exec(_methods_code(), g)  # noqa: S102 - the upstream methods, as written

    class MiniScheduler:
        """The state those methods read: config (ssd_cache_dir,
        ssd_cache_max_gb), memory_aware_cache, _ssd_tier, waiting."""

        def __init__(self, cache_dir: str, prefix_cache: Any, max_gb: float = 10.0) -> None:
            self.config = types.SimpleNamespace(ssd_cache_dir=cache_dir,
                                                ssd_cache_max_gb=max_gb)
            self.memory_aware_cache = prefix_cache
            self._ssd_tier = None
            self.waiting: list = []

    for name in SCHEDULER_SSD_METHODS:
        setattr(MiniScheduler, name, g[name])
    return MiniScheduler
