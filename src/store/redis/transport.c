/*
 * transport.c - plain TCP and TLS (OpenSSL libssl) connections for the Redis
 * client (see transport.h). Both kinds share the connect, the poll-based waits
 * and hiredis's RESP reader; they differ only in the two functions of their
 * ops table: send bytes (sendmsg for plain TCP: large chunk values go straight
 * from the caller's memory; SSL_write per piece for TLS) and receive bytes.
 * Each returns the bytes moved, 0 when it would block (then the caller polls
 * for what the transport asks: TLS may need to read to write and vice versa),
 * or -1 on failure. Certificate verification is OpenSSL's (chain against the
 * CA file or the system store, then the host name or IP address of the URL).
 */
#include "store/redis/transport.h"
#include "base/error.h"
#include "base/io.h"

#include <errno.h>
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define KVR_RBUF (256u << 10) /* bytes read per receive */

struct kvr_tls {
  SSL_CTX *ctx;
};

typedef struct kvr_ops {
  /* >0 bytes moved, 0 would block (*want = POLLIN/POLLOUT), -1 failed. */
  ssize_t (*send)(kvr_conn *c, const struct iovec *iov, int n, short *want);
  ssize_t (*recv)(kvr_conn *c, char *buf, size_t n, short *want);
} kvr_ops;

struct kvr_conn {
  const kvr_ops *ops;
  int fd;
  SSL *ssl;
  redisReader *rd;
  int broken;
  int tls_alert; /* the TLS layer failed (an alert: e.g. a refused client
                    certificate, which TLS 1.3 reports after the handshake) */
  char peer[300];
  char *buf; /* KVR_RBUF */
};

/* ------------------------------------------------------------------------ */
/* The two transports                                                       */
/* ------------------------------------------------------------------------ */

static ssize_t plain_send(kvr_conn *c, const struct iovec *iov, int n,
                          short *want) {
  for (;;) {
    struct msghdr mh;
    memset(&mh, 0, sizeof mh);
    mh.msg_iov = (struct iovec *)iov;
    mh.msg_iovlen = (size_t)n;
#ifdef MSG_NOSIGNAL
    ssize_t w = sendmsg(c->fd, &mh, MSG_NOSIGNAL);
#else
    ssize_t w = sendmsg(c->fd, &mh, 0); /* SO_NOSIGPIPE is set */
#endif
    if (w >= 0)
      return w;
    if (errno == EINTR)
      continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      *want = POLLOUT;
      return 0;
    }
    return -1;
  }
}

static ssize_t plain_recv(kvr_conn *c, char *buf, size_t n, short *want) {
  for (;;) {
    ssize_t r = read(c->fd, buf, n);
    if (r > 0)
      return r;
    if (r == 0) {
      errno = ECONNRESET;
      return -1;
    }
    if (errno == EINTR)
      continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      *want = POLLIN;
      return 0;
    }
    return -1;
  }
}

/* 0 and *want for a retry, -1 for a failure. */
static ssize_t tls_retry(kvr_conn *c, int r, short *want) {
  switch (SSL_get_error(c->ssl, r)) {
  case SSL_ERROR_WANT_READ:
    *want = POLLIN;
    return 0;
  case SSL_ERROR_WANT_WRITE:
    *want = POLLOUT;
    return 0;
  case SSL_ERROR_ZERO_RETURN:
    errno = ECONNRESET;
    return -1;
  case SSL_ERROR_SSL:
    c->tls_alert = 1;
    errno = EPROTO;
    return -1;
  default:
    if (errno == 0)
      errno = EPROTO;
    return -1;
  }
}

static ssize_t tls_send(kvr_conn *c, const struct iovec *iov, int n,
                        short *want) {
  (void)n; /* TLS records are per write: one piece at a time */
  size_t len = iov[0].iov_len > (1u << 30) ? (1u << 30) : iov[0].iov_len;
  ERR_clear_error();
  errno = 0;
  int r = SSL_write(c->ssl, iov[0].iov_base, (int)len);
  if (r > 0)
    return r;
  return tls_retry(c, r, want);
}

static ssize_t tls_recv(kvr_conn *c, char *buf, size_t n, short *want) {
  ERR_clear_error();
  errno = 0;
  int r = SSL_read(c->ssl, buf, (int)(n > (1u << 30) ? (1u << 30) : n));
  if (r > 0)
    return r;
  return tls_retry(c, r, want);
}

