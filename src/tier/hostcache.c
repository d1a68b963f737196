/*
 * hostcache.c - the host RAM cache's records (see hostcache.h): a hash map from
 * the entry name's first 64 bits to records (the full name confirms), a
 * resident LRU list and a lent list, both oldest first. Under the mutex only
 * links and counters change; items dropped by an operation are collected and
 * freed after unlocking, once the pool charge no longer counts them (so their
 * buffers can stay idle in the pool within its cap).
 */
#include "tier/hostcache.h"
#include "base/error.h"
#include "base/hashmap.h"
#include "base/io.h"
#include "format/dtype.h"
#include "format/layer.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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

static uint64_t key_of(const char *hash) {
  uint64_t k = 0;
  for (int i = 0; i < 16 && hash[i]; i++) {
    char ch = hash[i];
    unsigned v = ch >= 'a' ? (unsigned)(ch - 'a' + 10) : (unsigned)(ch - '0');
    k = k << 4 | (v & 15u);
  }
  return kvti_hm_key(k);
}

static uint64_t chain_key(const uint8_t chain[32]) {
  uint64_t k;
  memcpy(&k, chain, sizeof k);
  return kvti_hm_key(k);
}

/* Tags r with chain (NULL: none), replacing any tag. Returns 0 or KVT_ENOMEM
 * (r then has no tag). Caller holds mu. */
static int set_chain(kvti_hcache *c, rec *r, const uint8_t *chain) {
  if (r->has_chain)
    kvti_hm_remove(&c->by_chain, chain_key(r->chain), (uint64_t)(uintptr_t)r);
  r->has_chain = 0;
  if (!chain)
    return 0;
  if (kvti_hm_add(&c->by_chain, chain_key(chain), (uint64_t)(uintptr_t)r))
    return KVT_ENOMEM;
  memcpy(r->chain, chain, 32);
  r->has_chain = 1;
  return 0;
}

static void list_unlink(list *l, rec *r) {
  if (r->prev)
    r->prev->next = r->next;
  else
    l->old = r->next;
  if (r->next)
    r->next->prev = r->prev;
  else
    l->young = r->prev;
  r->prev = r->next = NULL;
}

static void list_push(list *l, rec *r) {
  r->next = NULL;
  r->prev = l->young;
  if (l->young)
    l->young->next = r;
  else
    l->old = r;
  l->young = r;
}

static rec *find(kvti_hcache *c, const char *hash, kvti_hm_slot **slot) {
  size_t pos = 0;
  kvti_hm_slot *s;
  uint64_t k = key_of(hash);
  while ((s = kvti_hm_next(&c->map, k, &pos)) != NULL) {
    rec *r = (rec *)(uintptr_t)s->val;
    if (strcmp(r->hash, hash) == 0) {
      if (slot)
        *slot = s;
      return r;
    }
  }
  return NULL;
}

static rec *find_chunk(kvti_hcache *c, const uint8_t key[32]) {
  size_t pos = 0;
  kvti_hm_slot *s;
  while ((s = kvti_hm_next(&c->chunks, chain_key(key), &pos)) != NULL) {
    rec *r = (rec *)(uintptr_t)s->val;
    if (memcmp(r->ch->key, key, 32) == 0)
      return r;
  }
  return NULL;
}

/* Moves a resident record to the young end of the LRU. Caller holds mu. */
static void touch(kvti_hcache *c, rec *r) {
  list_unlink(&c->lru, r);
  list_push(&c->lru, r);
}

/* Removes r from the map and its list, adjusting the gauges; *charge receives
 * the bytes to uncharge. r goes onto *garbage. Caller holds mu. */
static void drop(kvti_hcache *c, rec *r, rec **garbage, int64_t *charge) {
  if (r->kind == K_CHUNK) {
    kvti_hm_remove(&c->chunks, r->key, (uint64_t)(uintptr_t)r);
    list_unlink(&c->lru, r);
    c->st.used -= r->ch->bytes;
    c->st.chunks--;
    c->st.chunk_bytes -= r->ch->bytes;
    *charge -= (int64_t)r->ch->bytes;
  } else {
    kvti_hm_remove(&c->map, r->key, (uint64_t)(uintptr_t)r);
    set_chain(c, r, NULL);
    if (r->state == RESIDENT) {
      list_unlink(&c->lru, r);
      c->st.used -= r->it.bytes;
      c->st.resident--;
      *charge -= (int64_t)r->it.bytes;
    } else {
      list_unlink(&c->lent, r);
      c->st.lent--;
    }
  }
  if (r->pins) { /* its last unpin frees it */
    r->dead = 1;
    return;
  }
  r->gnext = *garbage;
  *garbage = r;
}

