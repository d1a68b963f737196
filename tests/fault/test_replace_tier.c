/*
 * test_replace_tier.c - a failed replacement never loses the acknowledged
 * version (issue 18, item 2). Another process holding index.db's write lock
 * past the busy timeout used to make the writer swap in the new files, delete
 * the old ones, fail the index commit and then remove the new files too: the
 * key had nothing left. Here another process holds the write lock (BEGIN
 * IMMEDIATE) while the same tokens are spilled again with new data:
 *  - held past the writer's busy budget: the spill fails (write_failures,
 *    spill_done status), the old version is still served bit-exact, row and
 *    all, during the wait and after, and after a reopen;
 *  - released after a moment: the spill succeeds and the new version is
 *    served;
 *  - during the wait the writer does not hold the tier's mutation lock: a
 *    reconcile (which takes it) returns at once instead of after the wait.
 */
#include "rel_tier.h"

#include <signal.h>
#include <sqlite3.h>
#include <sys/wait.h>
#include <time.h>

static char g_root[4096];

/* Same tokens as e, other tensor values. */
static t_entry variant(const t_entry *e, uint64_t seed) {
  t_entry v = t_make(seed, e->n_tokens, e->n_layers,
                     (int)e->layers[0].tensors[0].shape[2], 4);
  memcpy(v.tokens, e->tokens, e->n_tokens * sizeof(int32_t));
  return v;
}

/* Same tokens as e (T = n_tokens rows), other values in rows [keep, T): a
 * re-spill of a chunked prefix whose chunk rows are the same KV (chunks are
 * keyed by tokens, as the engine's KV of the same prefix is the same). */
static t_entry variant_tail(const t_entry *e, uint64_t seed, size_t keep) {
  t_entry v = variant(e, seed);
  t_copy_rows(&v, e, keep);
  return v;
}

static const char *g_self;

/* Another process holding index.db's write lock (BEGIN IMMEDIATE) until it
 * is killed; returns its pid once the lock is held. A fresh process image
 * (this test re-executed with --hold-lock): SQLite's lock bookkeeping does
 * not survive a plain fork of a process that has the database open. */
static pid_t lock_index(const char *dir) {
  char *db = rel_path(dir, "index.db", NULL);
  int p[2];
  REQUIRE(pipe(p) == 0);
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    close(p[0]);
    dup2(p[1], 1);
    execl(g_self, g_self, "--hold-lock", db, (char *)NULL);
    _exit(127);
  }
  close(p[1]);
  char c = 0;
  REQUIRE(read(p[0], &c, 1) == 1 && c == 'L');
  close(p[0]);
  free(db);
  return pid;
}

static int hold_lock_main(const char *db) {
  sqlite3 *h = NULL;
  if (sqlite3_open(db, &h) != SQLITE_OK ||
      sqlite3_exec(h, "BEGIN IMMEDIATE", NULL, NULL, NULL) != SQLITE_OK)
    return 1;
  if (write(1, "L", 1) != 1)
    return 1;
  for (;;)
    pause();
}

static void unlock_index(pid_t pid) {
  kill(pid, SIGKILL);
  waitpid(pid, NULL, 0);
}

static int served_as(kvt_tier *t, const t_entry *e) {
  kvt_entry *got = NULL;
  int rc = kvt_tier_promote(&got, t, e->tokens, e->n_tokens, NULL);
  int same = rc == 0 && t_same(got, e);
  kvt_entry_free(got);
  return same;
}

/* n_tokens 20: a whole entry; 300 (= rows): a chained entry of the default
 * chunk_tokens (256), its chain shared by both versions, its tail replaced. */
