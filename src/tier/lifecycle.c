/*
 * lifecycle.c - the tier's lifecycle: open (option validation, the local
 * store - which owns the directory layout, its checks and the one-writer lock
 * - stale tmp removal, index, remote, reconcile), close/free (stop accepting,
 * drain with a timeout, join the writer, wait for promotes, close the index).
 * It sits above every other tier file: it starts and stops them all, and none
 * calls back into it.
 */
#include "tier/ramtier.h"
#include "tier/tier.h"
#include "tier/admission.h"
#include "tier/chunks.h"
#include "base/error.h"
#include "base/io.h"
#include "engine/iobatch.h"
#include "index/index.h"
#include "tier/options.h"
#include "tier/remote.h"
#include "store/local.h"
#include "store/local_layout.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ------------------------------------------------------------------------ */
/* Open                                                                     */
/* ------------------------------------------------------------------------ */

static void tier_destroy(kvt_tier *t) {
  if (!t)
    return;
  kvti_remote_free(t);
  kvti_ram_free(t);
  if (t->admit) {
    kvti_admit_destroy(t->admit);
    kvti_free(t->admit);
  }
  kvti_pool_destroy(t);
  kvti_writer_destroy(t);
  kvti_tier_chunks_close(t); /* before the index it shares */
  if (t->idx)
    kvt_index_close(t->idx);
  if (t->be)
    t->be->ops->destroy(t->be); /* releases kvtier.lock */
  kvti_stats_detach(&t->stats);
  kvti_stripes_destroy(&t->stripes);
  kvti_stats_destroy(&t->stats);
  pthread_mutex_destroy(&t->mut_mu);
  pthread_mutex_destroy(&t->life_mu);
  pthread_cond_destroy(&t->life_cv);
  pthread_mutex_destroy(&t->close_mu);
  kvti_free(t->dir);
  kvti_free(t);
}

/* The index's measuring callback (kvti_index_measure) over the store. */
static int measure_entry(void *ctx, const char *hash, uint64_t *bytes) {
  kvti_backend *be = ctx;
  return kvti_backend_local_measure(be, hash, bytes);
}

