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
 * This file holds the put (the entry's files listed, read, cut into chunks,
 * uploaded, then the manifest and the prefix set) and the vtable with its
 * constructor. Below it, declared in internal.h and shared by every file of
 * the backend: the key names, commands and chunk batches (keys.c), the
 * remote manifest (rmanifest.c), deletion (remove.c) and the local staging
 * directories (stage.c); beside it, the read path (fetch/get) is fetch.c,
 * the lookups (find, reach) are find.c, and the chunks shared between nodes
 * are chunks.c.
 */
#include "store/backend.h"
#include "base/vec.h"
#include "base/clock.h"
#include "base/error.h"
#include "base/hash.h"
#include "base/io.h"
#include "store/redis.h"
#include "store/redis/mirror.h"
#include "store/redis/internal.h"
#include "store/redis/rclient.h"

#include <cjson/cJSON.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------------ */
/* put                                                                      */
/* ------------------------------------------------------------------------ */

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
    if (!kvti_rb_safe_file_name(de->d_name) || cnt >= RB_MAX_FILES) {
      rc = KVT_ERR(KVT_EINVAL, "entry file name '%s' cannot be stored remotely",
                   de->d_name);
      break;
    }
    if (KVTI_VEC_RESERVE(&v, &cap, cnt + 1, 16) != 0) {
      rc = KVT_ERR_NOMEM();
      break;
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
    kvti_rb_del_chunks(rb, hash, gen, nchunks); /* leave no trace of this put */
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
    kvti_rb_del_chunks(rb, hash, gen, nchunks);
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
    kvti_rb_del_chunks(rb, hash, old.gen, old.n_chunks);
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

static kvti_chunk_backend *rb_chunks(kvti_backend *b) {
  return &kvti_rb(b)->chunks;
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
                                           .chunks = rb_chunks,
                                           .destroy = rb_destroy};

static const kvti_remote_ops redis_remote_ops = {.find = kvti_rb_find,
                                                 .stat = rb_stat,
                                                 .stage = kvti_rb_stage,
                                                 .fetch = kvti_rb_fetch,
                                                 .reach = kvti_rb_reach,
                                                 .put_chained = rb_put_chained};

int kvti_backend_redis_new(kvti_backend **out, const kvti_remote_cfg *cfg) {
  redis_backend *rb = kvti_calloc(1, sizeof *rb);
  if (!rb)
    return KVT_ERR_NOMEM();
  rb->base.ops = &redis_ops;
  rb->base.remote = &redis_remote_ops;
  kvti_rb_chunks_init(rb);
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
