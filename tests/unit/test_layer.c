/*
 * test_layer.c - dtypes and single layers: the dtype table, exhaustive bf16/f16
 * <-> f32 conversion checks against straightforward reference implementations,
 * kvt_layer_save / kvt_layer_load round trips of every layer kind and dtype in
 * both storage modes (native bit-exact; compat: bf16 -> F32 exact upcast with
 * hints, quantized layers dequantized and checked element by element against an
 * independent MLX affine dequantization, trimmed to offset, bf16 -> F16), the
 * exact manifest objects (Python json.dumps style), and malformed layer
 * metadata and files.
 */
#include "fmt_testlib.h"
#include "format/dtype.h"
#include "format/layer.h"
#include "kvtier_sys.h"

static char *g_dir;

static void test_dtype_table(void) {
  size_t sizes[] = {0, 1, 1, 1, 2, 2, 2, 2, 4, 4, 4, 8, 8, 8};
  for (int d = 0; d <= 13; d++) {
    CHECK_EQ_INT(kvt_dtype_size((kvt_dtype)d), sizes[d]);
    const char *n = kvt_dtype_name((kvt_dtype)d);
    if (d == 0) {
      CHECK(n == NULL);
      continue;
    }
    REQUIRE(n);
    CHECK_EQ_INT(kvt_dtype_from_name(n), d);
    CHECK_EQ_INT(kvti_dtype_from_np_name(kvti_dtype_np_name((kvt_dtype)d)), d);
  }
  CHECK(kvt_dtype_size((kvt_dtype)14) == 0 &&
        kvt_dtype_name((kvt_dtype)-1) == NULL);
  CHECK_EQ_INT(kvt_dtype_from_name("bf16"), KVT_DTYPE_INVALID);
  CHECK_EQ_INT(kvt_dtype_from_name(NULL), KVT_DTYPE_INVALID);
  CHECK(strcmp(kvt_dtype_name(KVT_DTYPE_BF16), "BF16") == 0);
  CHECK(strcmp(kvti_dtype_np_name(KVT_DTYPE_BF16), "bfloat16") == 0);
  kvt_layer l;
  kvt_layer_init(&l, KVT_LAYER_QUANTIZED_KV);
  CHECK(l.num_tensors == 6 && l.offset == KVT_ABSENT &&
        l.max_size == KVT_ABSENT && l.tensors == NULL && l.orig_dtypes == NULL);
  kvt_layer_init(&l, KVT_LAYER_ARRAYS);
  CHECK(l.num_tensors == 0);
  kvt_layer_init(NULL, KVT_LAYER_KV);
}

static void test_conversions(void) {
  int bad = 0;
  /* every f16 and bf16 value widens exactly and narrows back to itself */
  for (uint32_t h = 0; h < 65536; h++) {
    float a = kvti_f16_to_f32((uint16_t)h), b = t_f16_to_f32((uint16_t)h);
    if (isnan(b)) {
      if (!isnan(a))
        bad++;
      continue;
    }
    if (memcmp(&a, &b, 4) != 0 || kvti_f32_to_f16(a) != h)
      bad++;
    float c = kvti_bf16_to_f32((uint16_t)h);
    if (!isnan(c) && kvti_f32_to_bf16(c) != h)
      bad++;
  }
  CHECK_EQ_INT(bad, 0);
  /* narrowing of arbitrary floats (including ties, subnormals, overflow) */
  kvt_rng r = {21};
  for (int i = 0; i < 200000; i++) {
    uint32_t u = (uint32_t)kvt_rng_next(&r);
    if (i % 4 == 0) /* exponents near the f16 range */
      u = (u & 0x807fffffu) | ((uint32_t)(100 + kvt_rng_next(&r) % 45) << 23);
    if (i % 8 == 1) /* exact ties for f16 normals */
      u = (u & 0xffffe000u) | 0x1000u;
    float f;
    memcpy(&f, &u, 4);
    if (isnan(f))
      continue;
    if (kvti_f32_to_f16(f) != t_f32_to_f16(f))
      bad++;
    if (kvti_f32_to_bf16(f) != t_f32_to_bf16(f))
      bad++;
  }
  CHECK_EQ_INT(bad, 0);
  CHECK_EQ_INT(kvti_f32_to_f16(65504.0f), 0x7bff);
  CHECK_EQ_INT(kvti_f32_to_f16(65519.99f), 0x7bff);
  CHECK_EQ_INT(kvti_f32_to_f16(65520.0f), 0x7c00);
  CHECK_EQ_INT(kvti_f32_to_f16(-INFINITY), 0xfc00);
  CHECK(isnan(kvti_f16_to_f32(kvti_f32_to_f16(NAN))));
  CHECK(isnan(kvti_bf16_to_f32(kvti_f32_to_bf16(NAN))));
  CHECK_EQ_INT(kvti_f32_to_bf16(1.0f + 0x1p-8f), 0x3f80); /* tie to even */
  CHECK_EQ_INT(kvti_f32_to_bf16(1.0f + 0x1p-8f + 0x1p-20f), 0x3f81);
}

