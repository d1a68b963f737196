/*
 * kvtier.h - the public C API of kvtier, a cold KV-cache tier on local SSD for
 * LLM inference servers: everything an inference engine (or a binding for
 * one) calls to configure a tier, spill, look up and promote KV caches, keep
 * tenants apart, maintain the directory and read the counters. This header is
 * the manual: every function documents its return codes, what state remains
 * after a failure, who owns what, and which threads may call it.
 *
 * Stability: within a major version (the library's soname) every call here
 * keeps its signature and meaning, and every struct keeps its layout, growing
 * only at its end (versioned structs, below), so a program built against one
 * 0.x release runs against any later 0.x library. kvtier installs a second
 * header, kvtier_sys.h (which includes this one), for its own tools and for
 * the reference implementation's index and layer files; its calls carry a
 * weaker promise, stated there.
 *
 * Conventions (shared by every function below and in kvtier_sys.h):
 *  - Return codes: 0 (KVT_OK) on success, a negative KVT_E* code on failure.
 *    Functions that return a count return it as a non-negative int64_t or via
 *    an out-parameter. After any failure, kvt_last_error() on the same thread
 *    holds a human-readable message and kvt_last_errno() the OS errno (0 when
 *    the failure did not come from the OS).
 *  - Out-parameters come first, before the object the call acts on and its
 *    inputs (a caller's buffer is followed by its capacity). They are written
 *    only on success unless the function says otherwise. The exceptions keep
 *    their order because a signature is part of the ABI: kvt_entry_tokens
 *    (returns the tokens, their count in the trailing *n), kvt_tier_gc and
 *    kvt_tier_trim (optional counts last, NULL when not wanted), and in
 *    kvtier_sys.h kvt_tier_chunk_verify and kvt_tier_chunk_gc (optional
 *    result last, NULL when not wanted).
 *  - Objects come in create/free pairs; every *_free function accepts NULL.
 *  - Strings passed in are copied; the caller keeps ownership. Memory kvtier
 *    hands over (JSON strings, chain lists) is freed with kvt_free.
 *  - Sizes are sized integers (uint64_t bytes, int32_t tokens).
 *  - Versioned structs (kvt_options, kvt_promote_opts, kvt_call_opts,
 *    kvt_gc_opts, kvt_stats; kvtier_sys.h's kvt_chunk_totals): the first
 *    field is the version of the header the caller was built with. Fields
 *    are only ever appended, and each append raises the struct's version, so
 *    the library knows how much of the caller's struct exists: fields newer
 *    than the caller's version take their defaults (input structs) or are not
 *    written (output structs). Fill them with their _INIT macro (C99
 *    designated initialisers, naming each default once) or, where there is
 *    one, their _init() function (any language: the way for C++ before C++20
 *    and for bindings such as ctypes), then set fields.
 */
#ifndef KVTIER_H
#define KVTIER_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(KVT_BUILDING_LIBRARY) && defined(__GNUC__)
#define KVT_API __attribute__((visibility("default")))
#else
#define KVT_API
#endif

/* ------------------------------------------------------------------------ */
/* Version                                                                  */
/* ------------------------------------------------------------------------ */

#define KVT_VERSION_MAJOR 0
#define KVT_VERSION_MINOR 1
#define KVT_VERSION_PATCH 0
#define KVT_VERSION_STRING "0.1.0"
#define KVT_VERSION_NUMBER                                                     \
  (KVT_VERSION_MAJOR * 10000 + KVT_VERSION_MINOR * 100 + KVT_VERSION_PATCH)

/** Version string of the library actually loaded ("0.1.0"). Static storage. */
KVT_API const char *kvt_version(void);
/** KVT_VERSION_NUMBER of the library actually loaded. */
KVT_API int kvt_version_number(void);

/* ------------------------------------------------------------------------ */
/* Errors                                                                   */
/* ------------------------------------------------------------------------ */

typedef enum kvt_error {
  KVT_OK = 0,
  KVT_EINVAL = -1,    /* invalid argument or option (message names it)   */
  KVT_ENOMEM = -2,    /* allocation failed                                */
  KVT_EIO = -3,       /* OS I/O error; kvt_last_errno() has the errno      */
  KVT_ENOTFOUND = -4, /* no such entry                                    */
  KVT_ECORRUPT = -5,  /* stored data failed validation (never served)     */
  KVT_EFULL = -6,     /* spill queue full: the entry was dropped          */
  KVT_ECLOSED = -7,   /* the tier is closed                               */
  KVT_ETIMEDOUT = -8, /* a wait ran out; the operation may be retried     */
  KVT_ECANCELED = -9, /* the operation was cancelled                      */
  KVT_EBUDGET = -10,  /* a reserve callback or the write budget refused */
  KVT_ETOOBIG = -11,  /* entry larger than the configured capacity/queue  */
  KVT_EPERM = -12,    /* unsafe ownership/permissions or symlink          */
  KVT_EBUSY = -13,    /* resource in use (e.g. another writer process)    */
  KVT_EUNSUPPORTED = -14, /* feature not available in this build/format      */
  KVT_ENOSPC = -15,       /* the disk is full                                 */
  KVT_EDB = -16,          /* SQLite error; the message carries SQLite's text  */
  KVT_EAGAIN = -17,       /* not ready yet (non-blocking query)               */
  KVT_ERANGE = -18        /* a caller-supplied buffer is too small            */
} kvt_error;

/** Static, never-NULL description of an error code ("invalid argument"). */
KVT_API const char *kvt_strerror(int err);
/** Message of the last failure on this thread ("" if none). Valid until the
 *  next kvtier call on this thread. Thread-local: safe from any thread. */
KVT_API const char *kvt_last_error(void);
/** OS errno of the last failure on this thread, 0 if not OS-related. */
KVT_API int kvt_last_errno(void);
/** Clears this thread's last error. */
KVT_API void kvt_clear_error(void);

/* ------------------------------------------------------------------------ */
/* Logging                                                                  */
/* ------------------------------------------------------------------------ */

typedef enum kvt_log_level {
  KVT_LOG_DEBUG = 0,
  KVT_LOG_INFO = 1,
  KVT_LOG_WARN = 2,
  KVT_LOG_ERROR = 3,
  KVT_LOG_NONE = 4
} kvt_log_level;

/** Log sink. Called from any kvtier thread (caller threads, the writer, the
 *  promote workers), possibly concurrently: it must be thread-safe and must
 *  not call back into the tier that logs. `msg` is valid only during the call.
 */
typedef void (*kvt_log_fn)(void *ctx, int level, const char *msg);

/* ------------------------------------------------------------------------ */
/* Tensors and layers                                                       */
/* ------------------------------------------------------------------------ */

/** Element types; the names are the safetensors dtype strings. */
typedef enum kvt_dtype {
  KVT_DTYPE_INVALID = 0,
  KVT_DTYPE_BOOL = 1,
  KVT_DTYPE_U8 = 2,
  KVT_DTYPE_I8 = 3,
  KVT_DTYPE_I16 = 4,
  KVT_DTYPE_U16 = 5,
  KVT_DTYPE_F16 = 6,
  KVT_DTYPE_BF16 = 7,
  KVT_DTYPE_I32 = 8,
  KVT_DTYPE_U32 = 9,
  KVT_DTYPE_F32 = 10,
  KVT_DTYPE_I64 = 11,
  KVT_DTYPE_U64 = 12,
  KVT_DTYPE_F64 = 13
} kvt_dtype;

/** Bytes per element, 0 for an unknown dtype. */
KVT_API size_t kvt_dtype_size(kvt_dtype dt);
/** safetensors name ("BF16"), or NULL for an unknown dtype. Static storage. */
KVT_API const char *kvt_dtype_name(kvt_dtype dt);
/** Parses a safetensors name; KVT_DTYPE_INVALID when unknown. */
KVT_API kvt_dtype kvt_dtype_from_name(const char *name);

#define KVT_MAX_DIMS 8

/** A dense, C-contiguous tensor. In a spill the data is the caller's and is
 *  only read; in a promoted entry it is owned by the entry. */
typedef struct kvt_tensor {
  int32_t dtype;               /* kvt_dtype */
  uint32_t ndim;               /* 0..KVT_MAX_DIMS (0 = scalar) */
  int64_t shape[KVT_MAX_DIMS]; /* each >= 0 */
  void *data;                  /* nbytes bytes; may be NULL iff nbytes==0 */
  uint64_t nbytes;             /* must equal prod(shape) * dtype size */
} kvt_tensor;

typedef enum kvt_layer_kind {
  KVT_LAYER_KV = 1,          /* tensors: [keys, values]                       */
  KVT_LAYER_ROTATING_KV = 2, /* as KV, plus max_size, keep, step, idx         */
  KVT_LAYER_ARRAYS = 3, /* tensors: state[0..n) (ArraysCache/MambaCache)  */
  KVT_LAYER_QUANTIZED_KV = 4 /* tensors: [k_packed, k_scales, k_biases,
                                 v_packed, v_scales, v_biases]; bits,
                                 group_size                                   */
} kvt_layer_kind;

/** Sentinel for "attribute absent" in the integer fields of kvt_layer. */
#define KVT_ABSENT INT64_MIN

/** One layer of a KV cache. On spill the caller fills it and keeps
 *  ownership of everything it points to; kvtier copies what it needs before
 *  kvt_tier_spill returns (or, with kvt_tier_spill_nocopy, until the release
 *  callback runs). In a promoted entry everything is owned by the entry. */
typedef struct kvt_layer {
  int32_t kind;         /* kvt_layer_kind */
  uint32_t num_tensors; /* KV/rotating: 2, quantized: 6, arrays: >= 0 */
  kvt_tensor *tensors;
  /* KV kinds: tokens held. For KV and quantized KV, the valid rows on axis
   * -2 of every tensor (token i is row i): at most shape[-2] (a spill with
   * more is KVT_EINVAL; docs/FORMAT.md section 4, "offset"); quantized may
   * be KVT_ABSENT (every row). Rotating KV: every token seen (unbounded).
   * KVT_ABSENT for arrays. */
  int64_t offset;
  /* Rotating KV attributes (KVT_ABSENT when not present). */
  int64_t max_size, keep, step, idx;
  /* Quantized KV attributes. */
  int32_t bits, group_size;
  /* Original-dtype hints, one per tensor (KVT_DTYPE_INVALID = none), or NULL.
   * Read from the reference's `*_original_dtype` manifest keys: the stored
   * tensor was upcast (bf16 -> F32) and the engine casts back. kvtier's own
   * native mode never needs them (bf16 stays BF16). */
  int32_t *orig_dtypes;
} kvt_layer;

