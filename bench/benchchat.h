/*
 * benchchat.h - the chat workload of the chunked native store (issue 13),
 * measured in one run through the public API only, shared by
 * `kvtier bench --preset chat` (tools/cmd_bench_chat.c) and
 * bench/bench_chunked: bytes written per new token and disk bytes / unique KV
 * for an aligned multi-turn chat (every turn ends on a chunk boundary) and an
 * unaligned one (seeded turns of 50-300 tokens); tokens served to a prefix
 * query (a shared system prompt + new tokens, the KV checked bit for bit);
 * a durable spill of 256-token Llama-3-8B-shaped entries against fio's
 * O_DIRECT write and their cold promote against fio's O_DIRECT read, both
 * limits measured right before in the same round (medians of per-round
 * ratios). Part of kvt_benchutil.
 */
#ifndef KVT_BENCHCHAT_H
#define KVT_BENCHCHAT_H

#include "benchutil.h"

#include <stdio.h>

/* The KV of tokens[0, n) for `layers` fp16 KV layers [1, 8, n, 128], offset
 * n: row t of every tensor and head depends only on token t and its position
 * (a deterministic "model"), so shared prefixes have identical KV, as they
 * would in an engine. make returns 0, or -1 when out of memory (free is
 * still needed); free accepts a zeroed or partly made c; same is 1 when entry
 * e holds exactly c's KV. */
typedef struct bu_kv {
  kvt_layer *l;
  kvt_tensor *t; /* layer L's tensors are t[2L], t[2L + 1] */
  uint32_t layers;
  uint64_t bytes;
} bu_kv;
int bu_kv_make(bu_kv *c, const int32_t *tok, size_t n, uint32_t layers);
void bu_kv_free(bu_kv *c);
int bu_kv_same(const kvt_entry *e, const bu_kv *c);

/* What each side of the spill ratio times (printed with it). fio lays its
 * file out before the job starts (created and preallocated with fallocate,
 * 0.02 ms for a fresh 32 MiB file on the VM of docs/PERFORMANCE.md) and reports
 * its runtime in whole milliseconds, rounded up; kvtier's figure is the
 * writer's time per spill, its file's creation and preallocation included,
 * with the protocol's flushes and index commits. */
#define BU_CHAT_FIO_WRITE_TIMED                                                \
  "write: the job's runtime (whole ms, rounded up), from its start through "   \
  "its end_fsync; its file created and preallocated before, untimed"
#define BU_CHAT_SPILL_TIMED                                                    \
  "spill: the writer taking it to its durable acknowledgement (file "          \
  "creation, preallocation, data, every flush, both index commits)"

typedef struct bu_chat_opts {
  const char *dir;       /* scratch directory (caches are made inside) */
  uint32_t chunk_tokens; /* 0: KVT_CHUNK_TOKENS_DEFAULT */
  uint32_t layers;       /* chat workloads: fp16 KV layers (8 heads x 128) */
  int turns;             /* unaligned chat: turns of 50-300 tokens */
  int aligned_turns;     /* aligned chat: turns of one chunk each */
  int convs;             /* prefix workload: conversations sharing the prompt */
  int entries;           /* 256-token Llama-3-8B entries per round */
  int rounds;            /* spill/promote rounds (median) */
  int fio;               /* 0: skip the disk limits */
  int burst;             /* queued spills of the burst figure (0: none) */
  uint64_t seed;
  int keep;                                 /* keep the chat caches */
  void (*step)(void *ctx, const char *msg); /* progress (may be NULL) */
  void *step_ctx;
} bu_chat_opts;

typedef struct bu_chat_mt {
  int turns;
  uint64_t tokens;           /* of the final conversation */
  uint64_t written;          /* bytes written by all spills */
  uint64_t disk;             /* bytes on disk at the end */
  double per_token;          /* written / tokens */
  double written_per_unique; /* written / (tokens * KV bytes per token) */
  double disk_per_unique;
} bu_chat_mt;

typedef struct bu_chat_result {
  uint32_t chunk_tokens, layers;
  uint64_t kv_per_token; /* bytes of KV per token (chat workloads) */
  bu_chat_mt aligned, unaligned;
  /* prefix query: convs x (system prompt 1024 + 256 own), then a new
   * prompt = the system prompt + 300 tokens */
  uint64_t prefix_query_tokens, prefix_served;
  int prefix_exact; /* 1: served KV bit-exact, 0: differs, -1: none */
  double shared_disk_per_unique;
  /* spill / cold promote of 256-token Llama-3-8B entries vs fio */
  int have_fio, spill_rounds;
  uint64_t spill_entry_bytes;
  double spill_bps, fio_write_bps, spill_ratio;
  double spill_ratio_min, spill_ratio_max; /* over the rounds */
  double promote_bps, fio_read_bps, promote_ratio;
  int promote_exact;
  /* a burst of `burst` 256-token spills queued at once, enqueue to flush
   * (wall time), vs fio writing as many files with an fsync each (the
   * ratio's median and its spread over the rounds); how many of them the
   * writer committed in groups (median of rounds). The burst's limit - what
   * flags it - is the disk's: one fio job writing the burst's bytes to one
   * file with one fsync (a group commit may beat the fsync per file, never
   * that). */
  int burst;
  double burst_bps, fio_burst_bps, burst_ratio;
  double burst_ratio_min, burst_ratio_max, fio_burst_seq_bps;
  uint64_t burst_batched;
  unsigned burst_flags;
  /* The cold promotes' files (chunks and entry directories of every round)
   * in the page cache, counted as they were evicted; and bu_figure_flags of
   * the rounds (OR over them) with how many rounds each flagged. */
  bu_residency cold_res;
  double promote_resident; /* bu_resident_after(&cold_res) */
  unsigned spill_flags, promote_flags;
  int spill_flagged_rounds, promote_flagged_rounds;
  char fio_engine[32];
  char fio_write_job[512], fio_read_job[512], fio_burst_job[512];
  char fio_burst_seq_job[512];
  char error[512]; /* when bu_chat_run failed */
} bu_chat_result;

/* Runs every workload. Returns 0, or -1 with r->error set (a spill, lookup
 * or promote failed, or served data differed). */
int bu_chat_run(bu_chat_result *r, const bu_chat_opts *o);
/* The report, one line per figure. */
void bu_chat_print(const bu_chat_result *r, FILE *f);

#endif
