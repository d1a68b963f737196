/*
 * test_ram_tier_chunked.c - the host RAM tier over the chunked native store
 * (chunk_tokens set; public API only), which holds a chained entry as its
 * tail plus its chain's chunks, each chunk once: a chained entry (chain +
 * tail) spilled in copy mode is promoted and read (kvt_tier_read_entry) from
 * RAM, bit for bit, also into caller buffers; a copy served from RAM is the
 * caller's own (altering it changes nothing cached); a disk read's buffers
 * altered before they are freed (given back to RAM) - in a chunk's rows or
 * in the tail's - fail the check and the disk is read; a replaced entry is
 * served in its new version; a chunk-aligned prefix no spill ended at is
 * served from the chunks a spill left in RAM (read_entry and a PREFIX
 * promote); removing the entries leaves the chunks (their chain is still
 * stored), evicting a leaf chunk drops exactly it from RAM; a quarantined
 * chunk drops every cached tail and chunk through it, lent disk reads
 * included (also when kvt_tier_chunk_verify repairs); a damaged chunk header
 * makes the RAM copy fail its check; reads of a cached prefix racing with
 * evictions of its chain return it whole or nothing; an entry stored as its
 * chain record alone (length a multiple of chunk_tokens) is served from RAM
 * too. No timings are asserted.
 */
#include "tier/ramtier.h"
#include "tier_testlib.h"
#include "kvtier_sys.h"

#define C 16
#define D 8
#define NL 2

/* After the RAM tier's cutter is done (kvt_tier_flush waits for it): freed
 * disk reads are then in RAM as tails and chunks. */
static kvt_stats stats_of(kvt_tier *t) {
  kvt_stats s = KVT_STATS_INIT;
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  REQUIRE(kvt_tier_stats(&s, t) == 0);
  return s;
}

#define MODEL "ram-chunked"

static kvt_tier *open_dir(const char *dir, uint64_t host_bytes) {
  kvt_options o;
  kvt_options_init(&o, KVT_OPTIONS_VERSION);
  o.cache_dir = dir;
  o.durability = KVT_DURABILITY_NONE;
  o.chunk_tokens = C;
  o.model_id = MODEL;
  o.host_cache_bytes = host_bytes;
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  return t;
}

/* Copies token rows [0, p) (and the tokens) of base into e: the shared part
 * of two prompts has the same KV, as in a real model. */
static void share(t_entry *e, const t_entry *base, size_t p) {
  memcpy(e->tokens, base->tokens, p * sizeof(int32_t));
  kvt_test_model_hash(e->hash, MODEL, e->tokens, e->n_tokens);
  for (uint32_t l = 0; l < e->n_layers; l++)
    for (int k = 0; k < 2; k++) {
      kvt_tensor *d = &e->layers[l].tensors[k];
      const kvt_tensor *s = &base->layers[l].tensors[k];
      for (int h = 0; h < 2; h++)
        memcpy((float *)d->data + (size_t)h * d->shape[2] * D,
               (const float *)s->data + (size_t)h * s->shape[2] * D,
               p * D * sizeof(float));
    }
}

/* A 40-token entry: 2 chunks + 8 tail rows. */
static t_entry mk(uint64_t seed, size_t n) {
  t_entry e = t_make(seed, n, NL, (int)n, D);
  kvt_test_model_hash(e.hash, MODEL, e.tokens, e.n_tokens); /* its name */
  return e;
}

static int spill_nocopy(kvt_tier *t, const t_entry *e) {
  return kvt_tier_spill_nocopy(t, e->tokens, e->n_tokens, e->layers,
                               e->n_layers, e->memory_bytes, NULL, NULL);
}

static kvt_entry *promote(kvt_tier *t, const t_entry *e) {
  kvt_entry *got = NULL;
  return kvt_tier_promote(&got, t, e->tokens, e->n_tokens, NULL) == 0 ? got
                                                                      : NULL;
}

static kvt_entry *read_entry(kvt_tier *t, const t_entry *e) {
  kvt_entry *got = NULL;
  return kvt_tier_read_entry(&got, t, e->tokens, e->n_tokens, e->hash) == 0
             ? got
             : NULL;
}

/* Flips byte off (from the end when < 0) of every chunk file under dir.
 * Returns how many were flipped. */
typedef struct flip_ctx {
  long off;
  int flipped;
} flip_ctx;
static void flip_one(void *ctx, const char *path) {
  flip_ctx *f = ctx;
  f->flipped += t_flip(path, f->off) == 0;
}
static int flip_chunks(const char *dir, long off) {
  flip_ctx f = {off, 0};
  kvt_test_each_chunk(dir, flip_one, &f);
  return f.flipped;
}

