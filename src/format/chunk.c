/*
 * chunk.c - chunk files (chunk.h, docs/FORMAT.md section 10): the key chains,
 * the byte layout (a fixed 128-byte part, namespace, tokens, layout
 * descriptor, block list and header checksum, then the layer-major,
 * head-contiguous data section), its strict parser, the durable writer and the
 * verified data reader. The writer streams the chunk's rows of every layer
 * from the caller's tensors through the staged O_DIRECT writer
 * (engine/fwriter.h), which hashes each block as it passes, into <key>.tmp
 * past a reserved header; the header (with those block checksums) goes in
 * last, and the file is published with fsync + rename + directory fsync, so a
 * crash leaves either no chunk or a complete one (at worst a stale <key>.tmp,
 * removed when the chunk is written again or by gc).
 */
#include "format/chunk.h"
#include "base/error.h"
#include "base/hash.h"
#include "base/io.h"
#include "engine/fwriter.h"
#include "format/dtype.h"
#include "format/layer.h"
#include "format/le.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

/* ---- helpers ---- */

static uint64_t up(uint64_t v, uint64_t a) {
  return (v + a - 1) / a * a;
}

/* ---- keys ---- */

int kvti_chunk_ns_encode(uint8_t **out, size_t *len, const char *model_id,
                         const char *salt) {
  size_t a = model_id ? strlen(model_id) : 0, b = salt ? strlen(salt) : 0;
  if (a + b + 8 > KVTI_CHUNK_MAX_NS)
    return KVT_ERR(KVT_EINVAL, "model_id + cache_salt longer than %u bytes",
                   KVTI_CHUNK_MAX_NS - 8);
  uint8_t *p = kvti_malloc(a + b + 8);
  if (!p)
    return KVT_ERR_NOMEM();
  kvti_le_put32(p, (uint32_t)a);
  if (a)
    memcpy(p + 4, model_id, a);
  kvti_le_put32(p + 4 + a, (uint32_t)b);
  if (b)
    memcpy(p + 8 + a, salt, b);
  *out = p;
  *len = a + b + 8;
  return 0;
}

static int sha256_parts(uint8_t out[32], const void *a, size_t na,
                        const void *b, size_t nb, const void *c, size_t nc) {
  EVP_MD_CTX *ctx = EVP_MD_CTX_new();
  unsigned int mdlen = 0;
  int ok = ctx && EVP_DigestInit_ex(ctx, EVP_sha256(), NULL) &&
           EVP_DigestUpdate(ctx, a, na) &&
           (!nb || EVP_DigestUpdate(ctx, b, nb)) &&
           (!nc || EVP_DigestUpdate(ctx, c, nc)) &&
           EVP_DigestFinal_ex(ctx, out, &mdlen) && mdlen == 32;
  EVP_MD_CTX_free(ctx);
  return ok ? 0 : KVT_ERR(KVT_ENOMEM, "SHA-256 computation failed");
}

int kvti_chunk_seed(uint8_t out[32], const uint8_t *ns, size_t ns_len,
                    uint64_t layout_hash) {
  uint8_t lh[8];
  kvti_le_put64(lh, layout_hash);
  return sha256_parts(out, ns, ns_len, lh, 8, NULL, 0);
}

int kvti_chunk_key(uint8_t out[32], const uint8_t parent[32],
                   const int32_t *tokens, uint32_t n) {
  uint8_t len[4];
  kvti_le_put32(len, n);
  /* Tokens are int32 in native order; every supported platform is
   * little-endian (as tokens.bin, docs/FORMAT.md section 2). */
  return sha256_parts(out, parent, 32, len, 4, tokens, (size_t)n * 4);
}

kvti_ck kvti_ck_seed(const uint8_t *ns, size_t ns_len) {
  XXH128_hash_t h = XXH3_128bits(ns, ns_len);
  return (kvti_ck){h.low64, h.high64};
}

kvti_ck kvti_ck_next(kvti_ck parent, const int32_t *tokens, uint32_t n) {
  /* One-shot seeded hash (no streaming state: this runs once per chunk of
   * every lookup). The seed folds the parent's value and the length. */
  uint64_t seed = parent.lo ^ (parent.hi * 0x9e3779b97f4a7c15ull) ^ n;
  XXH128_hash_t h = XXH3_128bits_withSeed(tokens, (size_t)n * 4, seed);
  return (kvti_ck){h.low64, h.high64};
}

/* ---- layout descriptor ---- */

static uint32_t layer_tensors(int32_t kind) {
  return kind == KVT_LAYER_QUANTIZED_KV ? 6u : 2u;
}

/* Bytes one layer's descriptor takes for tensors of the given ndims. */
static uint64_t desc_layer_bytes(const kvt_layer *l) {
  uint64_t b = 20;
  for (uint32_t j = 0; j < l->num_tensors; j++)
    b += 8 + 8ull * l->tensors[j].ndim + 16;
  return b;
}

