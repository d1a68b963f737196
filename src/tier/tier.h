/*
 * tier.h - the internal state of a kvt_tier shared by the tier files, and
 * the calls between them. The files form layers (docs/DESIGN.md, "Source
 * map"): tier.c (enter/leave, log) at the bottom; maint.c (removal,
 * capacity, retention, quarantine), reconcile.c/recover.c, ops.c (lookups
 * and entry operations), promote.c (promote, worker pool, promises),
 * commit.c (durable writes), writer.c (spill queue + writer thread), spill.c
 * (the public spill calls) above; lifecycle.c (open/close/free) on top.
 * stats.h and options.h sit below it and know nothing of a kvt_tier.
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
 *  - w.mu: the spill queue; pool.mu: the promote job queue (both
 * base/workq.h); each promise has its own mu. Callbacks into the caller
 * (log_fn, spill_done_fn, budget) are never made with mut_mu or a stripe held,
 * except log_fn, which must not call back into the tier.
 */
#ifndef KVT_TIER_H
#define KVT_TIER_H

#include "index/index.h"
#include "store/backend.h"
#include "base/salt.h"
#include "kvtier.h"
#include "base/clock.h"
#include "base/lock.h"
#include "base/workq.h"
#include "tier/stats.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

/* A spill queued for the writer (writer.c); link.cost is the bytes charged
 * against spill_queue_bytes, reserved the write budget's reservation it
 * holds (admission.h), given back once it is written, failed or dropped. */
typedef struct kvti_spill_item {
  kvti_workq_item link; /* first: the queue hands back this pointer */
  kvti_snapshot *snap;
  uint64_t reserved;
} kvti_spill_item;

/* writer_hook.c: a binding's write hook and close's stop marker. Its own
 * mutex is a leaf (never held while taking another lock). Invariants: id names
 * the one spill in the hook (0: none) and snap its snapshot, which stays alive
 * until the hook returned and no kvt_tier_write_pending call runs (busy 0). */
typedef struct kvti_writer_hook {
  pthread_mutex_t mu;
  pthread_cond_t cv;    /* busy dropped */
  kvt_write_hook_fn fn; /* NULL: the C write, no call out */
  void *ctx;
  uint64_t next_id; /* ids handed out so far (writer thread only) */
  uint64_t id;      /* spill the hook runs for, 0 */
  kvti_snapshot *snap;
  int busy;   /* kvt_tier_write_pending calls in progress */
  int rc;     /* result of the last such write of id */
  int marker; /* the stop marker was queued */
  int inited;
} kvti_writer_hook;

enum { KVTI_OPEN = 0, KVTI_TEARDOWN = 1, KVTI_CLOSED = 2 };

#define KVTI_LAYOUTS 8 /* distinct spill layouts the layout guard keeps */

struct kvt_tier {
  kvt_options opts; /* copy; opts.cache_dir points at dir */
  char *dir;        /* absolute cache directory */
  uint64_t max_bytes;
  int readonly;
  kvt_index *idx;
  kvti_backend *be; /* the local store (store/local.h): the layout is its */
  kvti_stripes stripes;
  pthread_mutex_t mut_mu;
  kvti_stats stats;
  kvti_workq w;            /* spill queue + the writer thread (writer.c) */
  kvti_writer_hook hook;   /* writer_hook.c */
  kvti_workq pool;         /* promote jobs + the worker pool (promote.c) */
  pthread_mutex_t life_mu; /* only for sleeping until active == 0 */
  pthread_cond_t life_cv;
  atomic_int state;
  atomic_uint_fast64_t active;
  pthread_mutex_t close_mu;   /* serialises close/free */
  struct kvti_remote *remote; /* shared remote tier (remote.h), NULL: none */
  struct kvti_hcache *hc;     /* host RAM cache (ramtier.h) */
  struct kvti_ram_bg *ram_bg; /* its background cutter (ramtier.c) */
  /* The chunked native store (chunks.h), NULL when chunk_tokens is 0. */
  struct kvti_chunked *chunked;
  /* The writer's lazy sweep of chunks/ (chunk_tools.h), under mut_mu. */
  unsigned chunk_sweep_calls, chunk_sweep_next;
  int chunks_rescanned; /* chain table rebuilt from the files (this open) */
  /* Admission and the write budget (admission.h); NULL on read-only tiers. */
  struct kvti_admit *admit;
  /* With clock_fn: the bits of its latest reading, taken on a caller's
   * thread (kvti_tier_clock); the index stamps recency with it, so no other
   * thread calls into the caller's clock. */
  _Atomic uint64_t clock_seen;
  /* The model_id's namespace (salt.c), joined into every call's salt: set
   * once at open (native mode, no remote tier), read-only after. */
  kvti_salt ns;
  /* Signatures of the layouts this handle spilled (layout_guard.c; 0: free
   * slot): promotes of none of them are misses; layout_full: more layouts
   * than slots, guard off. */
  atomic_uint_fast64_t layouts[KVTI_LAYOUTS];
  atomic_int layout_full;
};

/* Lifecycle guards: enter returns 0 or KVT_ECLOSED (message set). */
int kvti_tier_enter(kvt_tier *t);
/* The salt of a call (salt.c): kvti_salt_make, refused (KVT_EUNSUPPORTED)
 * with a remote tier, then joined with the tier's model_id namespace;
 * kvti_call_salt reads a kvt_call_opts (NULL: no salt, the namespace's
 * alone). Every entry point keys its names by one of these. */
int kvti_tier_salt(kvti_salt *out, const kvt_tier *t, const void *salt,
                   size_t len);
