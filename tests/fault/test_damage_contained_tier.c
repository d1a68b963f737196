/*
 * test_damage_contained_tier.c - damage to the chunked store costs only what
 * was damaged (public API, plus SQLite to damage index.db). One flipped byte
 * in a system-prompt chunk shared by every conversation: the promote that
 * finds it moves that one file aside and deletes nothing else - every other
 * chunk file, every entry directory and row stays; the entries through the
 * chunk are not offered (a miss) until a spill over the same prompt writes
 * the chunk again, after which every one of them serves bit-exact; the
 * decisions are counted (chunks_quarantined, entries_unservable,
 * chunks_rewritten). Damaged chunk rows - the kvtier_chunks table emptied, or
 * one row's parent_key replaced by random bytes - cost no entry either: the
 * chain table is rebuilt from the chunk files once, and every entry serves.
 * A chained-entry row pointed at another salt's chain is never followed: the
 * tail's own manifest names its chain. The damaged mark survives a reopen
 * (read back from quarantine/): nothing is offered or counted again.
 */
#include "fmt_testlib.h"
#include "tier_testlib.h"
#include "kvtier.h"
#include "kvtier_sys.h"

#include <dirent.h>
#include <sqlite3.h>
#include <sys/stat.h>

#define C 16
#define N_CONV 6
#define N_TOK 69 /* 32 shared + 32 own + 5 in the tail */

static char *g_dir;

static kvt_tier *open_tier(const char *dir) {
  kvt_options o = KVT_OPTIONS_INIT;
  o.cache_dir = dir;
  o.durability = KVT_DURABILITY_NONE;
  o.chunk_tokens = C;
  o.model_id = "contain";
  o.host_cache_bytes = 0; /* every promote reads the files */
  kvt_tier *t;
  REQUIRE(kvt_tier_open(&t, &o) == 0);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  return t;
}

static void conv(int32_t *tok, int c) {
  for (int i = 0; i < 32; i++)
    tok[i] = 300 + i; /* the system prompt */
  for (int i = 32; i < N_TOK; i++)
    tok[i] = 7000 + c * 100 + i;
}

static void spill(kvt_tier *t, const int32_t *tok) {
  CHECK(t_kv_spill(t, tok, N_TOK, N_TOK, 2, 1000) == 0);
}

/* 1 served bit-exact, 0 refused, -1 served wrong data. */
static int serve(kvt_tier *t, const int32_t *tok) {
  kvt_entry *e = NULL;
  int rc = kvt_tier_promote(&e, t, tok, N_TOK, NULL);
  int r = rc != 0 ? 0 : t_kv_matches(e, tok, N_TOK, N_TOK, 2) ? 1 : -1;
  kvt_entry_free(e);
  return r;
}

static void count_file(void *ctx, const char *path) {
  (void)path;
  (*(int *)ctx)++;
}
static int chunk_files(const char *dir) {
  int n = 0;
  kvt_test_each_chunk(dir, count_file, &n);
  return n;
}
static int data_dirs(const char *dir) {
  char p[4200];
  snprintf(p, sizeof p, "%s/data", dir);
  return kvt_test_count_dir(p, NULL);
}

static kvt_stats stats_of(kvt_tier *t) {
  kvt_stats s = KVT_STATS_INIT;
  REQUIRE(kvt_tier_stats(&s, t) == 0);
  return s;
}

static void test_shared_chunk_flipped(void) {
  char *dir = t_join(g_dir, "flip");
  kvt_tier *t = open_tier(dir);
  int32_t tok[N_CONV + 1][N_TOK];
  for (int c = 0; c <= N_CONV; c++)
    conv(tok[c], c);
  for (int c = 0; c < N_CONV; c++)
    spill(t, tok[c]);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  int files0 = chunk_files(dir), dirs0 = data_dirs(dir);
  CHECK_EQ_INT(files0, 2 + 2 * N_CONV);
  CHECK_EQ_INT(dirs0, N_CONV);
  char h[65];
  kvt_test_model_hash(h, "contain", tok[0], N_TOK);
  kvt_chunk_info *ch = NULL;
  size_t n = 0;
  REQUIRE(kvt_tier_entry_chain(&ch, &n, NULL, t, h, 0) == 0 && n == 4);
  CHECK_EQ_INT(ch[1].entries, N_CONV); /* the prompt's second chunk */
  char p[4400];
  snprintf(p, sizeof p, "%s/chunks/%.2s/%s.kvc", dir, ch[1].key, ch[1].key);
  kvt_free(ch);
  REQUIRE(t_flip(p, -1) == 0);

  /* The serving path finds it: that file alone leaves chunks/. */
  CHECK_EQ_INT(serve(t, tok[0]), 0);
  CHECK(!kvt_test_exists(p));
  CHECK_EQ_INT(chunk_files(dir), files0 - 1);
  CHECK_EQ_INT(data_dirs(dir), dirs0);
  kvt_stats s = stats_of(t);
  CHECK_EQ_INT(s.chunks_quarantined, 1);
  CHECK_EQ_INT(s.entries_unservable, N_CONV);
  CHECK_EQ_INT(s.entries, N_CONV);
  /* The others are not offered, and nothing more is removed. */
  kvt_entry_info info;
  for (int c = 0; c < N_CONV; c++) {
    CHECK_EQ_INT(kvt_tier_lookup(&info, t, tok[c], N_TOK), KVT_ENOTFOUND);
    CHECK_EQ_INT(serve(t, tok[c]), 0);
  }
  CHECK_EQ_INT(chunk_files(dir), files0 - 1);
  CHECK_EQ_INT(data_dirs(dir), dirs0);
  CHECK_EQ_INT(stats_of(t).chunks_quarantined, 1);

  /* A new conversation over the same prompt writes the chunk again. */
  spill(t, tok[N_CONV]);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  CHECK_EQ_INT(stats_of(t).chunks_rewritten, 1);
  CHECK(kvt_test_exists(p));
  for (int c = 0; c <= N_CONV; c++)
    CHECK_EQ_INT(serve(t, tok[c]), 1);
  REQUIRE(kvt_tier_close(t, -1) == 0);
  kvt_tier_free(t);
  free(dir);
}

