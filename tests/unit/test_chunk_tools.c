/*
 * test_chunk_tools.c - the chunked store's tools API (include/kvtier_sys.h,
 * "The chunked native store"), public API only: listing with children and
 * sharing, an entry's chain, totals and the logical bytes behind the
 * dedup ratio; a chained entry read by a tier of another chunk size (chains
 * are followed by parent links) and never by one of another model_id; chunk
 * verification, and its repair (the bad chunk's file alone moved to
 * quarantine/; the chunks below it and the entries through it kept, unservable,
 * until the next spill of those tokens writes the chunk again and they serve
 * bit-exact); gc of chunks/ (stale tmp removed, strays left; a dry run changes
 * nothing); and the writer's lazy sweep of one chunks/<kk> every 64 chunked
 * spills.
 */
#include "fmt_testlib.h"
#include "kvtier.h"
#include "kvtier_sys.h"
#include "base/io.h"

#include <dirent.h>
#include <sqlite3.h>
#include <sys/stat.h>
#include <unistd.h>

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
  char tmp_path[300]; /* the last stale tmp's, as reported */
} gcseen;
static void copy_file(const char *from, const char *to) {
  size_t len = 0;
  char *b = kvt_test_read_file(from, &len);
  REQUIRE(b);
  FILE *f = fopen(to, "wb");
  REQUIRE(f);
  REQUIRE(fwrite(b, 1, len, f) == len);
  fclose(f);
  free(b);
}

static int gc_cb(void *ctx, const char *path, int action, uint64_t bytes,
                 const char *detail) {
  gcseen *g = ctx;
  if (action == KVT_CHUNK_GC_TMP)
    snprintf(g->tmp_path, sizeof g->tmp_path, "%s", path);
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
  kvt_test_model_hash(hash, "model-a", tok[1], 69);
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
    kvt_test_model_hash(h, "model-a", tok[c], 69);
    REQUIRE(kvt_tier_entry_chain(&ch, &n, NULL, t, h, 0) == 0 && n == 4);
    snprintf(below_key[c], 65, "%s", ch[2].key);
    snprintf(last_key[c], 65, "%s", ch[3].key);
    kvt_free(ch);
  }
  CHECK(kvt_tier_close(t, -1) == 0);
  kvt_tier_free(t);

  /* Another model_id: none of model-a's entries is found or served (names
   * and chains are keyed by the model's namespace). */
  t = open_tier(dir, C, "model-b", 0);
  kvt_entry *e = NULL;
  kvt_entry_info mi;
  for (int c = 0; c < 3; c++) {
    CHECK(kvt_tier_lookup(&mi, t, tok[c], 69) == KVT_ENOTFOUND);
    CHECK(kvt_tier_lookup_prefix(&mi, t, tok[c], 69) == KVT_ENOTFOUND);
    CHECK(kvt_tier_promote(&e, t, tok[c], 69, NULL) == KVT_ENOTFOUND);
  }
  CHECK(kvt_tier_close(t, -1) == 0);
  kvt_tier_free(t);
  /* The same model_id with another chunk size: the chained entries still
   * read (by their records' parent links), and every chunk verifies. */
  t = open_tier(dir, 64, "model-a", 0);
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
    kvt_test_model_hash(h, "model-a", tok[c], 69);
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
  /* The writer's own tier reopened: the damage mark is read back from
   * quarantine/ (nothing is offered through the chunk, nothing counted
   * again); a new conversation over the same system prompt writes it
   * again. */
  t = open_tier(dir, C, "model-a", 0);
  CHECK(kvt_tier_promote(&e, t, tok[1], 69, NULL) == KVT_ENOTFOUND);
  CHECK(kvt_tier_lookup(&info, t, tok[2], 69) == KVT_ENOTFOUND);
  int32_t tok3[69];
  conv(tok3, 3);
  spill(t, tok3, 69);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  REQUIRE(kvt_tier_stats(&st, t) == 0);
  CHECK_EQ_INT(st.chunks_rewritten, 1);
  CHECK_EQ_INT(st.quarantined, 0);
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
  /* The path gc reports is one kvt_cache_name_stat looks at again, as is a
   * chunk's kvt_cache_chunk_name: both the layout's real names. */
  kvt_cache_name_stat_info ns = KVT_CACHE_NAME_STAT_INIT;
  CHECK(strstr(tmp, g.tmp_path) != NULL);
  CHECK_EQ_INT(kvt_cache_name_stat(&ns, dir, KVT_CACHE_AREA_CHUNKS, g.tmp_path),
               0);
  CHECK(!ns.is_dir && ns.mtime > 0);
  char cname[KVT_CACHE_CHUNK_NAME_MAX], cpath[4300];
  REQUIRE(kvt_cache_chunk_name(cname, sizeof cname, shared_key) == 0);
  chunk_path(cpath, sizeof cpath, dir, shared_key);
  CHECK(strlen(cpath) > strlen(cname) &&
        strcmp(cpath + strlen(cpath) - strlen(cname), cname) == 0);
  CHECK_EQ_INT(kvt_cache_name_stat(&ns, dir, KVT_CACHE_AREA_CHUNKS, cname), 0);
  CHECK(!ns.is_dir);
  memset(&g, 0, sizeof g);
  REQUIRE(kvt_tier_chunk_gc(t, 0, gc_cb, NULL, &g, &res) == 0);
  CHECK(g.tmp == 1 && g.adopted == 0 && g.removed == 0 && g.stray == 1);
  CHECK(!kvt_test_exists(tmp));
  CHECK_EQ_INT(kvt_cache_name_stat(&ns, dir, KVT_CACHE_AREA_CHUNKS, g.tmp_path),
               KVT_ENOTFOUND);
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
static void plant_tmp(char *out, size_t cap, const char *dir, const char *kk) {
  char sub[4200];
  snprintf(sub, sizeof sub, "%s/chunks", dir);
  mkdir(sub, 0700);
  snprintf(sub, sizeof sub, "%s/chunks/%s", dir, kk);
  mkdir(sub, 0700);
  snprintf(out, cap, "%s/stale.tmp", sub);
  FILE *f = fopen(out, "wb");
  REQUIRE(f);
  fputs("interrupted", f);
  fclose(f);
}

