/*
 * hash.c - SHA-256 token keys through OpenSSL's EVP interface and XXH3-64
 * checksums. xxhash is included with XXH_INLINE_ALL so the hot checksum loop is
 * inlined (about 2.5x faster here than calling the shared libxxhash), which
 * matters because every spilled and promoted byte is hashed.
 */
#include "base/hash.h"
#include "kvtier.h"
#include "base/error.h"
#include "base/io.h"
#include "base/vec.h"

#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

static void hex32(char out[65], const unsigned char *md) {
  static const char hx[] = "0123456789abcdef";
  for (unsigned i = 0; i < 32; i++) {
    out[2 * i] = hx[md[i] >> 4];
    out[2 * i + 1] = hx[md[i] & 15];
  }
  out[64] = '\0';
}

int kvti_sha256_hex(char out[65], const void *data, size_t len) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int mdlen = 0;
  if (!EVP_Digest(data, len, md, &mdlen, EVP_sha256(), NULL) || mdlen != 32)
    return KVT_ERR(KVT_ENOMEM, "SHA-256 computation failed");
  hex32(out, md);
  return 0;
}

struct kvti_sha256_state {
  EVP_MD_CTX *ctx;
};

kvti_sha256_state *kvti_sha256_new(void) {
  kvti_sha256_state *s = kvti_calloc(1, sizeof *s);
  if (!s)
    return NULL;
  s->ctx = EVP_MD_CTX_new();
  if (!s->ctx || !EVP_DigestInit_ex(s->ctx, EVP_sha256(), NULL)) {
    kvti_sha256_free(s);
    return NULL;
  }
  return s;
}

int kvti_sha256_update(kvti_sha256_state *s, const void *data, size_t len) {
  return EVP_DigestUpdate(s->ctx, data, len)
             ? 0
             : KVT_ERR(KVT_ENOMEM, "SHA-256 computation failed");
}

int kvti_sha256_final_hex(kvti_sha256_state *s, char out[65]) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int mdlen = 0;
  if (!EVP_DigestFinal_ex(s->ctx, md, &mdlen) || mdlen != 32)
    return KVT_ERR(KVT_ENOMEM, "SHA-256 computation failed");
  hex32(out, md);
  return 0;
}

