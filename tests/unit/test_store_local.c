/*
 * test_store_local.c - the storage seam below the tier: the local backend
 * alone owns the cache directory's layout (open creates and checks cache_dir
 * and data/, takes kvtier.lock - a second writer gets KVT_EBUSY until unlock,
 * readers take none -, makes index.db with file_mode and leaves an existing
 * one alone, measures data/<hash>, hands out the staging root - remote.tmp/
 * for a writer, a private directory under $TMPDIR for a reader, both removed
 * at destroy - and adopts a staged entry into data/ by rename, refusing to
 * replace a stored one); and the remote constructor table checks URLs by
 * scheme and either builds a backend that offers find/stat/stage/fetch or, in
 * a build without that store (hiredis missing), refuses with KVT_EUNSUPPORTED
 * and a message saying how to get it, which kvt_tier_open passes on. Tree
 * removal never enters a directory swapped for a link. The chunk files' names
 * come from the layout alone: chunks/<kk> from the key's first byte, the
 * file name and its temporary, the path under chunks/, and a name read back
 * as its key (anything else refused).
 */
#include "base/error.h"
#include "base/io.h"
#include "store/backend.h"
#include "store/local.h"
#include "store/local_layout.h"
#include "testutil.h"

#include "kvtier.h"

#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *HASH =
    "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

static kvti_local_cfg cfg_of(const char *dir, int readonly) {
  kvti_local_cfg c = {dir, 0700, 0600, readonly, 0};
  return c;
}

static void write_file(const char *path, size_t n) {
  FILE *f = fopen(path, "wb");
  REQUIRE(f != NULL);
  for (size_t i = 0; i < n; i++)
    fputc((int)(i & 0xff), f);
  fclose(f);
}

static mode_t mode_of(const char *path) {
  struct stat st;
  return lstat(path, &st) == 0 ? (st.st_mode & 07777) : (mode_t)-1;
}

static void test_open_and_lock(void) {
  char *base = kvt_test_tmpdir("stl");
  char dir[4200], p[4300];
  snprintf(dir, sizeof dir, "%s/a/b", base);
  kvti_backend *ro = NULL, *w = NULL, *w2 = NULL;
  kvti_local_cfg rc_ = cfg_of(dir, 1);
  /* A reader creates nothing. */
  CHECK(kvti_backend_local_open(&ro, &rc_) < 0);
  CHECK(!kvt_test_exists(dir));
  kvti_local_cfg wc = cfg_of(dir, 0);
  REQUIRE(kvti_backend_local_open(&w, &wc) == 0);
  CHECK_EQ_INT(mode_of(dir), 0700);
  snprintf(p, sizeof p, "%s/data", dir);
  CHECK_EQ_INT(mode_of(p), 0700);
  snprintf(p, sizeof p, "%s/kvtier.lock", dir);
  CHECK(kvt_test_exists(p));
  CHECK_EQ_INT(kvti_backend_local_open(&w2, &wc), KVT_EBUSY);
  CHECK(strstr(kvt_last_error(), "kvtier.lock") != NULL);
  CHECK_EQ_INT(kvti_backend_local_open(&ro, &rc_), 0);
  kvti_backend_local_unlock(w);
  CHECK_EQ_INT(kvti_backend_local_open(&w2, &wc), 0);
  if (w2)
    w2->ops->destroy(w2);
  if (ro)
    ro->ops->destroy(ro);
  w->ops->destroy(w);
  /* A symlinked cache directory is refused. */
  char link[4200];
  snprintf(link, sizeof link, "%s/link", base);
  CHECK_EQ_INT(symlink(dir, link), 0);
  kvti_local_cfg lc = cfg_of(link, 0);
  CHECK_EQ_INT(kvti_backend_local_open(&w, &lc), KVT_EPERM);
}

static void test_prepare_index(void) {
  char *dir = kvt_test_tmpdir("sti");
  char p[4300];
  kvti_backend *b = NULL;
  kvti_local_cfg c = cfg_of(dir, 0);
  c.file_mode = 0640;
  REQUIRE(kvti_backend_local_open(&b, &c) == 0);
  snprintf(p, sizeof p, "%s/index.db", dir);
  CHECK_EQ_INT(kvti_backend_local_prepare_index(b), 0);
  CHECK_EQ_INT(mode_of(p), 0640);
  write_file(p, 10);
  chmod(p, 0600);
  CHECK_EQ_INT(kvti_backend_local_prepare_index(b), 0);
  size_t len = 0;
  char *txt = kvt_test_read_file(p, &len);
  CHECK_EQ_INT(len, 10);
  CHECK_EQ_INT(mode_of(p), 0600);
  free(txt);
  b->ops->destroy(b);
}

