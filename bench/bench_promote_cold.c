/*
 * bench_promote_cold.c - the cold promote of one entry at a time against the
 * disk's own O_DIRECT read, per entry size (default 256, 1024 and 4096
 * Llama-3-8B-shaped fp16 tokens: 32, 128 and 512 MiB), through the public
 * API on the default options (the chunked store) with the host RAM tier off.
 * Per size, `--entries` entries are spilled durably once (each right after
 * fio's file of the same size is written); then each of
 * `--rounds` rounds runs, interleaved (fio first in even rounds, last in odd
 * ones, so a drift of the shared disk weighs on both alike):
 *   - fio: one O_DIRECT read job per entry, of a file of the entry's size,
 *     io_uring (libaio, psync where it is refused), at each `--depth`
 *     (default 8 and 32), three kinds of job: 1 MiB blocks into 4 KiB-page
 *     buffers, 1 MiB and 4 MiB blocks into transparent huge pages (glibc's
 *     tunable: kvtier's large buffers are huge pages too, and a virtio disk
 *     reads into them about twice as fast; 4 MiB at depth 32 is kvtier's
 *     bytes in flight); per entry, the fastest depth and kind's bytes over
 *     the jobs' summed times;
 *   - kvtier: every file of the cache (chunks/ and data/) fsynced and
 *     evicted from the page cache, the pages still cached counted with
 *     mincore, then kvt_tier_promote of each entry, timed one by one, every
 *     promoted tensor compared with what was spilled.
 * Then fio over kvtier's own chunk files after its promotes, and fio over
 * the n files in one job back to back - the way kvtier's pass reads, with no
 * pause in which the disk rests (a bursty disk reads faster after a pause;
 * separate fio runs give it one each). The round's limit is the fastest of
 * the three, and its ratio kvtier's bytes per second over that limit; the CPU
 * time the promotes took (with the data comparison) is printed next to it, as a
 * starved CPU on a loaded machine caps kvtier (hashing every block) and
 * not fio. Printed per
 * size: every round's figures, the median ratio and its spread, against the
 * target (0.95 of fio, no round below 0.85 of it); a figure above fio's or a
 * cold read that found more than 1% of its files cached is FLAGGED (it did
 * not measure the disk). fio's command lines are printed.
 *
 * bench_promote_cold [--tokens 256,1024,4096] [--rounds N] [--entries N]
 *                    [--depth N,N] [--dir DIR] [--quick] [--no-fio]
 */
#define _GNU_SOURCE
#include "benchutil.h"
#include "kvtier.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#define TARGET 0.95
#define FLOOR 0.85 /* of the target, for every round */
#define MAXR 16
#define MAXD 4

static int use_fio = 1;
static size_t depths[MAXD] = {8, 32};
static int ndepths = 2;
static char fio_engine[32];
static int all_exact = 1; /* every promoted tensor equal to what was spilled */

static void die(const char *what) {
  fprintf(stderr, "bench_promote_cold: %s: %s\n", what, kvt_last_error());
  exit(1);
}
#define API(call, what)                                                        \
  do {                                                                         \
    if ((call) < 0)                                                            \
      die(what);                                                               \
  } while (0)

/* One fio job with the first engine that works here (kept once found);
 * file may list several ("a:b:c"), read one after the other. */
static int fio_job(double *bw, const char *file, const char *rw, uint64_t size,
                   int depth, int huge, size_t bs) {
  static const char *engines[] = {"io_uring", "libaio", "psync"};
  for (int i = 0; i < 3; i++) {
    if (fio_engine[0] && strcmp(fio_engine, engines[i]) != 0)
      continue;
    bu_fio_job j = {file,
                    rw,
                    1,
                    bs,
                    size,
                    depth,
                    engines[i],
                    !strcmp(rw, "write"),
                    1,
                    1,
                    strchr(file, ':') ? "sequential" : NULL,
                    huge};
    if (bu_fio(bw, &j) == 0) {
      snprintf(fio_engine, sizeof fio_engine, "%s", engines[i]);
      return 0;
    }
  }
  return -1;
}

