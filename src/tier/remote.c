/*
 * remote.c - the tier's side of the shared remote tier (see remote.h and
 * docs/REMOTE.md): the upload queue (bounded by
 * remote_queue_size entries and spill_queue_bytes bytes) drained by one remote
 * thread so a slow or dead server never blocks the writer or a caller, the
 * back-off that turns a failing server into "local only" for a while (each
 * real failure counted in remote_errors; while backed off, uploads are dropped
 * and remote lookups are misses, both at no cost), remote lookups and reads for
 * promotes, and adoption of a fetched entry as a local copy. Remote reads run
 * on the promoting thread (the caller's for kvt_tier_promote, a worker's for
 * async promotes) and are bounded by remote_timeout_ms per command. The store
 * is reached only through the backend vtable (find, stage, fetch, put, list,
 * stat, remove) and made by the constructor table (kvti_backend_remote_new),
 * which names the store and, in a build without it, refuses the URL with
 * KVT_EUNSUPPORTED; staging and adoption are the local backend's. No code here
 * depends on how the tier was built.
 */
#include "tier/remote.h"
#include "base/vec.h"
#include "base/error.h"
#include "base/hash.h"
#include "index/index.h"
#include "base/io.h"
#include "store/local.h"
#include "store/chunked.h"
#include "tier/admission.h"
#include "tier/rchunks.h"
#include "tier/tier.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* An upload queued for the remote thread; link.cost is the snapshot's held
 * bytes, charged against spill_queue_bytes. reserved: in remote-only mode the
 * spill's write-budget reservation, held until the upload's bytes are in
 * spill_bytes, so no byte is ever out of both the bucket and the
 * reservations (admission.h). */
typedef struct up_item {
  kvti_workq_item link; /* first: the queue hands back this pointer */
  kvti_snapshot *snap;
  uint64_t reserved;
} up_item;

struct kvti_remote {
  kvti_backend *be;
  int mode;
  int keep_local;
  kvti_workq q; /* the upload queue and its thread (base/workq.h) */
  /* Health: back-off after failures. */
  pthread_mutex_t hmu;
  double down_until; /* monotonic seconds */
  double backoff;
};

static struct kvti_remote *RM(const kvt_tier *t) {
  return t->remote;
}

/* ---- health ---- */

static int remote_ok(struct kvti_remote *r) {
  pthread_mutex_lock(&r->hmu);
  int ok = kvti_now_mono() >= r->down_until;
  pthread_mutex_unlock(&r->hmu);
  return ok;
}

static void remote_success(struct kvti_remote *r) {
  pthread_mutex_lock(&r->hmu);
  r->backoff = 0;
  pthread_mutex_unlock(&r->hmu);
}

/* Counts a failed remote operation; connection-level failures (KVT_EIO,
 * KVT_ETIMEDOUT, KVT_EPERM from AUTH) also back off: for 0.25 s doubling up
 * to 5 s the remote is skipped, so callers do not each wait for a timeout. */
static void remote_failed(kvt_tier *t, int rc, const char *what) {
  struct kvti_remote *r = RM(t);
  KVTI_STAT_ADD(&t->stats, remote_errors, 1);
  if (rc == KVT_EIO || rc == KVT_ETIMEDOUT || rc == KVT_EPERM) {
    pthread_mutex_lock(&r->hmu);
    r->backoff = r->backoff > 0 ? r->backoff * 2 : 0.25;
    if (r->backoff > 5)
      r->backoff = 5;
    r->down_until = kvti_now_mono() + r->backoff;
    double b = r->backoff;
    pthread_mutex_unlock(&r->hmu);
    kvti_log(t, KVT_LOG_WARN,
             "kvtier: remote %s failed (%s); local only for %.2fs", what,
             kvt_last_error(), b);
  } else {
    kvti_log(t, KVT_LOG_WARN, "kvtier: remote %s failed: %s", what,
             kvt_last_error());
  }
}

/* ---- uploads ---- */

