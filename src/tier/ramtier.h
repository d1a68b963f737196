/*
 * ramtier.h - the tier's use of its host RAM cache (tier/hostcache.h, issue
 * 15): one call per hook in the tier's files - open/close, invalidation from
 * every path that removes or replaces an entry, the promote hit path, lending
 * entries read from disk, admitting written snapshots - plus the stats gauges.
 * The public kvt_tier_set_host_cache_bytes / kvt_tier_trim live here too.
 */
#ifndef KVT_RAMTIER_H
#define KVT_RAMTIER_H

#include "format/entry.h"
#include "index/chain.h"
#include "kvtier.h"

struct kvt_tier;

/* Creates the tier's cache (bound from kvt_options.host_cache_bytes; a cache
 * with bound 0 when it is 0). Returns 0 or KVT_ENOMEM. */
int kvti_ram_open(struct kvt_tier *t);
/* kvt_tier_close: empties it and refuses everything from now on (lent
 * entries freed later are simply freed); the gauges stay readable. */
void kvti_ram_close(struct kvt_tier *t);
/* Tier destruction: closes and drops the tier's reference. */
void kvti_ram_free(struct kvt_tier *t);
/* The stored version of hash is going away or being replaced (tier.c: the
 * removal paths sit below this file). */
void kvti_ram_invalidate(struct kvt_tier *t, const char *hash);
/* Chunks recs[0, n) were removed (evicted, quarantined): every cached entry or
 * prefix whose chain ran through one of them is dropped. */
void kvti_ram_invalidate_chunks(struct kvt_tier *t, const kvti_chain_rec *recs,
                                size_t n);
/* Promote hit path, called where the disk read would run (stripe held shared,
 * row re-checked): 0 with *out served from RAM (verified against the files),
 * or KVT_ENOTFOUND: not cached (or the copy failed the check) - read the
 * disk. Other codes: KVT_ENOMEM. */
int kvti_ram_promote(kvt_entry **out, struct kvt_tier *t, const char *hash,
                     const kvti_read_opts *ro);
/* The same for a chunk-aligned prefix no spill ended at (no index row; stripe
 * of hash held shared): served only while hash = the hash of ro's tokens
 * and their pure chain is stored (verified against its chunk files). */
int kvti_ram_promote_prefix(kvt_entry **out, struct kvt_tier *t,
                            const char *hash, const kvti_read_opts *ro);
/* After a successful local disk read: registers e so its buffers are admitted
 * when the caller frees it. */
void kvti_ram_after_disk(struct kvt_tier *t, kvt_entry *e,
                         const kvti_read_opts *ro);
/* The same after a prefix read (kvti_tier_chunks_get_prefix). */
void kvti_ram_after_prefix(struct kvt_tier *t, kvt_entry *e,
                           const kvti_read_opts *ro);
/* After the writer published s (disk_bytes on disk), on the writer thread:
 * admits its layers (a copy-mode snapshot's move in; a zero-copy one's are
 * copied, before the caller's buffers are released). */
void kvti_ram_spilled(struct kvt_tier *t, kvti_snapshot *s,
                      uint64_t disk_bytes);
/* Waits (deadline ts when has) until the RAM tier's cutter has done every
 * job queued before the call: freed chained entries cut into their tails and
 * chunks. Returns 0 or KVT_ETIMEDOUT (message set). */
struct timespec;
int kvti_ram_drain(struct kvt_tier *t, const struct timespec *ts, int has);
/* Bytes this thread has copied cutting entries into chunks and tails (for
 * tests: freeing an entry must not copy on the freeing thread). */
uint64_t kvti_ram_thread_cut_bytes(void);
/* A successful promote: promotes_from_ram/_disk and their bytes. */
void kvti_ram_account(struct kvt_tier *t, const kvt_entry *e);
/* Fills the host_cache_* fields of s. */
void kvti_ram_gauges(struct kvt_tier *t, kvt_stats *s);

#endif