int kvt_tier_open(kvt_tier **out, const kvt_options *user_opts) {
  if (!out)
    return KVT_ERR(KVT_EINVAL, "kvt_tier_open: out is NULL");
  int rc = kvt_options_validate(user_opts);
  if (rc != 0)
    return rc;
  /* From here on a current-version copy (a caller built against an older
   * header has fewer fields: the rest are defaults). */
  kvt_options cur = KVT_OPTIONS_INIT; /* set by upgrade */
  kvti_options_upgrade(&cur, user_opts);
  const kvt_options *opts = &cur;
#if !KVT_HAVE_URING
  if (opts->io_backend == KVT_IO_URING)
    return KVT_ERR(KVT_EUNSUPPORTED, "io_backend KVT_IO_URING: this build has "
                                     "no io_uring support (use AUTO or "
                                     "PORTABLE)");
#endif
  if (opts->io_backend == KVT_IO_URING) {
    /* Built with io_uring, but it may still be unusable here (seccomp, an old
     * kernel, io_uring_disabled): refuse now rather than fail every spill and
     * promote. */
    kvti_iobatch *probe = NULL;
    rc = kvti_iobatch_get(&probe, KVT_IO_URING);
    if (rc != 0)
      return rc;
    kvti_iobatch_put(probe);
  }
  kvt_tier *t = kvti_calloc(1, sizeof *t);
  if (!t)
    return KVT_ERR_NOMEM();
  t->opts = *opts;
  t->readonly = (opts->flags & KVT_OPEN_READONLY) != 0;
  t->max_bytes = kvti_options_max_bytes(opts);
  pthread_mutex_init(&t->mut_mu, NULL);
  pthread_mutex_init(&t->life_mu, NULL);
  pthread_mutex_init(&t->close_mu, NULL);
  kvti_stats_init(&t->stats);
  atomic_init(&t->state, KVTI_OPEN);
  atomic_init(&t->active, 0);
  for (int i = 0; i < KVTI_LAYOUTS; i++)
    atomic_init(&t->layouts[i], 0);
  atomic_init(&t->layout_full, 0);
  if ((rc = kvti_cond_init(&t->life_cv)) != 0) {
    pthread_cond_init(&t->life_cv, NULL); /* so destroy is valid */
    goto fail;
  }
  if ((rc = kvti_stripes_init(&t->stripes)) != 0)
    goto fail;
  if ((rc = kvti_writer_init(t)) != 0)
    goto fail;
  if ((rc = kvti_pool_init(t)) != 0)
    goto fail;
  if ((rc = kvti_ram_open(t)) != 0)
    goto fail;
  if (!t->readonly) { /* admission and the write budget (admission.h) */
    t->admit = kvti_calloc(1, sizeof *t->admit);
    if (!t->admit) {
      rc = KVT_ERR_NOMEM();
      goto fail;
    }
    if ((rc = kvti_admit_init(t->admit, opts)) != 0) {
      kvti_free(t->admit);
      t->admit = NULL;
      goto fail;
    }
  }

  char *resolved = NULL;
  if ((rc = kvti_options_resolve_dir(&resolved, opts)) != 0)
    goto fail;
  t->dir = kvti_local_absolute_dir(resolved);
  kvti_free(resolved);
  if (!t->dir) {
    rc = KVT_ENOMEM;
    goto fail;
  }
  t->opts.cache_dir = t->dir;
  kvti_local_cfg lc = {t->dir, opts->dir_mode, opts->file_mode, t->readonly,
                       (opts->flags & KVT_OPEN_SKIP_OWNER_CHECK) != 0};
  if ((rc = kvti_backend_local_open(&t->be, &lc)) != 0)
    goto fail;
  /* The live stats file (statsfile.h): the lock holder owns it (the backend
   * took kvtier.lock). Without it the tier works; only `kvtier stats` from
   * outside sees nothing. */
  if (!t->readonly &&
      kvti_stats_attach(&t->stats, t->dir, opts->file_mode) != 0) {
    kvti_log(t, KVT_LOG_WARN, "kvtier: no live stats file: %s",
             kvt_last_error());
    kvt_clear_error();
  }
  /* Before any purge of temporaries: a crash inside the portable replace can
   * leave an entry's only complete copy at <hash>.old.tmp. */
  if (!t->readonly) {
    uint64_t back = 0;
    rc = kvti_backend_local_recover(
        t->be, opts->durability == KVT_DURABILITY_FSYNC, &back);
    if (rc != 0)
      goto fail;
    if (back > 0)
      kvti_log(t, KVT_LOG_WARN,
               "kvtier: restored %llu entries left aside by an interrupted "
               "replace",
               (unsigned long long)back);
  }
  if (!t->readonly && (opts->flags & KVT_OPEN_NO_RECONCILE)) {
    /* (reconcile below removes them too, in the same directory walk) */
    int64_t n = kvti_tier_purge_tmps(t);
    if (n < 0) {
      rc = (int)n;
      goto fail;
    }
  }
  kvti_index_measure measure = {measure_entry, t->be};
  int rebuilt = 0;
  /* Without index.db (deleted, or a new directory) the chain table is
   * rebuilt from the chunk files too (chunkstore_rebuild.c). */
  int had_index = kvti_local_index_present(t->dir);
  if ((rc = kvti_tier_open_index(t, &measure, &rebuilt)) != 0) /* recover.c */
    goto fail;
  /* FSYNC durability covers the row too: the WAL is synced at each commit, so
   * an acknowledged entry cannot lose its row (and then its files, to
   * reconcile) in a power loss. */
  if (!t->readonly && opts->durability == KVT_DURABILITY_FSYNC &&
      (rc = kvti_index_set_durable(t->idx, 1)) != 0)
    goto fail;
  if ((rc = kvti_tier_ns_init(t)) != 0) /* model_id's namespace (salt.c) */
    goto fail;
  if ((rc = kvti_tier_chunks_open(t)) != 0) /* chunk_tokens (chunks.h) */
    goto fail;
  if ((rebuilt || !had_index) && (rc = kvti_tier_chunks_rebuild(t)) != 0)
    goto fail;
  if ((rc = kvti_remote_open(t)) != 0)
    goto fail;
  /* A new index is filled by reconcile's adoption, asked for or not. */
  if (!t->readonly && (!(opts->flags & KVT_OPEN_NO_RECONCILE) || rebuilt)) {
    int64_t n = kvti_tier_reconcile_locked(t);
    if (n < 0) {
      rc = (int)n;
      goto fail;
    }
  }
  kvti_log(t, KVT_LOG_INFO, "kvtier: opened %s%s", t->dir,
           t->readonly ? " (read-only)" : "");
  *out = t;
  return 0;
fail:;
  kvti_error_state es;
  kvti_error_state_capture(&es, rc);
  tier_destroy(t);
  return kvti_error_state_restore(&es);
}

/* ------------------------------------------------------------------------ */
/* Close and free                                                           */
/* ------------------------------------------------------------------------ */

