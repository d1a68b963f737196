/*
 * test_chainrec_tier.c - entries of the chunked store that are their chain
 * alone (format/chainrec.h, store/chunked_rec.h): a pure-KV spill with no
 * tail rows is stored as one chain record (data/<hash>/chain.kvr and nothing
 * else), reads back bit for bit (exact, trimmed, read_entry), is replaced by
 * and replaces tail entries of the same tokens; every flipped byte or
 * truncation of a record is refused by the parser and a damaged record is
 * never served; after the index is rebuilt (KVT_OPEN_REINDEX) reconcile
 * adopts record and tail entries and re-attaches their chains from the chunk
 * files (promotes bit-exact, a tail never read as a whole entry), and
 * quarantines a record whose chain lost a chunk.
 */
#include "fmt_testlib.h"
#include "tier_testlib.h"
#include "format/chainrec.h"
#include "kvtier.h"

#include <dirent.h>
#include <unistd.h>

#define C 16

static char *g_dir;

static kvt_tier *open_tier(const char *dir, uint32_t flags) {
  kvt_options o = KVT_OPTIONS_INIT;
  o.cache_dir = dir;
  o.durability = KVT_DURABILITY_FSYNC;
  o.chunk_tokens = C;
  o.model_id = "rec-model";
  o.flags |= flags;
  kvt_tier *t;
  REQUIRE(kvt_tier_open(&t, &o) == 0);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  return t;
}

static void close_tier(kvt_tier *t) {
  REQUIRE(kvt_tier_close(t, 30000) == 0);
  kvt_tier_free(t);
}

static void spill(kvt_tier *t, const int32_t *tok, int n, int T) {
  CHECK(t_kv_spill(t, tok, n, T, 2, 4242) == 0);
  REQUIRE(kvt_tier_flush(t, 30000) == 0);
}

static int matches(const kvt_entry *e, const int32_t *tok, int n, int T) {
  return t_kv_matches(e, tok, n, T, 2);
}

/* Files in data/<hash of tok>/; *rec = 1 when one of them is chain.kvr. */
static int entry_files(const char *dir, const int32_t *tok, int n, int *rec) {
  char h[65], p[4200];
  kvt_test_model_hash(h, "rec-model", tok, (size_t)n);
  snprintf(p, sizeof p, "%s/data/%s", dir, h);
  DIR *d = opendir(p);
  int k = 0;
  *rec = 0;
  struct dirent *de;
  while (d && (de = readdir(d))) {
    if (de->d_name[0] == '.')
      continue;
    k++;
    *rec |= strcmp(de->d_name, KVTI_CHAINREC_FILE) == 0;
  }
  if (d)
    closedir(d);
  return d ? k : -1;
}

static void rec_file(char *out, size_t cap, const char *dir, const int32_t *tok,
                     int n) {
  char h[65];
  kvt_test_model_hash(h, "rec-model", tok, (size_t)n);
  snprintf(out, cap, "%s/data/%s/%s", dir, h, KVTI_CHAINREC_FILE);
}

static void toks(int32_t *t, int n, int seed) {
  for (int i = 0; i < n; i++)
    t[i] = seed * 1000 + i;
}

static void test_record_entry(void) {
  char *dir = t_join(g_dir, "rec");
  kvt_tier *t = open_tier(dir, 0);
  int32_t a[64];
  toks(a, 64, 1);
  spill(t, a, 64, 64); /* 4 chunks, no tail rows: a record */
  int rec = 0;
  CHECK_EQ_INT(entry_files(dir, a, 64, &rec), 1);
  CHECK(rec);
  kvt_entry_info info;
  REQUIRE(kvt_tier_lookup(&info, t, a, 64) == 0);
  CHECK_EQ_INT(info.memory_bytes, 4242);
  kvt_promote_opts po = KVT_PROMOTE_OPTS_INIT;
  kvt_entry *e = NULL;
  REQUIRE(kvt_tier_promote(&e, t, a, 64, &po) == 0);
  CHECK(matches(e, a, 64, 64));
  kvt_entry_free(e);
  char h[65];
  kvt_test_model_hash(h, "rec-model", a, 64);
  REQUIRE(kvt_tier_read_entry(&e, t, a, 64, h) == 0);
  CHECK(matches(e, a, 64, 64));
  kvt_entry_free(e);
  REQUIRE(kvt_tier_promote_trim(&e, t, a, 64, 40, &po) == 0);
  CHECK_EQ_INT(kvt_entry_layer(e, 0)->tensors[0].shape[2], 40);
  kvt_entry_free(e);
  CHECK(kvt_tier_verify(t, h, 0) == 0);
  char *dj = NULL; /* describe (the CLI's show) of a record entry */
  REQUIRE(kvt_tier_describe(&dj, t, h) == 0);
  CHECK(strstr(dj, "\"chain-record\"") != NULL);
  CHECK(strstr(dj, "\"num_tokens\":64") != NULL);
  kvt_free(dj);
  /* The same tokens with spare rows: a tail entry replaces the record... */
  spill(t, a, 64, 80);
  CHECK(entry_files(dir, a, 64, &rec) > 1);
  CHECK(!rec);
  REQUIRE(kvt_tier_promote(&e, t, a, 64, &po) == 0);
  CHECK(matches(e, a, 64, 80));
  kvt_entry_free(e);
  /* ...and a record replaces the tail entry. */
  spill(t, a, 64, 64);
  CHECK_EQ_INT(entry_files(dir, a, 64, &rec), 1);
  CHECK(rec);
  REQUIRE(kvt_tier_promote(&e, t, a, 64, &po) == 0);
  CHECK(matches(e, a, 64, 64));
  kvt_entry_free(e);
  /* A spill whose offset is short of the token extent keeps a tail. */
  int32_t b[64];
  toks(b, 64, 2);
  spill(t, b, 50, 64);
  CHECK(entry_files(dir, b, 50, &rec) > 1);
  CHECK(!rec);
  REQUIRE(kvt_tier_promote(&e, t, b, 50, &po) == 0);
  CHECK(matches(e, b, 50, 64));
  kvt_entry_free(e);
  /* Removal takes the record's directory. */
  CHECK(kvt_tier_remove(t, a, 64) == 0);
  CHECK_EQ_INT(entry_files(dir, a, 64, &rec), -1);
  close_tier(t);
  free(dir);
}

