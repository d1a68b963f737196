/*
 * test_security_tier.c - hostile cache directories. Opening refuses (KVT_EPERM,
 * with a clear message) a directory writable by group or others, one owned by
 * another user (when the test can chown, i.e. runs as root), a symlinked
 * cache_dir and a symlinked data/. Symlinks planted inside the cache - an entry
 * directory, a layer file, manifest.json or tokens.bin pointing at a valid
 * entry outside, quarantine/ pointing outside - are never followed: the entry
 * is refused (no data), and nothing outside the cache is read, renamed or
 * deleted. A tampered index.db (rows whose file_path is "../..", an absolute
 * path, another entry's hash, or whose hash does not match its tokens) can
 * never make kvtier touch anything outside either: canary files next to and
 * above the cache dir survive open, reconcile, promote, read_entry with hostile
 * paths, quarantine, gc and remove, byte for byte. Files and directories are
 * created with the configured modes regardless of the umask. A link at
 * index.db (-wal, -shm), stats.bin, kvtier.lock, quarantine/, chunks/,
 * chunks/<kk> or inside an entry of a chunked cache, pointing outside,
 * leaves the outside untouched through every operation.
 */
#include "rel_tier.h"
#include "kvtier_sys.h"

#include <sqlite3.h>

static char g_root[4096];

/* A canary: a file with known content; returns 1 while it is intact. */
static void canary_make(const char *path) {
  REQUIRE(t_write_all(path, "canary-data", 11) == 0);
}
static int canary_ok(const char *path) {
  size_t n = 0;
  char *b = kvt_test_read_file(path, &n);
  int ok = b && n == 11 && !memcmp(b, "canary-data", 11);
  free(b);
  return ok;
}

static int open_rc(const char *dir, uint32_t flags) {
  kvt_options o = rel_opts(dir, KVT_DURABILITY_NONE);
  o.flags = flags;
  kvt_tier *t = NULL;
  kvt_clear_error();
  int rc = kvt_tier_open(&t, &o);
  if (rc == 0) {
    kvt_tier_close(t, -1);
    kvt_tier_free(t);
  } else {
    CHECK(t == NULL);
    CHECK(kvt_last_error()[0] != '\0');
  }
  return rc;
}

static void test_owner_and_modes_refused(void) {
  char *d = rel_path(g_root, "perm", NULL);
  REQUIRE(mkdir(d, 0700) == 0);
  CHECK_EQ_INT(open_rc(d, 0), 0);
  chmod(d, 0777);
  CHECK_EQ_INT(open_rc(d, 0), KVT_EPERM);
  CHECK(strstr(kvt_last_error(), "writable") != NULL);
  chmod(d, 0770);
  CHECK_EQ_INT(open_rc(d, 0), KVT_EPERM);
  CHECK_EQ_INT(open_rc(d, KVT_OPEN_SKIP_OWNER_CHECK), 0);
  chmod(d, 0700);
  char *data = rel_path(d, "data", NULL);
  chmod(data, 0757); /* data/ writable by others */
  CHECK_EQ_INT(open_rc(d, 0), KVT_EPERM);
  chmod(data, 0700);
  if (geteuid() == 0) {
    REQUIRE(chown(d, 12345, 12345) == 0);
    CHECK_EQ_INT(open_rc(d, 0), KVT_EPERM);
    CHECK(strstr(kvt_last_error(), "owned") != NULL);
    CHECK_EQ_INT(open_rc(d, KVT_OPEN_READONLY), KVT_EPERM);
    REQUIRE(chown(d, 0, 0) == 0);
  } else {
    fprintf(stderr, "  (not root: the foreign-owner case uses /)\n");
    CHECK_EQ_INT(open_rc("/", 0), KVT_EPERM);
  }
  CHECK_EQ_INT(open_rc(d, 0), 0);
  /* Symlinked cache_dir and data/. */
  char *link = rel_path(g_root, "perm-link", NULL);
  REQUIRE(symlink(d, link) == 0);
  CHECK_EQ_INT(open_rc(link, 0), KVT_EPERM);
  CHECK_EQ_INT(open_rc(link, KVT_OPEN_READONLY), KVT_EPERM);
  char *d2 = rel_path(g_root, "perm2", NULL),
       *d2data = rel_path(d2, "data", NULL);
  REQUIRE(mkdir(d2, 0700) == 0);
  REQUIRE(symlink(data, d2data) == 0);
  CHECK_EQ_INT(open_rc(d2, 0), KVT_EPERM);
  free(d);
  free(data);
  free(link);
  free(d2);
  free(d2data);
}

