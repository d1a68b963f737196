/*
 * strbuf.h - a growable NUL-terminated string for text built piece by piece
 * (JSON documents, metric renderings, protocol commands, paths): appends of
 * bytes, strings and printf-formatted text grow it by doubling through the
 * allocation seam (base/vec.h), so no caller sizes a buffer by hand. A failed
 * growth is kept in `oom` rather than returned by every append: appends then
 * stop, the text held stays valid, and take or the caller's check of oom
 * reports it once. Not thread-safe: one builder belongs to one caller.
 */
#ifndef KVT_BASE_STRBUF_H
#define KVT_BASE_STRBUF_H

#include <stddef.h>

/* Zero-initialised ({0}) it is empty. s is kvti_malloc'ed and, once
 * anything was appended, NUL-terminated at len (the NUL not counted). */
typedef struct kvti_sb {
  char *s;
  size_t len, cap;
  int oom;
} kvti_sb;

/* Appends n bytes of s (NUL bytes included: binary text is fine). */
void kvti_sb_putn(kvti_sb *b, const char *s, size_t n);
void kvti_sb_puts(kvti_sb *b, const char *s);
void kvti_sb_printf(kvti_sb *b, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* Returns the string (caller frees with kvti_free; "" when nothing was
 * appended) and empties b, or NULL with KVT_ENOMEM set (b freed) after a
 * failed growth. */
char *kvti_sb_take(kvti_sb *b);
void kvti_sb_free(kvti_sb *b);

/* A new string formatted as printf would (kvti_free), or NULL with
 * KVT_ENOMEM set. */
char *kvti_strfmt(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#endif
