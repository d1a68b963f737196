/*
 * ssdindex.c - the public kvt_index_* API: the reference's SSDIndex, call for
 * call. Each function runs the reference's own SQL statement (same text for
 * the insert, the same ORDER BY for lru/all) on the connection of an index
 * opened with KVTI_INDEX_SQL_ONLY, so rows are stored and returned exactly as
 * the reference stores them: any file_path string, any num_tokens.
 * lookup_prefix finds its candidates through ssdprefix.c's map instead of
 * the reference's scan of every row sharing the first 16 tokens, and then
 * applies the reference's condition to each candidate row as stored (the
 * scan remains as the fallback when the map cannot be allocated). Safety does
 * not rest on this table: a tier loads only rows whose file_path is their own
 * token hash (index/db.c's row_valid) and never opens a path read from the
 * index. The only additions to the reference's statements: a validity filter
 * (rows whose numbers or blob kvt_index_row cannot hold are left out of every
 * answer), and inserts and deletes also drop the row's kvtier_meta record, so a
 * tier re-measures the entry's files. The rows themselves are read, listed
 * and freed by ssdrows.c.
 */
#include "index/internal.h"

#include "base/clock.h"
#include "base/error.h"
#include "base/io.h"
#include "kvtier.h"

#include <pthread.h>
#include <sqlite3.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define PREFIX_TOKENS 16 /* the reference's _PREFIX_FILTER_TOKENS */
#define SQL_MAX_TOKENS                                                         \
  ((size_t)1 << 28) /* 1 GiB blob: SQLite's length limit                       \
                     */

/* Rows kvt_index_row can represent; every query adds it. */
#define VALID                                                                  \
  " typeof(token_hash) = 'text' AND length(token_hash) = 64"                   \
  " AND typeof(tokens_blob) = 'blob' AND length(tokens_blob) % 4 = 0"          \
  " AND typeof(num_tokens) = 'integer' AND num_tokens >= 0"                    \
  " AND typeof(memory_bytes) = 'integer' AND memory_bytes >= 0"                \
  " AND typeof(file_path) = 'text' "

#define COLS                                                                   \
  "SELECT token_hash, tokens_blob, num_tokens, file_path, memory_bytes, "      \
  "created_at, accessed_at FROM entries "

/* The reference's insert_entry statement, verbatim. */
static const char INSERT_SQL[] =
    "\n                INSERT OR REPLACE INTO entries\n"
    "                    (token_hash, tokens_blob, prefix_hash, num_tokens, "
    "file_path,\n                     memory_bytes, created_at, accessed_at)\n"
    "                VALUES (?, ?, ?, ?, ?, ?, ?, ?)\n                ";

/* The row key of a token sequence (kvt_token_hash refuses NULL tokens),
 * within the blob length SQLite stores. */
static int row_key(char th[KVT_HASH_HEX_LEN + 1], const int32_t *tokens,
                   size_t n) {
  if (n > SQL_MAX_TOKENS)
    return KVT_ERR(KVT_EINVAL, "index: too many tokens (%zu)", n);
  return kvt_token_hash(th, tokens, n);
}

/* Prepares sql on the locked connection; on failure returns the mapped code
 * (the caller unlocks). */
static int prep(kvt_index *idx, sqlite3 *db, const char *sql,
                sqlite3_stmt **s) {
  int rc = sqlite3_prepare_v2(db, sql, -1, s, NULL);
  return rc == SQLITE_OK ? 0 : kvti_index_sql_err(idx, rc, "prepare");
}

/* Steps a statement that returns no rows. */
static int step_one(kvt_index *idx, sqlite3_stmt *s, const char *what) {
  int rc = sqlite3_step(s);
  return rc == SQLITE_DONE || rc == SQLITE_ROW
             ? 0
             : kvti_index_sql_err(idx, rc, what);
}

/* step_one, then finalizes. */
static int run(kvt_index *idx, sqlite3_stmt *s, const char *what) {
  int out = step_one(idx, s, what);
  sqlite3_finalize(s);
  return out;
}

static int exec(kvt_index *idx, sqlite3 *db, const char *sql) {
  sqlite3_stmt *s = NULL;
  int rc = prep(idx, db, sql, &s);
  return rc ? rc : run(idx, s, sql);
}

/* One statement binding only a token_hash, in a transaction with the same
 * statement on kvtier_meta (insert/delete keep the side table in step). */
