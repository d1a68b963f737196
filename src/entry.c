/*
 * entry.c - cache entries on disk. A spill is first validated and copied into
 * an immutable snapshot on the caller's thread; the writer thread then builds
 * data/<hash>.tmp/ (one safetensors file per layer, tokens.bin, manifest.json
 * with kvtier's checksums, manifest.sum protecting the manifest itself),
 * fsyncs, and publishes it with an atomic rename - swapping it with an existing
 * version through renameat2(RENAME_EXCHANGE) so that a complete entry is always
 * in place. Reading validates everything before handing out any data: manifest
 * checksum and structure, token file against the entry name, each layer file's
 * header against the manifest, and each file's XXH3s (per 64 KiB block in
 * format 2, whole-file in format 1) while its tensors are pread straight into
 * their final buffers.
 */
#include "entry.h"
#include "dtype.h"
#include "error.h"
#include "fwriter.h"
#include "hash.h"
#include "io.h"
#include "layer.h"
#include "safetensors.h"

#include <cjson/cJSON.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Written format: 2 = per-block checksums of layer files (docs/FORMAT.md
 * section 6). Format 1 (whole-file checksums) is still read. */
#define KVTI_FORMAT 2
#define MANIFEST_MAX ((size_t)64 << 20)
#define SUM_LEN 22 /* "xxh3:" + 16 hex + "\n" */

/* ---- entries ------------------------------------------------------------ */

kvt_entry *kvti_entry_new(void) {
  kvt_entry *e = kvti_calloc(1, sizeof *e);
  if (!e)
    KVT_ERR_NOMEM();
  return e;
}

static void noop_free(void *ctx, void *buf) {
  (void)ctx;
  (void)buf;
}

void kvt_entry_free(kvt_entry *e) {
  if (!e)
    return;
  for (uint32_t i = 0; e->layers && i < e->num_layers; i++)
    kvti_layer_release(&e->layers[i], e->free_buf != NULL, e->free_buf,
                       e->alloc_ctx);
  kvti_free(e->layers);
  kvti_free(e->tokens);
  kvti_free(e);
}

uint32_t kvt_entry_num_layers(const kvt_entry *e) {
  return e ? e->num_layers : 0;
}
const kvt_layer *kvt_entry_layer(const kvt_entry *e, uint32_t i) {
  return e && i < e->num_layers ? &e->layers[i] : NULL;
}
const int32_t *kvt_entry_tokens(const kvt_entry *e, size_t *n) {
  if (n)
    *n = e ? e->n_tokens : 0;
  return e ? e->tokens : NULL;
}
uint64_t kvt_entry_memory_bytes(const kvt_entry *e) {
  return e ? e->memory_bytes : 0;
}
uint64_t kvt_entry_reserved_bytes(const kvt_entry *e) {
  return e ? e->reserved_bytes : 0;
}
uint64_t kvt_entry_disk_bytes(const kvt_entry *e) {
  return e ? e->disk_bytes : 0;
}
const char *kvt_entry_hash(const kvt_entry *e) {
  return e ? e->hash : NULL;
}
int kvt_entry_storage_mode(const kvt_entry *e) {
  return e ? e->storage_mode : 0;
}

/* ---- snapshots ---------------------------------------------------------- */

struct kvti_snapshot {
  char hash[KVT_HASH_HEX_LEN + 1];
  int32_t *tokens;
  size_t n_tokens;
  kvt_layer *layers;
  uint32_t n_layers;
  uint64_t memory_bytes;
  int copy;
  int has_quant;
  void (*release)(void *);
  void *release_ctx;
  uint64_t held;
};

void kvti_snapshot_free(kvti_snapshot *s) {
  if (!s)
    return;
  for (uint32_t i = 0; s->layers && i < s->n_layers; i++) {
    kvt_layer *l = &s->layers[i];
    if (s->copy && l->tensors)
      for (uint32_t j = 0; j < l->num_tensors; j++)
        kvti_buf_free(l->tensors[j].data);
    kvti_free(l->tensors);
    kvti_free(l->orig_dtypes);
  }
  kvti_free(s->layers);
  kvti_free(s->tokens);
  if (s->release)
    s->release(s->release_ctx);
  kvti_free(s);
}

int kvti_snapshot_create(kvti_snapshot **out, const int32_t *tokens,
                         size_t n_tokens, const kvt_layer *layers,
                         uint32_t n_layers, uint64_t memory_bytes, int copy,
                         void (*release)(void *), void *release_ctx) {
  int rc = 0;
  kvti_snapshot *s = NULL;
  if (!out || (n_tokens && !tokens) || (n_layers && !layers)) {
    rc = KVT_ERR(KVT_EINVAL, "snapshot: NULL argument");
    goto fail;
  }
  if (n_tokens > (SIZE_MAX / 8) || n_tokens > (size_t)INT32_MAX) {
    rc = KVT_ERR(KVT_EINVAL, "snapshot: too many tokens");
    goto fail;
  }
  if (n_layers > KVTI_MAX_LAYERS) {
    rc = KVT_ERR(KVT_EINVAL, "snapshot: too many layers (%u)", n_layers);
    goto fail;
  }
  if (memory_bytes > (UINT64_C(1) << 53)) {
    rc = KVT_ERR(KVT_EINVAL, "snapshot: memory_bytes too large");
    goto fail;
  }
  for (uint32_t i = 0; i < n_layers; i++)
    if ((rc = kvti_layer_validate(&layers[i], i, 1)) != 0)
      goto fail;
  s = kvti_calloc(1, sizeof *s);
  if (!s) {
    rc = KVT_ERR_NOMEM();
    goto fail;
  }
  s->copy = copy;
  s->memory_bytes = memory_bytes;
  s->n_tokens = n_tokens;
  if ((rc = kvt_token_hash(s->hash, tokens, n_tokens)) != 0)
    goto fail;
  s->tokens = kvti_malloc(n_tokens * sizeof(int32_t));
  s->layers = kvti_calloc(n_layers ? n_layers : 1, sizeof(kvt_layer));
  if (!s->tokens || !s->layers) {
    rc = KVT_ERR_NOMEM();
    goto fail;
  }
  if (n_tokens)
    memcpy(s->tokens, tokens, n_tokens * sizeof(int32_t));
  s->held = n_tokens * sizeof(int32_t);
  for (uint32_t i = 0; i < n_layers; i++) {
    const kvt_layer *src = &layers[i];
    kvt_layer *d = &s->layers[i];
    *d = *src;
    d->tensors = NULL;
    d->orig_dtypes = NULL;
    d->num_tensors = 0;
    s->n_layers = i + 1;
    uint32_t nt = src->num_tensors;
    d->tensors = kvti_calloc(nt ? nt : 1, sizeof(kvt_tensor));
    if (!d->tensors) {
      rc = KVT_ERR_NOMEM();
      goto fail;
    }
    if (src->orig_dtypes) {
      d->orig_dtypes = kvti_malloc((nt ? nt : 1) * sizeof(int32_t));
      if (!d->orig_dtypes) {
        rc = KVT_ERR_NOMEM();
        goto fail;
      }
      memcpy(d->orig_dtypes, src->orig_dtypes, nt * sizeof(int32_t));
    }
    for (uint32_t j = 0; j < nt; j++) {
      d->tensors[j] = src->tensors[j];
      if (copy) {
        d->tensors[j].data = NULL;
        d->num_tensors = j + 1;
        if (src->tensors[j].nbytes) {
          void *b = kvti_buf_alloc((size_t)src->tensors[j].nbytes);
          if (!b) {
            rc = KVT_ERR(KVT_ENOMEM, "snapshot: cannot copy %llu bytes",
                         (unsigned long long)src->tensors[j].nbytes);
            goto fail;
          }
          memcpy(b, src->tensors[j].data, (size_t)src->tensors[j].nbytes);
          d->tensors[j].data = b;
          s->held += src->tensors[j].nbytes;
        }
      }
    }
    d->num_tensors = nt;
    if (src->kind == KVT_LAYER_QUANTIZED_KV)
      s->has_quant = 1;
  }
  s->release = release;
  s->release_ctx = release_ctx;
  *out = s;
  return 0;
fail:
  kvti_snapshot_free(s);
  if (!copy && release)
    release(release_ctx);
  return rc;
}

