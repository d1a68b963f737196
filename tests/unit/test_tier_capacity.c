/*
 * test_tier_capacity.c - capacity and retention: LRU eviction by entry count
 * and by bytes actually on disk (not RAM estimates), LRU order respecting
 * touches and promotes, kvt_tier_gc (dry run and real, with explicit limits),
 * retention since written (expired entries are never returned, the writer's
 * periodic sweep and gc remove them and count expirations), and a replace
 * resetting the written time. The boundary itself: a tier holding exactly
 * its limit (in bytes or in entries) is within it - nothing is evicted - and
 * one byte or one entry over it evicts exactly one.
 */
#include "tier_testlib.h"

/* The LRU order under test is write_all's: the default (adaptive) declines
 * most first sightings once the store has evicted, which these tests'
 * distinct entries all are. */
static kvt_tier *open_started(kvt_options *o) {
  o->admission_policy = KVT_ADMIT_WRITE_ALL;
  kvt_tier *t = t_open(o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  return t;
}

static int stored(kvt_tier *t, const t_entry *e) {
  kvt_entry_info info;
  return kvt_tier_lookup(&info, t, e->tokens, e->n_tokens) == 0;
}

static void test_capacity_by_count(void) {
  kvt_options o = t_opts("count");
  o.max_entries = 3;
  kvt_tier *t = open_started(&o);
  t_entry e[6];
  for (int i = 0; i < 6; i++) {
    e[i] = t_make(10 + i, 8, 1, 2, 2);
    CHECK_EQ_INT(t_spill(t, &e[i]), 0);
    CHECK_EQ_INT(kvt_tier_flush(t, -1), 0); /* distinct accessed_at order */
    usleep(2000);
  }
  kvt_stats s = KVT_STATS_INIT;
  kvt_tier_stats(&s, t);
  CHECK_EQ_INT(s.entries, 3);
  CHECK_EQ_INT(s.evictions, 3);
  for (int i = 0; i < 3; i++)
    CHECK(!stored(t, &e[i]));
  for (int i = 3; i < 6; i++)
    CHECK(stored(t, &e[i]));
  /* Evicted entries' files are gone too. */
  char *d = t_entry_path(t, e[0].tokens, e[0].n_tokens, NULL);
  CHECK(!kvt_test_exists(d));
  free(d);
  kvt_tier_free(t);
  for (int i = 0; i < 6; i++)
    t_free(&e[i]);
}

static void test_lru_respects_touch(void) {
  kvt_options o = t_opts("lru");
  o.max_entries = 3;
  kvt_tier *t = open_started(&o);
  t_entry e[4];
  for (int i = 0; i < 4; i++)
    e[i] = t_make(20 + i, 8, 1, 2, 2);
  for (int i = 0; i < 3; i++) {
    CHECK_EQ_INT(t_spill(t, &e[i]), 0);
    CHECK_EQ_INT(kvt_tier_flush(t, -1), 0);
    usleep(2000);
  }
  /* e0 is the oldest; a promote (touch) makes e1 the LRU victim instead... */
  kvt_entry *got = NULL;
  CHECK_EQ_INT(kvt_tier_promote(&got, t, e[0].tokens, 8, NULL), 0);
  kvt_entry_free(got);
  usleep(2000);
  CHECK_EQ_INT(kvt_tier_touch(t, e[1].tokens, 8), 0); /* ... then e2 */
  usleep(2000);
  /* ... but a NO_TOUCH promote does not protect e2. */
  kvt_promote_opts po = t_popts(NULL);
  po.flags = KVT_PROMOTE_NO_TOUCH;
  CHECK_EQ_INT(kvt_tier_promote(&got, t, e[2].tokens, 8, &po), 0);
  kvt_entry_free(got);
  CHECK_EQ_INT(t_spill(t, &e[3]), 0);
  CHECK_EQ_INT(kvt_tier_flush(t, -1), 0);
  CHECK(stored(t, &e[0]));
  CHECK(stored(t, &e[1]));
  CHECK(!stored(t, &e[2]));
  CHECK(stored(t, &e[3]));
  kvt_tier_free(t);
  for (int i = 0; i < 4; i++)
    t_free(&e[i]);
}

static void test_capacity_by_disk_bytes(void) {
  /* Measure one entry's size on disk, then allow 3.5 of them. RAM estimates
   * (memory_bytes) are set absurdly high and low to prove they are not what is
   * counted. */
  kvt_options o = t_opts("bytesprobe");
  kvt_tier *t = open_started(&o);
  t_entry probe = t_make(30, 16, 2, 8, 8);
  CHECK_EQ_INT(t_spill(t, &probe), 0);
  CHECK_EQ_INT(kvt_tier_flush(t, -1), 0);
  kvt_entry_info info;
  CHECK_EQ_INT(kvt_tier_lookup(&info, t, probe.tokens, 16), 0);
  uint64_t one = info.disk_bytes;
  kvt_tier_free(t);

  o = t_opts("bytes");
  o.max_size_gb = (double)(one * 7 / 2) / 1073741824.0;
  t = open_started(&o);
  t_entry e[6];
  for (int i = 0; i < 6; i++) {
    e[i] = t_make(31 + i, 16, 2, 8, 8);
    e[i].memory_bytes = i % 2 ? 1 : (uint64_t)1 << 40;
    CHECK_EQ_INT(t_spill(t, &e[i]), 0);
    CHECK_EQ_INT(kvt_tier_flush(t, -1), 0);
    usleep(2000);
  }
  kvt_stats s = KVT_STATS_INIT;
  kvt_tier_stats(&s, t);
  CHECK_EQ_INT(s.entries, 3);
  CHECK_EQ_INT(s.evictions, 3);
  CHECK(s.disk_bytes <= one * 7 / 2);
  CHECK(s.disk_bytes > 3 * one - 64 && s.disk_bytes < 3 * one + 64);
  CHECK(!stored(t, &e[2]));
  CHECK(stored(t, &e[3]) && stored(t, &e[4]) && stored(t, &e[5]));
  kvt_tier_free(t);
  t_free(&probe);
  for (int i = 0; i < 6; i++)
    t_free(&e[i]);
}

static void test_gc(void) {
  kvt_options o = t_opts("gc");
  kvt_tier *t = open_started(&o);
  t_entry e[5];
  uint64_t bytes[5];
  for (int i = 0; i < 5; i++) {
    e[i] = t_make(40 + i, 8, 1, 2, 2);
    CHECK_EQ_INT(t_spill(t, &e[i]), 0);
    CHECK_EQ_INT(kvt_tier_flush(t, -1), 0);
    kvt_entry_info info;
    kvt_tier_lookup(&info, t, e[i].tokens, 8);
    bytes[i] = info.disk_bytes;
    usleep(2000);
  }
  kvt_gc_opts g = KVT_GC_OPTS_INIT;
  g.max_entries = 2;
  g.dry_run = 1;
  uint64_t n = 0, nb = 0;
  CHECK_EQ_INT(kvt_tier_gc(t, &g, &n, &nb), 0);
  CHECK_EQ_INT(n, 3);
  CHECK_EQ_INT(nb, bytes[0] + bytes[1] + bytes[2]);
  kvt_stats s = KVT_STATS_INIT;
  kvt_tier_stats(&s, t);
  CHECK_EQ_INT(s.entries, 5); /* dry run removed nothing */
  g.dry_run = 0;
  CHECK_EQ_INT(kvt_tier_gc(t, &g, &n, &nb), 0);
  CHECK_EQ_INT(n, 3);
  kvt_tier_stats(&s, t);
  CHECK_EQ_INT(s.entries, 2);
  CHECK_EQ_INT(s.evictions, 3);
  CHECK(stored(t, &e[3]) && stored(t, &e[4]));
  /* older_than 0: everything written before now goes, counted as expirations.
   */
  g = (kvt_gc_opts)KVT_GC_OPTS_INIT;
  g.older_than_seconds = 0;
  CHECK_EQ_INT(kvt_tier_gc(t, &g, &n, NULL), 0);
  CHECK_EQ_INT(n, 2);
  kvt_tier_stats(&s, t);
  CHECK_EQ_INT(s.entries, 0);
  CHECK_EQ_INT(s.expirations, 2);
  /* NULL opts: the configured limits (nothing to do). */
  CHECK_EQ_INT(kvt_tier_gc(t, NULL, &n, NULL), 0);
  CHECK_EQ_INT(n, 0);
  g.version = 9;
  CHECK_EQ_INT(kvt_tier_gc(t, &g, NULL, NULL), KVT_EINVAL);
  kvt_tier_free(t);
  for (int i = 0; i < 5; i++)
    t_free(&e[i]);
}

static void test_capacity_boundary(void) {
  kvt_options o = t_opts("boundary");
  kvt_tier *t = open_started(&o);
  t_entry e[3];
  for (int i = 0; i < 3; i++) {
    e[i] = t_make(50 + i, 8, 1, 2, 2);
    CHECK_EQ_INT(t_spill(t, &e[i]), 0);
    CHECK_EQ_INT(kvt_tier_flush(t, -1), 0);
    usleep(2000);
  }
  kvt_stats s = KVT_STATS_INIT;
  CHECK_EQ_INT(kvt_tier_stats(&s, t), 0);
  CHECK_EQ_INT(s.entries, 3);
  const uint64_t total = s.disk_bytes; /* exactly what capacity counts */
  CHECK(total > 0);
  /* Real (not dry-run) gc: the writer's own enforcement. */
  kvt_gc_opts g = KVT_GC_OPTS_INIT;
  uint64_t n = 99;
  g.max_bytes = total; /* exactly full: within the limit */
  CHECK_EQ_INT(kvt_tier_gc(t, &g, &n, NULL), 0);
  CHECK_EQ_INT(n, 0);
  g.max_bytes = 0;
  g.max_entries = 3;
  CHECK_EQ_INT(kvt_tier_gc(t, &g, &n, NULL), 0);
  CHECK_EQ_INT(n, 0);
  CHECK_EQ_INT(kvt_tier_stats(&s, t), 0);
  CHECK_EQ_INT(s.entries, 3);
  CHECK_EQ_INT(s.evictions, 0);
  g.max_entries = 0;
  g.max_bytes = total - 1; /* one byte over: the LRU entry goes */
  CHECK_EQ_INT(kvt_tier_gc(t, &g, &n, NULL), 0);
  CHECK_EQ_INT(n, 1);
  CHECK(!stored(t, &e[0]) && stored(t, &e[1]) && stored(t, &e[2]));
  g.max_bytes = 0;
  g.max_entries = 1; /* one entry over */
  CHECK_EQ_INT(kvt_tier_gc(t, &g, &n, NULL), 0);
  CHECK_EQ_INT(n, 1);
  CHECK(!stored(t, &e[1]) && stored(t, &e[2]));
  kvt_tier_free(t);
  for (int i = 0; i < 3; i++)
    t_free(&e[i]);
}

static void test_retention(void) {
  kvt_options o = t_opts("retention");
  o.retention_seconds = 1;
  kvt_tier *t = open_started(&o);
  t_entry a = t_make(50, 8, 1, 2, 2), b = t_make(51, 8, 1, 2, 2);
  t_entry longer = t_make(52, 20, 1, 2, 2);
  t_set_prefix(&longer, &a);
  CHECK_EQ_INT(t_spill(t, &a), 0);
  CHECK_EQ_INT(kvt_tier_flush(t, -1), 0);
  CHECK(stored(t, &a));
  /* Touching does not extend the life: retention counts from the write. */
  usleep(600 * 1000);
  CHECK_EQ_INT(kvt_tier_touch(t, a.tokens, 8), 0);
  CHECK_EQ_INT(t_spill(t, &b), 0);
  CHECK_EQ_INT(kvt_tier_flush(t, -1), 0);
  usleep(550 * 1000); /* a is now > 1 s old, b ~0.55 s */
  kvt_entry_info info;
  CHECK_EQ_INT(kvt_tier_lookup(&info, t, a.tokens, 8), KVT_ENOTFOUND);
  CHECK_EQ_INT(kvt_tier_lookup_prefix(&info, t, longer.tokens, 20),
               KVT_ENOTFOUND);
  kvt_entry *got = NULL;
  CHECK_EQ_INT(kvt_tier_promote(&got, t, a.tokens, 8, NULL), KVT_ENOTFOUND);
  CHECK_EQ_INT(kvt_tier_touch(t, a.tokens, 8), KVT_ENOTFOUND);
  CHECK(stored(t, &b));
  /* The writer's periodic sweep (every 0.25 s for a 1 s retention) removes it
   * and counts it, without any call (gc's expiry path is covered in test_gc).
   */
  kvt_stats s = KVT_STATS_INIT;
  for (int i = 0; i < 40; i++) {
    kvt_tier_stats(&s, t);
    if (s.expirations >= 1)
      break;
    usleep(25 * 1000);
  }
  CHECK_EQ_INT(s.expirations, 1);
  CHECK_EQ_INT(s.entries, 1);
  char *d = t_entry_path(t, a.tokens, 8, NULL);
  CHECK(!kvt_test_exists(d));
  free(d);
  /* Re-spilling a (replace) starts its life again. */
  CHECK_EQ_INT(t_spill(t, &a), 0);
  CHECK_EQ_INT(kvt_tier_flush(t, -1), 0);
  CHECK(stored(t, &a));
  kvt_tier_free(t);
  t_free(&a);
  t_free(&b);
  t_free(&longer);
}

int main(void) {
  RUN(test_capacity_by_count);
  RUN(test_lru_respects_touch);
  RUN(test_capacity_by_disk_bytes);
  RUN(test_gc);
  RUN(test_capacity_boundary);
  RUN(test_retention);
  return kvt_test_done();
}
