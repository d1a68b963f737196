/*
 * chunkstore.c - the chunk store (chunkstore.h): places chunk files where
 * the cache directory's layout names them (chunks/<kk>/<key>.kvc,
 * store/local_layout.h), writes the missing
 * chunks of a spill durably and only then indexes them, opens chunks for
 * verified reads and removes chains rows-first. Directories are created lazily
 * and, with durability FSYNC, their parent is fsynced when one is created, so a
 * chunk that was acknowledged survives a power loss with its directory entry.
 */
#include "store/local_layout.h"
#include "store/chunkstore.h"

#include "base/error.h"
#include "base/hash.h"
#include "base/io.h"
#include "store/local_dir.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

struct kvti_chunkstore {
  char *dir;   /* <cache_dir>/chunks */
  char *cache; /* <cache_dir>, for messages */
  int root_fd; /* cache_dir itself: reads and removals walk from here */
  kvti_chunkstore_opts o;
  kvti_chains *chains;
};

int kvti_chunkstore_open(kvti_chunkstore **out, const char *cache_dir,
                         kvt_index *idx, const kvti_chunkstore_opts *o) {
  if (!out || !cache_dir || !idx || !o)
    return KVT_ERR(KVT_EINVAL, "kvti_chunkstore_open: NULL argument");
  *out = NULL;
  kvti_chunkstore *cs = kvti_calloc(1, sizeof *cs);
  if (!cs)
    return KVT_ERR_NOMEM();
  cs->o = *o;
  int rc = 0;
  cs->root_fd = kvti_dir_open_root(cache_dir);
  if (cs->root_fd < 0)
    rc = cs->root_fd;
  if (rc == 0 && (!(cs->dir = kvti_path_join(cache_dir, KVTI_LOCAL_CHUNKS)) ||
                  !(cs->cache = kvti_strdup(cache_dir))))
    rc = KVT_ENOMEM;
  if (rc == 0)
    rc = kvti_chains_open(&cs->chains, idx);
  if (rc) {
    if (cs->root_fd >= 0)
      kvti_close(cs->root_fd);
    kvti_free(cs->dir);
    kvti_free(cs->cache);
    kvti_free(cs);
    return rc;
  }
  *out = cs;
  return 0;
}

void kvti_chunkstore_close(kvti_chunkstore *cs) {
  if (!cs)
    return;
  kvti_chains_close(cs->chains);
  kvti_close(cs->root_fd);
  kvti_free(cs->dir);
  kvti_free(cs->cache);
  kvti_free(cs);
}

int kvti_chunkstore_open_subdir(kvti_chunkstore *cs, unsigned kk) {
  char rel[16];
  int rc = kvti_local_chunk_dir_rel(rel, sizeof rel, kk);
  return rc ? rc : kvti_dir_open_rel(cs->root_fd, rel, cs->cache);
}

int kvti_chunkstore_make_subdir(kvti_chunkstore *cs, unsigned kk) {
  char rel[16];
  int rc = kvti_local_chunk_dir_rel(rel, sizeof rel, kk & 0xffu);
  return rc ? rc
            : kvti_dir_open_mk(cs->root_fd, rel, cs->o.dir_mode, cs->o.do_fsync,
                               cs->cache);
}

void kvti_chunkstore_sweep_pos_get(kvti_chunkstore *cs, unsigned *kk,
                                   uint64_t *cursor) {
  *kk = 0;
  *cursor = 0;
  int dfd = kvti_chunkstore_open_subdir(cs, 256);
  if (dfd < 0) {
    kvt_clear_error();
    return;
  }
  int fd =
      kvti_openat(dfd, KVTI_LOCAL_SWEEP_POS, O_RDONLY, 0, KVTI_LOCAL_SWEEP_POS);
  kvti_close(dfd);
  if (fd < 0) {
    kvt_clear_error();
    return;
  }
  char buf[64];
  size_t len = 0;
  char *text = NULL;
  if (kvti_read_fd(&text, &len, fd, KVTI_LOCAL_SWEEP_POS, sizeof buf, NULL) ==
      0) {
    unsigned k = 0;
    unsigned long long c = 0;
    if (sscanf(text, "%u %llu", &k, &c) == 2 && k < 256) {
      *kk = k;
      *cursor = c;
    }
  } else {
    kvt_clear_error(); /* damaged or planted: start over */
  }
  kvti_free(text);
  kvti_close(fd);
}

