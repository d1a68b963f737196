/*
 * iobatch.c - the batched I/O engine (see iobatch.h). Requests are cut into chunks by one
 * cursor shared by both backends: a chunk goes to the O_DIRECT descriptor when its buffer,
 * offset and length are 4096-aligned, otherwise to the buffered one (so an unaligned tail is
 * just a final buffered chunk). Completions are judged by one function for both backends:
 * EINTR/EAGAIN retry, a short transfer is continued (through the buffered descriptor when the
 * remainder is no longer aligned), a zero-byte read marks end of file, O_DIRECT refused with
 * EINVAL falls back to buffered, anything else fails the batch. Errors are recorded as
 * (errno, offset) and raised on the calling thread at the end, because portable worker threads
 * have their own thread-local error slot.
 *
 * Invariant: kvti_iobatch_run never returns while a request it issued may still touch a
 * caller's buffer (the ring is drained; portable workers are joined).
 */
#define _GNU_SOURCE 1 /* O_DIRECT */
#include "iobatch.h"
#include "error.h"
#include "io.h"
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

#define MAX_DEPTH 64
#define MAX_REGS 16
#define MAX_RETRIES 1000
/* Batches smaller than this run on the calling thread only (thread start-up would dominate). */
#define THREAD_MIN_BYTES (4u << 20)

struct kvti_iobatch {
  int backend; /* KVT_IO_URING / KVT_IO_PORTABLE */
  int requested;
  unsigned depth;
  size_t chunk;
  unsigned threads;
  int broken; /* the ring is in an unknown state: never reuse */
  struct kvti_iobatch *cache_next;
#if KVT_HAVE_URING
  struct io_uring ring;
  int ring_ok;
  struct iovec regs[MAX_REGS];
  unsigned nregs;
#endif
};

int kvti_iobatch_uring_built(void) { return KVT_HAVE_URING ? 1 : 0; }

/* ---------------------------------------------------------------- chunking */

typedef struct chunk {
  size_t req;
  char *buf;
  uint64_t off, len, done;
  int direct;
  int retries;
} chunk;

typedef struct cursor {
  kvti_iob_req *reqs;
  size_t n, i;
  uint64_t pos;
  size_t chunk;
  unsigned flags;
} cursor;

static int aligned(uint64_t v) { return (v & (KVTI_IOB_ALIGN - 1)) == 0; }

static int next_chunk(cursor *c, chunk *ch) {
  while (c->i < c->n && c->pos >= c->reqs[c->i].len) {
    c->i++;
    c->pos = 0;
  }
  if (c->i >= c->n)
    return 0;
  kvti_iob_req *r = &c->reqs[c->i];
  uint64_t rem = r->len - c->pos;
  char *buf = (char *)r->buf + c->pos;
  uint64_t off = r->off + c->pos;
  int direct = r->dfd >= 0 && !(c->flags & KVTI_IOB_NO_DIRECT) &&
               aligned((uint64_t)(uintptr_t)buf) && aligned(off) &&
               rem >= KVTI_IOB_ALIGN;
  uint64_t len = direct ? rem & ~(uint64_t)(KVTI_IOB_ALIGN - 1) : rem;
  if (len > c->chunk)
    len = c->chunk;
  ch->req = c->i;
  ch->buf = buf;
  ch->off = off;
  ch->len = len;
  ch->done = 0;
  ch->direct = direct;
  ch->retries = 0;
  c->pos += len;
  return 1;
}

/* First failure of a batch, raised on the calling thread. */
typedef struct failure {
  int os_errno; /* 0: none */
  int write;
  uint64_t off;
} failure;

static void fail(failure *f, kvti_iob_req *r, int os_errno, uint64_t off) {
  if (r->status == 0)
    r->status = kvti_errno_to_code(os_errno);
  if (f->os_errno == 0) {
    f->os_errno = os_errno;
    f->write = r->write;
    f->off = off;
  }
}

enum { CH_DONE = 0, CH_AGAIN = 1, CH_FAILED = 2 };

