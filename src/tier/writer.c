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
 * Sequence numbers: enq_seq counts spills accepted, done_seq spills finished
 * (in the same FIFO order), so "everything enqueued before me is done" is
 * done_seq >= my enq_seq (flush, close).
 */
#include "tier/tier.h"
#include "base/error.h"
#include "index/index.h"
#include "base/io.h"
#include "format/layer.h"
#include "tier/remote.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

int kvti_writer_init(kvt_tier *t) {
  kvti_writer *w = &t->w;
  pthread_mutex_init(&w->mu, NULL);
  int rc = kvti_cond_init(&w->cv_work);
  if (rc == 0)
    rc = kvti_cond_init(&w->cv_done);
  w->accepting = 1;
  return rc;
}

void kvti_writer_destroy(kvt_tier *t) {
  kvti_writer *w = &t->w;
  kvti_spill_item *it = w->head;
  while (it) {
    kvti_spill_item *next = it->next;
    kvti_snapshot_free(it->snap);
    kvti_free(it);
    it = next;
  }
  w->head = w->tail = NULL;
  pthread_mutex_destroy(&w->mu);
  pthread_cond_destroy(&w->cv_work);
  pthread_cond_destroy(&w->cv_done);
}

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
 * when the commit found index.db locked (worth a retry). */
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
  kvti_put_txn *x = NULL;
  int rc = ops->stage(t->be, &x, disk, s, wo);
  if (rc != 0)
    return rc;
  if (replacing)
    kvti_stripe_wrlock(&t->stripes, hash);
  rc = ops->publish(t->be, x);
  if (rc == 0)
    rc = kvti_index_put_nowait(t->idx, tokens, n, hash,
                               kvti_snapshot_memory_bytes(s), *disk,
                               t->opts.storage_mode);
  if (rc == 0) {
    ops->commit(t->be, x);
  } else {
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", kvt_last_error());
    if (!replacing)
      kvti_stripe_wrlock(&t->stripes, hash);
    if (ops->rollback(t->be, x) != 0)
      kvti_log(t, KVT_LOG_WARN,
               "kvtier: undoing the publish of %.16s failed (%s); the new "
               "version stays in place",
               hash, kvt_last_error());
    if (!replacing)
      kvti_stripe_unlock(&t->stripes, hash);
    *busy = rc == KVT_EBUSY;
    KVT_ERR(rc, "%s", msg);
  }
  if (replacing)
    kvti_stripe_unlock(&t->stripes, hash);
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
  double deadline = kvti_now_mono() + WRITER_BUSY_BUDGET_S;
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
    KVTI_STAT_ADD(&t->stats, spill_count, 1);
    KVTI_STAT_ADD(&t->stats, spill_bytes, disk);
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

static void sweep(kvt_tier *t) {
  pthread_mutex_lock(&t->mut_mu);
  kvti_tier_enforce_locked(t, t->opts.max_entries, t->max_bytes,
                           kvti_tier_cutoff(t), NULL, NULL);
  pthread_mutex_unlock(&t->mut_mu);
}

/* Drops a spill taken off the queue, unwritten (the tier is closing): counts
 * it done and runs its release callback with KVT_ECLOSED. Called and returns
 * with w->mu held; the callback runs without it. */
static void drop_item(kvt_tier *t, kvti_spill_item *it) {
  kvti_writer *w = &t->w;
  w->depth--;
  w->bytes -= it->cost;
  if (!it->snap) { /* the stop marker (writer_hook.c): not a spill */
    kvti_free(it);
    return;
  }
  w->done_seq++;
  pthread_mutex_unlock(&w->mu);
  if (t->opts.spill_done_fn)
    t->opts.spill_done_fn(t->opts.spill_done_ctx, kvti_snapshot_hash(it->snap),
                          KVT_ECLOSED);
  kvti_snapshot_free(it->snap);
  kvti_free(it);
  pthread_mutex_lock(&w->mu);
}

