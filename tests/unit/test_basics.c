/*
 * test_basics.c - unit tests for the small foundation modules: version, error
 * codes and the thread-local last error, SHA-256 token keys (against known
 * digests computed by Python's hashlib over array('i', tokens).tobytes()), xxh3
 * formatting, entry-name validation, and options defaults/validation with the
 * reference's messages.
 */
#include "testutil.h"
#include "base/error.h"
#include "base/hash.h"
#include "tier/options.h"

#include <pthread.h>
#include <string.h>

static void test_version(void) {
  CHECK(strcmp(kvt_version(), KVT_VERSION_STRING) == 0);
  CHECK_EQ_INT(kvt_version_number(), KVT_VERSION_NUMBER);
}

static void test_errors(void) {
  CHECK(strcmp(kvt_strerror(KVT_OK), "success") == 0);
  CHECK(strcmp(kvt_strerror(12345), "unknown error") == 0);
  for (int c = 0; c >= KVT_ERANGE; c--)
    CHECK(strcmp(kvt_strerror(c), "unknown error") != 0);
  CHECK_EQ_INT(KVT_ERR_OS(ENOSPC, "write %s", "x"), KVT_ENOSPC);
  CHECK_EQ_INT(kvt_last_errno(), ENOSPC);
  CHECK(strstr(kvt_last_error(), "write x") != NULL);
  CHECK(strstr(kvt_last_error(), "No space") != NULL);
  kvt_clear_error();
  CHECK(kvt_last_error()[0] == '\0');
  CHECK_EQ_INT(kvt_last_errno(), 0);
}

static void *other_thread(void *arg) {
  (void)arg;
  KVT_ERR(KVT_EINVAL, "from the other thread");
  return NULL;
}

static void test_error_thread_local(void) {
  KVT_ERR(KVT_EIO, "mine");
  pthread_t th;
  pthread_create(&th, NULL, other_thread, NULL);
  pthread_join(th, NULL);
  CHECK(strstr(kvt_last_error(), "mine") != NULL);
}

static void test_hashes(void) {
  char h[65];
  /* hashlib.sha256(array('i', [1, 2, 3]).tobytes()).hexdigest() on
   * little-endian. */
  int32_t t[3] = {1, 2, 3};
  CHECK_EQ_INT(kvt_token_hash(h, t, 3), 0);
  CHECK(
      strcmp(
          h,
          "4636993d3e1da4e9d6b8f87b79e8f7c6d018580d52661950eabc3845c5897a4d") ==
      0);
  /* Empty sequence: sha256(b""). */
  CHECK_EQ_INT(kvt_token_hash(h, NULL, 0), 0);
  CHECK(
      strcmp(
          h,
          "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855") ==
      0);
  /* Prefix hash = hash of the first 16 tokens. */
  int32_t many[40];
  for (int i = 0; i < 40; i++)
    many[i] = i * 7 - 3;
  char p1[65], p2[65];
  CHECK_EQ_INT(kvt_prefix_hash(p1, many, 40), 0);
  CHECK_EQ_INT(kvt_token_hash(p2, many, 16), 0);
  CHECK(strcmp(p1, p2) == 0);
  CHECK_EQ_INT(kvt_prefix_hash(p1, many, 5), 0);
  CHECK_EQ_INT(kvt_token_hash(p2, many, 5), 0);
  CHECK(strcmp(p1, p2) == 0);
  CHECK_EQ_INT(kvt_token_hash(NULL, t, 3), KVT_EINVAL);
  CHECK_EQ_INT(kvt_token_hash(h, NULL, 3), KVT_EINVAL);
  CHECK(kvti_is_hash_name(h));
  CHECK(!kvti_is_hash_name("../etc"));
  CHECK(!kvti_is_hash_name(
      "4636993D3E1DA4E9D6B8F87B79E8F7C6D018580D52661950EABC3845C5897A4D"));
  char x[24];
  kvti_xxh3_format(x, 0x0123456789abcdefULL);
  CHECK(strcmp(x, "xxh3:0123456789abcdef") == 0);
  uint64_t v = 0;
  CHECK_EQ_INT(kvti_xxh3_parse(&v, x), 0);
  CHECK(v == 0x0123456789abcdefULL);
  CHECK(kvti_xxh3_parse(&v, "xxh3:12") != 0);
  CHECK(kvti_xxh3_parse(&v, "xxh3:0123456789abcdeg") != 0);
  /* Streaming equals one-shot. */
  char buf[1000];
  for (int i = 0; i < 1000; i++)
    buf[i] = (char)(i * 31);
  kvti_xxh3_state *s = kvti_xxh3_new();
  REQUIRE(s);
  kvti_xxh3_update(s, buf, 300);
  kvti_xxh3_update(s, buf + 300, 700);
  CHECK(kvti_xxh3_digest(s) == kvti_xxh3(buf, 1000));
  kvti_xxh3_free(s);
}

