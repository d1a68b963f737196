/*
 * chunkstore_entry.c - entries over chains (chunkstore.h): cutting a spill into
 * the rows its chain stores and the tail an entry keeps
 * (kvti_chunk_split_make), and the reverse on promote: a tail entry completed
 * with its chain's prefix (kvti_chunk_join), or a prefix that no spill ended at
 * turned into an entry of its own (kvti_chunk_prefix_entry, pure chains only).
 * Token i is row i of every chunked layer; rows past a layer's offset (an
 * engine's preallocated room) stay in the tail, so a promote returns every
 * tensor bit for bit with its original shape.
 */
#include "store/chunkstore.h"

#include "base/error.h"
#include "base/hash.h"
#include "base/io.h"
#include "format/dtype.h"
#include "format/entry.h"
#include "format/layer.h"

#include <string.h>

static uint64_t tensor_T(const kvt_tensor *t) {
  return (uint64_t)t->shape[t->ndim - 2];
}

/* Valid rows of a cuttable layer: min(offset, T) (an absent offset on a
 * quantized layer means every row). */
static uint64_t layer_rows(const kvt_layer *l) {
  uint64_t T = tensor_T(&l->tensors[0]);
  for (uint32_t j = 1; j < l->num_tensors; j++)
    if (tensor_T(&l->tensors[j]) < T)
      T = tensor_T(&l->tensors[j]);
  if (l->offset != KVT_ABSENT && (uint64_t)l->offset < T)
    T = (uint64_t)l->offset;
  return T;
}

void kvti_chunk_split_free(kvti_chunk_split *sp) {
  if (!sp)
    return;
  for (uint32_t k = 0; sp->tail && k < sp->n_ids; k++) {
    kvt_layer *l = &sp->tail[sp->ids[k]];
    for (uint32_t j = 0; l->tensors && j < l->num_tensors; j++)
      kvti_buf_free(l->tensors[j].data);
    kvti_free(l->tensors);
  }
  kvti_free(sp->tail);
  kvti_free(sp->ids);
  memset(sp, 0, sizeof *sp);
}

int kvti_chunk_split_make(kvti_chunk_split *sp, const kvt_layer *layers,
                          uint32_t n_layers, size_t n_tokens, uint32_t C) {
  memset(sp, 0, sizeof *sp);
  sp->n_layers = n_layers;
  if (!(sp->tail = kvti_calloc(n_layers ? n_layers : 1, sizeof *sp->tail)) ||
      !(sp->ids = kvti_calloc(n_layers ? n_layers : 1, sizeof *sp->ids))) {
    kvti_chunk_split_free(sp);
    return KVT_ERR_NOMEM();
  }
  memcpy(sp->tail, layers, n_layers * sizeof *layers);
  uint64_t rows = n_tokens;
  for (uint32_t i = 0; i < n_layers; i++) {
    const kvt_layer *l = &layers[i];
    kvt_layer tmp = *l;
    /* kvti_chunk_layer_ok wants an offset: a quantized layer without one
     * holds every row. */
    if (tmp.offset == KVT_ABSENT && tmp.kind == KVT_LAYER_QUANTIZED_KV &&
        tmp.num_tensors)
      tmp.offset = (int64_t)tensor_T(&tmp.tensors[0]);
    if (!kvti_chunk_layer_ok(&tmp, C))
      continue;
    uint64_t T = tensor_T(&l->tensors[0]);
    int same = 1;
    for (uint32_t j = 1; j < l->num_tensors; j++)
      same &= tensor_T(&l->tensors[j]) == T;
    if (!same || (sp->n_ids && T != sp->T))
      continue;
    sp->T = T;
    sp->ids[sp->n_ids++] = i;
    uint64_t r = layer_rows(&tmp);
    if (r < rows)
      rows = r;
  }
  sp->rows = sp->n_ids ? rows / C * C : 0;
  sp->chunks = (size_t)(sp->rows / C);
  if (sp->chunks == 0) {
    sp->n_ids = 0;
    sp->rows = 0;
    return 0;
  }
  /* Tail copies: rows [rows, T) of every chunked tensor. */
  for (uint32_t k = 0; k < sp->n_ids; k++) {
    const kvt_layer *l = &layers[sp->ids[k]];
    kvt_layer *t = &sp->tail[sp->ids[k]];
    t->tensors = kvti_calloc(l->num_tensors, sizeof *t->tensors);
    if (!t->tensors) {
      t->num_tensors = 0;
      sp->n_ids = k;
      kvti_chunk_split_free(sp);
      return KVT_ERR_NOMEM();
    }
    for (uint32_t j = 0; j < l->num_tensors; j++) {
      const kvt_tensor *s = &l->tensors[j];
      kvt_tensor *d = &t->tensors[j];
      uint64_t keep = sp->T - sp->rows;
      kvti_tensor_cut_desc(d, s, keep);
      d->data = d->nbytes ? kvti_buf_alloc((size_t)d->nbytes) : NULL;
      if (d->nbytes && !d->data) {
        sp->n_ids = k + 1;
        kvti_chunk_split_free(sp);
        return KVT_ERR_NOMEM();
      }
      kvti_tensor_copy_rows(d, 0, s, sp->rows, keep);
    }
  }
  return 0;
}