const char *kvti_snapshot_hash(const kvti_snapshot *s) {
  return s->hash;
}
const int32_t *kvti_snapshot_tokens(const kvti_snapshot *s, size_t *n) {
  if (n)
    *n = s->n_tokens;
  return s->tokens;
}
uint64_t kvti_snapshot_memory_bytes(const kvti_snapshot *s) {
  return s->memory_bytes;
}
uint64_t kvti_snapshot_held_bytes(const kvti_snapshot *s) {
  return s->held;
}

/* ---- manifest ----------------------------------------------------------- */

/* Python json.dump(manifest) with default separators, plus kvtier's key. sums:
 * n_layers layer checksums then the tokens.bin checksum; blk[i] / nblk[i]: the
 * block list of layer i (blk NULL or blk[i] NULL: zeros of that length, for
 * size computations). */
static char *build_manifest(const kvti_snapshot *s, char **metas,
                            const uint64_t *sums, int mode,
                            const uint64_t *const *blk, const size_t *nblk) {
  kvti_sb b = {0};
  kvti_sb_printf(&b, "{\"num_layers\": %u, \"layers\": [", s->n_layers);
  for (uint32_t i = 0; i < s->n_layers; i++) {
    if (i)
      kvti_sb_puts(&b, ", ");
    kvti_sb_puts(&b, metas[i]);
  }
  kvti_sb_printf(&b,
                 "], \"memory_bytes\": %llu, \"num_tokens\": %zu, \"kvtier\": "
                 "{\"format\": %d, \"storage_mode\": \"%s\", \"block_size\": "
                 "%llu, \"checksums\": {",
                 (unsigned long long)s->memory_bytes, s->n_tokens, KVTI_FORMAT,
                 mode == KVT_STORAGE_COMPAT ? "compat" : "native",
                 (unsigned long long)KVTI_BLK_DEFAULT);
  char x[24];
  for (uint32_t i = 0; i < s->n_layers; i++) {
    kvti_xxh3_format(x, sums[i]);
    kvti_sb_printf(&b, "%s\"layer_%u.safetensors\": \"%s\"", i ? ", " : "", i,
                   x);
  }
  kvti_xxh3_format(x, sums[s->n_layers]);
  kvti_sb_printf(&b, "%s\"tokens.bin\": \"%s\"}, \"blocks\": {",
                 s->n_layers ? ", " : "", x);
  static const uint64_t zeros[64];
  char hex[64 * 16 + 1];
  for (uint32_t i = 0; i < s->n_layers; i++) {
    kvti_sb_printf(&b, "%s\"layer_%u.safetensors\": \"", i ? ", " : "", i);
    const uint64_t *l = blk ? blk[i] : NULL;
    for (size_t k = 0; k < nblk[i]; k += 64) {
      size_t n = nblk[i] - k < 64 ? nblk[i] - k : 64;
      kvti_blklist_format(hex, l ? l + k : zeros, n);
      kvti_sb_putn(&b, hex, 16 * n);
    }
    kvti_sb_puts(&b, "\"");
  }
  kvti_sb_puts(&b, "}}}");
  return kvti_sb_take(&b);
}

uint64_t kvti_snapshot_disk_bytes(const kvti_snapshot *s, int mode) {
  uint64_t total = (uint64_t)s->n_tokens * 4u + SUM_LEN;
  char **metas = kvti_calloc(s->n_layers ? s->n_layers : 1, sizeof(char *));
  uint64_t *sums = kvti_calloc(s->n_layers + 1u, sizeof(uint64_t));
  size_t *nblk = kvti_calloc(s->n_layers ? s->n_layers : 1, sizeof(size_t));
  uint64_t ret = 0;
  if (!metas || !sums || !nblk)
    goto out;
  for (uint32_t i = 0; i < s->n_layers; i++) {
    kvti_layer_out p;
    if (kvti_layer_plan(&p, &s->layers[i], i, mode, s->has_quant, 0) != 0)
      goto out;
    uint64_t fs = kvti_layer_out_file_size(&p);
    metas[i] = p.meta_json;
    p.meta_json = NULL;
    kvti_layer_out_free(&p);
    if (!fs)
      goto out;
    total += fs;
    nblk[i] = (size_t)kvti_blk_count(fs, KVTI_BLK_DEFAULT);
  }
  char *m = build_manifest(s, metas, sums, mode, NULL, nblk);
  if (m) {
    ret = total + strlen(m);
    kvti_free(m);
  }
out:
  for (uint32_t i = 0; metas && i < s->n_layers; i++)
    kvti_free(metas[i]);
  kvti_free(metas);
  kvti_free(sums);
  kvti_free(nblk);
  return ret;
}

/* ---- writing ------------------------------------------------------------ */

static char *suffixed(const char *dir, const char *hash, const char *suf) {
  char name[KVT_HASH_HEX_LEN + 16];
  snprintf(name, sizeof name, "%s%s", hash, suf);
  return kvti_path_join(dir, name);
}

int kvti_entry_recover(const char *data_dir, const char *tmp_name) {
  static const char suf[] = ".old.tmp";
  if (!data_dir || !tmp_name ||
      strlen(tmp_name) != KVT_HASH_HEX_LEN + sizeof suf - 1 ||
      strcmp(tmp_name + KVT_HASH_HEX_LEN, suf) != 0)
    return 0;
  char hash[KVT_HASH_HEX_LEN + 1];
  memcpy(hash, tmp_name, KVT_HASH_HEX_LEN);
  hash[KVT_HASH_HEX_LEN] = '\0';
  if (!kvti_is_hash_name(hash))
    return 0;
  char *live = suffixed(data_dir, hash, "");
  char *old = suffixed(data_dir, hash, suf);
  int rc = 0;
  struct stat st;
  if (!live || !old) {
    rc = KVT_ENOMEM;
  } else if (kvti_io->lstat(live, &st) == 0 || errno != ENOENT) {
    rc = 0; /* the new version is in place (or unknown): old is stale */
  } else if (kvti_io->lstat(old, &st) != 0 || !S_ISDIR(st.st_mode)) {
    rc = 0;
  } else if ((rc = kvti_rename(old, live)) == 0 &&
             (rc = kvti_fsync_dir(data_dir)) == 0) {
    rc = 1;
  }
  kvti_free(live);
  kvti_free(old);
  return rc;
}

