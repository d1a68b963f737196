"""Drop-in replacement for vllm-mlx's ``vllm_mlx.ssd_cache`` backed by libkvtier.

Switch with one import::

    from kvtier.ssd_cache import SSDCacheConfig, SSDCacheTier

Every public name of the reference module is here with the same signature,
defaults, return values and exceptions: ``SSDCacheConfig``, ``SSDCacheStats``,
``SSDIndex``, ``LayerSerializer``, ``KVCacheSerializer``,
``ArraysCacheSerializer``, ``get_serializer_for_layer``,
``SERIALIZER_SUPPORT_MATRIX`` and ``SSDCacheTier``.  The work happens in C:
the spill queue and writer thread, the SQLite index, the safetensors files,
the verified reads and the async promote workers.

Differences a caller can observe, all deliberate:

- ``SSDCacheConfig`` has extra fields after the reference's (``storage_mode``
  "native" (default) or "compat", ``durability``, ``spill_queue_bytes``,
  ``promote_threads``, ``quarantine_max``, ``io_backend``, ``model_name``).
  In "native" mode bf16 tensors stay bf16 and quantized layers stay packed on
  disk (lossless, smaller); "compat" writes exactly what the reference writes
  so the reference can read the directory.  Either mode reads both, and
  reads directories written by the reference.
- Promoted layers are the reference's dicts of numpy arrays, sharing the C
  buffers (no copy).  numpy has no bfloat16: a bf16 tensor comes back as
  float32 with ``"keys_original_dtype": "bfloat16"`` (``values_...``,
  ``state_original_dtypes``), exactly the hint the reference's reload path
  already casts back from.  A quantized layer stored natively (packed on
  disk) comes back dequantized, as the reference returns it: dense
  ``keys``/``values`` of its first ``offset`` rows, so the scheduler's
  ``_reconstruct_ssd_layers`` rebuilds it as a ``KVCache``.
- ``close()`` is the reference's (newer) close: a stop sentinel queued
  behind the accepted spills and the writer joined, within one deadline of
  ``_WRITER_JOIN_TIMEOUT_S``; ``TimeoutError`` when the sentinel cannot be
  queued (nothing changed) or the writer does not stop (writer and index stay
  open, a later ``close()`` finishes).  Unlike the reference it starts a
  writer that was never started, so queued spills are written, not dropped.
  ``close(timeout=s)`` / ``aclose(timeout=s)`` are kvtier's bounded drain.
  ``enqueue_spill`` once closing returns False.
- ``_write_entry`` is called by the C writer only while it is replaced on the
  instance (or by a subclass), with an opaque ``layer_snapshots`` to pass on
  to the original; ``_spill_queue`` is a read-only view of the C queue;
  ``tier._index`` is an ``SSDIndex`` bound to the tier (no second
  connection; no ``insert_entry``/``get_lru``/``all_entries``).
- ``SSDIndex.insert_entry`` takes a ``str`` file_path without NUL characters
  and integers in [0, 2**63) (the reference binds any SQLite value).
- ``retention_seconds`` is enforced (the reference only stores it).
- ``get_stats()`` returns the reference's keys with the same rounding, plus
  kvtier's counters (``spill_drops``, ``evictions``, ...).

The full table, with the reasons: bindings/python/README.md.

The scheduler-internal attributes vllm-mlx uses work unchanged:
``tier._stats.ssd_hits += 1`` / ``tier._stats.promotion_failures += 1`` (the
increments reach the C counters and show in ``get_stats()``),
``tier._read_entry(tokens, file_path)``, ``tier._index.touch(tokens)``,
``tier._spill_queue.qsize()``.
"""

from __future__ import annotations

import array as _array
import asyncio
import ctypes
import hashlib
import json
import inspect
import logging
import os
import queue
import sqlite3
import threading
import types
import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from . import _lib as L
from ._convert import (
    _Keep,
    build_layers,
    KIND_ARRAYS,
    KIND_KV,
    KIND_QUANTIZED,
    KIND_ROTATING,
    KV_ATTRS,
    entry_to_layers,
    layer_kind,
    layer_from_snapshot,
    to_numpy_safe,
    tokens_arg,
)

__all__ = [
    "SSDCacheConfig",
    "SSDCacheStats",
    "SSDIndex",
    "LayerSerializer",
    "KVCacheSerializer",
    "ArraysCacheSerializer",
    "get_serializer_for_layer",
    "SERIALIZER_SUPPORT_MATRIX",
    "SSDCacheTier",
]

logger = logging.getLogger(__name__)

_BYTES_PER_MB = 1024 * 1024
_BYTES_PER_GB = 1024 * 1024 * 1024
_PREFIX_FILTER_TOKENS = 16

SERIALIZER_SUPPORT_MATRIX = {
    "KVCache": "supported",
    "RotatingKVCache": "supported",
    "ArraysCache": "supported",
    "MambaCache": "supported",
    "_QuantizedCacheWrapper": "supported_via_dequant_on_spill",
    "QuantizedKVCache": "supported_via_dequant_on_spill",
}

_STORAGE_MODES = {"native": L.STORAGE_NATIVE, "compat": L.STORAGE_COMPAT}
_DURABILITIES = {"fsync": L.DURABILITY_FSYNC, "none": L.DURABILITY_NONE}
_IO_BACKENDS = {"auto": L.IO_AUTO, "portable": L.IO_PORTABLE, "uring": L.IO_URING}


# --------------------------------------------------------------------------
# Config and stats
# --------------------------------------------------------------------------


