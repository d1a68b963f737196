/*
 * cmd_inspect.c - the read-only inspection commands of the kvtier tool:
 * `ls` (one row per entry), `stats` (totals, capacity picture, Prometheus
 * text) and `show` (one entry's manifest, layers and tensors). All three open
 * the cache with KVT_OPEN_READONLY | KVT_OPEN_NO_RECONCILE: they never start a
 * writer and never change a byte in the directory. Layer kinds, dtypes and
 * the storage mode come from kvt_tier_describe (manifest and safetensors
 * headers only, no tensor data).
 */
#define _GNU_SOURCE
#include "cli.h"

#include <stdlib.h>
#include <string.h>
#include <sys/statvfs.h>

#define RO_FLAGS (KVT_OPEN_READONLY | KVT_OPEN_NO_RECONCILE)

static void add_info_json(cJSON *o, const kvt_entry_info *e) {
  char t[64];
  cJSON_AddStringToObject(o, "token_hash", e->token_hash);
  cJSON_AddStringToObject(o, "prefix_hash", e->prefix_hash);
  cJSON_AddNumberToObject(o, "num_tokens", (double)e->num_tokens);
  cJSON_AddNumberToObject(o, "disk_bytes", (double)e->disk_bytes);
  cJSON_AddNumberToObject(o, "memory_bytes", (double)e->memory_bytes);
  cJSON_AddNumberToObject(o, "created_at", e->created_at);
  cJSON_AddStringToObject(o, "created",
                          cli_fmt_iso(t, sizeof t, e->created_at));
  cJSON_AddNumberToObject(o, "accessed_at", e->accessed_at);
  cJSON_AddStringToObject(o, "accessed",
                          cli_fmt_iso(t, sizeof t, e->accessed_at));
}

static void add_desc_json(cJSON *o, const cli_desc *d) {
  cJSON_AddStringToObject(o, "storage_mode", d->storage);
  cJSON_AddNumberToObject(o, "num_layers", d->layers);
  cJSON *k = cJSON_AddObjectToObject(o, "layer_kinds");
  for (int i = 1; i <= 4; i++)
    if (d->kind_count[i])
      cJSON_AddNumberToObject(k, cli_kind_name(i), d->kind_count[i]);
  if (d->kind_count[0])
    cJSON_AddNumberToObject(k, "unknown", d->kind_count[0]);
  cJSON *dt = cJSON_AddArrayToObject(o, "dtypes");
  char tmp[64];
  snprintf(tmp, sizeof tmp, "%s", d->dtypes);
  for (char *sv = NULL, *p = strtok_r(tmp, ",", &sv); p;
       p = strtok_r(NULL, ",", &sv))
    if (strcmp(p, "?") != 0)
      cJSON_AddItemToArray(dt, cJSON_CreateString(p));
  if (!d->ok)
    cJSON_AddStringToObject(o, "error", d->error);
}

/* ---- ls ----------------------------------------------------------------- */

static const char *LS_HELP =
    "usage: kvtier ls DIR|--remote URL [--sort KEY] [--reverse] [--limit N] "
    "[--full]\n"
    "                     [--no-describe] [--json]\n"
    "\n"
    "Lists the entries of a cache directory (opened read-only).\n"
    "\n"
    "  --sort KEY      accessed (default: most recent first), created (newest\n"
    "                  first), size (bytes on disk, largest first), memory,\n"
    "                  tokens (most first), hash (ascending)\n"
    "  --reverse       reverse the order\n"
    "  --limit N       show at most N entries\n"
    "  --full          print full 64-digit hashes (the table shows 16)\n"
    "  --no-describe   skip reading manifests (no layers/kinds/dtypes/mode)\n"
    "                  and chains (no CHAIN/SHARED); fast on very large "
    "caches\n"
    "  --json          JSON output: {dir, total, count, entries: "
    "[...]}\n" CLI_REMOTE_HELP "\n"
    "Columns: HASH, TOKENS, LAYERS, KINDS (kv, rotating, arrays, quant with\n"
    "layer counts), DTYPES, DISK (bytes on disk), MEMORY (RAM size recorded\n"
    "at spill), CREATED, ACCESSED (local time), MODE (native, compat, or\n"
    "reference for entries the reference implementation wrote).\n";

static int sort_key;
static int sort_rev;

static int cmp_entries(const void *pa, const void *pb) {
  const kvt_entry_info *a = pa, *b = pb;
  int r = 0;
#define DESC(x, y) ((x) < (y) ? 1 : (x) > (y) ? -1 : 0)
  switch (sort_key) {
  case 0:
    r = DESC(a->accessed_at, b->accessed_at);
    break;
  case 1:
    r = DESC(a->created_at, b->created_at);
    break;
  case 2:
    r = DESC(a->disk_bytes, b->disk_bytes);
    break;
  case 3:
    r = DESC(a->memory_bytes, b->memory_bytes);
    break;
  case 4:
    r = DESC(a->num_tokens, b->num_tokens);
    break;
  default:
    break;
  }
#undef DESC
  if (r == 0)
    r = strcmp(a->token_hash, b->token_hash);
  return sort_rev ? -r : r;
}

