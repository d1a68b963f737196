/*
 * chunk_tools.c - the chunked native store as tools see it
 * (include/kvtier_sys.h, "The chunked native store, for tools"): every chunk
 * with its sharing, an entry's chain, totals and the dedup figures, the
 * complete verification of one chunk file, the one routine that contains a
 * damaged chunk (serving path and repair: the file alone moves aside, what
 * depends on it is kept, unservable until the chunk is written again), and the
 * cleaning of chunks/ - stale *.tmp files and orphans (chunk files without a
 * row), adopted when valid and reachable, else removed - by kvt_tier_chunk_gc
 * and lazily by the writer, one subdirectory at a time
 * (kvti_tier_chunks_sweep_lazy), so open never lists chunks/.
 *
 * Invariants: an orphan is adopted only after its whole file verified and
 * only under an indexed parent (or the seed its own namespace and layout
 * give), so adoption never makes an unreachable or damaged chunk reachable;
 * every change runs under mut_mu, which every chunk write holds, so a *.tmp
 * or an unindexed file seen under it is never one being written. Damage
 * moves one file: no valid chunk, row or entry is deleted for it.
 */
#include "tier/chunk_tools.h"
#include "tier/ramtier.h"

#include "base/vec.h"
#include "base/error.h"
#include "base/hash.h"
#include "base/io.h"
#include "index/chain_walk.h"
#include "store/chunked.h"
#include "store/local_chunks.h"
#include "store/local_layout.h"
#include "tier/chunks.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static kvti_chains *chains_of(kvt_tier *t) {
  return kvti_chunkstore_chains(kvti_chunked_store(t->chunked));
}

static void to_info(kvt_chunk_info *o, const kvti_chain_visit *v) {
  memset(o, 0, sizeof *o);
  kvti_hex32(o->key, v->r.key);
  kvti_hex32(o->parent, v->r.parent);
  o->index = v->r.index;
  o->num_tokens = v->r.n_tokens;
  o->children = v->children;
  o->entries = v->refs;
  o->pure = v->r.pure;
  o->layout_hash = v->r.layout_hash;
  o->disk_bytes = v->r.disk_bytes;
  o->memory_bytes = v->r.mem_bytes;
  o->created_at = v->r.created_at;
  o->accessed_at = v->r.accessed_at;
}

/* ---- listing ---- */

typedef struct visit_ctx {
  kvt_chunk_visit_fn fn;
  void *ctx;
} visit_ctx;

static int visit_cb(void *ctx, const kvti_chain_visit *v) {
  visit_ctx *c = ctx;
  kvt_chunk_info info;
  to_info(&info, v);
  return c->fn(c->ctx, &info);
}

int kvt_tier_chunk_foreach(kvt_tier *t, kvt_chunk_visit_fn fn, void *ctx) {
  if (!t || !fn)
    return KVT_ERR(KVT_EINVAL, "kvt_tier_chunk_foreach: NULL argument");
  int rc = kvti_tier_enter(t);
  if (rc)
    return rc;
  visit_ctx c = {fn, ctx};
  if (t->chunked)
    rc = kvti_chains_visit(chains_of(t), visit_cb, &c);
  kvti_tier_leave(t);
  return rc;
}

/* The chain of an entry: its keys (found walking up from its last chunk),
 * sorted for the visit that fills their infos (children, sharing). */
typedef struct keypos {
  uint8_t key[32];
  size_t pos; /* in the chain */
} keypos;

typedef struct chain_ctx {
  keypos *kp; /* sorted by key */
  size_t n;
  kvt_chunk_info *out;
} chain_ctx;

static int cmp_keypos(const void *a, const void *b) {
  return memcmp(((const keypos *)a)->key, ((const keypos *)b)->key, 32);
}

