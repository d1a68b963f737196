/*
 * ramtier.c - the tier's use of its host RAM cache (tier/hostcache.h): the
 * cache's life with the tier, the promote hit path (take the cached layers,
 * verify them against the entry's files like a disk read, hand them over or
 * copy them into the caller's buffers), registering entries read from disk so
 * their buffers come back when freed, admitting written copy-mode snapshots,
 * invalidation, the public bound/trim calls and the stats gauges. The hooks
 * in promote.c, writer.c, tier.c and chunks.c are one call each.
 *
 * With the chunked native store (chunk_tokens) RAM holds what the disk
 * holds: a chained entry as its tail (the rows past its chain and its other
 * layers, tagged with the chain's last chunk) plus its chain's chunks, one
 * record per chunk key shared by every entry and prefix through it. Spills
 * are cut into the tail and the chunks RAM lacks; freed disk reads are too,
 * by the cutter, once their chain shares a chunk with what RAM holds (until
 * then they stay whole records and are served zero copy, verified like a
 * whole entry, see the cutter below); a hit on a tail
 * assembles a fresh copy from the pinned chunks and tail (chunks RAM lacks
 * read from their files and kept) and that copy is verified against the
 * chunk files (store/chunkstore_verify.h: header, chain row, tokens, every
 * block over the copy's rows) and, for an entry, against its tail's files
 * (kvti_entry_verify_mem over the rows past the chain): the same checks as
 * the disk read it replaces, on the bytes served. An entry stored as its
 * chain record alone has no tail files: its record (tokens, layer count,
 * rows) is checked instead and the chain is all of its rows. A pure prefix
 * is its chunks alone.
 */
#include "tier/ramtier.h"
#include "base/error.h"
#include "base/hash.h"
#include "base/workq.h"
#include "base/io.h"
#include "format/dtype.h"
#include "format/entry.h"
#include "format/layer.h"
#include "tier/hostcache.h"
#include "tier/remote.h"
#include "index/chain_walk.h"
#include "store/chunked.h"
#include "store/local.h"
#include "tier/tier.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include "tier/ram_int.h"

static uint64_t bound_of(uint64_t opt) {
  return opt == KVT_HOST_CACHE_AUTO ? kvti_hc_default_bytes() : opt;
}

enum { JOB_ENTRY, JOB_PREFIX, JOB_WAKE };

int kvti_ram_open(kvt_tier *t) {
  uint64_t bound = bound_of(t->opts.host_cache_bytes);
  int rc = kvti_hc_create(&t->hc, bound, kvti_bufpool_default());
  if (rc == 0)
    rc = kvti_ram_bg_open(t, bound);
  return rc;
}

void kvti_ram_close(kvt_tier *t) {
  if (t->ram_bg)
    kvti_workq_stop(&t->ram_bg->q, 1);
  if (t->hc)
    kvti_hc_close(t->hc);
}

void kvti_ram_free(kvt_tier *t) {
  kvti_ram_close(t);
  kvti_ram_bg_release(t->ram_bg);
  t->ram_bg = NULL;
  kvti_hc_release(t->hc);
  t->hc = NULL;
}

int kvti_ram_drain(kvt_tier *t, const struct timespec *ts, int has) {
  if (!t->ram_bg)
    return 0;
  uint64_t pending = 0;
  int rc = kvti_workq_wait(&t->ram_bg->q, ts, has, &pending);
  if (rc == KVT_ETIMEDOUT)
    return KVT_ERR(KVT_ETIMEDOUT,
                   "flush: %llu freed entries still being cut for the RAM "
                   "tier",
                   (unsigned long long)pending);
  return 0; /* pending > 0 only once stopped: those were dropped */
}

/* A new entry served from RAM for the read ro of hash, with meta's figures
 * and no layers yet; NULL when out of memory (error set). */
static kvt_entry *ram_entry(const char *hash, const kvti_read_opts *ro,
                            const kvti_hc_item *meta) {
  kvt_entry *e = kvti_entry_new();
  if (e)
    e->tokens =
        kvti_malloc((ro->n_tokens ? ro->n_tokens : 1) * sizeof(int32_t));
  if (!e || !e->tokens) {
    kvt_entry_free(e);
    KVT_ERR_NOMEM();
    return NULL;
  }
  if (ro->n_tokens)
    memcpy(e->tokens, ro->tokens, ro->n_tokens * sizeof(int32_t));
  e->n_tokens = ro->n_tokens;
  memcpy(e->hash, hash, KVT_HASH_HEX_LEN + 1);
  e->memory_bytes = meta->memory_bytes;
  e->disk_bytes = meta->disk_bytes;
  e->storage_mode = meta->storage_mode;
  e->from = KVTI_FROM_RAM;
  return e;
}