static void spill_done(kvt_tier *t, kvti_snapshot *s, int rc) {
  if (RM(t)->mode == KVT_REMOTE_ONLY && t->opts.spill_done_fn)
    t->opts.spill_done_fn(t->opts.spill_done_ctx, kvti_snapshot_hash(s), rc);
}

/* Uploads s; reserved is given back once what it wrote is counted. */
static void upload_one(kvt_tier *t, kvti_snapshot *s, uint64_t reserved) {
  struct kvti_remote *r = RM(t);
  int rc;
  if (!remote_ok(r)) {
    KVTI_STAT_ADD(&t->stats, remote_spill_drops, 1);
    rc = KVT_ERR(KVT_EIO,
                 "remote store unavailable (backing off); upload of "
                 "%.16s dropped",
                 kvti_snapshot_hash(s));
  } else {
    kvti_write_opts wo = {t->opts.storage_mode, 0, t->opts.file_mode,
                          t->opts.dir_mode};
    uint64_t bytes = 0;
    int chunked = 0; /* a chunked tier shares chunks (rchunks.h) */
    rc = kvti_rchunks_upload(t, r->be, s, &wo, &bytes, &chunked);
    if (!chunked && rc == 0)
      rc = r->be->ops->put(r->be, &bytes, s, &wo);
    if (rc == 0) {
      remote_success(r);
      KVTI_STAT_ADD(&t->stats, remote_spill_count, 1);
      KVTI_STAT_ADD(&t->stats, remote_spill_bytes, bytes);
      if (r->mode == KVT_REMOTE_ONLY) {
        KVTI_STAT_ADD(&t->stats, spill_count, 1);
        KVTI_STAT_ADD(&t->stats, spill_bytes, bytes);
      }
      /* Counted first, then given back: a decision in between sees both
       * (too much, never too little). */
      kvti_admit_release(t, reserved);
      reserved = 0;
    } else {
      remote_failed(t, rc, "upload");
      if (r->mode == KVT_REMOTE_ONLY)
        KVTI_STAT_ADD(&t->stats, write_failures, 1);
    }
  }
  kvti_admit_release(t, reserved); /* nothing written: nothing to count */
  spill_done(t, s, rc);
}

static void upload_run(void *ctx, kvti_workq_item *qi) {
  kvt_tier *t = ctx;
  up_item *it = (up_item *)qi;
  upload_one(t, it->snap, it->reserved);
  kvti_snapshot_free(it->snap);
  kvti_free(it);
}

/* An upload dropped because the tier is being freed. */
static void upload_drop(void *ctx, kvti_workq_item *qi) {
  kvt_tier *t = ctx;
  up_item *it = (up_item *)qi;
  KVTI_STAT_ADD(&t->stats, remote_spill_drops, 1);
  kvti_admit_release(t, it->reserved);
  spill_done(t, it->snap,
             KVT_ERR(KVT_ECLOSED, "tier closed before the upload"));
  kvti_snapshot_free(it->snap);
  kvti_free(it);
}

int kvti_remote_spills_local(const kvt_tier *t) {
  return !RM(t) || RM(t)->mode != KVT_REMOTE_ONLY;
}

int kvti_remote_take(kvt_tier *t, kvti_snapshot *s, uint64_t reserved) {
  struct kvti_remote *r = RM(t);
  if (!r) {
    kvti_admit_release(t, reserved);
    return 0;
  }
  uint64_t cost = kvti_snapshot_held_bytes(s);
  up_item *it = kvti_calloc(1, sizeof *it);
  int rc;
  if (!it) {
    rc = KVT_ERR_NOMEM();
  } else {
    it->snap = s;
    it->reserved = reserved;
    rc = kvti_workq_push(&r->q, &it->link, cost);
    if (rc == KVT_ECLOSED) {
      KVT_ERR(KVT_ECLOSED, "the tier is closing; upload refused");
    } else if (rc == KVT_EFULL) {
      uint64_t depth = 0, bytes = 0;
      kvti_workq_gauges(&r->q, &depth, &bytes);
      KVT_ERR(KVT_EFULL,
              "remote upload queue full (%llu entries, %llu bytes); "
              "upload of %.16s dropped",
              (unsigned long long)depth, (unsigned long long)bytes,
              kvti_snapshot_hash(s));
    }
  }
  if (rc == 0)
    return 1;
  kvti_free(it);
  kvti_admit_release(t, reserved); /* refused: nothing will be uploaded */
  KVTI_STAT_ADD(&t->stats, remote_spill_drops, 1);
  if (r->mode == KVT_REMOTE_ONLY)
    KVTI_STAT_ADD(&t->stats, spill_drops, 1);
  kvti_log(t, KVT_LOG_WARN, "kvtier: %s", kvt_last_error());
  spill_done(t, s, rc);
  return 0;
}

