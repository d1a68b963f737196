/*
 * test_chunkstore.c - the chunk store and its chain table
 * (src/store/chunkstore.c, src/index/chain.c): a spill becomes a chain of full
 * chunks under chunks/<kk>/; spilling it again writes nothing; an extension
 * writes only the new chunks; a prompt sharing a prefix finds the longest
 * chunk-aligned chain even where no spill ended; namespaces, salts and layouts
 * never share or see each other's chunks; rows and lookups survive a reopen
 * (read-only too); offsets shorter than the tokens limit the chain (never
 * misalign); a chunk's tokens are compared before it is read; removal takes the
 * subtree (rows and files); LRU picks leaves and touches refresh the whole
 * path; a row whose parent vanished is dropped at open; chunk writes, adoptions
 * and byte reads never go through a link below the cache directory; rows record
 * their chunks' dense size (rows of an earlier build, the packed size, are
 * still served).
 */
#include "fmt_testlib.h"
#include "base/clock.h"
#include "base/hash.h"
#include "base/io.h"
#include "index/chain.h"
#include "format/layer.h"
#include "index/index.h"
#include "store/chunkstore.h"
#include "kvtier_sys.h"

#include <fcntl.h>
#include <sqlite3.h>
#include <sys/stat.h>
#include <unistd.h>
#include <time.h>

#define C 16
#define NTOK 200

static char *g_dir;
static int32_t g_tok[NTOK];

typedef struct spill {
  kvt_layer l[2];
  uint32_t ids[2];
} spill;

static void make(spill *s, kvt_rng *r, kvt_dtype dt, int T) {
  s->l[0] = t_kv(r, dt, 1, 2, T, 8, T);
  s->l[1] = t_quant(r, 4, 32, KVT_DTYPE_F16, 1, 2, T, 64, T);
  s->ids[0] = 0;
  s->ids[1] = 1;
}
static void unmake(spill *s) {
  t_layer_free(&s->l[0]);
  t_layer_free(&s->l[1]);
}

typedef struct store {
  char *dir;
  kvt_index *idx;
  kvti_chunkstore *cs;
} store;

static void sopen(store *st, const char *dir, int ro) {
  st->dir = (char *)dir;
  REQUIRE(kvti_index_open(&st->idx, dir, NULL, ro) == 0);
  kvti_chunkstore_opts o = {0600, 0700, 1};
  REQUIRE(kvti_chunkstore_open(&st->cs, dir, st->idx, &o) == 0);
}
static void sclose(store *st) {
  kvti_chunkstore_close(st->cs);
  kvt_index_close(st->idx);
}

static kvti_chunkstore_spill sp_of(const spill *s, const uint8_t *ns,
                                   size_t nsl, size_t n) {
  kvti_chunkstore_spill sp = {ns, nsl, g_tok, n, C, s->l, s->ids, 2, 2};
  return sp;
}

static int count_chunk_files(const char *dir) {
  char *cd = t_join(dir, "chunks");
  int total = 0;
  for (int a = 0; a < 256; a++) {
    char sub[64];
    snprintf(sub, sizeof sub, "%02x", a);
    char *p = t_join(cd, sub);
    int k = kvt_test_count_dir(p, ".kvc");
    total += k > 0 ? k : 0;
    free(p);
  }
  free(cd);
  return total;
}

