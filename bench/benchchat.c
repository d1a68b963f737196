/*
 * benchchat.c - the chat workload of the chunked native store (see
 * benchchat.h), through the public API only: each workload opens its own
 * tier in a fresh directory under the scratch directory, spills as vllm-mlx's
 * scheduler does (the whole prompt on every eviction, copy mode), and reads
 * kvt_stats for what was written (spill_bytes: entry and chunk files) and
 * what is on disk (disk_bytes: entries + chunks, each chunk once). The KV of
 * a conversation is a deterministic "model": row t of every layer depends
 * only on token t and its position, so shared prefixes have identical KV, as
 * they do in an engine, and anything served can be checked bit for bit.
 */
#define _GNU_SOURCE 1
#include "benchchat.h"

#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define HEADS 8
#define DIM 128

/* rm -rf without following symlinks (kvt_benchutil carries no test
 * helpers: `kvtier bench` links it too). */
static int rm_one(const char *p, const struct stat *st, int flag,
                  struct FTW *f) {
  (void)st;
  (void)f;
  return flag == FTW_DP ? rmdir(p) : unlink(p);
}
static void rm_tree(const char *p) {
  nftw(p, rm_one, 16, FTW_DEPTH | FTW_PHYS);
}

static void say(const bu_chat_opts *o, const char *msg) {
  if (o->step)
    o->step(o->step_ctx, msg);
}

static void fill_row(uint16_t *row, uint32_t tensor, int h, int32_t tok,
                     size_t pos) {
  uint64_t x = (uint64_t)(uint32_t)tok * 0x9e3779b97f4a7c15ull ^
               (uint64_t)pos << 20 ^ (uint64_t)tensor << 44 ^ (uint64_t)h << 56;
  for (int i = 0; i < DIM; i++) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    row[i] = (uint16_t)(0x3c00 | (x & 0x3ff)); /* f16 in [1, 2) */
  }
}

int bu_kv_make(bu_kv *c, const int32_t *tok, size_t n, uint32_t layers) {
  memset(c, 0, sizeof *c);
  c->layers = layers;
  c->l = calloc(layers, sizeof *c->l);
  c->t = calloc((size_t)layers * 2, sizeof *c->t);
  if (!c->l || !c->t)
    return -1;
  for (uint32_t L = 0; L < layers; L++) {
    kvt_layer_init(&c->l[L], KVT_LAYER_KV);
    c->l[L].num_tensors = 2;
    c->l[L].tensors = &c->t[2 * L];
    c->l[L].offset = (int64_t)n;
    for (uint32_t k = 0; k < 2; k++) {
      kvt_tensor *t = &c->t[2 * L + k];
      t->dtype = KVT_DTYPE_F16;
      t->ndim = 4;
      t->shape[0] = 1;
      t->shape[1] = HEADS;
      t->shape[2] = (int64_t)n;
      t->shape[3] = DIM;
      t->nbytes = (uint64_t)HEADS * n * DIM * 2;
      t->data = malloc(t->nbytes ? t->nbytes : 1);
      if (!t->data)
        return -1;
      for (int h = 0; h < HEADS; h++)
        for (size_t p = 0; p < n; p++)
          fill_row((uint16_t *)t->data + ((size_t)h * n + p) * DIM, 2 * L + k,
                   h, tok[p], p);
      c->bytes += t->nbytes;
    }
  }
  return 0;
}

void bu_kv_free(bu_kv *c) {
  for (uint32_t i = 0; c->t && i < c->layers * 2; i++)
    free(c->t[i].data);
  free(c->t);
  free(c->l);
  memset(c, 0, sizeof *c);
}

int bu_kv_same(const kvt_entry *e, const bu_kv *c) {
  if (kvt_entry_num_layers(e) != c->layers)
    return 0;
  for (uint32_t L = 0; L < c->layers; L++) {
    const kvt_layer *l = kvt_entry_layer(e, L);
    if (!l || l->num_tensors != 2)
      return 0;
    for (uint32_t k = 0; k < 2; k++)
      if (l->tensors[k].nbytes != c->l[L].tensors[k].nbytes ||
          memcmp(l->tensors[k].data, c->l[L].tensors[k].data,
                 (size_t)c->l[L].tensors[k].nbytes) != 0)
        return 0;
  }
  return 1;
}

