/*
 * test_tier_threads.c - many threads at once: spillers, sync and async
 * promoters, lookups and touches against a small capacity so eviction and
 * replacement run constantly. Every promote either misses (evicted first) or
 * returns exactly the data of one spilled version - never a torn or corrupt
 * entry; budgets balance; capacity holds by count and by disk bytes at the end;
 * no corruption is ever detected (quarantined == 0, promotion_failures == 0).
 * Run under TSan.
 */
#include "tier_testlib.h"

#define N_KEYS 12
#define N_SPILLERS 3
#define N_PROMOTERS 4
#define ROUNDS 40

/* Each key has two versions (seed 2k and 2k+1) with the same tokens: a promote
 * must return one of them exactly. */
static t_entry versions[N_KEYS][2];
static kvt_tier *tier;
static atomic_int bad_data, hits, misses, other_errors;
static t_budget budget;

static void *spiller(void *arg) {
  int id = (int)(intptr_t)arg;
  kvt_rng r = {1000 + (uint64_t)id};
  for (int i = 0; i < ROUNDS; i++) {
    int k = (int)(kvt_rng_next(&r) % N_KEYS);
    int v = (int)(kvt_rng_next(&r) % 2);
    int rc = t_spill(tier, &versions[k][v]);
    if (rc != 0 && rc != KVT_EFULL)
      atomic_fetch_add(&other_errors, 1);
    if (i % 10 == 0)
      kvt_tier_flush(tier, -1);
  }
  return NULL;
}

static void check_got(kvt_entry *got, int k) {
  if (!t_same(got, &versions[k][0]) && !t_same(got, &versions[k][1]))
    atomic_fetch_add(&bad_data, 1);
}

static void *promoter(void *arg) {
  int id = (int)(intptr_t)arg;
  kvt_rng r = {2000 + (uint64_t)id};
  kvt_promote_opts po = t_popts(&budget);
  for (int i = 0; i < ROUNDS; i++) {
    int k = (int)(kvt_rng_next(&r) % N_KEYS);
    const t_entry *e = &versions[k][0];
    kvt_entry *got = NULL;
    int rc;
    switch (kvt_rng_next(&r) % 4) {
    case 0:
      rc = kvt_tier_promote(&got, tier, e->tokens, e->n_tokens, &po);
      break;
    case 1: {
      kvt_promise *p = NULL;
      rc = kvt_tier_promote_async(&p, tier, e->tokens, e->n_tokens, &po);
      if (rc == 0) {
        kvt_promise_wait(p, -1);
        rc = kvt_promise_result(&got, p);
        kvt_promise_free(p);
      }
      break;
    }
    case 2: {
      kvt_promise *p = NULL;
      rc = kvt_tier_promote_async(&p, tier, e->tokens, e->n_tokens, &po);
      if (rc == 0) {
        rc = kvt_promise_cancel(p);
        if (rc == 0)
          rc = kvt_promise_result(&got, p);
        else if (rc == KVT_ECANCELED)
          rc = KVT_ENOTFOUND; /* count as a miss for the tally below */
        kvt_promise_free(p);
      }
      break;
    }
    default: {
      kvt_entry_info info;
      rc = kvt_tier_lookup(&info, tier, e->tokens, e->n_tokens);
      if (rc == 0)
        kvt_tier_touch(tier, e->tokens, e->n_tokens);
      rc = rc == 0 ? KVT_ENOTFOUND : rc; /* no data to check */
      break;
    }
    }
    if (rc == 0) {
      atomic_fetch_add(&hits, 1);
      check_got(got, k);
      t_release(&budget, kvt_entry_reserved_bytes(got));
      kvt_entry_free(got);
    } else if (rc == KVT_ENOTFOUND) {
      atomic_fetch_add(&misses, 1);
    } else {
      fprintf(stderr, "promote: %s: %s\n", kvt_strerror(rc), kvt_last_error());
      atomic_fetch_add(&other_errors, 1);
    }
  }
  return NULL;
}

