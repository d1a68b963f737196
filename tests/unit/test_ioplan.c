/*
 * test_ioplan.c - the read planner (src/engine/ioplan.c) on the layouts a
 * promote reads: scattered head extents contiguous in the file (a chunk of
 * 64 KiB head extents bound for strided places in each tensor), one
 * contiguous range (a whole tensor, cut at the limit), chunked layouts of
 * several tensors with tails and odd sizes, gaps in the file, memory-adjacent
 * extents, segment bounds and refusals. Every plan is checked structurally
 * (requests in file order, disjoint, each within the byte and segment
 * limits, every extent byte covered exactly once and bound for its own
 * address) and then executed by the engine on a real file, on the portable
 * backend (with and without the seam's preadv) and on io_uring where it can
 * be set up, with the O_DIRECT descriptor given, and the destinations
 * compared with the file.
 */
#include "testutil.h"
#include "base/error.h"
#include "base/io.h"
#include "engine/iobatch.h"
#include "engine/ioplan.h"

#include <fcntl.h>
#include <string.h>
#include <unistd.h>

static char *dir;
static int uring_ok;

/* The structural invariants of plan p over ext[0..n). */
static void check_plan(const kvti_ioplan *p, const kvti_ioplan_ext *ext,
                       size_t n, uint64_t limit, unsigned max_iov) {
  uint64_t total = 0, lo = UINT64_MAX, hi = 0;
  for (size_t i = 0; i < n; i++) {
    total += ext[i].len;
    if (ext[i].len && ext[i].off < lo)
      lo = ext[i].off;
    if (ext[i].len && ext[i].off + ext[i].len > hi)
      hi = ext[i].off + ext[i].len;
  }
  CHECK_EQ_INT(p->bytes, total);
  if (total == 0) {
    CHECK_EQ_INT(p->n, 0);
    return;
  }
  /* A count per file byte of the spanned range, and where it is read to. */
  uint64_t span = hi - lo;
  unsigned char *seen = calloc(span, 1);
  char **to = calloc(span, sizeof *to);
  REQUIRE(seen && to);
  uint64_t prev_end = 0, sum = 0;
  for (size_t r = 0; r < p->n; r++) {
    const kvti_iob_req *q = &p->reqs[r];
    CHECK(q->len > 0 && q->len <= limit);
    CHECK(r == 0 || q->off >= prev_end);
    prev_end = q->off + q->len;
    CHECK(q->off >= lo && q->off + q->len <= hi);
    if (q->iov) {
      CHECK(q->iovcnt >= 2 && q->iovcnt <= max_iov);
      CHECK(q->buf == NULL);
    } else {
      CHECK(q->buf != NULL && q->iovcnt == 0);
    }
    uint64_t at = q->off, segsum = 0;
    unsigned ns = q->iov ? q->iovcnt : 1;
    for (unsigned s = 0; s < ns; s++) {
      char *b = q->iov ? q->iov[s].iov_base : q->buf;
      uint64_t l = q->iov ? q->iov[s].iov_len : q->len;
      CHECK(l > 0);
      for (uint64_t k = 0; k < l && at + k < hi; k++) {
        seen[at + k - lo]++;
        to[at + k - lo] = b + k;
      }
      at += l;
      segsum += l;
    }
    CHECK_EQ_INT(segsum, q->len);
    sum += q->len;
  }
  CHECK_EQ_INT(sum, total);
  /* Every extent byte once, to its own address; nothing else. */
  uint64_t once = 0, wrong = 0;
  for (size_t i = 0; i < n; i++)
    for (uint64_t k = 0; k < ext[i].len; k++) {
      uint64_t f = ext[i].off + k - lo;
      if (seen[f] != 1 || to[f] != (char *)ext[i].buf + k)
        wrong++;
      else
        once++;
    }
  CHECK_EQ_INT(wrong, 0);
  CHECK_EQ_INT(once, total);
  uint64_t covered = 0;
  for (uint64_t f = 0; f < span; f++)
    covered += seen[f];
  CHECK_EQ_INT(covered, total); /* no byte outside the extents */
  free(seen);
  free(to);
}

/* A file of `size` random bytes; *data receives them (malloc). */
static int make_file(const char *name, uint64_t size, unsigned char **data,
                     char *path, size_t cap) {
  snprintf(path, cap, "%s/%s", dir, name);
  unsigned char *d = malloc(size ? size : 1);
  REQUIRE(d);
  kvt_rng rng = {size * 31 + 7};
  kvt_rng_fill(&rng, d, size);
  int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
  REQUIRE(fd >= 0);
  REQUIRE(pwrite(fd, d, size, 0) == (ssize_t)size);
  REQUIRE(fsync(fd) == 0);
  *data = d;
  return fd;
}

static kvti_io_ops no_preadv;

/* Builds the plan of ext over the file and runs it on every backend
 * (portable with the seam's preadv, portable without one, io_uring),
 * checking every destination byte against the file each time. */