static void test_stage_adopt_measure(void) {
  char *dir = kvt_test_tmpdir("sta");
  char p[4300], q[4400];
  kvti_backend *b = NULL;
  kvti_local_cfg c = cfg_of(dir, 0);
  REQUIRE(kvti_backend_local_open(&b, &c) == 0);
  uint64_t bytes = 7;
  CHECK_EQ_INT(kvti_backend_local_measure(b, HASH, &bytes), 0);
  const char *root = NULL;
  REQUIRE(kvti_backend_local_stage_root(b, &root) == 0);
  snprintf(p, sizeof p, "%s/remote.tmp", dir);
  CHECK_EQ_INT(strcmp(root, p), 0);
  const char *again = NULL;
  CHECK_EQ_INT(kvti_backend_local_stage_root(b, &again), 0);
  CHECK(again == root);
  /* A staged entry: root/<hash>/f. */
  snprintf(p, sizeof p, "%s/%s", root, HASH);
  REQUIRE(mkdir(p, 0700) == 0);
  snprintf(q, sizeof q, "%s/f", p);
  write_file(q, 1000);
  CHECK_EQ_INT(kvti_backend_local_adopt(b, root, HASH), 0);
  CHECK(!kvt_test_exists(p));
  snprintf(q, sizeof q, "%s/data/%s/f", dir, HASH);
  CHECK(kvt_test_exists(q));
  CHECK_EQ_INT(b->ops->present(b, HASH), 1);
  CHECK_EQ_INT(kvti_backend_local_measure(b, HASH, &bytes), 1);
  CHECK_EQ_INT(bytes, 1000);
  /* A stored entry is never replaced by an adopt. */
  REQUIRE(mkdir(p, 0700) == 0);
  snprintf(q, sizeof q, "%s/g", p);
  write_file(q, 5);
  CHECK(kvti_backend_local_adopt(b, root, HASH) < 0);
  CHECK_EQ_INT(kvti_backend_local_measure(b, HASH, &bytes), 1);
  CHECK_EQ_INT(bytes, 1000);
  CHECK_EQ_INT(kvti_backend_local_adopt(b, root, "../x"), KVT_EINVAL);
  char keep[4300];
  snprintf(keep, sizeof keep, "%s", root);
  b->ops->destroy(b);
  CHECK(!kvt_test_exists(keep)); /* the staging root goes with the backend */
  snprintf(q, sizeof q, "%s/data/%s/f", dir, HASH);
  CHECK(kvt_test_exists(q));
}

static void test_reader_stage_root(void) {
  char *dir = kvt_test_tmpdir("str");
  char *tmp = kvt_test_tmpdir("strt");
  char p[4300];
  snprintf(p, sizeof p, "%s/data", dir);
  REQUIRE(mkdir(p, 0700) == 0);
  const char *old = getenv("TMPDIR");
  char *saved = old ? strdup(old) : NULL;
  setenv("TMPDIR", tmp, 1);
  kvti_backend *b = NULL;
  kvti_local_cfg c = cfg_of(dir, 1);
  REQUIRE(kvti_backend_local_open(&b, &c) == 0);
  const char *root = NULL;
  CHECK_EQ_INT(kvti_backend_local_stage_root(b, &root), 0);
  CHECK(root && strncmp(root, tmp, strlen(tmp)) == 0);
  CHECK_EQ_INT(kvt_test_count_dir(tmp, NULL), 1);
  CHECK_EQ_INT(kvt_test_count_dir(dir, NULL), 1); /* data/ only */
  b->ops->destroy(b);
  CHECK_EQ_INT(kvt_test_count_dir(tmp, NULL), 0);
  if (saved) {
    setenv("TMPDIR", saved, 1);
    free(saved);
  } else {
    unsetenv("TMPDIR");
  }
}