int kvti_chunk_layer_ok(const kvt_layer *l, uint64_t rows) {
  if (l->kind != KVT_LAYER_KV && l->kind != KVT_LAYER_ROTATING_KV &&
      l->kind != KVT_LAYER_QUANTIZED_KV)
    return 0;
  if (l->num_tensors != layer_tensors(l->kind))
    return 0;
  /* Token i is row i: only rows below offset are valid KV (a quantized layer
   * without an offset holds every row, as compat mode reads it). */
  if (l->offset == KVT_ABSENT ? l->kind != KVT_LAYER_QUANTIZED_KV
                              : l->offset < 0 || (uint64_t)l->offset < rows)
    return 0;
  if (l->kind == KVT_LAYER_ROTATING_KV) {
    /* Wrapped rotating caches hold rows out of token order: not cuttable. */
    if (l->max_size != KVT_ABSENT && l->offset > l->max_size)
      return 0;
    if (l->idx != KVT_ABSENT && l->idx != l->offset)
      return 0;
  }
  for (uint32_t j = 0; j < l->num_tensors; j++) {
    const kvt_tensor *t = &l->tensors[j];
    if (t->ndim < 2 || t->shape[t->ndim - 2] < 0 ||
        (uint64_t)t->shape[t->ndim - 2] < rows)
      return 0;
  }
  return 1;
}

void kvti_chunk_tensor_geom(const kvt_tensor *t, uint64_t *outer,
                            uint64_t *row) {
  uint64_t o = 1, r = kvt_dtype_size((kvt_dtype)t->dtype);
  for (uint32_t d = 0; d + 2 < t->ndim; d++)
    o *= (uint64_t)t->shape[d];
  r *= (uint64_t)t->shape[t->ndim - 1];
  *outer = o;
  *row = r;
}

typedef struct plan {
  uint64_t layout_bytes, data_bytes, n_blocks, header_bytes, sum_pos;
  uint32_t ns_pad;
} plan;

static int make_plan(plan *p, const kvti_chunk_src *s) {
  if (!s || !s->parent || (!s->ns && s->ns_len) || !s->tokens || s->n == 0 ||
      s->n > KVTI_CHUNK_MAX_TOKENS || s->ns_len > KVTI_CHUNK_MAX_NS ||
      s->n_layers == 0 || s->n_layers > KVTI_CHUNK_MAX_LAYERS || !s->layers ||
      !s->layer_ids)
    return KVT_ERR(KVT_EINVAL, "chunk: invalid source");
  memset(p, 0, sizeof *p);
  if (s->spill_layers < s->n_layers || s->spill_layers > KVTI_MAX_LAYERS)
    return KVT_ERR(KVT_EINVAL, "chunk: spill_layers %u < %u chunked layers",
                   s->spill_layers, s->n_layers);
  p->layout_bytes = 4;
  for (uint32_t i = 0; i < s->n_layers; i++) {
    const kvt_layer *l = &s->layers[s->layer_ids[i]];
    if ((i && s->layer_ids[i] <= s->layer_ids[i - 1]) ||
        s->layer_ids[i] >= s->spill_layers)
      return KVT_ERR(KVT_EINVAL, "chunk: layer ids must increase");
    if (!kvti_chunk_layer_ok(l, s->row0 + s->n))
      return KVT_ERR(KVT_EINVAL,
                     "chunk: layer %u cannot be cut at rows [%llu, %llu)",
                     s->layer_ids[i], (unsigned long long)s->row0,
                     (unsigned long long)(s->row0 + s->n));
    p->layout_bytes += desc_layer_bytes(l);
    for (uint32_t j = 0; j < l->num_tensors; j++) {
      uint64_t outer, row;
      kvti_chunk_tensor_geom(&l->tensors[j], &outer, &row);
      p->data_bytes += outer * row * s->n;
    }
  }
  p->n_blocks = kvti_blk_count(p->data_bytes, KVTI_BLK_DEFAULT);
  p->ns_pad = (uint32_t)up(s->ns_len, 4);
  p->sum_pos = KVTI_CHUNK_FIXED + p->ns_pad + 4ull * s->n + p->layout_bytes +
               8 * p->n_blocks;
  p->header_bytes =
      up(p->sum_pos + 8, p->data_bytes >= KVTI_CHUNK_ALIGN_MIN ? 4096 : 64);
  return 0;
}

uint64_t kvti_chunk_file_size(const kvti_chunk_src *src) {
  plan p;
  if (make_plan(&p, src) != 0)
    return 0;
  return p.header_bytes + p.data_bytes;
}

/* Dense bytes of one layer's tensor j holding nb bytes in the chunk: for a
 * quantized layer the packed tensors (0 and 3) count as the values they
 * decode to, in the dtype of the scales beside them (1 and 4), and the scales
 * and biases (folded into those values) count nothing. */
static uint64_t dense_part(int32_t kind, int32_t bits, uint32_t num_tensors,
                           uint32_t j, uint64_t nb, int32_t scales_dtype) {
  if (kind != KVT_LAYER_QUANTIZED_KV || num_tensors != 6 || bits <= 0)
    return nb;
  if (j % 3 != 0)
    return 0;
  return nb * 8 / (uint64_t)bits * kvt_dtype_size((kvt_dtype)scales_dtype);
}

