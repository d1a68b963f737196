/*
 * layer.c - one layer <-> one safetensors file plus its manifest object.
 * Writing applies the storage mode: native keeps every tensor as given
 * (quantized layers as packed/scales/biases under kvtier's "QuantizedKVCache"
 * type), compat reproduces the reference's enqueue_spill and serializers byte
 * for byte (bf16 -> F32 with "*_original_dtype": "bfloat16"; quantized -> MLX
 * dequantization, trim to offset along axis -2, bf16 -> F16 with hints, written
 * as "KVCache"). Reading accepts every layer_type the reference accepts plus
 * QuantizedKVCache, checks the file's tensors against the manifest, and preads
 * each tensor straight into its final buffer while hashing the file in offset
 * order (whole-file hash, or per-block hashes each checked as its block
 * completes); a trimmed read of a file with per-block hashes reads and verifies
 * only the blocks covering the header and the kept rows.
 */
#include "format/layer.h"
#include "base/bufpool.h"
#include "engine/fwriter.h"
#include "engine/iobatch.h"
#include "format/dtype.h"
#include "format/entry.h"
#include "base/error.h"
#include "base/io.h"

#include <cjson/cJSON.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

/* ---- validation --------------------------------------------------------- */

static int quant_bits_ok(int b) {
  return b == 2 || b == 3 || b == 4 || b == 5 || b == 6 || b == 8;
}

static int check_tensor(const kvt_tensor *t, uint32_t idx, uint32_t j,
                        int need_data) {
  uint64_t nb;
  if (kvt_dtype_size((kvt_dtype)t->dtype) == 0)
    return KVT_ERR(KVT_EINVAL, "layer %u tensor %u: invalid dtype %d", idx, j,
                   (int)t->dtype);
  if (t->ndim > KVT_MAX_DIMS)
    return KVT_ERR(KVT_EINVAL, "layer %u tensor %u: ndim %u > %d", idx, j,
                   t->ndim, KVT_MAX_DIMS);
  for (uint32_t d = 0; d < t->ndim; d++)
    if (t->shape[d] < 0)
      return KVT_ERR(KVT_EINVAL, "layer %u tensor %u: negative dimension", idx,
                     j);
  if (kvti_tensor_nbytes(&nb, (kvt_dtype)t->dtype, t->ndim, t->shape) != 0)
    return KVT_ERR(KVT_EINVAL, "layer %u tensor %u: size overflows", idx, j);
  if (nb != t->nbytes)
    return KVT_ERR(KVT_EINVAL,
                   "layer %u tensor %u: nbytes %llu != shape x dtype size %llu",
                   idx, j, (unsigned long long)t->nbytes,
                   (unsigned long long)nb);
  if (need_data && nb && !t->data)
    return KVT_ERR(KVT_EINVAL, "layer %u tensor %u: NULL data", idx, j);
  return 0;
}

/* Geometry of one quantized triple (packed U32 [..., D*bits/32], scales/biases
 * [..., D/gs]). */
static int check_quant(const kvt_tensor *q, const kvt_tensor *s,
                       const kvt_tensor *b, int bits, int gs, uint32_t idx,
                       const char *which) {
  if (q->dtype != KVT_DTYPE_U32)
    return KVT_ERR(KVT_EINVAL, "layer %u: %s packed tensor must be U32", idx,
                   which);
  if (!kvti_dtype_is_float((kvt_dtype)s->dtype) || s->dtype == KVT_DTYPE_F64 ||
      s->dtype != b->dtype)
    return KVT_ERR(KVT_EINVAL,
                   "layer %u: %s scales/biases must share a dtype among F16, "
                   "BF16, F32",
                   idx, which);
  if (q->ndim < 1 || q->ndim != s->ndim || s->ndim != b->ndim)
    return KVT_ERR(KVT_EINVAL, "layer %u: %s tensors need the same ndim >= 1",
                   idx, which);
  for (uint32_t d = 0; d < q->ndim; d++) {
    if (s->shape[d] != b->shape[d])
      return KVT_ERR(KVT_EINVAL, "layer %u: %s scales/biases shapes differ",
                     idx, which);
    if (d + 1 < q->ndim && q->shape[d] != s->shape[d])
      return KVT_ERR(KVT_EINVAL, "layer %u: %s leading dimensions differ", idx,
                     which);
  }
  int64_t w = q->shape[q->ndim - 1];
  if (w > (INT64_C(1) << 40))
    return KVT_ERR(KVT_EINVAL, "layer %u: %s last dimension too large", idx,
                   which);
  if ((w * 32) % bits != 0)
    return KVT_ERR(KVT_EINVAL,
                   "layer %u: %s packed width %lld not a whole "
                   "number of %d-bit elements",
                   idx, which, (long long)w, bits);
  int64_t D = w * 32 / bits;
  if (D % gs != 0 || s->shape[s->ndim - 1] != D / gs)
    return KVT_ERR(KVT_EINVAL,
                   "layer %u: %s scales last dim %lld != %lld elements / "
                   "group_size %d",
                   idx, which, (long long)s->shape[s->ndim - 1], (long long)D,
                   gs);
  return 0;
}

int kvti_layer_validate(const kvt_layer *l, uint32_t idx, int need_data) {
  if (!l)
    return KVT_ERR(KVT_EINVAL, "layer %u is NULL", idx);
  uint32_t want;
  switch (l->kind) {
  case KVT_LAYER_KV:
  case KVT_LAYER_ROTATING_KV:
    want = 2;
    break;
  case KVT_LAYER_QUANTIZED_KV:
    want = 6;
    break;
  case KVT_LAYER_ARRAYS:
    want = l->num_tensors;
    break;
  default:
    return KVT_ERR(KVT_EINVAL, "layer %u: unknown kind %d", idx, l->kind);
  }
  if (l->num_tensors != want)
    return KVT_ERR(KVT_EINVAL, "layer %u: %u tensors, kind needs %u", idx,
                   l->num_tensors, want);
  if (l->num_tensors > KVTI_MAX_ARRAYS)
    return KVT_ERR(KVT_EINVAL, "layer %u: too many tensors", idx);
  if (l->num_tensors && !l->tensors)
    return KVT_ERR(KVT_EINVAL, "layer %u: NULL tensors", idx);
  for (uint32_t j = 0; j < l->num_tensors; j++) {
    int rc = check_tensor(&l->tensors[j], idx, j, need_data);
    if (rc)
      return rc;
    if (l->orig_dtypes && l->orig_dtypes[j] != KVT_DTYPE_INVALID &&
        !kvt_dtype_name((kvt_dtype)l->orig_dtypes[j]))
      return KVT_ERR(KVT_EINVAL, "layer %u: invalid orig_dtypes[%u]", idx, j);
  }
  if (l->kind != KVT_LAYER_ARRAYS && l->kind != KVT_LAYER_QUANTIZED_KV &&
      l->offset < 0)
    return KVT_ERR(KVT_EINVAL, "layer %u: offset must be >= 0", idx);
  if (l->kind == KVT_LAYER_QUANTIZED_KV && l->offset < 0 &&
      l->offset != KVT_ABSENT)
    return KVT_ERR(KVT_EINVAL, "layer %u: offset must be >= 0", idx);
  if (l->kind == KVT_LAYER_ROTATING_KV && l->max_size == KVT_ABSENT)
    return KVT_ERR(KVT_EINVAL, "layer %u: rotating layer needs max_size", idx);
  if (l->kind == KVT_LAYER_QUANTIZED_KV) {
    if (!quant_bits_ok(l->bits))
      return KVT_ERR(KVT_EINVAL, "layer %u: bits %d not in {2,3,4,5,6,8}", idx,
                     l->bits);
    if (l->group_size <= 0 || l->group_size > (1 << 20))
      return KVT_ERR(KVT_EINVAL, "layer %u: invalid group_size %d", idx,
                     l->group_size);
    int rc = check_quant(&l->tensors[0], &l->tensors[1], &l->tensors[2],
                         l->bits, l->group_size, idx, "keys");
    if (!rc)
      rc = check_quant(&l->tensors[3], &l->tensors[4], &l->tensors[5], l->bits,
                       l->group_size, idx, "values");
    if (rc)
      return rc;
  }
  return 0;
}

/* ---- dequantization ----------------------------------------------------- */

