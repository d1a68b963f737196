/*
 * writer.c - the spill path: kvt_tier_spill snapshots the caller's layers on
 * the caller's thread and enqueues them without blocking (bounded by
 * spill_queue_size entries and spill_queue_bytes bytes; a spill that does not
 * fit is dropped with KVT_EFULL, one that could never fit is refused with
 * KVT_ETOOBIG), and one writer thread drains the queue in FIFO order: backend
 * put (atomic, durable per the durability option), index row, stats, capacity
 * enforcement, the spill_done callback, and a periodic retention sweep. A
 * failed write leaves no entry and no row - and a failed replacement the
 * previous version and its row, exactly as they were - is counted in
 * write_failures, and the writer carries on with the next spill.
 *
 * The queue and the thread are a kvti_workq (base/workq.h) with one worker:
 * enq_seq counts spills accepted, done_seq spills finished (written, failed or
 * dropped, in the same FIFO order), so "everything enqueued before me is
 * done" is done_seq >= my enq_seq (flush, close).
 */
#include "tier/ramtier.h"
#include "tier/tier.h"
#include "tier/admission.h"
#include "tier/chunks.h"
#include "base/error.h"
#include "index/index.h"
#include "base/io.h"
#include "format/layer.h"
#include "tier/remote.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

/* Writes one spill (notify: then runs spill_done_fn). Runs on the writer
 * thread - or a write hook's caller, writer_hook.c - with nothing locked on
 * entry. Returns the write's result. */
/* How long the writer keeps retrying a spill whose index commit finds
 * index.db locked by another connection (SQLite's own busy timeout, which it
 * no longer waits for while holding mut_mu). */
#define WRITER_BUSY_BUDGET_S 5.0

/* One attempt at a spill, with mut_mu held. Order: stage the new version
 * (nobody sees it), publish it keeping the previous version, commit the index
 * row without waiting for another connection's lock, then drop the previous
 * version - or, when the commit failed, roll the publish back: the previous
 * version and its row are served exactly as before (the row never changed:
 * a failed index put changes neither SQLite nor the mirror). *busy is set
 * when the commit found index.db locked (worth a retry). A chunked tier
 * (chunks.h) takes the same steps for its tail entry and chained-entry
 * record (its chunks are immutable and written first). */
