/*
 * rchunks.c - chunks shared between nodes through the remote tier
 * (rchunks.h; protocol in docs/REMOTE.md "Chunks"), over two chunk stores
 * behind one seam (store/chunk_backend.h): the local one and the remote
 * one. Every movement of chunks is one road, chain_copy: the chain's keys
 * are computed from its seed and the prompt, the destination is asked once
 * which it lacks, those are taken from the source, verified completely
 * (kvti_chunk_verify_bytes) and put into the destination, parents first. An
 * upload copies local -> remote on the remote thread (a chunk the local
 * store lacks - remote-only mode, or evicted - is written from the spill's
 * snapshot into a staging directory first, as the entry upload does), then
 * sends the tail with its chain record; a read copies remote -> local under
 * mut_mu and then serves through the local chunked read path, which
 * verifies everything again as it copies; a remote verify walks the remote
 * chain keeping nothing. A damaged chunk is dealt with by its own store's
 * rule (remote: deleted and published; local: the tier's quarantine); a
 * missing one is a miss, never data.
 */
#include "store/local_layout.h"
#include "tier/rchunks.h"

#include "base/error.h"
#include "base/hash.h"
#include "base/io.h"
#include "store/chunked.h"
#include "tier/chunks.h"

#include <stdio.h>
#include <string.h>

/* The remote store's chunks, when this tier shares chunks with it: both
 * stores have a chunk store (the local one's is there while chunking is
 * on). */
static kvti_chunk_backend *remote_chunks(const kvt_tier *t, kvti_backend *be) {
  kvti_chunk_backend *cb = kvti_backend_chunks(be);
  return t->chunked && kvti_backend_chunks(t->be) && cb && be->remote ? cb
                                                                      : NULL;
}

/* ---- the road: a chain copied between two chunk stores ---- */

/* A chain as its keys are computed: chunk i holds tokens[i*C, (i+1)*C),
 * its key continues its parent's (chunk 0's parent is seed). */
typedef struct chain_walk {
  const int32_t *tokens;
  uint64_t chunks;
  uint32_t C;
  const uint8_t *ns; /* NULL: not compared (the key chain binds it) */
  size_t ns_len;
  uint64_t layout; /* 0 = any */
  uint8_t seed[32];
} chain_walk;

/* Writes chunk i (parent its parent's key) when the source lacks it:
 * *bytes kvti_malloc'ed. */
typedef int (*chunk_make_fn)(void *ctx, uint64_t i, const uint8_t parent[32],
                             void **bytes, size_t *len);

typedef struct chain_copy {
  kvt_tier *t;
  kvti_chunk_backend *src;
  kvti_chunk_backend *dst; /* NULL: every chunk read and verified, none kept */
  int dst_local;           /* dst is the tier's own store: puts under mut_mu */
  int src_local;      /* a damaged source chunk goes to the tier's quarantine */
  int drop_damaged;   /* a damaged source chunk is dealt with (not: tools) */
  chunk_make_fn make; /* NULL: a chunk the source lacks is a miss */
  void *make_ctx;
  uint64_t bytes, copied; /* out: what was put into dst */
} chain_copy;

static void source_damaged(chain_copy *c, const uint8_t key[32]) {
  if (!c->drop_damaged)
    return;
  kvti_error_state es;
  kvti_error_state_capture(&es, KVT_ECORRUPT);
  if (c->src_local)
    kvti_tier_chunks_quarantine(c->t, key);
  else
    c->src->ops->remove(c->src, key);
  kvti_error_state_restore(&es);
}

static int put_dst(chain_copy *c, const kvti_chain_rec *rec, const void *buf,
                   size_t len) {
  if (!c->dst_local)
    return c->dst->ops->put(c->dst, rec, buf, len);
  kvt_tier *t = c->t;
  pthread_mutex_lock(&t->mut_mu);
  int rc = atomic_load(&t->state) == KVTI_OPEN
               ? c->dst->ops->put(c->dst, rec, buf, len)
               : KVT_ERR(KVT_ECLOSED, "tier closing");
  pthread_mutex_unlock(&t->mut_mu);
  if (rc == KVT_EINVAL) /* its parent was evicted meanwhile */
    rc = KVT_ERR(KVT_ENOTFOUND, "chain cut while it was copied");
  return rc;
}

