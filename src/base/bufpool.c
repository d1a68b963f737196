/*
 * bufpool.c - the aligned buffer pool (see bufpool.h). Idle buffers sit in two
 * intrusive lists at once: a per-size-class stack (most recently returned
 * first, so a get reuses memory that is still mapped and likely warm in the
 * TLB) and one pool-wide age list (oldest first) used to evict when the idle
 * bytes would exceed the cap. Large allocations and frees happen outside the
 * mutex; under it only list links change.
 */
#include "base/bufpool.h"
#include "base/error.h"
#include "base/io.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#if !KVT_PORTABLE
#include <sys/mman.h>
#endif

/* 8 classes of 4 KiB steps up to 32 KiB, then 8 per power of two up to 2^64. */
#define NCLASSES (8 + 49 * 8)

typedef struct node {
  void *buf;
  size_t cap;
  struct node *cnext, *cprev; /* class stack */
  struct node *anext, *aprev; /* age list */
} node;

struct kvti_bufpool {
  pthread_mutex_t mu;
  uint64_t max_cached;
  uint64_t limit;
  uint64_t charged; /* kvti_bufpool_charge: idle bytes held by caches */
  int refs;         /* creator + retains */
  uint64_t nout;    /* outstanding buffers */
  node *cls[NCLASSES];
  node *oldest, *newest;
  kvti_bufpool_stats st;
};

static int class_index(size_t n, size_t *cap) {
  if (n == 0)
    n = 1;
  if (n <= 32768) {
    size_t c = (n + 4095) & ~(size_t)4095;
    *cap = c;
    return (int)(c / 4096 - 1);
  }
  int e = 63 -
          __builtin_clzll((unsigned long long)(n - 1)); /* 2^e < n <= 2^(e+1) */
  size_t step = (size_t)1 << (e - 3);
  size_t c = (n + step - 1) & ~(step - 1);
  *cap = c;
  return 8 + (e - 15) * 8 + (int)(c / step - 9);
}

size_t kvti_bufpool_class(size_t n) {
  size_t cap;
  class_index(n, &cap);
  return cap;
}

int kvti_bufpool_create(kvti_bufpool **out, uint64_t max_cached) {
  kvti_bufpool *p = kvti_calloc(1, sizeof *p);
  if (!p)
    return KVT_ERR_NOMEM();
  if (pthread_mutex_init(&p->mu, NULL) != 0) {
    kvti_free(p);
    return KVT_ERR_NOMEM();
  }
  p->max_cached = max_cached;
  p->refs = 1;
  *out = p;
  return 0;
}

/* The idle bytes the pool itself may keep: its cap less what caches charged.
 * Caller holds mu. */
static uint64_t own_cap(const kvti_bufpool *p) {
  return p->max_cached > p->charged ? p->max_cached - p->charged : 0;
}

static void destroy(kvti_bufpool *p) {
  pthread_mutex_destroy(&p->mu);
  kvti_free(p);
}

/* Unlinks n from the age list and its class stack. Caller holds mu. */
static void unlink_node(kvti_bufpool *p, node *n) {
  if (n->aprev)
    n->aprev->anext = n->anext;
  else
    p->oldest = n->anext;
  if (n->anext)
    n->anext->aprev = n->aprev;
  else
    p->newest = n->aprev;
  if (n->cprev) {
    n->cprev->cnext = n->cnext;
  } else {
    size_t cap;
    p->cls[class_index(n->cap, &cap)] = n->cnext;
  }
  if (n->cnext)
    n->cnext->cprev = n->cprev;
  p->st.idle_bytes -= n->cap;
}

/* Moves idle buffers to a private list until idle_bytes + extra <= keep (or
 * none remain). Caller holds mu and frees the returned list after unlocking. */
static node *evict_locked(kvti_bufpool *p, uint64_t keep, uint64_t extra) {
  node *victims = NULL;
  while (p->oldest && p->st.idle_bytes + extra > keep) {
    node *n = p->oldest;
    unlink_node(p, n);
    n->cnext = victims;
    victims = n;
    p->st.frees++;
  }
  return victims;
}

static void free_list(node *n) {
  while (n) {
    node *next = n->cnext;
    kvti_free(n->buf);
    kvti_free(n);
    n = next;
  }
}

void kvti_bufpool_retain(kvti_bufpool *p) {
  pthread_mutex_lock(&p->mu);
  p->refs++;
  pthread_mutex_unlock(&p->mu);
}

