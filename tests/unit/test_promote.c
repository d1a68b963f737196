/*
 * test_promote.c - promote paths and the budget contract: reserve runs BEFORE
 * any read and on the calling thread, refusal counts a promotion failure and
 * reads nothing, a failed read releases exactly once, a successful promote
 * hands the reservation over with the entry; async promise: wait with timeout,
 * the pollable fd becomes readable, result collected once, cancel waits for the
 * read and releases exactly once, free of an uncollected promise releases;
 * caller-supplied tensor buffers and per-layer callbacks.
 */
#include "tier_testlib.h"

#include <poll.h>

static kvt_tier *open_with(const char *tag, t_entry *e, int n) {
  kvt_options o = t_opts(tag);
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  for (int i = 0; i < n; i++)
    CHECK_EQ_INT(t_spill(t, &e[i]), 0);
  CHECK_EQ_INT(kvt_tier_flush(t, -1), 0);
  return t;
}

static void test_budget_refusal(void) {
  t_entry e = t_make(1, 32, 2, 8, 8);
  kvt_tier *t = open_with("refuse", &e, 1);
  t_budget b;
  t_budget_init(&b, e.memory_bytes - 1); /* one byte short */
  b.owner = pthread_self();
  b.check_thread = 1;
  kvt_promote_opts po = t_popts(&b);
  kvt_entry *got = NULL;
  CHECK_EQ_INT(kvt_tier_promote(&got, t, e.tokens, e.n_tokens, &po),
               KVT_EBUDGET);
  CHECK(got == NULL);
  kvt_promise *p = NULL;
  CHECK_EQ_INT(kvt_tier_promote_async(&p, t, e.tokens, e.n_tokens, &po),
               KVT_EBUDGET);
  CHECK(p == NULL);
  kvt_stats s = KVT_STATS_INIT;
  kvt_tier_stats(&s, t);
  CHECK_EQ_INT(s.promotion_failures, 2);
  CHECK_EQ_INT(s.ssd_hits, 0);
  CHECK_EQ_INT(s.reload_bytes, 0); /* nothing was read */
  CHECK_EQ_INT(b.refusals, 2);
  CHECK_EQ_INT(b.releases, 0);
  /* A miss never calls reserve. */
  t_entry other = t_make(2, 32, 1, 2, 2);
  CHECK_EQ_INT(kvt_tier_promote(&got, t, other.tokens, 32, &po), KVT_ENOTFOUND);
  CHECK_EQ_INT(b.refusals + b.reserves, 2);
  kvt_tier_stats(&s, t);
  CHECK_EQ_INT(s.ssd_misses, 1);
  /* Enough budget: reserved bytes travel with the entry and stay reserved. */
  b.limit = e.memory_bytes;
  CHECK_EQ_INT(kvt_tier_promote(&got, t, e.tokens, e.n_tokens, &po), 0);
  CHECK(got && t_same(got, &e));
  CHECK_EQ_INT(kvt_entry_reserved_bytes(got), e.memory_bytes);
  CHECK_EQ_INT(b.used, e.memory_bytes);
  CHECK_EQ_INT(b.releases, 0);
  kvt_entry_free(got);
  CHECK_EQ_INT(b.used, e.memory_bytes); /* the caller owns it now */
  CHECK_EQ_INT(b.wrong_thread, 0);
  kvt_tier_free(t);
  t_free(&e);
  t_free(&other);
}