/* Writes one small file (tokens, manifest, sum) in the entry's write group (its
 * fsync and, on failure, its removal happen with the group's) and returns its
 * xxh3. */
static int write_small(uint64_t *xxh, kvti_wgroup *g, const char *dir,
                       const char *name, const void *data, size_t len,
                       const kvti_write_opts *o) {
  char *p = kvti_path_join(dir, name);
  if (!p)
    return KVT_ENOMEM;
  if (xxh)
    *xxh = kvti_xxh3(data, len);
  kvti_fwriter_opts fo = KVTI_FWRITER_OPTS_INIT;
  fo.hash = 0;
  fo.size_hint = len;
  fo.file_mode = o->file_mode;
  kvti_fwriter *w = NULL;
  int rc = kvti_wgroup_file(&w, g, p, &fo);
  if (rc == 0)
    rc = kvti_fwriter_append(w, data, len);
  if (rc == 0)
    rc = kvti_fwriter_close(w, NULL, NULL);
  kvti_free(p);
  return rc;
}

int kvti_entry_write(uint64_t *disk_bytes, const char *data_dir,
                     const kvti_snapshot *s, const kvti_write_opts *o) {
  if (!data_dir || !s || !o || !kvti_is_hash_name(s->hash))
    return KVT_ERR(KVT_EINVAL, "entry write: bad argument");
  int mode = o->storage_mode;
  if (mode != KVT_STORAGE_NATIVE && mode != KVT_STORAGE_COMPAT)
    return KVT_ERR(KVT_EINVAL, "entry write: bad storage mode %d", mode);
  int rc = 0, published = 0, exchanged = 0, tmp_made = 0, moved_aside = 0;
  uint64_t total = 0;
  char *tmp = suffixed(data_dir, s->hash, ".tmp");
  char *live = suffixed(data_dir, s->hash, "");
  char *old = suffixed(data_dir, s->hash, ".old.tmp");
  char **metas = kvti_calloc(s->n_layers ? s->n_layers : 1, sizeof(char *));
  uint64_t *sums = kvti_calloc(s->n_layers + 1u, sizeof(uint64_t));
  /* Per-block hashes of each layer file (format 2), kept for the manifest. */
  kvti_blkhash **bh =
      kvti_calloc(s->n_layers ? s->n_layers : 1, sizeof(kvti_blkhash *));
  const uint64_t **blk =
      kvti_calloc(s->n_layers ? s->n_layers : 1, sizeof(uint64_t *));
  size_t *nblk = kvti_calloc(s->n_layers ? s->n_layers : 1, sizeof(size_t));
  char *manifest = NULL;
  kvti_wgroup *g = NULL;
  if (!tmp || !live || !old || !metas || !sums || !bh || !blk || !nblk) {
    rc = KVT_ERR_NOMEM();
    goto out;
  }
  if ((rc = kvti_rmtree(tmp)) != 0)
    goto out;
  if (kvti_io->mkdir(tmp, (mode_t)o->dir_mode) != 0) {
    rc = KVT_ERR_OS(errno, "mkdir %s", tmp);
    goto out;
  }
  tmp_made = 1;
  if (kvti_io->chmod(tmp, (mode_t)o->dir_mode) != 0) {
    rc = KVT_ERR_OS(errno, "chmod %s", tmp);
    goto out;
  }
  /* Every file of the entry goes through one write group: the writes stay in
   * flight across files and all files are fsynced together at the end
   * (fwriter.h). */
  rc = kvti_wgroup_open(&g, o->io_backend, NULL, o->do_fsync);
  if (rc) {
    g = NULL;
    goto out;
  }
  for (uint32_t i = 0; i < s->n_layers; i++) {
    kvti_layer_out p;
    rc = kvti_layer_plan(&p, &s->layers[i], i, mode, s->has_quant, 1);
    if (rc)
      goto out;
    char name[40];
    snprintf(name, sizeof name, "layer_%u.safetensors", i);
    char *lp = kvti_path_join(tmp, name);
    uint64_t sz = 0;
    rc = lp ? kvti_blkhash_new(&bh[i], KVTI_BLK_DEFAULT,
                               kvti_layer_out_file_size(&p))
            : KVT_ENOMEM;
    if (rc == 0)
      rc = kvti_layer_write_file(&sz, &sums[i], lp, &p, o->file_mode,
                                 o->do_fsync, 0, o->io_backend, g, bh[i]);
    if (rc == 0)
      blk[i] = kvti_blkhash_list(bh[i], &nblk[i]);
    kvti_free(lp);
    metas[i] = p.meta_json;
    p.meta_json = NULL;
    kvti_layer_out_free(&p);
    if (rc)
      goto out;
    total += sz;
  }
  rc = write_small(&sums[s->n_layers], g, tmp, "tokens.bin", s->tokens,
                   s->n_tokens * sizeof(int32_t), o);
  if (rc)
    goto out;
  total += s->n_tokens * sizeof(int32_t);
  manifest = build_manifest(s, metas, sums, mode, blk, nblk);
  if (!manifest) {
    rc = KVT_ENOMEM;
    goto out;
  }
  size_t mlen = strlen(manifest);
  rc = write_small(NULL, g, tmp, "manifest.json", manifest, mlen, o);
  if (rc)
    goto out;
  total += mlen;
  char sum[SUM_LEN + 8];
  kvti_xxh3_format(sum, kvti_xxh3(manifest, mlen));
  strcat(sum, "\n");
  rc = write_small(NULL, g, tmp, "manifest.sum", sum, SUM_LEN, o);
  if (rc)
    goto out;
  total += SUM_LEN;
  rc = kvti_wgroup_finish(
      g); /* waits, fsyncs every file (durability FSYNC), closes */
  g = NULL;
  if (rc)
    goto out;
  if (o->do_fsync && (rc = kvti_fsync_dir(tmp)) != 0)
    goto out;

  /* Publish. Preferred: atomic exchange with a live version (tmp then holds the
   * old one). */
  rc = kvti_rename_exchange(tmp, live);
  if (rc == 0) {
    exchanged = 1;
  } else if (rc == KVT_ENOTFOUND) {
    rc = kvti_rename(tmp, live);
  } else if (rc == KVT_EUNSUPPORTED) {
    struct stat st;
    rc = 0;
    if (kvti_io->lstat(live, &st) == 0) {
      /* Portable fallback: old version aside, new into place. A crash between
       * the two renames leaves the old version complete at <hash>.old.tmp. */
      if ((rc = kvti_rmtree(old)) == 0 && (rc = kvti_rename(live, old)) == 0) {
        moved_aside = 1;
        rc = kvti_rename(tmp, live);
        if (rc && kvti_io->rename(old, live) == 0)
          moved_aside = 0;
      }
    } else {
      rc = kvti_rename(tmp, live);
    }
  }
  if (rc)
    goto out;
  published = 1;
  if (o->do_fsync && (rc = kvti_fsync_dir(data_dir)) != 0) {
    /* Not durable: undo, putting the old version (if any) back. */
    if (exchanged) {
      if (kvti_io->rename_exchange && kvti_io->rename_exchange(tmp, live) == 0)
        published = 0;
    } else if (kvti_io->rename(live, tmp) == 0) {
      published = 0;
      if (moved_aside && kvti_io->rename(old, live) == 0)
        moved_aside = 0;
    }
    if (published) {
      /* could not undo: the new complete version stays; report success */
      rc = 0;
    } else {
      goto out;
    }
  }
  /* Remove the previous version (now at tmp after an exchange, or at old). */
  if (exchanged)
    kvti_rmtree(tmp);
  else if (moved_aside)
    kvti_rmtree(old);
  if (disk_bytes)
    *disk_bytes = total;
  rc = 0;
out:
  kvti_wgroup_abort(g);
  if (rc && tmp_made && !published) {
    int keep = rc;
    kvti_rmtree(tmp);
    rc = keep;
  }
  /* A vanished data/ (or file) is an I/O failure of the write, not "no such
   * entry"; kvt_last_errno() still says ENOENT. */
  if (rc == KVT_ENOTFOUND)
    rc = KVT_EIO;
  for (uint32_t i = 0; metas && i < s->n_layers; i++)
    kvti_free(metas[i]);
  kvti_free(metas);
  kvti_free(sums);
  for (uint32_t i = 0; bh && i < s->n_layers; i++)
    kvti_blkhash_free(bh[i]);
  kvti_free(bh);
  kvti_free(blk);
  kvti_free(nblk);
  kvti_free(manifest);
  kvti_free(tmp);
  kvti_free(live);
  kvti_free(old);
  return rc;
}