/* One chunk the destination lacks: taken from the source (or made),
 * verified against x, put. */
static int copy_one(chain_copy *c, const kvti_chunk_expect *x) {
  if (c->dst_local && c->t->readonly)
    return KVT_ERR(KVT_ENOTFOUND,
                   "remote chunks cannot be kept by a read-only tier");
  void *buf = NULL;
  size_t len = 0;
  kvti_chain_rec rec;
  int rc = c->src ? c->src->ops->get(c->src, x->key, &buf, &len)
                  : KVT_ERR(KVT_ENOTFOUND, "no source");
  if (rc == 0 &&
      (rc = kvti_chunk_verify_bytes(buf, len, x, &rec)) == KVT_ECORRUPT)
    source_damaged(c, x->key);
  if (rc != 0 && c->make) { /* whatever kept the source's copy from us */
    kvt_clear_error();
    kvti_free(buf);
    buf = NULL;
    rc = c->make(c->make_ctx, x->index, x->parent, &buf, &len);
    if (rc == 0)
      rc = kvti_chunk_verify_bytes(buf, len, x, &rec);
  }
  if (rc == 0 && c->dst)
    rc = put_dst(c, &rec, buf, len);
  if (rc == 0 && c->dst) {
    c->bytes += len;
    c->copied++;
  }
  kvti_free(buf);
  return rc;
}

/* Copies the chunks of w that c->dst lacks, in chain order; last (may be
 * NULL) receives the chain's last key (the seed when it has no chunk). 0,
 * KVT_ENOTFOUND (one is gone from the source), KVT_ECORRUPT (damaged),
 * KVT_ENOMEM, I/O and connection errors. */
static int chain_copy_run(chain_copy *c, const chain_walk *w,
                          uint8_t last[32]) {
  size_t n = (size_t)w->chunks;
  uint8_t(*keys)[32] = n ? kvti_malloc(n * sizeof *keys) : NULL;
  uint8_t *present = n ? kvti_calloc(n, 1) : NULL;
  int rc = n && (!keys || !present) ? KVT_ERR_NOMEM() : 0;
  for (size_t i = 0; rc == 0 && i < n; i++)
    rc = kvti_chunk_key(keys[i], i ? keys[i - 1] : w->seed,
                        w->tokens + i * w->C, w->C);
  /* One question for the whole chain (one round trip, not one per chunk). */
  if (rc == 0 && n && c->dst)
    rc = c->dst->ops->has(c->dst, (const uint8_t(*)[32])keys, n, 0, present);
  kvti_chunk_expect x;
  memset(&x, 0, sizeof x);
  x.ns = w->ns;
  x.ns_len = w->ns_len;
  x.n_tokens = w->C;
  x.layout_hash = w->layout;
  memcpy(x.parent, w->seed, 32);
  kvti_ck ck = w->ns ? kvti_ck_seed(w->ns, w->ns_len) : (kvti_ck){0};
  for (size_t i = 0; rc == 0 && i < n; i++) {
    x.tokens = w->tokens + i * w->C;
    x.index = i;
    if (w->ns)
      ck = kvti_ck_next(ck, x.tokens, w->C);
    x.ck = ck;
    memcpy(x.key, keys[i], 32);
    if (!present[i])
      rc = copy_one(c, &x);
    memcpy(x.parent, keys[i], 32);
  }
  if (rc == 0 && last)
    memcpy(last, n ? keys[n - 1] : w->seed, 32);
  kvti_free(keys);
  kvti_free(present);
  return rc;
}

/* The walk of a chain in this tier's namespace, of layout. */
static int tier_walk(chain_walk *w, kvt_tier *t, const int32_t *tokens,
                     uint64_t chunks, uint64_t layout) {
  memset(w, 0, sizeof *w);
  w->tokens = tokens;
  w->chunks = chunks;
  w->C = kvti_chunked_chunk_tokens(t->chunked);
  w->ns = kvti_chunked_ns(t->chunked, &w->ns_len);
  w->layout = layout;
  return kvti_chunk_seed(w->seed, w->ns, w->ns_len, layout);
}

