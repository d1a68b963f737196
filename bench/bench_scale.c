/*
 * bench_scale.c - how the issue-7 figures scale, measured in one run through
 * the public API only (include/kvtier.h) plus benchutil: (1) entry size -
 * Llama-3-8B-shaped entries (32 KV layers, 8 heads, head dim 128, F16) of
 * 256..8192 tokens: durable writer-side spill, cold and warm promote, each
 * next to the fio limit measured right before (same job shapes as
 * bench_tier), with milliseconds per entry and a fitted fixed cost per entry;
 * (2) entry count - small entries stored by the hundred, thousand and ten
 * thousand: exact and prefix lookup latency, warm promote latency, the
 * writer's throughput for the next 100 entries and kvt_tier_open time with
 * reconcile, to show what does (not) depend on the count; (3) concurrency -
 * 1..8 threads promoting distinct entries at once (warm and cold) against
 * fio, async promotes with 1 vs 4 in flight, and 1..4 threads spilling into
 * one tier. Scratch data lives in a kvt-bench-XXXXXX directory on the disk
 * under test; each section removes its data before the next so at most about
 * 2 GiB sit on disk at once. Benchmarks print, never assert; any API error
 * exits non-zero with kvt_last_error().
 *
 * Usage: bench_scale [--dir DIR] [--quick] [--sections size,count,conc]
 *                    [--tokens 256,1024,..] [--counts 100,1000,..]
 *                    [--depth N] [--no-fio] [--json]
 */
#define _GNU_SOURCE 1
#include "benchutil.h"
#include "kvtier.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

/* ------------------------------------------------------------ output */

static FILE *out; /* tables: stdout, or stderr with --json */
static int use_fio = 1, depth = 8;
static char *jbuf; /* JSON rows, comma-separated */
static size_t jlen, jcap;

/* Appends one JSON object (the caller's format is the object's body). */
static void jrow(const char *fmt, ...) {
  char tmp[1024];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
  va_end(ap);
  if (n < 0)
    return;
  size_t need = jlen + (size_t)n + 4;
  if (need > jcap) {
    jcap = need * 2;
    jbuf = realloc(jbuf, jcap);
    if (!jbuf)
      abort();
  }
  jlen += (size_t)sprintf(jbuf + jlen, "%s{%s}", jlen ? "," : "", tmp);
}

static void die(const char *what) {
  fprintf(stderr, "bench_scale: %s: %s\n", what, kvt_last_error());
  exit(1);
}
#define API(call, what)                                                        \
  do {                                                                         \
    if ((call) < 0)                                                            \
      die(what);                                                               \
  } while (0)

static void loadavg(char *buf, size_t cap) {
  FILE *f = fopen("/proc/loadavg", "r");
  double a = 0, b = 0, c = 0;
  if (f) {
    if (fscanf(f, "%lf %lf %lf", &a, &b, &c) != 3)
      a = b = c = 0;
    fclose(f);
  }
  snprintf(buf, cap, "%.2f %.2f %.2f", a, b, c);
}

static int cmp_d(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}
/* Nearest-rank percentile (q in 0..1) of n values; sorts v. */
static double pct(double *v, size_t n, double q) {
  if (!n)
    return 0;
  qsort(v, n, sizeof *v, cmp_d);
  size_t k = (size_t)(q * (double)n + 0.999999);
  if (k < 1)
    k = 1;
  if (k > n)
    k = n;
  return v[k - 1];
}

/* ------------------------------------------------------------ workload */

typedef bu_workload workload;

/* Entry k's tokens: the workload's, with the first token made unique. */
static void salt(int32_t *tok, int k) {
  tok[0] = 200000 + k;
}

/* ------------------------------------------------------------ limits */

typedef struct limits {
  double w, rd, rb; /* bytes/s: O_DIRECT write, O_DIRECT read, buffered read */
} limits;

/* bench_tier's fio job shapes: 1 MiB blocks, io_uring at `depth` (write with
 * end_fsync, read with the cache invalidated), warm buffered read with psync
 * (run three times: the best of the last two, once the file is cached). */
static void measure_limits(limits *L, const char *dir, uint64_t size) {
  memset(L, 0, sizeof *L);
  if (!use_fio)
    return;
  if (size > (1ull << 30))
    size = 1ull << 30;
  if (size < (64ull << 20))
    size = 64ull << 20;
  char f[4096];
  snprintf(f, sizeof f, "%s/fio.dat", dir);
  unlink(f);
  bu_fio_job j = {f, "write", 1, 1u << 20, size, depth, "io_uring", 1, 1};
  bu_fio(&L->w, &j);
  j.rw = "read";
  bu_fio(&L->rd, &j);
  j.direct = 0;
  j.engine = "psync";
  j.depth = 1;
  j.invalidate = 0;
  for (int r = 0; r < 3; r++) { /* the first reads the file into the cache */
    double v = 0;
    if (bu_fio(&v, &j) == 0 && r > 0 && v > L->rb)
      L->rb = v;
  }
  unlink(f);
}

