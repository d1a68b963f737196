/*
 * chain.h - the chain table of the chunked native store: one SQLite row per
 * stored chunk (table kvtier_chunks in index.db, beside the reference's
 * tables) and an in-memory mirror of it, a forest in which each chunk points
 * at its parent and is found by its SHA-256 key or by its XXH3-128 lookup
 * chain value (format/chunk.h). Lookups walk a prompt chunk by chunk with no
 * SQL and no file I/O; the store (store/chunkstore.c) compares the tokens
 * against the chunk files before anything is served.
 *
 * Invariants: a row is inserted only after its file is durable and its parent
 * is indexed (so nothing reachable has a missing ancestor); a chunk's
 * accessed_at is that of its newest descendant (a touch refreshes the whole
 * path to the root); removal takes a chunk and every chunk below it, rows
 * first (so no lookup can reach a chunk whose file is being deleted). Open
 * reads only the table (no listing of chunks/): one row per chunk, no token
 * blobs. Thread-safe: lookups take a read lock, changes the index's db_mu then
 * a write lock.
 */
#ifndef KVT_INDEX_CHAIN_H
#define KVT_INDEX_CHAIN_H

#include "format/chunk.h"
#include "index/index.h"

#include <stddef.h>
#include <stdint.h>

typedef struct kvti_chains kvti_chains;

/* One chunk as the table and the mirror know it. */
typedef struct kvti_chain_rec {
  uint8_t key[32], parent[32];
  kvti_ck ck;           /* lookup chain value (namespace + tokens) */
  uint64_t layout_hash; /* kvti_chunk_hdr.layout_hash */
  uint64_t index;       /* position in the chain */
  uint32_t n_tokens;
  uint8_t pure; /* the chain holds the whole state of its prefix (pure KV) */
  uint64_t disk_bytes, mem_bytes;
  double created_at, accessed_at;
} kvti_chain_rec;

/* Creates the table (writable index) and loads the mirror. Rows whose parent
 * is missing (a chain cut by a crash of an older build or by hand) are not
 * reachable: they are dropped from the table when writable. Returns 0,
 * KVT_EDB, KVT_ENOMEM. */
int kvti_chains_open(kvti_chains **out, kvt_index *idx);
/* Writes pending touches and frees (NULL is a no-op). Must run before the
 * index is closed. */
void kvti_chains_close(kvti_chains *c);

/* 1 and *rec (may be NULL) when key is indexed, else 0. */
int kvti_chains_find(kvti_chains *c, const uint8_t key[32],
                     kvti_chain_rec *rec);

/* Inserts n chunks in one transaction (all or none), parents before children:
 * recs[i]'s parent must be indexed or earlier in recs (index 0: parent = the
 * seed, not indexed). Already indexed keys are skipped. created_at and
 * accessed_at are set to now. Returns 0, KVT_EINVAL, KVT_EPERM (read-only),
 * KVT_EDB, KVT_ENOMEM. */
int kvti_chains_put(kvti_chains *c, const kvti_chain_rec *recs, size_t n);
/* kvti_chains_put and, in the same transaction, the chained-entry row e
 * (INSERT OR REPLACE; NULL: none), so a spill's new chunk rows and its
 * record cost one commit. All or none: a failure changes neither the table
 * nor its mirror. Returns as kvti_chains_put. */
struct kvti_chained_entry;
int kvti_chains_put_with_entry(kvti_chains *c, const kvti_chain_rec *recs,
                               size_t n, const struct kvti_chained_entry *e);

/* The longest stored chain over tokens[0, n) in namespace ns: chunk i must
 * have ck_i of tokens [i*C, (i+1)*C), index i, n_tokens C and the parent
 * found at i - 1, all with one layout. Fills out[0..*m) (at most max). With
 * several layouts the longest wins (then the most recently used). Returns 0
 * (*m may be 0) or KVT_EINVAL. */
int kvti_chains_lookup(kvti_chains *c, const uint8_t *ns, size_t ns_len,
                       const int32_t *tokens, size_t n, uint32_t chunk_tokens,
                       kvti_chain_rec *out, size_t max, size_t *m);

/* accessed_at = now for key and every ancestor (SQLite at the next flush).
 * Returns 0 or KVT_ENOTFOUND. */
int kvti_chains_touch(kvti_chains *c, const uint8_t key[32]);
/* Writes pending touches. 0 or KVT_EDB. */
int kvti_chains_flush(kvti_chains *c);

/* Removes key and every chunk below it: the rows in one transaction, then the
 * mirror. *removed receives a kvti_malloc'ed array of what was removed (the
 * caller deletes the files), *n its length. KVT_ENOTFOUND when absent. */
int kvti_chains_remove_tree(kvti_chains *c, const uint8_t key[32],
                            kvti_chain_rec **removed, size_t *n);

/* Marks chunk key damaged (on = 1: its file is gone or bad, no chain
 * through it is walked, looked up or served) or whole again (on = 0: its
 * file was written again). The row and everything below it stay. Returns 1
 * when key is indexed, else 0. */
int kvti_chains_set_damaged(kvti_chains *c, const uint8_t key[32], int on);
/* 1 when key is indexed and marked damaged. */
int kvti_chains_is_damaged(kvti_chains *c, const uint8_t key[32]);
/* Chunk key and every chunk below it, as kvti_chains_remove_tree would
 * remove them, without removing anything: *out (kvti_malloc'ed), *n.
 * KVT_ENOTFOUND when absent, KVT_ENOMEM. */
