/*
 * admission.c - admission and the write budget (admission.h): the record of
 * prefixes seen, the leaky bucket and the decision (spill.c applies it before
 * anything is copied or queued). Most spills of a
 * serving engine are prompts nobody sends again; a segment seen twice is a
 * prefix that is shared, and the segments after a prefix a lookup found
 * stored belong to a conversation that is continuing - those are the bytes
 * worth writing to an SSD whose endurance is finite.
 */
#include "tier/admission.h"
#include "base/clock.h"
#include "base/error.h"
#include "base/hash.h"
#include "base/io.h"
#include "format/chainrec.h"
#include "format/chunk.h"
#include "format/entry.h"
#include "format/layer.h"
#include "tier/chunks.h"
#include "tier/tier.h"

#include <math.h>
#include <string.h>

/* ------------------------------------------------------------------------ */
/* The record                                                               */
/* ------------------------------------------------------------------------ */

#define SEEN_FLAGS 7ull
#define SEEN_CLASS_SHIFT 3
#define SEEN_LOW 255ull /* flags (bits 0-2) and class (bits 3-7) */
#define SEEN_CLASS(v) ((unsigned)(((v) >> SEEN_CLASS_SHIFT) & 31u))
#define DEFAULT_RECORD_BYTES ((uint64_t)4 << 20)

static uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

int kvti_seen_init(kvti_seen *s, uint64_t bytes) {
  memset(s, 0, sizeof *s);
  /* Each set costs WAYS slots and one cursor byte. */
  uint64_t per_set = KVTI_SEEN_WAYS * sizeof(uint64_t) + 1;
  size_t nsets = 1;
  while ((uint64_t)nsets * 2 * per_set <= bytes)
    nsets *= 2;
  s->slot = kvti_calloc(nsets * KVTI_SEEN_WAYS, sizeof *s->slot);
  s->next = kvti_calloc(nsets, 1);
  if (!s->slot || !s->next) {
    kvti_seen_destroy(s);
    return KVT_ERR_NOMEM();
  }
  s->nsets = nsets;
  return 0;
}

void kvti_seen_destroy(kvti_seen *s) {
  kvti_free(s->slot);
  kvti_free(s->next);
  memset(s, 0, sizeof *s);
}

/* The stored form of fp: its low bits cleared, never 0 (0 marks empty). */
static uint64_t seen_key(uint64_t fp) {
  uint64_t k = fp & ~SEEN_LOW;
  return k ? k : SEEN_LOW + 1;
}

static uint64_t *seen_set(const kvti_seen *s, uint64_t key) {
  return s->slot + (size_t)(mix64(key) & (s->nsets - 1)) * KVTI_SEEN_WAYS;
}

/* The slot remembering fp, or NULL. */
static uint64_t *seen_find(const kvti_seen *s, uint64_t fp) {
  if (!s->nsets)
    return NULL;
  uint64_t key = seen_key(fp);
  uint64_t *set = seen_set(s, key);
  for (unsigned w = 0; w < KVTI_SEEN_WAYS; w++)
    if ((set[w] & ~SEEN_LOW) == key)
      return &set[w];
  return NULL;
}

unsigned kvti_seen_get(const kvti_seen *s, uint64_t fp) {
  const uint64_t *v = seen_find(s, fp);
  return v ? (unsigned)(*v & SEEN_FLAGS) : 0;
}

unsigned kvti_seen_class(const kvti_seen *s, uint64_t fp) {
  const uint64_t *v = seen_find(s, fp);
  unsigned c = v ? SEEN_CLASS(*v) : KVTI_LEN_UNKNOWN;
  return c < KVTI_LEN_UNKNOWN ? c : KVTI_LEN_UNKNOWN;
}

