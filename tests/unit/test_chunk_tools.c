/*
 * test_chunk_tools.c - the chunked store's tools API (include/kvtier.h, "The
 * chunked native store, for tools"), public API only: listing with children
 * and sharing, an entry's chain, totals and the logical bytes behind the
 * dedup ratio; a chained entry read by a tier of another model_id and chunk
 * size (chains are followed by parent links); chunk verification, and its
 * repair (the bad chunk's file alone moved to quarantine/; the chunks below
 * it and the entries through it kept, unservable, until the next spill of
 * those tokens writes the chunk again and they serve bit-exact); gc of
 * chunks/ (stale tmp removed, strays left; a dry run changes nothing); and
 * the writer's lazy sweep of one chunks/<kk> every 64 chunked spills.
 */
#include "fmt_testlib.h"
#include "kvtier.h"

#include <dirent.h>

#define C 16

static kvt_tier *open_tier(const char *dir, uint32_t chunk, const char *id,
                           unsigned flags) {
  kvt_options o = KVT_OPTIONS_INIT;
  o.cache_dir = dir;
  o.durability = KVT_DURABILITY_NONE;
  o.chunk_tokens = chunk;
  o.model_id = id;
  o.flags = flags;
  o.host_cache_bytes = 0;
  kvt_tier *t;
  REQUIRE(kvt_tier_open(&t, &o) == 0);
  if (!(flags & KVT_OPEN_READONLY))
    REQUIRE(kvt_tier_start_writer(t) == 0);
  return t;
}

/* One KV layer of rows [0, n), a function of the tokens (t_kv_tokens). */
static kvt_layer kv_of(const int32_t *tok, int n) {
  return t_kv_tokens(tok, n, n, 8, 0);
}

static void spill(kvt_tier *t, const int32_t *tok, int n) {
  kvt_layer l = kv_of(tok, n);
  CHECK(kvt_tier_spill(t, tok, (size_t)n, &l, 1, 1000) == 0);
  t_layer_free(&l);
}

/* Conversation c: 32 shared tokens, 32 own, 5 more (a tail). */
static void conv(int32_t *tok, int c) {
  for (int i = 0; i < 32; i++)
    tok[i] = 1000 + i;
  for (int i = 32; i < 69; i++)
    tok[i] = 5000 + c * 100 + i;
}

typedef struct seen {
  int n, refs3, refs1, kids3;
  uint64_t bytes;
} seen;
static int visit(void *ctx, const kvt_chunk_info *in) {
  seen *s = ctx;
  s->n++;
  s->refs3 += in->entries == 3;
  s->refs1 += in->entries == 1;
  s->kids3 += in->children == 3;
  s->bytes += in->disk_bytes;
  return 0;
}

static void chunk_path(char *out, size_t cap, const char *dir,
                       const char *key) {
  snprintf(out, cap, "%s/chunks/%.2s/%s.kvc", dir, key, key);
}

static void flip_last(const char *path) {
  FILE *f = fopen(path, "r+b");
  REQUIRE(f);
  fseek(f, -1, SEEK_END);
  int c = fgetc(f);
  fseek(f, -1, SEEK_END);
  fputc(c ^ 0x5a, f);
  fclose(f);
}


typedef struct gcseen {
  int tmp, adopted, removed, stray;
} gcseen;
static int gc_cb(void *ctx, const char *path, int action, uint64_t bytes,
                 const char *detail) {
  gcseen *g = ctx;
  (void)path;
  (void)bytes;
  (void)detail;
  g->tmp += action == KVT_CHUNK_GC_TMP;
  g->adopted += action == KVT_CHUNK_GC_ADOPTED;
  g->removed += action == KVT_CHUNK_GC_REMOVED;
  g->stray += action == KVT_CHUNK_GC_STRAY;
  return 0;
}

