/*
 * kvtier_sys.h - the part of kvtier's C API that serves tools and
 * compatibility rather than an engine's serving path: the chunked store's and
 * the remote store's entry-by-entry inspection and repair, the check of
 * index.db, what a cache directory holds (read with the tier's own names for
 * its layout, so a tool never spells them), another process's live counters
 * (kvtier's command-line tool is built on them), and the index of a cache
 * directory and single layer files on their own (the reference implementation's
 * SSDIndex and LayerSerializer, which the Python drop-in exposes). Nothing here
 * is needed to spill, look up or promote.
 *
 * Stability: unlike kvtier.h's, these calls, structs and constants may change
 * or go away between minor versions (0.1 to 0.2); they stay as they are
 * within one. A program using them is built against the kvtier release it
 * runs with, as kvtier's own tools and bindings are. Return codes, ownership,
 * threads and the other conventions are kvtier.h's, which this header
 * includes.
 */
#ifndef KVTIER_SYS_H
#define KVTIER_SYS_H

#include "kvtier.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------ */
/* The chunked native store (the CLI's ls/show/verify/gc/stats)             */
/* ------------------------------------------------------------------------ */

/* A tier opened with kvt_options.chunk_tokens keeps the KV of its native
 * spills in chunk files under cache_dir/chunks/<kk>/<key>.kvc (docs/FORMAT.md
 * section 10), each stored once however many entries share it; an entry then
 * holds only its tail in data/<hash>/ and names its chain. These calls show
 * and maintain that store. They follow parent links, never lookup values, so
 * they see every namespace and salt (a tool knows neither). On a tier opened
 * with chunk_tokens 0 the store is not loaded: there are no chunks to list
 * (kvtier's CLI therefore always opens with chunk_tokens set). None of them
 * is meant for the serving path. */

/** One stored chunk. */
typedef struct kvt_chunk_info {
  char key[KVT_HASH_HEX_LEN + 1]; /* SHA-256 chain key (the file's name) */
  /** The parent's key; for chunk 0 the chain's seed (namespace + layout),
   *  which is not a chunk. */
  char parent[KVT_HASH_HEX_LEN + 1];
  uint64_t index;      /* position in its chain */
  uint32_t num_tokens; /* token positions [index * C, index * C + num_tokens) */
  uint32_t children;   /* stored chunks whose parent this is */
  /** Entries whose chain runs through this chunk (how often it is shared);
   *  0 for a chunk only prefix lookups reach. */
  uint32_t entries;
  int pure;             /* 1: the chain holds every layer (pure KV) */
  uint64_t layout_hash; /* XXH3-64 of the KV layout descriptor */
  uint64_t disk_bytes;  /* the file's size */
  /** RAM its rows take loaded dense: its tensors' bytes, a quantized layer
   *  counted dequantized (keys and values in the scales' dtype), as the
   *  Python drop-in hands it over; what a prefix promote reserves for it (a
   *  C promote of a quantized layer allocates less: the packed form).
   *  Chunks an earlier build wrote record their tensors'
   *  bytes. */
  uint64_t memory_bytes;
  double created_at, accessed_at; /* Unix seconds; accessed: newest use of
                                     the chunk or any descendant */
} kvt_chunk_info;

/** Calls fn for every stored chunk (in no particular order) until fn returns
 *  nonzero. info is valid only during the call. fn runs with the chain table
 *  read-locked and must not call back into the tier. Returns 0, fn's nonzero
 *  value (the walk stopped there), KVT_EINVAL, KVT_ECLOSED, KVT_ENOMEM.
 *  Thread-safe. */
typedef int (*kvt_chunk_visit_fn)(void *ctx, const kvt_chunk_info *info);
KVT_API int kvt_tier_chunk_foreach(kvt_tier *t, kvt_chunk_visit_fn fn,
                                   void *ctx);

/** The chain of entry token_hash, chunk 0 first: *out (malloc'ed, free with
 *  kvt_free; NULL when *n is 0) and *n chunks of *chunk_tokens tokens each
 *  (chunk_tokens may be NULL; 0 for an entry stored whole, which has *n 0);
 *  flags: KVT_CHAIN_* (0: everything filled).
 *  Returns 0, KVT_ENOTFOUND (no such entry, or its chain is no longer
 *  complete - the message names the missing chunk; such an entry cannot be
 *  served), KVT_EINVAL (token_hash not 64 hex digits), KVT_ECLOSED,
 *  KVT_ENOMEM. Thread-safe. */
