/*
 * cmirror.c - the chunk table of the remote lookup mirror (cmirror.h): an
 * array of chain records with a free list, found by their key's first 64 bits
 * and by their lookup chain value's low 64 bits (both confirmed against the
 * whole value), and the longest-chain walk over a query, which mirrors
 * index/chain_mirror.c's but links children by parent key (the table has no
 * node ids: records arrive in any order, from events and resyncs).
 */
#include "store/redis/cmirror.h"

#include "base/error.h"
#include "base/hash.h"
#include "base/io.h"
#include "format/chunk.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t key64(const uint8_t k[32]) {
  uint64_t v;
  memcpy(&v, k, 8);
  return kvti_hm_key(v);
}

void kvr_ctab_free(kvr_ctab *t) {
  kvti_free(t->r);
  kvti_free(t->freel);
  kvti_hm_free(&t->bykey);
  kvti_hm_free(&t->byck);
  memset(t, 0, sizeof *t);
}

static size_t find_slot(const kvr_ctab *t, const uint8_t key[32],
                        kvti_hm_slot **hs) {
  size_t pos = 0;
  kvti_hm_slot *s;
  while ((s = kvti_hm_next(&t->bykey, key64(key), &pos)) != NULL)
    if (!memcmp(t->r[s->val].key, key, 32)) {
      if (hs)
        *hs = s;
      return (size_t)s->val + 1;
    }
  return 0;
}

int kvr_ctab_has(const kvr_ctab *t, const uint8_t key[32]) {
  return t->live && find_slot(t, key, NULL) != 0;
}

int kvr_ctab_put(kvr_ctab *t, const kvti_chain_rec *rec) {
  if (find_slot(t, rec->key, NULL))
    return 0; /* content addressed: the same key is the same chunk */
  size_t idx;
  if (t->nfree) {
    idx = t->freel[t->nfree - 1];
  } else {
    if (t->n == t->cap) {
      size_t nc = t->cap ? t->cap * 2 : 256;
      kvti_chain_rec *r = kvti_realloc(t->r, nc * sizeof *r);
      if (!r)
        return KVT_ERR_NOMEM();
      t->r = r;
      uint32_t *f = kvti_realloc(t->freel, nc * sizeof *f);
      if (!f)
        return KVT_ERR_NOMEM();
      t->freel = f;
      t->cap = nc;
    }
    idx = t->n;
  }
  if (kvti_hm_add(&t->bykey, key64(rec->key), idx) != 0)
    return KVT_ERR_NOMEM();
  if (kvti_hm_add(&t->byck, kvti_hm_key(rec->ck.lo), idx) != 0) {
    kvti_hm_remove(&t->bykey, key64(rec->key), idx);
    return KVT_ERR_NOMEM();
  }
  if (t->nfree)
    t->nfree--;
  else
    t->n++;
  t->r[idx] = *rec;
  t->live++;
  return 0;
}

void kvr_ctab_del(kvr_ctab *t, const uint8_t key[32]) {
  kvti_hm_slot *hs = NULL;
  size_t id1 = find_slot(t, key, &hs);
  if (!id1)
    return;
  size_t idx = id1 - 1;
  kvti_hm_remove_slot(&t->bykey, hs);
  kvti_hm_remove(&t->byck, kvti_hm_key(t->r[idx].ck.lo), idx);
  t->freel[t->nfree++] = (uint32_t)idx;
  t->live--;
}

/* The chunk at level i with lookup value ck, chunk_tokens C, layout and
 * parent key; NULL if none. */
static const kvti_chain_rec *child(const kvr_ctab *t, const uint8_t parent[32],
                                   uint64_t i, kvti_ck ck, uint32_t C,
                                   uint64_t layout) {
  size_t pos = 0;
  kvti_hm_slot *s;
  while ((s = kvti_hm_next(&t->byck, kvti_hm_key(ck.lo), &pos)) != NULL) {
    const kvti_chain_rec *x = &t->r[s->val];
    if (x->ck.lo == ck.lo && x->ck.hi == ck.hi && x->index == i &&
        x->n_tokens == C && x->layout_hash == layout &&
        !memcmp(x->parent, parent, 32))
      return x;
  }
  return NULL;
}

