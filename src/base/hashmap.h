/*
 * hashmap.h - a small open-addressing multimap from 64-bit keys to 64-bit
 * values, used by the index mirror (exact SHA-256 keys, sequence keys and
 * prefix-trie nodes). Keys are already hashes, so the slot is the key's low
 * bits; linear probing with backward-shift deletion (no tombstones), so lookups
 * stay short after any mix of inserts and removals. Several values may share a
 * key (64-bit collisions are resolved by the caller confirming the candidate).
 * Load factor stays in (0.35, 0.7]: 16 bytes per slot, i.e. 23-46 bytes per
 * stored pair. Not thread-safe: the index's read-write lock protects it
 * (lookups are read-only and may run concurrently).
 */
#ifndef KVT_HASHMAP_H
#define KVT_HASHMAP_H

#include <stddef.h>
#include <stdint.h>

typedef struct kvti_hm_slot {
  uint64_t key; /* 0 = empty; callers' key 0 is stored as 1 (see kvti_hm_key) */
  uint64_t val;
} kvti_hm_slot;

typedef struct kvti_hm {
  kvti_hm_slot *s;
  size_t mask; /* capacity - 1 (capacity a power of two), 0 when unallocated */
  size_t n;
} kvti_hm;

static inline uint64_t kvti_hm_key(uint64_t k) {
  return k ? k : 1;
}

/* Reserves room for at least n pairs. Returns 0 or KVT_ENOMEM. */
int kvti_hm_reserve(kvti_hm *m, size_t n);
void kvti_hm_free(kvti_hm *m);
/* Adds a pair (duplicates allowed). Returns 0 or KVT_ENOMEM (map unchanged). */
int kvti_hm_add(kvti_hm *m, uint64_t key, uint64_t val);
/* Iteration over the values of key: *pos = 0 to start; returns a pointer to the
 * next matching slot (whose val may be modified in place) or NULL at the end.
 */
kvti_hm_slot *kvti_hm_next(const kvti_hm *m, uint64_t key, size_t *pos);
/* Removes the slot returned by kvti_hm_next (invalidates iteration). */
void kvti_hm_remove_slot(kvti_hm *m, kvti_hm_slot *slot);
/* Removes one (key, val) pair. Returns 1 if found, 0 otherwise. */
int kvti_hm_remove(kvti_hm *m, uint64_t key, uint64_t val);
/* Heap bytes used. */
size_t kvti_hm_bytes(const kvti_hm *m);

#endif
