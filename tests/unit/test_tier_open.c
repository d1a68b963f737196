/*
 * test_tier_open.c - opening a cache directory safely: a symlinked cache or
 * data directory, a directory writable by group/others beyond dir_mode, or one
 * owned by another user (when running as root) is refused with KVT_EPERM unless
 * KVT_OPEN_SKIP_OWNER_CHECK; a second writer (same process, or another process
 * via fork) gets KVT_EBUSY while read-only opens work; failed opens leak no
 * file descriptor; and a directory laid out exactly as the reference writes it
 * (index.db with the reference schema, data/<hash>/layer_<i>.safetensors F32,
 * manifest.json without checksums, tokens.bin) opens without losing anything
 * and promotes correctly. An entry left at data/<hash>.old.tmp by a crash
 * inside the portable replace (no <hash>) is put back by the next writable
 * open; next to a live <hash> it is a stale temporary and purged.
 */
#include "tier_testlib.h"

#include <sqlite3.h>
#include <sys/wait.h>

#if defined(__SANITIZE_THREAD__)
#define UNDER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define UNDER_TSAN 1
#endif
#endif

static int count_fds(void) {
  return kvt_test_count_dir("/proc/self/fd", NULL);
}

static void test_symlink_refused(void) {
  char *base = kvt_test_tmpdir("sym");
  char real[4200], link[4200];
  snprintf(real, sizeof real, "%s/real", base);
  snprintf(link, sizeof link, "%s/link", base);
  mkdir(real, 0700);
  CHECK_EQ_INT(symlink(real, link), 0);
  kvt_options o = t_opts("symopt");
  o.cache_dir = link;
  kvt_tier *t = NULL;
  int fds = count_fds();
  CHECK_EQ_INT(kvt_tier_open(&t, &o), KVT_EPERM);
  CHECK(strstr(kvt_last_error(), "symlink") != NULL);
  CHECK(t == NULL);
  o.flags = KVT_OPEN_SKIP_OWNER_CHECK; /* never overrides the symlink check */
  CHECK_EQ_INT(kvt_tier_open(&t, &o), KVT_EPERM);
  /* data/ as a symlink is refused too. */
  char data[4300], elsewhere[4300];
  snprintf(data, sizeof data, "%s/data", real);
  snprintf(elsewhere, sizeof elsewhere, "%s/elsewhere", base);
  mkdir(elsewhere, 0700);
  CHECK_EQ_INT(symlink(elsewhere, data), 0);
  o.cache_dir = real;
  o.flags = 0;
  CHECK_EQ_INT(kvt_tier_open(&t, &o), KVT_EPERM);
  CHECK_EQ_INT(count_fds(), fds); /* nothing leaked */
}

static void test_permissions(void) {
  kvt_options o = t_opts("perm");
  chmod(o.cache_dir, 0777);
  kvt_tier *t = NULL;
  int fds = count_fds();
  CHECK_EQ_INT(kvt_tier_open(&t, &o), KVT_EPERM);
  CHECK(strstr(kvt_last_error(), "writable") != NULL);
  chmod(o.cache_dir, 0770);
  CHECK_EQ_INT(kvt_tier_open(&t, &o), KVT_EPERM);
  /* Group write that dir_mode itself grants is the user's choice. */
  o.dir_mode = 0770;
  CHECK_EQ_INT(kvt_tier_open(&t, &o), 0);
  kvt_tier_free(t);
  t = NULL;
  chmod(o.cache_dir, 0777);
  CHECK_EQ_INT(kvt_tier_open(&t, &o), KVT_EPERM); /* others: still refused */
  o.flags = KVT_OPEN_SKIP_OWNER_CHECK;
  CHECK_EQ_INT(kvt_tier_open(&t, &o), 0);
  kvt_tier_free(t);
  t = NULL;
  chmod(o.cache_dir, 0700);
  CHECK_EQ_INT(count_fds(), fds);
  /* Another owner (only testable as root). */
  if (geteuid() == 0) {
    kvt_options o2 = t_opts("owner");
    CHECK_EQ_INT(chown(o2.cache_dir, 12345, 12345), 0);
    CHECK_EQ_INT(kvt_tier_open(&t, &o2), KVT_EPERM);
    CHECK(strstr(kvt_last_error(), "owned") != NULL);
    o2.flags = KVT_OPEN_SKIP_OWNER_CHECK;
    CHECK_EQ_INT(kvt_tier_open(&t, &o2), 0);
    kvt_tier_free(t);
  } else {
    fprintf(stderr, "note: not root, foreign-owner refusal not exercised\n");
  }
}

