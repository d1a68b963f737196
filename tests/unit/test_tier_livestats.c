/*
 * test_tier_livestats.c - the live stats file (src/statsfile.c, FORMAT.md
 * "stats.bin") read through the public kvt_stats_read_live: absent before a
 * writer opens the directory; published by a writable tier with this pid and
 * alive; counters, token counters, histograms and gauges that follow spills
 * and promotes and agree with kvt_tier_stats; consistent and monotonic while
 * another thread keeps updating; kept with alive = 0 after close; reset by the
 * next writer; never created by a read-only open; alive = 0 for a writer that
 * died without closing; refused when damaged.
 */
#include "tier_testlib.h"
#include "testutil.h"
#include "kvtier_sys.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static uint64_t hist_sum(const uint64_t *h) {
  uint64_t n = 0;
  for (int i = 0; i < KVT_STATS_LATENCY_BUCKETS; i++)
    n += h[i];
  return n;
}

static char *stats_path(const char *dir) {
  static char p[4200];
  snprintf(p, sizeof p, "%s/stats.bin", dir);
  return p;
}

static void test_publish_and_close(void) {
  kvt_options o = t_opts("live");
  kvt_stats s = KVT_STATS_INIT;
  kvt_stats_live lv;
  CHECK_EQ_INT(kvt_stats_read_live(&s, &lv, o.cache_dir), KVT_ENOTFOUND);
  CHECK_EQ_INT(kvt_stats_read_live(&s, &lv, NULL), KVT_EINVAL);

  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  memset(&lv, 0, sizeof lv);
  CHECK_EQ_INT(kvt_stats_read_live(&s, &lv, o.cache_dir), 0);
  CHECK_EQ_INT(lv.alive, 1);
  CHECK_EQ_INT(lv.pid, (int64_t)getpid());
  CHECK(lv.started_at > 1e9 && lv.updated_at >= lv.started_at);
  CHECK_EQ_INT(s.spill_count, 0);

  t_entry a = t_make(1, 40, 2, 8, 16), b = t_make(2, 24, 2, 8, 16);
  t_entry miss = t_make(3, 12, 1, 8, 16);
  REQUIRE(t_spill(t, &a) == 0 && t_spill(t, &b) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  kvt_entry *e = NULL;
  REQUIRE(kvt_tier_promote(&e, t, a.tokens, a.n_tokens, NULL) == 0);
  CHECK(t_same(e, &a));
  kvt_entry_free(e);
  CHECK_EQ_INT(kvt_tier_promote(&e, t, miss.tokens, miss.n_tokens, NULL),
               KVT_ENOTFOUND);

  CHECK_EQ_INT(kvt_stats_read_live(&s, &lv, o.cache_dir), 0);
  CHECK_EQ_INT(lv.alive, 1);
  CHECK_EQ_INT(s.spill_count, 2);
  CHECK(s.spill_bytes > 0);
  CHECK_EQ_INT(s.ssd_hits, 1);
  CHECK_EQ_INT(s.ssd_misses, 1);
  CHECK_EQ_INT(s.tokens_requested, a.n_tokens + miss.n_tokens);
  CHECK_EQ_INT(s.tokens_served, a.n_tokens);
  CHECK_EQ_INT(hist_sum(s.promote_latency_hist), 1);
  CHECK_EQ_INT(hist_sum(s.spill_latency_hist), 2);
  CHECK(s.spill_latency_sum > 0 && s.reload_latency_sum > 0);
  /* Gauges are refreshed after every spill, without a kvt_tier_stats call. */
  CHECK_EQ_INT(s.entries, 2);
  CHECK(s.disk_bytes > 0);
  /* The in-process snapshot agrees. */
  kvt_stats in = KVT_STATS_INIT;
  REQUIRE(kvt_tier_stats(&in, t) == 0);
  CHECK_EQ_INT(in.spill_count, s.spill_count);
  CHECK_EQ_INT(in.spill_bytes, s.spill_bytes);
  CHECK_EQ_INT(in.tokens_served, s.tokens_served);
  CHECK_EQ_INT(in.disk_bytes, s.disk_bytes);
  CHECK(in.reload_latency_sum == s.reload_latency_sum);
  /* kvt_tier_stats_add is published too. */
  REQUIRE(kvt_tier_stats_add(t, "promotion_failures", 5) == 0);
  CHECK_EQ_INT(kvt_stats_read_live(&s, NULL, o.cache_dir), 0);
  CHECK_EQ_INT(s.promotion_failures, 5);

  REQUIRE(kvt_tier_close(t, -1) == 0);
  kvt_tier_free(t);
  CHECK_EQ_INT(kvt_stats_read_live(&s, &lv, o.cache_dir), 0);
  CHECK_EQ_INT(lv.alive, 0); /* closed: the last figures remain */
  CHECK_EQ_INT(lv.pid, (int64_t)getpid());
  CHECK_EQ_INT(s.spill_count, 2);

  /* A read-only open neither publishes nor changes the file. */
  o.flags |= KVT_OPEN_READONLY;
  t = t_open(&o);
  CHECK_EQ_INT(kvt_stats_read_live(&s, &lv, o.cache_dir), 0);
  CHECK_EQ_INT(lv.alive, 0);
  CHECK_EQ_INT(s.spill_count, 2);
  kvt_tier_close(t, -1);
  kvt_tier_free(t);
  unlink(stats_path(o.cache_dir));
  t = t_open(&o);
  CHECK_EQ_INT(kvt_stats_read_live(&s, &lv, o.cache_dir), KVT_ENOTFOUND);
  kvt_tier_close(t, -1);
  kvt_tier_free(t);

  /* The next writer starts from zero counters (and measured gauges). */
  o.flags &= ~KVT_OPEN_READONLY;
  t = t_open(&o);
  CHECK_EQ_INT(kvt_stats_read_live(&s, &lv, o.cache_dir), 0);
  CHECK_EQ_INT(lv.alive, 1);
  CHECK_EQ_INT(s.spill_count, 0);
  CHECK_EQ_INT(s.ssd_hits, 0);
  kvt_tier_close(t, -1);
  kvt_tier_free(t);
  t_free(&a);
  t_free(&b);
  t_free(&miss);
}

/* A reader racing a writer thread: every read succeeds with the publisher
 * alive, the counter never goes back, and it is seen moving (reads go on past
 * the first 2000 until it has moved, for up to 20 s: on a loaded machine the
 * adder thread may not have run at all during 2000 fast reads). */
typedef struct racer {
  kvt_tier *t;
  atomic_int stop;
} racer;

static void *add_loop(void *arg) {
  racer *r = arg;
  while (!atomic_load(&r->stop))
    kvt_tier_stats_add(r->t, "quarantined", 1);
  return NULL;
}

static void test_concurrent_reads(void) {
  kvt_options o = t_opts("live-race");
  racer r = {t_open(&o), 0};
  pthread_t th;
  REQUIRE(pthread_create(&th, NULL, add_loop, &r) == 0);
  uint64_t last = 0;
  int moved = 0;
  struct timespec t0, tn;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (int i = 0;; i++) {
    if (i >= 2000) {
      clock_gettime(CLOCK_MONOTONIC, &tn);
      if (moved || tn.tv_sec - t0.tv_sec > 20)
        break;
    }
    kvt_stats s = KVT_STATS_INIT;
    kvt_stats_live lv;
    CHECK_EQ_INT(kvt_stats_read_live(&s, &lv, o.cache_dir), 0);
    CHECK(s.quarantined >= last);
    moved += s.quarantined > last;
    last = s.quarantined;
    CHECK_EQ_INT(lv.alive, 1);
  }
  atomic_store(&r.stop, 1);
  pthread_join(th, NULL);
  CHECK(moved > 0);
  kvt_stats in = KVT_STATS_INIT;
  REQUIRE(kvt_tier_stats(&in, r.t) == 0);
  kvt_stats s = KVT_STATS_INIT;
  CHECK_EQ_INT(kvt_stats_read_live(&s, NULL, o.cache_dir), 0);
  CHECK_EQ_INT(s.quarantined, in.quarantined);
  kvt_tier_close(r.t, -1);
  kvt_tier_free(r.t);
}

/* A writer that dies without closing leaves state "open" with its pid: the
 * reader sees that pid is gone. */
static void test_dead_writer(void) {
  kvt_options o = t_opts("live-dead");
  fflush(NULL);
  pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    kvt_tier *t = NULL;
    _exit(kvt_tier_open(&t, &o) == 0 ? 0 : 1);
  }
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);
  REQUIRE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  kvt_stats_live lv;
  CHECK_EQ_INT(kvt_stats_read_live(NULL, &lv, o.cache_dir), 0);
  CHECK_EQ_INT(lv.pid, (int64_t)child);
  CHECK_EQ_INT(lv.alive, 0);
}

