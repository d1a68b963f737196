/*
 * test_tier_chunked.c - the tier in chunked native mode (chunk_tokens, public
 * API only): option validation; conversations sharing a prompt; exact promote
 * (sync and async) of chained entries bit for bit; a PREFIX promote of a
 * prompt sharing a chunk-aligned part of the system prompt reserves exactly
 * what it allocates and returns those tokens, and so does an exact promote
 * of those tokens; trimmed promote; touch of a
 * prefix with no entry; a damaged chunk is never served and takes the chains
 * and entries through it; capacity evicts chunks and entries (no entry left
 * without its chain); the chunks survive a reopen; an entry or chain prefix
 * holding a quantized layer reports (and reserves) its dense size; an
 * entry's tensors below a huge page are promoted into one shared block,
 * bit for bit.
 */
#include "fmt_testlib.h"
#include "tier_testlib.h"
#include "kvtier.h"

#include <dirent.h>

#define C 16

static char *g_dir;

static kvt_tier *open_tier(const char *dir, double max_gb) {
  kvt_options o = KVT_OPTIONS_INIT;
  o.cache_dir = dir;
  o.durability = KVT_DURABILITY_NONE;
  o.chunk_tokens = C;
  o.model_id = "test-model";
  o.max_size_gb = max_gb;
  kvt_tier *t;
  REQUIRE(kvt_tier_open(&t, &o) == 0);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  return t;
}

/* KV depending on (token, position) only, so shared prefixes share KV. */
static int g_reserved;
static int reserve(void *ctx, uint64_t n) {
  (void)ctx;
  g_reserved = (int)n;
  return 1;
}
static void release(void *ctx, uint64_t n) {
  (void)ctx;
  (void)n;
}

static void spill(kvt_tier *t, const int32_t *tok, int n, int T) {
  CHECK(t_kv_spill(t, tok, n, T, 2, 1000) == 0);
}

static int entry_matches(const kvt_entry *e, const int32_t *tok, int n, int T) {
  return t_kv_matches(e, tok, n, T, 2);
}

static void add_size(void *ctx, const char *path) {
  struct stat st;
  if (stat(path, &st) == 0)
    *(uint64_t *)ctx += (uint64_t)st.st_size;
}

static uint64_t chunk_file_bytes(const char *dir) {
  uint64_t total = 0;
  kvt_test_each_chunk(dir, add_size, &total);
  return total;
}

static void test_options(void) {
  kvt_options o = KVT_OPTIONS_INIT;
  o.cache_dir = g_dir;
  o.chunk_tokens = 24;
  CHECK(kvt_options_validate(&o) == KVT_EINVAL);
  o.chunk_tokens = 8192;
  CHECK(kvt_options_validate(&o) == KVT_EINVAL);
  o.chunk_tokens = 64;
  CHECK(kvt_options_validate(&o) == 0);
  o.storage_mode =
      KVT_STORAGE_COMPAT; /* ignored there: the reference's layout */
  CHECK(kvt_options_validate(&o) == 0);
  kvt_options d = KVT_OPTIONS_INIT;
  CHECK_EQ_INT(d.chunk_tokens, KVT_CHUNK_TOKENS_DEFAULT);
  CHECK_EQ_INT(KVT_CHUNK_TOKENS_DEFAULT, 256);
  kvt_options v3;
  REQUIRE(kvt_options_init(&v3, 3) == 0);
  CHECK_EQ_INT(v3.chunk_tokens, 256);
}

/* A compat-mode tier with the default chunk_tokens writes what the reference
 * reads: one entry per spill, no chunks/ directory. */
static void test_compat_ignores_chunks(void) {
  char *dir = t_join(g_dir, "compat");
  kvt_options o = KVT_OPTIONS_INIT;
  o.cache_dir = dir;
  o.durability = KVT_DURABILITY_NONE;
  o.storage_mode = KVT_STORAGE_COMPAT;
  kvt_tier *t = NULL;
  REQUIRE(kvt_tier_open(&t, &o) == 0);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  int32_t tok[600];
  for (int i = 0; i < 600; i++)
    tok[i] = 40 + i;
  spill(t, tok, 600, 600);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  char *cd = t_join(dir, "chunks");
  CHECK(!kvt_test_exists(cd));
  kvt_entry *e = NULL;
  CHECK(kvt_tier_promote(&e, t, tok, 600, NULL) == 0 && e);
  kvt_entry_free(e);
  kvt_tier_free(t);
  free(cd);
  free(dir);
}