static void modes_under(mode_t um, const char *name) {
  mode_t old = umask(um);
  char *d = rel_path(g_root, name, NULL);
  kvt_options o = rel_opts(d, KVT_DURABILITY_FSYNC);
  o.file_mode = 0640;
  o.dir_mode = 0750;
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  t_entry e = t_make(7, 12, 2, 4, 4);
  REQUIRE(t_spill(t, &e) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  struct stat st;
  char *ed = t_entry_path(t, e.tokens, e.n_tokens, NULL);
  CHECK(lstat(d, &st) == 0 && (st.st_mode & 07777) == 0750);
  char *data = rel_path(d, "data", NULL);
  CHECK(lstat(data, &st) == 0 && (st.st_mode & 07777) == 0750);
  CHECK(lstat(ed, &st) == 0 && (st.st_mode & 07777) == 0750);
  static const char *files[] = {"layer_0.safetensors", "layer_1.safetensors",
                                "manifest.json", "manifest.sum", "tokens.bin"};
  for (int i = 0; i < 5; i++) {
    char *f = rel_path(ed, files[i], NULL);
    CHECK(lstat(f, &st) == 0);
    if ((st.st_mode & 07777) != 0640)
      fprintf(stderr, "  %s has mode %o\n", files[i],
              (unsigned)(st.st_mode & 07777));
    CHECK((st.st_mode & 07777) == 0640);
    free(f);
  }
  /* index.db is created by SQLite: it must at least not be writable by
   * group/others. */
  char *db = rel_path(d, "index.db", NULL);
  CHECK(lstat(db, &st) == 0);
  if ((st.st_mode & 07777) != 0640)
    fprintf(stderr, "  note: index.db has mode %o (file_mode 640)\n",
            (unsigned)(st.st_mode & 07777));
  CHECK((st.st_mode & 022) == 0);
  kvt_tier_close(t, -1);
  kvt_tier_free(t);
  t_free(&e);
  free(ed);
  free(data);
  free(db);
  free(d);
  umask(old);
}

static void test_modes(void) {
  modes_under(0, "modes0");
  modes_under(077, "modes077");
}

/* A cache with entries a (spilled) and an outside copy of a's directory. */
typedef struct fixture {
  char *dir, *outside, *outside_entry, *canary_up, *canary_side;
  t_entry a, b;
  char ha[65], hb[65];
} fixture;

static void fx_init(fixture *f, const char *name) {
  memset(f, 0, sizeof *f);
  char *base = rel_path(g_root, name, NULL);
  REQUIRE(mkdir(base, 0700) == 0);
  f->dir = rel_path(base, "cache", NULL);
  f->outside = rel_path(base, "outside", NULL);
  f->canary_up = rel_path(base, "canary", NULL);
  f->canary_side = rel_path(f->dir, "canary", NULL);
  REQUIRE(mkdir(f->outside, 0700) == 0);
  canary_make(f->canary_up);
  f->a = t_make(21, 16, 2, 4, 4);
  f->b = t_make(22, 17, 2, 4, 4);
  kvt_token_hash(f->ha, f->a.tokens, f->a.n_tokens);
  kvt_token_hash(f->hb, f->b.tokens, f->b.n_tokens);
  kvt_options o = rel_opts(f->dir, KVT_DURABILITY_NONE);
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  REQUIRE(t_spill(t, &f->a) == 0 && t_spill(t, &f->b) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  kvt_tier_close(t, -1);
  kvt_tier_free(t);
  canary_make(f->canary_side);
  /* A valid copy of a's entry outside the cache. */
  char *src = rel_path(f->dir, "data", f->ha);
  f->outside_entry = rel_path(f->outside, f->ha, NULL);
  r_copy_tree(src, f->outside_entry);
  free(src);
  free(base);
}

static void fx_free(fixture *f) {
  free(f->dir);
  free(f->outside);
  free(f->outside_entry);
  free(f->canary_up);
  free(f->canary_side);
  t_free(&f->a);
  t_free(&f->b);
}

/* Outside copy intact (every file still there) and canaries intact. */
static int fx_outside_ok(const fixture *f) {
  static const char *files[] = {"layer_0.safetensors", "layer_1.safetensors",
                                "manifest.json", "manifest.sum", "tokens.bin"};
  int ok = canary_ok(f->canary_up) && canary_ok(f->canary_side);
  for (int i = 0; i < 5; i++) {
    char *p = rel_path(f->outside_entry, files[i], NULL);
    ok &= kvt_test_exists(p);
    free(p);
  }
  return ok;
}

/* Every operation that reads, renames or deletes; returns the promote code of
 * a. */
static int fx_exercise(fixture *f) {
  kvt_options o = rel_opts(f->dir, KVT_DURABILITY_NONE);
  kvt_tier *t = NULL;
  int rc = kvt_tier_open(&t, &o);
  if (rc != 0)
    return rc;
  kvt_tier_start_writer(t);
  kvt_entry *got = NULL;
  int pa = kvt_tier_promote(&got, t, f->a.tokens, f->a.n_tokens, NULL);
  if (pa == 0)
    CHECK(t_same(got, &f->a)); /* only ever a's own, genuine data */
  kvt_entry_free(got);
  got = NULL;
  static const char *hostile[] = {"../canary",
                                  "../../canary",
                                  "/etc/passwd",
                                  "..",
                                  ".",
                                  "data/../../canary",
                                  ""};
  for (size_t i = 0; i < sizeof hostile / sizeof *hostile; i++) {
    CHECK_EQ_INT(
        kvt_tier_read_entry(&got, t, f->a.tokens, f->a.n_tokens, hostile[i]),
        KVT_EINVAL);
    CHECK(got == NULL);
  }
  CHECK(kvt_tier_verify(t, "../canary", 1) == KVT_EINVAL);
  char *json = NULL;
  CHECK(kvt_tier_describe(&json, t, "../../canary") == KVT_EINVAL);
  kvt_free(json);
  kvt_tier_verify(t, f->ha, 1);
  kvt_tier_reconcile(t);
  kvt_gc_opts g = KVT_GC_OPTS_INIT;
  g.max_entries = 1;
  kvt_tier_gc(t, &g, NULL, NULL);
  kvt_tier_remove(t, f->b.tokens, f->b.n_tokens);
  kvt_tier_remove(t, f->a.tokens, f->a.n_tokens);
  kvt_tier_close(t, -1);
  kvt_tier_free(t);
  return pa;
}

static void test_symlinks_inside(void) {
  static const char *what[] = {"entry dir", "layer file", "manifest.json",
                               "tokens.bin", "quarantine dir"};
  for (int k = 0; k < 5; k++) {
    char name[32];
    snprintf(name, sizeof name, "sym%d", k);
    fixture f;
    fx_init(&f, name);
    char *ed = rel_path(f.dir, "data", f.ha);
    if (k == 0) {
      kvt_test_rmtree(ed);
      REQUIRE(symlink(f.outside_entry, ed) == 0);
    } else if (k <= 3) {
      static const char *file[] = {NULL, "layer_0.safetensors", "manifest.json",
                                   "tokens.bin"};
      char *in = rel_path(ed, file[k], NULL),
           *out = rel_path(f.outside_entry, file[k], NULL);
      unlink(in);
      REQUIRE(symlink(out, in) == 0);
      free(in);
      free(out);
    } else {
      /* quarantine/ -> outside, and a's layer damaged so a read quarantines it.
       */
      char *q = rel_path(f.dir, "quarantine", NULL);
      kvt_test_rmtree(q);
      REQUIRE(symlink(f.outside, q) == 0);
      char *l0 = rel_path(ed, "layer_0.safetensors", NULL);
      REQUIRE(t_flip(l0, -1) == 0);
      free(l0);
      free(q);
    }
    int pa = fx_exercise(&f);
    if (pa == 0)
      fprintf(stderr, "  symlinked %s: entry served\n", what[k]);
    CHECK(pa != 0);
    if (!fx_outside_ok(&f))
      fprintf(stderr,
              "  symlinked %s: something outside the cache was changed\n",
              what[k]);
    CHECK(fx_outside_ok(&f));
    /* The outside directory holds nothing new (nothing was moved into it). */
    CHECK_EQ_INT(kvt_test_count_dir(f.outside, NULL), 1);
    free(ed);
    fx_free(&f);
  }
}

static void tamper(const char *dir, const char *sql) {
  char *db = rel_path(dir, "index.db", NULL);
  sqlite3 *h = NULL;
  REQUIRE(sqlite3_open(db, &h) == SQLITE_OK);
  char *err = NULL;
  if (sqlite3_exec(h, sql, NULL, NULL, &err) != SQLITE_OK) {
    fprintf(stderr, "sql: %s\n", err);
    REQUIRE(0);
  }
  sqlite3_close(h);
  free(db);
}

static void test_tampered_index(void) {
  static const char *sqls[] = {
      /* file_path pointing out of data/ */
      "UPDATE entries SET file_path = '../canary';",
      "UPDATE entries SET file_path = '../../canary';",
      "UPDATE entries SET file_path = '%s';", /* absolute: the canary above the
                                                 cache */
      /* a's row pointing at b's entry */
      "UPDATE entries SET file_path = '%h' WHERE token_hash = '%a';",
      "UPDATE entries SET file_path = '%h';", /* every row names b's directory
                                               */
      /* hash not matching the tokens */
      "DELETE FROM entries WHERE token_hash = '%h'; UPDATE entries SET "
      "token_hash = '%h', "
      "file_path = '%h' WHERE token_hash = '%a';",
      /* traversal through token_hash itself */
      "UPDATE entries SET token_hash = '../../canary', file_path = "
      "'../../canary' WHERE "
      "token_hash = '%a';",
  };
  for (size_t k = 0; k < sizeof sqls / sizeof *sqls; k++) {
    char name[32];
    snprintf(name, sizeof name, "tamper%zu", k);
    fixture f;
    fx_init(&f, name);
    char sql[4096];
    const char *s = sqls[k];
    size_t o = 0;
    for (; *s && o < sizeof sql - 200; s++) {
      if (s[0] == '%' && s[1] == 's') {
        o += (size_t)snprintf(sql + o, sizeof sql - o, "%s", f.canary_up);
        s++;
      } else if (s[0] == '%' && s[1] == 'a') {
        o += (size_t)snprintf(sql + o, sizeof sql - o, "%s", f.ha);
        s++;
      } else if (s[0] == '%' && s[1] == 'h') {
        o += (size_t)snprintf(sql + o, sizeof sql - o, "%s", f.hb);
        s++;
      } else {
        sql[o++] = *s;
      }
    }
    sql[o] = '\0';
    tamper(f.dir, sql);
    int pa = fx_exercise(&f);
    (void)
        pa; /* a may be served only as its own genuine data (checked inside) */
    if (!fx_outside_ok(&f))
      fprintf(
          stderr,
          "  tampered index (%s): something outside the cache was changed\n",
          sql);
    CHECK(fx_outside_ok(&f));
    fx_free(&f);
  }
}

/* A link planted at any other name under the cache directory - index.db,
 * its -wal and -shm, stats.bin, kvtier.lock, quarantine/, chunks/,
 * chunks/<kk>, an entry's directory or one of its files - pointing at a file
 * (or a directory) outside: open either sets the link aside or refuses with
 * a clear message; spill, promote, read, verify --repair, chunk verify and
 * gc, reconcile, gc, remove, stats and a reindexing open never write,
 * rename or remove anything outside (the outside file keeps its bytes, the
 * outside directory holds only its sentinel). */
static int lk_count;

static void lk_exercise(const char *dir, const t_entry *a, const t_entry *c,
                        uint32_t flags) {
  kvt_options o = rel_opts(dir, KVT_DURABILITY_FSYNC);
  o.chunk_tokens = 16;
  o.flags = flags;
  kvt_tier *t = NULL;
  kvt_clear_error();
  int rc = kvt_tier_open(&t, &o);
  if (rc != 0) {
    /* Refused: the message says why (a link, never followed). */
    CHECK(strstr(kvt_last_error(), "link") != NULL ||
          strstr(kvt_last_error(), "not a directory") != NULL);
    if (!(strstr(kvt_last_error(), "link") != NULL ||
          strstr(kvt_last_error(), "not a directory") != NULL))
      fprintf(stderr, "  open refused unclearly: %s\n", kvt_last_error());
    return;
  }
  kvt_tier_start_writer(t);
  t_spill(t, c);
  kvt_tier_flush(t, -1);
  kvt_entry *got = NULL;
  if (kvt_tier_promote(&got, t, a->tokens, a->n_tokens, NULL) == 0)
    CHECK(t_same(got, a));
  kvt_entry_free(got);
  got = NULL;
  if (kvt_tier_promote(&got, t, c->tokens, c->n_tokens, NULL) == 0)
    CHECK(t_same(got, c));
  kvt_entry_free(got);
  kvt_tier_verify(t, NULL, 1);
  uint64_t rm = 0;
  kvt_tier_chunk_verify(t, NULL, 1, &rm);
  kvt_tier_chunk_gc(t, 0, NULL, NULL, NULL, NULL);
  kvt_tier_reconcile(t);
  kvt_stats st = KVT_STATS_INIT;
  kvt_tier_stats(&st, t);
  kvt_gc_opts g = KVT_GC_OPTS_INIT;
  g.max_entries = 1;
  kvt_tier_gc(t, &g, NULL, NULL);
  kvt_tier_remove(t, a->tokens, a->n_tokens);
  kvt_tier_close(t, -1);
  kvt_tier_free(t);
  kvt_stats_read_live(&st, NULL, dir);
}

static void test_links_at_cache_files(void) {
  char *base = rel_path(g_root, "links", NULL);
  REQUIRE(mkdir(base, 0700) == 0);
  char *proto = rel_path(base, "proto", NULL);
  t_entry a = t_make(31, 40, 2, 40, 4), c = t_make(32, 37, 2, 37, 4);
  {
    kvt_options o = rel_opts(proto, KVT_DURABILITY_FSYNC);
    o.chunk_tokens = 16;
    kvt_tier *t = t_open(&o);
    REQUIRE(kvt_tier_start_writer(t) == 0);
    REQUIRE(t_spill(t, &a) == 0);
    REQUIRE(kvt_tier_flush(t, -1) == 0);
    kvt_tier_close(t, -1);
    kvt_tier_free(t);
  }
  char ha[65];
  kvt_token_hash(ha, a.tokens, a.n_tokens);
  /* One chunk directory of a's chain (every chunk file's). */
  char kk[8] = "";
  {
    char *cd = rel_path(proto, "chunks", NULL);
    DIR *d = opendir(cd);
    REQUIRE(d != NULL);
    struct dirent *de;
    while ((de = readdir(d)) != NULL)
      if (strlen(de->d_name) == 2)
        memcpy(kk, de->d_name, 3); /* two characters and the NUL */
    closedir(d);
    free(cd);
  }
  REQUIRE(kk[0] != 0);
  char chunk_sub[32], data_ent[80], ent_file[400];
  snprintf(chunk_sub, sizeof chunk_sub, "chunks/%s", kk);
  snprintf(data_ent, sizeof data_ent, "data/%s", ha);
  /* The tail of a chunked entry: whatever data/<ha>/ holds first. */
  {
    char *ed = rel_path(proto, "data", ha);
    DIR *d = opendir(ed);
    REQUIRE(d != NULL);
    struct dirent *de;
    ent_file[0] = 0;
    while ((de = readdir(d)) != NULL)
      if (de->d_name[0] != '.' && !ent_file[0])
        snprintf(ent_file, sizeof ent_file, "data/%s/%s", ha, de->d_name);
    closedir(d);
    free(ed);
    REQUIRE(ent_file[0] != 0);
  }
  struct {
    const char *name;
    int dir; /* link to the outside directory, not the file */
  } at[] = {{"index.db", 0},  {"index.db-wal", 0}, {"index.db-shm", 0},
            {"stats.bin", 0}, {"kvtier.lock", 0},  {"quarantine", 1},
            {"chunks", 1},    {chunk_sub, 1},      {data_ent, 1},
            {ent_file, 0}};
  for (size_t k = 0; k < sizeof at / sizeof *at; k++) {
    for (int reindex = 0; reindex < 2; reindex++) {
      char name[32];
      snprintf(name, sizeof name, "c%d", lk_count++);
      char *root = rel_path(base, name, NULL);
      REQUIRE(mkdir(root, 0700) == 0);
      char *dir = rel_path(root, "cache", NULL),
           *out = rel_path(root, "outside", NULL),
           *outf = rel_path(out, "target", NULL);
      r_copy_tree(proto, dir);
      REQUIRE(mkdir(out, 0700) == 0);
      canary_make(outf);
      char *p = rel_path(dir, at[k].name, NULL);
      kvt_test_rmtree(p);
      REQUIRE(symlink(at[k].dir ? out : outf, p) == 0);
      lk_exercise(dir, &a, &c, reindex ? KVT_OPEN_REINDEX : 0);
      int ok = canary_ok(outf) && kvt_test_count_dir(out, NULL) == 1;
      if (!ok)
        fprintf(stderr, "  link at %s%s: something outside was changed\n",
                at[k].name, reindex ? " (reindex)" : "");
      CHECK(ok);
      free(p);
      free(dir);
      free(out);
      free(outf);
      free(root);
    }
  }
  t_free(&a);
  t_free(&c);
  free(proto);
  free(base);
}

int main(void) {
  r_use_fast_tmp();
  snprintf(g_root, sizeof g_root, "%s", kvt_test_tmpdir("security"));
  RUN(test_owner_and_modes_refused);
  RUN(test_modes);
  RUN(test_symlinks_inside);
  RUN(test_tampered_index);
  RUN(test_links_at_cache_files);
  return kvt_test_done();
}
