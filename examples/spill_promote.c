/*
 * spill_promote.c - the smallest complete use of libkvtier: open a tier in a
 * directory, start the writer, spill one two-layer fp16 KV entry, wait until it
 * is durable, look it up by a longer query (longest prefix), promote it with a
 * RAM budget, check the bytes, and close. Only the public header is used.
 * Usage: spill_promote [DIR] (default: a fresh directory under $TMPDIR or
 * /tmp, removed again at the end).
 */
#define _XOPEN_SOURCE 700 /* nftw */
#include <kvtier.h>

#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* A toy RAM budget: the engine's accounting of bytes it may still allocate. */
typedef struct budget {
  uint64_t free_bytes;
} budget;

static int reserve(void *ctx, uint64_t n) {
  budget *b = ctx;
  if (n > b->free_bytes)
    return 0;
  b->free_bytes -= n;
  return 1;
}

static void release(void *ctx, uint64_t n) {
  ((budget *)ctx)->free_bytes += n;
}

/* nftw callback of the cleanup: removes one file or (emptied) directory. */
static int rm_one(const char *path, const struct stat *st, int flag,
                  struct FTW *ftw) {
  (void)st, (void)flag, (void)ftw;
  return remove(path);
}

static int fail(const char *what, int rc) {
  fprintf(stderr, "%s: %s (%s)\n", what, kvt_strerror(rc), kvt_last_error());
  return 1;
}

int main(int argc, char **argv) {
  char tmpl[4096];
  const char *base = getenv("TMPDIR");
  snprintf(tmpl, sizeof tmpl, "%s/kvtier-example-XXXXXX",
           base && *base ? base : "/tmp");
  const char *dir = argc > 1 ? argv[1] : mkdtemp(tmpl);
  if (!dir)
    return 1;
  int own_dir = argc <= 1; /* ours to remove at the end */

  kvt_options o;
  kvt_options_init(&o, KVT_OPTIONS_VERSION);
  o.cache_dir = dir;
  o.max_size_gb = 1.0;
  kvt_tier *t = NULL;
  int rc = kvt_tier_open(&t, &o);
  if (rc)
    return fail("open", rc);
  kvt_tier_start_writer(t);

  /* Two KV layers of shape [1 batch, 8 heads, 64 tokens, 128 dims], fp16. */
  enum { L = 2, H = 8, T = 64, D = 128 };
  size_t nbytes = (size_t)H * T * D * 2;
  uint16_t *buf = malloc(nbytes * 2 * L);
  for (size_t i = 0; i < nbytes * L; i++)
    buf[i] = (uint16_t)(0x3c00 + (i % 512)); /* arbitrary fp16 values */
  kvt_tensor tens[L][2];
  kvt_layer layers[L];
  for (int l = 0; l < L; l++) {
    for (int k = 0; k < 2; k++) {
      kvt_tensor *x = &tens[l][k];
      memset(x, 0, sizeof *x);
      x->dtype = KVT_DTYPE_F16;
      x->ndim = 4;
      x->shape[0] = 1, x->shape[1] = H, x->shape[2] = T, x->shape[3] = D;
      x->data = (char *)buf + (size_t)(2 * l + k) * nbytes;
      x->nbytes = nbytes;
    }
    kvt_layer_init(&layers[l], KVT_LAYER_KV);
    layers[l].num_tensors = 2;
    layers[l].tensors = tens[l];
    layers[l].offset = T;
  }
  int32_t tokens[T + 8];
  for (int i = 0; i < T + 8; i++)
    tokens[i] = 1000 + i;

  rc = kvt_tier_spill(t, tokens, T, layers, L, (uint64_t)nbytes * 2 * L);
  if (rc)
    return fail("spill", rc);
  if ((rc = kvt_tier_flush(t, -1)))
    return fail("flush", rc);

  /* A request whose prompt extends the spilled one finds it by longest prefix.
   */
  kvt_entry_info info;
  if ((rc = kvt_tier_lookup_prefix(&info, t, tokens, T + 8)))
    return fail("lookup_prefix", rc);
  printf("found %llu-token prefix, %llu bytes on disk\n",
         (unsigned long long)info.num_tokens,
         (unsigned long long)info.disk_bytes);

  budget b = {64u << 20};
  kvt_promote_opts po;
  kvt_promote_opts_init(&po, KVT_PROMOTE_OPTS_VERSION);
  po.reserve = reserve;
  po.release = release;
  po.budget_ctx = &b;
  po.flags = KVT_PROMOTE_PREFIX;
  kvt_entry *e = NULL;
  if ((rc = kvt_tier_promote(&e, t, tokens, T + 8, &po)))
    return fail("promote", rc);
  int same = 1;
  for (uint32_t l = 0; l < kvt_entry_num_layers(e); l++)
    for (int k = 0; k < 2; k++)
      same &= memcmp(kvt_entry_layer(e, l)->tensors[k].data, tens[l][k].data,
                     nbytes) == 0;
  printf("promoted %u layers, %llu bytes reserved, data %s\n",
         kvt_entry_num_layers(e),
         (unsigned long long)kvt_entry_reserved_bytes(e),
         same ? "identical" : "DIFFERENT");
  release(&b, kvt_entry_reserved_bytes(e)); /* the engine frees the KV later */
  kvt_entry_free(e);

  char json[2048];
  size_t need;
  kvt_stats s = KVT_STATS_INIT;
  kvt_tier_stats(&s, t);
  if (kvt_stats_to_json(json, sizeof json, &need, &s) == 0)
    printf("%s\n", json);
  rc = kvt_tier_close(t, 10000);
  kvt_tier_free(t);
  free(buf);
  if (own_dir && nftw(dir, rm_one, 16, FTW_DEPTH | FTW_PHYS) != 0)
    perror("remove the example's directory");
  return same && rc == 0 ? 0 : 1;
}