static kvt_tier *tier_open(bu_chat_result *r, const char *dir, uint32_t C,
                           int durable) {
  kvt_options o;
  kvt_options_init(&o, KVT_OPTIONS_VERSION);
  o.cache_dir = dir;
  o.chunk_tokens = C;
  o.durability = durable ? KVT_DURABILITY_FSYNC : KVT_DURABILITY_NONE;
  o.max_size_gb = 1024;
  o.max_entries = 1 << 20;
  o.host_cache_bytes = 0; /* the disk path is what is measured */
  kvt_tier *t = NULL;
  if (kvt_tier_open(&t, &o) != 0 || kvt_tier_start_writer(t) != 0) {
    snprintf(r->error, sizeof r->error, "open %s: %s", dir, kvt_last_error());
    kvt_tier_free(t);
    return NULL;
  }
  return t;
}

static char *subdir(const char *base, const char *tag) {
  size_t n = strlen(base) + strlen(tag) + 2;
  char *p = malloc(n);
  if (p) {
    snprintf(p, n, "%s/%s", base, tag);
    rm_tree(p);
    mkdir(p, 0700);
  }
  return p;
}

/* Spills tokens[0, n) (KV built for them) and waits until it is written. */
static int spill(bu_chat_result *r, kvt_tier *t, const int32_t *tok, size_t n,
                 uint32_t layers) {
  bu_kv c;
  int rc = bu_kv_make(&c, tok, n, layers) == 0 ? 0 : KVT_ENOMEM;
  if (rc == 0)
    rc = kvt_tier_spill(t, tok, n, c.l, layers, c.bytes);
  if (rc == 0)
    rc = kvt_tier_flush(t, -1);
  bu_kv_free(&c);
  if (rc)
    snprintf(r->error, sizeof r->error, "spill of %zu tokens: %s", n,
             kvt_last_error());
  return rc;
}

static void stats_of(kvt_tier *t, kvt_stats *s) {
  kvt_stats_init(s, KVT_STATS_VERSION);
  kvt_tier_stats(s, t);
}

/* A multi-turn chat: turn k adds lens[k] tokens and spills the whole
 * conversation. */
static int multi_turn(bu_chat_result *r, const bu_chat_opts *o, const char *tag,
                      const size_t *lens, int turns, int32_t base,
                      bu_chat_mt *mt) {
  char *dir = subdir(o->dir, tag);
  kvt_tier *t = dir ? tier_open(r, dir, r->chunk_tokens, 0) : NULL;
  int rc = t ? 0 : -1;
  size_t total = 0;
  for (int k = 0; k < turns; k++)
    total += lens[k];
  int32_t *tok = malloc((total ? total : 1) * sizeof *tok);
  if (!tok)
    rc = -1;
  for (size_t i = 0; tok && i < total; i++)
    tok[i] = base + (int32_t)((i * 7919u) % 30000u);
  size_t n = 0;
  for (int k = 0; rc == 0 && k < turns; k++) {
    n += lens[k];
    rc = spill(r, t, tok, n, r->layers);
  }
  if (rc == 0) {
    kvt_stats s;
    stats_of(t, &s);
    mt->turns = turns;
    mt->tokens = n;
    mt->written = s.spill_bytes;
    mt->disk = s.disk_bytes;
    mt->per_token = n ? (double)s.spill_bytes / (double)n : 0;
    double unique = (double)n * (double)r->kv_per_token;
    mt->written_per_unique = unique > 0 ? (double)s.spill_bytes / unique : 0;
    mt->disk_per_unique = unique > 0 ? (double)s.disk_bytes / unique : 0;
  }
  free(tok);
  kvt_tier_free(t);
  if (dir && !o->keep)
    rm_tree(dir);
  free(dir);
  return rc;
}

/* convs conversations over one 1024-token system prompt, then a new prompt =
 * the system prompt + 300 tokens: lookup_prefix + read_entry (the drop-in's
 * _read_entry(prompt[:m], file_path)), the served KV checked. */
