/*
 * test_tier_faults.c - failure paths: corrupt entries are quarantined (name
 * clash keeps both, the quarantine is bounded oldest-first, quarantine_max 0
 * deletes); writer failures injected mid-entry through the I/O table (ENOSPC on
 * the Nth pwrite, EIO on the publishing rename) leave no entry, no row and no
 * temporary, count write_failures, keep a replaced entry intact, and the writer
 * goes on; close drains the queue, and a close that times out (writer stalled
 * in pwrite) is reported, leaves the tier readable and can be retried;
 * reconcile of missing files, orphan directories and stale temporaries; a
 * cold chained promote under read faults (EIO fails it cleanly, short reads
 * complete it).
 */
#include "tier_testlib.h"

static int stored(kvt_tier *t, const t_entry *e) {
  kvt_entry_info info;
  return kvt_tier_lookup(&info, t, e->tokens, e->n_tokens) == 0;
}

static char *qdir(kvt_tier *t) {
  char *p = malloc(4200);
  snprintf(p, 4200, "%s/quarantine", kvt_tier_dir(t));
  return p;
}

static char *ddir(kvt_tier *t) {
  char *p = malloc(4200);
  snprintf(p, 4200, "%s/data", kvt_tier_dir(t));
  return p;
}

/* Spills e, corrupts one of its layer files, promotes: must be ECORRUPT +
 * quarantined. */
static void spill_corrupt_promote(kvt_tier *t, t_entry *e) {
  CHECK_EQ_INT(t_spill(t, e), 0);
  CHECK_EQ_INT(kvt_tier_flush(t, -1), 0);
  char *f = t_entry_path(t, e->tokens, e->n_tokens, "layer_0.safetensors");
  CHECK_EQ_INT(t_flip(f, -1), 0);
  free(f);
  kvt_entry *got = NULL;
  CHECK_EQ_INT(kvt_tier_promote(&got, t, e->tokens, e->n_tokens, NULL),
               KVT_ECORRUPT);
  CHECK(got == NULL);
  CHECK(!stored(t, e));
  char *d = t_entry_path(t, e->tokens, e->n_tokens, NULL);
  CHECK(!kvt_test_exists(d));
  free(d);
}

static void test_quarantine(void) {
  kvt_options o = t_opts("quar");
  o.quarantine_max = 2;
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  t_entry e = t_make(1, 12, 2, 4, 4);
  char h[65];
  kvt_token_hash(h, e.tokens, e.n_tokens);
  char *q = qdir(t);
  char qh[4300];
  snprintf(qh, sizeof qh, "%s/%s", q, h);

  spill_corrupt_promote(t, &e);
  CHECK(kvt_test_exists(qh));
  char man[4400];
  snprintf(man, sizeof man, "%s/manifest.json", qh);
  CHECK(kvt_test_exists(man)); /* moved whole, kept for inspection */
  CHECK_EQ_INT(kvt_test_count_dir(q, NULL), 1);
  /* The same tokens again: a name clash in quarantine/ must not lose the move.
   */
  usleep(5000);
  spill_corrupt_promote(t, &e);
  CHECK_EQ_INT(kvt_test_count_dir(q, NULL), 2);
  CHECK(kvt_test_exists(qh));
  /* A third: the bound (2) drops the oldest, which is the unsuffixed first one.
   */
  usleep(5000);
  spill_corrupt_promote(t, &e);
  CHECK_EQ_INT(kvt_test_count_dir(q, NULL), 2);
  CHECK(!kvt_test_exists(qh));
  kvt_stats s = KVT_STATS_INIT;
  kvt_tier_stats(&s, t);
  CHECK_EQ_INT(s.quarantined, 3);
  CHECK_EQ_INT(s.promotion_failures, 3);
  CHECK_EQ_INT(s.entries, 0);
  /* verify with repair quarantines too; without repair it only reports. */
  CHECK_EQ_INT(t_spill(t, &e), 0);
  CHECK_EQ_INT(kvt_tier_flush(t, -1), 0);
  char *f = t_entry_path(t, e.tokens, e.n_tokens, "tokens.bin");
  CHECK_EQ_INT(t_flip(f, 0), 0);
  free(f);
  CHECK_EQ_INT(kvt_tier_verify(t, h, 0), KVT_ECORRUPT);
  CHECK(stored(t, &e));
  CHECK_EQ_INT(kvt_tier_verify(t, h, 1), KVT_ECORRUPT);
  CHECK(!stored(t, &e));
  CHECK_EQ_INT(kvt_tier_verify(t, h, 0), KVT_ENOTFOUND);
  kvt_tier_free(t);
  free(q);

  /* quarantine_max 0: corrupt entries are deleted, still counted. */
  o = t_opts("quar0");
  o.quarantine_max = 0;
  t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  spill_corrupt_promote(t, &e);
  q = qdir(t);
  CHECK(kvt_test_count_dir(q, NULL) <= 0);
  kvt_tier_stats(&s, t);
  CHECK_EQ_INT(s.quarantined, 1);
  kvt_tier_free(t);
  free(q);
  t_free(&e);
}