int cmd_ls(int argc, char **argv) {
  cli_flag f[] = {{"json", 0},    {"sort", 1},     {"reverse", 0},
                  {"limit", 1},   {"full", 0},     {"no-describe", 0},
                  {"verbose", 0}, CLI_REMOTE_FLAGS};
  const size_t nf = sizeof f / sizeof f[0];
  const char *pos[1] = {NULL};
  /* DIR is optional here: --remote URL lists a remote store instead. */
  int rc =
      cli_begin("ls", LS_HELP, "missing DIR", argc, argv, f, nf, pos, 0, 1);
  if (rc != CLI_RUN)
    return rc;
  int json = cli_flag_get(f, nf, "json")->set;
  cli_remote_args ra;
  if (cli_remote_args_get(&ra, f, nf))
    return cli_remote("ls", &ra, json, 0, cli_flag_get(f, nf, "verbose")->set);
  if ((rc = cli_need_dir("ls", LS_HELP, pos[0])) != CLI_RUN)
    return rc;
  static const char *keys[] = {"accessed", "created", "size",
                               "memory",   "tokens",  "hash"};
  sort_key = 0;
  const char *sk = cli_flag_get(f, nf, "sort")->value;
  if (sk) {
    sort_key = -1;
    for (int i = 0; i < 6; i++)
      if (strcmp(sk, keys[i]) == 0)
        sort_key = i;
    if (strcmp(sk, "disk") == 0)
      sort_key = 2;
    if (sort_key < 0)
      return cli_fail(json, "ls", CLI_USAGE,
                      "unknown sort key '%s' (accessed, created, size, "
                      "memory, tokens, hash)",
                      sk);
  }
  sort_rev = cli_flag_get(f, nf, "reverse")->set > 0;
  uint64_t limit = UINT64_MAX;
  const char *lv = cli_flag_get(f, nf, "limit")->value;
  if (lv && cli_parse_u64(lv, &limit) != 0)
    return cli_fail(json, "ls", CLI_USAGE, "--limit needs a number, got '%s'",
                    lv);
  int full = cli_flag_get(f, nf, "full")->set;
  int describe = !cli_flag_get(f, nf, "no-describe")->set;

  cli_cache c;
  cli_entries es;
  rc = cli_cache_open_list(&c, &es, pos[0], RO_FLAGS, json, "ls",
                           cli_flag_get(f, nf, "verbose")->set);
  if (rc)
    return rc;
  cli_qsort(es.v, es.n, sizeof *es.v, cmp_entries);
  size_t shown = es.n < limit ? es.n : (size_t)limit;
  /* Chains (chunked store): listed once, then each entry's chain walked. */
  cli_chunkmap cm; /* --no-describe: no chains either (fast, little RAM) */
  if (!describe || cli_chunkmap_load(&cm, c.tier) != 0)
    memset(&cm, 0, sizeof cm);
  int chains = cm.totals.chunks > 0 || cm.totals.chained_entries > 0;

  if (json) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "dir", c.dir);
    cJSON_AddNumberToObject(o, "total", (double)es.n);
    cJSON_AddNumberToObject(o, "count", (double)shown);
    cJSON *arr = cJSON_AddArrayToObject(o, "entries");
    for (size_t i = 0; i < shown; i++) {
      cJSON *e = cJSON_CreateObject();
      add_info_json(e, &es.v[i]);
      if (describe) {
        cli_desc d;
        cli_desc_entry(&d, c.tier, es.v[i].token_hash);
        add_desc_json(e, &d);
      }
      if (chains) {
        cli_chain_sum cs;
        cli_chain_summary(&cs, c.tier, &cm, es.v[i].token_hash);
        cli_chain_summary_json(e, &cs);
      }
      cJSON_AddItemToArray(arr, e);
    }
    cli_json_print(o);
  } else {
    static const char *heads[] = {"HASH",     "TOKENS", "LAYERS", "KINDS",
                                  "DTYPES",   "DISK",   "MEMORY", "CREATED",
                                  "ACCESSED", "MODE",   "CHAIN",  "SHARED"};
    cli_table t;
    /* CHAIN (chunks under the entry) and SHARED (of them, chunks other
     * entries' chains hold too) only for caches with chunks. */
    cli_table_init(&t, chains ? 12 : 10, heads, "lrrllrrlllrr");
    for (size_t i = 0; i < shown; i++) {
      const kvt_entry_info *e = &es.v[i];
      cli_desc d;
      memset(&d, 0, sizeof d);
      if (describe)
        cli_desc_entry(&d, c.tier, e->token_hash);
      char h[65], tok[32], nl[16], disk[32], mem[32], cr[32], ac[32];
      snprintf(h, sizeof h, "%.*s", full ? 64 : 16, e->token_hash);
      snprintf(tok, sizeof tok, "%llu", (unsigned long long)e->num_tokens);
      if (describe && d.ok)
        snprintf(nl, sizeof nl, "%u", d.layers);
      else
        snprintf(nl, sizeof nl, "-");
      const char *row[12] = {h,
                             tok,
                             nl,
                             !describe ? "-"
                             : d.ok    ? d.kinds
                                       : "(unreadable)",
                             describe && d.ok ? d.dtypes : "-",
                             cli_fmt_bytes(disk, sizeof disk, e->disk_bytes),
                             cli_fmt_bytes(mem, sizeof mem, e->memory_bytes),
                             cli_fmt_time(cr, sizeof cr, e->created_at),
                             cli_fmt_time(ac, sizeof ac, e->accessed_at),
                             describe && d.ok ? d.storage : "-",
                             "-",
                             "-"};
      char chn[32], shr[32];
      if (chains) {
        cli_chain_sum cs;
        cli_chain_summary(&cs, c.tier, &cm, e->token_hash);
        if (cs.chained) {
          snprintf(chn, sizeof chn, "%zu%s", cs.chunks,
                   cs.complete ? "" : " (broken)");
          snprintf(shr, sizeof shr, "%zu", cs.shared);
          row[10] = chn;
          row[11] = shr;
        }
      }
      cli_table_add(&t, row);
      if (describe && !d.ok)
        fprintf(stderr, "kvtier ls: %s: %s\n", e->token_hash, d.error);
    }
    cli_table_print(&t, stdout);
    cli_table_free(&t);
    if (es.n == 0) {
      printf("(no entries%s)\n", c.empty ? ": empty directory" : "");
    } else {
      uint64_t disk = 0, mem = 0;
      for (size_t i = 0; i < es.n; i++)
        disk += es.v[i].disk_bytes, mem += es.v[i].memory_bytes;
      char a[32], b[32];
      printf("(%zu of %zu entries shown; cache total %s on disk, %s in "
             "memory)\n",
             shown, es.n, cli_fmt_bytes(a, sizeof a, disk),
             cli_fmt_bytes(b, sizeof b, mem));
    }
  }
  cli_chunkmap_free(&cm);
  cli_entries_free(&es);
  cli_cache_close(&c);
  return CLI_OK;
}