int kvti_remote_drain(kvt_tier *t, const struct timespec *ts, int has) {
  struct kvti_remote *r = RM(t);
  if (!r)
    return 0;
  uint64_t pending = 0;
  if (kvti_workq_wait(&r->q, ts, has, &pending) == KVT_ETIMEDOUT)
    return KVT_ERR(KVT_ETIMEDOUT, "%llu remote uploads still pending",
                   (unsigned long long)pending);
  return 0;
}

void kvti_remote_stop(kvt_tier *t, int drop) {
  struct kvti_remote *r = RM(t);
  if (!r)
    return;
  kvti_workq_stop(&r->q, drop);
}

void kvti_remote_free(kvt_tier *t) {
  struct kvti_remote *r = RM(t);
  if (!r)
    return;
  kvti_remote_stop(t, 1);
  if (r->be)
    r->be->ops->destroy(r->be);
  kvti_workq_destroy(&r->q);
  pthread_mutex_destroy(&r->hmu);
  kvti_free(r);
  t->remote = NULL;
}

/* ---- open ---- */

int kvti_remote_open(kvt_tier *t) {
  const kvt_options *o = &t->opts;
  if (!o->remote_url || o->remote_mode == KVT_REMOTE_LOCAL)
    return 0;
  struct kvti_remote *r = kvti_calloc(1, sizeof *r);
  if (!r)
    return KVT_ERR_NOMEM();
  pthread_mutex_init(&r->hmu, NULL);
  kvti_workq_cfg qc;
  memset(&qc, 0, sizeof qc);
  qc.threads = 1;
  qc.max_items = o->remote_queue_size;
  qc.max_bytes = o->spill_queue_bytes;
  qc.start_on_push = 1;
  qc.run = upload_run;
  qc.drop = upload_drop;
  qc.ctx = t;
  qc.name = "remote upload";
  int rc = kvti_workq_init(&r->q, &qc);
  r->mode = o->remote_mode;
  r->keep_local = r->mode == KVT_REMOTE_LOCAL_AND_REMOTE && !t->readonly &&
                  !(o->remote_flags & KVT_REMOTE_NO_LOCAL_COPY);
  t->remote = r;
  /* Staging below the local store (same file system: a fetched entry is
   * adopted as a local copy by rename). */
  const char *stage_root = NULL;
  if (rc == 0)
    rc = kvti_backend_local_stage_root(t->be, &stage_root);
  if (rc == 0) {
    kvti_remote_cfg cfg = {
        o->remote_url,
        o->remote_prefix,
        o->remote_timeout_ms,
        o->remote_chunk_bytes,
        o->retention_seconds > 0 ? o->retention_seconds * 1000 : 0,
        stage_root,
        o->file_mode,
        o->dir_mode,
        o->remote_lookup_timeout_ms,
        o->remote_tls_ca_file,
        o->remote_tls_cert_file,
        o->remote_tls_key_file,
        1};
    rc = kvti_backend_remote_new(&r->be, &cfg);
  }
  if (rc == 0 && !r->be->remote)
    rc = KVT_ERR(KVT_EUNSUPPORTED,
                 "remote store %s cannot serve as a remote tier (no "
                 "find/stat/stage/fetch)",
                 r->be->ops->name);
  if (rc == 0) {
    /* One contact now: refused credentials or certificates are a
     * configuration error the caller must see at open; an unreachable
     * server is not (warned, then the usual back-off). */
    int p = r->be->remote->reach(r->be);
    if (p == KVT_EPERM)
      rc = p;
    else if (p != 0)
      remote_failed(t, p, "connect");
  }
  if (rc != 0) {
    char msg[512];
    snprintf(msg, sizeof msg, "%s", kvt_last_error());
    kvti_remote_free(t);
    return KVT_ERR(rc, "%s", msg);
  }
  kvti_log(t, KVT_LOG_INFO, "kvtier: remote tier %s (%s)", o->remote_url,
           r->mode == KVT_REMOTE_ONLY ? "remote only" : "local+remote");
  return 0;
}

