"""Loading libkvtier and describing its C API to ctypes.

This module finds the shared library (``KVTIER_LIBRARY``, then the build tree
of the source checkout this package lives in, then the installation prefix
this package was pip-installed into, then the system's library path),
mirrors the public structs of ``include/kvtier.h`` (and of
``include/kvtier_sys.h``, whose index and layer-file calls the drop-in uses)
as ctypes Structures (checked against ``kvt_options_size()`` at import so a
layout drift fails loudly instead of corrupting memory), declares the
prototype of every function the binding calls, and maps ``KVT_E*`` codes to
Python exceptions.  A function missing from an older library is replaced by
a stub that raises ``NotImplementedError`` when called, so the parts that do
exist stay usable.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sqlite3
from typing import Any, Callable, List, Optional

# --------------------------------------------------------------------------
# Constants (include/kvtier.h)
# --------------------------------------------------------------------------

KVT_OK = 0
KVT_EINVAL = -1
KVT_ENOMEM = -2
KVT_EIO = -3
KVT_ENOTFOUND = -4
KVT_ECORRUPT = -5
KVT_EFULL = -6
KVT_ECLOSED = -7
KVT_ETIMEDOUT = -8
KVT_ECANCELED = -9
KVT_EBUDGET = -10
KVT_ETOOBIG = -11
KVT_EPERM = -12
KVT_EBUSY = -13
KVT_EUNSUPPORTED = -14
KVT_ENOSPC = -15
KVT_EDB = -16
KVT_EAGAIN = -17
KVT_ERANGE = -18

DTYPE_INVALID = 0
DTYPE_BOOL = 1
DTYPE_U8 = 2
DTYPE_I8 = 3
DTYPE_I16 = 4
DTYPE_U16 = 5
DTYPE_F16 = 6
DTYPE_BF16 = 7
DTYPE_I32 = 8
DTYPE_U32 = 9
DTYPE_F32 = 10
DTYPE_I64 = 11
DTYPE_U64 = 12
DTYPE_F64 = 13

LAYER_KV = 1
LAYER_ROTATING_KV = 2
LAYER_ARRAYS = 3
LAYER_QUANTIZED_KV = 4

KVT_ABSENT = -(2 ** 63)
KVT_MAX_DIMS = 8
KVT_HASH_HEX_LEN = 64

STORAGE_NATIVE = 0
STORAGE_COMPAT = 1
DURABILITY_FSYNC = 0
DURABILITY_NONE = 1
IO_AUTO = 0
IO_PORTABLE = 1
IO_URING = 2

OPEN_READONLY = 0x1
OPEN_NO_RECONCILE = 0x2
OPEN_SKIP_OWNER_CHECK = 0x4
REMOTE_LOCAL = 0
REMOTE_LOCAL_AND_REMOTE = 1
REMOTE_ONLY = 2
REMOTE_NO_LOCAL_COPY = 0x1

PROMOTE_PREFIX = 0x1
PROMOTE_NO_TOUCH = 0x2

KVT_OPTIONS_VERSION = 5
KVT_PROMOTE_OPTS_VERSION = 2
KVT_CALL_OPTS_VERSION = 1
KVT_CACHE_SALT_MAX = 4096
KVT_STATS_VERSION = 3

# Reasons a spill is refused, as the kvt_stats counters spill_refused_<reason>
# (version 3) name them; a refusal decided in Python adds to one of them with
# kvt_tier_stats_add, as the library does for its own.
SPILL_REFUSAL_REASONS = ("unsupported", "invalid", "too_big", "queue_full",
                         "closed", "other")

# --------------------------------------------------------------------------
# Structs
# --------------------------------------------------------------------------

LOG_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p)
SPILL_DONE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int)
# kvt_clock_fn: the write budget's time source (seconds).
CLOCK_FN = ctypes.CFUNCTYPE(ctypes.c_double, ctypes.c_void_p)
# kvt_admission_policy, by the names the bindings take.
ADMISSION_POLICIES = {"write_all": 0, "second_sighting": 1, "adaptive": 2}
# The admission and write-budget fields of kvt_stats (version 3), in the
# struct's order (admission_declined_oversize was appended after the others).
ADMISSION_STAT_FIELDS = ("admission_admitted", "admission_truncated",
                         "admission_declined_unseen", "admission_declined_budget",
                         "admission_tokens_declined", "bytes_written_today",
                         "write_budget_bytes_per_day", "write_budget_left",
                         "admission_declined_oversize")
RESERVE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64)
RELEASE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint64)
RELEASE_CTX_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
WRITE_HOOK_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64,
                                 ctypes.POINTER(ctypes.c_int32), ctypes.c_size_t,
                                 ctypes.c_uint64)


class Tensor(ctypes.Structure):
    """struct kvt_tensor."""

    _fields_ = [
        ("dtype", ctypes.c_int32),
        ("ndim", ctypes.c_uint32),
        ("shape", ctypes.c_int64 * KVT_MAX_DIMS),
        ("data", ctypes.c_void_p),
        ("nbytes", ctypes.c_uint64),
    ]


class Layer(ctypes.Structure):
    """struct kvt_layer."""

    _fields_ = [
        ("kind", ctypes.c_int32),
        ("num_tensors", ctypes.c_uint32),
        ("tensors", ctypes.POINTER(Tensor)),
        ("offset", ctypes.c_int64),
        ("max_size", ctypes.c_int64),
        ("keep", ctypes.c_int64),
        ("step", ctypes.c_int64),
        ("idx", ctypes.c_int64),
        ("bits", ctypes.c_int32),
        ("group_size", ctypes.c_int32),
        ("orig_dtypes", ctypes.POINTER(ctypes.c_int32)),
    ]


class Options(ctypes.Structure):
    """struct kvt_options (KVT_OPTIONS_VERSION 5)."""

    _fields_ = [
        ("version", ctypes.c_uint),
        ("cache_dir", ctypes.c_char_p),
        ("model_name", ctypes.c_char_p),
        ("max_size_gb", ctypes.c_double),
        ("max_entries", ctypes.c_int64),
        ("file_mode", ctypes.c_uint32),
        ("dir_mode", ctypes.c_uint32),
        ("spill_queue_size", ctypes.c_uint32),
        ("spill_queue_bytes", ctypes.c_uint64),
        ("retention_seconds", ctypes.c_int64),
        ("storage_mode", ctypes.c_int32),
        ("durability", ctypes.c_int32),
        ("io_backend", ctypes.c_int32),
        ("promote_threads", ctypes.c_uint32),
        ("quarantine_max", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("log_fn", LOG_FN),
        ("log_ctx", ctypes.c_void_p),
        ("log_level", ctypes.c_int32),
        ("spill_done_fn", SPILL_DONE_FN),
        ("spill_done_ctx", ctypes.c_void_p),
        # The shared remote tier (Redis / Valkey).
        ("remote_url", ctypes.c_char_p),
        ("remote_mode", ctypes.c_int32),
        ("remote_prefix", ctypes.c_char_p),
        ("remote_timeout_ms", ctypes.c_uint32),
        ("remote_queue_size", ctypes.c_uint32),
        ("remote_chunk_bytes", ctypes.c_uint64),
        ("remote_flags", ctypes.c_uint32),
        # Version 2.
        ("read_threads", ctypes.c_uint32),
        # Version 3.
        ("host_cache_bytes", ctypes.c_uint64),
        # (version 3) the chunked native store.
        ("chunk_tokens", ctypes.c_uint32),
        ("model_id", ctypes.c_char_p),
        # Version 4.
        ("remote_lookup_timeout_ms", ctypes.c_uint32),
        ("remote_tls_ca_file", ctypes.c_char_p),
        ("remote_tls_cert_file", ctypes.c_char_p),
        ("remote_tls_key_file", ctypes.c_char_p),
        # Version 5: admission and the write budget.
        ("admission_policy", ctypes.c_int32),
        ("admission_memory_bytes", ctypes.c_uint64),
        ("write_budget_bytes_per_day", ctypes.c_uint64),
        ("write_budget_tbw", ctypes.c_double),
        ("write_budget_years", ctypes.c_double),
        ("clock_fn", CLOCK_FN),
        ("clock_ctx", ctypes.c_void_p),
    ]


class EntryInfo(ctypes.Structure):
    """struct kvt_entry_info."""

    _fields_ = [
        ("token_hash", ctypes.c_char * (KVT_HASH_HEX_LEN + 1)),
        ("prefix_hash", ctypes.c_char * (KVT_HASH_HEX_LEN + 1)),
        ("num_tokens", ctypes.c_uint64),
        ("memory_bytes", ctypes.c_uint64),
        ("disk_bytes", ctypes.c_uint64),
        ("created_at", ctypes.c_double),
        ("accessed_at", ctypes.c_double),
    ]


ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint32,
                            ctypes.c_uint32, ctypes.POINTER(Tensor))
FREE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)
LAYER_READY_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint32,
                                  ctypes.POINTER(Layer))
ENTRY_VISIT_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p,
                                  ctypes.POINTER(EntryInfo))


class PromoteOpts(ctypes.Structure):
    """struct kvt_promote_opts."""

    _fields_ = [
        ("version", ctypes.c_uint),
        ("flags", ctypes.c_uint32),
        ("reserve", RESERVE_FN),
        ("release", RELEASE_FN),
        ("budget_ctx", ctypes.c_void_p),
        ("alloc", ALLOC_FN),
        ("free_buf", FREE_FN),
        ("alloc_ctx", ctypes.c_void_p),
        ("on_layer", LAYER_READY_FN),
        ("layer_ctx", ctypes.c_void_p),
        # version 2
        ("cache_salt", ctypes.c_void_p),
        ("cache_salt_len", ctypes.c_size_t),
    ]


class CallOpts(ctypes.Structure):
    """struct kvt_call_opts."""

    _fields_ = [
        ("version", ctypes.c_uint),
        ("cache_salt", ctypes.c_void_p),
        ("cache_salt_len", ctypes.c_size_t),
    ]


def salt_bytes(cache_salt):
    """A cache_salt keyword (None, str or bytes-like) as bytes or None."""
    if cache_salt is None:
        return None
    if isinstance(cache_salt, str):
        b = cache_salt.encode("utf-8")
    elif isinstance(cache_salt, (bytes, bytearray, memoryview)):
        b = bytes(cache_salt)
    else:
        raise TypeError(f"cache_salt must be str or bytes, not {type(cache_salt).__name__}")
    if len(b) > KVT_CACHE_SALT_MAX:
        raise ValueError(f"cache_salt of {len(b)} bytes (at most {KVT_CACHE_SALT_MAX})")
    return b or None


def call_opts(cache_salt):
    """(CallOpts pointer or None, keep-alive) for a cache_salt keyword."""
    b = salt_bytes(cache_salt)
    if b is None:
        return None, None
    buf = ctypes.create_string_buffer(b, len(b))
    co = CallOpts(KVT_CALL_OPTS_VERSION, ctypes.cast(buf, ctypes.c_void_p), len(b))
    return ctypes.byref(co), (co, buf)


def set_promote_salt(opts, cache_salt):
    """Sets a PromoteOpts' salt; returns the buffer to keep alive."""
    b = salt_bytes(cache_salt)
    if b is None:
        opts.cache_salt = None
        opts.cache_salt_len = 0
        return None
    buf = ctypes.create_string_buffer(b, len(b))
    opts.cache_salt = ctypes.cast(buf, ctypes.c_void_p)
    opts.cache_salt_len = len(b)
    return buf


