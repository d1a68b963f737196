/*
 * chunked.h - the chunked native store as the tier sees it: one object that
 * turns a spill into its chain (only missing chunks written) plus a tail entry
 * put through the storage backend, reads an entry back (tail + chain, joined,
 * every byte verified), answers prefix lookups at chunk boundaries for pure-KV
 * chains and reads such a prefix, touches chains, and removes what an entry
 * or an eviction leaves unreachable. The tier keeps its own rules (locks,
 * index rows, budget, stats) and calls these where it would call the backend.
 *
 * Invariants: the chained-entry record is committed before a tail entry is
 * published and deleted only after its files are gone, so a tail is never
 * read as a whole entry; a chained entry whose chain is no longer complete is
 * reported missing (KVT_ENOTFOUND), never served short.
 */
#ifndef KVT_STORE_CHUNKED_H
#define KVT_STORE_CHUNKED_H

#include "format/entry.h"
#include "store/backend.h"
#include "format/chainrec.h"
#include "store/chunkstore.h"

#include <stdint.h>

typedef struct kvti_chunked kvti_chunked;

/* chunk_tokens: a power of two in [16, 4096]; model_id seeds the namespace
 * (NULL = ""). Returns 0, KVT_EINVAL, KVT_ENOMEM, KVT_EDB. */
int kvti_chunked_open(kvti_chunked **out, const char *cache_dir, kvt_index *idx,
                      uint32_t chunk_tokens, const char *model_id,
                      const kvti_chunkstore_opts *o);
void kvti_chunked_close(kvti_chunked *c); /* NULL is a no-op */
kvti_chunkstore *kvti_chunked_store(kvti_chunked *c);
/* The same store behind the chunk-store seam (store/chunk_backend.h): what
 * the tier moves chunks into and out of, as it does a remote store's. */
kvti_chunk_backend *kvti_chunked_chunks(kvti_chunked *c);
uint32_t kvti_chunked_chunk_tokens(const kvti_chunked *c);
/* The namespace encoding the chains are seeded with (kvti_chunk_ns_encode of
 * model_id, no salt). */
const uint8_t *kvti_chunked_ns(const kvti_chunked *c, size_t *len);

typedef struct kvti_chunked_put_result {
  uint64_t entry_bytes;   /* bytes of the tail entry (the index row's) */
  uint64_t chunk_bytes;   /* chunk file bytes newly written */
  size_t chunks, written; /* chain length, newly written chunks */
  size_t rewritten;       /* damaged chunks written again */
} kvti_chunked_put_result;

/* A spill being stored in steps, so the tier can stage, publish, commit or
 * roll back its tail entry as any other entry's (a failed replacement keeps
 * the acknowledged version, record included):
 *   prepare   writes the missing chunks (durable, indexed; immutable, so a
 *             later failure leaves only reusable prefixes), with_record
 *             commits the chained-entry record in the same transaction as
 *             their rows (one commit; p->recorded; a failure of prepare
 *             after it puts the previous record back; a later failure must
 *             undo it) and builds the tail;
 *   record    (before the tail is published) commits the record when
 *             prepare did not, without waiting for another connection's
 *             lock (KVT_EBUSY);
 *   commit    (after the index row) touches the chain, or drops the record of
 *             a chained version replaced by a whole entry;
 *   undo      (the publish or the row failed) restores the previous record.
 * prep_snapshot is what to stage: the tail, or s itself when nothing was
 * chunked. prep_free in every case after prepare. */
typedef struct kvti_chunked_prep {
  kvti_snapshot *tail; /* NULL: s is stored whole */
  int chained;         /* rec is to be (was) written */
  int had_old;         /* old: the record before this spill */
  int recorded;        /* rec committed by prepare, with the chunk rows */
  uint64_t n_tokens;   /* the spill's: its length class marks new chunks */
  kvti_chained_entry rec, old;
  kvti_chunked_put_result res;
  kvti_chunk_split split; /* has_split: the tail's layers live here */
  int has_split;
  kvti_chunkstore_batch *batch; /* prepare_in's: the rows wait for record */
  size_t member;
} kvti_chunked_prep;
/* with_record: commit the record with the chunk rows (only when nothing is
 * stored under the hash: a reader of a previous version must not meet the
 * new record before the stripe is held; record then commits it). */
int kvti_chunked_prepare(kvti_chunked *c, kvti_chunked_prep *p,
                         const kvti_snapshot *s, int with_record);