KVT_API int kvt_tier_entry_chain(kvt_chunk_info **out, size_t *n,
                                 uint32_t *chunk_tokens, kvt_tier *t,
                                 const char *token_hash, unsigned flags);
/** kvt_tier_entry_chain flags: leave kvt_chunk_info.entries 0 (counting the
 *  entries through each chunk walks every chained entry's chain; without it
 *  the call costs only the chain's length - for listing many entries). */
#define KVT_CHAIN_NO_SHARING 0x1u

#define KVT_CHUNK_TOTALS_VERSION 1
/** Totals of the chunked store (kvt_tier_chunk_totals). */
typedef struct kvt_chunk_totals {
  unsigned int version;     /* KVT_CHUNK_TOTALS_VERSION; set by the caller */
  uint32_t chunk_tokens;    /* the tier's option (0: the store is off) */
  uint64_t chunks;          /* stored chunks */
  uint64_t disk_bytes;      /* bytes of chunk files (each counted once) */
  uint64_t memory_bytes;    /* their kvt_chunk_info.memory_bytes */
  uint64_t leaves;          /* chunks no other chunk continues */
  uint64_t shared;          /* chunks in the chains of two or more entries */
  uint64_t chained_entries; /* entries stored over a chain */
  /** Bytes the chained entries' chains would take if each entry stored its
   *  own copy: the sum over chained entries of their chain's chunk bytes.
   *  (entry bytes + this) / (entry bytes + disk_bytes) is the dedup ratio. */
  uint64_t chain_logical_bytes;
} kvt_chunk_totals;
#define KVT_CHUNK_TOTALS_INIT                                                  \
  { .version = KVT_CHUNK_TOTALS_VERSION }

/** Fills *out (whose version the caller set). Returns 0, KVT_EINVAL (NULL or
 *  unknown version), KVT_ECLOSED, KVT_ENOMEM. Thread-safe. */
KVT_API int kvt_tier_chunk_totals(kvt_chunk_totals *out, kvt_tier *t);

/** Reads and verifies one chunk file completely: its header (magic,
 *  version, checksum, key = SHA-256 of parent and tokens, the name), its
 *  parent (the row's; for chunk 0 the seed of the file's namespace and
 *  layout), index and token count against its row, its tokens against the
 *  row's lookup chain value, and every XXH3 block checksum of its data.
 *  key_hex: 64 hex digits. With repair and a bad (or missing) chunk, on a
 *  writable tier: the routine the serving path uses - the chunk's file alone
 *  moves to cache_dir/quarantine/chunk-<key>/ (reached from cache_dir's
 *  descriptor, never through a link; the oldest chunk-* directories beyond
 *  quarantine_max are removed; the file is deleted when quarantine_max
 *  is 0) and the chunk is marked damaged; the chunks below it and the
 *  entries through it are kept (indexed, on disk), not offered by lookups,
 *  until a spill of those tokens writes the chunk again. *removed_entries
 *  (may be NULL) receives the number of entries through it (made
 *  unservable, none removed). Returns 0 (good), KVT_ECORRUPT
 *  (message says what; repaired when repair), KVT_ENOTFOUND (not indexed),
 *  KVT_EIO, KVT_EINVAL, KVT_ECLOSED, KVT_ENOMEM. Thread-safe. */
KVT_API int kvt_tier_chunk_verify(kvt_tier *t, const char *key_hex, int repair,
                                  uint64_t *removed_entries);

/** What kvt_tier_chunk_gc did (or would do) with one file under chunks/. */
typedef enum kvt_chunk_gc_action {
  KVT_CHUNK_GC_TMP = 1,     /* a stale *.tmp (an interrupted write): removed */
  KVT_CHUNK_GC_ADOPTED = 2, /* an unindexed chunk file that is valid and
                               whose parent is indexed (or is the seed):
                               indexed again */
  KVT_CHUNK_GC_REMOVED = 3, /* an unindexed chunk file that is damaged, or
                               whose parent is not stored: removed (it can
                               never be reached) */
  KVT_CHUNK_GC_STRAY = 4    /* a name that is no chunk: left, reported */
} kvt_chunk_gc_action;

