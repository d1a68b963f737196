/*
 * mirror.h - a local, in-memory mirror of which entries the remote store
 * holds, so that the tier's lookups (kvt_tier_lookup*, called from a
 * scheduler's synchronous path) answer a remote miss without a network round
 * trip. It is kept current by the store's own events: every kvtier process
 * that stores or removes an entry PUBLISHes it on the channel <P>events, and
 * the mirror's thread, subscribed to that channel, applies what it hears. On
 * every (re)connect it subscribes first and then resyncs from the prefix sets
 * (<P>{z:*}, <P>{s:*}: member = entry hash, score = length), so nothing
 * published while it was away is missed; while not in sync it says so and the
 * backend falls back to one bounded round trip. The mirror records, per entry,
 * its hash, its length and the prefix set it belongs to - exactly what a
 * longest-prefix lookup needs to pick candidates locally (each candidate is
 * confirmed by hashing the query's prefix, then by one GET of its manifest).
 *
 * Event grammar (one text message): "kvt1 + <kind> <name> <set> <len>" and
 * "kvt1 - <kind> <name>"; kind "e" = an entry; kind "c" = a chunk of the
 * chunked store: "kvt1 + c <key hex> <record>" (cmirror.h's text form) and
 * "kvt1 - c <key hex>". Other kinds are ignored (newer writers). With the
 * server's keyspace notifications on (notify-keyspace-events with E and e or
 * x), evicted and expired manifests and chunks leave the mirror too.
 * Thread-safe: lookups take a read lock; the thread and the backend's own puts
 * and removes take the write lock.
 */
#ifndef KVT_REDIS_MIRROR_H
#define KVT_REDIS_MIRROR_H

#include "index/chain.h"
#include "store/redis/rclient.h"

#include <stddef.h>
#include <stdint.h>

typedef struct kvr_mirror kvr_mirror;

/* Starts the mirror's thread on client cl (which it does not own) for key
 * prefix prefix. Returns 0, KVT_ENOMEM, or a thread error. */
int kvr_mirror_start(kvr_mirror **out, kvr_client *cl, const char *prefix);
/* Stops the thread (within one poll: it is woken) and frees the mirror. */
void kvr_mirror_stop(kvr_mirror *m);
/* 1 while the mirror is in sync with the store (subscribed and resynced). */
int kvr_mirror_synced(kvr_mirror *m);
/* Incremented by every added entry: a negative cache entry older than this
 * generation is stale. */
uint64_t kvr_mirror_gen(kvr_mirror *m);
/* The distinct lengths of the entries of prefix set set_id ("z:<hex>" /
 * "s:<token>") in [lo, hi], longest first, at most max; returns how many. A
 * query then hashes its prefix of each length and asks kvr_mirror_has: many
 * siblings of one length (a shared system prompt) cost one hash. */
size_t kvr_mirror_lengths(kvr_mirror *m, const char *set_id, uint64_t lo,
                          uint64_t hi, uint64_t *out, size_t max);
/* 1 when entry hash is mirrored (its length in *len when not NULL). */
int kvr_mirror_has(kvr_mirror *m, const char *hash, uint64_t *len);
/* Applies a put / a removal seen first-hand (this process's own writes, or a
 * lookup that found a mirrored entry gone). */
void kvr_mirror_put(kvr_mirror *m, const char *hash, const char *set_id,
                    uint64_t len);
void kvr_mirror_del(kvr_mirror *m, const char *hash);
/* The channel and the message of an event (for the backend's PUBLISH).
 * set_id NULL = a removal. Returns the length written (< cap). */
size_t kvr_mirror_channel(char *buf, size_t cap, const char *prefix);
size_t kvr_mirror_event(char *buf, size_t cap, const char *hash,
                        const char *set_id, uint64_t len);
/* Entries mirrored now (tests, stats). */
size_t kvr_mirror_count(kvr_mirror *m);

/* ---- chunks (cmirror.h) ---- */
void kvr_mirror_chunk_put(kvr_mirror *m, const kvti_chain_rec *rec);
void kvr_mirror_chunk_del(kvr_mirror *m, const uint8_t key[32]);
/* Longest mirrored chain over tokens (kvr_ctab_lookup); 0 while the mirror
 * is not in sync. */
size_t kvr_mirror_chunk_lookup(kvr_mirror *m, const uint8_t *ns, size_t ns_len,
                               const int32_t *tokens, size_t n,
                               uint32_t chunk_tokens, kvti_chain_rec *out,
                               size_t max);
size_t kvr_mirror_chunk_count(kvr_mirror *m);
/* A chunk event: rec != NULL = stored, NULL = gone. Length or 0. */
size_t kvr_mirror_chunk_event(char *buf, size_t cap, const uint8_t key[32],
                              const kvti_chain_rec *rec);
/* The chunk index shard key <P>{ci:<hex digit>} (shard 0..15). */
size_t kvr_mirror_chunk_index_key(char *buf, size_t cap, const char *prefix,
                                  int shard);

#endif
