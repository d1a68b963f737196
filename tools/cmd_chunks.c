/*
 * cmd_chunks.c - what the kvtier tool shows and does about the chunked native
 * store (docs/CLI.md, "Chains and chunks"), through the public chunk API
 * (kvt_tier_chunk_foreach, kvt_tier_entry_chain, kvt_tier_chunk_totals,
 * kvt_tier_chunk_verify, kvt_tier_chunk_gc): the chain summary of each entry
 * for `ls` (chain length, shared chunks), an entry's chain for `show`, the
 * chunk totals and dedup ratio for `stats`, the chunk pass of `verify` (every
 * chunk file verified; --repair quarantines), and the chunks/ cleaning of
 * `gc` (stale *.tmp, orphans adopted or removed). A cache without chunks
 * shows none of it.
 */
#include "cli.h"
#include "kvtier_sys.h"

#include <stdlib.h>
#include <string.h>

/* ---- all chunks, sorted by key ----------------------------------------- */

static int unhex(uint8_t out[32], const char *s) {
  for (int i = 0; i < 32; i++) {
    unsigned v = 0;
    for (int k = 0; k < 2; k++) {
      char c = s[2 * i + k];
      v <<= 4;
      if (c >= '0' && c <= '9')
        v |= (unsigned)(c - '0');
      else if (c >= 'a' && c <= 'f')
        v |= (unsigned)(c - 'a' + 10);
      else
        return -1;
    }
    out[i] = (uint8_t)v;
  }
  return s[64] == 0 ? 0 : -1;
}

void cli_chunk_hex(char out[65], const cli_chunk_ref *c) {
  for (int i = 0; i < 32; i++)
    snprintf(out + 2 * i, 3, "%02x", c->key[i]);
}

static int collect_chunk(void *ctx, const kvt_chunk_info *info) {
  cli_chunkmap *m = ctx;
  if (m->n == m->cap) {
    size_t nc = m->cap ? m->cap * 2 : 256;
    cli_chunk_ref *nv = realloc(m->v, nc * sizeof *nv);
    if (!nv)
      return KVT_ENOMEM; /* stops the walk; kvt_tier_chunk_foreach returns it */
    m->v = nv;
    m->cap = nc;
  }
  cli_chunk_ref *r = &m->v[m->n];
  if (unhex(r->key, info->key) != 0)
    return 0; /* not a key: cannot happen (the library's hex) */
  r->index = info->index;
  r->entries = info->entries;
  m->n++;
  return 0;
}

static int cmp_chunk_key(const void *a, const void *b) {
  return memcmp(((const cli_chunk_ref *)a)->key,
                ((const cli_chunk_ref *)b)->key, 32);
}

int cli_chunkmap_load(cli_chunkmap *m, kvt_tier *t) {
  memset(m, 0, sizeof *m);
  if (!t)
    return 0;
  kvt_chunk_totals tot = KVT_CHUNK_TOTALS_INIT;
  if (kvt_tier_chunk_totals(&tot, t) == 0)
    m->totals = tot;
  if (tot.chunks == 0)
    return 0;
  int rc = kvt_tier_chunk_foreach(t, collect_chunk, m);
  if (rc != 0) { /* KVT_ENOMEM from collect_chunk, or the walk's own code */
    cli_chunkmap_free(m);
    return rc;
  }
  cli_qsort(m->v, m->n, sizeof *m->v, cmp_chunk_key);
  return 0;
}

const cli_chunk_ref *cli_chunkmap_find(const cli_chunkmap *m, const char *key) {
  cli_chunk_ref k;
  if (unhex(k.key, key) != 0)
    return NULL;
  return cli_bsearch(&k, m->v, m->n, sizeof *m->v, cmp_chunk_key);
}

void cli_chunkmap_free(cli_chunkmap *m) {
  free(m->v);
  memset(m, 0, sizeof *m);
}

