/*
 * chain_walk.c - walks of the chain table along parent links (chain_walk.h):
 * the chain a chained-entry record names, and a visit of every chunk with its
 * children and sharing count. Both run under the table's read lock only.
 * Sharing (refs) is computed per visit by walking every record's chain up
 * from its last chunk: O(total chain length of the records), for tools, never
 * on the serving path.
 */
#include "index/chain_walk.h"

#include "index/chain_int.h"

#include "base/error.h"
#include "base/io.h"

#include <string.h>

int kvti_chains_path(kvti_chains *c, const uint8_t last_key[32], size_t n,
                     kvti_chain_rec *out) {
  if (!c || !last_key || (n && !out))
    return KVT_ERR(KVT_EINVAL, "kvti_chains_path: bad argument");
  if (n == 0)
    return 0;
  pthread_rwlock_rdlock(&c->rw);
  uint32_t id = kvti_chain_find_key(c, last_key);
  size_t k = n;
  uint64_t layout = id ? c->nodes[id - 1].r.layout_hash : 0;
  /* From the leaf up: chunk k-1 must be at index k-1, each parent linked. */
  int damaged = 0;
  while (id && k > 0) {
    const node *x = &c->nodes[id - 1];
    if (x->r.index != k - 1 || x->r.layout_hash != layout)
      break;
    if (x->damaged) {
      damaged = 1;
      break;
    }
    out[--k] = x->r;
    if (k == 0)
      break;
    id = x->parent;
  }
  pthread_rwlock_unlock(&c->rw);
  if (damaged)
    return KVT_ERR(KVT_ENOTFOUND,
                   "chain has a damaged chunk (moved aside; served again "
                   "once a spill writes it)");
  if (k != 0 || out[0].index != 0)
    return KVT_ERR(KVT_ENOTFOUND, "chain incomplete (evicted)");
  return 0;
}

int kvti_chains_any_damaged(kvti_chains *c) {
  return atomic_load_explicit(&c->n_damaged, memory_order_relaxed) != 0;
}

int kvti_chains_path_damaged(kvti_chains *c, const uint8_t last_key[32]) {
  pthread_rwlock_rdlock(&c->rw);
  int d = 0;
  if (c->n_damaged) {
    uint32_t id = kvti_chain_find_key(c, last_key);
    /* Parent links lead to the root: at most one step per chain level. */
    for (uint64_t steps = 0; id && !d && steps <= c->n; steps++) {
      d = c->nodes[id - 1].damaged;
      id = c->nodes[id - 1].parent;
    }
  }
  pthread_rwlock_unlock(&c->rw);
  return d;
}

int kvti_chains_visit(kvti_chains *c, kvti_chain_visit_fn fn, void *ctx) {
  pthread_rwlock_rdlock(&c->rw);
  uint32_t *refs = c->n ? kvti_calloc(c->n, sizeof *refs) : NULL;
  if (c->n && !refs) {
    pthread_rwlock_unlock(&c->rw);
    return KVT_ERR_NOMEM();
  }
  for (size_t e = 0; e < c->n_ents; e++) {
    uint32_t id = kvti_chain_find_key(c, c->ents[e].last_key);
    for (uint64_t k = 0; id && k < c->ents[e].chunks; k++) {
      refs[id - 1]++;
      id = c->nodes[id - 1].parent;
    }
  }
  int rc = 0;
  for (uint32_t i = 0; rc == 0 && i < c->n; i++) {
    if (!c->nodes[i].live)
      continue;
    kvti_chain_visit v = {c->nodes[i].r, c->nodes[i].children, refs[i]};
    rc = fn(ctx, &v);
  }
  kvti_free(refs);
  pthread_rwlock_unlock(&c->rw);
  return rc;
}

int kvti_chains_node(kvti_chains *c, const uint8_t key[32],
                     kvti_chain_visit *v) {
  pthread_rwlock_rdlock(&c->rw);
  uint32_t id = kvti_chain_find_key(c, key);
  if (id) {
    v->r = c->nodes[id - 1].r;
    v->children = c->nodes[id - 1].children;
    v->refs = 0;
  }
  pthread_rwlock_unlock(&c->rw);
  return id != 0;
}

size_t kvti_chains_entry_count(kvti_chains *c) {
  pthread_rwlock_rdlock(&c->rw);
  size_t n = c->n_ents;
  pthread_rwlock_unlock(&c->rw);
  return n;
}
