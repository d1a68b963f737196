/*
 * test_chunk_seam.c - the local chunk store behind the chunk-store seam
 * (src/store/chunkstore_seam.c, src/store/chunk_backend.h), the five
 * operations the tier moves chunks with: lookup finds the chain a spill
 * stored; has answers per key (an unknown key is absent); get returns a
 * stored chunk's whole file, which verifies as the chain expects it, and
 * refuses a key it does not store (an orphan file too); remove takes the
 * chunk with everything below it and succeeds on a missing one; put takes a
 * verified chunk back, refuses one whose parent is not stored, and is a no-op
 * for a stored one; a chain copied chunk by chunk from one store into a fresh
 * one through get/verify/put is found whole there; the pure-chain question
 * (kvti_chunk_backend_pure) is answered through the same seam.
 */
#include "fmt_testlib.h"
#include "base/io.h"
#include "index/chain.h"
#include "index/index.h"
#include "store/chunkstore.h"
#include "kvtier_sys.h"

#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define CT 16   /* tokens per chunk */
#define NT 100  /* tokens spilled: 6 full chunks */
#define CHAIN 6 /* NT / CT */

static char *g_root;
static int32_t g_prompt[NT];

/* One store over its own directory: index, chunk store, its seam. */
typedef struct seam_store {
  kvt_index *idx;
  kvti_chunkstore *cs;
  kvti_chunkstore_seam seam;
  kvti_chunk_backend *cb;
} seam_store;

static void seam_open(seam_store *s, const char *tag) {
  char *dir = t_join(g_root, tag);
  REQUIRE(mkdir(dir, 0700) == 0);
  REQUIRE(kvti_index_open(&s->idx, dir, NULL, 0) == 0);
  kvti_chunkstore_opts o = {0600, 0700, 0};
  REQUIRE(kvti_chunkstore_open(&s->cs, dir, s->idx, &o) == 0);
  kvti_chunkstore_seam_init(&s->seam, s->cs);
  s->cb = &s->seam.base;
  free(dir);
}

static void seam_close(seam_store *s) {
  kvti_chunkstore_close(s->cs);
  kvt_index_close(s->idx);
}

/* What the chain expects of chunk i (parent: chunk i-1's key, or the seed
 * the store wrote chunk 0 under). */
static kvti_chunk_expect expect_of(const kvti_chain_rec *r, size_t i) {
  kvti_chunk_expect x;
  memset(&x, 0, sizeof x);
  memcpy(x.key, r[i].key, 32);
  memcpy(x.parent, r[i].parent, 32);
  x.index = i;
  x.n_tokens = CT;
  x.tokens = g_prompt + i * CT;
  x.layout_hash = r[i].layout_hash;
  x.ck = r[i].ck;
  return x;
}

static void has_all(kvti_chunk_backend *cb, const kvti_chain_rec *r,
                    uint8_t *present) {
  uint8_t keys[CHAIN][32];
  for (size_t i = 0; i < CHAIN; i++)
    memcpy(keys[i], r[i].key, 32);
  REQUIRE(cb->ops->has(cb, (const uint8_t(*)[32])keys, CHAIN, 0, present) == 0);
}