static int write_locked(kvt_tier *t, kvti_snapshot *s, const char *hash,
                        const kvti_write_opts *wo, uint64_t *disk, int *busy) {
  size_t n = 0;
  const int32_t *tokens = kvti_snapshot_tokens(s, &n);
  const kvti_backend_ops *ops = t->be->ops;
  *busy = 0;
  /* Readers must be excluded only when something is already stored under this
   * hash (a replace: a reader could otherwise mix files of two versions). A new
   * entry appears atomically by rename and its row only after that, and nobody
   * else can create either while we hold mut_mu, so readers of other entries in
   * the stripe need not wait for this write. Staging needs no lock at all: the
   * staged version is invisible. */
  kvt_entry_info old;
  int replacing = kvti_index_find_hash(&old, t->idx, hash) == 0 ||
                  ops->present(t->be, hash) != 0;
  if (!ops->put_stage) {
    if (replacing) {
      kvti_stripe_wrlock(&t->stripes, hash);
      kvti_ram_invalidate(t, hash); /* the RAM copy is the old version */
    }
    int rc = t->be->ops->put(t->be, disk, s, wo);
    if (rc == 0) {
      kvti_index_put_args a = {tokens,     n,
                               hash,       kvti_snapshot_memory_bytes(s),
                               *disk,      t->opts.storage_mode,
                               0,          kvti_snapshot_salt(s),
                               !t->chunked};
      rc = kvti_index_put_one(t->idx, &a, 1);
      if (rc != 0) {
        /* Published files without a row would be an entry nobody can see
         * and capacity does not count: remove them (and any row of a
         * replaced version) so no trace remains. */
        kvti_error_state es;
        kvti_error_state_capture(&es, rc);
        if (!replacing)
          kvti_stripe_wrlock(&t->stripes, hash);
        kvti_index_remove_hash(t->idx, hash);
        ops->remove(t->be, hash);
        if (!replacing)
          kvti_stripe_unlock(&t->stripes, hash);
        kvti_error_state_restore(&es);
      }
    }
    if (replacing)
      kvti_stripe_unlock(&t->stripes, hash);
    return rc;
  }
  /* A chunked tier (chunks.h) first writes the chunks the chain lacks - they
   * are immutable and never replaced, so nothing of an old version changes -
   * then stages its tail like any entry; the chained-entry record changes
   * only under the stripe's write lock and is put back if the row fails. */
  kvti_chunked_prep cp;
  int chunked = t->chunked != NULL;
  if (chunked) {
    /* A new entry's record commits with its chunk rows (no reader can
     * reach it before its row); a replacement's waits for the stripe. */
    int prc = kvti_tier_chunks_prepare(t, &cp, s, !replacing);
    if (prc != 0) {
      kvti_chunked_prep_free(&cp);
      return prc;
    }
  }
  const kvti_snapshot *ss = chunked ? kvti_chunked_prep_snapshot(&cp, s) : s;
  kvti_put_txn *x = NULL;
  int rc = ops->put_stage(t->be, &x, disk, ss, wo);
  if (rc != 0) {
    if (chunked) {
      if (cp.recorded) { /* nothing published: the record goes back */
        kvti_error_state es;
        kvti_error_state_capture(&es, rc);
        kvti_chunked_prep_undo(t->chunked, &cp);
        kvti_error_state_restore(&es);
      }
      kvti_chunked_prep_free(&cp);
    }
    return rc;
  }
  if (replacing)
    kvti_stripe_wrlock(&t->stripes, hash);
  int recorded = chunked && cp.recorded;
  rc = chunked ? kvti_chunked_prep_record(t->chunked, &cp) : 0;
  if (rc == 0) {
    recorded = chunked;
    rc = ops->put_publish(t->be, x);
  }
  if (rc == 0) {
    kvti_index_put_args a = {tokens,  n,
                             hash,    kvti_snapshot_memory_bytes(s),
                             *disk,   t->opts.storage_mode,
                             0,       kvti_snapshot_salt(s),
                             !chunked};
    rc = kvti_index_put_one(t->idx, &a, 0);
  }
  if (rc == 0) {
    ops->put_commit(t->be, x);
    if (chunked)
      kvti_tier_chunks_committed(t, &cp);
    if (replacing)
      kvti_ram_invalidate(t, hash); /* the RAM copy is the old version */
  } else {
    kvti_error_state es;
    kvti_error_state_capture(&es, rc);
    if (!replacing)
      kvti_stripe_wrlock(&t->stripes, hash);
    if (recorded)
      kvti_chunked_prep_undo(t->chunked, &cp);
    if (ops->put_rollback(t->be, x) != 0)
      kvti_log(t, KVT_LOG_WARN,
               "kvtier: undoing the publish of %.16s failed (%s); the new "
               "version stays in place",
               hash, kvt_last_error());
    if (!replacing)
      kvti_stripe_unlock(&t->stripes, hash);
    *busy = rc == KVT_EBUSY;
    kvti_error_state_restore(&es);
  }
  if (replacing)
    kvti_stripe_unlock(&t->stripes, hash);
  if (chunked)
    kvti_chunked_prep_free(&cp);
  return rc;
}

/* Writes one spill (notify: then runs spill_done_fn). Runs on the writer
 * thread - or a write hook's caller, writer_hook.c - with nothing locked on
 * entry. A busy index is waited for without mut_mu (so removals, quarantines
 * and reconciles are not held up by another process's lock) and the write is
 * retried, within WRITER_BUSY_BUDGET_S. Returns the write's result. */
int kvti_writer_write(kvt_tier *t, kvti_snapshot *s, int notify) {
  if (!kvti_remote_spills_local(t))
    return 0; /* remote only: the upload thread writes it and reports it */
  char hash[KVT_HASH_HEX_LEN + 1];
  memcpy(hash, kvti_snapshot_hash(s), sizeof hash);
  size_t n = 0;
  kvti_snapshot_tokens(s, &n);
  kvti_write_opts wo = {
      t->opts.storage_mode, t->opts.durability == KVT_DURABILITY_FSYNC,
      t->opts.file_mode, t->opts.dir_mode, t->opts.io_backend};
  uint64_t disk = 0;
  double t0 = kvti_now_mono();
  double deadline = t0 + WRITER_BUSY_BUDGET_S;
  int rc;
  pthread_mutex_lock(&t->mut_mu);
  for (;;) {
    int busy = 0;
    rc = write_locked(t, s, hash, &wo, &disk, &busy);
    double left = deadline - kvti_now_mono();
    if (!busy || left <= 0)
      break;
    pthread_mutex_unlock(&t->mut_mu);
    int w = kvti_index_wait_writable(t->idx, (int64_t)(left * 1000) + 1);
    pthread_mutex_lock(&t->mut_mu);
    if (w != 0) {
      rc = w;
      break;
    }
  }
  if (rc == 0) {
    kvti_stats_spilled(&t->stats, disk, kvti_now_mono() - t0);
    kvti_ram_spilled(t, s, disk); /* before capacity enforcement may evict */
    kvti_log(t, KVT_LOG_DEBUG,
             "kvtier: spilled %.16s: %zu tokens, %llu bytes on disk", hash, n,
             (unsigned long long)disk);
    kvti_tier_enforce_locked(t, t->opts.max_entries, t->max_bytes,
                             kvti_tier_cutoff(t), NULL, NULL);
  } else {
    KVTI_STAT_ADD(&t->stats, write_failures, 1);
    kvti_log(t, KVT_LOG_ERROR,
             "kvtier: failed to write entry %.16s (%zu tokens): %s", hash, n,
             kvt_last_error());
  }
  pthread_mutex_unlock(&t->mut_mu);
  kvti_stats_refresh_gauges(t); /* entries, bytes, queue: for the live file */
  if (notify && t->opts.spill_done_fn)
    t->opts.spill_done_fn(t->opts.spill_done_ctx, hash, rc);
  return rc;
}

