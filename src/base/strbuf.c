/*
 * strbuf.c - the growable string (strbuf.h): room reserved through
 * kvti_vec_reserve (the text and its NUL, refused before size_t overflows),
 * printf output formatted into a small stack buffer first so a short piece
 * costs one pass, a long one formatted again in place once room is made.
 */
#include "base/strbuf.h"

#include "base/error.h"
#include "base/io.h"
#include "base/vec.h"

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

static void sb_reserve(kvti_sb *b, size_t extra) {
  if (b->oom)
    return;
  /* Room for the text and its NUL; a failure is kept in oom for take. */
  if (extra > SIZE_MAX - 1 - b->len ||
      KVTI_VEC_RESERVE(&b->s, &b->cap, b->len + extra + 1, 256) != 0)
    b->oom = 1;
}

void kvti_sb_putn(kvti_sb *b, const char *s, size_t n) {
  sb_reserve(b, n);
  if (b->oom)
    return;
  memcpy(b->s + b->len, s, n);
  b->len += n;
  b->s[b->len] = '\0';
}

void kvti_sb_puts(kvti_sb *b, const char *s) {
  kvti_sb_putn(b, s, strlen(s));
}

/* Appends fmt's output: formatted into tmp first (one pass for a short
 * piece), else formatted again in place once room for it is made. */
static void sb_vprintf(kvti_sb *b, const char *fmt, va_list ap) {
  char tmp[256];
  va_list again;
  va_copy(again, ap);
  int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
  if (n < 0)
    b->oom = 1;
  else if ((size_t)n < sizeof tmp)
    kvti_sb_putn(b, tmp, (size_t)n);
  else {
    sb_reserve(b, (size_t)n);
    if (!b->oom) {
      vsnprintf(b->s + b->len, (size_t)n + 1, fmt, again);
      b->len += (size_t)n;
    }
  }
  va_end(again);
}

void kvti_sb_printf(kvti_sb *b, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  sb_vprintf(b, fmt, ap);
  va_end(ap);
}

char *kvti_sb_take(kvti_sb *b) {
  if (b->oom || !b->s) {
    if (!b->oom && !b->s) {
      sb_reserve(b, 0);
      if (!b->oom) {
        b->s[0] = '\0';
        char *s = b->s;
        memset(b, 0, sizeof *b);
        return s;
      }
    }
    kvti_sb_free(b);
    KVT_ERR_NOMEM();
    return NULL;
  }
  char *s = b->s;
  memset(b, 0, sizeof *b);
  return s;
}

void kvti_sb_free(kvti_sb *b) {
  kvti_free(b->s);
  memset(b, 0, sizeof *b);
}

char *kvti_strfmt(const char *fmt, ...) {
  kvti_sb b = {0};
  va_list ap;
  va_start(ap, fmt);
  sb_vprintf(&b, fmt, ap);
  va_end(ap);
  return kvti_sb_take(&b);
}
