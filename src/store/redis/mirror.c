/*
 * mirror.c - the local mirror of the remote store's entries (see mirror.h).
 * Records live in one array (a free list reuses removed slots) indexed by two
 * multimaps: the entry hash's first 64 bits -> record, and the 64-bit xxh3 of
 * the prefix set's id -> records of that set. Both keys are confirmed against
 * the record's strings, so a 64-bit collision costs a comparison, never a
 * wrong answer. The thread: connect (a dedicated, authenticated connection
 * from the client), SUBSCRIBE <P>events, resync from the prefix sets (SCAN on
 * every master, ZRANGE of each set: the new content replaces the old in one
 * swap), then apply messages until the connection fails; then it is not in
 * sync and reconnects after a back-off (0.25 s doubling to 5 s). A pipe wakes
 * its poll at stop, so closing a tier never waits for a timeout.
 */
#include "store/redis/mirror.h"
#include "store/redis/cmirror.h"
#include "base/vec.h"
#include "base/error.h"
#include "base/hash.h"
#include "base/hashmap.h"
#include "base/io.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MR_SET_MAX 80 /* "z:" + 64 hex, or "s:" + a token */

typedef struct mrec {
  char hash[65];
  char set[MR_SET_MAX];
  uint64_t len;
  uint64_t next_free; /* free list link + 1 (0 = end); only when unused */
  int used;
} mrec;

/* The mirrored content: swapped whole by a resync. */
typedef struct mtab {
  mrec *r;
  size_t n, cap;      /* slots used (incl. free ones), allocated */
  uint64_t free_head; /* index + 1, 0 = none */
  size_t live;
  kvti_hm by_hash, by_set;
} mtab;

struct kvr_mirror {
  kvr_client *cl;
  char *prefix;
  pthread_rwlock_t lk; /* tab, ctab */
  mtab tab;
  kvr_ctab ctab; /* chunks (cmirror.h) */
  atomic_int synced;
  atomic_uint_fast64_t gen;
  atomic_int stop;
  int wake[2];
  pthread_t th;
  int started;
};

/* ------------------------------------------------------------------------ */
/* The table                                                                */
/* ------------------------------------------------------------------------ */

static uint64_t hash_key(const char *hash) {
  uint64_t k = 0;
  for (int i = 0; i < 16 && hash[i]; i++) {
    char c = hash[i];
    k = (k << 4) | (uint64_t)(c >= 'a' ? c - 'a' + 10 : c - '0');
  }
  return kvti_hm_key(k);
}

static uint64_t set_key(const char *set) {
  return kvti_hm_key(kvti_xxh3(set, strlen(set)));
}

static void tab_free(mtab *t) {
  kvti_free(t->r);
  kvti_hm_free(&t->by_hash);
  kvti_hm_free(&t->by_set);
  memset(t, 0, sizeof *t);
}

static mrec *tab_find(const mtab *t, const char *hash, kvti_hm_slot **slot) {
  size_t pos = 0;
  kvti_hm_slot *s;
  while ((s = kvti_hm_next(&t->by_hash, hash_key(hash), &pos)) != NULL) {
    mrec *r = &t->r[s->val];
    if (r->used && !strcmp(r->hash, hash)) {
      if (slot)
        *slot = s;
      return r;
    }
  }
  return NULL;
}

static void tab_del(mtab *t, const char *hash) {
  kvti_hm_slot *hs = NULL;
  mrec *r = tab_find(t, hash, &hs);
  if (!r)
    return;
  uint64_t idx = (uint64_t)(r - t->r);
  kvti_hm_remove_slot(&t->by_hash, hs);
  kvti_hm_remove(&t->by_set, set_key(r->set), idx);
  r->used = 0;
  r->next_free = t->free_head;
  t->free_head = idx + 1;
  t->live--;
}

