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
  ``_reconstruct_ssd_layers`` rebuilds it as a ``KVCache``.  The
  ``memory_bytes`` of a native entry (or chain prefix) holding such a
  layer is therefore the dense size of what comes back, not the spill's
  estimate of the packed tuples (the reference's, which under-reserves):
  the bytes the scheduler reserves are the bytes it loads.
- ``close()`` is the reference's (newer) close: a stop sentinel queued
  behind the accepted spills and the writer joined, within one deadline of
  ``_WRITER_JOIN_TIMEOUT_S``; ``TimeoutError`` when the sentinel cannot be
  queued (nothing changed) or the writer does not stop (writer and index stay
  open, a later ``close()`` finishes).  Unlike the reference it starts a
  writer that was never started, so queued spills are written, not dropped.
  ``close(timeout=s)`` / ``aclose(timeout=s)`` are kvtier's bounded drain.
  ``enqueue_spill`` once closing returns False.
- ``enqueue_spill`` copies only buffers the caller may still change: MLX
  arrays and numpy arrays read-only down to an immutable owner are held
  (zero-copy, ``kvt_tier_spill_nocopy``) until written, their bytes counted
  against ``spill_queue_bytes`` meanwhile.
- ``_write_entry`` is called by the C writer only while it is replaced on the
  instance (or by a subclass), with an opaque ``layer_snapshots`` to pass on
  to the original; ``_spill_queue`` is a read-only view of the C queue
  (a queue set in its place is served by a Python writer thread);
  ``tier._index`` is an ``SSDIndex`` bound to the tier (no second
  connection; no ``insert_entry``/``get_lru``/``all_entries``).
- ``SSDIndex.insert_entry`` takes a ``str`` file_path without NUL characters
  and integers in [0, 2**63) (the reference binds any SQLite value).
- ``SSDCacheConfig`` checks every field when it is made, by libkvtier's
  rules (ValueError; the reference checks three and leaves the rest to
  open time or to nobody).
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
import re
import sqlite3
import threading
import time
import types
import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from . import _lib as L
from ._hold import Holds
from ._promise import Budget, settle
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
# kvt_options' names of the fields SSDCacheConfig names otherwise.
_C_FIELD_NAMES = {"file_mode": "file_permissions", "dir_mode": "dir_permissions"}
_U32 = (1 << 32) - 1
_U64 = (1 << 64) - 1
_I64 = (1 << 63) - 1


# --------------------------------------------------------------------------
# Config and stats
# --------------------------------------------------------------------------


@dataclass
class SSDCacheConfig:
    """What an SSDCacheTier is opened with; every field is checked when the
    config is made (ValueError), by the same C rules the tier's open applies.

    The reference's fields, first and with its defaults:
        cache_dir: where the tier lives (index.db, data/).  SSDCacheTier
            needs it set; kvtier.Tier picks a per-model directory under
            ~/.cache when it is None.
        max_size_gb: disk budget in GiB (2**30 bytes); the least recently
            used entries go first when a spill would pass it.
        max_entries: bound on the number of stored entries, enforced the
            same way.
        file_permissions / dir_permissions: modes of the files and
            directories created; the owner's read/write (and, for
            directories, search) bits are required.
        spill_queue_size: spills that may wait for the writer; one more is
            refused (enqueue_spill returns False).
        retention_seconds: entries older than this are removed (None or 0:
            kept until evicted).  The reference only records the value.

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
        model_id: namespace of the entries and chunks in native mode:
            tiers of two model_ids on one directory never see each other's
            entries, chains or chunks. None (default, what the real client
            passes) = the directory alone is the namespace, as in the
            reference (one directory per model): a base model and its
            fine-tune have the same layout, so they need two directories or
            two model_ids; models of another layout are told apart by it (a
            layout mismatch is a miss). Refused with storage_mode "compat"
            (the reference's names have no namespace). Nodes sharing a
            remote store share chunks only under the same model_id.
        admission_policy: what a spill must show to be written (docs/DESIGN.md
            "Admission and the write budget"): "adaptive" (default:
            everything while the disk has room; once it has had to evict, as
            second_sighting, plus spills extending a prefix a lookup found
            stored and a 1-in-8 sample of new ones; the chunks of the spill
            lengths least reused go first at a full disk), "write_all" (the
            reference's behaviour) or "second_sighting" (a 256-token segment
            is written from its second sighting on, a spill up to its seen
            prefix).  A declined spill
            is no error; get_stats() counts it (admission_*).
        admission_memory_bytes: bound of the record of segments seen (0 =
            4 MiB).
        write_budget_bytes_per_day: write budget (0 = none), as a leaky
            bucket over kvtier's own count of bytes written; or
            write_budget_tbw (terabytes rated) with write_budget_years (the
            lifetime wanted), which also makes get_stats() project the SSD's
            lifetime (ssd_lifetime_years).
        clock: time source of the budget, a callable returning seconds
            (None = the wall clock), e.g. a replay's trace time.
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
    admission_policy: str = "adaptive"
    admission_memory_bytes: int = 0
    write_budget_bytes_per_day: int = 0
    write_budget_tbw: float = 0.0
    write_budget_years: float = 0.0
    clock: Any = None

    def __post_init__(self) -> None:
        # One rule book: libkvtier's kvt_options_validate, the check
        # kvt_tier_open itself applies.  The fields are converted to a
        # kvt_options and judged there, so whatever the tier would refuse
        # raises ValueError now, with C's message.
        self._to_options(validate=True)

    @property
    def max_size_bytes(self) -> int:
        """max_size_gb in bytes, truncated to an integer."""
        return int(self.max_size_gb * _BYTES_PER_GB)

    def _to_options(self, validate: bool = False) -> tuple[L.Options, list]:
        """This config as a kvt_options, with the byte strings its pointers
        refer to (keep them alive until kvt_tier_open has returned).

        With validate, the result is passed to kvt_options_validate and a
        refusal raises ValueError.  A number that does not fit its C field is
        passed as the nearest value that does, so C judges it; should C
        accept that value, the original is refused here instead."""
        o = L.Options()
        L.check(L.kvt_options_init(ctypes.byref(o), L.KVT_OPTIONS_VERSION),
                "kvt_options_init")
        keep: list = []
        outside: list = []

        def fit(name: str, value: Any, lo: int, hi: int) -> int:
            v = int(value)
            if lo <= v <= hi:
                return v
            outside.append((name, value, lo, hi))
            return lo if v < lo else hi

        for name, table in (("storage_mode", _STORAGE_MODES),
                            ("durability", _DURABILITIES),
                            ("io_backend", _IO_BACKENDS)):
            value = getattr(self, name)
            if value not in table:
                raise ValueError(f"{name} must be one of "
                                 f"{', '.join(repr(k) for k in table)}; got {value!r}")
        if self.cache_dir is not None:
            keep.append(L.fs_path(self.cache_dir))
            o.cache_dir = keep[-1]
        if self.model_name is not None:
            keep.append(self.model_name.encode("utf-8"))
            o.model_name = keep[-1]
        o.max_size_gb = float(self.max_size_gb)
        o.max_entries = fit("max_entries", self.max_entries, -_I64 - 1, _I64)
        o.file_mode = fit("file_permissions", self.file_permissions, 0, _U32)
        o.dir_mode = fit("dir_permissions", self.dir_permissions, 0, _U32)
        o.spill_queue_size = fit("spill_queue_size", self.spill_queue_size, 0, _U32)
        o.spill_queue_bytes = fit("spill_queue_bytes", self.spill_queue_bytes, 0, _U64)
        o.retention_seconds = fit("retention_seconds", self.retention_seconds or 0,
                                  -_I64 - 1, _I64)
        o.storage_mode = _STORAGE_MODES[self.storage_mode]
        o.durability = _DURABILITIES[self.durability]
        o.io_backend = _IO_BACKENDS[self.io_backend]
        o.promote_threads = fit("promote_threads", self.promote_threads, 0, _U32)
        o.quarantine_max = fit("quarantine_max", self.quarantine_max, 0, _U32)
        L.set_remote_options(o, keep, self.remote_url, self.remote_mode,
                             self.remote_prefix,
                             fit("remote_timeout_ms", self.remote_timeout_ms, 0, _U32),
                             fit("remote_lookup_timeout_ms",
                                 self.remote_lookup_timeout_ms, 0, _U32),
                             self.remote_keep_local, self.remote_tls_ca_file,
                             self.remote_tls_cert_file, self.remote_tls_key_file)
        if self.host_cache_bytes is not None:
            o.host_cache_bytes = fit("host_cache_bytes", self.host_cache_bytes, 0, _U64)
        o.chunk_tokens = fit("chunk_tokens", self.chunk_tokens, 0, _U32)
        # No model_id by default: the directory is the namespace (the
        # reference's convention, one directory per model), so the names stay
        # the reference's and a renamed directory keeps serving its entries.
        mid = self.model_id
        if mid is not None:
            keep.append(mid.encode("utf-8"))
            o.model_id = keep[-1]
        L.set_admission_options(o, keep, self.admission_policy,
                                self.admission_memory_bytes,
                                self.write_budget_bytes_per_day,
                                self.write_budget_tbw, self.write_budget_years,
                                self.clock)
        if validate:
            rc = L.kvt_options_validate(ctypes.byref(o))
            if rc != 0:
                raise ValueError(self._option_message(L.last_error() or L.strerror(rc)))
            if outside:
                name, value, lo, hi = outside[0]
                raise ValueError(f"{name} must be in {lo}..{hi}, got {value}")
        return o, keep

    def _option_message(self, msg: str) -> str:
        """kvt_options_validate's message in this class's terms: C's field
        names replaced by the dataclass's, and the offending value shown as
        Python prints the field ("got 0.0", as the reference says, where C
        prints "got 0"). A debug build's "file.c:LINE: " in front of C's
        message is dropped with it."""
        m = re.match(r"(?:\S+:\d+: )?(\w+) (.*), got .*$", msg, re.S)
        if m is None:
            return msg
        name = _C_FIELD_NAMES.get(m.group(1), m.group(1))
        if not hasattr(self, name):
            return msg
        value = getattr(self, name)
        if name in _C_FIELD_NAMES.values() and isinstance(value, int):
            value = oct(value)  # the rule is written in octal too
        return f"{name} {m.group(2)}, got {value}"


@dataclass
class SSDCacheStats:
    """The reference's counters as a plain dataclass (a snapshot: the tier's
    live counters are in C; get_stats() and tier._stats read them).

    Attributes:
        spill_count / spill_bytes: entries the writer published, and the
            bytes it wrote for them.
        ssd_hits / ssd_misses: promotions that returned layers, and lookups
            or promotions that found no entry.
        reload_latency_sum: seconds spent in successful promotions, summed.
        reload_bytes: bytes promoted entries brought back.
        promotion_failures: promotions refused (budget) or failed (a bad or
            vanished entry).
    """

    spill_count: int = 0
    spill_bytes: int = 0
    ssd_hits: int = 0
    ssd_misses: int = 0
    reload_latency_sum: float = 0.0
    reload_bytes: int = 0
    promotion_failures: int = 0

    def to_dict(self) -> dict:
        """The counters and two derived figures, in the reference's key order
        and rounding: ``ssd_hit_rate`` (hits over hits plus misses, 4
        places), ``reload_latency_sum_s`` (4 places) and
        ``avg_reload_latency_ms`` (per hit, 2 places); a ratio with nothing
        to divide by is 0.0."""
        looked = self.ssd_hits + self.ssd_misses
        rate = 0.0 if looked <= 0 else self.ssd_hits / looked
        # Divided first, then scaled: the reference's order, so the rounded
        # figure is the same to the last digit.
        per_hit_ms = 0.0 if self.ssd_hits <= 0 else \
            self.reload_latency_sum / self.ssd_hits * 1000
        out = {k: getattr(self, k) for k in ("spill_count", "spill_bytes",
                                             "ssd_hits", "ssd_misses")}
        out["ssd_hit_rate"] = round(rate, 4)
        out["reload_latency_sum_s"] = round(self.reload_latency_sum, 4)
        out["avg_reload_latency_ms"] = round(per_hit_ms, 2)
        out["reload_bytes"] = self.reload_bytes
        out["promotion_failures"] = self.promotion_failures
        return out


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
                           "promote_disk_bytes", "host_cache_chunks",
                           "host_cache_chunk_bytes")
# Refused spills by reason (kvt_stats version 3): the library counts its own
# refusals, enqueue_spill adds the ones decided here.
_REFUSAL_STAT_FIELDS = tuple(f"spill_refused_{r}" for r in L.SPILL_REFUSAL_REASONS)

# Return codes of a refused spill and the reason they count under (the same
# mapping as the library's own counting).
_RC_REASON = {L.KVT_EUNSUPPORTED: "unsupported", L.KVT_EINVAL: "invalid",
              L.KVT_ETOOBIG: "too_big", L.KVT_EFULL: "queue_full",
              L.KVT_ECLOSED: "closed"}


class _RefusalLog:
    """The WARNING of refused spills, rate limited per reason: the first
    refusal of a reason is logged, then at most one message per reason and
    interval, which says how many were refused without a message since.  A
    refusal comes from an eviction on the engine's thread; a server whose
    every eviction is refused must not log one line per eviction (the counts
    are in get_stats() either way)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}   # reason -> time of its last message
        self._quiet: dict[str, int] = {}    # reason -> refusals since, not logged

    def note(self, reason: str, what: str, interval: float, exc_info: Any = None) -> bool:
        """Logs one refusal unless its reason was logged less than interval
        seconds ago.  Returns whether it logged."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(reason)
            if last is not None and now - last < interval:
                self._quiet[reason] = self._quiet.get(reason, 0) + 1
                return False
            quiet = self._quiet.pop(reason, 0)
            self._last[reason] = now
        more = (f"; {quiet} more refused for this reason in the last "
                f"{now - last:.0f}s" if quiet and last is not None else "")
        logger.warning(f"[ssd_cache] spill refused ({reason}): {what}{more} "
                       f"(counted in get_stats()['spill_refused_{reason}'])",
                       exc_info=exc_info)
        return True


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
    """The tokens as index.db stores them (``tokens_blob``): one native-endian
    32-bit signed integer per token, packed."""
    return bytes(_array.array("i", tokens))


def _blob_to_tokens(blob: bytes) -> tuple[int, ...]:
    """The inverse of _tokens_to_blob."""
    return tuple(_array.array("i", blob))


def _tokens_hash(tokens: tuple[int, ...]) -> str:
    """An entry's key: lowercase hex SHA-256 of its tokens' blob.  It names
    the row (``token_hash``) and the entry's directory under data/."""
    return hashlib.sha256(_tokens_to_blob(tokens)).hexdigest()


