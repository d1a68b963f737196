/*
 * iobatch.c - the batched I/O engine (see iobatch.h). Requests are cut into
 * chunks by one cursor shared by both backends: a chunk goes to the O_DIRECT
 * descriptor when its buffer, offset and length are 4096-aligned, otherwise to
 * the buffered one (so an unaligned tail is just a final buffered chunk).
 * Completions are judged by one function for both backends: EINTR/EAGAIN retry,
 * a short transfer is continued (through the buffered descriptor when the
 * remainder is no longer aligned), a zero-byte read marks end of file, O_DIRECT
 * refused with EINVAL falls back to buffered, anything else fails the batch.
 * Errors are recorded as (errno, offset) and raised on the calling thread at
 * the end, because portable worker threads have their own thread-local error
 * slot.
 *
 * Invariant: kvti_iobatch_run never returns while a request it issued may still
 * touch a caller's buffer (the ring is drained; portable workers are joined).
 */
#if !KVT_PORTABLE
#define _GNU_SOURCE 1 /* O_DIRECT */
#endif
#include "engine/iobatch.h"
#include "base/error.h"
#include "base/io.h"
#include "kvtier.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>
#if KVT_HAVE_URING
#include <liburing.h>
#endif

/* Deepest ring: a cold chunked promote keeps 128 head extents of 64 KiB in
 * flight (8 MiB, as fio's 8 x 1 MiB); at 64 it had half the bytes and read
 * ~15% slower. */
#define MAX_DEPTH 256
#define MAX_REGS 16
#define MAX_RETRIES 1000
/* Batches smaller than this run on the calling thread only (thread start-up
 * would dominate). */
#define THREAD_MIN_BYTES (4u << 20)

int kvti_iobatch_uring_built(void) {
  return KVT_HAVE_URING ? 1 : 0;
}

/* ---------------------------------------------------------------- chunking */

typedef struct chunk {
  kvti_iob_req *r;
  char *buf; /* plain requests */
  uint64_t off, len, done;
  int direct;
  int retries;
  unsigned seg;  /* vectored requests: the segment holding the chunk's first */
  uint64_t skip; /* byte, and that byte's offset inside it */
} chunk;

static int aligned(uint64_t v) {
  return (v & (KVTI_IOB_ALIGN - 1)) == 0;
}

static void req_init(kvti_iob_req *r, unsigned flags, const char *path) {
  r->done = 0;
  r->status = 0;
  r->eof_at_ = UINT64_MAX;
  r->pos_ = 0;
  r->pending_ = 0;
  r->flags_ = flags;
  r->path_ = path;
  r->segi_ = 0;
  r->segoff_ = 0;
}

/* Cuts the next chunk off a vectored request: up to max bytes and
 * KVTI_IOB_MAX_IOV pieces. It goes O_DIRECT when its offset and its first
 * piece are aligned, and then ends before the first unaligned piece (which
 * starts the next, buffered chunk), so one odd extent costs only itself the
 * page cache. */
static int take_vec_chunk(kvti_iob_req *r, size_t max, chunk *ch) {
  uint64_t off = r->off + r->pos_;
  int can = r->dfd >= 0 && !(r->flags_ & KVTI_IOB_NO_DIRECT) && aligned(off);
  int direct = -1; /* undecided until the first piece */
  unsigned seg = r->segi_, n = 0;
  uint64_t skip = r->segoff_, len = 0;
  while (seg < r->iovcnt && len < max && n < KVTI_IOB_MAX_IOV) {
    uint64_t sl = r->iov[seg].iov_len - skip;
    if (sl == 0) {
      seg++;
      skip = 0;
      continue;
    }
    uint64_t take = sl < max - len ? sl : max - len;
    int ok = aligned((uint64_t)(uintptr_t)r->iov[seg].iov_base + skip) &&
             aligned(take);
    if (direct < 0)
      direct = can && ok;
    else if (direct && !ok)
      break;
    len += take;
    n++;
    if (take == sl) {
      seg++;
      skip = 0;
    } else {
      skip += take;
    }
  }
  if (len == 0)
    return 0;
  *ch = (chunk){r, NULL, off, len, 0, direct > 0, 0, r->segi_, r->segoff_};
  r->segi_ = seg;
  r->segoff_ = skip;
  r->pos_ += len;
  return 1;
}

/* The iovec of chunk ch's bytes not yet transferred ([done, len)) into out
 * (cap entries, >= the chunk's pieces). Returns the count. */
static unsigned chunk_iov(const chunk *ch, struct iovec *out, unsigned cap) {
  const kvti_iob_req *r = ch->r;
  unsigned seg = ch->seg, n = 0;
  uint64_t skip = ch->skip, adv = ch->done, want = ch->len - ch->done;
  while (seg < r->iovcnt && (adv > 0 || want > 0) && n < cap) {
    uint64_t sl = r->iov[seg].iov_len - skip;
    if (adv >= sl) {
      adv -= sl;
      seg++;
      skip = 0;
      continue;
    }
    skip += adv;
    adv = 0;
    uint64_t take = r->iov[seg].iov_len - skip;
    if (take > want)
      take = want;
    out[n].iov_base = (char *)r->iov[seg].iov_base + skip;
    out[n].iov_len = (size_t)take;
    n++;
    want -= take;
    seg++;
    skip = 0;
  }
  return n;
}

