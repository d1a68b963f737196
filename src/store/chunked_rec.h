/*
 * chunked_rec.h - entries of the chunked native store that are their chain
 * alone (format/chainrec.h): when a spill's every layer is pure KV held whole
 * by its chain (no tail rows, nothing else to keep), the entry is stored as
 * one chain record instead of a tail entry of per-layer files. This module
 * decides when that applies and reads such an entry back from its chain
 * (every chunk verified); the record itself is format/chainrec.h. After an
 * index loss reconcile adopts it like a tail (its probe gives the chain
 * mark) and the chain table is rebuilt from the chunk files
 * (store/chunkstore_rebuild.c).
 *
 * Invariants: a record is published only after its chunks are durable and
 * indexed and after the chained-entry row (as a tail entry); a record entry
 * is served only when its whole chain is present and verifies.
 */
#ifndef KVT_STORE_CHUNKED_REC_H
#define KVT_STORE_CHUNKED_REC_H

#include "format/chainrec.h"
#include "store/chunkstore.h"

/* 1 when the split spill can be stored as a chain record: chunks > 0, every
 * layer chunked, no tail rows (rows = T), every layer plain or quantized KV
 * with offset = T and no other attribute (so the chain's layers, offset =
 * T, are exactly the spilled ones). */
int kvti_chunked_rec_ok(const kvti_chunk_split *sp, const kvt_layer *layers,
                        uint32_t n_layers);

/* Reads the entry of record r from its chain into a new entry (tokens,
 * hash and memory_bytes from the record; alloc/free_buf/cancel of o). On
 * KVT_ECORRUPT from a chunk, *chunk_bad = 1 and bad_chunk its key (both may
 * be NULL). Returns 0, KVT_ENOTFOUND (chain incomplete: evicted),
 * KVT_ECORRUPT, KVT_EIO, KVT_ENOMEM, KVT_ECANCELED. */
int kvti_chunked_rec_get(kvti_chunkstore *cs, kvt_entry **out,
                         const kvti_chainrec *r, const kvti_read_opts *o,
                         uint8_t bad_chunk[32], int *chunk_bad);

#endif
