/*
 * cmd_bench.c - `kvtier bench`, every user's first run: spills a realistic,
 * seeded synthetic workload (model-shaped KV, hybrid KV + Mamba arrays, or
 * 4-bit quantized KV) into a cache directory, then promotes it back warm (page
 * cache hot) and cold (the entry files evicted from the page cache with
 * fsync + posix_fadvise(POSIX_FADV_DONTNEED), which works without root), and
 * times exact and prefix lookups. The disk's own sequential limits are
 * measured in the same run (disk.c) so each figure is printed next to the
 * hardware limit it should be judged against. Every promoted tensor is
 * compared with what was spilled (bit-exact where the storage mode keeps the
 * dtype), so a fast but wrong run cannot pass unnoticed.
 *
 * Memory stays bounded: all entries' tensors point into one shared random
 * pool (each entry at a different offset), at most a few spills are in
 * flight, and each promoted entry is freed before the next promote.
 */
#define _GNU_SOURCE
#include "cli.h"
#include "disk.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

static const char *BENCH_HELP =
    "usage: kvtier bench [DIR] [--preset NAME] [--entries N] [--tokens N]\n"
    "                    [--dtype f16|bf16|f32] [--storage native|compat]\n"
    "                    [--durability fsync|none] [--quick] [--keep]\n"
    "                    [--seed N] [--disk-size SIZE] [--no-disk]\n"
    "                    [--cold drop-caches] [--no-progress] [--json]\n"
    "\n"
    "Spills a synthetic workload of model-shaped entries into DIR, promotes\n"
    "it back warm and cold, times lookups, measures the disk's own limits\n"
    "and prints each figure with its ratio to the hardware limit.\n"
    "\n"
    "  DIR               cache directory to use (created if missing). "
    "Default:\n"
    "                    a fresh directory under $TMPDIR (else /var/tmp),\n"
    "                    removed afterwards unless --keep. In an existing\n"
    "                    cache only the bench's own entries are added (and\n"
    "                    removed afterwards unless --keep).\n"
    "  --preset NAME     llama3-8b (default): 32 KV layers, 8 KV heads, head\n"
    "                      dim 128\n"
    "                    hybrid: 32 layers, every 4th KV (8 heads x 128), the\n"
    "                      others Mamba arrays (conv [1,3,8192], ssm\n"
    "                      [1,8192,16] F32)\n"
    "                    quantized: llama3-8b shape, 4-bit quantized KV with\n"
    "                      group_size 64 (packed U32 + scales + biases)\n"
    "  --entries N       entries to spill (default 8; --quick 4)\n"
    "  --tokens N        tokens per entry (default 2048; --quick 1024)\n"
    "  --dtype D         f16 (default), bf16 or f32\n"
    "  --storage M       native (default, lossless) or compat (what the\n"
    "                    reference writes and reads)\n"
    "  --durability D    fsync (default: durable) or none\n"
    "  --quick           tiny run for a first look or CI (seconds)\n"
    "  --keep            keep the directory and the entries\n"
    "  --seed N          workload seed (default 1)\n"
    "  --disk-size SIZE  bytes per disk measurement job (default 1G; --quick\n"
    "                    256M)\n"
    "  --no-disk         skip the disk measurement (no ratios)\n"
    "  --cold drop-caches  make the cold run drop the whole page cache\n"
    "                    (root only) instead of evicting the entry files\n"
    "  --no-progress     never draw progress bars\n"
    "  --json            JSON output\n"
    "\n"
    "Throughputs are decimal (1 GB/s = 1e9 bytes/s) over bytes on disk.\n";

/* ---- the workload ---- */

typedef struct bench_cfg {
  const char *preset;
  int entries, tokens;
  kvt_dtype dtype;
  int storage, durability;
  int quick, keep, json, progress, no_disk, drop_caches;
  uint64_t seed, disk_size;
} bench_cfg;

typedef struct workload {
  uint32_t n_layers;
  kvt_layer *layers;   /* per entry, re-pointed into the pool */
  kvt_tensor *tensors; /* all tensors of one entry, layers point in here */
  uint32_t n_tensors;
  uint64_t entry_bytes; /* RAM size of one entry's layers = memory_bytes */
  unsigned char *pool;
  uint64_t pool_bytes;
  int32_t **tokens;  /* per entry */
  int32_t **queries; /* per entry: tokens + 16 more, for prefix lookups */
  char (*hashes)[KVT_HASH_HEX_LEN + 1];
  uint32_t kinds[5];
} workload;