/* Adds or updates. 0 or KVT_ENOMEM (table unchanged). */
static int tab_put(mtab *t, const char *hash, const char *set, uint64_t len) {
  mrec *r = tab_find(t, hash, NULL);
  if (r && r->len == len && !strcmp(r->set, set))
    return 0;
  if (r)
    tab_del(t, hash);
  uint64_t idx;
  if (t->free_head) {
    idx = t->free_head - 1;
  } else {
    if (KVTI_VEC_RESERVE(&t->r, &t->cap, t->n + 1, 256) != 0)
      return KVT_ENOMEM;
    idx = t->n;
  }
  if (kvti_hm_add(&t->by_hash, hash_key(hash), idx) != 0)
    return KVT_ERR_NOMEM();
  if (kvti_hm_add(&t->by_set, set_key(set), idx) != 0) {
    kvti_hm_remove(&t->by_hash, hash_key(hash), idx);
    return KVT_ERR_NOMEM();
  }
  if (t->free_head)
    t->free_head = t->r[idx].next_free;
  else
    t->n++;
  r = &t->r[idx];
  memset(r, 0, sizeof *r);
  snprintf(r->hash, sizeof r->hash, "%s", hash);
  snprintf(r->set, sizeof r->set, "%s", set);
  r->len = len;
  r->used = 1;
  t->live++;
  return 0;
}

/* ------------------------------------------------------------------------ */
/* Queries                                                                  */
/* ------------------------------------------------------------------------ */

int kvr_mirror_synced(kvr_mirror *m) {
  return m && atomic_load(&m->synced);
}

uint64_t kvr_mirror_gen(kvr_mirror *m) {
  return m ? (uint64_t)atomic_load(&m->gen) : 0;
}

size_t kvr_mirror_lengths(kvr_mirror *m, const char *set_id, uint64_t lo,
                          uint64_t hi, uint64_t *out, size_t max) {
  size_t k = 0;
  pthread_rwlock_rdlock(&m->lk);
  size_t pos = 0;
  kvti_hm_slot *s;
  while ((s = kvti_hm_next(&m->tab.by_set, set_key(set_id), &pos)) != NULL) {
    const mrec *r = &m->tab.r[s->val];
    if (!r->used || r->len < lo || r->len > hi || strcmp(r->set, set_id))
      continue;
    /* distinct lengths, the max longest, in a descending array */
    size_t at = k;
    while (at > 0 && out[at - 1] < r->len)
      at--;
    if ((at > 0 && out[at - 1] == r->len) || at >= max)
      continue;
    size_t last = k < max ? k : max - 1;
    memmove(&out[at + 1], &out[at], (last - at) * sizeof *out);
    out[at] = r->len;
    if (k < max)
      k++;
  }
  pthread_rwlock_unlock(&m->lk);
  return k;
}

int kvr_mirror_has(kvr_mirror *m, const char *hash, uint64_t *len) {
  pthread_rwlock_rdlock(&m->lk);
  const mrec *r = tab_find(&m->tab, hash, NULL);
  if (r && len)
    *len = r->len;
  pthread_rwlock_unlock(&m->lk);
  return r != NULL;
}

size_t kvr_mirror_count(kvr_mirror *m) {
  pthread_rwlock_rdlock(&m->lk);
  size_t n = m->tab.live;
  pthread_rwlock_unlock(&m->lk);
  return n;
}

void kvr_mirror_put(kvr_mirror *m, const char *hash, const char *set_id,
                    uint64_t len) {
  if (!m || strlen(set_id) >= MR_SET_MAX || strlen(hash) != 64)
    return;
  pthread_rwlock_wrlock(&m->lk);
  if (tab_put(&m->tab, hash, set_id, len) != 0)
    kvt_clear_error(); /* out of memory: a lookup then misses it, no more */
  pthread_rwlock_unlock(&m->lk);
  atomic_fetch_add(&m->gen, 1);
}

void kvr_mirror_del(kvr_mirror *m, const char *hash) {
  if (!m)
    return;
  pthread_rwlock_wrlock(&m->lk);
  tab_del(&m->tab, hash);
  pthread_rwlock_unlock(&m->lk);
}

size_t kvr_mirror_channel(char *buf, size_t cap, const char *prefix) {
  int n = snprintf(buf, cap, "%sevents", prefix);
  return n < 0 ? 0 : (size_t)n < cap ? (size_t)n : cap - 1;
}

size_t kvr_mirror_event(char *buf, size_t cap, const char *hash,
                        const char *set_id, uint64_t len) {
  int n = set_id
              ? snprintf(buf, cap, "kvt1 + e %s %s %" PRIu64, hash, set_id, len)
              : snprintf(buf, cap, "kvt1 - e %s", hash);
  return n < 0 ? 0 : (size_t)n < cap ? (size_t)n : cap - 1;
}

