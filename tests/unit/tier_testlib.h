/*
 * tier_testlib.h - helpers shared by the tier tests (test_tier*.c,
 * test_promote*.c, test_writer*.c): seeded KV entries of a chosen size, opening
 * a tier on a fresh temporary directory, comparing a promoted entry with what
 * was spilled, counting budget callbacks, flipping bytes in a stored file, and
 * an I/O table that fails or stalls the Nth pwrite/rename for fault injection.
 * Header-only so every test stays a standalone executable.
 */
#ifndef KVT_TIER_TESTLIB_H
#define KVT_TIER_TESTLIB_H

#include "testutil.h"
#include "base/io.h"
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

/* A spillable entry: tokens and n_layers KV layers of F32 keys/values [1, 2, T,
 * D]. */
typedef struct t_entry {
  int32_t *tokens;
  size_t n_tokens;
  kvt_layer *layers;
  uint32_t n_layers;
  uint64_t memory_bytes;
} t_entry;

/* Tokens: seed-derived, so different seeds give different keys; n tokens.
 * Tensor bytes per layer = 2 * 2 * T * D * 4. */
static inline t_entry t_make(uint64_t seed, size_t n_tokens, uint32_t n_layers,
                             int T, int D) {
  kvt_rng r = {seed};
  t_entry e;
  memset(&e, 0, sizeof e);
  e.n_tokens = n_tokens;
  e.tokens = calloc(n_tokens ? n_tokens : 1, sizeof(int32_t));
  for (size_t i = 0; i < n_tokens; i++)
    e.tokens[i] = (int32_t)(kvt_rng_next(&r) % 50000);
  e.n_layers = n_layers;
  e.layers = calloc(n_layers ? n_layers : 1, sizeof(kvt_layer));
  for (uint32_t l = 0; l < n_layers; l++) {
    kvt_layer *ly = &e.layers[l];
    kvt_layer_init(ly, KVT_LAYER_KV);
    ly->num_tensors = 2;
    ly->tensors = calloc(2, sizeof(kvt_tensor));
    ly->offset = T;
    for (int k = 0; k < 2; k++) {
      kvt_tensor *t = &ly->tensors[k];
      t->dtype = KVT_DTYPE_F32;
      t->ndim = 4;
      t->shape[0] = 1;
      t->shape[1] = 2;
      t->shape[2] = T;
      t->shape[3] = D;
      t->nbytes = (uint64_t)2 * T * D * 4;
      t->data = malloc(t->nbytes ? t->nbytes : 1);
      float *f = t->data;
      for (uint64_t i = 0; i < t->nbytes / 4; i++)
        f[i] = (float)(kvt_rng_next(&r) % 1000) / 7.0f;
    }
  }
  e.memory_bytes = (uint64_t)n_layers * 2 * 2 * T * D * 4;
  return e;
}

/* Same tokens as prefix's first n tokens followed by fresh ones. */
static inline void t_set_prefix(t_entry *e, const t_entry *prefix) {
  size_t n = prefix->n_tokens < e->n_tokens ? prefix->n_tokens : e->n_tokens;
  memcpy(e->tokens, prefix->tokens, n * sizeof(int32_t));
}

static inline void t_free(t_entry *e) {
  for (uint32_t l = 0; l < e->n_layers; l++) {
    for (uint32_t k = 0; k < e->layers[l].num_tensors; k++)
      free(e->layers[l].tensors[k].data);
    free(e->layers[l].tensors);
  }
  free(e->layers);
  free(e->tokens);
  memset(e, 0, sizeof *e);
}

static inline int t_spill(kvt_tier *t, const t_entry *e) {
  return kvt_tier_spill(t, e->tokens, e->n_tokens, e->layers, e->n_layers,
                        e->memory_bytes);
}