/* Cuts the next chunk off r (0 when r is fully handed out). */
static int take_chunk(kvti_iob_req *r, size_t max, chunk *ch) {
  if (r->pos_ >= r->len)
    return 0;
  if (r->iov)
    return take_vec_chunk(r, max, ch);
  uint64_t rem = r->len - r->pos_;
  char *buf = (char *)r->buf + r->pos_;
  uint64_t off = r->off + r->pos_;
  int direct = r->dfd >= 0 && !(r->flags_ & KVTI_IOB_NO_DIRECT) &&
               aligned((uint64_t)(uintptr_t)buf) && aligned(off) &&
               rem >= KVTI_IOB_ALIGN;
  uint64_t len = direct ? rem & ~(uint64_t)(KVTI_IOB_ALIGN - 1) : rem;
  if (len > max)
    len = max;
  *ch = (chunk){r, buf, off, len, 0, direct, 0, 0, 0};
  r->pos_ += len;
  return 1;
}

/* First failure of a batch, raised on the calling thread (worker threads have
 * their own thread-local error slot). os_errno != 0: an OS error; else code
 * (KVT_ECORRUPT: truncated). */
typedef struct failure {
  int code;
  int os_errno;
  int write;
  int fd;
  uint64_t off, done, len;
  const char *path;
} failure;

static void fail_os(failure *f, kvti_iob_req *r, int os_errno, uint64_t off) {
  if (r->status == 0)
    r->status = kvti_errno_to_code(os_errno);
  if (f->code == 0)
    *f = (failure){kvti_errno_to_code(os_errno),
                   os_errno,
                   r->write,
                   r->fd,
                   off,
                   0,
                   0,
                   r->path_};
}

static int raise_failure(const failure *f) {
  char fdname[32];
  const char *path = f->path;
  if (!path) {
    snprintf(fdname, sizeof fdname, "fd %d", f->fd);
    path = fdname;
  }
  if (f->os_errno)
    return KVT_ERR_OS(f->os_errno, "%s %s at offset %llu",
                      f->write ? "write" : "read", path,
                      (unsigned long long)f->off);
  if (f->code == KVT_ECORRUPT)
    return KVT_ERR(
        KVT_ECORRUPT,
        "read %s: file truncated (%llu of %llu bytes at offset %llu)", path,
        (unsigned long long)f->done, (unsigned long long)f->len,
        (unsigned long long)f->off);
  return KVT_ERR(f->code, "%s %s failed", f->write ? "write" : "read", path);
}

/* All chunks of r are complete: settle done and the short-read rule. */
static void req_finish(kvti_iob_req *r, failure *f) {
  r->done = r->eof_at_ == UINT64_MAX ? r->len : r->eof_at_ - r->off;
  if (r->status == 0 && r->done < r->len &&
      !(r->flags_ & KVTI_IOB_ALLOW_SHORT)) {
    r->status = KVT_ECORRUPT;
    if (f->code == 0)
      *f = (failure){KVT_ECORRUPT, 0,       0,      r->fd,
                     r->off,       r->done, r->len, r->path_};
  }
}

struct kvti_iobatch {
  int backend; /* KVT_IO_URING / KVT_IO_PORTABLE */
  int requested;
  unsigned depth;
  size_t chunk;
  unsigned threads;
  int broken; /* the ring is in an unknown state: never reuse */
  pid_t pid; /* creator: a ring is not shared across fork (see kvti_iobatch_get)
              */
  struct kvti_iobatch *cache_next;
  failure f; /* first failure since the last wait_all (push mode) */
#if KVT_HAVE_URING
  struct io_uring ring;
  int ring_ok;
  struct iovec regs[MAX_REGS];
  unsigned nregs;
  chunk slots[MAX_DEPTH];
  struct iovec *slot_iov[MAX_DEPTH]; /* a vectored chunk's iovec, kept until
                                        it completes (allocated on first use) */
  unsigned char inuse[MAX_DEPTH];
  unsigned freelist[MAX_DEPTH], nfree;
  unsigned inflight;    /* chunks queued or in the kernel */
  unsigned unsubmitted; /* queued, not yet accepted by the kernel */
  unsigned soft_errors;
#endif
};

enum { CH_DONE = 0, CH_AGAIN = 1, CH_FAILED = 2 };

