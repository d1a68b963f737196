/*
 * error.h - internal error reporting. Every failing internal function sets the
 * thread-local last-error message (and the OS errno when there is one) through
 * these macros and returns the negative kvt_error code, so the public API's
 * kvt_last_error() always explains the most recent failure on the calling
 * thread. In debug builds (KVT_DEBUG) the message is prefixed with the
 * file:line that raised it.
 */
#ifndef KVT_ERROR_H
#define KVT_ERROR_H

#include "kvtier.h"

#include <errno.h>

/* Sets the message (printf-style) and errno 0; returns code. */
int kvti_error_set(int code, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* Sets the message with ": strerror(os_errno)" appended and the OS errno;
 * returns a code mapped from os_errno (ENOSPC -> KVT_ENOSPC, ENOMEM ->
 * KVT_ENOMEM, EACCES/EPERM/ELOOP -> KVT_EPERM, ENOENT -> KVT_ENOTFOUND, else
 * KVT_EIO). */
int kvti_error_os(int os_errno, const char *file, int line, const char *fmt,
                  ...) __attribute__((format(printf, 4, 5)));
/* Maps an errno to a kvt_error code as above. */
int kvti_errno_to_code(int os_errno);

/* Sets this thread's message and errno verbatim (to carry an error raised on a
 * worker thread over to the thread that reports it). Returns code. */
int kvti_error_restore(int code, int os_errno, const char *msg);

/* Error capture (libgit2's git_error_state): a copy of this thread's last
 * error, taken before best-effort cleanup that may overwrite it (removing the
 * files of a failed write, releasing a reservation, quarantining) and put back
 * afterwards, or carried from a worker thread to the caller's. The message is
 * kept verbatim (no second file:line or strerror suffix on restore). */
#define KVTI_ERROR_MSG_MAX 1024
typedef struct kvti_error_state {
  int code;     /* the kvt_error the failure returned */
  int os_errno; /* kvt_last_errno() at capture */
  char msg[KVTI_ERROR_MSG_MAX];
} kvti_error_state;

/* Saves code with this thread's message and errno into *st; returns code. */
int kvti_error_state_capture(kvti_error_state *st, int code);
/* Makes *st this thread's last error again; returns st->code. */
int kvti_error_state_restore(const kvti_error_state *st);

#define KVT_ERR(code, ...)                                                     \
  kvti_error_set((code), __FILE__, __LINE__, __VA_ARGS__)
#define KVT_ERR_OS(os_errno, ...)                                              \
  kvti_error_os((os_errno), __FILE__, __LINE__, __VA_ARGS__)
#define KVT_ERR_NOMEM() KVT_ERR(KVT_ENOMEM, "out of memory")

#endif