static int chain_cb(void *ctx, const kvti_chain_visit *v) {
  chain_ctx *c = ctx;
  size_t lo = 0, hi = c->n;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    int d = memcmp(c->kp[mid].key, v->r.key, 32);
    if (d == 0) {
      to_info(&c->out[c->kp[mid].pos], v);
      return 0;
    }
    if (d < 0)
      lo = mid + 1;
    else
      hi = mid;
  }
  return 0;
}

int kvt_tier_entry_chain(kvt_chunk_info **out, size_t *n,
                         uint32_t *chunk_tokens, kvt_tier *t,
                         const char *token_hash, unsigned flags) {
  if (!out || !n || !t || !token_hash)
    return KVT_ERR(KVT_EINVAL, "kvt_tier_entry_chain: NULL argument");
  *out = NULL;
  *n = 0;
  if (chunk_tokens)
    *chunk_tokens = 0;
  if (!kvti_is_hash_name(token_hash))
    return KVT_ERR(KVT_EINVAL, "token_hash must be 64 lowercase hex digits");
  int rc = kvti_tier_enter(t);
  if (rc)
    return rc;
  kvt_entry_info info;
  uint8_t h[32];
  kvti_chained_entry ce;
  if (kvti_index_find_hash(&info, t->idx, token_hash) != 0) {
    kvti_tier_leave(t);
    return KVT_ERR(KVT_ENOTFOUND, "no entry %.16s", token_hash);
  }
  if (!t->chunked || kvti_unhex32(h, token_hash) != 0 ||
      !kvti_chains_entry_get(chains_of(t), h, &ce)) {
    kvti_tier_leave(t);
    return 0; /* stored whole */
  }
  if (chunk_tokens)
    *chunk_tokens = ce.chunk_tokens;
  kvti_chains *ch = chains_of(t);
  size_t cap = (size_t)ce.chunks;
  chain_ctx c = {0};
  c.kp = kvti_malloc(cap * sizeof *c.kp);
  /* malloc, not kvti_malloc: the caller frees it with kvt_free. */
  c.out = calloc(cap, sizeof *c.out);
  if (!c.kp || !c.out) {
    rc = KVT_ERR_NOMEM();
    goto done;
  }
  /* Walk up from the last chunk; a missing link leaves the chunks below it
   * unknown (found counts the ones from the top that are stored). */
  kvti_chain_visit v;
  uint8_t key[32];
  memcpy(key, ce.last_key, 32);
  size_t found = 0;
  while (found < cap && kvti_chains_node(ch, key, &v) &&
         v.r.index == cap - 1 - found) {
    memcpy(c.kp[found].key, v.r.key, 32);
    c.kp[found].pos = cap - 1 - found;
    to_info(&c.out[cap - 1 - found], &v);
    found++;
    memcpy(key, v.r.parent, 32);
  }
  if (found < cap) {
    rc = KVT_ERR(KVT_ENOTFOUND,
                 "entry %.16s: chain incomplete (chunk %zu of %zu missing)",
                 token_hash, cap - 1 - found, cap);
    goto done;
  }
  c.n = found;
  qsort(c.kp, found, sizeof *c.kp, cmp_keypos);
  if (!(flags & KVT_CHAIN_NO_SHARING))
    rc = kvti_chains_visit(ch, chain_cb, &c);
  if (rc == 0) {
    *n = found;
    *out = c.out;
    c.out = NULL;
  }
done:
  kvti_free(c.kp);
  free(c.out);
  kvti_tier_leave(t);
  return rc;
}

typedef struct totals_ctx {
  uint64_t shared, logical;
} totals_ctx;

static int totals_cb(void *ctx, const kvti_chain_visit *v) {
  totals_ctx *c = ctx;
  c->shared += v->refs >= 2;
  c->logical += (uint64_t)v->refs * v->r.disk_bytes;
  return 0;
}

