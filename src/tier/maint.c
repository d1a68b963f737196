/*
 * maint.c - changes the tier makes to stored entries on its own: removal (row
 * first, then files, under the entry's exclusive stripe), capacity by LRU over
 * bytes on disk and entry count, retention since written, quarantine of a
 * corrupt entry and dropping the row of an entry whose files vanished (both
 * only if the index still holds the version the reader saw), and the
 * eviction of leaf chunks with the entries over them (which is removal: the
 * two recurse into each other, so they live together). Every function
 * here runs with mut_mu held (or takes it) - see tier.h.
 */
#include "tier/admission.h"
#include "tier/ramtier.h"
#include "tier/tier.h"
#include "tier/chunks.h"
#include "base/error.h"
#include "base/hash.h"
#include "base/io.h"
#include "index/chain_walk.h"
#include "index/index.h"
#include "store/chunked.h"

/* ------------------------------------------------------------------------ */
/* Removal, capacity, retention, quarantine                                 */
/* ------------------------------------------------------------------------ */

int kvti_tier_remove_locked(kvt_tier *t, const char *hash, int why) {
  kvt_entry_info info;
  kvti_stripe_wrlock(&t->stripes, hash);
  int rc = kvti_index_find_hash(&info, t->idx, hash);
  if (rc == 0)
    rc = kvti_index_remove_hash(t->idx, hash); /* row first: no new lookup */
  if (rc == KVT_ENOSPC || rc == KVT_EIO) {
    /* A full disk: the commit of the removal needs space the cache can only
     * get by deleting files. The entry leaves the in-memory index (nothing
     * serves or counts it), its files go, then the row is retried; should
     * that still fail, the next open's reconcile drops the row whose files
     * are gone. Removal, eviction and gc never wedge on ENOSPC. */
    int cause = rc;
    kvti_index_forget_hash(t->idx, hash);
    kvti_ram_invalidate(t, hash);
    int r = t->be->ops->remove(t->be, hash);
    kvti_tier_chunks_forget(t, hash); /* after the files: chunks.h */
    if (kvti_index_remove_hash(t->idx, hash) != 0)
      kvti_log(t, KVT_LOG_WARN,
               "kvtier: index row of %.16s not removed (%s); files %s, the "
               "row goes at the next open",
               hash, kvt_strerror(cause), r == 0 ? "deleted" : "not deleted");
    kvt_clear_error();
    rc = 0;
  } else if (rc == 0) {
    kvti_ram_invalidate(t, hash);
    int r = t->be->ops->remove(t->be, hash);
    kvti_tier_chunks_forget(t, hash); /* after the files: chunks.h */
    if (r != 0)
      kvti_log(t, KVT_LOG_WARN,
               "kvtier: removing files of %.16s failed (%s); reconcile will "
               "clean them",
               hash, kvt_last_error());
  }
  kvti_stripe_unlock(&t->stripes, hash);
  if (rc == 0) {
    if (why == KVTI_RM_EVICT)
      KVTI_STAT_ADD(&t->stats, evictions, 1);
    else if (why == KVTI_RM_EXPIRE)
      KVTI_STAT_ADD(&t->stats, expirations, 1);
    kvti_log(t, KVT_LOG_DEBUG, "kvtier: %s %.16s (%llu tokens, %llu bytes)",
             why == KVTI_RM_EVICT    ? "evicted"
             : why == KVTI_RM_EXPIRE ? "expired"
                                     : "removed",
             hash, (unsigned long long)info.num_tokens,
             (unsigned long long)info.disk_bytes);
  }
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

/* How far past the LRU leaf eviction looks for a cheaper one: the oldest
 * half of the leaves' time span. Wider lets a valued class outlive recent
 * chunks of a worthless one; narrower is closer to plain LRU. */
#define VALUE_WINDOW 0.5

static int chunks_evict_older(kvt_tier *t, double accessed_at) {
  if (!t->chunked)
    return 0;
  kvti_chain_rec leaf;
  kvti_chains *ch = kvti_chunkstore_chains(kvti_chunked_store(t->chunked));
  int found;
  double lru_at = 0;
  if (t->admit) { /* by value: what the admission record has learnt */
    double v[KVTI_LEN_CLASSES + 1];
    kvti_admit_values(t->admit, v);
    found = kvti_chains_value_leaf(ch, v, VALUE_WINDOW, &leaf, &lru_at);
  } else {
    found = kvti_chains_lru_leaf(ch, &leaf);
    lru_at = leaf.accessed_at;
  }
  /* Chunks or entries: the older of the LRU leaf and the LRU entry says
   * which kind goes; the value picks the leaf. */
  if (!found || (accessed_at >= 0 && lru_at > accessed_at))
    return 0;
  drop_chunk_locked(t, leaf.key, KVTI_RM_EVICT);
  KVTI_STAT_ADD(&t->stats, evictions, 1);
  return 1;
}

void kvti_tier_enforce_locked(kvt_tier *t, int64_t max_entries,
                              uint64_t max_bytes, double cutoff,
                              uint64_t *removed, uint64_t *removed_bytes) {
  kvt_entry_info v;
  /* Retention first: expired entries go before any live one is evicted. */
  if (cutoff > 0) {
    while (kvti_index_oldest_before(&v, t->idx, cutoff) == 0) {
      if (kvti_tier_remove_locked(t, v.token_hash, KVTI_RM_EXPIRE) != 0)
        break;
      if (removed)
        (*removed)++;
      if (removed_bytes)
        *removed_bytes += v.disk_bytes;
    }
  }
  for (;;) {
    uint64_t n = 0, bytes = 0;
    kvti_index_totals(t->idx, &n, &bytes, NULL);
    bytes += kvti_tier_chunks_bytes(t); /* each chunk counted once */
    if (n <= (uint64_t)max_entries && bytes <= max_bytes)
      break;
    int have = kvti_index_lru_victim(&v, t->idx) == 0;
    /* Over bytes: a leaf chunk older than the LRU entry goes first (chunks.h;
     * the entries over it go with it). */
    if (bytes > max_bytes && chunks_evict_older(t, have ? v.accessed_at : -1.0))
      continue;
    if (!have)
      break;
    if (kvti_tier_remove_locked(t, v.token_hash, KVTI_RM_EVICT) != 0)
      break; /* never spin on an entry that cannot be removed */
    if (removed)
      (*removed)++;
    if (removed_bytes)
      *removed_bytes += v.disk_bytes;
  }
}

/* Caller holds mut_mu and the stripe exclusively. True when the index still
 * holds the version a reader saw: created_at >= 0 is the row's created_at at
 * read time (a replacement written since has another and is left alone);
 * created_at < 0 means the reader saw no row, and it must still have none. */
static int same_version(kvt_tier *t, const char *hash, double created_at,
                        int *stored) {
  kvt_entry_info cur;
  *stored = kvti_index_find_hash(&cur, t->idx, hash) == 0;
  if (created_at < 0)
    return !*stored;
  return *stored && cur.created_at == created_at;
}

void kvti_tier_quarantine(kvt_tier *t, const char *hash, double created_at) {
  if (t->readonly)
    return;
  kvti_error_state es;
  kvti_error_state_capture(&es, KVT_ECORRUPT);
  pthread_mutex_lock(&t->mut_mu);
  kvti_stripe_wrlock(&t->stripes, hash);
  int stored = 0;
  if (same_version(t, hash, created_at, &stored)) {
    /* Row first: no new lookup. A row that cannot be removed now (a full
     * disk) at least leaves the in-memory index; reconcile drops it. */
    if (stored && kvti_index_remove_hash(t->idx, hash) != 0)
      kvti_index_forget_hash(t->idx, hash);
    kvti_ram_invalidate(t, hash);
    int r = t->be->ops->quarantine(t->be, hash, t->opts.quarantine_max);
    kvti_tier_chunks_forget(t, hash);
    KVTI_STAT_ADD(&t->stats, quarantined, 1);
    if (r != 0)
      kvti_log(t, KVT_LOG_WARN, "kvtier: quarantine of %.16s: %s", hash,
               kvt_last_error());
    else
      kvti_log(t, KVT_LOG_WARN, "kvtier: quarantined corrupt entry %s (%s)",
               hash, es.msg);
  }
  kvti_stripe_unlock(&t->stripes, hash);
  pthread_mutex_unlock(&t->mut_mu);
  kvti_error_state_restore(&es);
}

void kvti_tier_drop_missing(kvt_tier *t, const char *hash, double created_at) {
  if (t->readonly)
    return;
  kvti_error_state es;
  kvti_error_state_capture(&es, KVT_ENOTFOUND);
  pthread_mutex_lock(&t->mut_mu);
  kvti_stripe_wrlock(&t->stripes, hash);
  int stored = 0;
  if (created_at >= 0 && same_version(t, hash, created_at, &stored) &&
      t->be->ops->exists(t->be, hash) == 0) {
    if (kvti_index_remove_hash(t->idx, hash) != 0)
      kvti_index_forget_hash(t->idx, hash); /* reconcile drops the row */
    kvti_ram_invalidate(t, hash);
    t->be->ops->remove(t->be, hash);
    kvti_tier_chunks_forget(t, hash);
    KVTI_STAT_ADD(&t->stats, reconciled, 1);
    kvti_log(t, KVT_LOG_WARN, "kvtier: entry %.16s had no files; row dropped",
             hash);
  }
  kvti_stripe_unlock(&t->stripes, hash);
  pthread_mutex_unlock(&t->mut_mu);
  kvti_error_state_restore(&es);
}
