/*
 * chunkstore_rebuild.c - the chain table rebuilt from the chunk files alone, so
 * index.db is never the only copy of what the chunked store holds (as for
 * whole entries, recover.c in the tier). Every chunk file carries its key, its
 * parent's key, its position, its tokens, the namespace and the KV layout
 * (docs/FORMAT.md section 10), and its key is the SHA-256 of parent + tokens,
 * so a file whose header parses and whose key matches its name can be indexed
 * again exactly as it was written. Chunks are indexed parents first (in order
 * of position): a chunk whose parent is neither indexed nor rebuilt (its chain
 * was cut) is left out, so nothing reachable ever has a missing ancestor.
 * Runs only when the index was rebuilt (missing, damaged, or `kvtier
 * reindex`), never at an ordinary open: it lists every chunk file.
 */
#include "store/local_layout.h"
#include "store/chunkstore.h"

#include "base/error.h"
#include "base/hash.h"
#include "base/io.h"
#include "base/vec.h"
#include "format/chunk.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* Chunks indexed per SQLite transaction. */
#define REBUILD_BATCH 4096

typedef struct found {
  uint8_t key[32], parent[32];
  uint64_t index;
  int ok; /* indexed by this rebuild (its ck is valid) */
  kvti_ck ck;
} found;

typedef struct found_v {
  found *v;
  size_t n, cap;
} found_v;

static int push(found_v *f, const kvti_chunk_hdr *h) {
  int rc = KVTI_VEC_RESERVE(&f->v, &f->cap, f->n + 1, 1024);
  if (rc)
    return rc;
  found *e = &f->v[f->n++];
  memset(e, 0, sizeof *e);
  memcpy(e->key, h->key, 32);
  memcpy(e->parent, h->parent, 32);
  e->index = h->index;
  return 0;
}

static int by_index(const void *a, const void *b) {
  const found *x = a, *y = b;
  if (x->index != y->index)
    return x->index < y->index ? -1 : 1;
  return memcmp(x->key, y->key, 32);
}

static int by_key(const void *a, const void *b) {
  const found *const *x = a, *const *y = b;
  return memcmp((*x)->key, (*y)->key, 32);
}

/* Pass 1: every chunks/<kk>/<key>.kvc whose header is valid and names its
 * own key, not indexed yet. Unreadable or invalid files are left for gc. */
static int scan(kvti_chunkstore *cs, found_v *f, size_t *bad) {
  /* Listed and opened from cache_dir's descriptor without following links:
   * a linked chunks/ or chunks/<kk> contributes nothing. */
  int rfd = kvti_chunkstore_open_subdir(cs, 256);
  DIR *d = rfd >= 0 ? kvti_fdopendir(rfd) : NULL;
  if (!d) {
    if (rfd >= 0)
      kvti_close(rfd);
    kvt_clear_error();
    return 0; /* no chunks/ yet (or not one to trust): nothing to rebuild */
  }
  int rc = 0;
  struct dirent *de;
  while (rc == 0 && (de = kvti_io->readdir(d)) != NULL) {
    if (strlen(de->d_name) != 2 || strspn(de->d_name, "0123456789abcdef") != 2)
      continue;
    int sfd = kvti_chunkstore_open_subdir(
        cs, (unsigned)strtoul(de->d_name, NULL, 16));
    DIR *sd = sfd >= 0 ? kvti_fdopendir(sfd) : NULL;
    if (!sd) {
      if (sfd >= 0)
        kvti_close(sfd);
      kvt_clear_error();
      continue;
    }
    struct dirent *fe;
    while (rc == 0 && (fe = kvti_io->readdir(sd)) != NULL) {
      const char *nm = fe->d_name;
      uint8_t key[32];
      if (kvti_local_chunk_key(key, nm) != 0 ||
          kvti_chains_find(kvti_chunkstore_chains(cs), key, NULL))
        continue;
      char path[4200]; /* for messages: the layout's name of that key */
      if (kvti_chunkstore_path(cs, key, path, sizeof path) != 0) {
        (*bad)++;
        kvt_clear_error();
        continue;
      }
      int fd = -1;
      kvti_chunk_hdr h;
      memset(&h, 0, sizeof h);
      int orc = kvti_openat(sfd, nm, O_RDONLY, 0, path);
      if (orc >= 0)
        orc = kvti_chunk_open_fd(orc, &fd, &h, path, key, 0);
      if (orc == 0) {
        rc = push(f, &h);
        kvti_chunk_hdr_free(&h);
        kvti_close(fd);
      } else if (orc == KVT_ENOMEM) {
        rc = orc;
      } else {
        (*bad)++;
        kvt_clear_error();
      }
    }
    kvti_io->closedir(sd);
  }
  kvti_io->closedir(d);
  return rc;
}

