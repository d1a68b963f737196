/*
 * stats.c - the tier's counters (see stats.h; the kvt_tier_stats entry points
 * that add the gauges are in ops.c), and two renderings of a kvt_stats: JSON
 * with exactly the reference's SSDCacheStats.to_dict keys and rounding
 * (ssd_hit_rate to 4 places, reload_latency_sum_s to 4, avg_reload_latency_ms
 * to 2; Python's round() is correctly rounded, as printf's %.Nf is) plus
 * kvtier's counters and gauges, and the Prometheus text exposition format
 * (HELP/TYPE lines, kvtier_* names, counters end in _total). Integers are
 * printed exactly (never through a double); floats like Python's repr.
 */
#include "tier/stats.h"
#include "base/error.h"
#include "base/io.h"
#include "base/strbuf.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void kvti_stats_init(kvti_stats *st) {
  pthread_mutex_init(&st->mu, NULL);
  memset(&st->s, 0, sizeof st->s);
  st->pub = NULL;
}

void kvti_stats_destroy(kvti_stats *st) {
  kvti_stats_detach(st);
  pthread_mutex_destroy(&st->mu);
}

int kvti_stats_attach(kvti_stats *st, const char *dir, mode_t mode) {
  pthread_mutex_lock(&st->mu);
  int rc = st->pub ? 0 : kvti_statsfile_open(&st->pub, dir, mode, &st->s);
  pthread_mutex_unlock(&st->mu);
  return rc;
}

void kvti_stats_detach(kvti_stats *st) {
  pthread_mutex_lock(&st->mu);
  kvti_statsfile_close(st->pub, &st->s);
  st->pub = NULL;
  pthread_mutex_unlock(&st->mu);
}

/* Ends every update: the live file gets the new figures (st->mu held). */
static void publish(kvti_stats *st) {
  if (st->pub)
    kvti_statsfile_publish(st->pub, &st->s);
}

void kvti_stats_add_at(kvti_stats *st, size_t offset, uint64_t v) {
  pthread_mutex_lock(&st->mu);
  uint64_t *f = (uint64_t *)((char *)&st->s + offset);
  *f += v;
  publish(st);
  pthread_mutex_unlock(&st->mu);
}

void kvti_stats_refused(kvti_stats *st, int rc) {
  size_t off;
  switch (rc) {
  case KVT_EUNSUPPORTED:
    off = offsetof(kvt_stats, spill_refused_unsupported);
    break;
  case KVT_EINVAL:
    off = offsetof(kvt_stats, spill_refused_invalid);
    break;
  case KVT_ETOOBIG:
    off = offsetof(kvt_stats, spill_refused_too_big);
    break;
  case KVT_EFULL:
    off = offsetof(kvt_stats, spill_refused_queue_full);
    break;
  case KVT_ECLOSED:
    off = offsetof(kvt_stats, spill_refused_closed);
    break;
  default:
    off = offsetof(kvt_stats, spill_refused_other);
    break;
  }
  kvti_stats_add_at(st, off, 1);
}

static const double latency_bounds[KVT_STATS_LATENCY_BUCKETS - 1] =
    KVT_STATS_LATENCY_BOUNDS_INIT;

static void hist_add(uint64_t *h, double latency_s) {
  size_t i = 0;
  while (i < KVT_STATS_LATENCY_BUCKETS - 1 && latency_s > latency_bounds[i])
    i++;
  h[i]++;
}

void kvti_stats_hit(kvti_stats *st, double latency_s, uint64_t bytes,
                    uint64_t tokens) {
  pthread_mutex_lock(&st->mu);
  st->s.ssd_hits++;
  st->s.reload_latency_sum += latency_s;
  st->s.reload_bytes += bytes;
  st->s.tokens_served += tokens;
  hist_add(st->s.promote_latency_hist, latency_s);
  publish(st);
  pthread_mutex_unlock(&st->mu);
}

