/*
 * test_redis_tier.c - the shared remote tier against real Debian redis-server
 * processes started by this test on loopback (127.0.0.1, random free high
 * ports, temporary directories): one standalone server, one under maxmemory
 * with allkeys-lru, and a 3-master Redis Cluster made with redis-cli --cluster
 * create. A second kvtier process (this binary re-executed with --child) acts
 * as a second machine: what one spills, the other promotes bit-identical, in
 * both directions. Then the store misbehaves: a chunk key is deleted, one is
 * damaged, keys are evicted, a slot is migrated mid-run (MIGRATING/IMPORTING +
 * MIGRATE: ASK then MOVED), a cluster node is killed, the standalone server is
 * killed - never wrong data, clear errors, and the local tier keeps working.
 * In remote-only mode the write budget holds a spill's reservation until its
 * upload is counted, and remote chain lookups are stamped by the tier's clock.
 * Every server is in one process group killed at exit (atexit, and
 * PR_SET_PDEATHSIG should the test itself die). Exit 77 when redis-server or
 * redis-cli is missing or kvtier was built without hiredis.
 */
#include "tier_testlib.h"
#include "kvtier_sys.h"
#include "tier/admission.h"

#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>

/* ------------------------------------------------------------------------ */
/* Servers                                                                  */
/* ------------------------------------------------------------------------ */

static pid_t g_pgid = 0; /* the group: a sleeping leader and every server */
static pid_t g_leader = 0;
static pid_t g_pids[16];
static int g_ports[16];
static int g_n;

static void kill_all(void) {
  if (g_pgid > 0) {
    kill(-g_pgid, SIGKILL);
    for (int i = 0; i < g_n; i++)
      if (g_pids[i] > 0)
        waitpid(g_pids[i], NULL, 0);
    waitpid(g_leader, NULL, 0);
    g_pgid = 0;
  }
}

static void on_signal(int sig) {
  if (g_pgid > 0)
    kill(-g_pgid, SIGKILL);
  signal(sig, SIG_DFL);
  raise(sig);
}

static int port_free(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0)
    return 0;
  struct sockaddr_in a;
  memset(&a, 0, sizeof a);
  a.sin_family = AF_INET;
  a.sin_port = htons((uint16_t)port);
  a.sin_addr.s_addr = htonl(0x7f000001);
  int ok = bind(fd, (struct sockaddr *)&a, sizeof a) == 0;
  close(fd);
  return ok;
}

/* A random free port p with p + 10000 (the cluster bus) free too. */
static int pick_port(void) {
  static kvt_rng r = {0};
  if (!r.s)
    r.s = (uint64_t)getpid() * 7919 + (uint64_t)time(NULL);
  for (int i = 0; i < 1000; i++) {
    int p = 20000 + (int)(kvt_rng_next(&r) % 30000);
    int used = 0;
    for (int j = 0; j < g_n; j++)
      used |=
          g_ports[j] == p || g_ports[j] + 10000 == p || g_ports[j] == p + 10000;
    if (!used && port_free(p) && port_free(p + 10000))
      return p;
  }
  return -1;
}

static char *sh_out(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static char *sh_out(const char *fmt, ...) {
  char cmd[4096];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(cmd, sizeof cmd, fmt, ap);
  va_end(ap);
  FILE *f = popen(cmd, "r");
  if (!f)
    return strdup("");
  size_t cap = 4096, n = 0;
  char *b = malloc(cap);
  size_t k;
  while ((k = fread(b + n, 1, cap - n - 1, f)) > 0) {
    n += k;
    if (cap - n < 2) {
      cap *= 2;
      b = realloc(b, cap);
    }
  }
  b[n] = '\0';
  pclose(f);
  return b;
}

static int cli_ok(int port, const char *args, const char *want) {
  char *o = sh_out("redis-cli -h 127.0.0.1 -p %d %s 2>&1", port, args);
  int ok = strstr(o, want) != NULL;
  free(o);
  return ok;
}

static void msleep(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* Starts redis-server on port (extra: more arguments, space separated, no
 * quoting). Returns its index. */
/* A process that only leads the servers' process group (a group must keep a
 * member for others to join it, whichever server dies first). */
static void start_leader(void) {
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    for (;;)
      pause();
  }
  setpgid(pid, pid);
  g_leader = g_pgid = pid;
}

static int start_server(int port, const char *dir, const char *extra) {
  char portbuf[16];
  snprintf(portbuf, sizeof portbuf, "%d", port);
  const char *argv[64];
  int a = 0;
  argv[a++] = "redis-server";
  argv[a++] = "--port";
  argv[a++] = portbuf;
  argv[a++] = "--bind";
  argv[a++] = "127.0.0.1";
  argv[a++] = "--save";
  argv[a++] = "";
  argv[a++] = "--appendonly";
  argv[a++] = "no";
  argv[a++] = "--dir";
  argv[a++] = dir;
  argv[a++] = "--logfile";
  argv[a++] = "redis.log";
  char *ex = strdup(extra ? extra : "");
  for (char *tok = strtok(ex, " "); tok && a < 62; tok = strtok(NULL, " "))
    argv[a++] = tok;
  argv[a] = NULL;
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    setpgid(0, g_pgid);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    int fd = open("/dev/null", O_RDWR);
    dup2(fd, 0);
    dup2(fd, 1);
    dup2(fd, 2);
    execvp("redis-server", (char *const *)argv);
    _exit(127);
  }
  free(ex);
  setpgid(pid, g_pgid);
  g_pids[g_n] = pid;
  g_ports[g_n] = port;
  int idx = g_n++;
  for (int i = 0; i < 200; i++) {
    if (cli_ok(port, "PING", "PONG"))
      return idx;
    msleep(25);
  }
  fprintf(stderr, "redis-server on port %d did not start\n", port);
  exit(1);
}

static void kill_server(int idx) {
  kill(g_pids[idx], SIGKILL);
  waitpid(g_pids[idx], NULL, 0);
  g_pids[idx] = -1;
}

/* ------------------------------------------------------------------------ */
/* Entries                                                                  */
/* ------------------------------------------------------------------------ */

/* 2 layers x 2 tensors x 4 KiB: with 4 KiB chunks, ~5 chunks per entry. */
static t_entry mk(uint64_t seed) {
  return t_make(seed, 40 + seed % 7, 2, 16, 32);
}

static kvt_options ropts(const char *tag, const char *url, const char *prefix,
                         int mode) {
  kvt_options o = t_opts(tag);
  o.remote_url = url;
  o.remote_mode = mode;
  o.remote_prefix = prefix;
  o.remote_chunk_bytes = 4096;
  o.remote_timeout_ms = 1000;
  return o;
}

static kvt_stats stats_of(kvt_tier *t) {
  kvt_stats s = KVT_STATS_INIT;
  kvt_tier_stats(&s, t);
  return s;
}

/* Promotes e; 1 = bit-identical hit, 0 = miss (KVT_ENOTFOUND), -1 = anything
 * else (wrong data, another error). */
static int promote_check(kvt_tier *t, const t_entry *e) {
  kvt_entry *got = NULL;
  int rc = kvt_tier_promote(&got, t, e->tokens, e->n_tokens, NULL);
  if (rc == KVT_ENOTFOUND)
    return 0;
  if (rc != 0) {
    fprintf(stderr, "promote: %s: %s\n", kvt_strerror(rc), kvt_last_error());
    return -1;
  }
  int same = t_same(got, e);
  kvt_entry_free(got);
  if (!same)
    fprintf(stderr, "promote returned WRONG DATA\n");
  return same ? 1 : -1;
}

/* The second node: --child URL PREFIX DIR SEED... promotes each seed's entry
 * (must be bit-identical), then spills seed 999 and flushes. */
