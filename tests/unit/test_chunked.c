/*
 * test_chunked.c - the chunked native store over the local backend
 * (src/store/chunked.c): conversations sharing a system prompt store the
 * shared chunks once; every entry reads back bit for bit (tail + chain, through
 * a caller allocator, on_layer in order); a prompt sharing part of the system
 * prompt gets the chunk-aligned prefix of a pure-KV chain (exact allocation
 * figure, 64-hex hash of the prefix) although no spill ended there; hybrid
 * spills (an arrays layer) get no such prefix but read back whole; a damaged
 * chunk is reported with its key, an evicted one as a miss (never a short
 * entry); a chained entry replaced by an unchunkable one loses its record.
 */
#include "fmt_testlib.h"
#include "base/io.h"
#include "format/entry.h"
#include "index/index.h"
#include "store/local.h"
#include "store/chunked.h"
#include "kvtier_sys.h"

#define C 16

static char *g_dir;

typedef struct env {
  char *dir;
  kvt_index *idx;
  kvti_backend *be;
  kvti_chunked *ck;
} env;

static void env_open(env *v, const char *tag) {
  v->dir = t_join(g_dir, tag);
  mkdir(v->dir, 0700);
  char *d = t_join(v->dir, "data");
  mkdir(d, 0700);
  free(d);
  kvti_local_cfg lc = {v->dir, 0700, 0600, 0, 0};
  REQUIRE(kvti_backend_local_open(&v->be, &lc) == 0);
  REQUIRE(kvti_index_open(&v->idx, v->dir, NULL, 0) == 0);
  kvti_chunkstore_opts o = {0600, 0700, 0};
  REQUIRE(kvti_chunked_open(&v->ck, v->dir, v->idx, C, "model", &o) == 0);
}
static void env_close(env *v) {
  kvti_chunked_close(v->ck);
  v->be->ops->destroy(v->be);
  kvt_index_close(v->idx);
  free(v->dir);
}

static const kvti_write_opts WO = {KVT_STORAGE_NATIVE, 0, 0600, 0700, 0};

static int g_live, g_layers_seen;
static void *t_alloc(void *ctx, uint32_t l, uint32_t j, const kvt_tensor *d) {
  (void)ctx;
  (void)l;
  (void)j;
  g_live++;
  return malloc(d->nbytes ? d->nbytes : 1);
}
/* 1 when trim holds exactly the first keep rows (axis -2) of full. */
static int first_rows_eq(const kvt_tensor *trim, const kvt_tensor *full,
                         int keep) {
  uint64_t outer = 1, T = (uint64_t)full->shape[full->ndim - 2];
  for (uint32_t d = 0; d + 2 < full->ndim; d++)
    outer *= (uint64_t)full->shape[d];
  uint64_t row = full->nbytes / (outer * T);
  if (trim->ndim != full->ndim || trim->dtype != full->dtype ||
      trim->shape[trim->ndim - 2] != keep ||
      trim->nbytes != outer * (uint64_t)keep * row)
    return 0;
  for (uint64_t q = 0; q < outer; q++)
    if (memcmp((const uint8_t *)trim->data + q * (uint64_t)keep * row,
               (const uint8_t *)full->data + q * T * row,
               (size_t)keep * row) != 0)
      return 0;
  return 1;
}

static void t_free(void *ctx, void *b) {
  (void)ctx;
  g_live--;
  free(b);
}
static void on_layer(void *ctx, uint32_t i, const kvt_layer *l) {
  (void)ctx;
  (void)l;
  CHECK_EQ_INT(i, g_layers_seen);
  g_layers_seen++;
}

static kvti_chunked_put_result put(env *v, const int32_t *tok, size_t n,
                                   const kvt_layer *l, uint32_t nl) {
  kvti_snapshot *s;
  REQUIRE(kvti_snapshot_create(&s, tok, n, l, nl, 999, 1, NULL, NULL) == 0);
  kvti_chunked_put_result r;
  REQUIRE(kvti_chunked_put(v->ck, v->be, &r, s, &WO) == 0);
  kvti_snapshot_free(s);
  return r;
}

static kvt_entry *get(env *v, const int32_t *tok, size_t n, int *rc) {
  char h[65];
  kvt_token_hash(h, tok, n);
  kvti_read_opts o = {0};
  o.tokens = tok;
  o.n_tokens = n;
  o.alloc = t_alloc;
  o.free_buf = t_free;
  o.on_layer = on_layer;
  g_layers_seen = 0;
  kvt_entry *e = NULL;
  *rc = kvti_chunked_get(v->ck, v->be, &e, h, &o, NULL, NULL);
  return e;
}

