/*
 * cmd_maint.c - the checking and maintenance commands of the kvtier tool:
 * `verify` (every entry read and verified through kvt_tier_verify, plus the
 * index compared with data/: rows without files, entry directories without
 * rows, stale *.tmp directories, stray names) with an optional `--repair`
 * that quarantines bad entries and reconciles; and `gc` (kvt_tier_gc with
 * the limits the user gives, reporting exactly which entries went).
 *
 * Plain verify opens read-only and changes nothing. --repair and gc open for
 * writing with KVT_OPEN_NO_RECONCILE so that nothing is changed before the
 * tool has looked, and with limits no cache reaches so that only what the
 * user asked for is applied.
 */
#define _GNU_SOURCE
#include "cli.h"
#include "kvtier_sys.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- verify ------------------------------------------------------------- */

static const char *VERIFY_HELP =
    "usage: kvtier verify DIR|--remote URL [--repair] [--json] "
    "[--no-progress]\n"
    "\n"
    "Checks every entry of a cache directory: reads and verifies each one\n"
    "completely (manifest, safetensors headers, xxh3 checksums where the\n"
    "manifest records them, tokens.bin against the hash, path safety), and\n"
    "compares the index with data/ (rows whose files are missing, entry\n"
    "directories without a row, stale *.tmp directories, unexpected names).\n"
    "Without --repair the directory is opened read-only and nothing changes.\n"
    "A progress bar is drawn on stderr when it is a terminal.\n"
    "\n"
    "  --repair       quarantine corrupt entries (to quarantine/<hash>, row\n"
    "                 dropped) and reconcile the index with the files\n"
    "  --json         JSON output: {dir, checked, ok, problems: [...],\n"
    "                 repaired, reconciled, clean}\n"
    "  --no-progress  never draw the progress bar\n" CLI_REMOTE_HELP
    "                 (damaged or incomplete remote entries are removed)\n"
    "\n"
    "Exit: 0 everything good; 1 problems found (with --repair: and repaired);\n"
    "3 cannot open; 4 a check or repair failed to run.\n";

typedef struct problem {
  char hash[80];
  const char *kind; /* corrupt, missing, io-error, orphan, stale-tmp, stray,
                       unlistable (data/ itself) */
  char detail[512];
  const char *action;
} problem;

typedef struct problems {
  problem *v;
  size_t n, cap;
} problems;

static problem *add_problem(problems *ps, const char *hash, const char *kind,
                            const char *detail) {
  if (ps->n == ps->cap) {
    size_t nc = ps->cap ? ps->cap * 2 : 16;
    problem *nv = realloc(ps->v, nc * sizeof *nv);
    if (!nv)
      return NULL;
    ps->v = nv;
    ps->cap = nc;
  }
  problem *p = &ps->v[ps->n++];
  memset(p, 0, sizeof *p);
  snprintf(p->hash, sizeof p->hash, "%s", hash);
  p->kind = kind;
  snprintf(p->detail, sizeof p->detail, "%s", detail ? detail : "");
  p->action = "-";
  return p;
}

/* cli_problem_fn over a problems list. */
static void problem_cb(void *ctx, const char *name, const char *kind,
                       const char *detail, const char *action) {
  problem *p = add_problem(ctx, name, kind, detail);
  if (p)
    p->action = action; /* static strings (cmd_chunks.c gc_action) */
}

/* The problems as a JSON array arr of o ({name_key, problem, detail,
 * action}), and as a table (first column head). */
static void problems_json(cJSON *o, const char *arr, const char *name_key,
                          const problems *ps) {
  cJSON *a = cJSON_AddArrayToObject(o, arr);
  for (size_t i = 0; i < ps->n; i++) {
    cJSON *p = cJSON_CreateObject();
    cJSON_AddStringToObject(p, name_key, ps->v[i].hash);
    cJSON_AddStringToObject(p, "problem", ps->v[i].kind);
    cJSON_AddStringToObject(p, "detail", ps->v[i].detail);
    cJSON_AddStringToObject(p, "action", ps->v[i].action);
    cJSON_AddItemToArray(a, p);
  }
}

static void problems_table(const problems *ps, const char *head) {
  const char *heads[] = {head, "PROBLEM", "ACTION", "DETAIL"};
  cli_table t;
  cli_table_init(&t, 4, heads, "llll");
  for (size_t i = 0; i < ps->n; i++) {
    const char *row[4] = {ps->v[i].hash, ps->v[i].kind, ps->v[i].action,
                          ps->v[i].detail};
    cli_table_add(&t, row);
  }
  cli_table_print(&t, stdout);
  cli_table_free(&t);
}