int kvt_tier_chunk_totals(kvt_chunk_totals *out, kvt_tier *t) {
  if (!out || !t)
    return KVT_ERR(KVT_EINVAL, "kvt_tier_chunk_totals: NULL argument");
  if (out->version < 1 || out->version > KVT_CHUNK_TOTALS_VERSION)
    return KVT_ERR(KVT_EINVAL, "kvt_chunk_totals version %u unknown",
                   out->version);
  int rc = kvti_tier_enter(t);
  if (rc)
    return rc;
  unsigned v = out->version;
  memset(out, 0, sizeof *out);
  out->version = v;
  if (t->chunked) {
    kvti_chains *ch = chains_of(t);
    kvti_chains_totals tot;
    kvti_chains_totals_get(ch, &tot);
    totals_ctx c = {0, 0};
    rc = kvti_chains_visit(ch, totals_cb, &c);
    out->chunk_tokens = kvti_chunked_chunk_tokens(t->chunked);
    out->chunks = tot.chunks;
    out->disk_bytes = tot.disk_bytes;
    out->memory_bytes = tot.mem_bytes;
    out->leaves = tot.leaves;
    out->shared = c.shared;
    out->chained_entries = kvti_chains_entry_count(ch);
    out->chain_logical_bytes = c.logical;
  }
  kvti_tier_leave(t);
  return rc;
}

/* ---- verification ---- */

/* Reads the data section of an open chunk, verifying every block. */
static int read_all(int fd, const kvti_chunk_hdr *h, const char *path) {
  return kvti_chunk_verify_data(fd, h, path); /* bounded memory */
}

/* The lookup value of the parent of the chunk of header h: the indexed
 * parent's (index - 1, same layout), or nothing for chunk 0 (whose seed
 * kvti_chunk_rec_of checks). 0, or KVT_ENOTFOUND (parent not stored). */
static int parent_ck(kvti_chains *ch, const kvti_chunk_hdr *h, kvti_ck *pck,
                     const char *path) {
  pck->lo = pck->hi = 0;
  if (h->index == 0)
    return 0;
  kvti_chain_rec p;
  if (!kvti_chains_find(ch, h->parent, &p) || p.index + 1 != h->index ||
      p.layout_hash != h->layout_hash)
    return KVT_ERR(KVT_ENOTFOUND, "%s: parent chunk not stored", path);
  *pck = p.ck;
  return 0;
}

int kvt_tier_chunk_verify(kvt_tier *t, const char *key_hex, int repair,
                          uint64_t *removed_entries);

