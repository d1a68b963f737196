/*
 * fuzz_chunk.c - libFuzzer target for chunk files (src/format/chunk.c,
 * docs/FORMAT.md section 10). Input: one control byte, then the bytes of a
 * chunk file. Control bit 0 set: the input's key (bytes 24..56) and header
 * checksum are recomputed from the fields it declares (when they are in
 * range), so mutations reach the descriptor, block-list and data checks behind
 * them instead of all stopping at the checksum. The header is parsed from
 * memory (kvti_chunk_parse) and, written to a file, through the real reader
 * (kvti_chunk_open + kvti_chunk_read_data); whatever the input, the result is
 * 0 or a kvt error code, and a parsed header is internally consistent.
 */
#include "fuzz_common.h"
#include "format/chunk.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

static uint32_t rd32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
         (uint32_t)p[3] << 24;
}

/* Recomputes the key and the header checksum in place (best effort). */
static void fixup(uint8_t *b, size_t n) {
  if (n < KVTI_CHUNK_FIXED)
    return;
  uint32_t hb = rd32(b + 12), ntok = rd32(b + 96), ns = rd32(b + 104),
           lay = rd32(b + 108), bs = rd32(b + 16);
  uint64_t data = (uint64_t)rd32(b + 112) | (uint64_t)rd32(b + 116) << 32;
  if (hb > n || ntok > KVTI_CHUNK_MAX_TOKENS || ns > KVTI_CHUNK_MAX_NS ||
      !kvti_blk_size_ok(bs))
    return;
  uint64_t pos_tok = KVTI_CHUNK_FIXED + ((uint64_t)ns + 3) / 4 * 4;
  uint64_t pos_sum = pos_tok + 4ull * ntok + lay + 8 * kvti_blk_count(data, bs);
  if (pos_tok + 4ull * ntok > hb || pos_sum + 8 > hb)
    return;
  int32_t *tok = malloc(4ull * ntok + 4);
  memcpy(tok, b + pos_tok, 4ull * ntok);
  kvti_chunk_key(b + 24, b + 56, tok, ntok);
  free(tok);
  uint64_t h = XXH3_64bits(b, pos_sum);
  for (int i = 0; i < 8; i++)
    b[pos_sum + i] = (uint8_t)(h >> (8 * i));
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1)
    return 0;
  size_t n = size - 1;
  uint8_t *b = malloc(n ? n : 1);
  memcpy(b, data + 1, n);
  if (data[0] & 1)
    fixup(b, n);
  kvti_chunk_hdr h;
  uint32_t hb = n >= KVTI_CHUNK_FIXED ? kvti_chunk_header_bytes(b, n, "f") : 0;
  if (hb && hb <= n) {
    int rc = kvti_chunk_parse(&h, b, hb, n, "f");
    if (rc == 0) {
      /* What a successful parse promises. */
      if (h.header_bytes + h.data_bytes != n || !h.n_tokens || !h.n_layers)
        abort();
      uint64_t sum = 0;
      for (uint32_t i = 0; i < h.n_layers; i++)
        for (uint32_t j = 0; j < h.layers[i].num_tensors; j++) {
          if (h.layers[i].tensors[j].off != sum)
            abort();
          sum += h.layers[i].tensors[j].nbytes;
        }
      if (sum != h.data_bytes)
        abort();
      kvti_chunk_hdr_free(&h);
    } else if (rc > 0) {
      abort();
    }
  }
  char p[700];
  snprintf(p, sizeof p, "%s/chunk.kvc", fz_dir());
  fz_write(p, b, n);
  int fd;
  if (kvti_chunk_open(&fd, &h, p, NULL, 0) == 0) {
    void *dst = malloc(h.data_bytes ? h.data_bytes : 1);
    int rc = kvti_chunk_read_data(fd, &h, dst, p);
    if (rc > 0)
      abort();
    free(dst);
    kvti_chunk_hdr_free(&h);
    close(fd);
  }
  free(b);
  return 0;
}