/* Judges one completion (res = bytes or -errno) of chunk ch. */
static int judge(chunk *ch, int64_t res, failure *f) {
  kvti_iob_req *r = ch->r;
  if (res == -EINTR || res == -EAGAIN) {
    if (++ch->retries <= MAX_RETRIES)
      return CH_AGAIN;
  } else if (res == -EINVAL && ch->direct) {
    /* The file system refused this O_DIRECT transfer: use the page cache for
     * it. */
    ch->direct = 0;
    return CH_AGAIN;
  }
  if (res < 0) {
    fail_os(f, r, (int)-res, ch->off + ch->done);
    return CH_FAILED;
  }
  if (res == 0) {
    if (r->write) {
      fail_os(f, r, EIO, ch->off + ch->done);
      return CH_FAILED;
    }
    uint64_t at = ch->off + ch->done;
    if (at < r->eof_at_)
      r->eof_at_ = at;
    return CH_DONE;
  }
  ch->done += (uint64_t)res;
  if (ch->done >= ch->len)
    return CH_DONE;
  if (ch->direct && !aligned(ch->done))
    ch->direct = 0;
  return CH_AGAIN;
}

/* ---------------------------------------------------------------- portable */

/* A vectored read through the seam: its preadv, or one pread per segment
 * where there is none - and also when a test replaced pread but left the
 * default preadv, so injected faults see every transfer. Returns bytes read
 * (short only where a pread was) or -1 with errno: a failing segment fails
 * the whole call, as preadv would, never a short count that a retry might
 * paper over. */
static ssize_t read_vec(int fd, const struct iovec *v, unsigned n, off_t off) {
  if (kvti_io->preadv && (kvti_io->preadv != kvti_io_default.preadv ||
                          kvti_io->pread == kvti_io_default.pread))
    return kvti_io->preadv(fd, v, (int)n, off);
  ssize_t total = 0;
  for (unsigned i = 0; i < n; i++) {
    ssize_t got =
        kvti_io->pread(fd, v[i].iov_base, v[i].iov_len, off + (off_t)total);
    if (got < 0)
      return -1;
    total += got;
    if ((size_t)got < v[i].iov_len)
      break;
  }
  return total;
}

static void portable_chunk(chunk *ch, failure *f) {
  kvti_iob_req *r = ch->r;
  struct iovec v[KVTI_IOB_MAX_IOV];
  for (;;) {
    int fd = ch->direct ? r->dfd : r->fd;
    char *p = ch->buf ? ch->buf + ch->done : NULL;
    size_t n = (size_t)(ch->len - ch->done);
    off_t off = (off_t)(ch->off + ch->done);
    ssize_t got;
    if (r->iov)
      got = read_vec(fd, v, chunk_iov(ch, v, KVTI_IOB_MAX_IOV), off);
    else
      got = r->write ? kvti_io->pwrite(fd, p, n, off)
                     : kvti_io->pread(fd, p, n, off);
    int64_t res = got < 0 ? -(int64_t)errno : (int64_t)got;
    if (judge(ch, res, f) != CH_AGAIN)
      return;
  }
}

typedef struct pjob {
  pthread_mutex_t mu;
  kvti_iob_req *reqs;
  size_t n, i;
  size_t chunk;
  failure f;
} pjob;

/* Next chunk of the batch (caller holds mu when threaded). */
static int pjob_next(pjob *j, chunk *ch) {
  while (j->i < j->n) {
    if (take_chunk(&j->reqs[j->i], j->chunk, ch))
      return 1;
    j->i++;
  }
  return 0;
}

static void *portable_worker(void *arg) {
  pjob *j = arg;
  for (;;) {
    chunk ch;
    /* judge() updates the request's eof_at_/status, which another worker may be
     * updating for another chunk of the same request: each chunk works on a
     * private copy of the request (taken under the lock, as pos_ changes under
     * it) and merges back under the lock. */
    kvti_iob_req shadow;
    pthread_mutex_lock(&j->mu);
    int have = j->f.code == 0 && pjob_next(j, &ch);
    if (have)
      shadow = *ch.r;
    pthread_mutex_unlock(&j->mu);
    if (!have)
      return NULL;
    kvti_iob_req *r = ch.r;
    shadow.eof_at_ = UINT64_MAX;
    shadow.status = 0;
    ch.r = &shadow;
    failure local = {0, 0, 0, 0, 0, 0, 0, NULL};
    portable_chunk(&ch, &local);
    pthread_mutex_lock(&j->mu);
    if (shadow.eof_at_ < r->eof_at_)
      r->eof_at_ = shadow.eof_at_;
    if (local.code) {
      if (r->status == 0)
        r->status = shadow.status;
      if (j->f.code == 0)
        j->f = local;
    }
    pthread_mutex_unlock(&j->mu);
  }
}

