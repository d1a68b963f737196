/*
 * fwriter.c - the staged file writer (see fwriter.h). NSTAGE staging buffers of
 * STAGE bytes rotate: the caller's bytes are copied (in cache-sized pieces,
 * each hashed right after its copy) into the current buffer; a full buffer is
 * pushed as one aligned write and the next buffer is waited for (its previous
 * write must have completed) before it is refilled. Staging buffers come from a
 * bufpool, so steady-state spills allocate nothing.
 */
#include "fwriter.h"
#include "error.h"
#include "hash.h"
#include "io.h"
#include "iobatch.h"
#include "kvtier.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <unistd.h>

#define NSTAGE 6
#define STAGE ((size_t)1 << 20)
#define PIECE                                                                  \
  ((size_t)64 << 10) /* copy+hash granularity: stays in L1/L2 between the two  \
                      */

struct kvti_fwriter {
  char *path;
  int fd, dfd;
  kvti_iobatch *b;
  kvti_bufpool *pool;
  kvti_xxh3_state *h;
  char *stage[NSTAGE];
  kvti_iob_req req[NSTAGE];
  int busy[NSTAGE]; /* req[k] pushed and not yet waited for */
  unsigned k;       /* current stage */
  size_t fill;      /* bytes in stage[k] */
  uint64_t off;     /* file offset of stage[k] */
  uint64_t prealloc;
  int err;
};

static void release(kvti_fwriter *w, int remove) {
  if (w->b) {
    kvti_iobatch_wait_all(
        w->b); /* no write may touch a staging buffer after this */
    kvti_iobatch_put(w->b);
  }
  for (int i = 0; i < NSTAGE; i++)
    kvti_bufpool_put(w->pool, w->stage[i], STAGE);
  if (w->dfd >= 0)
    kvti_io->close(w->dfd);
  if (w->fd >= 0)
    kvti_io->close(w->fd);
  if (remove && w->path)
    kvti_io->unlink(w->path);
  if (w->h)
    kvti_xxh3_free(w->h);
  if (w->pool)
    kvti_bufpool_release(w->pool);
  kvti_free(w->path);
  kvti_free(w);
}

int kvti_fwriter_open(kvti_fwriter **out, const char *path,
                      const kvti_fwriter_opts *o) {
  kvti_fwriter_opts def = KVTI_FWRITER_OPTS_INIT;
  if (!o)
    o = &def;
  kvti_fwriter *w = kvti_calloc(1, sizeof *w);
  if (!w)
    return KVT_ERR_NOMEM();
  w->fd = w->dfd = -1;
  w->pool = o->pool ? o->pool : kvti_bufpool_default();
  if (!w->pool) {
    kvti_free(w);
    return KVT_ERR_NOMEM();
  }
  kvti_bufpool_retain(w->pool);
  int rc = 0;
  w->path = kvti_strdup(path);
  if (!w->path) {
    rc = KVT_ENOMEM;
    goto fail;
  }
  if (o->hash && !(w->h = kvti_xxh3_new())) {
    rc = KVT_ERR_NOMEM();
    goto fail;
  }
  int flags = O_WRONLY | O_CREAT | (o->excl ? O_EXCL : O_TRUNC);
  mode_t mode = o->file_mode ? (mode_t)o->file_mode : 0600;
  w->fd = kvti_open(path, flags, mode);
  if (w->fd < 0) {
    rc = w->fd;
    w->fd = -1;
    kvti_free(w->path);
    w->path = NULL; /* not ours to remove (e.g. O_EXCL on an existing file) */
    goto fail;
  }
  if (!o->no_direct)
    w->dfd = kvti_iob_open_direct(path, O_WRONLY, 0);
  if (o->size_hint >= STAGE) {
    rc = kvti_iob_preallocate(w->fd, o->size_hint);
    if (rc)
      goto fail;
    w->prealloc = o->size_hint;
  }
  rc = kvti_iobatch_get(&w->b, o->backend);
  if (rc) {
    w->b = NULL;
    goto fail;
  }
  *out = w;
  return 0;
fail:
  release(w, 1);
  return rc;
}

/* Pushes stage k (len bytes at w->off) and makes the next stage current,
 * waiting for its previous write to finish. */
static int flush_stage(kvti_fwriter *w, size_t len) {
  unsigned k = w->k;
  w->req[k] = (kvti_iob_req){w->fd, w->dfd, 1, w->stage[k], len, w->off, 0,
                             0,     0,      0, 0,           0,   NULL};
  w->busy[k] = 1;
  int rc = kvti_iobatch_push(w->b, &w->req[k], 0, w->path);
  w->off += len;
  w->fill = 0;
  w->k = (k + 1) % NSTAGE;
  if (rc == 0 && w->busy[w->k]) {
    w->busy[w->k] = 0;
    rc = kvti_iobatch_wait_req(w->b, &w->req[w->k]);
  }
  return rc;
}

int kvti_fwriter_append(kvti_fwriter *w, const void *data, size_t len) {
  if (w->err)
    return w->err;
  const char *p = data;
  while (len > 0) {
    if (!w->stage[w->k]) {
      w->stage[w->k] = kvti_bufpool_get(w->pool, STAGE, NULL);
      if (!w->stage[w->k])
        return w->err = KVT_ENOMEM;
    }
    size_t n = STAGE - w->fill;
    if (n > len)
      n = len;
    if (n > PIECE)
      n = PIECE;
    char *dst = w->stage[w->k] + w->fill;
    memcpy(dst, p, n);
    if (w->h)
      kvti_xxh3_update(w->h, dst, n);
    w->fill += n;
    p += n;
    len -= n;
    if (w->fill == STAGE) {
      int rc = flush_stage(w, STAGE);
      if (rc)
        return w->err = rc;
    }
  }
  return 0;
}

int kvti_fwriter_finish(kvti_fwriter *w, uint64_t *size, uint64_t *xxh3,
                        int do_fsync) {
  int rc = w->err;
  if (rc == 0 && w->fill > 0) {
    unsigned k = w->k;
    w->req[k] = (kvti_iob_req){
        w->fd, w->dfd, 1, w->stage[k], w->fill, w->off, 0, 0, 0, 0, 0, 0, NULL};
    rc = kvti_iobatch_push(w->b, &w->req[k], 0, w->path);
    w->off += w->fill;
    w->fill = 0;
  }
  int rc2 = kvti_iobatch_wait_all(w->b);
  if (rc == 0)
    rc = rc2;
  if (rc == 0 && w->prealloc > w->off &&
      kvti_io->ftruncate(w->fd, (off_t)w->off) != 0)
    rc = KVT_ERR_OS(errno, "truncate %s", w->path);
  if (rc == 0 && do_fsync)
    rc = kvti_fsync(w->fd, w->path);
  if (rc == 0) {
    int fd = w->fd;
    w->fd = -1;
    if (kvti_io->close(fd) != 0 && errno != EINTR)
      rc = KVT_ERR_OS(errno, "close %s", w->path);
  }
  if (rc == 0) {
    if (size)
      *size = w->off;
    if (xxh3)
      *xxh3 = w->h ? kvti_xxh3_digest(w->h) : 0;
  }
  release(w, rc != 0);
  return rc;
}

void kvti_fwriter_abort(kvti_fwriter *w) {
  if (w)
    release(w, 1);
}