/** Initialises a layer to kind with every optional attribute absent. */
KVT_API void kvt_layer_init(kvt_layer *layer, kvt_layer_kind kind);

/* ------------------------------------------------------------------------ */
/* Token keys                                                               */
/* ------------------------------------------------------------------------ */

#define KVT_HASH_HEX_LEN 64
#define KVT_PREFIX_FILTER_TOKENS 16

/** out = lowercase hex SHA-256 of the native-endian int32 token blob, NUL
 *  terminated (65 bytes), bit-identical to the reference's _tokens_hash.
 *  n may be 0. Returns 0, KVT_EINVAL (NULL out, or NULL tokens with n > 0). */
KVT_API int kvt_token_hash(char out[KVT_HASH_HEX_LEN + 1],
                           const int32_t *tokens, size_t n);
/** Same over the first min(n, 16) tokens (the reference's _prefix_hash). */
KVT_API int kvt_prefix_hash(char out[KVT_HASH_HEX_LEN + 1],
                            const int32_t *tokens, size_t n);

/* ------------------------------------------------------------------------ */
/* Options                                                                  */
/* ------------------------------------------------------------------------ */

typedef enum kvt_storage_mode {
  /** Lossless: bf16 stays BF16, quantized layers stay packed with scales and
   *  biases. kvtier reads it back exactly; the reference cannot read bf16 or
   *  quantized layers written this way. */
  KVT_STORAGE_NATIVE = 0,
  /** What the reference writes: bf16 upcast to F32 with an original-dtype
   *  hint, quantized layers dequantized. The reference reads it. */
  KVT_STORAGE_COMPAT = 1
} kvt_storage_mode;

typedef enum kvt_durability {
  /** write tmp dir -> fsync files -> rename -> fsync data/ (default). An
   *  entry reported written survives a crash or power loss. */
  KVT_DURABILITY_FSYNC = 0,
  /** No fsync (the reference's behaviour): atomic rename only. Survives a
   *  process crash; a power loss may lose recent entries (never serves a
   *  torn one: checksums catch it). */
  KVT_DURABILITY_NONE = 1
} kvt_durability;

typedef enum kvt_io_backend {
  KVT_IO_AUTO = 0,     /* io_uring when built and usable, else portable */
  KVT_IO_PORTABLE = 1, /* pread/pwrite; every platform */
  KVT_IO_URING = 2     /* io_uring; KVT_EUNSUPPORTED where unavailable */
} kvt_io_backend;

/** Flags for kvt_options.flags. */
#define KVT_OPEN_READONLY 0x1u     /* inspect only: no writer, no changes   */
#define KVT_OPEN_NO_RECONCILE 0x2u /* skip reconcile at open               */
#define KVT_OPEN_SKIP_OWNER_CHECK 0x4u /* allow a dir not owned by the user */
/* Rebuild the index from the entry directories: index.db is set aside as
 * index.db.reindexed-<time> and every valid entry adopted (`kvtier
 * reindex`). Writable opens only. */
#define KVT_OPEN_REINDEX 0x8u

/** Called by the writer thread after each spill finished (status 0: the entry
 *  is published, durably when durability is FSYNC; negative: it was not
 *  written and no trace of it remains; KVT_EBUDGET: the write budget had no
 *  room for it when the writer took it, see write_budget_bytes_per_day).
 *  token_hash is valid during the call. In KVT_REMOTE_ONLY mode it reports
 *  the upload instead, from the remote upload thread (KVT_EFULL when the
 *  upload queue was full). Must not block for long and must not close the
 *  tier. */
typedef void (*kvt_spill_done_fn)(void *ctx, const char *token_hash,
                                  int status);

/** kvt_options versions: 1 (up to remote_flags), 2 (+ read_threads), 3 (+
 *  host_cache_bytes, chunk_tokens, model_id), 4 (+ remote_lookup_timeout_ms,
 *  remote_tls_*), 5 (+ admission_policy, admission_memory_bytes,
 *  write_budget_*, clock_fn, clock_ctx). */
#define KVT_OPTIONS_VERSION 5

/** A time source for the write budget (kvt_options.clock_fn): seconds on any
 *  fixed origin, never decreasing (a smaller value than the last is taken as
 *  the last). Called from the threads that call spill, lookup and stats
 *  functions (never from kvtier's own threads), with no tier lock held; it
 *  must not call into the tier. */
typedef double (*kvt_clock_fn)(void *ctx);

/** What a spill must show to be written (kvt_options.admission_policy). A
 *  spill is seen as segments of chunk_tokens tokens (256 when chunk_tokens
 *  is 0), each named by a fingerprint of every token up to its end (and the
 *  cache_salt), so equal fingerprints mean equal prefixes. A bounded in-RAM
 *  record (admission_memory_bytes) remembers fingerprints seen, and those a
 *  lookup found stored (a reused prefix). */
typedef enum kvt_admission_policy {
  /** Every spill is written (the reference's behaviour). */
  KVT_ADMIT_WRITE_ALL = 0,
  /** A segment is written from its second sighting on: a spill is written
   *  up to the end of its leading segments that were seen before (a spill
   *  of a prefix, as kvt_tier_spill_prefix stores it), all of it when every
   *  segment was, not at all when its first segment is new. Spills with
   *  layers that cannot be cut (arrays, rotating KV) are written whole or
   *  not at all. */
  KVT_ADMIT_SECOND_SIGHTING = 1,
  /** Writes everything while the store has room (no entry or chunk evicted
   *  for capacity since open); once it has had to evict, as SECOND_SIGHTING
   *  except that a spill is written whole when it extends a prefix a lookup
   *  found stored (a reused prefix: the conversation continues) or when its
   *  first new segment is in a fixed sample of 1 in 8 fingerprints; "seen
   *  before" here means asked for by a kvt_tier_lookup_prefix* call after a
   *  spill showed it (a spill alone, such as the same prompt spilled again
   *  with its answer, is no second request). At a
   *  full disk, writing every spill evicts entries before their reuse comes
   *  (most prompts are never sent again, and those that are come back after
   *  a while); writing only what was seen before misses every prefix used
   *  exactly twice. The sample lets new prefixes in at an eighth of the rate,
   *  so the disk holds a history about eight times longer. The record also
   *  learns which spill lengths are gone on from later, and at a full disk
   *  the chunked store evicts, among its older leaf chunks, those of the
   *  lengths worth least (docs/DESIGN.md, "Eviction by value"). The
   *  default of KVT_OPTIONS_INIT: on the Mooncake trace replay it keeps more
   *  hits than WRITE_ALL at a full disk for about 0.4x the bytes, and is
   *  WRITE_ALL until the disk first fills (docs/PERFORMANCE.md). */
  KVT_ADMIT_ADAPTIVE = 2
} kvt_admission_policy;