static int drop_meta(kvt_index *idx, sqlite3 *db, const char *th) {
  sqlite3_stmt *s = NULL;
  int rc = prep(idx, db, "DELETE FROM kvtier_meta WHERE token_hash = ?", &s);
  if (rc)
    return rc;
  sqlite3_bind_text(s, 1, th, 64, SQLITE_STATIC);
  return run(idx, s, "delete kvtier_meta");
}

static int finish_tx(kvt_index *idx, sqlite3 *db, int rc) {
  if (rc == 0)
    rc = exec(idx, db, "COMMIT");
  if (rc != 0 && !sqlite3_get_autocommit(db))
    sqlite3_exec(db, "ROLLBACK", NULL, NULL, NULL);
  return rc;
}

/* ---- the SSDIndex methods ---- */

int kvt_index_insert(kvt_index *idx, const int32_t *tokens, size_t n,
                     const char *file_path, uint64_t memory_bytes,
                     uint64_t num_tokens) {
  if (!idx || !file_path)
    return KVT_ERR(KVT_EINVAL, "kvt_index_insert: NULL argument");
  if (memory_bytes > INT64_MAX || num_tokens > INT64_MAX)
    return KVT_ERR(KVT_EINVAL,
                   "kvt_index_insert: memory_bytes/num_tokens above INT64_MAX");
  char th[KVT_HASH_HEX_LEN + 1], ph[KVT_HASH_HEX_LEN + 1];
  int rc = row_key(th, tokens, n);
  if (rc || (rc = kvt_prefix_hash(ph, tokens, n)) != 0)
    return rc;
  double now = kvti_index_now(idx);
  sqlite3 *db = kvti_index_sql_begin(idx);
  sqlite3_stmt *s = NULL;
  rc = exec(idx, db, "BEGIN IMMEDIATE");
  if (!rc && !(rc = prep(idx, db, INSERT_SQL, &s))) {
    sqlite3_bind_text(s, 1, th, 64, SQLITE_STATIC);
    sqlite3_bind_blob(s, 2, n ? (const void *)tokens : "", (int)(n * 4),
                      SQLITE_STATIC);
    sqlite3_bind_text(s, 3, ph, 64, SQLITE_STATIC);
    sqlite3_bind_int64(s, 4, (sqlite3_int64)num_tokens);
    sqlite3_bind_text(s, 5, file_path, -1, SQLITE_STATIC);
    sqlite3_bind_int64(s, 6, (sqlite3_int64)memory_bytes);
    sqlite3_bind_double(s, 7, now);
    sqlite3_bind_double(s, 8, now);
    rc = run(idx, s, "insert");
  }
  int64_t rowid = sqlite3_last_insert_rowid(db);
  if (!rc)
    rc = drop_meta(idx, db, th);
  rc = finish_tx(idx, db, rc);
  if (!rc)
    kvti_pfx_inserted(idx, rowid, tokens, n, num_tokens);
  kvti_index_sql_end(idx);
  return rc;
}

/* What a keyed call does with its statement (the row key bound last). */
typedef int (*keyed_fn)(kvt_index *idx, sqlite3 *db, sqlite3_stmt *s,
                        const char *th, void *ctx);

/* Hashes the tokens to their row key; then, with the connection locked,
 * prepares sql, binds the key to its last parameter and hands the statement
 * to fn, which steps it; finalizes. */
static int keyed(kvt_index *idx, const int32_t *tokens, size_t n,
                 const char *sql, keyed_fn fn, void *ctx) {
  char th[KVT_HASH_HEX_LEN + 1];
  int rc = row_key(th, tokens, n);
  if (rc)
    return rc;
  sqlite3 *db = kvti_index_sql_begin(idx);
  sqlite3_stmt *s = NULL;
  if ((rc = prep(idx, db, sql, &s)) == 0) {
    sqlite3_bind_text(s, sqlite3_bind_parameter_count(s), th, 64,
                      SQLITE_STATIC);
    rc = fn(idx, db, s, th, ctx);
    sqlite3_finalize(s);
  }
  kvti_index_sql_end(idx);
  return rc;
}

#define BY_KEY COLS "WHERE token_hash = ? AND" VALID

