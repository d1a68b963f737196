/*
 * ram_cut.c - the RAM tier's cuts at chunk granularity: an entry's layers
 * (or a pure prefix's) over a chain of the chunked native store become the
 * records of the chunks RAM lacks (each in its chunk file's data order) and
 * the entry's tail (the rows past the chain and its other layers), either by
 * taking the rows out of buffers the cache owns or by copying them out of a
 * borrowed spill. Pure functions of the layers: no tier state, no locks.
 */
#include "tier/ramtier.h"
#include "base/error.h"
#include "base/hash.h"
#include "base/workq.h"
#include "base/io.h"
#include "format/dtype.h"
#include "format/entry.h"
#include "format/layer.h"
#include "tier/hostcache.h"
#include "tier/remote.h"
#include "index/chain_walk.h"
#include "store/chunked.h"
#include "store/local.h"
#include "tier/tier.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include "tier/ram_int.h"

void kvti_ram_release_layers(kvt_layer *ls, uint32_t n) {
  for (uint32_t i = 0; ls && i < n; i++)
    kvti_layer_release(&ls[i], 0, NULL, NULL);
  kvti_free(ls);
}

static _Thread_local uint64_t tl_cut_bytes;

uint64_t kvti_ram_thread_cut_bytes(void) {
  return tl_cut_bytes;
}

/* ---- chunk granularity --------------------------------------------------- */

/* Chunk i of a chain (its key) built from rows [i*C, (i+1)*C) of the chunked
 * layers ids[0, n_ids) of layers (tensors of one token extent, the split's
 * T), in the chunk file's data order. NULL when out of memory. */
static kvti_hc_chunk *chunk_from_rows(const kvt_layer *layers,
                                      const uint32_t *ids, uint32_t n_ids,
                                      uint32_t spill_layers, uint32_t C,
                                      size_t i, const uint8_t key[32]) {
  kvti_hc_chunk *ch = kvti_calloc(1, sizeof *ch);
  if (!ch)
    return NULL;
  memcpy(ch->key, key, 32);
  ch->n_tokens = C;
  ch->spill_layers = spill_layers;
  if (!(ch->layers = kvti_calloc(n_ids ? n_ids : 1, sizeof *ch->layers)))
    goto fail;
  ch->n_layers = n_ids;
  uint64_t pos = 0;
  for (uint32_t k = 0; k < n_ids; k++) {
    const kvt_layer *l = &layers[ids[k]];
    kvti_chunk_layer *L = &ch->layers[k];
    L->kind = l->kind;
    L->layer_idx = ids[k];
    if (l->kind == KVT_LAYER_QUANTIZED_KV) {
      L->bits = l->bits;
      L->group_size = l->group_size;
    }
    if (!(L->tensors = kvti_calloc(l->num_tensors ? l->num_tensors : 1,
                                   sizeof *L->tensors)))
      goto fail;
    L->num_tensors = l->num_tensors;
    for (uint32_t j = 0; j < l->num_tensors; j++) {
      const kvt_tensor *t = &l->tensors[j];
      kvti_chunk_tensor *ct = &L->tensors[j];
      uint64_t outer, row;
      kvti_chunk_tensor_geom(t, &outer, &row);
      ct->dtype = t->dtype;
      ct->ndim = t->ndim;
      memcpy(ct->shape, t->shape, sizeof ct->shape);
      ct->shape[t->ndim - 2] = C;
      ct->off = pos;
      ct->nbytes = outer * C * row;
      pos += ct->nbytes;
    }
  }
  ch->data_bytes = pos;
  if (!(ch->data = kvti_malloc(pos ? (size_t)pos : 1)))
    goto fail;
  for (uint32_t k = 0; k < n_ids; k++) {
    const kvt_layer *l = &layers[ids[k]];
    for (uint32_t j = 0; j < l->num_tensors; j++) {
      const kvt_tensor *t = &l->tensors[j];
      kvt_tensor d;
      kvti_tensor_of_chunk(&d, &ch->layers[k].tensors[j], ch->data, C);
      kvti_tensor_copy_rows(&d, 0, t, (uint64_t)i * C, C);
    }
  }
  return ch;
fail:
  kvti_hc_chunk_free(ch);
  return NULL;
}

