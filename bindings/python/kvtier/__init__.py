"""kvtier: a cold KV-cache tier on local SSD for LLM inference servers.

Python binding of libkvtier (ctypes + numpy only).  The drop-in replacement
for vllm-mlx's ``vllm_mlx.ssd_cache`` is :mod:`kvtier.ssd_cache`::

    from kvtier.ssd_cache import SSDCacheConfig, SSDCacheTier

The shared library is found through ``KVTIER_LIBRARY`` (a path), else the
``build/`` directory of the source checkout this package sits in, else the
prefix this package was installed into (``pip install --prefix P`` next to
``cmake --install build --prefix P``), else the system's library path;
``kvtier.library_path`` says which was loaded.

A more Pythonic interface, raising exceptions instead of returning
False/None and exposing kvtier's extras (sync and prefix promote, gc,
verify, describe, Prometheus metrics), is :class:`kvtier.Tier`.
"""

from __future__ import annotations

from . import _lib
from ._lib import (
    KvtierClosed,
    KvtierCorrupt,
    KvtierError,
    KvtierNotFound,
    LibraryNotFoundError,
    library_path,
)

from .tier import BudgetRefused, Entry, EntryInfo, QueueFull, Tier, TooBig

# The release of the package; pyproject.toml reads it, the install test checks it
# against the loaded library's kvt_version().
__version__ = "0.1.0"


def library_version() -> str:
    """Version string of the loaded libkvtier."""
    return _lib.kvt_version().decode()


def token_hash(tokens) -> str:
    """SHA-256 hex of the int32 token blob (the reference's _tokens_hash),
    computed by libkvtier."""
    import ctypes

    from ._convert import tokens_arg

    tok, n = tokens_arg(tokens)
    buf = ctypes.create_string_buffer(65)
    _lib.check(_lib.kvt_token_hash(buf, tok, n), "token_hash")
    return buf.value.decode()


def buffers(idle_cap=None, trim: bool = False) -> dict:
    """kvtier's process-wide buffer pool (snapshot copies, promoted tensors):
    optionally sets the idle cap in bytes and/or frees every idle buffer,
    then returns {"idle_bytes", "out_bytes", "idle_cap"}.  Lower the cap (or
    trim) when the engine needs the memory; raise it above 1.2 GiB for warm
    promotes of 8k-token Llama-3-8B entries."""
    import ctypes

    if idle_cap is not None:
        if idle_cap < 0:
            raise ValueError("idle_cap must be >= 0")
        _lib.check(_lib.kvt_buffers_set_idle_cap(int(idle_cap)), "buffers")
    if trim:
        _lib.kvt_buffers_trim()
    v = [ctypes.c_uint64() for _ in range(3)]
    _lib.check(_lib.kvt_buffers_stats(*(ctypes.byref(x) for x in v)), "buffers")
    return {"idle_bytes": v[0].value, "out_bytes": v[1].value, "idle_cap": v[2].value}


__all__ = [
    "Tier",
    "Entry",
    "EntryInfo",
    "QueueFull",
    "TooBig",
    "BudgetRefused",
    "KvtierError",
    "KvtierClosed",
    "KvtierCorrupt",
    "KvtierNotFound",
    "LibraryNotFoundError",
    "library_path",
    "library_version",
    "token_hash",
    "buffers",
    "__version__",
]
