/*
 * cli_util.c - the shared plumbing of the kvtier tool declared in cli.h:
 * option parsing, value parsers (sizes, durations), human formatting, aligned
 * tables, the stderr progress bar (drawn only on a terminal), JSON output, and
 * opening a cache directory with a clear diagnostic for every way it can be
 * wrong (missing, not a directory, unreadable, not a cache, locked). Nothing
 * here aborts: every failure becomes a message and an exit code.
 */
#define _GNU_SOURCE
#include "cli.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* ---- option parsing --------------------------------------------------- */

cli_flag *cli_flag_get(cli_flag *flags, size_t nflags, const char *name) {
  for (size_t i = 0; i < nflags; i++)
    if (strcmp(flags[i].name, name) == 0)
      return &flags[i];
  return NULL;
}

int cli_parse(const char *cmd, int argc, char **argv, cli_flag *flags,
              size_t nflags, const char **pos, size_t maxpos, size_t *npos,
              int *help) {
  size_t np = 0;
  int only_pos = 0;
  *help = 0;
  for (int i = 0; i < argc; i++) {
    const char *a = argv[i];
    if (!only_pos && strcmp(a, "--") == 0) {
      only_pos = 1;
      continue;
    }
    if (!only_pos && (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0)) {
      *help = 1;
      continue;
    }
    if (!only_pos && a[0] == '-' && a[1] == '-' && a[2]) {
      const char *name = a + 2;
      const char *eq = strchr(name, '=');
      size_t len = eq ? (size_t)(eq - name) : strlen(name);
      cli_flag *f = NULL;
      for (size_t k = 0; k < nflags; k++)
        if (strlen(flags[k].name) == len &&
            strncmp(flags[k].name, name, len) == 0)
          f = &flags[k];
      if (!f) {
        fprintf(stderr,
                "kvtier %s: unknown option '--%.*s' (see kvtier %s --help)\n",
                cmd, (int)len, name, cmd);
        return CLI_USAGE;
      }
      if (f->takes_value) {
        if (eq) {
          f->value = eq + 1;
        } else if (i + 1 < argc) {
          f->value = argv[++i];
        } else {
          fprintf(stderr, "kvtier %s: option '--%s' needs a value\n", cmd,
                  f->name);
          return CLI_USAGE;
        }
      } else if (eq) {
        fprintf(stderr, "kvtier %s: option '--%s' takes no value\n", cmd,
                f->name);
        return CLI_USAGE;
      }
      f->set++;
      continue;
    }
    if (!only_pos && a[0] == '-' && a[1]) {
      fprintf(stderr, "kvtier %s: unknown option '%s' (see kvtier %s --help)\n",
              cmd, a, cmd);
      return CLI_USAGE;
    }
    if (np >= maxpos) {
      fprintf(stderr, "kvtier %s: unexpected argument '%s'\n", cmd, a);
      return CLI_USAGE;
    }
    pos[np++] = a;
  }
  *npos = np;
  return 0;
}

int cli_begin(const char *cmd, const char *help, const char *missing, int argc,
              char **argv, cli_flag *flags, size_t nflags, const char **pos,
              size_t minpos, size_t maxpos) {
  size_t np = 0;
  int want_help = 0;
  int rc =
      cli_parse(cmd, argc, argv, flags, nflags, pos, maxpos, &np, &want_help);
  if (rc)
    return rc;
  if (want_help) {
    fputs(help, stdout);
    return CLI_OK;
  }
  if (np < minpos) {
    fprintf(stderr, "kvtier %s: %s\n%s", cmd, missing, help);
    return CLI_USAGE;
  }
  return CLI_RUN;
}

int cli_need_dir(const char *cmd, const char *help, const char *dir) {
  if (dir)
    return CLI_RUN;
  fprintf(stderr, "kvtier %s: missing DIR\n%s", cmd, help);
  return CLI_USAGE;
}

int cli_flag_choice(cli_flag *flags, size_t nflags, const char *name,
                    const cli_choice *choices, size_t nchoices,
                    const char *expected, int json, const char *cmd, int *out) {
  const char *v = cli_flag_get(flags, nflags, name)->value;
  if (!v)
    return 0;
  for (size_t i = 0; i < nchoices; i++)
    if (strcmp(v, choices[i].name) == 0) {
      *out = choices[i].value;
      return 0;
    }
  return cli_fail(json, cmd, CLI_USAGE, "--%s must be %s, got '%s'", name,
                  expected, v);
}

