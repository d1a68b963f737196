/*
 * chunkstore_read.c - assembling a stored prefix from its chain of chunks
 * (kvti_chunkstore_read_prefix, chunkstore.h): the destination tensors are
 * described from chunk 0's header and all allocated first (the caller's
 * alloc, so a budget reserved before the read covers them), then each chunk
 * is opened and checked against its chain row and the prompt's tokens, and
 * its data section is read straight into place: one extent per head and
 * tensor (the chunk's rows are head-contiguous, the destination's rows
 * [i*C, (i+1)*C) of each head are contiguous too), coalesced into vectored
 * requests of 1 MiB (engine/ioplan.h), several chunk files' requests queued
 * at once and handed to the kernel a few at a time. Tensors below a huge
 * page share one block (own_buffers), so every read lands in huge pages.
 * Every block is verified as its bytes land, in file order, and
 * nothing is handed out unless every chunk verified.
 */
#include "store/chunkstore.h"

#include "base/bufpool.h"
#include "base/error.h"
#include "base/io.h"
#include "engine/iobatch.h"
#include "engine/ioplan.h"
#include "format/dtype.h"
#include "format/layer.h"

#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

uint64_t kvti_chunk_prefix_bytes(const kvti_chain_rec *recs, size_t m) {
  uint64_t b = 0;
  for (size_t i = 0; i < m; i++)
    b += recs[i].mem_bytes;
  return b;
}

void kvti_chunk_prefix_free(kvti_chunk_prefix *p,
                            const kvti_chunk_read_opts *o) {
  if (!p)
    return;
  for (uint32_t i = 0; p->layers && i < p->n_layers; i++)
    kvti_layer_release(&p->layers[i], p->caller_alloc, o ? o->free_buf : NULL,
                       o ? o->alloc_ctx : NULL);
  kvti_free(p->layers);
  kvti_free(p->layer_idx);
  memset(p, 0, sizeof *p);
}

/* kvtier's own destination buffers for p's described tensors. Tensors below
 * a huge page (a 256-token chunk's are 512 KiB) are carved from one block
 * (kvti_buf_alloc_group) when together they fill one or more: the reads land
 * in huge pages, as larger tensors' own buffers do (base/bufpool.h), and the
 * entry's tensors are freed together anyway. */
#define HUGE_PAGE ((uint64_t)2 << 20)
static int own_buffers(kvti_chunk_prefix *p) {
  size_t count = 0;
  uint64_t total = 0, largest = 0;
  for (uint32_t i = 0; i < p->n_layers; i++)
    for (uint32_t j = 0; j < p->layers[i].num_tensors; j++) {
      uint64_t nb = p->layers[i].tensors[j].nbytes;
      count++;
      total += nb;
      largest = nb > largest ? nb : largest;
    }
  if (count > 1 && largest < HUGE_PAGE && total >= HUGE_PAGE) {
    void **bufs = kvti_malloc(count * sizeof *bufs);
    size_t *sizes = kvti_malloc(count * sizeof *sizes);
    int rc = bufs && sizes ? 0 : KVT_ERR_NOMEM();
    size_t k = 0;
    for (uint32_t i = 0; rc == 0 && i < p->n_layers; i++)
      for (uint32_t j = 0; j < p->layers[i].num_tensors; j++)
        sizes[k++] = (size_t)p->layers[i].tensors[j].nbytes;
    if (rc == 0)
      rc = kvti_buf_alloc_group(bufs, sizes, count);
    k = 0;
    for (uint32_t i = 0; rc == 0 && i < p->n_layers; i++)
      for (uint32_t j = 0; j < p->layers[i].num_tensors; j++)
        p->layers[i].tensors[j].data = bufs[k++];
    kvti_free(bufs);
    kvti_free(sizes);
    if (rc == 0)
      return 0;
  }
  for (uint32_t i = 0; i < p->n_layers; i++)
    for (uint32_t j = 0; j < p->layers[i].num_tensors; j++) {
      kvt_tensor *t = &p->layers[i].tensors[j];
      if ((t->data = kvti_buf_alloc((size_t)t->nbytes)) == NULL && t->nbytes) {
        t->nbytes = 0; /* nothing to free */
        return KVT_ERR_NOMEM();
      }
    }
  return 0;
}