/* The damaged mark outlives the tier that set it: its persistent record is
 * the quarantine move. A tier reopened on the directory does not offer the
 * entries through the quarantined chunk (lookups miss, as in the tier that
 * found it) and counts nothing again (chunks_quarantined, quarantined and
 * entries_unservable stay 0 in it however often they are asked for); a
 * spill over the prompt writes the chunk again and they all serve, and a
 * tier opened after that marks nothing. Before, a reopened tier offered
 * them again (lookup hit, then a failed promote) and counted the chunk as
 * newly quarantined. */
static void test_mark_survives_reopen(void) {
  char *dir = t_join(g_dir, "reopen");
  kvt_tier *t = open_tier(dir);
  int32_t tok[N_CONV + 1][N_TOK];
  for (int c = 0; c <= N_CONV; c++)
    conv(tok[c], c);
  for (int c = 0; c < N_CONV; c++)
    spill(t, tok[c]);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  char h[65];
  kvt_test_model_hash(h, "contain", tok[0], N_TOK);
  kvt_chunk_info *ch = NULL;
  size_t n = 0;
  REQUIRE(kvt_tier_entry_chain(&ch, &n, NULL, t, h, 0) == 0 && n == 4);
  char p[4400];
  snprintf(p, sizeof p, "%s/chunks/%.2s/%s.kvc", dir, ch[1].key, ch[1].key);
  kvt_free(ch);
  REQUIRE(t_flip(p, -1) == 0);
  CHECK_EQ_INT(serve(t, tok[0]), 0);
  CHECK_EQ_INT(stats_of(t).chunks_quarantined, 1);
  REQUIRE(kvt_tier_close(t, -1) == 0);
  kvt_tier_free(t);

  t = open_tier(dir);
  kvt_entry_info info;
  for (int c = 0; c < N_CONV; c++) {
    CHECK_EQ_INT(kvt_tier_lookup(&info, t, tok[c], N_TOK), KVT_ENOTFOUND);
    CHECK_EQ_INT(serve(t, tok[c]), 0);
  }
  kvt_stats s = stats_of(t);
  CHECK_EQ_INT(s.chunks_quarantined, 0);
  CHECK_EQ_INT(s.quarantined, 0);
  CHECK_EQ_INT(s.entries_unservable, 0);
  CHECK_EQ_INT(s.entries, N_CONV); /* kept, never removed */
  spill(t, tok[N_CONV]);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  CHECK_EQ_INT(stats_of(t).chunks_rewritten, 1);
  for (int c = 0; c <= N_CONV; c++)
    CHECK_EQ_INT(serve(t, tok[c]), 1);
  REQUIRE(kvt_tier_close(t, -1) == 0);
  kvt_tier_free(t);

  /* The record is still in quarantine/, the file back: nothing marked. */
  t = open_tier(dir);
  for (int c = 0; c <= N_CONV; c++) {
    CHECK_EQ_INT(kvt_tier_lookup(&info, t, tok[c], N_TOK), 0);
    CHECK_EQ_INT(serve(t, tok[c]), 1);
  }
  CHECK_EQ_INT(stats_of(t).chunks_quarantined, 0);
  REQUIRE(kvt_tier_close(t, -1) == 0);
  kvt_tier_free(t);
  free(dir);
}

/* Runs sql on dir/index.db (the tier closed). */
static void damage_index(const char *dir, const char *sql) {
  char db[4200];
  snprintf(db, sizeof db, "%s/index.db", dir);
  sqlite3 *h = NULL;
  REQUIRE(sqlite3_open(db, &h) == SQLITE_OK);
  char *err = NULL;
  int rc = sqlite3_exec(h, sql, NULL, NULL, &err);
  if (rc != SQLITE_OK)
    fprintf(stderr, "sql: %s\n", err ? err : "?");
  sqlite3_free(err);
  REQUIRE(rc == SQLITE_OK);
  sqlite3_close(h);
}

