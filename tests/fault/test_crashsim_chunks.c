/*
 * test_crashsim_chunks.c - the power-loss simulator (tests/lib/crashsim.h)
 * over the chunked native store: one spill - its missing chunk files, their
 * chain rows and the chained-entry row in index.db (through the kvtier-io
 * SQLite VFS), its chain record or tail entry, then the entry's index row,
 * as the tier's writer does it - runs under the recording I/O table on top of
 * a store that already holds a shorter chain of the same prompt (and, in the
 * replacement cases, an older version of the entry). For every crash point
 * and several seeded fates the reopened store must hold: every indexed chunk
 * with its complete, verifying file and every ancestor indexed (no chain
 * points at a missing or partial chunk); the prefix stored before the spill
 * still found whole; an entry whose row exists read back bit for bit (or
 * reported missing while its chain is incomplete), never torn or wrong; once
 * the spill was acknowledged, exactly the new entry. Cases: a chain record
 * (pure KV, no tail rows), a tail entry (spare rows), each new and replacing.
 * Finally the simulator must catch a wrong order (chunk and entry files not
 * fsynced but success claimed). KVT_CRASHSIM_FATES (default 6) sets the fates
 * per crash point.
 */
#include "crashsim.h"
#include "crashsim_index.h"
#include "fmt_testlib.h"
#include "rel_common.h"

#include "format/entry.h"
#include "index/chain.h"
#include "index/index.h"
#include "store/chunked.h"
#include "store/local.h"
#include "kvtier_sys.h"

#define C 16
#define NTOK 96

typedef struct store {
  kvt_index *idx;
  kvti_backend *be;
  kvti_chunked *ck;
} store;

static int sopen(store *s, const char *dir) {
  memset(s, 0, sizeof *s);
  kvti_local_cfg lc = {dir, 0700, 0600, 0, 0};
  kvti_chunkstore_opts o = {0600, 0700, 1};
  int rc = kvti_backend_local_open(&s->be, &lc);
  /* As the tier's open does first: a version the portable replace left
   * aside (<hash>.old.tmp, no atomic exchange) is put back in place. */
  uint64_t back = 0;
  if (rc == 0)
    rc = kvti_backend_local_recover(s->be, 1, &back);
  if (rc == 0 && (rc = kvti_index_open(&s->idx, dir, NULL, 0)) != 0)
    s->idx = NULL;
  /* As a tier with durability FSYNC: commits are synced (WAL included). */
  if (rc == 0)
    rc = kvti_index_set_durable(s->idx, 1);
  if (rc == 0 &&
      (rc = kvti_chunked_open(&s->ck, dir, s->idx, C, "sim", &o)) != 0)
    s->ck = NULL;
  return rc;
}
static void sclose(store *s) {
  kvti_chunked_close(s->ck);
  if (s->be)
    s->be->ops->destroy(s->be);
  kvt_index_close(s->idx);
}

/* The spill's two layers: T rows, offset n, spare rows marked by salt. */
static void make_layers(kvt_layer *l, const int32_t *tok, int n, int T,
                        int salt) {
  for (int L = 0; L < 2; L++)
    l[L] = t_kv_pattern(tok, n, T, L, (uint16_t)(0x7000 + salt));
}

typedef struct spec {
  int n, T, salt;
} spec;

static int32_t g_tok[NTOK];

/* The tier writer's steps for one spill: chunks, record/tail (put), row. */
static int do_spill(store *s, const spec *sp) {
  kvt_layer l[2];
  make_layers(l, g_tok, sp->n, sp->T, sp->salt);
  kvti_snapshot *snap = NULL;
  int rc = kvti_snapshot_create(&snap, g_tok, (size_t)sp->n, l, 2, 777, 1, NULL,
                                NULL);
  for (int i = 0; i < 2; i++)
    t_layer_free(&l[i]);
  if (rc)
    return rc;
  kvti_write_opts wo = {KVT_STORAGE_NATIVE, 1, 0600, 0700, 0};
  kvti_chunked_put_result res;
  rc = kvti_chunked_put(s->ck, s->be, &res, snap, &wo);
  if (rc == 0)
    rc = kvti_index_put(s->idx, g_tok, (size_t)sp->n, kvti_snapshot_hash(snap),
                        777, res.entry_bytes, KVT_STORAGE_NATIVE);
  kvti_snapshot_free(snap);
  return rc;
}

