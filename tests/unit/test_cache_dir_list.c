/*
 * test_cache_dir_list.c - the tools' view of a cache directory's names,
 * public API only: kvt_cache_dir_list reports every name in data/ once with
 * its kind (an entry's name of any file type, a *.tmp, anything else a
 * stray), honours its kinds mask and stops at the callback's value; it tells
 * a missing data/ (KVT_ENOTFOUND) from a linked or non-directory one
 * (KVT_EPERM). kvt_cache_name_stat looks a data/ name or a chunks/ path up
 * without following a link, refuses names that would leave their area, and
 * zeroes *out past its version on failure. kvt_cache_chunk_name gives the
 * chunks/<kk>/<key>.kvc path and refuses what is not a key.
 */
#include "testutil.h"

#include "kvtier.h"
#include "kvtier_sys.h"

#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>

static void touch(const char *path) {
  FILE *f = fopen(path, "wb");
  REQUIRE(f != NULL);
  fclose(f);
}

#define HEX64 "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
#define HEX64_UPPER                                                            \
  "0123456789ABCDEF0123456789abcdef0123456789abcdef0123456789abcdef"

typedef struct listed {
  int n, entry, tmp, stray, stop_at;
  int saw_dir_entry, saw_file_entry, saw_tmp, saw_dot_tmp, saw_upper;
} listed;

static int on_name(void *ctx, const char *name, int kind) {
  listed *l = ctx;
  l->n++;
  l->entry += kind == KVT_CACHE_NAME_ENTRY;
  l->tmp += kind == KVT_CACHE_NAME_TMP;
  l->stray += kind == KVT_CACHE_NAME_STRAY;
  if (!strcmp(name, HEX64))
    l->saw_dir_entry = kind == KVT_CACHE_NAME_ENTRY;
  if (!strcmp(name, "ffffffffffffffffffffffffffffffffffffffffffffffffffffffffff"
                    "ffffff"))
    l->saw_file_entry = kind == KVT_CACHE_NAME_ENTRY;
  if (!strcmp(name, HEX64 ".rm.tmp"))
    l->saw_tmp = kind == KVT_CACHE_NAME_TMP;
  if (!strcmp(name, ".tmp"))
    l->saw_dot_tmp = kind == KVT_CACHE_NAME_STRAY;
  if (!strcmp(name, HEX64_UPPER))
    l->saw_upper = kind == KVT_CACHE_NAME_STRAY;
  return l->stop_at && l->n == l->stop_at ? 42 : 0;
}

/* base/cache with data/ holding two entry names (a directory and a file), a
 * *.tmp, and three strays (".tmp" alone, upper-case hex, notes.txt). */
static void make_cache(char *dir, size_t n, const char *base) {
  char p[4400];
  snprintf(dir, n, "%s/cache", base);
  REQUIRE(mkdir(dir, 0700) == 0);
  snprintf(p, sizeof p, "%s/data", dir);
  REQUIRE(mkdir(p, 0700) == 0);
  snprintf(p, sizeof p, "%s/data/%s", dir, HEX64);
  REQUIRE(mkdir(p, 0700) == 0);
  snprintf(p, sizeof p, "%s/data/%s", dir,
           "ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff");
  touch(p);
  snprintf(p, sizeof p, "%s/data/%s.rm.tmp", dir, HEX64);
  REQUIRE(mkdir(p, 0700) == 0);
  snprintf(p, sizeof p, "%s/data/.tmp", dir);
  touch(p);
  snprintf(p, sizeof p, "%s/data/%s", dir, HEX64_UPPER);
  REQUIRE(mkdir(p, 0700) == 0);
  snprintf(p, sizeof p, "%s/data/notes.txt", dir);
  touch(p);
}

