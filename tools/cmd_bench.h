/*
 * cmd_bench.h - private to `kvtier bench` (cmd_bench.c runs the workload,
 * cmd_bench_report.c renders what it measured): the run's configuration,
 * workload, per-phase figures and the bench_run state both files share, and
 * the report functions. Like every tools/ file it sees only the public API
 * (include/kvtier.h) and bench/'s benchutil.h.
 */
#ifndef KVT_TOOLS_CMD_BENCH_H
#define KVT_TOOLS_CMD_BENCH_H

#include "benchutil.h"
#include "cli.h"
#include "disk.h"

#include <pthread.h>
#include <stdint.h>

typedef struct bench_cfg {
  const char *preset;
  int entries, tokens;
  kvt_dtype dtype;
  int storage, durability;
  int quick, keep, json, progress, no_disk, drop_caches;
  int chunk_tokens; /* --chunk-tokens: -1 the library default, 0 off */
  uint64_t seed, disk_size;
} bench_cfg;

typedef struct workload {
  bu_layout lay; /* one entry's layers; tensors re-pointed per entry */
  unsigned char *pool;
  uint64_t pool_bytes;
  int32_t **tokens;  /* per entry */
  int32_t **queries; /* per entry: tokens + 16 more, for prefix lookups */
  char (*hashes)[KVT_HASH_HEX_LEN + 1];
} workload;

typedef struct spill_track {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  uint64_t done, failed;
  double *done_t; /* completion time of the i-th spill (FIFO writer) */
  uint64_t cap;
  char err[512];
} spill_track;

typedef struct verify_count {
  uint64_t exact, skipped, mismatched;
  char first_bad[256];
} verify_count;

typedef struct phase {
  uint64_t count, bytes;
  double seconds; /* sum of per-operation times */
  double p50, p99;
} phase;

/* Everything one `kvtier bench` run holds; each step below reads and fills
 * it. A step returns 0 to go on, or -1 after end_run recorded why the run
 * stops (code and fail), and the clean-up in finish() undoes what the steps
 * did, whichever step stopped. */
typedef struct bench_run {
  bench_cfg c;
  int verbose;
  char dir[4096];
  int remove_dir; /* the bench created dir: remove it at the end (no --keep) */
  char fsname[32];
  workload w;
  spill_track trk;
  double *lat;   /* per-operation latencies of the current phase */
  double *enq_t; /* when spill i was enqueued */
  cli_progress pg;
  disk_result disk;
  kvt_tier *t;
  kvt_stats st;
  phase producer, spill, spill_e2e, lookup[2], warm, cold;
  size_t nlook;
  verify_count vc;
  /* The page cache over every file the cold rounds read (entry directories
   * and chunk files), counted as each entry is evicted before its cold read. */
  bu_residency cold_res;
  int code, reported;
  char fail[8192];
} bench_run;

/* The figures both reports print, derived from the run. */
typedef struct bench_figs {
  double bps_spill, bps_e2e, bps_warm, bps_cold, bps_prod;
  uint64_t mem_total;
  double resident; /* fraction of the cold reads' pages cached at the read */
  double resident_before; /* ... before their eviction */
  /* bu_figure_flags of each figure against its limit */
  unsigned flag_spill, flag_e2e, flag_warm, flag_cold;
  int ratios; /* the disk was measured: print ratios */
  const char *dur, *cold_method;
} bench_figs;

/* Fills g from the finished run r. */
void bench_figures(bench_figs *g, const bench_run *r);
/* Step 8a: the report as one JSON document on stdout. */
void bench_report_json(const bench_run *r, const bench_figs *g);
/* Step 8b: the report as text on stdout. */
void bench_report_text(const bench_run *r, const bench_figs *g);

/* `kvtier bench --preset chat` (cmd_bench_chat.c): the flags of cmd_bench,
 * the scratch DIR (NULL: a fresh one). Returns the exit code. */
int cli_bench_chat(cli_flag *f, size_t nf, const char *dir);

#endif