static const kvr_ops plain_ops = {plain_send, plain_recv};
static const kvr_ops tls_ops = {tls_send, tls_recv};

/* ------------------------------------------------------------------------ */
/* TLS context                                                              */
/* ------------------------------------------------------------------------ */

static const char *ssl_reason(void) {
  static _Thread_local char b[256];
  unsigned long e = ERR_peek_last_error();
  if (!e)
    return "no detail";
  ERR_error_string_n(e, b, sizeof b);
  return b;
}

int kvr_tls_new(kvr_tls **out, const kvr_tls_opts *o) {
  kvr_tls *t = kvti_calloc(1, sizeof *t);
  if (!t)
    return KVT_ERR_NOMEM();
  ERR_clear_error();
  t->ctx = SSL_CTX_new(TLS_client_method());
  if (!t->ctx) {
    kvti_free(t);
    return KVT_ERR_NOMEM();
  }
  SSL_CTX_set_min_proto_version(t->ctx, TLS1_2_VERSION);
  SSL_CTX_set_verify(t->ctx, SSL_VERIFY_PEER, NULL);
  SSL_CTX_set_mode(t->ctx, SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER |
                               SSL_MODE_ENABLE_PARTIAL_WRITE);
  int rc = 0;
  if (o && o->ca_file) {
    if (SSL_CTX_load_verify_locations(t->ctx, o->ca_file, NULL) != 1)
      rc = KVT_ERR(KVT_EINVAL, "remote TLS: cannot load CA file %s: %s",
                   o->ca_file, ssl_reason());
  } else if (SSL_CTX_set_default_verify_paths(t->ctx) != 1) {
    rc = KVT_ERR(KVT_EINVAL, "remote TLS: no system trust store: %s",
                 ssl_reason());
  }
  if (rc == 0 && o && (o->cert_file || o->key_file)) {
    if (!o->cert_file || !o->key_file)
      rc = KVT_ERR(KVT_EINVAL, "remote TLS: a client certificate needs both "
                               "remote_tls_cert_file and remote_tls_key_file");
    else if (SSL_CTX_use_certificate_chain_file(t->ctx, o->cert_file) != 1)
      rc = KVT_ERR(KVT_EINVAL, "remote TLS: cannot load certificate %s: %s",
                   o->cert_file, ssl_reason());
    else if (SSL_CTX_use_PrivateKey_file(t->ctx, o->key_file,
                                         SSL_FILETYPE_PEM) != 1)
      rc = KVT_ERR(KVT_EINVAL, "remote TLS: cannot load key %s: %s",
                   o->key_file, ssl_reason());
    else if (SSL_CTX_check_private_key(t->ctx) != 1)
      rc = KVT_ERR(KVT_EINVAL,
                   "remote TLS: key %s does not match certificate %s",
                   o->key_file, o->cert_file);
  }
  if (rc != 0) {
    kvr_tls_free(t);
    return rc;
  }
  *out = t;
  return 0;
}

void kvr_tls_free(kvr_tls *t) {
  if (!t)
    return;
  SSL_CTX_free(t->ctx);
  kvti_free(t);
}

/* ------------------------------------------------------------------------ */
/* Waiting                                                                  */
/* ------------------------------------------------------------------------ */

int64_t kvr_deadline(uint32_t timeout_ms) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000 + (int64_t)timeout_ms;
}

uint32_t kvr_ms_left(int64_t dl) {
  int64_t l = dl - kvr_deadline(0);
  return l <= 0 ? 0 : l > INT32_MAX ? (uint32_t)INT32_MAX : (uint32_t)l;
}

/* Waits until fd is ready for ev or the deadline dl (kvr_deadline) passes: the
 * time left is recomputed at every wait, so a peer that sends (or accepts) a
 * byte at a time cannot stretch one call past its timeout. 0, KVT_ETIMEDOUT,
 * KVT_EIO. */
static int wait_fd(kvr_conn *c, short ev, int64_t dl) {
  struct pollfd p = {c->fd, ev, 0};
  for (;;) {
    uint32_t left = kvr_ms_left(dl);
    if (left == 0)
      return KVT_ETIMEDOUT;
    int r = poll(&p, 1, (int)left);
    if (r > 0)
      return 0; /* readable/writable or an error the next call reports */
    if (r == 0)
      return KVT_ETIMEDOUT;
    if (errno != EINTR)
      return KVT_ERR_OS(errno, "poll %s", c->peer);
  }
}

