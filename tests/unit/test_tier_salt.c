/*
 * test_tier_salt.c - per-request cache salts (kvt_call_opts, kvt_promote_opts
 * v2), whole-entry and chunked tiers: the same tokens spilled under two salts
 * and none are three entries, each served only to its own salt (lookup,
 * prefix lookup, promote sync/async/trimmed, read_entry, touch, remove); a
 * salted entry's name never reads for another salt (the SGLang #37058 / vLLM
 * #44701 cases: a tenant's prompt must not be a hit, exact or prefix, for
 * another); salts never share or see each other's chunks; salted entries
 * survive a reopen and an index rebuild under their salted keys; bad salts
 * and versions are refused; a salted entry is served from the host RAM tier.
 */
#include "fmt_testlib.h"
#include "kvtier.h"

#include <unistd.h>

#define C 16

static char *g_dir;

static kvt_tier *open_tier(const char *dir, uint32_t chunk) {
  kvt_options o = KVT_OPTIONS_INIT;
  o.cache_dir = dir;
  o.durability = KVT_DURABILITY_NONE;
  o.chunk_tokens = chunk;
  o.model_id = "m";
  kvt_tier *t;
  REQUIRE(kvt_tier_open(&t, &o) == 0);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  return t;
}

static kvt_call_opts salt_of(const char *s) {
  kvt_call_opts co = KVT_CALL_OPTS_INIT;
  co.cache_salt = s;
  co.cache_salt_len = s ? strlen(s) : 0;
  return co;
}

static kvt_promote_opts popts(const char *s, uint32_t flags) {
  kvt_promote_opts po = KVT_PROMOTE_OPTS_INIT;
  po.flags = flags;
  po.cache_salt = s;
  po.cache_salt_len = s ? strlen(s) : 0;
  return po;
}

static const char *SALT[3] = {"alice", "bob", NULL};

