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
 *
 * The layer layouts, the page-cache eviction and the fio runner are bench/'s
 * (benchutil.h, linked as kvt_benchutil over the public API), so the CLI and
 * the bench programs measure the same shapes the same way. cmd_bench runs the
 * steps below in order over one bench_run: parse, directory, workload, disk,
 * open, spill, lookups, promotes, report, clean-up.
 */
#define _GNU_SOURCE
#include "cmd_bench.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

static const char *BENCH_HELP =
    "usage: kvtier bench [DIR] [--preset NAME] [--entries N] [--tokens N]\n"
    "                    [--dtype f16|bf16|f32] [--storage native|compat]\n"
    "                    [--durability fsync|none] [--quick] [--keep]\n"
    "                    [--seed N] [--disk-size SIZE] [--no-disk]\n"
    "                    [--cold drop-caches] [--chunk-tokens N] "
    "[--no-progress]\n"
    "                    [--json]\n"
    "       kvtier bench [DIR] --preset chat [--quick] [--rounds N] "
    "[--entries N]\n"
    "                    [--chunk-tokens N] [--seed N] [--no-disk] [--keep]\n"
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
    "                    chat: the chunked store's chat workload: bytes\n"
    "                      written per new token and disk/unique KV for an\n"
    "                      aligned and an unaligned multi-turn chat (turns\n"
    "                      of 50-300 tokens), tokens served to a prefix\n"
    "                      query, durable spill of 256-token Llama-3-8B\n"
    "                      entries vs one durable fio O_DIRECT write per\n"
    "                      entry and their cold promote vs fio O_DIRECT\n"
    "                      read (median of --rounds, default 5; --quick 1;\n"
    "                      --entries per round, 4)\n"
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
    "  --chunk-tokens N  the chunked store: 0 (off) or a power of two\n"
    "                    16..4096 (default: the library's; native only)\n"
    "  --no-progress     never draw progress bars\n"
    "  --json            JSON output\n"
    "\n"
    "Throughputs are decimal (1 GB/s = 1e9 bytes/s) over bytes on disk.\n";

/* ---- the workload ---- */

