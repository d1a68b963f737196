/*
 * hostcache.h - host RAM as a tier: an in-process cache of whole
 * entries (their verified layers, tensor buffers included) between the engine
 * and the SSD, so an entry spilled or promoted a moment ago comes back at
 * memory speed although kvtier's own writes and cold reads bypass the page
 * cache (O_DIRECT). It is filled from three sources: the writer's copy-mode
 * snapshots once they are on disk (native mode, moved in), zero-copy spills
 * (copied by the writer thread before it releases the caller's buffers, what
 * RAM lacks of them only), and the buffers of promoted entries when the
 * caller frees them (kvt_entry_free: kept as they are, a chained entry's cut
 * into tail and chunks later by the RAM tier's cutter, ramtier.c).
 *
 * Records and their states. A RESIDENT record owns its layers and counts
 * against the byte bound; an LRU list (oldest first) decides what goes when a
 * put, a return or a lowered bound needs room. A promote that hits TAKES the
 * layers (they become the kvt_entry handed to the caller, no copy) and leaves
 * a LENT record with a fresh lend id; freeing that entry GIVES the layers BACK,
 * which re-admits them only while the record still carries that id. Every
 * invalidation (replace, evict, remove, quarantine, retention) deletes the
 * record, so a stale version can never come back. With the chunked native
 * store an entry is held at chunk granularity instead (see "chunk
 * granularity" below): its tail plus one record per chunk, shared; the tail
 * and lent records are tagged with the last chunk of their chain, and
 * removing any chunk of that chain (eviction, quarantine) deletes them and
 * the chunk records removed (kvti_hc_invalidate_chains). Entries promoted from
 * disk are registered as LENT (kvti_hc_lend) so their buffers are admitted when
 * freed. The bytes of lent entries belong to the caller (its RAM budget) and
 * are not counted here.
 *
 * A hit is served only after the caller verified the layers against the
 * entry's files (manifest block checksums, as a disk read does: see
 * kvti_entry_verify_mem); this module stores and bounds, it does not judge.
 *
 * Budget: bytes held here are charged to the buffer pool given at creation
 * (kvti_bufpool_charge), whose own idle buffers then shrink by as much, so
 * cache + idle pool buffers share one budget; evicted buffers go back to that
 * pool (and are freed beyond its cap).
 *
 * Threads: every function is thread-safe (one mutex; buffers are freed outside
 * it). Lifetime: reference counted like the buffer pool - every lent entry
 * holds a reference, so an entry freed after its tier closed still finds a
 * (closed) cache that simply frees it.
 */
#ifndef KVT_HOSTCACHE_H
#define KVT_HOSTCACHE_H

#include "base/bufpool.h"
#include "format/chunk.h"
#include "kvtier.h"

#include <stdint.h>

typedef struct kvti_hcache kvti_hcache;

/* What a record holds: layers as a read builds them (tensor data from
 * kvti_buf_alloc, tensors/orig_dtypes arrays from kvti_malloc), and what the
 * rebuilt kvt_entry reports. */
typedef struct kvti_hc_item {
  kvt_layer *layers;
  uint32_t n_layers;
  uint64_t bytes; /* footprint (kvti_hc_layers_bytes), set by the cache */
  uint64_t memory_bytes;
  uint64_t disk_bytes; /* bytes of the entry's files */
  int storage_mode;
  /* Chunked native store: the key of the last chunk of the chain the rows
   * came from (kvti_hc_put tags the record with it; kvti_hc_take reports the
   * record's tag). */
  int has_chain;
  uint8_t chain[32];
  /* A chained entry's tail (kvti_hc_put_tail): its chunked layers hold only
   * the rows past the chain, the chain's rows are chunk records. */
  int is_tail;
} kvti_hc_item;

/* A chunk of the chunked native store held once in RAM, whatever the
 * entries and prefixes through it: its data section as the chunk file
 * stores it (the chunked layers' tensors in order, each [outer, n_tokens,
 * row] contiguous), described by layers (shapes with n_tokens on axis -2,
 * off/nbytes within data; tensors arrays kvti_malloc'ed per layer). Owned by
 * the cache once put, and never changed while cached. */
typedef struct kvti_hc_chunk {
  uint8_t key[32];
  uint32_t n_tokens, n_layers, spill_layers;
  kvti_chunk_layer *layers;
  uint8_t *data; /* kvti_malloc'ed, data_bytes */
  uint64_t data_bytes;
  uint64_t bytes; /* footprint (kvti_hc_chunk_bytes), set by the cache */
} kvti_hc_chunk;

typedef struct kvti_hc_stats {
  uint64_t bound;           /* bytes, now */
  uint64_t used;            /* bytes of resident records, now */
  uint64_t resident;        /* resident records, now */
  uint64_t lent;            /* lent records, now */
  uint64_t hits;            /* takes that found a resident record */
  uint64_t misses;          /* takes that did not (cache enabled) */
  uint64_t inserts;         /* records made resident by a put */
  uint64_t returns;         /* give-backs re-admitted */
  uint64_t evictions;       /* resident records dropped for room or a trim */
  uint64_t invalidations;   /* records deleted by kvti_hc_invalidate */
  uint64_t verify_failures; /* takes undone by kvti_hc_forget(.., 1) */
  uint64_t rejects;         /* puts/give-backs refused (too big, disabled) */
  uint64_t chunks;          /* resident chunk records, now (not in resident) */
  uint64_t chunk_bytes;     /* their bytes, now (part of used) */
  uint64_t chunk_inserts;   /* chunk records made resident */
} kvti_hc_stats;