void kvti_seen_put_class(kvti_seen *s, uint64_t fp, unsigned flags,
                         unsigned cls) {
  if (!s->nsets)
    return;
  if (cls > KVTI_LEN_UNKNOWN)
    cls = KVTI_LEN_UNKNOWN;
  uint64_t *v = seen_find(s, fp);
  if (v) {
    *v |= flags & SEEN_FLAGS;
    if (SEEN_CLASS(*v) >= KVTI_LEN_UNKNOWN)
      *v = (*v & ~(SEEN_LOW & ~SEEN_FLAGS)) |
           ((uint64_t)cls << SEEN_CLASS_SHIFT);
    return;
  }
  uint64_t key = seen_key(fp);
  uint64_t *set = seen_set(s, key);
  size_t si = (size_t)(set - s->slot) / KVTI_SEEN_WAYS;
  unsigned w = s->next[si] % KVTI_SEEN_WAYS;
  set[w] = key | ((uint64_t)cls << SEEN_CLASS_SHIFT) | (flags & SEEN_FLAGS);
  s->next[si] = (uint8_t)((w + 1) % KVTI_SEEN_WAYS);
}

void kvti_seen_put(kvti_seen *s, uint64_t fp, unsigned flags) {
  kvti_seen_put_class(s, fp, flags, KVTI_LEN_UNKNOWN);
}

void kvti_seen_prints(uint64_t *fp, const int32_t *tokens, size_t n,
                      uint32_t seg, uint64_t seed) {
  uint64_t h = mix64(seed ^ 0x6B76746965722061ull);
  for (size_t i = 0, k = 0; i < n; i += seg, k++) {
    size_t len = n - i < seg ? n - i : seg;
    /* Chained: each print covers every token before its segment's end, and
     * the length tells a short last segment from a full one. */
    h = mix64(h ^ kvti_xxh3(tokens + i, len * sizeof *tokens)) ^ (uint64_t)len;
    fp[k] = h;
  }
}

uint64_t kvti_seen_seed(const kvti_salt *salt) {
  if (!salt || !salt->has)
    return 0;
  uint64_t s;
  memcpy(&s, salt->d, sizeof s);
  return s | 1; /* never the unsalted seed */
}

/* ------------------------------------------------------------------------ */
/* The bucket                                                               */
/* ------------------------------------------------------------------------ */

#define DAY_S 86400.0

void kvti_bucket_init(kvti_bucket *b, double per_day) {
  memset(b, 0, sizeof *b);
  b->per_day = per_day > 0 ? per_day : 0;
  b->cap = b->per_day / 24.0;
}

void kvti_bucket_update(kvti_bucket *b, double now, uint64_t total) {
  if (!b->started) {
    b->started = 1;
    b->last_t = b->t0 = now;
    b->last_total = b->total0 = b->day_base = total;
    b->day = (int64_t)floor(now / DAY_S);
    return;
  }
  if (now < b->last_t)
    now = b->last_t;
  if (total < b->last_total)
    total = b->last_total; /* the counter only grows: an older reading */
  if (total > b->last_total) {
    double step = (double)(total - b->last_total);
    b->level += step;
    if (step > b->max_step)
      b->max_step = step;
  }
  b->level -= b->per_day / DAY_S * (now - b->last_t);
  if (b->level < 0)
    b->level = 0;
  int64_t day = (int64_t)floor(now / DAY_S);
  if (day != b->day) {
    /* What this update added is counted in the new day: its time is now. */
    b->day = day;
    b->day_base = b->last_total;
  }
  b->last_t = now;
  b->last_total = total;
}

double kvti_bucket_top(const kvti_bucket *b) {
  double room = b->max_step < b->cap / 8 ? b->max_step : b->cap / 8;
  return b->cap - room;
}

uint64_t kvti_bucket_left(const kvti_bucket *b) {
  return b->level < b->cap ? (uint64_t)(b->cap - b->level) : 0;
}

uint64_t kvti_bucket_today(const kvti_bucket *b) {
  return b->last_total - b->day_base;
}

/* ------------------------------------------------------------------------ */
/* The decision                                                             */
/* ------------------------------------------------------------------------ */