static void test_release_on_failure(void) {
  t_entry e = t_make(3, 24, 3, 8, 8);
  kvt_tier *t = open_with("relfail", &e, 1);
  /* Corrupt a tensor byte: the read fails verification. */
  char *f = t_entry_path(t, e.tokens, e.n_tokens, "layer_1.safetensors");
  CHECK_EQ_INT(t_flip(f, -3), 0);
  free(f);
  t_budget b;
  t_budget_init(&b, 1 << 30);
  b.owner = pthread_self();
  b.check_thread = 1;
  kvt_promote_opts po = t_popts(&b);
  kvt_entry *got = NULL;
  CHECK_EQ_INT(kvt_tier_promote(&got, t, e.tokens, e.n_tokens, &po),
               KVT_ECORRUPT);
  CHECK(got == NULL);
  CHECK_EQ_INT(b.reserves, 1);
  CHECK_EQ_INT(b.releases, 1);
  CHECK_EQ_INT(b.used, 0);
  CHECK_EQ_INT(b.wrong_thread, 0);
  kvt_stats s = KVT_STATS_INIT;
  kvt_tier_stats(&s, t);
  CHECK_EQ_INT(s.promotion_failures, 1);
  CHECK_EQ_INT(s.quarantined, 1);
  CHECK_EQ_INT(s.ssd_hits, 0);
  /* The corrupt entry is gone from lookups: the next promote is a plain miss.
   */
  kvt_entry_info info;
  CHECK_EQ_INT(kvt_tier_lookup(&info, t, e.tokens, e.n_tokens), KVT_ENOTFOUND);
  CHECK_EQ_INT(kvt_tier_promote(&got, t, e.tokens, e.n_tokens, &po),
               KVT_ENOTFOUND);
  CHECK_EQ_INT(b.reserves, 1);
  kvt_tier_free(t);
  t_free(&e);
}

static void test_async_roundtrip(void) {
  t_entry e[2] = {t_make(5, 48, 2, 8, 8), t_make(6, 48, 2, 8, 8)};
  kvt_tier *t = open_with("async", e, 2);
  t_budget b;
  t_budget_init(&b, 1 << 30);
  b.owner = pthread_self();
  b.check_thread = 1;
  kvt_promote_opts po = t_popts(&b);
  kvt_promise *p = NULL;
  CHECK_EQ_INT(kvt_tier_promote_async(&p, t, e[0].tokens, 48, &po), 0);
  REQUIRE(p);
  CHECK_EQ_INT(b.reserves, 1); /* reserved at once, on this thread */
  int fd = kvt_promise_fd(p);
  CHECK(fd >= 0);
  struct pollfd pf = {fd, POLLIN, 0};
  CHECK_EQ_INT(poll(&pf, 1, 10000), 1);
  CHECK(pf.revents & POLLIN);
  CHECK_EQ_INT(kvt_promise_wait(p, 0), 0);
  kvt_entry *got = NULL;
  CHECK_EQ_INT(kvt_promise_result(&got, p), 0);
  CHECK(got && t_same(got, &e[0]));
  CHECK_EQ_INT(kvt_entry_reserved_bytes(got), e[0].memory_bytes);
  CHECK_EQ_INT(kvt_promise_result(&got, p), KVT_EINVAL); /* only once */
  CHECK_EQ_INT(kvt_promise_cancel(p), KVT_EINVAL);       /* nothing to cancel */
  kvt_promise_free(p);
  CHECK_EQ_INT(b.releases, 0);
  kvt_entry_free(got);

  /* fd asked for after completion is readable at once. */
  CHECK_EQ_INT(kvt_tier_promote_async(&p, t, e[1].tokens, 48, &po), 0);
  CHECK_EQ_INT(kvt_promise_wait(p, -1), 0);
  fd = kvt_promise_fd(p);
  pf.fd = fd;
  pf.revents = 0;
  CHECK_EQ_INT(poll(&pf, 1, 0), 1);
  CHECK_EQ_INT(kvt_promise_fd(p), fd); /* same fd */
  /* Freed without collecting: the entry is dropped and the budget released. */
  kvt_promise_free(p);
  CHECK_EQ_INT(b.releases, 1);
  CHECK_EQ_INT(b.used, e[0].memory_bytes);
  /* Async miss: no promise. */
  t_entry miss = t_make(7, 9, 1, 1, 1);
  p = NULL;
  CHECK_EQ_INT(kvt_tier_promote_async(&p, t, miss.tokens, 9, &po),
               KVT_ENOTFOUND);
  CHECK(p == NULL);
  /* Async prefix promote. */
  t_entry longer = t_make(8, 60, 1, 1, 1);
  t_set_prefix(&longer, &e[1]);
  po.flags = KVT_PROMOTE_PREFIX;
  CHECK_EQ_INT(kvt_tier_promote_async(&p, t, longer.tokens, 60, &po), 0);
  CHECK_EQ_INT(kvt_promise_wait(p, -1), 0);
  CHECK_EQ_INT(kvt_promise_result(&got, p), 0);
  CHECK(got && t_same(got, &e[1]));
  kvt_entry_free(got);
  kvt_promise_free(p);
  CHECK_EQ_INT(b.wrong_thread, 0);
  kvt_stats s = KVT_STATS_INIT;
  kvt_tier_stats(&s, t);
  CHECK_EQ_INT(s.ssd_hits, 3);
  CHECK_EQ_INT(s.ssd_misses, 1);
  kvt_tier_free(t);
  t_free(&e[0]);
  t_free(&e[1]);
  t_free(&miss);
  t_free(&longer);
}

