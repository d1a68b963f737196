/*
 * test_tier_admission.c - admission and the write budget (admission.h): the
 * record of prefixes seen (flags, bounded memory, the oldest forgotten), the
 * segment fingerprints (equal prefixes, equal prints; a salt separates), the
 * leaky bucket and its day (driven by explicit times, so every figure is
 * exact), each policy's decision, the length classes and what the record
 * learns of them, then a tier under an injected clock: a
 * second-sighting tier writes a prompt only when it comes back, cuts a spill
 * to its seen prefix, counts each decision by reason in kvt_stats, the live
 * file, JSON and Prometheus; a budgeted tier stops writing when its bucket is
 * full and writes again as trace time passes; bad option values are refused
 * with a message naming the field.
 */
#include "tier_testlib.h"
#include "testutil.h"
#include "tier/admission.h"
#include "kvtier_sys.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void test_record(void) {
  kvti_seen s;
  REQUIRE(kvti_seen_init(&s, 64 << 10) == 0);
  CHECK(s.nsets * KVTI_SEEN_WAYS * 8 <= 64 << 10);
  CHECK_EQ_INT(kvti_seen_get(&s, 12345), 0);
  kvti_seen_put(&s, 12345, KVTI_SEEN_ONCE);
  CHECK_EQ_INT(kvti_seen_get(&s, 12345), KVTI_SEEN_ONCE);
  kvti_seen_put(&s, 12345, KVTI_SEEN_REUSED);
  CHECK_EQ_INT(kvti_seen_get(&s, 12345), KVTI_SEEN_ONCE | KVTI_SEEN_REUSED);
  /* The flag bits are not part of the key: 12344..12347 are one print. */
  CHECK_EQ_INT(kvti_seen_get(&s, 12344), KVTI_SEEN_ONCE | KVTI_SEEN_REUSED);
  /* Far more prints than slots: the record stays bounded, the newest are
   * remembered and the first one is forgotten. */
  size_t slots = s.nsets * KVTI_SEEN_WAYS;
  for (uint64_t i = 1; i <= 4 * slots; i++)
    kvti_seen_put(&s, i * 0x9E3779B97F4A7C15ull, KVTI_SEEN_ONCE);
  CHECK_EQ_INT(kvti_seen_get(&s, 12345), 0);
  size_t newest = 0;
  for (uint64_t i = 4 * slots - 99; i <= 4 * slots; i++)
    newest += kvti_seen_get(&s, i * 0x9E3779B97F4A7C15ull) != 0;
  CHECK_EQ_INT(newest, 100);
  kvti_seen_destroy(&s);
}

static void test_prints(void) {
  int32_t a[700], b[700];
  for (int i = 0; i < 700; i++)
    a[i] = b[i] = i * 7 + 1;
  b[600] = -1; /* third segment of 256 differs */
  uint64_t fa[3], fb[3], fs[3], fshort[3];
  kvti_seen_prints(fa, a, 700, 256, 0);
  kvti_seen_prints(fb, b, 700, 256, 0);
  CHECK(fa[0] == fb[0] && fa[1] == fb[1] && fa[2] != fb[2]);
  kvti_seen_prints(fs, a, 700, 256, 99);
  CHECK(fs[0] != fa[0]); /* another salt: another namespace */
  kvti_seen_prints(fshort, a, 600, 256, 0);
  CHECK(fshort[1] == fa[1] && fshort[2] != fa[2]); /* 88 tokens != 188 */
  kvti_salt none = {0}, salted = {1, {7, 1, 2, 3, 4, 5, 6, 7}};
  CHECK(kvti_seen_seed(&none) == 0 && kvti_seen_seed(&salted) != 0);
}

