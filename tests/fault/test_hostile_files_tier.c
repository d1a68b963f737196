/*
 * test_hostile_files_tier.c - files planted in a cache directory that must
 * never make kvtier wait (issue 18, item 3). A FIFO put in place of each file
 * an entry holds (a layer file, manifest.json, manifest.sum, tokens.bin) used
 * to block the first open(2) of it forever: promote, verify, describe, the
 * read-only tools, and behind them the writer and close. Here every call of
 * the public API that may touch the planted file - on a read-only tier and on
 * the writer's, promote (sync and async), read_entry, verify, describe,
 * reconcile, a re-spill of the same key, a spill of another key, flush, close -
 * must return within a second, the planted entry is never served, and the
 * other entry still promotes bit-exact. A watchdog (SIGALRM) turns a hang into
 * a failure naming the call that hung.
 */
#include "rel_tier.h"

#include <signal.h>
#include <sys/stat.h>
#include <time.h>

static char g_root[4096];
static const char *volatile g_step = "setup";

static void on_alarm(int sig) {
  (void)sig;
  static const char msg[] = "FAIL: hung in ";
  ssize_t w = write(2, msg, sizeof msg - 1);
  const char *s = g_step;
  w = write(2, s, strlen(s));
  w = write(2, "\n", 1);
  (void)w;
  _exit(1);
}

/* Runs expr as step name; a hang fires the watchdog, a slow return fails. */
#define STEP(name, expr)                                                       \
  do {                                                                         \
    g_step = (name);                                                           \
    alarm(20);                                                                 \
    double t0_ = rel_now_ms();                                                 \
    expr;                                                                      \
    double dt_ = rel_now_ms() - t0_;                                           \
    alarm(0);                                                                  \
    if (dt_ >= 1000)                                                           \
      fprintf(stderr, "  %s took %.0f ms\n", (name), dt_);                     \
    CHECK(dt_ < 1000);                                                         \
  } while (0)

/* A cache holding entries a (the victim) and b (a bystander). */
typedef struct fixture {
  char *dir;
  t_entry a, b, c;
  char ha[65], hb[65];
} fixture;

static void fx_init(fixture *f, const char *name, uint32_t layers) {
  memset(f, 0, sizeof *f);
  f->dir = rel_path(g_root, name, NULL);
  f->a = t_make(31, 16, layers, 4, 4);
  f->b = t_make(32, 17, layers, 4, 4);
  f->c = t_make(33, 18, layers, 4, 4);
  kvt_token_hash(f->ha, f->a.tokens, f->a.n_tokens);
  kvt_token_hash(f->hb, f->b.tokens, f->b.n_tokens);
  t_entry *es[2] = {&f->a, &f->b};
  rel_spill_all(f->dir, es, 2);
}

static void fx_free(fixture *f) {
  free(f->dir);
  t_free(&f->a);
  t_free(&f->b);
  t_free(&f->c);
}

/* Replaces file in a's entry directory with a FIFO. */
static void plant_fifo(const fixture *f, const char *file) {
  char *ed = rel_path(f->dir, "data", f->ha);
  char *p = rel_path(ed, file, NULL);
  REQUIRE(unlink(p) == 0);
  REQUIRE(mkfifo(p, 0600) == 0);
  free(p);
  free(ed);
}

/* Every read path on a read-only tier (what `kvtier ls/verify/describe`
 * use): nothing may wait, a's entry is never served. */
static void exercise_readonly(fixture *f) {
  kvt_options o = rel_opts(f->dir, KVT_DURABILITY_NONE);
  o.flags = KVT_OPEN_READONLY;
  kvt_tier *t = NULL;
  int rc;
  STEP("read-only open", rc = kvt_tier_open(&t, &o));
  REQUIRE(rc == 0);
  kvt_entry *got = NULL;
  STEP("read-only promote",
       rc = kvt_tier_promote(&got, t, f->a.tokens, f->a.n_tokens, NULL));
  CHECK(rc != 0 && got == NULL);
  STEP("read-only verify", rc = kvt_tier_verify(t, f->ha, 0));
  CHECK_EQ_INT(rc, KVT_ECORRUPT);
  char *json = NULL;
  STEP("read-only describe", rc = kvt_tier_describe(&json, t, f->ha));
  kvt_free(json);
  json = NULL;
  STEP("read-only promote of b",
       rc = kvt_tier_promote(&got, t, f->b.tokens, f->b.n_tokens, NULL));
  CHECK_EQ_INT(rc, 0);
  if (rc == 0)
    CHECK(t_same(got, &f->b));
  kvt_entry_free(got);
  STEP("read-only close", kvt_tier_close(t, -1); kvt_tier_free(t));
}

