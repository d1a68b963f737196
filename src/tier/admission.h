/*
 * admission.h - what a spill must show to be written, and the write budget
 * (kvt_options.admission_policy, write_budget_*): a bounded record of the
 * prefixes seen (set-associative fingerprints with two flags and the length
 * class of their first spill each) and what it learns of how often each
 * class is gone on from (what eviction by value weighs), a leaky
 * bucket over kvtier's own count of the bytes it writes, the decision that
 * combines them (how many leading tokens of a spill to write), the
 * reservation an admitted spill holds in the bucket until it is written or
 * dropped, and the spill entry point that applies it. The record and the bucket
 * are plain data with no clock and no tier of their own, so tests drive them
 * deterministically; the tier feeds them its clock (clock_fn) and its
 * spill_bytes counter.
 */
#ifndef KVT_ADMISSION_H
#define KVT_ADMISSION_H

#include "base/salt.h"
#include "format/entry.h"
#include "index/chain.h"
#include "kvtier.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

/* ---- the record of prefixes seen ---- */

/* Flags of a fingerprint: seen in a spill or a lookup hit; found stored by a
 * lookup (a reused prefix); asked for by a prefix lookup after it was seen
 * (a request came back for it, whether or not it was stored). Beside them a
 * slot keeps the length class
 * (index/chain.h) of the spill that first showed the segment, so that a
 * later sighting credits the kind of spill that proved worth writing. */
#define KVTI_SEEN_ONCE 1u
#define KVTI_SEEN_REUSED 2u
#define KVTI_SEEN_ASKED 4u

/* Slots of one set; a full set forgets its oldest insertion. */
#define KVTI_SEEN_WAYS 8u

typedef struct kvti_seen {
  uint64_t *slot; /* nsets * WAYS: fingerprint with its low 8 bits the flags
                     (3) and the class (5); 0 = empty */
  uint8_t *next;  /* per set: the way the next insertion replaces */
  size_t nsets;   /* a power of two */
} kvti_seen;

/* A record of at most `bytes` bytes (at least one set). 0 or KVT_ENOMEM. */
int kvti_seen_init(kvti_seen *s, uint64_t bytes);
void kvti_seen_destroy(kvti_seen *s);
/* The flags of fp (0: not remembered). */
unsigned kvti_seen_get(const kvti_seen *s, uint64_t fp);
/* Adds flags to fp, remembering it if it is not (which may forget another;
 * its class then KVTI_LEN_UNKNOWN). */
void kvti_seen_put(kvti_seen *s, uint64_t fp, unsigned flags);
/* As kvti_seen_put; a fingerprint not yet remembered gets class cls, or one
 * remembered without a class. */
void kvti_seen_put_class(kvti_seen *s, uint64_t fp, unsigned flags,
                         unsigned cls);
/* The class of fp (KVTI_LEN_UNKNOWN: none, or not remembered). */
unsigned kvti_seen_class(const kvti_seen *s, uint64_t fp);

/* Fingerprints of the segments of tokens[0, n): fp[i] names tokens[0, end of
 * segment i) under seed, segments being seg tokens (the last may be shorter):
 * ceil(n / seg) of them into fp (caller-sized). */
void kvti_seen_prints(uint64_t *fp, const int32_t *tokens, size_t n,
                      uint32_t seg, uint64_t seed);
/* The seed of a salt (0 for none). */
uint64_t kvti_seen_seed(const kvti_salt *salt);

/* ---- the leaky bucket ---- */

typedef struct kvti_bucket {
  double per_day;      /* the budget, bytes a day; 0 = none */
  double cap;          /* what the bucket holds: an hour of the budget */
  double max_step;     /* the most one update has added (a spill's bytes) */
  double level;        /* bytes in it now */
  double last_t;       /* clock of the last update */
  uint64_t last_total; /* written counter at the last update (never goes
                          back: a caller's older reading adds nothing) */
  int64_t day;         /* the clock's day of the last update */
  uint64_t day_base;   /* written counter when that day began */
  double t0;           /* clock at the first update */
  uint64_t total0;     /* written counter then */
  int started;
} kvti_bucket;

void kvti_bucket_init(kvti_bucket *b, double per_day);
/* Brings the bucket to clock now with the written counter at total: adds
 * what was written since the last update, drains what the elapsed time lets
 * out. A clock that went back counts as not moved, a counter below the last
 * one (read before another thread's update) as not moved either. */
void kvti_bucket_update(kvti_bucket *b, double now, uint64_t total);
/* Where spills stop being let in when a spill's bytes are not known in
 * advance: the capacity less room for one more spill as large as the largest
 * yet (at most an eighth of the capacity, so that a single huge spill does
 * not shut the bucket). A spill with a bound (kvti_admit_decide) is let in
 * only while the bucket, the reservations and its bound fit the capacity. */
