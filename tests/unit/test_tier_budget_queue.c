/*
 * test_tier_budget_queue.c - the write budget holds for spills queued
 * together: the bound a spill reserves at admission is at least what its
 * write adds to kvtier's written counter (spill_bytes), in a plain and a
 * chunked tier, for a fresh spill, one that ends in a partial chunk and one
 * that shares its chunks with a stored one; with the writer held back many
 * spills are judged before any is written, and the counter never passes
 * the bucket, at any completion or at the end; each spill not queued is
 * counted by its reason (the budget, a full queue), and every reservation is
 * given back once its spill is written, shares what is stored, or is
 * refused, so the budget left is the bucket less what was written; a queued
 * spill whose stored chunks went before the writer took it is weighed again:
 * not written when the bucket has no room for the difference, written within
 * the bucket when it has; a spill with room for part of it is cut to the
 * longest chunk-aligned prefix that fits; a spill that cannot be cut and
 * is larger than the whole bucket is counted apart and logged once.
 */
#include "tier_testlib.h"
#include "testutil.h"
#include "kvtier_sys.h"
#include "tier/admission.h"
#include "tier/chunks.h"

#include <stdio.h>
#include <string.h>

/* A chunked tier under t_clock whose bucket holds `bucket` bytes (an
 * hour of 24 x that a day). */
static kvt_options budget_opts(const char *tag, uint64_t bucket) {
  kvt_options o = t_opts(tag);
  o.chunk_tokens = 16;
  o.clock_fn = t_clock;
  o.write_budget_bytes_per_day = 24 * bucket;
  return o;
}

/* Nothing reserved any more: the budget left is the bucket less the bytes
 * written (the bucket keeps fractions; the gauge rounds down). Time has not
 * moved since the bucket was empty. */
static void check_given_back(kvt_tier *t, uint64_t cap) {
  kvt_stats s = t_stats(t);
  CHECK(s.spill_bytes <= cap);
  CHECK(s.write_budget_left + 1 >= cap - s.spill_bytes &&
        s.write_budget_left <= cap - s.spill_bytes);
}

static void seq(int32_t *t, size_t n, int32_t base) {
  for (size_t i = 0; i < n; i++)
    t[i] = base + (int32_t)i;
}

/* kvti_admit_spill_bound of the t_kv_spill spill of tok[0, n) (T rows). */
static uint64_t bound_of(kvt_tier *t, const int32_t *tok, int n, int T,
                         int layers) {
  kvt_layer l[8];
  memset(l, 0, sizeof l);
  for (int i = 0; i < layers && i < 8; i++)
    l[i] = t_kv_tokens(tok, n, T, 8, i);
  kvti_salt salt; /* the spill's own: the tier's namespace (model_id) */
  REQUIRE(kvti_call_salt(&salt, t, NULL) == 0);
  uint64_t b =
      kvti_admit_spill_bound(t, tok, (size_t)n, l, (uint32_t)layers, &salt);
  for (int i = 0; i < layers; i++)
    t_layer_free(&l[i]);
  return b;
}

/* Spills tok[0, n) and returns what the write added to spill_bytes. */
static uint64_t written_by(kvt_tier *t, const int32_t *tok, int n, int T,
                           int layers) {
  uint64_t before = t_stats(t).spill_bytes;
  CHECK_EQ_INT(t_kv_spill(t, tok, n, T, layers, 4096), 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  return t_stats(t).spill_bytes - before;
}

static void check_bound(uint32_t chunk_tokens, const char *model_id) {
  kvt_options o = t_opts("bound");
  o.chunk_tokens = chunk_tokens;
  o.model_id = model_id;
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  int32_t p[200];
  /* Fresh, 4 layers; fresh with a partial last chunk; a longer spill
   * sharing the second one's chunks (it writes less than its bound, never
   * more). {tokens, rows, layers, first token} */
  const int cases[][4] = {
      {64, 64, 4, 5000}, {70, 80, 4, 9000}, {150, 160, 4, 9000}};
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    int n = cases[k][0], T = cases[k][1], L = cases[k][2];
    seq(p, 200, cases[k][3]);
    uint64_t b = bound_of(t, p, n, T, L);
    uint64_t w = written_by(t, p, n, T, L);
    CHECK(w > 0);
    CHECK(b >= w);
    /* Not far above its bytes: a fresh spill, and one whose stored chunks
     * come off its bound (chunked) or that is written whole (plain). */
    CHECK(b < w + w / 4 + 2048);
  }
  /* A malformed spill has no bound (it is refused at the queue). */
  kvt_layer bad = t_kv_tokens(p, 64, 64, 8, 0);
  bad.num_tensors = 1;
  CHECK_EQ_INT(kvti_admit_spill_bound(t, p, 64, &bad, 1, NULL), 0);
  bad.num_tensors = 2;
  t_layer_free(&bad);
  kvt_tier_free(t);
  kvt_test_rmtree(o.cache_dir);
}

