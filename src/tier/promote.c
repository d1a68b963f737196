/*
 * promote.c - bringing entries back from the tier: synchronous and asynchronous
 * promote in the reference's order (lookup -> reserve BEFORE reading -> read
 * and verify -> account), the worker pool that performs async reads, and the
 * promise (wait with timeout, a pollable fd, cancel, free). Also
 * kvt_tier_read_entry.
 *
 * Budget rule: the caller's reserve/release callbacks run only on caller
 * threads - reserve in kvt_tier_promote(_async), release in kvt_tier_promote
 * (failure), kvt_promise_result (failure), kvt_promise_cancel and
 * kvt_promise_free - exactly once per reservation unless a successful result
 * hands it over to the caller with the entry.
 *
 * Race with eviction: the read re-checks the index row under the entry's stripe
 * lock (held shared for the whole read, while eviction/replacement/quarantine
 * hold it exclusive). A row that vanished since the lookup is a miss
 * (KVT_ENOTFOUND), never a half-deleted read.
 *
 * Promise life: the worker finishes under the promise mutex (result, stats, fd
 * signal, state DONE) and never touches the promise after unlocking, so the
 * caller may free it as soon as it observes DONE. The tier counts an async
 * promote as an operation in flight until then, which is what lets close wait
 * for it; promise functions themselves never touch the tier.
 */
#include "base/error.h"
#include "base/hash.h"
#include "index/index.h"
#include "base/io.h"
#include "tier/remote.h"
#include "tier/ramtier.h"
#include "tier/tier.h"
#include "tier/chunks.h"

#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

enum { P_QUEUED = 0, P_RUNNING = 1, P_DONE = 2 };

/* Which tier a promote reads (remote.h): the remote store after a local miss,
 * or after a local prefix hit shorter than a remote one - then that local
 * entry is the fallback should the remote read fail. */
typedef struct rsel {
  int remote;
  int has_fb;
  kvt_entry_info fb;
} rsel;

struct kvt_promise {
  kvti_workq_item link; /* first: the pool's queue hands back this pointer */
  kvt_tier *t;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int state;
  atomic_int cancel;
  int cancelled;        /* the result was discarded because of a cancel */
  kvti_error_state err; /* the failure (rc != 0), carried to the caller */
  kvt_entry *entry;
  int collected; /* result taken (or cancelled): nothing left to hand over */
  int released;  /* the reservation was released */
  int fds[2];    /* lazily created pipe; fds[1] written at DONE */
  /* The request. */
  kvt_entry_info info;
  int32_t *tokens;
  size_t n_tokens;
  kvt_promote_opts opts;
  uint64_t reserved;
  double t0;
  rsel rs;        /* remote tier selection (remote.h) */
  kvti_salt salt; /* the request's (digested now: the caller's salt bytes
                     need not outlive the call) */
};

/* ------------------------------------------------------------------------ */
/* The read (shared by sync and async)                                      */
/* ------------------------------------------------------------------------ */

/* A chunk-aligned prefix no spill ended at: from the host RAM tier, else
 * from its chain (then lent to the RAM tier). Stripe of hash held shared. */
static int read_prefix(kvt_entry **out, kvt_tier *t, const char *hash,
                       const kvti_read_opts *ro) {
  int rc = kvti_ram_promote_prefix(out, t, hash, ro);
  if (rc == KVT_ENOTFOUND &&
      (rc = kvti_tier_chunks_get_prefix(t, out, hash, ro)) == 0)
    kvti_ram_after_prefix(t, *out, ro);
  return rc;
}

/* Reads the entry info describes, verifying it; counts failures (not hits: the
 * caller does, so a cancelled async result is never counted as a hit). On
 * corruption the entry is quarantined. Runs on the caller's thread (sync) or a
 * worker (async). */
