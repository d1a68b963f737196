/*
 * rclient.c - the cluster-aware Redis client of the remote tier (see
 * rclient.h); connections (plain TCP or TLS) are transport.c's. The slot map
 * (16384 entries, node indexes) and the node table live under one mutex; nodes
 * are never freed before the client, so a node pointer taken under the lock
 * stays valid. A batch goes to the slot's owner as one pipeline; replies
 * MOVED/ASK/TRYAGAIN/CLUSTERDOWN are not returned but followed: MOVED updates
 * the slot and marks the map for a refresh from CLUSTER SLOTS, ASK resends just
 * those commands to the importing node, each preceded by ASKING. A connection
 * that failed is dropped (never reused); the next command reconnects. Bounded:
 * at most KVR_MAX_ROUNDS redirections per batch.
 *
 * Deadlines: every public call (one batch, one node command, one slot-map
 * refresh, one probe, one dedicated connection) gets one deadline, timeout_ms
 * from its start, that covers all of it - connects, TLS handshakes, AUTH,
 * CLUSTER SLOTS, sends, every reply byte, redirections and the retry after a
 * failure. Each transport call is given only the time left (transport.c polls
 * against it at every wait), so a server dribbling a reply a byte at a time
 * cannot hold a call past timeout_ms; running out is KVT_ETIMEDOUT, which the
 * remote tier counts as a failure and backs off on.
 */
#include "store/redis/rclient.h"
#include "base/strbuf.h"
#include "base/vec.h"
#include "base/error.h"
#include "store/redis/transport.h"
#include "base/io.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <time.h>

#define KVR_MAX_NODES 64
#define KVR_MAX_IDLE 8
#define KVR_MAX_ROUNDS 8
#define KVR_SLOTS 16384

typedef struct kvr_node {
  kvr_addr addr;
  pthread_mutex_t mu;
  kvr_conn *idle[KVR_MAX_IDLE];
  int n_idle;
} kvr_node;

struct kvr_client {
  pthread_mutex_t mu; /* nodes, n_nodes, slots, mode, need_refresh */
  kvr_node *nodes[KVR_MAX_NODES];
  int n_nodes;
  int16_t slots[KVR_SLOTS]; /* node index, -1 unknown */
  int mode;                 /* 0 unknown, 1 standalone, 2 cluster */
  int need_refresh;
  int refresh_soon; /* a MOVED was followed: refresh before the next batch */
  char user[256];
  char password[256];
  uint32_t timeout_ms; /* the whole of one call (see the deadlines above) */
  kvr_tls *tls;        /* NULL: plain TCP (redis://) */
};

/* ------------------------------------------------------------------------ */
/* Slots                                                                    */
/* ------------------------------------------------------------------------ */

static uint16_t crc16(const char *buf, size_t len) {
  /* CRC16-CCITT (XMODEM), polynomial 0x1021, as Redis Cluster specifies. */
  uint16_t crc = 0;
  for (size_t i = 0; i < len; i++) {
    crc ^= (uint16_t)((uint8_t)buf[i] << 8);
    for (int b = 0; b < 8; b++)
      crc = (crc & 0x8000) ? (uint16_t)((crc << 1) ^ 0x1021)
                           : (uint16_t)(crc << 1);
  }
  return crc;
}

unsigned kvr_key_slot(const char *key, size_t len) {
  size_t s, e;
  for (s = 0; s < len; s++)
    if (key[s] == '{')
      break;
  if (s < len) {
    for (e = s + 1; e < len; e++)
      if (key[e] == '}')
        break;
    if (e < len && e != s + 1)
      return crc16(key + s + 1, e - s - 1) & (KVR_SLOTS - 1);
  }
  return crc16(key, len) & (KVR_SLOTS - 1);
}

void kvr_cmd_set(kvr_cmd *cmd, int argc, const char *const *argv) {
  cmd->argc = argc;
  for (int i = 0; i < argc; i++) {
    cmd->argv[i] = argv[i];
    cmd->len[i] = strlen(argv[i]);
  }
}