static void test_put_dedup_lookup(void) {
  char *dir = t_join(g_dir, "a");
  mkdir(dir, 0700);
  store st;
  sopen(&st, dir, 0);
  kvt_rng r = {1};
  spill s;
  make(&s, &r, KVT_DTYPE_F16, NTOK);
  uint8_t *ns;
  size_t nsl;
  REQUIRE(kvti_chunk_ns_encode(&ns, &nsl, "model", NULL) == 0);
  kvti_chunkstore_result res;
  kvti_chunkstore_spill sp = sp_of(&s, ns, nsl, 100); /* 6 full chunks */
  REQUIRE(kvti_chunkstore_put(st.cs, &sp, &res) == 0);
  CHECK_EQ_INT(res.chunks, 6);
  CHECK_EQ_INT(res.written, 6);
  CHECK(res.bytes_written > 0);
  CHECK_EQ_INT(count_chunk_files(dir), 6);
  /* Again: nothing written. */
  REQUIRE(kvti_chunkstore_put(st.cs, &sp, &res) == 0);
  CHECK_EQ_INT(res.chunks, 6);
  CHECK_EQ_INT(res.written, 0);
  CHECK_EQ_INT(res.bytes_written, 0);
  /* An extension to 190 tokens: chunks 6..10 only. */
  sp.n = 190;
  REQUIRE(kvti_chunkstore_put(st.cs, &sp, &res) == 0);
  CHECK_EQ_INT(res.chunks, 11);
  CHECK_EQ_INT(res.written, 5);
  CHECK_EQ_INT(count_chunk_files(dir), 11);
  kvti_chains_totals t;
  kvti_chains_totals_get(kvti_chunkstore_chains(st.cs), &t);
  CHECK_EQ_INT(t.chunks, 11);
  CHECK_EQ_INT(t.leaves, 1);
  /* A prompt = the first 70 tokens + something else: 4 chunks found, though
   * no spill ended at 64. */
  int32_t q[120];
  memcpy(q, g_tok, 70 * 4);
  for (int i = 70; i < 120; i++)
    q[i] = -i;
  kvti_chain_rec out[16];
  size_t m;
  CHECK(kvti_chunkstore_lookup(st.cs, ns, nsl, q, 120, C, out, 16, &m) == 0);
  CHECK_EQ_INT(m, 4);
  for (size_t i = 0; i < m; i++) {
    CHECK_EQ_INT(out[i].index, i);
    CHECK(out[i].pure); /* every layer of the spill is chunked */
  }
  CHECK(memcmp(out[1].parent, out[0].key, 32) == 0);
  /* max bounds the answer; too few tokens: nothing. */
  CHECK(kvti_chunkstore_lookup(st.cs, ns, nsl, q, 120, C, out, 2, &m) == 0);
  CHECK_EQ_INT(m, 2);
  CHECK(kvti_chunkstore_lookup(st.cs, ns, nsl, q, 15, C, out, 16, &m) == 0);
  CHECK_EQ_INT(m, 0);
  /* Another chunk size finds nothing. */
  CHECK(kvti_chunkstore_lookup(st.cs, ns, nsl, q, 120, 32, out, 16, &m) == 0);
  CHECK_EQ_INT(m, 0);
  CHECK(kvti_chunkstore_lookup(st.cs, ns, nsl, q, 120, 17, out, 16, &m) ==
        KVT_EINVAL);
  /* Another salt sees nothing. */
  uint8_t *ns2;
  size_t nsl2;
  REQUIRE(kvti_chunk_ns_encode(&ns2, &nsl2, "model", "tenant-b") == 0);
  CHECK(kvti_chunkstore_lookup(st.cs, ns2, nsl2, q, 120, C, out, 16, &m) == 0);
  CHECK_EQ_INT(m, 0);
  /* Read chunk 2 back: header checks, tokens compared, data = rows 32..47. */
  CHECK(kvti_chunkstore_lookup(st.cs, ns, nsl, g_tok, 190, C, out, 16, &m) ==
        0);
  CHECK_EQ_INT(m, 11);
  int fd;
  kvti_chunk_hdr h;
  REQUIRE(kvti_chunkstore_open_chunk(st.cs, &out[2], g_tok + 32, &fd, &h) == 0);
  uint8_t *data = malloc(h.data_bytes);
  CHECK(kvti_chunk_read_data(fd, &h, data, "c2") == 0);
  /* keys of layer 0: [1, 2, 16, 8] f16, head 1 starts at 16*8*2 bytes */
  const uint8_t *src = s.l[0].tensors[0].data;
  CHECK(memcmp(data, src + 32 * 16, 16 * 16) == 0);
  CHECK(memcmp(data + 16 * 16, src + (NTOK + 32) * 16, 16 * 16) == 0);
  free(data);
  kvti_chunk_hdr_free(&h);
  close(fd);
  /* Tokens that differ from the chunk's (a lookup-hash collision) are never
   * served. */
  CHECK(kvti_chunkstore_open_chunk(st.cs, &out[2], g_tok + 33, &fd, &h) ==
        KVT_ECORRUPT);
  /* A 4-bit spill of the same tokens in bf16 is another chain. */
  spill s2;
  make(&s2, &r, KVT_DTYPE_BF16, NTOK);
  kvti_chunkstore_spill sp2 = sp_of(&s2, ns, nsl, 40);
  REQUIRE(kvti_chunkstore_put(st.cs, &sp2, &res) == 0);
  CHECK_EQ_INT(res.written, 2);
  CHECK(kvti_chunkstore_lookup(st.cs, ns, nsl, g_tok, 190, C, out, 16, &m) ==
        0);
  CHECK_EQ_INT(m, 11); /* the longest chain wins */
  uint64_t lay_f16 = out[0].layout_hash;
  CHECK(kvti_chunkstore_lookup(st.cs, ns, nsl, g_tok, 40, C, out, 16, &m) == 0);
  CHECK_EQ_INT(m, 2);
  /* Every chunk of a chain has the chain's layout. */
  for (size_t i = 1; i < m; i++)
    CHECK(out[i].layout_hash == out[0].layout_hash);
  (void)lay_f16;
  unmake(&s2);
  sclose(&st);
  /* Reopen: the chains are there (no listing of chunks/ needed); read-only
   * too. */
  sopen(&st, dir, 0);
  CHECK(kvti_chunkstore_lookup(st.cs, ns, nsl, g_tok, 190, C, out, 16, &m) ==
        0);
  CHECK_EQ_INT(m, 11);
  sclose(&st);
  sopen(&st, dir, 1);
  CHECK(kvti_chunkstore_lookup(st.cs, ns, nsl, q, 120, C, out, 16, &m) == 0);
  CHECK_EQ_INT(m, 4);
  CHECK(kvti_chunkstore_put(st.cs, &sp, &res) == KVT_EPERM);
  sclose(&st);
  kvti_free(ns);
  kvti_free(ns2);
  unmake(&s);
  free(dir);
}

static void test_offsets_limit(void) {
  char *dir = t_join(g_dir, "b");
  mkdir(dir, 0700);
  store st;
  sopen(&st, dir, 0);
  kvt_rng r = {2};
  spill s;
  make(&s, &r, KVT_DTYPE_F16, 64);
  uint8_t *ns;
  size_t nsl;
  REQUIRE(kvti_chunk_ns_encode(&ns, &nsl, "m", NULL) == 0);
  /* 100 tokens but the layers hold 64 rows: 4 chunks, rows stay aligned. */
  kvti_chunkstore_spill sp = sp_of(&s, ns, nsl, 100);
  kvti_chunkstore_result res;
  REQUIRE(kvti_chunkstore_put(st.cs, &sp, &res) == 0);
  CHECK_EQ_INT(res.chunks, 4);
  /* One layer's offset is 40: only 2 chunks are valid everywhere. */
  s.l[1].offset = 40;
  sp.n = 64;
  uint8_t *ns2;
  size_t nsl2;
  REQUIRE(kvti_chunk_ns_encode(&ns2, &nsl2, "m2", NULL) == 0);
  sp.ns = ns2;
  sp.ns_len = nsl2;
  REQUIRE(kvti_chunkstore_put(st.cs, &sp, &res) == 0);
  CHECK_EQ_INT(res.chunks, 2);
  kvti_chain_rec o2[4];
  size_t m2;
  CHECK(kvti_chunkstore_lookup(st.cs, ns2, nsl2, g_tok, 64, C, o2, 4, &m2) ==
        0);
  CHECK_EQ_INT(m2, 2);
  /* A spill with a third, unchunked layer (arrays state) is not pure, and is
   * another chain. */
  sp.spill_layers = 3;
  REQUIRE(kvti_chunkstore_put(st.cs, &sp, &res) == 0);
  CHECK_EQ_INT(res.written, 2);
  CHECK(kvti_chunkstore_lookup(st.cs, ns2, nsl2, g_tok, 64, C, o2, 4, &m2) ==
        0);
  CHECK_EQ_INT(m2, 2);
  CHECK(o2[0].layout_hash == res.layout_hash && !o2[0].pure);
  /* Fewer tokens than a chunk: nothing. */
  sp.n = 15;
  REQUIRE(kvti_chunkstore_put(st.cs, &sp, &res) == 0);
  CHECK_EQ_INT(res.chunks, 0);
  sp.chunk_tokens = 24;
  CHECK(kvti_chunkstore_put(st.cs, &sp, &res) == KVT_EINVAL);
  sclose(&st);
  kvti_free(ns);
  kvti_free(ns2);
  unmake(&s);
  free(dir);
}