int kvti_dequantize(void *out, kvt_dtype out_dtype, const kvt_tensor *packed,
                    const kvt_tensor *scales, const kvt_tensor *biases,
                    int bits, int group_size, int64_t keep_rows) {
  /* MLX packs each row as a little-endian bit stream: element i occupies bits
   * [i*bits, (i+1)*bits) of the row's uint32 words (word k holds stream bits
   * 32k..32k+31). For bits 2/4/8 no element crosses a word; for 3 and 6 some do
   * (MLX's 3-byte packs are the same stream). 5-bit packing is refused: we
   * cannot verify MLX's layout for it. */
  if (!(bits == 2 || bits == 3 || bits == 4 || bits == 6 || bits == 8))
    return KVT_ERR(KVT_EUNSUPPORTED,
                   "compat mode cannot dequantize %d-bit layers", bits);
  kvt_dtype sd = (kvt_dtype)scales->dtype;
  uint32_t nd = packed->ndim;
  int64_t W = packed->shape[nd - 1];
  int64_t D = W * 32 / bits;
  int64_t G = D / group_size;
  int64_t T = nd >= 2 ? packed->shape[nd - 2] : 1;
  int64_t outer = 1;
  for (uint32_t d = 0; d + 2 < nd; d++)
    outer *= packed->shape[d];
  if (nd < 2)
    outer = 1;
  if (keep_rows > T || keep_rows < 0)
    keep_rows = T;
  const uint32_t *wq = packed->data;
  uint32_t mask = (1u << bits) - 1u;
  size_t o = 0;
  for (int64_t a = 0; a < outer; a++) {
    for (int64_t t = 0; t < keep_rows; t++) {
      int64_t row = a * T + t;
      const uint32_t *w = wq + row * W;
      for (int64_t i = 0; i < D; i++) {
        uint64_t bit = (uint64_t)i * (uint64_t)bits;
        uint64_t k = bit >> 5;
        unsigned s = (unsigned)(bit & 31u);
        uint64_t v = w[k] >> s;
        if (s + (unsigned)bits > 32)
          v |= (uint64_t)w[k + 1] << (32 - s);
        uint32_t q = (uint32_t)v & mask;
        size_t g = (size_t)(row * G + i / group_size);
        float sc = kvti_load_float(scales->data, sd, g);
        float bi = kvti_load_float(biases->data, sd, g);
        float f = sc * (float)q;
        f = f + bi;
        /* round to the dequantized dtype (the scales dtype), then to the output
         * dtype */
        if (sd == KVT_DTYPE_BF16)
          f = kvti_bf16_to_f32(kvti_f32_to_bf16(f));
        else if (sd == KVT_DTYPE_F16)
          f = kvti_f16_to_f32(kvti_f32_to_f16(f));
        kvti_store_float(out, out_dtype, o++, f);
      }
    }
  }
  return 0;
}

/* ---- planning ----------------------------------------------------------- */

void kvti_layer_out_free(kvti_layer_out *p) {
  if (!p)
    return;
  if (p->owned)
    for (uint32_t i = 0; i < p->n; i++)
      kvti_buf_free(p->owned[i]);
  kvti_free(p->owned);
  kvti_free(p->names);
  kvti_free(p->tensors);
  kvti_free(p->meta_json);
  memset(p, 0, sizeof *p);
}

static int out_alloc(kvti_layer_out *p, uint32_t n) {
  p->n = n;
  p->names = kvti_calloc(n ? n : 1, sizeof *p->names);
  p->tensors = kvti_calloc(n ? n : 1, sizeof *p->tensors);
  p->owned = kvti_calloc(n ? n : 1, sizeof *p->owned);
  if (!p->names || !p->tensors || !p->owned)
    return KVT_ERR_NOMEM();
  return 0;
}

/* Converted copy of src as dtype `to` (float types only). */
static int convert(kvti_layer_out *p, uint32_t j, const kvt_tensor *src,
                   kvt_dtype to, int materialize) {
  kvt_tensor *t = &p->tensors[j];
  *t = *src;
  t->dtype = to;
  t->nbytes =
      src->nbytes / kvt_dtype_size((kvt_dtype)src->dtype) * kvt_dtype_size(to);
  t->data = NULL;
  if (!materialize)
    return 0;
  if (!kvti_dtype_is_float((kvt_dtype)src->dtype))
    return KVT_ERR(KVT_EUNSUPPORTED, "cannot cast a %s tensor to %s",
                   kvt_dtype_name((kvt_dtype)src->dtype), kvt_dtype_name(to));
  void *buf = kvti_buf_alloc(t->nbytes);
  if (!buf)
    return KVT_ERR_NOMEM();
  size_t n = src->nbytes / kvt_dtype_size((kvt_dtype)src->dtype);
  kvt_dtype sd = (kvt_dtype)src->dtype;
  if (sd == KVT_DTYPE_BF16 && to == KVT_DTYPE_F32) {
    const uint16_t *s = src->data;
    float *d = buf;
    for (size_t i = 0; i < n; i++) {
      uint16_t h;
      memcpy(&h, s + i, 2);
      d[i] = kvti_bf16_to_f32(h);
    }
  } else if (sd == KVT_DTYPE_F64) {
    for (size_t i = 0; i < n; i++) {
      double v;
      memcpy(&v, (const char *)src->data + 8 * i, 8);
      kvti_store_float(buf, to, i, (float)v); /* double rounding accepted */
    }
  } else {
    for (size_t i = 0; i < n; i++)
      kvti_store_float(buf, to, i, kvti_load_float(src->data, sd, i));
  }
  p->owned[j] = buf;
  t->data = buf;
  return 0;
}

static void put_hint(kvti_sb *b, const char *key, int32_t dt) {
  const char *nm = kvti_dtype_np_name((kvt_dtype)dt);
  if (!nm)
    return;
  kvti_sb_printf(b, ", \"%s\": ", key);
  kvti_sb_json_str(b, nm);
}

static void put_int(kvti_sb *b, const char *key, int64_t v) {
  if (v != KVT_ABSENT)
    kvti_sb_printf(b, ", \"%s\": %lld", key, (long long)v);
}