uint64_t kvti_chunk_mem_bytes(const kvti_chunk_src *src) {
  plan p;
  if (make_plan(&p, src) != 0)
    return 0;
  uint64_t mem = 0;
  for (uint32_t i = 0; i < src->n_layers; i++) {
    const kvt_layer *l = &src->layers[src->layer_ids[i]];
    for (uint32_t j = 0; j < l->num_tensors; j++) {
      uint64_t outer, row;
      kvti_chunk_tensor_geom(&l->tensors[j], &outer, &row);
      int32_t sd =
          j + 1 < l->num_tensors ? (int32_t)l->tensors[j + 1].dtype : 0;
      mem += dense_part((int32_t)l->kind, l->bits, l->num_tensors, j,
                        outer * row * src->n, sd);
    }
  }
  return mem;
}

uint64_t kvti_chunk_hdr_mem_bytes(const kvti_chunk_hdr *h) {
  uint64_t mem = 0;
  for (uint32_t i = 0; i < h->n_layers; i++) {
    const kvti_chunk_layer *L = &h->layers[i];
    for (uint32_t j = 0; j < L->num_tensors; j++) {
      int32_t sd =
          j + 1 < L->num_tensors ? (int32_t)L->tensors[j + 1].dtype : 0;
      mem += dense_part(L->kind, L->bits, L->num_tensors, j,
                        L->tensors[j].nbytes, sd);
    }
  }
  return mem;
}

/* Writes the layout descriptor of s at d (p->layout_bytes bytes); with data
 * non-NULL also gathers the rows into the data section. */
static void put_desc(uint8_t *d, const kvti_chunk_src *s) {
  uint64_t off = 0;
  kvti_le_put32(d, s->spill_layers);
  d += 4;
  for (uint32_t i = 0; i < s->n_layers; i++) {
    const kvt_layer *l = &s->layers[s->layer_ids[i]];
    kvti_le_put32(d, (uint32_t)l->kind);
    kvti_le_put32(d + 4, s->layer_ids[i]);
    kvti_le_put32(d + 8,
                  l->kind == KVT_LAYER_QUANTIZED_KV ? (uint32_t)l->bits : 0);
    kvti_le_put32(d + 12, l->kind == KVT_LAYER_QUANTIZED_KV
                              ? (uint32_t)l->group_size
                              : 0);
    kvti_le_put32(d + 16, l->num_tensors);
    d += 20;
    for (uint32_t j = 0; j < l->num_tensors; j++) {
      const kvt_tensor *t = &l->tensors[j];
      uint64_t outer, row;
      kvti_chunk_tensor_geom(t, &outer, &row);
      uint64_t nb = outer * row * s->n;
      kvti_le_put32(d, (uint32_t)t->dtype);
      kvti_le_put32(d + 4, t->ndim);
      d += 8;
      for (uint32_t k = 0; k < t->ndim; k++, d += 8)
        kvti_le_put64(d, k == t->ndim - 2 ? s->n : (uint64_t)t->shape[k]);
      kvti_le_put64(d, off);
      kvti_le_put64(d + 8, nb);
      d += 16;
      /* Head-contiguous: for every outer index (batch x head) the chunk's n
       * rows are one extent (for_pieces), so promote copies one extent per
       * head. */
      off += nb;
    }
  }
}

int kvti_chunk_layout_hash(uint64_t *out, const kvti_chunk_src *src) {
  plan p;
  int rc = make_plan(&p, src);
  if (rc)
    return rc;
  uint8_t *d = kvti_malloc((size_t)p.layout_bytes);
  if (!d)
    return KVT_ERR_NOMEM();
  put_desc(d, src);
  *out = XXH3_64bits(d, (size_t)p.layout_bytes);
  kvti_free(d);
  return 0;
}

/* Calls fn for every extent of the chunk's data section in file order:
 * layer-major, then tensor order, then one extent of n rows per outer index
 * (batch x head) - the rows [row0, row0 + n) of that head in the caller's
 * tensor, contiguous there too. The data section is exactly these extents
 * concatenated, so the writer (which hashes as the bytes pass) streams from the
 * caller's tensors with no gathering copy. */
typedef int (*piece_fn)(void *ctx, const void *p, size_t n);
static int for_pieces(const kvti_chunk_src *s, piece_fn fn, void *ctx) {
  for (uint32_t i = 0; i < s->n_layers; i++) {
    const kvt_layer *l = &s->layers[s->layer_ids[i]];
    for (uint32_t j = 0; j < l->num_tensors; j++) {
      const kvt_tensor *t = &l->tensors[j];
      uint64_t outer, row;
      kvti_chunk_tensor_geom(t, &outer, &row);
      uint64_t T = (uint64_t)t->shape[t->ndim - 2];
      const uint8_t *src = t->data;
      for (uint64_t o = 0; o < outer && row; o++) {
        int rc = fn(ctx, src + (o * T + s->row0) * row, (size_t)(row * s->n));
        if (rc)
          return rc;
      }
    }
  }
  return 0;
}

/* The caller's tensors stay untouched until the group finishes (see
 * kvti_chunk_write_into), so the writer may write runs of them from where they
 * lie instead of copying them. */
static int piece_write(void *ctx, const void *p, size_t n) {
  return kvti_fwriter_append_held(ctx, p, n);
}

/* Fills hdr (header_bytes, zeroed) with the chunk's header except its block
 * list and header checksum (head_seal adds them once the data's blocks are
 * hashed, as the data streams to the file). */
