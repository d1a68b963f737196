/*
 * stats.h - the tier's counters: the reference's SSDCacheStats plus kvtier's,
 * kept in one kvt_stats under a mutex (updates are rare relative to I/O, and
 * the double latency sum needs one anyway). Gauges (entries, bytes, queue) are
 * filled in at snapshot time from the index and the spill queue. Renderings
 * (JSON with the reference's to_dict keys, Prometheus text) live in stats.c.
 */
#ifndef KVT_STATS_H
#define KVT_STATS_H

#include "kvtier.h"

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

typedef struct kvti_stats {
  pthread_mutex_t mu;
  kvt_stats s;
} kvti_stats;

void kvti_stats_init(kvti_stats *st);
void kvti_stats_destroy(kvti_stats *st);
/* Adds v to the uint64_t counter at offsetof(kvt_stats, field). */
void kvti_stats_add_at(kvti_stats *st, size_t offset, uint64_t v);
#define KVTI_STAT_ADD(st, field, v)                                            \
  kvti_stats_add_at((st), offsetof(kvt_stats, field), (uint64_t)(v))
/* A successful promote: hit, latency (seconds) and bytes read, under one lock.
 */
void kvti_stats_hit(kvti_stats *st, double latency_s, uint64_t bytes);
/* Copies the counters (gauges are left as stored: zero). */
void kvti_stats_copy(kvt_stats *out, kvti_stats *st);
/* Bytes of kvt_stats as version declared it (kvtier.h), 0 if unknown
 * (options.c, next to kvt_stats_init). */
size_t kvti_stats_size(unsigned int version);
/* Adds delta to a counter by name (see kvt_tier_stats_add). */
int kvti_stats_add_named(kvti_stats *st, const char *name, int64_t delta);

#endif
