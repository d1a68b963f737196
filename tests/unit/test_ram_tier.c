/*
 * test_ram_tier.c - the host RAM tier through the public API (issue 15):
 * written copy-mode spills and freed promotes are served from RAM (counted as
 * such, data identical); the byte bound is respected at every step; a lowered
 * bound and kvt_tier_trim shrink the cache before they return (bytes, and the
 * process's resident memory for trim); invalidation on replace, remove,
 * eviction, retention expiry and quarantine; an altered RAM copy fails the
 * block-checksum check and the disk is read instead (nothing quarantined); a
 * promote into caller buffers copies and keeps the record; zero-copy spills
 * are cached only after their first promote; an entry freed after its tier is
 * gone; host_cache_bytes = 0 disables it. No timings are asserted.
 */
#include "tier_testlib.h"

static kvt_stats stats_of(kvt_tier *t) {
  kvt_stats s = KVT_STATS_INIT;
  REQUIRE(kvt_tier_stats(&s, t) == 0);
  return s;
}

/* 4 layers x 2 tensors x (2*T*D*4) bytes: T=64, D=64 -> 32 KiB per tensor,
 * 256 KiB per entry. */
#define ET 64
#define ED 64
static t_entry mk(uint64_t seed) {
  return t_make(seed, 40, 4, ET, ED);
}

static kvt_entry *promote(kvt_tier *t, const t_entry *e) {
  kvt_entry *got = NULL;
  int rc = kvt_tier_promote(&got, t, e->tokens, e->n_tokens, NULL);
  return rc == 0 ? got : NULL;
}

