/*
 * chunked_rec.c - entries that are their chain alone (chunked_rec.h): the
 * eligibility rule, the read of such an entry from its chain (the pure-chain
 * prefix read, then the record's tokens, name and memory estimate).
 */
#include "store/chunked_rec.h"
#include "store/chunked_chain.h"

#include "base/error.h"
#include "base/hash.h"
#include "base/io.h"
#include "format/layer.h"
#include "index/chain_walk.h"

#include <string.h>
#include <unistd.h>

int kvti_chunked_rec_ok(const kvti_chunk_split *sp, const kvt_layer *layers,
                        uint32_t n_layers) {
  if (sp->chunks == 0 || sp->n_ids != n_layers || n_layers == 0 ||
      sp->rows != sp->T)
    return 0;
  for (uint32_t i = 0; i < n_layers; i++) {
    const kvt_layer *l = &layers[i];
    if (sp->ids[i] != i ||
        (l->kind != KVT_LAYER_KV && l->kind != KVT_LAYER_QUANTIZED_KV) ||
        l->offset < 0 || (uint64_t)l->offset != sp->T || l->orig_dtypes ||
        l->max_size != KVT_ABSENT || l->keep != KVT_ABSENT ||
        l->step != KVT_ABSENT || l->idx != KVT_ABSENT)
      return 0;
    if (l->kind == KVT_LAYER_KV && (l->bits != 0 || l->group_size != 0))
      return 0; /* what a chain's KV layer reads back with */
  }
  return 1;
}

int kvti_chunked_rec_get(kvti_chunkstore *cs, kvt_entry **out,
                         const kvti_chainrec *r, const kvti_read_opts *o,
                         uint8_t bad_chunk[32], int *chunk_bad) {
  *out = NULL;
  if (chunk_bad)
    *chunk_bad = 0;
  size_t k = (size_t)r->chunks, m = 0;
  kvti_chain_rec *recs = kvti_malloc(k * sizeof *recs);
  if (!recs)
    return KVT_ERR_NOMEM();
  /* The chain is walked up from the record's last key by parent links (no
   * namespace or salt needed); each chunk's tokens are compared with the
   * record's when it is opened. */
  int rc = kvti_chains_path(kvti_chunkstore_chains(cs), r->last_key, k, recs);
  if (rc == 0)
    m = k;
  char hex[65];
  kvti_hex32(hex, r->hash);
  if (rc == 0 && (recs[0].layout_hash != r->layout_hash || !recs[0].pure ||
                  recs[m - 1].n_tokens != r->chunk_tokens))
    rc = KVT_ERR(KVT_ENOTFOUND,
                 "chained entry %.16s: chain incomplete "
                 "(evicted)",
                 hex);
  kvti_chunk_read_opts ro = kvti_chunked_read_opts(o, r->total_rows);
  kvti_chunk_prefix p;
  if (rc == 0)
    rc = kvti_chunked_read_chain(cs, recs, m, r->tokens, &ro, &p, bad_chunk,
                                 chunk_bad);
  kvt_entry *e = NULL;
  if (rc == 0 && p.n_layers != r->num_layers) {
    kvti_chunk_prefix_free(&p, &ro);
    rc = KVT_ERR(KVT_ECORRUPT,
                 "chained entry %.16s: %u layers in the chain, "
                 "%u in the record",
                 hex, p.n_layers, r->num_layers);
  }
  if (rc == 0)
    rc = kvti_chunk_prefix_entry(&e, &p, r->tokens, r->total_rows, &ro);
  kvti_free(recs);
  if (rc)
    return rc;
  /* The entry's own tokens (the chain covers the first total_rows), name and
   * memory estimate are the record's. */
  if (r->n_tokens > r->total_rows) {
    int32_t *t = kvti_realloc(e->tokens, 4 * (size_t)r->n_tokens);
    if (!t) {
      kvt_entry_free(e);
      return KVT_ERR_NOMEM();
    }
    memcpy(t, r->tokens, 4 * (size_t)r->n_tokens);
    e->tokens = t;
    e->n_tokens = (size_t)r->n_tokens;
  }
  memcpy(e->hash, hex, sizeof hex);
  e->memory_bytes = r->memory_bytes;
  e->disk_bytes += kvti_chainrec_size(r->ns_len, r->n_tokens);
  *out = e;
  return 0;
}
