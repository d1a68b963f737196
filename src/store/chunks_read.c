/*
 * chunks_read.c - assembling a stored prefix from its chain of chunks
 * (kvti_chunkstore_read_prefix, chunks.h): the destination tensors are
 * described from chunk 0's header and all allocated first (the caller's
 * alloc, so a budget reserved before the read covers them), then each chunk
 * is opened, checked against its chain row and the prompt's tokens, read into
 * one scratch buffer with every block verified, and only then copied into
 * place: one extent per head and tensor (the chunk's rows are head-contiguous,
 * the destination's rows [i*C, (i+1)*C) of each head are contiguous too).
 * Nothing is handed out unless every chunk verified.
 */
#include "store/chunks.h"

#include "base/error.h"
#include "base/io.h"
#include "format/dtype.h"
#include "format/layer.h"

#include <string.h>
#include <unistd.h>

uint64_t kvti_chunk_prefix_bytes(const kvti_chain_rec *recs, size_t m) {
  uint64_t b = 0;
  for (size_t i = 0; i < m; i++)
    b += recs[i].mem_bytes;
  return b;
}

void kvti_chunk_prefix_free(kvti_chunk_prefix *p,
                            const kvti_chunk_read_opts *o) {
  if (!p)
    return;
  for (uint32_t i = 0; p->layers && i < p->n_layers; i++)
    kvti_layer_release(&p->layers[i], p->caller_alloc, o ? o->free_buf : NULL,
                       o ? o->alloc_ctx : NULL);
  kvti_free(p->layers);
  kvti_free(p->layer_idx);
  memset(p, 0, sizeof *p);
}

/* Describes and allocates the destination layers from chunk 0's header. */
static int make_layers(kvti_chunk_prefix *p, const kvti_chunk_hdr *h,
                       uint64_t rows, const kvti_chunk_read_opts *o) {
  p->n_layers = h->n_layers;
  p->spill_layers = h->spill_layers;
  p->caller_alloc = o->alloc != NULL;
  p->layers = kvti_calloc(h->n_layers, sizeof *p->layers);
  p->layer_idx = kvti_calloc(h->n_layers, sizeof *p->layer_idx);
  if (!p->layers || !p->layer_idx)
    return KVT_ERR_NOMEM();
  for (uint32_t i = 0; i < h->n_layers; i++) {
    const kvti_chunk_layer *L = &h->layers[i];
    kvt_layer *l = &p->layers[i];
    kvt_layer_init(l, (kvt_layer_kind)L->kind);
    p->layer_idx[i] = L->layer_idx;
    l->offset = (int64_t)rows;
    if (L->kind == KVT_LAYER_QUANTIZED_KV) {
      l->bits = L->bits;
      l->group_size = L->group_size;
    }
    if (!(l->tensors = kvti_calloc(L->num_tensors, sizeof *l->tensors)))
      return KVT_ERR_NOMEM();
    l->num_tensors = L->num_tensors;
    for (uint32_t j = 0; j < L->num_tensors; j++) {
      kvt_tensor *t = &l->tensors[j];
      t->dtype = L->tensors[j].dtype;
      t->ndim = L->tensors[j].ndim;
      memcpy(t->shape, L->tensors[j].shape, sizeof t->shape);
      t->shape[t->ndim - 2] = (int64_t)rows;
      uint64_t nb;
      if (kvti_tensor_nbytes(&nb, (kvt_dtype)t->dtype, t->ndim, t->shape) ||
          nb > SIZE_MAX / 2)
        return KVT_ERR(KVT_EINVAL, "chunked prefix: tensor too large");
      t->nbytes = nb;
      t->data = o->alloc ? o->alloc(o->alloc_ctx, L->layer_idx, j, t)
                         : kvti_buf_alloc((size_t)nb);
      if (!t->data && nb) {
        t->nbytes = 0; /* nothing to free */
        return o->alloc ? KVT_ERR(KVT_ENOMEM,
                                  "alloc callback refused %llu "
                                  "bytes",
                                  (unsigned long long)nb)
                        : KVT_ERR_NOMEM();
      }
    }
  }
  return 0;
}

