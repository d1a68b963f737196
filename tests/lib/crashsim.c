/*
 * crashsim.c - the power-loss simulator of the reliability tests (crashsim.h),
 * after SQLite's test6.c: a recording I/O table logs every mutation (mkdir,
 * file creation, pwrite, ftruncate, fsync of files and directories, rename,
 * rename-exchange, unlink, rmdir, and the same made relative to a directory
 * descriptor: openat, renameat, unlinkat, mkdirat, each logged under the
 * path its descriptor names) a write makes under a live directory; for a
 * crash point K the state a power loss after the first K operations could
 * leave is rebuilt in a replay directory from a copy of the state before the
 * write: a write to a file is durable only if that file was fsynced after it,
 * a name created/renamed/removed in a directory only if that directory was
 * fsynced after it; the non-durable file writes are each kept, dropped or
 * garbled, and of the non-durable namespace changes of each directory a
 * random prefix survives (journaled file systems keep a directory's order).
 * Shared by test_crashsim_entry.c (entry publication) and
 * test_crashsim_chunks.c (chunk files, chains and chain records).
 */
#include "crashsim.h"
#include "rel_common.h"

#include <fcntl.h>

enum {
  OP_MKDIR,
  OP_CREATE,
  OP_WRITE,
  OP_TRUNC,
  OP_FSYNC,
  OP_RENAME,
  OP_EXCH,
  OP_UNLINK,
  OP_RMDIR
};

typedef struct sim_op {
  int kind;
  char *a, *b;  /* paths (b: rename target) */
  uint64_t off; /* write offset / truncate length */
  size_t n;
  unsigned char *data;
} sim_op;

static sim_op *g_log;
size_t g_nlog;
static size_t g_caplog;
static char *g_fdpath[4096]; /* path each open fd was opened with */
int g_fsync_files = 1;       /* 0: the wrong-order variant drops file fsyncs */
static kvti_io_ops g_rec;

int (*g_cs_skip)(const char *path);
void (*g_cs_on_fsync)(const char *path, size_t op);
void (*g_cs_on_write)(const char *path, uint64_t off, const void *data,
                      size_t n, size_t op);

static void log_op(int kind, const char *a, const char *b, uint64_t off,
                   const void *d, size_t n) {
  if (g_cs_skip && g_cs_skip(a)) {
    if (kind == OP_FSYNC && g_cs_on_fsync)
      g_cs_on_fsync(a, g_nlog); /* durable from this point of the log on */
    if (kind == OP_WRITE && g_cs_on_write)
      g_cs_on_write(a, off, d, n, g_nlog);
    return;
  }
  if (g_nlog == g_caplog) {
    g_caplog = g_caplog ? 2 * g_caplog : 256;
    g_log = realloc(g_log, g_caplog * sizeof *g_log);
  }
  sim_op *o = &g_log[g_nlog++];
  memset(o, 0, sizeof *o);
  o->kind = kind;
  o->a = a ? strdup(a) : NULL;
  o->b = b ? strdup(b) : NULL;
  o->off = off;
  o->n = n;
  if (d && n) {
    o->data = malloc(n);
    memcpy(o->data, d, n);
  }
}

void log_clear(void) {
  for (size_t i = 0; i < g_nlog; i++) {
    free(g_log[i].a);
    free(g_log[i].b);
    free(g_log[i].data);
  }
  g_nlog = 0;
}

static int r_open(const char *p, int f, mode_t m) {
  struct stat st;
  int existed = lstat(p, &st) == 0;
  int fd = kvti_io_default.open(p, f, m);
  if (fd >= 0 && fd < 4096) {
    free(g_fdpath[fd]);
    g_fdpath[fd] = strdup(p);
    if ((f & O_CREAT) && !existed)
      log_op(OP_CREATE, p, NULL, 0, NULL, 0);
    else if ((f & O_TRUNC) && existed)
      log_op(OP_TRUNC, p, NULL, 0, NULL, 0);
  }
  return fd;
}
/* The path name names relative to directory descriptor dirfd: the path
 * dirfd was opened with (recorded by r_open / r_openat), or on Linux what
 * /proc says of a descriptor opened before the recorder was installed. 0 or
 * -1 (unknown: the operation is not logged). */