/* ---- stats -------------------------------------------------------------- */

static const char *STATS_HELP =
    "usage: kvtier stats DIR|--remote URL [--json | --prometheus] [--max-size "
    "SIZE]\n"
    "                        [--max-entries N] [--no-describe]\n"
    "       kvtier stats DIR --watch SECONDS [--count N] [--json | "
    "--prometheus]\n"
    "\n"
    "Totals and the capacity picture of a cache directory (read-only):\n"
    "entries, bytes on disk, memory bytes, tokens, oldest/newest entry, least\n"
    "recent access, layers and entries per layer kind, storage modes, dtypes,\n"
    "entries in quarantine/, free space on the filesystem, and the use of the\n"
    "limits (--max-size/--max-entries; default: the library defaults 10G and\n"
    "10000). The counters (spills, hits, tokens, latency histograms, queue)\n"
    "are the live ones of the process that has DIR open for writing, which\n"
    "publishes them in DIR/stats.bin; when no process has it open the output\n"
    "says so (and the counters are zero).\n"
    "\n"
    "  --watch SECONDS  print the live counters every SECONDS (one line, JSON\n"
    "                  object or exposition per tick) until interrupted\n"
    "  --count N       with --watch: stop after N ticks\n"
    "  --prometheus    Prometheus text exposition (kvt_stats_to_prometheus)\n"
    "  --json          JSON output\n"
    "  --max-size SIZE, --max-entries N   limits to compare against\n"
    "  --no-describe   skip reading manifests (no per-kind/dtype "
    "counts)\n" CLI_REMOTE_HELP;

