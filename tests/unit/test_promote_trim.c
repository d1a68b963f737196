/*
 * test_promote_trim.c - trimmed promotes (kvt_tier_promote_trim): only the
 * first n_keep tokens of a stored entry come back, with every head's rows [0,
 * n_keep) byte-identical to what was spilled, tokens/hash/offset/memory_bytes
 * of the kept prefix, the budget asked for the scaled amount, caller buffers
 * sized for the trimmed tensors, on_layer in order; quantized KV layers trim
 * all six tensors; arrays layers and bad n_keep are refused; a layer file read
 * without a checksum (as for reference-written entries) reads only the kept
 * rows; kvt_common_prefix.
 */
#include "testutil.h"
#include "tier_testlib.h"
#include "fmt_testlib.h"
#include "format/layer.h"
#include "kvtier_sys.h"

#include <cjson/cJSON.h>

static int layers_seen, layers_in_order;
static void on_layer(void *ctx, uint32_t i, const kvt_layer *l) {
  int64_t keep = *(int64_t *)ctx;
  if ((int)i == layers_seen && l->offset == keep)
    layers_in_order++;
  layers_seen++;
}

typedef struct cbuf {
  int allocs;
  uint64_t bytes;
} cbuf;
static void *c_alloc(void *ctx, uint32_t layer, uint32_t tensor,
                     const kvt_tensor *d) {
  (void)layer, (void)tensor;
  cbuf *c = ctx;
  c->allocs++;
  c->bytes += d->nbytes;
  return malloc(d->nbytes ? d->nbytes : 1);
}
static void c_free(void *ctx, void *p) {
  (void)ctx;
  free(p);
}