/* ------------------------------------------------------------------------ */
/* Nodes and connections                                                    */
/* ------------------------------------------------------------------------ */

/* Index of host:port, adding it. Caller holds c->mu. -1 when the table is full.
 */
static int node_index_locked(kvr_client *c, const char *host, int port) {
  for (int i = 0; i < c->n_nodes; i++)
    if (c->nodes[i]->addr.port == port && !strcmp(c->nodes[i]->addr.host, host))
      return i;
  if (c->n_nodes >= KVR_MAX_NODES)
    return -1;
  kvr_node *n = kvti_calloc(1, sizeof *n);
  if (!n)
    return -1;
  snprintf(n->addr.host, sizeof n->addr.host, "%s", host);
  n->addr.port = port;
  pthread_mutex_init(&n->mu, NULL);
  c->nodes[c->n_nodes] = n;
  return c->n_nodes++;
}

static kvr_node *node_at(kvr_client *c, int i) {
  pthread_mutex_lock(&c->mu);
  kvr_node *n = (i >= 0 && i < c->n_nodes) ? c->nodes[i] : NULL;
  pthread_mutex_unlock(&c->mu);
  return n;
}

/* A reply that refuses the client's credentials or rights. */
static int auth_refused(const redisReply *r) {
  return r && r->type == REDIS_REPLY_ERROR &&
         (!strncmp(r->str, "WRONGPASS", 9) || !strncmp(r->str, "NOAUTH", 6) ||
          !strncmp(r->str, "NOPERM", 6) ||
          strstr(r->str, "invalid password") != NULL);
}

/* A connection to n (an idle one, or a new one: connect, handshake and AUTH
 * before dl). */
static int conn_take(kvr_conn **out, kvr_client *c, kvr_node *n, int64_t dl) {
  pthread_mutex_lock(&n->mu);
  kvr_conn *cn = n->n_idle > 0 ? n->idle[--n->n_idle] : NULL;
  pthread_mutex_unlock(&n->mu);
  if (cn) {
    *out = cn;
    return 0;
  }
  int rc =
      kvr_conn_open(&cn, n->addr.host, n->addr.port, c->tls, kvr_ms_left(dl));
  if (rc != 0)
    return rc;
  if (c->password[0]) {
    const char *argv[3] = {"AUTH", c->user, c->password};
    size_t len[3] = {4, strlen(c->user), strlen(c->password)};
    redisReply *r = NULL;
    /* no user: AUTH <password> (the default user, Redis < 6 too) */
    rc = c->user[0]
             ? kvr_conn_call(cn, &r, 3, argv, len, kvr_ms_left(dl))
             : kvr_conn_call(cn, &r, 2, (const char *const[]){argv[0], argv[2]},
                             (const size_t[]){len[0], len[2]}, kvr_ms_left(dl));
    if (rc == 0 && r->type == REDIS_REPLY_ERROR)
      rc = KVT_ERR(KVT_EPERM, "redis %s:%d: AUTH%s%s refused: %s", n->addr.host,
                   n->addr.port, c->user[0] ? " as " : "", c->user, r->str);
    if (r)
      freeReplyObject(r);
    if (rc != 0) {
      kvr_conn_close(cn);
      return rc;
    }
  }
  *out = cn;
  return 0;
}

static void conn_give(kvr_node *n, kvr_conn *cn) {
  if (kvr_conn_broken(cn)) {
    kvr_conn_close(cn);
    return;
  }
  pthread_mutex_lock(&n->mu);
  if (n->n_idle < KVR_MAX_IDLE) {
    n->idle[n->n_idle++] = cn;
    cn = NULL;
  }
  pthread_mutex_unlock(&n->mu);
  if (cn)
    kvr_conn_close(cn);
}

/* Drops every idle connection of n (after a failure: they are likely dead). */
static void node_drop_idle(kvr_node *n) {
  pthread_mutex_lock(&n->mu);
  while (n->n_idle > 0)
    kvr_conn_close(n->idle[--n->n_idle]);
  pthread_mutex_unlock(&n->mu);
}

