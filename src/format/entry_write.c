/*
 * entry_write.c - the atomic and durable publication of one entry: builds
 * data/<hash>.tmp/ (one safetensors file per layer, tokens.bin, manifest.json,
 * manifest.sum) through one write group and fsyncs it (kvti_entry_stage);
 * kvti_entry_write then publishes it (format/publish.c: an atomic rename,
 * swapping it with an existing version through renameat2(RENAME_EXCHANGE)
 * where available) so that one complete version is in place at every moment
 * and a failure leaves no trace.
 */
#include "format/entry_int.h"
#include "base/error.h"
#include "base/hash.h"
#include "base/io.h"
#include "engine/fwriter.h"
#include "engine/syncset.h"
#include "format/layer.h"
#include "format/layout.h"
#include "format/chainrec.h"
#include "format/publish.h"

#include <stdio.h>
#include <string.h>

static char *suffixed(const char *dir, const char *hash, const char *suf) {
  char name[KVT_HASH_HEX_LEN + 16];
  snprintf(name, sizeof name, "%s%s", hash, suf);
  return kvti_path_join(dir, name);
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

int kvti_entry_stage(uint64_t *disk_bytes, const char *data_dir,
                     const kvti_snapshot *s, const kvti_write_opts *o) {
  if (!data_dir || !s || !o || !kvti_is_hash_name(s->hash))
    return KVT_ERR(KVT_EINVAL, "entry write: bad argument");
  int mode = o->storage_mode;
  if (mode != KVT_STORAGE_NATIVE && mode != KVT_STORAGE_COMPAT)
    return KVT_ERR(KVT_EINVAL, "entry write: bad storage mode %d", mode);
  int rc = 0, tmp_made = 0;
  uint64_t total = 0;
  char *tmp = suffixed(data_dir, s->hash, ".tmp");
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
  if (!tmp || !metas || !sums || !bh || !blk || !nblk) {
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
  if (s->chainrec) { /* an entry of the chunked store: one record */
    if ((rc = kvti_chainrec_stage(disk_bytes, tmp, s, o)) != 0)
      goto out;
    rc = 0;
    goto out;
  }
  /* Every file of the entry goes through one write group: the writes stay in
   * flight across files and all files are fsynced together at the end
   * (fwriter.h) - or, in a group commit's set, together with the files of
   * every other spill of the batch, when the caller runs the set's rounds. */
  if (o->sync) {
    g = kvti_syncset_group(o->sync);
    if (!g) {
      rc = KVT_ERR(KVT_EINVAL, "entry stage: the set's files were synced");
      goto out;
    }
  } else if ((rc = kvti_wgroup_open(&g, o->io_backend, NULL, o->do_fsync)) !=
             0) {
    g = NULL;
    goto out;
  }
  for (uint32_t i = 0; i < s->n_layers; i++) {
    kvti_layer_out p;
    rc = kvti_layer_plan(&p, &s->layers[i], i, mode, s->has_quant, 1);
    if (rc)
      goto out;
    char name[KVTI_LAYER_FILE_MAX];
    kvti_layer_file_name(name, i);
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
  rc = write_small(&sums[s->n_layers], g, tmp, KVTI_TOKENS_FILE, s->tokens,
                   s->n_tokens * sizeof(int32_t), o);
  if (rc)
    goto out;
  total += s->n_tokens * sizeof(int32_t);
  manifest = kvti_manifest_build(s, metas, sums, mode, blk, nblk);
  if (!manifest) {
    rc = KVT_ENOMEM;
    goto out;
  }
  size_t mlen = strlen(manifest);
  rc = write_small(NULL, g, tmp, KVTI_MANIFEST_FILE, manifest, mlen, o);
  if (rc)
    goto out;
  total += mlen;
  char sum[KVTI_SUM_LEN + 8];
  kvti_xxh3_format(sum, kvti_xxh3(manifest, mlen));
  strcat(sum, "\n");
  rc = write_small(NULL, g, tmp, KVTI_MANIFEST_SUM_FILE, sum, KVTI_SUM_LEN, o);
  if (rc)
    goto out;
  total += KVTI_SUM_LEN;
  if (o->sync) { /* the set's rounds sync the files, then tmp */
    g = NULL;
    if ((rc = kvti_syncset_dir(o->sync, tmp)) != 0)
      goto out;
  } else {
    rc = kvti_wgroup_finish(
        g); /* waits, fsyncs every file (durability FSYNC), closes */
    g = NULL;
    if (rc)
      goto out;
    if (o->do_fsync && (rc = kvti_fsync_dir(tmp)) != 0)
      goto out;
  }

  if (disk_bytes)
    *disk_bytes = total;
  rc = 0;
out:
  if (!o->sync) /* the set's group is the set's to abort */
    kvti_wgroup_abort(g);
  if (rc && tmp_made) {
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
  return rc;
}

int kvti_entry_write(uint64_t *disk_bytes, const char *data_dir,
                     const kvti_snapshot *s, const kvti_write_opts *o) {
  if (!data_dir || !s || !o || !kvti_is_hash_name(s->hash))
    return KVT_ERR(KVT_EINVAL, "entry write: bad argument");
  kvti_publish p;
  int rc = kvti_publish_init(&p, data_dir, s->hash, o->do_fsync);
  if (rc)
    return rc;
  uint64_t total = 0;
  rc = kvti_entry_stage(&total, data_dir, s, o);
  if (rc == 0) {
    rc = kvti_publish_do(&p);
    if (rc == 0)
      kvti_publish_commit(&p); /* the previous version, if any, deleted */
    else
      kvti_rmtree(p.tmp); /* nothing published: no trace of the new one */
  }
  kvti_publish_free(&p);
  /* A vanished data/ (or file) is an I/O failure of the write, not "no such
   * entry"; kvt_last_errno() still says ENOENT. */
  if (rc == KVT_ENOTFOUND)
    rc = KVT_EIO;
  if (rc == 0 && disk_bytes)
    *disk_bytes = total;
  return rc;
}