static int prefix_query(bu_chat_result *r, const bu_chat_opts *o) {
  enum { SYS = 1024, OWN = 256, NEW = 300 };
  char *dir = subdir(o->dir, "chat-prefix");
  kvt_tier *t = dir ? tier_open(r, dir, r->chunk_tokens, 0) : NULL;
  int rc = t ? 0 : -1;
  int32_t tok[SYS + (OWN > NEW ? OWN : NEW)];
  for (int i = 0; i < SYS; i++)
    tok[i] = 100 + i;
  for (int c = 0; rc == 0 && c < o->convs; c++) {
    for (int i = 0; i < OWN; i++)
      tok[SYS + i] = 20000 + c * 300 + i;
    rc = spill(r, t, tok, SYS + OWN, r->layers);
  }
  if (rc == 0) {
    kvt_stats s;
    stats_of(t, &s);
    r->shared_disk_per_unique =
        (double)s.disk_bytes /
        ((double)(SYS + o->convs * OWN) * (double)r->kv_per_token);
  }
  for (int i = 0; i < NEW; i++)
    tok[SYS + i] = 90000 + i;
  r->prefix_query_tokens = SYS + NEW;
  r->prefix_exact = -1;
  kvt_entry_info info;
  if (rc == 0 && kvt_tier_lookup_prefix(&info, t, tok, SYS + NEW) == 0) {
    kvt_entry *e = NULL;
    r->prefix_served = info.num_tokens;
    if (kvt_tier_read_entry(&e, t, tok, (size_t)info.num_tokens,
                            info.token_hash) == 0) {
      bu_kv ref;
      if (bu_kv_make(&ref, tok, (size_t)info.num_tokens, r->layers) == 0)
        r->prefix_exact = bu_kv_same(e, &ref);
      bu_kv_free(&ref);
      kvt_entry_free(e);
    } else {
      snprintf(r->error, sizeof r->error, "read of the %llu-token prefix: %s",
               (unsigned long long)info.num_tokens, kvt_last_error());
      rc = -1;
    }
  }
  kvt_tier_free(t);
  if (dir && !o->keep)
    rm_tree(dir);
  free(dir);
  return rc;
}

/* fio with the first engine that works here (io_uring, libaio, psync). */
static int fio_run(bu_chat_result *r, double *bw, const char *file,
                   const char *shown, const char *rw, uint64_t size, int times,
                   int huge) {
  static const char *engines[] = {"io_uring", "libaio", "psync"};
  for (int i = 0; i < 3; i++) {
    if (r->fio_engine[0] && strcmp(r->fio_engine, engines[i]) != 0)
      continue;
    int wr = !strcmp(rw, "write");
    bu_fio_job j = {file,       rw, 1, 1u << 20, size, 8,
                    engines[i], wr, 1, 1,        NULL, huge};
    if (bu_fio(bw, &j) == 0) {
      snprintf(r->fio_engine, sizeof r->fio_engine, "%s", engines[i]);
      char *job = !strcmp(rw, "write") ? r->fio_write_job : r->fio_read_job;
      snprintf(job, 512,
               "%d x %sfio --name=kvtbench --filename=%.300s --rw=%s --bs=1M "
               "--size=%llu --direct=1 --ioengine=%s --iodepth=8 "
               "--end_fsync=%d --invalidate=1 --numjobs=1",
               times, huge ? "GLIBC_TUNABLES=glibc.malloc.hugetlb=1 " : "",
               shown, rw, (unsigned long long)size, engines[i], wr);
      return 0;
    }
  }
  return -1;
}

/* The read limit is also one fio job over the n files back to back, as
 * kvtier's promotes of a round read them one after the other (a 32 MiB job
 * spends much of its time starting, which a promote does not), in 4 MiB
 * requests, the size kvtier's cold reads reach the disk in. The faster of
 * the two is the limit (*bw raised if this one is faster); its job line is
 * appended to r->fio_read_job. Nothing changes when the job fails. */
static void fio_read_all(bu_chat_result *r, double *bw, const char *base,
                         uint64_t size, int n) {
  char files[4096] = "";
  size_t len = 0;
  for (int i = 0; i < n && len < sizeof files - 1; i++)
    len += (size_t)snprintf(files + len, sizeof files - len, "%s%s.%d",
                            i ? ":" : "", base, i);
  if (len >= sizeof files - 1)
    return;
  bu_fio_job j;
  memset(&j, 0, sizeof j);
  j.file = files;
  j.rw = "read";
  j.direct = 1;
  j.bs = 4u << 20;
  j.size = size * (uint64_t)n;
  j.depth = 8;
  j.engine = r->fio_engine[0] ? r->fio_engine : "io_uring";
  j.invalidate = 1;
  j.quiet = 1;
  j.file_service = "sequential";
  j.huge_buffers = 1;
  double b = 0;
  if (bu_fio(&b, &j) != 0 || b <= 0)
    return;
  if (b > *bw)
    *bw = b;
  size_t at = strlen(r->fio_read_job); /* fio_run's line of this round */
  snprintf(r->fio_read_job + at, sizeof r->fio_read_job - at,
           "; the faster of that and 1 x the %d files in one job "
           "(--filename=<f.0>:...:<f.%d> --bs=4M --size=%llu "
           "--file_service_type=sequential)",
           n, n - 1, (unsigned long long)(size * (uint64_t)n));
}