static void spill_k(kvt_tier *t, int k) {
  int32_t tok[C];
  for (int i = 0; i < C; i++)
    tok[i] = 70000 + k * C + i;
  spill(t, tok, C);
}

/* The writer's sweep: one chunks/<kk> on the first chunked spill and every
 * 64th after it, resuming where the previous pass stopped - also a pass of
 * a previous process (before, each process started at chunks/00 and swept
 * only after 64 spills, so short-lived writers left their leftovers for
 * ever) - and chained-entry records whose entry has neither a row nor
 * files are removed (nothing removed them). */
static void test_lazy_sweep(const char *dir) {
  kvt_tier *t = open_tier(dir, C, NULL, 0);
  char t00[4300], t01[4300], t02[4300];
  plant_tmp(t00, sizeof t00, dir, "00");
  plant_tmp(t01, sizeof t01, dir, "01");
  spill_k(t, 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  CHECK(!kvt_test_exists(t00) && kvt_test_exists(t01));
  for (int k = 1; k < 64; k++)
    spill_k(t, k);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  CHECK(kvt_test_exists(t01)); /* 63 more spills: not yet */
  spill_k(t, 64);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  CHECK(!kvt_test_exists(t01));
  kvt_tier_free(t);

  /* A new process resumes at chunks/02, not 00. */
  plant_tmp(t00, sizeof t00, dir, "00");
  plant_tmp(t02, sizeof t02, dir, "02");
  t = open_tier(dir, C, NULL, 0);
  spill_k(t, 100);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  CHECK(!kvt_test_exists(t02) && kvt_test_exists(t00));
  /* A chained entry whose row and files went (a kill between its chain
   * record and its row leaves the same): its record is dangling. */
  int32_t tok[2 * C + 3];
  for (int i = 0; i < 2 * C + 3; i++)
    tok[i] = 90000 + i;
  spill(t, tok, 2 * C + 3);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  kvt_chunk_totals tot = KVT_CHUNK_TOTALS_INIT;
  REQUIRE(kvt_tier_chunk_totals(&tot, t) == 0);
  uint64_t before = tot.chained_entries;
  kvt_tier_free(t);
  char hash[65], db[4200], ed[4300], q[300];
  REQUIRE(kvt_token_hash(hash, tok, 2 * C + 3) == 0);
  snprintf(db, sizeof db, "%s/index.db", dir);
  sqlite3 *raw;
  REQUIRE(sqlite3_open(db, &raw) == SQLITE_OK);
  snprintf(q, sizeof q, "DELETE FROM entries WHERE token_hash = '%s'", hash);
  REQUIRE(sqlite3_exec(raw, q, NULL, NULL, NULL) == SQLITE_OK);
  sqlite3_close(raw);
  snprintf(ed, sizeof ed, "%s/data/%s", dir, hash);
  kvt_test_rmtree(ed);
  t = open_tier(dir, C, NULL, 0);
  REQUIRE(kvt_tier_chunk_totals(&tot, t) == 0);
  CHECK_EQ_INT(tot.chained_entries, before); /* open keeps it */
  spill_k(t, 200); /* the first pass of this process */
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  REQUIRE(kvt_tier_chunk_totals(&tot, t) == 0);
  CHECK_EQ_INT(tot.chained_entries, before); /* + 1 new, - 1 dangling */
  kvt_tier_free(t);
}

/* Copies every chunks/<kk>/<name> file of dir into to/<kk>/<name>. */
static int copy_chunk_tree(const char *dir, const char *to) {
  int n = 0;
  mkdir(to, 0700);
  for (int a = 0; a < 256; a++) {
    char sub[4200], dsub[4400];
    snprintf(sub, sizeof sub, "%s/chunks/%02x", dir, a);
    DIR *d = opendir(sub);
    if (!d)
      continue;
    snprintf(dsub, sizeof dsub, "%s/%02x", to, a);
    mkdir(dsub, 0700);
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
      if (de->d_name[0] == '.')
        continue;
      char f1[4800], f2[4800];
      snprintf(f1, sizeof f1, "%s/%s", sub, de->d_name);
      snprintf(f2, sizeof f2, "%s/%s", dsub, de->d_name);
      copy_file(f1, f2);
      n++;
    }
    closedir(d);
  }
  return n;
}

