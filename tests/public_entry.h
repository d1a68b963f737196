/*
 * public_entry.h - one small seeded fp16 KV entry (1 layer, 2 heads, T tokens,
 * 16 dims) built with the public API only, for the test programs that stand in
 * for an outside user of an installed or running libkvtier
 * (tests/install/prog.c, tests/cli/live_holder.c). pe_spill enqueues the entry
 * of a seed, pe_same checks a promoted entry against it.
 */
#ifndef KVT_PUBLIC_ENTRY_H
#define KVT_PUBLIC_ENTRY_H

#include <kvtier.h>

#include <string.h>

enum { PE_T = 32, PE_D = 16, PE_N = 2 * PE_T * PE_D };

/* The tokens of a seed: seed*1000 + i. */
static inline void pe_tokens(int32_t *tok, int seed) {
  for (int i = 0; i < PE_T; i++)
    tok[i] = seed * 1000 + i;
}

/* Keys and values of a seed (fp16 bit patterns). */
static inline void pe_data(uint16_t *k, uint16_t *v, int seed) {
  for (int i = 0; i < PE_N; i++)
    k[i] = (uint16_t)(0x3c00 + (i + seed) % 256), v[i] = (uint16_t)(i ^ seed);
}

static inline int pe_spill(kvt_tier *t, int seed) {
  static uint16_t k[PE_N], v[PE_N]; /* copied by kvt_tier_spill */
  pe_data(k, v, seed);
  kvt_tensor ts[2];
  memset(ts, 0, sizeof ts);
  uint16_t *data[2] = {k, v};
  for (int i = 0; i < 2; i++) {
    ts[i].dtype = KVT_DTYPE_F16;
    ts[i].ndim = 4;
    ts[i].shape[0] = 1, ts[i].shape[1] = 2, ts[i].shape[2] = PE_T;
    ts[i].shape[3] = PE_D;
    ts[i].data = data[i];
    ts[i].nbytes = sizeof k;
  }
  kvt_layer l;
  kvt_layer_init(&l, KVT_LAYER_KV);
  l.num_tensors = 2;
  l.tensors = ts;
  l.offset = PE_T;
  int32_t tok[PE_T];
  pe_tokens(tok, seed);
  return kvt_tier_spill(t, tok, PE_T, &l, 1, 2 * sizeof k);
}

/* 1 when e holds exactly the entry of seed. */
static inline int pe_same(const kvt_entry *e, int seed) {
  static uint16_t k[PE_N], v[PE_N];
  pe_data(k, v, seed);
  if (kvt_entry_num_layers(e) != 1 || kvt_entry_layer(e, 0)->num_tensors != 2)
    return 0;
  const kvt_tensor *ts = kvt_entry_layer(e, 0)->tensors;
  return ts[0].nbytes == sizeof k && ts[1].nbytes == sizeof v &&
         memcmp(ts[0].data, k, sizeof k) == 0 &&
         memcmp(ts[1].data, v, sizeof v) == 0;
}

#endif
