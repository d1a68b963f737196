/*
 * rel_tier.c - the whole-tier reliability helpers declared in rel_tier.h.
 */
#include "rel_tier.h"

#include <time.h>

void rel_done_fn(void *ctx, const char *hash, int status) {
  rel_done *d = ctx;
  pthread_mutex_lock(&d->mu);
  if (d->n < REL_MAX_DONE) {
    memcpy(d->hash[d->n], hash, KVT_HASH_HEX_LEN + 1);
    d->status[d->n] = status;
    d->n++;
  }
  pthread_mutex_unlock(&d->mu);
}

int rel_done_status(rel_done *d, const char *hash) {
  int st = 1;
  pthread_mutex_lock(&d->mu);
  for (int i = 0; i < d->n; i++)
    if (!strcmp(d->hash[i], hash))
      st = d->status[i];
  pthread_mutex_unlock(&d->mu);
  return st;
}

kvt_options rel_opts(const char *dir, int durability) {
  kvt_options o;
  kvt_options_init(&o, KVT_OPTIONS_VERSION);
  o.cache_dir = dir;
  o.durability = durability;
  o.quarantine_max = 4;
  o.host_cache_bytes = 0; /* the disk path is under test, not the RAM tier */
  return o;
}

char *rel_path(const char *dir, const char *a, const char *b) {
  size_t n = strlen(dir) + (a ? strlen(a) : 0) + (b ? strlen(b) : 0) + 4;
  char *p = malloc(n);
  snprintf(p, n, "%s%s%s%s%s", dir, a ? "/" : "", a ? a : "", b ? "/" : "",
           b ? b : "");
  return p;
}

int rel_collect(void *ctx, const kvt_entry_info *info) {
  rel_hashes *l = ctx;
  if (l->n < REL_MAX_DONE)
    memcpy(l->h[l->n++], info->token_hash, KVT_HASH_HEX_LEN + 1);
  return 0;
}

void rel_scan_data(const char *dir, int *entries, int *tmps, int *other) {
  char *d = rel_path(dir, "data", NULL);
  *entries = *tmps = *other = 0;
  DIR *dd = opendir(d);
  struct dirent *de;
  while (dd && (de = readdir(dd))) {
    if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, ".."))
      continue;
    size_t l = strlen(de->d_name);
    if (kvti_is_hash_name(de->d_name))
      (*entries)++;
    else if (l > 4 && !strcmp(de->d_name + l - 4, ".tmp"))
      (*tmps)++;
    else
      (*other)++;
  }
  if (dd)
    closedir(dd);
  free(d);
}

int rel_check_dir(const char *dir, const char *known_corrupt) {
  kvt_options o = rel_opts(dir, KVT_DURABILITY_NONE);
  kvt_tier *t = NULL;
  int rc = kvt_tier_open(&t, &o);
  if (rc != 0) {
    fprintf(stderr, "  reopen of %s failed: %d (%s)\n", dir, rc,
            kvt_last_error());
    CHECK_EQ_INT(rc, 0);
    return -1;
  }
  rel_hashes *l = calloc(1, sizeof *l);
  CHECK_EQ_INT(kvt_tier_foreach(t, rel_collect, l), 0);
  for (int i = 0; i < l->n; i++) {
    rc = kvt_tier_verify(t, l->h[i], 0);
    if (known_corrupt && !strcmp(l->h[i], known_corrupt)) {
      CHECK_EQ_INT(rc, KVT_ECORRUPT);
      continue;
    }
    if (rc != 0)
      fprintf(stderr, "  row %.16s does not verify after reopen: %d (%s)\n",
              l->h[i], rc, kvt_last_error());
    CHECK_EQ_INT(rc, 0);
  }
  int entries, tmps, other;
  rel_scan_data(dir, &entries, &tmps, &other);
  if (tmps || entries != l->n)
    fprintf(stderr,
            "  after reopen: %d rows, %d entry dirs, %d tmp, %d other\n", l->n,
            entries, tmps, other);
  CHECK_EQ_INT(tmps, 0);
  CHECK_EQ_INT(entries, l->n);
  int n = l->n;
  free(l);
  CHECK_EQ_INT(kvt_tier_close(t, -1), 0);
  kvt_tier_free(t);
  return n;
}

double rel_now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

void rel_sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

kvt_stats rel_stats(kvt_tier *t) {
  kvt_stats s = KVT_STATS_INIT;
  kvt_tier_stats(&s, t);
  return s;
}

void rel_spill_all(const char *dir, t_entry *const *es, int n) {
  kvt_options o = rel_opts(dir, KVT_DURABILITY_NONE);
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  for (int i = 0; i < n; i++)
    REQUIRE(t_spill(t, es[i]) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  kvt_tier_close(t, -1);
  kvt_tier_free(t);
}

void rel_rm_index(const char *dir) {
  static const char *names[] = {"index.db", "index.db-wal", "index.db-shm"};
  for (int i = 0; i < 3; i++) {
    char *p = rel_path(dir, names[i], NULL);
    unlink(p);
    free(p);
  }
}
