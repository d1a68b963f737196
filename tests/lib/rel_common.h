/*
 * rel_common.h - helpers shared by the reliability tests (fault injection,
 * crash simulation, corruption campaign): writing a test entry (r_make of
 * entry_testlib.h) through the format code and reading it back with t_same's
 * bit-for-bit judgement, directory helpers (fresh dir, tree copy, tmpfs for
 * speed), environment knobs and the damage kinds of the corruption campaigns.
 * Part of the test library (tests/lib); definitions in rel_common.c.
 */
#ifndef KVT_REL_COMMON_H
#define KVT_REL_COMMON_H

#include "entry_testlib.h"
#include "fmt_testlib.h"
#include "format/entry.h"
#include "base/io.h"

#include <dirent.h>
#include <errno.h>
#include <stdatomic.h>
#include <sys/stat.h>
#include <unistd.h>

/* Writes e into data_dir through kvti_entry_write (snapshot included, so
 * allocation faults also hit the snapshot copy); e's memory_bytes is the
 * entry's RAM size. */
int r_write(const char *data_dir, const t_entry *e, int mode, int do_fsync);

/* Reads data_dir/<e.hash> and returns the read's code; *same receives whether
 * the data equals e (only meaningful on 0). */
int r_read(const char *data_dir, const t_entry *e, int *same);

int r_entry_exists(const char *data_dir, const char *hash);

/* mkdir -p of one fresh directory (removed first). */
void r_fresh_dir(const char *path);

/* Environment integer with a default. */
long r_env_long(const char *name, long def);

/* Copies a tree of directories and regular files (cp -r without links or
 * modes). */
void r_copy_tree(const char *from, const char *to);

/* ---- damage ------------------------------------------------------------ */

enum { R_FLIP, R_TRUNCATE, R_ZERO, R_EXTEND, R_NKINDS };
extern const char *const r_kind_names[R_NKINDS];

/* Damages the file at path in one of four ways (kind < 0: random): flip 1-8
 * random bytes (xor with a non-zero value), truncate to a random shorter
 * length, zero a random range, or append 1-64 random bytes. Returns 1 when the
 * bytes changed, 0 when the damage happened to leave the file identical
 * (zeroing zeros, truncating an empty file), -1 on error. *orig / *orig_len
 * receive the original bytes (malloc'ed) so the caller can restore them. */
int r_damage(const char *path, kvt_rng *rng, int kind, char **orig,
             size_t *orig_len, int *kind_out);

/* Puts the test's temporary directories on tmpfs (/dev/shm) when available: the
 * reliability loops inject their own fsync failures and simulate power loss at
 * the seam, so real fsyncs to disk would only cost time. KVT_REL_TMPDIR
 * overrides (e.g. to test a real file system). */
void r_use_fast_tmp(void);

#endif
