/*
 * test_iobatch.c - unit tests for the batched I/O engine on both backends:
 * round trips of aligned and unaligned requests through the O_DIRECT and
 * buffered descriptors (checking which one carried each chunk), short reads at
 * end of file, errors, EINTR/EAGAIN, short transfers and O_DIRECT refusals
 * injected through the io seam (pread/pwrite for the portable backend,
 * uring_result/uring_submit/uring_setup for io_uring), backend selection when
 * io_uring cannot be set up, registered buffers and the engine cache (engines
 * of several depths cached side by side); deferred
 * pushes (many small requests sharing one submission, then submitted
 * explicitly or by a wait, with the data intact). io_uring
 * cases are skipped (not failed) where the ring cannot be created; the whole
 * program exits 77 only if nothing could run.
 */
#include "testutil.h"
#include "base/bufpool.h"
#include "base/error.h"
#include "base/io.h"
#include "engine/iobatch.h"

#include <errno.h>
#include <fcntl.h>
#if defined(__has_include)
#if __has_include(<liburing.h>)
#include <liburing.h> /* the ring's layout, to read the queued SQEs */
#define TEST_URING_H 1
#endif
#endif
#include <stdatomic.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static char *dir;
static int uring_ok;

/* ------------------------------------------------------------ injection */

static kvti_io_ops ops;
static int direct_fd = -1;      /* the O_DIRECT descriptor under test */
static atomic_int direct_calls; /* transfers seen on it */
static atomic_int buffered_calls;
static int fail_at_call = -1; /* transfer index that fails with fail_errno */
static int fail_errno;
static int fail_times = 1;
static int short_transfers; /* halve every transfer (at least 1 byte) */
static atomic_int call_no;
static int einval_direct; /* refuse every O_DIRECT transfer with EINVAL */

static void reset_inject(void) {
  direct_calls = buffered_calls = 0;
  fail_at_call = -1;
  fail_times = 1;
  short_transfers = 0;
  call_no = 0;
  einval_direct = 0;
}

/* Decides the fate of one transfer: returns -errno to inject, or the length to
 * transfer. */
static long decide(int fd, size_t n) {
  int k = call_no++;
  if (fd == direct_fd)
    direct_calls++;
  else
    buffered_calls++;
  if (einval_direct && fd == direct_fd)
    return -EINVAL;
  if (fail_at_call >= 0 && k >= fail_at_call && k < fail_at_call + fail_times)
    return -fail_errno;
  if (short_transfers && n > 1) {
    size_t h = n / 2;
    if (fd == direct_fd)
      h &= ~(size_t)4095;
    if (h > 0)
      n = h;
  }
  return (long)n;
}

static ssize_t inj_pread(int fd, void *buf, size_t n, off_t off) {
  long d = decide(fd, n);
  if (d < 0) {
    errno = (int)-d;
    return -1;
  }
  return pread(fd, buf, (size_t)d, off);
}

/* preadv: the fate is decided for the whole transfer, a short one cuts the
 * segments. */
static ssize_t inj_preadv(int fd, const struct iovec *iov, int cnt, off_t off) {
  size_t total = 0;
  for (int i = 0; i < cnt; i++)
    total += iov[i].iov_len;
  long d = decide(fd, total);
  if (d < 0) {
    errno = (int)-d;
    return -1;
  }
  struct iovec v[KVTI_IOB_MAX_IOV];
  int n = 0;
  size_t left = (size_t)d;
  for (int i = 0; i < cnt && left > 0; i++, n++) {
    v[n] = iov[i];
    if (v[n].iov_len > left)
      v[n].iov_len = left;
    left -= v[n].iov_len;
  }
  return preadv(fd, v, n, off);
}

static ssize_t inj_pwrite(int fd, const void *buf, size_t n, off_t off) {
  long d = decide(fd, n);
  if (d < 0) {
    errno = (int)-d;
    return -1;
  }
  return pwrite(fd, buf, (size_t)d, off);
}

/* io_uring: the transfer already happened in full; a "short" result just
 * reports fewer bytes (the engine re-issues the rest, which rewrites/re-reads
 * the same bytes: harmless). */
static int inj_uring_result(int is_write, int fd, uint64_t off, size_t len,
                            int res) {
  (void)is_write, (void)off;
  if (res < 0)
    return res;
  long d = decide(fd, len);
  if (d < 0)
    return (int)d;
  if (res == 0)
    return 0;
  return (size_t)d < (size_t)res ? (int)d : res;
}

static int setup_errno;
static int inj_uring_setup(unsigned entries, void *ring, unsigned flags) {
  if (setup_errno)
    return -setup_errno;
  return kvti_io_default.uring_setup(entries, ring, flags);
}
static int submit_errno;
static atomic_int submit_calls; /* io_uring_enter calls through the seam */
static int inj_uring_submit(void *ring, unsigned wait_nr) {
  atomic_fetch_add(&submit_calls, 1);
  if (submit_errno)
    return -submit_errno;
  return kvti_io_default.uring_submit(ring, wait_nr);
}

static void install(void) {
  ops = kvti_io_default;
  ops.pread = inj_pread;
  ops.pwrite = inj_pwrite;
  if (ops.preadv)
    ops.preadv = inj_preadv;
  if (ops.uring_result)
    ops.uring_result = inj_uring_result;
  if (ops.uring_setup)
    ops.uring_setup = inj_uring_setup;
  if (ops.uring_submit)
    ops.uring_submit = inj_uring_submit;
  kvti_io_set(&ops);
}

/* ------------------------------------------------------------ helpers */

static kvti_iobatch *engine(int backend, size_t chunk, unsigned threads) {
  kvti_iob_cfg cfg = KVTI_IOB_CFG_INIT;
  cfg.backend = backend;
  cfg.chunk = chunk;
  cfg.threads = threads;
  cfg.depth = 4;
  kvti_iobatch *b = NULL;
  int rc = kvti_iobatch_create(&b, &cfg);
  REQUIRE(rc == 0);
  CHECK_EQ_INT(kvti_iobatch_backend(b), backend);
  return b;
}

