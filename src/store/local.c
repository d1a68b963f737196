/*
 * backend_local.c - the local-directory storage backend (see backend.h):
 * entries live in cache_dir/data/<hash>/ exactly as the reference lays them
 * out, written and read by entry.c; corrupt entries move to
 * cache_dir/quarantine/<hash> (a unique suffix on a name clash so a move is
 * never lost), and quarantine/ is bounded by removing the oldest moves (by
 * ctime, which the rename sets). Removal renames the entry to <hash>.rm.tmp
 * before deleting the tree so an entry disappears atomically; a crash
 * mid-delete leaves only a *.tmp that the next open removes.
 */
#include "store/backend.h"
#include "base/clock.h"
#include "base/error.h"
#include "base/hash.h"
#include "base/io.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct local_backend {
  kvti_backend base; /* first: the tier holds a kvti_backend* */
  char *cache_dir;
  char *data_dir;
  char *quarantine_dir;
  uint32_t dir_mode;
} local_backend;

static local_backend *L(kvti_backend *b) {
  return (local_backend *)b;
}

static char *entry_path(local_backend *lb, const char *name) {
  return kvti_path_join(lb->data_dir, name);
}

static int ends_with(const char *s, const char *suf) {
  size_t a = strlen(s), b = strlen(suf);
  return a >= b && memcmp(s + a - b, suf, b) == 0;
}

static int safe_name(const char *name) {
  return name && name[0] && !strchr(name, '/') && strcmp(name, ".") &&
         strcmp(name, "..");
}

static int lb_put(kvti_backend *b, uint64_t *disk_bytes, const kvti_snapshot *s,
                  const kvti_write_opts *o) {
  return kvti_entry_write(disk_bytes, L(b)->data_dir, s, o);
}

static int lb_get(kvti_backend *b, kvt_entry **out, const char *hash,
                  const kvti_read_opts *o) {
  if (!kvti_is_hash_name(hash))
    return KVT_ERR(KVT_EINVAL, "invalid entry name");
  return kvti_entry_read(out, L(b)->data_dir, hash, o);
}

/* Renames data/<name> aside to a unique *.tmp and deletes it. */
static int remove_tree(local_backend *lb, const char *name) {
  char *p = entry_path(lb, name);
  if (!p)
    return KVT_ENOMEM;
  struct stat st;
  if (kvti_io->lstat(p, &st) != 0) {
    int e = errno;
    kvti_free(p);
    return e == ENOENT ? 0 : KVT_ERR_OS(e, "stat data/%s", name);
  }
  int rc;
  if (ends_with(name, ".tmp")) {
    rc = kvti_rmtree(p);
  } else {
    size_t n = strlen(p) + 16;
    char *aside = kvti_malloc(n);
    if (!aside) {
      kvti_free(p);
      return KVT_ERR_NOMEM();
    }
    snprintf(aside, n, "%s.rm.tmp", p);
    kvti_rmtree(aside); /* a stale one from a crash */
    if (kvti_io->rename(p, aside) == 0)
      rc = kvti_rmtree(aside);
    else
      rc = kvti_rmtree(p); /* rename refused: delete in place */
    kvti_free(aside);
  }
  kvti_free(p);
  return rc;
}

static int lb_remove(kvti_backend *b, const char *hash) {
  if (!kvti_is_hash_name(hash))
    return KVT_ERR(KVT_EINVAL, "invalid entry name");
  return remove_tree(L(b), hash);
}

static int lb_exists(kvti_backend *b, const char *hash) {
  local_backend *lb = L(b);
  if (!kvti_is_hash_name(hash))
    return KVT_ERR(KVT_EINVAL, "invalid entry name");
  char *dir = entry_path(lb, hash);
  if (!dir)
    return KVT_ENOMEM;
  char *man = kvti_path_join(dir, "manifest.json");
  if (!man) {
    kvti_free(dir);
    return KVT_ENOMEM;
  }
  struct stat st;
  int rc = 1;
  if (kvti_io->lstat(dir, &st) != 0) {
    rc = errno == ENOENT ? 0 : KVT_ERR_OS(errno, "stat data/%s", hash);
  } else if (!S_ISDIR(st.st_mode)) {
    rc = 0;
  } else if (kvti_io->lstat(man, &st) != 0) {
    rc = errno == ENOENT ? 0 : KVT_ERR_OS(errno, "stat data/%s/manifest", hash);
  } else if (!S_ISREG(st.st_mode)) {
    rc = 0;
  }
  kvti_free(man);
  kvti_free(dir);
  return rc;
}