uint64_t kvti_tier_chunk_damaged(kvt_tier *t, const uint8_t key[32], int found,
                                 const char *why) {
  if (!t->chunked || t->readonly)
    return 0;
  kvti_chains *ch = chains_of(t);
  kvti_chunkstore *cs = kvti_chunked_store(t->chunked);
  char kh[65];
  kvti_hex32(kh, key);
  kvti_chain_rec *sub = NULL;
  size_t nsub = 0;
  uint8_t(*hs)[32] = NULL;
  size_t nh = 0;
  const char *fate = "already gone";
  /* The caller reports the damage it found: file-system failures met while
   * containing it are logged (fate), not left as this thread's error. */
  kvti_error_state es;
  kvti_error_state_capture(&es, 0);
  pthread_mutex_lock(&t->mut_mu);
  /* Still indexed and not handled yet (another reader may have been first;
   * eviction removes rows before files under this lock, so a row seen here
   * is not a chunk being evicted). */
  if (!kvti_chains_find(ch, key, NULL) || kvti_chains_is_damaged(ch, key)) {
    pthread_mutex_unlock(&t->mut_mu);
    return 0;
  }
  /* The file is reached without following links (store/local_chunks.h): a
   * chunks/ or chunks/<kk> that is a link leaves the file where it is
   * (nothing outside the cache is moved or removed), a chunk file that is a
   * link is moved as the link. */
  int present = kvti_local_chunk_present(cs, key, 0);
  if (found == KVT_ENOTFOUND && present == 1) {
    /* The file is back (written again meanwhile): nothing is wrong. */
    pthread_mutex_unlock(&t->mut_mu);
    kvti_error_state_restore(&es);
    return 0;
  }
  if (present == KVT_EPERM)
    fate = "left where it is (its directory is a link or not a directory: "
           "never followed)";
  kvt_clear_error();
  kvti_chains_set_damaged(ch, key, 1); /* no chain walks through it now */
  /* What depends on it: counted and kept, never removed. RAM copies built
   * through it go (they are checked against a chain no longer whole). */
  if (kvti_chains_subtree(ch, key, &sub, &nsub) == 0) {
    kvti_ram_invalidate_chunks(t, sub, nsub);
    kvti_chains_entries_ending(ch, sub, nsub, &hs, &nh);
  }
  if (present == 1) {
    kvti_chunk_qpolicy qp = {t->opts.quarantine_max, t->opts.dir_mode,
                             t->opts.durability == KVT_DURABILITY_FSYNC};
    size_t gone = 0;
    fate = kvti_local_chunk_quarantine(cs, key, &qp, &gone);
    if (gone)
      kvti_log(t, KVT_LOG_INFO,
               "kvtier: %zu oldest quarantined chunk(s) removed "
               "(quarantine_max %u)",
               gone, (unsigned)t->opts.quarantine_max);
  }
  KVTI_STAT_ADD(&t->stats, chunks_quarantined, 1);
  KVTI_STAT_ADD(&t->stats, entries_unservable, nh);
  KVTI_STAT_ADD(&t->stats, quarantined, 1);
  pthread_mutex_unlock(&t->mut_mu);
  kvti_error_state_restore(&es);
  kvti_log(t, KVT_LOG_WARN,
           "kvtier: chunk %.16s is damaged (%s): file %s; %zu chunks below it "
           "and %zu entries through it kept, unservable until a spill writes "
           "the chunk again",
           kh, why ? why : "", fate, nsub ? nsub - 1 : 0, nh);
  kvti_free(sub);
  kvti_free(hs);
  return nh;
}

typedef struct damaged_ctx {
  kvt_tier *t;
  size_t n;
} damaged_ctx;

/* A quarantine record's key: damaged again unless it is no longer indexed,
 * already marked, or its file was written back after the move. */
static int mark_damaged(void *ctx, const uint8_t key[32]) {
  damaged_ctx *dc = ctx;
  kvti_chains *ch = chains_of(dc->t);
  if (!kvti_chains_find(ch, key, NULL) || kvti_chains_is_damaged(ch, key))
    return 0;
  kvti_chunkstore *cs = kvti_chunked_store(dc->t->chunked);
  if (kvti_local_chunk_present(cs, key, 1) != 1 &&
      kvti_chains_set_damaged(ch, key, 1))
    dc->n++;
  kvt_clear_error();
  return 0;
}

size_t kvti_tier_chunks_load_damaged(kvt_tier *t) {
  if (!t->chunked)
    return 0;
  kvti_error_state es;
  kvti_error_state_capture(&es, 0);
  damaged_ctx dc = {t, 0};
  kvti_local_chunks_quarantined(kvti_chunked_store(t->chunked), mark_damaged,
                                &dc);
  kvti_error_state_restore(&es);
  if (dc.n)
    kvti_log(t, KVT_LOG_INFO,
             "kvtier: %zu chunk(s) quarantined earlier are still damaged: "
             "kept unservable until a spill writes them again",
             dc.n);
  return dc.n;
}

