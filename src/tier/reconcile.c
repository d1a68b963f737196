/*
 * reconcile.c - the reference's reconcile (index rows whose files are missing,
 * data directories with no row) plus stale temporaries left by a crashed
 * write, as kvt_tier_reconcile and at open. Names come from the backend's
 * listing and rows from the index; each repair takes the entry's exclusive
 * stripe, with mut_mu held, so no write or reader is in progress on it.
 */
#include "tier/tier.h"
#include "base/error.h"
#include "base/io.h"
#include "index/index.h"

#include <string.h>

/* ------------------------------------------------------------------------ */
/* Reconcile                                                                */
/* ------------------------------------------------------------------------ */

/* A growing list of names (hashes or data/ names). */
typedef struct strv {
  char **v;
  size_t n, cap;
  int oom;
} strv;

static int strv_push(strv *l, const char *s) {
  if (l->n == l->cap) {
    size_t nc = l->cap ? l->cap * 2 : 64;
    char **p = kvti_realloc(l->v, nc * sizeof *p);
    if (!p) {
      l->oom = 1;
      return 1;
    }
    l->v = p;
    l->cap = nc;
  }
  char *d = kvti_strdup(s);
  if (!d) {
    l->oom = 1;
    return 1;
  }
  l->v[l->n++] = d;
  return 0;
}

static void strv_free(strv *l) {
  for (size_t i = 0; i < l->n; i++)
    kvti_free(l->v[i]);
  kvti_free(l->v);
  memset(l, 0, sizeof *l);
}

static int collect_row(void *ctx, const kvt_entry_info *info) {
  return strv_push(ctx, info->token_hash);
}

typedef struct name_acc {
  strv entries, tmps;
} name_acc;

static int collect_name(void *ctx, const char *name, int kind) {
  name_acc *a = ctx;
  if (kind == KVTI_BK_ENTRY)
    return strv_push(&a->entries, name);
  if (kind == KVTI_BK_TMP)
    return strv_push(&a->tmps, name);
  return 0; /* anything else is not ours: leave it */
}

/* Lists the backend's names into *a (entries and temporaries). Returns 0 or a
 * negative code; *a must be freed with name_acc_free either way. */
static int list_names(kvt_tier *t, name_acc *a) {
  memset(a, 0, sizeof *a);
  int rc = t->be->ops->list(t->be, collect_name, a);
  if (rc == 0 && (a->entries.oom || a->tmps.oom))
    rc = KVT_ERR_NOMEM();
  return rc;
}

static void name_acc_free(name_acc *a) {
  strv_free(&a->entries);
  strv_free(&a->tmps);
}

/* Purges every temporary in tmps; returns how many were removed. */
static int64_t purge_names(kvt_tier *t, const strv *tmps, const char *why) {
  int64_t n = 0;
  for (size_t i = 0; i < tmps->n; i++) {
    if (t->be->ops->purge(t->be, tmps->v[i]) == 0) {
      n++;
      kvti_log(t, KVT_LOG_INFO, "kvtier: %s data/%s", why, tmps->v[i]);
    }
  }
  return n;
}

/* Removes stale *.tmp in data/. Caller holds mut_mu (or no writer exists yet),
 * so no write is in progress and every tmp is stale. Returns the count or a
 * negative code. */
int64_t kvti_tier_purge_tmps(kvt_tier *t) {
  name_acc a;
  int rc = list_names(t, &a);
  int64_t n = rc == 0 ? purge_names(t, &a.tmps, "removed stale temporary") : 0;
  name_acc_free(&a);
  return rc < 0 ? rc : n;
}

/* The reference's reconcile, plus stale temporaries. Caller holds mut_mu. */
int64_t kvti_tier_reconcile_locked(kvt_tier *t) {
  int64_t cleaned = 0;
  strv rows = {0};
  int rc = kvti_index_foreach(t->idx, collect_row, &rows);
  if (rc == 0 && rows.oom)
    rc = KVT_ERR_NOMEM();
  /* Phase 1: rows whose directory or manifest is missing. */
  for (size_t i = 0; rc == 0 && i < rows.n; i++) {
    const char *h = rows.v[i];
    kvti_stripe_wrlock(&t->stripes, h);
    int ex = t->be->ops->exists(t->be, h);
    if (ex == 0 && kvti_index_remove_hash(t->idx, h) == 0) {
      cleaned++;
      kvti_log(t, KVT_LOG_INFO,
               "kvtier: reconcile: removed index row %.16s (files missing)", h);
    }
    kvti_stripe_unlock(&t->stripes, h);
  }
  strv_free(&rows);
  if (rc != 0)
    return rc;
  /* Phase 2: data directories with no row, and stale temporaries. */
  name_acc a;
  rc = list_names(t, &a);
  for (size_t i = 0; rc == 0 && i < a.entries.n; i++) {
    const char *h = a.entries.v[i];
    kvt_entry_info info;
    kvti_stripe_wrlock(&t->stripes, h);
    if (kvti_index_find_hash(&info, t->idx, h) == KVT_ENOTFOUND &&
        t->be->ops->remove(t->be, h) == 0) {
      cleaned++;
      kvti_log(t, KVT_LOG_INFO,
               "kvtier: reconcile: removed data/%s (no index row)", h);
    }
    kvti_stripe_unlock(&t->stripes, h);
  }
  if (rc == 0)
    cleaned += purge_names(t, &a.tmps, "reconcile: removed stale");
  name_acc_free(&a);
  if (rc != 0)
    return rc;
  if (cleaned > 0) {
    KVTI_STAT_ADD(&t->stats, reconciled, cleaned);
    kvti_log(t, KVT_LOG_INFO, "kvtier: reconciliation cleaned %lld entries",
             (long long)cleaned);
  }
  return cleaned;
}

int64_t kvt_tier_reconcile(kvt_tier *t) {
  if (!t)
    return KVT_ERR(KVT_EINVAL, "tier is NULL");
  int rc = kvti_tier_enter(t);
  if (rc != 0)
    return rc;
  int64_t r;
  if (t->readonly) {
    r = KVT_ERR(KVT_EINVAL,
                "reconcile needs a writable tier (opened read-only)");
  } else {
    pthread_mutex_lock(&t->mut_mu);
    r = kvti_tier_reconcile_locked(t);
    pthread_mutex_unlock(&t->mut_mu);
  }
  kvti_tier_leave(t);
  return r;
}
