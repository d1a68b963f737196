/*
 * chunked_trim.c - trimmed reads of a chained entry for any kept length
 * (kvti_chunked_get_trim, chunked.h): the first keep tokens of an entry stored
 * as chain + tail. The chain's chunks covering [0, keep) are read straight into
 * destination tensors of keep rows (the caller's alloc, trimmed descriptions,
 * every chunk verified); when keep reaches past the chain, the tail entry -
 * small: rows past the last full chunk - is read whole into kvtier's own
 * buffers and its first keep - chain rows rows are copied in after the
 * chain's. Layers the chain does not hold (a trimmable layer of another token
 * extent) are trimmed from the tail copy. Every layer must be KV or quantized
 * KV and hold keep valid rows (offset), as for an entry stored whole: rotating
 * KV and arrays cannot be cut on the token axis (KVT_EUNSUPPORTED).
 */
#include "store/chunked.h"
#include "store/chunked_chain.h"

#include "format/dtype.h"
#include "base/error.h"
#include "base/hash.h"
#include "base/io.h"
#include "format/layer.h"
#include "index/chain_walk.h"

#include <string.h>

static uint64_t rows_of(const kvt_tensor *t) {
  return (uint64_t)t->shape[t->ndim - 2];
}

static int trimmable(const kvt_layer *l, uint32_t li, uint64_t keep) {
  if (l->kind != KVT_LAYER_KV && l->kind != KVT_LAYER_QUANTIZED_KV)
    return KVT_ERR(KVT_EUNSUPPORTED,
                   "trimmed read: layer %u cannot be cut on the token axis "
                   "(only KV and quantized KV layers can)",
                   li);
  if (l->offset != KVT_ABSENT && (uint64_t)l->offset < keep)
    return KVT_ERR(KVT_EINVAL,
                   "trimmed read: layer %u holds KV of %lld tokens (offset), "
                   "fewer than the %llu to keep",
                   li, (long long)l->offset, (unsigned long long)keep);
  return 0;
}

/* A layer of the tail not in the chain, cut to its first keep rows into new
 * buffers (the caller's alloc when given). */
static int cut_layer(kvt_layer *out, const kvt_layer *tl, uint32_t li,
                     uint64_t keep, const kvti_read_opts *o) {
  *out = *tl;
  out->orig_dtypes = NULL;
  out->tensors =
      kvti_calloc(tl->num_tensors ? tl->num_tensors : 1, sizeof *out->tensors);
  if (!out->tensors) {
    out->num_tensors = 0;
    return KVT_ERR_NOMEM();
  }
  for (uint32_t j = 0; j < tl->num_tensors; j++) {
    const kvt_tensor *s = &tl->tensors[j];
    kvt_tensor *d = &out->tensors[j];
    if (rows_of(s) < keep) {
      out->num_tensors = j;
      return KVT_ERR(KVT_EINVAL,
                     "trimmed read: layer %u tensor %u holds fewer than the "
                     "%llu tokens to keep",
                     li, j, (unsigned long long)keep);
    }
    kvti_tensor_cut_desc(d, s, keep);
    if (d->nbytes) {
      d->data = o->alloc ? o->alloc(o->alloc_ctx, li, j, d)
                         : kvti_buf_alloc((size_t)d->nbytes);
      if (!d->data) {
        out->num_tensors = j;
        return KVT_ERR(KVT_ENOMEM, "trimmed read: cannot allocate %llu bytes",
                       (unsigned long long)d->nbytes);
      }
    }
    kvti_tensor_copy_rows(d, 0, s, 0, keep);
  }
  out->offset = (int64_t)keep;
  return 0;
}

