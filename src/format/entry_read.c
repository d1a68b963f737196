/*
 * entry_read.c - layer-by-layer reading of one entry: the reader validates the
 * manifest and tokens.bin (against the expected tokens and the entry name),
 * reads and verifies each layer into the entry being built (several threads may
 * read distinct layers at once; the caller's alloc/free callbacks are
 * serialised), and hands the entry over only once every layer is in and the
 * directory was not replaced meanwhile.
 */
#include "format/entry_int.h"
#include "base/error.h"
#include "base/hash.h"
#include "base/io.h"
#include "format/layer.h"
#include "format/layout.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>

#define BAD(...) KVT_ERR(KVT_ECORRUPT, __VA_ARGS__)

/* Reads tokens.bin (when present) and checks it against the manifest, the
 * expected tokens and the entry name. *tokens (when tokens is not NULL)
 * receives a kvti_malloc'ed copy. Bounded whatever the files claim: the
 * manifest's token count is compared with the caller's first, the file's
 * length with the count, a sparse file is refused, and the file is read in
 * pieces (checksum, comparison and hash streaming) - it is held whole only
 * when the caller wants the tokens and did not pass them. */
#define TOKENS_CHUNK ((size_t)1 << 20)
static int load_tokens(int32_t **tokens, uint64_t *bytes,
                       const kvti_manifest *m, const char *hash,
                       const kvti_read_opts *o) {
  size_t n = (size_t)m->num_tokens;
  if (o && o->tokens && o->n_tokens != n)
    return BAD("%s: entry holds %zu tokens, %zu expected", m->dir, n,
               o->n_tokens);
  char *tp = kvti_path_join(m->dir, KVTI_TOKENS_FILE);
  if (!tp)
    return KVT_ENOMEM;
  char *buf = NULL;
  kvti_xxh3_state *xs = NULL;
  kvti_sha256_state *ss = NULL;
  int32_t *tok = NULL;
  int fd = kvti_open(tp, O_RDONLY, 0), rc = 0, have_file = fd >= 0;
  if (fd == KVT_EPERM && kvt_last_errno() == ELOOP) {
    rc = BAD("%s: tokens.bin is a symlink", m->dir);
    goto out;
  }
  if (fd == KVT_ECORRUPT) {
    rc = BAD("%s: tokens.bin is not a regular file of num_tokens * 4 bytes",
             m->dir);
    goto out;
  }
  if (fd == KVT_ENOTFOUND) {
    if (m->has_sums || !o || !o->tokens) {
      rc = BAD("%s: tokens.bin missing", m->dir);
      goto out;
    }
  } else if (fd < 0) {
    rc = fd;
    goto out;
  }
  int want_copy = tokens && !(o && o->tokens);
  if (have_file) {
    struct stat st;
    if (kvti_io->fstat(fd, &st) != 0) {
      rc = KVT_ERR_OS(errno, "stat %s", tp);
      goto out;
    }
    uint64_t len = (uint64_t)st.st_size;
    if (len != (uint64_t)n * 4u) {
      rc = BAD("%s: tokens.bin has %llu bytes, num_tokens is %zu", m->dir,
               (unsigned long long)len, n);
      goto out;
    }
    if (kvti_file_sparse(&st)) {
      rc =
          BAD("%s: tokens.bin is sparse (%llu bytes, %llu allocated)", m->dir,
              (unsigned long long)len, (unsigned long long)st.st_blocks * 512u);
      goto out;
    }
    *bytes = len;
    size_t cap =
        want_copy ? (size_t)len : (len < TOKENS_CHUNK ? len : TOKENS_CHUNK);
    buf = kvti_malloc(cap ? cap : 1);
    if (!buf) {
      rc = KVT_ERR_NOMEM();
      goto out;
    }
    if (m->has_sums && !(xs = kvti_xxh3_new())) {
      rc = KVT_ERR_NOMEM();
      goto out;
    }
    if (!(o && o->tokens) && !(ss = kvti_sha256_new())) {
      rc = KVT_ERR_NOMEM();
      goto out;
    }
    /* A salted entry is named SHA-256(D || tokens) (base/salt.h). */
    if (ss && m->salt.has && (rc = kvti_sha256_update(ss, m->salt.d, 32)) != 0)
      goto out;
    for (uint64_t off = 0; off < len;) {
      size_t k = (size_t)(len - off < TOKENS_CHUNK ? len - off : TOKENS_CHUNK);
      char *dst = want_copy ? buf + off : buf;
      if ((rc = kvti_pread_all(fd, dst, k, off, tp)) != 0)
        goto out;
      if (xs)
        kvti_xxh3_update(xs, dst, k);
      if (ss && (rc = kvti_sha256_update(ss, dst, k)) != 0)
        goto out;
      if (o && o->tokens && memcmp(dst, (const char *)o->tokens + off, k)) {
        rc = BAD("%s: tokens.bin differs from the expected tokens", m->dir);
        goto out;
      }
      off += k;
    }
    if (xs && kvti_xxh3_digest(xs) != m->sums[m->num_layers]) {
      rc = BAD("%s: tokens.bin checksum mismatch", m->dir);
      goto out;
    }
  }
  char h[KVT_HASH_HEX_LEN + 1];
  if (ss)
    rc = kvti_sha256_final_hex(ss, h);
  else
    rc = kvti_salt_hex(h, &m->salt, o->tokens, n);
  if (rc)
    goto out;
  if (strcmp(h, hash) != 0) {
    rc = BAD("%s: tokens do not hash to the entry name", m->dir);
    goto out;
  }
  if (tokens) {
    if (want_copy) {
      tok = (int32_t *)buf;
      buf = NULL;
    } else {
      tok = kvti_malloc(n ? n * 4u : 1);
      if (!tok) {
        rc = KVT_ERR_NOMEM();
        goto out;
      }
      if (n)
        memcpy(tok, o->tokens, n * 4u);
    }
    *tokens = tok;
  }
out:
  if (fd >= 0)
    kvti_io->close(fd);
  kvti_xxh3_free(xs);
  kvti_sha256_free(ss);
  kvti_free(buf);
  kvti_free(tp);
  return rc;
}

