/*
 * bench_redis.c - throughput of the shared remote tier against what the same
 * Redis server does on its own, in one run: starts a private redis-server on
 * a free loopback port (killed at exit), measures redis-benchmark's own SET
 * and GET throughput with large values (one client, as kvtier's one upload
 * thread / one promoting thread), then kvtier's remote spill (spill ->
 * upload -> flush) and remote promote (fetch, verify, build the entry) of the
 * same bytes, and prints value / limit / ratio lines (best of 3 runs on each
 * side: the machine may be shared); then the lookup cost model: latency of
 * kvt_tier_lookup / kvt_tier_lookup_prefix for a local hit, a remote hit and
 * a remote miss (the mirror of the remote keys answers misses). Usage:
 *   bench_redis [entry_MiB=8] [entries=8] [chunk_MiB=16]
 * Exit 77 when redis-server / redis-benchmark are missing or kvtier was built
 * without hiredis.
 */
#include "kvtier.h"

#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static pid_t g_srv = -1;
static char g_dir[256];

static void cleanup(void) {
  if (g_srv > 0) {
    kill(g_srv, SIGKILL);
    waitpid(g_srv, NULL, 0);
    g_srv = -1;
  }
  if (g_dir[0]) {
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    if (system(cmd) != 0)
      fprintf(stderr, "could not remove %s\n", g_dir);
    g_dir[0] = '\0';
  }
}

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int free_port(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a;
  memset(&a, 0, sizeof a);
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(0x7f000001);
  socklen_t l = sizeof a;
  if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) != 0 ||
      getsockname(fd, (struct sockaddr *)&a, &l) != 0)
    return -1;
  close(fd);
  return ntohs(a.sin_port);
}

/* Requests per second of one redis-benchmark test (CSV output). */
static double rb_rps(int port, const char *test, size_t value, int n) {
  char cmd[512];
  snprintf(cmd, sizeof cmd,
           "redis-benchmark -h 127.0.0.1 -p %d -t %s -d %zu -n %d -c 1 --csv "
           "2>/dev/null",
           port, test, value, n);
  FILE *f = popen(cmd, "r");
  if (!f)
    return 0;
  char line[512];
  double rps = 0;
  while (fgets(line, sizeof line, f)) {
    /* "test","rps",...  e.g. "SET","68.49",... */
    char *p = strchr(line, ',');
    if (line[0] == '"' && p && p[1] == '"' && strncmp(line + 1, "test", 4))
      rps = atof(p + 2);
  }
  pclose(f);
  return rps;
}

/* 4 KV layers of F16 [1, 8, T, 128], data allocated (not filled). */
static void kv_layers(kvt_layer layers[4], kvt_tensor tens[4][2], int T) {
  for (int l = 0; l < 4; l++) {
    kvt_layer_init(&layers[l], KVT_LAYER_KV);
    layers[l].tensors = tens[l];
    layers[l].num_tensors = 2;
    layers[l].offset = T;
    for (int k = 0; k < 2; k++) {
      kvt_tensor *t = &tens[l][k];
      memset(t, 0, sizeof *t);
      t->dtype = KVT_DTYPE_F16;
      t->ndim = 4;
      t->shape[0] = 1;
      t->shape[1] = 8;
      t->shape[2] = T;
      t->shape[3] = 128;
      t->nbytes = (uint64_t)8 * T * 128 * 2;
      t->data = malloc(t->nbytes);
    }
  }
}

/* ---- chunks shared between nodes (docs/REMOTE.md "Chunks") ----
 * 8 conversations = one 1024-token system prompt + 256 own tokens, 4 layers
 * of F16 [1, 8, T, 128] (16 KiB per token), KV rows a function of (token,
 * position) as a real model's shared prefix is. Measured in one run on one
 * server: node A's remote-only spill chunked (chunk_tokens 256) against
 * whole entries (chunk_tokens 0): bytes sent and time; node B's promotes of
 * them (chunked: the first fetches 5 chunks + its tail, the next ones only
 * their own chunk + tail; whole: every entry whole); prefix lookups of the
 * system prompt + 100 new tokens on a node that has none of it. */
