/*
 * local.c - the local-directory storage backend (see backend.h and local.h),
 * the one owner of the cache directory's layout: cache_dir and data/ (created
 * and checked at open), kvtier.lock, index.db's creation, quarantine/ and the
 * remote staging root remote.tmp/. Entries live in cache_dir/data/<hash>/
 * exactly as the reference lays them out, written and read by format/entry*.c;
 * a verified entry fetched from a remote store into the staging root is
 * adopted into data/ by rename (same file system). Corrupt entries move to
 * cache_dir/quarantine/<hash> (a unique suffix on a name clash so a move is
 * never lost), and quarantine/ is bounded by removing the oldest moves (by
 * ctime, which the rename sets). Removal renames the entry to <hash>.rm.tmp
 * before deleting the tree so an entry disappears atomically; a crash
 * mid-delete leaves only a *.tmp that the next open removes.
 */
#include "store/local.h"
#include "store/local_dir.h"
#include "store/local_layout.h"
#include "base/clock.h"
#include "base/error.h"
#include "base/hash.h"
#include "base/io.h"
#include "base/vec.h"
#include "format/chainrec.h"
#include "format/entry_restore.h"
#include "index/index.h"
#include "format/publish.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <time.h>
#include <unistd.h>

typedef struct local_backend {
  kvti_backend base; /* first: the tier holds a kvti_backend* */
  char *cache_dir;
  char *data_dir;
  char *quarantine_dir;
  char *stage_root; /* NULL until kvti_backend_local_stage_root */
  uint32_t dir_mode, file_mode;
  int readonly;
  int lock_fd;                /* flock'ed kvtier.lock, -1: none */
  int dir_lock_fd;            /* the flock'ed cache directory, -1: none */
  kvti_chunk_backend *chunks; /* borrowed (kvti_backend_local_set_chunks) */
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

struct kvti_put_txn {
  kvti_publish pub;
};

int kvti_backend_local_put_stage(kvti_backend *b, kvti_put_txn **txn,
                                 uint64_t *disk_bytes, const kvti_snapshot *s,
                                 const kvti_write_opts *o) {
  *txn = NULL;
  kvti_put_txn *x = kvti_calloc(1, sizeof *x);
  if (!x)
    return KVT_ERR_NOMEM();
  /* A deferred directory sync: put_sync makes the rename durable. */
  int rc = kvti_publish_init(&x->pub, L(b)->data_dir, kvti_snapshot_hash(s),
                             o->do_fsync && !o->defer_dir_sync);
  if (rc == 0)
    rc = kvti_entry_stage(disk_bytes, L(b)->data_dir, s, o);
  if (rc != 0) {
    kvti_publish_free(&x->pub);
    kvti_free(x);
    return rc == KVT_ENOTFOUND ? KVT_EIO : rc;
  }
  *txn = x;
  return 0;
}

int kvti_backend_local_put_publish(kvti_backend *b, kvti_put_txn *x) {
  (void)b;
  int rc = kvti_publish_do(&x->pub);
  return rc == KVT_ENOTFOUND ? KVT_EIO : rc;
}

void kvti_backend_local_put_commit(kvti_backend *b, kvti_put_txn *x) {
  (void)b;
  kvti_publish_commit(&x->pub);
  kvti_publish_free(&x->pub);
  kvti_free(x);
}

int kvti_backend_local_put_sync(kvti_backend *b) {
  return kvti_fsync_dir(L(b)->data_dir);
}

int kvti_backend_local_put_rollback(kvti_backend *b, kvti_put_txn *x) {
  (void)b;
  if (!x)
    return 0;
  int was = x->pub.state;
  int rc = kvti_publish_rollback(&x->pub);
  if (was == KVTI_PUB_NONE)
    kvti_rmtree(x->pub.tmp); /* staged, never published */
  kvti_publish_free(&x->pub);
  kvti_free(x);
  return rc;
}

int kvti_backend_local_probe(kvti_backend *b, const char *hash,
                             kvti_entry_probe_info *out) {
  if (!kvti_is_hash_name(hash))
    return KVT_ERR(KVT_EINVAL, "invalid entry name");
  /* An entry of the chunked store that is its chain alone holds one chain
   * record instead of a manifest (format/chainrec.h). */
  int rc = kvti_entry_probe(out, L(b)->data_dir, hash);
  if (rc == KVT_ENOTFOUND && kvti_chainrec_present(L(b)->data_dir, hash) == 1)
    return kvti_chainrec_probe(out, L(b)->data_dir, hash);
  return rc;
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
    if (rc == 0) /* or a chain record instead (format/chainrec.h) */
      rc = kvti_chainrec_present(lb->data_dir, hash);
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
  int rc = kvti_entry_describe(json, L(b)->data_dir, hash);
  if (rc == KVT_ENOTFOUND && kvti_chainrec_present(L(b)->data_dir, hash) == 1)
    return kvti_chainrec_describe(json, L(b)->data_dir, hash);
  return rc;
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
      /* The four arrays share one capacity: each grows to it in turn. */
      size_t nc = kvti_vec_cap(l->cap, l->n + 1, sizeof(int64_t), 32);
      if ((rc = KVTI_VEC_RESIZE(&l->names, nc)) != 0 ||
          (rc = KVTI_VEC_RESIZE(&l->sec, nc)) != 0 ||
          (rc = KVTI_VEC_RESIZE(&l->nsec, nc)) != 0 ||
          (rc = KVTI_VEC_RESIZE(&l->type, nc)) != 0)
        break;
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

static int quarantine_at(const char *cache_dir, uint32_t dir_mode,
                         const char *hash, uint32_t keep_max, size_t *bounded);

static int lb_quarantine(kvti_backend *b, const char *hash, uint32_t keep_max) {
  local_backend *lb = L(b);
  if (!kvti_is_hash_name(hash))
    return KVT_ERR(KVT_EINVAL, "invalid entry name");
  if (keep_max == 0)
    return remove_tree(lb, hash);
  int rc = quarantine_at(lb->cache_dir, lb->dir_mode, hash, keep_max, NULL);
  if (rc != 0 && rc != KVT_ENOTFOUND) {
    /* The entry is corrupt: if it cannot be kept for inspection it must still
     * leave data/. */
    kvti_error_state es;
    kvti_error_state_capture(&es, rc);
    remove_tree(lb, hash);
    KVT_ERR(rc, "%s (entry deleted instead)", es.msg);
  }
  return rc == KVT_ENOTFOUND ? 0 : rc;
}

/* The move of data/<hash> into quarantine/ and the bound, every name
 * resolved from cache_dir's descriptor without following links (a
 * quarantine/ or data/ swapped for a link is refused, nothing moved out of
 * the cache or removed outside it). The bound governs the entries alone:
 * the chunk-* directories of quarantined chunks are bounded by their own
 * routine (tier/chunk_tools.c), so the two never evict or count each other,
 * and the entry just moved is never the one to go. KVT_ENOTFOUND: no such
 * entry (nothing to do). */
static int quarantine_at(const char *cache_dir, uint32_t dir_mode,
                         const char *hash, uint32_t keep_max, size_t *bounded) {
  if (bounded)
    *bounded = 0;
  int root = kvti_dir_open_root(cache_dir);
  if (root < 0)
    return root;
  int dfd = kvti_dir_open_rel(root, KVTI_LOCAL_DATA, cache_dir), qfd = -1,
      rc = 0;
  struct stat st;
  if (dfd < 0)
    rc = dfd;
  else if ((rc = kvti_lstatat(dfd, hash, &st, hash)) == KVT_ENOTFOUND)
    kvt_clear_error();
  if (rc == 0 && kvti_mkdirat(root, KVTI_LOCAL_QUARANTINE, dir_mode,
                              KVTI_LOCAL_QUARANTINE) >= 0)
    qfd = kvti_dir_open_rel(root, KVTI_LOCAL_QUARANTINE, cache_dir);
  else if (rc == 0)
    rc = KVT_EIO;
  if (rc == 0 && qfd < 0)
    rc = qfd;
  char dst[KVT_HASH_HEX_LEN + 48];
  if (rc == 0) {
    /* Name clash (the same tokens quarantined before): try unique suffixes;
     * never give up the move because a name is taken. */
    rc = KVT_ERR(KVT_EIO, "rename data/%s -> quarantine: no free name", hash);
    for (unsigned attempt = 0; attempt < 1000; attempt++) {
      if (attempt == 0)
        snprintf(dst, sizeof dst, "%s", hash);
      else
        snprintf(dst, sizeof dst, "%s.%lld-%u", hash,
                 (long long)kvti_now_wall(), attempt);
      struct stat dst_st;
      int r = kvti_io->fstatat
                  ? kvti_io->fstatat(qfd, dst, &dst_st, AT_SYMLINK_NOFOLLOW)
                  : fstatat(qfd, dst, &dst_st, AT_SYMLINK_NOFOLLOW);
      if (r == 0)
        continue; /* taken (rename would replace an empty dir) */
      r = kvti_io->renameat ? kvti_io->renameat(dfd, hash, qfd, dst)
                            : renameat(dfd, hash, qfd, dst);
      if (r == 0) {
        kvt_clear_error();
        rc = 0;
        break;
      }
      if (errno != EEXIST && errno != ENOTEMPTY) {
        rc = KVT_ERR_OS(errno, "rename data/%s -> quarantine", hash);
        break;
      }
    }
  }
  if (rc == 0) {
    kvti_error_state es;
    kvti_error_state_capture(&es, 0);
    kvti_dir_bound_others(qfd, keep_max, KVTI_LOCAL_CHUNK_QDIR, dst, bounded,
                          KVTI_LOCAL_QUARANTINE);
    kvti_error_state_restore(&es); /* the move is done: a bound left is not */
  }
  if (qfd >= 0)
    kvti_close(qfd);
  if (dfd >= 0)
    kvti_close(dfd);
  kvti_close(root);
  return rc;
}

/* ---- the remote path: adopting a staged entry, measuring ---- */

int kvti_backend_local_adopt(kvti_backend *b, const char *stage_dir,
                             const char *hash) {
  if (!kvti_is_hash_name(hash))
    return KVT_ERR(KVT_EINVAL, "invalid entry name");
  char *from = kvti_path_join(stage_dir, hash);
  char *to = entry_path(L(b), hash);
  int rc = from && to ? kvti_rename(from, to) : KVT_ERR_NOMEM();
  kvti_free(from);
  kvti_free(to);
  return rc;
}

/* The apparent bytes of data/<hash>/ (a row the reference wrote has no
 * kvtier_meta). */
int kvti_backend_local_measure(kvti_backend *b, const char *hash,
                               uint64_t *bytes) {
  char *dir = entry_path(L(b), hash);
  if (!dir)
    return KVT_ENOMEM;
  int measured = kvti_dir_bytes(bytes, dir, 1) == 0;
  kvti_free(dir);
  return measured;
}

static void lb_destroy(kvti_backend *b) {
  local_backend *lb = L(b);
  if (!lb)
    return;
  kvti_backend_local_unlock(b);
  if (lb->stage_root) {
    kvti_rmtree(lb->stage_root);
    kvti_free(lb->stage_root);
  }
  kvti_free(lb->cache_dir);
  kvti_free(lb->data_dir);
  kvti_free(lb->quarantine_dir);
  kvti_free(lb);
}

static kvti_chunk_backend *lb_chunks(kvti_backend *b) {
  return L(b)->chunks;
}

void kvti_backend_local_set_chunks(kvti_backend *b, kvti_chunk_backend *cb) {
  L(b)->chunks = cb;
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
    .chunks = lb_chunks,
    .destroy = lb_destroy,
};

int kvti_backend_is_local(const kvti_backend *b) {
  return b && b->ops == &local_ops;
}

/* ------------------------------------------------------------------------ */
/* The layout: open, lock, index.db, staging                               */
/* ------------------------------------------------------------------------ */

/* Creates path and missing parents (parents with mode too). Existing components
 * are fine. */
static int mkdir_p(const char *path, mode_t mode) {
  char *p = kvti_strdup(path);
  if (!p)
    return KVT_ENOMEM;
  int rc = 0;
  for (char *s = p + 1; *s && rc == 0; s++) {
    if (*s != '/')
      continue;
    *s = '\0';
    struct stat st;
    if (kvti_io->lstat(p, &st) != 0)
      rc = kvti_mkdir(p, mode);
    *s = '/';
  }
  kvti_free(p);
  return rc;
}

/* Creates dir (chmod'ing a newly created one to exactly mode, whatever the
 * umask) and refuses a symlink, a non-directory, a directory owned by someone
 * else or writable by group/others beyond what mode grants (unless skip_owner).
 */
static int secure_dir(const char *dir, mode_t mode, int create,
                      int skip_owner) {
  struct stat st;
  if (kvti_io->lstat(dir, &st) != 0) {
    if (errno != ENOENT || !create)
      return KVT_ERR_OS(errno, "cache directory %s", dir);
    int rc = mkdir_p(dir, mode);
    if (rc == 0)
      rc = kvti_mkdir(dir, mode);
    if (rc != 0)
      return rc;
    if (kvti_io->chmod(dir, mode) != 0)
      return KVT_ERR_OS(errno, "chmod %s", dir);
    if (kvti_io->lstat(dir, &st) != 0)
      return KVT_ERR_OS(errno, "stat %s", dir);
  }
  if (S_ISLNK(st.st_mode))
    return KVT_ERR(KVT_EPERM,
                   "%s is a symlink; refusing to use it as a cache directory "
                   "(point cache_dir at the real directory)",
                   dir);
  if (!S_ISDIR(st.st_mode))
    return KVT_ERR(KVT_EIO, "%s exists and is not a directory", dir);
  if (skip_owner)
    return 0;
  if (st.st_uid != geteuid())
    return KVT_ERR(KVT_EPERM,
                   "%s is owned by uid %u, not by the current user (uid %u); "
                   "refusing it (KVT_OPEN_SKIP_OWNER_CHECK overrides)",
                   dir, (unsigned)st.st_uid, (unsigned)geteuid());
  if ((st.st_mode & 022) & ~mode)
    return KVT_ERR(KVT_EPERM,
                   "%s is writable by group or others (mode %03o); refusing it "
                   "(chmod go-w, or KVT_OPEN_SKIP_OWNER_CHECK)",
                   dir, (unsigned)(st.st_mode & 0777));
  return 0;
}

/* One writer process per directory: an advisory flock on kvtier.lock, held
 * until unlock. flock (not fcntl) so a second tier in the same process is
 * refused as well. */
static int take_lock(local_backend *lb) {
  char *lp = kvti_path_join(lb->cache_dir, KVTI_LOCAL_LOCK);
  if (!lp)
    return KVT_ENOMEM;
  int fd = kvti_open(lp, O_RDWR | O_CREAT, lb->file_mode);
  kvti_free(lp);
  if (fd < 0)
    return fd;
  lb->lock_fd = fd;
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    int e = errno;
    if (e == EWOULDBLOCK)
      return KVT_ERR(KVT_EBUSY,
                     "%s is in use by another writer (kvtier.lock is held); "
                     "one writer process per cache directory is supported, "
                     "open with KVT_OPEN_READONLY to read it",
                     lb->cache_dir);
    return KVT_ERR_OS(e, "lock %s/kvtier.lock", lb->cache_dir);
  }
  /* The lock file is a name anyone can delete, after which a second writer
   * would lock a new file of the same name: the directory itself is locked
   * too (flock works on a directory's descriptor), and it cannot be replaced
   * while open. kvtier.lock stays for tools that look for it. */
  fd = kvti_open(lb->cache_dir, O_RDONLY | O_DIRECTORY, 0);
  if (fd < 0)
    return fd;
  lb->dir_lock_fd = fd;
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    int e = errno;
    return e == EWOULDBLOCK
               ? KVT_ERR(KVT_EBUSY,
                         "%s is in use by another writer (the directory is "
                         "locked); open with KVT_OPEN_READONLY to read it",
                         lb->cache_dir)
               : KVT_ERR_OS(e, "lock %s", lb->cache_dir);
  }
  return 0;
}

