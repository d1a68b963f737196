/*
 * io.c - the default (libc) implementation of the I/O seam and the robust
 * helpers built on it: EINTR retry, short-transfer loops, symlink-refusing
 * opens, directory fsync and a tree removal that never follows links. All
 * kvtier file access funnels through here (see io.h).
 */
#if defined(__APPLE__)
/* renamex_np/RENAME_SWAP and F_FULLFSYNC are Darwin extensions, hidden by
 * _POSIX_C_SOURCE unless asked for. */
#define _DARWIN_C_SOURCE 1
#endif
#include "base/io.h"
#include "base/error.h"
#include "kvtier.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#if KVT_HAVE_URING
#include <liburing.h>
#endif

static int d_open(const char *p, int f, mode_t m) {
  return open(p, f, m);
}
static int d_openat(int d, const char *p, int f, mode_t m) {
  return openat(d, p, f, m);
}
static int d_mkdir(const char *p, mode_t m) {
  return mkdir(p, m);
}
static int d_chmod(const char *p, mode_t m) {
  return chmod(p, m);
}
static void *d_aligned_alloc(size_t align, size_t n) {
  void *p = NULL;
  return posix_memalign(&p, align, n ? n : 1) == 0 ? p : NULL;
}
/* posix_fallocate/posix_fadvise are absent on macOS: the hooks stay NULL
 * there, which callers treat as "not available" (no preallocation, no cache
 * drop), never as an error. */
#if defined(POSIX_FADV_DONTNEED) && !defined(__APPLE__) && !KVT_PORTABLE
#define KVTI_HAVE_POSIX_FADVISE 1
static int d_fallocate(int fd, off_t off, off_t len) {
  return posix_fallocate(fd, off, len);
}
static int d_fadvise(int fd, off_t off, off_t len, int advice) {
  return posix_fadvise(fd, off, len, advice);
}
#endif
#if KVT_HAVE_URING
static int d_uring_setup(unsigned entries, void *ring, unsigned flags) {
  return io_uring_queue_init(entries, (struct io_uring *)ring, flags);
}
static int d_uring_submit(void *ring, unsigned wait_nr) {
  return io_uring_submit_and_wait((struct io_uring *)ring, wait_nr);
}
static int d_uring_result(int is_write, int fd, uint64_t off, size_t len,
                          int res) {
  (void)is_write, (void)fd, (void)off, (void)len;
  return res;
}
#endif

/* KVTI_LINUX: the Linux-only calls (renameat2, cachestat); never in the
 * portable build, which takes the paths other systems take. */
#if defined(__linux__) && !KVT_PORTABLE
#define KVTI_LINUX 1
#include <sys/syscall.h>
#endif
#if defined(__APPLE__)
#include <stdio.h>
#endif

/* fsync. On macOS fsync(2) hands the data to the drive but does not make the
 * drive write its cache to stable storage; only fcntl(F_FULLFSYNC) does
 * (Apple's fsync(2) manual). Where a file system refuses F_FULLFSYNC (some
 * network and FUSE ones) plain fsync is the best available. */
static int d_fsync(int fd) {
#if defined(__APPLE__) && defined(F_FULLFSYNC)
  if (fcntl(fd, F_FULLFSYNC) == 0)
    return 0;
  if (errno == EINTR)
    return -1; /* kvti_fsync retries */
#endif
  return fsync(fd);
}

/* renameat2(RENAME_EXCHANGE) through syscall(): older glibc lacks the wrapper.
 */
static int d_rename_exchange(const char *a, const char *b) {
#if defined(KVTI_LINUX) && defined(SYS_renameat2)
  return (int)syscall(SYS_renameat2, AT_FDCWD, a, AT_FDCWD, b,
                      2u /* RENAME_EXCHANGE */);
#elif defined(__APPLE__) && defined(RENAME_SWAP)
  return renamex_np(a, b, RENAME_SWAP);
#else
  (void)a;
  (void)b;
  errno = ENOTSUP;
  return -1;
#endif
}

/* The portable residency probe: maps the file (no page is touched) and asks
 * mincore which pages are in memory. */