/** Called per file acted on: path relative to cache_dir ("chunks/ab/...").
 *  path and detail (why) are valid only during the call. Nonzero stops the
 *  gc. Without dry_run fn runs with the tier's mutation lock held: it must
 *  not call back into the tier (that would deadlock). */
typedef int (*kvt_chunk_gc_fn)(void *ctx, const char *path, int action,
                               uint64_t bytes, const char *detail);
/** Progress: done of total subdirectories of chunks/ scanned (called with no
 *  lock held). */
typedef void (*kvt_chunk_progress_fn)(void *ctx, uint64_t done, uint64_t total);

typedef struct kvt_chunk_gc_result {
  uint64_t tmp_removed, adopted, removed, stray;
  uint64_t bytes_freed; /* of tmp and removed files */
} kvt_chunk_gc_result;

/** Cleans chunks/: stale *.tmp files and chunk files without a row
 *  (orphans, left by a crash between a chunk's write and its row, or by a
 *  removal that could not unlink). An orphan is adopted when it verifies
 *  completely (kvt_tier_chunk_verify's checks) and its parent is indexed or
 *  is adopted first (orphans are taken in chain order); otherwise it can
 *  never be reached and is removed. Files being written are never touched
 *  (each subdirectory is cleaned under the tier's mutation lock, which every
 *  chunk write holds). A running tier also cleans lazily: the writer sweeps
 *  one subdirectory of chunks/ after every 64 chunked spills (open never
 *  lists chunks/). dry_run: report only, the same decisions (an orphan
 *  under an orphan that would be adopted counts as adoptable). fn and
 *  progress may be NULL; *res
 *  may be NULL. A chunks/ that is a link or not a directory is reported as
 *  a stray and not entered. Returns 0, KVT_EINVAL (read-only tier without
 *  dry_run), KVT_EPERM (chunks/ cannot be opened, e.g. permission denied:
 *  nothing was cleaned), KVT_ECLOSED, KVT_EIO, KVT_EDB, KVT_ENOMEM, or fn's
 *  nonzero value. A dry run
 *  takes no lock and may race a running writer (its report is advisory).
 *  Thread-safe: one subdirectory at a time is locked against spills,
 *  evictions and other gcs. */
KVT_API int kvt_tier_chunk_gc(kvt_tier *t, int dry_run, kvt_chunk_gc_fn fn,
                              kvt_chunk_progress_fn progress, void *ctx,
                              kvt_chunk_gc_result *res);

/* ------------------------------------------------------------------------ */
/* The remote store, one entry at a time                                    */
/* ------------------------------------------------------------------------ */

/** Tools (the CLI's ls/stats/verify --remote): visits every entry of the
 *  tier's remote store under its remote_prefix, with info read from each
 *  entry's remote manifest (disk_bytes = bytes stored, accessed_at =
 *  created_at), in no particular order, until fn returns nonzero. A SCAN of
 *  every master plus one read per entry: never used on the serving path.
 *  Returns 0, KVT_EINVAL (no remote tier configured: always so in a build
 *  without hiredis, whose kvt_tier_open refuses a remote_url with
 *  KVT_EUNSUPPORTED), KVT_EIO / KVT_ETIMEDOUT (server), KVT_ENOMEM,
 *  KVT_ECLOSED.
 *  Thread-safe; fn must not call back into the tier. */
KVT_API int kvt_tier_remote_foreach(kvt_tier *t, kvt_entry_visit_fn fn,
                                    void *ctx);

/** Downloads and verifies one entry of the remote store completely (chunk
 *  checksums, then every file as kvt_tier_verify does). An incomplete or
 *  damaged entry is removed from the store (as every remote reader does).
 *  Returns 0 (good), KVT_ECORRUPT, KVT_ENOTFOUND, KVT_EINVAL (no remote tier,
 *  or token_hash not 64 hex digits), KVT_EIO / KVT_ETIMEDOUT, KVT_ENOMEM.
 *  Thread-safe. */
KVT_API int kvt_tier_remote_verify(kvt_tier *t, const char *token_hash);

