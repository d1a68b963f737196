/*
 * test_tier_basic.c - the tier's lifecycle and single-threaded behaviour: open
 * creates the directories, start_writer is idempotent, double close is harmless
 * and calls after close fail with KVT_ECLOSED; spill -> lookup -> promote round
 * trips (exact and prefix), replacing an entry, the queue bounds (entries and
 * bytes, writer not started), KVT_ETOOBIG, flush, no-copy spill release,
 * touch/remove/foreach/describe/verify, read-only mode, read_entry path
 * validation, stats counters and logging.
 */
#include "tier_testlib.h"

#include <math.h>

static void test_lifecycle(void) {
  kvt_options o = t_opts("life");
  char sub[4096];
  snprintf(sub, sizeof sub, "%s/nested/cache", o.cache_dir);
  o.cache_dir = sub;
  kvt_tier *t = t_open(&o);
  char p[4200];
  snprintf(p, sizeof p, "%s/data", sub);
  struct stat st;
  CHECK(stat(p, &st) == 0 && S_ISDIR(st.st_mode) &&
        (st.st_mode & 0777) == 0700);
  CHECK(stat(sub, &st) == 0 && (st.st_mode & 0777) == 0700);
  CHECK(strcmp(kvt_tier_dir(t), sub) == 0);
  CHECK_EQ_INT(kvt_tier_start_writer(t), 0);
  CHECK_EQ_INT(kvt_tier_start_writer(t), 0); /* idempotent */
  CHECK_EQ_INT(kvt_tier_close(t, -1), 0);
  CHECK_EQ_INT(kvt_tier_close(t, -1), 0); /* harmless */
  t_entry e = t_make(1, 8, 1, 4, 4);
  kvt_entry_info info;
  CHECK_EQ_INT(t_spill(t, &e), KVT_ECLOSED);
  CHECK_EQ_INT(kvt_tier_lookup(&info, t, e.tokens, e.n_tokens), KVT_ECLOSED);
  kvt_entry *got = NULL;
  CHECK_EQ_INT(kvt_tier_promote(&got, t, e.tokens, e.n_tokens, NULL),
               KVT_ECLOSED);
  kvt_promise *pr = NULL;
  CHECK_EQ_INT(kvt_tier_promote_async(&pr, t, e.tokens, e.n_tokens, NULL),
               KVT_ECLOSED);
  CHECK_EQ_INT(kvt_tier_start_writer(t), KVT_ECLOSED);
  CHECK_EQ_INT(kvt_tier_flush(t, 0), KVT_ECLOSED);
  CHECK_EQ_INT(kvt_tier_reconcile(t), KVT_ECLOSED);
  kvt_stats s = KVT_STATS_INIT;
  CHECK_EQ_INT(kvt_tier_stats(&s, t), 0); /* counters stay readable */
  kvt_tier_free(t);
  kvt_tier_free(NULL);
  /* Reopen works (the lock was released). */
  t = t_open(&o);
  kvt_tier_free(t); /* free without close */
  t_free(&e);
}

static void test_bad_options(void) {
  kvt_options o = t_opts("badopt");
  o.max_size_gb = -1;
  kvt_tier *t = NULL;
  CHECK_EQ_INT(kvt_tier_open(&t, &o), KVT_EINVAL);
  CHECK(strstr(kvt_last_error(), "max_size_gb") != NULL);
  CHECK(t == NULL);
  o.max_size_gb = 1;
  o.max_entries = 0;
  CHECK_EQ_INT(kvt_tier_open(&t, &o), KVT_EINVAL);
  CHECK(strstr(kvt_last_error(), "max_entries") != NULL);
  CHECK_EQ_INT(kvt_tier_open(NULL, &o), KVT_EINVAL);
}

