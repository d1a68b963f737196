/*
 * prog_sys.c - the install test's consumer of the installed <kvtier_sys.h>,
 * the header of the tools' and compatibility calls: it comes first, so it must
 * stand on its own (it brings <kvtier.h>). Spills one small entry into a tier
 * in argv[1] (tests/public_entry.h), then reads the directory back through
 * calls only kvtier_sys.h declares - the chunked store's totals, the check of
 * index.db, the live counters the open tier publishes and, once the tier is
 * closed, the index on its own - and prints the library version.
 */
#define _POSIX_C_SOURCE 200809L /* getpid */
#include <kvtier_sys.h>

#include "public_entry.h" /* only <kvtier.h> */

#include <stdio.h>
#include <unistd.h>

static int fail(const char *what) {
  fprintf(stderr, "%s: %s\n", what, kvt_last_error());
  return 1;
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: prog_sys DIR\n");
    return 2;
  }
  kvt_options o;
  kvt_options_init(&o, KVT_OPTIONS_VERSION);
  o.cache_dir = argv[1];
  kvt_tier *t = NULL;
  if (kvt_tier_open(&t, &o) != 0)
    return fail("open");
  if (kvt_tier_start_writer(t) != 0 || pe_spill(t, 3) != 0 ||
      kvt_tier_flush(t, -1) != 0)
    return fail("spill");

  kvt_chunk_totals ct = KVT_CHUNK_TOTALS_INIT;
  if (kvt_tier_chunk_totals(&ct, t) != 0)
    return fail("chunk totals");
  if (ct.chunk_tokens != KVT_CHUNK_TOKENS_DEFAULT) {
    fprintf(stderr, "chunk_tokens %u\n", (unsigned)ct.chunk_tokens);
    return 1;
  }
  if (kvt_tier_check_index(t) != 0)
    return fail("check index");
  kvt_stats s = KVT_STATS_INIT;
  kvt_stats_live live;
  if (kvt_stats_read_live(&s, &live, kvt_tier_dir(t)) != 0)
    return fail("live stats");
  if (!live.alive || live.pid != (int64_t)getpid() || s.spill_count != 1) {
    fprintf(stderr, "live stats: alive %d, pid %lld, spill_count %llu\n",
            live.alive, (long long)live.pid, (unsigned long long)s.spill_count);
    return 1;
  }
  if (kvt_tier_close(t, 10000) != 0)
    return fail("close");
  kvt_tier_free(t);

  kvt_index *idx = NULL;
  uint64_t rows = 0;
  if (kvt_index_open(&idx, argv[1]) != 0)
    return fail("index open");
  int rc = kvt_index_count(&rows, idx);
  kvt_index_close(idx);
  if (rc != 0 || rows != 1) {
    fprintf(stderr, "index count: rc %d, %llu rows\n", rc,
            (unsigned long long)rows);
    return 1;
  }
  printf("kvtier %s ok\n", kvt_version());
  return 0;
}
