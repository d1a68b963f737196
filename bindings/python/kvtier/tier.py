"""``kvtier.Tier``: a Pythonic interface to libkvtier beside the drop-in
``kvtier.ssd_cache`` module.

Where the drop-in module mirrors the reference (booleans and ``None`` for
every failure), ``Tier`` raises exceptions that say what happened
(``QueueFull``, ``BudgetRefused``, ``KvtierCorrupt``, ...), returns small
dataclasses, and exposes kvtier's extras: synchronous promote, prefix
promote, garbage collection, verification, per-entry description, iteration
over entries and Prometheus metrics.

    with kvtier.Tier("/var/cache/kv", storage_mode="native") as tier:
        tier.spill(tokens, layers)                 # raises QueueFull when full
        entry = tier.promote(tokens)               # Entry | None (miss)
        entry.layers[0]["keys"]                    # numpy, shares C memory
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import operator
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

from . import _lib as L
from ._convert import EntryHandle, build_layers, layer_to_dict, tokens_arg
from ._hold import Holds
from ._promise import Budget, settle
from .ssd_cache import _DURABILITIES, _IO_BACKENDS, _STORAGE_MODES, _TierHandle


class QueueFull(L.KvtierError):
    """The spill queue is full (by count or bytes): the entry was dropped."""


class TooBig(L.KvtierError, ValueError):
    """The entry is larger than the tier's capacity or queue byte bound."""


class BudgetRefused(L.KvtierError):
    """The reserve callback refused the entry's memory_bytes; nothing was read."""


@dataclass(frozen=True)
class EntryInfo:
    """Metadata of a stored entry (no tensor data read)."""

    token_hash: str
    prefix_hash: str
    num_tokens: int
    memory_bytes: int
    disk_bytes: int
    created_at: float
    accessed_at: float

    @classmethod
    def _from_c(cls, i: L.EntryInfo) -> "EntryInfo":
        return cls(i.token_hash.decode(), i.prefix_hash.decode(), int(i.num_tokens),
                   int(i.memory_bytes), int(i.disk_bytes), float(i.created_at),
                   float(i.accessed_at))


class Entry:
    """A promoted entry: its tokens, metadata and layers (the reference's
    layer dicts; numpy arrays sharing the entry's C memory)."""

    def __init__(self, ptr: int, handle: Any) -> None:
        owner = EntryHandle(ptr, handle)
        n = ctypes.c_size_t()
        tp = L.kvt_entry_tokens(ptr, ctypes.byref(n))
        self.tokens: Tuple[int, ...] = tuple(tp[i] for i in range(n.value))
        self.token_hash: str = L.kvt_entry_hash(ptr).decode()
        self.memory_bytes: int = int(L.kvt_entry_memory_bytes(ptr))
        self.reserved_bytes: int = int(L.kvt_entry_reserved_bytes(ptr))
        self.disk_bytes: int = int(L.kvt_entry_disk_bytes(ptr))
        self.storage_mode: str = ("compat" if L.kvt_entry_storage_mode(ptr) == L.STORAGE_COMPAT
                                  else "native")
        self.layers: List[dict] = [layer_to_dict(L.kvt_entry_layer(ptr, i).contents, owner)
                                   for i in range(L.kvt_entry_num_layers(ptr))]

    def __len__(self) -> int:
        return len(self.layers)

    def __repr__(self) -> str:
        return (f"<kvtier.Entry {self.token_hash[:12]}… {len(self.tokens)} tokens, "
                f"{len(self.layers)} layers, {self.storage_mode}>")