/** Tier options; mirrors the reference's SSDCacheConfig plus kvtier's own. */
typedef struct kvt_options {
  unsigned int version; /* KVT_OPTIONS_VERSION */
  /** Cache directory. NULL: $XDG_CACHE_HOME (else ~/.cache) +
   *  "/kvtier/<model_name>". */
  const char *cache_dir;
  /** Used only to derive the default cache_dir; NULL = "default". Must not
   *  contain '/' or be "." or "..". */
  const char *model_name;
  double max_size_gb;        /* > 0; GiB (2^30) of bytes ON DISK. 10.0 */
  int64_t max_entries;       /* >= 1. 10000 */
  uint32_t file_mode;        /* 0600 */
  uint32_t dir_mode;         /* 0700 */
  uint32_t spill_queue_size; /* >= 1 entries. 64 */
  /** Bound on the bytes of snapshots held by the queue; 0 = no bound. A
   *  spill that does not fit is dropped (KVT_EFULL); one larger than the
   *  whole bound is refused (KVT_ETOOBIG). */
  uint64_t spill_queue_bytes;
  /** Entries older than this many seconds since they were WRITTEN expire;
   *  0 = never (the reference's None). >= 0. */
  int64_t retention_seconds;
  int32_t storage_mode;     /* kvt_storage_mode; KVT_STORAGE_NATIVE */
  int32_t durability;       /* kvt_durability; KVT_DURABILITY_FSYNC */
  int32_t io_backend;       /* kvt_io_backend; KVT_IO_AUTO */
  uint32_t promote_threads; /* workers for async promote, >= 1. 2 */
  /** Max entries kept in quarantine/ (oldest removed first); 0 = keep none
   *  (corrupt entries are deleted). 16 */
  uint32_t quarantine_max;
  uint32_t flags;    /* KVT_OPEN_* */
  kvt_log_fn log_fn; /* NULL = no logging */
  void *log_ctx;
  int32_t log_level;               /* minimum level passed to log_fn. WARN */
  kvt_spill_done_fn spill_done_fn; /* NULL = none */
  void *spill_done_ctx;
  /* ---- Shared remote tier (Redis / Valkey); see docs/REMOTE.md. ---- */
  /** Remote store: "redis://[[user]:password@]host:port" (user: a Redis 6
   *  ACL user; none = the default user), "rediss://..." for TLS, several
   *  comma-separated "host:port" seed nodes for a Redis Cluster. NULL =
   *  none. Validated without connecting. kvt_tier_open contacts the store
   *  once: refused credentials or certificates fail it (KVT_EPERM); an
   *  unreachable server never does (a warning, then back-off). Builds
   *  without hiredis refuse a URL with KVT_EUNSUPPORTED at open. */
  const char *remote_url;
  /** kvt_remote_mode; KVT_REMOTE_LOCAL (the default) ignores the remote and
   *  needs remote_url NULL; the other modes need a remote_url. */
  int32_t remote_mode;
  /** Key prefix so several models or deployments share one store. NULL =
   *  "kvt:". No '{' or '}'; at most 128 bytes. */
  const char *remote_prefix;
  /** Bound on each connect and command, in ms (1..600000). 1000 */
  uint32_t remote_timeout_ms;
  /** Uploads waiting for the remote thread (>= 1); one that does not fit is
   *  dropped and counted in remote_spill_drops. Bytes are bounded by
   *  spill_queue_bytes as for the spill queue. 64 */
  uint32_t remote_queue_size;
  /** Entries are stored as values of at most this many bytes (the server's
   *  limit is 512 MiB). 4 KiB .. 512 MiB. 16 MiB */
  uint64_t remote_chunk_bytes;
  uint32_t remote_flags; /* KVT_REMOTE_* flags. 0 */
  /* ---- version 2 ---- */
  /** Threads reading the layers of one entry in a promote (the caller's plus
   *  helpers; entries of fewer than 4 layers use one), 0..8. 0 = the default:
   *  the KVT_READ_THREADS environment variable (1..8, read once per process)
   *  when set, else 2. A value > 0 wins over the environment. 0 */
  uint32_t read_threads;
  /* ---- version 3 ---- */
  /** Bytes of recently spilled and recently promoted entries kept in this
   *  process's RAM so that promoting them again runs at memory speed (the
   *  layer files are written and cold-read with O_DIRECT, so the page cache
   *  does not keep them). Filled from copy-mode spills once written (native
   *  storage mode; zero-copy spills are not cached at spill time) and from
   *  promoted entries when they are freed (kvt_entry_free); emptied of an
   *  entry when it is replaced, evicted, removed, quarantined or expires, or
   *  (chunked tiers) when a chunk of its chain is evicted or quarantined. A
   *  hit is verified against the entry's manifest block checksums (and the
   *  chunk files' block checksums) before it is served, like a disk read.
   *  kvt_tier_read_entry and chunk-aligned prefixes use it too. The bytes count
   * against the buffer pool's idle cap (one budget: the pool keeps idle only
   * what the caches leave of it). 0 disables the cache. KVT_HOST_CACHE_AUTO
   * (the default): 1/8 of the memory the process may use - the smallest of
   * physical RAM, the cgroup v2 limit (/sys/fs/cgroup/memory.max) and the
   * cgroup v1 limit
   *  (/sys/fs/cgroup/memory/memory.limit_in_bytes) - read at open.
   *  kvt_tier_set_host_cache_bytes changes it at run time. */
  uint64_t host_cache_bytes;
  /* The chunked native store (docs/FORMAT.md section 10). */
  /** A power of two in 16..4096 (KVT_CHUNK_TOKENS_DEFAULT = 256, chosen by
   *  bench/bench_chunked, docs/PERFORMANCE.md), or 0 = off (every spill is
   *  one entry, as the reference). Native storage mode keeps the KV (and
   *  quantized KV, and rotating KV that has not wrapped) of every spill in
   *  chunks of this many tokens under chunks/, stored once however many
   *  entries share them; prefix lookups of pure-KV models then also find
   *  chunk-aligned prefixes no spill ended at. Spills shorter than one
   *  chunk are plain entries. Ignored in storage_mode COMPAT (the directory
   *  the reference reads stays one entry per spill). With a remote tier the
   *  chunks are the unit shared between nodes (docs/REMOTE.md "Chunks shared
   *  between nodes"): nodes with the same model_id and chunk_tokens store a
   *  shared prefix once and fetch only the chunks they lack. */
  uint32_t chunk_tokens;
  /** Namespace of a native local tier (docs/FORMAT.md section 6): folded
   *  into the digest every call is keyed by, so entries, chain records and
   *  chunks of two model_ids (or of one and none) on one directory never
   *  meet, and names differ from the reference's. NULL or "" = none: the
   *  directory is the namespace (the reference's one directory per model)
   *  and chunks are seeded by model_name (or ""). A base model and its
   *  fine-tune (one layout) on one directory need two model_ids. Refused
   *  (KVT_EINVAL) in storage_mode COMPAT; with a remote tier only the chunks
   *  are namespaced (the remote store is keyed by the reference's names). At
   *  most 4000 bytes. */
  const char *model_id;
  /* ---- version 4 ---- */
  /** Deadline of a remote lookup's round trip in ms (1..600000), separate
   *  from remote_timeout_ms: kvt_tier_lookup* and a promote's remote lookup
   *  answer a miss from a local mirror of the remote keys without I/O; a
   *  hit (or a lookup while the mirror is not in sync) costs one call
   *  bounded by this. 250 */
  uint32_t remote_lookup_timeout_ms;
  /** TLS (rediss:// URLs only): PEM file of the CA(s) to trust (NULL = the
   *  system's trust store), and an optional client certificate chain and
   *  its key (both or neither). Loaded at open: a bad file is KVT_EINVAL. */
  const char *remote_tls_ca_file;
  const char *remote_tls_cert_file;
  const char *remote_tls_key_file;
  /* ---- version 5: admission and the write budget (docs/DESIGN.md) ---- */
  /** kvt_admission_policy; KVT_ADMIT_ADAPTIVE (also for a caller of an
   *  options version below 5). A spill declined or cut
   *  short by the policy or the budget still returns 0 (it was handled: the
   *  engine needs to do nothing), queues nothing for what it does not
   *  write, runs a zero-copy spill's release before returning, and is
   *  counted in admission_declined_* / admission_truncated; spill_done_fn is
   *  called only for what is written. */
  int32_t admission_policy;
  /** Bytes of the admission record of fingerprints seen (about 8 bytes a
   *  segment; when a slot is needed, the oldest of its set is forgotten). 0 = 4
   * MiB (half a million segments: 128M tokens of history at 256 tokens a
   * segment); else 64 KiB
   *  .. 1 GiB. */
  uint64_t admission_memory_bytes;
  /** The write budget, in bytes a day (0 = none), enforced on kvtier's own
   *  count of the bytes it writes (spill_bytes: entry and chunk files; not
   *  the index's pages) as a leaky bucket that drains at the budget's rate
   *  and holds one hour of it. A spill let in reserves the most it can
   *  write (its entry files and, chunked, the chunk files not yet stored)
   *  until it is written, refused or dropped, then is charged what it
   *  wrote. A spill whose reservation does not fit beside what is in the
   *  bucket and what the queued spills reserved is cut, when its layers
   *  are KV, to its longest chunk-aligned prefix that fits
   *  (admission_truncated), else not written (admission_declined_budget).
   *  Over half full only spills that extend a reused prefix or are of a
   *  length that has been reused more than the mean are written, and of
   *  the others (adaptive) the leading part a request asked for again. The
   *  writer checks the bound again before the write (a chunk counted as
   *  stored may have been evicted since) and, when the bucket has no room
   *  for what it grew by, does not write the spill
   *  (admission_declined_budget, spill_done_fn with KVT_EBUDGET). Over any
   *  span of s seconds kvtier so writes at most budget * (s / 86400 + 1 /
   *  24) bytes, queued spills included. A spill whose reservation is
   *  larger than the whole bucket (the hour) and that cannot be cut (or
   *  whose shortest cut is too) is never written under the budget, however
   *  long it waits: it is counted in admission_declined_oversize as well as
   *  admission_declined_budget, and the first one on a handle is logged at
   *  KVT_LOG_WARN (raise the budget or spill shorter prompts). Up to
   *  10^18. */
  uint64_t write_budget_bytes_per_day;
  /** Or the budget derived from the SSD's rating: write_budget_tbw terabytes
   *  (10^12 bytes) written over write_budget_years years (365.25 days):
   *  tbw * 10^12 / (years * 365.25) bytes a day. Both or neither (0), not
   *  with write_budget_bytes_per_day; tbw in (0, 10^6], years in (0, 100].
   *  With a rating, the stats also project the SSD's lifetime at the rate
   *  written so far (ssd_lifetime_years). 0 */
  double write_budget_tbw;
  double write_budget_years;
  /** Time source of the write budget and of "today" (bytes_written_today:
   *  days are [k * 86400, (k + 1) * 86400) of its seconds), and of recency:
   *  entries' and chunks' created_at / accessed_at (so LRU and eviction by
   *  value, and retention_seconds) are its readings, taken on the caller's
   *  thread at open, at each lookup and spill (the writer stamps with the
   *  latest). NULL = the wall clock (Unix seconds, UTC days). A replay or a
   *  test drives a day in minutes with its own clock, and evicts by the
   *  trace's time, not by how fast it ran; stamps of one clock mean nothing
   *  to a tier opened later with another. */
  kvt_clock_fn clock_fn;
  void *clock_ctx;
} kvt_options;

/** kvt_options.host_cache_bytes: derive the bound from the machine. */
#define KVT_HOST_CACHE_AUTO UINT64_MAX
/** The default chunk_tokens of KVT_OPTIONS_INIT. */
#define KVT_CHUNK_TOKENS_DEFAULT 256u

/** Where entries live (kvt_options.remote_mode). */
typedef enum kvt_remote_mode {
  KVT_REMOTE_LOCAL = 0, /* local SSD only (the reference)            */
  /** Spills go to the local SSD and, asynchronously, to the remote store; a
   *  promote that misses locally looks in the remote store and on a hit
   *  promotes from it, keeping a local copy (unless KVT_REMOTE_NO_LOCAL_COPY).
   */
  KVT_REMOTE_LOCAL_AND_REMOTE = 1,
  /** Spills go only to the remote store (the local directory holds the lock,
   *  an empty index and staging files; with chunk_tokens, also the chunks
   *  fetched by promotes); promotes read only from it. */
  KVT_REMOTE_ONLY = 2
} kvt_remote_mode;

/** kvt_options.remote_flags: do not keep a local copy of remote hits (with
 *  chunk_tokens the fetched chunks are still kept: they are the local chunk
 *  store's unit; only the entry's tail is not). */
#define KVT_REMOTE_NO_LOCAL_COPY 0x1u

