/*
 * find.c - the Redis backend's lookups (the vtable's find and reach): the
 * longest stored entry that is a prefix of a token sequence. While the lookup
 * mirror (mirror.c) is in sync, candidates come from it (no round trip) and
 * the chosen one is confirmed by one GET of its manifest; otherwise the lookup
 * reads one or two prefix sorted sets (never a keyspace scan), confirms each
 * candidate by hashing the query's prefix of that length, removes stale
 * members as found, and remembers misses briefly in a negative cache. Lookups
 * run on the lookup client (remote_lookup_timeout_ms).
 */
#include "base/error.h"
#include "base/hash.h"
#include "store/redis/internal.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ------------------------------------------------------------------------ */
/* Lookups                                                                  */
/* ------------------------------------------------------------------------ */

/* Candidates of one prefix set, longest first, with lengths in [lo, hi], read
 * in pages: many siblings may share the first 16 tokens (the reference's SQL
 * prefilter scans them too). Each distinct length is hashed once. */
#define RB_PAGE 256
#define RB_MAX_PAGES 64
static int find_page(redis_backend *rb, kvr_client *cl, kvti_backend_meta *out,
                     const rkey *ps, const int32_t *tokens, uint64_t lo,
                     uint64_t hi, unsigned page, int *more, uint64_t *last_len,
                     char *last_hash);

static int find_in_set(redis_backend *rb, kvr_client *cl,
                       kvti_backend_meta *out, const rkey *ps,
                       const int32_t *tokens, uint64_t lo, uint64_t hi) {
  if (lo > hi)
    return KVT_ENOTFOUND;
  uint64_t last_len = 0;
  char last_hash[KVT_HASH_HEX_LEN + 1] = "";
  for (unsigned page = 0; page < RB_MAX_PAGES; page++) {
    int more = 0;
    int rc = find_page(rb, cl, out, ps, tokens, lo, hi, page, &more, &last_len,
                       last_hash);
    if (rc != KVT_ENOTFOUND || !more)
      return rc;
  }
  return KVT_ENOTFOUND;
}

static int find_page(redis_backend *rb, kvr_client *cl, kvti_backend_meta *out,
                     const rkey *ps, const int32_t *tokens, uint64_t lo,
                     uint64_t hi, unsigned page, int *more, uint64_t *last_len,
                     char *last_hash) {
  char shi[32], slo[32], off[32], cnt[16];
  snprintf(shi, sizeof shi, "%" PRIu64, hi);
  snprintf(slo, sizeof slo, "%" PRIu64, lo);
  snprintf(off, sizeof off, "%u", page * RB_PAGE);
  snprintf(cnt, sizeof cnt, "%u", RB_PAGE);
  const char *argv[] = {"ZREVRANGEBYSCORE", ps->s,   shi, slo,
                        "WITHSCORES",       "LIMIT", off, cnt};
  kvr_cmd c;
  kvr_cmd_set(&c, 8, argv);
  c.len[1] = ps->n;
  redisReply *r = NULL;
  int rc = kvr_exec(cl, ps->s, ps->n, &c, 1, &r);
  if (rc != 0)
    return rc;
  if ((rc = kvti_rb_reply_err(r, "ZREVRANGEBYSCORE")) != 0 ||
      r->type != REDIS_REPLY_ARRAY) {
    freeReplyObject(r);
    return rc ? rc
              : KVT_ERR(KVT_EIO, "redis: unexpected ZREVRANGEBYSCORE reply");
  }
  *more = r->elements == 2 * RB_PAGE;
  rc = KVT_ENOTFOUND;
  for (size_t i = 0; i + 1 < r->elements; i += 2) {
    const redisReply *mem = r->element[i], *sc = r->element[i + 1];
    if (mem->type != REDIS_REPLY_STRING || sc->type != REDIS_REPLY_STRING ||
        mem->len != KVT_HASH_HEX_LEN)
      continue;
    char hash[KVT_HASH_HEX_LEN + 1];
    memcpy(hash, mem->str, KVT_HASH_HEX_LEN);
    hash[KVT_HASH_HEX_LEN] = '\0';
    uint64_t len = strtoull(sc->str, NULL, 10);
    if (len < lo || len > hi || !kvti_is_hash_name(hash))
      continue;
    if (len != *last_len) {
      if (kvt_token_hash(last_hash, tokens, (size_t)len) != 0)
        continue;
      *last_len = len;
    }
    if (strcmp(last_hash, hash) != 0)
      continue; /* another sequence with the same first 16 tokens */
    rmanifest m;
    int g = kvti_rb_rman_get(rb, cl, &m, hash);
    if (g == 0) {
      *out = m.meta;
      kvti_rb_rman_free(&m);
      rc = 0;
      break;
    }
    if (g == KVT_ENOTFOUND || g == KVT_ECORRUPT) {
      if (g == KVT_ECORRUPT)
        kvti_rb_remove_entry(rb, hash, NULL);
      kvti_rb_zrem(rb, ps,
                   hash); /* stale member: the entry expired or was evicted */
      continue;
    }
    rc = g;
    break;
  }
  freeReplyObject(r);
  if (rc == KVT_ENOTFOUND)
    kvt_clear_error();
  return rc;
}