/* Seconds between retention sweeps: a quarter of the retention, within [0.05 s,
 * 30 s]. */
static double sweep_interval(const kvt_tier *t) {
  double iv = (double)t->opts.retention_seconds / 4.0;
  if (iv < 0.05)
    iv = 0.05;
  if (iv > 30)
    iv = 30;
  return iv;
}

static void sweep(void *ctx) {
  kvt_tier *t = ctx;
  pthread_mutex_lock(&t->mut_mu);
  kvti_tier_enforce_locked(t, t->opts.max_entries, t->max_bytes,
                           kvti_tier_cutoff(t), NULL, NULL);
  pthread_mutex_unlock(&t->mut_mu);
}

/* ---- group commit ----------------------------------------------------
 * Spills waiting in the queue when the writer takes one are written as one
 * batch (at most WRITER_BATCH_MAX, distinct hashes, none replacing a stored
 * entry): each one's chunks, then its staged version (files and staging
 * directory synced) published by rename with the fsync of data/ deferred;
 * then ONE fsync of data/ makes every rename of the batch durable, then ONE
 * index transaction commits every row, and only then is each spill
 * acknowledged, in FIFO order. So an acknowledged spill is exactly as
 * durable as a single one, and a crash anywhere before the commit leaves
 * each spill of the batch published-without-row (adopted whole by the next
 * open's reconcile) or only staged (removed): never a row without its
 * files, never a partial entry. A replacement is written alone (it holds its
 * stripe across publish and commit, and batching several stripes could
 * deadlock readers). A spill whose batch step fails, or a batch whose sync
 * or commit fails (all publishes rolled back first), is written again
 * through the single path, which also waits out a busy index. */
#define WRITER_BATCH_MAX 16

typedef struct batch_ent {
  kvti_snapshot *s;
  char hash[KVT_HASH_HEX_LEN + 1];
  kvti_chunked_prep cp;
  int has_cp;   /* cp holds prepared state (prep_free pending) */
  int recorded; /* the chained-entry record was written */
  kvti_put_txn *x;
  uint64_t disk;
  double t0;
  int rc;     /* the spill's result */
  int single; /* to be written through the single path */
  int done;   /* rc is final */
} batch_ent;

/* Undoes a published (or staged) batch member: record, then files. mut_mu
 * held; takes its stripe for the rollback as the single path does. */
static void batch_undo(kvt_tier *t, batch_ent *b) {
  kvti_stripe_wrlock(&t->stripes, b->hash);
  if (b->recorded)
    kvti_chunked_prep_undo(t->chunked, &b->cp);
  if (b->x && t->be->ops->put_rollback(t->be, b->x) != 0)
    kvti_log(t, KVT_LOG_WARN,
             "kvtier: undoing the publish of %.16s failed (%s); the new "
             "version stays in place",
             b->hash, kvt_last_error());
  kvti_stripe_unlock(&t->stripes, b->hash);
  b->x = NULL;
  b->recorded = 0;
}

static void batch_free_prep(batch_ent *b) {
  if (b->has_cp)
    kvti_chunked_prep_free(&b->cp);
  b->has_cp = 0;
}

/* Writes the batch members b[i..n) up to (not including) the first that
 * replaces a stored entry, as described above. mut_mu held. Returns the
 * index of that member (n: none). Members end with done (rc final) or
 * single (to be written alone). */