static int child_main(int argc, char **argv) {
  kvt_options o;
  kvt_options_init(&o, KVT_OPTIONS_VERSION);
  o.cache_dir = argv[4];
  o.durability = KVT_DURABILITY_NONE;
  o.remote_url = argv[2];
  o.remote_prefix = argv[3];
  o.remote_mode = KVT_REMOTE_LOCAL_AND_REMOTE;
  o.remote_chunk_bytes = 4096;
  kvt_tier *t = t_open(&o);
  int bad = 0;
  for (int i = 5; i < argc; i++) {
    t_entry e = mk(strtoull(argv[i], NULL, 10));
    if (promote_check(t, &e) != 1) {
      fprintf(stderr, "child: entry seed %s not promoted identical\n", argv[i]);
      bad++;
    }
    t_free(&e);
  }
  kvt_stats s = stats_of(t);
  if (s.remote_hits != (uint64_t)(argc - 5)) {
    fprintf(stderr, "child: remote_hits %llu\n",
            (unsigned long long)s.remote_hits);
    bad++;
  }
  t_entry x = mk(999);
  kvt_tier_start_writer(t);
  if (t_spill(t, &x) != 0 || kvt_tier_flush(t, 10000) != 0)
    bad++;
  if (stats_of(t).remote_spill_count != 1)
    bad++;
  t_free(&x);
  kvt_tier_free(t);
  return bad ? 1 : 0;
}

static const char *g_self;

static int run_child(const char *url, const char *prefix, const char *dir,
                     const uint64_t *seeds, int n) {
  char sb[32][24];
  const char *argv[40];
  int a = 0;
  argv[a++] = g_self;
  argv[a++] = "--child";
  argv[a++] = url;
  argv[a++] = prefix;
  argv[a++] = dir;
  for (int i = 0; i < n && i < 32; i++) {
    snprintf(sb[i], sizeof sb[i], "%llu", (unsigned long long)seeds[i]);
    argv[a++] = sb[i];
  }
  argv[a] = NULL;
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    execv(g_self, (char *const *)argv);
    _exit(127);
  }
  int st = 0;
  waitpid(pid, &st, 0);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

static char *entry_hash(const t_entry *e) {
  static char h[KVT_HASH_HEX_LEN + 1];
  kvt_token_hash(h, e->tokens, e->n_tokens);
  return h;
}

/* Number of keys of an entry on a server (SCAN by pattern). */
static int count_keys(int port, const char *prefix, const char *hash) {
  char *o = sh_out("redis-cli -h 127.0.0.1 -p %d --scan --pattern '%s{%s}*'",
                   port, prefix, hash);
  int n = 0;
  for (char *p = o; *p; p++)
    n += *p == '\n';
  free(o);
  return n;
}

/* Name of one chunk key (not the manifest) of an entry. */
static char *a_chunk_key(int port, const char *prefix, const char *hash) {
  char *o = sh_out("redis-cli -h 127.0.0.1 -p %d --scan --pattern '%s{%s}:*:1'",
                   port, prefix, hash);
  char *nl = strchr(o, '\n');
  if (nl)
    *nl = '\0';
  return o;
}

/* ------------------------------------------------------------------------ */
/* Standalone                                                               */
/* ------------------------------------------------------------------------ */

/* Starts a standalone server (extra: as start_server) in a fresh directory
 * named by tag; url receives its redis:// URL, *port its port. Returns the
 * server's index for kill_server. */
static int start_standalone(const char *tag, const char *extra, char url[128],
                            int *port) {
  *port = pick_port();
  REQUIRE(*port > 0);
  int srv = start_server(*port, kvt_test_tmpdir(tag), extra);
  snprintf(url, 128, "redis://127.0.0.1:%d", *port);
  return srv;
}

static void test_standalone(void) {
  int port;
  char url[128];
  int srv = start_standalone("redis-a", NULL, url, &port);
  const char *P = "t1:";

  kvt_options o = ropts("rt-a", url, P, KVT_REMOTE_LOCAL_AND_REMOTE);
  kvt_tier *a = t_open(&o);
  REQUIRE(kvt_tier_start_writer(a) == 0);
  uint64_t seeds[] = {1, 2, 3, 4, 5};
  for (int i = 0; i < 5; i++) {
    t_entry e = mk(seeds[i]);
    CHECK(t_spill(a, &e) == 0);
    t_free(&e);
  }
  CHECK(kvt_tier_flush(a, 10000) == 0);
  kvt_stats s = stats_of(a);
  CHECK_EQ_INT(s.spill_count, 5);
  CHECK_EQ_INT(s.remote_spill_count, 5);
  CHECK(s.remote_spill_bytes > 5 * 16384);
  CHECK_EQ_INT(s.remote_available, 1);

  /* The second node promotes all of them, then spills one back. */
  char *bdir = kvt_test_tmpdir("rt-b");
  CHECK_EQ_INT(run_child(url, P, bdir, seeds, 5), 0);
  t_entry x = mk(999);
  CHECK_EQ_INT(promote_check(a, &x), 1);
  s = stats_of(a);
  CHECK_EQ_INT(s.remote_hits, 1);
  CHECK_EQ_INT(s.ssd_hits, 1);
  /* ... and kept a local copy: the next promote is local. */
  CHECK_EQ_INT(promote_check(a, &x), 1);
  CHECK_EQ_INT(stats_of(a).remote_hits, 1);
  CHECK_EQ_INT(stats_of(a).ssd_hits, 2);
  kvt_entry_info li;
  CHECK(kvt_tier_lookup(&li, a, x.tokens, x.n_tokens) == 0);

  /* Remote only, longest prefix: a query extending entry 3. */
  kvt_options oc = ropts("rt-c", url, P, KVT_REMOTE_ONLY);
  kvt_tier *c = t_open(&oc);
  t_entry e3 = mk(3);
  t_entry q = mk(77);
  size_t qn = e3.n_tokens + 9;
  int32_t *qt = calloc(qn, sizeof *qt);
  memcpy(qt, e3.tokens, e3.n_tokens * 4);
  for (size_t i = e3.n_tokens; i < qn; i++)
    qt[i] = (int32_t)i;
  kvt_promote_opts po = KVT_PROMOTE_OPTS_INIT;
  po.flags = KVT_PROMOTE_PREFIX;
  kvt_entry *got = NULL;
  CHECK(kvt_tier_promote(&got, c, qt, qn, &po) == 0);
  CHECK(got && t_same(got, &e3));
  kvt_entry_free(got);
  got = NULL;
  /* A short prefix of an entry is not an entry. */
  CHECK(kvt_tier_promote(&got, c, e3.tokens, e3.n_tokens - 1, &po) ==
        KVT_ENOTFOUND);
  /* Remote-only spill: nothing local, readable by others. */
  kvt_tier_start_writer(c);
  CHECK(t_spill(c, &q) == 0);
  CHECK(kvt_tier_flush(c, 10000) == 0);
  /* Lookups see remote entries (issue 16): what a promote will find. */
  CHECK(kvt_tier_lookup(&li, c, q.tokens, q.n_tokens) == 0);
  CHECK_EQ_INT(li.num_tokens, q.n_tokens);
  CHECK(!strcmp(li.token_hash, entry_hash(&q)));
  /* Node A learns of q through the pub/sub event (or its next resync): wait
   * for its lookup to see it, bounded (10 s), before promoting there. */
  for (int w = 0; w < 200 && kvt_tier_lookup(&li, a, q.tokens, q.n_tokens) != 0;
       w++)
    msleep(50);
  CHECK_EQ_INT(promote_check(a, &q), 1);
  free(qt);
  t_free(&q);
  t_free(&e3);

  /* Stats renderings carry the per-tier counters. */
  char buf[32768];
  size_t need = 0;
  s = stats_of(a);
  CHECK(kvt_stats_to_json(buf, sizeof buf, &need, &s) == 0);
  CHECK(strstr(buf, "\"remote_hits\":2") != NULL);
  CHECK(strstr(buf, "\"local_hits\":1") != NULL);
  CHECK(kvt_stats_to_prometheus(buf, sizeof buf, &need, &s) == 0);
  CHECK(strstr(buf, "kvtier_remote_hits_total 2") != NULL);

  /* A deleted chunk: a miss, and what is left of the entry is cleaned. */
  t_entry e2 = mk(2);
  char h2[KVT_HASH_HEX_LEN + 1];
  snprintf(h2, sizeof h2, "%s", entry_hash(&e2));
  char *ck = a_chunk_key(port, P, h2);
  CHECK(ck[0] != '\0');
  free(sh_out("redis-cli -h 127.0.0.1 -p %d DEL '%s'", port, ck));
  free(ck);
  CHECK_EQ_INT(promote_check(c, &e2), 0);
  CHECK(strstr(kvt_last_error(), "gone") != NULL);
  CHECK_EQ_INT(count_keys(port, P, h2), 0);
  /* A damaged chunk: a miss (never the data), cleaned, counted. */
  t_entry e4 = mk(4);
  char h4[KVT_HASH_HEX_LEN + 1];
  snprintf(h4, sizeof h4, "%s", entry_hash(&e4));
  ck = a_chunk_key(port, P, h4);
  free(sh_out("redis-cli -h 127.0.0.1 -p %d SETRANGE '%s' 100 XXXX", port, ck));
  free(ck);
  uint64_t err0 = stats_of(c).remote_errors;
  CHECK_EQ_INT(promote_check(c, &e4), 0);
  CHECK(strstr(kvt_last_error(), "damaged") != NULL);
  CHECK(stats_of(c).remote_errors > err0);
  CHECK_EQ_INT(count_keys(port, P, h4), 0);
  /* A deleted manifest: a plain miss. */
  t_entry e5 = mk(5);
  free(sh_out("redis-cli -h 127.0.0.1 -p %d DEL '%s{%s}:m'", port, P,
              entry_hash(&e5)));
  CHECK_EQ_INT(promote_check(c, &e5), 0);
  /* Another prefix is another store. */
  kvt_options od = ropts("rt-d", url, "other:", KVT_REMOTE_ONLY);
  kvt_tier *d = t_open(&od);
  t_entry e1 = mk(1);
  CHECK_EQ_INT(promote_check(d, &e1), 0);
  kvt_tier_free(d);
  CHECK_EQ_INT(promote_check(c, &e1), 1);

  /* FLUSHALL: every remote entry is gone; promotes are clean misses, the
   * local tier still serves its own entries. */
  free(sh_out("redis-cli -h 127.0.0.1 -p %d FLUSHALL", port));
  CHECK_EQ_INT(promote_check(c, &e1), 0);
  CHECK(kvt_tier_promote(&got, c, x.tokens, x.n_tokens - 1, NULL) ==
        KVT_ENOTFOUND);
  CHECK_EQ_INT(promote_check(a, &e1), 1); /* a spilled it: local */
  /* The server dies: clear errors, no stall, local tier keeps working. */
  kill_server(srv);
  t_entry n1 = mk(31);
  CHECK(t_spill(a, &n1) == 0);
  CHECK(kvt_tier_flush(a, 10000) == 0);
  CHECK_EQ_INT(promote_check(a, &n1), 1); /* local */
  CHECK_EQ_INT(promote_check(a, &e2), 1); /* local copy from the spill */
  t_entry gone = mk(32);
  CHECK_EQ_INT(promote_check(a, &gone), 0);
  s = stats_of(a);
  CHECK(s.remote_errors >= 1);
  CHECK_EQ_INT(s.remote_available, 0);
  CHECK_EQ_INT(promote_check(c, &e1), 0); /* remote only: a miss */
  CHECK(kvt_tier_close(a, 10000) == 0);
  kvt_tier_free(a);
  kvt_tier_free(c);
  t_free(&n1);
  t_free(&gone);
  t_free(&e1);
  t_free(&e2);
  t_free(&e4);
  t_free(&e5);
  t_free(&x);
}