/* Minor page faults of the calling thread. */
static long minflt(void) {
  struct rusage ru;
  getrusage(RUSAGE_THREAD, &ru);
  return ru.ru_minflt;
}

static double ratio(double v, double l) {
  return l > 0 ? v / l : 0;
}

/* Evicts every file a promote of the cache's entries reads (data/ and the
 * chunked store's chunks/) from the page cache; returns the fraction of their
 * pages still cached (what the cold read will find). */
static double evict_cache(const char *cache) {
  bu_residency res = {0};
  char p[4200];
  snprintf(p, sizeof p, "%s/data", cache);
  bu_evict_tree(p, &res);
  snprintf(p, sizeof p, "%s/chunks", cache);
  bu_evict_tree(p, &res);
  return bu_resident_after(&res);
}

/* The reverse, for warm figures: data/ and chunks/ read into the cache. */
static void warm_cache(const char *cache) {
  char p[4200];
  snprintf(p, sizeof p, "%s/data", cache);
  bu_warm_cache_tree(p);
  snprintf(p, sizeof p, "%s/chunks", cache);
  bu_warm_cache_tree(p);
}

/* " FLAGGED: ..." for a figure bu_figure_flags rejects, else "". */
static const char *flag_note(char *buf, size_t cap, double v, double l,
                             double resident) {
  unsigned f = bu_figure_flags(v, l, resident);
  if (!f)
    return "";
  snprintf(buf, cap, " (FLAGGED %s)", bu_figure_flag_text(f));
  return buf;
}

/* ------------------------------------------------------------ tier helpers */

static kvt_tier *open_tier(const char *cache, int durability,
                           uint64_t queue_bytes, uint32_t queue_n,
                           uint32_t promote_threads, int writer) {
  kvt_options o;
  kvt_options_init(&o, KVT_OPTIONS_VERSION);
  /* The disk path's figures (cold, page cache, pooled buffers): the host RAM
   * tier is measured by bench/bench_ram_tier.py. */
  o.host_cache_bytes = 0;
  o.cache_dir = cache;
  o.max_size_gb = 64;
  o.max_entries = 1000000;
  o.spill_queue_size = queue_n;
  o.spill_queue_bytes = queue_bytes;
  o.durability = durability;
  o.promote_threads = promote_threads;
  kvt_tier *t = NULL;
  API(kvt_tier_open(&t, &o), "kvt_tier_open");
  if (writer)
    API(kvt_tier_start_writer(t), "kvt_tier_start_writer");
  return t;
}

static void close_tier(kvt_tier *t) {
  API(kvt_tier_close(t, -1), "kvt_tier_close");
  kvt_tier_free(t);
}

static uint64_t promote_one(kvt_tier *t, const int32_t *tok, size_t n) {
  kvt_entry *e = NULL;
  API(kvt_tier_promote(&e, t, tok, n, NULL), "kvt_tier_promote");
  uint64_t b = kvt_entry_disk_bytes(e);
  kvt_entry_free(e);
  return b;
}

/* Spills entries first..first+n-1 with the writer stopped, then times the
 * writer from kvt_tier_start_writer to the end of kvt_tier_flush. Returns
 * seconds; *bytes receives the bytes written (stats.spill_bytes). */
static double timed_drain(kvt_tier *t, workload *w, int first, int n,
                          uint64_t *bytes) {
  for (int k = 0; k < n; k++) {
    salt(w->tokens, first + k);
    API(kvt_tier_spill(t, w->tokens, w->n_tokens, w->layers, w->n_layers,
                       w->bytes),
        "kvt_tier_spill");
  }
  kvt_stats s0 = KVT_STATS_INIT, s1 = KVT_STATS_INIT;
  API(kvt_tier_stats(&s0, t), "kvt_tier_stats");
  double t0 = bu_now();
  API(kvt_tier_start_writer(t), "kvt_tier_start_writer");
  API(kvt_tier_flush(t, -1), "kvt_tier_flush");
  double dt = bu_now() - t0;
  API(kvt_tier_stats(&s1, t), "kvt_tier_stats");
  if (s1.write_failures != s0.write_failures) {
    fprintf(stderr, "bench_scale: %llu spill(s) failed in the writer\n",
            (unsigned long long)(s1.write_failures - s0.write_failures));
    exit(1);
  }
  *bytes = s1.spill_bytes - s0.spill_bytes;
  return dt;
}

