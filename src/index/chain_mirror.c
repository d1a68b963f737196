/*
 * chain_mirror.c - the in-memory half of the chain table (chain.h): the
 * forest of chunk nodes (parent links and child counts, two multimaps:
 * SHA-256 key -> node and lookup chain value -> node) and the chained-entry
 * records, with the lookups, touches (marked dirty here, written to SQLite
 * by chain_db.c), the LRU leaf, the length classes and the value leaf,
 * totals and iteration. Everything here runs under the table's read-write
 * lock only, never the index's db_mu. Memory:
 * about 150 bytes per chunk plus the two maps (23-46 bytes per pair each).
 */
#include "index/chain_int.h"

#include "base/clock.h"
#include "base/error.h"
#include "base/io.h"
#include "base/vec.h"

#include <string.h>

static uint64_t key64(const uint8_t k[32]) {
  uint64_t v;
  memcpy(&v, k, 8);
  return kvti_hm_key(v);
}

/* 1-based id of the node with key, 0 if none (rw held, read suffices). */
uint32_t kvti_chain_find_key(const kvti_chains *c, const uint8_t key[32]) {
  size_t pos = 0;
  kvti_hm_slot *s;
  while ((s = kvti_hm_next(&c->bykey, key64(key), &pos)))
    if (c->nodes[s->val].live && !memcmp(c->nodes[s->val].r.key, key, 32))
      return (uint32_t)s->val + 1;
  return 0;
}

int kvti_chain_reserve_nodes(kvti_chains *c, size_t more) {
  if (kvti_hm_reserve(&c->bykey, c->tot.chunks + more) ||
      kvti_hm_reserve(&c->byck, c->tot.chunks + more))
    return KVT_ERR_NOMEM();
  if (c->nfree >= more || c->n + more - c->nfree <= c->cap)
    return 0;
  /* nodes and freel share one capacity; node ids are 32-bit. */
  size_t cap = kvti_vec_cap(c->cap, (size_t)c->n + more, sizeof *c->nodes, 64);
  if (cap > UINT32_MAX - 1)
    return KVT_ERR(KVT_ENOMEM, "chain table: too many chunks");
  int rc = KVTI_VEC_RESIZE(&c->nodes, cap);
  if (rc == 0)
    rc = KVTI_VEC_RESIZE(&c->freel, cap);
  if (rc)
    return rc;
  c->cap = (uint32_t)cap;
  return 0;
}

/* Adds r under parent (1-based, 0 = root); reserve_nodes must have
 * succeeded. Returns the 1-based id. */
uint32_t kvti_chain_add_node(kvti_chains *c, const kvti_chain_rec *r,
                             uint32_t parent) {
  uint32_t id = c->nfree ? c->freel[--c->nfree] : c->n++;
  node *x = &c->nodes[id];
  memset(x, 0, sizeof *x);
  x->r = *r;
  x->parent = parent;
  x->live = 1;
  x->cls = KVTI_LEN_UNKNOWN;
  kvti_hm_add(&c->bykey, key64(r->key), id); /* cannot fail: reserved */
  kvti_hm_add(&c->byck, kvti_hm_key(r->ck.lo), id);
  if (parent)
    c->nodes[parent - 1].children++;
  c->tot.chunks++;
  c->tot.disk_bytes += r->disk_bytes;
  c->tot.mem_bytes += r->mem_bytes;
  return id + 1;
}

void kvti_chain_del_node(kvti_chains *c, uint32_t id1) {
  node *x = &c->nodes[id1 - 1];
  kvti_hm_remove(&c->bykey, key64(x->r.key), id1 - 1);
  kvti_hm_remove(&c->byck, kvti_hm_key(x->r.ck.lo), id1 - 1);
  if (x->parent)
    c->nodes[x->parent - 1].children--;
  c->tot.chunks--;
  c->tot.disk_bytes -= x->r.disk_bytes;
  c->tot.mem_bytes -= x->r.mem_bytes;
  if (x->damaged)
    c->n_damaged--;
  x->damaged = 0;
  x->live = 0;
  c->freel[c->nfree++] = id1 - 1;
}