void cli_chain_summary(cli_chain_sum *s, kvt_tier *t, const cli_chunkmap *m,
                       const char *hash) {
  memset(s, 0, sizeof *s);
  s->complete = 1;
  if (!t || m->totals.chunks == 0)
    return;
  kvt_chunk_info *ch = NULL;
  size_t n = 0;
  int rc = kvt_tier_entry_chain(&ch, &n, &s->chunk_tokens, t, hash,
                                KVT_CHAIN_NO_SHARING);
  if (rc == KVT_ENOTFOUND && s->chunk_tokens) {
    s->chained = 1;
    s->complete = 0;
    return;
  }
  if (rc != 0 || n == 0) {
    kvt_free(ch);
    return;
  }
  s->chained = 1;
  s->chunks = n;
  for (size_t i = 0; i < n; i++) {
    const cli_chunk_ref *c = cli_chunkmap_find(m, ch[i].key);
    s->bytes += ch[i].disk_bytes;
    if (c && c->entries >= 2)
      s->shared++;
  }
  kvt_free(ch);
}

void cli_chain_summary_json(cJSON *o, const cli_chain_sum *s) {
  cJSON_AddNumberToObject(o, "chain_chunks", (double)s->chunks);
  cJSON_AddNumberToObject(o, "shared_chunks", (double)s->shared);
  cJSON_AddNumberToObject(o, "chunk_tokens", s->chunk_tokens);
  cJSON_AddNumberToObject(o, "chain_bytes", (double)s->bytes);
  cJSON_AddBoolToObject(o, "chain_complete", s->complete);
}

/* ---- show: one entry's chain -------------------------------------------- */

void cli_chain_show(kvt_tier *t, const char *hash, int json, cJSON *o) {
  if (!t)
    return;
  kvt_chunk_info *ch = NULL;
  size_t n = 0;
  uint32_t C = 0;
  int rc = kvt_tier_entry_chain(&ch, &n, &C, t, hash, 0);
  if (rc != 0 && rc != KVT_ENOTFOUND)
    return;
  if (C == 0) { /* stored whole */
    if (json)
      cJSON_AddNullToObject(o, "chain");
    kvt_free(ch);
    return;
  }
  uint64_t bytes = 0, mem = 0;
  size_t shared = 0;
  for (size_t i = 0; i < n; i++) {
    bytes += ch[i].disk_bytes;
    mem += ch[i].memory_bytes;
    shared += ch[i].entries >= 2;
  }
  if (json) {
    cJSON *c = cJSON_AddObjectToObject(o, "chain");
    cJSON_AddNumberToObject(c, "chunk_tokens", C);
    cJSON_AddNumberToObject(c, "chunks", (double)n);
    cJSON_AddNumberToObject(c, "tokens", (double)n * C);
    cJSON_AddNumberToObject(c, "disk_bytes", (double)bytes);
    cJSON_AddNumberToObject(c, "memory_bytes", (double)mem);
    cJSON_AddNumberToObject(c, "shared_chunks", (double)shared);
    cJSON_AddBoolToObject(c, "complete", rc == 0);
    if (rc != 0)
      cJSON_AddStringToObject(c, "error", kvt_last_error());
    cJSON *arr = cJSON_AddArrayToObject(c, "links");
    for (size_t i = 0; i < n; i++) {
      cJSON *k = cJSON_CreateObject();
      cJSON_AddNumberToObject(k, "index", (double)ch[i].index);
      cJSON_AddStringToObject(k, "key", ch[i].key);
      cJSON_AddStringToObject(k, "parent", ch[i].parent);
      cJSON_AddNumberToObject(k, "first_token", (double)ch[i].index * C);
      cJSON_AddNumberToObject(k, "num_tokens", ch[i].num_tokens);
      cJSON_AddNumberToObject(k, "disk_bytes", (double)ch[i].disk_bytes);
      cJSON_AddNumberToObject(k, "memory_bytes", (double)ch[i].memory_bytes);
      cJSON_AddNumberToObject(k, "entries", ch[i].entries);
      cJSON_AddNumberToObject(k, "children", ch[i].children);
      cJSON_AddBoolToObject(k, "pure", ch[i].pure);
      cJSON_AddNumberToObject(k, "accessed_at", ch[i].accessed_at);
      cJSON_AddItemToArray(arr, k);
    }
    kvt_free(ch);
    return;
  }
  char a[32], b[32];
  printf("\nchain       %zu chunks of %u tokens (tokens 0-%llu), %s on disk, "
         "%s in memory; %zu shared with other entries%s\n",
         n, C, (unsigned long long)(n * C - 1),
         cli_fmt_bytes(a, sizeof a, bytes), cli_fmt_bytes(b, sizeof b, mem),
         shared, rc == 0 ? "" : " - INCOMPLETE (cannot be served)");
  if (rc != 0)
    printf("            %s\n", kvt_last_error());
  static const char *heads[] = {"INDEX",  "CHUNK",   "TOKENS",  "DISK",
                                "MEMORY", "ENTRIES", "CHILDREN"};
  cli_table tb;
  cli_table_init(&tb, 7, heads, "rlrrrrr");
  for (size_t i = 0; i < n; i++) {
    char idx[24], tok[48], d[32], m[32], e[16], k[16];
    snprintf(idx, sizeof idx, "%llu", (unsigned long long)ch[i].index);
    snprintf(tok, sizeof tok, "%llu-%llu",
             (unsigned long long)(ch[i].index * C),
             (unsigned long long)(ch[i].index * C + ch[i].num_tokens - 1));
    snprintf(e, sizeof e, "%u", ch[i].entries);
    snprintf(k, sizeof k, "%u", ch[i].children);
    const char *row[7] = {idx,
                          ch[i].key,
                          tok,
                          cli_fmt_bytes(d, sizeof d, ch[i].disk_bytes),
                          cli_fmt_bytes(m, sizeof m, ch[i].memory_bytes),
                          e,
                          k};
    cli_table_add(&tb, row);
  }
  cli_table_print(&tb, stdout);
  cli_table_free(&tb);
  kvt_free(ch);
}