int kvti_resident_mincore(int fd, uint64_t len, uint64_t *bytes) {
  long pg = sysconf(_SC_PAGESIZE);
  if (pg <= 0)
    pg = 4096;
  *bytes = 0;
  if (len == 0)
    return 0;
  if (len > (uint64_t)SIZE_MAX / 2)
    return EFBIG;
  void *m = mmap(NULL, (size_t)len, PROT_READ, MAP_SHARED, fd, 0);
  if (m == MAP_FAILED)
    return errno;
  size_t np = (size_t)((len + (uint64_t)pg - 1) / (uint64_t)pg);
  /* mincore's vector is unsigned char on Linux, char on macOS: 1 byte/page. */
  unsigned char vec_small[1024];
  unsigned char *vec = np <= sizeof vec_small ? vec_small : malloc(np);
  int e = 0;
  if (!vec)
    e = ENOMEM;
  else if (mincore(m, (size_t)len, (void *)vec) != 0)
    e = errno;
  else
    for (size_t i = 0; i < np; i++)
      if (vec[i] & 1)
        *bytes += (uint64_t)pg;
  if (vec != vec_small)
    free(vec);
  munmap(m, (size_t)len);
  return e;
}

#if !KVT_PORTABLE
/* Residency: cachestat(2) (Linux 6.5+, no mapping needed) when the kernel has
 * it, else mmap + mincore (every POSIX system; maps without touching pages). */
#ifndef KVTI_SYS_CACHESTAT
#define KVTI_SYS_CACHESTAT 451 /* same number on every Linux architecture */
#endif
static int d_resident(int fd, uint64_t len, uint64_t *bytes) {
  *bytes = 0;
  if (len == 0)
    return 0;
#if defined(KVTI_LINUX)
  long pg = sysconf(_SC_PAGESIZE);
  if (pg <= 0)
    pg = 4096;
  static int no_cachestat; /* benign race: every thread learns the same */
  if (!__atomic_load_n(&no_cachestat, __ATOMIC_RELAXED)) {
    struct {
      uint64_t off, len;
    } range = {0, len};
    struct {
      uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted,
          nr_recently_evicted;
    } cs;
    memset(&cs, 0, sizeof cs);
    if (syscall(KVTI_SYS_CACHESTAT, fd, &range, &cs, 0) == 0) {
      *bytes = cs.nr_cache * (uint64_t)pg;
      return 0;
    }
    /* ENOSYS: kernel before 6.5; EPERM: a seccomp filter (container
     * runtimes refuse syscalls they do not know with EPERM). */
    if (errno != ENOSYS && errno != EPERM)
      return errno;
    __atomic_store_n(&no_cachestat, 1, __ATOMIC_RELAXED);
  }
#endif
  return kvti_resident_mincore(fd, len, bytes);
}
#endif

const kvti_io_ops kvti_io_default = {
    .open = d_open,
    .close = close,
    .pread = pread,
    .pwrite = pwrite,
    .fsync = d_fsync,
    .ftruncate = ftruncate,
    .fstat = fstat,
    .lstat = lstat,
    .rename = rename,
    .mkdir = d_mkdir,
    .rmdir = rmdir,
    .unlink = unlink,
    .chmod = d_chmod,
    .opendir = opendir,
    .readdir = readdir,
    .closedir = closedir,
    .malloc = malloc,
    .calloc = calloc,
    .realloc = realloc,
    .free = free,
    .rename_exchange = d_rename_exchange,
    .aligned_alloc = d_aligned_alloc,
#ifdef KVTI_HAVE_POSIX_FADVISE
    .fallocate = d_fallocate,
    .fadvise = d_fadvise,
#endif
#if KVT_HAVE_URING
    .uring_setup = d_uring_setup,
    .uring_submit = d_uring_submit,
    .uring_result = d_uring_result,
#endif
#if !KVT_PORTABLE
    /* The portable build never reads with O_DIRECT, so it never asks. */
    .resident = d_resident,
#endif
    .openat = d_openat,
    .unlinkat = unlinkat,
    .fstatat = fstatat,
    .fdopendir = fdopendir,
    .renameat = renameat,
    .mkdirat = mkdirat,
#if !KVT_PORTABLE
    .preadv = preadv,
#endif
    .fchmod = fchmod,
};