static void *writer_main(void *arg) {
  kvt_tier *t = arg;
  kvti_writer *w = &t->w;
  int retention = t->opts.retention_seconds > 0;
  double next_sweep = kvti_now_mono() + sweep_interval(t);
  pthread_mutex_lock(&w->mu);
  for (;;) {
    if (w->drop) {
      /* kvt_tier_free: spills not yet started are dropped (their release
       * callbacks run). */
      while (w->head) {
        kvti_spill_item *it = w->head;
        w->head = it->next;
        drop_item(t, it);
      }
      w->tail = NULL;
      pthread_cond_broadcast(&w->cv_done);
    }
    if (!w->head) {
      if (w->stop)
        break;
      if (retention) {
        double now = kvti_now_mono();
        if (now >= next_sweep) {
          pthread_mutex_unlock(&w->mu);
          sweep(t);
          pthread_mutex_lock(&w->mu);
          next_sweep = kvti_now_mono() + sweep_interval(t);
          continue;
        }
        struct timespec ts;
        int has;
        kvti_deadline(&ts, &has, (int64_t)((next_sweep - now) * 1000) + 1);
        kvti_cond_wait_until(&w->cv_work, &w->mu, &ts, has);
      } else {
        pthread_cond_wait(&w->cv_work, &w->mu);
      }
      continue;
    }
    kvti_spill_item *it = w->head;
    w->head = it->next;
    if (!w->head)
      w->tail = NULL;
    w->depth--;
    w->bytes -= it->cost;
    pthread_cond_broadcast(&w->cv_done); /* a slot is free (close's marker) */
    if (!it->snap) { /* the stop marker: every spill before it is done */
      kvti_free(it);
      w->stop = 1;
      continue;
    }
    kvt_write_hook_fn hook = w->hook;
    void *hook_ctx = w->hook_ctx;
    uint64_t id = w->done_seq + 1;
    pthread_mutex_unlock(&w->mu);

    if (hook)
      kvti_writer_hooked(t, it->snap, hook, hook_ctx, id);
    else
      kvti_writer_write(t, it->snap, 1);
    /* The remote upload queue may take the snapshot (and free it later). */
    if (!kvti_remote_take(t, it->snap))
      kvti_snapshot_free(
          it->snap); /* runs a no-copy spill's release on this thread */
    kvti_free(it);

    pthread_mutex_lock(&w->mu);
    w->done_seq++;
    pthread_cond_broadcast(&w->cv_done);
    if (retention && kvti_now_mono() >= next_sweep) {
      pthread_mutex_unlock(&w->mu);
      sweep(t);
      pthread_mutex_lock(&w->mu);
      next_sweep = kvti_now_mono() + sweep_interval(t);
    }
  }
  pthread_cond_broadcast(&w->cv_done);
  pthread_mutex_unlock(&w->mu);
  return NULL;
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
  kvti_writer *w = &t->w;
  pthread_mutex_lock(&w->mu);
  if (!w->started && !w->stop) {
    int e = pthread_create(&w->thread, NULL, writer_main, t);
    if (e != 0)
      rc = KVT_ERR_OS(e, "creating the writer thread");
    else
      w->started = 1;
  }
  pthread_mutex_unlock(&w->mu);
  if (rc == 0)
    kvti_log(t, KVT_LOG_INFO, "kvtier: writer thread started");
  kvti_tier_leave(t);
  return rc;
}

int kvti_writer_drain(kvt_tier *t, int64_t timeout_ms) {
  kvti_writer *w = &t->w;
  struct timespec ts;
  int has;
  kvti_deadline(&ts, &has, timeout_ms);
  int rc = 0;
  pthread_mutex_lock(&w->mu);
  while (w->done_seq < w->enq_seq && w->started) {
    if (kvti_cond_wait_until(&w->cv_done, &w->mu, &ts, has) == ETIMEDOUT &&
        w->done_seq < w->enq_seq) {
      rc = KVT_ERR(KVT_ETIMEDOUT,
                   "spill queue not drained within %lld ms (%llu spills "
                   "pending)",
                   (long long)timeout_ms,
                   (unsigned long long)(w->enq_seq - w->done_seq));
      break;
    }
  }
  pthread_mutex_unlock(&w->mu);
  return rc;
}

