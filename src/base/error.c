/*
 * error.c - error codes, their static descriptions and the thread-local
 * last-error state (message + OS errno) behind kvt_strerror, kvt_last_error and
 * kvt_last_errno. The message buffer is per thread so concurrent callers never
 * see each other's errors; it is fixed-size so that reporting an out-of-memory
 * condition never needs memory.
 */
#include "base/error.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#define KVT_MSG_MAX KVTI_ERROR_MSG_MAX

static _Thread_local char tl_msg[KVT_MSG_MAX];
static _Thread_local int tl_errno;

const char *kvt_strerror(int err) {
  switch (err) {
  case KVT_OK:
    return "success";
  case KVT_EINVAL:
    return "invalid argument";
  case KVT_ENOMEM:
    return "out of memory";
  case KVT_EIO:
    return "I/O error";
  case KVT_ENOTFOUND:
    return "not found";
  case KVT_ECORRUPT:
    return "corrupt data";
  case KVT_EFULL:
    return "spill queue full";
  case KVT_ECLOSED:
    return "tier closed";
  case KVT_ETIMEDOUT:
    return "timed out";
  case KVT_ECANCELED:
    return "cancelled";
  case KVT_EBUDGET:
    return "budget refused (a reserve callback or the write budget)";
  case KVT_ETOOBIG:
    return "entry too big";
  case KVT_EPERM:
    return "permission or ownership refused";
  case KVT_EBUSY:
    return "resource busy";
  case KVT_EUNSUPPORTED:
    return "unsupported";
  case KVT_ENOSPC:
    return "no space left on device";
  case KVT_EDB:
    return "index database error";
  case KVT_EAGAIN:
    return "not ready";
  case KVT_ERANGE:
    return "buffer too small";
  default:
    return "unknown error";
  }
}

const char *kvt_last_error(void) {
  return tl_msg;
}
int kvt_last_errno(void) {
  return tl_errno;
}
void kvt_clear_error(void) {
  tl_msg[0] = '\0';
  tl_errno = 0;
}

static void vset(const char *file, int line, const char *fmt, va_list ap) {
  size_t off = 0;
#ifdef KVT_DEBUG
  int n = snprintf(tl_msg, sizeof tl_msg, "%s:%d: ", file, line);
  off = (n > 0 && (size_t)n < sizeof tl_msg) ? (size_t)n : 0;
#else
  (void)file;
  (void)line;
#endif
  vsnprintf(tl_msg + off, sizeof tl_msg - off, fmt, ap);
}

int kvti_error_set(int code, const char *file, int line, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vset(file, line, fmt, ap);
  va_end(ap);
  tl_errno = 0;
  return code;
}

int kvti_errno_to_code(int os_errno) {
  switch (os_errno) {
  case ENOSPC:
#ifdef EDQUOT
  case EDQUOT:
#endif
    return KVT_ENOSPC;
  case ENOMEM:
    return KVT_ENOMEM;
  case EACCES:
  case EPERM:
  case ELOOP:
    return KVT_EPERM;
  case ENOENT:
    return KVT_ENOTFOUND;
  case EINVAL:
    return KVT_EINVAL;
  default:
    return KVT_EIO;
  }
}

int kvti_error_os(int os_errno, const char *file, int line, const char *fmt,
                  ...) {
  va_list ap;
  va_start(ap, fmt);
  vset(file, line, fmt, ap);
  va_end(ap);
  size_t len = strlen(tl_msg);
  if (len < sizeof tl_msg - 1) {
    char eb[128];
    const char *es = eb;
#if defined(__GLIBC__) && defined(_GNU_SOURCE)
    es = strerror_r(os_errno, eb, sizeof eb);
#else
    if (strerror_r(os_errno, eb, sizeof eb) != 0)
      snprintf(eb, sizeof eb, "errno %d", os_errno);
#endif
    snprintf(tl_msg + len, sizeof tl_msg - len, ": %s", es);
  }
  tl_errno = os_errno;
  return kvti_errno_to_code(os_errno);
}

int kvti_error_restore(int code, int os_errno, const char *msg) {
  snprintf(tl_msg, sizeof tl_msg, "%s", msg ? msg : "");
  tl_errno = os_errno;
  return code;
}

int kvti_error_state_capture(kvti_error_state *st, int code) {
  st->code = code;
  st->os_errno = tl_errno;
  memcpy(st->msg, tl_msg, sizeof st->msg);
  return code;
}

int kvti_error_state_restore(const kvti_error_state *st) {
  memcpy(tl_msg, st->msg, sizeof tl_msg);
  tl_errno = st->os_errno;
  return st->code;
}