void kvr_mirror_chunk_put(kvr_mirror *m, const kvti_chain_rec *rec) {
  if (!m)
    return;
  pthread_rwlock_wrlock(&m->lk);
  if (kvr_ctab_put(&m->ctab, rec) != 0)
    kvt_clear_error(); /* out of memory: a lookup then misses it, no more */
  pthread_rwlock_unlock(&m->lk);
}

void kvr_mirror_chunk_del(kvr_mirror *m, const uint8_t key[32]) {
  if (!m)
    return;
  pthread_rwlock_wrlock(&m->lk);
  kvr_ctab_del(&m->ctab, key);
  pthread_rwlock_unlock(&m->lk);
}

size_t kvr_mirror_chunk_lookup(kvr_mirror *m, const uint8_t *ns, size_t ns_len,
                               const int32_t *tokens, size_t n,
                               uint32_t chunk_tokens, kvti_chain_rec *out,
                               size_t max) {
  if (!m || !atomic_load(&m->synced))
    return 0;
  pthread_rwlock_rdlock(&m->lk);
  size_t k =
      kvr_ctab_lookup(&m->ctab, ns, ns_len, tokens, n, chunk_tokens, out, max);
  pthread_rwlock_unlock(&m->lk);
  return k;
}

size_t kvr_mirror_chunk_count(kvr_mirror *m) {
  pthread_rwlock_rdlock(&m->lk);
  size_t n = m->ctab.live;
  pthread_rwlock_unlock(&m->lk);
  return n;
}

size_t kvr_mirror_chunk_event(char *buf, size_t cap, const uint8_t key[32],
                              const kvti_chain_rec *rec) {
  char kh[65], rt[320];
  kvti_hex32(kh, key);
  int n;
  if (rec) {
    if (!kvr_crec_format(rt, sizeof rt, rec))
      return 0;
    n = snprintf(buf, cap, "kvt1 + c %s %s", kh, rt);
  } else {
    n = snprintf(buf, cap, "kvt1 - c %s", kh);
  }
  return n < 0 || (size_t)n >= cap ? 0 : (size_t)n;
}

size_t kvr_mirror_chunk_index_key(char *buf, size_t cap, const char *prefix,
                                  int shard) {
  int n = snprintf(buf, cap, "%s{ci:%x}", prefix, (unsigned)shard & 15u);
  return n < 0 ? 0 : (size_t)n < cap ? (size_t)n : cap - 1;
}

/* A key the server evicted or expired (keyspace notifications): a chunk
 * (<P>{c:<key>}) or an entry's manifest (<P>{<hash>}:m) leaves the mirror. */
static void apply_keyevent(kvr_mirror *m, const char *key, size_t len) {
  size_t pl = strlen(m->prefix);
  if (len < pl || memcmp(key, m->prefix, pl) != 0)
    return;
  key += pl;
  len -= pl;
  char hex[65];
  uint8_t k[32];
  if (len == 3 + 64 + 1 && !memcmp(key, "{c:", 3) && key[67] == '}') {
    memcpy(hex, key + 3, 64);
    hex[64] = '\0';
    if (kvti_unhex32(k, hex) == 0)
      kvr_mirror_chunk_del(m, k);
  } else if (len == 1 + 64 + 3 && key[0] == '{' &&
             !memcmp(key + 65, "}:m", 3)) {
    memcpy(hex, key + 1, 64);
    hex[64] = '\0';
    if (kvti_is_hash_name(hex))
      kvr_mirror_del(m, hex);
  }
}

/* Applies one event message; anything malformed or of another kind is
 * ignored (a newer writer may publish kinds this reader does not know). */
