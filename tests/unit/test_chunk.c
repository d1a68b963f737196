/*
 * test_chunk.c - chunk files (src/format/chunk.c, docs/FORMAT.md section 10):
 * the key chain (length prefix, namespace and salt seeds, parent dependence,
 * known-answer vectors of the chunk keys and the lookup chain),
 * round trips of KV, rotating (not wrapped) and quantized layers with rows cut
 * from the middle of the spill compared byte for byte against the source,
 * which layers may be cut (wrapped rotating KV, offset shorter than the rows,
 * arrays), the exact file size, the durable write (stale tmp replaced, nothing
 * left on failure), and corruption: every header byte flipped, truncation at
 * every length of the header, a flipped data byte in every block, a wrong
 * expected key or layout - all KVT_ECORRUPT, never a crash.
 */
#include "fmt_testlib.h"
#include "base/io.h"
#include "format/chunk.h"

#include <xxhash.h>

static char *g_dir;
static const int32_t TOK[64] = {
    5,  9,  2,  7,  11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53,
    59, 61, 67, 71, 73, 79, 83, 89, 97, 1,  2,  3,  4,  5,  6,  7,
    8,  9,  10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23,
    24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39};

static void test_keys(void) {
  uint8_t *ns1, *ns2, *ns3;
  size_t l1, l2, l3;
  REQUIRE(kvti_chunk_ns_encode(&ns1, &l1, "llama", NULL) == 0);
  REQUIRE(kvti_chunk_ns_encode(&ns2, &l2, "llama", "salt") == 0);
  /* Length prefixes: ("ab", "c") and ("a", "bc") differ. */
  REQUIRE(kvti_chunk_ns_encode(&ns3, &l3, "llam", "asalt") == 0);
  uint8_t s1[32], s2[32], s3[32], k1[32], k2[32], k1b[32], kc[32];
  CHECK(kvti_chunk_seed(s1, ns1, l1, 7) == 0);
  CHECK(kvti_chunk_seed(s2, ns2, l2, 7) == 0);
  CHECK(kvti_chunk_seed(s3, ns3, l3, 7) == 0);
  CHECK(memcmp(s1, s2, 32) != 0);
  CHECK(memcmp(s2, s3, 32) != 0);
  uint8_t s1l[32]; /* another KV layout: another chain */
  CHECK(kvti_chunk_seed(s1l, ns1, l1, 8) == 0);
  CHECK(memcmp(s1, s1l, 32) != 0);
  CHECK(kvti_chunk_key(k1, s1, TOK, 16) == 0);
  CHECK(kvti_chunk_key(k2, s2, TOK, 16) == 0);
  CHECK(kvti_chunk_key(k1b, s1, TOK, 16) == 0);
  CHECK(memcmp(k1, k2, 32) != 0);  /* salts never share chunks */
  CHECK(memcmp(k1, k1b, 32) == 0); /* deterministic */
  /* The next chunk depends on its parent. */
  CHECK(kvti_chunk_key(kc, k1, TOK + 16, 16) == 0);
  uint8_t kd[32];
  CHECK(kvti_chunk_key(kd, k2, TOK + 16, 16) == 0);
  CHECK(memcmp(kc, kd, 32) != 0);
  kvti_ck c1 = kvti_ck_next(kvti_ck_seed(ns1, l1), TOK, 16);
  kvti_ck c2 = kvti_ck_next(kvti_ck_seed(ns2, l2), TOK, 16);
  kvti_ck c3 = kvti_ck_next(kvti_ck_seed(ns1, l1), TOK, 15);
  kvti_ck c1b = kvti_ck_next(kvti_ck_seed(ns1, l1), TOK, 16);
  CHECK(c1.lo != c2.lo || c1.hi != c2.hi);
  CHECK(c1.lo != c3.lo || c1.hi != c3.hi);
  CHECK(c1.lo == c1b.lo && c1.hi == c1b.hi);
  uint8_t *big;
  size_t lb;
  char longid[5000];
  memset(longid, 'x', sizeof longid - 1);
  longid[sizeof longid - 1] = 0;
  CHECK(kvti_chunk_ns_encode(&big, &lb, longid, NULL) == KVT_EINVAL);
  kvti_free(ns1);
  kvti_free(ns2);
  kvti_free(ns3);
}

