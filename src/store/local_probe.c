/*
 * local_probe.c - kvt_cache_dir_probe: what a directory holds, read the way
 * the tier's layout names it, so a tool can tell an empty directory, a cache
 * and something else apart (and count what was set aside) before it opens
 * anything, without spelling the layout itself. It only lists and opens for
 * reading: probing never changes the directory, and it needs no lock (the
 * answer is a snapshot a writer may change right after).
 */
#include "base/error.h"
#include "base/io.h"
#include "kvtier_sys.h"
#include "store/local_layout.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>

/* Names in dir other than "." and ".." (a missing dir holds none); stops
 * counting at the first, when first_only. -1 with errno when unreadable. */
static int64_t count_names(const char *dir, int first_only) {
  DIR *d = kvti_io->opendir(dir);
  if (!d)
    return errno == ENOENT ? 0 : -1;
  int64_t n = 0;
  struct dirent *de;
  while ((de = kvti_io->readdir(d)) != NULL) {
    if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0)
      continue;
    n++;
    if (first_only)
      break;
  }
  kvti_io->closedir(d);
  return n;
}

/* 1 when cache_dir/name exists (as anything), 0 when not; -1 with errno. */
static int present(const char *cache_dir, const char *name, int *is_dir) {
  char *p = kvti_local_path(cache_dir, name);
  if (!p)
    return -1;
  struct stat st;
  int rc = kvti_io->lstat(p, &st);
  int e = errno;
  kvti_free(p);
  if (rc != 0) {
    errno = e;
    return e == ENOENT ? 0 : -1;
  }
  if (is_dir)
    *is_dir = S_ISDIR(st.st_mode);
  return 1;
}

/* Fills *out (zeroed by the caller) or fails part way. */
static int probe(kvt_cache_dir_probe_info *out, const char *dir) {
  struct stat st;
  if (kvti_io->lstat(dir, &st) != 0)
    return KVT_ERR_OS(errno, "%s: cannot access", dir);
  if (!S_ISDIR(st.st_mode))
    return KVT_ERR(KVT_EINVAL, "%s: not a directory", dir);
  int64_t any = count_names(dir, 1);
  if (any < 0)
    return KVT_ERR_OS(errno, "%s: cannot read directory", dir);
  out->empty = any == 0;
  int data_dir = 0;
  int rc = present(dir, KVTI_LOCAL_INDEX, NULL);
  if (rc < 0)
    return KVT_ERR_OS(errno, "%s/%s: cannot access", dir, KVTI_LOCAL_INDEX);
  out->has_index = rc;
  if ((rc = present(dir, KVTI_LOCAL_DATA, &data_dir)) < 0)
    return KVT_ERR_OS(errno, "%s/%s: cannot access", dir, KVTI_LOCAL_DATA);
  out->has_data = rc && data_dir;
  if (out->has_index) {
    char *p = kvti_local_path(dir, KVTI_LOCAL_INDEX);
    if (!p)
      return KVT_ENOMEM;
    int fd = kvti_io->open(p, O_RDONLY | O_CLOEXEC, 0);
    out->index_errno = fd < 0 ? errno : 0;
    if (fd >= 0)
      kvti_io->close(fd);
    kvti_free(p);
  }
  char *q = kvti_local_path(dir, KVTI_LOCAL_QUARANTINE);
  if (!q)
    return KVT_ENOMEM;
  int64_t nq = count_names(q, 0);
  int e = errno;
  kvti_free(q);
  if (nq < 0)
    return KVT_ERR_OS(e, "%s/%s: cannot read directory", dir,
                      KVTI_LOCAL_QUARANTINE);
  out->quarantined = (uint64_t)nq;
  return 0;
}

int kvt_cache_dir_probe(kvt_cache_dir_probe_info *out, const char *dir) {
  if (!out || !dir || !*dir)
    return KVT_ERR(KVT_EINVAL, "kvt_cache_dir_probe: NULL or empty argument");
  if (out->version != KVT_CACHE_DIR_PROBE_VERSION)
    return KVT_ERR(KVT_EINVAL, "kvt_cache_dir_probe: unknown version %u",
                   out->version);
  kvt_cache_dir_probe_info r = {.version = out->version};
  int rc = probe(&r, dir);
  if (rc < 0)
    r = (kvt_cache_dir_probe_info){.version = out->version};
  *out = r;
  return rc;
}
