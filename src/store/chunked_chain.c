/*
 * chunked_chain.c - the chain side of the chunked store's reads
 * (chunked_chain.h): a resolved chain prefix read through the chunk store
 * with the damaged chunk named, and the comparison of a tail's chain mark
 * with an index row's chain.
 */
#include "store/chunked_chain.h"

#include <string.h>

int kvti_chunked_mark_is(const kvti_chain_mark *m,
                         const kvti_chained_entry *ce) {
  return m->present == 1 && m->chunks == ce->chunks &&
         m->chunk_tokens == ce->chunk_tokens &&
         memcmp(m->last_key, ce->last_key, 32) == 0 &&
         m->layout_hash == ce->layout_hash && m->total_rows == ce->total_rows;
}

int kvti_chunked_read_chain(kvti_chunkstore *cs, const kvti_chain_rec *recs,
                            size_t m, const int32_t *tokens,
                            const kvti_chunk_read_opts *ro,
                            kvti_chunk_prefix *p, uint8_t bad_chunk[32],
                            int *chunk_bad) {
  size_t bad = 0;
  int rc = kvti_chunkstore_read_prefix(cs, recs, m, tokens, ro, p, &bad);
  if (chunk_bad)
    *chunk_bad = 0;
  /* A chunk that fails its checks, or whose indexed file is missing, is the
   * chunk's fault, not the entry's (the tier contains it: tier/chunks.h). */
  if ((rc == KVT_ECORRUPT || rc == KVT_ENOTFOUND) && chunk_bad && bad_chunk &&
      bad < m) {
    memcpy(bad_chunk, recs[bad].key, 32);
    *chunk_bad = 1;
  }
  return rc;
}
