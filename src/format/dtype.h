/*
 * dtype.h - element-type helpers shared by the format code: numpy-style dtype
 * names (the strings the reference stores in its `*_original_dtype` hints),
 * exact bf16/f16 <-> f32 conversions (round-to-nearest-even, NaN and infinity
 * preserved) used by compat mode, and 64-byte-aligned tensor buffers allocated
 * through the I/O seam.
 */
#ifndef KVT_DTYPE_H
#define KVT_DTYPE_H

#include "kvtier.h"

#include <stddef.h>
#include <stdint.h>

/* numpy/mlx name of a dtype ("bfloat16", "float32", "bool", ...) or NULL. */
const char *kvti_dtype_np_name(kvt_dtype dt);
/* Inverse of kvti_dtype_np_name (also accepts "bool_"); KVT_DTYPE_INVALID when
 * unknown. */
kvt_dtype kvti_dtype_from_np_name(const char *name);
/* True for F16, BF16, F32, F64. */
int kvti_dtype_is_float(kvt_dtype dt);

float kvti_bf16_to_f32(uint16_t h);
uint16_t kvti_f32_to_bf16(float f);
float kvti_f16_to_f32(uint16_t h);
uint16_t kvti_f32_to_f16(float f);

/* Reads element i of a float tensor buffer of dtype dt as float (F16/BF16/F32;
 * F64 rounded). */
float kvti_load_float(const void *buf, kvt_dtype dt, size_t i);
/* Stores v as element i of dtype dt (F16/BF16/F32/F64), rounding to nearest
 * even. */
void kvti_store_float(void *buf, kvt_dtype dt, size_t i, float v);

/* prod(shape) * kvt_dtype_size(dt) with overflow detection. Returns 0 and *out,
 * or -1. */
int kvti_tensor_nbytes(uint64_t *out, kvt_dtype dt, uint32_t ndim,
                       const int64_t *shape);

/* 64-byte aligned buffer (n may be 0); free with kvti_buf_free. Buffers of 64
 * KiB and more are 4096-aligned and come from the process-wide buffer pool
 * (bufpool.h), so tensor copies and promoted tensors reuse memory instead of
 * faulting in fresh pages. */
void *kvti_buf_alloc(size_t n);
/* count buffers of sizes[i] bytes (each 4096-aligned) carved from one pool
 * block, each freed with kvti_buf_free on its own; the block goes back to the
 * pool when the last of them is freed. For many buffers below a huge page
 * that are used and freed together (an entry's tensors): the block is one
 * run of huge pages (bufpool.h), which separate buffers of that size never
 * get. The first page and one page before each buffer hold bookkeeping. Any
 * buffer kept alive keeps the whole block. Returns 0 with out[0..count)
 * set, or KVT_ENOMEM with every out[i] NULL. */
int kvti_buf_alloc_group(void **out, const size_t *sizes, size_t count);
void kvti_buf_free(void *p);

#endif
