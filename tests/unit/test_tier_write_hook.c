/*
 * test_tier_write_hook.c - the writer pieces that exist for the Python
 * drop-in (writer_hook.c): kvt_tier_set_write_hook hands each spill to the
 * hook in FIFO order and writes nothing itself; kvt_tier_write_pending writes
 * the spill in the hook's hands and refuses any other; a failing hook is
 * counted and reported; a NULL hook restores the C write; a blocked hook
 * holds no tier lock (a promote and a quarantine complete meanwhile); and
 * kvt_tier_close_queued: KVT_EFULL with nothing changed when the stop marker
 * cannot get a queue slot, KVT_ETIMEDOUT with the tier still open when the
 * writer does not reach it, success on retry, and a writer started when
 * spills were queued without one.
 */
#include "tier_testlib.h"

#include <time.h>

enum { M_WRITE = 0, M_FAIL = 1, M_NOTHING = 2 };

typedef struct hook_ctx {
  kvt_tier *t;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int mode;
  int block;   /* the next call waits until unblocked */
  int blocked; /* a call is waiting */
  int calls;
  uint64_t last_id;
  int32_t first_token[16];
} hook_ctx;

static int hook(void *c, uint64_t id, const int32_t *tokens, size_t n,
                uint64_t memory_bytes) {
  hook_ctx *h = c;
  (void)memory_bytes;
  pthread_mutex_lock(&h->mu);
  if (h->calls < 16)
    h->first_token[h->calls] = n ? tokens[0] : -1;
  h->calls++;
  h->last_id = id;
  if (h->block) {
    h->block = 0;
    h->blocked = 1;
    pthread_cond_broadcast(&h->cv);
    while (h->blocked)
      pthread_cond_wait(&h->cv, &h->mu);
  }
  int mode = h->mode;
  pthread_mutex_unlock(&h->mu);
  if (mode == M_FAIL)
    return KVT_EIO;
  if (mode == M_NOTHING)
    return 0;
  return kvt_tier_write_pending(h->t, id);
}

static void hook_init(hook_ctx *h, kvt_tier *t) {
  memset(h, 0, sizeof *h);
  h->t = t;
  pthread_mutex_init(&h->mu, NULL);
  pthread_cond_init(&h->cv, NULL);
}

static void wait_blocked(hook_ctx *h) {
  pthread_mutex_lock(&h->mu);
  while (!h->blocked)
    pthread_cond_wait(&h->cv, &h->mu);
  pthread_mutex_unlock(&h->mu);
}

static void unblock(hook_ctx *h) {
  pthread_mutex_lock(&h->mu);
  h->blocked = 0;
  pthread_cond_broadcast(&h->cv);
  pthread_mutex_unlock(&h->mu);
}

typedef struct done_log {
  pthread_mutex_t mu;
  int n;
  int rc[16];
} done_log;

static void on_done(void *c, const char *hash, int rc) {
  done_log *d = c;
  (void)hash;
  pthread_mutex_lock(&d->mu);
  if (d->n < 16)
    d->rc[d->n] = rc;
  d->n++;
  pthread_mutex_unlock(&d->mu);
}

static int found(kvt_tier *t, const t_entry *e) {
  kvt_entry_info info;
  return kvt_tier_lookup(&info, t, e->tokens, e->n_tokens) == 0;
}

static uint64_t depth(kvt_tier *t) {
  kvt_stats s = KVT_STATS_INIT;
  REQUIRE(kvt_tier_stats(&s, t) == 0);
  return s.queue_depth;
}

