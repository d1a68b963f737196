/*
 * hybrid.c - spilling the state of a prefix (kvt_tier_spill_prefix): models
 * with layers that cannot be cut on the token axis (arrays/Mamba state,
 * rotating KV) get prefix hits only at lengths where their whole state was
 * stored, so an engine that captured those layers' state at token m (e.g. at
 * each chunk boundary during prefill) spills it as the entry of tokens[0, m)
 * together with its live KV layers, which may hold more rows: their first m
 * rows are cut out here and the entry is spilled as kvt_tier_spill would (in
 * chunked mode its KV rows are the chunks the longer spill shares, so only the
 * state and the record are written). Token i stays KV row i: a KV layer whose
 * offset is below m cannot give m rows and is refused.
 */
#include "tier/tier.h"

#include "base/error.h"
#include "base/io.h"
#include "format/dtype.h"
#include "format/layer.h"

#include <string.h>

/* rows [0, m) of a KV or quantized KV layer, in fresh buffers. */
static int cut(kvt_layer *out, const kvt_layer *l, uint64_t m) {
  *out = *l;
  out->tensors =
      kvti_calloc(l->num_tensors ? l->num_tensors : 1, sizeof *out->tensors);
  if (!out->tensors)
    return KVT_ERR_NOMEM();
  for (uint32_t j = 0; j < l->num_tensors; j++) {
    const kvt_tensor *s = &l->tensors[j];
    kvt_tensor *d = &out->tensors[j];
    *d = *s;
    d->data = NULL;
    uint64_t T = (uint64_t)s->shape[s->ndim - 2], outer = 1;
    for (uint32_t k = 0; k + 2 < s->ndim; k++)
      outer *= (uint64_t)s->shape[k];
    uint64_t row = outer && T ? s->nbytes / outer / T : 0;
    d->shape[d->ndim - 2] = (int64_t)m;
    d->nbytes = outer * m * row;
    if (d->nbytes && !(d->data = kvti_malloc((size_t)d->nbytes)))
      return KVT_ERR_NOMEM();
    for (uint64_t q = 0; q < outer && m && row; q++)
      memcpy((uint8_t *)d->data + q * m * row,
             (const uint8_t *)s->data + q * T * row, m * row);
  }
  out->offset = (int64_t)m;
  return 0;
}

static void free_cut(kvt_layer *l) {
  for (uint32_t j = 0; l->tensors && j < l->num_tensors; j++)
    kvti_free(l->tensors[j].data);
  kvti_free(l->tensors);
}

int kvt_tier_spill_prefix(kvt_tier *t, const int32_t *tokens, size_t n_keep,
                          const kvt_layer *layers, uint32_t n_layers,
                          uint64_t memory_bytes) {
  return kvt_tier_spill_prefix_ex(t, tokens, n_keep, layers, n_layers,
                                  memory_bytes, NULL);
}

/* admit: the cut spill goes through admission as any spill (the public
 * call); else it is queued as it is (admission already cut it). */
static int spill_prefix(kvt_tier *t, const int32_t *tokens, size_t n_keep,
                        const kvt_layer *layers, uint32_t n_layers,
                        uint64_t memory_bytes, const kvt_call_opts *co,
                        int admit) {
  if (!t || (!tokens && n_keep) || (!layers && n_layers))
    return KVT_ERR(KVT_EINVAL, "kvt_tier_spill_prefix: NULL argument");
  if (n_keep == 0 || n_layers > KVTI_MAX_LAYERS) {
    /* Counted like the spill's own refusals (kvt_tier_spill_ex below). */
    kvti_stats_refused(&t->stats, KVT_EINVAL);
    return n_keep == 0
               ? KVT_ERR(KVT_EINVAL, "kvt_tier_spill_prefix: n_keep is 0")
               : KVT_ERR(KVT_EINVAL, "kvt_tier_spill_prefix: too many layers");
  }
  kvt_layer *ls = kvti_calloc(n_layers ? n_layers : 1, sizeof *ls);
  uint8_t *own = kvti_calloc(n_layers ? n_layers : 1, 1);
  int rc = ls && own ? 0 : KVT_ERR_NOMEM();
  for (uint32_t i = 0; rc == 0 && i < n_layers; i++) {
    const kvt_layer *l = &layers[i];
    /* The same checks as a spill first: nothing is read from a bad layer. */
    if ((rc = kvti_layer_validate(l, i, 1)) != 0 ||
        (rc = kvti_layer_check_rows(l, i, 0, UINT64_MAX, KVT_EINVAL,
                                    "spill_prefix")) != 0)
      break;
    if (l->kind != KVT_LAYER_KV && l->kind != KVT_LAYER_QUANTIZED_KV) {
      ls[i] = *l; /* the state as of n_keep, as given */
      continue;
    }
    uint64_t valid = l->offset == KVT_ABSENT
                         ? (uint64_t)l->tensors[0].shape[l->tensors[0].ndim - 2]
                         : (uint64_t)l->offset;
    if (valid < n_keep) {
      rc = KVT_ERR(KVT_EINVAL,
                   "kvt_tier_spill_prefix: layer %u holds KV of %llu tokens, "
                   "fewer than the %zu to store",
                   i, (unsigned long long)valid, n_keep);
      break;
    }
    own[i] = 1;
    rc = cut(&ls[i], l, n_keep);
  }
  if (rc == 0 && admit)
    rc = kvt_tier_spill_ex(t, tokens, n_keep, ls, n_layers, memory_bytes, co);
  else if (rc == 0)
    rc = kvti_spill_enqueue(t, tokens, n_keep, ls, n_layers, memory_bytes, 1,
                            NULL, NULL, co);
  else /* the spill calls count their own */
    kvti_stats_refused(&t->stats, rc);
  for (uint32_t i = 0; ls && own && i < n_layers; i++)
    if (own[i])
      free_cut(&ls[i]);
  kvti_free(ls);
  kvti_free(own);
  return rc;
}

int kvt_tier_spill_prefix_ex(kvt_tier *t, const int32_t *tokens, size_t n_keep,
                             const kvt_layer *layers, uint32_t n_layers,
                             uint64_t memory_bytes, const kvt_call_opts *co) {
  return spill_prefix(t, tokens, n_keep, layers, n_layers, memory_bytes, co, 1);
}

int kvti_spill_prefix_noadmit(kvt_tier *t, const int32_t *tokens, size_t n_keep,
                              const kvt_layer *layers, uint32_t n_layers,
                              uint64_t memory_bytes, const kvt_call_opts *co) {
  return spill_prefix(t, tokens, n_keep, layers, n_layers, memory_bytes, co, 0);
}