int kvti_chunkstore_sweep_pos_set(kvti_chunkstore *cs, unsigned kk,
                                  uint64_t cursor) {
  int dfd = kvti_chunkstore_open_subdir(cs, 256);
  if (dfd < 0)
    return dfd;
  char buf[64];
  int n = snprintf(buf, sizeof buf, "%u %llu\n", kk % 256,
                   (unsigned long long)cursor);
  /* Rewritten in place (O_TRUNC): losing it to a crash costs only a pass
   * started over, so it is not fsynced. */
  int fd = kvti_openat(dfd, KVTI_LOCAL_SWEEP_POS, O_WRONLY | O_CREAT | O_TRUNC,
                       cs->o.file_mode, KVTI_LOCAL_SWEEP_POS);
  kvti_close(dfd);
  if (fd < 0)
    return fd;
  int rc = kvti_pwrite_all(fd, buf, (size_t)n, 0, KVTI_LOCAL_SWEEP_POS);
  kvti_close(fd);
  return rc;
}

int kvti_chunkstore_root_fd(const kvti_chunkstore *cs) {
  return cs->root_fd;
}

int kvti_chunkstore_unlink_rel(kvti_chunkstore *cs, const char *rel) {
  return kvti_dir_unlink_rel(cs->root_fd, rel, cs->cache);
}

int kvti_chunkstore_unlink(kvti_chunkstore *cs, const uint8_t key[32]) {
  char rel[96];
  int rc = kvti_local_chunk_rel(rel, sizeof rel, key);
  return rc ? rc : kvti_chunkstore_unlink_rel(cs, rel);
}

kvti_chains *kvti_chunkstore_chains(kvti_chunkstore *cs) {
  return cs->chains;
}

void kvti_chunkstore_get_opts(const kvti_chunkstore *cs,
                              kvti_chunkstore_opts *o) {
  *o = cs->o;
}

int kvti_chunkstore_path(const kvti_chunkstore *cs, const uint8_t key[32],
                         char *out, size_t cap) {
  return kvti_local_chunk_path(out, cap, cs->dir, key);
}

/* Rows every listed layer holds as valid KV: min(n, offsets, shape[-2]). */
static uint64_t valid_rows(const kvti_chunkstore_spill *sp) {
  uint64_t rows = sp->n;
  for (uint32_t i = 0; i < sp->n_layers; i++) {
    const kvt_layer *l = &sp->layers[sp->layer_ids[i]];
    if (l->offset == KVT_ABSENT ? l->kind != KVT_LAYER_QUANTIZED_KV
                                : l->offset < 0)
      return 0;
    if (l->offset != KVT_ABSENT && (uint64_t)l->offset < rows)
      rows = (uint64_t)l->offset;
    for (uint32_t j = 0; j < l->num_tensors; j++) {
      const kvt_tensor *t = &l->tensors[j];
      if (t->ndim < 2 || t->shape[t->ndim - 2] < 0)
        return 0;
      if ((uint64_t)t->shape[t->ndim - 2] < rows)
        rows = (uint64_t)t->shape[t->ndim - 2];
    }
  }
  return rows;
}