static int read_entry(kvt_entry **out, kvt_tier *t, const kvt_entry_info *info,
                      const int32_t *tokens, size_t n,
                      const kvt_promote_opts *o, atomic_int *cancel, int remote,
                      uint64_t keep, const kvti_salt *salt) {
  const char *hash = info->token_hash;
  kvti_read_opts ro;
  memset(&ro, 0, sizeof ro);
  ro.tokens = tokens;
  ro.n_tokens = n;
  ro.cancel = cancel;
  ro.io_backend = t->opts.io_backend;
  ro.read_threads = t->opts.read_threads;
  ro.keep_tokens = keep; /* trimmed promote (local entries only: see begin) */
  ro.salt = *salt;       /* the request's salt names what is read */
  ro.ns_check = 1;
  if (o) {
    ro.page_cache = (o->flags & KVT_PROMOTE_PAGE_CACHE) != 0;
    ro.alloc = o->alloc;
    ro.free_buf = o->free_buf;
    ro.alloc_ctx = o->alloc_ctx;
    ro.on_layer = o->on_layer;
    ro.layer_ctx = o->layer_ctx;
  }
  if (remote) /* does its own accounting (remote.h) */
    return kvti_remote_read(t, out, info, &ro);
  kvt_entry_info cur;
  int row_seen = 0;
  double cutoff = kvti_tier_cutoff(t);
  kvti_stripe_rdlock(&t->stripes, hash);
  int rc = kvti_index_find_hash(&cur, t->idx, hash);
  if (rc == 0 && cutoff > 0 && cur.created_at < cutoff)
    rc = KVT_ENOTFOUND;
  if (rc == 0) {
    row_seen = 1;
    rc = kvti_ram_promote(out, t, hash, &ro); /* the host RAM tier first */
    if (rc == KVT_ENOTFOUND) {
      rc = kvti_tier_chunks_get(t, out, hash, &ro); /* be->get unless chunked */
      if (rc == 0)
        kvti_ram_after_disk(t, *out, &ro);
    }
  } else if (rc == KVT_ENOTFOUND && t->chunked &&
             (rc = read_prefix(out, t, hash, &ro)) == 0) {
    row_seen = 1; /* a chunk-aligned prefix no spill ended at */
  } else if (rc == KVT_ENOTFOUND) {
    KVT_ERR(KVT_ENOTFOUND,
            "entry %.16s was evicted or expired before it was read", hash);
  }
  kvti_stripe_unlock(&t->stripes, hash);
  if (rc == 0 && (rc = kvti_tier_layout_check(t, out)) != 0)
    return rc; /* another model's layout: a miss, counted there */
  if (rc == 0)
    return 0;
  int chunk_fault = kvti_tier_chunks_after_read(t);
  if (rc == KVT_ECANCELED) {
    KVTI_STAT_ADD(&t->stats, promotions_cancelled, 1);
  } else if (rc == KVT_ENOTFOUND && !row_seen) {
    KVTI_STAT_ADD(&t->stats, ssd_misses, 1); /* lost a race with eviction */
  } else {
    KVTI_STAT_ADD(&t->stats, promotion_failures, 1);
    kvti_log(t, KVT_LOG_WARN, "kvtier: failed to read entry %.16s: %s", hash,
             kvt_last_error());
    if (rc == KVT_ECORRUPT && !chunk_fault) /* a chunk's: contained */
      kvti_tier_quarantine(t, hash, cur.created_at);
    else if (rc == KVT_ENOTFOUND && !chunk_fault)
      kvti_tier_drop_missing(t, hash, cur.created_at);
  }
  return rc;
}

/* Success accounting: hit, latency since t0, bytes read, touch. */
static void account_hit(kvt_tier *t, kvt_entry *e, const kvt_entry_info *info,
                        double t0, uint32_t flags) {
  double dt = kvti_now_mono() - t0;
  if (dt < 0)
    dt = 0;
  kvti_stats_hit(&t->stats, dt, e->disk_bytes, e->n_tokens);
  kvti_ram_account(t, e);
  if (!(flags & KVT_PROMOTE_NO_TOUCH) && !t->readonly)
    kvti_index_touch_hash(t->idx, info->token_hash);
  kvti_log(t, KVT_LOG_INFO,
           "kvtier: promoted entry %.16s: %llu tokens, %llu bytes, %.1fms",
           info->token_hash, (unsigned long long)info->num_tokens,
           (unsigned long long)e->disk_bytes, dt * 1000);
}