/* Names that are reported but are not the cache's business (no problem). */
static int is_stray(const char *kind) {
  return strcmp(kind, "stray") == 0 || strcmp(kind, "chunk-stray") == 0;
}

static int cmp_hash(const void *a, const void *b) {
  return strcmp(((const kvt_entry_info *)a)->token_hash,
                ((const kvt_entry_info *)b)->token_hash);
}

/* Rounds of recheck below: a real problem survives every one. */
#define RECHECK_ROUNDS 3

static int same_problem(const problems *ps, const problem *p) {
  for (size_t i = 0; i < ps->n; i++)
    if (!strcmp(ps->v[i].hash, p->hash) && !strcmp(ps->v[i].kind, p->kind))
      return 1;
  return 0;
}

/* A verify beside a live writer sees entries evicted or replaced, and chunk
 * files written or removed, between its listing and its reads. So a problem
 * of a read-only verify counts only when a fresh look - a new read-only
 * open, i.e. the index as it is now - still finds it: an entry problem when
 * the row is still there and the entry still fails; a data/ temporary or
 * orphan when the name is still there (and still has no row); a chunk
 * problem when a new chunk pass reports it again. Rounds stop when one
 * drops nothing. Strays and index.db problems are kept as found. */
/* A file a live writer may still be writing or indexing: young (modified
 * within this many seconds) while another process has the directory open
 * for writing. Its own sweep reclaims it should it really be left over. */
#define RECHECK_INFLIGHT_S 30

static int inflight_kind(const char *kind) {
  return !strcmp(kind, "stale-tmp") || !strcmp(kind, "orphan") ||
         !strcmp(kind, "chunk-stale-tmp") || !strcmp(kind, "chunk-orphan");
}

static void recheck(const char *dir, problems *ps, int json, int verbose) {
  cli_live lv;
  cli_live_read(&lv, dir);
  int writer = cli_live_alive(&lv);
  for (int round = 0; round < RECHECK_ROUNDS; round++) {
    int any = 0, chunks = 0;
    for (size_t i = 0; i < ps->n; i++)
      if (!is_stray(ps->v[i].kind)) {
        any = 1;
        chunks |= !strncmp(ps->v[i].kind, "chunk-", 6);
      }
    if (!any)
      return;
    /* A spill in flight (its chunk files written, its rows not yet) lasts
     * milliseconds: wait 20, 80, 320 ms before the looks so one write does
     * not span them all. */
    struct timespec ts = {0, 20000000L << (2 * round)};
    nanosleep(&ts, NULL);
    cli_cache c;
    cli_entries es;
    if (cli_cache_open_list(&c, &es, dir,
                            KVT_OPEN_NO_RECONCILE | KVT_OPEN_READONLY, json,
                            "verify", verbose) != 0)
      return; /* cannot look again: report what was found */
    cli_qsort(es.v, es.n, sizeof *es.v, cmp_hash);
    problems fresh = {0};
    if (chunks && c.tier) {
      size_t a = 0, b = 0, r = 0, f = 0;
      kvt_chunk_gc_result cg;
      cli_verify_chunks(c.tier, 0, 0, problem_cb, &fresh, &a, &b, &r, &f);
      cli_clean_chunks(c.tier, 1, 0, problem_cb, &fresh, &cg);
    }
    size_t w = 0, dropped = 0;
    for (size_t i = 0; i < ps->n; i++) {
      problem *p = &ps->v[i];
      int keep = 1;
      kvt_entry_info key;
      memset(&key, 0, sizeof key);
      snprintf(key.token_hash, sizeof key.token_hash, "%.64s", p->hash);
      int has_row =
          cli_bsearch(&key, es.v, es.n, sizeof *es.v, cmp_hash) != NULL;
      /* A leftover file named by the problem: a chunk problem names its
       * path under chunks/, any other its name in data/. */
      kvt_cache_name_stat_info st = KVT_CACHE_NAME_STAT_INIT;
      int area = strncmp(p->kind, "chunk-", 6) ? KVT_CACHE_AREA_DATA
                                               : KVT_CACHE_AREA_CHUNKS;
      int there = inflight_kind(p->kind) &&
                  kvt_cache_name_stat(&st, dir, area, p->hash) == 0;
      if (is_stray(p->kind)) {
        keep = 1;
      } else if (inflight_kind(p->kind) && !there) {
        keep = 0; /* gone by now (renamed into place or removed) */
      } else if (writer && inflight_kind(p->kind) &&
                 (double)time(NULL) - st.mtime < RECHECK_INFLIGHT_S) {
        keep = 0; /* the live writer's, most likely in flight */
      } else if (!strncmp(p->kind, "chunk-", 6)) {
        keep = same_problem(&fresh, p);
      } else if (!strcmp(p->kind, "stale-tmp")) {
        keep = there;
      } else if (!strcmp(p->kind, "orphan")) {
        keep = there && !has_row;
      } else if (cli_is_hex64(p->hash) && c.tier) {
        /* An entry: gone from the index now (evicted, removed, replaced
         * by a chained version...) or good now: not a problem. */
        int r = has_row ? kvt_tier_verify(c.tier, p->hash, 0) : 0;
        keep = has_row && r != 0;
        if (keep)
          snprintf(p->detail, sizeof p->detail, "%s", kvt_last_error());
      }
      if (keep)
        ps->v[w++] = *p;
      else
        dropped++;
    }
    ps->n = w;
    free(fresh.v);
    cli_entries_free(&es);
    cli_cache_close(&c);
    if (!dropped)
      return;
  }
}

