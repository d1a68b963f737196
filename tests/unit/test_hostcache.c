/*
 * test_hostcache.c - unit tests for the host RAM cache's records
 * (tier/hostcache.h), independent of a tier: put/take/give-back/lend life
 * cycles and their counters, the byte bound respected after every operation of
 * a seeded random workload (and charged to the buffer pool), a lowered bound
 * and a trim shrinking the cache before the call returns, invalidation of
 * resident and lent records (a stale lent copy never comes back), chain tags
 * (a removed chunk drops the records through it), the lent
 * record cap, a closed cache, concurrent use, the cgroup-limit parser of
 * the default bound on generated files, and chunk records: each key held
 * once, a pinned chunk dropped meanwhile still readable until its unpin
 * frees it, puts after an invalidation (an older epoch) refused, tails given
 * back only under their lend id, and the shared LRU and bound over tails and
 * chunks.
 */
#include "testutil.h"
#include "base/bufpool.h"
#include "base/error.h"
#include "base/io.h"
#include "format/dtype.h"
#include "tier/hostcache.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

/* A one-layer KV item of two tensors of nb bytes each, filled with seed. */
static kvti_hc_item make_item(uint64_t nb, unsigned seed) {
  kvti_hc_item it;
  memset(&it, 0, sizeof it);
  it.layers = kvti_calloc(1, sizeof(kvt_layer));
  REQUIRE(it.layers);
  it.n_layers = 1;
  kvt_layer *l = &it.layers[0];
  l->kind = KVT_LAYER_KV;
  l->num_tensors = 2;
  l->tensors = kvti_calloc(2, sizeof(kvt_tensor));
  REQUIRE(l->tensors);
  for (int j = 0; j < 2; j++) {
    kvt_tensor *t = &l->tensors[j];
    t->dtype = KVT_DTYPE_U8;
    t->ndim = 1;
    t->shape[0] = (int64_t)nb;
    t->nbytes = nb;
    t->data = kvti_buf_alloc((size_t)nb);
    REQUIRE(t->data);
    memset(t->data, (int)(seed + (unsigned)j), (size_t)nb);
  }
  it.memory_bytes = 2 * nb;
  it.disk_bytes = 2 * nb + 100;
  it.storage_mode = KVT_STORAGE_NATIVE;
  return it;
}

static void hash_of(char out[KVT_HASH_HEX_LEN + 1], unsigned i) {
  int32_t tok = (int32_t)i;
  REQUIRE(kvt_token_hash(out, &tok, 1) == 0);
}

static int item_is(const kvti_hc_item *it, uint64_t nb, unsigned seed) {
  if (!it->layers || it->n_layers != 1)
    return 0;
  for (int j = 0; j < 2; j++) {
    const unsigned char *p = it->layers[0].tensors[j].data;
    if (it->layers[0].tensors[j].nbytes != nb ||
        p[0] != (unsigned char)(seed + j) ||
        p[nb - 1] != (unsigned char)(seed + j))
      return 0;
  }
  return 1;
}

