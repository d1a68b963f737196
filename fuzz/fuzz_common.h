/*
 * fuzz_common.h - shared by the fuzz targets, their replay driver and the
 * seed-corpus generator: a private scratch directory (on tmpfs when available,
 * removed at exit), whole-file write, the manifest.sum text kvtier writes, and
 * a small real entry (a KV F16 layer, a rotating BF16 layer, an ARRAYS layer
 * and a 4-bit quantized layer) written by kvtier itself, whose files the
 * targets start from. Targets that take whole files write the fuzz input into
 * an entry directory and run the real read path on it, so what is fuzzed is
 * exactly what a cache directory on disk feeds kvtier.
 */
#ifndef KVT_FUZZ_COMMON_H
#define KVT_FUZZ_COMMON_H

#include "format/entry.h"
#include "base/hash.h"
#include "kvtier.h"
#include "testutil.h"

#include <dirent.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char fz_root[512];

static inline void fz_rmtree(const char *path) {
  struct stat st;
  if (lstat(path, &st) != 0)
    return;
  if (S_ISDIR(st.st_mode)) {
    DIR *d = opendir(path);
    struct dirent *de;
    while (d && (de = readdir(d))) {
      if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, ".."))
        continue;
      char c[1400];
      if (snprintf(c, sizeof c, "%.1000s/%.255s", path, de->d_name) >=
          (int)sizeof c)
        continue;
      fz_rmtree(c);
    }
    if (d)
      closedir(d);
    rmdir(path);
  } else {
    unlink(path);
  }
}

static inline void fz_cleanup(void) {
  if (fz_root[0])
    fz_rmtree(fz_root);
}

/* The scratch directory, created on first use. */
static inline const char *fz_dir(void) {
  if (!fz_root[0]) {
    const char *base =
        access("/dev/shm", W_OK | X_OK) == 0 ? "/dev/shm" : "/tmp";
    const char *t = getenv("KVT_FUZZ_TMPDIR");
    if (t && *t)
      base = t;
    snprintf(fz_root, sizeof fz_root, "%s/kvt-fuzz-XXXXXX", base);
    if (!mkdtemp(fz_root)) {
      perror("mkdtemp");
      abort();
    }
    atexit(fz_cleanup);
  }
  return fz_root;
}

static inline void fz_write(const char *path, const void *d, size_t n) {
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
  if (fd < 0) {
    perror(path);
    abort();
  }
  const char *p = d;
  while (n) {
    ssize_t w = write(fd, p, n);
    if (w <= 0) {
      perror(path);
      abort();
    }
    p += w;
    n -= (size_t)w;
  }
  close(fd);
}

/* The manifest.sum kvtier writes for a manifest text ("xxh3:<16 hex>\n", 22
 * bytes). */
static inline void fz_sum(char out[32], const void *manifest, size_t n) {
  kvti_xxh3_format(out, kvti_xxh3(manifest, n));
  strcat(out, "\n");
}

/* Tokens of the fixed entry. */
#define FZ_NTOK 9
static const int32_t fz_tokens[FZ_NTOK] = {1, 17, 4242, 9, 65000, 3, 3, 120, 7};

static inline void fz_fill(void *p, size_t n, uint32_t seed) {
  unsigned char *b = p;
  for (size_t i = 0; i < n; i++) {
    seed = seed * 1103515245u + 12345u;
    b[i] = (unsigned char)(seed >> 16);
  }
}

static inline kvt_tensor fz_tensor(kvt_dtype dt, uint32_t ndim,
                                   const int64_t *shape, uint32_t seed) {
  kvt_tensor t;
  memset(&t, 0, sizeof t);
  t.dtype = dt;
  t.ndim = ndim;
  uint64_t n = 1;
  for (uint32_t i = 0; i < ndim; i++) {
    t.shape[i] = shape[i];
    n *= (uint64_t)shape[i];
  }
  t.nbytes = n * kvt_dtype_size(dt);
  t.data = malloc(t.nbytes ? t.nbytes : 1);
  fz_fill(t.data, t.nbytes, seed);
  if (dt == KVT_DTYPE_F16 || dt == KVT_DTYPE_BF16 ||
      dt == KVT_DTYPE_F32) /* finite values */
    for (uint64_t i = 0; i < t.nbytes; i += kvt_dtype_size(dt))
      ((unsigned char *)t.data)[i + kvt_dtype_size(dt) - 1] &= 0x3f;
  return t;
}

/* Writes the fixed entry into data_dir in mode; hash receives its name. Returns
 * 0 or a code. */
