/*
 * live_holder.c - a serving process for the CLI's live-stats tests
 * (test_cli.py, group "live"): opens DIR as a writable tier (so it publishes
 * DIR/stats.bin), prints "ready PID", then obeys one command per stdin line,
 * answering "ok" when done: "spill N" stores N more seeded entries of 32
 * tokens (and waits until they are written), "again N" spills the first N
 * of them once more (and waits), "refuse N" makes N spills the
 * library must refuse as invalid (layers NULL), "hit" promotes the first entry,
 * "miss" promotes tokens never stored, "quit" closes the tier and exits 0;
 * end of input closes too. Optional CHUNK_TOKENS and MAX_ENTRIES make it a
 * chunked writer that evicts as it goes (a busy neighbour for `verify`);
 * POLICY (kvt_admission_policy) and BUDGET (write_budget_bytes_per_day) set
 * admission and the write budget.
 * Entries are tests/public_entry.h's; only the public API is used.
 */
#include "public_entry.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int promote(kvt_tier *t, int seed) {
  int32_t tok[PE_T];
  pe_tokens(tok, seed);
  kvt_entry *e = NULL;
  int rc = kvt_tier_promote(&e, t, tok, PE_T, NULL);
  if (rc == 0 && !pe_same(e, seed))
    rc = KVT_ECORRUPT;
  kvt_entry_free(e);
  return rc;
}

int main(int argc, char **argv) {
  if (argc < 2 || argc > 6) {
    fprintf(stderr, "usage: live_holder DIR [CHUNK_TOKENS [MAX_ENTRIES "
                    "[POLICY [BUDGET]]]]\n");
    return 2;
  }
  kvt_options o;
  kvt_options_init(&o, KVT_OPTIONS_VERSION);
  o.cache_dir = argv[1];
  o.durability = KVT_DURABILITY_NONE;
  if (argc > 2)
    o.chunk_tokens = (uint32_t)atoi(argv[2]);
  if (argc > 3)
    o.max_entries = (uint64_t)atoll(argv[3]);
  if (argc > 4)
    o.admission_policy = atoi(argv[4]);
  if (argc > 5)
    o.write_budget_bytes_per_day = (uint64_t)strtoull(argv[5], NULL, 10);
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
        rc = pe_spill(t, next++);
      if (rc == 0)
        rc = kvt_tier_flush(t, -1);
    } else if (sscanf(line, "again %d", &n) == 1 && n > 0 && n < next) {
      for (int i = 1; i <= n && rc == 0; i++)
        rc = pe_spill(t, i);
      if (rc == 0)
        rc = kvt_tier_flush(t, -1);
    } else if (sscanf(line, "refuse %d", &n) == 1 && n > 0 && n < 1000) {
      int32_t tok[PE_T];
      pe_tokens(tok, 7);
      for (int i = 0; i < n && rc == 0; i++)
        rc = kvt_tier_spill(t, tok, PE_T, NULL, 1, 0) == KVT_EINVAL ? 0 : 1;
      kvt_clear_error();
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