/* The kinds of fio read job each limit is measured with: 1 MiB blocks into
 * 4 KiB-page buffers (fio as is), 1 MiB blocks into huge-page buffers
 * (bu_fio_job.huge_buffers: kvtier's large buffers are huge pages), and
 * 4 MiB blocks into huge-page buffers. kvtier's chunked read hands the
 * kernel its 1 MiB requests four at a time into huge pages, so the disk
 * sees 4 MiB requests with up to 128 MiB in flight; fio at 1 MiB and depth
 * 32 keeps a quarter of that in flight, and on a disk that reads faster the
 * more it is given, that would be a limit kvtier can pass without the disk
 * being any faster. The 4 MiB kind at depth 32 is the same bytes in flight
 * as kvtier. */
#define NKINDS 3
static const struct {
  int huge;
  size_t bs;
  const char *name;
} kinds[NKINDS] = {{0, 1u << 20, "1 MiB blocks, 4 KiB-page buffers"},
                   {1, 1u << 20, "1 MiB blocks, huge-page buffers"},
                   {1, 4u << 20, "4 MiB blocks, huge-page buffers"}};

/* fio's limit for one round: per depth, the n files read one job each;
 * bytes over the summed job times; the fastest depth. kind: kinds[]. */
static double fio_read_limit(const char *base, int n, uint64_t size,
                             double *per_depth, int kind) {
  double best = 0;
  for (int d = 0; d < ndepths; d++) {
    double secs = 0;
    per_depth[d] = 0;
    for (int i = 0; i < n; i++) {
      char f[4300];
      snprintf(f, sizeof f, "%s.%d", base, i);
      double b = 0;
      if (fio_job(&b, f, "read", size, (int)depths[d], kinds[kind].huge,
                  kinds[kind].bs) != 0 ||
          b <= 0)
        return -1;
      secs += (double)size / b;
    }
    per_depth[d] = secs > 0 ? (double)size * n / secs : 0;
    if (per_depth[d] > best)
      best = per_depth[d];
  }
  return best;
}

/* The round's limit: fio_read_limit of every kind (per[kind]), the
 * fastest; -1 when fio cannot run. */
static double fio_limit(const char *base, int n, uint64_t size,
                        double per[NKINDS][MAXD]) {
  double best = 0;
  for (int h = 0; h < NKINDS; h++) {
    double b = fio_read_limit(base, n, size, per[h], h);
    if (b < 0)
      return -1;
    best = b > best ? b : best;
  }
  return best;
}

/* fio's read of the same n files in ONE job, back to back (as kvtier's pass
 * reads its entries: no pause between files in which the disk rests), the
 * fastest depth and buffers; one of the round's limits. 0 when it cannot
 * run. */
static double fio_one_job(const char *base, int n, uint64_t size) {
  static char list[8192];
  size_t used = 0;
  for (int i = 0; i < n; i++) {
    int w = snprintf(list + used, sizeof list - used, "%s%s.%d", i ? ":" : "",
                     base, i);
    if (w <= 0 || (size_t)w >= sizeof list - used || strchr(base, ':'))
      return 0;
    used += (size_t)w;
  }
  double best = 0;
  for (int h = 0; h < NKINDS; h++)
    for (int d = 0; d < ndepths; d++) {
      double b = 0;
      if (fio_job(&b, list, "read", size * (uint64_t)n, (int)depths[d],
                  kinds[h].huge, kinds[h].bs) == 0 &&
          b > best)
        best = b;
    }
  return best;
}

/* The chunk files of the cache (chunks/<kk>/<key>.kvc) as fio's file list
 * "a:b:c" into buf; *bytes receives their total size. 0, or -1 when there
 * are none or the list does not fit. */
