/*
 * disk.c - measures the sequential limits of the disk under a directory, so
 * that `kvtier bench` can print every figure as a ratio of what the hardware
 * allows: sequential write with O_DIRECT, sequential read with O_DIRECT, and
 * buffered sequential read with the page cache hot, with 1 MiB blocks (the
 * same jobs as bench/'s programs). Each read limit is the faster of two
 * ways, so that it is the disk's or the page cache's and not one job's:
 * the O_DIRECT read also in 4 MiB blocks (kvtier's cold reads reach the disk
 * in requests of about that size), the cached read also with two jobs at
 * once (kvtier's warm reads copy out of the page cache on more than one
 * thread). It
 * runs fio when installed (bench/'s runner, benchutil.h: --output-format=json
 * parsed with cJSON) and otherwise its own pwrite/pread loop (queue depth 1),
 * and says which one it used. The scratch file is always removed.
 */
#define _GNU_SOURCE
#include "disk.h"
#include "benchutil.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* The built-in fallback's direct I/O is Linux's O_DIRECT; elsewhere (macOS,
 * the portable build) it measures buffered I/O (fio, when installed, says what
 * it measured itself). */
#if !defined(O_DIRECT) || KVT_PORTABLE
#undef O_DIRECT
#define O_DIRECT 0
#endif

#define BLOCK (1u << 20)

/* One fio job of bs-byte blocks, jobs at once over the file (bench/'s
 * runner); returns bytes/s or a negative value on failure. */
static double fio_job(const char *path, const char *rw, int direct,
                      const char *engine, int iodepth, uint64_t size,
                      int invalidate, size_t bs, int jobs) {
  bu_fio_job j = {.file = path,
                  .rw = rw,
                  .direct = direct,
                  .bs = bs,
                  .numjobs = jobs,
                  .size = size,
                  .depth = iodepth,
                  .engine = engine,
                  .end_fsync = strcmp(rw, "write") == 0,
                  .invalidate = invalidate,
                  /* O_DIRECT into huge pages, as kvtier's own buffers are:
                   * into 4 KiB pages a 1 MiB request needs more segments
                   * than a virtio disk takes and is split, which would make
                   * the limit lower than the disk. */
                  .huge_buffers = direct,
                  .quiet = 1}; /* a failure falls back to the own loop */
  double bps = -1;
  return bu_fio(&bps, &j) == 0 ? bps : -1;
}

/* The O_DIRECT read limit: the faster of 1 MiB and 4 MiB blocks. */
static double direct_read(const char *path, const char *engine, int depth,
                          uint64_t size) {
  double rd = fio_job(path, "read", 1, engine, depth, size, 1, BLOCK, 1);
  if (rd > 0) {
    double rd4 = fio_job(path, "read", 1, engine, depth, size, 1, 4 * BLOCK, 1);
    rd = rd4 > rd ? rd4 : rd;
  }
  return rd;
}

/* The cached read limit: a first buffered pass warms the page cache, then
 * the faster of one job and two at once. */
static double cached_read(const char *path, uint64_t size) {
  if (fio_job(path, "read", 0, "psync", 1, size, 0, BLOCK, 1) <= 0)
    return -1;
  double rb = fio_job(path, "read", 0, "psync", 1, size, 0, BLOCK, 1);
  double rb2 = fio_job(path, "read", 0, "psync", 1, size, 0, BLOCK, 2);
  return rb2 > rb ? rb2 : rb;
}

void disk_measure_read_again(disk_result *r, const char *dir) {
  if (!r->ok || !r->used_fio)
    return;
  char path[4200];
  snprintf(path, sizeof path, "%s/.kvtier-bench-disk.tmp", dir);
  unlink(path);
  double rd = -1, rb = -1;
  if (fio_job(path, "write", 1, r->engine, r->iodepth, r->size, 1, BLOCK, 1) >
      0) {
    rd = direct_read(path, r->engine, r->iodepth, r->size);
    rb = cached_read(path, r->size);
  }
  unlink(path);
  if (rd > r->read_direct)
    r->read_direct = rd;
  if (rb > r->read_buffered)
    r->read_buffered = rb;
  size_t at = strlen(r->note);
  snprintf(r->note + at, sizeof r->note - at,
           "; both reads are the faster of their measure before the "
           "promotes and again after them");
}

/* ---- the built-in fallback --------------------------------------------- */

static double own_write(const char *path, uint64_t size, int direct,
                        void *buf) {
  int fd =
      open(path, O_WRONLY | O_CREAT | O_TRUNC | (direct ? O_DIRECT : 0), 0600);
  if (fd < 0)
    return -1;
  double t0 = cli_mono();
  for (uint64_t off = 0; off < size; off += BLOCK) {
    ssize_t n = pwrite(fd, buf, BLOCK, (off_t)off);
    if (n != (ssize_t)BLOCK) {
      close(fd);
      return -1;
    }
  }
  if (fdatasync(fd) != 0) {
    close(fd);
    return -1;
  }
  double t = cli_mono() - t0;
  close(fd);
  return t > 0 ? (double)size / t : -1;
}

