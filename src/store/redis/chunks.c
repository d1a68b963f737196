/*
 * chunks.c - the Redis backend's share of the chunked native store, behind
 * the chunk-store seam (store/chunk_backend.h; docs/REMOTE.md "Chunks"),
 * reached through the backend's chunks op: chunk files
 * stored whole under their chain key, content addressed, so two nodes that
 * spill the same prefix store it once:
 *   <P>{c:<key hex>}    the chunk file (format/chunk.h), SET NX: never
 *                       rewritten
 *   <P>{ci:<d>}         chunk index shard d (the key's first hex digit): a
 *                       hash field <key hex> -> the chain record text
 *                       (cmirror.h) lookups need, read by mirror resyncs
 * and the events "kvt1 + c <key> <record>" / "kvt1 - c <key>" on <P>events.
 * Nothing is verified here: a reader parses and block-verifies every chunk
 * file before it uses or keeps it (store/chunkstore_adopt.c). A chunk found
 * gone (evicted) or removed (damaged) is dropped from the index and published,
 * so other nodes' mirrors stop reporting it.
 */
#include "base/error.h"
#include "base/hash.h"
#include "base/io.h"
#include "store/redis/cmirror.h"
#include "store/redis/internal.h"

#include <inttypes.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

static redis_backend *rb_of(kvti_chunk_backend *cb) {
  return (redis_backend *)((char *)cb - offsetof(redis_backend, chunks));
}

static void key_data(rkey *k, const redis_backend *rb, const uint8_t key[32]) {
  char h[65];
  kvti_hex32(h, key);
  kvti_rb_key_fmt(k, rb, "{c:%s}", h);
}

static void key_shard(rkey *k, const redis_backend *rb, const uint8_t key[32]) {
  k->n = kvr_mirror_chunk_index_key(k->s, sizeof k->s, rb->prefix,
                                    (int)(key[0] >> 4));
}

/* Runs n commands on the slot of key k (client cl); replies freed. 0, the
 * first error reply's code, or a connection error. */
static int run(kvr_client *cl, const rkey *k, kvr_cmd *c, size_t n,
               const char *what) {
  redisReply *r[4] = {NULL, NULL, NULL, NULL};
  int rc = kvr_exec(cl, k->s, k->n, c, n, r);
  for (size_t i = 0; rc == 0 && i < n; i++)
    rc = kvti_rb_reply_err(r[i], what);
  if (rc == 0 || r[0])
    kvti_rb_free_replies(r, n);
  return rc;
}

/* Index + event of a chunk stored (rec) or gone (rec NULL); best effort: a
 * mirror that misses it confirms chunks before reporting them. */
static void announce(redis_backend *rb, const uint8_t key[32],
                     const kvti_chain_rec *rec) {
  rkey sk;
  key_shard(&sk, rb, key);
  char kh[65], rt[320], chan[400], ev[512];
  kvti_hex32(kh, key);
  size_t chl = kvr_mirror_channel(chan, sizeof chan, rb->prefix);
  size_t evl = kvr_mirror_chunk_event(ev, sizeof ev, key, rec);
  kvr_cmd c[3];
  size_t nc = 0;
  if (rec) {
    size_t rl = kvr_crec_format(rt, sizeof rt, rec);
    if (!rl || !evl)
      return;
    kvti_rb_cmd2(&c[nc], "HSET", sk.s, sk.n);
    kvti_rb_cmd_arg(&c[nc], kh, 64);
    kvti_rb_cmd_arg(&c[nc++], rt, rl);
  } else {
    kvti_rb_cmd2(&c[nc], "HDEL", sk.s, sk.n);
    kvti_rb_cmd_arg(&c[nc++], kh, 64);
  }
  kvti_rb_cmd2(&c[nc], "PUBLISH", chan, chl);
  kvti_rb_cmd_arg(&c[nc++], ev, evl);
  if (run(rb->cl, &sk, c, nc, "chunk index") != 0)
    kvt_clear_error();
  if (rec)
    kvr_mirror_chunk_put(rb->mirror, rec);
  else
    kvr_mirror_chunk_del(rb->mirror, key);
}

/* EXISTS of keys[0, n) as one pipeline (all keys on one node). */
static int exists_batch(redis_backend *rb, kvr_client *cl,
                        const uint8_t (*keys)[32], size_t n, uint8_t *present) {
  rkey *k = kvti_malloc(n * sizeof *k);
  kvr_cmd *c = kvti_malloc(n * sizeof *c);
  redisReply **r = kvti_calloc(n, sizeof *r);
  int rc = k && c && r ? 0 : KVT_ERR_NOMEM();
  for (size_t i = 0; rc == 0 && i < n; i++) {
    key_data(&k[i], rb, keys[i]);
    kvti_rb_cmd2(&c[i], "EXISTS", k[i].s, k[i].n);
  }
  if (rc == 0)
    rc = kvr_exec(cl, k[0].s, k[0].n, c, n, r);
  for (size_t i = 0; rc == 0 && i < n; i++)
    if ((rc = kvti_rb_reply_err(r[i], "EXISTS chunk")) == 0) {
      present[i] = r[i]->type == REDIS_REPLY_INTEGER && r[i]->integer > 0;
      if (!present[i])
        kvr_mirror_chunk_del(rb->mirror, keys[i]); /* evicted or expired */
    }
  if (r)
    kvti_rb_free_replies(r, n);
  kvti_free(k);
  kvti_free(c);
  kvti_free(r);
  return rc;
}

