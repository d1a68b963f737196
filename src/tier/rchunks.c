/*
 * rchunks.c - chunks shared between nodes through the remote tier
 * (rchunks.h; protocol in docs/REMOTE.md "Chunks"). Uploads run on the remote
 * thread from the spill's snapshot (so local+remote and remote-only modes
 * share them): each full chunk's chain key is computed, the chunks the store
 * lacks are sent (read from the local chunk store when present, else written
 * into a staging directory first, as the entry upload does), then the tail
 * with its chain record. Reads compute the chain's keys from the prompt, fetch
 * only the chunks not indexed locally, verify each one completely
 * (store/chunkstore_adopt.c) and adopt it under mut_mu, parents first; the
 * entry or prefix is then read by the local chunked read path, which verifies
 * everything again as it copies. A damaged remote chunk is deleted remotely
 * (and published); a missing one is a miss, never data.
 */
#include "store/local_layout.h"
#include "tier/rchunks.h"

#include "base/error.h"
#include "base/hash.h"
#include "base/io.h"
#include "store/chunked.h"
#include "store/chunkstore.h"
#include "tier/chunks.h"

#include <stdio.h>
#include <string.h>

static int usable(const kvt_tier *t, const kvti_backend *be) {
  return t->chunked && be && be->ops->chunk_get && be->ops->chunk_put &&
         be->ops->chunk_has && be->ops->chunk_lookup && be->ops->put_chained;
}

/* ---- uploads ---- */

int kvti_rchunks_upload(kvt_tier *t, kvti_backend *be, const kvti_snapshot *s,
                        const kvti_write_opts *wo, uint64_t *bytes,
                        int *handled) {
  *handled = 0;
  *bytes = 0;
  if (!usable(t, be))
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
  kvti_chunkstore *cs = kvti_chunked_store(t->chunked);
  kvti_chunk_src src = {.ns = ns,
                        .ns_len = ns_len,
                        .tokens = tokens,
                        .n = C,
                        .layers = layers,
                        .layer_ids = sp.ids,
                        .n_layers = sp.n_ids,
                        .spill_layers = L};
  int pure = sp.n_ids == L;
  for (uint32_t i = 0; pure && i < sp.n_ids; i++)
    pure = layers[sp.ids[i]].kind != KVT_LAYER_ROTATING_KV;
  uint8_t seed[32], parent[32];
  uint64_t layout = 0;
  src.parent = seed;
  rc = kvti_chunk_layout_hash(&layout, &src);
  if (rc == 0)
    rc = kvti_chunk_seed(seed, ns, ns_len, layout);
  /* Every chunk's key first, then one pipelined question for all of them
   * (one round trip, not one per chunk). */
  uint8_t(*keys)[32] = NULL;
  uint8_t *has = NULL;
  if (rc == 0 && (!(keys = kvti_malloc(sp.chunks * sizeof *keys)) ||
                  !(has = kvti_calloc(sp.chunks, 1))))
    rc = KVT_ERR_NOMEM();
  for (size_t i = 0; rc == 0 && i < sp.chunks; i++)
    rc = kvti_chunk_key(keys[i], i ? keys[i - 1] : seed, tokens + i * C, C);
  if (rc == 0)
    rc = be->ops->chunk_has(be, (const uint8_t(*)[32])keys, sp.chunks, 0, has);
  memcpy(parent, seed, 32);
  kvti_ck ck = kvti_ck_seed(ns, ns_len);
  char *stage = NULL;
  uint64_t sent = 0;
  for (size_t i = 0; rc == 0 && i < sp.chunks; i++) {
    const int32_t *tk = tokens + i * C;
    const uint8_t *key = keys[i];
    ck = kvti_ck_next(ck, tk, C);
    if (!has[i]) {
      src.parent = parent;
      src.index = i;
      src.tokens = tk;
      src.row0 = (uint64_t)i * C;
      char path[4200] = "", tmp[4200];
      char *buf = NULL;
      size_t len = 0;
      int lrc = KVT_ENOTFOUND;
      if (kvti_chains_find(kvti_chunkstore_chains(cs), key, NULL))
        lrc = kvti_chunkstore_read_bytes(cs, key, &buf, &len, (size_t)1 << 31);
      if (lrc != 0) { /* not local (remote-only mode, or evicted): write it */
        kvt_clear_error();
        char kh[65];
        kvti_hex32(kh, key);
        if (!stage && (rc = be->ops->stage(be, &stage)) != 0)
          break;
        rc = kvti_local_stage_chunk_paths(path, tmp, sizeof path, stage, kh);
        if (rc == 0)
          rc = kvti_chunk_write(path, tmp, &src, t->opts.file_mode, 0, NULL);
        if (rc == 0)
          rc = kvti_read_file(&buf, &len, path, (size_t)1 << 31);
        if (path[0])
          kvti_unlink(path);
      }
      if (rc == 0) {
        kvti_chain_rec rec;
        memset(&rec, 0, sizeof rec);
        memcpy(rec.key, key, 32);
        memcpy(rec.parent, parent, 32);
        rec.ck = ck;
        rec.layout_hash = layout;
        rec.index = i;
        rec.n_tokens = C;
        rec.pure = (uint8_t)pure;
        rec.mem_bytes = kvti_chunk_mem_bytes(&src);
        rec.disk_bytes = len;
        rc = be->ops->chunk_put(be, &rec, buf, len);
        sent += len;
      }
      kvti_free(buf);
    }
    memcpy(parent, key, 32);
  }
  kvti_free(keys);
  kvti_free(has);
  if (stage) {
    kvti_rmtree(stage);
    kvti_free(stage);
  }
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
    memcpy(ce.last_key, parent, 32);
    ce.layout_hash = layout;
    ce.total_rows = sp.T;
    uint64_t tb = 0;
    if (rc == 0)
      rc = be->ops->put_chained(be, &tb, tail, wo, &ce, seed);
    sent += tb;
  }
  kvti_snapshot_free(tail);
  kvti_chunk_split_free(&sp);
  *bytes = sent;
  return rc;
}

