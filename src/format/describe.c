/*
 * describe.c - kvti_entry_describe: an entry as JSON (manifest, per layer its
 * file, size, kind and tensors, total disk bytes) from the manifest and the
 * layer files' headers, checked as the reader checks them, without reading
 * any tensor data.
 */
#include "format/entry.h"
#include "base/error.h"
#include "base/io.h"
#include "format/layer.h"
#include "format/layout.h"
#include "format/manifest.h"

#include <cjson/cJSON.h>
#include <fcntl.h>
#include <stdio.h>

#define BAD(...) KVT_ERR(KVT_ECORRUPT, __VA_ARGS__)

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
  kvti_manifest m;
  int rc = kvti_manifest_load(&m, data_dir, hash, NULL);
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
    char name[KVTI_LAYER_FILE_MAX];
    kvti_layer_file_name(name, i);
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
      else if (kvti_file_sparse(&st))
        rc = BAD("%s is sparse", lp);
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
    char *tp = kvti_path_join(m.dir, KVTI_TOKENS_FILE);
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
  kvti_manifest_free(&m);
  return rc;
}
