/*
 * test_multiproc_tier.c - two real processes on one cache directory. kvtier's
 * policy is one writer process per directory (an flock on
 * cache_dir/kvtier.lock) plus any number of KVT_OPEN_READONLY readers. Checked
 * with fork+exec'd processes: while a writer holds the directory, a second
 * writer process is refused with KVT_EBUSY and a clear message, a reader
 * process opens and promotes; once the writer closes, another process can
 * write. Then a reader process promotes in a loop (reopening to see new
 * entries) while the writer process spills new entries and replacements and
 * evicts (max_entries): every entry the reader is handed is exactly one version
 * that was spilled for its key - never torn or mixed data - and afterwards the
 * directory is consistent. KVT_MULTIPROC_SECONDS (default 4) bounds the race.
 * Last, a process that forks (without exec) after using the tier: parent and
 * child then promote at the same time, and both must read exact data without
 * hanging (no I/O state, such as a cached io_uring ring, may be shared).
 */
#include "rel_tier.h"

#include <signal.h>
#include <sys/wait.h>
#include <time.h>

#define N_KEYS 12
#define N_VERS 6

static char g_self[4096];

static t_entry make_version(int k, int v) {
  t_entry e =
      t_make((uint64_t)k * 1000u + (uint64_t)v, 14 + (size_t)k, 2, 4, 8);
  kvt_rng r = {(uint64_t)k + 77};
  for (size_t i = 0; i < e.n_tokens; i++)
    e.tokens[i] = (int32_t)(kvt_rng_next(&r) % 40000);
  return e;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Runs this binary with a role; returns the pid. */
static pid_t spawn(const char *role, const char *dir, const char *arg) {
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    execl(g_self, g_self, role, dir, arg ? arg : "", (char *)NULL);
    _exit(127);
  }
  return pid;
}

static int wait_code(pid_t pid) {
  int st = 0;
  REQUIRE(waitpid(pid, &st, 0) == pid);
  return WIFEXITED(st) ? WEXITSTATUS(st)
                       : 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
}

/* ---- child roles (exit codes: 0 as expected, 1 not) --------------------- */

static int role_try_writer(const char *dir, const char *expect) {
  kvt_options o = rel_opts(dir, KVT_DURABILITY_NONE);
  kvt_tier *t = NULL;
  int rc = kvt_tier_open(&t, &o);
  if (!strcmp(expect, "busy")) {
    if (rc != KVT_EBUSY || t || !strstr(kvt_last_error(), "another writer")) {
      fprintf(stderr, "second writer: got %d (%s)\n", rc, kvt_last_error());
      return 1;
    }
    return 0;
  }
  if (rc != 0) {
    fprintf(stderr, "writer open after close: %d (%s)\n", rc, kvt_last_error());
    return 1;
  }
  kvt_tier_start_writer(t);
  t_entry e = make_version(1, 1);
  int ok = t_spill(t, &e) == 0 && kvt_tier_flush(t, -1) == 0;
  t_free(&e);
  kvt_tier_close(t, -1);
  kvt_tier_free(t);
  return ok ? 0 : 1;
}

/* Promotes every key; data must be one of the spilled versions. Returns 1 on
 * wrong data. */
static int promote_all(kvt_tier *t, long *ok, long *miss, long *fail) {
  for (int k = 0; k < N_KEYS; k++) {
    t_entry probe = make_version(k, 0);
    kvt_entry *got = NULL;
    int rc = kvt_tier_promote(&got, t, probe.tokens, probe.n_tokens, NULL);
    t_free(&probe);
    if (rc == 0) {
      int match = 0;
      for (int v = 0; v <= N_VERS && !match; v++) {
        t_entry e = make_version(k, v);
        match = t_same(got, &e);
        t_free(&e);
      }
      kvt_entry_free(got);
      if (!match) {
        fprintf(stderr, "reader: key %d served data of no spilled version\n",
                k);
        return 1;
      }
      (*ok)++;
    } else if (rc == KVT_ENOTFOUND) {
      (*miss)++;
    } else {
      (*fail)++; /* e.g. the entry was replaced or evicted under the reader:
                    refused, fine */
      if (rc != KVT_ECORRUPT && rc != KVT_EIO && rc != KVT_EAGAIN) {
        fprintf(stderr, "reader: unexpected %d (%s)\n", rc, kvt_last_error());
        return 1;
      }
    }
  }
  return 0;
}

