/*
 * benchutil.c - implementation of the bench helpers (see benchutil.h).
 * Benchmarks are not library code: they call libc, posix_spawn and popen
 * directly. Only the public API (kvtier.h, kvtier_sys.h) is used, so `kvtier
 * bench` can link this file against the shared library.
 */
#define _GNU_SOURCE 1
#include "benchutil.h"
#include "kvtier_sys.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

double bu_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Runs argv (stderr to /dev/null) and returns its stdout, malloc'ed and
 * NUL-terminated, or NULL; *status receives the wait status. extra (or NULL):
 * one "NAME=value" for the child's environment, replacing any NAME there. */
static char *run_capture(char *const argv[], const char *extra, int *status) {
  size_t ne = 0, kept = 0;
  while (environ[ne])
    ne++;
  char **env = calloc(ne + 2, sizeof *env);
  if (!env)
    return NULL;
  size_t nl = extra ? strcspn(extra, "=") + 1 : 0;
  for (size_t i = 0; i < ne; i++)
    if (!extra || strncmp(environ[i], extra, nl) != 0)
      env[kept++] = environ[i];
  if (extra)
    env[kept++] = (char *)extra;
  int pfd[2];
  if (pipe(pfd) != 0) {
    free(env);
    return NULL;
  }
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, pfd[1], STDOUT_FILENO);
  posix_spawn_file_actions_addclose(&fa, pfd[0]);
  posix_spawn_file_actions_addopen(&fa, STDERR_FILENO, "/dev/null", O_WRONLY,
                                   0);
  pid_t pid;
  int rc = posix_spawnp(&pid, argv[0], &fa, NULL, argv, env);
  posix_spawn_file_actions_destroy(&fa);
  free(env);
  close(pfd[1]);
  if (rc != 0) {
    close(pfd[0]);
    return NULL;
  }
  size_t cap = 65536, len = 0;
  char *buf = malloc(cap);
  for (;;) {
    if (buf && len + 4096 > cap) {
      char *nb = realloc(buf, cap * 2);
      if (!nb) {
        free(buf);
        buf = NULL;
      } else {
        buf = nb;
        cap *= 2;
      }
    }
    char sink[4096]; /* out of memory: drain the pipe so the child ends */
    ssize_t n = buf ? read(pfd[0], buf + len, cap - len - 1)
                    : read(pfd[0], sink, sizeof sink);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      break;
    if (buf)
      len += (size_t)n;
  }
  close(pfd[0]);
  int st = 0;
  while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {
  }
  *status = st;
  if (buf)
    buf[len] = 0;
  return buf;
}

int bu_fio_version(char *buf, size_t cap) {
  char *argv[] = {"fio", "--version", NULL};
  int st = 0;
  char *out = run_capture(argv, NULL, &st);
  if (!out)
    return -1;
  int ok = WIFEXITED(st) && WEXITSTATUS(st) == 0 && strncmp(out, "fio", 3) == 0;
  if (ok && buf && cap) {
    out[strcspn(out, "\r\n")] = 0;
    snprintf(buf, cap, "%s", out);
  }
  free(out);
  return ok ? 0 : -1;
}

int bu_have_fio(void) {
  return bu_fio_version(NULL, 0) == 0;
}

/* The job's bandwidth side of fio's JSON output: bytes/s, or -1. */
static double fio_bw(const char *out, const char *rw) {
  const char *js = strchr(out, '{'); /* fio may print notes first */
  cJSON *root = js ? cJSON_Parse(js) : NULL;
  cJSON *job = cJSON_GetArrayItem(cJSON_GetObjectItem(root, "jobs"), 0);
  cJSON *err = cJSON_GetObjectItem(job, "error");
  double bw = -1;
  if (job && (!cJSON_IsNumber(err) || err->valuedouble == 0)) {
    cJSON *side =
        cJSON_GetObjectItem(job, strstr(rw, "write") ? "write" : "read");
    cJSON *b = cJSON_GetObjectItem(side, "bw_bytes");
    cJSON *kib = cJSON_GetObjectItem(side, "bw"); /* older fio: KiB/s */
    if (cJSON_IsNumber(b) && b->valuedouble > 0)
      bw = b->valuedouble;
    else if (cJSON_IsNumber(kib) && kib->valuedouble > 0)
      bw = kib->valuedouble * 1024.0;
  }
  cJSON_Delete(root);
  return bw;
}

