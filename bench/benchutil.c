/*
 * benchutil.c - implementation of the bench helpers (see benchutil.h).
 * Benchmarks are not library code: they call libc and popen directly.
 */
#define _GNU_SOURCE 1
#include "benchutil.h"
#include "testutil.h" /* checks kvt_test_rmtree's declaration */

#include <cjson/cJSON.h>
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <time.h>
#include <unistd.h>

double bu_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int bu_have_fio(void) {
  return system("fio --version >/dev/null 2>&1") == 0;
}

int bu_fio(double *bw, const bu_fio_job *j) {
  char cmd[2048];
  snprintf(
      cmd, sizeof cmd,
      "fio --name=kvtbench --filename='%s' --rw=%s --bs=%zu --size=%llu "
      "--direct=%d "
      "--ioengine=%s --iodepth=%d --end_fsync=%d --invalidate=%d --numjobs=1 "
      "--output-format=json 2>/dev/null",
      j->file, j->rw, j->bs, (unsigned long long)j->size, j->direct, j->engine,
      j->depth, j->end_fsync, j->invalidate);
  FILE *f = popen(cmd, "r");
  if (!f) {
    fprintf(stderr, "fio: cannot run\n");
    return -1;
  }
  size_t cap = 1 << 16, len = 0;
  char *out = malloc(cap);
  size_t got;
  while (out && (got = fread(out + len, 1, cap - len - 1, f)) > 0) {
    len += got;
    if (cap - len < 4096) {
      char *n2 = realloc(out, cap *= 2);
      if (!n2) {
        free(out);
        out = NULL;
      }
      out = n2;
    }
  }
  int st = pclose(f);
  if (!out)
    return -1;
  out[len] = '\0';
  char *js = strchr(out, '{');
  cJSON *root = js ? cJSON_Parse(js) : NULL;
  int rc = -1;
  if (root) {
    cJSON *jobs = cJSON_GetObjectItem(root, "jobs");
    cJSON *job = cJSON_GetArrayItem(jobs, 0);
    cJSON *side =
        cJSON_GetObjectItem(job, strstr(j->rw, "write") ? "write" : "read");
    cJSON *b = cJSON_GetObjectItem(side, "bw_bytes");
    if (cJSON_IsNumber(b) && b->valuedouble > 0) {
      *bw = b->valuedouble;
      rc = 0;
    }
    cJSON_Delete(root);
  }
  if (rc != 0)
    fprintf(stderr, "fio failed (status %d): %s\n", st, cmd);
  free(out);
  return rc;
}

int bu_drop_cache(const char *path) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return -1;
  fdatasync(fd);
  int rc = posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  close(fd);
  return rc == 0 ? 0 : -1;
}

/* Reads a whole file into a scratch buffer: its pages end up in the page
 * cache. */
static void warm_file(const char *path) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return;
  static char buf[1 << 20];
  while (read(fd, buf, sizeof buf) > 0) {
  }
  close(fd);
}

static void drop_rec(const char *dir, int depth, int warm) {
  DIR *d = opendir(dir);
  if (!d)
    return;
  struct dirent *de;
  while ((de = readdir(d))) {
    if (de->d_name[0] == '.')
      continue;
    char p[4096];
    snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
    struct stat st;
    if (lstat(p, &st) != 0)
      continue;
    if (S_ISREG(st.st_mode)) {
      if (warm)
        warm_file(p);
      else
        bu_drop_cache(p);
    } else if (S_ISDIR(st.st_mode) && depth < 3) {
      drop_rec(p, depth + 1, warm);
    }
  }
  closedir(d);
}

int bu_drop_cache_tree(const char *dir) {
  drop_rec(dir, 0, 0);
  return 0;
}

void bu_warm_cache_tree(const char *dir) {
  drop_rec(dir, 0, 1);
}

static uint64_t status_kb(const char *key) {
  FILE *f = fopen("/proc/self/status", "r");
  if (!f)
    return 0;
  char line[256];
  uint64_t v = 0;
  size_t kl = strlen(key);
  while (fgets(line, sizeof line, f))
    if (!strncmp(line, key, kl)) {
      v = strtoull(line + kl, NULL, 10);
      break;
    }
  fclose(f);
  return v * 1024;
}

uint64_t bu_rss(void) {
  return status_kb("VmRSS:");
}
uint64_t bu_peak_rss(void) {
  return status_kb("VmHWM:");
}

void bu_reset_peak_rss(void) {
  FILE *f = fopen("/proc/self/clear_refs", "w");
  if (f) {
    fputs("5", f);
    fclose(f);
  }
}

char *bu_mkdtemp(const char *base) {
  if (!base)
    base = getenv("KVT_BENCH_DIR");
  if (!base || !*base)
    base = "/var/tmp";
  char *p = malloc(strlen(base) + 32);
  if (!p)
    return NULL;
  sprintf(p, "%s/kvt-bench-XXXXXX", base);
  if (!mkdtemp(p)) {
    perror(p);
    free(p);
    return NULL;
  }
  return p;
}

