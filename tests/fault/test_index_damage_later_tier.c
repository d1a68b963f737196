/*
 * test_index_damage_later_tier.c - index.db damaged while the tier is open
 * (issue 18 item 1: "SQLITE_NOTADB / SQLITE_CORRUPT at open or later").
 * Damage found at open was already rebuilt from the entry directories; damage
 * appearing later was only an error on every index write. Here index.db's
 * pages are overwritten under an open tier: kvt_tier_check_index (what
 * `kvtier verify` runs) reports it, the tier goes on serving every entry from
 * its in-memory index, and its close sets the file aside so the next open
 * rebuilds it - whole entries and a chained entry of the chunked store alike,
 * bit-exact.
 */
#include "rel_tier.h"
#include "kvtier_sys.h"

#include <dirent.h>
#include <fcntl.h>

#define N_ENT 5

static char g_root[4096];

static int count_prefix(const char *dir, const char *prefix) {
  DIR *d = opendir(dir);
  int n = 0;
  struct dirent *de;
  while (d && (de = readdir(d)))
    if (!strncmp(de->d_name, prefix, strlen(prefix)))
      n++;
  if (d)
    closedir(d);
  return n;
}

static int served(kvt_tier *t, const t_entry *e, int n) {
  int ok = 0;
  for (int i = 0; i < n; i++) {
    kvt_entry *got = NULL;
    if (kvt_tier_promote(&got, t, e[i].tokens, e[i].n_tokens, NULL) == 0 &&
        t_same(got, &e[i]))
      ok++;
    else
      fprintf(stderr, "  entry %d not served (%s)\n", i, kvt_last_error());
    kvt_entry_free(got);
  }
  return ok;
}

static void test_damage_while_open(void) {
  char *dir = rel_path(g_root, "later", NULL);
  kvt_options o = rel_opts(dir, KVT_DURABILITY_NONE);
  o.host_cache_bytes = 0; /* every promote reads the files */
  t_entry e[N_ENT];
  for (int i = 0; i < N_ENT - 1; i++)
    e[i] = t_make(300 + (uint64_t)i, 12 + (size_t)i, 2, 4, 4);
  e[N_ENT - 1] = t_make(399, 300, 2, 300, 4); /* chained (chunk_tokens 256) */
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  for (int i = 0; i < N_ENT; i++)
    REQUIRE(t_spill(t, &e[i]) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  CHECK_EQ_INT(kvt_tier_close(t, -1), 0); /* checkpointed into index.db */
  kvt_tier_free(t);

  t = t_open(&o);
  CHECK_EQ_INT(kvt_tier_check_index(t), 0); /* intact: ok */
  /* Every page after the header page overwritten under the open tier. */
  char *db = rel_path(dir, "index.db", NULL);
  int fd = open(db, O_WRONLY);
  REQUIRE(fd >= 0);
  struct stat st;
  REQUIRE(fstat(fd, &st) == 0 && st.st_size > 4096);
  char junk[4096];
  kvt_rng r = {5};
  for (off_t off = 4096; off < st.st_size; off += 4096) {
    kvt_rng_fill(&r, junk, sizeof junk);
    REQUIRE(pwrite(fd, junk, sizeof junk, off) == (ssize_t)sizeof junk);
  }
  close(fd);
  free(db);
  CHECK_EQ_INT(kvt_tier_check_index(t), KVT_ECORRUPT);
  CHECK_EQ_INT(served(t, e, N_ENT), N_ENT); /* from the in-memory index */
  CHECK_EQ_INT(kvt_tier_close(t, -1), 0);
  kvt_tier_free(t);
  CHECK_EQ_INT(count_prefix(dir, "index.db.corrupt-"), 1);

  t = t_open(&o); /* rebuilt from the entry directories and chunk files */
  CHECK_EQ_INT(served(t, e, N_ENT), N_ENT);
  CHECK_EQ_INT(kvt_tier_check_index(t), 0);
  CHECK_EQ_INT(rel_stats(t).entries, N_ENT);
  kvt_tier_free(t);
  for (int i = 0; i < N_ENT; i++)
    t_free(&e[i]);
  free(dir);
}

int main(void) {
  r_use_fast_tmp();
  snprintf(g_root, sizeof g_root, "%s", kvt_test_tmpdir("idx-later"));
  RUN(test_damage_while_open);
  return kvt_test_done();
}
