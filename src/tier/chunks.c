/*
 * chunks.c - the tier's use of the chunked native store (chunks.h): opens it
 * when chunk_tokens is set, routes the writer's put and the readers' get
 * through it, answers chunk-aligned prefixes of pure-KV chains, touches
 * chains, drops an entry's chain record with the entry and measures the chunk
 * files. Reads and what a failed read leaves behind are chunk_reads.c's; the
 * eviction of leaf chunks for capacity is maint.c's. Locks: as the backend
 * calls it replaces (mut_mu for changes); chunk files are immutable, so reads
 * of shared chunks take no common lock.
 */
#include "tier/chunks.h"

#include "base/error.h"
#include "base/hash.h"
#include "base/io.h"
#include "format/chunk.h"
#include "index/chain_walk.h"
#include "index/index.h"
#include "store/chunked.h"
#include "store/local.h"
#include "tier/chunk_tools.h"
#include "tier/ramtier.h"

#include <string.h>

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
  if (rc == 0) {
    kvti_backend_local_set_chunks(t->be, kvti_chunked_chunks(t->chunked));
    kvti_tier_chunks_load_damaged(t);
  }
  return rc;
}

int kvti_tier_chunks_rebuild(kvt_tier *t) {
  if (!t->chunked || t->readonly)
    return 0;
  t->chunks_rescanned = 1;
  size_t n = 0, skipped = 0;
  int rc =
      kvti_chunkstore_rebuild(kvti_chunked_store(t->chunked), &n, &skipped);
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
  if (t->chunked && t->be)
    kvti_backend_local_set_chunks(t->be, NULL);
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

int kvti_tier_chunks_batch_new(kvt_tier *t, kvti_chunkstore_batch **b,
                               struct kvti_syncset *set) {
  *b = NULL;
  if (!t->chunked)
    return 0;
  return kvti_chunkstore_batch_new(b, kvti_chunked_store(t->chunked), set);
}

int kvti_tier_chunks_prepare_in(kvt_tier *t, kvti_chunked_prep *p,
                                const kvti_snapshot *s,
                                kvti_chunkstore_batch *b) {
  int rc = kvti_chunked_prepare_in(t->chunked, p, s, b);
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
  info->created_at = info->accessed_at = kvti_tier_recency_now(t);
  return 0;
}

uint64_t kvti_tier_chunks_stored(kvt_tier *t, const int32_t *tokens, size_t n,
                                 const kvti_salt *salt) {
  uint64_t m = 0, mem = 0;
  if (!t->chunked || kvti_chunked_lookup_prefix(t->chunked, salt, tokens, n, &m,
                                                &mem, NULL) != 0) {
    kvt_clear_error(); /* counted as nothing stored: the larger bound */
    return 0;
  }
  return m;
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