static int role_reader(const char *dir, const char *secs) {
  double end = now_s() + atof(secs);
  long ok = 0, miss = 0, fail = 0, opens = 0;
  do {
    kvt_options o = rel_opts(dir, KVT_DURABILITY_NONE);
    o.flags = KVT_OPEN_READONLY;
    kvt_tier *t = NULL;
    int rc = kvt_tier_open(&t, &o);
    if (rc != 0) {
      fprintf(stderr, "reader open: %d (%s)\n", rc, kvt_last_error());
      return 1;
    }
    opens++;
    int bad = 0;
    for (int r = 0; r < 5 && !bad; r++)
      bad = promote_all(t, &ok, &miss, &fail);
    kvt_tier_close(t, -1);
    kvt_tier_free(t);
    if (bad)
      return 1;
  } while (now_s() < end);
  printf("reader: %ld opens, %ld promotes served (all exact), %ld misses, %ld "
         "refused\n",
         opens, ok, miss, fail);
  fflush(stdout);
  return ok > 0 ? 0 : 1;
}

/* ---- the parent's tests -------------------------------------------------- */

static void test_writer_lock(void) {
  char *dir = rel_path(kvt_test_tmpdir("mp-lock"), "cache", NULL);
  kvt_options o = rel_opts(dir, KVT_DURABILITY_NONE);
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  t_entry e = make_version(1, 0);
  REQUIRE(t_spill(t, &e) == 0 && kvt_tier_flush(t, -1) == 0);
  t_free(&e);
  CHECK_EQ_INT(wait_code(spawn("try-writer", dir, "busy")), 0);
  CHECK_EQ_INT(wait_code(spawn("reader", dir, "0")), 0);
  /* The same process cannot open a second writer either. */
  kvt_tier *t2 = NULL;
  CHECK_EQ_INT(kvt_tier_open(&t2, &o), KVT_EBUSY);
  CHECK(t2 == NULL);
  kvt_tier_close(t, -1);
  kvt_tier_free(t);
  CHECK_EQ_INT(wait_code(spawn("try-writer", dir, "ok")), 0);
  rel_check_dir(dir, NULL);
  free(dir);
}

static void test_reader_during_writes(void) {
  double secs = (double)r_env_long("KVT_MULTIPROC_SECONDS", 4);
  char *dir = rel_path(kvt_test_tmpdir("mp-race"), "cache", NULL);
  kvt_options o = rel_opts(dir, KVT_DURABILITY_NONE);
  o.max_entries = N_KEYS - 3; /* evictions too */
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  for (int k = 0; k < N_KEYS; k++) {
    t_entry e = make_version(k, 0);
    REQUIRE(t_spill(t, &e) == 0);
    t_free(&e);
  }
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  char arg[32];
  snprintf(arg, sizeof arg, "%g", secs);
  pid_t reader = spawn("reader", dir, arg);
  kvt_rng r = {31337};
  long spills = 0;
  double end = now_s() + secs;
  while (now_s() < end) {
    int k = (int)(kvt_rng_next(&r) % N_KEYS),
        v = 1 + (int)(kvt_rng_next(&r) % N_VERS);
    t_entry e = make_version(k, v);
    int rc = t_spill(t, &e);
    CHECK(rc == 0 || rc == KVT_EFULL);
    spills += rc == 0;
    t_free(&e);
    if (spills % 16 == 0)
      kvt_tier_flush(t, -1);
  }
  CHECK_EQ_INT(wait_code(reader), 0);
  kvt_stats st = KVT_STATS_INIT;
  kvt_tier_stats(&st, t);
  fprintf(
      stderr,
      "writer: %ld spills, %llu evictions, %llu write failures while a reader "
      "process promoted\n",
      spills, (unsigned long long)st.evictions,
      (unsigned long long)st.write_failures);
  CHECK_EQ_INT(st.write_failures, 0);
  CHECK_EQ_INT(kvt_tier_close(t, -1), 0);
  kvt_tier_free(t);
  rel_check_dir(dir, NULL);
  free(dir);
}