static uint64_t rng_next(uint64_t *s) { /* splitmix64 */
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static void set_tensor(kvt_tensor *t, kvt_dtype dt, uint32_t ndim,
                       const int64_t *shape) {
  memset(t, 0, sizeof *t);
  t->dtype = dt;
  t->ndim = ndim;
  uint64_t n = 1;
  for (uint32_t i = 0; i < ndim; i++) {
    t->shape[i] = shape[i];
    n *= (uint64_t)shape[i];
  }
  t->nbytes = n * kvt_dtype_size(dt);
}

/* Builds one entry's layer descriptors (data pointers set per entry). */
static int build_layout(workload *w, const bench_cfg *c) {
  const int64_t T = c->tokens, H = 8, D = 128;
  int hybrid = strcmp(c->preset, "hybrid") == 0;
  int quant = strcmp(c->preset, "quantized") == 0;
  w->n_layers = 32;
  w->layers = calloc(w->n_layers, sizeof *w->layers);
  w->tensors = calloc((size_t)w->n_layers * 6, sizeof *w->tensors);
  if (!w->layers || !w->tensors)
    return -1;
  uint32_t ti = 0;
  for (uint32_t l = 0; l < w->n_layers; l++) {
    kvt_layer *L = &w->layers[l];
    kvt_tensor *t = &w->tensors[ti];
    if (quant) {
      kvt_layer_init(L, KVT_LAYER_QUANTIZED_KV);
      L->bits = 4;
      L->group_size = 64;
      int64_t packed[4] = {1, H, T, D * 4 / 32};
      int64_t groups[4] = {1, H, T, D / 64};
      for (int kv = 0; kv < 2; kv++) {
        set_tensor(&t[kv * 3 + 0], KVT_DTYPE_U32, 4, packed);
        set_tensor(&t[kv * 3 + 1], c->dtype, 4, groups);
        set_tensor(&t[kv * 3 + 2], c->dtype, 4, groups);
      }
      L->num_tensors = 6;
      L->offset = T;
    } else if (hybrid && l % 4 != 3) {
      kvt_layer_init(L, KVT_LAYER_ARRAYS);
      int64_t conv[3] = {1, 3, 8192};
      int64_t ssm[3] = {1, 8192, 16};
      set_tensor(&t[0], c->dtype, 3, conv);
      set_tensor(&t[1], KVT_DTYPE_F32, 3, ssm);
      L->num_tensors = 2;
    } else {
      kvt_layer_init(L, KVT_LAYER_KV);
      int64_t shape[4] = {1, H, T, D};
      set_tensor(&t[0], c->dtype, 4, shape);
      set_tensor(&t[1], c->dtype, 4, shape);
      L->num_tensors = 2;
      L->offset = T;
    }
    L->tensors = t;
    ti += L->num_tensors;
    w->kinds[L->kind]++;
  }
  w->n_tensors = ti;
  w->entry_bytes = 0;
  for (uint32_t i = 0; i < ti; i++)
    w->entry_bytes += w->tensors[i].nbytes;
  return 0;
}

/* Offset of entry e's data in the pool: entries differ in content. */
static uint64_t entry_base(int e) {
  return (uint64_t)(e % 256) * 4096;
}

static void point_entry(workload *w, int e) {
  unsigned char *p = w->pool + entry_base(e);
  for (uint32_t i = 0; i < w->n_tensors; i++) {
    w->tensors[i].data = p;
    p += (w->tensors[i].nbytes + 63) / 64 * 64;
  }
}

static int build_workload(workload *w, const bench_cfg *c) {
  memset(w, 0, sizeof *w);
  if (build_layout(w, c) != 0)
    return -1;
  uint64_t span = 0;
  for (uint32_t i = 0; i < w->n_tensors; i++)
    span += (w->tensors[i].nbytes + 63) / 64 * 64;
  w->pool_bytes = span + 256 * 4096;
  w->pool = malloc(w->pool_bytes);
  w->tokens = calloc((size_t)c->entries, sizeof *w->tokens);
  w->queries = calloc((size_t)c->entries, sizeof *w->queries);
  w->hashes = calloc((size_t)c->entries, sizeof *w->hashes);
  if (!w->pool || !w->tokens || !w->queries || !w->hashes)
    return -1;
  uint64_t s = c->seed * 0x2545F4914F6CDD1Dull + 17;
  /* Random bits, but F16/BF16/F32 values kept finite and plausible: the top
   * bits of each 16-bit word are cleared so no NaN/Inf patterns appear
   * (values round-trip bit-exactly either way; this keeps compat mode's
   * conversions meaningful). */
  for (uint64_t i = 0; i + 8 <= w->pool_bytes; i += 8) {
    uint64_t v = rng_next(&s) & 0x3FFF3FFF3FFF3FFFull;
    memcpy(w->pool + i, &v, 8);
  }
  /* Tokens: every entry starts with the same "system prompt" (a quarter of
   * the tokens, at most 512), then its own conversation, so prefix lookups
   * see many candidates sharing the first 16 tokens, as in serving. */
  int sys = c->tokens / 4 > 512 ? 512 : c->tokens / 4;
  uint64_t ts = c->seed * 7919 + 3;
  int32_t *sysp = malloc(sizeof(int32_t) * (size_t)(sys ? sys : 1));
  if (!sysp)
    return -1;
  for (int i = 0; i < sys; i++)
    sysp[i] = (int32_t)(rng_next(&ts) % 128256);
  for (int e = 0; e < c->entries; e++) {
    w->tokens[e] = malloc(sizeof(int32_t) * (size_t)c->tokens);
    w->queries[e] = malloc(sizeof(int32_t) * ((size_t)c->tokens + 16));
    if (!w->tokens[e] || !w->queries[e]) {
      free(sysp);
      return -1;
    }
    memcpy(w->tokens[e], sysp, sizeof(int32_t) * (size_t)sys);
    for (int i = sys; i < c->tokens; i++)
      w->tokens[e][i] = (int32_t)(rng_next(&ts) % 128256);
    memcpy(w->queries[e], w->tokens[e], sizeof(int32_t) * (size_t)c->tokens);
    for (int i = 0; i < 16; i++)
      w->queries[e][c->tokens + i] = (int32_t)(rng_next(&ts) % 128256);
    kvt_token_hash(w->hashes[e], w->tokens[e], (size_t)c->tokens);
  }
  free(sysp);
  return 0;
}

static void free_workload(workload *w, int entries) {
  for (int e = 0; w->tokens && e < entries; e++) {
    free(w->tokens[e]);
    free(w->queries[e]);
  }
  free(w->tokens);
  free(w->queries);
  free(w->hashes);
  free(w->pool);
  free(w->layers);
  free(w->tensors);
}

/* ---- statistics ---- */

static int cmp_dbl(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* Nearest-rank percentile of v[0..n) (sorted in place). */
static double pct(double *v, size_t n, double q) {
  if (n == 0)
    return 0;
  cli_qsort(v, n, sizeof *v, cmp_dbl);
  size_t k = (size_t)ceil(q * (double)n);
  if (k < 1)
    k = 1;
  if (k > n)
    k = n;
  return v[k - 1];
}

/* ---- spill completion tracking ---- */

typedef struct spill_track {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  uint64_t done, failed;
  double *done_t; /* completion time of the i-th spill (FIFO writer) */
  uint64_t cap;
  char err[512];
} spill_track;

static void on_spill_done(void *ctx, const char *hash, int status) {
  spill_track *s = ctx;
  double now = cli_mono();
  pthread_mutex_lock(&s->mu);
  if (s->done < s->cap)
    s->done_t[s->done] = now;
  s->done++;
  if (status != 0) {
    s->failed++;
    snprintf(s->err, sizeof s->err, "entry %.16s: %s", hash,
             kvt_strerror(status));
  }
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
}

static void wait_done_at_least(spill_track *s, uint64_t n) {
  pthread_mutex_lock(&s->mu);
  while (s->done < n)
    pthread_cond_wait(&s->cv, &s->mu);
  pthread_mutex_unlock(&s->mu);
}

static void log_warn(void *ctx, int level, const char *msg) {
  (void)ctx;
  fprintf(stderr, "kvtier: %s: %s\n",
          level >= KVT_LOG_ERROR ? "error" : "warning", msg);
}

/* ---- page cache eviction ------------------------------------------------- */

/* Evicts every file of data/<hash>/ from the page cache; returns the
 * fraction of its pages still resident afterwards (mincore), or -1. */
static double evict_entry(const char *dir, const char *hash) {
  char d[4200];
  snprintf(d, sizeof d, "%s/data/%s", dir, hash);
  DIR *dp = opendir(d);
  if (!dp)
    return -1;
  uint64_t pages = 0, resident = 0;
  long psz = sysconf(_SC_PAGESIZE);
  struct dirent *de;
  while ((de = readdir(dp)) != NULL) {
    if (de->d_name[0] == '.')
      continue;
    char p[4500];
    snprintf(p, sizeof p, "%s/%s", d, de->d_name);
    int fd = open(p, O_RDONLY | O_NOFOLLOW | O_NONBLOCK); /* never a FIFO */
    if (fd < 0)
      continue;
    struct stat st;
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) {
      fdatasync(fd); /* dirty pages cannot be dropped */
      posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
      if (st.st_size > 0) {
        void *m = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
        if (m != MAP_FAILED) {
          size_t np = ((size_t)st.st_size + (size_t)psz - 1) / (size_t)psz;
          unsigned char *vec = malloc(np);
          if (vec && mincore(m, (size_t)st.st_size, vec) == 0) {
            for (size_t i = 0; i < np; i++)
              resident += vec[i] & 1;
            pages += np;
          }
          free(vec);
          munmap(m, (size_t)st.st_size);
        }
      }
    }
    close(fd);
  }
  fsync(dirfd(dp));
  closedir(dp);
  return pages ? (double)resident / (double)pages : 0;
}

static int drop_all_caches(void) {
  sync();
  int fd = open("/proc/sys/vm/drop_caches", O_WRONLY);
  if (fd < 0)
    return -1;
  int ok = write(fd, "1\n", 2) == 2;
  close(fd);
  return ok ? 0 : -1;
}

/* ---- verification of promoted data ---- */

typedef struct verify_count {
  uint64_t exact, skipped, mismatched;
  char first_bad[256];
} verify_count;

static void verify_entry(verify_count *vc, workload *w, int e,
                         const kvt_entry *ent) {
  point_entry(w, e);
  uint32_t nl = kvt_entry_num_layers(ent);
  if (nl != w->n_layers) {
    vc->mismatched++;
    snprintf(vc->first_bad, sizeof vc->first_bad,
             "entry %d: %u layers promoted, %u spilled", e, nl, w->n_layers);
    return;
  }
  for (uint32_t l = 0; l < nl; l++) {
    const kvt_layer *got = kvt_entry_layer(ent, l);
    const kvt_layer *want = &w->layers[l];
    if (!got || got->num_tensors != want->num_tensors) {
      vc->skipped += want->num_tensors; /* compat dequantized the layer */
      continue;
    }
    for (uint32_t j = 0; j < got->num_tensors; j++) {
      const kvt_tensor *a = &got->tensors[j], *b = &want->tensors[j];
      if (a->dtype != b->dtype || a->nbytes != b->nbytes) {
        vc->skipped++; /* converted by compat mode (e.g. bf16 -> F32) */
        continue;
      }
      if (memcmp(a->data, b->data, b->nbytes) == 0) {
        vc->exact++;
      } else {
        if (!vc->mismatched)
          snprintf(vc->first_bad, sizeof vc->first_bad,
                   "entry %d layer %u tensor %u differs from what was "
                   "spilled",
                   e, l, j);
        vc->mismatched++;
      }
    }
  }
}

/* ---- the command ---- */

/* Set by SIGINT/SIGTERM: the bench stops at the next step and still cleans
 * up its directory (a killed bench must not leave gigabytes in /var/tmp). */
static volatile sig_atomic_t interrupted;

static void on_signal(int sig) {
  (void)sig;
  interrupted = 1;
}

/* An empty directory, or one holding index.db or data/. */
static int looks_like_cache(const char *dir) {
  DIR *d = opendir(dir);
  if (!d)
    return 0;
  int n = 0, cache = 0;
  struct dirent *de;
  while ((de = readdir(d)) != NULL) {
    if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0)
      continue;
    n++;
    if (strcmp(de->d_name, "index.db") == 0 || strcmp(de->d_name, "data") == 0)
      cache = 1;
  }
  closedir(d);
  return n == 0 || cache;
}