/* The disk's own limit for what the spills (or promotes) of one round do:
 * `n` separate durable writes (or reads) of `size` bytes, each a fresh fio
 * file as each spill writes fresh files (one fio job of n x size with a single
 * fsync at its end would credit the disk with n - 1 cache flushes that every
 * durable spill must pay, ~30 ms each on the target VMs). *bw = n * size over
 * the jobs' summed times. Reads land in huge pages, as kvtier's cold reads do
 * (its buffer pool): into 4 KiB pages each 1 MiB request is 256 segments,
 * split in two on a disk of 254, and fio's figure is then below the disk's.
 * Writes run both ways, fio's buffers in 4 KiB pages and in huge pages, and
 * the faster is the limit: kvtier's writer stages what it writes in huge
 * pages where it can (engine/fwriter.c) and writes from the caller's pages
 * where it cannot. The files are left for the read limit (<base>.<i>);
 * fio_limit_clean removes them. */
static int fio_limit(bu_chat_result *r, double *bw, const char *base,
                     const char *rw, uint64_t size, int n) {
  int wr = !strcmp(rw, "write");
  char best_job[sizeof r->fio_write_job] = "";
  *bw = 0;
  for (int huge = wr ? 0 : 1; huge < 2; huge++) {
    double secs = 0;
    for (int i = 0; i < n; i++) {
      char f[4300], shown[4300];
      snprintf(f, sizeof f, "%s.%d", base, i);
      snprintf(shown, sizeof shown, "%s.<i>", base);
      double b = 0;
      if (wr)
        unlink(f);
      if (fio_run(r, &b, f, shown, rw, size, n, huge) != 0 || b <= 0)
        return -1;
      secs += (double)size / b;
    }
    double kind = secs > 0 ? (double)size * n / secs : 0;
    if (kind > *bw) {
      *bw = kind;
      if (wr)
        memcpy(best_job, r->fio_write_job, sizeof best_job);
    }
  }
  if (wr) /* the faster kind's line, and that both ran */
    snprintf(r->fio_write_job, sizeof r->fio_write_job,
             "%.440s (the faster of 4 KiB-page and huge-page buffers)",
             best_job);
  if (!strcmp(rw, "read") && n > 1)
    fio_read_all(r, bw, base, size, n);
  return 0;
}
static void fio_limit_clean(const char *base, int n) {
  for (int i = 0; i < n; i++) {
    char f[4300];
    snprintf(f, sizeof f, "%s.%d", base, i);
    unlink(f);
  }
}

/* The burst's fio figures: nb files with an fsync each (*fio), then the
 * disk's limit, one job of all their bytes with one fsync (*seq, its job line
 * in r->fio_burst_seq_job). */
static void burst_fio(bu_chat_result *r, const char *fio_file, uint64_t size,
                      int nb, double *fio, double *seq) {
  if (!r->have_fio)
    return;
  if (fio_limit(r, fio, fio_file, "write", size, nb) != 0)
    *fio = 0;
  memcpy(r->fio_burst_job, r->fio_write_job, sizeof r->fio_burst_job);
  char base[4200];
  snprintf(base, sizeof base, "%.4190s.seq", fio_file);
  if (fio_limit(r, seq, base, "write", size * (uint64_t)nb, 1) != 0)
    *seq = 0;
  memcpy(r->fio_burst_seq_job, r->fio_write_job, sizeof r->fio_burst_seq_job);
  fio_limit_clean(base, 1);
}

/* One round of the burst figure: `nb` distinct 256-token entries queued at
 * once (no-copy spills) on a fresh durable tier (the writer running, as under
 * an engine's eviction), timed from the first enqueue to the flush's return;
 * fio first or last (as the spill rounds) writing nb files of the same size
 * with an fsync each, then their bytes in one job. *bps, *fio, *seq and
 * *batched receive the round's figures. */
