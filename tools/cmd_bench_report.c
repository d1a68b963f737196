/*
 * cmd_bench_report.c - the report of `kvtier bench`: turns a finished
 * bench_run (cmd_bench.c) into the figures both reports print, then renders
 * them either as one JSON document (--json, cJSON) or as text (workload, disk
 * limits, a table of measures against the hardware limits, and the
 * size/cold/verification summary). Rendering only: nothing here runs I/O
 * against the cache.
 */
#define _GNU_SOURCE
#include "cmd_bench.h"

#include <stdio.h>

static cJSON *phase_json(const phase *p, double limit, const char *limit_name,
                         int ms, unsigned flags) {
  cJSON *o = cJSON_CreateObject();
  cJSON_AddNumberToObject(o, "count", (double)p->count);
  cJSON_AddNumberToObject(o, "bytes", (double)p->bytes);
  cJSON_AddNumberToObject(o, "seconds", p->seconds);
  double bps = p->seconds > 0 ? (double)p->bytes / p->seconds : 0;
  if (p->bytes)
    cJSON_AddNumberToObject(o, "bytes_per_second", bps);
  cJSON_AddNumberToObject(o, ms ? "p50_ms" : "p50_us",
                          ms ? p->p50 * 1e3 : p->p50 * 1e6);
  cJSON_AddNumberToObject(o, ms ? "p99_ms" : "p99_us",
                          ms ? p->p99 * 1e3 : p->p99 * 1e6);
  if (limit > 0 && p->bytes) {
    cJSON_AddNumberToObject(o, "ratio", bps / limit);
    cJSON_AddStringToObject(o, "ratio_of", limit_name);
  }
  if (limit_name) { /* a figure judged against a physical limit */
    cJSON_AddBoolToObject(o, "flagged", flags != 0);
    if (flags)
      cJSON_AddStringToObject(o, "flag", bu_figure_flag_text(flags));
  }
  return o;
}

/* One row of the text report: NAME, VALUE, the phase's p50 and p99 (in ms,
 * or in us when !ms; "-" without a phase) and the comparison VS. */
static void report_row(cli_table *tb, const char *name, const char *value,
                       const phase *p, int ms, const char *vs) {
  char p50[48] = "-", p99[48] = "-";
  if (p && ms) {
    snprintf(p50, sizeof p50, "%.2f ms", p->p50 * 1e3);
    snprintf(p99, sizeof p99, "%.2f ms", p->p99 * 1e3);
  } else if (p) {
    snprintf(p50, sizeof p50, "%.1f us", p->p50 * 1e6);
    snprintf(p99, sizeof p99, "%.1f us", p->p99 * 1e6);
  }
  const char *row[5] = {name, value, p50, p99, vs};
  cli_table_add(tb, row);
}

void bench_figures(bench_figs *g, const bench_run *r) {
  const bench_cfg *c = &r->c;
  g->bps_spill = r->spill.seconds > 0 ? r->spill.bytes / r->spill.seconds : 0;
  g->bps_e2e =
      r->spill_e2e.seconds > 0 ? r->spill_e2e.bytes / r->spill_e2e.seconds : 0;
  g->bps_warm = r->warm.seconds > 0 ? r->warm.bytes / r->warm.seconds : 0;
  g->bps_cold = r->cold.seconds > 0 ? r->cold.bytes / r->cold.seconds : 0;
  g->bps_prod =
      r->producer.seconds > 0 ? r->producer.bytes / r->producer.seconds : 0;
  g->mem_total = r->w.lay.bytes * (uint64_t)c->entries;
  g->resident = bu_resident_after(&r->cold_res);
  g->resident_before =
      r->cold_res.pages ? (double)r->cold_res.before / (double)r->cold_res.pages
                        : 0;
  g->ratios = r->disk.ok;
  /* Each figure against the limit it is printed with (none without the
   * disk measured; the cold one is also judged by what stayed cached). */
  double wd = g->ratios ? r->disk.write_direct : 0;
  g->flag_spill = bu_figure_flags(g->bps_spill, wd, -1);
  g->flag_e2e = bu_figure_flags(g->bps_e2e, wd, -1);
  g->flag_warm =
      bu_figure_flags(g->bps_warm, g->ratios ? r->disk.read_buffered : 0, -1);
  g->flag_cold = bu_figure_flags(
      g->bps_cold, g->ratios ? r->disk.read_direct : 0, g->resident);
  g->dur = c->durability == KVT_DURABILITY_FSYNC ? "fsync" : "none";
  g->cold_method = c->drop_caches ? "drop_caches" : "fsync + fadvise(DONTNEED)";
}

