/*
 * registry.c - the constructor table of remote stores (backend.h): a remote
 * URL's scheme picks the backend, so the tier (options validation, remote
 * open) names no particular store and adding one is a row here plus its own
 * files below store/. A backend this build does not include keeps its row with
 * a null constructor that refuses the URL with KVT_EUNSUPPORTED and says how
 * to get it: the URL is still validated by the same grammar in every build,
 * and the tier carries no build switch of its own.
 */
#include "store/backend.h"
#include "base/error.h"
#include "store/redis_url.h"

#include <stdio.h>
#include <string.h>

typedef struct remote_kind {
  const char *scheme; /* "redis://" */
  int (*check_url)(const char *url);
  int (*create)(kvti_backend **out, const kvti_remote_cfg *cfg);
} remote_kind;

/* The one build switch of the seam: Redis, or the null remote when this build
 * was made without hiredis. */
#if KVT_HAVE_REDIS
#include "store/redis.h"
#define KVTI_REDIS_NEW kvti_backend_redis_new
#else
static int redis_unsupported(kvti_backend **out, const kvti_remote_cfg *cfg) {
  *out = NULL;
  return KVT_ERR(KVT_EUNSUPPORTED,
                 "remote_url %s: this build of kvtier has no Redis support "
                 "(rebuild with hiredis, Debian's libhiredis-dev)",
                 cfg->url);
}
#define KVTI_REDIS_NEW redis_unsupported
#endif

static const remote_kind kinds[] = {
    {"redis://", kvti_redis_check_url, KVTI_REDIS_NEW},
    {"rediss://", kvti_redis_check_url, KVTI_REDIS_NEW}, /* TLS */
};
#define N_KINDS (sizeof kinds / sizeof kinds[0])

static const remote_kind *kind_of(const char *url) {
  for (size_t i = 0; url && i < N_KINDS; i++)
    if (strncmp(url, kinds[i].scheme, strlen(kinds[i].scheme)) == 0)
      return &kinds[i];
  char known[256] = "";
  size_t len = 0;
  for (size_t i = 0; i < N_KINDS && len < sizeof known; i++)
    len += (size_t)snprintf(known + len, sizeof known - len, "%s%s",
                            i ? " or " : "", kinds[i].scheme);
  KVT_ERR(KVT_EINVAL, "remote_url must start with %s (got '%s')", known,
          url ? url : "(null)");
  return NULL;
}

int kvti_backend_remote_check_url(const char *url) {
  const remote_kind *k = kind_of(url);
  return k ? k->check_url(url) : KVT_EINVAL;
}

int kvti_backend_remote_new(kvti_backend **out, const kvti_remote_cfg *cfg) {
  *out = NULL;
  const remote_kind *k = kind_of(cfg->url);
  if (!k)
    return KVT_EINVAL;
  int rc = k->check_url(cfg->url);
  return rc != 0 ? rc : k->create(out, cfg);
}