static void test_hook_modes(void) {
  kvt_options o = t_opts("hook-modes");
  done_log d = {PTHREAD_MUTEX_INITIALIZER, 0, {0}};
  o.spill_done_fn = on_done;
  o.spill_done_ctx = &d;
  kvt_tier *t = t_open(&o);
  hook_ctx h;
  hook_init(&h, t);
  t_entry e[6];
  for (int i = 0; i < 6; i++)
    e[i] = t_make(100 + (uint64_t)i, 8, 1, 4, 8);
  CHECK(kvt_tier_set_write_hook(NULL, hook, &h) == KVT_EINVAL);
  CHECK(kvt_tier_set_write_hook(t, hook, &h) == 0);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  /* Through the hook, in FIFO order. */
  for (int i = 0; i < 3; i++)
    REQUIRE(t_spill(t, &e[i]) == 0);
  REQUIRE(kvt_tier_flush(t, 20000) == 0);
  CHECK_EQ_INT(h.calls, 3);
  for (int i = 0; i < 3; i++) {
    CHECK(h.first_token[i] == e[i].tokens[0]);
    CHECK(found(t, &e[i]));
    CHECK(d.rc[i] == 0);
  }
  /* A spill that left the hook, or no spill, cannot be written. */
  CHECK(kvt_tier_write_pending(t, h.last_id) == KVT_EINVAL);
  CHECK(kvt_tier_write_pending(t, 0) == KVT_EINVAL);
  /* Failing: counted, reported, nothing stored. Nothing written: reported
   * as cancelled, not a failure. */
  h.mode = M_FAIL;
  REQUIRE(t_spill(t, &e[3]) == 0);
  REQUIRE(kvt_tier_flush(t, 20000) == 0);
  h.mode = M_NOTHING;
  REQUIRE(t_spill(t, &e[4]) == 0);
  REQUIRE(kvt_tier_flush(t, 20000) == 0);
  kvt_stats s = KVT_STATS_INIT;
  REQUIRE(kvt_tier_stats(&s, t) == 0);
  CHECK(s.write_failures == 1 && s.spill_count == 3);
  CHECK(!found(t, &e[3]) && !found(t, &e[4]));
  CHECK(d.rc[3] == KVT_EIO && d.rc[4] == KVT_ECANCELED);
  /* NULL: the C write again, no call out. */
  CHECK(kvt_tier_set_write_hook(t, NULL, NULL) == 0);
  REQUIRE(t_spill(t, &e[5]) == 0);
  REQUIRE(kvt_tier_flush(t, 20000) == 0);
  CHECK_EQ_INT(h.calls, 5);
  CHECK(found(t, &e[5]) && d.rc[5] == 0);
  CHECK(kvt_tier_close(t, -1) == 0);
  CHECK(kvt_tier_set_write_hook(t, hook, &h) == KVT_ECLOSED);
  kvt_tier_free(t);
  for (int i = 0; i < 6; i++)
    t_free(&e[i]);
}

/* A hook blocked in the writer holds no tier lock. */
static void test_blocked_hook_holds_no_lock(void) {
  kvt_options o = t_opts("hook-block");
  kvt_tier *t = t_open(&o);
  hook_ctx h;
  hook_init(&h, t);
  t_entry good = t_make(1, 16, 1, 8, 8), bad = t_make(2, 16, 1, 8, 8),
          late = t_make(3, 16, 1, 8, 8);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  REQUIRE(t_spill(t, &good) == 0 && t_spill(t, &bad) == 0);
  REQUIRE(kvt_tier_flush(t, 20000) == 0);
  char *p = t_entry_path(t, bad.tokens, bad.n_tokens, "layer_0.safetensors");
  REQUIRE(t_flip(p, -8) == 0);
  free(p);
  h.block = 1;
  REQUIRE(kvt_tier_set_write_hook(t, hook, &h) == 0);
  REQUIRE(t_spill(t, &late) == 0);
  wait_blocked(&h);
  kvt_entry *got = NULL;
  CHECK(kvt_tier_promote(&got, t, good.tokens, good.n_tokens, NULL) == 0);
  CHECK(got && t_same(got, &good));
  kvt_entry_free(got);
  got = NULL;
  CHECK(kvt_tier_promote(&got, t, bad.tokens, bad.n_tokens, NULL) ==
        KVT_ECORRUPT);
  CHECK(!found(t, &bad)); /* quarantined while the writer waits */
  CHECK(!found(t, &late));
  unblock(&h);
  REQUIRE(kvt_tier_flush(t, 20000) == 0);
  CHECK(found(t, &late));
  kvt_tier_free(t);
  t_free(&good);
  t_free(&bad);
  t_free(&late);
}

