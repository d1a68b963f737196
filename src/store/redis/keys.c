/*
 * keys.c - how the Redis backend addresses the server: the key names of an
 * entry (<P>{<hash>}:m, <P>{<hash>}:<gen>:<k>) and of its prefix set
 * (<P>{z:...} / <P>{s:...}; key layout at the top of backend.c), the
 * commands built over them, the reading of error replies, and the pipelined
 * batches of chunk commands of one generation. Every other file of the
 * backend (put, read path, lookups, deletion, shared chunks) speaks to the
 * server through these.
 */
#include "base/error.h"
#include "base/io.h"
#include "store/redis/internal.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

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