/* A spill of 3 layers (fp16 KV, rotating bf16 not wrapped, 4-bit quantized)
 * of T = 40 tokens. */
typedef struct spill {
  kvt_layer l[4];
  uint32_t ids[3];
  uint8_t *ns;
  size_t ns_len;
  uint8_t seed[32];
} spill;

static void make_spill(spill *s, kvt_rng *r) {
  s->l[0] = t_kv(r, KVT_DTYPE_F16, 1, 2, 40, 8, 40);
  s->l[1] = t_kv(r, KVT_DTYPE_BF16, 1, 3, 40, 4, 40);
  s->l[1].kind = KVT_LAYER_ROTATING_KV;
  s->l[1].max_size = 64;
  s->l[1].keep = 4;
  s->l[1].step = 256;
  s->l[1].idx = 40;
  kvt_dtype dts[1] = {KVT_DTYPE_F32};
  s->l[2] = t_arrays(r, 1, dts); /* not cuttable: stays in the entry */
  s->l[3] = t_quant(r, 4, 32, KVT_DTYPE_BF16, 1, 2, 40, 64, 40);
  s->ids[0] = 0;
  s->ids[1] = 1;
  s->ids[2] = 3;
  REQUIRE(kvti_chunk_ns_encode(&s->ns, &s->ns_len, "m", "") == 0);
  REQUIRE(kvti_chunk_seed(s->seed, s->ns, s->ns_len, 0) == 0);
}

static void free_spill(spill *s) {
  for (int i = 0; i < 4; i++)
    t_layer_free(&s->l[i]);
  kvti_free(s->ns);
}

static kvti_chunk_src src_of(const spill *s, const uint8_t *parent,
                             uint64_t index, uint32_t n) {
  kvti_chunk_src c = {.ns = s->ns,
                      .ns_len = s->ns_len,
                      .parent = parent,
                      .index = index,
                      .tokens = TOK + index * n,
                      .n = n,
                      .row0 = index * n,
                      .layers = s->l,
                      .layer_ids = s->ids,
                      .n_layers = 3,
                      .spill_layers = 4};
  return c;
}

static char *write_chunk(const spill *s, const uint8_t *parent, uint64_t index,
                         uint32_t n, uint8_t key[32], uint64_t *size) {
  char *p = t_join(g_dir, "c.kvc"), *tmp = t_join(g_dir, "c.kvc.tmp");
  kvti_chunk_src c = src_of(s, parent, index, n);
  kvti_chunk_written w;
  REQUIRE(kvti_chunk_write(p, tmp, &c, 0600, 1, &w) == 0);
  memcpy(key, w.key, 32);
  *size = w.size;
  uint64_t lh;
  CHECK(kvti_chunk_layout_hash(&lh, &c) == 0 && lh == w.layout_hash);
  CHECK(w.mem_bytes == kvti_chunk_mem_bytes(&c));
  CHECK(!kvt_test_exists(tmp));
  free(tmp);
  return p;
}

/* Every chunk tensor equals rows [index*n, index*n + n) of its source. */
static int rows_match(const spill *s, const kvti_chunk_hdr *h,
                      const uint8_t *data, uint64_t row0) {
  for (uint32_t i = 0; i < h->n_layers; i++) {
    const kvti_chunk_layer *L = &h->layers[i];
    const kvt_layer *src = &s->l[L->layer_idx];
    if (L->kind != src->kind || L->num_tensors != src->num_tensors)
      return 0;
    for (uint32_t j = 0; j < L->num_tensors; j++) {
      const kvt_tensor *t = &src->tensors[j];
      uint64_t outer = 1, row = kvt_dtype_size((kvt_dtype)t->dtype);
      for (uint32_t d = 0; d + 2 < t->ndim; d++)
        outer *= (uint64_t)t->shape[d];
      row *= (uint64_t)t->shape[t->ndim - 1];
      uint64_t T = (uint64_t)t->shape[t->ndim - 2];
      for (uint64_t o = 0; o < outer; o++)
        if (memcmp(data + L->tensors[j].off + o * row * h->n_tokens,
                   (const uint8_t *)t->data + (o * T + row0) * row,
                   row * h->n_tokens) != 0)
          return 0;
    }
  }
  return 1;
}