static char *path_for(const char *name) {
  static char buf[4096];
  snprintf(buf, sizeof buf, "%s/%s", dir, name);
  return buf;
}

typedef struct fpair {
  int fd, dfd;
} fpair;

static fpair open_pair(const char *name, int create) {
  const char *p = path_for(name);
  int flags = create ? O_RDWR | O_CREAT | O_TRUNC : O_RDWR;
  fpair f;
  f.fd = kvti_open(p, flags, 0600);
  REQUIRE(f.fd >= 0);
  f.dfd = kvti_iob_open_direct(p, O_RDWR, 0600);
  direct_fd = f.dfd;
  return f;
}

static void close_pair(fpair f) {
  close(f.fd);
  if (f.dfd >= 0)
    close(f.dfd);
  direct_fd = -1;
}

/* ------------------------------------------------------------ tests */

/* Layout: three requests; the first aligned (buffer, offset) with an unaligned
 * length, the second an unaligned buffer, the third aligned with a small tail.
 */
static void round_trip(int backend, int with_direct, unsigned threads) {
  reset_inject();
  kvti_iobatch *b = engine(backend, 64 * 1024, threads);
  fpair f = open_pair("rt.bin", 1);
  if (!with_direct && f.dfd >= 0) {
    close(f.dfd);
    f.dfd = -1;
    direct_fd = -1;
  }
  size_t l0 = 5 * 65536 + 4096 * 3 + 100, l1 = 70001, l2 = 4096 * 40 + 7;
  uint64_t o0 = 0, o1 = 1 << 20, o2 = 2 << 20;
  size_t total = l0 + l1 + l2;
  char *src = kvti_aligned_alloc(4096, total + 8192);
  char *dst = kvti_aligned_alloc(4096, total + 8192);
  REQUIRE(src && dst);
  kvt_rng rng = {42u + (unsigned)backend};
  kvt_rng_fill(&rng, src, total + 8192);
  char *s0 = src, *s1 = src + 8192 + 1,
       *s2 = src + 4096 * 100; /* s1 unaligned */
  REQUIRE(s1 + l1 <= s2 && s2 + l2 <= src + total + 8192);
  kvti_iob_req w[3] = {
      {f.fd, f.dfd, 1, s0, l0, o0, 0, 0, 0},
      {f.fd, f.dfd, 1, s1, l1, o1, 0, 0, 0},
      {f.fd, f.dfd, 1, s2, l2, o2, 0, 0, 0},
  };
  CHECK_EQ_INT(kvti_iobatch_run(b, w, 3, 0, "rt.bin"), 0);
  for (int i = 0; i < 3; i++) {
    CHECK_EQ_INT(w[i].status, 0);
    CHECK_EQ_INT(w[i].done, w[i].len);
  }
  if (f.dfd >= 0)
    CHECK(direct_calls > 0);
  else
    CHECK_EQ_INT(direct_calls, 0);
  CHECK(buffered_calls > 0); /* tails and the unaligned request */
  /* The file holds exactly what was written (checked with plain preads). */
  char *chk = malloc(l0 + l1 + l2);
  REQUIRE(chk);
  CHECK(pread(f.fd, chk, l0, (off_t)o0) == (ssize_t)l0 && !memcmp(chk, s0, l0));
  CHECK(pread(f.fd, chk, l1, (off_t)o1) == (ssize_t)l1 && !memcmp(chk, s1, l1));
  CHECK(pread(f.fd, chk, l2, (off_t)o2) == (ssize_t)l2 && !memcmp(chk, s2, l2));
  free(chk);

  /* Read back into different alignments. */
  memset(dst, 0, total + 8192);
  char *d0 = dst, *d1 = dst + 8192 + 1, *d2 = dst + 4096 * 100;
  kvti_iob_req r[3] = {
      {f.fd, f.dfd, 0, d0, l0, o0, 0, 0, 0},
      {f.fd, f.dfd, 0, d1, l1, o1, 0, 0, 0},
      {f.fd, f.dfd, 0, d2, l2, o2, 0, 0, 0},
  };
  reset_inject();
  CHECK_EQ_INT(kvti_iobatch_run(b, r, 3, 0, "rt.bin"), 0);
  CHECK(!memcmp(d0, s0, l0));
  CHECK(!memcmp(d1, s1, l1));
  CHECK(!memcmp(d2, s2, l2));
  if (f.dfd >= 0)
    CHECK(direct_calls > 0);
  /* NO_DIRECT keeps everything in the page cache path. */
  reset_inject();
  memset(dst, 0, total);
  CHECK_EQ_INT(kvti_iobatch_run(b, r, 3, KVTI_IOB_NO_DIRECT, NULL), 0);
  CHECK_EQ_INT(direct_calls, 0);
  CHECK(!memcmp(d0, s0, l0) && !memcmp(d1, s1, l1) && !memcmp(d2, s2, l2));
  /* An empty batch and zero-length requests are fine. */
  CHECK_EQ_INT(kvti_iobatch_run(b, NULL, 0, 0, NULL), 0);
  kvti_iob_req z = {f.fd, f.dfd, 0, NULL, 0, 0, 0, 0, 0};
  CHECK_EQ_INT(kvti_iobatch_run(b, &z, 1, 0, NULL), 0);
  close_pair(f);
  kvti_free(src);
  kvti_free(dst);
  kvti_iobatch_free(b);
}

static void test_round_trips(void) {
  install();
  for (int d = 0; d <= 1; d++) {
    round_trip(KVT_IO_PORTABLE, d, 1);
    round_trip(KVT_IO_PORTABLE, d, 3);
    if (uring_ok)
      round_trip(KVT_IO_URING, d, 1);
  }
  kvti_io_set(NULL);
}

