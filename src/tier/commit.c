/*
 * commit.c - writing spills durably, on the writer thread (or a write hook's
 * caller): one spill through the single path (stage, publish keeping the
 * previous version, commit the index row, drop the previous version; a busy
 * index is waited out without mut_mu), or the spills waiting in the queue as
 * one group (one data/ sync, one index transaction). An acknowledged spill is
 * exactly as durable either way; a failed write leaves no entry and no row -
 * a failed replacement the previous version and its row, as they were - is
 * counted in write_failures, and the writer carries on. The queue and the
 * thread that call it are writer.c's.
 */
#include "tier/ramtier.h"
#include "tier/tier.h"
#include "tier/admission.h"
#include "tier/chunks.h"
#include "base/error.h"
#include "index/index.h"
#include "base/io.h"
#include "engine/syncset.h"
#include "format/layer.h"
#include "tier/remote.h"
#include "store/local.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

/* How long the writer keeps retrying a spill whose index commit finds
 * index.db locked by another connection (SQLite's own busy timeout, which it
 * no longer waits for while holding mut_mu). */
#define WRITER_BUSY_BUDGET_S 5.0

/* One attempt at a spill, with mut_mu held. Order: stage the new version
 * (nobody sees it), publish it keeping the previous version, commit the index
 * row without waiting for another connection's lock, then drop the previous
 * version - or, when the commit failed, roll the publish back: the previous
 * version and its row are served exactly as before (the row never changed:
 * a failed index put changes neither SQLite nor the mirror). *busy is set
 * when the commit found index.db locked (worth a retry). A chunked tier
 * (chunks.h) takes the same steps for its tail entry and chained-entry
 * record (its chunks are immutable and written first). */
static int write_locked(kvt_tier *t, kvti_snapshot *s, const char *hash,
                        const kvti_write_opts *wo, uint64_t *disk, int *busy) {
  size_t n = 0;
  const int32_t *tokens = kvti_snapshot_tokens(s, &n);
  const kvti_backend_ops *ops = t->be->ops;
  *busy = 0;
  /* Readers must be excluded only when something is already stored under this
   * hash (a replace: a reader could otherwise mix files of two versions). A new
   * entry appears atomically by rename and its row only after that, and nobody
   * else can create either while we hold mut_mu, so readers of other entries in
   * the stripe need not wait for this write. Staging needs no lock at all: the
   * staged version is invisible. */
  kvt_entry_info old;
  int replacing = kvti_index_find_hash(&old, t->idx, hash) == 0 ||
                  ops->present(t->be, hash) != 0;
  /* A chunked tier (chunks.h) first writes the chunks the chain lacks - they
   * are immutable and never replaced, so nothing of an old version changes -
   * then stages its tail like any entry; the chained-entry record changes
   * only under the stripe's write lock and is put back if the row fails. */
  kvti_chunked_prep cp;
  int chunked = t->chunked != NULL;
  if (chunked) {
    /* A new entry's record commits with its chunk rows (no reader can
     * reach it before its row); a replacement's waits for the stripe. */
    int prc = kvti_tier_chunks_prepare(t, &cp, s, !replacing);
    if (prc != 0) {
      kvti_chunked_prep_free(&cp);
      return prc;
    }
  }
  const kvti_snapshot *ss = chunked ? kvti_chunked_prep_snapshot(&cp, s) : s;
  kvti_put_txn *x = NULL;
  int rc = kvti_backend_local_put_stage(t->be, &x, disk, ss, wo);
  if (rc != 0) {
    if (chunked) {
      if (cp.recorded) { /* nothing published: the record goes back */
        kvti_error_state es;
        kvti_error_state_capture(&es, rc);
        kvti_chunked_prep_undo(t->chunked, &cp);
        kvti_error_state_restore(&es);
      }
      kvti_chunked_prep_free(&cp);
    }
    return rc;
  }
  if (replacing)
    kvti_stripe_wrlock(&t->stripes, hash);
  int recorded = chunked && cp.recorded;
  rc = chunked ? kvti_chunked_prep_record(t->chunked, &cp) : 0;
  if (rc == 0) {
    recorded = chunked;
    rc = kvti_backend_local_put_publish(t->be, x);
  }
  if (rc == 0) {
    kvti_index_put_args a = {tokens,  n,
                             hash,    kvti_snapshot_memory_bytes(s),
                             *disk,   t->opts.storage_mode,
                             0,       kvti_snapshot_salt(s),
                             !chunked};
    rc = kvti_index_put_one(t->idx, &a, 0);
  }
  if (rc == 0) {
    kvti_backend_local_put_commit(t->be, x);
    if (chunked)
      kvti_tier_chunks_committed(t, &cp);
    if (replacing)
      kvti_ram_invalidate(t, hash); /* the RAM copy is the old version */
  } else {
    kvti_error_state es;
    kvti_error_state_capture(&es, rc);
    if (!replacing)
      kvti_stripe_wrlock(&t->stripes, hash);
    if (recorded)
      kvti_chunked_prep_undo(t->chunked, &cp);
    if (kvti_backend_local_put_rollback(t->be, x) != 0)
      kvti_log(t, KVT_LOG_WARN,
               "kvtier: undoing the publish of %.16s failed (%s); the new "
               "version stays in place",
               hash, kvt_last_error());
    if (!replacing)
      kvti_stripe_unlock(&t->stripes, hash);
    *busy = rc == KVT_EBUSY;
    kvti_error_state_restore(&es);
  }
  if (replacing)
    kvti_stripe_unlock(&t->stripes, hash);
  if (chunked)
    kvti_chunked_prep_free(&cp);
  return rc;
}

