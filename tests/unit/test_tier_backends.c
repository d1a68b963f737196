/*
 * test_tier_backends.c - the tier end to end on each I/O backend
 * (kvt_options.io_backend): PORTABLE (pread/pwrite) and URING (skipped where
 * io_uring cannot be set up) spill durably and promote byte-identical entries,
 * sync and async, with on_layer in order and caller buffers; URING is refused
 * at open with KVT_EUNSUPPORTED when io_uring setup fails (injected through the
 * io seam), while AUTO then falls back to the portable backend and still works.
 */
#include "testutil.h"
#include "engine/iobatch.h"
#include "tier_testlib.h"

static int ordered, seen;
static void on_layer(void *ctx, uint32_t i, const kvt_layer *l) {
  (void)ctx, (void)l;
  if ((int)i == seen)
    ordered++;
  seen++;
}

static void *c_alloc(void *ctx, uint32_t layer, uint32_t tensor,
                     const kvt_tensor *d) {
  (void)ctx, (void)layer, (void)tensor;
  return malloc(d->nbytes ? d->nbytes : 1);
}
static void c_free(void *ctx, void *p) {
  (void)ctx;
  free(p);
}

static void round_trip(int backend, const char *tag) {
  kvt_options o = t_opts(tag);
  o.io_backend = backend;
  o.durability = KVT_DURABILITY_FSYNC;
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  /* Layers of 2 x [1, 2, 300, 64] F32 (150 KiB each): several pieces, unaligned
   * tails. */
  t_entry e = t_make(21, 33, 6, 300, 64);
  REQUIRE(t_spill(t, &e) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  kvt_entry *got = NULL;
  REQUIRE(kvt_tier_promote(&got, t, e.tokens, e.n_tokens, NULL) == 0);
  CHECK(t_same(got, &e));
  kvt_entry_free(got);
  kvt_promote_opts po = t_popts(NULL);
  po.on_layer = on_layer;
  po.alloc = c_alloc;
  po.free_buf = c_free;
  seen = ordered = 0;
  kvt_promise *p = NULL;
  REQUIRE(kvt_tier_promote_async(&p, t, e.tokens, e.n_tokens, &po) == 0);
  REQUIRE(kvt_promise_wait(p, -1) == 0);
  got = NULL;
  REQUIRE(kvt_promise_result(&got, p) == 0);
  CHECK(t_same(got, &e));
  CHECK_EQ_INT(seen, 6);
  CHECK_EQ_INT(ordered, 6);
  kvt_entry_free(got);
  kvt_promise_free(p);
  char h[KVT_HASH_HEX_LEN + 1];
  kvt_token_hash(h, e.tokens, e.n_tokens);
  CHECK_EQ_INT(kvt_tier_verify(t, h, 0), 0);
  REQUIRE(kvt_tier_close(t, -1) == 0);
  kvt_tier_free(t);
  t_free(&e);
}

static int setup_errno;
static int fail_setup(unsigned entries, void *ring, unsigned flags) {
  if (setup_errno)
    return -setup_errno;
  return kvti_io_default.uring_setup(entries, ring, flags);
}

static void test_backends(void) {
  round_trip(KVT_IO_PORTABLE, "be-portable");
  round_trip(KVT_IO_AUTO, "be-auto");
  kvti_iob_cfg cfg = KVTI_IOB_CFG_INIT;
  cfg.backend = KVT_IO_URING;
  kvti_iobatch *b = NULL;
  if (kvti_iobatch_create(&b, &cfg) == 0) {
    kvti_iobatch_free(b);
    round_trip(KVT_IO_URING, "be-uring");
  } else {
    kvt_test_skip("uring", "URING round trip: io_uring unavailable (%s)",
                  kvt_last_error());
  }
}

static void test_uring_refused(void) {
  if (!kvti_iobatch_uring_built()) {
    kvt_test_skip("uring", "refused-ring fallback: built without liburing");
    return;
  }
  kvti_io_ops ops = kvti_io_default;
  ops.uring_setup = fail_setup;
  kvti_io_set(&ops);
  kvti_iobatch_cache_drain();
  setup_errno = ENOSYS;
  kvt_options o = t_opts("be-refused");
  o.io_backend = KVT_IO_URING;
  kvt_tier *t = NULL;
  CHECK_EQ_INT(kvt_tier_open(&t, &o), KVT_EUNSUPPORTED);
  CHECK(t == NULL);
  CHECK(strstr(kvt_last_error(), "io_uring") != NULL);
  /* AUTO falls back and works. */
  round_trip(KVT_IO_AUTO, "be-fallback");
  setup_errno = 0;
  kvti_io_set(NULL);
  kvti_iobatch_cache_drain();
}

int main(void) {
  RUN(test_backends);
  RUN(test_uring_refused);
  kvti_iobatch_cache_drain();
  return kvt_test_done();
}