static void plan_and_read(const char *name, kvti_ioplan_ext *ext, size_t n,
                          uint64_t file_size, uint64_t limit,
                          unsigned max_iov) {
  char path[4096];
  unsigned char *data;
  int fd = make_file(name, file_size, &data, path, sizeof path);
  int dfd = kvti_iob_open_direct(path, O_RDONLY, 0);
  for (int mode = 0; mode < 3; mode++) {
    if (mode == 2 && !uring_ok)
      break;
    if (mode == 1) {
      no_preadv = kvti_io_default;
      no_preadv.preadv = NULL;
      kvti_io_set(&no_preadv);
    }
    kvti_ioplan p;
    REQUIRE(kvti_ioplan_build(&p, ext, n, fd, dfd, limit, max_iov) == 0);
    check_plan(&p, ext, n, limit, max_iov ? max_iov : KVTI_IOB_MAX_IOV);
    for (size_t i = 0; i < n; i++)
      memset(ext[i].buf, 0xA5, ext[i].len);
    kvti_iob_cfg cfg = KVTI_IOB_CFG_INIT;
    cfg.backend = mode == 2 ? KVT_IO_URING : KVT_IO_PORTABLE;
    cfg.chunk = (size_t)limit < 4096 ? 4096 : (size_t)limit;
    cfg.depth = 16;
    cfg.threads = 3;
    kvti_iobatch *b = NULL;
    REQUIRE(kvti_iobatch_create(&b, &cfg) == 0);
    CHECK_EQ_INT(kvti_iobatch_run(b, p.reqs, p.n, 0, name), 0);
    kvti_iobatch_free(b);
    uint64_t bad = 0;
    for (size_t i = 0; i < n; i++)
      if (ext[i].len && memcmp(ext[i].buf, data + ext[i].off, ext[i].len))
        bad++;
    if (bad)
      fprintf(stderr, "%s mode %d: %llu extents differ\n", name, mode,
              (unsigned long long)bad);
    CHECK_EQ_INT(bad, 0);
    kvti_ioplan_free(&p);
    if (mode == 1)
      kvti_io_set(NULL);
  }
  if (dfd >= 0)
    close(dfd);
  close(fd);
  unlink(path);
  free(data);
}

/* A chunk of H heads x L tensors: the file holds each tensor's heads back
 * to back (head extent e bytes), the destination tensor of T rows per head
 * receives them at stride T/rows * e, at row block `blk`. */
static void chunk_layout(const char *name, unsigned tensors, unsigned heads,
                         uint64_t e, unsigned stride_mult, unsigned blk,
                         uint64_t hdr, uint64_t limit, unsigned max_iov) {
  size_t n = (size_t)tensors * heads;
  kvti_ioplan_ext *ext = calloc(n, sizeof *ext);
  char **bufs = calloc(tensors, sizeof *bufs);
  REQUIRE(ext && bufs);
  uint64_t tb = (uint64_t)heads * stride_mult * e; /* a destination tensor */
  size_t k = 0;
  for (unsigned t = 0; t < tensors; t++) {
    bufs[t] = kvti_aligned_alloc(4096, tb);
    REQUIRE(bufs[t]);
    for (unsigned h = 0; h < heads; h++, k++)
      ext[k] =
          (kvti_ioplan_ext){hdr + ((uint64_t)t * heads + h) * e,
                            bufs[t] + ((uint64_t)h * stride_mult + blk) * e, e};
  }
  plan_and_read(name, ext, n, hdr + n * e, limit, max_iov);
  for (unsigned t = 0; t < tensors; t++)
    kvti_free(bufs[t]);
  free(bufs);
  free(ext);
}

static void test_scattered(void) {
  /* Llama-3-8B-like: 64 KiB head extents, 8 heads, a destination of 4
   * chunks (stride 4), 1 MiB requests: 16 extents per request. */
  chunk_layout("scat.bin", 6, 8, 65536, 4, 1, 4096, 1 << 20, 0);
  /* The same extents, more of them per request than segments allowed. */
  chunk_layout("scat_iov.bin", 4, 8, 4096, 3, 2, 8192, 1 << 20, 5);
}

static void test_contiguous(void) {
  /* Whole tensors (stride 1): the destination is contiguous per tensor, so
   * segments merge and requests are cut at the limit. */
  chunk_layout("contig.bin", 3, 8, 65536, 1, 0, 4096, 1 << 20, 0);
  /* One long extent, not a multiple of the limit (a tail). */
  uint64_t len = (5u << 20) + 12345;
  char *b = kvti_aligned_alloc(4096, len);
  REQUIRE(b);
  kvti_ioplan_ext one = {4096, b, len};
  plan_and_read("one.bin", &one, 1, 4096 + len + 99, 1 << 20, 0);
  kvti_ioplan p;
  REQUIRE(kvti_ioplan_build(&p, &one, 1, 3, -1, 1 << 20, 0) == 0);
  CHECK_EQ_INT(p.n, 6);
  for (size_t i = 0; i < p.n; i++) {
    CHECK(p.reqs[i].iov == NULL);     /* one segment: a plain request */
    CHECK(p.reqs[i].off % 4096 == 0); /* aligned start, 1 MiB cuts */
    CHECK_EQ_INT(p.reqs[i].fd, 3);
    CHECK_EQ_INT(p.reqs[i].dfd, -1);
  }
  CHECK_EQ_INT(p.reqs[5].len, 12345);
  kvti_ioplan_free(&p);
  kvti_free(b);
}

