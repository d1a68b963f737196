/*
 * vec.h - growable arrays: an array of fixed-size elements kept as the
 * caller's own typed pointer plus its capacity (in elements), grown by
 * doubling through the allocation seam (kvti_realloc) so appends cost O(1)
 * amortised. The capacity computation refuses sizes that would overflow
 * size_t, and a failed growth leaves the caller's pointer and capacity as they
 * were, so the elements already held stay valid and owned by the caller. The
 * array is passed as the address of the caller's pointer (a T ** as void *);
 * the macros take the element size from that pointer's type. Not thread-safe:
 * the caller's lock, if any, covers the array.
 */
#ifndef KVT_VEC_H
#define KVT_VEC_H

#include <stddef.h>

/* The capacity an array of cap elements of elem bytes needs to hold need: cap
 * itself when it does already, else cap (first when cap is 0, 1 when both
 * are) doubled until it reaches need, clamped to the largest count whose bytes
 * fit in size_t. 0 when need elements do not fit (or elem is 0). */
size_t kvti_vec_cap(size_t cap, size_t need, size_t elem, size_t first);

/* Resizes the array *arr (arr: the address of a T *, elem = sizeof(T)) to n
 * elements. n == 0 - what kvti_vec_cap returns for a size it refuses - is
 * refused too, so parallel arrays sharing one capacity can be grown to
 * kvti_vec_cap's result without a check of their own. Returns 0 or
 * KVT_ENOMEM (n refused, or no memory: *arr unchanged, its elements intact).
 */
int kvti_vec_resize(void *arr, size_t n, size_t elem);

/* Makes room for need elements in the array *arr of *cap elements: grows it
 * to kvti_vec_cap(*cap, need, elem, first) when need > *cap, updating *cap.
 * Returns 0 or KVT_ENOMEM (overflow or no memory: *arr and *cap unchanged). */
int kvti_vec_reserve(void *arr, size_t *cap, size_t need, size_t elem,
                     size_t first);

/* The same with the element size taken from the pointer's type (pp: T **;
 * sizeof **pp also makes the compiler refuse anything but a pointer's
 * address). */
#define KVTI_VEC_RESERVE(pp, cap, need, first)                                 \
  kvti_vec_reserve((pp), (cap), (need), sizeof **(pp), (first))
#define KVTI_VEC_RESIZE(pp, n) kvti_vec_resize((pp), (n), sizeof **(pp))

#endif
