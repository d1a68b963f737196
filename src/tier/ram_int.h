/*
 * ram_int.h - private to the RAM tier's files (ramtier.c, ram_chain.c,
 * ram_cut.c, ram_cutter.c): the cutter's state, a cached copy's chain, and
 * the calls between them. ramtier.c sits on top; ram_cutter.c uses ram_cut.c;
 * ram_chain.c and ram_cut.c use nothing of the others.
 */
#ifndef KVT_TIER_RAM_INT_H
#define KVT_TIER_RAM_INT_H

#include "tier/hostcache.h"
#include "tier/tier.h"
#include "index/chain_walk.h"
#include "store/chunked.h"
#include "base/workq.h"

#include <stdatomic.h>

/* ---- ram_cut.c ---- */

/* Releases layers[0, n) (their buffers) and the array. */
void kvti_ram_release_layers(kvt_layer *ls, uint32_t n);
/* A deep copy of s into d in a read's layout (kvti_buf_alloc'ed data). On
 * KVT_ENOMEM d holds what was copied (kvti_layer_release frees it). */
int kvti_ram_dup_layer(kvt_layer *d, const kvt_layer *s);
/* Cuts the layers of an entry of n_tokens (owned, a read's layout:
 * kvti_buf_alloc'ed data; layers[0, n) and the array are consumed either
 * way) over chain recs[0, m) into its tail (*tail when tail is non-NULL:
 * the chunked layers' rows past the chain, copied, and every other layer,
 * moved) and copies of the chunks with have[i] == 0 (chs[i]; NULL for the
 * others). Returns 0, KVT_EINVAL (the layers do not cut into that chain:
 * nothing built), KVT_ENOMEM. */
int kvti_ram_cut(kvt_layer *layers, uint32_t n, size_t n_tokens,
                 const kvti_chain_rec *recs, size_t m, const uint8_t *have,
                 kvti_hc_item *tail, kvti_hc_chunk **chs);
/* As kvti_ram_cut over layers the caller keeps (a spill's): everything is
 * copied, nothing consumed. */
int kvti_ram_cut_borrowed(const kvt_layer *layers, uint32_t n, size_t n_tokens,
                          const kvti_chain_rec *recs, size_t m,
                          const uint8_t *have, kvti_hc_item *tail,
                          kvti_hc_chunk **chs);
/* A cut tail's record: the entry's figures, tagged with the chain's last
 * chunk. */
void kvti_ram_tail_meta(kvti_hc_item *tail, uint64_t memory_bytes,
                        uint64_t disk_bytes, int storage_mode,
                        const kvti_chain_rec *recs, size_t m);

/* ---- ram_cutter.c: state ---- */

typedef struct ram_job ram_job;

/* The background cutter's state (ram_cutter.c): reference counted, as lent
 * entries may outlive the tier. */
typedef struct kvti_ram_bg {
  kvti_workq q;
  atomic_uint refs;
  kvti_hcache *hc; /* a reference */
  /* Whole records left uncut (ram_cutter.c), newest first: the worker's alone
   * (and bg_release's, once no worker runs). */
  ram_job *deferred;
  size_t n_deferred;
} ram_bg;

/* ---- ram_cutter.c: calls ---- */

/* Drops one reference; the last stops nothing (the tier's close stopped the
 * worker) and frees the state and the jobs left deferred. */
void kvti_ram_bg_release(ram_bg *bg);
int kvti_ram_bg_open(kvt_tier *t, uint64_t bound);
/* Asks the cutter to cut the deferred records whose chain starts with first
 * (its chunks were just made resident by another path). Best effort: a
 * refused push leaves them whole. */
void kvti_ram_push_wake(kvt_tier *t, const uint8_t *first);
/* Hooks e (lent under id) so its buffers come back when freed; recs[0, m)
 * (copied; NULL for a whole entry) is the chain it was read through. */
void kvti_ram_hook(kvt_tier *t, kvt_entry *e, uint64_t id,
                   const kvti_chain_rec *recs, size_t m, int prefix);

/* ---- ram_chain.c ---- */

/* The chain cached rows of hash come from: a chained entry's (its record's
 * last chunk, walked back through the chain table) or, prefix = 1, the pure
 * chain of tokens[0, n) in this tier's namespace (the one a disk read of the
 * prefix would use). recs NULL and m 0 (and 0 returned) for an entry stored
 * whole. */
typedef struct ram_chain {
  kvti_chain_rec *recs;
  size_t m;
  uint64_t bytes; /* chunk file bytes */
  /* An entry stored as its chain record: it has no tail files, so the
   * record (its tokens, layer count, rows) stands where a tail's manifest
   * and tokens.bin would be checked. */
  kvti_chunked_rec_facts rec;
} ram_chain;

int kvti_ram_chain_of(kvt_tier *t, const char *hash, const int32_t *tokens,
                      size_t n, int prefix, const kvti_salt *salt,
                      ram_chain *out);
/* Checks a cached copy as the disk read it replaces would check the bytes it
 * reads (see the file comment); sets the layers' attributes as that read
 * does. */
int kvti_ram_verify_with(kvt_tier *t, const char *hash, kvti_hc_item *it,
                         const kvti_read_opts *ro, int prefix,
                         const ram_chain *chp);
/* Chunk rec (the prompt's tokens for it) read from its file, every block
 * verified as it lands (kvti_chunk_read_data), into a new chunk record. */
int kvti_ram_load_chunk(kvt_tier *t, const kvti_chain_rec *rec,
                        const int32_t *tokens, kvti_hc_chunk **out);
/* Frees layers built by assemble (caller buffers through ro->free_buf). */
void kvti_ram_free_built(kvt_layer *ls, uint32_t n, const kvti_read_opts *ro);
/* New layers (ro's alloc, else kvti_buf_alloc) holding the chain's rows from
 * chunks chs[0, m) followed by tail's rows, with tail's attributes and its
 * other layers copied - the entry a disk read returns - or, tail NULL, the
 * pure prefix of the chain alone (attributes set by the check that follows).
 * Nothing here is trusted: the result is checked against the files before
 * it is served. *bytes: tensor bytes allocated. Returns 0, KVT_ECORRUPT (the
 * pieces do not fit together), KVT_ENOTFOUND (a prefix of a chain that is
 * not pure), KVT_ENOMEM. */
int kvti_ram_assemble(const kvti_hc_item *tail, const kvti_hc_chunk *const *chs,
                      size_t m, const kvti_read_opts *ro, kvt_layer **out,
                      uint32_t *n_out, uint64_t *bytes);

#endif
