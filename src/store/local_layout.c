/*
 * local_layout.c - paths under the cache directory from the layout's names
 * (local_layout.h), and index.db's files as files: whether they are there,
 * whether one of them is something SQLite must not open (not a regular
 * file), and setting a damaged or replaced index aside under a name that says
 * why and when, so the next open builds a fresh one from the entries. What is
 * inside index.db is index/'s; where it lives is the layout's.
 */
#include "store/local_layout.h"
#include "base/error.h"
#include "base/hash.h"
#include "base/io.h"
#include "base/strbuf.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* cache_dir/index.db<sfx> into p (n bytes); 0, or KVT_EINVAL when too long. */
static int index_file(char *p, size_t n, const char *cache_dir,
                      const char *sfx) {
  int w = snprintf(p, n, "%s/%s%s", cache_dir, KVTI_LOCAL_INDEX, sfx);
  if (w < 0 || (size_t)w >= n)
    return KVT_ERR(KVT_EINVAL, "cache directory path too long: %.64s...",
                   cache_dir);
  return 0;
}

int kvti_local_index_present(const char *cache_dir) {
  char p[4200];
  struct stat st;
  return index_file(p, sizeof p, cache_dir, "") == 0 &&
         kvti_io->lstat(p, &st) == 0;
}

int kvti_local_index_hostile(const char *cache_dir) {
  static const char *const sfx[] = {"", "-wal", "-shm"};
  for (int i = 0; i < 3; i++) {
    char p[4200];
    struct stat st;
    if (index_file(p, sizeof p, cache_dir, sfx[i]) == 0 &&
        kvti_io->lstat(p, &st) == 0 && !S_ISREG(st.st_mode))
      return 1;
  }
  return 0;
}

int kvti_local_index_set_aside(const char *cache_dir, const char *why,
                               kvti_local_moved_fn note, void *note_ctx) {
  char stamp[32];
  time_t now = time(NULL);
  struct tm tm;
  gmtime_r(&now, &tm);
  strftime(stamp, sizeof stamp, "%Y%m%dT%H%M%SZ", &tm);
  char base[4200], from[4300], to[4400];
  int rc = index_file(base, sizeof base, cache_dir, "");
  static const char *const sfx[] = {"", "-wal"};
  for (int i = 0; i < 2 && rc == 0; i++) {
    snprintf(from, sizeof from, "%s%s", base, sfx[i]);
    struct stat st;
    if (kvti_io->lstat(from, &st) != 0)
      continue;
    /* The first free name: an earlier set-aside in the same second stays. */
    for (unsigned k = 0;; k++) {
      struct stat ts;
      if (k == 0)
        snprintf(to, sizeof to, "%s.%s-%s%s", base, why, stamp, sfx[i]);
      else
        snprintf(to, sizeof to, "%s.%s-%s.%u%s", base, why, stamp, k, sfx[i]);
      if (kvti_io->lstat(to, &ts) != 0)
        break;
    }
    if ((rc = kvti_rename(from, to)) == 0 && note)
      note(note_ctx, from, to);
  }
  if (rc == 0) {
    snprintf(from, sizeof from, "%s-shm", base);
    rc = kvti_unlink(from);
  }
  return rc;
}

char *kvti_local_path(const char *cache_dir, const char *name) {
  return kvti_path_join(cache_dir, name); /* sets KVT_ENOMEM */
}

int kvti_local_stage_chunk_paths(char *path, char *tmp, size_t n,
                                 const char *stage_root, const char *key_hex) {
  int a =
      snprintf(path, n, "%s/%s%s", stage_root, key_hex, KVTI_LOCAL_CHUNK_EXT);
  int b = snprintf(tmp, n, "%s/%s.tmp", stage_root, key_hex);
  if (a < 0 || b < 0 || (size_t)a >= n || (size_t)b >= n) {
    path[0] = tmp[0] = '\0'; /* nothing truncated is ever used as a path */
    return KVT_ERR(KVT_EINVAL, "staging path too long: %.64s...", stage_root);
  }
  return 0;
}

int kvti_local_chunk_dir_rel(char *out, size_t n, unsigned kk) {
  int w = kk < 256 ? snprintf(out, n, "%s/%02x", KVTI_LOCAL_CHUNKS, kk)
                   : snprintf(out, n, "%s", KVTI_LOCAL_CHUNKS);
  if (w < 0 || (size_t)w >= n) {
    if (n)
      out[0] = '\0';
    return KVT_ERR(KVT_EINVAL, "chunk directory name too long");
  }
  return 0;
}

void kvti_local_chunk_name(char out[KVTI_LOCAL_CHUNK_NAME_MAX],
                           const uint8_t key[32], int tmp) {
  char h[65];
  kvti_hex32(h, key);
  snprintf(out, KVTI_LOCAL_CHUNK_NAME_MAX, "%s%s", h,
           tmp ? ".tmp" : KVTI_LOCAL_CHUNK_EXT);
}

int kvti_local_chunk_rel(char *out, size_t n, const uint8_t key[32]) {
  char h[65];
  kvti_hex32(h, key);
  int w = snprintf(out, n, "%s/%.2s/%s%s", KVTI_LOCAL_CHUNKS, h, h,
                   KVTI_LOCAL_CHUNK_EXT);
  if (w < 0 || (size_t)w >= n) {
    if (n)
      out[0] = '\0';
    return KVT_ERR(KVT_EINVAL, "chunk name too long");
  }
  return 0;
}

int kvti_local_chunk_path(char *out, size_t n, const char *chunks_dir,
                          const uint8_t key[32]) {
  char h[65];
  kvti_hex32(h, key);
  int w =
      snprintf(out, n, "%s/%.2s/%s%s", chunks_dir, h, h, KVTI_LOCAL_CHUNK_EXT);
  if (w < 0 || (size_t)w >= n)
    return KVT_ERR(KVT_ERANGE, "chunk path too long");
  return 0;
}

int kvti_local_chunk_key(uint8_t key[32], const char *name) {
  const size_t ext = sizeof KVTI_LOCAL_CHUNK_EXT - 1;
  char hex[65];
  if (strlen(name) != 64 + ext || strcmp(name + 64, KVTI_LOCAL_CHUNK_EXT) != 0)
    return -1;
  memcpy(hex, name, 64);
  hex[64] = '\0';
  return kvti_unhex32(key, hex) == 0 ? 0 : -1;
}

int kvti_local_default_dir(char **out, const char *model) {
  const char *xdg = getenv("XDG_CACHE_HOME");
  const char *home = getenv("HOME");
  char *base;
  if (xdg && xdg[0] == '/')
    base = kvti_strdup(xdg);
  else if (home && home[0] == '/')
    base = kvti_path_join(home, ".cache");
  else
    return KVT_ERR(KVT_EINVAL,
                   "cache_dir is NULL and neither XDG_CACHE_HOME nor "
                   "HOME is an absolute path");
  if (!base)
    return KVT_ERR_NOMEM();
  char *p = kvti_strfmt("%s/kvtier/%s", base, model); /* sets KVT_ENOMEM */
  kvti_free(base);
  if (!p)
    return KVT_ENOMEM;
  *out = p;
  return 0;
}

char *kvti_local_absolute_dir(const char *dir) {
  if (dir[0] == '/')
    return kvti_strdup(dir);
  char cwd[4096];
  if (!getcwd(cwd, sizeof cwd)) {
    KVT_ERR_OS(errno, "getcwd (to make %s absolute)", dir);
    return NULL;
  }
  return kvti_path_join(cwd, dir);
}
