/*
 * fmt_testlib.h - helpers shared by the format tests (safetensors, layer,
 * entry): seeded random tensors and layers of every kind and dtype, bitwise
 * comparison, an independent reference implementation of MLX affine
 * dequantization and of the bf16/f16 conversions, and small file utilities
 * (write a whole file, join paths). Part of the test library (tests/lib,
 * one static library linked by every C test); definitions in fmt_testlib.c.
 * The system headers below stay included here: the tests rely on them.
 */
#ifndef KVT_FMT_TESTLIB_H
#define KVT_FMT_TESTLIB_H

#include "testutil.h"
#include "kvtier.h"

#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* Every dtype of the format, in enum order. */
#define N_ALL_DTYPES ((size_t)13)
extern const kvt_dtype ALL_DTYPES[N_ALL_DTYPES];

/* Independent float helpers (straightforward, not the library's). */
float t_bf16_to_f32(uint16_t h);
uint16_t t_f32_to_bf16(float f);
float t_f16_to_f32(uint16_t h);
/* f32 -> f16 by searching the nearest representable value (ties to even). */
uint16_t t_f32_to_f16(float f);

/* Element i of a F16/BF16/F32 buffer as float (aborts on other dtypes). */
float t_load(const void *buf, kvt_dtype dt, size_t i);

/* Random tensor; float dtypes get values in [-4, 4) on a 1/256 grid (exact in
 * every float type), others random bytes (BOOL: 0/1). */
kvt_tensor t_tensor(kvt_rng *r, kvt_dtype dt, uint32_t ndim, ...);

/* Frees a layer built by the generators below (tensor data, orig_dtypes). */
void t_layer_free(kvt_layer *l);
/* A KV layer of the chunked-store tests: F16 [1, 2, T, 8] keys and values
 * whose row p < n depends only on (tok[p], p, layer), so prompts sharing a
 * prefix share its KV; rows from n on (spare room) hold pad. offset = n. */
kvt_layer t_kv_pattern(const int32_t *tok, int n, int T, int layer,
                       uint16_t pad);

/* KV layer: keys and values [B, H, T, D] of dt. */
kvt_layer t_kv(kvt_rng *r, kvt_dtype dt, int B, int H, int T, int D,
               int64_t offset);

/* KV layer whose rows depend on (token, position, layer) only - as the shared
 * part of a real model's KV does, so shared prefixes share KV: F16 keys and
 * values [1, 2, T, D], row p < n from tok[p] (rows past n: 0x7777, the
 * engine's spare room), offset n. */
kvt_layer t_kv_tokens(const int32_t *tok, int n, int T, int D, int layer);

/* Rotating KV layer [1, 2, 8, 4] with fixed max_size/keep/step/idx. */
kvt_layer t_rotating(kvt_rng *r, kvt_dtype dt);

/* ARRAYS layer of n tensors [1, 3, j + 2] of dtypes dts[j]. */
kvt_layer t_arrays(kvt_rng *r, uint32_t n, const kvt_dtype *dts);

/* Quantized KV: [B,H,T,D] elements, packed along D. */
kvt_layer t_quant(kvt_rng *r, int bits, int gs, kvt_dtype sdt, int B, int H,
                  int T, int D, int64_t offset);

/* 1 when dtype, shape and bytes are equal. */
int t_tensor_eq(const kvt_tensor *a, const kvt_tensor *b);

/* 1 when kind, metadata, every tensor and orig_dtypes are equal. */
int t_layer_eq(const kvt_layer *a, const kvt_layer *b);

/* Straightforward MLX affine dequantization of element i of row `row` (byte
 * view of the packed words, little-endian host). */
float t_dequant_elem(const kvt_layer *l, int kv, int64_t row, int64_t i);

/* Writes n bytes to path (created/truncated): 0 or -1. */
int t_write_all(const char *path, const void *d, size_t n);

/* "a/b", malloc'ed. */
char *t_join(const char *a, const char *b);

#endif
