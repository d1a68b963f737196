/*
 * test_tier_trim_attrs.c - a trimmed promote that reads the entry's layer
 * files returns each layer with the attributes it was spilled with (here a KV
 * layer's growth step, as an MLX KVCache carries it), whether the entry is
 * stored whole or as a chain of chunks plus a tail whose kept rows reach into
 * the tail: only the offset changes, to the rows kept, as the whole promote of
 * either keeps them all. (Kept rows inside a pure chain are served from the
 * chunks alone, which hold no such attributes: not covered here.)
 */
#include "fmt_testlib.h"
#include "tier_testlib.h"
#include "kvtier.h"

#define N 40
#define T 48
#define STEP 256

static void spill(kvt_tier *t, const int32_t *tok) {
  kvt_layer l[2];
  for (int i = 0; i < 2; i++) {
    l[i] = t_kv_tokens(tok, N, T, 8, i);
    l[i].step = STEP;
  }
  CHECK_EQ_INT(kvt_tier_spill(t, tok, N, l, 2, 1000), 0);
  for (int i = 0; i < 2; i++)
    t_layer_free(&l[i]);
  REQUIRE(kvt_tier_flush(t, 30000) == 0);
}

/* Every layer of e: kind KV, step as spilled, offset keep, no rotating
 * fields. */
static int attrs_kept(const kvt_entry *e, int64_t keep) {
  if (!e || kvt_entry_num_layers(e) != 2)
    return 0;
  for (uint32_t i = 0; i < 2; i++) {
    const kvt_layer *l = kvt_entry_layer(e, i);
    if (l->kind != KVT_LAYER_KV || l->step != STEP || l->offset != keep ||
        l->max_size != KVT_ABSENT || l->keep != KVT_ABSENT ||
        l->idx != KVT_ABSENT || l->bits != 0 || l->group_size != 0)
      return 0;
  }
  return 1;
}

static void run(uint32_t chunk_tokens, const char *tag) {
  kvt_options o = t_opts(tag);
  o.chunk_tokens = chunk_tokens;
  o.model_id = "test-model";
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  int32_t tok[N];
  for (int i = 0; i < N; i++)
    tok[i] = 300 + i * 3;
  spill(t, tok);
  kvt_entry *e = NULL;
  REQUIRE(kvt_tier_promote(&e, t, tok, N, NULL) == 0);
  CHECK(attrs_kept(e, N));
  kvt_entry_free(e);
  /* Stored whole (chunk_tokens 0): any kept length. Chained (16-token
   * chunks, 32 rows in the chain): 36 reach into the tail. */
  int64_t keeps[] = {36, 20};
  for (int k = 0; k < (chunk_tokens ? 1 : 2); k++) {
    e = NULL;
    REQUIRE(kvt_tier_promote_trim(&e, t, tok, N, (size_t)keeps[k], NULL) == 0);
    CHECK(attrs_kept(e, keeps[k]));
    CHECK(e && kvt_entry_layer(e, 0)->tensors[0].shape[2] == keeps[k]);
    kvt_entry_free(e);
  }
  REQUIRE(kvt_tier_close(t, 30000) == 0);
  kvt_tier_free(t);
}

static void test_chained(void) {
  run(16, "trim_attrs_chained");
}

static void test_whole(void) {
  run(0, "trim_attrs_whole");
}

int main(void) {
  RUN(test_whole);
  RUN(test_chained);
  return kvt_test_done();
}