static void test_kv_trim(void) {
  kvt_options o = t_opts("trim-kv");
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  t_entry e = t_make(11, 40, 3, 40, 8); /* 3 layers of [1, 2, 40, 8] F32 */
  REQUIRE(t_spill(t, &e) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  int64_t keep = 17;
  t_budget b;
  t_budget_init(&b, UINT64_MAX);
  kvt_promote_opts po = t_popts(&b);
  po.on_layer = on_layer;
  po.layer_ctx = &keep;
  layers_seen = layers_in_order = 0;
  kvt_entry *got = NULL;
  REQUIRE(kvt_tier_promote_trim(&got, t, e.tokens, e.n_tokens, (size_t)keep,
                                &po) == 0);
  CHECK_EQ_INT(kvt_entry_num_layers(got), 3);
  for (uint32_t l = 0; l < 3; l++) {
    const kvt_layer *ly = kvt_entry_layer(got, l);
    CHECK_EQ_INT(ly->offset, keep);
    for (int k = 0; k < 2; k++)
      CHECK(t_rows_match(&ly->tensors[k], &e.layers[l].tensors[k], keep));
  }
  size_t n = 0;
  const int32_t *tok = kvt_entry_tokens(got, &n);
  CHECK_EQ_INT(n, keep);
  CHECK(memcmp(tok, e.tokens, (size_t)keep * 4) == 0);
  char h[65];
  kvt_token_hash(h, e.tokens, (size_t)keep);
  CHECK(strcmp(kvt_entry_hash(got), h) == 0);
  uint64_t scaled = (uint64_t)((double)e.memory_bytes * (double)keep / 40.0);
  CHECK_EQ_INT(kvt_entry_memory_bytes(got), scaled);
  CHECK_EQ_INT(kvt_entry_reserved_bytes(got), scaled);
  CHECK_EQ_INT(b.used, scaled);
  CHECK_EQ_INT(layers_seen, 3);
  CHECK_EQ_INT(layers_in_order, 3);
  kvt_entry_free(got);
  /* Caller buffers get the trimmed sizes. */
  cbuf cb = {0, 0};
  kvt_promote_opts pc = t_popts(NULL);
  pc.alloc = c_alloc;
  pc.free_buf = c_free;
  pc.alloc_ctx = &cb;
  got = NULL;
  REQUIRE(kvt_tier_promote_trim(&got, t, e.tokens, e.n_tokens, 5, &pc) == 0);
  CHECK_EQ_INT(cb.allocs, 6);
  CHECK_EQ_INT(cb.bytes, 6 * 2 * 5 * 8 * 4);
  CHECK(t_rows_match(&kvt_entry_layer(got, 2)->tensors[1],
                     &e.layers[2].tensors[1], 5));
  kvt_entry_free(got);
  /* n_keep == n_tokens is a plain promote; bad values are refused. */
  got = NULL;
  REQUIRE(kvt_tier_promote_trim(&got, t, e.tokens, e.n_tokens, e.n_tokens,
                                NULL) == 0);
  CHECK(t_same(got, &e));
  kvt_entry_free(got);
  got = NULL;
  CHECK_EQ_INT(kvt_tier_promote_trim(&got, t, e.tokens, e.n_tokens, 0, NULL),
               KVT_EINVAL);
  CHECK_EQ_INT(kvt_tier_promote_trim(&got, t, e.tokens, e.n_tokens, 41, NULL),
               KVT_EINVAL);
  kvt_promote_opts pp = t_popts(NULL);
  pp.flags = KVT_PROMOTE_PREFIX;
  CHECK_EQ_INT(kvt_tier_promote_trim(&got, t, e.tokens, e.n_tokens, 3, &pp),
               KVT_EINVAL);
  /* Unknown entry: a miss. */
  CHECK_EQ_INT(kvt_tier_promote_trim(&got, t, e.tokens, 39, 3, NULL),
               KVT_ENOTFOUND);
  CHECK(got == NULL);
  /* Integrity is not relaxed: these layer files are smaller than one 64 KiB
   * checksum block, so damage in the rows a trimmed read drops is in the block
   * it must read (and verify) for the header and the kept rows: caught, and
   * the entry quarantined. (Damage in blocks a trim does not read:
   * test_promote_blocks.c.) */
  char *lp = t_entry_path(t, e.tokens, e.n_tokens, "layer_1.safetensors");
  REQUIRE(lp && t_flip(lp, -1) == 0);
  free(lp);
  CHECK_EQ_INT(kvt_tier_promote_trim(&got, t, e.tokens, e.n_tokens, 3, NULL),
               KVT_ECORRUPT);
  CHECK(got == NULL);
  kvt_tier_free(t);
  t_free(&e);
}

static void test_quantized_and_arrays(void) {
  kvt_options o = t_opts("trim-q");
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  enum { H = 2, T = 12, D = 64, GS = 32, BITS = 4 };
  kvt_rng r = {3};
  int32_t tokens[T];
  for (int i = 0; i < T; i++)
    tokens[i] = 1000 + i;
  /* Packed U32 keys/values with F16 scales and biases, [1, H, T, .]. */
  kvt_layer q = t_quant(&r, BITS, GS, KVT_DTYPE_F16, 1, H, T, D, T);
  const kvt_tensor *qt = q.tensors;
  REQUIRE(kvt_tier_spill(t, tokens, T, &q, 1, 1000) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  kvt_entry *got = NULL;
  int rc = kvt_tier_promote_trim(&got, t, tokens, T, 7, NULL);
  CHECK_EQ_INT(rc, 0);
  if (rc == 0) {
    const kvt_layer *l = kvt_entry_layer(got, 0);
    CHECK_EQ_INT(l->kind, KVT_LAYER_QUANTIZED_KV);
    CHECK_EQ_INT(l->offset, 7);
    CHECK_EQ_INT(l->bits, BITS);
    for (int k = 0; k < 6; k++)
      CHECK(t_rows_match(&l->tensors[k], &qt[k], 7));
    kvt_entry_free(got);
  }
  /* Arrays layers cannot be trimmed. */
  kvt_layer a;
  kvt_layer_init(&a, KVT_LAYER_ARRAYS);
  kvt_tensor at = {0};
  at.dtype = KVT_DTYPE_F32;
  at.ndim = 2;
  at.shape[0] = 4;
  at.shape[1] = 4;
  at.nbytes = 64;
  at.data = calloc(1, 64);
  a.num_tensors = 1;
  a.tensors = &at;
  int32_t tok2[5] = {9, 8, 7, 6, 5};
  REQUIRE(kvt_tier_spill(t, tok2, 5, &a, 1, 64) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  got = NULL;
  CHECK_EQ_INT(kvt_tier_promote_trim(&got, t, tok2, 5, 2, NULL),
               KVT_EUNSUPPORTED);
  CHECK(got == NULL);
  kvt_tier_free(t);
  free(at.data);
  t_layer_free(&q);
}

/* A layer file read without a checksum (what entries written by the reference
 * get) reads only the kept rows: the bytes of the dropped rows are never looked
 * at, so corrupting them does not matter. */
static void test_layer_range_read(void) {
  char *dir = kvt_test_tmpdir("trim-layer");
  t_entry e = t_make(5, 30, 1, 30, 16);
  char path[4096];
  snprintf(path, sizeof path, "%s/layer_0.safetensors", dir);
  char *meta = NULL;
  REQUIRE(kvt_layer_save(&meta, path, &e.layers[0], 0, KVT_STORAGE_NATIVE,
                         0600) == 0);
  /* Flip the last byte of the file: the last row of the last head, beyond the
   * kept rows. */
  REQUIRE(t_flip(path, -1) == 0);
  cJSON *j = cJSON_Parse(meta);
  REQUIRE(j);
  kvti_layer_meta m;
  REQUIRE(kvti_layer_meta_parse(&m, j, -1, path) == 0);
  cJSON_Delete(j);
  kvti_layer_read_opts lo;
  memset(&lo, 0, sizeof lo);
  lo.keep_tokens = 10;
  kvt_layer l;
  uint64_t fb = 0;
  REQUIRE(kvti_layer_read_file(&l, &fb, path, &m, &lo) == 0);
  CHECK_EQ_INT(l.offset, 10);
  for (int k = 0; k < 2; k++)
    CHECK(t_rows_match(&l.tensors[k], &e.layers[0].tensors[k], 10));
  kvti_layer_release(&l, 0, NULL, NULL);
  /* More tokens than stored: refused. */
  lo.keep_tokens = 31;
  CHECK_EQ_INT(kvti_layer_read_file(&l, &fb, path, &m, &lo), KVT_EINVAL);
  kvti_layer_meta_free(&m);
  kvt_free(meta);
  t_free(&e);
}

static void test_common_prefix(void) {
  int32_t a[5] = {1, 2, 3, 4, 5}, b[4] = {1, 2, 9, 4};
  CHECK_EQ_INT(kvt_common_prefix(a, 5, b, 4), 2);
  CHECK_EQ_INT(kvt_common_prefix(a, 5, a, 3), 3);
  CHECK_EQ_INT(kvt_common_prefix(a, 0, b, 4), 0);
  CHECK_EQ_INT(kvt_common_prefix(NULL, 3, b, 4), 0);
}

int main(void) {
  RUN(test_kv_trim);
  RUN(test_quantized_and_arrays);
  RUN(test_layer_range_read);
  RUN(test_common_prefix);
  return kvt_test_done();
}
