/*
 * bench_chunks.c - the chain table at scale (issue 13 targets "open within 2 s
 * for 1M chunks" and "lookup p99 <= 20 us for a 4096-token query against 1M
 * stored chunks"): writes N chunk rows (N/16 chains of 16 chunks of 256
 * tokens, keys and lookup chain values computed as the store computes them)
 * into kvtier_chunks with SQLite's C API in one transaction, then times
 * kvti_index_open + kvti_chains_open on it (no file under chunks/ is listed:
 * the directory does not even exist), and lookups of 4096-token prompts that
 * match a whole chain, half a chain, and nothing. Usage: bench_chunks
 * [n_chunks=1000000]. Prints p50/p99 in microseconds. No assertions.
 */
#include "benchutil.h"
#include "base/io.h"
#include "format/chunk.h"
#include "index/chain.h"
#include "index/index.h"
#include "kvtier.h"
#include "kvtier_sys.h"

#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CT 256
#define LEVELS 16

static void chain_tokens(int32_t *t, uint32_t chain) {
  for (int i = 0; i < CT * LEVELS; i++)
    t[i] = (int32_t)(((uint64_t)chain * 2654435761u + (uint64_t)i * 40503u) %
                     128000u);
}

static int cmpd(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static void lat(const char *name, kvti_chains *ch, const uint8_t *ns,
                size_t nsl, uint32_t nchains, int mode) {
  enum { Q = 20000 };
  static double v[Q];
  static int32_t t[CT * LEVELS];
  kvti_chain_rec out[LEVELS];
  size_t m = 0, found = 0;
  for (int q = 0; q < Q; q++) {
    chain_tokens(t, (uint32_t)(((uint64_t)q * 7919u) % nchains));
    if (mode == 1)
      t[CT * LEVELS / 2 + 3] ^= 0x5555; /* diverges in chunk 8 */
    if (mode == 2)
      t[5] ^= 0x5555; /* diverges in chunk 0 */
    double t0 = bu_now();
    kvti_chains_lookup(ch, ns, nsl, t, CT * LEVELS, CT, out, LEVELS, &m);
    v[q] = (bu_now() - t0) * 1e6;
    found += m;
  }
  qsort(v, Q, sizeof v[0], cmpd);
  printf("%-34s p50 %7.2f us  p99 %7.2f us  (chunks found per query %.1f)\n",
         name, v[Q / 2], v[Q * 99 / 100], (double)found / Q);
}

int main(int argc, char **argv) {
  uint64_t n = argc > 1 ? strtoull(argv[1], NULL, 10) : 1000000;
  uint32_t nchains = (uint32_t)((n + LEVELS - 1) / LEVELS);
  char *dir = bu_mkdtemp(NULL);
  bu_header("bench_chunks: chain table at scale", dir);
  kvt_index *idx;
  if (kvti_index_open(&idx, dir, NULL, 0) != 0) {
    fprintf(stderr, "open: %s\n", kvt_last_error());
    return 1;
  }
  kvti_chains *ch;
  if (kvti_chains_open(&ch, idx) != 0) { /* creates the table */
    fprintf(stderr, "chains: %s\n", kvt_last_error());
    return 1;
  }
  kvti_chains_close(ch);
  kvt_index_close(idx);
  uint8_t *ns;
  size_t nsl;
  kvti_chunk_ns_encode(&ns, &nsl, "bench-model", NULL);
  const uint64_t layout = 0x1234567890abcdefull;
  uint8_t seed[32];
  kvti_chunk_seed(seed, ns, nsl, layout);
  char db[4096];
  snprintf(db, sizeof db, "%s/index.db", dir);
  sqlite3 *s;
  sqlite3_open(db, &s);
  sqlite3_exec(s, "PRAGMA journal_mode=WAL; BEGIN", NULL, NULL, NULL);
  sqlite3_stmt *ins;
  sqlite3_prepare_v2(
      s,
      "INSERT INTO kvtier_chunks (chunk_key, parent_key, chunk_index, "
      "num_tokens, layout_hash, ck_lo, ck_hi, disk_bytes, memory_bytes, "
      "created_at, accessed_at, pure) VALUES (?,?,?,?,?,?,?,?,?,?,?,1)",
      -1, &ins, NULL);
  double t0 = bu_now();
  static int32_t t[CT * LEVELS];
  uint64_t rows = 0;
  for (uint32_t c = 0; c < nchains && rows < n; c++) {
    chain_tokens(t, c);
    uint8_t parent[32], key[32];
    memcpy(parent, seed, 32);
    kvti_ck ck = kvti_ck_seed(ns, nsl);
    for (int i = 0; i < LEVELS && rows < n; i++, rows++) {
      kvti_chunk_key(key, parent, t + i * CT, CT);
      ck = kvti_ck_next(ck, t + i * CT, CT);
      sqlite3_bind_blob(ins, 1, key, 32, SQLITE_STATIC);
      sqlite3_bind_blob(ins, 2, parent, 32, SQLITE_STATIC);
      sqlite3_bind_int64(ins, 3, i);
      sqlite3_bind_int64(ins, 4, CT);
      sqlite3_bind_int64(ins, 5, (sqlite3_int64)layout);
      sqlite3_bind_int64(ins, 6, (sqlite3_int64)ck.lo);
      sqlite3_bind_int64(ins, 7, (sqlite3_int64)ck.hi);
      sqlite3_bind_int64(ins, 8, 33 << 20);
      sqlite3_bind_int64(ins, 9, 32 << 20);
      sqlite3_bind_double(ins, 10, 1.0e9 + (double)rows);
      sqlite3_bind_double(ins, 11, 1.0e9 + (double)rows);
      sqlite3_step(ins);
      sqlite3_reset(ins);
      memcpy(parent, key, 32);
    }
  }
  sqlite3_finalize(ins);
  sqlite3_exec(s, "COMMIT", NULL, NULL, NULL);
  sqlite3_close(s);
  printf("wrote %llu chunk rows (%u chains) in %.1f s\n",
         (unsigned long long)rows, nchains, bu_now() - t0);
  uint64_t rss0 = bu_rss();
  clock_t c0 = clock();
  t0 = bu_now();
  if (kvti_index_open(&idx, dir, NULL, 0) != 0) {
    fprintf(stderr, "reopen: %s\n", kvt_last_error());
    return 1;
  }
  double t1 = bu_now();
  if (kvti_chains_open(&ch, idx) != 0) {
    fprintf(stderr, "reopen: %s\n", kvt_last_error());
    return 1;
  }
  double open_s = bu_now() - t0;
  printf("index open %.3f s, chain table load %.3f s (CPU time of both: %.3f "
         "s; wall time includes waiting on a loaded machine)\n",
         t1 - t0, bu_now() - t1, (double)(clock() - c0) / CLOCKS_PER_SEC);
  kvti_chains_totals tot;
  kvti_chains_totals_get(ch, &tot);
  printf("open (index + chain table, %llu chunks): %.3f s, mirror RSS +%.0f "
         "MiB (%.0f B/chunk)\n",
         (unsigned long long)tot.chunks, open_s,
         (double)(bu_rss() - rss0) / 1048576.0,
         (double)(bu_rss() - rss0) / (double)(tot.chunks ? tot.chunks : 1));
  bu_report("open_1M_chunks_s", open_s, 2.0, "s", "issue 13 limit", 1.0, 0);
  lat("lookup 4096 tokens, whole chain", ch, ns, nsl, nchains, 0);
  lat("lookup 4096 tokens, half a chain", ch, ns, nsl, nchains, 1);
  lat("lookup 4096 tokens, miss", ch, ns, nsl, nchains, 2);
  kvti_chains_close(ch);
  kvt_index_close(idx);
  kvti_free(ns);
  kvt_test_rmtree(dir);
  free(dir);
  return 0;
}
