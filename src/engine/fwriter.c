/*
 * fwriter.c - the staged group writer (see fwriter.h). A group owns one I/O
 * engine and a ring of NSTAGE staging buffers of STAGE bytes shared by its
 * files: the current file's bytes are copied (in cache-sized pieces, each
 * hashed right after its copy) into the current buffer; a full buffer - or a
 * file's last partial one at close - is pushed as one write at the file's
 * offset and the ring advances, waiting only for the next buffer's previous
 * write. Files stay open until finish (or a checkpoint every MAX_OPEN files),
 * which waits for all writes, trims preallocations and fsyncs them all at once.
 * Staging buffers come from a bufpool, so steady state allocates nothing.
 * A file may reserve its first bytes for a header known only after its data
 * (a chunk's block checksums): appends start past the reserve, and the head
 * is one buffered pwrite at offset 0 before close, covered by the same fsync.
 */
#include "engine/fwriter.h"
#include "base/error.h"
#include "base/hash.h"
#include "base/io.h"
#include "engine/iobatch.h"
#include "kvtier.h"

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#define NSTAGE 8
/* One huge page: the pool hands out buffers of this size huge-page aligned
 * and advised (bufpool.h), so a staged write reaches the disk as one segment
 * per 2 MiB instead of one per 4 KiB page. */
#define STAGE ((size_t)2 << 20)
/* Copy+hash granularity: a piece stays in L1/L2 between its copy and its hash.
 */
#define PIECE ((size_t)64 << 10)
#define MAX_OPEN 64 /* files kept open before a checkpoint */
/* Held appends (kvti_fwriter_append_held): a run of the caller's memory is
 * written from where it lies once it reaches HELD_MIN bytes (shorter runs are
 * copied: small direct writes cost the disk more than the copy costs the CPU),
 * at most HELD_MAX per write, NHELD such writes queued (the engine's depth
 * bounds those in flight). Only where the stages are not huge pages: a
 * caller's tensors sit in 4 KiB pages (malloc, numpy), and the same 32 MiB
 * chunk written from them reached the disk at 0.83-0.97 of fio's 4 KiB-page
 * write against 1.09-1.29 copied into 2 MiB stages (docs/PERFORMANCE.md),
 * the copy (~3 ms of the writer's CPU per 32 MiB) overlapping the writes. */
#define HELD_MIN ((size_t)256 << 10)
#define HELD_MAX ((size_t)1 << 20)
#define NHELD 16

struct kvti_fwriter {
  kvti_wgroup *g;
  char *path;
  /* at >= 0: the file is name in directory descriptor at (borrowed from the
   * caller until the group settles); every later call on it (chmod, the
   * O_DIRECT descriptor, removal) goes by that descriptor, never by path. */
  int at;
  char *name;
  int fd, dfd;
  kvti_blkhash *h; /* the bytes' hasher (NULL: none) */
  int own_h;       /* h is the writer's whole-file hash, not the caller's */
  size_t fill;     /* bytes of this file in the current stage */
  uint64_t off;    /* file offset of the current stage's first byte */
  uint64_t prealloc;
  uint64_t head; /* bytes reserved at offset 0 (opts.head_reserve) */
  int head_put;  /* the reserved head was written */
  /* A held run not yet written: the caller's bytes [run, run + run_len),
   * already hashed, the file's bytes from off on (the stage is empty while a
   * run is open). */
  const char *run;
  size_t run_len;
  int closed;
  int own_group; /* made by kvti_fwriter_open */
  struct kvti_fwriter *next;
};

struct kvti_wgroup {
  kvti_iobatch *b;
  kvti_bufpool *pool;
  int do_fsync;
  char *stage[NSTAGE];
  kvti_iob_req req[NSTAGE];
  int busy[NSTAGE];
  unsigned k;
  kvti_iob_req hreq[NHELD]; /* writes from held memory */
  int hbusy[NHELD];
  unsigned hk;
  int in_place; /* held appends may be written from the caller's memory */
  kvti_fwriter *files; /* every file not yet checkpointed, newest first */
  unsigned nfiles;
  kvti_fwriter *cur; /* the file being appended to */
  int err;
};

