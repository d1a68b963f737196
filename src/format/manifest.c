/*
 * manifest.c - manifest.json of an entry: built (Python's json.dump of the
 * reference's manifest, plus kvtier's key with the storage mode, the XXH3 of
 * every file and, in format 2, the per-block lists of the layer files) and
 * loaded back (manifest.sum checked first, then every field validated, each
 * layer object through layer_meta.c) before any layer file is opened.
 */
#include "format/entry_int.h"
#include "base/error.h"
#include "base/hash.h"
#include "base/io.h"
#include "format/chunk.h"
#include "format/layer.h"
#include "format/layout.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

/* Written format: 2 = per-block checksums of layer files (docs/FORMAT.md
 * section 6). Format 1 (whole-file checksums) is still read. */
#define KVTI_FORMAT 2
#define MANIFEST_MAX ((size_t)64 << 20)

/* Python json.dump(manifest) with default separators, plus kvtier's key. sums:
 * n_layers layer checksums then the tokens.bin checksum; blk[i] / nblk[i]: the
 * block list of layer i (blk NULL or blk[i] NULL: zeros of that length, for
 * size computations). */
char *kvti_manifest_build(const kvti_snapshot *s, char **metas,
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
                 "%llu, ",
                 (unsigned long long)s->memory_bytes, s->n_tokens, KVTI_FORMAT,
                 mode == KVT_STORAGE_COMPAT ? "compat" : "native",
                 (unsigned long long)KVTI_BLK_DEFAULT);
  char x[24], name[KVTI_LAYER_FILE_MAX];
  if (s->salt.has) { /* the entry's name is then SHA-256(D || tokens) */
    char d[65];
    kvti_hex32(d, s->salt.d);
    kvti_sb_printf(&b, "\"cache_salt\": \"%s\", ", d);
  }
  if (s->chain.present) {
    char key[65];
    kvti_hex32(key, s->chain.last_key);
    kvti_xxh3_format(x, s->chain.layout_hash);
    kvti_sb_printf(&b,
                   "\"chain\": {\"chunks\": %llu, \"chunk_tokens\": %u, "
                   "\"last_key\": \"%s\", \"layout_hash\": \"%s\", "
                   "\"total_rows\": %llu}, ",
                   (unsigned long long)s->chain.chunks, s->chain.chunk_tokens,
                   key, x, (unsigned long long)s->chain.total_rows);
  }
  kvti_sb_puts(&b, "\"checksums\": {");
  for (uint32_t i = 0; i < s->n_layers; i++) {
    kvti_xxh3_format(x, sums[i]);
    kvti_layer_file_name(name, i);
    kvti_sb_printf(&b, "%s\"%s\": \"%s\"", i ? ", " : "", name, x);
  }
  kvti_xxh3_format(x, sums[s->n_layers]);
  kvti_sb_printf(&b, "%s\"" KVTI_TOKENS_FILE "\": \"%s\"}, \"blocks\": {",
                 s->n_layers ? ", " : "", x);
  static const uint64_t zeros[64];
  char hex[64 * 16 + 1];
  for (uint32_t i = 0; i < s->n_layers; i++) {
    kvti_layer_file_name(name, i);
    kvti_sb_printf(&b, "%s\"%s\": \"", i ? ", " : "", name);
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

#define BAD(...) KVT_ERR(KVT_ECORRUPT, __VA_ARGS__)

void kvti_manifest_free(kvti_manifest *m) {
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
static int parse_blocks(kvti_manifest *m, const cJSON *kv, const char *where) {
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
    char name[KVTI_LAYER_FILE_MAX];
    kvti_layer_file_name(name, i);
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
    char name[KVTI_LAYER_FILE_MAX];
    kvti_layer_file_name(name, i);
    if (kvti_blklist_parse(l, val[i]->valuestring, 16 * n) != 0) {
      rc = BAD("%s: block list of %s is not lowercase hex", where, name);
      goto out;
    }
    if (kvti_blklist_digest(l, n) != m->sums[i]) {
      rc = BAD("%s: block list of %s does not match its checksum", where, name);
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
/* JSON values a manifest may hold: a layer's metadata is a few dozen values,
 * block lists are single strings, so this is far above any real manifest of
 * KVTI_MAX_LAYERS layers; it bounds what the parser allocates (about 64 bytes
 * a value) before it runs, whatever the file holds. */
#define MANIFEST_MAX_VALUES ((size_t)1 << 20)

/* "kvtier"."chain" (optional): the tail of a chained entry. Every field is
 * checked; what it names (the chain) is checked by the chunked store. */
static int parse_chain(kvti_chain_mark *c, const cJSON *kv, const char *where) {
  memset(c, 0, sizeof *c);
  if (count_key(kv, "chain") > 1)
    return BAD("%s: duplicate kvtier key 'chain'", where);
  const cJSON *j = cJSON_GetObjectItemCaseSensitive(kv, "chain");
  if (!j)
    return 0;
  uint64_t ct = 0;
  int rc;
  if (!cJSON_IsObject(j))
    return BAD("%s: kvtier chain is not an object", where);
  if ((rc = json_uint(&c->chunks, j, "chunks", UINT32_MAX, where)) ||
      (rc = json_uint(&ct, j, "chunk_tokens", 4096, where)) ||
      (rc = json_uint(&c->total_rows, j, "total_rows", INT32_MAX, where)))
    return rc;
  const cJSON *k = cJSON_GetObjectItemCaseSensitive(j, "last_key");
  const cJSON *l = cJSON_GetObjectItemCaseSensitive(j, "layout_hash");
  if (c->chunks == 0 || !kvti_chunk_tokens_ok(ct) ||
      c->total_rows < c->chunks * ct || !cJSON_IsString(k) ||
      strlen(k->valuestring) != 64 ||
      kvti_unhex32(c->last_key, k->valuestring) != 0 || !cJSON_IsString(l) ||
      kvti_xxh3_parse(&c->layout_hash, l->valuestring) != 0)
    return BAD("%s: malformed kvtier chain", where);
  c->chunk_tokens = (uint32_t)ct;
  c->present = 1;
  return 0;
}

static int parse_manifest(kvti_manifest *m, const char *text, size_t tlen,
                          int have_sum, const char *hash, const char *where) {
  int rc = 0;
  size_t nv = kvti_json_count_values(text, tlen);
  if (nv > MANIFEST_MAX_VALUES)
    return BAD("%s: manifest.json holds about %zu JSON values (limit %zu)",
               where, nv, MANIFEST_MAX_VALUES);
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
    const cJSON *salt = cJSON_GetObjectItemCaseSensitive(kv, "cache_salt");
    if (salt) {
      if (!cJSON_IsString(salt) || count_key(kv, "cache_salt") != 1 ||
          strlen(salt->valuestring) != 64 ||
          kvti_unhex32(m->salt.d, salt->valuestring) != 0) {
        rc = BAD("%s: bad kvtier cache_salt", where);
        goto out;
      }
      m->salt.has = 1;
    }
    if ((rc = parse_chain(&m->chain, kv, where)) != 0)
      goto out;
    const cJSON *cs = cJSON_GetObjectItemCaseSensitive(kv, "checksums");
    if (!cJSON_IsObject(cs) ||
        cJSON_GetArraySize(cs) != (int)m->num_layers + 1) {
      rc = BAD("%s: kvtier checksums must list every file", where);
      goto out;
    }
    for (uint32_t i = 0; i <= m->num_layers; i++) {
      char name[KVTI_LAYER_FILE_MAX];
      if (i < m->num_layers)
        kvti_layer_file_name(name, i);
      else
        snprintf(name, sizeof name, "%s", KVTI_TOKENS_FILE);
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

int kvti_manifest_load(kvti_manifest *m, const char *data_dir, const char *hash,
                       kvti_dir_id *id) {
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
    kvti_manifest_free(m);
    return rc;
  }
  if (id) {
    id->known = 1;
    id->dev = st.st_dev;
    id->ino = st.st_ino;
  }
  char *mp = kvti_path_join(m->dir, KVTI_MANIFEST_FILE);
  char *sp = kvti_path_join(m->dir, KVTI_MANIFEST_SUM_FILE);
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
    if (slen != KVTI_SUM_LEN || sum[KVTI_SUM_LEN - 1] != '\n') {
      rc = BAD("%s: malformed manifest.sum", m->dir);
      goto out;
    }
    sum[KVTI_SUM_LEN - 1] = '\0';
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
    kvti_manifest_free(m);
  return rc;
}

int kvti_manifest_validate(const char *text, size_t len) {
  if (!text)
    return KVT_ERR(KVT_EINVAL, "manifest: NULL text");
  kvti_manifest m;
  memset(&m, 0, sizeof m);
  /* Standalone: the kvtier key's presence stands in for manifest.sum's. */
  int have_sum = 0;
  cJSON *probe = cJSON_ParseWithLength(text, len);
  if (probe && cJSON_IsObject(probe) &&
      cJSON_GetObjectItemCaseSensitive(probe, "kvtier"))
    have_sum = 1;
  cJSON_Delete(probe);
  int rc = parse_manifest(&m, text, len, have_sum, "(entry)", "manifest");
  kvti_manifest_free(&m);
  return rc;
}
