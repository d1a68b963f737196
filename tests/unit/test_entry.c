/*
 * test_entry.c - cache entries end to end: round trips of every layer kind in
 * both storage modes (bit-exact in native; compat checked against an
 * independent computation of what the reference writes), replacement of an
 * existing entry, detection of every flipped, truncated or extended byte of
 * every file (KVT_ECORRUPT, no data), writes failing through an injected I/O
 * table (nothing left behind, old entry intact), cancellation, caller
 * allocation callbacks, describe, and reading an entry laid out byte for byte
 * as the Python reference writes it.
 */
#include "fmt_testlib.h"
#include "format/dtype.h"
#include "format/entry.h"
#include "format/layer.h"
#include "base/hash.h"
#include "base/io.h"

#include <ctype.h>
#include <dirent.h>
#include <stdatomic.h>
#include <errno.h>

static void tokens_of(int32_t *t, size_t n, int seed) {
  for (size_t i = 0; i < n; i++)
    t[i] = (int32_t)(i * 31 + (size_t)seed * 7 - 5);
}

static int write_entry(const char *data, const int32_t *tok, size_t n,
                       kvt_layer *ls, uint32_t nl, int mode, uint64_t *disk) {
  kvti_snapshot *s = NULL;
  int rc = kvti_snapshot_create(&s, tok, n, ls, nl, 12345, 1, NULL, NULL);
  if (rc)
    return rc;
  kvti_write_opts o = {mode, 1, 0600, 0700};
  uint64_t d = 0;
  rc = kvti_entry_write(&d, data, s, &o);
  if (rc == 0) {
    uint64_t pred = kvti_snapshot_disk_bytes(s, mode);
    if (pred != 0 || kvti_io == &kvti_io_default) /* 0: OOM under injection */
      CHECK_EQ_INT(pred, d);
    if (disk)
      *disk = d;
  }
  kvti_snapshot_free(s);
  return rc;
}

static int count_dir(const char *dir) {
  DIR *d = opendir(dir);
  int n = 0;
  struct dirent *de;
  while ((de = readdir(d)))
    if (de->d_name[0] != '.')
      n++;
  closedir(d);
  return n;
}

/* Every layer kind and several dtypes. */
static uint32_t make_mix(kvt_rng *r, kvt_layer *ls, int with_quant) {
  uint32_t n = 0;
  ls[n++] = t_kv(r, KVT_DTYPE_F16, 1, 2, 5, 8, 5);
  ls[n++] = t_kv(r, KVT_DTYPE_BF16, 1, 2, 5, 8, 4);
  ls[n++] = t_rotating(r, KVT_DTYPE_F32);
  kvt_dtype dts[4] = {KVT_DTYPE_F32, KVT_DTYPE_BF16, KVT_DTYPE_I32,
                      KVT_DTYPE_F16};
  ls[n++] = t_arrays(r, 4, dts);
  ls[n++] = t_arrays(r, 0, NULL);
  if (with_quant) {
    ls[n++] = t_quant(r, 4, 32, KVT_DTYPE_BF16, 1, 2, 6, 64, 4);
    ls[n++] = t_quant(r, 8, 64, KVT_DTYPE_F16, 1, 2, 3, 64, 3);
  }
  return n;
}

static void test_native_roundtrip(void) {
  char *dir = kvt_test_tmpdir("entry-native");
  kvt_rng r = {1};
  kvt_layer ls[8];
  uint32_t n = make_mix(&r, ls, 1);
  ls[0].orig_dtypes = calloc(2, 4);
  ls[0].orig_dtypes[1] = KVT_DTYPE_BF16; /* caller hints survive */
  int32_t tok[20];
  tokens_of(tok, 20, 1);
  uint64_t disk = 0;
  REQUIRE(write_entry(dir, tok, 20, ls, n, KVT_STORAGE_NATIVE, &disk) == 0);
  char h[65];
  kvt_token_hash(h, tok, 20);
  CHECK_EQ_INT(count_dir(dir), 1);
  kvt_entry *e = NULL;
  kvti_read_opts ro = {0};
  ro.tokens = tok;
  ro.n_tokens = 20;
  REQUIRE(kvti_entry_read(&e, dir, h, &ro) == 0);
  CHECK_EQ_INT(kvt_entry_num_layers(e), n);
  CHECK_EQ_INT(kvt_entry_memory_bytes(e), 12345);
  CHECK_EQ_INT(kvt_entry_disk_bytes(e), disk);
  CHECK_EQ_INT(kvt_entry_storage_mode(e), KVT_STORAGE_NATIVE);
  CHECK(strcmp(kvt_entry_hash(e), h) == 0);
  size_t nt = 0;
  const int32_t *et = kvt_entry_tokens(e, &nt);
  CHECK(nt == 20 && memcmp(et, tok, 80) == 0);
  for (uint32_t i = 0; i < n; i++) {
    const kvt_layer *l = kvt_entry_layer(e, i);
    CHECK(t_layer_eq(l, &ls[i]));
    for (uint32_t j = 0; j < l->num_tensors; j++)
      CHECK(l->tensors[j].data == NULL ||
            ((uintptr_t)l->tensors[j].data & 63) == 0);
  }
  CHECK(kvt_entry_layer(e, n) == NULL);
  kvt_entry_free(e);
  /* without expected tokens: tokens come from tokens.bin */
  REQUIRE(kvti_entry_read(&e, dir, h, NULL) == 0);
  et = kvt_entry_tokens(e, &nt);
  CHECK(nt == 20 && memcmp(et, tok, 80) == 0);
  kvt_entry_free(e);
  /* wrong expected tokens */
  int32_t bad[20];
  memcpy(bad, tok, sizeof bad);
  bad[3]++;
  ro.tokens = bad;
  CHECK_EQ_INT(kvti_entry_read(&e, dir, h, &ro), KVT_ECORRUPT);
  /* describe */
  char *js = NULL;
  REQUIRE(kvti_entry_describe(&js, dir, h) == 0);
  CHECK(strstr(js, "\"storage_mode\":\"native\"") != NULL);
  CHECK(strstr(js, "layer_5_keys_scales") != NULL);
  CHECK(strstr(js, "\"quantized_kv\"") != NULL);
  kvt_free(js);
  for (uint32_t i = 0; i < n; i++)
    t_layer_free(&ls[i]);
}

