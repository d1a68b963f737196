/*
 * test_index_recovery_tier.c - the index is never the only copy (issue 18,
 * item 1). Every entry directory holds what its row says (manifest, tokens),
 * so a lost or damaged index.db must cost nothing but the time to rebuild it:
 * deleted, overwritten with garbage, damaged inside (SQLITE_CORRUPT while the
 * rows are loaded), or replaced by a FIFO, the next open rebuilds it from the
 * entry directories (the bad file kept aside as index.db.corrupt-<time>) and
 * serves every valid entry bit-exact. Reconcile at open and an explicit
 * reconcile (what `kvtier verify --repair` runs) follow one rule: a valid
 * entry without a row is adopted, an invalid one quarantined, none deleted
 * for lack of a row. KVT_OPEN_REINDEX (`kvtier reindex`) rebuilds on demand.
 */
#include "rel_tier.h"

#include <sqlite3.h>
#include <sys/stat.h>

#define N_ENTRIES 6

static char g_root[4096];

typedef struct fixture {
  char *dir;
  t_entry e[N_ENTRIES];
  char h[N_ENTRIES][65];
} fixture;

static void fx_init(fixture *f, const char *name) {
  memset(f, 0, sizeof *f);
  f->dir = rel_path(g_root, name, NULL);
  kvt_options o = rel_opts(f->dir, KVT_DURABILITY_NONE);
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  for (int i = 0; i < N_ENTRIES; i++) {
    f->e[i] =
        t_make(100 + (uint64_t)i, 10 + (size_t)i, 1 + (uint32_t)(i % 3), 4, 4);
    kvt_token_hash(f->h[i], f->e[i].tokens, f->e[i].n_tokens);
    REQUIRE(t_spill(t, &f->e[i]) == 0);
  }
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  REQUIRE(kvt_tier_close(t, -1) == 0);
  kvt_tier_free(t);
}

static void fx_free(fixture *f) {
  for (int i = 0; i < N_ENTRIES; i++)
    t_free(&f->e[i]);
  free(f->dir);
}

/* Number of entries of f served bit-exact by t; skip: one index not
 * expected (-1: none). */
static int served(kvt_tier *t, const fixture *f, int skip) {
  int n = 0;
  for (int i = 0; i < N_ENTRIES; i++) {
    if (i == skip)
      continue;
    kvt_entry *got = NULL;
    int rc = kvt_tier_promote(&got, t, f->e[i].tokens, f->e[i].n_tokens, NULL);
    if (rc == 0 && t_same(got, &f->e[i]))
      n++;
    else
      fprintf(stderr, "  entry %d not served: %d (%s)\n", i, rc,
              kvt_last_error());
    kvt_entry_free(got);
  }
  return n;
}

/* Names in dir starting with prefix (a set-aside WAL, "...-wal", not
 * counted). */
static int count_prefix(const char *dir, const char *prefix) {
  DIR *d = opendir(dir);
  int n = 0;
  struct dirent *de;
  while (d && (de = readdir(d))) {
    size_t l = strlen(de->d_name);
    if (!strncmp(de->d_name, prefix, strlen(prefix)) &&
        !(l > 4 && !strcmp(de->d_name + l - 4, "-wal")))
      n++;
  }
  if (d)
    closedir(d);
  return n;
}

static int64_t rows_of(kvt_tier *t) {
  kvt_stats s = KVT_STATS_INIT;
  kvt_tier_stats(&s, t);
  return (int64_t)s.entries;
}

/* Opens f's directory and checks every entry is served; returns the tier. */
static kvt_tier *open_and_check(const fixture *f, uint32_t flags) {
  kvt_options o = rel_opts(f->dir, KVT_DURABILITY_NONE);
  o.flags = flags;
  kvt_tier *t = NULL;
  int rc = kvt_tier_open(&t, &o);
  if (rc != 0)
    fprintf(stderr, "  open: %d (%s)\n", rc, kvt_last_error());
  CHECK_EQ_INT(rc, 0);
  if (rc != 0)
    return NULL;
  CHECK_EQ_INT(served(t, f, -1), N_ENTRIES);
  CHECK_EQ_INT(rows_of(t), N_ENTRIES);
  return t;
}

static void close_tier(kvt_tier *t) {
  if (!t)
    return;
  CHECK_EQ_INT(kvt_tier_close(t, -1), 0);
  kvt_tier_free(t);
}

static void test_index_deleted(void) {
  fixture f;
  fx_init(&f, "deleted");
  rel_rm_index(f.dir);
  close_tier(open_and_check(&f, 0));
  /* The rebuilt index is a real one: a plain reopen serves everything. */
  close_tier(open_and_check(&f, 0));
  CHECK_EQ_INT(rel_check_dir(f.dir, NULL), N_ENTRIES);
  fx_free(&f);
}

static void test_index_garbage(void) {
  fixture f;
  fx_init(&f, "garbage");
  rel_rm_index(f.dir);
  char *db = rel_path(f.dir, "index.db", NULL);
  char junk[8192];
  kvt_rng r = {7};
  kvt_rng_fill(&r, junk, sizeof junk);
  REQUIRE(t_write_all(db, junk, sizeof junk) == 0);
  close_tier(open_and_check(&f, 0));
  CHECK_EQ_INT(count_prefix(f.dir, "index.db.corrupt-"), 1);
  /* Kept aside byte for byte. */
  char name[256] = "";
  DIR *d = opendir(f.dir);
  struct dirent *de;
  while (d && (de = readdir(d)))
    if (!strncmp(de->d_name, "index.db.corrupt-", 17) &&
        !strstr(de->d_name, "-wal") && !strstr(de->d_name, "-shm"))
      snprintf(name, sizeof name, "%s", de->d_name);
  if (d)
    closedir(d);
  char *aside = rel_path(f.dir, name, NULL);
  size_t n = 0;
  char *b = kvt_test_read_file(aside, &n);
  CHECK(b && n == sizeof junk && !memcmp(b, junk, n));
  free(b);
  free(aside);
  free(db);
  CHECK_EQ_INT(rel_check_dir(f.dir, NULL), N_ENTRIES);
  fx_free(&f);
}

