/*
 * test_safetensors.c - the safetensors reader and writer: round trips of every
 * dtype (scalars, empty tensors, __metadata__), the exact bytes the writer
 * produces (key order, data order, space padding, as the Python package writes
 * them), and hostile input: truncation at every length, every flipped header
 * byte, and a catalogue of malformed headers (bad JSON, wrong JSON types,
 * duplicates, overlapping/gapped/out-of-range offsets, size mismatches,
 * overflow, huge header lengths) which must all fail with KVT_ECORRUPT and
 * never crash.
 */
#include "fmt_testlib.h"
#include "format/dtype.h"
#include "base/io.h"
#include "format/safetensors.h"

static char *g_dir;

static int parse_file_bytes(kvti_st_header *hd, const void *bytes, size_t n) {
  char *p = t_join(g_dir, "t.safetensors");
  t_write_all(p, bytes, n);
  int fd = open(p, O_RDONLY);
  int rc = kvti_st_read_header(hd, fd, n, p, NULL);
  close(fd);
  free(p);
  return rc;
}

/* File = 8-byte length + header text (unpadded) + dlen zero bytes of data. */
static int parse_header_text(const char *json, size_t dlen) {
  size_t n = strlen(json);
  char *b = calloc(1, 8 + n + dlen + 1);
  for (int i = 0; i < 8; i++)
    b[i] = (char)((uint64_t)n >> (8 * i));
  memcpy(b + 8, json, n);
  kvti_st_header hd;
  int rc = parse_file_bytes(&hd, b, 8 + n + dlen);
  if (rc == 0)
    kvti_st_header_free(&hd);
  free(b);
  return rc;
}

static void test_roundtrip_all_dtypes(void) {
  kvt_rng r = {11};
  kvt_tensor ts[N_ALL_DTYPES + 2];
  kvti_st_item items[N_ALL_DTYPES + 2];
  char names[N_ALL_DTYPES + 2][32];
  size_t n = 0;
  for (size_t i = 0; i < N_ALL_DTYPES; i++, n++) {
    ts[n] = t_tensor(&r, ALL_DTYPES[i], 2, 3, (int)i + 1);
    snprintf(names[n], 32, "t_%s", kvt_dtype_name(ALL_DTYPES[i]));
  }
  ts[n] = t_tensor(&r, KVT_DTYPE_F32, 0); /* scalar */
  snprintf(names[n++], 32, "scalar");
  ts[n] = t_tensor(&r, KVT_DTYPE_I64, 3, 2, 0, 5); /* empty */
  snprintf(names[n++], 32, "empty");
  for (size_t i = 0; i < n; i++) {
    items[i].name = names[i];
    items[i].t = &ts[i];
  }
  const char *meta[4] = {"format", "np", "a key", "v\"al\\ue\n"};
  char *p = t_join(g_dir, "rt.safetensors");
  int fd = open(p, O_RDWR | O_CREAT | O_TRUNC, 0600);
  uint64_t size = 0, xx = 0;
  REQUIRE(kvti_st_write(&size, &xx, fd, p, items, n, meta, 2) == 0);
  CHECK_EQ_INT(size, kvti_st_file_size(items, n, meta, 2));
  size_t len;
  char *all = kvt_test_read_file(p, &len);
  CHECK_EQ_INT(len, size);
  CHECK(kvti_xxh3(all, len) == xx);
  kvti_st_header hd;
  kvti_xxh3_state *h = kvti_xxh3_new();
  REQUIRE(kvti_st_read_header(&hd, fd, len, p, h) == 0);
  CHECK_EQ_INT(hd.n, n);
  CHECK_EQ_INT(hd.data_start % 8, 0);
  CHECK_EQ_INT(hd.file_size, len);
  CHECK_EQ_INT(hd.n_meta, 2);
  /* keys are written sorted */
  CHECK(hd.n_meta == 2 && strcmp(hd.meta_keys[0], "a key") == 0 &&
        strcmp(hd.meta_vals[0], "v\"al\\ue\n") == 0 &&
        strcmp(hd.meta_vals[1], "np") == 0);
  uint64_t prev = 0;
  for (size_t i = 0; i < hd.n; i++) {
    const kvti_st_tensor *t = &hd.tensors[i];
    CHECK(t->offset >= prev);
    prev = t->offset;
    kvti_xxh3_update(h, all + t->offset, t->nbytes);
  }
  CHECK(kvti_xxh3_digest(h) == xx); /* header + data in offset order = file */
  for (size_t i = 0; i < n; i++) {
    const kvti_st_tensor *t = kvti_st_find(&hd, names[i]);
    REQUIRE(t);
    CHECK_EQ_INT(t->dtype, ts[i].dtype);
    CHECK_EQ_INT(t->ndim, ts[i].ndim);
    CHECK_EQ_INT(t->nbytes, ts[i].nbytes);
    for (uint32_t d = 0; d < t->ndim; d++)
      CHECK_EQ_INT(t->shape[d], ts[i].shape[d]);
    CHECK(ts[i].nbytes == 0 ||
          memcmp(all + t->offset, ts[i].data, ts[i].nbytes) == 0);
  }
  CHECK(kvti_st_find(&hd, "nope") == NULL);
  kvti_st_header_free(&hd);
  kvti_xxh3_free(h);
  close(fd);
  free(all);
  free(p);
  for (size_t i = 0; i < n; i++)
    free(ts[i].data);
  /* writer refuses inconsistent input */
  kvt_tensor bad = t_tensor(&r, KVT_DTYPE_F32, 1, 4);
  bad.nbytes = 12;
  kvti_st_item bi = {"x", &bad};
  char *hdr;
  size_t hl, ord[2];
  CHECK_EQ_INT(kvti_st_build_header(&hdr, &hl, ord, &bi, 1, NULL, 0),
               KVT_EINVAL);
  bad.nbytes = 16;
  kvti_st_item dup[2] = {{"x", &bad}, {"x", &bad}};
  CHECK_EQ_INT(kvti_st_build_header(&hdr, &hl, ord, dup, 2, NULL, 0),
               KVT_EINVAL);
  free(bad.data);
}

