/*
 * layout_guard.c - entries of another model's layout are never served. The
 * real client names only a directory, so a tier cannot know its model; it
 * learns the layout from its own spills instead: the signature of a spill's
 * layers (layer count, each layer's class - attention KV or recurrent state
 * - and an attention layer's heads, head sizes and dtype: the model's
 * shape, whether the layer is spilled as KV, rotating or quantized KV) is
 * remembered (the first few distinct ones), and a promote or read whose
 * entry has none of them is a miss (counted in layout_misses), not a wrong
 * serve. A tier that has not spilled yet knows no layout and serves what its
 * namespace holds, as the reference does; a base model and its fine-tune
 * have one layout, so they need two directories or two model_ids
 * (docs/DESIGN.md "Namespaces"). Native mode only: compat stores a converted
 * form (bf16 upcast to F32) whose signature differs from the spilled one.
 */
#include "tier/tier.h"

#include "base/error.h"
#include "format/entry.h"

#include <stdio.h>
#include <xxhash.h>

/* The signature of n layers: XXH3-64 over the fields above; never 0 (0 is
 * "no layout known"). */
/* One KV tensor pair's shape as the model sees it: every dimension but the
 * token axis (-2), the last one in elements (a quantized tensor packs
 * 32 / bits of them per uint32 word), and the dtype of its values (a
 * quantized tensor's scales). */
static void put_kv(XXH3_state_t *s, const kvt_layer *l, uint32_t k,
                   uint32_t scales) {
  const kvt_tensor *te = &l->tensors[k];
  int64_t d[2 + KVT_MAX_DIMS] = {0};
  d[0] = scales < l->num_tensors ? l->tensors[scales].dtype : te->dtype;
  d[1] = te->ndim;
  for (uint32_t a = 0; a < te->ndim && a < KVT_MAX_DIMS; a++)
    d[2 + a] = a + 2 == te->ndim ? -1 : te->shape[a];
  if (te->ndim && scales < l->num_tensors && l->bits > 0)
    d[1 + te->ndim] = te->shape[te->ndim - 1] * 32 / l->bits;
  XXH3_64bits_update(s, d, sizeof d);
}

/* The signature of n layers - the model's, not the representation's: one
 * model spills its attention layers as KV, rotating KV or quantized KV
 * (vllm-mlx dequantizes some of its caches), so those kinds are one class
 * described by heads, head sizes and dtype; a recurrent-state layer
 * (arrays) by its class alone (it may hold an absent state). XXH3-64, never
 * 0 (0 is "no layout known"). */
static uint64_t layout_sig(const kvt_layer *layers, uint32_t n) {
  XXH3_state_t *s = XXH3_createState();
  if (!s)
    return 0;
  XXH3_64bits_reset(s);
  XXH3_64bits_update(s, &n, sizeof n);
  for (uint32_t i = 0; i < n; i++) {
    const kvt_layer *l = &layers[i];
    int32_t cls = l->kind == KVT_LAYER_ARRAYS ? 2 : 1;
    XXH3_64bits_update(s, &cls, sizeof cls);
    if (cls != 1)
      continue;
    int q = l->kind == KVT_LAYER_QUANTIZED_KV && l->num_tensors == 6;
    if (!q && l->num_tensors != 2)
      continue; /* malformed: nothing to describe (reads validated it) */
    put_kv(s, l, 0, q ? 1 : UINT32_MAX);
    put_kv(s, l, q ? 3 : 1, q ? 4 : UINT32_MAX);
  }
  uint64_t h = XXH3_64bits_digest(s);
  XXH3_freeState(s);
  return h ? h : 1;
}

void kvti_tier_layout_note(kvt_tier *t, const kvt_layer *layers, uint32_t n) {
  if (t->opts.storage_mode != KVT_STORAGE_NATIVE || !layers || n == 0)
    return;
  uint64_t sig = layout_sig(layers, n);
  if (!sig)
    return;
  /* Lock-free: slots only go from 0 to a signature; two spills racing for
   * one slot are settled by the compare-exchange (the loser tries the next).
   * A handle that spills more layouts than there are slots is not one
   * model's: the guard is then off (layout_full). */
  for (int i = 0; i < KVTI_LAYOUTS; i++) {
    uint_fast64_t cur =
        atomic_load_explicit(&t->layouts[i], memory_order_acquire);
    if (cur == sig)
      return;
    if (cur == 0) {
      uint_fast64_t zero = 0;
      if (atomic_compare_exchange_strong(&t->layouts[i], &zero, sig) ||
          zero == sig)
        return;
    }
  }
  atomic_store(&t->layout_full, 1);
}

int kvti_tier_layout_check(kvt_tier *t, kvt_entry **e) {
  if (!*e || atomic_load_explicit(&t->layout_full, memory_order_relaxed) ||
      atomic_load_explicit(&t->layouts[0], memory_order_acquire) == 0)
    return 0; /* nothing spilled yet (or not one model): nothing known */
  uint64_t got = layout_sig((*e)->layers, (*e)->num_layers);
  if (got == 0)
    return 0;
  for (int i = 0; i < KVTI_LAYOUTS; i++) {
    uint_fast64_t cur =
        atomic_load_explicit(&t->layouts[i], memory_order_acquire);
    if (cur == got)
      return 0;
    if (cur == 0)
      break;
  }
  char h[17];
  snprintf(h, sizeof h, "%.16s", (*e)->hash);
  kvt_entry_free(*e);
  *e = NULL;
  KVTI_STAT_ADD(&t->stats, layout_misses, 1);
  return KVT_ERR(KVT_ENOTFOUND,
                 "entry %s has a layout (layer count, heads, head sizes or "
                 "dtype) this tier never spilled: another model's, a miss",
                 h);
}