static void test_life_cycle(void) {
  kvti_hcache *c = NULL;
  REQUIRE(kvti_hc_create(&c, (uint64_t)64 << 20, NULL) == 0);
  char h[KVT_HASH_HEX_LEN + 1], h2[KVT_HASH_HEX_LEN + 1];
  hash_of(h, 1);
  hash_of(h2, 2);
  kvti_hc_item it = make_item(1 << 20, 7), got;
  uint64_t id = 0, id2 = 0;
  CHECK_EQ_INT(kvti_hc_take(c, h, &got, &id), 0); /* empty: miss */
  CHECK_EQ_INT(kvti_hc_put(c, h, &it), 1);
  kvti_hc_stats st;
  kvti_hc_get_stats(c, &st);
  CHECK_EQ_INT(st.resident, 1);
  CHECK(st.used >= (2u << 20) &&
        st.used <= 2 * kvti_bufpool_class((1u << 20) + 4096) + 4096);
  CHECK_EQ_INT(kvti_hc_take(c, h2, &got, &id), 0); /* other entry: miss */
  REQUIRE(kvti_hc_take(c, h, &got, &id) == 1);
  CHECK(item_is(&got, 1 << 20, 7));
  CHECK_EQ_INT(got.memory_bytes, 2u << 20);
  CHECK_EQ_INT(got.disk_bytes, (2u << 20) + 100);
  kvti_hc_get_stats(c, &st);
  CHECK_EQ_INT(st.used, 0); /* lent bytes are the caller's */
  CHECK_EQ_INT(st.lent, 1);
  CHECK_EQ_INT(st.hits, 1);
  CHECK_EQ_INT(st.misses, 2);
  /* While lent, a second take misses (the copy is out). */
  kvti_hc_item none;
  CHECK_EQ_INT(kvti_hc_take(c, h, &none, &id2), 0);
  /* Given back with the right id: resident again, and taken again. */
  CHECK_EQ_INT(kvti_hc_give_back(c, h, id, &got), 1);
  REQUIRE(kvti_hc_take(c, h, &got, &id) == 1);
  CHECK(item_is(&got, 1 << 20, 7));
  /* A wrong id is refused (freed). */
  kvti_hc_item other = make_item(4096, 1);
  CHECK_EQ_INT(kvti_hc_give_back(c, h, id + 100, &other), 0);
  CHECK(other.layers == NULL);
  /* forget: the record goes; a later give-back of that id is freed. */
  kvti_hc_forget(c, h, id, 1);
  kvti_hc_get_stats(c, &st);
  CHECK_EQ_INT(st.verify_failures, 1);
  CHECK_EQ_INT(st.hits, 1); /* the verified-failed take is not a hit */
  CHECK_EQ_INT(st.lent, 0);
  CHECK_EQ_INT(kvti_hc_give_back(c, h, id, &got), 0);
  /* lend (an entry read from disk), then its buffers come back. */
  REQUIRE(kvti_hc_lend(c, h2, &id2) == 1);
  kvti_hc_item disk = make_item(1 << 20, 9);
  CHECK_EQ_INT(kvti_hc_give_back(c, h2, id2, &disk), 1);
  REQUIRE(kvti_hc_take(c, h2, &got, &id2) == 1);
  CHECK(item_is(&got, 1 << 20, 9));
  /* lend while lent: the latest copy wins. */
  uint64_t id3 = 0;
  REQUIRE(kvti_hc_lend(c, h2, &id3) == 1);
  CHECK(id3 != id2);
  kvti_hc_item late = make_item(1 << 20, 11);
  CHECK_EQ_INT(kvti_hc_give_back(c, h2, id2, &got), 0);
  CHECK_EQ_INT(kvti_hc_give_back(c, h2, id3, &late), 1);
  /* lend on a resident record: refused (the resident copy stays). */
  CHECK_EQ_INT(kvti_hc_lend(c, h2, &id3), 0);
  kvti_hc_release(c);
}

static void test_invalidate(void) {
  kvti_hcache *c = NULL;
  REQUIRE(kvti_hc_create(&c, (uint64_t)64 << 20, NULL) == 0);
  char h[KVT_HASH_HEX_LEN + 1];
  hash_of(h, 3);
  kvti_hc_item it = make_item(1 << 20, 1), got;
  uint64_t id;
  REQUIRE(kvti_hc_put(c, h, &it) == 1);
  kvti_hc_invalidate(c, h); /* resident: dropped */
  CHECK_EQ_INT(kvti_hc_take(c, h, &got, &id), 0);
  it = make_item(1 << 20, 2);
  REQUIRE(kvti_hc_put(c, h, &it) == 1);
  REQUIRE(kvti_hc_take(c, h, &got, &id) == 1);
  kvti_hc_invalidate(c, h); /* lent: the old copy must not come back */
  CHECK_EQ_INT(kvti_hc_give_back(c, h, id, &got), 0);
  CHECK_EQ_INT(kvti_hc_take(c, h, &got, &id), 0);
  /* A put replaces a lent version too. */
  it = make_item(1 << 20, 3);
  REQUIRE(kvti_hc_put(c, h, &it) == 1);
  REQUIRE(kvti_hc_take(c, h, &got, &id) == 1);
  kvti_hc_item nv = make_item(1 << 20, 4);
  REQUIRE(kvti_hc_put(c, h, &nv) == 1);
  CHECK_EQ_INT(kvti_hc_give_back(c, h, id, &got), 0);
  REQUIRE(kvti_hc_take(c, h, &got, &id) == 1);
  CHECK(item_is(&got, 1 << 20, 4));
  kvti_hc_item_free(&got);
  kvti_hc_stats st;
  kvti_hc_get_stats(c, &st);
  CHECK_EQ_INT(st.invalidations, 2);
  kvti_hc_release(c);
}

