/*
 * test_fault_entry.c - fault injection at the I/O seam for one entry's write
 * and read (the format layer, below the tier). For every operation of the seam
 * and every call site of it in turn (N = 1, 2, ... until the armed fault stops
 * firing) the Nth call fails with EIO, ENOSPC, ENOMEM (allocations) or, for a
 * full disk, every call from the Nth on. EINTR and short transfers on
 * open/pread/pwrite/fsync must be absorbed: the operation succeeds with
 * identical data. Asserted after each fault: no crash (ASan/UBSan builds also
 * catch leaks and overruns), a failed write reports an I/O/space/memory code
 * with a message, leaves no new entry and no temporary behind, and never
 * changes the entry it was replacing; a failed read returns no data and never
 * reports a transient fault as corruption (the tier would quarantine a good
 * entry); no file descriptor leaks on any path (counted in /proc/self/fd);
 * retried without the fault, everything succeeds and reads back bit for bit.
 * The same for a trimmed read (format 2: verified blocks only).
 */
#include "faultio.h"
#include "rel_common.h"
#include "engine/iobatch.h"

static char g_data[4096];
static uint64_t g_runs, g_write_fail, g_read_fail, g_absorbed;

/* Codes a failed write or read may legitimately report for an injected OS/alloc
 * fault. */
static int code_ok(int rc) {
  return rc == KVT_EIO || rc == KVT_ENOSPC || rc == KVT_ENOMEM ||
         rc == KVT_EPERM || rc == KVT_ENOTFOUND;
}

/* Ops whose failure is in best-effort cleanup (removing a temporary / the old
 * version): a leftover <hash>.tmp is then allowed until the next write or the
 * tier's reconcile. */
static int cleanup_op(fio_op op) {
  return op == FIO_UNLINK || op == FIO_RMDIR || op == FIO_LSTAT ||
         op == FIO_OPENDIR || op == FIO_READDIR || op == FIO_CLOSEDIR;
}

typedef struct fault {
  fio_op op;
  fio_kind kind;
  int err;
  int sticky;
} fault;

static const char *fault_name(const fault *f, char *buf, size_t n) {
  snprintf(buf, n, "%s %s%s%s", fio_op_name(f->op),
           f->kind == FIO_FAIL_SHORT ? "short" : strerror(f->err),
           f->sticky ? " sticky" : "", "");
  return buf;
}

/* One write under fault f at call nth. replace: the entry written has the same
 * tokens as `old` (already stored). Returns 0 when the fault did not fire (all
 * sites covered). */
static int write_once(const fault *f, uint64_t nth, const t_entry *old,
                      const t_entry *neu, int replace, int no_exch) {
  char name[96];
  r_fresh_dir(g_data);
  fio_install();
  fio_set_no_exchange(no_exch);
  REQUIRE(r_write(g_data, old, KVT_STORAGE_NATIVE, 1) == 0);
  int fds0 = kvt_test_count_dir("/proc/self/fd", NULL);
  fio_arm(f->op, nth, f->kind, f->err, f->sticky);
  kvt_clear_error();
  int rc = r_write(g_data, neu, KVT_STORAGE_NATIVE, 1);
  uint64_t fired = fio_fired();
  fio_disarm();
  CHECK_EQ_INT(kvt_test_count_dir("/proc/self/fd", NULL),
               fds0); /* no descriptor leaked */
  g_runs++;
  int transparent = f->kind == FIO_FAIL_SHORT || f->err == EINTR;
  if (fired && transparent) {
    g_absorbed++;
    if (rc != 0)
      fprintf(stderr, "  %s #%llu not absorbed: %s\n",
              fault_name(f, name, sizeof name), (unsigned long long)nth,
              kvt_last_error());
    CHECK_EQ_INT(rc, 0);
  }
  if (rc != 0) {
    g_write_fail++;
    if (!code_ok(rc))
      fprintf(stderr, "  %s #%llu: unexpected code %d (%s)\n",
              fault_name(f, name, sizeof name), (unsigned long long)nth, rc,
              kvt_last_error());
    CHECK(code_ok(rc));
    CHECK(kvt_last_error()[0] != '\0');
  }
  /* What is visible now: the new version when the write succeeded, else the old
   * one (replace) or nothing (new entry). Never anything that does not verify.
   */
  int same = 0, rr;
  if (rc == 0) {
    rr = r_read(g_data, neu, &same);
    CHECK_EQ_INT(rr, 0);
    CHECK(same);
  } else if (replace) {
    rr = r_read(g_data, old, &same);
    if (rr != 0 || !same)
      fprintf(stderr, "  %s #%llu: replaced entry damaged (%d: %s)\n",
              fault_name(f, name, sizeof name), (unsigned long long)nth, rr,
              kvt_last_error());
    CHECK_EQ_INT(rr, 0);
    CHECK(same);
  } else {
    if (r_entry_exists(g_data, neu->hash))
      fprintf(stderr, "  %s #%llu: failed write left data/<hash>\n",
              fault_name(f, name, sizeof name), (unsigned long long)nth);
    CHECK(!r_entry_exists(g_data, neu->hash));
  }
  if (!replace) { /* the other entry is untouched */
    rr = r_read(g_data, old, &same);
    CHECK_EQ_INT(rr, 0);
    CHECK(same);
  }
  int leftovers = kvt_test_count_dir(g_data, ".tmp");
  /* A write that succeeded may leave the previous version in <hash>.tmp when
   * removing it failed (reported success: the new version is published); the
   * tier's reconcile removes it. */
  if (leftovers != 0 && !(cleanup_op(f->op) || f->sticky || rc == 0)) {
    fprintf(stderr, "  %s #%llu (rc %d): %d tmp leftovers\n",
            fault_name(f, name, sizeof name), (unsigned long long)nth, rc,
            leftovers);
    CHECK_EQ_INT(leftovers, 0);
  }
  /* Retried without the fault: succeeds, reads back, and no temporary of this
   * entry remains. */
  rc = r_write(g_data, neu, KVT_STORAGE_NATIVE, 1);
  CHECK_EQ_INT(rc, 0);
  rr = r_read(g_data, neu, &same);
  CHECK_EQ_INT(rr, 0);
  CHECK(same);
  char tmp[4200];
  snprintf(tmp, sizeof tmp, "%s/%s.tmp", g_data, neu->hash);
  CHECK(!kvt_test_exists(tmp));
  fio_set_no_exchange(0);
  fio_remove();
  return fired != 0;
}

