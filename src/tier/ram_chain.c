/*
 * ram_chain.c - the RAM tier's view of the chunked native store: the chain a
 * cached copy's rows come from, the check of a cached copy against the files
 * it replaces (chunk files for the chain's rows, the tail's files for the
 * rest: the same checks as the disk read), and an entry or prefix assembled
 * from cached chunks and tail, with the chunks RAM lacks read from their
 * files.
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
#include "store/chunked.h"
#include "store/chunkstore_verify.h"
#include "store/local.h"
#include "tier/tier.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include "tier/ram_int.h"

/* Rows the chain holds (every chunk has the chain's chunk_tokens rows). */
static uint64_t ch_rows(const ram_chain *ch) {
  return ch->m ? (uint64_t)ch->m * ch->recs[0].n_tokens : 0;
}

int kvti_ram_chain_of(kvt_tier *t, const char *hash, const int32_t *tokens,
                      size_t n, int prefix, const kvti_salt *salt,
                      ram_chain *out) {
  memset(out, 0, sizeof *out);
  if (!t->chunked)
    return prefix ? KVT_ERR(KVT_ENOTFOUND, "no chunked store") : 0;
  int rc;
  if (prefix) {
    /* The callers' hash is the name of tokens[0, n) under the salt (ram_read's
     * callers guarantee it). */
    rc = kvti_chunked_prefix_chain(t->chunked, salt, tokens, n, &out->recs,
                                   &out->m);
  } else {
    /* The chain a disk read of the entry would use (its record, else its
     * row): the chunked store resolves it. */
    kvti_chunked_chain cc;
    rc = kvti_chunked_entry_chain(t->chunked, hash, tokens, n, &cc);
    out->recs = cc.recs;
    out->m = cc.m;
    out->rec = cc.rec;
    if (rc == 0 && !cc.m)
      return 0; /* stored whole */
  }
  if (rc) {
    kvti_free(out->recs);
    memset(out, 0, sizeof *out);
    return rc;
  }
  if (out->rec.is_record &&
      (!out->recs[0].pure || ch_rows(out) != out->rec.rows)) {
    kvti_free(out->recs);
    memset(out, 0, sizeof *out);
    return KVT_ERR(KVT_ENOTFOUND, "chain record %.16s: chain replaced", hash);
  }
  for (size_t i = 0; i < out->m; i++)
    out->bytes += out->recs[i].disk_bytes;
  return 0;
}

/* Checks a cached copy as the disk read it replaces would check the bytes it
 * reads (see the file comment); sets the layers' attributes as that read
 * does. */