static uint64_t rng_next(uint64_t *s) { /* splitmix64 */
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* Builds one entry's layer descriptors (data pointers set per entry): 32
 * layers of 8 heads x 128, shaped by the preset (see BENCH_HELP). */
static int build_layout(workload *w, const bench_cfg *c) {
  bu_layout_spec s = {.n_layers = 32,
                      .model = BU_MODEL_KV,
                      .dtype = c->dtype,
                      .heads = 8,
                      .n_tokens = c->tokens,
                      .dim = 128,
                      .ssm_ndim = 3,
                      .ssm_shape = {1, 8192, 16},
                      .bits = 4,
                      .group_size = 64};
  if (strcmp(c->preset, "hybrid") == 0)
    s.model = BU_MODEL_HYBRID;
  else if (strcmp(c->preset, "quantized") == 0)
    s.model = BU_MODEL_QUANTIZED;
  return bu_layout_make(&w->lay, &s);
}

/* Offset of entry e's data in the pool: entries differ in content. */
static uint64_t entry_base(int e) {
  return (uint64_t)(e % 256) * 4096;
}

static void point_entry(workload *w, int e) {
  unsigned char *p = w->pool + entry_base(e);
  for (uint32_t i = 0; i < w->lay.n_tensors; i++) {
    w->lay.tensors[i].data = p;
    p += (w->lay.tensors[i].nbytes + 63) / 64 * 64;
  }
}

static int build_workload(workload *w, const bench_cfg *c) {
  memset(w, 0, sizeof *w);
  if (build_layout(w, c) != 0)
    return -1;
  uint64_t span = 0;
  for (uint32_t i = 0; i < w->lay.n_tensors; i++)
    span += (w->lay.tensors[i].nbytes + 63) / 64 * 64;
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
  /* The chunked store keys KV by tokens: entries sharing a whole chunk of
   * tokens share that chunk's KV, as a model's KV of a shared prefix is the
   * same. This workload's KV is random per entry, so its shared prompt stays
   * shorter than one chunk (sharing itself is measured by --preset chat,
   * whose KV is a function of the tokens). */
  int ct = c->chunk_tokens >= 0               ? c->chunk_tokens
           : c->storage == KVT_STORAGE_NATIVE ? (int)KVT_CHUNK_TOKENS_DEFAULT
                                              : 0;
  if (ct > 0 && sys >= ct)
    sys = ct - 1;
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
  bu_layout_free(&w->lay);
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

/* ---- verification of promoted data ---- */

static void verify_entry(verify_count *vc, workload *w, int e,
                         const kvt_entry *ent) {
  point_entry(w, e);
  uint32_t nl = kvt_entry_num_layers(ent);
  if (nl != w->lay.n_layers) {
    vc->mismatched++;
    snprintf(vc->first_bad, sizeof vc->first_bad,
             "entry %d: %u layers promoted, %u spilled", e, nl,
             w->lay.n_layers);
    return;
  }
  for (uint32_t l = 0; l < nl; l++) {
    const kvt_layer *got = kvt_entry_layer(ent, l);
    const kvt_layer *want = &w->lay.layers[l];
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
  kvt_cache_dir_probe_info pr = KVT_CACHE_DIR_PROBE_INIT;
  return kvt_cache_dir_probe(&pr, dir) == 0 &&
         (pr.empty || pr.has_index || pr.has_data);
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

/* ---- the run, step by step ---- */

/* Ends the run with exit code CODE and a printf-style message: the progress
 * bar (if any) is erased; finish() then cleans up. Returns -1. */
static int end_run(bench_run *r, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int end_run(bench_run *r, int code, const char *fmt, ...) {
  r->code = code;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(r->fail, sizeof r->fail, fmt, ap);
  va_end(ap);
  cli_progress_end(&r->pg);
  return -1;
}

#define CHECK_INTERRUPT(r)                                                     \
  do {                                                                         \
    if (interrupted)                                                           \
      return end_run((r), CLI_INTERRUPTED, "interrupted; cleaned up");         \
  } while (0)

/* Step 0: the flags into c (defaults first). Returns 0, or the exit code of
 * a usage error (reported). */
static int parse_cfg(bench_cfg *c, cli_flag *f, size_t nf) {
  int rc;
  memset(c, 0, sizeof *c);
  c->json = cli_flag_get(f, nf, "json")->set;
  c->quick = cli_flag_get(f, nf, "quick")->set;
  c->keep = cli_flag_get(f, nf, "keep")->set;
  c->no_disk = cli_flag_get(f, nf, "no-disk")->set;
  c->progress = !cli_flag_get(f, nf, "no-progress")->set;
  c->preset = "llama3-8b";
  c->entries = c->quick ? 4 : 8;
  c->tokens = c->quick ? 1024 : 2048; /* chat-sized entries (1-8k tokens) */
  c->dtype = KVT_DTYPE_F16;
  c->storage = KVT_STORAGE_NATIVE;
  c->durability = KVT_DURABILITY_FSYNC;
  c->seed = 1;
  c->chunk_tokens = -1;
  c->disk_size = c->quick ? (256ull << 20) : (1ull << 30);
  const char *v;
  int json = c->json;
  if ((v = cli_flag_get(f, nf, "preset")->value)) {
    if (strcmp(v, "llama3-8b") && strcmp(v, "hybrid") && strcmp(v, "quantized"))
      return cli_fail(
          json, "bench", CLI_USAGE,
          "unknown preset '%s' (llama3-8b, hybrid, quantized, chat)", v);
    c->preset = v;
  }
  uint64_t u;
  if ((v = cli_flag_get(f, nf, "entries")->value)) {
    if (cli_parse_u64(v, &u) != 0 || u < 1 || u > 100000)
      return cli_fail(json, "bench", CLI_USAGE,
                      "--entries needs 1..100000, got '%s'", v);
    c->entries = (int)u;
  }
  if ((v = cli_flag_get(f, nf, "tokens")->value)) {
    if (cli_parse_u64(v, &u) != 0 || u < 1 || u > 1000000)
      return cli_fail(json, "bench", CLI_USAGE,
                      "--tokens needs 1..1000000, got '%s'", v);
    c->tokens = (int)u;
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
  int dtype = (int)c->dtype;
  if ((rc = cli_flag_choice(f, nf, "dtype", dtypes, 5, "f16, bf16 or f32", json,
                            "bench", &dtype)) ||
      (rc = cli_flag_choice(f, nf, "storage", storages, 2, "native or compat",
                            json, "bench", &c->storage)) ||
      (rc = cli_flag_choice(f, nf, "durability", durabilities, 2,
                            "fsync or none", json, "bench", &c->durability)))
    return rc;
  c->dtype = (kvt_dtype)dtype;
  if ((v = cli_flag_get(f, nf, "seed")->value)) {
    if (cli_parse_u64(v, &c->seed) != 0)
      return cli_fail(json, "bench", CLI_USAGE, "--seed needs a number");
  }
  if ((v = cli_flag_get(f, nf, "chunk-tokens")->value)) {
    if (cli_parse_u64(v, &u) != 0 ||
        (u != 0 && (u < 16 || u > 4096 || (u & (u - 1)))))
      return cli_fail(json, "bench", CLI_USAGE,
                      "--chunk-tokens needs 0 or a power of two in 16..4096, "
                      "got '%s'",
                      v);
    if (u && c->storage != KVT_STORAGE_NATIVE)
      return cli_fail(json, "bench", CLI_USAGE,
                      "--chunk-tokens needs --storage native");
    c->chunk_tokens = (int)u;
  }
  if ((v = cli_flag_get(f, nf, "disk-size")->value)) {
    if (cli_parse_size(v, &c->disk_size) != 0 || c->disk_size < (1u << 20))
      return cli_fail(json, "bench", CLI_USAGE,
                      "--disk-size needs a size >= 1M like 512M, got '%s'", v);
  }
  if ((rc = cli_flag_choice(f, nf, "cold", colds, 2, "fadvise or drop-caches",
                            json, "bench", &c->drop_caches)) != 0)
    return rc;
  if (c->drop_caches && geteuid() != 0)
    return cli_fail(json, "bench", CLI_USAGE, "--cold drop-caches needs root");

  return 0;
}

/* Step 1: the cache directory - the one given (created if missing; an
 * existing one must be empty or a kvtier cache) or a fresh one under $TMPDIR
 * (else /var/tmp) - and its filesystem's name. Returns 0 or the exit code
 * (reported). */
static int prepare_dir(bench_run *r, const char *given) {
  const bench_cfg *c = &r->c;
  int json = c->json;
  char *dir = r->dir;
  const size_t dir_cap = sizeof r->dir;
  if (given) {
    snprintf(dir, dir_cap, "%s", given);
    struct stat st;
    if (stat(dir, &st) != 0) {
      if (errno != ENOENT || mkdir(dir, 0700) != 0)
        return cli_fail(json, "bench", CLI_NOOPEN, "%s: cannot create: %s", dir,
                        strerror(errno));
      r->remove_dir = !c->keep;
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
    snprintf(dir, dir_cap, "%s/kvtier-bench-XXXXXX", base);
    if (!mkdtemp(dir))
      return cli_fail(json, "bench", CLI_NOOPEN,
                      "cannot create a temporary directory under %s: %s", base,
                      strerror(errno));
    r->remove_dir = !c->keep;
  }
  snprintf(r->fsname, sizeof r->fsname, "?");
  struct statfs sfs;
  int is_tmpfs = 0;
  if (statfs(dir, &sfs) == 0) {
    is_tmpfs = sfs.f_type == 0x01021994; /* TMPFS_MAGIC */
    snprintf(r->fsname, sizeof r->fsname, "%s",
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
  return 0;
}

/* Step 2: the workload and the spill bookkeeping. Returns 0 or the exit code
 * (reported; nothing left to clean up but the directory, removed here). */
static int prepare_workload(bench_run *r) {
  const bench_cfg *c = &r->c;
  if (build_workload(&r->w, c) != 0) {
    free_workload(&r->w, c->entries);
    memset(&r->w, 0, sizeof r->w);
    if (r->remove_dir)
      cli_rmtree(r->dir);
    return cli_fail(c->json, "bench", CLI_FAILED,
                    "out of memory building the "
                    "workload");
  }
  spill_track *trk = &r->trk;
  pthread_mutex_init(&trk->mu, NULL);
  pthread_cond_init(&trk->cv, NULL);
  r->enq_t = calloc((size_t)c->entries, sizeof *r->enq_t);
  trk->done_t = calloc((size_t)c->entries, sizeof *trk->done_t);
  trk->cap = trk->done_t ? (uint64_t)c->entries : 0;
  return 0;
}

/* Step 3: the disk's own limits (skipped with --no-disk). */
static int measure_disk(bench_run *r) {
  if (!r->c.no_disk)
    disk_measure(&r->disk, r->dir, r->c.disk_size, r->c.progress);
  CHECK_INTERRUPT(r);
  return 0;
}

/* Step 4: the tier on dir, evicting nothing, with its writer started. */
static int open_tier(bench_run *r) {
  const bench_cfg *c = &r->c;
  kvt_options o;
  kvt_options_init(&o, KVT_OPTIONS_VERSION);
  /* The disk path's figures (cold, page cache, pooled buffers): the host RAM
   * tier is measured by bench/bench_ram_tier.py. */
  o.host_cache_bytes = 0;
  o.cache_dir = r->dir;
  o.max_size_gb = 1e6; /* never evict anything, ours or a user's */
  o.max_entries = INT64_MAX / 4;
  o.storage_mode = c->storage;
  o.durability = c->durability;
  if (c->chunk_tokens >= 0)
    o.chunk_tokens = (uint32_t)c->chunk_tokens;
  else if (c->storage != KVT_STORAGE_NATIVE)
    o.chunk_tokens = 0; /* chunks are native-mode only */
  o.log_fn = log_warn;
  o.log_level = r->verbose ? KVT_LOG_INFO : KVT_LOG_WARN;
  o.spill_done_fn = on_spill_done;
  o.spill_done_ctx = &r->trk;
  int rc = kvt_tier_open(&r->t, &o);
  if (rc == 0)
    rc = kvt_tier_start_writer(r->t);
  if (rc == 0 && (!r->enq_t || !r->trk.done_t))
    rc = KVT_ENOMEM;
  if (rc != 0)
    return end_run(r, CLI_FAILED, "cannot open %s: %s (%s)", r->dir,
                   kvt_last_error(), kvt_strerror(rc));
  return 0;
}

/* Step 5: spill every entry (at most a few in flight), timing the caller's
 * side (producer), the writer's busy time (spill) and spill .. flush
 * (spill_e2e). */
static int run_spills(bench_run *r) {
  const bench_cfg *c = &r->c;
  workload *w = &r->w;
  spill_track *trk = &r->trk;
  kvt_tier *t = r->t;
  const uint64_t inflight = 3;
  r->lat = calloc((size_t)c->entries * 64 + 20000, sizeof *r->lat);
  if (!r->lat)
    return end_run(r, CLI_FAILED, "out of memory");
  double *lat = r->lat;
  phase *producer = &r->producer;
  cli_progress_start(&r->pg, "spill", (uint64_t)c->entries, c->progress);
  double s0 = cli_mono();
  int rc = 0;
  for (int e = 0; e < c->entries; e++) {
    CHECK_INTERRUPT(r);
    if ((uint64_t)e >= inflight)
      wait_done_at_least(trk, (uint64_t)e - inflight + 1);
    point_entry(w, e);
    for (;;) {
      double t0 = cli_mono();
      rc = kvt_tier_spill(t, w->tokens[e], (size_t)c->tokens, w->lay.layers,
                          w->lay.n_layers, w->lay.bytes);
      double dt = cli_mono() - t0;
      if (rc == KVT_EFULL) { /* the queue is full: wait for the writer */
        pthread_mutex_lock(&trk->mu);
        uint64_t d = trk->done;
        pthread_mutex_unlock(&trk->mu);
        wait_done_at_least(trk, d + 1);
        continue;
      }
      r->enq_t[e] = t0 + dt;
      lat[producer->count++] = dt;
      producer->seconds += dt;
      producer->bytes += w->lay.bytes;
      break;
    }
    if (rc != 0)
      return end_run(r, CLI_FAILED, "spill of entry %d failed: %s (%s)", e,
                     kvt_last_error(), kvt_strerror(rc));
    pthread_mutex_lock(&trk->mu);
    uint64_t d = trk->done;
    pthread_mutex_unlock(&trk->mu);
    cli_progress_update(&r->pg, d);
  }
  rc = kvt_tier_flush(t, -1);
  wait_done_at_least(trk, (uint64_t)c->entries);
  double spill_secs = cli_mono() - s0;
  cli_progress_end(&r->pg);
  phase_percentiles(producer, lat, producer->count);
  if (rc != 0 || trk->failed)
    return end_run(r, CLI_FAILED, "%llu of %d spills failed: %s",
                   (unsigned long long)trk->failed, c->entries,
                   trk->failed ? trk->err : kvt_last_error());
  kvt_stats_init(&r->st, KVT_STATS_VERSION);
  kvt_tier_stats(&r->st, t);
  /* Writer-side time: the single FIFO writer starts entry i when it has been
   * enqueued and entry i-1 is done; summing those busy spans leaves out the
   * time the writer sat waiting for the producer. */
  phase *spill = &r->spill, *spill_e2e = &r->spill_e2e;
  for (int e = 0; e < c->entries; e++) {
    double start = r->enq_t[e];
    if (e > 0 && trk->done_t[e - 1] > start)
      start = trk->done_t[e - 1];
    double busy = trk->done_t[e] - start;
    lat[e] = busy > 0 ? busy : 0;
    spill->seconds += lat[e];
  }
  spill->count = spill_e2e->count = (uint64_t)c->entries;
  spill->bytes = spill_e2e->bytes = r->st.spill_bytes;
  phase_percentiles(spill, lat, (size_t)c->entries);
  spill_e2e->seconds = spill_secs;
  return 0;
}

/* Step 6: exact lookups (pass 0), then prefix lookups with a longer query
 * (pass 1), each checked to return the right entry. */
static int run_lookups(bench_run *r) {
  const bench_cfg *c = &r->c;
  workload *w = &r->w;
  double *lat = r->lat;
  size_t nlook = r->nlook = c->quick ? 2000 : 10000;
  static const char *lk_name[2] = {"exact", "prefix"};
  for (int pass = 0; pass < 2; pass++) {
    phase *p = &r->lookup[pass];
    for (size_t i = 0; i < nlook; i++) {
      if (i % 256 == 0)
        CHECK_INTERRUPT(r);
      int e = (int)(i % (size_t)c->entries);
      kvt_entry_info info;
      double t0 = cli_mono();
      int rc = pass == 0 ? kvt_tier_lookup(&info, r->t, w->tokens[e],
                                           (size_t)c->tokens)
                         : kvt_tier_lookup_prefix(&info, r->t, w->queries[e],
                                                  (size_t)c->tokens + 16);
      lat[i] = cli_mono() - t0;
      if (rc != 0 || strcmp(info.token_hash, w->hashes[e]) != 0)
        return end_run(r, CLI_FAILED, "%s lookup of entry %d failed: %s",
                       lk_name[pass], e,
                       rc ? kvt_last_error() : "wrong entry returned");
      p->seconds += lat[i];
      if (i % 256 == 0)
        cli_progress_update(&r->pg, pass * nlook + i);
    }
    p->count = nlook;
    phase_percentiles(p, lat, nlook);
  }
  cli_progress_end(&r->pg);
  return 0;
}

/* Step 7: promotes - a verifying warm-up pass through the page cache, then
 * timed warm rounds and cold rounds (each entry evicted first). Every promoted
 * tensor is compared with what was spilled; a mismatch fails the run after
 * the report. */
static int run_promotes(bench_run *r) {
  const bench_cfg *c = &r->c;
  workload *w = &r->w;
  double *lat = r->lat;
  int rc;
  int warm_rounds = c->entries >= 20 ? 2 : (20 + c->entries - 1) / c->entries;
  if (warm_rounds > 5)
    warm_rounds = 5;
  int cold_rounds = c->entries >= 10 ? 1 : 2;
  uint64_t total_ops = (uint64_t)c->entries * (1 + warm_rounds + cold_rounds);
  uint64_t done_ops = 0;
  cli_progress_start(&r->pg, "promote", total_ops, c->progress);
  /* The warm-up pass reads through the page cache (KVT_PROMOTE_PAGE_CACHE):
   * a cold promote otherwise bypasses it with O_DIRECT, and the warm runs
   * measure promotes of cached entries. */
  kvt_promote_opts warmup = KVT_PROMOTE_OPTS_INIT;
  warmup.flags = KVT_PROMOTE_PAGE_CACHE;
  for (int e = 0; e < c->entries; e++) {
    CHECK_INTERRUPT(r);
    kvt_entry *ent = NULL;
    rc = kvt_tier_promote(&ent, r->t, w->tokens[e], (size_t)c->tokens, &warmup);
    if (rc != 0)
      return end_run(r, CLI_FAILED, "promote of entry %d failed: %s (%s)", e,
                     kvt_last_error(), kvt_strerror(rc));
    verify_entry(&r->vc, w, e, ent);
    kvt_entry_free(ent);
    cli_progress_update(&r->pg, ++done_ops);
  }
  for (int k = 0; k < warm_rounds; k++)
    for (int e = 0; e < c->entries; e++) {
      CHECK_INTERRUPT(r);
      if ((rc = timed_promote(&r->warm, lat, &r->vc, r->t, w, c, e)) != 0)
        return end_run(r, CLI_FAILED, "warm promote of entry %d failed: %s", e,
                       kvt_last_error());
      cli_progress_update(&r->pg, ++done_ops);
    }
  phase_percentiles(&r->warm, lat, r->warm.count);
  for (int k = 0; k < cold_rounds; k++)
    for (int e = 0; e < c->entries; e++) {
      CHECK_INTERRUPT(r);
      if (c->drop_caches && bu_drop_all_caches() != 0)
        return end_run(r, CLI_FAILED, "cannot write /proc/sys/vm/drop_caches");
      /* Every file the promote reads - the entry's directory and, over a
       * chain, each of its chunk files - leaves the page cache; what stays
       * cached is counted and reported with the figure. */
      if ((rc = bu_evict_entry(r->t, r->dir, w->hashes[e], &r->cold_res)) != 0)
        return end_run(r, CLI_FAILED,
                       "cannot evict entry %d's files from the page cache: "
                       "%s",
                       e, rc == KVT_EIO ? strerror(errno) : kvt_last_error());
      if ((rc = timed_promote(&r->cold, lat, &r->vc, r->t, w, c, e)) != 0)
        return end_run(r, CLI_FAILED, "cold promote of entry %d failed: %s", e,
                       kvt_last_error());
      cli_progress_update(&r->pg, ++done_ops);
    }
  phase_percentiles(&r->cold, lat, r->cold.count);
  cli_progress_end(&r->pg);
  if (!c->no_disk) /* the promotes' limits, taken on both sides of them */
    disk_measure_read_again(&r->disk, r->dir);
  kvt_tier_stats(&r->st, r->t);
  free(r->lat);
  r->lat = NULL;
  if (r->vc.mismatched) {
    r->code = CLI_FAILED;
    snprintf(r->fail, sizeof r->fail,
             "%llu promoted tensors differ from what was "
             "spilled; first: %s",
             (unsigned long long)r->vc.mismatched, r->vc.first_bad);
  }
  return 0;
}

/* Step 9: takes back what the run added (its entries in an existing cache,
 * or the directory it created), frees everything and returns the exit code
 * (the failure reported unless the JSON report was already printed). */
static int finish(bench_run *r) {
  const bench_cfg *c = &r->c;
  free(r->lat);
  free(r->enq_t);
  free(r->trk.done_t);
  if (r->t) {
    if (!c->keep && !r->remove_dir) {
      /* An existing directory: take back only what the bench added. */
      for (int e = 0; e < c->entries; e++)
        kvt_tier_remove(r->t, r->w.tokens[e], (size_t)c->tokens);
    }
    kvt_tier_close(r->t, -1);
    kvt_tier_free(r->t);
  }
  pthread_mutex_destroy(&r->trk.mu);
  pthread_cond_destroy(&r->trk.cv);
  free_workload(&r->w, c->entries);
  if (r->remove_dir && cli_rmtree(r->dir) != 0)
    fprintf(stderr, "kvtier bench: could not remove %s: %s\n", r->dir,
            strerror(errno));
  if (r->code != CLI_OK)
    return cli_fail(c->json && !r->reported, "bench", r->code, "%s",
                    r->fail[0] ? r->fail : "failed");
  return CLI_OK;
}

int cmd_bench(int argc, char **argv) {
  cli_flag f[] = {{"json", 0},         {"preset", 1},    {"entries", 1},
                  {"tokens", 1},       {"dtype", 1},     {"storage", 1},
                  {"durability", 1},   {"quick", 0},     {"keep", 0},
                  {"seed", 1},         {"disk-size", 1}, {"no-disk", 0},
                  {"no-progress", 0},  {"cold", 1},      {"verbose", 0},
                  {"chunk-tokens", 1}, {"rounds", 1}};
  const size_t nf = sizeof f / sizeof f[0];
  const char *pos[1] = {NULL};
  int rc = cli_begin("bench", BENCH_HELP, NULL, argc, argv, f, nf, pos, 0, 1);
  if (rc != CLI_RUN)
    return rc;
  const char *pv = cli_flag_get(f, nf, "preset")->value;
  if (pv && strcmp(pv, "chat") == 0) /* the chunked store's chat workload */
    return cli_bench_chat(f, nf, pos[0]);
  if (cli_flag_get(f, nf, "rounds")->set)
    return cli_fail(cli_flag_get(f, nf, "json")->set, "bench", CLI_USAGE,
                    "--rounds is for --preset chat");
  bench_run *r = calloc(1, sizeof *r);
  if (!r)
    return cli_fail(cli_flag_get(f, nf, "json")->set, "bench", CLI_FAILED,
                    "out of memory");
  if ((rc = parse_cfg(&r->c, f, nf)) != 0) {
    free(r);
    return rc;
  }
  r->verbose = cli_flag_get(f, nf, "verbose")->set;

  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);

  if ((rc = prepare_dir(r, pos[0])) != 0 || (rc = prepare_workload(r)) != 0) {
    free(r);
    return rc;
  }
  if (measure_disk(r) == 0 && open_tier(r) == 0 && run_spills(r) == 0 &&
      run_lookups(r) == 0 && run_promotes(r) == 0) {
    bench_figs g;
    bench_figures(&g, r);
    r->reported = 1;
    if (r->c.json)
      bench_report_json(r, &g);
    else
      bench_report_text(r, &g);
  }
  rc = finish(r);
  free(r);
  return rc;
}