double kvti_bucket_top(const kvti_bucket *b);
/* Bytes it takes before it is full (as of the last update; 0 when full). */
uint64_t kvti_bucket_left(const kvti_bucket *b);
/* Written since the clock's current day began (as of the last update). */
uint64_t kvti_bucket_today(const kvti_bucket *b);

/* ---- the decision ---- */

enum {
  KVTI_ADMIT_WHOLE = 0,     /* write it all */
  KVTI_ADMIT_TRUNCATED = 1, /* write tokens[0, keep) */
  KVTI_ADMIT_UNSEEN = 2,    /* write nothing: the policy */
  KVTI_ADMIT_BUDGET = 3,    /* write nothing: the budget */
  KVTI_ADMIT_OVERSIZE = 4,  /* write nothing: its bound alone is more than
                                the bucket holds, so the budget never lets it
                                in (a decline of the budget too) */
  /* the budget has room below the hour, but not for all of it: write the
   * longest prefix of tokens[0, keep) whose bound fits (kvti_admit_fit) */
  KVTI_ADMIT_NOROOM = 5
};

typedef struct kvti_admit {
  pthread_mutex_t mu; /* the record and the bucket */
  int policy;         /* kvt_admission_policy */
  uint32_t seg;       /* tokens a segment */
  double tbw_bytes;   /* the SSD's rating in bytes, 0 = none */
  kvti_seen seen;
  kvti_bucket bucket;
  /* Bytes reserved by admitted spills not yet written, dropped or failed:
   * each holds the most it can write (kvti_admit_spill_bound) from its
   * admission until kvti_admit_settle, after its bytes are counted, so the
   * spills queued together can never carry the bucket over. */
  uint64_t reserved;
  /* 1 once a spill larger than the bucket has been logged (spill.c). */
  atomic_int oversize_logged;
  /* What the record has learnt, per length class: spills that brought new
   * segments (starts) and later spills that went on from a segment one of
   * those brought (rereads, credited to the class that brought it). */
  uint64_t starts[KVTI_LEN_CLASSES + 1], rereads[KVTI_LEN_CLASSES + 1];
} kvti_admit;

/* Whether a tier with these options needs a kvti_admit at all. */
int kvti_admit_needed(const kvt_options *o);
/* 0 or KVT_ENOMEM; o must be valid (kvt_options_validate). */
int kvti_admit_init(kvti_admit *a, const kvt_options *o);
void kvti_admit_destroy(kvti_admit *a);
/* The budget in bytes a day the options give (0: none). */
double kvti_admit_budget_per_day(const kvt_options *o);

/* 1 for the fixed 1-in-8 sample of fingerprints KVT_ADMIT_ADAPTIVE lets in
 * on a first sighting. */
int kvti_admit_sampled(uint64_t fp);
/* The decision for a spill of tokens[0, n) (cuttable: every layer can be cut
 * on the token axis; pressure: the store has evicted for capacity) at clock
 * now with the written counter at total: one of
 * KVTI_ADMIT_* and, for WHOLE/TRUNCATED/NOROOM, *keep tokens to write (NOROOM:
 * at most; nothing reserved). Records the spill's segments as seen. bound: the
 * most bytes the spill can write (0: unknown, the bucket's top decides); under
 * a budget a spill let in with a bound reserves it (*reserved, else 0), which
 * the caller must give back with kvti_admit_settle whatever becomes of the
 * spill. 0 or KVT_ENOMEM (then *verdict WHOLE and nothing reserved: a spill is
 * never lost to the record's own failure). */
int kvti_admit_decide(kvti_admit *a, int *verdict, size_t *keep,
                      const int32_t *tokens, size_t n, uint64_t seed,
                      int cuttable, int pressure, double now, uint64_t total,
                      uint64_t bound, uint64_t *reserved);
/* Gives back a reservation of kvti_admit_decide once the spill's bytes (if
 * any) are in the written counter, now total: the bucket takes total first,
 * so no bytes are ever out of both. */
void kvti_admit_settle(kvti_admit *a, uint64_t reserved, uint64_t total);
/* The learnt worth of each length class (and of KVTI_LEN_UNKNOWN, the mean):
 * how often a spill of that class was gone on from later, shrunk toward the
 * mean while a class has few spills. All equal before anything is learnt. */
void kvti_admit_values(kvti_admit *a, double value[KVTI_LEN_CLASSES + 1]);
/* A lookup found tokens[0, m) stored: its segments are reused prefixes. */
void kvti_admit_note_hit(kvti_admit *a, const int32_t *tokens, size_t m,
                         uint64_t seed);