static void test_remove_lru(void) {
  char *dir = t_join(g_dir, "c");
  mkdir(dir, 0700);
  store st;
  sopen(&st, dir, 0);
  kvt_rng r = {3};
  spill s;
  make(&s, &r, KVT_DTYPE_F16, NTOK);
  uint8_t *ns;
  size_t nsl;
  REQUIRE(kvti_chunk_ns_encode(&ns, &nsl, "m", NULL) == 0);
  /* Two branches: tokens A = g_tok[0..96), B = g_tok[0..48) + other. */
  kvti_chunkstore_spill sp = sp_of(&s, ns, nsl, 96);
  kvti_chunkstore_result res;
  REQUIRE(kvti_chunkstore_put(st.cs, &sp, &res) == 0);
  int32_t other[96];
  memcpy(other, g_tok, 48 * 4);
  for (int i = 48; i < 96; i++)
    other[i] = 7000 + i;
  sp.tokens = other;
  REQUIRE(kvti_chunkstore_put(st.cs, &sp, &res) == 0);
  CHECK_EQ_INT(res.written, 3);
  kvti_chains *ch = kvti_chunkstore_chains(st.cs);
  kvti_chains_totals t;
  kvti_chains_totals_get(ch, &t);
  CHECK_EQ_INT(t.chunks, 9);
  CHECK_EQ_INT(t.leaves, 2);
  /* Touch branch A's leaf: B's leaf becomes the LRU leaf, and A's shared
   * ancestors are refreshed too. */
  kvti_chain_rec out[8], leaf;
  size_t m;
  REQUIRE(kvti_chunkstore_lookup(st.cs, ns, nsl, g_tok, 96, C, out, 8, &m) ==
          0);
  CHECK_EQ_INT(m, 6);
  struct timespec ts = {0, 20 * 1000 * 1000};
  nanosleep(&ts, NULL);
  CHECK(kvti_chains_touch(ch, out[5].key) == 0);
  REQUIRE(kvti_chains_lru_leaf(ch, &leaf));
  CHECK(leaf.index == 5 && memcmp(leaf.key, out[5].key, 32) != 0);
  kvti_chain_rec a0;
  CHECK(kvti_chains_find(ch, out[0].key, &a0));
  CHECK(a0.accessed_at > leaf.accessed_at);
  /* By value: A's spill was of a class worth little, B's of one worth
   * more. Over every leaf's span A's (newer) leaf goes first; over none,
   * the LRU leaf (B's); without classes, by age too. */
  double val[KVTI_LEN_CLASSES + 1];
  for (int i = 0; i <= KVTI_LEN_CLASSES; i++)
    val[i] = 0.5;
  kvti_chain_rec vl;
  double lru_at = -1;
  REQUIRE(kvti_chains_value_leaf(ch, val, 1.0, &vl, &lru_at));
  CHECK(memcmp(vl.key, leaf.key, 32) == 0 && lru_at == leaf.accessed_at);
  CHECK(kvti_chains_set_class(ch, out[5].key, 3) == 0);
  CHECK(kvti_chains_set_class(ch, leaf.key, 5) == 0);
  val[3] = 0.1;
  val[5] = 1.0;
  REQUIRE(kvti_chains_value_leaf(ch, val, 1.0, &vl, &lru_at));
  CHECK(memcmp(vl.key, out[5].key, 32) == 0);
  CHECK(lru_at == leaf.accessed_at);
  REQUIRE(kvti_chains_value_leaf(ch, val, 0.0, &vl, &lru_at));
  CHECK(memcmp(vl.key, leaf.key, 32) == 0);
  val[3] = 2.0; /* now A's is worth more: B's goes first */
  REQUIRE(kvti_chains_value_leaf(ch, val, 1.0, &vl, &lru_at));
  CHECK(memcmp(vl.key, leaf.key, 32) == 0);
  /* The shared chunks took A's class (its spill made them): B's set_class
   * stopped there, so they are never reclassed by a later spill. */
  uint8_t unknown[32] = {0};
  CHECK(kvti_chains_set_class(ch, unknown, 1) == KVT_ENOTFOUND);
  /* Removing chunk 3 of A takes 3, 4, 5 of A (rows and files) only. */
  size_t nrem;
  uint64_t brem;
  CHECK(kvti_chunkstore_remove(st.cs, out[3].key, &nrem, &brem) == 0);
  CHECK_EQ_INT(nrem, 3);
  CHECK(brem > 0);
  CHECK_EQ_INT(count_chunk_files(dir), 6);
  CHECK(kvti_chunkstore_lookup(st.cs, ns, nsl, g_tok, 96, C, out, 8, &m) == 0);
  CHECK_EQ_INT(m, 3);
  CHECK(kvti_chunkstore_lookup(st.cs, ns, nsl, other, 96, C, out, 8, &m) == 0);
  CHECK_EQ_INT(m, 6);
  /* Removing the shared root takes everything. */
  CHECK(kvti_chunkstore_remove(st.cs, out[0].key, &nrem, NULL) == 0);
  CHECK_EQ_INT(nrem, 6);
  CHECK_EQ_INT(count_chunk_files(dir), 0);
  CHECK(kvti_chunkstore_remove(st.cs, out[0].key, &nrem, NULL) ==
        KVT_ENOTFOUND);
  CHECK(!kvti_chains_lru_leaf(ch, &leaf));
  /* Re-spilling writes the chain again (its chunks were evicted). */
  sp.tokens = g_tok;
  REQUIRE(kvti_chunkstore_put(st.cs, &sp, &res) == 0);
  CHECK_EQ_INT(res.written, 6);
  sclose(&st);
  /* A row whose parent vanished (e.g. deleted by hand) is unreachable: open
   * drops it, so nothing reachable has a missing ancestor. */
  char *db = t_join(dir, "index.db");
  sqlite3 *raw;
  REQUIRE(sqlite3_open(db, &raw) == SQLITE_OK);
  REQUIRE(sqlite3_exec(raw, "DELETE FROM kvtier_chunks WHERE chunk_index = 2",
                       NULL, NULL, NULL) == SQLITE_OK);
  sqlite3_close(raw);
  sopen(&st, dir, 0);
  kvti_chains_totals_get(kvti_chunkstore_chains(st.cs), &t);
  CHECK_EQ_INT(t.chunks, 2);
  CHECK(kvti_chunkstore_lookup(st.cs, ns, nsl, g_tok, 96, C, out, 8, &m) == 0);
  CHECK_EQ_INT(m, 2);
  sclose(&st);
  REQUIRE(sqlite3_open(db, &raw) == SQLITE_OK);
  sqlite3_stmt *q;
  REQUIRE(sqlite3_prepare_v2(raw, "SELECT COUNT(*) FROM kvtier_chunks", -1, &q,
                             NULL) == SQLITE_OK);
  REQUIRE(sqlite3_step(q) == SQLITE_ROW);
  CHECK_EQ_INT(sqlite3_column_int(q, 0), 2);
  sqlite3_finalize(q);
  sqlite3_close(raw);
  free(db);
  kvti_free(ns);
  unmake(&s);
  free(dir);
}

