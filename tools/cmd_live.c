/*
 * cmd_live.c - the live counters of `kvtier stats`: the figures the process
 * that has a cache directory open for writing publishes in DIR/stats.bin
 * (kvt_stats_read_live; layout in docs/FORMAT.md), shown next to the
 * directory's own totals, in --json and --prometheus output, and refreshed
 * every SECONDS by `--watch` (one line, JSON object or exposition per tick;
 * --count N stops after N). When no process has the directory open the output
 * says so, with the pid that last published and why it is not live.
 */
#include "cli.h"
#include "kvtier_sys.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

void cli_live_read(cli_live *l, const char *dir) {
  memset(l, 0, sizeof *l);
  l->rc = kvt_stats_read_live(&l->s, &l->lv, dir);
  if (l->rc != 0) {
    snprintf(l->err, sizeof l->err, "%s", kvt_last_error());
    kvt_clear_error();
  }
}

int cli_live_alive(const cli_live *l) {
  return l->rc == 0 && l->lv.alive;
}

const char *cli_live_describe(const cli_live *l, char *buf, size_t cap) {
  char a[32], b[32];
  double now = cli_now();
  if (cli_live_alive(l))
    snprintf(buf, cap, "live from pid %lld (opened %s ago, updated %s ago)",
             (long long)l->lv.pid,
             cli_fmt_age(a, sizeof a, now - l->lv.started_at),
             cli_fmt_age(b, sizeof b, fmax(0, now - l->lv.updated_at)));
  else if (l->rc == 0)
    snprintf(buf, cap,
             "none: no process has the directory open (pid %lld last "
             "published, %s ago; it closed or exited)",
             (long long)l->lv.pid,
             cli_fmt_age(a, sizeof a, fmax(0, now - l->lv.updated_at)));
  else if (l->rc == KVT_ENOTFOUND)
    snprintf(buf, cap,
             "none: no stats.bin (no writer has opened the "
             "directory with this kvtier)");
  else
    snprintf(buf, cap, "none: %s", l->err);
  return buf;
}

static const char *status_word(const cli_live *l) {
  return cli_live_alive(l)        ? "live"
         : l->rc == 0             ? "not_running"
         : l->rc == KVT_ENOTFOUND ? "no_stats_file"
                                  : "unreadable";
}

static cJSON *stats_json(const kvt_stats *s) {
  size_t need = 0;
  kvt_stats_to_json(NULL, 0, &need, s);
  char *buf = malloc(need ? need : 1);
  cJSON *j = NULL;
  if (buf && kvt_stats_to_json(buf, need, &need, s) == 0)
    j = cJSON_Parse(buf);
  free(buf);
  return j;
}

static cJSON *hist_json(const uint64_t *h) {
  cJSON *a = cJSON_CreateArray();
  for (int i = 0; i < KVT_STATS_LATENCY_BUCKETS; i++)
    cJSON_AddItemToArray(a, cJSON_CreateNumber((double)h[i]));
  return a;
}

void cli_live_json(cJSON *o, const cli_live *l) {
  cJSON *j = cJSON_AddObjectToObject(o, "live");
  char d[512];
  cJSON_AddStringToObject(j, "status", status_word(l));
  cJSON_AddBoolToObject(j, "alive", cli_live_alive(l));
  cJSON_AddStringToObject(j, "description", cli_live_describe(l, d, sizeof d));
  if (l->rc != 0)
    return;
  cJSON_AddNumberToObject(j, "pid", (double)l->lv.pid);
  cJSON_AddNumberToObject(j, "started_at", l->lv.started_at);
  cJSON_AddNumberToObject(j, "updated_at", l->lv.updated_at);
  static const double bounds[] = KVT_STATS_LATENCY_BOUNDS_INIT;
  cJSON *b = cJSON_AddArrayToObject(j, "latency_bucket_bounds_s");
  for (size_t i = 0; i < sizeof bounds / sizeof bounds[0]; i++)
    cJSON_AddItemToArray(b, cJSON_CreateNumber(bounds[i]));
  cJSON_AddItemToObject(j, "promote_latency_hist",
                        hist_json(l->s.promote_latency_hist));
  cJSON_AddItemToObject(j, "spill_latency_hist",
                        hist_json(l->s.spill_latency_hist));
  cJSON_AddNumberToObject(j, "spill_latency_sum_s", l->s.spill_latency_sum);
}

