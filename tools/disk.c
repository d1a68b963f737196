/*
 * disk.c - measures the sequential limits of the disk under a directory, so
 * that `kvtier bench` can print every figure as a ratio of what the hardware
 * allows: sequential write with O_DIRECT, sequential read with O_DIRECT, and
 * buffered sequential read with the page cache hot, all with 1 MiB blocks
 * (the same jobs as bench/'s programs). It
 * runs fio when installed (--output-format=json, parsed with cJSON) and
 * otherwise its own pwrite/pread loop (queue depth 1), and says which one it
 * used. The scratch file is always removed.
 */
#define _GNU_SOURCE
#include "disk.h"

#include <errno.h>
#include <fcntl.h>
#include <spawn.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

/* The built-in fallback's direct I/O is Linux's O_DIRECT; elsewhere (macOS,
 * the portable build) it measures buffered I/O (fio, when installed, says what
 * it measured itself). */
#if !defined(O_DIRECT) || KVT_PORTABLE
#undef O_DIRECT
#define O_DIRECT 0
#endif

#define BLOCK (1u << 20)

/* Runs argv, returns its stdout (malloc'ed, NUL-terminated) or NULL. */
static char *run_capture(char *const argv[], int *status) {
  int pfd[2];
  if (pipe(pfd) != 0)
    return NULL;
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, pfd[1], STDOUT_FILENO);
  posix_spawn_file_actions_addclose(&fa, pfd[0]);
  posix_spawn_file_actions_addopen(&fa, STDERR_FILENO, "/dev/null", O_WRONLY,
                                   0);
  pid_t pid;
  int rc = posix_spawnp(&pid, argv[0], &fa, NULL, argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  close(pfd[1]);
  if (rc != 0) {
    close(pfd[0]);
    return NULL;
  }
  size_t cap = 65536, len = 0;
  char *buf = malloc(cap);
  for (;;) {
    if (buf && len + 4096 > cap) {
      char *nb = realloc(buf, cap * 2);
      if (!nb) {
        free(buf);
        buf = NULL;
      } else {
        buf = nb;
        cap *= 2;
      }
    }
    char sink[4096];
    ssize_t n = buf ? read(pfd[0], buf + len, cap - len - 1)
                    : read(pfd[0], sink, sizeof sink);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      break;
    if (buf)
      len += (size_t)n;
  }
  close(pfd[0]);
  int st = 0;
  while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {
  }
  *status = st;
  if (buf)
    buf[len] = 0;
  return buf;
}

/* One fio job; returns bytes/s or a negative value on failure. */
static double fio_job(const char *path, const char *rw, int direct,
                      const char *engine, int iodepth, uint64_t size,
                      int invalidate) {
  char a_name[64], a_file[4200], a_rw[64], a_size[64], a_direct[32],
      a_engine[64], a_depth[32], a_inval[32];
  snprintf(a_name, sizeof a_name, "--name=kvtier-%s%s", rw,
           direct ? "-direct" : "-buffered");
  snprintf(a_file, sizeof a_file, "--filename=%s", path);
  snprintf(a_rw, sizeof a_rw, "--rw=%s", rw);
  snprintf(a_size, sizeof a_size, "--size=%llu", (unsigned long long)size);
  snprintf(a_direct, sizeof a_direct, "--direct=%d", direct);
  snprintf(a_engine, sizeof a_engine, "--ioengine=%s", engine);
  snprintf(a_depth, sizeof a_depth, "--iodepth=%d", iodepth);
  snprintf(a_inval, sizeof a_inval, "--invalidate=%d", invalidate);
  char *argv[] = {"fio",
                  a_name,
                  a_file,
                  a_rw,
                  "--bs=1M",
                  a_size,
                  a_direct,
                  a_engine,
                  a_depth,
                  a_inval,
                  strcmp(rw, "write") == 0 ? "--end_fsync=1" : "--thread",
                  "--output-format=json",
                  NULL};
  int st = 0;
  char *out = run_capture(argv, &st);
  if (!out)
    return -1;
  double bps = -1;
  /* fio may print notes before the JSON document. */
  const char *j = strchr(out, '{');
  cJSON *root =
      j && WIFEXITED(st) && WEXITSTATUS(st) == 0 ? cJSON_Parse(j) : NULL;
  const cJSON *jobs = cJSON_GetObjectItemCaseSensitive(root, "jobs");
  const cJSON *job = cJSON_GetArrayItem(jobs, 0);
  if (job && cli_jnum(job, "error", 0) == 0) {
    const cJSON *side = cJSON_GetObjectItemCaseSensitive(
        job, strcmp(rw, "write") == 0 ? "write" : "read");
    double v = cli_jnum(side, "bw_bytes", -1);
    if (v < 0) /* older fio: bw in KiB/s */
      v = cli_jnum(side, "bw", -1) * 1024.0;
    if (v > 0)
      bps = v;
  }
  cJSON_Delete(root);
  free(out);
  return bps;
}

static int fio_version(char *buf, size_t cap) {
  char *argv[] = {"fio", "--version", NULL};
  int st = 0;
  char *out = run_capture(argv, &st);
  if (!out)
    return -1;
  int ok = WIFEXITED(st) && WEXITSTATUS(st) == 0 && strncmp(out, "fio", 3) == 0;
  if (ok) {
    out[strcspn(out, "\r\n")] = 0;
    snprintf(buf, cap, "%s", out);
  }
  free(out);
  return ok ? 0 : -1;
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

static void drop_file_cache(const char *path) {
  int fd = open(path, O_RDONLY);
  if (fd >= 0) {
    fsync(fd);
#if defined(POSIX_FADV_DONTNEED) && !KVT_PORTABLE
    posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
#endif
    close(fd);
  }
}

static double own_read(const char *path, uint64_t size, int direct, void *buf,
                       int cold) {
  if (cold)
    drop_file_cache(path);
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
  if (fio_version(ver, sizeof ver) == 0) {
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
      w = fio_job(path, "write", 1, engine, depth, size, 1);
    }
    cli_progress_update(&pg, 1);
    double rd = w > 0 ? fio_job(path, "read", 1, engine, depth, size, 1) : -1;
    cli_progress_update(&pg, 2);
    double rb = -1;
    if (w > 0 && fio_job(path, "read", 0, "psync", 1, size, 0) > 0)
      rb = fio_job(path, "read", 0, "psync", 1, size, 0);
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
