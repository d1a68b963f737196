/*
 * test_tier_isolation.c - namespaces never meet. Two tiers on one directory
 * that differ in model_id, or calls that differ in cache_salt (a salt and
 * another, a salt and none), never find, promote, read or prefix-match each
 * other's entries: whole tails, chain records, and chunk-aligned prefixes of
 * a chain no spill ended at; through the RAM tier; after a reopen and after
 * the index is rebuilt from the files (KVT_OPEN_REINDEX). Each case has its
 * positive control: the owner's own calls still hit, bit for bit. Also the
 * documented known-answer names (docs/FORMAT.md section 6) and the refusal
 * of a model_id in compat mode; a tail directory of another salt put in
 * place of an entry's own is refused. Public API only.
 */
#include "fmt_testlib.h"
#include "tier_testlib.h"
#include "kvtier.h"
#include "kvtier_sys.h"
#include "base/hash.h"
#include "base/salt.h"
#include "base/io.h"
#include "format/chunk.h"

#include <sqlite3.h>

#define C 16
#define NL 2

static char *g_dir;

/* One namespace: a model_id (NULL: none) and a cache_salt (NULL: none). */
typedef struct ns {
  const char *model, *salt;
} ns;

static kvt_tier *open_ns(const char *dir, const ns *n, unsigned flags) {
  kvt_options o = KVT_OPTIONS_INIT;
  o.cache_dir = dir;
  o.durability = KVT_DURABILITY_NONE;
  o.chunk_tokens = C;
  o.model_id = n->model;
  o.host_cache_bytes = 64u << 20; /* the RAM tier on: it must isolate too */
  o.flags = flags;
  kvt_tier *t;
  REQUIRE(kvt_tier_open(&t, &o) == 0);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  return t;
}

static kvt_call_opts co_of(const ns *n) {
  kvt_call_opts co = KVT_CALL_OPTS_INIT;
  co.cache_salt = n->salt;
  co.cache_salt_len = n->salt ? strlen(n->salt) : 0;
  return co;
}

static kvt_promote_opts po_of(const ns *n, unsigned flags) {
  kvt_promote_opts po;
  kvt_promote_opts_init(&po, KVT_PROMOTE_OPTS_VERSION);
  po.cache_salt = n->salt;
  po.cache_salt_len = n->salt ? strlen(n->salt) : 0;
  po.flags = flags;
  return po;
}

static void spill(kvt_tier *t, const ns *n, const int32_t *tok, int len) {
  kvt_layer l[NL];
  for (int i = 0; i < NL; i++)
    l[i] = t_kv_tokens(tok, len, len, 8, i);
  kvt_call_opts co = co_of(n);
  REQUIRE(kvt_tier_spill_ex(t, tok, (size_t)len, l, NL, 1000, &co) == 0);
  for (int i = 0; i < NL; i++)
    t_layer_free(&l[i]);
}

/* The prompts: p (64 tokens); entries at p[0, 44) (2 chunks + a tail) and
 * p[0, 48) (a chain record: 3 pure chunks); r = p[0, 32) + 20 other tokens,
 * whose longest stored prefix is the chain's 2-chunk prefix alone. */
static int32_t g_p[64], g_r[52];

/* Every way of reaching a stored state, under namespace n on tier t: the
 * number of calls that found something. With own = 1 each must find its
 * state bit for bit (the control); with own = 0 none may find anything. */
/* A call's success counted; for the owner, a miss is a failure here. */
#define GOT(call) got(own, (call) == 0, #call, __LINE__)
static int got(int own, int ok, const char *what, int line) {
  if (own && !ok)
    fprintf(stderr, "line %d: the owner missed: %s (%s)\n", line, what,
            kvt_last_error());
  if (own)
    CHECK(ok);
  return ok;
}

