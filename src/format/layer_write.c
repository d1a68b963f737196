/*
 * layer_write.c - writes a planned layer as one safetensors file through the
 * staged O_DIRECT writer (alone or in an entry's write group), hashing it as it
 * goes (whole file or per block), and computes the exact size such a file will
 * have. Native files of at least KVTI_DATA_ALIGN_MIN bytes of tensors get their
 * header padded to KVTI_DATA_ALIGN so that readers can use O_DIRECT. Also the
 * public kvt_layer_save (validate, plan, write one file).
 */
#include "format/layer.h"
#include "base/error.h"
#include "base/io.h"
#include "engine/fwriter.h"
#include "format/safetensors.h"

static kvti_st_item *items_of(const kvti_layer_out *p) {
  kvti_st_item *it = kvti_calloc(p->n ? p->n : 1, sizeof *it);
  if (!it) {
    KVT_ERR_NOMEM();
    return NULL;
  }
  for (uint32_t j = 0; j < p->n; j++) {
    it[j].name = p->names[j];
    it[j].t = &p->tensors[j];
  }
  return it;
}

/* The header alignment a planned file gets: KVTI_DATA_ALIGN only for native
 * files holding at least KVTI_DATA_ALIGN_MIN bytes of tensors (what the reader
 * may read with O_DIRECT); small files keep the 8-byte padding so the
 * alignment never costs more than 0.4% of a file. */
static uint64_t layer_data_bytes(const kvti_layer_out *p) {
  uint64_t data = 0;
  for (uint32_t j = 0; j < p->n; j++)
    data += p->tensors[j].nbytes;
  return data;
}
static uint64_t layer_align(const kvti_layer_out *p) {
  return p->data_align && layer_data_bytes(p) >= KVTI_DATA_ALIGN_MIN
             ? p->data_align
             : 0;
}

uint64_t kvti_layer_out_file_size(const kvti_layer_out *p) {
  kvti_st_item *it = items_of(p);
  if (!it)
    return 0;
  /* descriptors may have NULL data when not materialized: size only */
  kvt_tensor *tmp = kvti_calloc(p->n ? p->n : 1, sizeof *tmp);
  uint64_t sz = 0;
  if (tmp) {
    static char dummy;
    for (uint32_t j = 0; j < p->n; j++) {
      tmp[j] = p->tensors[j];
      tmp[j].data = &dummy;
      it[j].t = &tmp[j];
    }
    sz = kvti_st_file_size(it, p->n, NULL, 0);
    uint64_t a = layer_align(p);
    if (sz && a) {
      /* the data part is sz minus the 8-aligned header: re-align the header */
      uint64_t data = layer_data_bytes(p);
      sz = ((sz - data + a - 1) & ~(a - 1)) + data;
    }
    kvti_free(tmp);
  } else {
    KVT_ERR_NOMEM();
  }
  kvti_free(it);
  return sz;
}

int kvti_layer_write_file(uint64_t *size, uint64_t *xxh3, const char *path,
                          const kvti_layer_out *p, uint32_t file_mode,
                          int do_fsync, int truncate, int io_backend,
                          kvti_wgroup *group, kvti_blkhash *blocks) {
  /* Through the staged writer (fwriter.h): the header and the tensors are
   * copied into aligned pooled buffers, hashed while hot, and written with
   * O_DIRECT, several writes in flight. In a group the writes complete (and are
   * fsynced) at kvti_wgroup_finish. */
  kvti_st_item *it = items_of(p);
  size_t *order = kvti_calloc(p->n ? p->n : 1, sizeof *order);
  char *hdr = NULL;
  size_t hl = 0;
  kvti_fwriter *w = NULL;
  int rc = 0;
  if (!it || !order) {
    rc = KVT_ERR_NOMEM();
    goto out;
  }
  rc = kvti_st_build_header(&hdr, &hl, order, it, p->n, NULL, 0);
  uint64_t align = layer_align(p);
  if (rc == 0 && align)
    rc = kvti_st_pad_header(&hdr, &hl, (size_t)align);
  if (rc)
    goto out;
  uint64_t total = hl + layer_data_bytes(p);
  kvti_fwriter_opts fo = KVTI_FWRITER_OPTS_INIT;
  fo.backend = io_backend;
  fo.hash = xxh3 != NULL;
  fo.blocks = blocks;
  fo.size_hint = total;
  fo.file_mode = file_mode;
  fo.excl = !truncate;
  rc = group ? kvti_wgroup_file(&w, group, path, &fo)
             : kvti_fwriter_open(&w, path, &fo);
  if (rc) {
    w = NULL;
    goto out;
  }
  rc = kvti_fwriter_append(w, hdr, hl);
  for (uint32_t j = 0; rc == 0 && j < p->n; j++) {
    const kvt_tensor *t = it[order[j]].t;
    if (t->nbytes)
      rc = kvti_fwriter_append(w, t->data, (size_t)t->nbytes);
  }
  if (group) {
    if (rc == 0)
      rc = kvti_fwriter_close(w, size, xxh3);
  } else if (rc) {
    kvti_fwriter_abort(w);
  } else {
    rc = kvti_fwriter_finish(w, size, xxh3, do_fsync);
  }
  if (rc == 0 && blocks) /* every byte was fed: close the last block */
    rc = kvti_blkhash_final(blocks, xxh3);
out:
  kvti_free(hdr);
  kvti_free(order);
  kvti_free(it);
  return rc;
}

/* ---- public single-layer API -------------------------------------------- */

int kvt_layer_save(char **meta_json, const char *path, const kvt_layer *layer,
                   uint32_t layer_idx, int mode, uint32_t file_mode) {
  if (!meta_json || !path || !layer)
    return KVT_ERR(KVT_EINVAL, "kvt_layer_save: NULL argument");
  if (mode != KVT_STORAGE_NATIVE && mode != KVT_STORAGE_COMPAT)
    return KVT_ERR(KVT_EINVAL, "kvt_layer_save: invalid storage mode %d", mode);
  if (layer_idx > KVTI_MAX_LAYERS)
    return KVT_ERR(KVT_EINVAL, "kvt_layer_save: layer_idx too large");
  int rc = kvti_layer_validate(layer, layer_idx, 1);
  if (rc == 0)
    rc = kvti_layer_check_rows(layer, layer_idx, 0, UINT64_MAX, KVT_EINVAL,
                               "kvt_layer_save");
  if (rc)
    return rc;
  kvti_layer_out p;
  rc = kvti_layer_plan(&p, layer, layer_idx, mode,
                       kvti_layer_is_quantized(layer), 1);
  if (rc)
    return rc;
  rc = kvti_layer_write_file(NULL, NULL, path, &p, file_mode, 0, 1, KVT_IO_AUTO,
                             NULL, NULL);
  if (rc == 0) {
    *meta_json = p.meta_json;
    p.meta_json = NULL;
  }
  kvti_layer_out_free(&p);
  return rc;
}
