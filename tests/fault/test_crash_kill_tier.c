/*
 * test_crash_kill_tier.c - real process crashes. Each trial forks a child that
 * opens the shared cache directory (durability FSYNC; the open purges and
 * reconciles what the previous crash left), starts the writer and spills a
 * seeded sequence of entries - new keys and new versions of existing keys
 * (replacements), with promotes in between - while spill_done_fn reports every
 * outcome (status + hash) through a pipe. The parent SIGKILLs the child at a
 * seeded random moment, then reopens the directory itself and checks: no
 * temporaries remain after reconcile, every indexed entry reads back and
 * verifies, every directory has a row, every entry the child was told was
 * written is still there, and each entry holds exactly one version that was
 * spilled for its key (the last acknowledged one or one spilled after it).
 * KVT_CRASH_TRIALS (default 500) and KVT_CRASH_SECONDS (default 45, wall time)
 * bound the run; KVT_CRASH_SEED changes the seed. The evicting variant runs
 * every call under a cache_salt on a chunked tier (chunk_tokens 16) whose
 * max_size_gb holds about a third of the keys, so the writer evicts leaf
 * chunks and entries all the time: an acknowledged entry may then be gone
 * (evicted), but what is served is still one possible version, and nothing
 * is ever quarantined (quarantine/ stays empty: an eviction cut by the kill
 * leaves nothing reconcile calls invalid). KVT_CRASH_EVICT_TRIALS (default
 * 30) and KVT_CRASH_EVICT_SECONDS (default 15) bound it;
 * The batching variant (a chunked tier, chunk_tokens 16) queues every spill
 * of a trial before it starts the writer, so the writer takes them in group
 * commits (batches of new keys: the directory starts empty each trial; a key
 * spilled twice splits a batch), and is killed inside them: an acknowledged
 * spill of a batch must survive exactly as one written alone.
 * KVT_CRASH_BATCH_TRIALS (default 40) and KVT_CRASH_BATCH_SECONDS (default
 * 15) bound it. scripts/crash-campaign.sh runs them at campaign size.
 */
#include "rel_tier.h"

#include <signal.h>
#include <sys/wait.h>
#include <time.h>

#define N_KEYS 24
#define N_SPILLS 24 /* per trial */
#define MAX_VERSIONS 4096

static char g_dir[4096];

/* Key k's tokens are fixed; version v's tensor data comes from seed k * 100000
 * + v. */
static t_entry make_version(int k, int v) {
  t_entry e =
      t_make((uint64_t)k * 100000u + (uint64_t)v, 20 + (size_t)k, 2, 4, 8);
  kvt_rng r = {(uint64_t)k + 1};
  for (size_t i = 0; i < e.n_tokens; i++)
    e.tokens[i] = (int32_t)(kvt_rng_next(&r) % 50000);
  return e;
}

typedef struct plan {
  int key[N_SPILLS], ver[N_SPILLS];
} plan;

static int g_next_ver[N_KEYS];

static void make_plan(plan *p, kvt_rng *r) {
  for (int j = 0; j < N_SPILLS; j++) {
    p->key[j] = (int)(kvt_rng_next(r) % N_KEYS);
    p->ver[j] = ++g_next_ver[p->key[j]];
  }
}

typedef struct ack {
  int32_t status;
  char hash[KVT_HASH_HEX_LEN + 1];
  char pad[3];
} ack;

static int g_pipe = -1;

static void child_done(void *ctx, const char *hash, int status) {
  (void)ctx;
  ack a;
  memset(&a, 0, sizeof a);
  a.status = status;
  memcpy(a.hash, hash, KVT_HASH_HEX_LEN + 1);
  if (write(g_pipe, &a, sizeof a) != (ssize_t)sizeof a)
    _exit(3);
}

static int g_durability = KVT_DURABILITY_FSYNC;
static int g_evict; /* the salted, chunked, evicting variant */
static int g_batch; /* the chunked variant whose spills queue up first */
static unsigned long long g_batched; /* spills_batched of a full child run */
static const char g_salt[] = "kill-tenant";

