/*
 * entry_testlib.c - the test entry's generators, release and comparer (see
 * entry_testlib.h).
 */
#include "entry_testlib.h"

#include <stdlib.h>
#include <string.h>

t_entry t_make(uint64_t seed, size_t n_tokens, uint32_t n_layers, int T,
               int D) {
  kvt_rng r = {seed};
  t_entry e;
  memset(&e, 0, sizeof e);
  e.n_tokens = n_tokens;
  e.tokens = calloc(n_tokens ? n_tokens : 1, sizeof(int32_t));
  for (size_t i = 0; i < n_tokens; i++)
    e.tokens[i] = (int32_t)(kvt_rng_next(&r) % 50000);
  e.n_layers = n_layers;
  e.layers = calloc(n_layers ? n_layers : 1, sizeof(kvt_layer));
  for (uint32_t l = 0; l < n_layers; l++) {
    kvt_layer *ly = &e.layers[l];
    kvt_layer_init(ly, KVT_LAYER_KV);
    ly->num_tensors = 2;
    ly->tensors = calloc(2, sizeof(kvt_tensor));
    ly->offset = T;
    for (int k = 0; k < 2; k++) {
      kvt_tensor *t = &ly->tensors[k];
      t->dtype = KVT_DTYPE_F32;
      t->ndim = 4;
      t->shape[0] = 1;
      t->shape[1] = 2;
      t->shape[2] = T;
      t->shape[3] = D;
      t->nbytes = (uint64_t)2 * T * D * 4;
      t->data = malloc(t->nbytes ? t->nbytes : 1);
      float *f = t->data;
      for (uint64_t i = 0; i < t->nbytes / 4; i++)
        f[i] = (float)(kvt_rng_next(&r) % 1000) / 7.0f;
    }
  }
  e.memory_bytes = (uint64_t)n_layers * 2 * 2 * T * D * 4;
  kvt_token_hash(e.hash, e.tokens, e.n_tokens);
  return e;
}

t_entry t_entry_alloc(kvt_rng *r, size_t n_tokens, uint32_t cap_layers) {
  t_entry e;
  memset(&e, 0, sizeof e);
  e.n_tokens = n_tokens;
  e.tokens = malloc((n_tokens ? n_tokens : 1) * sizeof(int32_t));
  for (size_t i = 0; i < n_tokens; i++)
    e.tokens[i] = (int32_t)(kvt_rng_next(r) % 60000);
  e.layers = calloc(cap_layers ? cap_layers : 1, sizeof(kvt_layer));
  e.memory_bytes = 777;
  kvt_token_hash(e.hash, e.tokens, e.n_tokens);
  return e;
}

t_entry r_make(uint64_t seed, size_t n_tokens, int quant) {
  kvt_rng r = {seed};
  t_entry e = t_entry_alloc(&r, n_tokens, 4);
  e.layers[e.n_layers++] = t_kv(&r, KVT_DTYPE_F16, 1, 2, 4, 8, 4);
  e.layers[e.n_layers++] = t_kv(&r, KVT_DTYPE_BF16, 1, 2, 4, 8, 3);
  kvt_dtype dts[2] = {KVT_DTYPE_F32, KVT_DTYPE_I32};
  e.layers[e.n_layers++] = t_arrays(&r, 2, dts);
  if (quant)
    e.layers[e.n_layers++] = t_quant(&r, 4, 32, KVT_DTYPE_BF16, 1, 2, 4, 64, 4);
  return e;
}

t_entry r_make_variant(const t_entry *base, uint64_t seed) {
  t_entry v = r_make(seed, base->n_tokens, base->n_layers > 3);
  memcpy(v.tokens, base->tokens, base->n_tokens * sizeof(int32_t));
  memcpy(v.hash, base->hash, sizeof v.hash);
  return v;
}

void t_set_prefix(t_entry *e, const t_entry *prefix) {
  size_t n = prefix->n_tokens < e->n_tokens ? prefix->n_tokens : e->n_tokens;
  memcpy(e->tokens, prefix->tokens, n * sizeof(int32_t));
  kvt_token_hash(e->hash, e->tokens, e->n_tokens);
}

void t_free(t_entry *e) {
  for (uint32_t l = 0; l < e->n_layers; l++)
    t_layer_free(&e->layers[l]);
  free(e->layers);
  free(e->tokens);
  memset(e, 0, sizeof *e);
}

int t_same(const kvt_entry *got, const t_entry *e) {
  size_t n = 0;
  const int32_t *tok = kvt_entry_tokens(got, &n);
  if (n != e->n_tokens || (n && memcmp(tok, e->tokens, n * 4) != 0))
    return 0;
  if (kvt_entry_num_layers(got) != e->n_layers)
    return 0;
  if (kvt_entry_memory_bytes(got) != e->memory_bytes)
    return 0;
  for (uint32_t i = 0; i < e->n_layers; i++) {
    const kvt_layer *a = kvt_entry_layer(got, i);
    if (!a || !t_layer_eq(a, &e->layers[i]))
      return 0;
  }
  return 1;
}

void t_copy_rows(t_entry *dst, const t_entry *src, size_t rows) {
  for (uint32_t l = 0; l < src->n_layers && l < dst->n_layers; l++)
    for (uint32_t k = 0; k < 2; k++) {
      const kvt_tensor *s = &src->layers[l].tensors[k];
      kvt_tensor *d = &dst->layers[l].tensors[k];
      uint64_t ts = (uint64_t)s->shape[2], td = (uint64_t)d->shape[2];
      uint64_t D = (uint64_t)s->shape[3];
      for (uint64_t h = 0; h < (uint64_t)s->shape[1]; h++)
        memcpy((float *)d->data + h * td * D,
               (const float *)s->data + h * ts * D, rows * D * sizeof(float));
    }
}