int kvti_backend_local_open(kvti_backend **out, const kvti_local_cfg *cfg) {
  local_backend *lb = kvti_calloc(1, sizeof *lb);
  if (!lb)
    return KVT_ERR_NOMEM();
  lb->base.ops = &local_ops;
  lb->dir_mode = cfg->dir_mode;
  lb->file_mode = cfg->file_mode;
  lb->readonly = cfg->readonly;
  lb->lock_fd = -1;
  lb->dir_lock_fd = -1;
  lb->cache_dir = kvti_strdup(cfg->dir);
  lb->data_dir =
      lb->cache_dir ? kvti_path_join(cfg->dir, KVTI_LOCAL_DATA) : NULL;
  lb->quarantine_dir =
      lb->data_dir ? kvti_path_join(cfg->dir, KVTI_LOCAL_QUARANTINE) : NULL;
  int rc = lb->quarantine_dir ? 0 : KVT_ENOMEM;
  if (rc == 0)
    rc = secure_dir(lb->cache_dir, cfg->dir_mode, !cfg->readonly,
                    cfg->skip_owner);
  if (rc == 0)
    rc = secure_dir(lb->data_dir, cfg->dir_mode, !cfg->readonly,
                    cfg->skip_owner);
  if (rc == 0 && !cfg->readonly)
    rc = take_lock(lb);
  if (rc != 0) {
    lb_destroy(&lb->base);
    return rc;
  }
  *out = &lb->base;
  return 0;
}