double kvti_admit_budget_per_day(const kvt_options *o) {
  if (o->write_budget_bytes_per_day)
    return (double)o->write_budget_bytes_per_day;
  if (o->write_budget_tbw > 0 && o->write_budget_years > 0)
    return o->write_budget_tbw * 1e12 / (o->write_budget_years * 365.25);
  return 0;
}

int kvti_admit_needed(const kvt_options *o) {
  return o->admission_policy != KVT_ADMIT_WRITE_ALL ||
         kvti_admit_budget_per_day(o) > 0;
}

int kvti_admit_init(kvti_admit *a, const kvt_options *o) {
  memset(a, 0, sizeof *a);
  a->policy = o->admission_policy;
  a->seg = o->chunk_tokens ? o->chunk_tokens : 256;
  a->tbw_bytes = o->write_budget_tbw > 0 ? o->write_budget_tbw * 1e12 : 0;
  kvti_bucket_init(&a->bucket, kvti_admit_budget_per_day(o));
  if (kvti_admit_needed(o)) {
    uint64_t bytes = o->admission_memory_bytes ? o->admission_memory_bytes
                                               : DEFAULT_RECORD_BYTES;
    int rc = kvti_seen_init(&a->seen, bytes);
    if (rc != 0)
      return rc;
  }
  pthread_mutex_init(&a->mu, NULL);
  return 0;
}

void kvti_admit_destroy(kvti_admit *a) {
  kvti_seen_destroy(&a->seen);
  pthread_mutex_destroy(&a->mu);
}

/* Ranks of a spill: what the budget's soft zone lets through. */
enum { RANK_NEW = 0, RANK_SEEN = 1, RANK_REUSED = 2 };

/* Spills a class needs before its own rate outweighs the mean. */
#define VALUE_PRIOR 8.0
/* A class alone is the mean: rounding must not make it worth more. */
#define WORTH_EPS 1e-9

static void values_locked(const kvti_admit *a,
                          double value[KVTI_LEN_CLASSES + 1]) {
  double rr = 0, st = 0;
  for (unsigned c = 0; c <= KVTI_LEN_UNKNOWN; c++) {
    rr += (double)a->rereads[c];
    st += (double)a->starts[c];
  }
  double mean = st > 0 ? rr / st : 0;
  for (unsigned c = 0; c < KVTI_LEN_CLASSES; c++)
    value[c] = ((double)a->rereads[c] + VALUE_PRIOR * mean) /
               ((double)a->starts[c] + VALUE_PRIOR);
  value[KVTI_LEN_UNKNOWN] = mean;
}

void kvti_admit_values(kvti_admit *a, double value[KVTI_LEN_CLASSES + 1]) {
  pthread_mutex_lock(&a->mu);
  values_locked(a, value);
  pthread_mutex_unlock(&a->mu);
}

int kvti_admit_sampled(uint64_t fp) {
  return (mix64(fp ^ 0x73616D706C65ull) & 7) == 0;
}