/* Lookup + reserve on the calling thread. On success *info, *reserved, and
 * *remote = 1 when the entry is to be read from the remote tier: after a local
 * miss, or a local prefix hit shorter than a remote one (kept as the
 * fallback; the reservation then covers the larger of the two). */
static int begin(kvt_tier *t, kvt_entry_info *info, uint64_t *reserved,
                 rsel *rs, const int32_t *tokens, size_t n,
                 const kvt_promote_opts *o, uint64_t keep) {
  uint32_t flags = o ? o->flags : 0;
  double cutoff = kvti_tier_cutoff(t);
  int prefix = (flags & KVT_PROMOTE_PREFIX) != 0;
  KVTI_STAT_ADD(&t->stats, tokens_requested, keep ? keep : n);
  kvti_salt salt = {0}; /* validated by check_args: cannot fail but OOM */
  int src = kvti_tier_salt(&salt, t, o ? o->cache_salt : NULL,
                           o ? o->cache_salt_len : 0);
  if (src != 0)
    return src;
  int rc = prefix
               ? kvti_index_find_prefix_salted(info, t->idx, tokens, n, cutoff,
                                               &salt)
               : kvti_index_find_salted(info, t->idx, tokens, n, cutoff, &salt);
  rc = kvti_tier_chunks_servable(t, info, rc); /* a damaged chain: kept */
  if (prefix) { /* chunk-aligned prefixes of pure-KV chains (chunks.h) */
    rc = kvti_tier_chunks_prefix(t, info, rc, tokens, n, &salt);
  } else if (rc == KVT_ENOTFOUND && !keep) {
    /* An exact promote of tokens that only a chain holds: a prefix lookup
     * offered exactly these tokens (a chunk-aligned prefix no spill ended
     * at), and the caller now asks for them by their own length. Served
     * when the chain covers all n tokens; a shorter chain is still a miss. */
    kvt_entry_info ci;
    if (kvti_tier_chunks_prefix(t, &ci, KVT_ENOTFOUND, tokens, n, &salt) == 0 &&
        ci.num_tokens == n) {
      *info = ci;
      rc = 0;
    } else {
      rc = KVT_ENOTFOUND;
    }
  }
  memset(rs, 0, sizeof *rs);
  /* A trimmed promote (keep > 0) reads local entries only; so does a salted
   * one (salts are refused with a remote tier). */
  if (!keep && !salt.has && kvti_remote_enabled(t) &&
      (rc == KVT_ENOTFOUND || (rc == 0 && prefix && info->num_tokens < n))) {
    kvt_entry_info ri;
    uint64_t min_len = rc == 0 ? info->num_tokens + 1 : 1;
    if (kvti_remote_lookup(t, &ri, tokens, n, prefix, min_len) == 0) {
      if (rc == 0) {
        rs->has_fb = 1;
        rs->fb = *info;
      }
      *info = ri;
      rs->remote = 1;
      rc = 0;
    }
  }
  if (rc == KVT_ENOTFOUND) {
    KVTI_STAT_ADD(&t->stats, ssd_misses, 1);
    return KVT_ERR(KVT_ENOTFOUND, "no stored entry for these %zu tokens", n);
  }
  if (rc != 0)
    return rc;
  *reserved = 0;
  if (keep &&
      keep < info->num_tokens) /* a trimmed promote needs its share only */
    info->memory_bytes = (uint64_t)((double)info->memory_bytes * (double)keep /
                                    (double)info->num_tokens);
  uint64_t want = info->memory_bytes;
  if (rs->has_fb && rs->fb.memory_bytes > want)
    want = rs->fb.memory_bytes;
  if (o && o->reserve) {
    if (!o->reserve(o->budget_ctx, want)) {
      KVTI_STAT_ADD(&t->stats, promotion_failures, 1);
      kvti_log(t, KVT_LOG_WARN,
               "kvtier: promotion denied: cannot reserve %llu bytes RAM budget",
               (unsigned long long)want);
      return KVT_ERR(KVT_EBUDGET,
                     "reserve(%llu) refused by the caller's budget",
                     (unsigned long long)want);
    }
    *reserved = want;
  }
  return 0;
}

/* read_entry for the selected tier; a failed remote read falls back to the
 * local prefix (info then describes what was read) or is a miss. */