int kvti_wgroup_open_depth(kvti_wgroup **out, int backend, kvti_bufpool *pool,
                           int do_fsync, unsigned depth) {
  kvti_wgroup *g = kvti_calloc(1, sizeof *g);
  if (!g)
    return KVT_ERR_NOMEM();
  g->pool = pool ? pool : kvti_bufpool_default();
  if (!g->pool) {
    kvti_free(g);
    return KVT_ERR_NOMEM();
  }
  kvti_bufpool_retain(g->pool);
  g->do_fsync = do_fsync;
  size_t huge = kvti_bufpool_huge_bytes();
  g->in_place = huge == 0 || huge > STAGE; /* the stages are not huge pages */
  kvti_iob_cfg cfg = KVTI_IOB_CFG_INIT;
  cfg.backend = backend;
  cfg.depth = depth;
  int rc = depth ? kvti_iobatch_get_cfg(&g->b, &cfg)
                 : kvti_iobatch_get(&g->b, backend);
  if (rc) {
    kvti_bufpool_release(g->pool);
    kvti_free(g);
    return rc;
  }
  *out = g;
  return 0;
}

int kvti_wgroup_open(kvti_wgroup **out, int backend, kvti_bufpool *pool,
                     int do_fsync) {
  return kvti_wgroup_open_depth(out, backend, pool, do_fsync, 0);
}

void kvti_wgroup_set_in_place(kvti_wgroup *g, int in_place) {
  if (g)
    g->in_place = in_place != 0;
}

int kvti_wgroup_in_place(const kvti_wgroup *g) {
  return g && g->in_place;
}

static void file_free(kvti_fwriter *w, int remove) {
  if (w->dfd >= 0)
    kvti_io->close(w->dfd);
  if (w->fd >= 0)
    kvti_io->close(w->fd);
  if (remove && w->at >= 0 && w->name) /* best effort, as by path below */
    (void)(kvti_io->unlinkat ? kvti_io->unlinkat(w->at, w->name, 0)
                             : unlinkat(w->at, w->name, 0));
  else if (remove && w->path)
    kvti_io->unlink(w->path);
  if (w->own_h)
    kvti_blkhash_free(w->h);
  kvti_free(w->path);
  kvti_free(w->name);
  kvti_free(w);
}

/* Waits for every write, then trims, fsyncs and closes the group's files; on
 * failure (or remove) removes them. Returns 0 or the error. */
static int settle(kvti_wgroup *g, int remove) {
  int rc = kvti_iobatch_wait_all(
      g->b); /* no write may touch a buffer or fd after this */
  memset(g->busy, 0, sizeof g->busy);
  memset(g->hbusy, 0, sizeof g->hbusy);
  if (g->err && !rc)
    rc = g->err;
  if (remove)
    rc = rc ? rc : KVT_ECANCELED;
  for (kvti_fwriter *w = g->files; rc == 0 && w; w = w->next)
    if (w->prealloc > w->off && kvti_io->ftruncate(w->fd, (off_t)w->off) != 0)
      rc = KVT_ERR_OS(errno, "truncate %s", w->path);
  if (rc == 0 && g->do_fsync && g->nfiles > 0) {
    int fds[MAX_OPEN + 1];
    const char *paths[MAX_OPEN + 1];
    size_t n = 0;
    for (kvti_fwriter *w = g->files; w && n <= MAX_OPEN; w = w->next) {
      fds[n] = w->fd;
      paths[n++] = w->path;
    }
    rc = kvti_iobatch_fsync_many(g->b, fds, n, paths);
  }
  for (kvti_fwriter *w = g->files; rc == 0 && w; w = w->next) {
    if (w->dfd >= 0) {
      kvti_io->close(w->dfd);
      w->dfd = -1;
    }
    int fd = w->fd;
    w->fd = -1;
    if (kvti_io->close(fd) != 0 && errno != EINTR)
      rc = KVT_ERR_OS(errno, "close %s", w->path);
  }
  kvti_fwriter *w = g->files;
  while (w) {
    kvti_fwriter *next = w->next;
    file_free(w, rc != 0);
    w = next;
  }
  g->files = NULL;
  g->nfiles = 0;
  if (rc && !g->err)
    g->err = rc;
  return rc == KVT_ECANCELED && remove ? 0 : rc;
}

static void group_free(kvti_wgroup *g) {
  kvti_iobatch_put(g->b);
  for (int i = 0; i < NSTAGE; i++)
    kvti_bufpool_put(g->pool, g->stage[i], STAGE);
  kvti_bufpool_release(g->pool);
  kvti_free(g);
}

int kvti_wgroup_finish(kvti_wgroup *g) {
  if (g->cur && !g->err)
    kvti_fwriter_close(g->cur, NULL, NULL);
  int rc = settle(g, g->err != 0);
  if (g->err && !rc)
    rc = g->err;
  group_free(g);
  return rc;
}

void kvti_wgroup_abort(kvti_wgroup *g) {
  if (!g)
    return;
  settle(g, 1);
  group_free(g);
}

