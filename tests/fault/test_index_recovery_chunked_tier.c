/*
 * test_index_recovery_chunked_tier.c - the index is never the only copy, in
 * the chunked store too (issues 13 and 18). With the default chunk_tokens
 * (256) an entry of >= 256 tokens is a chain of chunk files plus a tail
 * entry in data/ that alone is NOT the state of its tokens. Before the tails
 * carried their chain in their own manifest, deleting index.db made reconcile
 * adopt a tail as a whole entry: a 300-token prompt was served 44 KV rows with
 * offset 300 - a wrong state. Here, with index.db deleted or garbage, the
 * next open rebuilds the chain table from the chunk files and the records
 * from the tails, and serves every entry bit-exact, plus the chunk-aligned
 * prefixes no spill ended at; a tier opened with chunk_tokens = 0 refuses the
 * tails (never serves them) and deletes nothing; a chain cut by a lost chunk
 * file serves only what is still whole, never a tail; a hybrid spill's chain
 * (KV chunks, arrays in the tail) is rebuilt not pure, so no prefix is served
 * from its chunks alone.
 */
#include "rel_tier.h"

#include "format/chunk.h"
#include "kvtier_sys.h"

#include <dirent.h>
#include <sys/stat.h>

#define N_ENT 4
#define N_BASE 600

static char g_root[4096];

typedef struct fixture {
  char *dir;
  t_entry base;     /* 600 tokens, 600 rows: the conversation */
  t_entry e[N_ENT]; /* prefixes of base (300, 520, 600) + one short entry */
  int chained[N_ENT];
} fixture;

/* The first n tokens and rows of b (the same KV: one conversation). */
static t_entry prefix_of(const t_entry *b, size_t n) {
  t_entry e = t_make(1, n, b->n_layers, (int)n, 4);
  memcpy(e.tokens, b->tokens, n * sizeof(int32_t));
  t_copy_rows(&e, b, n);
  kvt_token_hash(e.hash, e.tokens, e.n_tokens);
  return e;
}

static kvt_options opts_of(const char *dir, uint32_t chunk_tokens) {
  kvt_options o = rel_opts(dir, KVT_DURABILITY_NONE);
  o.chunk_tokens = chunk_tokens;
  o.host_cache_bytes = 0; /* every promote reads the files */
  return o;
}

