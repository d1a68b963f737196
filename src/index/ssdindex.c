/*
 * ssdindex.c - the public kvt_index_* API (the reference's SSDIndex, in
 * include/kvtier.h) over the same kvt_index object the tier uses: inserts as
 * reference-style rows (no kvtier_meta), exact and prefix lookups from the
 * mirror, delete and touch silent when absent as the reference's SQL is, and
 * the LRU / all-rows listings read from SQLite after flushing touches.
 */
#include "index/internal.h"

#include "base/error.h"
#include "base/hash.h"
#include "base/io.h"

#include <pthread.h>
#include <sqlite3.h>
#include <stdint.h>
#include <string.h>

void kvt_index_rows_free(kvt_index_rows *rows) {
  if (!rows)
    return;
  for (size_t i = 0; i < rows->count; i++)
    kvti_free((void *)rows->rows[i].tokens);
  kvti_free(rows->rows);
  rows->rows = NULL;
  rows->count = 0;
}

int kvt_index_open(kvt_index **out, const char *cache_dir) {
  return kvti_index_open(out, cache_dir, NULL, 0);
}

void kvt_index_close(kvt_index *idx) {
  if (!idx)
    return;
  kvti_index_flush(idx);
  kvti_idx_destroy(idx);
}

int kvt_index_insert(kvt_index *idx, const int32_t *tokens, size_t n,
                     const char *file_path, uint64_t memory_bytes,
                     uint64_t num_tokens) {
  if (!idx || !file_path)
    return KVT_ERR(KVT_EINVAL, "kvt_index_insert: NULL argument");
  /* kvtier only ever stores entries under their own hash: any other file_path
   * would be an arbitrary path handed to readers of the index. */
  if (num_tokens != n)
    return KVT_ERR(KVT_EINVAL,
                   "kvt_index_insert: num_tokens %llu != %zu tokens",
                   (unsigned long long)num_tokens, n);
  if (!kvti_is_hash_name(file_path))
    return KVT_ERR(KVT_EINVAL,
                   "kvt_index_insert: file_path must be the token hash");
  kvti_index_put_args a = {tokens,       n, file_path,
                           memory_bytes, 0, KVT_STORAGE_COMPAT};
  return kvti_idx_put_common(idx, &a, 1, 0, 1);
}

static void row_from_ent(kvt_index_row *r, const mirror_ent *e) {
  memset(r, 0, sizeof *r);
  kvti_idx_hex(r->token_hash, e->sha);
  memcpy(r->file_path, r->token_hash, 65);
  r->num_tokens = e->num_tokens;
  r->memory_bytes = e->memory_bytes;
  r->created_at = e->created_at;
  r->accessed_at = e->accessed_at;
}

int kvt_index_lookup_exact(kvt_index_row *out, kvt_index *idx,
                           const int32_t *tokens, size_t n) {
  if (!out || !idx)
    return KVT_ERR(KVT_EINVAL, "kvt_index_lookup_exact: NULL argument");
  uint8_t sha[32];
  int rc = kvti_idx_tokens_sha(sha, tokens, n);
  if (rc)
    return rc;
  pthread_rwlock_rdlock(&idx->rw);
  uint32_t id;
  int found = kvti_idx_mirror_find(idx, sha, &id);
  if (found)
    row_from_ent(out, &idx->ents[id]);
  pthread_rwlock_unlock(&idx->rw);
  return found ? 0 : KVT_ERR(KVT_ENOTFOUND, "index: no such entry");
}

typedef struct collect_ctx {
  kvt_index_row *rows;
  size_t n, cap;
} collect_ctx;

/* Room for one more row at c->rows[c->n] (the capacity doubles, starting at
 * first_cap); NULL when out of memory. */
static kvt_index_row *collect_slot(collect_ctx *c, size_t first_cap) {
  if (c->n == c->cap) {
    size_t nc = c->cap ? c->cap * 2 : first_cap;
    kvt_index_row *r = kvti_realloc(c->rows, nc * sizeof *r);
    if (!r)
      return NULL;
    c->rows = r;
    c->cap = nc;
  }
  return &c->rows[c->n];
}

static int collect_fn(void *ctx, kvt_index *idx, uint32_t id) {
  collect_ctx *c = ctx;
  kvt_index_row *r = collect_slot(c, 8);
  if (!r)
    return KVT_ERR_NOMEM();
  row_from_ent(r, &idx->ents[id]);
  c->n++;
  return 0;
}

/* Hands the collected rows to out, or (rc != 0) releases them with their
 * tokens. Returns rc. */
static int collect_finish(kvt_index_rows *out, collect_ctx *c, int rc) {
  kvt_index_rows rows = {c->rows, c->n};
  if (rc)
    kvt_index_rows_free(&rows);
  else
    *out = rows;
  return rc;
}

int kvt_index_lookup_prefix(kvt_index_rows *out, kvt_index *idx,
                            const int32_t *tokens, size_t n) {
  if (!out || !idx)
    return KVT_ERR(KVT_EINVAL, "kvt_index_lookup_prefix: NULL argument");
  int rc = kvti_idx_check_tokens(tokens, n);
  if (rc)
    return rc;
  collect_ctx c = {0};
  pthread_rwlock_rdlock(&idx->rw);
  rc = kvti_idx_prefix_walk(idx, tokens, n, 0, collect_fn, &c);
  pthread_rwlock_unlock(&idx->rw);
  /* The matched rows' tokens are the query's prefixes: copy them. */
  for (size_t i = 0; !rc && i < c.n; i++) {
    size_t nt = (size_t)c.rows[i].num_tokens;
    int32_t *t = kvti_malloc(nt * sizeof(int32_t));
    if (!t) {
      rc = KVT_ERR_NOMEM();
      break;
    }
    memcpy(t, tokens, nt * sizeof(int32_t));
    c.rows[i].tokens = t;
    c.rows[i].n_tokens = nt;
  }
  return collect_finish(out, &c, rc);
}

