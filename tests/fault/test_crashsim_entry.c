/*
 * test_crashsim_entry.c - a power-loss simulator at the I/O seam (after
 * SQLite's test6.c) that checks the fsync ordering of an entry's publication,
 * not just its luck. An entry write runs once under a recording I/O table that
 * logs every mutation (mkdir, file creation, pwrite, ftruncate, fsync of files
 * and directories, rename, rename-exchange, unlink, rmdir). Then, for every
 * crash point K (after 0..all logged operations) and several seeded fates, the
 * state a power loss at K could leave is rebuilt in a fresh directory from a
 * copy of the state before the write: a write to a file is durable only if that
 * file was fsynced after it, a name created/renamed/removed in a directory only
 * if that directory was fsynced after it; the non-durable file writes are each
 * kept, dropped or garbled, and of the non-durable namespace changes of each
 * directory a random prefix survives (journaled file systems keep a directory's
 * order). Asserted on each rebuilt state, with durability FSYNC: the entry
 * reads back as exactly the old or the new version (or is absent when there was
 * none) - never torn, never an error -, and once the write returned success,
 * exactly the new version. With durability NONE (no fsync) torn states are
 * expected: each is detected (KVT_ECORRUPT or absent), never returned as data.
 * Finally the simulator is checked against a deliberately wrong order (files
 * not fsynced before the publishing rename, but success claimed), which it must
 * catch.
 */
#include "rel_common.h"
#include "format/entry_restore.h"

#include <fcntl.h>

enum {
  OP_MKDIR,
  OP_CREATE,
  OP_WRITE,
  OP_TRUNC,
  OP_FSYNC,
  OP_RENAME,
  OP_EXCH,
  OP_UNLINK,
  OP_RMDIR
};

typedef struct sim_op {
  int kind;
  char *a, *b;  /* paths (b: rename target) */
  uint64_t off; /* write offset / truncate length */
  size_t n;
  unsigned char *data;
} sim_op;

static sim_op *g_log;
static size_t g_nlog, g_caplog;
static char *g_fdpath[4096];  /* path each open fd was opened with */
static int g_fsync_files = 1; /* 0: the wrong-order variant drops file fsyncs */
static kvti_io_ops g_rec;

static void log_op(int kind, const char *a, const char *b, uint64_t off,
                   const void *d, size_t n) {
  if (g_nlog == g_caplog) {
    g_caplog = g_caplog ? 2 * g_caplog : 256;
    g_log = realloc(g_log, g_caplog * sizeof *g_log);
  }
  sim_op *o = &g_log[g_nlog++];
  memset(o, 0, sizeof *o);
  o->kind = kind;
  o->a = a ? strdup(a) : NULL;
  o->b = b ? strdup(b) : NULL;
  o->off = off;
  o->n = n;
  if (d && n) {
    o->data = malloc(n);
    memcpy(o->data, d, n);
  }
}

static void log_clear(void) {
  for (size_t i = 0; i < g_nlog; i++) {
    free(g_log[i].a);
    free(g_log[i].b);
    free(g_log[i].data);
  }
  g_nlog = 0;
}

