/*
 * statsfile.c - the live stats file (see statsfile.h and docs/FORMAT.md):
 * the writer side used by the tier and kvt_stats_read_live, the reader any
 * process may call. The mapping is shared memory between processes, so every
 * word of it is accessed through C11 atomics (lock-free 8-byte atomics are
 * address-free); the seqlock follows the C11 recipe: relaxed data stores
 * between a release fence and a release store of the sequence on the writer
 * side, acquire load / relaxed copy / acquire fence / relaxed reload on the
 * reader side.
 */
#include "store/local_layout.h"
#include "tier/statsfile.h"
#include "base/clock.h"
#include "base/error.h"
#include "base/io.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdatomic.h>
#include <stddef.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* The layout of the 64-byte header (docs/FORMAT.md). */
#define OFF_MAGIC 0
#define OFF_VERSION 8  /* u32 */
#define OFF_NSLOTS 12  /* u32 */
#define OFF_PID 16     /* i64 */
#define OFF_STATE 24   /* u32 */
#define OFF_SEQ 32     /* u64 */
#define OFF_STARTED 40 /* f64 bits */
#define OFF_UPDATED 48 /* f64 bits */

#define NSLOTS (sizeof(kvt_stats) / 8)
_Static_assert(sizeof(kvt_stats) % 8 == 0, "kvt_stats is made of 8-byte words");
_Static_assert(KVTI_STATSFILE_HEADER + NSLOTS * 8 <= KVTI_STATSFILE_SIZE,
               "kvt_stats fits in stats.bin");
_Static_assert(ATOMIC_LLONG_LOCK_FREE == 2, "8-byte atomics are lock-free");

struct kvti_statsfile {
  unsigned char *map;
  double started;
};

typedef _Atomic uint64_t au64;
typedef _Atomic uint32_t au32;

static au64 *w64(unsigned char *m, size_t off) {
  return (au64 *)(void *)(m + off);
}
static au32 *w32(unsigned char *m, size_t off) {
  return (au32 *)(void *)(m + off);
}
static uint64_t dbits(double d) {
  uint64_t u;
  memcpy(&u, &d, 8);
  return u;
}
static double bitsd(uint64_t u) {
  double d;
  memcpy(&d, &u, 8);
  return d;
}
static char *stats_path(const char *dir) {
  return kvti_local_path(dir, KVTI_LOCAL_STATS); /* the layout's name */
}

int kvti_statsfile_open(kvti_statsfile **out, const char *dir, mode_t mode,
                        const kvt_stats *s) {
  *out = NULL;
  char *p = stats_path(dir);
  if (!p)
    return KVT_ENOMEM;
  /* O_NONBLOCK: a FIFO planted in the directory must not block the open. */
  int fd = kvti_open(p, O_RDWR | O_CREAT | O_NONBLOCK, mode);
  if (fd < 0) {
    kvti_free(p);
    return fd;
  }
  int rc = 0;
  struct stat st;
  if (kvti_io->fstat(fd, &st) != 0)
    rc = KVT_ERR_OS(errno, "stat %s", p);
  else if (!S_ISREG(st.st_mode))
    rc = KVT_ERR(KVT_EIO, "%s is not a regular file", p);
  /* Never shrunk below the mapped size: a reader may have it mapped. */
  else if (st.st_size != KVTI_STATSFILE_SIZE &&
           kvti_io->ftruncate(fd, KVTI_STATSFILE_SIZE) != 0)
    rc = KVT_ERR_OS(errno, "resize %s", p);
  void *m = MAP_FAILED;
  if (rc == 0) {
    m = mmap(NULL, KVTI_STATSFILE_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
             0);
    if (m == MAP_FAILED)
      rc = KVT_ERR_OS(errno, "mmap %s", p);
  }
  kvti_io->close(fd); /* the mapping stays valid */
  kvti_free(p);
  if (rc)
    return rc;
  kvti_statsfile *f = kvti_calloc(1, sizeof *f);
  if (!f) {
    munmap(m, KVTI_STATSFILE_SIZE);
    return KVT_ERR_NOMEM();
  }
  f->map = m;
  f->started = kvti_now_wall();
  /* Taking the file over: the sequence goes odd first, so a reader never
   * mixes the previous owner's words with ours; then the header. */
  au64 *seq = w64(f->map, OFF_SEQ);
  uint64_t q = atomic_load_explicit(seq, memory_order_relaxed);
  atomic_store_explicit(seq, q | 1u, memory_order_relaxed);
  atomic_thread_fence(memory_order_release);
  for (size_t i = 0; i < 8; i++)
    atomic_store_explicit((_Atomic unsigned char *)(f->map + OFF_MAGIC + i),
                          (unsigned char)KVTI_STATSFILE_MAGIC[i],
                          memory_order_relaxed);
  atomic_store_explicit(w32(f->map, OFF_STATE + 4), 0, memory_order_relaxed);
  atomic_store_explicit(w64(f->map, OFF_UPDATED + 8), 0, memory_order_relaxed);
  atomic_store_explicit(w32(f->map, OFF_VERSION), KVTI_STATSFILE_VERSION,
                        memory_order_relaxed);
  atomic_store_explicit(w32(f->map, OFF_NSLOTS), (uint32_t)NSLOTS,
                        memory_order_relaxed);
  atomic_store_explicit(w64(f->map, OFF_PID), (uint64_t)getpid(),
                        memory_order_relaxed);
  atomic_store_explicit(w64(f->map, OFF_STARTED), dbits(f->started),
                        memory_order_relaxed);
  atomic_store_explicit(w32(f->map, OFF_STATE), KVTI_STATSFILE_OPEN,
                        memory_order_relaxed);
  atomic_store_explicit(seq, (q | 1u) + 1u, memory_order_release);
  kvti_statsfile_publish(f, s);
  *out = f;
  return 0;
}

