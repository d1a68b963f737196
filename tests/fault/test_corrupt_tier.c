/*
 * test_corrupt_tier.c - the corruption campaign through the tier. Each seeded
 * trial damages one random file of one stored entry (layer file, manifest.json,
 * manifest.sum or tokens.bin; flip, truncate, zero or extend) and reads the
 * entry through one of the tier's read paths in turn (sync promote, async
 * promote, kvt_tier_read_entry, kvt_tier_verify with repair): every damaged
 * entry must come back as KVT_ECORRUPT with no data, be quarantined (row gone,
 * data/<hash> gone) and be counted (quarantined; promotion_failures for
 * promotes). The entry is then spilled again for the next trial. The detection
 * rate is printed (100% required). A second campaign damages index.db (and
 * sometimes its -wal) of a closed tier: opening must never crash, fail with a
 * clear error or open, and whatever it then serves is exactly the data that was
 * spilled for those tokens. KVT_CORRUPT_TIER_TRIALS (default 1500) and
 * KVT_CORRUPT_TIER_INDEX_TRIALS (default 300) bound the run.
 */
#include "rel_tier.h"

#define N_ENT 10

static t_entry g_e[N_ENT];
static char g_hash[N_ENT][65];

static int read_path(kvt_tier *t, int i, int how, kvt_entry **got) {
  const t_entry *e = &g_e[i];
  switch (how) {
  case 0:
    return kvt_tier_promote(got, t, e->tokens, e->n_tokens, NULL);
  case 1: {
    kvt_promise *p = NULL;
    int rc = kvt_tier_promote_async(&p, t, e->tokens, e->n_tokens, NULL);
    if (rc != 0)
      return rc;
    CHECK_EQ_INT(kvt_promise_wait(p, -1), 0);
    rc = kvt_promise_result(got, p);
    kvt_promise_free(p);
    return rc;
  }
  case 2:
    return kvt_tier_read_entry(got, t, e->tokens, e->n_tokens, g_hash[i]);
  default:
    return kvt_tier_verify(t, g_hash[i], 1);
  }
}

static const char *const g_how[4] = {"promote", "promote_async", "read_entry",
                                     "verify"};

