/*
 * test_crashsim_evict_tier.c - a process crash (SIGKILL) at every point of a
 * chunked tier's evicting spill. A tier with chunk_tokens 16 and max_size_gb
 * just under what N+1 conversations over one shared system prompt take holds
 * N of them; the (N+1)-th spill makes the writer evict the least recently
 * used conversation (its leaf chunks, chain rows, chain record or tail, index
 * row). Every mutating call the tier makes meanwhile (pwrite, ftruncate,
 * create, mkdir, rename, unlink, rmdir: what a killed process leaves is what
 * those calls did, the page cache survives) is preceded by a copy of the
 * cache directory: the state a SIGKILL at that point leaves. Each copy is then
 * reopened and every conversation promoted: each acknowledged conversation
 * the uncut run keeps serves bit for bit, the evicted and the new one serve
 * bit for bit or miss, nothing wrong is ever served and nothing is
 * quarantined. The same cut states are reopened by tiers of chunk_tokens 256
 * and 0 (a directory written at 16: nothing lost, nothing wrong), and with
 * one flipped byte in the shared system-prompt chunk: then the promotes miss
 * (that chunk alone moves aside, no entry directory is deleted), and one
 * spill over the prompt writes it again, after which every kept conversation
 * serves. Cases: unsalted, and every call under one cache_salt. Counts of
 * cut points are printed.
 */
#include "fmt_testlib.h"
#include "rel_common.h"
#include "tier_testlib.h"
#include "kvtier.h"
#include "kvtier_sys.h"

#include "base/io.h"

#include <fcntl.h>

#define C 16
#define N_CONV 5 /* kept before the evicting spill */
#define SYS 32   /* the shared system prompt: two chunks */
#define MAX_TOK 69

static char *g_root;

/* ---- the cut recorder --------------------------------------------------- */

static kvti_io_ops g_ops;
static int g_armed, g_in_copy;
static int g_ncut;
static const char *g_live;

static void cut_here(void) {
  if (!g_armed || g_in_copy)
    return;
  g_in_copy = 1;
  char d[4200];
  snprintf(d, sizeof d, "%s/cut/%d", g_root, g_ncut++);
  r_copy_tree(g_live, d);
  /* The shared-memory index is rebuilt from the WAL by the next open. */
  char shm[4300];
  snprintf(shm, sizeof shm, "%s/index.db-shm", d);
  unlink(shm);
  g_in_copy = 0;
}

static int w_open(const char *p, int f, mode_t m) {
  if (f & O_CREAT)
    cut_here();
  return kvti_io_default.open(p, f, m);
}
static int w_openat(int dfd, const char *p, int f, mode_t m) {
  if (f & O_CREAT)
    cut_here();
  return kvti_io_default.openat(dfd, p, f, m);
}
static ssize_t w_pwrite(int fd, const void *b, size_t n, off_t o) {
  cut_here();
  return kvti_io_default.pwrite(fd, b, n, o);
}
static int w_ftruncate(int fd, off_t n) {
  cut_here();
  return kvti_io_default.ftruncate(fd, n);
}
static int w_rename(const char *a, const char *b) {
  cut_here();
  return kvti_io_default.rename(a, b);
}
static int w_exch(const char *a, const char *b) {
  cut_here();
  return kvti_io_default.rename_exchange(a, b);
}
static int w_mkdir(const char *p, mode_t m) {
  cut_here();
  return kvti_io_default.mkdir(p, m);
}
static int w_rmdir(const char *p) {
  cut_here();
  return kvti_io_default.rmdir(p);
}
static int w_unlink(const char *p) {
  cut_here();
  return kvti_io_default.unlink(p);
}
static int w_unlinkat(int dfd, const char *p, int f) {
  cut_here();
  return kvti_io_default.unlinkat(dfd, p, f);
}

static void recorder_install(void) {
  g_ops = kvti_io_default;
  g_ops.open = w_open;
  g_ops.openat = w_openat;
  g_ops.pwrite = w_pwrite;
  g_ops.ftruncate = w_ftruncate;
  g_ops.rename = w_rename;
  g_ops.rename_exchange = w_exch;
  g_ops.mkdir = w_mkdir;
  g_ops.rmdir = w_rmdir;
  g_ops.unlink = w_unlink;
  g_ops.unlinkat = w_unlinkat;
  /* Every write through pwrite, so each one is a cut point. */
  g_ops.uring_setup = NULL;
  g_ops.uring_submit = NULL;
  kvti_io_set(&g_ops);
}

/* ---- the conversations -------------------------------------------------- */