class Stats(ctypes.Structure):
    """struct kvt_stats (KVT_STATS_VERSION 3); a new one is ready for
    kvt_tier_stats (its version is set)."""

    _fields_ = [
        ("version", ctypes.c_uint),
        ("reserved", ctypes.c_uint),
        ("spill_count", ctypes.c_uint64),
        ("spill_bytes", ctypes.c_uint64),
        ("ssd_hits", ctypes.c_uint64),
        ("ssd_misses", ctypes.c_uint64),
        ("reload_latency_sum", ctypes.c_double),
        ("reload_bytes", ctypes.c_uint64),
        ("promotion_failures", ctypes.c_uint64),
        ("spill_drops", ctypes.c_uint64),
        ("spill_rejects", ctypes.c_uint64),
        ("write_failures", ctypes.c_uint64),
        ("evictions", ctypes.c_uint64),
        ("expirations", ctypes.c_uint64),
        ("quarantined", ctypes.c_uint64),
        ("reconciled", ctypes.c_uint64),
        ("promotions_cancelled", ctypes.c_uint64),
        ("entries", ctypes.c_uint64),
        ("disk_bytes", ctypes.c_uint64),
        ("memory_bytes", ctypes.c_uint64),
        ("queue_depth", ctypes.c_uint64),
        ("queue_bytes", ctypes.c_uint64),
        ("remote_hits", ctypes.c_uint64),
        ("remote_misses", ctypes.c_uint64),
        ("remote_read_bytes", ctypes.c_uint64),
        ("remote_latency_sum", ctypes.c_double),
        ("remote_spill_count", ctypes.c_uint64),
        ("remote_spill_bytes", ctypes.c_uint64),
        ("remote_spill_drops", ctypes.c_uint64),
        ("remote_errors", ctypes.c_uint64),
        ("remote_queue_depth", ctypes.c_uint64),
        ("remote_available", ctypes.c_uint64),
        ("tokens_requested", ctypes.c_uint64),
        ("tokens_served", ctypes.c_uint64),
        ("promote_latency_hist", ctypes.c_uint64 * 15),  # KVT_STATS_LATENCY_BUCKETS
        ("spill_latency_hist", ctypes.c_uint64 * 15),
        ("spill_latency_sum", ctypes.c_double),
        ("host_cache_bytes_used", ctypes.c_uint64),
        ("host_cache_bytes_bound", ctypes.c_uint64),
        ("host_cache_entries", ctypes.c_uint64),
        ("host_cache_hits", ctypes.c_uint64),
        ("host_cache_misses", ctypes.c_uint64),
        ("host_cache_evictions", ctypes.c_uint64),
        ("host_cache_verify_failures", ctypes.c_uint64),
        ("promotes_from_ram", ctypes.c_uint64),
        ("promote_ram_bytes", ctypes.c_uint64),
        ("promotes_from_disk", ctypes.c_uint64),
        ("promote_disk_bytes", ctypes.c_uint64),
        # ---- version 3 ----
        ("spill_refused_unsupported", ctypes.c_uint64),
        ("spill_refused_invalid", ctypes.c_uint64),
        ("spill_refused_too_big", ctypes.c_uint64),
        ("spill_refused_queue_full", ctypes.c_uint64),
        ("spill_refused_closed", ctypes.c_uint64),
        ("spill_refused_other", ctypes.c_uint64),
        # version 3: the chunked store's contained damage
        ("chunks_quarantined", ctypes.c_uint64),
        ("entries_unservable", ctypes.c_uint64),
        ("chunks_rewritten", ctypes.c_uint64),
        ("chain_cuts_kept", ctypes.c_uint64),
        ("host_cache_chunks", ctypes.c_uint64),
        ("host_cache_chunk_bytes", ctypes.c_uint64),
        # version 3: group commit of queued spills
        ("spill_batches", ctypes.c_uint64),
        ("spills_batched", ctypes.c_uint64),
        # version 3: admission and the write budget
        ("admission_admitted", ctypes.c_uint64),
        ("admission_truncated", ctypes.c_uint64),
        ("admission_declined_unseen", ctypes.c_uint64),
        ("admission_declined_budget", ctypes.c_uint64),
        ("admission_tokens_declined", ctypes.c_uint64),
        ("bytes_written_today", ctypes.c_uint64),
        ("write_budget_bytes_per_day", ctypes.c_uint64),
        ("write_budget_left", ctypes.c_uint64),
        ("ssd_lifetime_years", ctypes.c_double),
        # version 3: entries of another layout than the tier's spills
        ("layout_misses", ctypes.c_uint64),
        # version 3: spills larger than the write budget's whole bucket
        ("admission_declined_oversize", ctypes.c_uint64),
    ]

    def __init__(self, *args: Any, **kw: Any) -> None:
        kw.setdefault("version", KVT_STATS_VERSION)
        super().__init__(*args, **kw)


