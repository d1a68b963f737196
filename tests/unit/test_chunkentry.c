/*
 * test_chunkentry.c - entries over chains (src/store/chunkstore_entry.c): a
 * hybrid spill (fp16 KV with preallocated rows past its offset, an arrays
 * state, a wrapped rotating layer, 4-bit quantized KV) is cut into a chain
 * and a tail; the tail is written and read back as an entry, completed with
 * the chain's prefix, and must equal the spilled layers bit for bit (shapes,
 * attributes, rows past offset included). A pure-KV spill's prefix at a chunk
 * boundary becomes an entry of its own with exactly the bytes it allocated.
 * Layers the chain cannot hold (arrays, wrapped rotating, another token
 * extent) stay whole in the tail; a tail that disagrees with the chain is
 * refused.
 */
#include "fmt_testlib.h"
#include "base/io.h"
#include "format/entry.h"
#include "store/chunkstore.h"
#include "kvtier_sys.h"

#define C 16

static char *g_dir;

typedef struct env {
  char *dir, *data;
  kvt_index *idx;
  kvti_chunkstore *cs;
} env;

static void env_open(env *v, const char *tag) {
  v->dir = t_join(g_dir, tag);
  mkdir(v->dir, 0700);
  v->data = t_join(v->dir, "data");
  mkdir(v->data, 0700);
  REQUIRE(kvti_index_open(&v->idx, v->dir, NULL, 0) == 0);
  kvti_chunkstore_opts o = {0600, 0700, 0};
  REQUIRE(kvti_chunkstore_open(&v->cs, v->dir, v->idx, &o) == 0);
}
static void env_close(env *v) {
  kvti_chunkstore_close(v->cs);
  kvt_index_close(v->idx);
  free(v->dir);
  free(v->data);
}

static const uint8_t NS[8] = {0};

/* Spills layers as chain + tail, reads them back, returns the entry. */
static kvt_entry *roundtrip(env *v, const int32_t *tok, size_t n,
                            const kvt_layer *layers, uint32_t nl,
                            size_t *chunks) {
  kvti_chunk_split sp;
  REQUIRE(kvti_chunk_split_make(&sp, layers, nl, n, C) == 0);
  *chunks = sp.chunks;
  kvti_chunkstore_result res = {0};
  if (sp.chunks) {
    kvti_chunkstore_spill cs = {
        NS, 8, tok, (size_t)sp.rows, C, layers, sp.ids, sp.n_ids, nl};
    REQUIRE(kvti_chunkstore_put(v->cs, &cs, &res) == 0);
    CHECK_EQ_INT(res.chunks, sp.chunks);
  }
  kvti_snapshot *snap;
  REQUIRE(kvti_snapshot_create(&snap, tok, n, sp.tail, nl, 1234, 1, NULL,
                               NULL) == 0);
  kvti_write_opts wo = {KVT_STORAGE_NATIVE, 0, 0600, 0700, 0};
  uint64_t disk;
  REQUIRE(kvti_entry_write(&disk, v->data, snap, &wo) == 0);
  char hash[65];
  kvt_token_hash(hash, tok, n);
  kvti_snapshot_free(snap);
  kvti_read_opts ro = {0};
  ro.tokens = tok;
  ro.n_tokens = n;
  ro.chain_rows = sp.rows; /* a tail: its offsets count the chain's rows */
  kvt_entry *e;
  REQUIRE(kvti_entry_read(&e, v->data, hash, &ro) == 0);
  if (sp.chunks) {
    kvti_chain_rec recs[64];
    size_t m;
    REQUIRE(kvti_chunkstore_lookup(v->cs, NS, 8, tok, n, C, recs, 64, &m) == 0);
    CHECK_EQ_INT(m, sp.chunks);
    kvti_chunk_read_opts o = {0};
    o.total_rows = sp.T;
    kvti_chunk_prefix p;
    REQUIRE(kvti_chunkstore_read_prefix(v->cs, recs, m, tok, &o, &p, NULL) ==
            0);
    REQUIRE(kvti_chunk_join(e, &p, sp.rows, &o) == 0);
  }
  kvti_chunk_split_free(&sp);
  return e;
}