/* ---- promotes ---- */

/* The remote lookup of promotes (count: misses counted) and of
 * kvt_tier_lookup* (not counted, as local lookups are not). */
static int lookup(kvt_tier *t, kvt_entry_info *info, const int32_t *tokens,
                  size_t n, int prefix, uint64_t min_len, int count) {
  struct kvti_remote *r = RM(t);
  if (!r)
    return KVT_ENOTFOUND;
  if (!remote_ok(r)) {
    if (count)
      KVTI_STAT_ADD(&t->stats, remote_misses, 1);
    return KVT_ERR(KVT_ENOTFOUND, "remote store unavailable (backing off)");
  }
  kvti_backend_meta m;
  int rc = r->be->remote->find(r->be, &m, tokens, n, prefix, min_len);
  if (rc == 0) {
    remote_success(r);
    double cutoff = kvti_tier_cutoff(t);
    if (cutoff > 0 && m.created_at < cutoff)
      rc = KVT_ERR(KVT_ENOTFOUND, "remote entry %.16s expired", m.hash);
    else if (m.chained && !kvti_rchunks_entry_ok(t, &m))
      rc = KVT_ERR(KVT_ENOTFOUND,
                   "remote entry %.16s is chunked in another namespace or "
                   "chunk size",
                   m.hash);
  } else if (rc != KVT_ENOTFOUND) {
    remote_failed(t, rc, "lookup");
  }
  if (prefix && (rc == 0 || rc == KVT_ENOTFOUND) && t->chunked) {
    /* A chain other nodes stored, longer than any remote entry: a
     * chunk-aligned prefix no spill ended at (rchunks.h). */
    kvt_entry_info ci;
    uint64_t want =
        rc == 0 && m.num_tokens >= min_len ? m.num_tokens + 1 : min_len;
    int crc = kvti_rchunks_lookup(t, r->be, &ci, tokens, n, want);
    if (crc == 0) {
      remote_success(r);
      *info = ci;
      return 0;
    }
    if (crc != KVT_ENOTFOUND && crc != KVT_ENOMEM) {
      remote_failed(t, crc, "chunk lookup");
      if (rc != 0)
        rc = crc;
    }
  }
  if (rc != 0) {
    if (count)
      KVTI_STAT_ADD(&t->stats, remote_misses, 1);
    return rc == KVT_ENOTFOUND
               ? rc
               : KVT_ERR(KVT_ENOTFOUND, "remote lookup failed: %s",
                         kvt_last_error());
  }
  memset(info, 0, sizeof *info);
  memcpy(info->token_hash, m.hash, sizeof info->token_hash);
  kvt_prefix_hash(info->prefix_hash, tokens, (size_t)m.num_tokens);
  info->num_tokens = m.num_tokens;
  info->memory_bytes = m.memory_bytes;
  info->disk_bytes = m.total_bytes;
  info->created_at = m.created_at;
  info->accessed_at = m.created_at;
  return 0;
}

int kvti_remote_lookup(kvt_tier *t, kvt_entry_info *info, const int32_t *tokens,
                       size_t n, int prefix, uint64_t min_len) {
  return lookup(t, info, tokens, n, prefix, min_len, 1);
}