int kvti_chain_ent_add(kvti_chains *c, const kvti_chained_entry *e) {
  uint64_t k;
  memcpy(&k, e->hash, 8);
  size_t pos = 0;
  kvti_hm_slot *sl;
  while ((sl = kvti_hm_next(&c->byent, kvti_hm_key(k), &pos)))
    if (!memcmp(c->ents[sl->val].hash, e->hash, 32)) {
      c->ents[sl->val] = *e;
      return 0;
    }
  int rc = KVTI_VEC_RESERVE(&c->ents, &c->cap_ents, c->n_ents + 1, 64);
  if (rc)
    return rc;
  if (kvti_hm_add(&c->byent, kvti_hm_key(k), c->n_ents))
    return KVT_ERR_NOMEM();
  c->ents[c->n_ents++] = *e;
  return 0;
}

void kvti_chain_ent_del(kvti_chains *c, const uint8_t hash[32]) {
  uint64_t k;
  memcpy(&k, hash, 8);
  size_t pos = 0;
  kvti_hm_slot *sl;
  while ((sl = kvti_hm_next(&c->byent, kvti_hm_key(k), &pos))) {
    size_t i = sl->val;
    if (memcmp(c->ents[i].hash, hash, 32))
      continue;
    kvti_hm_remove_slot(&c->byent, sl);
    size_t last = --c->n_ents;
    if (i != last) {
      /* Move the last record into the hole and repoint its map slot. */
      uint64_t lk;
      memcpy(&lk, c->ents[last].hash, 8);
      size_t p2 = 0;
      kvti_hm_slot *s2;
      while ((s2 = kvti_hm_next(&c->byent, kvti_hm_key(lk), &p2)))
        if (s2->val == last) {
          s2->val = i;
          break;
        }
      c->ents[i] = c->ents[last];
    }
    return;
  }
}

int kvti_chains_entry_get(kvti_chains *c, const uint8_t hash[32],
                          kvti_chained_entry *out) {
  uint64_t k;
  memcpy(&k, hash, 8);
  pthread_rwlock_rdlock(&c->rw);
  size_t pos = 0;
  kvti_hm_slot *sl;
  int found = 0;
  while (!found && (sl = kvti_hm_next(&c->byent, kvti_hm_key(k), &pos)))
    if (!memcmp(c->ents[sl->val].hash, hash, 32)) {
      found = 1;
      if (out)
        *out = c->ents[sl->val];
    }
  pthread_rwlock_unlock(&c->rw);
  return found;
}

int kvti_chains_entries_ending(kvti_chains *c, const kvti_chain_rec *keys,
                               size_t nkeys, uint8_t (**out)[32], size_t *n) {
  *out = NULL;
  *n = 0;
  /* The removed keys in a map first, so each entry costs one probe: the
   * pairwise scan was entries x keys, quadratic for a deep chain's removal. */
  kvti_hm set = {0};
  if (kvti_hm_reserve(&set, nkeys ? nkeys : 1))
    return KVT_ERR_NOMEM();
  for (size_t k = 0; k < nkeys; k++)
    kvti_hm_add(&set, key64(keys[k].key), k); /* cannot fail: reserved */
  pthread_rwlock_rdlock(&c->rw);
  size_t cap = 0;
  int rc = 0;
  for (size_t i = 0; rc == 0 && i < c->n_ents; i++) {
    size_t pos = 0;
    kvti_hm_slot *sl;
    int hit = 0;
    while (!hit && (sl = kvti_hm_next(&set, key64(c->ents[i].last_key), &pos)))
      hit = !memcmp(c->ents[i].last_key, keys[sl->val].key, 32);
    if (!hit)
      continue;
    if ((rc = KVTI_VEC_RESERVE(out, &cap, *n + 1, 8)) != 0)
      break;
    memcpy((*out)[(*n)++], c->ents[i].hash, 32);
  }
  pthread_rwlock_unlock(&c->rw);
  kvti_hm_free(&set);
  return rc;
}

size_t kvti_chains_entries_page(kvti_chains *c, size_t *cursor, size_t max,
                                uint8_t (*out)[32]) {
  pthread_rwlock_rdlock(&c->rw);
  size_t n = 0, i = *cursor < c->n_ents ? *cursor : 0;
  for (; n < max && i < c->n_ents; i++)
    memcpy(out[n++], c->ents[i].hash, 32);
  *cursor = i < c->n_ents ? i : 0; /* wraps: the next page starts over */
  pthread_rwlock_unlock(&c->rw);
  return n;
}

int kvti_chains_set_damaged(kvti_chains *c, const uint8_t key[32], int on) {
  pthread_rwlock_wrlock(&c->rw);
  uint32_t id = kvti_chain_find_key(c, key);
  if (id) {
    node *x = &c->nodes[id - 1];
    if (!x->damaged && on)
      c->n_damaged++;
    else if (x->damaged && !on)
      c->n_damaged--;
    x->damaged = (uint8_t)(on != 0);
  }
  pthread_rwlock_unlock(&c->rw);
  return id != 0;
}

