/*
 * index.h - the SQLite index (the reference's schema, byte for byte, so either
 * program opens the other's index.db) plus kvtier's side table and an in-memory
 * mirror that answers exact and longest-prefix lookups without SQL. The public
 * kvt_index_* functions (the reference's SSDIndex, ssdindex.c) open the same
 * object without the mirror (KVTI_INDEX_SQL_ONLY) and run the reference's SQL.
 *
 * Schema: the reference's `schema_version` and `entries` tables with its three
 * indexes, untouched; kvtier adds `kvtier_meta(token_hash TEXT PRIMARY KEY,
 * disk_bytes INTEGER NOT NULL, storage_mode INTEGER NOT NULL)` which the
 * reference ignores. A row in entries without a kvtier_meta row (the reference
 * wrote it) has its disk bytes measured at open by the caller's callback.
 *
 * Threads: every function is safe to call from any thread; one mutex serialises
 * SQLite, the mirror has its own read-write lock so lookups do not wait for
 * writes to SQLite. *
 * Implemented in src/index/: db.c (SQLite), write.c, touch.c, mirror.c
 * (lookups) and ssdindex.c (the public kvt_index_* API), sharing internal.h.
 */
#ifndef KVT_INDEX_H
#define KVT_INDEX_H

#include "base/salt.h"
#include "kvtier.h"
#include "kvtier_sys.h"

#include <stddef.h>
#include <stdint.h>

/* Measures the bytes stored for the entry named hash (64 hex), for a row that
 * lacks kvtier_meta (the reference wrote it). The index knows nothing of where
 * or how entries are stored: the caller (the tier, over its storage backend)
 * supplies this. Returns 1 with *bytes set (recorded in kvtier_meta unless
 * read-only), 0 when it cannot be measured (the row is served with 0 disk
 * bytes and measured again at the next open), or a negative KVT_E* code,
 * which fails the open. Called on the opening thread, during
 * kvti_index_open only. */
typedef struct kvti_index_measure {
  int (*fn)(void *ctx, const char *hash, uint64_t *bytes);
  void *ctx;
} kvti_index_measure;

/* The database's name inside a cache directory (the reference's). */
#define KVTI_INDEX_DB_FILE "index.db"

/* Opens cache_dir/index.db. measure (may be NULL; copied) gives the disk bytes
 * of rows that lack kvtier_meta; without it they get 0. mode (bits):
 * KVTI_INDEX_READONLY opens SQLITE_OPEN_READONLY, no schema changes (a legacy
 * DB is then served with prefix hashes computed in memory; one whose tables
 * do not exist yet - a writer is creating them - is served as an empty
 * index);
 * KVTI_INDEX_SQL_ONLY does not load the mirror (the public SSDIndex API, which
 * answers from SQL; the kvti_ lookups then find nothing). Otherwise loads the
 * mirror. */
#define KVTI_INDEX_READONLY 0x1
#define KVTI_INDEX_SQL_ONLY 0x2
int kvti_index_open(kvt_index **out, const char *cache_dir,
                    const kvti_index_measure *measure, int mode);
/* The time recency is stamped with (rows' and chunks' created_at and
 * accessed_at): fn(ctx), or the wall clock for fn NULL (the default). Set
 * before the index is shared between threads; fn is called on any thread
 * that writes a stamp, so it must not call back into the caller's runtime. */
void kvti_index_set_clock(kvt_index *idx, double (*fn)(void *), void *ctx);
double kvti_index_now(const kvt_index *idx);

/* The SQLite connection for the public SSDIndex API (ssdindex.c), with the
 * index's SQL mutex held until kvti_index_sql_end; sql_err maps an SQLite
 * code to KVT_EDB/KVT_ENOSPC/KVT_EIO/KVT_ENOMEM with the message set. */
struct sqlite3;
struct sqlite3 *kvti_index_sql_begin(kvt_index *idx);
void kvti_index_sql_end(kvt_index *idx);
int kvti_index_sql_err(kvt_index *idx, int rc, const char *what);