void kvti_stats_spilled(kvti_stats *st, uint64_t bytes, double latency_s) {
  if (latency_s < 0)
    latency_s = 0;
  pthread_mutex_lock(&st->mu);
  st->s.spill_count++;
  st->s.spill_bytes += bytes;
  st->s.spill_latency_sum += latency_s;
  hist_add(st->s.spill_latency_hist, latency_s);
  publish(st);
  pthread_mutex_unlock(&st->mu);
}

void kvti_stats_set_gauges(kvti_stats *st, const kvt_stats *g) {
  pthread_mutex_lock(&st->mu);
  st->s.entries = g->entries;
  st->s.disk_bytes = g->disk_bytes;
  st->s.memory_bytes = g->memory_bytes;
  st->s.queue_depth = g->queue_depth;
  st->s.queue_bytes = g->queue_bytes;
  st->s.remote_queue_depth = g->remote_queue_depth;
  st->s.remote_available = g->remote_available;
  st->s.bytes_written_today = g->bytes_written_today;
  st->s.write_budget_bytes_per_day = g->write_budget_bytes_per_day;
  st->s.write_budget_left = g->write_budget_left;
  st->s.ssd_lifetime_years = g->ssd_lifetime_years;
  publish(st);
  pthread_mutex_unlock(&st->mu);
}

void kvti_stats_set_budget_gauges(kvti_stats *st, const kvt_stats *g) {
  pthread_mutex_lock(&st->mu);
  st->s.bytes_written_today = g->bytes_written_today;
  st->s.write_budget_bytes_per_day = g->write_budget_bytes_per_day;
  st->s.write_budget_left = g->write_budget_left;
  st->s.ssd_lifetime_years = g->ssd_lifetime_years;
  publish(st);
  pthread_mutex_unlock(&st->mu);
}

void kvti_stats_copy(kvt_stats *out, kvti_stats *st) {
  pthread_mutex_lock(&st->mu);
  *out = st->s;
  pthread_mutex_unlock(&st->mu);
}

/* Derived values of the renderings. */
static double hit_rate(const kvt_stats *s) {
  uint64_t total = s->ssd_hits + s->ssd_misses;
  return total > 0 ? (double)s->ssd_hits / (double)total : 0.0;
}
static double reload_latency_sum(const kvt_stats *s) {
  return s->reload_latency_sum;
}
static double avg_reload_ms(const kvt_stats *s) {
  return s->ssd_hits > 0 ? s->reload_latency_sum / (double)s->ssd_hits * 1000
                         : 0.0;
}
static uint64_t local_hits(const kvt_stats *s) {
  return s->ssd_hits > s->remote_hits ? s->ssd_hits - s->remote_hits : 0;
}
static double remote_latency_sum(const kvt_stats *s) {
  return s->remote_latency_sum;
}
static double avg_remote_ms(const kvt_stats *s) {
  return s->remote_hits > 0
             ? s->remote_latency_sum / (double)s->remote_hits * 1000
             : 0.0;
}

static double ssd_lifetime(const kvt_stats *s) {
  return s->ssd_lifetime_years;
}

/* Every value of a kvt_stats, in the order both renderings print them. A
 * value is a uint64_t field (off), or computed by getu (integer) or getf
 * (float, rounded to nd decimals in JSON as the reference's to_dict rounds;
 * Prometheus prints it unrounded). key is the JSON key, prom the Prometheus
 * name after "kvtier_" (NULL: not exported there). The counters that
 * kvt_tier_stats_add accepts are the counter fields (off, counter): gauges
 * (entries, bytes, queue) are measured, not counted, and derived values
 * cannot be adjusted. */
typedef struct metric {
  const char *key, *prom;
  int counter; /* else gauge */
  const char *help;
  size_t off;
  uint64_t (*getu)(const kvt_stats *);
  double (*getf)(const kvt_stats *);
  int nd;
} metric;