static void test_roundtrip(void) {
  kvt_options o = t_opts("rt");
  kvt_tier *t = t_open(&o);
  CHECK_EQ_INT(kvt_tier_start_writer(t), 0);
  t_entry a = t_make(11, 40, 3, 8, 16);
  t_entry b = t_make(12, 64, 3, 8, 16);
  t_set_prefix(&b, &a); /* a's tokens are a prefix of b's */
  CHECK_EQ_INT(t_spill(t, &a), 0);
  CHECK_EQ_INT(kvt_tier_flush(t, -1), 0);
  kvt_entry_info info;
  CHECK_EQ_INT(kvt_tier_lookup(&info, t, a.tokens, a.n_tokens), 0);
  CHECK_EQ_INT(info.num_tokens, 40);
  CHECK_EQ_INT(info.memory_bytes, a.memory_bytes);
  CHECK(info.disk_bytes > a.memory_bytes); /* data + headers + manifest */
  char h[65];
  kvt_token_hash(h, a.tokens, a.n_tokens);
  CHECK(strcmp(info.token_hash, h) == 0);
  /* b itself is not stored; its longest stored prefix is a. */
  CHECK_EQ_INT(kvt_tier_lookup(&info, t, b.tokens, b.n_tokens), KVT_ENOTFOUND);
  CHECK_EQ_INT(kvt_tier_lookup_prefix(&info, t, b.tokens, b.n_tokens), 0);
  CHECK_EQ_INT(info.num_tokens, 40);

  kvt_entry *got = NULL;
  CHECK_EQ_INT(kvt_tier_promote(&got, t, a.tokens, a.n_tokens, NULL), 0);
  CHECK(got && t_same(got, &a));
  CHECK_EQ_INT(kvt_entry_reserved_bytes(got), 0);
  CHECK(kvt_entry_disk_bytes(got) > 0);
  CHECK(strcmp(kvt_entry_hash(got), h) == 0);
  kvt_entry_free(got);
  got = NULL;
  /* Prefix promote. */
  kvt_promote_opts po = t_popts(NULL);
  po.flags = KVT_PROMOTE_PREFIX;
  CHECK_EQ_INT(kvt_tier_promote(&got, t, b.tokens, b.n_tokens, &po), 0);
  CHECK(got && t_same(got, &a));
  kvt_entry_free(got);
  got = NULL;
  /* Exact promote of b misses. */
  CHECK_EQ_INT(kvt_tier_promote(&got, t, b.tokens, b.n_tokens, NULL),
               KVT_ENOTFOUND);
  CHECK(got == NULL);

  kvt_stats s = KVT_STATS_INIT;
  CHECK_EQ_INT(kvt_tier_stats(&s, t), 0);
  CHECK_EQ_INT(s.spill_count, 1);
  CHECK_EQ_INT(s.spill_bytes, info.disk_bytes);
  CHECK_EQ_INT(s.ssd_hits, 2);
  CHECK_EQ_INT(s.ssd_misses, 1);
  CHECK_EQ_INT(s.entries, 1);
  CHECK_EQ_INT(s.disk_bytes, info.disk_bytes);
  CHECK_EQ_INT(s.memory_bytes, a.memory_bytes);
  CHECK(s.reload_bytes >= 2 * a.memory_bytes);
  CHECK(s.reload_latency_sum >= 0);
  CHECK_EQ_INT(s.promotion_failures, 0);

  /* Replace: same tokens, different data. */
  t_entry a2 = t_make(99, 40, 2, 8, 16);
  memcpy(a2.tokens, a.tokens, 40 * 4);
  CHECK_EQ_INT(t_spill(t, &a2), 0);
  CHECK_EQ_INT(kvt_tier_flush(t, -1), 0);
  CHECK_EQ_INT(kvt_tier_promote(&got, t, a.tokens, a.n_tokens, NULL), 0);
  CHECK(got && t_same(got, &a2));
  kvt_entry_free(got);
  CHECK_EQ_INT(kvt_tier_stats(&s, t), 0);
  CHECK_EQ_INT(s.entries, 1);
  CHECK_EQ_INT(kvt_tier_close(t, -1), 0);
  kvt_tier_free(t);

  /* Everything survives a reopen (durable, indexed). */
  t = t_open(&o);
  CHECK_EQ_INT(kvt_tier_promote(&got, t, a.tokens, a.n_tokens, NULL), 0);
  CHECK(got && t_same(got, &a2));
  kvt_entry_free(got);
  kvt_tier_free(t);
  t_free(&a);
  t_free(&a2);
  t_free(&b);
}