/* The file behind kvti_wgroup_file (at < 0: by path) and
 * kvti_wgroup_file_at. */
static int group_file(kvti_fwriter **out, kvti_wgroup *g, int at,
                      const char *name, const char *path,
                      const kvti_fwriter_opts *o) {
  kvti_fwriter_opts def = KVTI_FWRITER_OPTS_INIT;
  if (!o)
    o = &def;
  if (g->err)
    return g->err;
  if (g->cur)
    return KVT_ERR(KVT_EINVAL, "fwriter: %s still open in the group",
                   g->cur->path);
  if (g->nfiles >= MAX_OPEN) {
    int rc = settle(g, 0); /* checkpoint: bounds open descriptors */
    if (rc)
      return rc;
  }
  kvti_fwriter *w = kvti_calloc(1, sizeof *w);
  if (!w)
    return KVT_ERR_NOMEM();
  w->g = g;
  w->fd = w->dfd = -1;
  w->at = at;
  int rc = 0;
  if (!(w->path = kvti_strdup(path)) ||
      (at >= 0 && !(w->name = kvti_strdup(name)))) {
    kvti_free(w->path);
    kvti_free(w);
    return KVT_ENOMEM;
  }
  if (o->blocks) {
    w->h = o->blocks;
  } else if (o->hash) {
    if ((rc = kvti_blkhash_new(&w->h, 0, 0)) != 0) {
      w->h = NULL;
      file_free(w, 0);
      return rc;
    }
    w->own_h = 1;
  }
  int flags = O_WRONLY | O_CREAT | (o->excl ? O_EXCL : O_TRUNC);
  mode_t mode = o->file_mode ? (mode_t)o->file_mode : 0600;
  w->fd = at >= 0 ? kvti_openat(at, name, flags, mode, path)
                  : kvti_open(path, flags, mode);
  if (w->fd < 0) {
    rc = w->fd;
    w->fd = -1;
    file_free(w, 0); /* not ours to remove (e.g. O_EXCL on an existing file) */
    return rc;
  }
  /* Registered at once: from here on a failure removes it with the group's
   * files. */
  w->next = g->files;
  g->files = w;
  g->nfiles++;
  if (at >= 0) {
    if ((rc = kvti_fchmod(w->fd, mode, path)) != 0)
      return g->err = rc;
  } else if (kvti_io->chmod(path, mode) != 0) {
    return g->err = KVT_ERR_OS(errno, "chmod %s", path);
  }
  if (!o->no_direct && at >= 0) {
    /* The second descriptor must be the file just created: a name swapped
     * meanwhile (by whoever else writes into the directory) is not used. */
    struct stat st, ds;
    w->dfd = kvti_iob_open_direct_at(at, name, O_WRONLY, 0);
    if (w->dfd >= 0 &&
        (kvti_io->fstat(w->fd, &st) != 0 || kvti_io->fstat(w->dfd, &ds) != 0 ||
         st.st_ino != ds.st_ino || st.st_dev != ds.st_dev)) {
      kvti_io->close(w->dfd);
      w->dfd = -1;
    }
  } else if (!o->no_direct) {
    w->dfd = kvti_iob_open_direct(path, O_WRONLY, 0);
  }
  if (o->size_hint >= STAGE && w->dfd >= 0) {
    rc = kvti_iob_preallocate(w->fd, o->size_hint);
    if (rc)
      return g->err = rc;
    w->prealloc = o->size_hint;
  }
  w->head = o->head_reserve;
  w->off = o->head_reserve; /* appends start past the reserved head */
  g->cur = w;
  *out = w;
  return 0;
}

int kvti_wgroup_file(kvti_fwriter **out, kvti_wgroup *g, const char *path,
                     const kvti_fwriter_opts *o) {
  return group_file(out, g, -1, NULL, path, o);
}

int kvti_wgroup_file_at(kvti_fwriter **out, kvti_wgroup *g, int dirfd,
                        const char *name, const char *path,
                        const kvti_fwriter_opts *o) {
  if (dirfd < 0 || !name || !*name || strchr(name, '/'))
    return KVT_ERR(KVT_EINVAL, "fwriter: bad directory descriptor or name");
  return group_file(out, g, dirfd, name, path ? path : name, o);
}

/* Pushes len bytes of the current stage as w's data at w->off and makes the
 * next stage current, waiting for its previous write. */