/** The defaults, by field name: a new option is added here and in the struct
 *  only. C99 designated initialisers; from C++ use kvt_options_init(). Fields
 *  not named are 0/NULL. */
#define KVT_OPTIONS_INIT                                                       \
  {                                                                            \
    .version = KVT_OPTIONS_VERSION, .max_size_gb = 10.0, .max_entries = 10000, \
    .file_mode = 0600, .dir_mode = 0700, .spill_queue_size = 64,               \
    .spill_queue_bytes = 0, .retention_seconds = 0,                            \
    .storage_mode = KVT_STORAGE_NATIVE, .durability = KVT_DURABILITY_FSYNC,    \
    .io_backend = KVT_IO_AUTO, .promote_threads = 2, .quarantine_max = 16,     \
    .log_level = KVT_LOG_WARN, .remote_mode = KVT_REMOTE_LOCAL,                \
    .remote_timeout_ms = 1000, .remote_queue_size = 64,                        \
    .remote_chunk_bytes = 16u << 20, .read_threads = 0,                        \
    .host_cache_bytes = KVT_HOST_CACHE_AUTO,                                   \
    .chunk_tokens = KVT_CHUNK_TOKENS_DEFAULT, .remote_lookup_timeout_ms = 250, \
    .admission_policy = KVT_ADMIT_ADAPTIVE                                     \
  }

/** Fills opts with the defaults of KVT_OPTIONS_INIT for the given version
 *  (the caller's KVT_OPTIONS_VERSION: only that version's fields are
 *  written). Returns 0, or KVT_EINVAL for a NULL opts or a version this
 *  library does not know. */
KVT_API int kvt_options_init(kvt_options *opts, unsigned int version);
/** Checks every field as the reference's SSDCacheConfig.__post_init__ does
 *  and more (fields newer than opts->version count as their defaults).
 *  Returns 0, or KVT_EINVAL with a message naming the field, e.g.
 *  "max_size_gb must be > 0, got -1". */
KVT_API int kvt_options_validate(const kvt_options *opts);
/** sizeof(kvt_options), for bindings that mirror the struct. */
KVT_API size_t kvt_options_size(void);

/* ------------------------------------------------------------------------ */
/* Opening and closing a tier                                               */
/* ------------------------------------------------------------------------ */

typedef struct kvt_tier kvt_tier;

/** Opens (creating when missing) a cache directory: cache_dir/ and data/
 *  with dir_mode, index.db (WAL), removes stale *.tmp dirs (putting back the
 *  previous version of a replace a crash interrupted), and reconciles
 *  unless KVT_OPEN_NO_RECONCILE. A writable open also publishes the tier's
 *  counters in cache_dir/stats.bin until close (any process reads them with
 *  kvtier_sys.h's kvt_stats_read_live). Does NOT start the writer (see
 *  kvt_tier_start_writer), as in the reference.
 *  Returns 0 and *out; or KVT_EINVAL (bad options), KVT_EPERM (directory not
 *  owned by the user, writable by group/others, or a symlink), KVT_EBUSY
 *  (another process holds the directory for writing), KVT_EIO/KVT_ENOSPC,
 *  KVT_EDB, KVT_ENOMEM. On failure nothing stays open or allocated (created
 *  directories are left). Thread-safe (independent tiers). */
KVT_API int kvt_tier_open(kvt_tier **out, const kvt_options *opts);

/** Starts the background spill writer. Idempotent. Returns 0, KVT_ECLOSED,
 *  KVT_EINVAL (read-only tier), KVT_ENOMEM/KVT_EIO (thread creation).
 *  Spills enqueued before the writer starts wait in the queue. */
KVT_API int kvt_tier_start_writer(kvt_tier *t);

/** Stops accepting spills, waits up to timeout_ms (< 0: forever) for the
 *  writer to drain the queue, joins it, and closes the index. Returns 0, or
 *  KVT_ETIMEDOUT when the queue did not drain in time: the tier stays usable
 *  for lookups and promotes, still refuses spills, and close may be called
 *  again. A second close after success returns 0 and does nothing. Waits for
 *  running promotes. Any thread; not concurrently with kvt_tier_free. */
KVT_API int kvt_tier_close(kvt_tier *t, int64_t timeout_ms);

/** close as the reference's (newer) SSDCacheTier.close, within one deadline
 *  of timeout_ms (< 0: none): first queues a stop marker behind the accepted
 *  spills - it takes a queue slot, as the reference's None sentinel, and from
 *  then on spills are refused - then drains and joins the writer as
 *  kvt_tier_close. Returns 0; KVT_EFULL when the queue stayed full until the
 *  deadline, so the marker could not be queued (nothing changed: spills are
 *  still accepted, nothing was joined); KVT_ETIMEDOUT when the writer did not
 *  finish the spills before the marker in time (the writer and the index
 *  stay open; call again, the marker stays queued). Without a started writer
 *  and with an empty queue there is nothing to stop: as kvt_tier_close. */
KVT_API int kvt_tier_close_queued(kvt_tier *t, int64_t timeout_ms);

/** Closes if needed (dropping spills not yet started, waiting for the one in
 *  progress and for promotes), and frees the tier. Accepts NULL. After it,
 *  the pointer is invalid; no other call may be in flight on this tier. */
KVT_API void kvt_tier_free(kvt_tier *t);

/** The cache directory actually in use (absolute). Owned by the tier. */
KVT_API const char *kvt_tier_dir(const kvt_tier *t);

/* ------------------------------------------------------------------------ */
/* Spilling                                                                 */
/* ------------------------------------------------------------------------ */

/** Enqueues a spill without blocking on I/O. The layers are copied
 *  (snapshotted) on the calling thread before return; the writer never
 *  touches caller memory. memory_bytes is the engine's RAM estimate, stored
 *  as the reference does - except, with storage_mode native, when a layer
 *  is KVT_LAYER_QUANTIZED_KV: then kvtier records the entry's dense size, what
 * a promote that dequantizes (the Python drop-in; the reference's entries)
 * hands over: the other layers' tensor bytes as given, each quantized layer's
 * first min(offset, rows) rows of keys and values as (packed bytes x 8 / bits)
 *  elements of its scales' dtype. A caller reserving that figure before a
 *  promote is exact for the dense form (a C promote of a native entry
 *  allocates the packed form, less). Spilling tokens already stored replaces
 * the entry. Returns 0 (enqueued; kvt_options.spill_done_fn reports the
 * outcome), KVT_EFULL (queue full by count or bytes: dropped, counted in
 * spill_drops), KVT_ETOOBIG (larger than max_size_gb or spill_queue_bytes:
 * refused), KVT_EINVAL (bad layer: message says which layer and why; nothing
 *  enqueued), KVT_ECLOSED, KVT_ENOMEM. Thread-safe. */
KVT_API int kvt_tier_spill(kvt_tier *t, const int32_t *tokens, size_t n_tokens,
                           const kvt_layer *layers, uint32_t n_layers,
                           uint64_t memory_bytes);

/** Zero-copy spill: as kvt_tier_spill, but the tensor data is not copied.
 *  The caller hands the buffers over and must not modify or free them until
 *  release(release_ctx) is called (exactly once, from the writer thread or,
 *  on any failure return, from the calling thread before return; with a
 *  remote tier, from the remote upload thread once the upload is done). The
 *  kvt_layer/kvt_tensor descriptor arrays themselves are still copied. */
KVT_API int kvt_tier_spill_nocopy(kvt_tier *t, const int32_t *tokens,
                                  size_t n_tokens, const kvt_layer *layers,
                                  uint32_t n_layers, uint64_t memory_bytes,
                                  void (*release)(void *ctx),
                                  void *release_ctx);

/** Spills the state of a prefix, for hybrid models: layers that cannot be
 *  cut on the token axis (KVT_LAYER_ARRAYS - Mamba/SSM state -, rotating KV)
 *  make a cached prefix usable only at lengths where their whole state was
 *  stored, so such models get prefix hits (kvt_tier_lookup_prefix,
 *  KVT_PROMOTE_PREFIX) only where an entry ends - never from KV chunks alone.
 *  An engine that captured those layers' state at token n_keep (typically
 *  at each multiple of chunk_tokens while prefilling) stores it with this
 *  call as the entry of tokens[0, n_keep): `layers` are the model's layers
 *  with the non-cuttable ones as of n_keep, while KV and quantized KV layers
 *  may be the live ones holding more tokens - only their first n_keep rows
 *  are stored (offset n_keep; a layer holding fewer valid rows is
 *  KVT_EINVAL). In chunked mode those rows are the chunks a longer spill of
 *  the same tokens shares, so only the state and the entry's record are
 *  written. Otherwise exactly kvt_tier_spill (copy mode: everything is copied
 *  before return; same return codes). Thread-safe. */
KVT_API int kvt_tier_spill_prefix(kvt_tier *t, const int32_t *tokens,
                                  size_t n_keep, const kvt_layer *layers,
                                  uint32_t n_layers, uint64_t memory_bytes);

/** Blocks until every spill enqueued before the call has been written (or
 *  failed) - with a remote tier, uploaded (or failed/dropped) too - and the
 *  host RAM tier has finished admitting the entries freed before the call
 *  (their tails and chunks cut off the freeing thread), or timeout_ms passes
 *  (< 0: forever). Returns 0, KVT_ETIMEDOUT,
 *  KVT_EINVAL (writer not started while the queue is non-empty). */
KVT_API int kvt_tier_flush(kvt_tier *t, int64_t timeout_ms);

/** A language binding's per-tier override of the writer's write step (the
 *  Python drop-in's SSDCacheTier._write_entry replaced on an instance). While
 *  set, the writer thread calls fn for each spill it takes off the queue, in
 *  FIFO order, with nothing locked (no tier mutex: promotes, lookups and
 *  quarantine run meanwhile), instead of writing it. spill_id names the spill
 *  for kvt_tier_write_pending, which fn may call (on any thread, while fn has
 *  not returned) to run the C write; tokens are valid until fn returns. fn
 *  returns 0 or a KVT_E* code (then counted in write_failures and logged);
 *  spill_done_fn then gets that code, the write's result, or KVT_ECANCELED
 *  when fn wrote nothing. fn NULL restores the C write at full speed (no
 *  call out); a change applies from the next spill taken. Returns 0,
 *  KVT_EINVAL, KVT_ECLOSED. */