/* ------------------------------------------------------------ 1: size */

/* Least-squares fit y = a + b x; returns a (the intercept). */
static double fit(const double *x, const double *y, int n, double *slope) {
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (int i = 0; i < n; i++) {
    sx += x[i];
    sy += y[i];
    sxx += x[i] * x[i];
    sxy += x[i] * y[i];
  }
  double d = n * sxx - sx * sx;
  double b = d != 0 ? (n * sxy - sx * sy) / d : 0;
  *slope = b;
  return n ? (sy - b * sx) / n : 0;
}

static void section_size(const char *dir, const size_t *toks, int ntoks,
                         int quick) {
  fprintf(out, "\n## 1. Entry size: Llama-3-8B-shaped entries (32 KV layers, 8 "
               "heads, dim 128, F16), durability FSYNC\n\n");
  fprintf(out, "| tokens | MiB/entry | entries | figure | value GB/s | limit "
               "GB/s | ratio | ms/entry |\n");
  fprintf(out, "|---|---|---|---|---|---|---|---|\n");
  double mib[16], ms[3][16];
  int nf = 0;
  for (int ti = 0; ti < ntoks && ti < 16; ti++) {
    size_t T = toks[ti];
    workload w;
    bu_workload_make(&w, 32, 0, KVT_DTYPE_F16, 8, T, 128, 7);
    int n = T >= 4096 ? 2 : T >= 1024 ? 4 : 8;
    if (quick)
      n = T >= 1024 ? 2 : 4;
    limits L;
    measure_limits(&L, dir, (uint64_t)n * w.bytes);
    char cache[4096];
    snprintf(cache, sizeof cache, "%s/size", dir);
    kvt_test_rmtree(cache);
    kvt_tier *t = open_tier(cache, KVT_DURABILITY_FSYNC,
                            (uint64_t)(n + 1) * w.bytes, 64, 2, 0);
    uint64_t wb = 0;
    double tw = timed_drain(t, &w, 0, n, &wb);
    double resident = evict_cache(cache);
    uint64_t cb = 0;
    double t0 = bu_now();
    for (int k = 0; k < n; k++) {
      salt(w.tokens, k);
      cb += promote_one(t, w.tokens, T);
    }
    double tc = bu_now() - t0;
    /* Warm: the page cache made hot first (cold promotes read with O_DIRECT
     * and leave nothing cached); best of two passes. */
    warm_cache(cache);
    double th = 0;
    uint64_t hb = 0;
    for (int pass = 0; pass < 2; pass++) {
      uint64_t b = 0;
      t0 = bu_now();
      for (int k = 0; k < n; k++) {
        salt(w.tokens, k);
        b += promote_one(t, w.tokens, T);
      }
      double d = bu_now() - t0;
      if (th == 0 || d < th) {
        th = d;
        hb = b;
      }
    }
    close_tier(t);
    kvt_test_rmtree(cache);
    double m = (double)w.bytes / (1 << 20);
    const char *names[3] = {"durable spill (writer)", "cold promote",
                            "warm promote"};
    const char *keys[3] = {"spill", "cold", "warm"};
    double val[3] = {wb / tw, cb / tc, hb / th};
    double lim[3] = {L.w, L.rd, L.rb};
    double per[3] = {tw / n * 1e3, tc / n * 1e3, th / n * 1e3};
    for (int i = 0; i < 3; i++) {
      char fb[160];
      double res_i = i == 1 ? resident : -1;
      unsigned fl = bu_figure_flags(val[i], lim[i], res_i);
      fprintf(out, "| %zu | %.0f | %d | %s%s | %.2f | %.2f | %.2f | %.1f |\n",
              T, m, n, names[i],
              flag_note(fb, sizeof fb, val[i], lim[i], res_i), val[i] / 1e9,
              lim[i] / 1e9, ratio(val[i], lim[i]), per[i]);
      jrow("\"section\":\"size\",\"tokens\":%zu,\"entry_mib\":%.1f,"
           "\"entries\":%d,\"figure\":\"%s\",\"value_gbps\":%.4f,"
           "\"limit_gbps\":%.4f,\"ratio\":%.4f,\"ms_per_entry\":%.3f,"
           "\"resident_at_read\":%.4f,\"flagged\":%s",
           T, m, n, keys[i], val[i] / 1e9, lim[i] / 1e9, ratio(val[i], lim[i]),
           per[i], res_i < 0 ? 0 : res_i, fl ? "true" : "false");
      ms[i][nf] = per[i];
    }
    mib[nf++] = m;
    fflush(out);
    bu_workload_free(&w);
  }
  if (nf >= 2) {
    fprintf(out, "\nFit ms/entry = fixed + per-MiB x MiB over the sizes "
                 "above:\n");
    const char *names[3] = {"spill", "cold", "warm"};
    for (int i = 0; i < 3; i++) {
      double b = 0, a = fit(mib, ms[i], nf, &b);
      fprintf(out,
              "- %s: fixed %.1f ms/entry, %.3f ms/MiB (%.2f GB/s "
              "marginal)\n",
              names[i], a, b, b > 0 ? (1 << 20) / (b * 1e6) : 0);
      jrow("\"section\":\"size_fit\",\"figure\":\"%s\",\"fixed_ms\":%.3f,"
           "\"ms_per_mib\":%.5f",
           names[i], a, b);
    }
  }
}

