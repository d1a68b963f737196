/*
 * parfor.h - a parallel loop over independent items for CPU-bound checks
 * (hashing cached bytes against block checksums: the host RAM tier's layer
 * and chunk verification): the caller plus up to threads - 1 helper threads
 * each take the next index; after the first failure no new index starts, and
 * that failure's code, message and errno come back on the calling thread.
 */
#ifndef KVT_PARFOR_H
#define KVT_PARFOR_H

#include <stddef.h>

/* At most this many threads (the caller included). */
#define KVTI_PARFOR_MAX 8u

/* fn(ctx, i) for every i in [0, n) (any order, concurrently) until one
 * returns nonzero. threads: 1..KVTI_PARFOR_MAX (0: 1; larger: clamped; never
 * more than n); helpers that cannot be created are simply not used. Returns 0
 * or the first failure's code (its error restored on this thread). */
int kvti_parfor(unsigned threads, size_t n, int (*fn)(void *ctx, size_t i),
                void *ctx);

#endif