typedef int (*kvt_write_hook_fn)(void *ctx, uint64_t spill_id,
                                 const int32_t *tokens, size_t n_tokens,
                                 uint64_t memory_bytes);
KVT_API int kvt_tier_set_write_hook(kvt_tier *t, kvt_write_hook_fn fn,
                                    void *ctx);
/** Writes spill spill_id now, as the writer does without a hook (entry files,
 *  row, stats, capacity), from inside that spill's hook call. Returns the
 *  write's result, or KVT_EINVAL when spill_id is not in the hook. */
KVT_API int kvt_tier_write_pending(kvt_tier *t, uint64_t spill_id);

/* ------------------------------------------------------------------------ */
/* Looking up stored entries                                                */
/* ------------------------------------------------------------------------ */

/** Metadata of a stored entry, read without touching tensor data. */
typedef struct kvt_entry_info {
  char token_hash[KVT_HASH_HEX_LEN + 1];
  char prefix_hash[KVT_HASH_HEX_LEN + 1];
  uint64_t num_tokens;
  uint64_t memory_bytes; /* RAM estimate given at spill (dense size of a
                            native entry holding a quantized layer:
                            kvt_tier_spill);
                            a chain prefix: its chunks' memory_bytes */
  uint64_t disk_bytes;   /* bytes of the entry's files on disk */
  double created_at;     /* Unix seconds */
  double accessed_at;    /* Unix seconds */
} kvt_entry_info;

/** Exact lookup. Returns 0 and *out, KVT_ENOTFOUND (absent or expired),
 *  KVT_EINVAL, KVT_ECLOSED, KVT_EDB. Does not count hits or misses (as in
 *  the reference). With a remote tier (kvt_options.remote_mode) a local miss
 *  is looked up in the remote store and *out describes what a following
 *  promote will find there: a remote miss costs no I/O (a local mirror of
 *  the remote keys answers it), a remote hit one call bounded by
 *  remote_lookup_timeout_ms; an unreachable store is a miss, never an
 *  error. Thread-safe. */
KVT_API int kvt_tier_lookup(kvt_entry_info *out, kvt_tier *t,
                            const int32_t *tokens, size_t n_tokens);

/** Longest stored sequence that is a prefix of tokens (possibly all of it);
 *  with a remote tier, a remote entry longer than the local match wins (as
 *  in a promote). Returns as kvt_tier_lookup. Thread-safe. */
KVT_API int kvt_tier_lookup_prefix(kvt_entry_info *out, kvt_tier *t,
                                   const int32_t *tokens, size_t n_tokens);

/* ------------------------------------------------------------------------ */
/* Promoted entries                                                         */
/* ------------------------------------------------------------------------ */

/** A promoted entry: tokens, layers and tensor data, all owned by it.
 *  Immutable once returned: any number of threads may read it at once. */
typedef struct kvt_entry kvt_entry;

KVT_API uint32_t kvt_entry_num_layers(const kvt_entry *e);
/** Layer i (NULL if out of range). Owned by the entry. */
KVT_API const kvt_layer *kvt_entry_layer(const kvt_entry *e, uint32_t i);
/** Tokens of the entry; *n receives the count. Owned by the entry. */
KVT_API const int32_t *kvt_entry_tokens(const kvt_entry *e, size_t *n);
/** memory_bytes recorded at spill: the RAM estimate the engine gave, or for
 *  a native entry holding a quantized KV layer its dense size
 *  (kvt_tier_spill); a
 *  chain prefix (KVT_PROMOTE_PREFIX) reports its chunks' memory_bytes. */
KVT_API uint64_t kvt_entry_memory_bytes(const kvt_entry *e);
/** Bytes reserved through the reserve callback for this entry (0 when no
 *  callback was given). The reservation now belongs to the caller: kvtier
 *  never releases it after a successful promote. */
KVT_API uint64_t kvt_entry_reserved_bytes(const kvt_entry *e);
/** Bytes read from disk to build this entry; for an entry served from the
 *  host RAM cache (kvt_options.host_cache_bytes), the bytes of its files
 *  (nothing was read). */
KVT_API uint64_t kvt_entry_disk_bytes(const kvt_entry *e);
/** Token hash (64 hex chars). Owned by the entry. */
KVT_API const char *kvt_entry_hash(const kvt_entry *e);
/** Storage mode the entry was written in (kvt_storage_mode). */
KVT_API int kvt_entry_storage_mode(const kvt_entry *e);
/** Frees the entry and its tensors (via the caller's free callback for
 *  buffers the caller allocated). Accepts NULL. Not thread-safe against
 *  readers of the same entry. With the host RAM tier on, kvtier-allocated
 *  buffers of a promoted entry go back into its tier's cache instead (also
 *  after the tier is freed: then they are simply freed), so that the next
 *  promote of the entry is served from memory - which is why a promoted entry
 *  must stay unmodified (a modified one fails the next check and is read from
 *  disk again). */
KVT_API void kvt_entry_free(kvt_entry *e);

/* ------------------------------------------------------------------------ */
/* Promoting                                                                */
/* ------------------------------------------------------------------------ */

/** Budget callbacks. reserve returns nonzero when nbytes were reserved.
 *  Both run on the thread that calls kvt_tier_promote, kvt_tier_promote_async
 *  (reserve), kvt_promise_result / kvt_promise_cancel / kvt_promise_free
 *  (release) - never on a kvtier worker thread. */
typedef int (*kvt_reserve_fn)(void *ctx, uint64_t nbytes);
typedef void (*kvt_release_fn)(void *ctx, uint64_t nbytes);

/** Caller-supplied tensor buffers: return a buffer of at least desc->nbytes
 *  bytes (desc has dtype and shape filled) for tensor `tensor` of layer
 *  `layer`, or NULL to fail the promote with KVT_ENOMEM. free_fn, when set,
 *  is called for each such buffer by kvt_entry_free (or on failure). The
 *  descriptions are the size query: every layer's buffers are requested
 *  before any of its bytes are read, and the data lands straight in them.
 *  Layers are read by up to two threads at once (the promoting thread or an
 *  async worker, plus a kvtier reader thread), but alloc and free_fn are
 *  never called concurrently for one promote; they may be called from either
 *  thread. */
typedef void *(*kvt_alloc_fn)(void *ctx, uint32_t layer, uint32_t tensor,
                              const kvt_tensor *desc);
typedef void (*kvt_free_fn)(void *ctx, void *buf);

/** Per-layer completion for layer-streamed promote: called once per layer,
 *  in layer order, as soon as that layer and every earlier one are verified
 *  and in place (layers are read in parallel; a layer that finishes early is
 *  reported when its predecessors are). Never called concurrently; called
 *  from one of the threads reading the entry (the promoting thread or a
 *  kvtier reader thread). After a cancel no further layer is reported. The
 *  layer belongs to the entry being built. */
typedef void (*kvt_layer_ready_fn)(void *ctx, uint32_t layer_idx,
                                   const kvt_layer *layer);

#define KVT_PROMOTE_PREFIX 0x1u   /* promote the longest stored prefix */
#define KVT_PROMOTE_NO_TOUCH 0x2u /* do not update accessed_at */
/* Read through the page cache even when the entry is not cached. By default
 * a layer file that is mostly not in the page cache is read with O_DIRECT:
 * at the disk's speed for a few % of a core, without a second copy of the
 * entry in the page cache next to the one the engine is about to hold (a
 * buffered read of cold data cost 1-2 s of kernel CPU per GiB on the target
 * VMs and capped cold promotes at 0.6-0.8 GB/s on two cores). A file mostly
 * cached is always copied from the cache. This flag keeps the promoted pages
 * cached, for an engine that promotes the same entries again soon and has RAM
 * to spare (the next promote then runs at memory-copy speed). */
#define KVT_PROMOTE_PAGE_CACHE 0x4u

/** kvt_promote_opts versions: 1, 2 (+ cache_salt, cache_salt_len). */
#define KVT_PROMOTE_OPTS_VERSION 2
typedef struct kvt_promote_opts {
  unsigned int version;   /* KVT_PROMOTE_OPTS_VERSION */
  uint32_t flags;         /* KVT_PROMOTE_* */
  kvt_reserve_fn reserve; /* NULL: nothing reserved */
  kvt_release_fn release;
  void *budget_ctx;
  kvt_alloc_fn alloc; /* NULL: kvtier allocates (pooled) */
  kvt_free_fn free_buf;
  void *alloc_ctx;
  kvt_layer_ready_fn on_layer; /* NULL: none */
  void *layer_ctx;
  /* ---- version 2 ---- */
  /** The request's cache_salt (see kvt_call_opts): only entries spilled with
   *  the same salt are found and promoted. NULL / 0: none. */
  const void *cache_salt;
  size_t cache_salt_len;
} kvt_promote_opts;

#define KVT_PROMOTE_OPTS_INIT                                                  \
  { .version = KVT_PROMOTE_OPTS_VERSION }
KVT_API int kvt_promote_opts_init(kvt_promote_opts *opts, unsigned int version);

/** Synchronous promote, in the reference's order: lookup (a miss counts
 *  ssd_misses -> KVT_ENOTFOUND; tokens that no spill ended at but a stored
 *  chain of chunks covers whole - a prefix kvt_tier_lookup_prefix reported -
 *  are found, with that lookup's memory_bytes); reserve(memory_bytes) BEFORE
 * any data is read (refusal counts promotion_failures -> KVT_EBUDGET); read and
 * verify every file; on I/O error or corruption release the reservation, count
 * a promotion failure, quarantine a corrupt entry (KVT_EIO / KVT_ECORRUPT); on
 * success count the hit, latency and bytes, touch the entry and return it in
 * *out with the reservation handed to the caller. With a remote tier
 *  (kvt_options.remote_mode), a local miss - or a local prefix shorter than
 *  a remote one - is looked up and read remotely (bounded by
 *  remote_timeout_ms per command; an unusable or unreachable remote is a
 *  miss, counted in remote_misses/remote_errors, never an error or data).
 *  opts may be NULL (no budget). Thread-safe; many at once. */