static void write_text(const char *path, const char *text) {
  FILE *f = fopen(path, "wb");
  REQUIRE(f);
  fputs(text, f);
  fclose(f);
}

/* Nothing outside the cache is read or removed through a link below it.
 * A chunks/<kk> that is a symlink to a directory elsewhere, holding a
 * chunk-named damaged file and a stale-looking .tmp, then chunks/ itself a
 * symlink to a copy of the real chunk tree elsewhere: gc (dry and real)
 * reports the link as a stray and removes nothing outside, a promote is not
 * served from outside, and a rebuild indexes nothing from there. Before,
 * gc --chunks followed the link and deleted those files. */
static void test_links_not_followed(const char *dir, const char *outside) {
  kvt_tier *t = open_tier(dir, C, NULL, 0);
  int32_t tok[69];
  conv(tok, 0);
  spill(t, tok, 69);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  /* A chunks/<kk> no chunk of this cache uses. */
  char kk[3] = "";
  for (int a = 0; a < 256 && !kk[0]; a++) {
    char sub[4200];
    snprintf(sub, sizeof sub, "%s/chunks/%02x", dir, a);
    if (!kvt_test_exists(sub))
      snprintf(kk, sizeof kk, "%02x", a);
  }
  REQUIRE(kk[0]);
  mkdir(outside, 0700);
  char out1[4200], victim[4400], vtmp[4400], link[4200];
  snprintf(out1, sizeof out1, "%s/one", outside);
  mkdir(out1, 0700);
  snprintf(victim, sizeof victim, "%s/%s%062d.kvc", out1, kk, 0);
  write_text(victim, "not a chunk, and not the cache's");
  snprintf(vtmp, sizeof vtmp, "%s/%s%062d.tmp", out1, kk, 1);
  write_text(vtmp, "someone's temporary file");
  snprintf(link, sizeof link, "%s/chunks/%s", dir, kk);
  REQUIRE(symlink(out1, link) == 0);
  gcseen g = {0};
  kvt_chunk_gc_result res;
  REQUIRE(kvt_tier_chunk_gc(t, 1, gc_cb, NULL, &g, &res) == 0);
  CHECK_EQ_INT(g.stray, 1);
  CHECK(g.tmp == 0 && g.removed == 0);
  memset(&g, 0, sizeof g);
  REQUIRE(kvt_tier_chunk_gc(t, 0, gc_cb, NULL, &g, &res) == 0);
  CHECK_EQ_INT(g.stray, 1);
  CHECK(g.tmp == 0 && g.removed == 0);
  CHECK(kvt_test_exists(victim) && kvt_test_exists(vtmp));
  REQUIRE(unlink(link) == 0);

  /* chunks/ itself a link to a copy elsewhere, the real one moved aside. */
  char out2[4200], real[4200], moved[4200], vict2[4400], vtmp2[4400];
  snprintf(out2, sizeof out2, "%s/two", outside);
  REQUIRE(copy_chunk_tree(dir, out2) == 4); /* 69 tokens: 4 chunks */
  snprintf(vict2, sizeof vict2, "%s/%s", out2, kk);
  mkdir(vict2, 0700);
  snprintf(vtmp2, sizeof vtmp2, "%s/%s/%s%062d.tmp", out2, kk, kk, 2);
  write_text(vtmp2, "someone's temporary file");
  snprintf(vict2, sizeof vict2, "%s/%s/%s%062d.kvc", out2, kk, kk, 3);
  write_text(vict2, "not a chunk, and not the cache's");
  snprintf(real, sizeof real, "%s/chunks", dir);
  snprintf(moved, sizeof moved, "%s/chunks.aside", dir);
  REQUIRE(rename(real, moved) == 0);
  REQUIRE(symlink(out2, real) == 0);
  memset(&g, 0, sizeof g);
  REQUIRE(kvt_tier_chunk_gc(t, 0, gc_cb, NULL, &g, &res) == 0);
  CHECK_EQ_INT(g.stray, 1);
  CHECK(g.tmp == 0 && g.removed == 0 && g.adopted == 0);
  CHECK(kvt_test_exists(vict2) && kvt_test_exists(vtmp2));
  /* The entry's chunks are reached only through the link: not served. */
  kvt_entry *e = NULL;
  CHECK(kvt_tier_promote(&e, t, tok, 69, NULL) != 0);
  CHECK(e == NULL);
  kvt_entry_free(e);
  kvt_tier_free(t);
  /* A rebuild of the index finds no chunk through the link. */
  t = open_tier(dir, C, NULL, KVT_OPEN_REINDEX);
  kvt_chunk_totals tot = KVT_CHUNK_TOTALS_INIT;
  REQUIRE(kvt_tier_chunk_totals(&tot, t) == 0);
  CHECK_EQ_INT(tot.chunks, 0);
  kvt_tier_free(t);
  CHECK(kvt_test_exists(vict2) && kvt_test_exists(vtmp2));
}