static void test_close_queued(void) {
  kvt_options o = t_opts("hook-close");
  o.spill_queue_size = 2;
  kvt_tier *t = t_open(&o);
  hook_ctx h;
  hook_init(&h, t);
  t_entry e[5];
  for (int i = 0; i < 5; i++)
    e[i] = t_make(200 + (uint64_t)i, 8, 1, 4, 8);
  h.block = 1;
  REQUIRE(kvt_tier_set_write_hook(t, hook, &h) == 0);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  REQUIRE(t_spill(t, &e[0]) == 0);
  wait_blocked(&h);
  REQUIRE(t_spill(t, &e[1]) == 0 && t_spill(t, &e[2]) == 0);
  CHECK(depth(t) == 2);
  /* No slot for the marker: KVT_EFULL after the deadline, nothing changed. */
  struct timespec a, b;
  clock_gettime(CLOCK_MONOTONIC, &a);
  CHECK_EQ_INT(kvt_tier_close_queued(t, 100), KVT_EFULL);
  clock_gettime(CLOCK_MONOTONIC, &b);
  CHECK((b.tv_sec - a.tv_sec) * 1000 + (b.tv_nsec - a.tv_nsec) / 1000000 >= 90);
  CHECK(depth(t) == 2);
  unblock(&h);
  REQUIRE(kvt_tier_flush(t, 20000) == 0);
  CHECK(t_spill(t, &e[3]) == 0); /* still accepting */
  REQUIRE(kvt_tier_flush(t, 20000) == 0);
  /* The writer does not reach the marker in time: KVT_ETIMEDOUT, still
   * open; the marker is queued behind the blocked spill's successors. */
  h.block = 1;
  REQUIRE(t_spill(t, &e[4]) == 0);
  wait_blocked(&h);
  CHECK_EQ_INT(kvt_tier_close_queued(t, 100), KVT_ETIMEDOUT);
  CHECK(depth(t) == 1); /* the marker */
  CHECK(t_spill(t, &e[0]) == KVT_ECLOSED);
  CHECK(found(t, &e[3]));
  CHECK_EQ_INT(kvt_tier_close_queued(t, 50), KVT_ETIMEDOUT); /* again */
  CHECK(depth(t) == 1);
  unblock(&h);
  CHECK_EQ_INT(kvt_tier_close_queued(t, 20000), 0);
  CHECK_EQ_INT(kvt_tier_close_queued(t, 0), 0); /* closed: nothing */
  CHECK(depth(t) == 0);
  kvt_tier_free(t);
  t = t_open(&o);
  for (int i = 0; i < 5; i++)
    CHECK(found(t, &e[i]));
  kvt_tier_free(t);
  for (int i = 0; i < 5; i++)
    t_free(&e[i]);
}

/* Queued without a writer: close starts one and writes them (it never drops
 * accepted spills); nothing queued and no writer: nothing to stop. */
static void test_close_queued_starts_the_writer(void) {
  kvt_options o = t_opts("hook-nowriter");
  kvt_tier *t = t_open(&o);
  t_entry e = t_make(7, 8, 1, 4, 8);
  REQUIRE(t_spill(t, &e) == 0);
  CHECK_EQ_INT(kvt_tier_close_queued(t, 20000), 0);
  kvt_tier_free(t);
  t = t_open(&o);
  CHECK(found(t, &e));
  CHECK_EQ_INT(kvt_tier_close_queued(t, 0), 0);
  CHECK(t_spill(t, &e) == KVT_ECLOSED);
  kvt_tier_free(t);
  CHECK(kvt_tier_close_queued(NULL, 0) == KVT_EINVAL);
  t_free(&e);
}

int main(void) {
  RUN(test_hook_modes);
  RUN(test_blocked_hook_holds_no_lock);
  RUN(test_close_queued);
  RUN(test_close_queued_starts_the_writer);
  return kvt_test_done();
}
