/*
 * test_kv_offset.c - token i is KV row i (issue 18, docs/FORMAT.md "offset"):
 * a KV or quantized KV layer whose offset is past its tensors' token rows
 * (shape[-2]) is refused at spill and by kvt_layer_save (KVT_EINVAL) and, when
 * a stored file claims it (a reference-format entry, a layer file), never
 * served (KVT_ECORRUPT); an offset below the rows (an engine's preallocated
 * room) is stored and returned as spilled, but a trimmed promote never keeps
 * rows past it (KVT_EINVAL), and the chunked store chunks only rows below it.
 * Rotating KV (offset counts every token seen) is not bound by its rows.
 */
#include "fmt_testlib.h"
#include "kvtier.h"
#include "kvtier_sys.h"

#include <stdio.h>
#include <sys/stat.h>

static char *g_dir;

static kvt_tier *open_tier(const char *tag, uint32_t chunk) {
  char *dir = t_join(g_dir, tag);
  kvt_options o = KVT_OPTIONS_INIT;
  o.cache_dir = dir;
  o.durability = KVT_DURABILITY_NONE;
  o.chunk_tokens = chunk;
  kvt_tier *t = NULL;
  REQUIRE(kvt_tier_open(&t, &o) == 0);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  free(dir);
  return t;
}

static void toks(int32_t *tok, int n, int base) {
  for (int i = 0; i < n; i++)
    tok[i] = base + i;
}

/* Spill refusals: nothing enqueued, counted as rejects, the message names the
 * layer and the rows. */
static void test_spill_refused(void) {
  kvt_tier *t = open_tier("spill", 0);
  kvt_rng r = {11};
  int32_t tok[32];
  toks(tok, 32, 100);
  int64_t bad[] = {1000000000, 33};
  for (int k = 0; k < 2; k++) {
    kvt_layer l = t_kv(&r, KVT_DTYPE_F16, 1, 2, 32, 8, bad[k]);
    CHECK_EQ_INT(kvt_tier_spill(t, tok, 32, &l, 1, 100), KVT_EINVAL);
    CHECK(strstr(kvt_last_error(), "offset") &&
          strstr(kvt_last_error(), "32 token rows"));
    CHECK_EQ_INT(kvt_tier_spill_nocopy(t, tok, 32, &l, 1, 100, NULL, NULL),
                 KVT_EINVAL);
    t_layer_free(&l);
  }
  /* Quantized KV: the packed rows bound the offset too (absent: all rows). */
  kvt_layer q = t_quant(&r, 4, 32, KVT_DTYPE_F16, 1, 2, 32, 64, 40);
  CHECK_EQ_INT(kvt_tier_spill(t, tok, 32, &q, 1, 100), KVT_EINVAL);
  q.offset = KVT_ABSENT;
  CHECK_EQ_INT(kvt_tier_spill(t, tok, 32, &q, 1, 100), 0);
  t_layer_free(&q);
  /* A KV tensor without a token axis. */
  kvt_layer l1 = t_kv(&r, KVT_DTYPE_F16, 1, 2, 32, 8, 32);
  l1.tensors[0].ndim = 1;
  l1.tensors[0].shape[0] = (int64_t)(l1.tensors[0].nbytes / 2);
  CHECK_EQ_INT(kvt_tier_spill(t, tok, 32, &l1, 1, 100), KVT_EINVAL);
  t_layer_free(&l1);
  /* Rotating KV: offset counts every token ever seen, rows are a window. */
  kvt_layer rot = t_rotating(&r, KVT_DTYPE_F16);
  rot.offset = 1000000000;
  int32_t rt[9];
  toks(rt, 9, 7);
  CHECK_EQ_INT(kvt_tier_spill(t, rt, 9, &rot, 1, 100), 0);
  t_layer_free(&rot);
  REQUIRE(kvt_tier_flush(t, 30000) == 0);
  kvt_stats st = KVT_STATS_INIT;
  REQUIRE(kvt_tier_stats(&st, t) == 0);
  CHECK_EQ_INT(st.spill_rejects, 6);
  CHECK_EQ_INT(st.entries, 2);
  kvt_entry *e = NULL;
  REQUIRE(kvt_tier_promote(&e, t, rt, 9, NULL) == 0);
  CHECK_EQ_INT(kvt_entry_layer(e, 0)->offset, 1000000000);
  kvt_entry_free(e);
  kvt_tier_free(t);
}

/* offset 3 of 32 rows: stored and returned as spilled; a trim never keeps
 * rows past offset. */
