/*
 * chunk.h - the chunk file of the chunked native store (docs/FORMAT.md section
 * 9): a fixed run of token positions [index*C, index*C + n) of every trimmable
 * layer of a spill (KV, quantized KV, rotating KV that has not wrapped), stored
 * once under a content key and never rewritten. This header defines the keys
 * (a length-prefixed SHA-256 chain seeded by the namespace, plus the XXH3-128
 * chain the in-memory lookup uses), the parsed header, the pure header parser
 * (hostile input: the fuzz target drives it), the durable writer (tmp ->
 * fsync -> rename -> fsync dir) and the verified reader. It knows nothing of
 * the index or the tier: the store (src/store/chunkstore.c) names the files and
 * keeps the chain table.
 *
 * Invariants: a chunk's key is SHA-256(parent || u32 n || tokens), so a file
 * whose header parses and whose key matches the name it was opened by holds
 * exactly the tokens the chain says; every data byte is covered by an XXH3-64
 * block checksum listed in the header, and the header by its own XXH3-64, so
 * nothing read from a chunk is used before it is verified.
 */
#ifndef KVT_FORMAT_CHUNK_H
#define KVT_FORMAT_CHUNK_H

#include "kvtier.h"

#include <stddef.h>
#include <stdint.h>

#define KVTI_CHUNK_MAGIC "KVTCHUNK"
#define KVTI_CHUNK_VERSION 1u
#define KVTI_CHUNK_FIXED 128u /* bytes of the fixed header part */
/* Reader limits (the writer stays far below them). */
#define KVTI_CHUNK_MAX_TOKENS 65536u
#define KVTI_CHUNK_MAX_LAYERS 4096u
#define KVTI_CHUNK_MAX_NS 4096u
#define KVTI_CHUNK_MAX_HEADER ((uint32_t)16 << 20)
/* chunk_tokens option: a power of two in this range (0 = chunking off). */
#define KVTI_CHUNK_TOKENS_MIN 16u
#define KVTI_CHUNK_TOKENS_MAX 4096u
/* A valid chunk_tokens: a power of two in [MIN, MAX] (option, chunk header,
 * chained-entry row or record, remote manifest). */
static inline int kvti_chunk_tokens_ok(uint64_t c) {
  return c >= KVTI_CHUNK_TOKENS_MIN && c <= KVTI_CHUNK_TOKENS_MAX &&
         (c & (c - 1)) == 0;
}
/* Data sections of at least this many bytes start 4096-aligned (O_DIRECT). */
#define KVTI_CHUNK_ALIGN_MIN ((uint64_t)1 << 20)

/* ---- keys ---- */

/* The namespace encoding stored in every chunk: u32 len | model_id | u32 len |
 * salt (NULL = ""). out receives a kvti_malloc'ed buffer. 0, KVT_EINVAL (too
 * long), KVT_ENOMEM. */
int kvti_chunk_ns_encode(uint8_t **out, size_t *len, const char *model_id,
                         const char *salt);
/* Seed of a chain: key_{-1} = SHA-256(namespace encoding | u64 LE layout
 * hash), so two namespaces, salts or KV layouts (an fp16 and a 4-bit spill of
 * the same tokens) never share a chunk. */
int kvti_chunk_seed(uint8_t out[32], const uint8_t *ns, size_t ns_len,
                    uint64_t layout_hash);
/* key = SHA-256(parent(32) | u32 LE n | n int32 LE tokens). 0 or KVT_ENOMEM. */
int kvti_chunk_key(uint8_t out[32], const uint8_t parent[32],
                   const int32_t *tokens, uint32_t n);

/* The lookup chain (not stored in files): ck_{-1} = XXH3-128 of the
 * namespace encoding, ck_i = XXH3-128 of the tokens seeded by ck_{i-1} and
 * n (docs/FORMAT.md section 10). It does not
 * depend on the layout (a lookup does not know it): chains of different
 * layouts share ck values and the index tells them apart. Collisions only cost
 * a miss: tokens are compared against the chunk file before anything is
 * served. */
typedef struct kvti_ck {
  uint64_t lo, hi;
} kvti_ck;
kvti_ck kvti_ck_seed(const uint8_t *ns, size_t ns_len);
kvti_ck kvti_ck_next(kvti_ck parent, const int32_t *tokens, uint32_t n);

/* ---- parsed header ---- */

typedef struct kvti_chunk_tensor {
  int32_t dtype;
  uint32_t ndim; /* 2..KVT_MAX_DIMS: axis -2 is the token axis */
  int64_t shape[KVT_MAX_DIMS];
  uint64_t off, nbytes; /* within the data section */
} kvti_chunk_tensor;