static int read_selected(kvt_entry **out, kvt_tier *t, kvt_entry_info *info,
                         const rsel *rs, const int32_t *tokens,
                         const kvt_promote_opts *o, atomic_int *cancel,
                         uint64_t keep, const kvti_salt *salt) {
  int rc = read_entry(out, t, info, tokens, (size_t)info->num_tokens, o, cancel,
                      rs->remote, keep, salt);
  if (rs->remote && rc == KVT_ENOTFOUND) {
    if (rs->has_fb) {
      *info = rs->fb;
      rc = read_entry(out, t, info, tokens, (size_t)info->num_tokens, o, cancel,
                      0, keep, salt);
    } else {
      KVTI_STAT_ADD(&t->stats, ssd_misses, 1);
    }
  }
  return rc;
}

static int check_args(const void *out, kvt_tier *t, const int32_t *tokens,
                      size_t n, const kvt_promote_opts *o) {
  if (!out || !t)
    return KVT_ERR(KVT_EINVAL, "promote: NULL argument");
  if (!tokens && n > 0)
    return KVT_ERR(KVT_EINVAL, "tokens is NULL with n_tokens > 0");
  if (o && (o->version < 1 || o->version > KVT_PROMOTE_OPTS_VERSION))
    return KVT_ERR(KVT_EINVAL, "kvt_promote_opts version must be 1..%u, got %u",
                   KVT_PROMOTE_OPTS_VERSION, o->version);
  if (o) {
    kvti_salt s;
    int rc = kvti_tier_salt(&s, t, o->cache_salt, o->cache_salt_len);
    if (rc)
      return rc;
  }
  if (o && o->flags & ~(KVT_PROMOTE_PREFIX | KVT_PROMOTE_NO_TOUCH |
                        KVT_PROMOTE_PAGE_CACHE))
    return KVT_ERR(KVT_EINVAL, "promote flags has unknown bits 0x%x", o->flags);
  if (o && o->reserve && !o->release)
    return KVT_ERR(KVT_EINVAL, "promote: reserve given without release");
  return 0;
}

/* The caller's opts as this version's struct: fields past the caller's
 * version take their defaults (a version-1 struct has no cache_salt: it is
 * never read). NULL stays NULL. */
static const kvt_promote_opts *norm_opts(kvt_promote_opts *lo,
                                         const kvt_promote_opts *o) {
  if (!o || o->version >= KVT_PROMOTE_OPTS_VERSION ||
      o->version < 1) /* the current version, or refused by check_args */
    return o;
  kvt_promote_opts d = KVT_PROMOTE_OPTS_INIT;
  memcpy(&d, o, offsetof(kvt_promote_opts, cache_salt));
  d.version = KVT_PROMOTE_OPTS_VERSION;
  *lo = d;
  return lo;
}

static int promote_sync(kvt_entry **out, kvt_tier *t, const int32_t *tokens,
                        size_t n_tokens, const kvt_promote_opts *opts_in,
                        uint64_t keep) {
  kvt_promote_opts lo;
  const kvt_promote_opts *opts = norm_opts(&lo, opts_in);
  int rc = check_args(out, t, tokens, n_tokens, opts);
  if (rc != 0 || (rc = kvti_tier_enter(t)) != 0)
    return rc;
  kvt_entry_info info;
  uint64_t reserved = 0;
  rsel rs;
  rc = begin(t, &info, &reserved, &rs, tokens, n_tokens, opts, keep);
  if (rc == 0) {
    double t0 = kvti_now_mono();
    kvt_entry *e = NULL;
    kvti_salt salt = {0}; /* as begin's (validated by check_args) */
    kvti_tier_salt(&salt, t, opts ? opts->cache_salt : NULL,
                   opts ? opts->cache_salt_len : 0);
    rc = read_selected(&e, t, &info, &rs, tokens, opts, NULL, keep, &salt);
    if (rc == 0) {
      e->reserved_bytes = reserved;
      account_hit(t, e, &info, t0, opts ? opts->flags : 0);
      *out = e;
    } else if (reserved) {
      kvti_error_state es;
      kvti_error_state_capture(&es, rc);
      opts->release(opts->budget_ctx, reserved);
      kvti_error_state_restore(&es);
    }
  }
  kvti_tier_leave(t);
  return rc;
}