static int r_open(const char *p, int f, mode_t m) {
  struct stat st;
  int existed = lstat(p, &st) == 0;
  int fd = kvti_io_default.open(p, f, m);
  if (fd >= 0 && fd < 4096) {
    free(g_fdpath[fd]);
    g_fdpath[fd] = strdup(p);
    if ((f & O_CREAT) && !existed)
      log_op(OP_CREATE, p, NULL, 0, NULL, 0);
    else if ((f & O_TRUNC) && existed)
      log_op(OP_TRUNC, p, NULL, 0, NULL, 0);
  }
  return fd;
}
static int r_close(int fd) {
  if (fd >= 0 && fd < 4096) {
    free(g_fdpath[fd]);
    g_fdpath[fd] = NULL;
  }
  return kvti_io_default.close(fd);
}
static ssize_t r_pwrite(int fd, const void *b, size_t n, off_t o) {
  ssize_t r = kvti_io_default.pwrite(fd, b, n, o);
  if (r > 0 && fd < 4096 && g_fdpath[fd])
    log_op(OP_WRITE, g_fdpath[fd], NULL, (uint64_t)o, b, (size_t)r);
  return r;
}
static int r_ftruncate(int fd, off_t l) {
  int r = kvti_io_default.ftruncate(fd, l);
  if (r == 0 && fd < 4096 && g_fdpath[fd])
    log_op(OP_TRUNC, g_fdpath[fd], NULL, (uint64_t)l, NULL, 0);
  return r;
}
static int r_fsync(int fd) {
  struct stat st;
  if (!g_fsync_files && fstat(fd, &st) == 0 && S_ISREG(st.st_mode))
    return 0; /* the wrong-order variant: a file fsync that does nothing */
  int r = kvti_io_default.fsync(fd);
  if (r == 0 && fd < 4096 && g_fdpath[fd])
    log_op(OP_FSYNC, g_fdpath[fd], NULL, 0, NULL, 0);
  return r;
}
static int r_rename(const char *a, const char *b) {
  int r = kvti_io_default.rename(a, b);
  if (r == 0)
    log_op(OP_RENAME, a, b, 0, NULL, 0);
  return r;
}
static int g_exch_ok = 1;
static int r_exch(const char *a, const char *b) {
  if (!g_exch_ok) {
    errno = ENOTSUP;
    return -1;
  }
  int r = kvti_io_default.rename_exchange(a, b);
  if (r == 0)
    log_op(OP_EXCH, a, b, 0, NULL, 0);
  return r;
}
static int r_mkdir(const char *p, mode_t m) {
  int r = kvti_io_default.mkdir(p, m);
  if (r == 0)
    log_op(OP_MKDIR, p, NULL, 0, NULL, 0);
  return r;
}
static int r_unlink(const char *p) {
  int r = kvti_io_default.unlink(p);
  if (r == 0)
    log_op(OP_UNLINK, p, NULL, 0, NULL, 0);
  return r;
}
static int r_rmdir(const char *p) {
  int r = kvti_io_default.rmdir(p);
  if (r == 0)
    log_op(OP_RMDIR, p, NULL, 0, NULL, 0);
  return r;
}

static void rec_install(void) {
  g_rec = kvti_io_default;
  g_rec.open = r_open;
  g_rec.close = r_close;
  g_rec.pwrite = r_pwrite;
  g_rec.ftruncate = r_ftruncate;
  g_rec.fsync = r_fsync;
  g_rec.rename = r_rename;
  g_rec.rename_exchange = r_exch;
  g_rec.mkdir = r_mkdir;
  g_rec.unlink = r_unlink;
  g_rec.rmdir = r_rmdir;
  kvti_io_set(&g_rec);
}

/* ---- replay ----------------------------------------------------------- */

static char g_base[4096], g_live[4096], g_replay[4096];

static void parent_of(char *out, size_t cap, const char *p) {
  snprintf(out, cap, "%s", p);
  char *s = strrchr(out, '/');
  if (s)
    *s = '\0';
}

/* Maps a logged path under g_live to the same path under g_replay. */
static void remap(char *out, size_t cap, const char *p) {
  size_t l = strlen(g_live);
  if (strncmp(p, g_live, l) == 0)
    snprintf(out, cap, "%s%s", g_replay, p + l);
  else
    snprintf(out, cap, "%s",
             p); /* never happens: all entry I/O is under data/ */
}

static int is_ns(int k) {
  return k == OP_MKDIR || k == OP_CREATE || k == OP_RENAME || k == OP_EXCH ||
         k == OP_UNLINK || k == OP_RMDIR;
}

/* Rebuilds in g_replay the state a power loss after the first K logged
 * operations may leave.
 */