/* Describes and allocates the destination layers from chunk 0's header. */
static int make_layers(kvti_chunk_prefix *p, const kvti_chunk_hdr *h,
                       uint64_t rows, const kvti_chunk_read_opts *o) {
  p->n_layers = h->n_layers;
  p->spill_layers = h->spill_layers;
  p->caller_alloc = o->alloc != NULL;
  p->layers = kvti_calloc(h->n_layers, sizeof *p->layers);
  p->layer_idx = kvti_calloc(h->n_layers, sizeof *p->layer_idx);
  if (!p->layers || !p->layer_idx)
    return KVT_ERR_NOMEM();
  for (uint32_t i = 0; i < h->n_layers; i++) {
    const kvti_chunk_layer *L = &h->layers[i];
    kvt_layer *l = &p->layers[i];
    kvt_layer_init(l, (kvt_layer_kind)L->kind);
    p->layer_idx[i] = L->layer_idx;
    l->offset = (int64_t)rows;
    if (L->kind == KVT_LAYER_QUANTIZED_KV) {
      l->bits = L->bits;
      l->group_size = L->group_size;
    }
    if (!(l->tensors = kvti_calloc(L->num_tensors, sizeof *l->tensors)))
      return KVT_ERR_NOMEM();
    l->num_tensors = L->num_tensors;
    for (uint32_t j = 0; j < L->num_tensors; j++) {
      kvt_tensor *t = &l->tensors[j];
      t->dtype = L->tensors[j].dtype;
      t->ndim = L->tensors[j].ndim;
      memcpy(t->shape, L->tensors[j].shape, sizeof t->shape);
      t->shape[t->ndim - 2] = (int64_t)rows;
      uint64_t nb;
      if (kvti_tensor_nbytes(&nb, (kvt_dtype)t->dtype, t->ndim, t->shape) ||
          nb > SIZE_MAX / 2)
        return KVT_ERR(KVT_EINVAL, "chunked prefix: tensor too large");
      t->nbytes = nb;
      if (!o->alloc)
        continue; /* kvtier's own buffers: below */
      t->data = o->alloc(o->alloc_ctx, L->layer_idx, j, t);
      if (!t->data && nb) {
        t->nbytes = 0; /* nothing to free */
        return KVT_ERR(KVT_ENOMEM, "alloc callback refused %llu bytes",
                       (unsigned long long)nb);
      }
    }
  }
  return o->alloc ? 0 : own_buffers(p);
}

/* Copies chunk i's rows (data, verified) into the destination, clipped to
 * the destination's rows (a trimmed read keeps only the first of them). */
static void place(kvti_chunk_prefix *p, const kvti_chunk_hdr *h,
                  const uint8_t *data, uint64_t row0) {
  for (uint32_t i = 0; i < h->n_layers; i++) {
    const kvti_chunk_layer *L = &h->layers[i];
    for (uint32_t j = 0; j < L->num_tensors; j++) {
      const kvti_chunk_tensor *ct = &L->tensors[j];
      kvt_tensor *t = &p->layers[i].tensors[j];
      /* The destination has the chunk's geometry but for the token axis. */
      uint64_t outer, row;
      kvti_chunk_tensor_geom(t, &outer, &row);
      uint64_t T = (uint64_t)t->shape[t->ndim - 2], n = h->n_tokens;
      uint64_t k = row0 >= T ? 0 : (T - row0 < n ? T - row0 : n);
      for (uint64_t o = 0; o < outer && row && k; o++)
        memcpy((uint8_t *)t->data + (o * T + row0) * row,
               data + ct->off + o * n * row, k * row);
    }
  }
}

