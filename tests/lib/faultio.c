/*
 * faultio.c - implementation of the fault-injecting I/O table (see faultio.h).
 * Every wrapper bumps its operation's counter, asks should_fail() whether this
 * call is the armed one, and otherwise forwards to kvti_io_default. Short
 * transfers forward a shortened request, so the bytes that were transferred are
 * real; preadv (where the platform has it) is failed and shortened as a
 * pread is. The io_uring completion filter is wrapped only to count read bytes
 * (faults are injected at the pread/pwrite hooks, which io_uring bypasses).
 */
#include "faultio.h"
#include "base/io.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

static kvti_io_ops g_ops;
static atomic_uint_fast64_t g_count[FIO_NOPS];
static atomic_int g_op = -1;
static atomic_uint_fast64_t g_nth;
static atomic_int g_kind, g_err, g_sticky;
static atomic_uint_fast64_t g_fired, g_total;
static atomic_uint_fast64_t g_read_bytes;
/* The pwrite stall: g_stall holds writers, g_stalled says one is held. */
static atomic_int g_stall, g_stalled;
static pthread_mutex_t g_stall_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_stall_cv = PTHREAD_COND_INITIALIZER;

static const char *const g_names[FIO_NOPS] = {
    "open",  "close",   "pread",   "pwrite",   "fsync",           "ftruncate",
    "fstat", "lstat",   "rename",  "mkdir",    "rmdir",           "unlink",
    "chmod", "opendir", "readdir", "closedir", "rename_exchange", "alloc"};

const char *fio_op_name(fio_op op) {
  return op >= 0 && op < FIO_NOPS ? g_names[op] : "?";
}

/* The target filter (fio_target): while set, an armed fault fires only on
 * calls about files whose path contains g_target - path calls by their path,
 * descriptor calls by the path the descriptor was opened with. */
#define FIO_MAX_FD 65536
static char g_target[512];
static atomic_int g_has_target;
static atomic_uchar g_fd_target[FIO_MAX_FD];
static atomic_uint_fast64_t g_tcount[FIO_NOPS];

static int path_is_target(const char *p) {
  return atomic_load(&g_has_target) && p && strstr(p, g_target) != NULL;
}
static int fd_is_target(int fd) {
  return fd >= 0 && fd < FIO_MAX_FD && atomic_load(&g_fd_target[fd]);
}

/* Returns the fault kind + 1 for a call that must fail (errno set for errno
 * faults), else 0. target: the call is about a target file. */
static int should_fail_t(fio_op op, int target) {
  uint64_t k = atomic_fetch_add(&g_count[op], 1) + 1;
  if (target)
    k = atomic_fetch_add(&g_tcount[op], 1) + 1;
  if (atomic_load(&g_op) != (int)op)
    return 0;
  if (atomic_load(&g_has_target) && !target)
    return 0;
  uint64_t nth = atomic_load(&g_nth);
  if (k == nth || (k > nth && atomic_load(&g_sticky))) {
    atomic_fetch_add(&g_fired, 1);
    atomic_fetch_add(&g_total, 1);
    int kind = atomic_load(&g_kind);
    if (kind == FIO_FAIL_ERRNO)
      errno = atomic_load(&g_err);
    return kind + 1;
  }
  return 0;
}
#define should_fail(op) should_fail_t(op, 0)
#define FAIL_ERRNO(op) (should_fail(op) == FIO_FAIL_ERRNO + 1)
#define FAIL_FD(op, fd)                                                        \
  (should_fail_t(op, fd_is_target(fd)) == FIO_FAIL_ERRNO + 1)
#define FAIL_PATH(op, p)                                                       \
  (should_fail_t(op, path_is_target(p)) == FIO_FAIL_ERRNO + 1)

