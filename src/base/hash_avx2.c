/*
 * hash_avx2.c - an AVX2 build of the XXH3-64 loops, chosen at run time by
 * hash.c when the CPU has AVX2 (GCC on x86 only; elsewhere this file provides
 * nothing and hash.c keeps the SSE2 / scalar code). On the target VMs XXH3 over
 * cache-resident data runs at ~46 GB/s with AVX2 vs ~20 GB/s with SSE2, which
 * matters because every promoted byte is hashed right after the kernel copied
 * it: at SSE2 speed the hash costs ~40% of the copy, at AVX2 speed ~17%. The
 * XXH3 state layout does not depend on the vector width, so states are shared
 * with hash.c.
 */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#pragma GCC target("avx2")
#define KVTI_XXH3_AVX2 1
#define XXH_INLINE_ALL
#include <xxhash.h>
#endif

#include <stddef.h>
#include <stdint.h>

int kvti_xxh3_avx2_built(void);
uint64_t kvti_xxh3_avx2(const void *data, size_t len);
void kvti_xxh3_update_avx2(void *state, const void *data, size_t len);

#ifdef KVTI_XXH3_AVX2
int kvti_xxh3_avx2_built(void) {
  return 1;
}
uint64_t kvti_xxh3_avx2(const void *data, size_t len) {
  return XXH3_64bits(data, len);
}
void kvti_xxh3_update_avx2(void *state, const void *data, size_t len) {
  XXH3_64bits_update((XXH3_state_t *)state, data, len);
}
#else
int kvti_xxh3_avx2_built(void) {
  return 0;
}
uint64_t kvti_xxh3_avx2(const void *data, size_t len) {
  (void)data, (void)len;
  return 0;
}
void kvti_xxh3_update_avx2(void *state, const void *data, size_t len) {
  (void)state, (void)data, (void)len;
}
#endif
