/*
 * rel_tier.h - helpers shared by the reliability tests that run the whole tier:
 * spill outcome recording through spill_done_fn (thread-safe), opening a tier
 * on a given directory, and the post-mortem consistency check every test ends
 * with - after a clean reopen (which purges temporaries and reconciles), data/
 * holds no *.tmp, every index row's entry reads back and verifies, and every
 * entry directory has a row. Part of the test library (tests/lib); definitions
 * in rel_tier.c.
 */
#ifndef KVT_REL_TIER_H
#define KVT_REL_TIER_H

#include "tier_testlib.h"
#include "rel_common.h"
#include "base/hash.h"

#include <dirent.h>
#include <pthread.h>

#define REL_MAX_DONE 4096

typedef struct rel_done {
  pthread_mutex_t mu;
  int n;
  char hash[REL_MAX_DONE][KVT_HASH_HEX_LEN + 1];
  int status[REL_MAX_DONE];
} rel_done;

/* spill_done_fn recording (hash, status) into a rel_done (ctx). */
void rel_done_fn(void *ctx, const char *hash, int status);

/* Status of the last spill of hash reported, or 1 when none was reported. */
int rel_done_status(rel_done *d, const char *hash);

/* Options on dir with the given durability and quarantine_max 4. */
kvt_options rel_opts(const char *dir, int durability);

/* "dir/a/b" (a, b may be NULL), malloc'ed. */
char *rel_path(const char *dir, const char *a, const char *b);

typedef struct rel_hashes {
  int n;
  char h[REL_MAX_DONE][KVT_HASH_HEX_LEN + 1];
} rel_hashes;

/* kvt_tier_foreach callback collecting hashes into a rel_hashes (ctx). */
int rel_collect(void *ctx, const kvt_entry_info *info);

/* Names in data/: 64-hex entry directories and *.tmp leftovers. */
void rel_scan_data(const char *dir, int *entries, int *tmps, int *other);

/* Reopens dir (purge of temporaries and reconcile on), checks the invariants -
 * no *.tmp left in data/, every row's entry verifies, every entry directory has
 * a row - and closes. Returns the number of rows, or -1 when the reopen failed.
 * Problems count in kvt_test_failures. known_corrupt (may be NULL): an entry
 * the test damaged on purpose, which must then fail to verify (it is only
 * quarantined once something reads it). */
int rel_check_dir(const char *dir, const char *known_corrupt);

/* Deletes dir's index.db with its -wal and -shm (a lost index). */
void rel_rm_index(const char *dir);
/* Monotonic milliseconds, and a sleep of ms milliseconds (timing tests). */
double rel_now_ms(void);
void rel_sleep_ms(int ms);

/* The tier's stats (zeroed first). */
kvt_stats rel_stats(kvt_tier *t);

/* Opens a tier on dir, spills the n entries, flushes and closes: a cache
 * holding exactly them. */
void rel_spill_all(const char *dir, t_entry *const *es, int n);

#endif