static void test_tier(void) {
  char *dir = t_join(g_dir, "t");
  kvt_tier *t = open_tier(dir, 10.0);
  int32_t sys[64], a[100], b[100];
  for (int i = 0; i < 64; i++)
    sys[i] = 500 + i;
  memcpy(a, sys, sizeof sys);
  memcpy(b, sys, sizeof sys);
  for (int i = 64; i < 100; i++) {
    a[i] = 9000 + i;
    b[i] = 7000 + i;
  }
  spill(t, a, 100, 128); /* 28 spare rows past offset */
  spill(t, b, 100, 128);
  REQUIRE(kvt_tier_flush(t, 30000) == 0);
  CHECK_EQ_INT(kvt_test_each_chunk(dir, NULL, NULL),
               6 + 2); /* 4 shared chunks once */
  kvt_stats st0 = KVT_STATS_INIT;
  REQUIRE(kvt_tier_stats(&st0, t) == 0);
  CHECK(st0.disk_bytes > chunk_file_bytes(dir)); /* chunks once + tails */
  kvt_promote_opts po = KVT_PROMOTE_OPTS_INIT;
  po.reserve = reserve;
  po.release = release;
  kvt_entry *e = NULL;
  REQUIRE(kvt_tier_promote(&e, t, a, 100, &po) == 0);
  CHECK(entry_matches(e, a, 100, 128));
  kvt_entry_free(e);
  kvt_promise *pr;
  REQUIRE(kvt_tier_promote_async(&pr, t, b, 100, &po) == 0);
  REQUIRE(kvt_promise_wait(pr, 30000) == 0);
  REQUIRE(kvt_promise_result(&e, pr) == 0);
  CHECK(entry_matches(e, b, 100, 128));
  kvt_entry_free(e);
  kvt_promise_free(pr);
  /* A new prompt sharing 50 tokens: 48 served from the chain. */
  int32_t q[80];
  memcpy(q, sys, 50 * 4);
  for (int i = 50; i < 80; i++)
    q[i] = -i;
  kvt_entry_info info;
  REQUIRE(kvt_tier_lookup_prefix(&info, t, q, 80) == 0);
  CHECK_EQ_INT(info.num_tokens, 48);
  char h[65];
  kvt_test_model_hash(h, "test-model", q, 48);
  CHECK(strcmp(h, info.token_hash) == 0);
  po.flags = KVT_PROMOTE_PREFIX;
  g_reserved = 0;
  REQUIRE(kvt_tier_promote(&e, t, q, 80, &po) == 0);
  CHECK_EQ_INT(g_reserved, info.memory_bytes);
  uint64_t alloc = 0;
  for (uint32_t L = 0; L < kvt_entry_num_layers(e); L++)
    for (uint32_t j = 0; j < 2; j++)
      alloc += kvt_entry_layer(e, L)->tensors[j].nbytes;
  CHECK_EQ_INT(alloc, info.memory_bytes);
  CHECK(entry_matches(e, q, 48, 48));
  kvt_entry_free(e);
  REQUIRE(kvt_tier_read_entry(&e, t, q, 48, h) == 0);
  CHECK(entry_matches(e, q, 48, 48));
  kvt_entry_free(e);
  /* The scheduler asks for that candidate by its own length (an exact
   * promote of q[0, 48)): served sync and async, reserving the lookup's
   * memory_bytes; a length no chain ends at stays a miss. */
  po.flags = 0;
  g_reserved = 0;
  REQUIRE(kvt_tier_promote(&e, t, q, 48, &po) == 0);
  CHECK_EQ_INT(g_reserved, info.memory_bytes);
  CHECK(entry_matches(e, q, 48, 48));
  kvt_entry_free(e);
  REQUIRE(kvt_tier_promote_async(&pr, t, q, 48, &po) == 0);
  REQUIRE(kvt_promise_wait(pr, 30000) == 0);
  REQUIRE(kvt_promise_result(&e, pr) == 0);
  CHECK(entry_matches(e, q, 48, 48));
  kvt_entry_free(e);
  kvt_promise_free(pr);
  CHECK_EQ_INT(kvt_tier_promote(&e, t, q, 40, &po), KVT_ENOTFOUND);
  CHECK_EQ_INT(kvt_tier_promote(&e, t, q, 64, &po), KVT_ENOTFOUND);
  po.flags = KVT_PROMOTE_PREFIX;
  CHECK(kvt_tier_touch(t, q, 48) == 0);
  int32_t none[20] = {0};
  CHECK(kvt_tier_touch(t, none, 20) == KVT_ENOTFOUND);
  /* Trimmed promote of a chained entry. */
  po.flags = 0;
  REQUIRE(kvt_tier_promote_trim(&e, t, a, 100, 40, &po) == 0);
  CHECK_EQ_INT(kvt_entry_layer(e, 0)->tensors[0].shape[2], 40);
  kvt_entry_free(e);
  /* Past the chain's 96 tokens: chain + tail rows, bit for bit, reserving
   * the scaled memory_bytes; past the entry or its offset: refused. */
  for (int keep = 97; keep <= 99; keep += 2) {
    g_reserved = 0;
    REQUIRE(kvt_tier_promote_trim(&e, t, a, 100, (size_t)keep, &po) == 0);
    CHECK(entry_matches(e, a, keep, keep));
    CHECK_EQ_INT(g_reserved, 1000 * keep / 100);
    size_t ne;
    kvt_entry_tokens(e, &ne);
    CHECK_EQ_INT(ne, keep);
    kvt_entry_free(e);
  }
  REQUIRE(kvt_tier_promote_trim(&e, t, a, 100, 100, &po) == 0); /* whole */
  CHECK(entry_matches(e, a, 100, 128));
  kvt_entry_free(e);
  CHECK_EQ_INT(kvt_tier_promote_trim(&e, t, a, 100, 101, &po), KVT_EINVAL);
  /* Reopen: the chains are still there. */
  REQUIRE(kvt_tier_close(t, 30000) == 0);
  kvt_tier_free(t);
  t = open_tier(dir, 10.0);
  REQUIRE(kvt_tier_lookup_prefix(&info, t, q, 80) == 0);
  CHECK_EQ_INT(info.num_tokens, 48);
  REQUIRE(kvt_tier_promote(&e, t, b, 100, &po) == 0);
  CHECK(entry_matches(e, b, 100, 128));
  kvt_entry_free(e);
  /* Damage a shared chunk: never served; chains and entries through it go. */
  char cd[4096];
  int flipped = 0;
  for (int x = 0; x < 256 && !flipped; x++) {
    snprintf(cd, sizeof cd, "%s/chunks/%02x", dir, x);
    DIR *d = opendir(cd);
    struct dirent *de;
    while (d && (de = readdir(d)) && !flipped) {
      if (!strstr(de->d_name, ".kvc"))
        continue;
      char p[4400];
      snprintf(p, sizeof p, "%s/%s", cd, de->d_name);
      size_t n;
      char *bytes = kvt_test_read_file(p, &n);
      if (!bytes)
        continue;
      bytes[n - 3] ^= 0x20;
      t_write_all(p, bytes, n);
      free(bytes);
      flipped = 1;
    }
    if (d)
      closedir(d);
  }
  REQUIRE(flipped);
  int bad = 0;
  int32_t *who[2] = {a, b};
  for (int k = 0; k < 2; k++) {
    int rc = kvt_tier_promote(&e, t, who[k], 100, &po);
    if (rc == 0) {
      CHECK(entry_matches(e, who[k], 100, 128));
      kvt_entry_free(e);
    } else {
      CHECK(rc == KVT_ECORRUPT || rc == KVT_ENOTFOUND);
      bad++;
    }
  }
  CHECK(bad >= 1);
  kvt_stats st = KVT_STATS_INIT;
  REQUIRE(kvt_tier_stats(&st, t) == 0);
  CHECK(st.quarantined >= 1);
  REQUIRE(kvt_tier_close(t, 30000) == 0);
  kvt_tier_free(t);
  free(dir);
}