/* ---- stats: totals and the dedup ratio ---------------------------------- */

double cli_dedup_ratio(const kvt_chunk_totals *t, uint64_t entry_bytes) {
  double disk = (double)entry_bytes + (double)t->disk_bytes;
  return disk > 0
             ? ((double)entry_bytes + (double)t->chain_logical_bytes) / disk
             : 1.0;
}

/* The chunk sizes the stored chunks have (the CLI's tier is opened with the
 * default chunk_tokens, which says nothing about what a serving process
 * wrote): a bit per power of two up to 2^31. */
static int size_visit(void *ctx, const kvt_chunk_info *in) {
  uint32_t *bits = ctx;
  for (uint32_t b = 0; b < 32; b++)
    if (in->num_tokens == (uint32_t)1 << b)
      *bits |= (uint32_t)1 << b;
  return 0;
}

/* "16" or "16, 256" (every stored size) into out. */
static void sizes_text(char *out, size_t cap, uint32_t bits) {
  out[0] = 0;
  for (uint32_t b = 0; b < 32; b++)
    if (bits & ((uint32_t)1 << b)) {
      size_t n = strlen(out);
      snprintf(out + n, cap - n, "%s%u", n ? ", " : "", (uint32_t)1 << b);
    }
}

void cli_chunk_stats(kvt_tier *t, uint64_t entry_bytes, int json, cJSON *o) {
  kvt_chunk_totals tot = KVT_CHUNK_TOTALS_INIT;
  uint32_t bits = 0;
  if (t) {
    kvt_tier_chunk_totals(&tot, t);
    kvt_tier_chunk_foreach(t, size_visit, &bits);
  }
  /* One stored size: that is the store's chunk size, whatever this process
   * was opened with. */
  if (bits && !(bits & (bits - 1))) {
    uint32_t b = 0;
    while (!(bits & ((uint32_t)1 << b)))
      b++;
    tot.chunk_tokens = (uint32_t)1 << b;
  }
  double ratio = cli_dedup_ratio(&tot, entry_bytes);
  uint64_t logical = entry_bytes + tot.chain_logical_bytes;
  uint64_t disk = entry_bytes + tot.disk_bytes;
  if (json) {
    cJSON *c = cJSON_AddObjectToObject(o, "chunks");
    cJSON_AddNumberToObject(c, "chunk_tokens", tot.chunk_tokens);
    cJSON *sz = cJSON_AddArrayToObject(c, "chunk_sizes");
    for (uint32_t b = 0; sz && b < 32; b++)
      if (bits & ((uint32_t)1 << b))
        cJSON_AddItemToArray(sz,
                             cJSON_CreateNumber((double)((uint32_t)1 << b)));
    cJSON_AddNumberToObject(c, "count", (double)tot.chunks);
    cJSON_AddNumberToObject(c, "disk_bytes", (double)tot.disk_bytes);
    cJSON_AddNumberToObject(c, "memory_bytes", (double)tot.memory_bytes);
    cJSON_AddNumberToObject(c, "leaves", (double)tot.leaves);
    cJSON_AddNumberToObject(c, "shared", (double)tot.shared);
    cJSON_AddNumberToObject(c, "chained_entries", (double)tot.chained_entries);
    cJSON *d = cJSON_AddObjectToObject(o, "dedup");
    cJSON_AddNumberToObject(d, "logical_bytes", (double)logical);
    cJSON_AddNumberToObject(d, "disk_bytes", (double)disk);
    cJSON_AddNumberToObject(d, "ratio", ratio);
    return;
  }
  char a[32], b[32], c[32];
  if (tot.chunks == 0 && tot.chained_entries == 0) {
    printf("chunks     none%s\n",
           tot.chunk_tokens ? "" : " (the chunked store is off)");
    return;
  }
  char szs[400];
  if (bits)
    sizes_text(szs, sizeof szs, bits);
  else
    snprintf(szs, sizeof szs, "%u", tot.chunk_tokens);
  printf("chunks     %llu of %s tokens, %s on disk (%s of KV); %llu leaves, "
         "%llu shared by 2+ entries; %llu entries over chains\n",
         (unsigned long long)tot.chunks, szs,
         cli_fmt_bytes(a, sizeof a, tot.disk_bytes),
         cli_fmt_bytes(b, sizeof b, tot.memory_bytes),
         (unsigned long long)tot.leaves, (unsigned long long)tot.shared,
         (unsigned long long)tot.chained_entries);
  printf("dedup      %.2fx (entries would take %s stored separately; %s on "
         "disk)\n",
         ratio, cli_fmt_bytes(a, sizeof a, logical),
         cli_fmt_bytes(c, sizeof c, disk));
}