/* ---- uploads ---- */

/* A spill's chunks written on demand into a staging directory the remote
 * backend hands out (the chunks the local store lacks). */
typedef struct spill_maker {
  kvt_tier *t;
  kvti_backend *be;
  kvti_chunk_src src;
  char *stage;
} spill_maker;

static int make_from_spill(void *ctx, uint64_t i, const uint8_t parent[32],
                           void **bytes, size_t *len) {
  spill_maker *mk = ctx;
  const uint32_t C = (uint32_t)mk->src.n;
  kvti_chunk_src src = mk->src;
  src.parent = parent;
  src.index = i;
  src.tokens = mk->src.tokens + i * C;
  src.row0 = i * C;
  uint8_t key[32];
  char kh[65], path[4200] = "", tmp[4200];
  int rc = kvti_chunk_key(key, parent, src.tokens, C);
  if (rc == 0 && !mk->stage)
    rc = mk->be->remote->stage(mk->be, &mk->stage);
  if (rc == 0) {
    kvti_hex32(kh, key);
    rc = kvti_local_stage_chunk_paths(path, tmp, sizeof path, mk->stage, kh);
  }
  if (rc == 0)
    rc = kvti_chunk_write(path, tmp, &src, mk->t->opts.file_mode, 0, NULL);
  char *buf = NULL;
  if (rc == 0)
    rc = kvti_read_file(&buf, len, path, (size_t)1 << 31);
  if (path[0])
    kvti_unlink(path);
  *bytes = buf;
  return rc;
}

int kvti_rchunks_upload(kvt_tier *t, kvti_backend *be, const kvti_snapshot *s,
                        const kvti_write_opts *wo, uint64_t *bytes,
                        int *handled) {
  *handled = 0;
  *bytes = 0;
  kvti_chunk_backend *remote = remote_chunks(t, be);
  if (!remote)
    return 0;
  const uint32_t C = kvti_chunked_chunk_tokens(t->chunked);
  uint32_t L;
  const kvt_layer *layers = kvti_snapshot_layers(s, &L);
  size_t n;
  const int32_t *tokens = kvti_snapshot_tokens(s, &n);
  kvti_chunk_split sp;
  int rc = kvti_chunk_split_make(&sp, layers, L, n, C);
  if (rc)
    return rc;
  if (sp.chunks == 0) {
    kvti_chunk_split_free(&sp);
    return 0; /* nothing to chunk: put whole */
  }
  *handled = 1;
  size_t ns_len;
  const uint8_t *ns = kvti_chunked_ns(t->chunked, &ns_len);
  spill_maker mk = {.t = t,
                    .be = be,
                    .src = {.ns = ns,
                            .ns_len = ns_len,
                            .tokens = tokens,
                            .n = C,
                            .layers = layers,
                            .layer_ids = sp.ids,
                            .n_layers = sp.n_ids,
                            .spill_layers = L}};
  uint64_t layout = 0;
  uint8_t no_parent[32] = {0}; /* the layout does not depend on it */
  mk.src.parent = no_parent;
  rc = kvti_chunk_layout_hash(&layout, &mk.src);
  chain_walk w;
  memset(&w, 0, sizeof w);
  if (rc == 0)
    rc = tier_walk(&w, t, tokens, sp.chunks, layout);
  chain_copy cc = {.t = t,
                   .src = kvti_backend_chunks(t->be),
                   .dst = remote,
                   .src_local = 1,
                   .drop_damaged = 1,
                   .make = make_from_spill,
                   .make_ctx = &mk};
  uint8_t last[32];
  if (rc == 0)
    rc = chain_copy_run(&cc, &w, last);
  if (mk.stage) {
    kvti_rmtree(mk.stage);
    kvti_free(mk.stage);
  }
  uint64_t sent = cc.bytes;
  /* The tail, committed last: a reader finds its chain uploaded. */
  kvti_snapshot *tail = NULL;
  if (rc == 0)
    rc = kvti_snapshot_create(&tail, tokens, n, sp.tail, L,
                              kvti_snapshot_memory_bytes(s), 0, NULL, NULL);
  if (rc == 0) {
    kvti_chained_entry ce;
    memset(&ce, 0, sizeof ce);
    if (kvti_unhex32(ce.hash, kvti_snapshot_hash(s)) != 0)
      rc = KVT_ERR(KVT_EINVAL, "chunked upload: bad hash");
    ce.chunks = sp.chunks;
    ce.chunk_tokens = C;
    memcpy(ce.last_key, last, 32);
    ce.layout_hash = layout;
    ce.total_rows = sp.T;
    uint64_t tb = 0;
    if (rc == 0)
      rc = be->remote->put_chained(be, &tb, tail, wo, &ce, w.seed);
    sent += tb;
  }
  kvti_snapshot_free(tail);
  kvti_chunk_split_free(&sp);
  *bytes = sent;
  return rc;
}