KVT_API int kvt_tier_promote(kvt_entry **out, kvt_tier *t,
                             const int32_t *tokens, size_t n_tokens,
                             const kvt_promote_opts *opts);

/** Trimmed promote ("promote a longest common prefix"): promotes only the
 *  first n_keep tokens of the entry stored for exactly tokens[0, n_tokens) -
 *  typically a longer conversation that shares its first n_keep tokens with
 *  the request at hand (kvt_common_prefix computes n_keep). Every layer must
 *  be trimmable: KVT_LAYER_KV or KVT_LAYER_QUANTIZED_KV, whose tensors all hold
 *  the tokens on axis -2 (keys/values [.., T, D]; packed, scales and biases
 *  alike). The result holds, for every layer, token positions [0, n_keep) only
 *  (shape[-2] = n_keep, offset = n_keep); kvt_entry_tokens() is
 *  tokens[0, n_keep), kvt_entry_hash() is the hash of those tokens (what the
 *  entry now holds, so it can be spilled under its own key), and
 *  kvt_entry_memory_bytes() is the stored memory_bytes scaled by
 *  n_keep / n_tokens - the amount passed to opts->reserve before any read.
 *  opts->alloc receives the trimmed tensor descriptions; on_layer sees the
 *  trimmed layers. Disk reads: kvtier entries (format 2, docs/FORMAT.md
 *  section 6) carry an XXH3-64 per 64 KiB block of every layer file, so only
 *  the blocks covering the safetensors header and each head's kept rows are
 *  read (at most 2 extra blocks, 128 KiB, per head range), and every block is
 *  verified before any byte of it is copied into the entry: a damaged block
 *  the trim needs fails it with KVT_ECORRUPT and no data, while damage in
 *  blocks it does not read goes unnoticed until a full promote or
 *  kvt_tier_verify. Format-1 entries (whole-file checksums, written by older
 *  versions) still have their layer files read and hashed completely, only
 *  the kept rows being copied; entries without checksums (written by the
 *  reference) are read for the header and the kept rows only.
 *  kvt_entry_disk_bytes() counts the bytes actually read. Stats and touch as
 *  kvt_tier_promote (the stored entry is touched).
 *  Returns as kvt_tier_promote, plus KVT_EINVAL (n_keep 0 or > n_tokens, a
 *  layer holding fewer than n_keep tokens - rows or offset: rows past a
 *  layer's offset are never served as tokens -, KVT_PROMOTE_PREFIX in
 *  opts->flags) and KVT_EUNSUPPORTED (a layer kind that cannot be trimmed:
 *  arrays or rotating KV). n_keep == n_tokens is exactly kvt_tier_promote.
 *  Thread-safe; many at once. */
KVT_API int kvt_tier_promote_trim(kvt_entry **out, kvt_tier *t,
                                  const int32_t *tokens, size_t n_tokens,
                                  size_t n_keep, const kvt_promote_opts *opts);

/** Length of the longest common prefix of a[0, na) and b[0, nb). */
KVT_API size_t kvt_common_prefix(const int32_t *a, size_t na, const int32_t *b,
                                 size_t nb);

/** An asynchronous promote in flight. */
typedef struct kvt_promise kvt_promise;

/** Starts a promote: lookup and reserve run now, on the calling thread (so a
 *  miss or refusal is known at once: KVT_ENOTFOUND / KVT_EBUDGET are returned
 *  directly and no promise is created); the read runs on a worker thread.
 *  Returns 0 and *out, or the codes above, KVT_ECLOSED, KVT_ENOMEM. */
KVT_API int kvt_tier_promote_async(kvt_promise **out, kvt_tier *t,
                                   const int32_t *tokens, size_t n_tokens,
                                   const kvt_promote_opts *opts);

/** Waits up to timeout_ms (< 0: forever; 0: poll) for completion. Returns 0
 *  when complete (success or not; see kvt_promise_result), KVT_ETIMEDOUT. */
KVT_API int kvt_promise_wait(kvt_promise *p, int64_t timeout_ms);

/** A file descriptor that becomes readable when the promise completes, for
 *  event loops (select/poll/epoll/asyncio add_reader). Owned by the promise;
 *  valid until kvt_promise_free. Returns the fd or a negative code. */
KVT_API int kvt_promise_fd(kvt_promise *p);

/** Collects the result of a completed promise: 0 and *out (the entry, now the
 *  caller's), or the promote's error code (the reservation, if any, has then
 *  been released on this thread). KVT_EAGAIN if not complete yet. Can be
 *  called once successfully; later calls return KVT_EINVAL. */
KVT_API int kvt_promise_result(kvt_entry **out, kvt_promise *p);

/** Cancels: asks the read to stop, WAITS for it to finish, frees any data,
 *  releases the reservation on this thread. Returns KVT_ECANCELED when the
 *  promote was cancelled, 0 when it had already completed (the result is
 *  then still collectable), or KVT_EINVAL. The budget never leaks. */
KVT_API int kvt_promise_cancel(kvt_promise *p);

/** Frees the promise; an uncollected result is cancelled/released first
 *  (as kvt_promise_cancel). Accepts NULL. */
KVT_API void kvt_promise_free(kvt_promise *p);

/* ------------------------------------------------------------------------ */
/* Reading, touching and removing one entry                                 */
/* ------------------------------------------------------------------------ */

/** Reads an entry by its relative path in data/ (the index's file_path), as
 *  the reference's _read_entry(tokens, file_path): no budget, no stats, no
 *  touch. A corrupt entry is quarantined. Served from the host RAM tier when
 *  the entry (or chunk-aligned prefix) was just spilled or read and freed,
 *  after the same checks (host_cache_hits counts it). file_path must be a
 * 64-hex entry name (anything else: KVT_EINVAL, never a path outside the
 * cache). With a remote tier, an entry not stored locally (one a lookup found
 * remotely) is read from the remote store, verified, and kept as a local copy
 * unless KVT_REMOTE_NO_LOCAL_COPY (counted in remote_hits / remote_read_bytes).
 *  Returns 0 and *out, KVT_ENOTFOUND, KVT_ECORRUPT, KVT_EIO. */
KVT_API int kvt_tier_read_entry(kvt_entry **out, kvt_tier *t,
                                const int32_t *tokens, size_t n_tokens,
                                const char *file_path);

/** Marks an entry recently used (accessed_at = now). Returns 0 or
 *  KVT_ENOTFOUND. Touches may be grouped and written to SQLite lazily; they
 *  are visible to kvt_tier_lookup at once. */
KVT_API int kvt_tier_touch(kvt_tier *t, const int32_t *tokens, size_t n_tokens);

/** Removes an entry (files and row). Returns 0, KVT_ENOTFOUND. */
KVT_API int kvt_tier_remove(kvt_tier *t, const int32_t *tokens,
                            size_t n_tokens);

/* ------------------------------------------------------------------------ */
/* Cache salts (per-request namespaces)                                     */
/* ------------------------------------------------------------------------ */

/* A cache_salt (vLLM's per-request `cache_salt`, SGLang's namespaces) keeps
 * the entries of different tenants apart in one cache: an entry spilled with
 * salt S is found, promoted, read, touched and removed only by calls with the
 * same S, never by calls with another salt or none, and its chunks are never
 * shared with - nor seen by - them (the chain is seeded by model_id and S).
 * kvtier stores only SHA-256 digests of S: a salted entry is named
 * SHA-256(D || tokens), D = SHA-256("kvtier cache_salt v1" NUL || S), and so
 * are its index row (token_hash, file_path = that name; prefix_hash the same
 * over the first 16 tokens: the reference's own lookups never see it) and
 * its manifest (kvtier.cache_salt = hex D; docs/FORMAT.md). Calls without a
 * salt are exactly the reference's, unless the tier has a model_id (then D is
 * joined with its namespace: kvt_options.model_id). Salts are refused
 * (KVT_EUNSUPPORTED) when a remote tier is configured. */

/** Longest cache_salt, in bytes. */
#define KVT_CACHE_SALT_MAX 4096

/** kvt_call_opts versions: 1. */
#define KVT_CALL_OPTS_VERSION 1
/** Per-call options of the *_ex functions. NULL = none (the plain call). */
typedef struct kvt_call_opts {
  unsigned int version;   /* KVT_CALL_OPTS_VERSION */
  const void *cache_salt; /* bytes (any); NULL or length 0: no salt */
  size_t cache_salt_len;  /* <= KVT_CACHE_SALT_MAX */
} kvt_call_opts;
#define KVT_CALL_OPTS_INIT                                                     \
  { .version = KVT_CALL_OPTS_VERSION }
/** Fills o with the defaults for version. 0 or KVT_EINVAL. */
KVT_API int kvt_call_opts_init(kvt_call_opts *o, unsigned int version);

/** kvt_tier_spill, kvt_tier_spill_nocopy, kvt_tier_lookup,
 *  kvt_tier_lookup_prefix, kvt_tier_read_entry, kvt_tier_touch and
 *  kvt_tier_remove under co's cache_salt (co NULL: exactly the plain call).
 *  Return as the plain calls, plus KVT_EINVAL (unknown co->version, a salt
 *  longer than KVT_CACHE_SALT_MAX) and KVT_EUNSUPPORTED (a salt with a
 *  remote tier). A lookup's token_hash is the salted name: pass it to
 *  kvt_tier_read_entry_ex with the same salt (read_entry refuses a name that
 *  is not SHA-256(D || tokens) of its own salt: KVT_EINVAL). Promotes take
 *  the salt in kvt_promote_opts (version 2). Thread-safe. */
KVT_API int kvt_tier_spill_ex(kvt_tier *t, const int32_t *tokens,
                              size_t n_tokens, const kvt_layer *layers,
                              uint32_t n_layers, uint64_t memory_bytes,
                              const kvt_call_opts *co);
