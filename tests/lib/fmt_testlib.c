/*
 * fmt_testlib.c - the format-level test helpers declared in fmt_testlib.h:
 * seeded tensor/layer generators, bit-exact comparison and the independent
 * float and dequantization references the format tests check the library
 * against.
 */
#include "fmt_testlib.h"

const kvt_dtype ALL_DTYPES[N_ALL_DTYPES] = {
    KVT_DTYPE_BOOL, KVT_DTYPE_U8,   KVT_DTYPE_I8,  KVT_DTYPE_I16, KVT_DTYPE_U16,
    KVT_DTYPE_F16,  KVT_DTYPE_BF16, KVT_DTYPE_I32, KVT_DTYPE_U32, KVT_DTYPE_F32,
    KVT_DTYPE_I64,  KVT_DTYPE_U64,  KVT_DTYPE_F64};

float t_bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

uint16_t t_f32_to_bf16(float f) {
  /* round to nearest even through double arithmetic on the dropped bits */
  uint32_t u;
  memcpy(&u, &f, 4);
  if (isnan(f))
    return (uint16_t)((u >> 16) | 0x40);
  uint32_t lo = u & 0xffff, hi = u >> 16;
  if (lo > 0x8000 || (lo == 0x8000 && (hi & 1)))
    hi++;
  return (uint16_t)hi;
}

float t_f16_to_f32(uint16_t h) {
  int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
  double v;
  if (e == 0)
    v = ldexp(m, -24);
  else if (e == 31)
    v = m ? NAN : INFINITY;
  else
    v = ldexp(1024 + m, e - 25);
  return (float)(s ? -v : v);
}

uint16_t t_f32_to_f16(float f) {
  if (isnan(f))
    return 0x7e00;
  uint16_t sign = signbit(f) ? 0x8000 : 0;
  double a = fabs((double)f);
  if (a >= 65520.0)
    return sign | 0x7c00;
  /* candidates: binary search over the monotone positive encodings 0..0x7bff */
  uint16_t lo = 0, hi = 0x7bff;
  while (lo < hi) {
    uint16_t mid = (uint16_t)((lo + hi + 1) / 2);
    if (t_f16_to_f32(mid) <= a)
      lo = mid;
    else
      hi = (uint16_t)(mid - 1);
  }
  uint16_t best = lo;
  if (lo < 0x7bff || a > 65504.0) {
    double d0 = a - t_f16_to_f32(lo);
    double d1 = (lo < 0x7bff ? t_f16_to_f32((uint16_t)(lo + 1)) : 65536.0) - a;
    if (d1 < d0 || (d1 == d0 && (lo & 1)))
      best = (uint16_t)(lo + 1);
  }
  return sign | best;
}

float t_load(const void *buf, kvt_dtype dt, size_t i) {
  uint16_t h;
  float f;
  switch (dt) {
  case KVT_DTYPE_F16:
    memcpy(&h, (const char *)buf + 2 * i, 2);
    return t_f16_to_f32(h);
  case KVT_DTYPE_BF16:
    memcpy(&h, (const char *)buf + 2 * i, 2);
    return t_bf16_to_f32(h);
  case KVT_DTYPE_F32:
    memcpy(&f, (const char *)buf + 4 * i, 4);
    return f;
  default:
    abort();
  }
}

