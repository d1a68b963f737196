/*
 * test_group_commit_tier.c - the writer's group commit, counted through the
 * I/O seam (never timed). Spills queued before the writer starts are all
 * waiting when it takes the first, so it must write them as one batch: one
 * fsync of data/ and one index transaction (WAL fsync) for the batch, where a
 * spill written alone costs one of each (and, as a group of one, syncs all
 * its files before all its directories, and those before the index). Checked
 * with whole entries and with the chunked store (prompts sharing their first
 * chunk inside the batch), on a replacement in the middle of the queue (written
 * alone, in its turn: the batch splits around it), and on a failed fsync of
 * data/ (every publish of the batch rolled back, each spill written again
 * alone). In every case each spill is acknowledged once, successfully, in FIFO
 * order, and serves bit for bit; the directory passes the post-mortem check.
 */
#include "rel_tier.h"

#include "index/chain.h"
#include "index/index.h"
#include "kvtier_sys.h"

#include <fcntl.h>
#include <stdatomic.h>

#define MAX_FD 4096
#define NSP 8
#define C 16

/* ---- the counting seam -------------------------------------------------- */

enum { K_OTHER, K_DATA, K_WAL, K_STAGED, K_INDEX };
static atomic_int g_kind[MAX_FD];
static atomic_long g_data_fsyncs, g_wal_fsyncs, g_fsyncs;
static atomic_int g_fail_data_fsync;   /* fail the next n fsyncs of data/ */
static atomic_int g_fail_staged_fsync; /* ... of a staged data/<h>.tmp/ */
static kvti_io_ops g_ops;

static int kind_of(const char *p) {
  size_t n = strlen(p);
  if (n >= 5 && strcmp(p + n - 5, "/data") == 0)
    return K_DATA;
  if (strstr(p, "index.db-wal"))
    return K_WAL;
  if (n >= 8 && strcmp(p + n - 8, "index.db") == 0)
    return K_INDEX;
  if (n >= 4 && strcmp(p + n - 4, ".tmp") == 0 && strstr(p, "/data/"))
    return K_STAGED;
  return K_OTHER;
}
static void note(int fd, const char *p) {
  if (fd >= 0 && fd < MAX_FD)
    atomic_store(&g_kind[fd], kind_of(p));
}
static int w_open(const char *p, int f, mode_t m) {
  int fd = kvti_io_default.open(p, f, m);
  note(fd, p);
  return fd;
}
static int w_openat(int dfd, const char *p, int f, mode_t m) {
  int fd = kvti_io_default.openat(dfd, p, f, m);
  note(fd, p);
  return fd;
}
static int w_close(int fd) {
  if (fd >= 0 && fd < MAX_FD)
    atomic_store(&g_kind[fd], K_OTHER);
  return kvti_io_default.close(fd);
}
/* Directory fsyncs by inode (a directory opened relative to another has no
 * full path here): how often each directory was fsynced since the last
 * counters_zero. */
#define MAX_DIRS 1024
static pthread_mutex_t g_dir_mu = PTHREAD_MUTEX_INITIALIZER;
static ino_t g_dir_ino[MAX_DIRS];
static int g_dir_cnt[MAX_DIRS], g_ndirs;
static void dir_synced(int fd) {
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISDIR(st.st_mode))
    return;
  pthread_mutex_lock(&g_dir_mu);
  int i = 0;
  while (i < g_ndirs && g_dir_ino[i] != st.st_ino)
    i++;
  if (i == g_ndirs && g_ndirs < MAX_DIRS) {
    g_dir_ino[g_ndirs] = st.st_ino;
    g_dir_cnt[g_ndirs++] = 0;
  }
  if (i < g_ndirs)
    g_dir_cnt[i]++;
  pthread_mutex_unlock(&g_dir_mu);
}
/* The most fsyncs any one directory received; *ndirs: how many were. */
static int dir_sync_max(int *ndirs) {
  pthread_mutex_lock(&g_dir_mu);
  int m = 0;
  for (int i = 0; i < g_ndirs; i++)
    m = g_dir_cnt[i] > m ? g_dir_cnt[i] : m;
  *ndirs = g_ndirs;
  pthread_mutex_unlock(&g_dir_mu);
  return m;
}

/* The order of the fsyncs since counters_zero, one letter each: f a file
 * (chunk, layer or chain record), d a directory but data/, D data/, w the
 * WAL (index.db itself, a checkpoint, is left out). */
