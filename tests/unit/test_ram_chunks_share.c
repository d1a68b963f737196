/*
 * test_ram_chunks_share.c - the host RAM tier holds a prompt shared by many
 * chained entries once (public API only; chunk_tokens set): 16 entries
 * sharing a 256-token prompt (16 chunks) and 8 rows of their own each hold
 * at most 1.1x their unique KV bytes in RAM (exact byte accounting from the
 * stats gauges, no timing), and every one is served from RAM bit for bit; a
 * shared chunk altered in RAM (a disk read's buffers changed before they were
 * freed back to RAM) fails the check of the next entry assembled from it and
 * is not served, while the entries after it are served from RAM again, the
 * chunks RAM lost read back from their files; under a bound that holds the
 * chunks and a few tails, the bytes held never exceed it and the shared
 * chunks stay while the entries using them are used; promotes from several
 * threads racing with re-spills, trims and bound changes return every entry
 * bit for bit or nothing.
 */
#include "tier_testlib.h"

#include <pthread.h>
#include <stdatomic.h>

#define C 16
#define D 128
#define NL 2
#define NE 16
#define SHARED 256 /* tokens of the shared prompt: 16 chunks */
#define OWN 8      /* rows past the chain, each entry's own */
/* KV bytes per token: layers x (keys, values) x 2 heads x D x F32. */
#define TOKB ((uint64_t)NL * 2 * 2 * D * 4)

/* After the RAM tier's cutter is done (kvt_tier_flush waits for it): freed
 * disk reads are then in RAM as tails and chunks. */
static kvt_stats stats_of(kvt_tier *t) {
  kvt_stats s = KVT_STATS_INIT;
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  REQUIRE(kvt_tier_stats(&s, t) == 0);
  return s;
}

static kvt_tier *open_dir(const char *dir, uint64_t host_bytes) {
  kvt_options o;
  kvt_options_init(&o, KVT_OPTIONS_VERSION);
  o.cache_dir = dir;
  o.durability = KVT_DURABILITY_NONE;
  o.chunk_tokens = C;
  o.model_id = "ram-share";
  o.host_cache_bytes = host_bytes;
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  return t;
}

/* NE entries: the same SHARED tokens and KV rows, then OWN of their own. */
static void make_all(t_entry *es) {
  t_entry base = t_make(1000, SHARED, NL, SHARED, D);
  for (int i = 0; i < NE; i++) {
    es[i] = t_make((uint64_t)i + 1, SHARED + OWN, NL, SHARED + OWN, D);
    t_set_prefix(&es[i], &base);
    t_copy_rows(&es[i], &base, SHARED);
  }
  t_free(&base);
}

static void free_all(t_entry *es) {
  for (int i = 0; i < NE; i++)
    t_free(&es[i]);
}

static kvt_entry *promote(kvt_tier *t, const t_entry *e) {
  kvt_entry *got = NULL;
  return kvt_tier_promote(&got, t, e->tokens, e->n_tokens, NULL) == 0 ? got
                                                                      : NULL;
}

/* Promotes e: served bit for bit (1), or not at all (0). */
static int promote_same(kvt_tier *t, const t_entry *e) {
  kvt_entry *got = promote(t, e);
  int ok = got && t_same(got, e);
  kvt_entry_free(got);
  return ok;
}