/* The variant's options on top of rel_opts. */
static kvt_options opts_for(int durability) {
  kvt_options o = rel_opts(g_dir, durability);
  if (g_batch) {
    o.chunk_tokens = 16;
    o.admission_policy = KVT_ADMIT_WRITE_ALL; /* as below */
  }
  if (g_evict) {
    o.chunk_tokens = 16;
    o.max_size_gb = 24.0 * 1024 / (1024.0 * 1024.0 * 1024.0);
    /* Outcomes are matched to spills by their order: a spill declined by
     * the default's admission would shift them, so every spill is written. */
    o.admission_policy = KVT_ADMIT_WRITE_ALL;
  }
  return o;
}
static kvt_call_opts call_opts(void) {
  kvt_call_opts co;
  kvt_call_opts_init(&co, KVT_CALL_OPTS_VERSION);
  if (g_evict) {
    co.cache_salt = g_salt;
    co.cache_salt_len = sizeof g_salt - 1;
  }
  return co;
}
static int promote(kvt_entry **out, kvt_tier *t, const t_entry *q) {
  kvt_promote_opts po = t_popts(NULL);
  if (g_evict) {
    po.cache_salt = g_salt;
    po.cache_salt_len = sizeof g_salt - 1;
  }
  return kvt_tier_promote(out, t, q->tokens, q->n_tokens, &po);
}

static void child(const plan *p) {
  kvt_options o = opts_for(g_durability);
  o.spill_done_fn = child_done;
  kvt_call_opts co = call_opts();
  kvt_tier *t = NULL;
  if (kvt_tier_open(&t, &o) != 0) {
    fprintf(stderr, "child: open failed: %s\n", kvt_last_error());
    _exit(2);
  }
  if (!g_batch && kvt_tier_start_writer(t) != 0)
    _exit(2);
  for (int j = 0; j < N_SPILLS; j++) {
    t_entry e = make_version(p->key[j], p->ver[j]);
    int rc = kvt_tier_spill_ex(t, e.tokens, e.n_tokens, e.layers, e.n_layers,
                               e.memory_bytes, &co);
    if (rc != 0)
      _exit(4);
    t_free(&e);
    if (g_batch)
      continue; /* queued: the writer starts after the last one */
    t_entry q = make_version(p->key[(j * 7) % N_SPILLS], 0);
    kvt_entry *got = NULL;
    promote(&got, t, &q);
    kvt_entry_free(got);
    t_free(&q);
  }
  if (g_batch) {
    if (kvt_tier_start_writer(t) != 0)
      _exit(2);
    for (int j = 0; j < N_SPILLS; j++) { /* reads while the batches go */
      t_entry q = make_version(p->key[(j * 7) % N_SPILLS], 0);
      kvt_entry *got = NULL;
      promote(&got, t, &q);
      kvt_entry_free(got);
      t_free(&q);
    }
  }
  kvt_tier_flush(t, -1);
  kvt_stats st = rel_stats(t);
  ack end;
  memset(&end, 0, sizeof end);
  end.status = 999;
  snprintf(end.hash, sizeof end.hash, "%llu",
           (unsigned long long)st.spills_batched);
  if (write(g_pipe, &end, sizeof end) < 0)
    _exit(3);
  for (;;)
    pause();
}

/* What the parent knows per key: versions that may legitimately be stored. */
typedef struct keystate {
  int n;
  int ver[64];
  int must_exist; /* a version was acknowledged (or found after the last check)
                   */
} keystate;
static keystate g_ks[N_KEYS];