static void apply_event(kvr_mirror *m, const char *msg, size_t len) {
  char b[512];
  if (len >= sizeof b)
    return;
  memcpy(b, msg, len);
  b[len] = '\0';
  if (len >= 9 + 64 && !memcmp(b, "kvt1 ", 5) && !memcmp(b + 6, " c ", 3)) {
    /* "kvt1 + c <key> <record>" / "kvt1 - c <key>" */
    kvti_chain_rec rec;
    const char *key = b + 9;
    if (b[5] == '+' && len > 9 + 64 + 1 && key[64] == ' ' &&
        kvr_crec_parse(&rec, key, 64, key + 65, len - 9 - 65) == 0)
      kvr_mirror_chunk_put(m, &rec);
    else if (b[5] == '-' && len == 9 + 64 && kvti_unhex32(rec.key, key) == 0)
      kvr_mirror_chunk_del(m, rec.key);
    return;
  }
  char op[4], kind[8], hash[80], set[MR_SET_MAX + 8];
  unsigned long long n = 0;
  int got = sscanf(b, "kvt1 %3s %7s %79s %87s %llu", op, kind, hash, set, &n);
  if (got < 3 || strcmp(kind, "e") != 0 || strlen(hash) != 64 ||
      !kvti_is_hash_name(hash))
    return;
  if (!strcmp(op, "+") && got == 5)
    kvr_mirror_put(m, hash, set, n);
  else if (!strcmp(op, "-"))
    kvr_mirror_del(m, hash);
}

/* ------------------------------------------------------------------------ */
/* Resync                                                                   */
/* ------------------------------------------------------------------------ */

typedef struct resync {
  kvr_mirror *m;
  mtab fresh;
  kvr_ctab cfresh;
  char pattern[600];
  size_t plen;
  int rc;
} resync;

/* Glob-escapes s into out (SCAN MATCH patterns treat *?[]\ specially). */
static void glob_escape(char *out, size_t cap, const char *s) {
  size_t k = 0;
  for (; *s && k + 3 < cap; s++) {
    if (strchr("*?[]\\", *s))
      out[k++] = '\\';
    out[k++] = *s;
  }
  out[k] = '\0';
}

/* Runs argv (argv[1] = the key, klen bytes) on the key's node. */
static int run_on_key(resync *rs, const char **argv, int argc, size_t klen,
                      redisReply **r) {
  kvr_cmd c;
  kvr_cmd_set(&c, argc, argv);
  c.len[1] = klen;
  return kvr_exec(rs->m->cl, argv[1], klen, &c, 1, r);
}

/* ZRANGE of one prefix set key into the fresh table. */
static int load_set(resync *rs, const char *key, size_t klen) {
  if (klen < rs->plen + 4 || klen - rs->plen - 2 >= MR_SET_MAX)
    return 0;
  char set[MR_SET_MAX];
  memcpy(set, key + rs->plen + 1, klen - rs->plen - 2); /* strip the braces */
  set[klen - rs->plen - 2] = '\0';
  const char *argv[] = {"ZRANGE", key, "0", "-1", "WITHSCORES"};
  redisReply *r = NULL;
  int rc = run_on_key(rs, argv, 5, klen, &r);
  if (rc != 0)
    return rc;
  if (r->type == REDIS_REPLY_ARRAY) {
    for (size_t i = 0; i + 1 < r->elements; i += 2) {
      const redisReply *mem = r->element[i], *sc = r->element[i + 1];
      if (mem->type != REDIS_REPLY_STRING || sc->type != REDIS_REPLY_STRING ||
          mem->len != 64)
        continue;
      char hash[65];
      memcpy(hash, mem->str, 64);
      hash[64] = '\0';
      if (!kvti_is_hash_name(hash))
        continue;
      if ((rc = tab_put(&rs->fresh, hash, set, strtoull(sc->str, NULL, 10))) !=
          0)
        break;
    }
  }
  freeReplyObject(r);
  return rc;
}

static int scan_key(void *vctx, const char *key, size_t len) {
  resync *rs = vctx;
  if (atomic_load(&rs->m->stop))
    return KVT_ERR(KVT_ECANCELED, "mirror stopped");
  return load_set(rs, key, len);
}

static int scan_master(void *vctx, kvr_client *c, int node) {
  resync *rs = vctx;
  return kvr_scan(c, node, rs->pattern, scan_key, rs);
}

/* HGETALL of chunk index shard sh (<P>{ci:<hex digit>}) into the fresh
 * chunk table. */
