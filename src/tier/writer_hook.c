/*
 * writer_hook.c - the per-tier write hook, which exists for the reference's
 * Python API (the drop-in kvtier.ssd_cache): through it a binding lets
 * SSDCacheTier._write_entry be replaced on one instance (the writer thread
 * hands each spill to the hook with nothing locked, and the hook may run the
 * C write through kvt_tier_write_pending while the spill is in its hands).
 * Without a hook the writer never calls out. (Close's stop marker, the
 * reference's None sentinel, is writer.c's; it shares the hook's mutex.)
 * Invariants, all under t->hook.mu (a leaf lock): hook.id names the one spill
 * in the hook (0: none) and hook.snap its snapshot, which stays alive until
 * the hook has returned and no kvt_tier_write_pending call is running
 * (hook.busy == 0); spill ids come from a counter only the writer thread
 * advances, never reused, so a late call for an earlier spill is refused,
 * never applied to another.
 */
#include "base/error.h"
#include "base/io.h"
#include "tier/tier.h"

#include <errno.h>
#include <string.h>

int kvti_writer_hook_init(kvt_tier *t) {
  kvti_writer_hook *h = &t->hook;
  memset(h, 0, sizeof *h);
  pthread_mutex_init(&h->mu, NULL);
  pthread_cond_init(&h->cv, NULL);
  h->inited = 1;
  return 0;
}

void kvti_writer_hook_destroy(kvt_tier *t) {
  kvti_writer_hook *h = &t->hook;
  if (!h->inited)
    return;
  pthread_mutex_destroy(&h->mu);
  pthread_cond_destroy(&h->cv);
  h->inited = 0;
}

int kvt_tier_set_write_hook(kvt_tier *t, kvt_write_hook_fn fn, void *ctx) {
  if (!t)
    return KVT_ERR(KVT_EINVAL, "tier is NULL");
  int rc = kvti_tier_enter(t);
  if (rc != 0)
    return rc;
  pthread_mutex_lock(&t->hook.mu);
  t->hook.fn = fn;
  t->hook.ctx = fn ? ctx : NULL;
  pthread_mutex_unlock(&t->hook.mu);
  kvti_tier_leave(t);
  return 0;
}

int kvt_tier_write_pending(kvt_tier *t, uint64_t spill_id) {
  if (!t)
    return KVT_ERR(KVT_EINVAL, "tier is NULL");
  kvti_writer_hook *h = &t->hook;
  pthread_mutex_lock(&h->mu);
  if (spill_id == 0 || spill_id != h->id) {
    pthread_mutex_unlock(&h->mu);
    return KVT_ERR(KVT_EINVAL,
                   "spill %llu is not in the write hook (only the spill being "
                   "handed to the hook can be written)",
                   (unsigned long long)spill_id);
  }
  h->busy++;
  kvti_snapshot *s = h->snap;
  pthread_mutex_unlock(&h->mu);
  int rc = kvti_writer_write(t, s, 0);
  pthread_mutex_lock(&h->mu);
  h->rc = rc;
  h->busy--;
  pthread_cond_broadcast(&h->cv);
  pthread_mutex_unlock(&h->mu);
  return rc;
}

void kvti_writer_run_hooked(kvt_tier *t, kvti_snapshot *s) {
  kvti_writer_hook *h = &t->hook;
  pthread_mutex_lock(&h->mu);
  kvt_write_hook_fn fn = h->fn;
  void *ctx = h->ctx;
  uint64_t id = ++h->next_id;
  if (fn) {
    h->id = id;
    h->snap = s;
    h->rc = KVT_ECANCELED; /* until a write runs */
  }
  pthread_mutex_unlock(&h->mu);
  if (!fn) {
    kvti_writer_write(t, s, 1);
    return;
  }
  size_t n = 0;
  const int32_t *tokens = kvti_snapshot_tokens(s, &n);
  int hr = fn(ctx, id, tokens, n, kvti_snapshot_memory_bytes(s));
  pthread_mutex_lock(&h->mu);
  h->id = 0; /* refuse late calls, then wait for running ones */
  while (h->busy > 0)
    pthread_cond_wait(&h->cv, &h->mu);
  h->snap = NULL;
  int rc = hr != 0 ? hr : h->rc;
  pthread_mutex_unlock(&h->mu);
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
