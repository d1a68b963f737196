/*
 * test_tier_versions.c - the versioned public structs and the per-tier read
 * threads: kvt_options_init for version 1 writes only what a version-1 caller
 * has, a version-1 struct validates and opens a tier whatever lies beyond its
 * end, unknown versions are refused; read_threads is validated (0..8) and a
 * tier reads correctly with 1, 3 and 8 threads per entry; kvt_stats must carry
 * a known version (KVT_STATS_INIT / kvt_stats_init), which kvt_tier_stats
 * keeps, and kvt_stats_size matches the header.
 */
#include "tier_testlib.h"

#include <stddef.h>

#define CANARY 0xAB

static void test_options_versions(void) {
  unsigned char buf[sizeof(kvt_options)];
  memset(buf, CANARY, sizeof buf);
  kvt_options *o = (kvt_options *)buf;
  CHECK_EQ_INT(kvt_options_init(o, 1), 0);
  CHECK_EQ_INT(o->version, 1);
  CHECK(o->max_size_gb == 10.0 && o->promote_threads == 2);
  size_t v1 = offsetof(kvt_options, read_threads);
  int untouched = 1;
  for (size_t i = v1; i < sizeof buf; i++)
    untouched &= buf[i] == CANARY;
  CHECK(untouched); /* a version-1 caller's struct ends before read_threads */
  /* Fields beyond a version-1 struct are not read: its garbage is ignored. */
  CHECK_EQ_INT(kvt_options_validate(o), 0);
  o->version = KVT_OPTIONS_VERSION;
  CHECK_EQ_INT(kvt_options_validate(o), KVT_EINVAL); /* now it is read */
  CHECK(strstr(kvt_last_error(), "read_threads") != NULL);

  kvt_options c;
  CHECK_EQ_INT(kvt_options_init(&c, KVT_OPTIONS_VERSION), 0);
  CHECK_EQ_INT(c.read_threads, 0);
  kvt_options m = KVT_OPTIONS_INIT;
  CHECK_EQ_INT(m.version, KVT_OPTIONS_VERSION);
  CHECK(m.remote_chunk_bytes == c.remote_chunk_bytes &&
        m.remote_timeout_ms == c.remote_timeout_ms &&
        m.quarantine_max == c.quarantine_max && m.read_threads == 0);
  /* A version-3 caller's struct ends before the version-4 remote fields. */
  memset(buf, CANARY, sizeof buf);
  CHECK_EQ_INT(kvt_options_init(o, 3), 0);
  untouched = 1;
  for (size_t i = offsetof(kvt_options, remote_lookup_timeout_ms);
       i < sizeof buf; i++)
    untouched &= buf[i] == CANARY;
  CHECK(untouched);
  CHECK_EQ_INT(kvt_options_validate(o), 0); /* the garbage is not read */
  CHECK_EQ_INT(c.remote_lookup_timeout_ms, 250);
  /* 0 and the version after this library's are unknown */
  for (unsigned v = 0; v <= KVT_OPTIONS_VERSION + 1;
       v += KVT_OPTIONS_VERSION + 1) {
    CHECK_EQ_INT(kvt_options_init(&c, v), KVT_EINVAL);
    kvt_options bad = KVT_OPTIONS_INIT;
    bad.version = v;
    CHECK_EQ_INT(kvt_options_validate(&bad), KVT_EINVAL);
  }
  /* Version 2 ends before host_cache_bytes (version 3): not written by init,
   * and the derived default at open. */
  memset(buf, CANARY, sizeof buf);
  CHECK_EQ_INT(kvt_options_init(o, 2), 0);
  CHECK(buf[offsetof(kvt_options, host_cache_bytes)] == CANARY);
  CHECK_EQ_INT(kvt_options_validate(o), 0);
  CHECK(c.host_cache_bytes == KVT_HOST_CACHE_AUTO);
  kvt_options r = KVT_OPTIONS_INIT;
  r.read_threads = 9;
  CHECK_EQ_INT(kvt_options_validate(&r), KVT_EINVAL);
  r.read_threads = 8;
  CHECK_EQ_INT(kvt_options_validate(&r), 0);
}