@dataclass
class SSDCacheConfig:
    """Configuration for SSD cache tier.

    Attributes:
        cache_dir: Directory for SSD cache files. None = auto-detect
            (~/.cache/vllm-mlx/ssd_cache/{model}/).
        max_size_gb: Maximum total size of SSD cache in GB.
        max_entries: Maximum number of entries in SSD cache.
        file_permissions: Unix permission bits for cache data files.
        dir_permissions: Unix permission bits for cache directories.
        spill_queue_size: Max pending spill operations before dropping.
        retention_seconds: Optional max age for cache entries (None = no expiry).

    kvtier's own fields (defaults keep the reference's API behaviour):
        storage_mode: "native" (lossless bf16/quantized, default) or "compat"
            (the reference's on-disk format, readable by the reference).
        durability: "fsync" (default; published entries survive power loss)
            or "none" (the reference's: atomic rename, no fsync).
        spill_queue_bytes: bound on bytes held by queued spills (0 = none).
        promote_threads: async promote workers (>= 1).
        quarantine_max: corrupt entries kept in quarantine/ (0 = delete them).
        io_backend: "auto", "portable" or "uring".
        model_name: names the default directory when cache_dir is None
            (only used by kvtier.Tier; SSDCacheTier requires cache_dir).
        remote_url: shared remote tier, "redis://[[user]:password@]host:port"
            (user: a Redis ACL user), "rediss://..." for TLS (several
            comma-separated host:port seeds for a Redis Cluster); None
            (default) = local only.  Refused credentials or certificates
            fail the open; an unreachable server does not.
        remote_mode: "local" (default), "local+remote" (spills also go to
            the remote store asynchronously; local misses are looked up
            there) or "remote" (remote store only). Needs remote_url.
        remote_prefix: key prefix to share one store between models or
            deployments (None = "kvt:").
        remote_timeout_ms: bound on each remote connect/command.
        remote_keep_local: keep a local copy of entries promoted from the
            remote store ("local+remote" only).
        remote_lookup_timeout_ms: deadline of a lookup's round trip
            (lookup_ssd / lookup_ssd_prefix see remote entries; a miss is
            answered from a local mirror of the remote keys without I/O).
        remote_tls_ca_file, remote_tls_cert_file, remote_tls_key_file: TLS
            trust store (None = the system's) and client certificate/key
            for rediss:// URLs.
        host_cache_bytes: bytes of recently spilled/promoted entries kept in
            RAM so promoting them again runs at memory speed (the host RAM
            tier; chained entries and chunk-aligned prefixes too, and
            _read_entry uses it); None (default) = 1/8 of the memory the
            process may use (RAM and cgroup limit), 0 = disabled.
        chunk_tokens: 256 (default) or another power of two in 16..4096:
            native-mode spills are stored as chains of chunks of this many
            tokens, each stored once, and prefix lookups find chunk-aligned
            prefixes of pure-KV models even where no spill ended
            (docs/FORMAT.md section 10); 0 = one entry per spill, as the
            reference. Ignored in "compat" mode (the reference's layout).
            With remote_url, chunks are shared between nodes of the same
            model_id (docs/REMOTE.md "Chunks shared between nodes").
        model_id: namespace of the chunks; None = the cache directory's name
            (the reference's per-model directory), so two models never share
            chunks; nodes sharing a remote store share chunks only under the
            same model_id.
    """

    cache_dir: str | None = None
    max_size_gb: float = 10.0
    max_entries: int = 10000
    file_permissions: int = 0o600
    dir_permissions: int = 0o700
    spill_queue_size: int = 64
    retention_seconds: int | None = None
    storage_mode: str = "native"
    durability: str = "fsync"
    spill_queue_bytes: int = 0
    promote_threads: int = 2
    quarantine_max: int = 16
    io_backend: str = "auto"
    model_name: str | None = None
    remote_url: str | None = None
    remote_mode: str = "local"
    remote_prefix: str | None = None
    remote_timeout_ms: int = 1000
    remote_keep_local: bool = True
    remote_lookup_timeout_ms: int = 250
    remote_tls_ca_file: str | None = None
    remote_tls_cert_file: str | None = None
    remote_tls_key_file: str | None = None
    host_cache_bytes: int | None = None
    chunk_tokens: int = 256
    model_id: str | None = None

    def __post_init__(self) -> None:
        if self.max_size_gb <= 0:
            raise ValueError(f"max_size_gb must be > 0, got {self.max_size_gb}")
        if self.max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {self.max_entries}")
        if self.spill_queue_size < 1:
            raise ValueError(
                f"spill_queue_size must be >= 1, got {self.spill_queue_size}"
            )
        # kvtier's fields.
        if self.storage_mode not in _STORAGE_MODES:
            raise ValueError(
                f"storage_mode must be 'native' or 'compat', got {self.storage_mode!r}"
            )
        if self.durability not in _DURABILITIES:
            raise ValueError(
                f"durability must be 'fsync' or 'none', got {self.durability!r}"
            )
        if self.io_backend not in _IO_BACKENDS:
            raise ValueError(
                "io_backend must be 'auto', 'portable' or 'uring', "
                f"got {self.io_backend!r}"
            )
        if self.spill_queue_bytes < 0:
            raise ValueError(
                f"spill_queue_bytes must be >= 0, got {self.spill_queue_bytes}"
            )
        if self.promote_threads < 1:
            raise ValueError(
                f"promote_threads must be >= 1, got {self.promote_threads}"
            )
        if self.quarantine_max < 0:
            raise ValueError(f"quarantine_max must be >= 0, got {self.quarantine_max}")
        if self.remote_mode not in L.REMOTE_MODES:
            raise ValueError(
                "remote_mode must be 'local', 'local+remote' or 'remote', "
                f"got {self.remote_mode!r}"
            )
        if (self.remote_mode == "local") != (self.remote_url is None):
            raise ValueError(
                "remote_url and remote_mode go together: set remote_mode to "
                "'local+remote' or 'remote' with a remote_url, or neither"
            )
        if self.remote_timeout_ms < 1:
            raise ValueError(
                f"remote_timeout_ms must be >= 1, got {self.remote_timeout_ms}"
            )
        if self.host_cache_bytes is not None and self.host_cache_bytes < 0:
            raise ValueError(
                f"host_cache_bytes must be >= 0 or None, got {self.host_cache_bytes}"
            )
        if self.retention_seconds is not None and self.retention_seconds < 0:
            raise ValueError(
                f"retention_seconds must be >= 0 or None, got {self.retention_seconds}"
            )

    @property
    def max_size_bytes(self) -> int:
        """Maximum cache size in bytes."""
        return int(self.max_size_gb * _BYTES_PER_GB)

    def _to_options(self) -> tuple[L.Options, list]:
        """The kvt_options equivalent (plus the byte strings it points to,
        which must stay alive until kvt_tier_open returns)."""
        o = L.Options()
        L.check(L.kvt_options_init(ctypes.byref(o), L.KVT_OPTIONS_VERSION),
                "kvt_options_init")
        keep = []
        if self.cache_dir is not None:
            b = L.fs_path(self.cache_dir)
            keep.append(b)
            o.cache_dir = b
        if self.model_name is not None:
            b = self.model_name.encode("utf-8")
            keep.append(b)
            o.model_name = b
        o.max_size_gb = float(self.max_size_gb)
        o.max_entries = int(self.max_entries)
        o.file_mode = int(self.file_permissions)
        o.dir_mode = int(self.dir_permissions)
        o.spill_queue_size = int(self.spill_queue_size)
        o.spill_queue_bytes = int(self.spill_queue_bytes)
        o.retention_seconds = int(self.retention_seconds or 0)
        o.storage_mode = _STORAGE_MODES[self.storage_mode]
        o.durability = _DURABILITIES[self.durability]
        o.io_backend = _IO_BACKENDS[self.io_backend]
        o.promote_threads = int(self.promote_threads)
        o.quarantine_max = int(self.quarantine_max)
        L.set_remote_options(o, keep, self.remote_url, self.remote_mode,
                             self.remote_prefix, self.remote_timeout_ms,
                             self.remote_lookup_timeout_ms, self.remote_keep_local,
                             self.remote_tls_ca_file, self.remote_tls_cert_file,
                             self.remote_tls_key_file)
        if self.host_cache_bytes is not None:
            o.host_cache_bytes = int(self.host_cache_bytes)
        o.chunk_tokens = int(self.chunk_tokens)
        mid = self.model_id
        if mid is None and self.chunk_tokens and self.cache_dir is not None:
            mid = os.path.basename(os.path.normpath(str(self.cache_dir)))
        if mid is not None:
            b = mid.encode("utf-8")
            keep.append(b)
            o.model_id = b
        return o, keep


@dataclass
class SSDCacheStats:
    """Statistics for SSD cache tier — exposed from day one.

    Attributes:
        spill_count: Number of entries spilled to SSD.
        spill_bytes: Total bytes written to SSD.
        ssd_hits: Number of successful SSD cache lookups.
        ssd_misses: Number of SSD cache lookup misses.
        reload_latency_sum: Sum of reload latencies in seconds.
        reload_bytes: Total bytes read from SSD.
        promotion_failures: Number of failed promotions (RAM budget exhausted).
    """

    spill_count: int = 0
    spill_bytes: int = 0
    ssd_hits: int = 0
    ssd_misses: int = 0
    reload_latency_sum: float = 0.0
    reload_bytes: int = 0
    promotion_failures: int = 0

    def to_dict(self) -> dict:
        """Return spill, lookup, reload, and promotion statistics."""

        total_lookups = self.ssd_hits + self.ssd_misses
        hit_rate = self.ssd_hits / total_lookups if total_lookups > 0 else 0.0
        avg_latency_ms = (
            (self.reload_latency_sum / self.ssd_hits * 1000)
            if self.ssd_hits > 0
            else 0.0
        )
        return {
            "spill_count": self.spill_count,
            "spill_bytes": self.spill_bytes,
            "ssd_hits": self.ssd_hits,
            "ssd_misses": self.ssd_misses,
            "ssd_hit_rate": round(hit_rate, 4),
            "reload_latency_sum_s": round(self.reload_latency_sum, 4),
            "avg_reload_latency_ms": round(avg_latency_ms, 2),
            "reload_bytes": self.reload_bytes,
            "promotion_failures": self.promotion_failures,
        }


