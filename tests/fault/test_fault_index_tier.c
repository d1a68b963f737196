/*
 * test_fault_index_tier.c - index.db's file I/O goes through kvtier's I/O
 * seam (the kvtier-io SQLite VFS, src/sqlvfs.c), so the fault harness reaches
 * it. Checked here: the index's opens, reads, writes, syncs, sizes, existence
 * probes and the WAL's removal are calls of the I/O table (counted by the
 * harness's target filter on "index.db"); a failure injected there comes back
 * from the index as an error code with a message and leaves neither SQLite
 * nor the in-memory mirror changed; and the writer's cleanup when the index
 * row fails after the entry's files were published: the spill is reported
 * failed and counted, and the publish is rolled back at once - a new entry
 * leaves no trace, a replacement leaves the previous version and its row
 * exactly as they were (issue 18: an EIO on the WAL never loses the
 * acknowledged version) - also when the index stays unwritable; a clean
 * reopen finds the same.
 */
#include "faultio.h"
#include "index/index.h"
#include "rel_tier.h"
#include "kvtier_sys.h"

#include <errno.h>

static const int32_t g_tok[3][6] = {
    {1, 2, 3, 4, 5, 6}, {7, 8, 9, 10, 11, 12}, {13, 14, 15, 16, 17, 18}};

static kvt_index *open_index(const char *dir, int readonly) {
  kvt_index *idx = NULL;
  int rc = kvti_index_open(&idx, dir, NULL, readonly);
  if (rc != 0)
    fprintf(stderr, "index open: %d (%s)\n", rc, kvt_last_error());
  REQUIRE(rc == 0 && idx);
  return idx;
}

static int put(kvt_index *idx, int i) {
  return kvti_index_put(idx, g_tok[i], 6, NULL, 100 + (uint64_t)i, 10,
                        KVT_STORAGE_NATIVE);
}

static int has(kvt_index *idx, int i) {
  kvt_entry_info info;
  return kvti_index_find(&info, idx, g_tok[i], 6, 0) == 0;
}

static void test_index_io_goes_through_the_seam(void) {
  char *dir = kvt_test_tmpdir("vfs-count");
  fio_install();
  fio_target("index.db");
  kvt_index *idx = open_index(dir, 0);
  CHECK_EQ_INT(kvti_index_set_durable(idx, 1), 0);
  for (int i = 0; i < 3; i++)
    CHECK_EQ_INT(put(idx, i), 0);
  uint64_t opens = fio_count_target(FIO_OPEN),
           writes = fio_count_target(FIO_PWRITE),
           syncs = fio_count_target(FIO_FSYNC),
           sizes = fio_count_target(FIO_FSTAT),
           probes = fio_count_target(FIO_LSTAT);
  fprintf(stderr,
          "  index.db through the seam: %llu opens, %llu writes, %llu syncs, "
          "%llu fstats, %llu lstats\n",
          (unsigned long long)opens, (unsigned long long)writes,
          (unsigned long long)syncs, (unsigned long long)sizes,
          (unsigned long long)probes);
  CHECK(opens >= 2); /* the database and its WAL */
  CHECK(writes >= 3);
  CHECK(syncs >= 3); /* synchronous=FULL: the WAL at each commit */
  CHECK(sizes >= 1);
  CHECK(probes >= 1);
  kvt_index_close(idx);
  /* The last connection checkpoints and deletes the WAL through the table. */
  CHECK(fio_count_target(FIO_UNLINK) >= 1);
  fio_reset();
  idx = open_index(dir, 1);
  CHECK(fio_count_target(FIO_PREAD) >= 1);
  for (int i = 0; i < 3; i++)
    CHECK(has(idx, i));
  kvt_index_close(idx);
  fio_target(NULL);
  fio_remove();
}

/* One fault at the first matching index call during a put: an error code
 * with a message, nothing changed; the next put works and survives reopen. */
static void put_under(fio_op op, int err, int expect) {
  char *dir = kvt_test_tmpdir("vfs-fault");
  fio_install();
  fio_target("index.db");
  kvt_index *idx = open_index(dir, 0);
  CHECK_EQ_INT(kvti_index_set_durable(idx, 1), 0);
  CHECK_EQ_INT(put(idx, 0), 0);
  fio_arm(op, 1, FIO_FAIL_ERRNO, err, 0);
  kvt_clear_error();
  int rc = put(idx, 1);
  CHECK(fio_fired() == 1);
  if (rc != expect)
    fprintf(stderr, "  %s %s: put returned %d (%s)\n", fio_op_name(op),
            strerror(err), rc, kvt_last_error());
  CHECK_EQ_INT(rc, expect);
  CHECK(strstr(kvt_last_error(), "index.db") != NULL);
  CHECK(!has(idx, 1));
  fio_disarm();
  CHECK_EQ_INT(put(idx, 2), 0);
  kvt_index_close(idx);
  fio_target(NULL);
  fio_remove();
  idx = open_index(dir, 1);
  CHECK(has(idx, 0));
  CHECK(!has(idx, 1));
  CHECK(has(idx, 2));
  kvt_index_close(idx);
}