int kvti_chunk_rec_of(kvti_chain_rec *r, const kvti_chunk_hdr *h,
                      const kvti_ck *parent_ck, uint64_t file_size,
                      const char *path) {
  if (h->index == 0) {
    uint8_t seed[32];
    int rc = kvti_chunk_seed(seed, h->ns, h->ns_len, h->layout_hash);
    if (rc)
      return rc;
    if (memcmp(seed, h->parent, 32) != 0)
      return KVT_ERR(KVT_ECORRUPT,
                     "%s: first chunk whose parent is not its chain's seed",
                     path);
  }
  kvti_ck base = h->index == 0 ? kvti_ck_seed(h->ns, h->ns_len) : *parent_ck;
  memset(r, 0, sizeof *r);
  memcpy(r->key, h->key, 32);
  memcpy(r->parent, h->parent, 32);
  r->ck = kvti_ck_next(base, h->tokens, h->n_tokens);
  r->layout_hash = h->layout_hash;
  r->index = h->index;
  r->n_tokens = h->n_tokens;
  int pure = h->n_layers == h->spill_layers;
  for (uint32_t i = 0; pure && i < h->n_layers; i++)
    pure = h->layers[i].kind != KVT_LAYER_ROTATING_KV;
  r->pure = (uint8_t)pure;
  r->disk_bytes = file_size;
  r->mem_bytes = kvti_chunk_hdr_mem_bytes(h);
  return 0;
}

/* Pass 2 for one chunk (its parent already placed): the full row. */
static int make_rec(kvti_chunkstore *cs, found *e, const kvti_ck *parent_ck,
                    kvti_chain_rec *r) {
  char path[4096];
  int rc = kvti_chunkstore_path(cs, e->key, path, sizeof path);
  if (rc)
    return rc;
  int fd = -1;
  kvti_chunk_hdr h;
  memset(&h, 0, sizeof h);
  if ((rc = kvti_chunkstore_open_key(cs, e->key, 0, &fd, &h)) != 0)
    return rc;
  struct stat st;
  if (kvti_io->fstat(fd, &st) != 0)
    rc = KVT_ERR_OS(errno, "fstat %s", path);
  if (rc == 0)
    rc = kvti_chunk_rec_of(r, &h, parent_ck, (uint64_t)st.st_size, path);
  if (rc == 0)
    e->ck = r->ck;
  kvti_chunk_hdr_free(&h);
  kvti_close(fd);
  return rc;
}

int kvti_chunkstore_rebuild(kvti_chunkstore *cs, size_t *indexed,
                            size_t *skipped) {
  *indexed = *skipped = 0;
  found_v f = {0};
  size_t bad = 0;
  int rc = scan(cs, &f, &bad);
  found **byk = NULL;
  kvti_chain_rec *batch = NULL;
  if (rc == 0 && f.n) {
    qsort(f.v, f.n, sizeof *f.v, by_index);
    byk = kvti_malloc(f.n * sizeof *byk);
    batch = kvti_malloc(REBUILD_BATCH * sizeof *batch);
    if (!byk || !batch)
      rc = KVT_ERR_NOMEM();
  }
  if (rc == 0 && f.n) {
    for (size_t i = 0; i < f.n; i++)
      byk[i] = &f.v[i];
    qsort(byk, f.n, sizeof *byk, by_key);
  }
  size_t nb = 0;
  kvti_chains *ch = kvti_chunkstore_chains(cs);
  for (size_t i = 0; rc == 0 && i < f.n; i++) {
    found *e = &f.v[i];
    kvti_ck pck = {0, 0};
    int placed = e->index == 0;
    if (!placed) {
      kvti_chain_rec pr;
      found key, *kp = &key, **hit;
      memcpy(key.key, e->parent, 32);
      if (kvti_chains_find(ch, e->parent, &pr)) {
        placed = pr.index + 1 == e->index;
        pck = pr.ck;
      } else if ((hit = bsearch(&kp, byk, f.n, sizeof *byk, by_key)) &&
                 (*hit)->ok && (*hit)->index + 1 == e->index) {
        placed = 1;
        pck = (*hit)->ck;
      }
    }
    if (!placed) {
      (*skipped)++; /* its chain is cut: unreachable, gc's to remove */
      continue;
    }
    int r = make_rec(cs, e, &pck, &batch[nb]);
    if (r == KVT_ENOMEM) {
      rc = r;
      break;
    }
    if (r != 0) {
      (*skipped)++;
      kvt_clear_error();
      continue;
    }
    e->ok = 1;
    /* A child may be in this batch with its parent: kvti_chains_put takes
     * parents earlier in the same batch. */
    if (++nb == REBUILD_BATCH) {
      rc = kvti_chains_put(ch, batch, nb);
      *indexed += rc == 0 ? nb : 0;
      nb = 0;
    }
  }
  if (rc == 0 && nb) {
    rc = kvti_chains_put(ch, batch, nb);
    *indexed += rc == 0 ? nb : 0;
  }
  *skipped += bad;
  kvti_free(batch);
  kvti_free(byk);
  kvti_free(f.v);
  return rc;
}
