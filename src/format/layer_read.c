/*
 * layer_read.c - the verified read of one layer file straight into the final
 * tensor buffers: checks the file's tensors against the layer's manifest
 * object, then preads each tensor into its buffer (O_DIRECT when the file is
 * cold, batched, several pieces in flight) while hashing the file in offset
 * order (whole-file hash, or per-block hashes each checked as its block
 * completes). Trimmed reads keep a token prefix; with per-block hashes they go
 * through layer_blocks.c.
 */
#include "format/layer_int.h"
#include "base/bufpool.h"
#include "base/error.h"
#include "base/io.h"
#include "engine/iobatch.h"
#include "format/dtype.h"

#include <fcntl.h>
#include <string.h>
#include <unistd.h>

#define BAD(...) KVT_ERR(KVT_ECORRUPT, __VA_ARGS__)

void kvti_layer_release(kvt_layer *l, int caller_alloc, kvt_free_fn free_buf,
                        void *ctx) {
  if (!l)
    return;
  if (l->tensors)
    for (uint32_t j = 0; j < l->num_tensors; j++) {
      void *d = l->tensors[j].data;
      if (!d)
        continue;
      if (!caller_alloc)
        kvti_buf_free(d);
      else if (free_buf)
        free_buf(ctx, d);
    }
  kvti_free(l->tensors);
  kvti_free(l->orig_dtypes);
  l->tensors = NULL;
  l->orig_dtypes = NULL;
  l->num_tensors = 0;
}

#define RCHUNK ((size_t)8 << 20)
/* Read granularity: each piece is hashed, still cache-resident, as it lands. */
#define RPIECE ((size_t)256 << 10)
#define RWINDOW 16 /* pieces in flight ahead of the hashing */

/* Copies the part of a streamed piece (tensor bytes [pos, pos+len)) that falls
 * into kept rows: the tensor is `outer` blocks of tb bytes (all token rows of
 * one head), of which the first kb bytes (the kept rows) go to dst, block after
 * block. */
static void copy_kept(char *dst, const char *piece, uint64_t pos, uint64_t len,
                      uint64_t tb, uint64_t kb) {
  if (len == 0 || tb == 0)
    return;
  for (uint64_t o = pos / tb; o <= (pos + len - 1) / tb; o++) {
    uint64_t s = o * tb > pos ? o * tb : pos;
    uint64_t e = o * tb + kb < pos + len ? o * tb + kb : pos + len;
    if (s < e)
      memcpy(dst + o * kb + (s - o * tb), piece + (s - pos), (size_t)(e - s));
  }
}

/* One contiguous run of file bytes and where they go. */
typedef struct rseg {
  char *dst;
  uint64_t off, len;
} rseg;

/* Reads the segments (in file order) through the batched I/O engine as one
 * pipeline - pieces of every segment keep flowing, so the window does not
 * drain at each tensor boundary - keeping RWINDOW pieces of RPIECE bytes in
 * flight and hashing each piece (in order) as soon as it has landed, while the
 * next ones are still being read and while it is still warm in cache. */
static int read_segs_hashed(kvti_iobatch *b, int fd, int dfd, const rseg *sg,
                            size_t ns, kvti_blkhash *h,
                            const atomic_int *cancel, const char *path) {
  kvti_iob_req win[RWINDOW];
  /* Direct reads: 1 MiB pieces, what the disk likes (no readahead merges them);
   * page-cache reads: RPIECE, so a piece is hashed while still in L2. */
  const uint64_t piece = dfd >= 0 ? (uint64_t)1 << 20 : RPIECE;
  size_t si = 0;
  uint64_t sp = 0, pushed = 0, done = 0;
  int rc = 0;
  for (;;) {
    while (rc == 0 && pushed < done + RWINDOW && si < ns) {
      if (sp == sg[si].len) {
        si++, sp = 0;
        continue;
      }
      uint64_t pl = sg[si].len - sp < piece ? sg[si].len - sp : piece;
      kvti_iob_req *r = &win[pushed % RWINDOW];
      *r = (kvti_iob_req){
          fd, dfd, 0,   sg[si].dst + sp, pl, sg[si].off + sp, 0, 0, 0, 0,
          0,  0,   NULL};
      rc = kvti_iobatch_push(b, r, 0, path);
      pushed++;
      sp += pl;
    }
    if (rc != 0 || done == pushed)
      break;
    kvti_iob_req *r = &win[done % RWINDOW];
    rc = kvti_iobatch_wait_req(b, r);
    if (rc == 0 && h) /* format 2: fails at the first bad block */
      rc = kvti_blkhash_update(h, r->buf, (size_t)r->len);
    done++;
    if (rc == 0 && cancel && atomic_load(cancel))
      rc = KVT_ERR(KVT_ECANCELED, "read of %s cancelled", path);
  }
  int rc2 =
      kvti_iobatch_wait_all(b); /* nothing may land in dst after we return */
  return rc ? rc : rc2;
}

