/*
 * recover.c - the index is never the only copy of what is stored. Every entry
 * directory holds what its row says (manifest, tokens), so index.db can
 * always be rebuilt: at open, an index.db that is not a regular file, or that
 * SQLite reports damaged (SQLITE_NOTADB / SQLITE_CORRUPT while it is opened
 * and its rows loaded), is set aside as index.db.corrupt-<time> (its WAL
 * with it, the -shm cache deleted), logged, and replaced by a fresh index
 * that reconcile then fills; KVT_OPEN_REINDEX does the same on demand
 * (index.db.reindexed-<time>). Reconcile's rule for a directory without a row
 * is the one of verify --repair: a valid entry is adopted (a row built from
 * its files, created_at = the directory's mtime), an invalid one quarantined,
 * and none is deleted for lack of a row. A full quick_check is verify's job,
 * not every open's.
 */
#include "tier/tier.h"
#include "store/local.h"
#include "base/error.h"
#include "base/io.h"
#include "index/index.h"
#include "tier/chunks.h"
#include "store/local_layout.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

static void note_moved(void *ctx, const char *from, const char *to) {
  kvti_log(ctx, KVT_LOG_WARN, "kvtier: %s set aside as %s", from, to);
}

int kvti_tier_index_set_aside(kvt_tier *t, const char *why) {
  return kvti_local_index_set_aside(t->dir, why, note_moved, t);
}

int kvti_tier_open_index(kvt_tier *t, const kvti_index_measure *measure,
                         int *rebuilt) {
  *rebuilt = 0;
  int rc = 0;
  if (t->readonly) {
    if (kvti_local_index_hostile(t->dir))
      return KVT_ERR(KVT_ECORRUPT,
                     "%s/index.db is not a regular file; open the directory "
                     "writable (or run `kvtier reindex`) to rebuild it",
                     t->dir);
    rc = kvti_index_open(&t->idx, t->dir, measure, KVTI_INDEX_READONLY);
    goto opened;
  }
  if (t->opts.flags & KVT_OPEN_REINDEX) {
    if ((rc = kvti_tier_index_set_aside(t, "reindexed")) != 0)
      return rc;
    *rebuilt = 1;
  } else if (kvti_local_index_hostile(t->dir)) {
    if ((rc = kvti_tier_index_set_aside(t, "corrupt")) != 0)
      return rc;
    *rebuilt = 1;
  }
  if ((rc = kvti_backend_local_prepare_index(t->be)) != 0)
    return rc;
  rc = kvti_index_open(&t->idx, t->dir, measure, 0);
  if (rc != 0 && kvti_index_error_is_damage()) {
    kvti_log(t, KVT_LOG_WARN,
             "kvtier: %s/index.db is damaged (%s); rebuilding it from the "
             "entry directories",
             t->dir, kvt_last_error());
    if ((rc = kvti_tier_index_set_aside(t, "corrupt")) != 0 ||
        (rc = kvti_backend_local_prepare_index(t->be)) != 0)
      return rc;
    *rebuilt = 1;
    rc = kvti_index_open(&t->idx, t->dir, measure, 0);
  }
  if (rc == 0 && *rebuilt)
    kvti_log(t, KVT_LOG_WARN,
             "kvtier: %s: new index; entries are adopted from their "
             "directories",
             t->dir);
opened:
  /* An injected clock times recency too (a replay's eviction follows its
   * trace, not how fast it ran): read here first, on the opener's thread. */
  if (rc == 0 && t->opts.clock_fn) {
    kvti_tier_clock(t);
    kvti_index_set_clock(t->idx, kvti_tier_recency_now, t);
  }
  return rc;
}

/* Rows adopted per SQLite transaction. */
#define ADOPT_BATCH 256

typedef struct adopt_batch {
  kvti_index_put_args a[ADOPT_BATCH];
  kvti_entry_probe_info p[ADOPT_BATCH];
  char h[ADOPT_BATCH][KVT_HASH_HEX_LEN + 1];
  size_t n;
} adopt_batch;

