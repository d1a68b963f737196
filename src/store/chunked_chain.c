/*
 * chunked_chain.c - the chain side of the chunked store's reads
 * (chunked_chain.h): a resolved chain prefix read through the chunk store
 * with the damaged chunk named, the read of a tail, and a tail's chain mark
 * or a chain record compared with, or made into, an index row's chain.
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

void kvti_chunked_mark_row(kvti_chained_entry *ce, const kvti_chain_mark *m) {
  ce->chunks = m->chunks;
  ce->chunk_tokens = m->chunk_tokens;
  memcpy(ce->last_key, m->last_key, 32);
  ce->layout_hash = m->layout_hash;
  ce->total_rows = m->total_rows;
}

void kvti_chunked_rec_row(kvti_chained_entry *ce, const kvti_chainrec *r) {
  memset(ce, 0, sizeof *ce);
  memcpy(ce->hash, r->hash, 32);
  ce->chunks = r->chunks;
  ce->chunk_tokens = r->chunk_tokens;
  memcpy(ce->last_key, r->last_key, 32);
  ce->layout_hash = r->layout_hash;
  ce->total_rows = r->total_rows;
}

int kvti_chunked_get_tail(kvti_backend *be, kvt_entry **out, const char *hash,
                          const kvti_read_opts *o, uint64_t rows,
                          kvti_chain_mark *mark) {
  kvti_read_opts to = *o;
  to.on_layer = NULL;
  to.chain_rows = rows; /* the tail's offsets count them */
  to.tail_ok = 1;       /* completed with its chain by the caller */
  mark->present = -1;   /* left so by a backend that reads no manifest */
  to.tail_mark = mark;
  return be->ops->get(be, out, hash, &to);
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