/* Chunks opened ahead of their reads: an eviction that unlinks a chunk of
 * the chain after this point does not affect the read. Chains longer than
 * this are opened window by window (bounded descriptors). */
#define OPEN_WINDOW 256
/* Bytes per read request: fio's block size; a chunk's extents are coalesced
 * into requests of this size (engine/ioplan.h). */
#define REQ_BYTES ((uint64_t)1 << 20)
/* Chunks whose reads are in flight at once, and the bytes they may hold:
 * the disk sees up to IN_FLIGHT_BYTES of requests queued across chunk files
 * while earlier chunks are verified. */
#define AHEAD 16
#define IN_FLIGHT_BYTES ((uint64_t)128 << 20)
/* io_uring slots of the private engine: IN_FLIGHT_BYTES of 1 MiB requests. */
#define DEPTH 128
/* Requests handed to the kernel per io_uring_enter. The kernel pins (and, in
 * fresh memory, faults in) each request's pages while submitting, and the
 * disk gets none of a batch's requests before the whole batch is through: a
 * chunk's 32 MiB in one batch left the disk idle for the ~20 ms of faulting
 * in a caller's new buffers. Four 1 MiB requests still merge into one
 * device request of the disk's 4 MiB maximum. */
#define SUBMIT_REQS 4

/* One chunk opened for reading: descriptor, O_DIRECT descriptor (cold, or
 * -1) and parsed header. */
typedef struct opened {
  int fd, dfd;
  kvti_chunk_hdr h;
} opened;

/* Cold chunks are read with O_DIRECT, like entry layer files
 * (format/layer_read.c): the data section starts 4096-aligned when it holds
 * >= 1 MiB, and buffered reads of uncached data cost 1-2 s of kernel CPU per
 * GiB here. A chunk half cached or more, or of unknown residency, is read
 * through the page cache, as is everything when O_DIRECT is unavailable
 * (the portable build, file systems without it). */
static int direct_if_cold(const opened *c, const char *path, int page_cache) {
  uint64_t size = (uint64_t)c->h.header_bytes + c->h.data_bytes, cached = 0;
  if (page_cache || c->h.data_bytes < KVTI_CHUNK_ALIGN_MIN ||
      c->h.header_bytes % KVTI_IOB_ALIGN != 0 || !kvti_io->resident ||
      kvti_io->resident(c->fd, size, &cached) != 0 || cached >= size / 2)
    return -1;
  struct stat st, ds;
  int dfd = kvti_iob_open_direct(path, O_RDONLY, 0);
  /* Same inode as the verified descriptor, or not used (the file may have
   * been unlinked and its name reused meanwhile). */
  if (dfd >= 0 &&
      (kvti_io->fstat(c->fd, &st) != 0 || kvti_io->fstat(dfd, &ds) != 0 ||
       ds.st_ino != st.st_ino || ds.st_dev != st.st_dev)) {
    kvti_io->close(dfd);
    dfd = -1;
  }
  return dfd;
}

static void close_opened(opened *c) {
  if (c->fd >= 0)
    kvti_close(c->fd);
  if (c->dfd >= 0)
    kvti_io->close(c->dfd);
  kvti_chunk_hdr_free(&c->h);
  c->fd = c->dfd = -1;
}

/* A chunk's data section being read: straight into the destination
 * tensors (each head extent lands in its place; extents adjacent in the file
 * share requests of REQ_BYTES), or into a scratch buffer when only part of
 * the chunk is kept (a trimmed read's last chunk: every block is still
 * verified). */
typedef struct inflight {
  opened *c;
  uint8_t *scratch; /* NULL: direct to the destination */
  kvti_ioplan plan;
  uint64_t row0;
} inflight;

/* The extents of chunk c (rows [row0, row0 + n) of p's tensors), in file
 * order, into *ext (kvti_malloc). The data section is the tensors back to
 * back, each head's n rows contiguous, so the extents cover it exactly. */
