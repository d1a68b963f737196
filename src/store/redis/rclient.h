/*
 * rclient.h - a small Redis / Valkey client (hiredis 0.14's RESP reader, our
 * own plain/TLS transport: transport.h) for the remote tier: ACL users, seed
 * nodes from a URL, standalone or Redis Cluster detected at first contact,
 * routing by hash slot (CRC16 of the key's hash tag) from CLUSTER SLOTS, MOVED
 * (update the slot, refresh the map) and ASK (ASKING + command on the importing
 * node) followed per command, a pool of idle connections per node, and
 * connect/command timeouts on every socket. Every batch passed to kvr_exec must
 * route to ONE slot (the remote tier keeps all keys of an entry under one hash
 * tag), so a batch is one pipeline to one node. Thread-safe: any number of
 * threads may call kvr_exec at once (each takes its own connection).
 */
#ifndef KVT_RCLIENT_H
#define KVT_RCLIENT_H

#include "store/redis/transport.h"
#include "store/redis_url.h"

#include <hiredis/hiredis.h>
#include <stddef.h>
#include <stdint.h>

typedef struct kvr_client kvr_client;

/* One command: up to 8 arguments (binary-safe). */
#define KVR_MAX_ARGS 8
typedef struct kvr_cmd {
  int argc;
  const char *argv[KVR_MAX_ARGS];
  size_t len[KVR_MAX_ARGS];
} kvr_cmd;

/* A seed node (the URL grammar is store/redis_url.h). */
typedef kvti_redis_addr kvr_addr;

/* Creates a client (no connection is made yet: the first command connects and
 * detects cluster mode). timeout_ms bounds connects and each wait of every
 * command. tls: CA / client certificate files for rediss:// (may be NULL;
 * setting files for a redis:// URL is KVT_EINVAL). Certificate files are
 * loaded here: a bad one is KVT_EINVAL now, not at the first command. */
int kvr_client_new(kvr_client **out, const char *url, uint32_t timeout_ms,
                   const kvr_tls_opts *tls);
/* Contacts the store now (the slot map; AUTH and the TLS handshake on the
 * way). Returns 0, KVT_EPERM (credentials or certificates refused: a
 * configuration error), KVT_EIO / KVT_ETIMEDOUT (unreachable: transient). */
int kvr_client_probe(kvr_client *c);
void kvr_client_free(kvr_client *c);

/* Hash slot of a key (CRC16-CCITT of the hash tag, mod 16384). */
unsigned kvr_key_slot(const char *key, size_t len);

/* Runs n commands, all routed by key (whose slot they must share), as one
 * pipeline, following redirections. On 0 every replies[i] is set (a Redis
 * error reply is returned as a reply of type REDIS_REPLY_ERROR); the caller
 * frees them with freeReplyObject. On failure (KVT_EIO: connection lost or
 * refused; KVT_ETIMEDOUT; KVT_ENOMEM) no reply is returned. */
int kvr_exec(kvr_client *c, const char *key, size_t klen, const kvr_cmd *cmds,
             size_t n, redisReply **replies);

/* Calls fn(ctx, reply) with the reply of cmd run on every master once (SCAN
 * loops, INFO). Returns 0 or the first failure. */
typedef int (*kvr_node_fn)(void *ctx, kvr_client *c, int node);
int kvr_foreach_master(kvr_client *c, kvr_node_fn fn, void *ctx);
/* SCAN of one node for the keys matching pattern (tools and the mirror's
 * resync, never the serving path): fn(ctx, key, len) per key returns 0 to
 * go on, > 0 to stop (then 0 is returned) or a negative code (returned). */
typedef int (*kvr_key_fn)(void *ctx, const char *key, size_t len);
int kvr_scan(kvr_client *c, int node, const char *pattern, kvr_key_fn fn,
             void *ctx);
/* Runs one command on a given node (no redirection). */
int kvr_exec_node(kvr_client *c, int node, const kvr_cmd *cmd,
                  redisReply **reply);

/* A connection of its own (not pooled; the caller closes it) to a reachable
 * node, authenticated: for a pub/sub subscriber. */
int kvr_client_dedicated(kvr_client *c, kvr_conn **out);

/* 1 when the server is a cluster (after the first successful contact). */
int kvr_is_cluster(kvr_client *c);
/* 1 when it is known to be a standalone server (after the first contact):
 * then any keys may share one pipeline. */
int kvr_is_standalone(kvr_client *c);

/* Convenience: fills a command from NUL-terminated strings. */
void kvr_cmd_set(kvr_cmd *cmd, int argc, const char *const *argv);

#endif