/* Spills refused for any reason (the spill_refused_* counters). */
static uint64_t refused_total(const kvt_stats *s) {
  return s->spill_refused_unsupported + s->spill_refused_invalid +
         s->spill_refused_too_big + s->spill_refused_queue_full +
         s->spill_refused_closed + s->spill_refused_other;
}

void cli_live_print(const cli_live *l, FILE *f) {
  char d[512], a[32], b[32];
  fprintf(f, "counters   %s\n", cli_live_describe(l, d, sizeof d));
  if (!cli_live_alive(l))
    return;
  const kvt_stats *s = &l->s;
  uint64_t lookups = s->ssd_hits + s->ssd_misses;
  fprintf(f, "  spills   %llu (%s), dropped %llu, rejected %llu, failed %llu\n",
          (unsigned long long)s->spill_count,
          cli_fmt_bytes(a, sizeof a, s->spill_bytes),
          (unsigned long long)s->spill_drops,
          (unsigned long long)s->spill_rejects,
          (unsigned long long)s->write_failures);
  fprintf(f,
          "  refused  %llu: unsupported layer %llu, invalid %llu, too big "
          "%llu, queue full %llu, closed %llu, other %llu\n",
          (unsigned long long)refused_total(s),
          (unsigned long long)s->spill_refused_unsupported,
          (unsigned long long)s->spill_refused_invalid,
          (unsigned long long)s->spill_refused_too_big,
          (unsigned long long)s->spill_refused_queue_full,
          (unsigned long long)s->spill_refused_closed,
          (unsigned long long)s->spill_refused_other);
  fprintf(f,
          "  promotes %llu hits, %llu misses (hit rate %.1f%%), %llu failed, "
          "avg %.2f ms, %s read\n",
          (unsigned long long)s->ssd_hits, (unsigned long long)s->ssd_misses,
          lookups ? 100.0 * (double)s->ssd_hits / (double)lookups : 0.0,
          (unsigned long long)s->promotion_failures,
          s->ssd_hits ? s->reload_latency_sum / (double)s->ssd_hits * 1000
                      : 0.0,
          cli_fmt_bytes(b, sizeof b, s->reload_bytes));
  fprintf(f, "  tokens   %llu requested, %llu served (%.1f%%)\n",
          (unsigned long long)s->tokens_requested,
          (unsigned long long)s->tokens_served,
          s->tokens_requested
              ? 100.0 * (double)s->tokens_served / (double)s->tokens_requested
              : 0.0);
  fprintf(f,
          "  removed  %llu evicted, %llu expired, %llu quarantined; queue "
          "%llu (%s)\n",
          (unsigned long long)s->evictions, (unsigned long long)s->expirations,
          (unsigned long long)s->quarantined,
          (unsigned long long)s->queue_depth,
          cli_fmt_bytes(a, sizeof a, s->queue_bytes));
  char c[32], e[32];
  if (s->write_budget_bytes_per_day)
    snprintf(e, sizeof e, "%s",
             cli_fmt_bytes(c, sizeof c, s->write_budget_left));
  fprintf(f, "  writes   %s today, %s in all; budget %s%s%s%s\n",
          cli_fmt_bytes(a, sizeof a, s->bytes_written_today),
          cli_fmt_bytes(b, sizeof b, s->spill_bytes),
          s->write_budget_bytes_per_day
              ? cli_fmt_bytes(d, sizeof d, s->write_budget_bytes_per_day)
              : "none",
          s->write_budget_bytes_per_day ? "/day, " : "",
          s->write_budget_bytes_per_day ? e : "",
          s->write_budget_bytes_per_day ? " left" : "");
  if (s->ssd_lifetime_years > 0)
    fprintf(f, "  ssd      %.1f years of rated writes at this rate\n",
            s->ssd_lifetime_years);
  fprintf(f,
          "  admission %llu written whole, %llu cut to their seen prefix, "
          "declined %llu first sighting, %llu budget (%llu tokens not "
          "written)\n",
          (unsigned long long)s->admission_admitted,
          (unsigned long long)s->admission_truncated,
          (unsigned long long)s->admission_declined_unseen,
          (unsigned long long)s->admission_declined_budget,
          (unsigned long long)s->admission_tokens_declined);
  if (s->admission_declined_oversize)
    fprintf(f,
            "  admission %llu of the budget's declines larger than its whole "
            "bucket: never written under this budget\n",
            (unsigned long long)s->admission_declined_oversize);
}