static void test_bucket(void) {
  kvti_bucket b;
  kvti_bucket_init(&b, 86400.0); /* 1 byte a second, holds 3600 */
  kvti_bucket_update(&b, 1000.0, 500);
  CHECK_EQ_INT(kvti_bucket_left(&b), 3600);
  CHECK_EQ_INT(kvti_bucket_today(&b), 0);
  kvti_bucket_update(&b, 1010.0, 3500); /* 3000 in, 10 out */
  CHECK_EQ_INT(kvti_bucket_left(&b), 610);
  CHECK_EQ_INT(kvti_bucket_today(&b), 3000);
  kvti_bucket_update(&b, 900.0, 3500); /* the clock went back: no drain */
  CHECK_EQ_INT(kvti_bucket_left(&b), 610);
  kvti_bucket_update(&b, 1010.0, 8000); /* over the top: full */
  CHECK_EQ_INT(kvti_bucket_left(&b), 0);
  kvti_bucket_update(&b, 10000.0, 8000); /* drained empty, never below */
  CHECK_EQ_INT(kvti_bucket_left(&b), 3600);
  CHECK_EQ_INT(kvti_bucket_today(&b), 7500);
  kvti_bucket_update(&b, 86400.0 + 5, 9000); /* a new day */
  CHECK_EQ_INT(kvti_bucket_today(&b), 1000);
  kvti_bucket_init(&b, 0); /* no budget: nothing is ever left */
  kvti_bucket_update(&b, 0, 0);
  CHECK_EQ_INT(kvti_bucket_left(&b), 0);
}

static kvt_options admit_opts(int policy, uint64_t per_day) {
  kvt_options o = KVT_OPTIONS_INIT;
  o.admission_policy = policy;
  o.admission_memory_bytes = 64 << 10;
  o.write_budget_bytes_per_day = per_day;
  o.chunk_tokens = 16;
  return o;
}

static void seq(int32_t *t, size_t n, int32_t base) {
  for (size_t i = 0; i < n; i++)
    t[i] = base + (int32_t)i;
}

static int decide(kvti_admit *a, size_t *keep, const int32_t *t, size_t n,
                  int cuttable, int pressure, double now, uint64_t total) {
  int v = -1;
  uint64_t reserved = 1;
  CHECK_EQ_INT(kvti_admit_decide(a, &v, keep, t, n, 0, cuttable, pressure, now,
                                 total, 0, &reserved),
               0);
  CHECK_EQ_INT(reserved, 0); /* no bound: nothing reserved */
  return v;
}