/* A layer callback that blocks the read until the test lets it go, so cancel
 * can be issued while the read is provably in flight. */
typedef struct gate {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int entered, open, layers;
} gate;

static void gate_layer(void *ctx, uint32_t idx, const kvt_layer *l) {
  gate *g = ctx;
  (void)idx;
  (void)l;
  pthread_mutex_lock(&g->mu);
  g->layers++;
  g->entered = 1;
  pthread_cond_broadcast(&g->cv);
  while (!g->open)
    pthread_cond_wait(&g->cv, &g->mu);
  pthread_mutex_unlock(&g->mu);
}

typedef struct cancel_arg {
  kvt_promise *p;
  int rc;
} cancel_arg;

static void *do_cancel(void *arg) {
  cancel_arg *c = arg;
  c->rc = kvt_promise_cancel(c->p);
  return NULL;
}

static void test_cancel(void) {
  t_entry e = t_make(9, 32, 4, 8, 8);
  kvt_tier *t = open_with("cancel", &e, 1);
  t_budget b;
  t_budget_init(&b, 1 << 30);
  gate g;
  memset(&g, 0, sizeof g);
  pthread_mutex_init(&g.mu, NULL);
  pthread_cond_init(&g.cv, NULL);
  kvt_promote_opts po = t_popts(&b);
  po.on_layer = gate_layer;
  po.layer_ctx = &g;
  kvt_promise *p = NULL;
  CHECK_EQ_INT(kvt_tier_promote_async(&p, t, e.tokens, e.n_tokens, &po), 0);
  /* Wait until the worker is inside the read. */
  pthread_mutex_lock(&g.mu);
  while (!g.entered)
    pthread_cond_wait(&g.cv, &g.mu);
  pthread_mutex_unlock(&g.mu);
  CHECK_EQ_INT(kvt_promise_wait(p, 0), KVT_ETIMEDOUT);
  kvt_entry *got = NULL;
  CHECK_EQ_INT(kvt_promise_result(&got, p), KVT_EAGAIN);
  /* Cancel from another thread: it must wait for the read (still gated). */
  cancel_arg ca = {p, 1};
  pthread_t th;
  pthread_create(&th, NULL, do_cancel, &ca);
  usleep(50000);
  CHECK_EQ_INT(b.releases, 0); /* not released while the read runs */
  pthread_mutex_lock(&g.mu);
  g.open = 1;
  pthread_cond_broadcast(&g.cv);
  pthread_mutex_unlock(&g.mu);
  pthread_join(th, NULL);
  CHECK_EQ_INT(ca.rc, KVT_ECANCELED);
  CHECK_EQ_INT(b.reserves, 1);
  CHECK_EQ_INT(b.releases, 1);
  CHECK_EQ_INT(b.used, 0);
  CHECK_EQ_INT(kvt_promise_cancel(p), KVT_ECANCELED); /* idempotent */
  CHECK_EQ_INT(kvt_promise_result(&got, p), KVT_EINVAL);
  kvt_promise_free(p);
  CHECK_EQ_INT(b.releases, 1); /* exactly once */
  kvt_stats s = KVT_STATS_INIT;
  kvt_tier_stats(&s, t);
  CHECK_EQ_INT(s.promotions_cancelled, 1);
  CHECK_EQ_INT(s.ssd_hits, 0);

  /* Cancel after completion: 0, the result stays collectable. */
  g.open = 1;
  CHECK_EQ_INT(kvt_tier_promote_async(&p, t, e.tokens, e.n_tokens, &po), 0);
  CHECK_EQ_INT(kvt_promise_wait(p, -1), 0);
  CHECK_EQ_INT(kvt_promise_cancel(p), 0);
  CHECK_EQ_INT(kvt_promise_result(&got, p), 0);
  CHECK(got && t_same(got, &e));
  kvt_entry_free(got);
  kvt_promise_free(p);
  CHECK_EQ_INT(b.reserves, 2);
  CHECK_EQ_INT(b.releases, 1);

  /* Free while in flight = cancel: waits and releases once. */
  g.open = 0;
  g.entered = 0;
  CHECK_EQ_INT(kvt_tier_promote_async(&p, t, e.tokens, e.n_tokens, &po), 0);
  pthread_mutex_lock(&g.mu);
  while (!g.entered)
    pthread_cond_wait(&g.cv, &g.mu);
  g.open = 1;
  pthread_cond_broadcast(&g.cv);
  pthread_mutex_unlock(&g.mu);
  kvt_promise_free(p);
  CHECK_EQ_INT(b.reserves, 3);
  CHECK_EQ_INT(b.releases, 2);
  kvt_tier_free(t);
  t_free(&e);
}