/* What compat writes for one KV-type source tensor j of layer l. */
static void check_compat_layer(const kvt_layer *got, const kvt_layer *src,
                               int has_quant) {
  if (src->kind == KVT_LAYER_ARRAYS) {
    CHECK_EQ_INT(got->kind, KVT_LAYER_ARRAYS);
    REQUIRE(got->num_tensors == src->num_tensors);
    int any = 0;
    for (uint32_t j = 0; j < src->num_tensors; j++) {
      const kvt_tensor *s = &src->tensors[j], *g = &got->tensors[j];
      if (s->dtype == KVT_DTYPE_BF16) {
        any = 1;
        CHECK_EQ_INT(g->dtype, KVT_DTYPE_F32);
        CHECK(got->orig_dtypes && got->orig_dtypes[j] == KVT_DTYPE_BF16);
        size_t ne = s->nbytes / 2;
        for (size_t i = 0; i < ne; i++)
          CHECK(((float *)g->data)[i] == t_load(s->data, KVT_DTYPE_BF16, i));
      } else {
        CHECK(t_tensor_eq(g, s));
        CHECK(!got->orig_dtypes || got->orig_dtypes[j] == 0);
      }
    }
    CHECK(any == (got->orig_dtypes != NULL));
    return;
  }
  if (src->kind == KVT_LAYER_QUANTIZED_KV) {
    CHECK_EQ_INT(got->kind, KVT_LAYER_KV);
    CHECK_EQ_INT(got->offset, src->offset);
    int bf = src->tensors[1].dtype == KVT_DTYPE_BF16;
    for (int kv = 0; kv < 2; kv++) {
      const kvt_tensor *q = &src->tensors[3 * kv], *g = &got->tensors[kv];
      int64_t T = q->shape[2], D = q->shape[3] * 32 / src->bits;
      int64_t keep = src->offset < T ? src->offset : T;
      kvt_dtype od = bf ? KVT_DTYPE_F16 : (kvt_dtype)src->tensors[1].dtype;
      CHECK_EQ_INT(g->dtype, od);
      CHECK_EQ_INT(g->shape[2], keep);
      CHECK_EQ_INT(g->shape[3], D);
      CHECK(got->orig_dtypes ? got->orig_dtypes[kv] == (bf ? KVT_DTYPE_BF16 : 0)
                             : !bf);
      size_t o = 0;
      int bad = 0;
      for (int64_t a = 0; a < q->shape[0] * q->shape[1]; a++)
        for (int64_t t = 0; t < keep; t++)
          for (int64_t i = 0; i < D; i++, o++) {
            float want = t_dequant_elem(src, kv, a * T + t, i);
            float gv = t_load(g->data, od, o);
            if (bf)
              want = t_f16_to_f32(t_f32_to_f16(want));
            if (memcmp(&want, &gv, 4) != 0)
              bad++;
          }
      CHECK_EQ_INT(bad, 0);
    }
    return;
  }
  CHECK_EQ_INT(got->kind, src->kind);
  CHECK_EQ_INT(got->offset, src->offset);
  CHECK_EQ_INT(got->max_size, src->max_size);
  CHECK_EQ_INT(got->idx, src->idx);
  int cast16 = has_quant && src->tensors[0].dtype == KVT_DTYPE_BF16;
  for (int j = 0; j < 2; j++) {
    const kvt_tensor *s = &src->tensors[j], *g = &got->tensors[j];
    size_t ne = s->nbytes / kvt_dtype_size((kvt_dtype)s->dtype);
    if (cast16) {
      CHECK_EQ_INT(g->dtype, KVT_DTYPE_F16);
      CHECK(got->orig_dtypes && got->orig_dtypes[j] == KVT_DTYPE_BF16);
      for (size_t i = 0; i < ne; i++)
        CHECK(t_load(g->data, KVT_DTYPE_F16, i) ==
              t_load(s->data, (kvt_dtype)s->dtype, i));
    } else if (s->dtype == KVT_DTYPE_BF16) {
      CHECK_EQ_INT(g->dtype, KVT_DTYPE_F32);
      CHECK(got->orig_dtypes && got->orig_dtypes[j] == KVT_DTYPE_BF16);
      for (size_t i = 0; i < ne; i++)
        CHECK(((float *)g->data)[i] == t_load(s->data, KVT_DTYPE_BF16, i));
    } else {
      CHECK(t_tensor_eq(g, s));
    }
  }
}

static void test_compat_roundtrip(void) {
  char *dir = kvt_test_tmpdir("entry-compat");
  for (int with_quant = 0; with_quant < 2; with_quant++) {
    kvt_rng r = {2 + (uint64_t)with_quant};
    kvt_layer ls[8];
    uint32_t n = make_mix(&r, ls, with_quant);
    int32_t tok[7];
    tokens_of(tok, 7, with_quant);
    REQUIRE(write_entry(dir, tok, 7, ls, n, KVT_STORAGE_COMPAT, NULL) == 0);
    char h[65];
    kvt_token_hash(h, tok, 7);
    kvt_entry *e = NULL;
    REQUIRE(kvti_entry_read(&e, dir, h, NULL) == 0);
    CHECK_EQ_INT(kvt_entry_storage_mode(e), KVT_STORAGE_COMPAT);
    REQUIRE(kvt_entry_num_layers(e) == n);
    uint64_t held = 0;
    for (uint32_t i = 0; i < n; i++) {
      check_compat_layer(kvt_entry_layer(e, i), &ls[i], with_quant);
      const kvt_layer *el = kvt_entry_layer(e, i);
      for (uint32_t j = 0; j < el->num_tensors; j++) {
        const kvt_tensor *x = &el->tensors[j];
        int32_t od = el->orig_dtypes ? el->orig_dtypes[j] : KVT_DTYPE_INVALID;
        held += od == KVT_DTYPE_INVALID
                    ? x->nbytes
                    : x->nbytes / kvt_dtype_size((kvt_dtype)x->dtype) *
                          kvt_dtype_size((kvt_dtype)od);
      }
    }
    /* The entry keeps the reference's figure; the dense size kvtier reports
     * for a native entry holding quantized layers is exactly what this one
     * holds once read (stored dequantized), each tensor in the dtype its
     * hint casts it back to. */
    CHECK_EQ_INT(kvt_entry_memory_bytes(e), 12345);
    CHECK_EQ_INT(kvti_layers_dense_bytes(ls, n), held);
    if (with_quant) {
      /* the KV, rotating and arrays tensors as given (320 + 320 + 512 +
       * 120) and the quantized layers' first offset rows in their scales'
       * dtype (2 x 2 x 4 x 64 BF16, 2 x 2 x 3 x 64 F16) */
      kvti_snapshot *sn;
      REQUIRE(kvti_snapshot_create(&sn, tok, 7, ls, n, 12345, 1, NULL, NULL) ==
              0);
      CHECK_EQ_INT(kvti_snapshot_memory_bytes(sn), 12345);
      kvti_snapshot_report_dense(sn);
      CHECK_EQ_INT(kvti_snapshot_memory_bytes(sn),
                   320 + 320 + 512 + 120 + 2048 + 1536);
      kvti_snapshot_free(sn);
    }
    kvt_entry_free(e);
    /* the manifest uses only the reference's layer types */
    char *ed = t_join(dir, h), *mp = t_join(ed, "manifest.json");
    size_t len;
    char *m = kvt_test_read_file(mp, &len);
    REQUIRE(m);
    CHECK(strstr(m, "QuantizedKVCache") == NULL);
    CHECK(strncmp(m, "{\"num_layers\": ", 15) == 0);
    free(m);
    free(mp);
    free(ed);
    for (uint32_t i = 0; i < n; i++)
      t_layer_free(&ls[i]);
  }
}

static void test_replace(void) {
  char *dir = kvt_test_tmpdir("entry-replace");
  kvt_rng r = {3};
  int32_t tok[4] = {1, 2, 3, 4};
  char h[65];
  kvt_token_hash(h, tok, 4);
  kvt_layer a = t_kv(&r, KVT_DTYPE_F32, 1, 1, 4, 4, 4);
  kvt_layer b = t_kv(&r, KVT_DTYPE_F16, 1, 1, 3, 4, 3);
  REQUIRE(write_entry(dir, tok, 4, &a, 1, KVT_STORAGE_NATIVE, NULL) == 0);
  REQUIRE(write_entry(dir, tok, 4, &b, 1, KVT_STORAGE_NATIVE, NULL) == 0);
  CHECK_EQ_INT(count_dir(dir), 1); /* no .tmp / .old.tmp left */
  kvt_entry *e = NULL;
  REQUIRE(kvti_entry_read(&e, dir, h, NULL) == 0);
  CHECK(t_layer_eq(kvt_entry_layer(e, 0), &b));
  kvt_entry_free(e);
  /* a stale tmp dir is replaced */
  char *tmp = malloc(strlen(dir) + 80);
  sprintf(tmp, "%s/%s.tmp", dir, h);
  mkdir(tmp, 0700);
  char *junk = t_join(tmp, "junk");
  t_write_all(junk, "x", 1);
  REQUIRE(write_entry(dir, tok, 4, &a, 1, KVT_STORAGE_COMPAT, NULL) == 0);
  CHECK_EQ_INT(count_dir(dir), 1);
  REQUIRE(kvti_entry_read(&e, dir, h, NULL) == 0);
  CHECK(t_layer_eq(kvt_entry_layer(e, 0), &a));
  kvt_entry_free(e);
  free(junk);
  free(tmp);
  t_layer_free(&a);
  t_layer_free(&b);
}

