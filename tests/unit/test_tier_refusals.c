/*
 * test_tier_refusals.c - refused spills are counted by reason (kvt_stats
 * version 3, spill_refused_*; public API only): a rotating layer without
 * max_size and an n_keep of 0 count as invalid, a spill larger than
 * spill_queue_bytes as too big, a spill into a full queue as queue full (and
 * still as spill_drops), a spill after close as closed, a binding's own
 * refusal (kvt_tier_stats_add) as unsupported; each refused call counts
 * once, accepted ones never. The live stats file mirrors every counter word
 * for word, the JSON and Prometheus renderings carry them, and a version-2
 * caller's struct is not written past its end.
 */
#include "tier_testlib.h"
#include "testutil.h"
#include "kvtier_sys.h"

#include <stdio.h>
#include <stdlib.h>
#include <stddef.h>
#include <string.h>

static kvt_stats stats_of(kvt_tier *t) {
  kvt_stats s = KVT_STATS_INIT;
  REQUIRE(kvt_tier_stats(&s, t) == 0);
  return s;
}

/* What a sum of every refusal reason gives. */
static uint64_t refused(const kvt_stats *s) {
  return s->spill_refused_unsupported + s->spill_refused_invalid +
         s->spill_refused_too_big + s->spill_refused_queue_full +
         s->spill_refused_closed + s->spill_refused_other;
}