static void test_remote_table(void) {
  CHECK_EQ_INT(kvti_backend_remote_check_url("redis://127.0.0.1:6379"), 0);
  CHECK_EQ_INT(kvti_backend_remote_check_url("memcache://127.0.0.1:1"),
               KVT_EINVAL);
  CHECK(strstr(kvt_last_error(), "redis://") != NULL);
  CHECK_EQ_INT(kvti_backend_remote_check_url("redis://"), KVT_EINVAL);
  char *dir = kvt_test_tmpdir("stm");
  kvti_remote_cfg rc = {
      "memcache://127.0.0.1:1", NULL, 100, 1 << 20, 0, dir, 0600, 0700};
  kvti_backend *b = (kvti_backend *)&rc; /* must be reset */
  CHECK_EQ_INT(kvti_backend_remote_new(&b, &rc), KVT_EINVAL);
  CHECK(b == NULL);
  rc.url = "redis://127.0.0.1:1";
  int r = kvti_backend_remote_new(&b, &rc);
  if (r == 0) {
    /* Built with hiredis: no connection is made, and the remote path's
     * operations are all there. */
    REQUIRE(b != NULL);
    CHECK_EQ_INT(strcmp(b->ops->name, "redis"), 0);
    CHECK(b->remote && b->remote->find && b->remote->stat && b->remote->stage &&
          b->remote->fetch);
    CHECK(!kvti_backend_is_local(b));
    b->ops->destroy(b);
  } else {
    /* The null remote. */
    CHECK_EQ_INT(r, KVT_EUNSUPPORTED);
    CHECK(b == NULL);
    CHECK(strstr(kvt_last_error(), "no Redis support") != NULL);
    CHECK(strstr(kvt_last_error(), "hiredis") != NULL);
  }
  /* The tier passes the table's answer on and leaves nothing behind. */
  char cache[4300];
  snprintf(cache, sizeof cache, "%s/cache", dir);
  kvt_options o = KVT_OPTIONS_INIT;
  o.cache_dir = cache;
  o.remote_url = "redis://127.0.0.1:1";
  o.remote_mode = KVT_REMOTE_ONLY;
  kvt_tier *t = NULL;
  CHECK_EQ_INT(kvt_tier_open(&t, &o), r);
  if (r != 0) {
    CHECK(t == NULL);
    CHECK(strstr(kvt_last_error(), "no Redis support") != NULL);
    char st[4400];
    snprintf(st, sizeof st, "%s/remote.tmp", cache);
    CHECK(!kvt_test_exists(st));
  }
  kvt_tier_free(t);
}

/* kvti_rmtree never enters a directory by a name that became a link: the
 * tree's root is swapped for a link to a directory outside right after
 * removal has looked at it (inside its stat). Before, the removal then
 * listed and unlinked the outside directory's files through the link; now
 * the link alone goes. */
static char g_rm_root[4096], g_rm_aside[4200], g_rm_out[4096];
static int g_rm_armed;
static void rm_swap(const char *p) {
  size_t n = strlen(p), m = strlen("/victim");
  if (g_rm_armed &&
      ((n >= m && !strcmp(p + n - m, "/victim")) || !strcmp(p, "victim"))) {
    g_rm_armed = 0;
    REQUIRE(rename(g_rm_root, g_rm_aside) == 0 &&
            symlink(g_rm_out, g_rm_root) == 0);
  }
}
static int rm_lstat(const char *p, struct stat *st) {
  int r = kvti_io_default.lstat(p, st);
  rm_swap(p);
  return r;
}
static int rm_fstatat(int d, const char *p, struct stat *st, int fl) {
  int r = kvti_io_default.fstatat(d, p, st, fl);
  rm_swap(p);
  return r;
}