def _prefix_hash(tokens: tuple[int, ...]) -> str:
    """The key of the first _PREFIX_FILTER_TOKENS tokens (of all of them,
    when there are fewer): index.db's ``prefix_hash`` column, which narrows
    a prefix lookup to the rows that can match before their blobs are
    compared."""
    return _tokens_hash(tuple(tokens)[:_PREFIX_FILTER_TOKENS])


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
    """index.db, the table of stored entries, through libkvtier's kvt_index_*
    calls.

    The schema is the reference's, so either program opens a directory the
    other wrote, and so are the methods and what they return: a row keeps
    the ``file_path`` and ``num_tokens`` it was given.  Calls on one instance
    take turns (``_db_lock``); any thread may make them.

    The instance a tier makes for itself (``tier._index``) is bound to the
    tier instead of opening index.db a second time: lookups, touch, delete
    and the counts go through the tier (its in-memory index), and
    insert_entry/get_lru/all_entries are not available there (the C writer
    writes the tier's rows).
    """

    _SCHEMA_VERSION = 1

    def __init__(self, cache_dir: str) -> None:
        """Opens (creating it and its tables when missing) cache_dir/index.db;
        the directory must exist.  An older table without ``prefix_hash`` is
        upgraded in place."""
        self._db_lock = threading.Lock()
        self._cache_dir = cache_dir
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

    @property
    def _conn(self) -> sqlite3.Connection:
        """A Python sqlite3 connection to this index's index.db (rows as
        sqlite3.Row, usable from any thread), opened on first use and closed
        by close(): for code that queries the table directly, as the
        reference's own tests do.  Hold ``_db_lock`` around its use.  The
        index's calls never use it.  A tier's own index has none (its rows
        are the tier's in-memory index; open SSDIndex(cache_dir) instead)."""
        if self._via is not None:
            raise AttributeError(
                "_conn: a tier's own index has no Python connection; open "
                "SSDIndex(cache_dir) to query index.db")
        self._p()  # closed -> sqlite3.ProgrammingError, as the reference's
        c = self.__dict__.get("_py_conn")
        if c is None:
            c = sqlite3.connect(os.path.join(self._cache_dir, "index.db"),
                                check_same_thread=False)
            c.row_factory = sqlite3.Row
            self.__dict__["_py_conn"] = c
        return c

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
        """Stores the row for tokens_key, replacing one already there (its
        created and accessed times are now).  ``file_path`` (a str without
        NUL) and ``num_tokens`` are kept as given; a tier serves a row only
        when file_path is the row's own token hash.  Not on a tier's own
        index (NotImplementedError)."""
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
        """The row stored for exactly these tokens, as a dict of file_path,
        memory_bytes and num_tokens, or None."""
        if self._via is not None:
            return self._via.lookup_exact(tokens_key)
        tok, n = tokens_arg(tokens_key)
        with self._db_lock:
            rows = self._rows(L.kvt_index_get, self._p(), tok, n, keys=_EXACT_KEYS)
        return rows[0] if rows else None

    def lookup_prefix(self, query_tokens: tuple[int, ...]) -> list[dict]:
        """Every stored row whose tokens begin query_tokens (the whole query
        included), longest first, as dicts of token_hash, file_path,
        memory_bytes and num_tokens; [] for an empty query.  On a tier's own
        index only the longest is returned (0 or 1 dicts)."""
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
        """Removes the row for these tokens (nothing when there is none); on a
        tier's own index the entry's files go too.  cache_salt (kvtier's):
        the salt the tier's entry was spilled under; a salted entry is only
        removed with it, and a standalone SSDIndex has no salted rows."""
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
        """Up to ``limit`` rows (all of them for a negative limit), least
        recently accessed first, with their tokens_blob."""
        if self._via is not None:
            raise self._tier_only("get_lru")
        # SQLite's LIMIT with a negative value means "no limit".
        lim = int(limit) if limit >= 0 else (1 << 62)
        with self._db_lock:
            return self._rows(L.kvt_index_lru, self._p(), lim, keys=_LRU_KEYS)

    def get_total_bytes(self) -> int:
        """The sum of memory_bytes over the rows (0 when empty)."""
        if self._via is not None:
            return self._via.get_total_bytes()
        v = ctypes.c_uint64()
        with self._db_lock:
            L.check(L.kvt_index_total_bytes(ctypes.byref(v), self._p()))
        return int(v.value)

    def get_entry_count(self) -> int:
        """How many rows there are."""
        if self._via is not None:
            return self._via.get_entry_count()
        v = ctypes.c_uint64()
        with self._db_lock:
            L.check(L.kvt_index_count(ctypes.byref(v), self._p()))
        return int(v.value)

    def touch(self, tokens_key: tuple[int, ...], *,
              cache_salt: str | bytes | None = None) -> None:
        """Sets the row's accessed time to now, so LRU eviction takes it
        last; nothing when there is no such row.  cache_salt (kvtier's): the
        salt the tier's entry was spilled under (a standalone SSDIndex has no
        salted rows)."""
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
        """Every row, with its tokens_blob (what reconcile compares with the
        directories on disk)."""
        if self._via is not None:
            raise self._tier_only("all_entries")
        with self._db_lock:
            return self._rows(L.kvt_index_all, self._p(), keys=_LRU_KEYS)

    def close(self) -> None:
        """Releases index.db (and the _conn connection, if one was opened);
        later calls raise sqlite3.ProgrammingError.  On a tier's own index it
        does nothing: the tier's close() releases it."""
        with self._db_lock:
            c = self.__dict__.pop("_py_conn", None)
            if c is not None:
                c.close()
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
        """Marks the tier's entry as just used (kvt_tier_touch_ex), so its
        LRU eviction comes last; cache_salt: the salt it was spilled under."""
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
    """A numpy copy of an MLX (or numpy-convertible) array, and the name of
    its dtype when numpy had no such dtype and the copy was widened to
    float32 (None otherwise): see kvtier._convert.to_numpy_safe."""
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
    """The SSD tier behind vllm-mlx's prefix cache: entries the RAM cache
    evicts are spilled here and promoted back on a later hit.  libkvtier does
    the work (writer, index, files, reads); this class is the reference's
    interface to it.

    On disk, cache_dir holds what the reference writes - index.db (one row
    per entry) and data/<token hash>/ with an entry's layer_<i>.safetensors,
    manifest.json and tokens.bin - and kvtier's own files beside them
    (manifest.sum checksums, chunks/ for the chunked store, stats.bin, the
    kvtier.lock of the process that holds the directory).

    Typical use::

        tier = SSDCacheTier(SSDCacheConfig(cache_dir="/path"))
        tier.start_writer()
        tier.enqueue_spill(tokens, cache_layers, memory_bytes)   # -> bool
        meta = tier.lookup_ssd(tokens)                            # dict | None
        layers = await tier.async_promote(tokens, reserve, release)
        tier.close()

    Any thread may spill, look up and promote, concurrently.
    """

    def __init__(self, config: SSDCacheConfig) -> None:
        """Opens config.cache_dir, creating it (parents too) and index.db when
        missing.  Spills wait in the queue until start_writer() is called, as
        with the reference.

        Raises:
            ValueError: cache_dir is None, or an option libkvtier refuses.
            OSError: the directory cannot be created or used (PermissionError
                semantics for a directory owned by someone else or writable
                by group/others; another process holding it for writing).
            sqlite3.DatabaseError: index.db is unusable.
        """
        if config.cache_dir is None:
            raise ValueError("SSDCacheConfig.cache_dir must be set")
        self._config = config
        self._closed = True  # until every step below has worked
        self._closing = False
        self._writer_thread: Any = None
        self._sentinel_queued = False  # on a replaced _spill_queue
        self._hook_calls = 0  # calls of the write hook (replaced _write_entry)
        self._refusal_log = _RefusalLog()
        self._cache_dir, self._data_dir = config.cache_dir, os.path.join(
            config.cache_dir, "data")

        # The reference creates parents too; kvtier then checks ownership and
        # permissions of the leaf.
        os.makedirs(self._cache_dir, mode=config.dir_permissions, exist_ok=True)

        opts, keep = config._to_options()
        p = ctypes.c_void_p()
        rc = L.kvt_tier_open(ctypes.byref(p), ctypes.byref(opts))
        # The clock callback is called for as long as the tier lives.
        clocks = [k for k in keep if isinstance(k, L.CLOCK_FN)]
        del keep
        L.check(rc, f"open {self._cache_dir}")
        self._h = _TierHandle(p.value)
        self._h.keep.extend(clocks)
        self._c_write_hook = L.WRITE_HOOK_FN(_write_hook(weakref.ref(self)))
        self._h.keep.append(self._c_write_hook)
        # Zero-copy spills' buffers: kept with the handle, so the release
        # callback and what it drops outlive the writer (cleared after
        # kvt_tier_free has joined it).
        self._holds = Holds(config.spill_queue_bytes)
        self._h.keep.append(self._holds)
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
            self._undo_open()
            raise

    def _undo_open(self) -> None:
        """Undoes a half-done __init__: closes the index it got (whatever the
        module's SSDIndex returned, a caller's stand-in too) and frees the C
        tier, with its index connection and lock file.  A failing close is
        logged, not raised, so the caller sees the error that stopped
        __init__."""
        idx = self.__dict__.get("_index")
        if idx is not None:
            try:
                idx.close()
            except Exception:
                logger.exception("ssd_cache: failed to close index during init cleanup")
        self._h.free()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("closing" if self._closing else "open")
        return (f"<kvtier.ssd_cache.SSDCacheTier {self._cache_dir!r} "
                f"{self._config.storage_mode} {state}>")

    @staticmethod
    def _entry_hash(tokens: tuple[int, ...]) -> str:
        """The key of an entry (its directory's name under data/): see
        _tokens_hash."""
        return _tokens_hash(tokens)

    def get_stats(self) -> dict:
        """The tier's counters now: the nine keys of the reference's
        SSDCacheStats.to_dict() first, rounded the same way, then kvtier's
        (queue, evictions, quarantine, remote tier, host RAM tier...)."""
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
        for f in _REFUSAL_STAT_FIELDS:
            d[f] = int(getattr(s, f))
        d["spill_refused"] = sum(d[f] for f in _REFUSAL_STAT_FIELDS)
        # The binding's zero-copy spills: spills per road, bytes held now.
        d.update(self._holds.stats())
        for f in L.ADMISSION_STAT_FIELDS:
            d[f] = int(getattr(s, f))
        d["bytes_written_total"] = int(s.spill_bytes)
        d["ssd_lifetime_years"] = round(float(s.ssd_lifetime_years), 2)
        # Reads of another model's layout (a miss, never served).
        d["layout_misses"] = int(s.layout_misses)
        return d

    def start_writer(self) -> None:
        """Starts the writer, which takes spills off the queue and writes
        them; a second call does nothing."""
        if self._writer_thread is not None:
            return
        self._sync_write_hook()
        L.check(L.kvt_tier_start_writer(self._h.ptr), "start_writer")
        q = self._spill_queue
        if isinstance(q, _SpillQueue):
            self._writer_thread = _WriterInfo(self)
        else:
            # _spill_queue was replaced by a queue of the caller's: a Python
            # thread serves it (the C writer still serves enqueue_spill).
            th = threading.Thread(target=self._serve_replaced_queue, args=(q,),
                                  daemon=True, name="ssd-cache-writer")
            th.start()
            self._writer_thread = th
        logger.info("[ssd_cache] writer thread started")

    def _serve_replaced_queue(self, q: Any) -> None:
        """Writer loop for a ``_spill_queue`` replaced by the caller: hands
        each ``(tokens, layer_snapshots, memory_bytes)`` item to
        ``_write_entry`` until the None sentinel close() queues; a failing
        write is logged and the loop carries on."""
        while True:
            item = q.get()
            if item is None:
                return
            toks, snaps, mem = item
            try:
                self._write_entry(toks, snaps, mem)
            except Exception:
                logger.exception(f"[ssd_cache] failed to write entry ({len(toks)} tokens)")

    def enqueue_spill(
        self,
        tokens: tuple[int, ...],
        cache: list[Any],
        memory_bytes: int,
        *,
        cache_salt: str | bytes | None = None,
    ) -> bool:
        """Hands an entry to the writer without waiting for the disk.

        cache_salt (kvtier's; str or bytes): a per-request namespace (vLLM's
        ``cache_salt``): the entry is then found, promoted, read and touched
        only by calls given the same cache_salt, and its chunks are never
        shared with other salts (or none).

        Buffers that cannot change until they are written are not copied:
        MLX arrays (values: an engine that updates one rebinds its object,
        and the spill holds its own reference) and numpy arrays read-only
        down to an immutable owner are held, and released once the writer
        has written them (or dropped them at close).  Any other buffer is
        copied before this returns; the caller may reuse it.  What is held
        counts against ``spill_queue_bytes``: a spill that would pass it is
        refused as a full queue, never waited for.  Layers: ``.keys/.values/.offset`` (+ ``max_size, keep, step, _idx``),
        a list ``.state``, or quantized ``(packed, scales, biases)`` tuples
        with ``bits``/``group_size``; numpy arrays, bf16 arrays, or anything
        numpy.asarray accepts.

        True once the entry is queued: the writer will publish it unless the
        write itself fails.  False, with nothing queued, when it is refused:
        the queue is full, a layer cannot be stored, or the tier is closing.
        Every refusal counts in get_stats() under its reason
        (``spill_refused_<reason>``) and is logged as a WARNING at most once per
        reason and ``_REFUSAL_LOG_INTERVAL_S`` seconds.
        """
        if self._closed or self._closing:
            return self._refused("closed", f"{len(tokens)} tokens: the tier is closed",
                                 count=True)
        try:
            tok, n = tokens_arg(tokens)
            if memory_bytes < 0:
                raise ValueError(f"memory_bytes must be >= 0, got {memory_bytes}")
            co, salt_keep = L.call_opts(cache_salt)
            layers, nl, keep = build_layers(cache, hold=True)
        except Exception as e:
            return self._refused(L.exc_refusal_reason(e), f"{len(tokens)} tokens: {e}",
                                 count=True, exc_info=True)
        ptr, mem = self._h.ptr, int(memory_bytes)
        rc, counted = self._holds.spill(
            ptr, tok, n, layers, nl, mem, co, keep,
            lambda: L.kvt_tier_spill_ex(ptr, tok, n, layers, nl, mem, co))
        total = keep.held_bytes
        del keep, salt_keep
        if rc == 0:
            return True
        if not counted:  # the held bytes' bound, decided in Python
            L.kvt_tier_stats_add(ptr, b"spill_drops", 1)
            return self._refused("queue_full", f"{len(tokens)} tokens: "
                                 f"{self._holds.refusal_message(total)}", count=True)
        # The library has counted it.
        return self._refused(_RC_REASON.get(rc, "other"),
                             f"{len(tokens)} tokens, {memory_bytes} bytes: "
                             f"{L.last_error() or L.strerror(rc)}", count=False)

    def _write_entry(
        self,
        tokens_key: tuple[int, ...],
        layer_snapshots: Any,
        memory_bytes: int,
    ) -> None:
        """Writes one spill (on the writer thread): its files appear whole or
        not at all.

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
        """Is an entry stored for exactly these tokens?  Answered from the
        tier's in-memory index, without touching the disk.  Returns
        ``{"file_path", "memory_bytes", "num_tokens"}`` (file_path: the
        entry's directory under data/, its token hash) or None."""
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
        """The longest stored entry whose tokens begin ``tokens``, from
        memory like lookup_ssd: ``{"token_hash", "file_path",
        "memory_bytes", "num_tokens"}`` or None.  In the chunked store this
        may be a chunk-aligned prefix that no spill ended at (num_tokens and
        memory_bytes then describe that prefix)."""
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

    async def async_promote(
        self,
        tokens: tuple[int, ...],
        reserve_budget_fn: Callable[[int], bool],
        release_budget_fn: Callable[[int], None],
        *,
        cache_salt: str | bytes | None = None,
    ) -> list | None:
        """Reads the entry for ``tokens`` back into memory, off the event
        loop (libkvtier's promote workers), and returns its layers.

        The RAM is claimed first: ``reserve_budget_fn(memory_bytes)`` is
        called on this thread before any byte is read, and a False return
        ends the promotion there (no read, so racing promotions cannot
        overcommit).  ``release_budget_fn(memory_bytes)`` gives it back, on
        this thread, when the read then fails or the task is cancelled; on
        success the caller owns the reservation.

        Returns the layers as the reference's dicts of numpy arrays, or None
        for a miss, a refused budget, or a damaged or unreadable entry (a
        damaged one is quarantined); each outcome is counted in the stats.
        An exception from reserve_budget_fn propagates.

        Cancelling the awaiting task stops the read, waits for it to finish,
        releases the budget and re-raises CancelledError.
        """
        budget = Budget(reserve_budget_fn, release_budget_fn,
                        lambda: logger.exception("[ssd_cache] release_budget_fn raised"))
        budget.salt = L.set_promote_salt(budget.opts, cache_salt)  # kept with budget
        tok, n = tokens_arg(tokens)
        p = ctypes.c_void_p()
        rc = L.kvt_tier_promote_async(ctypes.byref(p), self._h.ptr, tok, n,
                                      ctypes.byref(budget.opts))
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
        # When the task is cancelled (or the loop goes away), settle stops
        # the read, waits for it and releases the reservation on this
        # thread, then re-raises.
        rc, e, msg = await settle(
            p.value, lambda rc, e: (rc, e.value, L.last_error() if rc else ""))
        del budget
        if rc != 0:
            logger.warning(f"[ssd_cache] failed to read entry from disk "
                           f"({len(tokens)} tokens): {msg or L.strerror(rc)}")
            return None
        return entry_to_layers(e, self._h, dense=True)

    def _read_entry(self, tokens: tuple[int, ...], relative_path: str, *,
                    cache_salt: str | bytes | None = None) -> list | None:
        """The scheduler's direct read: the entry for ``tokens`` whose
        directory is ``relative_path``, read on this thread with no budget,
        no stats and no touch.  Returns its layers as async_promote does, or
        None when it is missing, does not match, or is damaged (then
        quarantined)."""
        tok, n = tokens_arg(tokens)
        co, keep = L.call_opts(cache_salt)
        e = ctypes.c_void_p()
        rc = L.kvt_tier_read_entry_ex(ctypes.byref(e), self._h.ptr, tok, n,
                                      str(relative_path).encode(), co)
        del keep
        if rc == L.KVT_ECLOSED:
            raise L.error(rc, "_read_entry")
        if rc != 0:
            # A miss (gone, or another model's layout: counted) is no fault.
            log = logger.debug if rc == L.KVT_ENOTFOUND else logger.warning
            log(f"[ssd_cache] cannot read entry {relative_path}: "
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
        """Makes index.db and data/ agree: rows whose files are gone are
        dropped, and directories no row names are removed.  Returns how many
        were cleaned up."""
        return int(L.check(L.kvt_tier_reconcile(self._h.ptr), "reconcile"))

    _WRITER_JOIN_TIMEOUT_S = 5.0
    # Seconds between two WARNINGs of refused spills of one reason (the first
    # is logged at once); set on an instance to change one tier's.
    _REFUSAL_LOG_INTERVAL_S = 60.0

    def _refused(self, reason: str, what: str, *, count: bool,
                 exc_info: Any = None) -> bool:
        """A refused spill: counted under its reason (count: decided here,
        not by the library, which counts its own) and logged as _RefusalLog
        allows.  Returns False, enqueue_spill's answer."""
        if count:
            L.count_refusal(self._h.ptr, reason)
        self._refusal_log.note(reason, what, float(self._REFUSAL_LOG_INTERVAL_S),
                               exc_info)
        return False

    def close(self, timeout: float | None = None) -> None:
        """Stops the tier: the spills already accepted are written first,
        then the writer stops and the index is released.

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
            deadline = None if t is None else time.monotonic() + float(t)
            self._close_replaced_writer(t, deadline)
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ms = -1 if left is None else int(left * 1000)
            self._closing = True
            rc = L.kvt_tier_close_queued(self._h.ptr, ms)
            if rc == L.KVT_EFULL:
                self._closing = False
                raise L.KvtierTimeoutError(
                    L.KVT_ETIMEDOUT, f"SSDCacheTier.close: could not queue the writer's "
                    f"shutdown sentinel within {t}s (the spill queue stayed full); nothing "
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
        self._closed, self._writer_thread = True, None
        if self._holds.pending():  # a closed tier has released every spill
            logger.error(f"[ssd_cache] close: {self._holds.pending()} zero-copy spills "
                         "still held after the writer stopped")
        self._index.close()  # nothing for the tier's own; a stand-in's runs
        logger.info("[ssd_cache] SSDCacheTier closed")

    def _close_replaced_writer(self, t: float | None, deadline: float | None) -> None:
        """close()'s steps for a ``_spill_queue`` or ``_writer_thread`` the
        caller replaced (the C ones need neither): the None sentinel goes on
        the replaced queue (bounded by t), then the replaced or Python writer
        thread is joined until the deadline.  Raises TimeoutError, with the
        C tier and the index untouched, when either does not happen."""
        q = self._spill_queue
        if not isinstance(q, _SpillQueue) and not self._sentinel_queued:
            if self._writer_thread is None:
                self.start_writer()  # queued items are written, not dropped
            try:
                q.put(None, timeout=t)
            except queue.Full:
                raise L.KvtierTimeoutError(
                    L.KVT_ETIMEDOUT, f"SSDCacheTier.close: could not queue the writer's "
                    f"shutdown sentinel within {t}s (the replaced spill queue stayed "
                    "full); nothing was closed and close() may be retried") from None
            self._sentinel_queued = True
        wt = self._writer_thread
        if wt is None or isinstance(wt, _WriterInfo):
            return
        self._closing = True
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        wt.join(timeout=left)
        if wt.is_alive():
            raise L.KvtierTimeoutError(
                L.KVT_ETIMEDOUT, f"SSDCacheTier.close: the writer thread did not stop "
                f"within {t}s; the writer and the index stay open and close() may be "
                "called again")
        self._writer_thread = None

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
