/*
 * test_crashsim_index_tier.c - the power-loss check for the index half of a
 * spill. The entry files go through kvtier's I/O seam (checked by
 * test_crashsim_entry.c); index.db goes through SQLite, so this test wraps
 * SQLite's default VFS with a shim that tracks, for the database file, its WAL
 * and journals, whether bytes were written since that file's last xSync. At the
 * moment the tier acknowledges a spill as written (spill_done_fn, status 0)
 * with durability FSYNC, nothing the acknowledgement depends on may be
 * unsynced: if the WAL frames holding the entry's row were still unsynced, a
 * power loss could roll the row back, and the next open's reconcile would
 * delete the entry's (durable) directory as an orphan - an acknowledged entry
 * lost. With durability NONE no such promise is made: the test only reports
 * what it sees.
 */
#include "rel_tier.h"

#include <sqlite3.h>

typedef struct shim_file {
  sqlite3_file base;
  sqlite3_file *real;
  int tracked;
  atomic_int dirty;
} shim_file;

static sqlite3_vfs *g_real;
static sqlite3_vfs g_shim;
static sqlite3_io_methods g_methods;
static atomic_int g_unsynced; /* tracked files with writes not yet synced */
static atomic_long g_syncs, g_writes;

#define REAL(f) (((shim_file *)(f))->real)

static int s_close(sqlite3_file *f) {
  int rc = REAL(f)->pMethods->xClose(REAL(f));
  return rc;
}
static int s_read(sqlite3_file *f, void *b, int n, sqlite3_int64 o) {
  return REAL(f)->pMethods->xRead(REAL(f), b, n, o);
}
static void mark_dirty(shim_file *sf) {
  if (sf->tracked) {
    atomic_fetch_add(&g_writes, 1);
    int was = atomic_exchange(&sf->dirty, 1);
    if (!was)
      atomic_fetch_add(&g_unsynced, 1);
  }
}
static int s_write(sqlite3_file *f, const void *b, int n, sqlite3_int64 o) {
  int rc = REAL(f)->pMethods->xWrite(REAL(f), b, n, o);
  mark_dirty((shim_file *)f);
  return rc;
}
static int s_truncate(sqlite3_file *f, sqlite3_int64 n) {
  int rc = REAL(f)->pMethods->xTruncate(REAL(f), n);
  mark_dirty((shim_file *)f);
  return rc;
}
static int s_sync(sqlite3_file *f, int flags) {
  shim_file *sf = (shim_file *)f;
  int rc = REAL(f)->pMethods->xSync(REAL(f), flags);
  if (rc == SQLITE_OK && sf->tracked) {
    atomic_fetch_add(&g_syncs, 1);
    if (atomic_exchange(&sf->dirty, 0))
      atomic_fetch_sub(&g_unsynced, 1);
  }
  return rc;
}
static int s_size(sqlite3_file *f, sqlite3_int64 *s) {
  return REAL(f)->pMethods->xFileSize(REAL(f), s);
}
static int s_lock(sqlite3_file *f, int l) {
  return REAL(f)->pMethods->xLock(REAL(f), l);
}
static int s_unlock(sqlite3_file *f, int l) {
  return REAL(f)->pMethods->xUnlock(REAL(f), l);
}
static int s_check(sqlite3_file *f, int *o) {
  return REAL(f)->pMethods->xCheckReservedLock(REAL(f), o);
}
static int s_fcntl(sqlite3_file *f, int op, void *a) {
  return REAL(f)->pMethods->xFileControl(REAL(f), op, a);
}
static int s_sector(sqlite3_file *f) {
  return REAL(f)->pMethods->xSectorSize(REAL(f));
}
static int s_devchar(sqlite3_file *f) {
  return REAL(f)->pMethods->xDeviceCharacteristics(REAL(f));
}
static int s_shmmap(sqlite3_file *f, int i, int sz, int e, void volatile **p) {
  return REAL(f)->pMethods->xShmMap(REAL(f), i, sz, e, p);
}
static int s_shmlock(sqlite3_file *f, int o, int n, int fl) {
  return REAL(f)->pMethods->xShmLock(REAL(f), o, n, fl);
}
static void s_shmbarrier(sqlite3_file *f) {
  REAL(f)->pMethods->xShmBarrier(REAL(f));
}
static int s_shmunmap(sqlite3_file *f, int d) {
  return REAL(f)->pMethods->xShmUnmap(REAL(f), d);
}
static int s_fetch(sqlite3_file *f, sqlite3_int64 o, int n, void **p) {
  return REAL(f)->pMethods->xFetch(REAL(f), o, n, p);
}
static int s_unfetch(sqlite3_file *f, sqlite3_int64 o, void *p) {
  return REAL(f)->pMethods->xUnfetch(REAL(f), o, p);
}