/* 1 when e holds exactly sp's layers. */
static int same(const kvt_entry *e, const spec *sp) {
  kvt_layer ref[2];
  make_layers(ref, g_tok, sp->n, sp->T, sp->salt);
  int ok = kvt_entry_num_layers(e) == 2;
  for (int L = 0; L < 2 && ok; L++)
    ok = t_layer_eq(kvt_entry_layer(e, (uint32_t)L), &ref[L]);
  for (int L = 0; L < 2; L++)
    t_layer_free(&ref[L]);
  return ok;
}

typedef struct chk {
  kvti_chunkstore *cs;
  int bad;
} chk;

static int check_chunk(void *ctx, const kvti_chain_rec *r) {
  chk *c = ctx;
  int fd;
  kvti_chunk_hdr h;
  if (kvti_chunkstore_open_chunk(c->cs, r, NULL, &fd, &h) != 0) {
    c->bad++;
    return 0;
  }
  void *d = malloc(h.data_bytes ? h.data_bytes : 1);
  if (kvti_chunk_read_data(fd, &h, d, "chunk") != 0)
    c->bad++;
  free(d);
  kvti_chunk_hdr_free(&h);
  close(fd);
  return 0;
}

static uint64_t g_states, g_new, g_old, g_missing;

/* Checks the state in dir; returns 1 on a violation. */
static int check_state(const char *dir, const spec *old, const spec *neu,
                       int acked, int before_chunks, int strict) {
  store s;
  if (sopen(&s, dir) != 0) {
    fprintf(stderr, "  reopen failed: %s\n", kvt_last_error());
    sclose(&s);
    return 1;
  }
  g_states++;
  int viol = 0;
  chk c = {kvti_chunked_store(s.ck), 0};
  kvti_chains_foreach(kvti_chunkstore_chains(c.cs), check_chunk, &c);
  if (c.bad) {
    fprintf(stderr, "  %d indexed chunks missing or partial\n", c.bad);
    viol = 1;
  }
  /* Every ancestor is indexed: the chain over the prompt is found from its
   * first chunk on, at least as long as before the spill. */
  kvti_chain_rec out[NTOK / C];
  size_t m = 0;
  uint8_t *ns = NULL;
  size_t nsl = 0;
  kvti_chunk_ns_encode(&ns, &nsl, "sim", NULL);
  kvti_chunkstore_lookup(c.cs, ns, nsl, g_tok, NTOK, C, out, NTOK / C, &m);
  kvti_free(ns);
  kvti_chains_totals tot;
  kvti_chains_totals_get(kvti_chunkstore_chains(c.cs), &tot);
  if (strict && (m < (size_t)before_chunks || tot.chunks != m)) {
    fprintf(stderr, "  chain of %zu chunks found, %llu indexed, %d before\n", m,
            (unsigned long long)tot.chunks, before_chunks);
    viol = 1;
  }
  char h[65];
  kvt_token_hash(h, g_tok, (size_t)neu->n);
  kvt_entry_info info;
  int has_row = kvti_index_find_hash(&info, s.idx, h) == 0;
  kvt_entry *e = NULL;
  kvti_read_opts ro = {0};
  int rc = kvti_chunked_get(s.ck, s.be, &e, h, &ro, NULL, NULL);
  int is_new = rc == 0 && same(e, neu), is_old = rc == 0 && old && same(e, old);
  kvt_entry_free(e);
  if (rc == 0 && !is_new && !is_old) {
    fprintf(stderr, "  wrong data served\n");
    viol = 1;
  } else if (rc != 0 && rc != KVT_ENOTFOUND && (strict || rc != KVT_ECORRUPT)) {
    fprintf(stderr, "  read %d (%s)\n", rc, kvt_last_error());
    viol = 1;
  } else if (strict && has_row && rc != 0 && !old) {
    fprintf(stderr, "  row without its entry: %s\n", kvt_last_error());
    viol = 1;
  } else if (strict && old && rc != 0) {
    fprintf(stderr, "  the acknowledged old version is lost: %s\n",
            kvt_last_error());
    viol = 1;
  } else if (strict && acked && (!has_row || !is_new)) {
    fprintf(stderr, "  acknowledged spill lost (row %d, read %d)\n", has_row,
            rc);
    viol = 1;
  }
  g_new += is_new;
  g_old += is_old;
  g_missing += rc == KVT_ENOTFOUND;
  sclose(&s);
  return viol;
}

/* Base: a chain of `before` chunks of the prompt (and old, when given,
 * spilled as the entry's previous version); then neu is recorded and every
 * crash state checked. Returns violations. */