/** Tools (the CLI's show --remote): kvt_tier_describe for an entry of the
 *  remote store (its files are fetched to a staging directory, checked
 *  against the chunk checksums, described, and deleted). Returns as
 *  kvt_tier_describe, plus KVT_EINVAL (no remote tier), KVT_EUNSUPPORTED,
 *  KVT_ETIMEDOUT. Thread-safe. */
KVT_API int kvt_tier_remote_describe(char **json, kvt_tier *t,
                                     const char *token_hash);

/** Tools (the CLI's gc --remote): deletes one entry of the remote store (its
 *  manifest first, then its chunks) and tells the other nodes' lookup
 *  mirrors. A missing entry is success. Returns 0, KVT_EINVAL (no remote
 *  tier, read-only tier, bad hash), KVT_EUNSUPPORTED, KVT_EIO /
 *  KVT_ETIMEDOUT. Thread-safe. */
KVT_API int kvt_tier_remote_remove(kvt_tier *t, const char *token_hash);

/* ------------------------------------------------------------------------ */
/* The integrity of index.db                                                */
/* ------------------------------------------------------------------------ */

/** Checks index.db itself: SQLite's PRAGMA quick_check over the file (not
 *  what the process has cached), as `kvtier verify` does. Returns 0 (ok),
 *  KVT_ECORRUPT (damaged), KVT_EDB, KVT_EIO, KVT_EINVAL, KVT_ECLOSED. A
 *  damaged index - found here, or by any statement SQLite reports
 *  SQLITE_CORRUPT / SQLITE_NOTADB for after open - costs no entry: the tier
 *  goes on serving from its in-memory index, and a writable tier sets
 *  index.db aside as index.db.corrupt-<time> when it closes, so the next
 *  open rebuilds it from the entry directories (and the chain table from the
 *  chunk files). Thread-safe; takes the index's lock for the check. */
KVT_API int kvt_tier_check_index(kvt_tier *t);

/* ------------------------------------------------------------------------ */
/* What a directory holds, before anything opens it                         */
/* ------------------------------------------------------------------------ */

#define KVT_CACHE_DIR_PROBE_VERSION 1
/** What kvt_cache_dir_probe found in a directory, read with the tier's own
 *  names for its layout (docs/FORMAT.md), so a tool need not spell them. */
typedef struct kvt_cache_dir_probe_info {
  unsigned int version; /* KVT_CACHE_DIR_PROBE_VERSION; set by the caller */
  int empty;            /* 1: it holds nothing at all */
  int has_index;        /* 1: index.db is there (as any kind of file) */
  int index_errno;      /* 0, or why index.db cannot be opened for reading */
  int has_data;         /* 1: the data/ directory of entries is there */
  uint64_t quarantined; /* names set aside under quarantine/ (entries and
                           chunks a check found damaged) */
} kvt_cache_dir_probe_info;
#define KVT_CACHE_DIR_PROBE_INIT                                               \
  { .version = KVT_CACHE_DIR_PROBE_VERSION }

/** Looks into dir without opening a tier, taking a lock or changing
 *  anything: a snapshot that a writer may change right after. A kvtier (or
 *  reference) cache holds index.db or data/; an empty directory is one a tier
 *  may start in. Returns 0 (*out filled, its version kept), KVT_EINVAL (NULL
 *  or empty argument, unknown version, dir not a directory), KVT_ENOTFOUND (no
 *  such dir), KVT_EPERM / KVT_EIO (dir, index.db's name or quarantine/ cannot
 *  be read: kvt_last_errno() says why), KVT_ENOMEM. On failure *out is zeroed
 *  past its version.
 *  Thread-safe. */
KVT_API int kvt_cache_dir_probe(kvt_cache_dir_probe_info *out, const char *dir);

/** What a name in a cache directory's data/ is, read from the name alone
 *  (kvt_cache_dir_list). */
typedef enum kvt_cache_name_kind {
  KVT_CACHE_NAME_ENTRY = 1, /* 64 lowercase hex digits: an entry's name
                               (whatever the file's type) */
  KVT_CACHE_NAME_TMP = 2,   /* "<something>.tmp": an unfinished write or
                               removal, which a reconcile deletes */
  KVT_CACHE_NAME_STRAY = 4  /* anything else: not kvtier's (left alone) */
} kvt_cache_name_kind;