static int g_keep[N_CONV + 1]; /* must serve in the cut state at hand */
static int g_kept_dirs;        /* how many of them there are */
static int g_ack_cut = -1;     /* cut points from here on follow the ack */
static int g_damaged;          /* cut states checked with the damage */

static void on_done(void *ctx, const char *hash, int status) {
  (void)ctx;
  (void)hash;
  if (g_armed && status == 0 && g_ack_cut < 0)
    g_ack_cut = g_ncut;
}

static const char g_salt[] = "tenant-a";
static int g_salted;

/* Conversation c: the system prompt, then its own tokens; even ones end on a
 * chunk boundary (a chain record), odd ones have a 5-token tail. */
static int conv(int32_t *tok, int c) {
  int n = c % 2 ? MAX_TOK : 64;
  for (int i = 0; i < SYS; i++)
    tok[i] = 300 + i;
  for (int i = SYS; i < n; i++)
    tok[i] = 7000 + c * 100 + i;
  return n;
}

static kvt_call_opts call_opts(void) {
  kvt_call_opts co;
  kvt_call_opts_init(&co, KVT_CALL_OPTS_VERSION);
  if (g_salted) {
    co.cache_salt = g_salt;
    co.cache_salt_len = sizeof g_salt - 1;
  }
  return co;
}

static void log_dbg(void *ctx, int level, const char *msg) {
  (void)ctx;
  (void)level;
  if (getenv("KVT_EVICT_LOG"))
    fprintf(stderr, "    log: %s\n", msg);
}

static kvt_tier *open_tier(const char *dir, int chunk_tokens, double max_gb) {
  kvt_options o = KVT_OPTIONS_INIT;
  o.cache_dir = dir;
  o.durability = KVT_DURABILITY_NONE; /* a process crash: no fsync needed */
  o.chunk_tokens = (uint32_t)chunk_tokens;
  o.max_size_gb = max_gb;
  o.host_cache_bytes = 0; /* every promote reads the files */
  o.quarantine_max = 64;
  o.spill_done_fn = on_done;
  o.log_fn = log_dbg;
  kvt_tier *t = NULL;
  if (kvt_tier_open(&t, &o) != 0) {
    fprintf(stderr, "  open (C=%d) failed: %s\n", chunk_tokens,
            kvt_last_error());
    return NULL;
  }
  REQUIRE(kvt_tier_start_writer(t) == 0);
  return t;
}

static void spill(kvt_tier *t, int c) {
  int32_t tok[MAX_TOK];
  int n = conv(tok, c);
  kvt_layer l[2];
  for (int i = 0; i < 2; i++)
    l[i] = t_kv_tokens(tok, n, n, 8, i);
  kvt_call_opts co = call_opts();
  CHECK_EQ_INT(kvt_tier_spill_ex(t, tok, (size_t)n, l, 2, 1000, &co), 0);
  for (int i = 0; i < 2; i++)
    t_layer_free(&l[i]);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
}

/* 1 served bit-exact, 0 a miss (or, when errors_ok, a refusal), -1 wrong
 * data or an unexpected error. */
static int serve_x(kvt_tier *t, int c, int errors_ok) {
  int32_t tok[MAX_TOK];
  int n = conv(tok, c);
  kvt_promote_opts po = t_popts(NULL);
  if (g_salted) {
    po.cache_salt = g_salt;
    po.cache_salt_len = sizeof g_salt - 1;
  }
  kvt_entry *e = NULL;
  int rc = kvt_tier_promote(&e, t, tok, (size_t)n, &po);
  int r = rc == KVT_ENOTFOUND || (rc != 0 && errors_ok) ? 0
          : rc != 0                                     ? -1
          : t_kv_matches(e, tok, n, n, 2)               ? 1
                                                        : -1;
  if (r < 0 && !errors_ok)
    fprintf(stderr, "  conv %d: promote %d (%s)\n", c, rc,
            rc ? kvt_last_error() : "wrong data");
  kvt_entry_free(e);
  return r;
}

static int serve(kvt_tier *t, int c) {
  return serve_x(t, c, 0);
}

static kvt_stats stats_of(kvt_tier *t) {
  kvt_stats s = KVT_STATS_INIT;
  REQUIRE(kvt_tier_stats(&s, t) == 0);
  return s;
}

static void close_tier(kvt_tier *t) {
  CHECK_EQ_INT(kvt_tier_close(t, -1), 0);
  kvt_tier_free(t);
}