kvt_tensor t_tensor(kvt_rng *r, kvt_dtype dt, uint32_t ndim, ...) {
  kvt_tensor t;
  memset(&t, 0, sizeof t);
  t.dtype = dt;
  t.ndim = ndim;
  va_list ap;
  va_start(ap, ndim);
  uint64_t n = 1;
  for (uint32_t i = 0; i < ndim; i++) {
    t.shape[i] = va_arg(ap, int);
    n *= (uint64_t)t.shape[i];
  }
  va_end(ap);
  t.nbytes = n * kvt_dtype_size(dt);
  t.data = t.nbytes ? malloc(t.nbytes) : NULL;
  if (t.nbytes)
    kvt_rng_fill(r, t.data, t.nbytes);
  for (uint64_t i = 0; i < n; i++) {
    float v = (float)((int)(kvt_rng_next(r) % 2048) - 1024) / 256.0f;
    uint16_t h;
    double d = v;
    switch (dt) {
    case KVT_DTYPE_BOOL:
      ((uint8_t *)t.data)[i] &= 1;
      break;
    case KVT_DTYPE_F16:
      h = t_f32_to_f16(v);
      memcpy((char *)t.data + 2 * i, &h, 2);
      break;
    case KVT_DTYPE_BF16:
      h = t_f32_to_bf16(v);
      memcpy((char *)t.data + 2 * i, &h, 2);
      break;
    case KVT_DTYPE_F32:
      memcpy((char *)t.data + 4 * i, &v, 4);
      break;
    case KVT_DTYPE_F64:
      memcpy((char *)t.data + 8 * i, &d, 8);
      break;
    default:
      break;
    }
  }
  return t;
}

void t_layer_free(kvt_layer *l) {
  for (uint32_t j = 0; j < l->num_tensors; j++)
    free(l->tensors[j].data);
  free(l->tensors);
  free(l->orig_dtypes);
  memset(l, 0, sizeof *l);
}

kvt_layer t_kv(kvt_rng *r, kvt_dtype dt, int B, int H, int T, int D,
               int64_t offset) {
  kvt_layer l;
  kvt_layer_init(&l, KVT_LAYER_KV);
  l.tensors = calloc(2, sizeof(kvt_tensor));
  l.tensors[0] = t_tensor(r, dt, 4, B, H, T, D);
  l.tensors[1] = t_tensor(r, dt, 4, B, H, T, D);
  l.offset = offset;
  return l;
}

kvt_layer t_rotating(kvt_rng *r, kvt_dtype dt) {
  kvt_layer l = t_kv(r, dt, 1, 2, 8, 4, 11);
  l.kind = KVT_LAYER_ROTATING_KV;
  l.max_size = 8;
  l.keep = 2;
  l.step = 256;
  l.idx = 3;
  return l;
}

kvt_layer t_arrays(kvt_rng *r, uint32_t n, const kvt_dtype *dts) {
  kvt_layer l;
  kvt_layer_init(&l, KVT_LAYER_ARRAYS);
  l.num_tensors = n;
  l.tensors = calloc(n ? n : 1, sizeof(kvt_tensor));
  for (uint32_t j = 0; j < n; j++)
    l.tensors[j] = t_tensor(r, dts[j], 3, 1, 3, (int)(j + 2));
  return l;
}

kvt_layer t_quant(kvt_rng *r, int bits, int gs, kvt_dtype sdt, int B, int H,
                  int T, int D, int64_t offset) {
  kvt_layer l;
  kvt_layer_init(&l, KVT_LAYER_QUANTIZED_KV);
  l.tensors = calloc(6, sizeof(kvt_tensor));
  for (int kv = 0; kv < 2; kv++) {
    l.tensors[3 * kv] = t_tensor(r, KVT_DTYPE_U32, 4, B, H, T, D * bits / 32);
    l.tensors[3 * kv + 1] = t_tensor(r, sdt, 4, B, H, T, D / gs);
    l.tensors[3 * kv + 2] = t_tensor(r, sdt, 4, B, H, T, D / gs);
  }
  l.bits = bits;
  l.group_size = gs;
  l.offset = offset;
  return l;
}

int t_tensor_eq(const kvt_tensor *a, const kvt_tensor *b) {
  if (a->dtype != b->dtype || a->ndim != b->ndim || a->nbytes != b->nbytes)
    return 0;
  for (uint32_t d = 0; d < a->ndim; d++)
    if (a->shape[d] != b->shape[d])
      return 0;
  return a->nbytes == 0 || memcmp(a->data, b->data, a->nbytes) == 0;
}

