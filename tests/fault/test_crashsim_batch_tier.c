/*
 * test_crashsim_batch_tier.c - the power-loss simulator (tests/lib/crashsim.h)
 * over the writer's group commit. A chunked tier with durability FSYNC holds
 * one acknowledged entry; NSP more spills (sharing their first chunk, chain
 * records and tails alike) are queued before its writer starts, so the
 * writer writes them as one batch: chunks, staged versions, renames, one
 * fsync of data/, one index transaction, acknowledgements; then the same for
 * a spill alone (a group of one: its chunk rows and record commit without a
 * WAL fsync of their own, made durable by its row's). Everything the
 * tier does meanwhile runs under the recording I/O table; index.db is
 * modelled as SQLite guarantees it (a copy at every WAL fsync, as in
 * test_crashsim_chunks.c). For every crash point inside the batch and
 * several seeded fates, a tier opened on the rebuilt state (its reconcile
 * included) must serve: the entry stored before, bit for bit; every spill
 * acknowledged before the crash point, bit for bit; every other spill bit
 * for bit or a miss - never wrong data, never an error, nothing quarantined.
 * Finally the simulator must catch a wrong order (file fsyncs dropped,
 * success claimed). KVT_CRASHSIM_FATES (default 3) sets the fates per point
 * (8 times as many for the spill alone).
 */
#include "crashsim.h"
#include "crashsim_index.h"
#include "rel_common.h"
#include "tier_testlib.h"

#define C 16
#define NSP 4

static size_t g_ack_op[NSP + 1]; /* log position at each acknowledgement */
static int g_nack;
static int g_nsp = NSP; /* spills of the campaign */

static void on_done(void *ctx, const char *hash, int status) {
  (void)ctx;
  (void)hash;
  if (status == 0 && g_nack <= NSP)
    g_ack_op[g_nack++] = g_nlog;
}

/* Spill i's prompt (i = NSP: the entry stored before): 16 shared tokens,
 * then its own; odd spills end on a chunk boundary (a chain record), even
 * ones carry 8 tail rows. */
static int prompt(int32_t *tok, int i) {
  int n = i % 2 ? 32 : 40;
  for (int k = 0; k < n; k++)
    tok[k] = k < 16 ? 700 + k : 9000 + i * 100 + k;
  return n;
}

static kvt_tier *open_tier(const char *dir) {
  kvt_options o = KVT_OPTIONS_INIT;
  o.cache_dir = dir;
  o.durability = KVT_DURABILITY_FSYNC;
  o.chunk_tokens = C;
  o.host_cache_bytes = 0;
  o.quarantine_max = 64;
  o.spill_done_fn = on_done;
  kvt_tier *t = NULL;
  if (kvt_tier_open(&t, &o) != 0) {
    fprintf(stderr, "  open failed: %s\n", kvt_last_error());
    return NULL;
  }
  return t;
}

/* 1 served bit for bit, 0 a miss, -1 wrong data or an error. */
static int serve(kvt_tier *t, int i) {
  int32_t tok[64];
  int n = prompt(tok, i);
  kvt_promote_opts po = t_popts(NULL);
  kvt_entry *e = NULL;
  int rc = kvt_tier_promote(&e, t, tok, (size_t)n, &po);
  int r = rc == KVT_ENOTFOUND             ? 0
          : rc != 0                       ? -1
          : t_kv_matches(e, tok, n, n, 2) ? 1
                                          : -1;
  if (r < 0)
    fprintf(stderr, "  spill %d: promote %d (%s)\n", i, rc,
            rc ? kvt_last_error() : "wrong data");
  kvt_entry_free(e);
  return r;
}

/* ---- the campaign ------------------------------------------------------- */

static uint64_t g_states, g_served, g_missed;
static uint64_t g_early; /* spills served in a state before their ack */

/* Checks the state in g_replay after a crash after K operations. Returns 1
 * on a violation. */
static int check_state(size_t K, int quiet) {
  kvt_tier *t = open_tier(g_replay);
  if (!t)
    return 1;
  g_states++;
  int viol = 0;
  if (serve(t, NSP) != 1) {
    if (!quiet)
      fprintf(stderr, "  the entry stored before is lost\n");
    viol = 1;
  }
  for (int i = 0; i < g_nsp; i++) {
    int r = serve(t, i);
    int acked = i < g_nack && g_ack_op[i] <= K;
    g_early += r == 1 && !acked;
    if (r < 0 || (acked && r != 1)) {
      if (!quiet)
        fprintf(stderr, "  spill %d: %s\n", i,
                r < 0 ? "wrong data or an error" : "acknowledged, lost");
      viol = 1;
    }
    g_served += r == 1;
    g_missed += r == 0;
  }
  kvt_stats s = KVT_STATS_INIT;
  REQUIRE(kvt_tier_stats(&s, t) == 0);
  if (s.quarantined != 0) {
    if (!quiet)
      fprintf(stderr, "  %llu quarantined\n",
              (unsigned long long)s.quarantined);
    viol = 1;
  }
  kvt_tier_close(t, -1);
  kvt_tier_free(t);
  return viol;
}