int kvti_layer_plan(kvti_layer_out *p, const kvt_layer *l, uint32_t idx,
                    int mode, int entry_has_quant, int materialize) {
  memset(p, 0, sizeof *p);
  kvti_sb b = {0};
  int rc = 0;
  int32_t hint[6] = {0};
  int compat = mode == KVT_STORAGE_COMPAT;
  p->data_align = compat ? 0 : KVTI_DATA_ALIGN;
  const char *type;
  if (l->kind == KVT_LAYER_ARRAYS) {
    rc = out_alloc(p, l->num_tensors);
    if (rc)
      goto out;
    int any_hint = 0;
    int32_t *h = kvti_calloc(l->num_tensors ? l->num_tensors : 1, 4);
    if (!h) {
      rc = KVT_ERR_NOMEM();
      goto out;
    }
    for (uint32_t j = 0; j < l->num_tensors && rc == 0; j++) {
      snprintf(p->names[j], KVTI_NAME_MAX, "layer_%u_state_%u", idx, j);
      const kvt_tensor *t = &l->tensors[j];
      h[j] = l->orig_dtypes ? l->orig_dtypes[j] : 0;
      if (compat && t->dtype == KVT_DTYPE_BF16) {
        rc = convert(p, j, t, KVT_DTYPE_F32, materialize);
        h[j] = KVT_DTYPE_BF16;
      } else {
        p->tensors[j] = *t;
      }
      if (h[j])
        any_hint = 1;
    }
    if (rc) {
      kvti_free(h);
      goto out;
    }
    kvti_sb_printf(&b,
                   "{\"layer_type\": \"ArraysCache\", \"layer_idx\": %u, "
                   "\"num_arrays\": %u",
                   idx, l->num_tensors);
    if (any_hint) {
      kvti_sb_puts(&b, ", \"state_original_dtypes\": [");
      for (uint32_t j = 0; j < l->num_tensors; j++) {
        if (j)
          kvti_sb_puts(&b, ", ");
        const char *nm = kvti_dtype_np_name((kvt_dtype)h[j]);
        if (nm)
          kvti_sb_json_str(&b, nm);
        else
          kvti_sb_puts(&b, "null");
      }
      kvti_sb_puts(&b, "]");
    }
    kvti_free(h);
    put_int(&b, "offset", l->offset);
    kvti_sb_puts(&b, "}");
    goto done;
  }

  if (l->kind == KVT_LAYER_QUANTIZED_KV && !compat) {
    static const char *suf[6] = {"keys",   "keys_scales",   "keys_biases",
                                 "values", "values_scales", "values_biases"};
    rc = out_alloc(p, 6);
    if (rc)
      goto out;
    for (uint32_t j = 0; j < 6; j++) {
      snprintf(p->names[j], KVTI_NAME_MAX, "layer_%u_%s", idx, suf[j]);
      p->tensors[j] = l->tensors[j];
    }
    kvti_sb_printf(
        &b, "{\"layer_type\": \"QuantizedKVCache\", \"layer_idx\": %u", idx);
    put_int(&b, "offset", l->offset);
    kvti_sb_printf(&b, ", \"bits\": %d, \"group_size\": %d}", (int)l->bits,
                   (int)l->group_size);
    goto done;
  }

  /* KV, rotating KV, and compat-dequantized quantized KV: two tensors. */
  rc = out_alloc(p, 2);
  if (rc)
    goto out;
  snprintf(p->names[0], KVTI_NAME_MAX, "layer_%u_keys", idx);
  snprintf(p->names[1], KVTI_NAME_MAX, "layer_%u_values", idx);
  type = "KVCache";
  int64_t offset = l->offset;
  if (l->kind == KVT_LAYER_QUANTIZED_KV) {
    /* enqueue_spill: dequantize (dtype = scales dtype), trim to offset along
     * axis -2 when ndim >= 3, then bf16 -> F16 with "bfloat16" hints (decided
     * by the keys' dtype). */
    for (int kv = 0; kv < 2 && rc == 0; kv++) {
      const kvt_tensor *q = &l->tensors[3 * kv], *s = &l->tensors[3 * kv + 1],
                       *bi = &l->tensors[3 * kv + 2];
      kvt_tensor *t = &p->tensors[kv];
      t->ndim = q->ndim;
      memcpy(t->shape, q->shape, sizeof t->shape);
      t->shape[q->ndim - 1] = q->shape[q->ndim - 1] * 32 / l->bits;
      if (offset == KVT_ABSENT && kv == 0)
        offset = q->ndim >= 2 ? q->shape[q->ndim - 2] : 0;
      int64_t keep = q->ndim >= 2 ? q->shape[q->ndim - 2] : 1;
      if (q->ndim >= 3 && offset < keep) {
        keep = offset;
        t->shape[q->ndim - 2] = offset;
      }
      /* keys bf16: both cast to F16 (hints "bfloat16"). Otherwise a bf16 result
       * (values only) reaches the snapshot as bf16 and is upcast to F32 with a
       * hint there. */
      kvt_dtype kd =
          (kvt_dtype)l->tensors[1].dtype; /* keys' dequantized dtype */
      kvt_dtype od = kd == KVT_DTYPE_BF16         ? KVT_DTYPE_F16
                     : s->dtype == KVT_DTYPE_BF16 ? KVT_DTYPE_F32
                                                  : (kvt_dtype)s->dtype;
      if (kd == KVT_DTYPE_BF16 || s->dtype == KVT_DTYPE_BF16)
        hint[kv] = KVT_DTYPE_BF16;
      t->dtype = od;
      uint64_t nb;
      if (kvti_tensor_nbytes(&nb, od, t->ndim, t->shape) != 0) {
        rc = KVT_ERR(KVT_EINVAL, "layer %u: dequantized size overflows", idx);
        break;
      }
      t->nbytes = nb;
      t->data = NULL;
      if (!materialize)
        continue;
      if (!(l->bits == 2 || l->bits == 3 || l->bits == 4 || l->bits == 6 ||
            l->bits == 8)) {
        rc = KVT_ERR(KVT_EUNSUPPORTED,
                     "layer %u: compat mode cannot dequantize %d-bit layers",
                     idx, l->bits);
        break;
      }
      void *buf = kvti_buf_alloc(nb);
      if (!buf) {
        rc = KVT_ERR_NOMEM();
        break;
      }
      p->owned[kv] = buf;
      t->data = buf;
      rc = kvti_dequantize(buf, od, q, s, bi, l->bits, l->group_size, keep);
    }
    if (rc == 0 && !materialize && compat &&
        !(l->bits == 2 || l->bits == 3 || l->bits == 4 || l->bits == 6 ||
          l->bits == 8))
      rc = KVT_ERR(KVT_EUNSUPPORTED,
                   "layer %u: compat mode cannot dequantize %d-bit layers", idx,
                   l->bits);
    if (rc)
      goto out;
  } else {
    const kvt_tensor *k = &l->tensors[0], *v = &l->tensors[1];
    hint[0] = l->orig_dtypes ? l->orig_dtypes[0] : 0;
    hint[1] = l->orig_dtypes ? l->orig_dtypes[1] : 0;
    if (compat && entry_has_quant && k->dtype == KVT_DTYPE_BF16) {
      /* the reference casts every bf16 KV layer of an entry holding a quantized
       * layer */
      rc = convert(p, 0, k, KVT_DTYPE_F16, materialize);
      if (!rc)
        rc = convert(p, 1, v, KVT_DTYPE_F16, materialize);
      hint[0] = hint[1] = KVT_DTYPE_BF16;
    } else {
      for (int j = 0; j < 2 && rc == 0; j++) {
        const kvt_tensor *t = &l->tensors[j];
        if (compat && t->dtype == KVT_DTYPE_BF16) {
          rc = convert(p, (uint32_t)j, t, KVT_DTYPE_F32, materialize);
          hint[j] = KVT_DTYPE_BF16;
        } else {
          p->tensors[j] = *t;
        }
      }
    }
    if (rc)
      goto out;
  }
  kvti_sb_printf(&b, "{\"layer_type\": \"%s\", \"layer_idx\": %u", type, idx);
  put_int(&b, "offset", offset);
  put_hint(&b, "keys_original_dtype", hint[0]);
  put_hint(&b, "values_original_dtype", hint[1]);
  if (l->kind != KVT_LAYER_QUANTIZED_KV) {
    put_int(&b, "max_size", l->max_size);
    put_int(&b, "keep", l->keep);
    put_int(&b, "step", l->step);
    put_int(&b, "_idx", l->idx);
  }
  kvti_sb_puts(&b, "}");
done:
  p->meta_json = kvti_sb_take(&b);
  if (!p->meta_json)
    rc = KVT_ENOMEM;
out:
  kvti_sb_free(&b);
  if (rc)
    kvti_layer_out_free(p);
  return rc;
}

static kvti_st_item *items_of(const kvti_layer_out *p) {
  kvti_st_item *it = kvti_calloc(p->n ? p->n : 1, sizeof *it);
  if (!it) {
    KVT_ERR_NOMEM();
    return NULL;
  }
  for (uint32_t j = 0; j < p->n; j++) {
    it[j].name = p->names[j];
    it[j].t = &p->tensors[j];
  }
  return it;
}

/* The header alignment a planned file gets: KVTI_DATA_ALIGN only for native
 * files holding at least KVTI_DATA_ALIGN_MIN bytes of tensors (what the reader
 * may read with O_DIRECT); small files keep the 8-byte padding so the
 * alignment never costs more than 0.4% of a file. */
static uint64_t layer_data_bytes(const kvti_layer_out *p) {
  uint64_t data = 0;
  for (uint32_t j = 0; j < p->n; j++)
    data += p->tensors[j].nbytes;
  return data;
}
static uint64_t layer_align(const kvti_layer_out *p) {
  return p->data_align && layer_data_bytes(p) >= KVTI_DATA_ALIGN_MIN
             ? p->data_align
             : 0;
}

uint64_t kvti_layer_out_file_size(const kvti_layer_out *p) {
  kvti_st_item *it = items_of(p);
  if (!it)
    return 0;
  /* descriptors may have NULL data when not materialized: size only */
  kvt_tensor *tmp = kvti_calloc(p->n ? p->n : 1, sizeof *tmp);
  uint64_t sz = 0;
  if (tmp) {
    static char dummy;
    for (uint32_t j = 0; j < p->n; j++) {
      tmp[j] = p->tensors[j];
      tmp[j].data = &dummy;
      it[j].t = &tmp[j];
    }
    sz = kvti_st_file_size(it, p->n, NULL, 0);
    uint64_t a = layer_align(p);
    if (sz && a) {
      /* the data part is sz minus the 8-aligned header: re-align the header */
      uint64_t data = layer_data_bytes(p);
      sz = ((sz - data + a - 1) & ~(a - 1)) + data;
    }
    kvti_free(tmp);
  } else {
    KVT_ERR_NOMEM();
  }
  kvti_free(it);
  return sz;
}