/* ------------------------------------------------------------ 2: count */

static uint64_t rng_state = 0x2545f4914f6cdd1dull;
static uint64_t rnd(void) {
  uint64_t x = rng_state;
  x ^= x << 13;
  x ^= x >> 7;
  x ^= x << 17;
  return rng_state = x;
}

static void section_count(const char *dir, const size_t *counts, int ncounts,
                          int quick) {
  /* Small entries: 64 tokens, 2 KV layers of [1, 1, 64, 128] F16 (64 KiB of
   * tensors, 3 files): 10,000 of them take ~0.7 GiB of disk. */
  const size_t T = 64;
  workload w;
  bu_workload_make(&w, 2, 0, KVT_DTYPE_F16, 1, T, 128, 7);
  fprintf(out,
          "\n## 2. Entry count: entries of %zu tokens, 2 KV layers [1,1,%zu,"
          "128] F16 (%.0f KiB); filled with durability NONE, measured with "
          "FSYNC\n\n",
          T, T, (double)w.bytes / 1024);
  fprintf(out, "| stored | fill entries/s | open+reconcile ms | exact lookup "
               "p50/p99 us | prefix lookup p50/p99 us | warm promote p50/p99 "
               "ms | next 100 spills (writer): entries/s, MB/s |\n");
  fprintf(out, "|---|---|---|---|---|---|---|\n");
  char cache[4096];
  snprintf(cache, sizeof cache, "%s/count", dir);
  kvt_test_rmtree(cache);
  int next = 0; /* next salt */
  const int n_lookups = quick ? 2000 : 10000;
  const int n_promotes = quick ? 100 : 300;
  double *lat = malloc(sizeof(double) * (size_t)n_lookups);
  int32_t *longer = malloc((T + 16) * sizeof(int32_t));
  if (!lat || !longer)
    abort();
  for (int ci = 0; ci < ncounts; ci++) {
    int target = (int)counts[ci];
    /* Fill (durability NONE, writer running) up to target stored entries. */
    kvt_tier *t = open_tier(cache, KVT_DURABILITY_NONE, 0, 1024, 2, 1);
    kvt_stats st = KVT_STATS_INIT;
    API(kvt_tier_stats(&st, t), "kvt_tier_stats");
    int have = (int)st.entries, add = target - have;
    double t0 = bu_now();
    for (int k = 0; k < add; k++) {
      salt(w.tokens, next++);
      API(kvt_tier_spill(t, w.tokens, T, w.layers, w.n_layers, w.bytes),
          "kvt_tier_spill");
      if (k % 512 == 511)
        API(kvt_tier_flush(t, -1), "kvt_tier_flush");
    }
    API(kvt_tier_flush(t, -1), "kvt_tier_flush");
    double fill_rate = add > 0 ? add / (bu_now() - t0) : 0;
    close_tier(t);
    /* Open with reconcile (the default), FSYNC: median of 3. */
    double op[3];
    for (int r = 0; r < 3; r++) {
      t0 = bu_now();
      t = open_tier(cache, KVT_DURABILITY_FSYNC, 0, 1024, 2, 0);
      op[r] = bu_now() - t0;
      if (r < 2)
        close_tier(t);
    }
    double open_ms = bu_median(op, 3) * 1e3;
    API(kvt_tier_stats(&st, t), "kvt_tier_stats");
    int stored = (int)st.entries;
    /* Exact lookups of random stored entries (salts 0..next-1 are all
     * stored: nothing is evicted or expired). */
    kvt_entry_info info;
    for (int i = 0; i < n_lookups; i++) {
      salt(w.tokens, (int)(rnd() % (uint64_t)next));
      double a = bu_now();
      API(kvt_tier_lookup(&info, t, w.tokens, T), "kvt_tier_lookup");
      lat[i] = bu_now() - a;
    }
    double l50 = pct(lat, (size_t)n_lookups, 0.5) * 1e6;
    double l99 = pct(lat, (size_t)n_lookups, 0.99) * 1e6;
    /* Longest-prefix lookups: a stored entry's tokens plus 16 more. */
    for (size_t i = 0; i < T + 16; i++)
      longer[i] = (int32_t)(i < T ? w.tokens[i] : 120000 + (int32_t)i);
    for (int i = 0; i < n_lookups; i++) {
      salt(longer, (int)(rnd() % (uint64_t)next));
      double a = bu_now();
      API(kvt_tier_lookup_prefix(&info, t, longer, T + 16),
          "kvt_tier_lookup_prefix");
      lat[i] = bu_now() - a;
    }
    double p50 = pct(lat, (size_t)n_lookups, 0.5) * 1e6;
    double p99 = pct(lat, (size_t)n_lookups, 0.99) * 1e6;
    /* Warm promotes: random stored entries, each promoted once to bring it
     * into the page cache, then timed. */
    int *pick = malloc(sizeof(int) * (size_t)n_promotes);
    if (!pick)
      abort();
    for (int i = 0; i < n_promotes; i++) {
      pick[i] = (int)(rnd() % (uint64_t)next);
      salt(w.tokens, pick[i]);
      promote_one(t, w.tokens, T);
    }
    for (int i = 0; i < n_promotes; i++) {
      salt(w.tokens, pick[i]);
      double a = bu_now();
      promote_one(t, w.tokens, T);
      lat[i] = bu_now() - a;
    }
    free(pick);
    double w50 = pct(lat, (size_t)n_promotes, 0.5) * 1e3;
    double w99 = pct(lat, (size_t)n_promotes, 0.99) * 1e3;
    /* The writer's throughput for the next 100 durable spills. */
    uint64_t wb = 0;
    double tw = timed_drain(t, &w, next, 100, &wb);
    next += 100;
    close_tier(t);
    fprintf(out,
            "| %d | %.0f | %.1f | %.2f / %.2f | %.2f / %.2f | %.3f / %.3f | "
            "%.0f, %.1f |\n",
            stored, fill_rate, open_ms, l50, l99, p50, p99, w50, w99, 100 / tw,
            wb / tw / 1e6);
    jrow("\"section\":\"count\",\"stored\":%d,\"fill_entries_per_s\":%.1f,"
         "\"open_ms\":%.2f,\"lookup_p50_us\":%.3f,\"lookup_p99_us\":%.3f,"
         "\"prefix_p50_us\":%.3f,\"prefix_p99_us\":%.3f,"
         "\"warm_promote_p50_ms\":%.4f,\"warm_promote_p99_ms\":%.4f,"
         "\"writer_entries_per_s\":%.1f,\"writer_mbps\":%.2f",
         stored, fill_rate, open_ms, l50, l99, p50, p99, w50, w99, 100 / tw,
         wb / tw / 1e6);
    fflush(out);
  }
  free(lat);
  free(longer);
  bu_workload_free(&w);
  kvt_test_rmtree(cache);
  sync(); /* no writeback of the NONE fill left to disturb the next section */
}

