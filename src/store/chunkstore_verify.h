/*
 * chunkstore_verify.h - checking an in-memory copy of a chain's rows (the host
 * RAM tier's cached entries and prefixes of the chunked native store,
 * tier/ramtier.c) against the chunk files exactly as a read checks the bytes
 * it reads, without reading any tensor data: each chunk file is opened and
 * its header checked against its chain row and the prompt's tokens (as
 * kvti_chunkstore_read_prefix does), its layout matched against the cached
 * layers, and every block checksum of its data section verified over the
 * cached rows, taken in file order (layer-major, tensor, head-contiguous).
 */
#ifndef KVT_STORE_CHUNKS_VERIFY_H
#define KVT_STORE_CHUNKS_VERIFY_H

#include "store/chunkstore.h"

#include <stdatomic.h>

/* Verifies that layers[0, n_layers) (the cached entry: chunked tensors have
 * their full token extent on axis -2) hold, in rows [0, m*C) of every chunked
 * layer, exactly the data of chunks recs[0, m) over tokens. row0 (n_layers,
 * may be NULL) receives m*C for each layer the chain holds and 0 for the
 * others (the rows the entry's own files hold start there). Returns 0,
 * KVT_ENOTFOUND (a chunk file is gone), KVT_ECORRUPT (the copy is not the
 * chain's: layout, shapes or a block checksum differ; or a file is damaged),
 * KVT_EIO, KVT_ENOMEM, KVT_ECANCELED. Chunks are checked on up to threads
 * threads (kvti_parfor; 0: 2). */
int kvti_chunkstore_verify_mem(kvti_chunkstore *cs, const kvti_chain_rec *recs,
                               size_t m, const int32_t *tokens,
                               const kvt_layer *layers, uint32_t n_layers,
                               atomic_int *cancel, unsigned threads,
                               uint64_t *row0);

#endif
