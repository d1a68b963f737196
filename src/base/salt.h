/*
 * salt.h - per-request cache salts (kvt_call_opts.cache_salt): the salt is
 * reduced to a 32-byte digest D, and a salted entry's key is SHA-256(D ||
 * tokens) instead of the reference's SHA-256(tokens), so the entries of two
 * salts - and of no salt - never share a name, an index row, a prefix hash
 * or a chunk namespace: one is never served to a request of another. The
 * digest (never the salt) is what kvtier stores (manifest, chunk namespace).
 */
#ifndef KVT_BASE_SALT_H
#define KVT_BASE_SALT_H

#include <stddef.h>
#include <stdint.h>

/* Longest cache_salt accepted, in bytes. */
#define KVTI_SALT_MAX 4096

/* A request's salt: has = 0 for none (the reference's keys). */
typedef struct kvti_salt {
  int has;
  uint8_t d[32];
} kvti_salt;

/* D = SHA-256("kvtier cache_salt v1" NUL || salt[0, len)); len 0 (or salt
 * NULL) gives "no salt". Returns 0, KVT_EINVAL (len > KVTI_SALT_MAX, NULL salt
 * with len > 0), KVT_ENOMEM. */
int kvti_salt_make(kvti_salt *out, const void *salt, size_t len);

/* A model_id's namespace N = SHA-256("kvtier model_id v1" NUL || model_id);
 * NULL or "" gives none (has = 0: the directory alone is the namespace).
 * 0 or KVT_ENOMEM. */
int kvti_salt_model(kvti_salt *out, const char *model_id);

/* The digest a call is keyed by, under namespace ns and request salt req:
 * req alone when ns has none (exactly the keys without a model_id), ns alone
 * when req has none, else SHA-256(N || D). In place (out may be req). 0 or
 * KVT_ENOMEM. */
int kvti_salt_join(kvti_salt *out, const kvti_salt *ns, const kvti_salt *req);

/* Key of data[0, len) (an int32 token blob) under salt s (NULL or !has: the
 * plain SHA-256), binary and hex. 0 or KVT_ENOMEM. */
int kvti_salt_sha(uint8_t out[32], const kvti_salt *s, const void *data,
                  size_t len);
int kvti_salt_hex(char out[65], const kvti_salt *s, const int32_t *tokens,
                  size_t n);

#endif