#define MAX_SEQ 256
static char g_seq[MAX_SEQ + 1];
static int g_nseq;
static void seq_note(int fd, int k) {
  struct stat st;
  if (k == K_INDEX || fstat(fd, &st) != 0)
    return;
  char c = k == K_WAL            ? 'w'
           : k == K_DATA         ? 'D'
           : S_ISDIR(st.st_mode) ? 'd'
                                 : 'f';
  pthread_mutex_lock(&g_dir_mu);
  if (g_nseq < MAX_SEQ)
    g_seq[g_nseq++] = c;
  g_seq[g_nseq] = '\0';
  pthread_mutex_unlock(&g_dir_mu);
}

static int w_fsync(int fd) {
  int k = fd >= 0 && fd < MAX_FD ? atomic_load(&g_kind[fd]) : K_OTHER;
  if (k == K_DATA && atomic_load(&g_fail_data_fsync) > 0) {
    atomic_fetch_sub(&g_fail_data_fsync, 1);
    errno = EIO;
    return -1;
  }
  if (k == K_STAGED && atomic_load(&g_fail_staged_fsync) > 0) {
    atomic_fetch_sub(&g_fail_staged_fsync, 1);
    errno = EIO;
    return -1;
  }
  int r = kvti_io_default.fsync(fd);
  atomic_fetch_add(&g_fsyncs, 1);
  dir_synced(fd);
  seq_note(fd, k);
  if (k == K_DATA)
    atomic_fetch_add(&g_data_fsyncs, 1);
  else if (k == K_WAL)
    atomic_fetch_add(&g_wal_fsyncs, 1);
  return r;
}
static void seam_install(void) {
  g_ops = kvti_io_default;
  g_ops.open = w_open;
  g_ops.openat = w_openat;
  g_ops.close = w_close;
  g_ops.fsync = w_fsync;
  kvti_io_set(&g_ops);
}
static void counters_zero(void) {
  atomic_store(&g_data_fsyncs, 0);
  atomic_store(&g_wal_fsyncs, 0);
  atomic_store(&g_fsyncs, 0);
  pthread_mutex_lock(&g_dir_mu);
  g_ndirs = 0;
  g_nseq = 0;
  g_seq[0] = '\0';
  pthread_mutex_unlock(&g_dir_mu);
}

/* 1 when seq is a run of f, then a run of d, then the tail given: every file
 * synced in one round before every directory, in one round, before the
 * index. */
static int seq_is(const char *seq, const char *tail) {
  size_t i = 0, f = 0, d = 0;
  while (seq[i] == 'f')
    i++, f++;
  while (seq[i] == 'd')
    i++, d++;
  return f > 0 && d > 0 && strcmp(seq + i, tail) == 0;
}

/* ---- spills ------------------------------------------------------------- */

static rel_done g_done;

/* Spill i's prompt: the first 16 tokens shared by all (one chunk every
 * chunked spill of the batch needs: written by the first, found by the
 * rest), then its own; odd spills are 32 tokens (a chain record when
 * chunked), even ones 40 (a tail). */
static int prompt(int32_t *tok, int i) {
  int n = i % 2 ? 32 : 40;
  for (int k = 0; k < n; k++)
    tok[k] = k < 16 ? 900 + k : 5000 + i * 100 + k;
  return n;
}

static kvt_tier *open_tier(const char *dir, int chunk_tokens) {
  kvt_options o = rel_opts(dir, KVT_DURABILITY_FSYNC);
  o.chunk_tokens = (uint32_t)chunk_tokens;
  o.host_cache_bytes = 0; /* every promote reads the files */
  o.spill_done_fn = rel_done_fn;
  o.spill_done_ctx = &g_done;
  return t_open(&o);
}

static int serves(kvt_tier *t, const int32_t *tok, int n, int T) {
  kvt_promote_opts po = t_popts(NULL);
  kvt_entry *e = NULL;
  int rc = kvt_tier_promote(&e, t, tok, (size_t)n, &po);
  int ok = rc == 0 && t_kv_matches(e, tok, n, T, 2);
  if (!ok)
    fprintf(stderr, "  promote of %d tokens: %d (%s)\n", n, rc,
            rc ? kvt_last_error() : "wrong data");
  kvt_entry_free(e);
  return ok;
}

/* The acknowledgements since the last reset are exactly hashes[0, n), in
 * order, all successful. */
