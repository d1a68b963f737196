/*
 * writer.c - the spill queue and its thread: kvti_spill_enqueue checks a spill,
 * snapshots the caller's layers on the caller's thread (or holds them, for a
 * no-copy spill) and enqueues them without blocking (bounded by
 * spill_queue_size entries and spill_queue_bytes bytes; a spill that does not
 * fit is dropped with KVT_EFULL, one that could never fit is refused with
 * KVT_ETOOBIG); one writer thread drains the queue in FIFO order, taking the
 * spills waiting behind the one it runs along as a group, and hands them to
 * commit.c (or a binding's write hook), then runs a periodic retention sweep.
 * Also kvt_tier_flush and close's stop marker.
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

/* What the writer may take along with the spill it runs: spills (not
 * close's stop marker) whose hashes differ from every one taken. */
typedef struct take_ctx {
  const char *hashes[KVTI_WRITER_BATCH_MAX];
  size_t n;
} take_ctx;

static int take_want(void *ctx, const kvti_workq_item *qi) {
  take_ctx *c = ctx;
  const kvti_spill_item *it = (const kvti_spill_item *)qi;
  if (!it->snap || c->n >= KVTI_WRITER_BATCH_MAX)
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
 * locally (the local store writes in steps). */
static int batchable(kvt_tier *t) {
  if (!kvti_remote_spills_local(t))
    return 0;
  pthread_mutex_lock(&t->hook.mu);
  int hooked = t->hook.fn != NULL;
  pthread_mutex_unlock(&t->hook.mu);
  return !hooked;
}

/* Hands a written snapshot on (the remote upload queue may take it and free
 * it later) or frees it (a no-copy spill's release runs on this thread), and
 * gives its write-budget reservation back once its bytes are counted: here
 * when it was written locally, after the upload when the upload is the
 * write (remote only: nothing is counted yet). */
static void spill_release(kvt_tier *t, kvti_snapshot *s, uint64_t reserved) {
  if (kvti_remote_spills_local(t)) {
    kvti_admit_release(t, reserved);
    reserved = 0;
  }
  if (!kvti_remote_take(t, s, reserved))
    kvti_snapshot_free(s);
}

/* A spill that is not written: spill_done_fn hears status, its reservation
 * goes back, it is freed (a no-copy spill's release runs here). */
static void spill_gone(kvt_tier *t, kvti_spill_item *it, int status) {
  if (t->opts.spill_done_fn)
    t->opts.spill_done_fn(t->opts.spill_done_ctx, kvti_snapshot_hash(it->snap),
                          status);
  kvti_admit_release(t, it->reserved);
  kvti_snapshot_free(it->snap);
  kvti_free(it);
}

/* A spill let in under the write budget whose bound has grown since (chunks
 * it counted as stored were evicted by the spills written before it) beyond
 * the bucket's room is not written: counted as declined for the budget (it
 * was also counted admitted), reported to spill_done_fn with KVT_EBUDGET, its
 * reservation given back. Returns 1 when it was so dropped (it is freed). */
static int budget_refused(kvt_tier *t, kvti_spill_item *it) {
  if (kvti_admit_recheck(t, &it->reserved, it->snap))
    return 0;
  size_t n;
  (void)kvti_snapshot_tokens(it->snap, &n);
  KVTI_STAT_ADD(&t->stats, admission_declined_budget, 1);
  KVTI_STAT_ADD(&t->stats, admission_tokens_declined, n);
  kvti_log(t, KVT_LOG_INFO,
           "kvtier: spill %.16s not written: chunks it shared were evicted "
           "since it was let in, and the write budget has no room for them",
           kvti_snapshot_hash(it->snap));
  spill_gone(t, it, KVT_EBUDGET);
  return 1;
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
  if (budget_refused(t, it))
    return;
  kvti_workq_item *more[KVTI_WRITER_BATCH_MAX - 1];
  size_t nmore = 0;
  int group = batchable(t);
  if (group) {
    take_ctx tc;
    tc.hashes[0] = kvti_snapshot_hash(it->snap);
    tc.n = 1;
    size_t took = kvti_workq_take_more(&t->w, more, KVTI_WRITER_BATCH_MAX - 1,
                                       take_want, &tc);
    for (size_t k = 0; k < took; k++) /* each taken is done when this returns */
      if (!budget_refused(t, (kvti_spill_item *)more[k]))
        more[nmore++] = more[k];
  }
  /* A durable spill alone goes the group's way too, as a group of one: its
   * chunks and staged files share one round of file fsyncs and one of
   * directory fsyncs (the single path syncs each file and directory as it
   * writes it: two more flushes one after the other). */
  if (nmore == 0 && !(group && t->opts.durability == KVT_DURABILITY_FSYNC)) {
    kvti_writer_run_hooked(t, it->snap);
    spill_release(t, it->snap, it->reserved);
    kvti_free(it);
    return;
  }
  kvti_snapshot *snaps[KVTI_WRITER_BATCH_MAX];
  snaps[0] = it->snap;
  for (size_t k = 0; k < nmore; k++)
    snaps[k + 1] = ((kvti_spill_item *)more[k])->snap;
  kvti_writer_write_batch(t, snaps, nmore + 1);
  spill_release(t, it->snap, it->reserved);
  kvti_free(it);
  for (size_t k = 0; k < nmore; k++) {
    spill_release(t, ((kvti_spill_item *)more[k])->snap,
                  ((kvti_spill_item *)more[k])->reserved);
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
  spill_gone(t, it, KVT_ECLOSED);
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
                     void *release_ctx, const kvt_call_opts *co,
                     uint64_t reserved) {
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
  it->reserved = reserved;
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
                       void *release_ctx, const kvt_call_opts *co,
                       uint64_t reserved) {
  int rc = spill_try(t, tokens, n_tokens, layers, n_layers, memory_bytes, copy,
                     release, release_ctx, co, reserved);
  if (rc != 0 && t)
    kvti_stats_refused(&t->stats, rc);
  if (rc == 0) /* this model's layout, for the layout guard */
    kvti_tier_layout_note(t, layers, n_layers);
  return rc;
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

int kvti_writer_queue_marker(kvt_tier *t, const struct timespec *ts, int has) {
  kvti_writer_hook *h = &t->hook;
  uint64_t depth = 0;
  kvti_workq_gauges(&t->w, &depth, NULL);
  int started = kvti_workq_started(&t->w);
  pthread_mutex_lock(&h->mu);
  int nothing = h->marker || kvti_workq_check(&t->w, 0) == KVT_ECLOSED ||
                (!started && depth == 0);
  pthread_mutex_unlock(&h->mu);
  if (nothing)
    return 0;
  /* Spills queued before any writer: start one, so slots free up and the
   * spills before the marker get written (close drains, it never drops). */
  if (!started) {
    int rc = kvt_tier_start_writer(t);
    if (rc != 0)
      return rc;
  }
  kvti_spill_item *marker = kvti_calloc(1, sizeof *marker);
  if (!marker)
    return KVT_ERR_NOMEM();
  int rc = kvti_workq_push_last(&t->w, &marker->link, ts, has);
  if (rc == KVT_ETIMEDOUT) {
    kvti_free(marker);
    kvti_workq_gauges(&t->w, &depth, NULL);
    return KVT_ERR(KVT_EFULL,
                   "close: the spill queue stayed full (%llu of %u) until "
                   "the deadline; the writer's stop marker could not be "
                   "queued (nothing changed, close may be retried)",
                   (unsigned long long)depth, t->opts.spill_queue_size);
  }
  if (rc != 0) { /* closed meanwhile: nothing to stop */
    kvti_free(marker);
    return 0;
  }
  pthread_mutex_lock(&h->mu);
  h->marker = 1;
  pthread_mutex_unlock(&h->mu);
  return 0;
}
