/*
 * chunkstore_write.c - a spill's chain written into the chunk store
 * (chunkstore.h): kvti_chunkstore_put, and the batch in steps behind it that
 * the writer's group commit drives for several spills at once. The missing
 * chunks are written under <key>.tmp into one write group (engine/syncset.h),
 * and only once the set's round of file fsyncs returned are they renamed to
 * <key>.kvc; their directories (chunks/<kk>, and chunks/ and cache_dir when a
 * directory was made) are fsynced in the set's next round, and only then are
 * rows inserted. So every indexed chunk has its durable file and every
 * ancestor (parents are indexed by an earlier spill of the batch, or earlier
 * in the same transaction), and a crash leaves only unindexed files (gc
 * removes them) or stale tmp files (removed when written again, or by gc).
 */
#include "store/chunkstore.h"
#include "store/local_layout.h"

#include "base/error.h"
#include "base/io.h"
#include "base/vec.h"
#include "engine/syncset.h"

#include <stdio.h>
#include <string.h>

/* A chunk file the batch wrote. */
typedef struct wfile {
  uint8_t key[32];
  size_t member;
  int rewrite; /* an indexed chunk marked damaged, written again */
  int state;   /* 0 under its tmp name, 1 renamed into place */
} wfile;

/* A spill of the batch: its new rows are recs[first, first + n). */
typedef struct wmember {
  size_t first, n;
  int indexed;
} wmember;

struct kvti_chunkstore_batch {
  kvti_chunkstore *cs;
  kvti_syncset *set;
  kvti_chunkstore_opts o;
  int dirfd[256]; /* chunks/<kk> as the batch opened it, -1: not yet */
  int chunks_fd;  /* chunks/ itself, when the batch made a directory */
  int made;       /* a directory was created: its parents join the round */
  int root_added; /* cache_dir joined the round (for chunks/'s name) */
  wfile *files;
  size_t nfiles, capfiles;
  kvti_chain_rec *recs;
  size_t nrecs, caprecs;
  wmember *members;
  size_t nmembers, capmembers;
};

int kvti_chunkstore_batch_new(kvti_chunkstore_batch **out, kvti_chunkstore *cs,
                              kvti_syncset *set) {
  *out = NULL;
  if (!cs || !set)
    return KVT_ERR(KVT_EINVAL, "chunk batch: NULL store or set");
  kvti_chunkstore_batch *b = kvti_calloc(1, sizeof *b);
  if (!b)
    return KVT_ERR_NOMEM();
  b->cs = cs;
  b->set = set;
  kvti_chunkstore_get_opts(cs, &b->o);
  for (int i = 0; i < 256; i++)
    b->dirfd[i] = -1;
  b->chunks_fd = -1;
  *out = b;
  return 0;
}

/* chunks/<kk>, opened (made when missing, its parent left for the round of
 * directory fsyncs) once per batch. */
static int batch_dir(kvti_chunkstore_batch *b, unsigned kk) {
  if (b->dirfd[kk] >= 0)
    return b->dirfd[kk];
  int fd = kvti_chunkstore_open_subdir(b->cs, kk);
  if (fd == KVT_ENOTFOUND) {
    kvt_clear_error();
    fd = kvti_chunkstore_make_subdir_ex(b->cs, kk, 0);
    b->made = fd >= 0;
  }
  if (fd >= 0)
    b->dirfd[kk] = fd;
  return fd;
}

static int pending(const kvti_chunkstore_batch *b, const uint8_t key[32]) {
  for (size_t i = b->nfiles; i-- > 0;)
    if (!memcmp(b->files[i].key, key, 32))
      return 1;
  return 0;
}

/* The names of key's file: path (for messages), name and tmp in chunks/<kk>,
 * tpath (tmp's path for messages). */