void cli_live_prom(const cli_live *l, FILE *f) {
  char d[512];
  fprintf(f,
          "# HELP kvtier_live 1 when the counters above are the live ones of "
          "the process that has the directory open.\n"
          "# TYPE kvtier_live gauge\nkvtier_live %d\n",
          cli_live_alive(l));
  fprintf(f, "# kvtier: counters %s\n", cli_live_describe(l, d, sizeof d));
}

void cli_live_merge(kvt_stats *s, const cli_live *l) {
  if (!cli_live_alive(l))
    return;
  /* The directory's totals stay as measured here; everything else is the
   * publisher's. */
  kvt_stats m = l->s;
  m.entries = s->entries;
  m.disk_bytes = s->disk_bytes;
  m.memory_bytes = s->memory_bytes;
  *s = m;
}

static void watch_line(const char *dir, const cli_live *l,
                       const kvt_stats *prev, int json, int prom) {
  if (json) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "dir", dir);
    cJSON_AddNumberToObject(o, "time", cli_now());
    cli_live_json(o, l);
    if (cli_live_alive(l)) {
      cJSON *c = stats_json(&l->s);
      if (c)
        cJSON_AddItemToObject(o, "counters", c);
    }
    char *txt = cJSON_PrintUnformatted(o); /* JSON lines: one per tick */
    if (txt)
      printf("%s\n", txt);
    cJSON_free(txt);
    cJSON_Delete(o);
  } else if (prom) {
    if (cli_live_alive(l)) {
      size_t need = 0;
      kvt_stats_to_prometheus(NULL, 0, &need, &l->s);
      char *buf = malloc(need ? need : 1);
      if (buf && kvt_stats_to_prometheus(buf, need, &need, &l->s) == 0)
        fputs(buf, stdout);
      free(buf);
    }
    cli_live_prom(l, stdout);
    printf("\n");
  } else {
    char t[32], d[512];
    cli_fmt_time(t, sizeof t, cli_now());
    if (!cli_live_alive(l)) {
      printf("%s  %s\n", t, cli_live_describe(l, d, sizeof d));
    } else {
      const kvt_stats *s = &l->s;
      uint64_t lookups = s->ssd_hits + s->ssd_misses;
      printf(
          "%s  pid %lld  spills %llu (+%llu) drops %llu  refused %llu  "
          "hits %llu (+%llu) "
          "misses %llu  hit %.1f%%  tokens served %llu of %llu  entries %llu  "
          "queue "
          "%llu  promote avg %.2f ms\n",
          t, (long long)l->lv.pid, (unsigned long long)s->spill_count,
          (unsigned long long)(s->spill_count - prev->spill_count),
          (unsigned long long)s->spill_drops,
          (unsigned long long)refused_total(s), (unsigned long long)s->ssd_hits,
          (unsigned long long)(s->ssd_hits - prev->ssd_hits),
          (unsigned long long)s->ssd_misses,
          lookups ? 100.0 * (double)s->ssd_hits / (double)lookups : 0.0,
          (unsigned long long)s->tokens_served,
          (unsigned long long)s->tokens_requested,
          (unsigned long long)s->entries, (unsigned long long)s->queue_depth,
          s->ssd_hits ? s->reload_latency_sum / (double)s->ssd_hits * 1000
                      : 0.0);
    }
  }
  fflush(stdout);
}

int cli_live_watch(const char *dir, double interval, uint64_t count, int json,
                   int prom) {
  struct stat st;
  if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode))
    return cli_fail(json, "stats", CLI_NOOPEN, "%s: %s", dir,
                    stat(dir, &st) != 0 ? strerror(errno) : "not a directory");
  kvt_stats prev;
  memset(&prev, 0, sizeof prev);
  int64_t prev_pid = -1;
  for (uint64_t i = 0; count == 0 || i < count; i++) {
    if (i > 0) {
      struct timespec ts;
      ts.tv_sec = (time_t)interval;
      ts.tv_nsec = (long)((interval - (double)ts.tv_sec) * 1e9);
      while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
      }
    }
    cli_live l;
    cli_live_read(&l, dir);
    if (l.lv.pid != prev_pid) /* a new publisher: deltas from zero */
      memset(&prev, 0, sizeof prev);
    watch_line(dir, &l, &prev, json, prom);
    if (cli_live_alive(&l)) {
      prev = l.s;
      prev_pid = l.lv.pid;
    }
  }
  return CLI_OK;
}