int kvti_layer_write_file(uint64_t *size, uint64_t *xxh3, const char *path,
                          const kvti_layer_out *p, uint32_t file_mode,
                          int do_fsync, int truncate, int io_backend,
                          kvti_wgroup *group, kvti_blkhash *blocks) {
  /* Through the staged writer (fwriter.h): the header and the tensors are
   * copied into aligned pooled buffers, hashed while hot, and written with
   * O_DIRECT, several writes in flight. In a group the writes complete (and are
   * fsynced) at kvti_wgroup_finish. */
  kvti_st_item *it = items_of(p);
  size_t *order = kvti_calloc(p->n ? p->n : 1, sizeof *order);
  char *hdr = NULL;
  size_t hl = 0;
  kvti_fwriter *w = NULL;
  int rc = 0;
  if (!it || !order) {
    rc = KVT_ERR_NOMEM();
    goto out;
  }
  rc = kvti_st_build_header(&hdr, &hl, order, it, p->n, NULL, 0);
  uint64_t align = layer_align(p);
  if (rc == 0 && align)
    rc = kvti_st_pad_header(&hdr, &hl, (size_t)align);
  if (rc)
    goto out;
  uint64_t total = hl + layer_data_bytes(p);
  kvti_fwriter_opts fo = KVTI_FWRITER_OPTS_INIT;
  fo.backend = io_backend;
  fo.hash = xxh3 != NULL;
  fo.blocks = blocks;
  fo.size_hint = total;
  fo.file_mode = file_mode;
  fo.excl = !truncate;
  rc = group ? kvti_wgroup_file(&w, group, path, &fo)
             : kvti_fwriter_open(&w, path, &fo);
  if (rc) {
    w = NULL;
    goto out;
  }
  rc = kvti_fwriter_append(w, hdr, hl);
  for (uint32_t j = 0; rc == 0 && j < p->n; j++) {
    const kvt_tensor *t = it[order[j]].t;
    if (t->nbytes)
      rc = kvti_fwriter_append(w, t->data, (size_t)t->nbytes);
  }
  if (group) {
    if (rc == 0)
      rc = kvti_fwriter_close(w, size, xxh3);
  } else if (rc) {
    kvti_fwriter_abort(w);
  } else {
    rc = kvti_fwriter_finish(w, size, xxh3, do_fsync);
  }
  if (rc == 0 && blocks) /* every byte was fed: close the last block */
    rc = kvti_blkhash_final(blocks, xxh3);
out:
  kvti_free(hdr);
  kvti_free(order);
  kvti_free(it);
  return rc;
}

/* ---- manifest parsing --------------------------------------------------- */

#define BAD(...) KVT_ERR(KVT_ECORRUPT, __VA_ARGS__)

/* JSON integer in [-2^53, 2^53]. */
static int json_i64(int64_t *out, const cJSON *j) {
  if (!cJSON_IsNumber(j))
    return -1;
  double d = j->valuedouble;
  if (!isfinite(d) || fabs(d) > 9007199254740992.0 || floor(d) != d)
    return -1;
  *out = (int64_t)d;
  return 0;
}

static int opt_int(int64_t *out, const cJSON *o, const char *key,
                   const char *what) {
  const cJSON *j = cJSON_GetObjectItemCaseSensitive(o, key);
  *out = KVT_ABSENT;
  if (!j || cJSON_IsNull(j))
    return 0;
  if (json_i64(out, j) != 0)
    return BAD("%s: '%s' is not an integer", what, key);
  return 0;
}

static int req_int(int64_t *out, const cJSON *o, const char *key, int64_t lo,
                   int64_t hi, const char *what) {
  const cJSON *j = cJSON_GetObjectItemCaseSensitive(o, key);
  if (!j)
    return BAD("%s: missing '%s'", what, key);
  if (json_i64(out, j) != 0 || *out < lo || *out > hi)
    return BAD("%s: '%s' is not an integer in [%lld, %lld]", what, key,
               (long long)lo, (long long)hi);
  return 0;
}

/* A hint: absent/null -> none; a string -> its dtype (unknown names: none). */
static int hint_of(int32_t *out, const cJSON *j, const char *key,
                   const char *what) {
  *out = KVT_DTYPE_INVALID;
  if (!j || cJSON_IsNull(j))
    return 0;
  if (!cJSON_IsString(j))
    return BAD("%s: '%s' is not a string", what, key);
  *out = kvti_dtype_from_np_name(j->valuestring);
  return 0;
}

void kvti_layer_meta_free(kvti_layer_meta *m) {
  if (!m)
    return;
  kvti_free(m->orig_dtypes);
  m->orig_dtypes = NULL;
}

int kvti_layer_meta_parse(kvti_layer_meta *m, const void *cjson_obj,
                          int64_t expect_idx, const char *what) {
  const cJSON *o = cjson_obj;
  memset(m, 0, sizeof *m);
  m->offset = m->max_size = m->keep = m->step = m->idx = KVT_ABSENT;
  if (!cJSON_IsObject(o))
    return BAD("%s: layer metadata is not an object", what);
  const cJSON *ty = cJSON_GetObjectItemCaseSensitive(o, "layer_type");
  if (!cJSON_IsString(ty))
    return BAD("%s: layer_type missing or not a string", what);
  const char *t = ty->valuestring;
  int64_t v;
  int rc = req_int(&v, o, "layer_idx", 0, KVTI_MAX_LAYERS, what);
  if (rc)
    return rc;
  if (expect_idx >= 0 && v != expect_idx)
    return BAD("%s: layer_idx %lld where %lld expected", what, (long long)v,
               (long long)expect_idx);
  m->layer_idx = (uint32_t)v;
  int32_t h[2] = {0, 0};
  if (!strcmp(t, "KVCache") || !strcmp(t, "RotatingKVCache")) {
    rc = req_int(&m->offset, o, "offset", 0, INT64_C(1) << 53, what);
    if (!rc)
      rc = opt_int(&m->max_size, o, "max_size", what);
    if (!rc)
      rc = opt_int(&m->keep, o, "keep", what);
    if (!rc)
      rc = opt_int(&m->step, o, "step", what);
    if (!rc)
      rc = opt_int(&m->idx, o, "_idx", what);
    if (!rc)
      rc = hint_of(&h[0],
                   cJSON_GetObjectItemCaseSensitive(o, "keys_original_dtype"),
                   "keys_original_dtype", what);
    if (!rc)
      rc = hint_of(&h[1],
                   cJSON_GetObjectItemCaseSensitive(o, "values_original_dtype"),
                   "values_original_dtype", what);
    if (rc)
      return rc;
    m->kind = (!strcmp(t, "RotatingKVCache") || m->max_size != KVT_ABSENT)
                  ? KVT_LAYER_ROTATING_KV
                  : KVT_LAYER_KV;
    m->num_tensors = 2;
    if (h[0] || h[1]) {
      m->orig_dtypes = kvti_calloc(2, sizeof(int32_t));
      if (!m->orig_dtypes)
        return KVT_ERR_NOMEM();
      m->orig_dtypes[0] = h[0];
      m->orig_dtypes[1] = h[1];
    }
    return 0;
  }
  if (!strcmp(t, "ArraysCache") || !strcmp(t, "MambaCache")) {
    rc = req_int(&v, o, "num_arrays", 0, KVTI_MAX_ARRAYS, what);
    if (!rc)
      rc = opt_int(&m->offset, o, "offset", what);
    if (rc)
      return rc;
    m->kind = KVT_LAYER_ARRAYS;
    m->num_tensors = (uint32_t)v;
    const cJSON *sd =
        cJSON_GetObjectItemCaseSensitive(o, "state_original_dtypes");
    if (sd && !cJSON_IsNull(sd)) {
      if (!cJSON_IsArray(sd) || cJSON_GetArraySize(sd) != (int)v)
        return BAD("%s: state_original_dtypes is not a list of num_arrays "
                   "entries",
                   what);
      m->orig_dtypes = kvti_calloc(v ? (size_t)v : 1, sizeof(int32_t));
      if (!m->orig_dtypes)
        return KVT_ERR_NOMEM();
      uint32_t j = 0;
      int any = 0;
      for (const cJSON *e = sd->child; e; e = e->next, j++) {
        rc = hint_of(&m->orig_dtypes[j], e, "state_original_dtypes", what);
        if (rc) {
          kvti_layer_meta_free(m);
          return rc;
        }
        any |= m->orig_dtypes[j] != 0;
      }
      if (!any) {
        kvti_free(m->orig_dtypes);
        m->orig_dtypes = NULL;
      }
    }
    return 0;
  }
  if (!strcmp(t, "QuantizedKVCache")) {
    int64_t bits, gs;
    rc = opt_int(&m->offset, o, "offset", what);
    if (!rc && m->offset != KVT_ABSENT && m->offset < 0)
      rc = BAD("%s: negative offset", what);
    if (!rc)
      rc = req_int(&bits, o, "bits", 2, 8, what);
    if (!rc)
      rc = req_int(&gs, o, "group_size", 1, 1 << 20, what);
    if (rc)
      return rc;
    if (!quant_bits_ok((int)bits))
      return BAD("%s: unsupported bits %lld", what, (long long)bits);
    m->kind = KVT_LAYER_QUANTIZED_KV;
    m->bits = (int32_t)bits;
    m->group_size = (int32_t)gs;
    m->num_tensors = 6;
    return 0;
  }
  return BAD("%s: unknown layer_type '%.40s'", what, t);
}