int kvt_index_delete(kvt_index *idx, const int32_t *tokens, size_t n) {
  if (!idx)
    return KVT_ERR(KVT_EINVAL, "kvt_index_delete: NULL index");
  uint8_t sha[32];
  int rc = kvti_idx_tokens_sha(sha, tokens, n);
  if (rc == 0)
    rc = kvti_idx_remove_sha(idx, sha);
  return rc == KVT_ENOTFOUND ? 0 : rc; /* the reference's DELETE is silent */
}

/* Rows from SQLite in accessed_at order (after flushing touches), validated as
 * at open. */
static int sql_rows(kvt_index_rows *out, kvt_index *idx, const char *sql,
                    int64_t limit) {
  int rc = kvti_index_flush(idx);
  if (rc)
    return rc;
  collect_ctx c = {0};
  pthread_mutex_lock(&idx->db_mu);
  sqlite3_stmt *s = NULL;
  int src = sqlite3_prepare_v2(idx->db, sql, -1, &s, NULL);
  if (src != SQLITE_OK) {
    rc = kvti_idx_db_err(idx, src, "select");
    goto out;
  }
  if (limit >= 0)
    sqlite3_bind_int64(s, 1, limit);
  while ((src = sqlite3_step(s)) == SQLITE_ROW) {
    char th[65];
    /* Invalid rows were counted at open; here they are only left out. */
    int ok = kvti_idx_row_valid(NULL, s, 0, 1, 2, 3, th) &&
             kvti_idx_num_ok(s, 4) && kvti_idx_num_ok(s, 5) &&
             kvti_idx_num_ok(s, 6);
    if (!ok)
      continue;
    kvt_index_row *r = collect_slot(&c, 16);
    if (!r) {
      rc = KVT_ERR_NOMEM();
      goto out;
    }
    memset(r, 0, sizeof *r);
    memcpy(r->token_hash, th, 65);
    memcpy(r->file_path, th, 65);
    r->num_tokens = (uint64_t)sqlite3_column_int64(s, 2);
    r->memory_bytes = (uint64_t)sqlite3_column_int64(s, 4);
    r->created_at = sqlite3_column_double(s, 5);
    r->accessed_at = sqlite3_column_double(s, 6);
    size_t bl = (size_t)sqlite3_column_bytes(s, 1);
    int32_t *t = kvti_malloc(bl ? bl : 1);
    if (!t) {
      rc = KVT_ERR_NOMEM();
      goto out;
    }
    if (bl)
      memcpy(t, sqlite3_column_blob(s, 1), bl);
    r->tokens = t;
    r->n_tokens = bl / 4;
    c.n++;
  }
  if (src != SQLITE_DONE)
    rc = kvti_idx_db_err(idx, src, "select");
out:
  sqlite3_finalize(s);
  pthread_mutex_unlock(&idx->db_mu);
  return collect_finish(out, &c, rc);
}

int kvt_index_lru(kvt_index_rows *out, kvt_index *idx, size_t limit) {
  if (!out || !idx)
    return KVT_ERR(KVT_EINVAL, "kvt_index_lru: NULL argument");
  return sql_rows(
      out, idx,
      "SELECT token_hash, tokens_blob, num_tokens, file_path, memory_bytes, "
      "created_at, accessed_at FROM entries ORDER BY accessed_at ASC LIMIT ?",
      limit > INT64_MAX ? INT64_MAX : (int64_t)limit);
}

int kvt_index_all(kvt_index_rows *out, kvt_index *idx) {
  if (!out || !idx)
    return KVT_ERR(KVT_EINVAL, "kvt_index_all: NULL argument");
  return sql_rows(
      out, idx,
      "SELECT token_hash, tokens_blob, num_tokens, file_path, memory_bytes, "
      "created_at, accessed_at FROM entries ORDER BY accessed_at DESC",
      -1);
}

int kvt_index_total_bytes(uint64_t *out, kvt_index *idx) {
  if (!out || !idx)
    return KVT_ERR(KVT_EINVAL, "kvt_index_total_bytes: NULL argument");
  kvti_index_totals(idx, NULL, NULL, out);
  return 0;
}

int kvt_index_count(uint64_t *out, kvt_index *idx) {
  if (!out || !idx)
    return KVT_ERR(KVT_EINVAL, "kvt_index_count: NULL argument");
  kvti_index_totals(idx, out, NULL, NULL);
  return 0;
}

int kvt_index_touch(kvt_index *idx, const int32_t *tokens, size_t n) {
  if (!idx)
    return KVT_ERR(KVT_EINVAL, "kvt_index_touch: NULL index");
  uint8_t sha[32];
  int rc = kvti_idx_tokens_sha(sha, tokens, n);
  if (rc == 0)
    rc = kvti_idx_touch_sha(idx, sha);
  return rc == KVT_ENOTFOUND ? 0 : rc; /* the reference's UPDATE is silent */
}