/* ------------------------------------------------------------ 3: threads */

typedef struct job {
  kvt_tier *t;
  workload *w;
  pthread_barrier_t *bar;
  int first, step, n; /* entries first, first+step, ... < n */
  int spill;          /* 1: spill instead of promote */
  int base;           /* salt offset: entry k is salt base + k */
  uint64_t bytes;
  double done; /* bu_now() when the thread finished its work */
  long faults; /* minor page faults taken by this thread's calls */
  int rc;
} job;

static void *job_run(void *arg) {
  job *j = arg;
  int32_t *tok = malloc(j->w->n_tokens * sizeof(int32_t));
  if (!tok)
    abort();
  memcpy(tok, j->w->tokens, j->w->n_tokens * sizeof(int32_t));
  pthread_barrier_wait(j->bar);
  long f0 = minflt();
  for (int k = j->first; k < j->n; k += j->step) {
    salt(tok, j->base + k);
    int rc;
    if (j->spill) {
      rc = kvt_tier_spill(j->t, tok, j->w->n_tokens, j->w->layers,
                          j->w->n_layers, j->w->bytes);
      if (rc == 0)
        j->bytes += j->w->bytes;
    } else {
      kvt_entry *e = NULL;
      rc = kvt_tier_promote(&e, j->t, tok, j->w->n_tokens, NULL);
      if (rc == 0)
        j->bytes += kvt_entry_disk_bytes(e);
      kvt_entry_free(e);
    }
    if (rc != 0) {
      /* kvt_last_error is thread-local: report it here. */
      fprintf(stderr, "bench_scale: %s: %s\n",
              j->spill ? "kvt_tier_spill" : "kvt_tier_promote",
              kvt_last_error());
      j->rc = rc;
      break;
    }
  }
  j->done = bu_now();
  j->faults = minflt() - f0;
  free(tok);
  return NULL;
}

