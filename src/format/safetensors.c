/*
 * safetensors.c - safetensors parsing and writing. The parser treats every file
 * as hostile: it bounds the header length by 100 MB and by the file size,
 * requires a JSON object whose entries are either `__metadata__` (string ->
 * string) or tensors with exactly `dtype`, `shape` and `data_offsets` of the
 * right JSON types, rejects duplicate names, integers that are not exact
 * non-negative integers below 2^53, element-count overflow, byte lengths that
 * disagree with the shape, and data regions that do not tile [0, file_size -
 * data_start) exactly (no gap, no overlap, nothing past or short of the end).
 * The writer mirrors the Python package's layout.
 */
#include "format/safetensors.h"
#include "format/dtype.h"
#include "base/error.h"
#include "base/io.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- JSON strings ------------------------------------------------------ */

/* Python's json.dumps escaping with ensure_ascii=True: \" \\ \n \r \t \b \f,
 * other control characters and every non-ASCII code point as \uXXXX (UTF-16
 * surrogate pairs above U+FFFF). Invalid UTF-8 bytes are escaped as their
 * Latin-1 code points. */
void kvti_sb_json_str(kvti_sb *b, const char *s) {
  kvti_sb_putn(b, "\"", 1);
  const unsigned char *p = (const unsigned char *)s;
  while (*p) {
    unsigned c = *p;
    switch (c) {
    case '"':
      kvti_sb_puts(b, "\\\"");
      p++;
      continue;
    case '\\':
      kvti_sb_puts(b, "\\\\");
      p++;
      continue;
    case '\n':
      kvti_sb_puts(b, "\\n");
      p++;
      continue;
    case '\r':
      kvti_sb_puts(b, "\\r");
      p++;
      continue;
    case '\t':
      kvti_sb_puts(b, "\\t");
      p++;
      continue;
    case '\b':
      kvti_sb_puts(b, "\\b");
      p++;
      continue;
    case '\f':
      kvti_sb_puts(b, "\\f");
      p++;
      continue;
    default:
      break;
    }
    if (c < 0x20) {
      kvti_sb_printf(b, "\\u%04x", c);
      p++;
      continue;
    }
    if (c < 0x80) {
      kvti_sb_putn(b, (const char *)p, 1);
      p++;
      continue;
    }
    uint32_t cp = c;
    int extra = 0;
    if ((c & 0xe0) == 0xc0) {
      cp = c & 0x1f;
      extra = 1;
    } else if ((c & 0xf0) == 0xe0) {
      cp = c & 0x0f;
      extra = 2;
    } else if ((c & 0xf8) == 0xf0) {
      cp = c & 0x07;
      extra = 3;
    } else {
      extra = -1;
    }
    int ok = extra > 0;
    for (int i = 1; ok && i <= extra; i++)
      if ((p[i] & 0xc0) != 0x80)
        ok = 0;
    if (!ok) {
      kvti_sb_printf(b, "\\u%04x", c);
      p++;
      continue;
    }
    for (int i = 1; i <= extra; i++)
      cp = (cp << 6) | (p[i] & 0x3fu);
    p += extra + 1;
    if (cp >= 0x10000) {
      cp -= 0x10000;
      kvti_sb_printf(b, "\\u%04x\\u%04x", 0xd800u + (cp >> 10),
                     0xdc00u + (cp & 0x3ffu));
    } else {
      kvti_sb_printf(b, "\\u%04x", cp);
    }
  }
  kvti_sb_putn(b, "\"", 1);
}

/* ---- parsing ------------------------------------------------------------ */

void kvti_st_header_free(kvti_st_header *hd) {
  if (!hd)
    return;
  for (size_t i = 0; i < hd->n; i++)
    kvti_free(hd->tensors[i].name);
  kvti_free(hd->tensors);
  for (size_t i = 0; i < hd->n_meta; i++) {
    kvti_free(hd->meta_keys[i]);
    kvti_free(hd->meta_vals[i]);
  }
  kvti_free(hd->meta_keys);
  kvti_free(hd->meta_vals);
  memset(hd, 0, sizeof *hd);
}

const kvti_st_tensor *kvti_st_find(const kvti_st_header *hd, const char *name) {
  for (size_t i = 0; i < hd->n; i++)
    if (strcmp(hd->tensors[i].name, name) == 0)
      return &hd->tensors[i];
  return NULL;
}

