/*
 * backend.c - the Redis / Valkey implementation of the storage-backend
 * seam (backend.h). An entry is stored as the very files the local backend
 * writes (entry.c's layer safetensors, manifest.json with its xxh3 checksums,
 * tokens.bin), concatenated in a fixed order and cut into chunks of at most
 * chunk_bytes, each a string value:
 *   <P>{<hash>}:<gen>:<k>   chunk k of generation gen (16 hex, random per put)
 *   <P>{<hash>}:m           the remote manifest (JSON: gen, file names and
 *                           sizes, per-chunk xxh3, num_tokens, memory_bytes,
 *                           created_at), written LAST: it is the commit marker
 *   <P>{z:<prefix_hash>}    sorted set of entries of >= 16 tokens sharing the
 *                           reference's prefix_hash (SHA-256 of the first 16
 *                           tokens); member = token hash, score = length
 *   <P>{s:<first token>}    the same for entries shorter than 16 tokens
 * The hash tag {<hash>} keeps every key of an entry on one cluster slot, so the
 * chunks and the manifest move together in a migration and an entry's batch is
 * one pipeline to one node. A put writes the chunks of a new generation, then
 * the manifest (readers switch atomically), then deletes the old generation. A
 * get reads the manifest, then the chunks of its generation, checks each
 * chunk's size and xxh3, writes the files into a local staging directory and
 * lets entry.c's reader verify them as it verifies a local entry. The server
 * may evict any key at any time: a missing chunk (or a damaged one) makes the
 * entry a miss and deletes what is left of it. Longest-prefix lookups read one
 * or two sorted sets (never a keyspace scan) and confirm each candidate by
 * hashing the query's prefix of that length; stale members are removed as
 * found. Keys expire after retention_seconds when set.
 *
 * This file holds the keys, commands, remote manifest, deletion, staging, put
 * and the vtable; the read path (fetch/get) is fetch.c, the lookups (find,
 * reach) are find.c, and what they share is declared in internal.h.
 */
#include "store/backend.h"
#include "base/clock.h"
#include "base/error.h"
#include "base/hash.h"
#include "base/io.h"
#include "format/chunk.h"
#include "store/redis.h"
#include "store/redis/mirror.h"
#include "store/redis/internal.h"
#include "store/redis/rclient.h"

#include <cjson/cJSON.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------------ */
/* Keys                                                                     */
/* ------------------------------------------------------------------------ */

void kvti_rb_key_fmt(rkey *k, const redis_backend *rb, const char *fmt, ...) {
  int a = snprintf(k->s, sizeof k->s, "%s", rb->prefix);
  va_list ap;
  va_start(ap, fmt);
  int b = vsnprintf(k->s + a, sizeof k->s - (size_t)a, fmt, ap);
  va_end(ap);
  k->n = (size_t)a + (size_t)b;
}

void kvti_rb_key_manifest(rkey *k, const redis_backend *rb, const char *hash) {
  kvti_rb_key_fmt(k, rb, "{%s}:m", hash);
}
void kvti_rb_key_chunk(rkey *k, const redis_backend *rb, const char *hash,
                       const char *gen, uint64_t i) {
  kvti_rb_key_fmt(k, rb, "{%s}:%s:%" PRIu64, hash, gen, i);
}
/* The id of the prefix set an entry of these tokens belongs to: "z:<sha256
 * of the first 16 tokens>" or, shorter than 16, "s:<first token>". */
int kvti_rb_pset_id(char id[80], const int32_t *tokens, size_t n) {
  if (n >= RB_PREFIX_BLOCK) {
    char ph[KVT_HASH_HEX_LEN + 1];
    int rc = kvt_token_hash(ph, tokens, RB_PREFIX_BLOCK);
    if (rc != 0)
      return rc;
    snprintf(id, 80, "z:%s", ph);
  } else {
    snprintf(id, 80, "s:%" PRId32, n ? tokens[0] : 0);
  }
  return 0;
}

/* The prefix set key <P>{<id>} an entry of these tokens belongs to. */
int kvti_rb_key_pset(rkey *k, const redis_backend *rb, const int32_t *tokens,
                     size_t n) {
  char id[80];
  int rc = kvti_rb_pset_id(id, tokens, n);
  if (rc == 0)
    kvti_rb_key_fmt(k, rb, "{%s}", id);
  return rc;
}

