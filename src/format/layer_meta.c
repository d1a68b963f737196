/*
 * layer_meta.c - the manifest object of one layer, read side: parses and
 * validates it (every layer_type the reference accepts plus kvtier's
 * QuantizedKVCache) into a kvti_layer_meta, and checks a layer file's parsed
 * safetensors header against it (exactly the tensors the metadata calls for,
 * with consistent dtypes and shapes); and the one list of a layer's
 * attributes, copied onto a kvt_layer from a parsed object or another layer.
 */
#include "format/layer_int.h"
#include "base/error.h"
#include "base/io.h"
#include "format/dtype.h"
#include "format/layout.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#define BAD(...) KVT_ERR(KVT_ECORRUPT, __VA_ARGS__)

/* JSON integer in [-2^53, 2^53]. */
static int json_i64(int64_t *out, const cJSON *j) {
  if (!cJSON_IsNumber(j))
    return -1;
  double d = j->valuedouble;
  if (!isfinite(d) || fabs(d) > 9007199254740992.0 || floor(d) != d)
    return -1;
  *out = (int64_t)d;
  return 0;
}

static int opt_int(int64_t *out, const cJSON *o, const char *key,
                   const char *what) {
  const cJSON *j = cJSON_GetObjectItemCaseSensitive(o, key);
  *out = KVT_ABSENT;
  if (!j || cJSON_IsNull(j))
    return 0;
  if (json_i64(out, j) != 0)
    return BAD("%s: '%s' is not an integer", what, key);
  return 0;
}

static int req_int(int64_t *out, const cJSON *o, const char *key, int64_t lo,
                   int64_t hi, const char *what) {
  const cJSON *j = cJSON_GetObjectItemCaseSensitive(o, key);
  if (!j)
    return BAD("%s: missing '%s'", what, key);
  if (json_i64(out, j) != 0 || *out < lo || *out > hi)
    return BAD("%s: '%s' is not an integer in [%lld, %lld]", what, key,
               (long long)lo, (long long)hi);
  return 0;
}

/* A hint: absent/null -> none; a string -> its dtype (unknown names: none). */
static int hint_of(int32_t *out, const cJSON *j, const char *key,
                   const char *what) {
  *out = KVT_DTYPE_INVALID;
  if (!j || cJSON_IsNull(j))
    return 0;
  if (!cJSON_IsString(j))
    return BAD("%s: '%s' is not a string", what, key);
  *out = kvti_dtype_from_np_name(j->valuestring);
  return 0;
}

/* Every attribute of a layer (kvt_layer and kvti_layer_meta name them alike):
 * adding one to the structs means adding it here, and every copy follows. */
#define LAYER_ATTRS(F)                                                         \
  F(kind) F(offset) F(max_size) F(keep) F(step) F(idx) F(bits) F(group_size)
#define COPY_ATTR(f) dst->f = src->f;

void kvti_layer_copy_attrs(kvt_layer *dst, const kvt_layer *src) {
  LAYER_ATTRS(COPY_ATTR)
}

void kvti_layer_meta_attrs(kvt_layer *dst, const kvti_layer_meta *src) {
  LAYER_ATTRS(COPY_ATTR)
}

void kvti_layer_meta_free(kvti_layer_meta *m) {
  if (!m)
    return;
  kvti_free(m->orig_dtypes);
  m->orig_dtypes = NULL;
}