void cli_chunk_prom(kvt_tier *t, FILE *f) {
  kvt_chunk_totals tot = KVT_CHUNK_TOTALS_INIT;
  if (!t || kvt_tier_chunk_totals(&tot, t) != 0)
    return;
  static const char *names[4][2] = {
      {"kvtier_chunks", "chunk files of the chunked store"},
      {"kvtier_chunk_disk_bytes", "bytes of chunk files (each once)"},
      {"kvtier_chunk_shared", "chunks in the chains of 2+ entries"},
      {"kvtier_chained_entries", "entries stored over a chain"}};
  const uint64_t v[4] = {tot.chunks, tot.disk_bytes, tot.shared,
                         tot.chained_entries};
  for (int i = 0; i < 4; i++)
    fprintf(f, "# HELP %s %s\n# TYPE %s gauge\n%s %llu\n", names[i][0],
            names[i][1], names[i][0], names[i][0], (unsigned long long)v[i]);
}

/* ---- verify: every chunk file ------------------------------------------- */

static int cmp_chunk_index(const void *a, const void *b) {
  const cli_chunk_ref *x = a, *y = b;
  if (x->index != y->index)
    return x->index < y->index ? -1 : 1;
  return memcmp(x->key, y->key, 32);
}

int cli_verify_chunks(kvt_tier *t, int repair, int progress, cli_problem_fn fn,
                      void *ctx, size_t *checked, size_t *ok, size_t *repaired,
                      size_t *failed) {
  *checked = *ok = *repaired = *failed = 0;
  cli_chunkmap m;
  int rc = cli_chunkmap_load(&m, t);
  if (rc != 0)
    return rc;
  /* Chain order (index ascending), parents before the chunks below them. */
  cli_qsort(m.v, m.n, sizeof *m.v, cmp_chunk_index);
  cli_progress pg;
  cli_progress_start(&pg, repair ? "chunks (repair)" : "chunks", m.n, progress);
  for (size_t i = 0; i < m.n; i++) {
    uint64_t ents = 0;
    char key[65];
    cli_chunk_hex(key, &m.v[i]);
    int r = kvt_tier_chunk_verify(t, key, repair, &ents);
    cli_progress_update(&pg, i + 1);
    if (r == KVT_ENOTFOUND)
      continue; /* removed with a bad ancestor (or evicted) meanwhile */
    (*checked)++;
    if (r == 0) {
      (*ok)++;
      continue;
    }
    const char *act = "-";
    char detail[600];
    snprintf(detail, sizeof detail, "%s", kvt_last_error());
    if (repair && r == KVT_ECORRUPT) {
      act = "quarantined";
      size_t l = strlen(detail);
      snprintf(detail + l, sizeof detail - l,
               " (the file alone; the chunks below it and %llu entries "
               "through it kept, unservable until it is written again)",
               (unsigned long long)ents);
      (*repaired)++;
    } else if (r != KVT_ECORRUPT && r != KVT_EIO) {
      (*failed)++;
    }
    char name[KVT_CACHE_CHUNK_NAME_MAX];
    kvt_cache_chunk_name(name, sizeof name, key);
    fn(ctx, name,
       r == KVT_ECORRUPT ? "chunk-corrupt"
       : r == KVT_EIO    ? "io-error"
                         : "error",
       detail, act);
  }
  cli_progress_end(&pg);
  cli_chunkmap_free(&m);
  return 0;
}