static int save_load(kvt_entry **out, char **meta, const kvt_layer *l,
                     uint32_t idx, int mode) {
  char *p = t_join(g_dir, "layer.safetensors");
  int rc = kvt_layer_save(meta, p, l, idx, mode, 0600);
  if (rc == 0)
    rc = kvt_layer_load(out, p, *meta);
  free(p);
  return rc;
}

static void test_native_all(void) {
  kvt_rng r = {22};
  for (size_t i = 0; i < N_ALL_DTYPES; i++) {
    kvt_layer ls[3];
    ls[0] = t_kv(&r, ALL_DTYPES[i], 1, 2, 3, 4, 3);
    ls[1] = t_rotating(&r, ALL_DTYPES[i]);
    ls[1].orig_dtypes = calloc(2, 4);
    ls[1].orig_dtypes[0] = KVT_DTYPE_F32;
    ls[2] = t_arrays(&r, (uint32_t)N_ALL_DTYPES, ALL_DTYPES);
    for (int k = 0; k < 3; k++) {
      kvt_entry *e = NULL;
      char *meta = NULL;
      REQUIRE(save_load(&e, &meta, &ls[k], (uint32_t)(i * 3 + (size_t)k),
                        KVT_STORAGE_NATIVE) == 0);
      CHECK(t_layer_eq(kvt_entry_layer(e, 0), &ls[k]));
      CHECK_EQ_INT(kvt_entry_num_layers(e), 1);
      kvt_entry_free(e);
      kvt_free(meta);
      t_layer_free(&ls[k]);
    }
  }
  int bits[] = {2, 3, 4, 5, 6, 8};
  kvt_dtype sd[] = {KVT_DTYPE_F16, KVT_DTYPE_BF16, KVT_DTYPE_F32};
  for (int b = 0; b < 6; b++)
    for (int s = 0; s < 3; s++) {
      kvt_layer q = t_quant(&r, bits[b], 32, sd[s], 1, 2, 4, 64, 3);
      kvt_entry *e = NULL;
      char *meta = NULL;
      REQUIRE(save_load(&e, &meta, &q, 7, KVT_STORAGE_NATIVE) == 0);
      CHECK(t_layer_eq(kvt_entry_layer(e, 0), &q));
      kvt_entry_free(e);
      kvt_free(meta);
      t_layer_free(&q);
    }
}

static void check_dequant(const kvt_layer *got, const kvt_layer *q) {
  int bf = q->tensors[1].dtype == KVT_DTYPE_BF16;
  const kvt_tensor *p0 = &q->tensors[0];
  uint32_t nd = p0->ndim;
  int64_t T = nd >= 2 ? p0->shape[nd - 2] : 1;
  int64_t D = p0->shape[nd - 1] * 32 / q->bits;
  int64_t keep = (nd >= 3 && q->offset < T) ? q->offset : T;
  int64_t outer = p0->nbytes / 4 / (uint64_t)p0->shape[nd - 1] / (uint64_t)T;
  CHECK_EQ_INT(got->kind, KVT_LAYER_KV);
  for (int kv = 0; kv < 2; kv++) {
    const kvt_tensor *g = &got->tensors[kv];
    kvt_dtype od = bf ? KVT_DTYPE_F16 : (kvt_dtype)q->tensors[1].dtype;
    CHECK_EQ_INT(g->dtype, od);
    CHECK_EQ_INT(g->ndim, nd);
    CHECK_EQ_INT(g->shape[nd - 1], D);
    if (nd >= 2)
      CHECK_EQ_INT(g->shape[nd - 2], keep);
    int32_t h = got->orig_dtypes ? got->orig_dtypes[kv] : 0;
    CHECK_EQ_INT(h, bf ? KVT_DTYPE_BF16 : 0);
    size_t o = 0;
    int bad = 0;
    for (int64_t a = 0; a < outer; a++)
      for (int64_t t = 0; t < keep; t++)
        for (int64_t i = 0; i < D; i++, o++) {
          float want = t_dequant_elem(q, kv, a * T + t, i);
          if (bf)
            want = t_f16_to_f32(t_f32_to_f16(want));
          float gv = t_load(g->data, od, o);
          if (memcmp(&want, &gv, 4) != 0)
            bad++;
        }
    CHECK_EQ_INT(bad, 0);
    CHECK_EQ_INT(o * kvt_dtype_size(od), g->nbytes);
  }
}

