/*
 * test_stats.c - the stats renderings: JSON carries the reference's to_dict
 * keys with its rounding (values computed by Python's SSDCacheStats.to_dict for
 * the same counters and written here as literals) followed by kvtier's keys,
 * integers exact beyond 2^53; the Prometheus text has HELP/TYPE lines and
 * kvtier_* names; both follow the size-then-copy contract.
 */
#include "testutil.h"

#include <string.h>

static void test_json_reference_keys(void) {
  kvt_stats s;
  memset(&s, 0, sizeof s);
  s.spill_count = 3;
  s.spill_bytes = 12345;
  s.ssd_hits = 7;
  s.ssd_misses = 2;
  s.reload_latency_sum = 0.123456789;
  s.reload_bytes = 999;
  s.promotion_failures = 1;
  s.spill_drops = 4;
  s.entries = 5;
  s.disk_bytes =
      9007199254740993ULL; /* 2^53 + 1: not representable as a double */
  char buf[4096];
  size_t need = 0;
  CHECK_EQ_INT(kvt_stats_to_json(buf, sizeof buf, &need, &s), 0);
  CHECK_EQ_INT(need, strlen(buf) + 1);
  /* Python: SSDCacheStats(3, 12345, 7, 2, 0.123456789, 999, 1).to_dict() ->
   * ssd_hit_rate round(7/9, 4) = 0.7778, reload_latency_sum_s 0.1235,
   * avg_reload_latency_ms round(0.123456789/7*1000, 2) = 17.64. */
  const char *prefix =
      "{\"spill_count\":3,\"spill_bytes\":12345,\"ssd_hits\":7,\"ssd_misses\":"
      "2,"
      "\"ssd_hit_rate\":0.7778,\"reload_latency_sum_s\":0.1235,"
      "\"avg_reload_latency_ms\":17.64,\"reload_bytes\":999,"
      "\"promotion_failures\":1,";
  CHECK(strncmp(buf, prefix, strlen(prefix)) == 0);
  if (strncmp(buf, prefix, strlen(prefix)) != 0)
    fprintf(stderr, "got: %s\n", buf);
  CHECK(strstr(buf, "\"spill_drops\":4") != NULL);
  CHECK(strstr(buf, "\"entries\":5") != NULL);
  CHECK(strstr(buf, "\"disk_bytes\":9007199254740993") != NULL);
  const char *keys[] = {"write_failures", "evictions",   "expirations",
                        "quarantined",    "reconciled",  "promotions_cancelled",
                        "memory_bytes",   "queue_depth", "queue_bytes",
                        "spill_rejects"};
  for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
    char k[64];
    snprintf(k, sizeof k, "\"%s\":", keys[i]);
    CHECK(strstr(buf, k) != NULL);
  }
}

/* CHECKs the derived values kvt_stats_to_json renders for s, each exactly as
 * Python's to_dict prints it and followed by a comma. */
static void check_derived(const kvt_stats *s, const char *hit_rate,
                          const char *latency_sum_s, const char *avg_ms) {
  static const char *names[3] = {"ssd_hit_rate", "reload_latency_sum_s",
                                 "avg_reload_latency_ms"};
  const char *want[3] = {hit_rate, latency_sum_s, avg_ms};
  char buf[4096];
  CHECK_EQ_INT(kvt_stats_to_json(buf, sizeof buf, NULL, s), 0);
  for (int i = 0; i < 3; i++) {
    char k[96];
    snprintf(k, sizeof k, "\"%s\":%s,", names[i], want[i]);
    if (!strstr(buf, k))
      fprintf(stderr, "missing %s in %s\n", k, buf);
    CHECK(strstr(buf, k) != NULL);
  }
}

static void test_json_zero_and_rounding(void) {
  kvt_stats s;
  memset(&s, 0, sizeof s);
  /* Python's to_dict on zeros gives floats 0.0 for the derived values. */
  check_derived(&s, "0.0", "0.0", "0.0");
  /* 1 hit of 2 s: hit_rate 1.0, avg 2000.0 ms. */
  s.ssd_hits = 1;
  s.reload_latency_sum = 2.0;
  check_derived(&s, "1.0", "2.0", "2000.0");
  /* round(1/3, 4) = 0.3333; round(0.00005, 4) = 0.0001 (0.00005 is above the
   * tie in binary) */
  s.ssd_hits = 1;
  s.ssd_misses = 2;
  s.reload_latency_sum = 0.00005;
  check_derived(&s, "0.3333", "0.0001", "0.05");
}

static void test_size_then_copy(void) {
  kvt_stats s;
  memset(&s, 0, sizeof s);
  size_t need = 0;
  CHECK_EQ_INT(kvt_stats_to_json(NULL, 0, &need, &s), KVT_ERANGE);
  CHECK(need > 10);
  char small[8];
  CHECK_EQ_INT(kvt_stats_to_json(small, sizeof small, &need, &s), KVT_ERANGE);
  char *buf = malloc(need);
  size_t need2 = 0;
  CHECK_EQ_INT(kvt_stats_to_json(buf, need, &need2, &s), 0);
  CHECK_EQ_INT(need2, need);
  free(buf);
  CHECK_EQ_INT(kvt_stats_to_prometheus(NULL, 0, &need, &s), KVT_ERANGE);
  buf = malloc(need);
  CHECK_EQ_INT(kvt_stats_to_prometheus(buf, need, NULL, &s), 0);
  free(buf);
  CHECK_EQ_INT(kvt_stats_to_json(NULL, 0, &need, NULL), KVT_EINVAL);
}