/* Appends an argument of len bytes to c (every command here has fewer than
 * KVR_MAX_ARGS). */
void kvti_rb_cmd_arg(kvr_cmd *c, const char *a, size_t len) {
  c->argv[c->argc] = a;
  c->len[c->argc++] = len;
}

/* Starts c as the command a with the argument b of bl bytes. */
void kvti_rb_cmd2(kvr_cmd *c, const char *a, const char *b, size_t bl) {
  c->argc = 0;
  kvti_rb_cmd_arg(c, a, strlen(a));
  kvti_rb_cmd_arg(c, b, bl);
}

/* Appends "PX ttl" to a SET when entries expire (ttl: rb->ttl_ms printed). */
void kvti_rb_cmd_px(kvr_cmd *c, const redis_backend *rb, const char *ttl) {
  if (rb->ttl_ms > 0) {
    kvti_rb_cmd_arg(c, "PX", 2);
    kvti_rb_cmd_arg(c, ttl, strlen(ttl));
  }
}

int kvti_rb_reply_err(const redisReply *r, const char *what) {
  if (r && r->type == REDIS_REPLY_ERROR) {
    if (strstr(r->str, "OOM"))
      return KVT_ERR(KVT_ENOSPC, "redis %s: %s", what, r->str);
    return KVT_ERR(KVT_EIO, "redis %s: %s", what, r->str);
  }
  return 0;
}

void kvti_rb_free_replies(redisReply **r, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (r[i])
      freeReplyObject(r[i]);
}

void kvti_rb_batch_close(chunk_batch *b) {
  if (b->rep)
    kvti_rb_free_replies(b->rep, b->n);
  kvti_free(b->keys);
  kvti_free(b->cmds);
  kvti_free(b->rep);
}

/* Allocates a batch of n (>= 1) and fills its keys; on 0 the caller fills
 * cmds and calls kvti_rb_batch_exec, then kvti_rb_batch_close. */
int kvti_rb_batch_open(chunk_batch *b, const redis_backend *rb,
                       const char *hash, const char *gen, uint64_t base,
                       uint64_t n) {
  b->n = n;
  b->keys = kvti_malloc(n * sizeof *b->keys);
  b->cmds = kvti_malloc(n * sizeof *b->cmds);
  b->rep = kvti_calloc(n, sizeof *b->rep);
  if (!b->keys || !b->cmds || !b->rep) {
    kvti_rb_batch_close(b);
    return KVT_ERR_NOMEM();
  }
  for (uint64_t i = 0; i < n; i++)
    kvti_rb_key_chunk(&b->keys[i], rb, hash, gen, base + i);
  return 0;
}

int kvti_rb_batch_exec(redis_backend *rb, chunk_batch *b) {
  return kvr_exec(rb->cl, b->keys[0].s, b->keys[0].n, b->cmds, b->n, b->rep);
}

/* ------------------------------------------------------------------------ */
/* The remote manifest                                                      */
/* ------------------------------------------------------------------------ */

void kvti_rb_rman_free(rmanifest *m) {
  kvti_free(m->files);
  kvti_free(m->sums);
  kvti_free(m->raw);
  memset(m, 0, sizeof *m);
}

