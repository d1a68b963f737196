/*
 * entry_par.c - kvti_entry_read: one entry read with its layer files read in
 * parallel (the caller plus helper threads, each taking the next unread
 * layer), on_layer reported in layer order for the completed prefix, and the
 * retry when the entry directory was replaced during the read.
 */
#include "format/entry_int.h"
#include "base/error.h"
#include "base/io.h"
#include "format/layout.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Layers are independent files: up to READ_THREADS threads (the caller plus
 * helpers) each take the next unread layer and read it straight into its final
 * buffers, verifying it. A warm read is a copy out of the page cache plus a
 * hash, both CPU-bound, so this is what lets a warm promote go beyond one
 * core's copy speed; a cold one gets more I/O in flight. on_layer runs in layer
 * order for the completed prefix, from whichever reading thread completed it,
 * never concurrently; after a cancel no further layer is reported. */
#define READ_THREADS 2
#define MAX_READ_THREADS KVTI_MAX_READ_THREADS

/* Threads per entry read: READ_THREADS, or KVT_READ_THREADS from the
 * environment (1..8; read once) for tuning on machines with more cores or
 * slower disks. */
unsigned kvti_entry_read_threads(void) {
  static int cached = 0; /* benign race: every thread computes the same value */
  int v = __atomic_load_n(&cached, __ATOMIC_RELAXED);
  if (v == 0) {
    v = READ_THREADS;
    const char *env = getenv("KVT_READ_THREADS");
    if (env && *env) {
      int e = atoi(env);
      if (e >= 1 && e <= MAX_READ_THREADS)
        v = e;
    }
    __atomic_store_n(&cached, v, __ATOMIC_RELAXED);
  }
  return (unsigned)v;
}

typedef struct rd_job {
  pthread_mutex_t mu;
  kvti_entry_reader *r;
  const kvti_read_opts *o;
  const char *hash;
  uint32_t next, delivered;
  unsigned char
      *done; /* under mu (the reader's own flags are written outside it) */
  int reported;
  int rc, os_errno;
  char msg[512];
} rd_job;

static void *rd_worker(void *arg) {
  rd_job *j = arg;
  const kvti_read_opts *o = j->o;
  uint32_t n = j->r->m.num_layers;
  for (;;) {
    pthread_mutex_lock(&j->mu);
    uint32_t i = j->next;
    int stop = j->rc != 0 || i >= n;
    if (!stop)
      j->next++;
    pthread_mutex_unlock(&j->mu);
    if (stop)
      return NULL;
    int rc = 0;
    if (o->cancel && atomic_load(o->cancel))
      rc = KVT_ERR(KVT_ECANCELED, "read of %.12s... cancelled", j->hash);
    else
      rc = kvti_entry_reader_read_layer(j->r, i, NULL);
    pthread_mutex_lock(&j->mu);
    if (rc) {
      if (j->rc == 0) {
        j->rc = rc;
        j->os_errno = kvt_last_errno();
        snprintf(j->msg, sizeof j->msg, "%s", kvt_last_error());
      }
    } else {
      j->done[i] = 1;
      while (j->rc == 0 && j->delivered < n && j->done[j->delivered]) {
        if (o->cancel && atomic_load(o->cancel)) {
          j->rc = KVT_ECANCELED;
          j->os_errno = 0;
          snprintf(j->msg, sizeof j->msg, "read of %.12s... cancelled",
                   j->hash);
          break;
        }
        if (o->on_layer && !o->verify_only) {
          o->on_layer(o->layer_ctx, j->delivered,
                      &j->r->e->layers[j->delivered]);
          j->reported = 1;
        }
        j->delivered++;
      }
    }
    pthread_mutex_unlock(&j->mu);
  }
}

/* Starts reading the head of every layer file (its safetensors header) into
 * the page cache at once, asynchronously (fadvise WILLNEED). Each layer read
 * begins with a small synchronous header read; on a busy disk it waits behind
 * the other reader thread's megabytes in flight (measured: 5.9 ms on average,
 * up to 18 ms, per 16 MiB layer file, time in which that thread had nothing in
 * flight). Prefetched together, the headers are in memory by the time each
 * thread reaches them. Best effort: nothing here can fail the read. */