static void short_reads(int backend) {
  reset_inject();
  kvti_iobatch *b = engine(backend, 8192, 2);
  fpair f = open_pair("short.bin", 1);
  char *buf = kvti_aligned_alloc(4096, 65536);
  REQUIRE(buf);
  kvt_rng rng = {7};
  kvt_rng_fill(&rng, buf, 65536);
  CHECK(pwrite(f.fd, buf, 10000, 0) == 10000);
  char *rd = kvti_aligned_alloc(4096, 65536);
  REQUIRE(rd);
  /* Aligned read past EOF: an error without ALLOW_SHORT ... */
  kvti_iob_req r = {f.fd, f.dfd, 0, rd, 16384, 0, 0, 0, 0};
  CHECK_EQ_INT(kvti_iobatch_run(b, &r, 1, 0, "short.bin"), KVT_ECORRUPT);
  CHECK_EQ_INT(r.status, KVT_ECORRUPT);
  CHECK(strstr(kvt_last_error(), "truncated") != NULL);
  CHECK(strstr(kvt_last_error(), "short.bin") != NULL);
  /* ... and done == file size with it, whatever the chunking. */
  memset(rd, 0, 65536);
  CHECK_EQ_INT(kvti_iobatch_run(b, &r, 1, KVTI_IOB_ALLOW_SHORT, NULL), 0);
  CHECK_EQ_INT(r.done, 10000);
  CHECK(!memcmp(rd, buf, 10000));
  /* Entirely past EOF. */
  kvti_iob_req past = {f.fd, f.dfd, 0, rd, 8192, 20480, 0, 0, 0};
  CHECK_EQ_INT(kvti_iobatch_run(b, &past, 1, KVTI_IOB_ALLOW_SHORT, NULL), 0);
  CHECK_EQ_INT(past.done, 0);
  /* Unaligned start ending past EOF. */
  kvti_iob_req un = {f.fd, f.dfd, 0, rd + 1, 9000, 3001, 0, 0, 0};
  CHECK_EQ_INT(kvti_iobatch_run(b, &un, 1, KVTI_IOB_ALLOW_SHORT, NULL), 0);
  CHECK_EQ_INT(un.done, 10000 - 3001);
  CHECK(!memcmp(rd + 1, buf + 3001, 10000 - 3001));
  /* Short transfers everywhere (not at EOF) still complete exactly. */
  reset_inject();
  short_transfers = 1;
  memset(rd, 0, 65536);
  kvti_iob_req full = {f.fd, f.dfd, 0, rd, 10000, 0, 0, 0, 0};
  CHECK_EQ_INT(kvti_iobatch_run(b, &full, 1, 0, NULL), 0);
  CHECK(!memcmp(rd, buf, 10000));
  CHECK(call_no > 2);
  reset_inject();
  close_pair(f);
  kvti_free(buf);
  kvti_free(rd);
  kvti_iobatch_free(b);
}

static void test_short_reads(void) {
  install();
  short_reads(KVT_IO_PORTABLE);
  if (uring_ok)
    short_reads(KVT_IO_URING);
  kvti_io_set(NULL);
}

static void injected_errors(int backend, unsigned threads) {
  kvti_iobatch *b = engine(backend, 16384, threads);
  fpair f = open_pair("err.bin", 1);
  size_t len = 6u << 20; /* big enough for the threaded portable path */
  char *buf = kvti_aligned_alloc(4096, len);
  char *rd = kvti_aligned_alloc(4096, len);
  REQUIRE(buf && rd);
  kvt_rng rng = {99};
  kvt_rng_fill(&rng, buf, len);
  kvti_iob_req w = {f.fd, f.dfd, 1, buf, len, 0, 0, 0, 0};

  /* A write error (ENOSPC) mid-batch: the code maps, the request says so, errno
   * is kept. */
  reset_inject();
  fail_at_call = 5;
  fail_errno = ENOSPC;
  CHECK_EQ_INT(kvti_iobatch_run(b, &w, 1, 0, "err.bin"), KVT_ENOSPC);
  CHECK_EQ_INT(w.status, KVT_ENOSPC);
  CHECK_EQ_INT(kvt_last_errno(), ENOSPC);
  CHECK(strstr(kvt_last_error(), "write err.bin") != NULL);

  /* EINTR and EAGAIN are retried. */
  reset_inject();
  fail_at_call = 3;
  fail_times = 3;
  fail_errno = EINTR;
  CHECK_EQ_INT(kvti_iobatch_run(b, &w, 1, 0, NULL), 0);
  reset_inject();
  fail_at_call = 1;
  fail_errno = EAGAIN;
  CHECK_EQ_INT(kvti_iobatch_run(b, &w, 1, 0, NULL), 0);

  /* A read error (EIO). */
  kvti_iob_req r = {f.fd, f.dfd, 0, rd, len, 0, 0, 0, 0};
  reset_inject();
  fail_at_call = 7;
  fail_errno = EIO;
  CHECK_EQ_INT(kvti_iobatch_run(b, &r, 1, 0, "err.bin"), KVT_EIO);
  CHECK_EQ_INT(r.status, KVT_EIO);
  CHECK_EQ_INT(kvt_last_errno(), EIO);
  CHECK(strstr(kvt_last_error(), "read err.bin at offset") != NULL);

  /* O_DIRECT refused with EINVAL: falls back to buffered, data intact. */
  reset_inject();
  einval_direct = 1;
  memset(rd, 0, len);
  CHECK_EQ_INT(kvti_iobatch_run(b, &r, 1, 0, NULL), 0);
  CHECK(!memcmp(rd, buf, len));
  if (f.dfd >= 0)
    CHECK(buffered_calls > 0 && direct_calls > 0);

  /* Short transfers while writing, then a clean read: exact content. */
  reset_inject();
  short_transfers = 1;
  CHECK_EQ_INT(kvti_iobatch_run(b, &w, 1, 0, NULL), 0);
  reset_inject();
  memset(rd, 0, len);
  CHECK_EQ_INT(kvti_iobatch_run(b, &r, 1, 0, NULL), 0);
  CHECK(!memcmp(rd, buf, len));

  /* The engine is still usable after failures. */
  reset_inject();
  fail_at_call = 0;
  fail_errno = EIO;
  CHECK_EQ_INT(kvti_iobatch_run(b, &r, 1, 0, NULL), KVT_EIO);
  reset_inject();
  CHECK_EQ_INT(kvti_iobatch_run(b, &r, 1, 0, NULL), 0);
  close_pair(f);
  kvti_free(buf);
  kvti_free(rd);
  kvti_iobatch_free(b);
}