static int portable_run(kvti_iobatch *b, kvti_iob_req *reqs, size_t n) {
  pjob j;
  memset(&j, 0, sizeof j);
  j.reqs = reqs;
  j.n = n;
  j.chunk = b->chunk;
  uint64_t total = 0;
  for (size_t i = 0; i < n; i++)
    total += reqs[i].len;
  unsigned nthreads = b->threads;
  if (total < THREAD_MIN_BYTES || total <= b->chunk)
    nthreads = 1;
  if (nthreads > 1) {
    pthread_t th[16];
    unsigned started = 0;
    if (nthreads > 16)
      nthreads = 16;
    pthread_mutex_init(&j.mu, NULL);
    for (unsigned t = 1; t < nthreads; t++) {
      if (pthread_create(&th[started], NULL, portable_worker, &j) != 0)
        break;
      started++;
    }
    portable_worker(&j);
    for (unsigned t = 0; t < started; t++)
      pthread_join(th[t], NULL);
    pthread_mutex_destroy(&j.mu);
  } else {
    chunk ch;
    while (j.f.code == 0 && pjob_next(&j, &ch))
      portable_chunk(&ch, &j.f);
  }
  for (size_t i = 0; i < n; i++) {
    if (reqs[i].pos_ < reqs[i].len && reqs[i].status == 0)
      reqs[i].status =
          KVT_ECANCELED; /* never fully started because of another failure */
    req_finish(&reqs[i], &j.f);
  }
  return j.f.code ? raise_failure(&j.f) : 0;
}

/* Synchronous push (portable backend): the request is done before return. */
static int portable_push(kvti_iobatch *b, kvti_iob_req *r) {
  chunk ch;
  while (b->f.code == 0 && take_chunk(r, b->chunk, &ch))
    portable_chunk(&ch, &b->f);
  if (r->pos_ < r->len && r->status == 0)
    r->status = KVT_ECANCELED;
  req_finish(r, &b->f);
  return b->f.code ? raise_failure(&b->f) : 0;
}

/* ---------------------------------------------------------------- io_uring */

#if KVT_HAVE_URING
static int reg_index(kvti_iobatch *b, const char *buf, uint64_t len) {
  for (unsigned i = 0; i < b->nregs; i++) {
    const char *base = b->regs[i].iov_base;
    if (buf >= base && buf + len <= base + b->regs[i].iov_len)
      return (int)i;
  }
  return -1;
}

static int u_submit(kvti_iobatch *b, unsigned wait_nr) {
  return kvti_io->uring_submit ? kvti_io->uring_submit(&b->ring, wait_nr)
                               : io_uring_submit_and_wait(&b->ring, wait_nr);
}

static void u_chunk_done(kvti_iobatch *b, unsigned slot, int abandoned);

/* Queues an SQE for slot (its chunk's remaining bytes). */
static void u_issue(kvti_iobatch *b, unsigned slot) {
  chunk *ch = &b->slots[slot];
  kvti_iob_req *r = ch->r;
  if (r->iov && !b->slot_iov[slot] &&
      !(b->slot_iov[slot] =
            kvti_malloc(KVTI_IOB_MAX_IOV * sizeof *b->slot_iov[slot]))) {
    fail_os(&b->f, r, ENOMEM, ch->off + ch->done);
    u_chunk_done(b, slot, 0);
    return;
  }
  struct io_uring_sqe *sqe = io_uring_get_sqe(&b->ring);
  if (!sqe) { /* the SQ is full of unsubmitted entries: hand them to the kernel
                 first */
    int rc = u_submit(b, 0);
    if (rc > 0)
      b->unsubmitted -=
          (unsigned)rc < b->unsubmitted ? (unsigned)rc : b->unsubmitted;
    sqe = io_uring_get_sqe(&b->ring);
  }
  if (!sqe) { /* cannot happen (ring entries >= slots); fail the chunk rather
                 than hang */
    fail_os(&b->f, r, EBUSY, ch->off + ch->done);
    u_chunk_done(b, slot, 0);
    return;
  }
  int fd = ch->direct ? r->dfd : r->fd;
  uint64_t off = ch->off + ch->done;
  if (r->iov) {
    struct iovec *v = b->slot_iov[slot];
    io_uring_prep_readv(sqe, fd, v, chunk_iov(ch, v, KVTI_IOB_MAX_IOV), off);
    io_uring_sqe_set_data64(sqe, slot);
    b->inflight++;
    b->unsubmitted++;
    return;
  }
  char *p = ch->buf + ch->done;
  unsigned n = (unsigned)(ch->len - ch->done);
  int ri = b->nregs ? reg_index(b, p, n) : -1;
  if (r->write) {
    if (ri >= 0)
      io_uring_prep_write_fixed(sqe, fd, p, n, off, ri);
    else
      io_uring_prep_write(sqe, fd, p, n, off);
  } else {
    if (ri >= 0)
      io_uring_prep_read_fixed(sqe, fd, p, n, off, ri);
    else
      io_uring_prep_read(sqe, fd, p, n, off);
  }
  io_uring_sqe_set_data64(sqe, slot);
  b->inflight++;
  b->unsubmitted++;
}

static void u_chunk_done(kvti_iobatch *b, unsigned slot, int abandoned) {
  kvti_iob_req *r = b->slots[slot].r;
  if (abandoned && r->status == 0)
    r->status = KVT_ECANCELED;
  b->inuse[slot] = 0;
  b->freelist[b->nfree++] = slot;
  if (--r->pending_ == 0 && r->pos_ >= r->len)
    req_finish(r, &b->f);
}