static void test_list(void) {
  char *base = kvt_test_tmpdir("dirlist");
  char dir[4200], p[4400];
  make_cache(dir, sizeof dir, base);
  listed l = {0};
  REQUIRE(kvt_cache_dir_list(dir, 0, on_name, &l) == 0);
  CHECK_EQ_INT(l.n, 6);
  CHECK(l.entry == 2 && l.tmp == 1 && l.stray == 3);
  CHECK(l.saw_dir_entry && l.saw_file_entry && l.saw_tmp && l.saw_dot_tmp &&
        l.saw_upper);

  memset(&l, 0, sizeof l); /* the mask */
  REQUIRE(kvt_cache_dir_list(dir, KVT_CACHE_NAME_TMP | KVT_CACHE_NAME_STRAY,
                             on_name, &l) == 0);
  CHECK(l.n == 4 && l.entry == 0 && l.tmp == 1 && l.stray == 3);

  memset(&l, 0, sizeof l); /* the callback stops the walk */
  l.stop_at = 2;
  CHECK_EQ_INT(kvt_cache_dir_list(dir, 0, on_name, &l), 42);
  CHECK_EQ_INT(l.n, 2);

  CHECK_EQ_INT(kvt_cache_dir_list(NULL, 0, on_name, &l), KVT_EINVAL);
  CHECK_EQ_INT(kvt_cache_dir_list("", 0, on_name, &l), KVT_EINVAL);
  CHECK_EQ_INT(kvt_cache_dir_list(dir, 0, NULL, &l), KVT_EINVAL);
  snprintf(p, sizeof p, "%s/missing", base);
  CHECK_EQ_INT(kvt_cache_dir_list(p, 0, on_name, &l), KVT_ENOTFOUND);

  /* No data/, data/ a file, data/ a link to a real directory. */
  char other[4300];
  snprintf(other, sizeof other, "%s/other", base);
  REQUIRE(mkdir(other, 0700) == 0);
  CHECK_EQ_INT(kvt_cache_dir_list(other, 0, on_name, &l), KVT_ENOTFOUND);
  snprintf(p, sizeof p, "%s/data", other);
  touch(p);
  CHECK_EQ_INT(kvt_cache_dir_list(other, 0, on_name, &l), KVT_EPERM);
  unlink(p);
  char target[4400];
  snprintf(target, sizeof target, "%s/data", dir);
  REQUIRE(symlink(target, p) == 0);
  memset(&l, 0, sizeof l);
  CHECK_EQ_INT(kvt_cache_dir_list(other, 0, on_name, &l), KVT_EPERM);
  CHECK_EQ_INT(l.n, 0);
}

