/*
 * test_corrupt_entry.c - the corruption campaign below the tier. Thousands of
 * seeded trials each damage one random file of a stored entry (a layer file,
 * manifest.json, manifest.sum or tokens.bin; both storage modes) by flipping,
 * truncating, zeroing or extending random bytes, then read the entry twice
 * (with the expected tokens, as a promote does, and without, as verify does):
 * every damaged entry must be refused with KVT_ECORRUPT and no data, and the
 * detection rate is printed (100% required for kvtier-written entries). A
 * second campaign damages index.db itself: the tier's loader must never crash
 * and either refuse with a clear error or serve only rows that are
 * self-consistent (file_path = token hash of the row's tokens), so a damaged
 * index can never point a lookup at another entry's data; the public SSDIndex
 * API on the same file never crashes and answers as the reference's SQL does.
 * Trial counts: KVT_CORRUPT_TRIALS (default 5000) and KVT_CORRUPT_INDEX_TRIALS
 * (default 1000).
 */
#include "base/hash.h"
#include "index/index.h"
#include "rel_common.h"
#include "kvtier_sys.h"

static char g_data[4096];

static void list_files(const char *dir, char names[][64], int max) {
  DIR *d = opendir(dir);
  int n = 0;
  struct dirent *de;
  while (d && (de = readdir(d)) && n < max)
    if (de->d_name[0] != '.')
      snprintf(names[n++], 64, "%.63s", de->d_name);
  if (d)
    closedir(d);
  names[n][0] = '\0';
}

static void test_entry_campaign(void) {
  long trials = r_env_long("KVT_CORRUPT_TRIALS", 5000);
  t_entry e[2] = {r_make(41, 50, 1), r_make(42, 23, 1)};
  int modes[2] = {KVT_STORAGE_NATIVE, KVT_STORAGE_COMPAT};
  r_fresh_dir(g_data);
  for (int i = 0; i < 2; i++)
    REQUIRE(r_write(g_data, &e[i], modes[i], 0) == 0);
  char files[2][16][64];
  for (int i = 0; i < 2; i++) {
    char d[4200];
    snprintf(d, sizeof d, "%s/%s", g_data, e[i].hash);
    list_files(d, files[i], 15);
  }
  uint64_t damaged = 0, detected = 0, unchanged = 0,
           by_kind[R_NKINDS][2] = {{0}};
  uint64_t by_file[4][2] = {
      {0}}; /* layer, manifest.json, manifest.sum, tokens.bin */
  kvt_rng rng = {4242};
  for (long t = 0; t < trials; t++) {
    int i = (int)(kvt_rng_next(&rng) % 2);
    int nf = 0;
    while (files[i][nf][0])
      nf++;
    const char *fname = files[i][kvt_rng_next(&rng) % (uint64_t)nf];
    char path[4300];
    snprintf(path, sizeof path, "%s/%s/%s", g_data, e[i].hash, fname);
    char *orig = NULL;
    size_t olen = 0;
    int kind = 0;
    int ch = r_damage(path, &rng, -1, &orig, &olen, &kind);
    REQUIRE(ch >= 0);
    if (ch == 0) {
      unchanged++;
    } else {
      damaged++;
      int fk = strstr(fname, "layer_")           ? 0
               : !strcmp(fname, "manifest.json") ? 1
               : !strcmp(fname, "manifest.sum")  ? 2
                                                 : 3;
      /* With the expected tokens (promote) and without (verify / tokens from
       * tokens.bin). */
      kvt_entry *got = NULL;
      kvti_read_opts o;
      memset(&o, 0, sizeof o);
      o.tokens = e[i].tokens;
      o.n_tokens = e[i].n_tokens;
      int rc1 = kvti_entry_read(&got, g_data, e[i].hash, &o);
      CHECK(rc1 != 0 || got);
      kvt_entry_free(got);
      got = NULL;
      int rc2 = kvti_entry_read(&got, g_data, e[i].hash, NULL);
      kvt_entry_free(got);
      int ok = rc1 == KVT_ECORRUPT && rc2 == KVT_ECORRUPT;
      if (ok) {
        detected++;
        by_kind[kind][0]++;
        by_file[fk][0]++;
      } else if (damaged - detected <= 5) {
        fprintf(stderr,
                "  trial %ld: %s of %s (mode %d) not detected: %d / %d (%s)\n",
                t, r_kind_names[kind], fname, modes[i], rc1, rc2,
                kvt_last_error());
      }
      by_kind[kind][1]++;
      by_file[fk][1]++;
      CHECK(ok);
    }
    REQUIRE(t_write_all(path, orig, olen) == 0);
    free(orig);
  }
  /* The pristine entries still read back exactly (restores were exact). */
  for (int i = 0; i < 2; i++)
    CHECK_EQ_INT(r_read(g_data, &e[i], NULL), 0);
  fprintf(stderr,
          "entry corruption: %ld trials, %llu damaged, %llu detected (%.2f%%), "
          "%llu "
          "no-op damage\n",
          trials, (unsigned long long)damaged, (unsigned long long)detected,
          damaged ? 100.0 * (double)detected / (double)damaged : 100.0,
          (unsigned long long)unchanged);
  for (int k = 0; k < R_NKINDS; k++)
    fprintf(stderr, "  %-8s %llu/%llu\n", r_kind_names[k],
            (unsigned long long)by_kind[k][0],
            (unsigned long long)by_kind[k][1]);
  static const char *fn[4] = {"layers", "manifest.json", "manifest.sum",
                              "tokens.bin"};
  for (int k = 0; k < 4; k++)
    fprintf(stderr, "  %-14s %llu/%llu\n", fn[k],
            (unsigned long long)by_file[k][0],
            (unsigned long long)by_file[k][1]);
  for (int i = 0; i < 2; i++)
    t_free(&e[i]);
}