/* True when the promoted entry holds exactly the spilled layers and tokens. */
static inline int t_same(const kvt_entry *got, const t_entry *e) {
  size_t n = 0;
  const int32_t *tok = kvt_entry_tokens(got, &n);
  if (n != e->n_tokens || (n && memcmp(tok, e->tokens, n * 4) != 0))
    return 0;
  if (kvt_entry_num_layers(got) != e->n_layers)
    return 0;
  if (kvt_entry_memory_bytes(got) != e->memory_bytes)
    return 0;
  for (uint32_t l = 0; l < e->n_layers; l++) {
    const kvt_layer *a = kvt_entry_layer(got, l), *b = &e->layers[l];
    if (!a || a->kind != b->kind || a->num_tensors != b->num_tensors ||
        a->offset != b->offset)
      return 0;
    for (uint32_t k = 0; k < b->num_tensors; k++) {
      const kvt_tensor *x = &a->tensors[k], *y = &b->tensors[k];
      if (x->dtype != y->dtype || x->ndim != y->ndim || x->nbytes != y->nbytes)
        return 0;
      if (memcmp(x->shape, y->shape, sizeof(int64_t) * y->ndim) != 0)
        return 0;
      if (y->nbytes && memcmp(x->data, y->data, y->nbytes) != 0)
        return 0;
    }
  }
  return 1;
}

/* Default options on a fresh temporary directory. */
static inline kvt_options t_opts(const char *tag) {
  kvt_options o;
  kvt_options_init(&o, KVT_OPTIONS_VERSION);
  o.cache_dir = kvt_test_tmpdir(tag);
  o.durability = KVT_DURABILITY_NONE; /* tests do not need fsync */
  return o;
}

static inline kvt_tier *t_open(const kvt_options *o) {
  kvt_tier *t = NULL;
  int rc = kvt_tier_open(&t, o);
  if (rc != 0)
    fprintf(stderr, "kvt_tier_open: %s: %s\n", kvt_strerror(rc),
            kvt_last_error());
  REQUIRE(rc == 0 && t);
  return t;
}

/* Budget bookkeeping: counts calls and bytes; refuses when limit would be
 * exceeded. */
typedef struct t_budget {
  pthread_mutex_t mu;
  uint64_t limit, used;
  int reserves, releases, refusals;
  pthread_t owner; /* callbacks must run on this thread when check_thread */
  int check_thread, wrong_thread;
} t_budget;

static inline void t_budget_init(t_budget *b, uint64_t limit) {
  memset(b, 0, sizeof *b);
  pthread_mutex_init(&b->mu, NULL);
  b->limit = limit;
}

static inline int t_reserve(void *ctx, uint64_t n) {
  t_budget *b = ctx;
  pthread_mutex_lock(&b->mu);
  if (b->check_thread && !pthread_equal(b->owner, pthread_self()))
    b->wrong_thread++;
  int ok = b->used + n <= b->limit;
  if (ok) {
    b->used += n;
    b->reserves++;
  } else {
    b->refusals++;
  }
  pthread_mutex_unlock(&b->mu);
  return ok;
}

static inline void t_release(void *ctx, uint64_t n) {
  t_budget *b = ctx;
  pthread_mutex_lock(&b->mu);
  if (b->check_thread && !pthread_equal(b->owner, pthread_self()))
    b->wrong_thread++;
  b->used -= n;
  b->releases++;
  pthread_mutex_unlock(&b->mu);
}

static inline kvt_promote_opts t_popts(t_budget *b) {
  kvt_promote_opts o;
  kvt_promote_opts_init(&o, KVT_PROMOTE_OPTS_VERSION);
  if (b) {
    o.reserve = t_reserve;
    o.release = t_release;
    o.budget_ctx = b;
  }
  return o;
}

/* Path of a stored entry's directory / a file in it (malloc'ed). */
static inline char *t_entry_path(kvt_tier *t, const int32_t *tokens, size_t n,
                                 const char *file) {
  char h[KVT_HASH_HEX_LEN + 1];
  kvt_token_hash(h, tokens, n);
  size_t len = strlen(kvt_tier_dir(t)) + 128;
  char *p = malloc(len);
  if (file)
    snprintf(p, len, "%s/data/%s/%s", kvt_tier_dir(t), h, file);
  else
    snprintf(p, len, "%s/data/%s", kvt_tier_dir(t), h);
  return p;
}

/* Flips one byte at offset off (from the end when off < 0) of path. */
static inline int t_flip(const char *path, long off) {
  int fd = open(path, O_RDWR);
  if (fd < 0)
    return -1;
  struct stat st;
  fstat(fd, &st);
  off_t o = off >= 0 ? off : st.st_size + off;
  unsigned char c;
  if (pread(fd, &c, 1, o) != 1) {
    close(fd);
    return -1;
  }
  c ^= 0x5a;
  int rc = pwrite(fd, &c, 1, o) == 1 ? 0 : -1;
  close(fd);
  return rc;
}