#define HEADER_PREFETCH ((off_t)64 << 10)
static void prefetch_headers(const kvti_entry_reader *r) {
  if (!kvti_io->fadvise)
    return;
  for (uint32_t i = 0; i < r->m.num_layers; i++) {
    char name[KVTI_LAYER_FILE_MAX];
    kvti_layer_file_name(name, i);
    char *lp = kvti_path_join(r->m.dir, name);
    int fd = lp ? kvti_io->open(lp, O_RDONLY | O_NOFOLLOW | O_CLOEXEC, 0) : -1;
    if (fd >= 0) {
      kvti_io->fadvise(fd, 0, HEADER_PREFETCH, POSIX_FADV_WILLNEED);
      kvti_io->close(fd);
    }
    kvti_free(lp);
  }
}

static int read_layers(kvti_entry_reader *r, const kvti_read_opts *o,
                       const char *hash, int *reported) {
  rd_job j;
  memset(&j, 0, sizeof j);
  j.r = r;
  j.o = o;
  j.hash = hash;
  j.done = kvti_calloc(r->m.num_layers ? r->m.num_layers : 1, 1);
  if (!j.done)
    return KVT_ERR_NOMEM();
  pthread_mutex_init(&j.mu, NULL);
  unsigned nthreads =
      r->m.num_layers < 4 ? 1
      : o->read_threads >= 1 && o->read_threads <= MAX_READ_THREADS
          ? o->read_threads
          : kvti_entry_read_threads();
  if (nthreads > 1 && !o->verify_only)
    prefetch_headers(r);
  pthread_t th[MAX_READ_THREADS];
  unsigned started = 0;
  for (unsigned t = 1; t < nthreads; t++)
    if (pthread_create(&th[started], NULL, rd_worker, &j) == 0)
      started++;
  rd_worker(&j);
  for (unsigned t = 0; t < started; t++)
    pthread_join(th[t], NULL);
  pthread_mutex_destroy(&j.mu);
  kvti_free(j.done);
  *reported = j.reported;
  if (j.rc)
    return kvti_error_restore(j.rc, j.os_errno, j.msg);
  return 0;
}

/* The entry directory may be replaced (a re-spill of the same tokens swaps in a
 * new version) or removed (eviction) while it is read: files would then come
 * from two versions. The directory's identity is compared before and after; a
 * read that saw a replacement is retried (when no layer has been reported
 * through on_layer yet) instead of being mistaken for corruption, and one that
 * saw a removal reports KVT_ENOTFOUND. */
int kvti_entry_read(kvt_entry **out, const char *data_dir, const char *hash,
                    const kvti_read_opts *o) {
  static const kvti_read_opts none = {0};
  if (!o)
    o = &none;
  if (!out && !o->verify_only)
    return KVT_ERR(KVT_EINVAL, "entry read: NULL out");
  for (int attempt = 0;; attempt++) {
    kvti_dir_id id = {0};
    int reported = 0;
    kvti_entry_reader *r = NULL;
    kvt_entry *e = NULL;
    int rc = kvti_entry_reader_open_id(&r, data_dir, hash, o, &id);
    if (rc == 0)
      rc = read_layers(r, o, hash, &reported);
    if (rc == 0)
      rc = kvti_entry_reader_finish(&e, r);
    kvti_entry_reader_free(r);
    if (rc == 0) {
      if (out)
        *out = e;
      return 0;
    }
    if (rc != KVT_ECORRUPT && rc != KVT_ENOTFOUND && rc != KVT_EAGAIN)
      return rc;
    if (!id.known)
      return rc; /* no entry directory (or a bad name): nothing to compare */
    char *dir = kvti_path_join(data_dir, hash);
    if (!dir)
      return KVT_ENOMEM;
    int state = kvti_entry_dir_state(dir, &id);
    kvti_free(dir);
    if (state == 0)
      return rc; /* genuine: the same directory throughout */
    if (state == 2)
      return KVT_ERR(KVT_ENOTFOUND, "entry %.12s... was removed while read",
                     hash);
    if (reported || attempt >= 2)
      return KVT_ERR(KVT_EAGAIN,
                     "entry %.12s... was replaced while read; retry", hash);
  }
}