/* PTTL of a key in ms (-1: no expiry, -2: no key). */
static long pttl(int port, const char *key) {
  char *o = sh_out("redis-cli -h 127.0.0.1 -p %d PTTL '%s'", port, key);
  long v = strtol(o, NULL, 10);
  free(o);
  return v;
}

/* With retention, every key an upload writes (chunks, manifest, prefix set)
 * expires with it; without, none does. */
/* Lookups from several threads of node B while node A spills: the mirror
 * learns each entry from A's events (B's lookups find it within a few
 * seconds without B promoting anything), exact and as a prefix, and
 * kvt_tier_read_entry serves it bit-identical (the check_ssd flow). */
typedef struct look_ctx {
  kvt_tier *t;
  atomic_int stop;
  atomic_int bad;
  atomic_long calls;
} look_ctx;

static void *look_main(void *arg) {
  look_ctx *c = arg;
  int32_t q[64];
  uint64_t i = 0;
  while (!atomic_load(&c->stop)) {
    t_entry e = mk(300 + i % 12); /* 40..46 tokens */
    char h[KVT_HASH_HEX_LEN + 1];
    kvt_token_hash(h, e.tokens, e.n_tokens);
    kvt_entry_info info;
    int rc = kvt_tier_lookup(&info, c->t, e.tokens, e.n_tokens);
    if ((rc == 0 &&
         (info.num_tokens != e.n_tokens || strcmp(info.token_hash, h) != 0)) ||
        (rc != 0 && rc != KVT_ENOTFOUND))
      atomic_store(&c->bad, 1);
    memcpy(q, e.tokens, e.n_tokens * sizeof *q);
    q[e.n_tokens] = 777777;
    rc = kvt_tier_lookup_prefix(&info, c->t, q, e.n_tokens + 1);
    if ((rc == 0 &&
         (info.num_tokens != e.n_tokens || strcmp(info.token_hash, h) != 0)) ||
        (rc != 0 && rc != KVT_ENOTFOUND))
      atomic_store(&c->bad, 1);
    t_free(&e);
    atomic_fetch_add(&c->calls, 1);
    i++;
  }
  return NULL;
}

static void test_lookup_mirror(void) {
  int port;
  char url[128];
  start_standalone("redis-lm", NULL, url, &port);
  kvt_options oa = ropts("rt-lm-a", url, "lm:", KVT_REMOTE_LOCAL_AND_REMOTE);
  kvt_options ob = ropts("rt-lm-b", url, "lm:", KVT_REMOTE_LOCAL_AND_REMOTE);
  ob.remote_flags = KVT_REMOTE_NO_LOCAL_COPY;
  kvt_tier *a = t_open(&oa), *b = t_open(&ob);
  look_ctx lc = {.t = b};
  pthread_t th[2];
  for (int i = 0; i < 2; i++)
    REQUIRE(pthread_create(&th[i], NULL, look_main, &lc) == 0);
  CHECK(kvt_tier_start_writer(a) == 0);
  for (uint64_t s = 300; s < 312; s++) {
    t_entry e = mk(s);
    CHECK(t_spill(a, &e) == 0);
    t_free(&e);
  }
  CHECK(kvt_tier_flush(a, 20000) == 0);
  CHECK_EQ_INT(stats_of(a).remote_spill_count, 12);
  int found = 0;
  for (int tries = 0; tries < 100 && found < 12; tries++) {
    found = 0;
    for (uint64_t s = 300; s < 312; s++) {
      t_entry e = mk(s);
      kvt_entry_info info;
      found += kvt_tier_lookup(&info, b, e.tokens, e.n_tokens) == 0;
      t_free(&e);
    }
    if (found < 12)
      msleep(50);
  }
  CHECK_EQ_INT(found, 12);
  atomic_store(&lc.stop, 1);
  for (int i = 0; i < 2; i++)
    pthread_join(th[i], NULL);
  CHECK(!atomic_load(&lc.bad));
  CHECK(atomic_load(&lc.calls) > 0);
  /* The check_ssd flow on one of them: prefix lookup, then read_entry. */
  t_entry e = mk(305);
  int32_t *q = malloc((e.n_tokens + 5) * sizeof *q);
  memcpy(q, e.tokens, e.n_tokens * sizeof *q);
  for (int i = 0; i < 5; i++)
    q[e.n_tokens + i] = 888000 + i;
  kvt_entry_info info;
  CHECK(kvt_tier_lookup_prefix(&info, b, q, e.n_tokens + 5) == 0);
  CHECK_EQ_INT(info.num_tokens, e.n_tokens);
  kvt_entry *got = NULL;
  CHECK(kvt_tier_read_entry(&got, b, q, (size_t)info.num_tokens,
                            info.token_hash) == 0);
  CHECK(got && t_same(got, &e));
  kvt_entry_free(got);
  /* Lookups count nothing; the read is a remote hit. */
  kvt_stats sb = stats_of(b);
  CHECK_EQ_INT(sb.remote_misses, 0);
  CHECK_EQ_INT(sb.remote_hits, 1);
  free(q);
  t_free(&e);
  kvt_tier_free(a);
  kvt_tier_free(b);
}