/* A chunk file replaced by a symbolic link (to a valid copy outside): a
 * damaged chunk. verify reports it, --repair moves the link itself to
 * quarantine/ (the target is never touched) and the tier is clean after.
 * Before, every read and verify failed with KVT_EPERM for ever while the
 * repair claimed to have moved it. */
static void test_linked_chunk_file(const char *dir, const char *outside) {
  kvt_tier *t = open_tier(dir, C, NULL, 0);
  int32_t tok[69];
  conv(tok, 1);
  spill(t, tok, 69);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  char hash[65];
  REQUIRE(kvt_token_hash(hash, tok, 69) == 0);
  kvt_chunk_info *ch = NULL;
  size_t n = 0;
  REQUIRE(kvt_tier_entry_chain(&ch, &n, NULL, t, hash, 0) == 0 && n == 4);
  char key[65], p[4096], copy[4200];
  snprintf(key, sizeof key, "%s", ch[3].key);
  kvt_free(ch);
  chunk_path(p, sizeof p, dir, key);
  mkdir(outside, 0700);
  snprintf(copy, sizeof copy, "%s/%s.kvc", outside, key);
  copy_file(p, copy);
  REQUIRE(unlink(p) == 0 && symlink(copy, p) == 0);
  uint64_t ents = 99;
  CHECK(kvt_tier_chunk_verify(t, key, 0, &ents) == KVT_ECORRUPT);
  CHECK(strstr(kvt_last_error(), "symbolic link") != NULL);
  CHECK(kvt_tier_chunk_verify(t, key, 1, &ents) == KVT_ECORRUPT);
  CHECK_EQ_INT(ents, 1);
  struct stat st;
  CHECK(lstat(p, &st) != 0);    /* the link left chunks/ */
  CHECK(kvt_test_exists(copy)); /* its target untouched */
  kvt_entry *e = NULL;
  CHECK(kvt_tier_promote(&e, t, tok, 69, NULL) == KVT_ENOTFOUND && !e);
  kvt_entry_free(e);
  /* The serving path finds it the same way: another entry, another link. */
  conv(tok, 2);
  spill(t, tok, 69);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  REQUIRE(kvt_token_hash(hash, tok, 69) == 0);
  REQUIRE(kvt_tier_entry_chain(&ch, &n, NULL, t, hash, 0) == 0 && n == 4);
  char key2[65], p2[4096];
  snprintf(key2, sizeof key2, "%s", ch[3].key);
  kvt_free(ch);
  chunk_path(p2, sizeof p2, dir, key2);
  snprintf(copy, sizeof copy, "%s/%s.kvc", outside, key2);
  copy_file(p2, copy);
  REQUIRE(unlink(p2) == 0 && symlink(copy, p2) == 0);
  CHECK(kvt_tier_promote(&e, t, tok, 69, NULL) == KVT_ECORRUPT && !e);
  CHECK(lstat(p2, &st) != 0 && kvt_test_exists(copy));
  CHECK(kvt_tier_promote(&e, t, tok, 69, NULL) == KVT_ENOTFOUND && !e);
  /* The chunk keeps its row (damage is contained: the entries through it
   * stay, unservable until a spill writes it again), so verify still
   * reports its file missing. */
  int vrc = kvt_tier_chunk_verify(t, key2, 0, NULL);
  CHECK(vrc != 0 && vrc != KVT_EPERM);
  CHECK(strstr(kvt_last_error(), "missing") != NULL);
  kvt_tier_free(t);
}

