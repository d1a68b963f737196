/*
 * chunkstore_verify.c - a cached copy of a chain's rows checked against the
 * chunk files (chunkstore_verify.h): the host RAM tier's equivalent of
 * kvti_chunkstore_read_prefix. Each chunk is opened through
 * kvti_chunkstore_open_chunk (key, layout, chain row, tokens checked), the
 * cached tensors must have the chunk's geometry but for the token axis, and
 * the rows [i*C, (i+1)*C) of every head of every chunked tensor are fed to
 * the block hasher in the chunk's data order - the inverse of the read's
 * place() - so every block of the file is verified over the cached bytes.
 */
#include "store/chunkstore_verify.h"

#include "base/error.h"
#include "base/hash.h"
#include "base/io.h"
#include "base/parfor.h"

#include <string.h>

/* Feeds chunk h's rows (row0 = its first) of the cached layers to bh in the
 * chunk's data order, checking the geometry on the way. */
static int feed_chunk(kvti_blkhash *bh, const kvti_chunk_hdr *h,
                      const kvt_layer *layers, uint32_t n_layers, uint64_t row0,
                      uint64_t *row0_out) {
  uint64_t pos = 0;
  for (uint32_t i = 0; i < h->n_layers; i++) {
    const kvti_chunk_layer *L = &h->layers[i];
    if (L->layer_idx >= n_layers)
      return KVT_ERR(KVT_ECORRUPT, "cached copy: layer %u missing",
                     L->layer_idx);
    const kvt_layer *l = &layers[L->layer_idx];
    if (l->kind != L->kind || l->num_tensors != L->num_tensors ||
        (L->kind == KVT_LAYER_QUANTIZED_KV &&
         (l->bits != L->bits || l->group_size != L->group_size)))
      return KVT_ERR(KVT_ECORRUPT, "cached copy: layer %u is not the chunk's",
                     L->layer_idx);
    if (row0_out)
      row0_out[L->layer_idx] = row0 + h->n_tokens;
    for (uint32_t j = 0; j < L->num_tensors; j++) {
      const kvti_chunk_tensor *ct = &L->tensors[j];
      const kvt_tensor *t = &l->tensors[j];
      if (t->dtype != ct->dtype || t->ndim != ct->ndim || t->ndim < 2)
        return KVT_ERR(KVT_ECORRUPT, "cached copy: layer %u tensor %u differs",
                       L->layer_idx, j);
      for (uint32_t d = 0; d < t->ndim; d++)
        if (d != t->ndim - 2 && t->shape[d] != ct->shape[d])
          return KVT_ERR(KVT_ECORRUPT,
                         "cached copy: layer %u tensor %u shape differs",
                         L->layer_idx, j);
      uint64_t outer, row, T = (uint64_t)t->shape[t->ndim - 2];
      kvti_chunk_tensor_geom(t, &outer, &row);
      /* Tensors tile the data section in order (kvti_chunk_parse). */
      if (ct->off != pos || T < row0 + h->n_tokens ||
          ct->nbytes != outer * h->n_tokens * row || (ct->nbytes && !t->data))
        return KVT_ERR(KVT_ECORRUPT,
                       "cached copy: layer %u tensor %u does not hold the "
                       "chunk's rows",
                       L->layer_idx, j);
      for (uint64_t o = 0; o < outer && row; o++) {
        int rc = kvti_blkhash_update(
            bh, (const uint8_t *)t->data + (o * T + row0) * row,
            (size_t)(h->n_tokens * row));
        if (rc)
          return rc;
      }
      pos += ct->nbytes;
    }
  }
  if (pos != h->data_bytes)
    return KVT_ERR(KVT_ECORRUPT, "cached copy: chunk data not covered");
  return 0;
}

/* Chunks are checked by up to `threads` threads at once (hashing is
 * CPU-bound), each taking the next chunk (kvti_parfor). */
typedef struct cv_job {
  kvti_chunkstore *cs;
  const kvti_chain_rec *recs;
  size_t m;
  const int32_t *tokens;
  const kvt_layer *layers;
  uint32_t n_layers;
  atomic_int *cancel;
  uint64_t *row0;
} cv_job;

static int check_chunk(void *ctx, size_t i) {
  cv_job *j = ctx;
  if (j->cancel && atomic_load(j->cancel))
    return KVT_ERR(KVT_ECANCELED, "verify cancelled");
  uint32_t C = j->recs[0].n_tokens;
  int fd = -1;
  kvti_chunk_hdr h;
  int rc = kvti_chunkstore_open_chunk(j->cs, &j->recs[i], j->tokens + i * C,
                                      &fd, &h);
  if (rc)
    return rc;
  kvti_close(fd); /* the header is all that is read */
  kvti_blkhash *bh = NULL;
  rc = kvti_blkhash_new(&bh, h.block_size, 0);
  if (rc == 0) {
    kvti_blkhash_expect(bh, h.blocks, (size_t)h.n_blocks, "cached chunk");
    rc = feed_chunk(bh, &h, j->layers, j->n_layers, (uint64_t)i * C,
                    i == j->m - 1 ? j->row0 : NULL);
    if (rc == 0)
      rc = kvti_blkhash_final(bh, NULL);
  }
  kvti_blkhash_free(bh);
  kvti_chunk_hdr_free(&h);
  return rc;
}

int kvti_chunkstore_verify_mem(kvti_chunkstore *cs, const kvti_chain_rec *recs,
                               size_t m, const int32_t *tokens,
                               const kvt_layer *layers, uint32_t n_layers,
                               atomic_int *cancel, unsigned threads,
                               uint64_t *row0) {
  if (!cs || !recs || m == 0 || !tokens || (n_layers && !layers))
    return KVT_ERR(KVT_EINVAL, "kvti_chunkstore_verify_mem: bad argument");
  if (row0)
    memset(row0, 0, n_layers * sizeof *row0);
  uint32_t C = recs[0].n_tokens;
  for (size_t i = 0; i < m; i++)
    if (recs[i].index != i || recs[i].n_tokens != C ||
        recs[i].layout_hash != recs[0].layout_hash ||
        (i && memcmp(recs[i].parent, recs[i - 1].key, 32)))
      return KVT_ERR(KVT_EINVAL, "chunk verify: records are not a chain");
  cv_job j = {cs, recs, m, tokens, layers, n_layers, cancel, row0};
  return kvti_parfor(threads ? threads : 2, m, check_chunk, &j);
}