static void test_stat(void) {
  char *base = kvt_test_tmpdir("dirlist");
  char dir[4200], p[4400];
  make_cache(dir, sizeof dir, base);
  kvt_cache_name_stat_info st = KVT_CACHE_NAME_STAT_INIT;

  /* A data/ name: its type and its modification time. */
  snprintf(p, sizeof p, "%s/data/notes.txt", dir);
  struct timeval tv[2] = {{1500000000, 0}, {1500000000, 250000}};
  REQUIRE(utimes(p, tv) == 0);
  REQUIRE(kvt_cache_name_stat(&st, dir, KVT_CACHE_AREA_DATA, "notes.txt") == 0);
  CHECK(!st.is_dir && st.mtime > 1500000000.2 && st.mtime < 1500000000.3);
  CHECK(st.version == KVT_CACHE_NAME_STAT_VERSION);
  REQUIRE(kvt_cache_name_stat(&st, dir, KVT_CACHE_AREA_DATA, HEX64) == 0);
  CHECK(st.is_dir);

  /* Missing: KVT_ENOTFOUND, *out zeroed past its version. */
  CHECK_EQ_INT(kvt_cache_name_stat(&st, dir, KVT_CACHE_AREA_DATA, "gone"),
               KVT_ENOTFOUND);
  CHECK(st.version == KVT_CACHE_NAME_STAT_VERSION && !st.is_dir &&
        st.mtime == 0);

  /* A link is looked at, not followed: a link to a directory is no
   * directory. */
  snprintf(p, sizeof p, "%s/data/link", dir);
  REQUIRE(symlink(dir, p) == 0);
  REQUIRE(kvt_cache_name_stat(&st, dir, KVT_CACHE_AREA_DATA, "link") == 0);
  CHECK(!st.is_dir);

  /* Names that would leave their area, and bad calls. */
  static const char *bad_data[] = {"..", ".", "a/b", "/notes.txt"};
  for (size_t i = 0; i < sizeof bad_data / sizeof *bad_data; i++)
    CHECK_EQ_INT(
        kvt_cache_name_stat(&st, dir, KVT_CACHE_AREA_DATA, bad_data[i]),
        KVT_EINVAL);
  static const char *bad_chunks[] = {
      "data/notes.txt", "chunks",         "chunks/",
      "chunks/../data", "chunks/ab/../x", "chunks//x",
      "chunks/ab/c/d",  "chunksab/x",     "chunks/ab/"};
  for (size_t i = 0; i < sizeof bad_chunks / sizeof *bad_chunks; i++)
    CHECK_EQ_INT(
        kvt_cache_name_stat(&st, dir, KVT_CACHE_AREA_CHUNKS, bad_chunks[i]),
        KVT_EINVAL);
  CHECK_EQ_INT(kvt_cache_name_stat(&st, dir, 7, "notes.txt"), KVT_EINVAL);
  CHECK_EQ_INT(kvt_cache_name_stat(NULL, dir, KVT_CACHE_AREA_DATA, "x"),
               KVT_EINVAL);
  CHECK_EQ_INT(kvt_cache_name_stat(&st, NULL, KVT_CACHE_AREA_DATA, "x"),
               KVT_EINVAL);
  CHECK_EQ_INT(kvt_cache_name_stat(&st, dir, KVT_CACHE_AREA_DATA, ""),
               KVT_EINVAL);
  kvt_cache_name_stat_info v = {.version = 9};
  CHECK_EQ_INT(kvt_cache_name_stat(&v, dir, KVT_CACHE_AREA_DATA, "notes.txt"),
               KVT_EINVAL);
  CHECK(strstr(kvt_last_error(), "version") != NULL);

  /* chunks/: a subdirectory, a file in it, a missing one, a link on the way
   * (refused, never followed). */
  snprintf(p, sizeof p, "%s/chunks", dir);
  REQUIRE(mkdir(p, 0700) == 0);
  CHECK_EQ_INT(
      kvt_cache_name_stat(&st, dir, KVT_CACHE_AREA_CHUNKS, "chunks/ab"),
      KVT_ENOTFOUND);
  snprintf(p, sizeof p, "%s/chunks/ab", dir);
  REQUIRE(mkdir(p, 0700) == 0);
  snprintf(p, sizeof p, "%s/chunks/ab/x.tmp", dir);
  touch(p);
  REQUIRE(kvt_cache_name_stat(&st, dir, KVT_CACHE_AREA_CHUNKS, "chunks/ab") ==
          0);
  CHECK(st.is_dir);
  REQUIRE(kvt_cache_name_stat(&st, dir, KVT_CACHE_AREA_CHUNKS,
                              "chunks/ab/x.tmp") == 0);
  CHECK(!st.is_dir);
  CHECK_EQ_INT(
      kvt_cache_name_stat(&st, dir, KVT_CACHE_AREA_CHUNKS, "chunks/cd/x.tmp"),
      KVT_ENOTFOUND);
  snprintf(p, sizeof p, "%s/chunks/cd", dir);
  char target[4400];
  snprintf(target, sizeof target, "%s/chunks/ab", dir);
  REQUIRE(symlink(target, p) == 0);
  CHECK_EQ_INT(
      kvt_cache_name_stat(&st, dir, KVT_CACHE_AREA_CHUNKS, "chunks/cd/x.tmp"),
      KVT_EPERM);
}

static void test_chunk_name(void) {
  char out[KVT_CACHE_CHUNK_NAME_MAX];
  REQUIRE(kvt_cache_chunk_name(out, sizeof out, HEX64) == 0);
  CHECK(strcmp(out, "chunks/01/" HEX64 ".kvc") == 0);
  CHECK_EQ_INT(kvt_cache_chunk_name(out, sizeof out, HEX64_UPPER), KVT_EINVAL);
  CHECK(out[0] == '\0');
  CHECK_EQ_INT(kvt_cache_chunk_name(out, sizeof out, "0123"), KVT_EINVAL);
  CHECK_EQ_INT(kvt_cache_chunk_name(out, sizeof out, NULL), KVT_EINVAL);
  CHECK_EQ_INT(kvt_cache_chunk_name(NULL, 10, HEX64), KVT_EINVAL);
  char small[20] = "x";
  CHECK_EQ_INT(kvt_cache_chunk_name(small, sizeof small, HEX64), KVT_EINVAL);
  CHECK(small[0] == '\0');
}

int main(void) {
  RUN(test_list);
  RUN(test_stat);
  RUN(test_chunk_name);
  return kvt_test_done();
}