KVT_API int kvt_tier_spill_nocopy_ex(kvt_tier *t, const int32_t *tokens,
                                     size_t n_tokens, const kvt_layer *layers,
                                     uint32_t n_layers, uint64_t memory_bytes,
                                     void (*release)(void *ctx),
                                     void *release_ctx,
                                     const kvt_call_opts *co);
KVT_API int kvt_tier_lookup_ex(kvt_entry_info *out, kvt_tier *t,
                               const int32_t *tokens, size_t n_tokens,
                               const kvt_call_opts *co);
KVT_API int kvt_tier_lookup_prefix_ex(kvt_entry_info *out, kvt_tier *t,
                                      const int32_t *tokens, size_t n_tokens,
                                      const kvt_call_opts *co);
KVT_API int kvt_tier_read_entry_ex(kvt_entry **out, kvt_tier *t,
                                   const int32_t *tokens, size_t n_tokens,
                                   const char *file_path,
                                   const kvt_call_opts *co);
KVT_API int kvt_tier_touch_ex(kvt_tier *t, const int32_t *tokens,
                              size_t n_tokens, const kvt_call_opts *co);
KVT_API int kvt_tier_remove_ex(kvt_tier *t, const int32_t *tokens,
                               size_t n_tokens, const kvt_call_opts *co);

/** kvt_tier_spill_prefix under a cache_salt (see kvt_call_opts; NULL: the
 *  plain call). Returns as kvt_tier_spill_prefix, plus KVT_EINVAL (unknown
 *  kvt_call_opts version, salt longer than KVT_CACHE_SALT_MAX) and
 *  KVT_EUNSUPPORTED (a salt with a remote tier configured). Thread-safe. */
KVT_API int kvt_tier_spill_prefix_ex(kvt_tier *t, const int32_t *tokens,
                                     size_t n_keep, const kvt_layer *layers,
                                     uint32_t n_layers, uint64_t memory_bytes,
                                     const kvt_call_opts *co);

/* ------------------------------------------------------------------------ */
/* Maintenance and inspection of one tier                                   */
/* ------------------------------------------------------------------------ */

/** Reconciles the index with the files: drops rows whose entry directory or
 *  manifest is missing; a data directory with no row is adopted (its row
 *  rebuilt from its manifest and tokens) when valid and quarantined when not
 *  - never deleted for lack of a row -; stale *.tmp directories are removed.
 *  Returns the number cleaned (>= 0) or a negative code. Safe on a directory
 *  written by the reference. */
KVT_API int64_t kvt_tier_reconcile(kvt_tier *t);

/** Limits for kvt_tier_gc; a field of 0 (or < 0 for older_than) means "use
 *  the tier's configured value". */
typedef struct kvt_gc_opts {
  unsigned int version; /* 1 */
  uint64_t max_bytes;
  int64_t max_entries;
  int64_t older_than_seconds;
  int dry_run;
} kvt_gc_opts;
#define KVT_GC_OPTS_INIT                                                       \
  { .version = 1, .older_than_seconds = -1 }

/** Applies capacity and retention now (as the writer does after each spill
 *  and the retention sweep does periodically). Counts in *removed and
 *  *removed_bytes (may be NULL). Returns 0 or a negative code. */
KVT_API int kvt_tier_gc(kvt_tier *t, const kvt_gc_opts *opts, uint64_t *removed,
                        uint64_t *removed_bytes);

/** Calls fn for each stored entry, most recently used first, until fn
 *  returns nonzero. Must not call other kvt_tier functions from fn.
 *  Returns 0 or a negative code. */
typedef int (*kvt_entry_visit_fn)(void *ctx, const kvt_entry_info *info);
KVT_API int kvt_tier_foreach(kvt_tier *t, kvt_entry_visit_fn fn, void *ctx);

/** JSON description of one stored entry: its manifest, storage mode, and for
 *  each layer the tensors with dtype, shape and byte length, read from the
 *  manifest and safetensors headers only (no tensor data). *json is
 *  malloc'ed; free with kvt_free. Returns 0, KVT_ENOTFOUND, KVT_ECORRUPT,
 *  KVT_EINVAL (token_hash not 64 hex digits), KVT_EIO. Thread-safe. */
KVT_API int kvt_tier_describe(char **json, kvt_tier *t, const char *token_hash);

/** Reads and verifies one entry completely (manifest, every safetensors
 *  header and checksum, tokens.bin against the hash, path safety). Returns 0
 *  (good), KVT_ECORRUPT (message says what is wrong; with repair nonzero the
 *  entry is quarantined and its row dropped), KVT_ENOTFOUND, KVT_EIO. */
KVT_API int kvt_tier_verify(kvt_tier *t, const char *token_hash, int repair);

/* ------------------------------------------------------------------------ */
/* Stats                                                                    */
/* ------------------------------------------------------------------------ */

/* Latency histograms of kvt_stats: KVT_STATS_LATENCY_BUCKETS per-bucket
 * counts; bucket i (i < 14) counts operations that took more than bound i-1
 * and at most bound i seconds of KVT_STATS_LATENCY_BOUNDS_INIT, the last
 * bucket those above 10 s. */
#define KVT_STATS_LATENCY_BUCKETS 15
#define KVT_STATS_LATENCY_BOUNDS_INIT                                          \
  {                                                                            \
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, \
        5.0, 10.0                                                              \
  }

/** kvt_stats versions: 1 (up to remote_available), 2 (+ token counters,
 *  latency histograms, the host RAM tier's host_cache_* and promotes_from_*
 *  fields), 3 (+ refused spills by reason, spill_refused_*, the chunked
 *  store's damage counters, admission and the write budget, then
 *  layout_misses and admission_declined_oversize, appended). */
#define KVT_STATS_VERSION 3

/** Counters and gauges of a tier (output of kvt_tier_stats). The caller sets
 *  version (KVT_STATS_INIT or kvt_stats_init) before the call.
 *  Every field after the version word is 8 bytes (uint64_t or double) and the
 *  struct has no padding: the live stats file (docs/FORMAT.md, "stats.bin")
 *  stores it word by word in this order. New fields are only ever appended. */