#define FIELD(f, prom, counter, help)                                          \
  { #f, prom, counter, help, offsetof(kvt_stats, f), NULL, NULL, 0 }
#define CNT(f, help) FIELD(f, #f "_total", 1, help)
#define GAUGE(f, help) FIELD(f, #f, 0, help)
#define FLOAT(key, prom, counter, help, fn, nd)                                \
  { key, prom, counter, help, 0, NULL, fn, nd }

static const metric metrics[] = {
    /* The reference's to_dict, same keys, order and rounding. */
    CNT(spill_count, "Entries spilled to SSD."),
    CNT(spill_bytes, "Bytes written to SSD."),
    CNT(ssd_hits, "Successful promotes from SSD."),
    CNT(ssd_misses, "Promotes that found no entry."),
    FLOAT("ssd_hit_rate", "ssd_hit_rate", 0,
          "ssd_hits / (ssd_hits + ssd_misses).", hit_rate, 4),
    FLOAT("reload_latency_sum_s", "reload_latency_seconds_total", 1,
          "Sum of promote latencies in seconds.", reload_latency_sum, 4),
    FLOAT("avg_reload_latency_ms", "avg_reload_latency_ms", 0,
          "Mean promote latency in ms.", avg_reload_ms, 2),
    CNT(reload_bytes, "Bytes read from SSD by promotes."),
    CNT(promotion_failures,
        "Promotes refused by the budget or failed to read."),
    /* kvtier's. */
    CNT(spill_drops, "Spills dropped: queue full."),
    CNT(spill_rejects, "Spills refused: too big or invalid."),
    CNT(write_failures, "Spills that failed to write."),
    CNT(evictions, "Entries evicted for capacity (LRU)."),
    CNT(expirations, "Entries removed by retention."),
    CNT(quarantined, "Corrupt entries quarantined."),
    CNT(reconciled, "Rows or directories cleaned by reconcile."),
    CNT(promotions_cancelled, "Async promotes cancelled."),
    CNT(tokens_requested, "Tokens asked for by promotes (hit or miss)."),
    CNT(tokens_served, "Tokens of the entries promotes returned."),
    GAUGE(entries, "Entries stored."),
    GAUGE(disk_bytes, "Bytes of stored entries on disk."),
    GAUGE(memory_bytes, "Sum of stored entries' RAM estimates."),
    GAUGE(queue_depth, "Spills waiting in the queue."),
    GAUGE(queue_bytes, "Bytes held by queued spills."),
    /* Per tier: local and remote. */
    {"local_hits", "local_hits_total", 1, "Promotes served from the local SSD.",
     0, local_hits, NULL, 0},
    CNT(remote_hits, "Promotes served from the remote store."),
    CNT(remote_misses, "Remote lookups that found nothing usable."),
    CNT(remote_read_bytes, "Bytes fetched from the remote."),
    FLOAT("remote_latency_sum_s", "remote_latency_seconds_total", 1,
          "Sum of remote fetch latencies in seconds.", remote_latency_sum, 4),
    FLOAT("avg_remote_latency_ms", NULL, 0, NULL, avg_remote_ms, 2),
    CNT(remote_spill_count, "Entries uploaded to the remote."),
    CNT(remote_spill_bytes, "Bytes uploaded to the remote."),
    CNT(remote_spill_drops,
        "Uploads dropped: queue full or remote unavailable."),
    CNT(remote_errors, "Failed remote operations."),
    GAUGE(remote_queue_depth, "Uploads waiting."),
    GAUGE(remote_available,
          "1 when the remote is configured and not backing off."),
    /* The host RAM tier. */
    GAUGE(host_cache_bytes_used,
          "Bytes of entries held in the host RAM cache."),
    GAUGE(host_cache_bytes_bound, "Bound of the host RAM cache (0: off)."),
    GAUGE(host_cache_entries, "Entries held in the host RAM cache."),
    CNT(host_cache_hits,
        "Promotes that found the entry in the host RAM cache."),
    CNT(host_cache_misses, "Local promotes that did not find it there."),
    CNT(host_cache_evictions,
        "Entries dropped from the host RAM cache for room or by a trim."),
    CNT(host_cache_verify_failures,
        "Host RAM copies that failed the checksum check (disk read instead)."),
    CNT(promotes_from_ram, "Promotes served from the host RAM cache."),
    CNT(promote_ram_bytes, "Entry bytes of promotes served from RAM."),
    CNT(promotes_from_disk, "Local promotes read from the SSD."),
    CNT(promote_disk_bytes, "Bytes read from the SSD by local promotes."),
    /* Refused spills by reason (version 3). */
    CNT(spill_refused_unsupported,
        "Spills refused: a layer class that is not stored."),
    CNT(spill_refused_invalid,
        "Spills refused: an invalid layer or argument, or a read-only tier."),
    CNT(spill_refused_too_big,
        "Spills refused: larger than the spill queue or the capacity."),
    CNT(spill_refused_queue_full, "Spills refused: the spill queue was full."),
    CNT(spill_refused_closed,
        "Spills refused: the tier is closing or its writer stopped."),
    CNT(spill_refused_other,
        "Spills refused for another reason (out of memory, bad salt, ...)."),
    CNT(chunks_quarantined,
        "Damaged or missing chunk files moved aside (alone; the chunks below "
        "and the entries through them are kept)."),
    CNT(entries_unservable,
        "Entries made unservable by a damaged chunk (kept; served again once "
        "a spill writes the chunk)."),
    CNT(chunks_rewritten, "Damaged chunks written again by a spill."),
    CNT(chain_cuts_kept,
        "Chained reads that found their chain cut and kept the entry (a miss, "
        "never a deletion)."),
    GAUGE(host_cache_chunks,
          "Chunks held once in the host RAM cache (shared by the entries "
          "through them)."),
    GAUGE(host_cache_chunk_bytes,
          "Bytes of the chunks held in the host RAM cache."),
    CNT(spill_batches,
        "Group commits: spills written together, made durable by one fsync "
        "of data/ and one index transaction."),
    CNT(spills_batched, "Spills acknowledged through a group commit."),
    /* Admission and the write budget (version 3). */
    CNT(admission_admitted, "Spills the admission decision passed whole."),
    CNT(admission_truncated,
        "Spills written only up to their prefix seen before."),
    CNT(admission_declined_unseen,
        "Spills not written: first sighting (admission policy)."),
    CNT(admission_declined_budget, "Spills not written: the write budget."),
    CNT(admission_tokens_declined,
        "Tokens of spills that admission did not write."),
    GAUGE(bytes_written_today,
          "Bytes kvtier wrote since the day began (this open)."),
    GAUGE(write_budget_bytes_per_day, "The write budget (0: none)."),
    GAUGE(write_budget_left,
          "Bytes the write budget's bucket takes before it is full."),
    FLOAT("ssd_lifetime_years", "ssd_lifetime_years", 0,
          "The SSD's rated TBW at the rate written since open, in years "
          "(0: unknown).",
          ssd_lifetime, 2),
    CNT(layout_misses,
        "Promotes and reads of an entry of another layout than this tier's "
        "spills (another model's): a miss."),
    CNT(admission_declined_oversize,
        "Spills not written because they are larger than the write budget's "
        "whole bucket (never written under this budget; also counted in "
        "admission_declined_budget)."),
};
#define NMETRICS (sizeof metrics / sizeof metrics[0])

/* Whether m exists in s's version (a version-1 caller's struct ends before
 * the host RAM tier's fields; an unset version renders everything, as
 * before versions existed). */
static int metric_present(const metric *m, const kvt_stats *s) {
  size_t have = kvti_stats_size(s->version);
  return m->getf || m->getu || !have || m->off + sizeof(uint64_t) <= have;
}

static uint64_t metric_u64(const metric *m, const kvt_stats *s) {
  return m->getu ? m->getu(s) : *(const uint64_t *)((const char *)s + m->off);
}

int kvti_stats_add_named(kvti_stats *st, const char *name, int64_t delta) {
  if (!name)
    return KVT_ERR(KVT_EINVAL, "counter name is NULL");
  if (!strcmp(name, "reload_latency_sum")) {
    /* Seconds, as the reference's field. */
    int rc = 0;
    pthread_mutex_lock(&st->mu);
    double v = st->s.reload_latency_sum + (double)delta;
    if (v < 0)
      rc = KVT_ERR(KVT_EINVAL, "reload_latency_sum would drop below 0");
    else
      st->s.reload_latency_sum = v;
    publish(st);
    pthread_mutex_unlock(&st->mu);
    return rc;
  }
  for (size_t i = 0; i < NMETRICS; i++) {
    const metric *m = &metrics[i];
    if (!m->counter || m->getu || m->getf || strcmp(name, m->key) != 0)
      continue;
    int rc = 0;
    pthread_mutex_lock(&st->mu);
    uint64_t *f = (uint64_t *)((char *)&st->s + m->off);
    if (delta < 0 && (uint64_t)(-(delta + 1)) + 1 > *f)
      rc = KVT_ERR(KVT_EINVAL, "counter %s would drop below 0 (%llu%+lld)",
                   name, (unsigned long long)*f, (long long)delta);
    else
      *f += (uint64_t)delta; /* two's complement: adds or subtracts */
    publish(st);
    pthread_mutex_unlock(&st->mu);
    return rc;
  }
  return KVT_ERR(KVT_EINVAL, "unknown counter '%s'", name);
}

/* ------------------------------------------------------------------------ */
/* Renderings                                                               */
/* ------------------------------------------------------------------------ */

/* Python's round(x, nd): correctly rounded to nd decimals (printf rounds the
 * exact binary value the same way), read back as the nearest double. */
static double py_round(double x, int nd) {
  char b[64];
  snprintf(b, sizeof b, "%.*f", nd, x);
  return strtod(b, NULL);
}

/* Python's repr of a float: shortest digits that read back exactly, always with
 * a '.' or an exponent ("0.0", "0.1235", "1e+20" -> Python writes "1e+20" too).
 */
static void py_float(char *b, size_t cap, double x) {
  if (!isfinite(x)) {
    snprintf(b, cap, "null");
    return;
  }
  if (x == 0) {
    snprintf(b, cap, signbit(x) ? "-0.0" : "0.0");
    return;
  }
  int prec = 1;
  char e[64];
  for (; prec <= 17; prec++) {
    snprintf(e, sizeof e, "%.*e", prec - 1, x);
    if (strtod(e, NULL) == x)
      break;
  }
  int exp10 = atoi(strchr(e, 'e') + 1);
  if (exp10 >= -4 && exp10 < 16) {
    int decimals = prec - 1 - exp10;
    if (decimals < 1)
      decimals = 1;
    snprintf(b, cap, "%.*f", decimals, x);
  } else {
    snprintf(b, cap, "%s", e);
  }
}

static int add_raw(cJSON *o, const char *k, const char *raw) {
  cJSON *v = cJSON_CreateRaw(raw);
  if (!v)
    return -1;
  cJSON_AddItemToObject(o, k, v);
  return 0;
}

static int add_u64(cJSON *o, const char *k, uint64_t v) {
  char b[32];
  snprintf(b, sizeof b, "%llu", (unsigned long long)v);
  return add_raw(o, k, b);
}

static int add_f(cJSON *o, const char *k, double v) {
  char b[64];
  py_float(b, sizeof b, v);
  return add_raw(o, k, b);
}

static int copy_out(char *buf, size_t cap, size_t *needed, const char *s) {
  size_t n = strlen(s) + 1;
  if (needed)
    *needed = n;
  if (!buf || cap < n)
    return KVT_ERR(KVT_ERANGE, "buffer of %zu bytes is too small (%zu needed)",
                   cap, n);
  memcpy(buf, s, n);
  return 0;
}

int kvt_stats_to_json(char *buf, size_t cap, size_t *needed,
                      const kvt_stats *s) {
  if (!s)
    return KVT_ERR(KVT_EINVAL, "stats is NULL");
  cJSON *o = cJSON_CreateObject();
  if (!o)
    return KVT_ERR_NOMEM();
  int bad = 0;
  for (size_t i = 0; i < NMETRICS; i++) {
    const metric *m = &metrics[i];
    if (!metric_present(m, s))
      continue;
    bad |= m->getf ? add_f(o, m->key, py_round(m->getf(s), m->nd))
                   : add_u64(o, m->key, metric_u64(m, s));
  }
  char *txt = bad ? NULL : cJSON_PrintUnformatted(o);
  cJSON_Delete(o);
  if (!txt)
    return KVT_ERR_NOMEM();
  int rc = copy_out(buf, cap, needed, txt);
  cJSON_free(txt);
  return rc;
}

/* A Prometheus histogram from per-bucket counts: cumulative _bucket lines,
 * then _sum and _count. */
static void prom_hist(kvti_sb *b, const char *name, const char *help,
                      const uint64_t *h, double sum) {
  kvti_sb_printf(b, "# HELP kvtier_%s %s\n# TYPE kvtier_%s histogram\n", name,
                 help, name);
  uint64_t cum = 0;
  for (size_t i = 0; i < KVT_STATS_LATENCY_BUCKETS; i++) {
    cum += h[i];
    if (i < KVT_STATS_LATENCY_BUCKETS - 1)
      kvti_sb_printf(b, "kvtier_%s_bucket{le=\"%g\"} %llu\n", name,
                     latency_bounds[i], (unsigned long long)cum);
    else
      kvti_sb_printf(b, "kvtier_%s_bucket{le=\"+Inf\"} %llu\n", name,
                     (unsigned long long)cum);
  }
  kvti_sb_printf(b, "kvtier_%s_sum %.17g\nkvtier_%s_count %llu\n", name, sum,
                 name, (unsigned long long)cum);
}

int kvt_stats_to_prometheus(char *buf, size_t cap, size_t *needed,
                            const kvt_stats *s) {
  if (!s)
    return KVT_ERR(KVT_EINVAL, "stats is NULL");
  kvti_sb b = {0};
  for (size_t i = 0; i < NMETRICS; i++) {
    const metric *m = &metrics[i];
    if (!m->prom || !metric_present(m, s))
      continue;
    char v[64];
    if (m->getf)
      snprintf(v, sizeof v, "%.17g", m->getf(s));
    else
      snprintf(v, sizeof v, "%llu", (unsigned long long)metric_u64(m, s));
    kvti_sb_printf(
        &b, "# HELP kvtier_%s %s\n# TYPE kvtier_%s %s\nkvtier_%s %s\n", m->prom,
        m->help, m->prom, m->counter ? "counter" : "gauge", m->prom, v);
  }
  size_t have = kvti_stats_size(s->version);
  if (!have ||
      have >= offsetof(kvt_stats, spill_latency_sum) + sizeof(double)) {
    prom_hist(&b, "promote_latency_seconds",
              "Latency of successful promotes (local or remote).",
              s->promote_latency_hist, s->reload_latency_sum);
    prom_hist(&b, "spill_latency_seconds",
              "Time the writer took to store an entry locally (files, fsyncs, "
              "publication, index row).",
              s->spill_latency_hist, s->spill_latency_sum);
  }
  char *txt = kvti_sb_take(&b); /* NULL: KVT_ENOMEM set */
  if (!txt)
    return KVT_ENOMEM;
  int rc = copy_out(buf, cap, needed, txt);
  kvti_free(txt);
  return rc;
}
