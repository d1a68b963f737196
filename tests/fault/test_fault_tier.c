/*
 * test_fault_tier.c - fault injection through the whole tier. A pristine cache
 * directory holds E1, E2, E7, a corrupt E4 and debris (a row without files, a
 * directory without a row, a stale tmp). For each fault (EIO, ENOSPC, a full
 * disk, EINTR, short transfers, fsync and rename failures, allocation failure)
 * and each call site of that operation in turn, one run under the fault does:
 * open (purge + reconcile of the debris), start the writer, spill E3 (new), E1'
 * (a replacement of E1) and E8 (zero-copy), flush, promote E2 asynchronously,
 * remove E7, promote E2, promote the corrupt E4 (quarantine), reconcile, close.
 * Asserted after each run: no crash or leak (sanitizer builds; open descriptors
 * are counted too), the zero-copy release callback ran exactly once, failures
 * come back as error codes with a message and are counted (write_failures for
 * failed spills, promotion_failures for failed promotes), EINTR and short
 * transfers change nothing, the corrupt entry is never served; and after a
 * clean reopen: no temporaries, every row verifies, every directory has a row,
 * E2 (never written under the fault) is still there and intact - a transient
 * fault never makes the tier drop or quarantine a good entry -, E3, E8 and E1'
 * are there exactly when their spill was reported written, E1 otherwise keeps
 * its old version, and E7 is either whole or gone. KVT_FAULT_TIER_STRIDE
 * (default 1) fails only every Nth call site, to shorten the run.
 */
#include "faultio.h"
#include "rel_tier.h"

static char g_pristine[4096], g_dir[4096];
static t_entry E1, E1v, E2, E3, E4, E5, E6, E7, E8;
static atomic_int g_released;
static uint64_t g_last_quarantined, g_last_reconciled,
    g_served_during_write_faults;
static uint64_t g_runs, g_write_failed, g_promote_failed, g_open_failed,
    g_replace_lost;

static int code_ok(int rc) {
  return rc == KVT_EIO || rc == KVT_ENOSPC || rc == KVT_ENOMEM ||
         rc == KVT_EPERM || rc == KVT_ENOTFOUND || rc == KVT_EDB;
}