/* Seeded random puts/takes/give-backs/invalidations: after every operation the
 * resident bytes are within the bound and equal what the pool was charged. */
static void test_bound_respected(void) {
  kvti_bufpool *pool = NULL;
  REQUIRE(kvti_bufpool_create(&pool, (uint64_t)64 << 20) == 0);
  kvti_hcache *c = NULL;
  const uint64_t bound = (uint64_t)12 << 20;
  REQUIRE(kvti_hc_create(&c, bound, pool) == 0);
  kvt_rng rng = {42};
  struct {
    int out;
    uint64_t id;
    kvti_hc_item it;
  } held[16];
  memset(held, 0, sizeof held);
  int violations = 0, charge_mismatch = 0;
  for (int step = 0; step < 2000; step++) {
    unsigned k = (unsigned)(kvt_rng_next(&rng) % 16);
    char h[KVT_HASH_HEX_LEN + 1];
    hash_of(h, k);
    unsigned op = (unsigned)(kvt_rng_next(&rng) % 4);
    if (op == 0 && !held[k].out) {
      uint64_t nb = 4096 + kvt_rng_next(&rng) % (3u << 20);
      kvti_hc_item it = make_item(nb, k);
      kvti_hc_put(c, h, &it);
    } else if (op == 1 && !held[k].out) {
      if (kvti_hc_take(c, h, &held[k].it, &held[k].id))
        held[k].out = 1;
    } else if (op == 2 && held[k].out) {
      kvti_hc_give_back(c, h, held[k].id, &held[k].it);
      held[k].out = 0;
    } else if (op == 3) {
      kvti_hc_invalidate(c, h);
    }
    kvti_hc_stats st;
    kvti_bufpool_stats ps;
    kvti_hc_get_stats(c, &st);
    kvti_bufpool_get_stats(pool, &ps);
    violations += st.used > bound;
    charge_mismatch += ps.charged != st.used;
  }
  CHECK_EQ_INT(violations, 0);
  CHECK_EQ_INT(charge_mismatch, 0);
  kvti_hc_stats st;
  kvti_hc_get_stats(c, &st);
  CHECK(st.evictions > 0); /* the workload did exceed the bound */
  CHECK(st.hits > 0 && st.returns > 0);
  for (int k = 0; k < 16; k++)
    if (held[k].out)
      kvti_hc_item_free(&held[k].it);
  kvti_hc_release(c);
  kvti_bufpool_stats ps;
  kvti_bufpool_get_stats(pool, &ps);
  CHECK_EQ_INT(ps.charged, 0);
  kvti_bufpool_release(pool);
}

/* Pressure: lowering the bound or trimming shrinks the cache before the call
 * returns (the stated time: synchronously), oldest first. */
static void test_shrink(void) {
  kvti_hcache *c = NULL;
  REQUIRE(kvti_hc_create(&c, (uint64_t)64 << 20, NULL) == 0);
  char h[8][KVT_HASH_HEX_LEN + 1];
  for (unsigned i = 0; i < 8; i++) {
    hash_of(h[i], 100 + i);
    kvti_hc_item it = make_item(2 << 20, i);
    REQUIRE(kvti_hc_put(c, h[i], &it) == 1);
  }
  kvti_hc_stats st;
  kvti_hc_get_stats(c, &st);
  CHECK_EQ_INT(st.resident, 8);
  uint64_t one = st.used / 8;
  kvti_hc_set_bound(c, 3 * one);
  kvti_hc_get_stats(c, &st);
  CHECK(st.used <= 3 * one);
  CHECK_EQ_INT(st.resident, 3);
  CHECK_EQ_INT(st.bound, 3 * one);
  kvti_hc_item got;
  uint64_t id;
  CHECK_EQ_INT(kvti_hc_take(c, h[0], &got, &id), 0); /* oldest went first */
  REQUIRE(kvti_hc_take(c, h[7], &got, &id) == 1);
  CHECK_EQ_INT(kvti_hc_give_back(c, h[7], id, &got), 1); /* now youngest */
  CHECK_EQ_INT(kvti_hc_trim(c, one), 2 * one);
  kvti_hc_get_stats(c, &st);
  CHECK_EQ_INT(st.resident, 1);
  CHECK(kvti_hc_take(c, h[7], &got, &id) == 1);
  /* Larger than the bound: refused at give-back, and a put refuses it too. */
  kvti_hc_set_bound(c, 4096);
  CHECK_EQ_INT(kvti_hc_give_back(c, h[7], id, &got), 0);
  kvti_hc_item big = make_item(1 << 20, 1);
  CHECK_EQ_INT(kvti_hc_put(c, h[1], &big), 0);
  kvti_hc_set_bound(c, 0); /* disabled: takes neither hit nor count */
  kvti_hc_get_stats(c, &st);
  uint64_t misses = st.misses;
  CHECK_EQ_INT(kvti_hc_take(c, h[7], &got, &id), 0);
  kvti_hc_get_stats(c, &st);
  CHECK_EQ_INT(st.misses, misses);
  CHECK_EQ_INT(st.used, 0);
  kvti_hc_release(c);
}