/* Last chunk key of conversation c's entry (69 tokens: 4 chunks). */
static void last_key(char key[65], kvt_tier *t, const int32_t *tok) {
  char hash[65];
  REQUIRE(kvt_token_hash(hash, tok, 69) == 0);
  kvt_chunk_info *ch = NULL;
  size_t n = 0;
  REQUIRE(kvt_tier_entry_chain(&ch, &n, NULL, t, hash, 0) == 0 && n == 4);
  snprintf(key, 65, "%s", ch[3].key);
  kvt_free(ch);
}

/* chunks/<kk> swapped for a link to a directory outside the cache while a
 * damaged chunk in it is being verified (the swap runs inside the verify's
 * first read, after its file was opened): containing the damage must not
 * move the file, now outside, into quarantine/. Before, the routine renamed
 * by path, through the link. */
static char g_swap_from[4200], g_swap_to[4200];
static int g_swap_armed;
static ssize_t swap_pread(int fd, void *buf, size_t n, off_t off) {
  if (g_swap_armed) {
    g_swap_armed = 0;
    REQUIRE(rename(g_swap_from, g_swap_to) == 0 &&
            symlink(g_swap_to, g_swap_from) == 0);
  }
  return kvti_io_default.pread(fd, buf, n, off);
}

static void test_damage_through_linked_subdir(const char *dir,
                                              const char *outside) {
  kvt_tier *t = open_tier(dir, C, NULL, 0);
  int32_t tok[69];
  conv(tok, 7);
  spill(t, tok, 69);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  char key[65], p[4096], victim[4400];
  last_key(key, t, tok);
  chunk_path(p, sizeof p, dir, key);
  flip_last(p);
  mkdir(outside, 0700);
  snprintf(g_swap_from, sizeof g_swap_from, "%s/chunks/%.2s", dir, key);
  snprintf(g_swap_to, sizeof g_swap_to, "%s/%.2s", outside, key);
  snprintf(victim, sizeof victim, "%s/%s.kvc", g_swap_to, key);
  kvti_io_ops ops = kvti_io_default;
  ops.pread = swap_pread;
  g_swap_armed = 1;
  const kvti_io_ops *prev = kvti_io_set(&ops);
  uint64_t ents = 0;
  CHECK(kvt_tier_chunk_verify(t, key, 1, &ents) == KVT_ECORRUPT);
  kvti_io_set(prev);
  CHECK(!g_swap_armed);
  CHECK(kvt_test_exists(victim)); /* never moved through the link */
  char q[4400];
  snprintf(q, sizeof q, "%s/quarantine/chunk-%s/%s.kvc", dir, key, key);
  CHECK(!kvt_test_exists(q));
  kvt_tier_free(t);
}