/* Evicts resident records, oldest first, until used <= target (sparing keep).
 * Caller holds mu. */
static void evict_to(kvti_hcache *c, uint64_t target, const rec *keep,
                     rec **garbage, int64_t *charge) {
  rec *r = c->lru.old;
  while (r && c->st.used > target) {
    rec *next = r->next;
    if (r != keep) {
      drop(c, r, garbage, charge);
      c->st.evictions++;
    }
    r = next;
  }
}

/* After unlocking: uncharge/charge the pool, then free what was dropped (the
 * buffers go back to the pool, which keeps them idle within its cap). */
static void settle(kvti_hcache *c, rec *garbage, int64_t charge) {
  /* Every change of state ends here (after the mutex is released): wakes
   * kvti_hc_wait_cut, which re-checks under the mutex. */
  pthread_cond_broadcast(&c->cut_cv);
  if (charge && c->pool)
    kvti_bufpool_charge(c->pool, charge);
  while (garbage) {
    rec *next = garbage->gnext;
    if (garbage->kind == K_CHUNK)
      kvti_hc_chunk_free(garbage->ch);
    else if (garbage->state == RESIDENT)
      kvti_hc_item_free(&garbage->it);
    kvti_free(garbage);
    garbage = next;
  }
}

uint64_t kvti_hc_layers_bytes(const kvt_layer *layers, uint32_t n) {
  uint64_t b = (uint64_t)n * sizeof(kvt_layer);
  for (uint32_t i = 0; layers && i < n; i++) {
    const kvt_layer *l = &layers[i];
    b += (uint64_t)l->num_tensors * (sizeof(kvt_tensor) + sizeof(int32_t));
    for (uint32_t j = 0; l->tensors && j < l->num_tensors; j++) {
      uint64_t nb = l->tensors[j].nbytes;
      /* kvti_buf_alloc: pooled blocks (one header page + a size class) from
       * 64 KiB, small ones malloc'ed with 80 bytes of overhead. */
      b += nb >= ((uint64_t)64 << 10)
               ? (uint64_t)kvti_bufpool_class((size_t)nb + KVTI_BUF_ALIGN)
               : nb + 80;
    }
  }
  return b;
}

void kvti_hc_item_free(kvti_hc_item *it) {
  if (!it || !it->layers)
    return;
  for (uint32_t i = 0; i < it->n_layers; i++)
    kvti_layer_release(&it->layers[i], 0, NULL, NULL);
  kvti_free(it->layers);
  it->layers = NULL;
  it->n_layers = 0;
}

/* ---- lifetime ----------------------------------------------------------- */

int kvti_hc_create(kvti_hcache **out, uint64_t bound, kvti_bufpool *pool) {
  kvti_hcache *c = kvti_calloc(1, sizeof *c);
  if (!c)
    return KVT_ERR_NOMEM();
  if (pthread_mutex_init(&c->mu, NULL) != 0) {
    kvti_free(c);
    return KVT_ERR_NOMEM();
  }
  if (pthread_cond_init(&c->cut_cv, NULL) != 0) {
    pthread_mutex_destroy(&c->mu);
    kvti_free(c);
    return KVT_ERR_NOMEM();
  }
  c->refs = 1;
  c->bound = bound;
  c->st.bound = bound;
  c->pool = pool;
  if (pool)
    kvti_bufpool_retain(pool);
  *out = c;
  return 0;
}

void kvti_hc_retain(kvti_hcache *c) {
  pthread_mutex_lock(&c->mu);
  c->refs++;
  pthread_mutex_unlock(&c->mu);
}

/* Drops every record. Caller holds mu. */
static void drop_all(kvti_hcache *c, rec **garbage, int64_t *charge) {
  while (c->lru.old)
    drop(c, c->lru.old, garbage, charge);
  while (c->lent.old)
    drop(c, c->lent.old, garbage, charge);
}

