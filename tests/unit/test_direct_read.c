/*
 * test_direct_read.c - cold layer files are read with O_DIRECT, warm ones
 * through the page cache (issue 7): native-mode layer files holding >= 1 MiB
 * of tensors pad their safetensors header so the data starts at a 4096-aligned
 * offset (compat files and small files keep the 8-byte padding); the reader
 * opens an O_DIRECT descriptor only when the io seam's `resident` hook says at
 * most half of the file is cached; a direct read returns the same bytes as a
 * buffered one, still detects corruption, falls back to the page cache when the
 * file system refuses O_DIRECT (EINVAL), and fails cleanly on an I/O error. The
 * default residency hook (cachestat or mincore) is checked against reality.
 */
#define _GNU_SOURCE 1 /* O_DIRECT */
#include "format/entry.h"
#include "fmt_testlib.h"
#include "base/io.h"
#include "engine/iobatch.h"
#include "kvtier.h"
#include "testutil.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#ifdef __linux__
#include <sys/vfs.h>
#endif
#include <unistd.h>

#define TMPFS_MAGIC_ 0x01021994

/* ---- a counting / fault-injecting io table ------------------------------ */

static int g_direct_opens, g_direct_fd = -1;
static int g_resident_mode; /* 0: report nothing cached; 1: all cached */
static int g_direct_errno;  /* != 0: reads on the direct fd fail with it */
static int g_direct_reads;

#ifndef O_DIRECT
#define O_DIRECT 0 /* no such flag here: no open counts as direct */
#endif
static int c_open(const char *p, int f, mode_t m) {
  int fd = kvti_io_default.open(p, f, m);
  if (fd >= 0 && (f & O_DIRECT) != 0) {
    g_direct_opens++;
    g_direct_fd = fd;
  }
  return fd;
}
static int c_resident(int fd, uint64_t len, uint64_t *bytes) {
  (void)fd;
  *bytes = g_resident_mode ? len : 0;
  return 0;
}
static ssize_t c_pread(int fd, void *b, size_t n, off_t off) {
  if (fd == g_direct_fd) {
    g_direct_reads++;
    if (g_direct_errno) {
      errno = g_direct_errno;
      return -1;
    }
  }
  return kvti_io_default.pread(fd, b, n, off);
}
static int c_uring_result(int is_write, int fd, uint64_t off, size_t len,
                          int res) {
  if (!is_write && fd == g_direct_fd) {
    g_direct_reads++;
    if (g_direct_errno)
      return -g_direct_errno;
  }
  return kvti_io_default.uring_result
             ? kvti_io_default.uring_result(is_write, fd, off, len, res)
             : res;
}

static kvti_io_ops counting_ops(void) {
  kvti_io_ops ops = kvti_io_default;
  ops.open = c_open;
  ops.resident = c_resident;
  ops.pread = c_pread;
  if (ops.uring_result)
    ops.uring_result = c_uring_result;
  return ops;
}

/* ---- helpers ------------------------------------------------------------- */

static int write_entry(const char *data, const int32_t *tok, size_t n,
                       kvt_layer *ls, uint32_t nl, int mode) {
  kvti_snapshot *s = NULL;
  int rc = kvti_snapshot_create(&s, tok, n, ls, nl, 4242, 1, NULL, NULL);
  if (rc)
    return rc;
  kvti_write_opts o = {mode, 1, 0600, 0700};
  uint64_t d = 0;
  rc = kvti_entry_write(&d, data, s, &o);
  if (rc == 0)
    CHECK_EQ_INT(kvti_snapshot_disk_bytes(s, mode), d);
  kvti_snapshot_free(s);
  return rc;
}

/* 8 + N of a safetensors file: where its data starts. */
static uint64_t data_start(const char *path) {
  size_t len = 0;
  char *b = kvt_test_read_file(path, &len);
  uint64_t n = 0;
  if (b && len >= 8)
    for (int i = 7; i >= 0; i--)
      n = n << 8 | (unsigned char)b[i];
  free(b);
  return 8 + n;
}

static char *layer_path(const char *data, const char *h, int i) {
  char *p = malloc(4200);
  snprintf(p, 4200, "%s/%s/layer_%d.safetensors", data, h, i);
  return p;
}

