/*
 * le.h - little-endian integer encoding for kvtier's own binary formats
 * (chunk files, chain records: docs/FORMAT.md section 10), byte by byte so
 * the encoding does not depend on the host's order or alignment.
 */
#ifndef KVT_FORMAT_LE_H
#define KVT_FORMAT_LE_H

#include <stdint.h>

static inline void kvti_le_put32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}
static inline void kvti_le_put64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint32_t kvti_le_get32(const uint8_t *p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; i--)
    v = (v << 8) | p[i];
  return v;
}
static inline uint64_t kvti_le_get64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--)
    v = (v << 8) | p[i];
  return v;
}

#endif