/* index.db (and the -wal/-shm SQLite derives from it) gets file_mode whatever
 * the umask, like the entry files; an existing index.db keeps its mode. */
static void test_index_mode(void) {
  kvt_options o = t_opts("dbmode");
  o.file_mode = 0600;
  mode_t old = umask(022);
  kvt_tier *t = NULL;
  REQUIRE(kvt_tier_open(&t, &o) == 0);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  t_entry e = t_make(3, 8, 2, 4, 8);
  CHECK_EQ_INT(t_spill(t, &e), 0);
  CHECK_EQ_INT(kvt_tier_flush(t, -1), 0);
  const char *names[3] = {"index.db", "index.db-wal", "index.db-shm"};
  for (int i = 0; i < 3; i++) {
    char p[4200];
    snprintf(p, sizeof p, "%s/%s", o.cache_dir, names[i]);
    struct stat st;
    if (stat(p, &st) != 0) {
      CHECK(i > 0); /* index.db must exist; the others while open in WAL */
      continue;
    }
    CHECK_EQ_INT(st.st_mode & 0777, 0600);
  }
  CHECK_EQ_INT(kvt_tier_close(t, -1), 0);
  kvt_tier_free(t);
  /* A database created by someone else keeps the mode they gave it. */
  char db[4200];
  snprintf(db, sizeof db, "%s/index.db", o.cache_dir);
  CHECK_EQ_INT(chmod(db, 0640), 0);
  REQUIRE(kvt_tier_open(&t, &o) == 0);
  struct stat st;
  CHECK(stat(db, &st) == 0 && (st.st_mode & 0777) == 0640);
  kvt_tier_free(t);
  umask(old);
  t_free(&e);
}

static void test_second_writer(void) {
  kvt_options o = t_opts("busy");
  kvt_tier *a = t_open(&o);
  kvt_tier *b = NULL;
  int fds = count_fds();
  CHECK_EQ_INT(kvt_tier_open(&b, &o), KVT_EBUSY);
  CHECK(strstr(kvt_last_error(), "writer") != NULL);
  CHECK(b == NULL);
  CHECK_EQ_INT(count_fds(), fds);
  kvt_options ro = o;
  ro.flags = KVT_OPEN_READONLY;
  CHECK_EQ_INT(kvt_tier_open(&b, &ro), 0); /* readers do not take the lock */
  kvt_tier_free(b);
  b = NULL;
#ifndef UNDER_TSAN
  /* Another process. */
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) {
    kvt_tier *c = NULL;
    int rc = kvt_tier_open(&c, &o);
    _exit(rc == KVT_EBUSY ? 0 : 1);
  }
  int st = 0;
  waitpid(pid, &st, 0);
  CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
#else
  kvt_test_skip("tsan", "second writer in another process (fork under TSan)");
#endif
  kvt_tier_free(a);
  CHECK_EQ_INT(kvt_tier_open(&b, &o), 0); /* released at close */
  kvt_tier_free(b);
}

static void test_readonly_missing_dir(void) {
  kvt_options o = t_opts("romissing");
  char p[4200];
  snprintf(p, sizeof p, "%s/nope", o.cache_dir);
  o.cache_dir = p;
  o.flags = KVT_OPEN_READONLY;
  kvt_tier *t = NULL;
  CHECK(kvt_tier_open(&t, &o) < 0);
  CHECK(!kvt_test_exists(p)); /* read-only never creates */
}

