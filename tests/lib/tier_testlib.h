/*
 * tier_testlib.h - helpers shared by the tier tests (test_tier*.c,
 * test_promote*.c, the tier reliability tests): spilling a test entry
 * (entry_testlib.h), opening a tier on a fresh temporary directory, counting
 * budget callbacks, stored-entry paths, flipping bytes in a stored file and
 * comparing trimmed rows. Fault injection (failing or stalling the Nth call)
 * is faultio.h, included here for the tests that use it. Part of the test
 * library (tests/lib); definitions in tier_testlib.c.
 */
#ifndef KVT_TIER_TESTLIB_H
#define KVT_TIER_TESTLIB_H

#include "entry_testlib.h"
#include "base/io.h"
#include "faultio.h"
#include "testutil.h"
#include "kvtier.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* kvt_tier_spill of e (its memory_bytes as the RAM size). */
int t_spill(kvt_tier *t, const t_entry *e);

/* Default options on a fresh temporary directory. */
kvt_options t_opts(const char *tag);

/* kvt_tier_open, REQUIRE'd to succeed. */
kvt_tier *t_open(const kvt_options *o);

/* kvt_tier_stats, REQUIRE'd to succeed. */
kvt_stats t_stats(kvt_tier *t);

/* A clock for kvt_options.clock_fn that reads t_clock_now (ctx unused):
 * a test sets the time its tier sees. */
extern double t_clock_now;
double t_clock(void *ctx);

/* Budget bookkeeping: counts calls and bytes; refuses when limit would be
 * exceeded. */
typedef struct t_budget {
  pthread_mutex_t mu;
  uint64_t limit, used;
  int reserves, releases, refusals;
  pthread_t owner; /* callbacks must run on this thread when check_thread */
  int check_thread, wrong_thread;
} t_budget;

/* Zeroed bookkeeping with the given limit. */
void t_budget_init(t_budget *b, uint64_t limit);

/* The kvt_promote_opts budget callbacks over a t_budget (ctx). */
int t_reserve(void *ctx, uint64_t n);

void t_release(void *ctx, uint64_t n);
/* Default promote options, with b's callbacks when b is not NULL. */
kvt_promote_opts t_popts(t_budget *b);

/* Path of a stored entry's directory / a file in it (malloc'ed). */
char *t_entry_path(kvt_tier *t, const int32_t *tokens, size_t n,
                   const char *file);

/* Flips one byte at offset off (from the end when off < 0) of path. */
int t_flip(const char *path, long off);

/* The chunked tests' spill: `layers` KV layers t_kv_tokens(tok, n, T, 8, L)
 * (KV a function of the tokens, so shared prefixes share their KV) spilled
 * with memory_bytes mem. Returns kvt_tier_spill's code. */
int t_kv_spill(kvt_tier *t, const int32_t *tok, int n, int T, int layers,
               uint64_t mem);
/* True when e holds exactly those `layers` layers (t_layer_eq each). */
int t_kv_matches(const kvt_entry *e, const int32_t *tok, int n, int T,
                 int layers);

/* Rows [0, keep) of every head of a [1, H, T, D] tensor equal the trimmed
 * [1, H, keep, D] (what a trimmed promote must return). */
int t_rows_match(const kvt_tensor *trim, const kvt_tensor *full, int64_t keep);

#endif