/* Bound on lent records (each is ~100 bytes): beyond it the oldest are
 * forgotten (their entries are then freed normally). */
#define KVTI_HC_MAX_LENT 4096u

/* Creates a cache bounded by bound bytes (0: disabled - nothing is kept),
 * charging pool (may be NULL). Returns 0 or KVT_ENOMEM. */
int kvti_hc_create(kvti_hcache **out, uint64_t bound, kvti_bufpool *pool);
void kvti_hc_retain(kvti_hcache *c);
/* Drops a reference (accepts NULL); the last one frees everything. */
void kvti_hc_release(kvti_hcache *c);
/* Drops every record and refuses everything from now on (the tier closes);
 * lent entries given back later are freed. */
void kvti_hc_close(kvti_hcache *c);

/* Sets the bound and evicts down to it before returning. */
void kvti_hc_set_bound(kvti_hcache *c, uint64_t bound);
/* Evicts (LRU) until at most target bytes are used; the bound is unchanged.
 * Returns the bytes released. */
uint64_t kvti_hc_trim(kvti_hcache *c, uint64_t target);
void kvti_hc_get_stats(kvti_hcache *c, kvti_hc_stats *out);

/* Footprint of layers as the cache counts it: the buffer-pool capacity of each
 * tensor buffer (size class plus its header page) plus the arrays. */
uint64_t kvti_hc_layers_bytes(const kvt_layer *layers, uint32_t n);
/* Frees an item's layers (tensor buffers through kvti_buf_free). */
void kvti_hc_item_free(kvti_hc_item *it);

/* Makes it (ownership always passes) the resident version of hash, replacing
 * any record. Returns 1 when kept, 0 when freed (disabled, closed, larger
 * than the bound, no memory). */
int kvti_hc_put(kvti_hcache *c, const char *hash, kvti_hc_item *it);
/* On a resident record: moves its item to *out, marks it lent and returns 1
 * with *lend_id. Otherwise 0 (counted as a miss while enabled). */
int kvti_hc_take(kvti_hcache *c, const char *hash, kvti_hc_item *out,
                 uint64_t *lend_id);
/* The same for the RAM tier's own compaction of a whole record of a chained
 * entry into its tail and chunks: takes only a record tagged with chain (32
 * bytes) and counts neither a hit nor a miss. */
int kvti_hc_take_whole(kvti_hcache *c, const char *hash, const uint8_t *chain,
                       kvti_hc_item *out, uint64_t *lend_id);
/* Marks the lent record of hash (lend_id) as being cut by the RAM tier's
 * cutter (a prefix handed to it). Returns 1, or 0 when it is not lent under
 * that id. */
int kvti_hc_mark_cut(kvti_hcache *c, const char *hash, uint64_t lend_id);
/* While the record of hash is lent to the cutter (taken by
 * kvti_hc_take_whole or marked), waits until it is given back, forgotten or
 * dropped: its pieces are a memory copy away, cheaper than the disk read a
 * miss would cost. Returns 1 when it waited. */
int kvti_hc_wait_cut(kvti_hcache *c, const char *hash);
/* 1 when hash has a resident record now (a take would find it), else 0. */
int kvti_hc_resident(kvti_hcache *c, const char *hash);
/* Undoes a take whose item the caller could not use: the record is deleted
 * (the caller frees the item). verify_failed: count it as a verification
 * failure and a miss instead of a hit. */
void kvti_hc_forget(kvti_hcache *c, const char *hash, uint64_t lend_id,
                    int verify_failed);
/* Registers an entry read from disk as lent so its buffers are admitted when
 * freed. Returns 1 and *lend_id, or 0 (disabled, closed, a resident version
 * exists, no memory). */
int kvti_hc_lend(kvti_hcache *c, const char *hash, uint64_t *lend_id);
/* The same for rows read from a chain: the record is tagged with chain (the
 * last chunk's key; NULL: untagged) for kvti_hc_invalidate_chains. */
int kvti_hc_lend_chain(kvti_hcache *c, const char *hash, const uint8_t *chain,
                       uint64_t *lend_id);
/* Returns a lent item (ownership passes): re-admitted as resident (1) when the
 * record still carries lend_id and it fits the bound, else freed (0). */
int kvti_hc_give_back(kvti_hcache *c, const char *hash, uint64_t lend_id,
                      kvti_hc_item *it);
/* Deletes hash's record, whatever its state. */
void kvti_hc_invalidate(kvti_hcache *c, const char *hash);
/* Deletes every record tagged with one of n chunk keys (32 bytes each, at
 * keys + i * stride: an array of structs that start with the key works), in
 * any state, and the chunk records of those keys: the chunks are gone, so
 * nothing cached through them stays. Returns how many tagged records were
 * deleted (chunk records not counted). */