/* Known answers for the keys of docs/FORMAT.md section 10, computed from the
 * format's definitions outside kvtier (SHA-256 with Python's hashlib; the
 * lookup chain with xxHash's own XXH3-128): a change to any encoding (the
 * length prefix, the layout hash, the namespace, the seed mix) fails here
 * even when every key stays self-consistent. */
static void hex_eq(const uint8_t k[32], const char *want) {
  char got[65];
  for (int i = 0; i < 32; i++)
    snprintf(got + 2 * i, 3, "%02x", k[i]);
  if (strcmp(got, want) != 0)
    fprintf(stderr, "key %s, want %s\n", got, want);
  CHECK(strcmp(got, want) == 0);
}

static void test_key_vectors(void) {
  int32_t t[32];
  for (int i = 0; i < 32; i++)
    t[i] = i * 7919 - 3;
  uint8_t *ns;
  size_t nl;
  REQUIRE(kvti_chunk_ns_encode(&ns, &nl, "llama-3-8b", NULL) == 0);
  static const uint8_t ns_want[] = {0x0a, 0,   0,   0,   'l', 'l',
                                    'a',  'm', 'a', '-', '3', '-',
                                    '8',  'b', 0,   0,   0,   0};
  CHECK(nl == sizeof ns_want && memcmp(ns, ns_want, nl) == 0);
  uint8_t seed[32], k0[32], k1[32], kp[32];
  REQUIRE(kvti_chunk_seed(seed, ns, nl, 0x0123456789abcdefull) == 0);
  hex_eq(seed,
         "dc4cc441855cf08657df390bcff389016952016505ed047c61349a5655c3f7a2");
  REQUIRE(kvti_chunk_key(k0, seed, t, 16) == 0);
  hex_eq(k0,
         "22c1f31d693d9350a311710271a10c925f1c0d61f7fb6120ebc7482a5b83dd06");
  REQUIRE(kvti_chunk_key(k1, k0, t + 16, 16) == 0);
  hex_eq(k1,
         "f88ee3fd19d4d9eb06c6e6eaaceaa2130a23c7fdc674fbc0d950d8bc9149308f");
  REQUIRE(kvti_chunk_key(kp, seed, t, 3) == 0);
  hex_eq(kp,
         "50163538c15c0515849c125093f3f3c9f6f4725a59d0d55d4c49bde0aa5a7f4d");
  /* The lookup chain of the same namespace and tokens. */
  kvti_ck c = kvti_ck_seed(ns, nl);
  CHECK(c.lo == 0x9fa4d1f9541a8eb7ull && c.hi == 0x8a321c77b798dcb4ull);
  kvti_ck c0 = kvti_ck_next(c, t, 16);
  CHECK(c0.lo == 0xec823ab4021e15bcull && c0.hi == 0x46e77f90ddd3ce48ull);
  kvti_ck c1 = kvti_ck_next(c0, t + 16, 16);
  CHECK(c1.lo == 0x17c13b0d803727cfull && c1.hi == 0xd79eaf4e4afaa436ull);
  kvti_ck cp = kvti_ck_next(c, t, 3);
  CHECK(cp.lo == 0xec3fd3e546620530ull && cp.hi == 0x992a7cd107632a25ull);
  kvti_free(ns);
  /* A salted namespace (the salt field holds a 64-hex digest) and the int32
   * extremes. */
  char salt[65];
  memset(salt, 'a', 64);
  salt[64] = 0;
  REQUIRE(kvti_chunk_ns_encode(&ns, &nl, "m", salt) == 0);
  REQUIRE(kvti_chunk_seed(seed, ns, nl, 1) == 0);
  hex_eq(seed,
         "8bd82e211cd41399519845dfa8da9eb052faae0997fa2a0c4d28a974b69c4cbf");
  const int32_t ext[4] = {-1, 0, INT32_MAX, INT32_MIN};
  REQUIRE(kvti_chunk_key(k0, seed, ext, 4) == 0);
  hex_eq(k0,
         "0163c872725057a8fc4c78f06b650c60e31884237e816655abedee097d7d5216");
  kvti_free(ns);
}

