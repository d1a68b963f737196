/*
 * gen_corpus.c - writes the seed corpus of every fuzz target from real kvtier
 * output: the fixed entry of fuzz_common.h in both storage modes, its layer
 * files (safetensors seeds), its manifests (manifest seeds), its tokens.bin
 * under each control byte (tokens seeds) and whole entries packed in
 * fuzz_entry's container format (entry seeds), plus a few small hand-made edge
 * cases. Run by fuzz/gen_corpus.sh; the output is committed under fuzz/corpus/.
 * Usage: fuzz_gen_corpus <corpus root>.
 */
#include "fuzz_common.h"
#include "base/io.h"
#include "format/chunk.h"

static char g_out[1024];

static void seed(const char *target, const char *name, const void *d,
                 size_t n) {
  char p[2048];
  snprintf(p, sizeof p, "%s/%s", g_out, target);
  mkdir(p, 0755);
  snprintf(p, sizeof p, "%s/%s/%s", g_out, target, name);
  fz_write(p, d, n);
}

/* fuzz_entry container: records of [id][len u16 LE][bytes]; id 0 manifest.json,
 * 1 manifest.sum, 2 tokens.bin, 3+k layer_k.safetensors; 0x80 on the first id:
 * fix the sum. */
static size_t pack(unsigned char *out, const char *dir, int fix, int drop_sum) {
  size_t o = 0;
  for (int id = 0; id < 3 + 8; id++) {
    char name[64], p[2048];
    if (id == 0)
      snprintf(name, sizeof name, "manifest.json");
    else if (id == 1)
      snprintf(name, sizeof name, "manifest.sum");
    else if (id == 2)
      snprintf(name, sizeof name, "tokens.bin");
    else
      snprintf(name, sizeof name, "layer_%d.safetensors", id - 3);
    if (id == 1 && drop_sum)
      continue;
    snprintf(p, sizeof p, "%s/%s", dir, name);
    size_t n = 0;
    char *b = kvt_test_read_file(p, &n);
    if (!b)
      continue;
    if (n > 65535)
      abort();
    unsigned char flag = fix && o == 0 ? 0x80 : 0;
    out[o++] = (unsigned char)(id | flag);
    out[o++] = (unsigned char)(n & 0xff);
    out[o++] = (unsigned char)(n >> 8);
    memcpy(out + o, b, n);
    o += n;
    free(b);
  }
  return o;
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s <corpus root>\n", argv[0]);
    return 2;
  }
  snprintf(g_out, sizeof g_out, "%s", argv[1]);
  mkdir(g_out, 0755);
  static const char *mname[2] = {"native", "compat"};
  for (int mode = 0; mode < 2; mode++) {
    char data[1024], dir[1200], p[1400], name[128];
    snprintf(data, sizeof data, "%s/%s", fz_dir(), mname[mode]);
    mkdir(data, 0700);
    char hash[65];
    if (fz_make_entry(data, mode, hash) != 0) {
      fprintf(stderr, "entry write failed: %s\n", kvt_last_error());
      return 1;
    }
    snprintf(dir, sizeof dir, "%s/%s", data, hash);
    for (int l = 0; l < 4; l++) {
      snprintf(p, sizeof p, "%s/layer_%d.safetensors", dir, l);
      size_t n = 0;
      char *b = kvt_test_read_file(p, &n);
      snprintf(name, sizeof name, "%s_layer_%d", mname[mode], l);
      seed("safetensors", name, b, n);
      free(b);
    }
    size_t n = 0;
    snprintf(p, sizeof p, "%s/manifest.json", dir);
    char *m = kvt_test_read_file(p, &n);
    snprintf(name, sizeof name, "%s_manifest", mname[mode]);
    seed("manifest", name, m, n);
    free(m);
    snprintf(p, sizeof p, "%s/tokens.bin", dir);
    char *t = kvt_test_read_file(p, &n);
    for (int c = 0; c < 4; c++) {
      unsigned char *b = malloc(n + 1);
      b[0] = (unsigned char)c;
      memcpy(b + 1, t, n);
      snprintf(name, sizeof name, "%s_ctl%d", mname[mode], c);
      if (mode == 0)
        seed("tokens", name, b, n + 1);
      free(b);
    }
    free(t);
    unsigned char *pk = malloc(1 << 20);
    for (int v = 0; v < 3; v++) {
      size_t pn = pack(pk, dir, v == 1, v == 2);
      snprintf(name, sizeof name, "%s_entry_%s", mname[mode],
               v == 0   ? "exact"
               : v == 1 ? "fixsum"
                        : "nosum");
      seed("entry", name, pk, pn);
    }
    free(pk);
  }
  /* Chunk files (fuzz_chunk): a KV F16 layer and a 4-bit quantized layer cut
   * at rows [16, 32), as the chunk writer stores them; control byte 0 = as
   * is, 1 = key and header checksum recomputed after mutation. */
  {
    static uint8_t kbuf[2][1 * 2 * 32 * 8 * 2], qbuf[6][2 * 32 * 16 * 4];
    for (size_t i = 0; i < sizeof kbuf; i++)
      ((uint8_t *)kbuf)[i] = (uint8_t)(i * 31 + 7);
    for (size_t i = 0; i < sizeof qbuf; i++)
      ((uint8_t *)qbuf)[i] = (uint8_t)(i * 17 + 3);
    kvt_tensor kt[2], qt[6];
    for (int j = 0; j < 2; j++)
      kt[j] = (kvt_tensor){
          KVT_DTYPE_F16, 4, {1, 2, 32, 8}, kbuf[j], sizeof kbuf[j]};
    for (int j = 0; j < 6; j++) {
      int packed = j % 3 == 0;
      qt[j] = (kvt_tensor){packed ? KVT_DTYPE_U32 : KVT_DTYPE_F16,
                           4,
                           {1, 2, 32, packed ? 8 : 2},
                           qbuf[j],
                           packed ? 2 * 32 * 8 * 4 : 2 * 32 * 2 * 2};
    }
    kvt_layer ls[2];
    kvt_layer_init(&ls[0], KVT_LAYER_KV);
    ls[0].num_tensors = 2;
    ls[0].tensors = kt;
    ls[0].offset = 32;
    kvt_layer_init(&ls[1], KVT_LAYER_QUANTIZED_KV);
    ls[1].num_tensors = 6;
    ls[1].tensors = qt;
    ls[1].offset = 32;
    ls[1].bits = 4;
    ls[1].group_size = 32;
    uint32_t ids[2] = {0, 1};
    int32_t tok[16];
    for (int i = 0; i < 16; i++)
      tok[i] = 1000 + i;
    uint8_t *ns, parent[32];
    size_t nsl;
    if (kvti_chunk_ns_encode(&ns, &nsl, "fuzz-model", "salt") != 0 ||
        kvti_chunk_seed(parent, ns, nsl, 0) != 0)
      abort();
    kvti_chunk_src src = {ns, nsl, parent, 1, tok, 16, 16, ls, ids, 2, 2};
    char cp[1100], ct[1100];
    snprintf(cp, sizeof cp, "%s/seed.kvc", fz_dir());
    snprintf(ct, sizeof ct, "%s/seed.kvc.tmp", fz_dir());
    if (kvti_chunk_write(cp, ct, &src, 0600, 0, NULL) != 0)
      abort();
    size_t cn;
    char *cb = kvt_test_read_file(cp, &cn);
    unsigned char *cs = malloc(cn + 1);
    for (int v = 0; v < 2; v++) {
      cs[0] = (unsigned char)v;
      memcpy(cs + 1, cb, cn);
      seed("chunk", v ? "kv_quant_fixsum" : "kv_quant_exact", cs, cn + 1);
    }
    free(cs);
    free(cb);
    kvti_free(ns);
  }
  /* Hand-made edge cases. */
  static const char empty_st[] = "\x02\x00\x00\x00\x00\x00\x00\x00{}";
  seed("safetensors", "empty_header", empty_st, sizeof empty_st - 1);
  static const char meta_st[] = "\x28\x00\x00\x00\x00\x00\x00\x00{\"__metadata_"
                                "_\":{\"format\":\"pt\"}}      ";
  seed("safetensors", "metadata_only", meta_st, sizeof meta_st - 1);
  static const char ref_manifest[] = "{\"num_layers\": 0, \"layers\": [], "
                                     "\"memory_bytes\": 0, \"num_tokens\": 9}";
  seed("manifest", "reference_empty", ref_manifest, sizeof ref_manifest - 1);
  printf("corpus written to %s\n", g_out);
  return 0;
}
