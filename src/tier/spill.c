/*
 * spill.c - the public spill calls (kvt_tier_spill*, kvt_tier_spill_prefix*):
 * every spill passes the admission decision (admission.h) first, which keeps
 * it whole, keeps only a prefix of it, or declines it (counted by reason),
 * then it is queued (writer.c). A prefix spill serves models with layers that
 * cannot be cut on the token axis (arrays/Mamba state, rotating KV): they get
 * prefix hits only at lengths where their whole state was stored, so an
 * engine that captured that state at token m spills it as the entry of
 * tokens[0, m) together with its live KV layers, whose first m rows are cut
 * out here (in chunked mode those rows are the chunks the longer spill
 * shares, so only the state and the record are written). Token i stays KV
 * row i: a KV layer whose offset is below m cannot give m rows and is refused.
 */
#include "tier/tier.h"
#include "tier/admission.h"

#include "base/error.h"
#include "base/io.h"
#include "format/dtype.h"
#include "format/layer.h"

#include <string.h>

static int cut(kvt_layer *out, const kvt_layer *l, uint64_t m) {
  *out = *l;
  out->tensors =
      kvti_calloc(l->num_tensors ? l->num_tensors : 1, sizeof *out->tensors);
  if (!out->tensors)
    return KVT_ERR_NOMEM();
  for (uint32_t j = 0; j < l->num_tensors; j++) {
    const kvt_tensor *s = &l->tensors[j];
    kvt_tensor *d = &out->tensors[j];
    kvti_tensor_cut_desc(d, s, m);
    if (d->nbytes && !(d->data = kvti_malloc((size_t)d->nbytes)))
      return KVT_ERR_NOMEM();
    if (d->nbytes)
      kvti_tensor_copy_rows(d, 0, s, 0, m);
  }
  out->offset = (int64_t)m;
  return 0;
}

static void free_cut(kvt_layer *l) {
  for (uint32_t j = 0; l->tensors && j < l->num_tensors; j++)
    kvti_free(l->tensors[j].data);
  kvti_free(l->tensors);
}

static int spill_prefix_noadmit(kvt_tier *t, const int32_t *tokens,
                                size_t n_keep, const kvt_layer *layers,
                                uint32_t n_layers, uint64_t memory_bytes,
                                const kvt_call_opts *co, uint64_t reserved);

/* 1 when the spill would be accepted as far as its arguments go (a writable
 * open tier, well-formed layers): only such a spill may be declined with 0;
 * any other is left to the enqueue, which refuses and counts it. */
static int spill_acceptable(kvt_tier *t, const kvt_layer *layers, uint32_t n) {
  if (t->readonly || kvti_tier_enter(t) != 0)
    return 0;
  kvti_tier_leave(t);
  for (uint32_t i = 0; i < n; i++)
    if (kvti_layer_validate(&layers[i], i, 1) != 0 ||
        kvti_layer_check_rows(&layers[i], i, 0, UINT64_MAX, KVT_EINVAL,
                              "spill") != 0)
      return 0;
  return 1;
}

/* A spill the write budget can never let in: counted apart, and logged the
 * first time on this handle (the budget or the spills need changing; a log
 * line per spill would flood). */
static void oversize_declined(kvt_tier *t, size_t n_tokens, uint64_t bound) {
  KVTI_STAT_ADD(&t->stats, admission_declined_oversize, 1);
  if (atomic_exchange(&t->admit->oversize_logged, 1))
    return;
  kvti_log(t, KVT_LOG_WARN,
           "kvtier: a spill of %zu tokens can write up to %llu bytes, more "
           "than the write budget's bucket holds (%.0f bytes, an hour of the "
           "budget): such spills are never written under this budget "
           "(counted in admission_declined_oversize)",
           n_tokens, (unsigned long long)bound, t->admit->bucket.cap);
}