/* ---- reading ------------------------------------------------------------ */

#define BAD(...) KVT_ERR(KVT_ECORRUPT, __VA_ARGS__)

typedef struct manifest {
  cJSON *root;
  char *dir;
  uint32_t num_layers;
  uint64_t memory_bytes;
  uint64_t num_tokens;
  int has_sums; /* kvtier-written */
  int mode;
  uint64_t *sums; /* num_layers + 1 (tokens.bin last) */
  /* Format 2: per-block hashes of layer i are blk_all[blk_off[i] ..
   * blk_off[i + 1]); block_size 0 for format 1 and reference entries. */
  uint64_t block_size;
  uint64_t *blk_all;
  size_t *blk_off; /* num_layers + 1 */
  kvti_layer_meta *metas;
  uint64_t bytes; /* manifest + sum */
} manifest;

static void manifest_free(manifest *m) {
  cJSON_Delete(m->root);
  kvti_free(m->dir);
  kvti_free(m->sums);
  kvti_free(m->blk_all);
  kvti_free(m->blk_off);
  for (uint32_t i = 0; m->metas && i < m->num_layers; i++)
    kvti_layer_meta_free(&m->metas[i]);
  kvti_free(m->metas);
  memset(m, 0, sizeof *m);
}

static int json_uint(uint64_t *out, const cJSON *o, const char *key,
                     uint64_t max, const char *what) {
  const cJSON *j = cJSON_GetObjectItemCaseSensitive(o, key);
  if (!j)
    return BAD("%s: missing '%s'", what, key);
  double d = cJSON_IsNumber(j) ? j->valuedouble : -1;
  if (!isfinite(d) || d < 0 || floor(d) != d || d > (double)max)
    return BAD("%s: '%s' is not an integer in [0, %llu]", what, key,
               (unsigned long long)max);
  *out = (uint64_t)d;
  return 0;
}

/* Counts object members named key (cJSON keeps duplicates). */
static int count_key(const cJSON *o, const char *key) {
  int n = 0;
  for (const cJSON *c = o->child; c; c = c->next)
    if (c->string && strcmp(c->string, key) == 0)
      n++;
  return n;
}

/* Format 2: kvtier.block_size (a power of two in [4 KiB, 64 MiB]) and
 * kvtier.blocks, one string of 16 hex digits per block for exactly the layer
 * files, each list hashing to the file's entry in checksums (m->sums must be
 * parsed). Whether a list has the right length for its file is checked when the
 * file is opened (kvti_layer_read_file). */
static int parse_blocks(manifest *m, const cJSON *kv, const char *where) {
  uint64_t bs;
  int rc = json_uint(&bs, kv, "block_size", KVTI_BLK_MAX, where);
  if (rc)
    return rc;
  if (count_key(kv, "block_size") != 1)
    return BAD("%s: duplicate kvtier block_size", where);
  if (!kvti_blk_size_ok(bs))
    return BAD("%s: kvtier block_size %llu is not a power of two in [%llu, "
               "%llu]",
               where, (unsigned long long)bs, (unsigned long long)KVTI_BLK_MIN,
               (unsigned long long)KVTI_BLK_MAX);
  const cJSON *bl = cJSON_GetObjectItemCaseSensitive(kv, "blocks");
  if (count_key(kv, "blocks") != 1 || !cJSON_IsObject(bl) ||
      cJSON_GetArraySize(bl) != (int)m->num_layers)
    return BAD("%s: kvtier blocks must list every layer file", where);
  m->blk_off = kvti_calloc(m->num_layers + 1u, sizeof(size_t));
  if (!m->blk_off)
    return KVT_ERR_NOMEM();
  const cJSON **val =
      kvti_calloc(m->num_layers ? m->num_layers : 1, sizeof(cJSON *));
  if (!val)
    return KVT_ERR_NOMEM();
  size_t total = 0;
  for (uint32_t i = 0; i < m->num_layers; i++) {
    char name[40];
    snprintf(name, sizeof name, "layer_%u.safetensors", i);
    val[i] = cJSON_GetObjectItemCaseSensitive(bl, name);
    size_t len = cJSON_IsString(val[i]) ? strlen(val[i]->valuestring) : 1;
    if (count_key(bl, name) != 1 || len % 16 != 0) {
      rc = BAD("%s: block list of %s missing or malformed", where, name);
      goto out;
    }
    m->blk_off[i] = total;
    total += len / 16;
  }
  m->blk_off[m->num_layers] = total;
  m->blk_all = kvti_malloc((total ? total : 1) * sizeof(uint64_t));
  if (!m->blk_all) {
    rc = KVT_ERR_NOMEM();
    goto out;
  }
  for (uint32_t i = 0; i < m->num_layers; i++) {
    uint64_t *l = m->blk_all + m->blk_off[i];
    size_t n = m->blk_off[i + 1] - m->blk_off[i];
    if (kvti_blklist_parse(l, val[i]->valuestring, 16 * n) != 0) {
      rc = BAD("%s: block list of layer_%u.safetensors is not lowercase hex",
               where, i);
      goto out;
    }
    if (kvti_blklist_digest(l, n) != m->sums[i]) {
      rc = BAD("%s: block list of layer_%u.safetensors does not match its "
               "checksum",
               where, i);
      goto out;
    }
  }
  m->block_size = bs;
out:
  kvti_free(val);
  return rc;
}