/* Copies chunk i's rows (data, verified) into the destination, clipped to
 * the destination's rows (a trimmed read keeps only the first of them). */
static void place(kvti_chunk_prefix *p, const kvti_chunk_hdr *h,
                  const uint8_t *data, uint64_t row0) {
  for (uint32_t i = 0; i < h->n_layers; i++) {
    const kvti_chunk_layer *L = &h->layers[i];
    for (uint32_t j = 0; j < L->num_tensors; j++) {
      const kvti_chunk_tensor *ct = &L->tensors[j];
      kvt_tensor *t = &p->layers[i].tensors[j];
      /* The destination has the chunk's geometry but for the token axis. */
      uint64_t outer, row;
      kvti_chunk_tensor_geom(t, &outer, &row);
      uint64_t T = (uint64_t)t->shape[t->ndim - 2], n = h->n_tokens;
      uint64_t k = row0 >= T ? 0 : (T - row0 < n ? T - row0 : n);
      for (uint64_t o = 0; o < outer && row && k; o++)
        memcpy((uint8_t *)t->data + (o * T + row0) * row,
               data + ct->off + o * n * row, k * row);
    }
  }
}

int kvti_chunkstore_read_prefix(kvti_chunkstore *cs, const kvti_chain_rec *recs,
                                size_t m, const int32_t *tokens,
                                const kvti_chunk_read_opts *o,
                                kvti_chunk_prefix *out, size_t *bad_index) {
  if (!cs || !recs || m == 0 || !tokens || !o || !out)
    return KVT_ERR(KVT_EINVAL, "kvti_chunkstore_read_prefix: bad argument");
  memset(out, 0, sizeof *out);
  uint32_t C = recs[0].n_tokens;
  uint64_t rows = (uint64_t)m * C;
  if (o->total_rows && o->total_rows <= rows - C)
    return KVT_ERR(KVT_EINVAL, "chunked prefix: total_rows leaves a chunk "
                               "unused");
  if (o->total_rows)
    rows = o->total_rows;
  for (size_t i = 0; i < m; i++)
    if (recs[i].index != i || recs[i].n_tokens != C ||
        recs[i].layout_hash != recs[0].layout_hash ||
        (i && memcmp(recs[i].parent, recs[i - 1].key, 32)))
      return KVT_ERR(KVT_EINVAL, "chunked prefix: records are not a chain");
  kvti_chunk_prefix p;
  memset(&p, 0, sizeof p);
  uint8_t *scratch = NULL;
  size_t scap = 0;
  int rc = 0;
  for (size_t i = 0; rc == 0 && i < m; i++) {
    if (o->cancel && atomic_load(o->cancel)) {
      rc = KVT_ERR(KVT_ECANCELED, "promote cancelled");
      break;
    }
    int fd = -1;
    kvti_chunk_hdr h;
    rc = kvti_chunkstore_open_chunk(cs, &recs[i], tokens + i * C, &fd, &h);
    if (rc) {
      if (bad_index)
        *bad_index = i;
      break;
    }
    /* Buffers first (chunk 0 describes every layer; the others have the
     * same layout hash, so the same descriptor). */
    if (i == 0)
      rc = make_layers(&p, &h, rows, o);
    else if (h.n_layers != p.n_layers)
      rc = KVT_ERR(KVT_ECORRUPT, "chunk %zu: layer count differs", i);
    if (rc == 0 && h.data_bytes > scap) {
      kvti_free(scratch);
      scap = (size_t)h.data_bytes;
      if (!(scratch = kvti_aligned_alloc(4096, scap ? scap : 1))) {
        scap = 0;
        rc = KVT_ERR_NOMEM();
      }
    }
    if (rc == 0) {
      rc = kvti_chunk_read_data(fd, &h, scratch, "chunk");
      if (rc && bad_index)
        *bad_index = i;
    }
    if (rc == 0) {
      place(&p, &h, scratch, (uint64_t)i * C);
      p.bytes_read += h.header_bytes + h.data_bytes;
    }
    kvti_chunk_hdr_free(&h);
    kvti_close(fd);
  }
  kvti_free(scratch);
  if (rc) {
    kvti_chunk_prefix_free(&p, o);
    return rc;
  }
  *out = p;
  return 0;
}
