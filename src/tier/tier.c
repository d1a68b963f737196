/*
 * tier.c - the tier's lifecycle and maintenance: open (option validation,
 * directory creation and the ownership/permission/symlink checks, the
 * one-writer lock file, stale tmp removal, index, reconcile), close/free (stop
 * accepting, drain with a timeout, join the writer, wait for promotes, close
 * the index), lookups with retention applied, touch, remove, reconcile, gc
 * (capacity by LRU over bytes on disk, retention since written), quarantine,
 * foreach, describe and verify. Spilling lives in writer.c, promoting in
 * promote.c.
 */
#include "tier/tier.h"
#include "engine/iobatch.h"
#include "base/error.h"
#include "base/hash.h"
#include "index/index.h"
#include "base/io.h"
#include "tier/options.h"
#include "tier/remote.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <unistd.h>

/* ------------------------------------------------------------------------ */
/* Small shared helpers                                                     */
/* ------------------------------------------------------------------------ */

double kvti_now_wall(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

double kvti_now_mono(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

double kvti_tier_cutoff(const kvt_tier *t) {
  if (t->opts.retention_seconds <= 0)
    return 0;
  return kvti_now_wall() - (double)t->opts.retention_seconds;
}

int kvti_cond_init(pthread_cond_t *cv) {
  pthread_condattr_t a;
  if (pthread_condattr_init(&a) != 0)
    return KVT_ERR(KVT_ENOMEM, "pthread_condattr_init failed");
  pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
  int r = pthread_cond_init(cv, &a);
  pthread_condattr_destroy(&a);
  return r == 0 ? 0 : KVT_ERR(KVT_ENOMEM, "pthread_cond_init failed");
}

void kvti_deadline(struct timespec *ts, int *has, int64_t timeout_ms) {
  *has = timeout_ms >= 0;
  if (!*has)
    return;
  clock_gettime(CLOCK_MONOTONIC, ts);
  ts->tv_sec += (time_t)(timeout_ms / 1000);
  ts->tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
  if (ts->tv_nsec >= 1000000000L) {
    ts->tv_sec++;
    ts->tv_nsec -= 1000000000L;
  }
}

int kvti_cond_wait_until(pthread_cond_t *cv, pthread_mutex_t *mu,
                         const struct timespec *ts, int has) {
  if (!has) {
    pthread_cond_wait(cv, mu);
    return 0;
  }
  return pthread_cond_timedwait(cv, mu, ts) == ETIMEDOUT ? ETIMEDOUT : 0;
}

void kvti_log(kvt_tier *t, int level, const char *fmt, ...) {
  if (!t->opts.log_fn || level < t->opts.log_level)
    return;
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  t->opts.log_fn(t->opts.log_ctx, level, msg);
}

int kvti_tier_enter(kvt_tier *t) {
  atomic_fetch_add(&t->active, 1);
  if (atomic_load(&t->state) != KVTI_OPEN) {
    kvti_tier_leave(t);
    return KVT_ERR(KVT_ECLOSED, "the tier is closed");
  }
  return 0;
}

void kvti_tier_leave(kvt_tier *t) {
  /* After the decrement that lets a closer proceed, t may be freed at any
   * moment: the fast path touches nothing after it. While closing, the
   * decrement happens under life_mu, which the closer holds while it checks
   * active, so the broadcast cannot be lost and the closer cannot finish before
   * we unlock. A decrement on the fast path that races with the start of a
   * close is caught by the closer's periodic re-check (see tier_close). */
  if (atomic_load(&t->state) == KVTI_OPEN) {
    atomic_fetch_sub(&t->active, 1);
    return;
  }
  pthread_mutex_lock(&t->life_mu);
  atomic_fetch_sub(&t->active, 1);
  pthread_cond_broadcast(&t->life_cv);
  pthread_mutex_unlock(&t->life_mu);
}

/* Saves and restores the thread's error message around best-effort side work
 * (quarantine, logging) so the caller still reports the original failure. */
typedef struct saved_err {
  char msg[1024];
  int os;
} saved_err;
static void err_save(saved_err *s) {
  snprintf(s->msg, sizeof s->msg, "%s", kvt_last_error());
  s->os = kvt_last_errno();
}
static void err_restore(const saved_err *s, int code) {
  if (s->os)
    kvti_error_os(s->os, __FILE__, __LINE__, "%s", s->msg);
  else
    kvti_error_set(code, __FILE__, __LINE__, "%s", s->msg);
}

/* ------------------------------------------------------------------------ */
/* Removal, capacity, retention, quarantine                                 */
/* ------------------------------------------------------------------------ */

int kvti_tier_remove_locked(kvt_tier *t, const char *hash, int why) {
  kvt_entry_info info;
  kvti_stripe_wrlock(&t->stripes, hash);
  int rc = kvti_index_find_hash(&info, t->idx, hash);
  if (rc == 0)
    rc = kvti_index_remove_hash(t->idx, hash); /* row first: no new lookup */
  if (rc == 0) {
    int r = t->be->ops->remove(t->be, hash);
    if (r != 0)
      kvti_log(t, KVT_LOG_WARN,
               "kvtier: removing files of %.16s failed (%s); reconcile will "
               "clean them",
               hash, kvt_last_error());
  }
  kvti_stripe_unlock(&t->stripes, hash);
  if (rc == 0) {
    if (why == KVTI_RM_EVICT)
      KVTI_STAT_ADD(&t->stats, evictions, 1);
    else if (why == KVTI_RM_EXPIRE)
      KVTI_STAT_ADD(&t->stats, expirations, 1);
    kvti_log(t, KVT_LOG_DEBUG, "kvtier: %s %.16s (%llu tokens, %llu bytes)",
             why == KVTI_RM_EVICT    ? "evicted"
             : why == KVTI_RM_EXPIRE ? "expired"
                                     : "removed",
             hash, (unsigned long long)info.num_tokens,
             (unsigned long long)info.disk_bytes);
  }
  return rc;
}

void kvti_tier_enforce_locked(kvt_tier *t, int64_t max_entries,
                              uint64_t max_bytes, double cutoff,
                              uint64_t *removed, uint64_t *removed_bytes) {
  kvt_entry_info v;
  /* Retention first: expired entries go before any live one is evicted. */
  if (cutoff > 0) {
    while (kvti_index_oldest_before(&v, t->idx, cutoff) == 0) {
      if (kvti_tier_remove_locked(t, v.token_hash, KVTI_RM_EXPIRE) != 0)
        break;
      if (removed)
        (*removed)++;
      if (removed_bytes)
        *removed_bytes += v.disk_bytes;
    }
  }
  for (;;) {
    uint64_t n = 0, bytes = 0;
    kvti_index_totals(t->idx, &n, &bytes, NULL);
    if (n <= (uint64_t)max_entries && bytes <= max_bytes)
      break;
    if (kvti_index_lru_victim(&v, t->idx) != 0)
      break;
    if (kvti_tier_remove_locked(t, v.token_hash, KVTI_RM_EVICT) != 0)
      break; /* never spin on an entry that cannot be removed */
    if (removed)
      (*removed)++;
    if (removed_bytes)
      *removed_bytes += v.disk_bytes;
  }
}

/* Caller holds mut_mu and the stripe exclusively. True when the index still
 * holds the version a reader saw: created_at >= 0 is the row's created_at at
 * read time (a replacement written since has another and is left alone);
 * created_at < 0 means the reader saw no row, and it must still have none. */
static int same_version(kvt_tier *t, const char *hash, double created_at,
                        int *stored) {
  kvt_entry_info cur;
  *stored = kvti_index_find_hash(&cur, t->idx, hash) == 0;
  if (created_at < 0)
    return !*stored;
  return *stored && cur.created_at == created_at;
}

void kvti_tier_quarantine(kvt_tier *t, const char *hash, double created_at) {
  if (t->readonly)
    return;
  saved_err se;
  err_save(&se);
  pthread_mutex_lock(&t->mut_mu);
  kvti_stripe_wrlock(&t->stripes, hash);
  int stored = 0;
  if (same_version(t, hash, created_at, &stored)) {
    if (stored)
      kvti_index_remove_hash(t->idx, hash); /* row first: no new lookup */
    int r = t->be->ops->quarantine(t->be, hash, t->opts.quarantine_max);
    KVTI_STAT_ADD(&t->stats, quarantined, 1);
    if (r != 0)
      kvti_log(t, KVT_LOG_WARN, "kvtier: quarantine of %.16s: %s", hash,
               kvt_last_error());
    else
      kvti_log(t, KVT_LOG_WARN, "kvtier: quarantined corrupt entry %s (%s)",
               hash, se.msg);
  }
  kvti_stripe_unlock(&t->stripes, hash);
  pthread_mutex_unlock(&t->mut_mu);
  err_restore(&se, KVT_ECORRUPT);
}

void kvti_tier_drop_missing(kvt_tier *t, const char *hash, double created_at) {
  if (t->readonly)
    return;
  saved_err se;
  err_save(&se);
  pthread_mutex_lock(&t->mut_mu);
  kvti_stripe_wrlock(&t->stripes, hash);
  int stored = 0;
  if (created_at >= 0 && same_version(t, hash, created_at, &stored) &&
      t->be->ops->exists(t->be, hash) == 0) {
    kvti_index_remove_hash(t->idx, hash);
    t->be->ops->remove(t->be, hash);
    KVTI_STAT_ADD(&t->stats, reconciled, 1);
    kvti_log(t, KVT_LOG_WARN, "kvtier: entry %.16s had no files; row dropped",
             hash);
  }
  kvti_stripe_unlock(&t->stripes, hash);
  pthread_mutex_unlock(&t->mut_mu);
  err_restore(&se, KVT_ENOTFOUND);
}

/* ------------------------------------------------------------------------ */
/* Reconcile                                                                */
/* ------------------------------------------------------------------------ */

/* A growing list of names (hashes or data/ names). */
typedef struct strv {
  char **v;
  size_t n, cap;
  int oom;
} strv;

static int strv_push(strv *l, const char *s) {
  if (l->n == l->cap) {
    size_t nc = l->cap ? l->cap * 2 : 64;
    char **p = kvti_realloc(l->v, nc * sizeof *p);
    if (!p) {
      l->oom = 1;
      return 1;
    }
    l->v = p;
    l->cap = nc;
  }
  char *d = kvti_strdup(s);
  if (!d) {
    l->oom = 1;
    return 1;
  }
  l->v[l->n++] = d;
  return 0;
}

static void strv_free(strv *l) {
  for (size_t i = 0; i < l->n; i++)
    kvti_free(l->v[i]);
  kvti_free(l->v);
  memset(l, 0, sizeof *l);
}

static int collect_row(void *ctx, const kvt_entry_info *info) {
  return strv_push(ctx, info->token_hash);
}

typedef struct name_acc {
  strv entries, tmps;
} name_acc;

static int collect_name(void *ctx, const char *name, int kind) {
  name_acc *a = ctx;
  if (kind == KVTI_BK_ENTRY)
    return strv_push(&a->entries, name);
  if (kind == KVTI_BK_TMP)
    return strv_push(&a->tmps, name);
  return 0; /* anything else is not ours: leave it */
}

/* Lists the backend's names into *a (entries and temporaries). Returns 0 or a
 * negative code; *a must be freed with name_acc_free either way. */
static int list_names(kvt_tier *t, name_acc *a) {
  memset(a, 0, sizeof *a);
  int rc = t->be->ops->list(t->be, collect_name, a);
  if (rc == 0 && (a->entries.oom || a->tmps.oom))
    rc = KVT_ERR_NOMEM();
  return rc;
}

static void name_acc_free(name_acc *a) {
  strv_free(&a->entries);
  strv_free(&a->tmps);
}

/* Purges every temporary in tmps; returns how many were removed. */
static int64_t purge_names(kvt_tier *t, const strv *tmps, const char *why) {
  int64_t n = 0;
  for (size_t i = 0; i < tmps->n; i++) {
    if (t->be->ops->purge(t->be, tmps->v[i]) == 0) {
      n++;
      kvti_log(t, KVT_LOG_INFO, "kvtier: %s data/%s", why, tmps->v[i]);
    }
  }
  return n;
}

/* Removes stale *.tmp in data/. Caller holds mut_mu (or no writer exists yet),
 * so no write is in progress and every tmp is stale. Returns the count or a
 * negative code. */
static int64_t purge_tmps(kvt_tier *t) {
  name_acc a;
  int rc = list_names(t, &a);
  int64_t n = rc == 0 ? purge_names(t, &a.tmps, "removed stale temporary") : 0;
  name_acc_free(&a);
  return rc < 0 ? rc : n;
}

/* The reference's reconcile, plus stale temporaries. Caller holds mut_mu. */
static int64_t reconcile_locked(kvt_tier *t) {
  int64_t cleaned = 0;
  strv rows = {0};
  int rc = kvti_index_foreach(t->idx, collect_row, &rows);
  if (rc == 0 && rows.oom)
    rc = KVT_ERR_NOMEM();
  /* Phase 1: rows whose directory or manifest is missing. */
  for (size_t i = 0; rc == 0 && i < rows.n; i++) {
    const char *h = rows.v[i];
    kvti_stripe_wrlock(&t->stripes, h);
    int ex = t->be->ops->exists(t->be, h);
    if (ex == 0 && kvti_index_remove_hash(t->idx, h) == 0) {
      cleaned++;
      kvti_log(t, KVT_LOG_INFO,
               "kvtier: reconcile: removed index row %.16s (files missing)", h);
    }
    kvti_stripe_unlock(&t->stripes, h);
  }
  strv_free(&rows);
  if (rc != 0)
    return rc;
  /* Phase 2: data directories with no row, and stale temporaries. */
  name_acc a;
  rc = list_names(t, &a);
  for (size_t i = 0; rc == 0 && i < a.entries.n; i++) {
    const char *h = a.entries.v[i];
    kvt_entry_info info;
    kvti_stripe_wrlock(&t->stripes, h);
    if (kvti_index_find_hash(&info, t->idx, h) == KVT_ENOTFOUND &&
        t->be->ops->remove(t->be, h) == 0) {
      cleaned++;
      kvti_log(t, KVT_LOG_INFO,
               "kvtier: reconcile: removed data/%s (no index row)", h);
    }
    kvti_stripe_unlock(&t->stripes, h);
  }
  if (rc == 0)
    cleaned += purge_names(t, &a.tmps, "reconcile: removed stale");
  name_acc_free(&a);
  if (rc != 0)
    return rc;
  if (cleaned > 0) {
    KVTI_STAT_ADD(&t->stats, reconciled, cleaned);
    kvti_log(t, KVT_LOG_INFO, "kvtier: reconciliation cleaned %lld entries",
             (long long)cleaned);
  }
  return cleaned;
}

int64_t kvt_tier_reconcile(kvt_tier *t) {
  if (!t)
    return KVT_ERR(KVT_EINVAL, "tier is NULL");
  int rc = kvti_tier_enter(t);
  if (rc != 0)
    return rc;
  int64_t r;
  if (t->readonly) {
    r = KVT_ERR(KVT_EINVAL,
                "reconcile needs a writable tier (opened read-only)");
  } else {
    pthread_mutex_lock(&t->mut_mu);
    r = reconcile_locked(t);
    pthread_mutex_unlock(&t->mut_mu);
  }
  kvti_tier_leave(t);
  return r;
}

/* ------------------------------------------------------------------------ */
/* Open                                                                     */
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

static void tier_destroy(kvt_tier *t) {
  if (!t)
    return;
  kvti_remote_free(t);
  kvti_pool_destroy(t);
  kvti_writer_destroy(t);
  if (t->idx)
    kvt_index_close(t->idx);
  if (t->be)
    t->be->ops->destroy(t->be);
  if (t->lock_fd >= 0)
    kvti_io->close(t->lock_fd); /* releases the flock */
  kvti_stripes_destroy(&t->stripes);
  kvti_stats_destroy(&t->stats);
  pthread_mutex_destroy(&t->mut_mu);
  pthread_mutex_destroy(&t->life_mu);
  pthread_cond_destroy(&t->life_cv);
  pthread_mutex_destroy(&t->close_mu);
  kvti_free(t->dir);
  kvti_free(t->data_dir);
  kvti_free(t);
}

static char *absolute_dir(const char *dir) {
  if (dir[0] == '/')
    return kvti_strdup(dir);
  char cwd[4096];
  if (!getcwd(cwd, sizeof cwd)) {
    KVT_ERR_OS(errno, "getcwd (to make %s absolute)", dir);
    return NULL;
  }
  return kvti_path_join(cwd, dir);
}

/* SQLite creates a new database (and then its -wal and -shm, which copy the
 * database's mode) with 0644 minus the umask. Creating an empty index.db first
 * with file_mode - an empty file is a valid empty database - gives the index
 * the same permissions as the entry files. An existing index.db is left as it
 * is (it may be shared with the reference on purpose). */
static int precreate_db(const char *dir, uint32_t file_mode) {
  char *p = kvti_path_join(dir, "index.db");
  if (!p)
    return KVT_ENOMEM;
  int fd = kvti_open(p, O_RDWR | O_CREAT | O_EXCL, (mode_t)file_mode);
  int rc = 0;
  if (fd >= 0) {
    if (kvti_io->chmod(p, (mode_t)file_mode) != 0)
      rc = KVT_ERR_OS(errno, "chmod %s", p);
    kvti_io->close(fd);
  } else if (kvt_last_errno() != EEXIST) {
    rc = fd;
  }
  kvti_free(p);
  return rc;
}

/* The index's measuring callback (kvti_index_measure): the apparent bytes of
 * data/<hash>/ for a row the reference wrote. 1 measured, 0 not measurable,
 * KVT_ENOMEM. The directory layout is the local store's; this stays here, next
 * to the data_dir the tier creates, until the backend interface measures. */
static int measure_entry(void *ctx, const char *hash, uint64_t *bytes) {
  char *dir = kvti_path_join(((const kvt_tier *)ctx)->data_dir, hash);
  if (!dir)
    return KVT_ENOMEM;
  int measured = kvti_dir_bytes(bytes, dir, 1) == 0;
  kvti_free(dir);
  return measured;
}

int kvt_tier_open(kvt_tier **out, const kvt_options *opts) {
  if (!out)
    return KVT_ERR(KVT_EINVAL, "kvt_tier_open: out is NULL");
  int rc = kvt_options_validate(opts);
  if (rc != 0)
    return rc;
#if !KVT_HAVE_URING
  if (opts->io_backend == KVT_IO_URING)
    return KVT_ERR(KVT_EUNSUPPORTED, "io_backend KVT_IO_URING: this build has "
                                     "no io_uring support (use AUTO or "
                                     "PORTABLE)");
#endif
  if (opts->io_backend == KVT_IO_URING) {
    /* Built with io_uring, but it may still be unusable here (seccomp, an old
     * kernel, io_uring_disabled): refuse now rather than fail every spill and
     * promote. */
    kvti_iobatch *probe = NULL;
    rc = kvti_iobatch_get(&probe, KVT_IO_URING);
    if (rc != 0)
      return rc;
    kvti_iobatch_put(probe);
  }
  kvt_tier *t = kvti_calloc(1, sizeof *t);
  if (!t)
    return KVT_ERR_NOMEM();
  t->lock_fd = -1;
  t->opts = *opts;
  t->readonly = (opts->flags & KVT_OPEN_READONLY) != 0;
  t->max_bytes = kvti_options_max_bytes(opts);
  pthread_mutex_init(&t->mut_mu, NULL);
  pthread_mutex_init(&t->life_mu, NULL);
  pthread_mutex_init(&t->close_mu, NULL);
  kvti_stats_init(&t->stats);
  atomic_init(&t->state, KVTI_OPEN);
  atomic_init(&t->active, 0);
  if ((rc = kvti_cond_init(&t->life_cv)) != 0) {
    pthread_cond_init(&t->life_cv, NULL); /* so destroy is valid */
    goto fail;
  }
  if ((rc = kvti_stripes_init(&t->stripes)) != 0)
    goto fail;
  if ((rc = kvti_writer_init(t)) != 0)
    goto fail;
  if ((rc = kvti_pool_init(t)) != 0)
    goto fail;

  char *resolved = NULL;
  if ((rc = kvti_options_resolve_dir(&resolved, opts)) != 0)
    goto fail;
  t->dir = absolute_dir(resolved);
  kvti_free(resolved);
  if (!t->dir) {
    rc = KVT_ENOMEM;
    goto fail;
  }
  t->opts.cache_dir = t->dir;
  t->data_dir = kvti_path_join(t->dir, "data");
  if (!t->data_dir) {
    rc = KVT_ENOMEM;
    goto fail;
  }
  int skip = (opts->flags & KVT_OPEN_SKIP_OWNER_CHECK) != 0;
  if ((rc = secure_dir(t->dir, opts->dir_mode, !t->readonly, skip)) != 0)
    goto fail;
  if ((rc = secure_dir(t->data_dir, opts->dir_mode, !t->readonly, skip)) != 0)
    goto fail;

  if (!t->readonly) {
    /* One writer process per directory: an advisory flock on kvtier.lock, held
     * until close. flock (not fcntl) so a second tier in the same process is
     * refused as well. */
    char *lp = kvti_path_join(t->dir, "kvtier.lock");
    if (!lp) {
      rc = KVT_ENOMEM;
      goto fail;
    }
    rc = kvti_open(lp, O_RDWR | O_CREAT, opts->file_mode);
    kvti_free(lp);
    if (rc < 0)
      goto fail;
    t->lock_fd = rc;
    rc = 0;
    if (flock(t->lock_fd, LOCK_EX | LOCK_NB) != 0) {
      int e = errno;
      if (e == EWOULDBLOCK)
        rc = KVT_ERR(KVT_EBUSY,
                     "%s is in use by another writer (kvtier.lock is held); "
                     "one writer process per cache directory is supported, "
                     "open with KVT_OPEN_READONLY to read it",
                     t->dir);
      else
        rc = KVT_ERR_OS(e, "lock %s/kvtier.lock", t->dir);
      goto fail;
    }
  }

  if ((rc = kvti_backend_local_new(&t->be, t->dir, opts->dir_mode)) != 0)
    goto fail;
  if (!t->readonly && (opts->flags & KVT_OPEN_NO_RECONCILE)) {
    /* (reconcile below removes them too, in the same directory walk) */
    int64_t n = purge_tmps(t);
    if (n < 0) {
      rc = (int)n;
      goto fail;
    }
  }
  if (!t->readonly && (rc = precreate_db(t->dir, opts->file_mode)) != 0)
    goto fail;
  kvti_index_measure measure = {measure_entry, t};
  if ((rc = kvti_index_open(&t->idx, t->dir, &measure, t->readonly)) != 0)
    goto fail;
  /* FSYNC durability covers the row too: the WAL is synced at each commit, so
   * an acknowledged entry cannot lose its row (and then its files, to
   * reconcile) in a power loss. */
  if (!t->readonly && opts->durability == KVT_DURABILITY_FSYNC &&
      (rc = kvti_index_set_durable(t->idx, 1)) != 0)
    goto fail;
  if ((rc = kvti_remote_open(t)) != 0)
    goto fail;
  if (!t->readonly && !(opts->flags & KVT_OPEN_NO_RECONCILE)) {
    int64_t n = reconcile_locked(t);
    if (n < 0) {
      rc = (int)n;
      goto fail;
    }
  }
  kvti_log(t, KVT_LOG_INFO, "kvtier: opened %s%s", t->dir,
           t->readonly ? " (read-only)" : "");
  *out = t;
  return 0;
fail:;
  saved_err se;
  err_save(&se);
  tier_destroy(t);
  err_restore(&se, rc);
  return rc;
}

/* ------------------------------------------------------------------------ */
/* Close and free                                                           */
/* ------------------------------------------------------------------------ */

static int tier_close(kvt_tier *t, int64_t timeout_ms, int drop) {
  pthread_mutex_lock(&t->close_mu);
  int state = atomic_load(&t->state);
  if (state == KVTI_CLOSED) {
    pthread_mutex_unlock(&t->close_mu);
    return 0;
  }
  /* 1. Stop accepting spills. */
  pthread_mutex_lock(&t->w.mu);
  t->w.accepting = 0;
  int need_start = !t->w.started && t->w.depth > 0 && !drop;
  pthread_mutex_unlock(&t->w.mu);
  /* 2. Drain: queued spills are written (starting the writer if nobody did). */
  if (need_start) {
    int r = kvt_tier_start_writer(t);
    if (r != 0) {
      pthread_mutex_unlock(&t->close_mu);
      return r;
    }
  }
  if (!drop) {
    int r = kvti_writer_drain(t, timeout_ms);
    if (r != 0) {
      kvti_log(t, KVT_LOG_WARN,
               "kvtier: close timed out with spills still queued; the tier "
               "stays open for reads, call close again");
      pthread_mutex_unlock(&t->close_mu);
      return r;
    }
  }
  /* 3. Join the writer (free drops what has not started), then let the remote
   * uploads finish within the same timeout (they are best effort: what is
   * left after it is dropped). */
  kvti_writer_stop(t, drop);
  if (!drop) {
    struct timespec rts;
    int rhas;
    kvti_deadline(&rts, &rhas, timeout_ms);
    if (kvti_remote_drain(t, &rts, rhas) != 0)
      kvti_log(t, KVT_LOG_WARN, "kvtier: close: %s; dropped", kvt_last_error());
  }
  kvti_remote_stop(t, 1);
  /* 4. Refuse new calls and wait for those in flight, including async promotes.
   */
  atomic_store(&t->state, KVTI_TEARDOWN);
  pthread_mutex_lock(&t->life_mu);
  while (atomic_load(&t->active) > 0) {
    struct timespec ts;
    int has;
    kvti_deadline(&ts, &has, 5); /* re-check: see kvti_tier_leave */
    kvti_cond_wait_until(&t->life_cv, &t->life_mu, &ts, has);
  }
  pthread_mutex_unlock(&t->life_mu);
  kvti_pool_stop(t);
  /* 5. Flush batched touches, close the index, release the directory lock. */
  if (t->idx) {
    if (!t->readonly)
      kvti_index_flush(t->idx);
    kvt_index_close(t->idx);
    t->idx = NULL;
  }
  if (t->lock_fd >= 0) {
    kvti_io->close(t->lock_fd);
    t->lock_fd = -1;
  }
  atomic_store(&t->state, KVTI_CLOSED);
  kvti_log(t, KVT_LOG_INFO, "kvtier: closed %s", t->dir);
  pthread_mutex_unlock(&t->close_mu);
  return 0;
}

int kvt_tier_close(kvt_tier *t, int64_t timeout_ms) {
  if (!t)
    return KVT_ERR(KVT_EINVAL, "tier is NULL");
  return tier_close(t, timeout_ms, 0);
}

void kvt_tier_free(kvt_tier *t) {
  if (!t)
    return;
  tier_close(t, -1, 1);
  tier_destroy(t);
}

const char *kvt_tier_dir(const kvt_tier *t) {
  return t ? t->dir : NULL;
}

/* ------------------------------------------------------------------------ */
/* Lookups and entry operations                                             */
/* ------------------------------------------------------------------------ */

static int check_tokens(const int32_t *tokens, size_t n) {
  if (!tokens && n > 0)
    return KVT_ERR(KVT_EINVAL, "tokens is NULL with n_tokens > 0");
  return 0;
}

static int lookup_common(kvt_entry_info *out, kvt_tier *t,
                         const int32_t *tokens, size_t n, int prefix) {
  if (!out || !t)
    return KVT_ERR(KVT_EINVAL, "lookup: NULL argument");
  int rc = check_tokens(tokens, n);
  if (rc != 0 || (rc = kvti_tier_enter(t)) != 0)
    return rc;
  double cutoff = kvti_tier_cutoff(t);
  rc = prefix ? kvti_index_find_prefix(out, t->idx, tokens, n, cutoff)
              : kvti_index_find(out, t->idx, tokens, n, cutoff);
  /* The remote store, as a promote would consult it (promote.c's begin): on a
   * local miss, or for a longer remote prefix than the local one. */
  if (kvti_remote_enabled(t) &&
      (rc == KVT_ENOTFOUND || (rc == 0 && prefix && out->num_tokens < n))) {
    kvt_entry_info ri;
    uint64_t min_len = rc == 0 ? out->num_tokens + 1 : 1;
    if (kvti_remote_peek(t, &ri, tokens, n, prefix, min_len) == 0) {
      *out = ri;
      rc = 0;
    } else if (rc == 0) {
      kvt_clear_error();
    }
  }
  kvti_tier_leave(t);
  return rc;
}

int kvt_tier_lookup(kvt_entry_info *out, kvt_tier *t, const int32_t *tokens,
                    size_t n_tokens) {
  return lookup_common(out, t, tokens, n_tokens, 0);
}

int kvt_tier_lookup_prefix(kvt_entry_info *out, kvt_tier *t,
                           const int32_t *tokens, size_t n_tokens) {
  return lookup_common(out, t, tokens, n_tokens, 1);
}

int kvt_tier_touch(kvt_tier *t, const int32_t *tokens, size_t n_tokens) {
  kvt_entry_info info;
  int rc = kvt_tier_lookup(&info, t, tokens, n_tokens);
  if (rc != 0)
    return rc;
  if ((rc = kvti_tier_enter(t)) != 0)
    return rc;
  if (t->readonly)
    rc = KVT_ERR(KVT_EINVAL, "touch needs a writable tier (opened read-only)");
  else
    rc = kvti_index_touch_hash(t->idx, info.token_hash);
  kvti_tier_leave(t);
  return rc;
}

int kvt_tier_remove(kvt_tier *t, const int32_t *tokens, size_t n_tokens) {
  if (!t)
    return KVT_ERR(KVT_EINVAL, "tier is NULL");
  int rc = check_tokens(tokens, n_tokens);
  if (rc != 0 || (rc = kvti_tier_enter(t)) != 0)
    return rc;
  if (t->readonly) {
    rc = KVT_ERR(KVT_EINVAL, "remove needs a writable tier (opened read-only)");
  } else {
    char hash[KVT_HASH_HEX_LEN + 1];
    rc = kvt_token_hash(hash, tokens, n_tokens);
    if (rc == 0) {
      pthread_mutex_lock(&t->mut_mu);
      rc = kvti_tier_remove_locked(t, hash, KVTI_RM_USER);
      pthread_mutex_unlock(&t->mut_mu);
      if (rc == KVT_ENOTFOUND)
        KVT_ERR(KVT_ENOTFOUND, "no entry for these tokens");
    }
  }
  kvti_tier_leave(t);
  return rc;
}

typedef struct info_vec {
  kvt_entry_info *v;
  size_t n, cap;
  int oom;
} info_vec;

static int collect_info(void *ctx, const kvt_entry_info *info) {
  info_vec *l = ctx;
  if (l->n == l->cap) {
    size_t nc = l->cap ? l->cap * 2 : 64;
    kvt_entry_info *p = kvti_realloc(l->v, nc * sizeof *p);
    if (!p) {
      l->oom = 1;
      return 1;
    }
    l->v = p;
    l->cap = nc;
  }
  l->v[l->n++] = *info;
  return 0;
}

/* Dry-run gc: what kvti_tier_enforce_locked would remove, computed on a
 * snapshot of the rows (most recently used first): expired entries, then the
 * least recently used of the rest. */
static int gc_plan(kvt_tier *t, int64_t max_entries, uint64_t max_bytes,
                   double cutoff, uint64_t *n, uint64_t *bytes) {
  info_vec all = {0};
  int rc = kvti_index_foreach(t->idx, collect_info, &all);
  if (rc == 0 && all.oom)
    rc = KVT_ERR_NOMEM();
  if (rc == 0) {
    uint64_t count = all.n, total = 0;
    for (size_t i = 0; i < all.n; i++)
      total += all.v[i].disk_bytes;
    char *gone = kvti_calloc(all.n ? all.n : 1, 1);
    if (!gone) {
      rc = KVT_ERR_NOMEM();
    } else {
      for (size_t i = 0; cutoff > 0 && i < all.n; i++) {
        if (all.v[i].created_at < cutoff) {
          gone[i] = 1;
          count--;
          total -= all.v[i].disk_bytes;
          (*n)++;
          *bytes += all.v[i].disk_bytes;
        }
      }
      for (size_t i = all.n; i-- > 0;) {
        if (count <= (uint64_t)max_entries && total <= max_bytes)
          break;
        if (gone[i])
          continue;
        count--;
        total -= all.v[i].disk_bytes;
        (*n)++;
        *bytes += all.v[i].disk_bytes;
      }
      kvti_free(gone);
    }
  }
  kvti_free(all.v);
  return rc;
}

int kvt_tier_gc(kvt_tier *t, const kvt_gc_opts *o, uint64_t *removed,
                uint64_t *removed_bytes) {
  if (!t)
    return KVT_ERR(KVT_EINVAL, "tier is NULL");
  if (o && o->version != 1)
    return KVT_ERR(KVT_EINVAL, "kvt_gc_opts version must be 1, got %u",
                   o->version);
  int rc = kvti_tier_enter(t);
  if (rc != 0)
    return rc;
  uint64_t max_bytes = (o && o->max_bytes) ? o->max_bytes : t->max_bytes;
  int64_t max_entries =
      (o && o->max_entries > 0) ? o->max_entries : t->opts.max_entries;
  double cutoff = kvti_tier_cutoff(t);
  if (o && o->older_than_seconds >= 0)
    cutoff = kvti_now_wall() - (double)o->older_than_seconds;
  uint64_t n = 0, bytes = 0;
  if (o && o->dry_run) {
    rc = gc_plan(t, max_entries, max_bytes, cutoff, &n, &bytes);
  } else if (t->readonly) {
    rc = KVT_ERR(KVT_EINVAL, "gc needs a writable tier (opened read-only)");
  } else {
    pthread_mutex_lock(&t->mut_mu);
    kvti_tier_enforce_locked(t, max_entries, max_bytes, cutoff, &n, &bytes);
    pthread_mutex_unlock(&t->mut_mu);
  }
  if (rc == 0) {
    if (removed)
      *removed = n;
    if (removed_bytes)
      *removed_bytes = bytes;
  }
  kvti_tier_leave(t);
  return rc;
}

typedef struct visit_ctx {
  kvt_entry_visit_fn fn;
  void *ctx;
  double cutoff;
} visit_ctx;

static int visit_live(void *ctx, const kvt_entry_info *info) {
  visit_ctx *v = ctx;
  if (v->cutoff > 0 && info->created_at < v->cutoff)
    return 0; /* expired: as good as gone */
  return v->fn(v->ctx, info);
}

int kvt_tier_foreach(kvt_tier *t, kvt_entry_visit_fn fn, void *ctx) {
  if (!t || !fn)
    return KVT_ERR(KVT_EINVAL, "foreach: NULL argument");
  int rc = kvti_tier_enter(t);
  if (rc != 0)
    return rc;
  visit_ctx v = {fn, ctx, kvti_tier_cutoff(t)};
  rc = kvti_index_foreach(t->idx, visit_live, &v);
  kvti_tier_leave(t);
  return rc;
}

int kvt_tier_describe(char **json, kvt_tier *t, const char *token_hash) {
  if (!json || !t || !token_hash)
    return KVT_ERR(KVT_EINVAL, "describe: NULL argument");
  if (!kvti_is_hash_name(token_hash))
    return KVT_ERR(KVT_EINVAL, "token_hash must be 64 lowercase hex digits");
  int rc = kvti_tier_enter(t);
  if (rc != 0)
    return rc;
  kvti_stripe_rdlock(&t->stripes, token_hash);
  rc = t->be->ops->describe(t->be, json, token_hash);
  kvti_stripe_unlock(&t->stripes, token_hash);
  kvti_tier_leave(t);
  return rc;
}

int kvt_tier_verify(kvt_tier *t, const char *token_hash, int repair) {
  if (!t || !token_hash)
    return KVT_ERR(KVT_EINVAL, "verify: NULL argument");
  if (!kvti_is_hash_name(token_hash))
    return KVT_ERR(KVT_EINVAL, "token_hash must be 64 lowercase hex digits");
  int rc = kvti_tier_enter(t);
  if (rc != 0)
    return rc;
  kvti_read_opts ro;
  memset(&ro, 0, sizeof ro);
  ro.verify_only = 1;
  ro.io_backend = t->opts.io_backend;
  kvt_entry_info info;
  double created = -1;
  kvti_stripe_rdlock(&t->stripes, token_hash);
  if (kvti_index_find_hash(&info, t->idx, token_hash) == 0)
    created = info.created_at;
  kvt_entry *e = NULL;
  rc = t->be->ops->get(t->be, &e, token_hash, &ro);
  kvti_stripe_unlock(&t->stripes, token_hash);
  kvt_entry_free(e);
  if (rc == KVT_ECORRUPT && repair)
    kvti_tier_quarantine(t, token_hash, created);
  kvti_tier_leave(t);
  return rc;
}