_REF_STAT_FIELDS = ("spill_count", "spill_bytes", "ssd_hits", "ssd_misses",
                    "reload_latency_sum", "reload_bytes", "promotion_failures")
_KVT_STAT_FIELDS = ("spill_drops", "spill_rejects", "write_failures", "evictions",
                    "expirations", "quarantined", "reconciled",
                    "promotions_cancelled", "entries", "disk_bytes",
                    "memory_bytes", "queue_depth", "queue_bytes")
# The shared remote tier's (all 0 without one); local_hits is derived.
_REMOTE_STAT_FIELDS = ("remote_hits", "remote_misses", "remote_read_bytes",
                       "remote_spill_count", "remote_spill_bytes",
                       "remote_spill_drops", "remote_errors",
                       "remote_queue_depth", "remote_available")
# The host RAM tier's (kvt_options.host_cache_bytes).
_HOST_CACHE_STAT_FIELDS = ("host_cache_bytes_used", "host_cache_bytes_bound",
                           "host_cache_entries", "host_cache_hits",
                           "host_cache_misses", "host_cache_evictions",
                           "host_cache_verify_failures", "promotes_from_ram",
                           "promote_ram_bytes", "promotes_from_disk",
                           "promote_disk_bytes")


class _CounterValue(int):
    """An int read from a live C counter that remembers how much was added to
    it since, so ``tier._stats.x += n`` becomes one atomic
    kvt_tier_stats_add(x, n) (no lost updates from C-side increments racing
    the read-modify-write)."""

    def __new__(cls, value: int, name: str, delta: int = 0) -> "_CounterValue":
        obj = int.__new__(cls, value)
        obj._name = name
        obj._delta = delta
        return obj

    def __add__(self, other: Any) -> Any:
        if isinstance(other, int) and not isinstance(other, bool):
            return _CounterValue(int(self) + other, self._name, self._delta + other)
        return int(self) + other

    __radd__ = __add__

    def __sub__(self, other: Any) -> Any:
        if isinstance(other, int) and not isinstance(other, bool):
            return _CounterValue(int(self) - other, self._name, self._delta - other)
        return int(self) - other


def _free_tier(ptr: int, keep: list) -> None:
    # keep (C callbacks the tier may still call, such as its write hook) stays
    # referenced by the finalizer until the writer thread is joined here.
    L.kvt_tier_free(ptr)
    keep.clear()


class _TierHandle:
    """Owns the kvt_tier*; freed (kvt_tier_free) when the SSDCacheTier and
    every promoted entry that references it are gone (or at once by free(),
    when the tier's __init__ fails).  ``keep`` holds the C callbacks handed
    to the tier until it is freed."""

    __slots__ = ("ptr", "keep", "_fin", "__weakref__")

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr
        self.keep: list = []
        self._fin = weakref.finalize(self, _free_tier, ptr, self.keep)

    def free(self) -> None:
        self._fin()

    def stats(self) -> L.Stats:
        s = L.Stats()
        L.check(L.kvt_tier_stats(ctypes.byref(s), self.ptr), "kvt_tier_stats")
        return s