/* The round-trip lookup on client cl (no mirror). */
static int find_on(redis_backend *rb, kvr_client *cl, kvti_backend_meta *out,
                   const int32_t *tokens, size_t n, int prefix,
                   uint64_t min_len) {
  if (min_len < 1)
    min_len = 1;
  if (!prefix || n == 0) {
    if (n < min_len)
      return KVT_ERR(KVT_ENOTFOUND, "no remote entry");
    char hash[KVT_HASH_HEX_LEN + 1];
    int rc = kvt_token_hash(hash, tokens, n);
    if (rc != 0)
      return rc;
    rmanifest m;
    rc = kvti_rb_rman_get(rb, cl, &m, hash);
    if (rc == 0) {
      *out = m.meta;
      kvti_rb_rman_free(&m);
    } else if (rc == KVT_ECORRUPT) {
      kvti_rb_remove_entry(rb, hash, NULL);
      rc = KVT_ERR(KVT_ENOTFOUND, "remote manifest of %.16s was damaged", hash);
    }
    return rc;
  }
  rkey ps;
  int rc = KVT_ENOTFOUND;
  if (n >= RB_PREFIX_BLOCK) {
    if ((rc = kvti_rb_key_pset(&ps, rb, tokens, n)) != 0)
      return rc;
    rc = find_in_set(rb, cl, out, &ps, tokens,
                     min_len > RB_PREFIX_BLOCK ? min_len : RB_PREFIX_BLOCK, n);
  }
  if (rc == KVT_ENOTFOUND && min_len < RB_PREFIX_BLOCK) {
    size_t hi = n < RB_PREFIX_BLOCK ? n : RB_PREFIX_BLOCK - 1;
    if ((rc = kvti_rb_key_pset(&ps, rb, tokens, 1)) != 0)
      return rc;
    rc = find_in_set(rb, cl, out, &ps, tokens, min_len, hi);
  }
  if (rc == KVT_ENOTFOUND)
    return KVT_ERR(KVT_ENOTFOUND,
                   "no remote entry is a prefix of these %zu "
                   "tokens",
                   n);
  return rc;
}

/* ---- the cheap lookup: mirror first ---- */

static double mono_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static uint64_t neg_key(const int32_t *tokens, size_t n, int prefix,
                        uint64_t min_len) {
  uint64_t h = n ? kvti_xxh3(tokens, n * sizeof *tokens) : 0;
  h ^= (uint64_t)prefix * 0x9E3779B97F4A7C15ull;
  h ^= (min_len + 1) * 0xC2B2AE3D27D4EB4Full;
  return h | 1;
}

static int neg_hit(redis_backend *rb, uint64_t key) {
  neg_slot *sl = &rb->neg[key % RB_NEG_SLOTS];
  uint64_t gen = kvr_mirror_gen(rb->mirror);
  pthread_mutex_lock(&rb->neg_mu);
  int hit = sl->key == key && sl->gen == gen && mono_now() < sl->until;
  pthread_mutex_unlock(&rb->neg_mu);
  return hit;
}

static void neg_put(redis_backend *rb, uint64_t key) {
  neg_slot *sl = &rb->neg[key % RB_NEG_SLOTS];
  uint64_t gen = kvr_mirror_gen(rb->mirror);
  pthread_mutex_lock(&rb->neg_mu);
  sl->key = key;
  sl->gen = gen;
  sl->until = mono_now() + RB_NEG_TTL;
  pthread_mutex_unlock(&rb->neg_mu);
}

