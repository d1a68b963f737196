/*
 * layer.h - one layer <-> one safetensors file plus its manifest object: which
 * tensors each layer kind stores (names in layout.h), the compat-mode
 * transformations that reproduce exactly what the reference writes (bf16 -> F32
 * upcast with hints, MLX affine dequantization, trim to offset, bf16 -> F16
 * cast), the manifest object of a layer (emitted the way Python's json.dumps
 * writes it) and its parser, and the verified read of one layer file straight
 * into the final tensor buffers, and the cut of a layer's tensors to a range
 * of token rows. Implemented by layer_check.c (validation), layer_dequant.c,
 * layer_plan.c, layer_write.c, layer_meta.c, layer_read.c, layer_blocks.c and
 * layer_rows.c. Knows nothing of entries (entry.h builds on it).
 */
#ifndef KVT_LAYER_H
#define KVT_LAYER_H

#include "kvtier.h"
#include "kvtier_sys.h"
#include "format/layout.h"
#include "format/safetensors.h"

#include <stdatomic.h>
#include <stdint.h>

#define KVTI_MAX_ARRAYS 65536u
/* Layers per entry: far above any model (hundreds), low enough that a planted
 * manifest cannot make the parser build millions of objects. */
#define KVTI_MAX_LAYERS 16384u

/* Checks one caller layer (kind, tensor count, dtypes, shape vs nbytes,
 * quantized geometry, attributes). need_data: data must be non-NULL when nbytes
 * > 0. Returns 0 or KVT_EINVAL with a message naming layer idx. */
int kvti_layer_validate(const kvt_layer *l, uint32_t idx, int need_data);

/* Token i is KV row i (docs/FORMAT.md section 3, "offset"): a KV or quantized
 * KV layer's offset (when present) counts the valid rows on axis -2 of every
 * one of its tensors, so it may be below shape[-2] (an engine's preallocated
 * room: rows past offset are never served as tokens) but never above
 * row_base + shape[-2] (rows that do not exist; row_base = rows of the layer
 * held elsewhere, a chained entry's chain) and, with n_tokens != UINT64_MAX,
 * never above n_tokens. (Entries may hold more KV rows than tokens: a whole
 * entry is returned as spilled, and chunks, prefixes and trims only ever use
 * rows below min(offset, tokens).) Rotating KV is not checked: its offset
 * counts every token ever seen and its rows are a window. Tensors of KV kinds
 * need a token axis (ndim >= 2). Returns 0 or err (KVT_EINVAL for a caller's
 * layer, KVT_ECORRUPT for a stored one) with a message naming `what` and the
 * layer. */
int kvti_layer_check_rows(const kvt_layer *l, uint32_t idx, uint64_t row_base,
                          uint64_t n_tokens, int err, const char *what);

/* Token rows of a KV tensor (ndim >= 2; axis -2 = tokens, token i is row i).
 * kvti_tensor_cut_desc: *d = s described with n token rows (shape[-2] = n,
 * nbytes to match, data NULL: the caller gives it a buffer of d->nbytes).
 * kvti_tensor_copy_rows: rows [from, from + n) of src into rows [at, at + n)
 * of dst, head by head (each index of the axes before -2 holds its own run of
 * rows). dst has src's geometry but for the token axis, each tensor's row
 * count is its shape[-2], and both ranges lie within them. */
void kvti_tensor_cut_desc(kvt_tensor *d, const kvt_tensor *s, uint64_t n);
void kvti_tensor_copy_rows(kvt_tensor *dst, uint64_t at, const kvt_tensor *src,
                           uint64_t from, uint64_t n);
/* *v = tensor ct of a chunk (format/chunk.h) described with n token rows, its
 * bytes at data + ct->off (data: the chunk's data section), so a chunk's rows
 * are copied by kvti_tensor_copy_rows as any tensor's. */
struct kvti_chunk_tensor;
void kvti_tensor_of_chunk(kvt_tensor *v, const struct kvti_chunk_tensor *ct,
                          const void *data, uint64_t n);

/* True when the layer's stored form needs MLX dequantization in compat mode. */
static inline int kvti_layer_is_quantized(const kvt_layer *l) {
  return l->kind == KVT_LAYER_QUANTIZED_KV;
}

/* What one layer file contains once the storage mode is applied. */
typedef struct kvti_layer_out {
  uint32_t n;
  char (*names)[KVTI_NAME_MAX];
  kvt_tensor *tensors; /* data points into the caller's layer or into owned[] */
  void **owned;        /* converted buffers (kvti_buf_alloc), or NULL entries */
  char *meta_json;     /* the layer's manifest object, json.dumps style */
  /* Data alignment of the file: 0 = the safetensors package's 8 (compat mode
   * stays byte-identical to the reference); KVTI_DATA_ALIGN in native mode. */
  uint32_t data_align;
} kvti_layer_out;

