/*
 * crashsim_index.c - the crash simulator's model of the SQLite index (see
 * crashsim_index.h): copies of index.db and its WAL taken at each WAL fsync
 * under <g_base>.snap/<k>, and the one a crash point finds put back.
 */
#include "crashsim_index.h"
#include "crashsim.h"
#include "fmt_testlib.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define MAX_SNAP 256
static size_t g_snap_at[MAX_SNAP];
static int g_nsnap;

static int skip_index(const char *path) {
  return strstr(path, "/index.db") != NULL;
}

static void snap_dir(char *out, size_t cap, int k) {
  snprintf(out, cap, "%s.snap/%d", g_base, k);
}

static void copy_file(const char *from, const char *to) {
  size_t n = 0;
  char *b = kvt_test_read_file(from, &n);
  unlink(to);
  if (b) {
    t_write_all(to, b, n);
    free(b);
  }
}

static void copy_index(const char *from_dir, const char *to_dir) {
  static const char *const f[] = {"index.db", "index.db-wal"};
  char a[4200], b[4200];
  for (int i = 0; i < 2; i++) {
    snprintf(a, sizeof a, "%s/%s", from_dir, f[i]);
    snprintf(b, sizeof b, "%s/%s", to_dir, f[i]);
    struct stat st;
    if (stat(a, &st) == 0)
      copy_file(a, b);
    else
      unlink(b);
  }
  snprintf(b, sizeof b, "%s/index.db-shm", to_dir);
  unlink(b); /* rebuilt from the WAL */
}

static void on_fsync(const char *path, size_t op) {
  if (!strstr(path, "index.db-wal") || g_nsnap == MAX_SNAP)
    return;
  char d[4200], parent[4200];
  snap_dir(d, sizeof d, g_nsnap);
  kvt_test_rmtree(d);
  snprintf(parent, sizeof parent, "%s.snap", g_base);
  mkdir(parent, 0700);
  REQUIRE(mkdir(d, 0700) == 0);
  copy_index(g_live, d);
  g_snap_at[g_nsnap++] = op;
}

void cs_index_install(void) {
  g_nsnap = 0;
  g_cs_skip = skip_index;
  g_cs_on_fsync = on_fsync;
}

void cs_index_restore(size_t K) {
  int k = -1;
  for (int i = 0; i < g_nsnap; i++)
    if (g_snap_at[i] <= K)
      k = i;
  char d[4200];
  if (k < 0)
    snprintf(d, sizeof d, "%s", g_base);
  else
    snap_dir(d, sizeof d, k);
  copy_index(d, g_replay);
}