static int spill_admitted(kvt_tier *t, const int32_t *tokens, size_t n_tokens,
                          const kvt_layer *layers, uint32_t n_layers,
                          uint64_t memory_bytes, int copy,
                          void (*release)(void *), void *release_ctx,
                          const kvt_call_opts *co) {
  kvti_salt salt;
  if (t && t->opts.clock_fn) /* the spill's time, for its recency */
    kvti_tier_clock(t);
  /* Anything the enqueue would refuse is left to it (it counts refusals);
   * so is a tier without a record (read-only) or a bad salt. */
  if (!t || !t->admit || (!tokens && n_tokens) || (!layers && n_layers) ||
      kvti_call_salt(&salt, t, co) != 0) {
    kvt_clear_error();
    return kvti_spill_enqueue(t, tokens, n_tokens, layers, n_layers,
                              memory_bytes, copy, release, release_ctx, co, 0);
  }
  int verdict = KVTI_ADMIT_WHOLE;
  size_t keep = n_tokens;
  /* Under a budget a spill reserves the most it can write (a cut one the
   * whole spill's: it writes less), so spills queued together cannot carry
   * the bucket over; 0 when that cannot be told (then the bucket's top). */
  kvti_spill_bound parts;
  uint64_t bound = t->admit->bucket.per_day > 0 &&
                           kvti_admit_bound_of(&parts, t, tokens, n_tokens,
                                               layers, n_layers, &salt)
                       ? kvti_admit_bound_at(&parts, n_tokens)
                       : 0;
  uint64_t reserved = 0;
  double now = kvti_admit_now(t);
  kvt_stats cs;
  kvti_stats_copy(&cs, &t->stats);
  if (kvti_admit_decide(t->admit, &verdict, &keep, tokens, n_tokens,
                        kvti_seen_seed(&salt),
                        kvti_admit_cuttable(layers, n_layers), cs.evictions > 0,
                        now, cs.spill_bytes, bound, &reserved) != 0)
    kvt_clear_error(); /* verdict WHOLE: the record's failure loses nothing */
  kvt_stats g;
  memset(&g, 0, sizeof g);
  kvti_admit_gauges(t->admit, &g, now, cs.spill_bytes);
  kvti_stats_set_budget_gauges(&t->stats, &g); /* the live file follows */
  if (verdict != KVTI_ADMIT_WHOLE && !spill_acceptable(t, layers, n_layers)) {
    kvt_clear_error();
    verdict = KVTI_ADMIT_WHOLE; /* refused below, with its reason */
  }
  if (verdict == KVTI_ADMIT_NOROOM && !bound) /* no parts to cut by */
    verdict = KVTI_ADMIT_BUDGET;
  if (verdict == KVTI_ADMIT_NOROOM) {
    /* The part of it that fits the budget's room, or nothing. */
    int never = 0;
    keep = kvti_admit_fit(t, &parts, keep, &reserved, &never);
    verdict = keep == n_tokens ? KVTI_ADMIT_WHOLE
              : keep           ? KVTI_ADMIT_TRUNCATED
              : never          ? KVTI_ADMIT_OVERSIZE
                               : KVTI_ADMIT_BUDGET;
  }
  switch (verdict) {
  case KVTI_ADMIT_WHOLE: {
    int rc =
        kvti_spill_enqueue(t, tokens, n_tokens, layers, n_layers, memory_bytes,
                           copy, release, release_ctx, co, reserved);
    if (rc == 0) /* a refusal is counted by its reason instead */
      KVTI_STAT_ADD(&t->stats, admission_admitted, 1);
    else /* nothing queued holds the reservation */
      kvti_admit_release(t, reserved);
    return rc;
  }
  case KVTI_ADMIT_TRUNCATED: {
    KVTI_STAT_ADD(&t->stats, admission_truncated, 1);
    KVTI_STAT_ADD(&t->stats, admission_tokens_declined, n_tokens - keep);
    /* The engine's RAM estimate, in proportion to what is kept. */
    uint64_t mem =
        (uint64_t)((double)memory_bytes * (double)keep / (double)n_tokens);
    int rc = spill_prefix_noadmit(t, tokens, keep, layers, n_layers, mem, co,
                                  reserved);
    if (rc != 0)
      kvti_admit_release(t, reserved);
    if (!copy && release) /* the prefix was copied (or refused) */
      release(release_ctx);
    return rc;
  }
  default:
    if (verdict == KVTI_ADMIT_BUDGET || verdict == KVTI_ADMIT_OVERSIZE)
      KVTI_STAT_ADD(&t->stats, admission_declined_budget, 1);
    else
      KVTI_STAT_ADD(&t->stats, admission_declined_unseen, 1);
    if (verdict == KVTI_ADMIT_OVERSIZE)
      oversize_declined(t, n_tokens, bound);
    KVTI_STAT_ADD(&t->stats, admission_tokens_declined, n_tokens);
    kvti_admit_release(t, reserved); /* none: nothing is written */
    if (!copy && release)
      release(release_ctx);
    return 0;
  }
}

int kvt_tier_spill_prefix(kvt_tier *t, const int32_t *tokens, size_t n_keep,
                          const kvt_layer *layers, uint32_t n_layers,
                          uint64_t memory_bytes) {
  return kvt_tier_spill_prefix_ex(t, tokens, n_keep, layers, n_layers,
                                  memory_bytes, NULL);
}

/* admit: the cut spill goes through admission as any spill (the public
 * call); else it is queued as it is (admission already cut it). */
