/*
 * test_entry_thread.c - the layer-by-layer entry reader used for parallel
 * promotes: several threads read distinct layers of one entry at once (run
 * under TSan by the `threads` label), the result equals a sequential read bit
 * for bit, caller allocation callbacks are honoured from every thread, and
 * misuse (finishing early, reading a layer twice) is refused.
 */
#include "fmt_testlib.h"
#include "format/entry.h"

#include <pthread.h>
#include <stdatomic.h>

#define NL 12

typedef struct job {
  kvti_entry_reader *r;
  uint32_t start, step;
  int rc;
} job;

static void *worker(void *arg) {
  job *j = arg;
  uint32_t n = kvti_entry_reader_num_layers(j->r);
  for (uint32_t i = j->start; i < n; i += j->step) {
    const kvt_layer *l = NULL;
    int rc = kvti_entry_reader_read_layer(j->r, n - 1 - i, &l);
    if (rc || !l)
      j->rc = rc ? rc : -100;
  }
  return NULL;
}

static atomic_int g_allocs, g_frees;
static void *cb_alloc(void *ctx, uint32_t layer, uint32_t tensor,
                      const kvt_tensor *desc) {
  (void)ctx;
  (void)layer;
  (void)tensor;
  atomic_fetch_add(&g_allocs, 1);
  return malloc(desc->nbytes);
}
static void cb_free(void *ctx, void *buf) {
  (void)ctx;
  atomic_fetch_add(&g_frees, 1);
  free(buf);
}

static void test_parallel_layers(void) {
  char *dir = kvt_test_tmpdir("entry-par");
  kvt_rng r = {31};
  kvt_layer ls[NL];
  for (int i = 0; i < NL; i++) {
    if (i % 3 == 2) {
      kvt_dtype d[3] = {KVT_DTYPE_F32, KVT_DTYPE_BF16, KVT_DTYPE_I64};
      ls[i] = t_arrays(&r, 3, d);
    } else if (i % 3 == 1) {
      ls[i] = t_quant(&r, 4, 32, KVT_DTYPE_BF16, 1, 2, 8, 64, 8);
    } else {
      ls[i] = t_kv(&r, KVT_DTYPE_BF16, 1, 2, 16, 32, 16);
    }
  }
  int32_t tok[9] = {9, 8, 7, 6, 5, 4, 3, 2, 1};
  char h[65];
  kvt_token_hash(h, tok, 9);
  kvti_snapshot *s = NULL;
  REQUIRE(kvti_snapshot_create(&s, tok, 9, ls, NL, 1, 1, NULL, NULL) == 0);
  kvti_write_opts o = {KVT_STORAGE_NATIVE, 0, 0600, 0700};
  REQUIRE(kvti_entry_write(NULL, dir, s, &o) == 0);
  kvti_snapshot_free(s);
  for (int with_cb = 0; with_cb < 2; with_cb++) {
    kvti_read_opts ro = {0};
    if (with_cb) {
      ro.alloc = cb_alloc;
      ro.free_buf = cb_free;
    }
    atomic_store(&g_allocs, 0);
    atomic_store(&g_frees, 0);
    kvti_entry_reader *rd = NULL;
    REQUIRE(kvti_entry_reader_open(&rd, dir, h, &ro) == 0);
    CHECK_EQ_INT(kvti_entry_reader_num_layers(rd), NL);
    kvt_entry *e = NULL;
    CHECK_EQ_INT(kvti_entry_reader_finish(&e, rd), KVT_EINVAL); /* too early */
    pthread_t th[3];
    job jobs[3];
    for (int t = 0; t < 3; t++) {
      jobs[t] = (job){rd, (uint32_t)t, 3, 0};
      pthread_create(&th[t], NULL, worker, &jobs[t]);
    }
    for (int t = 0; t < 3; t++) {
      pthread_join(th[t], NULL);
      CHECK_EQ_INT(jobs[t].rc, 0);
    }
    CHECK_EQ_INT(kvti_entry_reader_read_layer(rd, 0, NULL), KVT_EINVAL);
    REQUIRE(kvti_entry_reader_finish(&e, rd) == 0);
    kvti_entry_reader_free(rd);
    kvt_entry *seq = NULL;
    REQUIRE(kvti_entry_read(&seq, dir, h, NULL) == 0);
    CHECK_EQ_INT(kvt_entry_disk_bytes(e), kvt_entry_disk_bytes(seq));
    for (uint32_t i = 0; i < NL; i++) {
      CHECK(t_layer_eq(kvt_entry_layer(e, i), &ls[i]));
      CHECK(t_layer_eq(kvt_entry_layer(e, i), kvt_entry_layer(seq, i)));
    }
    kvt_entry_free(seq);
    kvt_entry_free(e);
    CHECK_EQ_INT(atomic_load(&g_frees), atomic_load(&g_allocs));
    if (with_cb)
      CHECK(atomic_load(&g_allocs) > 0);
  }
  /* a reader freed half way hands every caller buffer back */
  kvti_read_opts ro = {0};
  ro.alloc = cb_alloc;
  ro.free_buf = cb_free;
  atomic_store(&g_allocs, 0);
  atomic_store(&g_frees, 0);
  kvti_entry_reader *rd = NULL;
  REQUIRE(kvti_entry_reader_open(&rd, dir, h, &ro) == 0);
  CHECK_EQ_INT(kvti_entry_reader_read_layer(rd, 3, NULL), 0);
  CHECK_EQ_INT(kvti_entry_reader_read_layer(rd, NL, NULL), KVT_EINVAL);
  kvti_entry_reader_free(rd);
  CHECK(atomic_load(&g_allocs) > 0);
  CHECK_EQ_INT(atomic_load(&g_frees), atomic_load(&g_allocs));
  for (int i = 0; i < NL; i++)
    t_layer_free(&ls[i]);
}

int main(void) {
  RUN(test_parallel_layers);
  return kvt_test_done();
}