static void *reader_alloc(void *ctx, uint32_t layer, uint32_t tensor,
                          const kvt_tensor *desc) {
  kvti_entry_reader *r = ctx;
  pthread_mutex_lock(&r->cb_mu);
  void *p = r->o.alloc(r->o.alloc_ctx, layer, tensor, desc);
  pthread_mutex_unlock(&r->cb_mu);
  return p;
}

static void reader_free(void *ctx, void *buf) {
  kvti_entry_reader *r = ctx;
  if (!r->o.free_buf)
    return;
  pthread_mutex_lock(&r->cb_mu);
  r->o.free_buf(r->o.alloc_ctx, buf);
  pthread_mutex_unlock(&r->cb_mu);
}

void kvti_entry_reader_free(kvti_entry_reader *r) {
  if (!r)
    return;
  kvt_entry_free(r->e);
  kvti_manifest_free(&r->m);
  kvti_free(r->layer_bytes);
  kvti_free(r->done);
  pthread_mutex_destroy(&r->cb_mu);
  kvti_free(r);
}

int kvti_entry_reader_open_id(kvti_entry_reader **out, const char *data_dir,
                              const char *hash, const kvti_read_opts *o,
                              kvti_dir_id *id) {
  static const kvti_read_opts none = {0};
  kvti_entry_reader *r = kvti_calloc(1, sizeof *r);
  if (!r)
    return KVT_ERR_NOMEM();
  r->o = o ? *o : none;
  pthread_mutex_init(&r->cb_mu, NULL);
  int rc = kvti_manifest_load(&r->m, data_dir, hash, id);
  if (rc == 0 && r->o.tail_ok && r->o.tail_mark)
    *r->o.tail_mark = r->m.chain;
  if (rc == 0 && r->m.chain.present && !r->o.tail_ok) {
    /* Rows [0, chunks * C) are in chunk files: alone it is not the state of
     * its tokens, so it is never served as an entry. */
    rc = KVT_ERR(KVT_EUNSUPPORTED,
                 "%.16s is the tail of a chained entry (chunked store): it "
                 "is read with its chain (chunk_tokens), never alone",
                 hash);
    kvti_manifest_free(&r->m);
  }
  if (rc) {
    pthread_mutex_destroy(&r->cb_mu);
    kvti_free(r);
    return rc;
  }
  r->id = *id;
  uint32_t n = r->m.num_layers;
  kvt_entry *e = r->e = kvti_entry_new();
  r->layer_bytes = kvti_calloc(n ? n : 1, sizeof(uint64_t));
  r->done = kvti_calloc(n ? n : 1, 1);
  if (!e || !r->layer_bytes || !r->done) {
    rc = KVT_ERR_NOMEM();
    goto fail;
  }
  memcpy(e->hash, hash, KVT_HASH_HEX_LEN + 1);
  e->memory_bytes = r->m.memory_bytes;
  e->storage_mode = r->m.mode;
  e->salt = r->m.salt;
  /* A verification returns no entry: its tokens are checked, never copied. */
  e->n_tokens = r->o.verify_only ? 0 : (size_t)r->m.num_tokens;
  if (r->o.alloc) {
    e->free_buf = r->o.free_buf ? r->o.free_buf : kvti_keep_caller_buf;
    e->alloc_ctx = r->o.alloc_ctx;
  }
  uint64_t tb = 0;
  rc = load_tokens(r->o.verify_only ? NULL : &e->tokens, &tb, &r->m, hash,
                   &r->o);
  if (rc)
    goto fail;
  r->base_bytes = r->m.bytes + tb;
  /* Every layer slot exists from the start (zeroed until read), so freeing the
   * entry releases exactly the layers that were read. */
  e->layers = kvti_calloc(n ? n : 1, sizeof(kvt_layer));
  if (!e->layers) {
    rc = KVT_ERR_NOMEM();
    goto fail;
  }
  e->num_layers = n;
  *out = r;
  return 0;
fail:
  kvti_entry_reader_free(r);
  return rc;
}

