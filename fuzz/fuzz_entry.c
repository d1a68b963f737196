/*
 * fuzz_entry.c - libFuzzer target for a whole-entry read. The input is a small
 * container of files: records [id][length, u16 little-endian][bytes], id 0
 * manifest.json, 1 manifest.sum, 2 tokens.bin, 3+k layer_k.safetensors (k < 8);
 * 0x80 set on the first record's id asks for a manifest.sum matching the
 * manifest. The files are written into a fresh entry directory named by the
 * SHA-256 of tokens.bin (so consistent inputs pass the name check) and the
 * entry is read every way the library does. Seeds are real kvtier entries
 * packed this way (gen_corpus.c).
 */
#include "fuzz_common.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  char data_dir[700], dir[800], p[900];
  snprintf(data_dir, sizeof data_dir, "%s/e", fz_dir());
  mkdir(data_dir, 0700);
  /* Entry name: hash of the tokens.bin record when its length is whole tokens.
   */
  char hash[65];
  const uint8_t *tok = NULL;
  size_t ntok = 0, o = 0;
  while (o + 3 <= size) {
    int id = data[o] & 0x7f;
    size_t n = (size_t)data[o + 1] | (size_t)data[o + 2] << 8;
    o += 3;
    if (n > size - o)
      n = size - o;
    if (id == 2) {
      tok = data + o;
      ntok = n;
    }
    o += n;
  }
  if (tok && ntok % 4 == 0)
    kvti_sha256_hex(hash, tok, ntok);
  else
    kvt_token_hash(hash, fz_tokens, FZ_NTOK);
  snprintf(dir, sizeof dir, "%s/%s", data_dir, hash);
  fz_rmtree(dir);
  mkdir(dir, 0700);
  const uint8_t *man = NULL;
  size_t nman = 0;
  int fix = size > 0 && (data[0] & 0x80);
  o = 0;
  while (o + 3 <= size) {
    int id = data[o] & 0x7f;
    size_t n = (size_t)data[o + 1] | (size_t)data[o + 2] << 8;
    o += 3;
    if (n > size - o)
      n = size - o;
    char name[40];
    if (id == 0) {
      snprintf(name, sizeof name, "manifest.json");
      man = data + o;
      nman = n;
    } else if (id == 1) {
      snprintf(name, sizeof name, "manifest.sum");
    } else if (id == 2) {
      snprintf(name, sizeof name, "tokens.bin");
    } else if (id < 3 + 8) {
      snprintf(name, sizeof name, "layer_%d.safetensors", id - 3);
    } else {
      o += n;
      continue;
    }
    snprintf(p, sizeof p, "%s/%s", dir, name);
    fz_write(p, data + o, n);
    o += n;
  }
  if (fix && man) {
    char sum[32];
    fz_sum(sum, man, nman);
    snprintf(p, sizeof p, "%s/manifest.sum", dir);
    fz_write(p, sum, strlen(sum));
  }
  int32_t *exp = NULL;
  if (tok && ntok % 4 == 0) {
    exp = malloc(ntok ? ntok : 1);
    memcpy(exp, tok, ntok);
  }
  fz_read_all_ways(data_dir, hash, exp, ntok / 4);
  free(exp);
  fz_rmtree(dir);
  return 0;
}
