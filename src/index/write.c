/*
 * write.c - the index's writes: puts (one or several in one SQLite
 * transaction, all or none) and removes. Each write validates and hashes
 * outside any lock, runs its SQL under db_mu, and only after the commit
 * applies the change to the mirror under rw, so a failed write leaves both
 * SQLite and the mirror as they were. A put also writes the pending touches
 * when they are due (the writer thread is the usual flusher).
 */
#include "index/internal.h"

#include "base/clock.h"
#include "base/error.h"
#include "base/io.h"

#include <pthread.h>
#include <sqlite3.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

/* ---- writes ---- */

/* Validates one put and builds its mirror record (hashes computed outside any
 * lock). */
static int put_prepare(mirror_ent *e, const kvti_index_put_args *a) {
  int rc = kvti_idx_check_tokens(a->tokens, a->n);
  if (rc)
    return rc;
  if (a->memory_bytes > INT64_MAX || a->disk_bytes > INT64_MAX)
    return KVT_ERR(KVT_EINVAL, "index: byte count out of range");
  if (a->storage_mode != KVT_STORAGE_NATIVE &&
      a->storage_mode != KVT_STORAGE_COMPAT)
    return KVT_ERR(KVT_EINVAL, "index: bad storage_mode %d", a->storage_mode);
  if ((rc = kvti_idx_make_ent(e, a->tokens, a->n, 1)) != 0)
    return rc;
  if (a->salt && a->salt->has &&
      ((rc = kvti_salt_sha(e->sha, a->salt, a->tokens, a->n * 4)) != 0 ||
       (rc = kvti_salt_sha(e->psha, a->salt, a->tokens,
                           (a->n < KVT_PREFIX_FILTER_TOKENS
                                ? a->n
                                : KVT_PREFIX_FILTER_TOKENS) *
                               4)) != 0))
    return rc;
  char th[65];
  kvti_idx_hex(th, e->sha);
  if (a->hash && strcmp(a->hash, th) != 0)
    return KVT_ERR(KVT_EINVAL, "index: hash %.64s is not the tokens' hash %s",
                   a->hash, th);
  e->memory_bytes = a->memory_bytes;
  e->disk_bytes = a->disk_bytes;
  e->storage_mode = a->storage_mode;
  return 0;
}

/* Deletes the chained-entry row of key sha inside the open transaction. A
 * directory no chunked tier ever used has no such table: nothing to do. */
static int drop_chained_sql(kvt_index *idx, const uint8_t sha[32]) {
  sqlite3_stmt *d = NULL;
  int rc = sqlite3_prepare_v2(
      idx->db, "DELETE FROM kvtier_chained_entries WHERE token_hash = ?", -1,
      &d, NULL);
  if (rc != SQLITE_OK) {
    sqlite3_finalize(d);
    /* "no such table" is the only expected failure; anything else shows up
     * in the insert that follows in the same transaction. */
    return 0;
  }
  sqlite3_bind_blob(d, 1, sha, 32, SQLITE_STATIC);
  rc = sqlite3_step(d);
  int out =
      rc == SQLITE_DONE ? 0 : kvti_idx_db_err(idx, rc, "delete chained row");
  sqlite3_finalize(d);
  return out;
}

/* The SQL of one put inside the open transaction: INSERT OR REPLACE as the
 * reference; with_meta writes kvtier_meta too, otherwise removes it (a
 * reference-style row: disk bytes get measured at the next open). */
static int put_sql(kvt_index *idx, const mirror_ent *e,
                   const kvti_index_put_args *a, int with_meta) {
  char th[65], ph[65];
  kvti_idx_hex(th, e->sha);
  kvti_idx_hex(ph, e->psha);
  sqlite3_stmt *s = idx->st[ST_INSERT];
  sqlite3_bind_text(s, 1, th, 64, SQLITE_STATIC);
  sqlite3_bind_blob(s, 2, a->n ? (const void *)a->tokens : "", (int)(a->n * 4),
                    SQLITE_STATIC);
  sqlite3_bind_text(s, 3, ph, 64, SQLITE_STATIC);
  sqlite3_bind_int64(s, 4, (sqlite3_int64)a->n);
  sqlite3_bind_text(s, 5, th, 64, SQLITE_STATIC);
  sqlite3_bind_int64(s, 6, (sqlite3_int64)e->memory_bytes);
  sqlite3_bind_double(s, 7, e->created_at);
  sqlite3_bind_double(s, 8, e->accessed_at);
  int rc = kvti_idx_step(idx, ST_INSERT, "insert");
  if (!rc && a->drop_chained)
    rc = drop_chained_sql(idx, e->sha);
  if (!rc && with_meta) {
    s = idx->st[ST_META_PUT];
    sqlite3_bind_text(s, 1, th, 64, SQLITE_STATIC);
    sqlite3_bind_int64(s, 2, (sqlite3_int64)e->disk_bytes);
    sqlite3_bind_int64(s, 3, e->storage_mode);
    rc = kvti_idx_step(idx, ST_META_PUT, "insert kvtier_meta");
  } else if (!rc) {
    sqlite3_bind_text(idx->st[ST_META_DEL], 1, th, 64, SQLITE_STATIC);
    rc = kvti_idx_step(idx, ST_META_DEL, "delete kvtier_meta");
  }
  return rc;
}