void kvti_layer_tensor_name(char out[KVTI_NAME_MAX], const kvti_layer_meta *m,
                            uint32_t j) {
  static const char *suf[6] = {"keys",   "keys_scales",   "keys_biases",
                               "values", "values_scales", "values_biases"};
  if (m->kind == KVT_LAYER_ARRAYS)
    snprintf(out, KVTI_NAME_MAX, "layer_%u_state_%u", m->layer_idx, j);
  else if (m->kind == KVT_LAYER_QUANTIZED_KV)
    snprintf(out, KVTI_NAME_MAX, "layer_%u_%s", m->layer_idx, suf[j % 6]);
  else
    snprintf(out, KVTI_NAME_MAX, "layer_%u_%s", m->layer_idx,
             j ? "values" : "keys");
}

int kvti_layer_check_header(const kvti_st_tensor **slot,
                            const kvti_st_header *hd, const kvti_layer_meta *m,
                            const char *path) {
  if (hd->n != m->num_tensors)
    return BAD("%s: %zu tensors where the manifest describes %u", path, hd->n,
               m->num_tensors);
  char nm[KVTI_NAME_MAX];
  for (uint32_t j = 0; j < m->num_tensors; j++) {
    kvti_layer_tensor_name(nm, m, j);
    slot[j] = kvti_st_find(hd, nm);
    if (!slot[j])
      return BAD("%s: tensor '%s' missing", path, nm);
  }
  if (m->kind == KVT_LAYER_QUANTIZED_KV) {
    kvt_layer l;
    kvt_tensor t[6];
    kvt_layer_init(&l, KVT_LAYER_QUANTIZED_KV);
    for (int j = 0; j < 6; j++) {
      memset(&t[j], 0, sizeof t[j]);
      t[j].dtype = slot[j]->dtype;
      t[j].ndim = slot[j]->ndim;
      memcpy(t[j].shape, slot[j]->shape, sizeof t[j].shape);
      t[j].nbytes = slot[j]->nbytes;
    }
    l.tensors = t;
    l.bits = m->bits;
    l.group_size = m->group_size;
    l.offset = m->offset;
    if (kvti_layer_validate(&l, m->layer_idx, 0) != 0) {
      char why[256];
      snprintf(why, sizeof why, "%s", kvt_last_error());
      return BAD("%s: quantized tensors inconsistent: %s", path, why);
    }
  }
  return 0;
}

/* ---- reading ------------------------------------------------------------ */

void kvti_layer_release(kvt_layer *l, int caller_alloc, kvt_free_fn free_buf,
                        void *ctx) {
  if (!l)
    return;
  if (l->tensors)
    for (uint32_t j = 0; j < l->num_tensors; j++) {
      void *d = l->tensors[j].data;
      if (!d)
        continue;
      if (!caller_alloc)
        kvti_buf_free(d);
      else if (free_buf)
        free_buf(ctx, d);
    }
  kvti_free(l->tensors);
  kvti_free(l->orig_dtypes);
  l->tensors = NULL;
  l->orig_dtypes = NULL;
  l->num_tensors = 0;
}

#define RCHUNK ((size_t)8 << 20)
/* Read granularity: each piece is hashed, still cache-resident, as it lands. */
#define RPIECE ((size_t)256 << 10)
#define RWINDOW 16 /* pieces in flight ahead of the hashing */

/* Copies the part of a streamed piece (tensor bytes [pos, pos+len)) that falls
 * into kept rows: the tensor is `outer` blocks of tb bytes (all token rows of
 * one head), of which the first kb bytes (the kept rows) go to dst, block after
 * block. */
static void copy_kept(char *dst, const char *piece, uint64_t pos, uint64_t len,
                      uint64_t tb, uint64_t kb) {
  if (len == 0 || tb == 0)
    return;
  for (uint64_t o = pos / tb; o <= (pos + len - 1) / tb; o++) {
    uint64_t s = o * tb > pos ? o * tb : pos;
    uint64_t e = o * tb + kb < pos + len ? o * tb + kb : pos + len;
    if (s < e)
      memcpy(dst + o * kb + (s - o * tb), piece + (s - pos), (size_t)(e - s));
  }
}

/* One contiguous run of file bytes and where they go. */
typedef struct rseg {
  char *dst;
  uint64_t off, len;
} rseg;

/* Reads the segments (in file order) through the batched I/O engine as one
 * pipeline - pieces of every segment keep flowing, so the window does not
 * drain at each tensor boundary - keeping RWINDOW pieces of RPIECE bytes in
 * flight and hashing each piece (in order) as soon as it has landed, while the
 * next ones are still being read and while it is still warm in cache. */
static int read_segs_hashed(kvti_iobatch *b, int fd, int dfd, const rseg *sg,
                            size_t ns, kvti_blkhash *h,
                            const atomic_int *cancel, const char *path) {
  kvti_iob_req win[RWINDOW];
  /* Direct reads: 1 MiB pieces, what the disk likes (no readahead merges them);
   * page-cache reads: RPIECE, so a piece is hashed while still in L2. */
  const uint64_t piece = dfd >= 0 ? (uint64_t)1 << 20 : RPIECE;
  size_t si = 0;
  uint64_t sp = 0, pushed = 0, done = 0;
  int rc = 0;
  for (;;) {
    while (rc == 0 && pushed < done + RWINDOW && si < ns) {
      if (sp == sg[si].len) {
        si++, sp = 0;
        continue;
      }
      uint64_t pl = sg[si].len - sp < piece ? sg[si].len - sp : piece;
      kvti_iob_req *r = &win[pushed % RWINDOW];
      *r = (kvti_iob_req){
          fd, dfd, 0,   sg[si].dst + sp, pl, sg[si].off + sp, 0, 0, 0, 0,
          0,  0,   NULL};
      rc = kvti_iobatch_push(b, r, 0, path);
      pushed++;
      sp += pl;
    }
    if (rc != 0 || done == pushed)
      break;
    kvti_iob_req *r = &win[done % RWINDOW];
    rc = kvti_iobatch_wait_req(b, r);
    if (rc == 0 && h) /* format 2: fails at the first bad block */
      rc = kvti_blkhash_update(h, r->buf, (size_t)r->len);
    done++;
    if (rc == 0 && cancel && atomic_load(cancel))
      rc = KVT_ERR(KVT_ECANCELED, "read of %s cancelled", path);
  }
  int rc2 =
      kvti_iobatch_wait_all(b); /* nothing may land in dst after we return */
  return rc ? rc : rc2;
}

/* ---- format 2: trimmed reads of verified blocks ------------------------- */

/* A trimmed read of a file with per-block checksums reads only the blocks that
 * cover the header and each head's kept rows, into a scratch window of at most
 * TWIN_BYTES (one block when blocks are larger), verifies every block, and only
 * then copies the kept bytes out: no byte reaches the caller from a block that
 * did not match. A block needed by two neighbouring ranges is read once (both
 * are in the same window); blocks of the header are kept and reused. */
#define TWIN_BYTES ((uint64_t)8 << 20)
#define TPIECES 4096 /* pieces (range x block) copied per window */

typedef struct trim_seg {
  uint64_t s, e; /* file range [s, e) of one head's kept rows */
  char *dst;     /* where they go (NULL: verify only) */
} trim_seg;

/* Walk over the pieces of the ranges: a piece is the part of range si from pos
 * to the range's end or the end of pos's block, whichever comes first. */
typedef struct trim_cur {
  size_t si;
  uint64_t pos;
} trim_cur;