static void test_local_seam(void) {
  seam_store a;
  seam_open(&a, "a");
  CHECK(strcmp(a.cb->ops->name, "local") == 0);
  kvt_rng rng = {7};
  kvt_layer kv = t_kv(&rng, KVT_DTYPE_F16, 1, 2, NT, 8, NT);
  uint32_t ids[1] = {0};
  kvti_chunkstore_spill sp = {NULL, 0, g_prompt, NT, CT, &kv, ids, 1, 1};
  kvti_chunkstore_result res;
  REQUIRE(kvti_chunkstore_put(a.cs, &sp, &res) == 0);
  REQUIRE(res.chunks == CHAIN);

  /* lookup: the whole chain, pure (one KV layer, the whole spill). */
  kvti_chain_rec r[CHAIN + 2];
  size_t m = 0;
  REQUIRE(a.cb->ops->lookup(a.cb, NULL, 0, g_prompt, NT, CT, r, CHAIN + 2,
                            &m) == 0);
  REQUIRE(m == CHAIN);
  CHECK(memcmp(r[CHAIN - 1].key, res.last_key, 32) == 0);
  kvti_chain_rec *pr = NULL;
  size_t pm = 0;
  CHECK(kvti_chunk_backend_pure(a.cb, NULL, 0, g_prompt, NT, CT, &pr, &pm) ==
        0);
  CHECK_EQ_INT(pm, CHAIN);
  CHECK(pr && memcmp(pr[0].key, r[0].key, 32) == 0);
  kvti_free(pr);

  /* has: every stored key, and not a key never stored. */
  uint8_t present[CHAIN];
  has_all(a.cb, r, present);
  for (size_t i = 0; i < CHAIN; i++)
    CHECK_EQ_INT(present[i], 1);
  uint8_t unknown[1][32];
  memset(unknown[0], 0xab, 32);
  uint8_t p1 = 1;
  CHECK(a.cb->ops->has(a.cb, (const uint8_t(*)[32])unknown, 1, 1, &p1) == 0);
  CHECK_EQ_INT(p1, 0);

  /* get: the whole file, verifying as the chain expects; the record it
   * yields is the stored row. */
  void *bytes[CHAIN] = {NULL};
  size_t len[CHAIN] = {0};
  kvti_chain_rec vr[CHAIN];
  for (size_t i = 0; i < CHAIN; i++) {
    REQUIRE(a.cb->ops->get(a.cb, r[i].key, &bytes[i], &len[i]) == 0);
    CHECK_EQ_INT(len[i], r[i].disk_bytes);
    kvti_chunk_expect x = expect_of(r, i);
    REQUIRE(kvti_chunk_verify_bytes(bytes[i], len[i], &x, &vr[i]) == 0);
    CHECK(memcmp(vr[i].key, r[i].key, 32) == 0);
    CHECK_EQ_INT(vr[i].mem_bytes, r[i].mem_bytes);
    CHECK_EQ_INT(vr[i].pure, r[i].pure);
  }
  void *nob = NULL;
  size_t nol = 0;
  CHECK_EQ_INT(a.cb->ops->get(a.cb, unknown[0], &nob, &nol), KVT_ENOTFOUND);
  CHECK(nob == NULL);

  /* remove: chunk 3 and the chunks below it; 0..2 stay. Again: success. */
  REQUIRE(a.cb->ops->remove(a.cb, r[3].key) == 0);
  has_all(a.cb, r, present);
  for (size_t i = 0; i < CHAIN; i++)
    CHECK_EQ_INT(present[i], i < 3);
  CHECK_EQ_INT(a.cb->ops->remove(a.cb, r[3].key), 0);
  CHECK_EQ_INT(a.cb->ops->get(a.cb, r[4].key, &nob, &nol), KVT_ENOTFOUND);

  /* put: chunk 5 under a missing parent is refused; 3, 4, 5 in chain order
   * are taken back; a stored one again is a no-op. */
  CHECK_EQ_INT(a.cb->ops->put(a.cb, &vr[5], bytes[5], len[5]), KVT_EINVAL);
  for (size_t i = 3; i < CHAIN; i++)
    REQUIRE(a.cb->ops->put(a.cb, &vr[i], bytes[i], len[i]) == 0);
  CHECK(a.cb->ops->put(a.cb, &vr[0], bytes[0], len[0]) == 0);
  has_all(a.cb, r, present);
  for (size_t i = 0; i < CHAIN; i++)
    CHECK_EQ_INT(present[i], 1);

  /* A chain copied into a fresh store through the seam alone. */
  seam_store b;
  seam_open(&b, "b");
  has_all(b.cb, r, present);
  for (size_t i = 0; i < CHAIN; i++) {
    CHECK_EQ_INT(present[i], 0);
    void *cb_bytes = NULL;
    size_t cb_len = 0;
    REQUIRE(a.cb->ops->get(a.cb, r[i].key, &cb_bytes, &cb_len) == 0);
    kvti_chunk_expect x = expect_of(r, i);
    kvti_chain_rec got;
    REQUIRE(kvti_chunk_verify_bytes(cb_bytes, cb_len, &x, &got) == 0);
    REQUIRE(b.cb->ops->put(b.cb, &got, cb_bytes, cb_len) == 0);
    kvti_free(cb_bytes);
  }
  kvti_chain_rec rb[CHAIN];
  size_t mb = 0;
  CHECK(b.cb->ops->lookup(b.cb, NULL, 0, g_prompt, NT, CT, rb, CHAIN, &mb) ==
        0);
  CHECK_EQ_INT(mb, CHAIN);
  CHECK(memcmp(rb[CHAIN - 1].key, r[CHAIN - 1].key, 32) == 0);
  /* A file without its row (an orphan: rows go first) is not stored. */
  kvti_chain_rec *gone = NULL;
  size_t ngone = 0;
  REQUIRE(kvti_chains_remove_tree(kvti_chunkstore_chains(b.cs), r[5].key, &gone,
                                  &ngone) == 0);
  CHECK_EQ_INT(ngone, 1);
  kvti_free(gone);
  CHECK_EQ_INT(b.cb->ops->get(b.cb, r[5].key, &nob, &nol), KVT_ENOTFOUND);
  CHECK(nob == NULL);
  seam_close(&b);

  for (size_t i = 0; i < CHAIN; i++)
    kvti_free(bytes[i]);
  t_layer_free(&kv);
  seam_close(&a);
}

int main(void) {
  g_root = kvt_test_tmpdir("chunkseam");
  kvt_rng rng = {3};
  for (int i = 0; i < NT; i++)
    g_prompt[i] = (int32_t)(kvt_rng_next(&rng) % 32000);
  RUN(test_local_seam);
  return kvt_test_done();
}