int kvti_ram_verify_with(kvt_tier *t, const char *hash, kvti_hc_item *it,
                         const kvti_read_opts *ro, int prefix,
                         const ram_chain *chp) {
  const ram_chain ch = *chp;
  int rc;
  if (!ch.recs) /* an entry stored whole */
    return kvti_backend_local_verify_mem(t->be, hash, it->layers, it->n_layers,
                                         ro);
  if (!it->has_chain || memcmp(it->chain, ch.recs[ch.m - 1].key, 32) != 0) {
    /* Not the chain these rows were cached from (another namespace's chain
     * over the same tokens, or a chain rebuilt since): never served, even if
     * the bytes matched. */
    return KVT_ERR(KVT_ENOTFOUND, "%.16s: cached from another chain", hash);
  }
  uint64_t *row0 = kvti_calloc(it->n_layers ? it->n_layers : 1, sizeof *row0);
  uint64_t rows = ch_rows(&ch);
  if (ch.rec.is_record && !ch.rec.tokens_match)
    rc = KVT_ERR(KVT_ENOTFOUND, "chain record %.16s: other tokens", hash);
  else if (ch.rec.is_record && ch.rec.layers != it->n_layers)
    rc = KVT_ERR(KVT_ECORRUPT,
                 "chain record %.16s: %u layers, the cached copy %u", hash,
                 ch.rec.layers, it->n_layers);
  else
    rc = row0 ? kvti_chunkstore_verify_mem(kvti_chunked_store(t->chunked),
                                           ch.recs, ch.m, ro->tokens,
                                           it->layers, it->n_layers, ro->cancel,
                                           ro->read_threads, row0)
              : KVT_ERR_NOMEM();
  if (rc == 0 && !prefix && !ch.rec.is_record) {
    /* The tail's files hold the rows past the chain and every other layer. */
    kvti_read_opts vo = *ro;
    vo.mem_row0 = row0;
    vo.tail_ok = 1; /* completed by the chain just checked */
    rc = kvti_backend_local_verify_mem(t->be, hash, it->layers, it->n_layers,
                                       &vo);
  } else if (rc == 0) {
    /* A pure prefix, or an entry that is its chain record: the chain is all
     * of it (no tail files to check); attributes as kvti_chunk_prefix_entry
     * sets them, which is what a record's read returns. */
    for (uint32_t i = 0; rc == 0 && i < it->n_layers; i++) {
      kvt_layer *l = &it->layers[i];
      if (row0[i] != rows || l->kind == KVT_LAYER_ROTATING_KV)
        rc = KVT_ERR(KVT_ECORRUPT, "prefix %.16s: layer %u not in its chain",
                     hash, i);
      for (uint32_t j = 0; rc == 0 && j < l->num_tensors; j++)
        if ((uint64_t)l->tensors[j].shape[l->tensors[j].ndim - 2] != rows)
          rc = KVT_ERR(KVT_ECORRUPT, "prefix %.16s: layer %u has extra rows",
                       hash, i);
      if (rc)
        break;
      l->offset = (int64_t)rows;
      l->max_size = l->keep = l->step = l->idx = KVT_ABSENT;
      kvti_free(l->orig_dtypes);
      l->orig_dtypes = NULL;
    }
  }
  kvti_free(row0);
  return rc;
}

/* Chunk rec (the prompt's tokens for it) read from its file, every block
 * verified as it lands (kvti_chunk_read_data), into a new chunk record. */
int kvti_ram_load_chunk(kvt_tier *t, const kvti_chain_rec *rec,
                        const int32_t *tokens, kvti_hc_chunk **out) {
  kvti_chunkstore *cs = kvti_chunked_store(t->chunked);
  int fd = -1;
  kvti_chunk_hdr h;
  int rc = kvti_chunkstore_open_chunk(cs, rec, tokens, &fd, &h);
  if (rc)
    return rc;
  kvti_hc_chunk *ch = kvti_calloc(1, sizeof *ch);
  if (!ch || !(ch->layers = kvti_calloc(h.n_layers ? h.n_layers : 1,
                                        sizeof *ch->layers))) {
    rc = KVT_ERR_NOMEM();
    goto out;
  }
  memcpy(ch->key, rec->key, 32);
  ch->n_tokens = h.n_tokens;
  ch->spill_layers = h.spill_layers;
  ch->n_layers = h.n_layers;
  for (uint32_t i = 0; rc == 0 && i < h.n_layers; i++) {
    kvti_chunk_layer *L = &ch->layers[i];
    *L = h.layers[i];
    L->tensors =
        kvti_malloc((L->num_tensors ? L->num_tensors : 1) * sizeof *L->tensors);
    if (!L->tensors) {
      L->num_tensors = 0;
      rc = KVT_ERR_NOMEM();
    } else {
      memcpy(L->tensors, h.layers[i].tensors,
             L->num_tensors * sizeof *L->tensors);
    }
  }
  ch->data_bytes = h.data_bytes;
  if (rc == 0 &&
      !(ch->data = kvti_malloc(h.data_bytes ? (size_t)h.data_bytes : 1)))
    rc = KVT_ERR_NOMEM();
  char path[4096];
  if (rc == 0 &&
      (rc = kvti_chunkstore_path(cs, rec->key, path, sizeof path)) == 0)
    rc = kvti_chunk_read_data(fd, &h, ch->data, path);
out:
  kvti_close(fd);
  kvti_chunk_hdr_free(&h);
  if (rc)
    kvti_hc_chunk_free(ch);
  else
    *out = ch;
  return rc;
}

