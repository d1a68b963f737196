/*
 * rmanifest.c - the remote manifest of an entry on the Redis server
 * (<P>{<hash>}:m, the entry's commit marker): its JSON parsed and validated
 * (version 1 = a whole entry, version 2 = a chained entry's tail with its
 * chain; generation, file names and sizes, per-chunk xxh3, the entry's
 * metadata), and read from the server as text or parsed. The manifest is
 * written by the put (backend.c); a reader trusts nothing in it that it has
 * not checked here.
 */
#include "base/error.h"
#include "base/hash.h"
#include "base/io.h"
#include "format/chunk.h"
#include "store/redis/internal.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void kvti_rb_rman_free(rmanifest *m) {
  kvti_free(m->files);
  kvti_free(m->sums);
  kvti_free(m->raw);
  memset(m, 0, sizeof *m);
}

int kvti_rb_safe_file_name(const char *s) {
  if (!s[0] || s[0] == '.' || strlen(s) >= 128)
    return 0;
  for (const char *p = s; *p; p++)
    if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') ||
          (*p >= '0' && *p <= '9') || *p == '_' || *p == '.' || *p == '-'))
      return 0;
  return 1;
}

static int num_u64(const cJSON *o, const char *k, uint64_t *out) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
  if (!cJSON_IsNumber(v) || v->valuedouble < 0 || v->valuedouble > 9.0e15)
    return -1;
  *out = (uint64_t)v->valuedouble;
  return 0;
}

/* Parses and validates a remote manifest for entry hash. */
int kvti_rb_rman_parse(rmanifest *m, const char *txt, size_t len,
                       const char *hash, uint64_t chunk_limit) {
  memset(m, 0, sizeof *m);
  cJSON *o = cJSON_ParseWithLength(txt, len);
  if (!o)
    return KVT_ERR(KVT_ECORRUPT, "remote manifest of %.16s is not JSON", hash);
  int rc = KVT_ERR(KVT_ECORRUPT, "remote manifest of %.16s is malformed", hash);
  const cJSON *ver = cJSON_GetObjectItemCaseSensitive(o, "kvtier_remote");
  const cJSON *gen = cJSON_GetObjectItemCaseSensitive(o, "gen");
  const cJSON *files = cJSON_GetObjectItemCaseSensitive(o, "files");
  const cJSON *sums = cJSON_GetObjectItemCaseSensitive(o, "chunks");
  const cJSON *hs = cJSON_GetObjectItemCaseSensitive(o, "hash");
  const cJSON *ca = cJSON_GetObjectItemCaseSensitive(o, "created_at");
  uint64_t sm = 0;
  /* Version 2 = a chained entry's tail: its "chain" says where the rest is
   * (a reader of version 1 only refuses it: never serves a tail alone). */
  if (cJSON_IsNumber(ver) && ver->valueint == 2) {
    const cJSON *ch = cJSON_GetObjectItemCaseSensitive(o, "chain");
    const cJSON *lk = cJSON_GetObjectItemCaseSensitive(ch, "last");
    const cJSON *ly = cJSON_GetObjectItemCaseSensitive(ch, "layout");
    const cJSON *sd = cJSON_GetObjectItemCaseSensitive(ch, "seed");
    uint64_t ct = 0;
    kvti_chained_entry *ce = &m->meta.chain;
    if (!cJSON_IsObject(ch) || num_u64(ch, "chunks", &ce->chunks) ||
        num_u64(ch, "chunk_tokens", &ct) ||
        num_u64(ch, "rows", &ce->total_rows) || !cJSON_IsString(lk) ||
        kvti_unhex32(ce->last_key, lk->valuestring) || !cJSON_IsString(ly) ||
        strlen(ly->valuestring) != 16 || kvti_unhex32(ce->hash, hash) ||
        ce->chunks == 0 || !kvti_chunk_tokens_ok(ct) || !cJSON_IsString(sd) ||
        kvti_unhex32(m->meta.chain_seed, sd->valuestring))
      goto out;
    char *end = NULL;
    ce->layout_hash = strtoull(ly->valuestring, &end, 16);
    if (!end || *end)
      goto out;
    ce->chunk_tokens = (uint32_t)ct;
    m->meta.chained = 1;
  } else if (!cJSON_IsNumber(ver) || ver->valueint != 1) {
    goto out;
  }
  if (!cJSON_IsString(gen) || strlen(gen->valuestring) != 16 ||
      !cJSON_IsArray(files) || !cJSON_IsArray(sums) || !cJSON_IsString(hs) ||
      strcmp(hs->valuestring, hash) != 0 || !cJSON_IsNumber(ca) ||
      num_u64(o, "num_tokens", &m->meta.num_tokens) ||
      num_u64(o, "memory_bytes", &m->meta.memory_bytes) ||
      num_u64(o, "storage_mode", &sm) ||
      num_u64(o, "chunk_bytes", &m->chunk_bytes) ||
      num_u64(o, "total", &m->total))
    goto out;
  for (const char *g = gen->valuestring; *g; g++)
    if (!((*g >= '0' && *g <= '9') || (*g >= 'a' && *g <= 'f')))
      goto out;
  if (m->chunk_bytes == 0 || m->chunk_bytes > chunk_limit)
    goto out;
  m->n_chunks = (m->total + m->chunk_bytes - 1) / m->chunk_bytes;
  int nf = cJSON_GetArraySize(files);
  if (nf < 1 || nf > RB_MAX_FILES ||
      (uint64_t)cJSON_GetArraySize(sums) != m->n_chunks)
    goto out;
  memcpy(m->gen, gen->valuestring, 17);
  snprintf(m->meta.hash, sizeof m->meta.hash, "%s", hash);
  m->meta.created_at = ca->valuedouble;
  m->meta.storage_mode = (int)sm;
  m->meta.total_bytes = m->total;
  m->files = kvti_calloc((size_t)nf, sizeof *m->files);
  m->sums = kvti_calloc(m->n_chunks ? m->n_chunks : 1, sizeof *m->sums);
  if (!m->files || !m->sums) {
    rc = KVT_ERR_NOMEM();
    goto out;
  }
  uint64_t sum = 0;
  for (int i = 0; i < nf; i++) {
    const cJSON *f = cJSON_GetArrayItem(files, i);
    const cJSON *nm = cJSON_GetArrayItem(f, 0), *sz = cJSON_GetArrayItem(f, 1);
    if (!cJSON_IsArray(f) || !cJSON_IsString(nm) || !cJSON_IsNumber(sz) ||
        !kvti_rb_safe_file_name(nm->valuestring) || sz->valuedouble < 0 ||
        sz->valuedouble > 9.0e15)
      goto out;
    for (int j = 0; j < i; j++)
      if (!strcmp(m->files[j].name, nm->valuestring))
        goto out;
    snprintf(m->files[i].name, sizeof m->files[i].name, "%s", nm->valuestring);
    m->files[i].size = (uint64_t)sz->valuedouble;
    sum += m->files[i].size;
  }
  m->n_files = (size_t)nf;
  if (sum != m->total)
    goto out;
  for (uint64_t i = 0; i < m->n_chunks; i++) {
    const cJSON *s = cJSON_GetArrayItem(sums, (int)i);
    if (!cJSON_IsString(s) || kvti_xxh3_parse(&m->sums[i], s->valuestring))
      goto out;
  }
  rc = 0;
  kvt_clear_error();
out:
  cJSON_Delete(o);
  if (rc != 0)
    kvti_rb_rman_free(m);
  return rc;
}

