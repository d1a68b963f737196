/*
 * layer_dequant.c - MLX affine dequantization of a packed quantized tensor
 * (what compat mode stores instead of the packed form, as the reference's
 * enqueue_spill does), bit for bit: the same unpacking, the same intermediate
 * rounding to the scales dtype - and the size of that dense form, which is
 * what an entry holding quantized layers reports as its memory_bytes.
 */
#include "format/layer.h"
#include "base/error.h"
#include "format/dtype.h"

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

/* Dense bytes of one packed tensor p (scales dtype sd) over its first rows
 * token rows: rows x (packed row bytes x 8 / bits) elements of sd. */
static uint64_t dense_of(const kvt_tensor *p, kvt_dtype sd, uint64_t rows,
                         int bits) {
  uint32_t nd = p->ndim;
  uint64_t outer = 1;
  for (uint32_t d = 0; d + 2 < nd; d++)
    outer *= (uint64_t)p->shape[d];
  uint64_t row =
      (uint64_t)p->shape[nd - 1] * kvt_dtype_size((kvt_dtype)p->dtype);
  return outer * rows * (row * 8 / (uint64_t)bits) * kvt_dtype_size(sd);
}

uint64_t kvti_layers_dense_bytes(const kvt_layer *ls, uint32_t n) {
  uint64_t mem = 0;
  for (uint32_t i = 0; i < n; i++) {
    const kvt_layer *l = &ls[i];
    if (l->kind != KVT_LAYER_QUANTIZED_KV || l->num_tensors != 6 ||
        l->bits <= 0 || l->tensors[0].ndim < 2 || l->tensors[3].ndim < 2) {
      for (uint32_t j = 0; j < l->num_tensors; j++)
        mem += l->tensors[j].nbytes;
      continue;
    }
    for (uint32_t j = 0; j < 6; j += 3) {
      const kvt_tensor *p = &l->tensors[j];
      uint64_t rows = (uint64_t)p->shape[p->ndim - 2];
      if (l->offset != KVT_ABSENT && l->offset >= 0 &&
          (uint64_t)l->offset < rows)
        rows = (uint64_t)l->offset;
      mem += dense_of(p, (kvt_dtype)l->tensors[j + 1].dtype, rows, l->bits);
    }
  }
  return mem;
}