static void fx_init(fixture *f, const char *name) {
  memset(f, 0, sizeof *f);
  f->dir = rel_path(g_root, name, NULL);
  f->base = t_make(77, N_BASE, 2, N_BASE, 4);
  static const size_t lens[3] = {300, 520, 600};
  for (int i = 0; i < 3; i++) {
    f->e[i] = prefix_of(&f->base, lens[i]);
    f->chained[i] = 1;
  }
  f->e[3] = t_make(78, 20, 2, 20, 4); /* shorter than a chunk: whole */
  kvt_options o = opts_of(f->dir, KVT_CHUNK_TOKENS_DEFAULT);
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  for (int i = 0; i < N_ENT; i++)
    REQUIRE(t_spill(t, &f->e[i]) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  REQUIRE(kvt_tier_close(t, -1) == 0);
  kvt_tier_free(t);
  char *cd = rel_path(f->dir, "chunks", NULL);
  REQUIRE(kvt_test_exists(cd)); /* the chunked store is in use */
  free(cd);
}

static void fx_free(fixture *f) {
  for (int i = 0; i < N_ENT; i++)
    t_free(&f->e[i]);
  t_free(&f->base);
  free(f->dir);
}

/* 1: served bit-exact; 0: refused (any error); -1: served WRONG data. */
static int serve(kvt_tier *t, const t_entry *e) {
  kvt_entry *got = NULL;
  int rc = kvt_tier_promote(&got, t, e->tokens, e->n_tokens, NULL);
  int r = rc != 0 ? 0 : t_same(got, e) ? 1 : -1;
  kvt_entry_free(got);
  return r;
}

/* Every entry served, and a prefix no spill ended at (512 of base's tokens
 * + other tokens) found chunk-aligned and served bit-exact. */
static void check_all(kvt_tier *t, const fixture *f) {
  for (int i = 0; i < N_ENT; i++) {
    int s = serve(t, &f->e[i]);
    if (s != 1)
      fprintf(stderr, "  entry %d: %d (%s)\n", i, s, kvt_last_error());
    CHECK_EQ_INT(s, 1);
  }
  int32_t q[560];
  memcpy(q, f->base.tokens, 512 * sizeof(int32_t));
  for (int i = 512; i < 560; i++)
    q[i] = 60000 + i; /* never spilled */
  kvt_entry_info info;
  REQUIRE(kvt_tier_lookup_prefix(&info, t, q, 560) == 0);
  CHECK_EQ_INT(info.num_tokens, 512); /* 2 chunks: longer than the 300 entry */
  /* As the scheduler reads it: _read_entry(prompt[:m], file_path). */
  t_entry p512 = prefix_of(&f->base, 512);
  kvt_entry *got = NULL;
  CHECK_EQ_INT(kvt_tier_read_entry(&got, t, q, 512, info.token_hash), 0);
  CHECK(got && t_same(got, &p512));
  kvt_entry_free(got);
  t_free(&p512);
}

static void test_index_deleted(void) {
  fixture f;
  fx_init(&f, "deleted");
  rel_rm_index(f.dir);
  kvt_options o = opts_of(f.dir, KVT_CHUNK_TOKENS_DEFAULT);
  kvt_tier *t = t_open(&o);
  check_all(t, &f);
  kvt_tier_free(t);
  fx_free(&f);
}

static void test_index_garbage(void) {
  fixture f;
  fx_init(&f, "garbage");
  rel_rm_index(f.dir);
  char *p = rel_path(f.dir, "index.db", NULL);
  FILE *fp = fopen(p, "wb");
  REQUIRE(fp);
  for (int i = 0; i < 4096; i++)
    fputc((i * 131) & 0xff, fp);
  fclose(fp);
  free(p);
  kvt_options o = opts_of(f.dir, KVT_CHUNK_TOKENS_DEFAULT);
  kvt_tier *t = t_open(&o);
  check_all(t, &f);
  kvt_tier_free(t);
  fx_free(&f);
}

/* chunk_tokens = 0 over a chunked directory: tails are refused, the whole
 * entry is served, nothing is deleted or quarantined (a chunked open serves
 * everything again) - with the index intact and without it. */
static void test_unchunked_open_refuses_tails(void) {
  fixture f;
  fx_init(&f, "unchunked");
  for (int pass = 0; pass < 2; pass++) {
    if (pass == 1)
      rel_rm_index(f.dir);
    kvt_options o = opts_of(f.dir, 0);
    kvt_tier *t = t_open(&o);
    for (int i = 0; i < N_ENT; i++)
      CHECK_EQ_INT(serve(t, &f.e[i]), f.chained[i] ? 0 : 1);
    CHECK_EQ_INT(rel_stats(t).quarantined, 0);
    kvt_tier_free(t);
    o = opts_of(f.dir, KVT_CHUNK_TOKENS_DEFAULT);
    t = t_open(&o);
    check_all(t, &f);
    kvt_tier_free(t);
  }
  fx_free(&f);
}

/* Index lost AND the chunk of rows [256, 512) lost: the 300-token entry
 * (chunk 0 + tail) is still whole; the 520- and 600-token entries need the
 * lost chunk and are never served (no tail passed off as an entry). */
static void test_cut_chain(void) {
  fixture f;
  fx_init(&f, "cut");
  rel_rm_index(f.dir);
  char *cd = rel_path(f.dir, "chunks", NULL);
  DIR *d = opendir(cd);
  REQUIRE(d);
  int removed = 0;
  struct dirent *de;
  while ((de = readdir(d))) {
    if (de->d_name[0] == '.')
      continue;
    char *sub = rel_path(cd, de->d_name, NULL);
    DIR *sd = opendir(sub);
    struct dirent *fe;
    while (sd && (fe = readdir(sd))) {
      if (fe->d_name[0] == '.')
        continue;
      char *p = rel_path(sub, fe->d_name, NULL);
      int fd = -1;
      kvti_chunk_hdr h;
      memset(&h, 0, sizeof h);
      if (kvti_chunk_open(&fd, &h, p, NULL, 0) == 0) {
        int one = h.index == 1;
        kvti_chunk_hdr_free(&h);
        close(fd);
        if (one && unlink(p) == 0)
          removed++;
      }
      free(p);
    }
    if (sd)
      closedir(sd);
    free(sub);
  }
  closedir(d);
  free(cd);
  CHECK_EQ_INT(removed, 1); /* one chunk covers rows [256, 512) */
  kvt_options o = opts_of(f.dir, KVT_CHUNK_TOKENS_DEFAULT);
  kvt_tier *t = t_open(&o);
  CHECK_EQ_INT(serve(t, &f.e[0]), 1);
  CHECK_EQ_INT(serve(t, &f.e[1]), 0);
  CHECK_EQ_INT(serve(t, &f.e[2]), 0);
  CHECK_EQ_INT(serve(t, &f.e[3]), 1);
  kvt_tier_free(t);
  fx_free(&f);
}

/* A hybrid spill (KV layers + an arrays state, as Mamba/hybrid models) keeps
 * its KV in chunks, but a chunk-aligned prefix of it is no state of those
 * tokens (the arrays are the whole prompt's): its chain is not pure, and a
 * prefix query must never be answered from its chunks alone - the entry
 * itself (its end) still is. The chain table rebuilt from the chunk files
 * after index.db is lost must say the same: were its rows all marked pure, a
 * prefix query would be answered with a 32-token hit that then cannot be
 * read. */
static void test_hybrid_chain_rebuilt_not_pure(void) {
  char *dir = rel_path(g_root, "hybrid", NULL);
  enum { C = 16, N = 64 };
  t_entry e = t_make(91, N, 2, N, 4);
  kvt_layer layers[3];
  memcpy(layers, e.layers, 2 * sizeof *layers);
  static float state[8];
  for (int i = 0; i < 8; i++)
    state[i] = (float)i + 0.5f;
  kvt_tensor st = {0};
  st.dtype = KVT_DTYPE_F32;
  st.ndim = 2;
  st.shape[0] = 2;
  st.shape[1] = 4;
  st.nbytes = sizeof state;
  st.data = state;
  kvt_layer_init(&layers[2], KVT_LAYER_ARRAYS);
  layers[2].num_tensors = 1;
  layers[2].tensors = &st;
  int32_t q[N];
  memcpy(q, e.tokens, 2 * C * sizeof(int32_t));
  for (int i = 2 * C; i < N; i++)
    q[i] = 70000 + i; /* shares two chunks with the entry, then differs */
  for (int pass = 0; pass < 2; pass++) {
    kvt_options o = opts_of(dir, C);
    kvt_tier *t = t_open(&o);
    if (pass == 0) {
      REQUIRE(kvt_tier_start_writer(t) == 0);
      REQUIRE(kvt_tier_spill(t, e.tokens, N, layers, 3, e.memory_bytes) == 0);
      REQUIRE(kvt_tier_flush(t, -1) == 0);
    }
    kvt_chunk_info *ch = NULL;
    size_t n = 0;
    CHECK_EQ_INT(kvt_tier_entry_chain(&ch, &n, NULL, t, e.hash, 0), 0);
    CHECK_EQ_INT((int)n, N / C);
    for (size_t i = 0; i < n; i++)
      CHECK(!ch[i].pure);
    kvt_free(ch);
    kvt_entry_info info;
    int rc = kvt_tier_lookup_prefix(&info, t, q, N);
    if (rc == 0)
      fprintf(stderr, "  pass %d: prefix hit of %llu tokens\n", pass,
              (unsigned long long)info.num_tokens);
    CHECK_EQ_INT(rc, KVT_ENOTFOUND);
    /* The entry itself is whole and served, arrays included. */
    kvt_entry *got = NULL;
    CHECK_EQ_INT(kvt_tier_promote(&got, t, e.tokens, N, NULL), 0);
    CHECK(got && kvt_entry_num_layers(got) == 3);
    if (got) {
      const kvt_layer *a = kvt_entry_layer(got, 2);
      CHECK(a && a->kind == KVT_LAYER_ARRAYS && a->num_tensors == 1 &&
            memcmp(a->tensors[0].data, state, sizeof state) == 0);
    }
    kvt_entry_free(got);
    REQUIRE(kvt_tier_close(t, -1) == 0);
    kvt_tier_free(t);
    if (pass == 0)
      rel_rm_index(dir); /* the next open rebuilds the chain table */
  }
  t_free(&e);
  free(dir);
}

/* The index rebuilt by a tier of another chunk_tokens (`kvtier reindex`
 * opens with the default whatever the server used): every tail is adopted
 * with its chain (read by parent links, whatever C), nothing is quarantined
 * or deleted, and the server's own chunk size serves everything after. */
static void test_reindex_other_chunk_size(void) {
  fixture f;
  fx_init(&f, "otherc");
  rel_rm_index(f.dir);
  kvt_options o = opts_of(f.dir, 16);
  kvt_tier *t = t_open(&o);
  for (int i = 0; i < N_ENT; i++)
    CHECK_EQ_INT(serve(t, &f.e[i]), 1);
  CHECK_EQ_INT(rel_stats(t).quarantined, 0);
  kvt_tier_free(t);
  char *q = rel_path(f.dir, "quarantine", NULL);
  CHECK(!kvt_test_exists(q));
  free(q);
  o = opts_of(f.dir, KVT_CHUNK_TOKENS_DEFAULT);
  t = t_open(&o);
  check_all(t, &f);
  kvt_tier_free(t);
  fx_free(&f);
}

int main(void) {
  r_use_fast_tmp();
  snprintf(g_root, sizeof g_root, "%s", kvt_test_tmpdir("reidx-chunked"));
  RUN(test_index_deleted);
  RUN(test_index_garbage);
  RUN(test_unchunked_open_refuses_tails);
  RUN(test_cut_chain);
  RUN(test_hybrid_chain_rebuilt_not_pure);
  RUN(test_reindex_other_chunk_size);
  return kvt_test_done();
}