/* kvt_cache_dir_list over data/: each name that has no business there. */
typedef struct data_walk {
  problems *ps;
  const cli_entries *es;
} data_walk;

static int data_name(void *ctx, const char *n, int kind) {
  data_walk *w = ctx;
  if (kind == KVT_CACHE_NAME_TMP) {
    add_problem(w->ps, n, "stale-tmp",
                "unfinished write left behind (removed by reconcile)");
  } else if (kind == KVT_CACHE_NAME_STRAY) {
    add_problem(w->ps, n, "stray", "unexpected name in data/ (left alone)");
  } else {
    kvt_entry_info key;
    memset(&key, 0, sizeof key);
    snprintf(key.token_hash, sizeof key.token_hash, "%s", n);
    if (!cli_bsearch(&key, w->es->v, w->es->n, sizeof *w->es->v, cmp_hash))
      add_problem(w->ps, n, "orphan", "entry directory without an index row");
  }
  return 0;
}

int cmd_verify(int argc, char **argv) {
  cli_flag f[] = {{"json", 0},
                  {"repair", 0},
                  {"no-progress", 0},
                  {"verbose", 0},
                  CLI_REMOTE_FLAGS};
  const size_t nf = sizeof f / sizeof f[0];
  const char *pos[1] = {NULL};
  int rc = cli_begin("verify", VERIFY_HELP, "missing DIR", argc, argv, f, nf,
                     pos, 0, 1);
  if (rc != CLI_RUN)
    return rc;
  int json = cli_flag_get(f, nf, "json")->set;
  int repair = cli_flag_get(f, nf, "repair")->set;
  cli_remote_args ra;
  if (cli_remote_args_get(&ra, f, nf))
    return cli_remote("verify", &ra, json, 0,
                      cli_flag_get(f, nf, "verbose")->set);
  if ((rc = cli_need_dir("verify", VERIFY_HELP, pos[0])) != CLI_RUN)
    return rc;
  unsigned flags = KVT_OPEN_NO_RECONCILE | (repair ? 0 : KVT_OPEN_READONLY);
  cli_cache c;
  cli_entries es;
  rc = cli_cache_open_list(&c, &es, pos[0], flags, json, "verify",
                           cli_flag_get(f, nf, "verbose")->set);
  if (rc)
    return rc;
  problems ps = {0};
  size_t ok = 0, failed_checks = 0, repaired = 0;
  int progress = !cli_flag_get(f, nf, "no-progress")->set;
  /* index.db itself (SQLite's quick_check): damage costs no entry - the
   * tier serves from memory, and a writable close (--repair) sets the file
   * aside so the next open rebuilds it from the entry directories. */
  if (c.tier) {
    int irc = kvt_tier_check_index(c.tier);
    if (irc == KVT_ECORRUPT) {
      problem *p = add_problem(&ps, "index.db", "corrupt", kvt_last_error());
      if (p && repair) {
        p->action = "set aside; rebuilt from the entries at the next open";
        repaired++;
      }
    } else if (irc != 0) {
      fprintf(stderr, "kvtier verify: cannot check index.db: %s\n",
              kvt_last_error());
      failed_checks++;
    }
  }
  /* Chunks first (chunked store): a bad chunk and every chain through it
   * are quarantined (entries included) before the entries are checked, so
   * the entry pass never removes chunks itself. */
  size_t ck_checked = 0, ck_ok = 0, ck_rep = 0, ck_failed = 0;
  if (c.tier) {
    int crc = cli_verify_chunks(c.tier, repair, progress, problem_cb, &ps,
                                &ck_checked, &ck_ok, &ck_rep, &ck_failed);
    if (crc != 0) {
      fprintf(stderr, "kvtier verify: cannot list chunks: %s\n",
              kvt_last_error());
      failed_checks++;
    }
    repaired += ck_rep;
    failed_checks += ck_failed;
    if (ck_rep) { /* entries through bad chunks are gone: list again */
      cli_entries_free(&es);
      if ((rc = cli_entries_load_or_fail(&es, &c, json, "verify")) != 0) {
        free(ps.v);
        return rc;
      }
    }
  }
  cli_qsort(es.v, es.n, sizeof *es.v, cmp_hash);
  cli_progress pg;
  cli_progress_start(&pg, repair ? "repairing" : "verifying", es.n, progress);
  for (size_t i = 0; i < es.n; i++) {
    const char *h = es.v[i].token_hash;
    int r = kvt_tier_verify(c.tier, h, repair);
    cli_progress_update(&pg, i + 1);
    if (r == 0) {
      ok++;
      continue;
    }
    const char *kind = r == KVT_ECORRUPT    ? "corrupt"
                       : r == KVT_ENOTFOUND ? "missing"
                       : r == KVT_EPERM     ? "unsafe"
                       : r == KVT_EIO       ? "io-error"
                                            : "error";
    problem *p = add_problem(&ps, h, kind, kvt_last_error());
    if (!p)
      continue;
    kvt_chunk_info *chain = NULL;
    size_t nchain = 0;
    if (repair && r == KVT_ECORRUPT &&
        kvt_tier_entry_chain(&chain, &nchain, NULL, c.tier, h, 0) == 0) {
      /* Still stored: the damage was a chunk of its chain, moved aside
       * alone; the entry serves again once the chunk is written again. */
      p->action = "kept (damaged chunk quarantined)";
      repaired++;
    } else if (repair && (r == KVT_ECORRUPT || r == KVT_EPERM)) {
      p->action = "quarantined";
      repaired++;
    } else if (repair && r == KVT_ENOTFOUND) {
      p->action = "row dropped"; /* by the reconcile below */
    } else if (r != KVT_ECORRUPT && r != KVT_ENOTFOUND && r != KVT_EPERM &&
               r != KVT_EIO) {
      failed_checks++;
    }
    kvt_free(chain);
  }
  cli_progress_end(&pg);

  /* data/ against the index: names that should not be there. */
  size_t orphans_before = ps.n;
  data_walk dw = {&ps, &es};
  int lrc = c.empty ? 0 : kvt_cache_dir_list(c.dir, 0, data_name, &dw);
  int unlisted = lrc != 0 && lrc != KVT_ENOTFOUND;
  if (lrc == KVT_ENOTFOUND) {
    if (c.tier && es.n > 0)
      add_problem(&ps, "data/", "missing", "data/ directory is missing");
  } else if (lrc != 0) {
    /* A read-only open does not list data/: a directory it cannot read
     * (permissions, an I/O error, replaced since) shows up only here, and
     * the comparison with the index did not run - never a clean verify. */
    char why[600];
    snprintf(why, sizeof why, "cannot list data/: %s (%s)", kvt_last_error(),
             kvt_strerror(lrc));
    fprintf(stderr, "kvtier verify: %s\n", why);
    add_problem(&ps, "data/", "unlistable", why);
    failed_checks++;
  }

  /* chunks/ against the chain table: stale *.tmp files and orphans (a dry
   * run of kvt_tier_chunk_gc; with --repair the real one, after reconcile
   * below). */
  size_t chunk_files_at = ps.n;
  kvt_chunk_gc_result cg;
  if (c.tier && !repair &&
      cli_clean_chunks(c.tier, 1, progress, problem_cb, &ps, &cg) != 0) {
    fprintf(stderr, "kvtier verify: cannot scan chunks/: %s\n",
            kvt_last_error());
    failed_checks++;
  }

  /* Beside a live writer: only what a fresh look still finds. */
  if (!repair && c.tier)
    recheck(c.dir, &ps, json, cli_flag_get(f, nf, "verbose")->set);

  int64_t reconciled = 0;
  int reconcile_failed = 0;
  if (repair && c.tier) {
    reconciled = kvt_tier_reconcile(c.tier);
    if (reconciled < 0) {
      reconcile_failed = 1;
      fprintf(stderr, "kvtier verify: reconcile failed: %s\n",
              kvt_last_error());
      reconciled = 0;
    } else {
      /* Orphans are adopted when valid and quarantined when not (never
       * deleted for lack of a row); stale temporaries are removed. */
      for (size_t i = orphans_before; i < ps.n; i++)
        if (strcmp(ps.v[i].kind, "stray") != 0)
          ps.v[i].action = strcmp(ps.v[i].kind, "orphan") == 0
                               ? "adopted or quarantined"
                               : "removed";
      for (size_t i = 0; i < orphans_before; i++)
        if (strcmp(ps.v[i].kind, "missing") == 0)
          repaired++;
      for (size_t i = orphans_before; i < ps.n; i++)
        if (strcmp(ps.v[i].kind, "stray") != 0)
          repaired++;
    }
    /* chunks/: orphans adopted or removed, stale tmps removed. */
    chunk_files_at = ps.n;
    if (cli_clean_chunks(c.tier, 0, progress, problem_cb, &ps, &cg) != 0) {
      fprintf(stderr, "kvtier verify: cleaning chunks/ failed: %s\n",
              kvt_last_error());
      reconcile_failed = 1;
    }
    for (size_t i = chunk_files_at; i < ps.n; i++)
      if (!is_stray(ps.v[i].kind))
        repaired++;
  }
  /* Stray names are reported but are not the cache's business to delete;
   * they do not make the cache bad. */
  size_t real = 0;
  for (size_t i = 0; i < ps.n; i++)
    if (!is_stray(ps.v[i].kind))
      real++;
  int code = CLI_OK;
  if (real)
    code = CLI_PROBLEMS;
  if (failed_checks || reconcile_failed || (repair && repaired < real))
    code = CLI_FAILED;

  if (json) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "dir", c.dir);
    cJSON_AddBoolToObject(o, "repair", repair);
    cJSON_AddNumberToObject(o, "checked", (double)es.n);
    cJSON_AddNumberToObject(o, "ok", (double)ok);
    cJSON_AddNumberToObject(o, "chunks_checked", (double)ck_checked);
    cJSON_AddNumberToObject(o, "chunks_ok", (double)ck_ok);
    problems_json(o, "problems", "entry", &ps);
    cJSON_AddNumberToObject(o, "repaired", (double)repaired);
    cJSON_AddNumberToObject(o, "reconciled", (double)reconciled);
    cJSON_AddBoolToObject(o, "clean", real == 0);
    cJSON_AddNumberToObject(o, "exit_code", code);
    cli_json_print(o);
  } else {
    if (ps.n) {
      problems_table(&ps, "ENTRY");
      printf("\n");
    }
    printf("checked %zu entries in %s: %zu ok, %zu problem%s", es.n, c.dir, ok,
           real, real == 1 ? "" : "s");
    if (repair)
      printf(", %zu repaired, %lld cleaned by reconcile", repaired,
             (long long)reconciled);
    printf("\n");
    if (ck_checked)
      printf("checked %zu chunks: %zu ok\n", ck_checked, ck_ok);
    if (real && !repair && !unlisted) /* a repair could not list it either */
      printf("run `kvtier verify %s --repair` to quarantine bad entries and "
             "reconcile\n",
             c.dir);
  }
  free(ps.v);
  cli_entries_free(&es);
  cli_cache_close(&c);
  return code;
}