void kvti_hc_close(kvti_hcache *c) {
  if (!c)
    return;
  rec *g = NULL;
  int64_t charge = 0;
  pthread_mutex_lock(&c->mu);
  c->closed = 1;
  drop_all(c, &g, &charge);
  pthread_mutex_unlock(&c->mu);
  settle(c, g, charge);
}

void kvti_hc_release(kvti_hcache *c) {
  if (!c)
    return;
  rec *g = NULL;
  int64_t charge = 0;
  pthread_mutex_lock(&c->mu);
  int last = --c->refs == 0;
  if (last)
    drop_all(c, &g, &charge);
  pthread_mutex_unlock(&c->mu);
  if (!last)
    return;
  settle(c, g, charge);
  kvti_hm_free(&c->map);
  kvti_hm_free(&c->by_chain);
  kvti_hm_free(&c->chunks);
  kvti_bufpool_release(c->pool);
  pthread_cond_destroy(&c->cut_cv);
  pthread_mutex_destroy(&c->mu);
  kvti_free(c);
}

/* ---- bound -------------------------------------------------------------- */

void kvti_hc_set_bound(kvti_hcache *c, uint64_t bound) {
  rec *g = NULL;
  int64_t charge = 0;
  pthread_mutex_lock(&c->mu);
  c->bound = bound;
  c->st.bound = bound;
  evict_to(c, bound, NULL, &g, &charge);
  pthread_mutex_unlock(&c->mu);
  settle(c, g, charge);
}

uint64_t kvti_hc_trim(kvti_hcache *c, uint64_t target) {
  rec *g = NULL;
  int64_t charge = 0;
  pthread_mutex_lock(&c->mu);
  evict_to(c, target, NULL, &g, &charge);
  pthread_mutex_unlock(&c->mu);
  settle(c, g, charge);
  return (uint64_t)-charge;
}

void kvti_hc_get_stats(kvti_hcache *c, kvti_hc_stats *out) {
  pthread_mutex_lock(&c->mu);
  *out = c->st;
  pthread_mutex_unlock(&c->mu);
}

/* ---- records ------------------------------------------------------------ */

/* Makes r resident with *it, charging it and evicting others for room. Caller
 * holds mu; r is in the map and in no list. */
static void admit(kvti_hcache *c, rec *r, kvti_hc_item *it, rec **g,
                  int64_t *charge) {
  r->state = RESIDENT;
  r->kind = it->is_tail ? K_TAIL : K_WHOLE;
  r->it = *it;
  r->lend_id = 0;
  list_push(&c->lru, r);
  c->st.used += it->bytes;
  c->st.resident++;
  *charge += (int64_t)it->bytes;
  evict_to(c, c->bound, r, g, charge);
}

int kvti_hc_put(kvti_hcache *c, const char *hash, kvti_hc_item *it) {
  it->bytes = kvti_hc_layers_bytes(it->layers, it->n_layers);
  rec *fresh = kvti_calloc(1, sizeof *fresh);
  rec *g = NULL;
  int64_t charge = 0;
  int kept = 0;
  pthread_mutex_lock(&c->mu);
  rec *r = find(c, hash, NULL);
  if (r) /* the new version replaces whatever was there (a lent old version
            is then never re-admitted) */
    drop(c, r, &g, &charge);
  if (!fresh || c->closed || it->bytes > c->bound ||
      kvti_hm_add(&c->map, key_of(hash), (uint64_t)(uintptr_t)fresh) != 0) {
    c->st.rejects++;
  } else if (set_chain(c, fresh, it->has_chain ? it->chain : NULL) != 0) {
    /* Untagged, a chunk's removal could not find it: not kept. */
    kvti_hm_remove(&c->map, key_of(hash), (uint64_t)(uintptr_t)fresh);
    c->st.rejects++;
  } else {
    snprintf(fresh->hash, sizeof fresh->hash, "%s", hash);
    fresh->key = key_of(hash);
    admit(c, fresh, it, &g, &charge);
    c->st.inserts++;
    kept = 1;
    fresh = NULL;
  }
  pthread_mutex_unlock(&c->mu);
  settle(c, g, charge);
  kvti_free(fresh);
  if (!kept)
    kvti_hc_item_free(it);
  return kept;
}

/* Deletes r, which is in the map but in no list (no bytes charged). Caller
 * holds mu. */
