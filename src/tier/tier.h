/*
 * tier.h - the internal state of a kvt_tier shared by tier.c (lifecycle,
 * lookup, maintenance), writer.c (spill queue + writer thread) and promote.c
 * (promote, worker pool, promises).
 *
 * Threads and locks (full story in docs/DESIGN.md):
 *  - life_mu/life_cv: lifecycle state and the count of operations in flight.
 * Every public call enters (refused with KVT_ECLOSED once the tier is tearing
 * down) and leaves; an async promote stays "in flight" until its worker
 * finishes, so close waits for it.
 *  - mut_mu: serialises every mutation of stored entries (the writer's publish
 * + row insert, eviction, expiry, removal, quarantine, reconcile, gc). Lock
 * order: mut_mu -> stripe -> index internals. Readers never take mut_mu.
 *  - stripes: per-hash rwlocks; readers shared, mutators exclusive (see
 * lock.h).
 *  - writer.mu: the spill queue; pool.mu: the promote job queue; each promise
 * has its own mu. Callbacks into the caller (log_fn, spill_done_fn, budget) are
 * never made with mut_mu or a stripe held, except log_fn, which must not call
 * back into the tier.
 */
#ifndef KVT_TIER_H
#define KVT_TIER_H

#include "index/index.h"
#include "store/backend.h"
#include "kvtier.h"
#include "base/lock.h"
#include "tier/stats.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

typedef struct kvti_spill_item {
  struct kvti_spill_item *next;
  kvti_snapshot *snap;
  uint64_t cost; /* bytes charged against spill_queue_bytes */
} kvti_spill_item;

typedef struct kvti_writer {
  pthread_mutex_t mu;
  pthread_cond_t cv_work; /* items queued, or stop/drop requested */
  pthread_cond_t cv_done; /* done_seq advanced, or the thread exited */
  kvti_spill_item *head, *tail;
  uint64_t depth, bytes;
  uint64_t enq_seq; /* spills ever enqueued */
  uint64_t
      done_seq;  /* spills finished (written, failed or dropped), FIFO order */
  int accepting; /* spills are accepted */
  int started;   /* thread created (and not yet joined) */
  int stop;      /* exit once the queue is empty */
  int drop;      /* discard queued spills (kvt_tier_free) */
  pthread_t thread;
  /* writer_hook.c: a binding's write hook and close's stop marker. */
  kvt_write_hook_fn hook; /* NULL: the C write, no call out */
  void *hook_ctx;
  uint64_t hook_id; /* spill the hook runs for (its done_seq + 1), 0 */
  kvti_snapshot *hook_snap;
  int hook_busy; /* kvt_tier_write_pending calls in progress */
  int hook_rc;   /* result of the last such write of hook_id */
  int marker;    /* the stop marker was queued (kvt_tier_close_queued) */
} kvti_writer;

typedef struct kvti_pool {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  kvt_promise *head, *tail;
  pthread_t *threads;
  uint32_t n_threads; /* started */
  int stop;
} kvti_pool;

enum { KVTI_OPEN = 0, KVTI_TEARDOWN = 1, KVTI_CLOSED = 2 };

struct kvt_tier {
  kvt_options opts; /* copy; opts.cache_dir points at dir */
  char *dir;        /* absolute cache directory */
  char *data_dir;
  uint64_t max_bytes;
  int readonly;
  int lock_fd;     /* flock'ed kvtier.lock, -1 for read-only */
  int dir_lock_fd; /* the flock'ed cache directory, -1 for read-only */
  kvt_index *idx;
  kvti_backend *be;
  kvti_stripes stripes;
  pthread_mutex_t mut_mu;
  kvti_stats stats;
  kvti_writer w;
  kvti_pool pool;
  pthread_mutex_t life_mu; /* only for sleeping until active == 0 */
  pthread_cond_t life_cv;
  atomic_int state;
  atomic_uint_fast64_t active;
  pthread_mutex_t close_mu;   /* serialises close/free */
  struct kvti_remote *remote; /* shared remote tier (remote.h), NULL: none */
};

/* Lifecycle guards: enter returns 0 or KVT_ECLOSED (message set). */
int kvti_tier_enter(kvt_tier *t);
void kvti_tier_leave(kvt_tier *t);