static int probe(kvt_tier *t, const ns *n, int own) {
  int found = 0;
  kvt_call_opts co = co_of(n);
  kvt_entry_info info;
  kvt_entry *e = NULL;
  const int lens[2] = {44, 48};
  for (int k = 0; k < 2; k++) {
    int len = lens[k];
    if (GOT(kvt_tier_lookup_ex(&info, t, g_p, (size_t)len, &co))) {
      found++;
      if (own) {
        CHECK_EQ_INT(info.num_tokens, len);
        e = NULL;
        CHECK(kvt_tier_read_entry_ex(&e, t, g_p, (size_t)len, info.token_hash,
                                     &co) == 0);
        CHECK(e && t_kv_matches(e, g_p, len, len, NL));
        kvt_entry_free(e);
      }
    }
    kvt_promote_opts po = po_of(n, 0);
    e = NULL;
    if (GOT(kvt_tier_promote(&e, t, g_p, (size_t)len, &po))) {
      found++;
      if (own)
        CHECK(t_kv_matches(e, g_p, len, len, NL));
      kvt_entry_free(e);
    }
    kvt_promise *pr = NULL;
    int arc = kvt_tier_promote_async(&pr, t, g_p, (size_t)len, &po);
    CHECK(arc == 0 || arc == KVT_ENOTFOUND); /* a miss may be known at once */
    e = NULL;
    if (GOT(arc || kvt_promise_wait(pr, 30000) || kvt_promise_result(&e, pr))) {
      found++;
      if (own)
        CHECK(t_kv_matches(e, g_p, len, len, NL));
      kvt_entry_free(e);
    }
    kvt_promise_free(pr);
    e = NULL;
    if (GOT(kvt_tier_promote_trim(&e, t, g_p, (size_t)len, 40, &po))) {
      found++;
      if (own) {
        kvt_layer full = t_kv_tokens(g_p, len, len, 8, 0);
        CHECK(e && t_rows_match(&kvt_entry_layer(e, 0)->tensors[0],
                                &full.tensors[0], 40));
        t_layer_free(&full);
      }
      kvt_entry_free(e);
    }
  }
  /* Prefixes: of the whole prompt (the 48-token record), and a chain's
   * chunk-aligned prefix no spill ended at (32 of r's tokens). */
  const struct {
    const int32_t *q;
    int n, want;
  } pre[2] = {{g_p, 64, 48}, {g_r, 52, 32}};
  for (int k = 0; k < 2; k++) {
    if (GOT(kvt_tier_lookup_prefix_ex(&info, t, pre[k].q, (size_t)pre[k].n,
                                      &co))) {
      found++;
      if (own) {
        CHECK_EQ_INT(info.num_tokens, pre[k].want);
        e = NULL;
        CHECK(kvt_tier_read_entry_ex(&e, t, pre[k].q, info.num_tokens,
                                     info.token_hash, &co) == 0);
        CHECK(e && t_kv_matches(e, pre[k].q, pre[k].want, pre[k].want, NL));
        kvt_entry_free(e);
      }
    }
    kvt_promote_opts po = po_of(n, KVT_PROMOTE_PREFIX);
    e = NULL;
    if (GOT(kvt_tier_promote(&e, t, pre[k].q, (size_t)pre[k].n, &po))) {
      found++;
      if (own)
        CHECK(t_kv_matches(e, pre[k].q, pre[k].want, pre[k].want, NL));
      kvt_entry_free(e);
    }
  }
  return found;
}

/* The other namespace's names, read by name: refused (never served). */
static void read_foreign(kvt_tier *t, const ns *n, char names[2][65]) {
  kvt_call_opts co = co_of(n);
  const int lens[2] = {44, 48};
  for (int k = 0; k < 2; k++) {
    kvt_entry *e = NULL;
    CHECK(kvt_tier_read_entry_ex(&e, t, g_p, (size_t)lens[k], names[k], &co) !=
          0);
    CHECK(e == NULL);
  }
}

static void names_of(kvt_tier *t, const ns *n, char names[2][65]) {
  kvt_call_opts co = co_of(n);
  const int lens[2] = {44, 48};
  for (int k = 0; k < 2; k++) {
    kvt_entry_info info;
    REQUIRE(kvt_tier_lookup_ex(&info, t, g_p, (size_t)lens[k], &co) == 0);
    memcpy(names[k], info.token_hash, 65);
  }
}

#define N_CALLS 12 /* what probe counts for its own namespace */

/* a spills; b, on the same directory, never meets it: while a is open (b's
 * RAM tier and a's both warm), after a reopen, after a reindex; a's own
 * calls hit throughout. */
