/*
 * local_dir.c - descriptor-relative walks below the cache directory (see
 * local_dir.h). Each component is opened with O_DIRECTORY | O_NOFOLLOW from
 * the previous one's descriptor, so the walk cannot leave the tree through
 * a link whatever is swapped in meanwhile: a name that is a link fails the
 * open itself (ELOOP), not a check made before it.
 */
#include "store/local_dir.h"

#include "base/error.h"
#include "base/io.h"
#include "base/vec.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int kvti_dir_open_root(const char *cache_dir) {
  return kvti_open(cache_dir, O_RDONLY | O_DIRECTORY, 0);
}

/* One component below dirfd; messages name where/prefix. */
static int open_comp(int dirfd, const char *name, const char *where,
                     const char *prefix) {
  char path[4200];
  snprintf(path, sizeof path, "%s/%s", where ? where : ".", prefix);
  int fd = kvti_openat(dirfd, name, O_RDONLY | O_DIRECTORY, 0, path);
  if (fd == KVT_ECORRUPT) /* a file, FIFO, ... where a directory belongs */
    return KVT_ERR(KVT_EPERM, "%s is not a directory", path);
  return fd;
}

/* open_comp that makes the component when it is missing. */
static int open_comp_mk(int dirfd, const char *name, const char *where,
                        const char *prefix, unsigned mode, int do_fsync) {
  int fd = open_comp(dirfd, name, where, prefix);
  if (fd != KVT_ENOTFOUND || mode == 0)
    return fd;
  kvt_clear_error();
  char path[4200];
  snprintf(path, sizeof path, "%s/%s", where ? where : ".", prefix);
  int rc = kvti_mkdirat(dirfd, name, (mode_t)mode, path);
  if (rc < 0)
    return rc;
  /* rc == 1: made meanwhile by another process; its open below checks
   * what it is. */
  if (rc == 0 && do_fsync && (rc = kvti_fsync(dirfd, path)) != 0)
    return rc;
  return open_comp(dirfd, name, where, prefix);
}

/* The walk of kvti_dir_open_rel; mode != 0 creates missing components. */
static int open_rel(int base_fd, const char *rel, const char *where,
                    unsigned mode, int do_fsync);

int kvti_dir_open_rel(int base_fd, const char *rel, const char *where) {
  return open_rel(base_fd, rel, where, 0, 0);
}

int kvti_dir_open_mk(int base_fd, const char *rel, unsigned mode, int do_fsync,
                     const char *where) {
  return open_rel(base_fd, rel, where, mode ? mode : 0700, do_fsync);
}

static int open_rel(int base_fd, const char *rel, const char *where,
                    unsigned mode, int do_fsync) {
  char buf[4096];
  size_t n = strlen(rel);
  if (n == 0 || n >= sizeof buf || rel[0] == '/')
    return KVT_ERR(KVT_EINVAL, "bad relative directory '%s'", rel);
  memcpy(buf, rel, n + 1);
  int fd = base_fd;
  for (char *c = buf; c && *c;) {
    char *sl = strchr(c, '/');
    if (sl)
      *sl = 0;
    if (!strcmp(c, ".") || !strcmp(c, "..") || !*c) {
      if (fd != base_fd)
        kvti_close(fd);
      return KVT_ERR(KVT_EINVAL, "bad relative directory '%s'", rel);
    }
    int nfd = open_comp_mk(fd, c, where, buf, mode, do_fsync);
    if (fd != base_fd)
      kvti_close(fd);
    if (nfd < 0)
      return nfd;
    fd = nfd;
    if (sl)
      *sl = '/';
    c = sl ? sl + 1 : NULL;
  }
  return fd;
}

int kvti_dir_unlink_rel(int base_fd, const char *rel, const char *where) {
  const char *sl = strrchr(rel, '/');
  char dir[4096];
  const char *name = sl ? sl + 1 : rel;
  int dfd = base_fd;
  if (sl) {
    if ((size_t)(sl - rel) >= sizeof dir)
      return KVT_ERR(KVT_ERANGE, "path too long");
    memcpy(dir, rel, (size_t)(sl - rel));
    dir[sl - rel] = 0;
    dfd = kvti_dir_open_rel(base_fd, dir, where);
    if (dfd == KVT_ENOTFOUND) {
      kvt_clear_error();
      return 0; /* nothing there to remove */
    }
    if (dfd < 0)
      return dfd;
  }
  char path[4200];
  snprintf(path, sizeof path, "%s/%s", where ? where : ".", rel);
  int rc = kvti_unlinkat(dfd, name, path);
  if (dfd != base_fd)
    kvti_close(dfd);
  return rc;
}

/* unlinkat with AT_REMOVEDIR through the seam. */
static int rmdir_at(int dirfd, const char *name) {
  return kvti_io->unlinkat ? kvti_io->unlinkat(dirfd, name, AT_REMOVEDIR)
                           : unlinkat(dirfd, name, AT_REMOVEDIR);
}

/* One directory's names (without "." and ".."), read through dirfd (which is
 * not taken over: a duplicate feeds the stream). With ctimes (lstat'ed
 * relative to dirfd) when sec is non-NULL. */
typedef struct {
  char **names;
  int64_t *sec, *nsec;
  size_t n, cap;
} dir_names;

static void dir_names_free(dir_names *l) {
  for (size_t i = 0; i < l->n; i++)
    kvti_free(l->names[i]);
  kvti_free(l->names);
  kvti_free(l->sec);
  kvti_free(l->nsec);
  memset(l, 0, sizeof *l);
}

