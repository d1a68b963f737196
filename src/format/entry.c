/*
 * entry.c - the public kvt_entry: allocation, accessors and kvt_entry_free
 * (which returns caller-allocated tensor buffers through the caller's
 * free_buf), plus the public calls that hand out what this level builds:
 * kvt_layer_load (one layer file read back as a one-layer entry; it lives here,
 * not with the layer files, so that those never depend on entries) and
 * kvt_free.
 */
#include "format/entry.h"
#include "base/error.h"
#include "base/io.h"
#include "format/layer.h"

#include <cjson/cJSON.h>

void kvti_keep_caller_buf(void *ctx, void *buf) {
  (void)ctx;
  (void)buf;
}

kvt_entry *kvti_entry_new(void) {
  kvt_entry *e = kvti_calloc(1, sizeof *e);
  if (!e)
    KVT_ERR_NOMEM();
  return e;
}

void kvt_entry_free(kvt_entry *e) {
  if (!e)
    return;
  if (e->recycle && e->recycle(e))
    return; /* taken back by the host RAM cache */
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

int kvt_layer_load(kvt_entry **out, const char *path, const char *meta_json) {
  if (!out || !path || !meta_json)
    return KVT_ERR(KVT_EINVAL, "kvt_layer_load: NULL argument");
  cJSON *j = cJSON_Parse(meta_json);
  if (!j)
    return KVT_ERR(KVT_EINVAL, "kvt_layer_load: metadata is not valid JSON");
  kvti_layer_meta m;
  int rc = kvti_layer_meta_parse(&m, j, -1, path);
  cJSON_Delete(j);
  if (rc)
    return rc;
  kvt_entry *e = kvti_entry_new();
  if (!e) {
    kvti_layer_meta_free(&m);
    return KVT_ENOMEM;
  }
  e->layers = kvti_calloc(1, sizeof(kvt_layer));
  if (!e->layers) {
    rc = KVT_ERR_NOMEM();
  } else {
    kvti_layer_read_opts o = {0};
    uint64_t fb = 0;
    rc = kvti_layer_read_file(&e->layers[0], &fb, path, &m, &o);
    if (rc == 0) {
      e->num_layers = 1;
      e->disk_bytes = fb;
    }
  }
  kvti_layer_meta_free(&m);
  if (rc) {
    kvt_entry_free(e);
    return rc;
  }
  *out = e;
  return 0;
}

void kvt_free(void *p) {
  kvti_free(p);
}
