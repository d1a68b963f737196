/*
 * internal.h - what the files of src/index share and nobody else sees: the
 * struct kvt_index (SQLite handle and statements, the in-memory mirror, the
 * pending touches), the mirror record, the prepared-statement table and the
 * kvti_idx_* helpers each file lends the others. db.c owns SQLite (schema,
 * open/migrate, load, close), write.c the puts and removes, touch.c the touch
 * batching, mirror.c the mirror (block trie, heaps, lookups) and ssdindex.c the
 * public kvt_index_* API (with ssdprefix.c its prefix candidate map and
 * ssdrows.c its rows). The design (trie keys, memory per entry, lock order)
 * is described in mirror.c and db.c; index.h is the interface the tier uses.
 *
 * Locks: db_mu serialises SQLite; rw protects the mirror; pend_mu the pending
 * touches. Order is always db_mu -> rw -> pend_mu. Each helper below states
 * which lock its caller must hold.
 */
#ifndef KVT_INDEX_INTERNAL_H
#define KVT_INDEX_INTERNAL_H

#include "base/hashmap.h"
#include "index/index.h"

#include <pthread.h>
#include <stdatomic.h>
#include <sqlite3.h>
#include <stddef.h>
#include <stdint.h>

#define BLK 16 /* tokens per trie block (== the reference's prefix filter) */
#define HB0 0x6b7674696572ull /* hb_0, "kvtier" */
#define TOUCH_BATCH 256
#define TOUCH_MAX_AGE 1.0 /* seconds a touch may wait before being written */
#define BUSY_TIMEOUT_MS 5000
#define MAX_TOKENS                                                             \
  ((uint64_t)1 << 28) /* 1 GiB blob: SQLite's default length limit */

/* Prepared statements (SQL text in db.c). */
enum {
  ST_INSERT, /* the reference's INSERT OR REPLACE */
  ST_META_PUT,
  ST_META_DEL,
  ST_DELETE,
  ST_TOUCH,
  ST_TOKENS,
  ST_BEGIN,
  ST_COMMIT,
  ST_ROLLBACK,
  ST_COUNT
};

typedef struct mirror_ent {
  uint8_t sha[32];  /* SHA-256 of the tokens: the key */
  uint8_t psha[32]; /* SHA-256 of the first min(n,16) tokens (prefix_hash) */
  uint64_t hb;      /* node key: chained hash of the full blocks */
  uint64_t hf;      /* sequence key (hb + tail) */
  uint64_t num_tokens;
  uint64_t memory_bytes;
  uint64_t disk_bytes;
  double created_at;
  double accessed_at;
  uint32_t heap_pos[2]; /* positions in the LRU / created heaps; heap_pos[0] =
                           next free */
  int32_t storage_mode;
  uint32_t live;
} mirror_ent;
_Static_assert(sizeof(mirror_ent) == 136,
               "per-entry memory stated in mirror.c's file comment");

enum { H_LRU = 0, H_CREATED = 1 };

typedef struct touch_rec {
  uint8_t sha[32];
  double t;
} touch_rec;

struct kvt_index {
  sqlite3 *db;
  sqlite3_stmt *st[ST_COUNT];
  pthread_mutex_t db_mu;
  int readonly;
  /* SQLite reported the file damaged (SQLITE_CORRUPT / SQLITE_NOTADB) after
   * open, or quick_check failed: the tier sets index.db aside at close so
   * the next open rebuilds it from the entry directories. */
  atomic_int damaged;
  kvti_index_measure measure; /* fn NULL: rows lacking kvtier_meta get 0 */
  double (*now_fn)(void *);   /* recency's clock (NULL: the wall clock) */
  void *now_ctx;
  char *db_path;

  pthread_rwlock_t rw;
  mirror_ent *ents;
  uint32_t n_ents, cap_ents; /* slots used (live or free) / allocated */
  uint32_t free_head;        /* 1-based id of a free slot, 0 = none */
  uint32_t *heap[2];
  uint32_t heap_n, heap_cap;
  kvti_hm exact; /* sha[0..8) -> id */
  kvti_hm seq;   /* hf -> id */
  kvti_hm nodes; /* hb -> count | tailmask << 32 */
  uint64_t n_live, sum_disk, sum_mem;
  uint64_t skipped;