/* Cuts the layers of an entry of n_tokens (owned, a read's layout:
 * kvti_buf_alloc'ed data; layers[0, n) and the array are consumed either
 * way) over chain recs[0, m) into its tail (*tail when tail is non-NULL:
 * the chunked layers' rows past the chain, copied, and every other layer,
 * moved) and copies of the chunks with have[i] == 0 (chs[i]; NULL for the
 * others). Returns 0, KVT_EINVAL (the layers do not cut into that chain:
 * nothing built), KVT_ENOMEM. */
/* A deep copy of s into d in a read's layout (kvti_buf_alloc'ed data). On
 * KVT_ENOMEM d holds what was copied (kvti_layer_release frees it). */
int kvti_ram_dup_layer(kvt_layer *d, const kvt_layer *s) {
  *d = *s;
  d->tensors = NULL;
  d->orig_dtypes = NULL;
  d->num_tensors = 0;
  if (s->orig_dtypes) {
    if (!(d->orig_dtypes = kvti_malloc((s->num_tensors ? s->num_tensors : 1) *
                                       sizeof(int32_t))))
      return KVT_ERR_NOMEM();
    memcpy(d->orig_dtypes, s->orig_dtypes, s->num_tensors * sizeof(int32_t));
  }
  if (!(d->tensors = kvti_calloc(s->num_tensors ? s->num_tensors : 1,
                                 sizeof *d->tensors)))
    return KVT_ERR_NOMEM();
  for (uint32_t j = 0; j < s->num_tensors; j++) {
    d->tensors[j] = s->tensors[j];
    d->tensors[j].data = NULL;
    d->num_tensors = j + 1;
    if (!s->tensors[j].nbytes)
      continue;
    if (!(d->tensors[j].data = kvti_buf_alloc((size_t)s->tensors[j].nbytes)))
      return KVT_ERR_NOMEM();
    memcpy(d->tensors[j].data, s->tensors[j].data,
           (size_t)s->tensors[j].nbytes);
    tl_cut_bytes += s->tensors[j].nbytes;
  }
  return 0;
}

/* Splits layers along their chain's chunks and makes the chunks RAM lacks
 * (have[i] set: already held), counting their bytes as cut on this thread.
 * chs[i] is NULL for a chunk held; on failure every made chunk is still in
 * chs for the caller to free. what names the entry in the error. */
static int split_chunks(kvti_chunk_split *sp, const kvt_layer *layers,
                        uint32_t n, size_t n_tokens, const kvti_chain_rec *recs,
                        size_t m, const uint8_t *have, kvti_hc_chunk **chs,
                        const char *what) {
  uint32_t C = recs[0].n_tokens;
  int rc = kvti_chunk_split_make(sp, layers, n, n_tokens, C);
  if (rc == 0 && sp->chunks != m)
    rc = KVT_ERR(KVT_EINVAL, "%s entry: %zu chunks, its chain %zu", what,
                 sp->chunks, m);
  for (size_t i = 0; i < m; i++)
    chs[i] = NULL;
  for (size_t i = 0; rc == 0 && i < m; i++)
    if (!(have && have[i]) &&
        !(chs[i] = chunk_from_rows(layers, sp->ids, sp->n_ids, n, C, i,
                                   recs[i].key)))
      rc = KVT_ERR_NOMEM();
    else if (chs[i])
      tl_cut_bytes += chs[i]->data_bytes;
  return rc;
}