static void ks_add(keystate *k, int v) {
  if (k->n < 64)
    k->ver[k->n++] = v;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Runs one trial; delay_us < 0 lets the child finish (calibration). Returns the
 * child's run time until its end marker (or the kill). */
static double trial(const plan *p, long delay_us, int *acked_out,
                    int *killed_mid) {
  int fds[2];
  REQUIRE(pipe(fds) == 0);
  double t0 = now_s();
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    close(fds[0]);
    g_pipe = fds[1];
    child(p);
    _exit(0);
  }
  close(fds[1]);
  int ended = 0;
  if (delay_us >= 0) {
    struct timespec ts = {delay_us / 1000000, (delay_us % 1000000) * 1000};
    nanosleep(&ts, NULL);
  } else {
    /* Calibration: wait for the end marker. */
    ack a;
    for (;;) {
      ssize_t r = read(fds[0], &a, sizeof a);
      REQUIRE(r == (ssize_t)sizeof a);
      if (a.status == 999)
        break;
    }
    g_batched = strtoull(a.hash, NULL, 10);
    ended = 1;
  }
  double dt = now_s() - t0;
  kill(pid, SIGKILL);
  int wst = 0;
  REQUIRE(waitpid(pid, &wst, 0) == pid);
  if (!(WIFSIGNALED(wst) && WTERMSIG(wst) == SIGKILL)) {
    fprintf(stderr, "child exited on its own: status %d\n",
            WIFEXITED(wst) ? WEXITSTATUS(wst) : -1);
    CHECK(0);
  }
  /* Outcomes in spill order (one writer, FIFO). */
  int acked = 0;
  ack a;
  int j = 0;
  if (!ended) {
    while (read(fds[0], &a, sizeof a) == (ssize_t)sizeof a) {
      if (a.status == 999) {
        ended = 1;
        break;
      }
      REQUIRE(j < N_SPILLS);
      t_entry e = make_version(p->key[j], p->ver[j]);
      char h[65];
      kvt_token_hash(h, e.tokens, e.n_tokens);
      t_free(&e);
      CHECK(g_evict || strcmp(h, a.hash) == 0); /* salted: another name */
      CHECK_EQ_INT(a.status, 0);
      if (a.status == 0) {
        keystate *k = &g_ks[p->key[j]];
        k->n = 0; /* acknowledged: this version or a later one */
        ks_add(k, p->ver[j]);
        k->must_exist = 1;
        acked++;
      }
      j++;
    }
  } else {
    for (j = 0; j < N_SPILLS; j++) {
      keystate *k = &g_ks[p->key[j]];
      k->n = 0;
      ks_add(k, p->ver[j]);
      k->must_exist = 1;
      acked++;
    }
  }
  close(fds[0]);
  /* Spills not acknowledged may have been published or not: any later version
   * is possible. */
  for (int x = j; x < N_SPILLS; x++)
    ks_add(&g_ks[p->key[x]], p->ver[x]);
  *acked_out = acked;
  *killed_mid = !ended;
  return dt;
}

typedef struct totals {
  long trials, killed_mid, acked, checked, lost, wrong, evicted, quarantined;
} totals;

static int quarantine_count(void) {
  char q[4200];
  snprintf(q, sizeof q, "%s/quarantine", g_dir);
  struct stat st;
  return stat(q, &st) == 0 ? kvt_test_count_dir(q, NULL) : 0;
}

/* Reopens and checks every key against what may be stored; then pins what was
 * found. */
static void check_state(totals *tot) {
  /* What the killed child's open and run left in quarantine/: nothing. */
  int nq = quarantine_count();
  if (g_evict && nq) {
    tot->quarantined += nq;
    fprintf(stderr, "  %d entries in quarantine/\n", nq);
    CHECK_EQ_INT(nq, 0);
  }
  rel_check_dir(g_dir, NULL);
  kvt_options o = opts_for(KVT_DURABILITY_NONE);
  kvt_tier *t = t_open(&o);
  for (int k = 0; k < N_KEYS; k++) {
    keystate *ks = &g_ks[k];
    t_entry probe = make_version(k, 0);
    kvt_entry *got = NULL;
    int rc = promote(&got, t, &probe);
    t_free(&probe);
    if (rc != 0) {
      if (g_evict && ks->must_exist) {
        tot->evicted++; /* capacity: acknowledged, then evicted */
        ks->must_exist = 0;
      }
      if (ks->must_exist) {
        tot->lost++;
        fprintf(stderr, "  key %d: acknowledged entry lost (%d: %s)\n", k, rc,
                kvt_last_error());
      }
      CHECK(!ks->must_exist);
      CHECK_EQ_INT(rc, KVT_ENOTFOUND);
      ks->n = 0;
      continue;
    }
    tot->checked++;
    int found = -1;
    for (int i = 0; i < ks->n && found < 0; i++) {
      t_entry e = make_version(k, ks->ver[i]);
      if (t_same(got, &e))
        found = ks->ver[i];
      t_free(&e);
    }
    kvt_entry_free(got);
    if (found < 0) {
      tot->wrong++;
      fprintf(stderr, "  key %d: stored version is none of the %d possible\n",
              k, ks->n);
    }
    CHECK(found >= 0);
    ks->n = 0;
    if (found >= 0)
      ks_add(ks, found);
    ks->must_exist = 1;
  }
  if (g_evict) {
    kvt_stats st = rel_stats(t);
    tot->quarantined += (long)st.quarantined;
    CHECK_EQ_INT(st.quarantined, 0);
  }
  CHECK_EQ_INT(kvt_tier_close(t, -1), 0);
  kvt_tier_free(t);
}