/* ---- A directory exactly as the reference writes it ---------------------- */

static void put_u64le(unsigned char *p, uint64_t v) {
  for (int i = 0; i < 8; i++)
    p[i] = (unsigned char)(v >> (8 * i));
}

/* safetensors.numpy.save_file equivalent for F32 tensors. */
static void ref_safetensors(const char *path, int n, const char *const *names,
                            const kvt_tensor *ts) {
  char hdr[4096];
  size_t h = 0;
  uint64_t off = 0;
  h += (size_t)snprintf(hdr + h, sizeof hdr - h, "{");
  for (int i = 0; i < n; i++) {
    h += (size_t)snprintf(hdr + h, sizeof hdr - h,
                          "%s\"%s\":{\"dtype\":\"F32\",\"shape\":[",
                          i ? "," : "", names[i]);
    for (uint32_t d = 0; d < ts[i].ndim; d++)
      h += (size_t)snprintf(hdr + h, sizeof hdr - h, "%s%lld", d ? "," : "",
                            (long long)ts[i].shape[d]);
    h += (size_t)snprintf(
        hdr + h, sizeof hdr - h, "],\"data_offsets\":[%llu,%llu]}",
        (unsigned long long)off, (unsigned long long)(off + ts[i].nbytes));
    off += ts[i].nbytes;
  }
  h += (size_t)snprintf(hdr + h, sizeof hdr - h, "}");
  while (h % 8)
    hdr[h++] = ' ';
  FILE *f = fopen(path, "wb");
  unsigned char len[8];
  put_u64le(len, h);
  fwrite(len, 1, 8, f);
  fwrite(hdr, 1, h, f);
  for (int i = 0; i < n; i++)
    fwrite(ts[i].data, 1, ts[i].nbytes, f);
  fclose(f);
}

static void ref_write_entry(const char *cache, sqlite3 *db, const t_entry *e,
                            double when) {
  char h[65], ph[65];
  kvt_token_hash(h, e->tokens, e->n_tokens);
  kvt_prefix_hash(ph, e->tokens, e->n_tokens);
  char dir[4300];
  snprintf(dir, sizeof dir, "%s/data/%s", cache, h);
  mkdir(dir, 0700);
  char man[8192];
  size_t m = (size_t)snprintf(
      man, sizeof man, "{\"num_layers\": %u, \"layers\": [", e->n_layers);
  for (uint32_t l = 0; l < e->n_layers; l++) {
    char path[4400], k[64], v[64];
    snprintf(path, sizeof path, "%s/layer_%u.safetensors", dir, l);
    snprintf(k, sizeof k, "layer_%u_keys", l);
    snprintf(v, sizeof v, "layer_%u_values", l);
    const char *names[2] = {k, v};
    ref_safetensors(path, 2, names, e->layers[l].tensors);
    m += (size_t)snprintf(man + m, sizeof man - m,
                          "%s{\"layer_type\": \"KVCache\", \"layer_idx\": %u, "
                          "\"offset\": %lld}",
                          l ? ", " : "", l, (long long)e->layers[l].offset);
  }
  m += (size_t)snprintf(man + m, sizeof man - m,
                        "], \"memory_bytes\": %llu, \"num_tokens\": %zu}",
                        (unsigned long long)e->memory_bytes, e->n_tokens);
  char path[4400];
  snprintf(path, sizeof path, "%s/manifest.json", dir);
  FILE *f = fopen(path, "w");
  fwrite(man, 1, m, f);
  fclose(f);
  snprintf(path, sizeof path, "%s/tokens.bin", dir);
  f = fopen(path, "wb");
  fwrite(e->tokens, 4, e->n_tokens, f);
  fclose(f);
  sqlite3_stmt *st;
  sqlite3_prepare_v2(db,
                     "INSERT OR REPLACE INTO entries (token_hash, tokens_blob, "
                     "prefix_hash, num_tokens, file_path, memory_bytes, "
                     "created_at, accessed_at) VALUES (?,?,?,?,?,?,?,?)",
                     -1, &st, NULL);
  sqlite3_bind_text(st, 1, h, -1, SQLITE_TRANSIENT);
  sqlite3_bind_blob(st, 2, e->tokens, (int)(e->n_tokens * 4), SQLITE_TRANSIENT);
  sqlite3_bind_text(st, 3, ph, -1, SQLITE_TRANSIENT);
  sqlite3_bind_int64(st, 4, (sqlite3_int64)e->n_tokens);
  sqlite3_bind_text(st, 5, h, -1, SQLITE_TRANSIENT);
  sqlite3_bind_int64(st, 6, (sqlite3_int64)e->memory_bytes);
  sqlite3_bind_double(st, 7, when);
  sqlite3_bind_double(st, 8, when);
  CHECK_EQ_INT(sqlite3_step(st), SQLITE_DONE);
  sqlite3_finalize(st);
}