typedef struct wnames {
  char path[4096], tpath[4200];
  char name[KVTI_LOCAL_CHUNK_NAME_MAX], tmp[KVTI_LOCAL_CHUNK_NAME_MAX];
} wnames;
static int names_of(const kvti_chunkstore_batch *b, const uint8_t key[32],
                    wnames *n) {
  int rc = kvti_chunkstore_path(b->cs, key, n->path, sizeof n->path);
  if (rc)
    return rc;
  kvti_local_chunk_name(n->name, key, 0);
  kvti_local_chunk_name(n->tmp, key, 1);
  const char *base = strrchr(n->path, '/') + 1;
  snprintf(n->tpath, sizeof n->tpath, "%.*s%s", (int)(base - n->path), n->path,
           n->tmp);
  return 0;
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

/* Writes chunk i of the spill (its key, parent and ck given) as a file of the
 * set's group and notes it (and its row, unless it rewrites a damaged one). */
static int write_one(kvti_chunkstore_batch *b, kvti_chunk_src *src,
                     const uint8_t key[32], const uint8_t parent[32],
                     kvti_ck ck, int pure, int rewrite, size_t member,
                     kvti_chunkstore_result *res) {
  kvti_wgroup *g = kvti_syncset_group(b->set);
  if (!g)
    return KVT_ERR(KVT_EINVAL, "chunk batch: its files were synced already");
  if (KVTI_VEC_RESERVE(&b->files, &b->capfiles, b->nfiles + 1, 16) != 0 ||
      KVTI_VEC_RESERVE(&b->recs, &b->caprecs, b->nrecs + 1, 16) != 0)
    return KVT_ERR_NOMEM();
  wnames nm;
  int rc = names_of(b, key, &nm);
  /* Written into chunks/<kk> reached from cache_dir's descriptor (made when
   * missing, links refused): a chunks/ or chunks/<kk> swapped for a link is
   * never written through. */
  int dfd = rc ? rc : batch_dir(b, key[0]);
  if (dfd < 0)
    return dfd;
  kvti_chunk_written w;
  rc = kvti_chunk_write_into(g, dfd, nm.tmp, nm.tpath, src, b->o.file_mode, &w);
  if (rc)
    return rc;
  wfile *f = &b->files[b->nfiles++];
  memcpy(f->key, key, 32);
  f->member = member;
  f->rewrite = rewrite;
  f->state = 0;
  res->bytes_written += w.size;
  if (rewrite) {
    res->rewritten++;
    return 0;
  }
  kvti_chain_rec *r = &b->recs[b->nrecs++];
  memset(r, 0, sizeof *r);
  memcpy(r->key, w.key, 32);
  memcpy(r->parent, parent, 32);
  r->ck = ck;
  r->layout_hash = w.layout_hash;
  r->index = src->index;
  r->n_tokens = src->n;
  r->pure = (uint8_t)pure;
  r->disk_bytes = w.size;
  r->mem_bytes = w.mem_bytes;
  b->members[member].n++;
  res->written++;
  return 0;
}

int kvti_chunkstore_batch_put(kvti_chunkstore_batch *b,
                              const kvti_chunkstore_spill *sp,
                              kvti_chunkstore_result *res, size_t *member) {
  if (!b || !sp || !res || !member || (!sp->tokens && sp->n) || !sp->layers ||
      !sp->layer_ids || sp->n_layers == 0 || (!sp->ns && sp->ns_len))
    return KVT_ERR(KVT_EINVAL, "kvti_chunkstore_put: bad argument");
  if (!kvti_chunk_tokens_ok(sp->chunk_tokens))
    return KVT_ERR(
        KVT_EINVAL, "chunk_tokens %u: must be a power of two in [%u, %u]",
        sp->chunk_tokens, KVTI_CHUNK_TOKENS_MIN, KVTI_CHUNK_TOKENS_MAX);
  memset(res, 0, sizeof *res);
  if (KVTI_VEC_RESERVE(&b->members, &b->capmembers, b->nmembers + 1, 16) != 0)
    return KVT_ERR_NOMEM();
  size_t mi = b->nmembers++;
  b->members[mi] = (wmember){b->nrecs, 0, 0};
  *member = mi;
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
  kvti_chains *chains = kvti_chunkstore_chains(b->cs);
  uint8_t parent[32];
  memcpy(parent, seed, 32);
  kvti_ck ck = kvti_ck_seed(sp->ns, sp->ns_len);
  for (size_t i = 0; rc == 0 && i < m; i++) {
    const int32_t *tk = sp->tokens + i * C;
    uint8_t key[32];
    ck = kvti_ck_next(ck, tk, C);
    if ((rc = kvti_chunk_key(key, parent, tk, C)) != 0)
      break;
    /* Stored once, never again - unless its file was found damaged and
     * moved aside: the same content-addressed file is written again (the
     * row, the chunks below and the entries through it were kept). A chunk
     * an earlier spill of this batch wrote is stored as far as this one is
     * concerned: that spill's rows commit first. */
    int rewrite = 0;
    if (!pending(b, key) && kvti_chains_find(chains, key, NULL))
      rewrite = kvti_chains_is_damaged(chains, key);
    else if (!pending(b, key))
      rewrite = -1; /* new */
    if (rewrite != 0) {
      src.parent = parent;
      src.index = i;
      src.tokens = tk;
      src.row0 = (uint64_t)i * C;
      rc = write_one(b, &src, key, parent, ck, pure, rewrite > 0, mi, res);
    }
    memcpy(parent, key, 32);
  }
  if (rc)
    return rc;
  res->chunks = m;
  memcpy(res->last_key, parent, 32);
  return 0;
}

int kvti_chunkstore_batch_publish(kvti_chunkstore_batch *b) {
  for (size_t i = 0; i < b->nfiles; i++) {
    wfile *f = &b->files[i];
    if (f->state != 0)
      continue;
    wnames nm;
    int rc = names_of(b, f->key, &nm);
    int dfd = b->dirfd[f->key[0]];
    if (rc == 0)
      rc = kvti_renameat(dfd, nm.tmp, dfd, nm.name, nm.tpath, nm.path);
    if (rc)
      return rc;
    f->state = 1;
    char *sl = strrchr(nm.path, '/');
    *sl = '\0'; /* the directory's path, for messages */
    if ((rc = kvti_syncset_dirfd(b->set, dfd, nm.path)) != 0)
      return rc;
  }
  if (!b->made)
    return 0;
  /* A chunks/<kk> (and maybe chunks/) made by this batch: their names
   * become durable in the same round - chunks/'s in cache_dir only until
   * one round has made it durable (it was there before any chunks/<kk>). */
  if (b->chunks_fd < 0) {
    int fd = kvti_chunkstore_open_subdir(b->cs, 256);
    if (fd < 0)
      return fd;
    b->chunks_fd = fd;
  }
  int rc = kvti_syncset_dirfd(b->set, b->chunks_fd, "chunks");
  if (rc == 0 && !kvti_chunkstore_chunks_durable(b->cs, b->chunks_fd)) {
    rc = kvti_syncset_dirfd(b->set, kvti_chunkstore_root_fd(b->cs),
                            "cache directory");
    b->root_added = rc == 0;
  }
  return rc;
}

int kvti_chunkstore_batch_index(kvti_chunkstore_batch *b, size_t member,
                                const kvti_chained_entry *e, int *recorded) {
  if (recorded)
    *recorded = 0;
  if (member >= b->nmembers)
    return KVT_ERR(KVT_EINVAL, "chunk batch: no member %zu", member);
  wmember *mb = &b->members[member];
  kvti_chains *chains = kvti_chunkstore_chains(b->cs);
  /* Rows come only after the round of directory fsyncs succeeded. */
  if (b->root_added && kvti_syncset_do_fsync(b->set))
    kvti_chunkstore_note_chunks_durable(b->cs, b->chunks_fd);
  b->root_added = 0;
  /* Called with nothing to insert too: a read-only table refuses it. */
  int rc = kvti_chains_put_with_entry(chains, b->recs + mb->first, mb->n, e);
  if (rc)
    return rc;
  mb->indexed = 1;
  for (size_t i = 0; i < b->nfiles; i++)
    if (b->files[i].member == member && b->files[i].rewrite)
      kvti_chains_set_damaged(chains, b->files[i].key, 0);
  if (recorded)
    *recorded = e != NULL;
  return 0;
}

void kvti_chunkstore_batch_free(kvti_chunkstore_batch *b) {
  if (!b)
    return;
  /* What no row points at goes: tmp files left by a failed round, and the
   * renamed files of spills never indexed (a rewritten chunk's file stays:
   * its row exists, and the content is the chunk's). */
  for (size_t i = 0; i < b->nfiles; i++) {
    wfile *f = &b->files[i];
    if (f->state == 1 && (f->rewrite || b->members[f->member].indexed))
      continue;
    wnames nm;
    if (names_of(b, f->key, &nm) == 0)
      kvti_unlinkat(b->dirfd[f->key[0]], f->state ? nm.name : nm.tmp,
                    f->state ? nm.path : nm.tpath);
  }
  kvt_clear_error(); /* best effort: gc removes what stays */
  for (int i = 0; i < 256; i++)
    if (b->dirfd[i] >= 0)
      kvti_close(b->dirfd[i]);
  if (b->chunks_fd >= 0)
    kvti_close(b->chunks_fd);
  kvti_free(b->files);
  kvti_free(b->recs);
  kvti_free(b->members);
  kvti_free(b);
}

int kvti_chunkstore_put(kvti_chunkstore *cs, const kvti_chunkstore_spill *sp,
                        kvti_chunkstore_result *res) {
  if (!cs || !res)
    return KVT_ERR(KVT_EINVAL, "kvti_chunkstore_put: bad argument");
  memset(res, 0, sizeof *res);
  kvti_chunkstore_opts o;
  kvti_chunkstore_get_opts(cs, &o);
  kvti_syncset *set = NULL;
  kvti_chunkstore_batch *b = NULL;
  size_t mi = 0;
  int rc = kvti_syncset_open(&set, 0, o.do_fsync);
  if (rc == 0)
    rc = kvti_chunkstore_batch_new(&b, cs, set);
  if (rc == 0)
    rc = kvti_chunkstore_batch_put(b, sp, res, &mi);
  if (rc == 0)
    rc = kvti_syncset_files(set);
  if (rc == 0)
    rc = kvti_chunkstore_batch_publish(b);
  if (rc == 0)
    rc = kvti_syncset_dirs(set);
  if (rc == 0 && res->chunks > 0) {
    /* The spill's record rides on the same commit: its chain is whole and
     * durable, so the record never names a missing chunk. */
    kvti_chained_entry *e = sp->rec;
    if (e) {
      e->chunks = res->chunks;
      memcpy(e->last_key, res->last_key, 32);
      e->layout_hash = res->layout_hash;
    }
    rc = kvti_chunkstore_batch_index(b, mi, e, &res->recorded);
  }
  if (rc) {
    res->chunks = 0;
    res->written = 0;
    res->rewritten = 0;
    res->bytes_written = 0;
  }
  kvti_error_state es;
  if (rc)
    kvti_error_state_capture(&es, rc);
  kvti_syncset_free(set); /* first: its abort unlinks through b's dirs */
  kvti_chunkstore_batch_free(b);
  if (rc)
    kvti_error_state_restore(&es);
  return rc;
}
