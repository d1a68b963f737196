/*
 * cli.h - shared plumbing of the kvtier command-line tool: exit codes, the
 * option parser every command uses, size/duration/time formatting, aligned
 * tables, the terminal progress bar, JSON output through cJSON, and opening a
 * cache directory with clear diagnostics. The tool uses only the public API
 * (include/kvtier.h and, for its maintenance commands, include/kvtier_sys.h)
 * plus POSIX; nothing here reaches into the library's internals, so it works
 * on any directory the library (or the reference Python implementation)
 * wrote.
 */
#ifndef KVT_CLI_H
#define KVT_CLI_H

#include "kvtier.h"
#include "kvtier_sys.h"

#include <cjson/cJSON.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* Exit codes (documented in docs/CLI.md and `kvtier --help`). */
enum {
  CLI_OK = 0,           /* success; verify: everything is good               */
  CLI_PROBLEMS = 1,     /* verify found problems (repaired with --repair)     */
  CLI_USAGE = 2,        /* bad command line                                   */
  CLI_NOOPEN = 3,       /* directory missing, unreadable or not a cache       */
  CLI_FAILED = 4,       /* the operation failed (I/O, database, repair)       */
  CLI_NOTFOUND = 5,     /* show: no such entry                                */
  CLI_INTERRUPTED = 130 /* bench: SIGINT/SIGTERM (cleaned up first)        */
};

/* ---- option parsing --------------------------------------------------- */

typedef struct cli_flag {
  const char *name;  /* long name without "--" */
  int takes_value;   /* 1: "--name VALUE" or "--name=VALUE" */
  const char *value; /* set by the parser (points into argv) */
  int set;           /* how many times seen */
} cli_flag;

/* Parses argv[0..argc) (the words after the command name). Positionals go to
 * pos (at most maxpos). "--help"/"-h" sets *help. Returns 0 or CLI_USAGE after
 * printing "kvtier CMD: ..." to stderr. */
int cli_parse(const char *cmd, int argc, char **argv, cli_flag *flags,
              size_t nflags, const char **pos, size_t maxpos, size_t *npos,
              int *help);
cli_flag *cli_flag_get(cli_flag *flags, size_t nflags, const char *name);

/* Returned by cli_begin when the command should go on (not an exit code). */
#define CLI_RUN (-1)

/* The start every command shares: cli_parse (maxpos positionals into pos),
 * then "--help" prints help to stdout (exit CLI_OK), and fewer than minpos
 * positionals print "kvtier CMD: MISSING" and the help to stderr (exit
 * CLI_USAGE; missing may be NULL when minpos is 0). Returns CLI_RUN when the
 * command should go on, else the exit code to return. */
int cli_begin(const char *cmd, const char *help, const char *missing, int argc,
              char **argv, cli_flag *flags, size_t nflags, const char **pos,
              size_t minpos, size_t maxpos);
/* For commands whose DIR is optional in cli_begin (minpos 0) because another
 * flag (--remote) can stand in for it: CLI_RUN when dir is set, else prints
 * "missing DIR" with the help and returns CLI_USAGE. */
int cli_need_dir(const char *cmd, const char *help, const char *dir);

/* One accepted word of an option whose value is one of a few names. */
typedef struct cli_choice {
  const char *name;
  int value;
} cli_choice;

/* Option --NAME whose value must be one of choices: returns 0 when it is
 * absent (*out untouched) or names a choice (*out set to its value); else
 * reports "--NAME must be EXPECTED, got 'VALUE'" (cli_fail) and returns
 * CLI_USAGE. */
int cli_flag_choice(cli_flag *flags, size_t nflags, const char *name,
                    const cli_choice *choices, size_t nchoices,
                    const char *expected, int json, const char *cmd, int *out);

/* Parsers of user values; return 0 or -1 (caller reports usage). */
int cli_parse_size(const char *s, uint64_t *out);    /* 10G, 512M, 4096 */
int cli_parse_duration(const char *s, int64_t *out); /* 7d, 12h, 1h30m, 45 */
int cli_parse_u64(const char *s, uint64_t *out);

/* ---- formatting ------------------------------------------------------- */

/* Human bytes, binary units: "1.50 GiB". buf >= 32. */
const char *cli_fmt_bytes(char *buf, size_t cap, uint64_t n);
/* Rate in decimal GB/s or MB/s: "1.62 GB/s". */
const char *cli_fmt_rate(char *buf, size_t cap, double bytes_per_s);
/* Local time "2026-11-29 08:41:07", "-" for 0. */
const char *cli_fmt_time(char *buf, size_t cap, double unix_s);
/* UTC ISO-8601 "2026-11-29T08:41:07Z". */
const char *cli_fmt_iso(char *buf, size_t cap, double unix_s);
/* Seconds as "3d 4h", "12m 5s", "850 ms". */
const char *cli_fmt_age(char *buf, size_t cap, double seconds);
double cli_now(void);  /* wall clock, Unix seconds */
double cli_mono(void); /* monotonic seconds */