int kvti_chains_is_damaged(kvti_chains *c, const uint8_t key[32]) {
  pthread_rwlock_rdlock(&c->rw);
  uint32_t id = kvti_chain_find_key(c, key);
  int d = id && c->nodes[id - 1].damaged;
  pthread_rwlock_unlock(&c->rw);
  return d;
}

int kvti_chains_find(kvti_chains *c, const uint8_t key[32],
                     kvti_chain_rec *rec) {
  pthread_rwlock_rdlock(&c->rw);
  uint32_t id = kvti_chain_find_key(c, key);
  if (id && rec)
    *rec = c->nodes[id - 1].r;
  pthread_rwlock_unlock(&c->rw);
  return id != 0;
}

/* Child of parent (1-based, 0 = root) at level i with lookup value ck and
 * layout (0 = any); the most recently used when several. rw held (read). */
static uint32_t find_child(const kvti_chains *c, uint32_t parent, uint64_t i,
                           kvti_ck ck, uint32_t C, uint64_t layout) {
  size_t pos = 0;
  kvti_hm_slot *s;
  uint32_t best = 0;
  while ((s = kvti_hm_next(&c->byck, kvti_hm_key(ck.lo), &pos))) {
    const node *x = &c->nodes[s->val];
    if (!x->live || x->damaged || x->parent != parent || x->r.ck.lo != ck.lo ||
        x->r.ck.hi != ck.hi || x->r.index != i || x->r.n_tokens != C ||
        (layout && x->r.layout_hash != layout))
      continue;
    if (!best || x->r.accessed_at > c->nodes[best - 1].r.accessed_at)
      best = (uint32_t)s->val + 1;
  }
  return best;
}

int kvti_chains_lookup(kvti_chains *c, const uint8_t *ns, size_t ns_len,
                       const int32_t *tokens, size_t n, uint32_t chunk_tokens,
                       kvti_chain_rec *out, size_t max, size_t *m) {
  if (!m || (!tokens && n) || (!ns && ns_len) || chunk_tokens == 0 ||
      (!out && max))
    return KVT_ERR(KVT_EINVAL, "kvti_chains_lookup: bad argument");
  *m = 0;
  size_t levels = n / chunk_tokens;
  if (levels > max)
    levels = max;
  if (levels == 0)
    return 0;
  kvti_ck ck = kvti_ck_next(kvti_ck_seed(ns, ns_len), tokens, chunk_tokens);
  pthread_rwlock_rdlock(&c->rw);
  if (c->tot.chunks == 0) {
    pthread_rwlock_unlock(&c->rw);
    return 0;
  }
  /* Every chain starting at a level-0 candidate (one per layout) is walked;
   * the longest wins. */
  size_t pos = 0, best_len = 0;
  kvti_hm_slot *s;
  while ((s = kvti_hm_next(&c->byck, kvti_hm_key(ck.lo), &pos))) {
    const node *x = &c->nodes[s->val];
    if (!x->live || x->damaged || x->parent || x->r.index ||
        x->r.ck.lo != ck.lo || x->r.ck.hi != ck.hi ||
        x->r.n_tokens != chunk_tokens)
      continue;
    uint32_t cur = (uint32_t)s->val + 1;
    size_t len = 1;
    kvti_ck cki = ck;
    /* Walk first, copy only a winner (out holds the best so far). */
    while (len < levels) {
      kvti_ck nx = kvti_ck_next(cki, tokens + len * chunk_tokens, chunk_tokens);
      uint32_t ch = find_child(c, cur, len, nx, chunk_tokens, x->r.layout_hash);
      if (!ch)
        break;
      cur = ch;
      cki = nx;
      len++;
    }
    if (len > best_len ||
        (len == best_len &&
         c->nodes[cur - 1].r.accessed_at > out[best_len - 1].accessed_at)) {
      best_len = len;
      /* Fill out[] from the leaf up along the parent links. */
      uint32_t id = cur;
      for (size_t k = len; k-- > 0; id = c->nodes[id - 1].parent)
        out[k] = c->nodes[id - 1].r;
    }
  }
  pthread_rwlock_unlock(&c->rw);
  *m = best_len;
  return 0;
}