/* Runs nt threads over entries 0..n-1 (thread i: i, i+nt, ...). Returns the
 * wall time from the common start to the last thread's end; *bytes gets the
 * total. */
static double run_threads(kvt_tier *t, workload *w, int nt, int n, int spill,
                          int base, uint64_t *bytes, double *t_start,
                          long *faults) {
  pthread_t th[16];
  job jobs[16];
  pthread_barrier_t bar;
  pthread_barrier_init(&bar, NULL, (unsigned)nt + 1);
  for (int i = 0; i < nt; i++) {
    jobs[i] = (job){t, w, &bar, i, nt, n, spill, base, 0, 0, 0, 0};
    if (pthread_create(&th[i], NULL, job_run, &jobs[i]) != 0)
      abort();
  }
  pthread_barrier_wait(&bar);
  double t0 = bu_now();
  if (t_start)
    *t_start = t0;
  double end = t0;
  *bytes = 0;
  int bad = 0;
  for (int i = 0; i < nt; i++) {
    pthread_join(th[i], NULL);
    *bytes += jobs[i].bytes;
    if (faults)
      *faults += jobs[i].faults;
    if (jobs[i].done > end)
      end = jobs[i].done;
    bad |= jobs[i].rc != 0;
  }
  pthread_barrier_destroy(&bar);
  if (bad)
    exit(1);
  return end - t0;
}

/* Async promotes of entries 0..n-1 keeping `inflight` promises open. */
static double run_async(kvt_tier *t, workload *w, int n, int inflight,
                        uint64_t *bytes) {
  kvt_promise *p[16] = {0};
  int issued = 0, done = 0;
  *bytes = 0;
  double t0 = bu_now();
  while (done < n) {
    while (issued < n && issued - done < inflight) {
      salt(w->tokens, issued);
      API(kvt_tier_promote_async(&p[issued % 16], t, w->tokens, w->n_tokens,
                                 NULL),
          "kvt_tier_promote_async");
      issued++;
    }
    kvt_promise *q = p[done % 16];
    API(kvt_promise_wait(q, -1), "kvt_promise_wait");
    kvt_entry *e = NULL;
    API(kvt_promise_result(&e, q), "kvt_promise_result");
    *bytes += kvt_entry_disk_bytes(e);
    kvt_entry_free(e);
    kvt_promise_free(q);
    done++;
  }
  return bu_now() - t0;
}