/* Forks without exec after the parent has used a tier (servers that fork
 * workers, Python's multiprocessing "fork"): the child must not share any I/O
 * state with the parent - e.g. a cached io_uring instance, whose rings a fork
 * shares - so parent and child promote at the same time, on their own tiers
 * over copies of one directory, and each must read exactly what was spilled. */
static int promote_loop(const char *dir, int rounds) {
  kvt_options o = rel_opts(dir, KVT_DURABILITY_NONE);
  kvt_tier *t = NULL;
  if (kvt_tier_open(&t, &o) != 0)
    return 1;
  long ok = 0, miss = 0, fail = 0;
  int bad = 0;
  for (int r = 0; r < rounds && !bad; r++)
    bad = promote_all(t, &ok, &miss, &fail);
  kvt_tier_close(t, -1);
  kvt_tier_free(t);
  if (!bad && (miss || fail))
    fprintf(stderr, "fork: %ld served, %ld missing, %ld failed (%s)\n", ok,
            miss, fail, kvt_last_error());
  return bad || miss || fail;
}

static void on_alarm(int sig) {
  (void)sig;
  static const char msg[] =
      "test_fork_after_use: promotes hung after fork (I/O state shared "
      "with the other process?)\n";
  if (write(2, msg, sizeof msg - 1) < 0) {
  }
  _exit(1);
}

static void test_fork_after_use(void) {
  /* A hang is a failure too: both processes give up after 60 s. */
  signal(SIGALRM, on_alarm);
  alarm(60);
  char *root = kvt_test_tmpdir("mp-fork");
  char *a = rel_path(root, "a", NULL), *b = rel_path(root, "b", NULL);
  kvt_options o = rel_opts(a, KVT_DURABILITY_NONE);
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  for (int k = 0; k < N_KEYS; k++) {
    t_entry e = make_version(k, 0);
    REQUIRE(t_spill(t, &e) == 0);
    t_free(&e);
  }
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  kvt_tier_close(t, -1);
  kvt_tier_free(t);
  r_copy_tree(a, b);
  chmod(b, 0700);
  CHECK_EQ_INT(promote_loop(a, 2), 0); /* the parent has used the read path */
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    alarm(60); /* alarms are not inherited across fork */
    _exit(promote_loop(b, 40));
  }
  CHECK_EQ_INT(promote_loop(a, 40), 0);
  int code = wait_code(pid);
  if (code != 0)
    fprintf(stderr, "  forked child's promotes failed (code %d)\n", code);
  CHECK_EQ_INT(code, 0);
  alarm(0);
  free(a);
  free(b);
}

int main(int argc, char **argv) {
  if (argc >= 3) {
    if (!strcmp(argv[1], "try-writer"))
      return role_try_writer(argv[2], argc > 3 ? argv[3] : "");
    if (!strcmp(argv[1], "reader"))
      return role_reader(argv[2], argc > 3 ? argv[3] : "0");
    return 2;
  }
  r_use_fast_tmp();
  ssize_t n = readlink("/proc/self/exe", g_self, sizeof g_self - 1);
  if (n <= 0) {
    return kvt_test_skip_all("env", "no /proc/self/exe to re-run this test");
  }
  g_self[n] = '\0';
  RUN(test_writer_lock);
  RUN(test_reader_during_writes);
  RUN(test_fork_after_use);
  return kvt_test_done();
}