void kvti_statsfile_publish(kvti_statsfile *f, const kvt_stats *s) {
  if (!f)
    return;
  uint64_t words[NSLOTS];
  memcpy(words, s, sizeof words);
  au64 *seq = w64(f->map, OFF_SEQ);
  uint64_t q = atomic_load_explicit(seq, memory_order_relaxed);
  atomic_store_explicit(seq, q + 1u, memory_order_relaxed);
  atomic_thread_fence(memory_order_release);
  for (size_t i = 0; i < NSLOTS; i++)
    atomic_store_explicit(w64(f->map, KVTI_STATSFILE_HEADER + 8 * i), words[i],
                          memory_order_relaxed);
  atomic_store_explicit(w64(f->map, OFF_UPDATED), dbits(kvti_now_wall()),
                        memory_order_relaxed);
  atomic_store_explicit(seq, q + 2u, memory_order_release);
}

void kvti_statsfile_close(kvti_statsfile *f, const kvt_stats *s) {
  if (!f)
    return;
  kvti_statsfile_publish(f, s);
  au64 *seq = w64(f->map, OFF_SEQ);
  uint64_t q = atomic_load_explicit(seq, memory_order_relaxed);
  atomic_store_explicit(seq, q + 1u, memory_order_relaxed);
  atomic_thread_fence(memory_order_release);
  atomic_store_explicit(w32(f->map, OFF_STATE), KVTI_STATSFILE_CLOSED,
                        memory_order_relaxed);
  atomic_store_explicit(seq, q + 2u, memory_order_release);
  munmap(f->map, KVTI_STATSFILE_SIZE);
  kvti_free(f);
}

/* ---- reading ------------------------------------------------------------ */

static int pid_running(int64_t pid) {
  if (pid <= 0 || (int64_t)(pid_t)pid != pid)
    return 0;
  return kill((pid_t)pid, 0) == 0 || errno == EPERM;
}