/* Ends the run with exit code CODE and a printf-style message: the progress
 * bar (if any) is erased, then everything is cleaned up at `out`. */
#define END_RUN(CODE, ...)                                                     \
  do {                                                                         \
    code = (CODE);                                                             \
    snprintf(fail, sizeof fail, __VA_ARGS__);                                  \
    cli_progress_end(&pg);                                                     \
    goto out;                                                                  \
  } while (0)

#define CHECK_INTERRUPT()                                                      \
  do {                                                                         \
    if (interrupted)                                                           \
      END_RUN(CLI_INTERRUPTED, "interrupted; cleaned up");                     \
  } while (0)

typedef struct phase {
  uint64_t count, bytes;
  double seconds; /* sum of per-operation times */
  double p50, p99;
} phase;

static cJSON *phase_json(const phase *p, double limit, const char *limit_name,
                         int ms) {
  cJSON *o = cJSON_CreateObject();
  cJSON_AddNumberToObject(o, "count", (double)p->count);
  cJSON_AddNumberToObject(o, "bytes", (double)p->bytes);
  cJSON_AddNumberToObject(o, "seconds", p->seconds);
  double bps = p->seconds > 0 ? (double)p->bytes / p->seconds : 0;
  if (p->bytes)
    cJSON_AddNumberToObject(o, "bytes_per_second", bps);
  cJSON_AddNumberToObject(o, ms ? "p50_ms" : "p50_us",
                          ms ? p->p50 * 1e3 : p->p50 * 1e6);
  cJSON_AddNumberToObject(o, ms ? "p99_ms" : "p99_us",
                          ms ? p->p99 * 1e3 : p->p99 * 1e6);
  if (limit > 0 && p->bytes) {
    cJSON_AddNumberToObject(o, "ratio", bps / limit);
    cJSON_AddStringToObject(o, "ratio_of", limit_name);
  }
  return o;
}