static int at_path(char *out, size_t cap, int dirfd, const char *name) {
  if (dirfd == AT_FDCWD || name[0] == '/') {
    snprintf(out, cap, "%s", name);
    return 0;
  }
  char dir[4096];
  if (dirfd >= 0 && dirfd < 4096 && g_fdpath[dirfd]) {
    snprintf(dir, sizeof dir, "%s", g_fdpath[dirfd]);
  } else {
#if defined(__linux__)
    char link[64];
    snprintf(link, sizeof link, "/proc/self/fd/%d", dirfd);
    ssize_t n = readlink(link, dir, sizeof dir - 1);
    if (n <= 0)
      return -1;
    dir[n] = '\0';
#else
    return -1;
#endif
  }
  if (!strcmp(name, "."))
    snprintf(out, cap, "%s", dir);
  else
    snprintf(out, cap, "%s/%s", dir, name);
  return 0;
}
static int r_openat(int dirfd, const char *name, int f, mode_t m) {
  char p[4200];
  int known = at_path(p, sizeof p, dirfd, name) == 0;
  struct stat st;
  int existed = fstatat(dirfd, name, &st, AT_SYMLINK_NOFOLLOW) == 0;
  int fd = kvti_io_default.openat(dirfd, name, f, m);
  if (fd >= 0 && fd < 4096) {
    free(g_fdpath[fd]);
    g_fdpath[fd] = known ? strdup(p) : NULL;
    if (known && (f & O_CREAT) && !existed)
      log_op(OP_CREATE, p, NULL, 0, NULL, 0);
    else if (known && (f & O_TRUNC) && existed)
      log_op(OP_TRUNC, p, NULL, 0, NULL, 0);
  }
  return fd;
}
static int r_renameat(int fd1, const char *a, int fd2, const char *b) {
  char pa[4200], pb[4200];
  int known = at_path(pa, sizeof pa, fd1, a) == 0 &&
              at_path(pb, sizeof pb, fd2, b) == 0;
  int r = kvti_io_default.renameat(fd1, a, fd2, b);
  if (r == 0 && known)
    log_op(OP_RENAME, pa, pb, 0, NULL, 0);
  return r;
}
static int r_unlinkat(int dirfd, const char *name, int flags) {
  char p[4200];
  int known = at_path(p, sizeof p, dirfd, name) == 0;
  int r = kvti_io_default.unlinkat(dirfd, name, flags);
  if (r == 0 && known)
    log_op((flags & AT_REMOVEDIR) ? OP_RMDIR : OP_UNLINK, p, NULL, 0, NULL, 0);
  return r;
}
static int r_mkdirat(int dirfd, const char *name, mode_t m) {
  char p[4200];
  int known = at_path(p, sizeof p, dirfd, name) == 0;
  int r = kvti_io_default.mkdirat(dirfd, name, m);
  if (r == 0 && known)
    log_op(OP_MKDIR, p, NULL, 0, NULL, 0);
  return r;
}
static int r_close(int fd) {
  if (fd >= 0 && fd < 4096) {
    free(g_fdpath[fd]);
    g_fdpath[fd] = NULL;
  }
  return kvti_io_default.close(fd);
}
static ssize_t r_pwrite(int fd, const void *b, size_t n, off_t o) {
  ssize_t r = kvti_io_default.pwrite(fd, b, n, o);
  if (r > 0 && fd < 4096 && g_fdpath[fd])
    log_op(OP_WRITE, g_fdpath[fd], NULL, (uint64_t)o, b, (size_t)r);
  return r;
}
static int r_ftruncate(int fd, off_t l) {
  int r = kvti_io_default.ftruncate(fd, l);
  if (r == 0 && fd < 4096 && g_fdpath[fd])
    log_op(OP_TRUNC, g_fdpath[fd], NULL, (uint64_t)l, NULL, 0);
  return r;
}
static int r_fsync(int fd) {
  struct stat st;
  if (!g_fsync_files && fstat(fd, &st) == 0 && S_ISREG(st.st_mode))
    return 0; /* the wrong-order variant: a file fsync that does nothing */
  int r = kvti_io_default.fsync(fd);
  if (r == 0 && fd < 4096 && g_fdpath[fd])
    log_op(OP_FSYNC, g_fdpath[fd], NULL, 0, NULL, 0);
  return r;
}
static int r_rename(const char *a, const char *b) {
  int r = kvti_io_default.rename(a, b);
  if (r == 0)
    log_op(OP_RENAME, a, b, 0, NULL, 0);
  return r;
}
int g_exch_ok = 1;
static int r_exch(const char *a, const char *b) {
  if (!g_exch_ok) {
    errno = ENOTSUP;
    return -1;
  }
  int r = kvti_io_default.rename_exchange(a, b);
  if (r == 0)
    log_op(OP_EXCH, a, b, 0, NULL, 0);
  return r;
}
static int r_mkdir(const char *p, mode_t m) {
  int r = kvti_io_default.mkdir(p, m);
  if (r == 0)
    log_op(OP_MKDIR, p, NULL, 0, NULL, 0);
  return r;
}
static int r_unlink(const char *p) {
  int r = kvti_io_default.unlink(p);
  if (r == 0)
    log_op(OP_UNLINK, p, NULL, 0, NULL, 0);
  return r;
}
static int r_rmdir(const char *p) {
  int r = kvti_io_default.rmdir(p);
  if (r == 0)
    log_op(OP_RMDIR, p, NULL, 0, NULL, 0);
  return r;
}

void rec_install(void) {
  g_rec = kvti_io_default;
  g_rec.open = r_open;
  g_rec.close = r_close;
  g_rec.pwrite = r_pwrite;
  g_rec.ftruncate = r_ftruncate;
  g_rec.fsync = r_fsync;
  g_rec.rename = r_rename;
  g_rec.rename_exchange = r_exch;
  g_rec.mkdir = r_mkdir;
  g_rec.unlink = r_unlink;
  g_rec.rmdir = r_rmdir;
  g_rec.openat = r_openat;
  g_rec.renameat = r_renameat;
  g_rec.unlinkat = r_unlinkat;
  g_rec.mkdirat = r_mkdirat;
  kvti_io_set(&g_rec);
}

