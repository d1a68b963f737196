/*
 * test_workq.c - unit tests for the queue-with-worker primitive (base/workq.h)
 * behind the tier's writer, promote pool and remote uploader: FIFO order with
 * one worker, the bounds by item count and by bytes (overflow included),
 * close refusing pushes while queued items still run, wait's flush semantics
 * (only items pushed before the call; pending reported when no worker runs;
 * ETIMEDOUT at the deadline), stop with and without drop (queued items dropped
 * through the drop callback, never run; every item counted done), start on
 * first push, several workers each running every item exactly once, the
 * periodic tick, and destroy of a never-initialised queue.
 */
#include "testutil.h"
#include "base/clock.h"
#include "base/workq.h"

#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>

#define MAXN 256

typedef struct job {
  kvti_workq_item link; /* first */
  int id;
} job;

typedef struct rec {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int ran[MAXN], n_ran; /* ids in run order */
  int dropped[MAXN], n_dropped;
  int runs[MAXN]; /* per id: times run */
  int gate;       /* run blocks while id >= gate */
  int running;    /* an item is inside run */
  atomic_int ticks;
} rec;

static job jobs[MAXN];

static void reset_jobs(void) {
  memset(jobs, 0, sizeof jobs);
  for (int i = 0; i < MAXN; i++)
    jobs[i].id = i;
}

/* Fresh records and jobs; run blocks items with id >= gate. */
static void rec_init(rec *r, int gate) {
  reset_jobs();
  memset(r, 0, sizeof *r);
  pthread_mutex_init(&r->mu, NULL);
  pthread_cond_init(&r->cv, NULL);
  r->gate = gate;
}

static void rec_free(rec *r) {
  pthread_mutex_destroy(&r->mu);
  pthread_cond_destroy(&r->cv);
}

static void set_gate(rec *r, int gate) {
  pthread_mutex_lock(&r->mu);
  r->gate = gate;
  pthread_cond_broadcast(&r->cv);
  pthread_mutex_unlock(&r->mu);
}