int bu_fio(double *bw, const bu_fio_job *j) {
  char a_file[4200], a_rw[64], a_bs[64], a_size[64], a_direct[32], a_engine[64],
      a_depth[32], a_fsync[32], a_inval[32];
  snprintf(a_file, sizeof a_file, "--filename=%s", j->file);
  snprintf(a_rw, sizeof a_rw, "--rw=%s", j->rw);
  snprintf(a_bs, sizeof a_bs, "--bs=%zu", j->bs);
  snprintf(a_size, sizeof a_size, "--size=%llu", (unsigned long long)j->size);
  snprintf(a_direct, sizeof a_direct, "--direct=%d", j->direct);
  snprintf(a_engine, sizeof a_engine, "--ioengine=%s", j->engine);
  snprintf(a_depth, sizeof a_depth, "--iodepth=%d", j->depth);
  snprintf(a_fsync, sizeof a_fsync, "--end_fsync=%d", j->end_fsync);
  snprintf(a_inval, sizeof a_inval, "--invalidate=%d", j->invalidate);
  char a_fst[96] = "--numjobs=1"; /* a harmless repeat when unset */
  if (j->file_service)
    snprintf(a_fst, sizeof a_fst, "--file_service_type=%s", j->file_service);
  char a_jobs[48] = "--numjobs=1", a_group[32] = "--numjobs=1";
  if (j->numjobs > 1) {
    snprintf(a_jobs, sizeof a_jobs, "--numjobs=%d", j->numjobs);
    snprintf(a_group, sizeof a_group, "--group_reporting");
  }
  char *argv[] = {"fio",
                  "--name=kvtbench",
                  a_file,
                  a_rw,
                  a_bs,
                  a_size,
                  a_direct,
                  a_engine,
                  a_depth,
                  a_fsync,
                  a_inval,
                  a_fst,
                  a_jobs,
                  a_group,
                  "--output-format=json",
                  NULL};
  int st = 0;
  char *out = run_capture(
      argv, j->huge_buffers ? "GLIBC_TUNABLES=glibc.malloc.hugetlb=1" : NULL,
      &st);
  double v =
      out && WIFEXITED(st) && WEXITSTATUS(st) == 0 ? fio_bw(out, j->rw) : -1;
  free(out);
  if (v > 0) {
    *bw = v;
    return 0;
  }
  if (!j->quiet)
    fprintf(stderr, "fio failed (status %d): fio %s %s %s %s %s %s\n", st,
            a_file, a_rw, a_bs, a_size, a_direct, a_engine);
  return -1;
}

/* fdatasync (dirty pages cannot be dropped) + fadvise(DONTNEED) of fd. */
static int drop_fd(int fd) {
  fdatasync(fd);
  return posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) == 0 ? 0 : -1;
}

int bu_drop_cache(const char *path) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return -1;
  int rc = drop_fd(fd);
  close(fd);
  return rc;
}

/* Adds fd's cached and total pages (size bytes) to *resident / *pages. */
static void count_resident(int fd, size_t size, uint64_t *resident,
                           uint64_t *pages) {
  if (size == 0)
    return;
  size_t psz = (size_t)sysconf(_SC_PAGESIZE);
  void *m = mmap(NULL, size, PROT_READ, MAP_SHARED, fd, 0);
  if (m == MAP_FAILED)
    return;
  size_t np = (size + psz - 1) / psz;
  unsigned char *vec = malloc(np);
  if (vec && mincore(m, size, vec) == 0) {
    for (size_t i = 0; i < np; i++)
      *resident += vec[i] & 1;
    *pages += np;
  }
  free(vec);
  munmap(m, size);
}