static void drop_unlisted(kvti_hcache *c, rec *r, rec **g) {
  kvti_hm_remove(&c->map, r->key, (uint64_t)(uintptr_t)r);
  set_chain(c, r, NULL);
  r->state = LENT;
  r->gnext = *g;
  *g = r;
}

/* Registers r (already in the map, in no list) as lent with a fresh id,
 * forgetting the oldest lent records beyond KVTI_HC_MAX_LENT. Caller holds
 * mu. */
static uint64_t lend_locked(kvti_hcache *c, rec *r, rec **g, int64_t *charge) {
  r->state = LENT;
  r->kind = K_WHOLE;
  r->cutting = 0;
  r->lend_id = ++c->next_id;
  memset(&r->it, 0, sizeof r->it);
  list_push(&c->lent, r);
  c->st.lent++;
  while (c->st.lent > KVTI_HC_MAX_LENT && c->lent.old != r)
    drop(c, c->lent.old, g, charge);
  return r->lend_id;
}

/* kvti_hc_take and kvti_hc_take_whole: chain non-NULL takes only a record
 * tagged with it, and counts neither a hit nor a miss. */
static int take(kvti_hcache *c, const char *hash, const uint8_t *chain,
                kvti_hc_item *out, uint64_t *lend_id) {
  rec *g = NULL;
  int64_t charge = 0;
  int hit = 0;
  pthread_mutex_lock(&c->mu);
  if (c->bound > 0 && !c->closed) {
    rec *r = find(c, hash, NULL);
    if (r && chain &&
        !(r->has_chain && memcmp(r->chain, chain, sizeof r->chain) == 0))
      r = NULL;
    if (r && r->state == RESIDENT && r->kind == K_WHOLE && !r->pins) {
      *out = r->it;
      out->has_chain = r->has_chain;
      memcpy(out->chain, r->chain, sizeof out->chain);
      list_unlink(&c->lru, r);
      c->st.used -= r->it.bytes;
      c->st.resident--;
      charge -= (int64_t)r->it.bytes;
      *lend_id = lend_locked(c, r, &g, &charge);
      r->cutting = chain != NULL;
      if (!chain)
        c->st.hits++;
      hit = 1;
    } else if (!chain) {
      c->st.misses++;
    }
  }
  pthread_mutex_unlock(&c->mu);
  settle(c, g, charge);
  return hit;
}

int kvti_hc_take(kvti_hcache *c, const char *hash, kvti_hc_item *out,
                 uint64_t *lend_id) {
  return take(c, hash, NULL, out, lend_id);
}

int kvti_hc_take_whole(kvti_hcache *c, const char *hash, const uint8_t *chain,
                       kvti_hc_item *out, uint64_t *lend_id) {
  return take(c, hash, chain, out, lend_id);
}

int kvti_hc_mark_cut(kvti_hcache *c, const char *hash, uint64_t lend_id) {
  pthread_mutex_lock(&c->mu);
  rec *r = find(c, hash, NULL);
  int ok = r && r->state == LENT && r->lend_id == lend_id && !c->closed;
  if (ok)
    r->cutting = 1;
  pthread_mutex_unlock(&c->mu);
  return ok;
}

int kvti_hc_wait_cut(kvti_hcache *c, const char *hash) {
  int waited = 0;
  pthread_mutex_lock(&c->mu);
  for (;;) {
    rec *r = c->closed ? NULL : find(c, hash, NULL);
    if (!r || r->state != LENT || !r->cutting)
      break;
    waited = 1;
    pthread_cond_wait(&c->cut_cv, &c->mu);
  }
  pthread_mutex_unlock(&c->mu);
  return waited;
}

int kvti_hc_resident(kvti_hcache *c, const char *hash) {
  pthread_mutex_lock(&c->mu);
  rec *r = c->bound > 0 && !c->closed ? find(c, hash, NULL) : NULL;
  int yes = r && r->state == RESIDENT && r->kind == K_WHOLE;
  pthread_mutex_unlock(&c->mu);
  return yes;
}

void kvti_hc_forget(kvti_hcache *c, const char *hash, uint64_t lend_id,
                    int verify_failed) {
  rec *g = NULL;
  int64_t charge = 0;
  pthread_mutex_lock(&c->mu);
  rec *r = find(c, hash, NULL);
  if (r && r->state == LENT && r->lend_id == lend_id)
    drop(c, r, &g, &charge);
  if (verify_failed) {
    c->st.verify_failures++;
    if (c->st.hits)
      c->st.hits--;
    c->st.misses++;
  }
  pthread_mutex_unlock(&c->mu);
  settle(c, g, charge);
}

