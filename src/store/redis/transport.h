/*
 * transport.h - one connection of the Redis client (rclient.c), plain TCP or
 * TLS over OpenSSL's libssl, behind one small table of functions (connect,
 * write a gather list, read, wait) so rclient.c neither knows nor cares which
 * it talks through. Debian 12's hiredis 0.14 has no TLS, so hiredis is used
 * only for what it does well: its RESP reader (redisReader) parses the bytes
 * this layer receives. Sockets are non-blocking; every wait is a poll(2) for
 * the time left before one deadline per call: timeout_ms bounds the whole of a
 * kvr_conn_* call (every wait in it together), so neither a silent server nor
 * one dribbling a byte at a time holds a thread past it. rclient.c passes the
 * time left of its own per-command deadline (kvr_deadline / kvr_ms_left). A
 * connection that failed once is marked broken and must be closed (never
 * reused). Not thread-safe: one thread uses a connection at a time (the
 * client's pool hands it out).
 */
#ifndef KVT_REDIS_TRANSPORT_H
#define KVT_REDIS_TRANSPORT_H

#include <hiredis/hiredis.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

typedef struct kvr_conn kvr_conn;

/* Monotonic deadline timeout_ms from now, in ms (arbitrary origin). */
int64_t kvr_deadline(uint32_t timeout_ms);
/* Milliseconds left before deadline dl; 0 once it passed (a transport call
 * given 0 fails with KVT_ETIMEDOUT as soon as it would have to wait). */
uint32_t kvr_ms_left(int64_t dl);
typedef struct kvr_tls kvr_tls;

/* TLS settings (rediss:// URLs). ca_file NULL = the system's default trust
 * store; cert_file/key_file NULL = no client certificate. */
typedef struct kvr_tls_opts {
  const char *ca_file;
  const char *cert_file;
  const char *key_file;
} kvr_tls_opts;

/* Builds a TLS context (certificates loaded now, so a missing or bad file is a
 * clear error before any connection). Returns 0, KVT_EINVAL (files),
 * KVT_ENOMEM. */
int kvr_tls_new(kvr_tls **out, const kvr_tls_opts *o);
void kvr_tls_free(kvr_tls *t);

/* Connects to host:port within timeout_ms in all (TCP, then the TLS handshake
 * when tls is not NULL; the server's certificate is verified against the trust
 * store and host name / IP address). Returns 0, KVT_EIO / KVT_ETIMEDOUT
 * (unreachable: transient), KVT_EPERM (TLS handshake or certificate refused:
 * a configuration error), KVT_ENOMEM. */
int kvr_conn_open(kvr_conn **out, const char *host, int port, kvr_tls *tls,
                  uint32_t timeout_ms);
void kvr_conn_close(kvr_conn *c);
/* 1 once the connection failed (it must then be closed, not reused). */
int kvr_conn_broken(const kvr_conn *c);
/* Writes all of iov within timeout_ms (in all, not per wait). Returns
 * 0, KVT_EIO, KVT_ETIMEDOUT (the connection is then broken). */
int kvr_conn_writev(kvr_conn *c, const struct iovec *iov, int n,
                    uint32_t timeout_ms);
/* Next reply (parsed by hiredis's reader; free with freeReplyObject), all of it
 * within timeout_ms. Returns 0, KVT_EIO (lost, protocol error), KVT_ETIMEDOUT
 * (not complete within timeout_ms:
 * broken unless keep_on_timeout, for a subscriber's idle poll, where a timeout
 * with no byte received leaves the connection usable), KVT_ENOMEM. */
int kvr_conn_reply(kvr_conn *c, redisReply **out, uint32_t timeout_ms,
                   int keep_on_timeout);
/* Formats and sends one command (binary-safe arguments) and reads its reply:
 * for the few small commands of connection setup (AUTH, CLUSTER SLOTS); both
 * within timeout_ms together. */
int kvr_conn_call(kvr_conn *c, redisReply **out, int argc,
                  const char *const *argv, const size_t *len,
                  uint32_t timeout_ms);
/* For a subscriber: waits until c has input (bytes in the socket, or already
 * received and not yet parsed) or wake_fd (-1: none) is readable. Returns 1
 * (c has input: kvr_conn_reply then reads it), 2 (woken), 0 (timeout). */
int kvr_conn_wait_input(kvr_conn *c, int wake_fd, uint32_t timeout_ms);
/* host:port for messages. */
const char *kvr_conn_peer(const kvr_conn *c);

#endif