/* The keys (64 hex) of a cache's chunk files. */
typedef struct key_ctx {
  char keys[4][65];
  int n;
} key_ctx;
static void last_key(void *ctx, const char *path) {
  key_ctx *k = ctx;
  const char *b = strrchr(path, '/') + 1;
  if (k->n < 4 && strlen(b) == 68)
    snprintf(k->keys[k->n++], 65, "%.64s", b);
}

static void *u_alloc(void *ctx, uint32_t layer, uint32_t tensor,
                     const kvt_tensor *d) {
  (void)layer;
  (void)tensor;
  ++*(int *)ctx;
  return malloc(d->nbytes ? d->nbytes : 1);
}
static void u_free(void *ctx, void *buf) {
  (void)ctx;
  free(buf);
}

static void test_entry(void) {
  char *dir = kvt_test_tmpdir("ramch1");
  kvt_tier *t = open_dir(dir, (uint64_t)64 << 20);
  t_entry a = mk(1, 40);
  REQUIRE(t_spill(t, &a) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  kvt_stats s = stats_of(t);
  CHECK_EQ_INT(s.host_cache_entries, 1);
  CHECK(s.disk_bytes > 0);
  for (int i = 0; i < 2; i++) {
    kvt_entry *got = promote(t, &a);
    REQUIRE(got);
    CHECK(t_same(got, &a));
    /* The tail's files and the two chunk files. */
    CHECK(kvt_entry_disk_bytes(got) > a.memory_bytes);
    kvt_entry_free(got);
  }
  kvt_entry *got = read_entry(t, &a);
  REQUIRE(got);
  CHECK(t_same(got, &a));
  kvt_entry_free(got);
  s = stats_of(t);
  CHECK_EQ_INT(s.promotes_from_ram, 2);
  CHECK_EQ_INT(s.promotes_from_disk, 0);
  CHECK_EQ_INT(s.host_cache_hits, 3);
  CHECK_EQ_INT(s.host_cache_verify_failures, 0);
  /* Into caller buffers: copied, the record stays. */
  int allocs = 0;
  kvt_promote_opts po = KVT_PROMOTE_OPTS_INIT;
  po.alloc = u_alloc;
  po.free_buf = u_free;
  po.alloc_ctx = &allocs;
  REQUIRE(kvt_tier_promote(&got, t, a.tokens, a.n_tokens, &po) == 0);
  CHECK(t_same(got, &a));
  CHECK_EQ_INT(allocs, 2 * NL);
  kvt_entry_free(got);
  s = stats_of(t);
  CHECK_EQ_INT(s.promotes_from_ram, 3);
  CHECK_EQ_INT(s.host_cache_entries, 1);
  /* A copy served from RAM is the caller's own: altering it changes
   * nothing cached. */
  got = promote(t, &a);
  REQUIRE(got);
  ((float *)kvt_entry_layer(got, 1)->tensors[0].data)[(40 + 3) * D + 2] += 1;
  kvt_entry_free(got);
  got = promote(t, &a);
  REQUIRE(got);
  CHECK(t_same(got, &a));
  kvt_entry_free(got);
  CHECK_EQ_INT(stats_of(t).promotes_from_ram, 5);
  /* A disk read's buffers go to RAM when freed (kept whole: nothing else in
   * RAM shares its chain): altered first - a row of a chunk, then one of the
   * tail - the copy fails the check and is not served: the disk is read (and
   * its result cached again). */
  const int rows[2] = {3, 37};
  for (int k = 0; k < 2; k++) {
    REQUIRE(kvt_tier_trim(t, 0, NULL) == 0);
    s = stats_of(t);
    CHECK_EQ_INT(s.host_cache_entries + s.host_cache_chunks, 0);
    got = promote(t, &a); /* from disk */
    REQUIRE(got);
    const kvt_layer *l = kvt_entry_layer(got, 1);
    ((float *)l->tensors[0].data)[(40 + rows[k]) * D + 2] += 1.0f; /* head 1 */
    kvt_entry_free(got);
    s = stats_of(t);
    CHECK_EQ_INT(s.host_cache_entries, 1);
    CHECK_EQ_INT(s.host_cache_chunks, 0);
    got = promote(t, &a);
    REQUIRE(got);
    CHECK(t_same(got, &a));
    kvt_entry_free(got);
    s = stats_of(t);
    CHECK_EQ_INT(s.host_cache_verify_failures, (uint64_t)k + 1);
    CHECK_EQ_INT(s.promotes_from_disk, 2 * ((uint64_t)k + 1));
    /* The disk read's copy, given back whole, serves the next one. */
    got = promote(t, &a);
    REQUIRE(got);
    CHECK(t_same(got, &a));
    kvt_entry_free(got);
    CHECK_EQ_INT(stats_of(t).promotes_from_ram, 6 + (uint64_t)k);
  }
  CHECK_EQ_INT(s.quarantined, 0);
  CHECK_EQ_INT(s.promotion_failures, 0);
  /* Replaced (same tokens and chain, another tail): the new version. */
  t_entry a2 = mk(2, 40);
  share(&a2, &a, 32);
  memcpy(a2.tokens, a.tokens, 40 * sizeof(int32_t)); /* same tokens */
  kvt_test_model_hash(a2.hash, MODEL, a2.tokens, a2.n_tokens);
  REQUIRE(strcmp(a2.hash, a.hash) == 0);
  REQUIRE(kvt_tier_trim(t, 0, NULL) == 0);
  got = promote(t, &a); /* a disk read of the old version is out (lent) */
  REQUIRE(got);
  REQUIRE(t_spill(t, &a2) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  kvt_entry_free(got); /* not re-admitted */
  got = promote(t, &a2);
  REQUIRE(got);
  CHECK(t_same(got, &a2));
  kvt_entry_free(got);
  s = stats_of(t);
  CHECK_EQ_INT(s.promotes_from_ram, 8);
  CHECK_EQ_INT(s.host_cache_entries, 1);
  CHECK_EQ_INT(s.host_cache_chunks, 2);
  /* Removed: gone from RAM too. */
  REQUIRE(kvt_tier_remove(t, a.tokens, a.n_tokens) == 0);
  CHECK_EQ_INT(stats_of(t).host_cache_entries, 0);
  CHECK(promote(t, &a) == NULL);
  /* Its chain stays stored (no eviction yet), and so do its chunks in RAM. */
  CHECK_EQ_INT(stats_of(t).host_cache_chunks, 2);
  t_free(&a);
  t_free(&a2);
  kvt_tier_free(t);
}

/* The expected prefix of base's first m tokens (rows [0, m), offset m). */
static t_entry prefix_of(const t_entry *base, size_t m) {
  t_entry p = mk(99, m);
  share(&p, base, m);
  return p;
}

static void test_prefix_and_eviction(void) {
  char *dir = kvt_test_tmpdir("ramch2");
  kvt_tier *t = open_dir(dir, (uint64_t)64 << 20);
  t_entry a = mk(10, 40), b = mk(11, 40);
  share(&b, &a, 32);
  REQUIRE(t_spill(t, &a) == 0);
  REQUIRE(spill_nocopy(t, &b) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  /* New prompts sharing 32 and 20 tokens: prefixes of 32 and 16 rows that
   * no spill ended at. */
  t_entry q2 = mk(12, 42), q1 = mk(13, 42);
  share(&q2, &a, 32);
  share(&q1, &a, 20);
  t_entry p2 = prefix_of(&a, 32), p1 = prefix_of(&a, 16);
  kvt_entry_info info;
  REQUIRE(kvt_tier_lookup_prefix(&info, t, q2.tokens, q2.n_tokens) == 0);
  CHECK_EQ_INT(info.num_tokens, 32);
  CHECK(strcmp(info.token_hash, p2.hash) == 0);
  REQUIRE(kvt_tier_lookup_prefix(&info, t, q1.tokens, q1.n_tokens) == 0);
  CHECK_EQ_INT(info.num_tokens, 16);
  CHECK(strcmp(info.token_hash, p1.hash) == 0);
  kvt_stats s0 = stats_of(t);
  const t_entry *ps[2] = {&p2, &p1};
  for (int k = 0; k < 2; k++)
    for (int i = 0; i < 2; i++) {
      kvt_entry *got = read_entry(t, ps[k]);
      REQUIRE(got);
      CHECK(t_same(got, ps[k]));
      kvt_entry_free(got);
    }
  kvt_stats s = stats_of(t);
  /* Every read: the chunks a's copy-mode spill left in RAM (a prefix is
   * its chunks: no record of its own). */
  CHECK_EQ_INT(s.host_cache_hits - s0.host_cache_hits, 4);
  /* a's tail and b's (its zero-copy spill copied in by the writer) */
  CHECK_EQ_INT(s.host_cache_entries, 2);
  CHECK_EQ_INT(s.host_cache_chunks, 2); /* shared by a, b, p2, p1 */
  CHECK_EQ_INT(s.promotes_from_disk, 0);
  /* A PREFIX promote of the longer prompt: the cached 32-token prefix. */
  kvt_promote_opts po = KVT_PROMOTE_OPTS_INIT;
  po.flags = KVT_PROMOTE_PREFIX;
  kvt_entry *got = NULL;
  REQUIRE(kvt_tier_promote(&got, t, q2.tokens, q2.n_tokens, &po) == 0);
  CHECK(t_same(got, &p2));
  kvt_entry_free(got);
  s = stats_of(t);
  CHECK_EQ_INT(s.promotes_from_ram, 1);
  CHECK_EQ_INT(s.promotes_from_disk, 0);
  /* The same tokens under a wrong name are not served. */
  got = NULL;
  CHECK(kvt_tier_read_entry(&got, t, p2.tokens, p2.n_tokens, p1.hash) != 0);
  /* The entries go; their chain stays, and so do the prefixes over it. */
  REQUIRE(kvt_tier_remove(t, a.tokens, a.n_tokens) == 0);
  REQUIRE(kvt_tier_remove(t, b.tokens, b.n_tokens) == 0);
  s = stats_of(t);
  CHECK_EQ_INT(s.entries, 0);
  CHECK_EQ_INT(s.host_cache_entries, 0);
  CHECK_EQ_INT(s.host_cache_chunks, 2);
  got = read_entry(t, &p2);
  REQUIRE(got);
  CHECK(t_same(got, &p2));
  kvt_entry_free(got);
  CHECK_EQ_INT(stats_of(t).host_cache_hits, s.host_cache_hits + 1);
  /* Evict one chunk (the chain's only leaf): the 32-token prefix through it
   * leaves RAM, the 16-token one (through its parent only) stays. */
  kvt_gc_opts g = KVT_GC_OPTS_INIT;
  g.max_bytes = s.disk_bytes - 1;
  uint64_t removed = 0;
  REQUIRE(kvt_tier_gc(t, &g, &removed, NULL) == 0);
  s = stats_of(t);
  CHECK_EQ_INT(s.host_cache_chunks, 1);
  CHECK(s.disk_bytes < g.max_bytes);
  CHECK(read_entry(t, &p2) == NULL);
  REQUIRE(kvt_tier_lookup_prefix(&info, t, q2.tokens, q2.n_tokens) == 0);
  CHECK_EQ_INT(info.num_tokens, 16);
  uint64_t hits = stats_of(t).host_cache_hits;
  got = read_entry(t, &p1);
  REQUIRE(got);
  CHECK(t_same(got, &p1));
  kvt_entry_free(got);
  CHECK_EQ_INT(stats_of(t).host_cache_hits, hits + 1);
  /* Everything evicted: nothing left in RAM. */
  g.max_bytes = 1;
  REQUIRE(kvt_tier_gc(t, &g, &removed, NULL) == 0);
  s = stats_of(t);
  CHECK_EQ_INT(s.host_cache_entries, 0);
  CHECK_EQ_INT(s.host_cache_chunks, 0);
  CHECK_EQ_INT(s.host_cache_bytes_used, 0);
  CHECK(read_entry(t, &p1) == NULL);
  t_entry *all[] = {&a, &b, &q1, &q2, &p1, &p2};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++)
    t_free(all[i]);
  kvt_tier_free(t);
}

static void test_quarantine(void) {
  char *dir = kvt_test_tmpdir("ramch3");
  kvt_tier *t = open_dir(dir, (uint64_t)64 << 20);
  t_entry a = mk(20, 40), f = mk(21, 40), q = mk(22, 42);
  share(&f, &a, 32);
  share(&q, &a, 20);
  t_entry p1 = prefix_of(&a, 16);
  REQUIRE(t_spill(t, &a) == 0);
  REQUIRE(spill_nocopy(t, &f) == 0); /* its tail cached by the writer */
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  kvt_entry *got = read_entry(t, &p1);
  REQUIRE(got);
  kvt_entry_free(got);
  CHECK_EQ_INT(stats_of(t).host_cache_entries, 2);
  CHECK_EQ_INT(stats_of(t).host_cache_chunks, 2);
  /* A disk read of a is out (lent) when its chain's chunk is quarantined. */
  REQUIRE(kvt_tier_trim(t, 0, NULL) == 0);
  kvt_entry *held = promote(t, &a);
  REQUIRE(held);
  CHECK(t_same(held, &a));
  CHECK_EQ_INT(stats_of(t).promotes_from_disk, 1);
  /* Damage the data of every chunk: a disk read through the chain finds
   * the damage and quarantines the chunk. */
  CHECK_EQ_INT(flip_chunks(dir, -3), 2);
  CHECK(promote(t, &f) == NULL);
  kvt_stats s = stats_of(t);
  CHECK(s.quarantined >= 1);
  CHECK_EQ_INT(s.host_cache_entries, 0);
  kvt_entry_free(held); /* its chain is damaged: freed, not re-admitted */
  s = stats_of(t);
  CHECK_EQ_INT(s.host_cache_entries, 0);
  CHECK_EQ_INT(s.host_cache_chunks, 0);
  /* The entries are kept (unservable until the chunk is written again). */
  CHECK_EQ_INT(s.entries, 2);
  CHECK(s.chunks_quarantined >= 1);
  CHECK(promote(t, &a) == NULL);
  CHECK(read_entry(t, &p1) == NULL);
  kvt_tier_free(t);
  /* A damaged chunk header: the RAM copy fails its check (never served), the
   * disk read that follows quarantines the chunk. */
  dir = kvt_test_tmpdir("ramch4");
  t = open_dir(dir, (uint64_t)64 << 20);
  REQUIRE(t_spill(t, &a) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  CHECK_EQ_INT(stats_of(t).host_cache_entries, 1);
  CHECK_EQ_INT(flip_chunks(dir, 100), 2); /* in the fixed header part */
  CHECK(promote(t, &a) == NULL);
  s = stats_of(t);
  CHECK_EQ_INT(s.host_cache_verify_failures, 1);
  CHECK_EQ_INT(s.promotes_from_ram, 0);
  CHECK(s.quarantined >= 1);
  CHECK_EQ_INT(s.host_cache_entries, 0);
  CHECK_EQ_INT(s.host_cache_chunks, 0);
  kvt_tier_free(t);
  /* The chunk tools' verify with repair (kvt_tier_chunk_verify) quarantining
   * a damaged chunk: the cached entry and prefix through it go too. */
  dir = kvt_test_tmpdir("ramch6");
  t = open_dir(dir, (uint64_t)64 << 20);
  REQUIRE(t_spill(t, &a) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  got = read_entry(t, &p1);
  REQUIRE(got);
  kvt_entry_free(got);
  CHECK_EQ_INT(stats_of(t).host_cache_entries, 1);
  CHECK_EQ_INT(stats_of(t).host_cache_chunks, 2);
  CHECK_EQ_INT(flip_chunks(dir, -3), 2);
  key_ctx kc;
  memset(&kc, 0, sizeof kc);
  kvt_test_each_chunk(dir, last_key, &kc);
  REQUIRE(kc.n == 2);
  int bad = 0;
  for (int i = 0; i < 2; i++) {
    uint64_t removed = 0;
    int rc = kvt_tier_chunk_verify(t, kc.keys[i], 1, &removed);
    CHECK(rc == KVT_ECORRUPT || rc == KVT_ENOTFOUND); /* 2nd: gone with 1st */
    bad += rc == KVT_ECORRUPT;
  }
  CHECK(bad >= 1);
  s = stats_of(t);
  CHECK_EQ_INT(s.host_cache_entries, 0);
  CHECK_EQ_INT(s.host_cache_chunks, 0);
  CHECK(promote(t, &a) == NULL);
  CHECK(read_entry(t, &p1) == NULL);
  t_free(&a);
  t_free(&f);
  t_free(&q);
  t_free(&p1);
  kvt_tier_free(t);
}

/* Reads of a cached prefix racing with evictions of its chain and re-spills
 * of the entry over it: every read returns the prefix bit for bit or
 * KVT_ENOTFOUND, never anything else. */
typedef struct racer {
  kvt_tier *t;
  const t_entry *p;
  atomic_int stop;
  int ok, missing, wrong, other;
} racer;

static void *race_reads(void *arg) {
  racer *r = arg;
  while (!atomic_load(&r->stop)) {
    kvt_entry *got = NULL;
    int rc = kvt_tier_read_entry(&got, r->t, r->p->tokens, r->p->n_tokens,
                                 r->p->hash);
    if (rc == 0) {
      if (t_same(got, r->p))
        r->ok++;
      else
        r->wrong++;
      kvt_entry_free(got);
    } else if (rc == KVT_ENOTFOUND) {
      r->missing++;
    } else {
      r->other++;
    }
  }
  return NULL;
}

static void test_eviction_race(void) {
  char *dir = kvt_test_tmpdir("ramch5");
  kvt_tier *t = open_dir(dir, (uint64_t)64 << 20);
  t_entry a = mk(30, 40);
  t_entry p2 = prefix_of(&a, 32);
  REQUIRE(t_spill(t, &a) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  racer r = {t, &p2, 0, 0, 0, 0, 0};
  pthread_t th;
  REQUIRE(pthread_create(&th, NULL, race_reads, &r) == 0);
  kvt_gc_opts g = KVT_GC_OPTS_INIT;
  g.max_bytes = 1;
  for (int i = 0; i < 40; i++) {
    REQUIRE(kvt_tier_gc(t, &g, NULL, NULL) == 0); /* chain and entry gone */
    REQUIRE(t_spill(t, &a) == 0);
    REQUIRE(kvt_tier_flush(t, -1) == 0);
    usleep(1000);
  }
  atomic_store(&r.stop, 1);
  pthread_join(th, NULL);
  CHECK_EQ_INT(r.wrong, 0);
  CHECK_EQ_INT(r.other, 0);
  CHECK(r.ok + r.missing > 0);
  kvt_stats s = stats_of(t);
  CHECK_EQ_INT(s.quarantined, 0);
  fprintf(stderr, "  %d reads served, %d missing, %llu RAM hits\n", r.ok,
          r.missing, (unsigned long long)s.host_cache_hits);
  t_free(&a);
  t_free(&p2);
  kvt_tier_free(t);
}

/* An entry whose length is a multiple of C is stored as its chain record
 * alone (no tail files). Its RAM copy - admitted by the copy-mode spill, or
 * lent by a disk read after a trim emptied the cache - is served on the next
 * promote and read_entry, bit for bit, with no verification failure; an
 * altered row still fails the check and the disk is read. */
static void test_record_entry(void) {
  char *dir = kvt_test_tmpdir("ramch5");
  kvt_tier *t = open_dir(dir, (uint64_t)64 << 20);
  t_entry a = mk(5, 2 * C);
  REQUIRE(t_spill(t, &a) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  /* Stored as a chain record: the entry's directory has no manifest. */
  char rec[4096];
  snprintf(rec, sizeof rec, "%s/data/%s/chain.kvr", dir, a.hash);
  CHECK(access(rec, F_OK) == 0);
  kvt_stats s = stats_of(t);
  CHECK_EQ_INT(s.host_cache_entries, 1);
  for (int i = 0; i < 2; i++) {
    kvt_entry *got = promote(t, &a);
    REQUIRE(got);
    CHECK(t_same(got, &a));
    kvt_entry_free(got);
  }
  kvt_entry *got = read_entry(t, &a);
  REQUIRE(got);
  CHECK(t_same(got, &a));
  kvt_entry_free(got);
  s = stats_of(t);
  CHECK_EQ_INT(s.host_cache_hits, 3);
  CHECK_EQ_INT(s.host_cache_verify_failures, 0);
  CHECK_EQ_INT(s.promotes_from_ram, 2);
  CHECK_EQ_INT(s.promotes_from_disk, 0);
  /* Emptied, then read from disk: the read's buffers are lent to the cache
   * and the next promote is served from RAM. */
  REQUIRE(kvt_tier_trim(t, 0, NULL) == 0);
  CHECK_EQ_INT(stats_of(t).host_cache_entries, 0);
  got = promote(t, &a);
  REQUIRE(got);
  CHECK(t_same(got, &a));
  kvt_entry_free(got);
  got = promote(t, &a);
  REQUIRE(got);
  CHECK(t_same(got, &a));
  kvt_entry_free(got);
  s = stats_of(t);
  CHECK_EQ_INT(s.promotes_from_disk, 1);
  CHECK_EQ_INT(s.promotes_from_ram, 3);
  CHECK_EQ_INT(s.host_cache_verify_failures, 0);
  /* An altered copy given back (a disk read's) fails the check: the disk
   * is read, bit for bit. */
  REQUIRE(kvt_tier_trim(t, 0, NULL) == 0);
  got = promote(t, &a);
  REQUIRE(got);
  ((float *)kvt_entry_layer(got, 0)->tensors[1].data)[5 * D + 1] += 1.0f;
  kvt_entry_free(got);
  got = promote(t, &a);
  REQUIRE(got);
  CHECK(t_same(got, &a));
  kvt_entry_free(got);
  s = stats_of(t);
  CHECK_EQ_INT(s.host_cache_verify_failures, 1);
  CHECK_EQ_INT(s.promotes_from_disk, 3);
  CHECK_EQ_INT(s.quarantined, 0);
  t_free(&a);
  kvt_tier_free(t);
}

/* Freeing a disk read copies nothing on the freeing thread: the buffers are
 * kept as they are (and the RAM tier's cutter makes the tail and chunks of
 * them once they share); a promote right after the free is served from RAM
 * all the same, bit for bit. The same for a prefix read (always cut: it has
 * no whole record). A zero-copy spill is in RAM once written. */
static void test_free_copies_nothing_here(void) {
  char *dir = kvt_test_tmpdir("ramch6");
  kvt_tier *t = open_dir(dir, (uint64_t)64 << 20);
  t_entry a = mk(60, 40), b = mk(61, 40), q = mk(62, 42);
  share(&b, &a, 32);
  share(&q, &a, 20);
  t_entry p1 = prefix_of(&a, 16);
  REQUIRE(t_spill(t, &a) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  for (int round = 0; round < 3; round++) {
    REQUIRE(kvt_tier_trim(t, 0, NULL) == 0);
    kvt_stats s = stats_of(t);
    CHECK_EQ_INT(s.host_cache_entries + s.host_cache_chunks, 0);
    uint64_t d0 = s.promotes_from_disk, r0 = s.promotes_from_ram;
    kvt_entry *got = promote(t, &a); /* from disk */
    REQUIRE(got);
    CHECK(t_same(got, &a));
    uint64_t here = kvti_ram_thread_cut_bytes();
    kvt_entry_free(got);
    CHECK_EQ_INT(kvti_ram_thread_cut_bytes(), here);
    got = promote(t, &a); /* no flush: RAM all the same */
    REQUIRE(got);
    CHECK(t_same(got, &a));
    kvt_entry_free(got);
    CHECK_EQ_INT(kvti_ram_thread_cut_bytes(), here);
    s = stats_of(t);
    CHECK_EQ_INT(s.promotes_from_disk, d0 + 1);
    CHECK_EQ_INT(s.promotes_from_ram, r0 + 1);
    CHECK_EQ_INT(s.host_cache_entries, 1); /* a, whole: it shares nothing */
    CHECK_EQ_INT(s.host_cache_chunks, 0);
  }
  /* A prefix read from disk: freed without a copy here, then its chunks are
   * in RAM and serve the next read. */
  REQUIRE(kvt_tier_trim(t, 0, NULL) == 0);
  kvt_entry *got = read_entry(t, &p1);
  REQUIRE(got);
  CHECK(t_same(got, &p1));
  uint64_t here = kvti_ram_thread_cut_bytes();
  kvt_entry_free(got);
  CHECK_EQ_INT(kvti_ram_thread_cut_bytes(), here);
  kvt_stats s = stats_of(t);
  CHECK_EQ_INT(s.host_cache_chunks, 1); /* its 16 rows */
  uint64_t h0 = s.host_cache_hits;
  got = read_entry(t, &p1);
  REQUIRE(got);
  CHECK(t_same(got, &p1));
  kvt_entry_free(got);
  CHECK_EQ_INT(stats_of(t).host_cache_hits, h0 + 1);
  /* A zero-copy spill sharing a's chain: its first promote is a RAM hit
   * (its tail copied in on the writer thread; its chunks already there). */
  REQUIRE(spill_nocopy(t, &b) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  s = stats_of(t);
  CHECK_EQ_INT(s.host_cache_chunks, 2);
  h0 = s.host_cache_hits;
  uint64_t d0 = s.promotes_from_disk;
  got = promote(t, &b);
  REQUIRE(got);
  CHECK(t_same(got, &b));
  kvt_entry_free(got);
  s = stats_of(t);
  CHECK_EQ_INT(s.host_cache_hits, h0 + 1);
  CHECK_EQ_INT(s.promotes_from_disk, d0);
  t_entry *all[] = {&a, &b, &q, &p1};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++)
    t_free(all[i]);
  kvt_tier_free(t);
}

/* A zero-copy spill into an empty RAM tier: its chunks and tail are copied
 * in by the writer, so the first promote is a RAM hit, bit for bit. */
static void test_nocopy_spill_in_ram(void) {
  char *dir = kvt_test_tmpdir("ramch7");
  kvt_tier *t = open_dir(dir, (uint64_t)64 << 20);
  t_entry a = mk(70, 40);
  REQUIRE(spill_nocopy(t, &a) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  kvt_stats s = stats_of(t);
  CHECK_EQ_INT(s.host_cache_entries, 1);
  CHECK_EQ_INT(s.host_cache_chunks, 2);
  kvt_entry *got = promote(t, &a);
  REQUIRE(got);
  CHECK(t_same(got, &a));
  kvt_entry_free(got);
  s = stats_of(t);
  CHECK_EQ_INT(s.host_cache_hits, 1);
  CHECK_EQ_INT(s.promotes_from_ram, 1);
  CHECK_EQ_INT(s.promotes_from_disk, 0);
  t_free(&a);
  kvt_tier_free(t);
}

/* The first tensor buffer of a promoted entry (to tell a zero-copy serve of
 * the same record from an assembled copy). */
static const void *buf0(const kvt_entry *e) {
  return kvt_entry_layer(e, 0)->tensors[0].data;
}

/* A freed disk read stays a whole record while nothing in RAM shares its
 * chain - served again zero copy (the same buffers back), bit for bit - and
 * is cut into its tail and chunks once something does: a second disk read
 * through the same chunks freed next (both cut, the chunks held once), or a
 * spill through them (the whole record left from before is cut when the
 * spill's chunks arrive). A tail row altered in a disk read freed into a
 * shared chain is caught by the check of the copy assembled from it. */
static void test_cut_when_shared(void) {
  char *dir = kvt_test_tmpdir("ramch8");
  kvt_tier *t = open_dir(dir, (uint64_t)64 << 20);
  t_entry a = mk(80, 40), b = mk(81, 40), c = mk(82, 40), x = mk(83, 40);
  share(&b, &a, 32);
  share(&c, &a, 32);
  REQUIRE(t_spill(t, &a) == 0);
  REQUIRE(t_spill(t, &b) == 0);
  REQUIRE(t_spill(t, &x) == 0); /* shares nothing with a */
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  REQUIRE(kvt_tier_trim(t, 0, NULL) == 0);
  /* a alone: whole, and served as it is. */
  kvt_entry *got = promote(t, &a); /* from disk */
  REQUIRE(got);
  const void *p = buf0(got);
  kvt_entry_free(got);
  kvt_stats s = stats_of(t);
  CHECK_EQ_INT(s.host_cache_entries, 1);
  CHECK_EQ_INT(s.host_cache_chunks, 0);
  for (int i = 0; i < 2; i++) {
    got = promote(t, &a);
    REQUIRE(got);
    CHECK(t_same(got, &a));
    CHECK(buf0(got) == p);
    kvt_entry_free(got);
  }
  /* x shares no chunk with a: both stay whole. */
  got = promote(t, &x);
  REQUIRE(got);
  kvt_entry_free(got);
  s = stats_of(t);
  CHECK_EQ_INT(s.host_cache_entries, 2);
  CHECK_EQ_INT(s.host_cache_chunks, 0);
  uint64_t whole = s.host_cache_bytes_used / 2;
  /* b through a's two chunks: b is cut, and a with it (its tail only). */
  got = promote(t, &b); /* from disk */
  REQUIRE(got);
  kvt_entry_free(got);
  s = stats_of(t);
  CHECK_EQ_INT(s.host_cache_entries, 3); /* a's and b's tails, x whole */
  CHECK_EQ_INT(s.host_cache_chunks, 2);
  CHECK(s.host_cache_bytes_used < 3 * whole);
  for (int i = 0; i < 2; i++) {
    const t_entry *e = i ? &b : &a;
    got = promote(t, e);
    REQUIRE(got);
    CHECK(t_same(got, e));
    kvt_entry_free(got);
  }
  s = stats_of(t);
  CHECK_EQ_INT(s.promotes_from_disk, 3);
  CHECK_EQ_INT(s.promotes_from_ram, 4);
  CHECK_EQ_INT(s.host_cache_verify_failures, 0);
  /* A tail row of b's disk read altered before it is freed into the shared
   * chain: cut (the chunks are resident), its tail fails the next check. */
  REQUIRE(kvt_tier_trim(t, 0, NULL) == 0);
  got = promote(t, &a);
  REQUIRE(got);
  kvt_entry_free(got); /* a: whole again, nothing shares */
  got = promote(t, &b);
  REQUIRE(got);
  ((float *)kvt_entry_layer(got, 1)->tensors[0].data)[(40 + 37) * D + 2] +=
      1.0f; /* head 1, a row past the chain */
  kvt_entry_free(got);
  s = stats_of(t);
  CHECK_EQ_INT(s.host_cache_chunks, 2);
  got = promote(t, &b);
  REQUIRE(got);
  CHECK(t_same(got, &b));
  kvt_entry_free(got);
  s = stats_of(t);
  CHECK_EQ_INT(s.host_cache_verify_failures, 1);
  CHECK_EQ_INT(s.promotes_from_disk, 6);
  /* A spill through the chain wakes a whole record left from before. */
  REQUIRE(kvt_tier_trim(t, 0, NULL) == 0);
  got = promote(t, &a);
  REQUIRE(got);
  kvt_entry_free(got);
  s = stats_of(t);
  CHECK_EQ_INT(s.host_cache_entries, 1);
  CHECK_EQ_INT(s.host_cache_chunks, 0);
  REQUIRE(t_spill(t, &c) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  s = stats_of(t);
  CHECK_EQ_INT(s.host_cache_entries, 2); /* a's and c's tails */
  CHECK_EQ_INT(s.host_cache_chunks, 2);
  CHECK(s.host_cache_bytes_used < 2 * whole);
  t_entry *all[] = {&a, &b, &c, &x};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++) {
    got = promote(t, all[i]);
    REQUIRE(got);
    CHECK(t_same(got, all[i]));
    kvt_entry_free(got);
  }
  s = stats_of(t);
  CHECK_EQ_INT(s.host_cache_verify_failures, 1);
  CHECK_EQ_INT(s.quarantined, 0);
  for (size_t i = 0; i < sizeof all / sizeof *all; i++)
    t_free(all[i]);
  kvt_tier_free(t);
}

int main(void) {
  RUN(test_entry);
  RUN(test_prefix_and_eviction);
  RUN(test_quarantine);
  RUN(test_eviction_race);
  RUN(test_record_entry);
  RUN(test_free_copies_nothing_here);
  RUN(test_nocopy_spill_in_ram);
  RUN(test_cut_when_shared);
  return kvt_test_done();
}