/* Does this file system give O_DIRECT descriptors at all? */
static int direct_supported(const char *path) {
  int fd = kvti_iob_open_direct(path, O_RDONLY, 0);
  if (fd < 0)
    return 0;
  close(fd);
  return 1;
}

/* A 2-layer entry: layer 0 holds 2 MiB of F16 (aligned, direct-eligible),
 * layer 1 a few KiB (never aligned, never direct). */
typedef struct fixture {
  char *dir;
  int32_t tok[9];
  char h[65];
  kvt_layer ls[2];
} fixture;

static void fixture_make(fixture *f, const char *tag, int mode) {
  f->dir = kvt_test_tmpdir(tag);
  for (int i = 0; i < 9; i++)
    f->tok[i] = 100 + i * 7;
  kvt_token_hash(f->h, f->tok, 9);
  kvt_rng r = {77};
  f->ls[0] = t_kv(&r, KVT_DTYPE_F16, 1, 8, 512, 128, 512);
  f->ls[1] = t_kv(&r, KVT_DTYPE_F16, 1, 2, 9, 16, 9);
  REQUIRE(write_entry(f->dir, f->tok, 9, f->ls, 2, mode) == 0);
}

static void fixture_free(fixture *f) {
  t_layer_free(&f->ls[0]);
  t_layer_free(&f->ls[1]);
}

static int read_ok(const fixture *f) {
  kvt_entry *e = NULL;
  int rc = kvti_entry_read(&e, f->dir, f->h, NULL);
  if (rc == 0) {
    CHECK_EQ_INT(kvt_entry_num_layers(e), 2);
    CHECK(t_layer_eq(kvt_entry_layer(e, 0), &f->ls[0]));
    CHECK(t_layer_eq(kvt_entry_layer(e, 1), &f->ls[1]));
    kvt_entry_free(e);
  }
  return rc;
}

/* ---- tests --------------------------------------------------------------- */

static void test_layout(void) {
  fixture nat, cmp;
  fixture_make(&nat, "direct-layout-n", KVT_STORAGE_NATIVE);
  fixture_make(&cmp, "direct-layout-c", KVT_STORAGE_COMPAT);
  char *n0 = layer_path(nat.dir, nat.h, 0), *n1 = layer_path(nat.dir, nat.h, 1);
  char *c0 = layer_path(cmp.dir, cmp.h, 0);
  /* native, big: data 4096-aligned */
  CHECK_EQ_INT(data_start(n0) % 4096, 0);
  /* native, small: the safetensors package's own 8-byte padding only */
  CHECK(data_start(n1) < 4096);
  CHECK_EQ_INT(data_start(n1) % 8, 0);
  /* compat: never re-padded (byte-identical to the reference) */
  CHECK(data_start(c0) < 4096);
  CHECK_EQ_INT(data_start(c0) % 8, 0);
  /* both read back exactly */
  CHECK_EQ_INT(read_ok(&nat), 0);
  CHECK_EQ_INT(read_ok(&cmp), 0);
  free(n0), free(n1), free(c0);
  fixture_free(&nat);
  fixture_free(&cmp);
}

static void test_cold_uses_direct_warm_does_not(void) {
  fixture f;
  fixture_make(&f, "direct-choice", KVT_STORAGE_NATIVE);
  char *p0 = layer_path(f.dir, f.h, 0);
  int have = direct_supported(p0);
  kvti_io_ops ops = counting_ops();
  for (int backend = 0; backend < 2; backend++) {
    if (backend == 1)
      ops.uring_setup = NULL; /* force the portable backend */
    kvti_iobatch_cache_drain();
    /* cold: one O_DIRECT open (layer 0 only), reads through it, same bytes */
    g_resident_mode = 0;
    g_direct_opens = g_direct_reads = 0;
    g_direct_fd = -1;
    kvti_io_set(&ops);
    CHECK_EQ_INT(read_ok(&f), 0);
    kvti_io_set(NULL);
    CHECK_EQ_INT(g_direct_opens, have ? 1 : 0);
    if (have)
      CHECK(g_direct_reads > 0);
    /* warm: no O_DIRECT at all */
    g_resident_mode = 1;
    g_direct_opens = 0;
    kvti_io_set(&ops);
    CHECK_EQ_INT(read_ok(&f), 0);
    kvti_io_set(NULL);
    CHECK_EQ_INT(g_direct_opens, 0);
    /* unknown residency (hook absent): the page cache */
    kvti_io_ops nores = ops;
    nores.resident = NULL;
    g_direct_opens = 0;
    kvti_io_set(&nores);
    CHECK_EQ_INT(read_ok(&f), 0);
    kvti_io_set(NULL);
    CHECK_EQ_INT(g_direct_opens, 0);
  }
  kvti_iobatch_cache_drain();
  free(p0);
  fixture_free(&f);
}

