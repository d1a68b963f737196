/*
 * test_bufpool.c - unit tests for the aligned buffer pool: size classes
 * (aligned, never smaller than asked, bounded slack), reuse of returned
 * buffers, the idle-bytes cap and the soft limit, statistics, allocation
 * failures injected through the io seam (aligned_alloc and malloc), and the
 * reference-counted lifetime (buffers returned after the creator released the
 * pool), huge-page blocks (aligned, and advised on Linux where transparent
 * huge pages are granted on advice), and groups of buffers carved from one
 * block (aligned, disjoint, freed one by one in any order, the block back in
 * the pool only with the last).
 */
#include "testutil.h"
#include "base/bufpool.h"
#include "format/dtype.h"
#include "base/error.h"
#include "base/io.h"

#include <stdint.h>
#include <stdio.h>
#include <string.h>

static void test_classes(void) {
  size_t prev = 0;
  kvt_rng rng = {1};
  for (size_t n = 1; n < (64u << 20);
       n += 1 + (size_t)(kvt_rng_next(&rng) % (n / 3 + 1))) {
    size_t c = kvti_bufpool_class(n);
    CHECK(c >= n);
    CHECK(c % 4096 == 0);
    if (n > 32768)
      CHECK((double)c <= (double)n * 1.125 + 1);
    CHECK(c >= prev); /* monotone */
    prev = c;
  }
  CHECK_EQ_INT(kvti_bufpool_class(0), 4096);
  CHECK_EQ_INT(kvti_bufpool_class(4096), 4096);
  CHECK_EQ_INT(kvti_bufpool_class(4097), 8192);
  CHECK_EQ_INT(kvti_bufpool_class(1u << 20), 1u << 20);
  CHECK_EQ_INT(kvti_bufpool_class((1u << 20) + 1), (1u << 20) + (1u << 17));
  CHECK(kvti_bufpool_class(SIZE_MAX / 2) >= SIZE_MAX / 2);
}

static void test_reuse_and_cap(void) {
  kvti_bufpool *p = NULL;
  CHECK_EQ_INT(kvti_bufpool_create(&p, 1u << 20), 0);
  size_t cap = 0;
  char *a = kvti_bufpool_get(p, 100000, &cap);
  REQUIRE(a);
  CHECK(((uintptr_t)a & 4095) == 0);
  CHECK(cap >= 100000);
  memset(a, 1, cap); /* the whole capacity is usable */
  kvti_bufpool_put(p, a, 100000);
  char *b = kvti_bufpool_get(p, 99000, NULL); /* same class: reused */
  CHECK(b == a);
  char *c = kvti_bufpool_get(p, 99000, NULL); /* none idle: new */
  CHECK(c && c != b);
  kvti_bufpool_stats st;
  kvti_bufpool_get_stats(p, &st);
  CHECK_EQ_INT(st.gets, 3);
  CHECK_EQ_INT(st.hits, 1);
  CHECK_EQ_INT(st.allocs, 2);
  CHECK_EQ_INT(st.out_bytes, 2 * cap);
  CHECK_EQ_INT(st.idle_bytes, 0);
  kvti_bufpool_put(p, b, 99000);
  kvti_bufpool_put(p, c, 99000);
  kvti_bufpool_get_stats(p, &st);
  CHECK_EQ_INT(st.out_bytes, 0);
  CHECK_EQ_INT(st.idle_bytes, 2 * cap);
  /* Idle bytes never exceed the cap: fill with 300 KiB buffers. */
  void *bufs[8];
  for (int i = 0; i < 8; i++)
    bufs[i] = kvti_bufpool_get(p, 300000, NULL);
  for (int i = 0; i < 8; i++)
    kvti_bufpool_put(p, bufs[i], 300000);
  kvti_bufpool_get_stats(p, &st);
  CHECK(st.idle_bytes <= (1u << 20));
  CHECK(st.idle_bytes > 0);
  CHECK(st.frees > 0);
  /* A buffer larger than the cap is never kept. */
  void *big = kvti_bufpool_get(p, 2u << 20, NULL);
  REQUIRE(big);
  kvti_bufpool_put(p, big, 2u << 20);
  kvti_bufpool_get_stats(p, &st);
  CHECK(st.idle_bytes <= (1u << 20));
  kvti_bufpool_trim(p);
  kvti_bufpool_get_stats(p, &st);
  CHECK_EQ_INT(st.idle_bytes, 0);
  kvti_bufpool_put(p, NULL, 10); /* no-op */
  kvti_bufpool_release(p);
  kvti_bufpool_release(NULL);
}