int kvt_tier_chunk_verify(kvt_tier *t, const char *key_hex, int repair,
                          uint64_t *removed_entries) {
  if (removed_entries)
    *removed_entries = 0;
  if (!t || !key_hex)
    return KVT_ERR(KVT_EINVAL, "kvt_tier_chunk_verify: NULL argument");
  uint8_t key[32];
  if (!kvti_is_hash_name(key_hex) || kvti_unhex32(key, key_hex) != 0)
    return KVT_ERR(KVT_EINVAL, "chunk key must be 64 lowercase hex digits");
  int rc = kvti_tier_enter(t);
  if (rc)
    return rc;
  kvti_chain_rec rec;
  if (!t->chunked || !kvti_chains_find(chains_of(t), key, &rec)) {
    kvti_tier_leave(t);
    return KVT_ERR(KVT_ENOTFOUND, "no chunk %.16s", key_hex);
  }
  kvti_chunkstore *cs = kvti_chunked_store(t->chunked);
  char path[4096];
  int fd = -1;
  kvti_chunk_hdr h;
  memset(&h, 0, sizeof h);
  rc = kvti_chunkstore_path(cs, key, path, sizeof path);
  if (rc == 0)
    rc = kvti_chunkstore_open_chunk(cs, &rec, NULL, &fd, &h);
  if (rc == KVT_ENOTFOUND) {
    if (kvti_chains_find(chains_of(t), key, NULL))
      rc = KVT_ERR(KVT_ECORRUPT, "%s: chunk file missing", path);
    else
      rc = KVT_ERR(KVT_ENOTFOUND, "no chunk %.16s (evicted)", key_hex);
  }
  if (rc == 0) {
    kvti_ck pck;
    int prc = parent_ck(chains_of(t), &h, &pck, path);
    kvti_chain_rec want;
    if (prc == 0 &&
        (prc = kvti_chunk_rec_of(&want, &h, &pck, rec.disk_bytes, path)) == 0) {
      if (want.ck.lo != rec.ck.lo || want.ck.hi != rec.ck.hi)
        prc = KVT_ERR(KVT_ECORRUPT,
                      "%s: tokens differ from the row's lookup value", path);
      else if (want.pure != rec.pure)
        prc = KVT_ERR(KVT_ECORRUPT, "%s: layers differ from the row", path);
    } else if (prc == KVT_ENOTFOUND) {
      prc = 0; /* the parent went meanwhile (evicted): not this chunk's fault */
    }
    rc = prc ? prc : read_all(fd, &h, path);
    kvti_close(fd);
    kvti_chunk_hdr_free(&h);
  }
  if (rc == KVT_ECORRUPT && repair && !t->readonly) {
    /* The serving path's routine: the chunk alone moves; nothing that
     * depends on it is removed. */
    kvti_error_state es;
    kvti_error_state_capture(&es, rc);
    int gone = kvti_local_chunk_present(cs, key, 0) == 0;
    kvt_clear_error();
    uint64_t ne = kvti_tier_chunk_damaged(
        t, key, gone ? KVT_ENOTFOUND : KVT_ECORRUPT, es.msg);
    if (removed_entries)
      *removed_entries = ne;
    kvti_error_state_restore(&es);
  }
  kvti_tier_leave(t);
  return rc;
}

/* ---- cleaning chunks/ ---- */

typedef struct orphan {
  char rel[96]; /* chunks/kk/<hex>.kvc */
  uint8_t key[32];
  uint64_t index, size;
  kvti_chunk_hdr h; /* parsed and fully verified */
} orphan;

typedef struct gc_run {
  kvt_tier *t;
  int dry, locked; /* locked: the caller holds mut_mu */
  kvt_chunk_gc_fn fn;
  void *ctx;
  kvt_chunk_gc_result res;
  orphan *orph;
  size_t norph, cap;
  int stop; /* fn's nonzero value */
} gc_run;

static void gc_report(gc_run *g, const char *rel, int action, uint64_t bytes,
                      const char *detail) {
  switch (action) {
  case KVT_CHUNK_GC_TMP:
    g->res.tmp_removed++;
    g->res.bytes_freed += bytes;
    break;
  case KVT_CHUNK_GC_ADOPTED:
    g->res.adopted++;
    break;
  case KVT_CHUNK_GC_REMOVED:
    g->res.removed++;
    g->res.bytes_freed += bytes;
    break;
  default:
    g->res.stray++;
  }
  if (g->fn && !g->stop)
    g->stop = g->fn(g->ctx, rel, action, bytes, detail);
}