static void test_storage_modes(void) {
  for (int mode = 0; mode < 2; mode++) {
    kvt_options o = t_opts("modes");
    o.storage_mode = mode;
    o.durability = mode ? KVT_DURABILITY_FSYNC : KVT_DURABILITY_NONE;
    kvt_tier *t = t_open(&o);
    CHECK_EQ_INT(kvt_tier_start_writer(t), 0);
    t_entry a = t_make(21 + mode, 10, 2, 3, 5);
    CHECK_EQ_INT(t_spill(t, &a), 0);
    CHECK_EQ_INT(kvt_tier_flush(t, -1), 0);
    kvt_entry *got = NULL;
    CHECK_EQ_INT(kvt_tier_promote(&got, t, a.tokens, a.n_tokens, NULL), 0);
    CHECK(got && t_same(got, &a));
    kvt_entry_free(got);
    kvt_tier_free(t);
    t_free(&a);
  }
}

static void test_queue_bounds(void) {
  kvt_options o = t_opts("queue");
  o.spill_queue_size = 3;
  kvt_tier *t = t_open(&o);
  t_entry e[5];
  for (int i = 0; i < 5; i++)
    e[i] = t_make(100 + i, 16, 1, 4, 8); /* 512 bytes of tensors */
  /* Writer not started: the queue fills up. */
  CHECK_EQ_INT(t_spill(t, &e[0]), 0);
  CHECK_EQ_INT(t_spill(t, &e[1]), 0);
  CHECK_EQ_INT(t_spill(t, &e[2]), 0);
  CHECK_EQ_INT(t_spill(t, &e[3]), KVT_EFULL);
  kvt_stats s = KVT_STATS_INIT;
  kvt_tier_stats(&s, t);
  CHECK_EQ_INT(s.spill_drops, 1);
  CHECK_EQ_INT(s.queue_depth, 3);
  CHECK(s.queue_bytes >= 3 * 512);
  /* flush without a writer cannot finish. */
  CHECK_EQ_INT(kvt_tier_flush(t, 0), KVT_EINVAL);
  /* Lookups do not see queued entries. */
  kvt_entry_info info;
  CHECK_EQ_INT(kvt_tier_lookup(&info, t, e[0].tokens, 16), KVT_ENOTFOUND);
  CHECK_EQ_INT(kvt_tier_start_writer(t), 0);
  CHECK_EQ_INT(kvt_tier_flush(t, -1), 0);
  CHECK_EQ_INT(kvt_tier_lookup(&info, t, e[2].tokens, 16), 0);
  CHECK_EQ_INT(kvt_tier_lookup(&info, t, e[3].tokens, 16), KVT_ENOTFOUND);
  kvt_tier_free(t);

  /* Byte bound: measure what one queued spill costs, then allow two and a half.
   */
  o = t_opts("qprobe");
  t = t_open(&o);
  CHECK_EQ_INT(t_spill(t, &e[4]), 0);
  kvt_tier_stats(&s, t);
  uint64_t per = s.queue_bytes;
  CHECK(per >= 512);
  kvt_tier_free(t);
  o = t_opts("qbytes");
  o.spill_queue_bytes = per * 5 / 2;
  t = t_open(&o);
  CHECK_EQ_INT(t_spill(t, &e[0]), 0);
  CHECK_EQ_INT(t_spill(t, &e[1]), 0);
  CHECK_EQ_INT(t_spill(t, &e[2]), KVT_EFULL);
  t_entry big = t_make(7, 16, 3, 4, 8); /* 1536 bytes: can never fit */
  CHECK_EQ_INT(t_spill(t, &big), KVT_ETOOBIG);
  kvt_tier_stats(&s, t);
  CHECK_EQ_INT(s.spill_drops, 1);
  CHECK_EQ_INT(s.spill_rejects, 1);
  CHECK_EQ_INT(s.queue_depth, 2);
  CHECK(s.queue_bytes <= o.spill_queue_bytes);
  /* Close drains what is queued even though nobody started the writer. */
  CHECK_EQ_INT(kvt_tier_close(t, -1), 0);
  kvt_tier_free(t);
  t = t_open(&o);
  CHECK_EQ_INT(kvt_tier_lookup(&info, t, e[1].tokens, 16), 0);
  kvt_tier_free(t);
  t_free(&big);
  for (int i = 0; i < 5; i++)
    t_free(&e[i]);
}