/* ---- fetching a chain ---- */

/* Makes chunks [0, nchunks) of the chain over tokens (layout) local: the
 * ones not indexed are fetched, verified and adopted in chain order.
 * *fetched += their bytes, *nfetched += their count. 0, KVT_ENOTFOUND (one
 * is gone remotely), KVT_ECORRUPT (damaged: deleted remotely), I/O
 * errors. */
static int fetch_chain(kvt_tier *t, kvti_backend *be, const int32_t *tokens,
                       uint64_t nchunks, uint64_t layout, uint64_t *fetched,
                       uint64_t *nfetched) {
  const uint32_t C = kvti_chunked_chunk_tokens(t->chunked);
  size_t ns_len;
  const uint8_t *ns = kvti_chunked_ns(t->chunked, &ns_len);
  kvti_chunkstore *cs = kvti_chunked_store(t->chunked);
  kvti_chains *ch = kvti_chunkstore_chains(cs);
  kvti_chunk_expect x;
  memset(&x, 0, sizeof x);
  x.ns = ns;
  x.ns_len = ns_len;
  x.n_tokens = C;
  x.layout_hash = layout;
  int rc = kvti_chunk_seed(x.parent, ns, ns_len, layout);
  kvti_ck ck = kvti_ck_seed(ns, ns_len);
  for (uint64_t i = 0; rc == 0 && i < nchunks; i++) {
    x.tokens = tokens + i * C;
    x.index = i;
    ck = kvti_ck_next(ck, x.tokens, C);
    x.ck = ck;
    if ((rc = kvti_chunk_key(x.key, x.parent, x.tokens, C)) != 0)
      break;
    if (!kvti_chains_find(ch, x.key, NULL)) {
      if (t->readonly) {
        rc = KVT_ERR(KVT_ENOTFOUND,
                     "remote chunks cannot be kept by a read-only tier");
        break;
      }
      void *buf = NULL;
      size_t len = 0;
      if ((rc = be->ops->chunk_get(be, x.key, &buf, &len)) != 0)
        break;
      kvti_chain_rec rec;
      rc = kvti_chunk_verify_bytes(buf, len, &x, &rec);
      if (rc == KVT_ECORRUPT) {
        kvti_error_state es;
        kvti_error_state_capture(&es, rc);
        be->ops->chunk_remove(be, x.key);
        kvti_error_state_restore(&es);
      }
      if (rc == 0) {
        pthread_mutex_lock(&t->mut_mu);
        rc = atomic_load(&t->state) == KVTI_OPEN
                 ? kvti_chunkstore_adopt(cs, buf, len, &rec)
                 : KVT_ERR(KVT_ECLOSED, "tier closing");
        pthread_mutex_unlock(&t->mut_mu);
        if (rc == KVT_EINVAL) /* its parent was evicted meanwhile */
          rc = KVT_ERR(KVT_ENOTFOUND, "chain cut while it was fetched");
      }
      if (rc == 0) {
        *fetched += len;
        (*nfetched)++;
      }
      kvti_free(buf);
    }
    memcpy(x.parent, x.key, 32);
  }
  return rc;
}

/* ---- lookups ---- */