static int burst_round(bu_chat_result *r, const bu_chat_opts *o, int k,
                       const bu_workload *w, int nb, double *bps, double *fio,
                       double *seq, uint64_t *batched) {
  char fio_file[4200];
  snprintf(fio_file, sizeof fio_file, "%s/fio-burst.dat", o->dir);
  int fio_first = k % 2 == 0;
  char keep[sizeof r->fio_write_job]; /* the single spills' job line */
  memcpy(keep, r->fio_write_job, sizeof keep);
  *fio = *seq = 0;
  if (fio_first)
    burst_fio(r, fio_file, w[0].bytes, nb, fio, seq);
  char tag[32];
  snprintf(tag, sizeof tag, "chat-burst-%d", k);
  char *dir = subdir(o->dir, tag);
  kvt_tier *t = dir ? tier_open(r, dir, r->chunk_tokens, 1) : NULL;
  if (!t) {
    free(dir);
    return -1;
  }
  kvt_stats s0, s1;
  stats_of(t, &s0);
  int rc = 0;
  double t0 = bu_now();
  /* No-copy spills (the workload's buffers stay untouched until the flush
   * returns): the burst is queued at once, as an engine handing over
   * immutable arrays queues it, and what is timed is the writer's work. */
  for (int i = 0; rc == 0 && i < nb; i++)
    rc = kvt_tier_spill_nocopy(t, w[i].tokens, w[i].n_tokens, w[i].layers,
                               w[i].n_layers, w[i].bytes, NULL, NULL);
  if (rc == 0)
    rc = kvt_tier_flush(t, -1);
  double dt = bu_now() - t0;
  stats_of(t, &s1);
  if (rc == 0 && s1.spill_count - s0.spill_count != (uint64_t)nb)
    rc = -1;
  if (rc)
    snprintf(r->error, sizeof r->error, "burst of %d spills: %s", nb,
             kvt_last_error());
  *bps = rc == 0 && dt > 0 ? (double)w[0].bytes * nb / dt : 0;
  *batched = s1.spills_batched - s0.spills_batched;
  kvt_tier_close(t, -1);
  kvt_tier_free(t);
  rm_tree(dir);
  free(dir);
  if (!fio_first)
    burst_fio(r, fio_file, w[0].bytes, nb, fio, seq);
  fio_limit_clean(fio_file, nb);
  if (r->have_fio)
    memcpy(r->fio_write_job, keep, sizeof keep);
  return rc;
}

/* The smallest and largest of v[0, k), k >= 1: a figure's spread over the
 * rounds. */
static void spread(const double *v, int k, double *lo, double *hi) {
  *lo = *hi = v[0];
  for (int i = 1; i < k; i++) {
    *lo = v[i] < *lo ? v[i] : *lo;
    *hi = v[i] > *hi ? v[i] : *hi;
  }
}

/* Rounds of (fio first in even rounds, last in odd ones): fio O_DIRECT
 * durable writes of the entries' bytes (fio_limit), the durable spill of
 * `entries` 256-token Llama-3-8B-shaped entries (writer throughput:
 * spill_latency_sum), fio O_DIRECT read, then their cold promote (files
 * fsynced and evicted from the page cache first). */