static void test_bound(void) {
  check_bound(0, NULL);
  check_bound(16, NULL);
  check_bound(16, "a-model-id-long-enough-to-widen-the-chunk-namespace");
}

/* spill_done_fn: spill_bytes as each spill completes, against the bucket. */
typedef struct watch {
  kvt_tier *t;
  uint64_t cap, most;
  int done, over, refused_budget;
} watch;

static void on_done(void *ctx, const char *hash, int rc) {
  (void)hash;
  watch *w = ctx;
  kvt_stats s = t_stats(w->t);
  if (s.spill_bytes > w->most)
    w->most = s.spill_bytes;
  if (s.spill_bytes > w->cap)
    w->over++;
  if (rc == 0)
    w->done++;
  if (rc == KVT_EBUDGET)
    w->refused_budget++;
}

static void test_queued_spills_hold_the_budget(void) {
  /* 64 tokens x 2 layers of [1, 2, 64, 8] F32: 8 KiB of KV a spill; the
   * bucket holds 40 KiB and time stands still, so nothing drains: at most
   * 40 KiB may ever be written. */
  const uint64_t cap = 40u << 10;
  kvt_options o = budget_opts("queued", cap);
  watch w = {0};
  o.spill_done_fn = on_done;
  o.spill_done_ctx = &w;
  t_clock_now = 1000.0;
  kvt_tier *t = t_open(&o);
  w.t = t;
  w.cap = cap;
  /* The writer is not started: every spill is judged while the bucket is
   * still empty by its own count. */
  int32_t p[64];
  const int N = 30;
  for (int i = 0; i < N; i++) {
    seq(p, 64, 200000 + 64 * i);
    CHECK_EQ_INT(t_kv_spill(t, p, 64, 64, 2, 8192), 0);
  }
  kvt_stats s = t_stats(t);
  CHECK_EQ_INT(s.spill_bytes, 0);
  CHECK(s.admission_admitted >= 2);       /* 8 KiB spills fit a 40 KiB bucket */
  CHECK(s.admission_declined_budget > 0); /* but not 30 of them */
  CHECK_EQ_INT(s.admission_admitted + s.admission_declined_budget, N);
  CHECK_EQ_INT(s.admission_declined_unseen + s.admission_truncated, 0);
  CHECK_EQ_INT(s.queue_depth, s.admission_admitted);
  CHECK(s.write_budget_left < cap); /* the queued spills' reservations */
  uint64_t admitted = s.admission_admitted;

  REQUIRE(kvt_tier_start_writer(t) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  s = t_stats(t);
  CHECK_EQ_INT(w.done, admitted);
  CHECK_EQ_INT(w.over, 0);
  CHECK(w.most <= cap);
  CHECK(s.spill_bytes <= cap);
  CHECK_EQ_INT(s.spill_count, admitted);
  check_given_back(t, cap);

  /* A spill that shares every chunk it has with a stored one writes only
   * its tail: its reservation comes back whole but for those bytes. */
  uint64_t before = s.spill_bytes;
  seq(p, 64, 200000);
  CHECK_EQ_INT(t_kv_spill(t, p, 48, 64, 2, 8192), 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  s = t_stats(t);
  if (s.admission_admitted > admitted) /* it fitted beside what is written */
    CHECK(s.spill_bytes - before < (8u << 10));
  check_given_back(t, cap);
  kvt_tier_free(t);
  kvt_test_rmtree(o.cache_dir);
}

/* Spills admitted under the budget but refused by a full queue: counted as
 * queue_full, their reservations given back (the budget left is the bucket
 * less what the queued ones wrote). */
static void test_refused_spills_give_back(void) {
  const uint64_t cap = 400u << 10;
  kvt_options o = budget_opts("refused", cap);
  o.spill_queue_size = 2;
  t_clock_now = 5000.0;
  kvt_tier *t = t_open(&o);
  int32_t p[64];
  int full = 0;
  for (int i = 0; i < 6; i++) {
    seq(p, 64, 700000 + 64 * i);
    int rc = t_kv_spill(t, p, 64, 64, 2, 8192);
    CHECK(rc == 0 || rc == KVT_EFULL);
    full += rc == KVT_EFULL;
  }
  CHECK_EQ_INT(full, 4);
  kvt_stats s = t_stats(t);
  CHECK_EQ_INT(s.spill_refused_queue_full, 4);
  CHECK_EQ_INT(s.admission_admitted, 2);
  CHECK_EQ_INT(s.admission_declined_budget, 0);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  s = t_stats(t);
  CHECK_EQ_INT(s.spill_count, 2);
  check_given_back(t, cap);
  kvt_tier_free(t);
  kvt_test_rmtree(o.cache_dir);
}

/* log_fn: warnings that name the oversize counter. */
static void count_oversize_logs(void *ctx, int level, const char *msg) {
  if (level >= KVT_LOG_WARN && strstr(msg, "admission_declined_oversize"))
    (*(int *)ctx)++;
}

/* A spill that cannot be cut on the token axis (two KV layers and a state
 * layer, as a hybrid model's): spilled whole (bound NULL) or its bound
 * taken (*bound). */
static int hybrid(kvt_tier *t, const int32_t *tok, uint64_t *bound) {
  kvt_layer l[3];
  l[0] = t_kv_tokens(tok, 64, 64, 8, 0);
  l[1] = t_kv_tokens(tok, 64, 64, 8, 1);
  kvt_rng r = {(uint64_t)tok[0]};
  const kvt_dtype dts[2] = {KVT_DTYPE_F32, KVT_DTYPE_F16};
  l[2] = t_arrays(&r, 2, dts);
  int rc = 0;
  if (bound) {
    kvti_salt salt;
    REQUIRE(kvti_call_salt(&salt, t, NULL) == 0);
    *bound = kvti_admit_spill_bound(t, tok, 64, l, 3, &salt);
  } else {
    rc = kvt_tier_spill(t, tok, 64, l, 3, 8192);
  }
  for (int i = 0; i < 3; i++)
    t_layer_free(&l[i]);
  return rc;
}

/* A spill that cannot be cut whose bound is more than the whole bucket:
 * declined by the budget even with the bucket empty, counted apart (stats,
 * live file, Prometheus) and logged once a handle; a spill declined because
 * the bucket is full for now is not counted there. */
static void test_oversize_spill_is_told(void) {
  t_clock_now = 9000.0;
  kvt_options probe = budget_opts("oversize-probe", 1u << 20);
  kvt_tier *pt = t_open(&probe);
  int32_t p[64];
  seq(p, 64, 900000);
  uint64_t big = 0;
  hybrid(pt, p, &big);
  uint64_t small = bound_of(pt, p, 16, 16, 1);
  kvt_tier_free(pt);
  kvt_test_rmtree(probe.cache_dir);
  const uint64_t cap = big - 1; /* one big spill does not fit, ever */
  REQUIRE(small < cap / 4);

  int logs = 0;
  kvt_options o = budget_opts("oversize", cap);
  o.log_fn = count_oversize_logs;
  o.log_ctx = &logs;
  o.log_level = KVT_LOG_WARN;
  o.admission_policy = KVT_ADMIT_WRITE_ALL;
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  for (int i = 0; i < 2; i++) {
    seq(p, 64, 900000 + 64 * i);
    CHECK_EQ_INT(hybrid(t, p, NULL), 0);
  }
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  kvt_stats s = t_stats(t);
  CHECK_EQ_INT(s.spill_bytes, 0); /* the bucket is empty */
  CHECK_EQ_INT(s.admission_declined_budget, 2);
  CHECK_EQ_INT(s.admission_declined_oversize, 2);
  CHECK_EQ_INT(logs, 1);

  /* Small spills fill the bucket (time stands still) until the budget
   * declines them for now: those are not oversize. */
  int declined = 0;
  for (int i = 0; i < 64 && !declined; i++) {
    seq(p, 16, 950000 + 16 * i);
    CHECK_EQ_INT(t_kv_spill(t, p, 16, 16, 1, 1024), 0);
    REQUIRE(kvt_tier_flush(t, -1) == 0);
    declined = t_stats(t).admission_declined_budget > 2;
  }
  CHECK(declined);
  s = t_stats(t);
  CHECK(s.admission_admitted >= 1);
  CHECK_EQ_INT(s.admission_declined_oversize, 2);
  CHECK(s.spill_bytes <= cap);

  /* The live file and the renderings carry it. */
  kvt_stats l = KVT_STATS_INIT;
  kvt_stats_live lv;
  REQUIRE(kvt_stats_read_live(&l, &lv, o.cache_dir) == 0);
  CHECK_EQ_INT(l.admission_declined_oversize, 2);
  char buf[1 << 16];
  size_t need = 0;
  REQUIRE(kvt_stats_to_prometheus(buf, sizeof buf, &need, &s) == 0);
  CHECK(strstr(buf, "\nkvtier_admission_declined_oversize_total 2\n") != NULL);
  REQUIRE(kvt_stats_to_json(buf, sizeof buf, &need, &s) == 0);
  CHECK(strstr(buf, "\"admission_declined_oversize\": 2") ||
        strstr(buf, "\"admission_declined_oversize\":2"));
  kvt_tier_free(t);
  kvt_test_rmtree(o.cache_dir);
}

/* Spills tok[0, n) (T rows, 2 layers) into a tier of base's directory and
 * chunking, without a budget, and closes it. */
static void store_one(const kvt_options *base, const int32_t *tok, int n,
                      int T) {
  kvt_options o = *base;
  o.write_budget_bytes_per_day = 0;
  o.spill_done_fn = NULL;
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  CHECK_EQ_INT(t_kv_spill(t, tok, n, T, 2, 8192), 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  kvt_tier_free(t);
}

/* A queued spill that counted a stored chunk as not to be written, whose
 * chunk is gone when the writer takes it (here found damaged and
 * quarantined; eviction by the spills before it does the same): the writer
 * weighs its bound again. With no room for the difference it is not written
 * (KVT_EBUDGET to spill_done_fn, declined for the budget) and the counter
 * stays within the bucket; with room it is written, its reservation grown,
 * and the counter still within the bucket. */
static void check_recheck(int room) {
  int32_t p[80];
  seq(p, 80, 300000);
  kvt_options o = budget_opts(room ? "recheck-room" : "recheck", 1);
  store_one(&o, p, 64, 64); /* 4 chunks of 16 */
  /* The bounds of tok[0, 80) with those 4 chunks stored and with none. */
  kvt_options plain = o;
  plain.write_budget_bytes_per_day = 0;
  kvt_tier *t = t_open(&plain);
  uint64_t small = bound_of(t, p, 80, 80, 2);
  kvt_tier_free(t);
  kvt_options fresh = t_opts("recheck-fresh");
  fresh.chunk_tokens = 16;
  t = t_open(&fresh);
  uint64_t full = bound_of(t, p, 80, 80, 2);
  kvt_tier_free(t);
  kvt_test_rmtree(fresh.cache_dir);
  CHECK(2 * small < full); /* 64 tokens' chunks came off */

  const uint64_t cap = room ? full + 4096 : small + 64;
  o.write_budget_bytes_per_day = 24 * cap;
  watch w = {0};
  o.spill_done_fn = on_done;
  o.spill_done_ctx = &w;
  t_clock_now = 9000.0; /* and it stands still: nothing drains */
  t = t_open(&o);
  w.t = t;
  w.cap = cap;
  CHECK_EQ_INT(t_kv_spill(t, p, 80, 80, 2, 8192), 0); /* queued, held */
  kvt_stats s = t_stats(t);
  CHECK_EQ_INT(s.admission_admitted, 1);
  CHECK_EQ_INT(s.admission_declined_budget, 0);
  /* The chain's first chunk goes: nothing of it is stored for the spill. */
  kvti_chain_rec *recs = NULL;
  size_t k = 0;
  REQUIRE(kvti_chunked_prefix_chain(t->chunked, NULL, p, 64, &recs, &k) == 0);
  REQUIRE(k == 4);
  kvti_tier_chunk_damaged(t, recs[0].key, KVT_ECORRUPT, "the test");
  kvti_free(recs);
  CHECK_EQ_INT(kvti_tier_chunks_stored(t, p, 80, NULL), 0);
  uint64_t before = t_stats(t).spill_bytes;

  REQUIRE(kvt_tier_start_writer(t) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  s = t_stats(t);
  CHECK_EQ_INT(w.over, 0);
  CHECK(s.spill_bytes <= cap);
  if (room) {
    CHECK_EQ_INT(w.done, 1);
    CHECK(s.spill_bytes - before > small); /* it wrote past its first bound */
    CHECK_EQ_INT(s.admission_declined_budget, 0);
  } else {
    CHECK_EQ_INT(w.done, 0);
    CHECK_EQ_INT(w.refused_budget, 1);
    CHECK_EQ_INT(s.spill_bytes, before);
    CHECK_EQ_INT(s.admission_declined_budget, 1);
    CHECK_EQ_INT(s.admission_tokens_declined, 80);
  }
  check_given_back(t, cap);
  kvt_tier_free(t);
  kvt_test_rmtree(o.cache_dir);
}

static void test_recheck(void) {
  check_recheck(0);
  check_recheck(1);
}

/* The bucket has room for part of a spill: its longest chunk-aligned prefix
 * that fits is written (admission_truncated), within the bucket, and reads
 * back exact. */
static void test_cut_to_fit(void) {
  int32_t p[256];
  seq(p, 256, 400000);
  kvt_options fresh = t_opts("fit-fresh");
  fresh.chunk_tokens = 16;
  kvt_tier *t = t_open(&fresh);
  uint64_t part = bound_of(t, p, 160, 160, 2);
  uint64_t whole = bound_of(t, p, 256, 256, 2);
  kvt_tier_free(t);
  kvt_test_rmtree(fresh.cache_dir);
  const uint64_t cap = part + 4096;
  CHECK(cap < whole);
  kvt_options o = budget_opts("fit", cap);
  t_clock_now = 12000.0;
  t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  CHECK_EQ_INT(t_kv_spill(t, p, 256, 256, 2, 8192), 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  kvt_stats s = t_stats(t);
  CHECK_EQ_INT(s.admission_truncated, 1);
  CHECK_EQ_INT(s.admission_declined_budget, 0);
  CHECK(s.spill_bytes <= cap);
  kvt_entry_info info;
  REQUIRE(kvt_tier_lookup_prefix(&info, t, p, 256) == 0);
  CHECK(info.num_tokens >= 96 && info.num_tokens <= 160);
  CHECK_EQ_INT(info.num_tokens % 16, 0);
  CHECK_EQ_INT(s.admission_tokens_declined, 256 - info.num_tokens);
  kvt_entry *e = NULL;
  REQUIRE(kvt_tier_promote(&e, t, p, info.num_tokens, NULL) == 0 && e);
  CHECK(t_kv_matches(e, p, (int)info.num_tokens, (int)info.num_tokens, 2));
  kvt_entry_free(e);
  check_given_back(t, cap);
  kvt_tier_free(t);
  kvt_test_rmtree(o.cache_dir);
}

int main(void) {
  RUN(test_bound);
  RUN(test_oversize_spill_is_told);
  RUN(test_queued_spills_hold_the_budget);
  RUN(test_refused_spills_give_back);
  RUN(test_recheck);
  RUN(test_cut_to_fit);
  return kvt_test_done();
}
