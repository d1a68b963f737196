/*
 * hostcache_chunks.c - the host RAM cache's records of the chunked store:
 * chunks (one record per chunk key, shared by every entry and prefix through
 * it) and entries' tails (tagged with their chain's last chunk), pinned while
 * a reader copies out of them without the mutex, and their invalidation by
 * chunk key. The records, the map and the lists are hostcache.c's.
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

size_t kvti_hc_invalidate_chains(kvti_hcache *c, const uint8_t *keys,
                                 size_t stride, size_t n) {
  rec *g = NULL;
  int64_t charge = 0;
  size_t dropped = 0;
  pthread_mutex_lock(&c->mu);
  c->epoch++;
  for (size_t i = 0; c->chunks.n && i < n; i++) {
    rec *r = kvti_hci_find_chunk(c, keys + i * stride);
    if (r) {
      kvti_hci_drop(c, r, &g, &charge);
      c->st.invalidations++;
    }
  }
  for (size_t i = 0; c->by_chain.n && i < n; i++) {
    const uint8_t *k = keys + i * stride;
    size_t pos = 0;
    kvti_hm_slot *s;
    /* kvti_hci_drop() edits the map: restart the scan after each removal. */
    while ((s = kvti_hm_next(&c->by_chain, kvti_hci_chain_key(k), &pos)) !=
           NULL) {
      rec *r = (rec *)(uintptr_t)s->val;
      if (memcmp(r->chain, k, 32) != 0)
        continue;
      kvti_hci_drop(c, r, &g, &charge);
      c->st.invalidations++;
      dropped++;
      pos = 0;
    }
  }
  pthread_mutex_unlock(&c->mu);
  kvti_hci_settle(c, g, charge);
  return dropped;
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
  if (c->closed || ch->bytes > c->bound || kvti_hci_find_chunk(c, ch->key))
    return 0;
  rec *r = kvti_calloc(1, sizeof *r);
  if (!r)
    return 0;
  r->kind = K_CHUNK;
  r->state = RESIDENT;
  r->ch = ch;
  r->key = kvti_hci_chain_key(ch->key);
  if (kvti_hm_add(&c->chunks, r->key, (uint64_t)(uintptr_t)r) != 0) {
    kvti_free(r);
    return 0;
  }
  kvti_hci_list_push(&c->lru, r);
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
    rec *r = c->bound > 0 && !c->closed
                 ? kvti_hci_find_chunk(c, keys + i * stride)
                 : NULL;
    have[i] = r != NULL;
    if (r)
      kvti_hci_touch(c, r);
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
    kvti_hci_evict_to(c, c->bound, NULL, &g, &charge);
  }
  pthread_mutex_unlock(&c->mu);
  kvti_hci_settle(c, g, charge);
  free_chunks(chs, n);
  return kept;
}

/* Makes record r (in the map, in no list) the resident tail *tail, tagged
 * with its chain, and admits chs; evicts for room sparing r. Caller holds
 * mu. Returns 1, or 0 when the tail could not be kept (r is then deleted). */
static int admit_tail(kvti_hcache *c, rec *r, kvti_hc_item *tail,
                      kvti_hc_chunk **chs, size_t n, rec **g, int64_t *charge) {
  if (c->closed || tail->bytes > c->bound ||
      kvti_hci_set_chain(c, r, tail->has_chain ? tail->chain : NULL) != 0) {
    kvti_hci_drop_unlisted(c, r, g);
    c->st.rejects++;
    return 0;
  }
  tail->is_tail = 1;
  admit_chunks(c, chs, n, charge);
  kvti_hci_admit(c, r, tail, g, charge);
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
  rec *r = kvti_hci_find(c, hash, NULL);
  if (r)
    kvti_hci_drop(c, r, &g, &charge);
  if (!fresh || c->epoch != epoch || c->bound == 0 ||
      kvti_hm_add(&c->map, kvti_hci_key_of(hash), (uint64_t)(uintptr_t)fresh) !=
          0) {
    c->st.rejects++;
  } else {
    snprintf(fresh->hash, sizeof fresh->hash, "%s", hash);
    fresh->key = kvti_hci_key_of(hash);
    kept = admit_tail(c, fresh, tail, chs, n, &g, &charge);
    if (kept)
      c->st.inserts++;
    fresh = NULL; /* kept, or on the garbage list */
  }
  pthread_mutex_unlock(&c->mu);
  kvti_hci_settle(c, g, charge);
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
  /* Still the version lent and its chain untouched since (a removal of any
   * chunk of it deletes the lent record). */
  rec *r = kvti_hci_take_lent(c, hash, lend_id);
  if (r) {
    if (tail) {
      kept = admit_tail(c, r, tail, chs, n, &g, &charge);
      if (kept)
        c->st.returns++;
    } else {
      /* A prefix: its chunks are all it is. */
      kvti_hci_drop_unlisted(c, r, &g);
      if (!c->closed) {
        admit_chunks(c, chs, n, &charge);
        kvti_hci_evict_to(c, c->bound, NULL, &g, &charge);
        c->st.returns++;
        kept = 1;
      }
    }
  }
  pthread_mutex_unlock(&c->mu);
  kvti_hci_settle(c, g, charge);
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
    rec *r = kvti_hci_find(c, hash, NULL);
    if (r && r->state == RESIDENT && r->kind == K_TAIL) {
      r->pins++;
      kvti_hci_touch(c, r);
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
    rec *r = c->bound > 0 && !c->closed
                 ? kvti_hci_find_chunk(c, keys + i * stride)
                 : NULL;
    refs[i] = (kvti_hc_ref *)r;
    if (r) {
      r->pins++;
      kvti_hci_touch(c, r);
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
  kvti_hci_settle(c, g, 0); /* dropped records were uncharged when dropped */
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
  rec *r = hash ? kvti_hci_find(c, hash, NULL) : NULL;
  if (r && r->kind == K_TAIL)
    kvti_hci_drop(c, r, &g, &charge);
  for (size_t i = 0; i < m; i++)
    if ((r = kvti_hci_find_chunk(c, keys + i * stride)) != NULL)
      kvti_hci_drop(c, r, &g, &charge);
  pthread_mutex_unlock(&c->mu);
  kvti_hci_settle(c, g, charge);
}