/* Parses and validates manifest text into m (dir and bytes are the caller's).
 * have_sum: a manifest.sum was present (and matched): the kvtier key is then
 * required, else forbidden. */
static int parse_manifest(manifest *m, const char *text, size_t tlen,
                          int have_sum, const char *hash, const char *where) {
  int rc = 0;
  m->root = cJSON_ParseWithLength(text, tlen);
  if (!m->root) {
    rc = BAD("%s: manifest.json is not valid JSON", where);
    goto out;
  }
  cJSON *r = m->root;
  if (!cJSON_IsObject(r)) {
    rc = BAD("%s: manifest is not a JSON object", where);
    goto out;
  }
  static const char *keys[] = {"num_layers", "layers", "memory_bytes",
                               "num_tokens", "kvtier"};
  for (size_t k = 0; k < 5; k++)
    if (count_key(r, keys[k]) > 1) {
      rc = BAD("%s: duplicate manifest key '%s'", where, keys[k]);
      goto out;
    }
  uint64_t nl;
  if ((rc = json_uint(&nl, r, "num_layers", KVTI_MAX_LAYERS, where)) ||
      (rc = json_uint(&m->memory_bytes, r, "memory_bytes", UINT64_C(1) << 53,
                      where)) ||
      (rc = json_uint(&m->num_tokens, r, "num_tokens", INT32_MAX, where)))
    goto out;
  m->num_layers = (uint32_t)nl;
  const cJSON *layers = cJSON_GetObjectItemCaseSensitive(r, "layers");
  if (!cJSON_IsArray(layers) ||
      cJSON_GetArraySize(layers) != (int)m->num_layers) {
    rc = BAD("%s: 'layers' is not a list of num_layers objects", where);
    goto out;
  }
  const cJSON *kv = cJSON_GetObjectItemCaseSensitive(r, "kvtier");
  m->mode = KVT_STORAGE_COMPAT;
  if (kv && !have_sum) {
    rc = BAD("%s: kvtier manifest without manifest.sum", where);
    goto out;
  }
  if (!kv && have_sum) {
    rc = BAD("%s: manifest.sum present but manifest has no kvtier key", where);
    goto out;
  }
  m->metas = kvti_calloc(m->num_layers ? m->num_layers : 1, sizeof *m->metas);
  m->sums = kvti_calloc(m->num_layers + 1u, sizeof(uint64_t));
  if (!m->metas || !m->sums) {
    rc = KVT_ERR_NOMEM();
    goto out;
  }
  if (kv) {
    uint64_t fmt;
    if (!cJSON_IsObject(kv) ||
        (rc = json_uint(&fmt, kv, "format", 1000, where)) != 0) {
      rc = BAD("%s: malformed kvtier manifest key", where);
      goto out;
    }
    if (fmt != 1 && fmt != 2) {
      rc = KVT_ERR(KVT_EUNSUPPORTED, "%s: kvtier format %llu not supported",
                   where, (unsigned long long)fmt);
      goto out;
    }
    const cJSON *sm = cJSON_GetObjectItemCaseSensitive(kv, "storage_mode");
    if (cJSON_IsString(sm) && !strcmp(sm->valuestring, "native"))
      m->mode = KVT_STORAGE_NATIVE;
    else if (cJSON_IsString(sm) && !strcmp(sm->valuestring, "compat"))
      m->mode = KVT_STORAGE_COMPAT;
    else {
      rc = BAD("%s: bad kvtier storage_mode", where);
      goto out;
    }
    const cJSON *cs = cJSON_GetObjectItemCaseSensitive(kv, "checksums");
    if (!cJSON_IsObject(cs) ||
        cJSON_GetArraySize(cs) != (int)m->num_layers + 1) {
      rc = BAD("%s: kvtier checksums must list every file", where);
      goto out;
    }
    for (uint32_t i = 0; i <= m->num_layers; i++) {
      char name[40];
      if (i < m->num_layers)
        snprintf(name, sizeof name, "layer_%u.safetensors", i);
      else
        snprintf(name, sizeof name, "tokens.bin");
      const cJSON *c = cJSON_GetObjectItemCaseSensitive(cs, name);
      if (count_key(cs, name) != 1 || !cJSON_IsString(c) ||
          kvti_xxh3_parse(&m->sums[i], c->valuestring) != 0) {
        rc = BAD("%s: checksum of %s missing or malformed", where, name);
        goto out;
      }
    }
    if (fmt == 2 && (rc = parse_blocks(m, kv, where)) != 0)
      goto out;
    m->has_sums = 1;
  }
  uint32_t i = 0;
  for (const cJSON *l = layers->child; l; l = l->next, i++) {
    char what[96];
    snprintf(what, sizeof what, "%.64s layer %u", hash, i);
    if ((rc = kvti_layer_meta_parse(&m->metas[i], l, i, what)) != 0)
      goto out;
  }
out:
  return rc;
}

/* dir_id (optional) receives the entry directory's identity as soon as it is
 * known, even when loading fails later: the reader compares it afterwards to
 * detect a replacement. */
typedef struct dir_id {
  int known;
  dev_t dev;
  ino_t ino;
} dir_id;

