/*
 * ops.c - the public calls on stored entries: lookups (exact and prefix, with
 * retention applied), touch, remove, gc (and its dry run), foreach, describe,
 * verify, and kvt_tier_stats / kvt_tier_stats_add (the counters of stats.c
 * plus gauges measured from the index, the spill queue and the remote tier).
 * Each enters and leaves the tier; mutations take mut_mu.
 */
#include "tier/tier.h"
#include "tier/admission.h"
#include "tier/chunks.h"
#include "base/vec.h"
#include "base/clock.h"
#include "base/error.h"
#include "base/hash.h"
#include "base/io.h"
#include "index/index.h"
#include "tier/ramtier.h"
#include "tier/remote.h"

#include <string.h>

/* ------------------------------------------------------------------------ */
/* Lookups and entry operations                                             */
/* ------------------------------------------------------------------------ */

static int check_tokens(const int32_t *tokens, size_t n) {
  if (!tokens && n > 0)
    return KVT_ERR(KVT_EINVAL, "tokens is NULL with n_tokens > 0");
  return 0;
}

/* remote: also consult the remote store, as a promote would (promote.c's
 * begin): on a local miss, or for a longer remote prefix than the local one.
 */
static int lookup_common(kvt_entry_info *out, kvt_tier *t,
                         const int32_t *tokens, size_t n, int prefix,
                         int remote, const kvti_salt *salt) {
  if (!out || !t)
    return KVT_ERR(KVT_EINVAL, "lookup: NULL argument");
  int rc = check_tokens(tokens, n);
  if (rc != 0 || (rc = kvti_tier_enter(t)) != 0)
    return rc;
  if (t->opts.clock_fn) /* the request's time, for what it touches */
    kvti_tier_clock(t);
  double cutoff = kvti_tier_cutoff(t);
  rc = prefix
           ? kvti_index_find_prefix_salted(out, t->idx, tokens, n, cutoff, salt)
           : kvti_index_find_salted(out, t->idx, tokens, n, cutoff, salt);
  rc = kvti_tier_chunks_servable(t, out, rc); /* a damaged chain: kept */
  if (prefix) /* chunk-aligned prefixes of pure-KV chains (chunks.h) */
    rc = kvti_tier_chunks_prefix(t, out, rc, tokens, n, salt);
  if (rc == 0) /* a stored prefix found: admission's reuse signal */
    kvti_admit_lookup_hit(t, tokens, (size_t)out->num_tokens, salt);
  /* A request for these tokens: what it asks for came back (all of it
   * stored: the hit above has marked it already). */
  if (prefix && !(rc == 0 && out->num_tokens >= n))
    kvti_admit_lookup_ask(t, tokens, n, salt);
  if (remote && kvti_remote_enabled(t) && !salt->has &&
      (rc == KVT_ENOTFOUND || (rc == 0 && prefix && out->num_tokens < n))) {
    kvt_entry_info ri;
    uint64_t min_len = rc == 0 ? out->num_tokens + 1 : 1;
    if (kvti_remote_peek(t, &ri, tokens, n, prefix, min_len) == 0) {
      *out = ri;
      rc = 0;
    } else if (rc == 0) {
      kvt_clear_error();
    }
  }
  kvti_tier_leave(t);
  return rc;
}

int kvt_tier_lookup(kvt_entry_info *out, kvt_tier *t, const int32_t *tokens,
                    size_t n_tokens) {
  return kvt_tier_lookup_ex(out, t, tokens, n_tokens, NULL);
}

int kvt_tier_lookup_prefix(kvt_entry_info *out, kvt_tier *t,
                           const int32_t *tokens, size_t n_tokens) {
  return kvt_tier_lookup_prefix_ex(out, t, tokens, n_tokens, NULL);
}

int kvt_tier_lookup_ex(kvt_entry_info *out, kvt_tier *t, const int32_t *tokens,
                       size_t n_tokens, const kvt_call_opts *co) {
  kvti_salt s;
  int rc = kvti_call_salt(&s, t, co);
  return rc ? rc : lookup_common(out, t, tokens, n_tokens, 0, 1, &s);
}

int kvt_tier_lookup_prefix_ex(kvt_entry_info *out, kvt_tier *t,
                              const int32_t *tokens, size_t n_tokens,
                              const kvt_call_opts *co) {
  kvti_salt s;
  int rc = kvti_call_salt(&s, t, co);
  return rc ? rc : lookup_common(out, t, tokens, n_tokens, 1, 1, &s);
}

