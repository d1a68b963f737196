/*
 * rel_common.h - helpers shared by the reliability tests (fault injection,
 * crash simulation, corruption campaign): a seeded entry of mixed layer kinds,
 * writing it through the format code, reading it back and comparing bit for
 * bit, and directory inspection (tmp leftovers, entry names). Header-only so
 * each test stays one executable.
 */
#ifndef KVT_REL_COMMON_H
#define KVT_REL_COMMON_H

#include "../unit/fmt_testlib.h"
#include "entry.h"
#include "io.h"

#include <dirent.h>
#include <errno.h>
#include <stdatomic.h>
#include <sys/stat.h>
#include <unistd.h>

/* A spillable test entry: tokens + layers (owned, libc malloc). */
typedef struct r_entry {
  int32_t *tokens;
  size_t n_tokens;
  kvt_layer layers[8];
  uint32_t n_layers;
  char hash[KVT_HASH_HEX_LEN + 1];
} r_entry;

/* Seeded entry: a KV F16 layer, a BF16 KV layer, an ARRAYS layer and (quant) a
 * 4-bit quantized layer. Small: a few KB in all, so loops over every call site
 * stay fast. */
static inline r_entry r_make(uint64_t seed, size_t n_tokens, int quant) {
  kvt_rng r = {seed};
  r_entry e;
  memset(&e, 0, sizeof e);
  e.n_tokens = n_tokens;
  e.tokens = malloc((n_tokens ? n_tokens : 1) * sizeof(int32_t));
  for (size_t i = 0; i < n_tokens; i++)
    e.tokens[i] = (int32_t)(kvt_rng_next(&r) % 60000);
  e.layers[e.n_layers++] = t_kv(&r, KVT_DTYPE_F16, 1, 2, 4, 8, 4);
  e.layers[e.n_layers++] = t_kv(&r, KVT_DTYPE_BF16, 1, 2, 4, 8, 3);
  kvt_dtype dts[2] = {KVT_DTYPE_F32, KVT_DTYPE_I32};
  e.layers[e.n_layers++] = t_arrays(&r, 2, dts);
  if (quant)
    e.layers[e.n_layers++] = t_quant(&r, 4, 32, KVT_DTYPE_BF16, 1, 2, 4, 64, 4);
  kvt_token_hash(e.hash, e.tokens, e.n_tokens);
  return e;
}

/* Same tokens, different tensor data (a replacement of the entry). */
static inline r_entry r_make_variant(const r_entry *base, uint64_t seed) {
  r_entry v = r_make(seed, base->n_tokens, base->n_layers > 3);
  memcpy(v.tokens, base->tokens, base->n_tokens * sizeof(int32_t));
  memcpy(v.hash, base->hash, sizeof v.hash);
  return v;
}

static inline void r_free(r_entry *e) {
  for (uint32_t i = 0; i < e->n_layers; i++)
    t_layer_free(&e->layers[i]);
  free(e->tokens);
  memset(e, 0, sizeof *e);
}

/* Writes e into data_dir through kvti_entry_write (snapshot included, so
 * allocation faults also hit the snapshot copy). */
static inline int r_write(const char *data_dir, const r_entry *e, int mode,
                          int do_fsync) {
  kvti_snapshot *s = NULL;
  int rc = kvti_snapshot_create(&s, e->tokens, e->n_tokens, e->layers,
                                e->n_layers, 777, 1, NULL, NULL);
  if (rc)
    return rc;
  kvti_write_opts o = {mode, do_fsync, 0600, 0700};
  uint64_t d = 0;
  rc = kvti_entry_write(&d, data_dir, s, &o);
  kvti_snapshot_free(s);
  return rc;
}

/* Compares a read entry with e (bit-exact: native mode). */
static inline int r_same(const kvt_entry *got, const r_entry *e) {
  size_t n = 0;
  const int32_t *tok = kvt_entry_tokens(got, &n);
  if (n != e->n_tokens || (n && memcmp(tok, e->tokens, n * 4) != 0))
    return 0;
  if (kvt_entry_num_layers(got) != e->n_layers)
    return 0;
  for (uint32_t i = 0; i < e->n_layers; i++)
    if (!t_layer_eq(kvt_entry_layer(got, i), &e->layers[i]))
      return 0;
  return 1;
}

/* Reads data_dir/<e.hash> and returns the read's code; *same receives whether
 * the data equals e (only meaningful on 0). */
static inline int r_read(const char *data_dir, const r_entry *e, int *same) {
  kvt_entry *got = NULL;
  kvti_read_opts o;
  memset(&o, 0, sizeof o);
  o.tokens = e->tokens;
  o.n_tokens = e->n_tokens;
  int rc = kvti_entry_read(&got, data_dir, e->hash, &o);
  if (same)
    *same = rc == 0 && got && r_same(got, e);
  if (rc != 0 && got)
    rc = -1000; /* data handed out with an error: never allowed */
  kvt_entry_free(got);
  return rc;
}

