/*
 * test_crashsim_index_tier.c - the power-loss check for the index half of a
 * spill. index.db, its WAL and journals are written through kvtier's I/O seam
 * (the kvtier-io SQLite VFS, src/sqlvfs.c), so this test wraps the I/O table:
 * for every descriptor opened on one of those files it tracks whether bytes
 * were written (pwrite, ftruncate) since that descriptor's last fsync. At the
 * moment the tier acknowledges a spill as written (spill_done_fn, status 0)
 * with durability FSYNC, nothing the acknowledgement depends on may be
 * unsynced: if the WAL frames holding the entry's row were still unsynced, a
 * power loss could roll the row back, and the next open's reconcile would
 * delete the entry's (durable) directory as an orphan - an acknowledged entry
 * lost. With durability NONE no such promise is made, and the tracker must see
 * acknowledgements with unsynced index writes there (synchronous=NORMAL does
 * not sync the WAL at commit): that shows it can see them at all.
 */
#include "rel_tier.h"

#include <fcntl.h>
#include <stdatomic.h>

#define MAX_FD 4096
static atomic_int g_tracked[MAX_FD], g_dirty[MAX_FD];
static atomic_int g_unsynced; /* tracked descriptors with writes not synced */
static atomic_long g_syncs, g_writes;
static kvti_io_ops g_ops;

static int tracked(int fd) {
  return fd >= 0 && fd < MAX_FD && atomic_load(&g_tracked[fd]);
}
static void mark_dirty(int fd) {
  if (!tracked(fd))
    return;
  atomic_fetch_add(&g_writes, 1);
  if (!atomic_exchange(&g_dirty[fd], 1))
    atomic_fetch_add(&g_unsynced, 1);
}

static int w_open(const char *p, int f, mode_t m) {
  int fd = kvti_io_default.open(p, f, m);
  if (fd >= 0 && fd < MAX_FD) {
    atomic_store(&g_dirty[fd], 0);
    atomic_store(&g_tracked[fd], strstr(p, "/index.db") != NULL);
  }
  return fd;
}
/* A descriptor closed dirty stays counted: its writes are still unsynced. */
static int w_close(int fd) {
  if (fd >= 0 && fd < MAX_FD) {
    atomic_store(&g_tracked[fd], 0);
    atomic_store(&g_dirty[fd], 0);
  }
  return kvti_io_default.close(fd);
}
static ssize_t w_pwrite(int fd, const void *b, size_t n, off_t o) {
  ssize_t r = kvti_io_default.pwrite(fd, b, n, o);
  mark_dirty(fd);
  return r;
}
static int w_ftruncate(int fd, off_t n) {
  int r = kvti_io_default.ftruncate(fd, n);
  mark_dirty(fd);
  return r;
}
static int w_fsync(int fd) {
  int r = kvti_io_default.fsync(fd);
  if (r == 0 && tracked(fd)) {
    atomic_fetch_add(&g_syncs, 1);
    if (atomic_exchange(&g_dirty[fd], 0))
      atomic_fetch_sub(&g_unsynced, 1);
  }
  return r;
}

static void tracker_install(void) {
  g_ops = kvti_io_default;
  g_ops.open = w_open;
  g_ops.close = w_close;
  g_ops.pwrite = w_pwrite;
  g_ops.ftruncate = w_ftruncate;
  g_ops.fsync = w_fsync;
  kvti_io_set(&g_ops);
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
  atomic_store(&g_unsynced, 0);
  atomic_store(&g_writes, 0);
  atomic_store(&g_syncs, 0);
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
          "(%ld index.db writes, %ld syncs)\n",
          acks, uns, atomic_load(&g_writes), atomic_load(&g_syncs));
  CHECK_EQ_INT(acks, 20);
  CHECK_EQ_INT(uns, 0);
  CHECK(atomic_load(&g_writes) > 0);
  CHECK(atomic_load(&g_syncs) > 0);
  run(KVT_DURABILITY_NONE, &acks, &uns);
  fprintf(stderr,
          "NONE: %d acknowledged, %d with unsynced index writes (allowed; "
          "%ld writes, %ld syncs)\n",
          acks, uns, atomic_load(&g_writes), atomic_load(&g_syncs));
  CHECK_EQ_INT(acks, 20);
  CHECK(uns > 0); /* the tracker does see unsynced index state */
}

int main(void) {
  r_use_fast_tmp();
  tracker_install();
  RUN(test_ack_implies_index_synced);
  kvti_io_set(NULL);
  return kvt_test_done();
}