static int touch_common(kvt_tier *t, const int32_t *tokens, size_t n_tokens,
                        const kvti_salt *salt) {
  kvt_entry_info info;
  /* local entries only: the remote store keeps no access times */
  int rc = lookup_common(&info, t, tokens, n_tokens, 0, 0, salt);
  if (rc != 0 && rc != KVT_ENOTFOUND)
    return rc;
  int found = rc == 0;
  if ((rc = kvti_tier_enter(t)) != 0)
    return rc;
  if (t->readonly)
    rc = KVT_ERR(KVT_EINVAL, "touch needs a writable tier (opened read-only)");
  else if (found)
    rc = kvti_index_touch_hash(t->idx, info.token_hash);
  else if (!t->chunked)
    rc = KVT_ERR(KVT_ENOTFOUND, "no stored entry for these %zu tokens",
                 n_tokens);
  /* The chain under the tokens is refreshed too (a chunk is as recent as its
   * newest use): the scheduler's only touch is of prompt[:matched]. */
  if (rc == 0 || (!found && t->chunked && !t->readonly)) {
    int crc = kvti_tier_chunks_touch(t, tokens, n_tokens, salt);
    if (!found)
      rc = crc == 0 ? 0
                    : KVT_ERR(KVT_ENOTFOUND,
                              "no stored entry or chain for these %zu tokens",
                              n_tokens);
  }
  kvti_tier_leave(t);
  return rc;
}

int kvt_tier_touch(kvt_tier *t, const int32_t *tokens, size_t n_tokens) {
  return kvt_tier_touch_ex(t, tokens, n_tokens, NULL);
}

int kvt_tier_touch_ex(kvt_tier *t, const int32_t *tokens, size_t n_tokens,
                      const kvt_call_opts *co) {
  kvti_salt s;
  int rc = kvti_call_salt(&s, t, co);
  return rc ? rc : touch_common(t, tokens, n_tokens, &s);
}

static int remove_common(kvt_tier *t, const int32_t *tokens, size_t n_tokens,
                         const kvti_salt *salt) {
  if (!t)
    return KVT_ERR(KVT_EINVAL, "tier is NULL");
  int rc = check_tokens(tokens, n_tokens);
  if (rc != 0 || (rc = kvti_tier_enter(t)) != 0)
    return rc;
  if (t->readonly) {
    rc = KVT_ERR(KVT_EINVAL, "remove needs a writable tier (opened read-only)");
  } else {
    char hash[KVT_HASH_HEX_LEN + 1];
    rc = kvti_salt_hex(hash, salt, tokens, n_tokens);
    if (rc == 0) {
      pthread_mutex_lock(&t->mut_mu);
      rc = kvti_tier_remove_locked(t, hash, KVTI_RM_USER);
      pthread_mutex_unlock(&t->mut_mu);
      if (rc == KVT_ENOTFOUND)
        KVT_ERR(KVT_ENOTFOUND, "no entry for these tokens");
    }
  }
  kvti_tier_leave(t);
  return rc;
}

int kvt_tier_remove(kvt_tier *t, const int32_t *tokens, size_t n_tokens) {
  return kvt_tier_remove_ex(t, tokens, n_tokens, NULL);
}

int kvt_tier_remove_ex(kvt_tier *t, const int32_t *tokens, size_t n_tokens,
                       const kvt_call_opts *co) {
  kvti_salt s;
  int rc = kvti_call_salt(&s, t, co);
  return rc ? rc : remove_common(t, tokens, n_tokens, &s);
}

typedef struct info_vec {
  kvt_entry_info *v;
  size_t n, cap;
  int oom;
} info_vec;

static int collect_info(void *ctx, const kvt_entry_info *info) {
  info_vec *l = ctx;
  if (KVTI_VEC_RESERVE(&l->v, &l->cap, l->n + 1, 64) != 0) {
    l->oom = 1;
    return 1;
  }
  l->v[l->n++] = *info;
  return 0;
}

/* Dry-run gc: what kvti_tier_enforce_locked would remove, computed on a
 * snapshot of the rows (most recently used first): expired entries, then the
 * least recently used of the rest. */