/* Inserts or replaces (both tables, one transaction). created_at/accessed_at =
 * now. hash may be NULL (computed); if given it must be the tokens' hash, else
 * KVT_EINVAL. storage_mode is a kvt_storage_mode. KVT_EPERM when opened
 * read-only; SQLite errors -> KVT_EDB (KVT_ENOSPC, KVT_EIO for SQLITE_FULL,
 * SQLITE_IOERR), and then neither SQLite nor the mirror changed. */
int kvti_index_put(kvt_index *idx, const int32_t *tokens, size_t n,
                   const char *hash, uint64_t memory_bytes, uint64_t disk_bytes,
                   int storage_mode);

/* Several puts in one SQLite transaction (all or none: on error neither SQLite
 * nor the mirror changed, except KVT_ENOMEM after the commit, when rows missing
 * from the mirror are served after reopen). Amortises the commit (and WAL
 * checkpoint) cost when the writer has several entries ready. Fields as
 * kvti_index_put; count 0 is a no-op. */
typedef struct kvti_index_put_args {
  const int32_t *tokens;
  size_t n;
  const char *hash; /* NULL or the tokens' hash */
  uint64_t memory_bytes;
  uint64_t disk_bytes;
  int storage_mode;
  /* > 0: created_at = accessed_at = this (an entry adopted from its files
   * keeps its age); 0: now. */
  double created_at;
  /* The entry's cache_salt (base/salt.h; NULL or has = 0: none): hash and
   * prefix_hash are then the salted keys, so only lookups with the same
   * salt find the row (kvti_index_find_salted). */
  const kvti_salt *salt;
  /* 1: the same transaction drops the hash's chained-entry row, if that
   * table exists (kvtier_chained_entries, index/chain.h). A tier without
   * chunks sets it: the whole entry it publishes replaces whatever a chunked
   * tier stored under the hash, whose row must not outlive it. */
  int drop_chained;
} kvti_index_put_args;
int kvti_index_put_many(kvt_index *idx, const kvti_index_put_args *puts,
                        size_t count);

/* Exact / longest-prefix lookups from the mirror (no SQL). created_before > 0
 * hides entries created before it (retention). Return 0, KVT_ENOTFOUND. */
int kvti_index_find(kvt_entry_info *out, kvt_index *idx, const int32_t *tokens,
                    size_t n, double created_before);
int kvti_index_find_prefix(kvt_entry_info *out, kvt_index *idx,
                           const int32_t *tokens, size_t n,
                           double created_before);
int kvti_index_find_hash(kvt_entry_info *out, kvt_index *idx, const char *hash);
/* As kvti_index_find / find_prefix for the rows of cache_salt salt (NULL or
 * has = 0: the unsalted rows, exactly kvti_index_find / find_prefix). */
int kvti_index_find_salted(kvt_entry_info *out, kvt_index *idx,
                           const int32_t *tokens, size_t n,
                           double created_before, const kvti_salt *salt);
int kvti_index_find_prefix_salted(kvt_entry_info *out, kvt_index *idx,
                                  const int32_t *tokens, size_t n,
                                  double created_before, const kvti_salt *salt);

/* Removes by hash (both tables and the mirror). KVT_ENOTFOUND if absent. */
int kvti_index_remove_hash(kvt_index *idx, const char *hash);
/* Removes an entry from the mirror only (lookups, totals, LRU), leaving its
 * SQLite row: for a removal whose SQL commit failed (a full disk), after the
 * files were deleted - the next open's reconcile drops the row whose files
 * are gone. KVT_ENOTFOUND if absent. */
int kvti_index_forget_hash(kvt_index *idx, const char *hash);

/* kvti_index_put without waiting for another connection's write lock:
 * KVT_EBUSY at once where kvti_index_put would wait up to its busy timeout
 * (5 s). The writer commits this way while it holds the tier's mutation lock,
 * and waits for the lock with kvti_index_wait_writable without it. */
int kvti_index_put_nowait(kvt_index *idx, const int32_t *tokens, size_t n,
                          const char *hash, uint64_t memory_bytes,
                          uint64_t disk_bytes, int storage_mode);
/* One put described by a (its salt included; created_at ignored): as
 * kvti_index_put (wait = 1) or kvti_index_put_nowait (wait = 0). */