static void test_lent_cap_and_close(void) {
  kvti_hcache *c = NULL;
  REQUIRE(kvti_hc_create(&c, (uint64_t)64 << 20, NULL) == 0);
  uint64_t first = 0, id = 0;
  char h[KVT_HASH_HEX_LEN + 1];
  for (unsigned i = 0; i < KVTI_HC_MAX_LENT + 10; i++) {
    hash_of(h, 1000 + i);
    REQUIRE(kvti_hc_lend(c, h, &id) == 1);
    if (i == 0)
      first = id;
  }
  kvti_hc_stats st;
  kvti_hc_get_stats(c, &st);
  CHECK_EQ_INT(st.lent, KVTI_HC_MAX_LENT);
  hash_of(h, 1000);
  kvti_hc_item it = make_item(4096, 1);
  CHECK_EQ_INT(kvti_hc_give_back(c, h, first, &it), 0); /* forgotten */
  /* Closed: a lent entry given back afterwards is freed; the reference it
   * holds keeps the cache alive until then. */
  hash_of(h, 1000 + KVTI_HC_MAX_LENT + 9);
  kvti_hc_retain(c);
  kvti_hc_close(c);
  kvti_hc_release(c);
  it = make_item(4096, 2);
  CHECK_EQ_INT(kvti_hc_give_back(c, h, id, &it), 0);
  it = make_item(4096, 3);
  CHECK_EQ_INT(kvti_hc_put(c, h, &it), 0);
  kvti_hc_get_stats(c, &st);
  CHECK_EQ_INT(st.lent + st.resident, 0);
  kvti_hc_release(c);
}

typedef struct thr_arg {
  kvti_hcache *c;
  unsigned seed;
} thr_arg;

static void *worker(void *arg) {
  thr_arg *a = arg;
  kvt_rng rng = {a->seed};
  for (int i = 0; i < 3000; i++) {
    char h[KVT_HASH_HEX_LEN + 1];
    hash_of(h, (unsigned)(kvt_rng_next(&rng) % 8));
    kvti_hc_item it;
    uint64_t id;
    switch (kvt_rng_next(&rng) % 4) {
    case 0:
      it = make_item(8192 + kvt_rng_next(&rng) % 100000, 5);
      kvti_hc_put(a->c, h, &it);
      break;
    case 1:
      if (kvti_hc_take(a->c, h, &it, &id))
        kvti_hc_give_back(a->c, h, id, &it);
      break;
    case 2:
      if (kvti_hc_lend(a->c, h, &id)) {
        it = make_item(8192, 6);
        kvti_hc_give_back(a->c, h, id, &it);
      }
      break;
    default:
      kvti_hc_invalidate(a->c, h);
    }
  }
  return NULL;
}

static void test_threads(void) {
  kvti_hcache *c = NULL;
  REQUIRE(kvti_hc_create(&c, 400000, kvti_bufpool_default()) == 0);
  pthread_t th[3];
  thr_arg a[3];
  for (int i = 0; i < 3; i++) {
    a[i].c = c;
    a[i].seed = 77u + (unsigned)i;
    REQUIRE(pthread_create(&th[i], NULL, worker, &a[i]) == 0);
  }
  for (int i = 0; i < 3; i++)
    pthread_join(th[i], NULL);
  kvti_hc_stats st;
  kvti_hc_get_stats(c, &st);
  CHECK(st.used <= 400000);
  CHECK(st.inserts > 0);
  kvti_hc_release(c);
}

static void write_text(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  REQUIRE(f);
  fputs(text, f);
  fclose(f);
}

