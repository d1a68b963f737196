/*
 * iobatch.c - the batched I/O engine's entry points (see iobatch.h): engines
 * created (backend choice, configuration defaults and bounds, ring setup) and
 * freed; requests checked and initialised, then handed to the backend in use
 * (iobatch_portable.c, iobatch_uring.c) by push, run and the waits; fsync of
 * many descriptors; the O_DIRECT opens and the file advice helpers; and the
 * process-wide cache of engines. How a request is cut into chunks and a
 * completion judged, for both backends, is iobatch_chunk.c.
 *
 * Invariant: kvti_iobatch_run never returns while a request it issued may still
 * touch a caller's buffer (the ring is drained; portable workers are joined).
 */
#if !KVT_PORTABLE
#define _GNU_SOURCE 1 /* O_DIRECT */
#endif
#include "engine/iobatch_int.h"
#include "base/error.h"
#include "base/io.h"
#include "kvtier.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <string.h>
#include <unistd.h>

int kvti_iobatch_uring_built(void) {
  return KVT_HAVE_URING ? 1 : 0;
}

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
#ifdef IORING_FEAT_FAST_POLL
        b->async_buffered = (b->ring.features & IORING_FEAT_FAST_POLL) != 0;
#endif
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

int kvti_iobatch_push(kvti_iobatch *b, kvti_iob_req *r, unsigned flags,
                      const char *path) {
  if (!r || !kvti_iob_check_req(r))
    return KVT_ERR(KVT_EINVAL, "iobatch: invalid request");
  kvti_iob_req_init(r, flags, path);
  if (b->broken)
    return KVT_ERR(KVT_EIO, "iobatch: engine unusable after a ring failure");
  if (b->f.code) {
    r->status = KVT_ECANCELED;
    return kvti_iob_raise(&b->f);
  }
#if KVT_HAVE_URING
  if (b->backend == KVT_IO_URING)
    return kvti_iob_uring_push(b, r, (flags & KVTI_IOB_DEFER) != 0)
               ? kvti_iob_raise(&b->f)
               : 0;
#endif
  return kvti_iob_portable_push(b, r);
}

int kvti_iobatch_submit(kvti_iobatch *b) {
#if KVT_HAVE_URING
  if (b->backend == KVT_IO_URING && !b->broken)
    kvti_iob_uring_pump(b, 0);
#endif
  return b->f.code ? kvti_iob_raise(&b->f) : 0;
}

int kvti_iobatch_wait_req(kvti_iobatch *b, kvti_iob_req *r) {
#if KVT_HAVE_URING
  while (b->backend == KVT_IO_URING && r->pending_ > 0 && !b->broken)
    kvti_iob_uring_pump(b, 1);
#endif
  if (r->status == 0)
    return 0;
  if (b->f.code)
    kvti_iob_raise(&b->f);
  return r->status;
}

int kvti_iobatch_wait_all(kvti_iobatch *b) {
#if KVT_HAVE_URING
  while (b->backend == KVT_IO_URING && b->inflight > 0 && !b->broken)
    kvti_iob_uring_pump(b, 1);
#endif
  int code = b->f.code;
  if (code)
    kvti_iob_raise(&b->f);
  memset(&b->f, 0, sizeof b->f);
  return code;
}

int kvti_iobatch_run(kvti_iobatch *b, kvti_iob_req *reqs, size_t n,
                     unsigned flags, const char *path) {
  if (n > 0 && !reqs)
    return KVT_ERR(KVT_EINVAL, "iobatch: NULL request list");
  for (size_t i = 0; i < n; i++) {
    if (!kvti_iob_check_req(&reqs[i]))
      return KVT_ERR(KVT_EINVAL, "iobatch: invalid request %zu", i);
    kvti_iob_req_init(&reqs[i], flags, path);
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
      kvti_iob_uring_push(b, &reqs[i], 1); /* wait_all submits what is queued */
    }
    return kvti_iobatch_wait_all(b);
  }
#endif
  memset(&b->f, 0, sizeof b->f);
  return kvti_iob_portable_run(b, reqs, n);
}

int kvti_iobatch_fsync_many(kvti_iobatch *b, const int *fds, size_t n,
                            const char *const *paths) {
  int rc = kvti_iobatch_wait_all(b);
  if (rc)
    return rc;
#if KVT_HAVE_URING
  if (b->backend == KVT_IO_URING && !b->broken &&
      kvti_io->fsync == kvti_io_default.fsync)
    return kvti_iob_uring_fsync(b, fds, n, paths);
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
