/*
 * test_promote_blocks.c - entry format 2 (per-block checksums, docs/FORMAT.md
 * section 6) and the trimmed promote it enables: the manifest lists, per layer
 * file, one XXH3-64 per 64 KiB block (recomputed here independently from the
 * file bytes) and the file checksum is the hash of that list; a trimmed promote
 * returns exactly the kept rows while reading - counted through the io seam,
 * pread and io_uring completions alike - only the covering blocks (well under
 * half of the layer bytes for a trim to 1/4), where a full promote reads them
 * all; a flipped byte in a block the trim needs (even outside the kept rows)
 * fails it with KVT_ECORRUPT and every caller buffer handed back, a flip in
 * blocks it does not need lets it succeed while the full promote and
 * kvt_tier_verify still catch it; malformed block lists and block sizes are
 * KVT_ECORRUPT; format-1 entries (whole-file checksums) and reference entries
 * (no kvtier key) are still read, trimmed and full; other block sizes (4 KiB
 * to 64 MiB) are read; quantized layers trim all six tensors.
 */
#include "testutil.h"
#include "tier_testlib.h"
#include "fmt_testlib.h"
#include "format/entry.h"
#include "base/hash.h"
#include "base/io.h"

#include <cjson/cJSON.h>
#include <stdatomic.h>

#define BS 65536u

/* Bytes read, counted by the test library's I/O harness (faultio.h). */
static uint64_t rd_now(void) {
  return fio_bytes_read();
}

/* ---- helpers --------------------------------------------------------------
 */

static int entry_rows_match(const kvt_entry *got, const t_entry *e,
                            int64_t keep) {
  if (!got || kvt_entry_num_layers(got) != e->n_layers)
    return 0;
  for (uint32_t l = 0; l < e->n_layers; l++) {
    const kvt_layer *ly = kvt_entry_layer(got, l);
    if (ly->offset != keep)
      return 0;
    for (int k = 0; k < 2; k++)
      if (!t_rows_match(&ly->tensors[k], &e->layers[l].tensors[k], keep))
        return 0;
  }
  return 1;
}

/* Caller buffers: counts what is outstanding. */
static atomic_int c_out;
static void *c_alloc(void *ctx, uint32_t layer, uint32_t tensor,
                     const kvt_tensor *d) {
  (void)ctx, (void)layer, (void)tensor;
  atomic_fetch_add(&c_out, 1);
  return malloc(d->nbytes ? d->nbytes : 1);
}
static void c_free(void *ctx, void *p) {
  (void)ctx;
  atomic_fetch_sub(&c_out, 1);
  free(p);
}

static void put_file(const char *path, const void *d, size_t n) {
  FILE *f = fopen(path, "wb");
  REQUIRE(f);
  REQUIRE(fwrite(d, 1, n, f) == n);
  fclose(f);
}

static char *file_in(const char *dir, const char *name) {
  size_t n = strlen(dir) + strlen(name) + 2;
  char *p = malloc(n);
  snprintf(p, n, "%s/%s", dir, name);
  return p;
}

static cJSON *load_manifest(const char *dir) {
  char *mp = file_in(dir, "manifest.json");
  size_t n = 0;
  char *txt = kvt_test_read_file(mp, &n);
  free(mp);
  REQUIRE(txt);
  cJSON *j = cJSON_Parse(txt);
  free(txt);
  REQUIRE(j);
  return j;
}

/* Writes manifest.json from j and a matching manifest.sum (a self-consistent
 * kvtier manifest), or removes manifest.sum (with_sum 0). */
static void store_manifest(const char *dir, const cJSON *j, int with_sum) {
  char *txt = cJSON_PrintUnformatted(j);
  REQUIRE(txt);
  char *mp = file_in(dir, "manifest.json"), *sp = file_in(dir, "manifest.sum");
  put_file(mp, txt, strlen(txt));
  if (with_sum) {
    char sum[32];
    kvti_xxh3_format(sum, kvti_xxh3(txt, strlen(txt)));
    strcat(sum, "\n");
    put_file(sp, sum, strlen(sum));
  } else {
    unlink(sp);
  }
  free(mp);
  free(sp);
  free(txt);
}

static cJSON *kvtier_key(cJSON *root) {
  return cJSON_GetObjectItemCaseSensitive(root, "kvtier");
}

/* Independent XXH3 of the block list as little-endian words. */
static uint64_t list_digest_hex(const char *hex) {
  size_t n = strlen(hex) / 16;
  unsigned char *b = malloc(n * 8 + 1);
  for (size_t i = 0; i < n; i++) {
    char w[17];
    memcpy(w, hex + 16 * i, 16);
    w[16] = 0;
    uint64_t v = strtoull(w, NULL, 16);
    for (int k = 0; k < 8; k++)
      b[8 * i + k] = (unsigned char)(v >> (8 * k));
  }
  uint64_t h = kvti_xxh3(b, n * 8);
  free(b);
  return h;
}