/* An exact integer in [0, 2^53]: JSON numbers arrive as doubles. */
static int json_u53(uint64_t *out, const cJSON *j) {
  if (!cJSON_IsNumber(j))
    return -1;
  double d = j->valuedouble;
  if (!isfinite(d) || d < 0 || d > 9007199254740992.0 || floor(d) != d)
    return -1;
  *out = (uint64_t)d;
  return 0;
}

static int cmp_name(const void *a, const void *b) {
  return strcmp(((const kvti_st_tensor *)a)->name,
                ((const kvti_st_tensor *)b)->name);
}
static int cmp_off(const void *a, const void *b) {
  const kvti_st_tensor *x = a, *y = b;
  if (x->offset != y->offset)
    return x->offset < y->offset ? -1 : 1;
  if (x->nbytes != y->nbytes)
    return x->nbytes < y->nbytes ? -1 : 1;
  return strcmp(x->name, y->name);
}

#define BAD(...) KVT_ERR(KVT_ECORRUPT, __VA_ARGS__)

static int parse_tensor(kvti_st_tensor *t, const cJSON *o, uint64_t *begin,
                        uint64_t *end, const char *what) {
  if (!cJSON_IsObject(o))
    return BAD("%s: tensor '%s' is not a JSON object", what, t->name);
  const cJSON *dt = NULL, *sh = NULL, *off = NULL;
  for (const cJSON *c = o->child; c; c = c->next) {
    const cJSON **slot = NULL;
    if (strcmp(c->string, "dtype") == 0)
      slot = &dt;
    else if (strcmp(c->string, "shape") == 0)
      slot = &sh;
    else if (strcmp(c->string, "data_offsets") == 0)
      slot = &off;
    else
      return BAD("%s: tensor '%s' has unknown key '%s'", what, t->name,
                 c->string);
    if (*slot)
      return BAD("%s: tensor '%s' has duplicate key '%s'", what, t->name,
                 c->string);
    *slot = c;
  }
  if (!dt || !sh || !off)
    return BAD("%s: tensor '%s' lacks dtype, shape or data_offsets", what,
               t->name);
  if (!cJSON_IsString(dt))
    return BAD("%s: tensor '%s': dtype is not a string", what, t->name);
  t->dtype = kvt_dtype_from_name(dt->valuestring);
  if (t->dtype == KVT_DTYPE_INVALID)
    return BAD("%s: tensor '%s': unsupported dtype '%.32s'", what, t->name,
               dt->valuestring);
  if (!cJSON_IsArray(sh))
    return BAD("%s: tensor '%s': shape is not an array", what, t->name);
  int nd = cJSON_GetArraySize(sh);
  if (nd < 0 || nd > KVT_MAX_DIMS)
    return BAD("%s: tensor '%s': %d dimensions (max %d)", what, t->name, nd,
               KVT_MAX_DIMS);
  t->ndim = (uint32_t)nd;
  int i = 0;
  for (const cJSON *c = sh->child; c; c = c->next, i++) {
    uint64_t v;
    if (json_u53(&v, c) != 0)
      return BAD("%s: tensor '%s': shape[%d] is not a non-negative integer",
                 what, t->name, i);
    t->shape[i] = (int64_t)v;
  }
  if (!cJSON_IsArray(off) || cJSON_GetArraySize(off) != 2 ||
      json_u53(begin, off->child) != 0 || json_u53(end, off->child->next) != 0)
    return BAD("%s: tensor '%s': data_offsets is not [begin, end]", what,
               t->name);
  if (*end < *begin)
    return BAD("%s: tensor '%s': data_offsets end < begin", what, t->name);
  uint64_t nb;
  if (kvti_tensor_nbytes(&nb, t->dtype, t->ndim, t->shape) != 0)
    return BAD("%s: tensor '%s': element count overflows", what, t->name);
  if (nb != *end - *begin)
    return BAD("%s: tensor '%s': shape needs %llu bytes but data_offsets "
               "span %llu",
               what, t->name, (unsigned long long)nb,
               (unsigned long long)(*end - *begin));
  t->nbytes = nb;
  return 0;
}

/* Number of JSON values in text, counted without parsing: every value but the
 * first follows a ',' ':' '[' outside strings (a bound, not an exact count). */
size_t kvti_json_count_values(const char *text, size_t len) {
  size_t n = 1;
  int in_str = 0;
  for (size_t i = 0; i < len; i++) {
    char c = text[i];
    if (in_str) {
      if (c == '\\')
        i++;
      else if (c == '"')
        in_str = 0;
    } else if (c == '"') {
      in_str = 1;
    } else if (c == ',' || c == ':' || c == '[') {
      n++;
    }
  }
  return n;
}