static int chunk_list(const char *cache, char *buf, size_t cap,
                      uint64_t *bytes) {
  char top[4200];
  snprintf(top, sizeof top, "%s/chunks", cache);
  DIR *d = opendir(top);
  size_t used = 0;
  *bytes = 0;
  buf[0] = 0;
  int ok = d != NULL;
  struct dirent *de;
  while (ok && (de = readdir(d)) != NULL) {
    if (de->d_name[0] == '.')
      continue;
    char sub[4600];
    snprintf(sub, sizeof sub, "%.4200s/%.255s", top, de->d_name);
    DIR *s2 = opendir(sub);
    struct dirent *f;
    while (ok && s2 && (f = readdir(s2)) != NULL) {
      size_t l = strlen(f->d_name);
      if (l < 4 || strcmp(f->d_name + l - 4, ".kvc"))
        continue;
      char path[4900];
      struct stat st;
      int n = snprintf(path, sizeof path, "%.4600s/%.255s", sub, f->d_name);
      if (n <= 0 || strchr(path, ':') || lstat(path, &st) != 0 ||
          !S_ISREG(st.st_mode) || used + (size_t)n + 2 > cap) {
        ok = 0;
        break;
      }
      used += (size_t)snprintf(buf + used, cap - used, "%s%s", used ? ":" : "",
                               path);
      *bytes += (uint64_t)st.st_size;
    }
    if (s2)
      closedir(s2);
  }
  if (d)
    closedir(d);
  return ok && used > 0 ? 0 : -1;
}

/* fio over kvtier's own chunk files (the bytes the promotes just read, in
 * the same places on the disk): the fastest depth and buffers. */
static double fio_files_limit(const char *cache) {
  static char list[4000];
  uint64_t bytes = 0;
  if (chunk_list(cache, list, sizeof list, &bytes) != 0)
    return 0;
  double best = 0;
  for (int h = 0; h < NKINDS; h++)
    for (int d = 0; d < ndepths; d++) {
      double b = 0;
      if (fio_job(&b, list, "read", bytes, (int)depths[d], kinds[h].huge,
                  kinds[h].bs) == 0 &&
          b > best)
        best = b;
    }
  return best;
}

static kvt_tier *open_tier(const char *cache, uint64_t queue_bytes) {
  kvt_options o;
  kvt_options_init(&o, KVT_OPTIONS_VERSION);
  o.cache_dir = cache;
  o.host_cache_bytes = 0; /* the disk path: no RAM tier in front */
  o.max_size_gb = 64;
  o.spill_queue_bytes = queue_bytes;
  o.durability = KVT_DURABILITY_FSYNC;
  kvt_tier *t = NULL;
  API(kvt_tier_open(&t, &o), "kvt_tier_open");
  API(kvt_tier_start_writer(t), "kvt_tier_start_writer");
  return t;
}

/* Whether entry e holds exactly w's tensors. */
static int same(const kvt_entry *e, const bu_workload *w) {
  for (uint32_t L = 0; L < w->n_layers; L++) {
    const kvt_layer *l = kvt_entry_layer(e, L);
    if (!l || l->num_tensors != w->layers[L].num_tensors)
      return 0;
    for (uint32_t j = 0; j < l->num_tensors; j++)
      if (l->tensors[j].nbytes != w->layers[L].tensors[j].nbytes ||
          memcmp(l->tensors[j].data, w->layers[L].tensors[j].data,
                 (size_t)l->tensors[j].nbytes))
        return 0;
  }
  return 1;
}

/* CPU seconds (user + system) of the whole process so far: the promote
 * threads' too. */
static double cpu_now(void) {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 +
         (double)ru.ru_stime.tv_sec + ru.ru_stime.tv_usec / 1e6;
}