static void pair(const char *tag, const ns *a, const ns *b) {
  char *dir = t_join(g_dir, tag);
  kvt_tier *ta = open_ns(dir, a, 0);
  spill(ta, a, g_p, 44);
  spill(ta, a, g_p, 48);
  REQUIRE(kvt_tier_flush(ta, 30000) == 0);
  CHECK_EQ_INT(probe(ta, a, 1), N_CALLS); /* also warms a's RAM tier */
  char names[2][65];
  names_of(ta, a, names);
  /* One writer per directory: b on a's own handle when they share a
   * model_id (salts: a's warm RAM tier must not leak), else after it. */
  int same_handle = a->model == b->model ||
                    (a->model && b->model && !strcmp(a->model, b->model));
  if (same_handle) {
    CHECK_EQ_INT(probe(ta, b, 0), 0);
    read_foreign(ta, b, names);
  }
  REQUIRE(kvt_tier_close(ta, 30000) == 0);
  kvt_tier_free(ta);
  kvt_tier *tb;
  for (int pass = 0; pass < 2; pass++) { /* reopened, then reindexed */
    unsigned fl = pass ? KVT_OPEN_REINDEX : 0;
    tb = open_ns(dir, b, fl);
    CHECK_EQ_INT(probe(tb, b, 0), 0);
    read_foreign(tb, b, names);
    REQUIRE(kvt_tier_close(tb, 30000) == 0);
    kvt_tier_free(tb);
    ta = open_ns(dir, a, 0);
    CHECK_EQ_INT(probe(ta, a, 1), N_CALLS);
    REQUIRE(kvt_tier_close(ta, 30000) == 0);
    kvt_tier_free(ta);
  }
  free(dir);
}

static void test_model_ids(void) {
  ns a = {"model-a", NULL}, b = {"model-b", NULL}, none = {NULL, NULL};
  pair("models", &a, &b);
  pair("model-none", &a, &none); /* a model_id and none */
  pair("none-model", &none, &a);
  /* "a" salted "b" against "ab" unsalted: the encodings never collide. */
  ns as = {"a", "b"}, ab = {"ab", NULL};
  pair("concat", &as, &ab);
}

static void test_salts(void) {
  ns s1 = {NULL, "tenant-1"}, s2 = {NULL, "tenant-2"}, none = {NULL, NULL};
  pair("salts", &s1, &s2);
  pair("salt-none", &s1, &none);
  pair("none-salt", &none, &s1);
  ns m1 = {"m", "tenant-1"}, m2 = {"m", "tenant-2"}, mn = {"m", NULL};
  pair("model-salts", &m1, &m2);
  pair("model-salt-none", &m1, &mn);
}

/* The documented names (docs/FORMAT.md section 6, computed with Python's
 * hashlib), tokens t[i] = 7919 i - 3 for i = 0..3. */
static void test_known_answers(void) {
  char *dir = t_join(g_dir, "kat");
  int32_t tok[4];
  for (int i = 0; i < 4; i++)
    tok[i] = 7919 * i - 3;
  const struct {
    const char *model, *salt, *want;
  } v[] = {
      {NULL, NULL,
       "cdf8f065e3fb70b634375e35e3d12965ed8b32f9e5bc821678d6dab9f12b7d6a"},
      {"llama-3-8b", NULL,
       "890f4c5d381748cc787eb44fb43b0d1a22690c8de2d7139f76d192914d7b8730"},
      {"llama-3-8b", "tenant-1",
       "9737158356812b1ba06cfdb78ca736101de66154886c499d661a964f79ef8d00"},
  };
  for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) {
    char sub[32];
    snprintf(sub, sizeof sub, "%zu", i);
    char *d = t_join(dir, sub);
    ns n = {v[i].model, v[i].salt};
    kvt_tier *t = open_ns(d, &n, 0);
    kvt_layer l = t_kv_tokens(tok, 4, 4, 8, 0);
    kvt_call_opts co = co_of(&n);
    REQUIRE(kvt_tier_spill_ex(t, tok, 4, &l, 1, 100, &co) == 0);
    t_layer_free(&l);
    REQUIRE(kvt_tier_flush(t, 30000) == 0);
    kvt_entry_info info;
    REQUIRE(kvt_tier_lookup_ex(&info, t, tok, 4, &co) == 0);
    if (strcmp(info.token_hash, v[i].want))
      fprintf(stderr, "vector %zu: got %s\n", i, info.token_hash);
    CHECK(strcmp(info.token_hash, v[i].want) == 0);
    if (!v[i].salt) { /* the test library's own derivation agrees */
      char h[65];
      kvt_test_model_hash(h, v[i].model, tok, 4);
      CHECK(strcmp(h, v[i].want) == 0);
    }
    REQUIRE(kvt_tier_close(t, 30000) == 0);
    kvt_tier_free(t);
    free(d);
  }
  free(dir);
}