static void test_retention_ttl(void) {
  int port;
  char url[128];
  int srv = start_standalone("redis-ttl", NULL, url, &port);
  for (int ret = 0; ret < 2; ret++) {
    const char *P = ret ? "ttl:" : "nottl:";
    kvt_options o =
        ropts(ret ? "rt-ttl" : "rt-nottl", url, P, KVT_REMOTE_LOCAL_AND_REMOTE);
    o.retention_seconds = ret ? 3600 : 0;
    kvt_tier *t = t_open(&o);
    REQUIRE(kvt_tier_start_writer(t) == 0);
    t_entry e = mk(41);
    CHECK(t_spill(t, &e) == 0);
    CHECK(kvt_tier_flush(t, 10000) == 0);
    CHECK_EQ_INT(stats_of(t).remote_spill_count, 1);
    char key[256];
    snprintf(key, sizeof key, "%s{%s}:m", P, entry_hash(&e));
    long m = pttl(port, key);
    char *ck = a_chunk_key(port, P, entry_hash(&e));
    long c = pttl(port, ck);
    free(ck);
    char *zs = sh_out("redis-cli -h 127.0.0.1 -p %d --scan --pattern '%s{z:*'",
                      port, P);
    char *nl = strchr(zs, '\n');
    if (nl)
      *nl = '\0';
    long z = pttl(port, zs);
    free(zs);
    if (ret) {
      CHECK(m > 0 && m <= 3600000);
      CHECK(c > 0 && c <= 3600000);
      CHECK(z > 0 && z <= 3600000);
    } else {
      CHECK_EQ_INT(m, -1);
      CHECK_EQ_INT(c, -1);
      CHECK_EQ_INT(z, -1);
    }
    CHECK(kvt_tier_close(t, 10000) == 0);
    kvt_tier_free(t);
    t_free(&e);
  }
  kill_server(srv);
}

/* Longest prefix among many siblings sharing the first 16 tokens: the match
 * sorts after 300 longer non-matching candidates (read in pages). */
static void test_prefix_paging(void) {
  int port;
  char url[128];
  start_standalone("redis-p", NULL, url, &port);
  kvt_options o = ropts("rt-p", url, "pg:", KVT_REMOTE_ONLY);
  o.spill_queue_size = 512;
  o.remote_queue_size = 512;
  kvt_tier *a = t_open(&o);
  kvt_tier_start_writer(a);
  t_entry base = t_make(77, 20, 1, 1, 4);
  CHECK(t_spill(a, &base) == 0);
  for (int i = 0; i < 300; i++) {
    t_entry sib = t_make(5000 + (uint64_t)i, 40, 1, 1, 4);
    t_set_prefix(&sib, &base);
    CHECK(t_spill(a, &sib) == 0);
    t_free(&sib);
  }
  CHECK(kvt_tier_flush(a, 30000) == 0);
  CHECK_EQ_INT(stats_of(a).remote_spill_count, 301);
  int32_t q[50];
  memcpy(q, base.tokens, 20 * sizeof *q);
  for (int i = 20; i < 50; i++)
    q[i] = 90000 + i;
  kvt_promote_opts po = KVT_PROMOTE_OPTS_INIT;
  po.flags = KVT_PROMOTE_PREFIX;
  kvt_entry *got = NULL;
  CHECK(kvt_tier_promote(&got, a, q, 50, &po) == 0);
  CHECK(got && t_same(got, &base));
  kvt_entry_free(got);
  got = NULL;
  /* A local prefix and a longer remote one that turns out unreadable: the
   * promote falls back to the local prefix. */
  kvt_options ol = ropts("rt-pl", url, "pg:", KVT_REMOTE_LOCAL_AND_REMOTE);
  kvt_tier *l = t_open(&ol);
  kvt_tier_start_writer(l);
  CHECK(t_spill(l, &base) == 0);
  CHECK(kvt_tier_flush(l, 10000) == 0);
  t_entry sib0 = t_make(5000, 40, 1, 1, 4);
  t_set_prefix(&sib0, &base);
  int32_t q2[45];
  memcpy(q2, sib0.tokens, 40 * sizeof *q2);
  for (int i = 40; i < 45; i++)
    q2[i] = 91000 + i;
  char *ck = a_chunk_key(port, "pg:", entry_hash(&sib0));
  if (!ck[0]) { /* a one-chunk entry: drop its only chunk */
    free(ck);
    ck = sh_out("redis-cli -h 127.0.0.1 -p %d --scan --pattern 'pg:{%s}:*:0'",
                port, entry_hash(&sib0));
    char *nl = strchr(ck, '\n');
    if (nl)
      *nl = '\0';
  }
  CHECK(ck[0] != '\0');
  free(sh_out("redis-cli -h 127.0.0.1 -p %d DEL '%s'", port, ck));
  free(ck);
  uint64_t miss0 = stats_of(l).ssd_misses;
  CHECK(kvt_tier_promote(&got, l, q2, 45, &po) == 0);
  CHECK(got && t_same(got, &base));
  kvt_entry_free(got);
  kvt_stats ls = stats_of(l);
  CHECK(ls.remote_misses >= 1);
  CHECK_EQ_INT(ls.ssd_misses, miss0);
  CHECK_EQ_INT(ls.remote_hits, 0);
  t_free(&sib0);
  kvt_tier_free(l);
  t_free(&base);
  kvt_tier_free(a);
}

/* Eviction under maxmemory with allkeys-lru: some entries lose keys; every
 * promote is then bit-identical or a miss. Which keys go is Redis's sampled
 * LRU: a round where every entry lost a key (or none did) proves nothing
 * about serving the survivors, so it is run again on an emptied server (at
 * most 3 rounds); wrong data fails every round. */
static void test_eviction(void) {
  int port;
  char url[128];
  start_standalone("redis-e", "--maxmemory 3mb --maxmemory-policy allkeys-lru",
                   url, &port);
  int hits = 0, misses = 0, bad = 0;
  for (int round = 0; round < 3 && !(hits > 0 && misses > 0); round++) {
    CHECK(cli_ok(port, "FLUSHALL", "OK"));
    kvt_options o = ropts("rt-e", url, "ev:", KVT_REMOTE_ONLY);
    o.spill_queue_size = 256;
    o.remote_queue_size = 256;
    kvt_tier *a = t_open(&o);
    kvt_tier_start_writer(a);
    int n = 200; /* ~3.5 MB of values: over maxmemory */
    for (int i = 0; i < n; i++) {
      t_entry e = mk(1000 + (uint64_t)i);
      CHECK(t_spill(a, &e) == 0);
      t_free(&e);
      if (i % 20 == 19)
        kvt_tier_flush(a, 10000);
    }
    CHECK(kvt_tier_flush(a, 10000) == 0);
    kvt_options ob = ropts("rt-e2", url, "ev:", KVT_REMOTE_ONLY);
    kvt_tier *b = t_open(&ob);
    hits = misses = 0;
    for (int i = 0; i < n; i++) {
      t_entry e = mk(1000 + (uint64_t)i);
      int r = promote_check(b, &e);
      hits += r == 1;
      misses += r == 0;
      bad += r < 0;
      t_free(&e);
    }
    fprintf(stderr, "eviction round %d: %d hits, %d misses\n", round, hits,
            misses);
    kvt_tier_free(a);
    kvt_tier_free(b);
  }
  CHECK_EQ_INT(bad, 0);
  CHECK(hits > 0);
  CHECK(misses > 0);
}

/* ------------------------------------------------------------------------ */
/* Chunks shared between nodes (docs/REMOTE.md "Chunks")                    */
/* ------------------------------------------------------------------------ */

/* Rows [0, m) of every tensor of got equal e's (tensors [1, 2, T, D]). */
static int same_rows(const kvt_entry *got, const t_entry *e, size_t m) {
  size_t n = 0;
  if (!got || kvt_entry_num_layers(got) != e->n_layers ||
      !kvt_entry_tokens(got, &n) || n != m)
    return 0;
  for (uint32_t l = 0; l < e->n_layers; l++) {
    const kvt_layer *gl = kvt_entry_layer(got, l);
    for (uint32_t k = 0; k < 2; k++) {
      const kvt_tensor *a = &gl->tensors[k];
      const kvt_tensor *b = &e->layers[l].tensors[k];
      size_t D = (size_t)b->shape[3], T = (size_t)b->shape[2];
      if (a->shape[2] != (int64_t)m || gl->offset != (int64_t)m)
        return 0;
      for (size_t h = 0; h < 2; h++)
        if (memcmp((const float *)a->data + h * m * D,
                   (const float *)b->data + h * T * D, m * D * 4))
          return 0;
    }
  }
  return 1;
}