static void test_limit(void) {
  kvti_bufpool *p = NULL;
  CHECK_EQ_INT(kvti_bufpool_create(&p, 64u << 20), 0);
  kvti_bufpool_set_limit(p, 1u << 20);
  /* Four idle 256 KiB buffers fill the limit ... */
  void *b[4];
  for (int i = 0; i < 4; i++)
    b[i] = kvti_bufpool_get(p, 256u << 10, NULL);
  for (int i = 0; i < 4; i++)
    kvti_bufpool_put(p, b[i], 256u << 10);
  kvti_bufpool_stats st;
  kvti_bufpool_get_stats(p, &st);
  CHECK_EQ_INT(st.idle_bytes, 1u << 20);
  /* ... so a get of another class first drops idle buffers to stay under it. */
  void *x = kvti_bufpool_get(p, 512u << 10, NULL);
  REQUIRE(x);
  kvti_bufpool_get_stats(p, &st);
  CHECK(st.idle_bytes + st.out_bytes <= (1u << 20));
  /* Gets above the limit still succeed. */
  void *y = kvti_bufpool_get(p, 2u << 20, NULL);
  CHECK(y != NULL);
  kvti_bufpool_put(p, y, 2u << 20);
  kvti_bufpool_get_stats(p, &st);
  CHECK(st.idle_bytes + st.out_bytes <= (1u << 20));
  kvti_bufpool_put(p, x, 512u << 10);
  kvti_bufpool_release(p);
}

static int fail_aligned, fail_malloc;
static void *inj_aligned(size_t align, size_t n) {
  if (fail_aligned)
    return NULL;
  return kvti_io_default.aligned_alloc(align, n);
}
static void *inj_malloc(size_t n) {
  if (fail_malloc)
    return NULL;
  return malloc(n);
}

static void test_alloc_failures(void) {
  kvti_io_ops ops = kvti_io_default;
  ops.aligned_alloc = inj_aligned;
  ops.malloc = inj_malloc;
  kvti_io_set(&ops);
  kvti_bufpool *p = NULL;
  CHECK_EQ_INT(kvti_bufpool_create(&p, 1u << 20), 0);
  fail_aligned = 1;
  CHECK(kvti_bufpool_get(p, 5000, NULL) == NULL);
  CHECK(strstr(kvt_last_error(), "out of memory") != NULL);
  kvti_bufpool_stats st;
  kvti_bufpool_get_stats(p, &st);
  CHECK_EQ_INT(st.out_bytes, 0);
  CHECK_EQ_INT(st.gets, 0);
  fail_aligned = 0;
  void *a = kvti_bufpool_get(p, 5000, NULL);
  REQUIRE(a);
  /* The bookkeeping node cannot be allocated: the buffer is freed instead of
   * leaking. */
  fail_malloc = 1;
  kvti_bufpool_put(p, a, 5000);
  fail_malloc = 0;
  kvti_bufpool_get_stats(p, &st);
  CHECK_EQ_INT(st.idle_bytes, 0);
  CHECK_EQ_INT(st.out_bytes, 0);
  kvti_io_set(NULL);
  kvti_bufpool_release(p);
}

static void *fail_calloc(size_t n, size_t s) {
  (void)n, (void)s;
  return NULL;
}

static void test_create_failure(void) {
  kvti_io_ops ops = kvti_io_default;
  ops.calloc = fail_calloc;
  kvti_io_set(&ops);
  kvti_bufpool *p = NULL;
  CHECK_EQ_INT(kvti_bufpool_create(&p, 1), KVT_ENOMEM);
  CHECK(p == NULL);
  kvti_io_set(NULL);
}

/* Buffers may outlive the creator's reference (entries outlive their tier).
 * ASan checks that nothing is used after free or leaked. */
static void test_lifetime(void) {
  kvti_bufpool *p = NULL;
  CHECK_EQ_INT(kvti_bufpool_create(&p, 1u << 20), 0);
  kvti_bufpool_retain(p);
  void *a = kvti_bufpool_get(p, 10000, NULL);
  void *b = kvti_bufpool_get(p, 20000, NULL);
  REQUIRE(a && b);
  kvti_bufpool_release(p); /* the extra reference */
  kvti_bufpool_release(p); /* the creator's: a and b still pin the pool */
  memset(a, 3, 10000);
  kvti_bufpool_put(p, a, 10000); /* not cached: nobody can get it any more */
  kvti_bufpool_put(p, b, 20000); /* the last one destroys the pool */
}

/* Regression: releasing a retained reference (what every write group does when
 * an entry is written) must not empty the pool - only the last release frees
 * idle buffers. Before the fix every written entry dropped the pool's idle
 * buffers and the next spill's copy paid page faults on half its pages. */