static int load_manifest(manifest *m, const char *data_dir, const char *hash,
                         dir_id *id) {
  memset(m, 0, sizeof *m);
  if (!data_dir || !kvti_is_hash_name(hash))
    return KVT_ERR(KVT_EINVAL, "entry name '%.80s' is not 64 hex digits",
                   hash ? hash : "(null)");
  m->dir = kvti_path_join(data_dir, hash);
  if (!m->dir)
    return KVT_ENOMEM;
  int rc;
  struct stat st;
  if ((rc = kvti_lstat(m->dir, &st)) != 0 ||
      (!S_ISDIR(st.st_mode) &&
       (rc = BAD("%s is not a directory", m->dir)) != 0)) {
    manifest_free(m);
    return rc;
  }
  if (id) {
    id->known = 1;
    id->dev = st.st_dev;
    id->ino = st.st_ino;
  }
  char *mp = kvti_path_join(m->dir, "manifest.json");
  char *sp = kvti_path_join(m->dir, "manifest.sum");
  char *text = NULL, *sum = NULL;
  size_t tlen = 0, slen = 0;
  if (!mp || !sp) {
    rc = KVT_ENOMEM;
    goto out;
  }
  rc = kvti_read_file(&text, &tlen, mp, MANIFEST_MAX);
  if (rc == KVT_EPERM && kvt_last_errno() == ELOOP) {
    rc = BAD("%s: manifest.json is a symlink", m->dir);
    goto out;
  }
  if (rc == KVT_ENOTFOUND) {
    rc = KVT_ERR(KVT_ENOTFOUND, "%s: no manifest.json", m->dir);
    goto out;
  }
  if (rc)
    goto out;
  m->bytes = tlen;
  rc = kvti_read_file(&sum, &slen, sp, 4096);
  if (rc == KVT_EPERM && kvt_last_errno() == ELOOP)
    rc = BAD("%s: manifest.sum is a symlink", m->dir);
  if (rc == KVT_ECORRUPT)
    goto out;
  int have_sum = rc == 0;
  if (rc && rc != KVT_ENOTFOUND)
    goto out;
  rc = 0;
  if (have_sum) {
    m->bytes += slen;
    uint64_t want;
    if (slen != SUM_LEN || sum[SUM_LEN - 1] != '\n') {
      rc = BAD("%s: malformed manifest.sum", m->dir);
      goto out;
    }
    sum[SUM_LEN - 1] = '\0';
    if (kvti_xxh3_parse(&want, sum) != 0) {
      rc = BAD("%s: malformed manifest.sum", m->dir);
      goto out;
    }
    if (kvti_xxh3(text, tlen) != want) {
      rc = BAD("%s: manifest.json checksum mismatch", m->dir);
      goto out;
    }
  }
  rc = parse_manifest(m, text, tlen, have_sum, hash, m->dir);
out:
  kvti_free(text);
  kvti_free(sum);
  kvti_free(mp);
  kvti_free(sp);
  if (rc)
    manifest_free(m);
  return rc;
}

int kvti_manifest_validate(const char *text, size_t len) {
  if (!text)
    return KVT_ERR(KVT_EINVAL, "manifest: NULL text");
  manifest m;
  memset(&m, 0, sizeof m);
  /* Standalone: the kvtier key's presence stands in for manifest.sum's. */
  int have_sum = 0;
  cJSON *probe = cJSON_ParseWithLength(text, len);
  if (probe && cJSON_IsObject(probe) &&
      cJSON_GetObjectItemCaseSensitive(probe, "kvtier"))
    have_sum = 1;
  cJSON_Delete(probe);
  int rc = parse_manifest(&m, text, len, have_sum, "(entry)", "manifest");
  manifest_free(&m);
  return rc;
}

/* Reads tokens.bin (when present) and checks it against the manifest, the
 * expected tokens and the entry name. *tokens receives a kvti_malloc'ed copy.
 */
static int load_tokens(int32_t **tokens, uint64_t *bytes, const manifest *m,
                       const char *hash, const kvti_read_opts *o) {
  char *tp = kvti_path_join(m->dir, "tokens.bin");
  if (!tp)
    return KVT_ENOMEM;
  char *buf = NULL;
  size_t len = 0;
  int rc = kvti_read_file(&buf, &len, tp, (size_t)m->num_tokens * 4u);
  int32_t *tok = NULL;
  size_t n = (size_t)m->num_tokens;
  if (rc == KVT_EPERM && kvt_last_errno() == ELOOP)
    rc = BAD("%s: tokens.bin is a symlink", m->dir);
  if (rc == KVT_ECORRUPT) {
    rc = BAD("%s: tokens.bin is not a regular file of num_tokens * 4 bytes",
             m->dir);
    goto out;
  }
  if (rc == KVT_ENOTFOUND) {
    if (m->has_sums || !o || !o->tokens) {
      rc = BAD("%s: tokens.bin missing", m->dir);
      goto out;
    }
  } else if (rc) {
    goto out;
  } else {
    *bytes = len;
    if (len != n * 4u) {
      rc = BAD("%s: tokens.bin has %zu bytes, num_tokens is %zu", m->dir, len,
               n);
      goto out;
    }
    if (m->has_sums && kvti_xxh3(buf, len) != m->sums[m->num_layers]) {
      rc = BAD("%s: tokens.bin checksum mismatch", m->dir);
      goto out;
    }
  }
  rc = 0;
  const void *src = buf;
  if (o && o->tokens) {
    if (o->n_tokens != n) {
      rc = BAD("%s: entry holds %zu tokens, %zu expected", m->dir, n,
               o->n_tokens);
      goto out;
    }
    if (buf && n && memcmp(buf, o->tokens, n * 4u) != 0) {
      rc = BAD("%s: tokens.bin differs from the expected tokens", m->dir);
      goto out;
    }
    src = o->tokens;
  }
  char h[KVT_HASH_HEX_LEN + 1];
  if ((rc = kvt_token_hash(h, src, n)) != 0)
    goto out;
  if (strcmp(h, hash) != 0) {
    rc = BAD("%s: tokens do not hash to the entry name", m->dir);
    goto out;
  }
  tok = kvti_malloc(n * 4u);
  if (!tok) {
    rc = KVT_ERR_NOMEM();
    goto out;
  }
  if (n)
    memcpy(tok, src, n * 4u);
  *tokens = tok;
out:
  kvti_free(buf);
  kvti_free(tp);
  return rc;
}

struct kvti_entry_reader {
  manifest m;
  kvt_entry *e;
  kvti_read_opts o;
  dir_id id;
  uint64_t base_bytes; /* manifest, manifest.sum, tokens.bin */
  uint64_t *layer_bytes;
  unsigned char *done;
  /* Layers may be read from several threads at once: the caller's alloc/free
   * callbacks are called under this lock, so never concurrently. */
  pthread_mutex_t cb_mu;
};

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
  manifest_free(&r->m);
  kvti_free(r->layer_bytes);
  kvti_free(r->done);
  pthread_mutex_destroy(&r->cb_mu);
  kvti_free(r);
}

static int reader_open(kvti_entry_reader **out, const char *data_dir,
                       const char *hash, const kvti_read_opts *o, dir_id *id) {
  static const kvti_read_opts none = {0};
  kvti_entry_reader *r = kvti_calloc(1, sizeof *r);
  if (!r)
    return KVT_ERR_NOMEM();
  r->o = o ? *o : none;
  pthread_mutex_init(&r->cb_mu, NULL);
  int rc = load_manifest(&r->m, data_dir, hash, id);
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
  e->n_tokens = (size_t)r->m.num_tokens;
  if (r->o.alloc) {
    e->free_buf = r->o.free_buf ? r->o.free_buf : noop_free;
    e->alloc_ctx = r->o.alloc_ctx;
  }
  uint64_t tb = 0;
  rc = load_tokens(&e->tokens, &tb, &r->m, hash, &r->o);
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
  dir_id id = {0};
  return reader_open(out, data_dir, hash, o, &id);
}

uint32_t kvti_entry_reader_num_layers(const kvti_entry_reader *r) {
  return r ? r->m.num_layers : 0;
}