/* ---- gc ----------------------------------------------------------------- */

static const char *GC_HELP =
    "usage: kvtier gc DIR|--remote URL [--max-size SIZE] [--max-entries N]\n"
    "                     [--older-than DURATION] [--chunks] [--dry-run] "
    "[--json]\n"
    "\n"
    "Applies limits and retention now (kvt_tier_gc) and reports which\n"
    "entries were removed, then cleans chunks/ (the chunked store): stale\n"
    "*.tmp files are removed, chunk files without an index row (orphans)\n"
    "are adopted when valid and their parent is stored, else removed. At\n"
    "least one limit (or --chunks) is required; a limit not given is not\n"
    "applied.\n"
    "\n"
    "  --max-size SIZE          evict least recently used entries until the\n"
    "                           bytes on disk are <= SIZE (10G, 512M, 1.5T,\n"
    "                           4096; K/M/G/T are powers of 1024)\n"
    "  --max-entries N          ... until at most N entries remain\n"
    "  --older-than DURATION    remove entries written more than DURATION ago\n"
    "                           (7d, 12h, 30m, 45s, 1h30m; plain = seconds)\n"
    "  --chunks                 only clean chunks/ (no limits needed)\n"
    "  --dry-run                report what would be removed, remove nothing\n"
    "  --json                   JSON output: {dir, dry_run, removed_count,\n"
    "                           removed_bytes, removed: [...], remaining}\n"
    "\n" CLI_REMOTE_HELP "\n"
    "Expired entries go first, then least recently used ones (in a remote\n"
    "store, which keeps no access times: the oldest written). A remote gc\n"
    "deletes from the shared store: every node sees the entries gone.\n";

