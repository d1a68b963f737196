/*
 * bench_io.c - the raw I/O engine against the disk's own speed, in one run:
 * fio's sequential O_DIRECT write and read (1 MiB blocks, io_uring, the
 * engine's queue depth) and fio's warm buffered read, against kvtier's iobatch
 * writing/reading the same amount through O_DIRECT and through the page cache,
 * on both backends. Each line prints value, limit and ratio. Runs are
 * interleaved (fio, then kvtier, per round) and the median of the rounds is
 * reported, so drift in a shared machine's load hits both sides alike.
 *
 * Usage: bench_io [--dir DIR] [--size-mb N] [--depth N] [--chunk-kb N] [--runs
 * N] [--no-fio]
 */
#define _GNU_SOURCE 1
#include "benchutil.h"
#include "base/bufpool.h"
#include "base/io.h"
#include "engine/iobatch.h"
#include "kvtier.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static uint64_t size_b = 512ull << 20;
static int depth = 8;
static size_t chunk = 1u << 20;

/* Writes the file from buf with the engine: create, preallocate, batch, fsync.
 * Returns seconds or -1. */
static double ours_write(kvti_iobatch *b, const char *path, void *buf,
                         int direct) {
  unlink(path);
  double t0 = bu_now();
  int fd = kvti_open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
  if (fd < 0)
    return -1;
  int dfd = direct ? kvti_iob_open_direct(path, O_RDWR, 0600) : -1;
  kvti_iob_preallocate(fd, size_b);
  kvti_iob_req r = {fd, dfd, 1, buf, size_b, 0, 0, 0, 0};
  int rc = kvti_iobatch_run(b, &r, 1, direct ? 0 : KVTI_IOB_NO_DIRECT, path);
  if (rc == 0)
    rc = kvti_fsync(fd, path);
  double t = bu_now() - t0;
  close(fd);
  if (dfd >= 0)
    close(dfd);
  if (rc != 0) {
    fprintf(stderr, "write failed: %s\n", kvt_last_error());
    return -1;
  }
  return t;
}

static double ours_read(kvti_iobatch *b, const char *path, void *buf,
                        int direct) {
  double t0 = bu_now();
  int fd = kvti_open(path, O_RDONLY, 0);
  if (fd < 0)
    return -1;
  int dfd = direct ? kvti_iob_open_direct(path, O_RDONLY, 0) : -1;
  kvti_iob_req r = {fd, dfd, 0, buf, size_b, 0, 0, 0, 0};
  int rc = kvti_iobatch_run(b, &r, 1, direct ? 0 : KVTI_IOB_NO_DIRECT, path);
  double t = bu_now() - t0;
  close(fd);
  if (dfd >= 0)
    close(dfd);
  if (rc != 0) {
    fprintf(stderr, "read failed: %s\n", kvt_last_error());
    return -1;
  }
  return t;
}

#define MAXRUNS 16
enum {
  FIO_W,
  FIO_RD,
  FIO_RB,
  U_WD,
  U_WB,
  U_RD,
  U_RBC,
  U_RBW,
  P_WD,
  P_RD,
  P_RBW,
  NMEAS
};