/* A spill that will not be written: counted and logged once, whichever
 * road (alone or in a group) it failed on. */
static void write_failed(kvt_tier *t, const kvti_snapshot *s, const char *hash,
                         const char *why) {
  size_t n = 0;
  kvti_snapshot_tokens(s, &n);
  KVTI_STAT_ADD(&t->stats, write_failures, 1);
  kvti_log(t, KVT_LOG_ERROR,
           "kvtier: failed to write entry %.16s (%zu tokens): %s", hash, n,
           why);
}

/* Writes one spill (notify: then runs spill_done_fn). Runs on the writer
 * thread - or a write hook's caller, writer_hook.c - with nothing locked on
 * entry. A busy index is waited for without mut_mu (so removals, quarantines
 * and reconciles are not held up by another process's lock) and the write is
 * retried, within WRITER_BUSY_BUDGET_S. Returns the write's result. */
int kvti_writer_write(kvt_tier *t, kvti_snapshot *s, int notify) {
  if (!kvti_remote_spills_local(t))
    return 0; /* remote only: the upload thread writes it and reports it */
  char hash[KVT_HASH_HEX_LEN + 1];
  memcpy(hash, kvti_snapshot_hash(s), sizeof hash);
  size_t n = 0;
  kvti_snapshot_tokens(s, &n);
  kvti_write_opts wo = {
      t->opts.storage_mode, t->opts.durability == KVT_DURABILITY_FSYNC,
      t->opts.file_mode, t->opts.dir_mode, t->opts.io_backend};
  uint64_t disk = 0;
  double t0 = kvti_now_mono();
  double deadline = t0 + WRITER_BUSY_BUDGET_S;
  int rc;
  pthread_mutex_lock(&t->mut_mu);
  for (;;) {
    int busy = 0;
    rc = write_locked(t, s, hash, &wo, &disk, &busy);
    double left = deadline - kvti_now_mono();
    if (!busy || left <= 0)
      break;
    pthread_mutex_unlock(&t->mut_mu);
    int w = kvti_index_wait_writable(t->idx, (int64_t)(left * 1000) + 1);
    pthread_mutex_lock(&t->mut_mu);
    if (w != 0) {
      rc = w;
      break;
    }
  }
  if (rc == 0) {
    kvti_stats_spilled(&t->stats, disk, kvti_now_mono() - t0);
    kvti_ram_spilled(t, s, disk); /* before capacity enforcement may evict */
    kvti_log(t, KVT_LOG_DEBUG,
             "kvtier: spilled %.16s: %zu tokens, %llu bytes on disk", hash, n,
             (unsigned long long)disk);
    kvti_tier_enforce_locked(t, t->opts.max_entries, t->max_bytes,
                             kvti_tier_cutoff(t), NULL, NULL);
  } else {
    write_failed(t, s, hash, kvt_last_error());
  }
  pthread_mutex_unlock(&t->mut_mu);
  kvti_stats_refresh_gauges(t); /* entries, bytes, queue: for the live file */
  if (notify && t->opts.spill_done_fn)
    t->opts.spill_done_fn(t->opts.spill_done_ctx, hash, rc);
  return rc;
}

