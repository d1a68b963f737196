/*
 * test_tier_hybrid.c - hybrid models (KV + arrays/Mamba state) in chunked
 * mode (public API): a prefix hit is served only where the state of that
 * length was stored - the entry's end or a kvt_tier_spill_prefix at a chunk
 * boundary - never from KV chunks alone, and always with the state of exactly
 * that length; boundary spills share the longer spill's chunks (none written
 * again); a trimmed promote of a hybrid entry is refused (its state is not
 * the prefix's).
 */
#include "fmt_testlib.h"
#include "kvtier.h"

#include <dirent.h>

#define C 16
#define N 100

static char *g_dir;
static int32_t g_p[N + 40];

/* KV row p depends on (token p, p): the same rows for every spill. */
static kvt_layer kv_layer(const int32_t *tok, int n) {
  return t_kv_tokens(tok, n, n, 4, 0);
}

/* The recurrent state after tokens[0, m): depends on every one of them. */
static kvt_layer state_layer(const int32_t *tok, int m) {
  kvt_layer l;
  kvt_layer_init(&l, KVT_LAYER_ARRAYS);
  l.num_tensors = 1;
  l.tensors = calloc(1, sizeof(kvt_tensor));
  kvt_tensor *t = &l.tensors[0];
  t->dtype = KVT_DTYPE_F32;
  t->ndim = 2;
  t->shape[0] = 1;
  t->shape[1] = 4;
  t->nbytes = 16;
  float *d = malloc(16);
  double acc = 0;
  for (int p = 0; p < m; p++)
    acc = acc * 0.5 + tok[p];
  d[0] = (float)m;
  d[1] = (float)acc;
  d[2] = (float)(m * 3 + 1);
  d[3] = -1.0f;
  t->data = d;
  return l;
}

/* The entry holds exactly the prefix of m tokens: KV rows and state. */
static int is_prefix_state(const kvt_entry *e, int m) {
  size_t n;
  kvt_entry_tokens(e, &n);
  if ((int)n != m || kvt_entry_num_layers(e) != 2)
    return 0;
  kvt_layer kv = kv_layer(g_p, m), st = state_layer(g_p, m);
  int ok = t_layer_eq(kvt_entry_layer(e, 0), &kv) &&
           t_layer_eq(kvt_entry_layer(e, 1), &st);
  t_layer_free(&kv);
  t_layer_free(&st);
  return ok;
}

/* A query sharing the first `shared` tokens of the prompt. */
static void query(int32_t *q, int shared, int len) {
  memcpy(q, g_p, (size_t)shared * 4);
  for (int i = shared; i < len; i++)
    q[i] = -7 - i;
}

static void test_hybrid(void) {
  char *dir = t_join(g_dir, "h");
  kvt_options o = KVT_OPTIONS_INIT;
  o.cache_dir = dir;
  o.durability = KVT_DURABILITY_NONE;
  o.chunk_tokens = C;
  o.model_id = "hybrid";
  kvt_tier *t;
  REQUIRE(kvt_tier_open(&t, &o) == 0);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  for (int i = 0; i < N + 40; i++)
    g_p[i] = 1000 + 3 * i;
  /* The whole prompt, then the states captured at 32 and 64 (the live KV
   * of all N tokens given: cut to the prefix). */
  kvt_layer l[2] = {kv_layer(g_p, N), state_layer(g_p, N)};
  REQUIRE(kvt_tier_spill(t, g_p, N, l, 2, 1000) == 0);
  REQUIRE(kvt_tier_flush(t, 30000) == 0);
  int chunks = kvt_test_each_chunk(dir, NULL, NULL);
  CHECK_EQ_INT(chunks, N / C);
  for (int m = 32; m <= 64; m += 32) {
    kvt_layer s = state_layer(g_p, m);
    kvt_layer b[2] = {l[0], s};
    REQUIRE(kvt_tier_spill_prefix(t, g_p, (size_t)m, b, 2, 500) == 0);
    t_layer_free(&s);
  }
  /* A KV layer that does not hold the tokens to store. */
  kvt_layer shortkv = kv_layer(g_p, 20);
  kvt_layer b2[2] = {shortkv, l[1]};
  CHECK_EQ_INT(kvt_tier_spill_prefix(t, g_p, 32, b2, 2, 500), KVT_EINVAL);
  t_layer_free(&shortkv);
  REQUIRE(kvt_tier_flush(t, 30000) == 0);
  CHECK_EQ_INT(kvt_test_each_chunk(dir, NULL, NULL),
               chunks); /* the chain is shared */
  /* Every query: the longest stored state, never chunks alone. */
  struct {
    int shared, want;
  } cases[] = {{N, N},   {N - 1, 64}, {70, 64}, {64, 64}, {63, 32},
               {50, 32}, {33, 32},    {31, 0},  {20, 0},  {5, 0}};
  kvt_promote_opts po = KVT_PROMOTE_OPTS_INIT;
  po.flags = KVT_PROMOTE_PREFIX;
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    int32_t q[N + 40];
    int len = cases[c].shared + 30;
    query(q, cases[c].shared, len);
    kvt_entry_info info;
    int rc = kvt_tier_lookup_prefix(&info, t, q, (size_t)len);
    kvt_entry *e = NULL;
    int prc = kvt_tier_promote(&e, t, q, (size_t)len, &po);
    if (cases[c].want == 0) {
      CHECK_EQ_INT(rc, KVT_ENOTFOUND);
      CHECK_EQ_INT(prc, KVT_ENOTFOUND);
      continue;
    }
    REQUIRE(rc == 0 && prc == 0);
    CHECK_EQ_INT(info.num_tokens, cases[c].want);
    if (!is_prefix_state(e, cases[c].want))
      fprintf(stderr, "case %zu: wrong state for %d tokens\n", c,
              cases[c].want);
    CHECK(is_prefix_state(e, cases[c].want));
    char h[65];
    kvt_test_model_hash(h, "hybrid", q, (size_t)cases[c].want);
    CHECK(strcmp(h, info.token_hash) == 0);
    kvt_entry_free(e);
    /* The drop-in's path: read_entry(prompt[:m], file_path). */
    REQUIRE(kvt_tier_read_entry(&e, t, q, info.num_tokens, info.token_hash) ==
            0);
    CHECK(is_prefix_state(e, cases[c].want));
    kvt_entry_free(e);
  }
  /* A chunk-aligned prefix no state was stored at: no entry to read. */
  char h48[65];
  kvt_test_model_hash(h48, "hybrid", g_p, 48);
  kvt_entry *e = NULL;
  CHECK_EQ_INT(kvt_tier_read_entry(&e, t, g_p, 48, h48), KVT_ENOTFOUND);
  /* Trimming cuts KV but not the state: refused. */
  CHECK_EQ_INT(kvt_tier_promote_trim(&e, t, g_p, N, 64, NULL),
               KVT_EUNSUPPORTED);
  CHECK_EQ_INT(kvt_tier_promote_trim(&e, t, g_p, N, 99, NULL),
               KVT_EUNSUPPORTED);
  /* The entries stay served after the refusals. */
  REQUIRE(kvt_tier_promote(&e, t, g_p, N, NULL) == 0);
  CHECK(is_prefix_state(e, N));
  kvt_entry_free(e);
  t_layer_free(&l[0]);
  t_layer_free(&l[1]);
  REQUIRE(kvt_tier_close(t, 30000) == 0);
  kvt_tier_free(t);
  free(dir);
}

int main(void) {
  g_dir = kvt_test_tmpdir("tierhybrid");
  RUN(test_hybrid);
  return kvt_test_done();
}