static uint64_t piece_end(const trim_seg *g, uint64_t pos, uint64_t bs) {
  uint64_t be = (pos / bs + 1) * bs;
  return be < g->e ? be : g->e;
}

static void piece_next(trim_cur *c, const trim_seg *g, size_t n, uint64_t bs) {
  uint64_t pe = piece_end(&g[c->si], c->pos, bs);
  c->pos = pe;
  if (pe == g[c->si].e && ++c->si < n)
    c->pos = g[c->si].s;
}

static int check_block(const char *p, uint64_t k, uint64_t file_size,
                       const kvti_layer_read_opts *o, const char *path) {
  uint64_t bs = o->block_size;
  uint64_t len = file_size - k * bs < bs ? file_size - k * bs : bs;
  if (kvti_xxh3(p, (size_t)len) != o->blocks[k])
    return BAD("%s: checksum mismatch in block %llu", path,
               (unsigned long long)k);
  return 0;
}

/* Reads and verifies the blocks covering the safetensors header [0, 8 + N),
 * then parses it from memory: nothing of the header, not even N, is used
 * before the block holding it matched. *hbuf receives the verified blocks
 * (*hlen bytes from offset 0; tensor rows in them are copied from there). */
static int read_header_blocks(kvti_st_header *hd, char **hbuf, uint64_t *hlen,
                              int fd, uint64_t size,
                              const kvti_layer_read_opts *o, const char *path) {
  uint64_t bs = o->block_size, n = 0;
  if (size < 8)
    return BAD("%s: too short for a safetensors file (%llu bytes)", path,
               (unsigned long long)size);
  uint64_t l0 = size < bs ? size : bs;
  char *buf = kvti_malloc((size_t)l0);
  if (!buf)
    return KVT_ERR_NOMEM();
  int rc = kvti_pread_all(fd, buf, (size_t)l0, 0, path);
  if (rc == 0)
    rc = check_block(buf, 0, size, o, path);
  if (rc == 0)
    rc = kvti_st_header_len(&n, (const unsigned char *)buf, size, path);
  uint64_t len = l0;
  if (rc == 0) {
    uint64_t nb = kvti_blk_count(8 + n, bs);
    len = nb * bs < size ? nb * bs : size;
  }
  if (rc == 0 && len > l0) {
    char *b2 = kvti_realloc(buf, (size_t)len);
    if (!b2) {
      rc = KVT_ERR_NOMEM();
    } else {
      buf = b2;
      rc = kvti_pread_all(fd, buf + l0, (size_t)(len - l0), l0, path);
      for (uint64_t k = 1; rc == 0 && k * bs < len; k++)
        rc = check_block(buf + k * bs, k, size, o, path);
    }
  }
  if (rc == 0)
    rc = kvti_st_parse(hd, buf + 8, (size_t)n, size, path);
  if (rc) {
    kvti_free(buf);
    return rc;
  }
  *hbuf = buf;
  *hlen = len;
  return 0;
}

/* Reads the kept rows of every tensor (ranges of tbytes (tb, kb) per tensor,
 * slot order) of a format-2 file through its verified blocks. *nread
 * accumulates the bytes read. */
static int read_trim_blocks(kvt_layer *l, const kvti_st_header *hd,
                            const kvti_st_tensor **slot, const uint64_t *tbytes,
                            const char *hbuf, uint64_t hlen, int fd,
                            uint64_t size, kvti_iobatch **eng,
                            const kvti_layer_read_opts *o, const char *path,
                            uint64_t *nread) {
  uint64_t bs = o->block_size;
  uint64_t hblk = kvti_blk_count(hlen, bs); /* blocks held in hbuf */
  size_t nseg = 0;
  trim_seg *seg = NULL;
  uint64_t *win = NULL;
  kvti_iob_req *rq = NULL;
  char *scratch = NULL;
  size_t scap = 0;
  kvti_bufpool *pool = kvti_bufpool_default();
  int rc = 0;
  for (size_t i = 0; i < hd->n; i++) {
    uint32_t j = 0;
    while (slot[j] != &hd->tensors[i])
      j++;
    uint64_t tb = tbytes[2 * j], kb = tbytes[2 * j + 1];
    if (tb && kb)
      nseg += (size_t)(hd->tensors[i].nbytes / tb);
  }
  if (nseg == 0)
    return 0;
  seg = kvti_malloc(nseg * sizeof *seg);
  if (!seg)
    return KVT_ERR_NOMEM();
  size_t ns = 0;
  for (size_t i = 0; i < hd->n; i++) { /* file order: ascending ranges */
    const kvti_st_tensor *ht = &hd->tensors[i];
    uint32_t j = 0;
    while (slot[j] != ht)
      j++;
    uint64_t tb = tbytes[2 * j], kb = tbytes[2 * j + 1];
    if (!tb || !kb)
      continue;
    char *dst = l->tensors[j].data;
    for (uint64_t b = 0; b < ht->nbytes / tb; b++)
      seg[ns++] = (trim_seg){ht->offset + b * tb, ht->offset + b * tb + kb,
                             dst ? dst + b * kb : NULL};
  }
  /* Distinct blocks to read (outside the header's), to size the window. */
  uint64_t need = 0, last = UINT64_MAX;
  for (trim_cur c = {0, seg[0].s}; c.si < nseg; piece_next(&c, seg, nseg, bs)) {
    uint64_t k = c.pos / bs;
    if (k >= hblk && k != last)
      need++;
    last = k;
  }
  size_t wcap = bs >= TWIN_BYTES ? 1 : (size_t)(TWIN_BYTES / bs);
  if (need < wcap)
    wcap = (size_t)need;
  if (wcap) {
    win = kvti_malloc(wcap * sizeof *win);
    rq = kvti_calloc(wcap, sizeof *rq);
    scratch = pool ? kvti_bufpool_get(pool, (size_t)(wcap * bs), &scap) : NULL;
    if (!win || !rq || !scratch) {
      rc = KVT_ERR_NOMEM();
      goto out;
    }
  }
  trim_cur c = {0, seg[0].s};
  while (c.si < nseg) {
    if (o->cancel && atomic_load(o->cancel)) {
      rc = KVT_ERR(KVT_ECANCELED, "read of %s cancelled", path);
      goto out;
    }
    /* Collect pieces while their blocks fit in the window. */
    trim_cur c0 = c;
    size_t nwin = 0, npc = 0;
    while (c.si < nseg && npc < TPIECES) {
      uint64_t k = c.pos / bs;
      if (k >= hblk && (nwin == 0 || win[nwin - 1] != k)) {
        if (nwin == wcap)
          break;
        win[nwin++] = k;
      }
      piece_next(&c, seg, nseg, bs);
      npc++;
    }
    /* One request per run of consecutive blocks, all in flight together. */
    size_t nr = 0;
    for (size_t w = 0; w < nwin;) {
      size_t w1 = w + 1;
      while (w1 < nwin && win[w1] == win[w1 - 1] + 1)
        w1++;
      uint64_t off = win[w] * bs, end = (win[w1 - 1] + 1) * bs;
      if (end > size)
        end = size;
      rq[nr++] = (kvti_iob_req){
          fd, -1, 0, scratch + w * bs, end - off, off, 0, 0, 0, 0, 0, 0, NULL};
      *nread += end - off;
      w = w1;
    }
    if (nr > 0) {
      if (!*eng && (rc = kvti_iobatch_get(eng, o->io_backend)) != 0) {
        *eng = NULL;
        goto out;
      }
      if ((rc = kvti_iobatch_run(*eng, rq, nr, 0, path)) != 0)
        goto out;
    }
    for (size_t w = 0; w < nwin; w++)
      if ((rc = check_block(scratch + w * bs, win[w], size, o, path)) != 0)
        goto out;
    /* Every block of the window matched: copy the pieces out. */
    size_t w = 0;
    for (size_t p = 0; p < npc; p++) {
      const trim_seg *g = &seg[c0.si];
      uint64_t k = c0.pos / bs, pe = piece_end(g, c0.pos, bs);
      const char *src;
      if (k < hblk) {
        src = hbuf + c0.pos;
      } else {
        while (win[w] != k)
          w++;
        src = scratch + w * bs + (c0.pos - k * bs);
      }
      if (g->dst)
        memcpy(g->dst + (c0.pos - g->s), src, (size_t)(pe - c0.pos));
      piece_next(&c0, seg, nseg, bs);
    }
  }
out:
  if (scratch)
    kvti_bufpool_put(pool, scratch, scap);
  kvti_free(rq);
  kvti_free(win);
  kvti_free(seg);
  return rc;
}

