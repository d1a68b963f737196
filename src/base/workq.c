/*
 * workq.c - the FIFO queue with worker threads (see workq.h). One mutex guards
 * the list, the counters and the flags; cv_work wakes workers, cv_done wakes
 * waiters. Workers take the head item, run it with the mutex released, then
 * count it done; dropped items are counted the same way, so done_seq always
 * catches up with enq_seq once the workers have stopped.
 */
#include "base/workq.h"
#include "base/clock.h"
#include "base/error.h"
#include "base/io.h"

#include <errno.h>
#include <string.h>

int kvti_workq_init(kvti_workq *q, const kvti_workq_cfg *cfg) {
  memset(q, 0, sizeof *q);
  q->cfg = *cfg;
  if (q->cfg.threads == 0)
    q->cfg.threads = 1;
  if (!q->cfg.name)
    q->cfg.name = "worker";
  q->accepting = 1;
  q->inited = 1;
  pthread_mutex_init(&q->mu, NULL);
  int rc = kvti_cond_init(&q->cv_work);
  if (rc != 0) {
    pthread_cond_init(&q->cv_work, NULL); /* so destroy is valid */
    pthread_cond_init(&q->cv_done, NULL);
    return rc;
  }
  rc = kvti_cond_init(&q->cv_done);
  if (rc != 0)
    pthread_cond_init(&q->cv_done, NULL);
  return rc;
}

/* Takes the head item off the queue. Caller holds q->mu; the queue is not
 * empty. */
static kvti_workq_item *pop_locked(kvti_workq *q) {
  kvti_workq_item *it = q->head;
  q->head = it->next;
  if (!q->head)
    q->tail = NULL;
  it->next = NULL;
  q->depth--;
  q->bytes -= it->cost;
  return it;
}

/* Drops every queued item: the drop callback runs without the mutex, then the
 * item counts as done. Called and returns with q->mu held. */
static void drop_all_locked(kvti_workq *q) {
  kvti_workq_fn fn = q->cfg.drop ? q->cfg.drop : q->cfg.run;
  while (q->head) {
    kvti_workq_item *it = pop_locked(q);
    pthread_mutex_unlock(&q->mu);
    fn(q->cfg.ctx, it);
    pthread_mutex_lock(&q->mu);
    q->done_seq++;
    pthread_cond_broadcast(&q->cv_done);
  }
}

/* Runs the tick callback without the mutex and returns the next tick time. */
static double tick_unlocked(kvti_workq *q) {
  pthread_mutex_unlock(&q->mu);
  q->cfg.tick(q->cfg.ctx);
  pthread_mutex_lock(&q->mu);
  return kvti_now_mono() + q->cfg.tick_interval;
}

static void *worker_main(void *arg) {
  kvti_workq *q = arg;
  int ticking = q->cfg.tick && q->cfg.tick_interval > 0;
  double next_tick = ticking ? kvti_now_mono() + q->cfg.tick_interval : 0;
  pthread_mutex_lock(&q->mu);
  for (;;) {
    if (q->drop)
      drop_all_locked(q);
    if (!q->head) {
      if (q->stop)
        break;
      if (ticking) {
        double now = kvti_now_mono();
        if (now >= next_tick) {
          next_tick = tick_unlocked(q);
          continue;
        }
        struct timespec ts;
        int has;
        kvti_deadline(&ts, &has, (int64_t)((next_tick - now) * 1000) + 1);
        kvti_cond_wait_until(&q->cv_work, &q->mu, &ts, has);
      } else {
        pthread_cond_wait(&q->cv_work, &q->mu);
      }
      continue;
    }
    kvti_workq_item *it = pop_locked(q);
    pthread_cond_broadcast(&q->cv_done); /* a slot is free (push_last) */
    pthread_mutex_unlock(&q->mu);
    q->cfg.run(q->cfg.ctx, it);
    pthread_mutex_lock(&q->mu);
    q->done_seq += 1 + q->taken; /* with any items its run took along */
    q->taken = 0;
    pthread_cond_broadcast(&q->cv_done);
    if (ticking && kvti_now_mono() >= next_tick)
      next_tick = tick_unlocked(q);
  }
  pthread_cond_broadcast(&q->cv_done);
  pthread_mutex_unlock(&q->mu);
  return NULL;
}

size_t kvti_workq_take_more(kvti_workq *q, kvti_workq_item **out, size_t max,
                            int (*want)(void *ctx, const kvti_workq_item *it),
                            void *ctx) {
  size_t n = 0;
  pthread_mutex_lock(&q->mu);
  /* Items a dropping stop would not run are not taken to be run either. */
  while (n < max && q->head && !q->drop && want(ctx, q->head))
    out[n++] = pop_locked(q);
  q->taken += n;
  if (n)
    pthread_cond_broadcast(&q->cv_done); /* slots are free (push_last) */
  pthread_mutex_unlock(&q->mu);
  return n;
}

/* Caller holds q->mu. */
static int start_locked(kvti_workq *q) {
  if (q->n_threads > 0 || q->stop)
    return 0;
  uint32_t n = q->cfg.threads;
  q->threads = kvti_calloc(n, sizeof *q->threads);
  if (!q->threads)
    return KVT_ERR_NOMEM();
  for (uint32_t i = 0; i < n; i++) {
    int e = pthread_create(&q->threads[i], NULL, worker_main, q);
    if (e != 0) {
      if (q->n_threads > 0)
        break; /* fewer workers still work */
      kvti_free(q->threads);
      q->threads = NULL;
      return KVT_ERR_OS(e, "creating the %s thread", q->cfg.name);
    }
    q->n_threads++;
  }
  return 0;
}