static inline int fz_make_entry(const char *data_dir, int mode, char hash[65]) {
  kvt_layer ls[4];
  int64_t kv[4] = {1, 2, 3, 4}, ar[2] = {2, 3}, qp[4] = {1, 2, 3, 8},
          qs[4] = {1, 2, 3, 2};
  kvt_layer_init(&ls[0], KVT_LAYER_KV);
  ls[0].num_tensors = 2;
  ls[0].tensors = calloc(2, sizeof(kvt_tensor));
  ls[0].tensors[0] = fz_tensor(KVT_DTYPE_F16, 4, kv, 1);
  ls[0].tensors[1] = fz_tensor(KVT_DTYPE_F16, 4, kv, 2);
  ls[0].offset = 3;
  kvt_layer_init(&ls[1], KVT_LAYER_ROTATING_KV);
  ls[1].num_tensors = 2;
  ls[1].tensors = calloc(2, sizeof(kvt_tensor));
  ls[1].tensors[0] = fz_tensor(KVT_DTYPE_BF16, 4, kv, 3);
  ls[1].tensors[1] = fz_tensor(KVT_DTYPE_BF16, 4, kv, 4);
  ls[1].offset = 5;
  ls[1].max_size = 3;
  ls[1].keep = 1;
  ls[1].step = 256;
  ls[1].idx = 2;
  kvt_layer_init(&ls[2], KVT_LAYER_ARRAYS);
  ls[2].num_tensors = 2;
  ls[2].tensors = calloc(2, sizeof(kvt_tensor));
  ls[2].tensors[0] = fz_tensor(KVT_DTYPE_F32, 2, ar, 5);
  ls[2].tensors[1] = fz_tensor(KVT_DTYPE_I32, 2, ar, 6);
  kvt_layer_init(&ls[3], KVT_LAYER_QUANTIZED_KV);
  ls[3].num_tensors = 6;
  ls[3].tensors = calloc(6, sizeof(kvt_tensor));
  for (int k = 0; k < 2; k++) {
    ls[3].tensors[3 * k] = fz_tensor(KVT_DTYPE_U32, 4, qp, 7 + (uint32_t)k);
    ls[3].tensors[3 * k + 1] = fz_tensor(KVT_DTYPE_F16, 4, qs, 9 + (uint32_t)k);
    ls[3].tensors[3 * k + 2] =
        fz_tensor(KVT_DTYPE_F16, 4, qs, 11 + (uint32_t)k);
  }
  ls[3].bits = 4;
  ls[3].group_size = 32;
  ls[3].offset = 3;
  kvti_snapshot *s = NULL;
  int rc =
      kvti_snapshot_create(&s, fz_tokens, FZ_NTOK, ls, 4, 4096, 1, NULL, NULL);
  if (rc == 0) {
    kvti_write_opts o = {mode, 0, 0600, 0700};
    rc = kvti_entry_write(NULL, data_dir, s, &o);
    memcpy(hash, kvti_snapshot_hash(s), 65);
  }
  kvti_snapshot_free(s);
  for (int i = 0; i < 4; i++) {
    for (uint32_t j = 0; j < ls[i].num_tensors; j++)
      free(ls[i].tensors[j].data);
    free(ls[i].tensors);
  }
  return rc;
}

/* Reads data_dir/<hash> every way the library does (full read taking the tokens
 * from tokens.bin, read against the expected tokens, verify-only, trimmed to
 * half the tokens, describe) and checks that a success is self-consistent.
 * Aborts (a finding) if data comes back with an error. */
static long fz_reads, fz_reads_ok;
static inline void fz_stats(void) {
  fprintf(stderr, "entry reads: %ld, accepted: %ld\n", fz_reads, fz_reads_ok);
}
static inline void fz_read_all_ways(const char *data_dir, const char *hash,
                                    const int32_t *exp, size_t n_exp) {
  if (fz_reads++ == 0 && getenv("KVT_FUZZ_STATS"))
    atexit(fz_stats);
  kvt_entry *e = NULL;
  int rc = kvti_entry_read(&e, data_dir, hash, NULL);
  fz_reads_ok += rc == 0;
  if (rc != 0 && e)
    abort();
  if (rc == 0) {
    size_t n = 0;
    const int32_t *t = kvt_entry_tokens(e, &n);
    char h[65];
    if (kvt_token_hash(h, t, n) != 0 || strcmp(h, hash) != 0)
      abort(); /* served tokens that are not the entry's */
    for (uint32_t i = 0; i < kvt_entry_num_layers(e); i++) {
      const kvt_layer *l = kvt_entry_layer(e, i);
      for (uint32_t j = 0; j < l->num_tensors; j++) {
        const kvt_tensor *x = &l->tensors[j];
        uint64_t cnt = 1;
        for (uint32_t d = 0; d < x->ndim; d++)
          cnt *= (uint64_t)x->shape[d];
        if (cnt * kvt_dtype_size((kvt_dtype)x->dtype) != x->nbytes)
          abort(); /* inconsistent tensor served */
      }
    }
  }
  kvt_entry_free(e);
  e = NULL;
  if (exp) {
    kvti_read_opts o;
    memset(&o, 0, sizeof o);
    o.tokens = exp;
    o.n_tokens = n_exp;
    rc = kvti_entry_read(&e, data_dir, hash, &o);
    if (rc != 0 && e)
      abort();
    kvt_entry_free(e);
    o.verify_only = 1;
    kvti_entry_read(NULL, data_dir, hash, &o);
    /* A trimmed read (format 2: verified blocks only). */
    o.verify_only = 0;
    o.keep_tokens = n_exp / 2;
    if (o.keep_tokens) {
      e = NULL;
      rc = kvti_entry_read(&e, data_dir, hash, &o);
      if (rc != 0 && e)
        abort();
      kvt_entry_free(e);
      e = NULL;
    }
  }
  char *json = NULL;
  if (kvti_entry_describe(&json, data_dir, hash) == 0 && !json)
    abort();
  kvt_free(json);
}

#endif
