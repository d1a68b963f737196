/*
 * cmd_remote.c - the CLI on a shared remote store (Redis / Valkey) instead of
 * a cache directory: `kvtier ls|stats|verify|show|gc --remote URL
 * [--remote-prefix P] [--remote-ca F] [--remote-cert F --remote-key F]`. The
 * store is opened through a throw-away tier in remote-only mode on a private
 * temporary directory (removed afterwards), and reached only through the
 * public API (kvt_tier_remote_foreach / _verify / _describe / _remove), with
 * the same URL forms, TLS and ACL credentials as the library. verify removes
 * incomplete or damaged entries, as every remote reader does; gc deletes from
 * the shared store (oldest first: the store keeps no access times).
 */
#define _XOPEN_SOURCE 700
#include "cli.h"
#include "kvtier_sys.h"

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

int cli_remote_args_get(cli_remote_args *ra, cli_flag *f, size_t nf) {
  ra->url = cli_flag_get(f, nf, "remote")->value;
  ra->prefix = cli_flag_get(f, nf, "remote-prefix")->value;
  ra->ca = cli_flag_get(f, nf, "remote-ca")->value;
  ra->cert = cli_flag_get(f, nf, "remote-cert")->value;
  ra->key = cli_flag_get(f, nf, "remote-key")->value;
  return ra->url != NULL;
}

/* An open remote-only tier on a private temporary directory, and every
 * entry of its store (newest first). */
typedef struct rstore {
  char tmp[64];
  kvt_tier *t;
  cli_entries es;
} rstore;

static void rstore_close(rstore *r) {
  cli_entries_free(&r->es);
  kvt_tier_free(r->t);
  r->t = NULL;
  /* The private directory made by rstore_open, removed whole: no name of
   * the layout is spelled and no user's cache is walked. */
  if (r->tmp[0])
    nftw(r->tmp, rm_one, 16, FTW_DEPTH | FTW_PHYS);
  r->tmp[0] = '\0';
}

/* Returns CLI_OK or the exit code of a reported failure (r closed). */
static int rstore_open(rstore *r, const cli_remote_args *ra, int json,
                       const char *cmd) {
  memset(r, 0, sizeof *r);
  snprintf(r->tmp, sizeof r->tmp, "/tmp/kvtier-cli-remote-XXXXXX");
  if (!mkdtemp(r->tmp)) {
    r->tmp[0] = '\0';
    return cli_fail(json, cmd, CLI_FAILED,
                    "mkdtemp: cannot create a temporary directory");
  }
  kvt_options o;
  kvt_options_init(&o, KVT_OPTIONS_VERSION);
  o.cache_dir = r->tmp;
  o.durability = KVT_DURABILITY_NONE;
  o.remote_url = ra->url;
  o.remote_mode = KVT_REMOTE_ONLY;
  o.remote_prefix = ra->prefix;
  o.remote_timeout_ms = 5000;
  o.remote_lookup_timeout_ms = 5000;
  o.remote_tls_ca_file = ra->ca;
  o.remote_tls_cert_file = ra->cert;
  o.remote_tls_key_file = ra->key;
  int rc = kvt_tier_open(&r->t, &o);
  int code = CLI_OK;
  if (rc != 0)
    code = cli_fail(json, cmd, rc == KVT_EINVAL ? CLI_USAGE : CLI_NOOPEN,
                    "%s: %s (%s)", ra->url, kvt_last_error(), kvt_strerror(rc));
  else if ((rc = kvt_tier_remote_foreach(r->t, cli_entries_collect, &r->es)) !=
           0)
    code = cli_fail(json, cmd, CLI_NOOPEN, "%s: cannot list the store: %s",
                    ra->url, kvt_last_error());
  if (code != CLI_OK) {
    rstore_close(r);
    return code;
  }
  qsort(r->es.v, r->es.n, sizeof *r->es.v, by_created);
  return CLI_OK;
}

int cli_remote(const char *cmd, const cli_remote_args *ra, int json, int prom,
               int verbose) {
  (void)verbose;
  rstore st;
  int code = rstore_open(&st, ra, json, cmd);
  if (code != CLI_OK)
    return code;
  const char *url = ra->url, *prefix = ra->prefix;
  kvt_tier *t = st.t;
  cli_entries es = st.es;
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
  rstore_close(&st);
  return code;
}