static int spill_promote(bu_chat_result *r, const bu_chat_opts *o) {
  enum { MAXR = 16 };
  double sb[MAXR], fw[MAXR], sr[MAXR], pb[MAXR], frd[MAXR], pr[MAXR];
  int rounds = o->rounds < 1 ? 1 : o->rounds > MAXR ? MAXR : o->rounds;
  int ne = o->entries < 1 ? 1 : o->entries;
  int nb = o->burst < 0 ? 0 : o->burst > 64 ? 64 : o->burst;
  int nw = nb > ne ? nb : ne;
  double bb[MAXR], bf[MAXR], br[MAXR], bq[MAXR], bs[MAXR];
  bu_workload *w = calloc((size_t)nw, sizeof *w);
  if (!w)
    return -1;
  for (int i = 0; i < nw; i++)
    bu_workload_make(&w[i], 32, 0, KVT_DTYPE_F16, 8, 256, 128,
                     (int32_t)(o->seed * 1000 + (uint64_t)i * 7 + 1));
  r->spill_entry_bytes = w[0].bytes;
  uint64_t total = w[0].bytes * (uint64_t)ne;
  r->have_fio = o->fio && bu_have_fio();
  r->promote_exact = 1;
  int rc = 0, k;
  char fio_file[4200];
  snprintf(fio_file, sizeof fio_file, "%s/fio.dat", o->dir);
  for (k = 0; rc == 0 && k < rounds; k++) {
    char msg[96];
    snprintf(msg, sizeof msg, "spill/promote round %d of %d", k + 1, rounds);
    say(o, msg);
    fw[k] = frd[k] = 0;
    /* fio before kvtier in even rounds, after it in odd ones: a drift of the
     * shared disk within a round favours neither. */
    int fio_first = k % 2 == 0;
    if (fio_first && r->have_fio &&
        fio_limit(r, &fw[k], fio_file, "write", w[0].bytes, ne) != 0)
      r->have_fio = 0;
    char tag[32];
    snprintf(tag, sizeof tag, "chat-spill-%d", k);
    char *dir = subdir(o->dir, tag);
    kvt_tier *t = dir ? tier_open(r, dir, r->chunk_tokens, 1) : NULL;
    if (!t) {
      rc = -1;
      free(dir);
      break;
    }
    kvt_stats s0, s1;
    stats_of(t, &s0);
    for (int i = 0; rc == 0 && i < ne; i++) {
      rc = kvt_tier_spill(t, w[i].tokens, w[i].n_tokens, w[i].layers,
                          w[i].n_layers, w[i].bytes);
      if (rc == 0)
        rc = kvt_tier_flush(t, -1);
      if (rc)
        snprintf(r->error, sizeof r->error, "durable spill: %s",
                 kvt_last_error());
    }
    stats_of(t, &s1);
    double busy = s1.spill_latency_sum - s0.spill_latency_sum;
    sb[k] = busy > 0 ? (double)total / busy : 0;
    if (!fio_first && r->have_fio &&
        fio_limit(r, &fw[k], fio_file, "write", w[0].bytes, ne) != 0)
      r->have_fio = 0;
    if (fio_first && r->have_fio &&
        fio_limit(r, &frd[k], fio_file, "read", w[0].bytes, ne) != 0)
      r->have_fio = 0;
    /* Cold: every file of the cache (chunks and entries) fsynced and
     * dropped from the cache, what stays cached counted for the report. */
    char sub[4400];
    bu_residency res = {0};
    snprintf(sub, sizeof sub, "%s/chunks", dir);
    bu_evict_tree(sub, &res);
    snprintf(sub, sizeof sub, "%s/data", dir);
    bu_evict_tree(sub, &res);
    r->cold_res.files += res.files;
    r->cold_res.pages += res.pages;
    r->cold_res.before += res.before;
    r->cold_res.after += res.after;
    double busy_p = 0;
    for (int i = 0; rc == 0 && i < ne; i++) {
      kvt_entry *e = NULL;
      double t0 = bu_now();
      rc = kvt_tier_promote(&e, t, w[i].tokens, w[i].n_tokens, NULL);
      busy_p += bu_now() - t0;
      if (rc) {
        snprintf(r->error, sizeof r->error, "cold promote: %s",
                 kvt_last_error());
        break;
      }
      for (uint32_t L = 0; L < w[i].n_layers; L++) {
        const kvt_layer *l = kvt_entry_layer(e, L);
        for (uint32_t j = 0; l && j < l->num_tensors; j++)
          if (l->tensors[j].nbytes != w[i].layers[L].tensors[j].nbytes ||
              memcmp(l->tensors[j].data, w[i].layers[L].tensors[j].data,
                     (size_t)l->tensors[j].nbytes))
            r->promote_exact = 0;
      }
      kvt_entry_free(e);
    }
    pb[k] = busy_p > 0 ? (double)total / busy_p : 0;
    if (!fio_first && r->have_fio &&
        fio_limit(r, &frd[k], fio_file, "read", w[0].bytes, ne) != 0)
      r->have_fio = 0;
    fio_limit_clean(fio_file, ne);
    if (rc == 0 && nb > 0) {
      uint64_t q = 0;
      rc = burst_round(r, o, k, w, nb, &bb[k], &bf[k], &bs[k], &q);
      bq[k] = (double)q;
      br[k] = bf[k] > 0 ? bb[k] / bf[k] : 0;
      r->burst_flags |= bu_figure_flags(bb[k], r->have_fio ? bs[k] : 0, -1);
    }
    sr[k] = fw[k] > 0 ? sb[k] / fw[k] : 0;
    pr[k] = frd[k] > 0 ? pb[k] / frd[k] : 0;
    unsigned fs = bu_figure_flags(sb[k], r->have_fio ? fw[k] : 0, -1);
    unsigned fp = bu_figure_flags(pb[k], r->have_fio ? frd[k] : 0,
                                  bu_resident_after(&res));
    r->spill_flags |= fs;
    r->promote_flags |= fp;
    r->spill_flagged_rounds += fs != 0;
    r->promote_flagged_rounds += fp != 0;
    kvt_tier_free(t);
    rm_tree(dir);
    free(dir);
  }
  r->spill_rounds = k;
  r->promote_resident = bu_resident_after(&r->cold_res);
  if (rc == 0 && k > 0) {
    r->spill_bps = bu_median(sb, k);
    r->fio_write_bps = bu_median(fw, k);
    r->spill_ratio = bu_median(sr, k);
    spread(sr, k, &r->spill_ratio_min, &r->spill_ratio_max);
    r->promote_bps = bu_median(pb, k);
    r->fio_read_bps = bu_median(frd, k);
    r->promote_ratio = bu_median(pr, k);
    r->burst = nb;
    if (nb > 0) {
      r->burst_bps = bu_median(bb, k);
      r->fio_burst_bps = bu_median(bf, k);
      r->burst_ratio = bu_median(br, k);
      r->fio_burst_seq_bps = bu_median(bs, k);
      spread(br, k, &r->burst_ratio_min, &r->burst_ratio_max);
      r->burst_batched = (uint64_t)bu_median(bq, k);
    }
  }
  for (int i = 0; i < nw; i++)
    bu_workload_free(&w[i]);
  free(w);
  if (rc == 0 && !r->promote_exact) {
    snprintf(r->error, sizeof r->error,
             "a promoted entry differs from what was spilled");
    rc = -1;
  }
  return rc;
}

