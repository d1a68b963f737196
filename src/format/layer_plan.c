/*
 * layer_plan.c - what one layer file holds once the storage mode is applied:
 * its tensor names, descriptors and (when materialized) converted data, and
 * its manifest object emitted the way Python's json.dumps writes it. Native
 * keeps every tensor as given (quantized layers as packed/scales/biases under
 * kvtier's "QuantizedKVCache" type); compat reproduces the reference's
 * enqueue_spill and serializers byte for byte (bf16 -> F32 with
 * "*_original_dtype": "bfloat16"; quantized -> MLX dequantization, trim to
 * offset along axis -2, bf16 -> F16 with hints, written as "KVCache").
 */
#include "format/layer.h"
#include "base/bufpool.h"
#include "base/error.h"
#include "base/io.h"
#include "format/dtype.h"
#include "format/layout.h"

#include <string.h>

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
      kvti_tensor_name(p->names[j], KVT_LAYER_ARRAYS, idx, j);
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
    rc = out_alloc(p, 6);
    if (rc)
      goto out;
    for (uint32_t j = 0; j < 6; j++) {
      kvti_tensor_name(p->names[j], KVT_LAYER_QUANTIZED_KV, idx, j);
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
  kvti_tensor_name(p->names[0], KVT_LAYER_KV, idx, 0);
  kvti_tensor_name(p->names[1], KVT_LAYER_KV, idx, 1);
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
