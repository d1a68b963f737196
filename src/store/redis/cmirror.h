/*
 * cmirror.h - the chunk half of the remote lookup mirror (mirror.h): which
 * chunks of the chunked native store the remote store holds, with what a
 * longest-chain lookup needs of each (key, parent, lookup chain value, layout,
 * position, tokens, purity, sizes: an index/chain.h record), so that node B's
 * prefix lookups find chains node A spilled without a network round trip. A
 * plain table (no lock: the mirror's read-write lock protects it, and a resync
 * builds a fresh one and swaps it in), plus the one-line text form of a
 * record that the events and the store's chunk index share.
 *
 * Invariant: a lookup walks from a level-0 chunk whose parent is the seed of
 * the query's namespace and the chunk's layout, then child by child (parent
 * key = the previous chunk's key, one layout), so two namespaces (model_id,
 * salt) never see each other's chunks and a chain is never reported past a
 * chunk the table does not hold.
 */
#ifndef KVT_REDIS_CMIRROR_H
#define KVT_REDIS_CMIRROR_H

#include "base/hashmap.h"
#include "index/chain.h"

#include <stddef.h>
#include <stdint.h>

/* Every slot the two maps reach is live: a deletion removes it from both and
 * puts it on the free list. */
typedef struct kvr_ctab {
  kvti_chain_rec *r;
  size_t n, cap, live;
  uint32_t *freel;
  size_t nfree;
  kvti_hm bykey; /* key[0..8) -> slot */
  kvti_hm byck;  /* ck.lo -> slot */
} kvr_ctab;

void kvr_ctab_free(kvr_ctab *t); /* accepts a zeroed table */
/* Adds (or keeps) rec. 0 or KVT_ENOMEM (table unchanged). */
int kvr_ctab_put(kvr_ctab *t, const kvti_chain_rec *rec);
void kvr_ctab_del(kvr_ctab *t, const uint8_t key[32]);
int kvr_ctab_has(const kvr_ctab *t, const uint8_t key[32]);
/* The longest chain over tokens[0, n) in namespace ns (at most max chunks of
 * chunk_tokens tokens) into out; returns its length. */
size_t kvr_ctab_lookup(const kvr_ctab *t, const uint8_t *ns, size_t ns_len,
                       const int32_t *tokens, size_t n, uint32_t chunk_tokens,
                       kvti_chain_rec *out, size_t max);

/* The record's text without its key: "<parent hex> <ck.lo> <ck.hi> <layout>
 * <index> <n_tokens> <pure> <mem_bytes> <disk_bytes>" (numbers: the first
 * three after the parent in hex, the rest decimal). Returns its length (<
 * cap) or 0. */
size_t kvr_crec_format(char *buf, size_t cap, const kvti_chain_rec *rec);
/* Parses key_hex (64 hex) and txt as kvr_crec_format wrote them. 0 or -1. */
int kvr_crec_parse(kvti_chain_rec *rec, const char *key_hex, size_t key_len,
                   const char *txt, size_t len);

#endif
