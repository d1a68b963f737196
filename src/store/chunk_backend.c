/*
 * chunk_backend.c - what every user of the chunk-store seam
 * (chunk_backend.h) asks of a store in the same words, whichever store it
 * is: the longest chain over a prompt that a prefix lookup may answer with.
 * Only a pure chain qualifies (its chunks hold every layer of their spill,
 * none rotating), because only such a chain is a complete prefix state at
 * each chunk boundary; the local prefix lookups (store/chunked.c) and the
 * remote ones (tier/rchunks.c) both go through it.
 */
#include "store/chunk_backend.h"

#include "base/error.h"
#include "base/io.h"

int kvti_chunk_backend_pure(kvti_chunk_backend *cb, const uint8_t *ns,
                            size_t ns_len, const int32_t *tokens, size_t n,
                            uint32_t chunk_tokens, kvti_chain_rec **recs,
                            size_t *m) {
  *recs = NULL;
  *m = 0;
  size_t max = chunk_tokens ? n / chunk_tokens : 0;
  if (max == 0)
    return 0;
  kvti_chain_rec *r = kvti_malloc(max * sizeof *r);
  if (!r)
    return KVT_ERR_NOMEM();
  int rc = cb->ops->lookup(cb, ns, ns_len, tokens, n, chunk_tokens, r, max, m);
  if (rc || *m == 0 || !r[0].pure) {
    kvti_free(r);
    *m = 0;
    return rc;
  }
  *recs = r;
  return 0;
}