/** Called per name: name (valid only during the call) is as stored in data/,
 *  kind one kvt_cache_name_kind. Nonzero stops the walk. */
typedef int (*kvt_cache_name_fn)(void *ctx, const char *name, int kind);

/** Calls fn for each name in dir's data/ (never "." or "..") whose kind is
 *  in kinds (a mask of kvt_cache_name_kind; 0: every kind), in no particular
 *  order, without opening a tier, taking a lock or changing anything (a
 *  writer may add or remove names during the walk: each is reported at most
 *  once). data/ is reached from dir without following a link below it.
 *  Returns 0, fn's nonzero value (the walk stopped there), KVT_ENOTFOUND
 *  (dir or its data/ does not exist), KVT_EPERM (data/ is a link or not a
 *  directory), KVT_EIO, KVT_EINVAL (NULL or empty argument, or fn NULL),
 *  KVT_ENOMEM. Thread-safe; fn may call anything. */
KVT_API int kvt_cache_dir_list(const char *dir, unsigned kinds,
                               kvt_cache_name_fn fn, void *ctx);

/** Where a name given to kvt_cache_name_stat is. */
#define KVT_CACHE_AREA_DATA                                                    \
  1 /* a name in data/, as kvt_cache_dir_list                                  \
       reports it */
#define KVT_CACHE_AREA_CHUNKS                                                  \
  2 /* a path under chunks/, relative to the                                   \
       cache directory, as kvt_tier_chunk_gc and                               \
       kvt_cache_chunk_name give it */

#define KVT_CACHE_NAME_STAT_VERSION 1
/** One name's state (kvt_cache_name_stat). */
typedef struct kvt_cache_name_stat_info {
  unsigned int version; /* KVT_CACHE_NAME_STAT_VERSION; set by the caller */
  int is_dir;           /* 1: a directory (a link is not followed) */
  double mtime;         /* Unix seconds of its last modification */
} kvt_cache_name_stat_info;
#define KVT_CACHE_NAME_STAT_INIT                                               \
  { .version = KVT_CACHE_NAME_STAT_VERSION }

/** Looks name up in dir (area: KVT_CACHE_AREA_*) without following a link
 *  on the way or at its end: whether it is there, and its type and time -
 *  so a tool can look at a name again without spelling the layout. Returns
 *  0 (there: *out filled, its version kept), KVT_ENOTFOUND (not there, or a
 *  directory on the way is missing), KVT_EPERM (a link or non-directory on
 *  the way), KVT_EINVAL (NULL or empty argument, unknown version or area, a
 *  data/ name holding '/' or a chunks/ path not of the form
 *  chunks/<name>[/<name>], "." and ".." refused), KVT_EIO. On failure *out
 *  is zeroed past its version. Thread-safe. */
KVT_API int kvt_cache_name_stat(kvt_cache_name_stat_info *out, const char *dir,
                                int area, const char *name);

/** The path of chunk key_hex (64 lowercase hex digits) relative to the cache
 *  directory, "chunks/<kk>/<key>.kvc" (docs/FORMAT.md section 10), into out
 *  (n bytes; KVT_CACHE_CHUNK_NAME_MAX is always enough). Returns 0, or
 *  KVT_EINVAL (NULL argument, key_hex not a key, n too small: out then ""
 *  when n > 0). */
#define KVT_CACHE_CHUNK_NAME_MAX 80
KVT_API int kvt_cache_chunk_name(char *out, size_t n, const char *key_hex);

/* ------------------------------------------------------------------------ */
/* The live counters of another process                                     */
/* ------------------------------------------------------------------------ */

/** The live counters of the process that has cache_dir open for writing.
 *  A writable tier publishes its counters (and its entry and queue gauges,
 *  refreshed after each spill and at each kvt_tier_stats call) to
 *  <cache_dir>/stats.bin, a small memory-mapped file (docs/FORMAT.md); this
 *  reads a consistent snapshot of it from any process, without opening the
 *  tier or taking any lock the writer uses. */
typedef struct kvt_stats_live {
  int64_t pid;       /* the process that published the file */
  int alive;         /* 1: it still has the directory open (its tier is open
                        and the process is running) */
  double started_at; /* unix seconds: when that tier opened */
  double updated_at; /* unix seconds: its last update */
} kvt_stats_live;

