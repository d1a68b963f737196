/*
 * workq.h - a FIFO work queue drained by its own worker thread(s): the one
 * primitive behind the tier's spill writer, its promote pool and its remote
 * uploader. Items are intrusive (a kvti_workq_item embedded in the caller's
 * struct, so queueing allocates nothing) and carry a byte cost. The queue is
 * bounded by item count and by total cost (0 = unbounded); push never blocks:
 * a full queue refuses with KVT_EFULL, a closed one with KVT_ECLOSED.
 *
 * Sequence numbers: enq_seq counts items accepted and done_seq items finished
 * (run or dropped). With one worker, items finish in FIFO order, so "every
 * item pushed before this call is done" is done_seq >= the enq_seq seen at
 * the call (kvti_workq_wait): flush and close build on it.
 *
 * Life: init -> (start, or the first push with start_on_push) -> push... ->
 * close (refuse new items, keep draining) -> wait -> stop (join the workers;
 * with drop, items not yet started are dropped, not run) -> destroy. Callbacks
 * (run, drop, tick) are called without the queue's mutex held, on a worker
 * thread (or on the stopping thread for items never picked up).
 */
#ifndef KVT_WORKQ_H
#define KVT_WORKQ_H

#include <pthread.h>
#include <stdint.h>
#include <time.h>

typedef struct kvti_workq_item {
  struct kvti_workq_item *next;
  uint64_t cost; /* charged against max_bytes while queued */
} kvti_workq_item;

/* Called with an item taken off the queue; it owns the item from then on. */
typedef void (*kvti_workq_fn)(void *ctx, kvti_workq_item *it);

typedef struct kvti_workq_cfg {
  uint32_t threads;   /* workers (>= 1) */
  uint64_t max_items; /* 0: unbounded */
  uint64_t max_bytes; /* 0: unbounded */
  int start_on_push;  /* start the workers at the first push */
  kvti_workq_fn run;  /* does the work */
  kvti_workq_fn drop; /* releases an item that will not run (stop with drop,
                         or never started); NULL: run is called instead */
  /* Optional periodic work (> 0 s): a worker calls tick(ctx) at least every
   * tick_interval seconds while it lives, idle or not. */
  double tick_interval;
  void (*tick)(void *ctx);
  void *ctx;
  const char *name; /* for messages ("writer", "promote worker") */
} kvti_workq_cfg;

typedef struct kvti_workq {
  pthread_mutex_t mu;
  pthread_cond_t cv_work; /* items queued, or stop/drop requested */
  pthread_cond_t cv_done; /* an item was taken or done, or workers exited */
  kvti_workq_item *head, *tail;
  uint64_t depth, bytes;
  uint64_t enq_seq, done_seq;
  int accepting; /* push is allowed */
  int stop;      /* workers exit once the queue is empty */
  int drop;      /* queued items are dropped, not run */
  pthread_t *threads;
  uint32_t n_threads; /* started and not yet joined */
  int inited;         /* init ran (destroy of a zeroed queue is a no-op) */
  uint64_t taken;     /* items the running item's run took with take_more */
  kvti_workq_cfg cfg;
} kvti_workq;

/* 0, or KVT_ENOMEM (message set); the queue is usable for destroy either way.
 */
int kvti_workq_init(kvti_workq *q, const kvti_workq_cfg *cfg);
/* Stops (dropping) if needed and frees what is left. */
void kvti_workq_destroy(kvti_workq *q);

/* Starts the workers if they are not running and the queue is not stopped
 * (idempotent). Starting fewer than cfg.threads is fine; none is an error:
 * 0 or the pthread_create error (message set). */
int kvti_workq_start(kvti_workq *q);
/* 1 when workers are running. */
int kvti_workq_started(kvti_workq *q);

/* Would an item of this cost be accepted now? 0, KVT_ECLOSED or KVT_EFULL
 * (no message set: callers say what was refused). */
int kvti_workq_check(kvti_workq *q, uint64_t cost);
/* Appends it with its cost. 0 (the queue owns it until run/drop), KVT_ECLOSED,
 * KVT_EFULL (no message set for these two), or the error starting the workers
 * under start_on_push (message set). On failure the caller keeps it. */
int kvti_workq_push(kvti_workq *q, kvti_workq_item *it, uint64_t cost);

/* Appends it as the last item (cost 0) once the queue has room for one more
 * item, waiting until the deadline (ts when has; see clock.h), then refuses
 * further pushes, atomically: nothing can be queued behind it. 0 (the queue
 * owns it), KVT_ECLOSED (not accepting), or KVT_ETIMEDOUT (still full; no
 * message set for these two; the caller keeps it and nothing changed). */
int kvti_workq_push_last(kvti_workq *q, kvti_workq_item *it,
                         const struct timespec *ts, int has);

/* Refuses further pushes; queued items still run. */
void kvti_workq_close(kvti_workq *q);
/* Waits until every item pushed before the call is done (deadline ts when has;
 * see clock.h). Returns 0 and *pending = 0; 0 and *pending > 0 when items are
 * queued but no worker is running to finish them; or KVT_ETIMEDOUT (no
 * message set) with *pending the items still outstanding. */
int kvti_workq_wait(kvti_workq *q, const struct timespec *ts, int has,
                    uint64_t *pending);
/* Closes, wakes and joins the workers: they finish the queue first, unless
 * drop, when items not yet started are dropped. Anything still queued
 * afterwards (no worker ever ran) is dropped too. The queue stays stopped. */
void kvti_workq_stop(kvti_workq *q, int drop);

/* From inside run, on a queue with one worker: takes up to max more items
 * off the head, in FIFO order, while want(ctx, item) returns 1 (the first
 * item it refuses stays queued, as does everything behind it), into out[].
 * The caller owns them as it owns the item being run, and they count as
 * done together with it, once run returns: a wait that covers any of them
 * also covers the whole batch. Returns how many were taken. */
size_t kvti_workq_take_more(kvti_workq *q, kvti_workq_item **out, size_t max,
                            int (*want)(void *ctx, const kvti_workq_item *it),
                            void *ctx);
/* Items and bytes queued now (not counting items being run). */
void kvti_workq_gauges(kvti_workq *q, uint64_t *depth, uint64_t *bytes);

#endif