static void put_file(const char *path, const void *data, size_t n) {
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
  REQUIRE(fd >= 0);
  REQUIRE(write(fd, data, n) == (ssize_t)n);
  close(fd);
}

static void test_damaged(void) {
  char *dir = kvt_test_tmpdir("live-bad");
  static char page[4096];
  kvt_stats s = KVT_STATS_INIT;
  put_file(stats_path(dir), page, sizeof page); /* zeros: no magic */
  CHECK_EQ_INT(kvt_stats_read_live(&s, NULL, dir), KVT_ECORRUPT);
  put_file(stats_path(dir), "KVTSTAT", 8); /* wrong size */
  CHECK_EQ_INT(kvt_stats_read_live(&s, NULL, dir), KVT_ECORRUPT);
  memcpy(page, "KVTSTAT", 8);
  page[8] = 99; /* unknown version */
  put_file(stats_path(dir), page, sizeof page);
  CHECK_EQ_INT(kvt_stats_read_live(&s, NULL, dir), KVT_ECORRUPT);
  /* A FIFO or a symlink in its place: refused at once, never waited on. */
  unlink(stats_path(dir));
  REQUIRE(mkfifo(stats_path(dir), 0600) == 0);
  CHECK_EQ_INT(kvt_stats_read_live(&s, NULL, dir), KVT_ECORRUPT);
  unlink(stats_path(dir));
  REQUIRE(symlink("/etc/passwd", stats_path(dir)) == 0);
  CHECK(kvt_stats_read_live(&s, NULL, dir) != 0);
  /* ... and the writer neither follows it nor fails to open: no live view. */
  kvt_options o;
  kvt_options_init(&o, KVT_OPTIONS_VERSION);
  o.cache_dir = dir;
  o.durability = KVT_DURABILITY_NONE;
  kvt_tier *t = t_open(&o);
  CHECK(kvt_stats_read_live(&s, NULL, dir) != 0);
  kvt_tier_close(t, -1);
  kvt_tier_free(t);
  unlink(stats_path(dir));
  put_file(stats_path(dir), page, sizeof page);
  /* A writer takes a damaged file over. */
  t = t_open(&o);
  kvt_stats_live lv;
  CHECK_EQ_INT(kvt_stats_read_live(&s, &lv, dir), 0);
  CHECK_EQ_INT(lv.alive, 1);
  kvt_tier_close(t, -1);
  kvt_tier_free(t);
}

int main(void) {
  RUN(test_publish_and_close);
  RUN(test_concurrent_reads);
  RUN(test_dead_writer);
  RUN(test_damaged);
  return kvt_test_done();
}