static void test_reasons_and_live_file(void) {
  kvt_options o = t_opts("refuse");
  o.spill_queue_size = 1;
  o.spill_queue_bytes = 64 << 10;
  kvt_tier *t =
      t_open(&o); /* writer not started: the queue keeps what it has */
  t_entry ok = t_make(1, 16, 2, 16, 16);    /* 4 KiB of tensors */
  t_entry big = t_make(2, 600, 2, 600, 16); /* 150 KiB > 64 KiB */
  t_entry rot = t_make(3, 16, 2, 16, 16);
  rot.layers[1].kind = KVT_LAYER_ROTATING_KV; /* max_size left absent */

  CHECK_EQ_INT(t_spill(t, &rot), KVT_EINVAL);
  CHECK_EQ_INT(t_spill(t, &big), KVT_ETOOBIG);
  CHECK_EQ_INT(kvt_tier_spill_prefix(t, ok.tokens, 0, ok.layers, ok.n_layers,
                                     ok.memory_bytes),
               KVT_EINVAL);
  CHECK_EQ_INT(t_spill(t, &ok), 0);
  t_entry ok2 = t_make(4, 16, 2, 16, 16);
  CHECK_EQ_INT(t_spill(t, &ok2), KVT_EFULL);
  CHECK_EQ_INT(kvt_tier_stats_add(t, "spill_refused_unsupported", 2), 0);

  kvt_stats s = stats_of(t);
  CHECK_EQ_INT(s.spill_refused_invalid, 2);
  CHECK_EQ_INT(s.spill_refused_too_big, 1);
  CHECK_EQ_INT(s.spill_refused_queue_full, 1);
  CHECK_EQ_INT(s.spill_refused_unsupported, 2);
  CHECK_EQ_INT(s.spill_refused_closed, 0);
  CHECK_EQ_INT(s.spill_refused_other, 0);
  CHECK_EQ_INT(s.spill_drops, 1); /* version 1's meaning is kept */
  CHECK_EQ_INT(refused(&s), 6);

  /* The live file holds the same words (read from another handle of it). */
  kvt_stats l = KVT_STATS_INIT;
  kvt_stats_live lv;
  REQUIRE(kvt_stats_read_live(&l, &lv, o.cache_dir) == 0);
  CHECK_EQ_INT(lv.alive, 1);
  CHECK_EQ_INT(l.spill_refused_invalid, 2);
  CHECK_EQ_INT(l.spill_refused_too_big, 1);
  CHECK_EQ_INT(l.spill_refused_queue_full, 1);
  CHECK_EQ_INT(l.spill_refused_unsupported, 2);
  CHECK(memcmp(&l.spill_refused_unsupported, &s.spill_refused_unsupported,
               6 * sizeof(uint64_t)) == 0);
  /* The file's word count covers the whole struct, version 3 included, and
   * each word sits at its field's offset (FORMAT.md section 9). */
  char p[4200];
  snprintf(p, sizeof p, "%s/stats.bin", o.cache_dir);
  FILE *f = fopen(p, "rb");
  REQUIRE(f);
  unsigned char head[4096];
  REQUIRE(fread(head, 1, sizeof head, f) == sizeof head);
  fclose(f);
  uint32_t nwords;
  memcpy(&nwords, head + 12, 4);
  CHECK_EQ_INT(nwords, sizeof(kvt_stats) / 8);
  uint64_t w;
  memcpy(&w, head + 64 + offsetof(kvt_stats, spill_refused_other), 8);
  CHECK_EQ_INT(w, s.spill_refused_other);
  memcpy(&w, head + 64 + offsetof(kvt_stats, spill_refused_too_big), 8);
  CHECK_EQ_INT(w, s.spill_refused_too_big);
  memcpy(&w, head + 64 + offsetof(kvt_stats, chain_cuts_kept), 8);
  CHECK_EQ_INT(w, s.chain_cuts_kept);
  memcpy(&w, head + 64 + offsetof(kvt_stats, host_cache_chunk_bytes), 8);
  CHECK_EQ_INT(w, s.host_cache_chunk_bytes);
  memcpy(&w, head + 64 + offsetof(kvt_stats, spills_batched), 8);
  CHECK_EQ_INT(w, s.spills_batched);
  memcpy(&w, head + 64 + offsetof(kvt_stats, admission_tokens_declined), 8);
  CHECK_EQ_INT(w, s.admission_tokens_declined);
  double life;
  memcpy(&life, head + 64 + offsetof(kvt_stats, ssd_lifetime_years), 8);
  CHECK(life == s.ssd_lifetime_years);
  memcpy(&w, head + 64 + offsetof(kvt_stats, layout_misses), 8);
  CHECK_EQ_INT(w, s.layout_misses);
  memcpy(&w, head + 64 + 8 * (nwords - 1), 8); /* the struct's last word */
  CHECK_EQ_INT(w, s.admission_declined_oversize);

  /* Renderings. */
  char buf[1 << 16];
  size_t need = 0;
  REQUIRE(kvt_stats_to_json(buf, sizeof buf, &need, &s) == 0);
  CHECK(strstr(buf, "\"spill_refused_invalid\": 2") ||
        strstr(buf, "\"spill_refused_invalid\":2"));
  CHECK(strstr(buf, "spill_refused_other") != NULL);
  REQUIRE(kvt_stats_to_prometheus(buf, sizeof buf, &need, &s) == 0);
  CHECK(strstr(buf, "\nkvtier_spill_refused_too_big_total 1\n") != NULL);
  CHECK(strstr(buf, "# TYPE kvtier_spill_refused_queue_full_total counter") !=
        NULL);

  /* A version-2 caller gets its prefix only. */
  kvt_stats v2;
  memset(&v2, 0x5A, sizeof v2);
  REQUIRE(kvt_stats_init(&v2, 2) == 0);
  REQUIRE(kvt_tier_stats(&v2, t) == 0);
  CHECK_EQ_INT(v2.spill_drops, 1);
  CHECK_EQ_INT(v2.spill_refused_invalid, 0x5A5A5A5A5A5A5A5Aull);

  /* After close: refused as closed, counted, and the file keeps it. */
  REQUIRE(kvt_tier_start_writer(t) == 0);
  REQUIRE(kvt_tier_close(t, -1) == 0);
  CHECK_EQ_INT(t_spill(t, &ok2), KVT_ECLOSED);
  kvt_stats c = KVT_STATS_INIT;
  CHECK_EQ_INT(kvt_tier_stats(&c, t), 0);
  CHECK_EQ_INT(c.spill_refused_closed, 1);
  CHECK_EQ_INT(refused(&c), 7);
  CHECK_EQ_INT(c.spill_count, 1);
  t_free(&ok);
  t_free(&ok2);
  t_free(&big);
  t_free(&rot);
  kvt_tier_free(t);
}

/* A read-only tier refuses every spill: counted as invalid. */
static void test_readonly(void) {
  kvt_options o = t_opts("refuse-ro");
  kvt_tier *t = t_open(&o);
  kvt_tier_free(t);
  o.flags |= KVT_OPEN_READONLY;
  t = t_open(&o);
  t_entry e = t_make(5, 16, 1, 16, 16);
  CHECK_EQ_INT(t_spill(t, &e), KVT_EINVAL);
  kvt_stats s = stats_of(t);
  CHECK_EQ_INT(s.spill_refused_invalid, 1);
  CHECK_EQ_INT(refused(&s), 1);
  t_free(&e);
  kvt_tier_free(t);
}

int main(void) {
  RUN(test_reasons_and_live_file);
  RUN(test_readonly);
  return kvt_test_done();
}