static uint64_t campaign(int fates, uint64_t seed, int quiet) {
  kvt_test_rmtree(g_base);
  REQUIRE(mkdir(g_base, 0700) == 0);
  kvt_tier *t = open_tier(g_base);
  REQUIRE(t);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  int32_t tok[64];
  int n = prompt(tok, NSP);
  REQUIRE(t_kv_spill(t, tok, n, n, 2, 1000) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  REQUIRE(kvt_tier_close(t, -1) == 0);
  kvt_tier_free(t);
  kvt_test_rmtree(g_live);
  r_copy_tree(g_base, g_live);
  log_clear();
  g_nack = 0;
  cs_index_install(); /* index.db: copies at its WAL fsyncs */
  rec_install();
  t = open_tier(g_live);
  REQUIRE(t);
  for (int i = 0; i < g_nsp; i++) {
    n = prompt(tok, i);
    REQUIRE(t_kv_spill(t, tok, n, n, 2, 1000) == 0);
  }
  REQUIRE(kvt_tier_start_writer(t) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  kvti_io_set(NULL); /* recorded up to the acknowledgements */
  kvt_stats s = KVT_STATS_INIT;
  REQUIRE(kvt_tier_stats(&s, t) == 0);
  /* One batch, or no batch was tested (a group of one is not counted). */
  CHECK_EQ_INT(s.spills_batched, g_nsp > 1 ? g_nsp : 0);
  CHECK_EQ_INT(s.spill_count, g_nsp);
  kvt_tier_close(t, -1);
  kvt_tier_free(t);
  CHECK_EQ_INT(g_nack, g_nsp);
  size_t total = g_nlog;
  uint64_t viol = 0;
  kvt_rng rng = {seed};
  for (size_t K = 0; K <= total; K++)
    for (int f = 0; f < fates; f++) {
      replay(K, &rng);
      cs_index_restore(K, &rng);
      int v = check_state(K, quiet);
      if (v && !quiet && viol < 5)
        fprintf(stderr, "  ^ crash after op %zu/%zu (fate %d)\n", K, total, f);
      viol += (uint64_t)v;
    }
  size_t commits = 0, syncs = 0;
  cs_index_counts(&commits, &syncs);
  if (!quiet)
    fprintf(stderr,
            "batch of %d: %zu operations logged, acknowledged after ops "
            "%zu..%zu; index: %zu commits, %zu WAL fsyncs\n",
            g_nsp, total, g_ack_op[0], g_ack_op[g_nsp - 1], commits, syncs);
  /* The records commit without a WAL fsync of their own: the model met
   * commits that a crash may keep or lose: every spill's record. */
  CHECK(cs_index_unsynced() >= (size_t)g_nsp);
  return viol;
}

static int g_fates;

static void run_campaign(int nsp, int fates, uint64_t seed) {
  g_nsp = nsp;
  g_states = g_served = g_missed = g_early = 0;
  CHECK_EQ_INT(campaign(fates, seed, 0), 0);
  fprintf(stderr,
          "%d spill(s): %llu crash states checked, %llu spills served (%llu "
          "before their acknowledgement), %llu missed (not yet "
          "acknowledged)\n",
          nsp, (unsigned long long)g_states, (unsigned long long)g_served,
          (unsigned long long)g_early, (unsigned long long)g_missed);
  /* Some crash states come after the publish and data/'s fsync but before
   * the row's commit: those spills are served by adoption, records lost or
   * not, or the states that need it were never reached. */
  CHECK(g_early > 0);
  g_nsp = NSP;
}

static void test_batch(void) {
  run_campaign(NSP, g_fates, 31);
}

/* A durable spill alone: the same steps as a group of one. Its window
 * between data/'s fsync and the row's commit is a few operations, so it
 * gets more fates: enough that a published tail whose record the crash
 * lost is met (and must be adopted with its chain, never quarantined). */
static void test_single(void) {
  run_campaign(1, 8 * g_fates, 37);
}

/* The simulator must catch a wrong order: file fsyncs skipped, success
 * claimed (an acknowledged spill then does not survive some crash). */
static void test_catches_bad_order(void) {
  g_fsync_files = 0;
  uint64_t v = campaign(1, 41, 1);
  g_fsync_files = 1;
  fprintf(stderr, "bad order: %llu crash states violate the guarantees\n",
          (unsigned long long)v);
  CHECK(v > 0);
}

int main(void) {
  r_use_fast_tmp();
  char *root = kvt_test_tmpdir("crashsim-batch");
  snprintf(g_base, sizeof g_base, "%s/base", root);
  snprintf(g_live, sizeof g_live, "%s/live", root);
  snprintf(g_replay, sizeof g_replay, "%s/replay", root);
  g_fates = (int)r_env_long("KVT_CRASHSIM_FATES", 3);
  RUN(test_batch);
  RUN(test_single);
  RUN(test_catches_bad_order);
  crashsim_free();
  char snaps[4200];
  snprintf(snaps, sizeof snaps, "%s.snap", g_base);
  kvt_test_rmtree(snaps);
  return kvt_test_done();
}