static void set_str(cJSON *obj, const char *key, const char *v) {
  REQUIRE(
      cJSON_ReplaceItemInObjectCaseSensitive(obj, key, cJSON_CreateString(v)));
}

/* Sets layer i's block list to hex and its checksum to the list's digest. */
static void set_blocks_fixed(cJSON *root, uint32_t i, const char *hex) {
  char name[40], x[24];
  snprintf(name, sizeof name, "layer_%u.safetensors", i);
  cJSON *kv = kvtier_key(root);
  set_str(cJSON_GetObjectItemCaseSensitive(kv, "blocks"), name, hex);
  kvti_xxh3_format(x, list_digest_hex(hex));
  set_str(cJSON_GetObjectItemCaseSensitive(kv, "checksums"), name, x);
}

static const char *blocks_of(cJSON *root, uint32_t i) {
  char name[40];
  snprintf(name, sizeof name, "layer_%u.safetensors", i);
  cJSON *b = cJSON_GetObjectItemCaseSensitive(
      cJSON_GetObjectItemCaseSensitive(kvtier_key(root), "blocks"), name);
  return cJSON_IsString(b) ? b->valuestring : NULL;
}

static uint64_t file_size(const char *path) {
  struct stat st;
  REQUIRE(stat(path, &st) == 0);
  return (uint64_t)st.st_size;
}

/* Data start of a safetensors file (8 + N). */
static uint64_t data_start(const char *path) {
  FILE *f = fopen(path, "rb");
  REQUIRE(f);
  unsigned char b[8];
  REQUIRE(fread(b, 1, 8, f) == 8);
  fclose(f);
  uint64_t n = 0;
  for (int i = 7; i >= 0; i--)
    n = (n << 8) | b[i];
  return 8 + n;
}

/* ---- tests ----------------------------------------------------------------
 */

/* What a format-2 entry looks like on disk: format 2, block_size 65536, one
 * list per layer file of ceil(size / 65536) hashes, each the XXH3 of its block
 * (recomputed here from the file), and the file checksum the XXH3 of the list.
 */
static void test_manifest_blocks(void) {
  kvt_options o = t_opts("blk-fmt");
  o.chunk_tokens =
      0; /* format-2 entries whole (chunk tails are tested in test_chunk*) */
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  t_entry e = t_make(21, 300, 2, 300, 64); /* layer files ~307 KiB: 5 blocks */
  REQUIRE(t_spill(t, &e) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  char *dir = t_entry_path(t, e.tokens, e.n_tokens, NULL);
  cJSON *root = load_manifest(dir);
  cJSON *kv = kvtier_key(root);
  REQUIRE(kv);
  CHECK_EQ_INT(cJSON_GetObjectItemCaseSensitive(kv, "format")->valueint, 2);
  CHECK_EQ_INT(cJSON_GetObjectItemCaseSensitive(kv, "block_size")->valuedouble,
               BS);
  cJSON *cs = cJSON_GetObjectItemCaseSensitive(kv, "checksums");
  CHECK_EQ_INT(cJSON_GetArraySize(cs), 3);
  CHECK_EQ_INT(
      cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(kv, "blocks")), 2);
  for (uint32_t i = 0; i < 2; i++) {
    char name[40];
    snprintf(name, sizeof name, "layer_%u.safetensors", i);
    char *lp = file_in(dir, name);
    size_t len = 0;
    char *data = kvt_test_read_file(lp, &len);
    REQUIRE(data);
    const char *hex = blocks_of(root, i);
    REQUIRE(hex);
    size_t nb = (len + BS - 1) / BS;
    CHECK(nb >= 4);
    CHECK_EQ_INT(strlen(hex), 16 * nb);
    int all = 1;
    for (size_t k = 0; k < nb; k++) {
      size_t bl = len - k * BS < BS ? len - k * BS : BS;
      char w[17];
      snprintf(w, sizeof w, "%016llx",
               (unsigned long long)kvti_xxh3(data + k * BS, bl));
      all &= memcmp(w, hex + 16 * k, 16) == 0;
    }
    CHECK(all);
    char x[24];
    kvti_xxh3_format(x, list_digest_hex(hex));
    CHECK(strcmp(cJSON_GetObjectItemCaseSensitive(cs, name)->valuestring, x) ==
          0);
    /* tokens.bin keeps its whole-file checksum. */
    free(data);
    free(lp);
  }
  char *tp = file_in(dir, "tokens.bin");
  size_t tl = 0;
  char *td = kvt_test_read_file(tp, &tl);
  char x[24];
  kvti_xxh3_format(x, kvti_xxh3(td, tl));
  CHECK(strcmp(cJSON_GetObjectItemCaseSensitive(cs, "tokens.bin")->valuestring,
               x) == 0);
  free(td);
  free(tp);
  /* The exact on-disk size estimate still holds (the manifest grew). */
  kvt_entry_info info;
  REQUIRE(kvt_tier_lookup(&info, t, e.tokens, e.n_tokens) == 0);
  uint64_t sum = 0;
  static const char *names[] = {"layer_0.safetensors", "layer_1.safetensors",
                                "tokens.bin", "manifest.json", "manifest.sum"};
  for (int k = 0; k < 5; k++) {
    char *p = file_in(dir, names[k]);
    sum += file_size(p);
    free(p);
  }
  CHECK_EQ_INT(info.disk_bytes, sum);
  cJSON_Delete(root);
  free(dir);
  kvt_tier_free(t);
  t_free(&e);
}