static int w_open(const char *p, int f, mode_t m) {
  if (FAIL_PATH(FIO_OPEN, p))
    return -1;
  int fd = kvti_io_default.open(p, f, m);
  if (fd >= 0 && fd < FIO_MAX_FD)
    atomic_store(&g_fd_target[fd], (unsigned char)path_is_target(p));
  return fd;
}
static int w_close(int fd) {
  int target = fd_is_target(fd);
  if (fd >= 0 && fd < FIO_MAX_FD)
    atomic_store(&g_fd_target[fd], 0);
  if (should_fail_t(FIO_CLOSE, target) == FIO_FAIL_ERRNO + 1) {
    /* A failed close still releases the descriptor on Linux: do that, or the fd
     * leaks. */
    int e = errno;
    kvti_io_default.close(fd);
    errno = e;
    return -1;
  }
  return kvti_io_default.close(fd);
}
static ssize_t w_pread(int fd, void *b, size_t n, off_t o) {
  int f = should_fail_t(FIO_PREAD, fd_is_target(fd));
  if (f == FIO_FAIL_ERRNO + 1)
    return -1;
  if (f == FIO_FAIL_SHORT + 1 && n > 1)
    n /= 2;
  ssize_t r = kvti_io_default.pread(fd, b, n, o);
  if (r > 0)
    atomic_fetch_add(&g_read_bytes, (uint64_t)r);
  return r;
}
/* preadv counts and fails as a pread (FIO_PREAD); a short one reads at most
 * half of the segments' bytes. */
static ssize_t w_preadv(int fd, const struct iovec *iov, int cnt, off_t o) {
  int f = should_fail_t(FIO_PREAD, fd_is_target(fd));
  if (f == FIO_FAIL_ERRNO + 1)
    return -1;
  struct iovec v[1024];
  if (cnt > 1024)
    cnt = 1024;
  size_t total = 0;
  for (int i = 0; i < cnt; i++) {
    v[i] = iov[i];
    total += iov[i].iov_len;
  }
  if (f == FIO_FAIL_SHORT + 1 && total > 1) {
    size_t left = total / 2;
    int n = 0;
    for (; n < cnt && left > 0; n++) {
      if (v[n].iov_len > left)
        v[n].iov_len = left;
      left -= v[n].iov_len;
    }
    cnt = n;
  }
  ssize_t r = kvti_io_default.preadv(fd, v, cnt, o);
  if (r > 0)
    atomic_fetch_add(&g_read_bytes, (uint64_t)r);
  return r;
}
static int w_uring_result(int is_write, int fd, uint64_t off, size_t len,
                          int res) {
  res = kvti_io_default.uring_result(is_write, fd, off, len, res);
  if (!is_write && res > 0)
    atomic_fetch_add(&g_read_bytes, (uint64_t)res);
  return res;
}
static void stall_if_set(void) {
  if (!atomic_load(&g_stall))
    return;
  pthread_mutex_lock(&g_stall_mu);
  atomic_store(&g_stalled, 1);
  pthread_cond_broadcast(&g_stall_cv);
  while (atomic_load(&g_stall))
    pthread_cond_wait(&g_stall_cv, &g_stall_mu);
  atomic_store(&g_stalled, 0);
  pthread_mutex_unlock(&g_stall_mu);
}
static ssize_t w_pwrite(int fd, const void *b, size_t n, off_t o) {
  stall_if_set();
  int f = should_fail_t(FIO_PWRITE, fd_is_target(fd));
  if (f == FIO_FAIL_ERRNO + 1)
    return -1;
  if (f == FIO_FAIL_SHORT + 1 && n > 1)
    n /= 2;
  return kvti_io_default.pwrite(fd, b, n, o);
}
static int w_fsync(int fd) {
  return FAIL_FD(FIO_FSYNC, fd) ? -1 : kvti_io_default.fsync(fd);
}
static int w_ftruncate(int fd, off_t l) {
  return FAIL_FD(FIO_FTRUNCATE, fd) ? -1 : kvti_io_default.ftruncate(fd, l);
}
static int w_fstat(int fd, struct stat *st) {
  return FAIL_FD(FIO_FSTAT, fd) ? -1 : kvti_io_default.fstat(fd, st);
}
static int w_lstat(const char *p, struct stat *st) {
  return FAIL_PATH(FIO_LSTAT, p) ? -1 : kvti_io_default.lstat(p, st);
}
static int w_rename(const char *a, const char *b) {
  return FAIL_PATH(FIO_RENAME, a) ? -1 : kvti_io_default.rename(a, b);
}
static int w_mkdir(const char *p, mode_t m) {
  return FAIL_PATH(FIO_MKDIR, p) ? -1 : kvti_io_default.mkdir(p, m);
}
static int w_rmdir(const char *p) {
  return FAIL_PATH(FIO_RMDIR, p) ? -1 : kvti_io_default.rmdir(p);
}
static int w_unlink(const char *p) {
  return FAIL_PATH(FIO_UNLINK, p) ? -1 : kvti_io_default.unlink(p);
}
static int w_chmod(const char *p, mode_t m) {
  return FAIL_PATH(FIO_CHMOD, p) ? -1 : kvti_io_default.chmod(p, m);
}
static DIR *w_opendir(const char *p) {
  return FAIL_PATH(FIO_OPENDIR, p) ? NULL : kvti_io_default.opendir(p);
}
static struct dirent *w_readdir(DIR *d) {
  return FAIL_ERRNO(FIO_READDIR) ? NULL : kvti_io_default.readdir(d);
}
static int w_closedir(DIR *d) {
  if (FAIL_ERRNO(FIO_CLOSEDIR)) {
    int e = errno;
    kvti_io_default.closedir(d);
    errno = e;
    return -1;
  }
  return kvti_io_default.closedir(d);
}
static atomic_int g_noexch;
void fio_set_no_exchange(int on) {
  atomic_store(&g_noexch, on);
}