enum { CB_SYS = 1024, CB_OWN = 256, CB_CONV = 8, CB_L = 4 };

static void cb_fill(kvt_layer *layers, const int32_t *tok, int n) {
  for (int l = 0; l < CB_L; l++) {
    layers[l].offset = n;
    for (int k = 0; k < 2; k++) {
      kvt_tensor *t = &layers[l].tensors[k];
      t->shape[2] = n;
      t->nbytes = (uint64_t)8 * n * 128 * 2;
      uint16_t *d = t->data;
      for (int h = 0; h < 8; h++)
        for (int i = 0; i < n; i++)
          for (int j = 0; j < 128; j++)
            d[((size_t)h * n + i) * 128 + j] =
                (uint16_t)((uint32_t)tok[i] * 2654435761u +
                           (uint32_t)i * 40503u +
                           (uint32_t)(h * 131 + j * 7 + l * 1009 + k * 17)) &
                0x3bff;
    }
  }
}

static void cb_tokens(int32_t *tok, int conv) {
  for (int i = 0; i < CB_SYS; i++)
    tok[i] = 100 + i;
  for (int i = 0; i < CB_OWN; i++)
    tok[CB_SYS + i] = 20000 + conv * 1000 + i;
}

static int chunk_bench(const char *url) {
  const int n = CB_SYS + CB_OWN;
  kvt_layer layers[CB_L];
  kvt_tensor tens[CB_L][2];
  kv_layers(layers, tens, n);
  int32_t tok[CB_SYS + CB_OWN];
  uint64_t ebytes = (uint64_t)n * CB_L * 2 * 8 * 128 * 2;
  double spill_s[2] = {0, 0}, prom_s[2][2] = {{0, 0}, {0, 0}};
  uint64_t sent[2] = {0, 0}, fetched[2] = {0, 0};
  int ok = 1;
  for (int mode = 0; mode < 2; mode++) { /* 0: chunked, 1: whole entries */
    char dirA[300], pre[16];
    snprintf(dirA, sizeof dirA, "%s/cha%d", g_dir, mode);
    snprintf(pre, sizeof pre, "cb%d:", mode);
    kvt_options o;
    kvt_options_init(&o, KVT_OPTIONS_VERSION);
    o.cache_dir = dirA;
    o.durability = KVT_DURABILITY_NONE;
    o.remote_url = url;
    o.remote_prefix = pre;
    o.remote_mode = KVT_REMOTE_ONLY;
    o.remote_timeout_ms = 30000;
    o.chunk_tokens = mode == 0 ? 256 : 0;
    o.model_id = "bench";
    o.host_cache_bytes = 0;
    kvt_tier *a = NULL;
    if (kvt_tier_open(&a, &o) != 0)
      return 0;
    kvt_tier_start_writer(a);
    double t0 = now();
    for (int c = 0; c < CB_CONV; c++) {
      cb_tokens(tok, c);
      cb_fill(layers, tok, n);
      int rc;
      while ((rc = kvt_tier_spill(a, tok, n, layers, CB_L, ebytes)) ==
             KVT_EFULL)
        usleep(1000);
      ok &= rc == 0;
      ok &= kvt_tier_flush(a, -1) == 0; /* the layers are reused */
    }
    spill_s[mode] = now() - t0;
    kvt_stats s = KVT_STATS_INIT;
    kvt_tier_stats(&s, a);
    sent[mode] = s.remote_spill_bytes;
    kvt_tier_free(a);
    o.remote_mode = KVT_REMOTE_LOCAL_AND_REMOTE;
    if (mode == 1)
      o.remote_flags = KVT_REMOTE_NO_LOCAL_COPY;
    /* Best of 3 fresh nodes B (the machine may be shared). */
    prom_s[mode][0] = prom_s[mode][1] = 1e30;
    for (int rep = 0; rep < 3; rep++) {
      char dirB[320];
      snprintf(dirB, sizeof dirB, "%s/chb%d.%d", g_dir, mode, rep);
      o.cache_dir = dirB;
      kvt_tier *b = NULL;
      if (kvt_tier_open(&b, &o) != 0)
        return 0;
      usleep(300000); /* the mirror resynced */
      double ps[2] = {0, 0};
      for (int c = 0; c < CB_CONV; c++) {
        cb_tokens(tok, c);
        kvt_entry *got = NULL;
        t0 = now();
        ok &= kvt_tier_promote(&got, b, tok, n, NULL) == 0;
        ps[c ? 1 : 0] += now() - t0;
        kvt_entry_free(got);
      }
      for (int k = 0; k < 2; k++)
        prom_s[mode][k] = ps[k] < prom_s[mode][k] ? ps[k] : prom_s[mode][k];
      kvt_stats sb = KVT_STATS_INIT;
      kvt_tier_stats(&sb, b);
      fetched[mode] = sb.remote_read_bytes;
      kvt_tier_free(b);
    }
  }
  /* Prefix lookups of a new prompt (system prompt + 100 tokens) on a node
   * that holds none of it: the remote chain (mirror + EXISTS of the 4
   * chunks) vs the same lookup once they are local. */
  char dirD[300];
  snprintf(dirD, sizeof dirD, "%s/chd", g_dir);
  kvt_options o;
  kvt_options_init(&o, KVT_OPTIONS_VERSION);
  o.cache_dir = dirD;
  o.durability = KVT_DURABILITY_NONE;
  o.remote_url = url;
  o.remote_prefix = "cb0:";
  o.remote_mode = KVT_REMOTE_LOCAL_AND_REMOTE;
  o.chunk_tokens = 256;
  o.model_id = "bench";
  kvt_tier *d = NULL;
  if (kvt_tier_open(&d, &o) != 0)
    return 0;
  usleep(300000);
  int32_t q[CB_SYS + 100], miss[CB_SYS + 100];
  for (int i = 0; i < CB_SYS + 100; i++) {
    q[i] = i < CB_SYS ? 100 + i : 900000 + i;
    miss[i] = 7000000 + i;
  }
  double us[3];
  for (int k = 0; k < 3; k++) {
    const int32_t *qq = k == 1 ? miss : q;
    if (k == 2) { /* make the chain local: one promote */
      kvt_promote_opts po = KVT_PROMOTE_OPTS_INIT;
      po.flags = KVT_PROMOTE_PREFIX;
      kvt_entry *got = NULL;
      ok &= kvt_tier_promote(&got, d, q, CB_SYS + 100, &po) == 0;
      kvt_entry_free(got);
    }
    us[k] = 1e30;
    for (int rep = 0; rep < 3; rep++) {
      kvt_entry_info info;
      double t0 = now();
      for (int i = 0; i < 500; i++) {
        int r = kvt_tier_lookup_prefix(&info, d, qq, CB_SYS + 100);
        ok &= (r == 0) == (k != 1) && (k == 1 || info.num_tokens == CB_SYS);
      }
      double u = (now() - t0) / 500 * 1e6;
      us[k] = u < us[k] ? u : us[k];
    }
  }
  kvt_tier_free(d);
  for (int l = 0; l < CB_L; l++)
    for (int k = 0; k < 2; k++)
      free(tens[l][k].data);
  double unique = (double)(CB_SYS + CB_CONV * CB_OWN) * CB_L * 2 * 8 * 128 * 2;
  printf("chunks shared between nodes: %d conversations = %d-token system "
         "prompt + %d own tokens, %.1f MiB each, chunk_tokens 256 vs whole "
         "entries, same run:\n",
         CB_CONV, CB_SYS, CB_OWN, (double)ebytes / 1048576.0);
  printf("remote_chunked_sent_per_unique value %.3f whole %.3f ratio %.2f\n",
         sent[0] / unique, sent[1] / unique,
         sent[1] ? (double)sent[0] / (double)sent[1] : 0);
  printf("remote_chunked_spill_s value %.3f whole %.3f ratio %.2f\n",
         spill_s[0], spill_s[1], spill_s[1] > 0 ? spill_s[0] / spill_s[1] : 0);
  printf("remote_chunked_fetched_per_unique value %.3f whole %.3f ratio %.2f\n",
         fetched[0] / unique, fetched[1] / unique,
         fetched[1] ? (double)fetched[0] / (double)fetched[1] : 0);
  printf("(promotes: best of 3 fresh nodes B)\n");
  printf("remote_chunked_promote_first_ms value %.2f whole %.2f ratio %.2f\n",
         prom_s[0][0] * 1e3, prom_s[1][0] * 1e3,
         prom_s[1][0] > 0 ? prom_s[0][0] / prom_s[1][0] : 0);
  printf("remote_chunked_promote_next_ms value %.2f whole %.2f ratio %.2f "
         "(mean of %d)\n",
         prom_s[0][1] * 1e3 / (CB_CONV - 1), prom_s[1][1] * 1e3 / (CB_CONV - 1),
         prom_s[1][1] > 0 ? prom_s[0][1] / prom_s[1][1] : 0, CB_CONV - 1);
  printf("lookup_remote_chain_prefix_hit_us value %.2f ratio %.1f\n", us[0],
         us[2] > 0 ? us[0] / us[2] : 0);
  printf("lookup_remote_chain_prefix_miss_us value %.2f ratio %.1f\n", us[1],
         us[2] > 0 ? us[1] / us[2] : 0);
  printf("lookup_local_chain_prefix_hit_us value %.2f ratio 1.0\n", us[2]);
  if (!ok)
    fprintf(stderr, "bench_redis: a chunked spill, promote or lookup failed\n");
  return ok;
}