static void test_compat_all(void) {
  kvt_rng r = {23};
  /* non-quantized kinds: bf16 -> F32 + hint, everything else unchanged */
  for (size_t i = 0; i < N_ALL_DTYPES; i++) {
    kvt_layer l = t_kv(&r, ALL_DTYPES[i], 2, 1, 3, 2, 1);
    kvt_entry *e = NULL;
    char *meta = NULL;
    REQUIRE(save_load(&e, &meta, &l, 0, KVT_STORAGE_COMPAT) == 0);
    const kvt_layer *g = kvt_entry_layer(e, 0);
    if (ALL_DTYPES[i] == KVT_DTYPE_BF16) {
      CHECK(strstr(meta, "\"keys_original_dtype\": \"bfloat16\"") != NULL);
      for (int j = 0; j < 2; j++) {
        CHECK_EQ_INT(g->tensors[j].dtype, KVT_DTYPE_F32);
        CHECK_EQ_INT(g->orig_dtypes[j], KVT_DTYPE_BF16);
        for (size_t k = 0; k < 12; k++)
          CHECK(((float *)g->tensors[j].data)[k] ==
                t_load(l.tensors[j].data, KVT_DTYPE_BF16, k));
      }
    } else {
      CHECK(t_layer_eq(g, &l));
    }
    kvt_entry_free(e);
    kvt_free(meta);
    t_layer_free(&l);
  }
  kvt_layer a = t_arrays(&r, (uint32_t)N_ALL_DTYPES, ALL_DTYPES);
  kvt_entry *e = NULL;
  char *meta = NULL;
  REQUIRE(save_load(&e, &meta, &a, 4, KVT_STORAGE_COMPAT) == 0);
  const kvt_layer *g = kvt_entry_layer(e, 0);
  for (uint32_t j = 0; j < a.num_tensors; j++) {
    if (a.tensors[j].dtype == KVT_DTYPE_BF16) {
      CHECK_EQ_INT(g->tensors[j].dtype, KVT_DTYPE_F32);
      CHECK_EQ_INT(g->orig_dtypes[j], KVT_DTYPE_BF16);
    } else {
      CHECK(t_tensor_eq(&g->tensors[j], &a.tensors[j]));
      CHECK_EQ_INT(g->orig_dtypes[j], 0);
    }
  }
  CHECK(strstr(meta, "\"state_original_dtypes\": [null, null, null, null, "
                     "null, null, \"bfloat16\", null") != NULL);
  kvt_entry_free(e);
  kvt_free(meta);
  t_layer_free(&a);
  /* quantized: every supported bits, every scales dtype, with and without
   * trimming */
  int bits[] = {2, 3, 4, 6, 8};
  int gss[] = {32, 64, 128};
  kvt_dtype sd[] = {KVT_DTYPE_F16, KVT_DTYPE_BF16, KVT_DTYPE_F32};
  for (int b = 0; b < 5; b++)
    for (int s = 0; s < 3; s++)
      for (int trim = 0; trim < 2; trim++) {
        int gs = gss[(b + s) % 3];
        kvt_layer q =
            t_quant(&r, bits[b], gs, sd[s], 1, 2, 5, 128, trim ? 3 : 5);
        REQUIRE(save_load(&e, &meta, &q, 2, KVT_STORAGE_COMPAT) == 0);
        check_dequant(kvt_entry_layer(e, 0), &q);
        CHECK(strstr(meta, "\"layer_type\": \"KVCache\"") != NULL);
        kvt_entry_free(e);
        kvt_free(meta);
        t_layer_free(&q);
      }
  /* 2-D quantized tensors are never trimmed (the reference trims only ndim >=
   * 3) */
  kvt_layer q2;
  kvt_layer_init(&q2, KVT_LAYER_QUANTIZED_KV);
  q2.tensors = calloc(6, sizeof(kvt_tensor));
  for (int kv = 0; kv < 2; kv++) {
    q2.tensors[3 * kv] = t_tensor(&r, KVT_DTYPE_U32, 2, 4, 4);
    q2.tensors[3 * kv + 1] = t_tensor(&r, KVT_DTYPE_F32, 2, 4, 1);
    q2.tensors[3 * kv + 2] = t_tensor(&r, KVT_DTYPE_F32, 2, 4, 1);
  }
  q2.bits = 4;
  q2.group_size = 32;
  q2.offset = 1;
  REQUIRE(save_load(&e, &meta, &q2, 0, KVT_STORAGE_COMPAT) == 0);
  CHECK_EQ_INT(kvt_entry_layer(e, 0)->tensors[0].shape[0], 4);
  check_dequant(kvt_entry_layer(e, 0), &q2);
  kvt_entry_free(e);
  kvt_free(meta);
  /* absent offset: the reference uses keys.shape[-2] */
  q2.offset = KVT_ABSENT;
  REQUIRE(save_load(&e, &meta, &q2, 0, KVT_STORAGE_COMPAT) == 0);
  CHECK_EQ_INT(kvt_entry_layer(e, 0)->offset, 4);
  kvt_entry_free(e);
  kvt_free(meta);
  t_layer_free(&q2);
  /* keys f16, values bf16: values reach the reference's snapshot as bf16 and
   * are upcast */
  kvt_layer qm = t_quant(&r, 4, 32, KVT_DTYPE_F16, 1, 1, 2, 32, 2);
  for (int j = 4; j < 6; j++) {
    free(qm.tensors[j].data);
    qm.tensors[j] = t_tensor(&r, KVT_DTYPE_BF16, 4, 1, 1, 2, 1);
  }
  REQUIRE(save_load(&e, &meta, &qm, 0, KVT_STORAGE_COMPAT) == 0);
  g = kvt_entry_layer(e, 0);
  CHECK_EQ_INT(g->tensors[0].dtype, KVT_DTYPE_F16);
  CHECK_EQ_INT(g->tensors[1].dtype, KVT_DTYPE_F32);
  CHECK(g->orig_dtypes && g->orig_dtypes[0] == 0 &&
        g->orig_dtypes[1] == KVT_DTYPE_BF16);
  for (int64_t i = 0; i < 64; i++)
    CHECK(((float *)g->tensors[1].data)[i] ==
          t_dequant_elem(&qm, 1, i / 32, i % 32));
  kvt_entry_free(e);
  kvt_free(meta);
  t_layer_free(&qm);
  /* 5-bit cannot be dequantized with confidence: refused in compat */
  kvt_layer q5 = t_quant(&r, 5, 32, KVT_DTYPE_F16, 1, 1, 2, 32, 2);
  CHECK_EQ_INT(save_load(&e, &meta, &q5, 0, KVT_STORAGE_COMPAT),
               KVT_EUNSUPPORTED);
  t_layer_free(&q5);
}