static int feed_blk(void *ctx, const void *data, size_t len) {
  return kvti_blkhash_update(ctx, data, len);
}

static int read_range_hashed(kvti_iobatch *b, int fd, char *dst, uint64_t off,
                             uint64_t len, kvti_blkhash *h, const char *path) {
  rseg one = {dst, off, len};
  return read_segs_hashed(b, fd, -1, &one, 1, h, NULL, path);
}

/* Cold files are read with O_DIRECT, warm ones through the page cache. On the
 * target VMs a buffered read of data not in the page cache costs 1-2 s of
 * kernel CPU per GiB (page-cache insertion, LRU, memcg accounting, the copy
 * out: fio measured sys 60-96% of a core for 0.5-1.1 GB/s), so two cores cap
 * cold promotes at 0.6-0.8 GB/s; O_DIRECT reads the same data at the disk's
 * speed for 5-8% of a core, straight into the final (aligned, pooled)
 * buffers, and does not duplicate in the page cache what the engine is about
 * to hold in RAM. A file mostly cached is cheaper to copy from memory. Returns
 * an O_DIRECT descriptor of the same inode as fd, or -1 when: the data does not
 * start at an aligned offset (native-mode files of >= 1 MiB of tensors do), the
 * file is small, half of it or more is cached, residency is unknown, the file
 * system has no O_DIRECT, or the path now names another file. -1 is always
 * safe: the page-cache path reads everything. */
static int open_direct_if_cold(int fd, const struct stat *st,
                               uint64_t data_start, const char *path) {
  uint64_t size = (uint64_t)st->st_size, cached = 0;
  if (size < KVTI_DATA_ALIGN_MIN || data_start % KVTI_IOB_ALIGN != 0 ||
      !kvti_io->resident || kvti_io->resident(fd, size, &cached) != 0 ||
      cached >= size / 2)
    return -1;
  int dfd = kvti_iob_open_direct(path, O_RDONLY, 0);
  struct stat ds;
  if (dfd >= 0 && (kvti_io->fstat(dfd, &ds) != 0 || ds.st_ino != st->st_ino ||
                   ds.st_dev != st->st_dev)) {
    kvti_io->close(dfd);
    dfd = -1;
  }
  return dfd;
}