/* ---- fetching a chain ---- */

/* Makes chunks [0, nchunks) of the chain over tokens (layout) local: the
 * ones the local store lacks are copied from the remote one. *fetched +=
 * their bytes. 0, KVT_ENOTFOUND (one is gone remotely), KVT_ECORRUPT
 * (damaged: deleted remotely), I/O errors. */
static int fetch_chain(kvt_tier *t, kvti_chunk_backend *remote,
                       const int32_t *tokens, uint64_t nchunks, uint64_t layout,
                       uint64_t *fetched) {
  chain_walk w;
  int rc = tier_walk(&w, t, tokens, nchunks, layout);
  chain_copy cc = {.t = t,
                   .src = remote,
                   .dst = kvti_backend_chunks(t->be),
                   .dst_local = 1,
                   .drop_damaged = 1};
  if (rc == 0)
    rc = chain_copy_run(&cc, &w, NULL);
  *fetched += cc.bytes;
  return rc;
}

/* ---- lookups ---- */

int kvti_rchunks_lookup(kvt_tier *t, kvti_backend *be, kvt_entry_info *info,
                        const int32_t *tokens, size_t n, uint64_t min_len) {
  kvti_chunk_backend *remote = remote_chunks(t, be);
  if (!remote)
    return KVT_ENOTFOUND;
  kvti_chunk_backend *local = kvti_backend_chunks(t->be);
  const uint32_t C = kvti_chunked_chunk_tokens(t->chunked);
  size_t max = n / C;
  if (max == 0 || (uint64_t)max * C < min_len)
    return KVT_ENOTFOUND;
  kvti_chain_rec *r = NULL;
  size_t ns_len, m = 0;
  const uint8_t *ns = kvti_chunked_ns(t->chunked, &ns_len);
  int rc = kvti_chunk_backend_pure(remote, ns, ns_len, tokens, n, C, &r, &m);
  /* Confirm what a promote would fetch (the server may have evicted it):
   * the chain stops at the first chunk neither here nor there. */
  uint8_t(*keys)[32] = m ? kvti_malloc(m * sizeof *keys) : NULL;
  size_t *at = m ? kvti_malloc(m * sizeof *at) : NULL;
  uint8_t *here = m ? kvti_malloc(m) : NULL;
  uint8_t *there = m ? kvti_malloc(m) : NULL;
  size_t nk = 0;
  if (m && (!keys || !at || !here || !there))
    rc = KVT_ERR_NOMEM();
  for (size_t i = 0; rc == 0 && i < m; i++)
    memcpy(keys[i], r[i].key, 32);
  if (rc == 0 && m)
    rc = local->ops->has(local, (const uint8_t(*)[32])keys, m, 1, here);
  for (size_t i = 0; rc == 0 && i < m; i++)
    if (!here[i]) {
      memcpy(keys[nk], r[i].key, 32);
      at[nk++] = i;
    }
  if (rc == 0 && nk)
    rc = remote->ops->has(remote, (const uint8_t(*)[32])keys, nk, 1, there);
  for (size_t j = 0; rc == 0 && j < nk; j++)
    if (!there[j]) {
      m = at[j];
      break;
    }
  kvti_free(keys);
  kvti_free(at);
  kvti_free(here);
  kvti_free(there);
  if (rc == 0 && (m == 0 || (uint64_t)m * C < min_len))
    rc = KVT_ERR(KVT_ENOTFOUND, "no remote chain");
  if (rc == 0) {
    memset(info, 0, sizeof *info);
    info->num_tokens = (uint64_t)m * C;
    info->memory_bytes = kvti_chunk_prefix_bytes(r, m);
    rc = kvt_token_hash(info->token_hash, tokens, (size_t)info->num_tokens);
    if (rc == 0)
      kvt_prefix_hash(info->prefix_hash, tokens, (size_t)info->num_tokens);
    /* A chain has no time of its own: the request's, on the tier's clock
     * (clock_fn's latest reading), as a local chain prefix is stamped. */
    info->created_at = info->accessed_at = kvti_tier_recency_now(t);
  }
  kvti_free(r);
  return rc;
}

