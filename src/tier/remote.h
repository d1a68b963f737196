/*
 * remote.h - the shared remote tier: the glue between the tier and a remote
 * store (tier/remote.c: modes, the asynchronous upload queue and its thread,
 * the failure backoff that degrades to local-only, stats, staging, adopting a
 * fetched entry as a local copy). The store itself is any remote backend of
 * the constructor table (store/backend.h), reached through its vtable. The
 * tier calls only the kvti_remote_* hooks below; each is a cheap no-op when no
 * remote is configured.
 */
#ifndef KVT_REMOTE_H
#define KVT_REMOTE_H

#include "store/backend.h"
#include "kvtier.h"

#include <stdint.h>
#include <time.h>

/* ---- hooks used by tier.c / writer.c / promote.c / ops.c ---- */
struct kvt_tier;
struct kvti_snapshot;
/* Opens the remote side of t when t->opts.remote_url is set (no connection is
 * made: an unreachable server does not fail open). 0, KVT_EINVAL,
 * KVT_EUNSUPPORTED (a store this build does not include, e.g. Redis without
 * hiredis), KVT_ENOMEM. */
int kvti_remote_open(struct kvt_tier *t);
/* 1 when the mode spills locally too (no remote, or local+remote). */
int kvti_remote_spills_local(const struct kvt_tier *t);
/* After the local write of a spill: hands the snapshot to the upload queue.
 * Returns 1 when it took ownership (frees it later), 0 when the caller frees
 * it. In remote-only mode it also reports the outcome through spill_done_fn
 * (KVT_EFULL when the queue is full). reserved: the spill's write-budget
 * reservation when the upload is what writes it (remote only; else 0),
 * always given back here: after the upload has counted its bytes, or at
 * once when nothing will be uploaded. */
int kvti_remote_take(struct kvt_tier *t, struct kvti_snapshot *s,
                     uint64_t reserved);
/* Waits for uploads queued so far (absolute deadline; has = 0: forever).
 * 0 or KVT_ETIMEDOUT. */
int kvti_remote_drain(struct kvt_tier *t, const struct timespec *ts, int has);
/* Stops the upload thread (dropping queued uploads when drop). */
void kvti_remote_stop(struct kvt_tier *t, int drop);
void kvti_remote_free(struct kvt_tier *t);
/* Remote lookup for a promote (counts remote misses/errors). Fills info from
 * the remote manifest. Returns 0, KVT_ENOTFOUND (also when the remote is
 * unavailable: degraded, counted as an error). */
int kvti_remote_lookup(struct kvt_tier *t, kvt_entry_info *info,
                       const int32_t *tokens, size_t n, int prefix,
                       uint64_t min_len);
/* The same for kvt_tier_lookup* (nothing counted): cheap - a miss is
 * answered from the local mirror of the remote keys without I/O, a hit costs
 * one call bounded by remote_lookup_timeout_ms; during back-off it is an
 * immediate miss. */
int kvti_remote_peek(struct kvt_tier *t, kvt_entry_info *info,
                     const int32_t *tokens, size_t n, int prefix,
                     uint64_t min_len);
/* Reads a remote entry found by kvti_remote_lookup: fetch, verify with the
 * entry format's reader, count the remote hit bytes/latency, keep a local copy
 * when configured. Returns as kvti_entry_read (a vanished or damaged remote
 * entry is KVT_ENOTFOUND). */
int kvti_remote_read(struct kvt_tier *t, kvt_entry **out,
                     const kvt_entry_info *info, const kvti_read_opts *ro);
/* Gauges for kvt_tier_stats. */
void kvti_remote_gauges(struct kvt_tier *t, kvt_stats *s);

#endif