static void gc_unlink(gc_run *g, const char *rel) {
  if (g->dry)
    return;
  /* Relative to the cache's own descriptor: a chunks/ or chunks/<kk>
   * replaced by a link since the scan is refused, nothing outside removed. */
  kvti_chunkstore *cs = kvti_chunked_store(g->t->chunked);
  if (kvti_chunkstore_unlink_rel(cs, rel) != 0)
    kvti_log(g->t, KVT_LOG_WARN, "kvtier: gc of %s: %s", rel, kvt_last_error());
}

/* One name of a scan of chunks/<kk> (store/local_chunks.h): stale tmps and
 * damaged files removed, valid orphans queued, other names reported. */
static int gc_visit(void *ctx, kvti_chunk_scan_item *it) {
  gc_run *g = ctx;
  switch (it->kind) {
  case KVTI_SCAN_TMP:
    gc_report(g, it->rel, KVT_CHUNK_GC_TMP, it->size, it->why);
    gc_unlink(g, it->rel);
    break;
  case KVTI_SCAN_DAMAGED:
    gc_report(g, it->rel, KVT_CHUNK_GC_REMOVED, it->size, it->why);
    gc_unlink(g, it->rel);
    break;
  case KVTI_SCAN_ORPHAN: {
    if (KVTI_VEC_RESERVE(&g->orph, &g->cap, g->norph + 1, 16) != 0)
      return KVT_ENOMEM;
    orphan *o = &g->orph[g->norph++];
    memset(o, 0, sizeof *o);
    snprintf(o->rel, sizeof o->rel, "%.95s", it->rel);
    memcpy(o->key, it->key, 32);
    o->size = it->size;
    o->h = it->hdr; /* taken */
    memset(&it->hdr, 0, sizeof it->hdr);
    o->index = o->h.index;
    break;
  }
  default:
    gc_report(g, it->rel, KVT_CHUNK_GC_STRAY, it->size, it->why);
  }
  return g->stop;
}

/* Scans chunks/<kk> under mut_mu (unless the caller holds it or the run is
 * dry). */
static int gc_dir(gc_run *g, unsigned kk) {
  kvt_tier *t = g->t;
  if (!g->locked && !g->dry)
    pthread_mutex_lock(&t->mut_mu);
  int rc =
      kvti_local_chunks_scan(kvti_chunked_store(t->chunked), kk, gc_visit, g);
  if (!g->locked && !g->dry)
    pthread_mutex_unlock(&t->mut_mu);
  return rc == g->stop ? 0 : rc;
}

static int cmp_orphan(const void *a, const void *b) {
  const orphan *x = a, *y = b;
  return x->index < y->index ? -1 : x->index > y->index;
}

/* Adopts the queued orphans in chain order (a parent before its children):
 * under an indexed parent (or the seed) they get their row back, else they
 * are removed. In a dry run "indexed" includes the orphans adopted before. */