/* The chunk seed of a model_id tier's unsalted spill (docs/FORMAT.md section
 * 10: the salt field holds the hex of N; computed with Python's hashlib),
 * layout_hash 0x0123456789abcdef. */
static void test_chunk_seed_known_answer(void) {
  kvti_salt n;
  REQUIRE(kvti_salt_model(&n, "llama-3-8b") == 0 && n.has);
  kvti_salt j;
  REQUIRE(kvti_salt_join(&j, &n, &(kvti_salt){0}) == 0);
  CHECK(j.has && memcmp(j.d, n.d, 32) == 0); /* no salt: N alone */
  char hex[65];
  kvti_hex32(hex, n.d);
  CHECK(strcmp(hex, "2bb4b98675a06e59c809803de3c255d6"
                    "535116611608fd7959f3d6b8b7f9686c") == 0);
  uint8_t *enc = NULL;
  size_t len = 0;
  REQUIRE(kvti_chunk_ns_encode(&enc, &len, "llama-3-8b", hex) == 0);
  uint8_t seed[32];
  REQUIRE(kvti_chunk_seed(seed, enc, len, 0x0123456789abcdefull) == 0);
  kvti_hex32(hex, seed);
  CHECK(strcmp(hex, "93ee055b59aa3f79f189a6f135d20d5a"
                    "34f32cff9ae505390b05fb8975b92d45") == 0);
  int32_t tok[16];
  for (int i = 0; i < 16; i++)
    tok[i] = 7919 * i - 3;
  uint8_t k0[32];
  REQUIRE(kvti_chunk_key(k0, seed, tok, 16) == 0);
  kvti_hex32(hex, k0);
  CHECK(strcmp(hex, "59d285bc2bfc8cbd325539ba63d21ecd"
                    "ae4cda5e43a6c92ac6d537a51c27fe6b") == 0);
  kvti_free(enc);
}

/* A compat directory holds the reference's names (no namespace): a model_id
 * there is refused, not silently shared. */
static void test_compat_refuses_model_id(void) {
  char *dir = t_join(g_dir, "compat");
  kvt_options o = KVT_OPTIONS_INIT;
  o.cache_dir = dir;
  o.storage_mode = KVT_STORAGE_COMPAT;
  o.model_id = "m";
  kvt_tier *t = NULL;
  CHECK_EQ_INT(kvt_options_validate(&o), KVT_EINVAL);
  CHECK_EQ_INT(kvt_tier_open(&t, &o), KVT_EINVAL);
  CHECK(t == NULL);
  CHECK(strstr(kvt_last_error(), "model_id") != NULL);
  o.model_id = ""; /* empty = none */
  CHECK_EQ_INT(kvt_options_validate(&o), 0);
  free(dir);
}

/* One model's spill: L layers of random KV (H heads, dtype dt) over tok. */
static void spill_layout(kvt_tier *t, const int32_t *tok, int n, int L, int H,
                         kvt_dtype dt, uint64_t seed) {
  kvt_rng r = {seed};
  kvt_layer l[4];
  memset(l, 0, sizeof l);
  REQUIRE(L >= 1 && L <= 4);
  for (int i = 0; i < L; i++)
    l[i] = t_kv(&r, dt, 1, H, n + 8, 8, n);
  REQUIRE(kvt_tier_spill(t, tok, (size_t)n, l, (uint32_t)L, 1000) == 0);
  for (int i = 0; i < L; i++)
    t_layer_free(&l[i]);
}

static uint64_t layout_misses(kvt_tier *t) {
  kvt_stats st = KVT_STATS_INIT;
  REQUIRE(kvt_tier_stats(&st, t) == 0);
  return st.layout_misses;
}

/* One directory, no model_id (the real client's defaults): model A (2 F16
 * layers of 2 heads) spills; model B of another layout - a layer count,
 * head count or dtype of its own - spills its own prompt, and is then never
 * served A's: exact, trimmed, prefix, async and read by name are misses
 * counted in layout_misses (no error, nothing removed), while B's own hit
 * and A's hit for A. A handle that spilled both layouts serves both. */