static void test_retain_release_keeps_idle(void) {
  kvti_bufpool *p = NULL;
  CHECK_EQ_INT(kvti_bufpool_create(&p, 8u << 20), 0);
  void *a = kvti_bufpool_get(p, 1u << 20, NULL);
  REQUIRE(a);
  kvti_bufpool_put(p, a, 1u << 20);
  kvti_bufpool_stats st;
  kvti_bufpool_get_stats(p, &st);
  CHECK_EQ_INT(st.idle_bytes, 1u << 20);
  for (int i = 0; i < 3; i++) { /* three write groups come and go */
    kvti_bufpool_retain(p);
    kvti_bufpool_release(p);
  }
  kvti_bufpool_get_stats(p, &st);
  CHECK_EQ_INT(st.idle_bytes, 1u << 20);
  CHECK_EQ_INT(st.frees, 0);
  void *b = kvti_bufpool_get(p, 1u << 20, NULL);
  CHECK(b == a); /* reused, not refaulted */
  kvti_bufpool_put(p, b, 1u << 20);
  kvti_bufpool_release(p); /* the creator's, the last: frees and destroys */
}

/* kvt_buffers_*: the public face of the default pool. */
static void test_public_api(void) {
  uint64_t idle = 1, out = 1, cap = 0, cap0 = 0;
  CHECK_EQ_INT(kvt_buffers_stats(NULL, NULL, &cap0), 0);
  CHECK(cap0 > 0); /* the default keeps something idle */
  CHECK_EQ_INT(kvt_buffers_stats(NULL, NULL, NULL), 0);
  kvt_buffers_trim();
  CHECK_EQ_INT(kvt_buffers_set_idle_cap(64u << 20), 0);
  CHECK_EQ_INT(kvt_buffers_stats(&idle, &out, &cap), 0);
  CHECK_EQ_INT(cap, 64u << 20);
  CHECK_EQ_INT(idle, 0);
  uint64_t out0 = out;
  void *a = kvti_buf_alloc(8u << 20), *b = kvti_buf_alloc(8u << 20);
  REQUIRE(a && b);
  CHECK_EQ_INT(kvt_buffers_stats(&idle, &out, NULL), 0);
  CHECK(out >= out0 + (16u << 20));
  kvti_buf_free(a);
  kvti_buf_free(b);
  CHECK_EQ_INT(kvt_buffers_stats(&idle, &out, NULL), 0);
  CHECK(idle >= 16u << 20); /* kept for reuse */
  CHECK_EQ_INT(out, out0);
  /* a lower cap frees the excess at once */
  CHECK_EQ_INT(kvt_buffers_set_idle_cap(9u << 20), 0);
  CHECK_EQ_INT(kvt_buffers_stats(&idle, NULL, NULL), 0);
  CHECK(idle <= 9u << 20 && idle > 0);
  kvt_buffers_trim();
  CHECK_EQ_INT(kvt_buffers_stats(&idle, NULL, &cap), 0);
  CHECK_EQ_INT(idle, 0);
  CHECK_EQ_INT(cap, 9u << 20); /* trim keeps the cap */
  /* cap 0: nothing stays idle */
  CHECK_EQ_INT(kvt_buffers_set_idle_cap(0), 0);
  a = kvti_buf_alloc(4u << 20);
  REQUIRE(a);
  kvti_buf_free(a);
  CHECK_EQ_INT(kvt_buffers_stats(&idle, NULL, NULL), 0);
  CHECK_EQ_INT(idle, 0);
  CHECK_EQ_INT(kvt_buffers_set_idle_cap(cap0), 0);
}

static void test_default_pool(void) {
  kvti_bufpool *d = kvti_bufpool_default();
  REQUIRE(d);
  CHECK(d == kvti_bufpool_default());
  void *a = kvti_bufpool_get(d, 1u << 20, NULL);
  REQUIRE(a);
  kvti_bufpool_put(d, a, 1u << 20);
  void *b = kvti_bufpool_get(d, 1u << 20, NULL);
  CHECK(a == b);
  kvti_bufpool_put(d, b, 1u << 20);
  kvti_bufpool_trim(d);
}

#if defined(__linux__) && !KVT_PORTABLE
/* The "THPeligible:" line of the smaps mapping holding p: 1 or 0, or -1 when
 * /proc/self/smaps is unreadable or has no such line. */
static int thp_eligible(const void *p) {
  FILE *f = fopen("/proc/self/smaps", "r");
  if (!f)
    return -1;
  char line[512];
  int in = 0, got = -1;
  uintptr_t a = (uintptr_t)p;
  while (got < 0 && fgets(line, sizeof line, f)) {
    unsigned long lo, hi;
    if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2 && strchr(line, '-') &&
        line[0] != ' ')
      in = a >= lo && a < hi;
    else if (in && strncmp(line, "THPeligible:", 12) == 0)
      got = atoi(line + 12) ? 1 : 0;
  }
  fclose(f);
  return got;
}

