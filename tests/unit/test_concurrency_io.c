/*
 * test_concurrency_io.c - the threaded parts of the I/O layer under contention
 * (run by the TSan job through the `threads` label): several threads sharing
 * one buffer pool (gets and puts of mixed sizes, checking every buffer is
 * exclusively theirs), taking engines from the process-wide engine cache, and
 * running batches - the portable backend with its own worker threads and
 * io_uring when available - on private files, verifying the bytes.
 */
#include "testutil.h"
#include "base/bufpool.h"
#include "base/io.h"
#include "engine/iobatch.h"

#include <fcntl.h>
#include <pthread.h>
#include <string.h>
#include <unistd.h>

#define NTHREADS 4
#define ROUNDS 6

static kvti_bufpool *pool;
static char *dir;
static int failures[NTHREADS];

typedef struct targ {
  int id;
  int backend;
} targ;

static void *worker(void *arg) {
  targ *a = arg;
  kvt_rng rng = {(uint64_t)a->id * 7919u + 1};
  char path[4096];
  snprintf(path, sizeof path, "%s/t%d.bin", dir, a->id);
  int fd = kvti_open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
  int dfd = kvti_iob_open_direct(path, O_RDWR, 0600);
  if (fd < 0) {
    failures[a->id]++;
    return NULL;
  }
  for (int r = 0; r < ROUNDS; r++) {
    size_t n = (size_t)(kvt_rng_next(&rng) % (5u << 20)) + 1;
    char *w = kvti_bufpool_get(pool, n, NULL);
    char *rd = kvti_bufpool_get(pool, n, NULL);
    if (!w || !rd) {
      failures[a->id]++;
      break;
    }
    unsigned char tag = (unsigned char)(a->id * 16 + r);
    memset(w, tag, n);
    kvti_iobatch *b = NULL;
    if (kvti_iobatch_get(&b, a->backend) != 0) {
      failures[a->id]++;
      break;
    }
    kvti_iob_req wq = {fd, dfd, 1, w, n, 0, 0, 0, 0};
    kvti_iob_req rq = {fd, dfd, 0, rd, n, 0, 0, 0, 0};
    if (kvti_iobatch_run(b, &wq, 1, 0, path) != 0 ||
        kvti_iobatch_run(b, &rq, 1, 0, path) != 0)
      failures[a->id]++;
    kvti_iobatch_put(b);
    /* Our buffers were not handed to anyone else meanwhile. */
    for (size_t i = 0; i < n; i += 4093)
      if ((unsigned char)rd[i] != tag || (unsigned char)w[i] != tag) {
        failures[a->id]++;
        break;
      }
    kvti_bufpool_put(pool, rd, n);
    kvti_bufpool_put(pool, w, n);
  }
  close(fd);
  if (dfd >= 0)
    close(dfd);
  return NULL;
}

static void run_threads(int backend) {
  pthread_t th[NTHREADS];
  targ args[NTHREADS];
  for (int i = 0; i < NTHREADS; i++) {
    args[i] = (targ){i, backend};
    REQUIRE(pthread_create(&th[i], NULL, worker, &args[i]) == 0);
  }
  for (int i = 0; i < NTHREADS; i++)
    pthread_join(th[i], NULL);
  for (int i = 0; i < NTHREADS; i++) {
    CHECK_EQ_INT(failures[i], 0);
    failures[i] = 0;
  }
  kvti_bufpool_stats st;
  kvti_bufpool_get_stats(pool, &st);
  CHECK_EQ_INT(st.out_bytes, 0);
  CHECK(st.idle_bytes <= (16u << 20));
}

static void test_portable_threads(void) {
  run_threads(KVT_IO_PORTABLE);
}
static void test_auto_threads(void) {
  run_threads(KVT_IO_AUTO);
}

int main(void) {
  dir = kvt_test_tmpdir("conc-io");
  REQUIRE(dir);
  REQUIRE(kvti_bufpool_create(&pool, 16u << 20) == 0);
  RUN(test_portable_threads);
  RUN(test_auto_threads);
  kvti_bufpool_release(pool);
  kvti_iobatch_cache_drain();
  return kvt_test_done();
}