/* Stripe of a hash as lock.c computes it (first 4 hex digits mod 64). */
static unsigned stripe_of(const t_entry *e) {
  char h[65];
  kvt_token_hash(h, e->tokens, e->n_tokens);
  return (unsigned)strtoul((char[5]){h[0], h[1], h[2], h[3], 0}, NULL, 16) % 64;
}

typedef struct remove_arg {
  kvt_tier *t;
  const t_entry *e;
  atomic_int done;
  int rc;
} remove_arg;

static void *do_remove(void *arg) {
  remove_arg *r = arg;
  r->rc = kvt_tier_remove(r->t, r->e->tokens, r->e->n_tokens);
  atomic_store(&r->done, 1);
  return NULL;
}

/* An eviction/removal never runs under a reader: it waits for the read in
 * progress, which returns the whole entry; and a promote whose entry is removed
 * between its lookup and its read is a miss, with the budget released. */
static void test_race_with_removal(void) {
  t_entry a = t_make(20, 16, 2, 4, 4), b = t_make(21, 16, 2, 4, 4);
  for (uint64_t seed = 22; stripe_of(&a) == stripe_of(&b); seed++) {
    t_free(&b);
    b = t_make(seed, 16, 2, 4, 4);
  }
  kvt_options o = t_opts("race");
  o.promote_threads = 1;
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  CHECK_EQ_INT(t_spill(t, &a), 0);
  CHECK_EQ_INT(t_spill(t, &b), 0);
  CHECK_EQ_INT(kvt_tier_flush(t, -1), 0);
  gate g;
  memset(&g, 0, sizeof g);
  pthread_mutex_init(&g.mu, NULL);
  pthread_cond_init(&g.cv, NULL);
  t_budget bud;
  t_budget_init(&bud, 1 << 30);
  kvt_promote_opts pa = t_popts(&bud);
  pa.on_layer = gate_layer;
  pa.layer_ctx = &g;
  kvt_promise *pA = NULL, *pB = NULL;
  CHECK_EQ_INT(kvt_tier_promote_async(&pA, t, a.tokens, 16, &pa), 0);
  pthread_mutex_lock(&g.mu);
  while (!g.entered)
    pthread_cond_wait(&g.cv, &g.mu);
  pthread_mutex_unlock(&g.mu);
  /* The only worker is inside A's read. B is looked up and reserved now, read
   * later. */
  kvt_promote_opts pb = t_popts(&bud);
  CHECK_EQ_INT(kvt_tier_promote_async(&pB, t, b.tokens, 16, &pb), 0);
  CHECK_EQ_INT(kvt_tier_remove(t, b.tokens, 16), 0); /* other stripe: no wait */
  /* Removing A must wait for A's reader. */
  remove_arg ra = {t, &a, 0, 1};
  pthread_t th;
  pthread_create(&th, NULL, do_remove, &ra);
  usleep(50000);
  CHECK_EQ_INT(atomic_load(&ra.done), 0);
  pthread_mutex_lock(&g.mu);
  g.open = 1;
  pthread_cond_broadcast(&g.cv);
  pthread_mutex_unlock(&g.mu);
  kvt_entry *got = NULL;
  CHECK_EQ_INT(kvt_promise_wait(pA, -1), 0);
  CHECK_EQ_INT(kvt_promise_result(&got, pA), 0);
  CHECK(got && t_same(got, &a)); /* whole, never half-removed */
  t_release(&bud, kvt_entry_reserved_bytes(got));
  kvt_entry_free(got);
  pthread_join(th, NULL);
  CHECK_EQ_INT(ra.rc, 0);
  CHECK_EQ_INT(kvt_promise_wait(pB, -1), 0);
  got = NULL;
  CHECK_EQ_INT(kvt_promise_result(&got, pB), KVT_ENOTFOUND);
  CHECK(got == NULL);
  kvt_promise_free(pA);
  kvt_promise_free(pB);
  CHECK_EQ_INT(bud.reserves, 2);
  CHECK_EQ_INT(bud.releases, 2);
  CHECK_EQ_INT(bud.used, 0);
  kvt_stats s = KVT_STATS_INIT;
  kvt_tier_stats(&s, t);
  CHECK_EQ_INT(s.ssd_misses, 1);
  CHECK_EQ_INT(s.promotion_failures, 0);
  CHECK_EQ_INT(s.entries, 0);
  kvt_tier_free(t);
  t_free(&a);
  t_free(&b);
}