static void test_odd_sizes(void) {
  /* Odd head extents (not multiples of anything), an odd limit, unaligned
   * header: cuts fall inside extents. */
  chunk_layout("odd.bin", 5, 3, 1000, 2, 1, 777, 4500, 0);
  chunk_layout("odd2.bin", 2, 7, 4097, 5, 4, 64, 1 << 20, 0);
  chunk_layout("tiny.bin", 3, 4, 1, 3, 0, 0, 1, 0); /* one byte each */
  /* Extents of varying length with gaps in the file and zero-length ones. */
  char *m = kvti_aligned_alloc(4096, 1 << 20);
  REQUIRE(m);
  kvti_ioplan_ext ext[8] = {
      {0, m, 3000},
      {3000, m + 5000, 0},       /* skipped */
      {3000, m + 3000, 5000},    /* memory-adjacent: one segment */
      {9000, m + 100000, 70000}, /* gap in the file before it */
      {79000, m + 350001, 1},
      {79001, m + 200000, 123456},
      {300000, m + 400000, 9},
      {300009, m + 500000, 4096 * 3}};
  plan_and_read("gaps.bin", ext, 8, 400000, 65536, 0);
  kvti_ioplan p;
  REQUIRE(kvti_ioplan_build(&p, ext, 8, 3, -1, 1 << 20, 0) == 0);
  /* Three file runs: [0, 8000) as one segment, [9000, 202457), [300000, ..) */
  CHECK_EQ_INT(p.n, 3);
  CHECK(p.reqs[0].iov == NULL && p.reqs[0].len == 8000);
  CHECK_EQ_INT(p.reqs[1].iovcnt, 3);
  CHECK_EQ_INT(p.reqs[2].iovcnt, 2);
  kvti_ioplan_free(&p);
  kvti_free(m);
}

static void test_chunked_files(void) {
  /* A chain of chunk files, each planned on its own: 4 files of one chunk
   * of the same destination (rows blocks 0..3), the way a promote plans. */
  for (unsigned blk = 0; blk < 4; blk++) {
    char name[32];
    snprintf(name, sizeof name, "chain%u.bin", blk);
    chunk_layout(name, 4, 8, 32768, 4, blk, 4096, 1 << 20, 0);
  }
}

static void test_refusals(void) {
  char b[64];
  kvti_ioplan p;
  kvti_ioplan_ext bad_order[2] = {{100, b, 10}, {50, b + 10, 10}};
  CHECK_EQ_INT(kvti_ioplan_build(&p, bad_order, 2, 3, -1, 4096, 0), KVT_EINVAL);
  CHECK(p.reqs == NULL && p.n == 0);
  kvti_ioplan_ext overlap[2] = {{0, b, 20}, {10, b + 20, 10}};
  CHECK_EQ_INT(kvti_ioplan_build(&p, overlap, 2, 3, -1, 4096, 0), KVT_EINVAL);
  kvti_ioplan_ext huge = {(uint64_t)INT64_MAX, b, 2};
  CHECK_EQ_INT(kvti_ioplan_build(&p, &huge, 1, 3, -1, 4096, 0), KVT_EINVAL);
  kvti_ioplan_ext null_buf = {0, NULL, 2};
  CHECK_EQ_INT(kvti_ioplan_build(&p, &null_buf, 1, 3, -1, 4096, 0), KVT_EINVAL);
  kvti_ioplan_ext ok = {0, b, 10};
  CHECK_EQ_INT(kvti_ioplan_build(&p, &ok, 1, 3, -1, 0, 0), KVT_EINVAL);
  CHECK_EQ_INT(kvti_ioplan_build(NULL, &ok, 1, 3, -1, 4096, 0), KVT_EINVAL);
  /* Nothing to read: an empty plan. */
  REQUIRE(kvti_ioplan_build(&p, NULL, 0, 3, -1, 4096, 0) == 0);
  CHECK_EQ_INT(p.n, 0);
  kvti_ioplan_free(&p);
  kvti_ioplan_free(NULL);
}

int main(void) {
  dir = kvt_test_tmpdir("ioplan");
  kvti_iobatch *u = NULL;
  kvti_iob_cfg cfg = KVTI_IOB_CFG_INIT;
  cfg.backend = KVT_IO_URING;
  uring_ok = kvti_iobatch_create(&u, &cfg) == 0;
  kvti_iobatch_free(u);
  if (!uring_ok)
    kvt_test_skip("ioplan", "io_uring unavailable: portable backend only");
  RUN(test_scattered);
  RUN(test_contiguous);
  RUN(test_odd_sizes);
  RUN(test_chunked_files);
  RUN(test_refusals);
  kvt_test_rmtree(dir);
  return kvt_test_done();
}
