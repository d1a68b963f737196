/*
 * testutil.c - implementation of the shared test helpers declared in
 * testutil.h.
 */
#include "testutil.h"

#include <dirent.h>
#include <openssl/evp.h>
#include <stdarg.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int kvt_test_failures;

static int kvt_test_skips;

static void skip_line(const char *tag, const char *fmt, va_list ap) {
  fprintf(stderr, "SKIP(%s): ", tag && *tag ? tag : "untagged");
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
}

void kvt_test_skip(const char *tag, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  skip_line(tag, fmt, ap);
  va_end(ap);
  kvt_test_skips++;
}

int kvt_test_skip_all(const char *tag, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  skip_line(tag, fmt, ap);
  va_end(ap);
  return 77;
}

int kvt_test_done(void) {
  if (kvt_test_skips)
    fprintf(stderr, "%d part(s) skipped (SKIP lines above)\n", kvt_test_skips);
  if (kvt_test_failures) {
    fprintf(stderr, "%d check(s) failed\n", kvt_test_failures);
    return 1;
  }
  return 0;
}

uint64_t kvt_rng_next(kvt_rng *r) {
  uint64_t z = (r->s += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

void kvt_rng_fill(kvt_rng *r, void *buf, size_t n) {
  unsigned char *p = buf;
  while (n >= 8) {
    uint64_t v = kvt_rng_next(r);
    memcpy(p, &v, 8);
    p += 8;
    n -= 8;
  }
  if (n) {
    uint64_t v = kvt_rng_next(r);
    memcpy(p, &v, n);
  }
}

#define MAX_TMP 64
static char *tmp_dirs[MAX_TMP];
static int n_tmp;

void kvt_test_rmtree(const char *path) {
  struct stat st;
  if (lstat(path, &st) != 0)
    return;
  if (S_ISDIR(st.st_mode)) {
    DIR *d = opendir(path);
    if (d) {
      struct dirent *de;
      while ((de = readdir(d))) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, ".."))
          continue;
        char child[4096];
        snprintf(child, sizeof child, "%s/%s", path, de->d_name);
        kvt_test_rmtree(child);
      }
      closedir(d);
    }
    chmod(path, 0700);
    rmdir(path);
  } else {
    unlink(path);
  }
}

char *kvt_test_read_file(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f)
    return NULL;
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  char *b = n >= 0 ? malloc((size_t)n + 1) : NULL;
  if (!b || fread(b, 1, (size_t)n, f) != (size_t)n) {
    free(b);
    fclose(f);
    return NULL;
  }
  b[n] = 0;
  fclose(f);
  *len = (size_t)n;
  return b;
}

int kvt_test_exists(const char *path) {
  struct stat st;
  return lstat(path, &st) == 0;
}

int kvt_test_count_dir(const char *dir, const char *suffix) {
  DIR *d = opendir(dir);
  if (!d)
    return -1;
  int n = 0;
  struct dirent *de;
  size_t b = suffix ? strlen(suffix) : 0;
  while ((de = readdir(d))) {
    if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, ".."))
      continue;
    size_t a = strlen(de->d_name);
    if (!suffix || (a >= b && strcmp(de->d_name + a - b, suffix) == 0))
      n++;
  }
  closedir(d);
  return n;
}

static void cleanup(void) {
  const char *keep = getenv("KVT_KEEP_TMP");
  for (int i = 0; i < n_tmp; i++) {
    if (!(keep && keep[0] == '1'))
      kvt_test_rmtree(tmp_dirs[i]);
    free(tmp_dirs[i]);
  }
  n_tmp = 0;
}

char *kvt_test_tmpdir(const char *tag) {
  const char *base = getenv("TMPDIR");
  if (!base || !base[0])
    base = "/tmp";
  char tmpl[4096];
  snprintf(tmpl, sizeof tmpl, "%s/kvt-%s-XXXXXX", base, tag ? tag : "t");
  char *d = mkdtemp(tmpl);
  if (!d) {
    perror("mkdtemp");
    exit(1);
  }
  char *p = strdup(d);
  if (n_tmp == 0)
    atexit(cleanup);
  if (n_tmp < MAX_TMP)
    tmp_dirs[n_tmp++] = p;
  return p;
}

int kvt_test_each_chunk(const char *cache_dir,
                        void (*fn)(void *ctx, const char *path), void *ctx) {
  char p[4096];
  int n = 0;
  for (int a = 0; a < 256; a++) {
    snprintf(p, sizeof p, "%s/chunks/%02x", cache_dir, a);
    DIR *d = opendir(p);
    struct dirent *de;
    while (d && (de = readdir(d)) != NULL) {
      size_t len = strlen(de->d_name);
      if (len < 4 || strcmp(de->d_name + len - 4, ".kvc") != 0)
        continue;
      char f[4400];
      snprintf(f, sizeof f, "%s/%s", p, de->d_name);
      if (fn)
        fn(ctx, f);
      n++;
    }
    if (d)
      closedir(d);
  }
  return n;
}

void kvt_test_model_hash(char out[65], const char *model_id,
                         const int32_t *tokens, size_t n) {
  static const char tag[] = "kvtier model_id v1"; /* with its NUL */
  unsigned char nsd[32], h[32];
  unsigned int md = 0;
  size_t len = model_id ? strlen(model_id) : 0;
  EVP_MD_CTX *c = EVP_MD_CTX_new();
  if (len) {
    EVP_DigestInit_ex(c, EVP_sha256(), NULL);
    EVP_DigestUpdate(c, tag, sizeof tag);
    EVP_DigestUpdate(c, model_id, len);
    EVP_DigestFinal_ex(c, nsd, &md);
  }
  EVP_DigestInit_ex(c, EVP_sha256(), NULL);
  if (len)
    EVP_DigestUpdate(c, nsd, 32);
  EVP_DigestUpdate(c, tokens, n * sizeof *tokens);
  EVP_DigestFinal_ex(c, h, &md);
  EVP_MD_CTX_free(c);
  for (int i = 0; i < 32; i++)
    snprintf(out + 2 * i, 3, "%02x", h[i]);
}