/* Applies a committed put to the mirror. Caller holds rw (write). */
static int put_mirror(kvt_index *idx, const mirror_ent *e) {
  uint32_t id;
  if (kvti_idx_mirror_find(idx, e->sha, &id)) {
    mirror_ent *o = &idx->ents[id];
    idx->sum_disk += e->disk_bytes - o->disk_bytes;
    idx->sum_mem += e->memory_bytes - o->memory_bytes;
    o->memory_bytes = e->memory_bytes;
    o->disk_bytes = e->disk_bytes;
    o->storage_mode = e->storage_mode;
    o->created_at = e->created_at;
    o->accessed_at = e->accessed_at;
    kvti_idx_heap_fix(idx, H_LRU, o->heap_pos[H_LRU]);
    kvti_idx_heap_fix(idx, H_CREATED, o->heap_pos[H_CREATED]);
    return 0;
  }
  int rc = kvti_idx_mirror_reserve(idx);
  if (!rc)
    kvti_idx_mirror_add(idx, e);
  return rc;
}

/* count puts in one SQLite transaction (all or none), then the mirror. */
int kvti_idx_put_common(kvt_index *idx, const kvti_index_put_args *a,
                        size_t count, int with_meta, int wait) {
  if (idx->readonly)
    return KVT_ERR(KVT_EPERM, "index: opened read-only");
  if (count == 0)
    return 0;
  mirror_ent one, *e = &one;
  if (count > 1) {
    if (count > SIZE_MAX / sizeof *e || !(e = kvti_malloc(count * sizeof *e)))
      return KVT_ERR_NOMEM();
  }
  int rc = 0;
  double now = kvti_index_now(idx);
  for (size_t i = 0; !rc && i < count; i++) {
    rc = put_prepare(&e[i], &a[i]);
    /* Rows of one batch keep their queue order in time (a microsecond
     * apart): with one shared instant, the LRU and retention order among
     * them - which of a group commit is evicted first - would be a tie. */
    e[i].created_at = e[i].accessed_at =
        a[i].created_at > 0 ? a[i].created_at : now + (double)i * 1e-6;
  }
  if (rc)
    goto out;
  pthread_mutex_lock(&idx->db_mu);
  if (!wait)
    sqlite3_busy_timeout(idx->db, 0);
  rc = kvti_idx_step(idx, ST_BEGIN, "begin");
  for (size_t i = 0; !rc && i < count; i++)
    rc = put_sql(idx, &e[i], &a[i], with_meta);
  if (!rc)
    rc = kvti_idx_step(idx, ST_COMMIT, "commit");
  if (!wait)
    sqlite3_busy_timeout(idx->db, BUSY_TIMEOUT_MS);
  if (rc) {
    kvti_idx_rollback(idx);
    pthread_mutex_unlock(&idx->db_mu);
    goto out;
  }
  pthread_rwlock_wrlock(&idx->rw);
  /* On ENOMEM here SQLite has the rows but the mirror lacks some: they are
   * served after reopen. */
  for (size_t i = 0; i < count; i++) {
    int r = put_mirror(idx, &e[i]);
    if (r && !rc)
      rc = r;
  }
  pthread_rwlock_unlock(&idx->rw);
  if (kvti_idx_touches_due(idx, now))
    kvti_idx_flush_locked(
        idx); /* a failure here loses only accessed_at updates */
  pthread_mutex_unlock(&idx->db_mu);
out:
  if (e != &one)
    kvti_free(e);
  return rc;
}

int kvti_index_put(kvt_index *idx, const int32_t *tokens, size_t n,
                   const char *hash, uint64_t memory_bytes, uint64_t disk_bytes,
                   int storage_mode) {
  if (!idx)
    return KVT_ERR(KVT_EINVAL, "kvti_index_put: NULL index");
  kvti_index_put_args a = {tokens,       n, hash, memory_bytes, disk_bytes,
                           storage_mode, 0, NULL};
  return kvti_idx_put_common(idx, &a, 1, 1, 1);
}

int kvti_index_put_nowait(kvt_index *idx, const int32_t *tokens, size_t n,
                          const char *hash, uint64_t memory_bytes,
                          uint64_t disk_bytes, int storage_mode) {
  if (!idx)
    return KVT_ERR(KVT_EINVAL, "kvti_index_put: NULL index");
  kvti_index_put_args a = {tokens,       n, hash, memory_bytes, disk_bytes,
                           storage_mode, 0, NULL};
  return kvti_idx_put_common(idx, &a, 1, 1, 0);
}