static int feed_blk(void *ctx, const void *data, size_t len) {
  return kvti_blkhash_update(ctx, data, len);
}

static int read_range_hashed(kvti_iobatch *b, int fd, char *dst, uint64_t off,
                             uint64_t len, kvti_blkhash *h, const char *path) {
  rseg one = {dst, off, len};
  return read_segs_hashed(b, fd, -1, &one, 1, h, NULL, path);
}

/* Cold files are read with O_DIRECT, warm ones through the page cache. On the
 * target VMs a buffered read of data not in the page cache costs 1-2 s of
 * kernel CPU per GiB (page-cache insertion, LRU, memcg accounting, the copy
 * out: fio measured sys 60-96% of a core for 0.5-1.1 GB/s), so two cores cap
 * cold promotes at 0.6-0.8 GB/s; O_DIRECT reads the same data at the disk's
 * speed for 5-8% of a core, straight into the final (aligned, pooled)
 * buffers, and does not duplicate in the page cache what the engine is about
 * to hold in RAM. A file mostly cached is cheaper to copy from memory. Returns
 * an O_DIRECT descriptor of the same inode as fd, or -1 when: the data does not
 * start at an aligned offset (native-mode files of >= 1 MiB of tensors do), the
 * file is small, half of it or more is cached, residency is unknown, the file
 * system has no O_DIRECT, or the path now names another file. -1 is always
 * safe: the page-cache path reads everything. */
static int open_direct_if_cold(int fd, const struct stat *st,
                               uint64_t data_start, const char *path) {
  uint64_t size = (uint64_t)st->st_size, cached = 0;
  if (size < KVTI_DATA_ALIGN_MIN || data_start % KVTI_IOB_ALIGN != 0 ||
      !kvti_io->resident || kvti_io->resident(fd, size, &cached) != 0 ||
      cached >= size / 2)
    return -1;
  int dfd = kvti_iob_open_direct(path, O_RDONLY, 0);
  struct stat ds;
  if (dfd >= 0 && (kvti_io->fstat(dfd, &ds) != 0 || ds.st_ino != st->st_ino ||
                   ds.st_dev != st->st_dev)) {
    kvti_io->close(dfd);
    dfd = -1;
  }
  return dfd;
}

int kvti_layer_read_file(kvt_layer *out, uint64_t *file_bytes, const char *path,
                         const kvti_layer_meta *m,
                         const kvti_layer_read_opts *o) {
  kvt_layer l;
  kvt_layer_init(&l, (kvt_layer_kind)m->kind);
  l.num_tensors = 0;
  kvti_st_header hd = {0};
  const kvti_st_tensor **slot = NULL;
  kvti_blkhash *h = NULL; /* whole-file hash (format 1) or block verifier */
  char *hbuf = NULL;      /* format 2, trimmed: the header's verified blocks */
  uint64_t hlen = 0, nread = 0;
  char *scratch = NULL;
  kvti_iobatch *eng = NULL;
  uint64_t *tbytes = NULL; /* trimmed read: per tensor (tb, kb) */
  int rc = 0, dfd = -1;
  int fd = kvti_open(path, O_RDONLY, 0);
  if (fd == KVT_ENOTFOUND)
    return BAD("%s: layer file missing", path);
  if (fd == KVT_EPERM && kvt_last_errno() == ELOOP)
    return BAD("%s is a symlink", path);
  if (fd < 0)
    return fd;
  struct stat st;
  if (kvti_io->fstat(fd, &st) != 0) {
    rc = KVT_ERR_OS(errno, "stat %s", path);
    goto out;
  }
  if (!S_ISREG(st.st_mode)) {
    rc = BAD("%s is not a regular file", path);
    goto out;
  }
  uint64_t size = (uint64_t)st.st_size;
  uint64_t bs = o->block_size;
  /* Format 2 with a trim: only verified blocks are read (read_trim_blocks). */
  int blk_trim = bs && o->keep_tokens;
  if (bs) {
    if (!kvti_blk_size_ok(bs) || !o->blocks ||
        kvti_blk_count(size, bs) != o->n_blocks) {
      rc =
          BAD("%s: %llu bytes, but its block list has %zu blocks of %llu", path,
              (unsigned long long)size, o->n_blocks, (unsigned long long)bs);
      goto out;
    }
    if (!blk_trim) {
      if ((rc = kvti_blkhash_new(&h, bs, 0)) != 0) {
        h = NULL;
        goto out;
      }
      kvti_blkhash_expect(h, o->blocks, o->n_blocks, path);
    }
  } else if (o->expect_xxh3) {
    if ((rc = kvti_blkhash_new(&h, 0, 0)) != 0) {
      h = NULL;
      goto out;
    }
    kvti_blkhash_expect(h, o->expect_xxh3, 1, path);
  }
  if (o->keep_tokens && (bs || !o->expect_xxh3) && kvti_io->fadvise) {
    /* A trimmed read touches scattered ranges: without this the kernel's
     * readahead (8 MiB on the target VMs) pulls the skipped rows from disk too.
     * Advice on our own open file only; a refusal changes nothing. */
    kvti_io->fadvise(fd, 0, 0, POSIX_FADV_RANDOM);
  }
  if (blk_trim) {
    rc = read_header_blocks(&hd, &hbuf, &hlen, fd, size, o, path);
    nread = hlen;
  } else {
    rc = kvti_st_read_header_fn(&hd, fd, size, path, h ? feed_blk : NULL, h);
    nread = hd.data_start;
  }
  if (rc)
    goto out;
  slot = kvti_calloc(m->num_tensors ? m->num_tensors : 1, sizeof *slot);
  l.tensors =
      kvti_calloc(m->num_tensors ? m->num_tensors : 1, sizeof(kvt_tensor));
  if (!slot || !l.tensors) {
    rc = KVT_ERR_NOMEM();
    goto out;
  }
  l.num_tensors = m->num_tensors;
  rc = kvti_layer_check_header(slot, &hd, m, path);
  if (rc)
    goto out;
  l.offset = m->offset;
  l.max_size = m->max_size;
  l.keep = m->keep;
  l.step = m->step;
  l.idx = m->idx;
  l.bits = m->bits;
  l.group_size = m->group_size;
  if (m->orig_dtypes) {
    l.orig_dtypes = kvti_malloc(m->num_tensors * sizeof(int32_t));
    if (!l.orig_dtypes) {
      rc = KVT_ERR_NOMEM();
      goto out;
    }
    memcpy(l.orig_dtypes, m->orig_dtypes, m->num_tensors * sizeof(int32_t));
  }
  for (uint32_t j = 0; j < m->num_tensors; j++) {
    kvt_tensor *t = &l.tensors[j];
    t->dtype = slot[j]->dtype;
    t->ndim = slot[j]->ndim;
    memcpy(t->shape, slot[j]->shape, sizeof t->shape);
    t->nbytes = slot[j]->nbytes;
    t->data = NULL;
  }
  /* Trimmed read: per tensor, tb = bytes of one head's token rows in the file,
   * kb = bytes of its kept rows. */
  uint64_t keep = o->keep_tokens;
  if (keep) {
    if (m->kind != KVT_LAYER_KV && m->kind != KVT_LAYER_QUANTIZED_KV) {
      rc = KVT_ERR(KVT_EUNSUPPORTED,
                   "%s: only KV and quantized KV layers can be trimmed to a "
                   "token prefix",
                   path);
      goto out;
    }
    tbytes = kvti_calloc(2u * (m->num_tensors ? m->num_tensors : 1),
                         sizeof(uint64_t));
    if (!tbytes) {
      rc = KVT_ERR_NOMEM();
      goto out;
    }
    for (uint32_t j = 0; j < m->num_tensors; j++) {
      kvt_tensor *t = &l.tensors[j];
      if (t->ndim < 2 || t->shape[t->ndim - 2] < (int64_t)keep) {
        rc = KVT_ERR(KVT_EINVAL,
                     "%s: tensor %u holds fewer than the %llu tokens to keep",
                     path, j, (unsigned long long)keep);
        goto out;
      }
      uint64_t outer = 1;
      for (uint32_t d = 0; d + 2 < t->ndim; d++)
        outer *= (uint64_t)t->shape[d];
      uint64_t tt = (uint64_t)t->shape[t->ndim - 2];
      uint64_t tb = outer ? t->nbytes / outer : 0;
      uint64_t kb = tt ? tb / tt * keep : 0;
      tbytes[2 * j] = tb;
      tbytes[2 * j + 1] = kb;
      t->shape[t->ndim - 2] = (int64_t)keep;
      t->nbytes = outer * kb;
    }
    l.offset = (int64_t)keep;
  }
  /* Allocate every buffer first (so a refusal costs no I/O), then read in file
   * order. */
  if (!o->verify_only) {
    for (uint32_t j = 0; j < m->num_tensors; j++) {
      kvt_tensor *t = &l.tensors[j];
      if (t->nbytes == 0)
        continue;
      t->data = o->alloc ? o->alloc(o->alloc_ctx, o->layer_no, j, t)
                         : kvti_buf_alloc((size_t)t->nbytes);
      if (!t->data) {
        rc = KVT_ERR(KVT_ENOMEM, "%s: cannot allocate %llu bytes for tensor %u",
                     path, (unsigned long long)t->nbytes, j);
        goto out;
      }
    }
  }
  if (blk_trim) {
    rc = read_trim_blocks(&l, &hd, slot, tbytes, hbuf, hlen, fd, size, &eng, o,
                          path, &nread);
    if (rc)
      goto out;
    goto done;
  }
  if (o->verify_only || (keep && h)) {
    scratch = kvti_malloc(RCHUNK);
    if (!scratch) {
      rc = KVT_ERR_NOMEM();
      goto out;
    }
  }
  if (!o->verify_only && !keep) {
    /* The common case, a full read into the final buffers: every tensor of
     * the file as one pipeline (tensors tile the data in offset order). */
    dfd =
        o->page_cache ? -1 : open_direct_if_cold(fd, &st, hd.data_start, path);
    rseg *sg = kvti_calloc(hd.n ? hd.n : 1, sizeof *sg);
    size_t ns = 0;
    if (!sg) {
      rc = KVT_ERR_NOMEM();
      goto out;
    }
    for (size_t i = 0; i < hd.n; i++) {
      uint32_t j = 0;
      while (slot[j] != &hd.tensors[i])
        j++;
      if (hd.tensors[i].nbytes)
        sg[ns++] = (rseg){l.tensors[j].data, hd.tensors[i].offset,
                          hd.tensors[i].nbytes};
    }
    if (o->cancel && atomic_load(o->cancel))
      rc = KVT_ERR(KVT_ECANCELED, "read of %s cancelled", path);
    else if (ns > 0 && (rc = kvti_iobatch_get(&eng, o->io_backend)) != 0)
      eng = NULL;
    else if (ns > 0)
      rc = read_segs_hashed(eng, fd, dfd, sg, ns, h, o->cancel, path);
    kvti_free(sg);
    if (rc)
      goto out;
  }
  for (size_t i = 0; (o->verify_only || keep) && i < hd.n; i++) {
    const kvti_st_tensor *ht = &hd.tensors[i];
    uint32_t j = 0;
    while (slot[j] != ht)
      j++;
    if (o->cancel && atomic_load(o->cancel)) {
      rc = KVT_ERR(KVT_ECANCELED, "read of %s cancelled", path);
      goto out;
    }
    char *dst = l.tensors[j].data;
    uint64_t left = ht->nbytes, off = ht->offset;
    if (left > 0 && !eng && (rc = kvti_iobatch_get(&eng, o->io_backend)) != 0) {
      eng = NULL;
      goto out;
    }
    if (keep && !h) {
      /* No checksum to verify: read only the kept rows, one read per head. */
      uint64_t tb = tbytes[2 * j], kb = tbytes[2 * j + 1];
      uint64_t outer = tb ? ht->nbytes / tb : 0;
      for (uint64_t b0 = 0; b0 < outer && !o->verify_only && kb > 0; b0 += 64) {
        kvti_iob_req rq[64];
        size_t nr = 0;
        for (uint64_t b = b0; b < outer && b < b0 + 64; b++)
          rq[nr++] =
              (kvti_iob_req){fd, -1, 0, dst + b * kb, kb, off + b * tb, 0, 0, 0,
                             0,  0,  0, NULL};
        if ((rc = kvti_iobatch_run(eng, rq, nr, 0, path)) != 0)
          goto out;
        nread += nr * kb;
      }
      continue;
    }
    uint64_t tpos = 0; /* tensor-relative position (trimmed reads) */
    while (left > 0) {
      if (o->cancel && atomic_load(o->cancel)) {
        rc = KVT_ERR(KVT_ECANCELED, "read of %s cancelled", path);
        goto out;
      }
      size_t c = left < RCHUNK ? (size_t)left : RCHUNK;
      char *p = o->verify_only || keep ? scratch : dst;
      rc = read_range_hashed(eng, fd, p, off, c, h, path);
      if (rc)
        goto out;
      if (keep && !o->verify_only)
        copy_kept(l.tensors[j].data, scratch, tpos, c, tbytes[2 * j],
                  tbytes[2 * j + 1]);
      else if (!o->verify_only)
        dst += c;
      tpos += c;
      off += c;
      left -= c;
    }
  }
  /* The whole-file hash, or the block count and the last partial block. */
  if (h && (rc = kvti_blkhash_final(h, NULL)) != 0)
    goto out;
  if (!keep || h)
    nread = size;
done:
  if (file_bytes)
    *file_bytes = nread;
  if (o->verify_only)
    kvti_layer_release(&l, 0, NULL, NULL);
  *out = l;
  memset(&l, 0, sizeof l);
out:
  kvti_iobatch_put(eng);
  if (dfd >= 0)
    kvti_io->close(dfd);
  kvti_io->close(fd);
  kvti_free(scratch);
  kvti_free(tbytes);
  kvti_free(slot);
  kvti_blkhash_free(h);
  kvti_free(hbuf);
  kvti_st_header_free(&hd);
  if (rc)
    kvti_layer_release(&l, o->alloc != NULL, o->free_buf, o->alloc_ctx);
  return rc;
}