static void run_kills(long max_trials, double budget, uint64_t seed) {
  kvt_rng rng = {seed};
  memset(g_ks, 0, sizeof g_ks);
  totals tot = {0};
  plan p;
  int acked, mid;
  make_plan(&p, &rng);
  double full = trial(&p, -1, &acked, &mid);
  check_state(&tot);
  if (g_batch) {
    fprintf(stderr, "calibration: %llu of %d spills group-committed\n",
            g_batched, N_SPILLS);
    CHECK(g_batched >= N_SPILLS / 3); /* or no batch is killed below */
  }
  long span_us = (long)(full * 1.3e6) + 1000;
  fprintf(stderr, "calibration: a full child run takes %.1f ms\n", full * 1000);
  double t0 = now_s();
  for (long i = 0; i < max_trials && now_s() - t0 < budget; i++) {
    if (g_batch) { /* new keys only: batches are of new entries */
      kvt_test_rmtree(g_dir);
      memset(g_ks, 0, sizeof g_ks);
    }
    make_plan(&p, &rng);
    /* A process crash loses nothing the kernel has: both durability modes must
     * keep every acknowledged entry. Odd trials run without fsync. */
    g_durability = (i & 1) ? KVT_DURABILITY_NONE : KVT_DURABILITY_FSYNC;
    long delay = (long)(kvt_rng_next(&rng) % (uint64_t)span_us);
    trial(&p, delay, &acked, &mid);
    tot.trials++;
    tot.killed_mid += mid;
    tot.acked += acked;
    int before = kvt_test_failures;
    check_state(&tot);
    if (kvt_test_failures != before) {
      fprintf(stderr, "  (trial %ld, kill after %ld us)\n", i, delay);
      if (kvt_test_failures - before > 20)
        break;
    }
  }
  fprintf(stderr,
          "crash: %ld SIGKILL trials (%ld mid-run) in %.1f s, %ld acknowledged "
          "spills, "
          "%ld key checks: %ld lost, %ld wrong version%s\n",
          tot.trials, tot.killed_mid, now_s() - t0, tot.acked, tot.checked,
          tot.lost, tot.wrong,
          g_evict   ? " (salted, evicting)"
          : g_batch ? " (spills queued first: group commits)"
                    : "");
  if (g_evict)
    fprintf(stderr,
            "  evicting: %ld acknowledged entries evicted, %ld quarantined\n",
            tot.evicted, tot.quarantined);
  CHECK(tot.trials >= 10);
  CHECK(!g_evict || tot.evicted > 0); /* it did evict */
}

static void test_crash_kill(void) {
  g_evict = 0;
  run_kills(r_env_long("KVT_CRASH_TRIALS", 500),
            (double)r_env_long("KVT_CRASH_SECONDS", 45),
            (uint64_t)r_env_long("KVT_CRASH_SEED", 2026));
}

/* A variant in its own directory: its trials and seconds from the
 * environment (KVT_CRASH_<env>_TRIALS, _SECONDS), its own seed. */
static void run_variant(const char *tag, const char *env, long trials,
                        long seconds, uint64_t seed_add) {
  char te[64], se[64];
  snprintf(g_dir, sizeof g_dir, "%s/cache", kvt_test_tmpdir(tag));
  snprintf(te, sizeof te, "KVT_CRASH_%s_TRIALS", env);
  snprintf(se, sizeof se, "KVT_CRASH_%s_SECONDS", env);
  run_kills(r_env_long(te, trials), (double)r_env_long(se, seconds),
            (uint64_t)r_env_long("KVT_CRASH_SEED", 2026) + seed_add);
}

static void test_crash_kill_evicting(void) {
  g_evict = 1;
  run_variant("crash-kill-evict", "EVICT", 30, 15, 1);
  g_evict = 0;
}

static void test_crash_kill_batch(void) {
  g_batch = 1;
  run_variant("crash-kill-batch", "BATCH", 40, 15, 2);
  g_batch = 0;
}

int main(void) {
  r_use_fast_tmp();
  snprintf(g_dir, sizeof g_dir, "%s/cache", kvt_test_tmpdir("crash-kill"));
  RUN(test_crash_kill);
  RUN(test_crash_kill_evicting);
  RUN(test_crash_kill_batch);
  return kvt_test_done();
}