int kvt_tier_promote(kvt_entry **out, kvt_tier *t, const int32_t *tokens,
                     size_t n_tokens, const kvt_promote_opts *opts) {
  return promote_sync(out, t, tokens, n_tokens, opts, 0);
}

int kvt_tier_promote_trim(kvt_entry **out, kvt_tier *t, const int32_t *tokens,
                          size_t n_tokens, size_t n_keep,
                          const kvt_promote_opts *opts) {
  if (n_keep == 0 || n_keep > n_tokens)
    return KVT_ERR(KVT_EINVAL, "n_keep must be in 1..n_tokens (%zu), got %zu",
                   n_tokens, n_keep);
  if (opts && (opts->flags & KVT_PROMOTE_PREFIX))
    return KVT_ERR(KVT_EINVAL, "kvt_tier_promote_trim promotes an exact entry: "
                               "KVT_PROMOTE_PREFIX is not allowed");
  return promote_sync(out, t, tokens, n_tokens, opts,
                      n_keep == n_tokens ? 0 : n_keep);
}

size_t kvt_common_prefix(const int32_t *a, size_t na, const int32_t *b,
                         size_t nb) {
  size_t n = na < nb ? na : nb, i = 0;
  if (!a || !b)
    return 0;
  while (i < n && a[i] == b[i])
    i++;
  return i;
}

int kvt_tier_read_entry(kvt_entry **out, kvt_tier *t, const int32_t *tokens,
                        size_t n_tokens, const char *file_path) {
  return kvt_tier_read_entry_ex(out, t, tokens, n_tokens, file_path, NULL);
}

int kvt_tier_read_entry_ex(kvt_entry **out, kvt_tier *t, const int32_t *tokens,
                           size_t n_tokens, const char *file_path,
                           const kvt_call_opts *co) {
  if (!out || !t || !file_path || (!tokens && n_tokens > 0))
    return KVT_ERR(KVT_EINVAL, "read_entry: NULL argument");
  if (!kvti_is_hash_name(file_path))
    return KVT_ERR(KVT_EINVAL, "file_path must be a 64-hex entry name");
  kvti_salt salt;
  int rc = kvti_call_salt(&salt, t, co);
  char want[KVT_HASH_HEX_LEN + 1];
  if (rc == 0)
    rc = kvti_salt_hex(want, &salt, tokens, n_tokens);
  if (rc != 0)
    return rc;
  /* Only the name of these tokens under the caller's salt: a salted entry
   * is never read by a call with another salt or none (nor the reverse). */
  if (strcmp(want, file_path) != 0)
    return KVT_ERR(KVT_ENOTFOUND,
                   "no entry %.16s for these %zu tokens under this cache_salt",
                   file_path, n_tokens);
  if ((rc = kvti_tier_enter(t)) != 0)
    return rc;
  kvti_read_opts ro;
  memset(&ro, 0, sizeof ro);
  ro.salt = salt;
  ro.ns_check = 1; /* file_path was checked against this salt above */
  ro.tokens = tokens;
  ro.n_tokens = n_tokens;
  ro.io_backend = t->opts.io_backend;
  ro.read_threads = t->opts.read_threads;
  kvt_entry_info cur;
  double created = -1;
  kvti_stripe_rdlock(&t->stripes, file_path);
  int has_row = kvti_index_find_hash(&cur, t->idx, file_path) == 0;
  if (has_row)
    created = cur.created_at;
  /* Past retention_seconds an entry is gone whether or not a sweep has run
   * yet (lookups and promotes apply the same cutoff). */
  double cutoff = kvti_tier_cutoff(t);
  if (created >= 0 && cutoff > 0 && created < cutoff) {
    kvti_stripe_unlock(&t->stripes, file_path);
    kvti_tier_leave(t);
    return KVT_ERR(KVT_ENOTFOUND, "entry %.16s expired (retention_seconds)",
                   file_path);
  }
  /* Served from the host RAM tier when just used (verified like the disk
   * read below), and lent to it after a disk read, as a promote. */
  rc = has_row ? kvti_ram_promote(out, t, file_path, &ro) : KVT_ENOTFOUND;
  if (rc == KVT_ENOTFOUND) {
    rc = kvti_tier_chunks_get(t, out, file_path, &ro);
    if (rc == 0 && has_row)
      kvti_ram_after_disk(t, *out, &ro);
  }
  if (rc == KVT_ENOTFOUND && !has_row && t->chunked)
    rc = read_prefix(out, t, file_path, &ro);
  kvti_stripe_unlock(&t->stripes, file_path);
  int chunk_fault = rc != 0 ? kvti_tier_chunks_after_read(t) : 0;
  if (rc == KVT_ECORRUPT && !chunk_fault) /* a chunk's: contained */
    kvti_tier_quarantine(t, file_path, created);
  if (rc == KVT_ENOTFOUND && created < 0 && kvti_remote_enabled(t)) {
    /* Not stored here: the entry a remote lookup reported (the reference's
     * check_ssd flow reads what lookup_ssd_prefix found). */
    kvt_entry_info ri;
    memset(&ri, 0, sizeof ri);
    memcpy(ri.token_hash, file_path, sizeof ri.token_hash);
    rc = kvti_remote_read(t, out, &ri, &ro);
  }
  if (rc == 0)
    rc = kvti_tier_layout_check(t, out); /* another model's: a miss */
  kvti_tier_leave(t);
  return rc;
}

