/*
 * parfor.c - kvti_parfor (parfor.h): a mutex-guarded next index shared by the
 * caller and its helper threads, the first failure captured with its message
 * (kvti_error_state) and restored on the caller's thread after the join.
 */
#include "base/parfor.h"
#include "base/error.h"

#include <pthread.h>
#include <string.h>

typedef struct job {
  pthread_mutex_t mu;
  size_t next, n;
  int (*fn)(void *ctx, size_t i);
  void *ctx;
  int failed;
  kvti_error_state err;
} job;

static void *worker(void *arg) {
  job *j = arg;
  for (;;) {
    pthread_mutex_lock(&j->mu);
    size_t i = j->next;
    int stop = j->failed || i >= j->n;
    if (!stop)
      j->next++;
    pthread_mutex_unlock(&j->mu);
    if (stop)
      return NULL;
    int rc = j->fn(j->ctx, i);
    if (rc) {
      pthread_mutex_lock(&j->mu);
      if (!j->failed) {
        j->failed = 1;
        kvti_error_state_capture(&j->err, rc);
      }
      pthread_mutex_unlock(&j->mu);
    }
  }
}

int kvti_parfor(unsigned threads, size_t n, int (*fn)(void *ctx, size_t i),
                void *ctx) {
  job j;
  memset(&j, 0, sizeof j);
  pthread_mutex_init(&j.mu, NULL);
  j.n = n;
  j.fn = fn;
  j.ctx = ctx;
  unsigned nt = threads == 0                ? 1
                : threads > KVTI_PARFOR_MAX ? KVTI_PARFOR_MAX
                                            : threads;
  if (nt > n)
    nt = n ? (unsigned)n : 1;
  pthread_t th[KVTI_PARFOR_MAX];
  unsigned started = 0;
  for (unsigned k = 1; k < nt; k++)
    if (pthread_create(&th[started], NULL, worker, &j) == 0)
      started++; /* fewer helpers still work */
  worker(&j);
  for (unsigned k = 0; k < started; k++)
    pthread_join(th[k], NULL);
  pthread_mutex_destroy(&j.mu);
  return j.failed ? kvti_error_state_restore(&j.err) : 0;
}
