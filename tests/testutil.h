/*
 * testutil.h - the tiny assertion framework and helpers every C test uses:
 * CHECK macros that report file:line and the kvtier last error and make the
 * test exit non-zero, a seeded PRNG (tests generate their data, never download
 * it), and private temporary directories removed at exit unless KVT_KEEP_TMP is
 * set.
 */
#ifndef KVT_TESTUTIL_H
#define KVT_TESTUTIL_H

#include "kvtier.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

extern int kvt_test_failures;

#define CHECK(cond)                                                            \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "%s:%d: CHECK failed: %s (last error: %s)\n", __FILE__,  \
              __LINE__, #cond, kvt_last_error());                              \
      kvt_test_failures++;                                                     \
    }                                                                          \
  } while (0)

/* Fatal variant: stops the test function at once. */
#define REQUIRE(cond)                                                          \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "%s:%d: REQUIRE failed: %s (last error: %s)\n",          \
              __FILE__, __LINE__, #cond, kvt_last_error());                    \
      exit(1);                                                                 \
    }                                                                          \
  } while (0)

#define CHECK_EQ_INT(a, b)                                                     \
  do {                                                                         \
    long long va_ = (long long)(a), vb_ = (long long)(b);                      \
    if (va_ != vb_) {                                                          \
      fprintf(stderr,                                                          \
              "%s:%d: CHECK_EQ failed: %s == %lld, %s == %lld (last "          \
              "error: %s)\n",                                                  \
              __FILE__, __LINE__, #a, va_, #b, vb_, kvt_last_error());         \
      kvt_test_failures++;                                                     \
    }                                                                          \
  } while (0)

#define RUN(fn)                                                                \
  do {                                                                         \
    int before_ = kvt_test_failures;                                           \
    fn();                                                                      \
    fprintf(stderr, "%s %s\n", kvt_test_failures == before_ ? "ok  " : "FAIL", \
            #fn);                                                              \
  } while (0)

/* Prints the summary line and returns the exit code for main. */
int kvt_test_done(void);

/* Skips, reported so scripts/test.sh counts them (never as passes). Every skip
 * names a reason tag - a short lowercase word saying what was missing - and
 * prints one line "SKIP(<tag>): <what>" on stderr:
 *   kvt_test_skip: a PART of this test did not run (the rest still runs and
 *     can fail); each call is one skip in the closing count;
 *   kvt_test_skip_all: the whole test cannot run; returns 77 (ctest's
 *     SKIP_RETURN_CODE) for main to return.
 * Tags in use: redis, hiredis, python (Debian's /usr/bin/python3 with numpy
 * and pytest), ref-tree (a file of this tree missing), seed (the reference's
 * documentation, ../shared/seed/ssd_cache_reference.txt beside the clone or
 * under $KVT_SHARED_DIR, from which tests/reference/reference_loader.py
 * assembles the reference module), upstream (the client code in
 * ../shared/upstream that the real-client tests load), clang - things CI
 * installs or provides, so KVT_TEST_STRICT=1 (set by .ci/run) turns their
 * skips into failures - and uring (io_uring refused, e.g. by a seccomp
 * filter), odirect
 * (a file system without O_DIRECT), env (a host facility such as /proc),
 * which are reported but never fail. An untagged skip is treated as strict. */
#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
void kvt_test_skip(const char *tag, const char *fmt, ...);
#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
int kvt_test_skip_all(const char *tag, const char *fmt, ...);

/* splitmix64 PRNG; deterministic for a seed. */
typedef struct kvt_rng {
  uint64_t s;
} kvt_rng;
uint64_t kvt_rng_next(kvt_rng *r);
void kvt_rng_fill(kvt_rng *r, void *buf, size_t n);

/* Creates a fresh private temporary directory (mode 0700) and returns its path
 * (static storage per call, malloc'ed; removed at exit unless KVT_KEEP_TMP=1).
 */
char *kvt_test_tmpdir(const char *tag);
/* rm -rf without following symlinks. */
void kvt_test_rmtree(const char *path);
/* The whole file, malloc'ed and NUL-terminated (*len: its size without the
 * NUL), or NULL when it cannot be read. */
char *kvt_test_read_file(const char *path, size_t *len);
/* 1 when path exists (lstat: a dangling symlink counts), else 0. */
int kvt_test_exists(const char *path);
/* Number of names in dir (without . and ..) ending in suffix (NULL: all), -1
 * when dir cannot be read. */
int kvt_test_count_dir(const char *dir, const char *suffix);
/* Calls fn (may be NULL) with the path of every chunk file
 * (chunks/<kk>/<key>.kvc) of a chunked cache directory; returns their number.
 */
int kvt_test_each_chunk(const char *cache_dir,
                        void (*fn)(void *ctx, const char *path), void *ctx);
/* The name (64 hex) of tokens[0, n) spilled without a cache_salt by a native
 * local tier opened with model_id (docs/FORMAT.md section 6): SHA-256(N ||
 * tokens), N = SHA-256("kvtier model_id v1" NUL || model_id); model_id NULL
 * or "": the reference's SHA-256(tokens). Computed here with OpenSSL from the
 * documented rule, not by the library's code. */
void kvt_test_model_hash(char out[65], const char *model_id,
                         const int32_t *tokens, size_t n);

#endif