static void test_too_big_for_capacity(void) {
  kvt_options o = t_opts("toobig");
  o.max_size_gb = 4096.0 / 1073741824.0; /* 4 KiB */
  kvt_tier *t = t_open(&o);
  CHECK_EQ_INT(kvt_tier_start_writer(t), 0);
  t_entry big = t_make(5, 16, 2, 16, 16); /* 8 KiB of tensors */
  CHECK_EQ_INT(t_spill(t, &big), KVT_ETOOBIG);
  CHECK(strstr(kvt_last_error(), "capacity") != NULL);
  t_entry ok = t_make(6, 16, 1, 4, 4);
  CHECK_EQ_INT(t_spill(t, &ok), 0);
  CHECK_EQ_INT(kvt_tier_flush(t, -1), 0);
  kvt_stats s = KVT_STATS_INIT;
  kvt_tier_stats(&s, t);
  CHECK_EQ_INT(s.spill_rejects, 1);
  CHECK_EQ_INT(s.spill_count, 1);
  CHECK_EQ_INT(s.evictions, 0);
  kvt_tier_free(t);
  t_free(&big);
  t_free(&ok);
}

static void test_invalid_spill(void) {
  kvt_options o = t_opts("inval");
  kvt_tier *t = t_open(&o);
  t_entry e = t_make(8, 4, 1, 2, 2);
  e.layers[0].tensors[0].nbytes += 4; /* shape/nbytes mismatch */
  CHECK_EQ_INT(t_spill(t, &e), KVT_EINVAL);
  e.layers[0].tensors[0].nbytes -= 4;
  CHECK_EQ_INT(kvt_tier_spill(t, NULL, 3, e.layers, 1, 0), KVT_EINVAL);
  kvt_stats s = KVT_STATS_INIT;
  kvt_tier_stats(&s, t);
  CHECK_EQ_INT(s.queue_depth, 0);
  CHECK(s.spill_rejects >= 1);
  kvt_tier_free(t);
  t_free(&e);
}

static atomic_int released_count;
static void on_release(void *ctx) {
  (void)ctx;
  atomic_fetch_add(&released_count, 1);
}

static void test_nocopy(void) {
  kvt_options o = t_opts("nocopy");
  kvt_tier *t = t_open(&o);
  t_entry e = t_make(31, 12, 2, 4, 4);
  atomic_store(&released_count, 0);
  CHECK_EQ_INT(kvt_tier_spill_nocopy(t, e.tokens, e.n_tokens, e.layers,
                                     e.n_layers, e.memory_bytes, on_release,
                                     NULL),
               0);
  CHECK_EQ_INT(atomic_load(&released_count), 0); /* buffers still pinned */
  CHECK_EQ_INT(kvt_tier_start_writer(t), 0);
  CHECK_EQ_INT(kvt_tier_flush(t, -1), 0);
  CHECK_EQ_INT(atomic_load(&released_count), 1);
  kvt_entry *got = NULL;
  CHECK_EQ_INT(kvt_tier_promote(&got, t, e.tokens, e.n_tokens, NULL), 0);
  CHECK(got && t_same(got, &e));
  kvt_entry_free(got);
  /* A refused no-copy spill releases before returning. */
  CHECK_EQ_INT(kvt_tier_close(t, -1), 0);
  CHECK_EQ_INT(kvt_tier_spill_nocopy(t, e.tokens, e.n_tokens, e.layers,
                                     e.n_layers, e.memory_bytes, on_release,
                                     NULL),
               KVT_ECLOSED);
  CHECK_EQ_INT(atomic_load(&released_count), 2);
  kvt_tier_free(t);
  t_free(&e);
}

static int count_visit(void *ctx, const kvt_entry_info *info) {
  (void)info;
  (*(int *)ctx)++;
  return 0;
}