static int lb_present(kvti_backend *b, const char *hash) {
  if (!kvti_is_hash_name(hash))
    return KVT_ERR(KVT_EINVAL, "invalid entry name");
  char *dir = entry_path(L(b), hash);
  if (!dir)
    return KVT_ENOMEM;
  struct stat st;
  int rc = 1;
  if (kvti_io->lstat(dir, &st) != 0)
    rc = errno == ENOENT ? 0 : KVT_ERR_OS(errno, "stat data/%s", hash);
  kvti_free(dir);
  return rc;
}

static int lb_describe(kvti_backend *b, char **json, const char *hash) {
  if (!kvti_is_hash_name(hash))
    return KVT_ERR(KVT_EINVAL, "invalid entry name");
  return kvti_entry_describe(json, L(b)->data_dir, hash);
}

typedef struct name_list {
  char **names;
  time_t *sec; /* ctimes, only when read with want_ctime */
  long *nsec;
  unsigned char
      *type; /* d_type (DT_UNKNOWN when the file system does not say) */
  size_t n, cap;
} name_list;

static void names_free(name_list *l) {
  for (size_t i = 0; i < l->n; i++)
    kvti_free(l->names[i]);
  kvti_free(l->names);
  kvti_free(l->sec);
  kvti_free(l->nsec);
  kvti_free(l->type);
  memset(l, 0, sizeof *l);
}

/* Reads the names of dir (without . and ..), their d_type and, with want_ctime,
 * their ctimes (one lstat each; skipped for data/, which may hold 100,000
 * entries). */
static int names_read(name_list *l, const char *dir, int want_ctime) {
  memset(l, 0, sizeof *l);
  DIR *d = kvti_io->opendir(dir);
  if (!d)
    return KVT_ERR_OS(errno, "opendir %s", dir);
  int rc = 0;
  struct dirent *de;
  while ((de = kvti_io->readdir(d)) != NULL) {
    if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, ".."))
      continue;
    if (l->n == l->cap) {
      size_t nc = l->cap ? l->cap * 2 : 32;
      char **nn = kvti_realloc(l->names, nc * sizeof *nn);
      if (nn)
        l->names = nn;
      time_t *ns = nn ? kvti_realloc(l->sec, nc * sizeof *ns) : NULL;
      if (ns)
        l->sec = ns;
      long *nns = ns ? kvti_realloc(l->nsec, nc * sizeof *nns) : NULL;
      if (nns)
        l->nsec = nns;
      unsigned char *nt = nns ? kvti_realloc(l->type, nc) : NULL;
      if (!nt) {
        rc = KVT_ERR_NOMEM();
        break;
      }
      l->type = nt;
      l->cap = nc;
    }
    char *s = kvti_strdup(de->d_name);
    if (!s) {
      rc = KVT_ENOMEM;
      break;
    }
    l->names[l->n] = s;
    l->sec[l->n] = 0;
    l->nsec[l->n] = 0;
#ifdef DT_UNKNOWN
    l->type[l->n] = de->d_type;
#else
    l->type[l->n] = 0;
#endif
    if (want_ctime) {
      char *p = kvti_path_join(dir, s);
      struct stat st;
      if (p && kvti_io->lstat(p, &st) == 0) {
        l->sec[l->n] = st.st_ctim.tv_sec;
        l->nsec[l->n] = st.st_ctim.tv_nsec;
      }
      kvti_free(p);
    }
    l->n++;
  }
  kvti_io->closedir(d);
  if (rc != 0)
    names_free(l);
  return rc;
}

static int lb_list(kvti_backend *b, kvti_backend_list_fn fn, void *ctx) {
  local_backend *lb = L(b);
  name_list l;
  int rc = names_read(&l, lb->data_dir, 0);
  if (rc != 0)
    return rc;
  for (size_t i = 0; i < l.n && rc == 0; i++) {
    const char *name = l.names[i];
    int kind = KVTI_BK_OTHER;
    if (ends_with(name, ".tmp")) {
      kind = KVTI_BK_TMP;
    } else if (kvti_is_hash_name(name)) {
#ifdef DT_DIR
      if (l.type[i] == DT_DIR) {
        kind = KVTI_BK_ENTRY;
      } else if (l.type[i] == DT_UNKNOWN)
#endif
      {
        char *p = entry_path(lb, name);
        struct stat st;
        if (p && kvti_io->lstat(p, &st) == 0 && S_ISDIR(st.st_mode))
          kind = KVTI_BK_ENTRY;
        kvti_free(p);
      }
    }
    rc = fn(ctx, name, kind);
  }
  names_free(&l);
  return rc;
}

static int lb_purge(kvti_backend *b, const char *name) {
  if (!safe_name(name))
    return KVT_ERR(KVT_EINVAL, "invalid name to purge");
  return remove_tree(L(b), name);
}