static int tier_close(kvt_tier *t, int64_t timeout_ms, int drop) {
  pthread_mutex_lock(&t->close_mu);
  int state = atomic_load(&t->state);
  if (state == KVTI_CLOSED) {
    pthread_mutex_unlock(&t->close_mu);
    return 0;
  }
  /* 1. Stop accepting spills. */
  kvti_workq_close(&t->w);
  uint64_t depth = 0;
  kvti_workq_gauges(&t->w, &depth, NULL);
  int need_start = !drop && depth > 0 && !kvti_workq_started(&t->w);
  /* 2. Drain: queued spills are written (starting the writer if nobody did). */
  if (need_start) {
    int r = kvt_tier_start_writer(t);
    if (r != 0) {
      pthread_mutex_unlock(&t->close_mu);
      return r;
    }
  }
  if (!drop) {
    int r = kvti_writer_drain(t, timeout_ms);
    if (r != 0) {
      kvti_log(t, KVT_LOG_WARN,
               "kvtier: close timed out with spills still queued; the tier "
               "stays open for reads, call close again");
      pthread_mutex_unlock(&t->close_mu);
      return r;
    }
  }
  /* 3. Join the writer (free drops what has not started), then let the remote
   * uploads finish within the same timeout (they are best effort: what is
   * left after it is dropped). */
  kvti_writer_stop(t, drop);
  if (!drop) {
    struct timespec rts;
    int rhas;
    kvti_deadline(&rts, &rhas, timeout_ms);
    if (kvti_remote_drain(t, &rts, rhas) != 0)
      kvti_log(t, KVT_LOG_WARN, "kvtier: close: %s; dropped", kvt_last_error());
  }
  kvti_remote_stop(t, 1);
  /* 4. Refuse new calls and wait for those in flight, including async promotes.
   */
  atomic_store(&t->state, KVTI_TEARDOWN);
  pthread_mutex_lock(&t->life_mu);
  while (atomic_load(&t->active) > 0) {
    struct timespec ts;
    int has;
    kvti_deadline(&ts, &has, 5); /* re-check: see kvti_tier_leave */
    kvti_cond_wait_until(&t->life_cv, &t->life_mu, &ts, has);
  }
  pthread_mutex_unlock(&t->life_mu);
  kvti_pool_stop(t);
  kvti_ram_close(t); /* the host RAM cache's memory goes now */
  /* 5. Flush batched touches, close the index, release the directory lock. */
  kvti_tier_chunks_close(t); /* before the index it shares */
  if (t->idx) {
    int damaged = kvti_index_damaged(t->idx);
    if (!t->readonly && !damaged)
      kvti_index_flush(t->idx);
    kvt_index_close(t->idx);
    t->idx = NULL;
    /* Damage SQLite reported after open (or quick_check found): the file is
     * kept aside and the next open rebuilds it from the entry directories,
     * while the directory lock is still ours. */
    if (damaged && !t->readonly) {
      if (kvti_tier_index_set_aside(t, "corrupt") == 0)
        kvti_log(t, KVT_LOG_WARN,
                 "kvtier: %s/index.db was found damaged while open: set aside "
                 "as index.db.corrupt-<time>; the next open rebuilds it",
                 t->dir);
      else
        kvt_clear_error();
    }
  }
  kvti_stats_detach(&t->stats); /* before another writer may take over */
  kvti_backend_local_unlock(t->be);
  atomic_store(&t->state, KVTI_CLOSED);
  kvti_log(t, KVT_LOG_INFO, "kvtier: closed %s", t->dir);
  pthread_mutex_unlock(&t->close_mu);
  return 0;
}

int kvt_tier_close(kvt_tier *t, int64_t timeout_ms) {
  if (!t)
    return KVT_ERR(KVT_EINVAL, "tier is NULL");
  return tier_close(t, timeout_ms, 0);
}

int kvt_tier_close_queued(kvt_tier *t, int64_t timeout_ms) {
  if (!t)
    return KVT_ERR(KVT_EINVAL, "tier is NULL");
  struct timespec ts = {0};
  int has;
  kvti_deadline(&ts, &has, timeout_ms);
  int rc = kvti_writer_queue_marker(t, &ts, has);
  if (rc != 0)
    return rc;
  int64_t left = -1; /* the rest of the same deadline */
  if (has) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    left = (int64_t)(ts.tv_sec - now.tv_sec) * 1000 +
           (ts.tv_nsec - now.tv_nsec) / 1000000;
    if (left < 0)
      left = 0;
  }
  return tier_close(t, left, 0);
}

void kvt_tier_free(kvt_tier *t) {
  if (!t)
    return;
  tier_close(t, -1, 1);
  tier_destroy(t);
}