static inline int r_entry_exists(const char *data_dir, const char *hash) {
  char p[4200];
  snprintf(p, sizeof p, "%s/%s", data_dir, hash);
  return kvt_test_exists(p);
}

/* mkdir -p of one fresh directory (removed first). */
static inline void r_fresh_dir(const char *path) {
  kvt_test_rmtree(path);
  REQUIRE(mkdir(path, 0700) == 0);
}

/* Environment integer with a default. */
static inline long r_env_long(const char *name, long def) {
  const char *v = getenv(name);
  if (!v || !*v)
    return def;
  char *end;
  long x = strtol(v, &end, 10);
  return *end ? def : x;
}

/* Copies a tree of directories and regular files (cp -r without links or
 * modes). */
static inline void r_copy_tree(const char *from, const char *to) {
  struct stat st;
  if (lstat(from, &st) != 0)
    return;
  if (S_ISDIR(st.st_mode)) {
    mkdir(to, 0700);
    DIR *d = opendir(from);
    struct dirent *de;
    while ((de = readdir(d))) {
      if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, ".."))
        continue;
      char a[4200], b[4200];
      REQUIRE((size_t)snprintf(a, sizeof a, "%s/%s", from, de->d_name) <
              sizeof a);
      REQUIRE((size_t)snprintf(b, sizeof b, "%s/%s", to, de->d_name) <
              sizeof b);
      r_copy_tree(a, b);
    }
    closedir(d);
  } else {
    size_t n = 0;
    char *buf = kvt_test_read_file(from, &n);
    REQUIRE(buf);
    REQUIRE(t_write_all(to, buf, n) == 0);
    free(buf);
  }
}

/* ---- damage ------------------------------------------------------------ */

enum { R_FLIP, R_TRUNCATE, R_ZERO, R_EXTEND, R_NKINDS };
static const char *const r_kind_names[R_NKINDS] = {"flip", "truncate", "zero",
                                                   "extend"};

/* Damages the file at path in one of four ways (kind < 0: random): flip 1-8
 * random bytes (xor with a non-zero value), truncate to a random shorter
 * length, zero a random range, or append 1-64 random bytes. Returns 1 when the
 * bytes changed, 0 when the damage happened to leave the file identical
 * (zeroing zeros, truncating an empty file), -1 on error. *orig / *orig_len
 * receive the original bytes (malloc'ed) so the caller can restore them. */
static inline int r_damage(const char *path, kvt_rng *rng, int kind,
                           char **orig, size_t *orig_len, int *kind_out) {
  size_t n = 0;
  char *b = kvt_test_read_file(path, &n);
  if (!b)
    return -1;
  if (kind < 0)
    kind = (int)(kvt_rng_next(rng) % R_NKINDS);
  if (n == 0 && kind != R_EXTEND)
    kind = R_EXTEND;
  if (kind_out)
    *kind_out = kind;
  char *m = malloc(n + 64 + 1);
  memcpy(m, b, n);
  size_t mn = n;
  switch (kind) {
  case R_FLIP: {
    int k = 1 + (int)(kvt_rng_next(rng) % 8);
    for (int i = 0; i < k; i++) {
      size_t at = (size_t)(kvt_rng_next(rng) % n);
      unsigned char x = (unsigned char)(1 + kvt_rng_next(rng) % 255);
      m[at] = (char)(m[at] ^ x);
    }
    break;
  }
  case R_TRUNCATE:
    mn = (size_t)(kvt_rng_next(rng) % n);
    break;
  case R_ZERO: {
    size_t at = (size_t)(kvt_rng_next(rng) % n);
    size_t len =
        1 + (size_t)(kvt_rng_next(rng) % (n - at < 256 ? n - at : 256));
    memset(m + at, 0, len);
    break;
  }
  default: {
    size_t len = 1 + (size_t)(kvt_rng_next(rng) % 64);
    kvt_rng_fill(rng, m + n, len);
    mn = n + len;
    break;
  }
  }
  int changed = mn != n || memcmp(m, b, n) != 0;
  int rc = t_write_all(path, m, mn) == 0 ? changed : -1;
  free(m);
  *orig = b;
  *orig_len = n;
  return rc;
}

/* Puts the test's temporary directories on tmpfs (/dev/shm) when available: the
 * reliability loops inject their own fsync failures and simulate power loss at
 * the seam, so real fsyncs to disk would only cost time. KVT_REL_TMPDIR
 * overrides (e.g. to test a real file system). */
static inline void r_use_fast_tmp(void) {
  const char *o = getenv("KVT_REL_TMPDIR");
  if (o && *o) {
    setenv("TMPDIR", o, 1);
    return;
  }
  if (access("/dev/shm", W_OK | X_OK) == 0)
    setenv("TMPDIR", "/dev/shm", 1);
}

#endif