static int head_build(uint8_t *hdr, const plan *p, const kvti_chunk_src *s,
                      kvti_chunk_written *w) {
  int rc = kvti_chunk_key(w->key, s->parent, s->tokens, s->n);
  if (rc)
    return rc;
  uint8_t *lay = hdr + KVTI_CHUNK_FIXED + p->ns_pad + 4ull * s->n;
  put_desc(lay, s);
  w->layout_hash = XXH3_64bits(lay, (size_t)p->layout_bytes);
  w->mem_bytes = kvti_chunk_mem_bytes(s);
  w->size = p->header_bytes + p->data_bytes;
  memcpy(hdr, KVTI_CHUNK_MAGIC, 8);
  kvti_le_put32(hdr + 8, KVTI_CHUNK_VERSION);
  kvti_le_put32(hdr + 12, (uint32_t)p->header_bytes);
  kvti_le_put32(hdr + 16, (uint32_t)KVTI_BLK_DEFAULT);
  kvti_le_put32(hdr + 20, 0);
  memcpy(hdr + 24, w->key, 32);
  memcpy(hdr + 56, s->parent, 32);
  kvti_le_put64(hdr + 88, s->index);
  kvti_le_put32(hdr + 96, s->n);
  kvti_le_put32(hdr + 100, s->n_layers);
  kvti_le_put32(hdr + 104, (uint32_t)s->ns_len);
  kvti_le_put32(hdr + 108, (uint32_t)p->layout_bytes);
  kvti_le_put64(hdr + 112, p->data_bytes);
  kvti_le_put64(hdr + 120, 0);
  if (s->ns_len)
    memcpy(hdr + KVTI_CHUNK_FIXED, s->ns, s->ns_len);
  uint8_t *tk = hdr + KVTI_CHUNK_FIXED + p->ns_pad;
  for (uint32_t i = 0; i < s->n; i++)
    kvti_le_put32(tk + 4ull * i, (uint32_t)s->tokens[i]);
  return 0;
}

/* Completes hdr with the block list of the data bh hashed (finalized here) and
 * the header checksum. */
static int head_seal(uint8_t *hdr, const plan *p, kvti_blkhash *bh) {
  int rc = kvti_blkhash_final(bh, NULL);
  if (rc)
    return rc;
  size_t nl;
  const uint64_t *list = kvti_blkhash_list(bh, &nl);
  if (nl != p->n_blocks)
    return KVT_ERR(KVT_EIO, "chunk: block count mismatch");
  uint8_t *d = hdr + p->sum_pos - 8 * p->n_blocks;
  for (size_t k = 0; k < nl; k++, d += 8)
    kvti_le_put64(d, list[k]);
  kvti_le_put64(hdr + p->sum_pos, XXH3_64bits(hdr, p->sum_pos));
  return 0;
}

int kvti_chunk_write_into(kvti_wgroup *g, int dirfd, const char *tmp,
                          const char *tpath, const kvti_chunk_src *src,
                          uint32_t file_mode, kvti_chunk_written *out) {
  if (!g || dirfd < 0 || !tmp || strchr(tmp, '/'))
    return KVT_ERR(KVT_EINVAL, "chunk write: bad directory or name");
  if (!tpath)
    tpath = tmp;
  plan p;
  int rc = make_plan(&p, src);
  if (rc)
    return rc;
  uint64_t total = p.header_bytes + p.data_bytes;
  if (total > SIZE_MAX / 2)
    return KVT_ERR(KVT_ETOOBIG, "chunk too large");
  uint8_t *hdr = kvti_calloc(1, (size_t)p.header_bytes);
  if (!hdr)
    return KVT_ERR_NOMEM();
  kvti_chunk_written w;
  kvti_blkhash *bh = NULL;
  rc = head_build(hdr, &p, src, &w);
  if (rc == 0)
    rc = kvti_blkhash_new(&bh, KVTI_BLK_DEFAULT, p.data_bytes);
  /* The file goes through the staged writer (engine/fwriter.h): the tensors'
   * rows are hashed once and written with large O_DIRECT writes, several in
   * flight - straight from the tensors where their runs are aligned and long
   * (a one-chunk entry's tensor is one run), else copied into aligned staging
   * buffers first (the page cache where O_DIRECT is unavailable, and for the
   * last partial block); the file
   * is preallocated to its exact size. The header, which holds the block
   * checksums, is written last into the space reserved for it: one pass over
   * the data, not a hashing pass before the writes (~5 ms of a 32 MiB chunk's
   * ~75 ms). Every name is resolved in dirfd alone (O_NOFOLLOW, O_EXCL): a
   * link planted at tmp is removed as a stale tmp (never followed: the create
   * is O_EXCL), and nothing is written outside dirfd whatever links lie above
   * it. */
  kvti_fwriter_opts fo = KVTI_FWRITER_OPTS_INIT;
  fo.blocks = bh; /* per block; the whole-file hash is then off */
  fo.head_reserve = p.header_bytes;
  fo.size_hint = total;
  fo.file_mode = file_mode;
  fo.excl = 1;
  kvti_fwriter *fw = NULL;
  if (rc == 0 && kvti_wgroup_file_at(&fw, g, dirfd, tmp, tpath, &fo) != 0) {
    /* A stale tmp left by a crash: remove it and try once more (a refused
     * create leaves the group as it was). */
    kvt_clear_error();
    kvti_unlinkat(dirfd, tmp, tpath);
    rc = kvti_wgroup_file_at(&fw, g, dirfd, tmp, tpath, &fo);
  }
  if (rc == 0)
    rc = for_pieces(src, piece_write, fw);
  if (rc == 0)
    rc = head_seal(hdr, &p, bh);
  if (rc == 0)
    rc = kvti_fwriter_put_head(fw, hdr, (size_t)p.header_bytes);
  uint64_t size = 0;
  if (rc == 0)
    rc = kvti_fwriter_close(fw, &size, NULL);
  if (rc == 0 && size != total)
    rc = KVT_ERR(KVT_EIO, "%s: wrote %llu of %llu bytes", tpath,
                 (unsigned long long)size, (unsigned long long)total);
  kvti_blkhash_free(bh);
  kvti_free(hdr);
  if (rc == 0 && out)
    *out = w;
  return rc;
}