static void section_conc(const char *dir, int quick) {
  const size_t T = 1024;
  const int n = quick ? 4 : 8; /* distinct entries */
  workload w;
  bu_workload_make(&w, 32, 0, KVT_DTYPE_F16, 8, T, 128, 7);
  limits L;
  measure_limits(&L, dir, quick ? (256ull << 20) : (512ull << 20));
  char cache[4096];
  snprintf(cache, sizeof cache, "%s/conc", dir);
  kvt_test_rmtree(cache);
  fprintf(out,
          "\n## 3. Concurrency: %d distinct entries of %zu tokens (%.0f MiB "
          "each); fio limits: O_DIRECT write %.2f, O_DIRECT read %.2f, "
          "buffered read %.2f GB/s\n\n",
          n, T, (double)w.bytes / (1 << 20), L.w / 1e9, L.rd / 1e9, L.rb / 1e9);
  fprintf(out, "| mode | threads / in flight | cold GB/s | ratio to fio "
               "O_DIRECT read | warm GB/s | ratio to fio buffered read |\n");
  fprintf(out, "|---|---|---|---|---|---|\n");
  kvt_tier *t = open_tier(cache, KVT_DURABILITY_FSYNC,
                          (uint64_t)(n + 1) * w.bytes, 64, 2, 1);
  for (int k = 0; k < n; k++) {
    salt(w.tokens, k);
    API(kvt_tier_spill(t, w.tokens, T, w.layers, w.n_layers, w.bytes),
        "kvt_tier_spill");
  }
  API(kvt_tier_flush(t, -1), "kvt_tier_flush");
  int threads[4] = {1, 2, 4, 8};
  for (int i = 0; i < 4; i++) {
    int nt = threads[i];
    if (nt > n)
      break;
    uint64_t cb = 0, hb = 0;
    double resident = evict_cache(cache);
    double tc = run_threads(t, &w, nt, n, 0, 0, &cb, NULL, NULL);
    /* Warm: page cache made hot first, as in section 1; best of two passes.
     */
    warm_cache(cache);
    double th = 0;
    for (int pass = 0; pass < 2; pass++) {
      uint64_t b = 0;
      double d = run_threads(t, &w, nt, n, 0, 0, &b, NULL, NULL);
      if (th == 0 || d < th) {
        th = d;
        hb = b;
      }
    }
    char f1[160], f2[160];
    fprintf(out, "| sync promote | %d | %.2f%s | %.2f | %.2f%s | %.2f |\n", nt,
            cb / tc / 1e9, flag_note(f1, sizeof f1, cb / tc, L.rd, resident),
            ratio(cb / tc, L.rd), hb / th / 1e9,
            flag_note(f2, sizeof f2, hb / th, L.rb, -1), ratio(hb / th, L.rb));
    jrow("\"section\":\"conc_promote\",\"threads\":%d,\"cold_gbps\":%.4f,"
         "\"cold_ratio\":%.4f,\"warm_gbps\":%.4f,\"warm_ratio\":%.4f",
         nt, cb / tc / 1e9, ratio(cb / tc, L.rd), hb / th / 1e9,
         ratio(hb / th, L.rb));
    fflush(out);
  }
  close_tier(t);
  /* Async: promote_threads = in flight (1 or 4). */
  int infl[2] = {1, 4};
  for (int i = 0; i < 2; i++) {
    t = open_tier(cache, KVT_DURABILITY_FSYNC, 0, 64, (uint32_t)infl[i], 0);
    uint64_t cb = 0, hb = 0;
    double resident = evict_cache(cache);
    double tc = run_async(t, &w, n, infl[i], &cb);
    warm_cache(cache);
    double th = 0;
    for (int pass = 0; pass < 2; pass++) {
      uint64_t b = 0;
      double d = run_async(t, &w, n, infl[i], &b);
      if (th == 0 || d < th) {
        th = d;
        hb = b;
      }
    }
    close_tier(t);
    char f1[160], f2[160];
    fprintf(out,
            "| async promote (promote_threads %d) | %d | %.2f%s | %.2f | "
            "%.2f%s | %.2f |\n",
            infl[i], infl[i], cb / tc / 1e9,
            flag_note(f1, sizeof f1, cb / tc, L.rd, resident),
            ratio(cb / tc, L.rd), hb / th / 1e9,
            flag_note(f2, sizeof f2, hb / th, L.rb, -1), ratio(hb / th, L.rb));
    jrow("\"section\":\"conc_async\",\"in_flight\":%d,\"cold_gbps\":%.4f,"
         "\"cold_ratio\":%.4f,\"warm_gbps\":%.4f,\"warm_ratio\":%.4f",
         infl[i], cb / tc / 1e9, ratio(cb / tc, L.rd), hb / th / 1e9,
         ratio(hb / th, L.rb));
    fflush(out);
  }
  kvt_test_rmtree(cache);
  /* Concurrent spills into one tier (writer running): producers' aggregate
   * copy throughput, and the writer's from the first spill to flush end
   * (spill_queue_bytes holds every entry of a round: no drops). */
  fprintf(out, "\n| spilling threads | entries | producer aggregate GB/s | "
               "ms per spill call | writer GB/s (first spill .. flushed) | "
               "ratio to fio O_DIRECT write | page faults in spill calls |\n");
  fprintf(out, "|---|---|---|---|---|---|---|\n");
  for (int nt = 1; nt <= 4; nt *= 2) {
    kvt_test_rmtree(cache);
    t = open_tier(cache, KVT_DURABILITY_FSYNC, (uint64_t)(n + 1) * w.bytes, 64,
                  2, 1);
    /* An untimed round first (other tokens): the buffer pool then holds
     * as many snapshot buffers as this many producers keep alive at once;
     * without it the timed round pays first-touch page faults. */
    uint64_t pb = 0;
    double start = 0;
    run_threads(t, &w, nt, n, 1, 1000, &pb, &start, NULL);
    API(kvt_tier_flush(t, -1), "kvt_tier_flush");
    kvt_stats s0 = KVT_STATS_INIT, s1 = KVT_STATS_INIT;
    API(kvt_tier_stats(&s0, t), "kvt_tier_stats");
    long faults = 0;
    double tp = run_threads(t, &w, nt, n, 1, 0, &pb, &start, &faults);
    API(kvt_tier_flush(t, -1), "kvt_tier_flush");
    double tw = bu_now() - start;
    API(kvt_tier_stats(&s1, t), "kvt_tier_stats");
    close_tier(t);
    double wbw = (double)(s1.spill_bytes - s0.spill_bytes) / tw;
    /* Each thread's calls run back to back: wall time x threads / calls. */
    double per = tp * nt / n * 1e3;
    fprintf(out, "| %d | %d | %.2f | %.1f | %.2f | %.2f | %ld |\n", nt, n,
            pb / tp / 1e9, per, wbw / 1e9, ratio(wbw, L.w), faults);
    jrow("\"section\":\"conc_spill\",\"threads\":%d,\"entries\":%d,"
         "\"producer_gbps\":%.4f,\"ms_per_spill\":%.3f,\"writer_gbps\":%.4f,"
         "\"writer_ratio\":%.4f,\"minor_faults\":%ld",
         nt, n, pb / tp / 1e9, per, wbw / 1e9, ratio(wbw, L.w), faults);
    fflush(out);
  }
  kvt_test_rmtree(cache);
  bu_workload_free(&w);
}