static int data_dirs(const char *dir) {
  char p[4200];
  snprintf(p, sizeof p, "%s/data", dir);
  return kvt_test_count_dir(p, NULL);
}

/* ---- the checks --------------------------------------------------------- */

/* Reopens the cut state at C=chunk_tokens; returns violations. must_serve:
 * the kept conversations must serve (else only: no wrong data). */
static int check_cut(const char *dir, int chunk_tokens, int must_serve) {
  kvt_tier *t = open_tier(dir, chunk_tokens, 1.0);
  if (!t)
    return 1;
  int viol = 0;
  for (int c = 0; c <= N_CONV; c++) {
    int r = serve_x(t, c, !must_serve);
    if (r < 0 || (must_serve && g_keep[c] && r != 1)) {
      fprintf(stderr, "  C=%d: kept conversation %d: %s\n", chunk_tokens, c,
              r < 0 ? "wrong" : "not served");
      viol++;
    }
  }
  kvt_stats s = stats_of(t);
  if (s.quarantined || data_dirs(dir) < g_kept_dirs) {
    fprintf(stderr, "  C=%d: %llu quarantined, %d entry directories\n",
            chunk_tokens, (unsigned long long)s.quarantined, data_dirs(dir));
    viol++;
  }
  close_tier(t);
  return viol;
}

/* The system prompt's second chunk of the cut state: flipped, every
 * conversation misses and no entry directory goes; a spill over the prompt
 * writes it again and every kept conversation serves. */
static int check_damage(const char *dir) {
  kvt_tier *t = open_tier(dir, C, 1.0);
  if (!t)
    return 1;
  int32_t tok[MAX_TOK];
  int n = conv(tok, N_CONV + 1);
  kvt_call_opts co = call_opts();
  kvt_entry_info info;
  int viol = 0;
  /* The prompt's second chunk, found through any stored conversation. */
  kvt_chunk_info *ch = NULL;
  size_t nch = 0;
  for (int c = 0; c <= N_CONV && nch < 2; c++) {
    int32_t ct[MAX_TOK];
    int cn = conv(ct, c);
    kvt_free(ch);
    ch = NULL;
    nch = 0;
    if (kvt_tier_lookup_ex(&info, t, ct, (size_t)cn, &co) != 0 ||
        kvt_tier_entry_chain(&ch, &nch, NULL, t, info.token_hash, 0) != 0)
      nch = 0;
  }
  if (nch < 2) {
    kvt_free(ch);
    close_tier(t);
    return 0; /* no conversation stored whole in this state */
  }
  char p[4400];
  snprintf(p, sizeof p, "%s/chunks/%.2s/%s.kvc", dir, ch[1].key, ch[1].key);
  kvt_free(ch);
  close_tier(t);
  REQUIRE(t_flip(p, -1) == 0);
  g_damaged++;
  t = open_tier(dir, C, 1.0);
  if (!t)
    return 1;
  for (int c = 0; c <= N_CONV; c++)
    if (serve_x(t, c, 1) != 0) {
      fprintf(stderr, "  damaged prompt: conversation %d not a miss\n", c);
      viol++;
    }
  if (data_dirs(dir) < g_kept_dirs) {
    fprintf(stderr, "  damaged prompt: %d entry directories, %d kept\n",
            data_dirs(dir), g_kept_dirs);
    viol++;
  }
  /* A new conversation over the prompt writes the chunk again. */
  kvt_layer l[2];
  for (int i = 0; i < 2; i++)
    l[i] = t_kv_tokens(tok, n, n, 8, i);
  CHECK_EQ_INT(kvt_tier_spill_ex(t, tok, (size_t)n, l, 2, 1000, &co), 0);
  for (int i = 0; i < 2; i++)
    t_layer_free(&l[i]);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  for (int c = 0; c <= N_CONV; c++)
    if (serve(t, c) < 0 || (g_keep[c] && serve(t, c) != 1)) {
      fprintf(stderr, "  rewritten prompt: kept conversation %d not served\n",
              c);
      viol++;
    }
  kvt_stats st = stats_of(t);
  if (st.quarantined != st.chunks_quarantined) {
    fprintf(stderr, "  damaged prompt: an entry was quarantined\n");
    viol++;
  }
  close_tier(t);
  return viol;
}

/* ---- the campaign ------------------------------------------------------- */

static double g_max_gb;