static void test_decisions(void) {
  int32_t p[64], q[64];
  seq(p, 64, 1000);
  memcpy(q, p, sizeof q);
  q[40] = -5; /* shares two segments of 16 with p, then differs */
  size_t keep = 0;

  kvti_admit a;
  kvt_options o = admit_opts(KVT_ADMIT_WRITE_ALL, 0);
  REQUIRE(kvti_admit_needed(&o) == 0);
  REQUIRE(kvti_admit_init(&a, &o) == 0);
  CHECK_EQ_INT(decide(&a, &keep, p, 64, 1, 1, 0, 0), KVTI_ADMIT_WHOLE);
  CHECK_EQ_INT(keep, 64);
  kvti_admit_destroy(&a);

  o = admit_opts(KVT_ADMIT_SECOND_SIGHTING, 0);
  REQUIRE(kvti_admit_init(&a, &o) == 0);
  CHECK_EQ_INT(decide(&a, &keep, p, 64, 1, 0, 0, 0), KVTI_ADMIT_UNSEEN);
  CHECK_EQ_INT(keep, 0);
  CHECK_EQ_INT(decide(&a, &keep, p, 64, 1, 0, 0, 0), KVTI_ADMIT_WHOLE);
  CHECK_EQ_INT(keep, 64);
  CHECK_EQ_INT(decide(&a, &keep, q, 64, 1, 0, 0, 0), KVTI_ADMIT_TRUNCATED);
  CHECK_EQ_INT(keep, 32);
  q[41] = -6; /* another new tail: not cuttable, so nothing */
  CHECK_EQ_INT(decide(&a, &keep, q, 64, 0, 0, 0, 0), KVTI_ADMIT_UNSEEN);
  kvti_admit_destroy(&a);

  /* Adaptive: everything until the store evicts; then a new prefix needs a
   * second sighting unless it is in the sample or extends a reused one. */
  o = admit_opts(KVT_ADMIT_ADAPTIVE, 0);
  REQUIRE(kvti_admit_init(&a, &o) == 0);
  CHECK_EQ_INT(decide(&a, &keep, p, 64, 1, 0, 0, 0), KVTI_ADMIT_WHOLE);
  int32_t r[48];
  int sampled = 0, unsampled = 0;
  for (int32_t base = 5000; base < 5000 + 64 * 200 && !(sampled && unsampled);
       base += 64) {
    seq(r, 48, base);
    uint64_t fp[3];
    kvti_seen_prints(fp, r, 48, 16, 0);
    int v = decide(&a, &keep, r, 48, 1, 1, 0, 0);
    if (kvti_admit_sampled(fp[0])) {
      sampled++;
      CHECK_EQ_INT(v, KVTI_ADMIT_WHOLE);
    } else {
      unsampled++;
      CHECK_EQ_INT(v, KVTI_ADMIT_UNSEEN);
    }
  }
  CHECK(sampled && unsampled);
  /* A lookup found p[0, 32) stored: a longer spill over it is written whole
   * on its first sighting. */
  int32_t longer[80];
  memcpy(longer, p, 32 * sizeof *longer);
  seq(longer + 32, 48, 90000);
  uint64_t lf[5];
  kvti_seen_prints(lf, longer, 80, 16, 0);
  kvti_admit_note_hit(&a, longer, 32, 0);
  CHECK_EQ_INT(decide(&a, &keep, longer, 80, 1, 1, 0, 0), KVTI_ADMIT_WHOLE);

  /* A prompt spilled, then the same prompt with its answer (what vllm-mlx's
   * prefix cache evicts for one request): the second is no second request,
   * so neither is written. Once a lookup asked for the prompt, a spill over
   * it writes the part asked for. */
  int32_t pr[48], pa[52];
  uint64_t pf[4];
  int32_t base = 200000;
  do { /* a prompt outside the sample, and its answer's segment too */
    seq(pr, 48, base += 64);
    memcpy(pa, pr, sizeof pr);
    seq(pa + 48, 4, base + 10000);
    kvti_seen_prints(pf, pa, 52, 16, 0);
  } while (kvti_admit_sampled(pf[0]) || kvti_admit_sampled(pf[3]));
  CHECK_EQ_INT(decide(&a, &keep, pr, 48, 1, 1, 0, 0), KVTI_ADMIT_UNSEEN);
  CHECK_EQ_INT(decide(&a, &keep, pa, 52, 1, 1, 0, 0), KVTI_ADMIT_UNSEEN);
  CHECK_EQ_INT(keep, 0);
  CHECK_EQ_INT(kvti_seen_get(&a.seen, pf[0]) & KVTI_SEEN_ASKED, 0);
  kvti_admit_note_ask(&a, pa, 52, 0); /* a request for the prompt + more */
  CHECK(kvti_seen_get(&a.seen, pf[2]) & KVTI_SEEN_ASKED);
  uint64_t unseen_fp[5];
  int32_t ext[80];
  memcpy(ext, pr, sizeof pr);
  seq(ext + 48, 32, base + 20000);
  kvti_seen_prints(unseen_fp, ext, 80, 16, 0);
  CHECK_EQ_INT(kvti_seen_get(&a.seen, unseen_fp[3]), 0); /* never a first */
  CHECK_EQ_INT(decide(&a, &keep, ext, 80, 1, 1, 0, 0), KVTI_ADMIT_TRUNCATED);
  CHECK_EQ_INT(keep, 48);
  kvti_admit_destroy(&a);

  /* The budget: 24 * 3600 B a day holds 3600 B, and stops spills short of
   * that by room for one as large as the largest yet. Full: nothing; over
   * half full: only an extension of a reused prefix; drained: as the
   * policy says. Time stands at 100 s while the bucket fills. */
  o = admit_opts(KVT_ADMIT_WRITE_ALL, 86400);
  REQUIRE(kvti_admit_needed(&o) == 1);
  REQUIRE(kvti_admit_init(&a, &o) == 0);
  CHECK_EQ_INT(decide(&a, &keep, p, 64, 1, 0, 100, 0), KVTI_ADMIT_WHOLE);
  for (uint64_t w = 200; w <= 2600; w += 200) /* 13 spills of 200 B */
    kvti_bucket_update(&a.bucket, 100, w);
  CHECK(fabs(kvti_bucket_top(&a.bucket) - 3400) < 1e-9);
  /* 2600 B in it: over half full (1800). */
  CHECK_EQ_INT(decide(&a, &keep, q, 64, 1, 0, 100, 2600), KVTI_ADMIT_BUDGET);
  CHECK_EQ_INT(keep, 0);
  kvti_admit_note_hit(&a, p, 32, 0);
  CHECK_EQ_INT(decide(&a, &keep, p, 64, 1, 0, 100, 2600), KVTI_ADMIT_WHOLE);
  /* A 900 B spill: 3500 B in it, past the top (now 3600 less the room's
   * bound, an eighth). */
  CHECK_EQ_INT(decide(&a, &keep, p, 64, 1, 0, 100, 3500), KVTI_ADMIT_BUDGET);
  CHECK(fabs(kvti_bucket_top(&a.bucket) - 3150) < 1e-9);
  /* 2200 s later 1300 B remain: under half full. */
  CHECK_EQ_INT(decide(&a, &keep, q, 64, 1, 0, 2300, 3500), KVTI_ADMIT_WHOLE);
  kvt_stats s;
  memset(&s, 0, sizeof s);
  kvti_admit_gauges(&a, &s, 2300, 3500);
  CHECK_EQ_INT(s.write_budget_bytes_per_day, 86400);
  CHECK_EQ_INT(s.write_budget_left, 2300);
  kvti_admit_gauges(&a, &s, -1, 3600); /* no clock: as of the last time */
  CHECK_EQ_INT(s.write_budget_left, 2200);
  CHECK_EQ_INT(s.bytes_written_today, 3600);
  CHECK(s.ssd_lifetime_years == 0); /* no rating */
  kvti_admit_destroy(&a);

  /* Adaptive in the soft zone: q declined, then a request asks for its
   * first 32 tokens, and that part is written (a spill that cannot be cut
   * still is not). */
  o = admit_opts(KVT_ADMIT_ADAPTIVE, 86400);
  REQUIRE(kvti_admit_init(&a, &o) == 0);
  CHECK_EQ_INT(decide(&a, &keep, p, 64, 1, 0, 100, 0), KVTI_ADMIT_WHOLE);
  for (uint64_t w = 200; w <= 2600; w += 200)
    kvti_bucket_update(&a.bucket, 100, w);
  CHECK_EQ_INT(decide(&a, &keep, q, 64, 1, 0, 100, 2600), KVTI_ADMIT_BUDGET);
  kvti_admit_note_ask(&a, q, 32, 0);
  CHECK_EQ_INT(decide(&a, &keep, q, 64, 0, 0, 100, 2600), KVTI_ADMIT_BUDGET);
  CHECK_EQ_INT(decide(&a, &keep, q, 64, 1, 0, 100, 2600), KVTI_ADMIT_TRUNCATED);
  CHECK_EQ_INT(keep, 32);
  kvti_admit_destroy(&a);

  /* A rating: 1 TB over 10 years; at 4000 B in 2000 s the SSD lasts
   * 1e12 / (2 B/s * 86400 * 365.25) years. */
  o = admit_opts(KVT_ADMIT_WRITE_ALL, 0);
  o.write_budget_tbw = 1;
  o.write_budget_years = 10;
  REQUIRE(kvti_admit_init(&a, &o) == 0);
  CHECK(fabs(a.bucket.per_day - 1e12 / 3652.5) < 1);
  kvti_admit_gauges(&a, &s, 100, 0);
  kvti_admit_gauges(&a, &s, 2100, 4000);
  CHECK(fabs(s.ssd_lifetime_years - 1e12 / (2.0 * 86400 * 365.25)) <
        1e-6 * s.ssd_lifetime_years);
  kvti_admit_destroy(&a);
}