static const char *REF_SCHEMA =
    "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;"
    "CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL);"
    "CREATE TABLE IF NOT EXISTS entries (token_hash TEXT PRIMARY KEY, "
    "tokens_blob BLOB NOT NULL, prefix_hash TEXT, num_tokens INTEGER NOT NULL, "
    "file_path TEXT NOT NULL, memory_bytes INTEGER NOT NULL, created_at REAL "
    "NOT NULL, accessed_at REAL NOT NULL);"
    "CREATE INDEX IF NOT EXISTS idx_entries_accessed ON entries(accessed_at);"
    "CREATE INDEX IF NOT EXISTS idx_entries_num_tokens ON entries(num_tokens);"
    "CREATE INDEX IF NOT EXISTS idx_entries_prefix_hash_num_tokens ON "
    "entries(prefix_hash, num_tokens);"
    "INSERT INTO schema_version (version) VALUES (1);";

static void test_reference_directory(void) {
  char *cache = kvt_test_tmpdir("refdir");
  char data[4200], dbp[4200];
  snprintf(data, sizeof data, "%s/data", cache);
  snprintf(dbp, sizeof dbp, "%s/index.db", cache);
  mkdir(data, 0700);
  sqlite3 *db = NULL;
  REQUIRE(sqlite3_open(dbp, &db) == SQLITE_OK);
  REQUIRE(sqlite3_exec(db, REF_SCHEMA, NULL, NULL, NULL) == SQLITE_OK);
  t_entry e[3];
  double now = (double)time(NULL);
  for (int i = 0; i < 3; i++) {
    e[i] = t_make(500 + i, 24 + (size_t)i * 8, 2, 4, 8);
    if (i > 0)
      t_set_prefix(&e[i], &e[0]);
    ref_write_entry(cache, db, &e[i], now - 100 + i);
  }
  sqlite3_close(db);

  kvt_options o = t_opts("refopt");
  o.cache_dir = cache;
  kvt_tier *t = t_open(&o);
  kvt_stats s = KVT_STATS_INIT;
  kvt_tier_stats(&s, t);
  CHECK_EQ_INT(s.entries, 3);
  CHECK_EQ_INT(s.reconciled, 0); /* nothing of the reference's was removed */
  CHECK(s.disk_bytes > 0);
  for (int i = 0; i < 3; i++) {
    kvt_entry_info info;
    CHECK_EQ_INT(kvt_tier_lookup(&info, t, e[i].tokens, e[i].n_tokens), 0);
    CHECK_EQ_INT(info.memory_bytes, e[i].memory_bytes);
    kvt_entry *got = NULL;
    CHECK_EQ_INT(kvt_tier_promote(&got, t, e[i].tokens, e[i].n_tokens, NULL),
                 0);
    CHECK(got && t_same(got, &e[i]));
    kvt_entry_free(got);
  }
  /* Longest prefix among the reference's rows. */
  t_entry q = t_make(600, 80, 1, 1, 1);
  t_set_prefix(&q, &e[2]);
  kvt_entry_info info;
  CHECK_EQ_INT(kvt_tier_lookup_prefix(&info, t, q.tokens, 80), 0);
  CHECK_EQ_INT(info.num_tokens, e[2].n_tokens);
  CHECK_EQ_INT(kvt_tier_reconcile(t), 0);
  /* kvtier writes next to the reference's entries and can evict them. */
  REQUIRE(kvt_tier_start_writer(t) == 0);
  CHECK_EQ_INT(t_spill(t, &q), 0);
  CHECK_EQ_INT(kvt_tier_flush(t, -1), 0);
  kvt_gc_opts g = KVT_GC_OPTS_INIT;
  g.max_entries = 2;
  uint64_t n = 0;
  CHECK_EQ_INT(kvt_tier_gc(t, &g, &n, NULL), 0);
  CHECK_EQ_INT(n, 2);
  CHECK_EQ_INT(kvt_tier_lookup(&info, t, e[0].tokens, e[0].n_tokens),
               KVT_ENOTFOUND); /* the least recently used */
  CHECK_EQ_INT(kvt_tier_lookup(&info, t, q.tokens, 80), 0);
  kvt_tier_free(t);
  t_free(&q);
  for (int i = 0; i < 3; i++)
    t_free(&e[i]);
}

