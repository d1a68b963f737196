/*
 * clock.c - wall and monotonic seconds, and timed condition-variable waits on
 * the monotonic clock (see clock.h). Every clock read of the library goes
 * through here, so there is one definition of "now" per kind.
 */
#include "base/clock.h"
#include "base/error.h"

#include <errno.h>

static double seconds(clockid_t id) {
  struct timespec ts;
  clock_gettime(id, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

double kvti_now_wall(void) {
  return seconds(CLOCK_REALTIME);
}

double kvti_now_mono(void) {
  return seconds(CLOCK_MONOTONIC);
}

int kvti_cond_init(pthread_cond_t *cv) {
  pthread_condattr_t a;
  if (pthread_condattr_init(&a) != 0)
    return KVT_ERR(KVT_ENOMEM, "pthread_condattr_init failed");
  pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
  int r = pthread_cond_init(cv, &a);
  pthread_condattr_destroy(&a);
  return r == 0 ? 0 : KVT_ERR(KVT_ENOMEM, "pthread_cond_init failed");
}

void kvti_deadline(struct timespec *ts, int *has, int64_t timeout_ms) {
  *has = timeout_ms >= 0;
  if (!*has)
    return;
  clock_gettime(CLOCK_MONOTONIC, ts);
  ts->tv_sec += (time_t)(timeout_ms / 1000);
  ts->tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
  if (ts->tv_nsec >= 1000000000L) {
    ts->tv_sec++;
    ts->tv_nsec -= 1000000000L;
  }
}

int kvti_cond_wait_until(pthread_cond_t *cv, pthread_mutex_t *mu,
                         const struct timespec *ts, int has) {
  if (!has) {
    pthread_cond_wait(cv, mu);
    return 0;
  }
  return pthread_cond_timedwait(cv, mu, ts) == ETIMEDOUT ? ETIMEDOUT : 0;
}