int kvti_entry_reader_open(kvti_entry_reader **out, const char *data_dir,
                           const char *hash, const kvti_read_opts *o) {
  if (!out)
    return KVT_ERR(KVT_EINVAL, "entry reader: NULL out");
  kvti_dir_id id = {0};
  return kvti_entry_reader_open_id(out, data_dir, hash, o, &id);
}

uint32_t kvti_entry_reader_num_layers(const kvti_entry_reader *r) {
  return r ? r->m.num_layers : 0;
}

int kvti_entry_reader_read_layer(kvti_entry_reader *r, uint32_t i,
                                 const kvt_layer **layer) {
  if (!r || i >= r->m.num_layers || r->done[i])
    return KVT_ERR(KVT_EINVAL, "entry reader: bad layer %u", i);
  char name[KVTI_LAYER_FILE_MAX];
  kvti_layer_file_name(name, i);
  char *lp = kvti_path_join(r->m.dir, name);
  if (!lp)
    return KVT_ENOMEM;
  kvti_layer_read_opts lo = {
      r->o.alloc ? reader_alloc : NULL, r->o.alloc ? reader_free : NULL, r, i,
      r->o.cancel, r->o.verify_only, r->m.has_sums ? &r->m.sums[i] : NULL,
      r->o.io_backend, r->o.keep_tokens, r->m.block_size,
      r->m.block_size ? r->m.blk_all + r->m.blk_off[i] : NULL,
      r->m.block_size ? r->m.blk_off[i + 1] - r->m.blk_off[i] : 0,
      r->o.page_cache,
      /* A tail's KV offsets count its chain's rows too. */
      r->o.chain_rows
          ? r->o.chain_rows
          : (r->m.chain.present ? r->m.chain.chunks * r->m.chain.chunk_tokens
                                : 0)};
  int rc = kvti_layer_read_file(&r->e->layers[i], &r->layer_bytes[i], lp,
                                &r->m.metas[i], &lo);
  kvti_free(lp);
  if (rc == 0) {
    r->done[i] = 1;
    if (layer)
      *layer = &r->e->layers[i];
  }
  return rc;
}

