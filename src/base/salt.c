/*
 * salt.c - salt digests and salted keys (salt.h), over OpenSSL's SHA-256 as
 * every other key of kvtier.
 */
#include "base/salt.h"

#include "base/error.h"
#include "base/hash.h"

#include <openssl/evp.h>
#include <string.h>

static const char TAG[] = "kvtier cache_salt v1"; /* hashed with its NUL */
static const char MTAG[] = "kvtier model_id v1";  /* likewise */

static int sha2(uint8_t out[32], const void *a, size_t alen, const void *b,
                size_t blen) {
  EVP_MD_CTX *c = EVP_MD_CTX_new();
  unsigned int md = 0;
  int ok = c && EVP_DigestInit_ex(c, EVP_sha256(), NULL) &&
           EVP_DigestUpdate(c, a, alen) &&
           (blen == 0 || EVP_DigestUpdate(c, b, blen)) &&
           EVP_DigestFinal_ex(c, out, &md) && md == 32;
  EVP_MD_CTX_free(c);
  return ok ? 0 : KVT_ERR(KVT_ENOMEM, "SHA-256 computation failed");
}

int kvti_salt_make(kvti_salt *out, const void *salt, size_t len) {
  memset(out, 0, sizeof *out);
  if (len > KVTI_SALT_MAX)
    return KVT_ERR(KVT_EINVAL, "cache_salt of %zu bytes (at most %d)", len,
                   KVTI_SALT_MAX);
  if (len && !salt)
    return KVT_ERR(KVT_EINVAL, "cache_salt is NULL with a length > 0");
  if (len == 0)
    return 0;
  int rc = sha2(out->d, TAG, sizeof TAG, salt, len);
  out->has = rc == 0;
  return rc;
}

int kvti_salt_model(kvti_salt *out, const char *model_id) {
  memset(out, 0, sizeof *out);
  size_t len = model_id ? strlen(model_id) : 0;
  if (len == 0)
    return 0;
  int rc = sha2(out->d, MTAG, sizeof MTAG, model_id, len);
  out->has = rc == 0;
  return rc;
}

int kvti_salt_join(kvti_salt *out, const kvti_salt *ns, const kvti_salt *req) {
  if (!ns || !ns->has) {
    if (out != req)
      *out = *req;
    return 0;
  }
  if (!req->has) {
    *out = *ns;
    return 0;
  }
  uint8_t d[32];
  int rc = sha2(d, ns->d, 32, req->d, 32);
  if (rc == 0) {
    memcpy(out->d, d, 32);
    out->has = 1;
  }
  return rc;
}

int kvti_salt_sha(uint8_t out[32], const kvti_salt *s, const void *data,
                  size_t len) {
  if (!s || !s->has)
    return sha2(out, len ? data : (const void *)"", len, NULL, 0);
  return sha2(out, s->d, 32, data, len);
}

int kvti_salt_hex(char out[65], const kvti_salt *s, const int32_t *tokens,
                  size_t n) {
  if (!s || !s->has)
    return kvt_token_hash(out, tokens, n);
  uint8_t b[32];
  int rc = kvti_salt_sha(b, s, tokens, n * sizeof(int32_t));
  if (rc == 0)
    kvti_hex32(out, b);
  return rc;
}
