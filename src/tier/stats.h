/*
 * stats.h - the tier's counters: the reference's SSDCacheStats plus kvtier's,
 * kept in one kvt_stats under a mutex (updates are rare relative to I/O, and
 * the double latency sum needs one anyway). Gauges (entries, bytes, queue) are
 * filled in at snapshot time from the index and the spill queue. Renderings
 * (JSON with the reference's to_dict keys, Prometheus text) live in stats.c.
 * A writable tier also publishes every update to its live stats file
 * (statsfile.h), under the same mutex.
 */
#ifndef KVT_STATS_H
#define KVT_STATS_H

#include "kvtier.h"
#include "tier/statsfile.h"

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

typedef struct kvti_stats {
  pthread_mutex_t mu;
  kvt_stats s;         /* gauges: as of the last refresh */
  kvti_statsfile *pub; /* the live stats file, or NULL */
} kvti_stats;

void kvti_stats_init(kvti_stats *st);
void kvti_stats_destroy(kvti_stats *st);
/* Adds v to the uint64_t counter at offsetof(kvt_stats, field). */
void kvti_stats_add_at(kvti_stats *st, size_t offset, uint64_t v);
#define KVTI_STAT_ADD(st, field, v)                                            \
  kvti_stats_add_at((st), offsetof(kvt_stats, field), (uint64_t)(v))
/* A successful promote: hit, latency (seconds), bytes read and tokens
 * returned, under one lock. */
void kvti_stats_hit(kvti_stats *st, double latency_s, uint64_t bytes,
                    uint64_t tokens);
/* An entry the writer stored locally: count, bytes, latency (seconds). */
void kvti_stats_spilled(kvti_stats *st, uint64_t bytes, double latency_s);
/* Starts publishing to dir/stats.bin (writable tiers). Returns 0 or a code. */
int kvti_stats_attach(kvti_stats *st, const char *dir, mode_t mode);
/* Publishes once more, marks the file closed and stops. Idempotent. */
void kvti_stats_detach(kvti_stats *st);
/* Stores the gauges of g (entries, bytes, queues, remote) into the counters
 * and publishes them. */
void kvti_stats_set_gauges(kvti_stats *st, const kvt_stats *g);
/* Stores only the write budget's gauges of g (bytes_written_today,
 * write_budget_*, ssd_lifetime_years) and publishes them: admission's
 * decisions change them without a write that would refresh the rest. */
void kvti_stats_set_budget_gauges(kvti_stats *st, const kvt_stats *g);
/* Copies the counters (gauges are left as stored: zero). */
void kvti_stats_copy(kvt_stats *out, kvti_stats *st);
/* Bytes of kvt_stats as version declared it (kvtier.h), 0 if unknown
 * (options.c, next to kvt_stats_init). */
size_t kvti_stats_size(unsigned int version);
/* A spill call refused with code rc (nonzero): adds 1 to the
 * spill_refused_* counter of its reason (kvtier.h, version 3). */
void kvti_stats_refused(kvti_stats *st, int rc);
/* Adds delta to a counter by name (see kvt_tier_stats_add). */
int kvti_stats_add_named(kvti_stats *st, const char *name, int64_t delta);

#endif
