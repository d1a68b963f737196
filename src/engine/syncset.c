/*
 * syncset.c - files and directories made durable together (syncset.h): the
 * files through one write group, whose finish fsyncs them all at once; the
 * directories as a list of descriptors (borrowed, or opened from their paths
 * when the round runs) fsynced at once through the set's engine.
 */
#include "engine/syncset.h"

#include "base/error.h"
#include "base/io.h"
#include "base/vec.h"
#include "engine/iobatch.h"

#include <fcntl.h>
#include <string.h>

typedef struct sync_dir {
  int fd;     /* borrowed descriptor, -1: open path at the round */
  char *path; /* owned */
} sync_dir;

struct kvti_syncset {
  kvti_wgroup *g;
  int backend, do_fsync;
  sync_dir *dirs;
  size_t ndirs, capdirs;
};

int kvti_syncset_open_depth(kvti_syncset **out, int backend, int do_fsync,
                            unsigned depth) {
  *out = NULL;
  kvti_syncset *s = kvti_calloc(1, sizeof *s);
  if (!s)
    return KVT_ERR_NOMEM();
  s->backend = backend;
  s->do_fsync = do_fsync;
  int rc = kvti_wgroup_open_depth(&s->g, backend, NULL, do_fsync, depth);
  if (rc) {
    kvti_free(s);
    return rc;
  }
  *out = s;
  return 0;
}

int kvti_syncset_open(kvti_syncset **out, int backend, int do_fsync) {
  return kvti_syncset_open_depth(out, backend, do_fsync, 0);
}

kvti_wgroup *kvti_syncset_group(kvti_syncset *s) {
  return s->g;
}

int kvti_syncset_do_fsync(const kvti_syncset *s) {
  return s->do_fsync;
}

static int add_dir(kvti_syncset *s, int fd, const char *path) {
  for (size_t i = 0; i < s->ndirs; i++)
    if (fd >= 0 ? s->dirs[i].fd == fd
                : s->dirs[i].fd < 0 && !strcmp(s->dirs[i].path, path))
      return 0;
  if (KVTI_VEC_RESERVE(&s->dirs, &s->capdirs, s->ndirs + 1, 16) != 0)
    return KVT_ERR_NOMEM();
  char *p = kvti_strdup(path ? path : "directory");
  if (!p)
    return KVT_ERR_NOMEM();
  s->dirs[s->ndirs].fd = fd;
  s->dirs[s->ndirs].path = p;
  s->ndirs++;
  return 0;
}

int kvti_syncset_dir(kvti_syncset *s, const char *path) {
  if (!path)
    return KVT_ERR(KVT_EINVAL, "syncset: NULL directory");
  return add_dir(s, -1, path);
}

int kvti_syncset_dirfd(kvti_syncset *s, int dirfd, const char *path) {
  if (dirfd < 0)
    return KVT_ERR(KVT_EINVAL, "syncset: bad directory descriptor");
  return add_dir(s, dirfd, path);
}

int kvti_syncset_files(kvti_syncset *s) {
  if (!s->g)
    return 0;
  int rc = kvti_wgroup_finish(s->g);
  s->g = NULL;
  return rc;
}

static void dirs_clear(kvti_syncset *s) {
  for (size_t i = 0; i < s->ndirs; i++)
    kvti_free(s->dirs[i].path);
  s->ndirs = 0;
}

int kvti_syncset_dirs(kvti_syncset *s) {
  size_t n = s->ndirs;
  if (n == 0 || !s->do_fsync) {
    dirs_clear(s);
    return 0;
  }
  int *fds = kvti_malloc(n * sizeof *fds);
  const char **paths = kvti_malloc(n * sizeof *paths);
  int *own = kvti_calloc(n, sizeof *own);
  int rc = fds && paths && own ? 0 : KVT_ERR_NOMEM();
  size_t k = 0;
  for (; rc == 0 && k < n; k++) {
    sync_dir *d = &s->dirs[k];
    paths[k] = d->path;
    fds[k] = d->fd;
    if (d->fd < 0) {
      fds[k] = kvti_open(d->path, O_RDONLY | O_DIRECTORY, 0);
      if (fds[k] < 0) {
        rc = fds[k];
        break;
      }
      own[k] = 1;
    }
  }
  kvti_iobatch *b = NULL;
  if (rc == 0 && (rc = kvti_iobatch_get(&b, s->backend)) == 0) {
    rc = kvti_iobatch_fsync_many(b, fds, n, paths);
    kvti_iobatch_put(b);
  }
  for (size_t i = 0; own && i < k; i++)
    if (own[i])
      kvti_close(fds[i]);
  kvti_free(fds);
  kvti_free(paths);
  kvti_free(own);
  dirs_clear(s);
  return rc;
}

void kvti_syncset_free(kvti_syncset *s) {
  if (!s)
    return;
  kvti_wgroup_abort(s->g);
  dirs_clear(s);
  kvti_free(s->dirs);
  kvti_free(s);
}