static void test_rmtree_never_follows_a_swap(void) {
  char *dir = kvt_test_tmpdir("rmtree-swap");
  snprintf(g_rm_root, sizeof g_rm_root, "%s/victim", dir);
  snprintf(g_rm_aside, sizeof g_rm_aside, "%s/victim.aside", dir);
  snprintf(g_rm_out, sizeof g_rm_out, "%s/outside", dir);
  char p[4400];
  REQUIRE(mkdir(g_rm_root, 0700) == 0 && mkdir(g_rm_out, 0700) == 0);
  snprintf(p, sizeof p, "%s/a", g_rm_root);
  write_file(p, 10);
  snprintf(p, sizeof p, "%s/keep1", g_rm_out);
  write_file(p, 10);
  snprintf(p, sizeof p, "%s/keep2", g_rm_out);
  write_file(p, 10);
  kvti_io_ops ops = kvti_io_default;
  ops.lstat = rm_lstat;
  ops.fstatat = rm_fstatat;
  g_rm_armed = 1;
  const kvti_io_ops *prev = kvti_io_set(&ops);
  int rc = kvti_rmtree(g_rm_root);
  kvti_io_set(prev);
  CHECK(!g_rm_armed);
  CHECK_EQ_INT(rc, 0);
  CHECK_EQ_INT(kvt_test_count_dir(g_rm_out, NULL), 2);
  struct stat st;
  CHECK(lstat(g_rm_root, &st) != 0); /* the link itself is gone */
  /* An ordinary tree goes entirely. */
  snprintf(p, sizeof p, "%s/sub", g_rm_aside);
  REQUIRE(mkdir(p, 0700) == 0);
  snprintf(p, sizeof p, "%s/sub/b", g_rm_aside);
  write_file(p, 3);
  CHECK_EQ_INT(kvti_rmtree(g_rm_aside), 0);
  CHECK(lstat(g_rm_aside, &st) != 0);
  CHECK_EQ_INT(kvti_rmtree(g_rm_aside), 0); /* missing: success */
}

static void test_chunk_names(void) {
  uint8_t key[32], back[32];
  for (int i = 0; i < 32; i++)
    key[i] = (uint8_t)(0xa7 + 3 * i);
  char hex[65], want[200], out[200];
  for (int i = 0; i < 32; i++)
    snprintf(hex + 2 * i, 3, "%02x", key[i]);
  CHECK_EQ_INT(kvti_local_chunk_dir_rel(out, sizeof out, 0x0b), 0);
  CHECK(strcmp(out, "chunks/0b") == 0);
  CHECK_EQ_INT(kvti_local_chunk_dir_rel(out, sizeof out, 256), 0);
  CHECK(strcmp(out, "chunks") == 0);
  CHECK_EQ_INT(kvti_local_chunk_dir_rel(out, 5, 0x0b), KVT_EINVAL);
  CHECK(out[0] == '\0'); /* nothing truncated is left to use */

  char name[KVTI_LOCAL_CHUNK_NAME_MAX];
  kvti_local_chunk_name(name, key, 0);
  snprintf(want, sizeof want, "%s.kvc", hex);
  CHECK(strcmp(name, want) == 0);
  kvti_local_chunk_name(name, key, 1);
  snprintf(want, sizeof want, "%s.tmp", hex);
  CHECK(strcmp(name, want) == 0);

  CHECK_EQ_INT(kvti_local_chunk_rel(out, sizeof out, key), 0);
  snprintf(want, sizeof want, "chunks/a7/%s.kvc", hex);
  CHECK(strcmp(out, want) == 0);
  CHECK_EQ_INT(kvti_local_chunk_rel(out, 20, key), KVT_EINVAL);
  CHECK_EQ_INT(kvti_local_chunk_path(out, sizeof out, "/c/chunks", key), 0);
  snprintf(want, sizeof want, "/c/chunks/a7/%s.kvc", hex);
  CHECK(strcmp(out, want) == 0);
  CHECK_EQ_INT(kvti_local_chunk_path(out, 30, "/c/chunks", key), KVT_ERANGE);

  kvti_local_chunk_name(name, key, 0);
  CHECK_EQ_INT(kvti_local_chunk_key(back, name), 0);
  CHECK(memcmp(back, key, 32) == 0);
  kvti_local_chunk_name(name, key, 1);
  CHECK_EQ_INT(kvti_local_chunk_key(back, name), -1); /* a temporary */
  CHECK_EQ_INT(kvti_local_chunk_key(back, "sweep.pos"), -1);
  snprintf(want, sizeof want, "%.63s.kvc", hex); /* one digit short */
  CHECK_EQ_INT(kvti_local_chunk_key(back, want), -1);
  snprintf(want, sizeof want, "%.63sg.kvc", hex); /* not hex */
  CHECK_EQ_INT(kvti_local_chunk_key(back, want), -1);
}

int main(void) {
  RUN(test_open_and_lock);
  RUN(test_prepare_index);
  RUN(test_stage_adopt_measure);
  RUN(test_reader_stage_root);
  RUN(test_remote_table);
  RUN(test_rmtree_never_follows_a_swap);
  RUN(test_chunk_names);
  return kvt_test_done();
}