/* Vectored reads: one file range scattered over segments - aligned 64 KiB
 * pieces at a stride (O_DIRECT), an unaligned piece, a zero-length segment,
 * 300 small pieces (more than a chunk may carry), a tail - read whole, under
 * short transfers, and failing with EIO mid-request. no_preadv: the portable
 * backend without the seam's preadv (one pread per segment). */
static void vectored(int backend, int no_preadv) {
  reset_inject();
  const kvti_io_ops *saved = kvti_io;
  static kvti_io_ops np;
  if (no_preadv) {
    np = *kvti_io;
    np.preadv = NULL;
    kvti_io_set(&np);
  }
  kvti_iobatch *b = engine(backend, 256 * 1024, 2);
  fpair f = open_pair("vec.bin", 1);
  enum { NSEG = 20 + 1 + 1 + 300 + 1 };
  struct iovec iov[NSEG];
  size_t mem = 64u << 20;
  char *dst = kvti_aligned_alloc(4096, mem);
  REQUIRE(dst);
  unsigned k = 0;
  size_t at = 0;
  for (int i = 0; i < 20; i++) /* head extents at a stride of 128 KiB */
    iov[k++] = (struct iovec){dst + (size_t)i * 131072, 65536};
  at = 20 * 131072;
  iov[k++] = (struct iovec){dst + at + 1, 1000}; /* unaligned */
  at += 8192;
  iov[k++] = (struct iovec){dst + at, 0};
  for (int i = 0; i < 300; i++)
    iov[k++] = (struct iovec){dst + at + (size_t)i * 1024, 512};
  at += 300 * 1024;
  iov[k++] = (struct iovec){dst + at, 12345}; /* the tail */
  REQUIRE(k == NSEG);
  size_t len = 0;
  for (unsigned i = 0; i < k; i++)
    len += iov[i].iov_len;
  char *src = kvti_aligned_alloc(4096, len);
  REQUIRE(src);
  kvt_rng rng = {77u + (unsigned)backend};
  kvt_rng_fill(&rng, src, len);
  CHECK(pwrite(f.fd, src, len, 0) == (ssize_t)len);
  CHECK(fsync(f.fd) == 0);
  kvti_iob_req r = {f.fd, f.dfd, 0, NULL, len, 0, 0, 0, 0};
  r.iov = iov;
  r.iovcnt = k;
  for (int round = 0; round < 2; round++) { /* clean, then short transfers */
    reset_inject();
    short_transfers = round;
    memset(dst, 0, at + 12345);
    CHECK_EQ_INT(kvti_iobatch_run(b, &r, 1, 0, "vec.bin"), 0);
    CHECK_EQ_INT(r.done, len);
    size_t pos = 0, bad = 0;
    for (unsigned i = 0; i < k; i++) {
      if (memcmp(iov[i].iov_base, src + pos, iov[i].iov_len))
        bad++;
      pos += iov[i].iov_len;
    }
    CHECK_EQ_INT(bad, 0);
    if (f.dfd >= 0)
      CHECK(direct_calls > 0); /* the aligned head extents */
    CHECK(buffered_calls > 0); /* the unaligned and small pieces */
  }
  /* Pushed too (the path of a chunked promote). */
  reset_inject();
  memset(dst, 0, at + 12345);
  CHECK_EQ_INT(kvti_iobatch_push(b, &r, KVTI_IOB_DEFER, "vec.bin"), 0);
  CHECK_EQ_INT(kvti_iobatch_wait_req(b, &r), 0);
  CHECK_EQ_INT(kvti_iobatch_wait_all(b), 0);
  CHECK(!memcmp(iov[0].iov_base, src, 65536));
  CHECK(!memcmp(iov[NSEG - 1].iov_base, src + len - 12345, 12345));
  /* EIO in the middle of the request: it fails, naming file and offset. */
  reset_inject();
  fail_at_call = 3;
  fail_errno = EIO;
  CHECK_EQ_INT(kvti_iobatch_run(b, &r, 1, 0, "vec.bin"), KVT_EIO);
  CHECK_EQ_INT(r.status, KVT_EIO);
  CHECK(strstr(kvt_last_error(), "read vec.bin at offset") != NULL);
  /* A file shorter than the segments: truncated. */
  reset_inject();
  CHECK(ftruncate(f.fd, (off_t)(len - 100)) == 0);
  CHECK_EQ_INT(kvti_iobatch_run(b, &r, 1, 0, "vec.bin"), KVT_ECORRUPT);
  CHECK(strstr(kvt_last_error(), "truncated") != NULL);
  /* Segments not summing to len, or a vectored write: invalid. */
  r.len = len + 1;
  CHECK_EQ_INT(kvti_iobatch_run(b, &r, 1, 0, NULL), KVT_EINVAL);
  r.len = len;
  r.write = 1;
  CHECK_EQ_INT(kvti_iobatch_run(b, &r, 1, 0, NULL), KVT_EINVAL);
  close_pair(f);
  kvti_free(src);
  kvti_free(dst);
  kvti_iobatch_free(b);
  kvti_io_set(saved);
}

static void test_vectored(void) {
  install();
  vectored(KVT_IO_PORTABLE, 0);
  vectored(KVT_IO_PORTABLE, 1);
  if (uring_ok)
    vectored(KVT_IO_URING, 0);
  kvti_io_set(NULL);
}

static void test_injected_errors(void) {
  install();
  injected_errors(KVT_IO_PORTABLE, 1);
  injected_errors(KVT_IO_PORTABLE, 3);
  if (uring_ok)
    injected_errors(KVT_IO_URING, 1);
  kvti_io_set(NULL);
}