int kvti_chunk_write_at(int dirfd, const char *name, const char *tmp,
                        const char *path, const kvti_chunk_src *src,
                        uint32_t file_mode, int do_fsync,
                        kvti_chunk_written *out) {
  if (dirfd < 0 || !name || !tmp || strchr(name, '/') || strchr(tmp, '/'))
    return KVT_ERR(KVT_EINVAL, "chunk write: bad directory or name");
  if (!path)
    path = name;
  char tpath[4200];
  snprintf(tpath, sizeof tpath, "%.*s%s",
           (int)(strrchr(path, '/') ? strrchr(path, '/') + 1 - path : 0), path,
           tmp);
  /* A group of one: its finish fsyncs the file (header and data) before the
   * rename, so no reader ever sees the reserved space unfilled; a failure
   * removes tmp. */
  kvti_wgroup *g = NULL;
  int rc = kvti_wgroup_open(&g, 0, NULL, do_fsync);
  if (rc)
    return rc;
  kvti_chunk_written w;
  rc = kvti_chunk_write_into(g, dirfd, tmp, tpath, src, file_mode, &w);
  if (rc == 0)
    rc = kvti_wgroup_finish(g);
  else
    kvti_wgroup_abort(g);
  if (rc == 0 &&
      (rc = kvti_renameat(dirfd, tmp, dirfd, name, tpath, path)) != 0) {
    kvti_error_state es;
    kvti_error_state_capture(&es, rc);
    kvti_unlinkat(dirfd, tmp, tpath);
    kvti_error_state_restore(&es);
  }
  if (rc == 0 && do_fsync && (rc = kvti_fsync(dirfd, path)) != 0) {
    kvti_error_state es;
    kvti_error_state_capture(&es, rc);
    kvti_unlinkat(dirfd, name, path); /* not durable: never to be indexed */
    kvti_error_state_restore(&es);
  }
  if (rc == 0 && out)
    *out = w;
  return rc;
}

int kvti_chunk_write(const char *path, const char *tmp,
                     const kvti_chunk_src *src, uint32_t file_mode,
                     int do_fsync, kvti_chunk_written *out) {
  const char *sl = strrchr(path, '/'), *tsl = strrchr(tmp, '/');
  size_t dn = sl ? (size_t)(sl - path) : 0;
  char dir[4096];
  if (dn >= sizeof dir)
    return KVT_ERR(KVT_ERANGE, "chunk path too long");
  if ((tsl ? (size_t)(tsl - tmp) : 0) != dn || strncmp(path, tmp, dn) != 0)
    return KVT_ERR(KVT_EINVAL, "chunk write: %s and %s in two directories", tmp,
                   path);
  snprintf(dir, sizeof dir, "%.*s", (int)(sl ? (dn ? dn : 1) : 1),
           sl ? path : ".");
  int dfd = kvti_open(dir, O_RDONLY | O_DIRECTORY, 0);
  if (dfd < 0)
    return dfd;
  int rc = kvti_chunk_write_at(dfd, sl ? sl + 1 : path, tsl ? tsl + 1 : tmp,
                               path, src, file_mode, do_fsync, out);
  kvti_close(dfd);
  return rc;
}

/* ---- parsing ---- */

#define BAD(...) KVT_ERR(KVT_ECORRUPT, __VA_ARGS__)

uint32_t kvti_chunk_header_bytes(const uint8_t *buf, size_t len,
                                 const char *what) {
  if (len < KVTI_CHUNK_FIXED || memcmp(buf, KVTI_CHUNK_MAGIC, 8) != 0) {
    BAD("%s: not a kvtier chunk (bad magic or truncated)", what);
    return 0;
  }
  uint32_t hb = kvti_le_get32(buf + 12);
  if (hb < KVTI_CHUNK_FIXED + 8 || hb > KVTI_CHUNK_MAX_HEADER || hb % 64) {
    BAD("%s: header length %u out of range", what, hb);
    return 0;
  }
  return hb;
}

void kvti_chunk_hdr_free(kvti_chunk_hdr *h) {
  if (!h)
    return;
  kvti_free(h->mem_);
  memset(h, 0, sizeof *h);
}

