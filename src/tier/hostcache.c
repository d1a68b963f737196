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
#include "tier/hostcache_int.h"

/* ---- helpers ------------------------------------------------------------ */

uint64_t kvti_hci_key_of(const char *hash) {
  uint64_t k = 0;
  for (int i = 0; i < 16 && hash[i]; i++) {
    char ch = hash[i];
    unsigned v = ch >= 'a' ? (unsigned)(ch - 'a' + 10) : (unsigned)(ch - '0');
    k = k << 4 | (v & 15u);
  }
  return kvti_hm_key(k);
}

uint64_t kvti_hci_chain_key(const uint8_t chain[32]) {
  uint64_t k;
  memcpy(&k, chain, sizeof k);
  return kvti_hm_key(k);
}

/* Tags r with chain (NULL: none), replacing any tag. Returns 0 or KVT_ENOMEM
 * (r then has no tag). Caller holds mu. */
int kvti_hci_set_chain(kvti_hcache *c, rec *r, const uint8_t *chain) {
  if (r->has_chain)
    kvti_hm_remove(&c->by_chain, kvti_hci_chain_key(r->chain),
                   (uint64_t)(uintptr_t)r);
  r->has_chain = 0;
  if (!chain)
    return 0;
  if (kvti_hm_add(&c->by_chain, kvti_hci_chain_key(chain),
                  (uint64_t)(uintptr_t)r))
    return KVT_ENOMEM;
  memcpy(r->chain, chain, 32);
  r->has_chain = 1;
  return 0;
}