static void test_memory_limit(void) {
  char *d = kvt_test_tmpdir("hcache");
  char v2[512], v1[512];
  snprintf(v2, sizeof v2, "%s/memory.max", d);
  snprintf(v1, sizeof v1, "%s/memory.limit_in_bytes", d);
  const uint64_t phys = (uint64_t)16 << 30;
  CHECK(kvti_hc_memory_limit(v2, v1, phys) == phys); /* no files */
  write_text(v2, "max\n");
  CHECK(kvti_hc_memory_limit(v2, v1, phys) == phys);
  write_text(v2, "4294967296\n");
  CHECK(kvti_hc_memory_limit(v2, v1, phys) == ((uint64_t)4 << 30));
  write_text(v1, "9223372036854771712\n"); /* v1 "unlimited" */
  CHECK(kvti_hc_memory_limit(v2, v1, phys) == ((uint64_t)4 << 30));
  write_text(v1, "1073741824\n");
  CHECK(kvti_hc_memory_limit(v2, v1, phys) == ((uint64_t)1 << 30));
  write_text(v2, "garbage");
  write_text(v1, "");
  CHECK(kvti_hc_memory_limit(v2, v1, phys) == phys);
  CHECK(kvti_hc_memory_limit(NULL, NULL, 0) == 0);
  uint64_t def = kvti_hc_default_bytes();
  CHECK(def > 0);
  long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
  if (pages > 0 && psz > 0)
    CHECK(def <= (uint64_t)pages * (uint64_t)psz / 8);
}

/* Chain tags (chunked native store): removing a chunk drops every record
 * tagged with it - resident (from a put) or lent (from a lend or a take),
 * the tag surviving a take and a give-back - and nothing else. */
static void test_chain_tags(void) {
  kvti_hcache *c = NULL;
  REQUIRE(kvti_hc_create(&c, (uint64_t)64 << 20, NULL) == 0);
  char h[4][KVT_HASH_HEX_LEN + 1];
  for (unsigned i = 0; i < 4; i++)
    hash_of(h[i], 40 + i);
  /* Two keys that share their first 8 bytes (one map slot key). */
  uint8_t k1[32], k2[32];
  memset(k1, 0x11, sizeof k1);
  memcpy(k2, k1, sizeof k2);
  k2[31] = 0x22;
  kvti_hc_item a = make_item(4096, 1), b = make_item(4096, 2),
               u = make_item(4096, 3), got;
  a.has_chain = 1;
  memcpy(a.chain, k1, 32);
  b.has_chain = 1;
  memcpy(b.chain, k2, 32);
  REQUIRE(kvti_hc_put(c, h[0], &a) == 1); /* tagged k1 */
  REQUIRE(kvti_hc_put(c, h[1], &b) == 1); /* tagged k2 */
  REQUIRE(kvti_hc_put(c, h[2], &u) == 1); /* untagged */
  uint64_t id = 0, lid = 0;
  REQUIRE(kvti_hc_lend_chain(c, h[3], k1, &lid) == 1); /* lent, tagged k1 */
  CHECK(kvti_hc_resident(c, h[0]) && !kvti_hc_resident(c, h[3]));
  /* The tag survives a take and a give-back. */
  REQUIRE(kvti_hc_take(c, h[0], &got, &id) == 1);
  CHECK(got.has_chain && memcmp(got.chain, k1, 32) == 0);
  REQUIRE(kvti_hc_give_back(c, h[0], id, &got) == 1);
  /* Removing k1 (and an unrelated key): h0 and the lent h3 go, h1 (same map
   * slot key, other chunk) and the untagged h2 stay. */
  uint8_t keys[2][32];
  memset(keys[0], 0x77, 32);
  memcpy(keys[1], k1, 32);
  CHECK_EQ_INT(kvti_hc_invalidate_chains(c, keys[0], 32, 2), 2);
  CHECK(!kvti_hc_resident(c, h[0]));
  CHECK(kvti_hc_resident(c, h[1]) && kvti_hc_resident(c, h[2]));
  kvti_hc_item late = make_item(4096, 4);
  CHECK_EQ_INT(kvti_hc_give_back(c, h[3], lid, &late), 0); /* not admitted */
  kvti_hc_stats st;
  kvti_hc_get_stats(c, &st);
  CHECK_EQ_INT(st.resident, 2);
  CHECK_EQ_INT(st.lent, 0);
  CHECK_EQ_INT(st.invalidations, 2);
  /* A lent record re-lent with another tag is found by the new one only. */
  REQUIRE(kvti_hc_take(c, h[1], &got, &id) == 1);
  REQUIRE(kvti_hc_lend_chain(c, h[1], k1, &lid) == 1);
  CHECK_EQ_INT(kvti_hc_invalidate_chains(c, k2, 32, 1), 0);
  CHECK_EQ_INT(kvti_hc_invalidate_chains(c, k1, 32, 1), 1);
  CHECK_EQ_INT(kvti_hc_give_back(c, h[1], lid, &got), 0);
  kvti_hc_release(c);
}