int cli_remote_show(const cli_remote_args *ra, const char *want, int json) {
  int code = cli_hash_arg(want, json);
  if (code != CLI_RUN)
    return code;
  rstore st;
  if ((code = rstore_open(&st, ra, json, "show")) != CLI_OK)
    return code;
  const kvt_entry_info *hit = NULL;
  if ((code = cli_find_hash(&st.es, want, ra->url, json, &hit)) != CLI_RUN) {
    rstore_close(&st);
    return code;
  }
  char *djson = NULL;
  int rc = kvt_tier_remote_describe(&djson, st.t, hit->token_hash);
  if (rc != 0)
    code =
        cli_fail(json, "show", rc == KVT_ENOTFOUND ? CLI_NOTFOUND : CLI_FAILED,
                 "entry %s: %s (%s)", hit->token_hash, kvt_last_error(),
                 kvt_strerror(rc));
  else
    code =
        cli_show_print("remote", ra->url, ra->prefix ? ra->prefix : "kvt:", hit,
                       djson, json, NULL);
  kvt_free(djson);
  rstore_close(&st);
  return code;
}

int cli_remote_gc(const cli_remote_args *ra, uint64_t max_bytes,
                  uint64_t max_entries, int64_t older, int dry, int json) {
  rstore st;
  int code = rstore_open(&st, ra, json, "gc");
  if (code != CLI_OK)
    return code;
  /* es is newest first: walk from the oldest. */
  size_t n = st.es.n;
  char *gone = calloc(n ? n : 1, 1);
  const char **why = calloc(n ? n : 1, sizeof *why);
  if (!gone || !why) {
    free(gone);
    free(why);
    rstore_close(&st);
    return cli_fail(json, "gc", CLI_FAILED, "out of memory");
  }
  double now = cli_now();
  uint64_t count = n, bytes = 0;
  for (size_t i = 0; i < n; i++)
    bytes += st.es.v[i].disk_bytes;
  for (size_t k = n; k-- > 0;) {
    const kvt_entry_info *e = &st.es.v[k];
    if (older > 0 && e->created_at < now - (double)older)
      why[k] = "expired";
    else if (count > max_entries || bytes > max_bytes)
      why[k] = "capacity";
    else
      continue;
    gone[k] = 1;
    count--;
    bytes -= e->disk_bytes;
  }
  uint64_t removed = 0, removed_bytes = 0;
  for (size_t k = n; k-- > 0;) {
    if (!gone[k])
      continue;
    if (!dry) {
      int rc = kvt_tier_remote_remove(st.t, st.es.v[k].token_hash);
      if (rc != 0) {
        code =
            cli_fail(json, "gc", CLI_FAILED, "removing %.16s: %s (%s)",
                     st.es.v[k].token_hash, kvt_last_error(), kvt_strerror(rc));
        break;
      }
    }
    removed++;
    removed_bytes += st.es.v[k].disk_bytes;
  }
  if (code == CLI_OK && json) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "remote", ra->url);
    cJSON_AddStringToObject(o, "prefix", ra->prefix ? ra->prefix : "kvt:");
    cJSON_AddBoolToObject(o, "dry_run", dry);
    cJSON_AddNumberToObject(o, "removed_count", (double)removed);
    cJSON_AddNumberToObject(o, "removed_bytes", (double)removed_bytes);
    cJSON *arr = cJSON_AddArrayToObject(o, "removed");
    for (size_t k = n; k-- > 0;) {
      if (!gone[k])
        continue;
      cJSON *p = cJSON_CreateObject();
      cJSON_AddStringToObject(p, "token_hash", st.es.v[k].token_hash);
      cJSON_AddNumberToObject(p, "num_tokens", (double)st.es.v[k].num_tokens);
      cJSON_AddNumberToObject(p, "disk_bytes", (double)st.es.v[k].disk_bytes);
      cJSON_AddNumberToObject(p, "created_at", st.es.v[k].created_at);
      cJSON_AddStringToObject(p, "reason", why[k]);
      cJSON_AddItemToArray(arr, p);
    }
    cJSON_AddNumberToObject(o, "remaining", (double)(n - removed));
    cli_json_print(o);
  } else if (code == CLI_OK) {
    char b[32];
    for (size_t k = n; k-- > 0;)
      if (gone[k])
        printf("%.16s  %s  %s\n", st.es.v[k].token_hash, why[k],
               cli_fmt_bytes(b, sizeof b, st.es.v[k].disk_bytes));
    printf("%s %llu entries (%s) from %s; %llu remain\n",
           dry ? "would remove" : "removed", (unsigned long long)removed,
           cli_fmt_bytes(b, sizeof b, removed_bytes), ra->url,
           (unsigned long long)(n - removed));
  }
  free(gone);
  free(why);
  rstore_close(&st);
  return code;
}