size_t kvr_ctab_lookup(const kvr_ctab *t, const uint8_t *ns, size_t ns_len,
                       const int32_t *tokens, size_t n, uint32_t C,
                       kvti_chain_rec *out, size_t max) {
  size_t levels = C ? n / C : 0;
  if (levels > max)
    levels = max;
  if (levels == 0 || t->live == 0)
    return 0;
  kvti_ck ck0 = kvti_ck_next(kvti_ck_seed(ns, ns_len), tokens, C);
  size_t best = 0, pos = 0;
  kvti_hm_slot *s;
  /* One level-0 candidate per layout; its parent must be the seed of this
   * namespace and that layout. */
  while ((s = kvti_hm_next(&t->byck, kvti_hm_key(ck0.lo), &pos)) != NULL) {
    const kvti_chain_rec *x = &t->r[s->val];
    uint8_t seed[32];
    if (x->index || x->n_tokens != C || x->ck.lo != ck0.lo ||
        x->ck.hi != ck0.hi ||
        kvti_chunk_seed(seed, ns, ns_len, x->layout_hash) != 0 ||
        memcmp(seed, x->parent, 32))
      continue;
    size_t len = 1;
    const kvti_chain_rec *cur = x;
    kvti_ck ck = ck0;
    /* Walk first; copy into out only a walk longer than the best so far. */
    while (len < levels) {
      kvti_ck nx = kvti_ck_next(ck, tokens + len * C, C);
      const kvti_chain_rec *c = child(t, cur->key, len, nx, C, x->layout_hash);
      if (!c)
        break;
      cur = c;
      ck = nx;
      len++;
    }
    if (len > best) {
      /* Fill out[] again along the walk (len hash probes). */
      out[0] = *x;
      kvti_ck c2 = ck0;
      for (size_t k = 1; k < len; k++) {
        c2 = kvti_ck_next(c2, tokens + k * C, C);
        out[k] = *child(t, out[k - 1].key, k, c2, C, x->layout_hash);
      }
      best = len;
    }
  }
  kvt_clear_error();
  return best;
}

size_t kvr_crec_format(char *buf, size_t cap, const kvti_chain_rec *r) {
  char ph[65];
  kvti_hex32(ph, r->parent);
  int n = snprintf(buf, cap,
                   "%s %016" PRIx64 " %016" PRIx64 " %016" PRIx64 " %" PRIu64
                   " %u %u %" PRIu64 " %" PRIu64,
                   ph, r->ck.lo, r->ck.hi, r->layout_hash, r->index,
                   r->n_tokens, (unsigned)r->pure, r->mem_bytes, r->disk_bytes);
  return n < 0 || (size_t)n >= cap ? 0 : (size_t)n;
}

int kvr_crec_parse(kvti_chain_rec *r, const char *key_hex, size_t key_len,
                   const char *txt, size_t len) {
  char kh[65], b[320], ph[80];
  if (key_len != 64 || len >= sizeof b)
    return -1;
  memcpy(kh, key_hex, 64);
  kh[64] = '\0';
  memcpy(b, txt, len);
  b[len] = '\0';
  memset(r, 0, sizeof *r);
  unsigned long long lo, hi, lay, idx, mem, disk;
  unsigned nt, pure;
  char tail;
  if (sscanf(b, "%79s %16llx %16llx %16llx %llu %u %u %llu %llu%c", ph, &lo,
             &hi, &lay, &idx, &nt, &pure, &mem, &disk, &tail) != 9 ||
      kvti_unhex32(r->key, kh) != 0 || kvti_unhex32(r->parent, ph) != 0 ||
      !kvti_chunk_tokens_ok(nt) || pure > 1)
    return -1;
  r->ck.lo = lo;
  r->ck.hi = hi;
  r->layout_hash = lay;
  r->index = idx;
  r->n_tokens = nt;
  r->pure = (uint8_t)pure;
  r->mem_bytes = mem;
  r->disk_bytes = disk;
  return 0;
}