int kvti_admit_decide(kvti_admit *a, int *verdict, size_t *keep,
                      const int32_t *tokens, size_t n, uint64_t seed,
                      int cuttable, int pressure, double now, uint64_t total,
                      uint64_t bound, uint64_t *reserved) {
  *verdict = KVTI_ADMIT_WHOLE;
  *keep = n;
  *reserved = 0;
  int budget = a->bucket.per_day > 0;
  pthread_mutex_lock(&a->mu);
  kvti_bucket_update(&a->bucket, now, total);
  pthread_mutex_unlock(&a->mu);
  if ((a->policy == KVT_ADMIT_WRITE_ALL && !budget) || n == 0)
    return 0;
  size_t nseg = (n + a->seg - 1) / a->seg;
  uint64_t *fp = kvti_malloc(nseg * sizeof *fp);
  if (!fp)
    return KVT_ERR_NOMEM();
  kvti_seen_prints(fp, tokens, n, a->seg, seed); /* no lock: pure */
  pthread_mutex_lock(&a->mu);
  /* run: leading segments seen before; came: leading segments a request
   * came back for (looked up after they were seen, or found stored). */
  size_t run = 0, came = 0;
  unsigned f;
  while (run < nseg && (f = kvti_seen_get(&a->seen, fp[run])) != 0) {
    if (came == run && (f & (KVTI_SEEN_ASKED | KVTI_SEEN_REUSED)))
      came++;
    run++;
  }
  /* A reused prefix: the spill starts with a segment a lookup found stored
   * and goes on past the stored part. */
  int reused = (kvti_seen_get(&a->seen, fp[0]) & KVTI_SEEN_REUSED) != 0;
  unsigned cls = kvti_len_class(n);
  /* Learning: this spill goes on from the deepest segment seen before,
   * which credits the class of the spill that first showed it; new
   * segments count as a start of this spill's class. */
  if (run > 0)
    a->rereads[kvti_seen_class(&a->seen, fp[run - 1])]++;
  if (run < nseg)
    a->starts[cls]++;
  for (size_t i = 0; i < nseg; i++)
    kvti_seen_put_class(&a->seen, fp[i], KVTI_SEEN_ONCE, cls);
  int rank = reused ? RANK_REUSED : run ? RANK_SEEN : RANK_NEW;
  size_t want = n; /* what the policy would write */
  if (a->policy == KVT_ADMIT_SECOND_SIGHTING)
    want = run == nseg ? n : run * (size_t)a->seg;
  /* Adaptive, under pressure: only segments a request came back for. A
   * segment seen in a spill alone is not one: vllm-mlx spills a prompt and
   * then the same prompt with its answer, and the second spill must not
   * pass for a second request. A request shows itself by its lookup
   * (KVTI_SEEN_ASKED, kvti_admit_note_ask). */
  if (a->policy == KVT_ADMIT_ADAPTIVE && pressure && !reused && came < nseg &&
      !kvti_admit_sampled(fp[came]))
    want = came * (size_t)a->seg;
  if (want < n && !cuttable)
    want = 0; /* whole or nothing */
  if (budget) {
    /* What is in the bucket or promised to it: the spills admitted and not
     * yet written count at their bound. */
    double level = a->bucket.level + (double)a->reserved;
    /* Nothing that would carry the bucket over (with a bound), or past the
     * top (without one); the soft zone (over half full) keeps reused
     * prefixes, spills of a class that has been worth more than the mean,
     * and of the others the leading segments a request came back for. */
    int over = bound ? 0 : level >= kvti_bucket_top(&a->bucket);
    double v[KVTI_LEN_CLASSES + 1];
    values_locked(a, v);
    int worth = v[cls] > v[KVTI_LEN_UNKNOWN] + WORTH_EPS;
    int soft = level >= a->bucket.cap / 2 && rank < RANK_REUSED && !worth;
    if (soft && !over && cuttable && came > 0) {
      /* Its leading segments were asked for by a request after an earlier
       * spill showed them: a prefix wanted twice, worth its bytes here too;
       * the rest waits for the same evidence. */
      if (want > came * (size_t)a->seg)
        want = came * (size_t)a->seg;
      soft = 0;
    }
    if (over || soft) {
      /* Told apart: waiting cannot help a spill that would not fit an empty
       * bucket. */
      *verdict = (double)bound > a->bucket.cap && !cuttable
                     ? KVTI_ADMIT_OVERSIZE
                     : KVTI_ADMIT_BUDGET;
      *keep = 0;
      pthread_mutex_unlock(&a->mu);
      kvti_free(fp);
      return 0;
    }
    if (want && cuttable && level + (double)bound > a->bucket.cap) {
      /* Room for a part: the caller cuts the spill to what fits. A prompt's
       * reused part is its beginning, so its prefix is worth its bytes
       * where the whole is not; refusing it instead let the short spills
       * that do fit take the room as it drained, and the long prompts that
       * carry the shared prefixes were never written. */
      *verdict = KVTI_ADMIT_NOROOM;
      *keep = want;
      pthread_mutex_unlock(&a->mu);
      kvti_free(fp);
      return 0;
    }
    if (bound && level + (double)bound > a->bucket.cap) {
      /* Whole or nothing, and no room (never, when it is over the bucket). */
      *verdict = (double)bound > a->bucket.cap ? KVTI_ADMIT_OVERSIZE
                                               : KVTI_ADMIT_BUDGET;
      *keep = 0;
      pthread_mutex_unlock(&a->mu);
      kvti_free(fp);
      return 0;
    }
    if (want) { /* what nothing is written for reserves nothing */
      a->reserved += bound;
      *reserved = bound;
    }
  }
  pthread_mutex_unlock(&a->mu);
  kvti_free(fp);
  *keep = want;
  *verdict = want == n ? KVTI_ADMIT_WHOLE
             : want    ? KVTI_ADMIT_TRUNCATED
                       : KVTI_ADMIT_UNSEEN;
  return 0;
}