int kvti_chunk_parse(kvti_chunk_hdr *h, const uint8_t *buf, size_t len,
                     uint64_t file_size, const char *what) {
  memset(h, 0, sizeof *h);
  uint32_t hb = kvti_chunk_header_bytes(buf, len, what);
  if (!hb)
    return KVT_ECORRUPT;
  if (hb != len)
    return BAD("%s: header length %u, %zu bytes given", what, hb, len);
  h->version = kvti_le_get32(buf + 8);
  if (h->version != KVTI_CHUNK_VERSION) {
    /* Another version, or ours with its version field damaged? The header
     * checksum covers the field: when the header verifies with the field
     * read as ours, this file was written in our format and damaged since
     * (KVT_ECORRUPT: repairable, quarantined), not written by another
     * kvtier (KVT_EUNSUPPORTED: left alone). */
    uint32_t v = h->version;
    uint8_t *copy = kvti_malloc(len);
    if (!copy)
      return KVT_ERR_NOMEM();
    memcpy(copy, buf, len);
    kvti_le_put32(copy + 8, KVTI_CHUNK_VERSION);
    kvti_error_state es;
    kvti_error_state_capture(&es, 0);
    int ours = kvti_chunk_parse(h, copy, len, file_size, what) == 0;
    kvti_chunk_hdr_free(h);
    kvti_free(copy);
    kvti_error_state_restore(&es);
    if (ours)
      return BAD("%s: chunk version field damaged (%u; the header verifies "
                 "as version %u)",
                 what, v, KVTI_CHUNK_VERSION);
    return KVT_ERR(KVT_EUNSUPPORTED, "%s: chunk version %u unsupported", what,
                   v);
  }
  h->header_bytes = hb;
  h->block_size = kvti_le_get32(buf + 16);
  if (!kvti_blk_size_ok(h->block_size))
    return BAD("%s: bad block size %u", what, h->block_size);
  if (kvti_le_get32(buf + 20) != 0 || kvti_le_get64(buf + 120) != 0)
    return BAD("%s: unknown flags", what);
  memcpy(h->key, buf + 24, 32);
  memcpy(h->parent, buf + 56, 32);
  h->index = kvti_le_get64(buf + 88);
  h->n_tokens = kvti_le_get32(buf + 96);
  h->n_layers = kvti_le_get32(buf + 100);
  h->ns_len = kvti_le_get32(buf + 104);
  h->layout_bytes = kvti_le_get32(buf + 108);
  h->data_bytes = kvti_le_get64(buf + 112);
  if (h->n_tokens == 0 || h->n_tokens > KVTI_CHUNK_MAX_TOKENS ||
      h->n_layers == 0 || h->n_layers > KVTI_CHUNK_MAX_LAYERS ||
      h->ns_len > KVTI_CHUNK_MAX_NS || h->layout_bytes > hb ||
      h->data_bytes > file_size)
    return BAD("%s: header counts out of range", what);
  if (file_size != (uint64_t)hb + h->data_bytes)
    return BAD("%s: file size %llu != header %u + data %llu", what,
               (unsigned long long)file_size, hb,
               (unsigned long long)h->data_bytes);
  h->n_blocks = kvti_blk_count(h->data_bytes, h->block_size);
  uint64_t pos_tok = KVTI_CHUNK_FIXED + up(h->ns_len, 4);
  uint64_t pos_lay = pos_tok + 4ull * h->n_tokens;
  uint64_t pos_blk = pos_lay + h->layout_bytes;
  uint64_t pos_sum = pos_blk + 8 * h->n_blocks;
  if (pos_sum + 8 > hb)
    return BAD("%s: header sections overflow its length", what);
  if (kvti_le_get64(buf + pos_sum) != XXH3_64bits(buf, pos_sum))
    return BAD("%s: header checksum mismatch", what);
  for (uint64_t i = pos_sum + 8; i < hb; i++)
    if (buf[i])
      return BAD("%s: non-zero header padding", what);
  for (uint64_t i = KVTI_CHUNK_FIXED + h->ns_len; i < pos_tok; i++)
    if (buf[i])
      return BAD("%s: non-zero namespace padding", what);
  /* Tensors per layer are bounded by the descriptor's size (>= 40 bytes). */
  uint64_t max_t = h->layout_bytes / 40 + 1;
  size_t need = (size_t)h->ns_len + 1 + 4ull * h->n_tokens + h->layout_bytes +
                8 * h->n_blocks + sizeof(kvti_chunk_layer) * h->n_layers +
                sizeof(kvti_chunk_tensor) * max_t + 64;
  uint8_t *m = kvti_calloc(1, need);
  if (!m)
    return KVT_ERR_NOMEM();
  h->mem_ = m;
  h->layers = (kvti_chunk_layer *)m;
  m += sizeof(kvti_chunk_layer) * h->n_layers;
  kvti_chunk_tensor *tpool = (kvti_chunk_tensor *)m;
  m += sizeof(kvti_chunk_tensor) * max_t;
  h->blocks = (uint64_t *)m;
  m += 8 * h->n_blocks;
  h->tokens = (int32_t *)m;
  m += 4ull * h->n_tokens;
  h->ns = m;
  m += h->ns_len + 1;
  h->layout = m;
  memcpy(h->ns, buf + KVTI_CHUNK_FIXED, h->ns_len);
  for (uint32_t i = 0; i < h->n_tokens; i++)
    h->tokens[i] = (int32_t)kvti_le_get32(buf + pos_tok + 4ull * i);
  memcpy(h->layout, buf + pos_lay, h->layout_bytes);
  for (uint64_t k = 0; k < h->n_blocks; k++)
    h->blocks[k] = kvti_le_get64(buf + pos_blk + 8 * k);
  h->layout_hash = XXH3_64bits(buf + pos_lay, h->layout_bytes);
  int rc = 0;
  uint8_t key[32];
  if ((rc = kvti_chunk_key(key, h->parent, h->tokens, h->n_tokens)) != 0)
    goto fail;
  if (memcmp(key, h->key, 32) != 0) {
    rc = BAD("%s: key does not match parent + tokens", what);
    goto fail;
  }
  /* The descriptor. */
  const uint8_t *d = h->layout, *end = h->layout + h->layout_bytes;
  uint64_t off = 0, used_t = 0;
  if (h->layout_bytes < 4) {
    rc = BAD("%s: layout descriptor truncated", what);
    goto fail;
  }
  h->spill_layers = kvti_le_get32(d);
  d += 4;
  if (h->spill_layers < h->n_layers || h->spill_layers > KVTI_MAX_LAYERS) {
    rc = BAD("%s: spill layer count %u out of range", what, h->spill_layers);
    goto fail;
  }
  for (uint32_t i = 0; i < h->n_layers; i++) {
    kvti_chunk_layer *L = &h->layers[i];
    if (end - d < 20) {
      rc = BAD("%s: layout descriptor truncated", what);
      goto fail;
    }
    L->kind = (int32_t)kvti_le_get32(d);
    L->layer_idx = kvti_le_get32(d + 4);
    L->bits = (int32_t)kvti_le_get32(d + 8);
    L->group_size = (int32_t)kvti_le_get32(d + 12);
    L->num_tensors = kvti_le_get32(d + 16);
    d += 20;
    if ((L->kind != KVT_LAYER_KV && L->kind != KVT_LAYER_ROTATING_KV &&
         L->kind != KVT_LAYER_QUANTIZED_KV) ||
        L->num_tensors != layer_tensors(L->kind) ||
        (i && L->layer_idx <= h->layers[i - 1].layer_idx) ||
        L->layer_idx >= h->spill_layers ||
        (L->kind != KVT_LAYER_QUANTIZED_KV && (L->bits || L->group_size)) ||
        (L->kind == KVT_LAYER_QUANTIZED_KV &&
         (L->bits <= 0 || L->group_size <= 0 || L->group_size > 65536))) {
      rc = BAD("%s: layer %u: bad kind/attributes", what, i);
      goto fail;
    }
    if (used_t + L->num_tensors > max_t) {
      rc = BAD("%s: layout descriptor truncated", what);
      goto fail;
    }
    L->tensors = tpool + used_t;
    used_t += L->num_tensors;
    kvt_tensor tv[6];
    for (uint32_t j = 0; j < L->num_tensors; j++) {
      kvti_chunk_tensor *t = &L->tensors[j];
      if (end - d < 8) {
        rc = BAD("%s: layout descriptor truncated", what);
        goto fail;
      }
      t->dtype = (int32_t)kvti_le_get32(d);
      t->ndim = kvti_le_get32(d + 4);
      d += 8;
      if (t->ndim < 2 || t->ndim > KVT_MAX_DIMS ||
          (uint64_t)(end - d) < 8ull * t->ndim + 16 ||
          kvt_dtype_size((kvt_dtype)t->dtype) == 0) {
        rc = BAD("%s: layer %u tensor %u: bad dtype/ndim", what, i, j);
        goto fail;
      }
      for (uint32_t k = 0; k < t->ndim; k++, d += 8) {
        uint64_t v = kvti_le_get64(d);
        if (v > ((uint64_t)1 << 40)) {
          rc = BAD("%s: layer %u tensor %u: dimension too large", what, i, j);
          goto fail;
        }
        t->shape[k] = (int64_t)v;
      }
      t->off = kvti_le_get64(d);
      t->nbytes = kvti_le_get64(d + 8);
      d += 16;
      uint64_t nb;
      if (t->shape[t->ndim - 2] != (int64_t)h->n_tokens ||
          kvti_tensor_nbytes(&nb, (kvt_dtype)t->dtype, t->ndim, t->shape) ||
          nb != t->nbytes || t->off != off || nb > h->data_bytes - off) {
        rc = BAD("%s: layer %u tensor %u: shape/offset inconsistent", what, i,
                 j);
        goto fail;
      }
      off += nb;
      tv[j] = (kvt_tensor){.dtype = t->dtype, .ndim = t->ndim, .nbytes = nb};
      memcpy(tv[j].shape, t->shape, sizeof t->shape);
    }
    /* Same rules as a caller's layer (quantized geometry included). */
    kvt_layer lv;
    /* Rotating attributes live in the entry, not in the chunk: the tensors
     * obey the plain KV rules. */
    kvt_layer_init(&lv, L->kind == KVT_LAYER_QUANTIZED_KV
                            ? KVT_LAYER_QUANTIZED_KV
                            : KVT_LAYER_KV);
    lv.num_tensors = L->num_tensors;
    lv.tensors = tv;
    lv.offset = h->n_tokens;
    lv.bits = L->bits;
    lv.group_size = L->group_size;
    if (kvti_layer_validate(&lv, L->layer_idx, 0) != 0) {
      char why[256];
      snprintf(why, sizeof why, "%s", kvt_last_error());
      rc = BAD("%s: chunk layer %u: %s", what, i, why);
      goto fail;
    }
  }
  if (d != end || off != h->data_bytes) {
    rc = BAD("%s: layout descriptor does not tile the data section", what);
    goto fail;
  }
  return 0;
fail:
  kvti_chunk_hdr_free(h);
  return rc;
}