void kvti_sha256_free(kvti_sha256_state *s) {
  if (!s)
    return;
  EVP_MD_CTX_free(s->ctx);
  kvti_free(s);
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

/* AVX2 variants (hash_avx2.c), used when built and the CPU has AVX2. */
int kvti_xxh3_avx2_built(void);
uint64_t kvti_xxh3_avx2(const void *data, size_t len);
void kvti_xxh3_update_avx2(void *state, const void *data, size_t len);

static int use_avx2(void) {
  static int v = -1; /* benign race: every thread computes the same value */
  int u = __atomic_load_n(&v, __ATOMIC_RELAXED);
  if (u < 0) {
    u = 0;
#if defined(__GNUC__) && defined(__x86_64__)
    if (kvti_xxh3_avx2_built()) {
      __builtin_cpu_init();
      u = __builtin_cpu_supports("avx2") ? 1 : 0;
    }
#endif
    __atomic_store_n(&v, u, __ATOMIC_RELAXED);
  }
  return u;
}

uint64_t kvti_xxh3(const void *data, size_t len) {
  if (use_avx2())
    return kvti_xxh3_avx2(data, len);
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
  if (use_avx2())
    kvti_xxh3_update_avx2(&s->st, data, len);
  else
    XXH3_64bits_update(&s->st, data, len);
}
uint64_t kvti_xxh3_digest(const kvti_xxh3_state *s) {
  return XXH3_64bits_digest(&s->st);
}
void kvti_xxh3_free(kvti_xxh3_state *s) {
  free(s);
}

/* ---- per-block hashes (format 2) ---------------------------------------- */

struct kvti_blkhash {
  XXH3_state_t st; /* first: the allocation is 64-byte aligned */
  uint64_t bs;     /* block size, 0 = one block for the whole stream */
  uint64_t pos;    /* stream bytes fed so far */
  uint64_t *list;  /* compute mode: the hashes so far */
  size_t n, cap;
  const uint64_t *want; /* verify mode */
  size_t nwant;
  const char *what;
  int err;
};

int kvti_blk_size_ok(uint64_t bs) {
  return bs >= KVTI_BLK_MIN && bs <= KVTI_BLK_MAX && (bs & (bs - 1)) == 0;
}

uint64_t kvti_blk_count(uint64_t size, uint64_t bs) {
  return bs ? size / bs + (size % bs != 0) : 0;
}

int kvti_blkhash_new(kvti_blkhash **out, uint64_t bs, uint64_t size_hint) {
  if (bs & (bs - 1))
    return KVT_ERR(KVT_EINVAL, "block size %llu is not a power of two",
                   (unsigned long long)bs);
  kvti_blkhash *h =
      kvti_aligned_alloc(64, (sizeof *h + 63) / 64 * 64); /* error set */
  if (!h)
    return KVT_ENOMEM;
  memset(h, 0, sizeof *h);
  h->bs = bs;
  XXH3_64bits_reset(&h->st);
  uint64_t cap = bs ? kvti_blk_count(size_hint, bs) : 0;
  if (cap > 0 && cap < (SIZE_MAX / sizeof(uint64_t))) {
    h->list = kvti_malloc((size_t)cap * sizeof(uint64_t));
    if (!h->list) {
      kvti_free(h);
      return KVT_ERR_NOMEM();
    }
    h->cap = (size_t)cap;
  }
  *out = h;
  return 0;
}

void kvti_blkhash_expect(kvti_blkhash *h, const uint64_t *list, size_t n,
                         const char *what) {
  h->want = list;
  h->nwant = n;
  h->what = what ? what : "stream";
}

static void st_update(XXH3_state_t *st, const void *p, size_t n) {
  if (use_avx2())
    kvti_xxh3_update_avx2(st, p, n);
  else
    XXH3_64bits_update(st, p, n);
}

/* Block h->n is complete with hash v: compare (verify) or append (compute). */
static int emit(kvti_blkhash *h, uint64_t v) {
  if (h->want) {
    if (h->n >= h->nwant)
      return h->err = KVT_ERR(KVT_ECORRUPT,
                              "%s: longer than its %zu checksummed blocks",
                              h->what, h->nwant);
    if (h->want[h->n] != v)
      return h->err =
                 KVT_ERR(KVT_ECORRUPT, "%s: checksum mismatch in block %zu",
                         h->what, h->n);
    h->n++;
    return 0;
  }
  int rc = KVTI_VEC_RESERVE(&h->list, &h->cap, h->n + 1, 16);
  if (rc)
    return h->err = rc;
  h->list[h->n++] = v;
  return 0;
}

int kvti_blkhash_update(kvti_blkhash *h, const void *data, size_t len) {
  if (h->err)
    return h->err;
  const char *p = data;
  if (h->bs == 0) {
    st_update(&h->st, p, len);
    h->pos += len;
    return 0;
  }
  while (len > 0) {
    uint64_t in = h->pos & (h->bs - 1); /* bytes of the current block so far */
    if (in == 0 && len >= h->bs) {
      /* A whole block at once: one-shot hash, no streaming state. */
      int rc = emit(h, kvti_xxh3(p, (size_t)h->bs));
      if (rc)
        return rc;
      p += h->bs;
      len -= (size_t)h->bs;
      h->pos += h->bs;
      continue;
    }
    if (in == 0)
      XXH3_64bits_reset(&h->st);
    size_t n = h->bs - in < len ? (size_t)(h->bs - in) : len;
    st_update(&h->st, p, n);
    p += n;
    len -= n;
    h->pos += n;
    if ((h->pos & (h->bs - 1)) == 0) {
      int rc = emit(h, XXH3_64bits_digest(&h->st));
      if (rc)
        return rc;
    }
  }
  return 0;
}

int kvti_blkhash_final(kvti_blkhash *h, uint64_t *digest) {
  if (h->err)
    return h->err;
  if (h->bs == 0) {
    uint64_t v = XXH3_64bits_digest(&h->st);
    if (h->want && (h->nwant != 1 || h->want[0] != v))
      return h->err = KVT_ERR(KVT_ECORRUPT, "%s: checksum mismatch", h->what);
    if (digest)
      *digest = v;
    return 0;
  }
  if ((h->pos & (h->bs - 1)) != 0) {
    int rc = emit(h, XXH3_64bits_digest(&h->st));
    if (rc)
      return rc;
    h->pos = (h->pos + h->bs - 1) & ~(h->bs - 1); /* final is idempotent */
  }
  if (h->want && h->n != h->nwant)
    return h->err =
               KVT_ERR(KVT_ECORRUPT, "%s: %zu blocks where %zu are checksummed",
                       h->what, h->n, h->nwant);
  if (digest)
    *digest = kvti_blklist_digest(h->want ? h->want : h->list, h->n);
  return 0;
}

const uint64_t *kvti_blkhash_list(const kvti_blkhash *h, size_t *n) {
  if (n)
    *n = h->n;
  return h->want ? h->want : h->list;
}

void kvti_blkhash_free(kvti_blkhash *h) {
  if (!h)
    return;
  kvti_free(h->list);
  kvti_free(h);
}

uint64_t kvti_blklist_digest(const uint64_t *list, size_t n) {
  /* Little-endian words, independent of the host's byte order; hashed in
   * pieces so no allocation is needed. */
  XXH3_state_t st;
  XXH3_64bits_reset(&st);
  unsigned char buf[512];
  size_t k = 0;
  for (size_t i = 0; i < n; i++) {
    for (int b = 0; b < 8; b++)
      buf[k++] = (unsigned char)(list[i] >> (8 * b));
    if (k == sizeof buf) {
      XXH3_64bits_update(&st, buf, k);
      k = 0;
    }
  }
  XXH3_64bits_update(&st, buf, k);
  return XXH3_64bits_digest(&st);
}

void kvti_blklist_format(char *out, const uint64_t *list, size_t n) {
  static const char hx[] = "0123456789abcdef";
  for (size_t i = 0; i < n; i++)
    for (int d = 0; d < 16; d++)
      *out++ = hx[(list[i] >> (60 - 4 * d)) & 15];
  *out = '\0';
}

int kvti_blklist_parse(uint64_t *list, const char *s, size_t len) {
  if (len % 16 != 0)
    return -1;
  for (size_t i = 0; i < len / 16; i++) {
    uint64_t v = 0;
    for (int d = 0; d < 16; d++) {
      char c = s[16 * i + (size_t)d];
      int x;
      if (c >= '0' && c <= '9')
        x = c - '0';
      else if (c >= 'a' && c <= 'f')
        x = c - 'a' + 10;
      else
        return -1;
      v = (v << 4) | (uint64_t)x;
    }
    list[i] = v;
  }
  return 0;
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

void kvti_hex32(char out[65], const uint8_t in[32]) {
  static const char hx[] = "0123456789abcdef";
  for (int i = 0; i < 32; i++) {
    out[2 * i] = hx[in[i] >> 4];
    out[2 * i + 1] = hx[in[i] & 15];
  }
  out[64] = '\0';
}

int kvti_unhex32(uint8_t out[32], const char *s) {
  if (!kvti_is_hash_name(s))
    return -1;
  for (int i = 0; i < 32; i++) {
    int a = s[2 * i], b = s[2 * i + 1];
    a = a <= '9' ? a - '0' : a - 'a' + 10;
    b = b <= '9' ? b - '0' : b - 'a' + 10;
    out[i] = (uint8_t)(a << 4 | b);
  }
  return 0;
}