static int chunk_extents(kvti_ioplan_ext **ext, size_t *next, const opened *c,
                         kvti_chunk_prefix *p, uint64_t row0,
                         uint8_t *scratch) {
  const kvti_chunk_hdr *h = &c->h;
  uint64_t n = h->n_tokens, cnt = 0, hb = h->header_bytes;
  uint64_t T = h->n_layers ? (uint64_t)p->layers[0]
                                 .tensors[0]
                                 .shape[p->layers[0].tensors[0].ndim - 2]
                           : 0;
  *ext = NULL;
  *next = 0;
  if (scratch) {
    if (!(*ext = kvti_malloc(sizeof **ext)))
      return KVT_ERR_NOMEM();
    (*ext)[0] = (kvti_ioplan_ext){hb, scratch, h->data_bytes};
    *next = 1;
    return 0;
  }
  for (uint32_t i = 0; i < h->n_layers; i++)
    for (uint32_t j = 0; j < h->layers[i].num_tensors; j++) {
      uint64_t outer, row;
      kvti_chunk_tensor_geom(&p->layers[i].tensors[j], &outer, &row);
      cnt += T == n ? 1 : outer;
    }
  if (!(*ext = kvti_malloc((size_t)(cnt ? cnt : 1) * sizeof **ext)))
    return KVT_ERR_NOMEM();
  size_t k = 0;
  for (uint32_t i = 0; i < h->n_layers; i++) {
    const kvti_chunk_layer *L = &h->layers[i];
    for (uint32_t j = 0; j < L->num_tensors; j++) {
      kvt_tensor *t = &p->layers[i].tensors[j];
      uint64_t outer, row, off = hb + L->tensors[j].off;
      kvti_chunk_tensor_geom(t, &outer, &row);
      if (T == n) { /* the chunk's tensor is the whole destination */
        (*ext)[k++] = (kvti_ioplan_ext){off, t->data, outer * n * row};
        continue;
      }
      for (uint64_t o = 0; o < outer; o++)
        (*ext)[k++] = (kvti_ioplan_ext){
            off + o * n * row, (uint8_t *)t->data + (o * T + row0) * row,
            n * row};
    }
  }
  *next = k;
  return 0;
}

/* Plans chunk c's reads and, on io_uring, queues them and hands them to the
 * kernel at once (the portable engine runs them in complete(), on its
 * threads). */
static int issue(kvti_iobatch *b, inflight *f, opened *c, kvti_chunk_prefix *p,
                 uint64_t row0, uint8_t *scratch) {
  memset(f, 0, sizeof *f);
  f->c = c;
  f->row0 = row0;
  uint64_t T = c->h.n_layers ? (uint64_t)p->layers[0]
                                   .tensors[0]
                                   .shape[p->layers[0].tensors[0].ndim - 2]
                             : 0;
  f->scratch = row0 + c->h.n_tokens > T ? scratch : NULL;
  kvti_ioplan_ext *ext = NULL;
  size_t n = 0;
  int rc = chunk_extents(&ext, &n, c, p, row0, f->scratch);
  if (rc == 0)
    rc = kvti_ioplan_build(&f->plan, ext, n, c->fd, c->dfd, REQ_BYTES, 0);
  kvti_free(ext);
  if (rc || kvti_iobatch_backend(b) != KVT_IO_URING)
    return rc;
  int src = 0;
  for (size_t k = 0; rc == 0 && k < f->plan.n; k++) {
    rc = kvti_iobatch_push(b, &f->plan.reqs[k], KVTI_IOB_DEFER, "chunk");
    if (rc == 0 && (k + 1) % SUBMIT_REQS == 0)
      rc = kvti_iobatch_submit(b);
  }
  src = kvti_iobatch_submit(b);
  return rc ? rc : src;
}

/* Hashes request r's bytes (its buffer, or its segments in order). */
static int hash_req(kvti_blkhash *bh, const kvti_iob_req *r) {
  if (!r->iov)
    return kvti_blkhash_update(bh, r->buf, (size_t)r->len);
  int rc = 0;
  for (unsigned s = 0; rc == 0 && s < r->iovcnt; s++)
    rc = kvti_blkhash_update(bh, r->iov[s].iov_base, r->iov[s].iov_len);
  return rc;
}