const kvti_io_ops *kvti_io = &kvti_io_default;

const kvti_io_ops *kvti_io_set(const kvti_io_ops *ops) {
  const kvti_io_ops *old = kvti_io;
  kvti_io = ops ? ops : &kvti_io_default;
  return old;
}

void *kvti_aligned_alloc(size_t align, size_t n) {
  void *(*fn)(size_t, size_t) =
      kvti_io->aligned_alloc ? kvti_io->aligned_alloc : d_aligned_alloc;
  void *p = fn(align, n ? n : 1);
  if (!p)
    KVT_ERR_NOMEM();
  return p;
}

void *kvti_malloc(size_t n) {
  return kvti_io->malloc(n ? n : 1);
}
void *kvti_calloc(size_t n, size_t size) {
  return kvti_io->calloc(n ? n : 1, size ? size : 1);
}
void *kvti_realloc(void *p, size_t n) {
  return kvti_io->realloc(p, n ? n : 1);
}
void kvti_free(void *p) {
  if (p)
    kvti_io->free(p);
}
char *kvti_strdup(const char *s) {
  size_t n = strlen(s) + 1;
  char *d = kvti_malloc(n);
  if (!d) {
    KVT_ERR_NOMEM();
    return NULL;
  }
  memcpy(d, s, n);
  return d;
}

/* The open under kvti_open and kvti_open_quiet. Every file under the cache
 * directory may have been planted by someone else, so nothing may wait on it:
 * O_NONBLOCK makes the open of a FIFO or a device return at once instead of
 * waiting for a writer (the open itself would otherwise block forever), and
 * fstat refuses anything but a regular file (a directory with O_DIRECTORY)
 * before the caller reads a byte. On the regular file the flag is cleared
 * again: read(2) ignores it there, but io_uring honours it (a buffered read
 * that would block completes with -EAGAIN instead of being queued). fcntl is
 * called directly: it changes no file-system state, so the seam (whose tests
 * inject faults into state changes and reads) needs no hook for it.
 * Returns the fd; -1 with errno set (open, fstat or fcntl failed); or -2 when
 * the path is of the wrong type (*mode_out receives its st_mode). */
static int open_typed(int dirfd, const char *path, int flags, mode_t mode,
                      mode_t *mode_out) {
  int fd;
  int oflags = flags | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK;
  do {
    if (dirfd == AT_FDCWD)
      fd = kvti_io->open(path, oflags, mode);
    else
      fd = kvti_io->openat ? kvti_io->openat(dirfd, path, oflags, mode)
                           : openat(dirfd, path, oflags, mode);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0)
    return -1;
  struct stat st;
  if (kvti_io->fstat(fd, &st) != 0) {
    int e = errno;
    kvti_io->close(fd);
    errno = e;
    return -1;
  }
  int want_dir = (flags & O_DIRECTORY) != 0;
  if (want_dir ? !S_ISDIR(st.st_mode) : !S_ISREG(st.st_mode)) {
    kvti_io->close(fd);
    *mode_out = st.st_mode;
    return -2;
  }
  if (!(flags & O_NONBLOCK)) {
    int fl = fcntl(fd, F_GETFL);
    if (fl == -1 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) == -1) {
      int e = errno;
      kvti_io->close(fd);
      errno = e;
      return -1;
    }
  }
  return fd;
}

const char *kvti_file_type_name(mode_t m) {
  if (S_ISREG(m))
    return "regular file";
  if (S_ISDIR(m))
    return "directory";
  if (S_ISFIFO(m))
    return "FIFO";
  if (S_ISSOCK(m))
    return "socket";
  if (S_ISCHR(m))
    return "character device";
  if (S_ISBLK(m))
    return "block device";
  if (S_ISLNK(m))
    return "symlink";
  return "special file";
}