/* ---- a tier under an injected clock ---- */

static int found(kvt_tier *t, const int32_t *tok, size_t n) {
  kvt_entry_info info;
  return kvt_tier_lookup(&info, t, tok, n) == 0;
}

/* Length classes, the class a record slot keeps, and what the record
 * learns: a class whose spills are gone on from later is worth more than
 * the mean, one whose spills never come back less; and in the budget's soft
 * zone a spill of the valued class passes where a new one of the other does
 * not. */
/* 40 spills of 64 tokens (class 0) never seen again, and 40 of 1024 tokens
 * (class 4) each continued by a longer spill over it. */
static void teach(kvti_admit *a) {
  static int32_t big[1024 + 64], small[64];
  size_t keep;
  for (int i = 0; i < 40; i++) {
    seq(small, 64, 100000 + 64 * i);
    decide(a, &keep, small, 64, 1, 0, 0, 0);
    seq(big, 1024 + 64, 1000000 + 2048 * i);
    decide(a, &keep, big, 1024, 1, 0, 0, 0);
    decide(a, &keep, big, 1024 + 64, 1, 0, 0, 0);
  }
}

static void test_learning(void) {
  CHECK_EQ_INT(kvti_len_class(0), 0);
  CHECK_EQ_INT(kvti_len_class(362), 0);
  CHECK_EQ_INT(kvti_len_class(363), 1);
  CHECK_EQ_INT(kvti_len_class(512), 2);
  CHECK_EQ_INT(kvti_len_class(1024), 4);
  CHECK_EQ_INT(kvti_len_class(46340), 14);
  CHECK_EQ_INT(kvti_len_class(46341), 15);
  CHECK_EQ_INT(kvti_len_class(UINT64_MAX), KVTI_LEN_CLASSES - 1);
  for (uint64_t n = 1; n < 100000; n += 97)
    CHECK(kvti_len_class(n) <= kvti_len_class(n + 97));

  kvti_seen r;
  REQUIRE(kvti_seen_init(&r, 64 << 10) == 0);
  CHECK_EQ_INT(kvti_seen_class(&r, 777), KVTI_LEN_UNKNOWN);
  kvti_seen_put(&r, 777, KVTI_SEEN_ONCE); /* no class yet */
  CHECK_EQ_INT(kvti_seen_class(&r, 777), KVTI_LEN_UNKNOWN);
  kvti_seen_put_class(&r, 777, KVTI_SEEN_REUSED, 5); /* the first one sticks */
  kvti_seen_put_class(&r, 777, 0, 9);
  CHECK_EQ_INT(kvti_seen_class(&r, 777), 5);
  CHECK_EQ_INT(kvti_seen_get(&r, 777), KVTI_SEEN_ONCE | KVTI_SEEN_REUSED);
  kvti_seen_destroy(&r);

  kvti_admit a;
  kvt_options o = admit_opts(KVT_ADMIT_ADAPTIVE, 0);
  REQUIRE(kvti_admit_init(&a, &o) == 0);
  double v[KVTI_LEN_CLASSES + 1];
  kvti_admit_values(&a, v);
  CHECK(v[0] == v[4] && v[4] == v[KVTI_LEN_UNKNOWN]);
  int32_t big[1024], small[64];
  size_t keep;
  teach(&a);
  kvti_admit_values(&a, v);
  CHECK(v[4] > v[KVTI_LEN_UNKNOWN]);
  CHECK(v[0] < v[KVTI_LEN_UNKNOWN]);
  CHECK(v[9] == v[KVTI_LEN_UNKNOWN] || fabs(v[9] - v[KVTI_LEN_UNKNOWN]) < 1e-9);
  kvti_admit_destroy(&a);

  /* The soft zone with what was learnt: 86400 B a day holds 3600 B; 2000 B
   * in it is over half full. */
  o = admit_opts(KVT_ADMIT_ADAPTIVE, 86400);
  REQUIRE(kvti_admit_init(&a, &o) == 0);
  teach(&a);
  seq(small, 64, 100000); /* seen: but of the worthless class */
  for (uint64_t w = 100; w <= 2000; w += 100) /* 2000 B in it, 100 B a spill */
    kvti_bucket_update(&a.bucket, 0, w);
  CHECK_EQ_INT(decide(&a, &keep, small, 64, 1, 0, 0, 2000), KVTI_ADMIT_BUDGET);
  seq(small, 64, 900000); /* new, of the worthless class */
  CHECK_EQ_INT(decide(&a, &keep, small, 64, 1, 0, 0, 2000), KVTI_ADMIT_BUDGET);
  seq(big, 1024, 5000000); /* new, of the valued class */
  CHECK_EQ_INT(decide(&a, &keep, big, 1024, 1, 0, 0, 2000), KVTI_ADMIT_WHOLE);
  /* Full: nothing, whatever its class. */
  seq(big, 1024, 6000000);
  CHECK_EQ_INT(decide(&a, &keep, big, 1024, 1, 0, 0, 4000), KVTI_ADMIT_BUDGET);
  kvti_admit_destroy(&a);
}