int cli_parse_u64(const char *s, uint64_t *out) {
  if (!s || !*s || !isdigit((unsigned char)*s))
    return -1;
  errno = 0;
  char *end = NULL;
  unsigned long long v = strtoull(s, &end, 10);
  if (errno || *end)
    return -1;
  *out = v;
  return 0;
}

int cli_parse_size(const char *s, uint64_t *out) {
  if (!s || !*s || !(isdigit((unsigned char)*s) || *s == '.'))
    return -1;
  errno = 0;
  char *end = NULL;
  double v = strtod(s, &end);
  if (errno || end == s || !(v >= 0) || !isfinite(v))
    return -1;
  double mul = 1;
  switch (toupper((unsigned char)*end)) {
  case '\0':
    break;
  case 'B':
    end++;
    break;
  case 'K':
    mul = 1024.0, end++;
    break;
  case 'M':
    mul = 1024.0 * 1024, end++;
    break;
  case 'G':
    mul = 1024.0 * 1024 * 1024, end++;
    break;
  case 'T':
    mul = 1024.0 * 1024 * 1024 * 1024, end++;
    break;
  default:
    return -1;
  }
  /* Accept "G", "GB", "GiB" (all binary). */
  if (mul > 1) {
    if (*end == 'i' || *end == 'I')
      end++;
    if (*end == 'b' || *end == 'B')
      end++;
  }
  if (*end)
    return -1;
  double r = v * mul;
  if (r >= 1.8e19)
    return -1;
  *out = (uint64_t)r;
  return 0;
}

int cli_parse_duration(const char *s, int64_t *out) {
  if (!s || !*s)
    return -1;
  double total = 0;
  const char *p = s;
  while (*p) {
    if (!(isdigit((unsigned char)*p) || *p == '.'))
      return -1;
    char *end = NULL;
    errno = 0;
    double v = strtod(p, &end);
    if (errno || end == p || !(v >= 0))
      return -1;
    double mul;
    switch (*end) {
    case '\0':
      mul = 1;
      break;
    case 's':
      mul = 1, end++;
      break;
    case 'm':
      mul = 60, end++;
      break;
    case 'h':
      mul = 3600, end++;
      break;
    case 'd':
      mul = 86400, end++;
      break;
    case 'w':
      mul = 7 * 86400, end++;
      break;
    default:
      return -1;
    }
    total += v * mul;
    p = end;
  }
  if (total > 9.2e18)
    return -1;
  *out = (int64_t)llround(total);
  return 0;
}

/* ---- formatting ------------------------------------------------------- */