/** Reads <cache_dir>/stats.bin into *out and *live (either may be NULL).
 *  Returns 0 (read; live->alive says whether the publisher is still there -
 *  otherwise these are its last figures), KVT_ENOTFOUND (no stats file: no
 *  writer has opened the directory with this version), KVT_ECORRUPT (not a
 *  kvtier stats file, or an unknown layout version), KVT_EIO, KVT_EINVAL.
 *  Fields the file's writer did not know (an older kvtier) read as 0.
 *  Thread-safe; never writes. */
KVT_API int kvt_stats_read_live(kvt_stats *out, kvt_stats_live *live,
                                const char *cache_dir);

/* ------------------------------------------------------------------------ */
/* The index on its own (the reference's SSDIndex)                          */
/* ------------------------------------------------------------------------ */

/** The SQLite index of a cache directory, usable without a tier (the
 *  reference exposes SSDIndex publicly). Every call is the reference's own SQL
 *  statement on the same schema, so it stores and returns rows exactly as the
 *  reference's SSDIndex does: any file_path string and any num_tokens (the
 *  reference's SSDIndex is a general table; only its tier writes file_path =
 *  token hash). A tier never takes a path from the index: it ignores rows
 *  whose file_path is not the row's own 64-hex token hash (or whose num_tokens
 *  is not the length of its tokens), and names entry files by the hash only.
 *  Rows whose numbers or blob the row struct cannot hold (num_tokens or
 *  memory_bytes not a non-negative integer, tokens_blob not a blob of whole
 *  int32s, token_hash not 64 characters, file_path not text) are left out of
 *  every answer, counts and sums included. Thread-safe: one mutex serialises
 *  every call, as in the reference. */
typedef struct kvt_index kvt_index;

/** A row of the entries table. file_path holds the stored path when it is
 *  shorter than KVT_HASH_HEX_LEN + 8 bytes (every path a tier writes), else
 *  ""; kvt_index_row_file_path gives the whole path of a row in a
 *  kvt_index_rows list, whatever its length. tokens points into memory owned
 *  by the list it came from (num_tokens is the stored column, n_tokens the
 *  length of the stored tokens; the reference lets them differ). */
typedef struct kvt_index_row {
  char token_hash[KVT_HASH_HEX_LEN + 1];
  char file_path[KVT_HASH_HEX_LEN + 8];
  uint64_t num_tokens;
  uint64_t memory_bytes;
  double created_at;
  double accessed_at;
  const int32_t *tokens;
  size_t n_tokens;
} kvt_index_row;

/** A list of rows, owned by the caller; free with kvt_index_rows_free. */
typedef struct kvt_index_rows {
  kvt_index_row *rows;
  size_t count;
} kvt_index_rows;

KVT_API void kvt_index_rows_free(kvt_index_rows *rows);

/** The whole stored file_path of a row (any length, NUL-terminated; owned
 *  like its tokens): for a row of a kvt_index_rows list it stays valid until
 *  the list is freed; for a row filled by kvt_index_lookup_exact (tokens NULL)
 *  it is row->file_path. NULL for a NULL row. An accessor rather than a
 *  longer field, so kvt_index_row and kvt_index_rows keep their layout (ABI):
 *  a list row's path is kept after its tokens, in the same allocation, and
 *  freed with them. */
KVT_API const char *kvt_index_row_file_path(const kvt_index_row *row);

/** Opens cache_dir/index.db (creating it, WAL, synchronous=NORMAL, schema
 *  and migration of a legacy table lacking prefix_hash, whose rows get their
 *  prefix_hash backfilled). Returns 0, KVT_EDB, KVT_EIO, KVT_ENOMEM,
 *  KVT_EINVAL. */
KVT_API int kvt_index_open(kvt_index **out, const char *cache_dir);
KVT_API void kvt_index_close(kvt_index *idx); /* accepts NULL */
/** INSERT OR REPLACE with created_at = accessed_at = now and prefix_hash =
 *  the hash of the first min(n, 16) tokens, as the reference's insert_entry:
 *  file_path is any NUL-terminated string, stored as given (a tier ignores
 *  the row unless it is the tokens' hash and num_tokens == n). memory_bytes
 *  and num_tokens must be at most INT64_MAX, n at most 2^28. Returns 0,
 *  KVT_EINVAL, KVT_EDB, KVT_ENOSPC, KVT_EIO, KVT_ENOMEM. */