/* ---- tables ----------------------------------------------------------- */

typedef struct cli_table {
  size_t ncols;
  const char **heads;
  const char *align; /* per column 'l' or 'r' */
  char **cells;      /* rows * ncols, malloc'ed strings */
  size_t rows, cap;
} cli_table;

void cli_table_init(cli_table *t, size_t ncols, const char **heads,
                    const char *align);
/* Adds one row of ncols printf-free strings (copied). */
void cli_table_add(cli_table *t, const char **cells);
void cli_table_print(const cli_table *t, FILE *f);
void cli_table_free(cli_table *t);

/* ---- progress bar (stderr, only when it is a terminal) ---------------- */

typedef struct cli_progress {
  int enabled;
  const char *label;
  uint64_t total;
  double last;
} cli_progress;

void cli_progress_start(cli_progress *p, const char *label, uint64_t total,
                        int allowed);
void cli_progress_update(cli_progress *p, uint64_t done);
void cli_progress_end(cli_progress *p);

/* ---- live counters (cmd_live.c) ---------------------------------------- */

/* DIR/stats.bin as kvt_stats_read_live returned it. */
typedef struct cli_live {
  int rc; /* 0, KVT_ENOTFOUND (no file) or another code (err says why) */
  kvt_stats s;
  kvt_stats_live lv;
  char err[256];
} cli_live;

void cli_live_read(cli_live *l, const char *dir);
/* 1 when the publisher still has the directory open. */
int cli_live_alive(const cli_live *l);
/* One phrase on where the counters come from ("live from pid N ..." or
 * "none: ..."). */
const char *cli_live_describe(const cli_live *l, char *buf, size_t cap);
/* Adds "live": {status, alive, description, pid, ..., histograms} to o. */
void cli_live_json(cJSON *o, const cli_live *l);
/* The "counters" block of the text output. */
void cli_live_print(const cli_live *l, FILE *f);
/* kvtier_live gauge and a comment naming the publisher (Prometheus text). */
void cli_live_prom(const cli_live *l, FILE *f);
/* When live: s takes the publisher's counters and gauges, keeping the
 * directory totals (entries, disk_bytes, memory_bytes) measured in s. */
void cli_live_merge(kvt_stats *s, const cli_live *l);
/* `kvtier stats DIR --watch SECONDS [--count N]`: N ticks (0: forever). */
int cli_live_watch(const char *dir, double interval, uint64_t count, int json,
                   int prom);

/* ---- JSON ------------------------------------------------------------- */

/* Prints the object formatted to stdout with a newline and deletes it. */
void cli_json_print(cJSON *obj);
/* Prints {"error": {"exit_code": code, "message": msg}} when json, and
 * "kvtier CMD: msg" on stderr always. Returns code. */