int cmd_stats(int argc, char **argv) {
  cli_flag f[] = {{"json", 0},        {"prometheus", 0},  {"max-size", 1},
                  {"max-entries", 1}, {"no-describe", 0}, {"verbose", 0},
                  {"watch", 1},       {"count", 1},       CLI_REMOTE_FLAGS};
  const size_t nf = sizeof f / sizeof f[0];
  const char *pos[1] = {NULL};
  int rc = cli_begin("stats", STATS_HELP, "missing DIR", argc, argv, f, nf, pos,
                     0, 1);
  if (rc != CLI_RUN)
    return rc;
  int json = cli_flag_get(f, nf, "json")->set;
  int prom = cli_flag_get(f, nf, "prometheus")->set;
  cli_remote_args ra;
  int remote = cli_remote_args_get(&ra, f, nf);
  if (cli_flag_get(f, nf, "watch")->value && remote)
    return cli_fail(json, "stats", CLI_USAGE,
                    "--watch reads the live counters of a DIR, not --remote");
  if (remote && !(json && prom))
    return cli_remote("stats", &ra, json, prom,
                      cli_flag_get(f, nf, "verbose")->set);
  if ((rc = cli_need_dir("stats", STATS_HELP, pos[0])) != CLI_RUN)
    return rc;
  if (json && prom)
    return cli_fail(0, "stats", CLI_USAGE,
                    "--json and --prometheus are exclusive");
  const char *wv = cli_flag_get(f, nf, "watch")->value;
  const char *cv = cli_flag_get(f, nf, "count")->value;
  if (cv && !wv)
    return cli_fail(json, "stats", CLI_USAGE, "--count needs --watch");
  if (wv) {
    char *end = NULL;
    double iv = strtod(wv, &end);
    uint64_t count = 0;
    if (end == wv || *end || !(iv >= 0.01 && iv <= 86400))
      return cli_fail(json, "stats", CLI_USAGE,
                      "--watch needs SECONDS in [0.01, 86400], got '%s'", wv);
    if (cv && (cli_parse_u64(cv, &count) != 0 || count == 0))
      return cli_fail(json, "stats", CLI_USAGE,
                      "--count needs a number >= 1, got '%s'", cv);
    return cli_live_watch(pos[0], iv, count, json, prom);
  }
  uint64_t max_bytes = (uint64_t)10 << 30, max_entries = 10000;
  int given = 0;
  const char *v;
  if ((v = cli_flag_get(f, nf, "max-size")->value)) {
    if (cli_parse_size(v, &max_bytes) != 0 || max_bytes == 0)
      return cli_fail(json, "stats", CLI_USAGE,
                      "--max-size needs a size like 10G or 512M, got '%s'", v);
    given = 1;
  }
  if ((v = cli_flag_get(f, nf, "max-entries")->value)) {
    if (cli_parse_u64(v, &max_entries) != 0 || max_entries == 0)
      return cli_fail(json, "stats", CLI_USAGE,
                      "--max-entries needs a number >= 1, got '%s'", v);
    given = 1;
  }
  int describe = !cli_flag_get(f, nf, "no-describe")->set && !prom;

  cli_cache c;
  rc = cli_cache_open(&c, pos[0], RO_FLAGS, json, "stats",
                      cli_flag_get(f, nf, "verbose")->set);
  if (rc)
    return rc;
  kvt_stats s = KVT_STATS_INIT;
  if (c.tier && (rc = kvt_tier_stats(&s, c.tier)) != 0) {
    cli_cache_close(&c);
    return cli_fail(json, "stats", CLI_FAILED, "cannot read stats: %s",
                    kvt_last_error());
  }
  cli_live live; /* the counters of the process that has the directory open */
  cli_live_read(&live, c.dir);
  cli_live_merge(&s, &live);
  if (prom) {
    size_t need = 0;
    kvt_stats_to_prometheus(NULL, 0, &need, &s);
    char *buf = malloc(need ? need : 1);
    if (!buf || kvt_stats_to_prometheus(buf, need, &need, &s) != 0) {
      free(buf);
      cli_cache_close(&c);
      return cli_fail(0, "stats", CLI_FAILED, "cannot render metrics: %s",
                      kvt_last_error());
    }
    fputs(buf, stdout);
    free(buf);
    cli_live_prom(&live, stdout);
    cli_chunk_prom(c.tier, stdout);
    cli_cache_close(&c);
    return CLI_OK;
  }

  cli_entries es;
  if ((rc = cli_entries_load_or_fail(&es, &c, json, "stats")) != 0)
    return rc;
  double oldest = 0, newest = 0, lru = 0;
  uint64_t tokens = 0, disk = 0, mem = 0;
  uint64_t layers_by_kind[5] = {0}, entries_by_kind[5] = {0};
  uint64_t unreadable = 0;
  /* Storage modes as describe names them (native, compat, reference...). */
  char mode_name[8][16];
  uint64_t mode_count[8] = {0};
  size_t nmodes = 0;
  char dtypes[256] = "";
  cli_progress pg;
  cli_progress_start(&pg, "reading", describe ? es.n : 0, 1);
  for (size_t i = 0; i < es.n; i++) {
    const kvt_entry_info *e = &es.v[i];
    if (oldest == 0 || e->created_at < oldest)
      oldest = e->created_at;
    if (e->created_at > newest)
      newest = e->created_at;
    if (lru == 0 || e->accessed_at < lru)
      lru = e->accessed_at;
    tokens += e->num_tokens;
    disk += e->disk_bytes;
    mem += e->memory_bytes;
    if (!describe)
      continue;
    cli_desc d;
    cli_desc_entry(&d, c.tier, e->token_hash);
    cli_progress_update(&pg, i + 1);
    if (!d.ok) {
      unreadable++;
      continue;
    }
    for (int k = 0; k < 5; k++) {
      layers_by_kind[k] += d.kind_count[k];
      entries_by_kind[k] += d.kind_count[k] ? 1 : 0;
    }
    size_t m = 0;
    while (m < nmodes && strcmp(mode_name[m], d.storage) != 0)
      m++;
    if (m == nmodes && nmodes < 8)
      snprintf(mode_name[nmodes++], sizeof mode_name[0], "%s", d.storage);
    if (m < nmodes)
      mode_count[m]++;
    if (strcmp(d.dtypes, "?") != 0) {
      char tmp[64];
      snprintf(tmp, sizeof tmp, "%s", d.dtypes);
      for (char *sv = NULL, *p = strtok_r(tmp, ",", &sv); p;
           p = strtok_r(NULL, ",", &sv)) {
        char pat[24];
        snprintf(pat, sizeof pat, ",%s,", p);
        char wrapped[260];
        snprintf(wrapped, sizeof wrapped, ",%s,", dtypes);
        if (!strstr(wrapped, pat)) {
          size_t cur = strlen(dtypes);
          snprintf(dtypes + cur, sizeof dtypes - cur, "%s%s", cur ? "," : "",
                   p);
        }
      }
    }
  }
  cli_progress_end(&pg);
  uint64_t entry_bytes = disk; /* the entries' own files (tails) */
  if (c.tier) {                /* the library's own totals are authoritative */
    disk = s.disk_bytes ? s.disk_bytes : disk;
    mem = s.memory_bytes ? s.memory_bytes : mem;
  }
  kvt_cache_dir_probe_info pr = KVT_CACHE_DIR_PROBE_INIT;
  uint64_t quarantined =
      kvt_cache_dir_probe(&pr, c.dir) == 0 ? pr.quarantined : 0;
  struct statvfs vfs;
  int have_vfs = statvfs(c.dir, &vfs) == 0;
  uint64_t fs_total = have_vfs ? (uint64_t)vfs.f_blocks * vfs.f_frsize : 0;
  uint64_t fs_free = have_vfs ? (uint64_t)vfs.f_bavail * vfs.f_frsize : 0;
  double now = cli_now();

  if (json) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "dir", c.dir);
    cJSON_AddNumberToObject(o, "entries", (double)es.n);
    cJSON_AddNumberToObject(o, "disk_bytes", (double)disk);
    cJSON_AddNumberToObject(o, "memory_bytes", (double)mem);
    cJSON_AddNumberToObject(o, "total_tokens", (double)tokens);
    char t[64];
    if (es.n) {
      cJSON_AddNumberToObject(o, "oldest_created_at", oldest);
      cJSON_AddStringToObject(o, "oldest_created",
                              cli_fmt_iso(t, sizeof t, oldest));
      cJSON_AddNumberToObject(o, "newest_created_at", newest);
      cJSON_AddNumberToObject(o, "least_recent_access_at", lru);
    } else {
      cJSON_AddNullToObject(o, "oldest_created_at");
      cJSON_AddNullToObject(o, "newest_created_at");
      cJSON_AddNullToObject(o, "least_recent_access_at");
    }
    if (describe) {
      cJSON *lk = cJSON_AddObjectToObject(o, "layers_by_kind");
      cJSON *ek = cJSON_AddObjectToObject(o, "entries_by_kind");
      for (int k = 1; k <= 4; k++) {
        cJSON_AddNumberToObject(lk, cli_kind_name(k),
                                (double)layers_by_kind[k]);
        cJSON_AddNumberToObject(ek, cli_kind_name(k),
                                (double)entries_by_kind[k]);
      }
      cJSON *sm = cJSON_AddObjectToObject(o, "storage_modes");
      for (size_t m = 0; m < nmodes; m++)
        cJSON_AddNumberToObject(sm, mode_name[m], (double)mode_count[m]);
      cJSON *dt = cJSON_AddArrayToObject(o, "dtypes");
      for (char *sv = NULL, *p = strtok_r(dtypes, ",", &sv); p;
           p = strtok_r(NULL, ",", &sv))
        cJSON_AddItemToArray(dt, cJSON_CreateString(p));
      cJSON_AddNumberToObject(o, "unreadable_entries", (double)unreadable);
    }
    cli_chunk_stats(c.tier, entry_bytes, 1, o);
    cJSON_AddNumberToObject(o, "quarantine_entries", (double)quarantined);
    cJSON *cap = cJSON_AddObjectToObject(o, "capacity");
    cJSON_AddNumberToObject(cap, "max_bytes", (double)max_bytes);
    cJSON_AddNumberToObject(cap, "max_entries", (double)max_entries);
    cJSON_AddNumberToObject(cap, "bytes_used_fraction",
                            (double)disk / (double)max_bytes);
    cJSON_AddNumberToObject(cap, "entries_used_fraction",
                            (double)es.n / (double)max_entries);
    cJSON_AddStringToObject(cap, "limits", given ? "given" : "default");
    if (have_vfs) {
      cJSON *fs = cJSON_AddObjectToObject(o, "filesystem");
      cJSON_AddNumberToObject(fs, "total_bytes", (double)fs_total);
      cJSON_AddNumberToObject(fs, "free_bytes", (double)fs_free);
    }
    size_t need = 0;
    kvt_stats_to_json(NULL, 0, &need, &s);
    char *buf = malloc(need ? need : 1);
    if (buf && kvt_stats_to_json(buf, need, &need, &s) == 0) {
      cJSON *sj = cJSON_Parse(buf);
      if (sj)
        cJSON_AddItemToObject(o, "counters", sj);
    }
    free(buf);
    cli_live_json(o, &live);
    cli_json_print(o);
  } else {
    char a[32], b[32], t1[32], t2[32];
    printf("cache      %s%s\n", c.dir, c.empty ? " (empty directory)" : "");
    printf("entries    %zu of %llu (%.1f%%)\n", es.n,
           (unsigned long long)max_entries, 100.0 * es.n / max_entries);
    printf("on disk    %s of %s (%.1f%%)%s\n", cli_fmt_bytes(a, sizeof a, disk),
           cli_fmt_bytes(b, sizeof b, max_bytes),
           100.0 * (double)disk / (double)max_bytes,
           given ? "" : "   [default limits; see --max-size]");
    printf("in memory  %s (sum of memory_bytes; disk/memory %.2f)\n",
           cli_fmt_bytes(a, sizeof a, mem), mem ? (double)disk / mem : 0.0);
    printf("tokens     %llu\n", (unsigned long long)tokens);
    if (es.n) {
      printf("oldest     %s (%s ago)\n", cli_fmt_time(t1, sizeof t1, oldest),
             cli_fmt_age(t2, sizeof t2, now - oldest));
      printf("newest     %s (%s ago)\n", cli_fmt_time(t1, sizeof t1, newest),
             cli_fmt_age(t2, sizeof t2, now - newest));
      printf("LRU access %s (%s ago)\n", cli_fmt_time(t1, sizeof t1, lru),
             cli_fmt_age(t2, sizeof t2, now - lru));
    }
    if (describe && es.n) {
      static const char *heads[] = {"KIND", "LAYERS", "ENTRIES"};
      cli_table t;
      cli_table_init(&t, 3, heads, "lrr");
      for (int k = 1; k <= 4; k++) {
        char l[32], e[32];
        snprintf(l, sizeof l, "%llu", (unsigned long long)layers_by_kind[k]);
        snprintf(e, sizeof e, "%llu", (unsigned long long)entries_by_kind[k]);
        const char *row[3] = {cli_kind_name(k), l, e};
        cli_table_add(&t, row);
      }
      printf("modes      ");
      for (size_t m = 0; m < nmodes; m++)
        printf("%s%s %llu", m ? ", " : "", mode_name[m],
               (unsigned long long)mode_count[m]);
      printf("%s\n", nmodes ? "" : "-");
      printf("dtypes     %s\n", dtypes[0] ? dtypes : "-");
      if (unreadable)
        printf("unreadable %llu entries (run kvtier verify)\n",
               (unsigned long long)unreadable);
      printf("\n");
      cli_table_print(&t, stdout);
      cli_table_free(&t);
      printf("\n");
    }
    cli_chunk_stats(c.tier, entry_bytes, 0, NULL);
    printf("quarantine %llu entries\n", (unsigned long long)quarantined);
    if (have_vfs)
      printf("filesystem %s free of %s\n", cli_fmt_bytes(a, sizeof a, fs_free),
             cli_fmt_bytes(b, sizeof b, fs_total));
    cli_live_print(&live, stdout);
  }
  cli_entries_free(&es);
  cli_cache_close(&c);
  return CLI_OK;
}