/* Opens o's directory, promotes e, and returns whether it came back whole. */
static int reopen_has(const kvt_options *o, const t_entry *e) {
  kvt_tier *t = t_open(o);
  kvt_entry *got = NULL;
  int rc = kvt_tier_promote(&got, t, e->tokens, e->n_tokens, NULL);
  int ok = rc == 0 && t_same(got, e);
  kvt_entry_free(got);
  kvt_tier_free(t);
  return ok;
}

static void test_restore_aside(void) {
  kvt_options o = t_opts("aside");
  t_entry a = t_make(61, 20, 2, 4, 8), b = t_make(62, 21, 2, 4, 8);
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  REQUIRE(t_spill(t, &a) == 0 && t_spill(t, &b) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  char *pa = t_entry_path(t, a.tokens, a.n_tokens, NULL);
  char *pb = t_entry_path(t, b.tokens, b.n_tokens, NULL);
  kvt_tier_free(t);
  char aside[4200], stale[4200];
  /* a: crash between the two renames - only the aside copy exists. */
  snprintf(aside, sizeof aside, "%s.old.tmp", pa);
  REQUIRE(rename(pa, aside) == 0);
  /* b: crash after the new version went in - the aside copy is stale. */
  snprintf(stale, sizeof stale, "%s.old.tmp", pb);
  REQUIRE(mkdir(stale, 0700) == 0);
  CHECK(reopen_has(&o, &a));
  CHECK(kvt_test_exists(pa));
  CHECK(!kvt_test_exists(aside));
  CHECK(reopen_has(&o, &b));
  CHECK(!kvt_test_exists(stale));
  /* A read-only open changes nothing. */
  REQUIRE(rename(pa, aside) == 0);
  kvt_options ro = o;
  ro.flags |= KVT_OPEN_READONLY;
  kvt_tier *r = t_open(&ro);
  kvt_tier_free(r);
  CHECK(kvt_test_exists(aside));
  CHECK(!kvt_test_exists(pa));
  CHECK(reopen_has(&o, &a));
  free(pa);
  free(pb);
  t_free(&a);
  t_free(&b);
}

int main(void) {
  RUN(test_symlink_refused);
  RUN(test_permissions);
  RUN(test_index_mode);
  RUN(test_second_writer);
  RUN(test_readonly_missing_dir);
  RUN(test_reference_directory);
  RUN(test_restore_aside);
  return kvt_test_done();
}
