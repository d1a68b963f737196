/*
 * live_holder.c - a serving process for the CLI's live-stats tests
 * (test_cli.py, group "live"): opens DIR as a writable tier (so it publishes
 * DIR/stats.bin), prints "ready PID", then obeys one command per stdin line,
 * answering "ok" when done: "spill N" stores N more seeded entries of 32
 * tokens (and waits until they are written), "hit" promotes the first entry,
 * "miss" promotes tokens never stored, "quit" closes the tier and exits 0.
 * End of input closes too. Only the public API is used.
 */
#include <kvtier.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { T = 32, D = 16 };

static void make_tokens(int32_t *tok, int seed) {
  for (int i = 0; i < T; i++)
    tok[i] = seed * 1000 + i;
}

static int spill_one(kvt_tier *t, int seed) {
  static uint16_t k[2 * T * D], v[2 * T * D];
  for (int i = 0; i < 2 * T * D; i++)
    k[i] = (uint16_t)(0x3c00 + (i + seed) % 256), v[i] = (uint16_t)i;
  kvt_tensor ts[2];
  memset(ts, 0, sizeof ts);
  uint16_t *data[2] = {k, v};
  for (int i = 0; i < 2; i++) {
    ts[i].dtype = KVT_DTYPE_F16;
    ts[i].ndim = 4;
    ts[i].shape[0] = 1, ts[i].shape[1] = 2, ts[i].shape[2] = T;
    ts[i].shape[3] = D;
    ts[i].data = data[i];
    ts[i].nbytes = sizeof k;
  }
  kvt_layer l;
  kvt_layer_init(&l, KVT_LAYER_KV);
  l.num_tensors = 2;
  l.tensors = ts;
  l.offset = T;
  int32_t tok[T];
  make_tokens(tok, seed);
  return kvt_tier_spill(t, tok, T, &l, 1, 2 * sizeof k);
}

static int promote(kvt_tier *t, int seed) {
  int32_t tok[T];
  make_tokens(tok, seed);
  kvt_entry *e = NULL;
  int rc = kvt_tier_promote(&e, t, tok, T, NULL);
  kvt_entry_free(e);
  return rc;
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: live_holder DIR\n");
    return 2;
  }
  kvt_options o;
  kvt_options_init(&o, KVT_OPTIONS_VERSION);
  o.cache_dir = argv[1];
  o.durability = KVT_DURABILITY_NONE;
  kvt_tier *t = NULL;
  if (kvt_tier_open(&t, &o) != 0 || kvt_tier_start_writer(t) != 0) {
    fprintf(stderr, "live_holder: open %s: %s\n", argv[1], kvt_last_error());
    return 1;
  }
  printf("ready %ld\n", (long)getpid());
  fflush(stdout);
  char line[128];
  int next = 1, rc = 0;
  while (fgets(line, sizeof line, stdin)) {
    int n = 0;
    if (sscanf(line, "spill %d", &n) == 1 && n > 0 && n < 1000) {
      for (int i = 0; i < n && rc == 0; i++)
        rc = spill_one(t, next++);
      if (rc == 0)
        rc = kvt_tier_flush(t, -1);
    } else if (strncmp(line, "hit", 3) == 0) {
      rc = promote(t, 1);
    } else if (strncmp(line, "miss", 4) == 0) {
      rc = promote(t, 999999) == KVT_ENOTFOUND ? 0 : 1;
    } else if (strncmp(line, "quit", 4) == 0) {
      break;
    } else {
      rc = 1;
    }
    if (rc != 0) {
      fprintf(stderr, "live_holder: '%s' failed: %s\n", line, kvt_last_error());
      break;
    }
    printf("ok\n");
    fflush(stdout);
  }
  int crc = kvt_tier_close(t, -1);
  kvt_tier_free(t);
  return rc == 0 && crc == 0 ? 0 : 1;
}
