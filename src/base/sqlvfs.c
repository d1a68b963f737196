/*
 * sqlvfs.c - the "kvtier-io" SQLite VFS (see sqlvfs.h): a shim over the VFS
 * that was SQLite's default when kvtier registered it (the unix VFS), in the
 * manner of SQLite's own shims (test_vfstrace.c, test_demovfs.c). For the
 * files that hold the index's state - the main database, its WAL and its
 * rollback journal - every byte goes through kvtier's I/O table on a
 * descriptor of our own: xRead/xWrite/xTruncate/xSync/xFileSize forward to
 * kvti_io->pread/pwrite/ftruncate/fsync/fstat, xOpen opens the descriptor with
 * kvti_io->open, xDelete is kvti_io->unlink, xAccess(EXISTS) kvti_io->lstat,
 * and the directory syncs SQLite asks for (a new WAL/journal, a deleted one)
 * are fsyncs through the table. Memory-mapped reads (xFetch) are declined so
 * that no read bypasses the table.
 *
 * What the I/O table has no equivalent for stays with the underlying VFS,
 * which also opens each of these files (on its own descriptor): POSIX
 * advisory locks (xLock/xUnlock/xCheckReservedLock), the WAL's shared-memory
 * index (xShmMap/xShmLock/xShmBarrier/xShmUnmap: an mmap of <db>-shm plus its
 * locks), file controls, sector size and device characteristics, and, at the
 * VFS level, path resolution, access checks other than existence,
 * randomness, sleeping, time and extension loading. SQLite's scratch files
 * (temporary databases, sort spills: no name, or any other file type) are not
 * the cache's state and pass through to the underlying VFS unchanged.
 *
 * The one hazard of a second descriptor: closing ANY descriptor of a file
 * drops every POSIX lock the process holds on it, including the locks the
 * underlying VFS holds for another connection to the same database (two
 * tiers on one cache directory in one process). So, like the unix VFS itself,
 * our descriptors are registered per (device, inode), and a closed file's
 * descriptor is kept open until the last file of ours on that inode closes.
 * (An application that opens index.db with its own SQLite connection, on the
 * default VFS, while kvtier has it open, is subject to the same rule as any
 * program that opens and closes a live SQLite database file: its locks can
 * drop when kvtier closes the index; see https://sqlite.org/howtocorrupt.html
 * section 2.2.)
 *
 * SQLite's and cJSON's allocators are process-global and stay outside the
 * seam (io.h).
 */
#include "base/sqlvfs.h"
#include "base/error.h"
#include "base/io.h"
#include "kvtier.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- descriptors per inode (deferred close) ---------------------------- */

typedef struct inode_ref {
  dev_t dev;
  ino_t ino;
  int files;     /* open files of ours on this inode */
  int *deferred; /* descriptors of closed files, closed with the last one */
  size_t n_deferred;
  struct inode_ref *next;
} inode_ref;

/* (The registry allocates with libc, not the seam: a close must not fail.) */
static pthread_mutex_t g_ref_mu = PTHREAD_MUTEX_INITIALIZER;
static inode_ref *g_refs;

/* Registers fd's inode; NULL on allocation failure. */
static inode_ref *ref_get(const struct stat *st) {
  pthread_mutex_lock(&g_ref_mu);
  inode_ref *r = g_refs;
  while (r && !(r->dev == st->st_dev && r->ino == st->st_ino))
    r = r->next;
  if (!r && (r = calloc(1, sizeof *r)) != NULL) {
    r->dev = st->st_dev;
    r->ino = st->st_ino;
    r->next = g_refs;
    g_refs = r;
  }
  if (r)
    r->files++;
  pthread_mutex_unlock(&g_ref_mu);
  return r;
}

/* Closes fd now if no other file of ours uses its inode, else with the last.
 */
static void ref_put(inode_ref *r, int fd) {
  int *close_now = NULL;
  size_t n_close = 0;
  pthread_mutex_lock(&g_ref_mu);
  if (--r->files > 0) {
    int *d = realloc(r->deferred, (r->n_deferred + 1) * sizeof *d);
    if (d) {
      d[r->n_deferred++] = fd;
      r->deferred = d;
      fd = -1;
    }
    /* (out of memory: closed now, the lesser evil than leaking it) */
  } else {
    inode_ref **pp = &g_refs;
    while (*pp != r)
      pp = &(*pp)->next;
    *pp = r->next;
    close_now = r->deferred;
    n_close = r->n_deferred;
    free(r);
  }
  pthread_mutex_unlock(&g_ref_mu);
  if (fd >= 0)
    kvti_io->close(fd);
  for (size_t i = 0; i < n_close; i++)
    kvti_io->close(close_now[i]);
  free(close_now);
}