static void test_backend_selection(void) {
  install();
  /* Only the io_uring hooks replaced: AUTO may use io_uring. */
  kvti_io_ops only_uring = ops;
  only_uring.pread = kvti_io_default.pread;
  only_uring.pwrite = kvti_io_default.pwrite;
  kvti_io_set(&only_uring);
  kvti_iobatch_cache_drain();
  int errs[2] = {ENOSYS, EPERM};
  for (int i = 0; i < 2; i++) {
    setup_errno = errs[i];
    kvti_iob_cfg cfg = KVTI_IOB_CFG_INIT;
    kvti_iobatch *b = NULL;
    cfg.backend = KVT_IO_AUTO;
    CHECK_EQ_INT(kvti_iobatch_create(&b, &cfg), 0);
    CHECK_EQ_INT(kvti_iobatch_backend(b), KVT_IO_PORTABLE);
    kvti_iobatch_free(b);
    b = NULL;
    cfg.backend = KVT_IO_URING;
    CHECK_EQ_INT(kvti_iobatch_create(&b, &cfg), KVT_EUNSUPPORTED);
    CHECK(b == NULL);
    CHECK(strstr(kvt_last_error(), "io_uring") != NULL);
  }
  setup_errno = 0;
  kvti_iob_cfg cfg = KVTI_IOB_CFG_INIT;
  kvti_iobatch *b = NULL;
  cfg.backend = 7;
  CHECK_EQ_INT(kvti_iobatch_create(&b, &cfg), KVT_EINVAL);
  cfg.backend = KVT_IO_AUTO;
  /* With pread/pwrite replaced, AUTO routes through them (portable) ... */
  kvti_io_set(&ops);
  CHECK_EQ_INT(kvti_iobatch_create(&b, &cfg), 0);
  CHECK_EQ_INT(kvti_iobatch_backend(b), KVT_IO_PORTABLE);
  kvti_iobatch_free(b);
  kvti_iobatch *cached = NULL;
  CHECK_EQ_INT(kvti_iobatch_get(&cached, KVT_IO_AUTO), 0);
  CHECK_EQ_INT(kvti_iobatch_backend(cached), KVT_IO_PORTABLE);
  kvti_iobatch_put(cached);
  /* ... else io_uring when it works. */
  kvti_io_set(&only_uring);
  CHECK_EQ_INT(kvti_iobatch_create(&b, &cfg), 0);
  CHECK_EQ_INT(kvti_iobatch_backend(b),
               uring_ok ? KVT_IO_URING : KVT_IO_PORTABLE);
  /* Registration is best effort and only for io_uring. */
  char *reg = kvti_aligned_alloc(4096, 65536);
  REQUIRE(reg);
  int rc = kvti_iobatch_register(b, reg, 65536);
  CHECK(rc == 0 || rc == KVT_EUNSUPPORTED);
  if (!uring_ok)
    CHECK_EQ_INT(rc, KVT_EUNSUPPORTED);
  /* Fixed-buffer I/O round trip when registered (and plain I/O either way). */
  fpair f = open_pair("reg.bin", 1);
  kvt_rng rng = {5};
  kvt_rng_fill(&rng, reg, 65536);
  kvti_iob_req w = {f.fd, f.dfd, 1, reg, 65536, 0, 0, 0, 0};
  CHECK_EQ_INT(kvti_iobatch_run(b, &w, 1, 0, NULL), 0);
  char *cp = malloc(65536);
  REQUIRE(cp);
  memcpy(cp, reg, 65536);
  memset(reg, 0, 65536);
  kvti_iob_req r = {f.fd, f.dfd, 0, reg, 65536, 0, 0, 0, 0};
  CHECK_EQ_INT(kvti_iobatch_run(b, &r, 1, 0, NULL), 0);
  CHECK(!memcmp(cp, reg, 65536));
  kvti_iobatch_unregister(b);
  kvti_iobatch_free(b);
  free(cp);
  kvti_free(reg);
  /* Invalid requests. */
  CHECK_EQ_INT(kvti_iobatch_create(&b, NULL), 0);
  char small[16];
  kvti_iob_req bad = {-1, -1, 0, small, 10, 0, 0, 0, 0};
  CHECK_EQ_INT(kvti_iobatch_run(b, &bad, 1, 0, NULL), KVT_EINVAL);
  kvti_iob_req nobuf = {f.fd, -1, 0, NULL, 10, 0, 0, 0, 0};
  CHECK_EQ_INT(kvti_iobatch_run(b, &nobuf, 1, 0, NULL), KVT_EINVAL);
  kvti_iobatch_free(b);
  close_pair(f);
  kvti_io_set(NULL);
}

/* A failing io_uring_submit_and_wait leaves the engine broken: the batch fails,
 * later runs refuse, and put() frees it rather than caching it. */
static void test_submit_failure(void) {
  if (!uring_ok)
    return;
  install();
  reset_inject();
  kvti_iobatch_cache_drain();
  kvti_iobatch *b = NULL;
  CHECK_EQ_INT(kvti_iobatch_get(&b, KVT_IO_URING), 0);
  fpair f = open_pair("sub.bin", 1);
  char *buf = kvti_aligned_alloc(4096, 1 << 20);
  REQUIRE(buf);
  memset(buf, 'x', 1 << 20);
  kvti_iob_req w = {f.fd, f.dfd, 1, buf, 1 << 20, 0, 0, 0, 0};
  submit_errno = ENOMEM;
  CHECK_EQ_INT(kvti_iobatch_run(b, &w, 1, 0, NULL), KVT_ENOMEM);
  submit_errno = 0;
  CHECK_EQ_INT(kvti_iobatch_run(b, &w, 1, 0, NULL), KVT_EIO);
  kvti_iobatch_put(b);
  kvti_iobatch *b2 = NULL;
  CHECK_EQ_INT(kvti_iobatch_get(&b2, KVT_IO_URING), 0);
  CHECK_EQ_INT(kvti_iobatch_run(b2, &w, 1, 0, NULL), 0);
  kvti_iobatch_put(b2);
  kvti_iobatch *b3 = NULL;
  CHECK_EQ_INT(kvti_iobatch_get(&b3, KVT_IO_URING), 0);
  CHECK(b3 == b2); /* a healthy engine is reused */
  kvti_iobatch_put(b3);
  kvti_iobatch_cache_drain();
  close_pair(f);
  kvti_free(buf);
  kvti_io_set(NULL);
}