int kvti_remote_peek(kvt_tier *t, kvt_entry_info *info, const int32_t *tokens,
                     size_t n, int prefix, uint64_t min_len) {
  return lookup(t, info, tokens, n, prefix, min_len, 0);
}

/* Hands a verified fetched entry (stage/<hash>) to the local store (a rename
 * into its layout) and indexes it, as the writer publishes a spill; skipped
 * when the entry exists locally. */
static void adopt(kvt_tier *t, const char *stage, const kvt_entry *e,
                  uint64_t bytes, const kvti_backend_meta *m) {
  const char *hash = e->hash;
  pthread_mutex_lock(&t->mut_mu);
  if (atomic_load(&t->state) == KVTI_OPEN) {
    kvt_entry_info cur;
    kvti_stripe_wrlock(&t->stripes, hash);
    int rc = 0;
    if (kvti_index_find_hash(&cur, t->idx, hash) != 0 &&
        t->be->ops->present(t->be, hash) == 0) {
      /* A chained entry's tail: its record goes first (a tail is never
       * visible without it), its chunks were adopted by the read. */
      kvti_chunked *ch = m->chained ? t->chunked : NULL;
      if (ch)
        rc = kvti_chunked_adopt_record(ch, &m->chain);
      if (rc == 0)
        rc = kvti_backend_local_adopt(t->be, stage, hash);
      if (rc == 0) {
        rc = kvti_index_put(
            t->idx, e->tokens, e->n_tokens, hash, e->memory_bytes,
            m->chained ? m->total_bytes : bytes, e->storage_mode);
        if (rc != 0)
          t->be->ops->remove(t->be, hash);
      }
      if (rc != 0 && ch)
        kvti_chunked_forget(ch, hash);
    }
    kvti_stripe_unlock(&t->stripes, hash);
    if (rc == 0)
      kvti_tier_enforce_locked(t, t->opts.max_entries, t->max_bytes,
                               kvti_tier_cutoff(t), NULL, NULL);
    else
      kvti_log(t, KVT_LOG_WARN, "kvtier: keeping a local copy of %.16s: %s",
               hash, kvt_last_error());
  }
  pthread_mutex_unlock(&t->mut_mu);
  kvt_clear_error();
}

