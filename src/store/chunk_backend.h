/*
 * chunk_backend.h - the chunk-store seam: the one way the tier reaches the
 * chunks of the chunked native store, in whichever store holds them. Chunk
 * files (format/chunk.h) are content addressed by their chain key (the same
 * key is the same tokens under the same namespace and layout), so a chunk is
 * stored once whoever spills it, and moving a chain between two stores is the
 * same walk whichever way it goes: ask the destination which keys it lacks,
 * take those from the source, verify them, put them into the destination.
 * The tier does exactly that for uploads, fetches and remote verification
 * (tier/rchunks.c), through these operations only.
 *
 * Implementations: the local chunk store (store/chunkstore_seam.c, over
 * chunks/<kk>/<key>.kvc and the chain table; reached with
 * kvti_chunked_chunks) and the Redis / Valkey store (store/redis/chunks.c,
 * over <P>{c:<key>} and its index shards; reached with kvti_backend_chunks of
 * the remote entry backend). The local store's own reads of whole chains
 * (O_DIRECT into the destination tensors, store/chunkstore.h) stay below
 * this seam: a chain is always served from the local store, a remote one
 * after its missing chunks were copied in. So do a local spill's own chunk
 * writes (store/chunkstore_write.c through the chunked store): they write
 * chunk files from the spill's tensors and make them durable with the
 * entry's group commit, where put takes a chunk file's verified bytes to
 * copy it from another store.
 *
 * Ownership: the object is owned by the store it belongs to and lives as
 * long as that store; the seam has no constructor or destructor of its own.
 * Threads: has, get and lookup may run on any thread concurrently. put and
 * remove of the local store are serialised by the caller with every other
 * change to the local chunks (the tier's mut_mu); the Redis store needs no
 * lock. All functions return 0 or a negative KVT_E* code with the thread's
 * error message set. Nothing is verified by the store: a caller parses and
 * verifies every chunk it takes (kvti_chunk_verify_bytes) before it uses or
 * keeps it.
 */
#ifndef KVT_CHUNK_BACKEND_H
#define KVT_CHUNK_BACKEND_H

#include "index/chain.h"

#include <stddef.h>
#include <stdint.h>

typedef struct kvti_chunk_backend kvti_chunk_backend;

typedef struct kvti_chunk_backend_ops {
  const char *name; /* "local", "redis" */
  /* present[i] = 1 when chunk keys[i] is stored, else 0 (one round trip
   * where the store allows it). lookup: a lookup's question, answered within
   * the store's lookup deadline where it has one. 0 or a connection error. */
  int (*has)(kvti_chunk_backend *cb, const uint8_t (*keys)[32], size_t n,
             int lookup, uint8_t *present);
  /* The chunk file's bytes (*bytes kvti_malloc'ed): 0, KVT_ENOTFOUND (gone;
   * a shared store also makes every node's lookups forget it), or another
   * code. */
  int (*get)(kvti_chunk_backend *cb, const uint8_t key[32], void **bytes,
             size_t *len);
  /* Stores a verified chunk file under rec->key (rec as
   * kvti_chunk_verify_bytes returns it) unless it is stored already, and
   * makes rec known to lookups. The local store keeps the chain table's rule:
   * the parent must be stored (KVT_EINVAL otherwise) unless it is chunk 0. */
  int (*put)(kvti_chunk_backend *cb, const kvti_chain_rec *rec,
             const void *bytes, size_t len);
  /* Deletes chunk key (found damaged). A store that links chunks into chains
   * (the local one) removes the chunks below it too, which nothing could
   * reach any more. A missing chunk is success. */
  int (*remove)(kvti_chunk_backend *cb, const uint8_t key[32]);
  /* The longest chain over tokens[0, n) stored in namespace ns, chunks of
   * chunk_tokens tokens: out[0, *m) (at most max), as kvti_chains_lookup.
   * Answered without I/O (the local chain table, the Redis store's lookup
   * mirror: *m = 0 while that is not in sync). */
  int (*lookup)(kvti_chunk_backend *cb, const uint8_t *ns, size_t ns_len,
                const int32_t *tokens, size_t n, uint32_t chunk_tokens,
                kvti_chain_rec *out, size_t max, size_t *m);
} kvti_chunk_backend_ops;

struct kvti_chunk_backend {
  const kvti_chunk_backend_ops *ops;
};

/* The longest pure chain (its first chunk's row says so: every layer of
 * its spill, none rotating) that cb holds over tokens[0, n) in namespace ns:
 * *recs (kvti_malloc'ed) and *m chunks, or *recs NULL and *m 0 when there is
 * none (chunk_backend.c). 0, KVT_ENOMEM, or the lookup's code. */
int kvti_chunk_backend_pure(kvti_chunk_backend *cb, const uint8_t *ns,
                            size_t ns_len, const int32_t *tokens, size_t n,
                            uint32_t chunk_tokens, kvti_chain_rec **recs,
                            size_t *m);

#endif