static kvt_rng g_small_rng = {9};

/* A small entry with every layer kind (about 2 KB of files). */
static void small_entry(const char *dir, int mode, char h[65]) {
  kvt_rng *r = &g_small_rng;
  kvt_layer ls[4];
  ls[0] = t_kv(r, KVT_DTYPE_BF16, 1, 1, 2, 4, 2);
  ls[1] = t_rotating(r, KVT_DTYPE_F16);
  kvt_dtype dts[2] = {KVT_DTYPE_F32, KVT_DTYPE_BF16};
  ls[2] = t_arrays(r, 2, dts);
  ls[3] = t_quant(r, 4, 32, KVT_DTYPE_F16, 1, 1, 2, 32, 2);
  int32_t tok[3] = {7, 8, 9};
  REQUIRE(write_entry(dir, tok, 3, ls, 4, mode, NULL) == 0);
  kvt_token_hash(h, tok, 3);
  for (int i = 0; i < 4; i++)
    t_layer_free(&ls[i]);
}

static int read_status(const char *dir, const char *h) {
  kvt_entry *e = (kvt_entry *)(uintptr_t)1;
  int rc = kvti_entry_read(&e, dir, h, NULL);
  if (rc == 0)
    kvt_entry_free(e);
  else if (e != (kvt_entry *)(uintptr_t)1)
    return 999; /* out written on failure */
  return rc;
}

/* Moves path to aside and puts a symlink to it in its place: reading the
 * entry must be refused as corruption. Then restores path, after which the
 * entry reads again. */
static void check_symlink_refused(const char *dir, const char *h,
                                  const char *path, const char *aside) {
  REQUIRE(rename(path, aside) == 0);
  REQUIRE(symlink(aside, path) == 0);
  CHECK_EQ_INT(read_status(dir, h), KVT_ECORRUPT);
  unlink(path);
  REQUIRE(rename(aside, path) == 0);
  CHECK_EQ_INT(read_status(dir, h), 0);
}

static void corrupt_all_files(int mode) {
  char *dir = kvt_test_tmpdir("entry-corrupt");
  char h[65];
  small_entry(dir, mode, h);
  REQUIRE(read_status(dir, h) == 0);
  char *ed = t_join(dir, h);
  const char *files[] = {"layer_0.safetensors", "layer_1.safetensors",
                         "layer_2.safetensors", "layer_3.safetensors",
                         "tokens.bin",          "manifest.json",
                         "manifest.sum"};
  int undetected = 0, tested = 0;
  for (size_t f = 0; f < sizeof files / sizeof files[0]; f++) {
    char *p = t_join(ed, files[f]);
    size_t len = 0;
    char *orig = kvt_test_read_file(p, &len);
    REQUIRE(orig && len > 0);
    char *buf = malloc(len + 1);
    /* every flipped byte (two different flips) */
    for (size_t i = 0; i < len; i++) {
      for (int k = 0; k < 2; k++) {
        memcpy(buf, orig, len);
        buf[i] ^= k ? (char)0x80 : (char)0x01;
        t_write_all(p, buf, len);
        int rc = read_status(dir, h);
        tested++;
        if (rc != KVT_ECORRUPT) {
          if (undetected < 5)
            fprintf(stderr, "undetected flip %s[%zu]^%d: rc %d\n", files[f], i,
                    k, rc);
          undetected++;
        }
      }
    }
    /* every truncation */
    for (size_t n = 0; n < len; n++) {
      t_write_all(p, orig, n);
      int rc = read_status(dir, h);
      tested++;
      if (rc != KVT_ECORRUPT) {
        if (undetected < 5)
          fprintf(stderr, "undetected truncation %s to %zu: rc %d\n", files[f],
                  n, rc);
        undetected++;
      }
    }
    /* extension */
    memcpy(buf, orig, len);
    buf[len] = ' ';
    t_write_all(p, buf, len + 1);
    CHECK_EQ_INT(read_status(dir, h), KVT_ECORRUPT);
    /* deletion (a missing manifest.json means "no such entry") */
    unlink(p);
    CHECK_EQ_INT(read_status(dir, h), strcmp(files[f], "manifest.json")
                                          ? KVT_ECORRUPT
                                          : KVT_ENOTFOUND);
    t_write_all(p, orig, len);
    CHECK_EQ_INT(read_status(dir, h), 0);
    free(buf);
    free(orig);
    free(p);
  }
  CHECK_EQ_INT(undetected, 0);
  CHECK(tested > 4000);
  free(ed);
}

static void test_corrupt_native(void) {
  corrupt_all_files(KVT_STORAGE_NATIVE);
}
static void test_corrupt_compat(void) {
  corrupt_all_files(KVT_STORAGE_COMPAT);
}

/* ---- fault injection ----------------------------------------------------- */

static int f_op; /* which op fails: 0 pwrite, 1 fsync, 2 rename, 3 exch, 4
                    mkdir, 5 open, 6 chmod, 7 close */
static int f_at, f_calls, f_hit;
static int f_errno = ENOSPC;

static int should_fail(int op) {
  if (op != f_op)
    return 0;
  if (++f_calls == f_at) {
    f_hit = 1;
    errno = f_errno;
    return 1;
  }
  return 0;
}
static ssize_t f_pwrite(int fd, const void *b, size_t n, off_t o) {
  if (should_fail(0))
    return -1;
  /* short writes exercise the retry loop */
  return kvti_io_default.pwrite(fd, b, n > 7 ? n / 2 : n, o);
}
static int f_fsync(int fd) {
  return should_fail(1) ? -1 : kvti_io_default.fsync(fd);
}
static int f_rename(const char *a, const char *b) {
  return should_fail(2) ? -1 : kvti_io_default.rename(a, b);
}
static int f_exch(const char *a, const char *b) {
  return should_fail(3) ? -1 : kvti_io_default.rename_exchange(a, b);
}
static int f_mkdir(const char *p, mode_t m) {
  return should_fail(4) ? -1 : kvti_io_default.mkdir(p, m);
}
static int f_open(const char *p, int fl, mode_t m) {
  return should_fail(5) ? -1 : kvti_io_default.open(p, fl, m);
}
static int f_chmod(const char *p, mode_t m) {
  return should_fail(6) ? -1 : kvti_io_default.chmod(p, m);
}
static int f_close(int fd) {
  if (should_fail(7)) {
    kvti_io_default.close(fd);
    errno = EIO;
    return -1;
  }
  return kvti_io_default.close(fd);
}