static int fail(kvr_conn *c, int rc, const char *what) {
  c->broken = 1;
  if (rc == KVT_ETIMEDOUT)
    return KVT_ERR(KVT_ETIMEDOUT, "redis %s: %s timed out", c->peer, what);
  if (rc == KVT_ENOMEM)
    return KVT_ERR_NOMEM();
  if (c->tls_alert)
    return KVT_ERR(KVT_EPERM, "redis %s: %s: TLS refused: %s", c->peer, what,
                   ssl_reason());
  int e = errno;
  return KVT_ERR(KVT_EIO, "redis %s: %s: %s", c->peer, what,
                 c->ssl && ERR_peek_last_error() ? ssl_reason()
                 : e                             ? strerror(e)
                                                 : "connection lost");
}

/* ------------------------------------------------------------------------ */
/* Connect                                                                  */
/* ------------------------------------------------------------------------ */

static int tcp_connect(kvr_conn *c, const char *host, int port, int64_t dl) {
  char ps[16];
  snprintf(ps, sizeof ps, "%d", port);
  struct addrinfo hints, *res = NULL;
  memset(&hints, 0, sizeof hints);
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  int g = getaddrinfo(host, ps, &hints, &res);
  if (g != 0)
    return KVT_ERR(KVT_EIO, "redis %s: cannot resolve: %s", c->peer,
                   gai_strerror(g));
  int rc = KVT_ERR(KVT_EIO, "redis %s: no address", c->peer);
  for (struct addrinfo *a = res; a; a = a->ai_next) {
    int fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd < 0) {
      rc = KVT_ERR_OS(errno, "redis %s: socket", c->peer);
      continue;
    }
    fcntl(fd, F_SETFD, FD_CLOEXEC);
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
#ifdef SO_NOSIGPIPE
    setsockopt(fd, SOL_SOCKET, SO_NOSIGPIPE, &one, sizeof one);
#endif
    c->fd = fd;
    int r = connect(fd, a->ai_addr, a->ai_addrlen);
    if (r != 0 && errno == EINPROGRESS) {
      int w = wait_fd(c, POLLOUT, dl);
      if (w == 0) {
        int err = 0;
        socklen_t el = sizeof err;
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el);
        errno = err;
        r = err ? -1 : 0;
      } else {
        errno = ETIMEDOUT;
        r = -1;
      }
    }
    if (r == 0) {
      rc = 0;
      break;
    }
    rc = errno == ETIMEDOUT
             ? KVT_ERR(KVT_ETIMEDOUT, "redis %s: connect timed out", c->peer)
             : KVT_ERR(KVT_EIO, "redis %s: connect: %s", c->peer,
                       strerror(errno));
    close(fd);
    c->fd = -1;
  }
  freeaddrinfo(res);
  return rc;
}

/* TLS 1.3 ends the client's handshake before the server has checked the
 * client's certificate: a refusal arrives as an alert afterwards, where it
 * would race with the first command (whose write may fail first, hiding it).
 * So wait briefly for what the server sends right after the handshake - its
 * session tickets, or that alert - and read it now: a refused certificate is
 * then a clear KVT_EPERM at connect. Bounded (100 ms at most): a server that
 * sends nothing costs that once per new connection. */
static int tls13_settle(kvr_conn *c, int64_t dl) {
  if (SSL_version(c->ssl) != TLS1_3_VERSION)
    return 0;
  int64_t soon = kvr_deadline(100);
  if (wait_fd(c, POLLIN, soon < dl ? soon : dl) != 0)
    return 0;
  char b[1];
  ERR_clear_error();
  int r = SSL_peek(c->ssl, b, 1);
  if (r > 0)
    return 0;
  int e = SSL_get_error(c->ssl, r);
  if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE)
    return 0;
  if (e == SSL_ERROR_SSL)
    return KVT_ERR(KVT_EPERM, "redis %s: TLS refused by the server: %s",
                   c->peer, ssl_reason());
  return KVT_ERR(KVT_EIO, "redis %s: TLS: connection closed by the server",
                 c->peer);
}