static void test_trim_within_offset(void) {
  kvt_tier *t = open_tier("trim", 0);
  kvt_rng r = {12};
  int32_t tok[32];
  toks(tok, 32, 300);
  kvt_layer l = t_kv(&r, KVT_DTYPE_F16, 1, 2, 32, 8, 3);
  REQUIRE(kvt_tier_spill(t, tok, 32, &l, 1, 100) == 0);
  REQUIRE(kvt_tier_flush(t, 30000) == 0);
  kvt_entry *e = NULL;
  REQUIRE(kvt_tier_promote(&e, t, tok, 32, NULL) == 0);
  CHECK(t_layer_eq(kvt_entry_layer(e, 0), &l));
  kvt_entry_free(e);
  e = NULL;
  CHECK_EQ_INT(kvt_tier_promote_trim(&e, t, tok, 32, 10, NULL), KVT_EINVAL);
  CHECK(e == NULL && strstr(kvt_last_error(), "offset"));
  REQUIRE(kvt_tier_promote_trim(&e, t, tok, 32, 3, NULL) == 0);
  const kvt_layer *tl = kvt_entry_layer(e, 0);
  CHECK(tl->offset == 3 && tl->tensors[0].shape[2] == 3);
  /* Row p of head h: [h][p][0..8) of F16. */
  for (int h = 0; h < 2; h++)
    CHECK(memcmp((const uint8_t *)tl->tensors[1].data + h * 3 * 16,
                 (const uint8_t *)l.tensors[1].data + h * 32 * 16, 48) == 0);
  kvt_entry_free(e);
  /* The refusal was not taken for damage: the entry is still served. */
  REQUIRE(kvt_tier_promote(&e, t, tok, 32, NULL) == 0);
  kvt_entry_free(e);
  t_layer_free(&l);
  kvt_tier_free(t);
}

/* A layer file claiming more rows than it holds is never loaded. */
static void test_layer_file(void) {
  kvt_rng r = {13};
  char *p = t_join(g_dir, "layer.safetensors");
  kvt_layer l = t_kv(&r, KVT_DTYPE_F16, 1, 2, 32, 8, 1000000000);
  char *meta = NULL;
  CHECK_EQ_INT(kvt_layer_save(&meta, p, &l, 0, KVT_STORAGE_NATIVE, 0600),
               KVT_EINVAL);
  l.offset = 32;
  REQUIRE(kvt_layer_save(&meta, p, &l, 0, KVT_STORAGE_NATIVE, 0600) == 0);
  kvt_entry *e = NULL;
  REQUIRE(kvt_layer_load(&e, p, meta) == 0);
  kvt_entry_free(e);
  char *at = strstr(meta, "\"offset\": 32");
  REQUIRE(at);
  size_t pre = (size_t)(at - meta);
  char *bad = malloc(strlen(meta) + 16);
  memcpy(bad, meta, pre);
  sprintf(bad + pre, "\"offset\": 1000000000%s", at + strlen("\"offset\": 32"));
  e = NULL;
  CHECK_EQ_INT(kvt_layer_load(&e, p, bad), KVT_ECORRUPT);
  CHECK(e == NULL);
  free(bad);
  kvt_free(meta);
  t_layer_free(&l);
  remove(p);
  free(p);
}

/* A reference-format entry (no checksums) whose manifest claims offset 10^9
 * for 16 rows: adopted by reconcile (its files are well-formed) but never
 * promoted; a correct sibling is. */
static void write_ref_entry(const char *cache, const int32_t *tok, int n,
                            int64_t claimed, kvt_rng *r) {
  char h[65];
  kvt_token_hash(h, tok, (size_t)n);
  char *data = t_join(cache, "data");
  mkdir(cache, 0700);
  mkdir(data, 0700);
  char *ed = t_join(data, h);
  REQUIRE(mkdir(ed, 0700) == 0);
  kvt_layer l = t_kv(r, KVT_DTYPE_F16, 1, 2, n, 8, n);
  char *lp = t_join(ed, "layer_0.safetensors");
  char *meta = NULL;
  REQUIRE(kvt_layer_save(&meta, lp, &l, 0, KVT_STORAGE_COMPAT, 0600) == 0);
  char off[64];
  snprintf(off, sizeof off, "\"offset\": %d", n);
  char *at = strstr(meta, off);
  REQUIRE(at);
  char man[4096];
  snprintf(man, sizeof man,
           "{\"num_layers\": 1, \"layers\": [%.*s\"offset\": %lld%s], "
           "\"memory_bytes\": 4096, \"num_tokens\": %d}",
           (int)(at - meta), meta, (long long)claimed, at + strlen(off), n);
  char *mp = t_join(ed, "manifest.json");
  REQUIRE(t_write_all(mp, man, strlen(man)) == 0);
  char *tp = t_join(ed, "tokens.bin");
  REQUIRE(t_write_all(tp, tok, (size_t)n * 4) == 0);
  kvt_free(meta);
  t_layer_free(&l);
  free(lp);
  free(mp);
  free(tp);
  free(ed);
  free(data);
}