/* A trim to 1/4 of the tokens reads the covering blocks only (bounded per head
 * range by the kept bytes + 2 blocks, plus the header's block), well under half
 * of the layer bytes; a full promote reads every byte; both return exactly the
 * stored data. */
static void test_trim_reads_less(void) {
  fio_install();
  kvt_options o = t_opts("blk-bytes");
  o.chunk_tokens =
      0; /* format-2 entries whole (chunk tails are tested in test_chunk*) */
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  enum { T = 4096, D = 64, KEEP = T / 4, L = 2 };
  t_entry e = t_make(22, T, L, T, D); /* [1, 2, T, D] F32: 1 MiB per head */
  REQUIRE(t_spill(t, &e) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  uint64_t layer_bytes = 0;
  for (uint32_t i = 0; i < L; i++) {
    char name[40];
    snprintf(name, sizeof name, "layer_%u.safetensors", i);
    char *lp = t_entry_path(t, e.tokens, e.n_tokens, name);
    layer_bytes += file_size(lp);
    free(lp);
  }
  kvt_entry *got = NULL;
  uint64_t r0 = rd_now();
  REQUIRE(kvt_tier_promote_trim(&got, t, e.tokens, e.n_tokens, KEEP, NULL) ==
          0);
  uint64_t trim_read = rd_now() - r0;
  CHECK(entry_rows_match(got, &e, KEEP));
  uint64_t kb = (uint64_t)KEEP * D * 4; /* kept bytes per head */
  uint64_t small = 64 << 10;            /* manifest, sum, tokens.bin */
  uint64_t bound = L * (BS + 4 * (kb + 2 * BS)) + small;
  fprintf(stderr,
          "trim to 1/4: %llu bytes read of %llu layer bytes (bound %llu); "
          "disk_bytes %llu\n",
          (unsigned long long)trim_read, (unsigned long long)layer_bytes,
          (unsigned long long)bound,
          (unsigned long long)kvt_entry_disk_bytes(got));
  CHECK(trim_read >= L * 4 * kb);
  CHECK(trim_read <= bound);
  CHECK(trim_read < layer_bytes / 2);
  CHECK(kvt_entry_disk_bytes(got) < layer_bytes / 2);
  kvt_entry_free(got);
  got = NULL;
  r0 = rd_now();
  REQUIRE(kvt_tier_promote(&got, t, e.tokens, e.n_tokens, NULL) == 0);
  uint64_t full_read = rd_now() - r0;
  fprintf(stderr, "full promote: %llu bytes read\n",
          (unsigned long long)full_read);
  CHECK(t_same(got, &e));
  CHECK(full_read >= layer_bytes);
  kvt_entry_free(got);
  /* Trims of other lengths (block-aligned or not, one token, all but one). */
  static const size_t keeps[] = {1, 255, 256, 257, 2048, T - 1};
  for (size_t k = 0; k < sizeof keeps / sizeof keeps[0]; k++) {
    got = NULL;
    REQUIRE(kvt_tier_promote_trim(&got, t, e.tokens, e.n_tokens, keeps[k],
                                  NULL) == 0);
    CHECK(entry_rows_match(got, &e, (int64_t)keeps[k]));
    kvt_entry_free(got);
  }
  kvt_tier_free(t);
  fio_remove();
  t_free(&e);
}

/* Damage: in a block the trim needs (inside or outside the kept rows) -> the
 * trim fails, no data, caller buffers returned; only in blocks it does not need
 * -> the trim succeeds (documented), the full promote and verify catch it. */
static void test_trim_corruption(void) {
  kvt_options o = t_opts("blk-corrupt");
  o.chunk_tokens =
      0; /* format-2 entries whole (chunk tails are tested in test_chunk*) */
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  enum { T = 1024, D = 64, KEEP = 256 };
  uint64_t tb = (uint64_t)T * D * 4, kb = (uint64_t)KEEP * D * 4;
  /* Five entries: damage in kept rows / in a needed block outside the kept
   * rows / in the header / in unneeded rows (twice: promote, verify). */
  t_entry e[5];
  for (int i = 0; i < 5; i++) {
    e[i] = t_make(30 + (uint64_t)i, T, 2, T, D);
    REQUIRE(t_spill(t, &e[i]) == 0);
  }
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  char *lp[5];
  for (int i = 0; i < 5; i++)
    lp[i] = t_entry_path(t, e[i].tokens, e[i].n_tokens, "layer_1.safetensors");
  uint64_t ds = data_start(lp[0]);
  CHECK(ds % BS != 0); /* so the end of head 0's kept rows shares a block */
  kvt_promote_opts pc = t_popts(NULL);
  pc.alloc = c_alloc;
  pc.free_buf = c_free;
  long off[3] = {
      (long)(ds + tb + 100), /* keys, head 1, a kept row */
      (long)(ds + kb + 10),  /* keys, head 0, first dropped row: its block
                                also holds kept bytes */
      20,                    /* the header */
  };
  for (int i = 0; i < 3; i++) {
    REQUIRE(t_flip(lp[i], off[i]) == 0);
    kvt_entry *got = NULL;
    atomic_store(&c_out, 0);
    CHECK_EQ_INT(
        kvt_tier_promote_trim(&got, t, e[i].tokens, e[i].n_tokens, KEEP, &pc),
        KVT_ECORRUPT);
    CHECK(got == NULL);
    CHECK_EQ_INT(atomic_load(&c_out), 0);
  }
  /* The last byte of the file: values, head 1, row T-1: a block no trim to
   * KEEP tokens reads. */
  for (int i = 3; i < 5; i++) {
    REQUIRE(t_flip(lp[i], -1) == 0);
    kvt_entry *got = NULL;
    atomic_store(&c_out, 0);
    REQUIRE(kvt_tier_promote_trim(&got, t, e[i].tokens, e[i].n_tokens, KEEP,
                                  &pc) == 0);
    CHECK(entry_rows_match(got, &e[i], KEEP));
    kvt_entry_free(got);
    CHECK_EQ_INT(atomic_load(&c_out), 0);
  }
  kvt_entry *got = NULL;
  CHECK_EQ_INT(kvt_tier_promote(&got, t, e[3].tokens, e[3].n_tokens, &pc),
               KVT_ECORRUPT);
  CHECK(got == NULL);
  CHECK_EQ_INT(atomic_load(&c_out), 0);
  char h[65];
  kvt_token_hash(h, e[4].tokens, e[4].n_tokens);
  CHECK_EQ_INT(kvt_tier_verify(t, h, 0), KVT_ECORRUPT);
  for (int i = 0; i < 5; i++) {
    free(lp[i]);
    t_free(&e[i]);
  }
  kvt_tier_free(t);
}

/* Reads of data/<hash> through the entry reader (no quarantine), full and
 * trimmed; both must give rc. */
static void expect_reads(const char *data_dir, const char *hash, int rc,
                         const char *what) {
  kvti_read_opts ro;
  memset(&ro, 0, sizeof ro);
  kvt_entry *got = NULL;
  int r1 = kvti_entry_read(&got, data_dir, hash, &ro);
  CHECK(got == NULL || r1 == 0);
  kvt_entry_free(got);
  got = NULL;
  ro.keep_tokens = 100;
  int r2 = kvti_entry_read(&got, data_dir, hash, &ro);
  CHECK(got == NULL || r2 == 0);
  kvt_entry_free(got);
  if (r1 != rc || r2 != rc)
    fprintf(stderr, "%s: full %d, trimmed %d, expected %d (%s)\n", what, r1, r2,
            rc, kvt_last_error());
  CHECK_EQ_INT(r1, rc);
  CHECK_EQ_INT(r2, rc);
}

/* Malformed block lists and block sizes (in manifests whose manifest.sum
 * matches) are KVT_ECORRUPT for full and trimmed reads alike, and for the
 * standalone validator (the fuzz target's entry point) where the text alone
 * shows it. */
static void test_malformed_blocks(void) {
  kvt_options o = t_opts("blk-bad");
  o.chunk_tokens =
      0; /* format-2 entries whole (chunk tails are tested in test_chunk*) */
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  t_entry e = t_make(41, 400, 2, 400, 64); /* ~410 KiB per layer: 7 blocks */
  REQUIRE(t_spill(t, &e) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  char *dir = t_entry_path(t, e.tokens, e.n_tokens, NULL);
  char h[65];
  kvt_token_hash(h, e.tokens, e.n_tokens);
  size_t dl = strlen(kvt_tier_dir(t)) + 8;
  char *data_dir = malloc(dl);
  snprintf(data_dir, dl, "%s/data", kvt_tier_dir(t));
  cJSON *orig = load_manifest(dir);
  expect_reads(data_dir, h, 0, "intact");
  const char *hex0 = blocks_of(orig, 1);
  REQUIRE(hex0);
  size_t hl = strlen(hex0);
  char *hex = malloc(hl + 64);
  for (int c = 0; c < 15; c++) {
    cJSON *m = cJSON_Duplicate(orig, 1);
    cJSON *kv = kvtier_key(m);
    int text_bad = 1; /* the standalone validator sees it too */
    strcpy(hex, hex0);
    const char *what = "";
    switch (c) {
    case 0:
      what = "odd hex length";
      hex[hl - 1] = 0;
      set_blocks_fixed(m, 1, hex);
      break;
    case 1:
      what = "half a hash missing";
      hex[hl - 8] = 0;
      set_blocks_fixed(m, 1, hex);
      break;
    case 2:
      what = "one block fewer than the file has";
      hex[hl - 16] = 0;
      set_blocks_fixed(m, 1, hex);
      text_bad = 0;
      break;
    case 3:
      what = "one block more than the file has";
      strcat(hex, "0123456789abcdef");
      set_blocks_fixed(m, 1, hex);
      text_bad = 0;
      break;
    case 4:
      what = "uppercase hex";
      for (size_t k = 0; k < hl; k++)
        if (hex[k] >= 'a' && hex[k] <= 'f') {
          hex[k] = (char)(hex[k] - 32);
          break;
        }
      set_blocks_fixed(m, 1, hex);
      break;
    case 5:
      what = "bad character";
      hex[3] = 'g';
      set_blocks_fixed(m, 1, hex);
      break;
    case 6:
      what = "list not matching its file checksum";
      hex[0] = hex[0] == '0' ? '1' : '0';
      set_str(cJSON_GetObjectItemCaseSensitive(kv, "blocks"),
              "layer_1.safetensors", hex);
      break;
    case 7:
      what = "a wrong block hash (self-consistent manifest)";
      /* The last block (6): rows of values head 1 beyond the first 100
       * tokens; a trim to 100 tokens does not read it. */
      hex[hl - 16] = hex[hl - 16] == '0' ? '1' : '0';
      set_blocks_fixed(m, 1, hex);
      text_bad = 0;
      break;
    case 8:
      what = "a wrong hash of block 0";
      hex[0] = hex[0] == '0' ? '1' : '0';
      set_blocks_fixed(m, 1, hex);
      text_bad = 0;
      break;
    case 9:
      what = "block_size not a power of two";
      cJSON_ReplaceItemInObjectCaseSensitive(kv, "block_size",
                                             cJSON_CreateNumber(65535));
      break;
    case 10:
      what = "block_size below 4096";
      cJSON_ReplaceItemInObjectCaseSensitive(kv, "block_size",
                                             cJSON_CreateNumber(2048));
      break;
    case 11:
      what = "block_size above 64 MiB";
      cJSON_ReplaceItemInObjectCaseSensitive(
          kv, "block_size", cJSON_CreateNumber(128.0 * 1024 * 1024));
      break;
    case 12:
      what = "block_size missing";
      cJSON_DeleteItemFromObjectCaseSensitive(kv, "block_size");
      break;
    case 13:
      what = "a layer file's list missing";
      cJSON_DeleteItemFromObjectCaseSensitive(
          cJSON_GetObjectItemCaseSensitive(kv, "blocks"),
          "layer_0.safetensors");
      break;
    case 14:
      what = "blocks not an object";
      cJSON_ReplaceItemInObjectCaseSensitive(kv, "blocks",
                                             cJSON_CreateNumber(7));
      break;
    }
    store_manifest(dir, m, 1);
    if (c == 7) {
      /* Full read: the last block mismatches; a trim to 100 tokens does not
       * need it (documented: damage outside the blocks a trim reads is found
       * by full reads and verify). */
      kvti_read_opts ro;
      memset(&ro, 0, sizeof ro);
      kvt_entry *got = NULL;
      CHECK_EQ_INT(kvti_entry_read(&got, data_dir, h, &ro), KVT_ECORRUPT);
      CHECK(got == NULL);
      ro.keep_tokens = 100;
      CHECK_EQ_INT(kvti_entry_read(&got, data_dir, h, &ro), 0);
      kvt_entry_free(got);
    } else {
      expect_reads(data_dir, h, KVT_ECORRUPT, what);
    }
    char *txt = cJSON_PrintUnformatted(m);
    int vr = kvti_manifest_validate(txt, strlen(txt));
    if (text_bad) {
      if (vr != KVT_ECORRUPT)
        fprintf(stderr, "validator accepted: %s\n", what);
      CHECK_EQ_INT(vr, KVT_ECORRUPT);
    } else {
      CHECK_EQ_INT(vr, 0);
    }
    free(txt);
    cJSON_Delete(m);
  }
  store_manifest(dir, orig, 1);
  expect_reads(data_dir, h, 0, "restored");
  free(hex);
  cJSON_Delete(orig);
  free(data_dir);
  free(dir);
  kvt_tier_free(t);
  t_free(&e);
}

/* Format 1 (whole-file checksums; what caches written before format 2 hold)
 * and reference entries (no kvtier key, no manifest.sum) read as before, full
 * and trimmed; a format-1 trim still reads (and checks) whole files. */
static void test_format1_and_reference(void) {
  fio_install();
  kvt_options o = t_opts("blk-compat");
  o.chunk_tokens =
      0; /* format-2 entries whole (chunk tails are tested in test_chunk*) */
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  enum { T = 1024, D = 64, KEEP = 256, L = 2 };
  t_entry e[3];
  for (int i = 0; i < 3; i++) {
    e[i] = t_make(50 + (uint64_t)i, T, L, T, D);
    REQUIRE(t_spill(t, &e[i]) == 0);
  }
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  uint64_t layer_bytes = 0;
  for (int i = 0; i < 3; i++) {
    char *dir = t_entry_path(t, e[i].tokens, e[i].n_tokens, NULL);
    cJSON *m = load_manifest(dir);
    cJSON *kv = kvtier_key(m);
    if (i < 2) {
      /* Format 1: drop the block keys, whole-file checksums. */
      cJSON_ReplaceItemInObjectCaseSensitive(kv, "format",
                                             cJSON_CreateNumber(1));
      cJSON_DeleteItemFromObjectCaseSensitive(kv, "block_size");
      cJSON_DeleteItemFromObjectCaseSensitive(kv, "blocks");
      cJSON *cs = cJSON_GetObjectItemCaseSensitive(kv, "checksums");
      for (uint32_t l = 0; l < L; l++) {
        char name[40], x[24];
        snprintf(name, sizeof name, "layer_%u.safetensors", l);
        char *lp = file_in(dir, name);
        size_t n = 0;
        char *d = kvt_test_read_file(lp, &n);
        REQUIRE(d);
        if (i == 0)
          layer_bytes += n;
        kvti_xxh3_format(x, kvti_xxh3(d, n));
        set_str(cs, name, x);
        free(d);
        free(lp);
      }
      store_manifest(dir, m, 1);
    } else {
      cJSON_DeleteItemFromObjectCaseSensitive(m, "kvtier");
      store_manifest(dir, m, 0);
    }
    cJSON_Delete(m);
    free(dir);
  }
  for (int i = 0; i < 3; i++) {
    kvt_entry *got = NULL;
    REQUIRE(kvt_tier_promote(&got, t, e[i].tokens, e[i].n_tokens, NULL) == 0);
    CHECK(t_same(got, &e[i]));
    CHECK_EQ_INT(kvt_entry_storage_mode(got),
                 i < 2 ? KVT_STORAGE_NATIVE : KVT_STORAGE_COMPAT);
    kvt_entry_free(got);
    got = NULL;
    uint64_t r0 = rd_now();
    REQUIRE(kvt_tier_promote_trim(&got, t, e[i].tokens, e[i].n_tokens, KEEP,
                                  NULL) == 0);
    uint64_t rd = rd_now() - r0;
    CHECK(entry_rows_match(got, &e[i], KEEP));
    kvt_entry_free(got);
    if (i == 0) /* format 1: whole files read and hashed */
      CHECK(rd >= layer_bytes);
    if (i == 2) /* reference: the kept rows (+ header, small files) only */
      CHECK(rd < layer_bytes / 2);
  }
  /* Format 1 still catches damage in rows a trim drops. */
  char *lp = t_entry_path(t, e[1].tokens, e[1].n_tokens, "layer_0.safetensors");
  REQUIRE(t_flip(lp, -1) == 0);
  free(lp);
  kvt_entry *got = NULL;
  CHECK_EQ_INT(
      kvt_tier_promote_trim(&got, t, e[1].tokens, e[1].n_tokens, KEEP, NULL),
      KVT_ECORRUPT);
  CHECK(got == NULL);
  /* A kvtier format this build does not know is refused (not misread). */
  char *dir = t_entry_path(t, e[0].tokens, e[0].n_tokens, NULL);
  cJSON *m = load_manifest(dir);
  cJSON_ReplaceItemInObjectCaseSensitive(kvtier_key(m), "format",
                                         cJSON_CreateNumber(3));
  char *txt = cJSON_PrintUnformatted(m);
  CHECK_EQ_INT(kvti_manifest_validate(txt, strlen(txt)), KVT_EUNSUPPORTED);
  free(txt);
  cJSON_Delete(m);
  free(dir);
  for (int i = 0; i < 3; i++)
    t_free(&e[i]);
  kvt_tier_free(t);
  fio_remove();
}

/* The block hasher itself: any split of the stream gives the same list as
 * one-shot hashes of each block, and verify mode fails at the first bad block.
 */
static void test_blkhash(void) {
  enum { N = 5 * 4096 + 123 };
  unsigned char *d = malloc(N);
  kvt_rng r = {7};
  kvt_rng_fill(&r, d, N);
  uint64_t want[6];
  for (int k = 0; k < 6; k++)
    want[k] = kvti_xxh3(d + k * 4096, k < 5 ? 4096 : 123);
  static const size_t steps[] = {1, 7, 100, 4095, 4096, 4097, 9000, N};
  for (size_t s = 0; s < sizeof steps / sizeof steps[0]; s++) {
    kvti_blkhash *h = NULL;
    REQUIRE(kvti_blkhash_new(&h, 4096, s % 2 ? N : 0) == 0);
    for (size_t o = 0; o < N; o += steps[s])
      REQUIRE(kvti_blkhash_update(h, d + o,
                                  N - o < steps[s] ? N - o : steps[s]) == 0);
    uint64_t dg = 0;
    REQUIRE(kvti_blkhash_final(h, &dg) == 0);
    size_t n = 0;
    const uint64_t *l = kvti_blkhash_list(h, &n);
    CHECK_EQ_INT(n, 6);
    CHECK(memcmp(l, want, sizeof want) == 0);
    CHECK(dg == kvti_blklist_digest(want, 6));
    kvti_blkhash_free(h);
  }
  /* Verify mode. */
  kvti_blkhash *h = NULL;
  REQUIRE(kvti_blkhash_new(&h, 4096, 0) == 0);
  kvti_blkhash_expect(h, want, 6, "stream");
  CHECK_EQ_INT(kvti_blkhash_update(h, d, N), 0);
  CHECK_EQ_INT(kvti_blkhash_final(h, NULL), 0);
  kvti_blkhash_free(h);
  d[2 * 4096 + 5] ^= 1;
  REQUIRE(kvti_blkhash_new(&h, 4096, 0) == 0);
  kvti_blkhash_expect(h, want, 6, "stream");
  CHECK_EQ_INT(kvti_blkhash_update(h, d, 2 * 4096), 0);
  CHECK_EQ_INT(kvti_blkhash_update(h, d + 2 * 4096, 4096), KVT_ECORRUPT);
  kvti_blkhash_free(h);
  d[2 * 4096 + 5] ^= 1;
  /* Too few blocks expected / too many. */
  REQUIRE(kvti_blkhash_new(&h, 4096, 0) == 0);
  kvti_blkhash_expect(h, want, 5, "stream");
  CHECK_EQ_INT(kvti_blkhash_update(h, d, N), 0);
  CHECK_EQ_INT(kvti_blkhash_final(h, NULL), KVT_ECORRUPT);
  kvti_blkhash_free(h);
  REQUIRE(kvti_blkhash_new(&h, 4096, 0) == 0);
  kvti_blkhash_expect(h, want, 6, "stream");
  CHECK_EQ_INT(kvti_blkhash_update(h, d, 5 * 4096), 0);
  CHECK_EQ_INT(kvti_blkhash_final(h, NULL), KVT_ECORRUPT);
  kvti_blkhash_free(h);
  /* Block size 0: the whole-stream hash. */
  REQUIRE(kvti_blkhash_new(&h, 0, 0) == 0);
  CHECK_EQ_INT(kvti_blkhash_update(h, d, 1000), 0);
  CHECK_EQ_INT(kvti_blkhash_update(h, d + 1000, N - 1000), 0);
  uint64_t whole = 0;
  CHECK_EQ_INT(kvti_blkhash_final(h, &whole), 0);
  CHECK(whole == kvti_xxh3(d, N));
  kvti_blkhash_free(h);
  CHECK(kvti_blk_size_ok(4096) && kvti_blk_size_ok(65536) &&
        kvti_blk_size_ok(64u << 20));
  CHECK(!kvti_blk_size_ok(2048) && !kvti_blk_size_ok(65535) &&
        !kvti_blk_size_ok(128u << 20) && !kvti_blk_size_ok(0));
  uint64_t l2[2];
  CHECK_EQ_INT(kvti_blklist_parse(l2, "0123456789abcdef0123456789abcdeF", 32),
               -1);
  CHECK_EQ_INT(kvti_blklist_parse(l2, "0123456789abcdef", 15), -1);
  CHECK_EQ_INT(kvti_blklist_parse(l2, "0123456789abcdef", 16), 0);
  CHECK(l2[0] == 0x0123456789abcdefull);
  free(d);
}

/* Readers accept any power-of-two block size in [4 KiB, 64 MiB]: the entry's
 * lists are recomputed here for 4 KiB and 1 MiB blocks (and the manifest
 * resealed); full and trimmed reads return exactly the stored data, and a 4 KiB
 * trim reads less than a 64 KiB one. */
static void rewrite_blocks(const char *dir, uint32_t n_layers, uint64_t bs) {
  cJSON *m = load_manifest(dir);
  cJSON *kv = kvtier_key(m);
  cJSON_ReplaceItemInObjectCaseSensitive(kv, "block_size",
                                         cJSON_CreateNumber((double)bs));
  for (uint32_t i = 0; i < n_layers; i++) {
    char name[40];
    snprintf(name, sizeof name, "layer_%u.safetensors", i);
    char *lp = file_in(dir, name);
    size_t n = 0;
    char *d = kvt_test_read_file(lp, &n);
    REQUIRE(d);
    size_t nb = (n + bs - 1) / bs;
    char *hex = malloc(16 * nb + 1);
    for (size_t k = 0; k < nb; k++) {
      size_t bl = n - k * bs < bs ? n - k * bs : (size_t)bs;
      snprintf(hex + 16 * k, 17, "%016llx",
               (unsigned long long)kvti_xxh3(d + k * bs, bl));
    }
    hex[16 * nb] = 0;
    set_blocks_fixed(m, i, hex);
    free(hex);
    free(d);
    free(lp);
  }
  store_manifest(dir, m, 1);
  cJSON_Delete(m);
}

static void test_other_block_sizes(void) {
  fio_install();
  kvt_options o = t_opts("blk-sizes");
  o.chunk_tokens =
      0; /* format-2 entries whole (chunk tails are tested in test_chunk*) */
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  enum { T = 1024, D = 64, KEEP = 100, L = 2 };
  t_entry e = t_make(61, T, L, T, D);
  REQUIRE(t_spill(t, &e) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  char *dir = t_entry_path(t, e.tokens, e.n_tokens, NULL);
  kvt_entry *got = NULL;
  uint64_t r0 = rd_now();
  REQUIRE(kvt_tier_promote_trim(&got, t, e.tokens, e.n_tokens, KEEP, NULL) ==
          0);
  uint64_t rd64k = rd_now() - r0;
  kvt_entry_free(got);
  static const uint64_t sizes[] = {4096, 1u << 20, 64u << 20};
  for (int k = 0; k < 3; k++) {
    rewrite_blocks(dir, L, sizes[k]);
    got = NULL;
    r0 = rd_now();
    REQUIRE(kvt_tier_promote_trim(&got, t, e.tokens, e.n_tokens, KEEP, NULL) ==
            0);
    uint64_t rd = rd_now() - r0;
    CHECK(entry_rows_match(got, &e, KEEP));
    kvt_entry_free(got);
    if (sizes[k] == 4096)
      CHECK(rd < rd64k);
    got = NULL;
    REQUIRE(kvt_tier_promote(&got, t, e.tokens, e.n_tokens, NULL) == 0);
    CHECK(t_same(got, &e));
    kvt_entry_free(got);
  }
  free(dir);
  kvt_tier_free(t);
  fio_remove();
  t_free(&e);
}

/* Quantized KV layers trim all six tensors (packed rows of 64 bytes, scales
 * and biases of 4 bytes: several heads' ranges share a block) through the
 * verified blocks, reading less than the whole file. */
static void test_quantized_blocks(void) {
  fio_install();
  kvt_options o = t_opts("blk-quant");
  o.chunk_tokens =
      0; /* format-2 entries whole (chunk tails are tested in test_chunk*) */
  kvt_tier *t = t_open(&o);
  REQUIRE(kvt_tier_start_writer(t) == 0);
  enum { H = 2, T = 2048, D = 128, GS = 64, BITS = 4, KEEP = 500 };
  kvt_rng r = {9};
  int32_t *tokens = malloc(T * sizeof(int32_t));
  for (int i = 0; i < T; i++)
    tokens[i] = 3000 + i;
  /* Packed U32 keys/values with F16 scales and biases, [1, H, T, .]. */
  kvt_layer q = t_quant(&r, BITS, GS, KVT_DTYPE_F16, 1, H, T, D, T);
  const kvt_tensor *qt = q.tensors;
  REQUIRE(kvt_tier_spill(t, tokens, T, &q, 1, 1000) == 0);
  REQUIRE(kvt_tier_flush(t, -1) == 0);
  char *lp = t_entry_path(t, tokens, T, "layer_0.safetensors");
  uint64_t fsz = file_size(lp);
  free(lp);
  kvt_entry *got = NULL;
  uint64_t r0 = rd_now();
  REQUIRE(kvt_tier_promote_trim(&got, t, tokens, T, KEEP, NULL) == 0);
  uint64_t rd = rd_now() - r0;
  const kvt_layer *l = kvt_entry_layer(got, 0);
  CHECK_EQ_INT(l->kind, KVT_LAYER_QUANTIZED_KV);
  CHECK_EQ_INT(l->offset, KEEP);
  for (int k = 0; k < 6; k++)
    CHECK(t_rows_match(&l->tensors[k], &qt[k], KEEP));
  CHECK(rd < fsz * 3 / 4);
  kvt_entry_free(got);
  kvt_tier_free(t);
  fio_remove();
  t_layer_free(&q);
  free(tokens);
}

int main(void) {
  RUN(test_blkhash);
  RUN(test_manifest_blocks);
  RUN(test_trim_reads_less);
  RUN(test_trim_corruption);
  RUN(test_malformed_blocks);
  RUN(test_format1_and_reference);
  RUN(test_other_block_sizes);
  RUN(test_quantized_blocks);
  return kvt_test_done();
}