static void test_direct_faults(void) {
  fixture f;
  fixture_make(&f, "direct-faults", KVT_STORAGE_NATIVE);
  char *p0 = layer_path(f.dir, f.h, 0);
  if (!direct_supported(p0)) {
    kvt_test_skip("odirect", "O_DIRECT fault cases: not supported by this file "
                             "system");
    free(p0);
    fixture_free(&f);
    return;
  }
  kvti_io_ops ops = counting_ops();
  g_resident_mode = 0;
  for (int backend = 0; backend < 2; backend++) {
    if (backend == 1)
      ops.uring_setup = NULL;
    kvti_iobatch_cache_drain();
    /* The file system refuses this direct transfer: page-cache fallback. */
    g_direct_errno = EINVAL;
    g_direct_fd = -1;
    kvti_io_set(&ops);
    CHECK_EQ_INT(read_ok(&f), 0);
    kvti_io_set(NULL);
    /* A real I/O error on the direct descriptor: the read fails, no data. */
    g_direct_errno = EIO;
    g_direct_fd = -1;
    g_direct_reads = 0;
    kvt_entry *e = NULL;
    kvti_io_set(&ops);
    int rc = kvti_entry_read(&e, f.dir, f.h, NULL);
    kvti_io_set(NULL);
    CHECK(g_direct_reads > 0);
    CHECK_EQ_INT(rc, KVT_EIO);
    CHECK(e == NULL);
    g_direct_errno = 0;
  }
  kvti_iobatch_cache_drain();
  /* Corruption in the aligned body is caught on the direct path too. */
  int fd = open(p0, O_RDWR);
  REQUIRE(fd >= 0);
  uint64_t at = data_start(p0) + 1000000;
  char c = 0;
  REQUIRE(pread(fd, &c, 1, (off_t)at) == 1);
  c ^= 0x10;
  REQUIRE(pwrite(fd, &c, 1, (off_t)at) == 1);
  fsync(fd);
  close(fd);
  g_direct_opens = 0;
  g_direct_fd = -1;
  kvt_entry *e = NULL;
  kvti_io_set(&ops);
  CHECK_EQ_INT(kvti_entry_read(&e, f.dir, f.h, NULL), KVT_ECORRUPT);
  kvti_io_set(NULL);
  CHECK_EQ_INT(g_direct_opens, 1);
  CHECK(e == NULL);
  kvti_iobatch_cache_drain();
  free(p0);
  fixture_free(&f);
}

/* Through the tier: a cold promote uses O_DIRECT; KVT_PROMOTE_PAGE_CACHE
 * keeps it out and leaves the pages cached (the next promote is warm). */
