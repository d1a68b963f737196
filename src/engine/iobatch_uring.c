/*
 * iobatch_uring.c - the io_uring backend of the batched I/O engine (Linux,
 * liburing): one chunk per slot, `depth` slots in flight, SQEs queued and
 * handed to the kernel through the io seam's uring_submit (its uring_result
 * sees every completion), completions judged as iobatch_chunk.c decides and
 * a retried chunk issued again in its slot; fsync of many descriptors in
 * parallel; buffer registration for fixed-buffer transfers. A build without
 * liburing has only registration's refusal.
 *
 * Invariant: when a submit fails for good, the kernel's accepted requests are
 * waited for (outside the seam) before the failure is returned and the ring
 * is never used again, so no request touches a caller's buffer afterwards.
 */
#if !KVT_PORTABLE
#define _GNU_SOURCE 1 /* as iobatch.c, which shares the engine struct */
#endif
#include "engine/iobatch_int.h"
#include "base/error.h"
#include "base/io.h"
#include "kvtier.h"

#include <errno.h>
#include <string.h>

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
    kvti_iob_fail_os(&b->f, r, ENOMEM, ch->off + ch->done);
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
    kvti_iob_fail_os(&b->f, r, EBUSY, ch->off + ch->done);
    u_chunk_done(b, slot, 0);
    return;
  }
  int fd = ch->direct ? r->dfd : r->fd;
  uint64_t off = ch->off + ch->done;
  if (r->iov) {
    struct iovec *v = b->slot_iov[slot];
    io_uring_prep_readv(sqe, fd, v, kvti_iob_chunk_iov(ch, v, KVTI_IOB_MAX_IOV),
                        off);
    io_uring_sqe_set_data64(sqe, slot);
    if (!ch->direct && !r->write && b->async_buffered)
      io_uring_sqe_set_flags(sqe, IOSQE_ASYNC);
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
    if (!ch->direct && b->async_buffered)
      io_uring_sqe_set_flags(sqe, IOSQE_ASYNC);
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
    kvti_iob_req_finish(r, &b->f);
}

/* Submits what is queued, waits for at least wait_nr completions (when any is
 * in flight) and processes every completion available. */
void kvti_iob_uring_pump(kvti_iobatch *b, unsigned wait_nr) {
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
      kvti_iob_fail_os(&b->f, r, -rc, b->slots[i].off);
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
    int v = kvti_iob_judge(ch, res, &b->f);
    if (v == CH_AGAIN && b->f.code == 0 && !b->broken)
      u_issue(b, slot);
    else
      u_chunk_done(b, slot, v == CH_AGAIN);
  }
  io_uring_cq_advance(&b->ring, seen);
}

int kvti_iob_uring_push(kvti_iobatch *b, kvti_iob_req *r, int defer) {
  while (b->f.code == 0 && !b->broken && r->pos_ < r->len) {
    if (b->nfree == 0) {
      kvti_iob_uring_pump(b, 1);
      continue;
    }
    unsigned slot = b->freelist[--b->nfree];
    kvti_iob_take_chunk(r, b->chunk, &b->slots[slot]);
    b->inuse[slot] = 1;
    r->pending_++;
    u_issue(b, slot);
  }
  if (r->len == 0)
    kvti_iob_req_finish(r, &b->f);
  else if (r->pos_ < r->len && r->status == 0)
    r->status = KVT_ECANCELED;
  if (!defer) /* hand the queued chunks to the kernel without waiting */
    kvti_iob_uring_pump(b, 0);
  return b->f.code;
}

int kvti_iob_uring_fsync(kvti_iobatch *b, const int *fds, size_t n,
                         const char *const *paths) {
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
      for (size_t i = 0; i < n; i++) { /* again for all: fsync is idempotent */
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