static void test_tier_second_sighting(void) {
  kvt_options o = t_opts("admit");
  o.admission_policy = KVT_ADMIT_SECOND_SIGHTING;
  o.chunk_tokens = 16;
  o.clock_fn = t_clock;
  t_clock_now = 1000;
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  int32_t p[64], q[64];
  seq(p, 64, 7);
  memcpy(q, p, sizeof q);
  q[50] = -1; /* a new last segment */

  CHECK_EQ_INT(t_kv_spill(t, p, 64, 64, 2, 4096), 0); /* first sighting */
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  CHECK(!found(t, p, 64));
  kvt_stats s = t_stats(t);
  CHECK_EQ_INT(s.admission_declined_unseen, 1);
  CHECK_EQ_INT(s.admission_tokens_declined, 64);
  CHECK_EQ_INT(s.spill_count, 0);

  CHECK_EQ_INT(t_kv_spill(t, p, 64, 64, 2, 4096), 0); /* it came back */
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  CHECK(found(t, p, 64));
  CHECK_EQ_INT(t_kv_spill(t, q, 64, 64, 2, 4096), 0); /* cut to 48 */
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  CHECK(found(t, q, 48) && !found(t, q, 64));
  s = t_stats(t);
  CHECK_EQ_INT(s.admission_admitted, 1);
  CHECK_EQ_INT(s.admission_truncated, 1);
  CHECK_EQ_INT(s.admission_tokens_declined, 64 + 16);
  CHECK(s.spill_bytes > 0 && s.bytes_written_today == s.spill_bytes);
  CHECK_EQ_INT(s.write_budget_bytes_per_day, 0);

  /* The promoted prefix is the spill's own rows. */
  kvt_promote_opts po = t_popts(NULL);
  kvt_entry *e = NULL;
  REQUIRE(kvt_tier_promote(&e, t, q, 48, &po) == 0);
  CHECK(t_kv_matches(e, q, 48, 48, 2));
  kvt_entry_free(e);

  /* A refused spill is refused, not declined. */
  t_entry rot = t_make(3, 16, 2, 16, 16);
  rot.layers[1].kind = KVT_LAYER_ROTATING_KV;
  CHECK_EQ_INT(t_spill(t, &rot), KVT_EINVAL);
  t_free(&rot);

  /* The live file and the renderings carry the counters. */
  kvt_stats live = KVT_STATS_INIT;
  REQUIRE(kvt_stats_read_live(&live, NULL, o.cache_dir) == 0);
  s = t_stats(t);
  CHECK_EQ_INT(live.admission_truncated, 1);
  CHECK_EQ_INT(live.admission_declined_unseen, s.admission_declined_unseen);
  CHECK_EQ_INT(live.bytes_written_today, s.bytes_written_today);
  char buf[16384];
  size_t need;
  REQUIRE(kvt_stats_to_json(buf, sizeof buf, &need, &s) == 0);
  CHECK(strstr(buf, "\"admission_truncated\":1") != NULL);
  CHECK(strstr(buf, "\"ssd_lifetime_years\":0.0") != NULL);
  REQUIRE(kvt_stats_to_prometheus(buf, sizeof buf, &need, &s) == 0);
  CHECK(strstr(buf, "kvtier_admission_declined_unseen_total 1\n") != NULL);
  CHECK(strstr(buf, "kvtier_write_budget_left 0\n") != NULL);
  kvt_tier_free(t);
  kvt_test_rmtree(o.cache_dir);
}