static void test_many_threads(void) {
  for (int k = 0; k < N_KEYS; k++) {
    versions[k][0] = t_make(10 + (uint64_t)k * 2, 24, 2, 8, 8);
    versions[k][1] = t_make(11 + (uint64_t)k * 2, 24, 2, 8, 8);
    memcpy(versions[k][1].tokens, versions[k][0].tokens, 24 * 4);
  }
  kvt_options o = t_opts("threads");
  o.max_entries = 5;
  o.spill_queue_size = N_KEYS;
  o.promote_threads = 3;
  tier = t_open(&o);
  REQUIRE(kvt_tier_start_writer(tier) == 0);
  t_budget_init(&budget, (uint64_t)1 << 40);
  for (int k = 0; k < N_KEYS; k++) /* start with something to promote */
    CHECK_EQ_INT(t_spill(tier, &versions[k][0]), 0);
  CHECK_EQ_INT(kvt_tier_flush(tier, -1), 0);
  pthread_t th[N_SPILLERS + N_PROMOTERS];
  for (int i = 0; i < N_SPILLERS; i++)
    pthread_create(&th[i], NULL, spiller, (void *)(intptr_t)i);
  for (int i = 0; i < N_PROMOTERS; i++)
    pthread_create(&th[N_SPILLERS + i], NULL, promoter, (void *)(intptr_t)i);
  for (int i = 0; i < N_SPILLERS + N_PROMOTERS; i++)
    pthread_join(th[i], NULL);
  CHECK_EQ_INT(kvt_tier_flush(tier, -1), 0);
  CHECK_EQ_INT(atomic_load(&bad_data), 0);
  CHECK_EQ_INT(atomic_load(&other_errors), 0);
  CHECK(atomic_load(&hits) > 0);
  CHECK_EQ_INT(budget.used, 0);
  CHECK_EQ_INT(budget.reserves, budget.releases);
  kvt_stats s = KVT_STATS_INIT;
  kvt_tier_stats(&s, tier);
  CHECK(s.entries <= 5);
  CHECK_EQ_INT(s.quarantined, 0);
  CHECK_EQ_INT(s.promotion_failures, 0);
  CHECK_EQ_INT(s.write_failures, 0);
  CHECK(s.evictions > 0);
  /* The index and the files agree. */
  CHECK_EQ_INT(kvt_tier_reconcile(tier), 0);
  kvt_tier_free(tier);
  for (int k = 0; k < N_KEYS; k++) {
    t_free(&versions[k][0]);
    t_free(&versions[k][1]);
  }
}

/* Capacity by disk bytes with concurrent spillers: the bound holds after every
 * flush. */
static void *byte_spiller(void *arg) {
  int id = (int)(intptr_t)arg;
  for (int i = 0; i < 15; i++) {
    t_entry e = t_make(5000 + (uint64_t)id * 100 + (uint64_t)i, 16, 2, 8, 8);
    int rc = t_spill(tier, &e);
    if (rc != 0 && rc != KVT_EFULL)
      atomic_fetch_add(&other_errors, 1);
    t_free(&e);
    if (i % 3 == 2)
      kvt_tier_flush(tier, -1); /* make sure plenty are written */
  }
  return NULL;
}

static void test_bytes_concurrent(void) {
  kvt_options o = t_opts("bytesconc");
  o.max_size_gb = 20000.0 / 1073741824.0; /* ~20 KB: a handful of entries */
  /* Every spill is written or dropped (the count below): no admission. */
  o.admission_policy = KVT_ADMIT_WRITE_ALL;
  o.spill_queue_size = 4;
  tier = t_open(&o);
  REQUIRE(kvt_tier_start_writer(tier) == 0);
  atomic_store(&other_errors, 0);
  pthread_t th[3];
  for (int i = 0; i < 3; i++)
    pthread_create(&th[i], NULL, byte_spiller, (void *)(intptr_t)i);
  for (int i = 0; i < 3; i++)
    pthread_join(th[i], NULL);
  CHECK_EQ_INT(kvt_tier_flush(tier, -1), 0);
  kvt_stats s = KVT_STATS_INIT;
  kvt_tier_stats(&s, tier);
  CHECK(s.disk_bytes <= 20000);
  CHECK(s.entries > 0);
  CHECK(s.evictions > 0);
  CHECK_EQ_INT(atomic_load(&other_errors), 0);
  CHECK_EQ_INT(s.spill_count + s.spill_drops, 45);
  kvt_tier_free(tier);
}

int main(void) {
  RUN(test_many_threads);
  RUN(test_bytes_concurrent);
  return kvt_test_done();
}