static void test_open_v1(void) {
  kvt_options cur = t_opts("v1");
  unsigned char buf[sizeof(kvt_options)];
  memset(buf, CANARY, sizeof buf);
  memcpy(buf, &cur, offsetof(kvt_options, read_threads));
  kvt_options *o = (kvt_options *)buf;
  o->version = 1;
  kvt_tier *t = t_open(o);
  t_entry e = t_make(11, 64, 6, 64, 8);
  CHECK_EQ_INT(kvt_tier_start_writer(t), 0);
  CHECK_EQ_INT(t_spill(t, &e), 0);
  CHECK_EQ_INT(kvt_tier_flush(t, 20000), 0);
  kvt_entry *got = NULL;
  CHECK_EQ_INT(kvt_tier_promote(&got, t, e.tokens, e.n_tokens, NULL), 0);
  CHECK(got && t_same(got, &e));
  kvt_entry_free(got);
  CHECK_EQ_INT(kvt_tier_close(t, 20000), 0);
  kvt_tier_free(t);
  t_free(&e);
}

static void test_read_threads(void) {
  const unsigned counts[] = {1, 3, 8};
  for (size_t i = 0; i < sizeof counts / sizeof counts[0]; i++) {
    kvt_options o = t_opts("rt");
    o.read_threads = counts[i];
    kvt_tier *t = t_open(&o);
    t_entry e = t_make(20 + i, 96, 9, 32, 16); /* >= 4 layers: threaded */
    CHECK_EQ_INT(kvt_tier_start_writer(t), 0);
    CHECK_EQ_INT(t_spill(t, &e), 0);
    CHECK_EQ_INT(kvt_tier_flush(t, 20000), 0);
    for (int rep = 0; rep < 3; rep++) {
      kvt_entry *got = NULL;
      CHECK_EQ_INT(kvt_tier_promote(&got, t, e.tokens, e.n_tokens, NULL), 0);
      CHECK(got && t_same(got, &e));
      kvt_entry_free(got);
    }
    char hash[KVT_HASH_HEX_LEN + 1];
    CHECK_EQ_INT(kvt_token_hash(hash, e.tokens, e.n_tokens), 0);
    CHECK_EQ_INT(kvt_tier_verify(t, hash, 0), 0);
    kvt_tier_free(t);
    t_free(&e);
  }
}

static void test_stats_version(void) {
  CHECK_EQ_INT(kvt_stats_size(), sizeof(kvt_stats));
  kvt_options o = t_opts("st");
  kvt_tier *t = t_open(&o);
  kvt_stats s;
  memset(&s, 0, sizeof s); /* no version: refused, nothing written */
  s.ssd_hits = 77;
  CHECK_EQ_INT(kvt_tier_stats(&s, t), KVT_EINVAL);
  CHECK(strstr(kvt_last_error(), "KVT_STATS_INIT") != NULL);
  CHECK_EQ_INT(s.ssd_hits, 77);
  s.version = KVT_STATS_VERSION + 1;
  CHECK_EQ_INT(kvt_tier_stats(&s, t), KVT_EINVAL);
  kvt_stats a = KVT_STATS_INIT;
  CHECK_EQ_INT(kvt_tier_stats(&a, t), 0);
  CHECK_EQ_INT(a.version, KVT_STATS_VERSION);
  CHECK_EQ_INT(a.ssd_misses, 0);
  int32_t tok[3] = {1, 2, 3};
  kvt_entry *e = NULL;
  CHECK_EQ_INT(kvt_tier_promote(&e, t, tok, 3, NULL), KVT_ENOTFOUND);
  CHECK_EQ_INT(kvt_tier_stats(&a, t), 0); /* reused: version kept */
  CHECK_EQ_INT(a.version, KVT_STATS_VERSION);
  CHECK_EQ_INT(a.ssd_misses, 1);
  kvt_stats b;
  memset(&b, 0x5A, sizeof b);
  CHECK_EQ_INT(kvt_stats_init(&b, KVT_STATS_VERSION), 0);
  CHECK_EQ_INT(b.version, KVT_STATS_VERSION);
  CHECK_EQ_INT(b.spill_count, 0);
  CHECK_EQ_INT(kvt_tier_stats(&b, t), 0);
  CHECK_EQ_INT(b.ssd_misses, 1);
  CHECK_EQ_INT(kvt_stats_init(&b, 0), KVT_EINVAL);
  CHECK_EQ_INT(kvt_stats_init(NULL, KVT_STATS_VERSION), KVT_EINVAL);
  kvt_tier_free(t);
}

int main(void) {
  RUN(test_options_versions);
  RUN(test_open_v1);
  RUN(test_read_threads);
  RUN(test_stats_version);
  return kvt_test_done();
}