/* Caller allocator: counts live buffers. */
static int g_live;
static void *t_alloc(void *ctx, uint32_t layer, uint32_t tensor,
                     const kvt_tensor *d) {
  (void)ctx;
  (void)layer;
  (void)tensor;
  g_live++;
  return malloc(d->nbytes ? d->nbytes : 1);
}
static void t_free(void *ctx, void *buf) {
  (void)ctx;
  g_live--;
  free(buf);
}

/* Rows [0, rows) of every tensor of the prefix equal the spill's. */
static int prefix_eq(const kvti_chunk_prefix *p, const spill *s,
                     uint64_t rows) {
  for (uint32_t i = 0; i < p->n_layers; i++) {
    const kvt_layer *a = &p->layers[i], *b = &s->l[p->layer_idx[i]];
    if (a->kind != b->kind || a->num_tensors != b->num_tensors)
      return 0;
    for (uint32_t j = 0; j < a->num_tensors; j++) {
      const kvt_tensor *x = &a->tensors[j], *y = &b->tensors[j];
      uint64_t outer = 1, row = kvt_dtype_size((kvt_dtype)y->dtype);
      for (uint32_t d = 0; d + 2 < y->ndim; d++)
        outer *= (uint64_t)y->shape[d];
      row *= (uint64_t)y->shape[y->ndim - 1];
      uint64_t TX = (uint64_t)x->shape[x->ndim - 2];
      uint64_t TY = (uint64_t)y->shape[y->ndim - 2];
      for (uint64_t o = 0; o < outer; o++)
        if (memcmp((const uint8_t *)x->data + o * TX * row,
                   (const uint8_t *)y->data + o * TY * row, rows * row))
          return 0;
    }
  }
  return 1;
}

static void test_read_prefix(void) {
  char *dir = t_join(g_dir, "d");
  mkdir(dir, 0700);
  store st;
  sopen(&st, dir, 0);
  kvt_rng r = {4};
  spill s;
  make(&s, &r, KVT_DTYPE_BF16, NTOK);
  uint8_t *ns;
  size_t nsl;
  REQUIRE(kvti_chunk_ns_encode(&ns, &nsl, "m", NULL) == 0);
  kvti_chunkstore_spill sp = sp_of(&s, ns, nsl, 150);
  kvti_chunkstore_result res;
  REQUIRE(kvti_chunkstore_put(st.cs, &sp, &res) == 0);
  kvti_chain_rec out[16];
  size_t m, bad = 99;
  REQUIRE(kvti_chunkstore_lookup(st.cs, ns, nsl, g_tok, 150, C, out, 16, &m) ==
          0);
  CHECK_EQ_INT(m, 9);
  kvti_chunk_read_opts o = {t_alloc, t_free, NULL, NULL, 0};
  kvti_chunk_prefix p;
  g_live = 0;
  REQUIRE(kvti_chunkstore_read_prefix(st.cs, out, 5, g_tok, &o, &p, &bad) == 0);
  CHECK_EQ_INT(p.n_layers, 2);
  CHECK_EQ_INT(p.layers[0].offset, 80);
  CHECK_EQ_INT(p.layers[0].tensors[0].shape[2], 80);
  CHECK_EQ_INT(p.layers[1].bits, 4);
  CHECK(prefix_eq(&p, &s, 80));
  /* What is reserved: the rows read, the 4-bit layer counted dense (80 rows
   * x 2 heads x 64 F16 values, keys and values) while its packed tensors
   * (32 packed + 4 scale + 4 bias bytes a row and head) are what the C read
   * allocated. */
  uint64_t sum = 0;
  for (uint32_t i = 0; i < p.n_layers; i++)
    for (uint32_t j = 0; j < p.layers[i].num_tensors; j++)
      sum += p.layers[i].tensors[j].nbytes;
  uint64_t kv = 2ull * 80 * 2 * 8 * 2; /* BF16 keys and values */
  CHECK_EQ_INT(sum, kv + 2ull * 80 * 2 * 40);
  CHECK_EQ_INT(kvti_chunk_prefix_bytes(out, 5), kv + 2ull * 80 * 2 * 64 * 2);
  CHECK_EQ_INT(kvti_layers_dense_bytes(p.layers, p.n_layers),
               kvti_chunk_prefix_bytes(out, 5));
  CHECK_EQ_INT(g_live, 8);
  kvti_chunk_prefix_free(&p, &o);
  CHECK_EQ_INT(g_live, 0);
  /* Room for a tail: rows beyond the chain are the caller's. */
  o.total_rows = 150;
  REQUIRE(kvti_chunkstore_read_prefix(st.cs, out, 9, g_tok, &o, &p, &bad) == 0);
  CHECK_EQ_INT(p.layers[0].tensors[1].shape[2], 150);
  CHECK(prefix_eq(&p, &s, 144));
  kvti_chunk_prefix_free(&p, &o);
  o.total_rows = 0;
  /* The prompt's tokens differ in chunk 3: refused, nothing handed out. */
  int32_t q[150];
  memcpy(q, g_tok, sizeof q);
  q[50] ^= 1;
  CHECK(kvti_chunkstore_read_prefix(st.cs, out, 5, q, &o, &p, &bad) ==
        KVT_ECORRUPT);
  CHECK_EQ_INT(bad, 3);
  CHECK_EQ_INT(g_live, 0);
  /* A flipped data byte in chunk 2. */
  char path[4096];
  REQUIRE(kvti_chunkstore_path(st.cs, out[2].key, path, sizeof path) == 0);
  size_t n;
  char *b = kvt_test_read_file(path, &n);
  REQUIRE(b);
  b[n - 5] ^= 0x10;
  t_write_all(path, b, n);
  CHECK(kvti_chunkstore_read_prefix(st.cs, out, 5, g_tok, &o, &p, &bad) ==
        KVT_ECORRUPT);
  CHECK_EQ_INT(bad, 2);
  CHECK_EQ_INT(g_live, 0);
  /* Two chunks are still fine. */
  CHECK(kvti_chunkstore_read_prefix(st.cs, out, 2, g_tok, &o, &p, &bad) == 0);
  kvti_chunk_prefix_free(&p, &o);
  /* A vanished file (evicted under the reader) is a miss, not corruption. */
  b[n - 5] ^= 0x10;
  t_write_all(path, b, n);
  free(b);
  REQUIRE(kvti_chunkstore_path(st.cs, out[4].key, path, sizeof path) == 0);
  unlink(path);
  CHECK(kvti_chunkstore_read_prefix(st.cs, out, 5, g_tok, &o, &p, &bad) ==
        KVT_ENOTFOUND);
  CHECK_EQ_INT(g_live, 0);
  /* Not a chain. */
  kvti_chain_rec two[2] = {out[0], out[2]};
  CHECK(kvti_chunkstore_read_prefix(st.cs, two, 2, g_tok, &o, &p, &bad) ==
        KVT_EINVAL);
  /* Cancelled. */
  atomic_int cancel = 1;
  o.cancel = &cancel;
  CHECK(kvti_chunkstore_read_prefix(st.cs, out, 2, g_tok, &o, &p, &bad) ==
        KVT_ECANCELED);
  CHECK_EQ_INT(g_live, 0);
  sclose(&st);
  kvti_free(ns);
  unmake(&s);
  free(dir);
}