static void test_index_faults_surface(void) {
  put_under(FIO_PWRITE, EIO, KVT_EIO);
  put_under(FIO_PWRITE, ENOSPC, KVT_ENOSPC);
  put_under(FIO_FSYNC, EIO, KVT_EIO);
}

static void test_index_open_faults(void) {
  char *dir = kvt_test_tmpdir("vfs-open");
  kvt_index *idx = open_index(dir, 0);
  CHECK_EQ_INT(put(idx, 0), 0);
  kvt_index_close(idx);
  fio_op ops[] = {FIO_OPEN, FIO_PREAD, FIO_FSTAT};
  for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++) {
    fio_install();
    fio_target("index.db");
    fio_arm(ops[i], 1, FIO_FAIL_ERRNO, EIO, 1);
    kvt_clear_error();
    idx = NULL;
    int rc = kvti_index_open(&idx, dir, NULL, 0);
    CHECK(fio_fired() >= 1);
    CHECK(rc == KVT_EIO || rc == KVT_EDB);
    CHECK(idx == NULL);
    CHECK(kvt_last_error()[0] != '\0');
    if (idx)
      kvt_index_close(idx);
    fio_target(NULL);
    fio_remove();
  }
  idx = open_index(dir, 1);
  CHECK(has(idx, 0));
  kvt_index_close(idx);
}

/* The spill of e under a fault in the index's writes (sticky: the index stays
 * unwritable until the flush is over). e_old: the stored version it
 * replaces, or NULL. */
static void spill_with_index_failing(const t_entry *e, const t_entry *e_old,
                                     int sticky) {
  char *dir = kvt_test_tmpdir("vfs-writer");
  rel_done done;
  memset(&done, 0, sizeof done);
  pthread_mutex_init(&done.mu, NULL);
  kvt_options o = rel_opts(dir, KVT_DURABILITY_FSYNC);
  o.spill_done_fn = rel_done_fn;
  o.spill_done_ctx = &done;
  fio_install();
  fio_target("index.db");
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  if (e_old) {
    REQUIRE(t_spill(t, e_old) == 0);
    REQUIRE(kvt_tier_flush(t, -1) == 0);
  }
  char h[KVT_HASH_HEX_LEN + 1];
  kvt_token_hash(h, e->tokens, e->n_tokens);
  char *path = t_entry_path(t, e->tokens, e->n_tokens, NULL);
  char *data = rel_path(dir, "data", NULL);
  fio_arm(FIO_PWRITE, 1, FIO_FAIL_ERRNO, EIO, sticky);
  REQUIRE(t_spill(t, e) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  /* Looked at before anything else runs: the writer's own cleanup. */
  CHECK(fio_fired() >= 1);
  CHECK(rel_done_status(&done, h) < 0);
  CHECK_EQ_INT(kvt_test_exists(path), e_old != NULL);
  CHECK_EQ_INT(kvt_test_count_dir(data, ".tmp"), 0);
  fio_disarm();
  kvt_stats st = KVT_STATS_INIT;
  CHECK_EQ_INT(kvt_tier_stats(&st, t), 0);
  CHECK_EQ_INT(st.write_failures, 1);
  kvt_entry_info info;
  int want = e_old ? 0 : KVT_ENOTFOUND;
  CHECK_EQ_INT(kvt_tier_lookup(&info, t, e->tokens, e->n_tokens), want);
  kvt_entry *got = NULL;
  CHECK_EQ_INT(kvt_tier_promote(&got, t, e->tokens, e->n_tokens, NULL), want);
  if (e_old) /* the previous version, bit-exact */
    CHECK(got && t_same(got, e_old));
  else
    CHECK(got == NULL);
  kvt_entry_free(got);
  kvt_tier_close(t, -1);
  kvt_tier_free(t);
  fio_target(NULL);
  fio_remove();
  /* After a clean reopen: the same. */
  CHECK_EQ_INT(rel_check_dir(dir, NULL), e_old ? 1 : 0);
  kvt_tier *t2 = t_open(&o);
  CHECK_EQ_INT(kvt_tier_lookup(&info, t2, e->tokens, e->n_tokens), want);
  kvt_tier_free(t2);
  CHECK_EQ_INT(kvt_test_exists(path), e_old != NULL);
  free(path);
  free(data);
  pthread_mutex_destroy(&done.mu);
}

static void test_writer_cleanup_after_index_failure(void) {
  t_entry a = t_make(41, 20, 2, 4, 8), a2 = t_make(42, 20, 2, 4, 8);
  memcpy(a2.tokens, a.tokens, 20 * sizeof(int32_t));
  spill_with_index_failing(&a, NULL, 0); /* a new entry */
  spill_with_index_failing(&a, NULL, 1);
  spill_with_index_failing(&a2, &a, 0); /* a replace */
  spill_with_index_failing(&a2, &a, 1);
  t_free(&a);
  t_free(&a2);
}

int main(void) {
  r_use_fast_tmp();
  RUN(test_index_io_goes_through_the_seam);
  RUN(test_index_faults_surface);
  RUN(test_index_open_faults);
  RUN(test_writer_cleanup_after_index_failure);
  return kvt_test_done();
}