static size_t batch_group_locked(kvt_tier *t, batch_ent *b, size_t i, size_t n,
                                 const kvti_write_opts *wo) {
  const kvti_backend_ops *ops = t->be->ops;
  size_t pub[WRITER_BATCH_MAX], np = 0, j;
  for (j = i; j < n; j++) {
    batch_ent *e = &b[j];
    kvt_entry_info old;
    if (kvti_index_find_hash(&old, t->idx, e->hash) == 0 ||
        ops->present(t->be, e->hash) != 0)
      break; /* a replacement: written alone, in its turn */
    e->t0 = kvti_now_mono();
    int rc = 0;
    if (t->chunked) {
      e->has_cp = 1;
      rc = kvti_tier_chunks_prepare(t, &e->cp, e->s, 1); /* all new */
      e->recorded = rc == 0 && e->cp.recorded;
    }
    const kvti_snapshot *ss =
        t->chunked ? kvti_chunked_prep_snapshot(&e->cp, e->s) : e->s;
    if (rc == 0)
      rc = ops->put_stage(t->be, &e->x, &e->disk, ss, wo);
    if (rc == 0 && t->chunked) {
      rc = kvti_chunked_prep_record(t->chunked, &e->cp);
      e->recorded = e->recorded || (rc == 0 && e->cp.chained);
    }
    if (rc == 0)
      rc = ops->put_publish(t->be, e->x);
    if (rc != 0) {
      kvti_error_state es;
      kvti_error_state_capture(&es, rc);
      batch_undo(t, e);
      batch_free_prep(e);
      kvti_error_state_restore(&es);
      /* A busy index is waited for by the single path; any other failure
       * is this spill's own (the single path would meet it again). */
      e->single = rc == KVT_EBUSY;
      e->done = !e->single;
      e->rc = rc;
      if (e->done) {
        KVTI_STAT_ADD(&t->stats, write_failures, 1);
        size_t nt = 0;
        kvti_snapshot_tokens(e->s, &nt);
        kvti_log(t, KVT_LOG_ERROR,
                 "kvtier: failed to write entry %.16s (%zu tokens): %s",
                 e->hash, nt, kvt_last_error());
      }
      continue;
    }
    pub[np++] = j;
  }
  if (np == 0)
    return j;
  /* Every rename of the batch durable at once, then every row at once. */
  int rc = wo->defer_dir_sync ? ops->put_sync(t->be) : 0;
  if (rc == 0) {
    kvti_index_put_args a[WRITER_BATCH_MAX];
    for (size_t k = 0; k < np; k++) {
      batch_ent *e = &b[pub[k]];
      size_t nt = 0;
      const int32_t *tokens = kvti_snapshot_tokens(e->s, &nt);
      kvti_index_put_args x = {tokens,     nt,
                               e->hash,    kvti_snapshot_memory_bytes(e->s),
                               e->disk,    t->opts.storage_mode,
                               0,          kvti_snapshot_salt(e->s),
                               !t->chunked};
      a[k] = x;
    }
    rc = kvti_index_put_batch(t->idx, a, np, 0);
  }
  if (rc != 0) {
    kvti_error_state es;
    kvti_error_state_capture(&es, rc);
    for (size_t k = np; k-- > 0;) {
      batch_ent *e = &b[pub[k]];
      batch_undo(t, e);
      batch_free_prep(e);
      e->single = 1; /* each gets its own try (and its own error) */
    }
    kvti_log(t, KVT_LOG_DEBUG,
             "kvtier: group commit of %zu spills failed (%s); writing them "
             "one by one",
             np, es.msg);
    kvti_error_state_restore(&es);
    return j;
  }
  if (np > 1) {
    KVTI_STAT_ADD(&t->stats, spill_batches, 1);
    KVTI_STAT_ADD(&t->stats, spills_batched, np);
  }
  for (size_t k = 0; k < np; k++) {
    batch_ent *e = &b[pub[k]];
    ops->put_commit(t->be, e->x);
    e->x = NULL;
    if (t->chunked)
      kvti_tier_chunks_committed(t, &e->cp);
    batch_free_prep(e);
    e->rc = 0;
    e->done = 1;
    size_t nt = 0;
    kvti_snapshot_tokens(e->s, &nt);
    kvti_stats_spilled(&t->stats, e->disk, kvti_now_mono() - e->t0);
    kvti_ram_spilled(t, e->s, e->disk); /* before enforcement may evict */
    kvti_log(t, KVT_LOG_DEBUG,
             "kvtier: spilled %.16s: %zu tokens, %llu bytes on disk "
             "(group of %zu)",
             e->hash, nt, (unsigned long long)e->disk, np);
  }
  kvti_tier_enforce_locked(t, t->opts.max_entries, t->max_bytes,
                           kvti_tier_cutoff(t), NULL, NULL);
  return j;
}