/* Step 8a: the report as one JSON document on stdout. */
void bench_report_json(const bench_run *r, const bench_figs *g) {
  cJSON *jo = cJSON_CreateObject();
  cJSON_AddStringToObject(jo, "version", kvt_version());
  cJSON *wl = cJSON_AddObjectToObject(jo, "workload");
  cJSON_AddStringToObject(wl, "preset", r->c.preset);
  cJSON_AddNumberToObject(wl, "entries", r->c.entries);
  cJSON_AddNumberToObject(wl, "tokens", r->c.tokens);
  cJSON_AddNumberToObject(wl, "layers", r->w.lay.n_layers);
  cJSON *lk = cJSON_AddObjectToObject(wl, "layer_kinds");
  for (int k = 1; k <= 4; k++)
    if (r->w.lay.kinds[k])
      cJSON_AddNumberToObject(lk, cli_kind_name(k), r->w.lay.kinds[k]);
  cJSON_AddStringToObject(wl, "dtype", kvt_dtype_name(r->c.dtype));
  cJSON_AddStringToObject(wl, "storage", r->c.storage ? "compat" : "native");
  cJSON_AddStringToObject(wl, "durability", g->dur);
  cJSON_AddNumberToObject(wl, "seed", (double)r->c.seed);
  cJSON_AddNumberToObject(wl, "entry_memory_bytes", (double)r->w.lay.bytes);
  cJSON_AddNumberToObject(wl, "total_memory_bytes", (double)g->mem_total);
  cJSON_AddStringToObject(wl, "dir", r->dir);
  cJSON_AddStringToObject(wl, "filesystem", r->fsname);
  if (r->disk.ok) {
    cJSON *dj = cJSON_AddObjectToObject(jo, "disk");
    cJSON_AddStringToObject(dj, "tool", r->disk.tool);
    cJSON_AddStringToObject(dj, "engine", r->disk.engine);
    cJSON_AddNumberToObject(dj, "iodepth", r->disk.iodepth);
    cJSON_AddNumberToObject(dj, "size_bytes", (double)r->disk.size);
    cJSON_AddNumberToObject(dj, "block_bytes", r->disk.block);
    cJSON_AddNumberToObject(dj, "write_direct_bps", r->disk.write_direct);
    cJSON_AddNumberToObject(dj, "read_direct_bps", r->disk.read_direct);
    cJSON_AddNumberToObject(dj, "read_buffered_bps", r->disk.read_buffered);
    if (r->disk.note[0])
      cJSON_AddStringToObject(dj, "note", r->disk.note);
  } else {
    cJSON_AddNullToObject(jo, "disk");
    if (r->disk.note[0])
      cJSON_AddStringToObject(jo, "disk_note", r->disk.note);
  }
  cJSON *sp = phase_json(&r->spill, g->ratios ? r->disk.write_direct : 0,
                         "disk write O_DIRECT", 1, g->flag_spill);
  cJSON_AddBoolToObject(sp, "durable", r->c.durability == KVT_DURABILITY_FSYNC);
  cJSON_AddStringToObject(sp, "measured", "writer busy time");
  cJSON_AddItemToObject(jo, "spill", sp);
  cJSON *se = phase_json(&r->spill_e2e, g->ratios ? r->disk.write_direct : 0,
                         "disk write O_DIRECT", 1, g->flag_e2e);
  cJSON_DeleteItemFromObject(se, "p50_ms");
  cJSON_DeleteItemFromObject(se, "p99_ms");
  cJSON_AddItemToObject(jo, "spill_end_to_end", se);
  cJSON *pj = phase_json(&r->producer, 0, NULL, 1, 0);
  cJSON_AddItemToObject(jo, "spill_producer", pj);
  cJSON_AddItemToObject(jo, "promote_warm",
                        phase_json(&r->warm,
                                   g->ratios ? r->disk.read_buffered : 0,
                                   "cached read", 1, g->flag_warm));
  cJSON *cj = phase_json(&r->cold, g->ratios ? r->disk.read_direct : 0,
                         "disk read O_DIRECT", 1, g->flag_cold);
  cJSON_AddStringToObject(cj, "eviction", g->cold_method);
  cJSON_AddNumberToObject(cj, "resident_fraction_after_eviction", g->resident);
  cJSON *pc = cJSON_AddObjectToObject(cj, "page_cache");
  cJSON_AddNumberToObject(pc, "files", (double)r->cold_res.files);
  cJSON_AddNumberToObject(pc, "pages", (double)r->cold_res.pages);
  cJSON_AddNumberToObject(pc, "resident_before_eviction", g->resident_before);
  cJSON_AddNumberToObject(pc, "resident_at_read", g->resident);
  cJSON_AddNumberToObject(pc, "resident_max", BU_COLD_RESIDENT_MAX);
  cJSON_AddItemToObject(jo, "promote_cold", cj);
  cJSON_AddItemToObject(jo, "lookup_exact",
                        phase_json(&r->lookup[0], 0, NULL, 0, 0));
  cJSON_AddItemToObject(jo, "lookup_prefix",
                        phase_json(&r->lookup[1], 0, NULL, 0, 0));
  cJSON_AddNumberToObject(jo, "disk_bytes", (double)r->st.disk_bytes);
  cJSON_AddNumberToObject(jo, "memory_bytes", (double)g->mem_total);
  cJSON_AddNumberToObject(jo, "disk_to_memory",
                          g->mem_total ? (double)r->st.disk_bytes / g->mem_total
                                       : 0);
  cJSON *vj = cJSON_AddObjectToObject(jo, "verified");
  cJSON_AddNumberToObject(vj, "exact_tensors", (double)r->vc.exact);
  cJSON_AddNumberToObject(vj, "converted_tensors", (double)r->vc.skipped);
  cJSON_AddNumberToObject(vj, "mismatched_tensors", (double)r->vc.mismatched);
  cJSON_AddBoolToObject(jo, "kept", r->c.keep);
  cli_json_print(jo);
}