static void test_options(void) {
  kvt_options o = KVT_OPTIONS_INIT, o2;
  CHECK_EQ_INT(kvt_options_init(&o2, KVT_OPTIONS_VERSION), 0);
  CHECK(o2.version == o.version && o2.max_size_gb == o.max_size_gb &&
        o2.promote_threads == o.promote_threads &&
        o2.log_level == o.log_level && o2.quarantine_max == o.quarantine_max &&
        o2.cache_dir == NULL);
  CHECK_EQ_INT(kvt_options_init(&o2, 99), KVT_EINVAL);
  CHECK_EQ_INT(kvt_options_validate(&o), 0);
  CHECK(o.max_size_gb == 10.0 && o.max_entries == 10000 &&
        o.file_mode == 0600 && o.dir_mode == 0700 && o.spill_queue_size == 64 &&
        o.retention_seconds == 0);
  CHECK(kvti_options_max_bytes(&o) == 10ULL * 1073741824ULL);
  o.max_size_gb = 0;
  CHECK_EQ_INT(kvt_options_validate(&o), KVT_EINVAL);
  CHECK(strstr(kvt_last_error(), "max_size_gb must be > 0, got 0") != NULL);
  o = o2;
  o.max_entries = 0;
  CHECK_EQ_INT(kvt_options_validate(&o), KVT_EINVAL);
  CHECK(strstr(kvt_last_error(), "max_entries must be >= 1, got 0") != NULL);
  o = o2;
  o.spill_queue_size = 0;
  CHECK_EQ_INT(kvt_options_validate(&o), KVT_EINVAL);
  CHECK(strstr(kvt_last_error(), "spill_queue_size must be >= 1, got 0") !=
        NULL);
  o = o2;
  o.retention_seconds = -1;
  CHECK_EQ_INT(kvt_options_validate(&o), KVT_EINVAL);
  CHECK(strstr(kvt_last_error(), "retention_seconds") != NULL);
  o = o2;
  o.storage_mode = 7;
  CHECK_EQ_INT(kvt_options_validate(&o), KVT_EINVAL);
  o = o2;
  o.model_name = "../x";
  CHECK_EQ_INT(kvt_options_validate(&o), KVT_EINVAL);
  o = o2;
  o.model_name = "llama";
  setenv("XDG_CACHE_HOME", "/xdg", 1);
  char *dir = NULL;
  CHECK_EQ_INT(kvti_options_resolve_dir(&dir, &o), 0);
  CHECK(dir && strcmp(dir, "/xdg/kvtier/llama") == 0);
  free(dir);
  unsetenv("XDG_CACHE_HOME");
  setenv("HOME", "/home/u", 1);
  CHECK_EQ_INT(kvti_options_resolve_dir(&dir, &o), 0);
  CHECK(dir && strcmp(dir, "/home/u/.cache/kvtier/llama") == 0);
  free(dir);
  CHECK(kvt_options_size() == sizeof(kvt_options));
}

int main(void) {
  RUN(test_version);
  RUN(test_errors);
  RUN(test_error_thread_local);
  RUN(test_hashes);
  RUN(test_options);
  return kvt_test_done();
}