void kvti_backend_local_unlock(kvti_backend *b) {
  local_backend *lb = L(b);
  if (lb->lock_fd >= 0) {
    kvti_io->close(lb->lock_fd); /* releases the flock */
    lb->lock_fd = -1;
  }
  if (lb->dir_lock_fd >= 0) {
    kvti_io->close(lb->dir_lock_fd);
    lb->dir_lock_fd = -1;
  }
}

int kvti_backend_local_recover(kvti_backend *b, int do_fsync,
                               uint64_t *restored) {
  return kvti_entry_restore_aside(L(b)->data_dir, do_fsync, restored);
}

/* SQLite creates a new database (and then its -wal and -shm, which copy the
 * database's mode) with 0644 minus the umask. Creating an empty index.db first
 * with file_mode - an empty file is a valid empty database - gives the index
 * the same permissions as the entry files. An existing index.db is left as it
 * is (it may be shared with the reference on purpose). */
int kvti_backend_local_prepare_index(kvti_backend *b) {
  local_backend *lb = L(b);
  char *p = kvti_path_join(lb->cache_dir, KVTI_INDEX_DB_FILE);
  if (!p)
    return KVT_ENOMEM;
  mode_t mode = (mode_t)lb->file_mode;
  int fd = kvti_open(p, O_RDWR | O_CREAT | O_EXCL, mode);
  int rc = 0;
  if (fd >= 0) {
    if (kvti_io->chmod(p, mode) != 0)
      rc = KVT_ERR_OS(errno, "chmod %s", p);
    kvti_io->close(fd);
  } else if (kvt_last_errno() != EEXIST) {
    rc = fd;
  }
  kvti_free(p);
  return rc;
}