static int s_open(sqlite3_vfs *v, const char *name, sqlite3_file *f, int flags,
                  int *out) {
  (void)v;
  shim_file *sf = (shim_file *)f;
  memset(sf, 0, sizeof *sf);
  sf->real = (sqlite3_file *)(sf + 1);
  int rc = g_real->xOpen(g_real, name, sf->real, flags, out);
  if (rc != SQLITE_OK || !sf->real->pMethods) {
    sf->base.pMethods = NULL;
    return rc;
  }
  g_methods.iVersion =
      sf->real->pMethods->iVersion < 3 ? sf->real->pMethods->iVersion : 3;
  sf->base.pMethods = &g_methods;
  sf->tracked = (flags & (SQLITE_OPEN_MAIN_DB | SQLITE_OPEN_WAL |
                          SQLITE_OPEN_MAIN_JOURNAL)) != 0;
  return rc;
}
static int s_delete(sqlite3_vfs *v, const char *n, int sync) {
  (void)v;
  return g_real->xDelete(g_real, n, sync);
}
static int s_access(sqlite3_vfs *v, const char *n, int fl, int *o) {
  (void)v;
  return g_real->xAccess(g_real, n, fl, o);
}
static int s_full(sqlite3_vfs *v, const char *n, int sz, char *o) {
  (void)v;
  return g_real->xFullPathname(g_real, n, sz, o);
}
static int s_rand(sqlite3_vfs *v, int n, char *o) {
  (void)v;
  return g_real->xRandomness(g_real, n, o);
}
static int s_sleep(sqlite3_vfs *v, int us) {
  (void)v;
  return g_real->xSleep(g_real, us);
}
static int s_time(sqlite3_vfs *v, double *t) {
  (void)v;
  return g_real->xCurrentTime(g_real, t);
}
static int s_lasterr(sqlite3_vfs *v, int n, char *o) {
  (void)v;
  return g_real->xGetLastError ? g_real->xGetLastError(g_real, n, o) : 0;
}
static int s_time64(sqlite3_vfs *v, sqlite3_int64 *t) {
  (void)v;
  return g_real->xCurrentTimeInt64(g_real, t);
}

static void shim_install(void) {
  g_real = sqlite3_vfs_find(NULL);
  REQUIRE(g_real);
  g_methods = (sqlite3_io_methods){
      3,         s_close,  s_read,    s_write,      s_truncate, s_sync,
      s_size,    s_lock,   s_unlock,  s_check,      s_fcntl,    s_sector,
      s_devchar, s_shmmap, s_shmlock, s_shmbarrier, s_shmunmap, s_fetch,
      s_unfetch};
  memset(&g_shim, 0, sizeof g_shim);
  g_shim.iVersion = 2;
  g_shim.szOsFile = (int)sizeof(shim_file) + g_real->szOsFile;
  g_shim.mxPathname = g_real->mxPathname;
  g_shim.zName = "kvt-durability-shim";
  g_shim.xOpen = s_open;
  g_shim.xDelete = s_delete;
  g_shim.xAccess = s_access;
  g_shim.xFullPathname = s_full;
  g_shim.xRandomness = s_rand;
  g_shim.xSleep = s_sleep;
  g_shim.xCurrentTime = s_time;
  g_shim.xGetLastError = s_lasterr;
  g_shim.xCurrentTimeInt64 = s_time64;
  REQUIRE(sqlite3_vfs_register(&g_shim, 1) == SQLITE_OK);
}

/* Acknowledgements seen with unsynced index state. */
static atomic_int g_acks, g_acks_unsynced;

static void on_done(void *ctx, const char *hash, int status) {
  (void)ctx;
  (void)hash;
  if (status != 0)
    return;
  atomic_fetch_add(&g_acks, 1);
  if (atomic_load(&g_unsynced) > 0)
    atomic_fetch_add(&g_acks_unsynced, 1);
}

static void run(int durability, int *acks, int *unsynced) {
  atomic_store(&g_acks, 0);
  atomic_store(&g_acks_unsynced, 0);
  char *dir = rel_path(kvt_test_tmpdir("crashsim-index"), "cache", NULL);
  kvt_options o = rel_opts(dir, durability);
  o.spill_done_fn = on_done;
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  for (int i = 0; i < 20; i++) {
    t_entry e = t_make(500 + (uint64_t)i, 12 + (size_t)i, 2, 4, 4);
    REQUIRE(t_spill(t, &e) == 0);
    t_free(&e);
    if (i % 5 == 4)
      REQUIRE(kvt_tier_flush(t, -1) == 0);
  }
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  kvt_tier_close(t, -1);
  kvt_tier_free(t);
  free(dir);
  *acks = atomic_load(&g_acks);
  *unsynced = atomic_load(&g_acks_unsynced);
}

static void test_ack_implies_index_synced(void) {
  int acks, uns;
  run(KVT_DURABILITY_FSYNC, &acks, &uns);
  fprintf(stderr,
          "FSYNC: %d spills acknowledged, %d while index.db/WAL writes were "
          "unsynced "
          "(%ld SQLite writes, %ld syncs)\n",
          acks, uns, atomic_load(&g_writes), atomic_load(&g_syncs));
  CHECK_EQ_INT(acks, 20);
  CHECK_EQ_INT(uns, 0);
  run(KVT_DURABILITY_NONE, &acks, &uns);
  fprintf(stderr,
          "NONE: %d acknowledged, %d with unsynced index writes (allowed)\n",
          acks, uns);
}

int main(void) {
  r_use_fast_tmp();
  shim_install();
  RUN(test_ack_implies_index_synced);
  sqlite3_vfs_unregister(&g_shim);
  return kvt_test_done();
}