static int exact_fn(kvt_index *idx, sqlite3 *db, sqlite3_stmt *s,
                    const char *th, void *out) {
  (void)db;
  (void)th;
  int src = sqlite3_step(s);
  if (src == SQLITE_ROW)
    return kvti_ssd_read_row(out, s, 0);
  if (src == SQLITE_DONE)
    return KVT_ERR(KVT_ENOTFOUND, "index: no such entry");
  return kvti_index_sql_err(idx, src, "lookup");
}

int kvt_index_lookup_exact(kvt_index_row *out, kvt_index *idx,
                           const int32_t *tokens, size_t n) {
  if (!out || !idx)
    return KVT_ERR(KVT_EINVAL, "kvt_index_lookup_exact: NULL argument");
  return keyed(idx, tokens, n, BY_KEY, exact_fn, out);
}

static int get_fn(kvt_index *idx, sqlite3 *db, sqlite3_stmt *s, const char *th,
                  void *out) {
  (void)db;
  (void)th;
  return kvti_ssd_collect(out, idx, s, NULL, NULL);
}

int kvt_index_get(kvt_index_rows *out, kvt_index *idx, const int32_t *tokens,
                  size_t n) {
  if (!out || !idx)
    return KVT_ERR(KVT_EINVAL, "kvt_index_get: NULL argument");
  return keyed(idx, tokens, n, BY_KEY, get_fn, out);
}

typedef struct query {
  const int32_t *tokens;
  size_t n;
} query;

/* The reference's comparison: the stored blob equals the query's first
 * num_tokens tokens (so its length is num_tokens too). */
static int is_prefix(const kvt_index_row *r, const void *ctx) {
  const query *q = ctx;
  return r->num_tokens <= q->n && r->n_tokens == r->num_tokens &&
         (r->n_tokens == 0 ||
          memcmp(r->tokens, q->tokens, r->n_tokens * sizeof(int32_t)) == 0);
}

int kvt_index_lookup_prefix(kvt_index_rows *out, kvt_index *idx,
                            const int32_t *tokens, size_t n) {
  if (!out || !idx)
    return KVT_ERR(KVT_EINVAL, "kvt_index_lookup_prefix: NULL argument");
  out->rows = NULL;
  out->count = 0;
  if (n > SQL_MAX_TOKENS)
    return KVT_ERR(KVT_EINVAL, "index: too many tokens (%zu)", n);
  if (n == 0)
    return 0; /* the reference: no prefix hashes, no query */
  if (!tokens)
    return KVT_ERR(KVT_EINVAL, "kvt_index_lookup_prefix: NULL tokens");
  /* The candidate map (ssdprefix.c) answers without reading the rows that
   * share the query's first tokens; the reference's candidate query below
   * stays for when the map cannot be made (out of memory). */
  int rc = KVT_ENOMEM;
  sqlite3 *mdb = kvti_index_sql_begin(idx);
  if (idx->pfx)
    rc = kvti_pfx_lookup(out, idx, mdb, tokens, n);
  kvti_index_sql_end(idx);
  if (rc != KVT_ENOMEM)
    return rc;
  /* The hashes of the query's first 1..m tokens, m = min(n, 16); the 16
   * placeholders repeat the last one when m < 16 (IN ignores duplicates). */
  size_t m = n < PREFIX_TOKENS ? n : PREFIX_TOKENS;
  char ph[PREFIX_TOKENS][KVT_HASH_HEX_LEN + 1];
  for (size_t k = 0; k < m; k++)
    if ((rc = kvt_token_hash(ph[k], tokens, k + 1)) != 0)
      return rc;
  sqlite3 *db = kvti_index_sql_begin(idx);
  sqlite3_stmt *s = NULL;
  rc = prep(idx, db,
            COLS "WHERE num_tokens <= ? AND prefix_hash IN "
                 "(?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?) AND" VALID
                 "ORDER BY num_tokens DESC",
            &s);
  if (!rc) {
    sqlite3_bind_int64(s, 1, (sqlite3_int64)n);
    for (size_t k = 0; k < PREFIX_TOKENS; k++)
      sqlite3_bind_text(s, (int)k + 2, ph[k < m ? k : m - 1], 64,
                        SQLITE_STATIC);
    query q = {tokens, n};
    rc = kvti_ssd_collect(out, idx, s, is_prefix, &q);
    sqlite3_finalize(s);
  }
  kvti_index_sql_end(idx);
  return rc;
}