static void test_entry_ops(void) {
  kvt_options o = t_opts("ops");
  kvt_tier *t = t_open(&o);
  CHECK_EQ_INT(kvt_tier_start_writer(t), 0);
  t_entry a = t_make(41, 20, 2, 4, 4), b = t_make(42, 21, 2, 4, 4);
  CHECK_EQ_INT(t_spill(t, &a), 0);
  CHECK_EQ_INT(t_spill(t, &b), 0);
  CHECK_EQ_INT(kvt_tier_flush(t, -1), 0);
  int n = 0;
  CHECK_EQ_INT(kvt_tier_foreach(t, count_visit, &n), 0);
  CHECK_EQ_INT(n, 2);
  kvt_entry_info ia, ib;
  CHECK_EQ_INT(kvt_tier_lookup(&ia, t, a.tokens, a.n_tokens), 0);
  CHECK_EQ_INT(kvt_tier_lookup(&ib, t, b.tokens, b.n_tokens), 0);
  double before = ia.accessed_at;
  usleep(20000);
  CHECK_EQ_INT(kvt_tier_touch(t, a.tokens, a.n_tokens), 0);
  CHECK_EQ_INT(kvt_tier_lookup(&ia, t, a.tokens, a.n_tokens), 0);
  CHECK(ia.accessed_at > before);
  char *json = NULL;
  CHECK_EQ_INT(kvt_tier_describe(&json, t, ia.token_hash), 0);
  CHECK(json && strstr(json, "layers") != NULL);
  kvt_free(json);
  CHECK_EQ_INT(kvt_tier_describe(&json, t, "../etc"), KVT_EINVAL);
  CHECK_EQ_INT(kvt_tier_verify(t, ia.token_hash, 0), 0);
  /* read_entry by path, as the reference's _read_entry. */
  kvt_entry *got = NULL;
  CHECK_EQ_INT(
      kvt_tier_read_entry(&got, t, a.tokens, a.n_tokens, ia.token_hash), 0);
  CHECK(got && t_same(got, &a));
  kvt_entry_free(got);
  got = NULL;
  CHECK_EQ_INT(kvt_tier_read_entry(&got, t, a.tokens, a.n_tokens, "../../x"),
               KVT_EINVAL);
  CHECK_EQ_INT(kvt_tier_remove(t, a.tokens, a.n_tokens), 0);
  CHECK_EQ_INT(kvt_tier_remove(t, a.tokens, a.n_tokens), KVT_ENOTFOUND);
  CHECK_EQ_INT(kvt_tier_touch(t, a.tokens, a.n_tokens), KVT_ENOTFOUND);
  char *dir = t_entry_path(t, a.tokens, a.n_tokens, NULL);
  CHECK(!kvt_test_exists(dir));
  free(dir);
  n = 0;
  CHECK_EQ_INT(kvt_tier_foreach(t, count_visit, &n), 0);
  CHECK_EQ_INT(n, 1);
  kvt_tier_free(t);

  /* Read-only: lookups and promotes work, changes are refused, no lock taken.
   */
  kvt_tier *w = t_open(&o); /* the writer keeps its lock */
  kvt_options ro = o;
  ro.flags = KVT_OPEN_READONLY;
  kvt_tier *r = t_open(&ro);
  CHECK_EQ_INT(kvt_tier_start_writer(r), KVT_EINVAL);
  CHECK_EQ_INT(t_spill(r, &a), KVT_EINVAL);
  CHECK_EQ_INT(kvt_tier_remove(r, b.tokens, b.n_tokens), KVT_EINVAL);
  CHECK_EQ_INT(kvt_tier_touch(r, b.tokens, b.n_tokens), KVT_EINVAL);
  CHECK_EQ_INT(kvt_tier_reconcile(r), KVT_EINVAL);
  kvt_gc_opts g = KVT_GC_OPTS_INIT;
  uint64_t would = 9;
  g.dry_run = 1; /* a dry run only reads */
  CHECK_EQ_INT(kvt_tier_gc(r, &g, &would, NULL), 0);
  CHECK_EQ_INT(would, 0);
  g.dry_run = 0;
  CHECK_EQ_INT(kvt_tier_gc(r, &g, NULL, NULL), KVT_EINVAL);
  CHECK_EQ_INT(kvt_tier_promote(&got, r, b.tokens, b.n_tokens, NULL), 0);
  CHECK(got && t_same(got, &b));
  kvt_entry_free(got);
  kvt_tier_free(r);
  kvt_tier_free(w);
  t_free(&a);
  t_free(&b);
}