int kvr_client_new(kvr_client **out, const char *url, uint32_t timeout_ms,
                   const kvr_tls_opts *tls) {
  kvr_addr seeds[KVTI_REDIS_MAX_SEEDS];
  int n = 0;
  kvti_redis_cred cred;
  int rc = kvti_redis_parse_url(url, seeds, KVTI_REDIS_MAX_SEEDS, &n, &cred);
  if (rc != 0)
    return rc;
  if (!cred.tls && tls && (tls->ca_file || tls->cert_file || tls->key_file))
    return KVT_ERR(KVT_EINVAL, "remote TLS files are set but remote_url is "
                               "not rediss://");
  kvr_client *c = kvti_calloc(1, sizeof *c);
  if (!c)
    return KVT_ERR_NOMEM();
  pthread_mutex_init(&c->mu, NULL);
  snprintf(c->user, sizeof c->user, "%s", cred.user);
  snprintf(c->password, sizeof c->password, "%s", cred.password);
  c->timeout_ms = timeout_ms ? timeout_ms : 1;
  if (cred.tls && (rc = kvr_tls_new(&c->tls, tls)) != 0) {
    kvr_client_free(c);
    return rc;
  }
  for (int i = 0; i < KVR_SLOTS; i++)
    c->slots[i] = -1;
  for (int i = 0; i < n; i++) {
    if (node_index_locked(c, seeds[i].host, seeds[i].port) < 0) {
      kvr_client_free(c);
      return KVT_ERR_NOMEM();
    }
  }
  c->need_refresh = 1;
  *out = c;
  return 0;
}

void kvr_client_free(kvr_client *c) {
  if (!c)
    return;
  for (int i = 0; i < c->n_nodes; i++) {
    node_drop_idle(c->nodes[i]);
    pthread_mutex_destroy(&c->nodes[i]->mu);
    kvti_free(c->nodes[i]);
  }
  kvr_tls_free(c->tls);
  pthread_mutex_destroy(&c->mu);
  kvti_free(c);
}

int kvr_is_cluster(kvr_client *c) {
  pthread_mutex_lock(&c->mu);
  int r = c->mode == 2;
  pthread_mutex_unlock(&c->mu);
  return r;
}

int kvr_is_standalone(kvr_client *c) {
  pthread_mutex_lock(&c->mu);
  int r = c->mode == 1;
  pthread_mutex_unlock(&c->mu);
  return r;
}

/* ------------------------------------------------------------------------ */
/* The slot map                                                             */
/* ------------------------------------------------------------------------ */

/* Applies a CLUSTER SLOTS reply; host_fallback for entries with an empty IP.
 */
static void apply_slots_locked(kvr_client *c, const redisReply *r,
                               const char *host_fallback) {
  for (int i = 0; i < KVR_SLOTS; i++)
    c->slots[i] = -1;
  for (size_t i = 0; i < r->elements; i++) {
    const redisReply *e = r->element[i];
    if (e->type != REDIS_REPLY_ARRAY || e->elements < 3 ||
        e->element[0]->type != REDIS_REPLY_INTEGER ||
        e->element[1]->type != REDIS_REPLY_INTEGER ||
        e->element[2]->type != REDIS_REPLY_ARRAY || e->element[2]->elements < 2)
      continue;
    const redisReply *m = e->element[2];
    if (m->element[0]->type != REDIS_REPLY_STRING ||
        m->element[1]->type != REDIS_REPLY_INTEGER)
      continue;
    const char *host = m->element[0]->len ? m->element[0]->str : host_fallback;
    int ni = node_index_locked(c, host, (int)m->element[1]->integer);
    if (ni < 0)
      continue;
    long long lo = e->element[0]->integer, hi = e->element[1]->integer;
    for (long long s = lo; s <= hi && s < KVR_SLOTS; s++)
      if (s >= 0)
        c->slots[s] = (int16_t)ni;
  }
}