int kvti_openat(int dirfd, const char *name, int flags, mode_t mode,
                const char *path) {
  if (!path)
    path = name;
  mode_t m = 0;
  int fd = open_typed(dirfd, name, flags, mode, &m);
  if (fd == -2)
    return KVT_ERR(KVT_ECORRUPT, "%s is a %s, not a %s", path,
                   kvti_file_type_name(m),
                   (flags & O_DIRECTORY) ? "directory" : "regular file");
  if (fd < 0 && errno == ELOOP)
    return KVT_ERR(KVT_EPERM, "%s is a symbolic link (never followed)", path);
  /* Linux reports a link opened with O_DIRECTORY | O_NOFOLLOW as ENOTDIR. */
  if (fd < 0 && errno == ENOTDIR && (flags & O_DIRECTORY))
    return KVT_ERR(KVT_EPERM,
                   "%s is not a directory (links are never "
                   "followed)",
                   path);
  if (fd < 0)
    return KVT_ERR_OS(errno, "open %s", path);
  return fd;
}

int kvti_openat_quiet(int dirfd, const char *name, int flags, mode_t mode) {
  mode_t m = 0;
  int fd = open_typed(dirfd, name, flags, mode, &m);
  if (fd == -2)
    errno = (flags & O_DIRECTORY) ? ENOTDIR : EINVAL;
  return fd < 0 ? -1 : fd;
}

int kvti_fchmod(int fd, mode_t mode, const char *path) {
  int r = kvti_io->fchmod ? kvti_io->fchmod(fd, mode) : fchmod(fd, mode);
  if (r != 0)
    return KVT_ERR_OS(errno, "chmod %s", path ? path : "(descriptor)");
  return 0;
}

int kvti_unlinkat(int dirfd, const char *name, const char *path) {
  int r = kvti_io->unlinkat ? kvti_io->unlinkat(dirfd, name, 0)
                            : unlinkat(dirfd, name, 0);
  if (r != 0 && errno != ENOENT)
    return KVT_ERR_OS(errno, "unlink %s", path ? path : name);
  return 0;
}

int kvti_lstatat(int dirfd, const char *name, struct stat *st,
                 const char *path) {
  int r = kvti_io->fstatat
              ? kvti_io->fstatat(dirfd, name, st, AT_SYMLINK_NOFOLLOW)
              : fstatat(dirfd, name, st, AT_SYMLINK_NOFOLLOW);
  if (r != 0) {
    if (errno == ENOENT)
      return KVT_ERR(KVT_ENOTFOUND, "%s does not exist", path ? path : name);
    return KVT_ERR_OS(errno, "stat %s", path ? path : name);
  }
  return 0;
}

int kvti_renameat(int fromfd, const char *from, int tofd, const char *to,
                  const char *from_path, const char *to_path) {
  int r = kvti_io->renameat ? kvti_io->renameat(fromfd, from, tofd, to)
                            : renameat(fromfd, from, tofd, to);
  if (r == 0)
    return 0;
  const char *fp = from_path ? from_path : from, *tp = to_path ? to_path : to;
  if (errno == ENOENT)
    return KVT_ERR(KVT_ENOTFOUND, "rename %s -> %s: no such file", fp, tp);
  return KVT_ERR_OS(errno, "rename %s -> %s", fp, tp);
}

int kvti_mkdirat(int dirfd, const char *name, mode_t mode, const char *path) {
  int r = kvti_io->mkdirat ? kvti_io->mkdirat(dirfd, name, mode)
                           : mkdirat(dirfd, name, mode);
  if (r == 0)
    return 0;
  if (errno == EEXIST)
    return 1;
  return KVT_ERR_OS(errno, "mkdir %s", path ? path : name);
}

DIR *kvti_fdopendir(int dirfd) {
  return kvti_io->fdopendir ? kvti_io->fdopendir(dirfd) : fdopendir(dirfd);
}

int kvti_open(const char *path, int flags, mode_t mode) {
  mode_t m = 0;
  int fd = open_typed(AT_FDCWD, path, flags, mode, &m);
  if (fd == -2)
    return KVT_ERR(KVT_ECORRUPT, "%s is a %s, not a %s", path,
                   kvti_file_type_name(m),
                   (flags & O_DIRECTORY) ? "directory" : "regular file");
  if (fd < 0)
    return KVT_ERR_OS(errno, "open %s", path);
  return fd;
}

int kvti_open_quiet(const char *path, int flags, mode_t mode) {
  mode_t m = 0;
  int fd = open_typed(AT_FDCWD, path, flags, mode, &m);
  if (fd == -2)
    errno = (flags & O_DIRECTORY) ? ENOTDIR : EINVAL;
  return fd < 0 ? -1 : fd;
}

