/*
 * local_probe.c - a cache directory read from outside, the way the tier's
 * layout names it, so a tool never spells the layout itself:
 * kvt_cache_dir_probe (an empty directory, a cache or something else, and
 * what was set aside), kvt_cache_dir_list (the names in data/ and what each
 * is), kvt_cache_name_stat (one such name, or a chunk file's, looked at
 * again) and kvt_cache_chunk_name (where a chunk file lives). It only lists,
 * stats and opens for reading: nothing here changes the directory, and it
 * needs no lock (every answer is a snapshot a writer may change right after).
 */
#include "base/error.h"
#include "base/hash.h"
#include "base/io.h"
#include "kvtier_sys.h"
#include "store/local_dir.h"
#include "store/local_layout.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
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

/* What a name in data/ is, from the name alone: the reconcile's reading. */
static int name_kind(const char *n) {
  size_t l = strlen(n);
  if (l > 4 && strcmp(n + l - 4, ".tmp") == 0)
    return KVT_CACHE_NAME_TMP;
  return kvti_is_hash_name(n) ? KVT_CACHE_NAME_ENTRY : KVT_CACHE_NAME_STRAY;
}

int kvt_cache_dir_list(const char *dir, unsigned kinds, kvt_cache_name_fn fn,
                       void *ctx) {
  if (!dir || !*dir || !fn)
    return KVT_ERR(KVT_EINVAL, "kvt_cache_dir_list: NULL or empty argument");
  int root = kvti_dir_open_root(dir);
  if (root < 0)
    return root;
  int dfd = kvti_dir_open_rel(root, KVTI_LOCAL_DATA, dir);
  kvti_io->close(root);
  if (dfd < 0)
    return dfd;
  DIR *d = kvti_fdopendir(dfd);
  if (!d) {
    int e = errno;
    kvti_io->close(dfd);
    return KVT_ERR_OS(e, "%s/%s: cannot read directory", dir, KVTI_LOCAL_DATA);
  }
  int rc = 0;
  struct dirent *de;
  while (rc == 0 && (errno = 0, de = kvti_io->readdir(d)) != NULL) {
    const char *n = de->d_name;
    if (strcmp(n, ".") == 0 || strcmp(n, "..") == 0)
      continue;
    int kind = name_kind(n);
    if (kinds == 0 || (kinds & (unsigned)kind))
      rc = fn(ctx, n, kind);
  }
  if (rc == 0 && errno != 0)
    rc =
        KVT_ERR_OS(errno, "%s/%s: cannot read directory", dir, KVTI_LOCAL_DATA);
  kvti_io->closedir(d);
  return rc;
}

/* A path component: not empty, ".", ".." and without '/'. */
static int component(const char *s, size_t n) {
  if (n == 0 || (n == 1 && s[0] == '.') || (n == 2 && !memcmp(s, "..", 2)))
    return 0;
  return memchr(s, '/', n) == NULL;
}

/* Splits name (in area) into the directory holding it, relative to the
 * cache directory, and its last component. 0 or KVT_EINVAL. */
static int split_name(char *parent, size_t np, const char **last, int area,
                      const char *name) {
  if (area == KVT_CACHE_AREA_DATA) {
    if (!component(name, strlen(name)))
      return KVT_ERR(KVT_EINVAL, "kvt_cache_name_stat: bad data/ name");
    snprintf(parent, np, "%s", KVTI_LOCAL_DATA);
    *last = name;
    return 0;
  }
  size_t lc = strlen(KVTI_LOCAL_CHUNKS);
  if (area != KVT_CACHE_AREA_CHUNKS)
    return KVT_ERR(KVT_EINVAL, "kvt_cache_name_stat: unknown area %d", area);
  if (strncmp(name, KVTI_LOCAL_CHUNKS, lc) != 0 || name[lc] != '/')
    return KVT_ERR(KVT_EINVAL, "kvt_cache_name_stat: not a chunks/ path");
  const char *a = name + lc + 1, *b = strchr(a, '/');
  size_t la = b ? (size_t)(b - a) : strlen(a);
  if (!component(a, la) || (b && !component(b + 1, strlen(b + 1))) ||
      la + lc + 2 > np)
    return KVT_ERR(KVT_EINVAL, "kvt_cache_name_stat: not a chunks/ path");
  if (!b) {
    snprintf(parent, np, "%s", KVTI_LOCAL_CHUNKS);
    *last = a;
  } else {
    snprintf(parent, np, "%.*s", (int)(b - name), name);
    *last = b + 1;
  }
  return 0;
}

static int name_stat(kvt_cache_name_stat_info *out, const char *dir, int area,
                     const char *name) {
  char parent[320];
  const char *last = NULL;
  int rc = split_name(parent, sizeof parent, &last, area, name);
  if (rc != 0)
    return rc;
  int root = kvti_dir_open_root(dir);
  if (root < 0)
    return root;
  int dfd = kvti_dir_open_rel(root, parent, dir);
  kvti_io->close(root);
  if (dfd < 0)
    return dfd;
  struct stat st;
  rc = kvti_lstatat(dfd, last, &st, name);
  kvti_io->close(dfd);
  if (rc != 0)
    return rc;
  out->is_dir = S_ISDIR(st.st_mode);
  out->mtime = (double)st.st_mtim.tv_sec + (double)st.st_mtim.tv_nsec / 1e9;
  return 0;
}

int kvt_cache_name_stat(kvt_cache_name_stat_info *out, const char *dir,
                        int area, const char *name) {
  if (!out || !dir || !*dir || !name || !*name)
    return KVT_ERR(KVT_EINVAL, "kvt_cache_name_stat: NULL or empty argument");
  if (out->version != KVT_CACHE_NAME_STAT_VERSION)
    return KVT_ERR(KVT_EINVAL, "kvt_cache_name_stat: unknown version %u",
                   out->version);
  kvt_cache_name_stat_info r = {.version = out->version};
  int rc = name_stat(&r, dir, area, name);
  if (rc != 0)
    r = (kvt_cache_name_stat_info){.version = out->version};
  *out = r;
  return rc;
}

int kvt_cache_chunk_name(char *out, size_t n, const char *key_hex) {
  uint8_t key[32];
  if (out && n)
    out[0] = '\0';
  if (!out || !key_hex || kvti_unhex32(key, key_hex) != 0)
    return KVT_ERR(KVT_EINVAL, "kvt_cache_chunk_name: not a chunk key");
  return kvti_local_chunk_rel(out, n, key);
}