static int gc_orphans(gc_run *g) {
  kvt_tier *t = g->t;
  kvti_chains *ch = chains_of(t);
  if (g->norph > 1)
    qsort(g->orph, g->norph, sizeof *g->orph, cmp_orphan);
  int rc = 0;
  for (size_t i = 0; i < g->norph && rc == 0 && !g->stop; i++) {
    orphan *o = &g->orph[i];
    const kvti_chunk_hdr *h = &o->h;
    if (!g->locked && !g->dry)
      pthread_mutex_lock(&t->mut_mu);
    kvti_ck pck = {0, 0};
    int prc = kvti_chains_find(ch, o->key, NULL) ? 1 : 0; /* indexed since */
    if (prc == 0) {
      prc = parent_ck(ch, h, &pck, o->rel);
      /* Dry run: a parent adopted earlier in this run counts. */
      for (size_t j = 0; g->dry && prc == KVT_ENOTFOUND && j < i; j++)
        if (g->orph[j].h.n_tokens && !memcmp(g->orph[j].key, h->parent, 32) &&
            g->orph[j].index + 1 == h->index &&
            g->orph[j].h.layout_hash == h->layout_hash)
          prc = 0; /* its ck is not needed in a dry run */
    }
    if (prc == 1) {
      /* nothing to do */
    } else if (prc == 0) {
      kvti_chain_rec r;
      int prc2 = kvti_chunk_rec_of(&r, h, &pck, o->size, o->rel);
      if (prc2 == 0 && !g->dry)
        prc2 = kvti_chains_put(ch, &r, 1);
      if (prc2 == 0) {
        gc_report(g, o->rel, KVT_CHUNK_GC_ADOPTED, o->size,
                  "valid, parent stored");
      } else if (prc2 == KVT_ECORRUPT) { /* chunk 0 not under its seed */
        gc_report(g, o->rel, KVT_CHUNK_GC_REMOVED, o->size, kvt_last_error());
        gc_unlink(g, o->rel);
        kvti_chunk_hdr_free(&o->h);
        memset(&o->h, 0, sizeof o->h);
      } else {
        rc = prc2;
      }
    } else {
      if (prc == KVT_ENOMEM)
        rc = prc;
      else {
        gc_report(g, o->rel, KVT_CHUNK_GC_REMOVED, o->size,
                  prc == KVT_ENOTFOUND ? "parent chunk not stored (unreachable)"
                                       : kvt_last_error());
        gc_unlink(g, o->rel);
        kvti_chunk_hdr_free(&o->h); /* n_tokens 0: not a dry-run parent */
        memset(&o->h, 0, sizeof o->h);
      }
    }
    if (!g->locked && !g->dry)
      pthread_mutex_unlock(&t->mut_mu);
  }
  return rc;
}

static void gc_free(gc_run *g) {
  for (size_t i = 0; i < g->norph; i++)
    kvti_chunk_hdr_free(&g->orph[i].h);
  kvti_free(g->orph);
  g->orph = NULL;
  g->norph = g->cap = 0;
}

int kvt_tier_chunk_gc(kvt_tier *t, int dry_run, kvt_chunk_gc_fn fn,
                      kvt_chunk_progress_fn progress, void *ctx,
                      kvt_chunk_gc_result *res) {
  if (res)
    memset(res, 0, sizeof *res);
  if (!t)
    return KVT_ERR(KVT_EINVAL, "kvt_tier_chunk_gc: NULL tier");
  if (t->readonly && !dry_run)
    return KVT_ERR(KVT_EINVAL, "kvt_tier_chunk_gc: read-only tier");
  int rc = kvti_tier_enter(t);
  if (rc)
    return rc;
  gc_run g;
  memset(&g, 0, sizeof g);
  g.t = t;
  g.dry = dry_run != 0;
  g.fn = fn;
  g.ctx = ctx;
  /* A chunks/ that is a link (or no directory) is reported once and never
   * entered; its 256 subdirectories are not looked for through it. One that
   * cannot be opened otherwise (permission, I/O) fails the gc, its message
   * kept: nothing under it was looked at, so nothing may pass for clean. */
  int top =
      t->chunked
          ? kvti_chunkstore_open_subdir(kvti_chunked_store(t->chunked), 256)
          : KVT_ENOTFOUND;
  if (top >= 0)
    kvti_close(top);
  else if (top == KVT_EPERM && kvt_last_errno() != EACCES)
    gc_report(&g, KVTI_LOCAL_CHUNKS, KVT_CHUNK_GC_STRAY, 0, kvt_last_error());
  else if (top != KVT_ENOTFOUND)
    rc = top;
  if (top < 0 && rc == 0)
    kvt_clear_error();
  for (unsigned kk = 0; top >= 0 && kk < 256 && rc == 0 && !g.stop; kk++) {
    rc = gc_dir(&g, kk);
    if (progress)
      progress(ctx, kk + 1, 256);
  }
  if (rc == 0 && top >= 0 && !g.stop)
    rc = gc_orphans(&g);
  gc_free(&g);
  if (res)
    *res = g.res;
  kvti_tier_leave(t);
  return rc ? rc : g.stop;
}

