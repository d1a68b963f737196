/*
 * chain_int.h - private to the chain table (chain.h), shared by its two
 * halves: chain_db.c (the SQL of tables kvtier_chunks and
 * kvtier_chained_entries: open/load, inserts, deletes, batched touches) and
 * chain_mirror.c (the in-memory forest and entry records: node add/remove,
 * lookups, touches, LRU and value leaves, length classes, totals). Invariant:
 * the mirror holds exactly the rows committed to SQLite; the helpers below
 * require c->rw held for writing unless stated.
 */
#ifndef KVT_INDEX_CHAIN_INT_H
#define KVT_INDEX_CHAIN_INT_H

#include "index/chain.h"
#include "index/internal.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

typedef struct node {
  kvti_chain_rec r;
  uint32_t parent;   /* 1-based id of the parent node, 0 = root (chunk 0) */
  uint32_t children; /* live nodes whose parent is this one */
  uint8_t live, dirty;
  /* The chunk's file was found damaged or missing and moved aside: the row
   * stays (the chunks below it and the entries through it are kept), but
   * no chain through it is walked or looked up until a spill writes the
   * file again (in memory only: after a reopen the first read finds the
   * file missing again). */
  uint8_t damaged;
  uint8_t cls; /* length class (chain.h), KVTI_LEN_UNKNOWN until set */
} node;

struct kvti_chains {
  kvt_index *idx;
  /* Live nodes marked damaged (0: nothing to check). Changed under rw
   * (write); read without it by kvti_chains_any_damaged. */
  _Atomic uint32_t n_damaged;
  pthread_rwlock_t rw;
  node *nodes;
  uint32_t n, cap;
  uint32_t *freel;
  uint32_t nfree;
  kvti_hm bykey; /* key[0..8) -> id */
  kvti_hm byck;  /* ck.lo -> id */
  uint32_t *dirty;
  size_t ndirty, capdirty;
  sqlite3_stmt *ins, *del, *upd;
  sqlite3_stmt *e_put, *e_del;
  kvti_chains_totals tot;
  /* Entries over chains (few: one per entry end). */
  kvti_chained_entry *ents;
  size_t n_ents, cap_ents;
  kvti_hm byent; /* hash[0..8) -> index in ents */
};

/* 1-based id of the node with key, 0 if none (rw held, read suffices). */
uint32_t kvti_chain_find_key(const kvti_chains *c, const uint8_t key[32]);
/* Room for MORE nodes (arrays and both maps); 0 or KVT_ENOMEM. */
int kvti_chain_reserve_nodes(kvti_chains *c, size_t more);
/* Adds r under parent (1-based, 0 = root); kvti_chain_reserve_nodes must
 * have succeeded. Returns the 1-based id. */
uint32_t kvti_chain_add_node(kvti_chains *c, const kvti_chain_rec *r,
                             uint32_t parent);
/* Removes live node id1 (1-based) from the forest and the totals. */
void kvti_chain_del_node(kvti_chains *c, uint32_t id1);
/* Adds or replaces the chained-entry record e; 0 or KVT_ENOMEM. */
int kvti_chain_ent_add(kvti_chains *c, const kvti_chained_entry *e);
/* Drops the chained-entry record of hash, if any. */
void kvti_chain_ent_del(kvti_chains *c, const uint8_t hash[32]);

#endif