/* Contacts known nodes until one answers CLUSTER SLOTS (or says cluster support
 * is disabled: standalone), all before dl. Returns 0 or the last connection
 * error; KVT_ETIMEDOUT as soon as dl passes (no time for another node). */
static int refresh(kvr_client *c, int64_t dl) {
  pthread_mutex_lock(&c->mu);
  int n = c->n_nodes;
  pthread_mutex_unlock(&c->mu);
  int rc = KVT_ERR(KVT_EIO, "redis: no node reachable");
  int perm = 0;
  char perm_msg[512] = "";
  for (int i = 0; i < n; i++) {
    kvr_node *node = node_at(c, i);
    kvr_conn *ctx = NULL;
    if ((rc = conn_take(&ctx, c, node, dl)) != 0) {
      if (rc == KVT_EPERM) { /* credentials or certificate refused */
        perm = rc;
        snprintf(perm_msg, sizeof perm_msg, "%s", kvt_last_error());
      }
      if (rc == KVT_ETIMEDOUT)
        break;
      continue;
    }
    static const char *const argv[2] = {"CLUSTER", "SLOTS"};
    static const size_t len[2] = {7, 5};
    redisReply *r = NULL;
    if ((rc = kvr_conn_call(ctx, &r, 2, argv, len, kvr_ms_left(dl))) != 0) {
      if (rc == KVT_EPERM) {
        perm = rc;
        snprintf(perm_msg, sizeof perm_msg, "%s", kvt_last_error());
      }
      kvr_conn_close(ctx);
      node_drop_idle(node);
      if (rc == KVT_ETIMEDOUT)
        break;
      continue;
    }
    if (auth_refused(r)) {
      perm = rc = KVT_ERR(
          KVT_EPERM, "redis %s:%d: %s%s", node->addr.host, node->addr.port,
          r->str, c->password[0] ? "" : " (remote_url has no credentials)");
      snprintf(perm_msg, sizeof perm_msg, "%s", kvt_last_error());
      freeReplyObject(r);
      conn_give(node, ctx);
      continue;
    }
    pthread_mutex_lock(&c->mu);
    if (r->type == REDIS_REPLY_ERROR &&
        strstr(r->str, "cluster support disabled")) {
      c->mode = 1;
      for (int s = 0; s < KVR_SLOTS; s++)
        c->slots[s] = (int16_t)i;
      c->need_refresh = 0;
      rc = 0;
    } else if (r->type == REDIS_REPLY_ARRAY && r->elements > 0) {
      c->mode = 2;
      apply_slots_locked(c, r, node->addr.host);
      c->need_refresh = 0;
      rc = 0;
    } else {
      rc = KVT_ERR(KVT_EIO, "redis %s:%d: unexpected CLUSTER SLOTS reply",
                   node->addr.host, node->addr.port);
    }
    pthread_mutex_unlock(&c->mu);
    freeReplyObject(r);
    conn_give(node, ctx);
    if (rc == 0)
      return 0;
  }
  if (perm) /* an auth/TLS refusal says more than an unreachable seed */
    return KVT_ERR(KVT_EPERM, "%s", perm_msg);
  return rc;
}

/* The node owning slot, refreshing the map first when needed. */
static int owner(kvr_client *c, unsigned slot, int *node, int64_t dl) {
  pthread_mutex_lock(&c->mu);
  int need = c->need_refresh || c->slots[slot] < 0;
  pthread_mutex_unlock(&c->mu);
  if (need) {
    int rc = refresh(c, dl);
    if (rc != 0)
      return rc;
  }
  pthread_mutex_lock(&c->mu);
  *node = c->slots[slot];
  pthread_mutex_unlock(&c->mu);
  if (*node < 0)
    return KVT_ERR(KVT_EIO,
                   "redis cluster: slot %u is not served by any node "
                   "(cluster down?)",
                   slot);
  return 0;
}