static void test_failed_writes(void) {
  char *dir = kvt_test_tmpdir("entry-faults");
  kvt_rng r = {5};
  int32_t tok[5] = {1, 1, 2, 3, 5};
  char h[65];
  kvt_token_hash(h, tok, 5);
  kvt_layer old = t_kv(&r, KVT_DTYPE_F32, 1, 1, 2, 4, 2);
  kvt_layer nw[2];
  nw[0] = t_kv(&r, KVT_DTYPE_F16, 1, 1, 3, 4, 3);
  kvt_dtype dts[1] = {KVT_DTYPE_BF16};
  nw[1] = t_arrays(&r, 1, dts);
  kvti_io_ops ops = kvti_io_default;
  ops.pwrite = f_pwrite;
  ops.fsync = f_fsync;
  ops.rename = f_rename;
  ops.rename_exchange = f_exch;
  ops.mkdir = f_mkdir;
  ops.open = f_open;
  ops.chmod = f_chmod;
  ops.close = f_close;
  int failures[8] = {0}, post[8] = {0};
  for (int with_old = 0; with_old < 2; with_old++) {
    for (int op = 0; op < 8; op++) {
      for (int exch = 0; exch < 2; exch++) {
        ops.rename_exchange =
            exch ? f_exch : NULL; /* NULL: portable fallback */
        for (int at = 1; at < 100; at++) {
          kvt_test_rmtree(dir);
          mkdir(dir, 0700);
          if (with_old)
            REQUIRE(write_entry(dir, tok, 5, &old, 1, KVT_STORAGE_NATIVE,
                                NULL) == 0);
          f_op = op;
          f_at = at;
          f_calls = 0;
          f_hit = 0;
          f_errno = op == 0 ? ENOSPC : EIO;
          kvti_io_set(&ops);
          int rc = write_entry(dir, tok, 5, nw, 2, KVT_STORAGE_COMPAT, NULL);
          kvti_io_set(NULL);
          kvt_entry *e = NULL;
          if (!f_hit) {
            CHECK_EQ_INT(rc, 0);
            REQUIRE(kvti_entry_read(&e, dir, h, NULL) == 0);
            CHECK_EQ_INT(kvt_entry_num_layers(e), 2);
            kvt_entry_free(e);
            CHECK_EQ_INT(count_dir(dir), 1);
            break;
          }
          if (rc == 0) {
            /* the fault hit a best-effort step after publication (removing the
             * old version): the new entry must be complete */
            REQUIRE(kvti_entry_read(&e, dir, h, NULL) == 0);
            CHECK_EQ_INT(kvt_entry_num_layers(e), 2);
            kvt_entry_free(e);
            post[op]++;
            continue;
          }
          failures[op]++;
          if (op == 0)
            CHECK_EQ_INT(rc, KVT_ENOSPC);
          /* nothing new visible; the old entry (if any) intact */
          CHECK_EQ_INT(count_dir(dir), with_old);
          if (with_old) {
            REQUIRE(kvti_entry_read(&e, dir, h, NULL) == 0);
            CHECK(t_layer_eq(kvt_entry_layer(e, 0), &old));
            kvt_entry_free(e);
          }
        }
      }
    }
  }
  for (int op = 0; op < 8; op++) {
    if (getenv("KVT_TEST_VERBOSE"))
      fprintf(stderr, "op %d: %d failed writes, %d post-publish faults\n", op,
              failures[op], post[op]);
    CHECK(failures[op] > 0);
  }
  t_layer_free(&old);
  t_layer_free(&nw[0]);
  t_layer_free(&nw[1]);
}

/* ---- the reference's own layout ----------------------------------------- */

/* Header exactly as safetensors' save_file writes it: compact JSON, keys in
 * order, padded with spaces so that 8 + len is a multiple of 8. */
static size_t st_file(char *out, size_t cap, const char *json, const void *data,
                      size_t dlen) {
  REQUIRE(16 + strlen(json) + dlen <= cap);
  size_t n = strlen(json), pad = (8 - n % 8) % 8;
  uint64_t hl = n + pad;
  for (int i = 0; i < 8; i++)
    out[i] = (char)(hl >> (8 * i));
  memcpy(out + 8, json, n);
  memset(out + 8 + n, ' ', pad);
  memcpy(out + 8 + hl, data, dlen);
  return 8 + hl + dlen;
}

/* Headers of reference-layout layer files 0-2 (KVCache F32 [1,1,2,2], KVCache
 * F16 [1,1,1,2], ArraysCache F32 [3] + I32 [3]) used by the tests below. */
static const char *const REF_HDR[3] = {
    "{\"layer_0_keys\":{\"dtype\":\"F32\",\"shape\":[1,1,2,2],"
    "\"data_offsets\":[0,16]},\"layer_0_values\":{\"dtype\":\"F32\","
    "\"shape\":[1,1,2,2],\"data_offsets\":[16,32]}}",
    "{\"layer_1_keys\":{\"dtype\":\"F16\",\"shape\":[1,1,1,2],"
    "\"data_offsets\":[0,4]},\"layer_1_values\":{\"dtype\":\"F16\","
    "\"shape\":[1,1,1,2],\"data_offsets\":[4,8]}}",
    "{\"layer_2_state_0\":{\"dtype\":\"F32\",\"shape\":[3],"
    "\"data_offsets\":[0,12]},\"layer_2_state_1\":{\"dtype\":\"I32\","
    "\"shape\":[3],\"data_offsets\":[12,24]}}"};

/* CHECKs that ed/name holds exactly the file st_file makes of json and data. */
static void check_st(const char *ed, const char *name, const char *json,
                     const void *data, size_t dlen) {
  char want[4096];
  size_t wn = st_file(want, sizeof want, json, data, dlen);
  char *p = t_join(ed, name);
  size_t len = 0;
  char *got = kvt_test_read_file(p, &len);
  CHECK(got && len == wn && memcmp(got, want, len) == 0);
  free(got);
  free(p);
}

/* Writes ed/name as a safetensors file (st_file) with this header and data. */
static void put_st(const char *ed, const char *name, const char *json,
                   const void *data, size_t dlen) {
  char buf[4096];
  size_t n = st_file(buf, sizeof buf, json, data, dlen);
  char *p = t_join(ed, name);
  t_write_all(p, buf, n);
  free(p);
}