int kvti_index_put_one(kvt_index *idx, const kvti_index_put_args *a, int wait) {
  if (!idx || !a)
    return KVT_ERR(KVT_EINVAL, "kvti_index_put: NULL argument");
  return kvti_idx_put_common(idx, a, 1, 1, wait);
}

int kvti_index_put_batch(kvt_index *idx, const kvti_index_put_args *a,
                         size_t count, int wait) {
  if (!idx || (!a && count))
    return KVT_ERR(KVT_EINVAL, "kvti_index_put_batch: NULL argument");
  return kvti_idx_put_common(idx, a, count, 1, wait);
}

/* Polls rather than relying on SQLite's busy handler, which a WAL-mode BEGIN
 * IMMEDIATE does not always invoke. */
int kvti_index_wait_writable(kvt_index *idx, int64_t timeout_ms) {
  if (!idx)
    return KVT_ERR(KVT_EINVAL, "kvti_index_wait_writable: NULL index");
  if (idx->readonly)
    return KVT_ERR(KVT_EPERM, "index: opened read-only");
  struct timespec t0, now;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (;;) {
    pthread_mutex_lock(&idx->db_mu);
    sqlite3_busy_timeout(idx->db, 0);
    int rc = kvti_idx_step(idx, ST_BEGIN, "begin");
    kvti_idx_rollback(idx);
    sqlite3_busy_timeout(idx->db, BUSY_TIMEOUT_MS);
    pthread_mutex_unlock(&idx->db_mu);
    if (rc != KVT_EBUSY)
      return rc;
    clock_gettime(CLOCK_MONOTONIC, &now);
    int64_t el = (int64_t)(now.tv_sec - t0.tv_sec) * 1000 +
                 (now.tv_nsec - t0.tv_nsec) / 1000000;
    if (el >= timeout_ms)
      return rc;
    struct timespec ts = {0, 20 * 1000 * 1000};
    nanosleep(&ts, NULL);
  }
}

int kvti_index_put_many(kvt_index *idx, const kvti_index_put_args *puts,
                        size_t count) {
  if (!idx || (!puts && count))
    return KVT_ERR(KVT_EINVAL, "kvti_index_put_many: NULL argument");
  return kvti_idx_put_common(idx, puts, count, 1, 1);
}

int kvti_idx_remove_sha(kvt_index *idx, const uint8_t sha[32]) {
  if (idx->readonly)
    return KVT_ERR(KVT_EPERM, "index: opened read-only");
  char th[65];
  kvti_idx_hex(th, sha);
  pthread_mutex_lock(&idx->db_mu);
  int rc = kvti_idx_step(idx, ST_BEGIN, "begin");
  int changed = 0;
  if (!rc) {
    sqlite3_bind_text(idx->st[ST_DELETE], 1, th, 64, SQLITE_STATIC);
    rc = kvti_idx_step(idx, ST_DELETE, "delete");
    changed = sqlite3_changes(idx->db);
  }
  if (!rc) {
    sqlite3_bind_text(idx->st[ST_META_DEL], 1, th, 64, SQLITE_STATIC);
    rc = kvti_idx_step(idx, ST_META_DEL, "delete kvtier_meta");
  }
  if (!rc)
    rc = kvti_idx_step(idx, ST_COMMIT, "commit");
  if (rc) {
    kvti_idx_rollback(idx);
    pthread_mutex_unlock(&idx->db_mu);
    return rc;
  }
  pthread_rwlock_wrlock(&idx->rw);
  uint32_t id;
  int found = kvti_idx_mirror_find(idx, sha, &id);
  if (found)
    kvti_idx_mirror_del(idx, id);
  pthread_rwlock_unlock(&idx->rw);
  pthread_mutex_unlock(&idx->db_mu);
  if (!found && !changed)
    return KVT_ERR(KVT_ENOTFOUND, "index: no entry %s", th);
  return 0;
}

int kvti_index_forget_hash(kvt_index *idx, const char *hash) {
  uint8_t sha[32];
  if (!idx || kvti_idx_unhex(sha, hash) != 0)
    return KVT_ERR(KVT_EINVAL, "kvti_index_forget_hash: bad argument");
  pthread_rwlock_wrlock(&idx->rw);
  uint32_t id;
  int found = kvti_idx_mirror_find(idx, sha, &id);
  if (found)
    kvti_idx_mirror_del(idx, id);
  pthread_rwlock_unlock(&idx->rw);
  return found ? 0 : KVT_ERR(KVT_ENOTFOUND, "index: no entry %.64s", hash);
}

int kvti_index_remove_hash(kvt_index *idx, const char *hash) {
  uint8_t sha[32];
  if (!idx || kvti_idx_unhex(sha, hash) != 0)
    return KVT_ERR(KVT_EINVAL, "kvti_index_remove_hash: bad argument");
  return kvti_idx_remove_sha(idx, sha);
}