/* Parses "MOVED <slot> <host>:<port>" / "ASK ..." into a node index. */
static int redirect_target(kvr_client *c, const char *err, int *node) {
  const char *sp = strchr(err, ' ');
  sp = sp ? strchr(sp + 1, ' ') : NULL;
  if (!sp)
    return -1;
  const char *hp = sp + 1;
  const char *colon = strrchr(hp, ':');
  if (!colon || colon == hp || (size_t)(colon - hp) >= sizeof(kvr_addr){0}.host)
    return -1;
  char host[256];
  memcpy(host, hp, (size_t)(colon - hp));
  host[colon - hp] = '\0';
  int port = atoi(colon + 1);
  pthread_mutex_lock(&c->mu);
  *node = node_index_locked(c, host, port);
  pthread_mutex_unlock(&c->mu);
  return *node < 0 ? -1 : 0;
}

static int is_err(const redisReply *r, const char *prefix) {
  return r->type == REDIS_REPLY_ERROR &&
         !strncmp(r->str, prefix, strlen(prefix));
}

/* ------------------------------------------------------------------------ */
/* Execution                                                                */
/* ------------------------------------------------------------------------ */

/* hiredis writes with write(2): a server that closed the connection raises
 * SIGPIPE, which would kill a process that did not ignore it. Every public
 * entry point blocks SIGPIPE on the calling thread while it talks to Redis
 * (SIGPIPE from a socket write is sent to the writing thread) and discards one
 * it caused, so the library needs no process-wide signal setting. */
typedef struct pipe_guard {
  sigset_t old;
  int was_blocked;
} pipe_guard;

static void pipe_block(pipe_guard *g) {
  sigset_t s;
  sigemptyset(&s);
  sigaddset(&s, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &s, &g->old);
  g->was_blocked = sigismember(&g->old, SIGPIPE);
}

static void pipe_restore(pipe_guard *g) {
  if (!g->was_blocked) {
    sigset_t pend, s;
    sigemptyset(&s);
    sigaddset(&s, SIGPIPE);
    if (sigpending(&pend) == 0 && sigismember(&pend, SIGPIPE)) {
      struct timespec zero = {0, 0};
      sigtimedwait(&s, NULL, &zero);
    }
  }
  pthread_sigmask(SIG_SETMASK, &g->old, NULL);
}

/* Sends a pipeline straight to the socket with writev: hiredis 0.14 would copy
 * every argument twice (formatting, then appending to its output buffer) and
 * memmove the rest of that buffer after each partial write, which for
 * multi-MiB chunk values costs more than the transfer. Small pieces (RESP
 * headers, keys) are gathered into one text buffer; large values are sent
 * from the caller's memory, through the connection's transport (writev on
 * plain TCP, TLS records otherwise; transport.c), bounded by the time left of
 * the call's deadline: a stalled server times out. */
typedef struct seg {
  const char *p; /* NULL: text at off */
  size_t off, len;
} seg;

typedef struct wbuf {
  kvti_sb text; /* the commands' own bytes; segs point into it by offset */
  seg *segs;
  size_t n, cap;
  int oom;
} wbuf;

static void wb_seg(wbuf *w, const char *p, size_t off, size_t len) {
  if (w->oom || len == 0)
    return;
  if (!p && w->n > 0 && !w->segs[w->n - 1].p &&
      w->segs[w->n - 1].off + w->segs[w->n - 1].len == off) {
    w->segs[w->n - 1].len += len;
    return;
  }
  if (KVTI_VEC_RESERVE(&w->segs, &w->cap, w->n + 1, 64) != 0) {
    w->oom = 1;
    return;
  }
  w->segs[w->n].p = p;
  w->segs[w->n].off = off;
  w->segs[w->n].len = len;
  w->n++;
}

static void wb_text(wbuf *w, const void *p, size_t len) {
  if (w->oom)
    return;
  size_t at = w->text.len;
  kvti_sb_putn(&w->text, (const char *)p, len);
  if (w->text.oom) {
    w->oom = 1;
    return;
  }
  wb_seg(w, NULL, at, len);
}