void kvti_bufpool_release(kvti_bufpool *p) {
  if (!p)
    return;
  pthread_mutex_lock(&p->mu);
  /* Only the last reference frees the idle buffers: an object that retained
   * the pool for a while (a write group, one per entry written) must not empty
   * it when it lets go - that turned every spill and promote after a write
   * into fresh page faults (bench_scale found it: ~50% of a snapshot's pages
   * faulted in steady state). */
  int last = --p->refs == 0;
  node *victims = last ? evict_locked(p, 0, 0) : NULL;
  int dead = last && p->nout == 0;
  pthread_mutex_unlock(&p->mu);
  free_list(victims);
  if (dead)
    destroy(p);
}

void kvti_bufpool_set_limit(kvti_bufpool *p, uint64_t limit) {
  pthread_mutex_lock(&p->mu);
  p->limit = limit;
  pthread_mutex_unlock(&p->mu);
}

void kvti_bufpool_set_cap(kvti_bufpool *p, uint64_t max_cached) {
  pthread_mutex_lock(&p->mu);
  p->max_cached = max_cached;
  node *victims = evict_locked(p, own_cap(p), 0);
  pthread_mutex_unlock(&p->mu);
  free_list(victims);
}

void kvti_bufpool_charge(kvti_bufpool *p, int64_t delta) {
  pthread_mutex_lock(&p->mu);
  if (delta < 0)
    p->charged -= (uint64_t)-delta > p->charged ? p->charged : (uint64_t)-delta;
  else
    p->charged += (uint64_t)delta;
  p->st.charged = p->charged;
  node *victims = delta > 0 ? evict_locked(p, own_cap(p), 0) : NULL;
  pthread_mutex_unlock(&p->mu);
  free_list(victims);
}

static pthread_once_t default_once = PTHREAD_ONCE_INIT;
static kvti_bufpool *default_pool;

static void default_init(void) {
  /* Idle cap: 2 GiB (one 8k-token Llama-3-8B fp16 entry is 1 GiB of tensors
   * plus up to 12.5% of size-class slack; at a 1 GiB cap its promotes were
   * refaulted at 0.5-0.7 of fio's cached read, bench_scale) but at most 1/8 of
   * physical memory. */
  uint64_t cap = (uint64_t)2 << 30;
  long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
  if (pages > 0 && psz > 0 && (uint64_t)pages * (uint64_t)psz / 8 < cap)
    cap = (uint64_t)pages * (uint64_t)psz / 8;
  const char *env = getenv("KVT_BUFPOOL_MB");
  if (env && *env) {
    char *end;
    unsigned long long v = strtoull(env, &end, 10);
    if (*end == '\0')
      cap = (uint64_t)v << 20;
  }
  if (kvti_bufpool_create(&default_pool, cap) != 0)
    default_pool = NULL;
}

kvti_bufpool *kvti_bufpool_default(void) {
  pthread_once(&default_once, default_init);
  return default_pool;
}

/* A new block of cap bytes for a request of n. From a huge page up, the block
 * is aligned to huge pages and those wholly within the n bytes asked for are
 * advised as such (transparent huge pages, granted on advice in the usual
 * "madvise" mode): an O_DIRECT read or write into 4 KiB pages is one device
 * segment per page, so a 1 MiB request into them is split (virtio disks take
 * about 254 segments) and every page is pinned one by one, while a huge page
 * is one physically contiguous segment. Measured on the target VMs (1 MiB
 * io_uring reads, bench_promote_cold and fio): 0.8-1.0 GB/s into 4 KiB pages,
 * 1.8-2.1 GB/s into huge pages. Only pages the caller asked for are advised, so
 * no huge page is faulted in for the class slack beyond n; refused advice
 * (huge pages off, a system without them) leaves the block as it is. */
#define HUGE_PAGE ((size_t)2 << 20)
size_t kvti_bufpool_huge_bytes(void) {
#if !KVT_PORTABLE && defined(MADV_HUGEPAGE)
  return HUGE_PAGE;
#else
  return 0;
#endif
}
static void *new_block(size_t n, size_t cap) {
#if !KVT_PORTABLE && defined(MADV_HUGEPAGE)
  if (n >= HUGE_PAGE) {
    void *b = kvti_aligned_alloc(HUGE_PAGE, cap);
    if (b)
      (void)madvise(b, n / HUGE_PAGE * HUGE_PAGE, MADV_HUGEPAGE);
    return b;
  }
#endif
  (void)n;
  return kvti_aligned_alloc(KVTI_BUF_ALIGN, cap);
}

