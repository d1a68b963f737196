/*
 * clock.h - the one clock of kvtier: wall time in Unix seconds (what the index
 * and the remote manifests store as created_at/accessed_at), monotonic seconds
 * (latencies, back-off, sweep intervals), and condition variables that sleep on
 * CLOCK_MONOTONIC until an absolute deadline derived from a timeout in ms, so a
 * wall-clock step never shortens or stretches a timed wait.
 */
#ifndef KVT_CLOCK_H
#define KVT_CLOCK_H

#include <pthread.h>
#include <stdint.h>
#include <time.h>

/* Wall clock (CLOCK_REALTIME) in seconds since the Unix epoch. */
double kvti_now_wall(void);
/* Monotonic clock in seconds (arbitrary origin). */
double kvti_now_mono(void);

/* Initialises cv to wait on CLOCK_MONOTONIC. Returns 0 or KVT_ENOMEM (message
 * set). */
int kvti_cond_init(pthread_cond_t *cv);
/* Absolute monotonic deadline timeout_ms from now into *ts and *has = 1;
 * timeout_ms < 0 means no deadline (*has = 0, *ts untouched). */
void kvti_deadline(struct timespec *ts, int *has, int64_t timeout_ms);
/* pthread_cond_wait (has = 0) or a timed wait until ts on a cv made by
 * kvti_cond_init. Returns 0 (woken, maybe spuriously) or ETIMEDOUT. */
int kvti_cond_wait_until(pthread_cond_t *cv, pthread_mutex_t *mu,
                         const struct timespec *ts, int has);

#endif