static int w_rename_exchange(const char *a, const char *b) {
  if (atomic_load(&g_noexch)) {
    errno = ENOTSUP;
    return -1;
  }
  if (FAIL_PATH(FIO_RENAME_EXCHANGE, a))
    return -1;
  if (!kvti_io_default.rename_exchange) {
    errno = ENOTSUP;
    return -1;
  }
  return kvti_io_default.rename_exchange(a, b);
}
/* The calls relative to a directory descriptor count as their path
 * counterparts (openat as open, unlinkat as unlink or rmdir, fstatat as
 * lstat, renameat as rename, mkdirat as mkdir, fdopendir as opendir, fchmod
 * as chmod), so every loop over an operation covers both forms. A call is
 * about a target file when its name contains the target or its directory
 * descriptor was opened from a target (everything below a target directory
 * is a target, as every path below it contains the substring). */
static int at_is_target(int dirfd, const char *name) {
  return fd_is_target(dirfd) || path_is_target(name);
}
static int w_openat(int d, const char *name, int f, mode_t m) {
  int target = at_is_target(d, name);
  if (should_fail_t(FIO_OPEN, target) == FIO_FAIL_ERRNO + 1)
    return -1;
  int fd = kvti_io_default.openat(d, name, f, m);
  if (fd >= 0 && fd < FIO_MAX_FD)
    atomic_store(&g_fd_target[fd], (unsigned char)target);
  return fd;
}
static int w_unlinkat(int d, const char *name, int flags) {
  fio_op op = (flags & AT_REMOVEDIR) ? FIO_RMDIR : FIO_UNLINK;
  if (should_fail_t(op, at_is_target(d, name)) == FIO_FAIL_ERRNO + 1)
    return -1;
  return kvti_io_default.unlinkat(d, name, flags);
}
static int w_fstatat(int d, const char *name, struct stat *st, int flags) {
  if (should_fail_t(FIO_LSTAT, at_is_target(d, name)) == FIO_FAIL_ERRNO + 1)
    return -1;
  return kvti_io_default.fstatat(d, name, st, flags);
}
static int w_renameat(int d1, const char *a, int d2, const char *b) {
  if (should_fail_t(FIO_RENAME, at_is_target(d1, a)) == FIO_FAIL_ERRNO + 1)
    return -1;
  return kvti_io_default.renameat(d1, a, d2, b);
}
static int w_mkdirat(int d, const char *name, mode_t m) {
  if (should_fail_t(FIO_MKDIR, at_is_target(d, name)) == FIO_FAIL_ERRNO + 1)
    return -1;
  return kvti_io_default.mkdirat(d, name, m);
}
static DIR *w_fdopendir(int fd) {
  if (FAIL_FD(FIO_OPENDIR, fd))
    return NULL;
  DIR *dir = kvti_io_default.fdopendir(fd);
  /* The stream owns fd now and closedir releases it without w_close. */
  if (dir && fd >= 0 && fd < FIO_MAX_FD)
    atomic_store(&g_fd_target[fd], 0);
  return dir;
}
static int w_fchmod(int fd, mode_t m) {
  return FAIL_FD(FIO_CHMOD, fd) ? -1 : kvti_io_default.fchmod(fd, m);
}
static void *w_malloc(size_t n) {
  return FAIL_ERRNO(FIO_ALLOC) ? NULL : kvti_io_default.malloc(n);
}
static void *w_calloc(size_t n, size_t s) {
  return FAIL_ERRNO(FIO_ALLOC) ? NULL : kvti_io_default.calloc(n, s);
}
static void *w_realloc(void *p, size_t n) {
  return FAIL_ERRNO(FIO_ALLOC) ? NULL : kvti_io_default.realloc(p, n);
}
static void w_free(void *p) {
  kvti_io_default.free(p);
}