typedef struct gc_pick {
  kvt_entry_info info;
  const char *reason; /* "expired" or "capacity" */
} gc_pick;

static int cmp_lru(const void *pa, const void *pb) {
  const kvt_entry_info *a = pa, *b = pb;
  if (a->accessed_at != b->accessed_at)
    return a->accessed_at < b->accessed_at ? -1 : 1;
  return strcmp(a->token_hash, b->token_hash);
}

int cmd_gc(int argc, char **argv) {
  cli_flag f[] = {{"json", 0},       {"max-size", 1}, {"max-entries", 1},
                  {"older-than", 1}, {"dry-run", 0},  {"verbose", 0},
                  {"chunks", 0},     CLI_REMOTE_FLAGS};
  const size_t nf = sizeof f / sizeof f[0];
  const char *pos[1] = {NULL};
  int rc =
      cli_begin("gc", GC_HELP, "missing DIR", argc, argv, f, nf, pos, 0, 1);
  if (rc != CLI_RUN)
    return rc;
  int json = cli_flag_get(f, nf, "json")->set;
  int dry = cli_flag_get(f, nf, "dry-run")->set;
  kvt_gc_opts go = KVT_GC_OPTS_INIT;
  const char *v;
  int any = 0;
  uint64_t max_bytes = UINT64_MAX, max_entries = UINT64_MAX;
  int64_t older = -1;
  if ((v = cli_flag_get(f, nf, "max-size")->value)) {
    if (cli_parse_size(v, &max_bytes) != 0 || max_bytes == 0)
      return cli_fail(json, "gc", CLI_USAGE,
                      "--max-size needs a size > 0 like 10G or 512M, got '%s'",
                      v);
    go.max_bytes = max_bytes;
    any = 1;
  }
  if ((v = cli_flag_get(f, nf, "max-entries")->value)) {
    if (cli_parse_u64(v, &max_entries) != 0 || max_entries == 0 ||
        max_entries > (uint64_t)INT64_MAX / 8)
      return cli_fail(json, "gc", CLI_USAGE,
                      "--max-entries needs a number >= 1, got '%s'", v);
    go.max_entries = (int64_t)max_entries;
    any = 1;
  }
  if ((v = cli_flag_get(f, nf, "older-than")->value)) {
    if (cli_parse_duration(v, &older) != 0 || older <= 0)
      return cli_fail(json, "gc", CLI_USAGE,
                      "--older-than needs a duration > 0 like 7d, 12h, 30m "
                      "or 45s, got '%s'",
                      v);
    go.older_than_seconds = older;
    any = 1;
  }
  int chunks_only = !any && cli_flag_get(f, nf, "chunks")->set;
  if (!any && !chunks_only)
    return cli_fail(json, "gc", CLI_USAGE,
                    "give at least one of --max-size, --max-entries, "
                    "--older-than, --chunks");
  go.dry_run = dry;
  cli_remote_args ra;
  if (cli_remote_args_get(&ra, f, nf)) {
    if (chunks_only)
      return cli_fail(json, "gc", CLI_USAGE,
                      "--chunks cleans a DIR's chunks/, not --remote");
    return cli_remote_gc(&ra, max_bytes, max_entries, older, dry, json);
  }
  if ((rc = cli_need_dir("gc", GC_HELP, pos[0])) != CLI_RUN)
    return rc;

  cli_cache c;
  /* A dry run changes nothing: read-only when the library allows gc there,
   * else read-write without reconcile (see below). */
  unsigned flags = KVT_OPEN_NO_RECONCILE | (dry ? KVT_OPEN_READONLY : 0);
  int verbose = cli_flag_get(f, nf, "verbose")->set;
  cli_entries before;
  rc = cli_cache_open_list(&c, &before, pos[0], flags, json, "gc", verbose);
  if (rc)
    return rc;
  double now = cli_now();
  uint64_t removed = 0, removed_bytes = 0;
  if (c.tier && !chunks_only) {
    rc = kvt_tier_gc(c.tier, &go, &removed, &removed_bytes);
    if (rc != 0 && dry && (rc == KVT_EINVAL || rc == KVT_EUNSUPPORTED)) {
      /* This build does not run gc on a read-only tier; a dry run is still
       * harmless on a writable one. */
      cli_cache_close(&c);
      rc = cli_cache_open(&c, pos[0], KVT_OPEN_NO_RECONCILE, json, "gc",
                          verbose);
      if (rc) {
        cli_entries_free(&before);
        return rc;
      }
      rc = kvt_tier_gc(c.tier, &go, &removed, &removed_bytes);
    }
    if (rc != 0) {
      char msg[1024];
      snprintf(msg, sizeof msg, "%s", kvt_last_error());
      cli_entries_free(&before);
      cli_cache_close(&c);
      return cli_fail(json, "gc", CLI_FAILED, "gc failed: %s (%s)", msg,
                      kvt_strerror(rc));
    }
  }
  /* Which entries: after a real run, exactly those no longer listed; for a
   * dry run, the same policy simulated over the listing (expired first,
   * then least recently used until within the limits). */
  gc_pick *picks = calloc(before.n ? before.n : 1, sizeof *picks);
  size_t npick = 0;
  size_t remaining = before.n;
  if (!dry) {
    cli_entries after;
    if ((rc = cli_entries_load_or_fail(&after, &c, json, "gc")) != 0) {
      free(picks);
      cli_entries_free(&before);
      return rc;
    }
    cli_qsort(after.v, after.n, sizeof *after.v, cmp_hash);
    for (size_t i = 0; i < before.n; i++)
      if (!cli_bsearch(&before.v[i], after.v, after.n, sizeof *after.v,
                       cmp_hash)) {
        picks[npick].info = before.v[i];
        picks[npick].reason =
            older > 0 && before.v[i].created_at < now - (double)older
                ? "expired"
                : "capacity";
        npick++;
      }
    remaining = after.n;
    cli_entries_free(&after);
  } else {
    cli_qsort(before.v, before.n, sizeof *before.v, cmp_lru);
    uint64_t count = before.n, bytes = 0;
    for (size_t i = 0; i < before.n; i++)
      bytes += before.v[i].disk_bytes;
    char *gone = calloc(before.n ? before.n : 1, 1);
    for (size_t i = 0; gone && older > 0 && i < before.n; i++)
      if (before.v[i].created_at < now - (double)older) {
        gone[i] = 1;
        count--;
        bytes -= before.v[i].disk_bytes;
        picks[npick].info = before.v[i];
        picks[npick++].reason = "expired";
      }
    for (size_t i = 0; gone && i < before.n; i++) {
      if (count <= max_entries && bytes <= max_bytes)
        break;
      if (gone[i])
        continue;
      gone[i] = 1;
      count--;
      bytes -= before.v[i].disk_bytes;
      picks[npick].info = before.v[i];
      picks[npick++].reason = "capacity";
    }
    free(gone);
    remaining = (size_t)count;
    if (!c.tier)
      removed = 0;
    if (c.tier && removed != npick)
      fprintf(stderr,
              "kvtier gc: note: the library counts %llu entries to remove, "
              "the listing below %zu\n",
              (unsigned long long)removed, npick);
  }
  /* chunks/: stale *.tmp files and orphans (kvt_tier_chunk_gc), after the
   * limits (whose evictions may leave nothing for it, or unlink-failures). */
  problems cps = {0};
  kvt_chunk_gc_result cg;
  memset(&cg, 0, sizeof cg);
  if (c.tier && cli_clean_chunks(c.tier, dry, 1, problem_cb, &cps, &cg) != 0) {
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", kvt_last_error());
    free(cps.v);
    free(picks);
    cli_entries_free(&before);
    cli_cache_close(&c);
    return cli_fail(json, "gc", CLI_FAILED, "cleaning chunks/ failed: %s", msg);
  }
  if (chunks_only)
    npick = 0, removed = 0, removed_bytes = 0;
  if (!c.tier || !dry) {
    /* Counts from the listing when the library gave none. */
    if (!removed && npick) {
      removed = npick;
      for (size_t i = 0; i < npick; i++)
        removed_bytes += picks[i].info.disk_bytes;
    }
  }
  if (json) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "dir", c.dir);
    cJSON_AddBoolToObject(o, "dry_run", dry);
    cJSON_AddNumberToObject(o, "removed_count", (double)removed);
    cJSON_AddNumberToObject(o, "removed_bytes", (double)removed_bytes);
    cJSON *arr = cJSON_AddArrayToObject(o, "removed");
    for (size_t i = 0; i < npick; i++) {
      cJSON *p = cJSON_CreateObject();
      cJSON_AddStringToObject(p, "token_hash", picks[i].info.token_hash);
      cJSON_AddNumberToObject(p, "num_tokens",
                              (double)picks[i].info.num_tokens);
      cJSON_AddNumberToObject(p, "disk_bytes",
                              (double)picks[i].info.disk_bytes);
      cJSON_AddNumberToObject(p, "created_at", picks[i].info.created_at);
      cJSON_AddNumberToObject(p, "accessed_at", picks[i].info.accessed_at);
      cJSON_AddStringToObject(p, "reason", picks[i].reason);
      cJSON_AddItemToArray(arr, p);
    }
    cJSON_AddNumberToObject(o, "remaining", (double)remaining);
    cJSON *ck = cJSON_AddObjectToObject(o, "chunks");
    cJSON_AddNumberToObject(ck, "tmp_removed", (double)cg.tmp_removed);
    cJSON_AddNumberToObject(ck, "adopted", (double)cg.adopted);
    cJSON_AddNumberToObject(ck, "removed", (double)cg.removed);
    cJSON_AddNumberToObject(ck, "stray", (double)cg.stray);
    cJSON_AddNumberToObject(ck, "bytes_freed", (double)cg.bytes_freed);
    problems_json(ck, "files", "path", &cps);
    cli_json_print(o);
  } else {
    if (npick) {
      static const char *heads[] = {"HASH",    "TOKENS",   "DISK",
                                    "CREATED", "ACCESSED", "REASON"};
      cli_table t;
      cli_table_init(&t, 6, heads, "lrrlll");
      for (size_t i = 0; i < npick; i++) {
        char tok[32], disk[32], cr[32], ac[32];
        snprintf(tok, sizeof tok, "%llu",
                 (unsigned long long)picks[i].info.num_tokens);
        const char *row[6] = {
            picks[i].info.token_hash,
            tok,
            cli_fmt_bytes(disk, sizeof disk, picks[i].info.disk_bytes),
            cli_fmt_time(cr, sizeof cr, picks[i].info.created_at),
            cli_fmt_time(ac, sizeof ac, picks[i].info.accessed_at),
            picks[i].reason};
        cli_table_add(&t, row);
      }
      cli_table_print(&t, stdout);
      printf("\n");
      cli_table_free(&t);
    }
    char b[32];
    printf("%s %llu entries (%s); %zu remain\n",
           dry ? "would remove" : "removed", (unsigned long long)removed,
           cli_fmt_bytes(b, sizeof b, removed_bytes), remaining);
    if (cps.n) {
      printf("\n");
      problems_table(&cps, "FILE");
    }
    if (c.tier)
      printf("chunks/ %s %llu stale tmp, %s %llu orphans, %s %llu "
             "unreachable or damaged (%s)\n",
             dry ? "would remove" : "removed",
             (unsigned long long)cg.tmp_removed,
             dry ? "would adopt" : "adopted", (unsigned long long)cg.adopted,
             dry ? "would remove" : "removed", (unsigned long long)cg.removed,
             cli_fmt_bytes(b, sizeof b, cg.bytes_freed));
  }
  free(cps.v);
  free(picks);
  cli_entries_free(&before);
  cli_cache_close(&c);
  return CLI_OK;
}