static void test_meta_exact(void) {
  kvt_rng r = {24};
  struct {
    kvt_layer l;
    int mode;
    const char *want;
  } c[5];
  c[0].l = t_kv(&r, KVT_DTYPE_F16, 1, 1, 1, 2, 1);
  c[0].mode = KVT_STORAGE_NATIVE;
  c[0].want = "{\"layer_type\": \"KVCache\", \"layer_idx\": 3, \"offset\": 1}";
  c[1].l = t_rotating(&r, KVT_DTYPE_BF16);
  c[1].mode = KVT_STORAGE_COMPAT;
  c[1].want = "{\"layer_type\": \"KVCache\", \"layer_idx\": 3, \"offset\": 11, "
              "\"keys_original_dtype\": \"bfloat16\", "
              "\"values_original_dtype\": \"bfloat16\", \"max_size\": 8, "
              "\"keep\": 2, \"step\": 256, \"_idx\": 3}";
  kvt_dtype d2[2] = {KVT_DTYPE_F32, KVT_DTYPE_BF16};
  c[2].l = t_arrays(&r, 2, d2);
  c[2].mode = KVT_STORAGE_COMPAT;
  c[2].want = "{\"layer_type\": \"ArraysCache\", \"layer_idx\": 3, "
              "\"num_arrays\": 2, \"state_original_dtypes\": [null, "
              "\"bfloat16\"]}";
  c[3].l = t_arrays(&r, 2, d2);
  c[3].mode = KVT_STORAGE_NATIVE;
  c[3].want = "{\"layer_type\": \"ArraysCache\", \"layer_idx\": 3, "
              "\"num_arrays\": 2}";
  c[4].l = t_quant(&r, 4, 64, KVT_DTYPE_BF16, 1, 1, 2, 64, 2);
  c[4].mode = KVT_STORAGE_NATIVE;
  c[4].want = "{\"layer_type\": \"QuantizedKVCache\", \"layer_idx\": 3, "
              "\"offset\": 2, \"bits\": 4, \"group_size\": 64}";
  for (int i = 0; i < 5; i++) {
    char *meta = NULL;
    char *p = t_join(g_dir, "m.safetensors");
    REQUIRE(kvt_layer_save(&meta, p, &c[i].l, 3, c[i].mode, 0600) == 0);
    if (strcmp(meta, c[i].want) != 0)
      fprintf(stderr, "got  %s\nwant %s\n", meta, c[i].want);
    CHECK(strcmp(meta, c[i].want) == 0);
    kvt_free(meta);
    free(p);
    t_layer_free(&c[i].l);
  }
}

