/*
 * layer_blocks.c - format 2's trimmed read of one layer file: with per-block
 * checksums only the blocks covering the safetensors header and each head's
 * kept token rows are read, each block is verified before any of its bytes is
 * used, and then the kept rows are copied out. Called by kvti_layer_read_file
 * (layer_read.c) when a prefix of the tokens is asked for.
 */
#include "format/layer_int.h"
#include "base/bufpool.h"
#include "base/error.h"
#include "base/io.h"

#include <stdatomic.h>
#include <string.h>

#define BAD(...) KVT_ERR(KVT_ECORRUPT, __VA_ARGS__)

/* A trimmed read of a file with per-block checksums reads only the blocks that
 * cover the header and each head's kept rows, into a scratch window of at most
 * TWIN_BYTES (one block when blocks are larger), verifies every block, and only
 * then copies the kept bytes out: no byte reaches the caller from a block that
 * did not match. A block needed by two neighbouring ranges is read once (both
 * are in the same window); blocks of the header are kept and reused. */
#define TWIN_BYTES ((uint64_t)8 << 20)
#define TPIECES 4096 /* pieces (range x block) copied per window */

typedef struct trim_seg {
  uint64_t s, e; /* file range [s, e) of one head's kept rows */
  char *dst;     /* where they go (NULL: verify only) */
} trim_seg;

/* Walk over the pieces of the ranges: a piece is the part of range si from pos
 * to the range's end or the end of pos's block, whichever comes first. */
typedef struct trim_cur {
  size_t si;
  uint64_t pos;
} trim_cur;

static uint64_t piece_end(const trim_seg *g, uint64_t pos, uint64_t bs) {
  uint64_t be = (pos / bs + 1) * bs;
  return be < g->e ? be : g->e;
}

static void piece_next(trim_cur *c, const trim_seg *g, size_t n, uint64_t bs) {
  uint64_t pe = piece_end(&g[c->si], c->pos, bs);
  c->pos = pe;
  if (pe == g[c->si].e && ++c->si < n)
    c->pos = g[c->si].s;
}

static int check_block(const char *p, uint64_t k, uint64_t file_size,
                       const kvti_layer_read_opts *o, const char *path) {
  uint64_t bs = o->block_size;
  uint64_t len = file_size - k * bs < bs ? file_size - k * bs : bs;
  if (kvti_xxh3(p, (size_t)len) != o->blocks[k])
    return BAD("%s: checksum mismatch in block %llu", path,
               (unsigned long long)k);
  return 0;
}

/* Reads and verifies the blocks covering the safetensors header [0, 8 + N),
 * then parses it from memory: nothing of the header, not even N, is used
 * before the block holding it matched. *hbuf receives the verified blocks
 * (*hlen bytes from offset 0; tensor rows in them are copied from there). */
int kvti_layer_read_header_blocks(kvti_st_header *hd, char **hbuf,
                                  uint64_t *hlen, int fd, uint64_t size,
                                  const kvti_layer_read_opts *o,
                                  const char *path) {
  uint64_t bs = o->block_size, n = 0;
  if (size < 8)
    return BAD("%s: too short for a safetensors file (%llu bytes)", path,
               (unsigned long long)size);
  uint64_t l0 = size < bs ? size : bs;
  char *buf = kvti_malloc((size_t)l0);
  if (!buf)
    return KVT_ERR_NOMEM();
  int rc = kvti_pread_all(fd, buf, (size_t)l0, 0, path);
  if (rc == 0)
    rc = check_block(buf, 0, size, o, path);
  if (rc == 0)
    rc = kvti_st_header_len(&n, (const unsigned char *)buf, size, path);
  uint64_t len = l0;
  if (rc == 0) {
    uint64_t nb = kvti_blk_count(8 + n, bs);
    len = nb * bs < size ? nb * bs : size;
  }
  if (rc == 0 && len > l0) {
    char *b2 = kvti_realloc(buf, (size_t)len);
    if (!b2) {
      rc = KVT_ERR_NOMEM();
    } else {
      buf = b2;
      rc = kvti_pread_all(fd, buf + l0, (size_t)(len - l0), l0, path);
      for (uint64_t k = 1; rc == 0 && k * bs < len; k++)
        rc = check_block(buf + k * bs, k, size, o, path);
    }
  }
  if (rc == 0)
    rc = kvti_st_parse(hd, buf + 8, (size_t)n, size, path);
  if (rc) {
    kvti_free(buf);
    return rc;
  }
  *hbuf = buf;
  *hlen = len;
  return 0;
}

/* Reads the kept rows of every tensor (ranges of tbytes (tb, kb) per tensor,
 * slot order) of a format-2 file through its verified blocks. *nread
 * accumulates the bytes read. */