class _TierStats:
    """``tier._stats``: the reference's SSDCacheStats fields, live from the C
    counters.  Assigning to an integer field (``+= 1`` included) adds the
    difference with kvt_tier_stats_add, so it shows in get_stats()."""

    def __init__(self, handle: _TierHandle) -> None:
        object.__setattr__(self, "_h", handle)

    def _snapshot(self) -> SSDCacheStats:
        s = self._h.stats()
        return SSDCacheStats(**{f: getattr(s, f) for f in _REF_STAT_FIELDS})

    def __getattr__(self, name: str) -> Any:
        if name in _REF_STAT_FIELDS or name in _KVT_STAT_FIELDS:
            v = getattr(self._h.stats(), name)
            if name == "reload_latency_sum":
                return float(v)
            return _CounterValue(int(v), name)
        raise AttributeError(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in _REF_STAT_FIELDS:
            raise AttributeError(f"_stats.{name} cannot be set")
        if name == "reload_latency_sum":
            raise AttributeError("_stats.reload_latency_sum is maintained by kvtier")
        if isinstance(value, _CounterValue) and value._name == name:
            delta = value._delta
        else:
            delta = int(value) - int(getattr(self._h.stats(), name))
        if delta:
            L.check(L.kvt_tier_stats_add(self._h.ptr, name.encode(), delta),
                    f"stats {name}")

    def to_dict(self) -> dict:
        """The reference's SSDCacheStats.to_dict() of the current counters."""
        return self._snapshot().to_dict()

    def __repr__(self) -> str:
        return f"_TierStats({self._snapshot()!r})"


# --------------------------------------------------------------------------
# Token helpers (the reference's module-level functions)
# --------------------------------------------------------------------------


def _tokens_to_blob(tokens: tuple[int, ...]) -> bytes:
    """Serialize token tuple to a compact binary blob for SQLite storage."""
    return _array.array("i", tokens).tobytes()


def _blob_to_tokens(blob: bytes) -> tuple[int, ...]:
    """Deserialize binary blob back to token tuple."""
    arr = _array.array("i")
    arr.frombytes(blob)
    return tuple(arr)


def _tokens_hash(tokens: tuple[int, ...]) -> str:
    """Compute SHA-256 hex digest of a token sequence for use as primary key."""
    return hashlib.sha256(_tokens_to_blob(tokens)).hexdigest()


def _prefix_hash(tokens: tuple[int, ...]) -> str:
    """Hash the bounded token prefix used to prefilter prefix lookups."""
    return _tokens_hash(tokens[:_PREFIX_FILTER_TOKENS])


# --------------------------------------------------------------------------
# SSDIndex
# --------------------------------------------------------------------------


def _row_dict(row: L.IndexRow, keys: tuple) -> dict:
    """A row of a kvt_index_rows list as the reference's dict (``file_path``
    whole, whatever its length, through kvt_index_row_file_path)."""
    d: dict = {}
    for k in keys:
        if k == "token_hash":
            d[k] = row.token_hash.decode()
        elif k == "file_path":
            d[k] = L.kvt_index_row_file_path(ctypes.byref(row)).decode("utf-8", "replace")
        elif k == "tokens_blob":
            n = int(row.n_tokens)
            d[k] = ctypes.string_at(row.tokens, n * 4) if n else b""
        else:
            d[k] = int(getattr(row, k))
    return d


_LRU_KEYS = ("token_hash", "tokens_blob", "file_path", "memory_bytes", "num_tokens")
_PREFIX_KEYS = ("token_hash", "file_path", "memory_bytes", "num_tokens")
_EXACT_KEYS = ("file_path", "memory_bytes", "num_tokens")


# Set by SSDCacheTier.__init__ around its ``SSDIndex(cache_dir)`` call (made
# through the module-level name, as the reference's, so a patched or
# subclassed SSDIndex is what the tier gets): the index constructed then is
# the tier's own, not a second connection to index.db.
_TIER_OPENING = threading.local()


class SSDIndex:
    """SQLite-backed index for SSD cache entries (libkvtier's kvt_index_*).

    Same schema as the reference (index.db opened by either program), same
    methods and return values: rows are stored and returned as given (any
    ``file_path``, any ``num_tokens``), by the reference's own SQL.  Thread
    safety: every call is serialised, as in the reference.

    The instance a tier makes for itself (``tier._index``) is bound to the
    tier instead of opening index.db a second time: lookups, touch, delete
    and the counts go through the tier (its in-memory index), and
    insert_entry/get_lru/all_entries are not available there (the C writer
    writes the tier's rows).
    """

    _SCHEMA_VERSION = 1

    def __init__(self, cache_dir: str) -> None:
        self._cache_dir = cache_dir
        self._db_lock = threading.Lock()
        self._ptr: Optional[int] = None
        tier = getattr(_TIER_OPENING, "tier", None)
        if tier is not None:
            _TIER_OPENING.tier = None  # one index per tier
            self._via: Optional[_TierIndex] = _TierIndex(tier)
            return
        self._via = None
        p = ctypes.c_void_p()
        L.check(L.kvt_index_open(ctypes.byref(p), L.fs_path(cache_dir)),
                f"open index in {cache_dir}")
        self._ptr = p.value
        self._fin = weakref.finalize(self, L.kvt_index_close, p.value)

    def _tier_only(self, what: str) -> NotImplementedError:
        return NotImplementedError(
            f"SSDIndex.{what} on a tier's own index: the tier's rows are "
            "written by its C writer; open SSDIndex(cache_dir) for the table")

    def _p(self) -> int:
        if self._ptr is None:
            raise sqlite3.ProgrammingError("Cannot operate on a closed database.")
        return self._ptr

    def _rows(self, fn: Callable, *args: Any, keys: tuple) -> list[dict]:
        rows = L.IndexRows()
        L.check(fn(ctypes.byref(rows), *args))
        try:
            return [_row_dict(rows.rows[i], keys) for i in range(rows.count)]
        finally:
            L.kvt_index_rows_free(ctypes.byref(rows))

    def insert_entry(
        self,
        tokens_key: tuple[int, ...],
        file_path: str,
        memory_bytes: int,
        num_tokens: int,
    ) -> None:
        """Insert or replace a cache entry in the index.

        As the reference, ``file_path`` is stored as given (any str) and so
        is ``num_tokens``; a tier only ever serves rows whose file_path is
        their own token hash."""
        if self._via is not None:
            raise self._tier_only("insert_entry")
        tok, n = tokens_arg(tokens_key)
        if file_path is None:  # what sqlite3 says for the NOT NULL column
            raise sqlite3.IntegrityError("NOT NULL constraint failed: entries.file_path")
        fp = str(file_path)
        if "\0" in fp:
            raise ValueError("file_path must not contain NUL characters")
        mb, nt = int(memory_bytes), int(num_tokens)
        if not (0 <= mb < 2 ** 63 and 0 <= nt < 2 ** 63):
            raise ValueError("memory_bytes and num_tokens must be in [0, 2**63)")
        with self._db_lock:
            L.check(L.kvt_index_insert(self._p(), tok, n, fp.encode("utf-8"), mb, nt),
                    "insert_entry")

    def lookup_exact(self, tokens_key: tuple[int, ...]) -> dict | None:
        """Look up an exact token sequence. Returns dict or None."""
        if self._via is not None:
            return self._via.lookup_exact(tokens_key)
        tok, n = tokens_arg(tokens_key)
        with self._db_lock:
            rows = self._rows(L.kvt_index_get, self._p(), tok, n, keys=_EXACT_KEYS)
        return rows[0] if rows else None

    def lookup_prefix(self, query_tokens: tuple[int, ...]) -> list[dict]:
        """Find entries whose token sequence is a prefix of query_tokens.

        Returns list of dicts sorted by num_tokens descending (longest prefix first).
        On a tier's own index: the longest stored prefix only (0 or 1 dicts).
        """
        if self._via is not None:
            return self._via.lookup_prefix(query_tokens)
        tok, n = tokens_arg(query_tokens)
        if n == 0:
            return []
        with self._db_lock:
            return self._rows(L.kvt_index_lookup_prefix, self._p(), tok, n,
                              keys=_PREFIX_KEYS)

    def delete_entry(self, tokens_key: tuple[int, ...], *,
                     cache_salt: str | bytes | None = None) -> None:
        """Delete an entry by token sequence (a tier's own: files and row).
        cache_salt (kvtier's): the tier's entry spilled under it (a salted
        entry is deleted only with its salt; a standalone SSDIndex has no
        salted rows)."""
        if self._via is not None:
            return self._via.delete_entry(tokens_key, cache_salt=cache_salt)
        if cache_salt is not None:
            raise ValueError("cache_salt needs a tier's index (SSDCacheTier._index)")
        tok, n = tokens_arg(tokens_key)
        with self._db_lock:
            rc = L.kvt_index_delete(self._p(), tok, n)
        if rc != L.KVT_ENOTFOUND:
            L.check(rc, "delete_entry")

    def get_lru(self, limit: int = 10) -> list[dict]:
        """Get the least recently used entries, ordered oldest first."""
        if self._via is not None:
            raise self._tier_only("get_lru")
        # SQLite's LIMIT with a negative value means "no limit".
        lim = int(limit) if limit >= 0 else (1 << 62)
        with self._db_lock:
            return self._rows(L.kvt_index_lru, self._p(), lim, keys=_LRU_KEYS)

    def get_total_bytes(self) -> int:
        """Get total memory_bytes across all entries."""
        if self._via is not None:
            return self._via.get_total_bytes()
        v = ctypes.c_uint64()
        with self._db_lock:
            L.check(L.kvt_index_total_bytes(ctypes.byref(v), self._p()))
        return int(v.value)

    def get_entry_count(self) -> int:
        """Get number of entries in the index."""
        if self._via is not None:
            return self._via.get_entry_count()
        v = ctypes.c_uint64()
        with self._db_lock:
            L.check(L.kvt_index_count(ctypes.byref(v), self._p()))
        return int(v.value)

    def touch(self, tokens_key: tuple[int, ...], *,
              cache_salt: str | bytes | None = None) -> None:
        """Update accessed_at timestamp for an entry (marks as recently used).
        cache_salt (kvtier's): the tier's entry spilled under it (a
        standalone SSDIndex has no salted rows)."""
        if self._via is not None:
            return self._via.touch(tokens_key, cache_salt=cache_salt)
        if cache_salt is not None:
            raise ValueError("cache_salt needs a tier's index (SSDCacheTier._index)")
        tok, n = tokens_arg(tokens_key)
        with self._db_lock:
            rc = L.kvt_index_touch(self._p(), tok, n)
        if rc != L.KVT_ENOTFOUND:
            L.check(rc, "touch")

    def all_entries(self) -> list[dict]:
        """Return all entries (for startup reconciliation)."""
        if self._via is not None:
            raise self._tier_only("all_entries")
        with self._db_lock:
            return self._rows(L.kvt_index_all, self._p(), keys=_LRU_KEYS)

    def close(self) -> None:
        """Close the SQLite connection (a tier's own index: nothing; the
        tier closes it)."""
        with self._db_lock:
            if self._ptr is not None:
                self._ptr = None
                self._fin()


class _TierIndex:
    """What ``tier._index`` (an SSDIndex bound to its tier) does: the calls
    vllm-mlx makes past the public API (``touch``) and read-only helpers,
    through the tier (kvt_tier_*), so it sees the tier's in-memory state."""

    def __init__(self, tier: "SSDCacheTier") -> None:
        self._tier = weakref.proxy(tier)

    def touch(self, tokens_key: tuple[int, ...], *,
              cache_salt: str | bytes | None = None) -> None:
        """Update accessed_at timestamp for an entry (marks as recently used);
        cache_salt: the entry spilled under it."""
        tok, n = tokens_arg(tokens_key)
        co, keep = L.call_opts(cache_salt)
        rc = L.kvt_tier_touch_ex(self._tier._h.ptr, tok, n, co)
        del keep
        if rc != L.KVT_ENOTFOUND:
            L.check(rc, "touch")

    def lookup_exact(self, tokens_key: tuple[int, ...]) -> dict | None:
        """As SSDIndex.lookup_exact."""
        return self._tier.lookup_ssd(tokens_key)

    def lookup_prefix(self, query_tokens: tuple[int, ...]) -> list[dict]:
        """The longest stored prefix only (kvtier's lookup), as a 0/1-list."""
        r = self._tier.lookup_ssd_prefix(query_tokens)
        return [r] if r is not None else []

    def delete_entry(self, tokens_key: tuple[int, ...], *,
                     cache_salt: str | bytes | None = None) -> None:
        """Remove the entry (files and row); cache_salt: the entry spilled
        under it (a salted entry is removed only with its salt)."""
        tok, n = tokens_arg(tokens_key)
        co, keep = L.call_opts(cache_salt)
        rc = L.kvt_tier_remove_ex(self._tier._h.ptr, tok, n, co)
        del keep
        if rc != L.KVT_ENOTFOUND:
            L.check(rc, "delete_entry")

    def get_entry_count(self) -> int:
        return int(self._tier._h.stats().entries)

    def get_total_bytes(self) -> int:
        return int(self._tier._h.stats().memory_bytes)


# --------------------------------------------------------------------------
# Serializers
# --------------------------------------------------------------------------


class LayerSerializer(ABC):
    """Interface for per-layer cache serialization.

    Spill is split across two threads: ``snapshot_layer`` runs on the
    producer (request handler) thread and copies the layer into numpy;
    ``serialize_layer`` then writes it (here through kvt_layer_save).
    """

    @abstractmethod
    def snapshot_layer(self, layer: Any) -> dict[str, Any]:
        """Producer-thread CPU snapshot of an MLX-backed cache layer."""
        ...

    @abstractmethod
    def serialize_layer(
        self, snapshot: dict[str, Any], layer_idx: int, file_path: str
    ) -> dict[str, Any]:
        """Writer-thread: persist a snapshot to safetensors at file_path.

        Returns metadata dict with at least 'layer_type'.
        """
        ...

    @abstractmethod
    def deserialize_layer(self, file_path: str, metadata: dict[str, Any]) -> dict:
        """Read a layer back from disk. Returns layer-state dict."""
        ...


def _mx_to_numpy_safe(arr: Any) -> tuple[np.ndarray, str | None]:
    """mx.array → np.ndarray, upcasting numpy-unsupported dtypes (bf16) to fp32.

    Returns (numpy_array, original_dtype_name_or_None).
    """
    return to_numpy_safe(arr)


def _save_snapshot(snapshot: dict[str, Any], layer_idx: int, file_path: str) -> dict:
    keep = _Keep()
    lay = layer_from_snapshot(snapshot, keep)
    meta = ctypes.c_void_p()
    L.check(L.kvt_layer_save(ctypes.byref(meta), L.fs_path(file_path),
                             ctypes.byref(lay), int(layer_idx), L.STORAGE_COMPAT,
                             0o600), f"save {file_path}")
    try:
        return json.loads(ctypes.string_at(meta.value).decode("utf-8"))
    finally:
        L.kvt_free(meta.value)


def _load_layer(file_path: str, metadata: dict[str, Any]) -> dict:
    out = ctypes.c_void_p()
    L.check(L.kvt_layer_load(ctypes.byref(out), L.fs_path(file_path),
                             json.dumps(metadata).encode("utf-8")),
            f"load {file_path}")
    return entry_to_layers(out.value)[0]


class KVCacheSerializer(LayerSerializer):
    """Serializer for KVCache and RotatingKVCache layers.

    Handles layers with .keys, .values, .offset attributes.
    RotatingKVCache also has .max_size, .keep, .step, ._idx.
    """

    _ROTATING_ATTRS = KV_ATTRS

    def snapshot_layer(self, layer: Any) -> dict[str, Any]:
        """Copy a KV cache layer into NumPy-backed writer-thread data."""
        snap: dict[str, Any] = {}
        for side in ("keys", "values"):
            arr, upcast_from = _mx_to_numpy_safe(getattr(layer, side))
            snap[side + "_np"] = arr
            # A spill that already cast bf16 down leaves its own note on the
            # layer; it outranks what the conversion saw.
            hint = getattr(layer, f"_ssd_{side}_original_dtype", None) or upcast_from
            if hint is not None:
                snap[side + "_original_dtype"] = hint
        # Reference key order: arrays, offset, hints, then the KV integers.
        ordered = {"keys_np": snap["keys_np"], "values_np": snap["values_np"],
                   "offset": layer.offset}
        for k in ("keys_original_dtype", "values_original_dtype"):
            if k in snap:
                ordered[k] = snap[k]
        ordered.update((a, getattr(layer, a)) for a in KV_ATTRS if hasattr(layer, a))
        return ordered

    def serialize_layer(
        self, snapshot: dict[str, Any], layer_idx: int, file_path: str
    ) -> dict[str, Any]:
        """Write one KV layer to safetensors and return reconstruction metadata."""
        return _save_snapshot(snapshot, layer_idx, file_path)

    def deserialize_layer(self, file_path: str, metadata: dict[str, Any]) -> dict:
        """Load one KV layer as arrays plus cache reconstruction metadata."""
        return _load_layer(file_path, metadata)


class ArraysCacheSerializer(LayerSerializer):
    """Serializer for ArraysCache (Mamba/linear attention) layers.

    Handles layers with .state attribute containing a list of arrays.
    """

    def snapshot_layer(self, layer: Any) -> dict[str, Any]:
        """Copy an arrays-cache state into NumPy-backed writer-thread data."""
        pairs = [_mx_to_numpy_safe(a) for a in layer.state]
        snap: dict[str, Any] = {"state_np": [arr for arr, _ in pairs]}
        hints = [hint for _, hint in pairs]
        if any(h is not None for h in hints):  # only when some array was upcast
            snap["state_original_dtypes"] = hints
        return snap

    def serialize_layer(
        self, snapshot: dict[str, Any], layer_idx: int, file_path: str
    ) -> dict[str, Any]:
        """Write arrays-cache state to safetensors and return its metadata."""
        return _save_snapshot(snapshot, layer_idx, file_path)

    def deserialize_layer(self, file_path: str, metadata: dict[str, Any]) -> dict:
        """Load arrays-cache state and any original dtype hints."""
        return _load_layer(file_path, metadata)


def get_serializer_for_layer(layer: Any) -> LayerSerializer:
    """Return the appropriate serializer for a cache layer.

    KV layers of every kind (plain, windowed, packed) get the KV serializer,
    layers whose state is a list the arrays serializer; the classification is
    kvtier._convert.layer_kind's.

    Raises ValueError for unsupported layer types.
    """
    try:
        kind = layer_kind(layer)
    except ValueError:
        kind = None
    if kind == KIND_QUANTIZED and not hasattr(layer, "offset"):
        kind = KIND_ARRAYS if isinstance(getattr(layer, "state", None), list) else None
    if kind in (KIND_KV, KIND_ROTATING, KIND_QUANTIZED):
        return KVCacheSerializer()
    if kind == KIND_ARRAYS:
        return ArraysCacheSerializer()
    raise ValueError(
        f"Unsupported cache layer type: {type(layer).__name__}. "
        f"Supported: {list(SERIALIZER_SUPPORT_MATRIX.keys())}"
    )


# --------------------------------------------------------------------------
# The tier
# --------------------------------------------------------------------------


class _Budget:
    """C callbacks around the caller's reserve/release functions.  Must stay
    alive until the promise is freed (release may run then)."""

    def __init__(self, reserve_fn: Callable[[int], bool],
                 release_fn: Callable[[int], None]) -> None:
        self.reserve_fn = reserve_fn
        self.release_fn = release_fn
        self.exc: Optional[BaseException] = None
        self.c_reserve = L.RESERVE_FN(self._reserve)
        self.c_release = L.RELEASE_FN(self._release)

    def _reserve(self, _ctx: Any, nbytes: int) -> int:
        try:
            return 1 if self.reserve_fn(int(nbytes)) else 0
        except BaseException as e:  # re-raised by async_promote
            self.exc = e
            return 0

    def _release(self, _ctx: Any, nbytes: int) -> None:
        try:
            self.release_fn(int(nbytes))
        except BaseException:
            logger.exception("[ssd_cache] release_budget_fn raised")

    def opts(self) -> L.PromoteOpts:
        o = L.PromoteOpts()
        L.check(L.kvt_promote_opts_init(ctypes.byref(o), L.KVT_PROMOTE_OPTS_VERSION))
        o.reserve = self.c_reserve
        o.release = self.c_release
        return o


class _WriterInfo:
    """Stands in for the reference's ``_writer_thread`` (a threading.Thread):
    kvtier's writer is a C thread; this reports its name and liveness."""

    name = "ssd-cache-writer"
    daemon = True

    def __init__(self, tier: "SSDCacheTier") -> None:
        self._tier = weakref.ref(tier)

    def is_alive(self) -> bool:
        t = self._tier()
        return t is not None and not t._closed

    def __repr__(self) -> str:
        return f"<kvtier writer {'alive' if self.is_alive() else 'stopped'}>"


class _SpillQueue:
    """``tier._spill_queue``: the reference's ``queue.Queue`` as far as
    watching it goes - ``qsize()``, ``empty()``, ``full()`` and ``maxsize`` -
    over the C queue's live counters (the spills waiting, not the one being
    written; close's stop marker counts while queued, as the reference's
    None sentinel).  Spills go in through enqueue_spill only."""

    def __init__(self, handle: _TierHandle, maxsize: int) -> None:
        self._h = handle
        self.maxsize = maxsize

    def qsize(self) -> int:
        return int(self._h.stats().queue_depth)

    def empty(self) -> bool:
        return self.qsize() == 0

    def full(self) -> bool:
        return 0 < self.maxsize <= self.qsize()

    def __repr__(self) -> str:
        return f"<kvtier spill queue {self.qsize()}/{self.maxsize}>"


class _PendingSpill:
    """The ``layer_snapshots`` a replaced ``_write_entry`` receives: the C
    snapshot of the spill the writer is handing over (kvtier's snapshots
    live in C, not as numpy dicts).  Opaque: pass it on to the original
    ``_write_entry`` to write the spill; valid until the replacement
    returns."""

    __slots__ = ("spill_id",)

    def __init__(self, spill_id: int) -> None:
        self.spill_id = spill_id

    def __repr__(self) -> str:
        return f"<kvtier pending spill {self.spill_id}>"


def _write_hook(ref: "weakref.ref[SSDCacheTier]") -> Callable:
    """The C writer's hook for one tier (installed only while its
    _write_entry is replaced): calls the tier's _write_entry on the writer
    thread, with no tier lock held, and maps an exception to a KVT_E* code
    (logged, as the reference's writer loop logs and carries on)."""

    def hook(_ctx: Any, spill_id: int, tokens: Any, n: int, memory_bytes: int) -> int:
        tier = ref()
        if tier is None:
            return L.KVT_ECLOSED
        tier._hook_calls += 1
        toks = tuple(tokens[:n]) if n else ()
        try:
            tier._write_entry(toks, _PendingSpill(spill_id), int(memory_bytes))
            return 0
        except BaseException as e:  # noqa: BLE001 - the writer must carry on
            logger.exception(f"[ssd_cache] failed to write entry ({n} tokens)")
            code = getattr(e, "code", None)
            return code if isinstance(code, int) and code < 0 else L.KVT_EIO

    return hook


class _ReplaceableWriteEntry:
    """``SSDCacheTier._write_entry``: reading it on an instance gives the
    replacement set on that instance, else the bound method; setting or
    deleting it on an instance (``monkeypatch.setattr(tier, "_write_entry",
    f)`` and its undo) installs or removes the C writer's hook for that tier,
    so the C writer calls out to Python only while a replacement is set."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None:
            return self.fn
        ov = obj.__dict__.get("_write_entry_replacement")
        return ov if ov is not None else types.MethodType(self.fn, obj)

    def __set__(self, obj: Any, value: Any) -> None:
        default = (isinstance(value, types.MethodType) and value.__func__ is self.fn
                   and value.__self__ is obj)
        obj.__dict__["_write_entry_replacement"] = None if default else value
        obj._sync_write_hook()

    def __delete__(self, obj: Any) -> None:
        obj.__dict__["_write_entry_replacement"] = None
        obj._sync_write_hook()


class SSDCacheTier:
    """Cold-tier disk cache for KV cache entries, backed by libkvtier.

    Directory layout (identical to the reference's)::

        cache_dir/
          index.db           # SQLite metadata index
          data/              # safetensors files per entry
            {hash}/          # one directory per entry
              layer_0.safetensors ...
              manifest.json  # per-entry layer metadata
              tokens.bin

    Typical use::

        tier = SSDCacheTier(SSDCacheConfig(cache_dir="/path"))
        tier.start_writer()
        tier.enqueue_spill(tokens, cache_layers, memory_bytes)   # -> bool
        meta = tier.lookup_ssd(tokens)                            # dict | None
        layers = await tier.async_promote(tokens, reserve, release)
        tier.close()

    Thread-safe: spills, lookups and promotes may come from any thread.
    """

    def __init__(self, config: SSDCacheConfig) -> None:
        """Opens (creating when missing) config.cache_dir and its index.  The
        writer is not started (call start_writer(), as with the reference).

        Raises:
            ValueError: cache_dir is None, or an option libkvtier refuses.
            OSError: the directory cannot be created or used (PermissionError
                semantics for a directory owned by someone else or writable
                by group/others; another process holding it for writing).
            sqlite3.DatabaseError: index.db is unusable.
        """
        self._config = config
        self._closed = True
        self._closing = False
        self._writer_thread: Any = None
        self._hook_calls = 0  # calls of the write hook (replaced _write_entry)

        if config.cache_dir is None:
            raise ValueError("SSDCacheConfig.cache_dir must be set")

        self._cache_dir = config.cache_dir
        self._data_dir = os.path.join(self._cache_dir, "data")

        # The reference creates parents too; kvtier then checks ownership and
        # permissions of the leaf.
        os.makedirs(self._cache_dir, mode=config.dir_permissions, exist_ok=True)

        opts, keep = config._to_options()
        p = ctypes.c_void_p()
        rc = L.kvt_tier_open(ctypes.byref(p), ctypes.byref(opts))
        del keep
        L.check(rc, f"open {self._cache_dir}")
        self._h = _TierHandle(p.value)
        self._c_write_hook = L.WRITE_HOOK_FN(_write_hook(weakref.ref(self)))
        self._h.keep.append(self._c_write_hook)
        # The reference's setup steps, through the same module-level names
        # (tests patch SSDIndex and queue.Queue to make one fail): on failure
        # the index is closed and the original error re-raised.
        try:
            _TIER_OPENING.tier = self  # SSDIndex(...) binds to this tier
            try:
                self._index = SSDIndex(self._cache_dir)
            finally:
                _TIER_OPENING.tier = None
            self._stats = _TierStats(self._h)
            self._lock = threading.Lock()
            q = queue.Queue(maxsize=config.spill_queue_size)
            self._spill_queue = _SpillQueue(self._h, q.maxsize)
            self._closed = False
        except Exception:
            index = getattr(self, "_index", None)
            if index is not None:
                try:
                    index.close()
                except Exception:
                    logger.exception(
                        "ssd_cache: failed to close index during init cleanup"
                    )
            self._h.free()  # the C tier (its index connection, the lock file)
            raise

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("closing" if self._closing else "open")
        return (f"<kvtier.ssd_cache.SSDCacheTier {self._cache_dir!r} "
                f"{self._config.storage_mode} {state}>")

    @staticmethod
    def _entry_hash(tokens: tuple[int, ...]) -> str:
        """Compute deterministic hash for a token sequence."""
        return _tokens_hash(tokens)

    def get_stats(self) -> dict:
        """Return current SSD cache statistics: the reference's keys (same
        rounding) followed by kvtier's counters."""
        s = self._h.stats()
        d = SSDCacheStats(**{f: getattr(s, f) for f in _REF_STAT_FIELDS}).to_dict()
        for f in _KVT_STAT_FIELDS:
            d[f] = int(getattr(s, f))
        d["local_hits"] = max(0, int(s.ssd_hits) - int(s.remote_hits))
        for f in _REMOTE_STAT_FIELDS:
            d[f] = int(getattr(s, f))
        d["remote_latency_sum_s"] = round(float(s.remote_latency_sum), 4)
        for f in _HOST_CACHE_STAT_FIELDS:
            d[f] = int(getattr(s, f))
        return d

    def start_writer(self) -> None:
        """Start the background spill writer thread (idempotent)."""
        if self._writer_thread is not None:
            return
        self._sync_write_hook()
        L.check(L.kvt_tier_start_writer(self._h.ptr), "start_writer")
        self._writer_thread = _WriterInfo(self)
        logger.info("[ssd_cache] writer thread started")

    def enqueue_spill(
        self,
        tokens: tuple[int, ...],
        cache: list[Any],
        memory_bytes: int,
        *,
        cache_salt: str | bytes | None = None,
    ) -> bool:
        """Enqueue a cache entry for async spill to SSD.

        cache_salt (kvtier's; str or bytes): a per-request namespace (vLLM's
        ``cache_salt``): the entry is then found, promoted, read and touched
        only by calls given the same cache_salt, and its chunks are never
        shared with other salts (or none).

        The layers are copied before this returns; the caller may reuse them.
        Layers: ``.keys/.values/.offset`` (+ ``max_size, keep, step, _idx``),
        a list ``.state``, or quantized ``(packed, scales, biases)`` tuples
        with ``bits``/``group_size``; numpy arrays, bf16 arrays, or anything
        numpy.asarray accepts.

        Returns True if enqueued, False if the entry was dropped (queue full,
        entry too big, unsupported layer, tier closed).
        """
        if self._closed or self._closing:
            return False
        try:
            tok, n = tokens_arg(tokens)
            if memory_bytes < 0:
                raise ValueError(f"memory_bytes must be >= 0, got {memory_bytes}")
            co, salt_keep = L.call_opts(cache_salt)
            layers, nl, keep = build_layers(cache)
        except Exception:
            logger.exception(
                "[ssd_cache] failed to snapshot layers for spill "
                f"({len(tokens)} tokens) — entry dropped"
            )
            return False
        rc = L.kvt_tier_spill_ex(self._h.ptr, tok, n, layers, nl, int(memory_bytes), co)
        del keep, salt_keep
        if rc == 0:
            return True
        if rc == L.KVT_EFULL:
            logger.warning(
                f"[ssd_cache] spill queue full, dropping entry "
                f"({len(tokens)} tokens, {memory_bytes} bytes)"
            )
        elif rc != L.KVT_ECLOSED:
            logger.warning(f"[ssd_cache] spill refused ({len(tokens)} tokens): "
                           f"{L.last_error() or L.strerror(rc)}")
        return False

    def _write_entry(
        self,
        tokens_key: tuple[int, ...],
        layer_snapshots: Any,
        memory_bytes: int,
    ) -> None:
        """Atomically persist one entry (writer thread), as the reference's.

        kvtier's C writer writes spills itself and calls this only while it
        is replaced on the instance (``tier._write_entry = f``, or
        monkeypatch): it then hands each spill to the replacement on the
        writer thread, with no tier lock held (a blocked replacement stalls
        neither promotes nor quarantine), and the replacement may call this
        original with the arguments it got to write the spill.
        ``layer_snapshots`` is then a _PendingSpill (the C snapshot), not the
        reference's list of (serializer, snapshot) pairs.

        Raises:
            TypeError: layer_snapshots is not what the writer handed over.
            ValueError: that spill is no longer in the replacement's hands.
            OSError and the other kvtier errors: the write failed.
        """
        if not isinstance(layer_snapshots, _PendingSpill):
            raise TypeError("layer_snapshots must be the value the writer passed to "
                            "_write_entry (kvtier's snapshots live in C)")
        L.check(L.kvt_tier_write_pending(self._h.ptr, layer_snapshots.spill_id),
                "_write_entry")

    _write_entry = _ReplaceableWriteEntry(_write_entry)  # type: ignore[assignment]

    def _sync_write_hook(self) -> None:
        """Installs the C writer's hook while _write_entry is replaced (on
        the instance, by a subclass, or on the class), removes it otherwise."""
        if "_h" not in self.__dict__ or self._closed:
            return
        static = inspect.getattr_static(type(self), "_write_entry")
        replaced = (not isinstance(static, _ReplaceableWriteEntry) or
                    self.__dict__.get("_write_entry_replacement") is not None)
        fn = self._c_write_hook if replaced else L.WRITE_HOOK_FN()
        rc = L.kvt_tier_set_write_hook(self._h.ptr, fn, None)
        if rc != L.KVT_ECLOSED:  # closing meanwhile: no writer to hook
            L.check(rc, "write hook")

    def lookup_ssd(self, tokens: tuple[int, ...], *,
                   cache_salt: str | bytes | None = None) -> dict | None:
        """Synchronous check whether tokens exist in SSD tier.

        Fast: an in-memory index lookup, no disk I/O.

        Returns:
            Dict with entry metadata (file_path, memory_bytes, num_tokens)
            if found, None otherwise.
        """
        tok, n = tokens_arg(tokens)
        co, keep = L.call_opts(cache_salt)
        info = L.EntryInfo()
        rc = L.kvt_tier_lookup_ex(ctypes.byref(info), self._h.ptr, tok, n, co)
        del keep
        if rc == L.KVT_ENOTFOUND:
            return None
        L.check(rc, "lookup_ssd")
        return {
            "file_path": info.token_hash.decode(),
            "memory_bytes": int(info.memory_bytes),
            "num_tokens": int(info.num_tokens),
        }

    def lookup_ssd_prefix(self, tokens: tuple[int, ...], *,
                          cache_salt: str | bytes | None = None) -> dict | None:
        """Find the longest prefix match in the SSD tier.

        Returns the longest-prefix entry metadata (token_hash, file_path,
        memory_bytes, num_tokens) or None.
        """
        tok, n = tokens_arg(tokens)
        if n == 0:
            return None
        co, keep = L.call_opts(cache_salt)
        info = L.EntryInfo()
        rc = L.kvt_tier_lookup_prefix_ex(ctypes.byref(info), self._h.ptr, tok, n, co)
        del keep
        if rc == L.KVT_ENOTFOUND:
            return None
        L.check(rc, "lookup_ssd_prefix")
        h = info.token_hash.decode()
        return {
            "token_hash": h,
            "file_path": h,
            "memory_bytes": int(info.memory_bytes),
            "num_tokens": int(info.num_tokens),
        }

    async def _wait_promise(self, promise: int) -> None:
        loop = asyncio.get_running_loop()
        fd = L.kvt_promise_fd(promise)
        if fd >= 0:
            fut = loop.create_future()

            def _ready() -> None:
                if not fut.done():
                    fut.set_result(None)

            try:
                loop.add_reader(fd, _ready)
            except (NotImplementedError, RuntimeError):
                pass
            else:
                try:
                    await fut
                finally:
                    loop.remove_reader(fd)
                return
        # Event loops without add_reader: poll without blocking the loop.
        delay = 0.0005
        while L.kvt_promise_wait(promise, 0) == L.KVT_ETIMEDOUT:
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.01)

    async def async_promote(
        self,
        tokens: tuple[int, ...],
        reserve_budget_fn: Callable[[int], bool],
        release_budget_fn: Callable[[int], None],
        *,
        cache_salt: str | bytes | None = None,
    ) -> list | None:
        """Promote an entry from SSD to RAM asynchronously.

        CRITICAL: Reserves RAM budget BEFORE the disk read, to avoid
        thrash when multiple promotions race.

        Args:
            tokens: Token sequence to promote.
            reserve_budget_fn: Callable(nbytes) -> bool. Must return True
                if budget is available and reserved, False otherwise. Called
                on this (the event loop's) thread before any data is read.
            release_budget_fn: Callable(nbytes) -> None. Called (on this
                thread) to release budget on failure or cancellation.

        Returns:
            List of deserialized cache layers (dicts of numpy arrays), or
            None if promotion failed (miss, budget refused, corrupt or
            unreadable entry; counted in the stats).

        Cancelling the awaiting task stops the read, waits for it to finish,
        releases the budget and re-raises CancelledError.
        """
        budget = _Budget(reserve_budget_fn, release_budget_fn)
        opts = budget.opts()
        budget.salt = L.set_promote_salt(opts, cache_salt)  # kept with budget
        tok, n = tokens_arg(tokens)
        p = ctypes.c_void_p()
        rc = L.kvt_tier_promote_async(ctypes.byref(p), self._h.ptr, tok, n,
                                      ctypes.byref(opts))
        if rc != 0:
            if budget.exc is not None:
                # The reference propagates the reserve function's exception
                # without counting a promotion failure.
                L.kvt_tier_stats_add(self._h.ptr, b"promotion_failures", -1)
                raise budget.exc
            if rc == L.KVT_ENOTFOUND:
                return None
            if rc == L.KVT_EBUDGET:
                logger.warning("[ssd_cache] promotion denied: cannot reserve "
                               "RAM budget")
                return None
            if rc in (L.KVT_ECLOSED, L.KVT_EDB, L.KVT_EINVAL):
                raise L.error(rc, "async_promote")
            logger.warning(f"[ssd_cache] promote failed: {L.last_error()}")
            return None
        promise = p.value
        try:
            await self._wait_promise(promise)
        except BaseException:
            # Cancelled (or the loop is going away): stop the read, wait for
            # it, release the reservation on this thread, then re-raise.
            L.kvt_promise_cancel(promise)
            L.kvt_promise_free(promise)
            raise
        e = ctypes.c_void_p()
        rc = L.kvt_promise_result(ctypes.byref(e), promise)
        if rc != 0:
            msg = L.last_error()
        L.kvt_promise_free(promise)
        del budget
        if rc != 0:
            logger.warning(f"[ssd_cache] failed to read entry from disk "
                           f"({len(tokens)} tokens): {msg or L.strerror(rc)}")
            return None
        return entry_to_layers(e.value, self._h, dense=True)

    def _read_entry(self, tokens: tuple[int, ...], relative_path: str, *,
                    cache_salt: str | bytes | None = None) -> list | None:
        """Read a cache entry from disk synchronously (no budget, no stats,
        no touch), as the reference's _read_entry.

        Returns list of deserialized layer dicts, or None when the entry is
        missing or corrupt (a corrupt entry is quarantined).
        """
        tok, n = tokens_arg(tokens)
        co, keep = L.call_opts(cache_salt)
        e = ctypes.c_void_p()
        rc = L.kvt_tier_read_entry_ex(ctypes.byref(e), self._h.ptr, tok, n,
                                      str(relative_path).encode(), co)
        del keep
        if rc == L.KVT_ECLOSED:
            raise L.error(rc, "_read_entry")
        if rc != 0:
            logger.warning(f"[ssd_cache] cannot read entry {relative_path}: "
                           f"{L.last_error() or L.strerror(rc)}")
            return None
        return entry_to_layers(e.value, self._h, dense=True)

    def flush(self, timeout: float | None = None) -> None:
        """kvtier extension: block until every spill enqueued so far has been
        written (or failed).  Raises TimeoutError after ``timeout`` seconds
        (None: no limit), ValueError when the writer was never started while
        spills are queued."""
        ms = -1 if timeout is None else max(0, int(timeout * 1000))
        rc = L.kvt_tier_flush(self._h.ptr, ms)
        L.check(rc, "flush")

    def set_host_cache_bytes(self, nbytes: int | None) -> None:
        """kvtier extension: changes the host RAM tier's bound (None: the
        derived default, 0: off); entries beyond it are freed before this
        returns."""
        L.set_host_cache_bytes(self._h.ptr, nbytes)

    def trim(self, target_bytes: int = 0) -> int:
        """kvtier extension, for memory pressure: frees host-cache entries
        down to target_bytes and the buffer pool's idle buffers; returns the
        cache bytes freed."""
        return L.trim(self._h.ptr, target_bytes)

    def reconcile(self) -> int:
        """Reconcile index with files on disk.

        Removes index entries whose data files are missing and data
        directories not in the index.

        Returns number of entries cleaned up.
        """
        return int(L.check(L.kvt_tier_reconcile(self._h.ptr), "reconcile"))

    _WRITER_JOIN_TIMEOUT_S = 5.0

    def close(self, timeout: float | None = None) -> None:
        """Close the SSD cache tier and release resources.

        As the reference's: queues a stop sentinel behind the accepted spills
        (FIFO: they are written first; spills are refused from then on) and
        joins the writer, both within one deadline of
        ``_WRITER_JOIN_TIMEOUT_S`` seconds (a class attribute; set it on an
        instance to change one tier's), then closes the index.  A writer that
        was never started is started to write the queued spills (the
        reference would drop them).  A second close after success does
        nothing.

        kvtier extension: ``close(timeout=s)`` waits up to s seconds for the
        queued spills instead (None: the reference's close above), without a
        sentinel.

        Raises:
            TimeoutError: the sentinel could not be queued in time (the queue
                stayed full; nothing was joined or closed, spills are still
                accepted), or "... writer thread did not stop ..." (the
                writer and the index stay open, lookups and promotes work,
                spills are refused; a later close() finishes the job).
        """
        if self._closed:
            return
        if timeout is None:
            t = self._WRITER_JOIN_TIMEOUT_S
            ms = -1 if t is None else max(0, int(float(t) * 1000))
            self._closing = True
            rc = L.kvt_tier_close_queued(self._h.ptr, ms)
            if rc == L.KVT_EFULL:
                self._closing = False
                raise L.KvtierTimeoutError(
                    L.KVT_ETIMEDOUT, f"SSDCacheTier.close: could not queue the writer's "
                    f"stop sentinel within {t}s (the spill queue stayed full); nothing "
                    "was closed and close() may be retried")
            if rc == L.KVT_ETIMEDOUT:
                raise L.KvtierTimeoutError(
                    rc, f"SSDCacheTier.close: the writer thread did not stop within "
                    f"{t}s ({self._spill_queue.qsize()} queued); the writer and the "
                    "index stay open and close() may be called again")
            L.check(rc, "close")
        else:
            self._closing = True
            ms = max(0, int(timeout * 1000))
            rc = L.kvt_tier_close(self._h.ptr, ms)
            if rc == L.KVT_ETIMEDOUT:
                raise L.KvtierTimeoutError(
                    rc, f"SSDCacheTier.close: the spill writer did not finish within "
                    f"{timeout}s; the tier is still open and close() may be retried")
            L.check(rc, "close")
        self._closed = True
        if self._writer_thread is not None:
            self._writer_thread = None
        self._index.close()
        logger.info("[ssd_cache] SSDCacheTier closed")

    async def aclose(self, timeout: float | None = None) -> None:
        """``await asyncio.to_thread(self.close)``, as the reference's: the
        event loop stays responsive and the instance's close (replaced or
        not) is what runs.  ``timeout`` (kvtier extension) is passed on."""
        if timeout is None:
            await asyncio.to_thread(self.close)
        else:
            await asyncio.to_thread(self.close, timeout)

    def __enter__(self) -> "SSDCacheTier":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def __aenter__(self) -> "SSDCacheTier":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()