int kvti_call_salt(kvti_salt *out, const kvt_tier *t, const kvt_call_opts *co);
/* Sets t->ns from opts.model_id (before kvti_tier_chunks_open forgets it). */
int kvti_tier_ns_init(kvt_tier *t);
/* The layout guard (layout_guard.c): note the layers of an accepted spill;
 * check a read entry against the noted layouts - on a mismatch *e is freed
 * and NULL, layout_misses counted, KVT_ENOTFOUND returned; else 0. */
void kvti_tier_layout_note(kvt_tier *t, const kvt_layer *layers, uint32_t n);
int kvti_tier_layout_check(kvt_tier *t, kvt_entry **e);
void kvti_tier_leave(kvt_tier *t);

void kvti_log(kvt_tier *t, int level, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* created_before for lookups: now - retention_seconds, or 0 when entries never
 * expire. */
double kvti_tier_cutoff(const kvt_tier *t);
/* The tier's clock on a caller's thread: clock_fn's reading (kept for
 * kvti_tier_recency_now), or the wall clock. */
double kvti_tier_clock(kvt_tier *t);
/* Recency's time (the index's clock, kvti_index_set_clock; ctx the tier):
 * the latest kvti_tier_clock reading when clock_fn is set, else the wall
 * clock. Any thread. */
double kvti_tier_recency_now(void *ctx);

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

/* reconcile.c. Removes stale temporaries (caller holds mut_mu, or no writer
 * exists yet); returns the count or a negative code. */
int64_t kvti_tier_purge_tmps(kvt_tier *t);
/* The reference's reconcile plus stale temporaries; caller holds mut_mu.
 * Returns the number of repairs or a negative code. */
int64_t kvti_tier_reconcile_locked(kvt_tier *t);

/* ops.c: measures the gauges (index totals, spill queue, remote) and
 * publishes them to the live stats file. Call with no tier lock held. */
void kvti_stats_refresh_gauges(kvt_tier *t);

/* tier.c: 1 when a remote tier is configured (promotes may consult it). */
int kvti_remote_enabled(const kvt_tier *t);

/* writer.c: the spill queue and its thread. */
int kvti_writer_init(kvt_tier *t);
void kvti_writer_destroy(kvt_tier *t);
/* Waits up to timeout for the queue to drain (accepting must already be 0).
 * 0/KVT_ETIMEDOUT. */
int kvti_writer_drain(kvt_tier *t, int64_t timeout_ms);
/* Stops (dropping queued spills when drop) and joins the writer thread. */
void kvti_writer_stop(kvt_tier *t, int drop);
/* The spill queue's entry, past admission (spill.c decides first): checks,
 * snapshot, enqueue; refusals counted by reason. reserved: the write
 * budget's reservation the queued spill takes over (0: none); on a refusal
 * it stays the caller's to give back. */
int kvti_spill_enqueue(kvt_tier *t, const int32_t *tokens, size_t n_tokens,
                       const kvt_layer *layers, uint32_t n_layers,
                       uint64_t memory_bytes, int copy, void (*release)(void *),
                       void *release_ctx, const kvt_call_opts *co,
                       uint64_t reserved);
/* Close's first step: queues the stop marker behind the accepted spills once
 * a queue slot is free (before the deadline: else KVT_EFULL, nothing changed)
 * and stops accepting spills. No-op without a writer to stop. */
int kvti_writer_queue_marker(kvt_tier *t, const struct timespec *ts, int has);

/* commit.c: durable writes of spills taken off the queue. */
/* The most spills written as one group. */
#define KVTI_WRITER_BATCH_MAX 16
/* Writes one spill (notify: run spill_done_fn); returns its result. */
int kvti_writer_write(kvt_tier *t, kvti_snapshot *s, int notify);
/* Writes n >= 1 spills together (group commit), then acknowledges each
 * (spill_done_fn) in FIFO order. */
void kvti_writer_write_batch(kvt_tier *t, kvti_snapshot **snaps, size_t n);

/* writer_hook.c: a binding's write hook. */
int kvti_writer_hook_init(kvt_tier *t);
void kvti_writer_hook_destroy(kvt_tier *t);
/* The writer thread's write of one spill: kvti_writer_write, or, with a hook
 * set, the hook with nothing locked, then the report (stats, log,
 * spill_done_fn). */
void kvti_writer_run_hooked(kvt_tier *t, kvti_snapshot *s);

/* promote.c */
int kvti_pool_init(kvt_tier *t);
/* Stops and joins the workers (the job queue must be empty: close waits for
 * promotes). */
void kvti_pool_stop(kvt_tier *t);
void kvti_pool_destroy(kvt_tier *t);

/* ---- recover.c: the index rebuilt from the entries ---- */

/* Opens t->idx; a hostile or damaged index.db (or KVT_OPEN_REINDEX) is set
 * aside and a fresh one opened (*rebuilt = 1: reconcile must fill it). */
int kvti_tier_open_index(kvt_tier *t, const kvti_index_measure *measure,
                         int *rebuilt);
/* Renames t->dir/index.db (and its -wal) to index.db.<why>-<time>[-wal] and
 * deletes its -shm, so a fresh index starts clean. The index must not be
 * open. 0 or the error. */
int kvti_tier_index_set_aside(kvt_tier *t, const char *why);
/* Reconcile's rule for names[0..n) without a row (caller holds mut_mu):
 * valid entries adopted (rows built from their files, in batches), invalid
 * ones quarantined (*quarantined), unreadable ones left. Returns the number
 * adopted or a negative code. */
int64_t kvti_tier_adopt_locked(kvt_tier *t, char *const *names, size_t n,
                               int64_t *quarantined);

#endif
