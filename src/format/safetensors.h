/*
 * safetensors.h - a hostile-input-safe reader and a streaming writer for the
 * safetensors format (8-byte little-endian header length N, N bytes of JSON,
 * then the tensor data; see docs/FORMAT.md). The reader validates the header
 * completely and exposes one descriptor per tensor (absolute file offset and
 * byte length) so callers pread each tensor straight into its final buffer. The
 * writer emits exactly what the Python `safetensors` package writes (data and
 * header keys ordered by dtype then name, header space-padded to 8 bytes)
 * and computes the XXH3-64 of the whole file while writing it. Also hosts a
 * tiny string builder used to emit JSON.
 */
#ifndef KVT_SAFETENSORS_H
#define KVT_SAFETENSORS_H

#include "base/hash.h"
#include "base/strbuf.h"
#include "kvtier.h"

#include <stddef.h>
#include <stdint.h>

/* Bound on the JSON header (the safetensors reference implementation uses 100
 * MB). */
#define KVTI_ST_MAX_HEADER (100u * 1000u * 1000u)
/* Bound on the number of tensors in one file. */
#define KVTI_ST_MAX_TENSORS 65536u

typedef struct kvti_st_tensor {
  char *name;
  kvt_dtype dtype;
  uint32_t ndim;
  int64_t shape[KVT_MAX_DIMS];
  uint64_t offset; /* absolute offset in the file */
  uint64_t nbytes;
} kvti_st_tensor;

typedef struct kvti_st_header {
  kvti_st_tensor *tensors; /* n, sorted by file offset (ties by name) */
  size_t n;
  char **meta_keys; /* __metadata__ entries (n_meta each), or NULL */
  char **meta_vals;
  size_t n_meta;
  uint64_t data_start; /* 8 + header length */
  uint64_t file_size;  /* data_start + sum of nbytes: the exact file size */
} kvti_st_header;

/* Parses and validates a header. `json`/`len` is the header text (not
 * NUL-terminated needed), file_size the size of the whole file. Returns 0,
 * KVT_ECORRUPT (message names `what` and the problem), KVT_ENOMEM. On failure
 * *out is zeroed. */
int kvti_st_parse(kvti_st_header *out, const char *json, size_t len,
                  uint64_t file_size, const char *what);

/* Reads and validates the header of the open file fd of size file_size (from
 * fstat). When h is non-NULL the 8 + N header bytes are fed to it (so the
 * caller can finish the whole-file hash by hashing the tensor data in offset
 * order). Returns as kvti_st_parse, plus KVT_EIO. */
int kvti_st_read_header(kvti_st_header *out, int fd, uint64_t file_size,
                        const char *path, kvti_xxh3_state *h);

/* As kvti_st_read_header, but the 8 + N header bytes are passed to feed(ctx,
 * bytes, len) (in file order) before they are parsed; a nonzero return from
 * feed (e.g. a block checksum mismatch) aborts with that code. feed may be
 * NULL. */
typedef int (*kvti_st_feed_fn)(void *ctx, const void *data, size_t len);
int kvti_st_read_header_fn(kvti_st_header *out, int fd, uint64_t file_size,
                           const char *path, kvti_st_feed_fn feed, void *ctx);

/* The header length N from a file's first 8 bytes, checked as the readers do
 * (2 <= N <= KVTI_ST_MAX_HEADER, 8 + N <= file_size). For callers that read
 * and verify the header bytes themselves before kvti_st_parse. Returns 0 or
 * KVT_ECORRUPT. */
int kvti_st_header_len(uint64_t *n, const unsigned char first8[8],
                       uint64_t file_size, const char *path);

void kvti_st_header_free(kvti_st_header *hd); /* accepts NULL / zeroed */
/* Tensor by name or NULL. */
const kvti_st_tensor *kvti_st_find(const kvti_st_header *hd, const char *name);

/* One tensor to write. */
typedef struct kvti_st_item {
  const char *name;
  const kvt_tensor *t;
} kvti_st_item;

/* Builds the header bytes (8-byte length + padded JSON) for items in *hdr
 * (kvti_malloc'ed) and the order in which the data must follow (order[i] =
 * index into items; caller-provided array of n). meta: n_meta key/value pairs
 * for __metadata__ (may be 0). Returns 0, KVT_EINVAL (dtype, duplicate name,
 * nbytes mismatch), KVT_ENOMEM. */
int kvti_st_build_header(char **hdr, size_t *hdr_len, size_t *order,
                         const kvti_st_item *items, size_t n,
                         const char *const *meta, size_t n_meta);

/* Re-pads a header built by kvti_st_build_header with spaces so that the data
 * starts at a multiple of align (a power of two >= 8; the safetensors format
 * allows any amount of trailing header whitespace). kvtier's native mode uses
 * 4096 so tensor data sits at block-aligned file offsets and can be read with
 * O_DIRECT straight into aligned buffers. Returns 0, KVT_EINVAL, KVT_ENOMEM
 * (the header is unchanged on failure). */
int kvti_st_pad_header(char **hdr, size_t *hdr_len, size_t align);

/* Writes a complete safetensors file to fd at offset 0 (header then data,
 * pwrite through the I/O seam), hashing every byte as it is written. *size and
 * *xxh3 receive the file size and the XXH3-64 of the whole file (either may be
 * NULL). Returns 0, KVT_EIO, KVT_ENOSPC, KVT_ENOMEM, KVT_EINVAL. */
int kvti_st_write(uint64_t *size, uint64_t *xxh3, int fd, const char *path,
                  const kvti_st_item *items, size_t n, const char *const *meta,
                  size_t n_meta);
/* File size kvti_st_write would produce, without writing. 0 on error (error
 * set). */
uint64_t kvti_st_file_size(const kvti_st_item *items, size_t n,
                           const char *const *meta, size_t n_meta);

/* Appends s to b (base/strbuf.h) as a JSON string literal, escaping like
 * Python's json.dumps (ensure_ascii=True). */
void kvti_sb_json_str(kvti_sb *b, const char *s);

/* An upper bound on the number of JSON values in text (every value but the
 * first follows a ',' ':' or '[' outside strings), counted without parsing:
 * callers refuse a document before cJSON allocates for it. */
size_t kvti_json_count_values(const char *text, size_t len);

#endif