/* Writes n >= 2 spills taken off the queue together, then acknowledges each
 * (spill_done_fn) in FIFO order. */
static void write_batch(kvt_tier *t, kvti_snapshot **snaps, size_t n) {
  batch_ent b[WRITER_BATCH_MAX];
  memset(b, 0, sizeof b);
  for (size_t k = 0; k < n; k++) {
    b[k].s = snaps[k];
    memcpy(b[k].hash, kvti_snapshot_hash(snaps[k]), sizeof b[k].hash);
  }
  kvti_write_opts wo = {
      t->opts.storage_mode, t->opts.durability == KVT_DURABILITY_FSYNC,
      t->opts.file_mode,    t->opts.dir_mode,
      t->opts.io_backend,   0};
  wo.defer_dir_sync = wo.do_fsync && t->be->ops->put_sync != NULL;
  size_t i = 0;
  while (i < n) {
    pthread_mutex_lock(&t->mut_mu);
    size_t j = batch_group_locked(t, b, i, n, &wo);
    pthread_mutex_unlock(&t->mut_mu);
    for (size_t k = i; k < j; k++)
      if (b[k].single)
        b[k].rc = kvti_writer_write(t, b[k].s, 0);
    if (j < n) /* the replacement that ended the group */
      b[j].rc = kvti_writer_write(t, b[j].s, 0);
    i = j + 1;
  }
  kvti_stats_refresh_gauges(t); /* entries, bytes, queue: for the live file */
  for (size_t k = 0; k < n; k++)
    if (t->opts.spill_done_fn)
      t->opts.spill_done_fn(t->opts.spill_done_ctx, b[k].hash, b[k].rc);
}

/* What the writer may take along with the spill it runs: spills (not
 * close's stop marker) whose hashes differ from every one taken. */
typedef struct take_ctx {
  const char *hashes[WRITER_BATCH_MAX];
  size_t n;
} take_ctx;

static int take_want(void *ctx, const kvti_workq_item *qi) {
  take_ctx *c = ctx;
  const kvti_spill_item *it = (const kvti_spill_item *)qi;
  if (!it->snap || c->n >= WRITER_BATCH_MAX)
    return 0;
  const char *h = kvti_snapshot_hash(it->snap);
  for (size_t k = 0; k < c->n; k++)
    if (strcmp(c->hashes[k], h) == 0)
      return 0;
  c->hashes[c->n++] = h;
  return 1;
}

/* 1 when the spills queued behind the one being run may be batched with it:
 * they are written here (no write hook hands them out one by one) and
 * locally, through a backend that writes in steps. */
static int batchable(kvt_tier *t) {
  if (!t->be->ops->put_stage || !kvti_remote_spills_local(t))
    return 0;
  pthread_mutex_lock(&t->hook.mu);
  int hooked = t->hook.fn != NULL;
  pthread_mutex_unlock(&t->hook.mu);
  return !hooked;
}

/* Hands a written snapshot on (the remote upload queue may take it and free
 * it later) or frees it (a no-copy spill's release runs on this thread). */
static void spill_release(kvt_tier *t, kvti_snapshot *s) {
  if (!kvti_remote_take(t, s))
    kvti_snapshot_free(s);
}

/* The writer thread's work on one spill taken off the queue, and on those
 * waiting behind it that it takes along (group commit). */
static void run_spill(void *ctx, kvti_workq_item *qi) {
  kvt_tier *t = ctx;
  kvti_spill_item *it = (kvti_spill_item *)qi;
  if (!it->snap) { /* close's stop marker: every spill before it is done */
    kvti_free(it);
    return;
  }
  kvti_workq_item *more[WRITER_BATCH_MAX - 1];
  size_t nmore = 0;
  if (batchable(t)) {
    take_ctx tc;
    tc.hashes[0] = kvti_snapshot_hash(it->snap);
    tc.n = 1;
    nmore =
        kvti_workq_take_more(&t->w, more, WRITER_BATCH_MAX - 1, take_want, &tc);
  }
  if (nmore == 0) {
    kvti_writer_run_hooked(t, it->snap);
    spill_release(t, it->snap);
    kvti_free(it);
    return;
  }
  kvti_snapshot *snaps[WRITER_BATCH_MAX];
  snaps[0] = it->snap;
  for (size_t k = 0; k < nmore; k++)
    snaps[k + 1] = ((kvti_spill_item *)more[k])->snap;
  write_batch(t, snaps, nmore + 1);
  spill_release(t, it->snap);
  kvti_free(it);
  for (size_t k = 0; k < nmore; k++) {
    spill_release(t, ((kvti_spill_item *)more[k])->snap);
    kvti_free(more[k]);
  }
}