/* ---- files -------------------------------------------------------------- */

typedef struct vfile {
  sqlite3_file base;  /* first: SQLite sees a sqlite3_file */
  sqlite3_file *real; /* the underlying VFS's file (locks, shm, controls) */
  int fd;             /* ours, through kvti_io; -1: pass-through file */
  int dirsync;        /* a created WAL/journal: sync its directory once */
  inode_ref *ref;
  char *dir; /* the file's directory (for dirsync) */
} vfile;

/* The underlying file lives right after ours, 8-aligned. */
#define VFILE_SIZE ((sizeof(vfile) + 7u) & ~(size_t)7u)
#define REAL(f) (((vfile *)(f))->real)

static sqlite3_vfs *g_under;

static int v_close(sqlite3_file *f) {
  vfile *v = (vfile *)f;
  int rc = v->real->pMethods ? v->real->pMethods->xClose(v->real) : SQLITE_OK;
  if (v->fd >= 0)
    ref_put(v->ref, v->fd);
  v->fd = -1;
  kvti_free(v->dir);
  v->dir = NULL;
  return rc;
}

/* SQLite's contract: a read past the end fills the rest with zeros and
 * returns SQLITE_IOERR_SHORT_READ. */
static int v_read(sqlite3_file *f, void *buf, int amt, sqlite3_int64 off) {
  vfile *v = (vfile *)f;
  if (v->fd < 0)
    return v->real->pMethods->xRead(v->real, buf, amt, off);
  char *p = buf;
  size_t n = (size_t)amt;
  while (n > 0) {
    ssize_t r = kvti_io->pread(v->fd, p, n, (off_t)off);
    if (r < 0) {
      if (errno == EINTR)
        continue;
      return SQLITE_IOERR_READ;
    }
    if (r == 0) {
      memset(p, 0, n);
      return SQLITE_IOERR_SHORT_READ;
    }
    p += r;
    n -= (size_t)r;
    off += r;
  }
  return SQLITE_OK;
}

static int v_write(sqlite3_file *f, const void *buf, int amt,
                   sqlite3_int64 off) {
  vfile *v = (vfile *)f;
  if (v->fd < 0)
    return v->real->pMethods->xWrite(v->real, buf, amt, off);
  const char *p = buf;
  size_t n = (size_t)amt;
  while (n > 0) {
    ssize_t r = kvti_io->pwrite(v->fd, p, n, (off_t)off);
    if (r < 0) {
      if (errno == EINTR)
        continue;
      return errno == ENOSPC
#ifdef EDQUOT
                     || errno == EDQUOT
#endif
                 ? SQLITE_FULL
                 : SQLITE_IOERR_WRITE;
    }
    if (r == 0)
      return SQLITE_IOERR_WRITE;
    p += r;
    n -= (size_t)r;
    off += r;
  }
  return SQLITE_OK;
}

static int v_truncate(sqlite3_file *f, sqlite3_int64 size) {
  vfile *v = (vfile *)f;
  if (v->fd < 0)
    return v->real->pMethods->xTruncate(v->real, size);
  int r;
  do {
    r = kvti_io->ftruncate(v->fd, (off_t)size);
  } while (r != 0 && errno == EINTR);
  return r == 0 ? SQLITE_OK : SQLITE_IOERR_TRUNCATE;
}

/* The directory part of a file name ("." for a bare name, "/" for one at the
 * root) into out (at least strlen(name) + 2 bytes). */
static void dir_of(char *out, const char *name) {
  const char *slash = strrchr(name, '/');
  size_t dl = slash ? (size_t)(slash - name) : 0;
  if (dl)
    memcpy(out, name, dl);
  else
    out[dl++] = slash ? '/' : '.';
  out[dl] = '\0';
}

/* fsync of a directory through the table; 0 or -1. */
static int fsync_dir(const char *dir) {
  int fd;
  do {
    fd = kvti_io->open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC, 0);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0)
    return -1;
  int r;
  do {
    r = kvti_io->fsync(fd);
  } while (r != 0 && errno == EINTR);
  kvti_io->close(fd);
  return r;
}