  pthread_mutex_t pend_mu;
  touch_rec *pend;
  size_t pend_n, pend_cap;
  double pend_first;

  /* kvt_index_lookup_prefix's candidate map (ssdprefix.c; db_mu): allocated
   * by kvt_index_open only (a tier's index writes its table elsewhere and
   * runs the reference's query), built at its first lookup. */
  struct kvti_pfx *pfx;
};

/* ---- mirror.c: keys and hashes ---- */

/* SHA-256 of len bytes. Returns 0 or KVT_ENOMEM. */
int kvti_idx_sha256(uint8_t out[32], const void *data, size_t len);
/* Lowercase hex of a 32-byte key, NUL-terminated. */
void kvti_idx_hex(char out[65], const uint8_t b[32]);
/* Parses 64 lowercase hex digits; -1 for anything else (NULL included). */
int kvti_idx_unhex(uint8_t out[32], const char *s);
/* KVT_EINVAL for NULL tokens with n > 0 or more than MAX_TOKENS. */
int kvti_idx_check_tokens(const int32_t *tokens, size_t n);
/* kvti_idx_check_tokens, then the sequence's key (SHA-256 of its int32
 * bytes). */
int kvti_idx_tokens_sha(uint8_t sha[32], const int32_t *tokens, size_t n);
/* Builds the mirror record of a token sequence (hashes computed here, outside
 * any lock). full_sha = 0 leaves e->sha for the caller (rows loaded from SQLite
 * carry their key). */
int kvti_idx_make_ent(mirror_ent *e, const int32_t *tokens, size_t n,
                      int full_sha);

/* ---- mirror.c: maintenance (callers hold rw for writing) ---- */

/* Restores heap h around position pos after its key changed. */
void kvti_idx_heap_fix(kvt_index *idx, int h, uint32_t pos);
/* 1 and *id when a live entry has key sha, else 0 (rw held, read suffices). */
int kvti_idx_mirror_find(const kvt_index *idx, const uint8_t sha[32],
                         uint32_t *id);
/* Room for one more entry everywhere, so kvti_idx_mirror_add cannot fail.
 * Returns 0 or KVT_ENOMEM. */
int kvti_idx_mirror_reserve(kvt_index *idx);
/* Inserts a new entry (not present). kvti_idx_mirror_reserve must have
 * succeeded. */
void kvti_idx_mirror_add(kvt_index *idx, const mirror_ent *src);
void kvti_idx_mirror_del(kvt_index *idx, uint32_t id);

/* Calls fn(ctx, idx, id) for each stored non-empty sequence that is a prefix
 * of tokens, longest first, until fn returns nonzero. Caller holds rw (read).
 * Returns 0 or a negative code. */
typedef int (*kvti_idx_prefix_fn)(void *ctx, kvt_index *idx, uint32_t id);
int kvti_idx_prefix_walk(kvt_index *idx, const int32_t *tokens, size_t n,
                         double created_before, kvti_idx_prefix_fn fn,
                         void *ctx, const kvti_salt *salt);

/* ---- db.c: SQLite ---- */

/* The KVT_E* code of SQLite result rc: KVT_ENOSPC (FULL), KVT_EIO (IOERR),
 * KVT_ENOMEM, KVT_EBUSY (BUSY, LOCKED: another connection holds the lock),
 * else KVT_EDB (a damaged file included: kvt_index_open's contract). */
int kvti_idx_code(int rc);
/* Sets the error message for SQLite result rc during what; returns the
 * KVT_E* code (kvti_idx_code). */
