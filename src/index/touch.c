/*
 * touch.c - touch batching. A touch updates accessed_at in the mirror at once
 * and queues the time; the queue is written to SQLite in one transaction when
 * due (256 touches or after 1 s; written by the writer's next put, by a
 * toucher that finds SQLite free, by kvti_index_flush or at close) with
 * "accessed_at = max(old, new)" so a late batch never rewinds an entry
 * re-inserted meanwhile. Past 16 batches a toucher waits for SQLite, so the
 * queue stays bounded. Also the index's clock, which every recency stamp
 * reads.
 */
#include "index/internal.h"

#include "base/clock.h"
#include "base/error.h"
#include "base/io.h"
#include "base/vec.h"

#include <pthread.h>
#include <sqlite3.h>
#include <stdlib.h>
#include <string.h>

/* ---- touches ---- */

static int touch_cmp(const void *a, const void *b) {
  return memcmp(((const touch_rec *)a)->sha, ((const touch_rec *)b)->sha, 32);
}

/* Writes the pending touches in one transaction. Caller holds db_mu. */
int kvti_idx_flush_locked(kvt_index *idx) {
  pthread_mutex_lock(&idx->pend_mu);
  touch_rec *batch = idx->pend;
  size_t n = idx->pend_n;
  idx->pend = NULL;
  idx->pend_n = idx->pend_cap = 0;
  pthread_mutex_unlock(&idx->pend_mu);
  int rc = 0;
  if (n > 1) { /* one UPDATE per entry (SQLite rewrites the whole row, blob
                  included) */
    qsort(batch, n, sizeof *batch, touch_cmp);
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
      if (m && memcmp(batch[m - 1].sha, batch[i].sha, 32) == 0) {
        if (batch[i].t > batch[m - 1].t)
          batch[m - 1].t = batch[i].t;
      } else {
        batch[m++] = batch[i];
      }
    }
    n = m;
  }
  if (n && !idx->readonly) {
    rc = kvti_idx_step(idx, ST_BEGIN, "begin");
    for (size_t i = 0; !rc && i < n; i++) {
      char th[65];
      kvti_idx_hex(th, batch[i].sha);
      sqlite3_stmt *s = idx->st[ST_TOUCH];
      sqlite3_bind_double(s, 1, batch[i].t);
      sqlite3_bind_text(s, 2, th, 64, SQLITE_TRANSIENT);
      sqlite3_bind_double(s, 3, batch[i].t);
      rc = kvti_idx_step(idx, ST_TOUCH, "touch");
    }
    if (!rc)
      rc = kvti_idx_step(idx, ST_COMMIT, "commit");
    if (rc)
      kvti_idx_rollback(idx);
  }
  kvti_free(batch);
  return rc;
}

int kvti_index_flush(kvt_index *idx) {
  if (!idx)
    return KVT_ERR(KVT_EINVAL, "kvti_index_flush: NULL index");
  pthread_mutex_lock(&idx->db_mu);
  int rc = kvti_idx_flush_locked(idx);
  pthread_mutex_unlock(&idx->db_mu);
  return rc;
}

/* True when the pending touches are due (a full batch, or the oldest waited
 * TOUCH_MAX_AGE). */
int kvti_idx_touches_due(kvt_index *idx, double t) {
  pthread_mutex_lock(&idx->pend_mu);
  int due = idx->pend_n >= TOUCH_BATCH ||
            (idx->pend_n > 0 && t - idx->pend_first >= TOUCH_MAX_AGE);
  pthread_mutex_unlock(&idx->pend_mu);
  return due;
}

void kvti_index_set_clock(kvt_index *idx, double (*fn)(void *), void *ctx) {
  idx->now_fn = fn;
  idx->now_ctx = ctx;
}

double kvti_index_now(const kvt_index *idx) {
  return idx && idx->now_fn ? idx->now_fn(idx->now_ctx) : kvti_now_wall();
}

int kvti_idx_touch_sha(kvt_index *idx, const uint8_t sha[32]) {
  double t = kvti_index_now(idx);
  pthread_rwlock_wrlock(&idx->rw);
  uint32_t id;
  if (!kvti_idx_mirror_find(idx, sha, &id)) {
    pthread_rwlock_unlock(&idx->rw);
    char th[65];
    kvti_idx_hex(th, sha);
    return KVT_ERR(KVT_ENOTFOUND, "index: no entry %s", th);
  }
  mirror_ent *e = &idx->ents[id];
  if (t > e->accessed_at) {
    e->accessed_at = t;
    kvti_idx_heap_fix(idx, H_LRU, e->heap_pos[H_LRU]);
  } else {
    t = e->accessed_at;
  }
  pthread_mutex_lock(&idx->pend_mu);
  int rc = 0, need_flush = 0, must_flush = 0;
  rc = KVTI_VEC_RESERVE(&idx->pend, &idx->pend_cap, idx->pend_n + 1, 64);
  if (!rc) {
    if (idx->pend_n == 0)
      idx->pend_first = t;
    memcpy(idx->pend[idx->pend_n].sha, sha, 32);
    idx->pend[idx->pend_n].t = t;
    idx->pend_n++;
    need_flush =
        idx->pend_n >= TOUCH_BATCH || t - idx->pend_first >= TOUCH_MAX_AGE;
    must_flush = idx->pend_n >= 16 * TOUCH_BATCH;
  }
  pthread_mutex_unlock(&idx->pend_mu);
  pthread_rwlock_unlock(&idx->rw);
  /* A touching (lookup) thread writes the batch only when SQLite is free;
   * otherwise the writer thread's next put/remove (or a later touch) does it.
   * Past 16 batches it waits, so the pending list stays bounded. */
  if (must_flush) {
    rc = kvti_index_flush(idx);
  } else if (need_flush && pthread_mutex_trylock(&idx->db_mu) == 0) {
    rc = kvti_idx_flush_locked(idx);
    pthread_mutex_unlock(&idx->db_mu);
  }
  return rc;
}

int kvti_index_touch_hash(kvt_index *idx, const char *hash) {
  uint8_t sha[32];
  if (!idx || kvti_idx_unhex(sha, hash) != 0)
    return KVT_ERR(KVT_EINVAL, "kvti_index_touch_hash: bad argument");
  return kvti_idx_touch_sha(idx, sha);
}