/* Byte-exact output for a known case, as safetensors' save_file writes it:
 * compact JSON, keys sorted, data sorted by dtype (descending enum order) then
 * name, padded with spaces. */
static void test_exact_bytes(void) {
  uint16_t a[2] = {0x3c00, 0x4000}; /* F16 "b_half" */
  float b[1] = {1.5f};              /* F32 "a_float" */
  int64_t c[1] = {-1};              /* I64 "c_long" */
  kvt_tensor ta = {KVT_DTYPE_F16, 1, {2}, a, 4};
  kvt_tensor tb = {KVT_DTYPE_F32, 2, {1, 1}, b, 4};
  kvt_tensor tc = {KVT_DTYPE_I64, 0, {0}, c, 8};
  kvti_st_item items[3] = {{"b_half", &ta}, {"a_float", &tb}, {"c_long", &tc}};
  char *hdr = NULL;
  size_t hl = 0, ord[3];
  REQUIRE(kvti_st_build_header(&hdr, &hl, ord, items, 3, NULL, 0) == 0);
  const char *want =
      "{\"c_long\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[0,8]},"
      "\"a_float\":{\"dtype\":\"F32\",\"shape\":[1,1],\"data_offsets\":[8,12]},"
      "\"b_half\":{\"dtype\":\"F16\",\"shape\":[2],\"data_offsets\":[12,16]}}";
  size_t wl = strlen(want), pad = (8 - wl % 8) % 8;
  CHECK_EQ_INT(hl, 8 + wl + pad);
  uint64_t stored = 0;
  for (int i = 7; i >= 0; i--)
    stored = (stored << 8) | (unsigned char)hdr[i];
  CHECK_EQ_INT(stored, wl + pad);
  CHECK(memcmp(hdr + 8, want, wl) == 0);
  for (size_t i = 0; i < pad; i++)
    CHECK(hdr[8 + wl + i] == ' ');
  CHECK(ord[0] == 2 && ord[1] == 1 && ord[2] == 0);
  kvti_free(hdr);
}