static void test_capacity(void) {
  char *dir = t_join(g_dir, "cap");
  /* Room for about 3 conversations of 100 tokens (2 layers x 2 heads x 8 x
   * 2 B x 2 = 128 B per token; 160 tokens of KV each with spare rows). */
  kvt_tier *t = open_tier(dir, 80000.0 / (1024.0 * 1024.0 * 1024.0));
  for (int c = 0; c < 12; c++) {
    int32_t tok[100];
    for (int i = 0; i < 100; i++)
      tok[i] = c * 1000 + i;
    spill(t, tok, 100, 100);
    REQUIRE(kvt_tier_flush(t, 30000) == 0);
  }
  kvt_stats st = KVT_STATS_INIT;
  REQUIRE(kvt_tier_stats(&st, t) == 0);
  CHECK(st.evictions > 0);
  /* Whatever is left reads back whole: no entry without its chain. */
  int left = 0;
  for (int c = 0; c < 12; c++) {
    int32_t tok[100];
    for (int i = 0; i < 100; i++)
      tok[i] = c * 1000 + i;
    kvt_entry_info info;
    if (kvt_tier_lookup(&info, t, tok, 100) != 0)
      continue;
    kvt_entry *e;
    kvt_promote_opts po = KVT_PROMOTE_OPTS_INIT;
    int rc = kvt_tier_promote(&e, t, tok, 100, &po);
    CHECK(rc == 0 || rc == KVT_ENOTFOUND);
    if (rc == 0) {
      left++;
      CHECK(entry_matches(e, tok, 100, 100));
      kvt_entry_free(e);
    }
  }
  CHECK(left >= 1 && left < 12);
  REQUIRE(kvt_tier_close(t, 30000) == 0);
  kvt_tier_free(t);
  free(dir);
}

