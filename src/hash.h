/*
 * hash.h - the two hashes kvtier uses: SHA-256 of token sequences (the entry
 * key, bit-identical to the reference's hashlib.sha256 over array('i',
 * tokens).tobytes()) via OpenSSL EVP, and XXH3-64 checksums of files (compiled
 * in from xxhash.h for speed) in one-shot and streaming forms.
 */
#ifndef KVT_HASH_H
#define KVT_HASH_H

#include <stddef.h>
#include <stdint.h>

/* Lowercase hex SHA-256 of len bytes into out (65 bytes with NUL). Returns 0 or
 * KVT_ENOMEM. */
int kvti_sha256_hex(char out[65], const void *data, size_t len);

/* XXH3-64 of a buffer. */
uint64_t kvti_xxh3(const void *data, size_t len);

/* Streaming XXH3-64; the state is opaque and heap-allocated. */
typedef struct kvti_xxh3_state kvti_xxh3_state;
kvti_xxh3_state *kvti_xxh3_new(void); /* NULL on OOM */
void kvti_xxh3_update(kvti_xxh3_state *s, const void *data, size_t len);
uint64_t kvti_xxh3_digest(const kvti_xxh3_state *s);
void kvti_xxh3_free(kvti_xxh3_state *s);

/* "xxh3:%016x" form used in manifests (24 bytes incl. NUL), and its parser (0
 * or -1). */
void kvti_xxh3_format(char out[24], uint64_t h);
int kvti_xxh3_parse(uint64_t *out, const char *s);

/* True when s is exactly 64 lowercase hex digits (a valid entry name). */
int kvti_is_hash_name(const char *s);

#endif