/* The writer's tier: describe, verify, promote (sync and async), read_entry,
 * reconcile, a re-spill of a, a spill of c, flush, close. */
static void exercise_writer(fixture *f) {
  kvt_options o = rel_opts(f->dir, KVT_DURABILITY_NONE);
  kvt_tier *t = NULL;
  int rc;
  STEP("open", rc = kvt_tier_open(&t, &o));
  REQUIRE(rc == 0);
  STEP("start writer", rc = kvt_tier_start_writer(t));
  CHECK_EQ_INT(rc, 0);
  char *json = NULL;
  STEP("describe", rc = kvt_tier_describe(&json, t, f->ha));
  kvt_free(json);
  STEP("verify", rc = kvt_tier_verify(t, f->ha, 0));
  CHECK(rc == KVT_ECORRUPT || rc == KVT_ENOTFOUND);
  kvt_promise *p = NULL;
  STEP("promote_async",
       rc = kvt_tier_promote_async(&p, t, f->a.tokens, f->a.n_tokens, NULL));
  if (rc == 0) {
    STEP("promise wait", rc = kvt_promise_wait(p, 5000));
    CHECK_EQ_INT(rc, 0);
    kvt_entry *e = NULL;
    CHECK(kvt_promise_result(&e, p) != 0 && e == NULL);
    kvt_promise_free(p);
  }
  kvt_entry *got = NULL;
  STEP("promote",
       rc = kvt_tier_promote(&got, t, f->a.tokens, f->a.n_tokens, NULL));
  CHECK(rc != 0 && got == NULL);
  STEP("read_entry",
       rc = kvt_tier_read_entry(&got, t, f->a.tokens, f->a.n_tokens, f->ha));
  CHECK(rc != 0 && got == NULL);
  int64_t n;
  STEP("reconcile", n = kvt_tier_reconcile(t));
  CHECK(n >= 0);
  STEP("re-spill of a", rc = t_spill(t, &f->a));
  CHECK_EQ_INT(rc, 0);
  STEP("spill of c", rc = t_spill(t, &f->c));
  CHECK_EQ_INT(rc, 0);
  STEP("flush", rc = kvt_tier_flush(t, 5000));
  CHECK_EQ_INT(rc, 0);
  STEP("promote of c",
       rc = kvt_tier_promote(&got, t, f->c.tokens, f->c.n_tokens, NULL));
  CHECK_EQ_INT(rc, 0);
  if (rc == 0)
    CHECK(t_same(got, &f->c));
  kvt_entry_free(got);
  got = NULL;
  STEP("promote of b",
       rc = kvt_tier_promote(&got, t, f->b.tokens, f->b.n_tokens, NULL));
  CHECK_EQ_INT(rc, 0);
  if (rc == 0)
    CHECK(t_same(got, &f->b));
  kvt_entry_free(got);
  STEP("close", rc = kvt_tier_close(t, 5000));
  CHECK_EQ_INT(rc, 0);
  kvt_tier_free(t);
}

static void test_fifo_planted(void) {
  static const char *files[] = {"layer_0.safetensors", "layer_1.safetensors",
                                "manifest.json", "manifest.sum", "tokens.bin"};
  for (size_t k = 0; k < sizeof files / sizeof *files; k++) {
    char name[32];
    snprintf(name, sizeof name, "fifo%zu", k);
    fprintf(stderr, "  FIFO as %s\n", files[k]);
    fixture f;
    fx_init(&f, name, 4); /* >= 4 layers: headers are prefetched */
    plant_fifo(&f, files[k]);
    exercise_readonly(&f);
    exercise_writer(&f);
    /* The re-spilled a is a normal entry again; b and c are intact. */
    CHECK_EQ_INT(rel_check_dir(f.dir, NULL), 3);
    fx_free(&f);
  }
}

int main(void) {
  r_use_fast_tmp();
  signal(SIGALRM, on_alarm);
  snprintf(g_root, sizeof g_root, "%s", kvt_test_tmpdir("hostile"));
  RUN(test_fifo_planted);
  return kvt_test_done();
}