/* The time of n single-row inserts of 32-byte keys in one WAL transaction
 * into a scratch database: the SQL work a linear put or removal of n chunks
 * does, measured on this machine now, whatever the code under test does. */
static double sql_baseline(const char *dir, const kvti_chain_rec *recs,
                           size_t n) {
  char *db = t_join(dir, "baseline.db");
  sqlite3 *raw;
  REQUIRE(sqlite3_open(db, &raw) == SQLITE_OK);
  REQUIRE(sqlite3_exec(raw,
                       "PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL; "
                       "CREATE TABLE t (k BLOB PRIMARY KEY, p BLOB, i INTEGER)",
                       NULL, NULL, NULL) == SQLITE_OK);
  sqlite3_stmt *q;
  REQUIRE(sqlite3_prepare_v2(raw, "INSERT INTO t VALUES (?, ?, ?)", -1, &q,
                             NULL) == SQLITE_OK);
  double t0 = kvti_now_mono();
  REQUIRE(sqlite3_exec(raw, "BEGIN", NULL, NULL, NULL) == SQLITE_OK);
  for (size_t i = 0; i < n; i++) {
    sqlite3_bind_blob(q, 1, recs[i].key, 32, SQLITE_STATIC);
    sqlite3_bind_blob(q, 2, recs[i].parent, 32, SQLITE_STATIC);
    sqlite3_bind_int64(q, 3, (sqlite3_int64)i);
    REQUIRE(sqlite3_step(q) == SQLITE_DONE);
    sqlite3_reset(q);
  }
  REQUIRE(sqlite3_exec(raw, "COMMIT", NULL, NULL, NULL) == SQLITE_OK);
  double t = kvti_now_mono() - t0;
  sqlite3_finalize(q);
  sqlite3_close(raw);
  free(db);
  return t;
}

/* Inserting and removing a deep chain is linear: a 24,000-chunk chain is
 * put in one batch, a few entries end along it, and its root is removed with
 * everything below it and those entries found. Each must cost about what
 * the same number of plain SQLite inserts costs (measured in the same run,
 * so a loaded machine slows both sides). Before, the put looked for each
 * parent from the start of the batch, the removal swept the whole table once
 * per level (16 s at 64,000 chunks) and the entries were compared with every
 * removed key: all quadratic. */
