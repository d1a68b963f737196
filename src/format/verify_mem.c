/*
 * verify_mem.c - checking an in-memory copy of an entry (the host RAM tier's
 * cached layers, tier/hostcache.h) against the entry's files exactly as a
 * read would check the bytes it reads, without reading the tensor data: the
 * manifest, manifest.sum and tokens.bin are loaded and validated as by the
 * entry reader, each layer file's safetensors header is read (a few KiB) and
 * checked against the manifest and against the cached tensors, and every
 * checksum of the manifest (per 64 KiB block in format 2, whole file in format
 * 1) is verified over the header bytes followed by the cached tensor bytes in
 * file order. A copy that passes is indistinguishable from a fresh read of the
 * current version; anything else (stale, altered, damaged) fails.
 */
#include "base/error.h"
#include "base/hash.h"
#include "base/io.h"
#include "base/parfor.h"
#include "format/chunk.h"
#include "format/entry_int.h"
#include "format/layer.h"
#include "format/safetensors.h"

#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#define BAD(...) KVT_ERR(KVT_ECORRUPT, __VA_ARGS__)

static int feed_blk(void *ctx, const void *data, size_t len) {
  return kvti_blkhash_update(ctx, data, len);
}
/* Feeds rows [row0, T) of t (axis -2) to h: each head's rows are contiguous
 * in the cached tensor and follow each other in the file. */
static int feed_rows(kvti_blkhash *h, const kvt_tensor *t, uint64_t row0) {
  if (!row0 || t->ndim < 2)
    return kvti_blkhash_update(h, t->data, (size_t)t->nbytes);
  uint64_t outer, row, T = (uint64_t)t->shape[t->ndim - 2];
  kvti_chunk_tensor_geom(t, &outer, &row);
  int rc = 0;
  for (uint64_t q = 0; rc == 0 && q < outer && row && T > row0; q++)
    rc = kvti_blkhash_update(h, (const uint8_t *)t->data + (q * T + row0) * row,
                             (size_t)((T - row0) * row));
  return rc;
}

int kvti_layer_verify_mem(kvt_layer *l, const char *path,
                          const kvti_layer_meta *m,
                          const kvti_layer_read_opts *o) {
  if (!o->block_size && !o->expect_xxh3)
    return KVT_ERR(KVT_EUNSUPPORTED, "%s has no checksums to verify against",
                   path);
  kvti_st_header hd = {0};
  const kvti_st_tensor **slot = NULL;
  kvti_blkhash *h = NULL;
  int rc = 0;
  int fd = kvti_open(path, O_RDONLY, 0);
  if (fd < 0)
    return fd == KVT_ENOTFOUND ? BAD("%s: layer file missing", path) : fd;
  struct stat st;
  if (kvti_io->fstat(fd, &st) != 0) {
    rc = KVT_ERR_OS(errno, "stat %s", path);
    goto out;
  }
  uint64_t size = (uint64_t)st.st_size, bs = o->block_size;
  if (bs && (!kvti_blk_size_ok(bs) || !o->blocks ||
             kvti_blk_count(size, bs) != o->n_blocks)) {
    rc = BAD("%s: %llu bytes, but its block list has %zu blocks of %llu", path,
             (unsigned long long)size, o->n_blocks, (unsigned long long)bs);
    goto out;
  }
  if ((rc = kvti_blkhash_new(&h, bs, 0)) != 0) {
    h = NULL;
    goto out;
  }
  kvti_blkhash_expect(h, bs ? o->blocks : o->expect_xxh3, bs ? o->n_blocks : 1,
                      path);
  /* The header comes from the file (a few KiB, verified as it is read). */
  rc = kvti_st_read_header_fn(&hd, fd, size, path, feed_blk, h);
  if (rc)
    goto out;
  slot = kvti_calloc(m->num_tensors ? m->num_tensors : 1, sizeof *slot);
  if (!slot) {
    rc = KVT_ERR_NOMEM();
    goto out;
  }
  if ((rc = kvti_layer_check_header(slot, &hd, m, path)) != 0)
    goto out;
  if (l->num_tensors != m->num_tensors || hd.n != m->num_tensors) {
    rc = BAD("%s: the cached copy has %u tensors, the file %u", path,
             l->num_tensors, m->num_tensors);
    goto out;
  }
  for (uint32_t j = 0; j < m->num_tensors; j++) {
    const kvt_tensor *t = &l->tensors[j];
    kvt_tensor view = *t; /* what the file holds of it: rows [row0, T) */
    if (o->mem_row0 && t->ndim >= 2) {
      uint64_t outer, row, T = (uint64_t)t->shape[t->ndim - 2];
      kvti_chunk_tensor_geom(t, &outer, &row);
      if (T < o->mem_row0) {
        rc = BAD("%s: tensor %u of the cached copy has fewer rows than its "
                 "chain",
                 path, j);
        goto out;
      }
      view.shape[t->ndim - 2] = (int64_t)(T - o->mem_row0);
      view.nbytes = outer * (T - o->mem_row0) * row;
    }
    if (view.dtype != (int32_t)slot[j]->dtype || view.ndim != slot[j]->ndim ||
        memcmp(view.shape, slot[j]->shape, sizeof view.shape) != 0 ||
        view.nbytes != slot[j]->nbytes || (view.nbytes && !view.data)) {
      rc = BAD("%s: tensor %u of the cached copy does not match the file", path,
               j);
      goto out;
    }
  }
  /* The data in file order (the header lists tensors by offset, contiguous
   * from data_start): every block is checked over the cached bytes. */
  uint64_t pos = hd.data_start;
  for (size_t k = 0; k < hd.n; k++) {
    uint32_t j = 0;
    while (j < m->num_tensors && slot[j] != &hd.tensors[k])
      j++;
    if (j == m->num_tensors || hd.tensors[k].offset != pos) {
      rc = BAD("%s: tensor data is not laid out contiguously", path);
      goto out;
    }
    if (o->cancel && atomic_load(o->cancel)) {
      rc = KVT_ERR(KVT_ECANCELED, "verify of %s cancelled", path);
      goto out;
    }
    if ((rc = feed_rows(h, &l->tensors[j], o->mem_row0)) != 0)
      goto out;
    pos += hd.tensors[k].nbytes;
  }
  if ((rc = kvti_blkhash_final(h, NULL)) != 0)
    goto out;
  /* The attributes as a read sets them. */
  kvti_layer_meta_attrs(l, m);
  kvti_free(l->orig_dtypes);
  l->orig_dtypes = NULL;
  if (m->orig_dtypes) {
    l->orig_dtypes = kvti_malloc(m->num_tensors * sizeof(int32_t));
    if (!l->orig_dtypes) {
      rc = KVT_ERR_NOMEM();
      goto out;
    }
    memcpy(l->orig_dtypes, m->orig_dtypes, m->num_tensors * sizeof(int32_t));
  }
out:
  kvti_io->close(fd);
  kvti_free(slot);
  kvti_blkhash_free(h);
  kvti_st_header_free(&hd);
  return rc;
}

