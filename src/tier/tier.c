/*
 * tier.c - the small helpers every tier file shares: enter/leave (the
 * reference count that close waits on), the log, the retention cutoff, the
 * tier's clock and recency's, and the directory accessor. Nothing here calls
 * another tier file, so every tier file may call it; the lifecycle that wires
 * the pieces together is lifecycle.c.
 */
#include "tier/tier.h"
#include "tier/hostcache.h"
#include "tier/ramtier.h"
#include "base/error.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* ------------------------------------------------------------------------ */
/* Small shared helpers                                                     */
/* ------------------------------------------------------------------------ */

double kvti_tier_cutoff(const kvt_tier *t) {
  if (t->opts.retention_seconds <= 0)
    return 0;
  return kvti_tier_recency_now((void *)t) - (double)t->opts.retention_seconds;
}

double kvti_tier_clock(kvt_tier *t) {
  if (!t->opts.clock_fn)
    return kvti_now_wall();
  double now = t->opts.clock_fn(t->opts.clock_ctx);
  uint64_t bits;
  memcpy(&bits, &now, sizeof bits);
  atomic_store(&t->clock_seen, bits);
  return now;
}

double kvti_tier_recency_now(void *ctx) {
  const kvt_tier *t = ctx;
  if (!t->opts.clock_fn)
    return kvti_now_wall();
  uint64_t bits = atomic_load(&((kvt_tier *)ctx)->clock_seen);
  double now;
  memcpy(&now, &bits, sizeof now);
  return now;
}

void kvti_log(kvt_tier *t, int level, const char *fmt, ...) {
  if (!t->opts.log_fn || level < t->opts.log_level)
    return;
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  t->opts.log_fn(t->opts.log_ctx, level, msg);
}

int kvti_tier_enter(kvt_tier *t) {
  atomic_fetch_add(&t->active, 1);
  if (atomic_load(&t->state) != KVTI_OPEN) {
    kvti_tier_leave(t);
    return KVT_ERR(KVT_ECLOSED, "the tier is closed");
  }
  return 0;
}

void kvti_tier_leave(kvt_tier *t) {
  /* After the decrement that lets a closer proceed, t may be freed at any
   * moment: the fast path touches nothing after it. While closing, the
   * decrement happens under life_mu, which the closer holds while it checks
   * active, so the broadcast cannot be lost and the closer cannot finish before
   * we unlock. A decrement on the fast path that races with the start of a
   * close is caught by the closer's periodic re-check (see tier_close). */
  if (atomic_load(&t->state) == KVTI_OPEN) {
    atomic_fetch_sub(&t->active, 1);
    return;
  }
  pthread_mutex_lock(&t->life_mu);
  atomic_fetch_sub(&t->active, 1);
  pthread_cond_broadcast(&t->life_cv);
  pthread_mutex_unlock(&t->life_mu);
}

int kvti_remote_enabled(const kvt_tier *t) {
  return t->remote != NULL;
}

/* The RAM tier's copies go with what they copy (ramtier.h): here, below
 * every file that removes or replaces stored data, as they touch only the
 * host cache. */
void kvti_ram_invalidate(kvt_tier *t, const char *hash) {
  if (t->hc)
    kvti_hc_invalidate(t->hc, hash);
}

void kvti_ram_invalidate_chunks(kvt_tier *t, const kvti_chain_rec *recs,
                                size_t n) {
  if (t->hc && n)
    kvti_hc_invalidate_chains(t->hc, recs[0].key, sizeof *recs, n);
}

const char *kvt_tier_dir(const kvt_tier *t) {
  return t ? t->dir : NULL;
}