static int dir_names_read(dir_names *l, int dirfd, int want_ctime) {
  memset(l, 0, sizeof *l);
  int dup_fd = kvti_openat(dirfd, ".", O_RDONLY | O_DIRECTORY, 0, NULL);
  if (dup_fd < 0)
    return dup_fd;
  DIR *d = kvti_fdopendir(dup_fd);
  if (!d) {
    int e = errno;
    kvti_close(dup_fd);
    return KVT_ERR_OS(e, "opendir");
  }
  int rc = 0;
  struct dirent *de;
  while ((de = kvti_io->readdir(d)) != NULL) {
    if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, ".."))
      continue;
    if (l->n == l->cap) {
      /* The three arrays share one capacity: each grows to it in turn. */
      size_t nc = kvti_vec_cap(l->cap, l->n + 1, sizeof(int64_t), 16);
      if ((rc = KVTI_VEC_RESIZE(&l->names, nc)) != 0 ||
          (rc = KVTI_VEC_RESIZE(&l->sec, nc)) != 0 ||
          (rc = KVTI_VEC_RESIZE(&l->nsec, nc)) != 0)
        break;
      l->cap = nc;
    }
    if (!(l->names[l->n] = kvti_strdup(de->d_name))) {
      rc = KVT_ENOMEM;
      break;
    }
    l->sec[l->n] = l->nsec[l->n] = 0;
    struct stat st;
    if (want_ctime &&
        (kvti_io->fstatat
             ? kvti_io->fstatat(dirfd, de->d_name, &st, AT_SYMLINK_NOFOLLOW)
             : fstatat(dirfd, de->d_name, &st, AT_SYMLINK_NOFOLLOW)) == 0) {
      l->sec[l->n] = (int64_t)st.st_ctim.tv_sec;
      l->nsec[l->n] = (int64_t)st.st_ctim.tv_nsec;
    }
    l->n++;
  }
  kvti_io->closedir(d);
  if (rc)
    dir_names_free(l);
  return rc;
}

/* Removes name below dirfd: a file or link is unlinked (a link's target is
 * never touched), a directory emptied first through its own descriptor.
 * depth bounds the recursion (quarantined trees are one or two levels). */
static int rmtree_at(int dirfd, const char *name, int depth) {
  struct stat st;
  int r = kvti_io->fstatat
              ? kvti_io->fstatat(dirfd, name, &st, AT_SYMLINK_NOFOLLOW)
              : fstatat(dirfd, name, &st, AT_SYMLINK_NOFOLLOW);
  if (r != 0)
    return errno == ENOENT ? 0 : KVT_ERR_OS(errno, "stat %s", name);
  if (!S_ISDIR(st.st_mode))
    return kvti_unlinkat(dirfd, name, name);
  if (depth <= 0)
    return KVT_ERR(KVT_ERANGE, "%s: directory tree too deep to remove", name);
  int sub = kvti_openat(dirfd, name, O_RDONLY | O_DIRECTORY, 0, name);
  if (sub < 0)
    return sub;
  dir_names l;
  int rc = dir_names_read(&l, sub, 0);
  for (size_t i = 0; rc == 0 && i < l.n; i++)
    rc = rmtree_at(sub, l.names[i], depth - 1);
  dir_names_free(&l);
  kvti_close(sub);
  if (rc == 0 && rmdir_at(dirfd, name) != 0 && errno != ENOENT)
    rc = KVT_ERR_OS(errno, "rmdir %s", name);
  return rc;
}

/* The bound of kvti_dir_bound (prefix: the names it governs) and
 * kvti_dir_bound_others (others: the names it leaves alone). */
static int bound(int dirfd, size_t keep, const char *prefix, const char *others,
                 const char *except, size_t *removed, const char *where);

int kvti_dir_bound(int dirfd, size_t keep, const char *prefix,
                   const char *except, size_t *removed, const char *where) {
  return bound(dirfd, keep, prefix, NULL, except, removed, where);
}

int kvti_dir_bound_others(int dirfd, size_t keep, const char *others,
                          const char *except, size_t *removed,
                          const char *where) {
  return bound(dirfd, keep, NULL, others, except, removed, where);
}

static int bound(int dirfd, size_t keep, const char *prefix, const char *others,
                 const char *except, size_t *removed, const char *where) {
  if (removed)
    *removed = 0;
  dir_names l;
  int rc = dir_names_read(&l, dirfd, 1);
  if (rc)
    return rc;
  /* Only the names the bound governs take part; except counts toward keep
   * but is never chosen (timestamps may tie, so "newest" alone would not
   * protect it). */
  size_t m = 0;
  for (size_t i = 0; i < l.n; i++) {
    int skip = (prefix && strncmp(l.names[i], prefix, strlen(prefix)) != 0) ||
               (others && strncmp(l.names[i], others, strlen(others)) == 0);
    if (!skip && except && !strcmp(l.names[i], except)) {
      skip = 1;
      if (keep)
        keep--;
    }
    if (skip) {
      kvti_free(l.names[i]);
      continue;
    }
    l.names[m] = l.names[i];
    l.sec[m] = l.sec[i];
    l.nsec[m] = l.nsec[i];
    m++;
  }
  l.n = m;
  while (rc == 0 && l.n > keep) {
    size_t o = 0;
    for (size_t i = 1; i < l.n; i++)
      if (l.sec[i] < l.sec[o] ||
          (l.sec[i] == l.sec[o] &&
           (l.nsec[i] < l.nsec[o] ||
            (l.nsec[i] == l.nsec[o] && strcmp(l.names[i], l.names[o]) < 0))))
        o = i;
    (void)where;
    rc = rmtree_at(dirfd, l.names[o], 4);
    if (rc == 0 && removed)
      (*removed)++;
    kvti_free(l.names[o]);
    l.n--;
    l.names[o] = l.names[l.n];
    l.sec[o] = l.sec[l.n];
    l.nsec[o] = l.nsec[l.n];
  }
  dir_names_free(&l);
  return rc;
}