static int gc_plan(kvt_tier *t, int64_t max_entries, uint64_t max_bytes,
                   double cutoff, uint64_t *n, uint64_t *bytes) {
  info_vec all = {0};
  int rc = kvti_index_foreach(t->idx, collect_info, &all);
  if (rc == 0 && all.oom)
    rc = KVT_ERR_NOMEM();
  if (rc == 0) {
    uint64_t count = all.n, total = 0;
    for (size_t i = 0; i < all.n; i++)
      total += all.v[i].disk_bytes;
    char *gone = kvti_calloc(all.n ? all.n : 1, 1);
    if (!gone) {
      rc = KVT_ERR_NOMEM();
    } else {
      for (size_t i = 0; cutoff > 0 && i < all.n; i++) {
        if (all.v[i].created_at < cutoff) {
          gone[i] = 1;
          count--;
          total -= all.v[i].disk_bytes;
          (*n)++;
          *bytes += all.v[i].disk_bytes;
        }
      }
      for (size_t i = all.n; i-- > 0;) {
        if (count <= (uint64_t)max_entries && total <= max_bytes)
          break;
        if (gone[i])
          continue;
        count--;
        total -= all.v[i].disk_bytes;
        (*n)++;
        *bytes += all.v[i].disk_bytes;
      }
      kvti_free(gone);
    }
  }
  kvti_free(all.v);
  return rc;
}

int kvt_tier_gc(kvt_tier *t, const kvt_gc_opts *o, uint64_t *removed,
                uint64_t *removed_bytes) {
  if (!t)
    return KVT_ERR(KVT_EINVAL, "tier is NULL");
  if (o && o->version != 1)
    return KVT_ERR(KVT_EINVAL, "kvt_gc_opts version must be 1, got %u",
                   o->version);
  int rc = kvti_tier_enter(t);
  if (rc != 0)
    return rc;
  uint64_t max_bytes = (o && o->max_bytes) ? o->max_bytes : t->max_bytes;
  int64_t max_entries =
      (o && o->max_entries > 0) ? o->max_entries : t->opts.max_entries;
  double cutoff = kvti_tier_cutoff(t);
  if (o && o->older_than_seconds >= 0)
    cutoff = kvti_tier_recency_now(t) - (double)o->older_than_seconds;
  uint64_t n = 0, bytes = 0;
  if (o && o->dry_run) {
    rc = gc_plan(t, max_entries, max_bytes, cutoff, &n, &bytes);
  } else if (t->readonly) {
    rc = KVT_ERR(KVT_EINVAL, "gc needs a writable tier (opened read-only)");
  } else {
    pthread_mutex_lock(&t->mut_mu);
    kvti_tier_enforce_locked(t, max_entries, max_bytes, cutoff, &n, &bytes);
    pthread_mutex_unlock(&t->mut_mu);
  }
  if (rc == 0) {
    if (removed)
      *removed = n;
    if (removed_bytes)
      *removed_bytes = bytes;
  }
  kvti_tier_leave(t);
  return rc;
}

typedef struct visit_ctx {
  kvt_entry_visit_fn fn;
  void *ctx;
  double cutoff;
} visit_ctx;

static int visit_live(void *ctx, const kvt_entry_info *info) {
  visit_ctx *v = ctx;
  if (v->cutoff > 0 && info->created_at < v->cutoff)
    return 0; /* expired: as good as gone */
  return v->fn(v->ctx, info);
}

int kvt_tier_foreach(kvt_tier *t, kvt_entry_visit_fn fn, void *ctx) {
  if (!t || !fn)
    return KVT_ERR(KVT_EINVAL, "foreach: NULL argument");
  int rc = kvti_tier_enter(t);
  if (rc != 0)
    return rc;
  visit_ctx v = {fn, ctx, kvti_tier_cutoff(t)};
  rc = kvti_index_foreach(t->idx, visit_live, &v);
  kvti_tier_leave(t);
  return rc;
}

int kvt_tier_describe(char **json, kvt_tier *t, const char *token_hash) {
  if (!json || !t || !token_hash)
    return KVT_ERR(KVT_EINVAL, "describe: NULL argument");
  if (!kvti_is_hash_name(token_hash))
    return KVT_ERR(KVT_EINVAL, "token_hash must be 64 lowercase hex digits");
  int rc = kvti_tier_enter(t);
  if (rc != 0)
    return rc;
  kvti_stripe_rdlock(&t->stripes, token_hash);
  rc = t->be->ops->describe(t->be, json, token_hash);
  kvti_stripe_unlock(&t->stripes, token_hash);
  kvti_tier_leave(t);
  return rc;
}

int kvt_tier_check_index(kvt_tier *t) {
  if (!t)
    return KVT_ERR(KVT_EINVAL, "check_index: tier is NULL");
  int rc = kvti_tier_enter(t);
  if (rc != 0)
    return rc;
  rc = kvti_index_quick_check(t->idx);
  if (rc == KVT_ECORRUPT)
    kvti_log(t, KVT_LOG_WARN,
             "kvtier: %s; it is set aside at close and rebuilt from the "
             "entry directories at the next open",
             kvt_last_error());
  kvti_tier_leave(t);
  return rc;
}