/* prepare for a spill of a group commit: its missing chunks are written into
 * batch b (store/chunkstore.h: not yet durable or indexed); after b's set
 * is synced and b published, record commits the chunk rows and the record
 * in one transaction (recorded then). For a new entry only (no reader of a
 * previous version). */
int kvti_chunked_prepare_in(kvti_chunked *c, kvti_chunked_prep *p,
                            const kvti_snapshot *s, kvti_chunkstore_batch *b);
const kvti_snapshot *kvti_chunked_prep_snapshot(const kvti_chunked_prep *p,
                                                const kvti_snapshot *s);
int kvti_chunked_prep_record(kvti_chunked *c, kvti_chunked_prep *p);
void kvti_chunked_prep_commit(kvti_chunked *c, kvti_chunked_prep *p);
void kvti_chunked_prep_undo(kvti_chunked *c, kvti_chunked_prep *p);
void kvti_chunked_prep_free(kvti_chunked_prep *p);

/* Stores snapshot s in one go (prepare, record, be->put, commit): its chain,
 * then (record first) its tail entry through be->put. A spill with nothing to
 * chunk is put whole (no record). Returns as the backend's put, plus KVT_EDB.
 */
int kvti_chunked_put(kvti_chunked *c, kvti_backend *be,
                     kvti_chunked_put_result *res, const kvti_snapshot *s,
                     const kvti_write_opts *wo);

/* The namespace chain keys are seeded with: model_id, plus the digest of
 * cache_salt s when s->has (NULL: none), so two salts never share or see
 * each other's chunks. ns->own (freed by kvti_chunk_ns_free) holds a salted
 * encoding. Returns 0 or KVT_ENOMEM. */
typedef struct kvti_chunk_ns {
  const uint8_t *p;
  size_t len;
  uint8_t *own;
} kvti_chunk_ns;
int kvti_chunked_ns_of(const kvti_chunked *c, const kvti_salt *s,
                       kvti_chunk_ns *ns);
void kvti_chunk_ns_free(kvti_chunk_ns *ns);

/* 1 when hash is a chained entry (its files alone are a tail). */
int kvti_chunked_is_chained(kvti_chunked *c, const char *hash);
/* After the entry's files are removed: drops its record. */
void kvti_chunked_forget(kvti_chunked *c, const char *hash);

/* Longest pure chain over tokens: *m tokens (a multiple of C; 0 = none),
 * *mem = the bytes a promote of them allocates, *hash = hex SHA-256 of
 * tokens[0, m) (hash NULL: not computed). Returns 0 or KVT_EINVAL. */
int kvti_chunked_lookup_prefix(kvti_chunked *c, const kvti_salt *salt,
                               const int32_t *tokens, size_t n, uint64_t *m,
                               uint64_t *mem, char hash[65]);
/* Refreshes the chain under tokens[0, m) (leaf and every ancestor). 0 or
 * KVT_ENOTFOUND. */
int kvti_chunked_touch(kvti_chunked *c, const kvti_salt *salt,
                       const int32_t *tokens, size_t n);

/* The pure chain a read of tokens[0, m) uses (as kvti_chunked_get_prefix
 * resolves it, in this store's namespace and salt (NULL: none)): *recs
 * (kvti_malloc'ed, *k = m / C chunks). For the host RAM tier, which verifies a
 * cached prefix against it. Returns 0, KVT_ENOTFOUND (not aligned, no such
 * chain), KVT_ENOMEM. */
int kvti_chunked_prefix_chain(kvti_chunked *c, const kvti_salt *salt,
                              const int32_t *tokens, uint64_t m,
                              kvti_chain_rec **recs, size_t *k);

/* The chain record of entry hash (chunked_rec.h: an entry that is its chain
 * alone), read and parsed from its file into *r (kvti_chainrec_free). For the
 * host RAM tier, which checks a cached copy of such an entry against it as a
 * read of the entry would. Returns 0, KVT_ENOTFOUND (not a record entry),
 * KVT_ECORRUPT, KVT_EIO, KVT_ENOMEM. */
int kvti_chunked_record(kvti_chunked *c, const char *hash, kvti_chainrec *r);

/* The chained-entry row of a tail adopted from elsewhere (a remote fetch
 * renamed into data/, its chunks adopted by the read): committed before the
 * tail is published, as a spill's record is; kvti_chunked_forget drops it
 * when the adoption fails. 0 or KVT_EDB. */