/* ------------------------------------------------------------ main */

int main(int argc, char **argv) {
  const char *base = NULL;
  int quick = 0, json = 0;
  const char *sections = "size,count,conc";
  size_t toks[16], counts[16];
  int ntoks = 0, ncounts = 0;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--dir") && i + 1 < argc)
      base = argv[++i];
    else if (!strcmp(argv[i], "--quick"))
      quick = 1;
    else if (!strcmp(argv[i], "--json"))
      json = 1;
    else if (!strcmp(argv[i], "--no-fio"))
      use_fio = 0;
    else if (!strcmp(argv[i], "--depth") && i + 1 < argc)
      depth = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--sections") && i + 1 < argc)
      sections = argv[++i];
    else if (!strcmp(argv[i], "--tokens") && i + 1 < argc)
      ntoks = bu_parse_list(toks, 16, argv[++i]);
    else if (!strcmp(argv[i], "--counts") && i + 1 < argc)
      ncounts = bu_parse_list(counts, 16, argv[++i]);
    else {
      fprintf(stderr,
              "usage: %s [--dir DIR] [--quick] [--sections size,count,conc] "
              "[--tokens N,N..] [--counts N,N..] [--depth N] [--no-fio] "
              "[--json]\n",
              argv[0]);
      return 2;
    }
  }
  if (depth < 1 || depth > 256) {
    fprintf(stderr, "--depth must be 1..256\n");
    return 2;
  }
  if (!ntoks) {
    size_t d[4] = {256, 1024, 4096, 8192}, q[2] = {256, 1024};
    ntoks = quick ? 2 : 4;
    memcpy(toks, quick ? q : d, sizeof(size_t) * (size_t)ntoks);
  }
  if (!ncounts) {
    size_t d[3] = {100, 1000, 10000}, q[2] = {100, 1000};
    ncounts = quick ? 2 : 3;
    memcpy(counts, quick ? q : d, sizeof(size_t) * (size_t)ncounts);
  }
  for (int i = 0; i < ntoks; i++)
    if (toks[i] < 1 || toks[i] > 16384) {
      fprintf(stderr, "--tokens: 1..16384\n");
      return 2;
    }
  for (int i = 0; i < ncounts; i++)
    if (counts[i] < 1 || counts[i] > 200000 ||
        (i && counts[i] <= counts[i - 1])) {
      fprintf(stderr, "--counts: increasing, 1..200000\n");
      return 2;
    }
  out = json ? stderr : stdout;
  if (use_fio && !bu_have_fio()) {
    fprintf(stderr, "fio not found: limits unavailable (ratios 0)\n");
    use_fio = 0;
  }
  char *dir = bu_mkdtemp(base);
  if (!dir)
    return 1;
  char la0[64], la1[64];
  loadavg(la0, sizeof la0);
  if (!json)
    bu_header("bench_scale: how the issue-7 figures scale", dir);
  fprintf(out, "# load average at start: %s\n", la0);
  double t0 = bu_now();
  if (strstr(sections, "size"))
    section_size(dir, toks, ntoks, quick);
  if (strstr(sections, "count"))
    section_count(dir, counts, ncounts, quick);
  if (strstr(sections, "conc"))
    section_conc(dir, quick);
  loadavg(la1, sizeof la1);
  fprintf(out, "\n# load average at end: %s; run time %.0f s\n", la1,
          bu_now() - t0);
  if (json)
    printf("{\"program\":\"bench_scale\",\"quick\":%d,\"fio_depth\":%d,"
           "\"loadavg_start\":\"%s\",\"loadavg_end\":\"%s\",\"seconds\":%.1f,"
           "\"rows\":[%s]}\n",
           quick, depth, la0, la1, bu_now() - t0, jbuf ? jbuf : "");
  free(jbuf);
  kvt_test_rmtree(dir);
  free(dir);
  return 0;
}