/* JSON values a header may hold: KVTI_ST_MAX_TENSORS tensors of a dozen
 * values each, with room to spare; bounds the parser's allocations. */
#define ST_MAX_VALUES ((size_t)2 << 20)

int kvti_st_parse(kvti_st_header *out, const char *json, size_t len,
                  uint64_t file_size, const char *what) {
  memset(out, 0, sizeof *out);
  if (len < 2 || json[0] != '{')
    return BAD("%s: safetensors header is not a JSON object", what);
  if (len > KVTI_ST_MAX_HEADER || 8u + (uint64_t)len > file_size)
    return BAD("%s: safetensors header length %zu out of range", what, len);
  size_t nv = kvti_json_count_values(json, len);
  if (nv > ST_MAX_VALUES)
    return BAD("%s: safetensors header holds about %zu JSON values (limit %zu)",
               what, nv, ST_MAX_VALUES);
  const char *end = NULL;
  cJSON *root = cJSON_ParseWithLengthOpts(json, len, &end, 0);
  if (!root)
    return BAD("%s: safetensors header is not valid JSON", what);
  int rc = 0;
  for (const char *p = end; p < json + len; p++)
    if (*p != ' ') {
      rc = BAD("%s: garbage after the safetensors header JSON", what);
      goto out;
    }
  if (!cJSON_IsObject(root)) {
    rc = BAD("%s: safetensors header is not a JSON object", what);
    goto out;
  }
  size_t n = 0, nmeta_obj = 0;
  for (const cJSON *c = root->child; c; c = c->next) {
    if (strcmp(c->string, "__metadata__") == 0)
      nmeta_obj++;
    else
      n++;
  }
  if (nmeta_obj > 1) {
    rc = BAD("%s: duplicate __metadata__", what);
    goto out;
  }
  if (n > KVTI_ST_MAX_TENSORS) {
    rc = BAD("%s: too many tensors (%zu)", what, n);
    goto out;
  }
  out->tensors = kvti_calloc(n ? n : 1, sizeof *out->tensors);
  if (!out->tensors) {
    rc = KVT_ERR_NOMEM();
    goto out;
  }
  out->data_start = 8u + (uint64_t)len;
  for (const cJSON *c = root->child; c; c = c->next) {
    if (strcmp(c->string, "__metadata__") == 0) {
      if (cJSON_IsNull(c))
        continue;
      if (!cJSON_IsObject(c)) {
        rc = BAD("%s: __metadata__ is not an object", what);
        goto out;
      }
      size_t m = (size_t)cJSON_GetArraySize(c);
      out->meta_keys = kvti_calloc(m ? m : 1, sizeof(char *));
      out->meta_vals = kvti_calloc(m ? m : 1, sizeof(char *));
      if (!out->meta_keys || !out->meta_vals) {
        rc = KVT_ERR_NOMEM();
        goto out;
      }
      for (const cJSON *e = c->child; e; e = e->next) {
        if (!cJSON_IsString(e)) {
          rc = BAD("%s: __metadata__ value of '%.64s' is not a string", what,
                   e->string);
          goto out;
        }
        for (size_t k = 0; k < out->n_meta; k++)
          if (strcmp(out->meta_keys[k], e->string) == 0) {
            rc = BAD("%s: duplicate __metadata__ key", what);
            goto out;
          }
        out->meta_keys[out->n_meta] = kvti_strdup(e->string);
        out->meta_vals[out->n_meta] = kvti_strdup(e->valuestring);
        out->n_meta++;
        if (!out->meta_keys[out->n_meta - 1] ||
            !out->meta_vals[out->n_meta - 1]) {
          rc = KVT_ENOMEM;
          goto out;
        }
      }
      continue;
    }
    kvti_st_tensor *t = &out->tensors[out->n];
    t->name = kvti_strdup(c->string);
    if (!t->name) {
      rc = KVT_ENOMEM;
      goto out;
    }
    out->n++;
    uint64_t b = 0, e = 0; /* set by parse_tensor on success */
    rc = parse_tensor(t, c, &b, &e, what);
    if (rc)
      goto out;
    if (b > file_size - out->data_start) {
      rc =
          BAD("%s: tensor '%s' starts past the end of the file", what, t->name);
      goto out;
    }
    t->offset = out->data_start + b;
  }
  /* Names must be unique (cJSON keeps duplicate keys). */
  qsort(out->tensors, out->n, sizeof *out->tensors, cmp_name);
  for (size_t i = 1; i < out->n; i++)
    if (strcmp(out->tensors[i - 1].name, out->tensors[i].name) == 0) {
      rc = BAD("%s: duplicate tensor name '%s'", what, out->tensors[i].name);
      goto out;
    }
  /* The data regions must tile [data_start, file_size) exactly. */
  qsort(out->tensors, out->n, sizeof *out->tensors, cmp_off);
  uint64_t pos = out->data_start;
  for (size_t i = 0; i < out->n; i++) {
    kvti_st_tensor *t = &out->tensors[i];
    if (t->offset != pos) {
      rc = BAD("%s: tensor '%s' data %s (at %llu, expected %llu)", what,
               t->name, t->offset < pos ? "overlaps" : "leaves a gap",
               (unsigned long long)(t->offset - out->data_start),
               (unsigned long long)(pos - out->data_start));
      goto out;
    }
    if (t->nbytes > file_size - pos) {
      rc = BAD("%s: tensor '%s' runs past the end of the file", what, t->name);
      goto out;
    }
    pos += t->nbytes;
  }
  if (pos != file_size) {
    rc = BAD("%s: file has %llu bytes after the last tensor", what,
             (unsigned long long)(file_size - pos));
    goto out;
  }
  out->file_size = pos;
out:
  cJSON_Delete(root);
  if (rc)
    kvti_st_header_free(out);
  return rc;
}