/* Confirms a mirrored candidate with one GET of its manifest (lookup
 * deadline): 0 and *out, KVT_ENOTFOUND (gone: dropped from the mirror), or a
 * connection error. */
static int confirm(redis_backend *rb, kvti_backend_meta *out,
                   const char *hash) {
  rmanifest m;
  int rc = kvti_rb_rman_get(rb, rb->lcl, &m, hash);
  if (rc == 0) {
    *out = m.meta;
    kvti_rb_rman_free(&m);
    return 0;
  }
  if (rc == KVT_ENOTFOUND || rc == KVT_ECORRUPT) {
    kvr_mirror_del(rb->mirror, hash); /* evicted, expired or damaged */
    kvt_clear_error();
    return KVT_ENOTFOUND;
  }
  return rc;
}

/* The longest entry of one prefix set that is a prefix of the query: the
 * set's distinct lengths from the mirror, the query's prefix of each hashed
 * (locally), looked up in the mirror, then confirmed by its manifest (one
 * round trip). */
#define RB_MIRROR_LENS 256
static int mirror_in_set(redis_backend *rb, kvti_backend_meta *out,
                         const int32_t *tokens, size_t set_len, uint64_t lo,
                         uint64_t hi) {
  if (lo > hi)
    return KVT_ENOTFOUND;
  char id[80];
  int rc = kvti_rb_pset_id(id, tokens, set_len);
  if (rc != 0)
    return rc;
  uint64_t lens[RB_MIRROR_LENS];
  size_t k = kvr_mirror_lengths(rb->mirror, id, lo, hi, lens, RB_MIRROR_LENS);
  for (size_t i = 0; i < k; i++) {
    char h[KVT_HASH_HEX_LEN + 1];
    uint64_t len = 0;
    if ((rc = kvt_token_hash(h, tokens, (size_t)lens[i])) != 0)
      return rc;
    if (!kvr_mirror_has(rb->mirror, h, &len) || len != lens[i])
      continue; /* another sequence with the same first tokens */
    rc = confirm(rb, out, h);
    if (rc != KVT_ENOTFOUND)
      return rc;
  }
  return KVT_ENOTFOUND;
}

static int mirror_find(redis_backend *rb, kvti_backend_meta *out,
                       const int32_t *tokens, size_t n, int prefix,
                       uint64_t min_len) {
  if (!prefix || n == 0) {
    char hash[KVT_HASH_HEX_LEN + 1];
    if (n < min_len)
      return KVT_ENOTFOUND;
    int rc = kvt_token_hash(hash, tokens, n);
    if (rc != 0)
      return rc;
    if (!kvr_mirror_has(rb->mirror, hash, NULL))
      return KVT_ENOTFOUND;
    return confirm(rb, out, hash);
  }
  int rc = KVT_ENOTFOUND;
  if (n >= RB_PREFIX_BLOCK)
    rc =
        mirror_in_set(rb, out, tokens, n,
                      min_len > RB_PREFIX_BLOCK ? min_len : RB_PREFIX_BLOCK, n);
  if (rc == KVT_ENOTFOUND && min_len < RB_PREFIX_BLOCK)
    rc = mirror_in_set(rb, out, tokens, 1, min_len,
                       n < RB_PREFIX_BLOCK ? n : RB_PREFIX_BLOCK - 1);
  return rc;
}

int kvti_rb_find(kvti_backend *b, kvti_backend_meta *out, const int32_t *tokens,
                 size_t n, int prefix, uint64_t min_len) {
  redis_backend *rb = kvti_rb(b);
  if (min_len < 1)
    min_len = 1;
  int rc;
  if (kvr_mirror_synced(rb->mirror)) {
    rc = mirror_find(rb, out, tokens, n, prefix, min_len);
  } else {
    uint64_t key = neg_key(tokens, n, prefix, min_len);
    if (neg_hit(rb, key))
      return KVT_ERR(KVT_ENOTFOUND, "no remote entry (cached miss)");
    rc = find_on(rb, rb->lcl, out, tokens, n, prefix, min_len);
    if (rc == KVT_ENOTFOUND)
      neg_put(rb, key);
  }
  if (rc == KVT_ENOTFOUND)
    return KVT_ERR(KVT_ENOTFOUND, "no remote entry for these %zu tokens", n);
  return rc;
}

int kvti_rb_reach(kvti_backend *b) {
  return kvr_client_probe(kvti_rb(b)->cl);
}