class IndexRow(ctypes.Structure):
    """struct kvt_index_row (include/kvtier_sys.h)."""

    _fields_ = [
        ("token_hash", ctypes.c_char * (KVT_HASH_HEX_LEN + 1)),
        ("file_path", ctypes.c_char * (KVT_HASH_HEX_LEN + 8)),
        ("num_tokens", ctypes.c_uint64),
        ("memory_bytes", ctypes.c_uint64),
        ("created_at", ctypes.c_double),
        ("accessed_at", ctypes.c_double),
        ("tokens", ctypes.POINTER(ctypes.c_int32)),
        ("n_tokens", ctypes.c_size_t),
    ]


class IndexRows(ctypes.Structure):
    """struct kvt_index_rows (include/kvtier_sys.h)."""

    _fields_ = [("rows", ctypes.POINTER(IndexRow)), ("count", ctypes.c_size_t)]


class GcOpts(ctypes.Structure):
    """struct kvt_gc_opts."""

    _fields_ = [
        ("version", ctypes.c_uint),
        ("max_bytes", ctypes.c_uint64),
        ("max_entries", ctypes.c_int64),
        ("older_than_seconds", ctypes.c_int64),
        ("dry_run", ctypes.c_int),
    ]


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------


class KvtierError(Exception):
    """A libkvtier failure: ``code`` is the KVT_E* code, ``errno`` the OS
    errno when the failure came from the OS (else 0)."""

    def __init__(self, code: int, message: str, errno_: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.errno = errno_


class KvtierValueError(KvtierError, ValueError):
    """KVT_EINVAL / KVT_ERANGE: bad argument or option."""


class KvtierOSError(KvtierError, OSError):
    """KVT_EIO / KVT_ENOSPC / KVT_EPERM / KVT_EBUSY: the OS said no."""

    def __init__(self, code: int, message: str, errno_: int = 0) -> None:
        KvtierError.__init__(self, code, message, errno_)
        self.args = (errno_ or None, message)
        self.strerror = message


class KvtierPermissionError(KvtierOSError, PermissionError):
    """KVT_EPERM: unsafe ownership/permissions or a symlink."""


class KvtierMemoryError(KvtierError, MemoryError):
    """KVT_ENOMEM."""


class KvtierTimeoutError(KvtierError, TimeoutError):
    """KVT_ETIMEDOUT."""


class KvtierDatabaseError(KvtierError, sqlite3.DatabaseError):
    """KVT_EDB: an SQLite failure (a sqlite3.DatabaseError, as the reference
    would raise)."""


class KvtierNotFound(KvtierError, KeyError):
    """KVT_ENOTFOUND."""

    def __str__(self) -> str:  # KeyError quotes its message otherwise
        return Exception.__str__(self)


class KvtierCorrupt(KvtierError):
    """KVT_ECORRUPT: stored data failed validation (and was not served)."""


class KvtierClosed(KvtierError):
    """KVT_ECLOSED: the tier is closed."""


class KvtierUnsupported(KvtierError, NotImplementedError):
    """KVT_EUNSUPPORTED."""


_EXC = {
    KVT_EINVAL: KvtierValueError,
    KVT_ERANGE: KvtierValueError,
    KVT_ENOMEM: KvtierMemoryError,
    KVT_EIO: KvtierOSError,
    KVT_ENOSPC: KvtierOSError,
    KVT_EPERM: KvtierPermissionError,
    KVT_EBUSY: KvtierOSError,
    KVT_ETIMEDOUT: KvtierTimeoutError,
    KVT_EDB: KvtierDatabaseError,
    KVT_ENOTFOUND: KvtierNotFound,
    KVT_ECORRUPT: KvtierCorrupt,
    KVT_ECLOSED: KvtierClosed,
    KVT_EUNSUPPORTED: KvtierUnsupported,
}


# --------------------------------------------------------------------------
# Finding and loading the library
# --------------------------------------------------------------------------


class LibraryNotFoundError(ImportError):
    """libkvtier could not be loaded; the message lists every place tried."""


def _build_tree_candidates() -> List[str]:
    """libkvtier.so* in build/ of the source checkout containing this
    package (walking up to the directory that has include/kvtier.h)."""
    here = os.path.dirname(os.path.abspath(__file__))
    d = here
    while True:
        if os.path.isfile(os.path.join(d, "include", "kvtier.h")):
            hits = sorted(glob.glob(os.path.join(d, "build", "libkvtier.so*")),
                          key=len)
            return hits or [os.path.join(d, "build", "libkvtier.so")]
        parent = os.path.dirname(d)
        if parent == d:
            return []
        d = parent


def _prefix_candidates() -> List[str]:
    """libkvtier in the installation prefix this package was installed into.

    A package installed with ``pip install --prefix P`` sits in
    ``P/lib/pythonX.Y/site-packages/kvtier`` (Debian's pip adds ``local/``:
    ``P/local/lib/pythonX.Y/dist-packages/kvtier``), and ``cmake --install
    --prefix P`` puts the library in ``P/lib``, ``P/lib64`` or
    ``P/lib/<multiarch>``.  The prefix is the directory above the last
    ``lib*/python*`` pair of this file's path (and its parent when it is a
    ``local/`` directory)."""
    import sysconfig

    parts = os.path.dirname(os.path.abspath(__file__)).split(os.sep)
    prefixes: List[str] = []
    for i in range(len(parts) - 2, 0, -1):
        if parts[i].startswith("lib") and parts[i + 1].startswith("python"):
            prefix = os.sep.join(parts[:i]) or os.sep
            prefixes.append(prefix)
            if os.path.basename(prefix) == "local":
                prefixes.append(os.path.dirname(prefix))
            break
    libdirs = ["lib", "lib64"]
    multiarch = sysconfig.get_config_var("MULTIARCH")
    if multiarch:
        libdirs.append(os.path.join("lib", multiarch))
    out: List[str] = []
    for prefix in prefixes:
        for libdir in libdirs:
            for name in ("libkvtier.so.0", "libkvtier.so", "libkvtier.0.dylib",
                         "libkvtier.dylib"):
                out.append(os.path.join(prefix, libdir, name))
    return out


def _load() -> tuple[ctypes.CDLL, str]:
    tried: List[str] = []
    env = os.environ.get("KVTIER_LIBRARY")
    if env:
        # An explicit choice that fails is an error, not a reason to load
        # some other copy silently.
        try:
            return ctypes.CDLL(env), env
        except OSError as e:
            raise LibraryNotFoundError(
                f"kvtier: cannot load libkvtier. Tried:\n  KVTIER_LIBRARY={env}: {e}\n"
                "Unset KVTIER_LIBRARY to search the build tree and the system.") from e
    else:
        tried.append("KVTIER_LIBRARY: not set")
    for cand in _build_tree_candidates():
        if not os.path.exists(cand):
            tried.append(f"build tree {cand}: no such file")
            continue
        try:
            return ctypes.CDLL(cand), cand
        except OSError as e:
            tried.append(f"build tree {cand}: {e}")
    for cand in _prefix_candidates():
        if not os.path.exists(cand):
            continue
        try:
            return ctypes.CDLL(cand), cand
        except OSError as e:
            tried.append(f"install prefix {cand}: {e}")
    tried.append("install prefix of this package: no libkvtier")
    found = ctypes.util.find_library("kvtier")
    names = [found] if found else []
    tried.append(f"ctypes.util.find_library('kvtier'): {found or 'nothing'}")
    names.append("libkvtier.so.0")
    for name in names:
        try:
            return ctypes.CDLL(name), name
        except OSError as e:
            tried.append(f"system {name}: {e}")
    raise LibraryNotFoundError(
        "kvtier: cannot load libkvtier. Tried:\n  " + "\n  ".join(tried)
        + "\nSet KVTIER_LIBRARY to the path of libkvtier.so, build the "
        "library (cmake --build build), or install it.")


lib, library_path = _load()

c_char_p = ctypes.c_char_p
c_int = ctypes.c_int
c_int32 = ctypes.c_int32
c_int64 = ctypes.c_int64
c_uint32 = ctypes.c_uint32
c_uint64 = ctypes.c_uint64
c_size_t = ctypes.c_size_t
c_void_p = ctypes.c_void_p
c_double = ctypes.c_double
P = ctypes.POINTER
PI32 = P(c_int32)

missing: List[str] = []


def _proto(name: str, restype: Any, argtypes: list) -> Callable:
    try:
        fn = getattr(lib, name)
    except AttributeError:
        missing.append(name)

        def _stub(*_a: Any, **_k: Any) -> Any:
            raise NotImplementedError(
                f"{name} is not exported by {library_path} (library too old?)")

        _stub.__name__ = name
        return _stub
    fn.restype = restype
    fn.argtypes = argtypes
    return fn


# Version, errors.
kvt_version = _proto("kvt_version", c_char_p, [])
kvt_strerror = _proto("kvt_strerror", c_char_p, [c_int])
kvt_last_error = _proto("kvt_last_error", c_char_p, [])
kvt_last_errno = _proto("kvt_last_errno", c_int, [])
kvt_free = _proto("kvt_free", None, [c_void_p])

# Dtypes, hashes.
kvt_token_hash = _proto("kvt_token_hash", c_int, [c_char_p, PI32, c_size_t])
kvt_layer_init = _proto("kvt_layer_init", None, [P(Layer), c_int])

# Options.
kvt_options_init = _proto("kvt_options_init", c_int, [P(Options), ctypes.c_uint])
kvt_options_validate = _proto("kvt_options_validate", c_int, [P(Options)])
kvt_options_size = _proto("kvt_options_size", c_size_t, [])
kvt_stats_size = _proto("kvt_stats_size", c_size_t, [])
kvt_promote_opts_init = _proto("kvt_promote_opts_init", c_int,
                               [P(PromoteOpts), ctypes.c_uint])

# Entries.
kvt_entry_num_layers = _proto("kvt_entry_num_layers", c_uint32, [c_void_p])
kvt_entry_layer = _proto("kvt_entry_layer", P(Layer), [c_void_p, c_uint32])
kvt_entry_tokens = _proto("kvt_entry_tokens", PI32, [c_void_p, P(c_size_t)])
kvt_entry_memory_bytes = _proto("kvt_entry_memory_bytes", c_uint64, [c_void_p])
kvt_entry_reserved_bytes = _proto("kvt_entry_reserved_bytes", c_uint64, [c_void_p])
kvt_entry_disk_bytes = _proto("kvt_entry_disk_bytes", c_uint64, [c_void_p])
kvt_entry_hash = _proto("kvt_entry_hash", c_char_p, [c_void_p])
kvt_entry_storage_mode = _proto("kvt_entry_storage_mode", c_int, [c_void_p])
kvt_entry_free = _proto("kvt_entry_free", None, [c_void_p])

# Tier.
kvt_tier_open = _proto("kvt_tier_open", c_int, [P(c_void_p), P(Options)])
kvt_tier_start_writer = _proto("kvt_tier_start_writer", c_int, [c_void_p])
kvt_tier_close = _proto("kvt_tier_close", c_int, [c_void_p, c_int64])
kvt_tier_close_queued = _proto("kvt_tier_close_queued", c_int, [c_void_p, c_int64])
kvt_tier_set_write_hook = _proto("kvt_tier_set_write_hook", c_int,
                                 [c_void_p, WRITE_HOOK_FN, c_void_p])
kvt_tier_write_pending = _proto("kvt_tier_write_pending", c_int, [c_void_p, c_uint64])
kvt_tier_free = _proto("kvt_tier_free", None, [c_void_p])
kvt_tier_spill_nocopy_ex = _proto("kvt_tier_spill_nocopy_ex", c_int,
                                  [c_void_p, PI32, c_size_t, P(Layer), c_uint32, c_uint64,
                                   RELEASE_CTX_FN, c_void_p, P(CallOpts)])
kvt_tier_spill_prefix_ex = _proto("kvt_tier_spill_prefix_ex", c_int,
                                  [c_void_p, PI32, c_size_t, P(Layer), c_uint32, c_uint64,
                                   P(CallOpts)])
kvt_tier_flush = _proto("kvt_tier_flush", c_int, [c_void_p, c_int64])
kvt_tier_promote = _proto("kvt_tier_promote", c_int,
                          [P(c_void_p), c_void_p, PI32, c_size_t, P(PromoteOpts)])
kvt_tier_promote_trim = _proto("kvt_tier_promote_trim", c_int,
                               [P(c_void_p), c_void_p, PI32, c_size_t, c_size_t,
                                P(PromoteOpts)])
kvt_buffers_set_idle_cap = _proto("kvt_buffers_set_idle_cap", c_int,
                                  [ctypes.c_uint64])
kvt_buffers_trim = _proto("kvt_buffers_trim", None, [])
HOST_CACHE_AUTO = (1 << 64) - 1  # KVT_HOST_CACHE_AUTO
kvt_tier_set_host_cache_bytes = _proto("kvt_tier_set_host_cache_bytes", c_int,
                                       [c_void_p, ctypes.c_uint64])
kvt_tier_trim = _proto("kvt_tier_trim", c_int,
                       [c_void_p, ctypes.c_uint64,
                        ctypes.POINTER(ctypes.c_uint64)])


def set_host_cache_bytes(tier_ptr: int, nbytes: Optional[int]) -> None:
    """kvt_tier_set_host_cache_bytes (None: the derived default)."""
    v = HOST_CACHE_AUTO if nbytes is None else int(nbytes)
    if v < 0:
        raise ValueError(f"host_cache_bytes must be >= 0 or None, got {v}")
    check(kvt_tier_set_host_cache_bytes(tier_ptr, v), "set_host_cache_bytes")


def trim(tier_ptr: int, target_bytes: int) -> int:
    """kvt_tier_trim; returns the host-cache bytes freed."""
    freed = ctypes.c_uint64()
    check(kvt_tier_trim(tier_ptr, int(target_bytes), ctypes.byref(freed)), "trim")
    return int(freed.value)
kvt_buffers_stats = _proto("kvt_buffers_stats", c_int,
                           [P(ctypes.c_uint64), P(ctypes.c_uint64),
                            P(ctypes.c_uint64)])
kvt_tier_promote_async = _proto("kvt_tier_promote_async", c_int,
                                [P(c_void_p), c_void_p, PI32, c_size_t,
                                 P(PromoteOpts)])
kvt_promise_wait = _proto("kvt_promise_wait", c_int, [c_void_p, c_int64])
kvt_promise_fd = _proto("kvt_promise_fd", c_int, [c_void_p])
kvt_promise_result = _proto("kvt_promise_result", c_int, [P(c_void_p), c_void_p])
kvt_promise_cancel = _proto("kvt_promise_cancel", c_int, [c_void_p])
kvt_promise_free = _proto("kvt_promise_free", None, [c_void_p])
# The cache_salt calls (kvt_call_opts; NULL = no salt).
kvt_tier_spill_ex = _proto("kvt_tier_spill_ex", c_int,
                           [c_void_p, PI32, c_size_t, P(Layer), c_uint32, c_uint64,
                            P(CallOpts)])
kvt_tier_lookup_ex = _proto("kvt_tier_lookup_ex", c_int,
                            [P(EntryInfo), c_void_p, PI32, c_size_t, P(CallOpts)])
kvt_tier_lookup_prefix_ex = _proto("kvt_tier_lookup_prefix_ex", c_int,
                                   [P(EntryInfo), c_void_p, PI32, c_size_t, P(CallOpts)])
kvt_tier_read_entry_ex = _proto("kvt_tier_read_entry_ex", c_int,
                                [P(c_void_p), c_void_p, PI32, c_size_t, c_char_p,
                                 P(CallOpts)])
kvt_tier_touch_ex = _proto("kvt_tier_touch_ex", c_int, [c_void_p, PI32, c_size_t, P(CallOpts)])
kvt_tier_remove_ex = _proto("kvt_tier_remove_ex", c_int, [c_void_p, PI32, c_size_t, P(CallOpts)])
kvt_tier_reconcile = _proto("kvt_tier_reconcile", c_int64, [c_void_p])
kvt_tier_gc = _proto("kvt_tier_gc", c_int,
                     [c_void_p, P(GcOpts), P(c_uint64), P(c_uint64)])
kvt_tier_foreach = _proto("kvt_tier_foreach", c_int,
                          [c_void_p, ENTRY_VISIT_FN, c_void_p])
kvt_tier_describe = _proto("kvt_tier_describe", c_int,
                           [P(c_void_p), c_void_p, c_char_p])
kvt_tier_verify = _proto("kvt_tier_verify", c_int, [c_void_p, c_char_p, c_int])
kvt_tier_dir = _proto("kvt_tier_dir", c_char_p, [c_void_p])
kvt_tier_stats = _proto("kvt_tier_stats", c_int, [P(Stats), c_void_p])
kvt_tier_stats_add = _proto("kvt_tier_stats_add", c_int,
                            [c_void_p, c_char_p, c_int64])
kvt_stats_to_json = _proto("kvt_stats_to_json", c_int,
                           [c_char_p, c_size_t, P(c_size_t), P(Stats)])
kvt_stats_to_prometheus = _proto("kvt_stats_to_prometheus", c_int,
                                 [c_char_p, c_size_t, P(c_size_t), P(Stats)])

# Index.
kvt_index_rows_free = _proto("kvt_index_rows_free", None, [P(IndexRows)])
kvt_index_open = _proto("kvt_index_open", c_int, [P(c_void_p), c_char_p])
kvt_index_close = _proto("kvt_index_close", None, [c_void_p])
kvt_index_insert = _proto("kvt_index_insert", c_int,
                          [c_void_p, PI32, c_size_t, c_char_p, c_uint64, c_uint64])
kvt_index_get = _proto("kvt_index_get", c_int,
                       [P(IndexRows), c_void_p, PI32, c_size_t])
kvt_index_row_file_path = _proto("kvt_index_row_file_path", c_char_p, [P(IndexRow)])
kvt_index_lookup_prefix = _proto("kvt_index_lookup_prefix", c_int,
                                 [P(IndexRows), c_void_p, PI32, c_size_t])
kvt_index_delete = _proto("kvt_index_delete", c_int, [c_void_p, PI32, c_size_t])
kvt_index_lru = _proto("kvt_index_lru", c_int, [P(IndexRows), c_void_p, c_size_t])
kvt_index_total_bytes = _proto("kvt_index_total_bytes", c_int,
                               [P(c_uint64), c_void_p])
kvt_index_count = _proto("kvt_index_count", c_int, [P(c_uint64), c_void_p])
kvt_index_touch = _proto("kvt_index_touch", c_int, [c_void_p, PI32, c_size_t])
kvt_index_all = _proto("kvt_index_all", c_int, [P(IndexRows), c_void_p])

# Layer files.
kvt_layer_save = _proto("kvt_layer_save", c_int,
                        [P(c_void_p), c_char_p, P(Layer), c_uint32, c_int, c_uint32])
kvt_layer_load = _proto("kvt_layer_load", c_int, [P(c_void_p), c_char_p, c_char_p])

# The struct mirrors must match the library's layout exactly.
for _struct, _cname, _size_fn in ((Options, "kvt_options", "kvt_options_size"),
                                  (Stats, "kvt_stats", "kvt_stats_size")):
    if _size_fn not in missing:
        _c_size = globals()[_size_fn]()
        if ctypes.sizeof(_struct) != _c_size:
            raise ImportError(
                f"kvtier: ctypes {_struct.__name__} mirror is "
                f"{ctypes.sizeof(_struct)} bytes but {library_path} reports "
                f"sizeof({_cname}) = {_c_size}; the binding and the library "
                "disagree on include/kvtier.h")


def exc_refusal_reason(exc: BaseException) -> str:
    """The refusal reason of an exception raised while the layers were turned
    into kvtier's (classification, conversion).  An exception may name its
    own (attribute ``kvt_refusal_reason``, one of SPILL_REFUSAL_REASONS);
    otherwise a layer class that is not stored reads "unsupported" in its
    message, any other bad value is "invalid"."""
    named = getattr(exc, "kvt_refusal_reason", None)
    if named in SPILL_REFUSAL_REASONS:
        return named
    if "unsupported" in str(exc).lower() or isinstance(exc, NotImplementedError):
        return "unsupported"
    if isinstance(exc, (ValueError, TypeError, OverflowError)):
        return "invalid"
    return "other"


def count_refusal(tier_ptr: int, reason: str) -> None:
    """Adds a spill refused in Python (before the library saw it) to the
    tier's spill_refused_<reason> counter."""
    kvt_tier_stats_add(tier_ptr, f"spill_refused_{reason}".encode(), 1)


def last_error() -> str:
    """This thread's last libkvtier error message."""
    msg = kvt_last_error()
    return msg.decode("utf-8", "replace") if msg else ""


def strerror(code: int) -> str:
    s = kvt_strerror(code)
    return s.decode("utf-8", "replace") if s else f"error {code}"


def error(code: int, what: str = "") -> KvtierError:
    """The exception for a negative KVT_E* code, with this thread's message."""
    msg = last_error() or strerror(code)
    if what:
        msg = f"{what}: {msg}"
    errno_ = kvt_last_errno() if "kvt_last_errno" not in missing else 0
    cls = _EXC.get(code, KvtierError)
    return cls(code, msg, errno_)


def check(rc: int, what: str = "") -> int:
    """Raises the mapped exception when rc < 0; returns rc otherwise."""
    if rc < 0:
        raise error(rc, what)
    return rc


REMOTE_MODES = {"local": REMOTE_LOCAL, "local+remote": REMOTE_LOCAL_AND_REMOTE,
                "remote": REMOTE_ONLY}


def set_remote_options(o: Any, keep: list, url: Any = None, mode: str = "local",
                       prefix: Any = None, timeout_ms: int = 1000,
                       lookup_timeout_ms: int = 250, keep_local: bool = True,
                       tls_ca_file: Any = None, tls_cert_file: Any = None,
                       tls_key_file: Any = None) -> None:
    """Fills the remote-tier fields of a kvt_options (shared by
    SSDCacheConfig and kvtier.Tier); the byte strings go to keep, which must
    outlive kvt_tier_open.  Validation is kvt_options_validate's."""
    if mode not in REMOTE_MODES:
        raise ValueError("remote_mode must be 'local', 'local+remote' or 'remote', "
                         f"got {mode!r}")
    o.remote_mode = REMOTE_MODES[mode]
    for field, val in (("remote_url", url), ("remote_prefix", prefix)):
        if val is not None:
            keep.append(str(val).encode("utf-8"))
            setattr(o, field, keep[-1])
    for field, val in (("remote_tls_ca_file", tls_ca_file),
                       ("remote_tls_cert_file", tls_cert_file),
                       ("remote_tls_key_file", tls_key_file)):
        if val is not None:
            keep.append(fs_path(val))
            setattr(o, field, keep[-1])
    o.remote_timeout_ms = int(timeout_ms)
    o.remote_lookup_timeout_ms = int(lookup_timeout_ms)
    if not keep_local:
        o.remote_flags |= REMOTE_NO_LOCAL_COPY


def set_admission_options(o: Any, keep: list, policy: str = "adaptive",
                          memory_bytes: int = 0, budget_bytes_per_day: int = 0,
                          budget_tbw: float = 0.0, budget_years: float = 0.0,
                          clock: Any = None) -> None:
    """Fills the admission and write-budget fields of a kvt_options (shared by
    SSDCacheConfig and kvtier.Tier).  clock (a callable returning seconds, or
    None for the wall clock) is wrapped as a kvt_clock_fn appended to keep,
    which must then outlive the tier, not only kvt_tier_open.  Ranges are
    kvt_options_validate's; a value no C field can hold is refused here."""
    if policy not in ADMISSION_POLICIES:
        raise ValueError("admission_policy must be one of "
                         f"{', '.join(repr(k) for k in ADMISSION_POLICIES)}; got {policy!r}")
    o.admission_policy = ADMISSION_POLICIES[policy]
    for name, v in (("admission_memory_bytes", memory_bytes),
                    ("write_budget_bytes_per_day", budget_bytes_per_day)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{name} must be an integer number of bytes, got {v!r}")
        if not 0 <= v < 2**64:
            raise ValueError(f"{name} must be >= 0 (0 = none/default), got {v}")
        setattr(o, name, v)
    for name, v in (("write_budget_tbw", budget_tbw), ("write_budget_years", budget_years)):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"{name} must be a number, got {v!r}")
        setattr(o, name, float(v))
    if clock is not None:
        if not callable(clock):
            raise ValueError(f"clock must be a callable returning seconds, got {clock!r}")

        def _now(_ctx: Any) -> float:
            return float(clock())
        fn = CLOCK_FN(_now)
        keep.append(fn)
        o.clock_fn = fn


def fs_path(p: Any) -> bytes:
    """os.PathLike / str / bytes -> bytes for a const char* argument."""
    return os.fsencode(os.fspath(p))


def opt_fs_path(p: Optional[Any]) -> Optional[bytes]:
    return None if p is None else fs_path(p)