int kvti_remote_read(kvt_tier *t, kvt_entry **out, const kvt_entry_info *info,
                     const kvti_read_opts *ro) {
  struct kvti_remote *r = RM(t);
  const char *hash = info->token_hash;
  if (!remote_ok(r))
    return KVT_ERR(KVT_ENOTFOUND, "remote store unavailable (backing off)");
  char *stage = NULL;
  int rc = r->be->remote->stage(r->be, &stage);
  if (rc != 0) {
    KVTI_STAT_ADD(&t->stats, promotion_failures, 1);
    return rc;
  }
  double t0 = kvti_now_mono();
  kvti_backend_meta m;
  memset(&m, 0, sizeof m);
  uint64_t chunk_bytes = 0;
  int via_chain = 0;
  rc = r->be->remote->fetch(r->be, &m, hash, stage);
  if (rc == KVT_ENOTFOUND && t->chunked) {
    /* No entry ends there: a chain other nodes stored (rchunks.h). */
    kvti_error_state es;
    kvti_error_state_capture(&es, rc);
    rc = kvti_rchunks_read_prefix(t, r->be, out, hash, ro, &chunk_bytes);
    if (rc == KVT_ENOTFOUND)
      kvti_error_state_restore(&es);
    via_chain = 1;
    m.total_bytes = 0;
  } else if (rc == 0 && m.chained) {
    rc = kvti_rchunks_read_chained(t, r->be, out, stage, &m, ro, &chunk_bytes);
  } else if (rc == 0) {
    rc = kvti_entry_read(out, stage, hash, ro);
    if (rc == KVT_ECORRUPT || rc == KVT_ENOTFOUND) {
      /* Chunks verified but the files do not: the writer's data was bad. */
      kvti_error_state es;
      kvti_error_state_capture(&es, rc);
      r->be->ops->remove(r->be, hash);
      rc = KVT_ERR(KVT_ECORRUPT, "remote entry %.16s: %s", hash, es.msg);
    }
  }
  if (rc == 0) {
    remote_success(r);
    double dt = kvti_now_mono() - t0;
    pthread_mutex_lock(&t->stats.mu);
    t->stats.s.remote_hits++;
    t->stats.s.remote_read_bytes += m.total_bytes + chunk_bytes;
    t->stats.s.remote_latency_sum += dt > 0 ? dt : 0;
    pthread_mutex_unlock(&t->stats.mu);
    if (r->keep_local && !ro->verify_only && *out && !via_chain)
      adopt(t, stage, *out, m.total_bytes, &m);
    else if (chunk_bytes && !t->readonly) {
      /* Adopted chunks count against the capacity like spilled ones. */
      pthread_mutex_lock(&t->mut_mu);
      if (atomic_load(&t->state) == KVTI_OPEN)
        kvti_tier_enforce_locked(t, t->opts.max_entries, t->max_bytes,
                                 kvti_tier_cutoff(t), NULL, NULL);
      pthread_mutex_unlock(&t->mut_mu);
    }
  } else if (rc == KVT_ECANCELED) {
    KVTI_STAT_ADD(&t->stats, promotions_cancelled, 1);
  } else {
    /* A vanished, damaged or unreachable remote entry is a miss, never data:
     * the caller carries on as with a local miss. */
    kvti_error_state es;
    kvti_error_state_capture(&es, rc);
    if (rc != KVT_ENOTFOUND)
      remote_failed(t, rc, "read");
    KVTI_STAT_ADD(&t->stats, remote_misses, 1);
    rc =
        KVT_ERR(KVT_ENOTFOUND, "remote entry %.16s unusable: %s", hash, es.msg);
  }
  kvti_rmtree(stage);
  kvti_free(stage);
  return rc;
}

void kvti_remote_gauges(kvt_tier *t, kvt_stats *s) {
  struct kvti_remote *r = RM(t);
  if (!r)
    return;
  kvti_workq_gauges(&r->q, &s->remote_queue_depth, NULL);
  s->remote_available = (uint64_t)remote_ok(r);
}

/* ------------------------------------------------------------------------ */
/* Tools: kvt_tier_remote_foreach / kvt_tier_remote_verify                  */
/* ------------------------------------------------------------------------ */

typedef struct name_vec {
  char (*v)[KVT_HASH_HEX_LEN + 1];
  size_t n, cap;
  int oom;
} name_vec;

static int collect_hash(void *ctx, const char *name, int kind) {
  name_vec *l = ctx;
  if (kind != KVTI_BK_ENTRY)
    return 0;
  if (KVTI_VEC_RESERVE(&l->v, &l->cap, l->n + 1, 256) != 0) {
    l->oom = 1;
    return 1;
  }
  snprintf(l->v[l->n++], KVT_HASH_HEX_LEN + 1, "%s", name);
  return 0;
}

int kvt_tier_remote_foreach(kvt_tier *t, kvt_entry_visit_fn fn, void *ctx) {
  if (!t || !fn)
    return KVT_ERR(KVT_EINVAL, "remote_foreach: NULL argument");
  if (!t->remote)
    return KVT_ERR(KVT_EINVAL, "the tier has no remote store configured");
  int rc = kvti_tier_enter(t);
  if (rc != 0)
    return rc;
  name_vec l = {0};
  kvti_backend *be = t->remote->be;
  rc = be->ops->list(be, collect_hash, &l);
  if (rc == 0 && l.oom)
    rc = KVT_ERR_NOMEM();
  for (size_t i = 0; rc == 0 && i < l.n; i++) {
    kvti_backend_meta m;
    int g = be->remote->stat(be, &m, l.v[i]);
    if (g == KVT_ENOTFOUND || g == KVT_ECORRUPT) {
      kvt_clear_error(); /* gone since the scan, or damaged: not an entry */
      continue;
    }
    if ((rc = g) != 0)
      break;
    kvt_entry_info info;
    memset(&info, 0, sizeof info);
    memcpy(info.token_hash, m.hash, sizeof info.token_hash);
    info.num_tokens = m.num_tokens;
    info.memory_bytes = m.memory_bytes;
    info.disk_bytes = m.total_bytes;
    info.created_at = info.accessed_at = m.created_at;
    if (fn(ctx, &info))
      break;
  }
  kvti_free(l.v);
  kvti_tier_leave(t);
  return rc;
}