const char *cli_fmt_bytes(char *buf, size_t cap, uint64_t n) {
  static const char *u[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = (double)n;
  int i = 0;
  while (v >= 1024 && i < 5)
    v /= 1024, i++;
  if (i == 0)
    snprintf(buf, cap, "%llu B", (unsigned long long)n);
  else
    snprintf(buf, cap, "%.2f %s", v, u[i]);
  return buf;
}

const char *cli_fmt_rate(char *buf, size_t cap, double bps) {
  if (bps >= 1e9)
    snprintf(buf, cap, "%.2f GB/s", bps / 1e9);
  else
    snprintf(buf, cap, "%.1f MB/s", bps / 1e6);
  return buf;
}

const char *cli_fmt_time(char *buf, size_t cap, double unix_s) {
  if (unix_s <= 0) {
    snprintf(buf, cap, "-");
    return buf;
  }
  time_t tt = (time_t)unix_s;
  struct tm tm;
  localtime_r(&tt, &tm);
  strftime(buf, cap, "%Y-%m-%d %H:%M:%S", &tm);
  return buf;
}

const char *cli_fmt_iso(char *buf, size_t cap, double unix_s) {
  time_t tt = (time_t)unix_s;
  struct tm tm;
  gmtime_r(&tt, &tm);
  strftime(buf, cap, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

const char *cli_fmt_age(char *buf, size_t cap, double s) {
  if (s < 0)
    s = 0;
  if (s < 1)
    snprintf(buf, cap, "%.0f ms", s * 1000);
  else if (s < 60)
    snprintf(buf, cap, "%.0fs", s);
  else if (s < 3600)
    snprintf(buf, cap, "%dm %ds", (int)(s / 60), (int)s % 60);
  else if (s < 86400)
    snprintf(buf, cap, "%dh %dm", (int)(s / 3600), (int)(s / 60) % 60);
  else
    snprintf(buf, cap, "%dd %dh", (int)(s / 86400), (int)(s / 3600) % 24);
  return buf;
}

double cli_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

double cli_mono(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

/* ---- tables ----------------------------------------------------------- */

void cli_table_init(cli_table *t, size_t ncols, const char **heads,
                    const char *align) {
  memset(t, 0, sizeof *t);
  t->ncols = ncols;
  t->heads = heads;
  t->align = align;
}

void cli_table_add(cli_table *t, const char **cells) {
  if (t->rows == t->cap) {
    size_t nc = t->cap ? t->cap * 2 : 16;
    char **n = realloc(t->cells, nc * t->ncols * sizeof *n);
    if (!n)
      return; /* out of memory: the row is dropped from the display */
    t->cells = n;
    t->cap = nc;
  }
  for (size_t c = 0; c < t->ncols; c++)
    t->cells[t->rows * t->ncols + c] = strdup(cells[c] ? cells[c] : "");
  t->rows++;
}

void cli_table_print(const cli_table *t, FILE *f) {
  size_t w[32] = {0};
  size_t nc = t->ncols < 32 ? t->ncols : 32;
  for (size_t c = 0; c < nc; c++) {
    w[c] = strlen(t->heads[c]);
    for (size_t r = 0; r < t->rows; r++) {
      const char *s = t->cells[r * t->ncols + c];
      size_t l = s ? strlen(s) : 0;
      if (l > w[c])
        w[c] = l;
    }
  }
  for (size_t r = 0; r <= t->rows; r++) {
    for (size_t c = 0; c < nc; c++) {
      const char *s = r == 0 ? t->heads[c] : t->cells[(r - 1) * t->ncols + c];
      if (!s)
        s = "";
      int last = c + 1 == nc;
      if (t->align[c] == 'r')
        fprintf(f, "%*s", (int)w[c], s);
      else if (last)
        fprintf(f, "%s", s);
      else
        fprintf(f, "%-*s", (int)w[c], s);
      if (!last)
        fputs("  ", f);
    }
    fputc('\n', f);
  }
}

void cli_table_free(cli_table *t) {
  for (size_t i = 0; i < t->rows * t->ncols; i++)
    free(t->cells[i]);
  free(t->cells);
  memset(t, 0, sizeof *t);
}

/* ---- progress bar ----------------------------------------------------- */

int cli_isatty_err(void) {
  return isatty(STDERR_FILENO);
}

void cli_progress_start(cli_progress *p, const char *label, uint64_t total,
                        int allowed) {
  p->enabled = allowed && cli_isatty_err() && total > 0;
  p->label = label;
  p->total = total;
  p->last = 0;
  cli_progress_update(p, 0);
}

void cli_progress_update(cli_progress *p, uint64_t done) {
  if (!p->enabled)
    return;
  double now = cli_mono();
  if (done != 0 && done < p->total && now - p->last < 0.1)
    return; /* redraw at most 10 times a second */
  p->last = now;
  const int width = 30;
  int fill = (int)(p->total ? (double)done * width / (double)p->total : 0);
  if (fill > width)
    fill = width;
  char bar[64];
  for (int i = 0; i < width; i++)
    bar[i] = i < fill ? '#' : '.';
  bar[width] = 0;
  fprintf(stderr, "\r%-14s [%s] %llu/%llu", p->label, bar,
          (unsigned long long)done, (unsigned long long)p->total);
  fflush(stderr);
}

void cli_progress_end(cli_progress *p) {
  if (!p->enabled)
    return;
  /* Erase the line so that the report starts clean. */
  fprintf(stderr, "\r%*s\r", 70, "");
  fflush(stderr);
  p->enabled = 0;
}

/* ---- JSON ------------------------------------------------------------- */

void cli_json_print(cJSON *obj) {
  char *s = cJSON_Print(obj);
  if (s) {
    fputs(s, stdout);
    fputc('\n', stdout);
    cJSON_free(s);
  }
  cJSON_Delete(obj);
}

int cli_fail(int json, const char *cmd, int code, const char *fmt, ...) {
  char msg[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  fprintf(stderr, "kvtier %s: %s\n", cmd, msg);
  if (json) {
    cJSON *o = cJSON_CreateObject();
    cJSON *e = cJSON_AddObjectToObject(o, "error");
    cJSON_AddNumberToObject(e, "exit_code", code);
    cJSON_AddStringToObject(e, "message", msg);
    cli_json_print(o);
  }
  return code;
}

double cli_jnum(const cJSON *o, const char *key, double dflt) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
  return cJSON_IsNumber(v) ? v->valuedouble : dflt;
}

const char *cli_jstr(const cJSON *o, const char *key) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
  return cJSON_IsString(v) ? v->valuestring : NULL;
}

/* ---- opening a cache directory ---------------------------------------- */

static void log_to_stderr(void *ctx, int level, const char *msg) {
  (void)ctx;
  static const char *names[] = {"debug", "info", "warning", "error"};
  fprintf(stderr, "kvtier: %s: %s\n",
          level >= 0 && level <= 3 ? names[level] : "log", msg);
}

int cli_cache_open(cli_cache *c, const char *dir, unsigned flags, int json,
                   const char *cmd, int verbose) {
  memset(c, 0, sizeof *c);
  snprintf(c->dir, sizeof c->dir, "%s", dir);
  struct stat st;
  if (stat(dir, &st) != 0) {
    if (errno == ENOENT)
      return cli_fail(json, cmd, CLI_NOOPEN, "%s: no such directory", dir);
    return cli_fail(json, cmd, CLI_NOOPEN, "%s: cannot access: %s", dir,
                    strerror(errno));
  }
  if (!S_ISDIR(st.st_mode))
    return cli_fail(json, cmd, CLI_NOOPEN,
                    "%s: not a directory (expected a kvtier cache directory)",
                    dir);
  kvt_cache_dir_probe_info pr = KVT_CACHE_DIR_PROBE_INIT;
  if (kvt_cache_dir_probe(&pr, dir) != 0)
    return cli_fail(json, cmd, CLI_NOOPEN, "%s", kvt_last_error());
  if (pr.empty) {
    c->empty = 1; /* an empty cache: nothing to open, nothing to change */
    return 0;
  }
  if (!pr.has_index && !pr.has_data)
    return cli_fail(json, cmd, CLI_NOOPEN,
                    "%s: not a kvtier cache directory (no index.db or data/)",
                    dir);
  if (!pr.has_index && (flags & KVT_OPEN_READONLY))
    return cli_fail(json, cmd, CLI_NOOPEN,
                    "%s: has data/ but no index.db: nothing to read (the "
                    "index is missing)",
                    dir);
  if (pr.has_index && pr.index_errno)
    return cli_fail(json, cmd, CLI_NOOPEN, "%s/index.db: cannot read: %s", dir,
                    strerror(pr.index_errno));
  kvt_options o;
  kvt_options_init(&o, KVT_OPTIONS_VERSION);
  o.cache_dir = dir;
  o.flags = flags;
  o.log_fn = log_to_stderr;
  o.log_level = verbose ? KVT_LOG_INFO : KVT_LOG_ERROR;
  /* Inspection and maintenance must not evict anything by themselves: the
   * limits a server configured are unknown here, so the tool opens with
   * limits no cache reaches and applies only what the user asked for. */
  o.max_size_gb = 1e6;
  o.max_entries = INT64_MAX / 4;
  o.retention_seconds = 0;
  /* The chunked store is loaded only with chunk_tokens set: always on here,
   * so chained entries are read with their chains and chunks are listed
   * whatever the serving process uses (tools read chains by parent links:
   * neither the chunk size nor the namespace has to match). */
  if (!o.chunk_tokens)
    o.chunk_tokens = KVT_CHUNK_TOKENS_DEFAULT;
  int rc = kvt_tier_open(&c->tier, &o);
  if (rc != 0) {
    c->tier = NULL;
    int code = (rc == KVT_EBUSY || rc == KVT_ENOMEM) ? CLI_FAILED : CLI_NOOPEN;
    return cli_fail(json, cmd, code, "%s: cannot open cache: %s (%s)", dir,
                    kvt_last_error()[0] ? kvt_last_error() : "",
                    kvt_strerror(rc));
  }
  return 0;
}

void cli_cache_close(cli_cache *c) {
  if (c->tier) {
    kvt_tier_close(c->tier, 30000);
    kvt_tier_free(c->tier);
  }
  c->tier = NULL;
}

int cli_entries_collect(void *ctx, const kvt_entry_info *info) {
  cli_entries *e = ctx;
  if (e->n == e->cap) {
    size_t nc = e->cap ? e->cap * 2 : 64;
    kvt_entry_info *nv = realloc(e->v, nc * sizeof *nv);
    if (!nv)
      return 1;
    e->v = nv;
    e->cap = nc;
  }
  e->v[e->n++] = *info;
  return 0;
}

int cli_entries_load(cli_entries *out, kvt_tier *t) {
  memset(out, 0, sizeof *out);
  if (!t)
    return 0;
  return kvt_tier_foreach(t, cli_entries_collect, out);
}

void cli_entries_free(cli_entries *e) {
  free(e->v);
  memset(e, 0, sizeof *e);
}

int cli_entries_load_or_fail(cli_entries *out, cli_cache *c, int json,
                             const char *cmd) {
  if (cli_entries_load(out, c->tier) == 0)
    return 0;
  cli_entries_free(out);
  cli_cache_close(c);
  return cli_fail(json, cmd, CLI_FAILED, "cannot list entries: %s",
                  kvt_last_error());
}

int cli_cache_open_list(cli_cache *c, cli_entries *es, const char *dir,
                        unsigned flags, int json, const char *cmd,
                        int verbose) {
  int rc = cli_cache_open(c, dir, flags, json, cmd, verbose);
  if (rc)
    return rc;
  return cli_entries_load_or_fail(es, c, json, cmd);
}

/* ---- describe summary ------------------------------------------------- */

const char *cli_kind_name(int kind) {
  switch (kind) {
  case KVT_LAYER_KV:
    return "kv";
  case KVT_LAYER_ROTATING_KV:
    return "rotating";
  case KVT_LAYER_ARRAYS:
    return "arrays";
  case KVT_LAYER_QUANTIZED_KV:
    return "quant";
  default:
    return "?";
  }
}

int cli_layer_kind(const cJSON *layer) {
  const cJSON *k = cJSON_GetObjectItemCaseSensitive(layer, "kind");
  if (cJSON_IsNumber(k) && k->valueint >= 1 && k->valueint <= 4)
    return k->valueint;
  const char *s = cJSON_IsString(k) ? k->valuestring : NULL;
  if (!s)
    s = cli_jstr(layer, "layer_type");
  if (!s) {
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(layer, "manifest");
    if (!m)
      m = cJSON_GetObjectItemCaseSensitive(layer, "metadata");
    s = m ? cli_jstr(m, "layer_type") : NULL;
  }
  if (!s)
    return 0;
  if (strcasestr(s, "quant"))
    return KVT_LAYER_QUANTIZED_KV;
  if (strcasestr(s, "rotat"))
    return KVT_LAYER_ROTATING_KV;
  if (strcasestr(s, "arrays") || strcasestr(s, "mamba") ||
      strcasestr(s, "state"))
    return KVT_LAYER_ARRAYS;
  if (strcasestr(s, "kv"))
    return KVT_LAYER_KV;
  return 0;
}

/* The layers array of a describe document: top-level "layers", else the
 * manifest's. */
static const cJSON *desc_layers(const cJSON *root) {
  const cJSON *l = cJSON_GetObjectItemCaseSensitive(root, "layers");
  if (cJSON_IsArray(l))
    return l;
  const cJSON *m = cJSON_GetObjectItemCaseSensitive(root, "manifest");
  l = m ? cJSON_GetObjectItemCaseSensitive(m, "layers") : NULL;
  return cJSON_IsArray(l) ? l : NULL;
}

static void add_dtype(char *list, size_t cap, const char *dt) {
  if (!dt || !*dt)
    return;
  /* list is comma separated; add dt when absent. */
  size_t l = strlen(dt);
  for (const char *p = list; *p;) {
    const char *e = strchr(p, ',');
    size_t n = e ? (size_t)(e - p) : strlen(p);
    if (n == l && strncmp(p, dt, l) == 0)
      return;
    p = e ? e + 1 : p + n;
  }
  size_t cur = strlen(list);
  snprintf(list + cur, cap - cur, "%s%s", cur ? "," : "", dt);
}

int cli_desc_parse(cli_desc *d, const char *json) {
  memset(d, 0, sizeof *d);
  snprintf(d->storage, sizeof d->storage, "?");
  cJSON *root = cJSON_Parse(json);
  if (!root) {
    snprintf(d->error, sizeof d->error, "describe returned invalid JSON");
    return -1;
  }
  const cJSON *sm = cJSON_GetObjectItemCaseSensitive(root, "storage_mode");
  if (!sm)
    sm = cJSON_GetObjectItemCaseSensitive(root, "storage");
  if (cJSON_IsString(sm))
    snprintf(d->storage, sizeof d->storage, "%s", sm->valuestring);
  else if (cJSON_IsNumber(sm))
    snprintf(d->storage, sizeof d->storage, "%s",
             sm->valueint == KVT_STORAGE_COMPAT ? "compat" : "native");
  const cJSON *layers = desc_layers(root);
  const cJSON *layer;
  cJSON_ArrayForEach(layer, layers) {
    d->layers++;
    int k = cli_layer_kind(layer);
    d->kind_count[k >= 1 && k <= 4 ? k : 0]++;
    const cJSON *ts = cJSON_GetObjectItemCaseSensitive(layer, "tensors");
    const cJSON *tv;
    cJSON_ArrayForEach(tv, ts) {
      add_dtype(d->dtypes, sizeof d->dtypes, cli_jstr(tv, "dtype"));
    }
  }
  /* A chained entry's record lists no layers (its chunks hold them) but
   * says how many: the count is num_layers, not the empty list. */
  double nl = cli_jnum(root, "num_layers", -1);
  if (nl >= 0 && (!layers || (uint32_t)nl > d->layers))
    d->layers = (uint32_t)nl;
  for (int k = 1; k <= 4; k++) {
    if (!d->kind_count[k])
      continue;
    size_t cur = strlen(d->kinds);
    snprintf(d->kinds + cur, sizeof d->kinds - cur, "%s%s:%u", cur ? "," : "",
             cli_kind_name(k), d->kind_count[k]);
  }
  if (d->kind_count[0]) {
    size_t cur = strlen(d->kinds);
    snprintf(d->kinds + cur, sizeof d->kinds - cur, "%s?:%u", cur ? "," : "",
             d->kind_count[0]);
  }
  if (!d->dtypes[0])
    snprintf(d->dtypes, sizeof d->dtypes, "?");
  cJSON_Delete(root);
  d->ok = 1;
  return 0;
}

void cli_desc_entry(cli_desc *d, kvt_tier *t, const char *hash) {
  char *json = NULL;
  int rc = kvt_tier_describe(&json, t, hash);
  if (rc != 0) {
    memset(d, 0, sizeof *d);
    snprintf(d->storage, sizeof d->storage, "?");
    snprintf(d->kinds, sizeof d->kinds, "?");
    snprintf(d->dtypes, sizeof d->dtypes, "?");
    snprintf(d->error, sizeof d->error, "%s: %s", kvt_strerror(rc),
             kvt_last_error());
    return;
  }
  cli_desc_parse(d, json);
  kvt_free(json);
}

/* ---- misc ------------------------------------------------------------- */

static int rm_cb(const char *path, const struct stat *sb, int type,
                 struct FTW *ftw) {
  (void)sb;
  (void)ftw;
  return type == FTW_DP ? rmdir(path) : unlink(path);
}

int cli_rmtree(const char *path) {
  return nftw(path, rm_cb, 16, FTW_DEPTH | FTW_PHYS) == 0 ? 0 : -1;
}

int cli_is_hex64(const char *s) {
  size_t i = 0;
  for (; s[i]; i++)
    if (!isxdigit((unsigned char)s[i]) || isupper((unsigned char)s[i]))
      return 0;
  return i == 64;
}

void cli_qsort(void *base, size_t n, size_t size,
               int (*cmp)(const void *, const void *)) {
  if (base && n > 1)
    qsort(base, n, size, cmp);
}

void *cli_bsearch(const void *key, const void *base, size_t n, size_t size,
                  int (*cmp)(const void *, const void *)) {
  return base && n ? bsearch(key, base, n, size, cmp) : NULL;
}