/* The whole file is synced (the table has no fdatasync: SQLITE_SYNC_DATAONLY
 * gets the stronger call). A WAL or journal created by this open also has its
 * directory entry synced, once, as the unix VFS does - but a failure of that
 * is reported here, where the unix VFS ignores it. */
static int v_sync(sqlite3_file *f, int flags) {
  vfile *v = (vfile *)f;
  if (v->fd < 0)
    return v->real->pMethods->xSync(v->real, flags);
  int r;
  do {
    r = kvti_io->fsync(v->fd);
  } while (r != 0 && errno == EINTR);
  if (r != 0)
    return SQLITE_IOERR_FSYNC;
  if (v->dirsync && v->dir) {
    if (fsync_dir(v->dir) != 0)
      return SQLITE_IOERR_DIR_FSYNC;
    v->dirsync = 0;
  }
  return SQLITE_OK;
}

static int v_size(sqlite3_file *f, sqlite3_int64 *size) {
  vfile *v = (vfile *)f;
  if (v->fd < 0)
    return v->real->pMethods->xFileSize(v->real, size);
  struct stat st;
  if (kvti_io->fstat(v->fd, &st) != 0)
    return SQLITE_IOERR_FSTAT;
  *size = (sqlite3_int64)st.st_size;
  return SQLITE_OK;
}

static int v_lock(sqlite3_file *f, int l) {
  return REAL(f)->pMethods->xLock(REAL(f), l);
}
static int v_unlock(sqlite3_file *f, int l) {
  return REAL(f)->pMethods->xUnlock(REAL(f), l);
}
static int v_check(sqlite3_file *f, int *out) {
  return REAL(f)->pMethods->xCheckReservedLock(REAL(f), out);
}

/* File controls go to the underlying file, except the two that would make it
 * touch the file's bytes on its own descriptor: a size hint (a preallocation,
 * only a hint: ignored) and the mmap size (memory-mapped I/O stays off, so
 * every read goes through the table). */
static int v_fcntl(sqlite3_file *f, int op, void *arg) {
  vfile *v = (vfile *)f;
  if (v->fd >= 0 && op == SQLITE_FCNTL_SIZE_HINT)
    return SQLITE_OK;
  if (v->fd >= 0 && op == SQLITE_FCNTL_MMAP_SIZE) {
    if (arg)
      *(sqlite3_int64 *)arg = 0;
    return SQLITE_OK;
  }
  return v->real->pMethods->xFileControl(v->real, op, arg);
}
static int v_sector(sqlite3_file *f) {
  return REAL(f)->pMethods->xSectorSize(REAL(f));
}
static int v_devchar(sqlite3_file *f) {
  return REAL(f)->pMethods->xDeviceCharacteristics(REAL(f));
}
static int v_shmmap(sqlite3_file *f, int i, int sz, int extend,
                    void volatile **pp) {
  return REAL(f)->pMethods->xShmMap(REAL(f), i, sz, extend, pp);
}
static int v_shmlock(sqlite3_file *f, int off, int n, int flags) {
  return REAL(f)->pMethods->xShmLock(REAL(f), off, n, flags);
}
static void v_shmbarrier(sqlite3_file *f) {
  REAL(f)->pMethods->xShmBarrier(REAL(f));
}
static int v_shmunmap(sqlite3_file *f, int del) {
  return REAL(f)->pMethods->xShmUnmap(REAL(f), del);
}
/* Declined: SQLite then reads the page with xRead. */
static int v_fetch(sqlite3_file *f, sqlite3_int64 off, int n, void **pp) {
  vfile *v = (vfile *)f;
  if (v->fd < 0 && v->real->pMethods->iVersion >= 3)
    return v->real->pMethods->xFetch(v->real, off, n, pp);
  *pp = NULL;
  return SQLITE_OK;
}
static int v_unfetch(sqlite3_file *f, sqlite3_int64 off, void *p) {
  vfile *v = (vfile *)f;
  if (v->fd < 0 && v->real->pMethods->iVersion >= 3)
    return v->real->pMethods->xUnfetch(v->real, off, p);
  return SQLITE_OK;
}

static const sqlite3_io_methods g_methods = {
    3,         v_close,  v_read,    v_write,      v_truncate, v_sync,
    v_size,    v_lock,   v_unlock,  v_check,      v_fcntl,    v_sector,
    v_devchar, v_shmmap, v_shmlock, v_shmbarrier, v_shmunmap, v_fetch,
    v_unfetch};