int kvti_hc_lend(kvti_hcache *c, const char *hash, uint64_t *lend_id) {
  return kvti_hc_lend_chain(c, hash, NULL, lend_id);
}

int kvti_hc_lend_chain(kvti_hcache *c, const char *hash, const uint8_t *chain,
                       uint64_t *lend_id) {
  rec *fresh = kvti_calloc(1, sizeof *fresh);
  rec *g = NULL;
  int64_t charge = 0;
  int ok = 0;
  pthread_mutex_lock(&c->mu);
  if (c->bound > 0 && !c->closed) {
    rec *r = find(c, hash, NULL);
    if (r && r->state == LENT) {
      /* Promoted again while the earlier copy is out: the latest copy is the
       * one re-admitted. */
      list_unlink(&c->lent, r);
      c->st.lent--;
      if (set_chain(c, r, chain) != 0) {
        drop_unlisted(c, r, &g);
      } else {
        *lend_id = lend_locked(c, r, &g, &charge);
        ok = 1;
      }
    } else if (!r && fresh &&
               kvti_hm_add(&c->map, key_of(hash), (uint64_t)(uintptr_t)fresh) ==
                   0) {
      snprintf(fresh->hash, sizeof fresh->hash, "%s", hash);
      fresh->key = key_of(hash);
      if (set_chain(c, fresh, chain) != 0) {
        kvti_hm_remove(&c->map, fresh->key, (uint64_t)(uintptr_t)fresh);
      } else {
        *lend_id = lend_locked(c, fresh, &g, &charge);
        fresh = NULL;
        ok = 1;
      }
    }
  }
  pthread_mutex_unlock(&c->mu);
  settle(c, g, charge);
  kvti_free(fresh);
  return ok;
}

int kvti_hc_give_back(kvti_hcache *c, const char *hash, uint64_t lend_id,
                      kvti_hc_item *it) {
  it->bytes = kvti_hc_layers_bytes(it->layers, it->n_layers);
  rec *g = NULL;
  int64_t charge = 0;
  int kept = 0;
  pthread_mutex_lock(&c->mu);
  rec *r = find(c, hash, NULL);
  if (r && r->state == LENT && r->lend_id == lend_id) {
    list_unlink(&c->lent, r);
    c->st.lent--;
    if (!c->closed && it->bytes <= c->bound) {
      admit(c, r, it, &g, &charge);
      c->st.returns++;
      kept = 1;
    } else {
      drop_unlisted(c, r, &g); /* not coming back */
      c->st.rejects++;
    }
  }
  pthread_mutex_unlock(&c->mu);
  settle(c, g, charge);
  if (!kept)
    kvti_hc_item_free(it);
  return kept;
}

void kvti_hc_invalidate(kvti_hcache *c, const char *hash) {
  rec *g = NULL;
  int64_t charge = 0;
  pthread_mutex_lock(&c->mu);
  rec *r = find(c, hash, NULL);
  if (r) {
    drop(c, r, &g, &charge);
    c->st.invalidations++;
  }
  pthread_mutex_unlock(&c->mu);
  settle(c, g, charge);
}

size_t kvti_hc_invalidate_chains(kvti_hcache *c, const uint8_t *keys,
                                 size_t stride, size_t n) {
  rec *g = NULL;
  int64_t charge = 0;
  size_t dropped = 0;
  pthread_mutex_lock(&c->mu);
  c->epoch++;
  for (size_t i = 0; c->chunks.n && i < n; i++) {
    rec *r = find_chunk(c, keys + i * stride);
    if (r) {
      drop(c, r, &g, &charge);
      c->st.invalidations++;
    }
  }
  for (size_t i = 0; c->by_chain.n && i < n; i++) {
    const uint8_t *k = keys + i * stride;
    size_t pos = 0;
    kvti_hm_slot *s;
    /* drop() edits the map: restart the scan after each removal. */
    while ((s = kvti_hm_next(&c->by_chain, chain_key(k), &pos)) != NULL) {
      rec *r = (rec *)(uintptr_t)s->val;
      if (memcmp(r->chain, k, 32) != 0)
        continue;
      drop(c, r, &g, &charge);
      c->st.invalidations++;
      dropped++;
      pos = 0;
    }
  }
  pthread_mutex_unlock(&c->mu);
  settle(c, g, charge);
  return dropped;
}