int kvti_chunkstore_put(kvti_chunkstore *cs, const kvti_chunkstore_spill *sp,
                        kvti_chunkstore_result *res) {
  if (!cs || !sp || !res || (!sp->tokens && sp->n) || !sp->layers ||
      !sp->layer_ids || sp->n_layers == 0 || (!sp->ns && sp->ns_len))
    return KVT_ERR(KVT_EINVAL, "kvti_chunkstore_put: bad argument");
  if (!kvti_chunk_tokens_ok(sp->chunk_tokens))
    return KVT_ERR(
        KVT_EINVAL, "chunk_tokens %u: must be a power of two in [%u, %u]",
        sp->chunk_tokens, KVTI_CHUNK_TOKENS_MIN, KVTI_CHUNK_TOKENS_MAX);
  memset(res, 0, sizeof *res);
  const uint32_t C = sp->chunk_tokens;
  /* Token i is row i: only rows valid in every layer are chunked (a layer
   * whose offset or shape[-2] is short of the entry's tokens limits the
   * chain; nothing is ever shifted). */
  size_t m = (size_t)(valid_rows(sp) / C);
  if (m == 0)
    return 0;
  kvti_chunk_src src = {.ns = sp->ns,
                        .ns_len = sp->ns_len,
                        .tokens = sp->tokens,
                        .n = C,
                        .layers = sp->layers,
                        .layer_ids = sp->layer_ids,
                        .n_layers = sp->n_layers,
                        .spill_layers = sp->spill_layers};
  /* Pure: the chain holds every layer and none needs attributes kept in the
   * entry (rotating), so any chunk boundary is a complete prefix state. */
  int pure = sp->n_layers == sp->spill_layers;
  for (uint32_t i = 0; pure && i < sp->n_layers; i++)
    pure = sp->layers[sp->layer_ids[i]].kind != KVT_LAYER_ROTATING_KV;
  uint8_t seed[32];
  src.parent = seed; /* any 32 bytes: the layout does not depend on it */
  int rc = kvti_chunk_layout_hash(&res->layout_hash, &src);
  if (rc == 0)
    rc = kvti_chunk_seed(seed, sp->ns, sp->ns_len, res->layout_hash);
  if (rc)
    return rc;
  kvti_chain_rec *recs = kvti_malloc(m * sizeof *recs);
  if (!recs)
    return KVT_ERR_NOMEM();
  size_t nnew = 0;
  uint8_t parent[32];
  memcpy(parent, seed, 32);
  kvti_ck ck = kvti_ck_seed(sp->ns, sp->ns_len);
  char path[4096];
  for (size_t i = 0; rc == 0 && i < m; i++) {
    const int32_t *tk = sp->tokens + i * C;
    uint8_t key[32];
    ck = kvti_ck_next(ck, tk, C);
    if ((rc = kvti_chunk_key(key, parent, tk, C)) != 0)
      break;
    int rewrite = 0;
    if (kvti_chains_find(cs->chains, key, NULL)) {
      /* Stored once, never again - unless its file was found damaged and
       * moved aside: the same content-addressed file is written again (the
       * row, the chunks below and the entries through it were kept). */
      if (!kvti_chains_is_damaged(cs->chains, key)) {
        memcpy(parent, key, 32);
        continue;
      }
      rewrite = 1;
    }
    if ((rc = kvti_chunkstore_path(cs, key, path, sizeof path)) != 0)
      break;
    /* Written into chunks/<kk> reached from cache_dir's descriptor (made
     * when missing, links refused): a chunks/ or chunks/<kk> swapped for a
     * link is never written through. */
    char name[KVTI_LOCAL_CHUNK_NAME_MAX], tmpname[KVTI_LOCAL_CHUNK_NAME_MAX];
    kvti_local_chunk_name(name, key, 0);
    kvti_local_chunk_name(tmpname, key, 1);
    int dfd = kvti_chunkstore_make_subdir(cs, key[0]);
    if (dfd < 0) {
      rc = dfd;
      break;
    }
    src.parent = parent;
    src.index = i;
    src.tokens = tk;
    src.row0 = (uint64_t)i * C;
    kvti_chunk_written w;
    rc = kvti_chunk_write_at(dfd, name, tmpname, path, &src, cs->o.file_mode,
                             cs->o.do_fsync, &w);
    kvti_close(dfd);
    if (rc)
      break;
    if (rewrite) {
      kvti_chains_set_damaged(cs->chains, key, 0);
      res->rewritten++;
      res->bytes_written += w.size;
      memcpy(parent, key, 32);
      continue;
    }
    kvti_chain_rec *r = &recs[nnew++];
    memset(r, 0, sizeof *r);
    memcpy(r->key, w.key, 32);
    memcpy(r->parent, parent, 32);
    r->ck = ck;
    r->layout_hash = w.layout_hash;
    r->index = i;
    r->n_tokens = C;
    r->pure = (uint8_t)pure;
    r->disk_bytes = w.size;
    r->mem_bytes = w.mem_bytes;
    res->bytes_written += w.size;
    memcpy(parent, key, 32);
  }
  /* Index what was written, even after a failure: those chunks are durable
   * and form a chain from the seed (each one's parent is indexed or earlier
   * in recs), so they are safe to share. */
  /* The spill's record rides on the same commit when its chain is whole:
   * its files are durable, so the record never names a missing chunk. */
  kvti_chained_entry *e = NULL;
  if (rc == 0 && sp->rec) {
    e = sp->rec;
    e->chunks = m;
    memcpy(e->last_key, parent, 32);
    e->layout_hash = res->layout_hash;
  }
  int prc = kvti_chains_put_with_entry(cs->chains, recs, nnew, e);
  res->recorded = prc == 0 && e != NULL;
  if (prc) {
    /* Not indexed: remove the files so nothing unaccounted stays. */
    for (size_t i = 0; i < nnew; i++)
      kvti_chunkstore_unlink(cs, recs[i].key);
    res->bytes_written = 0;
    nnew = 0;
    if (!rc)
      rc = prc;
  }
  res->written = nnew;
  if (rc == 0) {
    res->chunks = m;
    memcpy(res->last_key, parent, 32);
  }
  kvti_free(recs);
  return rc;
}

