/*
 * bench_chunked.c - the chunked native store's figures (issue 13), measured
 * in one run for several chunk sizes through the store the tier uses
 * (src/store/chunked.c over the local backend): 8-layer fp16 KV (8 heads x
 * 128), spilled the way vllm-mlx's scheduler spills (the whole prompt on every
 * eviction). Workloads: (a) 16 conversations = one 1024-token system prompt +
 * 256 own tokens: bytes on disk / unique KV; (b) one conversation, 8 turns of
 * +512 tokens spilled every turn: bytes written / unique KV; (c) 20 turns of
 * 50-300 tokens (seeded): bytes written / unique KV and per new token; (d) a
 * new prompt = the system prompt + 300 new tokens: tokens served by a prefix
 * query (bit-exact check of the served KV included); then (e) a durable spill
 * of a 256-token Llama-3-8B-shaped entry (32 layers, 8 KV heads x 128, fp16)
 * through the chunked store vs fio O_DIRECT write of the same bytes, and (f)
 * the cold promote of that entry vs fio O_DIRECT read (also for a 1024-token
 * entry at C=256), median of rounds of paired ratios; finally the chat
 * workload with default options (bench/benchchat.h, the same as `kvtier
 * bench --preset chat`). Usage: bench_chunked [chunk sizes, default
 * 16,32,64,128,256,512] [rounds=9]. No assertions.
 */
#include "benchchat.h"
#include "benchutil.h"
#include "base/io.h"
#include "format/entry.h"
#include "index/index.h"
#include "store/local.h"
#include "store/chunked.h"
#include "kvtier_sys.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#define LAYERS 8
#define HEADS 8
#define DIM 128
#define TOKB ((uint64_t)LAYERS * HEADS * DIM * 2 * 2) /* bytes per token */

typedef struct env {
  char *dir;
  kvt_index *idx;
  kvti_backend *be;
  kvti_chunked *ck;
} env;

static int env_open(env *v, const char *base, const char *tag, uint32_t C,
                    int fsync_) {
  char p[4096];
  snprintf(p, sizeof p, "%s/%s", base, tag);
  mkdir(p, 0700);
  v->dir = strdup(p);
  kvti_chunkstore_opts o = {0600, 0700, fsync_};
  kvti_local_cfg lc = {v->dir, 0700, 0600, 0, 0};
  if (kvti_backend_local_open(&v->be, &lc) ||
      kvti_index_open(&v->idx, v->dir, NULL, 0) ||
      kvti_chunked_open(&v->ck, v->dir, v->idx, C, "bench", &o)) {
    fprintf(stderr, "open: %s\n", kvt_last_error());
    return -1;
  }
  return 0;
}
static void env_close(env *v) {
  kvti_chunked_close(v->ck);
  v->be->ops->destroy(v->be);
  kvt_index_close(v->idx);
  kvt_test_rmtree(v->dir);
  free(v->dir);
}

/* Spills tokens[0, n); returns bytes written (chunks + tail entry). */
static uint64_t spill(env *v, const int32_t *tok, size_t n, uint32_t layers,
                      int fsync_) {
  bu_kv c;
  if (bu_kv_make(&c, tok, n, layers) != 0) {
    fprintf(stderr, "out of memory\n");
    exit(1);
  }
  kvti_snapshot *s;
  if (kvti_snapshot_create(&s, tok, n, c.l, layers, n * TOKB, 0, NULL, NULL)) {
    fprintf(stderr, "snapshot: %s\n", kvt_last_error());
    exit(1);
  }
  kvti_write_opts wo = {KVT_STORAGE_NATIVE, fsync_, 0600, 0700, 0};
  kvti_chunked_put_result r;
  if (kvti_chunked_put(v->ck, v->be, &r, s, &wo)) {
    fprintf(stderr, "put: %s\n", kvt_last_error());
    exit(1);
  }
  kvti_snapshot_free(s);
  bu_kv_free(&c);
  return r.entry_bytes + r.chunk_bytes;
}

static uint64_t dir_bytes(const char *dir) {
  /* data/<hash>/ files + chunks/<kk>/ files */
  uint64_t total = 0, b;
  char p[4096];
  snprintf(p, sizeof p, "%s/data", dir);
  DIR *d = opendir(p);
  struct dirent *de;
  while (d && (de = readdir(d))) {
    if (de->d_name[0] == '.')
      continue;
    char q[4400];
    snprintf(q, sizeof q, "%s/%s", p, de->d_name);
    if (kvti_dir_bytes(&b, q, 1) == 0)
      total += b;
  }
  if (d)
    closedir(d);
  for (int a = 0; a < 256; a++) {
    snprintf(p, sizeof p, "%s/chunks/%02x", dir, a);
    if (kvti_dir_bytes(&b, p, 1) == 0)
      total += b;
  }
  return total;
}