static void test_roundtrip(void) {
  kvt_rng r = {11};
  spill s;
  make_spill(&s, &r);
  uint8_t k0[32], k1[32];
  uint64_t sz0, sz1;
  char *p = write_chunk(&s, s.seed, 0, 16, k0, &sz0);
  kvti_chunk_src c1 = src_of(&s, k0, 1, 16);
  CHECK_EQ_INT(kvti_chunk_file_size(&c1), sz0);
  p = (free(p), write_chunk(&s, k0, 1, 16, k1, &sz1));
  struct stat st;
  CHECK(stat(p, &st) == 0 && (uint64_t)st.st_size == sz1);
  CHECK((st.st_mode & 0777) == 0600);
  int fd;
  kvti_chunk_hdr h;
  REQUIRE(kvti_chunk_open(&fd, &h, p, k1, 0) == 0);
  CHECK_EQ_INT(h.index, 1);
  CHECK_EQ_INT(h.n_tokens, 16);
  CHECK_EQ_INT(h.n_layers, 3);
  CHECK(memcmp(h.parent, k0, 32) == 0);
  CHECK(memcmp(h.tokens, TOK + 16, 64) == 0);
  CHECK(h.ns_len == s.ns_len && memcmp(h.ns, s.ns, s.ns_len) == 0);
  CHECK(h.header_bytes % 64 == 0);
  /* 16 rows: F16 KV (2 heads x 8) 1024 bytes, BF16 rotating (3 x 4) 768, and
   * the 4-bit layer (2 heads, 64 wide, groups of 32: 32 packed + 4 scale + 4
   * bias bytes a row) 2560 packed in the file, 8192 dense (64 BF16 values a
   * row for keys and values). memory_bytes is the dense figure. */
  CHECK_EQ_INT(h.data_bytes, 1024 + 768 + 2560);
  CHECK_EQ_INT(kvti_chunk_mem_bytes(&c1), 1024 + 768 + 8192);
  CHECK_EQ_INT(kvti_chunk_hdr_mem_bytes(&h), kvti_chunk_mem_bytes(&c1));
  CHECK_EQ_INT(h.layers[2].bits, 4);
  CHECK_EQ_INT(h.layers[2].group_size, 32);
  CHECK_EQ_INT(h.layers[2].layer_idx, 3);
  uint8_t *data = malloc(h.data_bytes);
  CHECK(kvti_chunk_read_data(fd, &h, data, p) == 0);
  CHECK(rows_match(&s, &h, data, 16));
  uint64_t lh = h.layout_hash;
  kvti_chunk_hdr_free(&h);
  close(fd);
  /* Chunk 0 has the same layout (same shapes except the token axis = n). */
  kvti_chunk_src c0 = src_of(&s, s.seed, 0, 16);
  char *p0 = t_join(g_dir, "c0.kvc"), *t0 = t_join(g_dir, "c0.tmp");
  REQUIRE(kvti_chunk_write(p0, t0, &c0, 0644, 0, NULL) == 0);
  REQUIRE(kvti_chunk_open(&fd, &h, p0, k0, lh) == 0);
  CHECK(kvti_chunk_read_data(fd, &h, data, p0) == 0);
  CHECK(rows_match(&s, &h, data, 0));
  kvti_chunk_hdr_free(&h);
  close(fd);
  /* Wrong key, wrong layout. */
  CHECK(kvti_chunk_open(&fd, &h, p0, k1, 0) == KVT_ECORRUPT);
  CHECK(kvti_chunk_open(&fd, &h, p0, k0, lh ^ 1) == KVT_ECORRUPT);
  /* A stale tmp (crash) is replaced. */
  t_write_all(t0, "junk", 4);
  unlink(p0);
  CHECK(kvti_chunk_write(p0, t0, &c0, 0644, 1, NULL) == 0);
  CHECK(!kvt_test_exists(t0));
  CHECK(kvti_chunk_open(&fd, &h, p0, k0, lh) == 0);
  kvti_chunk_hdr_free(&h);
  close(fd);
  /* The file may be unlinked between open and read (eviction). */
  REQUIRE(kvti_chunk_open(&fd, &h, p0, k0, lh) == 0);
  unlink(p0);
  CHECK(kvti_chunk_read_data(fd, &h, data, p0) == 0);
  kvti_chunk_hdr_free(&h);
  close(fd);
  CHECK(kvti_chunk_open(&fd, &h, p0, k0, lh) == KVT_ENOTFOUND);
  free(data);
  free(p);
  free(p0);
  free(t0);
  free_spill(&s);
}