/* Judges one completion (res = bytes or -errno) of chunk ch. */
static int judge(kvti_iob_req *reqs, chunk *ch, int64_t res, failure *f) {
  kvti_iob_req *r = &reqs[ch->req];
  if (res == -EINTR || res == -EAGAIN) {
    if (++ch->retries <= MAX_RETRIES)
      return CH_AGAIN;
  } else if (res == -EINVAL && ch->direct) {
    /* The file system refused this O_DIRECT transfer: use the page cache for it. */
    ch->direct = 0;
    return CH_AGAIN;
  }
  if (res < 0) {
    fail(f, r, (int)-res, ch->off + ch->done);
    return CH_FAILED;
  }
  if (res == 0) {
    if (r->write) {
      fail(f, r, EIO, ch->off + ch->done);
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

static int finish(kvti_iob_req *reqs, size_t n, unsigned flags, failure *f,
                  const char *path) {
  char fdname[32];
  if (f->os_errno) {
    if (!path) {
      snprintf(fdname, sizeof fdname, "fd %d", reqs[0].fd);
      path = fdname;
    }
    return KVT_ERR_OS(f->os_errno, "%s %s at offset %llu", f->write ? "write" : "read",
                      path, (unsigned long long)f->off);
  }
  for (size_t i = 0; i < n; i++) {
    kvti_iob_req *r = &reqs[i];
    r->done = r->eof_at_ == UINT64_MAX ? r->len : r->eof_at_ - r->off;
    if (r->done < r->len && !(flags & KVTI_IOB_ALLOW_SHORT)) {
      if (!path) {
        snprintf(fdname, sizeof fdname, "fd %d", r->fd);
        path = fdname;
      }
      r->status = KVT_ECORRUPT;
      return KVT_ERR(KVT_ECORRUPT, "read %s: file truncated (%llu of %llu bytes at offset %llu)",
                     path, (unsigned long long)r->done, (unsigned long long)r->len,
                     (unsigned long long)r->off);
    }
  }
  return 0;
}

/* ---------------------------------------------------------------- portable */

static void portable_chunk(kvti_iob_req *reqs, chunk *ch, failure *f) {
  kvti_iob_req *r = &reqs[ch->req];
  for (;;) {
    int fd = ch->direct ? r->dfd : r->fd;
    char *p = ch->buf + ch->done;
    size_t n = (size_t)(ch->len - ch->done);
    off_t off = (off_t)(ch->off + ch->done);
    ssize_t got = r->write ? kvti_io->pwrite(fd, p, n, off) : kvti_io->pread(fd, p, n, off);
    int64_t res = got < 0 ? -(int64_t)errno : (int64_t)got;
    if (judge(reqs, ch, res, f) != CH_AGAIN)
      return;
  }
}

typedef struct pjob {
  pthread_mutex_t mu;
  cursor cur;
  failure f;
} pjob;

static void *portable_worker(void *arg) {
  pjob *j = arg;
  for (;;) {
    chunk ch;
    pthread_mutex_lock(&j->mu);
    int have = j->f.os_errno == 0 && next_chunk(&j->cur, &ch);
    pthread_mutex_unlock(&j->mu);
    if (!have)
      return NULL;
    failure local = {0, 0, 0};
    kvti_iob_req *r = &j->cur.reqs[ch.req];
    /* judge() writes r->eof_at_ and r->status, which other workers may touch for another chunk
     * of the same request: do the chunk against a private copy and merge under the lock. */
    kvti_iob_req shadow = *r;
    shadow.eof_at_ = UINT64_MAX;
    shadow.status = 0;
    chunk c2 = ch;
    c2.req = 0;
    portable_chunk(&shadow, &c2, &local);
    pthread_mutex_lock(&j->mu);
    if (shadow.eof_at_ < r->eof_at_)
      r->eof_at_ = shadow.eof_at_;
    if (local.os_errno) {
      if (r->status == 0)
        r->status = shadow.status;
      if (j->f.os_errno == 0)
        j->f = local;
    }
    pthread_mutex_unlock(&j->mu);
  }
}

static int portable_run(kvti_iobatch *b, kvti_iob_req *reqs, size_t n, unsigned flags,
                        const char *path) {
  pjob j;
  memset(&j, 0, sizeof j);
  j.cur = (cursor){reqs, n, 0, 0, b->chunk, flags};
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
    while (j.f.os_errno == 0 && next_chunk(&j.cur, &ch))
      portable_chunk(reqs, &ch, &j.f);
  }
  return finish(reqs, n, flags, &j.f, path);
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

static void prep(kvti_iobatch *b, struct io_uring_sqe *sqe, kvti_iob_req *reqs, chunk *ch,
                 unsigned slot) {
  kvti_iob_req *r = &reqs[ch->req];
  int fd = ch->direct ? r->dfd : r->fd;
  char *p = ch->buf + ch->done;
  unsigned n = (unsigned)(ch->len - ch->done);
  uint64_t off = ch->off + ch->done;
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
}

static int uring_run(kvti_iobatch *b, kvti_iob_req *reqs, size_t n, unsigned flags,
                     const char *path) {
  cursor cur = {reqs, n, 0, 0, b->chunk, flags};
  chunk slots[MAX_DEPTH];
  unsigned freelist[MAX_DEPTH], nfree = 0;
  unsigned again[MAX_DEPTH], nagain = 0; /* slots to resubmit */
  for (unsigned i = 0; i < b->depth; i++)
    freelist[nfree++] = b->depth - 1 - i;
  failure f = {0, 0, 0};
  unsigned inflight = 0;   /* prepared and not completed */
  unsigned unsubmitted = 0; /* prepared and not yet accepted by the kernel */
  /* The kernel takes at most 2^31 bytes per read/write: chunks are far smaller by config. */
  for (;;) {
    while (nagain > 0 || (f.os_errno == 0 && nfree > 0)) {
      unsigned slot;
      if (nagain > 0) {
        slot = again[--nagain];
      } else {
        chunk ch;
        if (!next_chunk(&cur, &ch))
          break;
        slot = freelist[--nfree];
        slots[slot] = ch;
      }
      struct io_uring_sqe *sqe = io_uring_get_sqe(&b->ring);
      if (!sqe) { /* cannot happen: the ring has depth entries; be safe anyway */
        again[nagain++] = slot;
        break;
      }
      prep(b, sqe, reqs, &slots[slot], slot);
      inflight++;
      unsubmitted++;
    }
    if (inflight == 0)
      break;
    int rc = kvti_io->uring_submit ? kvti_io->uring_submit(&b->ring, 1)
                                   : io_uring_submit_and_wait(&b->ring, 1);
    if (rc >= 0) {
      unsubmitted -= (unsigned)rc < unsubmitted ? (unsigned)rc : unsubmitted;
    } else if (rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
      /* The ring can no longer be trusted. Wait (outside the seam) for what the kernel did
       * accept so no request touches the caller's buffers after we return. */
      b->broken = 1;
      if (f.os_errno == 0) {
        f.os_errno = -rc;
        f.write = reqs[0].write;
        f.off = reqs[0].off;
      }
      if (reqs[0].status == 0)
        reqs[0].status = kvti_errno_to_code(-rc);
      unsigned kernel = inflight - unsubmitted;
      while (kernel > 0) {
        struct io_uring_cqe *cqe;
        if (io_uring_wait_cqe(&b->ring, &cqe) != 0)
          break;
        io_uring_cqe_seen(&b->ring, cqe);
        kernel--;
      }
      break;
    }
    unsigned head, seen = 0;
    struct io_uring_cqe *cqe;
    io_uring_for_each_cqe(&b->ring, head, cqe) {
      seen++;
      unsigned slot = (unsigned)io_uring_cqe_get_data64(cqe);
      chunk *ch = &slots[slot];
      kvti_iob_req *r = &reqs[ch->req];
      int res = cqe->res;
      if (kvti_io->uring_result)
        res = kvti_io->uring_result(r->write, ch->direct ? r->dfd : r->fd,
                                    ch->off + ch->done, (size_t)(ch->len - ch->done), res);
      inflight--;
      int v = judge(reqs, ch, res, &f);
      if (v == CH_AGAIN && f.os_errno == 0)
        again[nagain++] = slot;
      else
        freelist[nfree++] = slot;
    }
    io_uring_cq_advance(&b->ring, seen);
  }
  return finish(reqs, n, flags, &f, path);
}
#endif

/* ---------------------------------------------------------------- engine */

int kvti_iobatch_create(kvti_iobatch **out, const kvti_iob_cfg *cfg) {
  kvti_iob_cfg def = KVTI_IOB_CFG_INIT;
  if (!cfg)
    cfg = &def;
  if (cfg->backend != KVT_IO_AUTO && cfg->backend != KVT_IO_PORTABLE &&
      cfg->backend != KVT_IO_URING)
    return KVT_ERR(KVT_EINVAL, "io_backend must be 0 (auto), 1 (portable) or 2 (uring), got %d",
                   cfg->backend);
  kvti_iobatch *b = kvti_calloc(1, sizeof *b);
  if (!b)
    return KVT_ERR_NOMEM();
  b->requested = cfg->backend;
  b->depth = cfg->depth ? cfg->depth : 8;
  if (b->depth > MAX_DEPTH)
    b->depth = MAX_DEPTH;
  b->chunk = cfg->chunk ? cfg->chunk : (size_t)1 << 20;
  b->chunk = (b->chunk + KVTI_IOB_ALIGN - 1) & ~(size_t)(KVTI_IOB_ALIGN - 1);
  if (b->chunk > ((size_t)1 << 30))
    b->chunk = (size_t)1 << 30;
  b->threads = cfg->threads ? cfg->threads : 2;
  b->backend = KVT_IO_PORTABLE;
  if (cfg->backend != KVT_IO_PORTABLE) {
    int err = ENOSYS;
#if KVT_HAVE_URING
    if (kvti_io->uring_setup && kvti_io->uring_submit && kvti_io->uring_result) {
      int rc = kvti_io->uring_setup(b->depth, &b->ring, 0);
      if (rc == 0) {
        b->ring_ok = 1;
        b->backend = KVT_IO_URING;
        err = 0;
      } else {
        err = -rc;
      }
    }
#endif
    if (err != 0 && cfg->backend == KVT_IO_URING) {
      kvti_free(b);
      return KVT_ERR(KVT_EUNSUPPORTED, "io_uring backend unavailable: %s",
                     KVT_HAVE_URING ? strerror(err) : "not built with liburing");
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
#endif
  kvti_free(b);
}

int kvti_iobatch_backend(const kvti_iobatch *b) { return b->backend; }

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
  return KVT_ERR(KVT_EUNSUPPORTED, "buffer registration needs the io_uring backend");
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

int kvti_iobatch_run(kvti_iobatch *b, kvti_iob_req *reqs, size_t n, unsigned flags,
                     const char *path) {
  if (n > 0 && !reqs)
    return KVT_ERR(KVT_EINVAL, "iobatch: NULL request list");
  for (size_t i = 0; i < n; i++) {
    kvti_iob_req *r = &reqs[i];
    if (r->fd < 0 || (r->len > 0 && !r->buf) || r->off > (uint64_t)INT64_MAX ||
        r->len > (uint64_t)INT64_MAX - r->off)
      return KVT_ERR(KVT_EINVAL, "iobatch: invalid request %zu", i);
    r->done = 0;
    r->status = 0;
    r->eof_at_ = UINT64_MAX;
  }
  if (b->broken)
    return KVT_ERR(KVT_EIO, "iobatch: engine unusable after a ring failure");
#if KVT_HAVE_URING
  if (b->backend == KVT_IO_URING)
    return uring_run(b, reqs, n, flags, path);
#endif
  return portable_run(b, reqs, n, flags, path);
}

int kvti_iob_open_direct(const char *path, int flags, unsigned mode) {
#ifdef O_DIRECT
  int fd;
  do {
    fd = kvti_io->open(path, flags | O_DIRECT | O_NOFOLLOW | O_CLOEXEC, (mode_t)mode);
  } while (fd < 0 && errno == EINTR);
  return fd < 0 ? -1 : fd;
#else
  (void)path, (void)flags, (void)mode;
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

#define CACHE_MAX 8
static pthread_mutex_t cache_mu = PTHREAD_MUTEX_INITIALIZER;
static kvti_iobatch *cache[3];
static unsigned cache_n[3];

int kvti_iobatch_get(kvti_iobatch **out, int backend) {
  if (backend >= 0 && backend < 3) {
    pthread_mutex_lock(&cache_mu);
    kvti_iobatch *b = cache[backend];
    if (b) {
      cache[backend] = b->cache_next;
      cache_n[backend]--;
    }
    pthread_mutex_unlock(&cache_mu);
    if (b) {
      b->cache_next = NULL;
      *out = b;
      return 0;
    }
  }
  kvti_iob_cfg cfg = KVTI_IOB_CFG_INIT;
  cfg.backend = backend;
  return kvti_iobatch_create(out, &cfg);
}

void kvti_iobatch_put(kvti_iobatch *b) {
  if (!b)
    return;
  if (!b->broken && b->requested >= 0 && b->requested < 3) {
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