int kvt_tier_verify(kvt_tier *t, const char *token_hash, int repair) {
  if (!t || !token_hash)
    return KVT_ERR(KVT_EINVAL, "verify: NULL argument");
  if (!kvti_is_hash_name(token_hash))
    return KVT_ERR(KVT_EINVAL, "token_hash must be 64 lowercase hex digits");
  int rc = kvti_tier_enter(t);
  if (rc != 0)
    return rc;
  kvti_read_opts ro;
  memset(&ro, 0, sizeof ro);
  ro.verify_only = 1;
  ro.io_backend = t->opts.io_backend;
  ro.read_threads = t->opts.read_threads;
  kvt_entry_info info;
  double created = -1;
  int32_t *row_tokens = NULL;
  size_t row_n = 0;
  kvti_stripe_rdlock(&t->stripes, token_hash);
  if (kvti_index_find_hash(&info, t->idx, token_hash) == 0) {
    created = info.created_at;
    /* The row's tokens are what the files must hold: compared first (the
     * count before anything is read), never taken from the files. */
    if (kvti_index_tokens(&row_tokens, &row_n, t->idx, token_hash) == 0) {
      ro.tokens = row_tokens;
      ro.n_tokens = row_n;
    }
  }
  kvt_entry *e = NULL;
  rc = kvti_tier_chunks_get(t, &e, token_hash, &ro); /* tail + chain */
  kvti_stripe_unlock(&t->stripes, token_hash);
  kvt_entry_free(e);
  kvti_free(row_tokens);
  if ((rc == KVT_ECORRUPT || rc == KVT_ENOTFOUND) && repair) {
    /* A damaged chunk is contained (the chunk alone moves; this entry is
     * kept, unservable until the chunk is written again); only the entry's
     * own damage quarantines the entry. */
    int chunk_fault = kvti_tier_chunks_after_read(t);
    if (rc == KVT_ECORRUPT && !chunk_fault)
      kvti_tier_quarantine(t, token_hash, created);
  }
  kvti_tier_leave(t);
  return rc;
}

/* ------------------------------------------------------------------------ */
/* Stats                                                                    */
/* ------------------------------------------------------------------------ */

/* Counters plus freshly measured gauges. caller: on a caller's thread, where
 * the budget's clock may be read (never on the writer thread: clock_fn may be
 * a binding's callback). */
static void snapshot(kvt_stats *s, kvt_tier *t, int caller) {
  kvti_stats_copy(s, &t->stats);
  /* Gauges: from the index while it is open (after close the last counters
   * remain). */
  if (kvti_tier_enter(t) == 0) {
    kvti_index_totals(t->idx, &s->entries, &s->disk_bytes, &s->memory_bytes);
    s->disk_bytes += kvti_tier_chunks_bytes(t); /* chunk files, each once */
    kvti_tier_leave(t);
  } else {
    kvt_clear_error();
  }
  kvti_workq_gauges(&t->w, &s->queue_depth, &s->queue_bytes);
  kvti_remote_gauges(t, s);
  kvti_ram_gauges(t, s);
  if (t->admit) /* bytes written today, the budget, the SSD's lifetime */
    kvti_admit_gauges(t->admit, s, caller ? kvti_admit_now(t) : -1,
                      s->spill_bytes);
}

void kvti_stats_refresh_gauges(kvt_tier *t) {
  kvt_stats s;
  snapshot(&s, t, 0);
  kvti_stats_set_gauges(&t->stats, &s);
}

int kvt_tier_stats(kvt_stats *out, kvt_tier *t) {
  if (!out || !t)
    return KVT_ERR(KVT_EINVAL, "kvt_tier_stats: NULL argument");
  /* The caller's version says how much of *out exists: an older caller gets
   * the prefix it has. */
  size_t n = kvti_stats_size(out->version);
  if (n == 0)
    return KVT_ERR(KVT_EINVAL,
                   "kvt_stats version must be 1..%u, got %u (initialise it "
                   "with KVT_STATS_INIT or kvt_stats_init)",
                   KVT_STATS_VERSION, out->version);
  kvt_stats s;
  snapshot(&s, t, 1);
  kvti_stats_set_gauges(&t->stats, &s); /* the live file shows what we saw */
  s.version = out->version;
  memcpy(out, &s, n);
  return 0;
}

int kvt_tier_stats_add(kvt_tier *t, const char *counter, int64_t delta) {
  if (!t)
    return KVT_ERR(KVT_EINVAL, "tier is NULL");
  return kvti_stats_add_named(&t->stats, counter, delta);
}
