/*
 * test_fault_chunks.c - the chunk store under faults and crashes
 * (src/store/chunkstore.c, src/format/chunk.c, src/index/chain.c). Fault
 * injection: for every I/O operation a chunk put uses (open, pwrite, fsync,
 * rename, mkdir, lstat, close, fstat, unlink, allocation), each call site in
 * turn fails (EIO, then a sticky ENOSPC for writes) while a chain is extended;
 * afterwards, and again after a reopen, every indexed chunk has its complete,
 * verifying file and every ancestor (no chain points at a missing chunk), no
 * temporary is left, and a retry without faults completes the chain writing
 * only the missing chunks. SIGKILL trials: a child process extends and
 * branches chains in a loop and is killed at a random moment; the reopened
 * store must satisfy the same invariants. Reads: every read call of a chain
 * read fails in turn (EIO: the read fails with nothing handed out; short:
 * it completes with exact data). Trials: KVT_CHUNK_KILL_TRIALS (default 12).
 */
#include "faultio.h"
#include "rel_common.h"
#include "index/chain.h"
#include "index/index.h"
#include "store/chunkstore.h"
#include "store/local_dir.h"
#include "kvtier_sys.h"

#include <fcntl.h>

#include <signal.h>
#include <sys/wait.h>
#include <time.h>

#define C 16
#define NTOK 96

static char *g_base;
static int32_t g_tok[NTOK];
static kvt_layer g_l[2];
static uint32_t g_ids[2] = {0, 1};

typedef struct store {
  kvt_index *idx;
  kvti_chunkstore *cs;
} store;

static int sopen(store *s, const char *dir) {
  int rc = kvti_index_open(&s->idx, dir, NULL, 0);
  if (rc)
    return rc;
  kvti_chunkstore_opts o = {0600, 0700, 1};
  if ((rc = kvti_chunkstore_open(&s->cs, dir, s->idx, &o)) != 0) {
    kvt_index_close(s->idx);
    return rc;
  }
  return 0;
}
static void sclose(store *s) {
  kvti_chunkstore_close(s->cs);
  kvt_index_close(s->idx);
}

static int put(store *s, const int32_t *tok, size_t n,
               kvti_chunkstore_result *res) {
  kvti_chunkstore_spill sp = {
      (const uint8_t *)"\0\0\0\0\0\0\0\0", 8, tok, n, C, g_l, g_ids, 2, 2};
  return kvti_chunkstore_put(s->cs, &sp, res);
}

typedef struct check_ctx {
  kvti_chunkstore *cs;
  int bad;
  size_t n;
} check_ctx;

static int check_one(void *vctx, const kvti_chain_rec *r) {
  check_ctx *c = vctx;
  c->n++;
  int fd;
  kvti_chunk_hdr h;
  if (kvti_chunkstore_open_chunk(c->cs, r, NULL, &fd, &h) != 0) {
    fprintf(stderr, "indexed chunk %llu unreadable: %s\n",
            (unsigned long long)r->index, kvt_last_error());
    c->bad++;
    return 0;
  }
  void *d = malloc(h.data_bytes ? h.data_bytes : 1);
  if (kvti_chunk_read_data(fd, &h, d, "chunk") != 0) {
    fprintf(stderr, "indexed chunk %llu fails verification: %s\n",
            (unsigned long long)r->index, kvt_last_error());
    c->bad++;
  }
  free(d);
  kvti_chunk_hdr_free(&h);
  close(fd);
  return 0;
}

static int count_suffix(const char *dir, const char *suffix) {
  char cd[4096];
  int total = 0;
  for (int a = 0; a < 256; a++) {
    REQUIRE((size_t)snprintf(cd, sizeof cd, "%s/chunks/%02x", dir, a) <
            sizeof cd);
    int k = kvt_test_count_dir(cd, suffix);
    total += k > 0 ? k : 0;
  }
  return total;
}

/* Every indexed chunk reads back and has all its ancestors indexed (the chain
 * table guarantees the links; a lookup of each chain's tokens must reach its
 * indexed length). Returns the number of indexed chunks. */
