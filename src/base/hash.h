/*
 * hash.h - the two hashes kvtier uses: SHA-256 of token sequences (the entry
 * key, bit-identical to the reference's hashlib.sha256 over array('i',
 * tokens).tobytes()) via OpenSSL EVP, and XXH3-64 checksums of files (compiled
 * in from xxhash.h for speed) in one-shot and streaming forms, and the
 * per-block form of entry format 2 (kvti_blkhash: a stream cut into fixed-size
 * blocks, each with its own XXH3-64, so a reader can verify any block alone).
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

/* Per-block XXH3-64 of a byte stream (docs/FORMAT.md section 6). Bytes are fed
 * in pieces of any size; the stream is cut at multiples of block_size in stream
 * offset, and block k's hash is the XXH3-64 (seed 0) of stream bytes [k*B,
 * min((k+1)*B, size)). block_size 0 means one block spanning the whole stream:
 * the plain whole-file XXH3-64 of format 1, so one type serves both formats.
 * Compute mode collects the list; after kvti_blkhash_expect (verify mode) each
 * block is compared as soon as it is complete and the first mismatch fails the
 * update with KVT_ECORRUPT (fail fast). Each byte is hashed once: a whole block
 * fed at once is hashed in one shot, pieces go through a streaming state. One
 * thread at a time. */
typedef struct kvti_blkhash kvti_blkhash;
/* Block sizes readers accept: powers of two in [4096, 64 MiB]. */
#define KVTI_BLK_MIN ((uint64_t)4096)
#define KVTI_BLK_MAX ((uint64_t)64 << 20)
/* What kvtier writes. */
#define KVTI_BLK_DEFAULT ((uint64_t)64 << 10)
int kvti_blk_size_ok(uint64_t block_size);
/* Number of blocks of a stream of size bytes (0 when block_size is 0). */
uint64_t kvti_blk_count(uint64_t size, uint64_t block_size);
/* block_size: 0 or a power of two; size_hint: expected stream size (sizes the
 * list so compute mode does not reallocate; 0 = unknown). Returns 0,
 * KVT_ENOMEM, KVT_EINVAL. */
int kvti_blkhash_new(kvti_blkhash **out, uint64_t block_size,
                     uint64_t size_hint);
/* Verify mode: block k must hash to list[k] and there must be exactly n blocks
 * (block_size 0: n = 1, list[0] = the whole-stream hash, checked by final).
 * list and what (names the file in messages) must outlive h. */
void kvti_blkhash_expect(kvti_blkhash *h, const uint64_t *list, size_t n,
                         const char *what);
/* Returns 0, KVT_ECORRUPT (verify mode: a mismatching or surplus block),
 * KVT_ENOMEM (compute mode: list growth beyond the hint). After a failure every
 * later call returns it. */
int kvti_blkhash_update(kvti_blkhash *h, const void *data, size_t len);
/* Closes the last partial block. *digest (may be NULL) receives the
 * whole-stream hash (block_size 0) or kvti_blklist_digest of the list. Verify
 * mode: also checks the block count (or the whole-stream hash). Returns as
 * update. */
int kvti_blkhash_final(kvti_blkhash *h, uint64_t *digest);
/* The list (valid until free; complete after final). */
const uint64_t *kvti_blkhash_list(const kvti_blkhash *h, size_t *n);
void kvti_blkhash_free(kvti_blkhash *h); /* accepts NULL */
/* XXH3-64 of the block hashes as 8-byte little-endian words, concatenated:
 * format 2's per-file checksum (so the writer hashes each byte once). */
uint64_t kvti_blklist_digest(const uint64_t *list, size_t n);
/* n hashes as 16*n lowercase hex digits into out (16*n + 1 bytes with NUL). */
void kvti_blklist_format(char *out, const uint64_t *list, size_t n);
/* Parses len hex characters (len % 16 == 0, lowercase) into list (len / 16
 * entries). Returns 0 or -1. */
int kvti_blklist_parse(uint64_t *list, const char *s, size_t len);

/* "xxh3:%016x" form used in manifests (24 bytes incl. NUL), and its parser (0
 * or -1). */
void kvti_xxh3_format(char out[24], uint64_t h);
int kvti_xxh3_parse(uint64_t *out, const char *s);

/* True when s is exactly 64 lowercase hex digits (a valid entry name). */
int kvti_is_hash_name(const char *s);
/* A 32-byte key as 64 lowercase hex digits + NUL, and back (0, or -1 for
 * anything but a valid entry name). */
void kvti_hex32(char out[65], const uint8_t in[32]);
int kvti_unhex32(uint8_t out[32], const char *s);

#endif
