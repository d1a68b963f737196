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
 * chunk files (store/chunks_verify.h: header, chain row, tokens, every block
 * over the copy's rows) and, for an entry, against its tail's files
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
#include "store/chunks_verify.h"
#include "store/local.h"
#include "tier/tier.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

static uint64_t bound_of(uint64_t opt) {
  return opt == KVT_HOST_CACHE_AUTO ? kvti_hc_default_bytes() : opt;
}

/* ---- the background cutter ---------------------------------------------
 * Freeing an entry read from disk must not copy on the freeing thread (often
 * the engine's). A chained entry's buffers are therefore admitted as they are,
 * as a whole record tagged with its chain (servable at once, zero copy), and a
 * job names it for this worker. A prefix has no whole record to become: its
 * job owns its layers until cut, and those pending bytes are bounded by the
 * cache's bound (beyond it the prefix is simply freed).
 *
 * Cutting pays only where RAM would hold rows twice. The worker cuts a whole
 * record into its tail and the chunks RAM lacks when its chain shares a chunk
 * with what RAM holds: a resident chunk, or another whole record waiting with
 * the same first chunk (chains that share any chunk share their first). An
 * entry that shares nothing stays whole - served again zero copy, no assembly
 * - and its job waits in a bounded list until something sharing its first
 * chunk is cut or spilled into RAM (that "wakes" it: cut then, tail only).
 * The list is the worker thread's alone; a job in it whose record was served,
 * replaced or dropped meanwhile finds nothing to cut.
 *
 * Lent entries may outlive the tier, so the worker's state is reference
 * counted (the tier and every lent entry hold one); the tier's close stops the
 * worker (pending jobs dropped: a whole record stays whole, a prefix is freed)
 * before the last reference can go, so no worker thread ever drops the last
 * one. */
#define RAM_MAX_DEFERRED 1024u

typedef struct ram_job ram_job;

typedef struct kvti_ram_bg {
  kvti_workq q;
  atomic_uint refs;
  kvti_hcache *hc; /* a reference */
  /* Whole records left uncut (see above), newest first: the worker's alone
   * (and bg_release's, once no worker runs). */
  ram_job *deferred;
  size_t n_deferred;
} ram_bg;

enum { JOB_ENTRY, JOB_PREFIX, JOB_WAKE };

struct ram_job {
  kvti_workq_item qi;
  ram_job *next; /* in ram_bg.deferred */
  char hash[KVT_HASH_HEX_LEN + 1];
  int prefix;
  int wake;   /* JOB_WAKE: cut the deferred records through first */
  int shared; /* an entry's chain had a resident chunk when it was freed */
  uint8_t first[32]; /* JOB_WAKE: a first chunk's key */
  uint64_t lend_id;  /* a prefix's lent record */
  size_t n_tokens;
  size_t m;
  kvti_chain_rec *recs; /* owned */
  kvt_layer *layers;    /* a prefix's layers, owned; NULL for an entry */
  uint32_t n_layers;
  uint64_t memory_bytes, disk_bytes;
  int storage_mode;
};

static void release_layers(kvt_layer *ls, uint32_t n) {
  for (uint32_t i = 0; ls && i < n; i++)
    kvti_layer_release(&ls[i], 0, NULL, NULL);
  kvti_free(ls);
}

static void job_free(ram_job *j);

static void bg_release(ram_bg *bg) {
  if (!bg || atomic_fetch_sub(&bg->refs, 1) != 1)
    return;
  kvti_workq_destroy(&bg->q);
  while (bg->deferred) {
    ram_job *j = bg->deferred;
    bg->deferred = j->next;
    job_free(j);
  }
  kvti_hc_release(bg->hc);
  kvti_free(bg);
}

static void job_free(ram_job *j) {
  release_layers(j->layers, j->n_layers);
  kvti_free(j->recs);
  kvti_free(j);
}

static void run_job(void *ctx, kvti_workq_item *qi);

static void drop_job(void *ctx, kvti_workq_item *qi) {
  ram_bg *bg = ctx;
  ram_job *j = (ram_job *)qi;
  if (j->prefix)
    kvti_hc_forget(bg->hc, j->hash, j->lend_id, 0);
  job_free(j);
}

static int bg_open(kvt_tier *t, uint64_t bound) {
  ram_bg *bg = kvti_calloc(1, sizeof *bg);
  if (!bg)
    return KVT_ERR_NOMEM();
  atomic_init(&bg->refs, 1);
  kvti_workq_cfg cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.threads = 1;
  cfg.max_items = KVTI_HC_MAX_LENT;  /* every job names a lent record */
  cfg.max_bytes = bound ? bound : 1; /* prefixes' pending bytes */
  cfg.start_on_push = 1;
  cfg.run = run_job;
  cfg.drop = drop_job;
  cfg.ctx = bg;
  cfg.name = "RAM tier cutter";
  int rc = kvti_workq_init(&bg->q, &cfg);
  if (rc) {
    kvti_workq_destroy(&bg->q);
    kvti_free(bg);
    return rc;
  }
  bg->hc = t->hc;
  kvti_hc_retain(t->hc);
  t->ram_bg = bg;
  return 0;
}

int kvti_ram_open(kvt_tier *t) {
  uint64_t bound = bound_of(t->opts.host_cache_bytes);
  int rc = kvti_hc_create(&t->hc, bound, kvti_bufpool_default());
  if (rc == 0)
    rc = bg_open(t, bound);
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
  bg_release(t->ram_bg);
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

static _Thread_local uint64_t tl_cut_bytes;

uint64_t kvti_ram_thread_cut_bytes(void) {
  return tl_cut_bytes;
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
static int verify_with(kvt_tier *t, const char *hash, kvti_hc_item *it,
                       const kvti_read_opts *ro, int prefix,
                       const ram_chain *chp) {
  const ram_chain ch = *chp;
  int rc;
  if (!ch.recs) /* an entry stored whole */
    return kvti_backend_local_verify_mem(t->be, hash, it->layers, it->n_layers,
                                         ro);
  if (!it->has_chain || memcmp(it->chain, ch.recs[ch.m - 1].key, 32) != 0) {
    /* Not the chain these rows were cached from (another namespace's chain
     * over the same tokens, or a chain rebuilt since): never served, even if
     * the bytes matched. */
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
  return rc;
}

/* ---- chunk granularity --------------------------------------------------- */

/* Chunk i of a chain (its key) built from rows [i*C, (i+1)*C) of the chunked
 * layers ids[0, n_ids) of layers (tensors of T rows), in the chunk file's
 * data order. NULL when out of memory. */
static kvti_hc_chunk *chunk_from_rows(const kvt_layer *layers,
                                      const uint32_t *ids, uint32_t n_ids,
                                      uint32_t spill_layers, uint64_t T,
                                      uint32_t C, size_t i,
                                      const uint8_t key[32]) {
  kvti_hc_chunk *ch = kvti_calloc(1, sizeof *ch);
  if (!ch)
    return NULL;
  memcpy(ch->key, key, 32);
  ch->n_tokens = C;
  ch->spill_layers = spill_layers;
  if (!(ch->layers = kvti_calloc(n_ids ? n_ids : 1, sizeof *ch->layers)))
    goto fail;
  ch->n_layers = n_ids;
  uint64_t pos = 0;
  for (uint32_t k = 0; k < n_ids; k++) {
    const kvt_layer *l = &layers[ids[k]];
    kvti_chunk_layer *L = &ch->layers[k];
    L->kind = l->kind;
    L->layer_idx = ids[k];
    if (l->kind == KVT_LAYER_QUANTIZED_KV) {
      L->bits = l->bits;
      L->group_size = l->group_size;
    }
    if (!(L->tensors = kvti_calloc(l->num_tensors ? l->num_tensors : 1,
                                   sizeof *L->tensors)))
      goto fail;
    L->num_tensors = l->num_tensors;
    for (uint32_t j = 0; j < l->num_tensors; j++) {
      const kvt_tensor *t = &l->tensors[j];
      kvti_chunk_tensor *ct = &L->tensors[j];
      uint64_t outer, row;
      kvti_chunk_tensor_geom(t, &outer, &row);
      ct->dtype = t->dtype;
      ct->ndim = t->ndim;
      memcpy(ct->shape, t->shape, sizeof ct->shape);
      ct->shape[t->ndim - 2] = C;
      ct->off = pos;
      ct->nbytes = outer * C * row;
      pos += ct->nbytes;
    }
  }
  ch->data_bytes = pos;
  if (!(ch->data = kvti_malloc(pos ? (size_t)pos : 1)))
    goto fail;
  for (uint32_t k = 0; k < n_ids; k++) {
    const kvt_layer *l = &layers[ids[k]];
    for (uint32_t j = 0; j < l->num_tensors; j++) {
      const kvt_tensor *t = &l->tensors[j];
      const kvti_chunk_tensor *ct = &ch->layers[k].tensors[j];
      uint64_t outer, row;
      kvti_chunk_tensor_geom(t, &outer, &row);
      for (uint64_t o = 0; o < outer && row; o++)
        memcpy(ch->data + ct->off + o * C * row,
               (const uint8_t *)t->data + (o * T + (uint64_t)i * C) * row,
               (size_t)(C * row));
    }
  }
  return ch;
fail:
  kvti_hc_chunk_free(ch);
  return NULL;
}

/* Cuts the layers of an entry of n_tokens (owned, a read's layout:
 * kvti_buf_alloc'ed data; layers[0, n) and the array are consumed either
 * way) over chain recs[0, m) into its tail (*tail when tail is non-NULL:
 * the chunked layers' rows past the chain, copied, and every other layer,
 * moved) and copies of the chunks with have[i] == 0 (chs[i]; NULL for the
 * others). Returns 0, KVT_EINVAL (the layers do not cut into that chain:
 * nothing built), KVT_ENOMEM. */
/* A deep copy of s into d in a read's layout (kvti_buf_alloc'ed data). On
 * KVT_ENOMEM d holds what was copied (kvti_layer_release frees it). */
static int dup_layer(kvt_layer *d, const kvt_layer *s) {
  *d = *s;
  d->tensors = NULL;
  d->orig_dtypes = NULL;
  d->num_tensors = 0;
  if (s->orig_dtypes) {
    if (!(d->orig_dtypes = kvti_malloc((s->num_tensors ? s->num_tensors : 1) *
                                       sizeof(int32_t))))
      return KVT_ERR_NOMEM();
    memcpy(d->orig_dtypes, s->orig_dtypes, s->num_tensors * sizeof(int32_t));
  }
  if (!(d->tensors = kvti_calloc(s->num_tensors ? s->num_tensors : 1,
                                 sizeof *d->tensors)))
    return KVT_ERR_NOMEM();
  for (uint32_t j = 0; j < s->num_tensors; j++) {
    d->tensors[j] = s->tensors[j];
    d->tensors[j].data = NULL;
    d->num_tensors = j + 1;
    if (!s->tensors[j].nbytes)
      continue;
    if (!(d->tensors[j].data = kvti_buf_alloc((size_t)s->tensors[j].nbytes)))
      return KVT_ERR_NOMEM();
    memcpy(d->tensors[j].data, s->tensors[j].data,
           (size_t)s->tensors[j].nbytes);
    tl_cut_bytes += s->tensors[j].nbytes;
  }
  return 0;
}

/* As cut, for layers that stay the caller's (a zero-copy spill): nothing is
 * consumed, the tail is a deep copy. */
static int cut_borrowed(const kvt_layer *layers, uint32_t n, size_t n_tokens,
                        const kvti_chain_rec *recs, size_t m,
                        const uint8_t *have, kvti_hc_item *tail,
                        kvti_hc_chunk **chs);

/* Splits layers along their chain's chunks and makes the chunks RAM lacks
 * (have[i] set: already held), counting their bytes as cut on this thread.
 * chs[i] is NULL for a chunk held; on failure every made chunk is still in
 * chs for the caller to free. what names the entry in the error. */
static int split_chunks(kvti_chunk_split *sp, const kvt_layer *layers,
                        uint32_t n, size_t n_tokens, const kvti_chain_rec *recs,
                        size_t m, const uint8_t *have, kvti_hc_chunk **chs,
                        const char *what) {
  uint32_t C = recs[0].n_tokens;
  int rc = kvti_chunk_split_make(sp, layers, n, n_tokens, C);
  if (rc == 0 && sp->chunks != m)
    rc = KVT_ERR(KVT_EINVAL, "%s entry: %zu chunks, its chain %zu", what,
                 sp->chunks, m);
  for (size_t i = 0; i < m; i++)
    chs[i] = NULL;
  for (size_t i = 0; rc == 0 && i < m; i++)
    if (!(have && have[i]) &&
        !(chs[i] = chunk_from_rows(layers, sp->ids, sp->n_ids, n, sp->T, C, i,
                                   recs[i].key)))
      rc = KVT_ERR_NOMEM();
    else if (chs[i])
      tl_cut_bytes += chs[i]->data_bytes;
  return rc;
}

static int cut(kvt_layer *layers, uint32_t n, size_t n_tokens,
               const kvti_chain_rec *recs, size_t m, const uint8_t *have,
               kvti_hc_item *tail, kvti_hc_chunk **chs) {
  kvti_chunk_split sp;
  int rc = split_chunks(&sp, layers, n, n_tokens, recs, m, have, chs, "cached");
  if (rc == 0 && tail) {
    /* sp.tail holds its own copies of the chunked layers' tail rows and
     * shallow copies of everything else: those move out of layers. */
    uint32_t k = 0;
    for (uint32_t i = 0; i < n; i++) {
      int chunked = k < sp.n_ids && sp.ids[k] == i;
      k += chunked;
      sp.tail[i].orig_dtypes = layers[i].orig_dtypes;
      layers[i].orig_dtypes = NULL;
      if (!chunked) {
        layers[i].tensors = NULL;
        layers[i].num_tensors = 0;
      }
    }
    memset(tail, 0, sizeof *tail);
    tail->layers = sp.tail;
    tail->n_layers = n;
    sp.tail = NULL;
  }
  if (rc)
    for (size_t i = 0; i < m; i++) {
      kvti_hc_chunk_free(chs[i]);
      chs[i] = NULL;
    }
  kvti_chunk_split_free(&sp);
  for (uint32_t i = 0; i < n; i++)
    kvti_layer_release(&layers[i], 0, NULL, NULL);
  kvti_free(layers);
  return rc;
}

static int cut_borrowed(const kvt_layer *layers, uint32_t n, size_t n_tokens,
                        const kvti_chain_rec *recs, size_t m,
                        const uint8_t *have, kvti_hc_item *tail,
                        kvti_hc_chunk **chs) {
  kvti_chunk_split sp;
  int rc =
      split_chunks(&sp, layers, n, n_tokens, recs, m, have, chs, "spilled");
  memset(tail, 0, sizeof *tail);
  if (rc == 0) {
    /* sp.tail's chunked layers own their tail rows; everything else in it
     * is the caller's: cleared first, so the item only ever owns its own
     * memory, then copied. */
    uint32_t k = 0;
    for (uint32_t i = 0; i < n; i++) {
      int chunked = k < sp.n_ids && sp.ids[k] == i;
      k += chunked;
      sp.tail[i].orig_dtypes = NULL;
      if (!chunked) {
        sp.tail[i].tensors = NULL;
        sp.tail[i].num_tensors = 0;
      } else {
        for (uint32_t j = 0; j < sp.tail[i].num_tensors; j++)
          tl_cut_bytes += sp.tail[i].tensors[j].nbytes;
      }
    }
    tail->layers = sp.tail;
    tail->n_layers = n;
    sp.tail = NULL;
    k = 0;
    for (uint32_t i = 0; rc == 0 && i < n; i++) {
      int chunked = k < sp.n_ids && sp.ids[k] == i;
      k += chunked;
      kvt_layer *d = &tail->layers[i];
      if (!chunked) {
        rc = dup_layer(d, &layers[i]);
      } else if (layers[i].orig_dtypes) {
        uint32_t nt = layers[i].num_tensors;
        if (!(d->orig_dtypes = kvti_malloc((nt ? nt : 1) * sizeof(int32_t))))
          rc = KVT_ERR_NOMEM();
        else
          memcpy(d->orig_dtypes, layers[i].orig_dtypes, nt * sizeof(int32_t));
      }
    }
    if (rc)
      kvti_hc_item_free(tail);
  }
  if (rc)
    for (size_t i = 0; i < m; i++) {
      kvti_hc_chunk_free(chs[i]);
      chs[i] = NULL;
    }
  kvti_chunk_split_free(&sp);
  return rc;
}

/* Chunk rec (the prompt's tokens for it) read from its file, every block
 * verified as it lands (kvti_chunk_read_data), into a new chunk record. */
static int load_chunk(kvt_tier *t, const kvti_chain_rec *rec,
                      const int32_t *tokens, kvti_hc_chunk **out) {
  kvti_chunkstore *cs = kvti_chunked_store(t->chunked);
  int fd = -1;
  kvti_chunk_hdr h;
  int rc = kvti_chunkstore_open_chunk(cs, rec, tokens, &fd, &h);
  if (rc)
    return rc;
  kvti_hc_chunk *ch = kvti_calloc(1, sizeof *ch);
  if (!ch || !(ch->layers = kvti_calloc(h.n_layers ? h.n_layers : 1,
                                        sizeof *ch->layers))) {
    rc = KVT_ERR_NOMEM();
    goto out;
  }
  memcpy(ch->key, rec->key, 32);
  ch->n_tokens = h.n_tokens;
  ch->spill_layers = h.spill_layers;
  ch->n_layers = h.n_layers;
  for (uint32_t i = 0; rc == 0 && i < h.n_layers; i++) {
    kvti_chunk_layer *L = &ch->layers[i];
    *L = h.layers[i];
    L->tensors =
        kvti_malloc((L->num_tensors ? L->num_tensors : 1) * sizeof *L->tensors);
    if (!L->tensors) {
      L->num_tensors = 0;
      rc = KVT_ERR_NOMEM();
    } else {
      memcpy(L->tensors, h.layers[i].tensors,
             L->num_tensors * sizeof *L->tensors);
    }
  }
  ch->data_bytes = h.data_bytes;
  if (rc == 0 &&
      !(ch->data = kvti_malloc(h.data_bytes ? (size_t)h.data_bytes : 1)))
    rc = KVT_ERR_NOMEM();
  char path[4096];
  if (rc == 0 &&
      (rc = kvti_chunkstore_path(cs, rec->key, path, sizeof path)) == 0)
    rc = kvti_chunk_read_data(fd, &h, ch->data, path);
out:
  kvti_close(fd);
  kvti_chunk_hdr_free(&h);
  if (rc)
    kvti_hc_chunk_free(ch);
  else
    *out = ch;
  return rc;
}

/* Frees layers built by assemble (caller buffers through ro->free_buf). */
static void free_built(kvt_layer *ls, uint32_t n, const kvti_read_opts *ro) {
  for (uint32_t i = 0; ls && i < n; i++)
    kvti_layer_release(&ls[i], ro->alloc != NULL, ro->free_buf, ro->alloc_ctx);
  kvti_free(ls);
}

static void *new_buf(const kvti_read_opts *ro, uint32_t i, uint32_t j,
                     const kvt_tensor *d) {
  if (!d->nbytes)
    return NULL;
  return ro->alloc ? ro->alloc(ro->alloc_ctx, i, j, d)
                   : kvti_buf_alloc((size_t)d->nbytes);
}

/* The same geometry but for the token axis (and the same dtype). */
static int same_but_rows(const kvt_tensor *t, const kvti_chunk_tensor *ct) {
  if (t->dtype != ct->dtype || t->ndim != ct->ndim || t->ndim < 2)
    return 0;
  for (uint32_t d = 0; d < t->ndim; d++)
    if (d != t->ndim - 2 && t->shape[d] != ct->shape[d])
      return 0;
  return 1;
}

/* New layers (ro's alloc, else kvti_buf_alloc) holding the chain's rows from
 * chunks chs[0, m) followed by tail's rows, with tail's attributes and its
 * other layers copied - the entry a disk read returns - or, tail NULL, the
 * pure prefix of the chain alone (attributes set by the check that follows).
 * Nothing here is trusted: the result is checked against the files before
 * it is served. *bytes: tensor bytes allocated. Returns 0, KVT_ECORRUPT (the
 * pieces do not fit together), KVT_ENOTFOUND (a prefix of a chain that is
 * not pure), KVT_ENOMEM. */
static int assemble(const kvti_hc_item *tail, const kvti_hc_chunk *const *chs,
                    size_t m, const kvti_read_opts *ro, kvt_layer **out,
                    uint32_t *n_out, uint64_t *bytes) {
  const kvti_hc_chunk *c0 = chs[0];
  uint32_t C = c0->n_tokens;
  uint64_t rows = (uint64_t)m * C;
  *bytes = 0;
  for (size_t c = 1; c < m; c++)
    if (chs[c]->n_tokens != C || chs[c]->n_layers != c0->n_layers)
      return KVT_ERR(KVT_ECORRUPT, "cached chunks: layouts differ");
  if (!tail && c0->spill_layers != c0->n_layers)
    return KVT_ERR(KVT_ENOTFOUND, "cached chain: not pure");
  uint32_t n = tail ? tail->n_layers : c0->spill_layers;
  int32_t *which = kvti_malloc((n ? n : 1) * sizeof *which);
  kvt_layer *ls = kvti_calloc(n ? n : 1, sizeof *ls);
  int rc = which && ls ? 0 : KVT_ERR_NOMEM();
  for (uint32_t i = 0; rc == 0 && i < n; i++)
    which[i] = -1;
  for (uint32_t k = 0; rc == 0 && k < c0->n_layers; k++) {
    uint32_t li = c0->layers[k].layer_idx;
    if (li >= n || which[li] >= 0)
      rc = KVT_ERR(KVT_ECORRUPT, "cached chunk: layer %u out of place", li);
    else
      which[li] = (int32_t)k;
  }
  for (uint32_t i = 0; rc == 0 && i < n; i++) {
    kvt_layer *d = &ls[i];
    const kvt_layer *tl = tail ? &tail->layers[i] : NULL;
    const kvti_chunk_layer *L = which[i] >= 0 ? &c0->layers[which[i]] : NULL;
    if (!L && !tl) {
      rc = KVT_ERR(KVT_ECORRUPT, "cached chain: layer %u missing", i);
      break;
    }
    if (tl) {
      *d = *tl;
      d->tensors = NULL;
      d->orig_dtypes = NULL;
      d->num_tensors = 0;
    } else {
      kvt_layer_init(d, (kvt_layer_kind)L->kind);
      d->offset = (int64_t)rows;
      if (L->kind == KVT_LAYER_QUANTIZED_KV) {
        d->bits = L->bits;
        d->group_size = L->group_size;
      }
    }
    uint32_t nt = L ? L->num_tensors : tl->num_tensors;
    if (L && tl && (tl->num_tensors != nt || tl->kind != L->kind)) {
      rc = KVT_ERR(KVT_ECORRUPT, "cached tail: layer %u differs", i);
      break;
    }
    if (!(d->tensors = kvti_calloc(nt ? nt : 1, sizeof *d->tensors))) {
      rc = KVT_ERR_NOMEM();
      break;
    }
    d->num_tensors = nt;
    if (tl && tl->orig_dtypes) {
      if (!(d->orig_dtypes = kvti_malloc(nt * sizeof(int32_t)))) {
        rc = KVT_ERR_NOMEM();
        break;
      }
      memcpy(d->orig_dtypes, tl->orig_dtypes, nt * sizeof(int32_t));
    }
    for (uint32_t j = 0; rc == 0 && j < nt; j++) {
      kvt_tensor *dt = &d->tensors[j];
      const kvt_tensor *tt = tl ? &tl->tensors[j] : NULL;
      if (!L) { /* a layer the chain does not hold: the tail's, copied */
        *dt = *tt;
        dt->data = NULL;
        if (tt->nbytes && !(dt->data = new_buf(ro, i, j, dt))) {
          dt->nbytes = 0;
          rc = KVT_ERR(KVT_ENOMEM, "no buffer for layer %u tensor %u", i, j);
          break;
        }
        if (tt->nbytes)
          memcpy(dt->data, tt->data, (size_t)tt->nbytes);
        *bytes += tt->nbytes;
        continue;
      }
      const kvti_chunk_tensor *ct = &L->tensors[j];
      uint64_t tT = tt ? (uint64_t)tt->shape[tt->ndim - 2] : 0;
      if (tt && !same_but_rows(tt, ct)) {
        rc = KVT_ERR(KVT_ECORRUPT, "cached tail: layer %u tensor %u differs", i,
                     j);
        break;
      }
      dt->dtype = ct->dtype;
      dt->ndim = ct->ndim;
      memcpy(dt->shape, ct->shape, sizeof dt->shape);
      dt->shape[dt->ndim - 2] = (int64_t)(rows + tT);
      uint64_t nb;
      if (kvti_tensor_nbytes(&nb, (kvt_dtype)dt->dtype, dt->ndim, dt->shape) ||
          nb > SIZE_MAX / 2) {
        rc = KVT_ERR(KVT_ECORRUPT, "cached chain: layer %u tensor %u size", i,
                     j);
        break;
      }
      dt->nbytes = nb;
      if (nb && !(dt->data = new_buf(ro, i, j, dt))) {
        dt->nbytes = 0;
        rc = KVT_ERR(KVT_ENOMEM, "no buffer for layer %u tensor %u", i, j);
        break;
      }
      *bytes += nb;
      uint64_t outer, row, T = rows + tT;
      kvti_chunk_tensor_geom(dt, &outer, &row);
      for (size_t c = 0; rc == 0 && c < m; c++) {
        const kvti_chunk_tensor *cc = &chs[c]->layers[which[i]].tensors[j];
        if (chs[c]->layers[which[i]].layer_idx != i ||
            chs[c]->layers[which[i]].num_tensors != nt ||
            !same_but_rows(dt, cc) || cc->nbytes != outer * C * row ||
            cc->off + cc->nbytes > chs[c]->data_bytes) {
          rc =
              KVT_ERR(KVT_ECORRUPT, "cached chunk %zu: layer %u differs", c, i);
          break;
        }
        for (uint64_t o = 0; o < outer && row; o++)
          memcpy((uint8_t *)dt->data + (o * T + (uint64_t)c * C) * row,
                 chs[c]->data + cc->off + o * C * row, (size_t)(C * row));
      }
      for (uint64_t o = 0; rc == 0 && o < outer && row && tT; o++)
        memcpy((uint8_t *)dt->data + (o * T + rows) * row,
               (const uint8_t *)tt->data + o * tT * row, (size_t)(tT * row));
    }
  }
  kvti_free(which);
  if (rc) {
    free_built(ls, n, ro);
    return rc;
  }
  *out = ls;
  *n_out = n;
  return 0;
}

/* What a lent entry needs when it is freed (kvt_entry_free -> recycle): the
 * cache and the cutter (a reference each) and, for a chained entry or a
 * prefix, the chain it was read through, to cut it into its tail and chunks
 * without the tier (which may be closed by then). */
typedef struct lend_ctx {
  kvti_hcache *hc;
  ram_bg *bg;
  int prefix;
  size_t m;
  kvti_chain_rec *recs; /* NULL: a whole entry */
} lend_ctx;

/* A cut tail's record: the entry's figures, tagged with the chain's last
 * chunk. */
static void tail_meta(kvti_hc_item *tail, uint64_t memory_bytes,
                      uint64_t disk_bytes, int storage_mode,
                      const kvti_chain_rec *recs, size_t m) {
  tail->memory_bytes = memory_bytes;
  tail->disk_bytes = disk_bytes;
  tail->storage_mode = storage_mode;
  tail->has_chain = 1;
  memcpy(tail->chain, recs[m - 1].key, 32);
}

/* The cutter's work on a lent record (lend_id) of hash: its layers (owned,
 * consumed) over recs[0, m) become its tail (none for a prefix) and the
 * chunks RAM lacks, given back in its place (only what RAM lacks is copied:
 * chunks another entry brought stay as they are); on failure the record is
 * forgotten. */
static void cut_back(kvti_hcache *c, const char *hash, uint64_t lend_id,
                     kvt_layer *layers, uint32_t n, size_t n_tokens,
                     const kvti_chain_rec *recs, size_t m, int prefix,
                     uint64_t memory_bytes, uint64_t disk_bytes,
                     int storage_mode) {
  uint8_t *have = kvti_calloc(m, 1);
  kvti_hc_chunk **chs = kvti_calloc(m, sizeof *chs);
  kvti_hc_item tail;
  memset(&tail, 0, sizeof tail);
  int rc = have && chs ? 0 : KVT_ERR_NOMEM();
  if (rc == 0) {
    kvti_hc_chunks_resident(c, recs[0].key, sizeof *recs, m, have);
    rc = cut(layers, n, n_tokens, recs, m, have, prefix ? NULL : &tail, chs);
  } else {
    release_layers(layers, n);
  }
  if (rc == 0) {
    tail_meta(&tail, memory_bytes, disk_bytes, storage_mode, recs, m);
    kvti_hc_give_back_tail(c, hash, lend_id, prefix ? NULL : &tail, chs, m);
  } else {
    kvt_clear_error();
    kvti_hc_forget(c, hash, lend_id, 0);
  }
  kvti_free(chs);
  kvti_free(have);
}

/* The whole record j names, unless it was served, replaced or dropped
 * meanwhile (then there is nothing of it to cut), cut into its tail and the
 * chunks RAM lacks. */
static void cut_entry(ram_bg *bg, const ram_job *j) {
  kvti_hc_item it;
  uint64_t id;
  if (kvti_hc_take_whole(bg->hc, j->hash, j->recs[j->m - 1].key, &it, &id))
    cut_back(bg->hc, j->hash, id, it.layers, it.n_layers, j->n_tokens, j->recs,
             j->m, 0, it.memory_bytes, it.disk_bytes, it.storage_mode);
}

/* 1 when cutting j's record would let RAM hold some of its rows once for
 * several users: a chunk of its chain is resident, or another deferred
 * record, still resident, starts with the same chunk (those no longer
 * resident are dropped on the way). */
static int shares(ram_bg *bg, const ram_job *j) {
  if (j->shared)
    return 1;
  for (ram_job **pp = &bg->deferred; *pp;) {
    ram_job *d = *pp;
    if (memcmp(d->recs[0].key, j->recs[0].key, 32) != 0) {
      pp = &d->next;
    } else if (kvti_hc_resident(bg->hc, d->hash)) {
      return 1;
    } else {
      *pp = d->next;
      bg->n_deferred--;
      job_free(d);
    }
  }
  uint8_t *have = kvti_calloc(j->m, 1);
  if (!have)
    return 1; /* cut, as nothing better is known */
  size_t n = kvti_hc_chunks_resident(bg->hc, j->recs[0].key, sizeof *j->recs,
                                     j->m, have);
  kvti_free(have);
  return n > 0;
}

/* Unlinks (and frees) the deferred jobs matching: hash non-NULL, that
 * record's (a newer job supersedes it); else those whose chain starts with
 * first, each cut first. */
static void take_deferred(ram_bg *bg, const char *hash, const uint8_t *first) {
  ram_job **pp = &bg->deferred;
  while (*pp) {
    ram_job *d = *pp;
    if (hash ? strcmp(d->hash, hash) != 0
             : memcmp(d->recs[0].key, first, 32) != 0) {
      pp = &d->next;
      continue;
    }
    *pp = d->next;
    bg->n_deferred--;
    if (!hash)
      cut_entry(bg, d);
    job_free(d);
  }
}

/* Keeps j (owned) uncut, newest first; beyond the bound the oldest are
 * dropped - their records stay whole, served as they are, and are looked at
 * again when next freed. */
static void defer(ram_bg *bg, ram_job *j) {
  if (bg->n_deferred >= RAM_MAX_DEFERRED) {
    ram_job **pp = &bg->deferred;
    for (size_t i = 1; *pp && i < RAM_MAX_DEFERRED; i++)
      pp = &(*pp)->next;
    while (*pp) {
      ram_job *d = *pp;
      *pp = d->next;
      bg->n_deferred--;
      job_free(d);
    }
  }
  j->next = bg->deferred;
  bg->deferred = j;
  bg->n_deferred++;
}

static void run_job(void *ctx, kvti_workq_item *qi) {
  ram_bg *bg = ctx;
  ram_job *j = (ram_job *)qi;
  if (j->wake) {
    take_deferred(bg, NULL, j->first);
  } else if (j->prefix) {
    cut_back(bg->hc, j->hash, j->lend_id, j->layers, j->n_layers, j->n_tokens,
             j->recs, j->m, 1, j->memory_bytes, j->disk_bytes, j->storage_mode);
    j->layers = NULL;
    take_deferred(bg, NULL, j->recs[0].key); /* its chunks are resident */
  } else {
    take_deferred(bg, j->hash, NULL);
    if (!shares(bg, j)) {
      defer(bg, j);
      return;
    }
    cut_entry(bg, j);
    take_deferred(bg, NULL, j->recs[0].key);
  }
  job_free(j);
}

/* Asks the cutter to cut the deferred records whose chain starts with first
 * (its chunks were just made resident by another path). Best effort: a
 * refused push leaves them whole. */
static void push_wake(kvt_tier *t, const uint8_t *first) {
  if (!t->ram_bg)
    return;
  ram_job *j = kvti_calloc(1, sizeof *j);
  if (!j)
    return;
  j->wake = 1;
  memcpy(j->first, first, 32);
  if (kvti_workq_push(&t->ram_bg->q, &j->qi, 0) != 0) {
    kvt_clear_error();
    kvti_free(j);
  }
}

/* kvt_entry_free's hook for an entry whose buffers the cache may take back.
 * Nothing is copied here (see the cutter above). */
static int recycle(kvt_entry *e) {
  lend_ctx *lc = e->recycle_ctx;
  kvti_hcache *c = lc->hc;
  ram_job *j = lc->recs ? kvti_calloc(1, sizeof *j) : NULL;
  if (j) {
    memcpy(j->hash, e->hash, sizeof j->hash);
    j->prefix = lc->prefix;
    j->lend_id = e->recycle_id;
    j->n_tokens = e->n_tokens;
    j->m = lc->m;
    j->recs = lc->recs;
    lc->recs = NULL;
    j->memory_bytes = e->memory_bytes;
    j->disk_bytes = e->disk_bytes;
    j->storage_mode = e->storage_mode;
  }
  if (!lc->prefix) {
    /* The buffers become the record as they are: a whole entry stays so, a
     * chained one is cut later by the cutter when it shares. Its resident
     * chunks are looked at (and LRU-touched) before the record is admitted,
     * which may need their room: a chain that shared then is cut, the
     * chunks it lost meanwhile made again. */
    if (j) {
      uint8_t *have = kvti_calloc(j->m, 1);
      j->shared =
          !have || kvti_hc_chunks_resident(c, j->recs[0].key, sizeof *j->recs,
                                           j->m, have) > 0;
      kvti_free(have);
    }
    kvti_hc_item it = {e->layers,       e->num_layers, 0,
                       e->memory_bytes, e->disk_bytes, e->storage_mode};
    if (kvti_hc_give_back(c, e->hash, e->recycle_id, &it) && j &&
        kvti_workq_push(&lc->bg->q, &j->qi, 0) == 0)
      j = NULL;
  } else if (j) {
    /* A prefix waits for the cutter with its layers, its bytes bounded by
     * the cutter's queue (the cache's bound). */
    j->layers = e->layers;
    j->n_layers = e->num_layers;
    if (kvti_hc_mark_cut(c, e->hash, e->recycle_id) &&
        kvti_workq_push(&lc->bg->q, &j->qi,
                        kvti_hc_layers_bytes(e->layers, e->num_layers)) == 0) {
      j = NULL;
    } else {
      kvti_hc_forget(c, e->hash, e->recycle_id, 0);
      release_layers(j->layers, j->n_layers);
      j->layers = NULL;
    }
  } else { /* no memory for the job */
    kvti_hc_forget(c, e->hash, e->recycle_id, 0);
    release_layers(e->layers, e->num_layers);
  }
  if (j)
    kvt_clear_error(); /* a refused push: the entry is simply not kept */
  e->layers = NULL;
  if (j)
    job_free(j);
  kvti_free(lc->recs);
  bg_release(lc->bg);
  kvti_hc_release(c);
  kvti_free(lc);
  kvti_free(e->tokens);
  kvti_free(e);
  return 1;
}

/* Hooks e (lent under id) so its buffers come back when freed; recs[0, m)
 * (copied; NULL for a whole entry) is the chain it was read through. */
static void hook(kvt_tier *t, kvt_entry *e, uint64_t id,
                 const kvti_chain_rec *recs, size_t m, int prefix) {
  lend_ctx *lc = kvti_calloc(1, sizeof *lc);
  if (lc && recs) {
    lc->recs = kvti_malloc(m * sizeof *recs);
    if (lc->recs)
      memcpy(lc->recs, recs, m * sizeof *recs);
  }
  if (!lc || (recs && !lc->recs)) {
    kvti_free(lc);
    kvti_hc_forget(t->hc, e->hash, id, 0);
    kvt_clear_error();
    return;
  }
  lc->m = m;
  lc->prefix = prefix;
  lc->hc = t->hc;
  kvti_hc_retain(t->hc);
  lc->bg = t->ram_bg;
  atomic_fetch_add(&t->ram_bg->refs, 1);
  e->recycle = recycle;
  e->recycle_ctx = lc;
  e->recycle_id = id;
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
  int rc = chain_of(t, hash, ro->tokens, ro->n_tokens, prefix, &ro->salt, &ch);
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
    } else if ((rc = load_chunk(t, &ch.recs[i], ro->tokens + i * C,
                                &loaded[i])) == 0) {
      chs[i] = loaded[i];
    }
    /* A chunk that cannot be read: the disk read that follows meets the
     * same fault and deals with it (quarantine, eviction). */
  }
  if (rc == 0 && ro->cancel && atomic_load(ro->cancel))
    rc = KVT_ERR(KVT_ECANCELED, "promote cancelled");
  if (rc == 0) {
    rc = assemble(tail, chs, m, ro, &layers, &nl, &abytes);
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
    rc = verify_with(t, hash, &it, ro, prefix, &ch);
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
    free_built(layers, nl, ro);
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
  int rc = chain_of(t, hash, ro->tokens, ro->n_tokens, prefix, &ro->salt, &ch);
  if (rc == 0)
    rc = verify_with(t, hash, &it, ro, prefix, &ch);
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
    hook(t, e, id, ch.recs, ch.m, 0);
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
  if (t->chunked && chain_of(t, e->hash, e->tokens, e->n_tokens, prefix,
                             &ro->salt, &ch) != 0) {
    kvt_clear_error();
    return; /* its chain went meanwhile: nothing to keep */
  }
  if (prefix && !ch.recs)
    return;
  if (kvti_hc_lend_chain(t->hc, e->hash, ch.recs ? ch.recs[ch.m - 1].key : NULL,
                         &id))
    hook(t, e, id, ch.recs, ch.m, prefix);
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
    rc = own ? cut(own, nl, n_tokens, ch->recs, ch->m, have, &tail, chs)
             : cut_borrowed(borrowed, nl, n_tokens, ch->recs, ch->m, have,
                            &tail, chs);
  } else if (own) {
    release_layers(own, nl);
  }
  if (rc == 0) {
    tail_meta(&tail, meta->memory_bytes, meta->disk_bytes, meta->storage_mode,
              ch->recs, ch->m);
    kvti_hc_put_tail(t->hc, hash, &tail, chs, ch->m, epoch);
    push_wake(t, ch->recs[0].key);
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
      rc = dup_layer(&it.layers[i], &src[i]);
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
  kvti_hc_item it;
  memset(&it, 0, sizeof it);
  const char *hash = kvti_snapshot_hash(s);
  size_t n = 0;
  const int32_t *tokens = kvti_snapshot_tokens(s, &n);
  uint64_t epoch = kvti_hc_epoch(t->hc);
  ram_chain ch;
  if (chain_of(t, hash, tokens, n, 0, NULL, &ch) != 0) {
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