/* The checks every per-entry tool call starts with; on 0 the caller holds
 * the tier (kvti_tier_leave) and *be is the remote backend. */
static int tool_enter(kvt_tier *t, const char *token_hash, const char *what,
                      kvti_backend **be) {
  if (!t || !token_hash)
    return KVT_ERR(KVT_EINVAL, "%s: NULL argument", what);
  if (!kvti_is_hash_name(token_hash))
    return KVT_ERR(KVT_EINVAL, "token_hash must be 64 lowercase hex digits");
  if (!t->remote)
    return KVT_ERR(KVT_EINVAL, "the tier has no remote store configured");
  int rc = kvti_tier_enter(t);
  if (rc == 0)
    *be = t->remote->be;
  return rc;
}

int kvt_tier_remote_verify(kvt_tier *t, const char *token_hash) {
  kvti_backend *be = NULL;
  int rc = tool_enter(t, token_hash, "remote_verify", &be);
  if (rc != 0)
    return rc;
  char *stage = NULL;
  rc = be->remote->stage(be, &stage);
  if (rc == 0) {
    kvti_backend_meta m;
    memset(&m, 0, sizeof m);
    rc = be->remote->fetch(be, &m, token_hash, stage);
    if (rc == 0) {
      kvti_read_opts ro;
      memset(&ro, 0, sizeof ro);
      ro.verify_only = !m.chained;
      ro.read_threads = t->opts.read_threads;
      /* A chained tail's KV offsets count its chain's rows too. */
      ro.chain_rows = m.chained ? m.chain.chunks * m.chain.chunk_tokens : 0;
      kvt_entry *tail = NULL;
      rc = kvti_entry_read(m.chained ? &tail : NULL, stage, token_hash, &ro);
      /* A chained entry: its tail, then every chunk of its chain, fetched
       * and verified (nothing kept). */
      if (rc == 0 && m.chained)
        rc = kvti_rchunks_verify(t, be, tail->tokens, tail->n_tokens, &m);
      kvt_entry_free(tail);
      if (rc == KVT_ENOTFOUND || rc == KVT_ECORRUPT) {
        kvti_error_state es;
        kvti_error_state_capture(&es, rc);
        be->ops->remove(be, token_hash);
        rc = KVT_ERR(KVT_ECORRUPT, "remote entry %.16s: %s (removed)",
                     token_hash, es.msg);
      }
    }
    kvti_rmtree(stage);
    kvti_free(stage);
  }
  kvti_tier_leave(t);
  return rc;
}

int kvt_tier_remote_describe(char **json, kvt_tier *t, const char *token_hash) {
  if (!json)
    return KVT_ERR(KVT_EINVAL, "remote_describe: NULL argument");
  kvti_backend *be = NULL;
  int rc = tool_enter(t, token_hash, "remote_describe", &be);
  if (rc != 0)
    return rc;
  rc = be->ops->describe(be, json, token_hash);
  kvti_tier_leave(t);
  return rc;
}

int kvt_tier_remote_remove(kvt_tier *t, const char *token_hash) {
  if (t && t->readonly)
    return KVT_ERR(KVT_EINVAL, "remote_remove needs a writable tier");
  kvti_backend *be = NULL;
  int rc = tool_enter(t, token_hash, "remote_remove", &be);
  if (rc != 0)
    return rc;
  rc = be->ops->remove(be, token_hash);
  kvti_tier_leave(t);
  return rc;
}
