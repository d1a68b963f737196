/*
 * fuzz_manifest.c - libFuzzer target for the manifest parser. The input becomes
 * the manifest.json of a real kvtier entry (the fixed entry of fuzz_common.h,
 * native mode, so its layer files and tokens.bin are genuine); when the input
 * names the "kvtier" key, a matching manifest.sum is written too, so the fuzzer
 * gets past the manifest checksum into the JSON structure, the per-layer
 * metadata and their cross-checks against the layer files. The entry is then
 * read every way the library reads entries (fz_read_all_ways).
 */
#include "fuzz_common.h"

static char g_data[600], g_hash[65], g_mpath[800], g_spath[800];

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!g_hash[0]) {
    snprintf(g_data, sizeof g_data, "%s/m", fz_dir());
    mkdir(g_data, 0700);
    if (fz_make_entry(g_data, KVT_STORAGE_NATIVE, g_hash) != 0)
      abort();
    snprintf(g_mpath, sizeof g_mpath, "%s/%s/manifest.json", g_data, g_hash);
    snprintf(g_spath, sizeof g_spath, "%s/%s/manifest.sum", g_data, g_hash);
  }
  fz_write(g_mpath, data, size);
  int has_kvtier = 0;
  for (size_t i = 0; i + 8 <= size && !has_kvtier; i++)
    has_kvtier = memcmp(data + i, "\"kvtier\"", 8) == 0;
  if (has_kvtier) {
    char sum[32];
    fz_sum(sum, data, size);
    fz_write(g_spath, sum, strlen(sum));
  } else {
    unlink(g_spath);
  }
  fz_read_all_ways(g_data, g_hash, fz_tokens, FZ_NTOK);
  return 0;
}
