/*
 * chunk_reads.c - verified reads of chained entries and pure chains through
 * the chunked store, and what a failed read leaves to do once no lock is
 * held: a damaged chunk goes to the one routine that contains the damage
 * (chunk_tools.c, kvti_tier_chunk_damaged: only the chunk moves, what depends
 * on it is kept unservable), and an entry whose chain was evicted under it
 * is removed. The read records what it found in thread-local state, so the
 * caller can release the entry's stripe first (a removal takes mut_mu, which
 * must never be taken under a stripe). Sits above maint.c, whose removal it
 * calls.
 */
#include "tier/chunks.h"

#include "base/error.h"
#include "base/hash.h"
#include "base/io.h"
#include "format/chunk.h"
#include "index/chain_walk.h"
#include "index/index.h"
#include "store/chunked.h"
#include "tier/chunk_tools.h"
#include "tier/ramtier.h"

#include <string.h>

/* A damaged chunk seen by this thread's last read (quarantined by
 * kvti_tier_chunks_after_read once no lock is held). */
static _Thread_local uint8_t g_bad[32];
static _Thread_local int g_has_bad;
static _Thread_local int g_bad_rc; /* KVT_ECORRUPT or KVT_ENOTFOUND */
/* A chained entry whose chain was evicted under it (removed likewise). */
static _Thread_local char g_lost[KVT_HASH_HEX_LEN + 1];

int kvti_tier_chunks_get(kvt_tier *t, kvt_entry **out, const char *hash,
                         const kvti_read_opts *o) {
  g_has_bad = 0;
  g_lost[0] = 0;
  if (!t->chunked)
    return t->be->ops->get(t->be, out, hash, o);
  int rc = kvti_chunked_get(t->chunked, t->be, out, hash, o, g_bad, &g_has_bad);
  g_bad_rc = rc;
  if (rc == KVT_ENOTFOUND && !g_has_bad &&
      kvti_chunked_is_chained(t->chunked, hash))
    memcpy(g_lost, hash, sizeof g_lost); /* its chain may be gone */
  return rc;
}

int kvti_tier_chunks_get_prefix(kvt_tier *t, kvt_entry **out, const char *hash,
                                const kvti_read_opts *o) {
  g_has_bad = 0;
  if (!t->chunked || !o->tokens || o->n_tokens == 0)
    return KVT_ERR(KVT_ENOTFOUND, "no entry %.16s", hash);
  char h[65];
  int rc = kvti_salt_hex(h, &o->salt, o->tokens, o->n_tokens);
  if (rc)
    return rc;
  if (strcmp(h, hash) != 0 ||
      o->n_tokens % kvti_chunked_chunk_tokens(t->chunked))
    return KVT_ERR(KVT_ENOTFOUND, "no entry %.16s", hash);
  return kvti_chunked_get_prefix(t->chunked, &o->salt, out, o->tokens,
                                 o->n_tokens, o, g_bad, &g_has_bad);
}

/* A chained entry whose read found its chain cut. Evicted chains are gone
 * from the table (eviction removes the entries ending at a leaf with it),
 * so an entry is removed only when its chain's last chunk is not indexed,
 * even after the chunk files were rescanned once (a damaged or emptied
 * chunk table is rebuilt from the files, as reindex would). Anything else -
 * a damaged chunk, a damaged row in the middle - keeps the entry: a miss.
 * mut_mu held. */
static void chain_cut_locked(kvt_tier *t, const char *hash) {
  kvti_chains *ch = kvti_chunkstore_chains(kvti_chunked_store(t->chunked));
  uint8_t h[32];
  kvti_chained_entry ce;
  if (kvti_unhex32(h, hash) != 0 || !kvti_chains_entry_get(ch, h, &ce))
    return; /* replaced or removed meanwhile */
  if (!kvti_chains_find(ch, ce.last_key, NULL) && !t->chunks_rescanned)
    kvti_tier_chunks_rebuild(t);
  if (!kvti_chains_find(ch, ce.last_key, NULL)) {
    kvti_tier_remove_locked(t, hash, KVTI_RM_EVICT);
    return;
  }
  KVTI_STAT_ADD(&t->stats, chain_cuts_kept, 1);
  kvti_log(t, KVT_LOG_WARN,
           "kvtier: entry %.16s: its chain is cut (%s); kept, not served "
           "until the chain is whole again (a spill of its tokens, or "
           "kvtier reindex)",
           hash, kvt_last_error());
}

int kvti_tier_chunks_after_read(kvt_tier *t) {
  int chunk_fault = 0;
  if (t->chunked && g_lost[0] && !t->readonly) {
    kvti_error_state es;
    kvti_error_state_capture(&es, KVT_ENOTFOUND);
    pthread_mutex_lock(&t->mut_mu);
    chain_cut_locked(t, g_lost);
    pthread_mutex_unlock(&t->mut_mu);
    kvti_error_state_restore(&es);
  }
  g_lost[0] = 0;
  if (!t->chunked || !g_has_bad)
    return 0;
  g_has_bad = 0;
  chunk_fault = 1;
  if (t->readonly)
    return chunk_fault;
  kvti_error_state es;
  kvti_error_state_capture(&es, g_bad_rc ? g_bad_rc : KVT_ECORRUPT);
  kvti_tier_chunk_damaged(
      t, g_bad, g_bad_rc == KVT_ENOTFOUND ? KVT_ENOTFOUND : KVT_ECORRUPT,
      es.msg);
  kvti_error_state_restore(&es);
  return chunk_fault;
}

void kvti_tier_chunks_quarantine(kvt_tier *t, const uint8_t key[32]) {
  memcpy(g_bad, key, 32);
  g_has_bad = 1;
  g_bad_rc = KVT_ECORRUPT;
  kvti_tier_chunks_after_read(t);
}