int main(int argc, char **argv) {
  const char *base = NULL;
  int runs = 3, use_fio = 1;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--dir") && i + 1 < argc)
      base = argv[++i];
    else if (!strcmp(argv[i], "--size-mb") && i + 1 < argc)
      size_b = strtoull(argv[++i], NULL, 10) << 20;
    else if (!strcmp(argv[i], "--depth") && i + 1 < argc)
      depth = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--chunk-kb") && i + 1 < argc)
      chunk = strtoull(argv[++i], NULL, 10) << 10;
    else if (!strcmp(argv[i], "--runs") && i + 1 < argc)
      runs = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--no-fio"))
      use_fio = 0;
    else {
      fprintf(stderr,
              "usage: %s [--dir DIR] [--size-mb N] [--depth N] [--chunk-kb N] "
              "[--runs N] "
              "[--no-fio]\n",
              argv[0]);
      return 2;
    }
  }
  if (runs < 1 || runs > MAXRUNS || depth < 1 || size_b == 0 || chunk < 4096) {
    fprintf(stderr, "bad arguments\n");
    return 2;
  }
  if (use_fio && !bu_have_fio()) {
    fprintf(
        stderr,
        "fio not found: limits unavailable (install fio or pass --no-fio)\n");
    use_fio = 0;
  }
  char *dir = bu_mkdtemp(base);
  if (!dir)
    return 1;
  bu_header("bench_io: iobatch vs fio", dir);
  printf("# size %llu MiB, queue depth %d, chunk %zu KiB, %d rounds (medians; "
         "ratio = median of per-round ratios)\n",
         (unsigned long long)(size_b >> 20), depth, chunk >> 10, runs);

  kvti_iob_cfg cfg = KVTI_IOB_CFG_INIT;
  cfg.backend = KVT_IO_URING;
  cfg.depth = (unsigned)depth;
  cfg.chunk = chunk;
  kvti_iobatch *ub = NULL, *pb = NULL;
  if (kvti_iobatch_create(&ub, &cfg) != 0) {
    printf("# io_uring unavailable (%s): io_uring lines skipped\n",
           kvt_last_error());
    ub = NULL;
  }
  cfg.backend = KVT_IO_PORTABLE;
  cfg.threads = 2;
  if (kvti_iobatch_create(&pb, &cfg) != 0)
    return 1;

  /* Pre-touched aligned buffer: the data source and sink (allocation cost is
   * not measured). */
  void *buf = kvti_aligned_alloc(4096, size_b);
  if (!buf)
    return 1;
  for (uint64_t i = 0; i < size_b; i += 8)
    ((uint64_t *)buf)[i / 8] = i * 0x9e3779b97f4a7c15ull;

  char fiof[4096], ourf[4096];
  snprintf(fiof, sizeof fiof, "%s/fio.dat", dir);
  snprintf(ourf, sizeof ourf, "%s/ours.dat", dir);
  double m[NMEAS][MAXRUNS];
  memset(m, 0, sizeof m);
  double gb = (double)size_b / 1e9;
  for (int r = 0; r < runs; r++) {
    if (use_fio) {
      bu_fio_job j = {fiof,  "write",    1, 1u << 20, size_b,
                      depth, "io_uring", 1, 1};
      unlink(fiof);
      bu_fio(&m[FIO_W][r], &j);
      j.rw = "read";
      bu_fio(&m[FIO_RD][r], &j);
      j.direct = 0;
      j.engine = "psync";
      j.depth = 1;
      j.invalidate = 0;
      bu_fio(&m[FIO_RB][r], &j); /* warms the cache */
      bu_fio(&m[FIO_RB][r], &j);
      unlink(fiof);
    }
    double t;
    if (ub) {
      if ((t = ours_write(ub, ourf, buf, 1)) > 0)
        m[U_WD][r] = gb / t * 1e9;
      bu_drop_cache(ourf);
      if ((t = ours_read(ub, ourf, buf, 1)) > 0)
        m[U_RD][r] = gb / t * 1e9;
      bu_drop_cache(ourf);
      if ((t = ours_read(ub, ourf, buf, 0)) > 0)
        m[U_RBC][r] = gb / t * 1e9;
      if ((t = ours_read(ub, ourf, buf, 0)) > 0)
        m[U_RBW][r] = gb / t * 1e9;
      if ((t = ours_write(ub, ourf, buf, 0)) > 0)
        m[U_WB][r] = gb / t * 1e9;
    }
    if ((t = ours_write(pb, ourf, buf, 1)) > 0)
      m[P_WD][r] = gb / t * 1e9;
    bu_drop_cache(ourf);
    if ((t = ours_read(pb, ourf, buf, 1)) > 0)
      m[P_RD][r] = gb / t * 1e9;
    ours_read(pb, ourf, buf, 0);
    if ((t = ours_read(pb, ourf, buf, 0)) > 0)
      m[P_RBW][r] = gb / t * 1e9;
    unlink(ourf);
  }
  double v[NMEAS];
  /* Medians of the rounds for values and limits; the ratio is the median of the
   * per-round ratios (each pairs kvtier's figure with fio's from the same
   * round). */
  for (int k = 0; k < NMEAS; k++) {
    double tmp[MAXRUNS];
    memcpy(tmp, m[k], sizeof tmp);
    v[k] = bu_median(tmp, runs) / 1e9;
  }
  char dw[128], dr[128], db[128];
  snprintf(dw, sizeof dw, "fio write O_DIRECT bs=1M qd=%d +fsync", depth);
  snprintf(dr, sizeof dr, "fio read O_DIRECT bs=1M qd=%d", depth);
  snprintf(db, sizeof db, "fio read buffered warm bs=1M psync");
  if (use_fio)
    printf("# fio (median): write %.3f GB/s, O_DIRECT read %.3f GB/s, warm "
           "buffered "
           "read %.3f GB/s\n",
           v[FIO_W], v[FIO_RD], v[FIO_RB]);
  struct {
    const char *name;
    int k, lim;
    const char *desc;
    double want;
  } lines[] = {
      {"uring write O_DIRECT+fsync", U_WD, FIO_W, dw, 0.85},
      {"uring read O_DIRECT (cold)", U_RD, FIO_RD, dr, 0.85},
      {"uring read buffered warm", U_RBW, FIO_RB, db, 0.80},
      {"uring read buffered cold", U_RBC, FIO_RD, dr, 0},
      {"uring write buffered+fsync", U_WB, FIO_W, dw, 0},
      {"portable write O_DIRECT+fsync", P_WD, FIO_W, dw, 0},
      {"portable read O_DIRECT (cold)", P_RD, FIO_RD, dr, 0},
      {"portable read buffered warm", P_RBW, FIO_RB, db, 0},
  };
  for (size_t i = 0; i < sizeof lines / sizeof *lines; i++) {
    if (!ub && lines[i].k >= U_WD && lines[i].k <= U_RBW)
      continue;
    double q[MAXRUNS];
    for (int r = 0; r < runs; r++)
      q[r] = m[lines[i].lim][r] > 0 ? m[lines[i].k][r] / m[lines[i].lim][r] : 0;
    /* Each line is held against a physical limit: one above it is flagged. */
    bu_report_limit(lines[i].name, v[lines[i].k], v[lines[i].lim],
                    bu_median(q, runs), "GB/s", lines[i].desc, lines[i].want,
                    -1);
  }
  kvti_free(buf);
  kvti_iobatch_free(ub);
  kvti_iobatch_free(pb);
  kvt_test_rmtree(dir);
  free(dir);
  return 0;
}