/* A spill dropped unwritten (the tier is closing): its release callback runs
 * with KVT_ECLOSED. */
static void drop_spill(void *ctx, kvti_workq_item *qi) {
  kvt_tier *t = ctx;
  kvti_spill_item *it = (kvti_spill_item *)qi;
  if (!it->snap) { /* close's stop marker: not a spill */
    kvti_free(it);
    return;
  }
  if (t->opts.spill_done_fn)
    t->opts.spill_done_fn(t->opts.spill_done_ctx, kvti_snapshot_hash(it->snap),
                          KVT_ECLOSED);
  kvti_snapshot_free(it->snap);
  kvti_free(it);
}

int kvti_writer_init(kvt_tier *t) {
  int rc = kvti_writer_hook_init(t);
  if (rc != 0)
    return rc;
  kvti_workq_cfg c;
  memset(&c, 0, sizeof c);
  c.threads = 1; /* one writer: FIFO order, done_seq in enqueue order */
  c.max_items = t->opts.spill_queue_size;
  c.max_bytes = t->opts.spill_queue_bytes;
  c.run = run_spill;
  c.drop = drop_spill;
  if (t->opts.retention_seconds > 0) { /* the periodic retention sweep */
    c.tick = sweep;
    c.tick_interval = sweep_interval(t);
  }
  c.ctx = t;
  c.name = "writer";
  return kvti_workq_init(&t->w, &c);
}

void kvti_writer_destroy(kvt_tier *t) {
  kvti_workq_destroy(&t->w);
  kvti_writer_hook_destroy(t);
}

int kvt_tier_start_writer(kvt_tier *t) {
  if (!t)
    return KVT_ERR(KVT_EINVAL, "tier is NULL");
  int rc = kvti_tier_enter(t);
  if (rc != 0)
    return rc;
  if (t->readonly) {
    kvti_tier_leave(t);
    return KVT_ERR(KVT_EINVAL, "cannot start the writer of a read-only tier");
  }
  rc = kvti_workq_start(&t->w);
  if (rc == 0)
    kvti_log(t, KVT_LOG_INFO, "kvtier: writer thread started");
  kvti_tier_leave(t);
  return rc;
}

int kvti_writer_drain(kvt_tier *t, int64_t timeout_ms) {
  struct timespec ts;
  int has;
  kvti_deadline(&ts, &has, timeout_ms);
  uint64_t pending = 0;
  if (kvti_workq_wait(&t->w, &ts, has, &pending) == KVT_ETIMEDOUT)
    return KVT_ERR(KVT_ETIMEDOUT,
                   "spill queue not drained within %lld ms (%llu spills "
                   "pending)",
                   (long long)timeout_ms, (unsigned long long)pending);
  return 0;
}

void kvti_writer_stop(kvt_tier *t, int drop) {
  kvti_workq_stop(&t->w, drop);
}

/* The most tensors a layer of this kind can have (0: unknown kind). */
static uint32_t kind_max_tensors(int kind) {
  switch (kind) {
  case KVT_LAYER_KV:
  case KVT_LAYER_ROTATING_KV:
    return 2;
  case KVT_LAYER_QUANTIZED_KV:
    return 6;
  case KVT_LAYER_ARRAYS:
    return KVTI_MAX_ARRAYS;
  default:
    return 0;
  }
}

/* Sum of the tensor bytes the caller passed (cheap, before any copy). Malformed
 * layers are left to kvti_snapshot_create to report - and not read here: a
 * num_tensors its kind cannot have may exceed the caller's array, so such a
 * layer's tensors are never touched before the refusal. */
static uint64_t layers_bytes(const kvt_layer *layers, uint32_t n_layers) {
  uint64_t sum = 0;
  for (uint32_t i = 0; layers && i < n_layers; i++) {
    if (!layers[i].tensors ||
        layers[i].num_tensors > kind_max_tensors(layers[i].kind))
      continue;
    for (uint32_t j = 0; j < layers[i].num_tensors; j++) {
      uint64_t b = layers[i].tensors[j].nbytes;
      sum = sum + b < sum ? UINT64_MAX : sum + b;
    }
  }
  return sum;
}