/* ---- public single-layer API -------------------------------------------- */

int kvt_layer_save(char **meta_json, const char *path, const kvt_layer *layer,
                   uint32_t layer_idx, int mode, uint32_t file_mode) {
  if (!meta_json || !path || !layer)
    return KVT_ERR(KVT_EINVAL, "kvt_layer_save: NULL argument");
  if (mode != KVT_STORAGE_NATIVE && mode != KVT_STORAGE_COMPAT)
    return KVT_ERR(KVT_EINVAL, "kvt_layer_save: invalid storage mode %d", mode);
  if (layer_idx > KVTI_MAX_LAYERS)
    return KVT_ERR(KVT_EINVAL, "kvt_layer_save: layer_idx too large");
  int rc = kvti_layer_validate(layer, layer_idx, 1);
  if (rc)
    return rc;
  kvti_layer_out p;
  rc = kvti_layer_plan(&p, layer, layer_idx, mode,
                       kvti_layer_is_quantized(layer), 1);
  if (rc)
    return rc;
  rc = kvti_layer_write_file(NULL, NULL, path, &p, file_mode, 0, 1, KVT_IO_AUTO,
                             NULL, NULL);
  if (rc == 0) {
    *meta_json = p.meta_json;
    p.meta_json = NULL;
  }
  kvti_layer_out_free(&p);
  return rc;
}

int kvt_layer_load(kvt_entry **out, const char *path, const char *meta_json) {
  if (!out || !path || !meta_json)
    return KVT_ERR(KVT_EINVAL, "kvt_layer_load: NULL argument");
  cJSON *j = cJSON_Parse(meta_json);
  if (!j)
    return KVT_ERR(KVT_EINVAL, "kvt_layer_load: metadata is not valid JSON");
  kvti_layer_meta m;
  int rc = kvti_layer_meta_parse(&m, j, -1, path);
  cJSON_Delete(j);
  if (rc)
    return rc;
  kvt_entry *e = kvti_entry_new();
  if (!e) {
    kvti_layer_meta_free(&m);
    return KVT_ENOMEM;
  }
  e->layers = kvti_calloc(1, sizeof(kvt_layer));
  if (!e->layers) {
    rc = KVT_ERR_NOMEM();
  } else {
    kvti_layer_read_opts o = {0};
    uint64_t fb = 0;
    rc = kvti_layer_read_file(&e->layers[0], &fb, path, &m, &o);
    if (rc == 0) {
      e->num_layers = 1;
      e->disk_bytes = fb;
    }
  }
  kvti_layer_meta_free(&m);
  if (rc) {
    kvt_entry_free(e);
    return rc;
  }
  *out = e;
  return 0;
}

void kvt_free(void *p) {
  kvti_free(p);
}
