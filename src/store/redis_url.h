/*
 * redis_url.h - parsing and validating the remote tier's URL, below the tier
 * and independent of hiredis: kvt_options validation (tier/options.c) checks
 * remote_url with it in every build, and the Redis client (store/redis/)
 * takes its seed nodes and password from it.
 */
#ifndef KVT_STORE_REDIS_URL_H
#define KVT_STORE_REDIS_URL_H

#include <stddef.h>

/* Most seed nodes a URL may list. */
#define KVTI_REDIS_MAX_SEEDS 16

/* One seed node of a URL. */
typedef struct kvti_redis_addr {
  char host[256];
  int port;
} kvti_redis_addr;

/* Credentials and scheme of a URL: user "" = the default user (AUTH
 * <password>), password "" = no AUTH; tls = 1 for rediss://. */
typedef struct kvti_redis_cred {
  char user[256];
  char password[256];
  int tls;
} kvti_redis_cred;

/* Parses redis[s]://[[user]:password@]host[:port][/db][,host[:port]...]
 * (port 6379 by default; user = a Redis 6 ACL user; the last '@' ends the
 * credentials). Fills up to max_addrs addrs and *n_out, and *cred; addrs,
 * n_out and cred may be NULL. Returns 0 or KVT_EINVAL (message names the
 * problem). No connection made. */
int kvti_redis_parse_url(const char *url, kvti_redis_addr *addrs, int max_addrs,
                         int *n_out, kvti_redis_cred *cred);
/* Validates url as above. 0 or KVT_EINVAL. */
int kvti_redis_check_url(const char *url);

#endif