static kvt_tier *open_chunks(const char *dir, uint32_t chunk, int compat) {
  kvt_options o = KVT_OPTIONS_INIT;
  o.cache_dir = dir;
  o.durability = KVT_DURABILITY_NONE;
  o.chunk_tokens = chunk;
  /* No model_id: a model_id namespaces native names, and compat writes the
   * reference's (which has none), so only without one do both modes name
   * the same tokens alike (a compat tier refuses a model_id). */
  if (compat)
    o.storage_mode = KVT_STORAGE_COMPAT;
  kvt_tier *t;
  REQUIRE(kvt_tier_open(&t, &o) == 0);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  return t;
}

/* One directory used by a chunked tier, then by a tier without chunks
 * (chunk_tokens = 0, or compat) replacing the same tokens with a whole
 * entry: the chained-entry row the chunked tier left names a chain the
 * acknowledged version does not use. The chunked tier reopened serves the
 * whole entry (exact and trimmed: never the old chain's rows), quarantines
 * nothing, and its next spill of those tokens is served too. */
static void test_mixed_chunk_sizes(int compat) {
  char *dir = t_join(g_dir, compat ? "mixed-compat" : "mixed-zero");
  int32_t a[40];
  for (int i = 0; i < 40; i++)
    a[i] = 900 + i;
  kvt_tier *t = open_chunks(dir, C, 0);
  CHECK(t_kv_spill(t, a, 40, 48, 2, 1000) == 0); /* 2 chunks + a tail */
  REQUIRE(kvt_tier_flush(t, 30000) == 0);
  REQUIRE(kvt_tier_close(t, 30000) == 0);
  kvt_tier_free(t);
  /* The new version: other KV (random), another padding, another size. */
  kvt_rng r = {91};
  kvt_layer l[2];
  for (int i = 0; i < 2; i++)
    l[i] = t_kv(&r, KVT_DTYPE_F16, 1, 2, 64, 8, 40);
  t = open_chunks(dir, 0, compat);
  REQUIRE(kvt_tier_spill(t, a, 40, l, 2, 2000) == 0);
  REQUIRE(kvt_tier_flush(t, 30000) == 0);
  REQUIRE(kvt_tier_close(t, 30000) == 0);
  kvt_tier_free(t);
  t = open_chunks(dir, C, 0);
  kvt_entry_info info;
  REQUIRE(kvt_tier_lookup(&info, t, a, 40) == 0);
  CHECK_EQ_INT(info.memory_bytes, 2000);
  kvt_entry *e = NULL;
  CHECK_EQ_INT(kvt_tier_promote(&e, t, a, 40, NULL), 0);
  CHECK(e && kvt_entry_num_layers(e) == 2 &&
        t_layer_eq(kvt_entry_layer(e, 0), &l[0]) &&
        t_layer_eq(kvt_entry_layer(e, 1), &l[1]));
  kvt_entry_free(e);
  e = NULL;
  kvt_promote_opts po = KVT_PROMOTE_OPTS_INIT;
  CHECK_EQ_INT(kvt_tier_promote_trim(&e, t, a, 40, 32, &po), 0);
  CHECK(e &&
        t_rows_match(&kvt_entry_layer(e, 0)->tensors[0], &l[0].tensors[0], 32));
  kvt_entry_free(e);
  e = NULL;
  CHECK_EQ_INT(kvt_tier_verify(t, info.token_hash, 0), 0);
  kvt_stats st = KVT_STATS_INIT;
  REQUIRE(kvt_tier_stats(&st, t) == 0);
  CHECK_EQ_INT(st.quarantined, 0);
  /* The chunked tier's own replacement: a chained entry again. */
  CHECK(t_kv_spill(t, a, 40, 48, 2, 3000) == 0);
  REQUIRE(kvt_tier_flush(t, 30000) == 0);
  CHECK_EQ_INT(kvt_tier_promote(&e, t, a, 40, NULL), 0);
  CHECK(entry_matches(e, a, 40, 48));
  kvt_entry_free(e);
  REQUIRE(kvt_tier_close(t, 30000) == 0);
  kvt_tier_free(t);
  for (int i = 0; i < 2; i++)
    t_layer_free(&l[i]);
  free(dir);
}
static void test_mixed_zero(void) {
  test_mixed_chunk_sizes(0);
}
static void test_mixed_compat(void) {
  test_mixed_chunk_sizes(1);
}