/* One row of the text report: NAME, VALUE, the phase's p50 and p99 (in ms,
 * or in us when !ms; "-" without a phase) and the comparison VS. */
static void report_row(cli_table *tb, const char *name, const char *value,
                       const phase *p, int ms, const char *vs) {
  char p50[48] = "-", p99[48] = "-";
  if (p && ms) {
    snprintf(p50, sizeof p50, "%.2f ms", p->p50 * 1e3);
    snprintf(p99, sizeof p99, "%.2f ms", p->p99 * 1e3);
  } else if (p) {
    snprintf(p50, sizeof p50, "%.1f us", p->p50 * 1e6);
    snprintf(p99, sizeof p99, "%.1f us", p->p99 * 1e6);
  }
  const char *row[5] = {name, value, p50, p99, vs};
  cli_table_add(tb, row);
}

/* p50/p99 of p from its n latencies in lat (sorted in place). */
static void phase_percentiles(phase *p, double *lat, size_t n) {
  p->p50 = pct(lat, n, 0.5);
  p->p99 = pct(lat, n, 0.99);
}

/* One timed promote of entry e, counted in p (latency into lat[p->count]);
 * the data is verified and freed outside the timed region. Returns 0 or the
 * library's error code. */
static int timed_promote(phase *p, double *lat, verify_count *vc, kvt_tier *t,
                         workload *w, const bench_cfg *c, int e) {
  kvt_entry *ent = NULL;
  double t0 = cli_mono();
  int rc = kvt_tier_promote(&ent, t, w->tokens[e], (size_t)c->tokens, NULL);
  double dt = cli_mono() - t0;
  if (rc != 0)
    return rc;
  lat[p->count++] = dt;
  p->seconds += dt;
  p->bytes += kvt_entry_disk_bytes(ent);
  verify_entry(vc, w, e, ent);
  kvt_entry_free(ent);
  return 0;
}