static int flush_stage(kvti_fwriter *w, size_t len) {
  kvti_wgroup *g = w->g;
  unsigned k = g->k;
  g->req[k] = (kvti_iob_req){w->fd, w->dfd, 1, g->stage[k], len, w->off, 0,
                             0,     0,      0, 0,           0,   NULL};
  g->busy[k] = 1;
  int rc = kvti_iobatch_push(g->b, &g->req[k], 0, w->path);
  w->off += len;
  w->fill = 0;
  g->k = (k + 1) % NSTAGE;
  if (rc == 0 && g->busy[g->k]) {
    g->busy[g->k] = 0;
    rc = kvti_iobatch_wait_req(g->b, &g->req[g->k]);
  }
  return rc;
}

/* Feeds n bytes to w's hasher (if any); an error fails the group. */
static int hash_bytes(kvti_fwriter *w, const void *p, size_t n) {
  int rc = w->h ? kvti_blkhash_update(w->h, p, n) : 0;
  return rc ? (w->g->err = rc) : 0;
}

/* Copies len bytes into the stages (hashing them while hot unless hashed
 * already), pushing every stage that fills. */
static int stage_copy(kvti_fwriter *w, const char *p, size_t len, int hash) {
  kvti_wgroup *g = w->g;
  while (len > 0) {
    if (!g->stage[g->k]) {
      g->stage[g->k] = kvti_bufpool_get(g->pool, STAGE, NULL);
      if (!g->stage[g->k])
        return g->err = KVT_ENOMEM;
    }
    size_t n = STAGE - w->fill;
    if (n > len)
      n = len;
    if (n > PIECE)
      n = PIECE;
    char *dst = g->stage[g->k] + w->fill;
    memcpy(dst, p, n);
    int rc = hash ? hash_bytes(w, dst, n) : 0;
    if (rc)
      return rc;
    w->fill += n;
    p += n;
    len -= n;
    if (w->fill == STAGE && (rc = flush_stage(w, STAGE)) != 0)
      return g->err = rc;
  }
  return 0;
}

/* Ends w's held run: written from the caller's memory when long enough,
 * else copied into the stage (its bytes were hashed when appended). */
static int run_end(kvti_fwriter *w) {
  kvti_wgroup *g = w->g;
  const char *p = w->run;
  size_t len = w->run_len;
  w->run = NULL;
  w->run_len = 0;
  if (len == 0)
    return 0;
  if (len < HELD_MIN || w->dfd < 0)
    return stage_copy(w, p, len, 0);
  unsigned k = g->hk;
  if (g->hbusy[k]) {
    g->hbusy[k] = 0;
    int rc = kvti_iobatch_wait_req(g->b, &g->hreq[k]);
    if (rc)
      return g->err = rc;
  }
  /* The request only reads buf: the cast drops const for the engine's
   * read/write request type. */
  g->hreq[k] = (kvti_iob_req){.fd = w->fd,
                              .dfd = w->dfd,
                              .write = 1,
                              .buf = (void *)(uintptr_t)p,
                              .len = len,
                              .off = w->off};
  g->hbusy[k] = 1;
  g->hk = (k + 1) % NHELD;
  w->off += len;
  int rc = kvti_iobatch_push(g->b, &g->hreq[k], 0, w->path);
  return rc ? (g->err = rc) : 0;
}

/* 1 when the file's next byte may start a held run at p: an aligned address,
 * at an aligned file offset with the stage empty or pushable as it is. */
static int run_can_start(const kvti_fwriter *w, const char *p) {
  return w->g->in_place && w->dfd >= 0 &&
         ((uintptr_t)p % KVTI_IOB_ALIGN) == 0 &&
         (w->off + w->fill) % KVTI_IOB_ALIGN == 0;
}

/* 0 when w may be appended to: its group not failed, w the open file. */
static int appendable(const kvti_fwriter *w) {
  if (w->g->err)
    return w->g->err;
  if (w->closed || w->g->cur != w)
    return KVT_ERR(KVT_EINVAL, "fwriter: %s is closed", w->path);
  return 0;
}

int kvti_fwriter_append(kvti_fwriter *w, const void *data, size_t len) {
  int rc = appendable(w);
  if (rc == 0)
    rc = run_end(w);
  return rc ? rc : stage_copy(w, data, len, 1);
}