static int tls_handshake(kvr_conn *c, kvr_tls *tls, const char *host,
                         int64_t dl) {
  ERR_clear_error();
  c->ssl = SSL_new(tls->ctx);
  if (!c->ssl || SSL_set_fd(c->ssl, c->fd) != 1)
    return KVT_ERR_NOMEM();
  /* Verify the name the URL gave: an IP address against the certificate's
   * IP SANs, a host name against its DNS names (and sent as SNI). */
  X509_VERIFY_PARAM *vp = SSL_get0_param(c->ssl);
  struct in6_addr tmp;
  int is_ip = inet_pton(AF_INET, host, &tmp) == 1 ||
              inet_pton(AF_INET6, host, &tmp) == 1;
  if (is_ip)
    X509_VERIFY_PARAM_set1_ip_asc(vp, host);
  else {
    X509_VERIFY_PARAM_set1_host(vp, host, 0);
    SSL_set_tlsext_host_name(c->ssl, host);
  }
  for (;;) {
    errno = 0;
    int r = SSL_connect(c->ssl);
    if (r == 1)
      return tls13_settle(c, dl);
    int e = SSL_get_error(c->ssl, r);
    short want = e == SSL_ERROR_WANT_READ    ? POLLIN
                 : e == SSL_ERROR_WANT_WRITE ? POLLOUT
                                             : 0;
    if (want) {
      int w = wait_fd(c, want, dl);
      if (w == KVT_ETIMEDOUT)
        return KVT_ERR(KVT_ETIMEDOUT, "redis %s: TLS handshake timed out",
                       c->peer);
      if (w != 0)
        return w;
      continue;
    }
    long vr = SSL_get_verify_result(c->ssl);
    if (vr != X509_V_OK)
      return KVT_ERR(KVT_EPERM,
                     "redis %s: TLS: the server's certificate was refused: %s",
                     c->peer, X509_verify_cert_error_string(vr));
    if (e == SSL_ERROR_SSL)
      return KVT_ERR(KVT_EPERM, "redis %s: TLS handshake refused: %s", c->peer,
                     ssl_reason());
    return KVT_ERR(KVT_EIO, "redis %s: TLS handshake: %s", c->peer,
                   errno ? strerror(errno) : "connection closed by the server");
  }
}

int kvr_conn_open(kvr_conn **out, const char *host, int port, kvr_tls *tls,
                  uint32_t timeout_ms) {
  int64_t dl = kvr_deadline(timeout_ms); /* connect and handshake together */
  kvr_conn *c = kvti_calloc(1, sizeof *c);
  if (!c)
    return KVT_ERR_NOMEM();
  c->fd = -1;
  c->ops = tls ? &tls_ops : &plain_ops;
  snprintf(c->peer, sizeof c->peer, "%s:%d", host, port);
  c->rd = redisReaderCreate();
  c->buf = kvti_malloc(KVR_RBUF);
  int rc = (!c->rd || !c->buf) ? KVT_ERR_NOMEM() : 0;
  if (rc == 0)
    rc = tcp_connect(c, host, port, dl);
  if (rc == 0 && tls)
    rc = tls_handshake(c, tls, host, dl);
  if (rc != 0) {
    kvr_conn_close(c);
    return rc;
  }
  *out = c;
  return 0;
}

void kvr_conn_close(kvr_conn *c) {
  if (!c)
    return;
  if (c->ssl) {
    if (!c->broken)
      SSL_shutdown(c->ssl); /* best effort, non-blocking */
    SSL_free(c->ssl);
  }
  if (c->fd >= 0)
    close(c->fd);
  if (c->rd)
    redisReaderFree(c->rd);
  kvti_free(c->buf);
  kvti_free(c);
}

int kvr_conn_broken(const kvr_conn *c) {
  return c->broken;
}

const char *kvr_conn_peer(const kvr_conn *c) {
  return c->peer;
}

/* ------------------------------------------------------------------------ */
/* I/O                                                                      */
/* ------------------------------------------------------------------------ */

