/*
 * ramtier.c - the tier's use of its host RAM cache (tier/hostcache.h): the
 * cache's life with the tier, the promote hit path (take the cached layers,
 * verify them against the entry's files like a disk read, hand them over or
 * copy them into the caller's buffers), registering entries read from disk so
 * their buffers come back when freed, admitting written copy-mode snapshots,
 * invalidation, the public bound/trim calls and the stats gauges. The hooks
 * in promote.c, writer.c and tier.c are one call each.
 */
#include "tier/ramtier.h"
#include "base/error.h"
#include "base/io.h"
#include "format/entry.h"
#include "format/layer.h"
#include "tier/hostcache.h"
#include "index/index.h"
#include "store/chunked.h"
#include "tier/remote.h"
#include "store/local.h"
#include "tier/tier.h"

#include <stdlib.h>
#include <string.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

static uint64_t bound_of(uint64_t opt) {
  return opt == KVT_HOST_CACHE_AUTO ? kvti_hc_default_bytes() : opt;
}

/* The cache holds whole entries verified against their own manifest. A
 * chained entry's layers live mostly in chunk files its manifest does not
 * describe, and a chain prefix no spill ended at has no manifest at all: in a
 * chunked tier only whole (unchained) entries are cached (docs/DESIGN.md). */
static int cacheable(kvt_tier *t, const char *hash) {
  if (!t->chunked)
    return 1;
  kvt_entry_info info;
  return !kvti_chunked_is_chained(t->chunked, hash) &&
         kvti_index_find_hash(&info, t->idx, hash) == 0;
}

int kvti_ram_open(kvt_tier *t) {
  return kvti_hc_create(&t->hc, bound_of(t->opts.host_cache_bytes),
                        kvti_bufpool_default());
}

void kvti_ram_close(kvt_tier *t) {
  if (t->hc)
    kvti_hc_close(t->hc);
}

void kvti_ram_free(kvt_tier *t) {
  kvti_ram_close(t);
  kvti_hc_release(t->hc);
  t->hc = NULL;
}

void kvti_ram_invalidate(kvt_tier *t, const char *hash) {
  if (t->hc)
    kvti_hc_invalidate(t->hc, hash);
}

/* kvt_entry_free's hook for an entry whose buffers the cache may take back. */
static int recycle(kvt_entry *e) {
  kvti_hcache *c = e->recycle_ctx;
  kvti_hc_item it = {e->layers,       e->num_layers, 0,
                     e->memory_bytes, e->disk_bytes, e->storage_mode};
  kvti_hc_give_back(c, e->hash, e->recycle_id, &it);
  kvti_hc_release(c);
  kvti_free(e->tokens);
  kvti_free(e);
  return 1;
}

static void hook(kvt_tier *t, kvt_entry *e, uint64_t id) {
  kvti_hc_retain(t->hc);
  e->recycle = recycle;
  e->recycle_ctx = t->hc;
  e->recycle_id = id;
}

/* Copies a verified cached item into the caller's buffers (alloc). */
static int copy_out(kvt_entry *e, const kvti_hc_item *it,
                    const kvti_read_opts *ro) {
  e->layers = kvti_calloc(it->n_layers ? it->n_layers : 1, sizeof(kvt_layer));
  if (!e->layers)
    return KVT_ERR_NOMEM();
  e->free_buf = ro->free_buf;
  e->alloc_ctx = ro->alloc_ctx;
  for (uint32_t i = 0; i < it->n_layers; i++) {
    const kvt_layer *s = &it->layers[i];
    kvt_layer *d = &e->layers[i];
    *d = *s;
    d->tensors = NULL;
    d->orig_dtypes = NULL;
    d->num_tensors = 0;
    e->num_layers = i + 1;
    d->tensors =
        kvti_calloc(s->num_tensors ? s->num_tensors : 1, sizeof(kvt_tensor));
    if (!d->tensors)
      return KVT_ERR_NOMEM();
    if (s->orig_dtypes) {
      d->orig_dtypes = kvti_malloc(s->num_tensors * sizeof(int32_t));
      if (!d->orig_dtypes)
        return KVT_ERR_NOMEM();
      memcpy(d->orig_dtypes, s->orig_dtypes, s->num_tensors * sizeof(int32_t));
    }
    for (uint32_t j = 0; j < s->num_tensors; j++) {
      d->tensors[j] = s->tensors[j];
      d->tensors[j].data = NULL;
      d->num_tensors = j + 1;
      if (!s->tensors[j].nbytes)
        continue;
      void *b = ro->alloc(ro->alloc_ctx, i, j, &s->tensors[j]);
      if (!b)
        return KVT_ERR(KVT_ENOMEM,
                       "alloc callback returned NULL for layer %u tensor %u", i,
                       j);
      memcpy(b, s->tensors[j].data, (size_t)s->tensors[j].nbytes);
      d->tensors[j].data = b;
    }
  }
  return 0;
}