/* ---- show --------------------------------------------------------------- */

static const char *SHOW_HELP =
    "usage: kvtier show DIR HASH [--json]\n"
    "       kvtier show --remote URL [--remote-prefix P] HASH [--json]\n"
    "\n"
    "One entry in detail (read-only): token count, sizes, times, storage\n"
    "mode, the manifest, and for each layer its kind, attributes and tensors\n"
    "with dtype, shape and byte length (from the manifest and safetensors\n"
    "headers; no tensor data is read). HASH is the 64-digit token hash or a\n"
    "unique prefix of it (at least 4 digits).\n"
    "\n"
    "  --json   the kvt_tier_describe document plus the index fields:\n"
    "           {dir, entry: {...}, describe: {...}} (--remote: {remote,\n"
    "           prefix, entry, describe})\n" CLI_REMOTE_HELP;

/* Byte length of a tensor object in a describe document. */
static double tensor_bytes(const cJSON *tv) {
  static const char *keys[] = {"nbytes", "byte_length", "bytes", "size"};
  for (size_t i = 0; i < 4; i++) {
    double v = cli_jnum(tv, keys[i], -1);
    if (v >= 0)
      return v;
  }
  const cJSON *off = cJSON_GetObjectItemCaseSensitive(tv, "data_offsets");
  if (cJSON_GetArraySize(off) == 2)
    return cJSON_GetArrayItem(off, 1)->valuedouble -
           cJSON_GetArrayItem(off, 0)->valuedouble;
  return -1;
}