static void test_chunks(void) {
  int port;
  char url[128];
  int srv =
      start_standalone("redis-ch", "--notify-keyspace-events Exe", url, &port);
  const char *P = "ch:";
  kvt_options o = ropts("rt-ch-a", url, P, KVT_REMOTE_LOCAL_AND_REMOTE);
  o.chunk_tokens = 16;
  o.model_id = "m";
  kvt_tier *a = t_open(&o);
  REQUIRE(kvt_tier_start_writer(a) == 0);
  t_entry e = t_make(77, 100, 2, 100, 8); /* 6 chunks + a 4-token tail */
  CHECK(t_spill(a, &e) == 0);
  CHECK(kvt_tier_flush(a, 30000) == 0);
  CHECK(stats_of(a).remote_spill_count == 1);
  /* content addressed: 6 chunk keys, the tail's manifest */
  char *o1 =
      sh_out("redis-cli -p %d --scan --pattern '%s{c:*' | wc -l", port, P);
  CHECK(o1 && atoi(o1) == 6);
  free(o1);

  /* B: exact promote of A's entry, fetching the 6 chunks it lacks */
  kvt_options ob = ropts("rt-ch-b", url, P, KVT_REMOTE_LOCAL_AND_REMOTE);
  ob.chunk_tokens = 16;
  ob.model_id = "m";
  kvt_tier *b = t_open(&ob);
  kvt_entry_info info;
  int tries = 0;
  while (kvt_tier_lookup(&info, b, e.tokens, e.n_tokens) != 0 && tries++ < 200)
    msleep(25);
  CHECK(info.num_tokens == 100 && info.memory_bytes == e.memory_bytes);
  CHECK(promote_check(b, &e) == 1);
  kvt_stats sb = stats_of(b);
  CHECK(sb.remote_hits == 1 && sb.remote_read_bytes > 0);
  CHECK(kvt_test_each_chunk(ob.cache_dir, NULL, NULL) == 6);
  CHECK(promote_check(b, &e) == 1); /* now local: nothing fetched */
  CHECK(stats_of(b).remote_read_bytes == sb.remote_read_bytes);

  /* C: a chunk-aligned prefix no spill ended at (70 tokens + its own) */
  kvt_options oc = ropts("rt-ch-c", url, P, KVT_REMOTE_LOCAL_AND_REMOTE);
  oc.chunk_tokens = 16;
  oc.model_id = "m";
  oc.clock_fn = t_clock; /* the chain's stamps are this clock's */
  t_clock_now = 4242.0;
  kvt_tier *c = t_open(&oc);
  int32_t q[80];
  memcpy(q, e.tokens, 70 * sizeof *q);
  for (int i = 70; i < 80; i++)
    q[i] = 60000 + i;
  tries = 0;
  while (kvt_tier_lookup_prefix(&info, c, q, 80) != 0 && tries++ < 200)
    msleep(25);
  CHECK(info.num_tokens == 64);
  CHECK(info.created_at == 4242.0 && info.accessed_at == 4242.0);
  kvt_promote_opts po = KVT_PROMOTE_OPTS_INIT;
  po.flags = KVT_PROMOTE_PREFIX;
  kvt_entry *got = NULL;
  CHECK(kvt_tier_promote(&got, c, q, 80, &po) == 0);
  CHECK(same_rows(got, &e, 64));
  kvt_entry_free(got);
  CHECK(kvt_test_each_chunk(oc.cache_dir, NULL, NULL) == 4);
  /* read_entry of that prefix by its hash: local now */
  char h64[65];
  kvt_token_hash(h64, q, 64);
  got = NULL;
  CHECK(kvt_tier_read_entry(&got, c, q, 64, h64) == 0);
  CHECK(same_rows(got, &e, 64));
  kvt_entry_free(got);

  /* another model_id on the same store sees none of it */
  kvt_options od = ropts("rt-ch-d", url, P, KVT_REMOTE_LOCAL_AND_REMOTE);
  od.chunk_tokens = 16;
  od.model_id = "other";
  kvt_tier *d = t_open(&od);
  msleep(200);
  CHECK(kvt_tier_lookup(&info, d, e.tokens, e.n_tokens) == KVT_ENOTFOUND);
  CHECK(kvt_tier_lookup_prefix(&info, d, q, 80) == KVT_ENOTFOUND);
  CHECK(promote_check(d, &e) == 0);
  CHECK(kvt_test_each_chunk(od.cache_dir, NULL, NULL) == 0);
  kvt_tier_free(d);

  /* remote-only: the spill's chunks are uploaded from the snapshot (none
   * stored locally), the 6 shared ones not sent again; read back by B */
  kvt_options oe = ropts("rt-ch-e", url, P, KVT_REMOTE_ONLY);
  oe.chunk_tokens = 16;
  oe.model_id = "m";
  kvt_tier *ro = t_open(&oe);
  REQUIRE(kvt_tier_start_writer(ro) == 0);
  t_entry f = t_make(78, 130, 2, 130, 8);
  memcpy(f.tokens, e.tokens, 96 * sizeof *f.tokens); /* e's 6 chunks */
  kvt_token_hash(f.hash, f.tokens, f.n_tokens);
  for (uint32_t l = 0; l < 2; l++) /* the same KV rows for them */
    for (uint32_t k = 0; k < 2; k++)
      for (size_t h = 0; h < 2; h++)
        memcpy((float *)f.layers[l].tensors[k].data + h * 130 * 8,
               (const float *)e.layers[l].tensors[k].data + h * 100 * 8,
               96 * 8 * 4);
  CHECK(t_spill(ro, &f) == 0);
  CHECK(kvt_tier_flush(ro, 30000) == 0);
  CHECK(stats_of(ro).remote_spill_count == 1);
  CHECK(kvt_test_each_chunk(oe.cache_dir, NULL, NULL) == 0);
  char *o2 =
      sh_out("redis-cli -p %d --scan --pattern '%s{c:*' | wc -l", port, P);
  CHECK(o2 && atoi(o2) == 8); /* 6 shared + 2 new */
  free(o2);
  tries = 0;
  while (kvt_tier_lookup(&info, b, f.tokens, f.n_tokens) != 0 && tries++ < 200)
    msleep(25);
  CHECK(promote_check(b, &f) == 1);
  CHECK(kvt_test_each_chunk(ob.cache_dir, NULL, NULL) ==
        8); /* fetched only the 2 new */
  kvt_tier_free(ro);
  t_free(&f);

  /* remote verify of a chained entry checks every chunk; damaged chunks
   * are found (the entry is then removed, as every remote reader does) */
  CHECK(kvt_tier_remote_verify(a, e.hash) == 0);
  char *rr = sh_out("redis-cli -p %d --scan --pattern '%s{c:*' | while read k; "
                    "do redis-cli -p %d SETRANGE \"$k\" 300 XXXX; done",
                    port, P, port);
  free(rr);
  CHECK(kvt_tier_remote_verify(a, e.hash) == KVT_ECORRUPT);
  CHECK(kvt_tier_remote_verify(a, e.hash) == KVT_ENOTFOUND); /* removed */
  kvt_tier_free(c);
  kvt_tier_free(b);
  kvt_tier_free(a);
  t_free(&e);
  kill_server(srv);
}

/* Overwrites 8 bytes every 64 through the second half of the first chunk
 * file it is given: the data section lies there (only its block checksums
 * can tell), whatever padding the header has. */
static void damage_first(void *ctx, const char *path) {
  int *done = ctx;
  if (*done)
    return;
  FILE *f = fopen(path, "r+b");
  if (!f)
    return;
  long size = fseek(f, 0, SEEK_END) == 0 ? ftell(f) : -1;
  for (long at = size / 2; size > 64 && at + 8 <= size; at += 64)
    if (fseek(f, at, SEEK_SET) == 0 && fwrite("XXXXXXXX", 1, 8, f) == 8)
      *done = 1;
  fclose(f);
}