/* The underlying VFS opens (and creates, with its permission rules and its
 * read-only fallback) the file first; then ours opens the same path for the
 * data, read-only if the underlying one had to be. */
/* 1 when name (with suffix appended) is a symbolic link. */
static int is_link(const char *name, const char *suffix) {
  char p[4200];
  if (snprintf(p, sizeof p, "%s%s", name, suffix) >= (int)sizeof p)
    return 0;
  struct stat st;
  return kvti_io->lstat(p, &st) == 0 && S_ISLNK(st.st_mode);
}

static int v_open(sqlite3_vfs *vfs, const char *name, sqlite3_file *f,
                  int flags, int *out_flags) {
  (void)vfs;
  vfile *v = (vfile *)f;
  memset(v, 0, sizeof *v);
  v->fd = -1;
  v->real = (sqlite3_file *)((char *)f + VFILE_SIZE);
  const int state =
      SQLITE_OPEN_MAIN_DB | SQLITE_OPEN_WAL | SQLITE_OPEN_MAIN_JOURNAL;
  /* The underlying VFS opens (and creates) by path, following a link: a
   * link at one of the index's files - the main database, its WAL or
   * journal, or the -shm the underlying VFS maps and writes - is refused
   * before it looks, so nothing outside the cache is created or written. */
  if (name && (flags & state) &&
      (is_link(name, "") || ((flags & SQLITE_OPEN_MAIN_DB) &&
                             (is_link(name, "-wal") || is_link(name, "-shm") ||
                              is_link(name, "-journal"))))) {
    v->base.pMethods = NULL;
    return SQLITE_CANTOPEN;
  }
  int oflags = 0;
  int rc = g_under->xOpen(g_under, name, v->real, flags, &oflags);
  if (rc != SQLITE_OK || !v->real->pMethods) {
    v->base.pMethods = NULL;
    return rc != SQLITE_OK ? rc : SQLITE_CANTOPEN;
  }
  const int ours =
      SQLITE_OPEN_MAIN_DB | SQLITE_OPEN_WAL | SQLITE_OPEN_MAIN_JOURNAL;
  if (name && (flags & ours)) {
    int ro = (oflags & SQLITE_OPEN_READONLY) != 0;
    int fd;
    do {
      fd = kvti_io->open(name,
                         (ro ? O_RDONLY : O_RDWR) | O_NOFOLLOW | O_CLOEXEC, 0);
    } while (fd < 0 && errno == EINTR);
    struct stat st;
    if (fd >= 0 && kvti_io->fstat(fd, &st) == 0 &&
        (v->ref = ref_get(&st)) != NULL) {
      v->fd = fd;
    } else {
      if (fd >= 0)
        kvti_io->close(fd);
      v->real->pMethods->xClose(v->real);
      v->base.pMethods = NULL;
      return SQLITE_CANTOPEN;
    }
    if ((flags & SQLITE_OPEN_CREATE) &&
        (flags & (SQLITE_OPEN_WAL | SQLITE_OPEN_MAIN_JOURNAL))) {
      v->dir = kvti_malloc(strlen(name) + 2);
      if (!v->dir) {
        ref_put(v->ref, v->fd);
        v->fd = -1;
        v->real->pMethods->xClose(v->real);
        v->base.pMethods = NULL;
        return SQLITE_NOMEM;
      }
      dir_of(v->dir, name);
      v->dirsync = 1;
    }
  }
  v->base.pMethods = &g_methods;
  if (out_flags)
    *out_flags = oflags;
  return SQLITE_OK;
}

static int v_delete(sqlite3_vfs *vfs, const char *name, int sync_dir) {
  (void)vfs;
  if (kvti_io->unlink(name) != 0)
    return errno == ENOENT ? SQLITE_IOERR_DELETE_NOENT : SQLITE_IOERR_DELETE;
  if (sync_dir) {
    char dir[4096];
    if (strlen(name) + 2 > sizeof dir)
      return SQLITE_IOERR_DIR_FSYNC;
    dir_of(dir, name);
    if (fsync_dir(dir) != 0)
      return SQLITE_IOERR_DIR_FSYNC;
  }
  return SQLITE_OK;
}