/* Pipelined pushes: a rotation of 3 buffers refilled after wait_req, then a
 * read-back; then a failure in the middle of a push sequence. */
static void pushes(int backend) {
  reset_inject();
  kvti_iobatch *b = engine(backend, 65536, 1);
  fpair f = open_pair("push.bin", 1);
  enum { NB = 3, BS = 200 * 1024, NPUSH = 20 };
  char *bufs[NB];
  kvti_iob_req reqs[NB];
  int busy[NB] = {0};
  for (int i = 0; i < NB; i++)
    REQUIRE((bufs[i] = kvti_aligned_alloc(4096, BS)) != NULL);
  for (int p = 0; p < NPUSH; p++) {
    int k = p % NB;
    if (busy[k])
      CHECK_EQ_INT(kvti_iobatch_wait_req(b, &reqs[k]), 0);
    memset(bufs[k], 'a' + p, BS);
    reqs[k] = (kvti_iob_req){
        f.fd, f.dfd, 1, bufs[k], BS, (uint64_t)p * BS, 0, 0, 0, 0, 0, 0, NULL};
    CHECK_EQ_INT(kvti_iobatch_push(b, &reqs[k], 0, "push.bin"), 0);
    busy[k] = 1;
  }
  CHECK_EQ_INT(kvti_iobatch_wait_all(b), 0);
  for (int k = 0; k < NB; k++)
    CHECK_EQ_INT(reqs[k].done, BS);
  char *rd = kvti_aligned_alloc(4096, BS);
  REQUIRE(rd);
  for (int p = 0; p < NPUSH; p++) {
    kvti_iob_req r = {f.fd, f.dfd, 0, rd, BS,  (uint64_t)p * BS, 0, 0,
                      0,    0,     0, 0,  NULL};
    CHECK_EQ_INT(kvti_iobatch_run(b, &r, 1, 0, NULL), 0);
    CHECK(rd[0] == 'a' + p && rd[BS - 1] == 'a' + p);
  }
  /* A failure: the failing push or a later one reports it; wait_all returns it
   * once. */
  reset_inject();
  fail_at_call = 2;
  fail_errno = EIO;
  int first = 0;
  for (int p = 0; p < 3; p++) {
    reqs[p] = (kvti_iob_req){
        f.fd, f.dfd, 1, bufs[p], BS, (uint64_t)p * BS, 0, 0, 0, 0, 0, 0, NULL};
    int rc = kvti_iobatch_push(b, &reqs[p], 0, "push.bin");
    if (rc && !first)
      first = rc;
  }
  CHECK_EQ_INT(kvti_iobatch_wait_all(b), KVT_EIO);
  CHECK(first == 0 || first == KVT_EIO);
  CHECK(reqs[0].status == KVT_EIO || reqs[1].status == KVT_EIO ||
        reqs[2].status == KVT_EIO);
  reset_inject();
  CHECK_EQ_INT(kvti_iobatch_wait_all(b), 0); /* forgotten */
  kvti_iob_req ok = {f.fd, f.dfd, 1, bufs[0], BS, 0, 0, 0, 0, 0, 0, 0, NULL};
  CHECK_EQ_INT(kvti_iobatch_push(b, &ok, 0, NULL), 0);
  CHECK_EQ_INT(kvti_iobatch_wait_req(b, &ok), 0);
  CHECK_EQ_INT(ok.done, BS);
  CHECK_EQ_INT(kvti_iobatch_push(b, NULL, 0, NULL), KVT_EINVAL);
  for (int i = 0; i < NB; i++)
    kvti_free(bufs[i]);
  kvti_free(rd);
  close_pair(f);
  kvti_iobatch_free(b);
}

/* KVTI_IOB_DEFER: N reads of 64 KiB into scattered places (as a chunked
 * promote reads head extents), queued without a system call and handed over
 * by one kvti_iobatch_submit, every byte where it belongs; then more
 * deferred pushes than the engine's depth (slot pressure submits them), and
 * a few completed by a wait alone. */
