/*
 * chunks.h - the tier's use of the chunked native store (store/chunked.h)
 * when kvt_options.chunk_tokens is set: open/close with the tier, the put the
 * writer makes instead of the backend's, the verified read promote and
 * read_entry make instead of the backend's (with chunk quarantine), prefix
 * lookups that chunk-aligned chains can answer, touches, forgetting an entry's
 * record on removal, and the bytes of chunk files (chunks.c); the reads and
 * their aftermath (chunk_reads.c); the damage routine (chunk_tools.c). Every
 * function is a no-op (or falls through to the backend) when chunking is off
 * (t->chunked == NULL).
 */
#ifndef KVT_TIER_CHUNKS_H
#define KVT_TIER_CHUNKS_H

#include "store/chunked.h"
#include "tier/tier.h"

int kvti_tier_chunks_open(kvt_tier *t);
void kvti_tier_chunks_close(kvt_tier *t);
/* After an index rebuild (or an open without index.db): the chain table is
 * rebuilt from the chunk files before reconcile adopts the entries (whose
 * tails then find their chains). A no-op without chunking or read-only. */
int kvti_tier_chunks_rebuild(kvt_tier *t);
/* Reconcile's adoption of a tail (probe found a chain mark, p->chain): puts
 * its chained-entry record back when its chain is indexed and complete.
 * Returns 1 (adopt the row), 0 (leave it: no chunked store to read it with),
 * or KVT_ECORRUPT (its chain is gone or differs: quarantine it). mut_mu
 * held. */
int kvti_tier_chunks_adopt(kvt_tier *t, const char *hash,
                           const kvti_chain_mark *m);

/* The writer's chunked steps (store/chunked.h, kvti_chunked_prep): prepare
 * writes the missing chunks (counted in spill_bytes); committed runs after
 * the index row. Caller holds mut_mu. */
int kvti_tier_chunks_prepare(kvt_tier *t, kvti_chunked_prep *p,
                             const kvti_snapshot *s, int with_record);
void kvti_tier_chunks_committed(kvt_tier *t, kvti_chunked_prep *p);
/* The same steps for the spills of a group commit (store/chunkstore.h's
 * batch): batch_new opens the chunk batch over set (*b NULL when chunking is
 * off), prepare_in writes a spill's missing chunks into it. Caller holds
 * mut_mu. */
int kvti_tier_chunks_batch_new(kvt_tier *t, kvti_chunkstore_batch **b,
                               struct kvti_syncset *set);
int kvti_tier_chunks_prepare_in(kvt_tier *t, kvti_chunked_prep *p,
                                const kvti_snapshot *s,
                                kvti_chunkstore_batch *b);
/* As be->get (caller holds the entry's stripe shared). A damaged chunk is
 * handled after the stripe is released (kvti_tier_chunks_after_read). */
int kvti_tier_chunks_get(kvt_tier *t, kvt_entry **out, const char *hash,
                         const kvti_read_opts *o);
/* With no lock held, after a read that failed: a chunk the read found
 * damaged or missing goes through kvti_tier_chunk_damaged; a chained entry
 * whose chain was cut is kept (a miss) unless its chain is gone from the
 * table after one rescan of the chunk files (then it was evicted: removed).
 * Returns 1 when the failure was a chunk's - the entry's own files are not
 * at fault and must not be quarantined - else 0. */
int kvti_tier_chunks_after_read(kvt_tier *t);
/* The one routine for a damaged chunk, shared by the serving path and
 * kvt_tier_chunk_verify's repair: under mut_mu, when key is still indexed,
 * its file alone moves to quarantine/chunk-<key>/ (found == KVT_ECORRUPT;
 * deleted when quarantine_max is 0; KVT_ENOTFOUND: the file is already gone
 * and nothing moves) and the chunk is marked damaged. Nothing else is
 * removed: the chunks below it stay indexed and on disk, the entries
 * through it stay (unservable - their reads miss - until a spill of those
 * tokens writes the chunk again, which makes them whole). Logged and
 * counted (chunks_quarantined, entries_unservable, quarantined). Returns
 * the number of entries through the chunk. No lock held by the caller. */
uint64_t kvti_tier_chunk_damaged(kvt_tier *t, const uint8_t key[32], int found,
                                 const char *why);
/* At open: the damaged marks a closed tier held, read back from their
 * persistent record - the quarantine move (quarantine/chunk-<key>[.n]/).
 * An indexed chunk quarantined so whose file is not back in chunks/<kk>
 * is marked damaged again, uncounted and unlogged per chunk (it was
 * counted when found), so a reopened tier neither offers nor re-counts
 * what is already known damaged. A chunk whose record is gone (deleted
 * with quarantine_max 0, or bounded away) is found again by its first read.
 * Costs one listing of quarantine/ and a stat per quarantined chunk; open
 * still lists nothing under chunks/. Returns how many were marked. */
size_t kvti_tier_chunks_load_damaged(kvt_tier *t);
/* The same for a chunk a read outside kvti_tier_chunks_get found damaged
 * (the remote tier's reads of chained entries). No lock held. */
void kvti_tier_chunks_quarantine(kvt_tier *t, const uint8_t key[32]);

/* rc (an index lookup's result for info) unless the entry is chained over
 * a chunk marked damaged: then KVT_ENOTFOUND (kept, not offered). Cheap
 * when nothing is damaged. */
int kvti_tier_chunks_servable(kvt_tier *t, const kvt_entry_info *info, int rc);

/* Prefix lookups: when a pure chain is longer than what info holds (rc =
 * the index's result), info becomes that prefix (num_tokens = m,
 * memory_bytes = the exact promote allocation, token_hash = hash of
 * tokens[0, m)) and 0 is returned; else rc. */
int kvti_tier_chunks_prefix(kvt_tier *t, kvt_entry_info *info, int rc,
                            const int32_t *tokens, size_t n,
                            const kvti_salt *salt);
/* Reads tokens[0, n) from a pure chain when hash names that prefix and no
 * entry row exists. KVT_ENOTFOUND otherwise. */
int kvti_tier_chunks_get_prefix(kvt_tier *t, kvt_entry **out, const char *hash,
                                const kvti_read_opts *o);
/* Refreshes the chain under tokens. */
int kvti_tier_chunks_touch(kvt_tier *t, const int32_t *tokens, size_t n,
                           const kvti_salt *salt);
/* After an entry's files were removed (mut_mu held). */
void kvti_tier_chunks_forget(kvt_tier *t, const char *hash);
/* Bytes of chunk files (0 when off). */
uint64_t kvti_tier_chunks_bytes(kvt_tier *t);
/* Tokens of tokens[0, n) whose chunks are stored under salt (the longest
 * pure chain, a multiple of chunk_tokens): what a spill of them now would not
 * write again. 0 without chunking or when it cannot be told. No lock needed. */
uint64_t kvti_tier_chunks_stored(kvt_tier *t, const int32_t *tokens, size_t n,
                                 const kvti_salt *salt);

#endif