/* ---- group commit ----------------------------------------------------
 * Spills waiting in the queue when the writer takes one are written as one
 * batch (at most KVTI_WRITER_BATCH_MAX, distinct hashes, none replacing a
 * stored entry), each step once for the whole batch:
 *   1. write: each spill's missing chunks (under their tmp names) and its
 *      staged version, all into one syncset (engine/syncset.h): nothing is
 *      synced yet;
 *   2. one round of file fsyncs (every chunk and staged file at once), the
 *      chunks renamed into place, one round of directory fsyncs (their
 *      chunks/<kk>, every staged directory);
 *   3. chunked: each spill's chunk rows and chained-entry record, one
 *      transaction per spill in FIFO order, with the index's fsync off
 *      (SQLite's WAL is one append-only file, recovered as a prefix of its
 *      commits, so a crash keeps some first records or all of them, never a
 *      later one without an earlier);
 *   4. each staged version published by rename, ONE fsync of data/, ONE
 *      index transaction for every row, whose WAL fsync makes step 3's
 *      commits durable too; only then is each spill acknowledged, in FIFO
 *      order.
 * So an acknowledged spill is exactly as durable as a single one: its files
 * are durable before any row names them, its rename before its row, and its
 * records no later than its row. A crash before step 3 leaves only
 * unindexed chunk files (gc) and staged temporaries (removed at open); during
 * 3 or 4 chunk rows with their durable files and records without a published
 * entry, or spills published (their chunk files durable and named) with or
 * without their records and chunk rows but without an entry row: the next
 * open's reconcile adopts each whole (a tail whose chain has no rows has its
 * chunk files indexed again first, tier/chunks.c). A
 * replacement is written alone (it holds its stripe across publish and
 * commit, and batching several stripes could deadlock readers). Any failure
 * of a step rolls the whole batch back (the set's group may be failed for
 * everyone), and each spill is written again through the single path, which
 * also waits out a busy index and reports each spill's own error. */
typedef struct batch_ent {
  kvti_snapshot *s;
  char hash[KVT_HASH_HEX_LEN + 1];
  kvti_chunked_prep cp;
  int has_cp;   /* cp holds prepared state (prep_free pending) */
  int recorded; /* the chained-entry record was written */
  kvti_put_txn *x;
  uint64_t disk;
  double t0;
  int rc;     /* the spill's result */
  int single; /* to be written through the single path */
  int done;   /* rc is final */
} batch_ent;

/* Undoes a published (or staged) batch member: record, then files. mut_mu
 * held; takes its stripe for the rollback as the single path does. */
static void batch_undo(kvt_tier *t, batch_ent *b) {
  kvti_stripe_wrlock(&t->stripes, b->hash);
  if (b->recorded)
    kvti_chunked_prep_undo(t->chunked, &b->cp);
  if (b->x && kvti_backend_local_put_rollback(t->be, b->x) != 0)
    kvti_log(t, KVT_LOG_WARN,
             "kvtier: undoing the publish of %.16s failed (%s); the new "
             "version stays in place",
             b->hash, kvt_last_error());
  kvti_stripe_unlock(&t->stripes, b->hash);
  b->x = NULL;
  b->recorded = 0;
}

static void batch_free_prep(batch_ent *b) {
  if (b->has_cp)
    kvti_chunked_prep_free(&b->cp);
  b->has_cp = 0;
}

/* Step 3: the chunk rows and record of every chained member of b[i, end),
 * in order. With durability FSYNC none of these commits waits for the WAL's
 * fsync: step 4's row transaction fsyncs the WAL, which makes them durable
 * with it (the WAL is recovered as a prefix of its commits), and no spill is
 * acknowledged before that. Lost to a crash, a record leaves a published
 * tail without rows, which the next open's reconcile adopts with its chain
 * (the chunk files are durable and named: steps 1-2). The index is durable
 * again on return, whatever happened. mut_mu held. */
