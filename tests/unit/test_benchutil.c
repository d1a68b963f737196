/*
 * test_benchutil.c - the parts of bench/'s helpers (benchutil.h) that decide
 * whether a printed figure is honest: the flag every figure measured against
 * a physical limit passes through (above its limit, or a cold read whose
 * files were still cached), and the cold eviction of an entry, which must
 * reach every file a promote reads - the entry's directory and each chunk
 * file of its chain - and count their page-cache residency before and after.
 * `kvtier bench` and the bench programs print these; nothing here times
 * anything.
 */
#define _GNU_SOURCE
#include "benchutil.h"
#include "testutil.h"

#include <fcntl.h>
#include <string.h>
#include <sys/vfs.h>
#include <unistd.h>

static void test_flags(void) {
  /* Within the limit, at it, or without a measured limit: never flagged. */
  CHECK_EQ_INT(bu_figure_flags(0.5e9, 1e9, -1), 0);
  CHECK_EQ_INT(bu_figure_flags(1e9, 1e9, -1), 0);
  CHECK_EQ_INT(bu_figure_flags(5e9, 0, -1), 0);
  CHECK_EQ_INT(bu_figure_flags(5e9, -1, -1), 0);
  /* Above: flagged however little (the limit was measured in this run). */
  CHECK_EQ_INT(bu_figure_flags(1.0001e9, 1e9, -1), (int)BU_FIG_ABOVE_LIMIT);
  CHECK_EQ_INT(bu_figure_flags(4.2e9, 1e9, 0), (int)BU_FIG_ABOVE_LIMIT);
  /* A cold read whose files stayed cached is no disk figure even below the
   * limit; at or below the allowance it is. */
  CHECK_EQ_INT(bu_figure_flags(0.5e9, 1e9, 0.5), (int)BU_FIG_CACHED);
  CHECK_EQ_INT(bu_figure_flags(0.5e9, 0, 1.0), (int)BU_FIG_CACHED);
  CHECK_EQ_INT(bu_figure_flags(0.5e9, 1e9, BU_COLD_RESIDENT_MAX), 0);
  CHECK_EQ_INT(bu_figure_flags(0.5e9, 1e9, 0), 0);
  CHECK_EQ_INT(bu_figure_flags(2e9, 1e9, 0.9),
               (int)(BU_FIG_ABOVE_LIMIT | BU_FIG_CACHED));
  CHECK(strcmp(bu_figure_flag_text(0), "") == 0);
  CHECK(strstr(bu_figure_flag_text(BU_FIG_ABOVE_LIMIT), "above") != NULL);
  CHECK(strstr(bu_figure_flag_text(BU_FIG_CACHED), "page cache") != NULL);
  CHECK(strstr(bu_figure_flag_text(BU_FIG_CACHED | BU_FIG_ABOVE_LIMIT),
               "page cache") != NULL);
  /* A flagged figure never passes its target, whatever its ratio. */
  CHECK_EQ_INT(bu_report_limit("t", 2, 1, 2, "GB/s", "limit", 0.85, -1), 0);
  CHECK_EQ_INT(bu_report_limit("t", 0.5, 1, 0.5, "GB/s", "limit", 0.85, 0.5),
               0);
  CHECK_EQ_INT(bu_report_limit("t", 0.9, 1, 0.9, "GB/s", "limit", 0.85, 0), 1);
}

/* Whether fadvise(DONTNEED) can empty the page cache of files in dir: not on
 * tmpfs, whose pages are the files themselves. */
static int can_evict(const char *dir) {
  struct statfs s;
  return statfs(dir, &s) == 0 && s.f_type != 0x01021994;
}