int kvti_chains_touch(kvti_chains *c, const uint8_t key[32]) {
  double now = kvti_index_now(c->idx);
  pthread_rwlock_wrlock(&c->rw);
  uint32_t id = kvti_chain_find_key(c, key);
  int rc = id ? 0 : KVT_ENOTFOUND;
  for (; id; id = c->nodes[id - 1].parent) {
    node *x = &c->nodes[id - 1];
    if (x->r.accessed_at < now)
      x->r.accessed_at = now;
    if (x->dirty)
      continue;
    if (KVTI_VEC_RESERVE(&c->dirty, &c->capdirty, c->ndirty + 1, 64) != 0)
      continue; /* the touch stays in memory only */
    x->dirty = 1;
    c->dirty[c->ndirty++] = id - 1;
  }
  pthread_rwlock_unlock(&c->rw);
  return rc;
}

int kvti_chains_lru_leaf(kvti_chains *c, kvti_chain_rec *rec) {
  pthread_rwlock_rdlock(&c->rw);
  uint32_t best = 0;
  for (uint32_t i = 0; i < c->n; i++) {
    const node *x = &c->nodes[i];
    if (x->live && !x->children &&
        (!best || x->r.accessed_at < c->nodes[best - 1].r.accessed_at))
      best = i + 1;
  }
  if (best)
    *rec = c->nodes[best - 1].r;
  pthread_rwlock_unlock(&c->rw);
  return best != 0;
}

int kvti_chains_set_class(kvti_chains *c, const uint8_t key[32], unsigned cls) {
  if (cls > KVTI_LEN_UNKNOWN)
    cls = KVTI_LEN_UNKNOWN;
  pthread_rwlock_wrlock(&c->rw);
  uint32_t id = kvti_chain_find_key(c, key);
  int rc = id ? 0 : KVT_ENOTFOUND;
  /* Up to the first chunk that has one: the ones above it were made by an
   * earlier spill (a shared prefix) and keep that spill's class. */
  for (; id && c->nodes[id - 1].cls == KVTI_LEN_UNKNOWN;
       id = c->nodes[id - 1].parent)
    c->nodes[id - 1].cls = (uint8_t)cls;
  pthread_rwlock_unlock(&c->rw);
  return rc;
}

int kvti_chains_value_leaf(kvti_chains *c,
                           const double value[KVTI_LEN_CLASSES + 1],
                           double window, kvti_chain_rec *rec, double *lru_at) {
  pthread_rwlock_rdlock(&c->rw);
  /* Two scans: the leaves' time span, then the cheapest leaf old enough. */
  double t0 = 0, t1 = 0;
  int any = 0;
  for (uint32_t i = 0; i < c->n; i++) {
    const node *x = &c->nodes[i];
    if (!x->live || x->children)
      continue;
    double a = x->r.accessed_at;
    if (!any || a < t0)
      t0 = a;
    if (!any || a > t1)
      t1 = a;
    any = 1;
  }
  uint32_t best = 0;
  double best_v = 0, cut = t0 + window * (t1 - t0);
  for (uint32_t i = 0; any && i < c->n; i++) {
    const node *x = &c->nodes[i];
    if (!x->live || x->children || x->r.accessed_at > cut)
      continue;
    double v = value[x->cls <= KVTI_LEN_UNKNOWN ? x->cls : KVTI_LEN_UNKNOWN];
    if (!best || v < best_v ||
        (v == best_v && x->r.accessed_at < c->nodes[best - 1].r.accessed_at)) {
      best = i + 1;
      best_v = v;
    }
  }
  if (best) {
    *rec = c->nodes[best - 1].r;
    *lru_at = t0;
  }
  pthread_rwlock_unlock(&c->rw);
  return best != 0;
}

void kvti_chains_totals_get(kvti_chains *c, kvti_chains_totals *t) {
  pthread_rwlock_rdlock(&c->rw);
  *t = c->tot;
  t->leaves = 0;
  for (uint32_t i = 0; i < c->n; i++)
    t->leaves += c->nodes[i].live && !c->nodes[i].children;
  pthread_rwlock_unlock(&c->rw);
}

int kvti_chains_foreach(kvti_chains *c, kvti_chains_fn fn, void *ctx) {
  pthread_rwlock_rdlock(&c->rw);
  int rc = 0;
  for (uint32_t i = 0; rc == 0 && i < c->n; i++)
    if (c->nodes[i].live)
      rc = fn(ctx, &c->nodes[i].r);
  pthread_rwlock_unlock(&c->rw);
  return rc;
}
