/*
 * bench_index.c - micro-benchmark of the index mirror (issue 7 lookup targets):
 * exact lookup latency at N entries, longest-prefix latency at M entries that
 * all share a 1,024-token prefix, bytes of lookup structures per entry, and the
 * open time of an index.db holding K entries (written in one transaction with
 * SQLite's C API, as the reference's schema and kvtier_meta), and the time of
 * kvt_tier_open - reconcile included - on a cache directory holding those K
 * entries (each a data/<hash>/ directory with its manifest.json: what
 * reconcile looks at), 0.1% of them with their files missing and as many
 * directories without a row, so reconcile has work to do. Usage:
 * bench_index [exact_n=1000000] [exact_tokens=256] [prefix_n=100000]
 * [open_n=100000] [open_tokens=128] [rebuild_n=100000]; rebuild_n real
 * entries then time the open of the intact cache and the open that rebuilds
 * a deleted index.db from them (issue 18). Prints p50/p99 in microseconds. No
 * assertions.
 */
#include "index/index.h"
#include "kvtier.h"
#include "kvtier_sys.h"
#include "benchutil.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

static void gen(int32_t *t, size_t n, uint64_t seed) {
  for (size_t i = 0; i < n; i++)
    t[i] = (int32_t)(mix(seed * 1000003u + i) % 150000);
}