static void test_layout_mismatch(void) {
  const struct {
    const char *tag;
    int L, H;
    kvt_dtype dt;
  } b[] = {{"layers", 3, 2, KVT_DTYPE_F16},
           {"heads", 2, 4, KVT_DTYPE_F16},
           {"dtype", 2, 2, KVT_DTYPE_BF16}};
  for (size_t c = 0; c < sizeof b / sizeof b[0]; c++) {
    for (int chunk = 0; chunk < 2; chunk++) {
      char tag[64];
      snprintf(tag, sizeof tag, "layout-%s-%d", b[c].tag, chunk);
      char *dir = t_join(g_dir, tag);
      kvt_options o = KVT_OPTIONS_INIT;
      o.cache_dir = dir;
      o.durability = KVT_DURABILITY_NONE;
      o.chunk_tokens = chunk ? C : 0;
      kvt_tier *t;
      REQUIRE(kvt_tier_open(&t, &o) == 0);
      REQUIRE(kvt_tier_start_writer(t) == 0);
      spill_layout(t, g_p, 48, 2, 2, KVT_DTYPE_F16, 1); /* model A */
      REQUIRE(kvt_tier_flush(t, 30000) == 0);
      REQUIRE(kvt_tier_close(t, 30000) == 0);
      kvt_tier_free(t);

      REQUIRE(kvt_tier_open(&t, &o) == 0); /* model B */
      REQUIRE(kvt_tier_start_writer(t) == 0);
      kvt_entry_info info;
      REQUIRE(kvt_tier_lookup(&info, t, g_p, 48) == 0); /* index only */
      char name[65];
      memcpy(name, info.token_hash, 65);
      int32_t own[40];
      for (int i = 0; i < 40; i++)
        own[i] = -7 - i;
      spill_layout(t, own, 40, b[c].L, b[c].H, b[c].dt, 2);
      REQUIRE(kvt_tier_flush(t, 30000) == 0);
      kvt_entry *e = NULL;
      kvt_promote_opts po = KVT_PROMOTE_OPTS_INIT;
      CHECK_EQ_INT(kvt_tier_promote(&e, t, g_p, 48, NULL), KVT_ENOTFOUND);
      CHECK(e == NULL);
      CHECK_EQ_INT(kvt_tier_promote_trim(&e, t, g_p, 48, 32, &po),
                   KVT_ENOTFOUND);
      po.flags = KVT_PROMOTE_PREFIX;
      CHECK_EQ_INT(kvt_tier_promote(&e, t, g_p, 64, &po), KVT_ENOTFOUND);
      CHECK_EQ_INT(kvt_tier_read_entry(&e, t, g_p, 48, name), KVT_ENOTFOUND);
      kvt_promise *pr = NULL;
      REQUIRE(kvt_tier_promote_async(&pr, t, g_p, 48, NULL) == 0);
      REQUIRE(kvt_promise_wait(pr, 30000) == 0);
      CHECK_EQ_INT(kvt_promise_result(&e, pr), KVT_ENOTFOUND);
      kvt_promise_free(pr);
      CHECK(e == NULL);
      CHECK_EQ_INT(layout_misses(t), 5);
      kvt_stats st = KVT_STATS_INIT;
      REQUIRE(kvt_tier_stats(&st, t) == 0);
      CHECK_EQ_INT(st.quarantined, 0); /* a miss, never damage */
      CHECK(kvt_tier_promote(&e, t, own, 40, NULL) == 0); /* B's own */
      kvt_entry_free(e);
      e = NULL;
      /* The same handle spilling A's layout too (one model with two
       * layouts, e.g. KV quantization switched): both served. */
      spill_layout(t, g_r, 52, 2, 2, KVT_DTYPE_F16, 3);
      REQUIRE(kvt_tier_flush(t, 30000) == 0);
      CHECK(kvt_tier_promote(&e, t, g_p, 48, NULL) == 0);
      kvt_entry_free(e);
      e = NULL;
      CHECK(kvt_tier_promote(&e, t, own, 40, NULL) == 0);
      kvt_entry_free(e);
      CHECK_EQ_INT(layout_misses(t), 5);
      REQUIRE(kvt_tier_close(t, 30000) == 0);
      kvt_tier_free(t);
      /* A's entry is still stored and A (its layout) is served it. */
      REQUIRE(kvt_tier_open(&t, &o) == 0);
      REQUIRE(kvt_tier_start_writer(t) == 0);
      spill_layout(t, g_r, 20, 2, 2, KVT_DTYPE_F16, 4);
      e = NULL;
      CHECK(kvt_tier_promote(&e, t, g_p, 48, NULL) == 0);
      kvt_entry_free(e);
      CHECK_EQ_INT(layout_misses(t), 0);
      REQUIRE(kvt_tier_close(t, 30000) == 0);
      kvt_tier_free(t);
      free(dir);
    }
  }
}