/* ---- chunks and tails -------------------------------------------------- */

uint64_t kvti_hc_chunk_bytes(const kvti_hc_chunk *ch) {
  uint64_t b = sizeof(rec) + sizeof *ch + ch->data_bytes +
               (uint64_t)ch->n_layers * sizeof(kvti_chunk_layer);
  for (uint32_t i = 0; ch->layers && i < ch->n_layers; i++)
    b += (uint64_t)ch->layers[i].num_tensors * sizeof(kvti_chunk_tensor);
  return b;
}

void kvti_hc_chunk_free(kvti_hc_chunk *ch) {
  if (!ch)
    return;
  for (uint32_t i = 0; ch->layers && i < ch->n_layers; i++)
    kvti_free(ch->layers[i].tensors);
  kvti_free(ch->layers);
  kvti_free(ch->data);
  kvti_free(ch);
}

uint64_t kvti_hc_epoch(kvti_hcache *c) {
  pthread_mutex_lock(&c->mu);
  uint64_t e = c->epoch;
  pthread_mutex_unlock(&c->mu);
  return e;
}

/* Makes chunk ch resident unless its key already is (then *dup is set and
 * nothing changes). Returns 1 kept, 0 not (caller frees). Caller holds mu. */
static int admit_chunk(kvti_hcache *c, kvti_hc_chunk *ch, int64_t *charge) {
  ch->bytes = kvti_hc_chunk_bytes(ch);
  if (c->closed || ch->bytes > c->bound || find_chunk(c, ch->key))
    return 0;
  rec *r = kvti_calloc(1, sizeof *r);
  if (!r)
    return 0;
  r->kind = K_CHUNK;
  r->state = RESIDENT;
  r->ch = ch;
  r->key = chain_key(ch->key);
  if (kvti_hm_add(&c->chunks, r->key, (uint64_t)(uintptr_t)r) != 0) {
    kvti_free(r);
    return 0;
  }
  list_push(&c->lru, r);
  c->st.used += ch->bytes;
  c->st.chunks++;
  c->st.chunk_bytes += ch->bytes;
  c->st.chunk_inserts++;
  *charge += (int64_t)ch->bytes;
  return 1;
}

/* Admits chs[0, n) (NULL slots skipped; each slot set to NULL when kept, so
 * the caller frees what is left). Caller holds mu. */
static void admit_chunks(kvti_hcache *c, kvti_hc_chunk **chs, size_t n,
                         int64_t *charge) {
  for (size_t i = 0; i < n; i++)
    if (chs[i] && admit_chunk(c, chs[i], charge))
      chs[i] = NULL;
}

static void free_chunks(kvti_hc_chunk **chs, size_t n) {
  for (size_t i = 0; chs && i < n; i++) {
    kvti_hc_chunk_free(chs[i]);
    chs[i] = NULL;
  }
}

size_t kvti_hc_chunks_resident(kvti_hcache *c, const uint8_t *keys,
                               size_t stride, size_t m, uint8_t *have) {
  size_t k = 0;
  pthread_mutex_lock(&c->mu);
  /* Last chunk first, as kvti_hc_pin_chunks: the entry asking uses them,
   * so they are touched (a prompt shared by many stays while any of them
   * is used). */
  for (size_t i = m; i-- > 0;) {
    rec *r =
        c->bound > 0 && !c->closed ? find_chunk(c, keys + i * stride) : NULL;
    have[i] = r != NULL;
    if (r)
      touch(c, r);
    k += have[i];
  }
  pthread_mutex_unlock(&c->mu);
  return k;
}

size_t kvti_hc_put_chunks(kvti_hcache *c, kvti_hc_chunk **chs, size_t n,
                          uint64_t epoch) {
  rec *g = NULL;
  int64_t charge = 0;
  size_t kept = 0;
  pthread_mutex_lock(&c->mu);
  if (c->epoch == epoch && c->bound > 0) {
    for (size_t i = 0; i < n; i++)
      if (chs[i] && admit_chunk(c, chs[i], &charge)) {
        chs[i] = NULL;
        kept++;
      }
    evict_to(c, c->bound, NULL, &g, &charge);
  }
  pthread_mutex_unlock(&c->mu);
  settle(c, g, charge);
  free_chunks(chs, n);
  return kept;
}

