/*
 * fuzz_tokens.c - libFuzzer target for tokens.bin. Input: one control byte,
 * then the bytes of tokens.bin, written into the fixed entry of fuzz_common.h.
 * The control byte chooses how the rest of the entry agrees with it: 0 - the
 * kvtier manifest is patched (num_tokens = len/4, the tokens.bin checksum,
 * manifest.sum) so only the token hash can refuse it; 1 - the genuine manifest
 * (checksum mismatch path); 2 - a reference-style manifest without checksums
 * (only the length and the hash protect it); 3 - as 0 and the entry directory
 * renamed to the hash of the fuzzed tokens, so a consistent tokens.bin is
 * accepted. Each variant is read every way. Bit 2 of the control byte makes
 * the manifest claim a token count taken from the first four bytes instead
 * of len/4 (up to 2^31-1, whatever the file's length): the count must be
 * refused against the caller's and the file's before anything is allocated
 * for it (run.sh's -malloc_limit_mb catches an allocation that is not).
 */
#include "fuzz_common.h"

static char g_data[600], g_hash[65];
static char *g_manifest;
static size_t g_mlen;

/* Replaces the first occurrence of `key` followed by a value up to one of
 * `stop` chars. */
static char *patch(const char *src, const char *key, const char *val,
                   const char *stop) {
  const char *k = strstr(src, key);
  if (!k)
    abort();
  const char *v = k + strlen(key);
  const char *e = v + strcspn(v, stop);
  size_t n = (size_t)(v - src) + strlen(val) + strlen(e) + 1;
  char *o = malloc(n);
  snprintf(o, n, "%.*s%s%s", (int)(v - src), src, val, e);
  return o;
}

static void put(const char *dir, const char *name, const void *d, size_t n) {
  char p[900];
  snprintf(p, sizeof p, "%s/%s", dir, name);
  fz_write(p, d, n);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  char dir[800], p[900];
  if (!g_hash[0]) {
    snprintf(g_data, sizeof g_data, "%s/t", fz_dir());
    mkdir(g_data, 0700);
    if (fz_make_entry(g_data, KVT_STORAGE_NATIVE, g_hash) != 0)
      abort();
    snprintf(p, sizeof p, "%s/%s/manifest.json", g_data, g_hash);
    g_manifest = kvt_test_read_file(p, &g_mlen);
    if (!g_manifest)
      abort();
  }
  if (size < 1)
    return 0;
  int ctl = data[0] & 3;
  const uint8_t *tok = data + 1;
  size_t n = size - 1;
  snprintf(dir, sizeof dir, "%s/%s", g_data, g_hash);
  put(dir, "tokens.bin", tok, n);
  char num[32], sum[32], x[24];
  uint64_t claimed = n / 4;
  if ((data[0] & 4) && n >= 4) {
    uint32_t c;
    memcpy(&c, tok, 4);
    claimed = c & 0x7fffffffu;
  }
  snprintf(num, sizeof num, "%llu", (unsigned long long)claimed);
  kvti_xxh3_format(x, kvti_xxh3(tok, n));
  char *m1 = patch(g_manifest, "\"num_tokens\": ", num, ",}");
  char *m2 = patch(m1, "\"tokens.bin\": \"", x, "\"");
  const char *m = ctl == 1 ? g_manifest : m2;
  char *ref = NULL;
  if (ctl == 2) {
    /* The reference writes no kvtier key: cut it (it is the manifest's last
     * key). */
    ref = strdup(m1);
    char *k = strstr(ref, ", \"kvtier\": ");
    if (!k)
      abort();
    strcpy(k, "}");
    m = ref;
    snprintf(p, sizeof p, "%s/manifest.sum", dir);
    unlink(p);
  } else {
    fz_sum(sum, m, strlen(m));
    put(dir, "manifest.sum", sum, strlen(sum));
  }
  put(dir, "manifest.json", m, strlen(m));
  char h[65] = "";
  int renamed = 0;
  if (ctl == 3 && n % 4 == 0 && kvti_sha256_hex(h, tok, n) == 0 &&
      strcmp(h, g_hash) != 0) {
    char to[900];
    snprintf(to, sizeof to, "%s/%s", g_data, h);
    renamed = rename(dir, to) == 0;
  }
  const char *name = renamed ? h : g_hash;
  int32_t *exp = NULL;
  if (n % 4 == 0) {
    exp = malloc(n ? n : 1);
    memcpy(exp, tok, n);
  }
  fz_read_all_ways(g_data, name, exp, n / 4);
  fz_read_all_ways(g_data, name, fz_tokens, FZ_NTOK);
  if (renamed) {
    char from[900];
    snprintf(from, sizeof from, "%s/%s", g_data, h);
    if (rename(from, dir) != 0)
      abort();
  }
  /* Restore the genuine files for the next input. */
  put(dir, "manifest.json", g_manifest, g_mlen);
  fz_sum(sum, g_manifest, g_mlen);
  put(dir, "manifest.sum", sum, strlen(sum));
  free(exp);
  free(ref);
  free(m1);
  free(m2);
  return 0;
}