static void rows_damaged(const char *tag, const char *sql) {
  char *dir = t_join(g_dir, tag);
  kvt_tier *t = open_tier(dir);
  int32_t tok[N_CONV][N_TOK];
  for (int c = 0; c < N_CONV; c++) {
    conv(tok[c], c);
    spill(t, tok[c]);
  }
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  REQUIRE(kvt_tier_close(t, -1) == 0);
  kvt_tier_free(t);
  int files0 = chunk_files(dir);
  damage_index(dir, sql);
  t = open_tier(dir);
  /* At most the first read misses (it finds the chain cut and rebuilds the
   * chain table from the chunk files); no entry or chunk is deleted. */
  int served = 0;
  for (int round = 0; round < 2; round++)
    for (int c = 0; c < N_CONV; c++) {
      int r = serve(t, tok[c]);
      CHECK(r >= 0);
      served += round == 1 && r == 1;
    }
  CHECK_EQ_INT(served, N_CONV);
  CHECK_EQ_INT(data_dirs(dir), N_CONV);
  CHECK_EQ_INT(chunk_files(dir), files0);
  REQUIRE(kvt_tier_close(t, -1) == 0);
  kvt_tier_free(t);
  free(dir);
}

static void test_chunk_table_emptied(void) {
  rows_damaged("empty", "DELETE FROM kvtier_chunks");
}

static void test_random_parent_key(void) {
  rows_damaged("parent",
               "UPDATE kvtier_chunks SET parent_key = randomblob(32) WHERE "
               "rowid = (SELECT rowid FROM kvtier_chunks WHERE chunk_index "
               "= 1 LIMIT 1)");
}

/* A chained-entry row pointed (index damaged or tampered with) at another
 * salt's chain of the same tokens: the tail's own manifest names its chain,
 * and the read uses that one - alice is served alice's KV, never bob's. */
static void test_row_points_at_other_salt(void) {
  char *dir = t_join(g_dir, "salts");
  kvt_tier *t = open_tier(dir);
  int32_t tok[40];
  for (int i = 0; i < 40; i++)
    tok[i] = 900 + i;
  const char *salt[2] = {"alice", "bob"};
  kvt_layer l[2][2];
  char name[2][65];
  kvt_rng r = {4321};
  for (int s = 0; s < 2; s++) {
    kvt_call_opts co = KVT_CALL_OPTS_INIT;
    co.cache_salt = salt[s];
    co.cache_salt_len = strlen(salt[s]);
    for (int i = 0; i < 2; i++)
      l[s][i] = t_kv(&r, KVT_DTYPE_F16, 1, 2, 48, 8, 40);
    REQUIRE(kvt_tier_spill_ex(t, tok, 40, l[s], 2, 1000, &co) == 0);
    REQUIRE(kvt_tier_flush(t, -1) == 0);
    kvt_entry_info info;
    REQUIRE(kvt_tier_lookup_ex(&info, t, tok, 40, &co) == 0);
    memcpy(name[s], info.token_hash, 65);
  }
  REQUIRE(kvt_tier_close(t, -1) == 0);
  kvt_tier_free(t);
  char sql[512];
  snprintf(sql, sizeof sql,
           "UPDATE kvtier_chained_entries SET last_key = (SELECT last_key "
           "FROM kvtier_chained_entries WHERE token_hash = x'%s') WHERE "
           "token_hash = x'%s'",
           name[1], name[0]);
  damage_index(dir, sql);
  t = open_tier(dir);
  for (int s = 0; s < 2; s++) {
    kvt_promote_opts po = KVT_PROMOTE_OPTS_INIT;
    po.cache_salt = salt[s];
    po.cache_salt_len = strlen(salt[s]);
    for (int trim = 0; trim < 2; trim++) {
      kvt_entry *e = NULL;
      int rc = trim ? kvt_tier_promote_trim(&e, t, tok, 40, 32, &po)
                    : kvt_tier_promote(&e, t, tok, 40, &po);
      CHECK_EQ_INT(rc, 0);
      if (e && !trim)
        CHECK(t_layer_eq(kvt_entry_layer(e, 0), &l[s][0]) &&
              t_layer_eq(kvt_entry_layer(e, 1), &l[s][1]));
      if (e && trim)
        CHECK(t_rows_match(&kvt_entry_layer(e, 0)->tensors[0],
                           &l[s][0].tensors[0], 32));
      kvt_entry_free(e);
    }
  }
  REQUIRE(kvt_tier_close(t, -1) == 0);
  kvt_tier_free(t);
  for (int s = 0; s < 2; s++)
    for (int i = 0; i < 2; i++)
      t_layer_free(&l[s][i]);
  free(dir);
}

int main(void) {
  g_dir = kvt_test_tmpdir("contain");
  RUN(test_shared_chunk_flipped);
  RUN(test_mark_survives_reopen);
  RUN(test_chunk_table_emptied);
  RUN(test_random_parent_key);
  RUN(test_row_points_at_other_salt);
  return kvt_test_done();
}