int kvti_rchunks_entry_ok(kvt_tier *t, const kvti_backend_meta *m) {
  const kvti_chained_entry *ce = &m->chain;
  if (!t->chunked || ce->chunk_tokens != kvti_chunked_chunk_tokens(t->chunked))
    return 0;
  size_t ns_len;
  const uint8_t *ns = kvti_chunked_ns(t->chunked, &ns_len);
  uint8_t seed[32];
  return kvti_chunk_seed(seed, ns, ns_len, ce->layout_hash) == 0 &&
         memcmp(seed, m->chain_seed, 32) == 0;
}

/* ---- reads ---- */

/* A read-only shim over a staging directory holding one fetched tail, not a
 * store: the chunked read path gets the tail through its get as it gets a
 * local one. Only get is filled; the chunked read asks nothing else of a
 * backend that is not local (kvti_backend_is_local), and the shim never
 * leaves this file. */
typedef struct stage_be {
  kvti_backend base;
  const char *dir;
  uint64_t rows, total_rows;
  int tail_bad; /* the fetched tail (or its record) failed verification */
} stage_be;

static int stage_get(kvti_backend *b, kvt_entry **out, const char *hash,
                     const kvti_read_opts *o) {
  stage_be *sb = (stage_be *)b;
  int rc = kvti_entry_read(out, sb->dir, hash, o);
  if (rc == KVT_ECORRUPT)
    sb->tail_bad = 1;
  if (rc || !*out)
    return rc;
  /* The record came from the server: its token extent must be the chain's
   * rows plus what the (verified) tail holds, so it never sizes an
   * allocation beyond what was stored. */
  uint64_t most = 0;
  const kvt_entry *e = *out;
  for (uint32_t i = 0; i < e->num_layers; i++)
    for (uint32_t j = 0; j < e->layers[i].num_tensors; j++) {
      const kvt_tensor *tt = &e->layers[i].tensors[j];
      if (tt->ndim >= 2 && (uint64_t)tt->shape[tt->ndim - 2] > most)
        most = (uint64_t)tt->shape[tt->ndim - 2];
    }
  if (sb->total_rows < sb->rows || sb->total_rows > sb->rows + most) {
    sb->tail_bad = 1;
    kvt_entry_free(*out);
    *out = NULL;
    return KVT_ERR(KVT_ECORRUPT,
                   "remote entry %.16s: chain record disagrees with its tail",
                   hash);
  }
  return 0;
}

static const kvti_backend_ops stage_ops = {.name = "remote-stage",
                                           .get = stage_get};