/* ---- reading ---- */

int kvti_chunk_open(int *fdp, kvti_chunk_hdr *h, const char *path,
                    const uint8_t expect_key[32], uint64_t expect_layout) {
  memset(h, 0, sizeof *h);
  int fd = kvti_open(path, O_RDONLY, 0);
  if (fd < 0)
    return fd;
  return kvti_chunk_open_fd(fd, fdp, h, path, expect_key, expect_layout);
}

int kvti_chunk_open_fd(int fd, int *fdp, kvti_chunk_hdr *h, const char *path,
                       const uint8_t expect_key[32], uint64_t expect_layout) {
  memset(h, 0, sizeof *h);
  struct stat st;
  uint8_t fixed[KVTI_CHUNK_FIXED], *buf = NULL;
  int rc = 0;
  if (kvti_io->fstat(fd, &st) != 0)
    rc = KVT_ERR_OS(errno, "fstat %s", path);
  else if (!S_ISREG(st.st_mode))
    rc = BAD("%s: not a regular file", path);
  else if ((uint64_t)st.st_size < KVTI_CHUNK_FIXED)
    rc = BAD("%s: truncated chunk", path);
  else if (kvti_file_sparse(&st))
    /* kvtier writes every byte of a chunk: a file that is mostly holes was
     * planted to make a reader allocate by its apparent size. */
    rc = BAD("%s: sparse chunk file (%llu bytes, %llu allocated)", path,
             (unsigned long long)st.st_size,
             (unsigned long long)st.st_blocks * 512u);
  if (rc == 0)
    rc = kvti_pread_all(fd, fixed, sizeof fixed, 0, path);
  uint32_t hb = 0;
  if (rc == 0 && !(hb = kvti_chunk_header_bytes(fixed, sizeof fixed, path)))
    rc = KVT_ECORRUPT;
  if (rc == 0 && hb > (uint64_t)st.st_size)
    rc = BAD("%s: truncated chunk header", path);
  if (rc == 0 && !(buf = kvti_malloc(hb)))
    rc = KVT_ERR_NOMEM();
  if (rc == 0)
    rc = kvti_pread_all(fd, buf, hb, 0, path);
  if (rc == 0)
    rc = kvti_chunk_parse(h, buf, hb, (uint64_t)st.st_size, path);
  kvti_free(buf);
  if (rc == 0 && expect_key && memcmp(expect_key, h->key, 32) != 0)
    rc = BAD("%s: chunk key differs from its name", path);
  if (rc == 0 && expect_layout && expect_layout != h->layout_hash)
    rc = BAD("%s: chunk layout differs from the chain's", path);
  if (rc) {
    kvti_chunk_hdr_free(h);
    kvti_close(fd);
    return rc;
  }
  *fdp = fd;
  return 0;
}