static int adopt_flush(kvt_tier *t, adopt_batch *b, int64_t *adopted) {
  int rc = b->n ? kvti_index_put_many(t->idx, b->a, b->n) : 0;
  if (rc == 0) {
    *adopted += (int64_t)b->n;
    for (size_t i = 0; i < b->n; i++)
      kvti_log(t, KVT_LOG_INFO, "kvtier: reconcile: adopted data/%s", b->h[i]);
  }
  for (size_t i = 0; i < b->n; i++)
    kvti_free(b->p[i].tokens);
  b->n = 0;
  return rc;
}

int64_t kvti_tier_adopt_locked(kvt_tier *t, char *const *names, size_t n,
                               int64_t *quarantined) {
  *quarantined = 0;
  adopt_batch *b = kvti_calloc(1, sizeof *b);
  if (!b)
    return KVT_ERR_NOMEM();
  int64_t adopted = 0;
  int rc = 0;
  for (size_t i = 0; rc == 0 && i < n; i++) {
    const char *h = names[i];
    kvt_entry_info info;
    if (kvti_index_find_hash(&info, t->idx, h) != KVT_ENOTFOUND)
      continue; /* indexed (or no longer listable): not ours to adopt */
    kvti_entry_probe_info *p = &b->p[b->n];
    int r = kvti_backend_local_probe(t->be, h, p);
    if (r == 0 && p->chain.present) {
      /* A tail of the chunked store: adopted only with its chain record. */
      int a = kvti_tier_chunks_adopt(t, h, &p->chain);
      if (a <= 0) {
        kvti_free(p->tokens);
        p->tokens = NULL;
        if (a == 0) {
          kvti_log(t, KVT_LOG_WARN,
                   "kvtier: reconcile: data/%s is the tail of a chained "
                   "entry and this tier does not use chunks; left in place",
                   h);
          continue;
        }
        r = a < 0 && a != KVT_ECORRUPT ? a : KVT_ECORRUPT;
      }
    }
    if (r == 0) {
      kvti_index_put_args *a = &b->a[b->n];
      memset(a, 0, sizeof *a);
      a->tokens = p->tokens;
      a->n = p->n_tokens;
      memcpy(b->h[b->n], h, KVT_HASH_HEX_LEN + 1);
      a->hash = b->h[b->n];
      a->memory_bytes = p->memory_bytes;
      a->disk_bytes = p->disk_bytes;
      a->storage_mode = p->storage_mode;
      a->created_at = p->mtime;
      a->salt = &p->salt; /* its row keyed as the files are */
      if (++b->n == ADOPT_BATCH)
        rc = adopt_flush(t, b, &adopted);
    } else if (r == KVT_ECORRUPT || r == KVT_EUNSUPPORTED ||
               (r == KVT_ENOTFOUND && t->be->ops->present(t->be, h) == 1)) {
      /* Invalid (a directory without a manifest included): kept for
       * inspection, never deleted for lack of a row. */
      char msg[512];
      snprintf(msg, sizeof msg, "%s", kvt_last_error());
      kvti_stripe_wrlock(&t->stripes, h);
      int q = t->be->ops->quarantine(t->be, h, t->opts.quarantine_max);
      kvti_stripe_unlock(&t->stripes, h);
      KVTI_STAT_ADD(&t->stats, quarantined, 1);
      (*quarantined)++;
      kvti_log(t, KVT_LOG_WARN,
               "kvtier: reconcile: data/%s has no row and is invalid (%s); %s",
               h, msg, q == 0 ? "quarantined" : "quarantine failed");
    } else {
      /* Not readable now (EIO, ENOMEM, gone): left alone for next time. */
      kvti_log(t, KVT_LOG_WARN,
               "kvtier: reconcile: data/%s has no row and cannot be read (%s); "
               "left in place",
               h, kvt_last_error());
      kvt_clear_error();
    }
  }
  if (rc == 0)
    rc = adopt_flush(t, b, &adopted);
  for (size_t i = 0; i < b->n; i++)
    kvti_free(b->p[i].tokens);
  kvti_free(b);
  return rc ? rc : adopted;
}