/* What a read under fault `f` (at its nth call site) must show: never data
 * with an error; a short transfer or EINTR absorbed; a success bit-exact; a
 * failure with an allowed code and never KVT_ECORRUPT (the data is fine). */
static void judge_read(const char *what, const fault *f, uint64_t nth, int rc,
                       uint64_t fired, int same) {
  char name[96];
  g_runs++;
  CHECK(rc != -1000); /* never data together with an error */
  if (fired && (f->kind == FIO_FAIL_SHORT || f->err == EINTR)) {
    g_absorbed++;
    CHECK_EQ_INT(rc, 0);
  }
  if (rc == 0) {
    CHECK(same);
  } else {
    g_read_fail++;
    if (rc == KVT_ECORRUPT || !code_ok(rc))
      fprintf(stderr, "  %s %s #%llu: code %d (%s)\n", what,
              fault_name(f, name, sizeof name), (unsigned long long)nth, rc,
              kvt_last_error());
    CHECK(rc != KVT_ECORRUPT);
    CHECK(code_ok(rc));
  }
}

static uint64_t read_once(const fault *f, uint64_t nth, const t_entry *e) {
  int fds0 = kvt_test_count_dir("/proc/self/fd", NULL);
  fio_install();
  fio_arm(f->op, nth, f->kind, f->err, f->sticky);
  kvt_clear_error();
  int same = 0;
  int rc = r_read(g_data, e, &same);
  uint64_t fired = fio_fired();
  fio_remove();
  CHECK_EQ_INT(kvt_test_count_dir("/proc/self/fd", NULL), fds0);
  judge_read("read", f, nth, rc, fired, same);
  /* still good without the fault */
  CHECK_EQ_INT(r_read(g_data, e, &same), 0);
  CHECK(same);
  return fired;
}