/* Whether transparent huge pages are granted on advice only ("[madvise]"):
 * then a mapping is eligible only if advised, so the check can fail. */
static int thp_on_advice(void) {
  FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
  char buf[128] = {0};
  int on = f && fgets(buf, sizeof buf, f) && strstr(buf, "[madvise]");
  if (f)
    fclose(f);
  return on;
}
#endif

static void test_huge_blocks(void) {
  kvti_bufpool *p = NULL;
  REQUIRE(kvti_bufpool_create(&p, 64u << 20) == 0);
  size_t big = (4u << 20) + 4096, small = 1u << 20;
  char *b = kvti_bufpool_get(p, big, NULL);
  char *s = kvti_bufpool_get(p, small, NULL);
  REQUIRE(b && s);
  CHECK(kvti_bufpool_class(big) > (4u << 20) + 4096);
  CHECK((uintptr_t)s % 4096 == 0);
  memset(b, 1, big);
  memset(s, 1, small);
#if defined(__linux__) && !KVT_PORTABLE
  CHECK((uintptr_t)b % (2u << 20) == 0); /* whole huge pages from its start */
  if (!thp_on_advice() || thp_eligible(b) < 0) {
    kvt_test_skip("env", "transparent huge pages not on advice, or no "
                         "THPeligible in /proc/self/smaps");
  } else {
    CHECK_EQ_INT(thp_eligible(b), 1);
    CHECK_EQ_INT(thp_eligible(b + (2u << 20)), 1);
    /* The class slack past the bytes asked for is not advised: no huge
     * page is faulted in for bytes nobody asked for. */
    CHECK_EQ_INT(thp_eligible(b + (4u << 20)), 0);
  }
#endif
  kvti_bufpool_put(p, b, big);
  kvti_bufpool_put(p, s, small);
  kvti_bufpool_release(p);
}

static void test_buf_group(void) {
  kvti_bufpool *d = kvti_bufpool_default();
  REQUIRE(d);
  kvti_bufpool_trim(d);
  kvti_bufpool_stats s0, s1, s2;
  kvti_bufpool_get_stats(d, &s0);
  enum { N = 9 };
  size_t sizes[N] = {512u << 10, 512u << 10,       0,     100, 4096,
                     512u << 10, (512u << 10) + 1, 65536, 3};
  void *b[N];
  REQUIRE(kvti_buf_alloc_group(b, sizes, N) == 0);
  for (int i = 0; i < N; i++) {
    REQUIRE(b[i]);
    CHECK((uintptr_t)b[i] % 4096 == 0);
    memset(b[i], 0x40 + i, sizes[i]);
  }
  for (int i = 0; i < N; i++) /* disjoint: each still holds its own bytes */
    for (size_t k = 0; k < sizes[i]; k += 997)
      CHECK(((unsigned char *)b[i])[k] == 0x40 + i);
  kvti_bufpool_get_stats(d, &s1);
  CHECK_EQ_INT(s1.gets - s0.gets, 1); /* one block for all of them */
  static const int order[N] = {4, 0, 8, 2, 6, 1, 7, 3, 5};
  for (int i = 0; i < N - 1; i++)
    kvti_buf_free(b[order[i]]);
  kvti_bufpool_get_stats(d, &s2);
  CHECK_EQ_INT(s2.out_bytes, s1.out_bytes); /* one buffer still lives */
  CHECK(((unsigned char *)b[order[N - 1]])[0] == 0x40 + order[N - 1]);
  kvti_buf_free(b[order[N - 1]]);
  kvti_bufpool_get_stats(d, &s2);
  CHECK_EQ_INT(s2.out_bytes, s0.out_bytes);
  CHECK_EQ_INT(kvti_buf_alloc_group(b, sizes, 0), 0);
  size_t huge[2] = {SIZE_MAX / 2, 1};
  CHECK(kvti_buf_alloc_group(b, huge, 2) == KVT_ENOMEM);
  CHECK(b[0] == NULL && b[1] == NULL);
  kvti_bufpool_trim(d);
}

int main(void) {
  RUN(test_classes);
  RUN(test_reuse_and_cap);
  RUN(test_limit);
  RUN(test_alloc_failures);
  RUN(test_create_failure);
  RUN(test_lifetime);
  RUN(test_retain_release_keeps_idle);
  RUN(test_default_pool);
  RUN(test_public_api);
  RUN(test_huge_blocks);
  RUN(test_buf_group);
  return kvt_test_done();
}
