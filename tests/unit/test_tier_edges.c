/*
 * test_tier_edges.c - the smaller reliability points of issue 18 (item 7),
 * one test each: a spill whose layer claims more tensors than its kind (and
 * the caller's array) has is refused without reading past the array (ASan
 * caught the overflow); kvt_tier_read_entry does not serve an entry past
 * retention_seconds even when no sweep has run; a KV layer whose offset lies
 * beyond its tensors' token axis is corrupt, never served; a read-only open
 * of a directory whose index.db exists but has no tables yet (a writer is
 * creating it) sees an empty cache instead of "no such table"; deleting
 * kvtier.lock does not let a second writer in.
 */
#include "tier_testlib.h"

#include <sqlite3.h>
#include <sys/stat.h>
#include <time.h>

static void test_spill_num_tensors_past_array(void) {
  kvt_options o = t_opts("edge-nt");
  kvt_tier *t = t_open(&o);
  t_entry e = t_make(1, 8, 1, 4, 4);
  /* A KV layer claiming 1000 tensors over an array of 2. */
  kvt_layer l = e.layers[0];
  kvt_tensor two[2];
  memcpy(two, l.tensors, sizeof two);
  l.tensors = two;
  l.num_tensors = 1000;
  CHECK_EQ_INT(kvt_tier_spill(t, e.tokens, e.n_tokens, &l, 1, 100), KVT_EINVAL);
  CHECK(strstr(kvt_last_error(), "tensors") != NULL);
  kvt_tier_close(t, -1);
  kvt_tier_free(t);
  t_free(&e);
}

/* Deleting kvtier.lock does not let a second writer in: the directory
 * itself is locked. */
static void test_lock_file_deleted(void) {
  kvt_options o = t_opts("edge-lock");
  kvt_tier *a = t_open(&o);
  char lp[4200];
  snprintf(lp, sizeof lp, "%s/kvtier.lock", o.cache_dir);
  REQUIRE(unlink(lp) == 0);
  kvt_tier *b = NULL;
  CHECK_EQ_INT(kvt_tier_open(&b, &o), KVT_EBUSY);
  CHECK(b == NULL);
  kvt_tier_close(a, -1);
  kvt_tier_free(a);
  /* Released at close: the next writer gets in. */
  CHECK_EQ_INT(kvt_tier_open(&b, &o), 0);
  kvt_tier_close(b, -1);
  kvt_tier_free(b);
}

/* read_entry applies retention_seconds even when no sweep ran (no writer
 * thread here, so no sweep can). */
static void test_read_entry_past_retention(void) {
  kvt_options o = t_opts("edge-ret");
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  t_entry e = t_make(2, 8, 1, 4, 4);
  REQUIRE(t_spill(t, &e) == 0 && kvt_tier_flush(t, -1) == 0);
  kvt_tier_close(t, -1);
  kvt_tier_free(t);
  char h[65];
  kvt_token_hash(h, e.tokens, e.n_tokens);
  o.retention_seconds = 1;
  t = t_open(&o); /* no writer: no sweep */
  kvt_entry *got = NULL;
  CHECK_EQ_INT(kvt_tier_read_entry(&got, t, e.tokens, e.n_tokens, h), 0);
  kvt_entry_free(got);
  got = NULL;
  struct timespec ts = {1, 300 * 1000 * 1000};
  nanosleep(&ts, NULL);
  CHECK_EQ_INT(kvt_tier_read_entry(&got, t, e.tokens, e.n_tokens, h),
               KVT_ENOTFOUND);
  CHECK(got == NULL);
  CHECK_EQ_INT(kvt_tier_promote(&got, t, e.tokens, e.n_tokens, NULL),
               KVT_ENOTFOUND);
  kvt_tier_close(t, -1);
  kvt_tier_free(t);
  t_free(&e);
}

/* A read-only open racing the directory's creation: index.db exists (the
 * writer creates it empty first) but has no tables yet - an empty cache, not
 * "no such table: entries". */
static void test_readonly_before_schema(void) {
  char *dir = kvt_test_tmpdir("edge-ro");
  char p[4200];
  snprintf(p, sizeof p, "%s/data", dir);
  REQUIRE(mkdir(p, 0700) == 0);
  snprintf(p, sizeof p, "%s/index.db", dir);
  FILE *f = fopen(p, "w");
  REQUIRE(f != NULL);
  fclose(f);
  kvt_options o;
  kvt_options_init(&o, KVT_OPTIONS_VERSION);
  o.cache_dir = dir;
  o.flags = KVT_OPEN_READONLY;
  kvt_tier *t = NULL;
  int rc = kvt_tier_open(&t, &o);
  if (rc != 0)
    fprintf(stderr, "  read-only open: %s\n", kvt_last_error());
  CHECK_EQ_INT(rc, 0);
  if (t) {
    kvt_stats s = KVT_STATS_INIT;
    CHECK_EQ_INT(kvt_tier_stats(&s, t), 0);
    CHECK_EQ_INT(s.entries, 0);
    int32_t tok[2] = {1, 2};
    kvt_entry *got = NULL;
    CHECK_EQ_INT(kvt_tier_promote(&got, t, tok, 2, NULL), KVT_ENOTFOUND);
    kvt_tier_close(t, -1);
    kvt_tier_free(t);
  }
}

int main(void) {
  RUN(test_spill_num_tensors_past_array);
  RUN(test_lock_file_deleted);
  RUN(test_read_entry_past_retention);
  RUN(test_readonly_before_schema);
  return kvt_test_done();
}