int kvt_stats_read_live(kvt_stats *out, kvt_stats_live *live,
                        const char *cache_dir) {
  if (!cache_dir)
    return KVT_ERR(KVT_EINVAL, "kvt_stats_read_live: cache_dir is NULL");
  char *p = stats_path(cache_dir);
  if (!p)
    return KVT_ENOMEM;
  int fd = kvti_open(p, O_RDONLY | O_NONBLOCK, 0); /* never waits on a FIFO */
  if (fd < 0) {
    int rc =
        fd == KVT_ENOTFOUND
            ? KVT_ERR(KVT_ENOTFOUND,
                      "%s: no live stats (no writer has opened it)", cache_dir)
            : fd;
    kvti_free(p);
    return rc;
  }
  int rc = 0;
  struct stat st;
  void *m = MAP_FAILED;
  if (kvti_io->fstat(fd, &st) != 0)
    rc = KVT_ERR_OS(errno, "stat %s", p);
  else if (!S_ISREG(st.st_mode) || st.st_size != KVTI_STATSFILE_SIZE)
    rc = KVT_ERR(KVT_ECORRUPT, "%s: not a kvtier stats file (%lld bytes)", p,
                 (long long)st.st_size);
  else if ((m = mmap(NULL, KVTI_STATSFILE_SIZE, PROT_READ, MAP_SHARED, fd,
                     0)) == MAP_FAILED)
    rc = KVT_ERR_OS(errno, "mmap %s", p);
  kvti_io->close(fd);
  if (rc) {
    kvti_free(p);
    return rc;
  }
  unsigned char *map = m;
  uint64_t words[NSLOTS];
  uint64_t pid = 0, started = 0, updated = 0;
  uint32_t version = 0, nslots = 0, state = 0;
  char magic[8];
  /* Bounded: a writer killed mid-update leaves the sequence odd forever;
   * after the retries the last copy is used (its writer is gone). */
  for (int tries = 0;; tries++) {
    au64 *seq = w64(map, OFF_SEQ);
    uint64_t s1 = atomic_load_explicit(seq, memory_order_acquire);
    for (size_t i = 0; i < 8; i++)
      magic[i] = (char)atomic_load_explicit(
          (_Atomic unsigned char *)(map + OFF_MAGIC + i), memory_order_relaxed);
    version = atomic_load_explicit(w32(map, OFF_VERSION), memory_order_relaxed);
    nslots = atomic_load_explicit(w32(map, OFF_NSLOTS), memory_order_relaxed);
    state = atomic_load_explicit(w32(map, OFF_STATE), memory_order_relaxed);
    pid = atomic_load_explicit(w64(map, OFF_PID), memory_order_relaxed);
    started = atomic_load_explicit(w64(map, OFF_STARTED), memory_order_relaxed);
    updated = atomic_load_explicit(w64(map, OFF_UPDATED), memory_order_relaxed);
    for (size_t i = 0; i < NSLOTS; i++)
      words[i] =
          i < nslots
              ? atomic_load_explicit(w64(map, KVTI_STATSFILE_HEADER + 8 * i),
                                     memory_order_relaxed)
              : 0;
    atomic_thread_fence(memory_order_acquire);
    uint64_t s2 = atomic_load_explicit(seq, memory_order_relaxed);
    if ((s1 == s2 && !(s1 & 1u)) || tries >= 2000)
      break;
    if (tries >= 100) {
      struct timespec ts = {0, 100000}; /* 0.1 ms */
      nanosleep(&ts, NULL);
    }
  }
  munmap(m, KVTI_STATSFILE_SIZE);
  if (memcmp(magic, KVTI_STATSFILE_MAGIC, 8) != 0) {
    rc = KVT_ERR(KVT_ECORRUPT, "%s: not a kvtier stats file (bad magic)", p);
  } else if (version != KVTI_STATSFILE_VERSION ||
             (uint64_t)nslots * 8 + KVTI_STATSFILE_HEADER >
                 KVTI_STATSFILE_SIZE) {
    rc = KVT_ERR(KVT_ECORRUPT, "%s: unknown stats file layout %u (%u words)", p,
                 version, nslots);
  }
  kvti_free(p);
  if (rc)
    return rc;
  if (out) {
    memcpy(out, words, sizeof *out);
    out->version = KVT_STATS_VERSION; /* word 0 carries no data (0) */
    out->reserved = 0;
  }
  if (live) {
    live->pid = (int64_t)pid;
    live->alive =
        state == KVTI_STATSFILE_OPEN && pid_running((int64_t)pid) ? 1 : 0;
    live->started_at = bitsd(started);
    live->updated_at = bitsd(updated);
  }
  return 0;
}