int kvti_chunked_get_trim(kvti_chunkstore *cs, kvti_backend *be,
                          kvt_entry **out, const char *hash,
                          const kvti_chained_entry *ce, const kvti_read_opts *o,
                          uint8_t bad_chunk[32], int *chunk_bad) {
  uint64_t keep = o->keep_tokens, rows = ce->chunks * ce->chunk_tokens;
  /* The tail, whole, in kvtier's buffers: its tokens are the entry's. */
  kvti_read_opts to = *o;
  to.keep_tokens = 0;
  to.alloc = NULL;
  to.free_buf = NULL;
  to.alloc_ctx = NULL;
  to.verify_only = 0;
  kvti_chain_mark mark;
  kvt_entry *tail = NULL;
  int rc = kvti_chunked_get_tail(be, &tail, hash, &to, rows, &mark);
  if (rc)
    return rc;
  if (mark.present == 1 && !kvti_chunked_mark_is(&mark, ce)) {
    /* The tail's manifest names its chain: read with that one. */
    kvt_entry_free(tail);
    kvti_chained_entry own = *ce;
    kvti_chunked_mark_row(&own, &mark);
    return kvti_chunked_get_trim(cs, be, out, hash, &own, o, bad_chunk,
                                 chunk_bad);
  }
  if (keep > tail->n_tokens) {
    size_t have = tail->n_tokens;
    kvt_entry_free(tail);
    return KVT_ERR(KVT_EINVAL, "trimmed read: %llu > the entry's %zu tokens",
                   (unsigned long long)keep, have);
  }
  /* The chain's chunks covering [0, keep). */
  size_t k = keep >= rows
                 ? (size_t)ce->chunks
                 : (size_t)((keep + ce->chunk_tokens - 1) / ce->chunk_tokens);
  kvti_chain_rec *recs = kvti_malloc((size_t)ce->chunks * sizeof *recs);
  size_t m = 0;
  /* The record names the chain exactly: walked up by parent links from its
   * last chunk (as the whole read, chunked.c); each chunk's tokens are
   * compared with the entry's when it is read. */
  rc = recs ? kvti_chains_path(kvti_chunkstore_chains(cs), ce->last_key,
                               (size_t)ce->chunks, recs)
            : KVT_ERR_NOMEM();
  if (rc == 0)
    m = (size_t)ce->chunks;
  if (rc == 0 && (recs[0].layout_hash != ce->layout_hash ||
                  recs[m - 1].n_tokens != ce->chunk_tokens ||
                  (uint64_t)m * ce->chunk_tokens > tail->n_tokens))
    rc = KVT_ERR(KVT_ENOTFOUND,
                 "chained entry %.16s: chain incomplete "
                 "(evicted)",
                 hash);
  /* The trimmed read keeps the promote's O_DIRECT choice like any other. */
  kvti_chunk_read_opts ro = kvti_chunked_read_opts(o, keep);
  kvti_chunk_prefix p;
  memset(&p, 0, sizeof p);
  if (rc == 0)
    rc = kvti_chunked_read_chain(cs, recs, k, tail->tokens, &ro, &p, bad_chunk,
                                 chunk_bad);
  kvti_free(recs);
  /* The result: chained layers from p (tail rows appended), others cut. */
  kvt_entry *e = NULL;
  uint8_t *from_chain = NULL;
  uint32_t L = tail->num_layers;
  if (rc == 0) {
    e = kvti_entry_new();
    from_chain = kvti_calloc(L ? L : 1, 1);
    if (!e || !from_chain ||
        !(e->layers = kvti_calloc(L ? L : 1, sizeof *e->layers)) ||
        !(e->tokens = kvti_malloc((size_t)(keep ? keep : 1) * 4)))
      rc = KVT_ERR_NOMEM();
  }
  if (rc == 0) {
    e->num_layers = L;
    e->free_buf =
        o->alloc ? (o->free_buf ? o->free_buf : kvti_keep_caller_buf) : NULL;
    e->alloc_ctx = o->alloc ? o->alloc_ctx : NULL;
    for (uint32_t li = 0; rc == 0 && li < L; li++)
      rc = trimmable(&tail->layers[li], li, keep);
  }
  for (uint32_t q = 0; rc == 0 && q < p.n_layers; q++) {
    uint32_t li = p.layer_idx[q];
    if (li >= L || from_chain[li]) {
      rc = KVT_ERR(KVT_ECORRUPT, "chained entry: chain layer %u invalid", li);
      break;
    }
    kvt_layer *tl = &tail->layers[li], *pl = &p.layers[q];
    if (tl->kind != pl->kind || tl->num_tensors != pl->num_tensors) {
      rc = KVT_ERR(KVT_ECORRUPT, "chained entry: layer %u kind differs", li);
      break;
    }
    uint64_t more = keep > rows ? keep - rows : 0;
    for (uint32_t j = 0; rc == 0 && j < tl->num_tensors; j++) {
      const kvt_tensor *tt = &tl->tensors[j];
      if (tt->ndim != pl->tensors[j].ndim ||
          tt->dtype != pl->tensors[j].dtype || rows_of(tt) < more)
        rc = KVT_ERR(KVT_ECORRUPT,
                     "chained entry: layer %u tensor %u: tail and chain "
                     "disagree",
                     li, j);
      else
        kvti_tensor_copy_rows(&pl->tensors[j], rows, tt, 0, more);
    }
    if (rc)
      break;
    /* The tail layer's attributes are the spilled layer's, as for the whole
     * read (kvti_chunk_join) and the layers cut from the tail below; only
     * the offset becomes the rows kept. */
    kvti_layer_copy_attrs(pl, tl);
    pl->offset = (int64_t)keep;
    e->layers[li] = *pl;
    memset(pl, 0, sizeof *pl);
    from_chain[li] = 1;
  }
  for (uint32_t li = 0; rc == 0 && li < L; li++)
    if (!from_chain[li])
      rc = cut_layer(&e->layers[li], &tail->layers[li], li, keep, o);
  if (rc == 0) {
    memcpy(e->tokens, tail->tokens, (size_t)keep * 4);
    e->n_tokens = (size_t)keep;
    e->salt = tail->salt;
    rc = kvti_salt_hex(e->hash, &e->salt, e->tokens, (size_t)keep);
    e->storage_mode = tail->storage_mode;
    e->memory_bytes = (uint64_t)((double)tail->memory_bytes * (double)keep /
                                 (double)tail->n_tokens);
    e->disk_bytes = tail->disk_bytes + p.bytes_read;
  }
  kvti_chunk_prefix_free(&p, &ro); /* what was not moved into e */
  kvti_free(from_chain);
  kvt_entry_free(tail);
  if (rc) {
    kvt_entry_free(e); /* caller buffers go back through free_buf */
    return rc;
  }
  if (o->on_layer)
    for (uint32_t i = 0; i < e->num_layers; i++)
      o->on_layer(o->layer_ctx, i, &e->layers[i]);
  *out = e;
  return 0;
}