void fio_reset(void) {
  for (int i = 0; i < FIO_NOPS; i++) {
    atomic_store(&g_count[i], 0);
    atomic_store(&g_tcount[i], 0);
  }
  atomic_store(&g_op, -1);
  atomic_store(&g_fired, 0);
}

void fio_install(void) {
  /* Start from the real table so hooks this harness does not wrap keep working.
   */
  g_ops = kvti_io_default;
  g_ops.open = w_open;
  g_ops.close = w_close;
  g_ops.pread = w_pread;
  g_ops.pwrite = w_pwrite;
  g_ops.fsync = w_fsync;
  g_ops.ftruncate = w_ftruncate;
  g_ops.fstat = w_fstat;
  g_ops.lstat = w_lstat;
  g_ops.rename = w_rename;
  g_ops.mkdir = w_mkdir;
  g_ops.rmdir = w_rmdir;
  g_ops.unlink = w_unlink;
  g_ops.chmod = w_chmod;
  g_ops.opendir = w_opendir;
  g_ops.readdir = w_readdir;
  g_ops.closedir = w_closedir;
  g_ops.malloc = w_malloc;
  g_ops.calloc = w_calloc;
  g_ops.realloc = w_realloc;
  g_ops.free = w_free;
  g_ops.rename_exchange = w_rename_exchange;
  g_ops.openat = w_openat;
  g_ops.unlinkat = w_unlinkat;
  g_ops.fstatat = w_fstatat;
  g_ops.renameat = w_renameat;
  g_ops.mkdirat = w_mkdirat;
  g_ops.fdopendir = w_fdopendir;
  g_ops.fchmod = w_fchmod;
  if (kvti_io_default.uring_result)
    g_ops.uring_result = w_uring_result;
  if (kvti_io_default.preadv)
    g_ops.preadv = w_preadv;
  atomic_store(&g_stall, 0);
  fio_reset();
  kvti_io_set(&g_ops);
}

void fio_remove(void) {
  fio_reset();
  kvti_io_set(NULL);
}

void fio_arm(fio_op op, uint64_t nth, fio_kind kind, int err, int sticky) {
  atomic_store(&g_op, -1);
  for (int i = 0; i < FIO_NOPS; i++) {
    atomic_store(&g_count[i], 0);
    atomic_store(&g_tcount[i], 0);
  }
  atomic_store(&g_fired, 0);
  atomic_store(&g_nth, nth);
  atomic_store(&g_kind, (int)kind);
  atomic_store(&g_err, err);
  atomic_store(&g_sticky, sticky);
  atomic_store(&g_op, (int)op);
}

void fio_disarm(void) {
  atomic_store(&g_op, -1);
}
uint64_t fio_fired(void) {
  return atomic_load(&g_fired);
}
uint64_t fio_count(fio_op op) {
  return atomic_load(&g_count[op]);
}
uint64_t fio_count_target(fio_op op) {
  return atomic_load(&g_tcount[op]);
}
void fio_target(const char *substr) {
  atomic_store(&g_has_target, 0);
  if (substr && *substr) {
    snprintf(g_target, sizeof g_target, "%s", substr);
    atomic_store(&g_has_target, 1);
  }
}
uint64_t fio_total_injected(void) {
  return atomic_load(&g_total);
}
uint64_t fio_bytes_read(void) {
  return atomic_load(&g_read_bytes);
}

void fio_stall_set(int on) {
  pthread_mutex_lock(&g_stall_mu);
  atomic_store(&g_stall, on);
  pthread_cond_broadcast(&g_stall_cv);
  pthread_mutex_unlock(&g_stall_mu);
}

void fio_stall_wait_blocked(void) {
  pthread_mutex_lock(&g_stall_mu);
  while (!atomic_load(&g_stalled))
    pthread_cond_wait(&g_stall_cv, &g_stall_mu);
  pthread_mutex_unlock(&g_stall_mu);
}