int kvti_layer_read_trim_blocks(kvt_layer *l, const kvti_st_header *hd,
                                const kvti_st_tensor **slot,
                                const uint64_t *tbytes, const char *hbuf,
                                uint64_t hlen, int fd, uint64_t size,
                                kvti_iobatch **eng,
                                const kvti_layer_read_opts *o, const char *path,
                                uint64_t *nread) {
  uint64_t bs = o->block_size;
  uint64_t hblk = kvti_blk_count(hlen, bs); /* blocks held in hbuf */
  size_t nseg = 0;
  trim_seg *seg = NULL;
  uint64_t *win = NULL;
  kvti_iob_req *rq = NULL;
  char *scratch = NULL;
  size_t scap = 0;
  kvti_bufpool *pool = kvti_bufpool_default();
  int rc = 0;
  for (size_t i = 0; i < hd->n; i++) {
    uint32_t j = 0;
    while (slot[j] != &hd->tensors[i])
      j++;
    uint64_t tb = tbytes[2 * j], kb = tbytes[2 * j + 1];
    if (tb && kb)
      nseg += (size_t)(hd->tensors[i].nbytes / tb);
  }
  if (nseg == 0)
    return 0;
  seg = kvti_malloc(nseg * sizeof *seg);
  if (!seg)
    return KVT_ERR_NOMEM();
  size_t ns = 0;
  for (size_t i = 0; i < hd->n; i++) { /* file order: ascending ranges */
    const kvti_st_tensor *ht = &hd->tensors[i];
    uint32_t j = 0;
    while (slot[j] != ht)
      j++;
    uint64_t tb = tbytes[2 * j], kb = tbytes[2 * j + 1];
    if (!tb || !kb)
      continue;
    char *dst = l->tensors[j].data;
    for (uint64_t b = 0; b < ht->nbytes / tb; b++)
      seg[ns++] = (trim_seg){ht->offset + b * tb, ht->offset + b * tb + kb,
                             dst ? dst + b * kb : NULL};
  }
  /* Distinct blocks to read (outside the header's), to size the window. */
  uint64_t need = 0, last = UINT64_MAX;
  for (trim_cur c = {0, seg[0].s}; c.si < nseg; piece_next(&c, seg, nseg, bs)) {
    uint64_t k = c.pos / bs;
    if (k >= hblk && k != last)
      need++;
    last = k;
  }
  size_t wcap = bs >= TWIN_BYTES ? 1 : (size_t)(TWIN_BYTES / bs);
  if (need < wcap)
    wcap = (size_t)need;
  if (wcap) {
    win = kvti_malloc(wcap * sizeof *win);
    rq = kvti_calloc(wcap, sizeof *rq);
    scratch = pool ? kvti_bufpool_get(pool, (size_t)(wcap * bs), &scap) : NULL;
    if (!win || !rq || !scratch) {
      rc = KVT_ERR_NOMEM();
      goto out;
    }
  }
  trim_cur c = {0, seg[0].s};
  while (c.si < nseg) {
    if (o->cancel && atomic_load(o->cancel)) {
      rc = KVT_ERR(KVT_ECANCELED, "read of %s cancelled", path);
      goto out;
    }
    /* Collect pieces while their blocks fit in the window. */
    trim_cur c0 = c;
    size_t nwin = 0, npc = 0;
    while (c.si < nseg && npc < TPIECES) {
      uint64_t k = c.pos / bs;
      if (k >= hblk && (nwin == 0 || win[nwin - 1] != k)) {
        if (nwin == wcap)
          break;
        win[nwin++] = k;
      }
      piece_next(&c, seg, nseg, bs);
      npc++;
    }
    /* One request per run of consecutive blocks, all in flight together. */
    size_t nr = 0;
    for (size_t w = 0; w < nwin;) {
      size_t w1 = w + 1;
      while (w1 < nwin && win[w1] == win[w1 - 1] + 1)
        w1++;
      uint64_t off = win[w] * bs, end = (win[w1 - 1] + 1) * bs;
      if (end > size)
        end = size;
      rq[nr++] = (kvti_iob_req){
          fd, -1, 0, scratch + w * bs, end - off, off, 0, 0, 0, 0, 0, 0, NULL};
      *nread += end - off;
      w = w1;
    }
    if (nr > 0) {
      if (!*eng && (rc = kvti_iobatch_get(eng, o->io_backend)) != 0) {
        *eng = NULL;
        goto out;
      }
      if ((rc = kvti_iobatch_run(*eng, rq, nr, 0, path)) != 0)
        goto out;
    }
    for (size_t w = 0; w < nwin; w++)
      if ((rc = check_block(scratch + w * bs, win[w], size, o, path)) != 0)
        goto out;
    /* Every block of the window matched: copy the pieces out. */
    size_t w = 0;
    for (size_t p = 0; p < npc; p++) {
      const trim_seg *g = &seg[c0.si];
      uint64_t k = c0.pos / bs, pe = piece_end(g, c0.pos, bs);
      const char *src;
      if (k < hblk) {
        src = hbuf + c0.pos;
      } else {
        while (win[w] != k)
          w++;
        src = scratch + w * bs + (c0.pos - k * bs);
      }
      if (g->dst)
        memcpy(g->dst + (c0.pos - g->s), src, (size_t)(pe - c0.pos));
      piece_next(&c0, seg, nseg, bs);
    }
  }
out:
  if (scratch)
    kvti_bufpool_put(pool, scratch, scap);
  kvti_free(rq);
  kvti_free(win);
  kvti_free(seg);
  return rc;
}
