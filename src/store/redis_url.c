/*
 * redis_url.c - the remote URL grammar, redis://[:password@]host[:port][,...]
 * (see redis_url.h). Always compiled, with or without hiredis, so option
 * validation gives the same answer in every build and needs no tier code.
 */
#include "store/redis_url.h"
#include "base/error.h"

#include <stdlib.h>
#include <string.h>

int kvti_redis_parse_url(const char *url, kvti_redis_addr *addrs, int max_addrs,
                         int *n_out, char *password, size_t pw_cap) {
  if (!url || strncmp(url, "redis://", 8) != 0)
    return KVT_ERR(KVT_EINVAL, "remote_url must start with redis:// (got '%s')",
                   url ? url : "(null)");
  const char *p = url + 8;
  const char *at = strchr(p, '@');
  if (password && pw_cap)
    password[0] = '\0';
  if (at) {
    const char *pw = p;
    if (*pw == ':')
      pw++;
    else {
      /* user:password@ - Redis 6 ACL users are not supported: only the
       * default user. */
      const char *colon = memchr(p, ':', (size_t)(at - p));
      if (!colon)
        return KVT_ERR(KVT_EINVAL,
                       "remote_url: credentials must be "
                       ":password@ (got '%.*s@')",
                       (int)(at - p), p);
      pw = colon + 1;
    }
    size_t n = (size_t)(at - pw);
    if (password) {
      if (n >= pw_cap)
        return KVT_ERR(KVT_EINVAL, "remote_url: password too long");
      memcpy(password, pw, n);
      password[n] = '\0';
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
  return kvti_redis_parse_url(url, NULL, KVTI_REDIS_MAX_SEEDS, NULL, NULL, 0);
}
