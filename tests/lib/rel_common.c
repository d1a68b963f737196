/*
 * rel_common.c - the reliability test helpers declared in rel_common.h.
 */
#include "rel_common.h"

const char *const r_kind_names[R_NKINDS] = {"flip", "truncate", "zero",
                                            "extend"};

int r_write(const char *data_dir, const t_entry *e, int mode, int do_fsync) {
  kvti_snapshot *s = NULL;
  int rc = kvti_snapshot_create(&s, e->tokens, e->n_tokens, e->layers,
                                e->n_layers, e->memory_bytes, 1, NULL, NULL);
  if (rc)
    return rc;
  kvti_write_opts o = {mode, do_fsync, 0600, 0700};
  uint64_t d = 0;
  rc = kvti_entry_write(&d, data_dir, s, &o);
  kvti_snapshot_free(s);
  return rc;
}

int r_read(const char *data_dir, const t_entry *e, int *same) {
  kvt_entry *got = NULL;
  kvti_read_opts o;
  memset(&o, 0, sizeof o);
  o.tokens = e->tokens;
  o.n_tokens = e->n_tokens;
  int rc = kvti_entry_read(&got, data_dir, e->hash, &o);
  if (same)
    *same = rc == 0 && got && t_same(got, e);
  if (rc != 0 && got)
    rc = -1000; /* data handed out with an error: never allowed */
  kvt_entry_free(got);
  return rc;
}

int r_entry_exists(const char *data_dir, const char *hash) {
  char p[4200];
  snprintf(p, sizeof p, "%s/%s", data_dir, hash);
  return kvt_test_exists(p);
}

void r_fresh_dir(const char *path) {
  kvt_test_rmtree(path);
  REQUIRE(mkdir(path, 0700) == 0);
}

long r_env_long(const char *name, long def) {
  const char *v = getenv(name);
  if (!v || !*v)
    return def;
  char *end;
  long x = strtol(v, &end, 10);
  return *end ? def : x;
}

void r_copy_tree(const char *from, const char *to) {
  struct stat st;
  if (lstat(from, &st) != 0)
    return;
  if (S_ISDIR(st.st_mode)) {
    mkdir(to, 0700);
    DIR *d = opendir(from);
    struct dirent *de;
    while ((de = readdir(d))) {
      if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, ".."))
        continue;
      char a[4200], b[4200];
      REQUIRE((size_t)snprintf(a, sizeof a, "%s/%s", from, de->d_name) <
              sizeof a);
      REQUIRE((size_t)snprintf(b, sizeof b, "%s/%s", to, de->d_name) <
              sizeof b);
      r_copy_tree(a, b);
    }
    closedir(d);
  } else {
    size_t n = 0;
    char *buf = kvt_test_read_file(from, &n);
    REQUIRE(buf);
    REQUIRE(t_write_all(to, buf, n) == 0);
    free(buf);
  }
}

int r_damage(const char *path, kvt_rng *rng, int kind, char **orig,
             size_t *orig_len, int *kind_out) {
  size_t n = 0;
  char *b = kvt_test_read_file(path, &n);
  if (!b)
    return -1;
  if (kind < 0)
    kind = (int)(kvt_rng_next(rng) % R_NKINDS);
  if (n == 0 && kind != R_EXTEND)
    kind = R_EXTEND;
  if (kind_out)
    *kind_out = kind;
  char *m = malloc(n + 64 + 1);
  memcpy(m, b, n);
  size_t mn = n;
  switch (kind) {
  case R_FLIP: {
    int k = 1 + (int)(kvt_rng_next(rng) % 8);
    for (int i = 0; i < k; i++) {
      size_t at = (size_t)(kvt_rng_next(rng) % n);
      unsigned char x = (unsigned char)(1 + kvt_rng_next(rng) % 255);
      m[at] = (char)(m[at] ^ x);
    }
    break;
  }
  case R_TRUNCATE:
    mn = (size_t)(kvt_rng_next(rng) % n);
    break;
  case R_ZERO: {
    size_t at = (size_t)(kvt_rng_next(rng) % n);
    size_t len =
        1 + (size_t)(kvt_rng_next(rng) % (n - at < 256 ? n - at : 256));
    memset(m + at, 0, len);
    break;
  }
  default: {
    size_t len = 1 + (size_t)(kvt_rng_next(rng) % 64);
    kvt_rng_fill(rng, m + n, len);
    mn = n + len;
    break;
  }
  }
  int changed = mn != n || memcmp(m, b, n) != 0;
  int rc = t_write_all(path, m, mn) == 0 ? changed : -1;
  free(m);
  *orig = b;
  *orig_len = n;
  return rc;
}

void r_use_fast_tmp(void) {
  const char *o = getenv("KVT_REL_TMPDIR");
  if (o && *o) {
    setenv("TMPDIR", o, 1);
    return;
  }
  if (access("/dev/shm", W_OK | X_OK) == 0)
    setenv("TMPDIR", "/dev/shm", 1);
}