static void test_tier_campaign(void) {
  long trials = r_env_long("KVT_CORRUPT_TIER_TRIALS", 1500);
  char *dir = kvt_test_tmpdir("corrupt-tier");
  kvt_options o = rel_opts(dir, KVT_DURABILITY_NONE);
  o.quarantine_max = 3;
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  for (int i = 0; i < N_ENT; i++)
    REQUIRE(t_spill(t, &g_e[i]) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  kvt_rng rng = {9090};
  uint64_t damaged = 0, detected = 0, noop = 0, by_how[4][2] = {{0}};
  kvt_stats s0 = KVT_STATS_INIT;
  kvt_tier_stats(&s0, t);
  uint64_t expect_pf = 0;
  for (long tr = 0; tr < trials; tr++) {
    int i = (int)(kvt_rng_next(&rng) % N_ENT);
    static const char *files[] = {"layer_0.safetensors", "layer_1.safetensors",
                                  "manifest.json", "manifest.sum",
                                  "tokens.bin"};
    const char *f = files[kvt_rng_next(&rng) % 5];
    char *path = t_entry_path(t, g_e[i].tokens, g_e[i].n_tokens, f);
    char *orig = NULL;
    size_t olen = 0;
    int kind = 0;
    int ch = r_damage(path, &rng, -1, &orig, &olen, &kind);
    REQUIRE(ch >= 0);
    free(orig);
    free(path);
    if (ch == 0) {
      noop++;
      continue;
    }
    damaged++;
    int how = (int)(tr % 4);
    kvt_entry *got = NULL;
    int rc = read_path(t, i, how, &got);
    CHECK(got == NULL);
    kvt_entry_free(got);
    kvt_entry_info info;
    int gone = kvt_tier_lookup(&info, t, g_e[i].tokens, g_e[i].n_tokens) ==
               KVT_ENOTFOUND;
    char *d = t_entry_path(t, g_e[i].tokens, g_e[i].n_tokens, NULL);
    int dir_gone = !kvt_test_exists(d);
    free(d);
    int ok = rc == KVT_ECORRUPT && gone && dir_gone;
    if (how <= 1)
      expect_pf++;
    by_how[how][1]++;
    if (ok) {
      detected++;
      by_how[how][0]++;
    } else if (damaged - detected <= 5) {
      fprintf(stderr,
              "  trial %ld: %s of %s via %s: rc %d, row gone %d, dir gone %d "
              "(%s)\n",
              tr, r_kind_names[kind], f, g_how[how], rc, gone, dir_gone,
              kvt_last_error());
    }
    CHECK(ok);
    /* Spill it again for the next trials. */
    REQUIRE(t_spill(t, &g_e[i]) == 0);
    REQUIRE(kvt_tier_flush(t, -1) == 0);
  }
  kvt_stats s1 = KVT_STATS_INIT;
  kvt_tier_stats(&s1, t);
  CHECK_EQ_INT(s1.quarantined - s0.quarantined, detected);
  CHECK(s1.promotion_failures - s0.promotion_failures >= expect_pf);
  char *q = rel_path(dir, "quarantine", NULL);
  CHECK(kvt_test_count_dir(q, NULL) <= 3); /* bounded */
  free(q);
  /* Everything still reads back exactly. */
  for (int i = 0; i < N_ENT; i++) {
    kvt_entry *got = NULL;
    CHECK_EQ_INT(
        kvt_tier_promote(&got, t, g_e[i].tokens, g_e[i].n_tokens, NULL), 0);
    CHECK(got && t_same(got, &g_e[i]));
    kvt_entry_free(got);
  }
  CHECK_EQ_INT(kvt_tier_close(t, -1), 0);
  kvt_tier_free(t);
  rel_check_dir(dir, NULL);
  fprintf(
      stderr,
      "tier corruption: %ld trials, %llu damaged, %llu detected+quarantined "
      "(%.2f%%), %llu no-op; quarantined counter +%llu\n",
      trials, (unsigned long long)damaged, (unsigned long long)detected,
      damaged ? 100.0 * (double)detected / (double)damaged : 100.0,
      (unsigned long long)noop,
      (unsigned long long)(s1.quarantined - s0.quarantined));
  for (int h = 0; h < 4; h++)
    fprintf(stderr, "  %-14s %llu/%llu\n", g_how[h],
            (unsigned long long)by_how[h][0], (unsigned long long)by_how[h][1]);
}

static void test_index_damage(void) {
  long trials = r_env_long("KVT_CORRUPT_TIER_INDEX_TRIALS", 300);
  char *root = kvt_test_tmpdir("corrupt-tier-index");
  char *pristine = rel_path(root, "pristine", NULL),
       *live = rel_path(root, "live", NULL);
  char *snap = rel_path(root, "snap", NULL);
  kvt_options o = rel_opts(pristine, KVT_DURABILITY_NONE);
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  for (int i = 0; i < N_ENT; i++)
    REQUIRE(t_spill(t, &g_e[i]) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  /* A copy taken while the tier is open (idle) holds index.db-wal too: the
   * state a crash leaves. Trials alternate between it and the cleanly closed
   * directory. */
  r_copy_tree(pristine, snap);
  REQUIRE(kvt_tier_close(t, -1) == 0);
  kvt_tier_free(t);
  char *snap_wal = rel_path(snap, "index.db-wal", NULL);
  int have_wal = kvt_test_exists(snap_wal);
  free(snap_wal);
  uint64_t wal_trials = 0;
  kvt_rng rng = {5151};
  uint64_t refused = 0, opened = 0, served = 0, lost = 0, wrong = 0;
  for (long tr = 0; tr < trials; tr++) {
    kvt_test_rmtree(live);
    int use_snap = (tr & 1) && have_wal;
    r_copy_tree(use_snap ? snap : pristine, live);
    chmod(live, 0700);
    int wal = use_snap && (kvt_rng_next(&rng) & 1);
    wal_trials += (uint64_t)wal;
    char *db = rel_path(live, wal ? "index.db-wal" : "index.db", NULL);
    char *orig = NULL;
    size_t olen = 0;
    r_damage(db, &rng, -1, &orig, &olen, NULL);
    free(orig);
    free(db);
    kvt_options lo = rel_opts(live, KVT_DURABILITY_NONE);
    kvt_clear_error();
    t = NULL;
    int rc = kvt_tier_open(&t, &lo);
    if (rc != 0) {
      refused++;
      CHECK(t == NULL);
      CHECK(kvt_last_error()[0] != '\0');
      CHECK(rc == KVT_EDB || rc == KVT_EIO || rc == KVT_ECORRUPT);
      continue;
    }
    opened++;
    for (int i = 0; i < N_ENT; i++) {
      kvt_entry *got = NULL;
      int pr = kvt_tier_promote(&got, t, g_e[i].tokens, g_e[i].n_tokens, NULL);
      if (pr == 0) {
        served++;
        if (!t_same(got, &g_e[i])) {
          wrong++;
          fprintf(stderr, "  trial %ld: entry %d served with wrong data\n", tr,
                  i);
        }
      } else {
        lost++;
        CHECK(got == NULL);
      }
      kvt_entry_free(got);
    }
    uint64_t removed = 0;
    kvt_tier_gc(t, NULL, &removed, NULL);
    kvt_tier_close(t, -1);
    kvt_tier_free(t);
  }
  CHECK_EQ_INT(wrong, 0);
  fprintf(stderr,
          "tier index.db damage: %ld trials: %llu refused at open with an "
          "error, %llu "
          "opened; %llu promotes served (all exact), %llu entries unavailable, "
          "%llu "
          "wrong (%llu trials damaged the WAL)\n",
          trials, (unsigned long long)refused, (unsigned long long)opened,
          (unsigned long long)served, (unsigned long long)lost,
          (unsigned long long)wrong, (unsigned long long)wal_trials);
  free(pristine);
  free(live);
  free(snap);
}

int main(void) {
  r_use_fast_tmp();
  for (int i = 0; i < N_ENT; i++) {
    g_e[i] = t_make(100 + (uint64_t)i, 10 + (size_t)i * 3, 2, 4, 8);
    kvt_token_hash(g_hash[i], g_e[i].tokens, g_e[i].n_tokens);
  }
  RUN(test_tier_campaign);
  RUN(test_index_damage);
  for (int i = 0; i < N_ENT; i++)
    t_free(&g_e[i]);
  return kvt_test_done();
}
