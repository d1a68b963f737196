/*
 * test_full_disk_tier.c - a full disk never wedges the tier (issue 18, item
 * 6). On a small tmpfs filled to the last byte, removing an entry, evicting
 * and gc must still work (deleting files is how the cache frees itself, and
 * the index commit that goes with it may need space it does not have), and
 * once space is back spills succeed again without any intervention. After a
 * reopen nothing removed comes back and every remaining entry verifies.
 * Needs a mount of its own: as root, or in a new user+mount namespace; exits
 * 77 where neither is allowed (a container without CAP_SYS_ADMIN).
 */
#define _GNU_SOURCE
#include "rel_tier.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/stat.h>

static char g_mnt[4096];
static int g_mounted;

static int write_str(const char *path, const char *s) {
  int fd = open(path, O_WRONLY);
  if (fd < 0)
    return -1;
  ssize_t n = write(fd, s, strlen(s));
  close(fd);
  return n == (ssize_t)strlen(s) ? 0 : -1;
}

/* Mounts a tmpfs of size bytes at g_mnt: directly (root), else in a new user
 * and mount namespace. 0 or -1. */
static int mount_small(size_t size) {
  char opt[64];
  snprintf(opt, sizeof opt, "size=%zu,mode=0700", size);
  if (mount("tmpfs", g_mnt, "tmpfs", 0, opt) == 0)
    return 0;
  uid_t uid = geteuid();
  gid_t gid = getegid();
  if (unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0)
    return -1;
  char m[64];
  write_str("/proc/self/setgroups", "deny");
  snprintf(m, sizeof m, "0 %u 1", (unsigned)uid);
  if (write_str("/proc/self/uid_map", m) != 0)
    return -1;
  snprintf(m, sizeof m, "0 %u 1", (unsigned)gid);
  if (write_str("/proc/self/gid_map", m) != 0)
    return -1;
  return mount("tmpfs", g_mnt, "tmpfs", 0, opt);
}

/* Fills the file system with filler until a write fails with ENOSPC. */
static void fill(const char *filler) {
  int fd = open(filler, O_WRONLY | O_CREAT | O_APPEND, 0600);
  REQUIRE(fd >= 0);
  static char buf[4096];
  size_t chunk = sizeof buf;
  for (;;) {
    ssize_t n = write(fd, buf, chunk);
    if (n < 0) {
      REQUIRE(errno == ENOSPC);
      if (chunk == 1)
        break;
      chunk /= 2;
    }
  }
  close(fd);
}

static void test_full_disk(void) {
  char *dir = rel_path(g_mnt, "cache", NULL);
  char *filler = rel_path(g_mnt, "filler", NULL);
  kvt_options o = rel_opts(dir, KVT_DURABILITY_NONE);
  /* A full disk's eviction and rewrite of every spill: not admission's. */
  o.admission_policy = KVT_ADMIT_WRITE_ALL;
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  enum { N = 12 };
  t_entry e[N];
  for (int i = 0; i < N; i++) {
    e[i] = t_make(300 + (uint64_t)i, 64, 4, 64, 64); /* ~256 KiB each */
    REQUIRE(t_spill(t, &e[i]) == 0);
  }
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  fill(filler);
  /* Not a byte left. */
  int probe = open(filler, O_WRONLY | O_APPEND);
  CHECK(probe >= 0 && write(probe, "x", 1) < 0 && errno == ENOSPC);
  close(probe);

  kvt_stats s = KVT_STATS_INIT;
  kvt_tier_stats(&s, t);
  uint64_t stored = s.entries;
  CHECK(stored >= 4);
  /* Find stored entries (the first spills fitted). */
  int have[N] = {0}, first = -1;
  for (int i = 0; i < N; i++) {
    kvt_entry_info info;
    have[i] = kvt_tier_lookup(&info, t, e[i].tokens, e[i].n_tokens) == 0;
    if (have[i] && first < 0)
      first = i;
  }
  REQUIRE(first >= 0);
  /* Removal with zero free bytes. */
  int rc = kvt_tier_remove(t, e[first].tokens, e[first].n_tokens);
  if (rc != 0)
    fprintf(stderr, "  remove on a full disk: %d (%s)\n", rc, kvt_last_error());
  CHECK_EQ_INT(rc, 0);
  kvt_entry_info info;
  CHECK_EQ_INT(kvt_tier_lookup(&info, t, e[first].tokens, e[first].n_tokens),
               KVT_ENOTFOUND);
  have[first] = 0;
  /* Refill (the removal freed space), then gc and eviction at zero bytes. */
  fill(filler);
  kvt_gc_opts g = KVT_GC_OPTS_INIT;
  g.max_entries = (int64_t)stored - 3;
  uint64_t removed = 0;
  rc = kvt_tier_gc(t, &g, &removed, NULL);
  if (rc != 0)
    fprintf(stderr, "  gc on a full disk: %d (%s)\n", rc, kvt_last_error());
  CHECK_EQ_INT(rc, 0);
  CHECK_EQ_INT(removed, 2);
  kvt_stats_init(&s, KVT_STATS_VERSION);
  kvt_tier_stats(&s, t);
  CHECK_EQ_INT(s.entries, stored - 3);
  /* Space back: the tier recovers by itself - a spill succeeds. */
  REQUIRE(unlink(filler) == 0);
  t_entry z = t_make(399, 64, 4, 64, 64);
  CHECK_EQ_INT(t_spill(t, &z), 0);
  CHECK_EQ_INT(kvt_tier_flush(t, -1), 0);
  kvt_entry *got = NULL;
  CHECK_EQ_INT(kvt_tier_promote(&got, t, z.tokens, z.n_tokens, NULL), 0);
  CHECK(got && t_same(got, &z));
  kvt_entry_free(got);
  kvt_stats_init(&s, KVT_STATS_VERSION);
  kvt_tier_stats(&s, t);
  uint64_t left = s.entries;
  CHECK_EQ_INT(kvt_tier_close(t, -1), 0);
  kvt_tier_free(t);
  /* Reopen: what was removed stays removed, the rest verifies. */
  CHECK_EQ_INT(rel_check_dir(dir, NULL), (int)left);
  t = t_open(&o);
  CHECK_EQ_INT(kvt_tier_lookup(&info, t, e[first].tokens, e[first].n_tokens),
               KVT_ENOTFOUND);
  kvt_tier_close(t, -1);
  kvt_tier_free(t);
  t_free(&z);
  for (int i = 0; i < N; i++)
    t_free(&e[i]);
  free(dir);
  free(filler);
}

static void cleanup(void) {
  if (g_mounted)
    umount2(g_mnt, MNT_DETACH);
  rmdir(g_mnt);
}

int main(void) {
  char *root = kvt_test_tmpdir("fulldisk");
  snprintf(g_mnt, sizeof g_mnt, "%s/mnt", root);
  REQUIRE(mkdir(g_mnt, 0700) == 0);
  if (mount_small((size_t)6 << 20) != 0) {
    fprintf(stderr, "skip: cannot mount a tmpfs here (%s)\n", strerror(errno));
    rmdir(g_mnt);
    return 77;
  }
  g_mounted = 1;
  atexit(cleanup);
  RUN(test_full_disk);
  cleanup();
  g_mounted = 0;
  return kvt_test_done();
}