/* ---- reindex ------------------------------------------------------------ */

static const char REINDEX_HELP[] =
    "usage: kvtier reindex DIR [--json] [--verbose]\n"
    "\n"
    "Rebuilds DIR's index from its entry directories: index.db is set aside\n"
    "as index.db.reindexed-<time> (kept, never deleted), every valid entry is\n"
    "adopted (its row rebuilt from its manifest and tokens, created_at from\n"
    "the directory's time) and every invalid one quarantined. Nothing is\n"
    "deleted. Opening a cache does the same by itself when index.db is\n"
    "missing or damaged; reindex forces it (e.g. after restoring data/ from a\n"
    "backup). Needs the directory writable and no other writer.\n"
    "\n"
    "  --json      JSON output: {dir, entries, quarantined}\n"
    "  --verbose   log what is adopted and quarantined to stderr\n";

int cmd_reindex(int argc, char **argv) {
  cli_flag f[] = {{"json", 0}, {"verbose", 0}};
  const size_t nf = sizeof f / sizeof f[0];
  const char *pos[1];
  int rc = cli_begin("reindex", REINDEX_HELP, "missing DIR", argc, argv, f, nf,
                     pos, 1, 1);
  if (rc != CLI_RUN)
    return rc;
  int json = cli_flag_get(f, nf, "json")->set;
  int verbose = cli_flag_get(f, nf, "verbose")->set;
  cli_cache c;
  rc = cli_cache_open(&c, pos[0], KVT_OPEN_REINDEX, json, "reindex", verbose);
  if (rc != 0)
    return rc;
  kvt_stats s = KVT_STATS_INIT;
  if (c.tier)
    kvt_tier_stats(&s, c.tier);
  if (json) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "dir", c.dir);
    cJSON_AddNumberToObject(o, "entries", (double)s.entries);
    cJSON_AddNumberToObject(o, "quarantined", (double)s.quarantined);
    cli_json_print(o);
  } else {
    printf("reindexed %s: %llu entries, %llu quarantined\n", c.dir,
           (unsigned long long)s.entries, (unsigned long long)s.quarantined);
  }
  cli_cache_close(&c);
  return CLI_OK;
}