static double own_read(const char *path, uint64_t size, int direct, void *buf,
                       int cold) {
  if (cold)
    bu_drop_cache(path);
  int fd = open(path, O_RDONLY | (direct ? O_DIRECT : 0));
  if (fd < 0)
    return -1;
  double t0 = cli_mono();
  for (uint64_t off = 0; off < size; off += BLOCK) {
    ssize_t n = pread(fd, buf, BLOCK, (off_t)off);
    if (n != (ssize_t)BLOCK) {
      close(fd);
      return -1;
    }
  }
  double t = cli_mono() - t0;
  close(fd);
  return t > 0 ? (double)size / t : -1;
}

int disk_measure(disk_result *r, const char *dir, uint64_t size, int progress) {
  memset(r, 0, sizeof *r);
  size = (size + BLOCK - 1) / BLOCK * BLOCK;
  if (size < BLOCK)
    size = BLOCK;
  r->size = size;
  r->block = BLOCK;
  char path[4200];
  snprintf(path, sizeof path, "%s/.kvtier-bench-disk.tmp", dir);
  cli_progress pg;
  cli_progress_start(&pg, "disk", 3, progress);
  char ver[128];
  if (bu_fio_version(ver, sizeof ver) == 0) {
    /* As bench/ does: io_uring (else libaio, else psync) at queue depth 8
     * for O_DIRECT; the buffered read is measured with the page cache hot
     * (a first pass warms it), the limit a warm promote is held against. */
    static const char *engines[] = {"io_uring", "libaio", "psync"};
    int depth = 8;
    const char *engine = NULL;
    double w = -1;
    for (int i = 0; i < 3 && w < 0; i++) {
      engine = engines[i];
      depth = i == 2 ? 1 : 8;
      unlink(path);
      w = fio_job(path, "write", 1, engine, depth, size, 1, BLOCK, 1);
    }
    cli_progress_update(&pg, 1);
    double rd = w > 0 ? direct_read(path, engine, depth, size) : -1;
    cli_progress_update(&pg, 2);
    double rb = w > 0 ? cached_read(path, size) : -1;
    cli_progress_update(&pg, 3);
    if (w > 0 && rd > 0 && rb > 0) {
      r->ok = 1;
      r->used_fio = 1;
      r->write_direct = w;
      r->read_direct = rd;
      r->read_buffered = rb;
      r->iodepth = depth;
      snprintf(r->tool, sizeof r->tool, "%s", ver);
      snprintf(r->engine, sizeof r->engine, "%s", engine);
      snprintf(r->note, sizeof r->note,
               "O_DIRECT jobs read and write huge-page buffers "
               "(GLIBC_TUNABLES=glibc.malloc.hugetlb=1), as kvtier's do; "
               "each read is the faster of 1 MiB and 4 MiB blocks "
               "(O_DIRECT) or of 1 and 2 jobs (cached)");
    } else {
      snprintf(r->note, sizeof r->note,
               "fio failed here; measured with kvtier's own loop instead");
    }
  } else {
    snprintf(r->note, sizeof r->note,
             "fio not installed; measured with kvtier's own O_DIRECT "
             "pwrite/pread loop (queue depth 1)");
  }
  if (!r->ok) {
    void *buf = NULL;
    if (posix_memalign(&buf, 4096, BLOCK) != 0) {
      cli_progress_end(&pg);
      snprintf(r->note, sizeof r->note, "out of memory");
      return -1;
    }
    for (size_t i = 0; i < BLOCK; i++)
      ((unsigned char *)buf)[i] = (unsigned char)(i * 2654435761u >> 13);
    int direct = 1;
    double w = own_write(path, size, 1, buf);
    if (w < 0) { /* O_DIRECT unsupported (tmpfs, some FUSE): buffered */
      direct = 0;
      w = own_write(path, size, 0, buf);
      snprintf(r->note + strlen(r->note), sizeof r->note - strlen(r->note),
               "%sO_DIRECT not supported by this filesystem: buffered + "
               "fdatasync",
               r->note[0] ? "; " : "");
    }
    cli_progress_update(&pg, 1);
    double rd = w > 0 ? own_read(path, size, direct, buf, 1) : -1;
    cli_progress_update(&pg, 2);
    double rb = -1;
    if (w > 0 && own_read(path, size, 0, buf, 1) > 0) /* warms the cache */
      rb = own_read(path, size, 0, buf, 0);
    cli_progress_update(&pg, 3);
    free(buf);
    if (w > 0 && rd > 0 && rb > 0) {
      r->ok = 1;
      r->write_direct = w;
      r->read_direct = rd;
      r->read_buffered = rb;
      r->iodepth = 1;
      snprintf(r->tool, sizeof r->tool, "builtin");
      snprintf(r->engine, sizeof r->engine, "%s",
               direct ? "pwrite/pread O_DIRECT" : "pwrite/pread buffered");
    }
  }
  unlink(path);
  cli_progress_end(&pg);
  if (!r->ok && !r->note[0])
    snprintf(r->note, sizeof r->note, "could not measure the disk: %s",
             strerror(errno));
  return r->ok ? 0 : -1;
}
