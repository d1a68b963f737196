/*
 * lock.c - striped read-write locks keyed by token hash (see lock.h). glibc's
 * default rwlock prefers readers; we ask for writer preference so eviction and
 * replacement make progress under a steady load of promotes.
 */
#if !defined(_GNU_SOURCE) && !KVT_PORTABLE
#define _GNU_SOURCE 1 /* pthread_rwlockattr_setkind_np */
#endif
#include "base/lock.h"
#include "base/error.h"

#include <string.h>

static unsigned stripe_of(const char *hash) {
  unsigned v = 0;
  for (int i = 0; i < 4 && hash[i]; i++) {
    char c = hash[i];
    unsigned d = (c >= '0' && c <= '9')   ? (unsigned)(c - '0')
                 : (c >= 'a' && c <= 'f') ? (unsigned)(c - 'a' + 10)
                                          : (unsigned)(unsigned char)c;
    v = v * 16u + d;
  }
  return v % KVTI_STRIPES;
}

int kvti_stripes_init(kvti_stripes *s) {
  pthread_rwlockattr_t attr;
  memset(s, 0, sizeof *s);
  if (pthread_rwlockattr_init(&attr) != 0)
    return KVT_ERR(KVT_ENOMEM, "pthread_rwlockattr_init failed");
#if defined(__GLIBC__) && defined(_GNU_SOURCE)
  pthread_rwlockattr_setkind_np(&attr,
                                PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
#endif
  for (int i = 0; i < KVTI_STRIPES; i++) {
    if (pthread_rwlock_init(&s->locks[i], &attr) != 0) {
      for (int j = 0; j < i; j++)
        pthread_rwlock_destroy(&s->locks[j]);
      pthread_rwlockattr_destroy(&attr);
      return KVT_ERR(KVT_ENOMEM, "pthread_rwlock_init failed");
    }
  }
  pthread_rwlockattr_destroy(&attr);
  s->inited = 1;
  return 0;
}

void kvti_stripes_destroy(kvti_stripes *s) {
  if (!s->inited)
    return;
  for (int i = 0; i < KVTI_STRIPES; i++)
    pthread_rwlock_destroy(&s->locks[i]);
  s->inited = 0;
}

void kvti_stripe_rdlock(kvti_stripes *s, const char *hash) {
  pthread_rwlock_rdlock(&s->locks[stripe_of(hash)]);
}
void kvti_stripe_wrlock(kvti_stripes *s, const char *hash) {
  pthread_rwlock_wrlock(&s->locks[stripe_of(hash)]);
}
void kvti_stripe_unlock(kvti_stripes *s, const char *hash) {
  pthread_rwlock_unlock(&s->locks[stripe_of(hash)]);
}