/* ------------------------------------------------------------------------ */
/* Worker pool                                                              */
/* ------------------------------------------------------------------------ */

static void signal_fd(kvt_promise *p) {
  if (p->fds[1] >= 0) {
    char b = 1;
    ssize_t r;
    do {
      r = write(p->fds[1], &b, 1); /* a pipe, not a file: outside the io seam */
    } while (r < 0 && errno == EINTR);
  }
}

static void run_job(kvt_promise *p) {
  kvt_tier *t = p->t;
  kvt_entry *e = NULL;
  int rc;
  pthread_mutex_lock(&p->mu);
  p->state = P_RUNNING;
  pthread_mutex_unlock(&p->mu);
  if (atomic_load(&p->cancel)) {
    rc = KVT_ERR(KVT_ECANCELED, "promote cancelled before it started");
    KVTI_STAT_ADD(&t->stats, promotions_cancelled, 1);
  } else {
    rc = read_selected(&e, t, &p->info, &p->rs, p->tokens, &p->opts, &p->cancel,
                       0, &p->salt);
  }
  pthread_mutex_lock(&p->mu);
  if (rc == 0 && atomic_load(&p->cancel)) {
    /* Cancelled while reading but the read won: discard, it is not a hit. */
    kvt_entry_free(e);
    e = NULL;
    rc = KVT_ERR(KVT_ECANCELED, "promote cancelled");
    KVTI_STAT_ADD(&t->stats, promotions_cancelled, 1);
  } else if (rc == 0) {
    e->reserved_bytes = p->reserved;
    account_hit(t, e, &p->info, p->t0, p->opts.flags);
  }
  p->entry = e;
  if (rc != 0)
    kvti_error_state_capture(&p->err, rc);
  p->state = P_DONE;
  signal_fd(p);
  pthread_cond_broadcast(&p->cv);
  pthread_mutex_unlock(&p->mu);
  /* p may be freed from here on. */
  kvti_tier_leave(t);
}

static void pool_run(void *ctx, kvti_workq_item *it) {
  (void)ctx;
  run_job((kvt_promise *)it);
}

int kvti_pool_init(kvt_tier *t) {
  kvti_workq_cfg c;
  memset(&c, 0, sizeof c);
  c.threads = t->opts.promote_threads;
  c.start_on_push = 1; /* no threads until the first async promote */
  c.run = pool_run;    /* never dropped: close waits for every promote */
  c.ctx = t;
  c.name = "promote worker";
  return kvti_workq_init(&t->pool, &c);
}

void kvti_pool_stop(kvt_tier *t) {
  kvti_workq_stop(&t->pool, 0);
}

void kvti_pool_destroy(kvt_tier *t) {
  kvti_workq_destroy(&t->pool);
}