static void wb_cmd(wbuf *w, int argc, const char *const *argv,
                   const size_t *len) {
  char h[32];
  int k = snprintf(h, sizeof h, "*%d\r\n", argc);
  wb_text(w, h, (size_t)k);
  for (int i = 0; i < argc; i++) {
    k = snprintf(h, sizeof h, "$%zu\r\n", len[i]);
    wb_text(w, h, (size_t)k);
    if (len[i] >= 4096)
      wb_seg(w, argv[i], 0, len[i]); /* sent from the caller's memory */
    else
      wb_text(w, argv[i], len[i]);
    wb_text(w, "\r\n", 2);
  }
}

static int send_direct(kvr_conn *ctx, int64_t dl, const kvr_cmd *cmds,
                       const size_t *idx, size_t m, int asking) {
  static const char *askv[] = {"ASKING"};
  static const size_t askl[] = {6};
  wbuf w;
  memset(&w, 0, sizeof w);
  for (size_t k = 0; k < m; k++) {
    const kvr_cmd *cm = &cmds[idx[k]];
    if (asking)
      wb_cmd(&w, 1, askv, askl);
    wb_cmd(&w, cm->argc, cm->argv, cm->len);
  }
  int rc = 0;
  struct iovec *iov = w.oom ? NULL : kvti_malloc((w.n ? w.n : 1) * sizeof *iov);
  if (!iov) {
    rc = KVT_ERR_NOMEM();
  } else {
    for (size_t j = 0; j < w.n; j++) {
      const seg *g = &w.segs[j];
      iov[j].iov_base = (void *)(g->p ? g->p : w.text.s + g->off);
      iov[j].iov_len = g->len;
    }
    rc = kvr_conn_writev(ctx, iov, (int)w.n, kvr_ms_left(dl));
  }
  kvti_free(iov);
  kvti_sb_free(&w.text);
  kvti_free(w.segs);
  return rc;
}

/* Sends cmds[idx[0..m)] to node (each preceded by ASKING when asking) and
 * reads the replies into replies[idx[k]]. 0 or a connection error (then no
 * reply is kept), all before dl. */
static int run_on(kvr_client *c, int node, const kvr_cmd *cmds,
                  const size_t *idx, size_t m, int asking, redisReply **replies,
                  int64_t dl) {
  kvr_node *nd = node_at(c, node);
  if (!nd)
    return KVT_ERR(KVT_EIO, "redis: unknown node %d", node);
  kvr_conn *ctx = NULL;
  int rc = conn_take(&ctx, c, nd, dl);
  if (rc != 0)
    return rc;
  rc = send_direct(ctx, dl, cmds, idx, m, asking);
  if (rc != 0) {
    kvr_conn_close(ctx);
    node_drop_idle(nd);
    return rc;
  }
  size_t got = 0;
  for (size_t k = 0; k < m; k++) {
    redisReply *r = NULL;
    if (asking) {
      if ((rc = kvr_conn_reply(ctx, &r, kvr_ms_left(dl), 0)) != 0)
        goto io_fail;
      freeReplyObject(r);
      r = NULL;
    }
    if ((rc = kvr_conn_reply(ctx, &r, kvr_ms_left(dl), 0)) != 0)
      goto io_fail;
    replies[idx[k]] = r;
    got++;
  }
  conn_give(nd, ctx);
  return 0;
io_fail:
  for (size_t k = 0; k < got; k++) {
    freeReplyObject(replies[idx[k]]);
    replies[idx[k]] = NULL;
  }
  kvr_conn_close(ctx);
  node_drop_idle(nd);
  pthread_mutex_lock(&c->mu);
  c->need_refresh = 1;
  pthread_mutex_unlock(&c->mu);
  return rc;
}

static int exec_batch(kvr_client *c, const char *key, size_t klen,
                      const kvr_cmd *cmds, size_t n, redisReply **replies,
                      int64_t dl);