static int batch_records(kvt_tier *t, batch_ent *b, size_t i, size_t end) {
  int defer = t->opts.durability == KVT_DURABILITY_FSYNC;
  int rc = defer ? kvti_index_set_durable(t->idx, 0) : 0;
  for (size_t k = i; rc == 0 && k < end; k++) {
    if (!b[k].cp.chained)
      continue;
    rc = kvti_chunked_prep_record(t->chunked, &b[k].cp);
    b[k].recorded = b[k].cp.recorded;
  }
  if (defer && rc == 0) /* the rows must not commit with the fsync off */
    return kvti_index_set_durable(t->idx, 1);
  if (defer) {
    kvti_error_state es;
    kvti_error_state_capture(&es, rc);
    if (kvti_index_set_durable(t->idx, 1) != 0)
      kvti_log(t, KVT_LOG_ERROR,
               "kvtier: index commits could not be made durable again (%s)",
               kvt_last_error());
    kvti_error_state_restore(&es);
  }
  return rc;
}

/* 1 when hash names a stored entry (a replacement). */
static int batch_replaces(kvt_tier *t, const char *hash) {
  kvt_entry_info old;
  return kvti_index_find_hash(&old, t->idx, hash) == 0 ||
         t->be->ops->present(t->be, hash) != 0;
}

/* Writes the batch members b[i..n) up to (not including) the first that
 * replaces a stored entry, as described above. mut_mu held. Returns the
 * index of that member (n: none). Members end with done (rc final) or
 * single (to be written alone). */
static size_t batch_group_locked(kvt_tier *t, batch_ent *b, size_t i, size_t n,
                                 const kvti_write_opts *wo) {
  size_t end = i;
  while (end < n && !batch_replaces(t, b[end].hash))
    end++;
  if (end == i)
    return end;
  kvti_syncset *set = NULL;
  kvti_chunkstore_batch *cb = NULL;
  /* A group of several: 16 writes in flight (their files' tensors are
   * written from where they lie, 512 KiB a write for a 256-token chunk); a
   * group of one keeps the default, which measured faster for it. */
  int rc = kvti_syncset_open_depth(&set, wo->io_backend, wo->do_fsync,
                                   end - i > 1 ? 16 : 0);
  if (rc == 0)
    rc = kvti_tier_chunks_batch_new(t, &cb, set);
  kvti_write_opts ws = *wo;
  ws.sync = set;
  /* 1. Everything written, nothing synced. */
  for (size_t k = i; rc == 0 && k < end; k++) {
    batch_ent *e = &b[k];
    e->t0 = kvti_now_mono();
    if (t->chunked) {
      e->has_cp = 1;
      rc = kvti_tier_chunks_prepare_in(t, &e->cp, e->s, cb);
    }
    const kvti_snapshot *ss =
        t->chunked ? kvti_chunked_prep_snapshot(&e->cp, e->s) : e->s;
    if (rc == 0)
      rc = kvti_backend_local_put_stage(t->be, &e->x, &e->disk, ss, &ws);
  }
  /* 2. Every file durable at once, the chunks renamed, every directory. */
  if (rc == 0)
    rc = kvti_syncset_files(set);
  if (rc == 0 && cb)
    rc = kvti_chunkstore_batch_publish(cb);
  if (rc == 0)
    rc = kvti_syncset_dirs(set);
  /* 3. Chunk rows and records. */
  if (rc == 0 && t->chunked)
    rc = batch_records(t, b, i, end);
  /* 4. Every rename, made durable at once, then every row at once. */
  for (size_t k = i; rc == 0 && k < end; k++)
    rc = kvti_backend_local_put_publish(t->be, b[k].x);
  if (rc == 0 && wo->defer_dir_sync)
    rc = kvti_backend_local_put_sync(t->be);
  if (rc == 0) {
    kvti_index_put_args a[KVTI_WRITER_BATCH_MAX];
    for (size_t k = i; k < end; k++) {
      batch_ent *e = &b[k];
      size_t nt = 0;
      const int32_t *tokens = kvti_snapshot_tokens(e->s, &nt);
      kvti_index_put_args x = {tokens,     nt,
                               e->hash,    kvti_snapshot_memory_bytes(e->s),
                               e->disk,    t->opts.storage_mode,
                               0,          kvti_snapshot_salt(e->s),
                               !t->chunked};
      a[k - i] = x;
    }
    rc = kvti_index_put_batch(t->idx, a, end - i, 0);
  }
  if (rc != 0) {
    kvti_error_state es;
    kvti_error_state_capture(&es, rc);
    /* A group of one that failed for any reason but a busy index has had
     * its try: its error is final, as the single path's would be. */
    int alone = end - i == 1 && rc != KVT_EBUSY;
    for (size_t k = end; k-- > i;) {
      batch_ent *e = &b[k];
      if (e->x || e->recorded)
        batch_undo(t, e);
      batch_free_prep(e);
      e->single = !alone; /* each gets its own try (and its own error) */
    }
    kvti_syncset_free(set); /* first: it removes files through cb's dirs */
    kvti_chunkstore_batch_free(cb);
    if (alone) {
      b[i].rc = rc;
      b[i].done = 1;
      write_failed(t, b[i].s, b[i].hash, es.msg);
      kvti_error_state_restore(&es);
      return end;
    }
    kvti_log(t, KVT_LOG_DEBUG,
             "kvtier: group commit of %zu spills failed (%s); writing them "
             "one by one",
             end - i, es.msg);
    kvti_error_state_restore(&es);
    return end;
  }
  kvti_syncset_free(set);
  kvti_chunkstore_batch_free(cb);
  size_t np = end - i;
  if (np > 1) {
    KVTI_STAT_ADD(&t->stats, spill_batches, 1);
    KVTI_STAT_ADD(&t->stats, spills_batched, np);
  }
  for (size_t k = i; k < end; k++) {
    batch_ent *e = &b[k];
    kvti_backend_local_put_commit(t->be, e->x);
    e->x = NULL;
    if (t->chunked)
      kvti_tier_chunks_committed(t, &e->cp);
    batch_free_prep(e);
    e->rc = 0;
    e->done = 1;
    size_t nt = 0;
    kvti_snapshot_tokens(e->s, &nt);
    kvti_stats_spilled(&t->stats, e->disk, kvti_now_mono() - e->t0);
    kvti_ram_spilled(t, e->s, e->disk); /* before enforcement may evict */
    kvti_log(t, KVT_LOG_DEBUG,
             "kvtier: spilled %.16s: %zu tokens, %llu bytes on disk "
             "(group of %zu)",
             e->hash, nt, (unsigned long long)e->disk, np);
  }
  kvti_tier_enforce_locked(t, t->opts.max_entries, t->max_bytes,
                           kvti_tier_cutoff(t), NULL, NULL);
  return end;
}