static int cmp_d(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* One entry size: its rounds and its line. */
static void one_size(const char *dir, size_t T, int n, int rounds) {
  bu_workload *w = calloc((size_t)n, sizeof *w);
  if (!w)
    die("out of memory");
  for (int i = 0; i < n; i++)
    bu_workload_make(&w[i], 32, 0, KVT_DTYPE_F16, 8, T, 128,
                     (int32_t)(T * 100 + (size_t)i * 7 + 1));
  uint64_t eb = w[0].bytes;
  char cache[4096], fbase[4096];
  snprintf(cache, sizeof cache, "%s/cache-%zu", dir, T);
  snprintf(fbase, sizeof fbase, "%s/fio-%zu.dat", dir, T);
  kvt_test_rmtree(cache);
  kvt_tier *t = open_tier(cache, eb * (uint64_t)(n + 1));
  /* fio's file i, then entry i: written alternately, so neither side's
   * data is the more recently written (a VM host may still cache what was
   * written last: fio reading a file written just before it can exceed the
   * device). */
  int have_fio = use_fio;
  for (int i = 0; i < n; i++) {
    if (have_fio) {
      char f[4300];
      snprintf(f, sizeof f, "%s.%d", fbase, i);
      double b;
      unlink(f);
      if (fio_job(&b, f, "write", eb, 8, 0, 1u << 20) != 0)
        have_fio = 0;
    }
    API(kvt_tier_spill(t, w[i].tokens, w[i].n_tokens, w[i].layers,
                       w[i].n_layers, w[i].bytes),
        "kvt_tier_spill");
    API(kvt_tier_flush(t, -1), "kvt_tier_flush");
  }
  kvt_stats st = KVT_STATS_INIT;
  API(kvt_tier_stats(&st, t), "kvt_tier_stats");
  if (st.write_failures) {
    fprintf(stderr, "bench_promote_cold: %llu spill(s) failed\n",
            (unsigned long long)st.write_failures);
    exit(1);
  }
  printf("\n## %zu tokens: %.0f MiB per entry, %d entries per round, %d "
         "rounds\n\n",
         T, eb / 1048576.0, n, rounds);
  if (have_fio) {
    printf("fio per entry and round, each depth:\n  fio --name=kvtbench "
           "--filename=%s.<i> --rw=read --bs=<1048576|4194304> --size=%llu "
           "--direct=1 --ioengine=%s --iodepth=<",
           fbase, (unsigned long long)eb, fio_engine);
    for (int d = 0; d < ndepths; d++)
      printf("%s%zu", d ? "|" : "", depths[d]);
    printf("> --end_fsync=0 --invalidate=1 --numjobs=1 "
           "--output-format=json\n  run three ways: 1 MiB blocks as is "
           "(fio's buffers in 4 KiB pages); 1 MiB and 4 MiB blocks with "
           "GLIBC_TUNABLES=glibc.malloc.hugetlb=1 in its environment (its "
           "buffers in transparent huge pages, as kvtier's are; 4 MiB at "
           "depth 32 keeps kvtier's 128 MiB in flight)\n  fio per entry = "
           "the fastest depth and kind's %d "
           "x %llu bytes over its jobs' summed times\n"
           "and, after kvtier's promotes, fio over kvtier's own chunk files "
           "(--filename=<file>:<file>:... --file_service_type=sequential, "
           "same parameters, fastest depth and kind): the same bytes in the "
           "same places on the disk\n"
           "and fio over the %d files in one job, back to back "
           "(--file_service_type=sequential, fastest depth and kind), as "
           "kvtier's pass reads its entries without a pause\n"
           "limit = the fastest of the three\n\n",
           n, (unsigned long long)eb, n);
  }
  printf("| round | order | kvtier cold GB/s | ms/entry | CPU ms/entry");
  for (int h = 0; h < NKINDS; h++) {
    printf(" | fio GB/s, %s (", kinds[h].name);
    for (int d = 0; d < ndepths; d++)
      printf("%sdepth %zu", d ? ", " : "", depths[d]);
    printf(")");
  }
  printf(
      " | fio per entry (faster kind) | fio on kvtier's files GB/s | fio one "
      "job GB/s | limit (the fastest fio) | ratio | resident at read | note "
      "|\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  double ratio[MAXR], kv[MAXR], lim[MAXR], own[MAXR], one[MAXR];
  int flagged = 0, exact = 1, k;
  for (k = 0; k < rounds; k++) {
    double perd[NKINDS][MAXD] = {{0}}, perd2[NKINDS][MAXD] = {{0}};
    int fio_first = k % 2 == 0;
    lim[k] = 0;
    if (have_fio && fio_first && (lim[k] = fio_limit(fbase, n, eb, perd)) < 0)
      have_fio = 0, lim[k] = 0;
    bu_residency res = {0};
    char sub[4200];
    snprintf(sub, sizeof sub, "%s/chunks", cache);
    bu_evict_tree(sub, &res);
    snprintf(sub, sizeof sub, "%s/data", cache);
    bu_evict_tree(sub, &res);
    double resident = bu_resident_after(&res);
    double busy = 0, cpu0 = cpu_now();
    uint64_t bytes = 0;
    for (int i = 0; i < n; i++) {
      kvt_entry *e = NULL;
      double t0 = bu_now();
      API(kvt_tier_promote(&e, t, w[i].tokens, w[i].n_tokens, NULL),
          "kvt_tier_promote");
      busy += bu_now() - t0;
      bytes += kvt_entry_disk_bytes(e);
      if (!same(e, &w[i]))
        exact = 0;
      kvt_entry_free(e);
    }
    double cpu = cpu_now() - cpu0; /* includes the comparisons */
    if (have_fio && !fio_first) {
      if ((lim[k] = fio_limit(fbase, n, eb, perd2)) < 0)
        have_fio = 0, lim[k] = 0;
      memcpy(perd, perd2, sizeof perd);
    }
    own[k] = have_fio ? fio_files_limit(cache) : 0;
    one[k] = have_fio ? fio_one_job(fbase, n, eb) : 0;
    /* The limit is the fastest fio read of the round: fio over kvtier's
     * own files, or over the n files in one job, reads the same bytes with
     * less of fio's per-job start in the timing (a 32 MiB job is ~20 ms). */
    double per_entry = lim[k];
    if (own[k] > lim[k])
      lim[k] = own[k];
    if (one[k] > lim[k])
      lim[k] = one[k];
    kv[k] = busy > 0 ? (double)bytes / busy : 0;
    ratio[k] = lim[k] > 0 ? kv[k] / lim[k] : 0;
    unsigned fl = bu_figure_flags(kv[k], lim[k], resident);
    flagged |= fl != 0;
    printf("| %d | %s | %.2f | %.1f | %.1f | ", k + 1,
           fio_first ? "fio, kvtier" : "kvtier, fio", kv[k] / 1e9,
           busy / n * 1e3, cpu / n * 1e3);
    for (int h = 0; h < NKINDS; h++) {
      for (int d = 0; d < ndepths; d++)
        printf("%s%.2f", d ? ", " : "", perd[h][d] / 1e9);
      printf(" | ");
    }
    printf("%.2f | %.2f | %.2f | %.2f | %.3f | %.2f%% (%llu files) | %s |\n",
           per_entry / 1e9, own[k] / 1e9, one[k] / 1e9, lim[k] / 1e9, ratio[k],
           resident * 100, (unsigned long long)res.files,
           fl ? bu_figure_flag_text(fl) : "");
    fflush(stdout);
  }
  API(kvt_tier_close(t, -1), "kvt_tier_close");
  kvt_tier_free(t);
  kvt_test_rmtree(cache);
  for (int i = 0; i < n; i++) {
    char f[4300];
    snprintf(f, sizeof f, "%s.%d", fbase, i);
    unlink(f);
    bu_workload_free(&w[i]);
  }
  free(w);
  all_exact &= exact;
  double sorted[MAXR];
  memcpy(sorted, ratio, sizeof(double) * (size_t)k);
  qsort(sorted, (size_t)k, sizeof *sorted, cmp_d);
  double med = k % 2 ? sorted[k / 2] : (sorted[k / 2 - 1] + sorted[k / 2]) / 2;
  double lo = sorted[0], hi = sorted[k - 1];
  double kvm = bu_median(kv, k), limm = bu_median(lim, k),
         ownm = bu_median(own, k), onem = bu_median(one, k);
  int pass =
      have_fio && exact && !flagged && med >= TARGET && lo >= FLOOR * TARGET;
  printf("\n%zu tokens: cold promote %.2f GB/s (median), fio O_DIRECT read "
         "%.2f GB/s (on kvtier's own files %.2f, in one job %.2f); ratio "
         "median %.3f, spread "
         "%.3f..%.3f over %d rounds (target >= %.2f, every round >= %.3f); "
         "data %s -> %s\n",
         T, kvm / 1e9, limm / 1e9, ownm / 1e9, onem / 1e9, med, lo, hi, k,
         TARGET, FLOOR * TARGET, exact ? "bit-exact" : "DIFFERS",
         !have_fio ? "no fio (no verdict)"
         : !exact  ? "FAIL"
         : flagged ? "FLAGGED (not the disk)"
         : pass    ? "PASS"
                   : "MISS");
}

int main(int argc, char **argv) {
  size_t toks[8] = {256, 1024, 4096};
  int ntoks = 3, rounds = 5, entries = 0, quick = 0;
  const char *base = NULL;
  char cmd[2048] = ""; /* before the lists are parsed (in place) */
  for (int i = 0; i < argc; i++)
    snprintf(cmd + strlen(cmd), sizeof cmd - strlen(cmd), "%s%s", i ? " " : "",
             argv[i]);
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--tokens") && i + 1 < argc)
      ntoks = bu_parse_list(toks, 8, argv[++i]);
    else if (!strcmp(argv[i], "--rounds") && i + 1 < argc)
      rounds = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--entries") && i + 1 < argc)
      entries = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--depth") && i + 1 < argc)
      ndepths = bu_parse_list(depths, MAXD, argv[++i]);
    else if (!strcmp(argv[i], "--dir") && i + 1 < argc)
      base = argv[++i];
    else if (!strcmp(argv[i], "--quick"))
      quick = 1;
    else if (!strcmp(argv[i], "--no-fio"))
      use_fio = 0;
    else {
      fprintf(stderr, "usage: bench_promote_cold [--tokens N,N..] [--rounds N] "
                      "[--entries N] [--depth N,N] [--dir DIR] [--quick] "
                      "[--no-fio]\n");
      return 2;
    }
  }
  if (quick && rounds == 5)
    rounds = 1;
  if (rounds < 1 || rounds > MAXR || ntoks < 1 || ndepths < 1) {
    fprintf(stderr,
            "bench_promote_cold: rounds 1..%d, sizes and depths "
            "needed\n",
            MAXR);
    return 2;
  }
  if (use_fio && !bu_have_fio()) {
    fprintf(stderr, "fio not found: no limits, no verdicts\n");
    use_fio = 0;
  }
  char *dir = bu_mkdtemp(base);
  if (!dir)
    die("scratch directory");
  bu_header("bench_promote_cold: per-entry cold promote vs fio O_DIRECT "
            "read (1 MiB blocks)",
            dir);
  printf("command: %s\n", cmd);
  for (int s = 0; s < ntoks; s++) {
    size_t T = toks[s];
    int n = entries > 0 ? entries : T >= 4096 ? 1 : T >= 1024 ? 2 : 4;
    if (quick && entries <= 0)
      n = 1;
    one_size(dir, T, n, rounds);
  }
  kvt_test_rmtree(dir);
  free(dir);
  return all_exact ? 0 : 1; /* a MISS is a figure, wrong data an error */
}
