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

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
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

int kvti_dir_open_rel(int base_fd, const char *rel, const char *where) {
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
    int nfd = open_comp(fd, c, where, buf);
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