/* ---- gc / verify: chunks/ cleaning -------------------------------------- */

typedef struct gc_ctx {
  cli_problem_fn fn;
  void *ctx;
  int dry;
  cli_progress pg;
} gc_ctx;

static const char *gc_kind(int action) {
  switch (action) {
  case KVT_CHUNK_GC_TMP:
    return "chunk-stale-tmp";
  case KVT_CHUNK_GC_ADOPTED:
  case KVT_CHUNK_GC_REMOVED:
    return "chunk-orphan";
  default:
    return "chunk-stray";
  }
}

static const char *gc_action(int action, int dry) {
  switch (action) {
  case KVT_CHUNK_GC_TMP:
  case KVT_CHUNK_GC_REMOVED:
    return dry ? "would remove" : "removed";
  case KVT_CHUNK_GC_ADOPTED:
    return dry ? "would adopt" : "adopted";
  default:
    return "-";
  }
}

static int gc_cb(void *ctx, const char *path, int action, uint64_t bytes,
                 const char *detail) {
  gc_ctx *g = ctx;
  (void)bytes;
  g->fn(g->ctx, path, gc_kind(action), detail, gc_action(action, g->dry));
  return 0;
}

static void gc_progress(void *ctx, uint64_t done, uint64_t total) {
  (void)total;
  cli_progress_update(&((gc_ctx *)ctx)->pg, done);
}

int cli_clean_chunks(kvt_tier *t, int dry, int progress, cli_problem_fn fn,
                     void *ctx, kvt_chunk_gc_result *res) {
  memset(res, 0, sizeof *res);
  if (!t)
    return 0;
  gc_ctx g = {fn, ctx, dry, {0}};
  cli_progress_start(&g.pg, "chunks/", 256, progress);
  int rc = kvt_tier_chunk_gc(t, dry, gc_cb, gc_progress, &g, res);
  cli_progress_end(&g.pg);
  return rc;
}