int kvti_st_header_len(uint64_t *out, const unsigned char lenb[8],
                       uint64_t file_size, const char *path) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; i--)
    n = (n << 8) | lenb[i];
  if (file_size < 8 || n > KVTI_ST_MAX_HEADER || n > file_size - 8 || n < 2)
    return BAD("%s: safetensors header length %llu out of range (file has "
               "%llu bytes)",
               path, (unsigned long long)n, (unsigned long long)file_size);
  *out = n;
  return 0;
}

int kvti_st_read_header_fn(kvti_st_header *out, int fd, uint64_t file_size,
                           const char *path, kvti_st_feed_fn feed, void *ctx) {
  memset(out, 0, sizeof *out);
  unsigned char lenb[8];
  if (file_size < 8)
    return BAD("%s: too short for a safetensors file (%llu bytes)", path,
               (unsigned long long)file_size);
  int rc = kvti_pread_all(fd, lenb, 8, 0, path);
  if (rc)
    return rc;
  uint64_t n = 0;
  if ((rc = kvti_st_header_len(&n, lenb, file_size, path)) != 0)
    return rc;
  char *buf = kvti_malloc((size_t)n + 1);
  if (!buf)
    return KVT_ERR_NOMEM();
  rc = kvti_pread_all(fd, buf, (size_t)n, 8, path);
  if (rc == 0) {
    buf[n] = '\0';
    if (feed && (rc = feed(ctx, lenb, 8)) == 0)
      rc = feed(ctx, buf, (size_t)n);
    if (rc == 0)
      rc = kvti_st_parse(out, buf, (size_t)n, file_size, path);
  }
  kvti_free(buf);
  return rc;
}

static int feed_xxh3(void *ctx, const void *data, size_t len) {
  kvti_xxh3_update(ctx, data, len);
  return 0;
}

int kvti_st_read_header(kvti_st_header *out, int fd, uint64_t file_size,
                        const char *path, kvti_xxh3_state *h) {
  return kvti_st_read_header_fn(out, fd, file_size, path, h ? feed_xxh3 : NULL,
                                h);
}

/* ---- writing ------------------------------------------------------------ */

/* The Python package (Rust core) lays data out sorted by dtype, largest enum
 * value first, then by name; its Dtype enum order is BOOL U8 I8 I16 U16 F16
 * BF16 I32 U32 F32 F64 I64 U64. */
static int dtype_rank(kvt_dtype dt) {
  switch (dt) {
  case KVT_DTYPE_BOOL:
    return 0;
  case KVT_DTYPE_U8:
    return 1;
  case KVT_DTYPE_I8:
    return 2;
  case KVT_DTYPE_I16:
    return 3;
  case KVT_DTYPE_U16:
    return 4;
  case KVT_DTYPE_F16:
    return 5;
  case KVT_DTYPE_BF16:
    return 6;
  case KVT_DTYPE_I32:
    return 7;
  case KVT_DTYPE_U32:
    return 8;
  case KVT_DTYPE_F32:
    return 9;
  case KVT_DTYPE_F64:
    return 10;
  case KVT_DTYPE_I64:
    return 11;
  case KVT_DTYPE_U64:
    return 12;
  default:
    return -1;
  }
}

