/*
 * layer_check.c - validation of a caller's layer before anything is planned or
 * written: kind and tensor count, dtypes, shape against nbytes, NULL data, and
 * for quantized layers bits, group_size and the packed/scales/biases geometry.
 * The reader reuses it (kvti_layer_check_header) to check the quantized tensors
 * a file holds, so a layer read back satisfies the same rules as one written.
 * kvti_layer_check_rows holds the one rule tying offset to the token axis, used
 * by the spill path, kvt_layer_save and every layer read.
 */
#include "format/layer_int.h"
#include "base/error.h"
#include "format/dtype.h"

int kvti_quant_bits_ok(int b) {
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
    if (!kvti_quant_bits_ok(l->bits))
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

int kvti_layer_check_rows(const kvt_layer *l, uint32_t idx, uint64_t row_base,
                          uint64_t n_tokens, int err, const char *what) {
  if (l->kind != KVT_LAYER_KV && l->kind != KVT_LAYER_QUANTIZED_KV)
    return 0;
  for (uint32_t j = 0; j < l->num_tensors; j++)
    if (l->tensors[j].ndim < 2)
      return KVT_ERR(err,
                     "%s: layer %u tensor %u: a KV tensor needs a token axis "
                     "(ndim >= 2, tokens on axis -2), got ndim %u",
                     what, idx, j, l->tensors[j].ndim);
  if (l->offset == KVT_ABSENT) /* quantized only: every row is valid */
    return 0;
  for (uint32_t j = 0; j < l->num_tensors; j++) {
    const kvt_tensor *t = &l->tensors[j];
    uint64_t rows = row_base + (uint64_t)t->shape[t->ndim - 2];
    if ((uint64_t)l->offset > rows)
      return KVT_ERR(err,
                     "%s: layer %u: offset %lld is past the %llu token rows of "
                     "tensor %u (shape[-2]): token i must be KV row i",
                     what, idx, (long long)l->offset, (unsigned long long)rows,
                     j);
  }
  if (n_tokens != UINT64_MAX && (uint64_t)l->offset > n_tokens)
    return KVT_ERR(err,
                   "%s: layer %u: offset %lld is past the entry's %llu "
                   "tokens: its KV rows past them belong to no token of the "
                   "key",
                   what, idx, (long long)l->offset,
                   (unsigned long long)n_tokens);
  return 0;
}