int kvti_chunkstore_lookup(kvti_chunkstore *cs, const uint8_t *ns,
                           size_t ns_len, const int32_t *tokens, size_t n,
                           uint32_t chunk_tokens, kvti_chain_rec *out,
                           size_t max, size_t *m) {
  if (!kvti_chunk_tokens_ok(chunk_tokens))
    return KVT_ERR(KVT_EINVAL, "chunk_tokens %u invalid", chunk_tokens);
  return kvti_chains_lookup(cs->chains, ns, ns_len, tokens, n, chunk_tokens,
                            out, max, m);
}

int kvti_chunkstore_open_key(kvti_chunkstore *cs, const uint8_t key[32],
                             uint64_t layout, int *fd, kvti_chunk_hdr *h) {
  char path[4096];
  memset(h, 0, sizeof *h);
  int rc = kvti_chunkstore_path(cs, key, path, sizeof path);
  if (rc)
    return rc;
  /* From cache_dir's descriptor, never through a link: a chunks/ or
   * chunks/<kk> swapped for one is refused (KVT_EPERM). */
  int dfd = kvti_chunkstore_open_subdir(cs, key[0]);
  if (dfd < 0)
    return dfd;
  const char *name = strrchr(path, '/') + 1;
  int ffd = kvti_openat(dfd, name, O_RDONLY, 0, path);
  struct stat st;
  if (ffd == KVT_EPERM && kvti_lstatat(dfd, name, &st, path) == 0 &&
      S_ISLNK(st.st_mode))
    /* kvtier never makes a link: one where an indexed chunk belongs is a
     * damaged chunk (quarantined - the link itself moves, its target is
     * never touched), not a permission problem that would last for ever. */
    ffd = KVT_ERR(KVT_ECORRUPT,
                  "%s is a symbolic link, not a chunk file "
                  "(never followed)",
                  path);
  kvti_close(dfd);
  if (ffd < 0)
    return ffd;
  return kvti_chunk_open_fd(ffd, fd, h, path, key, layout);
}