static void shape_str(char *buf, size_t cap, const cJSON *shape) {
  size_t cur = 0;
  buf[0] = 0;
  cur += snprintf(buf, cap, "[");
  const cJSON *d;
  int first = 1;
  cJSON_ArrayForEach(d, shape) {
    if (cur < cap)
      cur += snprintf(buf + cur, cap - cur, "%s%.0f", first ? "" : ", ",
                      d->valuedouble);
    first = 0;
  }
  if (cur < cap)
    snprintf(buf + cur, cap - cur, "]");
}

/* Layer attributes worth a glance: offset and the kind-specific ones. */
static void layer_attrs(char *buf, size_t cap, const cJSON *layer,
                        const cJSON *man_layer) {
  static const char *keys[] = {"offset", "max_size",   "keep",
                               "step",   "idx",        "_idx",
                               "bits",   "group_size", "num_arrays"};
  size_t cur = 0;
  buf[0] = 0;
  const cJSON *src[2] = {layer, man_layer};
  for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
    for (int s = 0; s < 2; s++) {
      const cJSON *v =
          src[s] ? cJSON_GetObjectItemCaseSensitive(src[s], keys[i]) : NULL;
      if (cJSON_IsNumber(v) && cur < cap) {
        cur += snprintf(buf + cur, cap - cur, "%s%s=%.0f", cur ? " " : "",
                        keys[i], v->valuedouble);
        break;
      }
    }
  }
  if (!buf[0])
    snprintf(buf, cap, "-");
}