typedef struct kvt_stats {
  unsigned int version;  /* KVT_STATS_VERSION; set by the caller */
  unsigned int reserved; /* 0; keeps the 8-byte words below aligned */
  /* The reference's counters. */
  uint64_t spill_count;
  uint64_t spill_bytes; /* bytes written to disk */
  uint64_t ssd_hits;
  uint64_t ssd_misses;
  double reload_latency_sum; /* seconds */
  uint64_t reload_bytes;
  uint64_t promotion_failures;
  /* kvtier's. */
  uint64_t spill_drops;   /* queue full */
  uint64_t spill_rejects; /* too big / invalid */
  uint64_t write_failures;
  uint64_t evictions;
  uint64_t expirations;
  uint64_t quarantined;
  uint64_t reconciled;
  uint64_t promotions_cancelled;
  uint64_t entries;      /* now */
  uint64_t disk_bytes;   /* now: bytes of entries (and chunks) on disk */
  uint64_t memory_bytes; /* now: sum of memory_bytes */
  uint64_t queue_depth;  /* now */
  uint64_t queue_bytes;  /* now */
  /* The remote tier (all 0 without one). ssd_hits/ssd_misses/reload_* count
   * every promote whichever tier served it; local hits = ssd_hits -
   * remote_hits. */
  uint64_t remote_hits;        /* promotes served from the remote store */
  uint64_t remote_misses;      /* remote lookups that found nothing usable */
  uint64_t remote_read_bytes;  /* entry bytes fetched from the remote */
  double remote_latency_sum;   /* seconds spent in remote fetches (hits) */
  uint64_t remote_spill_count; /* entries uploaded */
  uint64_t remote_spill_bytes; /* bytes uploaded */
  uint64_t remote_spill_drops; /* uploads dropped: queue full or remote down */
  uint64_t remote_errors;      /* failed remote operations (connection,
                                  timeout, server error, damaged data) */
  uint64_t remote_queue_depth; /* now: uploads waiting */
  uint64_t remote_available;   /* now: 1 when the remote is configured and
                                  not in back-off after a failure */
  /* ---- version 2 ---- */
  /* Tokens: requested = tokens asked for by promote calls (n_keep of a
   * trimmed one), hit or miss; served = tokens of the entries promotes
   * returned from the local SSD (remote hits are not counted here). */
  uint64_t tokens_requested;
  uint64_t tokens_served;
  /* Latency histograms (see KVT_STATS_LATENCY_BUCKETS). promote: every
   * successful promote, local or remote (sum: reload_latency_sum, count:
   * ssd_hits); spill: every entry the writer stored locally - files, fsyncs,
   * publication and index row (sum: spill_latency_sum, count: spill_count of
   * local writes). */
  uint64_t promote_latency_hist[KVT_STATS_LATENCY_BUCKETS];
  uint64_t spill_latency_hist[KVT_STATS_LATENCY_BUCKETS];
  double spill_latency_sum; /* seconds */
  /* The host RAM tier (kvt_options.host_cache_bytes). Every successful local
   * promote is served either from RAM or from disk: promotes_from_ram +
   * promotes_from_disk = ssd_hits - remote_hits. */
  uint64_t host_cache_bytes_used;  /* now: bytes held in RAM (entries,
                                      tails and chunks) */
  uint64_t host_cache_bytes_bound; /* now: the bound (0: disabled) */
  uint64_t host_cache_entries;     /* now: entries (or tails) held in RAM */
  uint64_t host_cache_hits;        /* promotes that found the entry in RAM */
  uint64_t host_cache_misses;      /* local promotes that did not (cache on) */
  uint64_t host_cache_evictions;   /* entries, tails and chunks dropped for
                                      room or by a trim */
  uint64_t host_cache_verify_failures; /* RAM copies that failed the check
                                          (dropped; read from disk instead) */
  uint64_t promotes_from_ram;          /* promotes served from the host cache */
  uint64_t promote_ram_bytes;          /* their entry bytes (files' size) */
  uint64_t promotes_from_disk;         /* local promotes read from the SSD */
  uint64_t promote_disk_bytes;         /* bytes read by them */
  /* ---- version 3 ---- */
  /* Spills refused, by reason: every spill call (spill, spill_ex,
   * spill_nocopy[_ex], spill_prefix[_ex]) that returns an error adds 1 to
   * exactly one of these, so a refusal is never only a return code.
   * spill_drops and spill_rejects keep their version-1 meaning.
   *   unsupported: a layer class kvtier does not store (KVT_EUNSUPPORTED;
   *                also what a binding's own classification refuses, added
   *                with kvt_tier_stats_add);
   *   invalid:     a malformed layer or argument, or a read-only tier
   *                (KVT_EINVAL);
   *   too_big:     larger than spill_queue_bytes or the capacity
   *                (KVT_ETOOBIG);
   *   queue_full:  the spill queue was full (KVT_EFULL, as spill_drops);
   *   closed:      the tier is closing or closed, its writer stopping
   *                (KVT_ECLOSED);
   *   other:       anything else (out of memory, a bad salt, ...). */
  uint64_t spill_refused_unsupported;
  uint64_t spill_refused_invalid;
  uint64_t spill_refused_too_big;
  uint64_t spill_refused_queue_full;
  uint64_t spill_refused_closed;
  uint64_t spill_refused_other;
  /* The chunked store's damage, contained (serving path and verify --repair
   * alike): a chunk file found damaged or missing is moved aside alone (to
   * quarantine/chunk-<key>/) and marked damaged; the chunks below it and the
   * entries through it are kept, unservable until a spill writes the chunk
   * again. */
  uint64_t chunks_quarantined; /* chunk files moved aside (or found gone) */
  uint64_t entries_unservable; /* entries through them at that moment */
  uint64_t chunks_rewritten;   /* damaged chunks a spill wrote again */
  uint64_t chain_cuts_kept;    /* chained reads that found their chain cut
                                  (damaged chunk, missing or damaged chunk
                                  rows) and kept the entry: a miss, never a
                                  deletion */
  /* The host RAM tier over the chunked store holds a chained entry as its
   * tail (counted in host_cache_entries) plus its chain's chunks, each held
   * once whatever the entries and prefixes through it (their bytes are part
   * of host_cache_bytes_used). */
  uint64_t host_cache_chunks;      /* now: chunks held in RAM */
  uint64_t host_cache_chunk_bytes; /* now: their bytes */
  /* Group commit: spills found waiting in the queue are written together
   * and made durable by one fsync of data/ and one index transaction. */
  uint64_t spill_batches;  /* group commits of two or more spills */
  uint64_t spills_batched; /* spills acknowledged through one */
  /* Admission and the write budget (kvt_options.admission_policy,
   * write_budget_*). Every spill call that passes the admission decision
   * adds 1 to exactly one of admitted, truncated, declined_unseen and
   * declined_budget (write_all without a budget: admitted). */
  uint64_t admission_admitted;         /* spills passed on whole */
  uint64_t admission_truncated;        /* spills cut to their seen prefix */
  uint64_t admission_declined_unseen;  /* not written: first sighting */
  uint64_t admission_declined_budget;  /* not written: the write budget */
  uint64_t admission_tokens_declined;  /* tokens not written by those */
  uint64_t bytes_written_today;        /* now: spill_bytes since the clock's day
                                          began (this open) */
  uint64_t write_budget_bytes_per_day; /* now: the budget (0: none) */
  uint64_t write_budget_left;          /* now: bytes the budget's bucket
                                          takes before it is full */
  double ssd_lifetime_years; /* now: write_budget_tbw at the rate written
                                since open, in years (0: no rating or
                                nothing written yet) */
  /* Promotes and reads (native mode) refused because the entry's layout -
   * layer count; attention layers' heads, head sizes and dtype - is none
   * of the layouts this handle has spilled: another model's entry, a miss
   * (KVT_ENOTFOUND; with on_layer, layers already reported belong to the
   * entry, freed). A handle that has not spilled yet, or spilled more than 8
   * layouts (not one model's), checks nothing. */
  uint64_t layout_misses;
  /* Of admission_declined_budget: spills whose reservation alone (the most
   * they can write; of a spill of KV layers, of its shortest chunk-aligned
   * cut) is more than the write budget's whole bucket, an hour of the
   * budget. Unlike the others they would be declined by an empty bucket
   * too: under this budget they are never written. */
  uint64_t admission_declined_oversize;
} kvt_stats;

/** A kvt_stats ready for kvt_tier_stats (C99 designated initialiser). */
#define KVT_STATS_INIT                                                         \
  { .version = KVT_STATS_VERSION }

/** Zeroes s and sets its version. Returns 0, or KVT_EINVAL for a NULL s or a
 *  version this library does not know. */
KVT_API int kvt_stats_init(kvt_stats *s, unsigned int version);
/** sizeof(kvt_stats), for bindings that mirror the struct. */
KVT_API size_t kvt_stats_size(void);

/** Snapshot of the counters into out, whose version the caller has set (the
 *  fields of that version are written; version is left as it is). Returns 0,
 *  KVT_EINVAL (NULL argument, or an unknown out->version: initialise it with
 *  KVT_STATS_INIT or kvt_stats_init). Thread-safe. */
KVT_API int kvt_tier_stats(kvt_stats *out, kvt_tier *t);

/** Adds delta to a counter by its reference name ("ssd_hits",
 *  "promotion_failures", ...), for engines that count on their own. Returns
 *  0, KVT_EINVAL (unknown name or a result below 0). */
KVT_API int kvt_tier_stats_add(kvt_tier *t, const char *counter, int64_t delta);

/** Renders stats as JSON: the reference's to_dict keys (same rounding) plus
 *  kvtier's. Size-then-copy: writes at most cap bytes including the NUL and
 *  sets *needed to the full size including the NUL. Returns 0, or KVT_ERANGE
 *  when cap < *needed (buf then holds nothing useful). */
KVT_API int kvt_stats_to_json(char *buf, size_t cap, size_t *needed,
                              const kvt_stats *s);
/** Prometheus text exposition (metric names prefixed "kvtier_"), same
 *  size-then-copy contract. */
KVT_API int kvt_stats_to_prometheus(char *buf, size_t cap, size_t *needed,
                                    const kvt_stats *s);

/* ------------------------------------------------------------------------ */
/* Memory: handed-over blocks, the buffer pool, the host RAM tier          */
/* ------------------------------------------------------------------------ */

/** Frees memory kvtier allocated and handed over (JSON strings). */
KVT_API void kvt_free(void *p);

/* ---- kvtier's buffer pool -------------------------------------------------
 * kvtier's own large buffers - the snapshot of a copy-mode spill, promoted
 * tensors when kvt_promote_opts.alloc is NULL, the writer's staging - come
 * from one process-wide pool of 4096-aligned buffers: a buffer kvtier is done
 * with (kvt_entry_free, a written spill) stays mapped and is reused, because
 * faulting fresh memory in runs at 1.5-2 GB/s on common VMs while a copy into
 * resident memory runs at ~10 GB/s. At most `idle cap` bytes stay idle;
 * beyond that the oldest are returned to the system. Default cap: 2 GiB but at
 * most 1/8 of physical memory, or KVT_BUFPOOL_MB (MiB) from the environment at
 * first use. Buffers handed out are not counted against the cap. The host RAM
 * caches of open tiers (kvt_options.host_cache_bytes) share this budget: the
 * bytes they hold are charged against the cap, and the pool keeps idle only
 * what is left. All three calls are thread-safe and may be called at any
 * time, with or without a tier open. */

/** Sets the idle cap in bytes (0: keep nothing idle - every buffer is freed
 *  when kvtier is done with it), freeing idle buffers beyond it now. An engine
 *  serving 8k-token Llama-3-8B entries (1 GiB each) wants a cap above 1.2 GiB
 *  for warm promotes at copy speed; one short of RAM wants it low. Returns 0
 *  or KVT_ENOMEM (the pool could not be created). */
KVT_API int kvt_buffers_set_idle_cap(uint64_t bytes);

/** Frees every idle buffer now (e.g. when the engine is about to need the
 *  memory). Buffers in use are not affected; the cap is unchanged. Host-cache
 *  entries are not idle buffers: kvt_tier_trim frees those. */
KVT_API void kvt_buffers_trim(void);

/** The pool's idle bytes, bytes handed out (in use) and idle cap; any pointer
 *  may be NULL. Returns 0 or KVT_ENOMEM (the pool could not be created). */
KVT_API int kvt_buffers_stats(uint64_t *idle_bytes, uint64_t *out_bytes,
                              uint64_t *idle_cap);

/* ---- the host RAM tier ----------------------------------------------------
 * Each tier keeps up to kvt_options.host_cache_bytes of entries in RAM (see
 * there); with chunk_tokens set, a chained entry is kept as its tail plus its
 * chain's chunks, each chunk held once however many entries share it (a
 * promote served from RAM is a fresh copy assembled from them and checked
 * against the files). Its memory is given back on demand: */

/** Sets the tier's host cache bound in bytes (0: disable and empty it);
 *  entries beyond the new bound (least recently used first) are freed
 *  before the call returns, so it is the way to shrink the cache under
 *  memory pressure. KVT_HOST_CACHE_AUTO re-derives the default. Returns 0,
 *  KVT_EINVAL (NULL tier), KVT_ECLOSED. Thread-safe. */
KVT_API int kvt_tier_set_host_cache_bytes(kvt_tier *t, uint64_t bytes);

/** Memory pressure: frees host-cache entries (least recently used first)
 *  until at most target_bytes remain (the bound is unchanged, so the cache
 *  refills later), then frees the buffer pool's idle buffers
 *  (kvt_buffers_trim) and asks the C library to return free heap pages to
 *  the system (malloc_trim where it exists). Done before the call returns.
 *  *freed (may be NULL) receives the host-cache bytes released. Returns 0,
 *  KVT_EINVAL, KVT_ECLOSED. Thread-safe. */
KVT_API int kvt_tier_trim(kvt_tier *t, uint64_t target_bytes, uint64_t *freed);

#ifdef __cplusplus
}
#endif

#endif /* KVTIER_H */
