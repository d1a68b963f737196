/*
 * test_tier_clock.c - an injected clock (kvt_options.clock_fn) times
 * recency as well as the write budget: the created and accessed times a
 * tier records are its readings, not the wall clock's, and eviction follows
 * them - spills made in one order but timed in the other are evicted by
 * their times. Without clock_fn the wall clock stamps them as before.
 */
#include "tier_testlib.h"
#include "testutil.h"

#include <string.h>

static void seq(int32_t *t, size_t n, int32_t base) {
  for (size_t i = 0; i < n; i++)
    t[i] = base + (int32_t)i;
}

static int stored(kvt_tier *t, const int32_t *tok, size_t n,
                  kvt_entry_info *info) {
  return kvt_tier_lookup(info, t, tok, n) == 0;
}

/* Spills A at time `ta`, then B at `tb`, then C once the tier holds two
 * entries: whichever of A and B is older by the tier's clock goes. */
static void evict_in_clock_order(int injected) {
  kvt_options o = t_opts(injected ? "clock" : "wall");
  o.max_entries = 2;
  if (injected)
    o.clock_fn = t_clock;
  t_clock_now = 500.0;
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  int32_t a[32], b[32], c[32];
  seq(a, 32, 1000);
  seq(b, 32, 2000);
  seq(c, 32, 3000);
  t_clock_now = 900.0; /* A spilled first, but timed later than B */
  CHECK_EQ_INT(t_kv_spill(t, a, 32, 32, 1, 4096), 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  t_clock_now = 700.0;
  CHECK_EQ_INT(t_kv_spill(t, b, 32, 32, 1, 4096), 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  kvt_entry_info ia, ib, ic;
  REQUIRE(stored(t, a, 32, &ia) && stored(t, b, 32, &ib));
  if (injected) {
    CHECK(ia.created_at == 900.0 && ia.accessed_at == 900.0);
    CHECK(ib.created_at == 700.0 && ib.accessed_at == 700.0);
  } else { /* Unix seconds, in call order */
    CHECK(ia.created_at > 1e9 && ib.created_at >= ia.created_at);
  }
  t_clock_now = 1000.0;
  CHECK_EQ_INT(t_kv_spill(t, c, 32, 32, 1, 4096), 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  CHECK(stored(t, c, 32, &ic));
  if (injected) { /* B is the older by the clock */
    CHECK(stored(t, a, 32, &ia) && !stored(t, b, 32, &ib));
    CHECK(ic.created_at == 1000.0);
  } else { /* A is the older by the wall */
    CHECK(!stored(t, a, 32, &ia) && stored(t, b, 32, &ib));
  }
  kvt_tier_free(t);
  kvt_test_rmtree(o.cache_dir);
}

static void test_eviction_follows_the_clock(void) {
  evict_in_clock_order(1);
  evict_in_clock_order(0);
}

int main(void) {
  RUN(test_eviction_follows_the_clock);
  return kvt_test_done();
}