typedef struct {
  size_t idx;
  const kvti_st_item *items;
} ord_t;

static int cmp_data_order(const void *a, const void *b) {
  const ord_t *x = a, *y = b;
  const kvti_st_item *i = &x->items[x->idx], *j = &y->items[y->idx];
  int ri = dtype_rank(i->t->dtype), rj = dtype_rank(j->t->dtype);
  if (ri != rj)
    return ri > rj ? -1 : 1;
  return strcmp(i->name, j->name);
}
static int cmp_item_name(const void *a, const void *b) {
  const ord_t *x = a, *y = b;
  return strcmp(x->items[x->idx].name, y->items[y->idx].name);
}

int kvti_st_build_header(char **hdr, size_t *hdr_len, size_t *order,
                         const kvti_st_item *items, size_t n,
                         const char *const *meta, size_t n_meta) {
  for (size_t i = 0; i < n; i++) {
    const kvt_tensor *t = items[i].t;
    uint64_t nb;
    if (!items[i].name || !items[i].name[0] ||
        strcmp(items[i].name, "__metadata__") == 0)
      return KVT_ERR(KVT_EINVAL, "invalid tensor name");
    if (kvti_tensor_nbytes(&nb, (kvt_dtype)t->dtype, t->ndim, t->shape) != 0 ||
        nb != t->nbytes)
      return KVT_ERR(KVT_EINVAL,
                     "tensor '%s': dtype/shape do not match nbytes %llu",
                     items[i].name, (unsigned long long)t->nbytes);
    if (nb && !t->data)
      return KVT_ERR(KVT_EINVAL, "tensor '%s': NULL data", items[i].name);
  }
  ord_t *o = kvti_calloc(n ? n : 1, sizeof *o);
  uint64_t *offs = kvti_calloc(n ? n : 1, sizeof *offs);
  kvti_sb b = {0};
  int rc = 0;
  if (!o || !offs) {
    rc = KVT_ERR_NOMEM();
    goto out;
  }
  for (size_t i = 0; i < n; i++)
    o[i] = (ord_t){i, items};
  qsort(o, n, sizeof *o, cmp_data_order);
  uint64_t pos = 0;
  for (size_t i = 0; i < n; i++) {
    order[i] = o[i].idx;
    offs[o[i].idx] = pos;
    pos += items[o[i].idx].t->nbytes;
  }
  qsort(o, n, sizeof *o, cmp_item_name);
  for (size_t i = 1; i < n; i++)
    if (strcmp(items[o[i].idx].name, items[o[i - 1].idx].name) == 0) {
      rc = KVT_ERR(KVT_EINVAL, "duplicate tensor name '%s'",
                   items[o[i].idx].name);
      goto out;
    }
  kvti_sb_putn(&b, "\0\0\0\0\0\0\0\0{", 9);
  int first = 1;
  if (n_meta) {
    /* keys sorted, like a BTreeMap */
    kvti_sb_puts(&b, "\"__metadata__\":{");
    const char **ks = kvti_calloc(n_meta, sizeof *ks);
    if (!ks) {
      rc = KVT_ERR_NOMEM();
      goto out;
    }
    for (size_t i = 0; i < n_meta; i++)
      ks[i] = NULL;
    int used_first = 1;
    for (size_t k = 0; k < n_meta; k++) {
      /* selection of the k-th smallest key (n_meta is tiny) */
      size_t best = SIZE_MAX;
      for (size_t i = 0; i < n_meta; i++) {
        int taken = 0;
        for (size_t j = 0; j < k; j++)
          if (ks[j] == meta[2 * i])
            taken = 1;
        if (!taken &&
            (best == SIZE_MAX || strcmp(meta[2 * i], meta[2 * best]) < 0))
          best = i;
      }
      ks[k] = meta[2 * best];
      if (!used_first)
        kvti_sb_putn(&b, ",", 1);
      used_first = 0;
      kvti_sb_json_str(&b, meta[2 * best]);
      kvti_sb_putn(&b, ":", 1);
      kvti_sb_json_str(&b, meta[2 * best + 1]);
    }
    kvti_free(ks);
    kvti_sb_putn(&b, "}", 1);
    first = 0;
  }
  for (size_t i = 0; i < n; i++) {
    const kvti_st_item *it = &items[order[i]];
    if (!first)
      kvti_sb_putn(&b, ",", 1);
    first = 0;
    kvti_sb_json_str(&b, it->name);
    kvti_sb_printf(&b, ":{\"dtype\":\"%s\",\"shape\":[",
                   kvt_dtype_name((kvt_dtype)it->t->dtype));
    for (uint32_t d = 0; d < it->t->ndim; d++)
      kvti_sb_printf(&b, d ? ",%lld" : "%lld", (long long)it->t->shape[d]);
    kvti_sb_printf(&b, "],\"data_offsets\":[%llu,%llu]}",
                   (unsigned long long)offs[order[i]],
                   (unsigned long long)(offs[order[i]] + it->t->nbytes));
  }
  kvti_sb_putn(&b, "}", 1);
  while (!b.oom && (b.len - 8) % 8 != 0)
    kvti_sb_putn(&b, " ", 1);
  if (b.oom) {
    rc = KVT_ERR_NOMEM();
    goto out;
  }
  uint64_t hl = b.len - 8;
  for (int i = 0; i < 8; i++)
    b.s[i] = (char)((hl >> (8 * i)) & 0xffu);
  *hdr_len = b.len;
  *hdr = b.s;
  b.s = NULL;
out:
  kvti_sb_free(&b);
  kvti_free(o);
  kvti_free(offs);
  return rc;
}

