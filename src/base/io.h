/*
 * io.h - the I/O seam. Every file-system call and every heap allocation kvtier
 * makes goes through the function table `kvti_io` (modelled on SQLite's VFS and
 * test_vfs.c), so tests can replace any call to inject faults (ENOSPC, EIO,
 * EINTR, short reads/writes, fsync and rename failures, allocation failure) or
 * to simulate a crash that drops unsynced writes. Production code calls only
 * the kvti_* helpers below or kvti_io->fn directly, never the libc functions.
 *
 * Safety invariants: paths are opened with O_NOFOLLOW|O_CLOEXEC, non-blocking,
 * and type-checked (fstat) before any read, so no FIFO, socket or device
 * planted in the cache can make a caller wait; directory walks use lstat and
 * never follow symlinks; the helpers retry EINTR and loop over short
 * reads/writes.
 */
#ifndef KVT_IO_H
#define KVT_IO_H

#include <dirent.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>

typedef struct kvti_io_ops {
  int (*open)(const char *path, int flags, mode_t mode);
  int (*close)(int fd);
  ssize_t (*pread)(int fd, void *buf, size_t n, off_t off);
  ssize_t (*pwrite)(int fd, const void *buf, size_t n, off_t off);
  int (*fsync)(int fd);
  int (*ftruncate)(int fd, off_t len);
  int (*fstat)(int fd, struct stat *st);
  int (*lstat)(const char *path, struct stat *st);
  int (*rename)(const char *from, const char *to);
  int (*mkdir)(const char *path, mode_t mode);
  int (*rmdir)(const char *path);
  int (*unlink)(const char *path);
  int (*chmod)(const char *path, mode_t mode);
  DIR *(*opendir)(const char *path);
  struct dirent *(*readdir)(DIR *d);
  int (*closedir)(DIR *d);
  void *(*malloc)(size_t n);
  void *(*calloc)(size_t n, size_t size);
  void *(*realloc)(void *p, size_t n);
  void (*free)(void *p);
  /* Atomically swaps two paths (Linux renameat2(RENAME_EXCHANGE), macOS
   * renamex_np(RENAME_SWAP)). -1 with errno ENOTSUP/ENOSYS/EINVAL where
   * unsupported. May be NULL in a test table (treated as unsupported). */
  int (*rename_exchange)(const char *a, const char *b);
  /* --- For the batched I/O engine (engine/iobatch*.c); all optional: a
   * NULL hook means "not available" (uring_*: io_uring unusable;
   * fallocate/fadvise: skipped). --- */
  /* 4096-or-larger aligned allocation (posix_memalign semantics: NULL on
   * failure); the block is released with ->free. */
  void *(*aligned_alloc)(size_t align, size_t n);
  /* posix_fallocate / posix_fadvise: return 0 or an errno value. */
  int (*fallocate)(int fd, off_t off, off_t len);
  int (*fadvise)(int fd, off_t off, off_t len, int advice);
  /* io_uring seam. `ring` is a struct io_uring * (opaque here so this header
   * needs no liburing). uring_setup = io_uring_queue_init: 0 or -errno
   * (-ENOSYS/-EPERM in sandboxes that forbid io_uring). uring_submit =
   * io_uring_submit_and_wait: submitted count or -errno. uring_result filters
   * every completion before iobatch looks at it: given the kernel's result
   * (bytes or -errno) of an op on fd at off for len bytes it returns the result
   * to use; tests replace it to inject errors and short transfers. The default
   * returns res unchanged. */
  int (*uring_setup)(unsigned entries, void *ring, unsigned flags);
  int (*uring_submit)(void *ring, unsigned wait_nr);
  int (*uring_result)(int is_write, int fd, uint64_t off, size_t len, int res);
  /* Page-cache residency of the first len bytes of an open file: *bytes
   * receives how many of them are cached (a page-granular count, so it may
   * exceed len by less than a page). 0 or an errno value (ENOSYS: unknown).
   * The reader uses it to choose O_DIRECT for cold files and the page cache for
   * warm ones. Default: cachestat(2) on Linux >= 6.5, else mmap + mincore.
   * NULL: unknown (the reader then keeps to the page cache). */
  int (*resident)(int fd, uint64_t len, uint64_t *bytes);
  /* Calls relative to a directory descriptor (POSIX 2008: Linux and macOS),
   * so a walk under the cache directory never resolves a name through a
   * link planted above it. NULL in a test table: the libc call is used. */
  int (*openat)(int dirfd, const char *name, int flags, mode_t mode);
  int (*unlinkat)(int dirfd, const char *name, int flags);
  int (*fstatat)(int dirfd, const char *name, struct stat *st, int flags);
  DIR *(*fdopendir)(int fd);
  int (*renameat)(int fromfd, const char *from, int tofd, const char *to);
  int (*mkdirat)(int dirfd, const char *name, mode_t mode);
  /* preadv(2): one read of a contiguous file range scattered over iovcnt
   * buffers. NULL where the platform has none (the portable build): the
   * engine then reads the buffers one pread at a time. */
  ssize_t (*preadv)(int fd, const struct iovec *iov, int iovcnt, off_t off);
  /* Mode of an open file (a file created relative to a directory descriptor
   * is chmod'ed through its descriptor, never again by name). NULL in a test
   * table: the libc call is used. */
  int (*fchmod)(int fd, mode_t mode);
} kvti_io_ops;

