/*
 * layer_rows.c - cutting a KV layer's tensors on the token axis (layer.h):
 * axis -2 holds the tokens (token i is row i) and every index of the axes
 * before it (batch x heads) holds its own run of rows, so a range of token
 * rows is one piece per outer index, never one contiguous block. Describing a
 * tensor cut to n rows and copying a range of rows between two tensors of the
 * same geometry (but for that axis) are the two steps every cut, split and
 * join of rows is made of; a chunk's tensor is described as a tensor too, so
 * the same copies move rows in and out of a chunk's data.
 */
#include "format/layer.h"

#include "format/chunk.h"

#include <string.h>

void kvti_tensor_cut_desc(kvt_tensor *d, const kvt_tensor *s, uint64_t n) {
  uint64_t outer, row;
  kvti_chunk_tensor_geom(s, &outer, &row);
  *d = *s;
  d->shape[d->ndim - 2] = (int64_t)n;
  d->nbytes = outer * n * row;
  d->data = NULL;
}

void kvti_tensor_of_chunk(kvt_tensor *v, const kvti_chunk_tensor *ct,
                          const void *data, uint64_t n) {
  memset(v, 0, sizeof *v);
  v->dtype = ct->dtype;
  v->ndim = ct->ndim;
  memcpy(v->shape, ct->shape, sizeof v->shape);
  v->shape[v->ndim - 2] = (int64_t)n;
  uint64_t outer, row;
  kvti_chunk_tensor_geom(v, &outer, &row);
  v->nbytes = outer * n * row;
  /* A view: the copies write through it only when it is their dst. */
  v->data = (uint8_t *)(uintptr_t)data + ct->off;
}

void kvti_tensor_copy_rows(kvt_tensor *dst, uint64_t at, const kvt_tensor *src,
                           uint64_t from, uint64_t n) {
  uint64_t outer, row;
  kvti_chunk_tensor_geom(src, &outer, &row);
  uint64_t dst_T = (uint64_t)dst->shape[dst->ndim - 2];
  uint64_t src_T = (uint64_t)src->shape[src->ndim - 2];
  for (uint64_t q = 0; q < outer && n && row; q++)
    memcpy((uint8_t *)dst->data + (q * dst_T + at) * row,
           (const uint8_t *)src->data + (q * src_T + from) * row, n * row);
}