static void run(const char *tag, uint32_t chunk) {
  char *dir = t_join(g_dir, tag);
  kvt_tier *t = open_tier(dir, chunk);
  kvt_rng r = {77};
  int32_t a[72], q[90];
  for (int i = 0; i < 72; i++)
    a[i] = 40 + i;
  /* One layer set per salt: different KV for the same tokens. */
  kvt_layer l[3];
  for (int s = 0; s < 3; s++) {
    l[s] = t_kv(&r, KVT_DTYPE_F16, 1, 2, 72, 8, 72);
    kvt_call_opts co = salt_of(SALT[s]);
    REQUIRE(kvt_tier_spill_ex(t, a, 72, &l[s], 1, 100, &co) == 0);
  }
  REQUIRE(kvt_tier_flush(t, 30000) == 0);
  kvt_stats st = KVT_STATS_INIT;
  REQUIRE(kvt_tier_stats(&st, t) == 0);
  CHECK_EQ_INT(st.entries, 3);
  if (chunk)
    CHECK_EQ_INT(kvt_test_each_chunk(dir, NULL, NULL),
                 3 * (72 / C)); /* nothing shared */
  char name[3][65];
  for (int s = 0; s < 3; s++) {
    kvt_call_opts co = salt_of(SALT[s]);
    kvt_entry_info info;
    REQUIRE(kvt_tier_lookup_ex(&info, t, a, 72, &co) == 0);
    memcpy(name[s], info.token_hash, 65);
    kvt_promote_opts po = popts(SALT[s], 0);
    kvt_entry *e = NULL;
    REQUIRE(kvt_tier_promote(&e, t, a, 72, &po) == 0);
    CHECK(t_layer_eq(kvt_entry_layer(e, 0), &l[s]));
    CHECK(strcmp(kvt_entry_hash(e), name[s]) == 0);
    kvt_entry_free(e);
    kvt_promise *pr;
    REQUIRE(kvt_tier_promote_async(&pr, t, a, 72, &po) == 0);
    REQUIRE(kvt_promise_wait(pr, 30000) == 0);
    REQUIRE(kvt_promise_result(&e, pr) == 0);
    CHECK(t_layer_eq(kvt_entry_layer(e, 0), &l[s]));
    kvt_entry_free(e);
    kvt_promise_free(pr);
    /* Trimmed: the salt's own rows, named under its salt. */
    REQUIRE(kvt_tier_promote_trim(&e, t, a, 72, 40, &po) == 0);
    CHECK(memcmp(kvt_entry_layer(e, 0)->tensors[0].data, l[s].tensors[0].data,
                 40 * 16) == 0);
    kvt_call_opts c2 = salt_of(SALT[s]);
    kvt_entry_info ti;
    kvt_entry_free(e);
    CHECK(kvt_tier_touch_ex(t, a, 72, &c2) == 0);
    (void)ti;
  }
  char plain[65];
  kvt_test_model_hash(plain, "m", a, 72);
  CHECK(strcmp(name[2], plain) == 0); /* no salt: model_id "m"'s own name */
  CHECK(strcmp(name[0], name[1]) && strcmp(name[0], plain));
  /* A name never reads under another salt, nor without one. */
  for (int s = 0; s < 3; s++)
    for (int u = 0; u < 3; u++) {
      kvt_call_opts co = salt_of(SALT[u]);
      kvt_entry *e = NULL;
      int rc = kvt_tier_read_entry_ex(&e, t, a, 72, name[s], &co);
      if (s == u) {
        REQUIRE(rc == 0);
        CHECK(t_layer_eq(kvt_entry_layer(e, 0), &l[s]));
        kvt_entry_free(e);
      } else {
        CHECK_EQ_INT(rc, KVT_ENOTFOUND);
        CHECK(e == NULL);
      }
    }
  kvt_entry *e = NULL;
  CHECK_EQ_INT(kvt_tier_read_entry(&e, t, a, 72, name[0]), KVT_ENOTFOUND);
  kvt_call_opts ca = salt_of("alice"), cb = salt_of("bob"),
                cc = salt_of("carol");
  REQUIRE(kvt_tier_remove_ex(t, a, 72, &cb) == 0); /* bob's only */
  REQUIRE(kvt_tier_remove(t, a, 72) == 0);         /* the unsalted one */
  kvt_entry_info info;
  REQUIRE(kvt_tier_lookup_ex(&info, t, a, 72, &ca) == 0);
  CHECK_EQ_INT(kvt_tier_lookup_ex(&info, t, a, 72, &cb), KVT_ENOTFOUND);
  CHECK_EQ_INT(kvt_tier_lookup(&info, t, a, 72), KVT_ENOTFOUND);
  CHECK_EQ_INT(kvt_tier_touch(t, a, 72) == 0, chunk != 0); /* its chain */
  /* Prefix queries on a prompt only alice spilled (sharing 50 tokens, or
   * extending hers): a tenant only ever hits its own. */
  for (int i = 0; i < 72; i++)
    a[i] = 5000 + 7 * i;
  REQUIRE(kvt_tier_spill_ex(t, a, 72, &l[0], 1, 100, &ca) == 0);
  REQUIRE(kvt_tier_flush(t, 30000) == 0);
  REQUIRE(kvt_tier_lookup_ex(&info, t, a, 72, &ca) == 0);
  memcpy(name[0], info.token_hash, 65);
  memcpy(q, a, 50 * 4);
  for (int i = 50; i < 90; i++)
    q[i] = -i;
  int32_t ext[90];
  memcpy(ext, a, sizeof a);
  for (int i = 72; i < 90; i++)
    ext[i] = -i;
  CHECK_EQ_INT(kvt_tier_lookup_prefix(&info, t, ext, 90), KVT_ENOTFOUND);
  CHECK_EQ_INT(kvt_tier_lookup_prefix_ex(&info, t, ext, 90, &cc),
               KVT_ENOTFOUND);
  CHECK_EQ_INT(kvt_tier_lookup_prefix(&info, t, q, 90), KVT_ENOTFOUND);
  CHECK_EQ_INT(kvt_tier_lookup_prefix_ex(&info, t, q, 90, &cb), KVT_ENOTFOUND);
  kvt_promote_opts pu = popts(NULL, KVT_PROMOTE_PREFIX);
  kvt_promote_opts pa = popts("alice", KVT_PROMOTE_PREFIX);
  CHECK_EQ_INT(kvt_tier_promote(&e, t, ext, 90, &pu), KVT_ENOTFOUND);
  CHECK_EQ_INT(kvt_tier_touch(t, a, 72), KVT_ENOTFOUND);
  CHECK_EQ_INT(kvt_tier_touch_ex(t, a, 72, &cb), KVT_ENOTFOUND);
  REQUIRE(kvt_tier_lookup_prefix_ex(&info, t, ext, 90, &ca) == 0);
  CHECK_EQ_INT(info.num_tokens, 72);
  REQUIRE(kvt_tier_promote(&e, t, ext, 90, &pa) == 0);
  CHECK(t_layer_eq(kvt_entry_layer(e, 0), &l[0]));
  kvt_entry_free(e);
  if (chunk) { /* alice's chunks: a prefix no spill ended at, hers only */
    REQUIRE(kvt_tier_lookup_prefix_ex(&info, t, q, 90, &ca) == 0);
    CHECK_EQ_INT(info.num_tokens, 48);
    REQUIRE(kvt_tier_read_entry_ex(&e, t, q, 48, info.token_hash, &ca) == 0);
    CHECK_EQ_INT(kvt_entry_layer(e, 0)->tensors[0].shape[2], 48);
    kvt_entry_free(e);
    CHECK_EQ_INT(kvt_tier_read_entry(&e, t, q, 48, info.token_hash),
                 KVT_ENOTFOUND);
    /* The same tokens again under the same salt: no chunk written. */
    int before = kvt_test_each_chunk(dir, NULL, NULL);
    REQUIRE(kvt_tier_spill_ex(t, a, 72, &l[0], 1, 100, &ca) == 0);
    REQUIRE(kvt_tier_flush(t, 30000) == 0);
    CHECK_EQ_INT(kvt_test_each_chunk(dir, NULL, NULL), before);
    REQUIRE(kvt_tier_verify(t, name[0], 0) == 0);
  }
  /* Bad salts and versions. */
  char big[KVT_CACHE_SALT_MAX + 1];
  memset(big, 'x', sizeof big);
  kvt_call_opts bad = KVT_CALL_OPTS_INIT;
  bad.cache_salt = big;
  bad.cache_salt_len = sizeof big;
  CHECK_EQ_INT(kvt_tier_lookup_ex(&info, t, a, 72, &bad), KVT_EINVAL);
  CHECK_EQ_INT(kvt_tier_spill_ex(t, a, 72, &l[0], 1, 100, &bad), KVT_EINVAL);
  bad.cache_salt_len = 3;
  bad.version = 9;
  CHECK_EQ_INT(kvt_tier_lookup_ex(&info, t, a, 72, &bad), KVT_EINVAL);
  kvt_promote_opts pb = popts(NULL, 0);
  pb.cache_salt = big;
  pb.cache_salt_len = sizeof big;
  CHECK_EQ_INT(kvt_tier_promote(&e, t, a, 72, &pb), KVT_EINVAL);
  /* A version-1 promote opts struct: no salt field read, the plain call. */
  kvt_promote_opts v1;
  REQUIRE(kvt_promote_opts_init(&v1, 1) == 0);
  CHECK_EQ_INT(kvt_tier_promote(&e, t, a, 72, &v1), KVT_ENOTFOUND);
  /* Reopen, then rebuild the index from the files (chunk tables included):
   * still alice's only, under her salted keys. */
  REQUIRE(kvt_tier_close(t, 30000) == 0);
  kvt_tier_free(t);
  for (int pass = 0; pass < 2; pass++) {
    if (pass == 1) {
      char *db = t_join(dir, "index.db");
      REQUIRE(unlink(db) == 0);
      free(db);
    }
    t = open_tier(dir, chunk);
    REQUIRE(kvt_tier_lookup_ex(&info, t, a, 72, &ca) == 0);
    CHECK(strcmp(info.token_hash, name[0]) == 0);
    CHECK_EQ_INT(kvt_tier_lookup(&info, t, a, 72), KVT_ENOTFOUND);
    REQUIRE(kvt_tier_promote(&e, t, a, 72, &pa) == 0);
    CHECK(t_layer_eq(kvt_entry_layer(e, 0), &l[0]));
    kvt_entry_free(e);
    REQUIRE(kvt_tier_close(t, 30000) == 0);
    kvt_tier_free(t);
  }
  for (int s = 0; s < 3; s++)
    t_layer_free(&l[s]);
  free(dir);
}

