/*
 * bufpool.h - a pool of 4096-aligned buffers reused across promotes and spills.
 * Freshly allocated memory costs a page fault per 4 KiB on first touch (~1.5
 * GB/s on the target VMs, slower than the disk), so the library's own large
 * buffers (snapshot copies, promoted tensor data, bounce buffers) come from
 * here and go back here instead of to the allocator. Buffers are rounded up to
 * a size class (4 KiB granularity below 32 KiB, then 8 classes per power of
 * two, so at most 12.5% slack) and a freed buffer is kept for the next request
 * of the same class. Blocks of a huge page (2 MiB) and more are aligned to
 * one, and the huge pages within the bytes asked for are advised as such
 * (bufpool.c: O_DIRECT transfers into them are one device segment per huge
 * page instead of one per 4 KiB).
 *
 * Bounds: the pool never holds more than `max_cached` bytes of idle buffers (a
 * put that would exceed it frees the oldest idle buffers first), and gets never
 * fail because of the pool: when no idle buffer fits, a new one is allocated
 * through the io seam (kvti_aligned_alloc). So the memory attributable to a
 * pool is (bytes handed out and not yet returned) + (at most max_cached). With
 * `limit` set (kvti_bufpool_set_limit), a get that would push handed-out + idle
 * bytes above it first drops idle buffers, so a caller bounding its own
 * outstanding bytes (the spill queue does) bounds the pool's whole footprint.
 *
 * Threads: every function is thread-safe (one mutex; the critical sections are
 * list updates, never allocation of large blocks or page faults). Lifetime: the
 * pool is reference counted - the creator holds one reference, and every
 * outstanding buffer pins the pool, so an entry that outlives its tier can
 * still return its buffers. kvti_bufpool_release drops the creator's reference;
 * the pool is destroyed when no reference and no outstanding buffer remains.
 */
#ifndef KVT_BUFPOOL_H
#define KVT_BUFPOOL_H

#include <stddef.h>
#include <stdint.h>

#define KVTI_BUF_ALIGN 4096u

typedef struct kvti_bufpool kvti_bufpool;

typedef struct kvti_bufpool_stats {
  uint64_t gets;       /* successful gets */
  uint64_t hits;       /* gets served from an idle buffer */
  uint64_t allocs;     /* gets that allocated a new buffer */
  uint64_t frees;      /* buffers returned to the allocator */
  uint64_t out_bytes;  /* capacity bytes handed out now */
  uint64_t idle_bytes; /* capacity bytes idle in the pool now */
  uint64_t peak_bytes; /* max of out_bytes + idle_bytes seen */
  uint64_t charged;    /* bytes charged by kvti_bufpool_charge now */
} kvti_bufpool_stats;

/* Creates a pool keeping at most max_cached idle bytes (0: keep none - every
 * put frees). Returns 0 and *out, or KVT_ENOMEM. */
int kvti_bufpool_create(kvti_bufpool **out, uint64_t max_cached);
/* Drops a reference (the creator's or one taken with kvti_bufpool_retain;
 * accepts NULL). When it was the last one, idle buffers are freed now and the
 * pool itself when the last outstanding buffer comes back; otherwise nothing
 * else changes. */
void kvti_bufpool_release(kvti_bufpool *p);
/* Adds a reference (for an object that will call kvti_bufpool_release later).
 */
void kvti_bufpool_retain(kvti_bufpool *p);
/* Optional soft ceiling on out_bytes + idle_bytes (0 = none): gets drop idle
 * buffers to stay under it (they still succeed above it). */
void kvti_bufpool_set_limit(kvti_bufpool *p, uint64_t limit);

/* Changes the idle cap (0: keep nothing idle), freeing idle buffers beyond it
 * now. */
void kvti_bufpool_set_cap(kvti_bufpool *p, uint64_t max_cached);

/* One budget for idle memory: bytes that other holders of this pool's buffers
 * keep idle on purpose (the host RAM caches, tier/hostcache.h) are charged
 * here (delta > 0) and uncharged (delta < 0) as they change, and the pool
 * keeps at most max_cached - charged idle bytes itself (never below 0),
 * freeing idle buffers beyond that now. So cached + pool-idle bytes stay
 * within max(max_cached, what the caches hold under their own bounds). */
void kvti_bufpool_charge(kvti_bufpool *p, int64_t delta);

/* The process-wide pool used when no other is given (idle cap 2 GiB but at most
 * 1/8 of physical memory, or the value of the environment variable
 * KVT_BUFPOOL_MB read at first use; kvt_buffers_set_idle_cap changes it).
 * Never released. */
kvti_bufpool *kvti_bufpool_default(void);

/* Capacity a request of n bytes is rounded up to (>= n, multiple of 4096, > 0).
 */
size_t kvti_bufpool_class(size_t n);

/* A 4096-aligned buffer of at least n bytes (contents undefined), or NULL with
 * the error set (KVT_ENOMEM). *cap (may be NULL) receives the usable capacity.
 */
void *kvti_bufpool_get(kvti_bufpool *p, size_t n, size_t *cap);
/* Returns a buffer obtained from kvti_bufpool_get(p, n, ...) with the same n
 * (or its cap). Accepts buf == NULL (no-op). */
void kvti_bufpool_put(kvti_bufpool *p, void *buf, size_t n);
/* The size from which buffers are huge-page aligned and advised as huge
 * pages, or 0 where this build advises none (the portable build, systems
 * without transparent huge pages). Whether the kernel grants the advice is
 * its own policy. */
size_t kvti_bufpool_huge_bytes(void);
/* Frees every idle buffer now. */
void kvti_bufpool_trim(kvti_bufpool *p);
void kvti_bufpool_get_stats(kvti_bufpool *p, kvti_bufpool_stats *out);

#endif