static int chunk_has(kvti_chunk_backend *b, const uint8_t (*keys)[32], size_t n,
                     int lookup, uint8_t *present) {
  redis_backend *rb = rb_of(b);
  kvr_client *cl = lookup ? rb->lcl : rb->cl;
  if (n == 0)
    return 0;
  /* A standalone server takes them in one round trip; a cluster's chunks
   * live on many slots: one per key. */
  if (kvr_is_standalone(cl))
    return exists_batch(rb, cl, keys, n, present);
  int rc = 0;
  for (size_t i = 0; rc == 0 && i < n; i++)
    rc = exists_batch(rb, cl, keys + i, 1, present + i);
  return rc;
}

static int chunk_put(kvti_chunk_backend *b, const kvti_chain_rec *rec,
                     const void *bytes, size_t len) {
  redis_backend *rb = rb_of(b);
  rkey k;
  key_data(&k, rb, rec->key);
  char ttl[32];
  snprintf(ttl, sizeof ttl, "%" PRId64, rb->ttl_ms);
  kvr_cmd c;
  kvti_rb_cmd2(&c, "SET", k.s, k.n);
  kvti_rb_cmd_arg(&c, bytes, len);
  kvti_rb_cmd_arg(&c, "NX", 2); /* content addressed: the first copy stays */
  kvti_rb_cmd_px(&c, rb, ttl);
  int rc = run(rb->cl, &k, &c, 1, "SET chunk");
  if (rc == 0)
    announce(rb, rec->key, rec);
  return rc;
}

static int chunk_get(kvti_chunk_backend *b, const uint8_t key[32], void **bytes,
                     size_t *len) {
  redis_backend *rb = rb_of(b);
  rkey k;
  key_data(&k, rb, key);
  kvr_cmd c;
  kvti_rb_cmd2(&c, "GET", k.s, k.n);
  redisReply *r = NULL;
  int rc = kvr_exec(rb->cl, k.s, k.n, &c, 1, &r);
  if (rc != 0)
    return rc;
  int gone = 0;
  if ((rc = kvti_rb_reply_err(r, "GET chunk")) == 0) {
    if (r->type == REDIS_REPLY_NIL) {
      gone = 1;
      rc = KVT_ERR(KVT_ENOTFOUND, "remote chunk %.16s is gone (evicted)",
                   k.s + strlen(rb->prefix) + 3);
    } else if (r->type != REDIS_REPLY_STRING || r->len == 0) {
      rc = KVT_ERR(KVT_ECORRUPT, "remote chunk %.16s is not a string",
                   k.s + strlen(rb->prefix) + 3);
    } else if (!(*bytes = kvti_malloc(r->len))) {
      rc = KVT_ERR_NOMEM();
    } else {
      memcpy(*bytes, r->str, r->len);
      *len = r->len;
    }
  }
  freeReplyObject(r);
  if (gone) {
    kvti_error_state es;
    kvti_error_state_capture(&es, rc);
    announce(rb, key, NULL); /* every mirror forgets it */
    kvti_error_state_restore(&es);
  }
  return rc;
}

static int chunk_remove(kvti_chunk_backend *b, const uint8_t key[32]) {
  redis_backend *rb = rb_of(b);
  rkey k;
  key_data(&k, rb, key);
  kvr_cmd c;
  kvti_rb_cmd2(&c, "UNLINK", k.s, k.n);
  int rc = run(rb->cl, &k, &c, 1, "UNLINK chunk");
  announce(rb, key, NULL);
  return rc;
}

static int chunk_lookup(kvti_chunk_backend *b, const uint8_t *ns, size_t ns_len,
                        const int32_t *tokens, size_t n, uint32_t C,
                        kvti_chain_rec *out, size_t max, size_t *m) {
  *m = kvr_mirror_chunk_lookup(rb_of(b)->mirror, ns, ns_len, tokens, n, C, out,
                               max);
  return 0;
}

static const kvti_chunk_backend_ops chunk_ops = {.name = "redis",
                                                 .has = chunk_has,
                                                 .get = chunk_get,
                                                 .put = chunk_put,
                                                 .remove = chunk_remove,
                                                 .lookup = chunk_lookup};

void kvti_rb_chunks_init(redis_backend *rb) {
  rb->chunks.ops = &chunk_ops;
}