static void test_truncation_and_flips(void) {
  kvt_rng r = {12};
  kvt_tensor t1 = t_tensor(&r, KVT_DTYPE_BF16, 2, 2, 3);
  kvt_tensor t2 = t_tensor(&r, KVT_DTYPE_U8, 1, 5);
  kvti_st_item items[2] = {{"k", &t1}, {"v", &t2}};
  char *p = t_join(g_dir, "small.safetensors");
  int fd = open(p, O_RDWR | O_CREAT | O_TRUNC, 0600);
  REQUIRE(kvti_st_write(NULL, NULL, fd, p, items, 2, NULL, 0) == 0);
  close(fd);
  size_t len;
  char *orig = kvt_test_read_file(p, &len);
  kvti_st_header hd;
  for (size_t n = 0; n < len; n++)
    CHECK_EQ_INT(parse_file_bytes(&hd, orig, n), KVT_ECORRUPT);
  char *ext = malloc(len + 1);
  memcpy(ext, orig, len);
  ext[len] = 0;
  CHECK_EQ_INT(parse_file_bytes(&hd, ext, len + 1), KVT_ECORRUPT);
  REQUIRE(parse_file_bytes(&hd, orig, len) == 0);
  size_t data_start = (size_t)hd.data_start;
  kvti_st_header_free(&hd);
  /* every flip in the length and JSON: corrupt, or a still-valid header
   * describing the same layout (e.g. a flipped space in the padding is not) -
   * never a crash */
  int accepted = 0;
  for (size_t i = 0; i < data_start; i++)
    for (int bit = 0; bit < 8; bit++) {
      memcpy(ext, orig, len);
      ext[i] ^= (char)(1 << bit);
      int rc = parse_file_bytes(&hd, ext, len);
      if (rc == 0) {
        accepted++;
        kvti_st_header_free(&hd);
      } else {
        CHECK_EQ_INT(rc, KVT_ECORRUPT);
      }
    }
  /* a few flips give another valid header (e.g. "k" -> "j", dtype BF16 <->
   * F16); the entry checksums catch those */
  CHECK(accepted < 40);
  free(ext);
  free(orig);
  free(p);
  free(t1.data);
  free(t2.data);
}

static void test_malformed_headers(void) {
  const struct {
    const char *json;
    size_t dlen;
  } bad[] = {
      {"", 0},
      {"[]", 0},
      {"\"x\"", 0},
      {"{", 0},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}x", 4},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}\n", 4},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
       "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
       8}, /* dup */
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
       "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[2,6]}}",
       8}, /* overlap */
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
       "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]}}",
       12}, /* gap */
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 3},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 5},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]}}", 4},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", 4},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1.5],\"data_offsets\":[0,4]}}", 4},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[\"1\"],\"data_offsets\":[0,4]}}",
       4},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":1,\"data_offsets\":[0,4]}}", 4},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,4294967296],"
       "\"data_offsets\":[0,0]}}",
       0}, /* overflow */
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[9007199254740993],"
       "\"data_offsets\":[0,4]}}",
       4},
      {"{\"a\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,1,1],"
       "\"data_offsets\":[0,1]}}",
       1}, /* ndim 9 */
      {"{\"a\":{\"dtype\":\"F8_E4M3\",\"shape\":[1],\"data_offsets\":[0,1]}}",
       1},
      {"{\"a\":{\"dtype\":7,\"shape\":[1],\"data_offsets\":[0,1]}}", 1},
      {"{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1,2]}}", 2},
      {"{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,0]}}", 1},
      {"{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":{}}}", 1},
      {"{\"a\":{\"dtype\":\"U8\",\"shape\":[1]}}", 1},
      {"{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1],\"x\":1}"
       "}",
       1},
      {"{\"a\":{\"dtype\":\"U8\",\"dtype\":\"U8\",\"shape\":[1],"
       "\"data_offsets\":[0,1]}}",
       1},
      {"{\"a\":[1,2]}", 0},
      {"{\"a\":null}", 0},
      {"{\"__metadata__\":{\"k\":1}}", 0},
      {"{\"__metadata__\":[]}", 0},
      {"{\"__metadata__\":{},\"__metadata__\":{}}", 0},
      {"{\"__metadata__\":{\"k\":\"a\",\"k\":\"b\"}}", 0},
      {"{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1e400]}}",
       1},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    int rc = parse_header_text(bad[i].json, bad[i].dlen);
    if (rc != KVT_ECORRUPT)
      fprintf(stderr, "malformed header %zu accepted: %s\n", i, bad[i].json);
    CHECK_EQ_INT(rc, KVT_ECORRUPT);
  }
  /* deep nesting */
  char deep[5000];
  size_t k = 0;
  deep[k++] = '{';
  deep[k++] = '"';
  deep[k++] = 'a';
  deep[k++] = '"';
  deep[k++] = ':';
  for (int i = 0; i < 2000; i++)
    deep[k++] = '[';
  deep[k] = 0;
  CHECK_EQ_INT(parse_header_text(deep, 0), KVT_ECORRUPT);
  /* good ones */
  CHECK_EQ_INT(parse_header_text("{}", 0), 0);
  CHECK_EQ_INT(parse_header_text("{}      ", 0), 0);
  CHECK_EQ_INT(parse_header_text("{\"__metadata__\":{\"format\":\"pt\"}}", 0),
               0);
  CHECK_EQ_INT(
      parse_header_text(
          "{\"b\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[1,3]},"
          "\"a\":{\"dtype\":\"BOOL\",\"shape\":[1],\"data_offsets\":[0,1]},"
          "\"z\":{\"dtype\":\"F64\",\"shape\":[0,3],\"data_offsets\":[3,3]}}",
          3),
      0);
  /* header length out of range */
  unsigned char b[16] = {0};
  kvti_st_header hd;
  uint64_t huge[] = {UINT64_MAX, (uint64_t)1 << 63, 100000001, 9, 0, 1};
  for (size_t i = 0; i < sizeof huge / sizeof huge[0]; i++) {
    for (int j = 0; j < 8; j++)
      b[j] = (unsigned char)(huge[i] >> (8 * j));
    b[8] = '{';
    b[9] = '}';
    CHECK_EQ_INT(parse_file_bytes(&hd, b, 16), KVT_ECORRUPT);
  }
  /* direct parser bound */
  CHECK_EQ_INT(kvti_st_parse(&hd, "{}", 2, 9, "x"), KVT_ECORRUPT);
  CHECK_EQ_INT(kvti_st_parse(&hd, "{}", 2, 10, "x"), 0);
  kvti_st_header_free(&hd);
}

