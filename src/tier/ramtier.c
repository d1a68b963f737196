/*
 * ramtier.c - the tier's use of its host RAM cache (tier/hostcache.h): the
 * cache's life with the tier, the promote hit path (take the cached layers,
 * verify them against the entry's files like a disk read, hand them over or
 * copy them into the caller's buffers), registering entries read from disk so
 * their buffers come back when freed, admitting written copy-mode snapshots,
 * invalidation, the public bound/trim calls and the stats gauges. The hooks
 * in promote.c, writer.c, tier.c and chunks.c are one call each.
 *
 * With the chunked native store (chunk_tokens) a record holds the assembled
 * entry - chain rows and tail joined, as a read returns it - or a pure chain's
 * prefix (named by the hash of its tokens, as lookup_prefix reports it), and is
 * tagged with the chain's last chunk. A hit is verified against the chunk
 * files (store/chunks_verify.h: header, chain row, tokens, every block over
 * the cached rows) and, for an entry, against its tail's files
 * (kvti_entry_verify_mem over the rows past the chain): the same checks as
 * the disk read it replaces. An entry stored as its chain record alone has
 * no tail: its record (tokens, layer count, rows) is checked instead and the
 * chain is all of its rows.
 */
#include "tier/ramtier.h"
#include "base/error.h"
#include "base/hash.h"
#include "base/io.h"
#include "format/entry.h"
#include "format/layer.h"
#include "tier/hostcache.h"
#include "tier/remote.h"
#include "index/chain_walk.h"
#include "store/chunked.h"
#include "store/chunks_verify.h"
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

void kvti_ram_invalidate_chunks(kvt_tier *t, const kvti_chain_rec *recs,
                                size_t n) {
  if (t->hc && n)
    kvti_hc_invalidate_chains(t->hc, recs[0].key, sizeof *recs, n);
}

/* ---- chains of the chunked native store --------------------------------- */

/* The chain cached rows of hash come from: a chained entry's (its record's
 * last chunk, walked back through the chain table) or, prefix = 1, the pure
 * chain of tokens[0, n) in this tier's namespace (the one a disk read of the
 * prefix would use). recs NULL and m 0 (and 0 returned) for an entry stored
 * whole. */
typedef struct ram_chain {
  kvti_chain_rec *recs;
  size_t m;
  uint64_t bytes; /* chunk file bytes */
  /* An entry stored as its chain record (store/chunked_rec.h): it has no
   * tail files, so the record (its tokens, layer count, rows) stands where a
   * tail's manifest and tokens.bin would be checked. */
  int is_record;
  uint64_t rec_rows;    /* total_rows: every layer holds exactly these */
  uint32_t rec_layers;  /* num_layers */
  int rec_tokens_match; /* the record's tokens are the caller's */
} ram_chain;

/* Rows the chain holds (every chunk has the chain's chunk_tokens rows). */
static uint64_t ch_rows(const ram_chain *ch) {
  return ch->m ? (uint64_t)ch->m * ch->recs[0].n_tokens : 0;
}

static int chain_of(kvt_tier *t, const char *hash, const int32_t *tokens,
                    size_t n, int prefix, const kvti_salt *salt,
                    ram_chain *out) {
  memset(out, 0, sizeof *out);
  if (!t->chunked)
    return prefix ? KVT_ERR(KVT_ENOTFOUND, "no chunked store") : 0;
  kvti_chunkstore *cs = kvti_chunked_store(t->chunked);
  int rc;
  if (prefix) {
    /* The callers' hash is the name of tokens[0, n) under the salt (ram_read's
     * callers guarantee it). */
    rc = kvti_chunked_prefix_chain(t->chunked, salt, tokens, n, &out->recs,
                                   &out->m);
  } else {
    uint8_t hb[32];
    kvti_chained_entry ce;
    if (kvti_unhex32(hb, hash) != 0)
      return 0; /* not a name the chunked store gives: stored whole */
    /* The entry's own chain record rules over the chained-entry row, as in
     * the disk read (kvti_chunked_get). */
    kvti_chainrec rec;
    rc = kvti_chunked_record(t->chunked, hash, &rec);
    if (rc == 0) {
      memset(&ce, 0, sizeof ce);
      memcpy(ce.hash, hb, 32);
      ce.chunks = rec.chunks;
      ce.chunk_tokens = rec.chunk_tokens;
      memcpy(ce.last_key, rec.last_key, 32);
      ce.layout_hash = rec.layout_hash;
      ce.total_rows = rec.total_rows;
      out->is_record = 1;
      out->rec_rows = rec.total_rows;
      out->rec_layers = rec.num_layers;
      out->rec_tokens_match =
          tokens && rec.n_tokens == n &&
          (n == 0 || memcmp(rec.tokens, tokens, n * sizeof *tokens) == 0);
      kvti_chainrec_free(&rec);
    } else if (rc != KVT_ENOTFOUND) {
      return rc;
    } else {
      kvt_clear_error();
      if (!kvti_chains_entry_get(kvti_chunkstore_chains(cs), hb, &ce))
        return 0; /* stored whole */
    }
    if (ce.chunks == 0 || (uint64_t)ce.chunks * ce.chunk_tokens > n)
      return KVT_ERR(KVT_ECORRUPT, "chained entry %.16s: bad record", hash);
    /* The chain the record names, walked up from its last chunk (as the
     * chunked read does: no namespace or salt needed). */
    out->recs = kvti_malloc((size_t)ce.chunks * sizeof *out->recs);
    rc = out->recs ? kvti_chains_path(kvti_chunkstore_chains(cs), ce.last_key,
                                      (size_t)ce.chunks, out->recs)
                   : KVT_ERR_NOMEM();
    out->m = (size_t)ce.chunks;
    if (rc == 0 && out->recs[0].layout_hash != ce.layout_hash)
      rc = KVT_ERR(KVT_ENOTFOUND, "chained entry %.16s: chain replaced", hash);
  }
  if (rc) {
    kvti_free(out->recs);
    memset(out, 0, sizeof *out);
    return rc;
  }
  if (out->is_record && (!out->recs[0].pure || ch_rows(out) != out->rec_rows)) {
    kvti_free(out->recs);
    memset(out, 0, sizeof *out);
    return KVT_ERR(KVT_ENOTFOUND, "chain record %.16s: chain replaced", hash);
  }
  for (size_t i = 0; i < out->m; i++)
    out->bytes += out->recs[i].disk_bytes;
  return 0;
}