static void test_reference_entry(void) {
  char *cache = t_join(g_dir, "ref");
  kvt_rng r = {14};
  int32_t bad[16], good[16];
  toks(bad, 16, 1);
  toks(good, 16, 50);
  write_ref_entry(cache, bad, 16, 1000000000, &r);
  write_ref_entry(cache, good, 16, 16, &r);
  kvt_options o = KVT_OPTIONS_INIT;
  o.cache_dir = cache;
  kvt_tier *t = NULL;
  REQUIRE(kvt_tier_open(&t, &o) == 0);
  kvt_entry *e = NULL;
  CHECK_EQ_INT(kvt_tier_promote(&e, t, bad, 16, NULL), KVT_ECORRUPT);
  CHECK(e == NULL && strstr(kvt_last_error(), "offset"));
  REQUIRE(kvt_tier_promote(&e, t, good, 16, NULL) == 0);
  CHECK_EQ_INT(kvt_entry_layer(e, 0)->offset, 16);
  kvt_entry_free(e);
  kvt_tier_free(t);
  free(cache);
}

static void *g_bufs[8];
static int g_nbufs;
static void *own_alloc(void *ctx, uint32_t layer, uint32_t tensor,
                       const kvt_tensor *desc) {
  (void)ctx;
  (void)layer;
  (void)tensor;
  return g_nbufs < 8 ? (g_bufs[g_nbufs++] = malloc(desc->nbytes)) : NULL;
}

/* Chunked store: only rows below offset go into chunks, so a prefix lookup
 * never offers rows past it. */
static void test_chunked_rows(void) {
  kvt_tier *t = open_tier("chunked", 16);
  kvt_rng r = {15};
  int32_t tok[40], q[60];
  toks(tok, 40, 900);
  memcpy(q, tok, sizeof tok);
  toks(q + 40, 20, -50);
  kvt_layer l = t_kv(&r, KVT_DTYPE_F16, 1, 2, 40, 8, 20); /* 20 valid rows */
  REQUIRE(kvt_tier_spill(t, tok, 40, &l, 1, 100) == 0);
  REQUIRE(kvt_tier_flush(t, 30000) == 0);
  kvt_entry_info info;
  REQUIRE(kvt_tier_lookup_prefix(&info, t, q, 60) == 0);
  CHECK_EQ_INT(info.num_tokens, 40); /* the entry itself */
  int32_t q2[60];
  memcpy(q2, q, sizeof q2);
  q2[30] = -1; /* diverges at 30: only the 16-token chunk can serve it */
  REQUIRE(kvt_tier_lookup_prefix(&info, t, q2, 60) == 0);
  CHECK_EQ_INT(info.num_tokens, 16);
  kvt_entry *e = NULL;
  REQUIRE(kvt_tier_promote(&e, t, tok, 40, NULL) == 0);
  CHECK(t_layer_eq(kvt_entry_layer(e, 0), &l));
  kvt_entry_free(e);
  kvt_promote_opts po = KVT_PROMOTE_OPTS_INIT;
  po.flags = KVT_PROMOTE_PREFIX;
  REQUIRE(kvt_tier_promote(&e, t, q2, 60, &po) == 0);
  CHECK(kvt_entry_layer(e, 0)->offset == 16 &&
        kvt_entry_layer(e, 0)->tensors[0].shape[2] == 16);
  kvt_entry_free(e);
  /* The same prefix into the caller's buffers, without a free_buf: they
   * stay the caller's (freed here, after the entry). */
  g_nbufs = 0;
  po.alloc = own_alloc;
  REQUIRE(kvt_tier_promote(&e, t, q2, 60, &po) == 0);
  CHECK_EQ_INT(g_nbufs, 2);
  CHECK(kvt_entry_layer(e, 0)->tensors[0].data == g_bufs[0]);
  kvt_entry_free(e);
  for (int i = 0; i < g_nbufs; i++)
    free(g_bufs[i]);
  t_layer_free(&l);
  kvt_tier_free(t);
}

int main(void) {
  g_dir = kvt_test_tmpdir("kvoffset");
  RUN(test_spill_refused);
  RUN(test_trim_within_offset);
  RUN(test_layer_file);
  RUN(test_reference_entry);
  RUN(test_chunked_rows);
  return kvt_test_done();
}