static void replay(size_t K, kvt_rng *rng) {
  kvt_test_rmtree(g_replay);
  r_copy_tree(g_base, g_replay);
  char *durable = calloc(K + 1, 1), *apply = calloc(K + 1, 1);
  for (size_t i = 0; i < K; i++) {
    sim_op *o = &g_log[i];
    char dir[4200];
    if (is_ns(o->kind))
      parent_of(dir, sizeof dir, o->a);
    for (size_t j = i + 1; j < K && !durable[i]; j++) {
      if (g_log[j].kind != OP_FSYNC)
        continue;
      if (is_ns(o->kind) ? !strcmp(g_log[j].a, dir) : !strcmp(g_log[j].a, o->a))
        durable[i] = 1;
    }
    if (o->kind == OP_FSYNC)
      durable[i] = 1;
  }
  /* Non-durable namespace ops: of each directory's, a random prefix survives
   * (0..all, drawn uniformly). Directories are told apart by name. */
  char *dirs[64];
  long cut[64], cnt[64];
  int nd = 0;
  for (int pass = 0; pass < 2; pass++) {
    for (size_t i = 0; i < K; i++) {
      sim_op *o = &g_log[i];
      if (durable[i] || !is_ns(o->kind)) {
        apply[i] = 1; /* durable, or a data write (fate decided at replay) */
        continue;
      }
      char dir[4200];
      parent_of(dir, sizeof dir, o->a);
      int d = 0;
      while (d < nd && strcmp(dirs[d], dir))
        d++;
      if (d == nd) {
        if (nd == 64)
          continue;
        dirs[nd] = strdup(dir);
        cnt[nd] = 0;
        nd++;
      }
      if (pass == 0) {
        cnt[d]++;
      } else if (cut[d] > 0) {
        apply[i] = 1;
        cut[d]--;
      }
    }
    if (pass == 0)
      for (int d = 0; d < nd; d++)
        cut[d] = (long)(kvt_rng_next(rng) % (uint64_t)(cnt[d] + 1));
  }
  for (int d = 0; d < nd; d++)
    free(dirs[d]);
  for (size_t i = 0; i < K; i++) {
    if (!apply[i])
      continue;
    sim_op *o = &g_log[i];
    char a[4200], b[4200];
    remap(a, sizeof a, o->a);
    if (o->b)
      remap(b, sizeof b, o->b);
    switch (o->kind) {
    case OP_MKDIR:
      mkdir(a, 0700);
      break;
    case OP_CREATE: {
      int fd = open(a, O_WRONLY | O_CREAT | O_EXCL, 0600);
      if (fd >= 0)
        close(fd);
      break;
    }
    case OP_TRUNC:
      if (truncate(a, (off_t)o->off) != 0) {
      }
      break;
    case OP_WRITE: {
      int fate =
          durable[i]
              ? 0
              : (int)(kvt_rng_next(rng) % 4); /* 0,1 keep 2 drop 3 garble */
      if (fate == 2)
        break;
      int fd = open(a, O_WRONLY);
      if (fd < 0)
        break;
      unsigned char *d = o->data;
      unsigned char *g = NULL;
      if (fate == 3) {
        g = malloc(o->n);
        kvt_rng_fill(rng, g, o->n);
        d = g;
      }
      if (pwrite(fd, d, o->n, (off_t)o->off) < 0) {
      }
      free(g);
      close(fd);
      break;
    }
    case OP_RENAME:
      rename(a, b);
      break;
    case OP_EXCH:
      kvti_io_default.rename_exchange(a, b);
      break;
    case OP_UNLINK:
      unlink(a);
      break;
    case OP_RMDIR:
      rmdir(a);
      break;
    default:
      break;
    }
  }
  free(durable);
  free(apply);
}

/* ---- the campaign ------------------------------------------------------ */

typedef struct sim_stats {
  uint64_t states, old_seen, new_seen, absent, corrupt_detected, violations;
} sim_stats;

/* Writes `neu` over the state (old present when replace), records, then checks
 * every crash point with `fates` fates each. strict: FSYNC expectations.
 * Returns violations. */
static uint64_t campaign(const t_entry *old, const t_entry *neu, int replace,
                         int do_fsync, int strict, int fates, uint64_t seed,
                         sim_stats *st, int quiet) {
  kvt_test_rmtree(g_base);
  REQUIRE(mkdir(g_base, 0700) == 0);
  if (replace)
    REQUIRE(r_write(g_base, old, KVT_STORAGE_NATIVE, 1) == 0);
  kvt_test_rmtree(g_live);
  r_copy_tree(g_base, g_live);
  log_clear();
  rec_install();
  int rc = r_write(g_live, neu, KVT_STORAGE_NATIVE, do_fsync);
  kvti_io_set(NULL);
  REQUIRE(rc == 0);
  uint64_t viol = 0;
  kvt_rng rng = {seed};
  for (size_t K = 0; K <= g_nlog; K++) {
    int acked = K == g_nlog; /* the write had returned success */
    for (int f = 0; f < fates; f++) {
      replay(K, &rng);
      /* What opening the tier does first: an entry left aside by an
       * interrupted portable replace is put back. */
      REQUIRE(kvti_entry_restore_aside(g_replay, 0, NULL) == 0);
      st->states++;
      int same_new = 0, same_old = 0;
      int rc_new = r_read(g_replay, neu, &same_new);
      if (replace && rc_new == 0 && !same_new)
        rc_new = r_read(g_replay, old, &same_old);
      int bad = 0;
      if (rc_new == 0 && !same_new && !same_old)
        bad = 1; /* wrong data served: never allowed */
      else if (rc_new == -1000)
        bad = 1;
      else if (strict && rc_new != 0 && (replace || rc_new != KVT_ENOTFOUND))
        bad = 1; /* torn / lost (or an acknowledged replace lost) under FSYNC */
      else if (strict && acked && !same_new)
        bad = 1; /* acknowledged but not there */
      else if (!strict && rc_new != 0 && rc_new != KVT_ENOTFOUND &&
               rc_new != KVT_ECORRUPT)
        bad = 1;
      if (rc_new == 0 && same_new)
        st->new_seen++;
      else if (same_old)
        st->old_seen++;
      else if (rc_new == KVT_ENOTFOUND)
        st->absent++;
      else if (rc_new == KVT_ECORRUPT)
        st->corrupt_detected++;
      if (bad) {
        viol++;
        if (!quiet && viol <= 5)
          fprintf(stderr,
                  "  crash after op %zu/%zu (fate %d, replace %d): read %d "
                  "(%s)%s\n",
                  K, g_nlog, f, replace, rc_new, rc_new ? kvt_last_error() : "",
                  acked ? " [acknowledged]" : "");
      }
    }
  }
  st->violations += viol;
  return viol;
}