/* Checks a cached copy as the disk read it replaces would check the bytes it
 * reads (see the file comment); sets the layers' attributes as that read
 * does. */
static int verify(kvt_tier *t, const char *hash, kvti_hc_item *it,
                  const kvti_read_opts *ro, int prefix) {
  ram_chain ch;
  int rc = chain_of(t, hash, ro->tokens, ro->n_tokens, prefix, &ro->salt, &ch);
  if (rc)
    return rc;
  if (!ch.recs) /* an entry stored whole */
    return kvti_backend_local_verify_mem(t->be, hash, it->layers, it->n_layers,
                                         ro);
  if (!it->has_chain || memcmp(it->chain, ch.recs[ch.m - 1].key, 32) != 0) {
    /* Not the chain these rows were cached from (another namespace's chain
     * over the same tokens, or a chain rebuilt since): never served, even if
     * the bytes matched. */
    kvti_free(ch.recs);
    return KVT_ERR(KVT_ENOTFOUND, "%.16s: cached from another chain", hash);
  }
  uint64_t *row0 = kvti_calloc(it->n_layers ? it->n_layers : 1, sizeof *row0);
  uint64_t rows = ch_rows(&ch);
  if (ch.is_record && !ch.rec_tokens_match)
    rc = KVT_ERR(KVT_ENOTFOUND, "chain record %.16s: other tokens", hash);
  else if (ch.is_record && ch.rec_layers != it->n_layers)
    rc = KVT_ERR(KVT_ECORRUPT,
                 "chain record %.16s: %u layers, the cached copy %u", hash,
                 ch.rec_layers, it->n_layers);
  else
    rc = row0 ? kvti_chunkstore_verify_mem(kvti_chunked_store(t->chunked),
                                           ch.recs, ch.m, ro->tokens,
                                           it->layers, it->n_layers, ro->cancel,
                                           ro->read_threads, row0)
              : KVT_ERR_NOMEM();
  if (rc == 0 && !prefix && !ch.is_record) {
    /* The tail's files hold the rows past the chain and every other layer. */
    kvti_read_opts vo = *ro;
    vo.mem_row0 = row0;
    vo.tail_ok = 1; /* completed by the chain just checked */
    rc = kvti_backend_local_verify_mem(t->be, hash, it->layers, it->n_layers,
                                       &vo);
  } else if (rc == 0) {
    /* A pure prefix, or an entry that is its chain record: the chain is all
     * of it (no tail files to check); attributes as kvti_chunk_prefix_entry
     * sets them, which is what a record's read returns. */
    for (uint32_t i = 0; rc == 0 && i < it->n_layers; i++) {
      kvt_layer *l = &it->layers[i];
      if (row0[i] != rows || l->kind == KVT_LAYER_ROTATING_KV)
        rc = KVT_ERR(KVT_ECORRUPT, "prefix %.16s: layer %u not in its chain",
                     hash, i);
      for (uint32_t j = 0; rc == 0 && j < l->num_tensors; j++)
        if ((uint64_t)l->tensors[j].shape[l->tensors[j].ndim - 2] != rows)
          rc = KVT_ERR(KVT_ECORRUPT, "prefix %.16s: layer %u has extra rows",
                       hash, i);
      if (rc)
        break;
      l->offset = (int64_t)rows;
      l->max_size = l->keep = l->step = l->idx = KVT_ABSENT;
      kvti_free(l->orig_dtypes);
      l->orig_dtypes = NULL;
    }
  }
  kvti_free(row0);
  kvti_free(ch.recs);
  return rc;
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
  /* Caller buffers without a free_buf stay the caller's. */
  e->free_buf = ro->free_buf ? ro->free_buf : kvti_keep_caller_buf;
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

static int ram_read(kvt_entry **out, kvt_tier *t, const char *hash,
                    const kvti_read_opts *ro, int prefix) {
  if (!t->hc || ro->keep_tokens || ro->verify_only || !ro->tokens)
    return KVT_ENOTFOUND;
  /* hash is the name of ro->tokens under the call's salt: every caller has
   * it from the index row of these tokens or has checked a read_entry
   * caller's file_path against them (promote.c), so it is not recomputed
   * here (an unsalted token hash would never match a salted name). */
  kvti_hc_item it;
  uint64_t id = 0;
  if (!kvti_hc_take(t->hc, hash, &it, &id))
    return KVT_ENOTFOUND;
  kvt_entry *e = NULL;
  /* Same checks as a disk read - manifest, tokens against the request, each
   * layer file's header against the cached tensors, every block checksum
   * over the cached bytes - so a stale, altered or damaged copy is never
   * served; it is dropped and the disk read that follows decides. */
  int rc = verify(t, hash, &it, ro, prefix);
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

int kvti_ram_promote(kvt_entry **out, kvt_tier *t, const char *hash,
                     const kvti_read_opts *ro) {
  return ram_read(out, t, hash, ro, 0);
}

int kvti_ram_promote_prefix(kvt_entry **out, kvt_tier *t, const char *hash,
                            const kvti_read_opts *ro) {
  return t->chunked ? ram_read(out, t, hash, ro, 1) : KVT_ENOTFOUND;
}

/* The chain tag of what a read of e returned; 0 when untagged (a whole
 * entry, or its chain is gone). */
static int tag_of(kvt_tier *t, const kvt_entry *e, int prefix,
                  const kvti_salt *salt, uint8_t tag[32]) {
  ram_chain ch;
  if (!t->chunked ||
      chain_of(t, e->hash, e->tokens, e->n_tokens, prefix, salt, &ch) != 0 ||
      !ch.recs) {
    kvt_clear_error();
    return 0;
  }
  memcpy(tag, ch.recs[ch.m - 1].key, 32);
  kvti_free(ch.recs);
  return 1;
}

static void after_read(kvt_tier *t, kvt_entry *e, const kvti_read_opts *ro,
                       int prefix) {
  uint64_t id;
  if (e)
    e->from = KVTI_FROM_DISK;
  if (!t->hc || !e || ro->keep_tokens || ro->alloc || e->free_buf || e->recycle)
    return;
  uint8_t tag[32];
  int tagged = tag_of(t, e, prefix, &ro->salt, tag);
  if (prefix && !tagged)
    return; /* its chain went meanwhile: nothing to keep */
  if (kvti_hc_lend_chain(t->hc, e->hash, tagged ? tag : NULL, &id))
    hook(t, e, id);
}

void kvti_ram_after_disk(kvt_tier *t, kvt_entry *e, const kvti_read_opts *ro) {
  after_read(t, e, ro, 0);
}

void kvti_ram_after_prefix(kvt_tier *t, kvt_entry *e,
                           const kvti_read_opts *ro) {
  after_read(t, e, ro, 1);
}

void kvti_ram_spilled(kvt_tier *t, kvti_snapshot *s, uint64_t disk_bytes) {
  /* Native mode only: there the files hold the snapshot's tensors as they
   * are (compat mode converts them); not when the remote upload queue still
   * needs the snapshot after this. */
  if (!t->hc || t->opts.storage_mode != KVT_STORAGE_NATIVE ||
      kvti_remote_enabled(t))
    return;
  kvti_hc_item it;
  memset(&it, 0, sizeof it);
  const char *hash = kvti_snapshot_hash(s);
  size_t n = 0;
  const int32_t *tokens = kvti_snapshot_tokens(s, &n);
  ram_chain ch;
  if (chain_of(t, hash, tokens, n, 0, NULL, &ch) != 0) {
    kvt_clear_error();
    kvti_hc_invalidate(t->hc, hash);
    return; /* its chain is not whole (cannot happen after a put) */
  }
  if (ch.recs) {
    it.has_chain = 1;
    memcpy(it.chain, ch.recs[ch.m - 1].key, 32);
    kvti_free(ch.recs);
  }
  if (!kvti_snapshot_take_layers(s, &it.layers, &it.n_layers)) {
    kvti_hc_invalidate(t->hc, hash); /* e.g. a prefix record of these tokens */
    return; /* zero-copy spill: not cached (see hostcache.h) */
  }
  it.memory_bytes = kvti_snapshot_memory_bytes(s);
  it.disk_bytes = disk_bytes + ch.bytes; /* tail + every chunk of its chain */
  it.storage_mode = KVT_STORAGE_NATIVE;
  kvti_hc_put(t->hc, hash, &it);
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