typedef struct kvti_chunk_layer {
  int32_t kind; /* KV, ROTATING_KV or QUANTIZED_KV */
  uint32_t layer_idx;
  int32_t bits, group_size; /* 0 unless quantized */
  uint32_t num_tensors;     /* 2 or 6 */
  kvti_chunk_tensor *tensors;
} kvti_chunk_layer;

typedef struct kvti_chunk_hdr {
  uint32_t version, header_bytes, block_size;
  uint8_t key[32], parent[32];
  uint64_t index; /* chunk i covers token positions [i*C, i*C + n) */
  uint32_t n_tokens, n_layers, ns_len, layout_bytes;
  uint32_t spill_layers; /* layers of the spill (n_layers of them chunked) */
  uint64_t data_bytes;
  uint8_t *ns;          /* ns_len bytes */
  int32_t *tokens;      /* n_tokens */
  uint8_t *layout;      /* layout_bytes: the raw descriptor */
  uint64_t layout_hash; /* XXH3-64 of the descriptor (a chain's identity) */
  uint64_t *blocks;     /* block list of the data section */
  uint64_t n_blocks;
  kvti_chunk_layer *layers;
  void *mem_; /* one allocation behind the arrays above */
} kvti_chunk_hdr;

/* Bytes of the fixed part a reader needs first to learn header_bytes. */
/* Parses header bytes buf[0..len) of a file of file_size bytes (len must be
 * the header_bytes the fixed part announces). Checks magic, version, bounds,
 * the header checksum, the key against parent + tokens, the descriptor (kinds,
 * dtypes, shapes = nbytes, quantized geometry, token axis == n_tokens,
 * tensors tiling the data section), the block count and file_size ==
 * header_bytes + data_bytes. Returns 0, KVT_ECORRUPT (message names what),
 * KVT_EUNSUPPORTED (other version), KVT_ENOMEM. */
int kvti_chunk_parse(kvti_chunk_hdr *h, const uint8_t *buf, size_t len,
                     uint64_t file_size, const char *what);
/* header_bytes announced by a fixed part (len >= KVTI_CHUNK_FIXED), or 0 with
 * the error set (KVT_ECORRUPT) when the fixed part is unusable. */
uint32_t kvti_chunk_header_bytes(const uint8_t *buf, size_t len,
                                 const char *what);
void kvti_chunk_hdr_free(kvti_chunk_hdr *h); /* accepts a zeroed h */

/* ---- writing ---- */

/* What to store: token rows [row0, row0 + n) of the layers listed in
 * layer_ids (the trimmable layers of a validated spill, in order). */
typedef struct kvti_chunk_src {
  const uint8_t *ns;
  size_t ns_len;
  const uint8_t *parent; /* 32 bytes */
  uint64_t index;
  const int32_t *tokens; /* the chunk's n tokens */
  uint32_t n;
  uint64_t row0;
  const kvt_layer *layers;
  const uint32_t *layer_ids;
  uint32_t n_layers;
  /* Layers of the whole spill (>= n_layers): part of the layout, so a chain
   * knows whether it holds every layer (a pure-KV chain, servable at any
   * chunk boundary) or needs the entry's other layers. */
  uint32_t spill_layers;
} kvti_chunk_src;

/* Token-axis geometry of a tensor (axis -2 = tokens): *outer = product of the
 * dimensions before it (batch x heads), *row = bytes of one token row. */
void kvti_chunk_tensor_geom(const kvt_tensor *t, uint64_t *outer,
                            uint64_t *row);

/* True when layer l can be cut into chunks of rows [0, rows): KV and quantized
 * KV (and rotating KV not wrapped: offset <= max_size, idx == offset) whose
 * tensors hold >= rows positions on axis -2 and whose offset >= rows. */
int kvti_chunk_layer_ok(const kvt_layer *l, uint64_t rows);

/* Exact file size of the chunk src describes (0 with the error set). */
uint64_t kvti_chunk_file_size(const kvti_chunk_src *src);
/* A chunk's memory_bytes: the RAM its rows take once loaded dense - a
 * quantized layer counted as its keys and values dequantized (packed bytes x
 * 8 / bits elements in the scales' dtype), every other layer as its tensors'
 * bytes. It is what the chain row records and what a promote of a prefix
 * reserves: the drop-in hands quantized layers over dequantized, as the
 * reference does, so the packed size would under-reserve; a native C promote
 * allocates the packed bytes, never more than this. 0 with the error set. */