static size_t check_store(store *s, const char *dir, int allow_tmp) {
  check_ctx c = {s->cs, 0, 0};
  kvti_chains_foreach(kvti_chunkstore_chains(s->cs), check_one, &c);
  CHECK_EQ_INT(c.bad, 0);
  if (!allow_tmp)
    CHECK_EQ_INT(count_suffix(dir, ".tmp"), 0);
  /* Rows <= files (an orphan file is harmless; a row without a file is not,
   * and check_one caught it). */
  CHECK((size_t)count_suffix(dir, ".kvc") >= c.n);
  return c.n;
}

static void fresh(char *dir, size_t cap, const char *tag, int i) {
  snprintf(dir, cap, "%s/%s-%d", g_base, tag, i);
  kvt_test_rmtree(dir);
  mkdir(dir, 0700);
}

static void campaign(fio_op op, int err, int sticky) {
  int sites = 0;
  for (uint64_t nth = 1; nth < 400; nth++) {
    char dir[4096];
    fresh(dir, sizeof dir, "f", (int)op);
    store s;
    REQUIRE(sopen(&s, dir) == 0);
    kvti_chunkstore_result res;
    REQUIRE(put(&s, g_tok, 48, &res) == 0); /* 3 chunks before the fault */
    fio_arm(op, nth, FIO_FAIL_ERRNO, err, sticky);
    int rc = put(&s, g_tok, NTOK, &res);
    uint64_t fired = fio_fired();
    fio_disarm();
    if (!fired) {
      CHECK_EQ_INT(rc, 0);
      sclose(&s);
      break;
    }
    sites++;
    CHECK(rc == 0 || rc < 0);
    size_t n = check_store(&s, dir, op == FIO_UNLINK);
    CHECK(n >= 3);
    sclose(&s);
    REQUIRE(sopen(&s, dir) == 0);
    check_store(&s, dir, op == FIO_UNLINK);
    /* A retry completes the chain, writing only what is missing. */
    REQUIRE(put(&s, g_tok, NTOK, &res) == 0);
    CHECK_EQ_INT(res.chunks, NTOK / C);
    CHECK(res.written == NTOK / C - n || rc != 0);
    kvti_chain_rec out[8];
    size_t m;
    CHECK(kvti_chunkstore_lookup(s.cs, (const uint8_t *)"\0\0\0\0\0\0\0\0", 8,
                                 g_tok, NTOK, C, out, 8, &m) == 0);
    CHECK_EQ_INT(m, NTOK / C);
    CHECK_EQ_INT(check_store(&s, dir, op == FIO_UNLINK), NTOK / C);
    sclose(&s);
    if (sticky)
      break; /* every later call fails too: one trial is enough */
  }
  fprintf(stderr, "  %s (%s%s): %d call sites failed in turn\n",
          fio_op_name(op), strerror(err), sticky ? ", sticky" : "", sites);
}

static void test_faults(void) {
  fio_install();
  const fio_op ops[] = {FIO_OPEN,  FIO_PWRITE, FIO_FSYNC, FIO_RENAME,
                        FIO_MKDIR, FIO_LSTAT,  FIO_CLOSE, FIO_FSTAT,
                        FIO_CHMOD, FIO_UNLINK, FIO_ALLOC};
  for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++)
    campaign(ops[i], ops[i] == FIO_ALLOC ? ENOMEM : EIO, 0);
  campaign(FIO_PWRITE, ENOSPC, 1);
  campaign(FIO_FSYNC, EIO, 1);
  fio_remove();
}

/* Whether prefix p (all NTOK rows of a chain spilled from layers l) holds
 * exactly l's tensors. */
static int prefix_is(const kvti_chunk_prefix *p, const kvt_layer *l,
                     uint32_t nl) {
  if (!p->layers || p->n_layers != nl)
    return 0;
  for (uint32_t k = 0; k < nl; k++) {
    const kvt_layer *a = &p->layers[k], *b = &l[p->layer_idx[k]];
    if (a->num_tensors != b->num_tensors)
      return 0;
    for (uint32_t j = 0; j < a->num_tensors; j++)
      if (a->tensors[j].nbytes != b->tensors[j].nbytes ||
          memcmp(a->tensors[j].data, b->tensors[j].data, b->tensors[j].nbytes))
        return 0;
  }
  return 1;
}