static int delete_fn(kvt_index *idx, sqlite3 *db, sqlite3_stmt *s,
                     const char *th, void *ctx) {
  (void)ctx;
  int rc = exec(idx, db, "BEGIN IMMEDIATE");
  if (!rc)
    rc = step_one(idx, s, "delete");
  if (!rc)
    rc = drop_meta(idx, db, th);
  rc = finish_tx(idx, db, rc);
  if (!rc)
    kvti_pfx_removed(idx);
  return rc;
}

int kvt_index_delete(kvt_index *idx, const int32_t *tokens, size_t n) {
  if (!idx)
    return KVT_ERR(KVT_EINVAL, "kvt_index_delete: NULL index");
  return keyed(idx, tokens, n, "DELETE FROM entries WHERE token_hash = ?",
               delete_fn, NULL);
}

static int ordered(kvt_index_rows *out, kvt_index *idx, const char *sql,
                   int64_t limit) {
  if (!out || !idx)
    return KVT_ERR(KVT_EINVAL, "kvt_index_lru/all: NULL argument");
  sqlite3 *db = kvti_index_sql_begin(idx);
  sqlite3_stmt *s = NULL;
  int rc = prep(idx, db, sql, &s);
  if (!rc) {
    if (limit >= 0)
      sqlite3_bind_int64(s, 1, limit);
    rc = kvti_ssd_collect(out, idx, s, NULL, NULL);
    sqlite3_finalize(s);
  }
  kvti_index_sql_end(idx);
  return rc;
}

int kvt_index_lru(kvt_index_rows *out, kvt_index *idx, size_t limit) {
  return ordered(out, idx,
                 COLS "WHERE" VALID "ORDER BY accessed_at ASC LIMIT ?",
                 limit > INT64_MAX ? INT64_MAX : (int64_t)limit);
}

int kvt_index_all(kvt_index_rows *out, kvt_index *idx) {
  return ordered(out, idx, COLS "WHERE" VALID "ORDER BY accessed_at DESC", -1);
}

/* One integer from a single-row aggregate. */
static int scalar(uint64_t *out, kvt_index *idx, const char *sql) {
  if (!out || !idx)
    return KVT_ERR(KVT_EINVAL, "kvt_index_count/total_bytes: NULL argument");
  sqlite3 *db = kvti_index_sql_begin(idx);
  sqlite3_stmt *s = NULL;
  int rc = prep(idx, db, sql, &s);
  if (!rc) {
    int src = sqlite3_step(s);
    if (src == SQLITE_ROW)
      *out = (uint64_t)sqlite3_column_int64(s, 0);
    else
      rc = kvti_index_sql_err(idx, src, "aggregate");
    sqlite3_finalize(s);
  }
  kvti_index_sql_end(idx);
  return rc;
}

int kvt_index_total_bytes(uint64_t *out, kvt_index *idx) {
  return scalar(
      out, idx,
      "SELECT COALESCE(SUM(memory_bytes), 0) FROM entries WHERE" VALID);
}

int kvt_index_count(uint64_t *out, kvt_index *idx) {
  return scalar(out, idx, "SELECT COUNT(*) FROM entries WHERE" VALID);
}

static int touch_fn(kvt_index *idx, sqlite3 *db, sqlite3_stmt *s,
                    const char *th, void *ctx) {
  (void)db;
  (void)th;
  (void)ctx;
  sqlite3_bind_double(s, 1, kvti_index_now(idx));
  return step_one(idx, s, "touch");
}

int kvt_index_touch(kvt_index *idx, const int32_t *tokens, size_t n) {
  if (!idx)
    return KVT_ERR(KVT_EINVAL, "kvt_index_touch: NULL index");
  return keyed(idx, tokens, n,
               "UPDATE entries SET accessed_at = ? WHERE token_hash = ?",
               touch_fn, NULL);
}

int kvt_index_open(kvt_index **out, const char *cache_dir) {
  int rc = kvti_index_open(out, cache_dir, NULL, KVTI_INDEX_SQL_ONLY);
  /* Only a public index gets the prefix map: every write to its table from
   * this connection goes through kvt_index_insert/delete, which keep it. (A
   * tier's index writes rows elsewhere; without the map, or when it cannot
   * be allocated, lookup_prefix runs the reference's query.) */
  if (rc == 0)
    kvti_pfx_attach(*out);
  return rc;
}

void kvt_index_close(kvt_index *idx) {
  if (!idx)
    return;
  kvti_pfx_free(idx); /* its statements before the connection closes */
  kvti_index_flush(idx);
  kvti_idx_destroy(idx);
}
