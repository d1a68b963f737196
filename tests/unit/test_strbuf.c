/*
 * test_strbuf.c - unit tests for the growable string (base/strbuf.h): an
 * empty builder taken as "", bytes (NUL included) appended with their length
 * and a terminating NUL, printf pieces short and longer than the builder's
 * stack buffer equal to what snprintf makes, thousands of appends kept in
 * order, kvti_strfmt short and long, and an allocator that fails: oom set,
 * later appends ignored, the text already held intact, take returning NULL
 * with the out-of-memory error and leaving the builder empty.
 */
#include "testutil.h"
#include "base/io.h"
#include "base/strbuf.h"
#include "faultio.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void test_empty_and_bytes(void) {
  kvti_sb b = {0};
  char *s = kvti_sb_take(&b);
  REQUIRE(s != NULL);
  CHECK_EQ_INT(strlen(s), 0);
  kvti_free(s);
  CHECK(b.s == NULL && b.len == 0 && b.cap == 0);

  static const char bin[5] = {'a', '\0', 'b', '\r', '\n'};
  kvti_sb_putn(&b, bin, sizeof bin);
  kvti_sb_puts(&b, "cd");
  CHECK_EQ_INT(b.len, 7);
  CHECK(memcmp(b.s, bin, sizeof bin) == 0);
  CHECK(memcmp(b.s + 5, "cd", 3) == 0); /* NUL-terminated at len */
  kvti_sb_free(&b);
  CHECK(b.s == NULL && b.len == 0);
}

static void test_printf(void) {
  char big[1000];
  memset(big, 'x', sizeof big - 1);
  big[sizeof big - 1] = '\0';
  kvti_sb b = {0};
  kvti_sb_printf(&b, "n=%d;", 42);
  kvti_sb_printf(&b, "[%s|%llu]", big, 18446744073709551615ull);
  kvti_sb_printf(&b, "%s", "");
  char want[1200];
  snprintf(want, sizeof want, "n=%d;[%s|%llu]", 42, big,
           18446744073709551615ull);
  CHECK_EQ_INT(b.len, strlen(want));
  char *s = kvti_sb_take(&b);
  REQUIRE(s != NULL);
  CHECK(strcmp(s, want) == 0);
  kvti_free(s);

  for (int i = 0; i < 5000; i++)
    kvti_sb_printf(&b, "%04d,", i);
  CHECK_EQ_INT(b.len, 5000 * 5);
  int same = 1;
  for (int i = 0; i < 5000; i++) {
    char p[8];
    snprintf(p, sizeof p, "%04d,", i);
    same &= memcmp(b.s + 5 * i, p, 5) == 0;
  }
  CHECK(same);
  CHECK(b.s[b.len] == '\0');
  kvti_sb_free(&b);

  char *f = kvti_strfmt("%s/%s/%u", "dir", "name", 7u);
  REQUIRE(f != NULL);
  CHECK(strcmp(f, "dir/name/7") == 0);
  kvti_free(f);
  f = kvti_strfmt("%s-%s", big, big);
  REQUIRE(f != NULL);
  CHECK_EQ_INT(strlen(f), 2 * (sizeof big - 1) + 1);
  CHECK(f[sizeof big - 1] == '-' && f[2 * (sizeof big - 1)] == 'x');
  kvti_free(f);
}

static void test_alloc_failure(void) {
  fio_install(); /* allocations fail through the seam when armed */
  kvti_sb b = {0};
  kvti_sb_puts(&b, "kept");
  REQUIRE(!b.oom);
  char big[600];
  memset(big, 'y', sizeof big - 1);
  big[sizeof big - 1] = '\0';
  fio_arm(FIO_ALLOC, 1, FIO_FAIL_ERRNO, ENOMEM, 1);
  kvti_sb_printf(&b, "%s", big); /* needs more room than the first growth */
  CHECK(b.oom);
  CHECK_EQ_INT(b.len, 4);
  CHECK(strcmp(b.s, "kept") == 0);
  fio_disarm();
  kvti_sb_puts(&b, "more"); /* after a failure nothing is appended */
  CHECK_EQ_INT(b.len, 4);
  kvt_clear_error();
  CHECK(kvti_sb_take(&b) == NULL);
  CHECK(strstr(kvt_last_error(), "out of memory") != NULL);
  CHECK(b.s == NULL && b.len == 0 && !b.oom);

  fio_arm(FIO_ALLOC, 1, FIO_FAIL_ERRNO, ENOMEM, 1);
  kvt_clear_error();
  CHECK(kvti_strfmt("%s", "x") == NULL);
  CHECK(strstr(kvt_last_error(), "out of memory") != NULL);
  CHECK(fio_fired() >= 1);
  fio_remove();
}

int main(void) {
  RUN(test_empty_and_bytes);
  RUN(test_printf);
  RUN(test_alloc_failure);
  return kvt_test_done();
}