static void check_acks(char (*hashes)[KVT_HASH_HEX_LEN + 1], int n) {
  pthread_mutex_lock(&g_done.mu);
  CHECK_EQ_INT(g_done.n, n);
  for (int i = 0; i < n && i < g_done.n; i++) {
    CHECK(strcmp(g_done.hash[i], hashes[i]) == 0);
    CHECK_EQ_INT(g_done.status[i], 0);
  }
  g_done.n = 0;
  pthread_mutex_unlock(&g_done.mu);
}

static kvt_stats stats_of(kvt_tier *t) {
  kvt_stats s = KVT_STATS_INIT;
  REQUIRE(kvt_tier_stats(&s, t) == 0);
  return s;
}

/* NSP spills queued, then the writer started: one batch. fail_sync: the
 * batch's fsync of data/ fails once. */
static void batch_case(int chunk_tokens, int fail_sync) {
  char *dir = rel_path(kvt_test_tmpdir("group-commit"), "cache", NULL);
  kvt_tier *t = open_tier(dir, chunk_tokens);
  char hashes[NSP][KVT_HASH_HEX_LEN + 1];
  int32_t tok[NSP][64];
  int n[NSP];
  for (int i = 0; i < NSP; i++) {
    n[i] = prompt(tok[i], i);
    kvt_token_hash(hashes[i], tok[i], (size_t)n[i]);
    REQUIRE(t_kv_spill(t, tok[i], n[i], n[i], 2, 1000) == 0);
  }
  counters_zero();
  atomic_store(&g_fail_data_fsync, fail_sync);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  long dsync = atomic_load(&g_data_fsyncs), wal = atomic_load(&g_wal_fsyncs);
  kvt_stats s = stats_of(t);
  fprintf(stderr,
          "C=%d%s: %d spills: %ld fsyncs of data/, %ld WAL fsyncs, %ld fsyncs "
          "in all; %llu group commits of %llu spills\n",
          chunk_tokens, fail_sync ? " (data/ fsync fails once)" : "", NSP,
          dsync, wal, atomic_load(&g_fsyncs),
          (unsigned long long)s.spill_batches,
          (unsigned long long)s.spills_batched);
  check_acks(hashes, NSP);
  CHECK_EQ_INT(s.spill_count, NSP);
  CHECK_EQ_INT(s.write_failures, 0);
  if (!fail_sync) {
    CHECK_EQ_INT(s.spill_batches, 1);
    CHECK_EQ_INT(s.spills_batched, NSP);
    CHECK_EQ_INT(dsync, 1); /* one spill at a time made NSP */
    /* Whole entries: the rows are the only index writes (one commit); a
     * chunked batch also commits each spill's chunk rows with its
     * chained-entry row before publishing, but none of those commits
     * fsyncs the WAL: the rows' commit does, once for the batch. */
    CHECK_EQ_INT(wal, 1);
  } else {
    /* The failed sync rolled the whole batch back; each spill then went
     * alone (its own data/ fsync, its own commit). */
    CHECK_EQ_INT(s.spill_batches, 0);
    CHECK_EQ_INT(dsync, NSP);
  }
  for (int i = 0; i < NSP; i++)
    CHECK(serves(t, tok[i], n[i], n[i]));
  CHECK_EQ_INT(kvt_tier_close(t, -1), 0);
  kvt_tier_free(t);
  CHECK_EQ_INT(rel_check_dir(dir, NULL), NSP);
  free(dir);
}

static void test_batch_whole(void) {
  batch_case(0, 0);
}
static void test_batch_chunked(void) {
  batch_case(C, 0);
}
static void test_batch_sync_fails(void) {
  batch_case(0, 1);
  batch_case(C, 1);
}

/* The same NSP spills written one at a time (each flushed before the next
 * is queued) and queued together (one batch), on fresh directories: the batch
 * fsyncs fewer times in all, data/ once where the singles fsync it NSP
 * times, the WAL once where they do NSP, and no directory more than once. */
