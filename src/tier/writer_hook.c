/*
 * writer_hook.c - two pieces of the writer that exist for the reference's
 * Python API (the drop-in kvtier.ssd_cache): the per-tier write hook, through
 * which a binding lets SSDCacheTier._write_entry be replaced on one instance
 * (the writer thread hands each spill to the hook with nothing locked, and the
 * hook may run the C write through kvt_tier_write_pending while the spill is
 * in its hands), and close's stop marker, the reference's None sentinel: a
 * queue item that takes a slot, queued behind the accepted spills, at which
 * the writer stops. Without a hook the writer never calls out (writer.c's
 * loop writes directly). Invariants, all under w->mu: hook_id names the one
 * spill in the hook (0: none) and hook_snap its snapshot, which stays alive
 * until the hook has returned and no kvt_tier_write_pending call is running
 * (hook_busy == 0); spill ids are done_seq + 1 at the time, never reused, so
 * a late call for an earlier spill is refused, never applied to another.
 */
#include "base/error.h"
#include "base/io.h"
#include "tier/tier.h"

#include <errno.h>
#include <string.h>

int kvt_tier_set_write_hook(kvt_tier *t, kvt_write_hook_fn fn, void *ctx) {
  if (!t)
    return KVT_ERR(KVT_EINVAL, "tier is NULL");
  int rc = kvti_tier_enter(t);
  if (rc != 0)
    return rc;
  pthread_mutex_lock(&t->w.mu);
  t->w.hook = fn;
  t->w.hook_ctx = fn ? ctx : NULL;
  pthread_mutex_unlock(&t->w.mu);
  kvti_tier_leave(t);
  return 0;
}

int kvt_tier_write_pending(kvt_tier *t, uint64_t spill_id) {
  if (!t)
    return KVT_ERR(KVT_EINVAL, "tier is NULL");
  kvti_writer *w = &t->w;
  pthread_mutex_lock(&w->mu);
  if (spill_id == 0 || spill_id != w->hook_id) {
    pthread_mutex_unlock(&w->mu);
    return KVT_ERR(KVT_EINVAL,
                   "spill %llu is not in the write hook (only the spill being "
                   "handed to the hook can be written)",
                   (unsigned long long)spill_id);
  }
  w->hook_busy++;
  kvti_snapshot *s = w->hook_snap;
  pthread_mutex_unlock(&w->mu);
  int rc = kvti_writer_write(t, s, 0);
  pthread_mutex_lock(&w->mu);
  w->hook_rc = rc;
  w->hook_busy--;
  pthread_cond_broadcast(&w->cv_done);
  pthread_mutex_unlock(&w->mu);
  return rc;
}

void kvti_writer_hooked(kvt_tier *t, kvti_snapshot *s, kvt_write_hook_fn fn,
                        void *ctx, uint64_t id) {
  kvti_writer *w = &t->w;
  pthread_mutex_lock(&w->mu);
  w->hook_id = id;
  w->hook_snap = s;
  w->hook_rc = KVT_ECANCELED; /* until a write runs */
  pthread_mutex_unlock(&w->mu);
  size_t n = 0;
  const int32_t *tokens = kvti_snapshot_tokens(s, &n);
  int hr = fn(ctx, id, tokens, n, kvti_snapshot_memory_bytes(s));
  pthread_mutex_lock(&w->mu);
  w->hook_id = 0; /* refuse late calls, then wait for running ones */
  while (w->hook_busy > 0)
    pthread_cond_wait(&w->cv_done, &w->mu);
  w->hook_snap = NULL;
  int rc = hr != 0 ? hr : w->hook_rc;
  pthread_mutex_unlock(&w->mu);
  const char *hash = kvti_snapshot_hash(s);
  if (hr != 0) {
    KVTI_STAT_ADD(&t->stats, write_failures, 1);
    kvti_log(t, KVT_LOG_ERROR,
             "kvtier: the write hook failed for entry %.16s (%zu tokens): %d",
             hash, n, hr);
  }
  if (t->opts.spill_done_fn)
    t->opts.spill_done_fn(t->opts.spill_done_ctx, hash, rc);
}

int kvti_writer_queue_marker(kvt_tier *t, const struct timespec *ts, int has) {
  kvti_writer *w = &t->w;
  kvti_spill_item *marker = kvti_calloc(1, sizeof *marker);
  if (!marker)
    return KVT_ERR_NOMEM();
  pthread_mutex_lock(&w->mu);
  int nothing = w->marker || !w->accepting || (!w->started && w->depth == 0);
  int start = !nothing && !w->started;
  pthread_mutex_unlock(&w->mu);
  if (nothing) {
    kvti_free(marker);
    return 0;
  }
  /* Spills queued before any writer: start one, so slots free up and the
   * spills before the marker get written (close drains, it never drops). */
  if (start) {
    int rc = kvt_tier_start_writer(t);
    if (rc != 0) {
      kvti_free(marker);
      return rc;
    }
  }
  int rc = 0;
  pthread_mutex_lock(&w->mu);
  while (w->depth >= t->opts.spill_queue_size) {
    if (kvti_cond_wait_until(&w->cv_done, &w->mu, ts, has) == ETIMEDOUT &&
        w->depth >= t->opts.spill_queue_size) {
      rc = KVT_ERR(KVT_EFULL,
                   "close: the spill queue stayed full (%llu of %u) until "
                   "the deadline; the writer's stop marker could not be "
                   "queued (nothing changed, close may be retried)",
                   (unsigned long long)w->depth, t->opts.spill_queue_size);
      break;
    }
  }
  if (rc == 0 && w->accepting) {
    if (w->tail)
      w->tail->next = marker;
    else
      w->head = marker;
    w->tail = marker;
    w->depth++;
    w->accepting = 0;
    w->marker = 1;
    marker = NULL;
    pthread_cond_signal(&w->cv_work);
  }
  pthread_mutex_unlock(&w->mu);
  kvti_free(marker); /* not queued */
  return rc;
}