int kvti_st_pad_header(char **hdr, size_t *hdr_len, size_t align) {
  if (align < 8 || (align & (align - 1)) != 0 || *hdr_len < 8)
    return KVT_ERR(KVT_EINVAL, "bad header alignment %zu", align);
  size_t want = (*hdr_len + align - 1) & ~(align - 1);
  if (want == *hdr_len)
    return 0;
  char *p = kvti_realloc(*hdr, want);
  if (!p)
    return KVT_ERR_NOMEM();
  memset(p + *hdr_len, ' ', want - *hdr_len);
  uint64_t hl = want - 8;
  for (int i = 0; i < 8; i++)
    p[i] = (char)((hl >> (8 * i)) & 0xffu);
  *hdr = p;
  *hdr_len = want;
  return 0;
}

uint64_t kvti_st_file_size(const kvti_st_item *items, size_t n,
                           const char *const *meta, size_t n_meta) {
  size_t *order = kvti_calloc(n ? n : 1, sizeof *order);
  if (!order) {
    KVT_ERR_NOMEM();
    return 0;
  }
  char *hdr = NULL;
  size_t hl = 0;
  uint64_t total = 0;
  if (kvti_st_build_header(&hdr, &hl, order, items, n, meta, n_meta) == 0) {
    total = hl;
    for (size_t i = 0; i < n; i++)
      total += items[i].t->nbytes;
  }
  kvti_free(hdr);
  kvti_free(order);
  return total;
}

#define WCHUNK ((size_t)1 << 20)

int kvti_st_write(uint64_t *size, uint64_t *xxh3, int fd, const char *path,
                  const kvti_st_item *items, size_t n, const char *const *meta,
                  size_t n_meta) {
  size_t *order = kvti_calloc(n ? n : 1, sizeof *order);
  kvti_xxh3_state *h = kvti_xxh3_new();
  char *hdr = NULL;
  size_t hl = 0;
  int rc = 0;
  if (!order || !h) {
    rc = KVT_ERR_NOMEM();
    goto out;
  }
  rc = kvti_st_build_header(&hdr, &hl, order, items, n, meta, n_meta);
  if (rc)
    goto out;
  kvti_xxh3_update(h, hdr, hl);
  rc = kvti_pwrite_all(fd, hdr, hl, 0, path);
  uint64_t pos = hl;
  for (size_t i = 0; rc == 0 && i < n; i++) {
    const kvt_tensor *t = items[order[i]].t;
    const char *p = t->data;
    uint64_t left = t->nbytes;
    /* hash each chunk right before writing it, while it is in cache */
    while (rc == 0 && left > 0) {
      size_t c = left < WCHUNK ? (size_t)left : WCHUNK;
      kvti_xxh3_update(h, p, c);
      rc = kvti_pwrite_all(fd, p, c, pos, path);
      p += c;
      pos += c;
      left -= c;
    }
  }
  if (rc == 0) {
    if (size)
      *size = pos;
    if (xxh3)
      *xxh3 = kvti_xxh3_digest(h);
  }
out:
  kvti_free(hdr);
  kvti_free(order);
  if (h)
    kvti_xxh3_free(h);
  return rc;
}
