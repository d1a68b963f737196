/*
 * test_remote_deadline_tier.c - a slow Redis peer cannot hold a caller longer
 * than the remote timeout (issue 18, item 5). The test runs its own small
 * server on 127.0.0.1 that speaks just enough RESP: it parses each command
 * and answers it, but sends every reply one byte per 0.5 s. hiredis's socket
 * timeouts bound each read(2) alone, so such a peer used to hold one promote
 * for tens of seconds at remote_timeout_ms = 1000 without counting an error.
 * Here, with the per-call deadline: a promote that misses locally returns
 * within three times the timeout (slack for sanitizer builds), the failure
 * counts in remote_errors, the remote is backed off (the next promote does not
 * wait at all), and a spill's upload and close are bounded the same way. Two
 * server behaviours: everything dribbled (the slot-map probe CLUSTER SLOTS
 * times out), and CLUSTER SLOTS answered at once with only the data commands
 * dribbled (the batch itself times out). Exit 77 when kvtier is built without
 * hiredis.
 */
#include "rel_tier.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <time.h>

#define TIMEOUT_MS 1000

typedef struct dribbler {
  int lfd, port;
  int fast_slots; /* answer CLUSTER SLOTS at once */
  atomic_int stop;
  atomic_int commands; /* data commands seen */
  atomic_int seen;     /* every command seen */
  pthread_t th;
  /* Connection threads, joined by dribbler_stop (so the next case's reuse
   * of this struct happens after their last access). */
  pthread_t conns[256];
  int n_conns; /* accept thread only, until joined */
} dribbler;

typedef struct conn_arg {
  dribbler *d;
  int fd;
} conn_arg;

/* Length of the first complete RESP command in buf (an array of bulk
 * strings), 0 when more bytes are needed, -1 when it is not RESP. first
 * receives the first argument (truncated to 31 bytes). */
static long resp_command(const char *buf, size_t n, char first[32]) {
  size_t i = 0;
  if (n < 1)
    return 0;
  if (buf[0] != '*')
    return -1;
  const char *e = memchr(buf, '\n', n);
  if (!e)
    return 0;
  long argc = strtol(buf + 1, NULL, 10);
  i = (size_t)(e - buf) + 1;
  first[0] = '\0';
  for (long a = 0; a < argc; a++) {
    if (i >= n)
      return 0;
    if (buf[i] != '$')
      return -1;
    e = memchr(buf + i, '\n', n - i);
    if (!e)
      return 0;
    long len = strtol(buf + i + 1, NULL, 10);
    i = (size_t)(e - buf) + 1;
    if (i + (size_t)len + 2 > n)
      return 0;
    if (a == 0) {
      size_t c = (size_t)len < 31 ? (size_t)len : 31;
      memcpy(first, buf + i, c);
      first[c] = '\0';
    }
    i += (size_t)len + 2;
  }
  return (long)i;
}

/* Sends s one byte per 500 ms (or all at once); 0, or -1 once the client
 * went away or the server stops. */
static int send_reply(dribbler *d, int fd, const char *s, int slow) {
  size_t n = strlen(s);
  if (!slow)
    return send(fd, s, n, MSG_NOSIGNAL) == (ssize_t)n ? 0 : -1;
  for (size_t k = 0; k < n; k++) {
    if (atomic_load(&d->stop) || send(fd, s + k, 1, MSG_NOSIGNAL) != 1)
      return -1;
    for (int w = 0; w < 10 && !atomic_load(&d->stop); w++)
      rel_sleep_ms(50);
  }
  return 0;
}

static void *conn_main(void *arg) {
  conn_arg *ca = arg;
  dribbler *d = ca->d;
  int fd = ca->fd;
  free(ca);
  char buf[1 << 16];
  size_t have = 0;
  while (!atomic_load(&d->stop)) {
    struct pollfd p = {fd, POLLIN, 0};
    if (poll(&p, 1, 50) <= 0)
      continue;
    ssize_t r = recv(fd, buf + have, sizeof buf - have, 0);
    if (r <= 0)
      break;
    have += (size_t)r;
    for (;;) {
      char first[32];
      long used = resp_command(buf, have, first);
      if (used < 0) {
        have = 0; /* not RESP: drop it */
        break;
      }
      if (used == 0)
        break;
      memmove(buf, buf + used, have - (size_t)used);
      have -= (size_t)used;
      atomic_fetch_add(&d->seen, 1);
      int rc;
      if (!strcasecmp(first, "CLUSTER"))
        rc = send_reply(d, fd,
                        "-ERR This instance has cluster support disabled\r\n",
                        !d->fast_slots);
      else {
        atomic_fetch_add(&d->commands, 1);
        rc = send_reply(d, fd, "$-1\r\n", 1);
      }
      if (rc != 0)
        goto out;
    }
    if (have == sizeof buf)
      have = 0; /* a huge value: not parsed, never answered */
  }
out:
  close(fd);
  return NULL;
}