int bu_evict_dir(const char *dir, double *resident) {
  DIR *dp = opendir(dir);
  if (!dp)
    return -1;
  uint64_t pages = 0, res = 0;
  struct dirent *de;
  while ((de = readdir(dp)) != NULL) {
    if (de->d_name[0] == '.')
      continue;
    char p[4500];
    snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
    int fd = open(p, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0)
      continue;
    struct stat st;
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) {
      drop_fd(fd);
      count_resident(fd, (size_t)st.st_size, &res, &pages);
    }
    close(fd);
  }
  fsync(dirfd(dp));
  closedir(dp);
  if (resident)
    *resident = pages ? (double)res / (double)pages : 0;
  return 0;
}

/* Evicts the open regular file fd (size bytes), counting its pages before
 * and after into acc. */
static void evict_fd(int fd, size_t size, bu_residency *acc) {
  uint64_t pages = 0, before = 0, after = 0;
  count_resident(fd, size, &before, &pages);
  drop_fd(fd);
  uint64_t p2 = 0;
  count_resident(fd, size, &after, &p2);
  acc->files++;
  acc->pages += pages;
  acc->before += before;
  acc->after += after;
}

int bu_evict_file(const char *path, bu_residency *acc) {
  int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0)
    return -1;
  struct stat st;
  int rc = -1;
  if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) {
    evict_fd(fd, (size_t)st.st_size, acc);
    rc = 0;
  }
  close(fd);
  return rc;
}

static void evict_rec(const char *dir, int depth, bu_residency *acc) {
  DIR *d = opendir(dir);
  if (!d)
    return;
  struct dirent *de;
  while ((de = readdir(d)) != NULL) {
    if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0)
      continue;
    /* chunks/sweep.pos is the writer sweep's resume mark: no promote reads
     * it, so it is not one of the files a cold read is measured over. */
    if (strcmp(de->d_name, "sweep.pos") == 0)
      continue;
    char p[4500];
    snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
    struct stat st;
    if (lstat(p, &st) != 0)
      continue;
    if (S_ISREG(st.st_mode))
      bu_evict_file(p, acc);
    else if (S_ISDIR(st.st_mode) && depth < 3)
      evict_rec(p, depth + 1, acc);
  }
  fsync(dirfd(d));
  closedir(d);
}

int bu_evict_tree(const char *dir, bu_residency *acc) {
  struct stat st;
  if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode))
    return -1;
  evict_rec(dir, 0, acc);
  return 0;
}

int bu_evict_entry(kvt_tier *t, const char *cache_dir, const char *token_hash,
                   bu_residency *acc) {
  char p[4500];
  snprintf(p, sizeof p, "%s/data/%s", cache_dir, token_hash);
  if (bu_evict_tree(p, acc) != 0)
    return KVT_EIO;
  kvt_chunk_info *ch = NULL;
  size_t n = 0;
  int rc =
      kvt_tier_entry_chain(&ch, &n, NULL, t, token_hash, KVT_CHAIN_NO_SHARING);
  if (rc != 0)
    return rc;
  for (size_t i = 0; i < n; i++) {
    snprintf(p, sizeof p, "%s/chunks/%.2s/%s.kvc", cache_dir, ch[i].key,
             ch[i].key);
    bu_evict_file(p, acc);
  }
  kvt_free(ch);
  return 0;
}

double bu_resident_after(const bu_residency *r) {
  return r->pages ? (double)r->after / (double)r->pages : 0;
}