int kvti_workq_start(kvti_workq *q) {
  pthread_mutex_lock(&q->mu);
  int rc = start_locked(q);
  pthread_mutex_unlock(&q->mu);
  return rc;
}

int kvti_workq_started(kvti_workq *q) {
  pthread_mutex_lock(&q->mu);
  int r = q->n_threads > 0;
  pthread_mutex_unlock(&q->mu);
  return r;
}

/* Caller holds q->mu. */
static int check_locked(const kvti_workq *q, uint64_t cost) {
  if (!q->accepting)
    return KVT_ECLOSED;
  if (q->cfg.max_items && q->depth >= q->cfg.max_items)
    return KVT_EFULL;
  if (q->cfg.max_bytes &&
      (q->bytes + cost < q->bytes || q->bytes + cost > q->cfg.max_bytes))
    return KVT_EFULL;
  return 0;
}

int kvti_workq_check(kvti_workq *q, uint64_t cost) {
  pthread_mutex_lock(&q->mu);
  int rc = check_locked(q, cost);
  pthread_mutex_unlock(&q->mu);
  return rc;
}

int kvti_workq_push(kvti_workq *q, kvti_workq_item *it, uint64_t cost) {
  pthread_mutex_lock(&q->mu);
  int rc = check_locked(q, cost);
  if (rc == 0 && q->cfg.start_on_push)
    rc = start_locked(q);
  if (rc == 0) {
    it->next = NULL;
    it->cost = cost;
    if (q->tail)
      q->tail->next = it;
    else
      q->head = it;
    q->tail = it;
    q->depth++;
    q->bytes += cost;
    q->enq_seq++;
    pthread_cond_signal(&q->cv_work);
  }
  pthread_mutex_unlock(&q->mu);
  return rc;
}

int kvti_workq_push_last(kvti_workq *q, kvti_workq_item *it,
                         const struct timespec *ts, int has) {
  int rc = 0;
  pthread_mutex_lock(&q->mu);
  while ((rc = check_locked(q, 0)) == KVT_EFULL) {
    if (kvti_cond_wait_until(&q->cv_done, &q->mu, ts, has) == ETIMEDOUT &&
        (rc = check_locked(q, 0)) == KVT_EFULL) {
      rc = KVT_ETIMEDOUT;
      break;
    }
  }
  if (rc == 0) {
    it->next = NULL;
    it->cost = 0;
    if (q->tail)
      q->tail->next = it;
    else
      q->head = it;
    q->tail = it;
    q->depth++;
    q->enq_seq++;
    q->accepting = 0;
    pthread_cond_signal(&q->cv_work);
  }
  pthread_mutex_unlock(&q->mu);
  return rc;
}

void kvti_workq_close(kvti_workq *q) {
  pthread_mutex_lock(&q->mu);
  q->accepting = 0;
  pthread_mutex_unlock(&q->mu);
}

int kvti_workq_wait(kvti_workq *q, const struct timespec *ts, int has,
                    uint64_t *pending) {
  int rc = 0;
  pthread_mutex_lock(&q->mu);
  uint64_t target = q->enq_seq;
  while (q->done_seq < target && q->n_threads > 0) {
    if (kvti_cond_wait_until(&q->cv_done, &q->mu, ts, has) == ETIMEDOUT &&
        q->done_seq < target) {
      rc = KVT_ETIMEDOUT;
      break;
    }
  }
  if (pending)
    *pending = q->done_seq < target ? target - q->done_seq : 0;
  pthread_mutex_unlock(&q->mu);
  return rc;
}

void kvti_workq_stop(kvti_workq *q, int drop) {
  pthread_mutex_lock(&q->mu);
  q->accepting = 0;
  q->stop = 1;
  if (drop)
    q->drop = 1;
  uint32_t n = q->n_threads;
  pthread_cond_broadcast(&q->cv_work);
  pthread_mutex_unlock(&q->mu);
  /* n_threads stays set while joining: a concurrent wait keeps waiting for
   * the workers' last items rather than returning early. */
  for (uint32_t i = 0; i < n; i++)
    pthread_join(q->threads[i], NULL);
  pthread_mutex_lock(&q->mu);
  if (n > 0) {
    q->n_threads = 0;
    kvti_free(q->threads);
    q->threads = NULL;
  }
  /* No worker ever ran (or none is left): release what is queued. */
  drop_all_locked(q);
  pthread_cond_broadcast(&q->cv_done);
  pthread_mutex_unlock(&q->mu);
}

void kvti_workq_destroy(kvti_workq *q) {
  if (!q->inited)
    return;
  kvti_workq_stop(q, 1);
  pthread_mutex_destroy(&q->mu);
  pthread_cond_destroy(&q->cv_work);
  pthread_cond_destroy(&q->cv_done);
  q->inited = 0;
}

void kvti_workq_gauges(kvti_workq *q, uint64_t *depth, uint64_t *bytes) {
  pthread_mutex_lock(&q->mu);
  if (depth)
    *depth = q->depth;
  if (bytes)
    *bytes = q->bytes;
  pthread_mutex_unlock(&q->mu);
}
