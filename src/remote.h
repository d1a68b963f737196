/*
 * remote.h - the shared remote tier: the glue between the tier and a remote
 * store (tier_remote.c: modes, the asynchronous upload queue and its thread,
 * the failure backoff that degrades to local-only, stats, staging, adopting a
 * fetched entry as a local copy) and the Redis/Valkey implementation of the
 * storage-backend seam (src/redis/, built only when hiredis is found:
 * KVT_HAVE_REDIS). The tier calls only the kvti_remote_* hooks below; each is a
 * cheap no-op when no remote is configured.
 */
#ifndef KVT_REMOTE_H
#define KVT_REMOTE_H

#include "backend.h"
#include "kvtier.h"

#include <stdint.h>
#include <time.h>

/* What a remote lookup learns from an entry's remote manifest. */
typedef struct kvti_remote_meta {
  char hash[KVT_HASH_HEX_LEN + 1];
  uint64_t num_tokens;
  uint64_t memory_bytes;
  uint64_t total_bytes; /* bytes of the entry's files */
  double created_at;
  int storage_mode;
} kvti_remote_meta;

/* Configuration of the Redis backend. */
typedef struct kvti_redis_cfg {
  const char *url;
  const char *prefix; /* key prefix ("kvt:" when NULL) */
  uint32_t timeout_ms;
  uint64_t chunk_bytes;
  int64_t ttl_ms;         /* 0 = keys do not expire */
  const char *stage_root; /* local directory for staging entry files */
  uint32_t file_mode, dir_mode;
} kvti_redis_cfg;

/* Validates a remote URL without connecting (always compiled). */
int kvti_remote_check_url(const char *url);

#if KVT_HAVE_REDIS
/* The Redis backend (vtable of backend.h; put/get stage files in stage_root).
 * No connection is made here. Returns 0, KVT_EINVAL (URL), KVT_ENOMEM. */
int kvti_backend_redis_new(kvti_backend **out, const kvti_redis_cfg *cfg);
/* Exact (prefix 0) or longest-prefix lookup of tokens among entries of at
 * least min_len tokens, without scanning the keyspace. Returns 0 and *out,
 * KVT_ENOTFOUND, or a connection error. */
int kvti_redis_find(kvti_backend *b, kvti_remote_meta *out,
                    const int32_t *tokens, size_t n, int prefix,
                    uint64_t min_len);
/* Downloads entry hash into dest_data_dir/<hash>/ (files verified against the
 * remote manifest's chunk checksums). A missing or damaged part cleans up the
 * remote entry and returns KVT_ENOTFOUND / KVT_ECORRUPT. */
int kvti_redis_fetch(kvti_backend *b, kvti_remote_meta *out, const char *hash,
                     const char *dest_data_dir);
/* The remote manifest of entry hash: 0 and *out, KVT_ENOTFOUND, KVT_ECORRUPT
 * (a damaged manifest), or a connection error. */
int kvti_redis_stat(kvti_backend *b, kvti_remote_meta *out, const char *hash);
/* Makes a unique empty staging directory below stage_root (malloc'ed path). */
int kvti_redis_stage_dir(kvti_backend *b, char **out);
#endif

/* ---- hooks used by tier.c / writer.c / promote.c / stats.c ---- */
struct kvt_tier;
struct kvti_snapshot;
/* Opens the remote side of t when t->opts.remote_url is set (no connection is
 * made: an unreachable server does not fail open). 0, KVT_EINVAL,
 * KVT_EUNSUPPORTED (built without hiredis), KVT_ENOMEM. */
int kvti_remote_open(struct kvt_tier *t);
/* 1 when the mode spills locally too (no remote, or local+remote). */
int kvti_remote_spills_local(const struct kvt_tier *t);
/* After the local write of a spill: hands the snapshot to the upload queue.
 * Returns 1 when it took ownership (frees it later), 0 when the caller frees
 * it. In remote-only mode it also reports the outcome through spill_done_fn
 * (KVT_EFULL when the queue is full). */
int kvti_remote_take(struct kvt_tier *t, struct kvti_snapshot *s);
/* Waits for uploads queued so far (absolute deadline; has = 0: forever).
 * 0 or KVT_ETIMEDOUT. */
int kvti_remote_drain(struct kvt_tier *t, const struct timespec *ts, int has);
/* Stops the upload thread (dropping queued uploads when drop). */
void kvti_remote_stop(struct kvt_tier *t, int drop);
void kvti_remote_free(struct kvt_tier *t);
/* 1 when promotes may consult the remote store. */
int kvti_remote_enabled(const struct kvt_tier *t);
/* Remote lookup for a promote (counts remote misses/errors). Fills info from
 * the remote manifest. Returns 0, KVT_ENOTFOUND (also when the remote is
 * unavailable: degraded, counted as an error). */
int kvti_remote_lookup(struct kvt_tier *t, kvt_entry_info *info,
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