/* A prefix lookup asked for tokens[0, n): the leading segments already seen
 * are marked asked (KVT_ADMIT_ADAPTIVE counts only those, or stored ones, as
 * a request that came back). */
void kvti_admit_note_ask(kvti_admit *a, const int32_t *tokens, size_t n,
                         uint64_t seed);
/* Fills the budget's gauges of s (bytes_written_today, write_budget_*,
 * ssd_lifetime_years) as of clock now (< 0: the time of the last update, for
 * threads that must not call the clock) and written counter total. */
void kvti_admit_gauges(kvti_admit *a, kvt_stats *s, double now, uint64_t total);

/* ---- the tier's side (admission.c; tier.h's struct kvt_tier) ---- */

struct kvt_tier;
/* A lookup of tokens under salt found m of them stored (lookup_common). */
void kvti_admit_lookup_hit(struct kvt_tier *t, const int32_t *tokens, size_t m,
                           const kvti_salt *salt);
/* A prefix lookup of tokens[0, n) under salt (lookup_common). */
void kvti_admit_lookup_ask(struct kvt_tier *t, const int32_t *tokens, size_t n,
                           const kvti_salt *salt);
/* The tier's clock (clock_fn or the wall clock). */
double kvti_admit_now(struct kvt_tier *t);
/* The most bytes of the tier's written counter (spill_bytes) a spill of
 * tokens[0, n) with these layers under salt can add when it is written: its
 * entry files and manifest, and in a chunked tier the chunk files not stored
 * now plus the chain record. 0 when it cannot be told (the spill is
 * malformed and will be refused, or memory ran out). */
uint64_t kvti_admit_spill_bound(struct kvt_tier *t, const int32_t *tokens,
                                size_t n, const kvt_layer *layers,
                                uint32_t n_layers, const kvti_salt *salt);
/* What the bound of a spill and of its prefixes is made of, taken once per
 * spill (kvti_admit_bound_of) and evaluated at any cut (kvti_admit_bound_at).
 */
typedef struct kvti_spill_bound {
  uint64_t entry;  /* the whole entry's files */
  uint64_t row;    /* bytes a token's rows take in a chunk's data */
  uint64_t head;   /* a chunk file's header bound */
  uint64_t C, ns;  /* chunk_tokens (0: not chunked), the namespace's bytes */
  uint64_t stored; /* tokens whose chunks are stored when it was taken */
  uint64_t pad;    /* slack for a cut entry's alignment */
  size_t n;        /* the spill's tokens */
} kvti_spill_bound;
/* Fills *b for a spill of tokens[0, n) with these layers under salt (in a
 * chunked tier one lookup of the stored chain). 1, or 0 when the bound
 * cannot be told (as kvti_admit_spill_bound's 0). */
int kvti_admit_bound_of(kvti_spill_bound *b, struct kvt_tier *t,
                        const int32_t *tokens, size_t n,
                        const kvt_layer *layers, uint32_t n_layers,
                        const kvti_salt *salt);
/* The bound of the spill's prefix tokens[0, k), k <= b->n (k == n: the
 * whole spill, kvti_admit_spill_bound's figure). */
uint64_t kvti_admit_bound_at(const kvti_spill_bound *b, size_t k);
/* 1 when every layer is KV or quantized KV: cut on the token axis by a
 * truncated spill, and chunked row by row. */
int kvti_admit_cuttable(const kvt_layer *layers, uint32_t n_layers);
/* On the writer's thread, before a spill that holds *reserved is written:
 * its bound taken again from its snapshot s. Chunks counted as stored when it
 * was let in may have been evicted since (by the spills written before it);
 * the reservation then grows by the difference if that fits beside the bucket
 * and the other reservations. Returns 1 (write it; *reserved is what it now
 * holds) or 0 (it would carry the bucket over: not written; *reserved is
 * unchanged and still to be given back). */
int kvti_admit_recheck(struct kvt_tier *t, uint64_t *reserved,
                       const kvti_snapshot *s);
/* For KVTI_ADMIT_NOROOM, with the spill's bound b: the longest prefix
 * tokens[0, k), k <= keep and a multiple of the tier's chunk_tokens (of the
 * admission segment without chunking), longer than what is stored of it,
 * whose bound fits the bucket's room now; its bound is reserved (*reserved,
 * to be given back as any reservation). Returns k, or 0 when none fits
 * (nothing reserved; *never 1 when the shortest cut that would add anything
 * is over the whole bucket). */
size_t kvti_admit_fit(struct kvt_tier *t, const kvti_spill_bound *b,
                      size_t keep, uint64_t *reserved, int *never);
/* kvti_admit_settle with the tier's written counter; no-op for 0. */
void kvti_admit_release(struct kvt_tier *t, uint64_t reserved);

#endif
