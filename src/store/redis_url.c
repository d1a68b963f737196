/*
 * redis_url.c - the remote URL grammar,
 * redis[s]://[[user]:password@]host[:port][,...]
 * (see redis_url.h). Always compiled, with or without hiredis, so option
 * validation gives the same answer in every build and needs no tier code.
 */
#include "store/redis_url.h"
#include "base/error.h"

#include <stdlib.h>
#include <string.h>

int kvti_redis_parse_url(const char *url, kvti_redis_addr *addrs, int max_addrs,
                         int *n_out, kvti_redis_cred *cred) {
  int tls = 0;
  const char *p = NULL;
  if (url && !strncmp(url, "redis://", 8))
    p = url + 8;
  else if (url && !strncmp(url, "rediss://", 9)) {
    p = url + 9;
    tls = 1;
  } else
    return KVT_ERR(KVT_EINVAL,
                   "remote_url must start with redis:// or rediss:// (got "
                   "'%s')",
                   url ? url : "(null)");
  if (cred) {
    memset(cred, 0, sizeof *cred);
    cred->tls = tls;
  }
  /* [user]:password@ (user: a Redis 6 ACL user; none = the default user).
   * The LAST '@' ends the credentials: a password may hold '@'. */
  const char *at = strrchr(p, '@');
  if (at) {
    const char *colon = memchr(p, ':', (size_t)(at - p));
    if (!colon)
      return KVT_ERR(KVT_EINVAL,
                     "remote_url: credentials must be [user]:password@ (got "
                     "'%.*s@')",
                     (int)(at - p), p);
    size_t ul = (size_t)(colon - p), pl = (size_t)(at - colon - 1);
    if (ul >= sizeof cred->user || pl >= sizeof cred->password)
      return KVT_ERR(KVT_EINVAL, "remote_url: user or password too long");
    if (pl == 0)
      return KVT_ERR(KVT_EINVAL, "remote_url: empty password");
    if (cred) {
      memcpy(cred->user, p, ul);
      cred->user[ul] = '\0';
      memcpy(cred->password, colon + 1, pl);
      cred->password[pl] = '\0';
    }
    p = at + 1;
  }
  int count = 0;
  while (*p) {
    const char *end = strchr(p, ',');
    size_t len = end ? (size_t)(end - p) : strlen(p);
    /* strip a trailing "/db" path: only db 0 exists in a cluster */
    const char *slash = memchr(p, '/', len);
    if (slash)
      len = (size_t)(slash - p);
    const char *colon = NULL;
    for (size_t i = 0; i < len; i++)
      if (p[i] == ':')
        colon = p + i;
    size_t hlen = colon ? (size_t)(colon - p) : len;
    if (hlen == 0 || hlen >= sizeof addrs[0].host)
      return KVT_ERR(KVT_EINVAL, "remote_url: bad host in '%s'", url);
    long port = 6379;
    if (colon) {
      char *e = NULL;
      port = strtol(colon + 1, &e, 10);
      if (e != p + len || port < 1 || port > 65535)
        return KVT_ERR(KVT_EINVAL, "remote_url: bad port in '%s'", url);
    }
    if (count >= max_addrs && addrs)
      return KVT_ERR(KVT_EINVAL, "remote_url: more than %d seed nodes",
                     max_addrs);
    if (addrs) {
      memcpy(addrs[count].host, p, hlen);
      addrs[count].host[hlen] = '\0';
      addrs[count].port = (int)port;
    }
    count++;
    if (!end)
      break;
    p = end + 1;
    if (slash && slash < end)
      continue;
  }
  if (count == 0)
    return KVT_ERR(KVT_EINVAL, "remote_url: no host in '%s'", url);
  if (n_out)
    *n_out = count;
  return 0;
}

int kvti_redis_check_url(const char *url) {
  return kvti_redis_parse_url(url, NULL, KVTI_REDIS_MAX_SEEDS, NULL, NULL);
}