/* A valid database whose pages are damaged: SQLITE_CORRUPT while the rows
 * are read, not at open. */
static void test_index_damaged_pages(void) {
  fixture f;
  fx_init(&f, "damaged");
  /* Fold the WAL into index.db first so the damage is in the database. */
  char *db = rel_path(f.dir, "index.db", NULL);
  sqlite3 *h = NULL;
  REQUIRE(sqlite3_open(db, &h) == SQLITE_OK);
  sqlite3_exec(h, "PRAGMA wal_checkpoint(TRUNCATE)", NULL, NULL, NULL);
  sqlite3_exec(h, "PRAGMA journal_mode=DELETE", NULL, NULL, NULL);
  sqlite3_close(h);
  struct stat st;
  REQUIRE(stat(db, &st) == 0 && st.st_size >= 8192);
  FILE *fp = fopen(db, "r+b");
  REQUIRE(fp != NULL);
  /* Page 2 onwards (the tables' b-tree pages): garbage. */
  char junk[4096];
  kvt_rng r = {9};
  for (long off = 4096; off + 4096 <= st.st_size; off += 4096) {
    kvt_rng_fill(&r, junk, sizeof junk);
    fseek(fp, off, SEEK_SET);
    fwrite(junk, 1, sizeof junk, fp);
  }
  fclose(fp);
  free(db);
  close_tier(open_and_check(&f, 0));
  CHECK(count_prefix(f.dir, "index.db.corrupt-") >= 1);
  CHECK_EQ_INT(rel_check_dir(f.dir, NULL), N_ENTRIES);
  fx_free(&f);
}

static void test_index_fifo(void) {
  fixture f;
  fx_init(&f, "fifo");
  rel_rm_index(f.dir);
  char *db = rel_path(f.dir, "index.db", NULL);
  REQUIRE(mkfifo(db, 0600) == 0);
  free(db);
  close_tier(open_and_check(&f, 0));
  CHECK_EQ_INT(count_prefix(f.dir, "index.db.corrupt-"), 1);
  fx_free(&f);
}

/* The one rule: valid unindexed entries adopted, invalid ones quarantined,
 * none deleted for lack of a row - at open and by an explicit reconcile
 * (kvtier verify --repair: opened without reconcile, then reconciled). */
static void test_reconcile_adopts(void) {
  fixture f;
  fx_init(&f, "adopt");
  rel_rm_index(f.dir);
  /* Entry 2's tokens.bin damaged: it is invalid and must be quarantined. */
  char *ed = rel_path(f.dir, "data", f.h[2]);
  char *tp = rel_path(ed, "tokens.bin", NULL);
  REQUIRE(t_flip(tp, 0) == 0);
  free(tp);
  free(ed);
  kvt_options o = rel_opts(f.dir, KVT_DURABILITY_NONE);
  o.flags = KVT_OPEN_NO_RECONCILE;
  kvt_tier *t = NULL;
  REQUIRE(kvt_tier_open(&t, &o) == 0);
  int64_t n = kvt_tier_reconcile(t);
  CHECK(n >= N_ENTRIES); /* 5 adopted + 1 quarantined */
  CHECK_EQ_INT(served(t, &f, 2), N_ENTRIES - 1);
  CHECK_EQ_INT(rows_of(t), N_ENTRIES - 1);
  close_tier(t);
  char *q = rel_path(f.dir, "quarantine", NULL);
  CHECK_EQ_INT(count_prefix(q, f.h[2]), 1);
  free(q);
  /* An entry copied in from elsewhere is adopted at open. */
  fixture g;
  fx_init(&g, "adopt-src");
  char *src = rel_path(g.dir, "data", g.h[0]);
  char *dst = rel_path(f.dir, "data", g.h[0]);
  r_copy_tree(src, dst);
  free(src);
  free(dst);
  o.flags = 0;
  REQUIRE(kvt_tier_open(&t, &o) == 0);
  kvt_entry *got = NULL;
  CHECK_EQ_INT(kvt_tier_promote(&got, t, g.e[0].tokens, g.e[0].n_tokens, NULL),
               0);
  CHECK(got && t_same(got, &g.e[0]));
  kvt_entry_free(got);
  close_tier(t);
  fx_free(&g);
  fx_free(&f);
}

/* KVT_OPEN_REINDEX: the index rebuilt on demand (kvtier reindex), the old
 * one kept aside; rows whose files are gone disappear, entries without rows
 * appear. */
static void test_reindex_flag(void) {
  fixture f;
  fx_init(&f, "reindex");
  close_tier(open_and_check(&f, KVT_OPEN_REINDEX));
  CHECK_EQ_INT(count_prefix(f.dir, "index.db.reindexed-"), 1);
  close_tier(open_and_check(&f, 0));
  fx_free(&f);
}

int main(void) {
  r_use_fast_tmp();
  snprintf(g_root, sizeof g_root, "%s", kvt_test_tmpdir("idxrec"));
  RUN(test_index_deleted);
  RUN(test_index_garbage);
  RUN(test_index_damaged_pages);
  RUN(test_index_fifo);
  RUN(test_reconcile_adopts);
  RUN(test_reindex_flag);
  return kvt_test_done();
}