int kvti_rchunks_read_chained(kvt_tier *t, kvti_backend *be, kvt_entry **out,
                              const char *stage, const kvti_backend_meta *m,
                              const kvti_read_opts *ro, uint64_t *fetched) {
  *fetched = 0;
  const kvti_chained_entry *ce = &m->chain;
  kvti_chunk_backend *remote = remote_chunks(t, be);
  if (!remote || !kvti_rchunks_entry_ok(t, m))
    return KVT_ERR(KVT_ENOTFOUND,
                   "remote entry %.16s is chunked (%u tokens per chunk); this "
                   "tier cannot read it",
                   m->hash, ce->chunk_tokens);
  char h[65];
  if (ce->chunks > m->num_tokens / ce->chunk_tokens || !ro->tokens ||
      ro->n_tokens != m->num_tokens ||
      kvt_token_hash(h, ro->tokens, ro->n_tokens) != 0 || strcmp(h, m->hash))
    return KVT_ERR(KVT_ENOTFOUND,
                   "remote entry %.16s: its chain needs the entry's tokens",
                   m->hash);
  int rc =
      fetch_chain(t, remote, ro->tokens, ce->chunks, ce->layout_hash, fetched);
  if (rc)
    return rc;
  stage_be sb = {
      {&stage_ops}, stage, ce->chunks * ce->chunk_tokens, ce->total_rows, 0};
  uint8_t bad[32];
  int chunk_bad = 0;
  rc = kvti_chunked_get_record(t->chunked, &sb.base, out, m->hash, ce, ro, bad,
                               &chunk_bad);
  if (rc && chunk_bad) /* a local chunk: the local store's to quarantine */
    kvti_tier_chunks_quarantine(t, bad);
  if (rc == KVT_ECORRUPT && sb.tail_bad) {
    /* The remote tail is bad: delete it, as a damaged entry is. */
    kvti_error_state es;
    kvti_error_state_capture(&es, rc);
    be->ops->remove(be, m->hash);
    kvti_error_state_restore(&es);
  }
  return rc;
}

int kvti_rchunks_read_prefix(kvt_tier *t, kvti_backend *be, kvt_entry **out,
                             const char *hash, const kvti_read_opts *ro,
                             uint64_t *fetched) {
  *fetched = 0;
  kvti_chunk_backend *remote = remote_chunks(t, be);
  if (!remote || !ro->tokens)
    return KVT_ERR(KVT_ENOTFOUND, "no remote entry %.16s", hash);
  const uint32_t C = kvti_chunked_chunk_tokens(t->chunked);
  size_t n = ro->n_tokens, k = n / C, m = 0;
  char h[65];
  if (n == 0 || n % C || kvt_token_hash(h, ro->tokens, n) != 0 ||
      strcmp(h, hash))
    return KVT_ERR(KVT_ENOTFOUND, "no remote entry %.16s", hash);
  kvti_chain_rec *r = NULL;
  size_t ns_len;
  const uint8_t *ns = kvti_chunked_ns(t->chunked, &ns_len);
  int rc =
      kvti_chunk_backend_pure(remote, ns, ns_len, ro->tokens, n, C, &r, &m);
  if (rc == 0 && m != k)
    rc = KVT_ERR(KVT_ENOTFOUND, "no remote chain of %zu tokens", n);
  if (rc == 0)
    rc = fetch_chain(t, remote, ro->tokens, k, r[0].layout_hash, fetched);
  kvti_free(r);
  if (rc)
    return rc;
  kvti_stripe_rdlock(&t->stripes, hash);
  rc = kvti_tier_chunks_get_prefix(t, out, hash, ro);
  kvti_stripe_unlock(&t->stripes, hash);
  if (rc)
    kvti_tier_chunks_after_read(t);
  return rc;
}

int kvti_rchunks_verify(kvt_tier *t, kvti_backend *be, const int32_t *tokens,
                        size_t n, const kvti_backend_meta *m) {
  const kvti_chained_entry *ce = &m->chain;
  kvti_chunk_backend *remote = kvti_backend_chunks(be);
  if (!remote)
    return KVT_ERR(KVT_EUNSUPPORTED, "the remote store keeps no chunks");
  if (ce->chunks > n / ce->chunk_tokens)
    return KVT_ERR(KVT_ECORRUPT, "remote chain longer than its entry");
  /* The chain from the seed the entry records: any tier verifies it, whatever
   * its own model_id and chunk_tokens (the CLI's). Every chunk is read and
   * verified, nothing kept, nothing deleted (a tool's look). */
  chain_walk w;
  memset(&w, 0, sizeof w);
  w.tokens = tokens;
  w.chunks = ce->chunks;
  w.C = ce->chunk_tokens;
  w.layout = ce->layout_hash;
  memcpy(w.seed, m->chain_seed, 32);
  chain_copy cc = {.t = t, .src = remote};
  uint8_t last[32];
  int rc = chain_copy_run(&cc, &w, last);
  if (rc == 0 && memcmp(last, ce->last_key, 32))
    rc = KVT_ERR(KVT_ECORRUPT, "remote chain does not end at its record's key");
  return rc;
}