/* A salted entry is served from the host RAM tier like any other: its
 * second promote under its salt is a RAM hit, with the same KV (the RAM
 * tier once compared the salted name with the unsalted token hash, so salted
 * entries were cached but never served from RAM). */
static void ram_hit(const char *tag, uint32_t chunk) {
  char *dir = t_join(g_dir, tag);
  kvt_tier *t = open_tier(dir, chunk);
  kvt_rng r = {78};
  int32_t a[72];
  for (int i = 0; i < 72; i++)
    a[i] = 900 + i;
  kvt_layer l = t_kv(&r, KVT_DTYPE_F16, 1, 2, 72, 8, 72);
  kvt_call_opts co = salt_of("carol");
  REQUIRE(kvt_tier_spill_ex(t, a, 72, &l, 1, 4096, &co) == 0);
  REQUIRE(kvt_tier_flush(t, 30000) == 0);
  kvt_promote_opts po = popts("carol", 0);
  kvt_stats s0 = KVT_STATS_INIT, s1 = KVT_STATS_INIT;
  kvt_entry *e = NULL;
  REQUIRE(kvt_tier_promote(&e, t, a, 72, &po) == 0);
  kvt_entry_free(e);
  REQUIRE(kvt_tier_stats(&s0, t) == 0);
  REQUIRE(kvt_tier_promote(&e, t, a, 72, &po) == 0);
  REQUIRE(kvt_tier_stats(&s1, t) == 0);
  CHECK_EQ_INT(s1.host_cache_hits - s0.host_cache_hits, 1);
  CHECK(t_layer_eq(kvt_entry_layer(e, 0), &l));
  kvt_entry_free(e);
  REQUIRE(kvt_tier_close(t, 30000) == 0);
  kvt_tier_free(t);
  t_layer_free(&l);
  free(dir);
}

static void test_ram_hit(void) {
  ram_hit("ram-whole", 0);
  ram_hit("ram-chunked", C);
}

static void test_whole(void) {
  run("whole", 0);
}
static void test_chunked(void) {
  run("chunked", C);
}

int main(void) {
  g_dir = kvt_test_tmpdir("tiersalt");
  RUN(test_whole);
  RUN(test_chunked);
  RUN(test_ram_hit);
  return kvt_test_done();
}