static void print_manifest(const cJSON *obj, const char *prefix) {
  const cJSON *it;
  cJSON_ArrayForEach(it, obj) {
    if (!it->string || (!*prefix && strcmp(it->string, "layers") == 0))
      continue;
    char key[128];
    snprintf(key, sizeof key, "%s%s", prefix, it->string);
    if (cJSON_IsObject(it) && !*prefix) {
      char p2[136];
      snprintf(p2, sizeof p2, "%s.", key);
      print_manifest(it, p2);
    } else if (cJSON_IsObject(it) || cJSON_IsArray(it)) {
      char *s = cJSON_PrintUnformatted(it);
      if (s && strlen(s) <= 100)
        printf("  %-24s %s\n", key, s);
      else
        printf("  %-24s (%d items; see --json)\n", key, cJSON_GetArraySize(it));
      cJSON_free(s);
    } else {
      char *s = cJSON_PrintUnformatted(it);
      printf("  %-24s %s\n", key, s ? s : "?");
      cJSON_free(s);
    }
  }
}

int cli_hash_arg(const char *want, int json) {
  size_t wl = strlen(want);
  if (wl < 4 || wl > 64 || strspn(want, "0123456789abcdefABCDEF") != wl)
    return cli_fail(json, "show", CLI_USAGE,
                    "HASH must be 4 to 64 hex digits, got '%s'", want);
  return CLI_RUN;
}

int cli_find_hash(const cli_entries *es, const char *want, const char *where,
                  int json, const kvt_entry_info **hit) {
  size_t wl = strlen(want);
  char lw[65];
  for (size_t i = 0; i <= wl && i < sizeof lw; i++)
    lw[i] = (char)((want[i] >= 'A' && want[i] <= 'F') ? want[i] + 32 : want[i]);
  size_t matches = 0;
  for (size_t i = 0; i < es->n; i++)
    if (strncmp(es->v[i].token_hash, lw, wl) == 0) {
      *hit = &es->v[i];
      matches++;
    }
  if (matches > 1)
    return cli_fail(json, "show", CLI_USAGE,
                    "hash prefix '%s' matches %zu entries; give more digits",
                    want, matches);
  if (matches == 0)
    return cli_fail(json, "show", CLI_NOTFOUND, "no entry %s in %s", want,
                    where);
  return CLI_RUN;
}

int cmd_show(int argc, char **argv) {
  cli_flag f[] = {{"json", 0}, {"verbose", 0}, CLI_REMOTE_FLAGS};
  const size_t nf = sizeof f / sizeof f[0];
  const char *pos[2] = {NULL, NULL};
  int rc = cli_begin("show", SHOW_HELP, "needs DIR and HASH", argc, argv, f, nf,
                     pos, 1, 2);
  if (rc != CLI_RUN)
    return rc;
  int json = cli_flag_get(f, nf, "json")->set;
  cli_remote_args ra;
  if (cli_remote_args_get(&ra, f, nf)) {
    if (pos[1])
      return cli_fail(json, "show", CLI_USAGE,
                      "give HASH only with --remote (no DIR)");
    return cli_remote_show(&ra, pos[0], json);
  }
  if (!pos[1])
    return cli_fail(json, "show", CLI_USAGE, "needs DIR and HASH");
  const char *want = pos[1];
  if ((rc = cli_hash_arg(want, json)) != CLI_RUN)
    return rc;
  cli_cache c;
  cli_entries es;
  rc = cli_cache_open_list(&c, &es, pos[0], RO_FLAGS, json, "show",
                           cli_flag_get(f, nf, "verbose")->set);
  if (rc)
    return rc;
  const kvt_entry_info *hit = NULL;
  if ((rc = cli_find_hash(&es, want, c.dir, json, &hit)) != CLI_RUN) {
    cli_entries_free(&es);
    cli_cache_close(&c);
    return rc;
  }
  kvt_entry_info info = *hit;
  cli_entries_free(&es);
  char *djson = NULL;
  rc = kvt_tier_describe(&djson, c.tier, info.token_hash);
  if (rc != 0) {
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", kvt_last_error());
    cli_cache_close(&c);
    if (rc == KVT_ENOTFOUND)
      return cli_fail(json, "show", CLI_NOTFOUND, "entry %s: files missing: %s",
                      info.token_hash, msg);
    return cli_fail(json, "show", CLI_FAILED, "entry %s: %s (%s)",
                    info.token_hash, msg, kvt_strerror(rc));
  }
  rc = cli_show_print("dir", c.dir, NULL, &info, djson, json, c.tier);
  kvt_free(djson);
  cli_cache_close(&c);
  return rc;
}