/* GET of the manifest's text: 0 and *raw (kvti_malloc'ed, NUL-terminated),
 * KVT_ENOTFOUND, KVT_ECORRUPT (not a string), I/O errors. */
int kvti_rb_rman_get_raw(redis_backend *rb, kvr_client *cl, const char *hash,
                         char **raw, size_t *len) {
  rkey k;
  kvti_rb_key_manifest(&k, rb, hash);
  kvr_cmd c;
  kvti_rb_cmd2(&c, "GET", k.s, k.n);
  redisReply *r = NULL;
  int rc = kvr_exec(cl, k.s, k.n, &c, 1, &r);
  if (rc != 0)
    return rc;
  if ((rc = kvti_rb_reply_err(r, "GET manifest")) == 0) {
    if (r->type == REDIS_REPLY_NIL) {
      rc = KVT_ERR(KVT_ENOTFOUND, "no remote entry %.16s", hash);
    } else if (r->type != REDIS_REPLY_STRING) {
      rc = KVT_ERR(KVT_ECORRUPT, "remote manifest of %.16s is not a string",
                   hash);
    } else if (!(*raw = kvti_malloc(r->len + 1))) {
      rc = KVT_ERR_NOMEM();
    } else {
      memcpy(*raw, r->str, r->len);
      (*raw)[r->len] = '\0';
      *len = r->len;
    }
  }
  freeReplyObject(r);
  return rc;
}

/* GET and parse of the manifest. 0 and *m, KVT_ENOTFOUND, KVT_ECORRUPT, I/O
 * errors. */
int kvti_rb_rman_get(redis_backend *rb, kvr_client *cl, rmanifest *m,
                     const char *hash) {
  char *raw = NULL;
  size_t len = 0;
  memset(m, 0, sizeof *m);
  int rc = kvti_rb_rman_get_raw(rb, cl, hash, &raw, &len);
  if (rc != 0)
    return rc;
  rc = kvti_rb_rman_parse(m, raw, len, hash, 512ull << 20);
  if (rc != 0) {
    kvti_free(raw);
    return rc;
  }
  m->raw = raw;
  m->raw_len = len;
  return 0;
}