static void test_conversations(void) {
  env v;
  env_open(&v, "conv");
  kvt_rng r = {21};
  /* 4 conversations: a 64-token system prompt + 40 own tokens. */
  int32_t tok[4][104];
  kvt_layer l[4][2];
  for (int c = 0; c < 4; c++) {
    for (int i = 0; i < 104; i++)
      tok[c][i] = i < 64 ? 1000 + i : (int32_t)(kvt_rng_next(&r) % 30000);
    l[c][0] = t_kv(&r, KVT_DTYPE_F16, 1, 2, 128, 8, 104);
    l[c][1] = t_quant(&r, 4, 32, KVT_DTYPE_BF16, 1, 2, 128, 64, 104);
  }
  /* The shared rows must really be the same KV (same prompt, same model). */
  for (int c = 1; c < 4; c++)
    for (int k = 0; k < 2; k++)
      for (uint32_t j = 0; j < l[c][k].num_tensors; j++) {
        kvt_tensor *d = &l[c][k].tensors[j], *s = &l[0][k].tensors[j];
        uint64_t row = d->nbytes / 2 / 128;
        for (int hd = 0; hd < 2; hd++)
          memcpy((uint8_t *)d->data + hd * 128 * row,
                 (uint8_t *)s->data + hd * 128 * row, 64 * row);
      }
  uint64_t written = 0;
  for (int c = 0; c < 4; c++) {
    kvti_chunked_put_result pr = put(&v, tok[c], 104, l[c], 2);
    CHECK_EQ_INT(pr.chunks, 6);
    CHECK_EQ_INT(pr.written, c == 0 ? 6 : 2); /* 4 shared chunks once */
    written += pr.written;
  }
  CHECK_EQ_INT(written, 6 + 3 * 2);
  for (int c = 0; c < 4; c++) {
    int rc;
    g_live = 0;
    kvt_entry *e = get(&v, tok[c], 104, &rc);
    REQUIRE(rc == 0 && e);
    CHECK_EQ_INT(g_layers_seen, 2);
    CHECK(t_layer_eq(&e->layers[0], &l[c][0]));
    CHECK(t_layer_eq(&e->layers[1], &l[c][1]));
    CHECK_EQ_INT(g_live, 8); /* 2 + 6 tensors, in the caller's buffers */
    kvt_entry_free(e);
    CHECK_EQ_INT(g_live, 0);
  }
  /* Trimmed read (keep 40 of 104 tokens): from the chain alone. */
  {
    char h0[65];
    kvt_token_hash(h0, tok[0], 104);
    kvti_read_opts to = {0};
    to.tokens = tok[0];
    to.n_tokens = 104;
    to.keep_tokens = 40;
    kvt_entry *te = NULL;
    REQUIRE(kvti_chunked_get(v.ck, v.be, &te, h0, &to, NULL, NULL) == 0);
    CHECK_EQ_INT(te->n_tokens, 40);
    CHECK_EQ_INT(te->layers[1].offset, 40);
    CHECK_EQ_INT(te->layers[1].tensors[3].shape[2], 40);
    const kvt_tensor *x = &te->layers[0].tensors[1], *y = &l[0][0].tensors[1];
    CHECK(memcmp((uint8_t *)x->data + 40 * 16, (uint8_t *)y->data + 128 * 16,
                 40 * 16) == 0);
    kvt_entry_free(te);
    /* Beyond the chain's 96 tokens: chain + the tail's first 4 rows. */
    for (int keep = 96; keep <= 104; keep += 4) {
      to.keep_tokens = (uint64_t)keep;
      REQUIRE(kvti_chunked_get(v.ck, v.be, &te, h0, &to, NULL, NULL) == 0);
      CHECK_EQ_INT(te->n_tokens, keep);
      char hk[65];
      kvt_token_hash(hk, tok[0], (size_t)keep);
      CHECK(strcmp(te->hash, hk) == 0);
      for (int L = 0; L < 2; L++) {
        CHECK_EQ_INT(te->layers[L].offset, keep);
        for (uint32_t j = 0; j < te->layers[L].num_tensors; j++)
          CHECK(first_rows_eq(&te->layers[L].tensors[j], &l[0][L].tensors[j],
                              keep));
      }
      kvt_entry_free(te);
    }
    to.keep_tokens = 105;
    te = NULL;
    CHECK(kvti_chunked_get(v.ck, v.be, &te, h0, &to, NULL, NULL) == KVT_EINVAL);
    CHECK(te == NULL);
    to.keep_tokens = 0;
    to.verify_only = 1;
    te = (kvt_entry *)1;
    CHECK(kvti_chunked_get(v.ck, v.be, &te, h0, &to, NULL, NULL) == 0);
    CHECK(te == NULL);
  }
  /* A new prompt: the system prompt's first 50 tokens + others: 3 chunks. */
  int32_t q[80];
  memcpy(q, tok[0], 50 * 4);
  for (int i = 50; i < 80; i++)
    q[i] = -i;
  uint64_t m, mem;
  char h[65], want[65];
  REQUIRE(kvti_chunked_lookup_prefix(v.ck, NULL, q, 80, &m, &mem, h) == 0);
  CHECK_EQ_INT(m, 48);
  kvt_token_hash(want, q, 48);
  CHECK(strcmp(h, want) == 0);
  kvti_read_opts o = {0};
  o.alloc = t_alloc;
  o.free_buf = t_free;
  o.on_layer = on_layer;
  g_layers_seen = 0;
  kvt_entry *e;
  REQUIRE(kvti_chunked_get_prefix(v.ck, NULL, &e, q, 48, &o, NULL, NULL) == 0);
  CHECK_EQ_INT(e->memory_bytes, mem); /* exactly what was allocated */
  CHECK_EQ_INT(e->n_tokens, 48);
  CHECK_EQ_INT(g_layers_seen, 2);
  const kvt_tensor *a = &e->layers[0].tensors[0], *b = &l[0][0].tensors[0];
  CHECK(memcmp(a->data, b->data, 48 * 16) == 0);
  CHECK(memcmp((uint8_t *)a->data + 48 * 16, (uint8_t *)b->data + 128 * 16,
               48 * 16) == 0);
  kvt_entry_free(e);
  CHECK(kvti_chunked_get_prefix(v.ck, NULL, &e, q, 64, &o, NULL, NULL) ==
        KVT_ENOTFOUND);
  CHECK(kvti_chunked_touch(v.ck, NULL, q, 80) == 0);
  /* A damaged chunk: reported with its key; nothing returned. */
  kvti_chain_rec recs[8];
  size_t k;
  REQUIRE(kvti_chunkstore_lookup(kvti_chunked_store(v.ck),
                                 (const uint8_t *)"\5\0\0\0model\0\0\0\0", 13,
                                 tok[1], 104, C, recs, 8, &k) == 0);
  REQUIRE(k == 6);
  char path[4096];
  kvti_chunkstore_path(kvti_chunked_store(v.ck), recs[5].key, path,
                       sizeof path);
  size_t n;
  char *bytes = kvt_test_read_file(path, &n);
  bytes[n - 1] ^= 1;
  t_write_all(path, bytes, n);
  char h1[65];
  kvt_token_hash(h1, tok[1], 104);
  kvti_read_opts ro = {0};
  uint8_t badk[32];
  int bad = 0;
  CHECK(kvti_chunked_get(v.ck, v.be, &e, h1, &ro, badk, &bad) == KVT_ECORRUPT);
  CHECK(bad && memcmp(badk, recs[5].key, 32) == 0);
  /* Evicted: a miss, never a short entry. */
  CHECK(kvti_chunkstore_remove(kvti_chunked_store(v.ck), recs[5].key, NULL,
                               NULL) == 0);
  CHECK(kvti_chunked_get(v.ck, v.be, &e, h1, &ro, badk, &bad) == KVT_ENOTFOUND);
  free(bytes);
  /* Replaced by a spill with nothing to chunk: the record goes. */
  CHECK(kvti_chunked_is_chained(v.ck, h1));
  kvt_layer small = t_kv(&r, KVT_DTYPE_F16, 1, 2, 8, 8, 8);
  put(&v, tok[1], 104, &small, 1);
  CHECK(!kvti_chunked_is_chained(v.ck, h1));
  int rc;
  e = get(&v, tok[1], 104, &rc);
  REQUIRE(rc == 0);
  CHECK(t_layer_eq(&e->layers[0], &small));
  kvt_entry_free(e);
  t_layer_free(&small);
  for (int c = 0; c < 4; c++) {
    t_layer_free(&l[c][0]);
    t_layer_free(&l[c][1]);
  }
  env_close(&v);
}

