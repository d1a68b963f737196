/*
 * vec.c - growable arrays (vec.h): the doubling capacity with its overflow
 * bound, and the resize and reserve over kvti_realloc that leave the caller's
 * array untouched when they fail.
 */
#include "base/vec.h"

#include "base/error.h"
#include "base/io.h"

#include <stdint.h>
#include <string.h>

size_t kvti_vec_cap(size_t cap, size_t need, size_t elem, size_t first) {
  if (elem == 0)
    return 0;
  size_t max = SIZE_MAX / elem;
  if (need > max)
    return 0;
  if (need <= cap)
    return cap;
  size_t c = cap ? cap : first ? first : 1;
  if (c > max)
    c = max;
  while (c < need)
    c = c > max / 2 ? max : c * 2;
  return c;
}

int kvti_vec_resize(void *arr, size_t n, size_t elem) {
  if (n == 0 || elem == 0 || n > SIZE_MAX / elem)
    return KVT_ERR(KVT_ENOMEM,
                   "array of %zu elements of %zu bytes is too large", n, elem);
  /* The caller's pointer is read and written as bytes: arr is a T ** seen
   * as void *, and object pointers share one representation on every
   * platform kvtier builds for. */
  void *p;
  memcpy(&p, arr, sizeof p);
  void *np = kvti_realloc(p, n * elem);
  if (!np)
    return KVT_ERR_NOMEM();
  memcpy(arr, &np, sizeof np);
  return 0;
}

int kvti_vec_reserve(void *arr, size_t *cap, size_t need, size_t elem,
                     size_t first) {
  if (need <= *cap)
    return 0;
  size_t c = kvti_vec_cap(*cap, need, elem, first);
  if (c == 0)
    return KVT_ERR(KVT_ENOMEM,
                   "array of %zu elements of %zu bytes is too large", need,
                   elem);
  int rc = kvti_vec_resize(arr, c, elem);
  if (rc == 0)
    *cap = c;
  return rc;
}
