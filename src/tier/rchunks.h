/*
 * rchunks.h - chunks as the unit shared between nodes (docs/REMOTE.md
 * "Chunks"): the remote tier's half of the chunked native store. A chunked
 * spill uploads the chunks the remote store lacks (content addressed by their
 * chain key) and its tail with its chain record; remote prefix lookups see
 * the chains other nodes stored (through the store's lookup mirror); a remote
 * read fetches only the chunks missing locally, verifies every one completely
 * and adopts it into the local chunk store, then serves through the local,
 * verified chunked read path. Every function is a no-op (handled = 0, or
 * KVT_ENOTFOUND) when the tier is not chunked or the store has no chunk ops.
 */
#ifndef KVT_TIER_RCHUNKS_H
#define KVT_TIER_RCHUNKS_H

#include "store/backend.h"
#include "tier/tier.h"

/* Upload of snapshot s on the remote thread. *handled = 0: not a chunked
 * spill (the caller puts it whole). Else returns 0 or the failure, *bytes =
 * bytes sent (new chunks + tail). */
int kvti_rchunks_upload(kvt_tier *t, kvti_backend *be, const kvti_snapshot *s,
                        const kvti_write_opts *wo, uint64_t *bytes,
                        int *handled);
/* The longest remote pure chain over tokens[0, n) of at least min_len
 * tokens, its chunks missing locally confirmed present (lookup client): info
 * as a local chain prefix reports it. 0, KVT_ENOTFOUND, or a connection
 * error. */
int kvti_rchunks_lookup(kvt_tier *t, kvti_backend *be, kvt_entry_info *info,
                        const int32_t *tokens, size_t n, uint64_t min_len);
/* 1 when the chained remote entry m belongs to this tier's namespace and
 * chunk size (its chain's seed is this namespace's for its layout): another
 * model's entries are not this tier's hits. */
int kvti_rchunks_entry_ok(kvt_tier *t, const kvti_backend_meta *m);
/* Reads the chained remote entry whose tail was fetched into stage (m its
 * metadata): the missing chunks are fetched, verified and adopted, then the
 * entry is assembled and verified as a local chained entry. *fetched = chunk
 * bytes fetched. Returns as kvti_chunked_get. */
int kvti_rchunks_read_chained(kvt_tier *t, kvti_backend *be, kvt_entry **out,
                              const char *stage, const kvti_backend_meta *m,
                              const kvti_read_opts *ro, uint64_t *fetched);
/* Reads the remote chain prefix hash = SHA-256 of ro->tokens (no remote entry
 * ends there): missing chunks fetched, verified, adopted, then read locally.
 * KVT_ENOTFOUND when no such chain is known. */
int kvti_rchunks_read_prefix(kvt_tier *t, kvti_backend *be, kvt_entry **out,
                             const char *hash, const kvti_read_opts *ro,
                             uint64_t *fetched);
/* Verifies the chain of a chained remote entry (tools: remote verify): every
 * chunk fetched and verified, nothing kept. */
int kvti_rchunks_verify(kvt_tier *t, kvti_backend *be, const int32_t *tokens,
                        size_t n, const kvti_backend_meta *m);

#endif