/* max_size_gb that holds N_CONV conversations but not N_CONV + 1. */
static double calibrate(void) {
  char *dir = t_join(g_root, "calib");
  kvt_test_rmtree(dir);
  kvt_tier *t = open_tier(dir, C, 1.0);
  REQUIRE(t);
  for (int c = 0; c < N_CONV; c++)
    spill(t, c);
  uint64_t b0 = stats_of(t).disk_bytes;
  spill(t, N_CONV);
  uint64_t b1 = stats_of(t).disk_bytes;
  close_tier(t);
  kvt_test_rmtree(dir);
  free(dir);
  REQUIRE(b1 > b0);
  return (double)(b0 + (b1 - b0) / 2) / (1024.0 * 1024.0 * 1024.0);
}

static int run_case(int salted) {
  g_salted = salted;
  char *live = t_join(g_root, salted ? "live-salted" : "live");
  char *cuts = t_join(g_root, "cut");
  kvt_test_rmtree(live);
  kvt_test_rmtree(cuts);
  REQUIRE(mkdir(cuts, 0700) == 0);
  g_live = live;
  g_ncut = 0;
  g_ack_cut = -1;
  g_damaged = 0;
  kvt_tier *t = open_tier(live, C, g_max_gb);
  REQUIRE(t);
  for (int c = 0; c < N_CONV; c++)
    spill(t, c);
  for (int c = 0; c < N_CONV; c++)
    CHECK_EQ_INT(serve(t, c), 1);
  /* Conversation 0 least recently used, conversation 1 next. */
  for (int c = 1; c < N_CONV; c++)
    serve(t, c);
  uint64_t ev0 = stats_of(t).evictions;
  g_armed = 1;
  spill(t, N_CONV);
  cut_here(); /* and the state after the acknowledgement */
  g_armed = 0;
  CHECK(stats_of(t).evictions > ev0); /* the spill did evict */
  int keep[N_CONV + 1];
  for (int c = 0; c <= N_CONV; c++)
    keep[c] = serve(t, c) == 1;
  CHECK(!keep[0]);
  CHECK(keep[N_CONV]);
  CHECK(g_ack_cut > 0);
  close_tier(t);
  int n = g_ncut, viol = 0;
  for (int k = 0; k < n; k++) {
    char d[4200];
    snprintf(d, sizeof d, "%s/%d", cuts, k);
    /* Each check works on its own copy: reopening may change the state. */
    /* The new conversation must serve once its spill was acknowledged. */
    g_kept_dirs = 0;
    for (int c = 0; c <= N_CONV; c++) {
      g_keep[c] = keep[c] && (c < N_CONV || k >= g_ack_cut);
      g_kept_dirs += g_keep[c];
    }
    /* C=16 alone; then C=256 and 0 (which must not lose or serve wrong what
     * C=16 wrote) and C=16 again on one copy, which must still serve every
     * kept conversation. */
    static const int sizes[4] = {C, 256, 0, C};
    char *w = t_join(g_root, "work");
    for (int s = 0; s < 4; s++) {
      if (s < 2) {
        kvt_test_rmtree(w);
        r_copy_tree(d, w);
      }
      int v = check_cut(w, sizes[s], sizes[s] == C);
      if (v)
        fprintf(stderr, "  ^ cut %d of %d, C=%d%s (%s)\n", k, n, sizes[s],
                s == 3 ? " after 256 and 0" : "",
                salted ? "salted" : "unsalted");
      viol += v;
    }
    kvt_test_rmtree(w);
    r_copy_tree(d, w);
    int v = check_damage(w);
    if (v)
      fprintf(stderr, "  ^ cut %d of %d, damaged prompt (%s)\n", k, n,
              salted ? "salted" : "unsalted");
    viol += v;
    kvt_test_rmtree(w);
    free(w);
  }
  fprintf(stderr,
          "evicting spill (%s): %d cut points (acknowledged from %d on), each "
          "reopened at C=16, 256, 0; %d with the prompt chunk damaged: %d "
          "violations\n",
          salted ? "salted" : "unsalted", n, g_ack_cut, g_damaged, viol);
  CHECK(n > 10);
  CHECK(g_damaged > n / 2);
  kvt_test_rmtree(cuts);
  kvt_test_rmtree(live);
  free(cuts);
  free(live);
  return viol;
}

static void test_unsalted(void) {
  CHECK_EQ_INT(run_case(0), 0);
}
static void test_salted(void) {
  CHECK_EQ_INT(run_case(1), 0);
}

int main(void) {
  r_use_fast_tmp();
  g_root = kvt_test_tmpdir("crashsim-evict");
  g_max_gb = calibrate();
  recorder_install();
  RUN(test_unsalted);
  RUN(test_salted);
  kvti_io_set(NULL);
  return kvt_test_done();
}