/* Removes the oldest quarantined entries until at most keep remain. */
static void quarantine_bound(local_backend *lb, uint32_t keep) {
  name_list l;
  if (names_read(&l, lb->quarantine_dir, 1) != 0)
    return;
  while (l.n > keep) {
    size_t oldest = 0;
    for (size_t i = 1; i < l.n; i++) {
      if (l.sec[i] < l.sec[oldest] ||
          (l.sec[i] == l.sec[oldest] && l.nsec[i] < l.nsec[oldest]) ||
          (l.sec[i] == l.sec[oldest] && l.nsec[i] == l.nsec[oldest] &&
           strcmp(l.names[i], l.names[oldest]) < 0))
        oldest = i;
    }
    char *p = kvti_path_join(lb->quarantine_dir, l.names[oldest]);
    if (p)
      kvti_rmtree(p);
    kvti_free(p);
    kvti_free(l.names[oldest]);
    l.n--;
    l.names[oldest] = l.names[l.n];
    l.sec[oldest] = l.sec[l.n];
    l.nsec[oldest] = l.nsec[l.n];
  }
  names_free(&l);
}

static int lb_quarantine(kvti_backend *b, const char *hash, uint32_t keep_max) {
  local_backend *lb = L(b);
  if (!kvti_is_hash_name(hash))
    return KVT_ERR(KVT_EINVAL, "invalid entry name");
  if (keep_max == 0)
    return remove_tree(lb, hash);
  char *src = entry_path(lb, hash);
  if (!src)
    return KVT_ENOMEM;
  struct stat st;
  if (kvti_io->lstat(src, &st) != 0) {
    int e = errno;
    kvti_free(src);
    return e == ENOENT ? 0 : KVT_ERR_OS(e, "stat data/%s", hash);
  }
  int rc = kvti_mkdir(lb->quarantine_dir, lb->dir_mode);
  if (rc == 0) {
    size_t n = strlen(lb->quarantine_dir) + KVT_HASH_HEX_LEN + 48;
    char *dst = kvti_malloc(n);
    if (!dst) {
      rc = KVT_ERR_NOMEM();
    } else {
      /* Name clash (the same tokens quarantined before): try unique suffixes;
       * never give up the move because a name is taken. */
      rc = KVT_EIO;
      for (unsigned attempt = 0; attempt < 1000; attempt++) {
        if (attempt == 0)
          snprintf(dst, n, "%s/%s", lb->quarantine_dir, hash);
        else
          snprintf(dst, n, "%s/%s.%lld-%u", lb->quarantine_dir, hash,
                   (long long)kvti_now_wall(), attempt);
        struct stat dst_st;
        if (kvti_io->lstat(dst, &dst_st) == 0)
          continue; /* taken (rename would replace an empty dir) */
        if (kvti_io->rename(src, dst) == 0) {
          rc = 0;
          break;
        }
        if (errno != EEXIST && errno != ENOTEMPTY) {
          rc = KVT_ERR_OS(errno, "rename data/%s -> quarantine", hash);
          break;
        }
      }
      kvti_free(dst);
    }
  }
  if (rc != 0) {
    /* The entry is corrupt: if it cannot be kept for inspection it must still
     * leave data/. */
    kvti_error_state es;
    kvti_error_state_capture(&es, rc);
    remove_tree(lb, hash);
    KVT_ERR(rc, "%s (entry deleted instead)", es.msg);
  } else {
    quarantine_bound(lb, keep_max);
  }
  kvti_free(src);
  return rc;
}

static void lb_destroy(kvti_backend *b) {
  local_backend *lb = L(b);
  if (!lb)
    return;
  kvti_free(lb->cache_dir);
  kvti_free(lb->data_dir);
  kvti_free(lb->quarantine_dir);
  kvti_free(lb);
}

static const kvti_backend_ops local_ops = {
    .name = "local",
    .put = lb_put,
    .get = lb_get,
    .remove = lb_remove,
    .exists = lb_exists,
    .present = lb_present,
    .describe = lb_describe,
    .list = lb_list,
    .purge = lb_purge,
    .quarantine = lb_quarantine,
    .destroy = lb_destroy,
};

int kvti_backend_local_new(kvti_backend **out, const char *cache_dir,
                           uint32_t dir_mode) {
  local_backend *lb = kvti_calloc(1, sizeof *lb);
  if (!lb)
    return KVT_ERR_NOMEM();
  lb->base.ops = &local_ops;
  lb->dir_mode = dir_mode;
  lb->cache_dir = kvti_strdup(cache_dir);
  lb->data_dir = lb->cache_dir ? kvti_path_join(cache_dir, "data") : NULL;
  lb->quarantine_dir =
      lb->data_dir ? kvti_path_join(cache_dir, "quarantine") : NULL;
  if (!lb->quarantine_dir) {
    lb_destroy(&lb->base);
    return KVT_ENOMEM;
  }
  *out = &lb->base;
  return 0;
}

const char *kvti_backend_local_data_dir(const kvti_backend *b) {
  return ((const local_backend *)b)->data_dir;
}