/* The chain read a cold promote runs (head extents coalesced into vectored
 * requests straight into the destination tensors) with every read call
 * failing in turn: EIO fails the read cleanly (KVT_EIO, nothing handed
 * out), a short transfer is completed (exact data). Twice: through the
 * seam's preadv, and with none (one pread per segment: the EIO then hits
 * the middle of a request). Two layouts: tiny layers (one request of many
 * segments per chunk) and 1.5 MiB chunks (several 1 MiB requests each). */
static void read_campaign(const char *tag, kvt_layer *l, uint32_t nl,
                          int with_preadv) {
  char dir[4096];
  fresh(dir, sizeof dir, tag, with_preadv);
  store s;
  REQUIRE(sopen(&s, dir) == 0);
  uint32_t ids[4] = {0, 1, 2, 3};
  const uint8_t *ns = (const uint8_t *)"\0\0\0\0\0\0\0\0";
  kvti_chunkstore_spill sp = {ns, 8, g_tok, NTOK, C, l, ids, nl, nl};
  kvti_chunkstore_result res;
  REQUIRE(kvti_chunkstore_put(s.cs, &sp, &res) == 0);
  kvti_chain_rec recs[NTOK / C];
  size_t m = 0;
  REQUIRE(kvti_chunkstore_lookup(s.cs, ns, 8, g_tok, NTOK, C, recs, NTOK / C,
                                 &m) == 0);
  REQUIRE(m == NTOK / C);
  fio_install();
  kvti_io_ops np = *kvti_io;
  if (!with_preadv) {
    np.preadv = NULL;
    kvti_io_set(&np);
  }
  for (int kind = 0; kind < 2; kind++) {
    uint64_t sites = 0;
    for (uint64_t nth = 1; nth < 100000; nth++) {
      fio_arm(FIO_PREAD, nth, kind ? FIO_FAIL_SHORT : FIO_FAIL_ERRNO, EIO, 0);
      kvti_chunk_read_opts o = {0};
      kvti_chunk_prefix p;
      size_t bad = 99;
      int rc = kvti_chunkstore_read_prefix(s.cs, recs, m, g_tok, &o, &p, &bad);
      uint64_t fired = fio_fired();
      fio_disarm();
      if (!fired) {
        CHECK_EQ_INT(rc, 0);
        if (rc == 0) {
          CHECK(prefix_is(&p, l, nl));
          kvti_chunk_prefix_free(&p, &o);
        }
        break;
      }
      sites++;
      if (kind == 0) {
        CHECK_EQ_INT(rc, KVT_EIO);
        CHECK(p.layers == NULL && p.n_layers == 0);
        if (rc == 0)
          kvti_chunk_prefix_free(&p, &o);
      } else {
        CHECK_EQ_INT(rc, 0);
        if (rc == 0) {
          CHECK(prefix_is(&p, l, nl));
          kvti_chunk_prefix_free(&p, &o);
        }
      }
    }
    /* More read calls than chunks: the data reads were failed too, not only
     * the headers'. */
    CHECK(sites > NTOK / C);
    fprintf(stderr, "  %s (%s, %s): %llu read calls failed in turn\n", tag,
            kind ? "short" : "EIO",
            with_preadv && kvti_io_default.preadv ? "preadv"
                                                  : "pread per segment",
            (unsigned long long)sites);
  }
  fio_remove();
  sclose(&s);
}

static void test_read_faults(void) {
  read_campaign("rd-small", g_l, 2, 1);
  read_campaign("rd-small", g_l, 2, 0);
  kvt_rng r = {11};
  kvt_layer big[3];
  for (int i = 0; i < 3; i++)
    big[i] = t_kv(&r, KVT_DTYPE_F16, 1, 8, NTOK, 1024, NTOK);
  read_campaign("rd-big", big, 3, 1);
  read_campaign("rd-big", big, 3, 0);
  for (int i = 0; i < 3; i++)
    t_layer_free(&big[i]);
}