/* Every single flipped byte and every truncation is refused. */
static void test_parse_strict(void) {
  char *dir = t_join(g_dir, "parse");
  kvt_tier *t = open_tier(dir, 0);
  int32_t a[48];
  toks(a, 48, 3);
  spill(t, a, 48, 48);
  close_tier(t);
  char p[4400], h[65];
  rec_file(p, sizeof p, dir, a, 48);
  kvt_test_model_hash(h, "rec-model", a, 48);
  size_t n = 0;
  uint8_t *buf = (uint8_t *)kvt_test_read_file(p, &n);
  REQUIRE(buf != NULL);
  kvti_chainrec r;
  REQUIRE(kvti_chainrec_parse(&r, buf, n, h, "rec") == 0);
  CHECK_EQ_INT(r.n_tokens, 48);
  CHECK_EQ_INT(r.chunks, 3);
  CHECK_EQ_INT(r.total_rows, 48);
  CHECK(memcmp(r.tokens, a, sizeof a) == 0);
  kvti_chainrec_free(&r);
  int refused = 0;
  for (size_t i = 0; i < n; i++) {
    buf[i] ^= 0x04;
    refused += kvti_chainrec_parse(&r, buf, n, h, "rec") != 0;
    kvti_chainrec_free(&r);
    buf[i] ^= 0x04;
  }
  CHECK_EQ_INT(refused, n);
  for (size_t k = 0; k < n; k++) {
    CHECK(kvti_chainrec_parse(&r, buf, k, h, "rec") != 0);
    kvti_chainrec_free(&r);
  }
  /* The name must be the record's. */
  char other[65];
  memset(other, 'a', 64);
  other[64] = 0;
  CHECK(kvti_chainrec_parse(&r, buf, n, other, "rec") == KVT_ECORRUPT);
  /* A damaged record on disk is never served. */
  buf[200] ^= 0x01;
  t_write_all(p, (char *)buf, n);
  t = open_tier(dir, 0);
  kvt_entry *e = NULL;
  kvt_promote_opts po = KVT_PROMOTE_OPTS_INIT;
  int rc = kvt_tier_promote(&e, t, a, 48, &po);
  CHECK(rc == KVT_ECORRUPT || rc == KVT_ENOTFOUND);
  CHECK(e == NULL);
  close_tier(t);
  free(buf);
  free(dir);
}

static int chunk_path_of(const char *dir, char *out, size_t cap, int skip) {
  char cd[4096];
  for (int x = 0; x < 256; x++) {
    snprintf(cd, sizeof cd, "%s/chunks/%02x", dir, x);
    DIR *d = opendir(cd);
    struct dirent *de;
    while (d && (de = readdir(d))) {
      if (!strstr(de->d_name, ".kvc") || skip-- > 0)
        continue;
      snprintf(out, cap, "%s/%s", cd, de->d_name);
      closedir(d);
      return 0;
    }
    if (d)
      closedir(d);
  }
  return -1;
}