int kvti_ram_promote(kvt_entry **out, kvt_tier *t, const char *hash,
                     const kvti_read_opts *ro) {
  if (!t->hc || ro->keep_tokens || ro->verify_only || !ro->tokens)
    return KVT_ENOTFOUND;
  kvti_hc_item it;
  uint64_t id = 0;
  if (!kvti_hc_take(t->hc, hash, &it, &id))
    return KVT_ENOTFOUND;
  kvt_entry *e = NULL;
  /* Same checks as a disk read - manifest, tokens against the request, each
   * layer file's header against the cached tensors, every block checksum
   * over the cached bytes - so a stale, altered or damaged copy is never
   * served; it is dropped and the disk read that follows decides. */
  int rc =
      kvti_backend_local_verify_mem(t->be, hash, it.layers, it.n_layers, ro);
  if (rc != 0) {
    kvti_log(t, KVT_LOG_INFO,
             "kvtier: RAM copy of %.16s not served (%s); reading the disk",
             hash, kvt_last_error());
    kvti_hc_forget(t->hc, hash, id, 1);
    kvti_hc_item_free(&it);
    kvt_clear_error();
    return KVT_ENOTFOUND;
  }
  e = kvti_entry_new();
  if (e)
    e->tokens =
        kvti_malloc((ro->n_tokens ? ro->n_tokens : 1) * sizeof(int32_t));
  if (!e || !e->tokens) {
    rc = KVT_ERR_NOMEM();
    goto undo;
  }
  if (ro->n_tokens)
    memcpy(e->tokens, ro->tokens, ro->n_tokens * sizeof(int32_t));
  e->n_tokens = ro->n_tokens;
  memcpy(e->hash, hash, KVT_HASH_HEX_LEN + 1);
  e->memory_bytes = it.memory_bytes;
  e->disk_bytes = it.disk_bytes;
  e->storage_mode = it.storage_mode;
  e->from = KVTI_FROM_RAM;
  if (ro->alloc) {
    rc = copy_out(e, &it, ro);
    if (rc != 0)
      goto undo;
    kvti_hc_give_back(t->hc, hash, id, &it); /* stays resident */
  } else {
    e->layers = it.layers;
    e->num_layers = it.n_layers;
    hook(t, e, id);
  }
  if (ro->on_layer)
    for (uint32_t i = 0; i < e->num_layers; i++)
      ro->on_layer(ro->layer_ctx, i, &e->layers[i]);
  *out = e;
  return 0;
undo:
  kvt_entry_free(e);
  kvti_hc_give_back(t->hc, hash, id, &it);
  return rc;
}

void kvti_ram_after_disk(kvt_tier *t, kvt_entry *e, const kvti_read_opts *ro) {
  uint64_t id;
  if (e)
    e->from = KVTI_FROM_DISK;
  if (!t->hc || !e || ro->keep_tokens || ro->alloc || e->free_buf ||
      e->recycle || !cacheable(t, e->hash))
    return;
  if (kvti_hc_lend(t->hc, e->hash, &id))
    hook(t, e, id);
}

void kvti_ram_spilled(kvt_tier *t, kvti_snapshot *s, uint64_t disk_bytes) {
  /* Native mode only: there the files hold the snapshot's tensors as they
   * are (compat mode converts them); not when the remote upload queue still
   * needs the snapshot after this. */
  if (!t->hc || t->opts.storage_mode != KVT_STORAGE_NATIVE ||
      kvti_remote_enabled(t) || !cacheable(t, kvti_snapshot_hash(s)))
    return;
  kvti_hc_item it;
  memset(&it, 0, sizeof it);
  if (!kvti_snapshot_take_layers(s, &it.layers, &it.n_layers))
    return; /* zero-copy spill: not cached (see hostcache.h) */
  it.memory_bytes = kvti_snapshot_memory_bytes(s);
  it.disk_bytes = disk_bytes;
  it.storage_mode = KVT_STORAGE_NATIVE;
  kvti_hc_put(t->hc, kvti_snapshot_hash(s), &it);
}

void kvti_ram_gauges(kvt_tier *t, kvt_stats *s) {
  if (!t->hc)
    return;
  kvti_hc_stats st;
  kvti_hc_get_stats(t->hc, &st);
  s->host_cache_bytes_used = st.used;
  s->host_cache_bytes_bound = st.bound;
  s->host_cache_entries = st.resident;
  s->host_cache_hits = st.hits;
  s->host_cache_misses = st.misses;
  s->host_cache_evictions = st.evictions;
  s->host_cache_verify_failures = st.verify_failures;
}

void kvti_ram_account(kvt_tier *t, const kvt_entry *e) {
  if (e->from == KVTI_FROM_RAM) {
    KVTI_STAT_ADD(&t->stats, promotes_from_ram, 1);
    KVTI_STAT_ADD(&t->stats, promote_ram_bytes, e->disk_bytes);
  } else if (e->from == KVTI_FROM_DISK) {
    KVTI_STAT_ADD(&t->stats, promotes_from_disk, 1);
    KVTI_STAT_ADD(&t->stats, promote_disk_bytes, e->disk_bytes);
  }
}

/* ---- public API --------------------------------------------------------- */

int kvt_tier_set_host_cache_bytes(kvt_tier *t, uint64_t bytes) {
  if (!t)
    return KVT_ERR(KVT_EINVAL, "tier is NULL");
  int rc = kvti_tier_enter(t);
  if (rc != 0)
    return rc;
  if (t->hc)
    kvti_hc_set_bound(t->hc, bound_of(bytes));
  kvti_tier_leave(t);
  return rc;
}

int kvt_tier_trim(kvt_tier *t, uint64_t target_bytes, uint64_t *freed) {
  if (!t)
    return KVT_ERR(KVT_EINVAL, "tier is NULL");
  int rc = kvti_tier_enter(t);
  if (rc != 0)
    return rc;
  uint64_t f = t->hc ? kvti_hc_trim(t->hc, target_bytes) : 0;
  kvti_bufpool *p = kvti_bufpool_default();
  if (p)
    kvti_bufpool_trim(p);
#if defined(__GLIBC__)
  malloc_trim(0); /* free heap pages back to the system (MADV_DONTNEED) */
#endif
  if (freed)
    *freed = f;
  kvti_tier_leave(t);
  return 0;
}