unsigned bu_figure_flags(double value, double limit, double resident) {
  unsigned f = 0;
  if (limit > 0 && value > limit)
    f |= BU_FIG_ABOVE_LIMIT;
  if (resident > BU_COLD_RESIDENT_MAX)
    f |= BU_FIG_CACHED;
  return f;
}

const char *bu_figure_flag_text(unsigned flags) {
  if ((flags & BU_FIG_ABOVE_LIMIT) && (flags & BU_FIG_CACHED))
    return "NOT MEASURED: above its limit measured in this run, and its files "
           "were in the page cache";
  if (flags & BU_FIG_ABOVE_LIMIT)
    return "NOT MEASURED: above its limit measured in this run";
  if (flags & BU_FIG_CACHED)
    return "NOT THE DISK: its files were in the page cache";
  return "";
}

int bu_drop_all_caches(void) {
  sync();
  int fd = open("/proc/sys/vm/drop_caches", O_WRONLY | O_CLOEXEC);
  if (fd < 0)
    return -1;
  int ok = write(fd, "1\n", 2) == 2;
  close(fd);
  return ok ? 0 : -1;
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

/* One target line with the verdict given (NULL: PASS/MISS/info from want). */
static int report_line(const char *name, double value, double limit,
                       double ratio, const char *unit, const char *limit_desc,
                       double want, int higher_better, const char *verdict) {
  int ok = want <= 0 || (higher_better ? ratio >= want : ratio <= want);
  char tgt[32] = "-";
  if (want > 0)
    snprintf(tgt, sizeof tgt, "%s %.2f", higher_better ? ">=" : "<=", want);
  printf(
      "%-34s %10.3f %-5s limit %10.3f %-5s ratio %6.3f  target %-8s %s  [%s]\n",
      name, value, unit, limit, unit, ratio, tgt,
      verdict     ? verdict
      : want <= 0 ? "info"
      : ok        ? "PASS"
                  : "MISS",
      limit_desc);
  fflush(stdout);
  return ok;
}

int bu_report_ratio(const char *name, double value, double limit, double ratio,
                    const char *unit, const char *limit_desc, double want,
                    int higher_better) {
  return report_line(name, value, limit, ratio, unit, limit_desc, want,
                     higher_better, NULL);
}

int bu_report_limit(const char *name, double value, double limit, double ratio,
                    const char *unit, const char *limit_desc, double want,
                    double resident) {
  unsigned f = bu_figure_flags(value, limit, resident);
  int ok = report_line(name, value, limit, ratio, unit, limit_desc, want, 1,
                       f ? "FLAG" : NULL);
  if (resident >= 0)
    printf("%-34s page cache before the cold read: %.2f%% resident\n", "",
           resident * 100);
  if (f)
    printf("%-34s %s\n", "", bu_figure_flag_text(f));
  fflush(stdout);
  return f ? 0 : ok;
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

static void set_tensor(kvt_tensor *t, kvt_dtype dt, uint32_t ndim,
                       const int64_t *shape) {
  memset(t, 0, sizeof *t);
  t->dtype = dt;
  t->ndim = ndim;
  uint64_t n = kvt_dtype_size(dt);
  for (uint32_t i = 0; i < ndim; i++) {
    t->shape[i] = shape[i];
    n *= (uint64_t)shape[i];
  }
  t->nbytes = n;
}

int bu_layout_make(bu_layout *l, const bu_layout_spec *s) {
  memset(l, 0, sizeof *l);
  const int64_t H = s->heads, T = s->n_tokens, D = s->dim;
  l->n_layers = s->n_layers;
  l->layers = calloc(s->n_layers ? s->n_layers : 1, sizeof *l->layers);
  l->tensors =
      calloc((size_t)(s->n_layers ? s->n_layers : 1) * 6, sizeof *l->tensors);
  if (!l->layers || !l->tensors) {
    bu_layout_free(l);
    return -1;
  }
  uint32_t ti = 0;
  for (uint32_t i = 0; i < s->n_layers; i++) {
    kvt_layer *L = &l->layers[i];
    kvt_tensor *t = &l->tensors[ti];
    if (s->model == BU_MODEL_QUANTIZED) {
      kvt_layer_init(L, KVT_LAYER_QUANTIZED_KV);
      L->bits = s->bits;
      L->group_size = s->group_size;
      int64_t packed[4] = {1, H, T, D * s->bits / 32};
      int64_t groups[4] = {1, H, T, D / s->group_size};
      for (int kv = 0; kv < 2; kv++) {
        set_tensor(&t[kv * 3 + 0], KVT_DTYPE_U32, 4, packed);
        set_tensor(&t[kv * 3 + 1], s->dtype, 4, groups);
        set_tensor(&t[kv * 3 + 2], s->dtype, 4, groups);
      }
      L->num_tensors = 6;
      L->offset = T;
    } else if (s->model == BU_MODEL_HYBRID && i % 4 != 3) {
      kvt_layer_init(L, KVT_LAYER_ARRAYS);
      int64_t conv[3] = {1, 3, 8192};
      set_tensor(&t[0], s->dtype, 3, conv);
      set_tensor(&t[1], KVT_DTYPE_F32, s->ssm_ndim, s->ssm_shape);
      L->num_tensors = 2;
    } else {
      kvt_layer_init(L, KVT_LAYER_KV);
      int64_t shape[4] = {1, H, T, D};
      set_tensor(&t[0], s->dtype, 4, shape);
      set_tensor(&t[1], s->dtype, 4, shape);
      L->num_tensors = 2;
      L->offset = T;
    }
    L->tensors = t;
    ti += L->num_tensors;
    l->kinds[L->kind]++;
  }
  l->n_tensors = ti;
  for (uint32_t i = 0; i < ti; i++)
    l->bytes += l->tensors[i].nbytes;
  return 0;
}

void bu_layout_free(bu_layout *l) {
  free(l->layers);
  free(l->tensors);
  memset(l, 0, sizeof *l);
}

void bu_workload_make(bu_workload *w, uint32_t n_layers, int hybrid,
                      kvt_dtype dt, int64_t heads, size_t n_tokens, int64_t dim,
                      int32_t salt) {
  memset(w, 0, sizeof *w);
  bu_layout_spec s = {.n_layers = n_layers,
                      .model = hybrid ? BU_MODEL_HYBRID : BU_MODEL_KV,
                      .dtype = dt,
                      .heads = heads,
                      .n_tokens = (int64_t)n_tokens,
                      .dim = dim,
                      .ssm_ndim = 4,
                      .ssm_shape = {1, 64, 128, 128}};
  w->n_tokens = n_tokens;
  w->tokens = malloc((n_tokens ? n_tokens : 1) * sizeof(int32_t));
  if (!w->tokens || bu_layout_make(&w->layout, &s) != 0)
    abort();
  for (size_t i = 0; i < n_tokens; i++)
    w->tokens[i] = (int32_t)((i * 2654435761u + (uint32_t)salt) % 128000u);
  w->layers = w->layout.layers;
  w->n_layers = n_layers;
  w->bytes = w->layout.bytes;
  /* Tensor j of layer i is seeded i * 2 + 1 + j. */
  for (uint32_t i = 0; i < n_layers; i++)
    for (uint32_t j = 0; j < w->layers[i].num_tensors; j++) {
      kvt_tensor *t = &w->layers[i].tensors[j];
      void *p = NULL;
      if (posix_memalign(&p, 4096, t->nbytes ? t->nbytes : 1) != 0)
        abort();
      fill(p, t->nbytes, i * 2 + 1 + j); /* touched: resident like a KV cache */
      t->data = p;
    }
}

void bu_workload_free(bu_workload *w) {
  for (uint32_t i = 0; i < w->layout.n_tensors; i++)
    free(w->layout.tensors[i].data);
  bu_layout_free(&w->layout);
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