/* A one-layer chunk of nb data bytes filled with seed, key derived from it. */
static kvti_hc_chunk *make_chunk(uint64_t nb, unsigned seed) {
  kvti_hc_chunk *ch = kvti_calloc(1, sizeof *ch);
  REQUIRE(ch);
  memset(ch->key, (int)seed, 32);
  ch->n_tokens = 16;
  ch->n_layers = ch->spill_layers = 1;
  ch->layers = kvti_calloc(1, sizeof *ch->layers);
  REQUIRE(ch->layers);
  ch->layers[0].kind = KVT_LAYER_KV;
  ch->layers[0].num_tensors = 1;
  ch->layers[0].tensors = kvti_calloc(1, sizeof(kvti_chunk_tensor));
  REQUIRE(ch->layers[0].tensors);
  ch->layers[0].tensors[0].nbytes = nb;
  ch->data_bytes = nb;
  ch->data = kvti_malloc((size_t)nb);
  REQUIRE(ch->data);
  memset(ch->data, (int)seed, (size_t)nb);
  return ch;
}

static void test_chunks(void) {
  kvti_hcache *c = NULL;
  uint64_t nb = 100000;
  REQUIRE(kvti_hc_create(&c, (uint64_t)64 << 20, NULL) == 0);
  kvti_hc_chunk *chs[3] = {make_chunk(nb, 1), make_chunk(nb, 2),
                           make_chunk(nb, 1)}; /* the third: a duplicate */
  uint64_t one = kvti_hc_chunk_bytes(chs[0]);
  CHECK(one >= nb && one < nb + 1024);
  CHECK_EQ_INT(kvti_hc_put_chunks(c, chs, 3, kvti_hc_epoch(c)), 2);
  CHECK(!chs[0] && !chs[1] && !chs[2]); /* ownership passed, dup freed */
  kvti_hc_stats st;
  kvti_hc_get_stats(c, &st);
  CHECK_EQ_INT(st.chunks, 2);
  CHECK_EQ_INT(st.used, 2 * one);
  CHECK_EQ_INT(st.chunk_bytes, 2 * one);
  CHECK_EQ_INT(st.resident, 0); /* chunks are not entries */
  uint8_t keys[3][32], have[3];
  for (int i = 0; i < 3; i++)
    memset(keys[i], i + 1, 32);
  CHECK_EQ_INT(kvti_hc_chunks_resident(c, keys[0], 32, 3, have), 2);
  CHECK(have[0] && have[1] && !have[2]);
  /* Pinned, then invalidated: gone from the cache at once, readable until
   * unpinned (ASan: no use after free), freed by the unpin. */
  kvti_hc_ref *refs[3];
  CHECK_EQ_INT(kvti_hc_pin_chunks(c, keys[0], 32, 3, refs), 2);
  CHECK(refs[2] == NULL);
  const kvti_hc_chunk *p0 = kvti_hc_ref_chunk(refs[0]);
  REQUIRE(p0);
  uint64_t e0 = kvti_hc_epoch(c);
  CHECK_EQ_INT(kvti_hc_invalidate_chains(c, keys[0], 32, 1), 0);
  kvti_hc_get_stats(c, &st);
  CHECK_EQ_INT(st.chunks, 1);
  CHECK_EQ_INT(st.used, one);
  CHECK(p0->data[0] == 1 && p0->data[nb - 1] == 1);
  kvti_hc_unpin(c, refs, 3);
  CHECK(refs[0] == NULL && refs[1] == NULL);
  /* A chunk read before that invalidation is refused (epoch e0). */
  kvti_hc_chunk *late[1] = {make_chunk(nb, 1)};
  CHECK(kvti_hc_epoch(c) != e0);
  CHECK_EQ_INT(kvti_hc_put_chunks(c, late, 1, e0), 0);
  CHECK(late[0] == NULL);
  kvti_hc_get_stats(c, &st);
  CHECK_EQ_INT(st.chunks, 1);
  /* A tail over chunks 1 and 3: put with its new chunk; pinned; a tail is
   * never taken as a whole entry. */
  char h[KVT_HASH_HEX_LEN + 1];
  hash_of(h, 7);
  kvti_hc_item tail = make_item(5000, 9);
  tail.has_chain = 1;
  memset(tail.chain, 3, 32);
  kvti_hc_chunk *more[2] = {NULL, make_chunk(nb, 3)};
  CHECK_EQ_INT(kvti_hc_put_tail(c, h, &tail, more, 2, kvti_hc_epoch(c)), 1);
  kvti_hc_get_stats(c, &st);
  CHECK_EQ_INT(st.resident, 1);
  CHECK_EQ_INT(st.chunks, 2);
  kvti_hc_item got;
  uint64_t id = 0;
  CHECK_EQ_INT(kvti_hc_take(c, h, &got, &id), 0);
  CHECK_EQ_INT(kvti_hc_resident(c, h), 0);
  kvti_hc_ref *tref = NULL;
  const kvti_hc_item *tp = NULL;
  REQUIRE(kvti_hc_pin_tail(c, h, &tref, &tp) == 1);
  CHECK(item_is(tp, 5000, 9));
  kvti_hc_unpin(c, &tref, 1);
  /* Removing chunk 3 (the tail's last) drops the tail and chunk 3. */
  CHECK_EQ_INT(kvti_hc_invalidate_chains(c, keys[2], 32, 1), 1);
  kvti_hc_get_stats(c, &st);
  CHECK_EQ_INT(st.resident, 0);
  CHECK_EQ_INT(st.chunks, 1);
  CHECK_EQ_INT(kvti_hc_pin_tail(c, h, &tref, &tp), 0);
  /* A lent record gives back tail + chunks only under its lend id. */
  uint8_t k3[32];
  memset(k3, 3, 32);
  REQUIRE(kvti_hc_lend_chain(c, h, k3, &id) == 1);
  tail = make_item(5000, 9);
  tail.has_chain = 1;
  memcpy(tail.chain, k3, 32);
  kvti_hc_chunk *back[1] = {make_chunk(nb, 3)};
  CHECK_EQ_INT(kvti_hc_give_back_tail(c, h, id + 1, &tail, back, 1), 0);
  kvti_hc_get_stats(c, &st);
  CHECK_EQ_INT(st.resident, 0);
  CHECK_EQ_INT(st.chunks, 1);
  REQUIRE(kvti_hc_lend_chain(c, h, k3, &id) == 1);
  tail = make_item(5000, 9);
  tail.has_chain = 1;
  memcpy(tail.chain, k3, 32);
  back[0] = make_chunk(nb, 3);
  CHECK_EQ_INT(kvti_hc_give_back_tail(c, h, id, &tail, back, 1), 1);
  kvti_hc_get_stats(c, &st);
  CHECK_EQ_INT(st.resident, 1);
  CHECK_EQ_INT(st.chunks, 2);
  /* One LRU and one bound: room for the tail and one chunk. Chunk 3 is
   * touched (a use of the tail's chain), so chunk 2 is the oldest and goes
   * first. */
  CHECK_EQ_INT(kvti_hc_chunks_resident(c, k3, 32, 1, have), 1);
  uint64_t tb = st.used - 2 * one;
  kvti_hc_set_bound(c, tb + one);
  kvti_hc_get_stats(c, &st);
  CHECK(st.used <= tb + one);
  CHECK_EQ_INT(st.chunks, 1);
  CHECK_EQ_INT(kvti_hc_chunks_resident(c, keys[2], 32, 1, have), 1);
  /* A verification failure drops the tail and its chunks. */
  kvti_hc_drop_chain(c, h, keys[2], 32, 1);
  kvti_hc_count(c, 0, 1);
  kvti_hc_get_stats(c, &st);
  CHECK_EQ_INT(st.used, 0);
  CHECK_EQ_INT(st.verify_failures, 1);
  kvti_hc_close(c);
  kvti_hc_release(c);
}

int main(void) {
  RUN(test_life_cycle);
  RUN(test_invalidate);
  RUN(test_chain_tags);
  RUN(test_bound_respected);
  RUN(test_shrink);
  RUN(test_lent_cap_and_close);
  RUN(test_threads);
  RUN(test_memory_limit);
  RUN(test_chunks);
  return kvt_test_done();
}