/* Spills g_p[0, 44) under a (the KV t_kv_tokens gives) and under b (one
 * value changed in every tensor: the other salt's KV differs), flushes, and
 * looks both up. */
static void spill_two_salts(kvt_tier *t, const ns *a, const ns *b,
                            kvt_entry_info *ia, kvt_entry_info *ib) {
  spill(t, a, g_p, 44);
  kvt_layer l[NL];
  for (int i = 0; i < NL; i++) {
    l[i] = t_kv_tokens(g_p, 44, 44, 8, i);
    for (uint32_t j = 0; j < l[i].num_tensors; j++)
      ((float *)l[i].tensors[j].data)[3] += 1.0f;
  }
  kvt_call_opts ca = co_of(a), cb = co_of(b);
  REQUIRE(kvt_tier_spill_ex(t, g_p, 44, l, NL, 1000, &cb) == 0);
  for (int i = 0; i < NL; i++)
    t_layer_free(&l[i]);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  REQUIRE(kvt_tier_lookup_ex(ia, t, g_p, 44, &ca) == 0);
  REQUIRE(kvt_tier_lookup_ex(ib, t, g_p, 44, &cb) == 0);
  REQUIRE(strcmp(ia->token_hash, ib->token_hash) != 0);
}

/* Neither a promote of g_p[0, 44) under n nor a read of it by its name hash
 * is served. */
static void refused(kvt_tier *t, const ns *n, const char *hash) {
  kvt_promote_opts po = po_of(n, 0);
  kvt_call_opts co = co_of(n);
  kvt_entry *e = NULL;
  int rc = kvt_tier_promote(&e, t, g_p, 44, &po);
  CHECK(rc != 0);
  if (rc == 0)
    kvt_entry_free(e);
  e = NULL;
  rc = kvt_tier_read_entry_ex(&e, t, g_p, 44, hash, &co);
  CHECK(rc != 0);
  if (rc == 0)
    kvt_entry_free(e);
}

/* A chained entry's tail directory replaced by the tail of the same tokens
 * spilled under another cache_salt (a copied or restored directory): every
 * file of it is intact, its tokens are the request's and its chain is whole,
 * but its files name the other salt's entry (the tokens hash to the name
 * under the salt they were stored with), so the read refuses it and the
 * other salt's KV is never served under this salt's name. */
static void test_foreign_chain_in_tail(void) {
  char *dir = kvt_test_tmpdir("iso-foreign");
  ns a = {NULL, "salt-one"}, b = {NULL, "salt-two"};
  kvt_tier *t = open_ns(dir, &a, 0);
  kvt_entry_info ia, ib;
  spill_two_salts(t, &a, &b, &ia, &ib);
  kvt_tier_free(t);
  char pa[4200], pb[4200];
  snprintf(pa, sizeof pa, "%s/data/%s", dir, ia.token_hash);
  snprintf(pb, sizeof pb, "%s/data/%s", dir, ib.token_hash);
  REQUIRE(kvt_test_exists(pa) && kvt_test_exists(pb));
  kvt_test_rmtree(pa);
  REQUIRE(rename(pb, pa) == 0);
  t = open_ns(dir, &a, 0);
  refused(t, &a, ia.token_hash);
  /* The other salt's chain itself is untouched and still its own. */
  kvt_stats st = KVT_STATS_INIT;
  REQUIRE(kvt_tier_stats(&st, t) == 0);
  CHECK_EQ_INT(st.chunks_quarantined, 0);
  kvt_tier_free(t);
}