/* A chunked local+remote tier of namespace "m", 16 tokens a chunk. */
static kvt_tier *open_chunked(const char *tag, const char *url,
                              const char *prefix, const char **dir) {
  kvt_options o = ropts(tag, url, prefix, KVT_REMOTE_LOCAL_AND_REMOTE);
  o.chunk_tokens = 16;
  o.model_id = "m";
  *dir = o.cache_dir;
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  return t;
}

/* Chunks the server holds under prefix. */
static int server_chunks(int port, const char *prefix) {
  char *out =
      sh_out("redis-cli -p %d --scan --pattern '%s{c:*' | wc -l", port, prefix);
  int n = out ? atoi(out) : -1;
  free(out);
  return n;
}

/* An upload reads the chunks the remote store lacks from the local store and
 * verifies each: a local chunk damaged on disk is not sent; it goes to the
 * local quarantine and the upload writes that chunk from the spill instead,
 * so another node fetches a chain that verifies. */
static void test_chunks_damaged_upload(void) {
  int port;
  char url[128];
  int srv =
      start_standalone("redis-cd", "--notify-keyspace-events Exe", url, &port);
  const char *adir, *bdir;
  kvt_tier *a = open_chunked("rt-cd-a", url, "cd:", &adir);
  t_entry e = t_make(91, 100, 2, 100, 8); /* 6 chunks + a 4-token tail */
  int spilled = t_spill(a, &e) == 0 && kvt_tier_flush(a, 30000) == 0;
  CHECK(spilled && stats_of(a).remote_spill_count == 1);
  /* The server loses everything; a local chunk is damaged on disk. */
  free(sh_out("redis-cli -p %d FLUSHALL", port));
  CHECK_EQ_INT(server_chunks(port, "cd:"), 0);
  int damaged = 0;
  CHECK(kvt_test_each_chunk(adir, damage_first, &damaged) == 6);
  REQUIRE(damaged == 1);
  /* The same spill again writes no chunk locally and uploads all six from
   * the local store, the damaged one from the spill. */
  spilled = t_spill(a, &e) == 0 && kvt_tier_flush(a, 30000) == 0;
  kvt_stats sa = stats_of(a);
  CHECK(spilled && sa.remote_spill_count == 2);
  CHECK_EQ_INT(sa.chunks_quarantined, 1);
  CHECK_EQ_INT(server_chunks(port, "cd:"), 6);
  /* Another node fetches the chain (every chunk verified) and serves it. */
  kvt_tier *b = open_chunked("rt-cd-b", url, "cd:", &bdir);
  kvt_entry_info info;
  for (int i = 0; i < 200 && kvt_tier_lookup(&info, b, e.tokens, 100); i++)
    msleep(25);
  CHECK_EQ_INT(promote_check(b, &e), 1);
  CHECK_EQ_INT(kvt_test_each_chunk(bdir, NULL, NULL), 6);
  CHECK_EQ_INT(kvt_tier_remote_verify(a, e.hash), 0);
  kvt_tier_free(b);
  kvt_tier_free(a);
  t_free(&e);
  kill_server(srv);
}

/* ------------------------------------------------------------------------ */

/* Cluster                                                                  */
/* ------------------------------------------------------------------------ */

static uint16_t crc16(const char *b, size_t n) {
  uint16_t c = 0;
  for (size_t i = 0; i < n; i++) {
    c ^= (uint16_t)((uint8_t)b[i] << 8);
    for (int k = 0; k < 8; k++)
      c = (c & 0x8000) ? (uint16_t)((c << 1) ^ 0x1021) : (uint16_t)(c << 1);
  }
  return c;
}

static int slot_of_hash(const char *hash) {
  return crc16(hash, strlen(hash)) & 16383; /* the hash tag is {hash} */
}

typedef struct cnode {
  char id[64];
  int port;
  int lo[8], hi[8], nr;
} cnode;

/* Masters and their slot ranges from CLUSTER NODES. */
static int cluster_nodes(int port, cnode *out, int max) {
  char *o = sh_out("redis-cli -h 127.0.0.1 -p %d CLUSTER NODES", port);
  int n = 0;
  for (char *line = strtok(o, "\n"); line && n < max;
       line = strtok(NULL, "\n")) {
    char id[64], addr[128], flags[128];
    int off = 0;
    if (sscanf(line, "%63s %127s %127s %*s %*s %*s %*s %*s%n", id, addr, flags,
               &off) < 3 ||
        !strstr(flags, "master") || strstr(flags, "fail"))
      continue;
    cnode *c = &out[n++];
    memset(c, 0, sizeof *c);
    snprintf(c->id, sizeof c->id, "%s", id);
    char *colon = strchr(addr, ':');
    c->port = colon ? atoi(colon + 1) : 0;
    char *p = line + off;
    while (*p && c->nr < 8) {
      while (*p == ' ')
        p++;
      if (!*p)
        break;
      if (*p == '[') {
        p = strchr(p, ']');
        if (!p)
          break;
        p++;
        continue;
      }
      int lo = 0, hi = 0, k = 0;
      if (sscanf(p, "%d-%d%n", &lo, &hi, &k) == 2) {
        c->lo[c->nr] = lo;
        c->hi[c->nr++] = hi;
      } else if (sscanf(p, "%d%n", &lo, &k) == 1) {
        c->lo[c->nr] = c->hi[c->nr] = lo;
        c->nr++;
      } else {
        break;
      }
      p += k;
    }
  }
  free(o);
  return n;
}

static int owner_port(const cnode *ns, int n, int slot) {
  for (int i = 0; i < n; i++)
    for (int r = 0; r < ns[i].nr; r++)
      if (slot >= ns[i].lo[r] && slot <= ns[i].hi[r])
        return ns[i].port;
  return -1;
}

static const cnode *node_by_port(const cnode *ns, int n, int port) {
  for (int i = 0; i < n; i++)
    if (ns[i].port == port)
      return &ns[i];
  return NULL;
}