/* EXISTS as the unix VFS answers it (a regular file counts only when it is not
 * empty), through the table's lstat; a failure other than "no such file" is an
 * I/O error rather than "absent". READ/READWRITE need access(2): underlying. */
static int v_access(sqlite3_vfs *vfs, const char *name, int what, int *out) {
  (void)vfs;
  if (what != SQLITE_ACCESS_EXISTS)
    return g_under->xAccess(g_under, name, what, out);
  struct stat st;
  if (kvti_io->lstat(name, &st) != 0) {
    *out = 0;
    return errno == ENOENT || errno == ENOTDIR ? SQLITE_OK
                                               : SQLITE_IOERR_ACCESS;
  }
  *out = !S_ISREG(st.st_mode) || st.st_size > 0;
  return SQLITE_OK;
}

static int v_fullpath(sqlite3_vfs *vfs, const char *name, int n, char *out) {
  (void)vfs;
  return g_under->xFullPathname(g_under, name, n, out);
}
static void *v_dlopen(sqlite3_vfs *vfs, const char *path) {
  (void)vfs;
  return g_under->xDlOpen(g_under, path);
}
static void v_dlerror(sqlite3_vfs *vfs, int n, char *msg) {
  (void)vfs;
  g_under->xDlError(g_under, n, msg);
}
static void (*v_dlsym(sqlite3_vfs *vfs, void *h, const char *sym))(void) {
  (void)vfs;
  return g_under->xDlSym(g_under, h, sym);
}
static void v_dlclose(sqlite3_vfs *vfs, void *h) {
  (void)vfs;
  g_under->xDlClose(g_under, h);
}
static int v_random(sqlite3_vfs *vfs, int n, char *out) {
  (void)vfs;
  return g_under->xRandomness(g_under, n, out);
}
static int v_sleep(sqlite3_vfs *vfs, int us) {
  (void)vfs;
  return g_under->xSleep(g_under, us);
}
static int v_time(sqlite3_vfs *vfs, double *t) {
  (void)vfs;
  return g_under->xCurrentTime(g_under, t);
}
static int v_lasterr(sqlite3_vfs *vfs, int n, char *msg) {
  (void)vfs;
  return g_under->xGetLastError ? g_under->xGetLastError(g_under, n, msg) : 0;
}
static int v_time64(sqlite3_vfs *vfs, sqlite3_int64 *t) {
  (void)vfs;
  if (g_under->iVersion >= 2 && g_under->xCurrentTimeInt64)
    return g_under->xCurrentTimeInt64(g_under, t);
  double d = 0;
  int rc = g_under->xCurrentTime(g_under, &d);
  *t = (sqlite3_int64)(d * 86400000.0);
  return rc;
}

static sqlite3_vfs g_vfs;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static int g_reg_rc = SQLITE_ERROR;

static void do_register(void) {
  /* The default at this moment: the unix VFS, or a shim an application (or a
   * test) installed over it before kvtier first opened an index. */
  g_under = sqlite3_vfs_find(NULL);
  if (!g_under)
    return;
  g_vfs.iVersion = 2;
  g_vfs.szOsFile = (int)VFILE_SIZE + g_under->szOsFile;
  g_vfs.mxPathname = g_under->mxPathname;
  g_vfs.zName = KVTI_SQLVFS_NAME;
  g_vfs.xOpen = v_open;
  g_vfs.xDelete = v_delete;
  g_vfs.xAccess = v_access;
  g_vfs.xFullPathname = v_fullpath;
  g_vfs.xDlOpen = v_dlopen;
  g_vfs.xDlError = v_dlerror;
  g_vfs.xDlSym = v_dlsym;
  g_vfs.xDlClose = v_dlclose;
  g_vfs.xRandomness = v_random;
  g_vfs.xSleep = v_sleep;
  g_vfs.xCurrentTime = v_time;
  g_vfs.xGetLastError = v_lasterr;
  g_vfs.xCurrentTimeInt64 = v_time64;
  g_reg_rc = sqlite3_vfs_register(&g_vfs, 0);
}

const char *kvti_sqlvfs_name(void) {
  pthread_once(&g_once, do_register);
  if (g_reg_rc != SQLITE_OK) {
    KVT_ERR(KVT_EDB, "index.db: cannot register the %s SQLite VFS (SQLite %d)",
            KVTI_SQLVFS_NAME, g_reg_rc);
    return NULL;
  }
  return KVTI_SQLVFS_NAME;
}