KVT_API int kvt_index_insert(kvt_index *idx, const int32_t *tokens, size_t n,
                             const char *file_path, uint64_t memory_bytes,
                             uint64_t num_tokens);
/** The row of exactly these tokens: 0 and *out (tokens NULL), KVT_ENOTFOUND,
 *  or KVT_ERANGE when its file_path does not fit out->file_path (use
 *  kvt_index_get). */
KVT_API int kvt_index_lookup_exact(kvt_index_row *out, kvt_index *idx,
                                   const int32_t *tokens, size_t n);
/** The row of exactly these tokens as a list of 0 or 1 rows (tokens filled,
 *  any file_path length through kvt_index_row_file_path). Returns 0 (count 0
 *  when absent) or an error code. */
KVT_API int kvt_index_get(kvt_index_rows *out, kvt_index *idx,
                          const int32_t *tokens, size_t n);
/** The reference's lookup_prefix: rows whose prefix_hash is the hash of one
 *  of the query's first 1..min(n, 16) tokens and num_tokens <= n, in
 *  num_tokens descending order (rows of equal num_tokens, which only a
 *  table written by hand can hold, in insertion (rowid) order), kept when
 *  their stored tokens equal the query's first num_tokens tokens (tokens
 *  filled, every column as stored). Only candidate rows are read: an
 *  in-memory map of (length, hash of the stored tokens) -> rowid, built at
 *  the first lookup and rebuilt when another connection commits to index.db
 *  (PRAGMA data_version), finds them in time linear in min(n, longest row)
 *  plus the matches, however many rows share the query's first tokens; it
 *  holds about 40 bytes per row. An empty list (count 0) when none or
 *  n == 0; KVT_EINVAL for NULL tokens with n > 0. */
KVT_API int kvt_index_lookup_prefix(kvt_index_rows *out, kvt_index *idx,
                                    const int32_t *tokens, size_t n);
/** Deletes the row (absent: 0, as the reference). */
KVT_API int kvt_index_delete(kvt_index *idx, const int32_t *tokens, size_t n);
/** Least recently accessed first, at most limit rows (tokens filled). */
KVT_API int kvt_index_lru(kvt_index_rows *out, kvt_index *idx, size_t limit);
KVT_API int kvt_index_total_bytes(uint64_t *out, kvt_index *idx);
KVT_API int kvt_index_count(uint64_t *out, kvt_index *idx);
/** accessed_at = now (absent: 0), written at once as the reference's touch. */
KVT_API int kvt_index_touch(kvt_index *idx, const int32_t *tokens, size_t n);
/** Every row, most recently accessed first (tokens filled). */
KVT_API int kvt_index_all(kvt_index_rows *out, kvt_index *idx);

/* ------------------------------------------------------------------------ */
/* Single layer files (the reference's LayerSerializer)                     */
/* ------------------------------------------------------------------------ */

/** Writes one layer as a safetensors file at path (tensor names
 *  layer_<idx>_keys/_values/_state_<j>, quantized names in native mode) and
 *  returns its manifest metadata as a malloc'ed JSON object string in
 *  *meta_json (free with kvt_free). mode is a kvt_storage_mode. Not atomic
 *  on its own (the tier publishes whole entry directories atomically).
 *  Returns 0, KVT_EINVAL, KVT_EIO/KVT_ENOSPC, KVT_ENOMEM. */
KVT_API int kvt_layer_save(char **meta_json, const char *path,
                           const kvt_layer *layer, uint32_t layer_idx, int mode,
                           uint32_t file_mode);

/** Reads one layer file given its manifest metadata JSON. The result is
 *  owned by a single-layer kvt_entry (*out; kvt_entry_layer(*out, 0)).
 *  Returns 0, KVT_ECORRUPT, KVT_EIO, KVT_ENOMEM, KVT_EINVAL. */
KVT_API int kvt_layer_load(kvt_entry **out, const char *path,
                           const char *meta_json);

#ifdef __cplusplus
}
#endif

#endif /* KVTIER_SYS_H */
