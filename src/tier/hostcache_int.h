/*
 * hostcache_int.h - private to hostcache.c and hostcache_chunks.c: the
 * records, the lists and the cache's state, and the record operations both
 * use (all under the cache's mutex unless said otherwise).
 */
#ifndef KVT_TIER_HOSTCACHE_INT_H
#define KVT_TIER_HOSTCACHE_INT_H

#include "tier/hostcache.h"
#include "base/hashmap.h"

#include <pthread.h>

enum { RESIDENT = 1, LENT = 2 };

/* What a record is: a whole entry or an entry's tail (named by the entry's
 * hash, in map) or a chunk (named by its key, in chunks). */
enum { K_WHOLE = 0, K_TAIL = 1, K_CHUNK = 2 };

typedef struct rec {
  char hash[KVT_HASH_HEX_LEN + 1];
  uint64_t key;
  int state;
  int kind;
  kvti_hc_item it;   /* valid while RESIDENT (whole or tail) */
  kvti_hc_chunk *ch; /* K_CHUNK (always RESIDENT) */
  /* Pins of readers copying out of it without the mutex: a record dropped
   * while pinned leaves the map and its list at once (dead) and is freed by
   * its last unpin. */
  int pins, dead;
  uint64_t lend_id;
  /* LENT to the RAM tier's cutter (kvti_hc_take_whole, kvti_hc_mark_cut):
   * its tail and chunks are coming; kvti_hc_wait_cut waits for them. */
  int cutting;
  /* Chunked native store: the last chunk of the chain the cached rows come
   * from (has_chain), indexed in by_chain so that removing a chunk drops
   * every record through it (kvti_hc_invalidate_chains). */
  int has_chain;
  uint8_t chain[32];
  struct rec *prev, *next; /* in the resident LRU or the lent list */
  struct rec *gnext;       /* garbage list (records to free after unlock) */
} rec;

typedef struct list {
  rec *old, *young;
} list;

struct kvti_hcache {
  pthread_mutex_t mu;
  pthread_cond_t cut_cv; /* broadcast by settle: some record changed */
  int refs;
  int closed;
  uint64_t bound;
  kvti_bufpool *pool;
  kvti_hm map;
  kvti_hm by_chain; /* chain[0..8) -> records with has_chain */
  kvti_hm chunks;   /* chunk key[0..8) -> K_CHUNK records */
  list lru, lent;
  uint64_t next_id;
  /* Bumped by every kvti_hc_invalidate_chains: chunks read or built before
   * a removal are admitted only while it is unchanged (kvti_hc_epoch). */
  uint64_t epoch;
  kvti_hc_stats st;
};

/* ---- helpers ------------------------------------------------------------ */
uint64_t kvti_hci_key_of(const char *hash);
uint64_t kvti_hci_chain_key(const uint8_t chain[32]);
/* Tags r with chain (NULL: none), replacing any tag. Returns 0 or KVT_ENOMEM
 * (r then has no tag). Caller holds mu. */
int kvti_hci_set_chain(kvti_hcache *c, rec *r, const uint8_t *chain);
void kvti_hci_list_unlink(list *l, rec *r);
void kvti_hci_list_push(list *l, rec *r);
rec *kvti_hci_find(kvti_hcache *c, const char *hash, kvti_hm_slot **slot);
rec *kvti_hci_find_chunk(kvti_hcache *c, const uint8_t key[32]);
/* Moves a resident record to the young end of the LRU. Caller holds mu. */
void kvti_hci_touch(kvti_hcache *c, rec *r);
/* Removes r from the map and its list, adjusting the gauges; *charge receives
 * the bytes to uncharge. r goes onto *garbage. Caller holds mu. */
void kvti_hci_drop(kvti_hcache *c, rec *r, rec **garbage, int64_t *charge);
/* Evicts resident records, oldest first, until used <= target (sparing keep).
 * Caller holds mu. */
void kvti_hci_evict_to(kvti_hcache *c, uint64_t target, const rec *keep,
                       rec **garbage, int64_t *charge);
/* After unlocking: uncharge/charge the pool, then free what was dropped (the
 * buffers go back to the pool, which keeps them idle within its cap). */
void kvti_hci_settle(kvti_hcache *c, rec *garbage, int64_t charge);
/* ---- records ------------------------------------------------------------ */

/* Makes r resident with *it, charging it and evicting others for room. Caller
 * holds mu; r is in the map and in no list. */
void kvti_hci_admit(kvti_hcache *c, rec *r, kvti_hc_item *it, rec **g,
                    int64_t *charge);
/* Deletes r, which is in the map but in no list (no bytes charged). Caller
 * holds mu. */
void kvti_hci_drop_unlisted(kvti_hcache *c, rec *r, rec **g);

/* The record of hash if it is still the version lent under lend_id, else
 * NULL. */
rec *kvti_hci_find_lent(kvti_hcache *c, const char *hash, uint64_t lend_id);
/* The same, taken off the lent list for a give-back (NULL: nothing taken). */
rec *kvti_hci_take_lent(kvti_hcache *c, const char *hash, uint64_t lend_id);

#endif