int cli_show_print(const char *where_key, const char *where, const char *prefix,
                   const kvt_entry_info *ip, const char *djson, int json,
                   kvt_tier *chain_tier) {
  kvt_entry_info info = *ip;
  cJSON *doc = cJSON_Parse(djson);
  if (!doc)
    return cli_fail(json, "show", CLI_FAILED,
                    "entry %s: describe returned invalid JSON",
                    info.token_hash);
  if (json) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, where_key, where);
    if (prefix)
      cJSON_AddStringToObject(o, "prefix", prefix);
    cJSON *e = cJSON_AddObjectToObject(o, "entry");
    add_info_json(e, &info);
    cJSON_AddItemToObject(o, "describe", doc);
    if (chain_tier)
      cli_chain_show(chain_tier, info.token_hash, 1, o);
    cli_json_print(o);
    return CLI_OK;
  }
  char a[32], b[32], t1[32], t2[32];
  cli_desc d;
  char *flat = cJSON_PrintUnformatted(doc);
  cli_desc_parse(&d, flat ? flat : "{}");
  cJSON_free(flat);
  printf("entry       %s\n", info.token_hash);
  printf("prefix      %s\n", info.prefix_hash);
  printf("tokens      %llu\n", (unsigned long long)info.num_tokens);
  printf("on disk     %s (%llu bytes)\n",
         cli_fmt_bytes(a, sizeof a, info.disk_bytes),
         (unsigned long long)info.disk_bytes);
  printf("memory      %s (%llu bytes)\n",
         cli_fmt_bytes(b, sizeof b, info.memory_bytes),
         (unsigned long long)info.memory_bytes);
  printf("created     %s\n", cli_fmt_time(t1, sizeof t1, info.created_at));
  printf("accessed    %s\n", cli_fmt_time(t2, sizeof t2, info.accessed_at));
  printf("storage     %s\n", d.storage);
  printf("layers      %u (%s)\n", d.layers, d.kinds[0] ? d.kinds : "-");
  printf("\n");
  static const char *heads[] = {"LAYER", "KIND",  "ATTRIBUTES", "TENSOR",
                                "DTYPE", "SHAPE", "BYTES"};
  cli_table t;
  cli_table_init(&t, 7, heads, "rlllllr");
  const cJSON *layers = cJSON_GetObjectItemCaseSensitive(doc, "layers");
  if (!cJSON_IsArray(layers)) {
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(doc, "manifest");
    layers = m ? cJSON_GetObjectItemCaseSensitive(m, "layers") : NULL;
  }
  const cJSON *layer;
  int li = 0;
  cJSON_ArrayForEach(layer, layers) {
    char idx[16], attrs[160];
    double lidx = cli_jnum(layer, "layer_idx", cli_jnum(layer, "index", li));
    snprintf(idx, sizeof idx, "%.0f", lidx);
    /* Attributes live in the manifest's layer object (describe's layer
     * object may repeat them). */
    const cJSON *man = cJSON_GetObjectItemCaseSensitive(doc, "manifest");
    const cJSON *mls =
        man ? cJSON_GetObjectItemCaseSensitive(man, "layers") : NULL;
    layer_attrs(attrs, sizeof attrs, layer, cJSON_GetArrayItem(mls, li));
    const char *kind = cli_kind_name(cli_layer_kind(layer));
    const cJSON *ts = cJSON_GetObjectItemCaseSensitive(layer, "tensors");
    const cJSON *tv;
    int first = 1;
    cJSON_ArrayForEach(tv, ts) {
      char shape[128], bytes[32];
      const char *name = cli_jstr(tv, "name");
      if (!name)
        name = tv->string ? tv->string : "?";
      shape_str(shape, sizeof shape,
                cJSON_GetObjectItemCaseSensitive(tv, "shape"));
      double nb = tensor_bytes(tv);
      if (nb >= 0)
        snprintf(bytes, sizeof bytes, "%.0f", nb);
      else
        snprintf(bytes, sizeof bytes, "-");
      const char *dt = cli_jstr(tv, "dtype");
      const char *row[7] = {first ? idx : "",
                            first ? kind : "",
                            first ? attrs : "",
                            name,
                            dt ? dt : "?",
                            shape,
                            bytes};
      cli_table_add(&t, row);
      first = 0;
    }
    if (first) {
      const char *row[7] = {idx, kind, attrs, "-", "-", "-", "-"};
      cli_table_add(&t, row);
    }
    li++;
  }
  cli_table_print(&t, stdout);
  cli_table_free(&t);
  if (chain_tier) /* the chunks behind the entry's tail (chunked store) */
    cli_chain_show(chain_tier, info.token_hash, 0, NULL);
  const cJSON *man = cJSON_GetObjectItemCaseSensitive(doc, "manifest");
  if (man) {
    /* The manifest's other keys, one level of nesting flattened; big
     * objects (per-file checksums) summarised. The full document is in
     * --json. */
    printf("\nmanifest\n");
    print_manifest(man, "");
  }
  cJSON_Delete(doc);
  return CLI_OK;
}
