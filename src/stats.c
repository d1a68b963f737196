/*
 * stats.c - the tier's counters (see stats.h), kvt_tier_stats /
 * kvt_tier_stats_add, and two renderings of a kvt_stats: JSON with exactly the
 * reference's SSDCacheStats.to_dict keys and rounding (ssd_hit_rate to 4
 * places, reload_latency_sum_s to 4, avg_reload_latency_ms to 2; Python's
 * round() is correctly rounded, as printf's %.Nf is) plus kvtier's counters and
 * gauges, and the Prometheus text exposition format (HELP/TYPE lines, kvtier_*
 * names, counters end in _total). Integers are printed exactly (never through a
 * double); floats like Python's repr.
 */
#include "stats.h"
#include "error.h"
#include "index.h"
#include "io.h"
#include "remote.h"
#include "tier.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void kvti_stats_init(kvti_stats *st) {
  pthread_mutex_init(&st->mu, NULL);
  memset(&st->s, 0, sizeof st->s);
}

void kvti_stats_destroy(kvti_stats *st) {
  pthread_mutex_destroy(&st->mu);
}

void kvti_stats_add_at(kvti_stats *st, size_t offset, uint64_t v) {
  pthread_mutex_lock(&st->mu);
  uint64_t *f = (uint64_t *)((char *)&st->s + offset);
  *f += v;
  pthread_mutex_unlock(&st->mu);
}

void kvti_stats_hit(kvti_stats *st, double latency_s, uint64_t bytes) {
  pthread_mutex_lock(&st->mu);
  st->s.ssd_hits++;
  st->s.reload_latency_sum += latency_s;
  st->s.reload_bytes += bytes;
  pthread_mutex_unlock(&st->mu);
}

void kvti_stats_copy(kvt_stats *out, kvti_stats *st) {
  pthread_mutex_lock(&st->mu);
  *out = st->s;
  pthread_mutex_unlock(&st->mu);
}

/* The counters kvt_tier_stats_add accepts: the reference's names and kvtier's.
 * Gauges (entries, bytes, queue) are measured, not counted, and cannot be
 * adjusted. */
static const struct {
  const char *name;
  size_t off;
} counters[] = {
    {"spill_count", offsetof(kvt_stats, spill_count)},
    {"spill_bytes", offsetof(kvt_stats, spill_bytes)},
    {"ssd_hits", offsetof(kvt_stats, ssd_hits)},
    {"ssd_misses", offsetof(kvt_stats, ssd_misses)},
    {"reload_bytes", offsetof(kvt_stats, reload_bytes)},
    {"promotion_failures", offsetof(kvt_stats, promotion_failures)},
    {"spill_drops", offsetof(kvt_stats, spill_drops)},
    {"spill_rejects", offsetof(kvt_stats, spill_rejects)},
    {"write_failures", offsetof(kvt_stats, write_failures)},
    {"evictions", offsetof(kvt_stats, evictions)},
    {"expirations", offsetof(kvt_stats, expirations)},
    {"quarantined", offsetof(kvt_stats, quarantined)},
    {"reconciled", offsetof(kvt_stats, reconciled)},
    {"promotions_cancelled", offsetof(kvt_stats, promotions_cancelled)},
    /* The remote tier's. */
    {"remote_hits", offsetof(kvt_stats, remote_hits)},
    {"remote_misses", offsetof(kvt_stats, remote_misses)},
    {"remote_read_bytes", offsetof(kvt_stats, remote_read_bytes)},
    {"remote_spill_count", offsetof(kvt_stats, remote_spill_count)},
    {"remote_spill_bytes", offsetof(kvt_stats, remote_spill_bytes)},
    {"remote_spill_drops", offsetof(kvt_stats, remote_spill_drops)},
    {"remote_errors", offsetof(kvt_stats, remote_errors)},
};

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
    pthread_mutex_unlock(&st->mu);
    return rc;
  }
  for (size_t i = 0; i < sizeof counters / sizeof counters[0]; i++) {
    if (strcmp(name, counters[i].name) != 0)
      continue;
    int rc = 0;
    pthread_mutex_lock(&st->mu);
    uint64_t *f = (uint64_t *)((char *)&st->s + counters[i].off);
    if (delta < 0 && (uint64_t)(-(delta + 1)) + 1 > *f)
      rc = KVT_ERR(KVT_EINVAL, "counter %s would drop below 0 (%llu%+lld)",
                   name, (unsigned long long)*f, (long long)delta);
    else
      *f += (uint64_t)delta; /* two's complement: adds or subtracts */
    pthread_mutex_unlock(&st->mu);
    return rc;
  }
  return KVT_ERR(KVT_EINVAL, "unknown counter '%s'", name);
}

