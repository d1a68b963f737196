/*
 * iobatch_int.h - private to the batched I/O engine's files: the engine
 * object, the chunk a request is cut into, a batch's first failure, and what
 * each file lends the others. iobatch.c holds the entry points (create, push,
 * run, wait, fsync, the engine cache); below it, iobatch_chunk.c the request
 * checks, the chunk cursor and the judging of completions that both backends
 * share, iobatch_portable.c the pread/pwrite backend and iobatch_uring.c the
 * io_uring backend. Nothing here is seen outside src/engine/.
 */
#ifndef KVT_IOBATCH_INT_H
#define KVT_IOBATCH_INT_H

#include "engine/iobatch.h"

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <sys/uio.h>
#if KVT_HAVE_URING
#include <liburing.h>
#endif

/* Deepest ring: a cold chunked promote keeps 128 head extents of 64 KiB in
 * flight (8 MiB, as fio's 8 x 1 MiB); at 64 it had half the bytes and read
 * ~15% slower. */
#define MAX_DEPTH 256
#define MAX_REGS 16
#define MAX_RETRIES 1000

/* One piece of a request, transferred by one system call (retried and
 * continued in place until judged done or failed). */
typedef struct chunk {
  kvti_iob_req *r;
  char *buf; /* plain requests */
  uint64_t off, len, done;
  int direct;
  int retries;
  unsigned seg;  /* vectored requests: the segment holding the chunk's first */
  uint64_t skip; /* byte, and that byte's offset inside it */
} chunk;

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
  /* Buffered reads go to the kernel's workers (IOSQE_ASYNC): a read of
   * cached pages otherwise copies inline in io_uring_enter, on the one
   * submitting thread, and several in flight then copy one after the other;
   * on the workers they copy in parallel (a warm 1024-token promote measured
   * 6.8-7.4 GB/s against 5.6-5.8 inline, 2 cores). Set when the kernel takes
   * the flag (its ring reports IORING_FEAT_FAST_POLL, 5.7 on; the flag came
   * in 5.6). O_DIRECT reads and writes stay as they are: they wait for the
   * device, not for a copy. */
  int async_buffered;
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

static inline int kvti_iob_aligned(uint64_t v) {
  return (v & (KVTI_IOB_ALIGN - 1)) == 0;
}

/* ---- requests, chunks and completions (iobatch_chunk.c) ---- */

/* 1 when r is a valid request (descriptor, buffer or vectored segments
 * summing to len, offset and length within int64). */
int kvti_iob_check_req(const kvti_iob_req *r);
/* Resets r's results and cursor for a run or push with flags and path. */
void kvti_iob_req_init(kvti_iob_req *r, unsigned flags, const char *path);
/* Cuts the next chunk of at most max bytes off r into *ch (0 when r is fully
 * handed out). */
int kvti_iob_take_chunk(kvti_iob_req *r, size_t max, chunk *ch);
/* The iovec of vectored chunk ch's bytes not yet transferred ([done, len))
 * into out (cap entries, >= the chunk's pieces). Returns the count. */
unsigned kvti_iob_chunk_iov(const chunk *ch, struct iovec *out, unsigned cap);
/* Records an OS error of r at file offset off (r's status; f's first). */
void kvti_iob_fail_os(failure *f, kvti_iob_req *r, int os_errno, uint64_t off);
/* Raises f on the calling thread; returns its code. */
int kvti_iob_raise(const failure *f);
/* All chunks of r are complete: settles done and the short-read rule. */
void kvti_iob_req_finish(kvti_iob_req *r, failure *f);
/* Judges one completion (res = bytes or -errno) of chunk ch: CH_DONE,
 * CH_AGAIN (issue the chunk's rest again) or CH_FAILED (recorded in f). */
int kvti_iob_judge(chunk *ch, int64_t res, failure *f);

/* ---- the portable backend (iobatch_portable.c) ---- */

/* Runs requests reqs[0, n) (initialised) to completion on b's threads. */
int kvti_iob_portable_run(kvti_iobatch *b, kvti_iob_req *reqs, size_t n);
/* Performs request r (initialised) before returning. */
int kvti_iob_portable_push(kvti_iobatch *b, kvti_iob_req *r);

/* ---- the io_uring backend (iobatch_uring.c) ---- */

#if KVT_HAVE_URING
/* Queues every chunk of r (initialised), pumping while no slot is free;
 * without defer, hands the queue to the kernel without waiting. Returns b's
 * failure code (raised by the caller). */
int kvti_iob_uring_push(kvti_iobatch *b, kvti_iob_req *r, int defer);
/* Submits what is queued, waits for at least wait_nr completions (when any is
 * in flight) and processes every completion available. */
void kvti_iob_uring_pump(kvti_iobatch *b, unsigned wait_nr);
/* fsync of fds[0, n) in parallel through the ring (nothing else in flight).
 * Returns 0 or the first error (naming paths[i] when paths is given). */
int kvti_iob_uring_fsync(kvti_iobatch *b, const int *fds, size_t n,
                         const char *const *paths);
#endif

#endif