/* Waits (bounded) until run has entered for an item. */
static int wait_running(rec *r) {
  for (int i = 0; i < 5000; i++) {
    pthread_mutex_lock(&r->mu);
    int x = r->running;
    pthread_mutex_unlock(&r->mu);
    if (x)
      return 1;
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
  return 0;
}

static void run_fn(void *ctx, kvti_workq_item *it) {
  rec *r = ctx;
  job *j = (job *)it;
  pthread_mutex_lock(&r->mu);
  r->running = 1;
  pthread_cond_broadcast(&r->cv);
  while (j->id >= r->gate)
    pthread_cond_wait(&r->cv, &r->mu);
  if (r->n_ran < MAXN)
    r->ran[r->n_ran++] = j->id;
  r->runs[j->id]++;
  r->running = 0;
  pthread_mutex_unlock(&r->mu);
}

static void drop_fn(void *ctx, kvti_workq_item *it) {
  rec *r = ctx;
  job *j = (job *)it;
  pthread_mutex_lock(&r->mu);
  if (r->n_dropped < MAXN)
    r->dropped[r->n_dropped++] = j->id;
  pthread_mutex_unlock(&r->mu);
}

static void tick_fn(void *ctx) {
  rec *r = ctx;
  atomic_fetch_add(&r->ticks, 1);
}

static kvti_workq_cfg cfg_for(rec *r, uint32_t threads, uint64_t max_items,
                              uint64_t max_bytes) {
  kvti_workq_cfg c;
  memset(&c, 0, sizeof c);
  c.threads = threads;
  c.max_items = max_items;
  c.max_bytes = max_bytes;
  c.run = run_fn;
  c.drop = drop_fn;
  c.ctx = r;
  c.name = "test";
  return c;
}

static uint64_t wait_all(kvti_workq *q) {
  uint64_t pending = 99;
  CHECK_EQ_INT(kvti_workq_wait(q, NULL, 0, &pending), 0);
  return pending;
}

static void test_fifo(void) {
  rec r;
  rec_init(&r, MAXN);
  kvti_workq q;
  kvti_workq_cfg c = cfg_for(&r, 1, 0, 0);
  REQUIRE(kvti_workq_init(&q, &c) == 0);
  for (int i = 0; i < 50; i++)
    CHECK_EQ_INT(kvti_workq_push(&q, &jobs[i].link, 1), 0);
  /* Not started: nothing runs, wait reports what nobody can finish. */
  CHECK_EQ_INT(kvti_workq_started(&q), 0);
  CHECK_EQ_INT(wait_all(&q), 50);
  uint64_t depth = 0, bytes = 0;
  kvti_workq_gauges(&q, &depth, &bytes);
  CHECK_EQ_INT(depth, 50);
  CHECK_EQ_INT(bytes, 50);
  CHECK_EQ_INT(kvti_workq_start(&q), 0);
  CHECK_EQ_INT(kvti_workq_start(&q), 0); /* idempotent */
  CHECK_EQ_INT(kvti_workq_started(&q), 1);
  CHECK_EQ_INT(wait_all(&q), 0);
  CHECK_EQ_INT(r.n_ran, 50);
  for (int i = 0; i < r.n_ran; i++)
    CHECK_EQ_INT(r.ran[i], i);
  CHECK_EQ_INT(q.enq_seq, 50);
  CHECK_EQ_INT(q.done_seq, 50);
  kvti_workq_gauges(&q, &depth, &bytes);
  CHECK_EQ_INT(depth, 0);
  CHECK_EQ_INT(bytes, 0);
  kvti_workq_stop(&q, 0);
  CHECK_EQ_INT(kvti_workq_started(&q), 0);
  CHECK_EQ_INT(kvti_workq_start(&q), 0); /* stopped: stays stopped */
  CHECK_EQ_INT(kvti_workq_started(&q), 0);
  CHECK_EQ_INT(kvti_workq_push(&q, &jobs[60].link, 1), KVT_ECLOSED);
  CHECK_EQ_INT(r.n_dropped, 0);
  kvti_workq_destroy(&q);
  rec_free(&r);
}

static void test_bounds(void) {
  rec r;
  rec_init(&r, MAXN);
  kvti_workq q;
  kvti_workq_cfg c = cfg_for(&r, 1, 3, 0);
  REQUIRE(kvti_workq_init(&q, &c) == 0);
  for (int i = 0; i < 3; i++) {
    CHECK_EQ_INT(kvti_workq_check(&q, 1000), 0);
    CHECK_EQ_INT(kvti_workq_push(&q, &jobs[i].link, 1000), 0);
  }
  CHECK_EQ_INT(kvti_workq_check(&q, 0), KVT_EFULL);
  CHECK_EQ_INT(kvti_workq_push(&q, &jobs[3].link, 0), KVT_EFULL);
  kvti_workq_stop(&q, 1); /* never started: all three dropped here */
  CHECK_EQ_INT(r.n_dropped, 3);
  CHECK_EQ_INT(r.n_ran, 0);
  CHECK_EQ_INT(q.done_seq, 3);
  kvti_workq_destroy(&q);

  /* By bytes: 60 + 50 > 100 is refused, 60 + 40 fits exactly. */
  c = cfg_for(&r, 1, 0, 100);
  r.n_dropped = 0;
  REQUIRE(kvti_workq_init(&q, &c) == 0);
  CHECK_EQ_INT(kvti_workq_push(&q, &jobs[0].link, 60), 0);
  CHECK_EQ_INT(kvti_workq_check(&q, 50), KVT_EFULL);
  CHECK_EQ_INT(kvti_workq_push(&q, &jobs[1].link, 50), KVT_EFULL);
  CHECK_EQ_INT(kvti_workq_push(&q, &jobs[1].link, 40), 0);
  CHECK_EQ_INT(kvti_workq_push(&q, &jobs[2].link, 0), 0);
  CHECK_EQ_INT(kvti_workq_push(&q, &jobs[3].link, 1), KVT_EFULL);
  CHECK_EQ_INT(kvti_workq_push(&q, &jobs[3].link, UINT64_MAX), KVT_EFULL);
  uint64_t depth = 0, bytes = 0;
  kvti_workq_gauges(&q, &depth, &bytes);
  CHECK_EQ_INT(depth, 3);
  CHECK_EQ_INT(bytes, 100);
  /* Running frees the budget again. */
  CHECK_EQ_INT(kvti_workq_start(&q), 0);
  CHECK_EQ_INT(wait_all(&q), 0);
  CHECK_EQ_INT(kvti_workq_push(&q, &jobs[3].link, 100), 0);
  kvti_workq_stop(&q, 0); /* not dropped: runs */
  CHECK_EQ_INT(r.n_ran, 4);
  CHECK_EQ_INT(r.n_dropped, 0);
  kvti_workq_destroy(&q);
  rec_free(&r);
}

typedef struct waiter {
  kvti_workq *q;
  uint64_t pending;
  int rc;
  atomic_int done;
} waiter;

static void *waiter_main(void *arg) {
  waiter *w = arg;
  w->rc = kvti_workq_wait(w->q, NULL, 0, &w->pending);
  atomic_store(&w->done, 1);
  return NULL;
}

static void test_wait_semantics(void) {
  rec r;
  rec_init(&r, 0); /* everything blocks */
  kvti_workq q;
  kvti_workq_cfg c = cfg_for(&r, 1, 0, 0);
  REQUIRE(kvti_workq_init(&q, &c) == 0);
  REQUIRE(kvti_workq_start(&q) == 0);
  for (int i = 0; i < 3; i++)
    CHECK_EQ_INT(kvti_workq_push(&q, &jobs[i].link, 1), 0);
  REQUIRE(wait_running(&r));
  /* Deadline: item 0 is stuck in run. */
  struct timespec ts;
  int has;
  kvti_deadline(&ts, &has, 30);
  uint64_t pending = 0;
  CHECK_EQ_INT(kvti_workq_wait(&q, &ts, has, &pending), KVT_ETIMEDOUT);
  CHECK_EQ_INT(pending, 3);
  /* A waiter now targets items 0..2 only; later pushes do not hold it up. */
  waiter w = {&q, 99, -1, 0};
  pthread_t th;
  REQUIRE(pthread_create(&th, NULL, waiter_main, &w) == 0);
  /* Give the waiter time to take its target (it blocks on item 0 anyway). */
  struct timespec nap = {0, 100000000};
  nanosleep(&nap, NULL);
  CHECK_EQ_INT(atomic_load(&w.done), 0);
  for (int i = 3; i < 6; i++)
    CHECK_EQ_INT(kvti_workq_push(&q, &jobs[i].link, 1), 0);
  set_gate(&r, 3); /* 0..2 may finish, 3.. stay blocked */
  double until = kvti_now_mono() + 10;
  while (!atomic_load(&w.done) && kvti_now_mono() < until)
    nanosleep(&(struct timespec){0, 1000000}, NULL);
  CHECK_EQ_INT(atomic_load(&w.done), 1); /* not held up by items 3..5 */
  pthread_mutex_lock(&r.mu);
  CHECK_EQ_INT(r.n_ran, 3);
  pthread_mutex_unlock(&r.mu);
  /* Close: refused from now on, but what is queued still runs. */
  kvti_workq_close(&q);
  CHECK_EQ_INT(kvti_workq_check(&q, 1), KVT_ECLOSED);
  CHECK_EQ_INT(kvti_workq_push(&q, &jobs[7].link, 1), KVT_ECLOSED);
  set_gate(&r, MAXN);
  pthread_join(th, NULL);
  CHECK_EQ_INT(w.rc, 0);
  CHECK_EQ_INT(w.pending, 0);
  CHECK_EQ_INT(wait_all(&q), 0);
  CHECK_EQ_INT(r.n_ran, 6);
  for (int i = 0; i < 6; i++)
    CHECK_EQ_INT(r.ran[i], i);
  kvti_workq_destroy(&q); /* stops */
  CHECK_EQ_INT(r.n_dropped, 0);
  rec_free(&r);
}

typedef struct stopper {
  kvti_workq *q;
  int drop;
} stopper;

static void *stopper_main(void *arg) {
  stopper *s = arg;
  kvti_workq_stop(s->q, s->drop);
  return NULL;
}

static void test_stop_drop(void) {
  for (int drop = 0; drop <= 1; drop++) {
    rec r;
    rec_init(&r, 0); /* item 0 blocks in run */
    kvti_workq q;
    kvti_workq_cfg c = cfg_for(&r, 1, 0, 0);
    c.start_on_push = 1;
    REQUIRE(kvti_workq_init(&q, &c) == 0);
    CHECK_EQ_INT(kvti_workq_started(&q), 0);
    for (int i = 0; i < 5; i++)
      CHECK_EQ_INT(kvti_workq_push(&q, &jobs[i].link, 1), 0);
    CHECK_EQ_INT(kvti_workq_started(&q), 1); /* started by the first push */
    REQUIRE(wait_running(&r));
    stopper s = {&q, drop};
    pthread_t th;
    REQUIRE(pthread_create(&th, NULL, stopper_main, &s) == 0);
    /* Release item 0 only once stop has set its flags (it then joins). */
    for (int stopped = 0; !stopped;) {
      pthread_mutex_lock(&q.mu);
      stopped = q.stop;
      pthread_mutex_unlock(&q.mu);
      nanosleep(&(struct timespec){0, 1000000}, NULL);
    }
    set_gate(&r, MAXN);
    pthread_join(th, NULL);
    /* Item 0 was running: it completes either way. */
    CHECK(r.n_ran >= 1 && r.ran[0] == 0);
    if (drop) {
      CHECK_EQ_INT(r.n_ran, 1);
      CHECK_EQ_INT(r.n_dropped, 4);
      for (int i = 0; i < r.n_dropped; i++)
        CHECK_EQ_INT(r.dropped[i], i + 1);
    } else {
      CHECK_EQ_INT(r.n_ran, 5);
      CHECK_EQ_INT(r.n_dropped, 0);
    }
    for (int i = 0; i < 5; i++)
      CHECK_EQ_INT(r.runs[i] + (drop && i > 0 ? 1 : 0), 1);
    CHECK_EQ_INT(q.enq_seq, 5);
    CHECK_EQ_INT(q.done_seq, 5);
    CHECK_EQ_INT(kvti_workq_push(&q, &jobs[9].link, 1), KVT_ECLOSED);
    kvti_workq_destroy(&q);
    rec_free(&r);
  }
}

static void test_many_workers(void) {
  rec r;
  rec_init(&r, MAXN);
  kvti_workq q;
  kvti_workq_cfg c = cfg_for(&r, 4, 0, 0);
  c.start_on_push = 1;
  REQUIRE(kvti_workq_init(&q, &c) == 0);
  for (int i = 0; i < 200; i++)
    CHECK_EQ_INT(kvti_workq_push(&q, &jobs[i].link, 0), 0);
  CHECK_EQ_INT(q.n_threads, 4);
  CHECK_EQ_INT(wait_all(&q), 0);
  kvti_workq_stop(&q, 0);
  CHECK_EQ_INT(r.n_ran, 200);
  for (int i = 0; i < 200; i++)
    CHECK_EQ_INT(r.runs[i], 1);
  kvti_workq_destroy(&q);
  rec_free(&r);
}

static void test_tick(void) {
  rec r;
  rec_init(&r, MAXN);
  kvti_workq q;
  kvti_workq_cfg c = cfg_for(&r, 1, 0, 0);
  c.tick = tick_fn;
  c.tick_interval = 0.01;
  REQUIRE(kvti_workq_init(&q, &c) == 0);
  REQUIRE(kvti_workq_start(&q) == 0);
  /* Idle worker: ticks keep coming (bounded wait, not a timing claim). */
  double until = kvti_now_mono() + 10;
  while (atomic_load(&r.ticks) < 3 && kvti_now_mono() < until) {
    struct timespec nap = {0, 5000000};
    nanosleep(&nap, NULL);
  }
  CHECK(atomic_load(&r.ticks) >= 3);
  CHECK_EQ_INT(kvti_workq_push(&q, &jobs[0].link, 0), 0);
  CHECK_EQ_INT(wait_all(&q), 0);
  kvti_workq_stop(&q, 0);
  int after = atomic_load(&r.ticks);
  struct timespec nap = {0, 30000000};
  nanosleep(&nap, NULL);
  CHECK_EQ_INT(atomic_load(&r.ticks), after); /* none once stopped */
  kvti_workq_destroy(&q);
  rec_free(&r);
}

static void test_zeroed_destroy(void) {
  kvti_workq q;
  memset(&q, 0, sizeof q);
  kvti_workq_destroy(&q); /* never initialised: no-op */
  kvti_workq_destroy(&q);
  CHECK_EQ_INT(q.inited, 0);
}

int main(void) {
  RUN(test_fifo);
  RUN(test_bounds);
  RUN(test_wait_semantics);
  RUN(test_stop_drop);
  RUN(test_many_workers);
  RUN(test_tick);
  RUN(test_zeroed_destroy);
  return kvt_test_done();
}