static void test_hybrid(void) {
  env v;
  env_open(&v, "hyb");
  kvt_rng r = {22};
  int32_t tok[70];
  for (int i = 0; i < 70; i++)
    tok[i] = i * 3;
  kvt_layer l[2];
  l[0] = t_kv(&r, KVT_DTYPE_BF16, 1, 2, 70, 8, 70);
  kvt_dtype dts[1] = {KVT_DTYPE_F32};
  l[1] = t_arrays(&r, 1, dts);
  kvti_chunked_put_result pr = put(&v, tok, 70, l, 2);
  CHECK_EQ_INT(pr.chunks, 4);
  uint64_t m, mem;
  char h[65];
  /* The arrays state exists only at 70 tokens: no prefix at 64. */
  CHECK(kvti_chunked_lookup_prefix(v.ck, NULL, tok, 70, &m, &mem, h) == 0);
  CHECK_EQ_INT(m, 0);
  int rc;
  kvt_entry *e = get(&v, tok, 70, &rc);
  REQUIRE(rc == 0);
  CHECK(t_layer_eq(&e->layers[0], &l[0]));
  CHECK(t_layer_eq(&e->layers[1], &l[1]));
  kvt_entry_free(e);
  t_layer_free(&l[0]);
  t_layer_free(&l[1]);
  env_close(&v);
}

int main(void) {
  g_dir = kvt_test_tmpdir("chunked");
  RUN(test_conversations);
  RUN(test_hybrid);
  return kvt_test_done();
}