uint64_t kvti_chunk_mem_bytes(const kvti_chunk_src *src);
/* The same figure from a parsed header (its layers' descriptors). */
uint64_t kvti_chunk_hdr_mem_bytes(const kvti_chunk_hdr *h);

/* XXH3-64 of the layout descriptor src's chunk would carry (the
 * kvti_chunk_hdr.layout_hash of the file). 0, KVT_EINVAL, KVT_ENOMEM. */
int kvti_chunk_layout_hash(uint64_t *out, const kvti_chunk_src *src);

typedef struct kvti_chunk_written {
  uint8_t key[32];
  uint64_t size;        /* file bytes */
  uint64_t mem_bytes;   /* kvti_chunk_mem_bytes (dense RAM bytes) */
  uint64_t layout_hash; /* as kvti_chunk_layout_hash */
} kvti_chunk_written;

/* Writes the chunk durably at path: tmp (O_EXCL; a stale one from a crash is
 * removed first) -> write -> fsync (do_fsync) -> rename -> fsync of the
 * directory (do_fsync). out (may be NULL) receives key, sizes and layout
 * hash. On failure nothing is left at tmp and path is untouched.
 * Returns 0, KVT_EINVAL, KVT_ENOMEM, KVT_ENOSPC, KVT_EIO. */
int kvti_chunk_write(const char *path, const char *tmp,
                     const kvti_chunk_src *src, uint32_t file_mode,
                     int do_fsync, kvti_chunk_written *out);
/* The same in directory descriptor dirfd (borrowed): name and tmp are file
 * names in it (no '/'), resolved there alone - created O_EXCL|O_NOFOLLOW,
 * renamed with renameat, removed with unlinkat, the directory fsynced by
 * its descriptor - so no link above or at either name is ever followed.
 * path (may be NULL: name) names the file in messages; tmp's message name is
 * made from path's directory. Same codes (KVT_EPERM: something at tmp that
 * cannot be replaced). */
int kvti_chunk_write_at(int dirfd, const char *name, const char *tmp,
                        const char *path, const kvti_chunk_src *src,
                        uint32_t file_mode, int do_fsync,
                        kvti_chunk_written *out);

/* The file part of kvti_chunk_write_at, into write group g (engine/fwriter.h,
 * borrowing dirfd until the group settles): tmp created O_EXCL|O_NOFOLLOW in
 * dirfd (a stale one removed first), the data after a reserved header, then
 * the header; closed, not synced, not renamed. The group's finish makes it
 * durable (or, on any failure of the group, removes it); the caller renames
 * it only after that. src's tensors must stay untouched until the group
 * finishes or aborts: aligned runs of them are written from where they lie
 * (kvti_fwriter_append_held). tpath (may be NULL: tmp) names it in messages.
 * Same codes as kvti_chunk_write_at. */
typedef struct kvti_wgroup kvti_wgroup;
int kvti_chunk_write_into(kvti_wgroup *g, int dirfd, const char *tmp,
                          const char *tpath, const kvti_chunk_src *src,
                          uint32_t file_mode, kvti_chunk_written *out);

/* ---- reading ---- */

/* Opens path (O_NOFOLLOW), reads and parses its header (a sparse file is
 * KVT_ECORRUPT before anything is allocated by its size); expect_key (may be
 * NULL) must equal the header's key, expect_layout (0 = any) the layout hash.
 * *fd stays open for kvti_chunk_read_data (the file may be unlinked
 * meanwhile). Returns 0, KVT_ENOTFOUND, KVT_ECORRUPT, KVT_EIO, KVT_ENOMEM. */
int kvti_chunk_open(int *fd, kvti_chunk_hdr *h, const char *path,
                    const uint8_t expect_key[32], uint64_t expect_layout);
/* The same over fd, a regular file its caller opened (kvti_openat from the
 * chunk's own directory). fd is taken over: *fdp on success, closed on
 * failure; path names it in messages. */
int kvti_chunk_open_fd(int fd, int *fdp, kvti_chunk_hdr *h, const char *path,
                       const uint8_t expect_key[32], uint64_t expect_layout);
/* Verifies every block of the data section through one buffer of at most
 * 4 MiB, whatever the file's size (checking a file nobody asked to read:
 * gc, the writer's sweep). Returns 0, KVT_ECORRUPT, KVT_EIO, KVT_ENOMEM. */
int kvti_chunk_verify_data(int fd, const kvti_chunk_hdr *h, const char *path);
/* Reads the whole data section into dst (h->data_bytes bytes), verifying every
 * block as it lands. Returns 0, KVT_ECORRUPT, KVT_EIO. */
int kvti_chunk_read_data(int fd, const kvti_chunk_hdr *h, void *dst,
                         const char *path);

#endif