typedef struct log_rec {
  pthread_mutex_t mu;
  int n[5];
} log_rec;
static void log_fn(void *ctx, int level, const char *msg) {
  log_rec *l = ctx;
  (void)msg;
  pthread_mutex_lock(&l->mu);
  if (level >= 0 && level < 5)
    l->n[level]++;
  pthread_mutex_unlock(&l->mu);
}

static void test_logging(void) {
  log_rec lr;
  memset(&lr, 0, sizeof lr);
  pthread_mutex_init(&lr.mu, NULL);
  kvt_options o = t_opts("log");
  o.log_fn = log_fn;
  o.log_ctx = &lr;
  o.log_level = KVT_LOG_INFO;
  kvt_tier *t = t_open(&o);
  CHECK_EQ_INT(kvt_tier_start_writer(t), 0);
  kvt_tier_free(t);
  CHECK(lr.n[KVT_LOG_INFO] >= 2);       /* opened, writer started, closed */
  CHECK_EQ_INT(lr.n[KVT_LOG_DEBUG], 0); /* below the level */
}

typedef struct done_rec {
  pthread_mutex_t mu;
  int ok, failed;
} done_rec;
static void on_done(void *ctx, const char *hash, int status) {
  done_rec *d = ctx;
  pthread_mutex_lock(&d->mu);
  if (status == 0 && strlen(hash) == 64)
    d->ok++;
  else
    d->failed++;
  pthread_mutex_unlock(&d->mu);
}

static void test_spill_done(void) {
  done_rec d;
  memset(&d, 0, sizeof d);
  pthread_mutex_init(&d.mu, NULL);
  kvt_options o = t_opts("done");
  o.spill_done_fn = on_done;
  o.spill_done_ctx = &d;
  kvt_tier *t = t_open(&o);
  CHECK_EQ_INT(kvt_tier_start_writer(t), 0);
  t_entry e[3];
  for (int i = 0; i < 3; i++) {
    e[i] = t_make(200 + i, 5, 1, 2, 2);
    CHECK_EQ_INT(t_spill(t, &e[i]), 0);
  }
  CHECK_EQ_INT(kvt_tier_flush(t, -1), 0);
  pthread_mutex_lock(&d.mu);
  CHECK_EQ_INT(d.ok, 3);
  CHECK_EQ_INT(d.failed, 0);
  pthread_mutex_unlock(&d.mu);
  kvt_tier_free(t);
  /* free drops spills that never started, reporting them. */
  d.ok = d.failed = 0;
  o = t_opts("done2");
  o.spill_done_fn = on_done;
  o.spill_done_ctx = &d;
  t = t_open(&o);
  CHECK_EQ_INT(t_spill(t, &e[0]), 0);
  kvt_tier_free(t);
  CHECK_EQ_INT(d.failed, 1);
  for (int i = 0; i < 3; i++)
    t_free(&e[i]);
}

static void test_stats_add(void) {
  kvt_options o = t_opts("sadd");
  kvt_tier *t = t_open(&o);
  CHECK_EQ_INT(kvt_tier_stats_add(t, "ssd_hits", 5), 0);
  CHECK_EQ_INT(kvt_tier_stats_add(t, "ssd_hits", -2), 0);
  CHECK_EQ_INT(kvt_tier_stats_add(t, "ssd_hits", -4), KVT_EINVAL);
  CHECK_EQ_INT(kvt_tier_stats_add(t, "nope", 1), KVT_EINVAL);
  CHECK_EQ_INT(kvt_tier_stats_add(t, "entries", 1), KVT_EINVAL);
  CHECK_EQ_INT(kvt_tier_stats_add(t, "reload_latency_sum", 2), 0);
  kvt_stats s = KVT_STATS_INIT;
  kvt_tier_stats(&s, t);
  CHECK_EQ_INT(s.ssd_hits, 3);
  CHECK(fabs(s.reload_latency_sum - 2.0) < 1e-9);
  kvt_tier_free(t);
}

int main(void) {
  RUN(test_lifecycle);
  RUN(test_bad_options);
  RUN(test_roundtrip);
  RUN(test_storage_modes);
  RUN(test_queue_bounds);
  RUN(test_too_big_for_capacity);
  RUN(test_invalid_spill);
  RUN(test_nocopy);
  RUN(test_entry_ops);
  RUN(test_logging);
  RUN(test_spill_done);
  RUN(test_stats_add);
  return kvt_test_done();
}