/* memory_bytes of an entry holding a quantized layer, and of a chain prefix
 * through one, is what a dense promote hands over (the drop-in dequantizes;
 * the scheduler reserves the figure before the read), not the packed size
 * nor the caller's estimate of it; a C promote reserves that figure and
 * allocates the packed form, less. chunk_tokens 0 too (no chains). */
static void test_quantized_memory_bytes(uint32_t chunk_tokens) {
  char *dir = t_join(g_dir, chunk_tokens ? "q" : "q0");
  kvt_options opt = KVT_OPTIONS_INIT;
  opt.cache_dir = dir;
  opt.durability = KVT_DURABILITY_NONE;
  opt.chunk_tokens = chunk_tokens;
  opt.model_id = "test-model";
  kvt_tier *t;
  REQUIRE(kvt_tier_open(&t, &opt) == 0);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  kvt_rng r = {77};
  /* 40 tokens in buffers of 48 rows: KV kept whole (2 heads x 8 F16), the
   * 4-bit layer's first 40 rows dequantized (2 heads x 64 F16). */
  kvt_layer l[2] = {t_kv(&r, KVT_DTYPE_F16, 1, 2, 48, 8, 40),
                    t_quant(&r, 4, 32, KVT_DTYPE_F16, 1, 2, 48, 64, 40)};
  int32_t tok[50];
  for (int i = 0; i < 50; i++)
    tok[i] = 300 + i;
  REQUIRE(kvt_tier_spill(t, tok, 40, l, 2, 1000) == 0);
  REQUIRE(kvt_tier_flush(t, 30000) == 0);
  const uint64_t exact = 2ull * 2 * 48 * 8 * 2 + 2ull * 2 * 40 * 64 * 2;
  kvt_entry_info info;
  REQUIRE(kvt_tier_lookup(&info, t, tok, 40) == 0);
  CHECK_EQ_INT(info.memory_bytes, exact);
  kvt_promote_opts po = KVT_PROMOTE_OPTS_INIT;
  po.reserve = reserve;
  po.release = release;
  g_reserved = 0;
  kvt_entry *e = NULL;
  REQUIRE(kvt_tier_promote(&e, t, tok, 40, &po) == 0);
  CHECK_EQ_INT(g_reserved, exact);
  CHECK_EQ_INT(kvt_entry_memory_bytes(e), exact);
  kvt_entry_free(e);
  /* A prompt sharing 36 tokens: the 32-token chain prefix. */
  int32_t q[50];
  memcpy(q, tok, sizeof q);
  for (int i = 36; i < 50; i++)
    q[i] = -i;
  int rc = kvt_tier_lookup_prefix(&info, t, q, 50);
  if (!chunk_tokens) {
    CHECK_EQ_INT(rc, KVT_ENOTFOUND);
  } else {
    REQUIRE(rc == 0);
    CHECK_EQ_INT(info.num_tokens, 32);
    const uint64_t pre = 2ull * 2 * 32 * 8 * 2 + 2ull * 2 * 32 * 64 * 2;
    CHECK_EQ_INT(info.memory_bytes, pre);
    po.flags = KVT_PROMOTE_PREFIX;
    g_reserved = 0;
    REQUIRE(kvt_tier_promote(&e, t, q, 50, &po) == 0);
    CHECK_EQ_INT(g_reserved, pre);
    CHECK_EQ_INT(kvt_entry_memory_bytes(e), pre);
    uint64_t alloc = 0;
    for (uint32_t L = 0; L < kvt_entry_num_layers(e); L++)
      for (uint32_t j = 0; j < kvt_entry_layer(e, L)->num_tensors; j++)
        alloc += kvt_entry_layer(e, L)->tensors[j].nbytes;
    /* packed: 32 + 4 + 4 bytes a row and head for keys and values */
    CHECK_EQ_INT(alloc, 2ull * 2 * 32 * 8 * 2 + 2ull * 2 * 32 * 40);
    kvt_entry_free(e);
    /* The same tokens asked for by their own length (the scheduler's
     * promote of a candidate): the same reservation, sync and async. */
    po.flags = 0;
    g_reserved = 0;
    REQUIRE(kvt_tier_promote(&e, t, q, 32, &po) == 0);
    CHECK_EQ_INT(g_reserved, pre);
    kvt_entry_free(e);
    kvt_promise *pr;
    g_reserved = 0;
    REQUIRE(kvt_tier_promote_async(&pr, t, q, 32, &po) == 0);
    REQUIRE(kvt_promise_wait(pr, 30000) == 0);
    REQUIRE(kvt_promise_result(&e, pr) == 0);
    CHECK_EQ_INT(g_reserved, pre);
    kvt_entry_free(e);
    kvt_promise_free(pr);
  }
  kvt_tier_free(t);
  t_layer_free(&l[0]);
  t_layer_free(&l[1]);
  free(dir);
}

