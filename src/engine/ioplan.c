/*
 * ioplan.c - the read planner (see ioplan.h). One walk over the extents
 * serves twice: first it only counts requests and segments, then it fills
 * arrays of exactly that size, so a plan is two allocations whatever its
 * length. A request stays open while the next byte is the file byte right
 * after it and it has room; it closes at a gap in the file, at `limit`
 * bytes, or when a new segment would exceed `max_iov`.
 */
#include "engine/ioplan.h"
#include "base/error.h"
#include "base/io.h"
#include "kvtier.h"

#include <string.h>

typedef struct walk {
  kvti_ioplan *fill; /* NULL: count only */
  int fd, dfd;
  size_t nreq, nseg;
  /* The open request (when open): its file range, first segment, segment
   * count, and where its last segment ends in memory. */
  int open;
  uint64_t off, len;
  size_t seg0, segs;
  char *end;
} walk;

static void close_req(walk *w) {
  if (!w->open)
    return;
  if (w->fill) {
    kvti_iob_req *r = &w->fill->reqs[w->nreq];
    memset(r, 0, sizeof *r);
    r->fd = w->fd;
    r->dfd = w->dfd;
    r->off = w->off;
    r->len = w->len;
    if (w->segs == 1) {
      r->buf = w->fill->iov[w->seg0].iov_base;
    } else {
      r->iov = &w->fill->iov[w->seg0];
      r->iovcnt = (unsigned)w->segs;
    }
  }
  w->nreq++;
  w->open = 0;
}

/* Adds take bytes of the file at off, bound for p, to the open request. */
static void add(walk *w, uint64_t off, char *p, uint64_t take) {
  if (!w->open) {
    w->open = 1;
    w->off = off;
    w->len = 0;
    w->seg0 = w->nseg;
    w->segs = 0;
    w->end = NULL;
  }
  if (w->segs > 0 && w->end == p) {
    if (w->fill)
      w->fill->iov[w->nseg - 1].iov_len += (size_t)take;
  } else {
    if (w->fill) {
      w->fill->iov[w->nseg].iov_base = p;
      w->fill->iov[w->nseg].iov_len = (size_t)take;
    }
    w->nseg++;
    w->segs++;
  }
  w->len += take;
  w->end = p + take;
}

static int run(walk *w, const kvti_ioplan_ext *ext, size_t n, uint64_t limit,
               unsigned max_iov) {
  uint64_t prev_end = 0;
  int any = 0;
  for (size_t i = 0; i < n; i++) {
    const kvti_ioplan_ext *e = &ext[i];
    if (e->len == 0)
      continue;
    if (!e->buf || e->off > (uint64_t)INT64_MAX ||
        e->len > (uint64_t)INT64_MAX - e->off || e->len > SIZE_MAX ||
        (any && e->off < prev_end))
      return KVT_ERR(KVT_EINVAL,
                     "read plan: extent %zu (offset %llu, %llu bytes) is "
                     "out of order, overlapping or out of range",
                     i, (unsigned long long)e->off, (unsigned long long)e->len);
    any = 1;
    prev_end = e->off + e->len;
    for (uint64_t pos = 0; pos < e->len;) {
      uint64_t off = e->off + pos;
      char *p = (char *)e->buf + pos;
      if (w->open) {
        int merges = w->segs > 0 && w->end == p;
        if (off != w->off + w->len || w->len >= limit ||
            (!merges && w->segs >= max_iov))
          close_req(w);
      }
      uint64_t room = limit - (w->open ? w->len : 0);
      uint64_t take = e->len - pos < room ? e->len - pos : room;
      add(w, off, p, take);
      pos += take;
    }
  }
  close_req(w);
  return 0;
}

int kvti_ioplan_build(kvti_ioplan *p, const kvti_ioplan_ext *ext, size_t n,
                      int fd, int dfd, uint64_t limit, unsigned max_iov) {
  if (!p)
    return KVT_ERR(KVT_EINVAL, "read plan: NULL plan");
  memset(p, 0, sizeof *p);
  if ((n && !ext) || limit == 0)
    return KVT_ERR(KVT_EINVAL, "read plan: no extents or a zero limit");
  if (max_iov == 0 || max_iov > KVTI_IOB_MAX_IOV)
    max_iov = KVTI_IOB_MAX_IOV;
  walk w;
  memset(&w, 0, sizeof w);
  w.fd = fd;
  w.dfd = dfd;
  int rc = run(&w, ext, n, limit, max_iov);
  if (rc)
    return rc;
  size_t nreq = w.nreq, nseg = w.nseg;
  p->reqs = kvti_calloc(nreq ? nreq : 1, sizeof *p->reqs);
  p->iov = kvti_calloc(nseg ? nseg : 1, sizeof *p->iov);
  if (!p->reqs || !p->iov) {
    kvti_ioplan_free(p);
    return KVT_ERR_NOMEM();
  }
  memset(&w, 0, sizeof w);
  w.fill = p;
  w.fd = fd;
  w.dfd = dfd;
  run(&w, ext, n, limit, max_iov); /* validated above: cannot fail */
  p->n = nreq;
  p->niov = nseg;
  for (size_t i = 0; i < nreq; i++)
    p->bytes += p->reqs[i].len;
  return 0;
}

void kvti_ioplan_free(kvti_ioplan *p) {
  if (!p)
    return;
  kvti_free(p->reqs);
  kvti_free(p->iov);
  memset(p, 0, sizeof *p);
}