static void test_cluster(void) {
  int ports[3], idx[3];
  char *dirs[3];
  char hosts[256] = "";
  for (int i = 0; i < 3; i++) {
    ports[i] = pick_port();
    REQUIRE(ports[i] > 0);
    g_ports[g_n] = ports[i]; /* reserve before the next pick */
    char tag[16];
    snprintf(tag, sizeof tag, "redis-c%d", i);
    dirs[i] = kvt_test_tmpdir(tag);
    idx[i] = start_server(ports[i], dirs[i],
                          "--cluster-enabled yes --cluster-config-file "
                          "nodes.conf --cluster-node-timeout 1500 "
                          "--cluster-require-full-coverage no");
    size_t l = strlen(hosts);
    snprintf(hosts + l, sizeof hosts - l, "127.0.0.1:%d ", ports[i]);
  }
  char *o = sh_out("redis-cli --cluster create %s --cluster-replicas 0 "
                   "--cluster-yes 2>&1",
                   hosts);
  int created = strstr(o, "All 16384 slots covered") != NULL;
  if (!created)
    fprintf(stderr, "%s\n", o);
  free(o);
  REQUIRE(created);
  for (int i = 0; i < 200; i++) {
    int ok = 1;
    for (int k = 0; k < 3; k++)
      ok &= cli_ok(ports[k], "CLUSTER INFO", "cluster_state:ok");
    if (ok)
      break;
    msleep(50);
  }
  char url[256];
  /* Two seeds are enough: the rest is learned from CLUSTER SLOTS. */
  snprintf(url, sizeof url, "redis://127.0.0.1:%d,127.0.0.1:%d", ports[0],
           ports[1]);
  const char *P = "c:";
  kvt_options oa = ropts("rt-ca", url, P, KVT_REMOTE_LOCAL_AND_REMOTE);
  kvt_tier *a = t_open(&oa);
  kvt_tier_start_writer(a);
  enum { N = 12 };
  uint64_t seeds[N];
  for (int i = 0; i < N; i++) {
    seeds[i] = 500 + (uint64_t)i;
    t_entry e = mk(seeds[i]);
    CHECK(t_spill(a, &e) == 0);
    t_free(&e);
  }
  CHECK(kvt_tier_flush(a, 20000) == 0);
  CHECK_EQ_INT(stats_of(a).remote_spill_count, N);
  /* Spread over the masters. */
  cnode ns[8];
  int nn = cluster_nodes(ports[0], ns, 8);
  CHECK_EQ_INT(nn, 3);
  int per[3] = {0, 0, 0};
  for (int i = 0; i < N; i++) {
    t_entry e = mk(seeds[i]);
    int op = owner_port(ns, nn, slot_of_hash(entry_hash(&e)));
    for (int k = 0; k < 3; k++)
      per[k] += op == ports[k];
    t_free(&e);
  }
  CHECK(per[0] > 0 && per[1] > 0 && per[2] > 0);
  char *bdir = kvt_test_tmpdir("rt-cb");
  CHECK_EQ_INT(run_child(url, P, bdir, seeds, N), 0);

  /* Slot migration mid-run: entry 0's slot moves to another master. */
  kvt_options oc = ropts("rt-cc", url, P, KVT_REMOTE_ONLY);
  kvt_tier *c = t_open(&oc);
  t_entry m0 = mk(seeds[0]);
  CHECK_EQ_INT(promote_check(c, &m0), 1); /* c's map is now warm */
  char h0[KVT_HASH_HEX_LEN + 1];
  snprintf(h0, sizeof h0, "%s", entry_hash(&m0));
  int slot = slot_of_hash(h0);
  int src = owner_port(ns, nn, slot);
  int dst = src == ports[0] ? ports[1] : ports[0];
  const cnode *S = node_by_port(ns, nn, src), *D = node_by_port(ns, nn, dst);
  REQUIRE(S && D);
  int nkeys = count_keys(src, P, h0);
  CHECK(nkeys >= 3); /* manifest + chunks */
  char cmd[512];
  snprintf(cmd, sizeof cmd, "CLUSTER SETSLOT %d IMPORTING %s", slot, S->id);
  CHECK(cli_ok(dst, cmd, "OK"));
  snprintf(cmd, sizeof cmd, "CLUSTER SETSLOT %d MIGRATING %s", slot, D->id);
  CHECK(cli_ok(src, cmd, "OK"));
  /* Move about half of the entry's keys: reads now need ASK. */
  char *keys = sh_out("redis-cli -h 127.0.0.1 -p %d CLUSTER GETKEYSINSLOT %d "
                      "100",
                      src, slot);
  int nk = 0, moved = 0;
  for (char *k = strtok(keys, "\n"); k; k = strtok(NULL, "\n")) {
    if (nk++ % 2)
      continue;
    char *r = sh_out("redis-cli -h 127.0.0.1 -p %d MIGRATE 127.0.0.1 %d '%s' "
                     "0 5000",
                     src, dst, k);
    moved += strstr(r, "OK") != NULL;
    free(r);
  }
  free(keys);
  CHECK(moved > 0);
  CHECK_EQ_INT(promote_check(c, &m0), 1); /* ASK followed */
  /* Finish: the rest of the keys, then the slot belongs to dst. */
  keys = sh_out("redis-cli -h 127.0.0.1 -p %d CLUSTER GETKEYSINSLOT %d 100",
                src, slot);
  for (char *k = strtok(keys, "\n"); k; k = strtok(NULL, "\n"))
    free(sh_out("redis-cli -h 127.0.0.1 -p %d MIGRATE 127.0.0.1 %d '%s' 0 "
                "5000",
                src, dst, k));
  free(keys);
  snprintf(cmd, sizeof cmd, "CLUSTER SETSLOT %d NODE %s", slot, D->id);
  for (int k = 0; k < 3; k++)
    CHECK(cli_ok(ports[k], cmd, "OK"));
  CHECK_EQ_INT(count_keys(dst, P, h0), nkeys);
  CHECK_EQ_INT(count_keys(src, P, h0), 0);
  CHECK_EQ_INT(promote_check(c, &m0), 1); /* MOVED followed */
  /* A new spill to the moved slot lands on its new owner. */
  kvt_tier_start_writer(c);
  CHECK(kvt_tier_remove(a, m0.tokens, m0.n_tokens) == 0);
  CHECK(t_spill(c, &m0) == 0); /* replace: new generation */
  CHECK(kvt_tier_flush(c, 10000) == 0);
  CHECK_EQ_INT(count_keys(dst, P, h0), nkeys); /* old generation gone */
  CHECK_EQ_INT(promote_check(a, &m0), 1);

  /* Kill a master that owns some entries (not a seed-only node). */
  int victim = 2;
  kill_server(idx[victim]);
  int hits = 0, misses = 0, bad = 0, on_victim = 0;
  kvt_options od = ropts("rt-cd", url, P, KVT_REMOTE_ONLY);
  kvt_tier *d = t_open(&od);
  for (int i = 0; i < N; i++) {
    t_entry e = mk(seeds[i]);
    int r = promote_check(d, &e);
    hits += r == 1;
    misses += r == 0;
    bad += r < 0;
    on_victim += i != 0 && owner_port(ns, nn, slot_of_hash(entry_hash(&e))) ==
                               ports[victim];
    t_free(&e);
  }
  fprintf(stderr, "cluster with a dead master: %d hits, %d misses\n", hits,
          misses);
  CHECK_EQ_INT(bad, 0);
  CHECK(misses >= on_victim && on_victim > 0);
  CHECK(stats_of(d).remote_errors >= 1);
  /* Once the back-off expires, entries on live masters are served again. */
  int live_hit = 0;
  for (int attempt = 0; attempt < 40 && !live_hit; attempt++) {
    msleep(250);
    for (int i = 0; i < N && !live_hit; i++) {
      t_entry e = mk(seeds[i]);
      if (owner_port(ns, nn, slot_of_hash(entry_hash(&e))) != ports[victim] &&
          i != 0)
        live_hit = promote_check(d, &e) == 1;
      t_free(&e);
    }
  }
  CHECK(live_hit);
  /* The local tier of a local+remote node keeps working. */
  t_entry l = mk(4242);
  CHECK(t_spill(a, &l) == 0);
  CHECK(kvt_tier_flush(a, 10000) == 0);
  CHECK_EQ_INT(promote_check(a, &l), 1);
  t_free(&l);
  t_free(&m0);
  kvt_tier_free(a);
  kvt_tier_free(c);
  kvt_tier_free(d);
}

/* The write budget in remote-only mode: the upload is the write, so a
 * spill's reservation must stay in the bucket until the upload thread has
 * counted its bytes. spill_done_fn holds the upload thread in A's report
 * (A counted, a bytes); B, handed over by the writer, waits behind it; C is
 * judged then. With B's reservation still held the bucket (2a + bound) is
 * over half full and C is declined; had the writer given B's reservation
 * back on handing it over, C would see only a and be let in. */
typedef struct held_upload {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int entered, open;
} held_upload;

static void hold_first(void *ctx, const char *hash, int rc) {
  (void)hash;
  (void)rc;
  held_upload *h = ctx;
  pthread_mutex_lock(&h->mu);
  if (h->entered++ == 0) {
    pthread_cond_broadcast(&h->cv);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += 60; /* a broken test must not hang the suite */
    while (!h->open)
      if (pthread_cond_timedwait(&h->cv, &h->mu, &ts) != 0)
        break;
  }
  pthread_mutex_unlock(&h->mu);
}

/* Polls the stats (up to 10 s) until the remote queue holds want uploads. */
static int remote_queued(kvt_tier *t, uint64_t want) {
  for (int i = 0; i < 1000; i++) {
    if (stats_of(t).remote_queue_depth == want)
      return 1;
    msleep(10);
  }
  return 0;
}