static void test_reference_layout(void) {
  char *dir = kvt_test_tmpdir("entry-reference");
  int32_t tok[6] = {101, 2023, -1, 0, 7, 65536};
  char h[65];
  kvt_token_hash(h, tok, 6);
  char *ed = t_join(dir, h);
  REQUIRE(mkdir(ed, 0700) == 0);
  /* layer 0: KVCache whose bf16 keys/values were upcast to float32 (shape
   * [1,1,2,2]) */
  float kv0[8] = {1.0f, -2.0f, 0.5f, 3.25f, -0.125f, 8.0f, 0.0f, -1.5f};
  put_st(ed, "layer_0.safetensors", REF_HDR[0], kv0, sizeof kv0);
  /* layer 1: RotatingKVCache written as "KVCache" with the rotating attributes,
   * F16 */
  uint16_t kv1[4] = {0x3c00, 0x4000, 0xbc00, 0x0000};
  put_st(ed, "layer_1.safetensors", REF_HDR[1], kv1, sizeof kv1);
  /* layer 2: ArraysCache, state_0 f32 upcast from bf16, state_1 int32. Data
   * order = dtype (F32 > I32) then name. */
  char d2[24];
  float s0[3] = {0.25f, 0.5f, 0.75f};
  int32_t s1[3] = {1, -2, 3};
  memcpy(d2, s0, 12);
  memcpy(d2 + 12, s1, 12);
  put_st(ed, "layer_2.safetensors", REF_HDR[2], d2, sizeof d2);
  /* layer 3: MambaCache with a single state (mlx-lm's old class name) */
  float s3[2] = {4.0f, 5.0f};
  put_st(ed, "layer_3.safetensors",
         "{\"layer_3_state_0\":{\"dtype\":\"F32\",\"shape\":[2],"
         "\"data_offsets\":[0,8]}}",
         s3, sizeof s3);
  const char *manifest =
      "{\"num_layers\": 4, \"layers\": [{\"layer_type\": \"KVCache\", "
      "\"layer_idx\": 0, \"offset\": 2, \"keys_original_dtype\": "
      "\"bfloat16\", \"values_original_dtype\": \"bfloat16\"}, "
      "{\"layer_type\": \"KVCache\", \"layer_idx\": 1, \"offset\": 9, "
      "\"max_size\": 4, \"keep\": 0, \"step\": 256, \"_idx\": 1}, "
      "{\"layer_type\": \"ArraysCache\", \"layer_idx\": 2, \"num_arrays\": 2, "
      "\"state_original_dtypes\": [\"bfloat16\", null]}, {\"layer_type\": "
      "\"MambaCache\", \"layer_idx\": 3, \"num_arrays\": 1}], "
      "\"memory_bytes\": 4096, \"num_tokens\": 6}";
  char *mp = t_join(ed, "manifest.json");
  t_write_all(mp, manifest, strlen(manifest));
  char *tp = t_join(ed, "tokens.bin");
  t_write_all(tp, tok, sizeof tok);

  kvt_entry *e = NULL;
  kvti_read_opts ro = {0};
  ro.tokens = tok;
  ro.n_tokens = 6;
  REQUIRE(kvti_entry_read(&e, dir, h, &ro) == 0);
  CHECK_EQ_INT(kvt_entry_num_layers(e), 4);
  CHECK_EQ_INT(kvt_entry_memory_bytes(e), 4096);
  CHECK_EQ_INT(kvt_entry_storage_mode(e), KVT_STORAGE_COMPAT);
  const kvt_layer *l0 = kvt_entry_layer(e, 0), *l1 = kvt_entry_layer(e, 1),
                  *l2 = kvt_entry_layer(e, 2), *l3 = kvt_entry_layer(e, 3);
  CHECK_EQ_INT(l0->kind, KVT_LAYER_KV);
  CHECK_EQ_INT(l0->offset, 2);
  CHECK(l0->orig_dtypes && l0->orig_dtypes[0] == KVT_DTYPE_BF16 &&
        l0->orig_dtypes[1] == KVT_DTYPE_BF16);
  CHECK(l0->tensors[0].dtype == KVT_DTYPE_F32 &&
        memcmp(l0->tensors[0].data, kv0, 16) == 0 &&
        memcmp(l0->tensors[1].data, kv0 + 4, 16) == 0);
  CHECK_EQ_INT(l1->kind, KVT_LAYER_ROTATING_KV);
  CHECK(l1->offset == 9 && l1->max_size == 4 && l1->keep == 0 &&
        l1->step == 256 && l1->idx == 1 && l1->orig_dtypes == NULL);
  CHECK(memcmp(l1->tensors[1].data, kv1 + 2, 4) == 0);
  CHECK_EQ_INT(l2->kind, KVT_LAYER_ARRAYS);
  CHECK_EQ_INT(l2->num_tensors, 2);
  CHECK_EQ_INT(l2->offset, KVT_ABSENT);
  CHECK(l2->orig_dtypes && l2->orig_dtypes[0] == KVT_DTYPE_BF16 &&
        l2->orig_dtypes[1] == 0);
  CHECK(memcmp(l2->tensors[0].data, s0, 12) == 0 &&
        memcmp(l2->tensors[1].data, s1, 12) == 0 &&
        l2->tensors[1].dtype == KVT_DTYPE_I32);
  CHECK(l3->kind == KVT_LAYER_ARRAYS && l3->num_tensors == 1 &&
        memcmp(l3->tensors[0].data, s3, 8) == 0);
  kvt_entry_free(e);
  /* without expected tokens (tokens.bin) too */
  REQUIRE(kvti_entry_read(&e, dir, h, NULL) == 0);
  kvt_entry_free(e);
  char *js = NULL;
  REQUIRE(kvti_entry_describe(&js, dir, h) == 0);
  CHECK(strstr(js, "\"storage_mode\":\"reference\"") != NULL);
  kvt_free(js);

  /* structural damage the reference has no checksum for is still caught */
  size_t ml = strlen(manifest);
  char *bad = malloc(ml + 64);
  struct {
    const char *from, *to;
  } edits[] = {
      {"\"num_layers\": 4", "\"num_layers\": 5"},
      {"\"num_layers\": 4", "\"num_layers\": \"4\""},
      {"\"layer_idx\": 1", "\"layer_idx\": 2"},
      {"\"offset\": 2", "\"offset\": -2"},
      {"\"offset\": 2", "\"offset\": 2.5"},
      {"\"num_arrays\": 2", "\"num_arrays\": 3"},
      {"\"num_arrays\": 1", "\"num_arrays\": 0"},
      {"\"MambaCache\"", "\"FancyCache\""},
      {"\"num_tokens\": 6", "\"num_tokens\": 5"},
      {"\"memory_bytes\": 4096", "\"memory_bytes\": null"},
      {"[\"bfloat16\", null]", "[\"bfloat16\"]"},
      {"\"keys_original_dtype\": \"bfloat16\"", "\"keys_original_dtype\": 3"},
      {"{\"num_layers\"", "[{\"num_layers\""},
      {"\"layers\": [", "\"layers\": {"},
  };
  for (size_t i = 0; i < sizeof edits / sizeof edits[0]; i++) {
    const char *at = strstr(manifest, edits[i].from);
    REQUIRE(at);
    size_t pre = (size_t)(at - manifest);
    sprintf(bad, "%.*s%s%s", (int)pre, manifest, edits[i].to,
            at + strlen(edits[i].from));
    t_write_all(mp, bad, strlen(bad));
    int rc = read_status(dir, h);
    if (rc != KVT_ECORRUPT)
      fprintf(stderr, "edit %zu not detected: rc %d\n", i, rc);
    CHECK_EQ_INT(rc, KVT_ECORRUPT);
  }
  t_write_all(mp, manifest, ml);
  CHECK_EQ_INT(read_status(dir, h), 0);
  /* the standalone validator agrees */
  CHECK_EQ_INT(kvti_manifest_validate(manifest, ml), 0);
  for (size_t i = 0; i < sizeof edits / sizeof edits[0]; i++) {
    const char *at = strstr(manifest, edits[i].from);
    size_t pre = (size_t)(at - manifest);
    sprintf(bad, "%.*s%s%s", (int)pre, manifest, edits[i].to,
            at + strlen(edits[i].from));
    int rc = kvti_manifest_validate(bad, strlen(bad));
    /* num_tokens is only checked against tokens.bin, num_arrays 1 -> 0 against
     * the layer file */
    if (strstr(edits[i].from, "num_tokens") ||
        strstr(edits[i].from, "num_arrays\": 1"))
      CHECK_EQ_INT(rc, 0);
    else
      CHECK_EQ_INT(rc, KVT_ECORRUPT);
  }
  for (size_t cut = 0; cut < ml; cut++)
    CHECK_EQ_INT(kvti_manifest_validate(manifest, cut), KVT_ECORRUPT);
  /* tokens.bin of the wrong length or content */
  t_write_all(tp, tok, sizeof tok - 4);
  CHECK_EQ_INT(read_status(dir, h), KVT_ECORRUPT);
  int32_t tok2[6];
  memcpy(tok2, tok, sizeof tok);
  tok2[5] = 1;
  t_write_all(tp, tok2, sizeof tok2);
  CHECK_EQ_INT(read_status(dir, h), KVT_ECORRUPT);
  t_write_all(tp, tok, sizeof tok);
  CHECK_EQ_INT(read_status(dir, h), 0);
  /* a manifest.sum the manifest does not match */
  char *sp = t_join(ed, "manifest.sum");
  t_write_all(sp, "xxh3:0000000000000000\n", 22);
  CHECK_EQ_INT(read_status(dir, h), KVT_ECORRUPT);
  unlink(sp);
  free(sp);
  free(bad);
  free(mp);
  free(tp);
  free(ed);
}

/* kvtier's compat output is byte for byte what the reference writes for the
 * same cache. */