/* quarantine_max bounds quarantined chunks as it bounds entries: the oldest
 * moves go first, the newest stay. Before, every damaged chunk added a
 * quarantine/chunk-* directory for ever. */
static void test_chunk_quarantine_bounded(const char *dir) {
  kvt_options o = KVT_OPTIONS_INIT;
  o.cache_dir = dir;
  o.durability = KVT_DURABILITY_NONE;
  o.chunk_tokens = C;
  o.host_cache_bytes = 0;
  o.quarantine_max = 2;
  kvt_tier *t;
  REQUIRE(kvt_tier_open(&t, &o) == 0);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  char keys[4][65];
  int32_t tok[69];
  for (int c = 0; c < 4; c++) {
    conv(tok, 20 + c);
    spill(t, tok, 69);
    REQUIRE(kvt_tier_flush(t, -1) == 0);
    last_key(keys[c], t, tok);
  }
  for (int c = 0; c < 4; c++) {
    char p[4096];
    chunk_path(p, sizeof p, dir, keys[c]);
    flip_last(p);
    uint64_t ents = 0;
    CHECK(kvt_tier_chunk_verify(t, keys[c], 1, &ents) == KVT_ECORRUPT);
    CHECK_EQ_INT(ents, 1);
  }
  int kept = 0;
  for (int c = 0; c < 4; c++) {
    char q[4400];
    snprintf(q, sizeof q, "%s/quarantine/chunk-%s", dir, keys[c]);
    kept += kvt_test_exists(q);
    if (c == 3)
      CHECK(kvt_test_exists(q)); /* the newest is never the one to go */
  }
  CHECK_EQ_INT(kept, 2);
  kvt_tier_free(t);
}

/* The entry and chunk quarantine bounds are separate: with quarantine_max
 * 2, two quarantined chunks (quarantine/chunk-*) and three quarantined
 * entries leave both chunks and the two newest entries - the entry bound
 * neither removes chunk records (which a reopened tier reads its damaged
 * marks from) nor counts them, and never removes the entry just moved.
 * Before, the entry bound counted every name in quarantine/ and removed the
 * chunk-* directories first (the oldest). */