static void deferred(int backend) {
  reset_inject();
  enum { N = 48, X = 65536, DEPTH = 64 };
  kvti_iob_cfg cfg = KVTI_IOB_CFG_INIT;
  cfg.backend = backend;
  cfg.depth = DEPTH;
  kvti_iobatch *b = NULL;
  REQUIRE(kvti_iobatch_create(&b, &cfg) == 0);
  fpair f = open_pair("defer.bin", 1);
  size_t total = (size_t)3 * N * X;
  char *src = kvti_aligned_alloc(4096, total);
  char *dst = kvti_aligned_alloc(4096, total * 2);
  REQUIRE(src && dst);
  kvt_rng rng = {77};
  kvt_rng_fill(&rng, src, total);
  kvti_iob_req w = {f.fd, f.dfd, 1, src, total, 0, 0, 0, 0};
  CHECK_EQ_INT(kvti_iobatch_run(b, &w, 1, 0, NULL), 0);
  memset(dst, 0, total * 2);
  kvti_iob_req r[3 * N];
  atomic_store(&submit_calls, 0);
  for (int i = 0; i < N; i++) {
    /* extent i of the file goes to slot 2i of dst (every other 64 KiB) */
    r[i] = (kvti_iob_req){f.fd, f.dfd,
                          0,    dst + (size_t)2 * i * X,
                          X,    (uint64_t)i * X,
                          0,    0,
                          0,    0,
                          0,    0,
                          NULL};
    CHECK_EQ_INT(kvti_iobatch_push(b, &r[i], KVTI_IOB_DEFER, "defer.bin"), 0);
  }
  if (backend == KVT_IO_URING)
    CHECK_EQ_INT(atomic_load(&submit_calls), 0); /* all still queued */
  CHECK_EQ_INT(kvti_iobatch_submit(b), 0);
  if (backend == KVT_IO_URING)
    CHECK_EQ_INT(atomic_load(&submit_calls), 1); /* one for all 48 */
  for (int i = 0; i < N; i++)
    CHECK_EQ_INT(kvti_iobatch_wait_req(b, &r[i]), 0);
  int ok = 1;
  for (int i = 0; i < N; i++)
    ok &= r[i].done == X &&
          memcmp(dst + (size_t)2 * i * X, src + (size_t)i * X, X) == 0 &&
          dst[(size_t)(2 * i + 1) * X] == 0;
  CHECK(ok);
  /* More than the depth: the pushes submit when every slot is busy. */
  memset(dst, 0, total);
  for (int i = 0; i < 3 * N; i++) {
    r[i] = (kvti_iob_req){
        f.fd, f.dfd, 0,   dst + (size_t)i * X, X, (uint64_t)i * X, 0, 0, 0, 0,
        0,    0,     NULL};
    CHECK_EQ_INT(kvti_iobatch_push(b, &r[i], KVTI_IOB_DEFER, "defer.bin"), 0);
  }
  CHECK_EQ_INT(kvti_iobatch_wait_all(b), 0);
  CHECK(memcmp(dst, src, total) == 0);
  /* A few, completed by waiting for the last one (a wait submits). */
  memset(dst, 0, total);
  for (int i = 0; i < 12; i++) {
    r[i] = (kvti_iob_req){
        f.fd, f.dfd, 0,   dst + (size_t)i * X, X, (uint64_t)i * X, 0, 0, 0, 0,
        0,    0,     NULL};
    CHECK_EQ_INT(kvti_iobatch_push(b, &r[i], KVTI_IOB_DEFER, "defer.bin"), 0);
  }
  CHECK_EQ_INT(kvti_iobatch_wait_req(b, &r[11]), 0);
  CHECK_EQ_INT(kvti_iobatch_wait_all(b), 0);
  CHECK(memcmp(dst, src, (size_t)12 * X) == 0);
  kvti_free(src);
  kvti_free(dst);
  close_pair(f);
  kvti_iobatch_free(b);
}

/* The engine cache holds engines of several configurations and hands back
 * one of the asked configuration: a deep promote engine is reused, never
 * given to a default-depth caller, and the default one never to it. */
static void test_cache_cfg(void) {
  kvti_iobatch_cache_drain();
  int backends[2] = {KVT_IO_PORTABLE, KVT_IO_URING};
  for (int bi = 0; bi < 2; bi++) {
    if (backends[bi] == KVT_IO_URING && !uring_ok)
      continue;
    kvti_iob_cfg deep = KVTI_IOB_CFG_INIT;
    deep.backend = backends[bi];
    deep.depth = 128;
    kvti_iobatch *d1 = NULL, *d2 = NULL, *n1 = NULL, *n2 = NULL, *o1 = NULL;
    REQUIRE(kvti_iobatch_get_cfg(&d1, &deep) == 0);
    REQUIRE(kvti_iobatch_get(&n1, backends[bi]) == 0);
    CHECK(d1 != n1);
    kvti_iobatch_put(d1);
    kvti_iobatch_put(n1);
    REQUIRE(kvti_iobatch_get(&n2, backends[bi]) == 0);
    CHECK(n2 == n1); /* the default engine, not the deep one */
    REQUIRE(kvti_iobatch_get_cfg(&d2, &deep) == 0);
    CHECK(d2 == d1); /* the deep one, reused */
    kvti_iob_cfg other = deep;
    other.depth = 16;
    REQUIRE(kvti_iobatch_get_cfg(&o1, &other) == 0);
    CHECK(o1 != d1 && o1 != n1); /* nothing cached of that depth */
    CHECK_EQ_INT(kvti_iobatch_backend(o1), backends[bi]);
    kvti_iobatch_put(o1);
    kvti_iobatch_put(d2);
    kvti_iobatch_put(n2);
    CHECK_EQ_INT(kvti_iobatch_get_cfg(&d1, NULL), 0); /* NULL: the defaults */
    kvti_iobatch_put(d1);
  }
  kvti_iobatch_cache_drain();
}

static void test_deferred(void) {
  install();
  deferred(KVT_IO_PORTABLE);
  if (uring_ok)
    deferred(KVT_IO_URING);
  kvti_io_set(NULL);
}

static void test_push(void) {
  install();
  pushes(KVT_IO_PORTABLE);
  if (uring_ok)
    pushes(KVT_IO_URING);
  kvti_io_set(NULL);
}

/* A process forked after engines were cached must not use them (the ring's
 * memory would be shared with the parent): the child gets fresh engines, and
 * both sides keep working. */
static void test_fork(void) {
  kvti_iobatch_cache_drain();
  kvti_iobatch *b = NULL;
  REQUIRE(kvti_iobatch_get(&b, KVT_IO_AUTO) == 0);
  kvti_iobatch *parent_engine = b;
  kvti_iobatch_put(b);
  fpair f = open_pair("fork.bin", 1);
  char *buf = kvti_aligned_alloc(4096, 1 << 20);
  REQUIRE(buf);
  memset(buf, 'p', 1 << 20);
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    kvti_iobatch *c = NULL;
    /* (the new engine may well reuse the freed copy's address: not checked) */
    int bad = kvti_iobatch_get(&c, KVT_IO_AUTO) != 0;
    memset(buf, 'c', 1 << 20);
    kvti_iob_req w = {f.fd, f.dfd, 1, buf, 1 << 20, 1 << 20, 0, 0, 0};
    bad |= kvti_iobatch_run(c, &w, 1, 0, NULL) != 0;
    kvti_iobatch_put(c);
    _exit(bad ? 1 : 0);
  }
  kvti_iob_req w = {f.fd, f.dfd, 1, buf, 1 << 20, 0, 0, 0, 0};
  REQUIRE(kvti_iobatch_get(&b, KVT_IO_AUTO) == 0);
  CHECK(b == parent_engine); /* the parent keeps its own */
  CHECK_EQ_INT(kvti_iobatch_run(b, &w, 1, 0, NULL), 0);
  kvti_iobatch_put(b);
  int st = 0;
  REQUIRE(waitpid(pid, &st, 0) == pid);
  CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  char *rd = kvti_aligned_alloc(4096, 2 << 20);
  REQUIRE(rd);
  CHECK(pread(f.fd, rd, 2 << 20, 0) == (ssize_t)(2 << 20));
  CHECK(rd[0] == 'p' && rd[(1 << 20) - 1] == 'p');
  CHECK(rd[1 << 20] == 'c' && rd[(2 << 20) - 1] == 'c');
  kvti_free(rd);
  kvti_free(buf);
  close_pair(f);
  kvti_iobatch_cache_drain();
}