static void test_compat_bytes_match_reference(void) {
  char *dir = kvt_test_tmpdir("entry-compat-bytes");
  int32_t tok[3] = {11, 12, 13};
  char h[65];
  kvt_token_hash(h, tok, 3);
  float kv0[8] = {1.0f, -2.0f, 0.5f, 3.25f, -0.125f, 8.0f, 0.0f, -1.5f};
  uint16_t kv0b[8];
  for (int i = 0; i < 8; i++)
    kv0b[i] = t_f32_to_bf16(kv0[i]); /* exact: all are bf16 values */
  uint16_t kv1[4] = {0x3c00, 0x4000, 0xbc00, 0x0000};
  float s0[3] = {0.25f, 0.5f, 0.75f};
  uint16_t s0b[3];
  for (int i = 0; i < 3; i++)
    s0b[i] = t_f32_to_bf16(s0[i]);
  int32_t s1[3] = {1, -2, 3};
  kvt_tensor t0[2] = {{KVT_DTYPE_BF16, 4, {1, 1, 2, 2}, kv0b, 8},
                      {KVT_DTYPE_BF16, 4, {1, 1, 2, 2}, kv0b + 4, 8}};
  kvt_tensor t1[2] = {{KVT_DTYPE_F16, 4, {1, 1, 1, 2}, kv1, 4},
                      {KVT_DTYPE_F16, 4, {1, 1, 1, 2}, kv1 + 2, 4}};
  kvt_tensor t2[2] = {{KVT_DTYPE_BF16, 1, {3}, s0b, 6},
                      {KVT_DTYPE_I32, 1, {3}, s1, 12}};
  kvt_layer ls[3];
  kvt_layer_init(&ls[0], KVT_LAYER_KV);
  ls[0].tensors = t0;
  ls[0].offset = 2;
  kvt_layer_init(&ls[1], KVT_LAYER_ROTATING_KV);
  ls[1].tensors = t1;
  ls[1].offset = 9;
  ls[1].max_size = 4;
  ls[1].keep = 0;
  ls[1].step = 256;
  ls[1].idx = 1;
  kvt_layer_init(&ls[2], KVT_LAYER_ARRAYS);
  ls[2].num_tensors = 2;
  ls[2].tensors = t2;
  kvti_snapshot *s = NULL;
  REQUIRE(kvti_snapshot_create(&s, tok, 3, ls, 3, 4096, 0, NULL, NULL) == 0);
  kvti_write_opts o = {KVT_STORAGE_COMPAT, 0, 0600, 0700};
  REQUIRE(kvti_entry_write(NULL, dir, s, &o) == 0);
  kvti_snapshot_free(s);
  char *ed = t_join(dir, h);
  check_st(ed, "layer_0.safetensors", REF_HDR[0], kv0, sizeof kv0);
  check_st(ed, "layer_1.safetensors", REF_HDR[1], kv1, sizeof kv1);
  char d2[24];
  memcpy(d2, s0, 12);
  memcpy(d2 + 12, s1, 12);
  check_st(ed, "layer_2.safetensors", REF_HDR[2], d2, sizeof d2);
  const char *manifest =
      "{\"num_layers\": 3, \"layers\": [{\"layer_type\": \"KVCache\", "
      "\"layer_idx\": 0, \"offset\": 2, \"keys_original_dtype\": "
      "\"bfloat16\", \"values_original_dtype\": \"bfloat16\"}, "
      "{\"layer_type\": \"KVCache\", \"layer_idx\": 1, \"offset\": 9, "
      "\"max_size\": 4, \"keep\": 0, \"step\": 256, \"_idx\": 1}, "
      "{\"layer_type\": \"ArraysCache\", \"layer_idx\": 2, \"num_arrays\": 2, "
      "\"state_original_dtypes\": [\"bfloat16\", null]}], "
      "\"memory_bytes\": 4096, \"num_tokens\": 3";
  char *mp = t_join(ed, "manifest.json");
  size_t ml = 0;
  char *m = kvt_test_read_file(mp, &ml);
  REQUIRE(m);
  size_t pl = strlen(manifest);
  /* identical up to kvtier's extra key */
  CHECK(ml > pl && memcmp(m, manifest, pl) == 0 &&
        strncmp(m + pl, ", \"kvtier\": {", 13) == 0);
  char *tp = t_join(ed, "tokens.bin");
  size_t tl = 0;
  char *tb = kvt_test_read_file(tp, &tl);
  CHECK(tb && tl == sizeof tok && memcmp(tb, tok, tl) == 0);
  free(tb);
  free(tp);
  free(m);
  free(mp);
  free(ed);
}

/* ---- callbacks, cancellation, names ------------------------------------ */

static int g_allocs, g_frees, g_layers_seen;
static void *cb_alloc(void *ctx, uint32_t layer, uint32_t tensor,
                      const kvt_tensor *desc) {
  (void)ctx;
  (void)layer;
  (void)tensor;
  g_allocs++;
  return malloc(desc->nbytes);
}
static void cb_free(void *ctx, void *buf) {
  (void)ctx;
  g_frees++;
  free(buf);
}
static void cb_layer(void *ctx, uint32_t i, const kvt_layer *l) {
  (void)l;
  CHECK_EQ_INT(i, (uint32_t)g_layers_seen);
  g_layers_seen++;
  if (ctx && g_layers_seen == 2)
    atomic_store((atomic_int *)ctx, 1);
}

static void test_callbacks_and_cancel(void) {
  char *dir = kvt_test_tmpdir("entry-cb");
  char h[65];
  small_entry(dir, KVT_STORAGE_NATIVE, h);
  kvti_read_opts ro = {0};
  ro.alloc = cb_alloc;
  ro.free_buf = cb_free;
  ro.on_layer = cb_layer;
  kvt_entry *e = NULL;
  g_allocs = g_frees = g_layers_seen = 0;
  REQUIRE(kvti_entry_read(&e, dir, h, &ro) == 0);
  CHECK_EQ_INT(g_layers_seen, 4);
  CHECK(g_allocs > 0 && g_frees == 0);
  kvt_entry_free(e);
  CHECK_EQ_INT(g_frees, g_allocs);
  /* cancel after layer 1: nothing returned, every caller buffer handed back */
  atomic_int cancel = 0;
  ro.cancel = &cancel;
  ro.layer_ctx = &cancel;
  g_allocs = g_frees = g_layers_seen = 0;
  e = NULL;
  CHECK_EQ_INT(kvti_entry_read(&e, dir, h, &ro), KVT_ECANCELED);
  CHECK(e == NULL);
  CHECK_EQ_INT(g_layers_seen, 2);
  CHECK_EQ_INT(g_frees, g_allocs);
  /* corruption in the last layer: caller buffers of earlier layers handed back
   */
  char *ed = t_join(dir, h), *p = t_join(ed, "layer_3.safetensors");
  size_t len = 0;
  char *orig = kvt_test_read_file(p, &len);
  REQUIRE(orig && len > 0);
  orig[len - 1] ^= 1;
  t_write_all(p, orig, len);
  ro.cancel = NULL;
  ro.layer_ctx = NULL;
  g_allocs = g_frees = g_layers_seen = 0;
  CHECK_EQ_INT(kvti_entry_read(&e, dir, h, &ro), KVT_ECORRUPT);
  CHECK(g_allocs > 0);
  CHECK_EQ_INT(g_frees, g_allocs);
  /* verify_only finds it too, and succeeds on a good entry */
  kvti_read_opts vo = {0};
  vo.verify_only = 1;
  CHECK_EQ_INT(kvti_entry_read(NULL, dir, h, &vo), KVT_ECORRUPT);
  orig[len - 1] ^= 1;
  t_write_all(p, orig, len);
  CHECK_EQ_INT(kvti_entry_read(NULL, dir, h, &vo), 0);
  /* names that are not 64 hex digits are refused before touching the disk */
  const char *bad[] = {"../etc", "", "ABCDEF", NULL};
  for (int i = 0; bad[i]; i++) {
    CHECK_EQ_INT(kvti_entry_read(&e, dir, bad[i], NULL), KVT_EINVAL);
    char *js = NULL;
    CHECK_EQ_INT(kvti_entry_describe(&js, dir, bad[i]), KVT_EINVAL);
  }
  char up[65];
  for (int i = 0; i < 64; i++)
    up[i] = (char)toupper((unsigned char)h[i]);
  up[64] = 0;
  CHECK_EQ_INT(kvti_entry_read(&e, dir, up, NULL), KVT_EINVAL);
  /* symlinks inside or as the entry are refused as corruption */
  {
    char *lp = t_join(ed, "layer_1.safetensors"), *lk = t_join(ed, "elsewhere");
    check_symlink_refused(dir, h, lp, lk);
    char *mp = t_join(ed, "manifest.json");
    check_symlink_refused(dir, h, mp, lk);
    char *moved = t_join(dir, "moved");
    check_symlink_refused(dir, h, ed, moved);
    free(moved);
    free(mp);
    free(lp);
    free(lk);
  }
  /* absent entry */
  char other[65];
  memset(other, 'a', 64);
  other[64] = 0;
  CHECK_EQ_INT(kvti_entry_read(&e, dir, other, NULL), KVT_ENOTFOUND);
  free(orig);
  free(p);
  free(ed);
}