/* Replaces the first occurrence of from (64 hex) by to in file path. */
static void swap_in_file(const char *path, const char *from, const char *to) {
  size_t len = 0;
  char *b = kvt_test_read_file(path, &len);
  REQUIRE(b);
  char *at = strstr(b, from);
  REQUIRE(at);
  memcpy(at, to, 64);
  FILE *fp = fopen(path, "wb");
  REQUIRE(fp && fwrite(b, 1, len, fp) == len && fclose(fp) == 0);
  /* The manifest's own checksum, recomputed (a consistent rewrite). */
  char sum[4200], x[24];
  snprintf(sum, sizeof sum, "%.*s/manifest.sum",
           (int)(strrchr(path, '/') - path), path);
  kvti_xxh3_format(x, kvti_xxh3(b, len));
  fp = fopen(sum, "wb");
  REQUIRE(fp && fprintf(fp, "%s\n", x) > 0 && fclose(fp) == 0);
  free(b);
}

/* A chained entry whose tail (manifest and index row alike, so they agree)
 * names the chain of the same tokens stored under another cache_salt:
 * every file is intact, the tokens are the request's and that chain is
 * whole, but it is rooted in the other salt's namespace. A read checks that
 * the chain it assembles belongs to the entry's namespace and refuses it;
 * the other salt's KV rows never come back under this salt's name. Before,
 * the promote returned them joined with this entry's tail. */
static void test_foreign_chain_named(void) {
  char *dir = kvt_test_tmpdir("iso-chain");
  ns a = {NULL, "salt-one"}, b = {NULL, "salt-two"};
  kvt_tier *t = open_ns(dir, &a, 0);
  kvt_entry_info ia, ib;
  spill_two_salts(t, &a, &b, &ia, &ib); /* a chain row differs */
  kvt_chunk_info *cha = NULL, *chb = NULL;
  size_t na = 0, nb = 0;
  REQUIRE(kvt_tier_entry_chain(&cha, &na, NULL, t, ia.token_hash, 0) == 0);
  REQUIRE(kvt_tier_entry_chain(&chb, &nb, NULL, t, ib.token_hash, 0) == 0);
  REQUIRE(na == 2 && nb == 2 && strcmp(cha[1].key, chb[1].key) != 0);
  char ka[65], kb[65];
  snprintf(ka, sizeof ka, "%s", cha[1].key);
  snprintf(kb, sizeof kb, "%s", chb[1].key);
  kvt_free(cha);
  kvt_free(chb);
  kvt_tier_free(t);
  char mf[4200], sql[512], db[4200];
  snprintf(mf, sizeof mf, "%s/data/%s/manifest.json", dir, ia.token_hash);
  swap_in_file(mf, ka, kb);
  snprintf(sql, sizeof sql,
           "UPDATE kvtier_chained_entries SET last_key = X'%s' WHERE "
           "token_hash = X'%s'",
           kb, ia.token_hash);
  snprintf(db, sizeof db, "%s/index.db", dir);
  sqlite3 *h = NULL;
  REQUIRE(sqlite3_open(db, &h) == SQLITE_OK);
  REQUIRE(sqlite3_exec(h, sql, NULL, NULL, NULL) == SQLITE_OK);
  CHECK(sqlite3_changes(h) == 1);
  sqlite3_close(h);
  t = open_ns(dir, &a, 0);
  refused(t, &a, ia.token_hash);
  /* The other salt's entry is its own still (its chain was not damaged). */
  kvt_promote_opts pb = po_of(&b, 0);
  kvt_entry *e = NULL;
  CHECK(kvt_tier_promote(&e, t, g_p, 44, &pb) == 0);
  kvt_entry_free(e);
  kvt_tier_free(t);
}

int main(void) {
  g_dir = kvt_test_tmpdir("isolation");
  for (int i = 0; i < 64; i++)
    g_p[i] = 5000 + 37 * i;
  memcpy(g_r, g_p, 32 * sizeof(int32_t));
  for (int i = 32; i < 52; i++)
    g_r[i] = -100 - i;
  RUN(test_model_ids);
  RUN(test_salts);
  RUN(test_known_answers);
  RUN(test_chunk_seed_known_answer);
  RUN(test_compat_refuses_model_id);
  RUN(test_layout_mismatch);
  RUN(test_foreign_chain_in_tail);
  RUN(test_foreign_chain_named);
  return kvt_test_done();
}
