/*
 * stage.c - the Redis backend's local staging directories (the vtable's
 * stage): a fresh directory under the configured staging root, named by
 * process and sequence so concurrent puts and reads of one process, or of
 * several sharing the root, never meet. A put writes the entry's files there
 * before uploading them; a read scatters fetched chunks there before the
 * entry reader verifies them.
 */
#include "base/io.h"
#include "store/redis/internal.h"

#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <unistd.h>

int kvti_rb_stage(kvti_backend *b, char **out) {
  redis_backend *rb = kvti_rb(b);
  char name[64];
  snprintf(name, sizeof name, "%ld-%" PRIu64, (long)getpid(),
           (uint64_t)atomic_fetch_add(&rb->stage_seq, 1));
  char *p = kvti_path_join(rb->stage_root, name);
  if (!p)
    return KVT_ENOMEM;
  kvti_rmtree(p);
  int rc = kvti_mkdir(p, rb->dir_mode);
  if (rc != 0) {
    kvti_free(p);
    return rc;
  }
  *out = p;
  return 0;
}