size_t kvti_hc_invalidate_chains(kvti_hcache *c, const uint8_t *keys,
                                 size_t stride, size_t n);

/* ---- chunk granularity (the chunked native store) ----
 * A chained entry is cached as its tail (a record named by the entry, tagged
 * with its chain's last chunk) plus one record per chunk of its chain, keyed
 * by the chunk's key and shared by every entry and prefix through it; all
 * records share one LRU and one bound, so a chunk stays while anything
 * using it is used. Readers pin what they copy from (kvti_hc_pin_*): no copy
 * is made under the mutex, and a record dropped meanwhile is freed by its
 * last unpin. Chunk records are dropped by kvti_hc_invalidate_chains (their
 * key among the removed ones) and kvti_hc_drop_chain. */

/* Footprint of a chunk as the cache counts it: data, descriptors, record. */
uint64_t kvti_hc_chunk_bytes(const kvti_hc_chunk *ch);
void kvti_hc_chunk_free(kvti_hc_chunk *ch); /* accepts NULL */
/* The invalidation epoch: read it before resolving a chain whose chunks are
 * to be put; a put with an older epoch admits nothing (a chunk of that chain
 * may have been removed meanwhile). */
uint64_t kvti_hc_epoch(kvti_hcache *c);
/* have[i] = 1 when the chunk with key keys + i * stride is resident (the
 * caller then need not build it; it is LRU-touched, the caller's entry
 * uses it). Returns how many are. */
size_t kvti_hc_chunks_resident(kvti_hcache *c, const uint8_t *keys,
                               size_t stride, size_t m, uint8_t *have);
/* Makes chunks chs[0, n) resident (NULL slots skipped; ownership of every
 * one passes: those already resident, refused or put with a stale epoch are
 * freed; every slot is NULL after). Returns how many were kept. */
size_t kvti_hc_put_chunks(kvti_hcache *c, kvti_hc_chunk **chs, size_t n,
                          uint64_t epoch);
/* The resident tail of hash replaces any record of hash, with chunks chs
 * (as kvti_hc_put_chunks); tail->has_chain names its chain. Ownership of
 * everything passes. Returns 1 when the tail is kept. */
int kvti_hc_put_tail(kvti_hcache *c, const char *hash, kvti_hc_item *tail,
                     kvti_hc_chunk **chs, size_t n, uint64_t epoch);
/* Gives back a lent chained entry cut into its tail (NULL for a prefix,
 * whose chunks are all it is) and the chunks not yet resident: admitted only
 * while the record still carries lend_id (an invalidation, a replacement or
 * a removal of any chunk of its chain deletes it). Ownership passes. Returns
 * 1 when admitted. */
int kvti_hc_give_back_tail(kvti_hcache *c, const char *hash, uint64_t lend_id,
                           kvti_hc_item *tail, kvti_hc_chunk **chs, size_t n);

typedef struct kvti_hc_ref kvti_hc_ref; /* a pinned record */
/* Pins the resident tail of hash (LRU-touched): 1 with *ref and *it (valid
 * until kvti_hc_unpin), else 0. Counts neither hit nor miss. */
int kvti_hc_pin_tail(kvti_hcache *c, const char *hash, kvti_hc_ref **ref,
                     const kvti_hc_item **it);
/* Pins every resident chunk of keys[0, m) (LRU-touched); refs[i] NULL for
 * the others. Returns how many were pinned. */
size_t kvti_hc_pin_chunks(kvti_hcache *c, const uint8_t *keys, size_t stride,
                          size_t m, kvti_hc_ref **refs);
const kvti_hc_chunk *kvti_hc_ref_chunk(const kvti_hc_ref *ref);
/* Unpins refs[0, n) (NULL skipped; every slot NULL after). */
void kvti_hc_unpin(kvti_hcache *c, kvti_hc_ref **refs, size_t n);
/* Counts a chained lookup: a hit, or a miss (verify_failed: the copy failed
 * its check). */
void kvti_hc_count(kvti_hcache *c, int hit, int verify_failed);
/* Deletes the tail of hash (NULL: none) and the chunk records of keys[0, m):
 * a copy assembled from them failed its check. */
void kvti_hc_drop_chain(kvti_hcache *c, const char *hash, const uint8_t *keys,
                        size_t stride, size_t m);

/* The default bound (kvt_options.host_cache_bytes = KVT_HOST_CACHE_AUTO): 1/8
 * of the memory this process may use, i.e. the smallest of physical RAM, the
 * cgroup v2 limit (/sys/fs/cgroup/memory.max) and the cgroup v1 limit
 * (/sys/fs/cgroup/memory/memory.limit_in_bytes). */
uint64_t kvti_hc_default_bytes(void);
/* The smallest of phys and the limits in the files at v2 and v1 (either may be
 * NULL or missing; "max" or an unparsable/huge value means no limit). */
uint64_t kvti_hc_memory_limit(const char *v2, const char *v1, uint64_t phys);

#endif