static uint64_t campaign(const spec *old, const spec *neu, int before,
                         int fates, uint64_t seed, int strict, int quiet) {
  kvt_test_rmtree(g_base);
  REQUIRE(mkdir(g_base, 0700) == 0);
  store s;
  REQUIRE(sopen(&s, g_base) == 0);
  spec pre = {before * C, before * C, 1};
  REQUIRE(do_spill(&s, &pre) == 0);
  if (old)
    REQUIRE(do_spill(&s, old) == 0);
  sclose(&s);
  kvt_test_rmtree(g_live);
  r_copy_tree(g_base, g_live);
  log_clear();
  cs_index_install(); /* index.db: copies at its WAL fsyncs */
  /* Opened under the recorder, so the index's WAL fsyncs are seen. */
  rec_install();
  REQUIRE(sopen(&s, g_live) == 0);
  int rc = do_spill(&s, neu);
  /* Recorded up to the acknowledgement; the checkpoint SQLite runs at close
   * is its own protocol (the WAL frames are already synced). */
  kvti_io_set(NULL);
  sclose(&s);
  REQUIRE(rc == 0);
  /* Without a crash the new version is there. */
  CHECK_EQ_INT(check_state(g_live, old, neu, 1, before, strict), 0);
  uint64_t viol = 0;
  kvt_rng rng = {seed};
  size_t n = g_nlog;
  for (size_t K = 0; K <= n; K++)
    for (int f = 0; f < fates; f++) {
      replay(K, &rng);
      cs_index_restore(K, &rng);
      int v = check_state(g_replay, old, neu, K == n, before, strict);
      if (v && !quiet && viol < 5)
        fprintf(stderr, "  ^ crash after op %zu/%zu (fate %d)\n", K, n, f);
      viol += (uint64_t)v;
    }
  return viol;
}

static int g_fates;

static void test_spills(void) {
  /* A chain record: 96 tokens, 6 chunks, no tail rows (3 chunks stored
   * before). */
  spec rec = {NTOK, NTOK, 2};
  CHECK_EQ_INT(campaign(NULL, &rec, 3, g_fates, 11, 1, 0), 0);
  /* A tail entry: 90 tokens, 5 chunks + 10 tail rows + 6 spare rows. */
  spec tail = {90, NTOK, 3};
  CHECK_EQ_INT(campaign(NULL, &tail, 3, g_fates, 12, 1, 0), 0);
  /* Replacements of the same tokens: a record over a tail version and a
   * tail over a record version (exchanged atomically). */
  spec old_tail = {NTOK, NTOK + 16, 4}, old_rec = {NTOK, NTOK, 5};
  spec new_tail = {NTOK, NTOK + 8, 6};
  CHECK_EQ_INT(campaign(&old_tail, &rec, 3, g_fates, 13, 1, 0), 0);
  CHECK_EQ_INT(campaign(&old_rec, &new_tail, 3, g_fates, 14, 1, 0), 0);
  fprintf(stderr,
          "chunk crash states: %llu checked, %llu new, %llu old, %llu missing "
          "(chain or entry not yet durable)\n",
          (unsigned long long)g_states, (unsigned long long)g_new,
          (unsigned long long)g_old, (unsigned long long)g_missing);
}

/* The simulator must catch a wrong order: file fsyncs skipped, success
 * claimed. */
static void test_catches_bad_order(void) {
  spec rec = {NTOK, NTOK, 7};
  g_fsync_files = 0;
  uint64_t v = campaign(NULL, &rec, 3, g_fates, 21, 1, 1);
  g_fsync_files = 1;
  fprintf(stderr, "bad order: %llu crash states violate the guarantees\n",
          (unsigned long long)v);
  CHECK(v > 0);
}

int main(void) {
  r_use_fast_tmp();
  char *root = kvt_test_tmpdir("crashsim-chunks");
  snprintf(g_base, sizeof g_base, "%s/base", root);
  snprintf(g_live, sizeof g_live, "%s/live", root);
  snprintf(g_replay, sizeof g_replay, "%s/replay", root);
  g_fates = (int)r_env_long("KVT_CRASHSIM_FATES", 6);
  for (int i = 0; i < NTOK; i++)
    g_tok[i] = 3000 + i * 7;
  RUN(test_spills);
  RUN(test_catches_bad_order);
  crashsim_free();
  char snaps[4200];
  snprintf(snaps, sizeof snaps, "%s.snap", g_base);
  kvt_test_rmtree(snaps);
  return kvt_test_done();
}
