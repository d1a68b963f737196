/*
 * hash.c - SHA-256 token keys through OpenSSL's EVP interface and XXH3-64
 * checksums. xxhash is included with XXH_INLINE_ALL so the hot checksum loop is
 * inlined (about 2.5x faster here than calling the shared libxxhash), which
 * matters because every spilled and promoted byte is hashed.
 */
#include "hash.h"
#include "kvtier.h"
#include "error.h"

#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

int kvti_sha256_hex(char out[65], const void *data, size_t len) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int mdlen = 0;
  if (!EVP_Digest(data, len, md, &mdlen, EVP_sha256(), NULL) || mdlen != 32)
    return KVT_ERR(KVT_ENOMEM, "SHA-256 computation failed");
  static const char hx[] = "0123456789abcdef";
  for (unsigned i = 0; i < 32; i++) {
    out[2 * i] = hx[md[i] >> 4];
    out[2 * i + 1] = hx[md[i] & 15];
  }
  out[64] = '\0';
  return 0;
}

int kvt_token_hash(char out[KVT_HASH_HEX_LEN + 1], const int32_t *tokens,
                   size_t n) {
  if (!out || (!tokens && n > 0))
    return KVT_ERR(KVT_EINVAL, "kvt_token_hash: NULL argument");
  if (n > SIZE_MAX / sizeof(int32_t))
    return KVT_ERR(KVT_EINVAL, "kvt_token_hash: too many tokens");
  return kvti_sha256_hex(out, n ? (const void *)tokens : (const void *)"",
                         n * sizeof(int32_t));
}

int kvt_prefix_hash(char out[KVT_HASH_HEX_LEN + 1], const int32_t *tokens,
                    size_t n) {
  return kvt_token_hash(
      out, tokens, n < KVT_PREFIX_FILTER_TOKENS ? n : KVT_PREFIX_FILTER_TOKENS);
}

uint64_t kvti_xxh3(const void *data, size_t len) {
  return XXH3_64bits(data, len);
}

struct kvti_xxh3_state {
  XXH3_state_t st;
};

kvti_xxh3_state *kvti_xxh3_new(void) {
  kvti_xxh3_state *s =
      aligned_alloc(64, sizeof *s + (64 - sizeof *s % 64) % 64);
  if (s)
    XXH3_64bits_reset(&s->st);
  return s;
}
void kvti_xxh3_update(kvti_xxh3_state *s, const void *data, size_t len) {
  XXH3_64bits_update(&s->st, data, len);
}
uint64_t kvti_xxh3_digest(const kvti_xxh3_state *s) {
  return XXH3_64bits_digest(&s->st);
}
void kvti_xxh3_free(kvti_xxh3_state *s) {
  free(s);
}

void kvti_xxh3_format(char out[24], uint64_t h) {
  snprintf(out, 24, "xxh3:%016llx", (unsigned long long)h);
}

int kvti_xxh3_parse(uint64_t *out, const char *s) {
  if (!s || strncmp(s, "xxh3:", 5) != 0 || strlen(s) != 21)
    return -1;
  uint64_t v = 0;
  for (const char *p = s + 5; *p; p++) {
    int d;
    if (*p >= '0' && *p <= '9')
      d = *p - '0';
    else if (*p >= 'a' && *p <= 'f')
      d = *p - 'a' + 10;
    else
      return -1;
    v = (v << 4) | (uint64_t)d;
  }
  *out = v;
  return 0;
}

int kvti_is_hash_name(const char *s) {
  if (!s)
    return 0;
  size_t i = 0;
  for (; s[i]; i++) {
    if (i >= 64)
      return 0;
    char c = s[i];
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f')))
      return 0;
  }
  return i == 64;
}