int bu_report_ratio(const char *name, double value, double limit, double ratio,
                    const char *unit, const char *limit_desc, double want,
                    int higher_better) {
  int ok = want <= 0 || (higher_better ? ratio >= want : ratio <= want);
  char tgt[32] = "-";
  if (want > 0)
    snprintf(tgt, sizeof tgt, "%s %.2f", higher_better ? ">=" : "<=", want);
  printf(
      "%-34s %10.3f %-5s limit %10.3f %-5s ratio %6.3f  target %-8s %s  [%s]\n",
      name, value, unit, limit, unit, ratio, tgt,
      want <= 0 ? "info"
      : ok      ? "PASS"
                : "MISS",
      limit_desc);
  fflush(stdout);
  return ok;
}

int bu_report(const char *name, double value, double limit, const char *unit,
              const char *limit_desc, double want, int higher_better) {
  return bu_report_ratio(name, value, limit, limit > 0 ? value / limit : 0,
                         unit, limit_desc, want, higher_better);
}

void bu_header(const char *title, const char *dir) {
  struct utsname u;
  uname(&u);
  long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
  long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
  double load[3] = {0, 0, 0};
  getloadavg(load, 3);
  printf("# %s\n# machine: %ld cpus, %.1f GiB RAM, kernel %s %s; load avg %.2f "
         "%.2f %.2f\n",
         title, ncpu, (double)pages * (double)psz / (1 << 30), u.sysname,
         u.release, load[0], load[1], load[2]);
  char cmd[4200];
  snprintf(cmd, sizeof cmd, "df -hT '%s' 2>/dev/null | tail -1", dir);
  FILE *f = popen(cmd, "r");
  if (f) {
    char line[512];
    if (fgets(line, sizeof line, f))
      printf("# disk under test (%s): %s", dir, line);
    pclose(f);
  }
  fflush(stdout);
}

static int cmpd(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

double bu_median(double *v, int n) {
  if (n <= 0)
    return 0;
  qsort(v, (size_t)n, sizeof *v, cmpd);
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

double bu_max(const double *v, int n) {
  double m = 0;
  for (int i = 0; i < n; i++)
    if (v[i] > m)
      m = v[i];
  return m;
}

/* ---- workloads ---------------------------------------------------------- */

static void fill(void *p, uint64_t n, uint64_t seed) {
  uint64_t *q = p;
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  for (uint64_t i = 0; i < n / 8; i++) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    q[i] = x;
  }
}

static void tensor(kvt_tensor *t, kvt_dtype dt, uint32_t ndim,
                   const int64_t *shape, uint64_t seed) {
  memset(t, 0, sizeof *t);
  t->dtype = dt;
  t->ndim = ndim;
  uint64_t n = kvt_dtype_size(dt);
  for (uint32_t i = 0; i < ndim; i++) {
    t->shape[i] = shape[i];
    n *= (uint64_t)shape[i];
  }
  t->nbytes = n;
  void *p = NULL;
  if (posix_memalign(&p, 4096, n ? n : 1) != 0)
    abort();
  fill(p, n, seed); /* touched: the caller's KV cache is resident */
  t->data = p;
}

void bu_workload_make(bu_workload *w, uint32_t n_layers, int hybrid,
                      kvt_dtype dt, int64_t heads, size_t n_tokens, int64_t dim,
                      int32_t salt) {
  memset(w, 0, sizeof *w);
  w->n_tokens = n_tokens;
  w->tokens = malloc((n_tokens ? n_tokens : 1) * sizeof(int32_t));
  w->layers = calloc(n_layers ? n_layers : 1, sizeof(kvt_layer));
  if (!w->tokens || !w->layers)
    abort();
  for (size_t i = 0; i < n_tokens; i++)
    w->tokens[i] = (int32_t)((i * 2654435761u + (uint32_t)salt) % 128000u);
  w->n_layers = n_layers;
  for (uint32_t i = 0; i < n_layers; i++) {
    kvt_layer *l = &w->layers[i];
    int kv = !hybrid || i % 4 == 3;
    kvt_layer_init(l, kv ? KVT_LAYER_KV : KVT_LAYER_ARRAYS);
    l->num_tensors = 2;
    l->tensors = calloc(2, sizeof(kvt_tensor));
    if (!l->tensors)
      abort();
    if (kv) {
      int64_t sh[4] = {1, heads, (int64_t)n_tokens, dim};
      tensor(&l->tensors[0], dt, 4, sh, i * 2 + 1);
      tensor(&l->tensors[1], dt, 4, sh, i * 2 + 2);
      l->offset = (int64_t)n_tokens;
    } else {
      int64_t conv[3] = {1, 3, 8192};
      int64_t ssm[4] = {1, 64, 128, 128};
      tensor(&l->tensors[0], dt, 3, conv, i * 2 + 1);
      tensor(&l->tensors[1], KVT_DTYPE_F32, 4, ssm, i * 2 + 2);
    }
    for (uint32_t j = 0; j < l->num_tensors; j++)
      w->bytes += l->tensors[j].nbytes;
  }
}

void bu_workload_free(bu_workload *w) {
  for (uint32_t i = 0; i < w->n_layers; i++) {
    for (uint32_t j = 0; j < w->layers[i].num_tensors; j++)
      free(w->layers[i].tensors[j].data);
    free(w->layers[i].tensors);
  }
  free(w->layers);
  free(w->tokens);
  memset(w, 0, sizeof *w);
}

int bu_parse_list(size_t *v, int cap, char *s) {
  int n = 0;
  char *save = NULL;
  for (char *x = strtok_r(s, ",", &save); x && n < cap;
       x = strtok_r(NULL, ",", &save))
    v[n++] = (size_t)strtoull(x, NULL, 10);
  return n;
}