int kvti_rchunks_lookup(kvt_tier *t, kvti_backend *be, kvt_entry_info *info,
                        const int32_t *tokens, size_t n, uint64_t min_len) {
  if (!usable(t, be))
    return KVT_ENOTFOUND;
  const uint32_t C = kvti_chunked_chunk_tokens(t->chunked);
  size_t max = n / C;
  if (max == 0 || (uint64_t)max * C < min_len)
    return KVT_ENOTFOUND;
  kvti_chain_rec *r = kvti_malloc(max * sizeof *r);
  if (!r)
    return KVT_ERR_NOMEM();
  size_t ns_len, m = 0;
  const uint8_t *ns = kvti_chunked_ns(t->chunked, &ns_len);
  int rc = be->ops->chunk_lookup(be, ns, ns_len, tokens, n, C, r, max, &m);
  if (rc == 0 && (m == 0 || !r[0].pure))
    m = 0;
  /* Confirm what a promote would fetch (the server may have evicted it):
   * the chain stops at the first chunk neither here nor there. */
  kvti_chains *ch = kvti_chunkstore_chains(kvti_chunked_store(t->chunked));
  uint8_t(*keys)[32] = m ? kvti_malloc(m * sizeof *keys) : NULL;
  size_t *at = m ? kvti_malloc(m * sizeof *at) : NULL;
  uint8_t *present = m ? kvti_malloc(m) : NULL;
  size_t nk = 0;
  if (m && (!keys || !at || !present))
    rc = KVT_ERR_NOMEM();
  for (size_t i = 0; rc == 0 && i < m; i++)
    if (!kvti_chains_find(ch, r[i].key, NULL)) {
      memcpy(keys[nk], r[i].key, 32);
      at[nk++] = i;
    }
  if (rc == 0 && nk)
    rc = be->ops->chunk_has(be, (const uint8_t(*)[32])keys, nk, 1, present);
  for (size_t j = 0; rc == 0 && j < nk; j++)
    if (!present[j]) {
      m = at[j];
      break;
    }
  kvti_free(keys);
  kvti_free(at);
  kvti_free(present);
  if (rc == 0 && (m == 0 || (uint64_t)m * C < min_len))
    rc = KVT_ERR(KVT_ENOTFOUND, "no remote chain");
  if (rc == 0) {
    memset(info, 0, sizeof *info);
    info->num_tokens = (uint64_t)m * C;
    info->memory_bytes = kvti_chunk_prefix_bytes(r, m);
    rc = kvt_token_hash(info->token_hash, tokens, (size_t)info->num_tokens);
    if (rc == 0)
      kvt_prefix_hash(info->prefix_hash, tokens, (size_t)info->num_tokens);
    info->created_at = info->accessed_at = kvti_now_wall();
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

/* A backend over a staging directory holding one fetched tail: the chunked
 * read path gets the tail through it as it gets a local one. */
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
  if (!usable(t, be) || !kvti_rchunks_entry_ok(t, m))
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
  uint64_t nf = 0;
  int rc =
      fetch_chain(t, be, ro->tokens, ce->chunks, ce->layout_hash, fetched, &nf);
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
  if (!usable(t, be) || !ro->tokens)
    return KVT_ERR(KVT_ENOTFOUND, "no remote entry %.16s", hash);
  const uint32_t C = kvti_chunked_chunk_tokens(t->chunked);
  size_t n = ro->n_tokens, k = n / C, m = 0;
  char h[65];
  if (n == 0 || n % C || kvt_token_hash(h, ro->tokens, n) != 0 ||
      strcmp(h, hash))
    return KVT_ERR(KVT_ENOTFOUND, "no remote entry %.16s", hash);
  kvti_chain_rec *r = kvti_malloc(k * sizeof *r);
  if (!r)
    return KVT_ERR_NOMEM();
  size_t ns_len;
  const uint8_t *ns = kvti_chunked_ns(t->chunked, &ns_len);
  int rc = be->ops->chunk_lookup(be, ns, ns_len, ro->tokens, n, C, r, k, &m);
  if (rc == 0 && (m != k || !r[0].pure))
    rc = KVT_ERR(KVT_ENOTFOUND, "no remote chain of %zu tokens", n);
  uint64_t nf = 0;
  if (rc == 0)
    rc = fetch_chain(t, be, ro->tokens, k, r[0].layout_hash, fetched, &nf);
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
  (void)t;
  const kvti_chained_entry *ce = &m->chain;
  if (!be->ops->chunk_get)
    return KVT_ERR(KVT_EUNSUPPORTED, "the remote store keeps no chunks");
  if (ce->chunks > n / ce->chunk_tokens)
    return KVT_ERR(KVT_ECORRUPT, "remote chain longer than its entry");
  /* The chain from the seed the entry records: any tier verifies it, whatever
   * its own model_id and chunk_tokens (the CLI's). */
  kvti_chunk_expect x;
  memset(&x, 0, sizeof x);
  x.n_tokens = ce->chunk_tokens;
  x.layout_hash = ce->layout_hash;
  memcpy(x.parent, m->chain_seed, 32);
  int rc = 0;
  for (uint64_t i = 0; rc == 0 && i < ce->chunks; i++) {
    x.tokens = tokens + i * ce->chunk_tokens;
    x.index = i;
    if ((rc = kvti_chunk_key(x.key, x.parent, x.tokens, ce->chunk_tokens)))
      break;
    void *buf = NULL;
    size_t len = 0;
    if ((rc = be->ops->chunk_get(be, x.key, &buf, &len)) == 0)
      rc = kvti_chunk_verify_bytes(buf, len, &x, NULL);
    kvti_free(buf);
    memcpy(x.parent, x.key, 32);
  }
  if (rc == 0 && memcmp(x.parent, ce->last_key, 32))
    rc = KVT_ERR(KVT_ECORRUPT, "remote chain does not end at its record's key");
  return rc;
}
