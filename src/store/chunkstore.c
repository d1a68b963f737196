/*
 * chunkstore.c - the chunk store (chunkstore.h): places chunk files where
 * the cache directory's layout names them (chunks/<kk>/<key>.kvc,
 * store/local_layout.h), opens chunks for verified reads and removes chains
 * rows-first; a spill's chunks are written by chunkstore_write.c. Directories
 * are created lazily and, with durability FSYNC, their parent is fsynced when
 * one is created (at once, or in the batch's round of directory fsyncs), so a
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
  /* chunks/ whose name in cache_dir is known durable (known: 1). */
  dev_t chunks_dev;
  ino_t chunks_ino;
  int chunks_known;
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
  return kvti_chunkstore_make_subdir_ex(cs, kk, cs->o.do_fsync);
}

int kvti_chunkstore_make_subdir_ex(kvti_chunkstore *cs, unsigned kk,
                                   int do_fsync) {
  char rel[16];
  int rc = kvti_local_chunk_dir_rel(rel, sizeof rel, kk & 0xffu);
  return rc ? rc
            : kvti_dir_open_mk(cs->root_fd, rel, cs->o.dir_mode, do_fsync,
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

int kvti_chunkstore_chunks_durable(const kvti_chunkstore *cs, int chunks_fd) {
  struct stat st;
  return cs->chunks_known && kvti_io->fstat(chunks_fd, &st) == 0 &&
         st.st_dev == cs->chunks_dev && st.st_ino == cs->chunks_ino;
}

void kvti_chunkstore_note_chunks_durable(kvti_chunkstore *cs, int chunks_fd) {
  struct stat st;
  if (kvti_io->fstat(chunks_fd, &st) != 0)
    return; /* not known: cache_dir is fsynced again next time */
  cs->chunks_dev = st.st_dev;
  cs->chunks_ino = st.st_ino;
  cs->chunks_known = 1;
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