/* Submits what is queued, waits for at least wait_nr completions (when any is
 * in flight) and processes every completion available. */
static void u_pump(kvti_iobatch *b, unsigned wait_nr) {
  if (b->broken || b->inflight == 0)
    return;
  int rc = u_submit(b, wait_nr);
  if (rc >= 0) {
    b->soft_errors = 0;
    b->unsubmitted -=
        (unsigned)rc < b->unsubmitted ? (unsigned)rc : b->unsubmitted;
  } else if ((rc == -EINTR || rc == -EAGAIN || rc == -EBUSY) &&
             ++b->soft_errors < MAX_RETRIES) {
    /* transient: reap what is there and come back */
  } else {
    /* The ring can no longer be trusted. Wait (outside the seam) for what the
     * kernel did accept so no request touches a caller's buffer after we
     * return; never reuse it. */
    b->broken = 1;
    unsigned kernel = b->inflight - b->unsubmitted;
    while (kernel > 0) {
      struct io_uring_cqe *c;
      if (io_uring_wait_cqe(&b->ring, &c) != 0)
        break;
      io_uring_cqe_seen(&b->ring, c);
      kernel--;
    }
    for (unsigned i = 0; i < b->depth; i++) {
      if (!b->inuse[i])
        continue;
      kvti_iob_req *r = b->slots[i].r;
      fail_os(&b->f, r, -rc, b->slots[i].off);
      r->pending_ = 0;
      b->inuse[i] = 0;
    }
    b->inflight = 0;
    return;
  }
  unsigned head, seen = 0;
  struct io_uring_cqe *cqe;
  io_uring_for_each_cqe(&b->ring, head, cqe) {
    seen++;
    unsigned slot = (unsigned)io_uring_cqe_get_data64(cqe);
    chunk *ch = &b->slots[slot];
    kvti_iob_req *r = ch->r;
    int res = cqe->res;
    if (kvti_io->uring_result)
      res = kvti_io->uring_result(r->write, ch->direct ? r->dfd : r->fd,
                                  ch->off + ch->done,
                                  (size_t)(ch->len - ch->done), res);
    b->inflight--;
    int v = judge(ch, res, &b->f);
    if (v == CH_AGAIN && b->f.code == 0 && !b->broken)
      u_issue(b, slot);
    else
      u_chunk_done(b, slot, v == CH_AGAIN);
  }
  io_uring_cq_advance(&b->ring, seen);
}
#endif

/* ---------------------------------------------------------------- engine */

/* A test table that replaced pread/pwrite wants to see every transfer: AUTO
 * then means portable (io_uring would bypass those hooks). */
static int auto_backend(int backend) {
  if (backend == KVT_IO_AUTO && (kvti_io->pread != kvti_io_default.pread ||
                                 kvti_io->pwrite != kvti_io_default.pwrite))
    return KVT_IO_PORTABLE;
  return backend;
}

/* cfg with its defaults and bounds applied: what an engine made from it has
 * (create) and what the cache matches (get_cfg). */
static kvti_iob_cfg cfg_effective(const kvti_iob_cfg *c) {
  kvti_iob_cfg e = *c;
  e.depth = c->depth ? c->depth : 8;
  if (e.depth > MAX_DEPTH)
    e.depth = MAX_DEPTH;
  e.chunk = c->chunk ? c->chunk : (size_t)1 << 20;
  e.chunk = (e.chunk + KVTI_IOB_ALIGN - 1) & ~(size_t)(KVTI_IOB_ALIGN - 1);
  if (e.chunk > ((size_t)1 << 30))
    e.chunk = (size_t)1 << 30;
  e.threads = c->threads ? c->threads : 2;
  return e;
}

int kvti_iobatch_create(kvti_iobatch **out, const kvti_iob_cfg *cfg) {
  kvti_iob_cfg def = KVTI_IOB_CFG_INIT;
  if (!cfg)
    cfg = &def;
  if (cfg->backend != KVT_IO_AUTO && cfg->backend != KVT_IO_PORTABLE &&
      cfg->backend != KVT_IO_URING)
    return KVT_ERR(
        KVT_EINVAL,
        "io_backend must be 0 (auto), 1 (portable) or 2 (uring), got %d",
        cfg->backend);
  kvti_iobatch *b = kvti_calloc(1, sizeof *b);
  if (!b)
    return KVT_ERR_NOMEM();
  b->requested = cfg->backend;
  b->pid = getpid();
  kvti_iob_cfg e = cfg_effective(cfg);
  b->depth = e.depth;
  b->chunk = e.chunk;
  b->threads = e.threads;
  b->backend = KVT_IO_PORTABLE;
  if (auto_backend(cfg->backend) != KVT_IO_PORTABLE) {
    int err = ENOSYS;
#if KVT_HAVE_URING
    if (kvti_io->uring_setup && kvti_io->uring_submit &&
        kvti_io->uring_result) {
      int rc = kvti_io->uring_setup(b->depth, &b->ring, 0);
      if (rc == 0) {
        b->ring_ok = 1;
        b->backend = KVT_IO_URING;
        err = 0;
        for (unsigned i = 0; i < b->depth; i++)
          b->freelist[b->nfree++] = b->depth - 1 - i;
      } else {
        err = -rc;
      }
    }
#endif
    if (err != 0 && cfg->backend == KVT_IO_URING) {
      kvti_free(b);
      return KVT_ERR(KVT_EUNSUPPORTED, "io_uring backend unavailable: %s",
                     KVT_HAVE_URING ? strerror(err)
                                    : "not built with liburing");
    }
  }
  *out = b;
  return 0;
}