static void test_hybrid(void) {
  env v;
  env_open(&v, "h");
  kvt_rng r = {8};
  int32_t tok[200];
  for (int i = 0; i < 200; i++)
    tok[i] = (int32_t)(kvt_rng_next(&r) % 30000);
  kvt_layer l[5];
  l[0] = t_kv(&r, KVT_DTYPE_F16, 1, 2, 256, 8, 200); /* 56 spare rows */
  kvt_dtype dts[2] = {KVT_DTYPE_F32, KVT_DTYPE_BF16};
  l[1] = t_arrays(&r, 2, dts);
  l[2] = t_rotating(&r, KVT_DTYPE_BF16); /* wrapped: stays whole */
  l[3] = t_quant(&r, 4, 32, KVT_DTYPE_BF16, 1, 2, 256, 64, 200);
  l[4] = t_kv(&r, KVT_DTYPE_BF16, 1, 1, 100, 4, 100); /* another extent */
  size_t chunks;
  kvt_entry *e = roundtrip(&v, tok, 200, l, 5, &chunks);
  CHECK_EQ_INT(chunks, 12); /* 192 rows of layers 0 and 3 */
  REQUIRE(e->num_layers == 5);
  for (uint32_t i = 0; i < 5; i++) {
    CHECK(t_layer_eq(&e->layers[i], &l[i]));
    if (!t_layer_eq(&e->layers[i], &l[i]))
      fprintf(stderr, "layer %u differs\n", i);
  }
  kvt_entry_free(e);
  /* The tail disagreeing with the chain (another extent) is refused. */
  kvti_chunk_split sp;
  REQUIRE(kvti_chunk_split_make(&sp, l, 5, 200, C) == 0);
  CHECK_EQ_INT(sp.n_ids, 2);
  CHECK_EQ_INT(sp.rows, 192);
  CHECK_EQ_INT(sp.tail[0].tensors[0].shape[2], 64);
  CHECK(sp.tail[1].tensors == l[1].tensors); /* arrays: whole, not copied */
  kvti_chain_rec recs[16];
  size_t m;
  REQUIRE(kvti_chunkstore_lookup(v.cs, NS, 8, tok, 200, C, recs, 16, &m) == 0);
  kvti_chunk_read_opts o = {0};
  o.total_rows = 200; /* wrong: the tail has 64 rows, 192 + 64 = 256 */
  kvti_chunk_prefix p;
  REQUIRE(kvti_chunkstore_read_prefix(v.cs, recs, m, tok, &o, &p, NULL) == 0);
  char hash[65];
  kvt_token_hash(hash, tok, 200);
  kvti_read_opts ro = {0};
  ro.chain_rows = sp.rows;
  kvt_entry *e2;
  REQUIRE(kvti_entry_read(&e2, v.data, hash, &ro) == 0);
  CHECK_EQ_INT(kvti_chunk_join(e2, &p, sp.rows, &o), KVT_ECORRUPT);
  kvt_entry_free(e2);
  kvti_chunk_split_free(&sp);
  /* Not pure: no prefix entry from this chain. */
  o.total_rows = 0;
  REQUIRE(kvti_chunkstore_read_prefix(v.cs, recs, 4, tok, &o, &p, NULL) == 0);
  kvt_entry *pe;
  CHECK_EQ_INT(kvti_chunk_prefix_entry(&pe, &p, tok, 64, &o), KVT_ECORRUPT);
  for (int i = 0; i < 5; i++)
    t_layer_free(&l[i]);
  env_close(&v);
}

static void test_pure_prefix(void) {
  env v;
  env_open(&v, "p");
  kvt_rng r = {9};
  int32_t tok[100];
  for (int i = 0; i < 100; i++)
    tok[i] = (int32_t)(kvt_rng_next(&r) % 30000);
  kvt_layer l[2];
  l[0] = t_kv(&r, KVT_DTYPE_F16, 1, 2, 100, 8, 100);
  l[1] = t_quant(&r, 8, 32, KVT_DTYPE_F16, 1, 2, 100, 32, KVT_ABSENT);
  size_t chunks;
  kvt_entry *e = roundtrip(&v, tok, 100, l, 2, &chunks);
  CHECK_EQ_INT(chunks, 6);
  CHECK(t_layer_eq(&e->layers[0], &l[0]));
  CHECK(t_layer_eq(&e->layers[1], &l[1])); /* absent offset stays absent */
  kvt_entry_free(e);
  /* A prompt sharing 70 tokens: 4 chunks = 64 tokens servable, no entry
   * ends there. */
  int32_t q[90];
  memcpy(q, tok, 70 * 4);
  for (int i = 70; i < 90; i++)
    q[i] = -1;
  kvti_chain_rec recs[8];
  size_t m;
  REQUIRE(kvti_chunkstore_lookup(v.cs, NS, 8, q, 90, C, recs, 8, &m) == 0);
  CHECK_EQ_INT(m, 4);
  CHECK(recs[0].pure);
  kvti_chunk_read_opts o = {0};
  kvti_chunk_prefix p;
  REQUIRE(kvti_chunkstore_read_prefix(v.cs, recs, m, q, &o, &p, NULL) == 0);
  REQUIRE(kvti_chunk_prefix_entry(&e, &p, q, 64, &o) == 0);
  CHECK_EQ_INT(e->n_tokens, 64);
  CHECK_EQ_INT(e->memory_bytes, kvti_chunk_prefix_bytes(recs, m));
  char h[65];
  kvt_token_hash(h, q, 64);
  CHECK(strcmp(h, e->hash) == 0);
  CHECK_EQ_INT(e->layers[0].offset, 64);
  CHECK_EQ_INT(e->layers[0].tensors[0].shape[2], 64);
  /* Bit-exact against the first 64 rows of the spill. */
  const kvt_tensor *a = &e->layers[0].tensors[1], *b = &l[0].tensors[1];
  int ok = 1;
  for (int hd = 0; hd < 2; hd++)
    ok &= memcmp((const uint8_t *)a->data + hd * 64 * 16,
                 (const uint8_t *)b->data + hd * 100 * 16, 64 * 16) == 0;
  CHECK(ok);
  kvt_entry_free(e);
  t_layer_free(&l[0]);
  t_layer_free(&l[1]);
  env_close(&v);
}

int main(void) {
  g_dir = kvt_test_tmpdir("chunkentry");
  RUN(test_hybrid);
  RUN(test_pure_prefix);
  return kvt_test_done();
}