int cli_fail(int json, const char *cmd, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* cJSON number helpers tolerant of absent fields. */
double cli_jnum(const cJSON *o, const char *key, double dflt);
const char *cli_jstr(const cJSON *o, const char *key);

/* ---- opening a cache directory ---------------------------------------- */

typedef struct cli_cache {
  kvt_tier *tier; /* NULL when the directory is an empty directory */
  int empty;      /* exists, contains nothing at all: an empty cache */
  char dir[4096];
} cli_cache;

/* Checks dir (exists, is a directory, readable, looks like a cache: holds
 * index.db or data/, or is empty) and opens it with flags (KVT_OPEN_*).
 * On failure prints a clear message and returns CLI_NOOPEN (or CLI_FAILED when
 * the directory exists and is a cache but the library could not open it for
 * another reason such as KVT_EBUSY). */
int cli_cache_open(cli_cache *c, const char *dir, unsigned flags, int json,
                   const char *cmd, int verbose);
void cli_cache_close(cli_cache *c);

/* Every entry's info, in kvt_tier_foreach order (most recently used first). */
typedef struct cli_entries {
  kvt_entry_info *v;
  size_t n, cap;
} cli_entries;
int cli_entries_load(cli_entries *out, kvt_tier *t);
/* A kvt_entry_visit_fn appending each info to the cli_entries at ctx (nonzero
 * stops the walk when memory runs out). */
int cli_entries_collect(void *ctx, const kvt_entry_info *info);
void cli_entries_free(cli_entries *e);
/* cli_entries_load for a command: returns 0, or on failure frees out, closes
 * c and returns cli_fail(json, cmd, CLI_FAILED, "cannot list entries: ..."). */
int cli_entries_load_or_fail(cli_entries *out, cli_cache *c, int json,
                             const char *cmd);
/* cli_cache_open, then cli_entries_load_or_fail. Returns 0 (c open, es
 * loaded) or the exit code (nothing left to close or free). */
int cli_cache_open_list(cli_cache *c, cli_entries *es, const char *dir,
                        unsigned flags, int json, const char *cmd, int verbose);

/* ---- describe summary ------------------------------------------------- */

/* Summary of kvt_tier_describe's JSON for ls/stats, tolerant of layout. */
typedef struct cli_desc {
  int ok;
  char storage[16]; /* "native", "compat" or "?" */
  uint32_t layers;
  uint32_t kind_count[5]; /* by kvt_layer_kind (index 1..4) */
  char kinds[64];         /* "kv:32" / "kv:8,arrays:24" */
  char dtypes[64];        /* "F16" / "F16,F32" */
  char error[256];        /* when !ok */
} cli_desc;

/* Parses describe output into d. Returns 0 or -1 (d->error set). */
int cli_desc_parse(cli_desc *d, const char *json);
/* Runs kvt_tier_describe and parses. */
void cli_desc_entry(cli_desc *d, kvt_tier *t, const char *hash);
/* Layer kind from a describe/manifest layer object: 1..4 or 0 if unknown. */
int cli_layer_kind(const cJSON *layer);
const char *cli_kind_name(int kind); /* "kv", "rotating", "arrays", "quant" */

/* ---- misc ------------------------------------------------------------- */

int cli_isatty_err(void);
/* rm -rf without following symlinks, for a scratch directory the command
 * made itself (bench's fresh run directory): it removes whatever is there and
 * spells no name of the cache layout, so it is no way into a user's cache
 * (those are read through kvtier_sys.h's listing API). Returns 0 or -1. */
int cli_rmtree(const char *path);
int cli_is_hex64(const char *s);
/* qsort/bsearch that accept an empty (NULL) array. */
void cli_qsort(void *base, size_t n, size_t size,
               int (*cmp)(const void *, const void *));
void *cli_bsearch(const void *key, const void *base, size_t n, size_t size,
                  int (*cmp)(const void *, const void *));

/* The shared remote store (cmd_remote.c): --remote URL [--remote-prefix P]
 * [--remote-ca FILE] [--remote-cert FILE --remote-key FILE] instead of DIR,
 * for ls, stats, verify, show and gc. CLI_REMOTE_FLAGS go into a command's
 * flag table, CLI_REMOTE_HELP into its help text. */
#define CLI_REMOTE_FLAGS                                                       \
  {"remote", 1}, {"remote-prefix", 1}, {"remote-ca", 1}, {"remote-cert", 1}, { \
    "remote-key", 1                                                            \
  }
#define CLI_REMOTE_HELP                                                        \
  "  --remote URL    a shared remote store instead of DIR: "                   \
  "redis://host:port,\n"                                                       \
  "                  rediss:// (TLS), [user]:password@ (ACL user), comma-\n"   \
  "                  separated seeds for a cluster\n"                          \
  "  --remote-prefix P   its key prefix (default kvt:)\n"                      \
  "  --remote-ca FILE    TLS: CA certificates to trust (default: system)\n"    \
  "  --remote-cert FILE, --remote-key FILE   TLS client certificate and key\n"
typedef struct cli_remote_args {
  const char *url, *prefix, *ca, *cert, *key;
} cli_remote_args;
/* Reads the CLI_REMOTE_FLAGS; returns 1 when --remote was given. */
int cli_remote_args_get(cli_remote_args *ra, cli_flag *flags, size_t nflags);
/* ls / stats / verify. prom: stats --prometheus. */
int cli_remote(const char *cmd, const cli_remote_args *ra, int json, int prom,
               int verbose);
/* show HASH (4..64 hex digits, a unique prefix). */
int cli_remote_show(const cli_remote_args *ra, const char *hash, int json);
/* gc: oldest entries first (the store keeps no access times): expired
 * (older_than > 0) then beyond max_entries / max_bytes. */
int cli_remote_gc(const cli_remote_args *ra, uint64_t max_bytes,
                  uint64_t max_entries, int64_t older_than, int dry, int json);

/* show's HASH argument: 4..64 hex digits (CLI_RUN), else reported
 * (CLI_USAGE). */
int cli_hash_arg(const char *want, int json);
/* The one entry of es whose hash starts with want (any case): CLI_RUN and
 * *hit, else reported (ambiguous: CLI_USAGE; none in where: CLI_NOTFOUND). */
int cli_find_hash(const cli_entries *es, const char *want, const char *where,
                  int json, const kvt_entry_info **hit);
/* show's output for one entry (info + its kvt_tier_describe document):
 * where_key/where name the store ("dir" or "remote"), prefix the remote key
 * prefix (NULL for a directory), chain_tier the tier whose chain of the
 * entry to show too (NULL: none). Returns a CLI exit code. */
int cli_show_print(const char *where_key, const char *where, const char *prefix,
                   const kvt_entry_info *info, const char *djson, int json,
                   kvt_tier *chain_tier);

/* ---- the chunked native store (cmd_chunks.c) ---------------------------- */

/* Every chunk (kvt_tier_chunk_foreach) in 48 bytes - key, position,
 * sharing - sorted by key (a million chunks: 48 MB), and the totals. */
typedef struct cli_chunk_ref {
  uint8_t key[32];
  uint64_t index;
  uint32_t entries; /* entries whose chain runs through it */
} cli_chunk_ref;
typedef struct cli_chunkmap {
  cli_chunk_ref *v;
  size_t n, cap;
  kvt_chunk_totals totals;
} cli_chunkmap;
/* Loads m (t NULL: empty). 0 or a KVT_E* code. */
int cli_chunkmap_load(cli_chunkmap *m, kvt_tier *t);
/* The chunk of 64-hex key, or NULL. */
const cli_chunk_ref *cli_chunkmap_find(const cli_chunkmap *m, const char *key);
/* A chunk's key as 64 hex digits into out (65 bytes). */
void cli_chunk_hex(char out[65], const cli_chunk_ref *c);
void cli_chunkmap_free(cli_chunkmap *m);

/* An entry's chain for ls: chained (stored over a chain), its chunks, how
 * many of them other entries share too, chunk size, chunk bytes, and whether
 * the chain is complete. */
typedef struct cli_chain_sum {
  int chained, complete;
  size_t chunks, shared;
  uint32_t chunk_tokens;
  uint64_t bytes;
} cli_chain_sum;
void cli_chain_summary(cli_chain_sum *s, kvt_tier *t, const cli_chunkmap *m,
                       const char *hash);
/* chain_chunks, shared_chunks, chunk_tokens, chain_bytes, chain_complete. */
void cli_chain_summary_json(cJSON *o, const cli_chain_sum *s);
/* show: the entry's chain as a table on stdout, or "chain" in o (json). */
void cli_chain_show(kvt_tier *t, const char *hash, int json, cJSON *o);
/* stats: "chunks" and "dedup" lines, or objects in o (json). entry_bytes:
 * bytes of the entries' own files. */
void cli_chunk_stats(kvt_tier *t, uint64_t entry_bytes, int json, cJSON *o);
/* stats --prometheus: kvtier_chunks, kvtier_chunk_disk_bytes,
 * kvtier_chunk_shared, kvtier_chained_entries (gauges; nothing when t is
 * NULL). */
void cli_chunk_prom(kvt_tier *t, FILE *f);
/* (entry bytes + chain bytes counted per entry) / (entry bytes + chunk file
 * bytes): how much the sharing of chunks saves. */
double cli_dedup_ratio(const kvt_chunk_totals *t, uint64_t entry_bytes);

/* A problem found by verify/gc: name (entry hash or path), kind, detail,
 * action taken. */
typedef void (*cli_problem_fn)(void *ctx, const char *name, const char *kind,
                               const char *detail, const char *action);
/* verify's chunk pass: every chunk (chain order) through
 * kvt_tier_chunk_verify. Counts into the out-parameters (failed: checks that
 * could not run). 0 or a KVT_E* code (the listing failed). */
int cli_verify_chunks(kvt_tier *t, int repair, int progress, cli_problem_fn fn,
                      void *ctx, size_t *checked, size_t *ok, size_t *repaired,
                      size_t *failed);
/* kvt_tier_chunk_gc, each file reported through fn (kinds chunk-stale-tmp,
 * chunk-orphan, chunk-stray). */
int cli_clean_chunks(kvt_tier *t, int dry, int progress, cli_problem_fn fn,
                     void *ctx, kvt_chunk_gc_result *res);

/* Commands. argv excludes the command word. */
int cmd_ls(int argc, char **argv);
int cmd_stats(int argc, char **argv);
int cmd_show(int argc, char **argv);
int cmd_verify(int argc, char **argv);
int cmd_gc(int argc, char **argv);
int cmd_reindex(int argc, char **argv);
int cmd_bench(int argc, char **argv);

#endif