static void test_promote_flag(void) {
  char *dir = kvt_test_tmpdir("direct-tier");
  kvt_options o;
  kvt_options_init(&o, KVT_OPTIONS_VERSION);
  o.cache_dir = dir;
  o.host_cache_bytes = 0; /* reads must reach the files */
  kvt_tier *t = NULL;
  REQUIRE(kvt_tier_open(&t, &o) == 0);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  kvt_rng r = {91};
  kvt_layer l = t_kv(&r, KVT_DTYPE_F16, 1, 8, 512, 128, 512);
  int32_t tok[4] = {5, 6, 7, 8};
  REQUIRE(kvt_tier_spill(t, tok, 4, &l, 1, 1000) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  char h[65], p0[4300];
  kvt_token_hash(h, tok, 4);
  snprintf(p0, sizeof p0, "%s/data/%s/layer_0.safetensors", dir, h);
  int have = direct_supported(p0);
  kvti_io_ops ops = counting_ops();
  ops.resident = kvti_io_default.resident; /* the real residency */
  int fd = open(p0, O_RDONLY);
  REQUIRE(fd >= 0);
  kvti_iob_drop_cache(fd);
  kvt_promote_opts po = KVT_PROMOTE_OPTS_INIT;
  po.flags = KVT_PROMOTE_PAGE_CACHE;
  for (int pass = 0; pass < 3; pass++) {
    g_direct_opens = 0;
    g_direct_fd = -1;
    kvt_entry *e = NULL;
    kvti_io_set(&ops);
    int rc = kvt_tier_promote(&e, t, tok, 4, pass == 1 ? &po : NULL);
    kvti_io_set(NULL);
    CHECK_EQ_INT(rc, 0);
    if (rc == 0)
      CHECK(t_layer_eq(kvt_entry_layer(e, 0), &l));
    kvt_entry_free(e);
    if (pass == 0) /* cold: O_DIRECT (where the file system has it) */
      CHECK_EQ_INT(g_direct_opens, have ? 1 : 0);
    else /* the flag; then the pages it left cached: page cache */
      CHECK_EQ_INT(g_direct_opens, 0);
  }
  close(fd);
  po.flags = 0x80; /* unknown bits are still refused */
  kvt_entry *e = NULL;
  CHECK_EQ_INT(kvt_tier_promote(&e, t, tok, 4, &po), KVT_EINVAL);
  kvt_tier_free(t);
  t_layer_free(&l);
  kvt_test_rmtree(dir);
}

/* The default hook tells the truth: a file just read is resident; after
 * fadvise(DONTNEED) of a synced file it is not (where the file system really
 * drops pages: not tmpfs). */
static void test_default_resident(void) {
  if (!kvti_io_default.resident) {
    fprintf(stderr, "  (no residency hook on this platform)\n");
    return;
  }
  char *dir = kvt_test_tmpdir("direct-resident");
  char path[4200];
  snprintf(path, sizeof path, "%s/f", dir);
  size_t n = 4u << 20;
  char *buf = malloc(n);
  REQUIRE(buf != NULL);
  kvt_rng r = {3};
  kvt_rng_fill(&r, buf, n);
  int fd = open(path, O_CREAT | O_RDWR | O_TRUNC, 0600);
  REQUIRE(fd >= 0);
  REQUIRE(pwrite(fd, buf, n, 0) == (ssize_t)n);
  REQUIRE(fsync(fd) == 0);
  int tmpfs = 0; /* tmpfs keeps pages whatever the advice */
#ifdef __linux__
  struct statfs sf;
  tmpfs = fstatfs(fd, &sf) == 0 && (long)sf.f_type == TMPFS_MAGIC_;
#endif
  /* Both probes: the default hook (cachestat where the kernel has it) and the
   * mincore fallback. */
  int (*probe[2])(int, uint64_t, uint64_t *) = {kvti_io_default.resident,
                                                kvti_resident_mincore};
  for (int k = 0; k < 2; k++) {
    uint64_t res = 0;
    REQUIRE(pread(fd, buf, n, 0) == (ssize_t)n); /* cached again */
    CHECK_EQ_INT(probe[k](fd, n, &res), 0);
    CHECK(res >= n - 4096);
    CHECK(res <= n + 65536);
    if (!tmpfs && kvti_iob_drop_cache(fd) == 0) {
      CHECK_EQ_INT(probe[k](fd, n, &res), 0);
      CHECK(res < n / 2);
    }
    /* an empty range: nothing resident, not an error */
    CHECK_EQ_INT(probe[k](fd, 0, &res), 0);
    CHECK_EQ_INT(res, 0);
  }
  close(fd);
  free(buf);
  kvt_test_rmtree(dir);
}

int main(void) {
  RUN(test_layout);
  RUN(test_cold_uses_direct_warm_does_not);
  RUN(test_direct_faults);
  RUN(test_promote_flag);
  RUN(test_default_resident);
  return kvt_test_done();
}
