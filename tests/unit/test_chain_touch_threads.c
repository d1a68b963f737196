/*
 * test_chain_touch_threads.c - touches of chunk chains concurrently with the
 * lookups and walks that read them (run under TSan by the `threads` label). A
 * touch of a chained entry or of a chunk-aligned prefix refreshes accessed_at
 * and the dirty list of every chunk up its chain; entries here share their
 * first chunks, so concurrent touches write the same nodes that concurrent
 * prefix lookups, chain walks and the chunk listing read. Only the chain
 * table's write lock makes that safe: a touch taking the read lock is a data
 * race TSan reports here. Every answer is also checked: lookups find the
 * entry they were asked for, chains are complete, and a touched chunk's
 * accessed_at never goes back.
 */
#include "tier_testlib.h"
#include "kvtier_sys.h"

#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

enum { C = 16, N_ENT = 6, T = 64, ROUNDS = 300, TOUCHERS = 2, READERS = 2 };

static kvt_tier *tier;
static int32_t tok[N_ENT][T + 8];
static char hash[N_ENT][KVT_HASH_HEX_LEN + 1];
static atomic_int bad, touched;

static void *toucher(void *arg) {
  kvt_rng r = {(uint64_t)(uintptr_t)arg};
  for (int i = 0; i < ROUNDS; i++) {
    int e = (int)(kvt_rng_next(&r) % N_ENT);
    /* The whole entry, or a chunk-aligned prefix of it (a chain touch). */
    size_t n = kvt_rng_next(&r) % 2 ? T : (size_t)C * (1 + i % 3);
    int rc = kvt_tier_touch(tier, tok[e], n);
    if (rc != 0 && !(rc == KVT_ENOTFOUND && n != T))
      atomic_fetch_add(&bad, 1);
    else
      atomic_fetch_add(&touched, 1);
  }
  return NULL;
}

typedef struct newest {
  double max_accessed;
  int n;
} newest;

static int visit(void *ctx, const kvt_chunk_info *ci) {
  newest *w = ctx;
  if (ci->accessed_at > w->max_accessed)
    w->max_accessed = ci->accessed_at;
  w->n++;
  return 0;
}

static void *reader(void *arg) {
  kvt_rng r = {(uint64_t)(uintptr_t)arg};
  double last = 0;
  for (int i = 0; i < ROUNDS; i++) {
    int e = (int)(kvt_rng_next(&r) % N_ENT);
    kvt_entry_info info;
    int rc = kvt_tier_lookup_prefix(&info, tier, tok[e], T + 8);
    if (rc != 0 || strcmp(info.token_hash, hash[e]) != 0)
      atomic_fetch_add(&bad, 1);
    kvt_chunk_info *ch = NULL;
    size_t n = 0;
    uint32_t ct = 0;
    rc = kvt_tier_entry_chain(&ch, &n, &ct, tier, hash[e], 0);
    if (rc != 0 || n != T / C || ct != C)
      atomic_fetch_add(&bad, 1);
    kvt_free(ch);
    if (i % 8 == 0) {
      newest w = {0, 0};
      if (kvt_tier_chunk_foreach(tier, visit, &w) != 0 || w.n < T / C ||
          w.max_accessed < last)
        atomic_fetch_add(&bad, 1);
      last = w.max_accessed;
    }
  }
  return NULL;
}

int main(void) {
  kvt_options o;
  kvt_options_init(&o, KVT_OPTIONS_VERSION);
  o.cache_dir = kvt_test_tmpdir("chain-touch");
  o.chunk_tokens = C;
  o.host_cache_bytes = 0;
  tier = t_open(&o);
  REQUIRE(tier);
  REQUIRE(kvt_tier_start_writer(tier) == 0);
  /* Six entries sharing their first two chunks, then their own two. */
  for (int e = 0; e < N_ENT; e++) {
    for (int i = 0; i < T + 8; i++)
      tok[e][i] = i < 2 * C ? 1000 + i : 5000 * (e + 1) + i;
    REQUIRE(t_kv_spill(tier, tok[e], T, T, 2, 1) == 0);
    kvt_token_hash(hash[e], tok[e], T);
  }
  REQUIRE(kvt_tier_flush(tier, -1) == 0);
  pthread_t th[TOUCHERS + READERS];
  for (int i = 0; i < TOUCHERS + READERS; i++)
    REQUIRE(pthread_create(&th[i], NULL, i < TOUCHERS ? toucher : reader,
                           (void *)(uintptr_t)(i + 1)) == 0);
  for (int i = 0; i < TOUCHERS + READERS; i++)
    pthread_join(th[i], NULL);
  CHECK(atomic_load(&bad) == 0);
  CHECK(atomic_load(&touched) > ROUNDS);
  kvt_stats st = KVT_STATS_INIT;
  kvt_tier_stats(&st, tier);
  CHECK(st.quarantined == 0);
  kvt_tier_close(tier, -1);
  kvt_tier_free(tier);
  return kvt_test_done();
}