typedef struct status_rec {
  pthread_mutex_t mu;
  int last, calls;
} status_rec;
static void on_done(void *ctx, const char *hash, int status) {
  status_rec *r = ctx;
  (void)hash;
  pthread_mutex_lock(&r->mu);
  r->last = status;
  r->calls++;
  pthread_mutex_unlock(&r->mu);
}

static void no_trace(kvt_tier *t, const t_entry *e) {
  CHECK(!stored(t, e));
  char *d = t_entry_path(t, e->tokens, e->n_tokens, NULL);
  CHECK(!kvt_test_exists(d));
  free(d);
  char *dd = ddir(t);
  CHECK_EQ_INT(kvt_test_count_dir(dd, ".tmp"), 0);
  free(dd);
}

static void test_writer_failures(void) {
  fio_install();
  status_rec r = {PTHREAD_MUTEX_INITIALIZER, 0, 0};
  kvt_options o = t_opts("wfail");
  o.spill_done_fn = on_done;
  o.spill_done_ctx = &r;
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  t_entry a = t_make(10, 16, 3, 8, 8), b = t_make(11, 16, 3, 8, 8);
  /* ENOSPC on the 2nd pwrite of the entry (mid layer files). */
  fio_arm(FIO_PWRITE, 2, FIO_FAIL_ERRNO, ENOSPC, 0);
  CHECK_EQ_INT(t_spill(t, &a), 0);
  CHECK_EQ_INT(kvt_tier_flush(t, -1), 0);
  no_trace(t, &a);
  kvt_stats s = KVT_STATS_INIT;
  kvt_tier_stats(&s, t);
  CHECK_EQ_INT(s.write_failures, 1);
  CHECK_EQ_INT(s.spill_count, 0);
  CHECK_EQ_INT(s.entries, 0);
  CHECK_EQ_INT(r.last, KVT_ENOSPC);
  /* The writer keeps going. */
  fio_disarm();
  CHECK_EQ_INT(t_spill(t, &b), 0);
  CHECK_EQ_INT(kvt_tier_flush(t, -1), 0);
  CHECK(stored(t, &b));
  CHECK_EQ_INT(r.last, 0);
  /* EIO on the publishing rename. */
  fio_arm(FIO_RENAME, 1, FIO_FAIL_ERRNO, EIO, 0);
  CHECK_EQ_INT(t_spill(t, &a), 0);
  CHECK_EQ_INT(kvt_tier_flush(t, -1), 0);
  no_trace(t, &a);
  kvt_tier_stats(&s, t);
  CHECK_EQ_INT(s.write_failures, 2);
  CHECK(r.last < 0);
  /* A failing replace leaves the previous version complete and readable. */
  t_entry b2 = t_make(12, 16, 2, 8, 8);
  memcpy(b2.tokens, b.tokens, 16 * 4);
  for (int at = 1; at <= 3; at++) {
    fio_arm(FIO_PWRITE, (uint64_t)at, FIO_FAIL_ERRNO, ENOSPC, 0);
    CHECK_EQ_INT(t_spill(t, &b2), 0);
    CHECK_EQ_INT(kvt_tier_flush(t, -1), 0);
    kvt_entry *got = NULL;
    CHECK_EQ_INT(kvt_tier_promote(&got, t, b.tokens, 16, NULL), 0);
    CHECK(got && t_same(got, &b));
    kvt_entry_free(got);
  }
  fio_disarm();
  char *dd = ddir(t);
  CHECK_EQ_INT(kvt_test_count_dir(dd, ".tmp"), 0);
  CHECK_EQ_INT(kvt_test_count_dir(dd, NULL), 1);
  free(dd);
  kvt_tier_stats(&s, t);
  CHECK_EQ_INT(s.write_failures, 5);
  CHECK_EQ_INT(s.entries, 1);
  kvt_tier_free(t);
  fio_remove();
  t_free(&a);
  t_free(&b);
  t_free(&b2);
}

/* A cold promote of a chained entry (4 chunks and a tail) under read
 * faults, every read call in turn: an EIO fails the promote cleanly (an
 * error, no entry handed out, a promotion failure counted, nothing
 * quarantined: the next promote serves the entry whole), a short read is
 * completed (exact data). The chunk reads are vectored requests into the
 * destination (preadv through the seam). */