/* Same geometry apart from the token axis. */
static int same_geom(const kvt_tensor *a, const kvt_tensor *b) {
  if (a->dtype != b->dtype || a->ndim != b->ndim || a->ndim < 2)
    return 0;
  for (uint32_t d = 0; d < a->ndim; d++)
    if (d != a->ndim - 2 && a->shape[d] != b->shape[d])
      return 0;
  return 1;
}

int kvti_chunk_join(struct kvt_entry *e, kvti_chunk_prefix *p, uint64_t rows,
                    const kvti_chunk_read_opts *o) {
  int rc = 0;
  for (uint32_t k = 0; rc == 0 && k < p->n_layers; k++) {
    uint32_t li = p->layer_idx[k];
    if (li >= e->num_layers) {
      rc = KVT_ERR(KVT_ECORRUPT, "chained entry: layer %u missing", li);
      break;
    }
    kvt_layer *tl = &e->layers[li], *pl = &p->layers[k];
    int kind_ok = tl->kind == pl->kind && tl->num_tensors == pl->num_tensors;
    if (!kind_ok) {
      rc = KVT_ERR(KVT_ECORRUPT, "chained entry: layer %u kind differs", li);
      break;
    }
    for (uint32_t j = 0; rc == 0 && j < tl->num_tensors; j++) {
      const kvt_tensor *tt = &tl->tensors[j];
      const kvt_tensor *pt = &pl->tensors[j];
      if (!same_geom(tt, pt) ||
          (uint64_t)pt->shape[pt->ndim - 2] != rows + tensor_T(tt))
        rc = KVT_ERR(KVT_ECORRUPT,
                     "chained entry: layer %u tensor %u: tail and chain "
                     "shapes disagree",
                     li, j);
    }
  }
  if (rc) {
    kvti_chunk_prefix_free(p, o);
    return rc;
  }
  for (uint32_t k = 0; k < p->n_layers; k++) {
    uint32_t li = p->layer_idx[k];
    kvt_layer *tl = &e->layers[li], *pl = &p->layers[k];
    /* The tail's rows follow the chain's (their shapes checked above). */
    for (uint32_t j = 0; j < tl->num_tensors; j++)
      kvti_tensor_copy_rows(&pl->tensors[j], rows, &tl->tensors[j], 0,
                            tensor_T(&tl->tensors[j]));
    /* The tail layer's attributes are the spilled layer's. */
    kvti_layer_copy_attrs(pl, tl);
    pl->orig_dtypes = tl->orig_dtypes;
    tl->orig_dtypes = NULL;
    kvti_layer_release(tl, e->free_buf != NULL, e->free_buf, e->alloc_ctx);
    *tl = *pl;
    memset(pl, 0, sizeof *pl);
  }
  p->n_layers = 0;
  kvti_chunk_prefix_free(p, o);
  return 0;
}

int kvti_chunk_prefix_entry(struct kvt_entry **out, kvti_chunk_prefix *p,
                            const int32_t *tokens, uint64_t rows,
                            const kvti_chunk_read_opts *o) {
  *out = NULL;
  int pure = p->n_layers == p->spill_layers;
  for (uint32_t k = 0; pure && k < p->n_layers; k++)
    pure = p->layer_idx[k] == k && p->layers[k].kind != KVT_LAYER_ROTATING_KV;
  if (!pure) {
    kvti_chunk_prefix_free(p, o);
    return KVT_ERR(KVT_ECORRUPT, "chain does not hold every layer");
  }
  kvt_entry *e = kvti_entry_new();
  int rc = e ? 0 : KVT_ENOMEM;
  if (rc == 0 &&
      !(e->tokens = kvti_malloc((size_t)(rows ? rows : 1) * sizeof *tokens)))
    rc = KVT_ERR_NOMEM();
  if (rc == 0)
    rc = kvt_token_hash(e->hash, tokens, (size_t)rows);
  if (rc) {
    kvt_entry_free(e);
    kvti_chunk_prefix_free(p, o);
    return rc;
  }
  memcpy(e->tokens, tokens, (size_t)rows * sizeof *tokens);
  e->n_tokens = (size_t)rows;
  e->num_layers = p->n_layers;
  e->layers = p->layers;
  e->storage_mode = KVT_STORAGE_NATIVE;
  e->disk_bytes = p->bytes_read;
  /* Caller buffers without a free_buf stay the caller's (never freed here). */
  e->free_buf = p->caller_alloc
                    ? (o->free_buf ? o->free_buf : kvti_keep_caller_buf)
                    : NULL;
  e->alloc_ctx = p->caller_alloc ? o->alloc_ctx : NULL;
  /* What the lookup offering this prefix reported (and a promote reserved):
   * the chunks' memory_bytes, a quantized layer counted dense. */
  e->memory_bytes = kvti_layers_dense_bytes(e->layers, e->num_layers);
  p->layers = NULL;
  p->n_layers = 0;
  kvti_chunk_prefix_free(p, o);
  *out = e;
  return 0;
}