int kvr_exec(kvr_client *c, const char *key, size_t klen, const kvr_cmd *cmds,
             size_t n, redisReply **replies) {
  pipe_guard g;
  pipe_block(&g);
  int rc =
      exec_batch(c, key, klen, cmds, n, replies, kvr_deadline(c->timeout_ms));
  pipe_restore(&g);
  return rc;
}

static int exec_batch(kvr_client *c, const char *key, size_t klen,
                      const kvr_cmd *cmds, size_t n, redisReply **replies,
                      int64_t dl) {
  if (n == 0)
    return 0;
  unsigned slot = kvr_key_slot(key, klen);
  pthread_mutex_lock(&c->mu);
  int soon = c->refresh_soon;
  c->refresh_soon = 0;
  pthread_mutex_unlock(&c->mu);
  if (soon && refresh(c, dl) != 0)
    kvt_clear_error(); /* the batch below reports what matters */
  size_t *pend = kvti_malloc(n * sizeof *pend);
  size_t *next = kvti_malloc(n * sizeof *next);
  if (!pend || !next) {
    kvti_free(pend);
    kvti_free(next);
    return KVT_ERR_NOMEM();
  }
  for (size_t i = 0; i < n; i++) {
    pend[i] = i;
    replies[i] = NULL;
  }
  size_t np = n;
  int node = -1, asking = 0, rc = 0, conn_retries = 0;
  for (int round = 0; np > 0; round++) {
    if (round >= KVR_MAX_ROUNDS) {
      rc = KVT_ERR(KVT_EIO, "redis: slot %u still redirected after %d rounds",
                   slot, KVR_MAX_ROUNDS);
      break;
    }
    if (!asking && (rc = owner(c, slot, &node, dl)) != 0)
      break;
    rc = run_on(c, node, cmds, pend, np, asking, replies, dl);
    if (rc != 0) {
      /* One retry after a refresh: the node may have been replaced. Within
       * the same deadline: a timeout leaves no time for it. */
      if (rc != KVT_ETIMEDOUT && conn_retries++ == 0 &&
          (rc = refresh(c, dl)) == 0) {
        asking = 0;
        continue;
      }
      break;
    }
    size_t nn = 0;
    int ask_node = -1, moved = 0, again = 0;
    for (size_t k = 0; k < np; k++) {
      redisReply *r = replies[pend[k]];
      int t = -1;
      if (is_err(r, "MOVED ") && redirect_target(c, r->str, &t) == 0) {
        pthread_mutex_lock(&c->mu);
        c->slots[slot] = (int16_t)t;
        c->refresh_soon = 1; /* other slots may have moved too */
        pthread_mutex_unlock(&c->mu);
        moved = 1;
      } else if (is_err(r, "ASK ") && redirect_target(c, r->str, &t) == 0) {
        ask_node = t;
      } else if (is_err(r, "TRYAGAIN") || is_err(r, "CLUSTERDOWN")) {
        again = 1;
      } else {
        continue; /* a final reply */
      }
      freeReplyObject(r);
      replies[pend[k]] = NULL;
      next[nn++] = pend[k];
    }
    memcpy(pend, next, nn * sizeof *pend);
    np = nn;
    if (np == 0)
      break;
    if (ask_node >= 0 && !moved) {
      node = ask_node;
      asking = 1;
    } else {
      asking = 0; /* a MOVED target is now the slot's owner in the map */
      if (again) {
        if (kvr_ms_left(dl) <= 20) {
          rc = KVT_ERR(KVT_ETIMEDOUT,
                       "redis: slot %u still unavailable (TRYAGAIN / "
                       "CLUSTERDOWN) at the deadline",
                       slot);
          break;
        }
        struct timespec ts = {0, 20 * 1000 * 1000};
        nanosleep(&ts, NULL);
      }
    }
  }
  if (rc != 0) {
    for (size_t i = 0; i < n; i++) {
      if (replies[i])
        freeReplyObject(replies[i]);
      replies[i] = NULL;
    }
  }
  kvti_free(pend);
  kvti_free(next);
  return rc;
}