static void test_cuttable(void) {
  kvt_rng r = {3};
  spill s;
  make_spill(&s, &r);
  CHECK(kvti_chunk_layer_ok(&s.l[0], 40));
  CHECK(!kvti_chunk_layer_ok(&s.l[0], 41)); /* more rows than stored */
  CHECK(!kvti_chunk_layer_ok(&s.l[2], 1));  /* arrays */
  CHECK(kvti_chunk_layer_ok(&s.l[1], 32));
  s.l[1].idx = 7; /* wrapped: rows out of token order */
  CHECK(!kvti_chunk_layer_ok(&s.l[1], 8));
  s.l[1].idx = 40;
  s.l[1].max_size = 32; /* offset beyond the window */
  CHECK(!kvti_chunk_layer_ok(&s.l[1], 8));
  s.l[1].max_size = 64;
  s.l[0].offset = 20; /* rows >= offset are not valid KV: never stored */
  CHECK(kvti_chunk_layer_ok(&s.l[0], 16));
  CHECK(!kvti_chunk_layer_ok(&s.l[0], 32));
  kvti_chunk_src c = src_of(&s, s.seed, 1, 16);
  char *p = t_join(g_dir, "x.kvc"), *tmp = t_join(g_dir, "x.tmp");
  CHECK(kvti_chunk_write(p, tmp, &c, 0600, 0, NULL) == KVT_EINVAL);
  CHECK(!kvt_test_exists(p) && !kvt_test_exists(tmp));
  CHECK(kvti_chunk_file_size(&c) == 0);
  s.l[0].offset = 40;
  c.n = 0;
  CHECK(kvti_chunk_write(p, tmp, &c, 0600, 0, NULL) == KVT_EINVAL);
  free(p);
  free(tmp);
  free_spill(&s);
}