static void test_tools(const char *dir) {
  kvt_tier *t = open_tier(dir, C, "model-a", 0);
  int32_t tok[3][69];
  for (int c = 0; c < 3; c++) {
    conv(tok[c], c);
    spill(t, tok[c], 69);
  }
  REQUIRE(kvt_tier_flush(t, -1) == 0);

  kvt_chunk_totals tot = KVT_CHUNK_TOTALS_INIT;
  REQUIRE(kvt_tier_chunk_totals(&tot, t) == 0);
  CHECK(tot.chunk_tokens == C);
  CHECK(tot.chunks == 8 && tot.chained_entries == 3 && tot.shared == 2 &&
        tot.leaves == 3);
  /* Every chunk file has the same size here: 12 per-entry chunk copies. */
  CHECK(tot.chain_logical_bytes == tot.disk_bytes / 8 * 12);
  kvt_chunk_totals bad = {.version = 99};
  CHECK(kvt_tier_chunk_totals(&bad, t) == KVT_EINVAL);

  seen s = {0};
  REQUIRE(kvt_tier_chunk_foreach(t, visit, &s) == 0);
  CHECK(s.n == 8 && s.refs3 == 2 && s.refs1 == 6 && s.kids3 == 1);
  CHECK(s.bytes == tot.disk_bytes);

  char hash[65];
  REQUIRE(kvt_token_hash(hash, tok[1], 69) == 0);
  kvt_chunk_info *ch = NULL;
  size_t n = 0;
  uint32_t ct = 0;
  REQUIRE(kvt_tier_entry_chain(&ch, &n, &ct, t, hash, 0) == 0);
  REQUIRE(n == 4);
  CHECK(ct == C);
  for (size_t i = 0; i < n; i++) {
    CHECK(ch[i].index == i && ch[i].num_tokens == C);
    CHECK(ch[i].entries == (i < 2 ? 3u : 1u));
    if (i)
      CHECK(strcmp(ch[i].parent, ch[i - 1].key) == 0);
  }
  CHECK(ch[1].children == 3 && ch[3].children == 0);
  char shared_key[65], below_key[3][65], last_key[3][65];
  snprintf(shared_key, sizeof shared_key, "%s", ch[1].key);
  kvt_free(ch);
  REQUIRE(kvt_tier_entry_chain(&ch, &n, NULL, t, hash, KVT_CHAIN_NO_SHARING) ==
          0);
  CHECK(n == 4 && ch[0].entries == 0 && ch[1].children == 3);
  kvt_free(ch);
  CHECK(kvt_tier_entry_chain(&ch, &n, NULL, t, "zz", 0) == KVT_EINVAL);
  char none[65];
  memset(none, 'a', 64);
  none[64] = 0;
  CHECK(kvt_tier_entry_chain(&ch, &n, NULL, t, none, 0) == KVT_ENOTFOUND);
  for (int c = 0; c < 3; c++) { /* the chunk below the shared one */
    char h[65];
    REQUIRE(kvt_token_hash(h, tok[c], 69) == 0);
    REQUIRE(kvt_tier_entry_chain(&ch, &n, NULL, t, h, 0) == 0 && n == 4);
    snprintf(below_key[c], 65, "%s", ch[2].key);
    snprintf(last_key[c], 65, "%s", ch[3].key);
    kvt_free(ch);
  }
  CHECK(kvt_tier_close(t, -1) == 0);
  kvt_tier_free(t);

  /* Another model_id and chunk size: the chained entries still read (by
   * their records' parent links), and every chunk verifies. */
  t = open_tier(dir, 64, "model-b", 0);
  kvt_entry *e = NULL;
  CHECK(kvt_tier_promote(&e, t, tok[2], 69, NULL) == 0);
  if (e) {
    kvt_layer ref = kv_of(tok[2], 69);
    CHECK(t_layer_eq(kvt_entry_layer(e, 0), &ref));
    t_layer_free(&ref);
  }
  kvt_entry_free(e);
  CHECK(kvt_tier_verify(t, hash, 0) == 0);
  ch = NULL;
  REQUIRE(kvt_tier_entry_chain(&ch, &n, NULL, t, hash, 0) == 0 && n == 4);
  for (size_t i = 0; i < n; i++)
    CHECK(kvt_tier_chunk_verify(t, ch[i].key, 0, NULL) == 0);
  kvt_free(ch);
  CHECK(kvt_tier_chunk_verify(t, none, 0, NULL) == KVT_ENOTFOUND);
  CHECK(kvt_tier_chunk_verify(t, "xyz", 0, NULL) == KVT_EINVAL);

  /* Damage the shared chunk: reported without repair (nothing moves); with
   * repair the file alone moves to quarantine/chunk-<key>/ - the 3 chunks
   * below it stay indexed and on disk, the 3 entries through it stay
   * (unservable: a miss) - and the next spill of those tokens writes it
   * again, after which every entry through it serves bit-exact. */
  char p[4096], q[4400];
  chunk_path(p, sizeof p, dir, shared_key);
  flip_last(p);
  uint64_t ents = 99;
  CHECK(kvt_tier_chunk_verify(t, shared_key, 0, &ents) == KVT_ECORRUPT);
  CHECK(ents == 0 && kvt_test_exists(p));
  CHECK(kvt_tier_chunk_verify(t, shared_key, 1, &ents) == KVT_ECORRUPT);
  CHECK(ents == 3);
  CHECK(!kvt_test_exists(p));
  snprintf(q, sizeof q, "%s/quarantine/chunk-%s", dir, shared_key);
  CHECK(kvt_test_count_dir(q, ".kvc") == 1);
  for (int c = 0; c < 3; c++) {
    char bp[4096];
    chunk_path(bp, sizeof bp, dir, below_key[c]);
    CHECK(kvt_test_exists(bp));
    CHECK(kvt_tier_chunk_verify(t, below_key[c], 0, NULL) == 0);
    CHECK(kvt_tier_chunk_verify(t, last_key[c], 0, NULL) == 0);
  }
  kvt_entry_info info;
  for (int c = 0; c < 3; c++) {
    e = NULL;
    CHECK(kvt_tier_promote(&e, t, tok[c], 69, NULL) == KVT_ENOTFOUND);
    CHECK(e == NULL);
    char h[65], d[4200];
    REQUIRE(kvt_token_hash(h, tok[c], 69) == 0);
    snprintf(d, sizeof d, "%s/data/%s", dir, h);
    CHECK(kvt_test_exists(d)); /* kept */
  }
  /* The entries through it are not offered. */
  CHECK(kvt_tier_lookup_prefix(&info, t, tok[0], 69) == KVT_ENOTFOUND);
  CHECK(kvt_tier_lookup(&info, t, tok[1], 69) == KVT_ENOTFOUND);
  tot = (kvt_chunk_totals)KVT_CHUNK_TOTALS_INIT;
  REQUIRE(kvt_tier_chunk_totals(&tot, t) == 0);
  CHECK(tot.chunks == 8 && tot.chained_entries == 3);
  kvt_stats st = KVT_STATS_INIT;
  REQUIRE(kvt_tier_stats(&st, t) == 0);
  CHECK_EQ_INT(st.chunks_quarantined, 1);
  CHECK_EQ_INT(st.entries_unservable, 3);
  CHECK_EQ_INT(st.chunks_rewritten, 0);
  CHECK(kvt_tier_close(t, -1) == 0);
  kvt_tier_free(t);
  /* The writer's own tier reopened (the damage mark is not stored): the
   * first read through the chunk finds its file gone and marks it again;
   * a new conversation over the same system prompt writes it again. */
  t = open_tier(dir, C, "model-a", 0);
  CHECK(kvt_tier_promote(&e, t, tok[1], 69, NULL) == KVT_ENOTFOUND);
  CHECK(kvt_tier_lookup(&info, t, tok[2], 69) == KVT_ENOTFOUND);
  int32_t tok3[69];
  conv(tok3, 3);
  spill(t, tok3, 69);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  REQUIRE(kvt_tier_stats(&st, t) == 0);
  CHECK_EQ_INT(st.chunks_rewritten, 1);
  CHECK_EQ_INT(st.quarantined, 1);
  CHECK(kvt_test_exists(p));
  CHECK(kvt_tier_chunk_verify(t, shared_key, 0, NULL) == 0);
  for (int c = 0; c < 3; c++) {
    e = NULL;
    CHECK(kvt_tier_promote(&e, t, tok[c], 69, NULL) == 0);
    if (e) {
      kvt_layer ref = kv_of(tok[c], 69);
      CHECK(t_layer_eq(kvt_entry_layer(e, 0), &ref));
      t_layer_free(&ref);
    }
    kvt_entry_free(e);
  }

  /* gc of chunks/: a stale tmp is removed, a stray left, nothing else. */
  char tmp[4300], stray[4300];
  snprintf(tmp, sizeof tmp, "%s/chunks/%.2s/x.tmp", dir, shared_key);
  snprintf(stray, sizeof stray, "%s/chunks/%.2s/README", dir, shared_key);
  FILE *f = fopen(tmp, "wb");
  fputs("partial", f);
  fclose(f);
  f = fopen(stray, "wb");
  fputs("not mine", f);
  fclose(f);
  gcseen g = {0};
  kvt_chunk_gc_result res;
  REQUIRE(kvt_tier_chunk_gc(t, 1, gc_cb, NULL, &g, &res) == 0);
  CHECK(g.tmp == 1 && g.adopted == 0 && g.removed == 0 && g.stray == 1);
  CHECK(kvt_test_exists(tmp));
  memset(&g, 0, sizeof g);
  REQUIRE(kvt_tier_chunk_gc(t, 0, gc_cb, NULL, &g, &res) == 0);
  CHECK(g.tmp == 1 && g.adopted == 0 && g.removed == 0 && g.stray == 1);
  CHECK(!kvt_test_exists(tmp));
  CHECK(kvt_test_exists(stray));
  tot = (kvt_chunk_totals)KVT_CHUNK_TOTALS_INIT;
  REQUIRE(kvt_tier_chunk_totals(&tot, t) == 0);
  CHECK(tot.chunks == 10 && tot.chained_entries == 4);
  CHECK(kvt_tier_close(t, -1) == 0);
  kvt_tier_free(t);

  t = open_tier(dir, C, "model-a", KVT_OPEN_READONLY | KVT_OPEN_NO_RECONCILE);
  CHECK(kvt_tier_chunk_gc(t, 0, NULL, NULL, NULL, NULL) == KVT_EINVAL);
  CHECK(kvt_tier_chunk_gc(t, 1, NULL, NULL, NULL, NULL) == 0);
  /* The healed chain and its entry are offered again. */
  CHECK(kvt_tier_lookup_prefix(&info, t, tok[0], 69) == 0 &&
        info.num_tokens == 69);
  kvt_tier_free(t);
}