int kvti_close(int fd) {
  if (kvti_io->close(fd) != 0 && errno != EINTR)
    return KVT_ERR_OS(errno, "close");
  return 0;
}

int kvti_pread_all(int fd, void *buf, size_t n, uint64_t off,
                   const char *path) {
  char *p = buf;
  while (n > 0) {
    ssize_t r = kvti_io->pread(fd, p, n, (off_t)off);
    if (r < 0) {
      if (errno == EINTR)
        continue;
      return KVT_ERR_OS(errno, "read %s", path);
    }
    if (r == 0)
      return KVT_ERR(KVT_ECORRUPT,
                     "read %s: file truncated (%zu bytes missing)", path, n);
    p += r;
    n -= (size_t)r;
    off += (uint64_t)r;
  }
  return 0;
}

int kvti_pwrite_all(int fd, const void *buf, size_t n, uint64_t off,
                    const char *path) {
  const char *p = buf;
  while (n > 0) {
    ssize_t r = kvti_io->pwrite(fd, p, n, (off_t)off);
    if (r < 0) {
      if (errno == EINTR)
        continue;
      return KVT_ERR_OS(errno, "write %s", path);
    }
    if (r == 0)
      return KVT_ERR_OS(EIO, "write %s: no progress", path);
    p += r;
    n -= (size_t)r;
    off += (uint64_t)r;
  }
  return 0;
}

int kvti_fsync(int fd, const char *path) {
  int r;
  do {
    r = kvti_io->fsync(fd);
  } while (r != 0 && errno == EINTR);
  if (r != 0)
    return KVT_ERR_OS(errno, "fsync %s", path);
  return 0;
}

int kvti_fsync_dir(const char *path) {
  int fd = kvti_open(path, O_RDONLY | O_DIRECTORY, 0);
  if (fd < 0)
    return fd;
  int rc = kvti_fsync(fd, path);
  kvti_io->close(fd);
  return rc;
}

int kvti_read_fd(char **out, size_t *len, int fd, const char *path, size_t max,
                 struct stat *st_out) {
  struct stat st;
  if (kvti_io->fstat(fd, &st) != 0)
    return KVT_ERR_OS(errno, "stat %s", path);
  if (!S_ISREG(st.st_mode))
    return KVT_ERR(KVT_ECORRUPT, "%s is not a regular file", path);
  if ((uint64_t)st.st_size > max)
    return KVT_ERR(KVT_ECORRUPT, "%s is too large (%lld bytes, limit %zu)",
                   path, (long long)st.st_size, max);
  char *buf = kvti_malloc((size_t)st.st_size + 1);
  if (!buf)
    return KVT_ERR_NOMEM();
  int rc = kvti_pread_all(fd, buf, (size_t)st.st_size, 0, path);
  if (rc != 0) {
    kvti_free(buf);
    return rc;
  }
  buf[st.st_size] = '\0';
  *out = buf;
  *len = (size_t)st.st_size;
  if (st_out)
    *st_out = st;
  return 0;
}

int kvti_read_file(char **out, size_t *len, const char *path, size_t max) {
  int fd = kvti_open(path, O_RDONLY, 0);
  if (fd < 0)
    return fd;
  int rc = kvti_read_fd(out, len, fd, path, max, NULL);
  kvti_io->close(fd);
  return rc;
}

int kvti_write_file(const char *path, const void *data, size_t len, mode_t mode,
                    int do_fsync) {
  int fd = kvti_open(path, O_WRONLY | O_CREAT | O_TRUNC, mode);
  if (fd < 0)
    return fd;
  int rc = kvti_pwrite_all(fd, data, len, 0, path);
  if (rc == 0 && do_fsync)
    rc = kvti_fsync(fd, path);
  if (kvti_io->close(fd) != 0 && rc == 0 && errno != EINTR)
    rc = KVT_ERR_OS(errno, "close %s", path);
  if (rc != 0)
    kvti_io->unlink(path);
  return rc;
}