static void test_corruption(void) {
  kvt_rng r = {5};
  spill s;
  make_spill(&s, &r);
  uint8_t k0[32];
  uint64_t sz;
  char *p = write_chunk(&s, s.seed, 0, 32, k0, &sz);
  size_t n;
  uint8_t *orig = (uint8_t *)kvt_test_read_file(p, &n);
  REQUIRE(orig && n == sz);
  kvti_chunk_hdr h;
  REQUIRE(kvti_chunk_parse(&h, orig, 0, n, "x") == KVT_ECORRUPT);
  uint32_t hb = kvti_chunk_header_bytes(orig, n, "x");
  REQUIRE(hb > KVTI_CHUNK_FIXED && hb < n);
  REQUIRE(kvti_chunk_parse(&h, orig, hb, n, "x") == 0);
  uint64_t nblocks = h.n_blocks;
  kvti_chunk_hdr_free(&h);
  CHECK(nblocks >= 1);
  /* Every header byte flipped: parse fails as damage - the version field
   * too: the header still verifies with it read as ours, so it is our file
   * damaged (it used to be KVT_EUNSUPPORTED, which nothing repairs). */
  int bad = 0;
  for (uint32_t i = 0; i < hb; i++) {
    orig[i] ^= 0x40;
    uint32_t hb2 = kvti_chunk_header_bytes(orig, n, "x");
    int rc = hb2 && hb2 <= n ? kvti_chunk_parse(&h, orig, hb2, n, "x")
                             : KVT_ECORRUPT;
    if (rc == 0) {
      kvti_chunk_hdr_free(&h);
      bad++;
      fprintf(stderr, "header byte %u flip accepted\n", i);
    } else if (rc != KVT_ECORRUPT) {
      bad++;
      fprintf(stderr, "header byte %u flip: %s\n", i, kvt_strerror(rc));
    }
    orig[i] ^= 0x40;
  }
  CHECK_EQ_INT(bad, 0);
  /* Another version whose header checksum is its own (a file another kvtier
   * wrote): unsupported, not damage. The checksum's place is where the
   * stored value equals the hash of everything before it. */
  {
    uint8_t *v2 = malloc(hb);
    REQUIRE(v2);
    memcpy(v2, orig, hb);
    size_t at = 0;
    for (size_t pos = KVTI_CHUNK_FIXED; !at && pos + 8 <= hb; pos += 4) {
      uint64_t sv;
      memcpy(&sv, v2 + pos, 8);
      if (sv == XXH3_64bits(v2, pos))
        at = pos;
    }
    REQUIRE(at);
    v2[8] = 2;
    uint64_t sum = XXH3_64bits(v2, at);
    memcpy(v2 + at, &sum, 8);
    CHECK_EQ_INT(kvti_chunk_parse(&h, v2, hb, n, "x"), KVT_EUNSUPPORTED);
    v2[8] = 1; /* back to ours, its checksum now for version 2: damage */
    CHECK_EQ_INT(kvti_chunk_parse(&h, v2, hb, n, "x"), KVT_ECORRUPT);
    free(v2);
  }
  /* Truncation anywhere. */
  for (size_t len = 0; len < n; len += (len < hb + 64 ? 1 : 997)) {
    t_write_all(p, orig, len);
    int fd;
    int rc = kvti_chunk_open(&fd, &h, p, k0, 0);
    CHECK_EQ_INT(rc, KVT_ECORRUPT);
    if (rc == 0) {
      kvti_chunk_hdr_free(&h);
      close(fd);
    }
  }
  /* One flipped data byte per block: the data read fails. */
  uint8_t *data = malloc(n);
  for (uint64_t b = 0; b < nblocks; b++) {
    uint64_t at = hb + b * 65536 + 17;
    if (at >= n)
      at = n - 1;
    orig[at] ^= 1;
    t_write_all(p, orig, n);
    orig[at] ^= 1;
    int fd;
    REQUIRE(kvti_chunk_open(&fd, &h, p, k0, 0) == 0);
    CHECK_EQ_INT(kvti_chunk_read_data(fd, &h, data, p), KVT_ECORRUPT);
    kvti_chunk_hdr_free(&h);
    close(fd);
  }
  /* An extended file. */
  uint8_t *ext = malloc(n + 1);
  memcpy(ext, orig, n);
  ext[n] = 0;
  t_write_all(p, ext, n + 1);
  int fd;
  CHECK_EQ_INT(kvti_chunk_open(&fd, &h, p, k0, 0), KVT_ECORRUPT);
  /* A symlink is refused. */
  char *lnk = t_join(g_dir, "lnk.kvc");
  t_write_all(p, orig, n);
  CHECK(symlink(p, lnk) == 0);
  CHECK(kvti_chunk_open(&fd, &h, lnk, k0, 0) < 0);
  unlink(lnk);
  free(lnk);
  free(ext);
  free(data);
  free(orig);
  free(p);
  free_spill(&s);
}

/* A chunk of at least 1 MiB of data gets a 4096-aligned data section. */
static void test_aligned(void) {
  kvt_rng r = {7};
  spill s;
  make_spill(&s, &r);
  t_layer_free(&s.l[0]);
  s.l[0] = t_kv(&r, KVT_DTYPE_F16, 1, 8, 256, 128, 256);
  int32_t tok[256];
  for (int i = 0; i < 256; i++)
    tok[i] = i * 7;
  kvti_chunk_src c = src_of(&s, s.seed, 0, 256);
  c.tokens = tok;
  c.n_layers = 1;
  char *p = t_join(g_dir, "a.kvc"), *tmp = t_join(g_dir, "a.tmp");
  kvti_chunk_written w;
  REQUIRE(kvti_chunk_write(p, tmp, &c, 0600, 0, &w) == 0);
  const uint8_t *k = w.key;
  int fd;
  kvti_chunk_hdr h;
  REQUIRE(kvti_chunk_open(&fd, &h, p, k, 0) == 0);
  CHECK(h.header_bytes % 4096 == 0);
  CHECK(h.data_bytes >= KVTI_CHUNK_ALIGN_MIN);
  uint8_t *data = malloc(h.data_bytes);
  CHECK(kvti_chunk_read_data(fd, &h, data, p) == 0);
  CHECK(rows_match(&s, &h, data, 0));
  free(data);
  kvti_chunk_hdr_free(&h);
  close(fd);
  free(p);
  free(tmp);
  free_spill(&s);
}

int main(void) {
  g_dir = kvt_test_tmpdir("chunk");
  RUN(test_keys);
  RUN(test_key_vectors);
  RUN(test_roundtrip);
  RUN(test_cuttable);
  RUN(test_corruption);
  RUN(test_aligned);
  return kvt_test_done();
}