int kvti_index_put_one(kvt_index *idx, const kvti_index_put_args *a, int wait);
/* count puts in ONE transaction (all or none: a failure changes neither
 * SQLite nor the mirror), waiting for another connection's lock (wait = 1)
 * or not (wait = 0: KVT_EBUSY at once). The writer's group commit. */
int kvti_index_put_batch(kvt_index *idx, const kvti_index_put_args *a,
                         size_t count, int wait);
/* Waits up to timeout_ms until index.db's write lock can be taken (then
 * releases it at once). 0, KVT_EBUSY (still held by another connection), or
 * another code. */
int kvti_index_wait_writable(kvt_index *idx, int64_t timeout_ms);

/* 1 when the last index error on this thread was SQLite reporting a damaged
 * file (SQLITE_NOTADB, SQLITE_CORRUPT): the tier then sets index.db aside and
 * rebuilds it from the entry directories. */
int kvti_index_error_is_damage(void);
/* 1 once SQLite has reported this index's file damaged after open (any
 * statement), or kvti_index_quick_check failed. */
int kvti_index_damaged(kvt_index *idx);
/* PRAGMA quick_check over the file (this connection's page cache dropped
 * first, so the disk is what is checked). 0 (ok), KVT_ECORRUPT (damaged:
 * kvti_index_damaged is then 1), KVT_EDB, KVT_EIO. */
int kvti_index_quick_check(kvt_index *idx);

/* accessed_at = now in the mirror at once; written to SQLite in batches (at the
 * latest by kvti_index_flush or close). KVT_ENOTFOUND if absent. */
int kvti_index_touch_hash(kvt_index *idx, const char *hash);
int kvti_index_flush(kvt_index *idx);

/* Totals from the mirror, O(1). */
void kvti_index_totals(kvt_index *idx, uint64_t *entries, uint64_t *disk_bytes,
                       uint64_t *memory_bytes);

/* Least recently used entry (oldest accessed_at). KVT_ENOTFOUND when empty. */
int kvti_index_lru_victim(kvt_entry_info *out, kvt_index *idx);
/* Oldest-created entry with created_at < cutoff. KVT_ENOTFOUND when none. */
int kvti_index_oldest_before(kvt_entry_info *out, kvt_index *idx,
                             double cutoff);

/* Visits entries, most recently used first, until fn returns nonzero. The index
 * lock is NOT held during fn (a snapshot is taken first), so fn may call other
 * index functions. */
int kvti_index_foreach(kvt_index *idx, kvt_entry_visit_fn fn, void *ctx);

/* Tokens of a stored entry (malloc'ed copy; free with kvti_free), read from
 * SQLite. */
int kvti_index_tokens(int32_t **tokens, size_t *n, kvt_index *idx,
                      const char *hash);

/* Makes every commit durable before it returns (durable != 0: PRAGMA
 * synchronous=FULL, which in WAL mode fsyncs the WAL at each commit) or
 * restores the reference's synchronous=NORMAL (a power loss may roll back the
 * last commits; never corrupts). The tier sets FULL when its durability is
 * FSYNC, so an entry acknowledged as written cannot lose its row to a power
 * loss (reconcile would then delete its durable files as an orphan). No-op on
 * a read-only index. Returns 0 or an error code. */
int kvti_index_set_durable(kvt_index *idx, int durable);

/* Rows of index.db that failed validation at open (hostile or damaged:
 * file_path not the token_hash, blob length != num_tokens*4, bad numbers) and
 * are not served; each set the last-error message when skipped. */
uint64_t kvti_index_skipped(kvt_index *idx);

/* Benchmarks only: adds an entry to the in-memory mirror without writing SQLite
 * (created_at = accessed_at = t). Returns 0, KVT_ENOMEM, KVT_EINVAL. */
int kvti_index_bench_add(kvt_index *idx, const int32_t *tokens, size_t n,
                         double t);

/* Heap bytes of the mirror's lookup structures (benchmarks, diagnostics). */
uint64_t kvti_index_mem_bytes(kvt_index *idx);

#endif