static void test_promote_read_faults(void) {
  fio_install();
  kvt_options o = t_opts("rdfail");
  o.chunk_tokens = 16;
  o.host_cache_bytes = 0;
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  int32_t tok[72];
  for (int i = 0; i < 72; i++)
    tok[i] = 1000 + 7 * i;
  REQUIRE(t_kv_spill(t, tok, 72, 80, 3, 1000) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  for (int kind = 0; kind < 2; kind++) {
    int sites = 0;
    for (uint64_t nth = 1; nth < 10000; nth++) {
      kvt_stats s0 = KVT_STATS_INIT, s1 = KVT_STATS_INIT;
      kvt_tier_stats(&s0, t);
      fio_arm(FIO_PREAD, nth, kind ? FIO_FAIL_SHORT : FIO_FAIL_ERRNO, EIO, 0);
      kvt_entry *e = NULL;
      int rc = kvt_tier_promote(&e, t, tok, 72, NULL);
      uint64_t fired = fio_fired();
      fio_disarm();
      kvt_tier_stats(&s1, t);
      if (!fired) {
        CHECK_EQ_INT(rc, 0);
        CHECK(e && t_kv_matches(e, tok, 72, 80, 3));
        kvt_entry_free(e);
        break;
      }
      sites++;
      if (kind == 0) {
        CHECK(rc < 0);
        CHECK(e == NULL);
        CHECK_EQ_INT(s1.promotion_failures, s0.promotion_failures + 1);
        kvt_entry_free(e);
        e = NULL;
        CHECK_EQ_INT(kvt_tier_promote(&e, t, tok, 72, NULL), 0);
      } else {
        CHECK_EQ_INT(rc, 0);
      }
      CHECK(e && t_kv_matches(e, tok, 72, 80, 3));
      kvt_entry_free(e);
    }
    fprintf(stderr, "  promote, %s: %d read calls failed in turn\n",
            kind ? "short reads" : "EIO", sites);
    CHECK(sites >= 5); /* the tail's reads and every chunk's */
  }
  kvt_tier_free(t);
  fio_remove();
}

static void test_drain_on_close(void) {
  kvt_options o = t_opts("drain");
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  t_entry e[10];
  for (int i = 0; i < 10; i++) {
    e[i] = t_make(100 + i, 32, 2, 16, 16);
    CHECK_EQ_INT(t_spill(t, &e[i]), 0);
  }
  CHECK_EQ_INT(kvt_tier_close(t, -1), 0);
  kvt_stats s = KVT_STATS_INIT;
  kvt_tier_stats(&s, t);
  CHECK_EQ_INT(s.spill_count, 10);
  CHECK_EQ_INT(s.queue_depth, 0);
  kvt_tier_free(t);
  t = t_open(&o);
  for (int i = 0; i < 10; i++)
    CHECK(stored(t, &e[i]));
  kvt_tier_free(t);
  for (int i = 0; i < 10; i++)
    t_free(&e[i]);
}

static void test_close_timeout(void) {
  fio_install();
  kvt_options o = t_opts("ctimeout");
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  t_entry a = t_make(200, 16, 1, 4, 4), b = t_make(201, 16, 1, 4, 4);
  CHECK_EQ_INT(t_spill(t, &a), 0);
  CHECK_EQ_INT(kvt_tier_flush(t, -1), 0);
  fio_stall_set(1);
  CHECK_EQ_INT(t_spill(t, &b), 0);
  fio_stall_wait_blocked();
  CHECK_EQ_INT(kvt_tier_flush(t, 50), KVT_ETIMEDOUT);
  CHECK_EQ_INT(kvt_tier_close(t, 100), KVT_ETIMEDOUT);
  CHECK(strstr(kvt_last_error(), "pending") != NULL);
  /* Still readable; spills refused. */
  kvt_entry *got = NULL;
  CHECK_EQ_INT(kvt_tier_promote(&got, t, a.tokens, 16, NULL), 0);
  CHECK(got && t_same(got, &a));
  kvt_entry_free(got);
  CHECK_EQ_INT(t_spill(t, &a), KVT_ECLOSED);
  CHECK_EQ_INT(kvt_tier_close(t, 0), KVT_ETIMEDOUT); /* retry, still stuck */
  fio_stall_set(0);
  CHECK_EQ_INT(kvt_tier_close(t, -1), 0);
  CHECK_EQ_INT(kvt_tier_close(t, -1), 0);
  kvt_stats s = KVT_STATS_INIT;
  kvt_tier_stats(&s, t);
  CHECK_EQ_INT(s.spill_count, 2);
  kvt_tier_free(t);
  fio_remove();
  t_free(&a);
  t_free(&b);
}

static void mkdir_junk(const char *dir, const char *name) {
  char p[4400];
  snprintf(p, sizeof p, "%s/%s", dir, name);
  mkdir(p, 0700);
  char f[4500];
  snprintf(f, sizeof f, "%s/layer_0.safetensors", p);
  FILE *fp = fopen(f, "w");
  if (fp) {
    fputs("junk", fp);
    fclose(fp);
  }
}

static void test_reconcile(void) {
  kvt_options o = t_opts("recon");
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  t_entry e[4];
  for (int i = 0; i < 4; i++) {
    e[i] = t_make(300 + i, 8, 1, 2, 2);
    CHECK_EQ_INT(t_spill(t, &e[i]), 0);
  }
  CHECK_EQ_INT(kvt_tier_flush(t, -1), 0);
  CHECK_EQ_INT(kvt_tier_reconcile(t), 0); /* consistent: nothing to do */
  /* Damage behind the tier's back. */
  char *d0 = t_entry_path(t, e[0].tokens, 8, NULL);
  kvt_test_rmtree(d0); /* row without directory */
  char *m1 = t_entry_path(t, e[1].tokens, 8, "manifest.json");
  unlink(m1); /* row without manifest */
  char *dd = ddir(t);
  mkdir_junk(dd, "0000000000000000000000000000000000000000000000000000000000000"
                 "abc"); /* directory with no row */
  char h3[65];
  kvt_token_hash(h3, e[3].tokens, 8);
  char tmpname[80];
  snprintf(tmpname, sizeof tmpname, "%s.tmp", h3);
  mkdir_junk(dd, tmpname); /* stale temporary */
  char other[4400];
  snprintf(other, sizeof other, "%s/README", dd);
  FILE *fp = fopen(other, "w");
  fputs("not ours", fp);
  fclose(fp);
  /* rows of e0 and e1, then e1's manifest-less directory, the orphan, the tmp.
   */
  CHECK_EQ_INT(kvt_tier_reconcile(t), 5);
  CHECK(!stored(t, &e[0]));
  CHECK(!stored(t, &e[1]));
  CHECK(stored(t, &e[2]) && stored(t, &e[3]));
  CHECK(kvt_test_exists(other)); /* not ours: left alone */
  CHECK_EQ_INT(kvt_test_count_dir(dd, ".tmp"), 0);
  CHECK_EQ_INT(kvt_test_count_dir(dd, NULL), 3); /* e2, e3, README */
  kvt_stats s = KVT_STATS_INIT;
  kvt_tier_stats(&s, t);
  CHECK_EQ_INT(s.reconciled, 5);
  CHECK_EQ_INT(s.entries, 2);
  /* A promote of an entry whose files vanished: a failure, the row is dropped.
   */
  char *d2 = t_entry_path(t, e[2].tokens, 8, NULL);
  kvt_test_rmtree(d2);
  kvt_entry *got = NULL;
  CHECK_EQ_INT(kvt_tier_promote(&got, t, e[2].tokens, 8, NULL), KVT_ENOTFOUND);
  CHECK(!stored(t, &e[2]));
  kvt_tier_free(t);

  /* At open: stale temporaries always go; reconcile unless NO_RECONCILE. */
  mkdir_junk(dd, tmpname);
  o.flags = KVT_OPEN_NO_RECONCILE;
  unlink(other);
  t = t_open(&o);
  CHECK_EQ_INT(kvt_test_count_dir(dd, ".tmp"), 0);
  kvt_tier_free(t);
  /* Remove e3's directory: without reconcile the row stays, with it it goes. */
  char d3p[4400];
  snprintf(d3p, sizeof d3p, "%s/%s", dd, h3);
  kvt_test_rmtree(d3p);
  t = t_open(&o);
  CHECK(stored(t, &e[3]));
  kvt_tier_free(t);
  o.flags = 0;
  t = t_open(&o);
  CHECK(!stored(t, &e[3]));
  kvt_tier_stats(&s, t);
  CHECK_EQ_INT(s.reconciled, 1);
  kvt_tier_free(t);
  free(d0);
  free(m1);
  free(d2);
  free(dd);
  for (int i = 0; i < 4; i++)
    t_free(&e[i]);
}

int main(void) {
  RUN(test_quarantine);
  RUN(test_writer_failures);
  RUN(test_promote_read_faults);
  RUN(test_drain_on_close);
  RUN(test_close_timeout);
  RUN(test_reconcile);
  return kvt_test_done();
}
