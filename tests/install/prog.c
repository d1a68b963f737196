/*
 * prog.c - the consumer program of the install test: uses only the installed
 * <kvtier.h>. Opens a tier in argv[1], checks that the header it was compiled
 * with matches the library it runs with, spills one small entry, promotes it
 * back and compares the bytes, then prints the library version.
 */
#include <kvtier.h>

#include <stdio.h>
#include <string.h>

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: prog DIR\n");
    return 2;
  }
  if (kvt_version_number() != KVT_VERSION_NUMBER) {
    fprintf(stderr, "header %s, library %s\n", KVT_VERSION_STRING,
            kvt_version());
    return 1;
  }
  kvt_options o;
  kvt_options_init(&o, KVT_OPTIONS_VERSION);
  o.cache_dir = argv[1];
  kvt_tier *t = NULL;
  int rc = kvt_tier_open(&t, &o);
  if (rc) {
    fprintf(stderr, "open: %s\n", kvt_last_error());
    return 1;
  }
  kvt_tier_start_writer(t);
  static float k[64], v[64];
  for (int i = 0; i < 64; i++)
    k[i] = (float)i, v[i] = (float)-i;
  kvt_tensor ts[2];
  memset(ts, 0, sizeof ts);
  float *data[2] = {k, v};
  for (int i = 0; i < 2; i++) {
    ts[i].dtype = KVT_DTYPE_F32;
    ts[i].ndim = 4;
    ts[i].shape[0] = 1, ts[i].shape[1] = 1, ts[i].shape[2] = 8;
    ts[i].shape[3] = 8;
    ts[i].data = data[i];
    ts[i].nbytes = sizeof k;
  }
  kvt_layer l;
  kvt_layer_init(&l, KVT_LAYER_KV);
  l.num_tensors = 2;
  l.tensors = ts;
  l.offset = 8;
  int32_t tok[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  if ((rc = kvt_tier_spill(t, tok, 8, &l, 1, 2 * sizeof k)) != 0 ||
      (rc = kvt_tier_flush(t, -1)) != 0) {
    fprintf(stderr, "spill: %s\n", kvt_last_error());
    return 1;
  }
  kvt_entry *e = NULL;
  if ((rc = kvt_tier_promote(&e, t, tok, 8, NULL)) != 0) {
    fprintf(stderr, "promote: %s\n", kvt_last_error());
    return 1;
  }
  int same = kvt_entry_num_layers(e) == 1 &&
             memcmp(kvt_entry_layer(e, 0)->tensors[1].data, v, sizeof v) == 0;
  kvt_entry_free(e);
  rc = kvt_tier_close(t, 10000);
  kvt_tier_free(t);
  if (!same || rc != 0) {
    fprintf(stderr, "promoted data differs or close failed\n");
    return 1;
  }
  printf("kvtier %s ok\n", kvt_version());
  return 0;
}