int kvti_mkdir(const char *path, mode_t mode) {
  if (kvti_io->mkdir(path, mode) == 0)
    return 0;
  int e = errno;
  if (e == EEXIST) {
    struct stat st;
    if (kvti_io->lstat(path, &st) != 0)
      return KVT_ERR_OS(errno, "stat %s", path);
    if (S_ISLNK(st.st_mode))
      return KVT_ERR(KVT_EPERM, "%s is a symlink; refusing to use it", path);
    if (!S_ISDIR(st.st_mode))
      return KVT_ERR(KVT_EIO, "%s exists and is not a directory", path);
    return 0;
  }
  return KVT_ERR_OS(e, "mkdir %s", path);
}

int kvti_rename(const char *from, const char *to) {
  if (kvti_io->rename(from, to) != 0)
    return KVT_ERR_OS(errno, "rename %s -> %s", from, to);
  return 0;
}

int kvti_rename_exchange(const char *a, const char *b) {
  if (!kvti_io->rename_exchange)
    return KVT_EUNSUPPORTED;
  if (kvti_io->rename_exchange(a, b) == 0)
    return 0;
  int e = errno;
  if (e == ENOSYS || e == EINVAL || e == ENOTSUP || e == EOPNOTSUPP)
    return KVT_EUNSUPPORTED;
  if (e == ENOENT)
    return KVT_ENOTFOUND;
  return KVT_ERR_OS(e, "rename-exchange %s <-> %s", a, b);
}

int kvti_unlink(const char *path) {
  if (kvti_io->unlink(path) != 0 && errno != ENOENT)
    return KVT_ERR_OS(errno, "unlink %s", path);
  return 0;
}

int kvti_lstat(const char *path, struct stat *st) {
  if (kvti_io->lstat(path, st) != 0) {
    if (errno == ENOENT)
      return KVT_ERR(KVT_ENOTFOUND, "%s does not exist", path);
    return KVT_ERR_OS(errno, "stat %s", path);
  }
  return 0;
}

char *kvti_path_join(const char *a, const char *b) {
  size_t la = strlen(a), lb = strlen(b);
  char *p = kvti_malloc(la + lb + 2);
  if (!p) {
    KVT_ERR_NOMEM();
    return NULL;
  }
  memcpy(p, a, la);
  size_t o = la;
  if (la == 0 || a[la - 1] != '/')
    p[o++] = '/';
  memcpy(p + o, b, lb + 1);
  return p;
}

/* Removes name below dirfd (path names it in messages). Every step is
 * relative to the descriptor of the directory above, and a directory is
 * entered only by an O_NOFOLLOW|O_DIRECTORY open: a directory swapped for a
 * link between the stat and the open is not entered - the link itself is
 * removed, its target never touched. Depth is bounded so a hostile deep
 * tree cannot exhaust the stack. */
static int rmtree_at(int dirfd, const char *name, const char *path, int depth) {
  struct stat st;
  int r = kvti_io->fstatat
              ? kvti_io->fstatat(dirfd, name, &st, AT_SYMLINK_NOFOLLOW)
              : fstatat(dirfd, name, &st, AT_SYMLINK_NOFOLLOW);
  if (r != 0)
    return errno == ENOENT ? 0 : KVT_ERR_OS(errno, "stat %s", path);
  if (!S_ISDIR(st.st_mode))
    return kvti_unlinkat(dirfd, name, path);
  if (depth > 16)
    return KVT_ERR(KVT_EIO, "%s: directory tree too deep to remove", path);
  mode_t m = 0;
  int sub = open_typed(dirfd, name, O_RDONLY | O_DIRECTORY, 0, &m);
  if (sub == -2 || (sub < 0 && (errno == ELOOP || errno == ENOTDIR)))
    return kvti_unlinkat(dirfd, name, path); /* no longer a directory */
  if (sub < 0)
    return errno == ENOENT ? 0 : KVT_ERR_OS(errno, "open %s", path);
  /* The stream gets its own descriptor (closedir closes it); sub stays for
   * the removals below it. */
  int sfd = open_typed(sub, ".", O_RDONLY | O_DIRECTORY, 0, &m);
  DIR *d = sfd >= 0 ? kvti_fdopendir(sfd) : NULL;
  if (!d) {
    int e = sfd >= 0 ? errno : (sfd == -2 ? ENOTDIR : errno);
    if (sfd >= 0)
      kvti_io->close(sfd);
    kvti_io->close(sub);
    return KVT_ERR_OS(e, "opendir %s", path);
  }
  int rc = 0;
  struct dirent *de;
  while ((de = kvti_io->readdir(d)) != NULL) {
    if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, ".."))
      continue;
    char *child = kvti_path_join(path, de->d_name);
    if (!child) {
      rc = KVT_ENOMEM;
      break;
    }
    int cr = rmtree_at(sub, de->d_name, child, depth + 1);
    kvti_free(child);
    if (cr != 0 && rc == 0)
      rc = cr;
  }
  kvti_io->closedir(d);
  kvti_io->close(sub);
  if (rc == 0) {
    r = kvti_io->unlinkat ? kvti_io->unlinkat(dirfd, name, AT_REMOVEDIR)
                          : unlinkat(dirfd, name, AT_REMOVEDIR);
    if (r != 0 && errno != ENOENT)
      rc = KVT_ERR_OS(errno, "rmdir %s", path);
  }
  return rc;
}