int kvti_layer_read_file(kvt_layer *out, uint64_t *file_bytes, const char *path,
                         const kvti_layer_meta *m,
                         const kvti_layer_read_opts *o) {
  kvt_layer l;
  kvt_layer_init(&l, (kvt_layer_kind)m->kind);
  l.num_tensors = 0;
  kvti_st_header hd = {0};
  const kvti_st_tensor **slot = NULL;
  kvti_blkhash *h = NULL; /* whole-file hash (format 1) or block verifier */
  char *hbuf = NULL;      /* format 2, trimmed: the header's verified blocks */
  uint64_t hlen = 0, nread = 0;
  char *scratch = NULL;
  kvti_iobatch *eng = NULL;
  uint64_t *tbytes = NULL; /* trimmed read: per tensor (tb, kb) */
  int rc = 0, dfd = -1;
  int fd = kvti_open(path, O_RDONLY, 0);
  if (fd == KVT_ENOTFOUND)
    return BAD("%s: layer file missing", path);
  if (fd == KVT_EPERM && kvt_last_errno() == ELOOP)
    return BAD("%s is a symlink", path);
  if (fd < 0)
    return fd;
  struct stat st;
  if (kvti_io->fstat(fd, &st) != 0) {
    rc = KVT_ERR_OS(errno, "stat %s", path);
    goto out;
  }
  if (!S_ISREG(st.st_mode)) {
    rc = BAD("%s is not a regular file", path);
    goto out;
  }
  /* The header's tensor sizes are bounded by st_size when it is parsed; a
   * sparse file must not make that length a licence to allocate. */
  if (kvti_file_sparse(&st)) {
    rc = BAD("%s is sparse (%llu bytes, %llu allocated)", path,
             (unsigned long long)st.st_size,
             (unsigned long long)st.st_blocks * 512u);
    goto out;
  }
  uint64_t size = (uint64_t)st.st_size;
  uint64_t bs = o->block_size;
  /* Format 2 with a trim: only verified blocks are read
   * (kvti_layer_read_trim_blocks). */
  int blk_trim = bs && o->keep_tokens;
  if (bs) {
    if (!kvti_blk_size_ok(bs) || !o->blocks ||
        kvti_blk_count(size, bs) != o->n_blocks) {
      rc =
          BAD("%s: %llu bytes, but its block list has %zu blocks of %llu", path,
              (unsigned long long)size, o->n_blocks, (unsigned long long)bs);
      goto out;
    }
    if (!blk_trim) {
      if ((rc = kvti_blkhash_new(&h, bs, 0)) != 0) {
        h = NULL;
        goto out;
      }
      kvti_blkhash_expect(h, o->blocks, o->n_blocks, path);
    }
  } else if (o->expect_xxh3) {
    if ((rc = kvti_blkhash_new(&h, 0, 0)) != 0) {
      h = NULL;
      goto out;
    }
    kvti_blkhash_expect(h, o->expect_xxh3, 1, path);
  }
  if (o->keep_tokens && (bs || !o->expect_xxh3) && kvti_io->fadvise) {
    /* A trimmed read touches scattered ranges: without this the kernel's
     * readahead (8 MiB on the target VMs) pulls the skipped rows from disk too.
     * Advice on our own open file only; a refusal changes nothing. */
    kvti_io->fadvise(fd, 0, 0, POSIX_FADV_RANDOM);
  }
  if (blk_trim) {
    rc = kvti_layer_read_header_blocks(&hd, &hbuf, &hlen, fd, size, o, path);
    nread = hlen;
  } else {
    rc = kvti_st_read_header_fn(&hd, fd, size, path, h ? feed_blk : NULL, h);
    nread = hd.data_start;
  }
  if (rc)
    goto out;
  slot = kvti_calloc(m->num_tensors ? m->num_tensors : 1, sizeof *slot);
  l.tensors =
      kvti_calloc(m->num_tensors ? m->num_tensors : 1, sizeof(kvt_tensor));
  if (!slot || !l.tensors) {
    rc = KVT_ERR_NOMEM();
    goto out;
  }
  l.num_tensors = m->num_tensors;
  rc = kvti_layer_check_header(slot, &hd, m, path);
  if (rc)
    goto out;
  kvti_layer_meta_attrs(&l, m);
  if (m->orig_dtypes) {
    l.orig_dtypes = kvti_malloc(m->num_tensors * sizeof(int32_t));
    if (!l.orig_dtypes) {
      rc = KVT_ERR_NOMEM();
      goto out;
    }
    memcpy(l.orig_dtypes, m->orig_dtypes, m->num_tensors * sizeof(int32_t));
  }
  for (uint32_t j = 0; j < m->num_tensors; j++) {
    kvt_tensor *t = &l.tensors[j];
    t->dtype = slot[j]->dtype;
    t->ndim = slot[j]->ndim;
    memcpy(t->shape, slot[j]->shape, sizeof t->shape);
    t->nbytes = slot[j]->nbytes;
    t->data = NULL;
  }
  /* Token i is row i: an offset past the rows would serve garbage. */
  if ((rc = kvti_layer_check_rows(&l, m->layer_idx, o->row_base, UINT64_MAX,
                                  KVT_ECORRUPT, path)) != 0)
    goto out;
  /* Trimmed read: per tensor, tb = bytes of one head's token rows in the file,
   * kb = bytes of its kept rows. */
  uint64_t keep = o->keep_tokens;
  if (keep && l.offset != KVT_ABSENT && (uint64_t)l.offset < keep &&
      (m->kind == KVT_LAYER_KV || m->kind == KVT_LAYER_QUANTIZED_KV)) {
    rc = KVT_ERR(KVT_EINVAL,
                 "%s: layer holds KV of %lld tokens (offset), fewer than the "
                 "%llu to keep: rows past offset are not KV of those tokens",
                 path, (long long)l.offset, (unsigned long long)keep);
    goto out;
  }
  if (keep) {
    if (m->kind != KVT_LAYER_KV && m->kind != KVT_LAYER_QUANTIZED_KV) {
      rc = KVT_ERR(KVT_EUNSUPPORTED,
                   "%s: only KV and quantized KV layers can be trimmed to a "
                   "token prefix",
                   path);
      goto out;
    }
    tbytes = kvti_calloc(2u * (m->num_tensors ? m->num_tensors : 1),
                         sizeof(uint64_t));
    if (!tbytes) {
      rc = KVT_ERR_NOMEM();
      goto out;
    }
    for (uint32_t j = 0; j < m->num_tensors; j++) {
      kvt_tensor *t = &l.tensors[j];
      if (t->ndim < 2 || t->shape[t->ndim - 2] < (int64_t)keep) {
        rc = KVT_ERR(KVT_EINVAL,
                     "%s: tensor %u holds fewer than the %llu tokens to keep",
                     path, j, (unsigned long long)keep);
        goto out;
      }
      uint64_t outer = 1;
      for (uint32_t d = 0; d + 2 < t->ndim; d++)
        outer *= (uint64_t)t->shape[d];
      uint64_t tt = (uint64_t)t->shape[t->ndim - 2];
      uint64_t tb = outer ? t->nbytes / outer : 0;
      uint64_t kb = tt ? tb / tt * keep : 0;
      tbytes[2 * j] = tb;
      tbytes[2 * j + 1] = kb;
      t->shape[t->ndim - 2] = (int64_t)keep;
      t->nbytes = outer * kb;
    }
    l.offset = (int64_t)keep;
  }
  /* Allocate every buffer first (so a refusal costs no I/O), then read in file
   * order. */
  if (!o->verify_only) {
    for (uint32_t j = 0; j < m->num_tensors; j++) {
      kvt_tensor *t = &l.tensors[j];
      if (t->nbytes == 0)
        continue;
      t->data = o->alloc ? o->alloc(o->alloc_ctx, o->layer_no, j, t)
                         : kvti_buf_alloc((size_t)t->nbytes);
      if (!t->data) {
        rc = KVT_ERR(KVT_ENOMEM, "%s: cannot allocate %llu bytes for tensor %u",
                     path, (unsigned long long)t->nbytes, j);
        goto out;
      }
    }
  }
  if (blk_trim) {
    rc = kvti_layer_read_trim_blocks(&l, &hd, slot, tbytes, hbuf, hlen, fd,
                                     size, &eng, o, path, &nread);
    if (rc)
      goto out;
    goto done;
  }
  if (o->verify_only || (keep && h)) {
    scratch = kvti_malloc(RCHUNK);
    if (!scratch) {
      rc = KVT_ERR_NOMEM();
      goto out;
    }
  }
  if (!o->verify_only && !keep) {
    /* The common case, a full read into the final buffers: every tensor of
     * the file as one pipeline (tensors tile the data in offset order). */
    dfd =
        o->page_cache ? -1 : open_direct_if_cold(fd, &st, hd.data_start, path);
    rseg *sg = kvti_calloc(hd.n ? hd.n : 1, sizeof *sg);
    size_t ns = 0;
    if (!sg) {
      rc = KVT_ERR_NOMEM();
      goto out;
    }
    for (size_t i = 0; i < hd.n; i++) {
      uint32_t j = 0;
      while (slot[j] != &hd.tensors[i])
        j++;
      if (hd.tensors[i].nbytes)
        sg[ns++] = (rseg){l.tensors[j].data, hd.tensors[i].offset,
                          hd.tensors[i].nbytes};
    }
    if (o->cancel && atomic_load(o->cancel))
      rc = KVT_ERR(KVT_ECANCELED, "read of %s cancelled", path);
    else if (ns > 0 && (rc = kvti_iobatch_get(&eng, o->io_backend)) != 0)
      eng = NULL;
    else if (ns > 0)
      rc = read_segs_hashed(eng, fd, dfd, sg, ns, h, o->cancel, path);
    kvti_free(sg);
    if (rc)
      goto out;
  }
  for (size_t i = 0; (o->verify_only || keep) && i < hd.n; i++) {
    const kvti_st_tensor *ht = &hd.tensors[i];
    uint32_t j = 0;
    while (slot[j] != ht)
      j++;
    if (o->cancel && atomic_load(o->cancel)) {
      rc = KVT_ERR(KVT_ECANCELED, "read of %s cancelled", path);
      goto out;
    }
    char *dst = l.tensors[j].data;
    uint64_t left = ht->nbytes, off = ht->offset;
    if (left > 0 && !eng && (rc = kvti_iobatch_get(&eng, o->io_backend)) != 0) {
      eng = NULL;
      goto out;
    }
    if (keep && !h) {
      /* No checksum to verify: read only the kept rows, one read per head. */
      uint64_t tb = tbytes[2 * j], kb = tbytes[2 * j + 1];
      uint64_t outer = tb ? ht->nbytes / tb : 0;
      for (uint64_t b0 = 0; b0 < outer && !o->verify_only && kb > 0; b0 += 64) {
        kvti_iob_req rq[64];
        size_t nr = 0;
        for (uint64_t b = b0; b < outer && b < b0 + 64; b++)
          rq[nr++] =
              (kvti_iob_req){fd, -1, 0, dst + b * kb, kb, off + b * tb, 0, 0, 0,
                             0,  0,  0, NULL};
        if ((rc = kvti_iobatch_run(eng, rq, nr, 0, path)) != 0)
          goto out;
        nread += nr * kb;
      }
      continue;
    }
    uint64_t tpos = 0; /* tensor-relative position (trimmed reads) */
    while (left > 0) {
      if (o->cancel && atomic_load(o->cancel)) {
        rc = KVT_ERR(KVT_ECANCELED, "read of %s cancelled", path);
        goto out;
      }
      size_t c = left < RCHUNK ? (size_t)left : RCHUNK;
      char *p = o->verify_only || keep ? scratch : dst;
      rc = read_range_hashed(eng, fd, p, off, c, h, path);
      if (rc)
        goto out;
      if (keep && !o->verify_only)
        copy_kept(l.tensors[j].data, scratch, tpos, c, tbytes[2 * j],
                  tbytes[2 * j + 1]);
      else if (!o->verify_only)
        dst += c;
      tpos += c;
      off += c;
      left -= c;
    }
  }
  /* The whole-file hash, or the block count and the last partial block. */
  if (h && (rc = kvti_blkhash_final(h, NULL)) != 0)
    goto out;
  if (!keep || h)
    nread = size;
done:
  if (file_bytes)
    *file_bytes = nread;
  if (o->verify_only)
    kvti_layer_release(&l, 0, NULL, NULL);
  *out = l;
  memset(&l, 0, sizeof l);
out:
  kvti_iobatch_put(eng);
  if (dfd >= 0)
    kvti_io->close(dfd);
  kvti_io->close(fd);
  kvti_free(scratch);
  kvti_free(tbytes);
  kvti_free(slot);
  kvti_blkhash_free(h);
  kvti_free(hbuf);
  kvti_st_header_free(&hd);
  if (rc)
    kvti_layer_release(&l, o->alloc != NULL, o->free_buf, o->alloc_ctx);
  return rc;
}