static void test_reindex(void) {
  char *dir = t_join(g_dir, "reidx");
  kvt_tier *t = open_tier(dir, 0);
  int32_t a[3][64];
  for (int k = 0; k < 3; k++) {
    toks(a[k], 64, 10 + k);
    spill(t, a[k], 64, 64);
  }
  int32_t tb[64]; /* a tail entry: 48 rows in its chain, 16 in its files */
  toks(tb, 64, 20);
  spill(t, tb, 56, 64);
  close_tier(t);
  /* The index is rebuilt from the directories: records and chunk files. */
  t = open_tier(dir, KVT_OPEN_REINDEX);
  kvt_promote_opts po = KVT_PROMOTE_OPTS_INIT;
  {
    /* The tail is adopted with its chain, never read as a whole entry. */
    kvt_entry *e = NULL;
    REQUIRE(kvt_tier_promote(&e, t, tb, 56, &po) == 0);
    CHECK(matches(e, tb, 56, 64));
    kvt_entry_free(e);
  }
  for (int k = 0; k < 3; k++) {
    kvt_entry_info info;
    REQUIRE(kvt_tier_lookup(&info, t, a[k], 64) == 0);
    CHECK_EQ_INT(info.memory_bytes, 4242);
    kvt_entry *e = NULL;
    REQUIRE(kvt_tier_promote(&e, t, a[k], 64, &po) == 0);
    CHECK(matches(e, a[k], 64, 64));
    kvt_entry_free(e);
    /* The chain is indexed again: prefix lookups see it. */
    REQUIRE(kvt_tier_lookup_prefix(&info, t, a[k], 48) == 0);
    CHECK_EQ_INT(info.num_tokens, 48);
  }
  close_tier(t);
  /* A chunk file lost while the index is rebuilt: the entries through it
   * are quarantined, never served. */
  char cp[4400];
  REQUIRE(chunk_path_of(dir, cp, sizeof cp, 0) == 0);
  REQUIRE(unlink(cp) == 0);
  t = open_tier(dir, KVT_OPEN_REINDEX);
  int served = 0;
  for (int k = 0; k < 3; k++) {
    kvt_entry *e = NULL;
    int rc = kvt_tier_promote(&e, t, a[k], 64, &po);
    if (rc == 0) {
      CHECK(matches(e, a[k], 64, 64));
      kvt_entry_free(e);
      served++;
    } else {
      CHECK(rc == KVT_ENOTFOUND);
    }
  }
  CHECK_EQ_INT(served, 2);
  kvt_stats st = KVT_STATS_INIT;
  REQUIRE(kvt_tier_stats(&st, t) == 0);
  CHECK(st.quarantined >= 1);
  close_tier(t);
  free(dir);
}

/* A salted spill of m x C tokens with no tail rows is a record too: its
 * name is the salted key, which the record's namespace (holding the salt's
 * digest) lets the parser recompute. It is served to its salt (promote,
 * read_entry, verify) and survives an index rebuild; another salt or none
 * never sees it. */
static void test_salted_record(void) {
  char *dir = t_join(g_dir, "salted");
  kvt_tier *t = open_tier(dir, 0);
  int32_t a[64];
  toks(a, 64, 3);
  kvt_call_opts co = KVT_CALL_OPTS_INIT;
  co.cache_salt = "tenant-a";
  co.cache_salt_len = strlen(co.cache_salt);
  kvt_layer l[2];
  for (int i = 0; i < 2; i++)
    l[i] = t_kv_tokens(a, 64, 64, 8, i);
  REQUIRE(kvt_tier_spill_ex(t, a, 64, l, 2, 4242, &co) == 0);
  for (int i = 0; i < 2; i++)
    t_layer_free(&l[i]);
  REQUIRE(kvt_tier_flush(t, 30000) == 0);
  kvt_entry_info info;
  for (int round = 0; round < 2; round++) {
    REQUIRE(kvt_tier_lookup_ex(&info, t, a, 64, &co) == 0);
    char p[4300];
    snprintf(p, sizeof p, "%s/data/%s/%s", dir, info.token_hash,
             KVTI_CHAINREC_FILE);
    CHECK(access(p, F_OK) == 0); /* stored as a record */
    kvt_promote_opts po = KVT_PROMOTE_OPTS_INIT;
    po.cache_salt = co.cache_salt;
    po.cache_salt_len = co.cache_salt_len;
    kvt_entry *e = NULL;
    REQUIRE(kvt_tier_promote(&e, t, a, 64, &po) == 0);
    CHECK(matches(e, a, 64, 64));
    kvt_entry_free(e);
    e = NULL;
    REQUIRE(kvt_tier_read_entry_ex(&e, t, a, 64, info.token_hash, &co) == 0);
    CHECK(matches(e, a, 64, 64));
    kvt_entry_free(e);
    CHECK_EQ_INT(kvt_tier_verify(t, info.token_hash, 0), 0);
    CHECK_EQ_INT(kvt_tier_lookup(&info, t, a, 64), KVT_ENOTFOUND);
    kvt_stats st = KVT_STATS_INIT;
    REQUIRE(kvt_tier_stats(&st, t) == 0);
    CHECK_EQ_INT(st.quarantined, 0);
    close_tier(t);
    t = open_tier(dir, KVT_OPEN_REINDEX); /* round 1: after a rebuild */
  }
  close_tier(t);
  free(dir);
}

int main(void) {
  g_dir = kvt_test_tmpdir("chainrec");
  RUN(test_record_entry);
  RUN(test_parse_strict);
  RUN(test_reindex);
  RUN(test_salted_record);
  return kvt_test_done();
}