/* Seeded random mutations (byte changes, insertions, deletions, JSON tokens
 * spliced in) of a valid header, parsed from memory: never a crash (ASan/UBSan
 * run this), and whatever is accepted satisfies the invariants the readers rely
 * on. */
static void test_random_mutations(void) {
  const char *base =
      "{\"__metadata__\":{\"format\":\"np\"},\"layer_0_keys\":{\"dtype\":"
      "\"F16\",\"shape\":[1,2,3],\"data_offsets\":[0,12]},\"layer_0_values\":"
      "{\"dtype\":\"F16\",\"shape\":[1,2,3],\"data_offsets\":[12,24]}}";
  const char *tokens[] = {"{",
                          "}",
                          "[",
                          "]",
                          ",",
                          ":",
                          "\"",
                          "0",
                          "-1",
                          "1e9",
                          "null",
                          "true",
                          "\\u0000",
                          "99999999999999999999",
                          "[0,24]",
                          "\"U8\"",
                          "\"__metadata__\""};
  kvt_rng r = {13};
  char buf[1024];
  int accepted = 0;
  for (int it = 0; it < 20000; it++) {
    size_t n = strlen(base);
    memcpy(buf, base, n);
    int edits = 1 + (int)(kvt_rng_next(&r) % 4);
    for (int e = 0; e < edits; e++) {
      size_t pos = (size_t)(kvt_rng_next(&r) % (n + 1));
      switch (kvt_rng_next(&r) % 4) {
      case 0: /* change */
        if (pos < n)
          buf[pos] = (char)(kvt_rng_next(&r) & 0xff);
        break;
      case 1: /* delete */
        if (pos < n) {
          memmove(buf + pos, buf + pos + 1, n - pos - 1);
          n--;
        }
        break;
      default: { /* splice a token */
        const char *t =
            tokens[kvt_rng_next(&r) % (sizeof tokens / sizeof tokens[0])];
        size_t tl = strlen(t);
        if (n + tl < sizeof buf) {
          memmove(buf + pos + tl, buf + pos, n - pos);
          memcpy(buf + pos, t, tl);
          n += tl;
        }
      }
      }
    }
    uint64_t fsize =
        8 + n + (kvt_rng_next(&r) % 3 == 0 ? 24 : kvt_rng_next(&r) % 40);
    kvti_st_header hd;
    int rc = kvti_st_parse(&hd, buf, n, fsize, "fuzz");
    if (rc == 0) {
      accepted++;
      uint64_t pos = hd.data_start;
      for (size_t k = 0; k < hd.n; k++) {
        CHECK(hd.tensors[k].offset == pos);
        CHECK(hd.tensors[k].ndim <= KVT_MAX_DIMS);
        pos += hd.tensors[k].nbytes;
      }
      CHECK(pos == fsize && hd.file_size == fsize);
      kvti_st_header_free(&hd);
    } else {
      CHECK(rc == KVT_ECORRUPT || rc == KVT_ENOMEM);
    }
  }
  CHECK(accepted > 0);
}

int main(void) {
  g_dir = kvt_test_tmpdir("safetensors");
  RUN(test_roundtrip_all_dtypes);
  RUN(test_exact_bytes);
  RUN(test_truncation_and_flips);
  RUN(test_malformed_headers);
  RUN(test_random_mutations);
  return kvt_test_done();
}