/* ------------------------------------------------------------------------ */
/* Promises                                                                 */
/* ------------------------------------------------------------------------ */

static void promise_destroy(kvt_promise *p) {
  if (p->fds[0] >= 0)
    close(p->fds[0]);
  if (p->fds[1] >= 0)
    close(p->fds[1]);
  pthread_mutex_destroy(&p->mu);
  pthread_cond_destroy(&p->cv);
  kvti_free(p->tokens);
  kvti_free(p);
}

int kvt_tier_promote_async(kvt_promise **out, kvt_tier *t,
                           const int32_t *tokens, size_t n_tokens,
                           const kvt_promote_opts *opts_in) {
  kvt_promote_opts lo;
  const kvt_promote_opts *opts = norm_opts(&lo, opts_in);
  int rc = check_args(out, t, tokens, n_tokens, opts);
  if (rc != 0 || (rc = kvti_tier_enter(t)) != 0)
    return rc;
  kvt_promise *p = kvti_calloc(1, sizeof *p);
  if (!p) {
    kvti_tier_leave(t);
    return KVT_ERR_NOMEM();
  }
  p->t = t;
  p->fds[0] = p->fds[1] = -1;
  atomic_init(&p->cancel, 0);
  pthread_mutex_init(&p->mu, NULL);
  if ((rc = kvti_cond_init(&p->cv)) != 0) {
    pthread_cond_init(&p->cv, NULL);
    promise_destroy(p);
    kvti_tier_leave(t);
    return rc;
  }
  if (opts)
    p->opts = *opts;
  else
    kvt_promote_opts_init(&p->opts, KVT_PROMOTE_OPTS_VERSION);
  /* validated by check_args; the namespace joined as in begin */
  kvti_tier_salt(&p->salt, t, p->opts.cache_salt, p->opts.cache_salt_len);
  p->opts.cache_salt = NULL; /* p->salt holds it */
  p->opts.cache_salt_len = 0;
  rc = begin(t, &p->info, &p->reserved, &p->rs, tokens, n_tokens, opts, 0);
  if (rc != 0) {
    promise_destroy(p);
    kvti_tier_leave(t);
    return rc;
  }
  p->n_tokens = (size_t)p->info.num_tokens;
  p->tokens = kvti_malloc(p->n_tokens * sizeof(int32_t));
  if (!p->tokens) {
    rc = KVT_ERR_NOMEM();
  } else {
    if (p->n_tokens)
      memcpy(p->tokens, tokens, p->n_tokens * sizeof(int32_t));
    p->t0 = kvti_now_mono();
    rc = kvti_workq_push(&t->pool, &p->link, 0);
    if (rc == KVT_ECLOSED)
      KVT_ERR(KVT_ECLOSED, "the tier is closing; promote refused");
  }
  if (rc != 0) {
    if (p->reserved)
      p->opts.release(p->opts.budget_ctx, p->reserved);
    promise_destroy(p);
    kvti_tier_leave(t);
    return rc;
  }
  /* The operation stays in flight (tier "active") until the worker completes
   * it. */
  *out = p;
  return 0;
}

int kvt_promise_wait(kvt_promise *p, int64_t timeout_ms) {
  if (!p)
    return KVT_ERR(KVT_EINVAL, "promise is NULL");
  struct timespec ts;
  int has;
  kvti_deadline(&ts, &has, timeout_ms);
  int rc = 0;
  pthread_mutex_lock(&p->mu);
  while (p->state != P_DONE) {
    if (timeout_ms == 0 ||
        (kvti_cond_wait_until(&p->cv, &p->mu, &ts, has) == ETIMEDOUT &&
         p->state != P_DONE)) {
      rc = KVT_ERR(KVT_ETIMEDOUT, "promote not complete within %lld ms",
                   (long long)timeout_ms);
      break;
    }
  }
  pthread_mutex_unlock(&p->mu);
  return rc;
}