int bu_chat_run(bu_chat_result *r, const bu_chat_opts *o) {
  memset(r, 0, sizeof *r);
  r->chunk_tokens =
      o->chunk_tokens ? o->chunk_tokens : KVT_CHUNK_TOKENS_DEFAULT;
  r->layers = o->layers ? o->layers : 8;
  r->kv_per_token = (uint64_t)r->layers * 2 * HEADS * DIM * 2;
  /* Aligned: every turn one chunk, so each spill ends on a boundary. */
  int at = o->aligned_turns > 0 ? o->aligned_turns : 8;
  int ut = o->turns > 0 ? o->turns : 20;
  size_t *lens = calloc((size_t)(at > ut ? at : ut), sizeof *lens);
  if (!lens) {
    snprintf(r->error, sizeof r->error, "out of memory");
    return -1;
  }
  for (int k = 0; k < at; k++)
    lens[k] = r->chunk_tokens;
  say(o, "aligned multi-turn chat");
  int rc = multi_turn(r, o, "chat-aligned", lens, at, 30000, &r->aligned);
  /* Unaligned: seeded turns of 50-300 tokens. */
  uint64_t x = o->seed * 6364136223846793005ull + 1442695040888963407ull;
  for (int k = 0; k < ut; k++) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    lens[k] = 50 + (size_t)((x >> 33) % 251);
  }
  if (rc == 0) {
    say(o, "unaligned multi-turn chat");
    rc = multi_turn(r, o, "chat-unaligned", lens, ut, 60000, &r->unaligned);
  }
  free(lens);
  if (rc == 0) {
    say(o, "shared system prompt and prefix query");
    rc = prefix_query(r, o);
  }
  if (rc == 0 && r->prefix_exact == 0) {
    snprintf(r->error, sizeof r->error,
             "the served prefix differs from what was spilled");
    rc = -1;
  }
  if (rc == 0 && o->entries > 0 && o->rounds > 0)
    rc = spill_promote(r, o);
  return rc ? -1 : 0;
}

static void mt_line(FILE *f, const char *name, const bu_chat_mt *m,
                    uint64_t kvpt) {
  fprintf(f,
          "%-22s %3d turns, %5llu tokens: %8.0f B written per new token "
          "(%.3f x its KV of %llu B), writes/unique %.3fx, disk/unique "
          "%.3fx\n",
          name, m->turns, (unsigned long long)m->tokens, m->per_token,
          kvpt ? m->per_token / (double)kvpt : 0, (unsigned long long)kvpt,
          m->written_per_unique, m->disk_per_unique);
}