/* ------------------------------------------------------------------------ */
/* Fault-injecting I/O table                                                */
/* ------------------------------------------------------------------------ */

typedef struct t_faults {
  atomic_int pwrites, renames; /* calls seen */
  atomic_int fail_pwrite_at;   /* fail the Nth pwrite (1-based; 0 = never) */
  atomic_int fail_rename_at;   /* fail the Nth rename */
  atomic_int fail_errno;       /* errno to fail with */
  atomic_int stall;            /* pwrite blocks while set */
  atomic_int stalled;          /* a pwrite is currently blocked */
  pthread_mutex_t mu;
  pthread_cond_t cv;
} t_faults;

static t_faults t_fault_state = {.mu = PTHREAD_MUTEX_INITIALIZER,
                                 .cv = PTHREAD_COND_INITIALIZER};
static kvti_io_ops t_fault_ops;

static inline ssize_t t_fault_pwrite(int fd, const void *buf, size_t n,
                                     off_t off) {
  t_faults *f = &t_fault_state;
  int k = atomic_fetch_add(&f->pwrites, 1) + 1;
  if (atomic_load(&f->stall)) {
    pthread_mutex_lock(&f->mu);
    atomic_store(&f->stalled, 1);
    pthread_cond_broadcast(&f->cv);
    while (atomic_load(&f->stall))
      pthread_cond_wait(&f->cv, &f->mu);
    atomic_store(&f->stalled, 0);
    pthread_mutex_unlock(&f->mu);
  }
  int at = atomic_load(&f->fail_pwrite_at);
  if (at && k == at) {
    errno = atomic_load(&f->fail_errno);
    return -1;
  }
  return kvti_io_default.pwrite(fd, buf, n, off);
}

static inline int t_fault_rename(const char *a, const char *b) {
  t_faults *f = &t_fault_state;
  int k = atomic_fetch_add(&f->renames, 1) + 1;
  int at = atomic_load(&f->fail_rename_at);
  if (at && k == at) {
    errno = atomic_load(&f->fail_errno);
    return -1;
  }
  return kvti_io_default.rename(a, b);
}

/* Installs the fault table (counters reset, nothing armed). */
static inline void t_faults_install(void) {
  t_faults *f = &t_fault_state;
  atomic_store(&f->pwrites, 0);
  atomic_store(&f->renames, 0);
  atomic_store(&f->fail_pwrite_at, 0);
  atomic_store(&f->fail_rename_at, 0);
  atomic_store(&f->fail_errno, ENOSPC);
  atomic_store(&f->stall, 0);
  t_fault_ops = kvti_io_default;
  t_fault_ops.pwrite = t_fault_pwrite;
  t_fault_ops.rename = t_fault_rename;
  kvti_io_set(&t_fault_ops);
}

static inline void t_faults_remove(void) {
  kvti_io_set(NULL);
}

static inline void t_stall_set(int on) {
  t_faults *f = &t_fault_state;
  pthread_mutex_lock(&f->mu);
  atomic_store(&f->stall, on);
  pthread_cond_broadcast(&f->cv);
  pthread_mutex_unlock(&f->mu);
}

/* Waits until a pwrite is blocked in the stall. */
static inline void t_stall_wait_blocked(void) {
  t_faults *f = &t_fault_state;
  pthread_mutex_lock(&f->mu);
  while (!atomic_load(&f->stalled))
    pthread_cond_wait(&f->cv, &f->mu);
  pthread_mutex_unlock(&f->mu);
}

/* Rows [0, keep) of every head of a [1, H, T, D] tensor equal the trimmed
 * [1, H, keep, D] (what a trimmed promote must return). */
static inline int t_rows_match(const kvt_tensor *trim, const kvt_tensor *full,
                               int64_t keep) {
  int64_t H = full->shape[1], T = full->shape[2];
  size_t row = (size_t)(full->nbytes / (uint64_t)(H * T)); /* one token row */
  if (trim->ndim != 4 || trim->shape[2] != keep || trim->shape[1] != H ||
      trim->shape[3] != full->shape[3] ||
      trim->nbytes != (uint64_t)(H * keep) * row)
    return 0;
  for (int64_t h = 0; h < H; h++)
    if (memcmp((const char *)trim->data + (size_t)(h * keep) * row,
               (const char *)full->data + (size_t)(h * T) * row,
               (size_t)keep * row) != 0)
      return 0;
  return 1;
}

#endif