/* Step 8b: the report as text: workload, disk limits, the table of measures
 * against the hardware, and the size/cold/verification summary. */
void bench_report_text(const bench_run *r, const bench_figs *g) {
  char a[32], b[32], r1[32];
  printf("kvtier bench %s: preset %s, %u layers (", kvt_version(), r->c.preset,
         r->w.lay.n_layers);
  int first = 1;
  for (int k = 1; k <= 4; k++)
    if (r->w.lay.kinds[k]) {
      printf("%s%s %u", first ? "" : ", ", cli_kind_name(k), r->w.lay.kinds[k]);
      first = 0;
    }
  printf("), %s\n", kvt_dtype_name(r->c.dtype));
  printf("  %d entries x %d tokens, %s each in memory, %s total; seed "
         "%llu\n",
         r->c.entries, r->c.tokens, cli_fmt_bytes(a, sizeof a, r->w.lay.bytes),
         cli_fmt_bytes(b, sizeof b, g->mem_total),
         (unsigned long long)r->c.seed);
  printf("  dir %s (%s), storage %s, durability %s\n\n", r->dir, r->fsname,
         r->c.storage ? "compat" : "native", g->dur);
  if (r->disk.ok) {
    printf("disk (%s, %s, %s per job, 1 MiB blocks, iodepth %d)\n",
           r->disk.tool, r->disk.engine,
           cli_fmt_bytes(a, sizeof a, r->disk.size), r->disk.iodepth);
    printf("  sequential write O_DIRECT   %12s\n",
           cli_fmt_rate(r1, sizeof r1, r->disk.write_direct));
    printf("  sequential read  O_DIRECT   %12s\n",
           cli_fmt_rate(r1, sizeof r1, r->disk.read_direct));
    printf("  sequential read  cached     %12s   (buffered, page cache hot)\n",
           cli_fmt_rate(r1, sizeof r1, r->disk.read_buffered));
    if (r->disk.note[0])
      printf("  note: %s\n", r->disk.note);
  } else if (r->c.no_disk) {
    printf("disk: not measured (--no-disk): no ratios\n");
  } else {
    printf("disk: not measured (%s): no ratios\n", r->disk.note);
  }
  printf("\n");
  static const char *heads[] = {"MEASURE", "VALUE", "p50", "p99",
                                "VS HARDWARE"};
  cli_table tb;
  cli_table_init(&tb, 5, heads, "lrrrl");
  char v1[48], v4[192];
  /* The ratio to the limit, and the flag of a figure that cannot be the
   * disk's (bu_figure_flags) right beside it. */
#define RATIO(x, lim, name, flags)                                             \
  (g->ratios ? (snprintf(v4, sizeof v4, "%.2f x %s%s%s", (x) / (lim), name,    \
                         (flags) ? "  " : "", bu_figure_flag_text(flags)),     \
                v4)                                                            \
   : (flags) ? bu_figure_flag_text(flags)                                      \
             : "-")
  report_row(&tb,
             r->c.durability == KVT_DURABILITY_FSYNC
                 ? "spill (durable, writer)"
                 : "spill (no fsync, writer)",
             cli_fmt_rate(v1, sizeof v1, g->bps_spill), &r->spill, 1,
             RATIO(g->bps_spill, r->disk.write_direct, "disk write O_DIRECT",
                   g->flag_spill));
  report_row(&tb, "  end to end (spill .. flush)",
             cli_fmt_rate(v1, sizeof v1, g->bps_e2e), NULL, 1,
             RATIO(g->bps_e2e, r->disk.write_direct, "disk write O_DIRECT",
                   g->flag_e2e));
  report_row(&tb, "  producer (caller thread)",
             cli_fmt_rate(v1, sizeof v1, g->bps_prod), &r->producer, 1,
             "copy of the layers on spill");
  report_row(
      &tb, "promote warm", cli_fmt_rate(v1, sizeof v1, g->bps_warm), &r->warm,
      1,
      RATIO(g->bps_warm, r->disk.read_buffered, "cached read", g->flag_warm));
  report_row(&tb, "promote cold", cli_fmt_rate(v1, sizeof v1, g->bps_cold),
             &r->cold, 1,
             RATIO(g->bps_cold, r->disk.read_direct, "disk read O_DIRECT",
                   g->flag_cold));
  snprintf(v1, sizeof v1, "%zu", r->nlook);
  report_row(&tb, "lookup exact", v1, &r->lookup[0], 0, "-");
  report_row(&tb, "lookup prefix", v1, &r->lookup[1], 0, "-");
#undef RATIO
  cli_table_print(&tb, stdout);
  cli_table_free(&tb);
  printf("\n");
  printf("bytes on disk   %s for %s in memory (%.3f x)\n",
         cli_fmt_bytes(a, sizeof a, r->st.disk_bytes),
         cli_fmt_bytes(b, sizeof b, g->mem_total),
         g->mem_total ? (double)r->st.disk_bytes / g->mem_total : 0.0);
  printf("cold reload     %d tokens in %.1f ms p50 (%.1f us/token); "
         "page cache over the %llu files it read (entry and chunk files): "
         "%.1f%% resident before eviction, %.2f%% at the read (%s)\n",
         r->c.tokens, r->cold.p50 * 1e3, r->cold.p50 * 1e6 / r->c.tokens,
         (unsigned long long)r->cold_res.files, g->resident_before * 100,
         g->resident * 100, g->cold_method);
  if (g->flag_spill | g->flag_e2e | g->flag_warm | g->flag_cold)
    printf("flagged         a figure marked NOT MEASURED is above the limit "
           "measured for it in this run (NOT THE DISK: its files were "
           "cached): it does not measure what its limit measures\n");
  printf("promotes        %llu warm, %llu cold; every promoted tensor "
         "compared: %llu exact, %llu converted by the storage mode, "
         "%llu wrong\n",
         (unsigned long long)r->warm.count, (unsigned long long)r->cold.count,
         (unsigned long long)r->vc.exact, (unsigned long long)r->vc.skipped,
         (unsigned long long)r->vc.mismatched);
  if (r->c.keep)
    printf("kept            %s\n", r->dir);
}