/* ---- index.db ---------------------------------------------------------- */

#define N_ROWS 40

static void row_tokens(int32_t *t, size_t n, int r) {
  for (size_t i = 0; i < n; i++)
    t[i] = (int32_t)(r * 1000 + (int)i);
}

static void test_index_campaign(void) {
  long trials = r_env_long("KVT_CORRUPT_INDEX_TRIALS", 1000);
  char *root = kvt_test_tmpdir("corrupt-index");
  char pristine[4200], live[4200], db[4300];
  snprintf(pristine, sizeof pristine, "%s/pristine", root);
  snprintf(live, sizeof live, "%s/live", root);
  REQUIRE(mkdir(pristine, 0700) == 0);
  kvt_index *idx = NULL;
  REQUIRE(kvt_index_open(&idx, pristine) == 0);
  for (int r = 0; r < N_ROWS; r++) {
    int32_t t[64];
    size_t n = 1 + (size_t)r % 60;
    row_tokens(t, n, r);
    char h[65];
    kvt_token_hash(h, t, n);
    REQUIRE(kvt_index_insert(idx, t, n, h, 100 + (uint64_t)r, n) == 0);
  }
  kvt_index_close(idx);
  snprintf(db, sizeof db, "%s/index.db", pristine);
  size_t dblen = 0;
  char *dbbytes = kvt_test_read_file(db, &dblen);
  REQUIRE(dbbytes && dblen > 0);
  kvt_rng rng = {777};
  uint64_t refused = 0, opened = 0, rows_seen = 0, rows_lost = 0, unchanged = 0,
           bad = 0, listed_mismatch = 0;
  for (long tr = 0; tr < trials; tr++) {
    kvt_test_rmtree(live);
    REQUIRE(mkdir(live, 0700) == 0);
    snprintf(db, sizeof db, "%s/index.db", live);
    REQUIRE(t_write_all(db, dbbytes, dblen) == 0);
    char *orig = NULL;
    size_t olen = 0;
    /* Flips and zeroed ranges hit SQLite pages; truncation and extension change
     * the size. */
    int ch = r_damage(db, &rng, -1, &orig, &olen, NULL);
    free(orig);
    if (ch == 0) {
      unchanged++;
      continue;
    }
    kvt_clear_error();
    idx = NULL;
    /* The tier's loader (kvti_index_open with the mirror): the safety claim.
     * It refuses, or serves only rows that are self-consistent (file_path =
     * token hash of the row's tokens), so a damaged index can never point a
     * lookup at another entry's data. */
    int rc = kvti_index_open(&idx, live, NULL, 0);
    if (rc != 0) {
      refused++;
      CHECK(idx == NULL);
      CHECK(kvt_last_error()[0] != '\0');
      CHECK(rc == KVT_EDB || rc == KVT_EIO || rc == KVT_ECORRUPT);
      continue;
    }
    opened++;
    /* The public SSDIndex API (the reference's SQL) on the same damaged file:
     * never a crash; an answer is a clean error or what the reference's
     * statements return - exact lookups only the queried hash, prefix
     * lookups only true prefixes of the query. Whatever path it lists, no
     * tier takes it (the loader above). */
    kvt_index *pub = NULL;
    if (kvt_index_open(&pub, live) != 0)
      CHECK(pub == NULL && kvt_last_error()[0] != '\0');
    for (int r = 0; r < N_ROWS; r++) {
      int32_t t[64];
      size_t n = 1 + (size_t)r % 60;
      row_tokens(t, n, r);
      char h[65];
      kvt_token_hash(h, t, n);
      kvt_entry_info info;
      kvt_index_row row;
      if (kvti_index_find(&info, idx, t, n, 0) == 0) {
        rows_seen++;
        if (strcmp(info.token_hash, h) || info.num_tokens != n) {
          bad++;
          fprintf(stderr, "  trial %ld: lookup of row %d answered %s\n", tr, r,
                  info.token_hash);
        }
      } else {
        rows_lost++;
      }
      if (pub && kvt_index_lookup_exact(&row, pub, t, n) == 0 &&
          strcmp(row.token_hash, h)) {
        bad++;
        fprintf(stderr, "  trial %ld: public lookup of row %d answered %s\n",
                tr, r, row.token_hash);
      }
      /* Prefix lookups with an extra token: every answer is a true prefix of
       * the query (the loader's under its own hash). */
      t[n] = 999999;
      if (kvti_index_find_prefix(&info, idx, t, n + 1, 0) == 0) {
        char hx[65];
        kvt_token_hash(hx, t, info.num_tokens <= n + 1 ? info.num_tokens : 0);
        if (info.num_tokens > n + 1 || strcmp(info.token_hash, hx)) {
          bad++;
          fprintf(stderr, "  trial %ld: prefix lookup of row %d answered %s\n",
                  tr, r, info.token_hash);
        }
      }
      kvt_index_rows pr = {0};
      if (pub && kvt_index_lookup_prefix(&pr, pub, t, n + 1) == 0) {
        for (size_t i = 0; i < pr.count; i++) {
          const kvt_index_row *x = &pr.rows[i];
          if (x->n_tokens > n + 1 || memcmp(x->tokens, t, x->n_tokens * 4)) {
            bad++;
            fprintf(stderr,
                    "  trial %ld: public prefix of row %d not a prefix\n", tr,
                    r);
          }
        }
        kvt_index_rows_free(&pr);
      }
    }
    kvt_index_close(idx);
    kvt_index_rows all = {0};
    if (pub && kvt_index_all(&all, pub) == 0) {
      for (size_t i = 0; i < all.count; i++) {
        char h[65];
        kvt_token_hash(h, all.rows[i].tokens, all.rows[i].n_tokens);
        /* Listed as stored (a damaged blob or path is listed, as the
         * reference lists it; the tier's loader above never serves it). */
        if (strcmp(kvt_index_row_file_path(&all.rows[i]), h))
          listed_mismatch++;
      }
      kvt_index_rows_free(&all);
    }
    kvt_index_close(pub);
  }
  CHECK_EQ_INT(bad, 0);
  fprintf(
      stderr,
      "index.db corruption: %ld trials, %llu refused at open with an error, "
      "%llu "
      "opened (%llu rows served, all self-consistent; %llu rows dropped), %llu "
      "no-op, inconsistent rows served %llu (public listing, rows whose path "
      "is not their tokens' hash: %llu)\n",
      trials, (unsigned long long)refused, (unsigned long long)opened,
      (unsigned long long)rows_seen, (unsigned long long)rows_lost,
      (unsigned long long)unchanged, (unsigned long long)bad,
      (unsigned long long)listed_mismatch);
  free(dbbytes);
}

int main(void) {
  r_use_fast_tmp();
  snprintf(g_data, sizeof g_data, "%s/data", kvt_test_tmpdir("corrupt-entry"));
  RUN(test_entry_campaign);
  RUN(test_index_campaign);
  return kvt_test_done();
}