/* Many async promotes cancelled at random points: reserve and release always
 * balance. */
static void test_cancel_storm(void) {
  t_entry e[4];
  for (int i = 0; i < 4; i++)
    e[i] = t_make(300 + i, 40, 4, 16, 16);
  kvt_tier *t = open_with("storm", e, 4);
  t_budget b;
  t_budget_init(&b, 1 << 30);
  kvt_promote_opts po = t_popts(&b);
  kvt_rng r = {77};
  int collected = 0;
  for (int round = 0; round < 60; round++) {
    kvt_promise *p = NULL;
    CHECK_EQ_INT(kvt_tier_promote_async(&p, t, e[round % 4].tokens, 40, &po),
                 0);
    int action = (int)(kvt_rng_next(&r) % 3);
    if (action == 0) {
      int rc = kvt_promise_cancel(p);
      CHECK(rc == KVT_ECANCELED || rc == 0);
    } else if (action == 1) {
      kvt_promise_wait(p, -1);
      kvt_entry *got = NULL;
      if (kvt_promise_result(&got, p) == 0) {
        collected++;
        CHECK_EQ_INT(kvt_entry_reserved_bytes(got), e[0].memory_bytes);
        t_release(&b, kvt_entry_reserved_bytes(got)); /* the caller's job */
        kvt_entry_free(got);
      }
    }
    kvt_promise_free(p);
  }
  CHECK_EQ_INT(b.used, 0);
  CHECK_EQ_INT(b.reserves, 60);
  CHECK_EQ_INT(b.releases, 60); /* kvtier released the rest, exactly once */
  CHECK(collected > 0);
  kvt_tier_free(t);
  for (int i = 0; i < 4; i++)
    t_free(&e[i]);
}