/* Chained-entry records whose entry has neither a row nor files (a kill
 * between the record and the row): page of at most KVTI_CHUNK_SWEEP_ENTRIES
 * from *cursor, removed. mut_mu held, so no spill is between its record and
 * its row here. Returns how many went. */
static uint64_t sweep_dangling(kvt_tier *t, uint64_t *cursor) {
  kvti_chains *ch = chains_of(t);
  uint8_t(*hs)[32] = kvti_malloc(KVTI_CHUNK_SWEEP_ENTRIES * 32);
  if (!hs)
    return 0;
  size_t cur = (size_t)*cursor;
  size_t n = kvti_chains_entries_page(ch, &cur, KVTI_CHUNK_SWEEP_ENTRIES, hs);
  uint64_t gone = 0;
  for (size_t i = 0; i < n; i++) {
    char hex[65];
    kvti_hex32(hex, hs[i]);
    kvt_entry_info info;
    if (kvti_index_find_hash(&info, t->idx, hex) != KVT_ENOTFOUND ||
        t->be->ops->present(t->be, hex) != 0)
      continue; /* served, or files a reconcile may still adopt */
    if (kvti_chains_entry_del(ch, hs[i]) == 0) {
      gone++;
      kvti_log(t, KVT_LOG_INFO,
               "kvtier: chain record of %.16s removed: no entry row or files",
               hex);
    }
  }
  kvt_clear_error();
  /* A removal moves a later record into a visited slot; the next round
   * sees it. */
  *cursor = cur;
  kvti_free(hs);
  return gone;
}

void kvti_tier_chunks_sweep_lazy(kvt_tier *t) {
  /* The first chunked spill of a process sweeps, then every EVERY-th: a
   * process killed early still does its share. */
  if (!t->chunked || t->readonly ||
      t->chunk_sweep_calls++ % KVTI_CHUNK_SWEEP_EVERY != 0)
    return;
  kvti_error_state es;
  kvti_error_state_capture(&es, 0);
  kvti_chunkstore *cs = kvti_chunked_store(t->chunked);
  unsigned kk;
  uint64_t cursor;
  /* Where the last pass - of this process or an earlier one - stopped. */
  kvti_chunkstore_sweep_pos_get(cs, &kk, &cursor);
  gc_run g;
  memset(&g, 0, sizeof g);
  g.t = t;
  g.locked = 1;
  int rc = gc_dir(&g, kk);
  if (rc == 0)
    rc = gc_orphans(&g);
  gc_free(&g);
  uint64_t dangling = rc == 0 ? sweep_dangling(t, &cursor) : 0;
  t->chunk_sweep_next = (kk + 1) % 256;
  if (kvti_chunkstore_sweep_pos_set(cs, t->chunk_sweep_next, cursor) != 0)
    kvt_clear_error(); /* the next pass starts over: only slower */
  if (rc)
    kvti_log(t, KVT_LOG_WARN, "kvtier: sweep of chunks/%02x: %s", kk,
             kvt_last_error());
  else if (g.res.tmp_removed + g.res.adopted + g.res.removed + dangling)
    kvti_log(t, KVT_LOG_INFO,
             "kvtier: chunks/%02x: %llu stale tmp removed, %llu orphans "
             "adopted, %llu removed; %llu dangling chain records removed",
             kk, (unsigned long long)g.res.tmp_removed,
             (unsigned long long)g.res.adopted,
             (unsigned long long)g.res.removed, (unsigned long long)dangling);
  kvti_error_state_restore(&es);
}
