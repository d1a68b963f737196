/*
 * chunkstore_seam.c - the local chunk store behind the chunk-store seam
 * (store/chunk_backend.h): the same five operations the Redis store offers,
 * over chunks/<kk>/<key>.kvc and the chain table, so the tier moves chunks
 * into and out of the local store the way it moves them into and out of a
 * remote one. A chunk is stored when the chain table holds its row (rows
 * never exist without their file: files first); put is the adoption of a
 * verified chunk, durable before it is indexed; the caller serialises put and
 * remove with the store's other changes (the tier's mut_mu).
 */
#include "store/chunkstore.h"

#include "base/error.h"

#include <stddef.h>

/* A chunk file is far smaller than this; a larger one is not a chunk. */
#define SEAM_MAX_CHUNK ((size_t)1 << 31)

static kvti_chunkstore *store_of(kvti_chunk_backend *cb) {
  return ((kvti_chunkstore_seam *)cb)->cs;
}

static int seam_has(kvti_chunk_backend *cb, const uint8_t (*keys)[32], size_t n,
                    int lookup, uint8_t *present) {
  (void)lookup; /* the chain table is in memory: no deadline to choose */
  kvti_chains *ch = kvti_chunkstore_chains(store_of(cb));
  for (size_t i = 0; i < n; i++)
    present[i] = kvti_chains_find(ch, keys[i], NULL) ? 1 : 0;
  return 0;
}

static int seam_get(kvti_chunk_backend *cb, const uint8_t key[32], void **bytes,
                    size_t *len) {
  kvti_chunkstore *cs = store_of(cb);
  char *buf = NULL;
  *bytes = NULL;
  /* Stored means indexed, as has answers: an unindexed file is an orphan. */
  if (!kvti_chains_find(kvti_chunkstore_chains(cs), key, NULL))
    return KVT_ERR(KVT_ENOTFOUND, "chunk not stored");
  int rc = kvti_chunkstore_read_bytes(cs, key, &buf, len, SEAM_MAX_CHUNK);
  *bytes = rc == 0 ? buf : NULL;
  return rc;
}

static int seam_put(kvti_chunk_backend *cb, const kvti_chain_rec *rec,
                    const void *bytes, size_t len) {
  return kvti_chunkstore_adopt(store_of(cb), bytes, len, rec);
}

static int seam_remove(kvti_chunk_backend *cb, const uint8_t key[32]) {
  int rc = kvti_chunkstore_remove(store_of(cb), key, NULL, NULL);
  if (rc == KVT_ENOTFOUND) {
    kvt_clear_error();
    rc = 0;
  }
  return rc;
}

static int seam_lookup(kvti_chunk_backend *cb, const uint8_t *ns, size_t ns_len,
                       const int32_t *tokens, size_t n, uint32_t chunk_tokens,
                       kvti_chain_rec *out, size_t max, size_t *m) {
  return kvti_chunkstore_lookup(store_of(cb), ns, ns_len, tokens, n,
                                chunk_tokens, out, max, m);
}

static const kvti_chunk_backend_ops seam_ops = {.name = "local",
                                                .has = seam_has,
                                                .get = seam_get,
                                                .put = seam_put,
                                                .remove = seam_remove,
                                                .lookup = seam_lookup};

void kvti_chunkstore_seam_init(kvti_chunkstore_seam *s, kvti_chunkstore *cs) {
  s->base.ops = &seam_ops;
  s->cs = cs;
}