int cmd_bench(int argc, char **argv) {
  cli_flag f[] = {{"json", 0},        {"preset", 1},    {"entries", 1},
                  {"tokens", 1},      {"dtype", 1},     {"storage", 1},
                  {"durability", 1},  {"quick", 0},     {"keep", 0},
                  {"seed", 1},        {"disk-size", 1}, {"no-disk", 0},
                  {"no-progress", 0}, {"cold", 1},      {"verbose", 0}};
  const size_t nf = sizeof f / sizeof f[0];
  const char *pos[1] = {NULL};
  int rc = cli_begin("bench", BENCH_HELP, NULL, argc, argv, f, nf, pos, 0, 1);
  if (rc != CLI_RUN)
    return rc;
  bench_cfg c;
  memset(&c, 0, sizeof c);
  c.json = cli_flag_get(f, nf, "json")->set;
  c.quick = cli_flag_get(f, nf, "quick")->set;
  c.keep = cli_flag_get(f, nf, "keep")->set;
  c.no_disk = cli_flag_get(f, nf, "no-disk")->set;
  c.progress = !cli_flag_get(f, nf, "no-progress")->set;
  c.preset = "llama3-8b";
  c.entries = c.quick ? 4 : 8;
  c.tokens = c.quick ? 1024 : 2048; /* issue 7: entries of 1-8k tokens */
  c.dtype = KVT_DTYPE_F16;
  c.storage = KVT_STORAGE_NATIVE;
  c.durability = KVT_DURABILITY_FSYNC;
  c.seed = 1;
  c.disk_size = c.quick ? (256ull << 20) : (1ull << 30);
  const char *v;
  int json = c.json;
  if ((v = cli_flag_get(f, nf, "preset")->value)) {
    if (strcmp(v, "llama3-8b") && strcmp(v, "hybrid") && strcmp(v, "quantized"))
      return cli_fail(json, "bench", CLI_USAGE,
                      "unknown preset '%s' (llama3-8b, hybrid, quantized)", v);
    c.preset = v;
  }
  uint64_t u;
  if ((v = cli_flag_get(f, nf, "entries")->value)) {
    if (cli_parse_u64(v, &u) != 0 || u < 1 || u > 100000)
      return cli_fail(json, "bench", CLI_USAGE,
                      "--entries needs 1..100000, got '%s'", v);
    c.entries = (int)u;
  }
  if ((v = cli_flag_get(f, nf, "tokens")->value)) {
    if (cli_parse_u64(v, &u) != 0 || u < 1 || u > 1000000)
      return cli_fail(json, "bench", CLI_USAGE,
                      "--tokens needs 1..1000000, got '%s'", v);
    c.tokens = (int)u;
  }
  static const cli_choice dtypes[] = {{"f16", KVT_DTYPE_F16},
                                      {"fp16", KVT_DTYPE_F16},
                                      {"bf16", KVT_DTYPE_BF16},
                                      {"f32", KVT_DTYPE_F32},
                                      {"fp32", KVT_DTYPE_F32}};
  static const cli_choice storages[] = {{"native", KVT_STORAGE_NATIVE},
                                        {"compat", KVT_STORAGE_COMPAT}};
  static const cli_choice durabilities[] = {{"fsync", KVT_DURABILITY_FSYNC},
                                            {"none", KVT_DURABILITY_NONE}};
  static const cli_choice colds[] = {{"fadvise", 0}, {"drop-caches", 1}};
  int dtype = (int)c.dtype;
  if ((rc = cli_flag_choice(f, nf, "dtype", dtypes, 5, "f16, bf16 or f32", json,
                            "bench", &dtype)) ||
      (rc = cli_flag_choice(f, nf, "storage", storages, 2, "native or compat",
                            json, "bench", &c.storage)) ||
      (rc = cli_flag_choice(f, nf, "durability", durabilities, 2,
                            "fsync or none", json, "bench", &c.durability)))
    return rc;
  c.dtype = (kvt_dtype)dtype;
  if ((v = cli_flag_get(f, nf, "seed")->value)) {
    if (cli_parse_u64(v, &c.seed) != 0)
      return cli_fail(json, "bench", CLI_USAGE, "--seed needs a number");
  }
  if ((v = cli_flag_get(f, nf, "disk-size")->value)) {
    if (cli_parse_size(v, &c.disk_size) != 0 || c.disk_size < (1u << 20))
      return cli_fail(json, "bench", CLI_USAGE,
                      "--disk-size needs a size >= 1M like 512M, got '%s'", v);
  }
  if ((rc = cli_flag_choice(f, nf, "cold", colds, 2, "fadvise or drop-caches",
                            json, "bench", &c.drop_caches)) != 0)
    return rc;
  if (c.drop_caches && geteuid() != 0)
    return cli_fail(json, "bench", CLI_USAGE, "--cold drop-caches needs root");

  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);

  /* ---- the directory ---- */
  char dir[4096];
  int remove_dir = 0, created = 0;
  if (pos[0]) {
    snprintf(dir, sizeof dir, "%s", pos[0]);
    struct stat st;
    if (stat(dir, &st) != 0) {
      if (errno != ENOENT || mkdir(dir, 0700) != 0)
        return cli_fail(json, "bench", CLI_NOOPEN, "%s: cannot create: %s", dir,
                        strerror(errno));
      created = 1;
      remove_dir = !c.keep;
    } else if (!S_ISDIR(st.st_mode)) {
      return cli_fail(json, "bench", CLI_NOOPEN, "%s: not a directory", dir);
    } else if (!looks_like_cache(dir)) {
      /* Never scatter index.db and data/ into someone's own directory. */
      return cli_fail(json, "bench", CLI_NOOPEN,
                      "%s: not empty and not a kvtier cache directory; give a "
                      "new or empty directory, or an existing cache",
                      dir);
    }
  } else {
    const char *base = getenv("TMPDIR");
    if (!base || !*base)
      base = "/var/tmp";
    snprintf(dir, sizeof dir, "%s/kvtier-bench-XXXXXX", base);
    if (!mkdtemp(dir))
      return cli_fail(json, "bench", CLI_NOOPEN,
                      "cannot create a temporary directory under %s: %s", base,
                      strerror(errno));
    created = 1;
    remove_dir = !c.keep;
  }
  char fsname[32] = "?";
  struct statfs sfs;
  int is_tmpfs = 0;
  if (statfs(dir, &sfs) == 0) {
    is_tmpfs = sfs.f_type == 0x01021994; /* TMPFS_MAGIC */
    snprintf(fsname, sizeof fsname, "%s",
             is_tmpfs                         ? "tmpfs"
             : sfs.f_type == 0xEF53           ? "ext4"
             : sfs.f_type == 0x58465342       ? "xfs"
             : sfs.f_type == (long)0x9123683E ? "btrfs"
             : sfs.f_type == 0x794c7630       ? "overlayfs"
                                              : "other");
  }
  if (is_tmpfs)
    fprintf(stderr,
            "kvtier bench: warning: %s is on tmpfs (RAM), not a disk: the "
            "figures say nothing about an SSD. Give a DIR on the SSD.\n",
            dir);

  workload w;
  int code = CLI_OK, reported = 0;
  char fail[8192] = "";
  double *lat = NULL, *enq_t = NULL;
  cli_progress pg = {0};
  if (build_workload(&w, &c) != 0) {
    free_workload(&w, c.entries);
    if (remove_dir)
      cli_rmtree(dir);
    return cli_fail(json, "bench", CLI_FAILED,
                    "out of memory building the "
                    "workload");
  }

  spill_track trk;
  memset(&trk, 0, sizeof trk);
  pthread_mutex_init(&trk.mu, NULL);
  pthread_cond_init(&trk.cv, NULL);
  enq_t = calloc((size_t)c.entries, sizeof *enq_t);
  trk.done_t = calloc((size_t)c.entries, sizeof *trk.done_t);
  trk.cap = trk.done_t ? (uint64_t)c.entries : 0;

  /* ---- 1. the disk's own limits ---- */
  disk_result disk;
  memset(&disk, 0, sizeof disk);
  if (!c.no_disk)
    disk_measure(&disk, dir, c.disk_size, c.progress);
  kvt_tier *t = NULL;
  CHECK_INTERRUPT();

  /* ---- 2. open the tier ---- */
  kvt_options o;
  kvt_options_init(&o, KVT_OPTIONS_VERSION);
  o.cache_dir = dir;
  o.max_size_gb = 1e6; /* never evict anything, ours or a user's */
  o.max_entries = INT64_MAX / 4;
  o.storage_mode = c.storage;
  o.durability = c.durability;
  o.log_fn = log_warn;
  o.log_level =
      cli_flag_get(f, nf, "verbose")->set ? KVT_LOG_INFO : KVT_LOG_WARN;
  o.spill_done_fn = on_spill_done;
  o.spill_done_ctx = &trk;
  rc = kvt_tier_open(&t, &o);
  if (rc == 0)
    rc = kvt_tier_start_writer(t);
  if (rc == 0 && (!enq_t || !trk.done_t))
    rc = KVT_ENOMEM;
  if (rc != 0)
    END_RUN(CLI_FAILED, "cannot open %s: %s (%s)", dir, kvt_last_error(),
            kvt_strerror(rc));

  /* ---- 3. spill ---- */
  const uint64_t inflight = 3;
  lat = calloc((size_t)c.entries * 64 + 20000, sizeof *lat);
  if (!lat)
    END_RUN(CLI_FAILED, "out of memory");
  phase producer = {0};
  cli_progress_start(&pg, "spill", (uint64_t)c.entries, c.progress);
  double s0 = cli_mono();
  for (int e = 0; e < c.entries; e++) {
    CHECK_INTERRUPT();
    if ((uint64_t)e >= inflight)
      wait_done_at_least(&trk, (uint64_t)e - inflight + 1);
    point_entry(&w, e);
    for (;;) {
      double t0 = cli_mono();
      rc = kvt_tier_spill(t, w.tokens[e], (size_t)c.tokens, w.layers,
                          w.n_layers, w.entry_bytes);
      double dt = cli_mono() - t0;
      if (rc == KVT_EFULL) { /* the queue is full: wait for the writer */
        pthread_mutex_lock(&trk.mu);
        uint64_t d = trk.done;
        pthread_mutex_unlock(&trk.mu);
        wait_done_at_least(&trk, d + 1);
        continue;
      }
      enq_t[e] = t0 + dt;
      lat[producer.count++] = dt;
      producer.seconds += dt;
      producer.bytes += w.entry_bytes;
      break;
    }
    if (rc != 0)
      END_RUN(CLI_FAILED, "spill of entry %d failed: %s (%s)", e,
              kvt_last_error(), kvt_strerror(rc));
    pthread_mutex_lock(&trk.mu);
    uint64_t d = trk.done;
    pthread_mutex_unlock(&trk.mu);
    cli_progress_update(&pg, d);
  }
  rc = kvt_tier_flush(t, -1);
  wait_done_at_least(&trk, (uint64_t)c.entries);
  double spill_secs = cli_mono() - s0;
  cli_progress_end(&pg);
  phase_percentiles(&producer, lat, producer.count);
  if (rc != 0 || trk.failed)
    END_RUN(CLI_FAILED, "%llu of %d spills failed: %s",
            (unsigned long long)trk.failed, c.entries,
            trk.failed ? trk.err : kvt_last_error());
  kvt_stats st;
  kvt_tier_stats(&st, t);
  /* Writer-side time: the single FIFO writer starts entry i when it has been
   * enqueued and entry i-1 is done; summing those busy spans leaves out the
   * time the writer sat waiting for the producer. */
  phase spill = {0}, spill_e2e = {0};
  for (int e = 0; e < c.entries; e++) {
    double start = enq_t[e];
    if (e > 0 && trk.done_t[e - 1] > start)
      start = trk.done_t[e - 1];
    double busy = trk.done_t[e] - start;
    lat[e] = busy > 0 ? busy : 0;
    spill.seconds += lat[e];
  }
  spill.count = spill_e2e.count = (uint64_t)c.entries;
  spill.bytes = spill_e2e.bytes = st.spill_bytes;
  phase_percentiles(&spill, lat, (size_t)c.entries);
  spill_e2e.seconds = spill_secs;

  /* ---- 4. lookups ---- */
  size_t nlook = c.quick ? 2000 : 10000;
  /* Pass 0 times exact lookups, pass 1 prefix lookups (a longer query). */
  phase lookup[2] = {{0}, {0}};
  static const char *lk_name[2] = {"exact", "prefix"};
  for (int pass = 0; pass < 2; pass++) {
    for (size_t i = 0; i < nlook; i++) {
      if (i % 256 == 0)
        CHECK_INTERRUPT();
      int e = (int)(i % (size_t)c.entries);
      kvt_entry_info info;
      double t0 = cli_mono();
      rc = pass == 0 ? kvt_tier_lookup(&info, t, w.tokens[e], (size_t)c.tokens)
                     : kvt_tier_lookup_prefix(&info, t, w.queries[e],
                                              (size_t)c.tokens + 16);
      lat[i] = cli_mono() - t0;
      if (rc != 0 || strcmp(info.token_hash, w.hashes[e]) != 0)
        END_RUN(CLI_FAILED, "%s lookup of entry %d failed: %s", lk_name[pass],
                e, rc ? kvt_last_error() : "wrong entry returned");
      lookup[pass].seconds += lat[i];
      if (i % 256 == 0)
        cli_progress_update(&pg, pass * nlook + i);
    }
    lookup[pass].count = nlook;
    phase_percentiles(&lookup[pass], lat, nlook);
  }
  cli_progress_end(&pg);

  /* ---- 5. promote: a verifying warm-up pass, then warm and cold runs ---- */
  verify_count vc = {0};
  int warm_rounds = c.entries >= 20 ? 2 : (20 + c.entries - 1) / c.entries;
  if (warm_rounds > 5)
    warm_rounds = 5;
  int cold_rounds = c.entries >= 10 ? 1 : 2;
  uint64_t total_ops = (uint64_t)c.entries * (1 + warm_rounds + cold_rounds);
  uint64_t done_ops = 0;
  cli_progress_start(&pg, "promote", total_ops, c.progress);
  /* The warm-up pass reads through the page cache (KVT_PROMOTE_PAGE_CACHE):
   * a cold promote otherwise bypasses it with O_DIRECT, and the warm runs
   * measure promotes of cached entries. */
  kvt_promote_opts warmup = KVT_PROMOTE_OPTS_INIT;
  warmup.flags = KVT_PROMOTE_PAGE_CACHE;
  for (int e = 0; e < c.entries; e++) {
    CHECK_INTERRUPT();
    kvt_entry *ent = NULL;
    rc = kvt_tier_promote(&ent, t, w.tokens[e], (size_t)c.tokens, &warmup);
    if (rc != 0)
      END_RUN(CLI_FAILED, "promote of entry %d failed: %s (%s)", e,
              kvt_last_error(), kvt_strerror(rc));
    verify_entry(&vc, &w, e, ent);
    kvt_entry_free(ent);
    cli_progress_update(&pg, ++done_ops);
  }
  phase warm = {0}, cold = {0};
  for (int r = 0; r < warm_rounds; r++)
    for (int e = 0; e < c.entries; e++) {
      CHECK_INTERRUPT();
      if ((rc = timed_promote(&warm, lat, &vc, t, &w, &c, e)) != 0)
        END_RUN(CLI_FAILED, "warm promote of entry %d failed: %s", e,
                kvt_last_error());
      cli_progress_update(&pg, ++done_ops);
    }
  phase_percentiles(&warm, lat, warm.count);
  double resident_sum = 0;
  int resident_n = 0;
  for (int r = 0; r < cold_rounds; r++)
    for (int e = 0; e < c.entries; e++) {
      CHECK_INTERRUPT();
      if (c.drop_caches && drop_all_caches() != 0)
        END_RUN(CLI_FAILED, "cannot write /proc/sys/vm/drop_caches");
      double res = evict_entry(dir, w.hashes[e]);
      if (res >= 0) {
        resident_sum += res;
        resident_n++;
      }
      if ((rc = timed_promote(&cold, lat, &vc, t, &w, &c, e)) != 0)
        END_RUN(CLI_FAILED, "cold promote of entry %d failed: %s", e,
                kvt_last_error());
      cli_progress_update(&pg, ++done_ops);
    }
  phase_percentiles(&cold, lat, cold.count);
  cli_progress_end(&pg);
  kvt_tier_stats(&st, t);
  free(lat);
  lat = NULL;
  if (vc.mismatched) {
    code = CLI_FAILED;
    snprintf(fail, sizeof fail,
             "%llu promoted tensors differ from what was "
             "spilled; first: %s",
             (unsigned long long)vc.mismatched, vc.first_bad);
  }

  /* ---- 6. report ---- */
  reported = 1;
  {
    double bps_spill = spill.seconds > 0 ? spill.bytes / spill.seconds : 0;
    double bps_e2e =
        spill_e2e.seconds > 0 ? spill_e2e.bytes / spill_e2e.seconds : 0;
    double bps_warm = warm.seconds > 0 ? warm.bytes / warm.seconds : 0;
    double bps_cold = cold.seconds > 0 ? cold.bytes / cold.seconds : 0;
    double bps_prod =
        producer.seconds > 0 ? producer.bytes / producer.seconds : 0;
    uint64_t mem_total = w.entry_bytes * (uint64_t)c.entries;
    double resident = resident_n ? resident_sum / resident_n : 0;
    int ratios = disk.ok;
    const char *dur = c.durability == KVT_DURABILITY_FSYNC ? "fsync" : "none";
    const char *cold_method =
        c.drop_caches ? "drop_caches" : "fsync + fadvise(DONTNEED)";
    if (json) {
      cJSON *jo = cJSON_CreateObject();
      cJSON_AddStringToObject(jo, "version", kvt_version());
      cJSON *wl = cJSON_AddObjectToObject(jo, "workload");
      cJSON_AddStringToObject(wl, "preset", c.preset);
      cJSON_AddNumberToObject(wl, "entries", c.entries);
      cJSON_AddNumberToObject(wl, "tokens", c.tokens);
      cJSON_AddNumberToObject(wl, "layers", w.n_layers);
      cJSON *lk = cJSON_AddObjectToObject(wl, "layer_kinds");
      for (int k = 1; k <= 4; k++)
        if (w.kinds[k])
          cJSON_AddNumberToObject(lk, cli_kind_name(k), w.kinds[k]);
      cJSON_AddStringToObject(wl, "dtype", kvt_dtype_name(c.dtype));
      cJSON_AddStringToObject(wl, "storage", c.storage ? "compat" : "native");
      cJSON_AddStringToObject(wl, "durability", dur);
      cJSON_AddNumberToObject(wl, "seed", (double)c.seed);
      cJSON_AddNumberToObject(wl, "entry_memory_bytes", (double)w.entry_bytes);
      cJSON_AddNumberToObject(wl, "total_memory_bytes", (double)mem_total);
      cJSON_AddStringToObject(wl, "dir", dir);
      cJSON_AddStringToObject(wl, "filesystem", fsname);
      if (disk.ok) {
        cJSON *dj = cJSON_AddObjectToObject(jo, "disk");
        cJSON_AddStringToObject(dj, "tool", disk.tool);
        cJSON_AddStringToObject(dj, "engine", disk.engine);
        cJSON_AddNumberToObject(dj, "iodepth", disk.iodepth);
        cJSON_AddNumberToObject(dj, "size_bytes", (double)disk.size);
        cJSON_AddNumberToObject(dj, "block_bytes", disk.block);
        cJSON_AddNumberToObject(dj, "write_direct_bps", disk.write_direct);
        cJSON_AddNumberToObject(dj, "read_direct_bps", disk.read_direct);
        cJSON_AddNumberToObject(dj, "read_buffered_bps", disk.read_buffered);
        if (disk.note[0])
          cJSON_AddStringToObject(dj, "note", disk.note);
      } else {
        cJSON_AddNullToObject(jo, "disk");
        if (disk.note[0])
          cJSON_AddStringToObject(jo, "disk_note", disk.note);
      }
      cJSON *sp = phase_json(&spill, ratios ? disk.write_direct : 0,
                             "disk write O_DIRECT", 1);
      cJSON_AddBoolToObject(sp, "durable",
                            c.durability == KVT_DURABILITY_FSYNC);
      cJSON_AddStringToObject(sp, "measured", "writer busy time");
      cJSON_AddItemToObject(jo, "spill", sp);
      cJSON *se = phase_json(&spill_e2e, ratios ? disk.write_direct : 0,
                             "disk write O_DIRECT", 1);
      cJSON_DeleteItemFromObject(se, "p50_ms");
      cJSON_DeleteItemFromObject(se, "p99_ms");
      cJSON_AddItemToObject(jo, "spill_end_to_end", se);
      cJSON *pj = phase_json(&producer, 0, NULL, 1);
      cJSON_AddItemToObject(jo, "spill_producer", pj);
      cJSON_AddItemToObject(
          jo, "promote_warm",
          phase_json(&warm, ratios ? disk.read_buffered : 0, "cached read", 1));
      cJSON *cj = phase_json(&cold, ratios ? disk.read_direct : 0,
                             "disk read O_DIRECT", 1);
      cJSON_AddStringToObject(cj, "eviction", cold_method);
      cJSON_AddNumberToObject(cj, "resident_fraction_after_eviction", resident);
      cJSON_AddItemToObject(jo, "promote_cold", cj);
      cJSON_AddItemToObject(jo, "lookup_exact",
                            phase_json(&lookup[0], 0, NULL, 0));
      cJSON_AddItemToObject(jo, "lookup_prefix",
                            phase_json(&lookup[1], 0, NULL, 0));
      cJSON_AddNumberToObject(jo, "disk_bytes", (double)st.disk_bytes);
      cJSON_AddNumberToObject(jo, "memory_bytes", (double)mem_total);
      cJSON_AddNumberToObject(jo, "disk_to_memory",
                              mem_total ? (double)st.disk_bytes / mem_total
                                        : 0);
      cJSON *vj = cJSON_AddObjectToObject(jo, "verified");
      cJSON_AddNumberToObject(vj, "exact_tensors", (double)vc.exact);
      cJSON_AddNumberToObject(vj, "converted_tensors", (double)vc.skipped);
      cJSON_AddNumberToObject(vj, "mismatched_tensors", (double)vc.mismatched);
      cJSON_AddBoolToObject(jo, "kept", c.keep);
      cli_json_print(jo);
    } else {
      char a[32], b[32], r1[32];
      printf("kvtier bench %s: preset %s, %u layers (", kvt_version(), c.preset,
             w.n_layers);
      int first = 1;
      for (int k = 1; k <= 4; k++)
        if (w.kinds[k]) {
          printf("%s%s %u", first ? "" : ", ", cli_kind_name(k), w.kinds[k]);
          first = 0;
        }
      printf("), %s\n", kvt_dtype_name(c.dtype));
      printf("  %d entries x %d tokens, %s each in memory, %s total; seed "
             "%llu\n",
             c.entries, c.tokens, cli_fmt_bytes(a, sizeof a, w.entry_bytes),
             cli_fmt_bytes(b, sizeof b, mem_total), (unsigned long long)c.seed);
      printf("  dir %s (%s), storage %s, durability %s\n\n", dir, fsname,
             c.storage ? "compat" : "native", dur);
      if (disk.ok) {
        printf("disk (%s, %s, %s per job, 1 MiB blocks, iodepth %d)\n",
               disk.tool, disk.engine, cli_fmt_bytes(a, sizeof a, disk.size),
               disk.iodepth);
        printf("  sequential write O_DIRECT   %12s\n",
               cli_fmt_rate(r1, sizeof r1, disk.write_direct));
        printf("  sequential read  O_DIRECT   %12s\n",
               cli_fmt_rate(r1, sizeof r1, disk.read_direct));
        printf(
            "  sequential read  cached     %12s   (buffered, page cache hot)\n",
            cli_fmt_rate(r1, sizeof r1, disk.read_buffered));
        if (disk.note[0])
          printf("  note: %s\n", disk.note);
      } else if (c.no_disk) {
        printf("disk: not measured (--no-disk): no ratios\n");
      } else {
        printf("disk: not measured (%s): no ratios\n", disk.note);
      }
      printf("\n");
      static const char *heads[] = {"MEASURE", "VALUE", "p50", "p99",
                                    "VS HARDWARE"};
      cli_table tb;
      cli_table_init(&tb, 5, heads, "lrrrl");
      char v1[48], v4[96];
#define RATIO(x, lim, name)                                                    \
  (ratios ? (snprintf(v4, sizeof v4, "%.2f x %s", (x) / (lim), name), v4) : "-")
      report_row(&tb,
                 c.durability == KVT_DURABILITY_FSYNC
                     ? "spill (durable, writer)"
                     : "spill (no fsync, writer)",
                 cli_fmt_rate(v1, sizeof v1, bps_spill), &spill, 1,
                 RATIO(bps_spill, disk.write_direct, "disk write O_DIRECT"));
      report_row(&tb, "  end to end (spill .. flush)",
                 cli_fmt_rate(v1, sizeof v1, bps_e2e), NULL, 1,
                 RATIO(bps_e2e, disk.write_direct, "disk write O_DIRECT"));
      report_row(&tb, "  producer (caller thread)",
                 cli_fmt_rate(v1, sizeof v1, bps_prod), &producer, 1,
                 "copy of the layers on spill");
      report_row(&tb, "promote warm", cli_fmt_rate(v1, sizeof v1, bps_warm),
                 &warm, 1, RATIO(bps_warm, disk.read_buffered, "cached read"));
      report_row(&tb, "promote cold", cli_fmt_rate(v1, sizeof v1, bps_cold),
                 &cold, 1,
                 RATIO(bps_cold, disk.read_direct, "disk read O_DIRECT"));
      snprintf(v1, sizeof v1, "%zu", nlook);
      report_row(&tb, "lookup exact", v1, &lookup[0], 0, "-");
      report_row(&tb, "lookup prefix", v1, &lookup[1], 0, "-");
#undef RATIO
      cli_table_print(&tb, stdout);
      cli_table_free(&tb);
      printf("\n");
      printf("bytes on disk   %s for %s in memory (%.3f x)\n",
             cli_fmt_bytes(a, sizeof a, st.disk_bytes),
             cli_fmt_bytes(b, sizeof b, mem_total),
             mem_total ? (double)st.disk_bytes / mem_total : 0.0);
      printf("cold reload     %d tokens in %.1f ms p50 (%.1f us/token); "
             "page cache after eviction: %.1f%% resident (%s)\n",
             c.tokens, cold.p50 * 1e3, cold.p50 * 1e6 / c.tokens,
             resident * 100, cold_method);
      printf("promotes        %llu warm, %llu cold; every promoted tensor "
             "compared: %llu exact, %llu converted by the storage mode, "
             "%llu wrong\n",
             (unsigned long long)warm.count, (unsigned long long)cold.count,
             (unsigned long long)vc.exact, (unsigned long long)vc.skipped,
             (unsigned long long)vc.mismatched);
      if (c.keep)
        printf("kept            %s\n", dir);
    }
  }

out:
  free(lat);
  free(enq_t);
  free(trk.done_t);
  if (t) {
    if (!c.keep && !remove_dir) {
      /* An existing directory: take back only what the bench added. */
      for (int e = 0; e < c.entries; e++)
        kvt_tier_remove(t, w.tokens[e], (size_t)c.tokens);
    }
    kvt_tier_close(t, -1);
    kvt_tier_free(t);
  }
  pthread_mutex_destroy(&trk.mu);
  pthread_cond_destroy(&trk.cv);
  free_workload(&w, c.entries);
  if (remove_dir && cli_rmtree(dir) != 0)
    fprintf(stderr, "kvtier bench: could not remove %s: %s\n", dir,
            strerror(errno));
  (void)created;
  if (code != CLI_OK)
    return cli_fail(json && !reported, "bench", code, "%s",
                    fail[0] ? fail : "failed");
  return CLI_OK;
}