static void test_remove_deep(void) {
  enum { DEPTH = 24000, ENTS = 64 };
  char *dir = t_join(g_dir, "deep");
  mkdir(dir, 0700);
  store st;
  sopen(&st, dir, 0);
  kvti_chains *ch = kvti_chunkstore_chains(st.cs);
  kvti_chain_rec *recs = calloc(DEPTH, sizeof *recs);
  REQUIRE(recs);
  kvt_rng r = {41};
  uint8_t parent[32];
  for (int b = 0; b < 32; b++)
    parent[b] = (uint8_t)kvt_rng_next(&r);
  for (int i = 0; i < DEPTH; i++) {
    kvti_chain_rec *x = &recs[i];
    for (int b = 0; b < 32; b++)
      x->key[b] = (uint8_t)kvt_rng_next(&r);
    memcpy(x->parent, parent, 32);
    memcpy(parent, x->key, 32);
    x->index = (uint64_t)i;
    x->n_tokens = C;
    x->layout_hash = 7;
    x->ck.lo = kvt_rng_next(&r);
    x->ck.hi = kvt_rng_next(&r);
    x->disk_bytes = x->mem_bytes = 100;
    x->pure = 1;
  }
  double t_sql = sql_baseline(dir, recs, DEPTH);
  double t0 = kvti_now_mono();
  REQUIRE(kvti_chains_put(ch, recs, DEPTH) == 0);
  double t_put = kvti_now_mono() - t0;
  for (int e = 0; e < ENTS; e++) {
    kvti_chained_entry ce = {0};
    for (int b = 0; b < 32; b++)
      ce.hash[b] = (uint8_t)kvt_rng_next(&r);
    size_t at = (size_t)(e + 1) * (DEPTH / ENTS) - 1;
    ce.chunks = at + 1;
    ce.chunk_tokens = C;
    memcpy(ce.last_key, recs[at].key, 32);
    ce.layout_hash = 7;
    ce.total_rows = ce.chunks * C;
    REQUIRE(kvti_chains_entry_put(ch, &ce) == 0);
  }
  t0 = kvti_now_mono();
  kvti_chain_rec *rem = NULL;
  size_t nrem = 0;
  REQUIRE(kvti_chains_remove_tree(ch, recs[0].key, &rem, &nrem) == 0);
  uint8_t(*hs)[32] = NULL;
  size_t nh = 0;
  REQUIRE(kvti_chains_entries_ending(ch, rem, nrem, &hs, &nh) == 0);
  double t_rm = kvti_now_mono() - t0;
  CHECK_EQ_INT(nrem, DEPTH);
  CHECK_EQ_INT(nh, ENTS);
  /* Parents come before their children in what is returned. */
  CHECK(nrem && rem[0].index == 0);
  kvti_chains_totals tot;
  kvti_chains_totals_get(ch, &tot);
  CHECK_EQ_INT(tot.chunks, 0);
  printf("remove_deep: depth %d: %d SQLite inserts %.3f s, put %.3f s, "
         "remove %.3f s\n",
         DEPTH, DEPTH, t_sql, t_put, t_rm);
  CHECK(t_put < 8 * t_sql + 0.05);
  CHECK(t_rm < 8 * t_sql + 0.05);
  kvti_free(hs);
  kvti_free(rem);
  free(recs);
  sclose(&st);
  free(dir);
}

/* A chunk's sizes are checked against its chain row - what a promote
 * reserved and the reader allocates by - and a sparse chunk file is refused,
 * both before any buffer is sized from the header. Before, a header that
 * promised more than the row (a planted chunk, 8 GiB apparent) was read into
 * buffers sized from the header and served; gc and the writer's sweep
 * allocated a sparse orphan's whole apparent size to verify it. */
static void test_sizes_vs_row(void) {
  char *dir = t_join(g_dir, "sizes");
  mkdir(dir, 0700);
  store st;
  sopen(&st, dir, 0);
  kvt_rng r = {43};
  /* One KV layer of 1 MiB per tensor per chunk, all zero: its sparse copy
   * (header written, data left as a hole) has exactly the same bytes. */
  kvt_layer l = t_kv(&r, KVT_DTYPE_F32, 1, 64, 2 * C, 128, 2 * C);
  for (uint32_t j = 0; j < l.num_tensors; j++)
    memset(l.tensors[j].data, 0, (size_t)l.tensors[j].nbytes);
  uint32_t ids[1] = {0};
  uint8_t *ns;
  size_t nsl;
  REQUIRE(kvti_chunk_ns_encode(&ns, &nsl, "m", NULL) == 0);
  kvti_chunkstore_spill sp = {ns, nsl, g_tok, 2 * C, C, &l, ids, 1, 1};
  kvti_chunkstore_result res;
  REQUIRE(kvti_chunkstore_put(st.cs, &sp, &res) == 0);
  kvti_chain_rec out[4];
  size_t m, bad = 99;
  REQUIRE(kvti_chunkstore_lookup(st.cs, ns, nsl, g_tok, 2 * C, C, out, 4, &m) ==
          0);
  REQUIRE(m == 2);
  kvti_chunk_read_opts o = {t_alloc, t_free, NULL, NULL, 0};
  kvti_chunk_prefix p;
  g_live = 0;
  REQUIRE(kvti_chunkstore_read_prefix(st.cs, out, 2, g_tok, &o, &p, &bad) == 0);
  kvti_chunk_prefix_free(&p, &o);
  /* The row (what was reserved) says less than the header: refused, and
   * nothing was allocated. */
  kvti_chain_rec t[2];
  memcpy(t, out, sizeof t);
  t[1].mem_bytes /= 2;
  CHECK(kvti_chunkstore_read_prefix(st.cs, t, 2, g_tok, &o, &p, &bad) ==
        KVT_ECORRUPT);
  CHECK_EQ_INT(bad, 1);
  CHECK(strstr(kvt_last_error(), "differ from its chain row") != NULL);
  memcpy(t, out, sizeof t);
  t[0].mem_bytes /= 2;
  CHECK(kvti_chunkstore_read_prefix(st.cs, t, 2, g_tok, &o, &p, &bad) ==
        KVT_ECORRUPT);
  CHECK_EQ_INT(bad, 0);
  CHECK_EQ_INT(g_live, 0);
  memcpy(t, out, sizeof t);
  t[1].disk_bytes += 4096;
  CHECK(kvti_chunkstore_read_prefix(st.cs, t, 2, g_tok, &o, &p, &bad) ==
        KVT_ECORRUPT);
  CHECK_EQ_INT(g_live, 0);
  /* Chunk 1 replaced by a sparse file holding the same bytes. */
  char path[4096];
  REQUIRE(kvti_chunkstore_path(st.cs, out[1].key, path, sizeof path) == 0);
  int fd = -1;
  kvti_chunk_hdr h;
  REQUIRE(kvti_chunk_open(&fd, &h, path, out[1].key, 0) == 0);
  uint32_t hb = h.header_bytes;
  uint64_t size = (uint64_t)h.header_bytes + h.data_bytes;
  kvti_chunk_hdr_free(&h);
  uint8_t *hdr = malloc(hb);
  REQUIRE(hdr && pread(fd, hdr, hb, 0) == (ssize_t)hb);
  close(fd);
  char sparse[4200];
  snprintf(sparse, sizeof sparse, "%s.plant", path);
  fd = open(sparse, O_CREAT | O_WRONLY | O_TRUNC, 0600);
  REQUIRE(fd >= 0 && write(fd, hdr, hb) == (ssize_t)hb);
  REQUIRE(ftruncate(fd, (off_t)size) == 0);
  close(fd);
  REQUIRE(rename(sparse, path) == 0);
  free(hdr);
  struct stat sst;
  REQUIRE(stat(path, &sst) == 0);
  if (!kvti_file_sparse(&sst)) {
    kvt_test_skip("sparse-files", "this file system allocated the holes");
  } else {
    CHECK(kvti_chunkstore_read_prefix(st.cs, out, 2, g_tok, &o, &p, &bad) ==
          KVT_ECORRUPT);
    CHECK_EQ_INT(bad, 1);
    CHECK(strstr(kvt_last_error(), "sparse") != NULL);
    CHECK_EQ_INT(g_live, 0);
  }
  kvti_free(ns);
  t_layer_free(&l);
  sclose(&st);
  free(dir);
}