/* Native-mode layer files pad their header so tensor data starts at a
 * multiple of this: reads of aligned tensors can then use O_DIRECT. */
#define KVTI_DATA_ALIGN 4096u
/* ... when the file holds at least this many bytes of tensors (smaller files
 * are read through the page cache anyway). */
#define KVTI_DATA_ALIGN_MIN ((uint64_t)1 << 20)

/* Plans layer idx for mode. entry_has_quant: some layer of the entry is
 * quantized (the reference then casts every bf16 KV layer to F16). With
 * materialize == 0 no data is converted (descriptors, names and metadata only:
 * enough to compute sizes). The layer must be valid. Returns 0, KVT_ENOMEM,
 * KVT_EUNSUPPORTED (compat dequantization of unsupported bits). */
int kvti_layer_plan(kvti_layer_out *p, const kvt_layer *l, uint32_t idx,
                    int mode, int entry_has_quant, int materialize);
void kvti_layer_out_free(kvti_layer_out *p);

/* Bytes the layer file will have (0 with the error set on failure). */
uint64_t kvti_layer_out_file_size(const kvti_layer_out *p);

/* Writes a planned layer as a safetensors file at path (O_CREAT|O_EXCL unless
 * truncate), with file_mode, fsync when do_fsync. size and xxh3 as
 * kvti_st_write (same bytes). With blocks (non-NULL, a fresh compute-mode
 * kvti_blkhash) the bytes are hashed per block into it instead (each byte once)
 * and *xxh3 receives the digest of the block list (entry format 2). io_backend
 * (kvt_io_backend) picks the I/O engine of the staged O_DIRECT writer
 * (fwriter.h). With a group (non-NULL) the file joins it: do_fsync/io_backend
 * are the group's, and the writes complete, are fsynced and (on failure)
 * removed by kvti_wgroup_finish/abort. Alone, on failure the file is removed.
 */
struct kvti_wgroup;
int kvti_layer_write_file(uint64_t *size, uint64_t *xxh3, const char *path,
                          const kvti_layer_out *p, uint32_t file_mode,
                          int do_fsync, int truncate, int io_backend,
                          struct kvti_wgroup *group, kvti_blkhash *blocks);

/* Parsed manifest object of a layer. */
typedef struct kvti_layer_meta {
  int32_t kind;
  uint32_t layer_idx;
  int64_t offset, max_size, keep, step, idx;
  int32_t bits, group_size;
  uint32_t num_tensors;
  int32_t *orig_dtypes; /* num_tensors entries or NULL (kvti_malloc) */
} kvti_layer_meta;

/* A layer's attributes: kind, offset, the rotating KV fields (max_size, keep,
 * step, idx) and the quantized ones (bits, group_size) - everything of a
 * layer but its tensors and orig_dtypes, whose ownership each caller settles
 * itself (moved, copied or left). kvti_layer_meta_attrs sets them from a
 * parsed manifest object, as a read of the layer's file does;
 * kvti_layer_copy_attrs from another form of the same layer (a chained
 * entry's tail onto the rows read from its chain). One list of fields serves
 * both (layer_meta.c). */
void kvti_layer_meta_attrs(kvt_layer *dst, const kvti_layer_meta *src);
void kvti_layer_copy_attrs(kvt_layer *dst, const kvt_layer *src);

/* Parses one layer object (a cJSON *, passed as void * to keep cJSON out of
 * this header). expect_idx >= 0: layer_idx must equal it. Returns 0,
 * KVT_ECORRUPT, KVT_ENOMEM. */
int kvti_layer_meta_parse(kvti_layer_meta *m, const void *cjson_obj,
                          int64_t expect_idx, const char *what);
void kvti_layer_meta_free(kvti_layer_meta *m);

/* Checks that a parsed safetensors header holds exactly the tensors the
 * metadata calls for, with consistent dtypes/shapes; slot[j] receives the
 * header tensor of layer tensor j (array of m->num_tensors). Returns 0 or
 * KVT_ECORRUPT. */
int kvti_layer_check_header(const kvti_st_tensor **slot,
                            const kvti_st_header *hd, const kvti_layer_meta *m,
                            const char *path);

