/*
 * iobatch_portable.c - the portable backend of the batched I/O engine (every
 * platform): each chunk through the io seam's pread/pwrite (preadv, or one
 * pread per segment, for a vectored read), retried and continued as
 * iobatch_chunk.c judges. A batch of at least THREAD_MIN_BYTES runs on up to
 * `threads` threads including the caller, each taking the next chunk under
 * one lock and merging its end of file and failure back under it; a push is
 * performed before it returns.
 *
 * Invariant: every worker thread is joined before a run returns, so no
 * transfer touches a caller's buffer afterwards.
 */
#if !KVT_PORTABLE
#define _GNU_SOURCE 1 /* as iobatch.c, which shares the engine struct */
#endif
#include "engine/iobatch_int.h"
#include "base/io.h"
#include "kvtier.h"

#include <errno.h>
#include <pthread.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

/* Batches smaller than this run on the calling thread only (thread start-up
 * would dominate). */
#define THREAD_MIN_BYTES (4u << 20)

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
      got = read_vec(fd, v, kvti_iob_chunk_iov(ch, v, KVTI_IOB_MAX_IOV), off);
    else
      got = r->write ? kvti_io->pwrite(fd, p, n, off)
                     : kvti_io->pread(fd, p, n, off);
    int64_t res = got < 0 ? -(int64_t)errno : (int64_t)got;
    if (kvti_iob_judge(ch, res, f) != CH_AGAIN)
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
    if (kvti_iob_take_chunk(&j->reqs[j->i], j->chunk, ch))
      return 1;
    j->i++;
  }
  return 0;
}

static void *portable_worker(void *arg) {
  pjob *j = arg;
  for (;;) {
    chunk ch;
    /* kvti_iob_judge() updates the request's eof_at_/status, which another
     * worker may be updating for another chunk of the same request: each chunk
     * works on a private copy of the request (taken under the lock, as pos_
     * changes under it) and merges back under the lock. */
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

int kvti_iob_portable_run(kvti_iobatch *b, kvti_iob_req *reqs, size_t n) {
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
    kvti_iob_req_finish(&reqs[i], &j.f);
  }
  return j.f.code ? kvti_iob_raise(&j.f) : 0;
}

/* Synchronous push (portable backend): the request is done before return. */
int kvti_iob_portable_push(kvti_iobatch *b, kvti_iob_req *r) {
  chunk ch;
  while (b->f.code == 0 && kvti_iob_take_chunk(r, b->chunk, &ch))
    portable_chunk(&ch, &b->f);
  if (r->pos_ < r->len && r->status == 0)
    r->status = KVT_ECANCELED;
  kvti_iob_req_finish(r, &b->f);
  return b->f.code ? kvti_iob_raise(&b->f) : 0;
}