static int load_chunk_shard(resync *rs, int sh) {
  char key[600];
  size_t klen = kvr_mirror_chunk_index_key(key, sizeof key, rs->m->prefix, sh);
  const char *argv[] = {"HGETALL", key};
  redisReply *r = NULL;
  int rc = run_on_key(rs, argv, 2, klen, &r);
  if (rc != 0)
    return rc;
  if (r->type == REDIS_REPLY_ARRAY) {
    for (size_t i = 0; rc == 0 && i + 1 < r->elements; i += 2) {
      const redisReply *f = r->element[i], *v = r->element[i + 1];
      kvti_chain_rec rec;
      if (f->type == REDIS_REPLY_STRING && v->type == REDIS_REPLY_STRING &&
          kvr_crec_parse(&rec, f->str, f->len, v->str, v->len) == 0)
        rc = kvr_ctab_put(&rs->cfresh, &rec);
    }
  }
  freeReplyObject(r);
  return rc;
}

/* Rebuilds the table from the store; on success it replaces the old one. */
static int resync_all(kvr_mirror *m) {
  resync rs;
  memset(&rs, 0, sizeof rs);
  rs.m = m;
  char esc[300];
  glob_escape(esc, sizeof esc, m->prefix);
  snprintf(rs.pattern, sizeof rs.pattern, "%s{[zs]:*}", esc);
  rs.plen = strlen(m->prefix);
  int rc = kvr_foreach_master(m->cl, scan_master, &rs);
  for (int sh = 0; rc == 0 && sh < 16; sh++)
    rc = load_chunk_shard(&rs, sh);
  if (rc != 0) {
    tab_free(&rs.fresh);
    kvr_ctab_free(&rs.cfresh);
    return rc;
  }
  pthread_rwlock_wrlock(&m->lk);
  mtab old = m->tab;
  kvr_ctab cold = m->ctab;
  m->tab = rs.fresh;
  m->ctab = rs.cfresh;
  pthread_rwlock_unlock(&m->lk);
  tab_free(&old);
  kvr_ctab_free(&cold);
  atomic_fetch_add(&m->gen, 1);
  return 0;
}

/* ------------------------------------------------------------------------ */
/* The thread                                                               */
/* ------------------------------------------------------------------------ */

/* Sleeps ms unless woken by stop (the wake pipe stays readable once
 * written: stop is final). */
static void nap(kvr_mirror *m, uint32_t ms) {
  struct pollfd p = {m->wake[0], POLLIN, 0};
  while (!atomic_load(&m->stop) && poll(&p, 1, (int)ms) < 0 && errno == EINTR)
    ;
}

/* One connected session: subscribe, resync, apply events until failure. */
static void session(kvr_mirror *m, kvr_conn *cn, uint32_t *backoff) {
  char chan[400];
  size_t cl = kvr_mirror_channel(chan, sizeof chan, m->prefix);
  const char *argv[2] = {"SUBSCRIBE", chan};
  size_t len[2] = {9, cl};
  redisReply *r = NULL;
  if (kvr_conn_call(cn, &r, 2, argv, len, 2000) != 0)
    return;
  int ok = r->type == REDIS_REPLY_ARRAY && r->elements >= 1 &&
           r->element[0]->type == REDIS_REPLY_STRING &&
           !strcmp(r->element[0]->str, "subscribe");
  freeReplyObject(r);
  /* Evictions and expirations, when the server publishes them
   * (notify-keyspace-events with E and e/x): nothing arrives otherwise. */
  static const char *const kev[2] = {"__keyevent@*__:evicted",
                                     "__keyevent@*__:expired"};
  for (int i = 0; ok && i < 2; i++) {
    const char *pv[2] = {"PSUBSCRIBE", kev[i]};
    size_t pl[2] = {10, strlen(kev[i])};
    r = NULL;
    if (kvr_conn_call(cn, &r, 2, pv, pl, 2000) != 0)
      return;
    ok = r->type == REDIS_REPLY_ARRAY;
    freeReplyObject(r);
  }
  if (!ok || resync_all(m) != 0) {
    kvt_clear_error();
    return;
  }
  atomic_store(&m->synced, 1);
  *backoff = 0;
  /* A dead server usually shows as a hang-up; one that vanished without a
   * word (a partition) is caught by a PING after 5 s of silence, unanswered
   * for another 5 s. */
  int ping_pending = 0;
  static const char *const pingv[1] = {"PING"};
  static const size_t pingl[1] = {4};
  char *ping = NULL;
  int ping_len = redisFormatCommandArgv(&ping, 1, (const char **)pingv, pingl);
  while (!atomic_load(&m->stop) && ping_len > 0) {
    int w = kvr_conn_wait_input(cn, m->wake[0], 5000);
    if (w == 2 || atomic_load(&m->stop))
      break;
    if (w == 0) {
      if (ping_pending)
        break;
      struct iovec v = {ping, (size_t)ping_len};
      if (kvr_conn_writev(cn, &v, 1, 2000) != 0)
        break;
      ping_pending = 1;
      continue;
    }
    if (kvr_conn_reply(cn, &r, 2000, 0) != 0)
      break;
    ping_pending = 0; /* anything received shows the server alive */
    if (r->type == REDIS_REPLY_ARRAY && r->elements == 3 &&
        r->element[0]->type == REDIS_REPLY_STRING &&
        !strcmp(r->element[0]->str, "message") &&
        r->element[2]->type == REDIS_REPLY_STRING)
      apply_event(m, r->element[2]->str, r->element[2]->len);
    else if (r->type == REDIS_REPLY_ARRAY && r->elements == 4 &&
             r->element[0]->type == REDIS_REPLY_STRING &&
             !strcmp(r->element[0]->str, "pmessage") &&
             r->element[3]->type == REDIS_REPLY_STRING)
      apply_keyevent(m, r->element[3]->str, r->element[3]->len);
    freeReplyObject(r);
  }
  free(ping); /* hiredis allocates with malloc */
  atomic_store(&m->synced, 0);
  kvt_clear_error();
}