int kvti_idx_db_err(kvt_index *idx, int rc, const char *what);
/* Runs SQL text (sqlite3_exec); 0 or a code as kvti_idx_db_err. */
int kvti_idx_exec(kvt_index *idx, const char *sql, const char *what);
/* Runs prepared statement `which` (no rows wanted), then resets it. */
int kvti_idx_step(kvt_index *idx, int which, const char *what);
/* Rolls back the open transaction, if any. */
void kvti_idx_rollback(kvt_index *idx);
/* Validates a row of entries (columns: token_hash, tokens_blob, num_tokens,
 * file_path at the given indexes) read from SQLite; th receives the hash.
 * Returns 1 when valid, 0 (counted in *skipped unless NULL, error message set)
 * for a hostile or damaged row. */
int kvti_idx_row_valid(uint64_t *skipped, sqlite3_stmt *s, int col_th,
                       int col_blob, int col_n, int col_fp, char th[65]);
/* 1 when column col is a non-negative integer or finite real. */
int kvti_idx_num_ok(sqlite3_stmt *s, int col);
/* Frees everything (no flush; kvt_index_close flushes first). NULL is a
 * no-op. */
void kvti_idx_destroy(kvt_index *idx);

/* ---- write.c ---- */

/* count puts in one SQLite transaction (all or none), then the mirror.
 * with_meta = 0 writes a reference-style row (no kvtier_meta). wait = 0:
 * another connection's write lock is not waited for (KVT_EBUSY at once). */
int kvti_idx_put_common(kvt_index *idx, const kvti_index_put_args *a,
                        size_t count, int with_meta, int wait);
/* Removes key sha from both tables and the mirror; KVT_ENOTFOUND if absent. */
int kvti_idx_remove_sha(kvt_index *idx, const uint8_t sha[32]);

/* ---- touch.c ---- */

/* accessed_at = now for key sha (mirror at once, SQLite batched). */
int kvti_idx_touch_sha(kvt_index *idx, const uint8_t sha[32]);
/* Writes the pending touches in one transaction. Caller holds db_mu. */
int kvti_idx_flush_locked(kvt_index *idx);
/* True when the pending touches are due (a full batch, or the oldest waited
 * TOUCH_MAX_AGE). */
int kvti_idx_touches_due(kvt_index *idx, double t);

/* ---- ssdprefix.c: the public lookup_prefix's candidate map (db_mu held) ----
 */

/* The reference's lookup_prefix answer for tokens[0, n) (n >= 1), read
 * through the candidate map (built or refreshed here). Returns 0 and *out, or
 * an error code (*out untouched). */
int kvti_pfx_lookup(kvt_index_rows *out, kvt_index *idx, sqlite3 *db,
                    const int32_t *tokens, size_t n);
/* The own connection inserted (or replaced) row rowid with these tokens and
 * num_tokens column: its pair joins the map. */
void kvti_pfx_inserted(kvt_index *idx, int64_t rowid, const int32_t *tokens,
                       size_t n, uint64_t num_tokens);
/* The own connection deleted a row (its pair goes stale). */
void kvti_pfx_removed(kvt_index *idx);
/* Gives a public index its (empty) map; left without one when out of
 * memory. */
void kvti_pfx_attach(kvt_index *idx);
/* Frees the map and its statements (before the connection closes). */
void kvti_pfx_free(kvt_index *idx);

/* ---- ssdrows.c: rows of the public API (ssdindex.c, ssdprefix.c) ---- */

/* Fills r from a statement whose first seven columns are token_hash,
 * tokens_blob, num_tokens, file_path, memory_bytes, created_at, accessed_at;
 * with_tokens: tokens and the whole path in one allocation (list rows), else
 * tokens NULL and KVT_ERANGE when the path does not fit r->file_path. */
int kvti_ssd_read_row(kvt_index_row *r, sqlite3_stmt *s, int with_tokens);
/* Steps s to the end, collecting list rows (keep: NULL or a filter on the row
 * just read, which drops it when it returns 0). Hands the list to out on
 * success, frees it on failure. */
int kvti_ssd_collect(kvt_index_rows *out, kvt_index *idx, sqlite3_stmt *s,
                     int (*keep)(const kvt_index_row *, const void *),
                     const void *kctx);

#endif