static void test_tier_budget(void) {
  kvt_options o = t_opts("budget");
  o.chunk_tokens = 16;
  o.clock_fn = t_clock;
  /* 64 tokens x 2 layers of [1, 2, 64, 8] F32 (t_kv_spill): 8 KiB of KV a
   * spill; the bucket holds 24 KiB (an hour of 576 KiB a day). */
  o.write_budget_bytes_per_day = 576 << 10;
  t_clock_now = 86400.0 * 3;
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  int32_t p[64];
  int spilled = 0;
  for (int i = 0; i < 40; i++) {
    seq(p, 64, 100000 + 64 * i);
    CHECK_EQ_INT(t_kv_spill(t, p, 64, 64, 2, 8192), 0);
    REQUIRE(kvt_tier_flush(t, -1) == 0);
    spilled++;
  }
  kvt_stats s = t_stats(t);
  CHECK(s.admission_declined_budget > 0);
  CHECK_EQ_INT(s.admission_admitted + s.admission_declined_budget, spilled);
  /* At most the bucket plus the one spill that filled it. */
  uint64_t one = s.spill_count ? s.spill_bytes / s.spill_count : 0;
  CHECK(s.spill_bytes <= (24u << 10) + one);
  CHECK(s.write_budget_left < (24u << 10) / 2 + one);
  CHECK_EQ_INT(s.write_budget_bytes_per_day, 576 << 10);
  uint64_t written = s.spill_bytes, declined = s.admission_declined_budget;

  /* An hour of trace time later the bucket has drained: writes resume, and
   * the next day starts counting from zero. */
  t_clock_now = 86400.0 * 4 + 10;
  seq(p, 64, 900000);
  CHECK_EQ_INT(t_kv_spill(t, p, 64, 64, 2, 8192), 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  s = t_stats(t);
  CHECK_EQ_INT(s.admission_declined_budget, declined);
  CHECK(s.spill_bytes > written);
  CHECK_EQ_INT(s.bytes_written_today, s.spill_bytes - written);
  kvt_tier_free(t);
  kvt_test_rmtree(o.cache_dir);
}

static void bad(kvt_options *o, const char *want) {
  CHECK_EQ_INT(kvt_options_validate(o), KVT_EINVAL);
  CHECK(strstr(kvt_last_error(), want) != NULL);
  if (!strstr(kvt_last_error(), want))
    fprintf(stderr, "  message: %s (want %s)\n", kvt_last_error(), want);
  kvt_tier *t = NULL;
  CHECK_EQ_INT(kvt_tier_open(&t, o), KVT_EINVAL);
  CHECK(t == NULL);
}

static void test_options(void) {
  kvt_options base = KVT_OPTIONS_INIT;
  base.cache_dir = "/nonexistent/kvtier-admission";
  CHECK_EQ_INT(base.admission_policy, KVT_ADMIT_ADAPTIVE);
  CHECK_EQ_INT(kvt_options_validate(&base), 0);
  kvt_options o = base;
  o.admission_policy = 3;
  bad(&o, "admission_policy must be");
  o = base;
  o.admission_memory_bytes = 1000;
  bad(&o, "admission_memory_bytes must be 0");
  o = base;
  o.write_budget_tbw = -1;
  o.write_budget_years = 5;
  bad(&o, "write_budget_tbw must be");
  o.write_budget_tbw = NAN;
  bad(&o, "write_budget_tbw must be");
  o = base;
  o.write_budget_tbw = 600;
  bad(&o, "go together");
  o.write_budget_years = INFINITY;
  bad(&o, "write_budget_years must be");
  o.write_budget_years = 5;
  CHECK_EQ_INT(kvt_options_validate(&o), 0);
  o.write_budget_bytes_per_day = 1 << 30;
  bad(&o, "not both");
  o = base;
  o.write_budget_bytes_per_day = 2000000000000000000ull;
  bad(&o, "write_budget_bytes_per_day must be at most");
  /* A version-4 caller's struct ends before the new fields: defaults. */
  kvt_options v4;
  memset(&v4, 0xAB, sizeof v4);
  REQUIRE(kvt_options_init(&v4, 4) == 0);
  v4.cache_dir = base.cache_dir;
  CHECK_EQ_INT(kvt_options_validate(&v4), 0);
}

int main(void) {
  RUN(test_record);
  RUN(test_prints);
  RUN(test_bucket);
  RUN(test_decisions);
  RUN(test_learning);
  RUN(test_tier_second_sighting);
  RUN(test_tier_budget);
  RUN(test_options);
  return kvt_test_done();
}