static void run_size(const char *base, uint32_t C) {
  env v;
  static int32_t sys[1024], tok[1024 + 4096];
  for (int i = 0; i < 1024; i++)
    sys[i] = 100 + i;
  /* (a) shared system prompt */
  if (env_open(&v, base, "a", C, 0))
    exit(1);
  for (int c = 0; c < 16; c++) {
    memcpy(tok, sys, sizeof sys);
    for (int i = 0; i < 256; i++)
      tok[1024 + i] = 20000 + c * 300 + i;
    spill(&v, tok, 1280, LAYERS, 0);
  }
  double shared = (double)dir_bytes(v.dir) / (double)((1024 + 16 * 256) * TOKB);
  /* (d) prefix query: system prompt + 300 new tokens */
  memcpy(tok, sys, sizeof sys);
  for (int i = 0; i < 300; i++)
    tok[1024 + i] = 90000 + i;
  uint64_t m, mem;
  char h[65];
  kvti_chunked_lookup_prefix(v.ck, NULL, tok, 1324, &m, &mem, h);
  int exact = 0;
  if (m) {
    kvti_read_opts o = {0};
    kvt_entry *e;
    if (kvti_chunked_get_prefix(v.ck, NULL, &e, tok, m, &o, NULL, NULL) == 0) {
      bu_kv ref;
      exact =
          bu_kv_make(&ref, tok, (size_t)m, LAYERS) == 0 && bu_kv_same(e, &ref);
      bu_kv_free(&ref);
      kvt_entry_free(e);
    }
  }
  env_close(&v);
  /* (b) aligned multi-turn */
  if (env_open(&v, base, "b", C, 0))
    exit(1);
  uint64_t wrote = 0;
  for (int i = 0; i < 4096; i++)
    tok[i] = 30000 + (i * 7) % 9000;
  for (int turn = 1; turn <= 8; turn++)
    wrote += spill(&v, tok, (size_t)turn * 512, LAYERS, 0);
  double aligned = (double)wrote / (double)(4096 * TOKB);
  env_close(&v);
  /* (c) unaligned multi-turn: 20 turns of 50-300 tokens */
  if (env_open(&v, base, "c", C, 0))
    exit(1);
  uint64_t r = 1234;
  size_t n = 0;
  wrote = 0;
  for (int turn = 0; turn < 20; turn++) {
    r = r * 6364136223846793005ull + 1442695040888963407ull; /* seeded */
    size_t add = 50 + (size_t)((r >> 33) % 251);
    for (size_t i = 0; i < add && n < sizeof tok / 4; i++, n++)
      tok[n] = 40000 + (int32_t)((n * 13) % 9000);
    wrote += spill(&v, tok, n, LAYERS, 0);
  }
  double unaligned = (double)wrote / (double)(n * TOKB);
  env_close(&v);
  printf("C=%4u  shared-prompt disk/unique %.3fx  aligned 8x512 writes/unique "
         "%.3fx  unaligned 20 turns writes/unique %.3fx (%.0f B per new token,"
         " unique %llu B)  prefix query served %llu of 1324 tokens%s\n",
         C, shared, aligned, unaligned, (double)wrote / (double)n,
         (unsigned long long)TOKB, (unsigned long long)m,
         m ? (exact ? " bit-exact" : " MISMATCH") : "");
}

/* The disk's limits for one round: fio O_DIRECT write (ending in an fsync)
 * and read of `bytes` in a fresh file. */
static void fio_limits(const char *base, uint64_t bytes, double *wbw,
                       double *rbw) {
  char f[4096];
  snprintf(f, sizeof f, "%s/fio.dat", base);
  bu_fio_job job = {f, "write", 1, 1 << 20, bytes, 8, "io_uring", 1, 0};
  if (bu_fio(wbw, &job) != 0)
    *wbw = 0;
  bu_fio_job rj = {f, "read", 1, 1 << 20, bytes, 8, "io_uring", 0, 1};
  if (bu_fio(rbw, &rj) != 0)
    *rbw = 0;
  unlink(f);
}

/* (e) durable spill of an ntok-token Llama-3-8B-shaped entry vs fio O_DIRECT
 * write, then (f) its cold promote (chunk and entry files dropped from the
 * page cache) vs fio O_DIRECT read of the same bytes, paired per round: fio
 * runs before kvtier in even rounds and after it in odd ones, so a drift of
 * the shared disk within a round favours neither. */