/* The residency probe the default `resident` hook falls back to where
 * cachestat(2) is missing or refused: mmap + mincore. Same contract as the
 * hook. Exposed so tests can check it on kernels that have cachestat. */
int kvti_resident_mincore(int fd, uint64_t len, uint64_t *bytes);

/* The table in force. Tests swap it with kvti_io_set (not thread-safe: set
 * before opening tiers and restore after closing them). */
extern const kvti_io_ops *kvti_io;
/* The real libc table. */
extern const kvti_io_ops kvti_io_default;
/* Installs ops (NULL restores the default). Returns the previous table. */
const kvti_io_ops *kvti_io_set(const kvti_io_ops *ops);

/* 4096-aligned allocation through the seam (->aligned_alloc, falling back to
 * posix_memalign semantics when the hook is NULL); free with kvti_free. Sets
 * the error on failure. */
void *kvti_aligned_alloc(size_t align, size_t n);

/* Allocation through the seam. kvti_free accepts NULL. */
void *kvti_malloc(size_t n);
void *kvti_calloc(size_t n, size_t size);
void *kvti_realloc(void *p, size_t n);
void kvti_free(void *p);
char *kvti_strdup(const char *s);

/* Opens with O_NOFOLLOW|O_CLOEXEC added, retrying EINTR, and never waits on
 * the file: the open is non-blocking (a FIFO or device under the cache
 * directory cannot stall it) and the file's type is checked with fstat before
 * the fd is returned: a regular file, or a directory when O_DIRECTORY is
 * given; anything else (FIFO, socket, device) is KVT_ECORRUPT. The returned fd
 * is in blocking mode unless the caller asked for O_NONBLOCK. Returns fd or
 * sets the error and returns a negative kvt code (a symlink: KVT_EPERM with
 * errno ELOOP). */
int kvti_open(const char *path, int flags, mode_t mode);
/* kvti_open relative to directory descriptor dirfd: name is opened with
 * O_NOFOLLOW (a link there is KVT_EPERM, errno ELOOP) and type-checked the
 * same way. path (may be NULL: name) names the file in messages. */
int kvti_openat(int dirfd, const char *name, int flags, mode_t mode,
                const char *path);
/* kvti_open_quiet relative to dirfd (O_NOFOLLOW on name): fd, or -1 with
 * errno set (ELOOP: a link; EINVAL / ENOTDIR: the wrong type). */
int kvti_openat_quiet(int dirfd, const char *name, int flags, mode_t mode);
/* fchmod through the seam: 0 or a code (path names fd in messages). */
int kvti_fchmod(int fd, mode_t mode, const char *path);
/* unlinkat(dirfd, name, 0): 0 (a missing name too) or a code. */
int kvti_unlinkat(int dirfd, const char *name, const char *path);
/* fstatat(dirfd, name, AT_SYMLINK_NOFOLLOW): 0, KVT_ENOTFOUND or a code. */
int kvti_lstatat(int dirfd, const char *name, struct stat *st,
                 const char *path);