void kvti_iobatch_free(kvti_iobatch *b) {
  if (!b)
    return;
#if KVT_HAVE_URING
  if (b->ring_ok)
    io_uring_queue_exit(&b->ring);
  for (unsigned i = 0; i < MAX_DEPTH; i++)
    kvti_free(b->slot_iov[i]);
#endif
  kvti_free(b);
}

int kvti_iobatch_backend(const kvti_iobatch *b) {
  return b->backend;
}

int kvti_iobatch_register(kvti_iobatch *b, void *base, size_t len) {
#if KVT_HAVE_URING
  if (b->backend == KVT_IO_URING && b->nregs < MAX_REGS && !b->broken) {
    if (b->nregs)
      io_uring_unregister_buffers(&b->ring);
    b->regs[b->nregs].iov_base = base;
    b->regs[b->nregs].iov_len = len;
    int rc = io_uring_register_buffers(&b->ring, b->regs, b->nregs + 1);
    if (rc == 0) {
      b->nregs++;
      return 0;
    }
    /* Restore the previous set (best effort). */
    if (b->nregs && io_uring_register_buffers(&b->ring, b->regs, b->nregs) != 0)
      b->nregs = 0;
    return KVT_ERR(KVT_EUNSUPPORTED, "io_uring buffer registration refused: %s",
                   strerror(-rc));
  }
#else
  (void)base, (void)len;
#endif
  (void)b;
  return KVT_ERR(KVT_EUNSUPPORTED,
                 "buffer registration needs the io_uring backend");
}

void kvti_iobatch_unregister(kvti_iobatch *b) {
#if KVT_HAVE_URING
  if (b->nregs)
    io_uring_unregister_buffers(&b->ring);
  b->nregs = 0;
#else
  (void)b;
#endif
}

/* A vectored request: a read whose segments sum to exactly len. */
static int check_vec(const kvti_iob_req *r) {
  if (r->write || r->iovcnt == 0)
    return 0;
  uint64_t sum = 0;
  for (unsigned i = 0; i < r->iovcnt; i++) {
    uint64_t l = r->iov[i].iov_len;
    if ((l && !r->iov[i].iov_base) || l > r->len - sum)
      return 0;
    sum += l;
  }
  return sum == r->len;
}

static int check_req(const kvti_iob_req *r) {
  return r->fd >= 0 && (r->iov ? check_vec(r) : (r->len == 0 || r->buf)) &&
         r->off <= (uint64_t)INT64_MAX &&
         r->len <= (uint64_t)INT64_MAX - r->off;
}

#if KVT_HAVE_URING
static int uring_push(kvti_iobatch *b, kvti_iob_req *r, int defer) {
  while (b->f.code == 0 && !b->broken && r->pos_ < r->len) {
    if (b->nfree == 0) {
      u_pump(b, 1);
      continue;
    }
    unsigned slot = b->freelist[--b->nfree];
    take_chunk(r, b->chunk, &b->slots[slot]);
    b->inuse[slot] = 1;
    r->pending_++;
    u_issue(b, slot);
  }
  if (r->len == 0)
    req_finish(r, &b->f);
  else if (r->pos_ < r->len && r->status == 0)
    r->status = KVT_ECANCELED;
  if (!defer)
    u_pump(b, 0); /* hand the queued chunks to the kernel without waiting */
  return b->f.code;
}
#endif

int kvti_iobatch_push(kvti_iobatch *b, kvti_iob_req *r, unsigned flags,
                      const char *path) {
  if (!r || !check_req(r))
    return KVT_ERR(KVT_EINVAL, "iobatch: invalid request");
  req_init(r, flags, path);
  if (b->broken)
    return KVT_ERR(KVT_EIO, "iobatch: engine unusable after a ring failure");
  if (b->f.code) {
    r->status = KVT_ECANCELED;
    return raise_failure(&b->f);
  }
#if KVT_HAVE_URING
  if (b->backend == KVT_IO_URING)
    return uring_push(b, r, (flags & KVTI_IOB_DEFER) != 0)
               ? raise_failure(&b->f)
               : 0;
#endif
  return portable_push(b, r);
}