int kvti_chunkstore_read_bytes(kvti_chunkstore *cs, const uint8_t key[32],
                               char **out, size_t *len, size_t max) {
  char path[4096];
  int rc = kvti_chunkstore_path(cs, key, path, sizeof path);
  if (rc)
    return rc;
  int dfd = kvti_chunkstore_open_subdir(cs, key[0]);
  if (dfd < 0)
    return dfd;
  int fd = kvti_openat(dfd, strrchr(path, '/') + 1, O_RDONLY, 0, path);
  kvti_close(dfd);
  if (fd < 0)
    return fd;
  struct stat st;
  if (kvti_io->fstat(fd, &st) != 0)
    rc = KVT_ERR_OS(errno, "stat %s", path);
  else if (kvti_file_sparse(&st))
    rc = KVT_ERR(KVT_ECORRUPT, "%s is sparse (%lld bytes, mostly holes)", path,
                 (long long)st.st_size);
  else
    rc = kvti_read_fd(out, len, fd, path, max, NULL);
  kvti_close(fd);
  return rc;
}

int kvti_chunkstore_open_chunk(kvti_chunkstore *cs, const kvti_chain_rec *rec,
                               const int32_t *tokens, int *fd,
                               kvti_chunk_hdr *h) {
  char path[4096];
  int rc = kvti_chunkstore_path(cs, rec->key, path, sizeof path);
  if (rc)
    return rc;
  if ((rc = kvti_chunkstore_open_key(cs, rec->key, rec->layout_hash, fd, h)) !=
      0)
    return rc;
  if (h->index != rec->index || h->n_tokens != rec->n_tokens ||
      memcmp(h->parent, rec->parent, 32) != 0)
    rc = KVT_ERR(KVT_ECORRUPT, "%s: chunk header differs from its chain row",
                 path);
  else if ((rec->mem_bytes != kvti_chunk_hdr_mem_bytes(h) &&
            rec->mem_bytes != h->data_bytes) ||
           (uint64_t)h->header_bytes + h->data_bytes != rec->disk_bytes)
    /* The row's sizes are what a promote reserved and what the reader
     * allocates by: a header promising more (or less) is refused before any
     * buffer is sized from it. memory_bytes is the rows' dense size; rows
     * written before it was (the packed data bytes, equal for unquantized
     * chunks) still match their own header. */
    rc = KVT_ERR(KVT_ECORRUPT,
                 "%s: chunk sizes (%llu data, %llu file bytes) differ from "
                 "its chain row's (%llu, %llu)",
                 path, (unsigned long long)h->data_bytes,
                 (unsigned long long)h->header_bytes + h->data_bytes,
                 (unsigned long long)rec->mem_bytes,
                 (unsigned long long)rec->disk_bytes);
  else if (tokens &&
           memcmp(h->tokens, tokens, (size_t)h->n_tokens * sizeof *tokens))
    rc = KVT_ERR(KVT_ECORRUPT, "%s: chunk tokens differ from the prompt", path);
  if (rc) {
    kvti_chunk_hdr_free(h);
    kvti_close(*fd);
    *fd = -1;
  }
  return rc;
}

int kvti_chunkstore_remove(kvti_chunkstore *cs, const uint8_t key[32],
                           size_t *n, uint64_t *bytes) {
  kvti_chain_rec *rem = NULL;
  size_t nr = 0;
  int rc = kvti_chains_remove_tree(cs->chains, key, &rem, &nr);
  uint64_t b = 0;
  /* Rows are gone: no lookup reaches these files any more. A reader that
   * opened one already keeps its descriptor. */
  for (size_t i = 0; rc == 0 && i < nr; i++) {
    b += rem[i].disk_bytes;
    int urc = kvti_chunkstore_unlink(cs, rem[i].key);
    (void)urc; /* a missing file is fine; another error leaves an orphan that
                  gc removes */
  }
  kvti_free(rem);
  if (n)
    *n = rc ? 0 : nr;
  if (bytes)
    *bytes = rc ? 0 : b;
  return rc;
}
