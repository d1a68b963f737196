/*
 * tier_testlib.c - the tier test helpers declared in tier_testlib.h.
 */
#include "tier_testlib.h"
#include "fmt_testlib.h"

int t_spill(kvt_tier *t, const t_entry *e) {
  return kvt_tier_spill(t, e->tokens, e->n_tokens, e->layers, e->n_layers,
                        e->memory_bytes);
}

kvt_options t_opts(const char *tag) {
  kvt_options o;
  kvt_options_init(&o, KVT_OPTIONS_VERSION);
  o.cache_dir = kvt_test_tmpdir(tag);
  o.durability = KVT_DURABILITY_NONE; /* tests do not need fsync */
  /* These tests are about the disk path (reads, corruption, faults): the host
   * RAM tier would serve a fresh spill from memory. test_ram_tier turns it
   * on. */
  o.host_cache_bytes = 0;
  return o;
}

kvt_tier *t_open(const kvt_options *o) {
  kvt_tier *t = NULL;
  int rc = kvt_tier_open(&t, o);
  if (rc != 0)
    fprintf(stderr, "kvt_tier_open: %s: %s\n", kvt_strerror(rc),
            kvt_last_error());
  REQUIRE(rc == 0 && t);
  return t;
}

kvt_stats t_stats(kvt_tier *t) {
  kvt_stats s = KVT_STATS_INIT;
  REQUIRE(kvt_tier_stats(&s, t) == 0);
  return s;
}

double t_clock_now;
double t_clock(void *ctx) {
  (void)ctx;
  return t_clock_now;
}

void t_budget_init(t_budget *b, uint64_t limit) {
  memset(b, 0, sizeof *b);
  pthread_mutex_init(&b->mu, NULL);
  b->limit = limit;
}

int t_reserve(void *ctx, uint64_t n) {
  t_budget *b = ctx;
  pthread_mutex_lock(&b->mu);
  if (b->check_thread && !pthread_equal(b->owner, pthread_self()))
    b->wrong_thread++;
  int ok = b->used + n <= b->limit;
  if (ok) {
    b->used += n;
    b->reserves++;
  } else {
    b->refusals++;
  }
  pthread_mutex_unlock(&b->mu);
  return ok;
}

void t_release(void *ctx, uint64_t n) {
  t_budget *b = ctx;
  pthread_mutex_lock(&b->mu);
  if (b->check_thread && !pthread_equal(b->owner, pthread_self()))
    b->wrong_thread++;
  b->used -= n;
  b->releases++;
  pthread_mutex_unlock(&b->mu);
}

kvt_promote_opts t_popts(t_budget *b) {
  kvt_promote_opts o;
  kvt_promote_opts_init(&o, KVT_PROMOTE_OPTS_VERSION);
  if (b) {
    o.reserve = t_reserve;
    o.release = t_release;
    o.budget_ctx = b;
  }
  return o;
}

char *t_entry_path(kvt_tier *t, const int32_t *tokens, size_t n,
                   const char *file) {
  char h[KVT_HASH_HEX_LEN + 1];
  kvt_token_hash(h, tokens, n);
  size_t len = strlen(kvt_tier_dir(t)) + 128;
  char *p = malloc(len);
  if (file)
    snprintf(p, len, "%s/data/%s/%s", kvt_tier_dir(t), h, file);
  else
    snprintf(p, len, "%s/data/%s", kvt_tier_dir(t), h);
  return p;
}

int t_flip(const char *path, long off) {
  int fd = open(path, O_RDWR);
  if (fd < 0)
    return -1;
  struct stat st;
  fstat(fd, &st);
  off_t o = off >= 0 ? off : st.st_size + off;
  unsigned char c;
  if (pread(fd, &c, 1, o) != 1) {
    close(fd);
    return -1;
  }
  c ^= 0x5a;
  int rc = pwrite(fd, &c, 1, o) == 1 ? 0 : -1;
  close(fd);
  return rc;
}

int t_rows_match(const kvt_tensor *trim, const kvt_tensor *full, int64_t keep) {
  int64_t H = full->shape[1], T = full->shape[2];
  size_t row = (size_t)(full->nbytes / (uint64_t)(H * T)); /* one token row */
  if (trim->ndim != 4 || trim->shape[2] != keep || trim->shape[1] != H ||
      trim->shape[3] != full->shape[3] ||
      trim->nbytes != (uint64_t)(H * keep) * row)
    return 0;
  for (int64_t h = 0; h < H; h++)
    if (memcmp((const char *)trim->data + (size_t)(h * keep) * row,
               (const char *)full->data + (size_t)(h * T) * row,
               (size_t)keep * row) != 0)
      return 0;
  return 1;
}

int t_kv_spill(kvt_tier *t, const int32_t *tok, int n, int T, int layers,
               uint64_t mem) {
  kvt_layer l[8];
  if (layers < 1 || layers > 8)
    return KVT_EINVAL;
  for (int i = 0; i < layers; i++)
    l[i] = t_kv_tokens(tok, n, T, 8, i);
  int rc = kvt_tier_spill(t, tok, (size_t)n, l, (uint32_t)layers, mem);
  for (int i = 0; i < layers; i++)
    t_layer_free(&l[i]);
  return rc;
}

int t_kv_matches(const kvt_entry *e, const int32_t *tok, int n, int T,
                 int layers) {
  if (!e || kvt_entry_num_layers(e) != (uint32_t)layers)
    return 0;
  for (int L = 0; L < layers; L++) {
    kvt_layer ref = t_kv_tokens(tok, n, T, 8, L);
    int ok = t_layer_eq(kvt_entry_layer(e, (uint32_t)L), &ref);
    t_layer_free(&ref);
    if (!ok)
      return 0;
  }
  return 1;
}