int kvti_chains_subtree(kvti_chains *c, const uint8_t key[32],
                        kvti_chain_rec **out, size_t *n);

/* The least recently used leaf (a chunk no other chunk points at): eviction
 * order, leaf first. 1 and *rec, or 0 when empty. */
int kvti_chains_lru_leaf(kvti_chains *c, kvti_chain_rec *rec);

/* ---- length classes: what eviction by value weighs ----
 * A chunk carries the length class of the spill that first wrote it (in the
 * mirror only: a reopened table knows none, KVTI_LEN_UNKNOWN). Classes are
 * half-octaves of the spill's tokens from 256 up; the admission record
 * learns how often each class is used again (tier/admission.h). */
#define KVTI_LEN_CLASSES 16
#define KVTI_LEN_UNKNOWN KVTI_LEN_CLASSES
static inline unsigned kvti_len_class(uint64_t n_tokens) {
  unsigned c = 0; /* 2 * log2(n / 256), floored, by squaring */
  uint64_t lo = 256;
  if (n_tokens > ((uint64_t)1 << 30))
    n_tokens = (uint64_t)1 << 30; /* past the top class; no overflow below */
  while (c + 2 < KVTI_LEN_CLASSES && n_tokens >= lo * 2) {
    lo *= 2;
    c += 2;
  }
  /* the upper half of the octave: n >= lo * sqrt(2) */
  if (c + 1 < KVTI_LEN_CLASSES && n_tokens * n_tokens >= lo * lo * 2)
    c++;
  return c;
}
/* Gives key and every ancestor still without a class the class cls (the
 * spill that made them). Returns 0 or KVT_ENOTFOUND. */
int kvti_chains_set_class(kvti_chains *c, const uint8_t key[32], unsigned cls);
/* Eviction by value: among the leaves accessed in the oldest `window`
 * fraction of the leaves' time span (0: the LRU leaf alone, 1: every leaf),
 * the one whose class is worth least (value[cls], value[KVTI_LEN_UNKNOWN]
 * for a chunk without one; the older on a tie). 1, *rec and *lru_at (the
 * LRU leaf's accessed_at), or 0 when empty. Leaves only: a parent never goes
 * before its children. */
int kvti_chains_value_leaf(kvti_chains *c,
                           const double value[KVTI_LEN_CLASSES + 1],
                           double window, kvti_chain_rec *rec, double *lru_at);

/* ---- entries stored over chains ----
 * An entry of the chunked native store keeps only its tail (and non-trimmable
 * layers) in data/<hash>/; this record says which chain holds the rest. It is
 * written before the entry is published and removed after the entry's files,
 * so a tail is never read as if it were a whole entry. */
typedef struct kvti_chained_entry {
  uint8_t hash[32]; /* SHA-256 of the entry's tokens */
  uint64_t chunks;  /* full chunks in the chain */
  uint32_t chunk_tokens;
  uint8_t last_key[32]; /* key of chunk chunks - 1 */
  uint64_t layout_hash;
  uint64_t total_rows; /* token extent T of the chunked tensors */
} kvti_chained_entry;
/* INSERT OR REPLACE (one transaction). 0, KVT_EPERM, KVT_EDB, KVT_ENOMEM. */
int kvti_chains_entry_put(kvti_chains *c, const kvti_chained_entry *e);
/* As kvti_chains_entry_put; wait = 0: KVT_EBUSY at once where it would wait
 * for another connection's write lock (the writer holds mut_mu). */
int kvti_chains_entry_put_ex(kvti_chains *c, const kvti_chained_entry *e,
                             int wait);
/* 1 and *out (may be NULL) when hash has a record, else 0. */
int kvti_chains_entry_get(kvti_chains *c, const uint8_t hash[32],
                          kvti_chained_entry *out);
/* Hashes of the entries whose chain ends at one of keys[0, nkeys) (they lose
 * their chain when those chunks go). *out: kvti_malloc'ed, *n entries. */
int kvti_chains_entries_ending(kvti_chains *c, const kvti_chain_rec *keys,
                               size_t nkeys, uint8_t (**out)[32], size_t *n);
/* Up to max chained-entry hashes into out, from position *cursor of the
 * records (advanced; back to 0 after the last), for a sweep that visits
 * them a page at a time. Returns how many. */
size_t kvti_chains_entries_page(kvti_chains *c, size_t *cursor, size_t max,
                                uint8_t (*out)[32]);
/* Removes the record (missing is success). 0, KVT_EPERM, KVT_EDB. */
int kvti_chains_entry_del(kvti_chains *c, const uint8_t hash[32]);

typedef struct kvti_chains_totals {
  uint64_t chunks, disk_bytes, mem_bytes, leaves;
} kvti_chains_totals;
void kvti_chains_totals_get(kvti_chains *c, kvti_chains_totals *t);

/* Calls fn for each chunk (index order not guaranteed) until it returns
 * nonzero (returned). Runs under the read lock: fn must not call back. */
typedef int (*kvti_chains_fn)(void *ctx, const kvti_chain_rec *rec);
int kvti_chains_foreach(kvti_chains *c, kvti_chains_fn fn, void *ctx);

#endif