static void *accept_main(void *arg) {
  dribbler *d = arg;
  while (!atomic_load(&d->stop)) {
    struct pollfd p = {d->lfd, POLLIN, 0};
    if (poll(&p, 1, 50) <= 0)
      continue;
    int fd = accept(d->lfd, NULL, NULL);
    if (fd < 0)
      continue;
    conn_arg *ca = malloc(sizeof *ca);
    ca->d = d;
    ca->fd = fd;
    if (d->n_conns < (int)(sizeof d->conns / sizeof d->conns[0]) &&
        pthread_create(&d->conns[d->n_conns], NULL, conn_main, ca) == 0)
      d->n_conns++;
    else {
      close(fd);
      free(ca);
    }
  }
  return NULL;
}

static void dribbler_start(dribbler *d, int fast_slots) {
  memset(d, 0, sizeof *d);
  d->fast_slots = fast_slots;
  d->lfd = socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(d->lfd >= 0);
  struct sockaddr_in a;
  memset(&a, 0, sizeof a);
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(bind(d->lfd, (struct sockaddr *)&a, sizeof a) == 0);
  REQUIRE(listen(d->lfd, 16) == 0);
  socklen_t l = sizeof a;
  REQUIRE(getsockname(d->lfd, (struct sockaddr *)&a, &l) == 0);
  d->port = ntohs(a.sin_port);
  REQUIRE(pthread_create(&d->th, NULL, accept_main, d) == 0);
}

static void dribbler_stop(dribbler *d) {
  atomic_store(&d->stop, 1);
  pthread_join(d->th, NULL);
  close(d->lfd);
  /* connection threads notice the flag within 50 ms */
  for (int i = 0; i < d->n_conns; i++)
    pthread_join(d->conns[i], NULL);
}

static void run_case(int fast_slots) {
  dribbler d;
  dribbler_start(&d, fast_slots);
  char url[64];
  snprintf(url, sizeof url, "redis://127.0.0.1:%d", d.port);
  kvt_options o = t_opts(fast_slots ? "dl-fast" : "dl-slow");
  o.remote_url = url;
  o.remote_mode = KVT_REMOTE_LOCAL_AND_REMOTE;
  o.remote_timeout_ms = TIMEOUT_MS;
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  t_entry e = t_make(41, 16, 2, 4, 4);

  kvt_entry *got = NULL;
  double t0 = rel_now_ms();
  int rc = kvt_tier_promote(&got, t, e.tokens, e.n_tokens, NULL);
  double dt = rel_now_ms() - t0;
  fprintf(stderr, "  promote against the dribbling peer: %d after %.0f ms\n",
          rc, dt);
  CHECK_EQ_INT(rc, KVT_ENOTFOUND);
  CHECK(got == NULL);
  /* Bounded: the deadline is TIMEOUT_MS; the slack covers sanitizer builds on
   * two shared cores (the unbounded wait this guards against was tens of
   * seconds). */
  CHECK(dt < 3 * TIMEOUT_MS);
  kvt_stats s = rel_stats(t);
  CHECK(s.remote_errors >= 1);
  if (fast_slots)
    CHECK(atomic_load(&d.commands) >= 1); /* the batch itself timed out */
  /* Backed off: the next promote does not wait for the peer at all. */
  t0 = rel_now_ms();
  rc = kvt_tier_promote(&got, t, e.tokens, e.n_tokens, NULL);
  dt = rel_now_ms() - t0;
  CHECK_EQ_INT(rc, KVT_ENOTFOUND);
  CHECK(dt < TIMEOUT_MS); /* a promote that asked the peer would wait it out */
  /* Once the back-off has passed (0.25 s after the first failure), a spill
   * (local copy plus an upload the peer stalls), then close: bounded too. */
  rel_sleep_ms(400);
  int seen = atomic_load(&d.seen);
  CHECK_EQ_INT(t_spill(t, &e), 0);
  t0 = rel_now_ms();
  rc = kvt_tier_close(t, -1);
  dt = rel_now_ms() - t0;
  fprintf(stderr, "  close with an upload to the dribbling peer: %.0f ms\n",
          dt);
  CHECK_EQ_INT(rc, 0);
  CHECK(dt < 3 * TIMEOUT_MS);
  CHECK(atomic_load(&d.seen) > seen); /* the upload did talk to the peer */
  kvt_tier_free(t);
  t_free(&e);
  dribbler_stop(&d);
}

static void test_everything_dribbled(void) {
  run_case(0);
}

static void test_data_commands_dribbled(void) {
  run_case(1);
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  {
    kvt_options o = t_opts("dl-probe");
    o.remote_url = "redis://127.0.0.1:1";
    o.remote_mode = KVT_REMOTE_ONLY;
    kvt_tier *t = NULL;
    int rc = kvt_tier_open(&t, &o);
    kvt_tier_free(t);
    if (rc == KVT_EUNSUPPORTED) {
      fprintf(stderr, "skip: kvtier built without hiredis\n");
      return 77;
    }
  }
  RUN(test_everything_dribbled);
  RUN(test_data_commands_dribbled);
  return kvt_test_done();
}
