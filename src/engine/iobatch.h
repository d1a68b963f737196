/*
 * iobatch.h - the batched file I/O engine for large tensor data. A caller (the
 * entry writer and reader) describes a list of reads or writes - (fd, buffer,
 * length, offset) - and kvti_iobatch_run completes them all, splitting each
 * into chunks kept several at a time in flight. Two backends: io_uring (Linux,
 * liburing, KVT_HAVE_URING) with `depth` requests in flight and optional
 * registered buffers, and a portable pread/pwrite backend (every platform) that
 * uses up to `threads` threads for big batches. Each request may name a second
 * descriptor of the same file opened with O_DIRECT (kvti_iob_open_direct): the
 * 4096-aligned part of a request whose buffer and offset are aligned then
 * bypasses the page cache; unaligned requests and tails use the buffered
 * descriptor, so any layout works and alignment only buys speed. A read may
 * be vectored (a contiguous file range into scattered buffers: preadv, or
 * io_uring's readv), so head extents bound for different places in memory
 * still travel in requests of about a chunk.
 *
 * Every system call goes through the io seam (io.h): pread/pwrite/open for the
 * portable path, uring_setup/uring_submit/uring_result for io_uring, so tests
 * inject failures and short transfers into either backend.
 *
 * Threads: an engine is used by one thread at a time (it owns a ring).
 * kvti_iobatch_get/put hand out cached engines to any thread (thread-safe).
 */
#ifndef KVT_IOBATCH_H
#define KVT_IOBATCH_H

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#define KVTI_IOB_ALIGN 4096u

typedef struct kvti_iob_req {
  int fd;    /* buffered descriptor (required) */
  int dfd;   /* O_DIRECT descriptor of the same file, or -1 */
  int write; /* 0 = read into buf, 1 = write from buf */
  void *buf;
  uint64_t len;
  uint64_t off;
  /* Results, written by kvti_iobatch_run. */
  uint64_t done; /* bytes transferred; a read stops early only at end of file */
  int status;    /* 0 or a negative kvt code */
  /* Internal (set by run/push). */
  uint64_t eof_at_;
  uint64_t pos_;     /* next byte to hand to a chunk */
  unsigned pending_; /* chunks issued and not yet completed */
  unsigned flags_;
  const char *path_;
  unsigned segi_;   /* vectored: the segment holding byte pos_ */
  uint64_t segoff_; /* and pos_'s offset inside it */
  /* Vectored read (optional; NULL/0 for a plain request): the file range
   * [off, off + len) is scattered over iov[0..iovcnt) in order, and buf is
   * ignored. len must equal the sum of the segment lengths (else the request
   * is invalid). Reads only. The array must stay untouched until the request
   * completed. A segment may be of any length; a chunk goes to the O_DIRECT
   * descriptor only when its offset and every piece of it (address and
   * length) are 4096-aligned. */
  const struct iovec *iov;
  unsigned iovcnt;
} kvti_iob_req;

/* Segments per system call at most (Linux's UIO_MAXIOV is 1024): a chunk of
 * a vectored request ends early where its segments would exceed this. */
#define KVTI_IOB_MAX_IOV 256u

/* kvti_iobatch_run flags. */
#define KVTI_IOB_ALLOW_SHORT                                                   \
  0x1u /* a read ending at EOF is not an error (done < len) */
#define KVTI_IOB_NO_DIRECT 0x2u /* ignore dfd (use the page cache) */
/* kvti_iobatch_push only: queue the request's chunks without handing them to
 * the kernel; they go with the next push without the flag, a wait,
 * kvti_iobatch_submit, or as soon as every slot is busy. Many small requests
 * then share one io_uring_enter (one per 64 KiB head extent cost ~25% of a
 * cold chunked promote in system calls). No effect on the portable backend. */
#define KVTI_IOB_DEFER 0x4u

typedef struct kvti_iobatch kvti_iobatch;

typedef struct kvti_iob_cfg {
  int backend; /* kvt_io_backend: KVT_IO_AUTO, KVT_IO_PORTABLE, KVT_IO_URING */
  unsigned depth;   /* requests in flight (io_uring); 0 = 8, at most 256 */
  size_t chunk;     /* bytes per request; 0 = 1 MiB; rounded to 4096 */
  unsigned threads; /* portable backend: max threads per batch incl. the caller;
                       0 = 2 */
} kvti_iob_cfg;
#define KVTI_IOB_CFG_INIT                                                      \
  { 0, 0, 0, 0 }

/* Creates an engine. KVT_IO_AUTO picks io_uring when built and usable (ring
 * setup succeeds), else portable. KVT_IO_URING fails with KVT_EUNSUPPORTED when
 * io_uring is not built in or cannot be set up (ENOSYS/EPERM in sandboxes).
 * Returns 0, KVT_EINVAL, KVT_EUNSUPPORTED, KVT_ENOMEM. */