static int g_released;
static void on_release(void *ctx) {
  (void)ctx;
  g_released++;
}

static void test_snapshot_validation(void) {
  kvt_rng r = {6};
  int32_t tok[2] = {1, 2};
  kvt_layer l = t_kv(&r, KVT_DTYPE_F32, 1, 1, 2, 2, 2);
  kvti_snapshot *s = NULL;
  /* no-copy: release runs exactly once, on free */
  g_released = 0;
  REQUIRE(kvti_snapshot_create(&s, tok, 2, &l, 1, 0, 0, on_release, NULL) == 0);
  CHECK_EQ_INT(kvti_snapshot_held_bytes(s), 8);
  CHECK_EQ_INT(g_released, 0);
  kvti_snapshot_free(s);
  CHECK_EQ_INT(g_released, 1);
  /* copy: held bytes count the data */
  REQUIRE(kvti_snapshot_create(&s, tok, 2, &l, 1, 0, 1, NULL, NULL) == 0);
  CHECK_EQ_INT(kvti_snapshot_held_bytes(s), 8 + 2 * 16);
  size_t n;
  CHECK(kvti_snapshot_tokens(s, &n)[1] == 2 && n == 2);
  kvti_snapshot_free(s);
  /* invalid layers: EINVAL, release still runs */
  struct {
    int what;
  } cases[] = {{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    kvt_layer b = l;
    kvt_tensor t[2] = {l.tensors[0], l.tensors[1]};
    b.tensors = t;
    switch (cases[i].what) {
    case 0:
      b.kind = 99;
      break;
    case 1:
      b.num_tensors = 3;
      break;
    case 2:
      t[0].nbytes++;
      break;
    case 3:
      t[1].dtype = 77;
      break;
    case 4:
      t[0].shape[1] = -1;
      break;
    case 5:
      b.offset = -3;
      break;
    case 6:
      b.kind = KVT_LAYER_ROTATING_KV;
      break; /* no max_size */
    case 7:
      t[0].data = NULL;
      break;
    }
    g_released = 0;
    s = NULL;
    CHECK_EQ_INT(
        kvti_snapshot_create(&s, tok, 2, &b, 1, 0, 0, on_release, NULL),
        KVT_EINVAL);
    CHECK(s == NULL);
    CHECK_EQ_INT(g_released, 1);
  }
  t_layer_free(&l);
  /* quantized geometry */
  kvt_layer q = t_quant(&r, 4, 32, KVT_DTYPE_F16, 1, 1, 2, 64, 2);
  CHECK_EQ_INT(kvti_snapshot_create(&s, tok, 2, &q, 1, 0, 1, NULL, NULL), 0);
  kvti_snapshot_free(s);
  q.group_size = 48; /* 64 not a multiple */
  CHECK_EQ_INT(kvti_snapshot_create(&s, tok, 2, &q, 1, 0, 1, NULL, NULL),
               KVT_EINVAL);
  q.group_size = 32;
  q.bits = 7;
  CHECK_EQ_INT(kvti_snapshot_create(&s, tok, 2, &q, 1, 0, 1, NULL, NULL),
               KVT_EINVAL);
  q.bits = 4;
  q.tensors[4].dtype = KVT_DTYPE_BF16; /* values scales vs biases dtype */
  CHECK_EQ_INT(kvti_snapshot_create(&s, tok, 2, &q, 1, 0, 1, NULL, NULL),
               KVT_EINVAL);
  t_layer_free(&q);
}

static void test_compat_unsupported_bits(void) {
  char *dir = kvt_test_tmpdir("entry-5bit");
  kvt_rng r = {7};
  kvt_layer q = t_quant(&r, 5, 32, KVT_DTYPE_F16, 1, 1, 2, 32, 2);
  int32_t tok[1] = {42};
  CHECK_EQ_INT(write_entry(dir, tok, 1, &q, 1, KVT_STORAGE_COMPAT, NULL),
               KVT_EUNSUPPORTED);
  CHECK_EQ_INT(count_dir(dir), 0);
  /* native keeps it packed: fine */
  CHECK_EQ_INT(write_entry(dir, tok, 1, &q, 1, KVT_STORAGE_NATIVE, NULL), 0);
  char h[65];
  kvt_token_hash(h, tok, 1);
  kvt_entry *e = NULL;
  REQUIRE(kvti_entry_read(&e, dir, h, NULL) == 0);
  CHECK(t_layer_eq(kvt_entry_layer(e, 0), &q));
  kvt_entry_free(e);
  t_layer_free(&q);
}

static void test_empty_entry(void) {
  char *dir = kvt_test_tmpdir("entry-empty");
  kvt_entry *e = NULL;
  char *nodir = t_join(dir, "missing");
  CHECK_EQ_INT(write_entry(nodir, NULL, 0, NULL, 0, KVT_STORAGE_NATIVE, NULL),
               KVT_EIO);
  free(nodir);
  REQUIRE(write_entry(dir, NULL, 0, NULL, 0, KVT_STORAGE_NATIVE, NULL) == 0);
  char h[65];
  kvt_token_hash(h, NULL, 0);
  REQUIRE(kvti_entry_read(&e, dir, h, NULL) == 0);
  size_t n = 9;
  kvt_entry_tokens(e, &n);
  CHECK_EQ_INT(n, 0);
  CHECK_EQ_INT(kvt_entry_num_layers(e), 0);
  kvt_entry_free(e);
}

/* ---- concurrent replacement / removal during a read ---------------------- */

static int r_armed; /* 1: replace, 2: remove, on the open of layer_1 */
static const char *r_dir;
static kvt_layer *r_new;
static int r_open(const char *p, int fl, mode_t m) {
  size_t n = strlen(p);
  if (r_armed && n > 19 && strcmp(p + n - 19, "layer_1.safetensors") == 0) {
    int what = r_armed;
    r_armed = 0;
    int32_t tok[2] = {5, 6};
    if (what == 1)
      REQUIRE(write_entry(r_dir, tok, 2, r_new, 2, KVT_STORAGE_NATIVE, NULL) ==
              0);
    else {
      char h[65];
      kvt_token_hash(h, tok, 2);
      char *ed = t_join(r_dir, h);
      kvt_test_rmtree(ed);
      free(ed);
    }
  }
  return kvti_io_default.open(p, fl, m);
}
static void noop_layer(void *ctx, uint32_t i, const kvt_layer *l) {
  (void)ctx;
  (void)i;
  (void)l;
}

static void test_replaced_while_read(void) {
  char *dir = kvt_test_tmpdir("entry-race");
  kvt_rng r = {10};
  static kvt_layer a[2], b[2];
  for (int i = 0; i < 2; i++) {
    a[i] = t_kv(&r, KVT_DTYPE_F32, 1, 1, 2, 4, 2);
    b[i] = t_kv(&r, KVT_DTYPE_F32, 1, 1, 2, 4, 2);
  }
  int32_t tok[2] = {5, 6};
  char h[65];
  kvt_token_hash(h, tok, 2);
  kvti_io_ops ops = kvti_io_default;
  ops.open = r_open;
  r_dir = dir;
  r_new = b;
  for (int rep = 0; rep < 2; rep++) { /* with exchange, then the fallback */
    ops.rename_exchange = rep ? NULL : kvti_io_default.rename_exchange;
    /* replaced before any layer was reported: retried, the new version returned
     */
    REQUIRE(write_entry(dir, tok, 2, a, 2, KVT_STORAGE_NATIVE, NULL) == 0);
    kvt_entry *e = NULL;
    r_armed = 1;
    kvti_io_set(&ops);
    int rc = kvti_entry_read(&e, dir, h, NULL);
    kvti_io_set(NULL);
    CHECK_EQ_INT(rc, 0);
    CHECK(r_armed == 0);
    if (rc == 0) {
      CHECK(t_layer_eq(kvt_entry_layer(e, 0), &b[0]));
      CHECK(t_layer_eq(kvt_entry_layer(e, 1), &b[1]));
      kvt_entry_free(e);
    }
    /* replaced after layer 0 was reported: KVT_EAGAIN, never corruption */
    REQUIRE(write_entry(dir, tok, 2, a, 2, KVT_STORAGE_NATIVE, NULL) == 0);
    kvti_read_opts ro = {0};
    ro.on_layer = noop_layer;
    r_armed = 1;
    kvti_io_set(&ops);
    rc = kvti_entry_read(&e, dir, h, &ro);
    kvti_io_set(NULL);
    CHECK_EQ_INT(rc, KVT_EAGAIN);
    /* removed during the read: not found, not corrupt */
    r_armed = 2;
    kvti_io_set(&ops);
    rc = kvti_entry_read(&e, dir, h, NULL);
    kvti_io_set(NULL);
    CHECK_EQ_INT(rc, KVT_ENOTFOUND);
  }
  for (int i = 0; i < 2; i++) {
    t_layer_free(&a[i]);
    t_layer_free(&b[i]);
  }
}

/* ---- Python's own view ------------------------------------------------ */

/* Python's json must re-serialise manifest.json to the identical text
 * (json.dump default separators), and every safetensors header must be the
 * compact serde_json form; checked with /usr/bin/python3 when present (skipped
 * otherwise). */
static void test_python_json(void) {
  if (access("/usr/bin/python3", X_OK) != 0) {
    kvt_test_skip("python", "Python json re-serialisation check: no "
                            "/usr/bin/python3");
    return;
  }
  char *dir = kvt_test_tmpdir("entry-python");
  char h[65];
  small_entry(dir, KVT_STORAGE_COMPAT, h);
  char *ed = t_join(dir, h);
  char *script = t_join(dir, "check.py");
  const char *py =
      "import json, os, struct, sys\n"
      "d = sys.argv[1]\n"
      "t = open(os.path.join(d, 'manifest.json')).read()\n"
      "m = json.loads(t)\n"
      "assert json.dumps(m) == t, 'manifest differs from json.dumps'\n"
      "for i in range(m['num_layers']):\n"
      "    b = open(os.path.join(d, 'layer_%d.safetensors' % i), 'rb').read()\n"
      "    n = struct.unpack('<Q', b[:8])[0]\n"
      "    assert (8 + n) % 8 == 0\n"
      "    hs = b[8:8 + n].decode()\n"
      "    hd = json.loads(hs)\n"
      "    assert json.dumps(hd, separators=(',', ':')) == hs.rstrip(' ')\n"
      "    assert hs == hs.rstrip(' ') + ' ' * (len(hs) - len(hs.rstrip(' "
      "')))\n"
      "    end = max([v['data_offsets'][1] for v in hd.values()] + [0])\n"
      "    assert 8 + n + end == len(b)\n"
      "    assert m['layers'][i]['layer_type'] in ('KVCache', 'ArraysCache')\n"
      "toks = open(os.path.join(d, 'tokens.bin'), 'rb').read()\n"
      "assert len(toks) == 4 * m['num_tokens']\n"
      "import hashlib\n"
      "assert hashlib.sha256(toks).hexdigest() == os.path.basename(d)\n";
  t_write_all(script, py, strlen(py));
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s %s", script, ed);
  CHECK_EQ_INT(system(cmd), 0);
  free(script);
  free(ed);
}

/* ---- allocation failures ------------------------------------------------ */

static int a_at, a_calls, a_hit;
static int a_fail(void) {
  if (++a_calls == a_at) {
    a_hit = 1;
    errno = ENOMEM;
    return 1;
  }
  return 0;
}
static void *a_malloc(size_t n) {
  return a_fail() ? NULL : malloc(n);
}
static void *a_calloc(size_t n, size_t z) {
  return a_fail() ? NULL : calloc(n, z);
}
static void *a_realloc(void *p, size_t n) {
  return a_fail() ? NULL : realloc(p, n);
}

static void test_allocation_failures(void) {
  char *dir = kvt_test_tmpdir("entry-oom");
  kvt_rng r = {8};
  kvt_layer ls[3];
  ls[0] = t_kv(&r, KVT_DTYPE_BF16, 1, 1, 2, 4, 2);
  kvt_dtype dts[2] = {KVT_DTYPE_F32, KVT_DTYPE_BF16};
  ls[1] = t_arrays(&r, 2, dts);
  ls[2] = t_quant(&r, 4, 32, KVT_DTYPE_BF16, 1, 1, 2, 32, 2);
  int32_t tok[3] = {3, 1, 4};
  char h[65];
  kvt_token_hash(h, tok, 3);
  kvti_io_ops ops = kvti_io_default;
  ops.malloc = a_malloc;
  ops.calloc = a_calloc;
  ops.realloc = a_realloc;
  for (int mode = 0; mode < 2; mode++) {
    int fails = 0;
    for (a_at = 1; a_at < 10000; a_at++) {
      kvt_test_rmtree(dir);
      mkdir(dir, 0700);
      a_calls = 0;
      a_hit = 0;
      kvti_io_set(&ops);
      int rc = write_entry(dir, tok, 3, ls, 3, mode, NULL);
      kvti_io_set(NULL);
      if (!a_hit) {
        CHECK_EQ_INT(rc, 0);
        break;
      }
      if (rc == 0)
        continue;
      fails++;
      CHECK_EQ_INT(rc, KVT_ENOMEM);
      CHECK_EQ_INT(count_dir(dir), 0);
    }
    CHECK(fails > 10);
    /* reads (and describe) of the complete entry */
    fails = 0;
    for (a_at = 1; a_at < 10000; a_at++) {
      a_calls = 0;
      a_hit = 0;
      kvt_entry *e = NULL;
      char *js = NULL;
      kvti_io_set(&ops);
      int rc = kvti_entry_read(&e, dir, h, NULL);
      int rc2 = kvti_entry_describe(&js, dir, h);
      kvti_io_set(NULL);
      kvt_entry_free(e);
      kvt_free(js);
      if (!a_hit) {
        CHECK_EQ_INT(rc, 0);
        CHECK_EQ_INT(rc2, 0);
        break;
      }
      if (rc)
        CHECK(e == NULL);
      CHECK(rc == 0 || rc == KVT_ENOMEM);
      CHECK(rc2 == 0 || rc2 == KVT_ENOMEM);
      fails += rc != 0;
    }
    CHECK(fails > 10);
  }
  for (int i = 0; i < 3; i++)
    t_layer_free(&ls[i]);
}

int main(void) {
  RUN(test_native_roundtrip);
  RUN(test_compat_roundtrip);
  RUN(test_replace);
  RUN(test_corrupt_native);
  RUN(test_corrupt_compat);
  RUN(test_failed_writes);
  RUN(test_reference_layout);
  RUN(test_compat_bytes_match_reference);
  RUN(test_callbacks_and_cancel);
  RUN(test_snapshot_validation);
  RUN(test_compat_unsupported_bits);
  RUN(test_empty_entry);
  RUN(test_allocation_failures);
  RUN(test_python_json);
  RUN(test_replaced_while_read);
  return kvt_test_done();
}