static int spill_try(kvt_tier *t, const int32_t *tokens, size_t n_tokens,
                     const kvt_layer *layers, uint32_t n_layers,
                     uint64_t memory_bytes, int copy, void (*release)(void *),
                     void *release_ctx, const kvt_call_opts *co) {
  int rc;
  kvti_salt salt;
  if (!t) {
    rc = KVT_ERR(KVT_EINVAL, "tier is NULL");
    goto early_fail;
  }
  if ((rc = kvti_call_salt(&salt, t, co)) != 0)
    goto early_fail;
  if (!tokens && n_tokens > 0) {
    rc = KVT_ERR(KVT_EINVAL, "tokens is NULL with n_tokens > 0");
    goto early_fail;
  }
  if (!layers && n_layers > 0) {
    rc = KVT_ERR(KVT_EINVAL, "layers is NULL with n_layers > 0");
    goto early_fail;
  }
  if ((rc = kvti_tier_enter(t)) != 0)
    goto early_fail;
  if (t->readonly) {
    rc = KVT_ERR(KVT_EINVAL, "cannot spill into a read-only tier");
    kvti_tier_leave(t);
    goto early_fail;
  }
  /* Cheap refusals before copying anything. */
  uint64_t raw = layers_bytes(layers, n_layers);
  uint64_t qb = t->opts.spill_queue_bytes;
  if (qb && raw > qb) {
    KVTI_STAT_ADD(&t->stats, spill_rejects, 1);
    rc = KVT_ERR(KVT_ETOOBIG,
                 "spill of %llu bytes is larger than spill_queue_bytes (%llu)",
                 (unsigned long long)raw, (unsigned long long)qb);
    kvti_tier_leave(t);
    goto early_fail;
  }
  int chk = kvti_workq_check(&t->w, raw);
  if (chk == KVT_ECLOSED) {
    rc = KVT_ERR(KVT_ECLOSED, "the tier is closing; spill refused");
    kvti_tier_leave(t);
    goto early_fail;
  }
  if (chk == KVT_EFULL) {
    KVTI_STAT_ADD(&t->stats, spill_drops, 1);
    rc = KVT_ERR(KVT_EFULL,
                 "spill queue full (%u entries, %llu bytes max); "
                 "entry dropped",
                 t->opts.spill_queue_size, (unsigned long long)qb);
    kvti_tier_leave(t);
    goto early_fail;
  }

  kvti_snapshot *s = NULL;
  rc = kvti_snapshot_create(&s, tokens, n_tokens, layers, n_layers,
                            memory_bytes, copy, release, release_ctx);
  /* Validated: now the rows rule (token i is KV row i; not in
   * snapshot_create, which also builds a chained entry's tail). */
  for (uint32_t i = 0; rc == 0 && i < n_layers; i++)
    if ((rc = kvti_layer_check_rows(&layers[i], i, 0, UINT64_MAX, KVT_EINVAL,
                                    "spill")) != 0) {
      kvti_snapshot_free(s); /* runs release for a no-copy spill */
      s = NULL;
    }
  if (rc == 0 && (rc = kvti_snapshot_set_salt(s, &salt)) != 0) {
    kvti_snapshot_free(s);
    s = NULL;
  }
  /* A native quantized layer is promoted dense by the drop-in: its entry
   * reports that size (compat keeps the reference's figure). */
  if (rc == 0 && t->opts.storage_mode == KVT_STORAGE_NATIVE)
    kvti_snapshot_report_dense(s);
  if (rc != 0) {
    /* snapshot_create ran release already. */
    if (rc == KVT_EINVAL)
      KVTI_STAT_ADD(&t->stats, spill_rejects, 1);
    kvti_tier_leave(t);
    return rc;
  }
  uint64_t cost = copy ? kvti_snapshot_held_bytes(s) : raw;
  uint64_t disk = kvti_snapshot_disk_bytes(s, t->opts.storage_mode);
  if ((qb && cost > qb) || disk > t->max_bytes) {
    KVTI_STAT_ADD(&t->stats, spill_rejects, 1);
    if (disk > t->max_bytes)
      rc = KVT_ERR(KVT_ETOOBIG,
                   "entry needs %llu bytes on disk, more than the capacity "
                   "max_size_gb (%llu bytes)",
                   (unsigned long long)disk, (unsigned long long)t->max_bytes);
    else
      rc = KVT_ERR(KVT_ETOOBIG,
                   "spill of %llu bytes is larger than spill_queue_bytes "
                   "(%llu)",
                   (unsigned long long)cost, (unsigned long long)qb);
    goto fail;
  }
  kvti_spill_item *it = kvti_calloc(1, sizeof *it);
  if (!it) {
    rc = KVT_ERR_NOMEM();
    goto fail;
  }
  it->snap = s;
  rc = kvti_workq_push(&t->w, &it->link, cost);
  if (rc == KVT_ECLOSED) {
    KVT_ERR(KVT_ECLOSED, "the tier is closing; spill refused");
  } else if (rc == KVT_EFULL) {
    KVTI_STAT_ADD(&t->stats, spill_drops, 1);
    KVT_ERR(KVT_EFULL,
            "spill queue full (%u entries, %llu bytes max); "
            "entry dropped",
            t->opts.spill_queue_size, (unsigned long long)qb);
  }
  if (rc != 0) {
    kvti_free(it);
    goto fail;
  }
  kvti_tier_leave(t);
  return 0;
fail:
  kvti_snapshot_free(s); /* runs release for a no-copy spill */
  kvti_tier_leave(t);
  return rc;
early_fail:
  if (!copy && release)
    release(release_ctx);
  return rc;
}