int kvti_iobatch_create(kvti_iobatch **out, const kvti_iob_cfg *cfg);
void kvti_iobatch_free(kvti_iobatch *b); /* accepts NULL */
/* KVT_IO_URING or KVT_IO_PORTABLE: the backend actually in use. */
int kvti_iobatch_backend(const kvti_iobatch *b);
/* Nonzero when this build has the io_uring backend compiled in. */
int kvti_iobatch_uring_built(void);

/* Registers a buffer region with the ring (io_uring only; up to 16 regions) so
 * requests whose buffers lie entirely inside it use fixed-buffer operations (no
 * per-request page pinning). Best effort: returns 0 when registered,
 * KVT_EUNSUPPORTED when the backend is portable or the kernel refused (e.g.
 * RLIMIT_MEMLOCK); I/O works the same either way. Regions must stay valid until
 * kvti_iobatch_unregister or free. */
int kvti_iobatch_register(kvti_iobatch *b, void *base, size_t len);
void kvti_iobatch_unregister(kvti_iobatch *b);

/* Runs every request to completion. Returns 0 when all succeeded; else the
 * first failure's code (each request's status says which failed; after a
 * failure no new chunk is started, chunks in flight are drained, and the
 * contents of the failed requests' buffers / file ranges are undefined). A read
 * reaching EOF early fails with KVT_ECORRUPT ("truncated") unless
 * KVTI_IOB_ALLOW_SHORT. Errors carry the path when given (NULL: "fd N"). */
int kvti_iobatch_run(kvti_iobatch *b, kvti_iob_req *reqs, size_t n,
                     unsigned flags, const char *path);

/* Pipelined use, for a producer that prepares the next buffer while earlier
 * ones are in flight (the staged file writer). kvti_iobatch_push starts one
 * request and returns once it is submitted (io_uring: it blocks only while
 * `depth` chunks are already in flight; portable: the request is performed
 * before return). The request, its buffer and path must stay untouched until
 * kvti_iobatch_wait_req(r) or kvti_iobatch_wait_all returned. wait_req returns
 * r's status (raising its error on this thread); wait_all completes everything
 * pushed and returns the first failure since the previous wait_all (then
 * forgotten). After a failure further pushes return it without starting
 * anything until wait_all. Same flags as run. */
int kvti_iobatch_push(kvti_iobatch *b, kvti_iob_req *r, unsigned flags,
                      const char *path);
/* Hands every request queued with KVTI_IOB_DEFER to the kernel without
 * waiting. Returns 0 or the engine's failure (as push). */
int kvti_iobatch_submit(kvti_iobatch *b);
int kvti_iobatch_wait_req(kvti_iobatch *b, kvti_iob_req *r);
int kvti_iobatch_wait_all(kvti_iobatch *b);

/* fsync of n descriptors at once: through io_uring (in parallel, so the file
 * system can commit them together) when b is an io_uring engine and the io
 * table's fsync is the default one; otherwise kvti_fsync one after the other.
 * Waits for everything pushed first. Returns 0 or the first error (naming
 * paths[i] when paths is given). */
int kvti_iobatch_fsync_many(kvti_iobatch *b, const int *fds, size_t n,
                            const char *const *paths);

/* Opens path with O_DIRECT added to flags (through the io seam). Returns the
 * fd, or -1 when the platform or the file system has no O_DIRECT (the error is
 * not set: callers just use the buffered descriptor). */
int kvti_iob_open_direct(const char *path, int flags, unsigned mode);
/* The same for name relative to directory descriptor dirfd (O_NOFOLLOW). */
int kvti_iob_open_direct_at(int dirfd, const char *name, int flags,
                            unsigned mode);

/* A process-wide cache of engines per backend so promotes and spills do not set
 * up a ring per call. get returns a cached engine or creates one (same codes as
 * create); put returns it (engines beyond a small bound are freed).
 * kvti_iobatch_cache_drain frees cached engines. get_cfg is get for an engine
 * of cfg's depth, chunk and threads (a cached one of the same configuration,
 * else a new one; the cache holds engines of several configurations). */
int kvti_iobatch_get(kvti_iobatch **out, int backend);
int kvti_iobatch_get_cfg(kvti_iobatch **out, const kvti_iob_cfg *cfg);
void kvti_iobatch_put(kvti_iobatch *b);
void kvti_iobatch_cache_drain(void);

/* Advice helpers through the io seam (no-ops where unsupported): drop a file's
 * pages from the page cache (after fsync: used by benchmarks for cold reads)
 * and preallocate. Return 0 or a negative kvt code. */
int kvti_iob_drop_cache(int fd);
int kvti_iob_preallocate(int fd, uint64_t len);

#endif