/* An outside directory holding one sentinel file: outside_clean says it
 * still holds exactly that (nothing created, written or removed there). */
static char *outside_make(const char *tag) {
  char *o = t_join(g_dir, tag);
  kvt_test_rmtree(o);
  REQUIRE(mkdir(o, 0700) == 0);
  char *f = t_join(o, "sentinel");
  FILE *fp = fopen(f, "w");
  REQUIRE(fp != NULL);
  fputs("outside", fp);
  fclose(fp);
  free(f);
  return o;
}
static int outside_clean(const char *o) {
  char *f = t_join(o, "sentinel");
  size_t len = 0;
  char *b = kvt_test_read_file(f, &len);
  int ok = b && len == 7 && !memcmp(b, "outside", 7) &&
           kvt_test_count_dir(o, NULL) == 1;
  free(b);
  free(f);
  return ok;
}

/* Chunk writes never go through a link: chunks/ swapped for a link after
 * the store has written there, chunks/<kk> planted as a link, and a chunk
 * adopted from another node into a linked chunks/ are all refused
 * (KVT_EPERM, the message names the link) with nothing created, written or
 * removed outside the cache; a link planted at the tmp or the final name is
 * replaced, its target untouched. The local read of a chunk's bytes (what
 * the remote tier uploads) refuses a linked chunks/ too. */
static void test_writes_never_follow_links(void) {
  kvt_rng r = {21};
  spill s;
  make(&s, &r, KVT_DTYPE_F16, NTOK);
  kvti_chunkstore_result res;
  /* The first chunk's key (its directory is chunks/<key[0]>). */
  char *d0 = t_join(g_dir, "links0");
  mkdir(d0, 0700);
  store st;
  sopen(&st, d0, 0);
  kvti_chunkstore_spill sp = sp_of(&s, NULL, 0, 100);
  REQUIRE(kvti_chunkstore_put(st.cs, &sp, &res) == 0);
  kvti_chain_rec out[8];
  size_t m = 0;
  REQUIRE(kvti_chunkstore_lookup(st.cs, NULL, 0, g_tok, 100, C, out, 8, &m) ==
          0);
  REQUIRE(m == 6);
  char *bytes = NULL;
  size_t blen = 0;
  REQUIRE(kvti_chunkstore_read_bytes(st.cs, out[0].key, &bytes, &blen,
                                     (size_t)1 << 30) == 0);
  CHECK_EQ_INT(blen, out[0].disk_bytes);
  kvti_chain_rec rec0 = out[0];
  char kk[3];
  snprintf(kk, sizeof kk, "%02x", rec0.key[0]);

  /* 1. chunks/ replaced by a link after a first write (the store had seen
   * it as a directory): the next spill's chunks go nowhere. */
  char *o1 = outside_make("outside1");
  char *cd = t_join(d0, "chunks"), *aside = t_join(d0, "chunks.real");
  REQUIRE(rename(cd, aside) == 0 && symlink(o1, cd) == 0);
  kvti_chunkstore_spill sp2 = sp_of(&s, (const uint8_t *)"other", 5, 100);
  CHECK_EQ_INT(kvti_chunkstore_put(st.cs, &sp2, &res), KVT_EPERM);
  CHECK(strstr(kvt_last_error(), "chunks") != NULL);
  CHECK_EQ_INT(res.written, 0);
  CHECK(outside_clean(o1));
  /* The read of a chunk's bytes refuses the link too. */
  char *b2 = NULL;
  size_t l2 = 0;
  CHECK_EQ_INT(kvti_chunkstore_read_bytes(st.cs, rec0.key, &b2, &l2, 1 << 30),
               KVT_EPERM);
  CHECK(b2 == NULL);
  REQUIRE(unlink(cd) == 0 && rename(aside, cd) == 0);
  sclose(&st);

  /* 2. A chunk from another node adopted into a cache whose chunks/ is a
   * link: refused, nothing outside. */
  char *d1 = t_join(g_dir, "links1");
  mkdir(d1, 0700);
  char *o2 = outside_make("outside2");
  char *cd1 = t_join(d1, "chunks");
  REQUIRE(symlink(o2, cd1) == 0);
  sopen(&st, d1, 0);
  CHECK_EQ_INT(kvti_chunkstore_adopt(st.cs, bytes, blen, &rec0), KVT_EPERM);
  CHECK(outside_clean(o2));
  CHECK(!kvti_chains_find(kvti_chunkstore_chains(st.cs), rec0.key, NULL));
  /* 3. chunks/ real, chunks/<kk> a link: spill and adoption refused. */
  REQUIRE(unlink(cd1) == 0 && mkdir(cd1, 0700) == 0);
  char *kd = t_join(cd1, kk);
  REQUIRE(symlink(o2, kd) == 0);
  CHECK_EQ_INT(kvti_chunkstore_adopt(st.cs, bytes, blen, &rec0), KVT_EPERM);
  CHECK_EQ_INT(kvti_chunkstore_put(st.cs, &sp, &res), KVT_EPERM);
  CHECK(outside_clean(o2));
  /* 4. Links planted at the tmp and at the final name of chunk 0 point at
   * outside files: the write replaces them, never writes through them. */
  REQUIRE(unlink(kd) == 0 && mkdir(kd, 0700) == 0);
  char h[65];
  kvti_hex32(h, rec0.key);
  char fname[80], tname[80];
  snprintf(fname, sizeof fname, "%s.kvc", h);
  snprintf(tname, sizeof tname, "%s.tmp", h);
  char *fl = t_join(kd, fname), *tl = t_join(kd, tname);
  char *os = t_join(o2, "sentinel");
  REQUIRE(symlink(os, fl) == 0 && symlink(os, tl) == 0);
  REQUIRE(kvti_chunkstore_put(st.cs, &sp, &res) == 0);
  CHECK_EQ_INT(res.written, 6);
  CHECK(outside_clean(o2));
  struct stat lst;
  CHECK(lstat(fl, &lst) == 0 && S_ISREG(lst.st_mode));
  CHECK(!kvt_test_exists(tl));
  int fd = -1;
  kvti_chunk_hdr hh;
  CHECK(kvti_chunkstore_open_chunk(st.cs, &rec0, g_tok, &fd, &hh) == 0);
  if (fd >= 0) {
    kvti_chunk_hdr_free(&hh);
    close(fd);
  }
  sclose(&st);

  free(os);
  free(fl);
  free(tl);
  free(kd);
  free(cd1);
  free(o2);
  free(d1);
  free(cd);
  free(aside);
  free(o1);
  kvti_free(bytes);
  unmake(&s);
  free(d0);
}

