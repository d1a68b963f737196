/*
 * test_cache_dir_probe.c - kvt_cache_dir_probe tells the directories a tool
 * meets apart without spelling the layout: a missing one (KVT_ENOTFOUND), a
 * file (KVT_EINVAL), an empty one, one holding something else, one a tier has
 * opened (index.db and data/), a data/ that is not a directory, an index.db
 * that cannot be opened (its errno), and counts what quarantine/ holds; a bad
 * call is refused and a failure leaves the fields zeroed.
 */
#include "testutil.h"

#include "kvtier.h"
#include "kvtier_sys.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static void touch(const char *path) {
  FILE *f = fopen(path, "wb");
  REQUIRE(f != NULL);
  fclose(f);
}

static void test_refusals(void) {
  char *base = kvt_test_tmpdir("probe");
  char p[4200];
  kvt_cache_dir_probe_info pr = KVT_CACHE_DIR_PROBE_INIT;
  CHECK_EQ_INT(kvt_cache_dir_probe(NULL, base), KVT_EINVAL);
  CHECK_EQ_INT(kvt_cache_dir_probe(&pr, NULL), KVT_EINVAL);
  CHECK_EQ_INT(kvt_cache_dir_probe(&pr, ""), KVT_EINVAL);
  kvt_cache_dir_probe_info bad = {.version = 99};
  CHECK_EQ_INT(kvt_cache_dir_probe(&bad, base), KVT_EINVAL);
  CHECK(strstr(kvt_last_error(), "version") != NULL);

  snprintf(p, sizeof p, "%s/missing", base);
  pr.empty = 7;
  CHECK_EQ_INT(kvt_cache_dir_probe(&pr, p), KVT_ENOTFOUND);
  CHECK_EQ_INT(kvt_last_errno(), ENOENT);
  CHECK(pr.version == KVT_CACHE_DIR_PROBE_VERSION && pr.empty == 0);

  snprintf(p, sizeof p, "%s/file", base);
  touch(p);
  CHECK_EQ_INT(kvt_cache_dir_probe(&pr, p), KVT_EINVAL);
  CHECK(strstr(kvt_last_error(), "not a directory") != NULL);
}

static void test_kinds(void) {
  char *base = kvt_test_tmpdir("probe");
  char p[4200];
  kvt_cache_dir_probe_info pr = KVT_CACHE_DIR_PROBE_INIT;
  REQUIRE(kvt_cache_dir_probe(&pr, base) == 0);
  CHECK(pr.empty && !pr.has_index && !pr.has_data && pr.quarantined == 0);

  snprintf(p, sizeof p, "%s/notes.txt", base); /* something else */
  touch(p);
  REQUIRE(kvt_cache_dir_probe(&pr, base) == 0);
  CHECK(!pr.empty && !pr.has_index && !pr.has_data);

  snprintf(p, sizeof p, "%s/data", base); /* a file named data is no data/ */
  touch(p);
  REQUIRE(kvt_cache_dir_probe(&pr, base) == 0);
  CHECK(!pr.has_data);
  unlink(p);

  snprintf(p, sizeof p, "%s/index.db", base); /* opens to ENOENT */
  CHECK_EQ_INT(symlink("nowhere", p), 0);
  REQUIRE(kvt_cache_dir_probe(&pr, base) == 0);
  CHECK(pr.has_index && pr.index_errno == ENOENT);
  unlink(p);
}

static void test_a_tiers_directory(void) {
  char *base = kvt_test_tmpdir("probe");
  char dir[4200], p[4300];
  snprintf(dir, sizeof dir, "%s/cache", base);
  kvt_options o;
  kvt_options_init(&o, KVT_OPTIONS_VERSION);
  o.cache_dir = dir;
  kvt_tier *t = NULL;
  REQUIRE(kvt_tier_open(&t, &o) == 0);
  kvt_tier_free(t);
  kvt_cache_dir_probe_info pr = KVT_CACHE_DIR_PROBE_INIT;
  REQUIRE(kvt_cache_dir_probe(&pr, dir) == 0);
  CHECK(!pr.empty && pr.has_index && pr.index_errno == 0 && pr.has_data);
  CHECK(pr.quarantined == 0);

  snprintf(p, sizeof p, "%s/quarantine", dir);
  mkdir(p, 0700);
  snprintf(p, sizeof p, "%s/quarantine/chunk-00", dir);
  mkdir(p, 0700);
  snprintf(p, sizeof p, "%s/quarantine/abc", dir);
  touch(p);
  REQUIRE(kvt_cache_dir_probe(&pr, dir) == 0);
  CHECK(pr.quarantined == 2);
}

int main(void) {
  RUN(test_refusals);
  RUN(test_kinds);
  RUN(test_a_tiers_directory);
  return kvt_test_done();
}
