/*
 * ram_cutter.c - the RAM tier's background cutter and the free path that
 * feeds it: an entry read from disk comes back to the cache when freed (its
 * buffers, without a copy on the freeing thread) and a job names it for the
 * cutter's one thread, which cuts it into tail + chunks once its chain
 * shares a chunk with what RAM holds (see the comment on the cutter below).
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

static void job_free(ram_job *j);

void kvti_ram_bg_release(ram_bg *bg) {
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
  kvti_ram_release_layers(j->layers, j->n_layers);
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

int kvti_ram_bg_open(kvt_tier *t, uint64_t bound) {
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
    rc = kvti_ram_cut(layers, n, n_tokens, recs, m, have, prefix ? NULL : &tail,
                      chs);
  } else {
    kvti_ram_release_layers(layers, n);
  }
  if (rc == 0) {
    kvti_ram_tail_meta(&tail, memory_bytes, disk_bytes, storage_mode, recs, m);
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
void kvti_ram_push_wake(kvt_tier *t, const uint8_t *first) {
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
      kvti_ram_release_layers(j->layers, j->n_layers);
      j->layers = NULL;
    }
  } else { /* no memory for the job */
    kvti_hc_forget(c, e->hash, e->recycle_id, 0);
    kvti_ram_release_layers(e->layers, e->num_layers);
  }
  if (j)
    kvt_clear_error(); /* a refused push: the entry is simply not kept */
  e->layers = NULL;
  if (j)
    job_free(j);
  kvti_free(lc->recs);
  kvti_ram_bg_release(lc->bg);
  kvti_hc_release(c);
  kvti_free(lc);
  kvti_free(e->tokens);
  kvti_free(e);
  return 1;
}

/* Hooks e (lent under id) so its buffers come back when freed; recs[0, m)
 * (copied; NULL for a whole entry) is the chain it was read through. */
void kvti_ram_hook(kvt_tier *t, kvt_entry *e, uint64_t id,
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