static int g_fates;

static void test_fsync_order(void) {
  t_entry a = r_make(11, 24, 1), b = r_make(12, 17, 1);
  t_entry a2 = r_make_variant(&a, 13);
  sim_stats st = {0};
  for (int exch = 1; exch >= 0; exch--) {
    g_exch_ok = exch;
    CHECK_EQ_INT(
        campaign(NULL, &b, 0, 1, 1, g_fates, 100 + (uint64_t)exch, &st, 0), 0);
    uint64_t v =
        campaign(&a, &a2, 1, 1, 1, g_fates, 200 + (uint64_t)exch, &st, 0);
    /* Both publish paths: the exchange, and the portable two renames (the
     * old version aside at <hash>.old.tmp, which open restores when <hash>
     * is missing). Any lost or torn entry is a failure. */
    CHECK_EQ_INT(v, 0);
  }
  g_exch_ok = 1;
  fprintf(stderr,
          "fsync: %llu crash states: %llu new, %llu old, %llu absent, %llu "
          "detected "
          "corrupt, violations %llu\n",
          (unsigned long long)st.states, (unsigned long long)st.new_seen,
          (unsigned long long)st.old_seen, (unsigned long long)st.absent,
          (unsigned long long)st.corrupt_detected,
          (unsigned long long)st.violations);
  t_free(&a);
  t_free(&b);
  t_free(&a2);
}

/* Durability NONE: torn states are allowed but must be detected, never served.
 */
static void test_no_fsync_detected(void) {
  t_entry a = r_make(21, 24, 1), b = r_make(22, 17, 1);
  t_entry a2 = r_make_variant(&a, 23);
  sim_stats st = {0};
  CHECK_EQ_INT(campaign(NULL, &b, 0, 0, 0, g_fates, 300, &st, 0), 0);
  CHECK_EQ_INT(campaign(&a, &a2, 1, 0, 0, g_fates, 301, &st, 0), 0);
  fprintf(
      stderr,
      "none: %llu crash states: %llu new, %llu old, %llu absent, %llu detected "
      "corrupt, wrong data served %llu\n",
      (unsigned long long)st.states, (unsigned long long)st.new_seen,
      (unsigned long long)st.old_seen, (unsigned long long)st.absent,
      (unsigned long long)st.corrupt_detected,
      (unsigned long long)st.violations);
  CHECK(st.corrupt_detected > 0); /* torn states did occur and were caught */
  t_free(&a);
  t_free(&b);
  t_free(&a2);
}

/* The simulator must catch a wrong order: file fsyncs skipped but FSYNC
 * guarantees claimed. */
static void test_simulator_catches_bad_order(void) {
  t_entry b = r_make(31, 17, 1);
  sim_stats st = {0};
  g_fsync_files = 0;
  uint64_t v = campaign(NULL, &b, 0, 1, 1, g_fates, 400, &st, 1);
  g_fsync_files = 1;
  fprintf(stderr,
          "bad order: %llu of %llu crash states violate the guarantees\n",
          (unsigned long long)v, (unsigned long long)st.states);
  CHECK(v > 0);
  t_free(&b);
}

int main(void) {
  r_use_fast_tmp();
  char *root = kvt_test_tmpdir("crashsim");
  snprintf(g_base, sizeof g_base, "%s/base", root);
  snprintf(g_live, sizeof g_live, "%s/live", root);
  snprintf(g_replay, sizeof g_replay, "%s/replay", root);
  g_fates = (int)r_env_long("KVT_CRASHSIM_FATES", 24);
  RUN(test_fsync_order);
  RUN(test_no_fsync_detected);
  RUN(test_simulator_catches_bad_order);
  log_clear();
  free(g_log);
  for (int i = 0; i < 4096; i++)
    free(g_fdpath[i]);
  return kvt_test_done();
}
