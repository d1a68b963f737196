/*
 * fuzz_safetensors.c - libFuzzer target for the safetensors header parser. The
 * input is a whole safetensors file (8-byte little-endian header length, JSON
 * header, data). It is parsed in memory (kvti_st_parse over the header bytes
 * with the input size as the file size) and through the file path
 * (kvti_st_read_header on a scratch file, which also feeds the checksum state).
 * Whatever the parser accepts must be self-consistent - every tensor inside the
 * file, its byte length equal to its element count times the dtype size,
 * offsets sorted and not overlapping, the data ending exactly at the file size
 * - or the target aborts (a finding).
 */
#include "fuzz_common.h"
#include "format/safetensors.h"

static void check(const kvti_st_header *h, uint64_t file_size) {
  if (h->n > KVTI_ST_MAX_TENSORS || h->data_start < 8 ||
      h->file_size != file_size)
    abort();
  uint64_t end = h->data_start;
  for (size_t i = 0; i < h->n; i++) {
    const kvti_st_tensor *t = &h->tensors[i];
    size_t es = kvt_dtype_size(t->dtype);
    if (!es || t->ndim > KVT_MAX_DIMS || !t->name)
      abort();
    uint64_t cnt = 1;
    for (uint32_t d = 0; d < t->ndim; d++) {
      if (t->shape[d] < 0)
        abort();
      cnt *= (uint64_t)t->shape[d];
    }
    if (cnt * es != t->nbytes || t->offset < end ||
        t->offset + t->nbytes > file_size)
      abort();
    end = t->offset + t->nbytes;
    if (kvti_st_find(h, t->name) == NULL)
      abort();
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 8)
    return 0;
  uint64_t hl = 0;
  for (int i = 7; i >= 0; i--)
    hl = hl << 8 | data[i];
  size_t len = hl < size - 8 ? (size_t)hl : size - 8;
  kvti_st_header h;
  if (kvti_st_parse(&h, (const char *)data + 8, len, size, "fuzz") == 0) {
    check(&h, size);
    kvti_st_header_free(&h);
  }
  char p[600];
  snprintf(p, sizeof p, "%s/st", fz_dir());
  fz_write(p, data, size);
  int fd = open(p, O_RDONLY);
  if (fd < 0)
    abort();
  kvti_xxh3_state *x = kvti_xxh3_new();
  if (kvti_st_read_header(&h, fd, size, p, x) == 0) {
    check(&h, size);
    kvti_st_header_free(&h);
  }
  kvti_xxh3_free(x);
  close(fd);
  return 0;
}