/* Chunk rows record the dense size of their rows (a quantized layer counted
 * dequantized). Rows an earlier build wrote hold the packed data bytes: they
 * are still served (their header matches them), and a rebuild from the files
 * records the dense size. */
static void test_packed_rows(void) {
  char *dir = t_join(g_dir, "packed");
  mkdir(dir, 0700);
  store st;
  sopen(&st, dir, 0);
  kvt_rng r = {51};
  spill s;
  make(&s, &r, KVT_DTYPE_F16, NTOK);
  uint8_t *ns;
  size_t nsl;
  REQUIRE(kvti_chunk_ns_encode(&ns, &nsl, "m", NULL) == 0);
  kvti_chunkstore_spill sp = sp_of(&s, ns, nsl, 4 * C);
  kvti_chunkstore_result res;
  REQUIRE(kvti_chunkstore_put(st.cs, &sp, &res) == 0);
  /* A chunk of 16 rows: F16 KV (2 heads x 8) 1024 bytes; the 4-bit layer
   * 2560 packed, 8192 dense (2 heads x 64 F16 values, keys and values). */
  const uint64_t dense = 1024 + 8192, packed = 1024 + 2560;
  kvti_chain_rec out[8];
  size_t m, bad = 99;
  REQUIRE(kvti_chunkstore_lookup(st.cs, ns, nsl, g_tok, 4 * C, C, out, 8, &m) ==
          0);
  REQUIRE(m == 4);
  for (size_t i = 0; i < m; i++)
    CHECK_EQ_INT(out[i].mem_bytes, dense);
  sclose(&st);
  char *db = t_join(dir, "index.db");
  sqlite3 *raw;
  char sql[128];
  snprintf(sql, sizeof sql, "UPDATE kvtier_chunks SET memory_bytes = %llu",
           (unsigned long long)packed);
  REQUIRE(sqlite3_open(db, &raw) == SQLITE_OK);
  REQUIRE(sqlite3_exec(raw, sql, NULL, NULL, NULL) == SQLITE_OK);
  sqlite3_close(raw);
  sopen(&st, dir, 0);
  REQUIRE(kvti_chunkstore_lookup(st.cs, ns, nsl, g_tok, 4 * C, C, out, 8, &m) ==
          0);
  REQUIRE(m == 4);
  CHECK_EQ_INT(out[3].mem_bytes, packed);
  kvti_chunk_read_opts o = {t_alloc, t_free, NULL, NULL, 0};
  kvti_chunk_prefix p;
  g_live = 0;
  CHECK(kvti_chunkstore_read_prefix(st.cs, out, 4, g_tok, &o, &p, &bad) == 0);
  CHECK(prefix_eq(&p, &s, 4 * C));
  kvti_chunk_prefix_free(&p, &o);
  /* Any other figure is still refused. */
  out[2].mem_bytes = packed + 1;
  CHECK(kvti_chunkstore_read_prefix(st.cs, out, 4, g_tok, &o, &p, &bad) ==
        KVT_ECORRUPT);
  CHECK_EQ_INT(bad, 2);
  CHECK_EQ_INT(g_live, 0);
  sclose(&st);
  /* Rebuilt from the files (the index lost its rows): dense again. */
  REQUIRE(sqlite3_open(db, &raw) == SQLITE_OK);
  REQUIRE(sqlite3_exec(raw, "DELETE FROM kvtier_chunks", NULL, NULL, NULL) ==
          SQLITE_OK);
  sqlite3_close(raw);
  sopen(&st, dir, 0);
  size_t indexed = 0, skipped = 0;
  REQUIRE(kvti_chunkstore_rebuild(st.cs, &indexed, &skipped) == 0);
  CHECK_EQ_INT(indexed, 4);
  REQUIRE(kvti_chunkstore_lookup(st.cs, ns, nsl, g_tok, 4 * C, C, out, 8, &m) ==
          0);
  REQUIRE(m == 4);
  for (size_t i = 0; i < m; i++)
    CHECK_EQ_INT(out[i].mem_bytes, dense);
  CHECK_EQ_INT(kvti_chunk_prefix_bytes(out, 4), 4 * dense);
  sclose(&st);
  free(db);
  kvti_free(ns);
  unmake(&s);
  free(dir);
}

int main(void) {
  g_dir = kvt_test_tmpdir("chunkstore");
  kvt_rng r = {99};
  for (int i = 0; i < NTOK; i++)
    g_tok[i] = (int32_t)(kvt_rng_next(&r) % 50000);
  RUN(test_put_dedup_lookup);
  RUN(test_offsets_limit);
  RUN(test_remove_lru);
  RUN(test_read_prefix);
  RUN(test_remove_deep);
  RUN(test_sizes_vs_row);
  RUN(test_writes_never_follow_links);
  RUN(test_packed_rows);
  return kvt_test_done();
}