static void spill_all(kvt_tier *t, const t_entry *es) {
  for (int i = 0; i < NE; i++)
    REQUIRE(t_spill(t, &es[i]) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
}

static void test_shared_once(void) {
  char *dir = kvt_test_tmpdir("ramsh1");
  kvt_tier *t = open_dir(dir, (uint64_t)256 << 20);
  t_entry es[NE];
  make_all(es);
  spill_all(t, es);
  kvt_stats s = stats_of(t);
  CHECK_EQ_INT(s.host_cache_entries, NE);
  CHECK_EQ_INT(s.host_cache_chunks, SHARED / C);
  uint64_t unique = (SHARED + (uint64_t)NE * OWN) * TOKB;
  uint64_t held = s.host_cache_bytes_used;
  fprintf(stderr,
          "  %d entries sharing %d tokens: held %llu B, unique KV %llu "
          "B, ratio %.4f (an entry-granular cache holds %.2fx)\n",
          NE, SHARED, (unsigned long long)held, (unsigned long long)unique,
          (double)held / (double)unique,
          (double)NE * (SHARED + OWN) * TOKB / (double)unique);
  CHECK(s.host_cache_chunk_bytes >= SHARED * TOKB);
  CHECK(held >= unique); /* every byte held is counted */
  CHECK(held * 10 <= unique * 11);
  for (int i = 0; i < NE; i++)
    CHECK(promote_same(t, &es[i]));
  s = stats_of(t);
  CHECK_EQ_INT(s.promotes_from_ram, NE);
  CHECK_EQ_INT(s.promotes_from_disk, 0);
  CHECK_EQ_INT(s.host_cache_hits, NE);
  CHECK_EQ_INT(s.host_cache_verify_failures, 0);
  CHECK_EQ_INT(s.host_cache_bytes_used, held); /* serving copies nothing in */
  /* Served again after a trim: read from disk and cut back into RAM when
   * freed, the shared chunks brought by the first only. */
  REQUIRE(kvt_tier_trim(t, 0, NULL) == 0);
  CHECK_EQ_INT(stats_of(t).host_cache_bytes_used, 0);
  for (int i = 0; i < NE; i++)
    CHECK(promote_same(t, &es[i]));
  s = stats_of(t);
  CHECK_EQ_INT(s.promotes_from_disk, NE);
  CHECK_EQ_INT(s.host_cache_entries, NE);
  CHECK_EQ_INT(s.host_cache_chunks, SHARED / C);
  CHECK(s.host_cache_bytes_used * 10 <= unique * 11);
  free_all(es);
  kvt_tier_free(t);
}

static void test_corrupt_shared_chunk(void) {
  char *dir = kvt_test_tmpdir("ramsh2");
  kvt_tier *t = open_dir(dir, (uint64_t)256 << 20);
  t_entry es[NE];
  make_all(es);
  spill_all(t, es);
  /* Disk reads of entries 1 and 0, freed in that order: entry 1 alone
   * shares nothing (kept whole); entry 0, altered in a shared row (chunk 0)
   * before it is freed, shares entry 1's chain, so it is cut: its chunks go
   * to RAM with the alteration, and entry 1 adds its tail. */
  REQUIRE(kvt_tier_trim(t, 0, NULL) == 0);
  kvt_entry *got = promote(t, &es[1]);
  REQUIRE(got);
  kvt_entry_free(got);
  kvt_stats s = stats_of(t);
  CHECK_EQ_INT(s.host_cache_chunks, 0);
  CHECK_EQ_INT(s.host_cache_entries, 1);
  got = promote(t, &es[0]);
  REQUIRE(got);
  ((float *)kvt_entry_layer(got, 1)->tensors[0].data)[(SHARED + OWN + 5) * D +
                                                      7] += 1.0f; /* head 1 */
  kvt_entry_free(got);
  s = stats_of(t);
  CHECK_EQ_INT(s.host_cache_chunks, SHARED / C);
  CHECK_EQ_INT(s.host_cache_entries, 2);
  /* The other entries' tails come back with their copy-mode re-spills (the
   * chunks are in RAM already: only tails are added). */
  for (int i = 2; i < NE; i++)
    REQUIRE(t_spill(t, &es[i]) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  s = stats_of(t);
  CHECK_EQ_INT(s.host_cache_entries, NE);
  CHECK_EQ_INT(s.host_cache_chunks, SHARED / C);
  /* Entry 1 assembled from the altered chunk fails its check: its tail and
   * the chain's chunks leave RAM, the disk is read, bit for bit. */
  kvt_entry *held = promote(t, &es[1]);
  REQUIRE(held);
  CHECK(t_same(held, &es[1]));
  s = stats_of(t);
  CHECK_EQ_INT(s.host_cache_verify_failures, 1);
  CHECK_EQ_INT(s.promotes_from_disk, 3);
  CHECK_EQ_INT(s.host_cache_chunks, 0);
  CHECK_EQ_INT(s.host_cache_entries, NE - 1);
  /* Entry 2's tail is still there: its chunks are read from their files
   * (and kept), the copy is served from RAM. */
  CHECK(promote_same(t, &es[2]));
  s = stats_of(t);
  CHECK_EQ_INT(s.promotes_from_disk, 3);
  CHECK_EQ_INT(s.promotes_from_ram, 1);
  CHECK_EQ_INT(s.host_cache_chunks, SHARED / C);
  /* Entry 1's disk read given back adds only its tail. */
  uint64_t chunk_bytes = s.host_cache_chunk_bytes;
  kvt_entry_free(held);
  s = stats_of(t);
  CHECK_EQ_INT(s.host_cache_entries, NE);
  CHECK_EQ_INT(s.host_cache_chunk_bytes, chunk_bytes);
  for (int i = 0; i < NE; i++)
    CHECK(promote_same(t, &es[i]));
  s = stats_of(t);
  CHECK_EQ_INT(s.host_cache_verify_failures, 1);
  CHECK_EQ_INT(s.promotes_from_ram, 1 + NE);
  CHECK_EQ_INT(s.quarantined, 0);
  CHECK_EQ_INT(s.promotion_failures, 0);
  free_all(es);
  kvt_tier_free(t);
}

static void test_budget(void) {
  char *dir = kvt_test_tmpdir("ramsh3");
  kvt_tier *t = open_dir(dir, (uint64_t)256 << 20);
  t_entry es[NE];
  make_all(es);
  spill_all(t, es);
  kvt_stats s = stats_of(t);
  uint64_t chunks = s.host_cache_chunk_bytes;
  uint64_t tail = (s.host_cache_bytes_used - chunks) / NE;
  /* Room for the chunks and four and a half tails: the oldest tails go,
   * the chunks every spill used stay. */
  uint64_t bound = chunks + 4 * tail + tail / 2;
  REQUIRE(kvt_tier_set_host_cache_bytes(t, bound) == 0);
  s = stats_of(t);
  CHECK(s.host_cache_bytes_used <= bound);
  CHECK_EQ_INT(s.host_cache_entries, 4);
  CHECK_EQ_INT(s.host_cache_chunks, SHARED / C);
  /* Every entry used in turn, twice: each comes from RAM or disk, bit for
   * bit; the bound holds after each; the shared chunks never leave. */
  for (int r = 0; r < 2; r++)
    for (int i = 0; i < NE; i++) {
      CHECK(promote_same(t, &es[i]));
      s = stats_of(t);
      CHECK(s.host_cache_bytes_used <= bound);
      CHECK_EQ_INT(s.host_cache_chunks, SHARED / C);
    }
  CHECK_EQ_INT(s.host_cache_verify_failures, 0);
  /* A bound below the chunks: some chunks go, the copies assembled from the
   * rest (and the files) are still right. */
  bound = chunks / 2;
  REQUIRE(kvt_tier_set_host_cache_bytes(t, bound) == 0);
  s = stats_of(t);
  CHECK(s.host_cache_bytes_used <= bound);
  CHECK(s.host_cache_chunks < SHARED / C);
  for (int i = 0; i < NE; i++) {
    CHECK(promote_same(t, &es[i]));
    CHECK(stats_of(t).host_cache_bytes_used <= bound);
  }
  CHECK_EQ_INT(stats_of(t).host_cache_verify_failures, 0);
  /* Off: nothing held. */
  REQUIRE(kvt_tier_set_host_cache_bytes(t, 0) == 0);
  s = stats_of(t);
  CHECK_EQ_INT(s.host_cache_bytes_used, 0);
  CHECK_EQ_INT(s.host_cache_chunks, 0);
  CHECK(promote_same(t, &es[3]));
  free_all(es);
  kvt_tier_free(t);
}

typedef struct racer {
  kvt_tier *t;
  const t_entry *es;
  int seed, rounds;
  int ok, missing, wrong;
} racer;

static void *race_promotes(void *arg) {
  racer *r = arg;
  for (int k = 0; k < r->rounds; k++) {
    const t_entry *e = &r->es[(r->seed * 7 + k * 5) % NE];
    kvt_entry *got = NULL;
    int rc = kvt_tier_promote(&got, r->t, e->tokens, e->n_tokens, NULL);
    if (rc == 0) {
      if (t_same(got, e))
        r->ok++;
      else
        r->wrong++;
      /* Some copies held a while: their give-back races the others. */
      if (k % 3 == 0)
        usleep(200);
      kvt_entry_free(got);
    } else if (rc == KVT_ENOTFOUND) {
      r->missing++;
    } else {
      r->wrong++;
    }
  }
  return NULL;
}

static void test_threads(void) {
  char *dir = kvt_test_tmpdir("ramsh4");
  kvt_tier *t = open_dir(dir, (uint64_t)256 << 20);
  t_entry es[NE];
  make_all(es);
  spill_all(t, es);
  uint64_t full = stats_of(t).host_cache_bytes_used;
  enum { NT = 3 };
  racer r[NT];
  pthread_t th[NT];
  for (int i = 0; i < NT; i++) {
    r[i] = (racer){t, es, i + 1, 40, 0, 0, 0};
    REQUIRE(pthread_create(&th[i], NULL, race_promotes, &r[i]) == 0);
  }
  /* Meanwhile: re-spills (tails replaced), trims, bounds that cut the
   * chunks, a removal and its re-spill. */
  for (int k = 0; k < 24; k++) {
    switch (k % 4) {
    case 0:
      REQUIRE(t_spill(t, &es[k % NE]) == 0);
      break;
    case 1:
      REQUIRE(kvt_tier_trim(t, full / 3, NULL) == 0);
      break;
    case 2:
      REQUIRE(kvt_tier_set_host_cache_bytes(t, k % 8 == 2 ? full / 4 : full) ==
              0);
      break;
    default:
      kvt_tier_remove(t, es[k % NE].tokens, es[k % NE].n_tokens);
      REQUIRE(kvt_tier_flush(t, -1) == 0);
      REQUIRE(t_spill(t, &es[k % NE]) == 0);
      break;
    }
    usleep(500);
  }
  int ok = 0, missing = 0, wrong = 0;
  for (int i = 0; i < NT; i++) {
    pthread_join(th[i], NULL);
    ok += r[i].ok;
    missing += r[i].missing;
    wrong += r[i].wrong;
  }
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  kvt_stats s = stats_of(t);
  fprintf(stderr, "  %d served, %d missing, %llu from RAM\n", ok, missing,
          (unsigned long long)s.promotes_from_ram);
  CHECK_EQ_INT(wrong, 0);
  CHECK(ok > 0);
  CHECK_EQ_INT(s.quarantined, 0);
  CHECK_EQ_INT(s.host_cache_verify_failures, 0);
  CHECK(s.host_cache_bytes_used <= s.host_cache_bytes_bound);
  /* Quiet again: every entry is served from RAM or disk, bit for bit. */
  for (int i = 0; i < NE; i++)
    CHECK(promote_same(t, &es[i]));
  free_all(es);
  kvt_tier_free(t);
}

int main(void) {
  RUN(test_shared_once);
  RUN(test_corrupt_shared_chunk);
  RUN(test_budget);
  RUN(test_threads);
  return kvt_test_done();
}