/* Waits for f's reads in file order and verifies every block as it lands;
 * a scratch read is then copied into place. */
static int complete(kvti_iobatch *b, inflight *f, kvti_chunk_prefix *p) {
  kvti_blkhash *bh = NULL;
  int rc = kvti_blkhash_new(&bh, f->c->h.block_size, 0);
  if (rc == 0)
    kvti_blkhash_expect(bh, f->c->h.blocks, (size_t)f->c->h.n_blocks, "chunk");
  if (rc == 0 && kvti_iobatch_backend(b) != KVT_IO_URING)
    rc = kvti_iobatch_run(b, f->plan.reqs, f->plan.n, 0, "chunk");
  for (size_t k = 0; rc == 0 && k < f->plan.n; k++)
    if ((rc = kvti_iobatch_wait_req(b, &f->plan.reqs[k])) == 0)
      rc = hash_req(bh, &f->plan.reqs[k]);
  if (rc == 0)
    rc = kvti_blkhash_final(bh, NULL);
  kvti_blkhash_free(bh);
  if (rc == 0 && f->scratch)
    place(p, &f->c->h, f->scratch, f->row0);
  return rc;
}

int kvti_chunkstore_read_prefix(kvti_chunkstore *cs, const kvti_chain_rec *recs,
                                size_t m, const int32_t *tokens,
                                const kvti_chunk_read_opts *o,
                                kvti_chunk_prefix *out, size_t *bad_index) {
  if (!cs || !recs || m == 0 || !tokens || !o || !out)
    return KVT_ERR(KVT_EINVAL, "kvti_chunkstore_read_prefix: bad argument");
  memset(out, 0, sizeof *out);
  uint32_t C = recs[0].n_tokens;
  uint64_t rows = (uint64_t)m * C;
  if (o->total_rows && o->total_rows <= rows - C)
    return KVT_ERR(KVT_EINVAL, "chunked prefix: total_rows leaves a chunk "
                               "unused");
  if (o->total_rows)
    rows = o->total_rows;
  for (size_t i = 0; i < m; i++)
    if (recs[i].index != i || recs[i].n_tokens != C ||
        recs[i].layout_hash != recs[0].layout_hash ||
        (i && memcmp(recs[i].parent, recs[i - 1].key, 32)))
      return KVT_ERR(KVT_EINVAL, "chunked prefix: records are not a chain");
  kvti_chunk_prefix p;
  memset(&p, 0, sizeof p);
  size_t win = m < OPEN_WINDOW ? m : OPEN_WINDOW;
  opened *oc = kvti_calloc(win, sizeof *oc);
  kvti_iobatch *b = NULL;
  uint8_t *scratch = NULL;
  uint64_t scap = 1, have = 0; /* largest data section; bytes allocated */
  inflight *fl = kvti_calloc(AHEAD, sizeof *fl);
  kvti_bufpool *pool = kvti_bufpool_default();
  /* A private engine, deeper than the shared one, so the requests of
   * several chunk files are queued at once; the portable engine reads each
   * chunk's requests on a few threads instead. */
  kvti_iob_cfg cfg = KVTI_IOB_CFG_INIT;
  cfg.depth = DEPTH;
  cfg.chunk = (size_t)REQ_BYTES;
  cfg.threads = 4;
  int rc = oc && fl && pool ? kvti_iobatch_get_cfg(&b, &cfg) : KVT_ERR_NOMEM();
  if (rc)
    b = NULL;
  for (size_t w = 0; w < win; w++)
    oc[w].fd = oc[w].dfd = -1;
  size_t bad = 0;
  for (size_t w0 = 0; rc == 0 && w0 < m; w0 += win) {
    size_t wn = m - w0 < win ? m - w0 : win;
    /* Open (and check against its row and the prompt) every chunk of the
     * window before reading any data. */
    for (size_t k = 0; rc == 0 && k < wn; k++) {
      size_t i = w0 + k;
      if ((rc = kvti_chunkstore_open_chunk(cs, &recs[i], tokens + i * C,
                                           &oc[k].fd, &oc[k].h)) != 0) {
        oc[k].fd = -1;
        bad = i;
        break;
      }
      if (oc[k].h.n_layers != (i ? p.n_layers : oc[k].h.n_layers)) {
        rc = KVT_ERR(KVT_ECORRUPT, "chunk %zu: layer count differs", i);
        bad = i;
        break;
      }
      if (oc[k].h.data_bytes > scap)
        scap = oc[k].h.data_bytes;
      /* Buffers first (chunk 0 describes every layer; the others have the
       * same layout hash, so the same descriptor). */
      if (i == 0 && (rc = make_layers(&p, &oc[k].h, rows, o)) != 0)
        break;
      char path[4096];
      if (kvti_chunkstore_path(cs, recs[i].key, path, sizeof path) == 0)
        oc[k].dfd = direct_if_cold(&oc[k], path, o->page_cache);
    }
    /* Scratch only for a chunk kept in part (a trimmed read's last one). */
    if (rc == 0 && rows < (uint64_t)(w0 + wn) * C && scap > have) {
      kvti_bufpool_put(pool, scratch, (size_t)have);
      have = 0;
      if (!(scratch = kvti_bufpool_get(pool, (size_t)scap, NULL)))
        rc = KVT_ENOMEM;
      else
        have = scap;
    }
    /* Chunks ahead of the one being verified have their reads in flight:
     * up to AHEAD chunks and IN_FLIGHT_BYTES (always at least the next). */
    size_t next = 0, k = 0;
    uint64_t ahead = 0;
    int issue_failed = 0;
    for (; rc == 0 && k < wn; k++) {
      if (o->cancel && atomic_load(o->cancel)) {
        rc = KVT_ERR(KVT_ECANCELED, "promote cancelled");
        break;
      }
      while (rc == 0 && next < wn && next < k + AHEAD &&
             (next == k || ahead + oc[next].h.data_bytes <= IN_FLIGHT_BYTES)) {
        rc = issue(b, &fl[next % AHEAD], &oc[next], &p,
                   (uint64_t)(w0 + next) * C, scratch);
        ahead += oc[next].h.data_bytes;
        next++;
      }
      if (rc) {
        issue_failed = 1;
        break;
      }
      inflight *cur = &fl[k % AHEAD];
      if ((rc = complete(b, cur, &p)) != 0) {
        bad = w0 + k;
        break;
      }
      ahead -= oc[k].h.data_bytes;
      p.bytes_read += oc[k].h.header_bytes + oc[k].h.data_bytes;
      kvti_ioplan_free(&cur->plan);
      close_opened(&oc[k]);
    }
    if (b && rc)
      kvti_iobatch_wait_all(b); /* nothing in flight before buffers go */
    /* A failure seen while queueing may be any queued chunk's: blame the
     * first whose read failed. */
    for (size_t s = k; issue_failed && s < next; s++) {
      const kvti_ioplan *pl = &fl[s % AHEAD].plan;
      size_t q = 0;
      while (q < pl->n &&
             (pl->reqs[q].status == 0 || pl->reqs[q].status == KVT_ECANCELED))
        q++;
      if (q < pl->n) {
        bad = w0 + s;
        break;
      }
    }
    for (int s = 0; s < AHEAD; s++)
      kvti_ioplan_free(&fl[s].plan);
    for (size_t c = 0; c < wn; c++)
      close_opened(&oc[c]);
  }
  if (rc && bad_index)
    *bad_index = bad;
  kvti_iobatch_put(b); /* back to the cache: no ring set up per promote */
  kvti_bufpool_put(pool, scratch, (size_t)have);
  kvti_free(oc);
  kvti_free(fl);
  if (rc) {
    kvti_chunk_prefix_free(&p, o);
    return rc;
  }
  *out = p;
  return 0;
}
