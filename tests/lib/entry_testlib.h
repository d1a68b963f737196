/*
 * entry_testlib.h - the one test entry every C test spills, writes, reads and
 * compares: tokens (with their hash) and owned layers. Two seeded generators
 * fill it - t_make (n uniform F32 KV layers of a chosen size, for the tier
 * tests) and r_make (one layer of each kind and dtype family, a few KB, for the
 * format-level reliability loops) - and one comparer, t_same, judges a promoted
 * or read entry against it bit for bit. Part of the test library (tests/lib);
 * definitions in entry_testlib.c.
 */
#ifndef KVT_ENTRY_TESTLIB_H
#define KVT_ENTRY_TESTLIB_H

#include "fmt_testlib.h"
#include "kvtier.h"

#include <stdint.h>

/* A spillable test entry: tokens, their hash and n_layers owned layers (libc
 * malloc; t_free releases all). memory_bytes is what a spill/write reports as
 * the entry's RAM size. */
typedef struct t_entry {
  int32_t *tokens;
  size_t n_tokens;
  kvt_layer *layers;
  uint32_t n_layers;
  uint64_t memory_bytes;
  char hash[KVT_HASH_HEX_LEN + 1];
} t_entry;

/* n_layers KV layers of F32 keys/values [1, 2, T, D]. Tokens: seed-derived, so
 * different seeds give different keys; n tokens. Tensor bytes per layer =
 * 2 * 2 * T * D * 4 (= memory_bytes / n_layers). */
t_entry t_make(uint64_t seed, size_t n_tokens, uint32_t n_layers, int T, int D);

/* Seeded entry: a KV F16 layer, a BF16 KV layer, an ARRAYS layer and (quant) a
 * 4-bit quantized layer. Small: a few KB in all, so loops over every call site
 * stay fast. memory_bytes is 777. */
t_entry r_make(uint64_t seed, size_t n_tokens, int quant);

/* Same tokens, different tensor data (a replacement of the entry). */
t_entry r_make_variant(const t_entry *base, uint64_t seed);

/* n_tokens seeded tokens (hash set), room for cap_layers layers, none built:
 * for tests that assemble their own layers. memory_bytes is 777. */
t_entry t_entry_alloc(kvt_rng *r, size_t n_tokens, uint32_t cap_layers);

/* Same tokens as prefix's first n tokens followed by fresh ones (the hash
 * follows). */
void t_set_prefix(t_entry *e, const t_entry *prefix);

void t_free(t_entry *e);

/* Copies token rows [0, rows) of every tensor of src into dst (entries made
 * by t_make, tensors [1, heads, T, D] of F32; T may differ): the same KV for a
 * shared prefix. */
void t_copy_rows(t_entry *dst, const t_entry *src, size_t rows);

/* True when got holds exactly e's tokens, memory size and layers (every tensor
 * bit for bit, the layer metadata too; see t_layer_eq). */
int t_same(const kvt_entry *got, const t_entry *e);

#endif