/* The written counter's bytes into the bucket at its last update's time
 * (threads that must not call the clock): the next decision sees them even if
 * its own reading of the counter is older. a->mu held. */
static void catch_up_locked(kvti_bucket *b, uint64_t total) {
  if (b->started)
    kvti_bucket_update(b, b->last_t, total);
}

void kvti_admit_settle(kvti_admit *a, uint64_t reserved, uint64_t total) {
  if (!reserved)
    return;
  pthread_mutex_lock(&a->mu);
  catch_up_locked(&a->bucket, total);
  a->reserved = a->reserved > reserved ? a->reserved - reserved : 0;
  pthread_mutex_unlock(&a->mu);
}

/* Adds flags to the nseg segments of tokens[0, span) a lookup walked: all
 * of them, or (seen_only) the leading ones already remembered. A lost hint
 * (no memory) is not a failure of the lookup. */
static void mark(kvti_admit *a, const int32_t *tokens, size_t span, size_t nseg,
                 uint64_t seed, unsigned flags, int seen_only) {
  uint64_t *fp = kvti_malloc(nseg * sizeof *fp);
  if (!fp) {
    kvt_clear_error();
    return;
  }
  kvti_seen_prints(fp, tokens, span, a->seg, seed);
  pthread_mutex_lock(&a->mu);
  for (size_t i = 0; i < nseg && (!seen_only || kvti_seen_get(&a->seen, fp[i]));
       i++)
    kvti_seen_put(&a->seen, fp[i], flags);
  pthread_mutex_unlock(&a->mu);
  kvti_free(fp);
}

void kvti_admit_note_hit(kvti_admit *a, const int32_t *tokens, size_t m,
                         uint64_t seed) {
  if (!a->seen.nsets || m == 0)
    return;
  /* Only whole segments are stored prefixes a longer spill can extend. */
  size_t nseg = m / a->seg;
  if (nseg == 0)
    nseg = 1; /* a short entry is its own (only) segment */
  size_t span = m / a->seg ? nseg * a->seg : m;
  mark(a, tokens, span, nseg, seed, KVTI_SEEN_ONCE | KVTI_SEEN_REUSED, 0);
}

void kvti_admit_note_ask(kvti_admit *a, const int32_t *tokens, size_t n,
                         uint64_t seed) {
  if (!a->seen.nsets || n == 0 || a->policy != KVT_ADMIT_ADAPTIVE)
    return;
  /* Most prompts looked up are new: their first segment decides, before the
   * whole prompt is hashed on the engine's thread. */
  uint64_t first = 0; /* n > 0 and seg > 0: always written */
  kvti_seen_prints(&first, tokens, n < a->seg ? n : a->seg, a->seg, seed);
  pthread_mutex_lock(&a->mu);
  int seen = kvti_seen_get(&a->seen, first) != 0;
  pthread_mutex_unlock(&a->mu);
  if (!seen)
    return;
  /* Only what was seen before is asked for again; the rest stays unknown
   * (a lookup alone never makes a first sighting). */
  mark(a, tokens, n, (n + a->seg - 1) / a->seg, seed, KVTI_SEEN_ASKED, 1);
}