void kvti_writer_stop(kvt_tier *t, int drop) {
  kvti_writer *w = &t->w;
  pthread_mutex_lock(&w->mu);
  w->accepting = 0;
  w->stop = 1;
  if (drop)
    w->drop = 1;
  int started = w->started;
  pthread_cond_broadcast(&w->cv_work);
  pthread_mutex_unlock(&w->mu);
  if (started) {
    pthread_join(w->thread, NULL);
    pthread_mutex_lock(&w->mu);
    w->started = 0;
    pthread_mutex_unlock(&w->mu);
  }
  /* Never started (or dropped): whatever is still queued is released here. */
  pthread_mutex_lock(&w->mu);
  kvti_spill_item *it = w->head;
  w->head = w->tail = NULL;
  while (it) {
    kvti_spill_item *next = it->next;
    drop_item(t, it);
    it = next;
  }
  pthread_cond_broadcast(&w->cv_done);
  pthread_mutex_unlock(&w->mu);
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

static int queue_fits(const kvt_tier *t, uint64_t cost) {
  const kvti_writer *w = &t->w;
  if (w->depth >= t->opts.spill_queue_size)
    return 0;
  uint64_t qb = t->opts.spill_queue_bytes;
  return qb == 0 || (w->bytes + cost >= w->bytes && w->bytes + cost <= qb);
}

static int spill_common(kvt_tier *t, const int32_t *tokens, size_t n_tokens,
                        const kvt_layer *layers, uint32_t n_layers,
                        uint64_t memory_bytes, int copy,
                        void (*release)(void *), void *release_ctx) {
  int rc;
  if (!t) {
    rc = KVT_ERR(KVT_EINVAL, "tier is NULL");
    goto early_fail;
  }
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
  kvti_writer *w = &t->w;
  pthread_mutex_lock(&w->mu);
  int accepting = w->accepting, fits = queue_fits(t, raw);
  pthread_mutex_unlock(&w->mu);
  if (!accepting) {
    rc = KVT_ERR(KVT_ECLOSED, "the tier is closing; spill refused");
    kvti_tier_leave(t);
    goto early_fail;
  }
  if (!fits) {
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
  it->cost = cost;
  pthread_mutex_lock(&w->mu);
  if (!w->accepting) {
    rc = KVT_ERR(KVT_ECLOSED, "the tier is closing; spill refused");
  } else if (!queue_fits(t, cost)) {
    KVTI_STAT_ADD(&t->stats, spill_drops, 1);
    rc = KVT_ERR(KVT_EFULL,
                 "spill queue full (%u entries, %llu bytes max); "
                 "entry dropped",
                 t->opts.spill_queue_size, (unsigned long long)qb);
  } else {
    if (w->tail)
      w->tail->next = it;
    else
      w->head = it;
    w->tail = it;
    w->depth++;
    w->bytes += cost;
    w->enq_seq++;
    pthread_cond_signal(&w->cv_work);
  }
  pthread_mutex_unlock(&w->mu);
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

int kvt_tier_spill(kvt_tier *t, const int32_t *tokens, size_t n_tokens,
                   const kvt_layer *layers, uint32_t n_layers,
                   uint64_t memory_bytes) {
  return spill_common(t, tokens, n_tokens, layers, n_layers, memory_bytes, 1,
                      NULL, NULL);
}

int kvt_tier_spill_nocopy(kvt_tier *t, const int32_t *tokens, size_t n_tokens,
                          const kvt_layer *layers, uint32_t n_layers,
                          uint64_t memory_bytes, void (*release)(void *ctx),
                          void *release_ctx) {
  return spill_common(t, tokens, n_tokens, layers, n_layers, memory_bytes, 0,
                      release, release_ctx);
}

int kvt_tier_flush(kvt_tier *t, int64_t timeout_ms) {
  if (!t)
    return KVT_ERR(KVT_EINVAL, "tier is NULL");
  int rc = kvti_tier_enter(t);
  if (rc != 0)
    return rc;
  kvti_writer *w = &t->w;
  struct timespec ts;
  int has;
  kvti_deadline(&ts, &has, timeout_ms);
  pthread_mutex_lock(&w->mu);
  uint64_t target = w->enq_seq;
  while (w->done_seq < target) {
    if (!w->started) {
      rc = KVT_ERR(KVT_EINVAL,
                   "flush: %llu spills queued but the writer is "
                   "not started (kvt_tier_start_writer)",
                   (unsigned long long)(target - w->done_seq));
      break;
    }
    if (kvti_cond_wait_until(&w->cv_done, &w->mu, &ts, has) == ETIMEDOUT &&
        w->done_seq < target) {
      rc = KVT_ERR(KVT_ETIMEDOUT,
                   "flush: %llu spills still pending after "
                   "%lld ms",
                   (unsigned long long)(target - w->done_seq),
                   (long long)timeout_ms);
      break;
    }
  }
  pthread_mutex_unlock(&w->mu);
  if (rc == 0)
    rc = kvti_remote_drain(t, &ts, has); /* uploads of those spills too */
  kvti_tier_leave(t);
  return rc;
}
