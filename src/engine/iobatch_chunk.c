/*
 * iobatch_chunk.c - what both backends of the batched I/O engine share
 * (iobatch_int.h): request checks, and one cursor that cuts requests into
 * chunks: a chunk goes to the O_DIRECT descriptor when its buffer, offset and
 * length are 4096-aligned, otherwise to the buffered one (so an unaligned
 * tail is just a final buffered chunk). Completions are judged by one
 * function for both backends: EINTR/EAGAIN retry, a short transfer is
 * continued (through the buffered descriptor when the remainder is no longer
 * aligned), a zero-byte read marks end of file, O_DIRECT refused with EINVAL
 * falls back to buffered, anything else fails the batch. Errors are recorded
 * as (errno, offset) and raised on the calling thread at the end, because
 * portable worker threads have their own thread-local error slot.
 */
#if !KVT_PORTABLE
#define _GNU_SOURCE 1 /* as iobatch.c, which shares the engine struct */
#endif
#include "engine/iobatch_int.h"
#include "base/error.h"
#include "kvtier.h"

#include <errno.h>
#include <stdio.h>

void kvti_iob_req_init(kvti_iob_req *r, unsigned flags, const char *path) {
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
  int can =
      r->dfd >= 0 && !(r->flags_ & KVTI_IOB_NO_DIRECT) && kvti_iob_aligned(off);
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
    int ok =
        kvti_iob_aligned((uint64_t)(uintptr_t)r->iov[seg].iov_base + skip) &&
        kvti_iob_aligned(take);
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
unsigned kvti_iob_chunk_iov(const chunk *ch, struct iovec *out, unsigned cap) {
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
int kvti_iob_take_chunk(kvti_iob_req *r, size_t max, chunk *ch) {
  if (r->pos_ >= r->len)
    return 0;
  if (r->iov)
    return take_vec_chunk(r, max, ch);
  uint64_t rem = r->len - r->pos_;
  char *buf = (char *)r->buf + r->pos_;
  uint64_t off = r->off + r->pos_;
  int direct = r->dfd >= 0 && !(r->flags_ & KVTI_IOB_NO_DIRECT) &&
               kvti_iob_aligned((uint64_t)(uintptr_t)buf) &&
               kvti_iob_aligned(off) && rem >= KVTI_IOB_ALIGN;
  uint64_t len = direct ? rem & ~(uint64_t)(KVTI_IOB_ALIGN - 1) : rem;
  if (len > max)
    len = max;
  *ch = (chunk){r, buf, off, len, 0, direct, 0, 0, 0};
  r->pos_ += len;
  return 1;
}

void kvti_iob_fail_os(failure *f, kvti_iob_req *r, int os_errno, uint64_t off) {
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

int kvti_iob_raise(const failure *f) {
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
void kvti_iob_req_finish(kvti_iob_req *r, failure *f) {
  r->done = r->eof_at_ == UINT64_MAX ? r->len : r->eof_at_ - r->off;
  if (r->status == 0 && r->done < r->len &&
      !(r->flags_ & KVTI_IOB_ALLOW_SHORT)) {
    r->status = KVT_ECORRUPT;
    if (f->code == 0)
      *f = (failure){KVT_ECORRUPT, 0,       0,      r->fd,
                     r->off,       r->done, r->len, r->path_};
  }
}

/* Judges one completion (res = bytes or -errno) of chunk ch. */
int kvti_iob_judge(chunk *ch, int64_t res, failure *f) {
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
    kvti_iob_fail_os(f, r, (int)-res, ch->off + ch->done);
    return CH_FAILED;
  }
  if (res == 0) {
    if (r->write) {
      kvti_iob_fail_os(f, r, EIO, ch->off + ch->done);
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
  if (ch->direct && !kvti_iob_aligned(ch->done))
    ch->direct = 0;
  return CH_AGAIN;
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

int kvti_iob_check_req(const kvti_iob_req *r) {
  return r->fd >= 0 && (r->iov ? check_vec(r) : (r->len == 0 || r->buf)) &&
         r->off <= (uint64_t)INT64_MAX &&
         r->len <= (uint64_t)INT64_MAX - r->off;
}