static void test_remote_budget(void) {
  int port;
  char url[128];
  int srv = start_standalone("redis-budget", NULL, url, &port);
  t_entry e[4];
  for (int i = 0; i < 4; i++)
    e[i] = t_make(5100 + (uint64_t)i, 32, 2, 32, 32);
  /* Calibration, without a budget: what one upload adds to spill_bytes, and
   * the bound a spill of this shape reserves. */
  kvt_options oc = ropts("rt-bud-cal", url, "bcal:", KVT_REMOTE_ONLY);
  oc.admission_policy = KVT_ADMIT_WRITE_ALL;
  kvt_tier *cal = t_open(&oc);
  REQUIRE(kvt_tier_start_writer(cal) == 0);
  CHECK(t_spill(cal, &e[3]) == 0);
  CHECK(kvt_tier_flush(cal, 30000) == 0);
  uint64_t a = stats_of(cal).spill_bytes;
  uint64_t bound = kvti_admit_spill_bound(cal, e[3].tokens, e[3].n_tokens,
                                          e[3].layers, e[3].n_layers, NULL);
  kvt_tier_free(cal);
  REQUIRE(a > 0 && bound > 0);

  held_upload h = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0};
  const uint64_t cap = 2 * a + bound; /* half: a + bound / 2 */
  kvt_options o = ropts("rt-bud", url, "bud:", KVT_REMOTE_ONLY);
  o.admission_policy = KVT_ADMIT_WRITE_ALL;
  o.write_budget_bytes_per_day = 24 * cap;
  o.clock_fn = t_clock; /* time stands still: nothing drains */
  t_clock_now = 7000.0;
  o.spill_done_fn = hold_first;
  o.spill_done_ctx = &h;
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  CHECK(t_spill(t, &e[0]) == 0); /* A */
  pthread_mutex_lock(&h.mu);
  while (!h.entered)
    pthread_cond_wait(&h.cv, &h.mu);
  pthread_mutex_unlock(&h.mu);
  CHECK(t_spill(t, &e[1]) == 0); /* B: fits beside A's bytes */
  CHECK(remote_queued(t, 1));    /* B handed over, waiting behind A */
  kvt_stats s = stats_of(t);
  CHECK_EQ_INT(s.admission_admitted, 2);
  CHECK(s.write_budget_left + bound <= cap - s.spill_bytes);
  CHECK(t_spill(t, &e[2]) == 0); /* C */
  s = stats_of(t);
  CHECK_EQ_INT(s.admission_declined_budget, 1);
  CHECK_EQ_INT(s.admission_admitted, 2);
  pthread_mutex_lock(&h.mu);
  h.open = 1;
  pthread_cond_broadcast(&h.cv);
  pthread_mutex_unlock(&h.mu);
  CHECK(kvt_tier_flush(t, 30000) == 0);
  s = stats_of(t);
  CHECK_EQ_INT(s.remote_spill_count, 2);
  CHECK(s.spill_bytes <= cap);
  /* Both reservations given back: the budget left is the bucket less the
   * bytes (the gauge rounds down). */
  CHECK(s.write_budget_left + 1 >= cap - s.spill_bytes &&
        s.write_budget_left <= cap - s.spill_bytes);
  kvt_tier_free(t);
  for (int i = 0; i < 4; i++)
    t_free(&e[i]);
  kill_server(srv);
}

/* Options: validation without connecting, and an unreachable server does not
 * fail open nor stall promotes. */
static void test_options(void) {
  kvt_options o = t_opts("rt-opt");
  CHECK(kvt_options_validate(&o) == 0);
  o.remote_mode = KVT_REMOTE_ONLY;
  CHECK(kvt_options_validate(&o) == KVT_EINVAL); /* no URL */
  o.remote_url = "http://x";
  CHECK(kvt_options_validate(&o) == KVT_EINVAL);
  o.remote_url = "redis://127.0.0.1:99999";
  CHECK(kvt_options_validate(&o) == KVT_EINVAL);
  o.remote_url = "redis://:pw@127.0.0.1:1,127.0.0.1:2";
  CHECK(kvt_options_validate(&o) == 0);
  o.remote_prefix = "a{b";
  CHECK(kvt_options_validate(&o) == KVT_EINVAL);
  o.remote_prefix = NULL;
  /* ACL users, TLS URLs, a password holding '@' or ':' (the last '@' ends
   * the credentials; served by a real server in test_remote_lookup.py). */
  o.remote_url = "redis://alice:p@ss:w0rd@127.0.0.1:1";
  CHECK(kvt_options_validate(&o) == 0);
  o.remote_url = "rediss://:pw@h:7,h2:8";
  CHECK(kvt_options_validate(&o) == 0);
  o.remote_url = "redis://alice@127.0.0.1:1"; /* no ':' before '@' */
  CHECK(kvt_options_validate(&o) == KVT_EINVAL);
  o.remote_url = "redis://alice:@127.0.0.1:1"; /* empty password */
  CHECK(kvt_options_validate(&o) == KVT_EINVAL);
  o.remote_url = "rediss://127.0.0.1:1";
  CHECK(kvt_options_validate(&o) == 0);
  o.remote_tls_ca_file = "/nonexistent/ca.pem"; /* checked at open */
  CHECK(kvt_options_validate(&o) == 0);
  o.remote_tls_cert_file = "/x.pem"; /* a certificate needs its key */
  CHECK(kvt_options_validate(&o) == KVT_EINVAL);
  o.remote_tls_cert_file = NULL;
  o.remote_url = "redis://127.0.0.1:1"; /* TLS files need rediss:// */
  CHECK(kvt_options_validate(&o) == KVT_EINVAL);
  o.remote_tls_ca_file = NULL;
  o.remote_lookup_timeout_ms = 0;
  CHECK(kvt_options_validate(&o) == KVT_EINVAL);
  o.remote_lookup_timeout_ms = 250;
  {
    /* A CA file that cannot be loaded fails the open clearly. */
    kvt_options b = ropts("rt-badca", "rediss://127.0.0.1:1", NULL,
                          KVT_REMOTE_LOCAL_AND_REMOTE);
    b.remote_tls_ca_file = "/nonexistent/ca.pem";
    kvt_tier *bt = NULL;
    CHECK(kvt_tier_open(&bt, &b) == KVT_EINVAL);
    CHECK(strstr(kvt_last_error(), "/nonexistent/ca.pem") != NULL);
    CHECK(bt == NULL);
  }
  o.remote_mode = KVT_REMOTE_LOCAL;
  CHECK(kvt_options_validate(&o) == KVT_EINVAL); /* URL but local mode */
  /* Nothing listens on the port picked: open works, promotes miss. */
  int port = pick_port();
  char url[64];
  snprintf(url, sizeof url, "redis://127.0.0.1:%d", port);
  kvt_options r = ropts("rt-dead", url, NULL, KVT_REMOTE_LOCAL_AND_REMOTE);
  kvt_tier *t = t_open(&r);
  t_entry e = mk(9);
  CHECK_EQ_INT(promote_check(t, &e), 0);
  CHECK(kvt_tier_start_writer(t) == 0);
  CHECK(t_spill(t, &e) == 0);
  CHECK(kvt_tier_flush(t, 10000) == 0);
  CHECK_EQ_INT(promote_check(t, &e), 1);
  kvt_stats s = stats_of(t);
  CHECK(s.remote_errors >= 1);
  CHECK_EQ_INT(s.remote_spill_count, 0);
  t_free(&e);
  kvt_tier_free(t);
}

int main(int argc, char **argv) {
  if (argc >= 5 && !strcmp(argv[1], "--child"))
    return child_main(argc, argv);
  g_self = argv[0];
  if (system("command -v redis-server >/dev/null 2>&1 && command -v "
             "redis-cli >/dev/null 2>&1") != 0) {
    return kvt_test_skip_all("redis", "redis-server / redis-cli not installed");
  }
  {
    kvt_options o = t_opts("rt-probe");
    o.remote_url = "redis://127.0.0.1:1";
    o.remote_mode = KVT_REMOTE_ONLY;
    kvt_tier *t = NULL;
    int rc = kvt_tier_open(&t, &o);
    kvt_tier_free(t);
    if (rc == KVT_EUNSUPPORTED) {
      return kvt_test_skip_all("hiredis", "kvtier built without hiredis");
    }
  }
  start_leader();
  atexit(kill_all);
  signal(SIGINT, on_signal);
  signal(SIGTERM, on_signal);
  signal(SIGABRT, on_signal);
  RUN(test_options);
  RUN(test_standalone);
  RUN(test_remote_budget);
  RUN(test_lookup_mirror);
  RUN(test_retention_ttl);
  RUN(test_prefix_paging);
  RUN(test_eviction);
  RUN(test_chunks);
  RUN(test_chunks_damaged_upload);
  RUN(test_cluster);
  kill_all();
  return kvt_test_done();
}
