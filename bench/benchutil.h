/*
 * benchutil.h - helpers shared by the bench programs and `kvtier bench`
 * (tools/cmd_bench.c, tools/disk.c): wall-clock timing, the model-shaped layer
 * layouts and seeded workloads, running fio with JSON output and reading its
 * bandwidth, evicting files from the page cache (and measuring what stayed
 * resident), peak/current RSS from /proc, a scratch directory on the disk
 * under test, and the one report-line format every bench target uses ("name
 * value  limit  ratio  target  verdict"). Built as the static library
 * kvt_benchutil, which uses only the public API (include/kvtier.h and
 * include/kvtier_sys.h): the command-line tool links it against the shared
 * library, exactly as an outside program would, and the bench programs
 * against the static one.
 */
#ifndef KVT_BENCHUTIL_H
#define KVT_BENCHUTIL_H

#include "kvtier.h"

#include <stddef.h>
#include <stdint.h>

double bu_now(void);

/* Parses "N,N,..." (modifies s) into up to cap values; returns how many. */
int bu_parse_list(size_t *v, int cap, char *s);

/* The layer layout of a model-shaped entry: descriptors only (dtype, shape,
 * nbytes; data NULL), every tensor in one array the layers point into. */
typedef enum bu_model {
  BU_MODEL_KV,       /* every layer KV: keys, values [1, heads, tokens, dim] */
  BU_MODEL_HYBRID,   /* every 4th layer KV, the others Mamba arrays: a conv
                        state [1, 3, 8192] of dtype and an SSM state (ssm) F32 */
  BU_MODEL_QUANTIZED /* every layer quantized KV: per side packed U32
                        [1, heads, tokens, dim * bits / 32] + scales and
                        biases [1, heads, tokens, dim / group_size] of dtype */
} bu_model;

typedef struct bu_layout_spec {
  uint32_t n_layers;
  bu_model model;
  kvt_dtype dtype;
  int64_t heads, n_tokens, dim;
  uint32_t ssm_ndim; /* BU_MODEL_HYBRID: the SSM state's shape */
  int64_t ssm_shape[4];
  int bits, group_size; /* BU_MODEL_QUANTIZED */
} bu_layout_spec;

typedef struct bu_layout {
  kvt_layer *layers;
  uint32_t n_layers;
  kvt_tensor *tensors; /* n_tensors, in layer order */
  uint32_t n_tensors;
  uint64_t bytes;    /* sum of the tensors' nbytes */
  uint32_t kinds[5]; /* layers per kvt_layer_kind */
} bu_layout;

/* Builds the descriptors of s into l. Returns 0, or -1 when out of memory
 * (l then holds nothing to free). */
int bu_layout_make(bu_layout *l, const bu_layout_spec *s);
/* Frees the descriptors (not the tensors' data). */
void bu_layout_free(bu_layout *l);

/* A seeded, resident workload of the issue-7 shape: n_layers layers, KV keys
 * and values [1, heads, n_tokens, dim] of dtype dt; with hybrid, every 4th
 * layer is KV and the others arrays (a conv state [1, 3, 8192] of dt and an SSM
 * state [1, 64, 128, 128] F32). Tensor data is xorshift-filled (touched, as an
 * engine's KV cache is resident); token i is (i * 2654435761 + salt) % 128000.
 * Aborts on OOM. */
typedef struct bu_workload {
  int32_t *tokens;
  size_t n_tokens;
  kvt_layer *layers;
  uint32_t n_layers;
  uint64_t bytes;   /* tensor bytes */
  bu_layout layout; /* owns layers and their tensors */
} bu_workload;
void bu_workload_make(bu_workload *w, uint32_t n_layers, int hybrid,
                      kvt_dtype dt, int64_t heads, size_t n_tokens, int64_t dim,
                      int32_t salt);
void bu_workload_free(bu_workload *w);

typedef struct bu_fio_job {
  const char *file;
  const char *rw;     /* "write", "read" */
  int direct;         /* 1 = O_DIRECT */
  size_t bs;          /* bytes */
  uint64_t size;      /* bytes */
  int depth;          /* iodepth */
  const char *engine; /* "io_uring", "psync", ... */
  int end_fsync;
  int invalidate; /* 1: fio drops the file's cache before the job */
  int quiet;      /* 1: no message on failure (the caller has a fallback) */
  /* With several files (file "a:b:c"): fio's file_service_type, e.g.
   * "sequential" (one file after the other); NULL: fio's default. */
  const char *file_service;
  /* 1: fio's I/O buffers in transparent huge pages (fio is run with
   * GLIBC_TUNABLES=glibc.malloc.hugetlb=1, so glibc advises its large
   * blocks): an O_DIRECT request is then one device segment per 2 MiB
   * instead of one per 4 KiB page, which some disks (virtio here) read
   * twice as fast. No effect where glibc or the kernel lacks it. */
  int huge_buffers;
  /* > 1: that many jobs over the same file at once (--numjobs, with
   * --group_reporting: *bw is their sum); 0 or 1: one. */
  int numjobs;
} bu_fio_job;

/* Runs fio (spawned with an argument vector, no shell; its stderr discarded);
 * *bw receives bytes/s. Returns 0, or -1 when fio is missing, fails or its
 * output cannot be parsed (a message is printed unless job->quiet). */