/* Layers are checked by up to read_threads() threads at once (hashing is
 * CPU-bound, ~5 GB/s per core from memory), each taking the next layer
 * (kvti_parfor). */
typedef struct vm_job {
  kvti_entry_reader *r;
  kvt_layer *layers;
  atomic_int *cancel;
  const uint64_t *row0; /* kvti_read_opts.mem_row0 */
} vm_job;

static int vm_layer(void *ctx, size_t li) {
  vm_job *j = ctx;
  const kvti_manifest *m = &j->r->m;
  uint32_t i = (uint32_t)li;
  char name[40];
  snprintf(name, sizeof name, "layer_%u.safetensors", i);
  char *lp = kvti_path_join(m->dir, name);
  if (!lp)
    return KVT_ERR_NOMEM();
  kvti_layer_read_opts lo;
  memset(&lo, 0, sizeof lo);
  lo.layer_no = i;
  lo.cancel = j->cancel;
  lo.expect_xxh3 = &m->sums[i];
  lo.block_size = m->block_size;
  lo.blocks = m->block_size ? m->blk_all + m->blk_off[i] : NULL;
  lo.n_blocks = m->block_size ? m->blk_off[i + 1] - m->blk_off[i] : 0;
  lo.mem_row0 = j->row0 ? j->row0[i] : 0;
  int rc = kvti_layer_verify_mem(&j->layers[i], lp, &m->metas[i], &lo);
  kvti_free(lp);
  return rc;
}

int kvti_entry_verify_mem(const char *data_dir, const char *hash,
                          kvt_layer *layers, uint32_t n_layers,
                          const kvti_read_opts *o) {
  if (!data_dir || !hash || !o || !o->tokens || (n_layers && !layers))
    return KVT_ERR(KVT_EINVAL, "entry verify: bad argument");
  kvti_read_opts ro;
  memset(&ro, 0, sizeof ro);
  ro.tokens = o->tokens;
  ro.n_tokens = o->n_tokens;
  ro.cancel = o->cancel;
  ro.tail_ok =
      o->tail_ok; /* a chained entry's tail (its rows past the chain) */
  ro.verify_only = 1;
  kvti_dir_id id = {0};
  kvti_entry_reader *r = NULL;
  int rc = kvti_entry_reader_open_id(&r, data_dir, hash, &ro, &id);
  if (rc)
    return rc;
  if (!r->m.has_sums) {
    rc = KVT_ERR(KVT_EUNSUPPORTED, "entry %.16s has no kvtier checksums", hash);
    goto out;
  }
  if (r->m.num_layers != n_layers) {
    rc = BAD("entry %.16s: the cached copy has %u layers, the manifest %u",
             hash, n_layers, r->m.num_layers);
    goto out;
  }
  vm_job j = {r, layers, o->cancel, o->mem_row0};
  unsigned nt = o->read_threads >= 1 && o->read_threads <= KVTI_MAX_READ_THREADS
                    ? o->read_threads
                    : kvti_entry_read_threads();
  if ((rc = kvti_parfor(nt, n_layers, vm_layer, &j)) != 0)
    goto out;
  /* Replaced while we looked: not this version. */
  if (kvti_entry_dir_state(r->m.dir, &id) != 0)
    rc = KVT_ERR(KVT_EAGAIN, "entry %.16s was replaced during the check", hash);
out:
  kvti_entry_reader_free(r);
  return rc;
}