int kvr_scan(kvr_client *c, int node, const char *pattern, kvr_key_fn fn,
             void *ctx) {
  char cursor[32] = "0";
  do {
    const char *argv[] = {"SCAN", cursor, "MATCH", pattern, "COUNT", "1000"};
    kvr_cmd cmd;
    kvr_cmd_set(&cmd, 6, argv);
    redisReply *r = NULL;
    int rc = kvr_exec_node(c, node, &cmd, &r);
    if (rc != 0)
      return rc;
    if (r->type != REDIS_REPLY_ARRAY || r->elements != 2 ||
        r->element[0]->type != REDIS_REPLY_STRING ||
        r->element[1]->type != REDIS_REPLY_ARRAY) {
      rc = r->type == REDIS_REPLY_ERROR
               ? KVT_ERR(KVT_EIO, "redis SCAN: %s", r->str)
               : KVT_ERR(KVT_EIO, "redis: unexpected SCAN reply");
      freeReplyObject(r);
      return rc;
    }
    snprintf(cursor, sizeof cursor, "%s", r->element[0]->str);
    const redisReply *keys = r->element[1];
    for (size_t i = 0; rc == 0 && i < keys->elements; i++)
      if (keys->element[i]->type == REDIS_REPLY_STRING)
        rc = fn(ctx, keys->element[i]->str, keys->element[i]->len);
    freeReplyObject(r);
    if (rc != 0)
      return rc < 0 ? rc : 0;
  } while (strcmp(cursor, "0") != 0);
  return 0;
}

int kvr_client_probe(kvr_client *c) {
  pipe_guard g;
  pipe_block(&g);
  int rc = refresh(c, kvr_deadline(c->timeout_ms));
  pipe_restore(&g);
  return rc;
}

int kvr_client_dedicated(kvr_client *c, kvr_conn **out) {
  pthread_mutex_lock(&c->mu);
  int n = c->n_nodes;
  int first = c->n_nodes > 0 ? c->slots[0] : -1;
  pthread_mutex_unlock(&c->mu);
  int rc = KVT_ERR(KVT_EIO, "redis: no node known");
  int64_t dl = kvr_deadline(c->timeout_ms);
  /* The owner of slot 0 first (a live master once the map is known), then
   * every known node in turn. */
  for (int k = -1; k < n; k++) {
    int i = k < 0 ? first : k;
    if (i < 0 || (k >= 0 && i == first))
      continue;
    kvr_node *nd = node_at(c, i);
    if (nd && (rc = conn_take(out, c, nd, dl)) == 0)
      return 0;
    if (rc == KVT_ETIMEDOUT)
      break;
  }
  return rc;
}

int kvr_exec_node(kvr_client *c, int node, const kvr_cmd *cmd,
                  redisReply **reply) {
  size_t idx = 0;
  *reply = NULL;
  pipe_guard g;
  pipe_block(&g);
  int rc = run_on(c, node, cmd, &idx, 1, 0, reply, kvr_deadline(c->timeout_ms));
  pipe_restore(&g);
  return rc;
}

int kvr_foreach_master(kvr_client *c, kvr_node_fn fn, void *ctx) {
  pipe_guard g;
  pipe_block(&g);
  int rc = refresh(c, kvr_deadline(c->timeout_ms));
  pipe_restore(&g);
  if (rc != 0)
    return rc;
  /* The distinct owners in the slot map are the masters. */
  char seen[KVR_MAX_NODES] = {0};
  pthread_mutex_lock(&c->mu);
  for (int s = 0; s < KVR_SLOTS; s++)
    if (c->slots[s] >= 0)
      seen[c->slots[s]] = 1;
  pthread_mutex_unlock(&c->mu);
  for (int i = 0; i < KVR_MAX_NODES; i++) {
    if (!seen[i])
      continue;
    if ((rc = fn(ctx, c, i)) != 0)
      return rc;
  }
  return 0;
}