static const fault g_faults[] = {
    {FIO_OPEN, FIO_FAIL_ERRNO, EIO, 0},
    {FIO_OPEN, FIO_FAIL_ERRNO, ENOSPC, 0},
    {FIO_OPEN, FIO_FAIL_ERRNO, EINTR, 0},
    {FIO_CLOSE, FIO_FAIL_ERRNO, EIO, 0},
    {FIO_PREAD, FIO_FAIL_ERRNO, EIO, 0},
    {FIO_PREAD, FIO_FAIL_ERRNO, EINTR, 0},
    {FIO_PREAD, FIO_FAIL_SHORT, 0, 0},
    {FIO_PREAD, FIO_FAIL_SHORT, 0, 1},
    {FIO_PWRITE, FIO_FAIL_ERRNO, EIO, 0},
    {FIO_PWRITE, FIO_FAIL_ERRNO, ENOSPC, 0},
    {FIO_PWRITE, FIO_FAIL_ERRNO, ENOSPC, 1},
    {FIO_PWRITE, FIO_FAIL_ERRNO, EINTR, 0},
    {FIO_PWRITE, FIO_FAIL_SHORT, 0, 0},
    {FIO_PWRITE, FIO_FAIL_SHORT, 0, 1},
    {FIO_FSYNC, FIO_FAIL_ERRNO, EIO, 0},
    {FIO_FSYNC, FIO_FAIL_ERRNO, EINTR, 0},
    {FIO_FTRUNCATE, FIO_FAIL_ERRNO, EIO, 0},
    {FIO_FSTAT, FIO_FAIL_ERRNO, EIO, 0},
    {FIO_LSTAT, FIO_FAIL_ERRNO, EIO, 0},
    {FIO_RENAME, FIO_FAIL_ERRNO, EIO, 0},
    {FIO_RENAME, FIO_FAIL_ERRNO, ENOSPC, 0},
    {FIO_MKDIR, FIO_FAIL_ERRNO, ENOSPC, 0},
    {FIO_RMDIR, FIO_FAIL_ERRNO, EIO, 0},
    {FIO_UNLINK, FIO_FAIL_ERRNO, EIO, 0},
    {FIO_CHMOD, FIO_FAIL_ERRNO, EIO, 0},
    {FIO_OPENDIR, FIO_FAIL_ERRNO, EIO, 0},
    {FIO_READDIR, FIO_FAIL_ERRNO, EIO, 0},
    {FIO_CLOSEDIR, FIO_FAIL_ERRNO, EIO, 0},
    {FIO_RENAME_EXCHANGE, FIO_FAIL_ERRNO, EIO, 0},
    {FIO_ALLOC, FIO_FAIL_ERRNO, ENOMEM, 0},
};
#define N_FAULTS (sizeof g_faults / sizeof g_faults[0])

/* Upper bound on call sites per op and run, so a bug cannot loop forever. */
#define MAX_SITES 5000

static void test_write_faults(void) {
  t_entry a = r_make(1, 40, 1), b = r_make(2, 33, 1);
  t_entry a2 = r_make_variant(&a, 3);
  uint64_t sites = 0;
  for (int no_exch = 0; no_exch < 2; no_exch++)
    for (int replace = 0; replace < 2; replace++)
      for (size_t i = 0; i < N_FAULTS; i++) {
        const fault *f = &g_faults[i];
        if (no_exch && f->op == FIO_RENAME_EXCHANGE)
          continue;
        int before = kvt_test_failures;
        uint64_t n = 1;
        while (n < MAX_SITES &&
               write_once(f, n, &a, replace ? &a2 : &b, replace, no_exch))
          n++;
        sites += n - 1;
        if (kvt_test_failures != before) {
          char name[96];
          fprintf(stderr, "  (write, replace=%d, no_exchange=%d, %s)\n",
                  replace, no_exch, fault_name(f, name, sizeof name));
        }
      }
  fprintf(stderr, "write: %llu call sites failed in turn\n",
          (unsigned long long)sites);
  t_free(&a);
  t_free(&b);
  t_free(&a2);
}

static void test_read_faults(void) {
  t_entry a = r_make(5, 64, 1);
  r_fresh_dir(g_data);
  REQUIRE(r_write(g_data, &a, KVT_STORAGE_NATIVE, 0) == 0);
  uint64_t sites = 0;
  for (size_t i = 0; i < N_FAULTS; i++) {
    uint64_t n = 1;
    while (n < MAX_SITES && read_once(&g_faults[i], n, &a))
      n++;
    sites += n - 1;
  }
  fprintf(stderr, "read: %llu call sites failed in turn\n",
          (unsigned long long)sites);
  t_free(&a);
}

/* Compat mode converts (bf16 upcast, dequantization): its extra allocations
 * fail in turn. */
static void test_compat_alloc_faults(void) {
  t_entry a = r_make(7, 20, 1);
  uint64_t n = 1;
  for (; n < MAX_SITES; n++) {
    r_fresh_dir(g_data);
    fio_install();
    fio_arm(FIO_ALLOC, n, FIO_FAIL_ERRNO, ENOMEM, 0);
    int rc = r_write(g_data, &a, KVT_STORAGE_COMPAT, 0);
    uint64_t fired = fio_fired();
    fio_remove();
    g_runs++;
    if (rc) {
      CHECK_EQ_INT(rc, KVT_ENOMEM);
      CHECK(!r_entry_exists(g_data, a.hash));
    } else {
      CHECK_EQ_INT(r_read(g_data, &a, NULL), 0);
    }
    CHECK_EQ_INT(kvt_test_count_dir(g_data, ".tmp"), 0);
    if (!fired)
      break;
  }
  fprintf(stderr, "compat write: %llu allocation sites\n",
          (unsigned long long)n - 1);
  t_free(&a);
}