int kvti_fwriter_append_held(kvti_fwriter *w, const void *data, size_t len) {
  int rc0 = appendable(w);
  if (rc0 || len == 0)
    return rc0;
  kvti_wgroup *g = w->g;
  const char *p = data;
  if (w->run && p != w->run + w->run_len) {
    int rc = run_end(w);
    if (rc)
      return rc;
  }
  if (!w->run) {
    if (!run_can_start(w, p))
      return stage_copy(w, p, len, 1);
    if (w->fill > 0) { /* aligned: pushed as it is, the run follows it */
      int rc = flush_stage(w, w->fill);
      if (rc)
        return g->err = rc;
    }
    w->run = p;
  }
  while (len > 0) {
    size_t n = HELD_MAX - w->run_len;
    if (n > len)
      n = len;
    int rc = hash_bytes(w, p, n);
    if (rc)
      return rc;
    w->run_len += n;
    p += n;
    len -= n;
    if (w->run_len == HELD_MAX) {
      if ((rc = run_end(w)) != 0)
        return rc;
      if (len > 0)
        w->run = p; /* still aligned: HELD_MAX is a multiple of 4096 */
    }
  }
  return 0;
}

int kvti_fwriter_put_head(kvti_fwriter *w, const void *head, size_t len) {
  kvti_wgroup *g = w->g;
  if (g->err)
    return g->err;
  if (w->closed || g->cur != w || w->head_put || w->head == 0 || len != w->head)
    return g->err = KVT_ERR(KVT_EINVAL,
                            "fwriter: %s: head of %zu bytes does not fit its "
                            "reserve of %llu (or was already written)",
                            w->path, len, (unsigned long long)w->head);
  int rc = kvti_pwrite_all(w->fd, head, len, 0, w->path);
  if (rc)
    return g->err = rc;
  w->head_put = 1;
  return 0;
}

int kvti_fwriter_close(kvti_fwriter *w, uint64_t *size, uint64_t *xxh3) {
  kvti_wgroup *g = w->g;
  if (g->err)
    return g->err;
  if (w->closed)
    return KVT_ERR(KVT_EINVAL, "fwriter: %s closed twice", w->path);
  if (w->head && !w->head_put) /* never a file with a hole for a header */
    return g->err = KVT_ERR(KVT_EINVAL, "fwriter: %s closed before its head",
                            w->path);
  int rc0 = run_end(w);
  if (rc0)
    return rc0;
  uint64_t total = w->off + w->fill;
  if (w->fill > 0) {
    int rc = flush_stage(w, w->fill);
    if (rc)
      return g->err = rc;
  }
  w->off = total;
  w->closed = 1;
  g->cur = NULL;
  if (size)
    *size = total;
  if (xxh3) {
    *xxh3 = 0;
    if (w->own_h) {
      int rc = kvti_blkhash_final(w->h, xxh3);
      if (rc)
        return g->err = rc;
    }
  }
  return 0;
}

/* The private group of one behind kvti_fwriter_open(_at). */
static int open_single(kvti_fwriter **out, int dirfd, const char *name,
                       const char *path, const kvti_fwriter_opts *o) {
  kvti_fwriter_opts def = KVTI_FWRITER_OPTS_INIT;
  if (!o)
    o = &def;
  kvti_wgroup *g = NULL;
  int rc = kvti_wgroup_open(&g, o->backend, o->pool, 0);
  if (rc)
    return rc;
  kvti_fwriter *w = NULL;
  rc = dirfd >= 0 ? kvti_wgroup_file_at(&w, g, dirfd, name, path, o)
                  : kvti_wgroup_file(&w, g, path, o);
  if (rc) {
    kvti_wgroup_abort(g);
    return rc;
  }
  w->own_group = 1;
  *out = w;
  return 0;
}

int kvti_fwriter_open(kvti_fwriter **out, const char *path,
                      const kvti_fwriter_opts *o) {
  return open_single(out, -1, NULL, path, o);
}

int kvti_fwriter_open_at(kvti_fwriter **out, int dirfd, const char *name,
                         const char *path, const kvti_fwriter_opts *o) {
  if (dirfd < 0)
    return KVT_ERR(KVT_EINVAL, "fwriter: bad directory descriptor");
  return open_single(out, dirfd, name, path, o);
}

kvti_wgroup *kvti_fwriter_group(kvti_fwriter *w) {
  return w ? w->g : NULL;
}

int kvti_fwriter_finish(kvti_fwriter *w, uint64_t *size, uint64_t *xxh3,
                        int do_fsync) {
  kvti_wgroup *g = w->g;
  uint64_t sz = 0, h = 0;
  int rc = w->closed ? 0 : kvti_fwriter_close(w, &sz, &h);
  g->do_fsync = do_fsync;
  int rc2 = kvti_wgroup_finish(g); /* frees w */
  if (rc == 0)
    rc = rc2;
  if (rc == 0) {
    if (size)
      *size = sz;
    if (xxh3)
      *xxh3 = h;
  }
  return rc;
}

void kvti_fwriter_abort(kvti_fwriter *w) {
  if (w)
    kvti_wgroup_abort(w->g);
}