/* renameat(fromfd, from, tofd, to): neither name is resolved through a link
 * above its directory descriptor (a link as from itself is moved, not its
 * target). 0 or a code (KVT_ENOTFOUND: from is missing); paths (may be NULL)
 * name both sides in messages. */
int kvti_renameat(int fromfd, const char *from, int tofd, const char *to,
                  const char *from_path, const char *to_path);
/* mkdirat(dirfd, name, mode): 0, 1 when name exists already (whatever it
 * is: the caller opens it with O_DIRECTORY|O_NOFOLLOW to check), or a code. */
int kvti_mkdirat(int dirfd, const char *name, mode_t mode, const char *path);
/* A directory stream over dirfd (which it takes over: closedir closes it);
 * NULL with errno set, dirfd then still the caller's. */
DIR *kvti_fdopendir(int dirfd);
/* The same open and check without touching the error state (best-effort
 * callers: prefetch, the second O_DIRECT descriptor): fd, or -1 with errno set
 * (EINVAL / ENOTDIR: the path is of the wrong type). */
int kvti_open_quiet(const char *path, int flags, mode_t mode);
/* "FIFO", "socket", ... for messages about a file of the wrong type. */
const char *kvti_file_type_name(mode_t m);
int kvti_close(int fd); /* retries nothing (close must not be retried); returns
                           0 or code */
/* Full read/write at off, looping over short transfers and EINTR. A read that
 * reaches EOF before n bytes returns KVT_ECORRUPT ("truncated"). Return 0 or a
 * negative kvt code. */
int kvti_pread_all(int fd, void *buf, size_t n, uint64_t off, const char *path);
int kvti_pwrite_all(int fd, const void *buf, size_t n, uint64_t off,
                    const char *path);
int kvti_fsync(int fd, const char *path);
/* fsync of a directory (opens it read-only). */
int kvti_fsync_dir(const char *path);
/* Reads a whole regular file (refusing > max bytes or a non-regular file) into
 * a malloc'ed buffer with a NUL appended (not counted in *len). */
int kvti_read_file(char **out, size_t *len, const char *path, size_t max);
/* The same from an open descriptor (not closed; path names it in errors);
 * *st_out (may be NULL) receives its fstat. */
int kvti_read_fd(char **out, size_t *len, int fd, const char *path, size_t max,
                 struct stat *st_out);
/* Writes a whole file (O_CREAT|O_TRUNC|O_WRONLY with mode), optionally fsyncing
 * it. */
int kvti_write_file(const char *path, const void *data, size_t len, mode_t mode,
                    int do_fsync);
/* mkdir that accepts an existing directory (not a symlink) and applies mode. */
int kvti_mkdir(const char *path, mode_t mode);
/* Removes a file tree without following symlinks: the directory above path
 * is opened by path, everything below it by descriptor (openat with
 * O_DIRECTORY|O_NOFOLLOW, unlinkat), so a directory swapped for a link is
 * not entered (the link itself is removed). Missing path is success. */
int kvti_rmtree(const char *path);
int kvti_rename(const char *from, const char *to);
/* Atomic swap of a and b through kvti_io->rename_exchange. Returns 0,
 * KVT_EUNSUPPORTED (no support on this OS/file system: error not set),
 * KVT_ENOTFOUND (one side missing), or another code with the error set. */
int kvti_rename_exchange(const char *a, const char *b);
int kvti_unlink(const char *path);
/* lstat; returns 0, KVT_ENOTFOUND, or another code. */
int kvti_lstat(const char *path, struct stat *st);
/* Joins a and b with '/' into a malloc'ed string (NULL on OOM, error set). */
char *kvti_path_join(const char *a, const char *b);
/* Sum of st_blocks*512 (allocated bytes) or st_size (apparent) of regular files
 * directly in dir. */
int kvti_dir_bytes(uint64_t *out, const char *dir, int apparent);

/* 1 when the regular file st describes is mostly holes: larger than 1 MiB
 * with under an eighth of it allocated. kvtier and the reference write every
 * byte of an entry's files, so such a file was planted; readers refuse it
 * (KVT_ECORRUPT) before allocating by its length. */
int kvti_file_sparse(const struct stat *st);

#endif
