/*
 * test_replace_race_tier.c - a streamed read racing a replace of the same
 * entry. A promote that reports layers through on_layer cannot be retried
 * once a layer is out, so the writer must not swap a new version in while it
 * runs: the writer takes the entry's stripe lock for writing when it replaces
 * (write_one in src/writer.c). Here a promote pauses inside on_layer while
 * the same tokens are spilled again; the pause ends as soon as the entry's
 * directory is seen swapped (or after a grace period, when the writer is
 * correctly waiting). Asserted: the promote succeeds, every layer reported and
 * returned is the old version's (no mix, no KVT_EAGAIN), no promotion failure
 * is counted, and afterwards the new version is served. Both for a kvtier
 * entry (checksummed: a mix would also fail verification) and for a
 * reference-format entry (no checksums: only the lock and the directory
 * identity check protect it).
 */
#include "tier_testlib.h"

#include <pthread.h>
#include <sys/stat.h>

typedef struct race {
  kvt_tier *t;
  const t_entry *old_v;
  char dir[4200];
  struct stat before;
  atomic_int paused, swapped_seen, bad_layers, reported;
  int rc;
  kvt_entry *got;
} race;

static int dir_swapped(const race *r) {
  struct stat st;
  return lstat(r->dir, &st) != 0 || st.st_ino != r->before.st_ino;
}

static void on_layer(void *ctx, uint32_t i, const kvt_layer *layer) {
  race *r = ctx;
  atomic_fetch_add(&r->reported, 1);
  const kvt_layer *want = &r->old_v->layers[i];
  int same = layer && layer->num_tensors == want->num_tensors;
  for (uint32_t k = 0; same && k < want->num_tensors; k++)
    same = layer->tensors[k].nbytes == want->tensors[k].nbytes &&
           !memcmp(layer->tensors[k].data, want->tensors[k].data,
                   want->tensors[k].nbytes);
  if (!same)
    atomic_fetch_add(&r->bad_layers, 1);
  if (atomic_exchange(&r->paused, 1))
    return;
  /* Hold the read open until the replace has happened (the bug) or long
   * enough for the writer to have reached it (then it is waiting for us). */
  for (int ms = 0; ms < 400; ms++) {
    if (dir_swapped(r)) {
      atomic_store(&r->swapped_seen, 1);
      break;
    }
    usleep(1000);
  }
}

static void *reader(void *arg) {
  race *r = arg;
  kvt_promote_opts po = KVT_PROMOTE_OPTS_INIT;
  po.on_layer = on_layer;
  po.layer_ctx = r;
  r->rc = kvt_tier_promote(&r->got, r->t, r->old_v->tokens, r->old_v->n_tokens,
                           &po);
  return NULL;
}

/* Rewrites data/<hash> as the reference writes it: manifest.json without the
 * "kvtier" object (no checksums), no manifest.sum. */
static void make_reference(kvt_tier *t, const t_entry *e) {
  char *man = t_entry_path(t, e->tokens, e->n_tokens, "manifest.json");
  char *sum = t_entry_path(t, e->tokens, e->n_tokens, "manifest.sum");
  size_t n = 0;
  char *m = kvt_test_read_file(man, &n);
  REQUIRE(m);
  char *k = strstr(m, ", \"kvtier\": {");
  if (!k)
    k = strstr(m, ",\"kvtier\":{");
  REQUIRE(k);
  strcpy(k, "}");
  FILE *f = fopen(man, "w");
  REQUIRE(f && fputs(m, f) >= 0 && fclose(f) == 0);
  REQUIRE(unlink(sum) == 0);
  free(m);
  free(man);
  free(sum);
}

static void race_once(int reference, uint64_t seed) {
  kvt_options o = t_opts("race");
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  t_entry a = t_make(seed, 40, 6, 8, 16), b = t_make(seed + 1, 40, 6, 8, 16);
  memcpy(b.tokens, a.tokens, 40 * sizeof(int32_t));
  REQUIRE(t_spill(t, &a) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  if (reference)
    make_reference(t, &a);
  race *r = calloc(1, sizeof *r);
  r->t = t;
  r->old_v = &a;
  char *d = t_entry_path(t, a.tokens, a.n_tokens, NULL);
  snprintf(r->dir, sizeof r->dir, "%s", d);
  free(d);
  REQUIRE(lstat(r->dir, &r->before) == 0);
  /* A plain read of the unchanged entry first: the format is readable. */
  kvt_entry *got = NULL;
  REQUIRE(kvt_tier_promote(&got, t, a.tokens, a.n_tokens, NULL) == 0);
  CHECK(t_same(got, &a));
  kvt_entry_free(got);

  pthread_t th;
  REQUIRE(pthread_create(&th, NULL, reader, r) == 0);
  while (!atomic_load(&r->paused))
    usleep(200);
  REQUIRE(t_spill(t, &b) == 0); /* the replace, while the read is paused */
  pthread_join(th, NULL);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  if (r->rc != 0 || atomic_load(&r->swapped_seen))
    fprintf(stderr,
            "  %s entry: promote returned %d (%s); directory swapped during "
            "the read: %d\n",
            reference ? "reference" : "kvtier", r->rc,
            r->rc ? kvt_last_error() : "", atomic_load(&r->swapped_seen));
  CHECK_EQ_INT(r->rc, 0);
  CHECK(!atomic_load(&r->swapped_seen));
  CHECK(r->got && t_same(r->got, &a));
  CHECK_EQ_INT(atomic_load(&r->bad_layers), 0);
  CHECK_EQ_INT(atomic_load(&r->reported), 6);
  kvt_entry_free(r->got);
  kvt_stats s = KVT_STATS_INIT;
  CHECK_EQ_INT(kvt_tier_stats(&s, t), 0);
  CHECK_EQ_INT(s.promotion_failures, 0);
  CHECK_EQ_INT(s.quarantined, 0);
  CHECK_EQ_INT(s.write_failures, 0);
  /* The replace did happen, after the read. */
  got = NULL;
  CHECK_EQ_INT(kvt_tier_promote(&got, t, a.tokens, a.n_tokens, NULL), 0);
  CHECK(got && t_same(got, &b));
  kvt_entry_free(got);
  kvt_tier_free(t);
  free(r);
  t_free(&a);
  t_free(&b);
}

static void test_streamed_read_vs_replace(void) {
  for (uint64_t i = 0; i < 2; i++)
    race_once(0, 700 + 2 * i);
}

static void test_reference_entry_read_vs_replace(void) {
  for (uint64_t i = 0; i < 2; i++)
    race_once(1, 800 + 2 * i);
}

int main(void) {
  RUN(test_streamed_read_vs_replace);
  RUN(test_reference_entry_read_vs_replace);
  return kvt_test_done();
}