/* The harness sees the calls relative to a directory descriptor: a fault
 * armed on open, unlink, rmdir, lstat, rename, mkdir, opendir or chmod fires
 * on openat, unlinkat (AT_REMOVEDIR), fstatat, renameat, mkdirat,
 * fdopendir and fchmod, each reported to the caller; a target set on a
 * directory reaches the calls below its descriptor; and a chunk put under a
 * sticky rename fault aimed at chunks/ (its renameat of the tmp) fails,
 * leaving no tmp and no row without its file. */
static void test_at_calls_faulted(void) {
  fio_install();
  char dir[4096];
  fresh(dir, sizeof dir, "at", 0);
  int root = kvti_dir_open_root(dir);
  REQUIRE(root >= 0);
  int fd = openat(root, "f", O_WRONLY | O_CREAT, 0600);
  REQUIRE(fd >= 0);
  close(fd);
  REQUIRE(mkdirat(root, "sub", 0700) == 0);
  struct stat st;

  fio_arm(FIO_OPEN, 1, FIO_FAIL_ERRNO, EIO, 0);
  CHECK(kvti_openat(root, "f", O_RDONLY, 0, NULL) < 0);
  CHECK_EQ_INT(fio_fired(), 1);
  fio_arm(FIO_LSTAT, 1, FIO_FAIL_ERRNO, EIO, 0);
  CHECK(kvti_lstatat(root, "f", &st, NULL) < 0);
  CHECK_EQ_INT(fio_fired(), 1);
  fio_arm(FIO_RENAME, 1, FIO_FAIL_ERRNO, EIO, 0);
  CHECK(kvti_renameat(root, "f", root, "g", NULL, NULL) < 0);
  CHECK_EQ_INT(fio_fired(), 1);
  CHECK(kvt_test_exists(dir) && fstatat(root, "f", &st, 0) == 0);
  fio_arm(FIO_MKDIR, 1, FIO_FAIL_ERRNO, EIO, 0);
  CHECK(kvti_mkdirat(root, "d2", 0700, NULL) < 0);
  CHECK_EQ_INT(fio_fired(), 1);
  fio_arm(FIO_UNLINK, 1, FIO_FAIL_ERRNO, EIO, 0);
  CHECK(kvti_unlinkat(root, "f", NULL) < 0);
  CHECK_EQ_INT(fio_fired(), 1);
  CHECK(fstatat(root, "f", &st, 0) == 0);
  fio_arm(FIO_CHMOD, 1, FIO_FAIL_ERRNO, EIO, 0);
  fd = kvti_openat(root, "f", O_RDONLY, 0, NULL);
  REQUIRE(fd >= 0);
  CHECK(kvti_fchmod(fd, 0600, NULL) < 0);
  CHECK_EQ_INT(fio_fired(), 1);
  kvti_close(fd);
  fio_arm(FIO_OPENDIR, 1, FIO_FAIL_ERRNO, EIO, 0);
  fd = openat(root, "sub", O_RDONLY | O_DIRECTORY);
  REQUIRE(fd >= 0);
  CHECK(kvti_fdopendir(fd) == NULL);
  CHECK_EQ_INT(fio_fired(), 1);
  close(fd);
  /* A removal of a quarantined tree (kvti_dir_bound) goes through
   * unlinkat(AT_REMOVEDIR): counted and failed as rmdir. */
  fio_arm(FIO_RMDIR, 1, FIO_FAIL_ERRNO, EIO, 0);
  size_t removed = 9;
  CHECK(kvti_dir_bound(root, 0, "sub", NULL, &removed, dir) < 0);
  CHECK_EQ_INT(fio_fired(), 1);
  CHECK_EQ_INT(removed, 0);
  CHECK(fstatat(root, "sub", &st, 0) == 0);
  fio_disarm();

  /* Targets below a directory descriptor: aimed at "sub", an open of a
   * name in sub's descriptor fails; one in the root does not. */
  fio_target("sub");
  int sub = kvti_dir_open_rel(root, "sub", dir);
  REQUIRE(sub >= 0);
  fio_arm(FIO_OPEN, 1, FIO_FAIL_ERRNO, EIO, 1);
  fd = kvti_openat(root, "f", O_RDONLY, 0, NULL);
  CHECK(fd >= 0);
  if (fd >= 0)
    kvti_close(fd);
  CHECK(kvti_openat(sub, "x", O_WRONLY | O_CREAT, 0600, NULL) < 0);
  CHECK_EQ_INT(fio_fired(), 1);
  fio_disarm();
  fio_target(NULL);
  kvti_close(sub);
  kvti_close(root);

  /* A chunk put whose tmp renames (renameat in chunks/<kk>) all fail. */
  char d2[4096];
  fresh(d2, sizeof d2, "at-put", 0);
  store s;
  REQUIRE(sopen(&s, d2) == 0);
  kvti_chunkstore_result res;
  fio_target("chunks");
  fio_arm(FIO_RENAME, 1, FIO_FAIL_ERRNO, EIO, 1);
  CHECK(put(&s, g_tok, NTOK, &res) < 0);
  CHECK(fio_fired() >= 1);
  fio_disarm();
  fio_target(NULL);
  CHECK_EQ_INT(check_store(&s, d2, 0), 0);
  CHECK_EQ_INT(count_suffix(d2, ".kvc"), 0);
  REQUIRE(put(&s, g_tok, NTOK, &res) == 0);
  CHECK_EQ_INT(check_store(&s, d2, 0), NTOK / C);
  sclose(&s);
  fio_remove();
}

