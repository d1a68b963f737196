/*
 * cmd_remote.c - `kvtier ls|stats|verify --remote URL [--remote-prefix P]`:
 * the same three inspections on a shared remote store (Redis / Valkey) instead
 * of a cache directory. The store is opened through a throw-away tier in
 * remote-only mode on a private temporary directory (removed afterwards), and
 * read only through the public API (kvt_tier_remote_foreach /
 * kvt_tier_remote_verify). verify removes incomplete or damaged entries, as
 * every remote reader does.
 */
#define _XOPEN_SOURCE 700
#include "cli.h"

#include <ftw.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int rm_one(const char *p, const struct stat *st, int type,
                  struct FTW *f) {
  (void)st;
  (void)type;
  (void)f;
  remove(p);
  return 0;
}

static int by_created(const void *a, const void *b) {
  double x = ((const kvt_entry_info *)a)->created_at,
         y = ((const kvt_entry_info *)b)->created_at;
  return x < y ? 1 : x > y ? -1 : 0;
}

int cli_remote(const char *cmd, const char *url, const char *prefix, int json,
               int prom, int verbose) {
  (void)verbose;
  char tmp[] = "/tmp/kvtier-cli-remote-XXXXXX";
  if (!mkdtemp(tmp))
    return cli_fail(json, cmd, CLI_FAILED,
                    "mkdtemp: cannot create a "
                    "temporary directory");
  kvt_options o;
  kvt_options_init(&o, KVT_OPTIONS_VERSION);
  o.cache_dir = tmp;
  o.durability = KVT_DURABILITY_NONE;
  o.remote_url = url;
  o.remote_mode = KVT_REMOTE_ONLY;
  o.remote_prefix = prefix;
  o.remote_timeout_ms = 5000;
  kvt_tier *t = NULL;
  int code = CLI_OK;
  int rc = kvt_tier_open(&t, &o);
  cli_entries es = {0};
  if (rc != 0) {
    code = cli_fail(json, cmd, rc == KVT_EINVAL ? CLI_USAGE : CLI_NOOPEN,
                    "%s: %s (%s)", url, kvt_last_error(), kvt_strerror(rc));
    goto out;
  }
  rc = kvt_tier_remote_foreach(t, cli_entries_collect, &es);
  if (rc != 0) {
    code = cli_fail(json, cmd, CLI_NOOPEN, "%s: cannot list the store: %s", url,
                    kvt_last_error());
    goto out;
  }
  qsort(es.v, es.n, sizeof *es.v, by_created);
  uint64_t stored = 0, memory = 0, tokens = 0;
  for (size_t i = 0; i < es.n; i++) {
    stored += es.v[i].disk_bytes;
    memory += es.v[i].memory_bytes;
    tokens += es.v[i].num_tokens;
  }
  char b1[64], b2[64], b3[64];
  if (strcmp(cmd, "ls") == 0) {
    if (json) {
      cJSON *root = cJSON_CreateObject();
      cJSON_AddStringToObject(root, "remote", url);
      cJSON_AddStringToObject(root, "prefix", prefix ? prefix : "kvt:");
      cJSON *arr = cJSON_AddArrayToObject(root, "entries");
      for (size_t i = 0; i < es.n; i++) {
        cJSON *e = cJSON_CreateObject();
        cJSON_AddStringToObject(e, "token_hash", es.v[i].token_hash);
        cJSON_AddNumberToObject(e, "num_tokens", (double)es.v[i].num_tokens);
        cJSON_AddNumberToObject(e, "stored_bytes", (double)es.v[i].disk_bytes);
        cJSON_AddNumberToObject(e, "memory_bytes",
                                (double)es.v[i].memory_bytes);
        cJSON_AddStringToObject(e, "created",
                                cli_fmt_iso(b1, sizeof b1, es.v[i].created_at));
        cJSON_AddItemToArray(arr, e);
      }
      cli_json_print(root);
    } else {
      static const char *heads[] = {"HASH", "TOKENS", "STORED", "MEMORY",
                                    "CREATED"};
      cli_table tb;
      cli_table_init(&tb, 5, heads, "lrrrl");
      for (size_t i = 0; i < es.n; i++) {
        char h[20], n[32];
        snprintf(h, sizeof h, "%.16s", es.v[i].token_hash);
        snprintf(n, sizeof n, "%llu", (unsigned long long)es.v[i].num_tokens);
        const char *row[] = {h, n,
                             cli_fmt_bytes(b1, sizeof b1, es.v[i].disk_bytes),
                             cli_fmt_bytes(b2, sizeof b2, es.v[i].memory_bytes),
                             cli_fmt_time(b3, sizeof b3, es.v[i].created_at)};
        cli_table_add(&tb, row);
      }
      cli_table_print(&tb, stdout);
      cli_table_free(&tb);
      printf("%zu entries, %s stored in %s\n", es.n,
             cli_fmt_bytes(b1, sizeof b1, stored), url);
    }
  } else if (strcmp(cmd, "stats") == 0) {
    if (prom) {
      printf("# HELP kvtier_remote_entries Entries in the remote store.\n"
             "# TYPE kvtier_remote_entries gauge\nkvtier_remote_entries %zu\n"
             "# HELP kvtier_remote_stored_bytes Bytes stored remotely.\n"
             "# TYPE kvtier_remote_stored_bytes gauge\n"
             "kvtier_remote_stored_bytes %llu\n"
             "# HELP kvtier_remote_memory_bytes Sum of the entries' RAM "
             "estimates.\n# TYPE kvtier_remote_memory_bytes gauge\n"
             "kvtier_remote_memory_bytes %llu\n",
             es.n, (unsigned long long)stored, (unsigned long long)memory);
    } else if (json) {
      cJSON *root = cJSON_CreateObject();
      cJSON_AddStringToObject(root, "remote", url);
      cJSON_AddStringToObject(root, "prefix", prefix ? prefix : "kvt:");
      cJSON_AddNumberToObject(root, "entries", (double)es.n);
      cJSON_AddNumberToObject(root, "stored_bytes", (double)stored);
      cJSON_AddNumberToObject(root, "memory_bytes", (double)memory);
      cJSON_AddNumberToObject(root, "tokens", (double)tokens);
      cli_json_print(root);
    } else {
      printf("remote store   %s (prefix %s)\n", url, prefix ? prefix : "kvt:");
      printf("entries        %zu\n", es.n);
      printf("stored         %s\n", cli_fmt_bytes(b1, sizeof b1, stored));
      printf("memory (est.)  %s\n", cli_fmt_bytes(b2, sizeof b2, memory));
      printf("tokens         %llu\n", (unsigned long long)tokens);
    }
  } else { /* verify */
    size_t bad = 0;
    cJSON *root = json ? cJSON_CreateObject() : NULL;
    cJSON *probs = root ? cJSON_AddArrayToObject(root, "problems") : NULL;
    for (size_t i = 0; i < es.n; i++) {
      int v = kvt_tier_remote_verify(t, es.v[i].token_hash);
      if (v == 0 || v == KVT_ENOTFOUND)
        continue; /* good, or gone since the listing */
      if (v != KVT_ECORRUPT) {
        code = cli_fail(json, cmd, CLI_FAILED, "%.16s: %s", es.v[i].token_hash,
                        kvt_last_error());
        cJSON_Delete(root);
        goto out;
      }
      bad++;
      if (probs) {
        cJSON *p = cJSON_CreateObject();
        cJSON_AddStringToObject(p, "token_hash", es.v[i].token_hash);
        cJSON_AddStringToObject(p, "detail", kvt_last_error());
        cJSON_AddStringToObject(p, "action", "removed");
        cJSON_AddItemToArray(probs, p);
      } else {
        printf("%.16s  corrupt  removed  %s\n", es.v[i].token_hash,
               kvt_last_error());
      }
    }
    if (root) {
      cJSON_AddNumberToObject(root, "checked", (double)es.n);
      cJSON_AddNumberToObject(root, "bad", (double)bad);
      cli_json_print(root);
    } else {
      printf("%zu entries checked in %s, %zu bad\n", es.n, url, bad);
    }
    code = bad ? CLI_PROBLEMS : CLI_OK;
  }
out:
  cli_entries_free(&es);
  kvt_tier_free(t);
  nftw(tmp, rm_one, 16, FTW_DEPTH | FTW_PHYS);
  return code;
}