/* Caller-allocated buffers. */
typedef struct arena {
  pthread_mutex_t mu;
  int allocs, frees;
} arena;
static void *a_alloc(void *ctx, uint32_t layer, uint32_t tensor,
                     const kvt_tensor *desc) {
  arena *a = ctx;
  (void)layer;
  (void)tensor;
  pthread_mutex_lock(&a->mu);
  a->allocs++;
  pthread_mutex_unlock(&a->mu);
  return malloc(desc->nbytes ? desc->nbytes : 1);
}
static void a_free(void *ctx, void *buf) {
  arena *a = ctx;
  pthread_mutex_lock(&a->mu);
  a->frees++;
  pthread_mutex_unlock(&a->mu);
  free(buf);
}
static void *a_fail(void *ctx, uint32_t layer, uint32_t tensor,
                    const kvt_tensor *desc) {
  (void)ctx;
  (void)layer;
  (void)tensor;
  (void)desc;
  return NULL;
}

static void test_caller_buffers(void) {
  t_entry e = t_make(10, 16, 2, 4, 4);
  kvt_tier *t = open_with("alloc", &e, 1);
  arena a = {PTHREAD_MUTEX_INITIALIZER, 0, 0};
  kvt_promote_opts po = t_popts(NULL);
  po.alloc = a_alloc;
  po.free_buf = a_free;
  po.alloc_ctx = &a;
  kvt_promise *p = NULL;
  CHECK_EQ_INT(kvt_tier_promote_async(&p, t, e.tokens, e.n_tokens, &po), 0);
  kvt_entry *got = NULL;
  CHECK_EQ_INT(kvt_promise_wait(p, -1), 0);
  CHECK_EQ_INT(kvt_promise_result(&got, p), 0);
  CHECK(got && t_same(got, &e));
  CHECK_EQ_INT(a.allocs, 4);
  kvt_entry_free(got);
  kvt_promise_free(p);
  CHECK_EQ_INT(a.frees, 4);
  /* An allocator that refuses: KVT_ENOMEM, budget released, not a corrupt
   * entry. */
  t_budget b;
  t_budget_init(&b, 1 << 30);
  po = t_popts(&b);
  po.alloc = a_fail;
  po.free_buf = a_free;
  CHECK_EQ_INT(kvt_tier_promote(&got, t, e.tokens, e.n_tokens, &po),
               KVT_ENOMEM);
  CHECK_EQ_INT(b.releases, 1);
  kvt_entry_info info;
  CHECK_EQ_INT(kvt_tier_lookup(&info, t, e.tokens, e.n_tokens), 0);
  kvt_tier_free(t);
  t_free(&e);
}

/* Closing the tier waits for async promotes still reading; promises outlive the
 * tier. */
static void test_close_waits_for_promotes(void) {
  t_entry e = t_make(11, 16, 2, 4, 4);
  kvt_tier *t = open_with("closewait", &e, 1);
  t_budget b;
  t_budget_init(&b, 1 << 30);
  kvt_promote_opts po = t_popts(&b);
  kvt_promise *p[8];
  for (int i = 0; i < 8; i++)
    CHECK_EQ_INT(kvt_tier_promote_async(&p[i], t, e.tokens, e.n_tokens, &po),
                 0);
  CHECK_EQ_INT(kvt_tier_close(t, -1), 0);
  for (int i = 0; i < 8; i++)
    CHECK_EQ_INT(kvt_promise_wait(p[i], 0), 0); /* all complete */
  kvt_tier_free(t);
  for (int i = 0; i < 8; i++) {
    kvt_entry *got = NULL;
    if (i % 2 == 0) {
      CHECK_EQ_INT(kvt_promise_result(&got, p[i]), 0);
      CHECK(got && t_same(got, &e));
      kvt_entry_free(got);
      t_release(&b, e.memory_bytes);
    }
    kvt_promise_free(p[i]);
  }
  CHECK_EQ_INT(b.used, 0);
  t_free(&e);
}

int main(void) {
  RUN(test_budget_refusal);
  RUN(test_release_on_failure);
  RUN(test_async_roundtrip);
  RUN(test_cancel);
  RUN(test_race_with_removal);
  RUN(test_cancel_storm);
  RUN(test_caller_buffers);
  RUN(test_close_waits_for_promotes);
  return kvt_test_done();
}