static void *mirror_main(void *arg) {
  kvr_mirror *m = arg;
  /* SIGPIPE from a closed socket is this thread's own, never the process's */
  sigset_t s;
  sigemptyset(&s);
  sigaddset(&s, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &s, NULL);
  uint32_t backoff = 0;
  while (!atomic_load(&m->stop)) {
    kvr_conn *cn = NULL;
    if (kvr_client_dedicated(m->cl, &cn) == 0) {
      session(m, cn, &backoff);
      kvr_conn_close(cn);
    }
    kvt_clear_error();
    atomic_store(&m->synced, 0);
    backoff = backoff ? (backoff * 2 > 5000 ? 5000 : backoff * 2) : 250;
    nap(m, backoff);
  }
  return NULL;
}

int kvr_mirror_start(kvr_mirror **out, kvr_client *cl, const char *prefix) {
  kvr_mirror *m = kvti_calloc(1, sizeof *m);
  if (!m)
    return KVT_ERR_NOMEM();
  m->cl = cl;
  m->wake[0] = m->wake[1] = -1;
  m->prefix = kvti_strdup(prefix);
  pthread_rwlock_init(&m->lk, NULL);
  atomic_init(&m->synced, 0);
  atomic_init(&m->gen, 1);
  atomic_init(&m->stop, 0);
  int rc = m->prefix ? 0 : KVT_ENOMEM;
  if (rc == 0 && pipe(m->wake) != 0)
    rc = KVT_ERR_OS(errno, "pipe (remote mirror)");
  if (rc == 0) {
    for (int i = 0; i < 2; i++)
      fcntl(m->wake[i], F_SETFD, FD_CLOEXEC);
    int e = pthread_create(&m->th, NULL, mirror_main, m);
    if (e != 0)
      rc = KVT_ERR_OS(e, "creating the remote mirror thread");
    else
      m->started = 1;
  }
  if (rc != 0) {
    kvr_mirror_stop(m);
    return rc;
  }
  *out = m;
  return 0;
}

void kvr_mirror_stop(kvr_mirror *m) {
  if (!m)
    return;
  atomic_store(&m->stop, 1);
  if (m->wake[1] >= 0) {
    char b = 1;
    ssize_t w = write(m->wake[1], &b, 1);
    (void)w;
  }
  if (m->started)
    pthread_join(m->th, NULL);
  for (int i = 0; i < 2; i++)
    if (m->wake[i] >= 0)
      close(m->wake[i]);
  tab_free(&m->tab);
  kvr_ctab_free(&m->ctab);
  pthread_rwlock_destroy(&m->lk);
  kvti_free(m->prefix);
  kvti_free(m);
}