/* Writes n >= 1 spills taken off the queue together (one: a durable spill
 * alone), then acknowledges each (spill_done_fn) in FIFO order. */
void kvti_writer_write_batch(kvt_tier *t, kvti_snapshot **snaps, size_t n) {
  batch_ent b[KVTI_WRITER_BATCH_MAX];
  memset(b, 0, sizeof b);
  for (size_t k = 0; k < n; k++) {
    b[k].s = snaps[k];
    memcpy(b[k].hash, kvti_snapshot_hash(snaps[k]), sizeof b[k].hash);
  }
  kvti_write_opts wo = {
      t->opts.storage_mode, t->opts.durability == KVT_DURABILITY_FSYNC,
      t->opts.file_mode,    t->opts.dir_mode,
      t->opts.io_backend,   0};
  wo.defer_dir_sync = wo.do_fsync;
  size_t i = 0;
  while (i < n) {
    pthread_mutex_lock(&t->mut_mu);
    size_t j = batch_group_locked(t, b, i, n, &wo);
    pthread_mutex_unlock(&t->mut_mu);
    for (size_t k = i; k < j; k++)
      if (b[k].single)
        b[k].rc = kvti_writer_write(t, b[k].s, 0);
    if (j < n) /* the replacement that ended the group */
      b[j].rc = kvti_writer_write(t, b[j].s, 0);
    i = j + 1;
  }
  kvti_stats_refresh_gauges(t); /* entries, bytes, queue: for the live file */
  for (size_t k = 0; k < n; k++)
    if (t->opts.spill_done_fn)
      t->opts.spill_done_fn(t->opts.spill_done_ctx, b[k].hash, b[k].rc);
}