int t_layer_eq(const kvt_layer *a, const kvt_layer *b) {
  if (a->kind != b->kind || a->num_tensors != b->num_tensors ||
      a->offset != b->offset || a->max_size != b->max_size ||
      a->keep != b->keep || a->step != b->step || a->idx != b->idx)
    return 0;
  if (a->kind == KVT_LAYER_QUANTIZED_KV &&
      (a->bits != b->bits || a->group_size != b->group_size))
    return 0;
  for (uint32_t j = 0; j < a->num_tensors; j++) {
    if (!t_tensor_eq(&a->tensors[j], &b->tensors[j]))
      return 0;
    int32_t ha = a->orig_dtypes ? a->orig_dtypes[j] : 0;
    int32_t hb = b->orig_dtypes ? b->orig_dtypes[j] : 0;
    if (ha != hb)
      return 0;
  }
  return 1;
}

float t_dequant_elem(const kvt_layer *l, int kv, int64_t row, int64_t i) {
  const kvt_tensor *q = &l->tensors[3 * kv], *s = &l->tensors[3 * kv + 1],
                   *b = &l->tensors[3 * kv + 2];
  int64_t W = q->shape[q->ndim - 1];
  int64_t D = W * 32 / l->bits, G = D / l->group_size;
  const uint8_t *bytes = (const uint8_t *)q->data + row * W * 4;
  uint32_t v = 0;
  for (int k = 0; k < l->bits; k++) {
    int64_t bit = i * l->bits + k;
    v |= (uint32_t)((bytes[bit / 8] >> (bit % 8)) & 1) << k;
  }
  kvt_dtype sd = (kvt_dtype)s->dtype;
  float sc = t_load(s->data, sd, (size_t)(row * G + i / l->group_size));
  float bi = t_load(b->data, sd, (size_t)(row * G + i / l->group_size));
  float f = sc * (float)v;
  f = f + bi;
  if (sd == KVT_DTYPE_BF16)
    f = t_bf16_to_f32(t_f32_to_bf16(f));
  else if (sd == KVT_DTYPE_F16)
    f = t_f16_to_f32(t_f32_to_f16(f));
  return f;
}

int t_write_all(const char *path, const void *d, size_t n) {
  FILE *f = fopen(path, "wb");
  if (!f)
    return -1;
  int ok = fwrite(d, 1, n, f) == n;
  fclose(f);
  return ok ? 0 : -1;
}

char *t_join(const char *a, const char *b) {
  char *p = malloc(strlen(a) + strlen(b) + 2);
  sprintf(p, "%s/%s", a, b);
  return p;
}

/* Both KV builders below: rows p < n hold a pattern of (token, position,
 * head, layer, key/value), rows past n the pad value. */
static kvt_layer kv_rows(const int32_t *tok, int n, int T, int D, int layer,
                         uint16_t pad) {
  kvt_layer l;
  kvt_layer_init(&l, KVT_LAYER_KV);
  l.num_tensors = 2;
  l.tensors = calloc(2, sizeof(kvt_tensor));
  l.offset = n;
  for (int k = 0; k < 2; k++) {
    kvt_tensor *t = &l.tensors[k];
    t->dtype = KVT_DTYPE_F16;
    t->ndim = 4;
    t->shape[0] = 1;
    t->shape[1] = 2;
    t->shape[2] = T;
    t->shape[3] = D;
    t->nbytes = 2ull * (uint64_t)T * (uint64_t)D * 2;
    uint16_t *d = malloc(t->nbytes ? t->nbytes : 1);
    for (int h = 0; h < 2; h++)
      for (int p = 0; p < T; p++)
        for (int i = 0; i < D; i++)
          d[(h * T + p) * D + i] =
              p < n ? (uint16_t)((tok[p] * 31 + p * 7 + i + h * 3 + layer * 5 +
                                  k * 11) &
                                 0x3fff)
                    : pad;
    t->data = d;
  }
  return l;
}

kvt_layer t_kv_tokens(const int32_t *tok, int n, int T, int D, int layer) {
  return kv_rows(tok, n, T, D, layer, 0x7777);
}

kvt_layer t_kv_pattern(const int32_t *tok, int n, int T, int layer,
                       uint16_t pad) {
  return kv_rows(tok, n, T, 8, layer, pad);
}