void kvti_admit_gauges(kvti_admit *a, kvt_stats *s, double now,
                       uint64_t total) {
  pthread_mutex_lock(&a->mu);
  kvti_bucket *b = &a->bucket;
  if (now < 0) /* no clock read: as of the last update's time */
    now = b->started ? b->last_t : 0;
  kvti_bucket_update(b, now, total);
  s->bytes_written_today = kvti_bucket_today(b);
  s->write_budget_bytes_per_day = (uint64_t)b->per_day;
  uint64_t left = b->per_day > 0 ? kvti_bucket_left(b) : 0;
  s->write_budget_left = left > a->reserved ? left - a->reserved : 0;
  double span = b->last_t - b->t0;
  uint64_t written = b->last_total - b->total0;
  s->ssd_lifetime_years =
      a->tbw_bytes > 0 && written > 0 && span > 0
          ? a->tbw_bytes / ((double)written / span * DAY_S * 365.25)
          : 0.0;
  pthread_mutex_unlock(&a->mu);
}

/* ------------------------------------------------------------------------ */
/* The tier's side                                                          */
/* ------------------------------------------------------------------------ */

double kvti_admit_now(kvt_tier *t) {
  return kvti_tier_clock(t);
}

void kvti_admit_lookup_hit(kvt_tier *t, const int32_t *tokens, size_t m,
                           const kvti_salt *salt) {
  if (t->admit && t->admit->seen.nsets)
    kvti_admit_note_hit(t->admit, tokens, m, kvti_seen_seed(salt));
}

void kvti_admit_lookup_ask(kvt_tier *t, const int32_t *tokens, size_t n,
                           const kvti_salt *salt) {
  if (t->admit && t->admit->seen.nsets)
    kvti_admit_note_ask(t->admit, tokens, n, kvti_seen_seed(salt));
}

/* Slack for what a manifest holds beyond what the bound's snapshot shows:
 * the salt, a chained tail's mark (hex keys and counts, fixed widths but for
 * the counts' digits). */
#define MANIFEST_SLACK 512u

/* The most one chunk file's header can take for a chunk of C tokens of these
 * layers (format/chunk.c's plan): the fixed part, the namespace, the tokens,
 * the layout descriptor, the checksum list's share not counted per 64 KiB of
 * data (one partial block) and the header's rounding (to 4096 before a data
 * section of 1 MiB or more, else to 64). */
static uint64_t chunk_head_bound(const kvt_layer *layers, uint32_t n_layers,
                                 uint64_t C, uint64_t ns_len) {
  uint64_t layout = 4, data = 0;
  for (uint32_t i = 0; i < n_layers; i++) {
    layout += 20;
    for (uint32_t j = 0; j < layers[i].num_tensors; j++) {
      const kvt_tensor *x = &layers[i].tensors[j];
      layout += 8 + 8ull * x->ndim + 16;
      if (x->ndim >= 2) {
        uint64_t outer, row;
        kvti_chunk_tensor_geom(x, &outer, &row);
        data += outer * row * C;
      }
    }
  }
  uint64_t align = data >= KVTI_CHUNK_ALIGN_MIN ? 4096 : 64;
  return KVTI_CHUNK_FIXED + ns_len + 4 + 4 * C + layout + 8 + 8 + align;
}

/* Bytes a token's rows take in a chunk file's data, summed over the layers
 * (the data chunk_head_bound counts per token). */
static uint64_t row_bytes(const kvt_layer *layers, uint32_t n_layers) {
  uint64_t b = 0;
  for (uint32_t i = 0; i < n_layers; i++)
    for (uint32_t j = 0; j < layers[i].num_tensors; j++) {
      const kvt_tensor *x = &layers[i].tensors[j];
      if (x->ndim >= 2) {
        uint64_t outer, row;
        kvti_chunk_tensor_geom(x, &outer, &row);
        b += outer * row;
      }
    }
  return b;
}