/* ---- replay ----------------------------------------------------------- */

char g_base[4096], g_live[4096], g_replay[4096];

static void parent_of(char *out, size_t cap, const char *p) {
  snprintf(out, cap, "%s", p);
  char *s = strrchr(out, '/');
  if (s)
    *s = '\0';
}

/* Maps a logged path under g_live to the same path under g_replay. */
static void remap(char *out, size_t cap, const char *p) {
  size_t l = strlen(g_live);
  if (strncmp(p, g_live, l) == 0)
    snprintf(out, cap, "%s%s", g_replay, p + l);
  else
    snprintf(out, cap, "%s",
             p); /* never happens: all entry I/O is under data/ */
}

static int is_ns(int k) {
  return k == OP_MKDIR || k == OP_CREATE || k == OP_RENAME || k == OP_EXCH ||
         k == OP_UNLINK || k == OP_RMDIR;
}

/* Rebuilds in g_replay the state a power loss after the first K logged
 * operations may leave.
 */
void replay(size_t K, kvt_rng *rng) {
  kvt_test_rmtree(g_replay);
  r_copy_tree(g_base, g_replay);
  char *durable = calloc(K + 1, 1), *apply = calloc(K + 1, 1);
  for (size_t i = 0; i < K; i++) {
    sim_op *o = &g_log[i];
    char dir[4200];
    if (is_ns(o->kind))
      parent_of(dir, sizeof dir, o->a);
    for (size_t j = i + 1; j < K && !durable[i]; j++) {
      if (g_log[j].kind != OP_FSYNC)
        continue;
      if (is_ns(o->kind) ? !strcmp(g_log[j].a, dir) : !strcmp(g_log[j].a, o->a))
        durable[i] = 1;
    }
    if (o->kind == OP_FSYNC)
      durable[i] = 1;
  }
  /* Non-durable namespace ops: of each directory's, a random prefix survives
   * (0..all, drawn uniformly). Directories are told apart by name. */
  char *dirs[64];
  long cut[64], cnt[64];
  int nd = 0;
  for (int pass = 0; pass < 2; pass++) {
    for (size_t i = 0; i < K; i++) {
      sim_op *o = &g_log[i];
      if (durable[i] || !is_ns(o->kind)) {
        apply[i] = 1; /* durable, or a data write (fate decided at replay) */
        continue;
      }
      char dir[4200];
      parent_of(dir, sizeof dir, o->a);
      int d = 0;
      while (d < nd && strcmp(dirs[d], dir))
        d++;
      if (d == nd) {
        if (nd == 64)
          continue;
        dirs[nd] = strdup(dir);
        cnt[nd] = 0;
        nd++;
      }
      if (pass == 0) {
        cnt[d]++;
      } else if (cut[d] > 0) {
        apply[i] = 1;
        cut[d]--;
      }
    }
    if (pass == 0)
      for (int d = 0; d < nd; d++)
        cut[d] = (long)(kvt_rng_next(rng) % (uint64_t)(cnt[d] + 1));
  }
  for (int d = 0; d < nd; d++)
    free(dirs[d]);
  for (size_t i = 0; i < K; i++) {
    if (!apply[i])
      continue;
    sim_op *o = &g_log[i];
    char a[4200], b[4200];
    remap(a, sizeof a, o->a);
    if (o->b)
      remap(b, sizeof b, o->b);
    switch (o->kind) {
    case OP_MKDIR:
      mkdir(a, 0700);
      break;
    case OP_CREATE: {
      int fd = open(a, O_WRONLY | O_CREAT | O_EXCL, 0600);
      if (fd >= 0)
        close(fd);
      break;
    }
    case OP_TRUNC:
      if (truncate(a, (off_t)o->off) != 0) {
      }
      break;
    case OP_WRITE: {
      int fate =
          durable[i]
              ? 0
              : (int)(kvt_rng_next(rng) % 4); /* 0,1 keep 2 drop 3 garble */
      if (fate == 2)
        break;
      int fd = open(a, O_WRONLY);
      if (fd < 0)
        break;
      unsigned char *d = o->data;
      unsigned char *g = NULL;
      if (fate == 3) {
        g = malloc(o->n);
        kvt_rng_fill(rng, g, o->n);
        d = g;
      }
      if (pwrite(fd, d, o->n, (off_t)o->off) < 0) {
      }
      free(g);
      close(fd);
      break;
    }
    case OP_RENAME:
      rename(a, b);
      break;
    case OP_EXCH:
      kvti_io_default.rename_exchange(a, b);
      break;
    case OP_UNLINK:
      unlink(a);
      break;
    case OP_RMDIR:
      rmdir(a);
      break;
    default:
      break;
    }
  }
  free(durable);
  free(apply);
}

void crashsim_free(void) {
  log_clear();
  free(g_log);
  g_log = NULL;
  g_caplog = 0;
  for (int i = 0; i < 4096; i++) {
    free(g_fdpath[i]);
    g_fdpath[i] = NULL;
  }
}