int kvti_backend_local_stage_root(kvti_backend *b, const char **root) {
  local_backend *lb = L(b);
  if (lb->stage_root) {
    *root = lb->stage_root;
    return 0;
  }
  int rc = 0;
  if (!lb->readonly) {
    /* Next to data/ (same file system: a fetched entry is adopted by rename).
     * The one writer process owns it, so a leftover is stale. */
    char *p = kvti_path_join(lb->cache_dir, KVTI_LOCAL_STAGE);
    if (!p)
      return KVT_ENOMEM;
    kvti_rmtree(p);
    if ((rc = kvti_mkdir(p, lb->dir_mode)) != 0) {
      kvti_free(p);
      return rc;
    }
    lb->stage_root = p;
  } else {
    /* A reader may not write the cache directory: a private one elsewhere
     * (nothing is adopted by a read-only tier). */
    const char *tmp = getenv("TMPDIR");
    char tmpl[4096];
    snprintf(tmpl, sizeof tmpl, "%s/kvtier-remote-XXXXXX",
             tmp && tmp[0] == '/' ? tmp : "/tmp");
    if (!mkdtemp(tmpl))
      return KVT_ERR_OS(errno, "mkdtemp %s", tmpl);
    if (!(lb->stage_root = kvti_strdup(tmpl))) {
      kvti_rmtree(tmpl);
      return KVT_ENOMEM;
    }
  }
  *root = lb->stage_root;
  return 0;
}

int kvti_backend_local_verify_mem(kvti_backend *b, const char *hash,
                                  kvt_layer *layers, uint32_t n_layers,
                                  const kvti_read_opts *o) {
  return kvti_entry_verify_mem(L(b)->data_dir, hash, layers, n_layers, o);
}