static void run(const char *name, int hold_ms, size_t n_tokens) {
  char *dir = rel_path(g_root, name, NULL);
  rel_done *done = calloc(1, sizeof *done);
  pthread_mutex_init(&done->mu, NULL);
  kvt_options o = rel_opts(dir, KVT_DURABILITY_NONE);
  o.spill_done_fn = rel_done_fn;
  o.spill_done_ctx = done;
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  int chained = n_tokens >= 256;
  t_entry v1 = t_make(51, n_tokens, 2, chained ? (int)n_tokens : 4, 4);
  t_entry v2 = chained ? variant_tail(&v1, 52, 256) : variant(&v1, 52);
  char h[65];
  kvt_token_hash(h, v1.tokens, v1.n_tokens);
  REQUIRE(t_spill(t, &v1) == 0 && kvt_tier_flush(t, -1) == 0);
  REQUIRE(served_as(t, &v1));
  if (chained) { /* the chunk store is in use: chunks/ holds the chain */
    char *cd = rel_path(dir, "chunks", NULL);
    CHECK(kvt_test_exists(cd));
    free(cd);
  }

  pthread_mutex_lock(&done->mu);
  int reports = done->n; /* v1's report is in already */
  pthread_mutex_unlock(&done->mu);
  pid_t lk = lock_index(dir);
  double t0 = rel_now_ms();
  REQUIRE(t_spill(t, &v2) == 0);
  rel_sleep_ms(300); /* the writer is in its busy wait now */
  double r0 = rel_now_ms();
  CHECK(kvt_tier_reconcile(t) >= 0);
  double rdt = rel_now_ms() - r0;
  if (rdt >= 1000)
    fprintf(stderr, "  reconcile waited %.0f ms for the writer\n", rdt);
  CHECK(rdt < 1000);
  CHECK(served_as(t, &v1)); /* the old version while the writer waits */
  for (;;) {
    pthread_mutex_lock(&done->mu);
    int n = done->n;
    pthread_mutex_unlock(&done->mu);
    if (n > reports || rel_now_ms() - t0 >= hold_ms)
      break;
    rel_sleep_ms(50);
  }
  unlock_index(lk);
  CHECK_EQ_INT(kvt_tier_flush(t, 30000), 0);
  int st = rel_done_status(done, h);
  kvt_stats s = rel_stats(t);
  if (hold_ms > 5000) {
    /* Held past the busy budget: the replacement failed, the old version
     * stays. */
    CHECK(st != 0 && st != 1);
    CHECK_EQ_INT(s.write_failures, 1);
    CHECK(served_as(t, &v1));
  } else {
    CHECK_EQ_INT(st, 0);
    CHECK_EQ_INT(s.write_failures, 0);
    CHECK(served_as(t, &v2));
  }
  CHECK_EQ_INT(kvt_tier_close(t, -1), 0);
  kvt_tier_free(t);
  /* And after a reopen (reconcile): the same version, the row intact. */
  t = t_open(&o);
  CHECK(served_as(t, hold_ms > 5000 ? &v1 : &v2));
  CHECK_EQ_INT(rel_stats(t).entries, 1);
  kvt_tier_close(t, -1);
  kvt_tier_free(t);
  CHECK_EQ_INT(rel_check_dir(dir, NULL), 1);
  t_free(&v1);
  t_free(&v2);
  pthread_mutex_destroy(&done->mu);
  free(done);
  free(dir);
}

static void test_busy_past_timeout_keeps_old(void) {
  run("busy-long", 7000, 20);
}

static void test_busy_briefly_replaces(void) {
  run("busy-short", 1200, 20);
}

static void test_chained_busy_past_timeout_keeps_old(void) {
  run("chained-long", 7000, 300);
}

static void test_chained_busy_briefly_replaces(void) {
  run("chained-short", 1200, 300);
}

int main(int argc, char **argv) {
  if (argc == 3 && !strcmp(argv[1], "--hold-lock"))
    return hold_lock_main(argv[2]);
  g_self = argv[0];
  r_use_fast_tmp();
  snprintf(g_root, sizeof g_root, "%s", kvt_test_tmpdir("replace"));
  RUN(test_busy_past_timeout_keeps_old);
  RUN(test_busy_briefly_replaces);
  RUN(test_chained_busy_past_timeout_keeps_old);
  RUN(test_chained_busy_briefly_replaces);
  return kvt_test_done();
}
