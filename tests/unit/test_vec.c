/*
 * test_vec.c - unit tests for the growable array (base/vec.h): the doubling
 * capacity (first size, doubling past need, the clamp below size_t's limit,
 * refusal of counts whose bytes overflow), growth by reserve keeping the
 * elements held, a reserve within capacity touching nothing, and refusals -
 * overflow and an allocator that fails - that leave the caller's pointer,
 * capacity and elements as they were with an error explaining why.
 */
#include "testutil.h"
#include "base/io.h"
#include "base/vec.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static void test_cap(void) {
  CHECK_EQ_INT(kvti_vec_cap(0, 1, 8, 16), 16);
  CHECK_EQ_INT(kvti_vec_cap(0, 17, 8, 16), 32);
  CHECK_EQ_INT(kvti_vec_cap(16, 16, 8, 64), 16); /* already holds it */
  CHECK_EQ_INT(kvti_vec_cap(16, 17, 8, 64), 32); /* cap, not first, doubles */
  CHECK_EQ_INT(kvti_vec_cap(16, 100, 8, 64), 128);
  CHECK_EQ_INT(kvti_vec_cap(0, 3, 4, 0), 4); /* first 0 starts at 1 */
  /* Doubling past the limit stops at the largest count that fits. */
  size_t max = SIZE_MAX / 8;
  CHECK(kvti_vec_cap(max / 2 + 1, max / 2 + 2, 8, 16) == max);
  CHECK(kvti_vec_cap(0, max, 8, SIZE_MAX) == max);
  /* Counts whose bytes do not fit are refused. */
  CHECK_EQ_INT(kvti_vec_cap(0, max + 1, 8, 16), 0);
  CHECK_EQ_INT(kvti_vec_cap(0, 1, 0, 16), 0);
}

static void test_growth(void) {
  uint64_t *v = NULL;
  size_t n = 0, cap = 0;
  size_t caps_seen[8], n_caps = 0;
  for (uint64_t i = 0; i < 1000; i++) {
    size_t before = cap;
    REQUIRE(KVTI_VEC_RESERVE(&v, &cap, n + 1, 16) == 0);
    REQUIRE(cap >= n + 1);
    if (cap != before && n_caps < 8)
      caps_seen[n_caps++] = cap;
    v[n++] = i * 7;
  }
  CHECK_EQ_INT(n_caps, 7); /* 16, 32, ..., 1024 */
  for (size_t k = 0; k < n_caps; k++)
    CHECK_EQ_INT(caps_seen[k], (size_t)16 << k);
  int same = 1;
  for (uint64_t i = 0; i < n; i++)
    same &= v[i] == i * 7;
  CHECK(same);
  /* Within capacity: nothing moves. */
  uint64_t *was = v;
  CHECK_EQ_INT(KVTI_VEC_RESERVE(&v, &cap, cap, 16), 0);
  CHECK(v == was);
  CHECK_EQ_INT(cap, 1024);
  /* A reserve far past double goes straight to a doubled size above it. */
  CHECK_EQ_INT(KVTI_VEC_RESERVE(&v, &cap, 5000, 16), 0);
  CHECK_EQ_INT(cap, 8192);
  CHECK(v[999] == 999 * 7);
  /* Resize to an exact count (elements of a 32-byte row type). */
  uint8_t(*rows)[32] = NULL;
  REQUIRE(KVTI_VEC_RESIZE(&rows, 3) == 0);
  memset(rows, 0xab, 3 * sizeof *rows);
  REQUIRE(KVTI_VEC_RESIZE(&rows, 5) == 0);
  CHECK(rows[2][31] == 0xab);
  kvti_free(rows);
  kvti_free(v);
}

static void test_overflow_refused(void) {
  uint32_t *v = NULL;
  size_t cap = 0;
  REQUIRE(KVTI_VEC_RESERVE(&v, &cap, 4, 4) == 0);
  v[0] = 11;
  v[3] = 44;
  uint32_t *was = v;
  CHECK_EQ_INT(KVTI_VEC_RESERVE(&v, &cap, SIZE_MAX / 4 + 1, 4), KVT_ENOMEM);
  CHECK(strstr(kvt_last_error(), "too large") != NULL);
  CHECK(v == was);
  CHECK_EQ_INT(cap, 4);
  CHECK_EQ_INT(KVTI_VEC_RESIZE(&v, SIZE_MAX / 2), KVT_ENOMEM);
  CHECK(v == was);
  /* A capacity kvti_vec_cap refused (0) is refused by resize as well. */
  CHECK_EQ_INT(KVTI_VEC_RESIZE(&v, kvti_vec_cap(4, SIZE_MAX, 4, 4)),
               KVT_ENOMEM);
  CHECK(v == was);
  CHECK(v[0] == 11 && v[3] == 44);
  kvti_free(v);
}

static int fail_realloc;
static void *inj_realloc(void *p, size_t n) {
  if (fail_realloc)
    return NULL;
  return realloc(p, n);
}

static void test_alloc_failure_unchanged(void) {
  kvti_io_ops ops = kvti_io_default;
  ops.realloc = inj_realloc;
  kvti_io_set(&ops);
  int32_t *v = NULL;
  size_t cap = 0, n = 0;
  for (int32_t i = 0; i < 8; i++) {
    REQUIRE(KVTI_VEC_RESERVE(&v, &cap, n + 1, 8) == 0);
    v[n++] = -i;
  }
  CHECK_EQ_INT(cap, 8);
  int32_t *was = v;
  fail_realloc = 1;
  CHECK_EQ_INT(KVTI_VEC_RESERVE(&v, &cap, n + 1, 8), KVT_ENOMEM);
  CHECK(strstr(kvt_last_error(), "out of memory") != NULL);
  CHECK(v == was);
  CHECK_EQ_INT(cap, 8);
  CHECK_EQ_INT(KVTI_VEC_RESIZE(&v, 100), KVT_ENOMEM);
  CHECK(v == was);
  int same = 1;
  for (int32_t i = 0; i < 8; i++)
    same &= v[i] == -i;
  CHECK(same);
  /* The allocator back: the same call now grows the array. */
  fail_realloc = 0;
  CHECK_EQ_INT(KVTI_VEC_RESERVE(&v, &cap, n + 1, 8), 0);
  CHECK_EQ_INT(cap, 16);
  CHECK(v[7] == -7);
  kvti_free(v);
  kvti_io_set(&kvti_io_default);
}

int main(void) {
  RUN(test_cap);
  RUN(test_growth);
  RUN(test_overflow_refused);
  RUN(test_alloc_failure_unchanged);
  return kvt_test_done();
}