static void test_evict_file(const char *dir) {
  char p[4200];
  snprintf(p, sizeof p, "%s/f.bin", dir);
  int fd = open(p, O_WRONLY | O_CREAT | O_TRUNC, 0600);
  CHECK(fd >= 0);
  static char buf[5 * 4096 + 100];
  memset(buf, 7, sizeof buf);
  CHECK(write(fd, buf, sizeof buf) == (ssize_t)sizeof buf);
  close(fd);
  long psz = sysconf(_SC_PAGESIZE);
  bu_residency r = {0};
  CHECK_EQ_INT(bu_evict_file(p, &r), 0);
  CHECK_EQ_INT((int)r.files, 1);
  CHECK_EQ_INT((int)r.pages, (int)((sizeof buf + psz - 1) / psz));
  CHECK_EQ_INT((int)r.before, (int)r.pages); /* just written: cached */
  if (can_evict(dir))
    CHECK_EQ_INT((int)r.after, 0);
  else
    kvt_test_skip("env", "tmpfs: eviction not observable");
  /* A link is not followed, a missing file counts nothing. */
  char l[4300];
  snprintf(l, sizeof l, "%s/link", dir);
  CHECK(symlink(p, l) == 0);
  CHECK_EQ_INT(bu_evict_file(l, &r), -1);
  snprintf(l, sizeof l, "%s/missing", dir);
  CHECK_EQ_INT(bu_evict_file(l, &r), -1);
  CHECK_EQ_INT((int)r.files, 1);
}

/* The cold eviction of `kvtier bench`: an entry over a chain of 4 chunks
 * (64 tokens, chunk_tokens 16, pure KV: a chain record in data/<hash>/) is 5
 * files, all counted and, warmed first by a promote through the page cache,
 * all evicted. */
static void test_evict_entry(const char *dir) {
  char cache[4200];
  snprintf(cache, sizeof cache, "%s/cache", dir);
  kvt_options o;
  kvt_options_init(&o, KVT_OPTIONS_VERSION);
  o.cache_dir = cache;
  o.chunk_tokens = 16;
  o.host_cache_bytes = 0;
  o.durability = KVT_DURABILITY_FSYNC;
  kvt_tier *t = NULL;
  CHECK_EQ_INT(kvt_tier_open(&t, &o), 0);
  if (!t)
    return;
  CHECK_EQ_INT(kvt_tier_start_writer(t), 0);
  bu_workload w;
  bu_workload_make(&w, 2, 0, KVT_DTYPE_F16, 2, 64, 32, 5);
  CHECK_EQ_INT(
      kvt_tier_spill(t, w.tokens, w.n_tokens, w.layers, w.n_layers, w.bytes),
      0);
  CHECK_EQ_INT(kvt_tier_flush(t, -1), 0);
  char hash[KVT_HASH_HEX_LEN + 1];
  kvt_token_hash(hash, w.tokens, w.n_tokens);
  kvt_promote_opts po = KVT_PROMOTE_OPTS_INIT;
  po.flags = KVT_PROMOTE_PAGE_CACHE;
  kvt_entry *e = NULL;
  CHECK_EQ_INT(kvt_tier_promote(&e, t, w.tokens, w.n_tokens, &po), 0);
  kvt_entry_free(e);
  CHECK_EQ_INT(kvt_test_each_chunk(cache, NULL, NULL), 4);
  bu_residency r = {0};
  CHECK_EQ_INT(bu_evict_entry(t, cache, hash, &r), 0);
  CHECK_EQ_INT((int)r.files, 5); /* chain.kvr + 4 chunk files */
  CHECK(r.pages >= 5);
  CHECK(r.before > 0); /* the promote read them through the page cache */
  if (can_evict(cache))
    CHECK_EQ_INT((int)r.after, 0);
  else
    kvt_test_skip("env", "tmpfs: eviction not observable");
  CHECK(bu_resident_after(&r) <= (can_evict(cache) ? 0.0 : 1.0));
  /* An unknown entry: its directory is missing. */
  bu_residency z = {0};
  char other[KVT_HASH_HEX_LEN + 1];
  memset(other, 'a', KVT_HASH_HEX_LEN);
  other[KVT_HASH_HEX_LEN] = 0;
  CHECK_EQ_INT(bu_evict_entry(t, cache, other, &z), KVT_EIO);
  CHECK_EQ_INT((int)z.files, 0);
  bu_workload_free(&w);
  kvt_tier_close(t, -1);
  kvt_tier_free(t);
}

int main(void) {
  char *dir = kvt_test_tmpdir("benchutil");
  test_flags();
  test_evict_file(dir);
  test_evict_entry(dir);
  return kvt_test_done();
}