int kvti_ram_cut(kvt_layer *layers, uint32_t n, size_t n_tokens,
                 const kvti_chain_rec *recs, size_t m, const uint8_t *have,
                 kvti_hc_item *tail, kvti_hc_chunk **chs) {
  kvti_chunk_split sp;
  int rc = split_chunks(&sp, layers, n, n_tokens, recs, m, have, chs, "cached");
  if (rc == 0 && tail) {
    /* sp.tail holds its own copies of the chunked layers' tail rows and
     * shallow copies of everything else: those move out of layers. */
    uint32_t k = 0;
    for (uint32_t i = 0; i < n; i++) {
      int chunked = k < sp.n_ids && sp.ids[k] == i;
      k += chunked;
      sp.tail[i].orig_dtypes = layers[i].orig_dtypes;
      layers[i].orig_dtypes = NULL;
      if (!chunked) {
        layers[i].tensors = NULL;
        layers[i].num_tensors = 0;
      }
    }
    memset(tail, 0, sizeof *tail);
    tail->layers = sp.tail;
    tail->n_layers = n;
    sp.tail = NULL;
  }
  if (rc)
    for (size_t i = 0; i < m; i++) {
      kvti_hc_chunk_free(chs[i]);
      chs[i] = NULL;
    }
  kvti_chunk_split_free(&sp);
  for (uint32_t i = 0; i < n; i++)
    kvti_layer_release(&layers[i], 0, NULL, NULL);
  kvti_free(layers);
  return rc;
}

int kvti_ram_cut_borrowed(const kvt_layer *layers, uint32_t n, size_t n_tokens,
                          const kvti_chain_rec *recs, size_t m,
                          const uint8_t *have, kvti_hc_item *tail,
                          kvti_hc_chunk **chs) {
  kvti_chunk_split sp;
  int rc =
      split_chunks(&sp, layers, n, n_tokens, recs, m, have, chs, "spilled");
  memset(tail, 0, sizeof *tail);
  if (rc == 0) {
    /* sp.tail's chunked layers own their tail rows; everything else in it
     * is the caller's: cleared first, so the item only ever owns its own
     * memory, then copied. */
    uint32_t k = 0;
    for (uint32_t i = 0; i < n; i++) {
      int chunked = k < sp.n_ids && sp.ids[k] == i;
      k += chunked;
      sp.tail[i].orig_dtypes = NULL;
      if (!chunked) {
        sp.tail[i].tensors = NULL;
        sp.tail[i].num_tensors = 0;
      } else {
        for (uint32_t j = 0; j < sp.tail[i].num_tensors; j++)
          tl_cut_bytes += sp.tail[i].tensors[j].nbytes;
      }
    }
    tail->layers = sp.tail;
    tail->n_layers = n;
    sp.tail = NULL;
    k = 0;
    for (uint32_t i = 0; rc == 0 && i < n; i++) {
      int chunked = k < sp.n_ids && sp.ids[k] == i;
      k += chunked;
      kvt_layer *d = &tail->layers[i];
      if (!chunked) {
        rc = kvti_ram_dup_layer(d, &layers[i]);
      } else if (layers[i].orig_dtypes) {
        uint32_t nt = layers[i].num_tensors;
        if (!(d->orig_dtypes = kvti_malloc((nt ? nt : 1) * sizeof(int32_t))))
          rc = KVT_ERR_NOMEM();
        else
          memcpy(d->orig_dtypes, layers[i].orig_dtypes, nt * sizeof(int32_t));
      }
    }
    if (rc)
      kvti_hc_item_free(tail);
  }
  if (rc)
    for (size_t i = 0; i < m; i++) {
      kvti_hc_chunk_free(chs[i]);
      chs[i] = NULL;
    }
  kvti_chunk_split_free(&sp);
  return rc;
}

/* A cut tail's record: the entry's figures, tagged with the chain's last
 * chunk. */
void kvti_ram_tail_meta(kvti_hc_item *tail, uint64_t memory_bytes,
                        uint64_t disk_bytes, int storage_mode,
                        const kvti_chain_rec *recs, size_t m) {
  tail->memory_bytes = memory_bytes;
  tail->disk_bytes = disk_bytes;
  tail->storage_mode = storage_mode;
  tail->has_chain = 1;
  memcpy(tail->chain, recs[m - 1].key, 32);
}