/* Child: extends and branches chains forever. */
static void child_loop(const char *dir, uint64_t seed) {
  store s;
  if (sopen(&s, dir) != 0)
    _exit(2);
  kvt_rng r = {seed};
  int32_t tok[NTOK];
  for (;;) {
    memcpy(tok, g_tok, sizeof tok);
    size_t cut = (size_t)(kvt_rng_next(&r) % NTOK);
    for (size_t i = cut; i < NTOK; i++)
      tok[i] = (int32_t)(kvt_rng_next(&r) % 50000);
    kvti_chunkstore_result res;
    put(&s, tok, NTOK, &res);
    if (kvt_rng_next(&r) % 4 == 0) {
      kvti_chain_rec out[8];
      size_t m;
      if (kvti_chunkstore_lookup(s.cs, (const uint8_t *)"\0\0\0\0\0\0\0\0", 8,
                                 tok, NTOK, C, out, 8, &m) == 0 &&
          m > 2)
        kvti_chunkstore_remove(s.cs, out[m / 2].key, NULL, NULL);
    }
  }
}

static void test_sigkill(void) {
  const char *e = getenv("KVT_CHUNK_KILL_TRIALS");
  int trials = e ? atoi(e) : 12;
  char dir[4096];
  fresh(dir, sizeof dir, "kill", 0);
  kvt_rng r = {77};
  size_t max_seen = 0;
  for (int t = 0; t < trials; t++) {
    pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0)
      child_loop(dir, (uint64_t)t + 1);
    struct timespec ts = {0, (long)(20 + kvt_rng_next(&r) % 180) * 1000000L};
    nanosleep(&ts, NULL);
    kill(pid, SIGKILL);
    int st;
    waitpid(pid, &st, 0);
    CHECK(WIFSIGNALED(st));
    store s;
    REQUIRE(sopen(&s, dir) == 0);
    /* A killed writer may leave one <key>.tmp: it is replaced when that chunk
     * is written again, or removed by gc. */
    size_t n = check_store(&s, dir, 1);
    if (n > max_seen)
      max_seen = n;
    sclose(&s);
  }
  fprintf(stderr, "  %d SIGKILL trials, up to %zu chunks indexed\n", trials,
          max_seen);
  CHECK(max_seen > 0);
}

int main(void) {
  g_base = kvt_test_tmpdir("faultchunks");
  kvt_rng r = {5};
  for (int i = 0; i < NTOK; i++)
    g_tok[i] = (int32_t)(kvt_rng_next(&r) % 50000);
  g_l[0] = t_kv(&r, KVT_DTYPE_F16, 1, 2, NTOK, 8, NTOK);
  g_l[1] = t_quant(&r, 4, 32, KVT_DTYPE_BF16, 1, 2, NTOK, 64, NTOK);
  RUN(test_read_faults);
  RUN(test_faults);
  RUN(test_at_calls_faulted);
  RUN(test_sigkill);
  t_layer_free(&g_l[0]);
  t_layer_free(&g_l[1]);
  return kvt_test_done();
}