int bu_fio(double *bw, const bu_fio_job *job);
/* fio's version line ("fio-3.33") into buf: 0, or -1 when fio cannot run. */
int bu_fio_version(char *buf, size_t cap);
/* Whether fio is on PATH. */
int bu_have_fio(void);

/* fsync + posix_fadvise(DONTNEED) of a file: its pages leave the page cache. */
int bu_drop_cache(const char *path);
/* Same for every regular file below dir (one level of subdirectories, as in
 * data/<hash>/). */
int bu_drop_cache_tree(const char *dir);
/* Drops every regular file directly in dir (not following links) from the
 * page cache and fsyncs dir; *resident (may be NULL) receives the fraction of
 * their pages still cached afterwards (mincore; 0 for no pages). Returns 0, or
 * -1 when dir cannot be opened. */
int bu_evict_dir(const char *dir, double *resident);
/* Page-cache residency of the files a cold read is about to use, counted by
 * the eviction helpers below (mincore over a read-only mapping of each file).
 */
typedef struct bu_residency {
  uint64_t files;  /* regular files evicted */
  uint64_t pages;  /* their pages */
  uint64_t before; /* of those, cached before the eviction */
  uint64_t after;  /* cached after it: what the cold read will find in RAM */
} bu_residency;
/* fdatasync + fadvise(DONTNEED) of one file (links not followed), its pages
 * counted into *acc. Returns 0, or -1 when it cannot be opened (acc
 * unchanged). */
int bu_evict_file(const char *path, bu_residency *acc);
/* The same for every regular file below dir (three levels: data/<hash>/,
 * chunks/<kk>/), counted into *acc; the directories are fsynced. Returns 0, or
 * -1 when dir cannot be opened. */
int bu_evict_tree(const char *dir, bu_residency *acc);
/* Every file a promote of entry token_hash reads in the cache at cache_dir of
 * tier t: data/<hash>/ and, for an entry over a chain, each chunk file of the
 * chain (chunks/<kk>/<key>.kvc, from kvt_tier_entry_chain). Counted into
 * *acc. Returns 0, KVT_EIO when data/<hash>/ cannot be opened (errno set),
 * or the library's error from kvt_tier_entry_chain. */
int bu_evict_entry(kvt_tier *t, const char *cache_dir, const char *token_hash,
                   bu_residency *acc);
/* Fraction of r's pages cached after the eviction (0 for no pages). */
double bu_resident_after(const bu_residency *r);

/* The check every figure measured against a physical limit (fio in the same
 * run) goes through before it is printed. A figure above its limit cannot
 * have been measured on that device (the page cache, a skipped write, or a
 * limit measured low), and a cold read whose files were still cached past
 * BU_COLD_RESIDENT_MAX did not read the disk: either is flagged next to the
 * figure. value and limit in the same unit; limit <= 0 (not measured): never
 * flagged. resident: bu_resident_after of a cold read's files, or < 0 for a
 * figure that is no cold read. */
#define BU_FIG_ABOVE_LIMIT 0x1u
#define BU_FIG_CACHED 0x2u
#define BU_COLD_RESIDENT_MAX 0.01
unsigned bu_figure_flags(double value, double limit, double resident);
/* A short text for flags (never NULL; "" for 0). */
const char *bu_figure_flag_text(unsigned flags);
/* As bu_report_ratio, for a figure against a physical limit: the line also
 * carries bu_figure_flags' verdict (a flagged figure is never a PASS). */
int bu_report_limit(const char *name, double value, double limit, double ratio,
                    const char *unit, const char *limit_desc, double want,
                    double resident);

/* sync, then drops the whole page cache through /proc/sys/vm/drop_caches
 * (root only): 0 or -1. */
int bu_drop_all_caches(void);
/* The reverse: reads every regular file below dir, so its pages are cached
 * (kvtier reads cold files with O_DIRECT, which caches nothing: a warm-promote
 * measurement has to put the pages there first). */
void bu_warm_cache_tree(const char *dir);

uint64_t bu_rss(void);      /* VmRSS, bytes */
uint64_t bu_peak_rss(void); /* VmHWM, bytes */
void bu_reset_peak_rss(void);

/* Creates <base>/kvt-bench-XXXXXX (base NULL: $KVT_BENCH_DIR, else /var/tmp).
 */
char *bu_mkdtemp(const char *base);
/* rm -rf without following symlinks: the tests' helper (tests/testutil.c,
 * linked into the bench programs, not into kvt_benchutil; its header is not
 * included here because its CHECK macros are for tests). */
void kvt_test_rmtree(const char *path);

/* Prints one target line. higher_better: ratio = value/limit (target: ratio >=
 * want), else ratio = value/limit (target: ratio <= want). want <= 0:
 * informational line, no verdict. Returns 1 when the target is met (or
 * informational). */
int bu_report(const char *name, double value, double limit, const char *unit,
              const char *limit_desc, double want, int higher_better);
/* As bu_report with the ratio given (e.g. the median of per-round ratios, each
 * pairing a measurement with the limit measured right before it). */
int bu_report_ratio(const char *name, double value, double limit, double ratio,
                    const char *unit, const char *limit_desc, double want,
                    int higher_better);
/* Prints the header (machine: nproc, memory, disk of dir, kernel, load
 * average). */
void bu_header(const char *title, const char *dir);

/* Median of n doubles (sorts in place). */
double bu_median(double *v, int n);
double bu_max(const double *v, int n);

#endif