int kvt_tier_stats(kvt_stats *out, kvt_tier *t) {
  if (!out || !t)
    return KVT_ERR(KVT_EINVAL, "kvt_tier_stats: NULL argument");
  kvt_stats s;
  kvti_stats_copy(&s, &t->stats);
  /* Gauges: from the index while it is open (after close the last counters
   * remain). */
  if (kvti_tier_enter(t) == 0) {
    kvti_index_totals(t->idx, &s.entries, &s.disk_bytes, &s.memory_bytes);
    kvti_tier_leave(t);
  } else {
    kvt_clear_error();
  }
  pthread_mutex_lock(&t->w.mu);
  s.queue_depth = t->w.depth;
  s.queue_bytes = t->w.bytes;
  pthread_mutex_unlock(&t->w.mu);
  kvti_remote_gauges(t, &s);
  *out = s;
  return 0;
}

int kvt_tier_stats_add(kvt_tier *t, const char *counter, int64_t delta) {
  if (!t)
    return KVT_ERR(KVT_EINVAL, "tier is NULL");
  return kvti_stats_add_named(&t->stats, counter, delta);
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

static void derived(const kvt_stats *s, double *hit_rate, double *avg_ms) {
  uint64_t total = s->ssd_hits + s->ssd_misses;
  *hit_rate = total > 0 ? (double)s->ssd_hits / (double)total : 0.0;
  *avg_ms = s->ssd_hits > 0 ? s->reload_latency_sum / (double)s->ssd_hits * 1000
                            : 0.0;
}

int kvt_stats_to_json(char *buf, size_t cap, size_t *needed,
                      const kvt_stats *s) {
  if (!s)
    return KVT_ERR(KVT_EINVAL, "stats is NULL");
  double hit_rate, avg_ms;
  derived(s, &hit_rate, &avg_ms);
  cJSON *o = cJSON_CreateObject();
  if (!o)
    return KVT_ERR_NOMEM();
  int bad = 0;
  /* The reference's to_dict, same keys, order and rounding. */
  bad |= add_u64(o, "spill_count", s->spill_count);
  bad |= add_u64(o, "spill_bytes", s->spill_bytes);
  bad |= add_u64(o, "ssd_hits", s->ssd_hits);
  bad |= add_u64(o, "ssd_misses", s->ssd_misses);
  bad |= add_f(o, "ssd_hit_rate", py_round(hit_rate, 4));
  bad |= add_f(o, "reload_latency_sum_s", py_round(s->reload_latency_sum, 4));
  bad |= add_f(o, "avg_reload_latency_ms", py_round(avg_ms, 2));
  bad |= add_u64(o, "reload_bytes", s->reload_bytes);
  bad |= add_u64(o, "promotion_failures", s->promotion_failures);
  /* kvtier's. */
  bad |= add_u64(o, "spill_drops", s->spill_drops);
  bad |= add_u64(o, "spill_rejects", s->spill_rejects);
  bad |= add_u64(o, "write_failures", s->write_failures);
  bad |= add_u64(o, "evictions", s->evictions);
  bad |= add_u64(o, "expirations", s->expirations);
  bad |= add_u64(o, "quarantined", s->quarantined);
  bad |= add_u64(o, "reconciled", s->reconciled);
  bad |= add_u64(o, "promotions_cancelled", s->promotions_cancelled);
  bad |= add_u64(o, "entries", s->entries);
  bad |= add_u64(o, "disk_bytes", s->disk_bytes);
  bad |= add_u64(o, "memory_bytes", s->memory_bytes);
  bad |= add_u64(o, "queue_depth", s->queue_depth);
  bad |= add_u64(o, "queue_bytes", s->queue_bytes);
  /* Per tier: local and remote. */
  uint64_t local_hits =
      s->ssd_hits > s->remote_hits ? s->ssd_hits - s->remote_hits : 0;
  bad |= add_u64(o, "local_hits", local_hits);
  bad |= add_u64(o, "remote_hits", s->remote_hits);
  bad |= add_u64(o, "remote_misses", s->remote_misses);
  bad |= add_u64(o, "remote_read_bytes", s->remote_read_bytes);
  bad |= add_f(o, "remote_latency_sum_s", py_round(s->remote_latency_sum, 4));
  bad |= add_f(o, "avg_remote_latency_ms",
               py_round(s->remote_hits > 0 ? s->remote_latency_sum /
                                                 (double)s->remote_hits * 1000
                                           : 0.0,
                        2));
  bad |= add_u64(o, "remote_spill_count", s->remote_spill_count);
  bad |= add_u64(o, "remote_spill_bytes", s->remote_spill_bytes);
  bad |= add_u64(o, "remote_spill_drops", s->remote_spill_drops);
  bad |= add_u64(o, "remote_errors", s->remote_errors);
  bad |= add_u64(o, "remote_queue_depth", s->remote_queue_depth);
  bad |= add_u64(o, "remote_available", s->remote_available);
  char *txt = bad ? NULL : cJSON_PrintUnformatted(o);
  cJSON_Delete(o);
  if (!txt)
    return KVT_ERR_NOMEM();
  int rc = copy_out(buf, cap, needed, txt);
  cJSON_free(txt);
  return rc;
}

/* A growing text buffer for the Prometheus rendering. */
typedef struct sbuf {
  char *p;
  size_t n, cap;
  int oom;
} sbuf;

static void sb_printf(sbuf *b, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

#include <stdarg.h>
static void sb_printf(sbuf *b, const char *fmt, ...) {
  if (b->oom)
    return;
  for (;;) {
    va_list ap;
    va_start(ap, fmt);
    int w =
        vsnprintf(b->p ? b->p + b->n : NULL, b->p ? b->cap - b->n : 0, fmt, ap);
    va_end(ap);
    if (w < 0) {
      b->oom = 1;
      return;
    }
    if (b->p && b->n + (size_t)w < b->cap) {
      b->n += (size_t)w;
      return;
    }
    size_t nc = (b->cap ? b->cap * 2 : 2048) + (size_t)w;
    char *np = kvti_realloc(b->p, nc);
    if (!np) {
      b->oom = 1;
      return;
    }
    b->p = np;
    b->cap = nc;
  }
}

static void prom_u64(sbuf *b, const char *name, const char *type,
                     const char *help, uint64_t v) {
  sb_printf(b, "# HELP kvtier_%s %s\n# TYPE kvtier_%s %s\nkvtier_%s %llu\n",
            name, help, name, type, name, (unsigned long long)v);
}

static void prom_f(sbuf *b, const char *name, const char *type,
                   const char *help, double v) {
  char f[64];
  snprintf(f, sizeof f, "%.17g", v);
  sb_printf(b, "# HELP kvtier_%s %s\n# TYPE kvtier_%s %s\nkvtier_%s %s\n", name,
            help, name, type, name, f);
}

int kvt_stats_to_prometheus(char *buf, size_t cap, size_t *needed,
                            const kvt_stats *s) {
  if (!s)
    return KVT_ERR(KVT_EINVAL, "stats is NULL");
  double hit_rate, avg_ms;
  derived(s, &hit_rate, &avg_ms);
  sbuf b = {0};
  const char *C = "counter", *G = "gauge";
  prom_u64(&b, "spill_count_total", C, "Entries spilled to SSD.",
           s->spill_count);
  prom_u64(&b, "spill_bytes_total", C, "Bytes written to SSD.", s->spill_bytes);
  prom_u64(&b, "ssd_hits_total", C, "Successful promotes from SSD.",
           s->ssd_hits);
  prom_u64(&b, "ssd_misses_total", C, "Promotes that found no entry.",
           s->ssd_misses);
  prom_f(&b, "ssd_hit_rate", G, "ssd_hits / (ssd_hits + ssd_misses).",
         hit_rate);
  prom_f(&b, "reload_latency_seconds_total", C,
         "Sum of promote latencies in seconds.", s->reload_latency_sum);
  prom_f(&b, "avg_reload_latency_ms", G, "Mean promote latency in ms.", avg_ms);
  prom_u64(&b, "reload_bytes_total", C, "Bytes read from SSD by promotes.",
           s->reload_bytes);
  prom_u64(&b, "promotion_failures_total", C,
           "Promotes refused by the budget or failed to read.",
           s->promotion_failures);
  prom_u64(&b, "spill_drops_total", C, "Spills dropped: queue full.",
           s->spill_drops);
  prom_u64(&b, "spill_rejects_total", C, "Spills refused: too big or invalid.",
           s->spill_rejects);
  prom_u64(&b, "write_failures_total", C, "Spills that failed to write.",
           s->write_failures);
  prom_u64(&b, "evictions_total", C, "Entries evicted for capacity (LRU).",
           s->evictions);
  prom_u64(&b, "expirations_total", C, "Entries removed by retention.",
           s->expirations);
  prom_u64(&b, "quarantined_total", C, "Corrupt entries quarantined.",
           s->quarantined);
  prom_u64(&b, "reconciled_total", C,
           "Rows or directories cleaned by reconcile.", s->reconciled);
  prom_u64(&b, "promotions_cancelled_total", C, "Async promotes cancelled.",
           s->promotions_cancelled);
  prom_u64(&b, "entries", G, "Entries stored.", s->entries);
  prom_u64(&b, "disk_bytes", G, "Bytes of stored entries on disk.",
           s->disk_bytes);
  prom_u64(&b, "memory_bytes", G, "Sum of stored entries' RAM estimates.",
           s->memory_bytes);
  prom_u64(&b, "queue_depth", G, "Spills waiting in the queue.",
           s->queue_depth);
  prom_u64(&b, "queue_bytes", G, "Bytes held by queued spills.",
           s->queue_bytes);
  prom_u64(&b, "local_hits_total", C, "Promotes served from the local SSD.",
           s->ssd_hits > s->remote_hits ? s->ssd_hits - s->remote_hits : 0);
  prom_u64(&b, "remote_hits_total", C, "Promotes served from the remote store.",
           s->remote_hits);
  prom_u64(&b, "remote_misses_total", C,
           "Remote lookups that found nothing usable.", s->remote_misses);
  prom_u64(&b, "remote_read_bytes_total", C, "Bytes fetched from the remote.",
           s->remote_read_bytes);
  prom_f(&b, "remote_latency_seconds_total", C,
         "Sum of remote fetch latencies in seconds.", s->remote_latency_sum);
  prom_u64(&b, "remote_spill_count_total", C, "Entries uploaded to the remote.",
           s->remote_spill_count);
  prom_u64(&b, "remote_spill_bytes_total", C, "Bytes uploaded to the remote.",
           s->remote_spill_bytes);
  prom_u64(&b, "remote_spill_drops_total", C,
           "Uploads dropped: queue full or remote unavailable.",
           s->remote_spill_drops);
  prom_u64(&b, "remote_errors_total", C, "Failed remote operations.",
           s->remote_errors);
  prom_u64(&b, "remote_queue_depth", G, "Uploads waiting.",
           s->remote_queue_depth);
  prom_u64(&b, "remote_available", G,
           "1 when the remote is configured and not backing off.",
           s->remote_available);
  if (b.oom) {
    kvti_free(b.p);
    return KVT_ERR_NOMEM();
  }
  int rc = copy_out(buf, cap, needed, b.p ? b.p : "");
  kvti_free(b.p);
  return rc;
}