static void test_bad_meta_and_files(void) {
  kvt_rng r = {25};
  kvt_layer l = t_kv(&r, KVT_DTYPE_F32, 1, 1, 2, 2, 2);
  char *p = t_join(g_dir, "bad.safetensors");
  char *meta = NULL;
  REQUIRE(kvt_layer_save(&meta, p, &l, 5, KVT_STORAGE_NATIVE, 0600) == 0);
  kvt_entry *e = NULL;
  const char *bad[] = {
      "{\"layer_type\": \"KVCache\", \"layer_idx\": 4, \"offset\": 2}",
      "{\"layer_type\": \"KVCache\", \"layer_idx\": 5}",
      "{\"layer_type\": \"KVCache\", \"layer_idx\": 5, \"offset\": \"2\"}",
      "{\"layer_type\": \"ArraysCache\", \"layer_idx\": 5, \"num_arrays\": 2}",
      "{\"layer_type\": \"QuantizedKVCache\", \"layer_idx\": 5, \"bits\": 4, "
      "\"group_size\": 32}",
      "{\"layer_type\": 1, \"layer_idx\": 5, \"offset\": 2}",
      "{\"layer_type\": \"Other\", \"layer_idx\": 5, \"offset\": 2}",
      "{\"layer_type\": \"KVCache\", \"layer_idx\": -5, \"offset\": 2}",
      "{\"layer_type\": \"KVCache\", \"layer_idx\": 5, \"offset\": 2, "
      "\"max_size\": \"x\"}",
      "[1]",
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    int rc = kvt_layer_load(&e, p, bad[i]);
    if (rc != KVT_ECORRUPT)
      fprintf(stderr, "bad meta %zu: rc %d\n", i, rc);
    CHECK_EQ_INT(rc, KVT_ECORRUPT);
  }
  CHECK_EQ_INT(kvt_layer_load(&e, p, "{not json"), KVT_EINVAL);
  CHECK_EQ_INT(kvt_layer_load(NULL, p, meta), KVT_EINVAL);
  /* the good one, then a missing file */
  REQUIRE(kvt_layer_load(&e, p, meta) == 0);
  CHECK(t_layer_eq(kvt_entry_layer(e, 0), &l));
  kvt_entry_free(e);
  char *missing = t_join(g_dir, "missing.safetensors");
  CHECK_EQ_INT(kvt_layer_load(&e, missing, meta), KVT_ECORRUPT);
  /* a file with an extra tensor is refused */
  kvt_dtype d3[3] = {KVT_DTYPE_F32, KVT_DTYPE_F32, KVT_DTYPE_F32};
  kvt_layer a3 = t_arrays(&r, 3, d3);
  char *m3 = NULL;
  REQUIRE(kvt_layer_save(&m3, p, &a3, 5, KVT_STORAGE_NATIVE, 0600) == 0);
  CHECK_EQ_INT(kvt_layer_load(&e, p,
                              "{\"layer_type\": \"ArraysCache\", "
                              "\"layer_idx\": 5, \"num_arrays\": 2}"),
               KVT_ECORRUPT);
  REQUIRE(kvt_layer_load(&e, p, m3) == 0);
  kvt_entry_free(e);
  /* invalid arguments to save */
  CHECK_EQ_INT(kvt_layer_save(&m3, p, &l, 0, 7, 0600), KVT_EINVAL);
  l.tensors[0].nbytes = 3;
  CHECK_EQ_INT(kvt_layer_save(&m3, p, &l, 0, 0, 0600), KVT_EINVAL);
  l.tensors[0].nbytes = 16;
  kvt_free(m3);
  kvt_free(meta);
  free(missing);
  free(p);
  t_layer_free(&a3);
  t_layer_free(&l);
}

int main(void) {
  g_dir = kvt_test_tmpdir("layer");
  RUN(test_dtype_table);
  RUN(test_conversions);
  RUN(test_native_all);
  RUN(test_compat_all);
  RUN(test_meta_exact);
  RUN(test_bad_meta_and_files);
  return kvt_test_done();
}