int kvti_admit_cuttable(const kvt_layer *layers, uint32_t n_layers) {
  for (uint32_t i = 0; i < n_layers; i++)
    if (layers[i].kind != KVT_LAYER_KV &&
        layers[i].kind != KVT_LAYER_QUANTIZED_KV)
      return 0;
  return 1;
}

int kvti_admit_bound_of(kvti_spill_bound *b, kvt_tier *t, const int32_t *tokens,
                        size_t n, const kvt_layer *layers, uint32_t n_layers,
                        const kvti_salt *salt) {
  memset(b, 0, sizeof *b);
  /* A snapshot that only points at the caller's layers: the entry's exact
   * size without copying or converting anything. */
  kvti_snapshot *s = NULL;
  if (kvti_snapshot_create(&s, tokens, n, layers, n_layers, 0, 0, NULL, NULL) !=
      0) {
    kvt_clear_error();
    return 0;
  }
  b->entry = kvti_snapshot_disk_bytes(s, t->opts.storage_mode);
  kvti_snapshot_free(s);
  if (!b->entry) {
    kvt_clear_error();
    return 0;
  }
  b->n = n;
  b->row = row_bytes(layers, n_layers);
  /* A cut entry's files (one a layer) hold fewer rows under headers no
   * larger; slack for a header rounded to another boundary. The writer's
   * recheck takes the cut's exact bound, so this only makes a cut likelier
   * to hold. */
  b->pad = 4096 * ((uint64_t)n_layers + 1);
  if (t->chunked && t->opts.chunk_tokens) {
    /* The namespace: model id and a salt's hex. */
    b->C = t->opts.chunk_tokens;
    b->ns = 8 + (t->opts.model_id ? strlen(t->opts.model_id) : 0) + 64;
    b->ns = (b->ns + 3) & ~(uint64_t)3;
    b->head = chunk_head_bound(layers, n_layers, b->C, b->ns);
    /* Only as true as the store when the bound is taken: the writer checks
     * it again before the write (kvti_admit_recheck). */
    b->stored = kvti_admit_cuttable(layers, n_layers)
                    ? kvti_tier_chunks_stored(t, tokens, n, salt)
                    : 0;
  }
  return 1;
}

uint64_t kvti_admit_bound_at(const kvti_spill_bound *b, size_t k) {
  uint64_t entry = b->entry;
  if (k < b->n) {
    uint64_t cut = b->row * (uint64_t)(b->n - k);
    entry = entry > cut ? entry - cut + b->pad : entry;
  }
  uint64_t bound = entry + MANIFEST_SLACK;
  if (b->C) {
    /* Chunks and tail split the rows the entry holds, so its data counts
     * once; each chunk adds its own header, and the tail may be a chain
     * record instead. */
    uint64_t chunks = ((uint64_t)k + b->C - 1) / b->C;
    bound += chunks * b->head + 8 * (b->entry / KVTI_BLK_DEFAULT + 1) +
             kvti_chainrec_size((size_t)b->ns, k);
    /* The chunks already stored are not written again (the store dedups
     * them by key): their rows and headers come off. The entry's bytes hold
     * every row in the chunk's own dtype (chunking is native only), so what
     * is left still covers the new chunks' data and the tail's files. */
    uint64_t m = b->stored < k ? b->stored : (uint64_t)k / b->C * b->C;
    uint64_t saved = m * b->row + (m / b->C) * b->head;
    if (saved < bound)
      bound -= saved;
  }
  return bound;
}

uint64_t kvti_admit_spill_bound(kvt_tier *t, const int32_t *tokens, size_t n,
                                const kvt_layer *layers, uint32_t n_layers,
                                const kvti_salt *salt) {
  kvti_spill_bound b;
  return kvti_admit_bound_of(&b, t, tokens, n, layers, n_layers, salt)
             ? kvti_admit_bound_at(&b, n)
             : 0;
}

