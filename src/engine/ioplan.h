/*
 * ioplan.h - turns the extents one read needs from a file (a file range and
 * where its bytes go in memory) into requests for the batched engine of at
 * most `limit` bytes each. Extents adjacent in the file are coalesced into
 * one request whatever their destinations (a vectored read: the engine's
 * preadv or io_uring readv), extents adjacent in memory as well share one
 * segment, and an extent longer than the limit is cut. So a chunk file of
 * 64 KiB head extents bound for 16 different places in each destination
 * tensor is read in requests of 1 MiB, as fio reads, instead of one request
 * per extent.
 *
 * Invariants of a plan: requests are in file order, their file ranges are
 * disjoint, each is at most `limit` bytes and `max_iov` segments, and
 * together they cover every byte of every extent exactly once, each byte
 * landing where its extent says. A request of one segment is a plain one
 * (buf set, iov NULL), so registered buffers and the plain path still apply.
 *
 * Threads: a plan is plain data; build and free it on any thread.
 */
#ifndef KVT_IOPLAN_H
#define KVT_IOPLAN_H

#include "engine/iobatch.h"

#include <stddef.h>
#include <stdint.h>

/* One extent: len bytes of the file at off, to be read into buf. */
typedef struct kvti_ioplan_ext {
  uint64_t off;
  void *buf;
  uint64_t len;
} kvti_ioplan_ext;

typedef struct kvti_ioplan {
  kvti_iob_req *reqs; /* n requests, in file order (fd/dfd as given) */
  size_t n;
  struct iovec *iov; /* every vectored request's segments, in order */
  size_t niov;
  uint64_t bytes; /* sum of the extents' lengths */
} kvti_ioplan;

/* Plans the reads of ext[0..n) from the file open as fd (dfd: its O_DIRECT
 * descriptor or -1). The extents must be in ascending file order and must
 * not overlap (zero-length extents are skipped); limit >= 1 bounds each
 * request's bytes (a multiple of 4096 keeps the cuts of an aligned range
 * aligned); max_iov bounds its segments (0 or more than KVTI_IOB_MAX_IOV:
 * KVTI_IOB_MAX_IOV). Returns 0, KVT_EINVAL (unsorted or overlapping extents,
 * limit 0, a range past INT64_MAX), or KVT_ENOMEM; on failure *p is empty.
 * The requests point into p->iov: keep p until they completed. */
int kvti_ioplan_build(kvti_ioplan *p, const kvti_ioplan_ext *ext, size_t n,
                      int fd, int dfd, uint64_t limit, unsigned max_iov);
void kvti_ioplan_free(kvti_ioplan *p); /* accepts NULL and an empty plan */

#endif