static void run_spill(const char *base, uint32_t C, int rounds, int ntok) {
  enum { L8B = 32 };
  double ratios[16], bws[16], fios[16], pr[16], pbw[16], pfio[16];
  bu_residency cold = {0}; /* the cold promotes' files, every round */
  uint64_t bytes = (uint64_t)ntok * L8B * HEADS * DIM * 2 * 2;
  int k;
  for (k = 0; k < rounds && k < 16; k++) {
    double fbw = 0, frbw = 0;
    if (k % 2 == 0)
      fio_limits(base, bytes, &fbw, &frbw);
    env v;
    if (env_open(&v, base, "e", C, 1))
      exit(1);
    bu_workload w; /* distinct tokens every round (the salt) */
    bu_workload_make(&w, L8B, 0, KVT_DTYPE_F16, HEADS, (size_t)ntok, DIM,
                     50000 + k * 10000);
    const int32_t *tok = w.tokens;
    kvti_snapshot *s;
    kvti_snapshot_create(&s, tok, (size_t)ntok, w.layers, L8B, w.bytes, 0, NULL,
                         NULL);
    kvti_write_opts wo = {KVT_STORAGE_NATIVE, 1, 0600, 0700, 0};
    kvti_chunked_put_result res;
    double t0 = bu_now();
    int rc = kvti_chunked_put(v.ck, v.be, &res, s, &wo);
    double dt = bu_now() - t0;
    kvti_snapshot_free(s);
    /* Cold promote: every file of the store out of the page cache. */
    char h[65], cdir[4200], ddir[4200];
    kvt_token_hash(h, tok, (size_t)ntok);
    snprintf(cdir, sizeof cdir, "%s/chunks", v.dir);
    snprintf(ddir, sizeof ddir, "%s/data", v.dir);
    bu_evict_tree(cdir, &cold);
    bu_evict_tree(ddir, &cold);
    kvt_entry *e = NULL;
    kvti_read_opts ro = {0};
    double t1 = bu_now();
    int prc = rc ? rc : kvti_chunked_get(v.ck, v.be, &e, h, &ro, NULL, NULL);
    double dp = bu_now() - t1;
    kvt_entry_free(e);
    bu_workload_free(&w);
    env_close(&v);
    if (k % 2 == 1)
      fio_limits(base, bytes, &fbw, &frbw);
    if (rc || prc) {
      fprintf(stderr, "%s: %s\n", rc ? "spill" : "promote", kvt_last_error());
      return;
    }
    bws[k] = (double)bytes / dt;
    fios[k] = fbw;
    ratios[k] = fbw > 0 ? bws[k] / fbw : 0;
    pbw[k] = (double)bytes / dp;
    pfio[k] = frbw;
    pr[k] = frbw > 0 ? pbw[k] / frbw : 0;
  }
  rounds = k;
  double bw = bu_median(bws, rounds), fb = bu_median(fios, rounds);
  double ratio = bu_median(ratios, rounds);
  char lim[160];
  snprintf(lim, sizeof lim,
           "fio --rw=write --direct=1 --bs=1M --iodepth=8 --ioengine=io_uring "
           "--end_fsync=1 --size=%lluM",
           (unsigned long long)(bytes >> 20));
  char name[64];
  snprintf(name, sizeof name, "spill_%dtok_8B_C%u", ntok, C);
  bu_report_limit(name, bw / 1048576.0, fb / 1048576.0, ratio, "MiB/s", lim,
                  0.85, -1);
  snprintf(lim, sizeof lim,
           "fio --rw=read --direct=1 --bs=1M --iodepth=8 --ioengine=io_uring "
           "--invalidate=1 --size=%lluM",
           (unsigned long long)(bytes >> 20));
  snprintf(name, sizeof name, "cold_promote_%dtok_8B_C%u", ntok, C);
  bu_report_limit(name, bu_median(pbw, rounds) / 1048576.0,
                  bu_median(pfio, rounds) / 1048576.0, bu_median(pr, rounds),
                  "MiB/s", lim, 0.85, bu_resident_after(&cold));
}

int main(int argc, char **argv) {
  size_t sizes[16] = {16, 32, 64, 128, 256, 512};
  int ns = 6;
  if (argc > 1) {
    char *s = strdup(argv[1]);
    ns = bu_parse_list(sizes, 16, s);
    free(s);
  }
  int rounds = argc > 2 ? atoi(argv[2]) : 9;
  char *base = bu_mkdtemp(NULL);
  bu_header("bench_chunked: chunked native store (8-layer fp16 KV, 32 KiB "
            "per token)",
            base);
  for (int i = 0; i < ns; i++)
    run_size(base, (uint32_t)sizes[i]);
  if (bu_have_fio())
    for (int i = 0; i < ns; i++) {
      run_spill(base, (uint32_t)sizes[i], rounds, 256);
      if (sizes[i] == 256)
        run_spill(base, (uint32_t)sizes[i], rounds, 1024);
    }
  else
    printf("fio not found: spill vs fio O_DIRECT write skipped\n");
  /* The chat workload through the public API with default options
   * (bench/benchchat.h; also `kvtier bench --preset chat`). */
  bu_chat_opts co = {.dir = base,
                     .layers = 8,
                     .turns = 20,
                     .aligned_turns = 8,
                     .convs = 16,
                     .entries = 4,
                     .burst = 16,
                     .rounds = rounds,
                     .fio = 1,
                     .seed = 1};
  bu_chat_result cr;
  if (bu_chat_run(&cr, &co) == 0)
    bu_chat_print(&cr, stdout);
  else
    fprintf(stderr, "chat workload: %s\n", cr.error);
  kvt_test_rmtree(base);
  free(base);
  return 0;
}