int kvti_chunked_adopt_record(kvti_chunked *c, const kvti_chained_entry *ce);

/* Bytes of all chunk files. */
uint64_t kvti_chunked_disk_bytes(kvti_chunked *c);

/* ---- reads (chunked_read.c) ---- */

/* What an entry that is its chain record alone (chunked_rec.h) says of
 * itself, where a tail's manifest and tokens.bin would be checked. */
typedef struct kvti_chunked_rec_facts {
  int is_record;    /* 1: the entry is a chain record */
  uint64_t rows;    /* total_rows: every layer holds exactly these */
  uint32_t layers;  /* num_layers */
  int tokens_match; /* the record's tokens are the caller's */
} kvti_chunked_rec_facts;
/* The chain a read of entry hash is served from, resolved as
 * kvti_chunked_get resolves it (the entry's own chain record rules over its
 * chained-entry row) and walked up from its last chunk by parent links (no
 * namespace or salt needed). For the host RAM tier, which checks a cached
 * copy of the entry against the chunk files it stands for. */
typedef struct kvti_chunked_chain {
  kvti_chain_rec *recs; /* chunk 0 first (kvti_malloc'ed); NULL: none */
  size_t m;             /* 0: the entry is stored whole */
  kvti_chunked_rec_facts rec;
} kvti_chunked_chain;
/* Fills *out (zeroed first) for entry hash, whose caller holds tokens[0, n).
 * A name the store never gives, or an entry stored whole, is 0 with out->m
 * 0. Returns 0, KVT_ENOTFOUND (its chain replaced or no longer stored),
 * KVT_ECORRUPT (a chain longer than the entry), KVT_EIO, KVT_ENOMEM; *out is
 * zeroed on failure. */
int kvti_chunked_entry_chain(kvti_chunked *c, const char *hash,
                             const int32_t *tokens, size_t n,
                             kvti_chunked_chain *out);

/* Reads entry hash (as be->get with o): a chained entry is read as its tail
 * (on_layer not called for it) and completed with its chain; on_layer then
 * runs for every layer in order. KVT_ENOTFOUND when the chain is incomplete
 * (evicted), KVT_ECORRUPT when a chunk or the tail is damaged (*bad_chunk
 * receives the damaged chunk's key, when it was a chunk; may be NULL). */
int kvti_chunked_get(kvti_chunked *c, kvti_backend *be, kvt_entry **out,
                     const char *hash, const kvti_read_opts *o,
                     uint8_t bad_chunk[32], int *chunk_bad);

/* A trimmed read (o->keep_tokens in [1, entry tokens]) of chained entry hash
 * (record ce) from the chunk store cs, for any kept length: chunks covering
 * the kept tokens, plus the tail's first rows when keep reaches past the
 * chain (chunked_trim.c). Returns as kvti_chunked_get, plus KVT_EUNSUPPORTED
 * (a layer that cannot be cut on the token axis) and KVT_EINVAL (a layer
 * holding fewer valid rows). */
int kvti_chunked_get_trim(kvti_chunkstore *cs, kvti_backend *be,
                          kvt_entry **out, const char *hash,
                          const kvti_chained_entry *ce, const kvti_read_opts *o,
                          uint8_t bad_chunk[32], int *chunk_bad);

/* kvti_chunked_get of a chained entry whose record ce is given rather than
 * indexed (a tail fetched from the remote tier into a staging backend): the
 * chain must be stored locally and match ce. */
int kvti_chunked_get_record(kvti_chunked *c, kvti_backend *be, kvt_entry **out,
                            const char *hash, const kvti_chained_entry *ce,
                            const kvti_read_opts *o, uint8_t bad_chunk[32],
                            int *chunk_bad);

/* Reads tokens[0, m) from their pure chain (m from lookup_prefix) into a new
 * entry, as kvti_chunked_get (alloc, cancel, on_layer of o). Returns 0,
 * KVT_ENOTFOUND (chain shorter now), KVT_ECORRUPT (bad_chunk set), ... */
int kvti_chunked_get_prefix(kvti_chunked *c, const kvti_salt *salt,
                            kvt_entry **out, const int32_t *tokens, uint64_t m,
                            const kvti_read_opts *o, uint8_t bad_chunk[32],
                            int *chunk_bad);

#endif