void *kvti_bufpool_get(kvti_bufpool *p, size_t n, size_t *capp) {
  size_t cap;
  int ci = class_index(n, &cap);
  if (cap < n) { /* overflow near SIZE_MAX */
    KVT_ERR(KVT_ENOMEM, "buffer of %zu bytes is too large", n);
    return NULL;
  }
  node *hit = NULL, *victims = NULL;
  pthread_mutex_lock(&p->mu);
  if (p->cls[ci]) {
    hit = p->cls[ci];
    unlink_node(p, hit);
    p->st.hits++;
  } else if (p->limit) {
    uint64_t out = p->st.out_bytes + cap;
    uint64_t keep = p->limit > out ? p->limit - out : 0;
    victims = evict_locked(p, keep, 0);
  }
  /* Count the buffer as outstanding before allocating so that the pool cannot
   * be destroyed under us and concurrent gets see the bytes. */
  p->nout++;
  p->st.out_bytes += cap;
  pthread_mutex_unlock(&p->mu);
  free_list(victims);

  void *buf;
  if (hit) {
    buf = hit->buf;
    kvti_free(hit);
  } else {
    buf = new_block(n, cap);
  }
  pthread_mutex_lock(&p->mu);
  if (!buf) {
    p->nout--;
    p->st.out_bytes -= cap;
  } else {
    p->st.gets++;
    if (!hit)
      p->st.allocs++;
    uint64_t tot = p->st.out_bytes + p->st.idle_bytes;
    if (tot > p->st.peak_bytes)
      p->st.peak_bytes = tot;
  }
  int dead = p->refs == 0 && p->nout == 0;
  pthread_mutex_unlock(&p->mu);
  if (dead) /* only possible when a get races the final release and fails */
    destroy(p);
  if (buf && capp)
    *capp = cap;
  return buf;
}

void kvti_bufpool_put(kvti_bufpool *p, void *buf, size_t n) {
  if (!buf)
    return;
  size_t cap;
  int ci = class_index(n, &cap);
  /* The node is allocated outside the lock; when even that fails the buffer is
   * simply freed. */
  node *nd = kvti_malloc(sizeof *nd);
  node *victims = NULL;
  pthread_mutex_lock(&p->mu);
  p->nout--;
  p->st.out_bytes -= cap;
  uint64_t keep = p->refs > 0 ? own_cap(p) : 0;
  if (p->limit) {
    uint64_t room = p->limit > p->st.out_bytes ? p->limit - p->st.out_bytes : 0;
    if (room < keep)
      keep = room;
  }
  if (nd && cap <= keep) {
    victims = evict_locked(p, keep, cap);
    nd->buf = buf;
    nd->cap = cap;
    nd->cnext = p->cls[ci];
    nd->cprev = NULL;
    if (nd->cnext)
      nd->cnext->cprev = nd;
    p->cls[ci] = nd;
    nd->anext = NULL;
    nd->aprev = p->newest;
    if (p->newest)
      p->newest->anext = nd;
    else
      p->oldest = nd;
    p->newest = nd;
    p->st.idle_bytes += cap;
    buf = NULL;
    nd = NULL;
  } else {
    p->st.frees++;
  }
  int dead = p->refs == 0 && p->nout == 0;
  pthread_mutex_unlock(&p->mu);
  free_list(victims);
  kvti_free(nd);
  kvti_free(buf);
  if (dead)
    destroy(p);
}

void kvti_bufpool_trim(kvti_bufpool *p) {
  pthread_mutex_lock(&p->mu);
  node *victims = evict_locked(p, 0, 0);
  pthread_mutex_unlock(&p->mu);
  free_list(victims);
}

void kvti_bufpool_get_stats(kvti_bufpool *p, kvti_bufpool_stats *out) {
  pthread_mutex_lock(&p->mu);
  *out = p->st;
  pthread_mutex_unlock(&p->mu);
}

/* ---- public API --------------------------------------------------------- */

int kvt_buffers_set_idle_cap(uint64_t bytes) {
  kvti_bufpool *p = kvti_bufpool_default();
  if (!p)
    return KVT_ERR_NOMEM();
  kvti_bufpool_set_cap(p, bytes);
  return 0;
}

void kvt_buffers_trim(void) {
  kvti_bufpool *p = kvti_bufpool_default();
  if (p)
    kvti_bufpool_trim(p);
}

int kvt_buffers_stats(uint64_t *idle_bytes, uint64_t *out_bytes,
                      uint64_t *idle_cap) {
  kvti_bufpool *p = kvti_bufpool_default();
  if (!p)
    return KVT_ERR_NOMEM();
  kvti_bufpool_stats st;
  kvti_bufpool_get_stats(p, &st);
  if (idle_bytes)
    *idle_bytes = st.idle_bytes;
  if (out_bytes)
    *out_bytes = st.out_bytes;
  if (idle_cap) {
    pthread_mutex_lock(&p->mu);
    *idle_cap = p->max_cached;
    pthread_mutex_unlock(&p->mu);
  }
  return 0;
}
