/*
 * chunked_chain.h - the chain side of every read of the chunked native store
 * (chunked.c, chunked_rec.c, chunked_trim.c): the chunk reader's options for
 * a read, the read of a resolved chain prefix with the damaged chunk named
 * when it was a chunk's fault, and the check that a tail's chain mark names
 * the chain an index row gives. Kept below the three readers so none of them
 * calls back into another for it. The same goes for the tail's read and for a
 * row made from the chain a tail's mark or a chain record names.
 *
 * Invariant: a chunk that fails its checks, or whose indexed file is missing,
 * is reported as that chunk (its key), never as the entry's fault.
 */
#ifndef KVT_STORE_CHUNKED_CHAIN_H
#define KVT_STORE_CHUNKED_CHAIN_H

#include "format/chainrec.h"
#include "format/entry.h"
#include "index/chain.h"
#include "store/backend.h"
#include "store/chunkstore.h"

#include <stddef.h>
#include <stdint.h>

/* The chunk reader's options for a read with o of a chain whose destination
 * tensors hold total_rows rows (kvti_chunk_read_opts.total_rows; 0 = the
 * chain's). One place, so a new read option reaches every chained read. */
static inline kvti_chunk_read_opts
kvti_chunked_read_opts(const kvti_read_opts *o, uint64_t total_rows) {
  kvti_chunk_read_opts ro = {o->alloc,  o->free_buf, o->alloc_ctx,
                             o->cancel, total_rows,  o->page_cache};
  return ro;
}

/* kvti_chunkstore_read_prefix of chain recs[0, m) for tokens with ro; on
 * KVT_ECORRUPT bad_chunk receives the damaged chunk's key and *chunk_bad 1
 * (both may be NULL; *chunk_bad is 0 otherwise). */
int kvti_chunked_read_chain(kvti_chunkstore *cs, const kvti_chain_rec *recs,
                            size_t m, const int32_t *tokens,
                            const kvti_chunk_read_opts *ro,
                            kvti_chunk_prefix *p, uint8_t bad_chunk[32],
                            int *chunk_bad);

/* 1 when mark m (a tail manifest's, present = 1) names exactly the chain of
 * row ce. */
int kvti_chunked_mark_is(const kvti_chain_mark *m,
                         const kvti_chained_entry *ce);
/* Row ce made to name the chain of mark m (its hash kept): a tail's own
 * manifest rules over the row. */
void kvti_chunked_mark_row(kvti_chained_entry *ce, const kvti_chain_mark *m);
/* The row chain record r stands for (hash and chain from the record, which
 * rules over an indexed row). */
void kvti_chunked_rec_row(kvti_chained_entry *ce, const kvti_chainrec *r);

/* be->get of hash's tail entry with o, its offsets counting the chain's rows
 * first: on_layer is never called (the entry is whole only once joined with
 * its chain) and *mark receives the chain the tail's manifest names
 * (present = -1 from a backend that reads no manifest). */
int kvti_chunked_get_tail(kvti_backend *be, kvt_entry **out, const char *hash,
                          const kvti_read_opts *o, uint64_t rows,
                          kvti_chain_mark *mark);

#endif
