/*
 * chain_walk.h - walks of the chain table (chain.h) that follow parent links
 * rather than lookup values, so they need no namespace: the chain a
 * chained-entry record names (from its last chunk up to the root), and a
 * visit of every chunk with its child count and the number of entries whose
 * chain runs through it (its sharing). Used by the read of a chained entry
 * (its record names the chain exactly, whatever namespace or salt seeded it)
 * and by the tools' API (tier/chunk_tools.c: kvt_tier_chunk_foreach, ...).
 */
#ifndef KVT_INDEX_CHAIN_WALK_H
#define KVT_INDEX_CHAIN_WALK_H

#include "index/chain.h"

#include <stddef.h>
#include <stdint.h>

/* The chain ending at last_key, root first: out[0..n) = chunks 0..n-1 (out
 * holds n). Returns 0, or KVT_ENOTFOUND when it is not complete any more: a
 * chunk missing, or the chain not n long (its records' indices must run
 * 0..n-1 with one layout). */
int kvti_chains_path(kvti_chains *c, const uint8_t last_key[32], size_t n,
                     kvti_chain_rec *out);

/* One chunk of a visit: its row, its children (chunks whose parent it is)
 * and refs (chained entries whose chain runs through it). */
typedef struct kvti_chain_visit {
  kvti_chain_rec r;
  uint32_t children, refs;
} kvti_chain_visit;
typedef int (*kvti_chain_visit_fn)(void *ctx, const kvti_chain_visit *v);
/* Calls fn for every chunk (in table order) until it returns nonzero (then
 * returned). Runs under the table's read lock: fn must not call back. 0,
 * KVT_ENOMEM. */
/* 1 when a chunk on the chain ending at last_key (itself or an ancestor)
 * is marked damaged (kvti_chains_set_damaged); 0 otherwise - at once when
 * nothing is damaged. */
int kvti_chains_path_damaged(kvti_chains *c, const uint8_t last_key[32]);
/* 1 when any chunk is marked damaged (a relaxed load: a lookup racing the
 * mark may miss it; the read that follows walks the chain under the lock). */
int kvti_chains_any_damaged(kvti_chains *c);
int kvti_chains_visit(kvti_chains *c, kvti_chain_visit_fn fn, void *ctx);
/* The row and child count of key (refs 0): 1, or 0 when not stored. */
int kvti_chains_node(kvti_chains *c, const uint8_t key[32],
                     kvti_chain_visit *v);
/* Chained-entry records now. */
size_t kvti_chains_entry_count(kvti_chains *c);

#endif