static int cmpd(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static void report(const char *what, double *lat, size_t n) {
  qsort(lat, n, sizeof *lat, cmpd);
  printf("%-40s p50 %8.2f us  p99 %8.2f us  max %8.2f us\n", what,
         lat[n / 2] * 1e6, lat[n * 99 / 100] * 1e6, lat[n - 1] * 1e6);
}

static char *mktmp(void) {
  char *d = strdup("/tmp/kvt-bench-index-XXXXXX");
  if (!d || !mkdtemp(d)) {
    perror("mkdtemp");
    exit(1);
  }
  return d;
}

static void rmdb(const char *dir) {
  char p[4096];
  const char *suf[] = {"/index.db", "/index.db-wal", "/index.db-shm"};
  for (int i = 0; i < 3; i++) {
    snprintf(p, sizeof p, "%s%s", dir, suf[i]);
    unlink(p);
  }
  rmdir(dir);
}

enum { Q = 20000 };

static void bench_exact(size_t n, size_t ntok) {
  char *dir = mktmp();
  kvt_index *idx = NULL;
  if (kvti_index_open(&idx, dir, NULL, 0)) {
    fprintf(stderr, "open: %s\n", kvt_last_error());
    exit(1);
  }
  int32_t *t = malloc(ntok * sizeof *t);
  double t0 = now();
  for (size_t i = 0; i < n; i++) {
    gen(t, ntok, i);
    if (kvti_index_bench_add(idx, t, ntok, (double)i)) {
      fprintf(stderr, "add: %s\n", kvt_last_error());
      exit(1);
    }
  }
  double build = now() - t0;
  double *lat = malloc(Q * sizeof *lat);
  kvt_entry_info info;
  size_t hits = 0;
  for (size_t q = 0; q < Q; q++) {
    gen(t, ntok, mix(q) % n);
    double a = now();
    hits += kvti_index_find(&info, idx, t, ntok, 0) == 0;
    lat[q] = now() - a;
  }
  char what[128];
  snprintf(what, sizeof what, "exact, %zu entries x %zu tokens", n, ntok);
  report(what, lat, Q);
  for (size_t q = 0; q < Q; q++) {
    double a = now();
    kvt_entry_info v;
    kvti_index_lru_victim(&v, idx);
    lat[q] = now() - a;
  }
  report("lru victim", lat, Q);
  printf("  hits %zu/%d, build %.2f s, lookup structures %.1f bytes/entry\n",
         hits, Q, build, (double)kvti_index_mem_bytes(idx) / (double)n);
  kvt_index_close(idx);
  rmdb(dir);
  free(dir);
  free(t);
  free(lat);
}

static void bench_prefix(size_t n) {
  enum { P = 1024, MAXS = 64, EXTRA = 50 };
  char *dir = mktmp();
  kvt_index *idx = NULL;
  if (kvti_index_open(&idx, dir, NULL, 0))
    exit(1);
  int32_t *t = malloc((P + MAXS + EXTRA) * sizeof *t);
  gen(t, P, 999999);
  double t0 = now();
  for (size_t i = 0; i < n; i++) {
    size_t s = 1 + mix(i) % MAXS;
    gen(t + P, s, i + 1);
    t[P] = (int32_t)i; /* distinct entries */
    if (kvti_index_bench_add(idx, t, P + s, (double)i))
      exit(1);
  }
  double build = now() - t0;
  double *lat = malloc(Q * sizeof *lat);
  kvt_entry_info info;
  size_t ok = 0;
  for (size_t q = 0; q < Q; q++) {
    size_t i = mix(q + 77) % n;
    size_t s = 1 + mix(i) % MAXS;
    gen(t + P, s, i + 1);
    t[P] = (int32_t)i;
    gen(t + P + s, EXTRA, q + 123456789);
    double a = now();
    int rc = kvti_index_find_prefix(&info, idx, t, P + s + EXTRA, 0);
    lat[q] = now() - a;
    ok += rc == 0 && info.num_tokens == P + s;
  }
  char what[128];
  snprintf(what, sizeof what, "prefix, %zu sharing %d tokens", n, P);
  report(what, lat, Q);
  /* Miss after the shared prefix: walks every block, matches nothing. */
  for (size_t q = 0; q < Q; q++) {
    t[P] = -1;
    double a = now();
    kvti_index_find_prefix(&info, idx, t, P + 60, 0);
    lat[q] = now() - a;
  }
  report("prefix miss after shared prefix", lat, Q);
  printf("  correct %zu/%d, build %.2f s, lookup structures %.1f bytes/entry\n",
         ok, Q, build, (double)kvti_index_mem_bytes(idx) / (double)n);
  kvt_index_close(idx);
  rmdb(dir);
  free(dir);
  free(t);
  free(lat);
}

/* The cache directory of bench_open's index gets its data/ tree: one
 * directory with a manifest.json per row, except every 1000th row (files
 * missing: reconcile drops the row), plus n/1000 directories without a row
 * (reconcile removes them). Then kvt_tier_open, which reconciles, is timed.
 * The dentry/inode caches are warm (dropping them needs root and hits every
 * user of the machine): this is the open of a directory the system has seen,
 * e.g. a restart of the engine. */
static void bench_tier_open(const char *dir, size_t n, size_t ntok) {
  char p[4200];
  snprintf(p, sizeof p, "%s/data", dir);
  mkdir(p, 0700);
  int32_t *t = malloc(ntok * sizeof *t);
  double a = now();
  size_t missing = 0, orphans = 0;
  for (size_t i = 0; i < n + n / 1000; i++) {
    char h[65];
    if (i < n) {
      if (i % 1000 == 999) {
        missing++;
        continue;
      }
      gen(t, ntok, i);
      kvt_token_hash(h, t, ntok);
    } else {
      gen(t, ntok, 5 * n + i); /* no row */
      kvt_token_hash(h, t, ntok);
      orphans++;
    }
    snprintf(p, sizeof p, "%s/data/%s", dir, h);
    if (mkdir(p, 0700) != 0) {
      perror("mkdir");
      exit(1);
    }
    snprintf(p, sizeof p, "%s/data/%s/manifest.json", dir, h);
    int fd = open(p, O_CREAT | O_WRONLY | O_TRUNC, 0600);
    if (fd < 0 || write(fd, "{}", 2) != 2) {
      perror("manifest");
      exit(1);
    }
    close(fd);
  }
  double built = now() - a;
  kvt_options o;
  kvt_options_init(&o, KVT_OPTIONS_VERSION);
  o.cache_dir = dir;
  o.max_entries = (int64_t)(2 * n + 10);
  o.max_size_gb = 1e6;
  kvt_tier *tier = NULL;
  a = now();
  if (kvt_tier_open(&tier, &o) != 0) {
    fprintf(stderr, "tier open: %s\n", kvt_last_error());
    exit(1);
  }
  double el = now() - a;
  kvt_stats st = KVT_STATS_INIT;
  kvt_tier_stats(&st, tier);
  printf("tier open with reconcile, %zu entries (%zu rows without files, %zu "
         "directories without a row): %.3f s, target 2 s, ratio %.2f %s; %llu "
         "entries after, %llu reconciled (tree built in %.1f s)\n",
         n, missing, orphans, el, el / 2.0, el <= 2.0 ? "PASS" : "MISS",
         (unsigned long long)st.entries, (unsigned long long)st.reconciled,
         built);
  kvt_tier_free(tier);
  snprintf(p, sizeof p, "%s/data", dir);
  kvt_test_rmtree(p);
  snprintf(p, sizeof p, "%s/kvtier.lock", dir);
  unlink(p);
  snprintf(p, sizeof p, "%s/quarantine", dir);
  rmdir(p);
  free(t);
}

static void bench_open(size_t n, size_t ntok) {
  char *dir = mktmp();
  kvt_index *idx = NULL;
  if (kvti_index_open(&idx, dir, NULL, 0))
    exit(1);
  kvt_index_close(idx);
  char path[4096];
  snprintf(path, sizeof path, "%s/index.db", dir);
  sqlite3 *db;
  sqlite3_open(path, &db);
  sqlite3_exec(db, "BEGIN", NULL, NULL, NULL);
  sqlite3_stmt *ins, *meta;
  sqlite3_prepare_v2(
      db,
      "INSERT INTO entries (token_hash, tokens_blob, prefix_hash, num_tokens, "
      "file_path, memory_bytes, created_at, accessed_at) VALUES "
      "(?,?,?,?,?,?,?,?)",
      -1, &ins, NULL);
  sqlite3_prepare_v2(db, "INSERT INTO kvtier_meta VALUES (?, ?, 0)", -1, &meta,
                     NULL);
  int32_t *t = malloc(ntok * sizeof *t);
  for (size_t i = 0; i < n; i++) {
    gen(t, ntok, i);
    char h[65], ph[65];
    kvt_token_hash(h, t, ntok);
    kvt_prefix_hash(ph, t, ntok);
    sqlite3_bind_text(ins, 1, h, 64, SQLITE_STATIC);
    sqlite3_bind_blob(ins, 2, t, (int)(ntok * 4), SQLITE_STATIC);
    sqlite3_bind_text(ins, 3, ph, 64, SQLITE_STATIC);
    sqlite3_bind_int64(ins, 4, (sqlite3_int64)ntok);
    sqlite3_bind_text(ins, 5, h, 64, SQLITE_STATIC);
    sqlite3_bind_int64(ins, 6, 1000);
    sqlite3_bind_double(ins, 7, 1.7e9 + (double)i);
    sqlite3_bind_double(ins, 8, 1.7e9 + (double)i);
    sqlite3_step(ins);
    sqlite3_reset(ins);
    sqlite3_bind_text(meta, 1, h, 64, SQLITE_STATIC);
    sqlite3_bind_int64(meta, 2, 4096);
    sqlite3_step(meta);
    sqlite3_reset(meta);
  }
  sqlite3_exec(db, "COMMIT", NULL, NULL, NULL);
  sqlite3_finalize(ins);
  sqlite3_finalize(meta);
  sqlite3_close(db);
  double t0 = now();
  if (kvti_index_open(&idx, dir, NULL, 0)) {
    fprintf(stderr, "open: %s\n", kvt_last_error());
    exit(1);
  }
  double el = now() - t0;
  uint64_t ne;
  kvti_index_totals(idx, &ne, NULL, NULL);
  printf("open, %zu entries x %zu tokens: %.3f s (%llu loaded)\n", n, ntok, el,
         (unsigned long long)ne);
  kvt_index_close(idx);
  idx = NULL;
  bench_tier_open(dir, n, ntok);
  if (kvti_index_open(&idx, dir, NULL, 0)) {
    fprintf(stderr, "reopen: %s\n", kvt_last_error());
    exit(1);
  }
  /* Write cost: puts and batched touches through SQLite. */
  double a = now();
  enum { W = 2000 };
  for (size_t i = 0; i < W; i++) {
    gen(t, ntok, n + i);
    kvti_index_put(idx, t, ntok, NULL, 1, 1, 0);
  }
  double put = (now() - a) / W;
  /* The same through kvti_index_put_many, 16 entries per transaction. */
  enum { G = 16 };
  int32_t *tg = malloc((size_t)G * ntok * sizeof *tg);
  kvti_index_put_args pa[G];
  a = now();
  for (size_t i = 0; i < W; i += G) {
    for (size_t j = 0; j < G; j++) {
      gen(tg + j * ntok, ntok, 2 * n + i + j);
      pa[j] = (kvti_index_put_args){tg + j * ntok, ntok, NULL, 1, 1, 0};
    }
    kvti_index_put_many(idx, pa, G);
  }
  double put_many = (now() - a) / W;
  free(tg);
  a = now();
  for (size_t i = 0; i < W; i++) {
    char h[65];
    gen(t, ntok, i);
    kvt_token_hash(h, t, ntok);
    kvti_index_touch_hash(idx, h);
  }
  double touch = (now() - a) / W;
  printf("put %.1f us each, put_many(16) %.1f us each, touch %.2f us each "
         "(batched)\n",
         put * 1e6, put_many * 1e6, touch * 1e6);
  kvt_index_close(idx);
  rmdb(dir);
  free(dir);
  free(t);
}

/* Index recovery (issue 18): n real entries (spilled through a tier: one KV
 * layer of 8 tokens each), then the open of the intact cache (reconcile
 * included; target 2 s) and the open after index.db was deleted (the index
 * rebuilt from the entry directories: every entry's manifest and tokens.bin
 * read and checked, its row put in batches). */
static void bench_rebuild(size_t n) {
  char *dir = mktmp();
  kvt_options o;
  kvt_options_init(&o, KVT_OPTIONS_VERSION);
  o.cache_dir = dir;
  o.durability = KVT_DURABILITY_NONE;
  o.max_entries = (int64_t)(2 * n + 10);
  o.max_size_gb = 1e6;
  o.spill_queue_size = 1u << 20;
  o.spill_queue_bytes = 0;
  kvt_tier *tier = NULL;
  if (kvt_tier_open(&tier, &o) != 0 || kvt_tier_start_writer(tier) != 0) {
    fprintf(stderr, "tier open: %s\n", kvt_last_error());
    exit(1);
  }
  enum { T = 8, D = 4 };
  float kv[2][2 * T * D];
  memset(kv, 0, sizeof kv);
  kvt_tensor ts[2];
  memset(ts, 0, sizeof ts);
  for (int k = 0; k < 2; k++) {
    ts[k].dtype = KVT_DTYPE_F32;
    ts[k].ndim = 4;
    ts[k].shape[0] = 1;
    ts[k].shape[1] = 2;
    ts[k].shape[2] = T;
    ts[k].shape[3] = D;
    ts[k].nbytes = sizeof kv[k];
    ts[k].data = kv[k];
  }
  kvt_layer l;
  kvt_layer_init(&l, KVT_LAYER_KV);
  l.num_tensors = 2;
  l.tensors = ts;
  l.offset = T;
  int32_t tok[16];
  double a = now();
  for (size_t i = 0; i < n; i++) {
    gen(tok, 16, 77 * n + i);
    while (kvt_tier_spill(tier, tok, 16, &l, 1, sizeof kv) == KVT_EFULL)
      kvt_tier_flush(tier, 100);
  }
  kvt_tier_flush(tier, -1);
  kvt_tier_close(tier, -1);
  kvt_tier_free(tier);
  double built = now() - a;
  o.max_entries = (int64_t)(2 * n + 10);
  double t_open = 0, t_rebuild = 0;
  kvt_stats st;
  for (int pass = 0; pass < 2; pass++) {
    if (pass == 1)
      rmdb(dir);
    tier = NULL;
    a = now();
    if (kvt_tier_open(&tier, &o) != 0) {
      fprintf(stderr, "tier open: %s\n", kvt_last_error());
      exit(1);
    }
    double el = now() - a;
    memset(&st, 0, sizeof st);
    kvt_tier_stats(&st, tier);
    kvt_tier_close(tier, -1);
    kvt_tier_free(tier);
    if (pass == 0)
      t_open = el;
    else
      t_rebuild = el;
    if (st.entries != n)
      fprintf(stderr, "  pass %d: %llu entries, %zu expected\n", pass,
              (unsigned long long)st.entries, n);
  }
  printf("index recovery, %zu entries (spilled in %.1f s): open of the intact "
         "cache %.3f s (target 2 s, ratio %.2f %s); open with index.db "
         "deleted, index rebuilt %.3f s (%.0f entries/s, %.1fx the intact "
         "open); %llu entries after\n",
         n, built, t_open, t_open / 2.0, t_open <= 2.0 ? "PASS" : "MISS",
         t_rebuild, (double)n / t_rebuild, t_rebuild / t_open,
         (unsigned long long)st.entries);
  char cmd[4200];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  if (system(cmd) != 0)
    fprintf(stderr, "cleanup of %s failed\n", dir);
  free(dir);
}

int main(int argc, char **argv) {
  size_t exact_n = argc > 1 ? strtoull(argv[1], NULL, 10) : 1000000;
  size_t exact_tok = argc > 2 ? strtoull(argv[2], NULL, 10) : 256;
  size_t prefix_n = argc > 3 ? strtoull(argv[3], NULL, 10) : 100000;
  size_t open_n = argc > 4 ? strtoull(argv[4], NULL, 10) : 100000;
  size_t open_tok = argc > 5 ? strtoull(argv[5], NULL, 10) : 128;
  size_t rebuild_n = argc > 6 ? strtoull(argv[6], NULL, 10) : 100000;
  if (exact_n)
    bench_exact(exact_n, exact_tok ? exact_tok : 1);
  if (prefix_n)
    bench_prefix(prefix_n);
  if (open_n)
    bench_open(open_n, open_tok ? open_tok : 1);
  if (rebuild_n)
    bench_rebuild(rebuild_n);
  return 0;
}