typedef struct kvti_layer_read_opts {
  kvt_alloc_fn alloc; /* NULL: kvti_buf_alloc */
  kvt_free_fn free_buf;
  void *alloc_ctx;
  uint32_t layer_no; /* passed to alloc */
  atomic_int *cancel;
  int verify_only; /* read + verify, keep no data (out gets no buffers) */
  /* Format 1: the whole-file XXH3-64; NULL: no checksum (reference entries).
   * Ignored when block_size > 0. */
  const uint64_t *expect_xxh3;
  int io_backend; /* kvt_io_backend of the reads (0 = AUTO) */
  /* > 0: keep only token positions [0, keep_tokens) of a KV or quantized KV
   * layer (axis -2 of every tensor; offset becomes keep_tokens); other kinds
   * fail with KVT_EUNSUPPORTED, a layer holding fewer tokens with KVT_EINVAL.
   * With per-block checksums (block_size > 0) only the blocks covering the
   * header and each head's kept rows are read, and each is verified before any
   * of its bytes is used; with a whole-file checksum the whole file is still
   * read (the checksum covers it) but only the kept rows are copied out;
   * without a checksum only the kept rows are read. 0: the whole layer. */
  uint64_t keep_tokens;
  /* Format 2: block size (a power of two) and the n_blocks expected per-block
   * XXH3-64s; n_blocks must be the file's block count (else KVT_ECORRUPT). 0:
   * format 1 or no checksum. */
  uint64_t block_size;
  const uint64_t *blocks;
  size_t n_blocks;
  /* 1: read through the page cache even when the file is cold (never
   * O_DIRECT), leaving the pages cached for a next read. */
  int page_cache;
  /* Rows of this layer held elsewhere (a chained entry's tail: its chain's
   * rows), for the offset check (kvti_layer_check_rows). 0: none. */
  uint64_t row_base;
  /* kvti_layer_verify_mem only: the cached tensors hold rows [0, T) on axis
   * -2 of which the file holds [mem_row0, T) (a chained entry's tail: the
   * chain holds the rows before). 0: the file holds the whole tensors. */
  uint64_t mem_row0;
} kvti_layer_read_opts;

/* Reads the layer file at path described by m into out (tensors and orig_dtypes
 * allocated with kvti_malloc, data via alloc), verifying the header against m
 * and the checksums (whole file, or every block as it lands). *file_bytes
 * receives the file size, or for a trimmed read the bytes actually read. On
 * failure nothing is kept (caller buffers go back through free_buf). Returns 0,
 * KVT_ECORRUPT, KVT_EIO, KVT_ENOMEM, KVT_ENOTFOUND, KVT_ECANCELED.
 */
int kvti_layer_read_file(kvt_layer *out, uint64_t *file_bytes, const char *path,
                         const kvti_layer_meta *m,
                         const kvti_layer_read_opts *o);

/* Frees a layer read by kvti_layer_read_file (tensor buffers via free_buf when
 * alloc was a caller's: pass caller_alloc = 1; free_buf NULL then means the
 * caller keeps them). */
void kvti_layer_release(kvt_layer *l, int caller_alloc, kvt_free_fn free_buf,
                        void *ctx);

/* MLX affine dequantization of one quantized tensor into out (n = rows*D
 * elements of out_dtype), keeping only the first keep_rows of every block of T
 * rows along axis -2 (keep_rows = T: all). q_round: the intermediate dtype the
 * result is rounded to first (the scales dtype). Exposed for tests. Returns 0
 * or KVT_EUNSUPPORTED. */
int kvti_dequantize(void *out, kvt_dtype out_dtype, const kvt_tensor *packed,
                    const kvt_tensor *scales, const kvt_tensor *biases,
                    int bits, int group_size, int64_t keep_rows);

/* What the n layers take once promoted dense, as the Python drop-in hands
 * them over (and the reference's dequantize-at-spill entries hold them): a
 * quantized layer as its keys and values dequantized - min(offset, rows)
 * token rows of (packed row bytes x 8 / bits) elements in the dtype of the
 * scales beside them, scales and biases folded in - every other layer as its
 * tensors' bytes. */
uint64_t kvti_layers_dense_bytes(const kvt_layer *ls, uint32_t n);

/* Checks that the in-memory layer l (a cached copy: tensors with data) holds
 * exactly what the layer file at path holds, as kvti_layer_read_file would
 * read it, without reading the tensor data: the file's header is read and
 * checked against m and against l's tensors (dtype, shape, size), and the
 * checksums (o->block_size/blocks/n_blocks, or o->expect_xxh3) are verified
 * over the header bytes followed by l's tensor bytes in file order. On
 * success l's attributes (kind, offset, rotating and quantized fields,
 * orig_dtypes) are set from m. Only the checksum fields and cancel of o are
 * used. Returns 0, KVT_ECORRUPT (mismatch; l's data unchanged), KVT_EIO,
 * KVT_ENOMEM, KVT_ECANCELED, KVT_EUNSUPPORTED (no checksums: reference
 * entries). */
int kvti_layer_verify_mem(kvt_layer *l, const char *path,
                          const kvti_layer_meta *m,
                          const kvti_layer_read_opts *o);

#endif
