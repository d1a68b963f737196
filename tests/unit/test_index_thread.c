/*
 * test_index_thread.c - concurrency of the index (run under TSan by the
 * `threads` label): reader threads do exact and longest-prefix lookups, touches
 * and LRU/total queries while a writer thread inserts, replaces and removes
 * entries. Every answer must be consistent: a lookup that succeeds returns the
 * entry whose hash matches the query (prefix) it asked for, and entries that
 * are never removed are always found.
 */
#include "testutil.h"
#include "index/index.h"
#include "kvtier_sys.h"

#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

enum { BASE = 40, STABLE = 20, CHURN = 60, ROUNDS = 500, READERS = 3 };

static kvt_index *g_idx;
static atomic_int g_stop;
static atomic_int g_bad;

static void make(int32_t *t, int which, size_t *n) {
  for (int i = 0; i < BASE; i++)
    t[i] = 7 + i;
  t[BASE] = 100000 + which;
  t[BASE + 1] = which % 3;
  *n = BASE + 2;
}

static void *writer(void *arg) {
  (void)arg;
  for (int r = 0; r < ROUNDS; r++) {
    int32_t t[BASE + 2];
    size_t n;
    int w = STABLE + r % CHURN;
    make(t, w, &n);
    if (kvti_index_put(g_idx, t, n, NULL, (uint64_t)r, 1, 0) != 0)
      atomic_fetch_add(&g_bad, 1);
    if (r % 3 == 2) {
      char h[65];
      make(t, STABLE + (r / 2) % CHURN, &n);
      kvt_token_hash(h, t, n);
      int rc = kvti_index_remove_hash(g_idx, h);
      if (rc != 0 && rc != KVT_ENOTFOUND)
        atomic_fetch_add(&g_bad, 1);
    }
  }
  atomic_store(&g_stop, 1);
  return NULL;
}

static int count_fn(void *ctx, const kvt_entry_info *e) {
  (void)e;
  (*(int *)ctx)++;
  return 0;
}

static void *reader(void *arg) {
  kvt_rng rng = {(uint64_t)(uintptr_t)arg};
  while (!atomic_load(&g_stop)) {
    int32_t t[BASE + 10];
    size_t n;
    int w = (int)(kvt_rng_next(&rng) % (STABLE + CHURN));
    make(t, w, &n);
    t[n] = 5; /* query one token longer than the entry */
    kvt_entry_info info;
    char h[65];
    kvt_token_hash(h, t, n);
    int rc = kvti_index_find(&info, g_idx, t, n, 0);
    if (rc == 0 && strcmp(info.token_hash, h) != 0)
      atomic_fetch_add(&g_bad, 1);
    if (w < STABLE && rc != 0)
      atomic_fetch_add(&g_bad, 1);
    rc = kvti_index_find_prefix(&info, g_idx, t, n + 1, 0);
    if (rc == 0) {
      char hp[65];
      kvt_token_hash(hp, t, info.num_tokens);
      if (strcmp(info.token_hash, hp) != 0 || info.num_tokens > n + 1)
        atomic_fetch_add(&g_bad, 1);
    }
    if (w < STABLE && (rc != 0 || info.num_tokens != n))
      atomic_fetch_add(&g_bad, 1);
    if (w < STABLE && kvti_index_touch_hash(g_idx, h) != 0)
      atomic_fetch_add(&g_bad, 1);
    uint64_t ne;
    kvti_index_totals(g_idx, &ne, NULL, NULL);
    if (ne < STABLE)
      atomic_fetch_add(&g_bad, 1);
    if (kvti_index_lru_victim(&info, g_idx) != 0)
      atomic_fetch_add(&g_bad, 1);
    kvt_index_rows rs;
    if (kvt_index_lookup_prefix(&rs, g_idx, t, n + 1) != 0)
      atomic_fetch_add(&g_bad, 1);
    else {
      for (size_t i = 0; i < rs.count; i++) {
        char hp[65];
        kvt_token_hash(hp, rs.rows[i].tokens, rs.rows[i].n_tokens);
        if (strcmp(hp, rs.rows[i].token_hash) != 0 ||
            (i && rs.rows[i].num_tokens >= rs.rows[i - 1].num_tokens))
          atomic_fetch_add(&g_bad, 1);
      }
      kvt_index_rows_free(&rs);
    }
    if ((w & 15) == 0) {
      int visited = 0;
      if (kvti_index_foreach(g_idx, count_fn, &visited) != 0 ||
          visited < STABLE)
        atomic_fetch_add(&g_bad, 1);
    }
  }
  return NULL;
}

static void test_concurrent(void) {
  char *dir = kvt_test_tmpdir("idx-thread");
  REQUIRE(kvti_index_open(&g_idx, dir, NULL, 0) == 0);
  for (int i = 0; i < STABLE; i++) {
    int32_t t[BASE + 2];
    size_t n;
    make(t, i, &n);
    REQUIRE(kvti_index_put(g_idx, t, n, NULL, 1, 1, 0) == 0);
  }
  pthread_t w, r[READERS];
  for (int i = 0; i < READERS; i++)
    REQUIRE(pthread_create(&r[i], NULL, reader, (void *)(uintptr_t)(i + 1)) ==
            0);
  REQUIRE(pthread_create(&w, NULL, writer, NULL) == 0);
  pthread_join(w, NULL);
  for (int i = 0; i < READERS; i++)
    pthread_join(r[i], NULL);
  CHECK_EQ_INT(atomic_load(&g_bad), 0);
  CHECK(kvti_index_flush(g_idx) == 0);
  uint64_t ne;
  kvti_index_totals(g_idx, &ne, NULL, NULL);
  int visited = 0;
  CHECK(kvti_index_foreach(g_idx, count_fn, &visited) == 0);
  CHECK_EQ_INT(visited, ne);
  kvt_index_close(g_idx);
  /* Reopen: SQLite and the mirror agreed. */
  REQUIRE(kvti_index_open(&g_idx, dir, NULL, 0) == 0);
  uint64_t ne2;
  kvti_index_totals(g_idx, &ne2, NULL, NULL);
  CHECK_EQ_INT(ne2, ne);
  kvt_index_close(g_idx);
}

int main(void) {
  RUN(test_concurrent);
  return kvt_test_done();
}