class Tier:
    """A kvtier cache directory.  See the module docstring.

    Args mirror ``kvt_options`` (include/kvtier.h): cache_dir (None: the
    default ``$XDG_CACHE_HOME/kvtier/<model_name>``), max_size_gb,
    max_entries, spill_queue_size, spill_queue_bytes, retention_seconds
    (None/0: never expire), storage_mode ("native"/"compat"), durability
    ("fsync"/"none"), promote_threads, quarantine_max, io_backend, file_mode,
    dir_mode, readonly, reconcile (at open), start_writer, host_cache_bytes
    (the host RAM tier's bound: None = derived from RAM and the cgroup limit,
    0 = off; see set_host_cache_bytes and trim); the shared remote
    tier (docs/REMOTE.md): remote_url ("redis[s]://[[user]:password@]host:port",
    comma-separated seeds for a cluster), remote_mode ("local+remote" when a
    URL is given, or "remote"), remote_prefix, remote_timeout_ms,
    remote_lookup_timeout_ms, remote_keep_local, remote_tls_ca_file,
    remote_tls_cert_file, remote_tls_key_file.  Lookups, promotes and
    read_entry then see the remote entries.  The chunked native store
    (docs/DESIGN.md): chunk_tokens (None: the library's default, 256 in
    native mode; 0: off; else a power of two in 16..4096) and model_id (the
    namespace of entries, chains and chunks in native mode: two model_ids on
    one directory never meet; refused in compat mode; None: the directory is
    the namespace, chunks seeded by model_name; docs/FORMAT.md section 6).  Admission and the write budget
    (docs/DESIGN.md): admission_policy ("write_all", "second_sighting",
    "adaptive"), admission_memory_bytes, write_budget_bytes_per_day or
    write_budget_tbw with write_budget_years, and clock (a callable returning
    seconds for the budget; None: the wall clock).
    """

    def __init__(self, cache_dir: Optional[str] = None, *, model_name: Optional[str] = None,
                 max_size_gb: float = 10.0, max_entries: int = 10000,
                 spill_queue_size: int = 64, spill_queue_bytes: int = 0,
                 retention_seconds: Optional[int] = None, storage_mode: str = "native",
                 durability: str = "fsync", promote_threads: int = 2,
                 quarantine_max: int = 16, io_backend: str = "auto",
                 file_mode: int = 0o600, dir_mode: int = 0o700, readonly: bool = False,
                 reconcile: bool = True, start_writer: bool = True,
                 host_cache_bytes: Optional[int] = None,
                 remote_url: Optional[str] = None, remote_mode: Optional[str] = None,
                 remote_prefix: Optional[str] = None, remote_timeout_ms: int = 1000,
                 remote_lookup_timeout_ms: int = 250, remote_keep_local: bool = True,
                 remote_tls_ca_file: Optional[str] = None,
                 remote_tls_cert_file: Optional[str] = None,
                 remote_tls_key_file: Optional[str] = None,
                 chunk_tokens: Optional[int] = None,
                 model_id: Optional[str] = None,
                 admission_policy: str = "adaptive", admission_memory_bytes: int = 0,
                 write_budget_bytes_per_day: int = 0, write_budget_tbw: float = 0.0,
                 write_budget_years: float = 0.0,
                 clock: Optional[Callable[[], float]] = None) -> None:
        o = L.Options()
        L.check(L.kvt_options_init(ctypes.byref(o), L.KVT_OPTIONS_VERSION))
        keep = []
        if cache_dir is not None:
            keep.append(L.fs_path(cache_dir))
            o.cache_dir = keep[-1]
        if model_name is not None:
            keep.append(model_name.encode())
            o.model_name = keep[-1]
        try:
            o.storage_mode = _STORAGE_MODES[storage_mode]
            o.durability = _DURABILITIES[durability]
            o.io_backend = _IO_BACKENDS[io_backend]
        except KeyError as e:
            raise ValueError(f"unknown option value {e.args[0]!r}") from None
        o.max_size_gb = float(max_size_gb)
        o.max_entries = int(max_entries)
        o.spill_queue_size = int(spill_queue_size)
        o.spill_queue_bytes = int(spill_queue_bytes)
        o.retention_seconds = int(retention_seconds or 0)
        o.promote_threads = int(promote_threads)
        o.quarantine_max = int(quarantine_max)
        o.file_mode = int(file_mode)
        o.dir_mode = int(dir_mode)
        if host_cache_bytes is not None:
            if host_cache_bytes < 0:
                raise ValueError(f"host_cache_bytes must be >= 0 or None, "
                                 f"got {host_cache_bytes}")
            o.host_cache_bytes = int(host_cache_bytes)
        o.flags = ((L.OPEN_READONLY if readonly else 0)
                   | (0 if reconcile else L.OPEN_NO_RECONCILE))
        if chunk_tokens is not None:
            # Only what its C field cannot hold is refused here (ctypes would
            # store it modulo 2**32); the rule itself is kvt_options_validate's.
            if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) \
                    or not 0 <= chunk_tokens < 2**32:
                raise ValueError(f"chunk_tokens must be an integer in 0..{2**32 - 1}, "
                                 f"got {chunk_tokens!r}")
            o.chunk_tokens = chunk_tokens
        if model_id is not None:
            keep.append(model_id.encode("utf-8"))
            o.model_id = keep[-1]
        if remote_mode is None:
            remote_mode = "local" if remote_url is None else "local+remote"
        L.set_remote_options(o, keep, remote_url, remote_mode, remote_prefix,
                             remote_timeout_ms, remote_lookup_timeout_ms,
                             remote_keep_local, remote_tls_ca_file,
                             remote_tls_cert_file, remote_tls_key_file)
        L.set_admission_options(o, keep, admission_policy, admission_memory_bytes,
                                write_budget_bytes_per_day, write_budget_tbw,
                                write_budget_years, clock)
        L.check(L.kvt_options_validate(ctypes.byref(o)), "options")
        p = ctypes.c_void_p()
        L.check(L.kvt_tier_open(ctypes.byref(p), ctypes.byref(o)), "open")
        self._h = _TierHandle(p.value)
        # Zero-copy spills' buffers, kept with the handle (see ssd_cache).
        self._holds = Holds(o.spill_queue_bytes)
        self._h.keep.append(self._holds)
        # The clock callback is called for as long as the tier lives.
        self._h.keep.extend(k for k in keep if isinstance(k, L.CLOCK_FN))
        self.storage_mode = storage_mode
        if start_writer and not readonly:
            L.check(L.kvt_tier_start_writer(self._h.ptr), "start_writer")

    # -- properties ---------------------------------------------------------

    @property
    def path(self) -> str:
        """The cache directory in use (absolute)."""
        return L.kvt_tier_dir(self._h.ptr).decode()

    def __repr__(self) -> str:
        return f"<kvtier.Tier {self.path!r} {self.storage_mode}>"

    # -- spill --------------------------------------------------------------

    def spill(self, tokens: Sequence[int], layers: Sequence[Any],
              memory_bytes: Optional[int] = None, *, cache_salt: Any = None) -> None:
        """Enqueues a spill.  Buffers nobody can change before they are
        written (MLX arrays; numpy arrays read-only down to an immutable
        owner) are held until the writer releases them, the others copied
        before return; the held bytes count against spill_queue_bytes (as
        the drop-in's enqueue_spill).  memory_bytes defaults to the layers'
        tensor bytes.  cache_salt (str or bytes): the entry is then seen
        only by calls with the same cache_salt (kvt_call_opts).  Raises
        QueueFull, TooBig, ValueError (bad layer), KvtierClosed."""
        try:
            tok, n = tokens_arg(tokens)
            co, salt_keep = L.call_opts(cache_salt)
            arr, nl, keep = build_layers(layers, hold=True)
        except Exception as e:  # counted like the library's own refusals
            L.count_refusal(self._h.ptr, L.exc_refusal_reason(e))
            raise
        if memory_bytes is None:
            memory_bytes = keep.held_bytes
        ptr, mem = self._h.ptr, int(memory_bytes)
        rc, counted = self._holds.spill(
            ptr, tok, n, arr, nl, mem, co, keep,
            lambda: L.kvt_tier_spill_ex(ptr, tok, n, arr, nl, mem, co))
        total = keep.held_bytes
        del salt_keep
        del keep
        if not counted:  # the held bytes' bound, decided here
            L.kvt_tier_stats_add(ptr, b"spill_drops", 1)
            L.count_refusal(ptr, "queue_full")
            raise QueueFull(rc, self._holds.refusal_message(total))
        if rc == L.KVT_EFULL:
            raise QueueFull(rc, L.last_error() or "spill queue full")
        if rc == L.KVT_ETOOBIG:
            raise TooBig(rc, L.last_error() or "entry too big")
        L.check(rc, "spill")

    def spill_prefix(self, tokens: Sequence[int], n_keep: int, layers: Sequence[Any],
                     memory_bytes: Optional[int] = None, *, cache_salt: Any = None) -> None:
        """Hybrid models: stores the entry of tokens[:n_keep] from layers whose
        arrays/rotating layers are the state as of n_keep and whose KV layers
        may hold more tokens (their first n_keep rows are stored).  Such
        models get prefix hits only where a state was stored
        (kvt_tier_spill_prefix).  Raises as spill."""
        try:
            n_keep = int(n_keep)
            if not 0 < n_keep <= len(tokens):
                raise ValueError(f"n_keep must be in 1..{len(tokens)}, got {n_keep}")
            tok, _n = tokens_arg(tokens)
            arr, nl, keep = build_layers(layers)
        except Exception as e:  # counted like the library's own refusals
            L.count_refusal(self._h.ptr, L.exc_refusal_reason(e))
            raise
        if memory_bytes is None:
            memory_bytes = sum(int(getattr(x, "nbytes", 0)) for x in keep
                               if hasattr(x, "dtype")) * n_keep // max(1, len(tokens))
        co, salt_keep = L.call_opts(cache_salt)
        rc = L.kvt_tier_spill_prefix_ex(self._h.ptr, tok, n_keep, arr, nl,
                                        int(memory_bytes), co)
        del keep, salt_keep
        if rc == L.KVT_EFULL:
            raise QueueFull(rc, L.last_error() or "spill queue full")
        if rc == L.KVT_ETOOBIG:
            raise TooBig(rc, L.last_error() or "entry too big")
        L.check(rc, "spill_prefix")

    def flush(self, timeout: Optional[float] = None) -> None:
        """Waits until every spill enqueued so far is written (or failed)."""
        ms = -1 if timeout is None else max(0, int(timeout * 1000))
        L.check(L.kvt_tier_flush(self._h.ptr, ms), "flush")

    # -- lookups ------------------------------------------------------------

    def _lookup(self, fn: Callable, tokens: Sequence[int],
                cache_salt: Any = None) -> Optional[EntryInfo]:
        tok, n = tokens_arg(tokens)
        co, keep = L.call_opts(cache_salt)
        info = L.EntryInfo()
        rc = fn(ctypes.byref(info), self._h.ptr, tok, n, co)
        del keep
        if rc == L.KVT_ENOTFOUND:
            return None
        L.check(rc, "lookup")
        return EntryInfo._from_c(info)

    def lookup(self, tokens: Sequence[int], *, cache_salt: Any = None) -> Optional[EntryInfo]:
        """The entry stored for exactly these tokens (under cache_salt), or None."""
        return self._lookup(L.kvt_tier_lookup_ex, tokens, cache_salt)

    def lookup_prefix(self, tokens: Sequence[int], *,
                      cache_salt: Any = None) -> Optional[EntryInfo]:
        """The longest stored entry whose tokens are a prefix of tokens
        (under cache_salt)."""
        return self._lookup(L.kvt_tier_lookup_prefix_ex, tokens, cache_salt)

    def read_entry(self, tokens: Sequence[int], token_hash: str, *,
                   cache_salt: Any = None) -> Optional[Entry]:
        """Reads the entry named token_hash (a lookup's) for exactly these
        tokens, as the drop-in's _read_entry: no budget, stats or touch.
        None when absent or named under another cache_salt."""
        tok, n = tokens_arg(tokens)
        co, keep = L.call_opts(cache_salt)
        e = ctypes.c_void_p()
        rc = L.kvt_tier_read_entry_ex(ctypes.byref(e), self._h.ptr, tok, n,
                                      str(token_hash).encode(), co)
        del keep
        if rc == L.KVT_ENOTFOUND:
            return None
        L.check(rc, "read_entry")
        return Entry(e.value, self._h)

    def __contains__(self, tokens: Sequence[int]) -> bool:
        return self.lookup(tokens) is not None

    # -- promote ------------------------------------------------------------

    def _finish(self, rc: int, budget: Budget, e: ctypes.c_void_p) -> Optional[Entry]:
        if budget.exc is not None:
            raise budget.exc
        if rc == L.KVT_ENOTFOUND:
            return None
        if rc == L.KVT_EBUDGET:
            raise BudgetRefused(rc, L.last_error() or "budget refused")
        L.check(rc, "promote")
        return Entry(e.value, self._h)

    def promote(self, tokens: Sequence[int], *,
                reserve: Optional[Callable[[int], bool]] = None,
                release: Optional[Callable[[int], None]] = None,
                prefix: bool = False, touch: bool = True,
                keep: Optional[int] = None, cache_salt: Any = None) -> Optional[Entry]:
        """Reads an entry synchronously: None on a miss; BudgetRefused when
        reserve(memory_bytes) says no (nothing read); KvtierCorrupt /
        OSError when the data is bad (budget released, entry quarantined).
        prefix=True promotes the longest stored prefix of tokens.
        keep=n promotes only the first n tokens of the entry stored for
        exactly `tokens` (kvt_tier_promote_trim: KV and quantized KV layers;
        only the blocks holding those rows are read). reserve then sees the
        stored memory_bytes scaled by n / len(tokens). reserve and release
        are each optional: without release nothing is handed back when the
        promote fails after reserving (reserve is then an admission check).
        ValueError for n outside [0, len(tokens)] (or with prefix=True),
        KvtierUnsupported (a
        NotImplementedError) for a layer that cannot be trimmed (arrays,
        rotating KV).  cache_salt: only entries spilled with it."""
        budget = Budget(reserve, release)
        budget.opts.flags = ((L.PROMOTE_PREFIX if prefix else 0)
                             | (0 if touch else L.PROMOTE_NO_TOUCH))
        budget.salt = L.set_promote_salt(budget.opts, cache_salt)
        tok, n = tokens_arg(tokens)
        e = ctypes.c_void_p()
        if keep is None:
            rc = L.kvt_tier_promote(ctypes.byref(e), self._h.ptr, tok, n,
                                    ctypes.byref(budget.opts))
        else:
            if prefix:
                raise ValueError("keep= and prefix=True cannot be combined")
            k = operator.index(keep)
            # Checked here: ctypes would pass keep modulo 2**64 (2**64 + 5
            # promoting 5 tokens).
            if k < 0 or k > n:
                raise ValueError(f"keep={k} is not in [0, {n}] "
                                 f"(the number of tokens)")
            rc = L.kvt_tier_promote_trim(ctypes.byref(e), self._h.ptr, tok, n,
                                         k, ctypes.byref(budget.opts))
        return self._finish(rc, budget, e)

    async def promote_async(self, tokens: Sequence[int], *,
                            reserve: Optional[Callable[[int], bool]] = None,
                            release: Optional[Callable[[int], None]] = None,
                            prefix: bool = False, touch: bool = True,
                            cache_salt: Any = None) -> Optional[Entry]:
        """promote() without blocking the event loop.  Cancelling stops the
        read, waits for it and releases the reservation."""
        budget = Budget(reserve, release)
        budget.opts.flags = ((L.PROMOTE_PREFIX if prefix else 0)
                             | (0 if touch else L.PROMOTE_NO_TOUCH))
        budget.salt = L.set_promote_salt(budget.opts, cache_salt)
        tok, n = tokens_arg(tokens)
        p = ctypes.c_void_p()
        rc = L.kvt_tier_promote_async(ctypes.byref(p), self._h.ptr, tok, n,
                                      ctypes.byref(budget.opts))
        if rc != 0:
            return self._finish(rc, budget, ctypes.c_void_p())
        return await settle(p.value, lambda rc, e: self._finish(rc, budget, e))

    # -- maintenance --------------------------------------------------------

    def touch(self, tokens: Sequence[int], *, cache_salt: Any = None) -> bool:
        """Marks an entry recently used; False if absent."""
        tok, n = tokens_arg(tokens)
        co, keep = L.call_opts(cache_salt)
        rc = L.kvt_tier_touch_ex(self._h.ptr, tok, n, co)
        del keep
        if rc == L.KVT_ENOTFOUND:
            return False
        L.check(rc, "touch")
        return True

    def remove(self, tokens: Sequence[int], *, cache_salt: Any = None) -> bool:
        """Removes an entry (files and row); False if absent."""
        tok, n = tokens_arg(tokens)
        co, keep = L.call_opts(cache_salt)
        rc = L.kvt_tier_remove_ex(self._h.ptr, tok, n, co)
        del keep
        if rc == L.KVT_ENOTFOUND:
            return False
        L.check(rc, "remove")
        return True

    def reconcile(self) -> int:
        """Drops rows without files and files without rows; returns the count."""
        return int(L.check(L.kvt_tier_reconcile(self._h.ptr), "reconcile"))

    def gc(self, *, max_bytes: int = 0, max_entries: int = 0,
           older_than: Optional[float] = None, dry_run: bool = False) -> Tuple[int, int]:
        """Applies capacity/retention now (0/None: the configured limits).
        Returns (entries removed, bytes removed)."""
        o = L.GcOpts(1, int(max_bytes), int(max_entries),
                     -1 if older_than is None else int(older_than), int(bool(dry_run)))
        r, b = ctypes.c_uint64(), ctypes.c_uint64()
        L.check(L.kvt_tier_gc(self._h.ptr, ctypes.byref(o), ctypes.byref(r), ctypes.byref(b)),
                "gc")
        return int(r.value), int(b.value)

    def entries(self) -> List[EntryInfo]:
        """Every stored entry, most recently used first."""
        out: List[EntryInfo] = []

        def visit(_ctx: Any, info: Any) -> int:
            out.append(EntryInfo._from_c(info.contents))
            return 0

        cb = L.ENTRY_VISIT_FN(visit)
        L.check(L.kvt_tier_foreach(self._h.ptr, cb, None), "entries")
        return out

    def __len__(self) -> int:
        return int(self._h.stats().entries)

    def describe(self, token_hash: str) -> dict:
        """The entry's manifest and tensor layout (no tensor data read)."""
        p = ctypes.c_void_p()
        L.check(L.kvt_tier_describe(ctypes.byref(p), self._h.ptr, token_hash.encode()),
                "describe")
        try:
            return json.loads(ctypes.string_at(p.value).decode())
        finally:
            L.kvt_free(p.value)

    def verify(self, token_hash: str, repair: bool = False) -> None:
        """Reads and checks an entry completely; raises KvtierCorrupt (with
        repair=True the entry is then quarantined) or KvtierNotFound."""
        L.check(L.kvt_tier_verify(self._h.ptr, token_hash.encode(), int(bool(repair))),
                "verify")

    # -- stats --------------------------------------------------------------

    def stats(self) -> dict:
        """The reference's stats keys (same rounding) plus kvtier's counters."""
        d = json.loads(self._render(L.kvt_stats_to_json))
        # The binding's zero-copy spills: spills per road, bytes held now.
        d.update(self._holds.stats())
        return d

    def set_host_cache_bytes(self, nbytes: Optional[int]) -> None:
        """Changes the host RAM tier's bound (None: the derived default, 0:
        off); entries beyond it are freed before this returns."""
        L.set_host_cache_bytes(self._h.ptr, nbytes)

    def trim(self, target_bytes: int = 0) -> int:
        """Memory pressure: frees host-cache entries down to target_bytes,
        then the buffer pool's idle buffers; returns the cache bytes freed."""
        return L.trim(self._h.ptr, target_bytes)

    def prometheus(self) -> str:
        """Prometheus text exposition of the stats (kvtier_* metrics)."""
        return self._render(L.kvt_stats_to_prometheus)

    def _render(self, fn: Callable) -> str:
        s = self._h.stats()
        need = ctypes.c_size_t()
        rc = fn(None, 0, ctypes.byref(need), ctypes.byref(s))
        if rc not in (0, L.KVT_ERANGE):
            L.check(rc, "stats")
        buf = ctypes.create_string_buffer(need.value)
        L.check(fn(buf, need.value, ctypes.byref(need), ctypes.byref(s)), "stats")
        return buf.value.decode()

    # -- closing ------------------------------------------------------------

    def close(self, timeout: Optional[float] = None) -> None:
        """Drains queued spills and closes; TimeoutError leaves the tier open
        (retry close)."""
        ms = -1 if timeout is None else max(0, int(timeout * 1000))
        L.check(L.kvt_tier_close(self._h.ptr, ms), "close")

    async def aclose(self, timeout: Optional[float] = None) -> None:
        """close() in a thread."""
        await asyncio.to_thread(self.close, timeout)

    def __enter__(self) -> "Tier":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["Tier", "Entry", "EntryInfo", "QueueFull", "TooBig", "BudgetRefused"]