int kvt_promise_fd(kvt_promise *p) {
  if (!p)
    return KVT_ERR(KVT_EINVAL, "promise is NULL");
  int rc;
  pthread_mutex_lock(&p->mu);
  if (p->fds[0] < 0) {
    int fds[2];
    /* pipe (not a file-system object): created lazily so promises nobody polls
     * cost no fds. */
    if (pipe(fds) != 0) {
      rc = KVT_ERR_OS(errno, "pipe for the promise fd");
      pthread_mutex_unlock(&p->mu);
      return rc;
    }
    for (int i = 0; i < 2; i++) {
      fcntl(fds[i], F_SETFD, FD_CLOEXEC);
      fcntl(fds[i], F_SETFL, fcntl(fds[i], F_GETFL) | O_NONBLOCK);
    }
    p->fds[0] = fds[0];
    p->fds[1] = fds[1];
    if (p->state == P_DONE)
      signal_fd(p);
  }
  rc = p->fds[0];
  pthread_mutex_unlock(&p->mu);
  return rc;
}

/* Releases the reservation once, on the calling thread. Caller holds nothing.
 */
static void release_once(kvt_promise *p) {
  uint64_t r = 0;
  pthread_mutex_lock(&p->mu);
  if (!p->released && p->reserved) {
    p->released = 1;
    r = p->reserved;
  }
  pthread_mutex_unlock(&p->mu);
  if (r)
    p->opts.release(p->opts.budget_ctx, r);
}

int kvt_promise_result(kvt_entry **out, kvt_promise *p) {
  if (!out || !p)
    return KVT_ERR(KVT_EINVAL, "promise_result: NULL argument");
  pthread_mutex_lock(&p->mu);
  if (p->collected) {
    pthread_mutex_unlock(&p->mu);
    return KVT_ERR(KVT_EINVAL, "promise result already collected");
  }
  if (p->state != P_DONE) {
    pthread_mutex_unlock(&p->mu);
    return KVT_ERR(KVT_EAGAIN, "promote not complete yet");
  }
  p->collected = 1;
  kvt_entry *e = p->entry;
  p->entry = NULL;
  kvti_error_state err = p->err;
  int rc = err.code;
  if (rc == 0)
    p->released = 1; /* handed over with the entry */
  pthread_mutex_unlock(&p->mu);
  if (rc == 0) {
    *out = e;
    return 0;
  }
  release_once(p); /* runs the caller's release: may overwrite the error */
  return kvti_error_state_restore(&err);
}

int kvt_promise_cancel(kvt_promise *p) {
  if (!p)
    return KVT_ERR(KVT_EINVAL, "promise is NULL");
  pthread_mutex_lock(&p->mu);
  if (p->cancelled) {
    pthread_mutex_unlock(&p->mu);
    return KVT_ERR(KVT_ECANCELED, "promote was cancelled");
  }
  if (p->collected) {
    pthread_mutex_unlock(&p->mu);
    return KVT_ERR(KVT_EINVAL, "promise result already collected");
  }
  if (p->state == P_DONE) {
    pthread_mutex_unlock(&p->mu);
    return 0; /* completed first: the result is still collectable */
  }
  atomic_store(&p->cancel, 1);
  while (p->state != P_DONE)
    pthread_cond_wait(&p->cv, &p->mu);
  /* The worker saw the flag (it completes under p->mu), so there is no entry to
   * keep. */
  kvt_entry *e = p->entry;
  p->entry = NULL;
  p->cancelled = 1;
  p->collected = 1;
  pthread_mutex_unlock(&p->mu);
  kvt_entry_free(e);
  release_once(p);
  return KVT_ERR(KVT_ECANCELED, "promote cancelled");
}

void kvt_promise_free(kvt_promise *p) {
  if (!p)
    return;
  pthread_mutex_lock(&p->mu);
  int done = p->state == P_DONE;
  pthread_mutex_unlock(&p->mu);
  if (!done)
    kvt_promise_cancel(p); /* waits for the worker */
  /* Completed but never collected (or completed just before the cancel): drop
   * it all. */
  pthread_mutex_lock(&p->mu);
  kvt_entry *e = NULL;
  if (!p->collected) {
    e = p->entry;
    p->entry = NULL;
    p->collected = 1;
  }
  pthread_mutex_unlock(&p->mu);
  kvt_entry_free(e);
  release_once(p);
  promise_destroy(p);
}
