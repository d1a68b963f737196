/*
 * faultio.h - the reusable fault-injection harness for the reliability tests.
 * It installs an I/O table (src/base/io.h) that forwards every call to the real
 * one while counting calls per operation, and can make the Nth call of a chosen
 * operation (or every call from the Nth on) fail with a chosen errno (ENOSPC,
 * EIO, EINTR...), transfer only part of the bytes (short read/write), or fail
 * an allocation of the seam's malloc/calloc/realloc. Tests loop N = 1, 2,
 * ... until the armed fault no longer fires, which covers every call site of
 * that operation (the SQLite/curl "fail each site in turn" method). It also
 * counts the bytes reads return (pread and io_uring completions) and can hold
 * every pwrite in a stall, so a test can catch the writer mid-entry.
 * The calls relative to a directory descriptor (openat, unlinkat, fstatat,
 * renameat, mkdirat, fdopendir, fchmod) count and fail as their path
 * counterparts (open, unlink/rmdir, lstat, rename, mkdir, opendir, chmod).
 * Thread-safe (atomic counters), so the tier's writer and promote threads can
 * run under it. The one I/O-table harness of the test library (tests/lib), used
 * by unit and reliability tests alike.
 */
#ifndef KVT_FAULTIO_H
#define KVT_FAULTIO_H

#include <stdint.h>

typedef enum fio_op {
  FIO_OPEN,
  FIO_CLOSE,
  FIO_PREAD, /* pread and preadv */
  FIO_PWRITE,
  FIO_FSYNC,
  FIO_FTRUNCATE,
  FIO_FSTAT,
  FIO_LSTAT,
  FIO_RENAME,
  FIO_MKDIR,
  FIO_RMDIR,
  FIO_UNLINK,
  FIO_CHMOD,
  FIO_OPENDIR,
  FIO_READDIR,
  FIO_CLOSEDIR,
  FIO_RENAME_EXCHANGE,
  FIO_ALLOC, /* malloc, calloc and realloc of the seam together */
  FIO_NOPS
} fio_op;

typedef enum fio_kind {
  FIO_FAIL_ERRNO = 0, /* return -1 (NULL) with the armed errno */
  FIO_FAIL_SHORT = 1  /* pread/preadv/pwrite: transfer at most half (>= 1 byte)
                         and return  it */
} fio_kind;

/* Installs the counting table (nothing armed, counters zero). Call before
 * opening anything that must run under it; fio_remove restores the default
 * table. */
void fio_install(void);
void fio_remove(void);
/* Zeroes the counters and disarms. */
void fio_reset(void);
/* Arms: the nth call (1-based, counted from now) of op fails as kind/err.
 * sticky: every call after the nth fails too (a full disk, a dead device).
 * Counters restart at zero. */
void fio_arm(fio_op op, uint64_t nth, fio_kind kind, int err, int sticky);
void fio_disarm(void);
/* Number of calls that were failed since fio_arm. */
uint64_t fio_fired(void);
/* Calls of op since install/reset/arm. */
uint64_t fio_count(fio_op op);
/* Restricts armed faults to calls about files whose path contains substr
 * (NULL or "": no restriction): path calls by their path (rename: its source),
 * descriptor calls by the path the descriptor was opened with; allocations
 * and directory reads are never targets; a call relative to a directory
 * descriptor is about a target when its name contains substr or its
 * descriptor was opened from a target. The nth of fio_arm then counts only
 * target calls. Set it before opening the files it should see (descriptors are
 * classified when opened). E.g. "index.db" aims at the index's database and
 * WAL, which SQLite reaches through kvtier's VFS (src/sqlvfs.c). */
void fio_target(const char *substr);
/* Calls of op about target files since install/reset/arm. */
uint64_t fio_count_target(fio_op op);
/* Total faults injected since the process started (for the report). */
uint64_t fio_total_injected(void);
const char *fio_op_name(fio_op op);
/* While set, rename_exchange fails with ENOTSUP (not counted as a fault),
 * forcing the portable two-rename publish path. */
void fio_set_no_exchange(int on);
/* Bytes returned by reads (pread and io_uring read completions) since install
 * (not reset by fio_reset/fio_arm: callers take differences). */
uint64_t fio_bytes_read(void);
/* While on, every pwrite blocks before it runs; off releases them. */
void fio_stall_set(int on);
/* Waits until a pwrite is blocked in the stall. */
void fio_stall_wait_blocked(void);

#endif
