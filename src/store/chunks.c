/*
 * chunks.c - the chunk store (chunks.h): names chunk files (chunks/<kk>/ with
 * kk the key's first two hex digits: 256 directories, so a million chunks
 * make about 4000 files per directory), writes the missing chunks of a spill
 * durably and only then indexes them, opens chunks for verified reads and
 * removes chains rows-first. Directories are created lazily and, with
 * durability FSYNC, their parent is fsynced when one is created, so a chunk
 * that was acknowledged survives a power loss with its directory entry.
 */
#include "store/chunks.h"

#include "base/error.h"
#include "base/hash.h"
#include "base/io.h"

#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

struct kvti_chunkstore {
  char *dir; /* <cache_dir>/chunks */
  kvti_chunkstore_opts o;
  kvti_chains *chains;
  int dir_ok; /* chunks/ known to exist */
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
  if (!(cs->dir = kvti_path_join(cache_dir, "chunks")))
    rc = KVT_ENOMEM;
  if (rc == 0)
    rc = kvti_chains_open(&cs->chains, idx);
  if (rc) {
    kvti_free(cs->dir);
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
  kvti_free(cs->dir);
  kvti_free(cs);
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
  char h[65];
  kvti_hex32(h, key);
  int n = snprintf(out, cap, "%s/%.2s/%s.kvc", cs->dir, h, h);
  if (n < 0 || (size_t)n >= cap)
    return KVT_ERR(KVT_ERANGE, "chunk path too long");
  return 0;
}

int kvti_chunk_file_key(uint8_t key[32], const char *name) {
  char hex[65];
  if (strlen(name) != 68 || strcmp(name + 64, ".kvc") != 0)
    return -1;
  memcpy(hex, name, 64);
  hex[64] = '\0';
  return kvti_unhex32(key, hex) == 0 ? 0 : -1;
}

/* Creates dir if missing; with do_fsync the parent is fsynced after a
 * creation, so the new directory entry is durable before chunks go in. */
static int ensure_dir(const kvti_chunkstore *cs, const char *dir,
                      const char *parent) {
  struct stat st;
  int rc = kvti_lstat(dir, &st);
  if (rc == 0)
    return S_ISDIR(st.st_mode)
               ? 0
               : KVT_ERR(KVT_EPERM, "%s is not a directory", dir);
  if (rc != KVT_ENOTFOUND)
    return rc;
  if ((rc = kvti_mkdir(dir, cs->o.dir_mode)) != 0)
    return rc;
  return cs->o.do_fsync ? kvti_fsync_dir(parent) : 0;
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
  char path[4096], tmp[4200], sub[4096];
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
    snprintf(sub, sizeof sub, "%.*s", (int)(strrchr(path, '/') - path), path);
    snprintf(tmp, sizeof tmp, "%.*s.tmp", (int)(strlen(path) - 4), path);
    if (!cs->dir_ok) {
      char *root = kvti_strdup(cs->dir);
      char *sl = root ? strrchr(root, '/') : NULL;
      if (!root)
        rc = KVT_ERR_NOMEM();
      else {
        if (sl)
          *sl = 0;
        rc = ensure_dir(cs, cs->dir, sl ? root : ".");
      }
      kvti_free(root);
      if (rc)
        break;
      cs->dir_ok = 1;
    }
    if ((rc = ensure_dir(cs, sub, cs->dir)) != 0)
      break;
    src.parent = parent;
    src.index = i;
    src.tokens = tk;
    src.row0 = (uint64_t)i * C;
    kvti_chunk_written w;
    if ((rc = kvti_chunk_write(path, tmp, &src, cs->o.file_mode, cs->o.do_fsync,
                               &w)) != 0)
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
  int prc = kvti_chains_put(cs->chains, recs, nnew);
  if (prc) {
    /* Not indexed: remove the files so nothing unaccounted stays. */
    for (size_t i = 0; i < nnew; i++)
      if (kvti_chunkstore_path(cs, recs[i].key, path, sizeof path) == 0)
        kvti_unlink(path);
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

int kvti_chunkstore_open_chunk(kvti_chunkstore *cs, const kvti_chain_rec *rec,
                               const int32_t *tokens, int *fd,
                               kvti_chunk_hdr *h) {
  char path[4096];
  int rc = kvti_chunkstore_path(cs, rec->key, path, sizeof path);
  if (rc)
    return rc;
  if ((rc = kvti_chunk_open(fd, h, path, rec->key, rec->layout_hash)) != 0)
    return rc;
  if (h->index != rec->index || h->n_tokens != rec->n_tokens ||
      memcmp(h->parent, rec->parent, 32) != 0)
    rc = KVT_ERR(KVT_ECORRUPT, "%s: chunk header differs from its chain row",
                 path);
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
  char path[4096];
  /* Rows are gone: no lookup reaches these files any more. A reader that
   * opened one already keeps its descriptor. */
  for (size_t i = 0; rc == 0 && i < nr; i++) {
    b += rem[i].disk_bytes;
    if (kvti_chunkstore_path(cs, rem[i].key, path, sizeof path) == 0) {
      int urc = kvti_unlink(path);
      (void)urc; /* a missing file is fine; another error leaves an orphan
                    that gc removes */
    }
  }
  kvti_free(rem);
  if (n)
    *n = rc ? 0 : nr;
  if (bytes)
    *bytes = rc ? 0 : b;
  return rc;
}
