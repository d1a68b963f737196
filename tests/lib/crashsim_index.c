/*
 * crashsim_index.c - the crash simulator's model of the SQLite index (see
 * crashsim_index.h): copies of index.db and its WAL taken at each WAL fsync
 * and at the end of each commit written to the WAL under <g_base>.snap/<k>,
 * and the one a crash point finds put back. A commit ends with the page of
 * its commit frame: SQLite writes each WAL frame as its 24-byte header (bytes
 * 4-7 hold the database size in pages for a commit frame, 0 otherwise), then
 * the page.
 */
#include "crashsim_index.h"
#include "crashsim.h"
#include "fmt_testlib.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define MAX_SNAP 2048
#define WAL_HDR 32   /* the WAL file's header */
#define FRAME_HDR 24 /* each frame's header */
static size_t g_snap_at[MAX_SNAP];
static int g_snap_synced[MAX_SNAP]; /* 1: at a fsync, 0: a commit's end */
static int g_nsnap;
static int g_commit_next; /* the next WAL write is a commit frame's page */
static size_t g_ncommits, g_nsyncs;
static size_t g_pending;  /* commits since the last WAL fsync */
static size_t g_unsynced; /* commits another one followed before a fsync */

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

static void snapshot(size_t op, int synced) {
  if (g_nsnap == MAX_SNAP)
    return;
  char d[4200], parent[4200];
  snap_dir(d, sizeof d, g_nsnap);
  kvt_test_rmtree(d);
  snprintf(parent, sizeof parent, "%s.snap", g_base);
  mkdir(parent, 0700);
  REQUIRE(mkdir(d, 0700) == 0);
  copy_index(g_live, d);
  g_snap_synced[g_nsnap] = synced;
  g_snap_at[g_nsnap++] = op;
}

static void on_fsync(const char *path, size_t op) {
  if (!strstr(path, "index.db-wal"))
    return;
  g_nsyncs++;
  g_pending = 0;
  snapshot(op, 1);
}

static void on_write(const char *path, uint64_t off, const void *data, size_t n,
                     size_t op) {
  if (!strstr(path, "index.db-wal"))
    return;
  const unsigned char *b = data;
  if (g_commit_next) { /* the commit frame's page: the commit is written */
    g_commit_next = 0;
    g_ncommits++;
    g_unsynced += g_pending;
    g_pending = 1;
    snapshot(op, 0);
    return;
  }
  if (off >= WAL_HDR && n == FRAME_HDR)
    g_commit_next = (b[4] | b[5] | b[6] | b[7]) != 0;
}

void cs_index_counts(size_t *commits, size_t *syncs) {
  *commits = g_ncommits;
  *syncs = g_nsyncs;
}

size_t cs_index_unsynced(void) {
  return g_unsynced;
}

void cs_index_install(void) {
  g_nsnap = 0;
  g_commit_next = 0;
  g_ncommits = g_nsyncs = 0;
  g_pending = g_unsynced = 0;
  g_cs_skip = skip_index;
  g_cs_on_fsync = on_fsync;
  g_cs_on_write = on_write;
}

void cs_index_restore(size_t K, kvt_rng *rng) {
  int k = -1, last = -1; /* the last synced copy, the last copy, before K */
  for (int i = 0; i < g_nsnap; i++)
    if (g_snap_at[i] <= K) {
      last = i;
      if (g_snap_synced[i])
        k = i;
    }
  if (rng && last > k) {
    /* The commits after the sync: none, some first ones, or all of them. */
    int unsynced = 0;
    for (int i = k + 1; i <= last; i++)
      unsynced += !g_snap_synced[i];
    int keep = (int)(kvt_rng_next(rng) % (uint64_t)(unsynced + 1));
    for (int i = k + 1; i <= last && keep > 0; i++)
      if (!g_snap_synced[i]) {
        k = i;
        keep--;
      }
  }
  char d[4200];
  if (k < 0)
    snprintf(d, sizeof d, "%s", g_base);
  else
    snap_dir(d, sizeof d, k);
  copy_index(d, g_replay);
}