static kvt_tier *open_with(const char *tag, uint64_t bound, kvt_options *o) {
  *o = t_opts(tag);
  o->host_cache_bytes = bound;
  kvt_tier *t = t_open(o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  return t;
}

static void test_spill_then_ram(void) {
  kvt_options o;
  kvt_tier *t = open_with("ram1", (uint64_t)64 << 20, &o);
  t_entry e[3] = {mk(1), mk(2), mk(3)};
  for (int i = 0; i < 3; i++)
    REQUIRE(t_spill(t, &e[i]) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  kvt_stats s = stats_of(t);
  CHECK_EQ_INT(s.host_cache_entries, 3);
  CHECK(s.host_cache_bytes_used >= 3 * e[0].memory_bytes);
  CHECK(s.host_cache_bytes_used <= s.host_cache_bytes_bound);
  CHECK_EQ_INT(s.host_cache_bytes_bound, (uint64_t)64 << 20);
  for (int pass = 0; pass < 2; pass++)
    for (int i = 0; i < 3; i++) {
      kvt_entry *got = promote(t, &e[i]);
      REQUIRE(got);
      CHECK(t_same(got, &e[i]));
      CHECK(kvt_entry_disk_bytes(got) > e[i].memory_bytes);
      kvt_entry_free(got); /* back into the cache */
    }
  s = stats_of(t);
  CHECK_EQ_INT(s.promotes_from_ram, 6);
  CHECK_EQ_INT(s.promotes_from_disk, 0);
  CHECK_EQ_INT(s.host_cache_hits, 6);
  CHECK_EQ_INT(s.ssd_hits, 6);
  CHECK(s.promote_ram_bytes > 6 * e[0].memory_bytes);
  CHECK_EQ_INT(s.host_cache_entries, 3);
  /* Held by the caller: the entry is out of the cache (its bytes are the
   * caller's), and a second promote of it meanwhile reads the disk. */
  kvt_entry *a = promote(t, &e[0]);
  REQUIRE(a);
  s = stats_of(t);
  CHECK_EQ_INT(s.host_cache_entries, 2);
  kvt_entry *b = promote(t, &e[0]);
  REQUIRE(b);
  CHECK(t_same(b, &e[0]));
  s = stats_of(t);
  CHECK_EQ_INT(s.promotes_from_disk, 1);
  CHECK(s.promote_disk_bytes > 0);
  kvt_entry_free(a); /* not the latest copy out: freed */
  kvt_entry_free(b); /* the latest: admitted */
  s = stats_of(t);
  CHECK_EQ_INT(s.host_cache_entries, 3);
  /* A version-1 caller's struct ends before the host RAM tier's fields:
   * nothing is written there, and its renderings leave them out. */
  kvt_stats v1;
  memset(&v1, 0xab, sizeof v1);
  v1.version = 1;
  REQUIRE(kvt_tier_stats(&v1, t) == 0);
  CHECK(v1.ssd_hits == s.ssd_hits);
  CHECK(v1.promotes_from_ram == 0xababababababababull);
  char small[16384];
  size_t nd = 0;
  REQUIRE(kvt_stats_to_json(small, sizeof small, &nd, &v1) == 0);
  CHECK(strstr(small, "promotes_from_ram") == NULL);
  /* JSON and Prometheus carry the new figures. */
  char buf[16384];
  size_t need = 0;
  REQUIRE(kvt_stats_to_json(buf, sizeof buf, &need, &s) == 0);
  CHECK(strstr(buf, "\"host_cache_bytes_used\":") != NULL);
  CHECK(strstr(buf, "\"promotes_from_ram\":7") != NULL);
  REQUIRE(kvt_stats_to_prometheus(buf, sizeof buf, &need, &s) == 0);
  CHECK(strstr(buf, "kvtier_promotes_from_ram_total 7") != NULL);
  CHECK(strstr(buf, "kvtier_host_cache_bytes_used ") != NULL);
  for (int i = 0; i < 3; i++)
    t_free(&e[i]);
  kvt_tier_free(t);
}

static void test_bound_and_pressure(void) {
  kvt_options o;
  kvt_tier *t = open_with("ram2", 0, &o);
  t_entry probe = mk(100);
  /* Bound of 2.5 entries (32 KiB tensors are malloc'ed: the footprint is
   * memory_bytes plus a few hundred bytes). */
  uint64_t one = probe.memory_bytes + probe.memory_bytes / 16;
  REQUIRE(kvt_tier_set_host_cache_bytes(t, one * 5 / 2) == 0);
  t_entry e[6];
  int over = 0;
  for (int i = 0; i < 6; i++) {
    e[i] = mk(200 + (uint64_t)i);
    REQUIRE(t_spill(t, &e[i]) == 0);
    REQUIRE(kvt_tier_flush(t, -1) == 0);
    kvt_stats s = stats_of(t);
    over += s.host_cache_bytes_used > s.host_cache_bytes_bound;
  }
  kvt_stats s = stats_of(t);
  CHECK_EQ_INT(over, 0);
  CHECK_EQ_INT(s.host_cache_entries, 2);
  CHECK(s.host_cache_evictions >= 4);
  /* The oldest went: promoting it reads the disk, and freeing it admits it
   * (evicting another) - still within the bound. */
  kvt_entry *got = promote(t, &e[0]);
  REQUIRE(got);
  CHECK(t_same(got, &e[0]));
  kvt_entry_free(got);
  s = stats_of(t);
  CHECK(s.host_cache_bytes_used <= s.host_cache_bytes_bound);
  CHECK_EQ_INT(s.promotes_from_disk, 1);
  CHECK_EQ_INT(s.host_cache_entries, 2);
  /* Lower the bound: shrunk when the call returns. */
  REQUIRE(kvt_tier_set_host_cache_bytes(t, one) == 0);
  s = stats_of(t);
  CHECK(s.host_cache_bytes_used <= one);
  CHECK_EQ_INT(s.host_cache_entries, 1);
  /* Trim to 0: empty when the call returns, bound unchanged. */
  uint64_t freed = 0;
  uint64_t before = s.host_cache_bytes_used;
  REQUIRE(kvt_tier_trim(t, 0, &freed) == 0);
  CHECK_EQ_INT(freed, before);
  s = stats_of(t);
  CHECK_EQ_INT(s.host_cache_bytes_used, 0);
  CHECK_EQ_INT(s.host_cache_bytes_bound, one);
  /* Disabled: nothing kept. */
  REQUIRE(kvt_tier_set_host_cache_bytes(t, 0) == 0);
  got = promote(t, &e[5]);
  REQUIRE(got);
  kvt_entry_free(got);
  s = stats_of(t);
  CHECK_EQ_INT(s.host_cache_entries, 0);
  CHECK_EQ_INT(s.host_cache_bytes_bound, 0);
  /* AUTO re-derives a positive default. */
  REQUIRE(kvt_tier_set_host_cache_bytes(t, KVT_HOST_CACHE_AUTO) == 0);
  s = stats_of(t);
  CHECK(s.host_cache_bytes_bound > 0);
  CHECK(kvt_tier_set_host_cache_bytes(NULL, 1) == KVT_EINVAL);
  CHECK(kvt_tier_trim(NULL, 0, NULL) == KVT_EINVAL);
  for (int i = 0; i < 6; i++)
    t_free(&e[i]);
  t_free(&probe);
  kvt_tier_free(t);
}

static long rss_bytes(void) {
  FILE *f = fopen("/proc/self/statm", "r");
  if (!f)
    return -1;
  long size = 0, res = 0;
  int n = fscanf(f, "%ld %ld", &size, &res);
  fclose(f);
  return n == 2 ? res * sysconf(_SC_PAGESIZE) : -1;
}

/* Memory really goes back: after kvt_tier_trim the process's resident set
 * has dropped by at least half of what the cache held (Linux only). */
/* Sanitizer allocators keep freed memory (quarantine): no RSS check there. */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define T_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define T_SANITIZED 1
#endif
#endif

static void test_trim_returns_memory(void) {
#ifdef T_SANITIZED
  int check_rss = 0;
#else
  int check_rss = rss_bytes() >= 0;
#endif
  kvt_options o;
  kvt_tier *t = open_with("ram3", (uint64_t)256 << 20, &o);
  /* 16 entries of 4 layers x 2 x 1 MiB = 128 MiB. */
  t_entry e[16];
  for (int i = 0; i < 16; i++) {
    e[i] = t_make(300 + (uint64_t)i, 40, 4, 1024, 128);
    REQUIRE(t_spill(t, &e[i]) == 0);
  }
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  for (int i = 0; i < 16; i++)
    t_free(&e[i]); /* the caller's copies: only the cache holds the data */
  kvt_stats s = stats_of(t);
  CHECK_EQ_INT(s.host_cache_entries, 16);
  uint64_t held = s.host_cache_bytes_used;
  long before = rss_bytes();
  uint64_t freed = 0;
  REQUIRE(kvt_tier_trim(t, 0, &freed) == 0);
  long after = rss_bytes();
  CHECK_EQ_INT(freed, held);
  CHECK_EQ_INT(stats_of(t).host_cache_bytes_used, 0);
  if (check_rss)
    CHECK(before - after >= (long)(held / 2));
  else
    fprintf(stderr, "  (sanitizer or no /proc/self/statm: RSS not checked)\n");
  if (check_rss && before - after < (long)(held / 2))
    fprintf(stderr, "  RSS %ld -> %ld after trimming %llu bytes\n", before,
            after, (unsigned long long)held);
  kvt_tier_free(t);
}

static void test_invalidation(void) {
  kvt_options o;
  kvt_tier *t = open_with("ram4", (uint64_t)64 << 20, &o);
  t_entry a = mk(10), a2 = mk(11), b = mk(12), c = mk(13);
  memcpy(a2.tokens, a.tokens, a.n_tokens * sizeof(int32_t)); /* same key */
  REQUIRE(t_spill(t, &a) == 0);
  REQUIRE(t_spill(t, &b) == 0);
  REQUIRE(t_spill(t, &c) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  /* Replace while a copy of the old version is out: the new version is
   * served, and the old copy is freed (not re-admitted) when it comes back. */
  kvt_entry *old = promote(t, &a);
  REQUIRE(old);
  REQUIRE(t_spill(t, &a2) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  kvt_entry_free(old);
  kvt_entry *got = promote(t, &a);
  REQUIRE(got);
  CHECK(t_same(got, &a2));
  kvt_entry_free(got);
  kvt_stats s = stats_of(t);
  CHECK_EQ_INT(s.promotes_from_ram, 2);
  CHECK_EQ_INT(s.host_cache_entries, 3);
  /* Remove. */
  REQUIRE(kvt_tier_remove(t, b.tokens, b.n_tokens) == 0);
  s = stats_of(t);
  CHECK_EQ_INT(s.host_cache_entries, 2);
  CHECK(promote(t, &b) == NULL);
  /* Quarantine: a damaged manifest fails the RAM check and the disk read
   * that follows quarantines the entry; its RAM copy is gone. */
  char *mp = t_entry_path(t, c.tokens, c.n_tokens, "manifest.json");
  REQUIRE(t_flip(mp, 5) == 0);
  free(mp);
  CHECK(promote(t, &c) == NULL);
  s = stats_of(t);
  CHECK_EQ_INT(s.quarantined, 1);
  CHECK_EQ_INT(s.host_cache_entries, 1);
  CHECK_EQ_INT(s.host_cache_verify_failures, 1);
  /* Eviction by capacity: max_entries 1 leaves one entry, in RAM too. */
  kvt_tier_free(t);
  o.max_entries = 1;
  t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  REQUIRE(t_spill(t, &b) == 0);
  REQUIRE(t_spill(t, &c) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  s = stats_of(t);
  CHECK_EQ_INT(s.entries, 1);
  CHECK_EQ_INT(s.host_cache_entries, 1);
  got = promote(t, &c);
  REQUIRE(got);
  kvt_entry_free(got);
  CHECK_EQ_INT(stats_of(t).promotes_from_ram, 1);
  kvt_tier_free(t);
  t_free(&a);
  t_free(&a2);
  t_free(&b);
  t_free(&c);
}

/* A replace in both whole-entry layouts - compat mode (what the reference
 * reads) and native - drops the RAM copy of the old version: the next promote
 * serves the new version's data, whether it comes from RAM or from disk, the
 * old one is never served again, and its copy never even reaches the block
 * check. (The chunked store keys KV by tokens -
 * a model's KV of the same tokens is the same - so a "replace" with other KV
 * for the same tokens keeps its chunks by design; test_ram_tier_chunked
 * covers its replaces.) */
static void test_replace_each_mode(void) {
  static const struct {
    const char *tag;
    int storage;
    uint32_t chunk_tokens;
  } modes[] = {{"ram-rep-compat", KVT_STORAGE_COMPAT, 0},
               {"ram-rep-native", KVT_STORAGE_NATIVE, 0}};
  for (size_t m = 0; m < sizeof modes / sizeof *modes; m++) {
    kvt_options o = t_opts(modes[m].tag);
    o.host_cache_bytes = (uint64_t)64 << 20;
    o.storage_mode = modes[m].storage;
    o.chunk_tokens = modes[m].chunk_tokens;
    kvt_tier *t = t_open(&o);
    REQUIRE(kvt_tier_start_writer(t) == 0);
    t_entry a = mk(30), a2 = mk(31);
    memcpy(a2.tokens, a.tokens, a.n_tokens * sizeof(int32_t)); /* same key */
    REQUIRE(t_spill(t, &a) == 0);
    REQUIRE(kvt_tier_flush(t, -1) == 0);
    /* The old version in RAM: a written spill is cached (native), a freed
     * promote is (every mode); the second promote is served from there. */
    kvt_entry *got = NULL;
    for (int k = 0; k < 2; k++) {
      got = promote(t, &a);
      REQUIRE(got);
      CHECK(t_same(got, &a));
      kvt_entry_free(got);
    }
    CHECK(stats_of(t).promotes_from_ram >= 1);
    REQUIRE(t_spill(t, &a2) == 0);
    REQUIRE(kvt_tier_flush(t, -1) == 0);
    for (int k = 0; k < 2; k++) { /* from disk or RAM: the new version */
      got = promote(t, &a);
      REQUIRE(got);
      if (!t_same(got, &a2))
        fprintf(stderr,
                "%s: promote %d after the replace served the old "
                "version\n",
                modes[m].tag, k);
      CHECK(t_same(got, &a2));
      kvt_entry_free(got);
    }
    kvt_stats s = stats_of(t);
    /* The old copy was dropped at the replace, not caught later by the
     * block check against the new version's files (which would still
     * serve the right data, at the cost of a failed check per hit). */
    CHECK_EQ_INT(s.host_cache_verify_failures, 0);
    CHECK_EQ_INT(s.quarantined, 0);
    CHECK_EQ_INT(s.host_cache_entries, 1);
    kvt_tier_free(t);
    t_free(&a);
    t_free(&a2);
  }
}

static void test_retention(void) {
  kvt_options o = t_opts("ram5");
  o.retention_seconds = 1;
  o.host_cache_bytes = (uint64_t)64 << 20;
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  t_entry e = mk(20);
  REQUIRE(t_spill(t, &e) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  CHECK_EQ_INT(stats_of(t).host_cache_entries, 1);
  /* Expired entries are never served (from RAM either), and the sweep (a
   * quarter of the retention) drops the RAM copy: wait for it, bounded. */
  int gone = 0;
  for (int i = 0; i < 100 && !gone; i++) {
    usleep(50 * 1000);
    kvt_stats s = stats_of(t); /* the counter rises just after the removal */
    gone = s.host_cache_entries == 0 && s.expirations == 1;
  }
  CHECK(gone);
  CHECK(promote(t, &e) == NULL);
  CHECK_EQ_INT(stats_of(t).expirations, 1);
  t_free(&e);
  kvt_tier_free(t);
}

/* An altered RAM copy (a caller writing into a promoted entry, or a bad
 * DIMM) is caught by the block checksums: the disk is read instead and the
 * entry on disk is left alone. */
static void test_altered_copy(void) {
  kvt_options o;
  kvt_tier *t = open_with("ram6", (uint64_t)64 << 20, &o);
  t_entry e = mk(30);
  REQUIRE(t_spill(t, &e) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  kvt_entry *got = promote(t, &e);
  REQUIRE(got);
  const kvt_layer *l = kvt_entry_layer(got, 2);
  ((unsigned char *)l->tensors[1].data)[1000] ^= 0x40; /* breaks the contract */
  kvt_entry_free(got);
  got = promote(t, &e);
  REQUIRE(got);
  CHECK(t_same(got, &e));
  kvt_entry_free(got);
  kvt_stats s = stats_of(t);
  CHECK_EQ_INT(s.host_cache_verify_failures, 1);
  CHECK_EQ_INT(s.quarantined, 0);
  CHECK_EQ_INT(s.promotes_from_ram, 1);
  CHECK_EQ_INT(s.promotes_from_disk, 1);
  CHECK_EQ_INT(s.promotion_failures, 0);
  t_free(&e);
  kvt_tier_free(t);
}

typedef struct ualloc {
  int allocs, frees;
} ualloc;
static void *u_alloc(void *ctx, uint32_t layer, uint32_t tensor,
                     const kvt_tensor *d) {
  (void)layer;
  (void)tensor;
  ((ualloc *)ctx)->allocs++;
  return malloc(d->nbytes ? d->nbytes : 1);
}
static void u_free(void *ctx, void *buf) {
  ((ualloc *)ctx)->frees++;
  free(buf);
}

static void test_caller_buffers_and_nocopy(void) {
  kvt_options o;
  kvt_tier *t = open_with("ram7", (uint64_t)64 << 20, &o);
  t_entry e = mk(40), z = mk(41);
  REQUIRE(t_spill(t, &e) == 0);
  /* Zero-copy: cached when written too (the writer copies it before it
   * releases the caller's buffers). */
  REQUIRE(kvt_tier_spill_nocopy(t, z.tokens, z.n_tokens, z.layers, z.n_layers,
                                z.memory_bytes, NULL, NULL) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  CHECK_EQ_INT(stats_of(t).host_cache_entries, 2);
  ualloc ua = {0, 0};
  kvt_promote_opts po;
  kvt_promote_opts_init(&po, KVT_PROMOTE_OPTS_VERSION);
  po.alloc = u_alloc;
  po.free_buf = u_free;
  po.alloc_ctx = &ua;
  kvt_entry *got = NULL;
  REQUIRE(kvt_tier_promote(&got, t, e.tokens, e.n_tokens, &po) == 0);
  CHECK(t_same(got, &e));
  CHECK_EQ_INT(ua.allocs, 8);
  CHECK_EQ_INT(stats_of(t).host_cache_entries, 2); /* copied, still there */
  kvt_entry_free(got);
  CHECK_EQ_INT(ua.frees, 8);
  CHECK_EQ_INT(stats_of(t).promotes_from_ram, 1);
  /* The zero-copy entry: its first promote is a RAM hit, bit for bit (the
   * cache's copy is its own: the caller's buffers are altered after). */
  uint64_t hits0 = stats_of(t).host_cache_hits;
  ((uint8_t *)z.layers[1].tensors[0].data)[5] ^= 0x40;
  got = promote(t, &z);
  REQUIRE(got);
  ((uint8_t *)z.layers[1].tensors[0].data)[5] ^= 0x40;
  CHECK(t_same(got, &z));
  kvt_entry_free(got);
  CHECK_EQ_INT(stats_of(t).host_cache_hits, hits0 + 1);
  CHECK_EQ_INT(stats_of(t).host_cache_entries, 2);
  got = promote(t, &z);
  REQUIRE(got);
  kvt_entry_free(got);
  kvt_stats s = stats_of(t);
  CHECK_EQ_INT(s.promotes_from_ram, 3);
  CHECK_EQ_INT(s.promotes_from_disk, 0);
  /* An entry that outlives its tier: freed afterwards without harm. */
  got = promote(t, &e);
  REQUIRE(got);
  kvt_tier_free(t);
  CHECK(t_same(got, &e));
  kvt_entry_free(got);
  t_free(&e);
  t_free(&z);
}

/* n async promotes of e, each result checked and freed. */
static void async_rounds(kvt_tier *t, const t_entry *e, int n) {
  for (int i = 0; i < n; i++) {
    kvt_promise *p = NULL;
    REQUIRE(kvt_tier_promote_async(&p, t, e->tokens, e->n_tokens, NULL) == 0);
    REQUIRE(kvt_promise_wait(p, -1) == 0);
    kvt_entry *got = NULL;
    REQUIRE(kvt_promise_result(&got, p) == 0);
    CHECK(t_same(got, e));
    kvt_entry_free(got);
    kvt_promise_free(p);
  }
}

static void test_async_and_disabled(void) {
  kvt_options o;
  kvt_tier *t = open_with("ram8", 0, &o);
  t_entry e = mk(50);
  REQUIRE(t_spill(t, &e) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  kvt_stats s = stats_of(t);
  CHECK_EQ_INT(s.host_cache_entries, 0);
  CHECK_EQ_INT(s.host_cache_bytes_bound, 0);
  async_rounds(t, &e, 2);
  s = stats_of(t);
  CHECK_EQ_INT(s.promotes_from_disk, 2);
  CHECK_EQ_INT(s.promotes_from_ram, 0);
  CHECK_EQ_INT(s.host_cache_hits + s.host_cache_misses, 0);
  /* On: async promotes are served from RAM after the first. */
  REQUIRE(kvt_tier_set_host_cache_bytes(t, (uint64_t)64 << 20) == 0);
  async_rounds(t, &e, 3);
  s = stats_of(t);
  CHECK_EQ_INT(s.promotes_from_disk, 3);
  CHECK_EQ_INT(s.promotes_from_ram, 2);
  t_free(&e);
  kvt_tier_free(t);
}

int main(void) {
  RUN(test_spill_then_ram);
  RUN(test_bound_and_pressure);
  RUN(test_trim_returns_memory);
  RUN(test_invalidation);
  RUN(test_replace_each_mode);
  RUN(test_retention);
  RUN(test_altered_copy);
  RUN(test_caller_buffers_and_nocopy);
  RUN(test_async_and_disabled);
  return kvt_test_done();
}
