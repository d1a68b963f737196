/*
 * chunks.c - the tier's use of the chunked native store (chunks.h): opens it
 * when chunk_tokens is set, routes the writer's put and the readers' get
 * through it, answers chunk-aligned prefixes of pure-KV chains, touches
 * chains, drops an entry's chain record with the entry, hands a damaged
 * chunk to the one routine that contains the damage (chunk_tools.c,
 * kvti_tier_chunk_damaged: only the chunk moves, what depends on it is kept
 * unservable) and evicts leaf chunks for capacity. Locks: as the backend calls
 * it replaces (mut_mu for changes, the entry's stripe around reads); chunk
 * files are immutable, so reads of shared chunks take no common lock.
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

/* 1 when these options store native spills in chunks. Compat mode writes
 * what the reference reads: one entry per spill. The remote tier shares the
 * chunks (tier/rchunks.h). */
static int chunks_wanted(const kvt_options *o) {
  return o->chunk_tokens != 0 && o->storage_mode == KVT_STORAGE_NATIVE;
}

int kvti_tier_chunks_open(kvt_tier *t) {
  if (!chunks_wanted(&t->opts))
    return 0;
  kvti_chunkstore_opts o = {t->opts.file_mode, t->opts.dir_mode,
                            t->opts.durability == KVT_DURABILITY_FSYNC};
  const char *id = t->opts.model_id ? t->opts.model_id : t->opts.model_name;
  int rc = kvti_chunked_open(&t->chunked, t->dir, t->idx, t->opts.chunk_tokens,
                             id, &o);
  t->opts.model_id = NULL; /* the caller's string: encoded, not kept */
  if (rc == 0)
    kvti_tier_chunks_load_damaged(t);
  return rc;
}

int kvti_tier_chunks_rebuild(kvt_tier *t) {
  if (!t->chunked || t->readonly)
    return 0;
  t->chunks_rescanned = 1;
  size_t n = 0, skipped = 0;
  int rc = kvti_chunkstore_rebuild(kvti_chunked_store(t->chunked), t->dir, &n,
                                   &skipped);
  if (rc == 0 && (n || skipped))
    kvti_log(t, KVT_LOG_WARN,
             "kvtier: %s: chain table rebuilt from the chunk files: %zu "
             "chunks indexed, %zu left out (cut chains or invalid files)",
             t->dir, n, skipped);
  return rc;
}

int kvti_tier_chunks_adopt(kvt_tier *t, const char *hash,
                           const kvti_chain_mark *m) {
  if (!t->chunked)
    return 0;
  kvti_chains *ch = kvti_chunkstore_chains(kvti_chunked_store(t->chunked));
  kvti_chain_rec last;
  /* A tail whose chain is not indexed: its chunks may be on disk unindexed
   * (the index was rebuilt by a tier without chunks): rescan once. */
  if (!kvti_chains_find(ch, m->last_key, NULL) && !t->chunks_rescanned) {
    int rrc = kvti_tier_chunks_rebuild(t);
    if (rrc != 0)
      return rrc;
  }
  /* The chain is named by its last chunk and read by parent links, so a
   * tier of another chunk_tokens (the CLI opens with the default) adopts it
   * as the writer's own would: only a chain that is not stored whole, or
   * whose last chunk holds another run length, is refused. */
  if (!kvti_chunk_tokens_ok(m->chunk_tokens) ||
      !kvti_chains_find(ch, m->last_key, &last) ||
      last.index + 1 != m->chunks || last.layout_hash != m->layout_hash ||
      last.n_tokens != m->chunk_tokens)
    return KVT_ERR(KVT_ECORRUPT,
                   "data/%.16s is the tail of a chain that is not stored",
                   hash);
  kvti_chained_entry ce;
  if (kvti_unhex32(ce.hash, hash) != 0)
    return KVT_ERR(KVT_ECORRUPT, "bad entry name %.16s", hash);
  ce.chunks = m->chunks;
  ce.chunk_tokens = m->chunk_tokens;
  memcpy(ce.last_key, m->last_key, 32);
  ce.layout_hash = m->layout_hash;
  ce.total_rows = m->total_rows;
  int rc = kvti_chains_entry_put(ch, &ce);
  return rc == 0 ? 1 : rc;
}

void kvti_tier_chunks_close(kvt_tier *t) {
  kvti_chunked_close(t->chunked);
  t->chunked = NULL;
}

int kvti_tier_chunks_prepare(kvt_tier *t, kvti_chunked_prep *p,
                             const kvti_snapshot *s, int with_record) {
  int rc = kvti_chunked_prepare(t->chunked, p, s, with_record);
  if (p->res.chunk_bytes)
    KVTI_STAT_ADD(&t->stats, spill_bytes, p->res.chunk_bytes);
  return rc;
}

void kvti_tier_chunks_committed(kvt_tier *t, kvti_chunked_prep *p) {
  if (p->res.rewritten) {
    KVTI_STAT_ADD(&t->stats, chunks_rewritten, p->res.rewritten);
    kvti_log(t, KVT_LOG_INFO,
             "kvtier: %zu damaged chunk(s) written again: the chains through "
             "them serve again",
             p->res.rewritten);
  }
  kvti_chunked_prep_commit(t->chunked, p);
  kvti_tier_chunks_sweep_lazy(t); /* orphans: one chunks/<kk> at a time */
}

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