static void test_prometheus(void) {
  kvt_stats s;
  memset(&s, 0, sizeof s);
  s.ssd_hits = 3;
  s.ssd_misses = 1;
  s.spill_count = 42;
  s.entries = 7;
  s.reload_latency_sum = 1.5;
  char buf[16384];
  CHECK_EQ_INT(kvt_stats_to_prometheus(buf, sizeof buf, NULL, &s), 0);
  CHECK(strstr(buf, "# HELP kvtier_spill_count_total ") != NULL);
  CHECK(strstr(buf, "# TYPE kvtier_spill_count_total counter\n") != NULL);
  CHECK(strstr(buf, "\nkvtier_spill_count_total 42\n") != NULL);
  CHECK(strstr(buf, "# TYPE kvtier_entries gauge\n") != NULL);
  CHECK(strstr(buf, "\nkvtier_entries 7\n") != NULL);
  CHECK(strstr(buf, "\nkvtier_ssd_hit_rate 0.75\n") != NULL);
  CHECK(strstr(buf, "\nkvtier_reload_latency_seconds_total 1.5\n") != NULL);
  CHECK(strstr(buf, "\nkvtier_tokens_requested_total 0\n") != NULL);
  CHECK(strstr(buf, "# TYPE kvtier_tokens_served_total counter\n") != NULL);
  /* Every sample line has a TYPE line before it and the kvtier_ prefix; a
   * histogram has 15 _bucket lines, _sum and _count under one TYPE. */
  int samples = 0, types = 0, hists = 0;
  for (char *line = strtok(buf, "\n"); line; line = strtok(NULL, "\n")) {
    if (!strncmp(line, "# TYPE ", 7)) {
      types++;
      hists += strstr(line, " histogram") != NULL;
    } else if (line[0] != '#') {
      samples++;
      CHECK(!strncmp(line, "kvtier_", 7));
    }
  }
  CHECK(samples > 15);
  CHECK_EQ_INT(hists, 2);
  CHECK_EQ_INT(samples, types + hists * (KVT_STATS_LATENCY_BUCKETS + 1));
}

/* Histograms: per-bucket counts in kvt_stats, cumulative in the text. */
static void test_prometheus_histograms(void) {
  kvt_stats s;
  memset(&s, 0, sizeof s);
  s.promote_latency_hist[0] = 2;  /* <= 0.5 ms */
  s.promote_latency_hist[3] = 1;  /* (2.5 ms, 5 ms] */
  s.promote_latency_hist[14] = 4; /* > 10 s */
  s.reload_latency_sum = 41.25;
  s.spill_latency_hist[10] = 5; /* (0.5 s, 1 s] */
  s.spill_latency_sum = 4.5;
  char buf[16384];
  CHECK_EQ_INT(kvt_stats_to_prometheus(buf, sizeof buf, NULL, &s), 0);
  CHECK(strstr(buf, "# TYPE kvtier_promote_latency_seconds histogram\n"));
  CHECK(strstr(buf, "\nkvtier_promote_latency_seconds_bucket{le=\"0.0005\"} "
                    "2\n"));
  CHECK(strstr(buf,
               "\nkvtier_promote_latency_seconds_bucket{le=\"0.0025\"} 2\n"));
  CHECK(
      strstr(buf, "\nkvtier_promote_latency_seconds_bucket{le=\"0.005\"} 3\n"));
  CHECK(strstr(buf, "\nkvtier_promote_latency_seconds_bucket{le=\"10\"} 3\n"));
  CHECK(
      strstr(buf, "\nkvtier_promote_latency_seconds_bucket{le=\"+Inf\"} 7\n"));
  CHECK(strstr(buf, "\nkvtier_promote_latency_seconds_sum 41.25\n"));
  CHECK(strstr(buf, "\nkvtier_promote_latency_seconds_count 7\n"));
  CHECK(strstr(buf, "\nkvtier_spill_latency_seconds_bucket{le=\"0.5\"} 0\n"));
  CHECK(strstr(buf, "\nkvtier_spill_latency_seconds_bucket{le=\"1\"} 5\n"));
  CHECK(strstr(buf, "\nkvtier_spill_latency_seconds_sum 4.5\n"));
  CHECK(strstr(buf, "\nkvtier_spill_latency_seconds_count 5\n"));
}

int main(void) {
  RUN(test_json_reference_keys);
  RUN(test_json_zero_and_rounding);
  RUN(test_size_then_copy);
  RUN(test_prometheus);
  RUN(test_prometheus_histograms);
  return kvt_test_done();
}