int kvti_layer_meta_parse(kvti_layer_meta *m, const void *cjson_obj,
                          int64_t expect_idx, const char *what) {
  const cJSON *o = cjson_obj;
  memset(m, 0, sizeof *m);
  m->offset = m->max_size = m->keep = m->step = m->idx = KVT_ABSENT;
  if (!cJSON_IsObject(o))
    return BAD("%s: layer metadata is not an object", what);
  const cJSON *ty = cJSON_GetObjectItemCaseSensitive(o, "layer_type");
  if (!cJSON_IsString(ty))
    return BAD("%s: layer_type missing or not a string", what);
  const char *t = ty->valuestring;
  int64_t v;
  int rc = req_int(&v, o, "layer_idx", 0, KVTI_MAX_LAYERS, what);
  if (rc)
    return rc;
  if (expect_idx >= 0 && v != expect_idx)
    return BAD("%s: layer_idx %lld where %lld expected", what, (long long)v,
               (long long)expect_idx);
  m->layer_idx = (uint32_t)v;
  int32_t h[2] = {0, 0};
  if (!strcmp(t, "KVCache") || !strcmp(t, "RotatingKVCache")) {
    rc = req_int(&m->offset, o, "offset", 0, INT64_C(1) << 53, what);
    if (!rc)
      rc = opt_int(&m->max_size, o, "max_size", what);
    if (!rc)
      rc = opt_int(&m->keep, o, "keep", what);
    if (!rc)
      rc = opt_int(&m->step, o, "step", what);
    if (!rc)
      rc = opt_int(&m->idx, o, "_idx", what);
    if (!rc)
      rc = hint_of(&h[0],
                   cJSON_GetObjectItemCaseSensitive(o, "keys_original_dtype"),
                   "keys_original_dtype", what);
    if (!rc)
      rc = hint_of(&h[1],
                   cJSON_GetObjectItemCaseSensitive(o, "values_original_dtype"),
                   "values_original_dtype", what);
    if (rc)
      return rc;
    m->kind = (!strcmp(t, "RotatingKVCache") || m->max_size != KVT_ABSENT)
                  ? KVT_LAYER_ROTATING_KV
                  : KVT_LAYER_KV;
    m->num_tensors = 2;
    if (h[0] || h[1]) {
      m->orig_dtypes = kvti_calloc(2, sizeof(int32_t));
      if (!m->orig_dtypes)
        return KVT_ERR_NOMEM();
      m->orig_dtypes[0] = h[0];
      m->orig_dtypes[1] = h[1];
    }
    return 0;
  }
  if (!strcmp(t, "ArraysCache") || !strcmp(t, "MambaCache")) {
    rc = req_int(&v, o, "num_arrays", 0, KVTI_MAX_ARRAYS, what);
    if (!rc)
      rc = opt_int(&m->offset, o, "offset", what);
    if (rc)
      return rc;
    m->kind = KVT_LAYER_ARRAYS;
    m->num_tensors = (uint32_t)v;
    const cJSON *sd =
        cJSON_GetObjectItemCaseSensitive(o, "state_original_dtypes");
    if (sd && !cJSON_IsNull(sd)) {
      if (!cJSON_IsArray(sd) || cJSON_GetArraySize(sd) != (int)v)
        return BAD("%s: state_original_dtypes is not a list of num_arrays "
                   "entries",
                   what);
      m->orig_dtypes = kvti_calloc(v ? (size_t)v : 1, sizeof(int32_t));
      if (!m->orig_dtypes)
        return KVT_ERR_NOMEM();
      uint32_t j = 0;
      int any = 0;
      for (const cJSON *e = sd->child; e; e = e->next, j++) {
        rc = hint_of(&m->orig_dtypes[j], e, "state_original_dtypes", what);
        if (rc) {
          kvti_layer_meta_free(m);
          return rc;
        }
        any |= m->orig_dtypes[j] != 0;
      }
      if (!any) {
        kvti_free(m->orig_dtypes);
        m->orig_dtypes = NULL;
      }
    }
    return 0;
  }
  if (!strcmp(t, "QuantizedKVCache")) {
    int64_t bits, gs;
    rc = opt_int(&m->offset, o, "offset", what);
    if (!rc && m->offset != KVT_ABSENT && m->offset < 0)
      rc = BAD("%s: negative offset", what);
    if (!rc)
      rc = req_int(&bits, o, "bits", 2, 8, what);
    if (!rc)
      rc = req_int(&gs, o, "group_size", 1, 1 << 20, what);
    if (rc)
      return rc;
    if (!kvti_quant_bits_ok((int)bits))
      return BAD("%s: unsupported bits %lld", what, (long long)bits);
    m->kind = KVT_LAYER_QUANTIZED_KV;
    m->bits = (int32_t)bits;
    m->group_size = (int32_t)gs;
    m->num_tensors = 6;
    return 0;
  }
  return BAD("%s: unknown layer_type '%.40s'", what, t);
}

int kvti_layer_check_header(const kvti_st_tensor **slot,
                            const kvti_st_header *hd, const kvti_layer_meta *m,
                            const char *path) {
  if (hd->n != m->num_tensors)
    return BAD("%s: %zu tensors where the manifest describes %u", path, hd->n,
               m->num_tensors);
  char nm[KVTI_NAME_MAX];
  for (uint32_t j = 0; j < m->num_tensors; j++) {
    kvti_tensor_name(nm, m->kind, m->layer_idx, j);
    slot[j] = kvti_st_find(hd, nm);
    if (!slot[j])
      return BAD("%s: tensor '%s' missing", path, nm);
  }
  if (m->kind == KVT_LAYER_QUANTIZED_KV) {
    kvt_layer l;
    kvt_tensor t[6];
    kvt_layer_init(&l, KVT_LAYER_QUANTIZED_KV);
    for (int j = 0; j < 6; j++) {
      memset(&t[j], 0, sizeof t[j]);
      t[j].dtype = slot[j]->dtype;
      t[j].ndim = slot[j]->ndim;
      memcpy(t[j].shape, slot[j]->shape, sizeof t[j].shape);
      t[j].nbytes = slot[j]->nbytes;
    }
    l.tensors = t;
    kvti_layer_meta_attrs(&l, m);
    if (kvti_layer_validate(&l, m->layer_idx, 0) != 0) {
      char why[256];
      snprintf(why, sizeof why, "%s", kvt_last_error());
      return BAD("%s: quantized tensors inconsistent: %s", path, why);
    }
  }
  return 0;
}