/* A trimmed read of a format-2 entry (only the verified blocks covering the
 * header and the kept rows: header pread, batched block reads, scratch window,
 * block checks) under every fault in turn: never data with an error, never
 * corruption for a transient fault, EINTR/short reads absorbed, no fd leak, and
 * the kept rows exact on success. Layer files of 4+ blocks (2 heads x 64 KiB
 * per tensor); both I/O backends. */
enum { TR_T = 512, TR_D = 64, TR_KEEP = 100 };

static int trim_same(const kvt_entry *got, const t_entry *e) {
  if (!got || kvt_entry_num_layers(got) != e->n_layers)
    return 0;
  for (uint32_t i = 0; i < e->n_layers; i++) {
    const kvt_layer *l = kvt_entry_layer(got, i);
    if (l->offset != TR_KEEP)
      return 0;
    for (int k = 0; k < 2; k++) {
      const kvt_tensor *a = &l->tensors[k], *b = &e->layers[i].tensors[k];
      size_t row = TR_D * 2;
      if (a->shape[2] != TR_KEEP || a->nbytes != 2u * TR_KEEP * row)
        return 0;
      for (int h = 0; h < 2; h++)
        if (memcmp((const char *)a->data + (size_t)h * TR_KEEP * row,
                   (const char *)b->data + (size_t)h * TR_T * row,
                   TR_KEEP * row) != 0)
          return 0;
    }
  }
  return 1;
}

static int trim_backend; /* kvt_io_backend of the trimmed reads */

static int trim_read(const t_entry *e, int *same) {
  kvt_entry *got = NULL;
  kvti_read_opts o;
  memset(&o, 0, sizeof o);
  o.tokens = e->tokens;
  o.n_tokens = e->n_tokens;
  o.keep_tokens = TR_KEEP;
  o.io_backend = trim_backend;
  int rc = kvti_entry_read(&got, g_data, e->hash, &o);
  *same = rc == 0 && trim_same(got, e);
  if (rc != 0 && got)
    rc = -1000;
  kvt_entry_free(got);
  return rc;
}

static void test_trim_read_faults(void) {
  kvt_rng r = {11};
  t_entry a = t_entry_alloc(&r, TR_T, 2);
  for (int i = 0; i < 2; i++)
    a.layers[a.n_layers++] = t_kv(&r, KVT_DTYPE_F16, 1, 2, TR_T, TR_D, TR_T);
  r_fresh_dir(g_data);
  REQUIRE(r_write(g_data, &a, KVT_STORAGE_NATIVE, 0) == 0);
  int same = 0;
  REQUIRE(trim_read(&a, &same) == 0);
  REQUIRE(same);
  uint64_t sites = 0;
  /* PORTABLE (every block read is a pread the harness can fail; what AUTO
   * means under a replaced pread) and, where usable, io_uring (block reads
   * bypass the pread hook; allocation and header-read faults still hit). */
  kvti_iobatch *probe = NULL;
  int have_uring = kvti_iobatch_get(&probe, KVT_IO_URING) == 0;
  kvti_iobatch_put(probe);
  for (size_t i = 0; i < (have_uring ? 2 : 1) * N_FAULTS; i++) {
    const fault *f = &g_faults[i % N_FAULTS];
    trim_backend = i < N_FAULTS ? KVT_IO_PORTABLE : KVT_IO_URING;
    uint64_t n = 1;
    for (; n < MAX_SITES; n++) {
      int fds0 = kvt_test_count_dir("/proc/self/fd", NULL);
      fio_install();
      fio_arm(f->op, n, f->kind, f->err, f->sticky);
      int rc = trim_read(&a, &same);
      uint64_t fired = fio_fired();
      fio_remove();
      CHECK_EQ_INT(kvt_test_count_dir("/proc/self/fd", NULL), fds0);
      judge_read("trimmed read", f, n, rc, fired, same);
      if (!fired)
        break;
    }
    sites += n - 1;
  }
  CHECK_EQ_INT(trim_read(&a, &same), 0);
  CHECK(same);
  fprintf(stderr, "trimmed read: %llu call sites failed in turn\n",
          (unsigned long long)sites);
  t_free(&a);
}

int main(void) {
  r_use_fast_tmp();
  snprintf(g_data, sizeof g_data, "%s/data", kvt_test_tmpdir("fault-entry"));
  RUN(test_write_faults);
  RUN(test_read_faults);
  RUN(test_trim_read_faults);
  RUN(test_compat_alloc_faults);
  fprintf(
      stderr,
      "fault-entry: %llu runs, %llu faults injected, %llu write failures, %llu "
      "read failures, %llu absorbed (EINTR/short)\n",
      (unsigned long long)g_runs, (unsigned long long)fio_total_injected(),
      (unsigned long long)g_write_fail, (unsigned long long)g_read_fail,
      (unsigned long long)g_absorbed);
  return kvt_test_done();
}