void bu_chat_print(const bu_chat_result *r, FILE *f) {
  fprintf(f,
          "chat workload: chunk_tokens %u, %u-layer fp16 KV (8 heads x 128, "
          "%llu B per token)\n",
          r->chunk_tokens, r->layers, (unsigned long long)r->kv_per_token);
  mt_line(f, "aligned multi-turn", &r->aligned, r->kv_per_token);
  mt_line(f, "unaligned multi-turn", &r->unaligned, r->kv_per_token);
  fprintf(f,
          "prefix query           %llu of %llu tokens served (system prompt "
          "1024 + 300 new)%s; shared-prompt disk/unique %.3fx\n",
          (unsigned long long)r->prefix_served,
          (unsigned long long)r->prefix_query_tokens,
          r->prefix_exact > 0    ? ", bit-exact"
          : r->prefix_exact == 0 ? ", MISMATCH"
                                 : "",
          r->shared_disk_per_unique);
  if (!r->spill_rounds)
    return;
  fprintf(f, "256-token Llama-3-8B entries (%.2f MiB), median of %d rounds:\n",
          (double)r->spill_entry_bytes / 1048576.0, r->spill_rounds);
  if (r->have_fio) {
    fprintf(f,
            "  spill (durable, writer) %8.1f MiB/s  fio O_DIRECT write %8.1f "
            "MiB/s  ratio %.2f (rounds %.2f-%.2f; target 0.95)\n",
            r->spill_bps / 1048576.0, r->fio_write_bps / 1048576.0,
            r->spill_ratio, r->spill_ratio_min, r->spill_ratio_max);
    fprintf(f,
            "  promote (cold)          %8.1f MiB/s  fio O_DIRECT read  %8.1f "
            "MiB/s  ratio %.2f (target 0.95)\n",
            r->promote_bps / 1048576.0, r->fio_read_bps / 1048576.0,
            r->promote_ratio);
    if (r->burst > 0) {
      fprintf(f,
              "  burst of %d (no-copy)  %8.1f MiB/s  fio %d files, fsync each "
              "%8.1f MiB/s  ratio %.2f (rounds %.2f-%.2f; target 1.2, the "
              "disk's limit %.2f); %llu of %d spills group-committed\n",
              r->burst, r->burst_bps / 1048576.0, r->burst,
              r->fio_burst_bps / 1048576.0, r->burst_ratio, r->burst_ratio_min,
              r->burst_ratio_max,
              r->fio_burst_bps > 0 ? r->fio_burst_seq_bps / r->fio_burst_bps
                                   : 0,
              (unsigned long long)r->burst_batched, r->burst);
      fprintf(f,
              "  burst's disk limit      fio one job of its bytes, one fsync "
              "%8.1f MiB/s  (burst / limit %.2f)\n",
              r->fio_burst_seq_bps / 1048576.0,
              r->fio_burst_seq_bps > 0 ? r->burst_bps / r->fio_burst_seq_bps
                                       : 0);
    }
    fprintf(f, "  fio jobs: %s\n            %s\n", r->fio_write_job,
            r->fio_read_job);
    fprintf(f, "  timed: fio %s\n         kvtier %s\n", BU_CHAT_FIO_WRITE_TIMED,
            BU_CHAT_SPILL_TIMED);
    if (r->burst > 0)
      fprintf(f, "  burst fio: %s\n             %s\n", r->fio_burst_job,
              r->fio_burst_seq_job);
  }
  if (r->burst_flags)
    fprintf(f, "  FLAGGED burst: %s\n", bu_figure_flag_text(r->burst_flags));
  fprintf(f,
          "  page cache over the cold promotes' %llu files (chunks and "
          "entries): %.1f%% resident before eviction, %.2f%% at the read\n",
          (unsigned long long)r->cold_res.files,
          r->cold_res.pages
              ? 100.0 * (double)r->cold_res.before / (double)r->cold_res.pages
              : 0.0,
          100 * r->promote_resident);
  if (r->spill_flags)
    fprintf(f, "  FLAGGED spill in %d of %d rounds: %s\n",
            r->spill_flagged_rounds, r->spill_rounds,
            bu_figure_flag_text(r->spill_flags));
  if (r->promote_flags)
    fprintf(f, "  FLAGGED promote (cold) in %d of %d rounds: %s\n",
            r->promote_flagged_rounds, r->spill_rounds,
            bu_figure_flag_text(r->promote_flags));
  if (!r->have_fio)
    fprintf(f,
            "  spill (durable, writer) %8.1f MiB/s, promote (cold) %8.1f "
            "MiB/s, burst of %d %8.1f MiB/s (fio not run: no ratios)\n",
            r->spill_bps / 1048576.0, r->promote_bps / 1048576.0, r->burst,
            r->burst_bps / 1048576.0);
}