int kvti_iobatch_submit(kvti_iobatch *b) {
#if KVT_HAVE_URING
  if (b->backend == KVT_IO_URING && !b->broken)
    u_pump(b, 0);
#endif
  return b->f.code ? raise_failure(&b->f) : 0;
}

int kvti_iobatch_wait_req(kvti_iobatch *b, kvti_iob_req *r) {
#if KVT_HAVE_URING
  while (b->backend == KVT_IO_URING && r->pending_ > 0 && !b->broken)
    u_pump(b, 1);
#endif
  if (r->status == 0)
    return 0;
  if (b->f.code)
    raise_failure(&b->f);
  return r->status;
}

int kvti_iobatch_wait_all(kvti_iobatch *b) {
#if KVT_HAVE_URING
  while (b->backend == KVT_IO_URING && b->inflight > 0 && !b->broken)
    u_pump(b, 1);
#endif
  int code = b->f.code;
  if (code)
    raise_failure(&b->f);
  memset(&b->f, 0, sizeof b->f);
  return code;
}

int kvti_iobatch_run(kvti_iobatch *b, kvti_iob_req *reqs, size_t n,
                     unsigned flags, const char *path) {
  if (n > 0 && !reqs)
    return KVT_ERR(KVT_EINVAL, "iobatch: NULL request list");
  for (size_t i = 0; i < n; i++) {
    if (!check_req(&reqs[i]))
      return KVT_ERR(KVT_EINVAL, "iobatch: invalid request %zu", i);
    req_init(&reqs[i], flags, path);
  }
  if (b->broken)
    return KVT_ERR(KVT_EIO, "iobatch: engine unusable after a ring failure");
#if KVT_HAVE_URING
  if (b->backend == KVT_IO_URING) {
    /* Anything left from an unfinished push sequence is completed first. */
    kvti_iobatch_wait_all(b);
    for (size_t i = 0; i < n; i++) {
      if (b->f.code || b->broken) {
        reqs[i].status = KVT_ECANCELED;
        continue;
      }
      uring_push(b, &reqs[i], 1); /* wait_all submits what is queued */
    }
    return kvti_iobatch_wait_all(b);
  }
#endif
  memset(&b->f, 0, sizeof b->f);
  return portable_run(b, reqs, n);
}

int kvti_iobatch_fsync_many(kvti_iobatch *b, const int *fds, size_t n,
                            const char *const *paths) {
  int rc = kvti_iobatch_wait_all(b);
  if (rc)
    return rc;
#if KVT_HAVE_URING
  if (b->backend == KVT_IO_URING && !b->broken &&
      kvti_io->fsync == kvti_io_default.fsync) {
    size_t next = 0, done = 0;
    int first_err = 0;
    size_t err_i = 0;
    unsigned inflight = 0;
    while (done < n) {
      while (next < n && inflight < b->depth) {
        struct io_uring_sqe *sqe = io_uring_get_sqe(&b->ring);
        if (!sqe)
          break;
        io_uring_prep_fsync(sqe, fds[next], 0);
        io_uring_sqe_set_data64(sqe, next);
        next++;
        inflight++;
      }
      int s = u_submit(b, 1);
      if (s < 0 && s != -EINTR && s != -EAGAIN && s != -EBUSY) {
        /* Leave the ring alone (it may hold accepted fsyncs) and finish the
         * portable way. */
        struct io_uring_cqe *c;
        while (inflight > 0 && io_uring_wait_cqe(&b->ring, &c) == 0) {
          io_uring_cqe_seen(&b->ring, c);
          inflight--;
        }
        b->broken = inflight > 0;
        for (size_t i = 0; i < n;
             i++) { /* again for all: fsync is idempotent */
          int r = kvti_fsync(fds[i], paths ? paths[i] : "file");
          if (r && !first_err)
            return r;
        }
        return first_err ? KVT_ERR_OS(first_err, "fsync %s",
                                      paths ? paths[err_i] : "file")
                         : 0;
      }
      unsigned head, seen = 0;
      struct io_uring_cqe *cqe;
      io_uring_for_each_cqe(&b->ring, head, cqe) {
        seen++;
        size_t i = (size_t)io_uring_cqe_get_data64(cqe);
        int res = cqe->res;
        if (kvti_io->uring_result)
          res = kvti_io->uring_result(2, fds[i], 0, 0, res);
        if (res == -EINTR || res == -EAGAIN) {
          /* retry this one the plain way */
          int r = kvti_fsync(fds[i], paths ? paths[i] : "file");
          res = r == 0 ? 0 : -(kvt_last_errno() ? kvt_last_errno() : EIO);
        }
        if (res < 0 && !first_err) {
          first_err = -res;
          err_i = i;
        }
        inflight--;
        done++;
      }
      io_uring_cq_advance(&b->ring, seen);
    }
    if (first_err)
      return KVT_ERR_OS(first_err, "fsync %s", paths ? paths[err_i] : "file");
    return 0;
  }
#endif
  for (size_t i = 0; i < n; i++) {
    rc = kvti_fsync(fds[i], paths ? paths[i] : "file");
    if (rc)
      return rc;
  }
  return 0;
}