/* Removes chunk key and everything below it, and the entries whose chain
 * ran through it. The order makes every point a crash can cut it at
 * recoverable: the entries go first (row, then files), while their chains
 * are still whole - a cut there leaves either an entry the next open
 * reconciles whole (its directory and its chain both present) or none; then
 * the chain rows in one transaction, then the chunk files (a cut there
 * leaves orphan files the sweep reclaims). Removing the rows first would let
 * a cut leave an entry directory whose chain is no longer indexed, which
 * reconcile must then call invalid and quarantine. mut_mu held. */
static void drop_chunk_locked(kvt_tier *t, const uint8_t key[32], int why) {
  kvti_chunkstore *cs = kvti_chunked_store(t->chunked);
  kvti_chains *ch = kvti_chunkstore_chains(cs);
  kvti_chain_rec *sub = NULL;
  size_t nsub = 0;
  if (kvti_chains_subtree(ch, key, &sub, &nsub) != 0)
    return;
  uint8_t(*hs)[32] = NULL;
  size_t nh = 0;
  if (kvti_chains_entries_ending(ch, sub, nsub, &hs, &nh) != 0) {
    kvti_free(sub);
    return; /* nothing removed: the chain and its entries stay whole */
  }
  kvti_free(sub);
  for (size_t i = 0; i < nh; i++) {
    char hex[65];
    kvti_hex32(hex, hs[i]);
    kvti_tier_remove_locked(t, hex, why); /* forgets the record too */
  }
  kvti_free(hs);
  kvti_chain_rec *rem = NULL;
  size_t nrem = 0;
  if (kvti_chains_remove_tree(ch, key, &rem, &nrem) != 0)
    return;
  kvti_ram_invalidate_chunks(t, rem, nrem); /* RAM copies through them */
  for (size_t i = 0; i < nrem; i++)
    kvti_chunkstore_unlink(cs, rem[i].key); /* never through a link */
  kvti_free(rem);
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

int kvti_tier_chunks_servable(kvt_tier *t, const kvt_entry_info *info, int rc) {
  if (rc != 0 || !t->chunked)
    return rc;
  kvti_chains *ch = kvti_chunkstore_chains(kvti_chunked_store(t->chunked));
  if (!kvti_chains_any_damaged(ch))
    return rc; /* the common case: one atomic load */
  uint8_t h[32];
  kvti_chained_entry ce;
  if (kvti_unhex32(h, info->token_hash) != 0 ||
      !kvti_chains_entry_get(ch, h, &ce) ||
      !kvti_chains_path_damaged(ch, ce.last_key))
    return rc;
  return KVT_ERR(KVT_ENOTFOUND,
                 "entry %.16s is kept but unservable: a chunk of its chain is "
                 "damaged (served again once a spill writes it)",
                 info->token_hash);
}

int kvti_tier_chunks_prefix(kvt_tier *t, kvt_entry_info *info, int rc,
                            const int32_t *tokens, size_t n,
                            const kvti_salt *salt) {
  if (!t->chunked || (rc != 0 && rc != KVT_ENOTFOUND))
    return rc;
  uint64_t m = 0, mem = 0;
  char h[65];
  if (kvti_chunked_lookup_prefix(t->chunked, salt, tokens, n, &m, &mem, h) !=
          0 ||
      m == 0 || (rc == 0 && m <= info->num_tokens))
    return rc;
  memset(info, 0, sizeof *info);
  memcpy(info->token_hash, h, sizeof info->token_hash);
  info->num_tokens = m;
  info->memory_bytes = mem;
  info->created_at = info->accessed_at = kvti_now_wall();
  return 0;
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

int kvti_tier_chunks_touch(kvt_tier *t, const int32_t *tokens, size_t n,
                           const kvti_salt *salt) {
  if (!t->chunked)
    return KVT_ENOTFOUND;
  return kvti_chunked_touch(t->chunked, salt, tokens, n);
}

void kvti_tier_chunks_forget(kvt_tier *t, const char *hash) {
  if (t->chunked)
    kvti_chunked_forget(t->chunked, hash);
}

uint64_t kvti_tier_chunks_bytes(kvt_tier *t) {
  return t->chunked ? kvti_chunked_disk_bytes(t->chunked) : 0;
}

int kvti_tier_chunks_evict_older(kvt_tier *t, double accessed_at) {
  if (!t->chunked)
    return 0;
  kvti_chain_rec leaf;
  kvti_chains *ch = kvti_chunkstore_chains(kvti_chunked_store(t->chunked));
  if (!kvti_chains_lru_leaf(ch, &leaf) ||
      (accessed_at >= 0 && leaf.accessed_at > accessed_at))
    return 0;
  drop_chunk_locked(t, leaf.key, KVTI_RM_EVICT);
  KVTI_STAT_ADD(&t->stats, evictions, 1);
  return 1;
}