static int safe_file_name(const char *s) {
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
        !safe_file_name(nm->valuestring) || sz->valuedouble < 0 ||
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

/* ------------------------------------------------------------------------ */
/* Deleting                                                                 */
/* ------------------------------------------------------------------------ */

/* Deletes chunks [0, n) of generation gen (pipelined, one slot). */
static int del_chunks(redis_backend *rb, const char *hash, const char *gen,
                      uint64_t n) {
  int rc = 0;
  for (uint64_t base = 0; base < n && rc == 0; base += 256) {
    chunk_batch bt;
    if ((rc = kvti_rb_batch_open(&bt, rb, hash, gen, base,
                                 n - base < 256 ? n - base : 256)) != 0)
      break;
    for (uint64_t i = 0; i < bt.n; i++)
      kvti_rb_cmd2(&bt.cmds[i], "UNLINK", bt.keys[i].s, bt.keys[i].n);
    rc = kvti_rb_batch_exec(rb, &bt);
    kvti_rb_batch_close(&bt);
  }
  return rc;
}

/* Removes hash from the prefix set for its length (needs the first tokens,
 * which only the entry's files know; callers with a manifest pass its
 * pset key when known, else nothing is done: stale members are dropped by
 * lookups anyway). */
int kvti_rb_zrem(redis_backend *rb, const rkey *pset, const char *hash) {
  kvr_cmd c;
  kvti_rb_cmd2(&c, "ZREM", pset->s, pset->n);
  kvti_rb_cmd_arg(&c, hash, KVT_HASH_HEX_LEN);
  redisReply *r = NULL;
  int rc = kvr_exec(rb->cl, pset->s, pset->n, &c, 1, &r);
  if (rc == 0)
    freeReplyObject(r);
  return rc;
}

/* Deletes the manifest only if it is still exactly raw (atomically, one key):
 * a reader cleaning up a damaged version must never delete a newer version a
 * writer has just committed. */
static int manifest_cad(redis_backend *rb, const char *hash, const char *raw,
                        size_t len) {
  static const char script[] =
      "if redis.call('GET', KEYS[1]) == ARGV[1] then "
      "return redis.call('DEL', KEYS[1]) else return 0 end";
  rkey k;
  kvti_rb_key_manifest(&k, rb, hash);
  kvr_cmd c;
  kvti_rb_cmd2(&c, "EVAL", script, sizeof script - 1);
  kvti_rb_cmd_arg(&c, "1", 1);
  kvti_rb_cmd_arg(&c, k.s, k.n);
  kvti_rb_cmd_arg(&c, raw, len);
  redisReply *r = NULL;
  int rc = kvr_exec(rb->cl, k.s, k.n, &c, 1, &r);
  if (rc == 0) {
    rc = kvti_rb_reply_err(r, "EVAL (manifest compare-and-delete)");
    freeReplyObject(r);
  }
  return rc;
}

/* Tells the lookup mirrors that hash is gone (best effort: a mirror that
 * misses it finds the manifest gone at its next confirmation). */
static void publish_removal(redis_backend *rb, const char *hash) {
  char chan[400], ev[256];
  size_t chl = kvr_mirror_channel(chan, sizeof chan, rb->prefix);
  size_t evl = kvr_mirror_event(ev, sizeof ev, hash, NULL, 0);
  kvr_cmd c;
  kvti_rb_cmd2(&c, "PUBLISH", chan, chl);
  kvti_rb_cmd_arg(&c, ev, evl);
  redisReply *r = NULL;
  rkey k;
  kvti_rb_key_manifest(&k, rb, hash);
  if (kvr_exec(rb->cl, k.s, k.n, &c, 1, &r) == 0)
    freeReplyObject(r);
  else
    kvt_clear_error();
  kvr_mirror_del(rb->mirror, hash);
}

/* Deletes every key of one version of an entry: its manifest first (only if
 * it is still that version: readers stop finding it), then the chunks of its
 * generation. known: the version a reader found damaged; NULL: whatever
 * version is stored now (removal, quarantine). */
int kvti_rb_remove_entry(redis_backend *rb, const char *hash,
                         const rmanifest *known) {
  rmanifest m;
  memset(&m, 0, sizeof m);
  const rmanifest *mp = known;
  char *raw = NULL;
  size_t len = 0;
  int rc = 0;
  if (!mp) {
    rc = kvti_rb_rman_get_raw(rb, rb->cl, hash, &raw, &len);
    if (rc == KVT_ENOTFOUND) {
      kvt_clear_error();
      return 0;
    }
    if (rc != 0)
      return rc;
    if (kvti_rb_rman_parse(&m, raw, len, hash, 512ull << 20) == 0)
      mp = &m; /* else a damaged manifest: delete it, no chunks known */
    kvt_clear_error();
  } else {
    raw = mp->raw;
    len = mp->raw_len;
  }
  if (raw)
    rc = manifest_cad(rb, hash, raw, len);
  if (rc == 0 && mp)
    rc = del_chunks(rb, hash, mp->gen, mp->n_chunks);
  if (rc == 0)
    publish_removal(rb, hash);
  if (!known)
    kvti_free(raw);
  kvti_rb_rman_free(&m);
  return rc;
}

/* ------------------------------------------------------------------------ */
/* Staging                                                                  */
/* ------------------------------------------------------------------------ */

int kvti_rb_stage(kvti_backend *b, char **out) {
  redis_backend *rb = kvti_rb(b);
  char name[64];
  snprintf(name, sizeof name, "%ld-%" PRIu64, (long)getpid(),
           (uint64_t)atomic_fetch_add(&rb->stage_seq, 1));
  char *p = kvti_path_join(rb->stage_root, name);
  if (!p)
    return KVT_ENOMEM;
  kvti_rmtree(p);
  int rc = kvti_mkdir(p, rb->dir_mode);
  if (rc != 0) {
    kvti_free(p);
    return rc;
  }
  *out = p;
  return 0;
}

static void random_gen(char gen[17]) {
  static atomic_uint_fast64_t ctr;
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  uint64_t seed[3] = {(uint64_t)ts.tv_sec * 1000000000ull +
                          (uint64_t)ts.tv_nsec,
                      (uint64_t)getpid(), (uint64_t)atomic_fetch_add(&ctr, 1)};
  snprintf(gen, 17, "%016" PRIx64, kvti_xxh3(seed, sizeof seed));
}

static int cmp_rfile(const void *a, const void *b) {
  return strcmp(((const rfile *)a)->name, ((const rfile *)b)->name);
}

/* Lists the regular files of an entry directory (sorted by name). */
static int list_files(rfile **out, size_t *n, const char *dir) {
  DIR *d = kvti_io->opendir(dir);
  if (!d)
    return KVT_ERR_OS(errno, "opendir %s", dir);
  rfile *v = NULL;
  size_t cnt = 0, cap = 0;
  int rc = 0;
  struct dirent *de;
  while ((de = kvti_io->readdir(d)) != NULL) {
    if (de->d_name[0] == '.')
      continue;
    if (!safe_file_name(de->d_name) || cnt >= RB_MAX_FILES) {
      rc = KVT_ERR(KVT_EINVAL, "entry file name '%s' cannot be stored remotely",
                   de->d_name);
      break;
    }
    if (cnt == cap) {
      size_t nc = cap ? cap * 2 : 16;
      rfile *p = kvti_realloc(v, nc * sizeof *p);
      if (!p) {
        rc = KVT_ERR_NOMEM();
        break;
      }
      v = p;
      cap = nc;
    }
    memcpy(v[cnt].name, de->d_name, strlen(de->d_name) + 1); /* < 128 */
    char *path = kvti_path_join(dir, de->d_name);
    struct stat st;
    if (!path) {
      rc = KVT_ENOMEM;
      break;
    }
    rc = kvti_lstat(path, &st);
    kvti_free(path);
    if (rc != 0)
      break;
    v[cnt++].size = (uint64_t)st.st_size;
  }
  kvti_io->closedir(d);
  if (rc != 0) {
    kvti_free(v);
    return rc;
  }
  qsort(v, cnt, sizeof *v, cmp_rfile);
  *out = v;
  *n = cnt;
  return 0;
}

/* ------------------------------------------------------------------------ */
/* put                                                                      */
/* ------------------------------------------------------------------------ */

/* Uploads the files of entry_dir as entry hash. */
static int upload_dir(redis_backend *rb, uint64_t *total_out, const char *hash,
                      const char *entry_dir, const int32_t *tokens, size_t n,
                      uint64_t memory_bytes, int storage_mode,
                      const kvti_chained_entry *ce, const uint8_t *seed) {
  rfile *files = NULL;
  size_t nf = 0;
  int rc = list_files(&files, &nf, entry_dir);
  if (rc != 0)
    return rc;
  uint64_t total = 0;
  for (size_t i = 0; i < nf; i++)
    total += files[i].size;
  uint64_t cb = rb->chunk_bytes;
  uint64_t nchunks = (total + cb - 1) / cb;
  /* The whole blob in memory, in file order (an entry is bounded by the tier's
   * capacity and the spill queue). */
  char *blob = kvti_malloc(total ? total : 1);
  uint64_t *sums = kvti_calloc(nchunks ? nchunks : 1, sizeof *sums);
  rmanifest old;
  int have_old = 0;
  char gen[17];
  random_gen(gen);
  cJSON *o = NULL;
  char *mtxt = NULL;
  if (!blob || !sums) {
    rc = KVT_ERR_NOMEM();
    goto out;
  }
  uint64_t off = 0;
  for (size_t i = 0; i < nf && rc == 0; i++) {
    char *path = kvti_path_join(entry_dir, files[i].name);
    if (!path) {
      rc = KVT_ENOMEM;
      break;
    }
    int fd = kvti_open(path, O_RDONLY, 0);
    if (fd < 0) {
      rc = fd;
    } else {
      rc = kvti_pread_all(fd, blob + off, files[i].size, 0, path);
      kvti_io->close(fd);
    }
    kvti_free(path);
    off += files[i].size;
  }
  if (rc != 0)
    goto out;
  for (uint64_t i = 0; i < nchunks; i++) {
    uint64_t len = total - i * cb < cb ? total - i * cb : cb;
    sums[i] = kvti_xxh3(blob + i * cb, (size_t)len);
  }
  /* The generation being replaced, deleted after the commit. */
  rc = kvti_rb_rman_get(rb, rb->cl, &old, hash);
  if (rc == 0)
    have_old = 1;
  else if (rc != KVT_ENOTFOUND && rc != KVT_ECORRUPT)
    goto out;
  rc = 0;
  kvt_clear_error();
  /* Chunks, pipelined in batches of about RB_BATCH_BYTES. */
  char ttl[32];
  snprintf(ttl, sizeof ttl, "%" PRId64, rb->ttl_ms);
  uint64_t per = RB_BATCH_BYTES / cb ? RB_BATCH_BYTES / cb : 1; /* <= 16384 */
  for (uint64_t base = 0; base < nchunks && rc == 0; base += per) {
    chunk_batch bt;
    if ((rc = kvti_rb_batch_open(&bt, rb, hash, gen, base,
                                 nchunks - base < per ? nchunks - base
                                                      : per)) != 0)
      break;
    for (uint64_t i = 0; i < bt.n; i++) {
      uint64_t ci = base + i;
      uint64_t len = total - ci * cb < cb ? total - ci * cb : cb;
      kvr_cmd *c = &bt.cmds[i];
      kvti_rb_cmd2(c, "SET", bt.keys[i].s, bt.keys[i].n);
      kvti_rb_cmd_arg(c, blob + ci * cb, (size_t)len);
      kvti_rb_cmd_px(c, rb, ttl);
    }
    rc = kvti_rb_batch_exec(rb, &bt);
    for (uint64_t i = 0; rc == 0 && i < bt.n; i++)
      rc = kvti_rb_reply_err(bt.rep[i], "SET chunk");
    kvti_rb_batch_close(&bt);
  }
  if (rc != 0) {
    del_chunks(rb, hash, gen, nchunks); /* leave no trace of this put */
    goto out;
  }
  /* The manifest: the commit marker. */
  o = cJSON_CreateObject();
  cJSON *fa = cJSON_CreateArray(), *sa = cJSON_CreateArray();
  char hsum[24];
  if (!o || !fa || !sa) {
    cJSON_Delete(fa);
    cJSON_Delete(sa);
    rc = KVT_ERR_NOMEM();
    goto out;
  }
  cJSON_AddNumberToObject(o, "kvtier_remote", ce ? 2 : 1);
  cJSON_AddStringToObject(o, "hash", hash);
  if (ce) {
    cJSON *ch = cJSON_AddObjectToObject(o, "chain");
    char lk[65], ly[17], sd[65];
    kvti_hex32(lk, ce->last_key);
    kvti_hex32(sd, seed);
    snprintf(ly, sizeof ly, "%016" PRIx64, ce->layout_hash);
    if (ch) {
      cJSON_AddNumberToObject(ch, "chunks", (double)ce->chunks);
      cJSON_AddNumberToObject(ch, "chunk_tokens", ce->chunk_tokens);
      cJSON_AddStringToObject(ch, "last", lk);
      cJSON_AddStringToObject(ch, "layout", ly);
      cJSON_AddStringToObject(ch, "seed", sd);
      cJSON_AddNumberToObject(ch, "rows", (double)ce->total_rows);
    }
  }
  cJSON_AddStringToObject(o, "gen", gen);
  cJSON_AddNumberToObject(o, "num_tokens", (double)n);
  cJSON_AddNumberToObject(o, "memory_bytes", (double)memory_bytes);
  cJSON_AddNumberToObject(o, "storage_mode", storage_mode);
  cJSON_AddNumberToObject(o, "created_at", kvti_now_wall());
  cJSON_AddNumberToObject(o, "chunk_bytes", (double)cb);
  cJSON_AddNumberToObject(o, "total", (double)total);
  for (size_t i = 0; i < nf; i++) {
    cJSON *f = cJSON_CreateArray();
    cJSON_AddItemToArray(f, cJSON_CreateString(files[i].name));
    cJSON_AddItemToArray(f, cJSON_CreateNumber((double)files[i].size));
    cJSON_AddItemToArray(fa, f);
  }
  for (uint64_t i = 0; i < nchunks; i++) {
    kvti_xxh3_format(hsum, sums[i]);
    cJSON_AddItemToArray(sa, cJSON_CreateString(hsum));
  }
  cJSON_AddItemToObject(o, "files", fa);
  cJSON_AddItemToObject(o, "chunks", sa);
  mtxt = cJSON_PrintUnformatted(o);
  if (!mtxt) {
    rc = KVT_ERR_NOMEM();
    del_chunks(rb, hash, gen, nchunks);
    goto out;
  }
  {
    rkey mk;
    kvti_rb_key_manifest(&mk, rb, hash);
    kvr_cmd c;
    kvti_rb_cmd2(&c, "SET", mk.s, mk.n);
    kvti_rb_cmd_arg(&c, mtxt, strlen(mtxt));
    kvti_rb_cmd_px(&c, rb, ttl);
    redisReply *r = NULL;
    rc = kvr_exec(rb->cl, mk.s, mk.n, &c, 1, &r);
    if (rc == 0) {
      rc = kvti_rb_reply_err(r, "SET manifest");
      freeReplyObject(r);
    }
    if (rc != 0) {
      /* The manifest may or may not be in place (a timeout): if it is, the
       * chunks must stay; a later get sees either a complete entry or a miss.
       */
      goto out;
    }
  }
  /* Index it in its prefix set (best effort: a missing member only hides the
   * entry from prefix lookups; exact lookups still find it). */
  {
    rkey ps;
    char id[80];
    if (kvti_rb_pset_id(id, tokens, n) == 0) {
      kvti_rb_key_fmt(&ps, rb, "{%s}", id);
      char score[32];
      snprintf(score, sizeof score, "%zu", n);
      kvr_cmd c[3];
      kvti_rb_cmd2(&c[0], "ZADD", ps.s, ps.n);
      kvti_rb_cmd_arg(&c[0], score, strlen(score));
      kvti_rb_cmd_arg(&c[0], hash, KVT_HASH_HEX_LEN);
      size_t nc = 1;
      if (rb->ttl_ms > 0) {
        /* The set lives as long as its newest member can. */
        kvti_rb_cmd2(&c[nc], "PEXPIRE", ps.s, ps.n);
        kvti_rb_cmd_arg(&c[nc++], ttl, strlen(ttl));
      }
      /* Tell every node's lookup mirror (after the commit: a receiver that
       * confirms the entry finds its manifest). PUBLISH reaches every
       * subscriber of a cluster from any node. */
      char chan[400], ev[256];
      size_t chl = kvr_mirror_channel(chan, sizeof chan, rb->prefix);
      size_t evl = kvr_mirror_event(ev, sizeof ev, hash, id, n);
      kvti_rb_cmd2(&c[nc], "PUBLISH", chan, chl);
      kvti_rb_cmd_arg(&c[nc++], ev, evl);
      redisReply *r[3] = {NULL, NULL, NULL};
      if (kvr_exec(rb->cl, ps.s, ps.n, c, nc, r) == 0)
        kvti_rb_free_replies(r, nc);
      else
        kvt_clear_error();
      kvr_mirror_put(rb->mirror, hash, id, n);
    }
  }
  if (have_old && strcmp(old.gen, gen) != 0)
    del_chunks(rb, hash, old.gen, old.n_chunks);
  *total_out = total;
out:
  if (have_old)
    kvti_rb_rman_free(&old);
  cJSON_Delete(o);
  if (mtxt)
    cJSON_free(mtxt);
  kvti_free(files);
  kvti_free(blob);
  kvti_free(sums);
  return rc;
}

static int put_common(kvti_backend *b, uint64_t *disk_bytes,
                      const kvti_snapshot *s, const kvti_write_opts *o,
                      const kvti_chained_entry *ce, const uint8_t *seed) {
  redis_backend *rb = kvti_rb(b);
  char *stage = NULL;
  int rc = kvti_rb_stage(b, &stage);
  if (rc != 0)
    return rc;
  kvti_write_opts wo = *o;
  wo.do_fsync = 0; /* a staging copy: never needs to survive a crash */
  uint64_t disk = 0;
  rc = kvti_entry_write(&disk, stage, s, &wo);
  if (rc == 0) {
    const char *hash = kvti_snapshot_hash(s);
    char *dir = kvti_path_join(stage, hash);
    size_t n = 0;
    const int32_t *tokens = kvti_snapshot_tokens(s, &n);
    if (!dir)
      rc = KVT_ENOMEM;
    else
      rc = upload_dir(rb, disk_bytes, hash, dir, tokens, n,
                      kvti_snapshot_memory_bytes(s), o->storage_mode, ce, seed);
    kvti_free(dir);
  }
  kvti_rmtree(stage);
  kvti_free(stage);
  return rc;
}

static int rb_put(kvti_backend *b, uint64_t *disk_bytes, const kvti_snapshot *s,
                  const kvti_write_opts *o) {
  return put_common(b, disk_bytes, s, o, NULL, NULL);
}

static int rb_put_chained(kvti_backend *b, uint64_t *disk_bytes,
                          const kvti_snapshot *s, const kvti_write_opts *o,
                          const kvti_chained_entry *ce,
                          const uint8_t seed[32]) {
  return put_common(b, disk_bytes, s, o, ce, seed);
}

/* ------------------------------------------------------------------------ */
/* The rest of the seam                                                     */
/* ------------------------------------------------------------------------ */

static int rb_stat(kvti_backend *b, kvti_backend_meta *out, const char *hash) {
  if (!kvti_is_hash_name(hash))
    return KVT_ERR(KVT_EINVAL, "invalid entry name");
  rmanifest m;
  int rc = kvti_rb_rman_get(kvti_rb(b), kvti_rb(b)->cl, &m, hash);
  if (rc == 0) {
    *out = m.meta;
    kvti_rb_rman_free(&m);
  }
  return rc;
}

static int rb_remove(kvti_backend *b, const char *hash) {
  return kvti_rb_remove_entry(kvti_rb(b), hash, NULL);
}

static int rb_exists(kvti_backend *b, const char *hash) {
  rmanifest m;
  int rc = kvti_rb_rman_get(kvti_rb(b), kvti_rb(b)->cl, &m, hash);
  if (rc == 0) {
    kvti_rb_rman_free(&m);
    return 1;
  }
  if (rc == KVT_ENOTFOUND || rc == KVT_ECORRUPT) {
    kvt_clear_error();
    return 0;
  }
  return rc;
}

static int rb_describe(kvti_backend *b, char **json, const char *hash) {
  char *stage = NULL;
  int rc = kvti_rb_stage(b, &stage);
  if (rc != 0)
    return rc;
  rc = kvti_rb_fetch(b, NULL, hash, stage);
  if (rc == 0)
    rc = kvti_entry_describe(json, stage, hash);
  kvti_rmtree(stage);
  kvti_free(stage);
  return rc;
}

typedef struct scan_ctx {
  redis_backend *rb;
  kvti_backend_list_fn fn;
  void *ctx;
  int stop;
} scan_ctx;

/* One manifest key (<P>{<hash>}:m) found by SCAN. */
static int scan_key(void *vctx, const char *key, size_t len) {
  scan_ctx *s = vctx;
  size_t plen = strlen(s->rb->prefix);
  if (len != plen + 1 + KVT_HASH_HEX_LEN + 3)
    return 0;
  char hash[KVT_HASH_HEX_LEN + 1];
  memcpy(hash, key + plen + 1, KVT_HASH_HEX_LEN);
  hash[KVT_HASH_HEX_LEN] = '\0';
  if (kvti_is_hash_name(hash) && s->fn(s->ctx, hash, KVTI_BK_ENTRY))
    s->stop = 1;
  return s->stop;
}

/* SCAN one master for manifest keys. Tools only (ls). */
static int scan_node(void *vctx, kvr_client *c, int node) {
  scan_ctx *s = vctx;
  char match[600];
  snprintf(match, sizeof match, "%s{*}:m", s->rb->prefix);
  return s->stop ? 0 : kvr_scan(c, node, match, scan_key, s);
}

static int rb_list(kvti_backend *b, kvti_backend_list_fn fn, void *ctx) {
  scan_ctx s = {kvti_rb(b), fn, ctx, 0};
  return kvr_foreach_master(kvti_rb(b)->cl, scan_node, &s);
}

static int rb_purge(kvti_backend *b, const char *name) {
  (void)b;
  (void)name;
  return 0; /* nothing temporary lives on the server */
}

static int rb_quarantine(kvti_backend *b, const char *hash, uint32_t keep_max) {
  (void)keep_max; /* a shared store keeps no quarantine: corrupt = deleted */
  return kvti_rb_remove_entry(kvti_rb(b), hash, NULL);
}

static void rb_destroy(kvti_backend *b) {
  redis_backend *rb = kvti_rb(b);
  if (!rb)
    return;
  kvr_mirror_stop(rb->mirror); /* before the client it uses */
  kvr_client_free(rb->cl);
  kvr_client_free(rb->lcl);
  pthread_mutex_destroy(&rb->neg_mu);
  kvti_free(rb->prefix);
  kvti_free(rb->stage_root);
  kvti_free(rb);
}

static const kvti_backend_ops redis_ops = {.name = "redis",
                                           .put = rb_put,
                                           .get = kvti_rb_get,
                                           .remove = rb_remove,
                                           .exists = rb_exists,
                                           .present = rb_exists,
                                           .describe = rb_describe,
                                           .list = rb_list,
                                           .purge = rb_purge,
                                           .quarantine = rb_quarantine,
                                           .find = kvti_rb_find,
                                           .stat = rb_stat,
                                           .stage = kvti_rb_stage,
                                           .fetch = kvti_rb_fetch,
                                           .reach = kvti_rb_reach,
                                           .chunk_has = kvti_rb_chunk_has,
                                           .chunk_put = kvti_rb_chunk_put,
                                           .chunk_get = kvti_rb_chunk_get,
                                           .chunk_remove = kvti_rb_chunk_remove,
                                           .chunk_lookup = kvti_rb_chunk_lookup,
                                           .put_chained = rb_put_chained,
                                           .destroy = rb_destroy};

int kvti_backend_redis_new(kvti_backend **out, const kvti_remote_cfg *cfg) {
  redis_backend *rb = kvti_calloc(1, sizeof *rb);
  if (!rb)
    return KVT_ERR_NOMEM();
  rb->base.ops = &redis_ops;
  rb->chunk_bytes = cfg->chunk_bytes;
  rb->ttl_ms = cfg->ttl_ms;
  rb->file_mode = cfg->file_mode;
  rb->dir_mode = cfg->dir_mode;
  atomic_init(&rb->stage_seq, 0);
  pthread_mutex_init(&rb->neg_mu, NULL);
  rb->prefix = kvti_strdup(cfg->prefix ? cfg->prefix : "kvt:");
  rb->stage_root = kvti_strdup(cfg->stage_root);
  int rc = (!rb->prefix || !rb->stage_root) ? KVT_ENOMEM : 0;
  kvr_tls_opts tls = {cfg->tls_ca_file, cfg->tls_cert_file, cfg->tls_key_file};
  if (rc == 0)
    rc = kvr_client_new(&rb->cl, cfg->url, cfg->timeout_ms, &tls);
  if (rc == 0)
    rc = kvr_client_new(&rb->lcl, cfg->url,
                        cfg->lookup_timeout_ms ? cfg->lookup_timeout_ms
                                               : cfg->timeout_ms,
                        &tls);
  if (rc == 0 && cfg->mirror)
    rc = kvr_mirror_start(&rb->mirror, rb->cl, rb->prefix);
  if (rc != 0) {
    rb_destroy(&rb->base);
    return rc;
  }
  *out = &rb->base;
  return 0;
}