typedef struct flush_count {
  long all, data, wal;
  int dir_max, ndirs;
} flush_count;
static flush_count spill_all(int chunk_tokens, int batch) {
  char *dir = rel_path(kvt_test_tmpdir("group-commit-n"), "cache", NULL);
  kvt_tier *t = open_tier(dir, chunk_tokens);
  if (!batch)
    REQUIRE(kvt_tier_start_writer(t) == 0);
  int32_t tok[NSP][64];
  int n[NSP];
  counters_zero();
  for (int i = 0; i < NSP; i++) {
    n[i] = prompt(tok[i], i);
    REQUIRE(t_kv_spill(t, tok[i], n[i], n[i], 2, 1000) == 0);
    if (!batch)
      REQUIRE(kvt_tier_flush(t, -1) == 0);
  }
  if (batch)
    REQUIRE(kvt_tier_start_writer(t) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  flush_count c = {atomic_load(&g_fsyncs), atomic_load(&g_data_fsyncs),
                   atomic_load(&g_wal_fsyncs), 0, 0};
  c.dir_max = dir_sync_max(&c.ndirs);
  kvt_stats s = stats_of(t);
  CHECK_EQ_INT(s.spills_batched, batch ? NSP : 0);
  for (int i = 0; i < NSP; i++)
    CHECK(serves(t, tok[i], n[i], n[i]));
  pthread_mutex_lock(&g_done.mu);
  g_done.n = 0;
  pthread_mutex_unlock(&g_done.mu);
  CHECK_EQ_INT(kvt_tier_close(t, -1), 0);
  kvt_tier_free(t);
  CHECK_EQ_INT(rel_check_dir(dir, NULL), NSP);
  free(dir);
  return c;
}
static void test_batch_fewer_flushes(void) {
  for (int C_ = 0; C_ <= C; C_ += C) {
    flush_count one = spill_all(C_, 0), all = spill_all(C_, 1);
    fprintf(stderr,
            "C=%d, %d spills: one by one %ld fsyncs (data/ %ld, WAL %ld, "
            "%d directories, one up to %d times); one batch %ld (data/ "
            "%ld, WAL %ld, %d directories, each at most %d times)\n",
            C_, NSP, one.all, one.data, one.wal, one.ndirs, one.dir_max,
            all.all, all.data, all.wal, all.ndirs, all.dir_max);
    CHECK(all.all < one.all);
    CHECK_EQ_INT(one.data, NSP);
    CHECK_EQ_INT(all.data, 1);
    CHECK_EQ_INT(one.wal, NSP);
    CHECK_EQ_INT(all.wal, 1);
    CHECK(one.dir_max >= NSP); /* data/ */
    CHECK_EQ_INT(all.dir_max, 1);
  }
}

/* One durable spill alone, flushes counted: a group of one. Its chunk files
 * and staged files are synced in one round, then every directory in one
 * round, then data/ once, then the WAL once: the commit of its chunk rows and
 * chained-entry record does not fsync the WAL, its row's commit does (both
 * before the acknowledgement). Chain records (32 tokens at C = 16, two
 * chunks): the first spill writes both chunks (3 files: chunks and
 * chain.kvr) and syncs data/H.tmp, the chunk directories, chunks/ (new
 * directories in it) and the cache directory once (chunks/ new in it); the
 * second shares the first chunk (2 files) and syncs the cache directory no
 * more. Whole entries: their files, data/H.tmp, data/, the WAL. */
static int count_of(const char *seq, char c) {
  int n = 0;
  for (; *seq; seq++)
    n += *seq == c;
  return n;
}
static void single_case(int chunk_tokens) {
  char *dir = rel_path(kvt_test_tmpdir("group-commit-1"), "cache", NULL);
  kvt_tier *t = open_tier(dir, chunk_tokens);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  struct stat root;
  REQUIRE(stat(dir, &root) == 0);
  for (int i = 1; i <= 3; i += 2) {
    int32_t tok[64];
    int n = prompt(tok, i);
    char h[1][KVT_HASH_HEX_LEN + 1];
    kvt_token_hash(h[0], tok, (size_t)n);
    counters_zero();
    REQUIRE(t_kv_spill(t, tok, n, n, 2, 1000) == 0);
    REQUIRE(kvt_tier_flush(t, -1) == 0);
    pthread_mutex_lock(&g_dir_mu);
    char seq[MAX_SEQ + 1];
    memcpy(seq, g_seq, sizeof seq);
    int root_syncs = 0;
    for (int d = 0; d < g_ndirs; d++)
      if (g_dir_ino[d] == root.st_ino)
        root_syncs = g_dir_cnt[d];
    pthread_mutex_unlock(&g_dir_mu);
    long all = atomic_load(&g_fsyncs);
    fprintf(stderr,
            "C=%d, spill %d: %ld fsyncs (data/ %ld, WAL %ld, cache directory "
            "%d), in order: %s\n",
            chunk_tokens, i, all, atomic_load(&g_data_fsyncs),
            atomic_load(&g_wal_fsyncs), root_syncs, seq);
    CHECK_EQ_INT(atomic_load(&g_data_fsyncs), 1);
    CHECK_EQ_INT(atomic_load(&g_wal_fsyncs), 1);
    CHECK(seq_is(seq, "Dw"));
    if (chunk_tokens) {
      CHECK_EQ_INT(count_of(seq, 'f'), i == 1 ? 3 : 2);
      CHECK_EQ_INT(root_syncs, i == 1 ? 1 : 0);
    } else {
      CHECK_EQ_INT(count_of(seq, 'd'), 1); /* data/H.tmp */
      CHECK_EQ_INT(root_syncs, 0);
    }
    CHECK_EQ_INT(all, (long)strlen(seq));
    check_acks(h, 1);
    CHECK(serves(t, tok, n, n));
  }
  CHECK_EQ_INT(kvt_tier_close(t, -1), 0);
  kvt_tier_free(t);
  CHECK_EQ_INT(rel_check_dir(dir, NULL), 2);
  free(dir);
}
static void test_single(void) {
  single_case(0);
  single_case(C);
}

/* Queue: X0 X1 R X2, R replacing a stored entry: X0 and X1 are one group, R
 * is written alone after them, X2 alone after R; acknowledged in that order,
 * R serving its new version. */
static void test_replace_in_queue(void) {
  for (int C_ = 0; C_ <= C; C_ += C) {
    char *dir = rel_path(kvt_test_tmpdir("group-commit-r"), "cache", NULL);
    kvt_tier *t = open_tier(dir, C_);
    int32_t tok[4][64];
    int n[4];
    char hashes[4][KVT_HASH_HEX_LEN + 1];
    for (int i = 0; i < 4; i++) {
      n[i] = prompt(tok[i], i);
      kvt_token_hash(hashes[i], tok[i], (size_t)n[i]);
    }
    /* R = prompt 2, stored first with T = n (no spare rows). */
    REQUIRE(kvt_tier_start_writer(t) == 0);
    REQUIRE(t_kv_spill(t, tok[2], n[2], n[2], 2, 1000) == 0);
    REQUIRE(kvt_tier_flush(t, -1) == 0);
    pthread_mutex_lock(&g_done.mu);
    g_done.n = 0;
    pthread_mutex_unlock(&g_done.mu);
    kvt_tier_close(t, -1);
    kvt_tier_free(t);
    t = open_tier(dir, C_);
    /* The new version of R carries 8 spare rows (T = n + 8). */
    REQUIRE(t_kv_spill(t, tok[0], n[0], n[0], 2, 1000) == 0);
    REQUIRE(t_kv_spill(t, tok[1], n[1], n[1], 2, 1000) == 0);
    REQUIRE(t_kv_spill(t, tok[2], n[2], n[2] + 8, 2, 1000) == 0);
    REQUIRE(t_kv_spill(t, tok[3], n[3], n[3], 2, 1000) == 0);
    REQUIRE(kvt_tier_start_writer(t) == 0);
    REQUIRE(kvt_tier_flush(t, -1) == 0);
    char order[4][KVT_HASH_HEX_LEN + 1];
    for (int i = 0; i < 4; i++)
      memcpy(order[i], hashes[i], sizeof order[i]);
    check_acks(order, 4);
    kvt_stats s = stats_of(t);
    CHECK_EQ_INT(s.spill_batches, 1);
    CHECK_EQ_INT(s.spills_batched, 2);
    CHECK_EQ_INT(s.write_failures, 0);
    CHECK(serves(t, tok[0], n[0], n[0]));
    CHECK(serves(t, tok[1], n[1], n[1]));
    CHECK(serves(t, tok[2], n[2], n[2] + 8));
    CHECK(serves(t, tok[3], n[3], n[3]));
    CHECK_EQ_INT(kvt_tier_close(t, -1), 0);
    kvt_tier_free(t);
    CHECK_EQ_INT(rel_check_dir(dir, NULL), 4);
    free(dir);
  }
}

/* The same spill queued twice: the second is not taken into the first's
 * batch (one hash per batch) and replaces it afterwards. */
static void test_same_hash_twice(void) {
  char *dir = rel_path(kvt_test_tmpdir("group-commit-2"), "cache", NULL);
  kvt_tier *t = open_tier(dir, C);
  int32_t tok[2][64];
  int n[2];
  char h[3][KVT_HASH_HEX_LEN + 1];
  for (int i = 0; i < 2; i++) {
    n[i] = prompt(tok[i], i);
    kvt_token_hash(h[i], tok[i], (size_t)n[i]);
  }
  memcpy(h[2], h[0], sizeof h[2]);
  REQUIRE(t_kv_spill(t, tok[0], n[0], n[0], 2, 1000) == 0);
  REQUIRE(t_kv_spill(t, tok[1], n[1], n[1], 2, 1000) == 0);
  REQUIRE(t_kv_spill(t, tok[0], n[0], n[0] + 8, 2, 1000) == 0);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  check_acks(h, 3);
  kvt_stats s = stats_of(t);
  CHECK_EQ_INT(s.spills_batched, 2);
  CHECK(serves(t, tok[0], n[0], n[0] + 8)); /* the later one rules */
  CHECK(serves(t, tok[1], n[1], n[1]));
  CHECK_EQ_INT(kvt_tier_close(t, -1), 0);
  kvt_tier_free(t);
  CHECK_EQ_INT(rel_check_dir(dir, NULL), 2);
  free(dir);
}

/* A chunked spill whose staging fails after its chunk rows and record were
 * committed together: the record is taken back (no chained-entry row for an
 * entry that was never published), alone and inside a batch; the spill
 * fails, the others of the batch are written, and a retry serves. */
static int record_present(const char *dir, const char *hash) {
  kvt_index *idx = NULL;
  kvti_chains *ch = NULL;
  REQUIRE(kvti_index_open(&idx, dir, NULL, 0) == 0);
  REQUIRE(kvti_chains_open(&ch, idx) == 0);
  uint8_t h[32];
  REQUIRE(kvti_unhex32(h, hash) == 0);
  int has = kvti_chains_entry_get(ch, h, NULL);
  kvti_chains_close(ch);
  kvt_index_close(idx);
  return has;
}
static void test_stage_fails_record_undone(void) {
  for (int batch = 0; batch <= 1; batch++) {
    char *dir = rel_path(kvt_test_tmpdir("group-commit-s"), "cache", NULL);
    kvt_tier *t = open_tier(dir, C);
    if (!batch)
      REQUIRE(kvt_tier_start_writer(t) == 0);
    int32_t tok[3][64];
    int n[3];
    char h[3][KVT_HASH_HEX_LEN + 1];
    /* The first spill's staging: inside a batch, the batch's round of
     * directory fsyncs fails on it (every spill is then written alone), and
     * so does its own write alone. */
    atomic_store(&g_fail_staged_fsync, batch ? 2 : 1);
    for (int i = 0; i < (batch ? 3 : 1); i++) {
      n[i] = prompt(tok[i], i);
      kvt_token_hash(h[i], tok[i], (size_t)n[i]);
      REQUIRE(t_kv_spill(t, tok[i], n[i], n[i], 2, 1000) == 0);
    }
    if (batch)
      REQUIRE(kvt_tier_start_writer(t) == 0);
    REQUIRE(kvt_tier_flush(t, -1) == 0);
    atomic_store(&g_fail_staged_fsync, 0);
    kvt_stats s = stats_of(t);
    CHECK_EQ_INT(s.write_failures, 1);
    CHECK(rel_done_status(&g_done, h[0]) != 0);
    for (int i = 1; i < (batch ? 3 : 1); i++) {
      CHECK_EQ_INT(rel_done_status(&g_done, h[i]), 0);
      CHECK(serves(t, tok[i], n[i], n[i]));
    }
    CHECK_EQ_INT(kvt_tier_close(t, -1), 0);
    kvt_tier_free(t);
    CHECK(!record_present(dir, h[0]));
    t = open_tier(dir, C);
    REQUIRE(kvt_tier_start_writer(t) == 0);
    REQUIRE(t_kv_spill(t, tok[0], n[0], n[0], 2, 1000) == 0);
    REQUIRE(kvt_tier_flush(t, -1) == 0);
    CHECK(serves(t, tok[0], n[0], n[0]));
    CHECK_EQ_INT(kvt_tier_close(t, -1), 0);
    kvt_tier_free(t);
    CHECK(record_present(dir, h[0]));
    pthread_mutex_lock(&g_done.mu);
    g_done.n = 0;
    pthread_mutex_unlock(&g_done.mu);
    free(dir);
  }
}

int main(void) {
  r_use_fast_tmp();
  pthread_mutex_init(&g_done.mu, NULL);
  seam_install();
  RUN(test_batch_whole);
  RUN(test_batch_chunked);
  RUN(test_batch_sync_fails);
  RUN(test_single);
  RUN(test_batch_fewer_flushes);
  RUN(test_replace_in_queue);
  RUN(test_same_hash_twice);
  RUN(test_stage_fails_record_undone);
  kvti_io_set(NULL);
  return kvt_test_done();
}