/* The RAM read of a chained entry (its tail cached) or, prefix = 1, of a
 * pure prefix (some chunk of it cached): assembled from the cached chunks
 * and tail, the chunks RAM lacks read from their files (and kept), then
 * checked against the files exactly as a cached whole entry is (verify) -
 * the copy served is the one checked. *tried = 0 when nothing of it is
 * cached (the caller looks for a whole entry). */
static int ram_read_chained(kvt_entry **out, kvt_tier *t, const char *hash,
                            const kvti_read_opts *ro, int prefix, int *tried) {
  kvti_hc_ref *tref = NULL;
  const kvti_hc_item *tail = NULL;
  *tried = 0;
  if (!prefix && !kvti_hc_pin_tail(t->hc, hash, &tref, &tail))
    return KVT_ENOTFOUND;
  *tried = 1;
  uint64_t epoch = kvti_hc_epoch(t->hc);
  ram_chain ch;
  memset(&ch, 0, sizeof ch);
  int rc = kvti_ram_chain_of(t, hash, ro->tokens, ro->n_tokens, prefix,
                             &ro->salt, &ch);
  if (rc != 0 && prefix) { /* no such chain: a plain miss */
    kvti_hc_count(t->hc, 0, 0);
    kvt_clear_error();
    return KVT_ENOTFOUND;
  }
  if (rc == 0 && !ch.recs)
    rc = KVT_ERR(KVT_ENOTFOUND, "%.16s: stored whole now", hash);
  if (rc == 0 && tail &&
      (!tail->has_chain || memcmp(tail->chain, ch.recs[ch.m - 1].key, 32)))
    rc = KVT_ERR(KVT_ENOTFOUND, "%.16s: cached from another chain", hash);
  size_t m = ch.m;
  kvti_hc_ref **refs = NULL;
  kvti_hc_chunk **loaded = NULL;
  const kvti_hc_chunk **chs = NULL;
  kvt_layer *layers = NULL;
  uint32_t nl = 0;
  uint64_t abytes = 0;
  int failed_check = rc != 0; /* a stale tail counts as a failed check */
  if (rc == 0) {
    refs = kvti_calloc(m, sizeof *refs);
    loaded = kvti_calloc(m, sizeof *loaded);
    chs = kvti_calloc(m, sizeof *chs);
    if (!refs || !loaded || !chs)
      rc = KVT_ERR_NOMEM();
  }
  if (rc == 0 &&
      kvti_hc_pin_chunks(t->hc, ch.recs[0].key, sizeof *ch.recs, m, refs) ==
          0 &&
      prefix) {
    rc = KVT_ENOTFOUND; /* nothing of it in RAM: a plain miss */
    failed_check = 0;
    *tried = 2;
  }
  uint32_t C = m ? ch.recs[0].n_tokens : 0;
  for (size_t i = 0; rc == 0 && i < m; i++) {
    if (refs[i]) {
      chs[i] = kvti_hc_ref_chunk(refs[i]);
    } else if ((rc = kvti_ram_load_chunk(t, &ch.recs[i], ro->tokens + i * C,
                                         &loaded[i])) == 0) {
      chs[i] = loaded[i];
    }
    /* A chunk that cannot be read: the disk read that follows meets the
     * same fault and deals with it (quarantine, eviction). */
  }
  if (rc == 0 && ro->cancel && atomic_load(ro->cancel))
    rc = KVT_ERR(KVT_ECANCELED, "promote cancelled");
  if (rc == 0) {
    rc = kvti_ram_assemble(tail, chs, m, ro, &layers, &nl, &abytes);
    failed_check = rc != 0 && rc != KVT_ENOMEM;
  }
  kvti_hc_item it;
  memset(&it, 0, sizeof it);
  if (tail) {
    it.memory_bytes = tail->memory_bytes;
    it.disk_bytes = tail->disk_bytes;
    it.storage_mode = tail->storage_mode;
  } else {
    /* A chain prefix reports what a promote of it loads: its quantized
     * layers counted dense, as the chunk rows and the disk read do. */
    it.memory_bytes = rc == 0 ? kvti_layers_dense_bytes(layers, nl) : abytes;
    it.disk_bytes = ch.bytes;
    it.storage_mode = KVT_STORAGE_NATIVE;
  }
  if (refs)
    kvti_hc_unpin(t->hc, refs, m);
  if (tref)
    kvti_hc_unpin(t->hc, &tref, 1);
  tail = NULL; /* not to be touched once unpinned */
  if (rc == 0) {
    it.layers = layers;
    it.n_layers = nl;
    it.has_chain = 1;
    memcpy(it.chain, ch.recs[m - 1].key, 32);
    rc = kvti_ram_verify_with(t, hash, &it, ro, prefix, &ch);
    failed_check = rc != 0;
  }
  kvt_entry *e = NULL;
  if (rc == 0 && !(e = ram_entry(hash, ro, &it))) {
    rc = KVT_ENOMEM;
    failed_check = 0;
  }
  if (rc != 0) {
    if (failed_check) {
      kvti_log(t, KVT_LOG_INFO,
               "kvtier: RAM copy of %.16s not served (%s); reading the disk",
               hash, kvt_last_error());
      /* Which piece is bad is not known: all of them go. */
      kvti_hc_drop_chain(t->hc, prefix ? NULL : hash,
                         ch.recs ? ch.recs[0].key : NULL, sizeof *ch.recs,
                         ch.recs ? m : 0);
    }
    if (*tried == 1)
      kvti_hc_count(t->hc, 0, failed_check);
    if (*tried == 2)
      kvti_hc_count(t->hc, 0, 0);
    kvti_ram_free_built(layers, nl, ro);
    for (size_t i = 0; loaded && i < m; i++)
      kvti_hc_chunk_free(loaded[i]);
    kvt_entry_free(e);
    rc = rc == KVT_ENOMEM || rc == KVT_ECANCELED ? rc : KVT_ENOTFOUND;
    kvt_clear_error();
  } else {
    /* The chunks read from disk stay in RAM (unless one of the chain's
     * chunks went meanwhile). */
    kvti_hc_put_chunks(t->hc, loaded, m, epoch);
    kvti_hc_count(t->hc, 1, 0);
    e->layers = layers;
    e->num_layers = nl;
    if (ro->alloc) {
      /* Caller buffers without a free_buf stay the caller's. */
      e->free_buf = ro->free_buf ? ro->free_buf : kvti_keep_caller_buf;
      e->alloc_ctx = ro->alloc_ctx;
    }
    if (ro->on_layer)
      for (uint32_t i = 0; i < e->num_layers; i++)
        ro->on_layer(ro->layer_ctx, i, &e->layers[i]);
    *out = e;
  }
  kvti_free(refs);
  kvti_free(loaded);
  kvti_free(chs);
  kvti_free(ch.recs);
  return rc;
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
  kvti_hc_item it;
  uint64_t id = 0;
  /* hash is the name of ro->tokens under the call's salt: every caller has
   * it from the index row of these tokens or has checked a read_entry
   * caller's file_path against them (promote.c), so it is not recomputed
   * here (an unsalted token hash would never match a salted name). */
  for (int attempt = 0;; attempt++) {
    if (t->chunked) {
      int tried;
      /* A freed copy of it being cut into tail and chunks: they come at
       * memory speed (a miss would read the disk). */
      kvti_hc_wait_cut(t->hc, hash);
      int rc = ram_read_chained(out, t, hash, ro, prefix, &tried);
      if (tried || prefix)
        return rc;
    }
    if (kvti_hc_take(t->hc, hash, &it, &id))
      break;
    /* The cutter may have taken the whole record between the two looks:
     * its tail is then there (or coming), looked for once more. */
    if (!t->chunked || attempt > 0)
      return KVT_ENOTFOUND;
  }
  kvt_entry *e = NULL;
  /* Same checks as a disk read - manifest, tokens against the request, each
   * layer file's header against the cached tensors, every block checksum
   * over the cached bytes - so a stale, altered or damaged copy is never
   * served; it is dropped and the disk read that follows decides. */
  /* The chain too (when it has one): the entry served is hooked with it, so
   * that freeing it lets the cutter make its tail and chunks. */
  ram_chain ch;
  int rc = kvti_ram_chain_of(t, hash, ro->tokens, ro->n_tokens, prefix,
                             &ro->salt, &ch);
  if (rc == 0)
    rc = kvti_ram_verify_with(t, hash, &it, ro, prefix, &ch);
  if (rc != 0) {
    kvti_free(ch.recs);
    ch.recs = NULL;
    kvti_log(t, KVT_LOG_INFO,
             "kvtier: RAM copy of %.16s not served (%s); reading the disk",
             hash, kvt_last_error());
    kvti_hc_forget(t->hc, hash, id, 1);
    kvti_hc_item_free(&it);
    kvt_clear_error();
    return KVT_ENOTFOUND;
  }
  if (!(e = ram_entry(hash, ro, &it))) {
    rc = KVT_ENOMEM;
    goto undo;
  }
  if (ro->alloc) {
    rc = copy_out(e, &it, ro);
    if (rc != 0)
      goto undo;
    kvti_hc_give_back(t->hc, hash, id, &it); /* stays resident */
  } else {
    e->layers = it.layers;
    e->num_layers = it.n_layers;
    kvti_ram_hook(t, e, id, ch.recs, ch.m, 0);
  }
  kvti_free(ch.recs);
  if (ro->on_layer)
    for (uint32_t i = 0; i < e->num_layers; i++)
      ro->on_layer(ro->layer_ctx, i, &e->layers[i]);
  *out = e;
  return 0;
undo:
  kvti_free(ch.recs);
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

static void after_read(kvt_tier *t, kvt_entry *e, const kvti_read_opts *ro,
                       int prefix) {
  uint64_t id;
  if (e)
    e->from = KVTI_FROM_DISK;
  if (!t->hc || !e || ro->keep_tokens || ro->alloc || e->free_buf || e->recycle)
    return;
  ram_chain ch;
  memset(&ch, 0, sizeof ch);
  if (t->chunked && kvti_ram_chain_of(t, e->hash, e->tokens, e->n_tokens,
                                      prefix, &ro->salt, &ch) != 0) {
    kvt_clear_error();
    return; /* its chain went meanwhile: nothing to keep */
  }
  if (prefix && !ch.recs)
    return;
  if (kvti_hc_lend_chain(t->hc, e->hash, ch.recs ? ch.recs[ch.m - 1].key : NULL,
                         &id))
    kvti_ram_hook(t, e, id, ch.recs, ch.m, prefix);
  kvti_free(ch.recs);
}

void kvti_ram_after_disk(kvt_tier *t, kvt_entry *e, const kvti_read_opts *ro) {
  after_read(t, e, ro, 0);
}

void kvti_ram_after_prefix(kvt_tier *t, kvt_entry *e,
                           const kvti_read_opts *ro) {
  after_read(t, e, ro, 1);
}

/* A chained spill made resident as its tail and the chunks RAM lacks (a
 * prompt shared with earlier spills is there once), then the cutter woken for
 * whole records through the same chain: cut from own (the snapshot's layers,
 * consumed) or copied from borrowed (a zero-copy spill's, untouched). meta:
 * the record's figures. Returns 0, or an error with nothing kept. */
static int put_spilled_cut(kvt_tier *t, const char *hash, size_t n_tokens,
                           kvt_layer *own, const kvt_layer *borrowed,
                           uint32_t nl, const ram_chain *ch, uint64_t epoch,
                           const kvti_hc_item *meta) {
  uint8_t *have = kvti_calloc(ch->m, 1);
  kvti_hc_chunk **chs = kvti_calloc(ch->m, sizeof *chs);
  kvti_hc_item tail;
  memset(&tail, 0, sizeof tail);
  int rc = have && chs ? 0 : KVT_ERR_NOMEM();
  if (rc == 0) {
    kvti_hc_chunks_resident(t->hc, ch->recs[0].key, sizeof *ch->recs, ch->m,
                            have);
    rc =
        own ? kvti_ram_cut(own, nl, n_tokens, ch->recs, ch->m, have, &tail, chs)
            : kvti_ram_cut_borrowed(borrowed, nl, n_tokens, ch->recs, ch->m,
                                    have, &tail, chs);
  } else if (own) {
    kvti_ram_release_layers(own, nl);
  }
  if (rc == 0) {
    kvti_ram_tail_meta(&tail, meta->memory_bytes, meta->disk_bytes,
                       meta->storage_mode, ch->recs, ch->m);
    kvti_hc_put_tail(t->hc, hash, &tail, chs, ch->m, epoch);
    kvti_ram_push_wake(t, ch->recs[0].key);
  }
  kvti_free(chs);
  kvti_free(have);
  return rc;
}

/* A zero-copy spill, on the writer thread before the caller's buffers are
 * released: what RAM lacks of it (an entry stored whole: all of it; a chained
 * one: its tail and the chunks not resident) is copied in, unless the layers
 * exceed the cache's bound (they would not stay). meta: the record's
 * memory/disk bytes and mode. */
static void spilled_borrowed(kvt_tier *t, kvti_snapshot *s, const char *hash,
                             size_t n_tokens, const ram_chain *ch,
                             uint64_t epoch, const kvti_hc_item *meta) {
  uint32_t nl = 0;
  const kvt_layer *src = kvti_snapshot_layers(s, &nl);
  uint64_t bytes = 0;
  for (uint32_t i = 0; src && i < nl; i++)
    for (uint32_t j = 0; j < src[i].num_tensors; j++)
      bytes += src[i].tensors[j].nbytes;
  kvti_hc_stats st;
  kvti_hc_get_stats(t->hc, &st);
  if (!src || bytes > st.bound) {
    kvti_hc_invalidate(t->hc, hash); /* the old version */
    return;
  }
  int rc;
  if (!ch->recs) {
    kvti_hc_item it = *meta;
    it.n_layers = nl;
    it.layers = kvti_calloc(nl ? nl : 1, sizeof *it.layers);
    rc = it.layers ? 0 : KVT_ERR_NOMEM();
    for (uint32_t i = 0; rc == 0 && i < nl; i++)
      rc = kvti_ram_dup_layer(&it.layers[i], &src[i]);
    if (rc == 0) {
      kvti_hc_put(t->hc, hash, &it);
      return;
    }
    kvti_hc_item_free(&it);
  } else if (put_spilled_cut(t, hash, n_tokens, NULL, src, nl, ch, epoch,
                             meta) == 0) {
    return;
  }
  kvt_clear_error();
  kvti_hc_invalidate(t->hc, hash);
}

void kvti_ram_spilled(kvt_tier *t, kvti_snapshot *s, uint64_t disk_bytes) {
  /* Native mode only: there the files hold the snapshot's tensors as they
   * are (compat mode converts them); not when the remote upload queue still
   * needs the snapshot after this. */
  if (!t->hc || t->opts.storage_mode != KVT_STORAGE_NATIVE ||
      kvti_remote_enabled(t))
    return;
  const char *hash = kvti_snapshot_hash(s);
  /* A bound of 0 (the cache off) keeps nothing: no cut (a copy of every
   * row on the writer's thread), only the old version dropped. */
  kvti_hc_stats st;
  kvti_hc_get_stats(t->hc, &st);
  if (st.bound == 0) {
    kvti_hc_invalidate(t->hc, hash);
    return;
  }
  kvti_hc_item it;
  memset(&it, 0, sizeof it);
  size_t n = 0;
  const int32_t *tokens = kvti_snapshot_tokens(s, &n);
  uint64_t epoch = kvti_hc_epoch(t->hc);
  ram_chain ch;
  if (kvti_ram_chain_of(t, hash, tokens, n, 0, NULL, &ch) != 0) {
    kvt_clear_error();
    kvti_hc_invalidate(t->hc, hash);
    return; /* its chain is not whole (cannot happen after a put) */
  }
  it.memory_bytes = kvti_snapshot_memory_bytes(s);
  it.disk_bytes = disk_bytes + ch.bytes; /* tail + every chunk of its chain */
  it.storage_mode = KVT_STORAGE_NATIVE;
  if (!kvti_snapshot_take_layers(s, &it.layers, &it.n_layers)) {
    spilled_borrowed(t, s, hash, n, &ch, epoch, &it);
    kvti_free(ch.recs);
    return;
  }
  if (!ch.recs) {
    kvti_hc_put(t->hc, hash, &it);
    return;
  }
  if (put_spilled_cut(t, hash, n, it.layers, NULL, it.n_layers, &ch, epoch,
                      &it) != 0) {
    kvt_clear_error();
    kvti_hc_invalidate(t->hc, hash);
  }
  kvti_free(ch.recs);
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
  s->host_cache_chunks = st.chunks;
  s->host_cache_chunk_bytes = st.chunk_bytes;
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
  if (t->ram_bg) { /* prefixes waiting for the cutter: the same bound */
    uint64_t b = bound_of(bytes);
    pthread_mutex_lock(&t->ram_bg->q.mu);
    t->ram_bg->q.cfg.max_bytes = b ? b : 1;
    pthread_mutex_unlock(&t->ram_bg->q.mu);
  }
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