void kvti_hci_list_unlink(list *l, rec *r) {
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

void kvti_hci_list_push(list *l, rec *r) {
  r->next = NULL;
  r->prev = l->young;
  if (l->young)
    l->young->next = r;
  else
    l->old = r;
  l->young = r;
}

rec *kvti_hci_find(kvti_hcache *c, const char *hash, kvti_hm_slot **slot) {
  size_t pos = 0;
  kvti_hm_slot *s;
  uint64_t k = kvti_hci_key_of(hash);
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

rec *kvti_hci_find_chunk(kvti_hcache *c, const uint8_t key[32]) {
  size_t pos = 0;
  kvti_hm_slot *s;
  while ((s = kvti_hm_next(&c->chunks, kvti_hci_chain_key(key), &pos)) !=
         NULL) {
    rec *r = (rec *)(uintptr_t)s->val;
    if (memcmp(r->ch->key, key, 32) == 0)
      return r;
  }
  return NULL;
}

/* Moves a resident record to the young end of the LRU. Caller holds mu. */
void kvti_hci_touch(kvti_hcache *c, rec *r) {
  kvti_hci_list_unlink(&c->lru, r);
  kvti_hci_list_push(&c->lru, r);
}

/* Removes r from the map and its list, adjusting the gauges; *charge receives
 * the bytes to uncharge. r goes onto *garbage. Caller holds mu. */
void kvti_hci_drop(kvti_hcache *c, rec *r, rec **garbage, int64_t *charge) {
  if (r->kind == K_CHUNK) {
    kvti_hm_remove(&c->chunks, r->key, (uint64_t)(uintptr_t)r);
    kvti_hci_list_unlink(&c->lru, r);
    c->st.used -= r->ch->bytes;
    c->st.chunks--;
    c->st.chunk_bytes -= r->ch->bytes;
    *charge -= (int64_t)r->ch->bytes;
  } else {
    kvti_hm_remove(&c->map, r->key, (uint64_t)(uintptr_t)r);
    kvti_hci_set_chain(c, r, NULL);
    if (r->state == RESIDENT) {
      kvti_hci_list_unlink(&c->lru, r);
      c->st.used -= r->it.bytes;
      c->st.resident--;
      *charge -= (int64_t)r->it.bytes;
    } else {
      kvti_hci_list_unlink(&c->lent, r);
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
void kvti_hci_evict_to(kvti_hcache *c, uint64_t target, const rec *keep,
                       rec **garbage, int64_t *charge) {
  rec *r = c->lru.old;
  while (r && c->st.used > target) {
    rec *next = r->next;
    if (r != keep) {
      kvti_hci_drop(c, r, garbage, charge);
      c->st.evictions++;
    }
    r = next;
  }
}

/* After unlocking: uncharge/charge the pool, then free what was dropped (the
 * buffers go back to the pool, which keeps them idle within its cap). */
void kvti_hci_settle(kvti_hcache *c, rec *garbage, int64_t charge) {
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
    kvti_hci_drop(c, c->lru.old, garbage, charge);
  while (c->lent.old)
    kvti_hci_drop(c, c->lent.old, garbage, charge);
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
  kvti_hci_settle(c, g, charge);
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
  kvti_hci_settle(c, g, charge);
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
  kvti_hci_evict_to(c, bound, NULL, &g, &charge);
  pthread_mutex_unlock(&c->mu);
  kvti_hci_settle(c, g, charge);
}

uint64_t kvti_hc_trim(kvti_hcache *c, uint64_t target) {
  rec *g = NULL;
  int64_t charge = 0;
  pthread_mutex_lock(&c->mu);
  kvti_hci_evict_to(c, target, NULL, &g, &charge);
  pthread_mutex_unlock(&c->mu);
  kvti_hci_settle(c, g, charge);
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
void kvti_hci_admit(kvti_hcache *c, rec *r, kvti_hc_item *it, rec **g,
                    int64_t *charge) {
  r->state = RESIDENT;
  r->kind = it->is_tail ? K_TAIL : K_WHOLE;
  r->it = *it;
  r->lend_id = 0;
  kvti_hci_list_push(&c->lru, r);
  c->st.used += it->bytes;
  c->st.resident++;
  *charge += (int64_t)it->bytes;
  kvti_hci_evict_to(c, c->bound, r, g, charge);
}

int kvti_hc_put(kvti_hcache *c, const char *hash, kvti_hc_item *it) {
  it->bytes = kvti_hc_layers_bytes(it->layers, it->n_layers);
  rec *fresh = kvti_calloc(1, sizeof *fresh);
  rec *g = NULL;
  int64_t charge = 0;
  int kept = 0;
  pthread_mutex_lock(&c->mu);
  rec *r = kvti_hci_find(c, hash, NULL);
  if (r) /* the new version replaces whatever was there (a lent old version
            is then never re-admitted) */
    kvti_hci_drop(c, r, &g, &charge);
  if (!fresh || c->closed || it->bytes > c->bound ||
      kvti_hm_add(&c->map, kvti_hci_key_of(hash), (uint64_t)(uintptr_t)fresh) !=
          0) {
    c->st.rejects++;
  } else if (kvti_hci_set_chain(c, fresh, it->has_chain ? it->chain : NULL) !=
             0) {
    /* Untagged, a chunk's removal could not find it: not kept. */
    kvti_hm_remove(&c->map, kvti_hci_key_of(hash), (uint64_t)(uintptr_t)fresh);
    c->st.rejects++;
  } else {
    snprintf(fresh->hash, sizeof fresh->hash, "%s", hash);
    fresh->key = kvti_hci_key_of(hash);
    kvti_hci_admit(c, fresh, it, &g, &charge);
    c->st.inserts++;
    kept = 1;
    fresh = NULL;
  }
  pthread_mutex_unlock(&c->mu);
  kvti_hci_settle(c, g, charge);
  kvti_free(fresh);
  if (!kept)
    kvti_hc_item_free(it);
  return kept;
}

/* Deletes r, which is in the map but in no list (no bytes charged). Caller
 * holds mu. */
void kvti_hci_drop_unlisted(kvti_hcache *c, rec *r, rec **g) {
  kvti_hm_remove(&c->map, r->key, (uint64_t)(uintptr_t)r);
  kvti_hci_set_chain(c, r, NULL);
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
  kvti_hci_list_push(&c->lent, r);
  c->st.lent++;
  while (c->st.lent > KVTI_HC_MAX_LENT && c->lent.old != r)
    kvti_hci_drop(c, c->lent.old, g, charge);
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
    rec *r = kvti_hci_find(c, hash, NULL);
    if (r && chain &&
        !(r->has_chain && memcmp(r->chain, chain, sizeof r->chain) == 0))
      r = NULL;
    if (r && r->state == RESIDENT && r->kind == K_WHOLE && !r->pins) {
      *out = r->it;
      out->has_chain = r->has_chain;
      memcpy(out->chain, r->chain, sizeof out->chain);
      kvti_hci_list_unlink(&c->lru, r);
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
  kvti_hci_settle(c, g, charge);
  return hit;
}

int kvti_hc_take(kvti_hcache *c, const char *hash, kvti_hc_item *out,
                 uint64_t *lend_id) {
  return take(c, hash, NULL, out, lend_id);
}

rec *kvti_hci_find_lent(kvti_hcache *c, const char *hash, uint64_t lend_id) {
  rec *r = kvti_hci_find(c, hash, NULL);
  return r && r->state == LENT && r->lend_id == lend_id ? r : NULL;
}

rec *kvti_hci_take_lent(kvti_hcache *c, const char *hash, uint64_t lend_id) {
  rec *r = kvti_hci_find_lent(c, hash, lend_id);
  if (r) {
    kvti_hci_list_unlink(&c->lent, r);
    c->st.lent--;
  }
  return r;
}

int kvti_hc_take_whole(kvti_hcache *c, const char *hash, const uint8_t *chain,
                       kvti_hc_item *out, uint64_t *lend_id) {
  return take(c, hash, chain, out, lend_id);
}

int kvti_hc_mark_cut(kvti_hcache *c, const char *hash, uint64_t lend_id) {
  pthread_mutex_lock(&c->mu);
  rec *r = kvti_hci_find_lent(c, hash, lend_id);
  int ok = r && !c->closed;
  if (ok)
    r->cutting = 1;
  pthread_mutex_unlock(&c->mu);
  return ok;
}

int kvti_hc_wait_cut(kvti_hcache *c, const char *hash) {
  int waited = 0;
  pthread_mutex_lock(&c->mu);
  for (;;) {
    rec *r = c->closed ? NULL : kvti_hci_find(c, hash, NULL);
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
  rec *r = c->bound > 0 && !c->closed ? kvti_hci_find(c, hash, NULL) : NULL;
  int yes = r && r->state == RESIDENT && r->kind == K_WHOLE;
  pthread_mutex_unlock(&c->mu);
  return yes;
}

void kvti_hc_forget(kvti_hcache *c, const char *hash, uint64_t lend_id,
                    int verify_failed) {
  rec *g = NULL;
  int64_t charge = 0;
  pthread_mutex_lock(&c->mu);
  rec *r = kvti_hci_find_lent(c, hash, lend_id);
  if (r)
    kvti_hci_drop(c, r, &g, &charge);
  if (verify_failed) {
    c->st.verify_failures++;
    if (c->st.hits)
      c->st.hits--;
    c->st.misses++;
  }
  pthread_mutex_unlock(&c->mu);
  kvti_hci_settle(c, g, charge);
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
    rec *r = kvti_hci_find(c, hash, NULL);
    if (r && r->state == LENT) {
      /* Promoted again while the earlier copy is out: the latest copy is the
       * one re-admitted. */
      kvti_hci_list_unlink(&c->lent, r);
      c->st.lent--;
      if (kvti_hci_set_chain(c, r, chain) != 0) {
        kvti_hci_drop_unlisted(c, r, &g);
      } else {
        *lend_id = lend_locked(c, r, &g, &charge);
        ok = 1;
      }
    } else if (!r && fresh &&
               kvti_hm_add(&c->map, kvti_hci_key_of(hash),
                           (uint64_t)(uintptr_t)fresh) == 0) {
      snprintf(fresh->hash, sizeof fresh->hash, "%s", hash);
      fresh->key = kvti_hci_key_of(hash);
      if (kvti_hci_set_chain(c, fresh, chain) != 0) {
        kvti_hm_remove(&c->map, fresh->key, (uint64_t)(uintptr_t)fresh);
      } else {
        *lend_id = lend_locked(c, fresh, &g, &charge);
        fresh = NULL;
        ok = 1;
      }
    }
  }
  pthread_mutex_unlock(&c->mu);
  kvti_hci_settle(c, g, charge);
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
  rec *r = kvti_hci_take_lent(c, hash, lend_id);
  if (r) {
    if (!c->closed && it->bytes <= c->bound) {
      kvti_hci_admit(c, r, it, &g, &charge);
      c->st.returns++;
      kept = 1;
    } else {
      kvti_hci_drop_unlisted(c, r, &g); /* not coming back */
      c->st.rejects++;
    }
  }
  pthread_mutex_unlock(&c->mu);
  kvti_hci_settle(c, g, charge);
  if (!kept)
    kvti_hc_item_free(it);
  return kept;
}

void kvti_hc_invalidate(kvti_hcache *c, const char *hash) {
  rec *g = NULL;
  int64_t charge = 0;
  pthread_mutex_lock(&c->mu);
  rec *r = kvti_hci_find(c, hash, NULL);
  if (r) {
    kvti_hci_drop(c, r, &g, &charge);
    c->st.invalidations++;
  }
  pthread_mutex_unlock(&c->mu);
  kvti_hci_settle(c, g, charge);
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