static void make_pristine(void) {
  kvt_options o = rel_opts(g_pristine, KVT_DURABILITY_FSYNC);
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  REQUIRE(t_spill(t, &E1) == 0 && t_spill(t, &E2) == 0 &&
          t_spill(t, &E4) == 0 && t_spill(t, &E7) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  char *f = t_entry_path(t, E4.tokens, E4.n_tokens, "layer_1.safetensors");
  REQUIRE(t_flip(f, -3) == 0);
  free(f);
  /* Debris for open's purge and reconcile to clean up under the faults: a row
   * whose files are gone (E5), a data directory without a row (a copy of E2
   * under E6's name), a stale tmp. */
  REQUIRE(t_spill(t, &E5) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  char *d5 = t_entry_path(t, E5.tokens, E5.n_tokens, NULL);
  char *d2 = t_entry_path(t, E2.tokens, E2.n_tokens, NULL);
  char *d6 = t_entry_path(t, E6.tokens, E6.n_tokens, NULL);
  REQUIRE(kvt_tier_close(t, -1) == 0);
  kvt_tier_free(t);
  kvt_test_rmtree(d5);
  r_copy_tree(d2, d6);
  char tmp[4200];
  snprintf(tmp, sizeof tmp, "%s.tmp", d6);
  r_copy_tree(d2, tmp);
  free(d5);
  free(d2);
  free(d6);
}

typedef struct fault {
  fio_op op;
  fio_kind kind;
  int err;
  int sticky;
} fault;

/* Operations only writes use: a promote must work while they fail. */
static int write_only(fio_op op) {
  return op == FIO_PWRITE || op == FIO_FSYNC || op == FIO_RENAME ||
         op == FIO_MKDIR || op == FIO_RMDIR || op == FIO_UNLINK ||
         op == FIO_CHMOD || op == FIO_RENAME_EXCHANGE;
}

static int transparent(const fault *f) {
  return f->kind == FIO_FAIL_SHORT || f->err == EINTR;
}

/* Open descriptors of this process (a fault path that leaks an fd shows up
 * here). */
static int open_fds(void) {
  return kvt_test_count_dir("/proc/self/fd", NULL);
}

static void on_release(void *ctx) {
  (void)ctx;
  atomic_fetch_add(&g_released, 1);
}

/* Async promote of e: 0 + same data, or the code. */
static int promote_async_same(kvt_tier *t, const t_entry *e, int *same) {
  kvt_promise *p = NULL;
  *same = 0;
  int rc = kvt_tier_promote_async(&p, t, e->tokens, e->n_tokens, NULL);
  if (rc != 0) {
    CHECK(p == NULL);
    return rc;
  }
  CHECK_EQ_INT(kvt_promise_wait(p, -1), 0);
  kvt_entry *got = NULL;
  rc = kvt_promise_result(&got, p);
  *same = rc == 0 && got && t_same(got, e);
  CHECK(rc == 0 || got == NULL);
  kvt_entry_free(got);
  kvt_promise_free(p);
  return rc;
}

/* Promotes e on t; 0 + same data, or the promote's code. */
static int promote_same(kvt_tier *t, const t_entry *e, int *same) {
  kvt_entry *got = NULL;
  int rc = kvt_tier_promote(&got, t, e->tokens, e->n_tokens, NULL);
  *same = rc == 0 && got && t_same(got, e);
  CHECK(rc == 0 || got == NULL);
  kvt_entry_free(got);
  return rc;
}

static int hash_of(char h[65], const t_entry *e) {
  return kvt_token_hash(h, e->tokens, e->n_tokens);
}

/* One run under the fault; returns whether it fired. */
static int run_once(const fault *f, uint64_t nth) {
  kvt_test_rmtree(g_dir);
  r_copy_tree(g_pristine, g_dir);
  chmod(g_dir, 0700);
  rel_done done;
  memset(&done, 0, sizeof done);
  pthread_mutex_init(&done.mu, NULL);
  kvt_options o = rel_opts(g_dir, KVT_DURABILITY_FSYNC);
  o.spill_done_fn = rel_done_fn;
  o.spill_done_ctx = &done;
  int fds0 = open_fds();
  atomic_store(&g_released, 0);
  int nocopy_called = 0;
  fio_install();
  fio_arm(f->op, nth, f->kind, f->err, f->sticky);
  kvt_clear_error();
  kvt_tier *t = NULL;
  int rc_open = kvt_tier_open(&t, &o), rc_p2 = 1, rc_p4 = 1, same2 = 0,
      same4 = 0;
  kvt_stats st = KVT_STATS_INIT;
  if (rc_open == 0) {
    kvt_tier_start_writer(t);
    int s3 = t_spill(t, &E3), s1 = t_spill(t, &E1v);
    CHECK(s3 == 0 || s3 == KVT_ENOMEM);
    CHECK(s1 == 0 || s1 == KVT_ENOMEM);
    /* Zero-copy spill: its release callback must run exactly once whatever
     * happens. */
    int s8 =
        kvt_tier_spill_nocopy(t, E8.tokens, E8.n_tokens, E8.layers, E8.n_layers,
                              E8.memory_bytes, on_release, NULL);
    CHECK(s8 == 0 || s8 == KVT_ENOMEM);
    nocopy_called = 1;
    kvt_tier_flush(t, 20000);
    int same2a = 0, rc_a = promote_async_same(t, &E2, &same2a);
    if (rc_a == 0)
      CHECK(same2a);
    else
      CHECK(code_ok(rc_a));
    int rm = kvt_tier_remove(t, E7.tokens, E7.n_tokens);
    CHECK(rm == 0 || code_ok(rm));
    rc_p2 = promote_same(t, &E2, &same2);
    if (write_only(f->op)) {
      /* Writes failing (a full or read-only disk) never stop the tier from
       * serving what it has: E2, and E1 in its old or new version. */
      CHECK_EQ_INT(rc_p2, 0);
      int s_old = 0, s_new = 0;
      int r1 = promote_same(t, &E1, &s_old);
      if (r1 == 0 && !s_old)
        CHECK_EQ_INT(promote_same(t, &E1v, &s_new), 0);
      char h1v[65];
      hash_of(h1v, &E1v);
      if (r1 == KVT_ENOTFOUND && rel_done_status(&done, h1v) < 0) {
        /* The replace failed after its files were published (the index row
         * could not be written: index.db's I/O goes through the seam too):
         * the writer removed both versions (see the check after reopen). */
      } else {
        CHECK_EQ_INT(r1, 0);
        CHECK(s_old || s_new);
      }
      g_served_during_write_faults++;
    }
    rc_p4 = promote_same(t, &E4, &same4);
    kvt_tier_reconcile(t);
    CHECK_EQ_INT(kvt_tier_stats(&st, t), 0);
    g_last_quarantined = st.quarantined;
    g_last_reconciled = st.reconciled;
    kvt_tier_close(t, 20000);
    kvt_tier_free(t);
  } else {
    g_open_failed++;
    CHECK(t == NULL);
    CHECK(kvt_last_error()[0] != '\0');
    if (!code_ok(rc_open))
      fprintf(stderr, "  %s #%llu: open returned %d (%s)\n", fio_op_name(f->op),
              (unsigned long long)nth, rc_open, kvt_last_error());
    CHECK(code_ok(rc_open));
  }
  uint64_t fired = fio_fired();
  fio_remove();
  g_runs++;
  if (nocopy_called)
    CHECK_EQ_INT(atomic_load(&g_released), 1);
  int fds1 = open_fds();
  if (fds1 != fds0)
    fprintf(stderr, "  %s #%llu: %d descriptors leaked\n", fio_op_name(f->op),
            (unsigned long long)nth, fds1 - fds0);
  CHECK_EQ_INT(fds1, fds0);
  char h1[65], h3[65];
  hash_of(h1, &E1v);
  hash_of(h3, &E3);
  int st1 = rel_done_status(&done, h1), st3 = rel_done_status(&done, h3);
  if (fired && transparent(f)) {
    CHECK_EQ_INT(rc_open, 0);
    CHECK_EQ_INT(st1, 0);
    CHECK_EQ_INT(st3, 0);
    CHECK_EQ_INT(rc_p2, 0);
  }
  if (rc_open == 0) {
    /* Counted: each failed spill in write_failures, each failed promote in
     * promotion_failures. */
    uint64_t wf = (uint64_t)(st1 < 0) + (uint64_t)(st3 < 0);
    g_write_failed += wf;
    CHECK(st.write_failures >= wf);
    if (rc_p2 != 0) {
      g_promote_failed++;
      CHECK(code_ok(rc_p2));
      CHECK(st.promotion_failures >= 1);
    } else {
      CHECK(same2);
    }
    CHECK(rc_p4 != 0); /* the corrupt entry is never served */
    if (rc_p4 == KVT_ECORRUPT)
      CHECK(st.promotion_failures >= 1);
  }
  /* After a clean reopen. */
  int before = kvt_test_failures;
  char h4[65];
  hash_of(h4, &E4);
  rel_check_dir(g_dir, h4);
  kvt_options o2 = rel_opts(g_dir, KVT_DURABILITY_NONE);
  kvt_tier *t2 = t_open(&o2);
  int same = 0, rc = promote_same(t2, &E2, &same);
  if (rc != 0 || !same)
    fprintf(stderr, "  E2 lost or damaged by a fault elsewhere: %d (%s)\n", rc,
            kvt_last_error());
  CHECK_EQ_INT(rc, 0);
  CHECK(same);
  rc = promote_same(t2, &E3, &same);
  if (st3 == 0) {
    CHECK_EQ_INT(rc, 0);
    CHECK(same);
  } else {
    CHECK_EQ_INT(rc, KVT_ENOTFOUND);
  }
  rc = promote_same(t2, &E1v, &same);
  if (st1 == 0) {
    CHECK_EQ_INT(rc, 0);
    CHECK(same);
  } else if (rc == 0) {
    CHECK(!same); /* not reported written: the old version */
    CHECK_EQ_INT(promote_same(t2, &E1, &same), 0);
    CHECK(same);
  } else {
    /* A replace that failed after the exchange (index row not written) removes
     * both versions, so that no unindexed files remain; the spill was reported
     * failed. */
    CHECK(st1 < 0);
    CHECK_EQ_INT(rc, KVT_ENOTFOUND);
    g_replace_lost++;
  }
  rc = promote_same(t2, &E4, &same);
  CHECK(rc != 0);
  /* A removal under the fault: the entry is either whole or gone. */
  rc = promote_same(t2, &E7, &same);
  CHECK(rc == KVT_ENOTFOUND || (rc == 0 && same));
  char h8[65];
  hash_of(h8, &E8);
  rc = promote_same(t2, &E8, &same);
  if (rel_done_status(&done, h8) == 0)
    CHECK(rc == 0 && same);
  else
    CHECK_EQ_INT(rc, KVT_ENOTFOUND);
  kvt_tier_close(t2, -1);
  kvt_tier_free(t2);
  if (kvt_test_failures != before)
    fprintf(stderr, "  (after %s %s #%llu%s)\n", fio_op_name(f->op),
            f->kind == FIO_FAIL_SHORT ? "short" : strerror(f->err),
            (unsigned long long)nth, f->sticky ? " sticky" : "");
  pthread_mutex_destroy(&done.mu);
  return fired != 0;
}

static const fault g_faults[] = {
    {FIO_OPEN, FIO_FAIL_ERRNO, EIO, 0},
    {FIO_OPEN, FIO_FAIL_ERRNO, EINTR, 0},
    {FIO_CLOSE, FIO_FAIL_ERRNO, EIO, 0},
    {FIO_PREAD, FIO_FAIL_ERRNO, EIO, 0},
    {FIO_PREAD, FIO_FAIL_SHORT, 0, 1},
    {FIO_PWRITE, FIO_FAIL_ERRNO, ENOSPC, 0},
    {FIO_PWRITE, FIO_FAIL_ERRNO, ENOSPC, 1},
    {FIO_PWRITE, FIO_FAIL_ERRNO, EINTR, 0},
    {FIO_PWRITE, FIO_FAIL_SHORT, 0, 1},
    {FIO_FSYNC, FIO_FAIL_ERRNO, EIO, 0},
    {FIO_FSTAT, FIO_FAIL_ERRNO, EIO, 0},
    {FIO_LSTAT, FIO_FAIL_ERRNO, EIO, 0},
    {FIO_RENAME, FIO_FAIL_ERRNO, EIO, 0},
    {FIO_MKDIR, FIO_FAIL_ERRNO, ENOSPC, 0},
    {FIO_RMDIR, FIO_FAIL_ERRNO, EIO, 0},
    {FIO_UNLINK, FIO_FAIL_ERRNO, EIO, 0},
    {FIO_CHMOD, FIO_FAIL_ERRNO, EIO, 0},
    {FIO_OPENDIR, FIO_FAIL_ERRNO, EIO, 0},
    {FIO_READDIR, FIO_FAIL_ERRNO, EIO, 0},
    {FIO_RENAME_EXCHANGE, FIO_FAIL_ERRNO, EIO, 0},
    {FIO_PWRITE, FIO_FAIL_ERRNO, EIO, 0},
    {FIO_FSYNC, FIO_FAIL_ERRNO, ENOSPC, 0},
    {FIO_FSYNC, FIO_FAIL_ERRNO, EINTR, 0},
    {FIO_PREAD, FIO_FAIL_ERRNO, EINTR, 0},
    {FIO_PREAD, FIO_FAIL_ERRNO, EIO, 1},
    {FIO_RENAME, FIO_FAIL_ERRNO, ENOSPC, 0},
    {FIO_ALLOC, FIO_FAIL_ERRNO, ENOMEM, 0},
};
#define N_FAULTS (sizeof g_faults / sizeof g_faults[0])

/* The same run without a fault: everything succeeds, the corrupt entry is
 * quarantined and counted, the debris is cleaned up (so the fault runs do
 * exercise those paths). */
static void test_baseline(void) {
  fault none = {FIO_OPEN, FIO_FAIL_ERRNO, EIO, 0};
  CHECK(!run_once(&none, 0));
  kvt_options o = rel_opts(g_dir, KVT_DURABILITY_NONE);
  kvt_tier *t = t_open(&o);
  kvt_entry_info info;
  CHECK_EQ_INT(kvt_tier_lookup(&info, t, E4.tokens, E4.n_tokens),
               KVT_ENOTFOUND);
  CHECK_EQ_INT(kvt_tier_lookup(&info, t, E5.tokens, E5.n_tokens),
               KVT_ENOTFOUND);
  CHECK_EQ_INT(kvt_tier_lookup(&info, t, E6.tokens, E6.n_tokens),
               KVT_ENOTFOUND);
  char *q = rel_path(g_dir, "quarantine", NULL);
  CHECK_EQ_INT(kvt_test_count_dir(q, NULL), 1);
  free(q);
  kvt_tier_free(t);
  CHECK_EQ_INT(g_last_quarantined, 1);
  CHECK(g_last_reconciled >= 2);
}

static void test_tier_faults(void) {
  long stride = r_env_long("KVT_FAULT_TIER_STRIDE", 1);
  if (stride < 1)
    stride = 1;
  uint64_t sites = 0;
  for (size_t i = 0; i < N_FAULTS; i++) {
    uint64_t n = 1, k = 0;
    while (n < 20000 && run_once(&g_faults[i], n)) {
      n += (uint64_t)stride;
      k++;
    }
    sites += k;
    fprintf(stderr, "  %-16s %-24s %4llu sites\n", fio_op_name(g_faults[i].op),
            g_faults[i].kind == FIO_FAIL_SHORT ? "short"
                                               : strerror(g_faults[i].err),
            (unsigned long long)k);
  }
  fprintf(
      stderr,
      "tier: %llu runs over %llu call sites, %llu faults injected; %llu opens "
      "failed, %llu spills failed (counted), %llu promotes failed (counted), "
      "%llu "
      "failed replaces removed the old version; %llu sessions kept serving "
      "while writes "
      "failed\n",
      (unsigned long long)g_runs, (unsigned long long)sites,
      (unsigned long long)fio_total_injected(),
      (unsigned long long)g_open_failed, (unsigned long long)g_write_failed,
      (unsigned long long)g_promote_failed, (unsigned long long)g_replace_lost,
      (unsigned long long)g_served_during_write_faults);
}

int main(void) {
  r_use_fast_tmp();
  char *root = kvt_test_tmpdir("fault-tier");
  snprintf(g_pristine, sizeof g_pristine, "%s/pristine", root);
  snprintf(g_dir, sizeof g_dir, "%s/run", root);
  E1 = t_make(1, 24, 2, 4, 8);
  E1v = t_make(11, 24, 2, 4, 8);
  memcpy(E1v.tokens, E1.tokens, 24 * sizeof(int32_t));
  E2 = t_make(2, 30, 2, 4, 8);
  E3 = t_make(3, 18, 3, 4, 8);
  E4 = t_make(4, 20, 2, 4, 8);
  E5 = t_make(5, 21, 2, 4, 8);
  E6 = t_make(6, 22, 2, 4, 8);
  E7 = t_make(7, 23, 2, 4, 8);
  E8 = t_make(8, 25, 2, 4, 8);
  make_pristine();
  RUN(test_baseline);
  RUN(test_tier_faults);
  t_free(&E1);
  t_free(&E1v);
  t_free(&E2);
  t_free(&E3);
  t_free(&E4);
  t_free(&E5);
  t_free(&E6);
  t_free(&E7);
  t_free(&E8);
  return kvt_test_done();
}