/* Makes record r (in the map, in no list) the resident tail *tail, tagged
 * with its chain, and admits chs; evicts for room sparing r. Caller holds
 * mu. Returns 1, or 0 when the tail could not be kept (r is then deleted). */
static int admit_tail(kvti_hcache *c, rec *r, kvti_hc_item *tail,
                      kvti_hc_chunk **chs, size_t n, rec **g, int64_t *charge) {
  if (c->closed || tail->bytes > c->bound ||
      set_chain(c, r, tail->has_chain ? tail->chain : NULL) != 0) {
    drop_unlisted(c, r, g);
    c->st.rejects++;
    return 0;
  }
  tail->is_tail = 1;
  admit_chunks(c, chs, n, charge);
  admit(c, r, tail, g, charge);
  return 1;
}

int kvti_hc_put_tail(kvti_hcache *c, const char *hash, kvti_hc_item *tail,
                     kvti_hc_chunk **chs, size_t n, uint64_t epoch) {
  tail->bytes = kvti_hc_layers_bytes(tail->layers, tail->n_layers);
  rec *fresh = kvti_calloc(1, sizeof *fresh);
  rec *g = NULL;
  int64_t charge = 0;
  int kept = 0;
  pthread_mutex_lock(&c->mu);
  rec *r = find(c, hash, NULL);
  if (r)
    drop(c, r, &g, &charge);
  if (!fresh || c->epoch != epoch || c->bound == 0 ||
      kvti_hm_add(&c->map, key_of(hash), (uint64_t)(uintptr_t)fresh) != 0) {
    c->st.rejects++;
  } else {
    snprintf(fresh->hash, sizeof fresh->hash, "%s", hash);
    fresh->key = key_of(hash);
    kept = admit_tail(c, fresh, tail, chs, n, &g, &charge);
    if (kept)
      c->st.inserts++;
    fresh = NULL; /* kept, or on the garbage list */
  }
  pthread_mutex_unlock(&c->mu);
  settle(c, g, charge);
  kvti_free(fresh);
  free_chunks(chs, n);
  if (!kept)
    kvti_hc_item_free(tail);
  return kept;
}

int kvti_hc_give_back_tail(kvti_hcache *c, const char *hash, uint64_t lend_id,
                           kvti_hc_item *tail, kvti_hc_chunk **chs, size_t n) {
  if (tail)
    tail->bytes = kvti_hc_layers_bytes(tail->layers, tail->n_layers);
  rec *g = NULL;
  int64_t charge = 0;
  int kept = 0;
  pthread_mutex_lock(&c->mu);
  rec *r = find(c, hash, NULL);
  if (r && r->state == LENT && r->lend_id == lend_id) {
    /* Still the version lent and its chain untouched since (a removal of
     * any chunk of it deletes the lent record). */
    list_unlink(&c->lent, r);
    c->st.lent--;
    if (tail) {
      kept = admit_tail(c, r, tail, chs, n, &g, &charge);
      if (kept)
        c->st.returns++;
    } else {
      /* A prefix: its chunks are all it is. */
      drop_unlisted(c, r, &g);
      if (!c->closed) {
        admit_chunks(c, chs, n, &charge);
        evict_to(c, c->bound, NULL, &g, &charge);
        c->st.returns++;
        kept = 1;
      }
    }
  }
  pthread_mutex_unlock(&c->mu);
  settle(c, g, charge);
  free_chunks(chs, n);
  if (tail && !kept)
    kvti_hc_item_free(tail);
  return kept;
}

/* A kvti_hc_ref is a pinned record (the type stays opaque). */
int kvti_hc_pin_tail(kvti_hcache *c, const char *hash, kvti_hc_ref **ref,
                     const kvti_hc_item **it) {
  int hit = 0;
  pthread_mutex_lock(&c->mu);
  if (c->bound > 0 && !c->closed) {
    rec *r = find(c, hash, NULL);
    if (r && r->state == RESIDENT && r->kind == K_TAIL) {
      r->pins++;
      touch(c, r);
      *ref = (kvti_hc_ref *)r;
      *it = &r->it;
      hit = 1;
    }
  }
  pthread_mutex_unlock(&c->mu);
  return hit;
}