int main(int argc, char **argv) {
  size_t entry_mib = argc > 1 ? (size_t)atoi(argv[1]) : 8;
  int entries = argc > 2 ? atoi(argv[2]) : 8;
  size_t chunk_mib = argc > 3 ? (size_t)atoi(argv[3]) : 16;
  if (entry_mib < 1 || entries < 1 || chunk_mib < 1 || chunk_mib > 512)
    return 2;
  if (system("command -v redis-server >/dev/null && command -v "
             "redis-benchmark >/dev/null") != 0) {
    fprintf(stderr, "skip: redis-server / redis-benchmark not installed\n");
    return 77;
  }
  snprintf(g_dir, sizeof g_dir, "/tmp/kvt-bench-redis-XXXXXX");
  if (!mkdtemp(g_dir))
    return 1;
  atexit(cleanup);
  int port = free_port();
  char ps[16];
  snprintf(ps, sizeof ps, "%d", port);
  g_srv = fork();
  if (g_srv == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (!freopen("/dev/null", "w", stdout))
      _exit(127);
    execlp("redis-server", "redis-server", "--port", ps, "--bind", "127.0.0.1",
           "--save", "", "--appendonly", "no", "--dir", g_dir,
           "--proto-max-bulk-len", "1gb", (char *)NULL);
    _exit(127);
  }
  char ping[256];
  snprintf(ping, sizeof ping, "redis-cli -p %d PING 2>/dev/null | grep -q PONG",
           port);
  for (int i = 0; i < 200 && system(ping) != 0; i++)
    usleep(25000);

  /* The limit: redis-benchmark's own large-value SET/GET, one client. */
  size_t vbytes = chunk_mib << 20;
  if (vbytes > entry_mib << 20)
    vbytes = entry_mib << 20;
  int n = (int)((entry_mib * (size_t)entries << 20) / vbytes);
  if (n < 32)
    n = 32;
  /* Best of 3 on both sides: the machine may be shared. */
  double set_rps = 0, get_rps = 0;
  for (int rep = 0; rep < 3; rep++) {
    double s1 = rb_rps(port, "set", vbytes, n);
    double g1 = rb_rps(port, "get", vbytes, n);
    set_rps = s1 > set_rps ? s1 : set_rps;
    get_rps = g1 > get_rps ? g1 : get_rps;
  }
  double set_mbs = set_rps * (double)vbytes / 1e6;
  double get_mbs = get_rps * (double)vbytes / 1e6;
  char flush[128];
  snprintf(flush, sizeof flush, "redis-cli -p %d FLUSHALL >/dev/null", port);
  if (system(flush) != 0)
    fprintf(stderr, "FLUSHALL failed\n");

  /* kvtier: entries of 4 layers, keys/values F16 [1, 8, T, 128]. */
  char url[64];
  snprintf(url, sizeof url, "redis://127.0.0.1:%d", port);
  uint64_t tensor = (entry_mib << 20) / 8;
  int T = (int)(tensor / (8 * 128 * 2));
  kvt_layer layers[4];
  kvt_tensor tens[4][2];
  unsigned seed = 1;
  kv_layers(layers, tens, T);
  for (int l = 0; l < 4; l++) {
    for (int k = 0; k < 2; k++) {
      kvt_tensor *t = &tens[l][k];
      unsigned char *b = t->data;
      for (uint64_t i = 0; i < t->nbytes; i++)
        b[i] = (unsigned char)((seed = seed * 1103515245u + 12345u) >> 16);
    }
  }
  uint64_t ebytes = 8 * tens[0][0].nbytes;
  char dirA[300], dirB[300];
  snprintf(dirA, sizeof dirA, "%s/a", g_dir);
  snprintf(dirB, sizeof dirB, "%s/b", g_dir);
  kvt_options o;
  kvt_options_init(&o, KVT_OPTIONS_VERSION);
  o.cache_dir = dirA;
  o.durability = KVT_DURABILITY_NONE;
  o.remote_url = url;
  o.remote_mode = KVT_REMOTE_ONLY;
  o.remote_chunk_bytes = chunk_mib << 20;
  o.remote_timeout_ms = 30000;
  o.spill_queue_size = 2;
  o.remote_queue_size = 2;
  kvt_tier *a = NULL;
  int rc = kvt_tier_open(&a, &o);
  if (rc == KVT_EUNSUPPORTED) {
    fprintf(stderr, "skip: %s\n", kvt_last_error());
    return 77;
  }
  if (rc != 0) {
    fprintf(stderr, "open: %s\n", kvt_last_error());
    return 1;
  }
  kvt_tier_start_writer(a);
  int32_t *tok = malloc(sizeof(int32_t) * 64);
  double spill_s = 1e30, t0;
  for (int rep = 0; rep < 3; rep++) { /* each rep replaces the entries */
    t0 = now();
    for (int e = 0; e < entries; e++) {
      for (int i = 0; i < 64; i++)
        tok[i] = e * 1000 + i;
      /* Bounded queues: wait for room instead of dropping. */
      while ((rc = kvt_tier_spill(a, tok, 64, layers, 4, ebytes)) == KVT_EFULL)
        usleep(1000);
      if (rc != 0) {
        fprintf(stderr, "spill: %s\n", kvt_last_error());
        return 1;
      }
      kvt_tier_flush(a, -1);
    }
    kvt_tier_flush(a, -1);
    if (now() - t0 < spill_s)
      spill_s = now() - t0;
  }
  kvt_stats s = KVT_STATS_INIT;
  kvt_tier_stats(&s, a);
  kvt_tier_free(a);

  o.cache_dir = dirB;
  o.remote_flags = KVT_REMOTE_NO_LOCAL_COPY;
  kvt_tier *b = NULL;
  if (kvt_tier_open(&b, &o) != 0)
    return 1;
  double prom_s = 1e30;
  int hits = 0;
  for (int rep = 0; rep < 3; rep++) {
    t0 = now();
    hits = 0;
    for (int e = 0; e < entries; e++) {
      for (int i = 0; i < 64; i++)
        tok[i] = e * 1000 + i;
      kvt_entry *got = NULL;
      if (kvt_tier_promote(&got, b, tok, 64, NULL) == 0)
        hits++;
      kvt_entry_free(got);
    }
    if (now() - t0 < prom_s)
      prom_s = now() - t0;
  }

  /* Lookup latency (kvt_tier_lookup, as a scheduler calls it): a local hit
   * (a local-only tier), then on b (nothing local) a remote hit - one GET of
   * the manifest, bounded by remote_lookup_timeout_ms - and a remote miss,
   * answered by the mirror of the remote keys without I/O; exact and
   * longest-prefix. Mean of many calls, best of 3. */
  kvt_options lo;
  kvt_options_init(&lo, KVT_OPTIONS_VERSION);
  char dirC[300];
  snprintf(dirC, sizeof dirC, "%s/c", g_dir);
  lo.cache_dir = dirC;
  lo.durability = KVT_DURABILITY_NONE;
  kvt_tier *c = NULL;
  if (kvt_tier_open(&c, &lo) != 0)
    return 1;
  kvt_tier_start_writer(c);
  for (int i = 0; i < 64; i++)
    tok[i] = i; /* entry 0's tokens */
  if (kvt_tier_spill(c, tok, 64, layers, 4, ebytes) != 0 ||
      kvt_tier_flush(c, -1) != 0)
    return 1;
  usleep(300000); /* b's mirror: subscribed and resynced long before */
  int32_t miss[64], longer[80];
  for (int i = 0; i < 64; i++)
    miss[i] = 7000000 + i;
  for (int i = 0; i < 80; i++)
    longer[i] = i < 64 ? i : 9000000 + i;
  struct {
    const char *name;
    kvt_tier *t;
    const int32_t *q;
    size_t n;
    int prefix, want;
    double us;
  } L[] = {{"local_hit", c, tok, 64, 0, 1, 0},
           {"remote_hit", b, tok, 64, 0, 1, 0},
           {"remote_miss", b, miss, 64, 0, 0, 0},
           {"local_prefix_hit", c, longer, 80, 1, 1, 0},
           {"remote_prefix_hit", b, longer, 80, 1, 1, 0},
           {"remote_prefix_miss", b, miss, 64, 1, 0, 0}};
  int lookups_ok = 1;
  for (size_t k = 0; k < sizeof L / sizeof L[0]; k++) {
    int reps = L[k].t == b && L[k].want ? 500 : 5000;
    L[k].us = 1e30;
    for (int rep = 0; rep < 3; rep++) {
      kvt_entry_info info;
      t0 = now();
      for (int i = 0; i < reps; i++) {
        int r = L[k].prefix
                    ? kvt_tier_lookup_prefix(&info, L[k].t, L[k].q, L[k].n)
                    : kvt_tier_lookup(&info, L[k].t, L[k].q, L[k].n);
        if ((r == 0) != L[k].want)
          lookups_ok = 0;
      }
      double us = (now() - t0) / reps * 1e6;
      L[k].us = us < L[k].us ? us : L[k].us;
    }
  }
  kvt_tier_free(c);
  kvt_tier_free(b);

  double total = (double)s.remote_spill_bytes / 3; /* 3 reps */
  double spill_mbs = total / spill_s / 1e6;
  double prom_mbs = total / prom_s / 1e6 * hits / entries;
  printf("bench_redis: %d entries of %.1f MiB (%.1f MB stored), chunks of %zu "
         "MiB, one server on loopback\n",
         entries, (double)ebytes / 1048576.0, total / 1e6, chunk_mib);
  printf("redis-benchmark SET %zu-byte values, 1 client: %.1f MB/s\n", vbytes,
         set_mbs);
  printf("redis-benchmark GET %zu-byte values, 1 client: %.1f MB/s\n", vbytes,
         get_mbs);
  printf("remote_spill_MBps value %.1f limit %.1f ratio %.2f\n", spill_mbs,
         set_mbs, set_mbs > 0 ? spill_mbs / set_mbs : 0);
  printf("remote_promote_MBps value %.1f limit %.1f ratio %.2f (%d/%d hits)\n",
         prom_mbs, get_mbs, get_mbs > 0 ? prom_mbs / get_mbs : 0, hits,
         entries);
  printf("lookup latency (kvt_tier_lookup*, mean of many calls, best of 3; "
         "ratio = / local_hit of the same kind):\n");
  for (size_t k = 0; k < sizeof L / sizeof L[0]; k++) {
    double base = L[k].prefix ? L[3].us : L[0].us;
    printf("lookup_%s_us value %.2f ratio %.1f\n", L[k].name, L[k].us,
           base > 0 ? L[k].us / base : 0);
  }
  if (!lookups_ok)
    fprintf(stderr, "bench_redis: a lookup gave the wrong answer\n");
  for (int l = 0; l < 4; l++)
    for (int k = 0; k < 2; k++)
      free(tens[l][k].data);
  free(tok);
  int chunks_ok = chunk_bench(url);
  return hits == entries && lookups_ok && chunks_ok ? 0 : 1;
}
