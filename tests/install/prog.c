/*
 * prog.c - the consumer program of the install test: uses only the installed
 * <kvtier.h>. Opens a tier in argv[1], checks that the header it was compiled
 * with matches the library it runs with, spills one small entry
 * (tests/public_entry.h), promotes it back and compares the bytes, then prints
 * the library version.
 */
#include "public_entry.h" /* only <kvtier.h> */

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
  if ((rc = pe_spill(t, 7)) != 0 || (rc = kvt_tier_flush(t, -1)) != 0) {
    fprintf(stderr, "spill: %s\n", kvt_last_error());
    return 1;
  }
  int32_t tok[PE_T];
  pe_tokens(tok, 7);
  kvt_entry *e = NULL;
  if ((rc = kvt_tier_promote(&e, t, tok, PE_T, NULL)) != 0) {
    fprintf(stderr, "promote: %s\n", kvt_last_error());
    return 1;
  }
  int same = pe_same(e, 7);
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