/* 0: the entry directory is the one the reader opened; 1: replaced; 2: gone. */
int kvti_entry_dir_state(const char *dir, const kvti_dir_id *id) {
  struct stat st;
  if (kvti_io->lstat(dir, &st) != 0)
    return 2;
  return st.st_dev != id->dev || st.st_ino != id->ino;
}

int kvti_entry_reader_finish(kvt_entry **out, kvti_entry_reader *r) {
  if (!r || (!out && !r->o.verify_only))
    return KVT_ERR(KVT_EINVAL, "entry reader: bad argument");
  for (uint32_t i = 0; i < r->m.num_layers; i++)
    if (!r->done[i])
      return KVT_ERR(KVT_EINVAL, "entry reader: layer %u not read", i);
  /* A replacement during the read may have mixed versions (undetectable for
   * reference entries, which carry no checksums); an eviction right after a
   * complete, verified read is harmless. */
  if (kvti_entry_dir_state(r->m.dir, &r->id) == 1)
    return KVT_ERR(KVT_EAGAIN, "entry %.12s... was replaced while read; retry",
                   r->e->hash);
  uint64_t disk = r->base_bytes;
  for (uint32_t i = 0; i < r->m.num_layers; i++)
    disk += r->layer_bytes[i];
  r->e->disk_bytes = disk;
  uint64_t keep = r->o.keep_tokens;
  if (keep && keep < r->e->n_tokens) {
    /* A trimmed read: the entry now holds (and is named by) the kept tokens. */
    kvt_entry *e = r->e;
    int rc = kvti_salt_hex(e->hash, &e->salt, e->tokens, (size_t)keep);
    if (rc)
      return rc;
    e->memory_bytes = (uint64_t)((double)e->memory_bytes * (double)keep /
                                 (double)e->n_tokens);
    e->n_tokens = (size_t)keep;
  }
  if (r->o.verify_only) {
    if (out)
      *out = NULL;
  } else {
    *out = r->e;
    r->e = NULL;
  }
  return 0;
}

int kvti_entry_probe(kvti_entry_probe_info *out, const char *data_dir,
                     const char *hash) {
  memset(out, 0, sizeof *out);
  kvti_manifest m;
  int rc = kvti_manifest_load(&m, data_dir, hash, NULL);
  if (rc)
    return rc;
  uint64_t tb = 0;
  int32_t *tok = NULL;
  rc = load_tokens(&tok, &tb, &m, hash, NULL);
  uint64_t disk = m.bytes + tb;
  for (uint32_t i = 0; rc == 0 && i < m.num_layers; i++) {
    char name[KVTI_LAYER_FILE_MAX];
    kvti_layer_file_name(name, i);
    char *lp = kvti_path_join(m.dir, name);
    struct stat st;
    if (!lp)
      rc = KVT_ENOMEM;
    else if (kvti_io->lstat(lp, &st) != 0)
      rc = errno == ENOENT ? BAD("%s: layer file missing", lp)
                           : KVT_ERR_OS(errno, "stat %s", lp);
    else if (!S_ISREG(st.st_mode))
      rc = BAD("%s is not a regular file", lp);
    else
      disk += (uint64_t)st.st_size;
    kvti_free(lp);
  }
  struct stat dst;
  if (rc == 0 && kvti_io->lstat(m.dir, &dst) == 0)
    out->mtime = (double)dst.st_mtim.tv_sec + dst.st_mtim.tv_nsec / 1e9;
  if (rc == 0) {
    out->tokens = tok;
    out->n_tokens = (size_t)m.num_tokens;
    out->memory_bytes = m.memory_bytes;
    out->storage_mode = m.mode;
    out->disk_bytes = disk;
    out->salt = m.salt;
    out->chain = m.chain;
    tok = NULL;
  }
  kvti_free(tok);
  kvti_manifest_free(&m);
  return rc;
}