/* Frees layers built by assemble (caller buffers through ro->free_buf). */
void kvti_ram_free_built(kvt_layer *ls, uint32_t n, const kvti_read_opts *ro) {
  for (uint32_t i = 0; ls && i < n; i++)
    kvti_layer_release(&ls[i], ro->alloc != NULL, ro->free_buf, ro->alloc_ctx);
  kvti_free(ls);
}

static void *new_buf(const kvti_read_opts *ro, uint32_t i, uint32_t j,
                     const kvt_tensor *d) {
  if (!d->nbytes)
    return NULL;
  return ro->alloc ? ro->alloc(ro->alloc_ctx, i, j, d)
                   : kvti_buf_alloc((size_t)d->nbytes);
}

/* The same geometry but for the token axis (and the same dtype). */
static int same_but_rows(const kvt_tensor *t, const kvti_chunk_tensor *ct) {
  if (t->dtype != ct->dtype || t->ndim != ct->ndim || t->ndim < 2)
    return 0;
  for (uint32_t d = 0; d < t->ndim; d++)
    if (d != t->ndim - 2 && t->shape[d] != ct->shape[d])
      return 0;
  return 1;
}

/* New layers (ro's alloc, else kvti_buf_alloc) holding the chain's rows from
 * chunks chs[0, m) followed by tail's rows, with tail's attributes and its
 * other layers copied - the entry a disk read returns - or, tail NULL, the
 * pure prefix of the chain alone (attributes set by the check that follows).
 * Nothing here is trusted: the result is checked against the files before
 * it is served. *bytes: tensor bytes allocated. Returns 0, KVT_ECORRUPT (the
 * pieces do not fit together), KVT_ENOTFOUND (a prefix of a chain that is
 * not pure), KVT_ENOMEM. */
