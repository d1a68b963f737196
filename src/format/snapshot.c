/*
 * snapshot.c - the immutable producer-side copy of a spill: validated and
 * copied (or, without copy, referenced and released once) on the caller's
 * thread, then handed to the writer thread, which never touches caller memory.
 * Also the exact on-disk size an entry will have, computed from the snapshot
 * without converting any data (admission control before the write).
 */
#include "format/entry_int.h"
#include "base/error.h"
#include "base/hash.h"
#include "base/io.h"
#include "format/dtype.h"
#include "format/layer.h"

#include <string.h>

void kvti_snapshot_set_chain(kvti_snapshot *s, const kvti_chain_mark *m) {
  s->chain = *m;
  s->chain.present = 1;
}

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
  kvti_free(s->chainrec);
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
const kvt_layer *kvti_snapshot_layers(const kvti_snapshot *s, uint32_t *n) {
  if (n)
    *n = s->n_layers;
  return s->layers;
}
uint64_t kvti_snapshot_memory_bytes(const kvti_snapshot *s) {
  return s->memory_bytes;
}
void kvti_snapshot_report_dense(kvti_snapshot *s) {
  /* The packed size an engine estimates for a quantized layer is not what a
   * dequantizing promote loads: record the loaded size, so a reservation of
   * memory_bytes is exact for what comes back. */
  if (s->has_quant)
    s->memory_bytes = kvti_layers_dense_bytes(s->layers, s->n_layers);
}
int kvti_snapshot_set_salt(kvti_snapshot *s, const kvti_salt *salt) {
  if (!salt || !salt->has)
    return 0;
  s->salt = *salt;
  return kvti_salt_hex(s->hash, &s->salt, s->tokens, s->n_tokens);
}
const kvti_salt *kvti_snapshot_salt(const kvti_snapshot *s) {
  return &s->salt;
}
uint64_t kvti_snapshot_held_bytes(const kvti_snapshot *s) {
  return s->held;
}

uint64_t kvti_snapshot_disk_bytes(const kvti_snapshot *s, int mode) {
  uint64_t total = (uint64_t)s->n_tokens * 4u + KVTI_SUM_LEN;
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
  char *m = kvti_manifest_build(s, metas, sums, mode, NULL, nblk);
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

int kvti_snapshot_take_layers(kvti_snapshot *s, kvt_layer **layers,
                              uint32_t *n_layers) {
  if (!s || !s->copy || !s->layers)
    return 0;
  *layers = s->layers;
  *n_layers = s->n_layers;
  s->layers = NULL;
  s->n_layers = 0;
  s->held = s->n_tokens * sizeof(int32_t);
  return 1;
}