/* Takes bytes from the bucket's room if they fit beside its level and the
 * reservations (the level as of the last update, with the counter's
 * latest bytes in: no clock read here). 1 when reserved. */
static int take_room(kvt_tier *t, uint64_t bytes) {
  kvt_stats cs;
  kvti_stats_copy(&cs, &t->stats);
  kvti_admit *a = t->admit;
  pthread_mutex_lock(&a->mu);
  catch_up_locked(&a->bucket, cs.spill_bytes);
  int fits =
      a->bucket.level + (double)a->reserved + (double)bytes <= a->bucket.cap;
  if (fits)
    a->reserved += bytes;
  pthread_mutex_unlock(&a->mu);
  return fits;
}

/* The room take_room would find now. */
static double room_now(kvt_tier *t) {
  kvt_stats cs;
  kvti_stats_copy(&cs, &t->stats);
  kvti_admit *a = t->admit;
  pthread_mutex_lock(&a->mu);
  catch_up_locked(&a->bucket, cs.spill_bytes);
  double room = a->bucket.cap - a->bucket.level - (double)a->reserved;
  pthread_mutex_unlock(&a->mu);
  return room;
}

size_t kvti_admit_fit(kvt_tier *t, const kvti_spill_bound *b, size_t keep,
                      uint64_t *reserved, int *never) {
  *reserved = 0;
  *never = 0;
  if (!t->admit || keep > b->n)
    return 0;
  size_t g = b->C ? (size_t)b->C : t->admit->seg;
  /* The shortest cut that adds to what is stored: over the whole bucket,
   * no part of this spill is ever written under the budget. */
  size_t first = ((size_t)b->stored / g + 1) * g;
  *never = first <= keep &&
           (double)kvti_admit_bound_at(b, first) > t->admit->bucket.cap;
  double room = room_now(t);
  /* The bound grows with k: the longest multiple of g that fits. */
  size_t lo = 0, hi = keep / g;
  while (lo < hi) {
    size_t mid = lo + (hi - lo + 1) / 2;
    if ((double)kvti_admit_bound_at(b, mid * g) <= room)
      lo = mid;
    else
      hi = mid - 1;
  }
  size_t k = lo * g;
  if (k == 0 || k <= b->stored) /* nothing this spill would add */
    return 0;
  uint64_t need = kvti_admit_bound_at(b, k);
  if (!take_room(t, need)) /* another spill took the room meanwhile */
    return 0;
  *reserved = need;
  return k;
}

int kvti_admit_recheck(kvt_tier *t, uint64_t *reserved,
                       const kvti_snapshot *s) {
  if (!*reserved || !t->admit)
    return 1;
  uint32_t L;
  size_t n;
  const kvt_layer *layers = kvti_snapshot_layers(s, &L);
  const int32_t *tokens = kvti_snapshot_tokens(s, &n);
  uint64_t now =
      kvti_admit_spill_bound(t, tokens, n, layers, L, kvti_snapshot_salt(s));
  if (!now || now <= *reserved)
    return 1;
  uint64_t extra = now - *reserved;
  if (!take_room(t, extra))
    return 0;
  *reserved += extra;
  return 1;
}

void kvti_admit_release(kvt_tier *t, uint64_t reserved) {
  if (!reserved || !t->admit)
    return;
  kvt_stats cs;
  kvti_stats_copy(&cs, &t->stats);
  kvti_admit_settle(t->admit, reserved, cs.spill_bytes);
  /* The budget left grew back: the live file follows (no clock read on the
   * writer's thread: as of the last decision's time). */
  kvt_stats g;
  memset(&g, 0, sizeof g);
  kvti_admit_gauges(t->admit, &g, -1, cs.spill_bytes);
  kvti_stats_set_budget_gauges(&t->stats, &g);
}