int kvti_iob_open_direct(const char *path, int flags, unsigned mode) {
#if defined(O_DIRECT) && !KVT_PORTABLE
  /* Non-blocking and type-checked like every open (the path may have been
   * replaced by a FIFO since the buffered descriptor was opened). */
  return kvti_open_quiet(path, flags | O_DIRECT, (mode_t)mode);
#else
  (void)path, (void)flags, (void)mode;
  return -1;
#endif
}

int kvti_iob_open_direct_at(int dirfd, const char *name, int flags,
                            unsigned mode) {
#if defined(O_DIRECT) && !KVT_PORTABLE
  return kvti_openat_quiet(dirfd, name, flags | O_DIRECT, (mode_t)mode);
#else
  (void)dirfd, (void)name, (void)flags, (void)mode;
  return -1;
#endif
}

int kvti_iob_drop_cache(int fd) {
#ifdef POSIX_FADV_DONTNEED
  if (kvti_io->fadvise) {
    int e = kvti_io->fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    if (e != 0 && e != ENOSYS && e != EOPNOTSUPP)
      return KVT_ERR_OS(e, "posix_fadvise(DONTNEED)");
  }
#else
  (void)fd;
#endif
  return 0;
}

int kvti_iob_preallocate(int fd, uint64_t len) {
  if (len == 0 || !kvti_io->fallocate)
    return 0;
  int e = kvti_io->fallocate(fd, 0, (off_t)len);
  if (e == 0 || e == EOPNOTSUPP || e == ENOSYS || e == EINVAL)
    return 0;
  return KVT_ERR_OS(e, "fallocate %llu bytes", (unsigned long long)len);
}

/* ---------------------------------------------------------------- cache */

/* Engines kept per backend, of every configuration together (the default ones
 * of spills and entry reads, the deep ones of chunked promotes). */
#define CACHE_MAX 16
static pthread_mutex_t cache_mu = PTHREAD_MUTEX_INITIALIZER;
static kvti_iobatch *cache[3];
static unsigned cache_n[3];

/* Whether b was made from a configuration with c's effective values. */
static int same_cfg(const kvti_iobatch *b, const kvti_iob_cfg *c) {
  kvti_iob_cfg e = cfg_effective(c);
  return b->depth == e.depth && b->chunk == e.chunk && b->threads == e.threads;
}

int kvti_iobatch_get_cfg(kvti_iobatch **out, const kvti_iob_cfg *cfg) {
  kvti_iob_cfg c = cfg ? *cfg : (kvti_iob_cfg)KVTI_IOB_CFG_INIT;
  c.backend = auto_backend(c.backend);
  if (c.backend >= 0 && c.backend < 3) {
    pid_t me = getpid();
    for (;;) {
      /* The first cached engine of this backend with this configuration. */
      pthread_mutex_lock(&cache_mu);
      kvti_iobatch **pp = &cache[c.backend], *b;
      while ((b = *pp) && !same_cfg(b, &c))
        pp = &b->cache_next;
      if (b) {
        *pp = b->cache_next;
        cache_n[c.backend]--;
      }
      pthread_mutex_unlock(&cache_mu);
      if (!b)
        break;
      b->cache_next = NULL;
      if (b->pid != me) {
        /* Inherited through fork: the ring's memory is shared with the parent,
         * so using it would corrupt both. Drop this process's mapping and
         * descriptor only. */
        kvti_iobatch_free(b);
        continue;
      }
      *out = b;
      return 0;
    }
  }
  return kvti_iobatch_create(out, &c);
}

int kvti_iobatch_get(kvti_iobatch **out, int backend) {
  kvti_iob_cfg cfg = KVTI_IOB_CFG_INIT;
  cfg.backend = backend;
  return kvti_iobatch_get_cfg(out, &cfg);
}

void kvti_iobatch_put(kvti_iobatch *b) {
  if (!b)
    return;
  if (!b->broken && b->pid == getpid() && b->requested >= 0 &&
      b->requested < 3) {
#if KVT_HAVE_URING
    kvti_iobatch_unregister(b);
#endif
    pthread_mutex_lock(&cache_mu);
    if (cache_n[b->requested] < CACHE_MAX) {
      b->cache_next = cache[b->requested];
      cache[b->requested] = b;
      cache_n[b->requested]++;
      b = NULL;
    }
    pthread_mutex_unlock(&cache_mu);
  }
  kvti_iobatch_free(b);
}

void kvti_iobatch_cache_drain(void) {
  for (int k = 0; k < 3; k++) {
    pthread_mutex_lock(&cache_mu);
    kvti_iobatch *b = cache[k];
    cache[k] = NULL;
    cache_n[k] = 0;
    pthread_mutex_unlock(&cache_mu);
    while (b) {
      kvti_iobatch *next = b->cache_next;
      kvti_iobatch_free(b);
      b = next;
    }
  }
}