int kvti_rmtree(const char *path) {
  size_t n = strlen(path);
  while (n > 1 && path[n - 1] == '/')
    n--;
  char buf[4096];
  if (n == 0 || n >= sizeof buf)
    return KVT_ERR(KVT_EINVAL, "rmtree: bad path '%s'", path);
  memcpy(buf, path, n);
  buf[n] = 0;
  char *sl = strrchr(buf, '/');
  const char *name = sl ? sl + 1 : buf;
  if (!*name || !strcmp(name, ".") || !strcmp(name, ".."))
    return KVT_ERR(KVT_EINVAL, "rmtree: bad path '%s'", path);
  /* The directory above is reached by path (the caller's, below a cache
   * directory whose ancestors it trusts); from there on nothing is. */
  int dfd;
  if (sl) {
    *sl = 0;
    mode_t m = 0;
    dfd = open_typed(AT_FDCWD, sl == buf ? "/" : buf, O_RDONLY | O_DIRECTORY, 0,
                     &m);
    *sl = '/';
    if (dfd < 0)
      return errno == ENOENT
                 ? 0
                 : KVT_ERR_OS(errno, "open %.*s", (int)(sl - buf), buf);
  } else {
    dfd = AT_FDCWD;
  }
  int rc = rmtree_at(dfd, name, buf, 0);
  if (dfd >= 0)
    kvti_io->close(dfd);
  return rc;
}

int kvti_dir_bytes(uint64_t *out, const char *dir, int apparent) {
  DIR *d = kvti_io->opendir(dir);
  if (!d)
    return KVT_ERR_OS(errno, "opendir %s", dir);
  uint64_t total = 0;
  int rc = 0;
  struct dirent *de;
  while ((de = kvti_io->readdir(d)) != NULL) {
    if (de->d_name[0] == '.')
      continue;
    char *p = kvti_path_join(dir, de->d_name);
    if (!p) {
      rc = KVT_ENOMEM;
      break;
    }
    struct stat st;
    if (kvti_io->lstat(p, &st) == 0 && S_ISREG(st.st_mode))
      total += apparent ? (uint64_t)st.st_size : (uint64_t)st.st_blocks * 512u;
    kvti_free(p);
  }
  kvti_io->closedir(d);
  if (rc == 0)
    *out = total;
  return rc;
}

/* A file whose allocated size is less than 1/KVTI_SPARSE_FACTOR of its
 * length (and which is larger than KVTI_SPARSE_MIN) is refused as sparse:
 * kvtier and the reference write every byte, so a file that is mostly holes
 * was planted, and its length is no licence to allocate. (A compressing file
 * system could shrink real data too, but not eightfold.) */
#define KVTI_SPARSE_FACTOR 8
#define KVTI_SPARSE_MIN ((uint64_t)1 << 20)

int kvti_file_sparse(const struct stat *st) {
  uint64_t size = (uint64_t)st->st_size;
  uint64_t alloc = (uint64_t)st->st_blocks * 512u;
  return size > KVTI_SPARSE_MIN && alloc * KVTI_SPARSE_FACTOR < size;
}