size_t kvti_hc_pin_chunks(kvti_hcache *c, const uint8_t *keys, size_t stride,
                          size_t m, kvti_hc_ref **refs) {
  size_t k = 0;
  pthread_mutex_lock(&c->mu);
  /* Touched last chunk first, so the chain's head ends youngest: the LRU
   * then evicts a chain from its end, as the disk's eviction does. */
  for (size_t i = m; i-- > 0;) {
    rec *r =
        c->bound > 0 && !c->closed ? find_chunk(c, keys + i * stride) : NULL;
    refs[i] = (kvti_hc_ref *)r;
    if (r) {
      r->pins++;
      touch(c, r);
      k++;
    }
  }
  pthread_mutex_unlock(&c->mu);
  return k;
}

const kvti_hc_chunk *kvti_hc_ref_chunk(const kvti_hc_ref *ref) {
  const rec *r = (const rec *)ref;
  return r && r->kind == K_CHUNK ? r->ch : NULL;
}

void kvti_hc_unpin(kvti_hcache *c, kvti_hc_ref **refs, size_t n) {
  rec *g = NULL;
  pthread_mutex_lock(&c->mu);
  for (size_t i = 0; i < n; i++) {
    rec *r = (rec *)refs[i];
    refs[i] = NULL;
    if (r && --r->pins == 0 && r->dead) {
      r->gnext = g;
      g = r;
    }
  }
  pthread_mutex_unlock(&c->mu);
  settle(c, g, 0); /* dropped records were uncharged when dropped */
}

void kvti_hc_count(kvti_hcache *c, int hit, int verify_failed) {
  pthread_mutex_lock(&c->mu);
  if (hit)
    c->st.hits++;
  else
    c->st.misses++;
  if (verify_failed)
    c->st.verify_failures++;
  pthread_mutex_unlock(&c->mu);
}

void kvti_hc_drop_chain(kvti_hcache *c, const char *hash, const uint8_t *keys,
                        size_t stride, size_t m) {
  rec *g = NULL;
  int64_t charge = 0;
  pthread_mutex_lock(&c->mu);
  rec *r = hash ? find(c, hash, NULL) : NULL;
  if (r && r->kind == K_TAIL)
    drop(c, r, &g, &charge);
  for (size_t i = 0; i < m; i++)
    if ((r = find_chunk(c, keys + i * stride)) != NULL)
      drop(c, r, &g, &charge);
  pthread_mutex_unlock(&c->mu);
  settle(c, g, charge);
}

/* ---- default bound ------------------------------------------------------ */

/* A cgroup limit file's value in bytes, or UINT64_MAX (absent, "max",
 * unparsable; cgroup v1 reports "no limit" as a huge page-rounded number). */
static uint64_t read_limit(const char *path) {
  if (!path)
    return UINT64_MAX;
  FILE *f = fopen(path, "r"); /* a /sys file, not cache data: no io seam */
  if (!f)
    return UINT64_MAX;
  char buf[64] = {0};
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = '\0';
  char *end;
  unsigned long long v = strtoull(buf, &end, 10);
  if (end == buf || (*end && *end != '\n'))
    return UINT64_MAX;
  if (v >= (1ull << 62))
    return UINT64_MAX;
  return (uint64_t)v;
}

uint64_t kvti_hc_memory_limit(const char *v2, const char *v1, uint64_t phys) {
  uint64_t m = phys ? phys : UINT64_MAX;
  uint64_t a = read_limit(v2), b = read_limit(v1);
  if (a < m)
    m = a;
  if (b < m)
    m = b;
  return m == UINT64_MAX ? 0 : m;
}

uint64_t kvti_hc_default_bytes(void) {
  long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
  uint64_t phys =
      pages > 0 && psz > 0 ? (uint64_t)pages * (uint64_t)psz : UINT64_MAX;
  uint64_t m =
      kvti_hc_memory_limit("/sys/fs/cgroup/memory.max",
                           "/sys/fs/cgroup/memory/memory.limit_in_bytes",
                           phys == UINT64_MAX ? 0 : phys);
  if (m == 0) /* nothing known: a conservative 1 GiB */
    return (uint64_t)1 << 30;
  return m / 8;
}