int kvti_ram_assemble(const kvti_hc_item *tail, const kvti_hc_chunk *const *chs,
                      size_t m, const kvti_read_opts *ro, kvt_layer **out,
                      uint32_t *n_out, uint64_t *bytes) {
  const kvti_hc_chunk *c0 = chs[0];
  uint32_t C = c0->n_tokens;
  uint64_t rows = (uint64_t)m * C;
  *bytes = 0;
  for (size_t c = 1; c < m; c++)
    if (chs[c]->n_tokens != C || chs[c]->n_layers != c0->n_layers)
      return KVT_ERR(KVT_ECORRUPT, "cached chunks: layouts differ");
  if (!tail && c0->spill_layers != c0->n_layers)
    return KVT_ERR(KVT_ENOTFOUND, "cached chain: not pure");
  uint32_t n = tail ? tail->n_layers : c0->spill_layers;
  int32_t *which = kvti_malloc((n ? n : 1) * sizeof *which);
  kvt_layer *ls = kvti_calloc(n ? n : 1, sizeof *ls);
  int rc = which && ls ? 0 : KVT_ERR_NOMEM();
  for (uint32_t i = 0; rc == 0 && i < n; i++)
    which[i] = -1;
  for (uint32_t k = 0; rc == 0 && k < c0->n_layers; k++) {
    uint32_t li = c0->layers[k].layer_idx;
    if (li >= n || which[li] >= 0)
      rc = KVT_ERR(KVT_ECORRUPT, "cached chunk: layer %u out of place", li);
    else
      which[li] = (int32_t)k;
  }
  for (uint32_t i = 0; rc == 0 && i < n; i++) {
    kvt_layer *d = &ls[i];
    const kvt_layer *tl = tail ? &tail->layers[i] : NULL;
    const kvti_chunk_layer *L = which[i] >= 0 ? &c0->layers[which[i]] : NULL;
    if (!L && !tl) {
      rc = KVT_ERR(KVT_ECORRUPT, "cached chain: layer %u missing", i);
      break;
    }
    if (tl) {
      *d = *tl;
      d->tensors = NULL;
      d->orig_dtypes = NULL;
      d->num_tensors = 0;
    } else {
      kvt_layer_init(d, (kvt_layer_kind)L->kind);
      d->offset = (int64_t)rows;
      if (L->kind == KVT_LAYER_QUANTIZED_KV) {
        d->bits = L->bits;
        d->group_size = L->group_size;
      }
    }
    uint32_t nt = L ? L->num_tensors : tl->num_tensors;
    if (L && tl && (tl->num_tensors != nt || tl->kind != L->kind)) {
      rc = KVT_ERR(KVT_ECORRUPT, "cached tail: layer %u differs", i);
      break;
    }
    if (!(d->tensors = kvti_calloc(nt ? nt : 1, sizeof *d->tensors))) {
      rc = KVT_ERR_NOMEM();
      break;
    }
    d->num_tensors = nt;
    if (tl && tl->orig_dtypes) {
      if (!(d->orig_dtypes = kvti_malloc(nt * sizeof(int32_t)))) {
        rc = KVT_ERR_NOMEM();
        break;
      }
      memcpy(d->orig_dtypes, tl->orig_dtypes, nt * sizeof(int32_t));
    }
    for (uint32_t j = 0; rc == 0 && j < nt; j++) {
      kvt_tensor *dt = &d->tensors[j];
      const kvt_tensor *tt = tl ? &tl->tensors[j] : NULL;
      if (!L) { /* a layer the chain does not hold: the tail's, copied */
        *dt = *tt;
        dt->data = NULL;
        if (tt->nbytes && !(dt->data = new_buf(ro, i, j, dt))) {
          dt->nbytes = 0;
          rc = KVT_ERR(KVT_ENOMEM, "no buffer for layer %u tensor %u", i, j);
          break;
        }
        if (tt->nbytes)
          memcpy(dt->data, tt->data, (size_t)tt->nbytes);
        *bytes += tt->nbytes;
        continue;
      }
      const kvti_chunk_tensor *ct = &L->tensors[j];
      uint64_t tT = tt ? (uint64_t)tt->shape[tt->ndim - 2] : 0;
      if (tt && !same_but_rows(tt, ct)) {
        rc = KVT_ERR(KVT_ECORRUPT, "cached tail: layer %u tensor %u differs", i,
                     j);
        break;
      }
      dt->dtype = ct->dtype;
      dt->ndim = ct->ndim;
      memcpy(dt->shape, ct->shape, sizeof dt->shape);
      dt->shape[dt->ndim - 2] = (int64_t)(rows + tT);
      uint64_t nb;
      if (kvti_tensor_nbytes(&nb, (kvt_dtype)dt->dtype, dt->ndim, dt->shape) ||
          nb > SIZE_MAX / 2) {
        rc = KVT_ERR(KVT_ECORRUPT, "cached chain: layer %u tensor %u size", i,
                     j);
        break;
      }
      dt->nbytes = nb;
      if (nb && !(dt->data = new_buf(ro, i, j, dt))) {
        dt->nbytes = 0;
        rc = KVT_ERR(KVT_ENOMEM, "no buffer for layer %u tensor %u", i, j);
        break;
      }
      *bytes += nb;
      uint64_t outer, row;
      kvti_chunk_tensor_geom(dt, &outer, &row);
      for (size_t c = 0; rc == 0 && c < m; c++) {
        const kvti_chunk_tensor *cc = &chs[c]->layers[which[i]].tensors[j];
        if (chs[c]->layers[which[i]].layer_idx != i ||
            chs[c]->layers[which[i]].num_tensors != nt ||
            !same_but_rows(dt, cc) || cc->nbytes != outer * C * row ||
            cc->off + cc->nbytes > chs[c]->data_bytes) {
          rc =
              KVT_ERR(KVT_ECORRUPT, "cached chunk %zu: layer %u differs", c, i);
          break;
        }
        kvt_tensor s;
        kvti_tensor_of_chunk(&s, cc, chs[c]->data, C);
        kvti_tensor_copy_rows(dt, (uint64_t)c * C, &s, 0, C);
      }
      if (rc == 0 && tT)
        kvti_tensor_copy_rows(dt, rows, tt, 0, tT);
    }
  }
  kvti_free(which);
  if (rc) {
    kvti_ram_free_built(ls, n, ro);
    return rc;
  }
  *out = ls;
  *n_out = n;
  return 0;
}