/* Buffered reads through io_uring go to the kernel's workers (IOSQE_ASYNC)
 * where the ring says the kernel takes the flag, so reads of cached pages
 * copy in parallel; O_DIRECT reads never do. Seen from the submit seam: the
 * SQEs queued since the last submit are between the ring's sqe_head and
 * sqe_tail. */
#if TEST_URING_H
static int scan_fd = -1, scan_dfd = -1;
static int sqe_buffered, sqe_buffered_async, sqe_direct, sqe_direct_async;
static unsigned ring_features;
static int scan_submit(void *ring_, unsigned wait_nr) {
  struct io_uring *ring = ring_;
  ring_features = ring->features;
  for (unsigned i = ring->sq.sqe_head; i != ring->sq.sqe_tail; i++) {
    const struct io_uring_sqe *s = &ring->sq.sqes[i & ring->sq.ring_mask];
    int rd = s->opcode == IORING_OP_READ || s->opcode == IORING_OP_READV ||
             s->opcode == IORING_OP_READ_FIXED;
    int async = (s->flags & IOSQE_ASYNC) != 0;
    if (rd && s->fd == scan_fd)
      sqe_buffered++, sqe_buffered_async += async;
    else if (rd && s->fd == scan_dfd)
      sqe_direct++, sqe_direct_async += async;
  }
  return kvti_io_default.uring_submit(ring_, wait_nr);
}
#endif

static void test_async_buffered(void) {
#if TEST_URING_H
  if (!uring_ok)
    return; /* skipped once for every io_uring case (main) */
  ops = kvti_io_default;
  ops.uring_submit = scan_submit;
  kvti_io_set(&ops);
  kvti_iobatch *b = engine(KVT_IO_URING, 65536, 1);
  fpair f = open_pair("async.bin", 1);
  size_t n = 262144;
  char *buf = kvti_aligned_alloc(4096, n), *rd = kvti_aligned_alloc(4096, n);
  REQUIRE(buf && rd);
  kvt_rng rng = {11};
  kvt_rng_fill(&rng, buf, n);
  CHECK(pwrite(f.fd, buf, n, 0) == (ssize_t)n);
  scan_fd = f.fd;
  scan_dfd = f.dfd;
  /* Buffered (no O_DIRECT descriptor), then direct where the file system
   * takes it. */
  kvti_iob_req r = {f.fd, -1, 0, rd, n, 0, 0, 0, 0};
  CHECK_EQ_INT(kvti_iobatch_run(b, &r, 1, 0, "async.bin"), 0);
  CHECK(!memcmp(rd, buf, n));
  if (f.dfd >= 0) {
    CHECK(fsync(f.fd) == 0);
    memset(rd, 0, n);
    kvti_iob_req d = {f.fd, f.dfd, 0, rd, n, 0, 0, 0, 0};
    CHECK_EQ_INT(kvti_iobatch_run(b, &d, 1, 0, "async.bin"), 0);
    CHECK(!memcmp(rd, buf, n));
    CHECK(sqe_direct >= 4);
    CHECK_EQ_INT(sqe_direct_async, 0);
  }
  CHECK(sqe_buffered >= 4); /* 256 KiB in 64 KiB chunks */
  if (ring_features & IORING_FEAT_FAST_POLL)
    CHECK_EQ_INT(sqe_buffered_async, sqe_buffered);
  else
    CHECK_EQ_INT(sqe_buffered_async, 0);
  scan_fd = scan_dfd = -1;
  close_pair(f);
  kvti_free(buf);
  kvti_free(rd);
  kvti_iobatch_free(b);
  kvti_io_set(NULL);
#else
  kvt_test_skip("uring", "async buffered reads: no liburing.h to read the "
                         "ring's queued SQEs with");
#endif
}

static void test_helpers(void) {
  fpair f = open_pair("adv.bin", 1);
  CHECK_EQ_INT(kvti_iob_preallocate(f.fd, 1 << 20), 0);
  struct stat st;
  /* The portable build has no posix_fallocate hook: preallocation is a
   * successful no-op there. */
  off_t want = kvti_io_default.fallocate ? 1 << 20 : 0;
  CHECK(fstat(f.fd, &st) == 0 && st.st_size == want);
  CHECK_EQ_INT(kvti_iob_drop_cache(f.fd), 0);
  CHECK_EQ_INT(kvti_iob_preallocate(f.fd, 0), 0);
  close_pair(f);
}

int main(void) {
  dir = kvt_test_tmpdir("iobatch");
  REQUIRE(dir);
  kvti_iob_cfg cfg = KVTI_IOB_CFG_INIT;
  cfg.backend = KVT_IO_URING;
  kvti_iobatch *b = NULL;
  uring_ok = kvti_iobatch_create(&b, &cfg) == 0;
  kvti_iobatch_free(b);
  if (!uring_ok)
    kvt_test_skip("uring", "io_uring unavailable (%s): its cases",
                  kvt_last_error());
  RUN(test_round_trips);
  RUN(test_short_reads);
  RUN(test_vectored);
  RUN(test_injected_errors);
  RUN(test_backend_selection);
  RUN(test_submit_failure);
  RUN(test_push);
  RUN(test_deferred);
  RUN(test_cache_cfg);
  RUN(test_fork);
  RUN(test_helpers);
  RUN(test_async_buffered);
  kvti_iobatch_cache_drain();
  return kvt_test_done();
}