int kvti_entry_reader_read_layer(kvti_entry_reader *r, uint32_t i,
                                 const kvt_layer **layer) {
  if (!r || i >= r->m.num_layers || r->done[i])
    return KVT_ERR(KVT_EINVAL, "entry reader: bad layer %u", i);
  char name[40];
  snprintf(name, sizeof name, "layer_%u.safetensors", i);
  char *lp = kvti_path_join(r->m.dir, name);
  if (!lp)
    return KVT_ENOMEM;
  kvti_layer_read_opts lo = {
      r->o.alloc ? reader_alloc : NULL,
      r->o.alloc ? reader_free : NULL,
      r,
      i,
      r->o.cancel,
      r->o.verify_only,
      r->m.has_sums ? &r->m.sums[i] : NULL,
      r->o.io_backend,
      r->o.keep_tokens,
      r->m.block_size,
      r->m.block_size ? r->m.blk_all + r->m.blk_off[i] : NULL,
      r->m.block_size ? r->m.blk_off[i + 1] - r->m.blk_off[i] : 0,
      r->o.page_cache};
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
static int dir_state(const char *dir, const dir_id *id) {
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
  if (dir_state(r->m.dir, &r->id) == 1)
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
    int rc = kvt_token_hash(e->hash, e->tokens, (size_t)keep);
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

/* ---- parallel layer reads ------------------------------------------------ */

/* Layers are independent files: up to READ_THREADS threads (the caller plus
 * helpers) each take the next unread layer and read it straight into its final
 * buffers, verifying it. A warm read is a copy out of the page cache plus a
 * hash, both CPU-bound, so this is what lets a warm promote go beyond one
 * core's copy speed; a cold one gets more I/O in flight. on_layer runs in layer
 * order for the completed prefix, from whichever reading thread completed it,
 * never concurrently; after a cancel no further layer is reported. */
#define READ_THREADS 2
#define MAX_READ_THREADS 8

/* Threads per entry read: READ_THREADS, or KVT_READ_THREADS from the
 * environment (1..8; read once) for tuning on machines with more cores or
 * slower disks. */
static unsigned read_threads(void) {
  static int cached = 0; /* benign race: every thread computes the same value */
  int v = __atomic_load_n(&cached, __ATOMIC_RELAXED);
  if (v == 0) {
    v = READ_THREADS;
    const char *env = getenv("KVT_READ_THREADS");
    if (env && *env) {
      int e = atoi(env);
      if (e >= 1 && e <= MAX_READ_THREADS)
        v = e;
    }
    __atomic_store_n(&cached, v, __ATOMIC_RELAXED);
  }
  return (unsigned)v;
}

typedef struct rd_job {
  pthread_mutex_t mu;
  kvti_entry_reader *r;
  const kvti_read_opts *o;
  const char *hash;
  uint32_t next, delivered;
  unsigned char
      *done; /* under mu (the reader's own flags are written outside it) */
  int reported;
  int rc, os_errno;
  char msg[512];
} rd_job;

static void *rd_worker(void *arg) {
  rd_job *j = arg;
  const kvti_read_opts *o = j->o;
  uint32_t n = j->r->m.num_layers;
  for (;;) {
    pthread_mutex_lock(&j->mu);
    uint32_t i = j->next;
    int stop = j->rc != 0 || i >= n;
    if (!stop)
      j->next++;
    pthread_mutex_unlock(&j->mu);
    if (stop)
      return NULL;
    int rc = 0;
    if (o->cancel && atomic_load(o->cancel))
      rc = KVT_ERR(KVT_ECANCELED, "read of %.12s... cancelled", j->hash);
    else
      rc = kvti_entry_reader_read_layer(j->r, i, NULL);
    pthread_mutex_lock(&j->mu);
    if (rc) {
      if (j->rc == 0) {
        j->rc = rc;
        j->os_errno = kvt_last_errno();
        snprintf(j->msg, sizeof j->msg, "%s", kvt_last_error());
      }
    } else {
      j->done[i] = 1;
      while (j->rc == 0 && j->delivered < n && j->done[j->delivered]) {
        if (o->cancel && atomic_load(o->cancel)) {
          j->rc = KVT_ECANCELED;
          j->os_errno = 0;
          snprintf(j->msg, sizeof j->msg, "read of %.12s... cancelled",
                   j->hash);
          break;
        }
        if (o->on_layer && !o->verify_only) {
          o->on_layer(o->layer_ctx, j->delivered,
                      &j->r->e->layers[j->delivered]);
          j->reported = 1;
        }
        j->delivered++;
      }
    }
    pthread_mutex_unlock(&j->mu);
  }
}

/* Starts reading the head of every layer file (its safetensors header) into
 * the page cache at once, asynchronously (fadvise WILLNEED). Each layer read
 * begins with a small synchronous header read; on a busy disk it waits behind
 * the other reader thread's megabytes in flight (measured: 5.9 ms on average,
 * up to 18 ms, per 16 MiB layer file, time in which that thread had nothing in
 * flight). Prefetched together, the headers are in memory by the time each
 * thread reaches them. Best effort: nothing here can fail the read. */
#define HEADER_PREFETCH ((off_t)64 << 10)
static void prefetch_headers(const kvti_entry_reader *r) {
  if (!kvti_io->fadvise)
    return;
  for (uint32_t i = 0; i < r->m.num_layers; i++) {
    char name[40];
    snprintf(name, sizeof name, "layer_%u.safetensors", i);
    char *lp = kvti_path_join(r->m.dir, name);
    int fd = lp ? kvti_io->open(lp, O_RDONLY | O_NOFOLLOW | O_CLOEXEC, 0) : -1;
    if (fd >= 0) {
      kvti_io->fadvise(fd, 0, HEADER_PREFETCH, POSIX_FADV_WILLNEED);
      kvti_io->close(fd);
    }
    kvti_free(lp);
  }
}

static int read_layers(kvti_entry_reader *r, const kvti_read_opts *o,
                       const char *hash, int *reported) {
  rd_job j;
  memset(&j, 0, sizeof j);
  j.r = r;
  j.o = o;
  j.hash = hash;
  j.done = kvti_calloc(r->m.num_layers ? r->m.num_layers : 1, 1);
  if (!j.done)
    return KVT_ERR_NOMEM();
  pthread_mutex_init(&j.mu, NULL);
  unsigned nthreads = r->m.num_layers >= 4 ? read_threads() : 1;
  if (nthreads > 1 && !o->verify_only)
    prefetch_headers(r);
  pthread_t th[MAX_READ_THREADS];
  unsigned started = 0;
  for (unsigned t = 1; t < nthreads; t++)
    if (pthread_create(&th[started], NULL, rd_worker, &j) == 0)
      started++;
  rd_worker(&j);
  for (unsigned t = 0; t < started; t++)
    pthread_join(th[t], NULL);
  pthread_mutex_destroy(&j.mu);
  kvti_free(j.done);
  *reported = j.reported;
  if (j.rc)
    return kvti_error_restore(j.rc, j.os_errno, j.msg);
  return 0;
}

/* The entry directory may be replaced (a re-spill of the same tokens swaps in a
 * new version) or removed (eviction) while it is read: files would then come
 * from two versions. The directory's identity is compared before and after; a
 * read that saw a replacement is retried (when no layer has been reported
 * through on_layer yet) instead of being mistaken for corruption, and one that
 * saw a removal reports KVT_ENOTFOUND. */
int kvti_entry_read(kvt_entry **out, const char *data_dir, const char *hash,
                    const kvti_read_opts *o) {
  static const kvti_read_opts none = {0};
  if (!o)
    o = &none;
  if (!out && !o->verify_only)
    return KVT_ERR(KVT_EINVAL, "entry read: NULL out");
  for (int attempt = 0;; attempt++) {
    dir_id id = {0};
    int reported = 0;
    kvti_entry_reader *r = NULL;
    kvt_entry *e = NULL;
    int rc = reader_open(&r, data_dir, hash, o, &id);
    if (rc == 0)
      rc = read_layers(r, o, hash, &reported);
    if (rc == 0)
      rc = kvti_entry_reader_finish(&e, r);
    kvti_entry_reader_free(r);
    if (rc == 0) {
      if (out)
        *out = e;
      return 0;
    }
    if (rc != KVT_ECORRUPT && rc != KVT_ENOTFOUND && rc != KVT_EAGAIN)
      return rc;
    if (!id.known)
      return rc; /* no entry directory (or a bad name): nothing to compare */
    char *dir = kvti_path_join(data_dir, hash);
    if (!dir)
      return KVT_ENOMEM;
    int state = dir_state(dir, &id);
    kvti_free(dir);
    if (state == 0)
      return rc; /* genuine: the same directory throughout */
    if (state == 2)
      return KVT_ERR(KVT_ENOTFOUND, "entry %.12s... was removed while read",
                     hash);
    if (reported || attempt >= 2)
      return KVT_ERR(KVT_EAGAIN,
                     "entry %.12s... was replaced while read; retry", hash);
  }
}

/* ---- describe ----------------------------------------------------------- */

static const char *kind_name(int k) {
  switch (k) {
  case KVT_LAYER_KV:
    return "kv";
  case KVT_LAYER_ROTATING_KV:
    return "rotating_kv";
  case KVT_LAYER_ARRAYS:
    return "arrays";
  case KVT_LAYER_QUANTIZED_KV:
    return "quantized_kv";
  default:
    return "unknown";
  }
}

int kvti_entry_describe(char **json, const char *data_dir, const char *hash) {
  if (!json)
    return KVT_ERR(KVT_EINVAL, "describe: NULL out");
  manifest m;
  int rc = load_manifest(&m, data_dir, hash, NULL);
  if (rc)
    return rc;
  cJSON *d = cJSON_CreateObject();
  cJSON *ls = cJSON_CreateArray();
  const kvti_st_tensor **slot = NULL;
  if (!d || !ls) {
    cJSON_Delete(ls);
    rc = KVT_ERR_NOMEM();
    goto out;
  }
  cJSON_AddStringToObject(d, "token_hash", hash);
  cJSON_AddStringToObject(d, "storage_mode",
                          !m.has_sums                    ? "reference"
                          : m.mode == KVT_STORAGE_NATIVE ? "native"
                                                         : "compat");
  cJSON_AddBoolToObject(d, "checksums", m.has_sums);
  cJSON_AddNumberToObject(d, "num_layers", m.num_layers);
  cJSON_AddNumberToObject(d, "num_tokens", (double)m.num_tokens);
  cJSON_AddNumberToObject(d, "memory_bytes", (double)m.memory_bytes);
  cJSON_AddItemReferenceToObject(d, "manifest", m.root);
  cJSON_AddItemToObject(d, "layers", ls);
  uint64_t disk = m.bytes;
  for (uint32_t i = 0; i < m.num_layers; i++) {
    char name[40];
    snprintf(name, sizeof name, "layer_%u.safetensors", i);
    char *lp = kvti_path_join(m.dir, name);
    if (!lp) {
      rc = KVT_ENOMEM;
      goto out;
    }
    kvti_st_header hd = {0};
    int fd = kvti_open(lp, O_RDONLY, 0);
    struct stat st;
    if (fd < 0) {
      rc = fd == KVT_ENOTFOUND ? BAD("%s: layer file missing", lp) : fd;
    } else {
      if (kvti_io->fstat(fd, &st) != 0)
        rc = KVT_ERR_OS(errno, "stat %s", lp);
      else if (!S_ISREG(st.st_mode))
        rc = BAD("%s is not a regular file", lp);
      else
        rc = kvti_st_read_header(&hd, fd, (uint64_t)st.st_size, lp, NULL);
      kvti_io->close(fd);
    }
    kvti_free(slot);
    slot = kvti_calloc(m.metas[i].num_tensors + 1u, sizeof *slot);
    if (!rc && !slot)
      rc = KVT_ERR_NOMEM();
    if (!rc)
      rc = kvti_layer_check_header(slot, &hd, &m.metas[i], lp);
    kvti_free(lp);
    if (rc) {
      kvti_st_header_free(&hd);
      goto out;
    }
    disk += (uint64_t)st.st_size;
    cJSON *lo = cJSON_CreateObject();
    cJSON_AddItemToArray(ls, lo);
    cJSON_AddNumberToObject(lo, "index", i);
    cJSON_AddStringToObject(lo, "file", name);
    cJSON_AddNumberToObject(lo, "bytes", (double)st.st_size);
    cJSON_AddStringToObject(lo, "kind", kind_name(m.metas[i].kind));
    cJSON *ts = cJSON_AddArrayToObject(lo, "tensors");
    for (uint32_t j = 0; j < m.metas[i].num_tensors; j++) {
      const kvti_st_tensor *t = slot[j];
      cJSON *to = cJSON_CreateObject();
      cJSON_AddItemToArray(ts, to);
      cJSON_AddStringToObject(to, "name", t->name);
      cJSON_AddStringToObject(to, "dtype", kvt_dtype_name(t->dtype));
      cJSON *sh = cJSON_AddArrayToObject(to, "shape");
      for (uint32_t k = 0; k < t->ndim; k++)
        cJSON_AddItemToArray(sh, cJSON_CreateNumber((double)t->shape[k]));
      cJSON_AddNumberToObject(to, "nbytes", (double)t->nbytes);
    }
    kvti_st_header_free(&hd);
  }
  {
    struct stat st;
    char *tp = kvti_path_join(m.dir, "tokens.bin");
    if (tp && kvti_io->lstat(tp, &st) == 0)
      disk += (uint64_t)st.st_size;
    kvti_free(tp);
  }
  cJSON_AddNumberToObject(d, "disk_bytes", (double)disk);
  char *s = cJSON_PrintUnformatted(d);
  if (!s) {
    rc = KVT_ERR_NOMEM();
    goto out;
  }
  *json = kvti_strdup(s);
  cJSON_free(s);
  if (!*json)
    rc = KVT_ENOMEM;
out:
  kvti_free(slot);
  cJSON_Delete(d);
  manifest_free(&m);
  return rc;
}