/* Every refusal is counted by its reason (kvt_stats version 3), whichever
 * check made it: the engine may ignore the return code, the stats may not. */
int kvti_spill_enqueue(kvt_tier *t, const int32_t *tokens, size_t n_tokens,
                       const kvt_layer *layers, uint32_t n_layers,
                       uint64_t memory_bytes, int copy, void (*release)(void *),
                       void *release_ctx, const kvt_call_opts *co) {
  int rc = spill_try(t, tokens, n_tokens, layers, n_layers, memory_bytes, copy,
                     release, release_ctx, co);
  if (rc != 0 && t)
    kvti_stats_refused(&t->stats, rc);
  if (rc == 0) /* this model's layout, for the layout guard */
    kvti_tier_layout_note(t, layers, n_layers);
  return rc;
}

/* Every public spill passes the admission decision first (admission.h). */
static int spill_common(kvt_tier *t, const int32_t *tokens, size_t n_tokens,
                        const kvt_layer *layers, uint32_t n_layers,
                        uint64_t memory_bytes, int copy,
                        void (*release)(void *), void *release_ctx,
                        const kvt_call_opts *co) {
  return kvti_admit_spill(t, tokens, n_tokens, layers, n_layers, memory_bytes,
                          copy, release, release_ctx, co);
}

int kvt_tier_spill(kvt_tier *t, const int32_t *tokens, size_t n_tokens,
                   const kvt_layer *layers, uint32_t n_layers,
                   uint64_t memory_bytes) {
  return spill_common(t, tokens, n_tokens, layers, n_layers, memory_bytes, 1,
                      NULL, NULL, NULL);
}

int kvt_tier_spill_ex(kvt_tier *t, const int32_t *tokens, size_t n_tokens,
                      const kvt_layer *layers, uint32_t n_layers,
                      uint64_t memory_bytes, const kvt_call_opts *co) {
  return spill_common(t, tokens, n_tokens, layers, n_layers, memory_bytes, 1,
                      NULL, NULL, co);
}

int kvt_tier_spill_nocopy_ex(kvt_tier *t, const int32_t *tokens,
                             size_t n_tokens, const kvt_layer *layers,
                             uint32_t n_layers, uint64_t memory_bytes,
                             void (*release)(void *ctx), void *release_ctx,
                             const kvt_call_opts *co) {
  return spill_common(t, tokens, n_tokens, layers, n_layers, memory_bytes, 0,
                      release, release_ctx, co);
}

int kvt_tier_spill_nocopy(kvt_tier *t, const int32_t *tokens, size_t n_tokens,
                          const kvt_layer *layers, uint32_t n_layers,
                          uint64_t memory_bytes, void (*release)(void *ctx),
                          void *release_ctx) {
  return spill_common(t, tokens, n_tokens, layers, n_layers, memory_bytes, 0,
                      release, release_ctx, NULL);
}

int kvt_tier_flush(kvt_tier *t, int64_t timeout_ms) {
  if (!t)
    return KVT_ERR(KVT_EINVAL, "tier is NULL");
  int rc = kvti_tier_enter(t);
  if (rc != 0)
    return rc;
  struct timespec ts;
  int has;
  kvti_deadline(&ts, &has, timeout_ms);
  uint64_t pending = 0;
  rc = kvti_workq_wait(&t->w, &ts, has, &pending);
  if (rc == KVT_ETIMEDOUT)
    rc = KVT_ERR(KVT_ETIMEDOUT,
                 "flush: %llu spills still pending after "
                 "%lld ms",
                 (unsigned long long)pending, (long long)timeout_ms);
  else if (pending > 0)
    rc = KVT_ERR(KVT_EINVAL,
                 "flush: %llu spills queued but the writer is "
                 "not started (kvt_tier_start_writer)",
                 (unsigned long long)pending);
  if (rc == 0)
    rc = kvti_remote_drain(t, &ts, has); /* uploads of those spills too */
  if (rc == 0)
    rc = kvti_ram_drain(t, &ts, has); /* freed entries' RAM admission */
  kvti_tier_leave(t);
  return rc;
}