static void test_quantized_memory_bytes_chunked(void) {
  test_quantized_memory_bytes(C);
}
static void test_quantized_memory_bytes_unchunked(void) {
  test_quantized_memory_bytes(0);
}

/* Tensors of 1 MiB (below a huge page), 8 MiB in all: the promote carves
 * them from one block (kvti_buf_alloc_group), each 4096-aligned after a
 * bookkeeping page, and they still hold exactly what was spilled - also
 * freed one entry at a time across repeated promotes (the block back in
 * the pool and reused). */
static void test_small_tensors_share_a_block(void) {
  char *dir = t_join(g_dir, "shared-block");
  kvt_options o = KVT_OPTIONS_INIT;
  o.cache_dir = dir;
  o.durability = KVT_DURABILITY_NONE;
  o.chunk_tokens = 128;
  o.host_cache_bytes = 0; /* every promote reads the chunk files */
  kvt_tier *t;
  REQUIRE(kvt_tier_open(&t, &o) == 0);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  enum { N = 256, D = 1024, L = 4 };
  int32_t tok[N];
  for (int i = 0; i < N; i++)
    tok[i] = 4000 + i;
  kvt_layer l[L];
  for (int i = 0; i < L; i++)
    l[i] = t_kv_tokens(tok, N, N, D, i);
  REQUIRE(kvt_tier_spill(t, tok, N, l, L, 0) == 0);
  REQUIRE(kvt_tier_flush(t, 30000) == 0);
  for (int round = 0; round < 3; round++) {
    kvt_entry *e = NULL;
    REQUIRE(kvt_tier_promote(&e, t, tok, N, NULL) == 0 && e);
    CHECK_EQ_INT(kvt_entry_num_layers(e), L);
    const char *prev = NULL;
    for (uint32_t i = 0; i < L; i++) {
      const kvt_layer *got = kvt_entry_layer(e, i);
      REQUIRE(got && got->num_tensors == 2);
      CHECK(t_layer_eq(got, &l[i]));
      for (uint32_t j = 0; j < 2; j++) {
        const char *d = got->tensors[j].data;
        CHECK_EQ_INT(got->tensors[j].nbytes, 2u * N * D * 2);
        CHECK((uintptr_t)d % 4096 == 0);
        if (prev) /* the next buffer of the same block */
          CHECK(d == prev + 2u * N * D * 2 + 4096);
        prev = d;
      }
    }
    kvt_entry_free(e);
  }
  for (int i = 0; i < L; i++)
    t_layer_free(&l[i]);
  REQUIRE(kvt_tier_close(t, 30000) == 0);
  kvt_tier_free(t);
  free(dir);
}

int main(void) {
  g_dir = kvt_test_tmpdir("tierchunked");
  RUN(test_options);
  RUN(test_compat_ignores_chunks);
  RUN(test_tier);
  RUN(test_capacity);
  RUN(test_mixed_zero);
  RUN(test_mixed_compat);
  RUN(test_quantized_memory_bytes_chunked);
  RUN(test_quantized_memory_bytes_unchunked);
  RUN(test_small_tensors_share_a_block);
  return kvt_test_done();
}