static int spill_prefix(kvt_tier *t, const int32_t *tokens, size_t n_keep,
                        const kvt_layer *layers, uint32_t n_layers,
                        uint64_t memory_bytes, const kvt_call_opts *co,
                        int admit, uint64_t reserved) {
  if (!t || (!tokens && n_keep) || (!layers && n_layers))
    return KVT_ERR(KVT_EINVAL, "kvt_tier_spill_prefix: NULL argument");
  if (n_keep == 0 || n_layers > KVTI_MAX_LAYERS) {
    /* Counted like the spill's own refusals (kvt_tier_spill_ex below). */
    kvti_stats_refused(&t->stats, KVT_EINVAL);
    return n_keep == 0
               ? KVT_ERR(KVT_EINVAL, "kvt_tier_spill_prefix: n_keep is 0")
               : KVT_ERR(KVT_EINVAL, "kvt_tier_spill_prefix: too many layers");
  }
  kvt_layer *ls = kvti_calloc(n_layers ? n_layers : 1, sizeof *ls);
  uint8_t *own = kvti_calloc(n_layers ? n_layers : 1, 1);
  int rc = ls && own ? 0 : KVT_ERR_NOMEM();
  for (uint32_t i = 0; rc == 0 && i < n_layers; i++) {
    const kvt_layer *l = &layers[i];
    /* The same checks as a spill first: nothing is read from a bad layer. */
    if ((rc = kvti_layer_validate(l, i, 1)) != 0 ||
        (rc = kvti_layer_check_rows(l, i, 0, UINT64_MAX, KVT_EINVAL,
                                    "spill_prefix")) != 0)
      break;
    if (l->kind != KVT_LAYER_KV && l->kind != KVT_LAYER_QUANTIZED_KV) {
      ls[i] = *l; /* the state as of n_keep, as given */
      continue;
    }
    uint64_t valid = l->offset == KVT_ABSENT
                         ? (uint64_t)l->tensors[0].shape[l->tensors[0].ndim - 2]
                         : (uint64_t)l->offset;
    if (valid < n_keep) {
      rc = KVT_ERR(KVT_EINVAL,
                   "kvt_tier_spill_prefix: layer %u holds KV of %llu tokens, "
                   "fewer than the %zu to store",
                   i, (unsigned long long)valid, n_keep);
      break;
    }
    own[i] = 1;
    rc = cut(&ls[i], l, n_keep);
  }
  if (rc == 0 && admit)
    rc = spill_admitted(t, tokens, n_keep, ls, n_layers, memory_bytes, 1, NULL,
                        NULL, co);
  else if (rc == 0)
    rc = kvti_spill_enqueue(t, tokens, n_keep, ls, n_layers, memory_bytes, 1,
                            NULL, NULL, co, reserved);
  else /* the spill calls count their own */
    kvti_stats_refused(&t->stats, rc);
  for (uint32_t i = 0; ls && own && i < n_layers; i++)
    if (own[i])
      free_cut(&ls[i]);
  kvti_free(ls);
  kvti_free(own);
  return rc;
}

int kvt_tier_spill_prefix_ex(kvt_tier *t, const int32_t *tokens, size_t n_keep,
                             const kvt_layer *layers, uint32_t n_layers,
                             uint64_t memory_bytes, const kvt_call_opts *co) {
  return spill_prefix(t, tokens, n_keep, layers, n_layers, memory_bytes, co, 1,
                      0);
}

static int spill_prefix_noadmit(kvt_tier *t, const int32_t *tokens,
                                size_t n_keep, const kvt_layer *layers,
                                uint32_t n_layers, uint64_t memory_bytes,
                                const kvt_call_opts *co, uint64_t reserved) {
  return spill_prefix(t, tokens, n_keep, layers, n_layers, memory_bytes, co, 0,
                      reserved);
}

int kvt_tier_spill(kvt_tier *t, const int32_t *tokens, size_t n_tokens,
                   const kvt_layer *layers, uint32_t n_layers,
                   uint64_t memory_bytes) {
  return spill_admitted(t, tokens, n_tokens, layers, n_layers, memory_bytes, 1,
                        NULL, NULL, NULL);
}

int kvt_tier_spill_ex(kvt_tier *t, const int32_t *tokens, size_t n_tokens,
                      const kvt_layer *layers, uint32_t n_layers,
                      uint64_t memory_bytes, const kvt_call_opts *co) {
  return spill_admitted(t, tokens, n_tokens, layers, n_layers, memory_bytes, 1,
                        NULL, NULL, co);
}

int kvt_tier_spill_nocopy_ex(kvt_tier *t, const int32_t *tokens,
                             size_t n_tokens, const kvt_layer *layers,
                             uint32_t n_layers, uint64_t memory_bytes,
                             void (*release)(void *ctx), void *release_ctx,
                             const kvt_call_opts *co) {
  return spill_admitted(t, tokens, n_tokens, layers, n_layers, memory_bytes, 0,
                        release, release_ctx, co);
}

int kvt_tier_spill_nocopy(kvt_tier *t, const int32_t *tokens, size_t n_tokens,
                          const kvt_layer *layers, uint32_t n_layers,
                          uint64_t memory_bytes, void (*release)(void *ctx),
                          void *release_ctx) {
  return spill_admitted(t, tokens, n_tokens, layers, n_layers, memory_bytes, 0,
                        release, release_ctx, NULL);
}