int kvti_chunk_verify_data(int fd, const kvti_chunk_hdr *h, const char *path) {
  const size_t piece = (size_t)4 << 20;
  size_t cap = h->data_bytes < piece ? (size_t)h->data_bytes : piece;
  uint8_t *buf = kvti_malloc(cap ? cap : 1);
  if (!buf)
    return KVT_ERR_NOMEM();
  kvti_blkhash *bh = NULL;
  int rc = kvti_blkhash_new(&bh, h->block_size, 0);
  if (rc == 0)
    kvti_blkhash_expect(bh, h->blocks, (size_t)h->n_blocks, path);
  for (uint64_t off = 0; rc == 0 && off < h->data_bytes; off += cap) {
    size_t n = (size_t)(h->data_bytes - off < cap ? h->data_bytes - off : cap);
    rc = kvti_pread_all(fd, buf, n, h->header_bytes + off, path);
    if (rc == 0)
      rc = kvti_blkhash_update(bh, buf, n);
  }
  if (rc == 0)
    rc = kvti_blkhash_final(bh, NULL);
  kvti_blkhash_free(bh);
  kvti_free(buf);
  return rc;
}

int kvti_chunk_read_data(int fd, const kvti_chunk_hdr *h, void *dst,
                         const char *path) {
  kvti_blkhash *bh = NULL;
  int rc = kvti_blkhash_new(&bh, h->block_size, 0);
  if (rc)
    return rc;
  kvti_blkhash_expect(bh, h->blocks, (size_t)h->n_blocks, path);
  /* Pieces of 4 MiB: the first damaged block fails the read early. */
  const uint64_t piece = (uint64_t)4 << 20;
  for (uint64_t off = 0; rc == 0 && off < h->data_bytes; off += piece) {
    size_t n =
        (size_t)(h->data_bytes - off < piece ? h->data_bytes - off : piece);
    rc = kvti_pread_all(fd, (uint8_t *)dst + off, n, h->header_bytes + off,
                        path);
    if (rc == 0)
      rc = kvti_blkhash_update(bh, (uint8_t *)dst + off, n);
  }
  if (rc == 0)
    rc = kvti_blkhash_final(bh, NULL);
  kvti_blkhash_free(bh);
  return rc;
}