static int writev_by(kvr_conn *c, const struct iovec *iov_in, int n,
                     int64_t dl) {
  if (c->broken)
    return KVT_ERR(KVT_EIO, "redis %s: connection already failed", c->peer);
  struct iovec iov[64];
  int i = 0;
  size_t done = 0; /* bytes of iov_in[i] sent */
  while (i < n) {
    int k = 0;
    for (int j = i; j < n && k < 64; j++, k++) {
      iov[k].iov_base = (char *)iov_in[j].iov_base + (j == i ? done : 0);
      iov[k].iov_len = iov_in[j].iov_len - (j == i ? done : 0);
    }
    short want = 0;
    ssize_t w = c->ops->send(c, iov, k, &want);
    if (w < 0)
      return fail(c, KVT_EIO, "send");
    if (w == 0) {
      int rc = wait_fd(c, want, dl);
      if (rc != 0)
        return fail(c, rc, "send");
      continue;
    }
    size_t left = (size_t)w;
    while (left > 0 && i < n) {
      size_t rem = iov_in[i].iov_len - done;
      if (left >= rem) {
        left -= rem;
        i++;
        done = 0;
      } else {
        done += left;
        left = 0;
      }
    }
    while (i < n && iov_in[i].iov_len == 0)
      i++;
  }
  return 0;
}

int kvr_conn_writev(kvr_conn *c, const struct iovec *iov, int n,
                    uint32_t timeout_ms) {
  return writev_by(c, iov, n, kvr_deadline(timeout_ms));
}

static int reply_by(kvr_conn *c, redisReply **out, int64_t dl,
                    int keep_on_timeout) {
  *out = NULL;
  if (c->broken)
    return KVT_ERR(KVT_EIO, "redis %s: connection already failed", c->peer);
  int got_bytes = 0;
  for (;;) {
    void *r = NULL;
    if (redisReaderGetReply(c->rd, &r) != REDIS_OK) {
      c->broken = 1;
      return KVT_ERR(KVT_EIO, "redis %s: protocol error: %s", c->peer,
                     c->rd->errstr);
    }
    if (r) {
      *out = r;
      return 0;
    }
    short want = 0;
    ssize_t k = c->ops->recv(c, c->buf, KVR_RBUF, &want);
    if (k < 0)
      return fail(c, KVT_EIO, "receive");
    if (k == 0) {
      int rc = wait_fd(c, want, dl);
      if (rc == KVT_ETIMEDOUT && keep_on_timeout && !got_bytes &&
          c->rd->len == c->rd->pos)
        return KVT_ETIMEDOUT; /* idle: the connection stays usable */
      if (rc != 0)
        return fail(c, rc, "receive");
      continue;
    }
    got_bytes = 1;
    if (redisReaderFeed(c->rd, c->buf, (size_t)k) != REDIS_OK) {
      c->broken = 1;
      return KVT_ERR_NOMEM();
    }
  }
}

int kvr_conn_reply(kvr_conn *c, redisReply **out, uint32_t timeout_ms,
                   int keep_on_timeout) {
  return reply_by(c, out, kvr_deadline(timeout_ms), keep_on_timeout);
}

int kvr_conn_call(kvr_conn *c, redisReply **out, int argc,
                  const char *const *argv, const size_t *len,
                  uint32_t timeout_ms) {
  int64_t dl = kvr_deadline(timeout_ms); /* the send and the reply together */
  char *cmd = NULL;
  int n = redisFormatCommandArgv(&cmd, argc, (const char **)argv, len);
  if (n < 0 || !cmd)
    return KVT_ERR_NOMEM();
  struct iovec v = {cmd, (size_t)n};
  int rc = writev_by(c, &v, 1, dl);
  free(cmd); /* hiredis allocates with malloc */
  if (rc != 0)
    return rc;
  return reply_by(c, out, dl, 0);
}

int kvr_conn_wait_input(kvr_conn *c, int wake_fd, uint32_t timeout_ms) {
  if (c->rd->len > c->rd->pos || (c->ssl && SSL_pending(c->ssl) > 0))
    return 1;
  struct pollfd p[2] = {{c->fd, POLLIN, 0}, {wake_fd, POLLIN, 0}};
  int64_t dl = kvr_deadline(timeout_ms);
  for (;;) {
    int r = poll(p, wake_fd >= 0 ? 2 : 1, (int)kvr_ms_left(dl));
    if (r < 0 && errno == EINTR)
      continue; /* resumes with the time left, not a fresh timeout */
    if (r <= 0)
      return 0;
    if (wake_fd >= 0 && p[1].revents)
      return 2;
    return 1; /* readable, or hung up: the read reports which */
  }
}