/* The writer cleans chunks/00 after the 64th chunked spill of a fresh tier. */
static void test_lazy_sweep(const char *dir) {
  kvt_tier *t = open_tier(dir, C, NULL, 0);
  char sub[4200], tmp[4300];
  snprintf(sub, sizeof sub, "%s/chunks", dir); /* made by the first put */
  mkdir(sub, 0700);
  snprintf(sub, sizeof sub, "%s/chunks/00", dir);
  mkdir(sub, 0700);
  snprintf(tmp, sizeof tmp, "%s/stale.tmp", sub);
  FILE *f = fopen(tmp, "wb");
  REQUIRE(f);
  fputs("interrupted", f);
  fclose(f);
  int32_t tok[C];
  for (int k = 0; k < 63; k++) {
    for (int i = 0; i < C; i++)
      tok[i] = 70000 + k * C + i;
    spill(t, tok, C);
  }
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  CHECK(kvt_test_exists(tmp)); /* 63 spills: not yet */
  for (int i = 0; i < C; i++)
    tok[i] = 90000 + i;
  spill(t, tok, C);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  CHECK(!kvt_test_exists(tmp));
  kvt_tier_free(t);
}

int main(void) {
  char *d = kvt_test_tmpdir("chunktools");
  char a[1024], b[1024];
  snprintf(a, sizeof a, "%s/a", d);
  snprintf(b, sizeof b, "%s/b", d);
  test_tools(a);
  test_lazy_sweep(b);
  return kvt_test_done(); /* the tmpdir is removed at exit */
}