void kvti_log(kvt_tier *t, int level, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Clocks: wall (Unix seconds, as the index stores) and monotonic seconds. */
double kvti_now_wall(void);
double kvti_now_mono(void);
/* created_before for lookups: now - retention_seconds, or 0 when entries never
 * expire. */
double kvti_tier_cutoff(const kvt_tier *t);

/* Condition variables on CLOCK_MONOTONIC and absolute deadlines from a timeout
 * in ms
 * (< 0: none -> *has = 0). wait_until returns 0 or ETIMEDOUT. */
int kvti_cond_init(pthread_cond_t *cv);
void kvti_deadline(struct timespec *ts, int *has, int64_t timeout_ms);
int kvti_cond_wait_until(pthread_cond_t *cv, pthread_mutex_t *mu,
                         const struct timespec *ts, int has);

/* Why an entry is removed (which counter rises). */
enum { KVTI_RM_EVICT = 1, KVTI_RM_EXPIRE = 2, KVTI_RM_USER = 3 };
/* Removes an entry: exclusive stripe, index row first (no new lookup finds it),
 * then files. Caller holds mut_mu. Returns 0, KVT_ENOTFOUND, or an index error.
 */
int kvti_tier_remove_locked(kvt_tier *t, const char *hash, int why);
/* Capacity (count and disk bytes, LRU) and retention; caller holds mut_mu. */
void kvti_tier_enforce_locked(kvt_tier *t, int64_t max_entries,
                              uint64_t max_bytes, double cutoff,
                              uint64_t *removed, uint64_t *removed_bytes);
/* Quarantines a corrupt entry if it is still the version created at created_at
 * (< 0: any): takes mut_mu and the stripe, drops the row, moves the files.
 * Keeps the caller's error message. No-op on a read-only tier. */
void kvti_tier_quarantine(kvt_tier *t, const char *hash, double created_at);
/* Drops the row of an entry whose files vanished (same version check as
 * quarantine). */
void kvti_tier_drop_missing(kvt_tier *t, const char *hash, double created_at);

/* writer.c */
int kvti_writer_init(kvt_tier *t);
void kvti_writer_destroy(kvt_tier *t);
/* Waits up to timeout for the queue to drain (accepting must already be 0).
 * 0/KVT_ETIMEDOUT. */
int kvti_writer_drain(kvt_tier *t, int64_t timeout_ms);
/* Stops (dropping queued spills when drop) and joins the writer thread. */
void kvti_writer_stop(kvt_tier *t, int drop);
/* Writes one spill (notify: run spill_done_fn); returns its result. */
int kvti_writer_write(kvt_tier *t, kvti_snapshot *s, int notify);

/* writer_hook.c */
/* Hands spill id (snapshot s) to the write hook fn, on the writer thread with
 * nothing locked, then reports it (stats, log, spill_done_fn). */
void kvti_writer_hooked(kvt_tier *t, kvti_snapshot *s, kvt_write_hook_fn fn,
                        void *ctx, uint64_t id);
/* Close's first step: queues the stop marker behind the accepted spills once
 * a queue slot is free (before the deadline: else KVT_EFULL, nothing changed)
 * and stops accepting spills. No-op without a writer to stop. */
int kvti_writer_queue_marker(kvt_tier *t, const struct timespec *ts, int has);

/* promote.c */
int kvti_pool_init(kvt_tier *t);
/* Stops and joins the workers (the job queue must be empty: close waits for
 * promotes). */
void kvti_pool_stop(kvt_tier *t);
void kvti_pool_destroy(kvt_tier *t);

/* ---- recover.c: the index rebuilt from the entries ---- */

/* Creates an empty index.db with file_mode when there is none (tier.c). */
int kvti_tier_precreate_db(const char *dir, uint32_t file_mode);
/* Opens t->idx; a hostile or damaged index.db (or KVT_OPEN_REINDEX) is set
 * aside and a fresh one opened (*rebuilt = 1: reconcile must fill it). */
int kvti_tier_open_index(kvt_tier *t, const kvti_index_measure *measure,
                         uint32_t file_mode, int *rebuilt);
/* Reconcile's rule for names[0..n) without a row (caller holds mut_mu):
 * valid entries adopted (rows built from their files, in batches), invalid
 * ones quarantined (*quarantined), unreadable ones left. Returns the number
 * adopted or a negative code. */
int64_t kvti_tier_adopt_locked(kvt_tier *t, char *const *names, size_t n,
                               int64_t *quarantined);

#endif