static void test_two_quarantine_bounds(const char *dir) {
  kvt_options o = KVT_OPTIONS_INIT;
  o.cache_dir = dir;
  o.durability = KVT_DURABILITY_NONE;
  o.chunk_tokens = C;
  o.host_cache_bytes = 0;
  o.quarantine_max = 2;
  kvt_tier *t;
  REQUIRE(kvt_tier_open(&t, &o) == 0);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  char keys[2][65];
  int32_t tok[69];
  for (int c = 0; c < 2; c++) {
    conv(tok, 40 + c);
    spill(t, tok, 69);
    REQUIRE(kvt_tier_flush(t, -1) == 0);
    last_key(keys[c], t, tok);
  }
  int32_t small[3][8];
  char hs[3][65];
  for (int e = 0; e < 3; e++) {
    for (int i = 0; i < 8; i++)
      small[e][i] = 90000 + e * 10 + i; /* shorter than a chunk: an entry */
    spill(t, small[e], 8);
    kvt_token_hash(hs[e], small[e], 8);
  }
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  for (int c = 0; c < 2; c++) {
    char p[4096];
    chunk_path(p, sizeof p, dir, keys[c]);
    flip_last(p);
    uint64_t ents = 0;
    CHECK(kvt_tier_chunk_verify(t, keys[c], 1, &ents) == KVT_ECORRUPT);
  }
  for (int e = 0; e < 3; e++) {
    char p[4400];
    snprintf(p, sizeof p, "%s/data/%s/layer_0.safetensors", dir, hs[e]);
    flip_last(p);
    CHECK(kvt_tier_verify(t, hs[e], 1) != 0);
    char dd[4400];
    snprintf(dd, sizeof dd, "%s/data/%s", dir, hs[e]);
    CHECK(!kvt_test_exists(dd));
  }
  int chunks_kept = 0, entries_kept = 0;
  for (int c = 0; c < 2; c++) {
    char q[4400];
    snprintf(q, sizeof q, "%s/quarantine/chunk-%s", dir, keys[c]);
    chunks_kept += kvt_test_exists(q);
  }
  for (int e = 0; e < 3; e++) {
    char q[4400];
    snprintf(q, sizeof q, "%s/quarantine/%s", dir, hs[e]);
    entries_kept += kvt_test_exists(q);
    if (e == 2)
      CHECK(kvt_test_exists(q)); /* the one just moved stays */
  }
  CHECK_EQ_INT(chunks_kept, 2);
  CHECK_EQ_INT(entries_kept, 2);
  kvt_tier_free(t);
}

int main(void) {
  char *d = kvt_test_tmpdir("chunktools");
  char a[1024], b[1024];
  snprintf(a, sizeof a, "%s/a", d);
  snprintf(b, sizeof b, "%s/b", d);
  test_tools(a);
  test_lazy_sweep(b);
  char c[1024], o[1024];
  snprintf(c, sizeof c, "%s/c", d);
  snprintf(o, sizeof o, "%s/outside", d);
  test_links_not_followed(c, o);
  char e2[1024], o2[1024];
  snprintf(e2, sizeof e2, "%s/e", d);
  snprintf(o2, sizeof o2, "%s/outside2", d);
  test_linked_chunk_file(e2, o2);
  char f[1024], o3[1024], g[1024];
  snprintf(f, sizeof f, "%s/f", d);
  snprintf(o3, sizeof o3, "%s/outside3", d);
  test_damage_through_linked_subdir(f, o3);
  snprintf(g, sizeof g, "%s/g", d);
  test_chunk_quarantine_bounded(g);
  char h2[1024];
  snprintf(h2, sizeof h2, "%s/h", d);
  test_two_quarantine_bounds(h2);
  return kvt_test_done(); /* the tmpdir is removed at exit */
}
