/*
 * chunkstore_adopt.c - chunks that arrive from another node (the remote tier's
 * chunk sharing, docs/REMOTE.md "Chunks"): a chunk file received as bytes is
 * verified completely - header parse (checksum, key = SHA-256 of parent and
 * tokens, descriptor), the key, parent, position, tokens, namespace and layout
 * the chain expects, and every data block's XXH3 - before anything is kept,
 * then written into the local chunk store the way a spill writes one (tmp,
 * fsync with durability FSYNC, rename, fsync of the directory) and indexed
 * (parents before children, as kvti_chains_put requires). So a fetched chunk
 * is used only through the local, verified read path, and the next promote of
 * the same prefix is local.
 */
#include "store/chunkstore.h"

#include "base/error.h"
#include "base/hash.h"
#include "base/io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <stdio.h>
#include <string.h>

int kvti_chunk_verify_bytes(const void *bytes, size_t len,
                            const kvti_chunk_expect *x, kvti_chain_rec *out) {
  const uint8_t *b = bytes;
  char what[96];
  char kh[65];
  kvti_hex32(kh, x->key);
  snprintf(what, sizeof what, "chunk %.16s", kh);
  if (len < KVTI_CHUNK_FIXED)
    return KVT_ERR(KVT_ECORRUPT, "%s: %zu bytes, shorter than a header", what,
                   len);
  uint32_t hb = kvti_chunk_header_bytes(b, len, what);
  if (hb == 0)
    return KVT_ECORRUPT;
  if (hb > len)
    return KVT_ERR(KVT_ECORRUPT, "%s: truncated header", what);
  kvti_chunk_hdr h;
  memset(&h, 0, sizeof h);
  int rc = kvti_chunk_parse(&h, b, hb, (uint64_t)len, what);
  if (rc)
    return rc;
  if (memcmp(h.key, x->key, 32) || memcmp(h.parent, x->parent, 32) ||
      h.index != x->index || h.n_tokens != x->n_tokens)
    rc = KVT_ERR(KVT_ECORRUPT, "%s: not the chunk the chain names", what);
  else if (x->layout_hash && h.layout_hash != x->layout_hash)
    rc = KVT_ERR(KVT_ECORRUPT, "%s: another KV layout", what);
  else if (x->ns && (h.ns_len != x->ns_len || memcmp(h.ns, x->ns, x->ns_len)))
    rc = KVT_ERR(KVT_ECORRUPT, "%s: another namespace", what);
  else if (memcmp(h.tokens, x->tokens, (size_t)h.n_tokens * sizeof(int32_t)))
    rc = KVT_ERR(KVT_ECORRUPT, "%s: tokens differ from the prompt", what);
  kvti_blkhash *bh = NULL;
  if (rc == 0)
    rc = kvti_blkhash_new(&bh, h.block_size, 0);
  if (rc == 0) {
    kvti_blkhash_expect(bh, h.blocks, (size_t)h.n_blocks, what);
    rc = kvti_blkhash_update(bh, b + h.header_bytes, (size_t)h.data_bytes);
    if (rc == 0)
      rc = kvti_blkhash_final(bh, NULL);
  }
  kvti_blkhash_free(bh);
  if (rc == 0 && out) {
    memset(out, 0, sizeof *out);
    memcpy(out->key, h.key, 32);
    memcpy(out->parent, h.parent, 32);
    out->ck = x->ck;
    out->layout_hash = h.layout_hash;
    out->index = h.index;
    out->n_tokens = h.n_tokens;
    int pure = h.n_layers == h.spill_layers;
    for (uint32_t i = 0; i < h.n_layers; i++)
      if (h.layers[i].kind == KVT_LAYER_ROTATING_KV)
        pure = 0;
    out->pure = (uint8_t)pure;
    out->mem_bytes = kvti_chunk_hdr_mem_bytes(&h);
    out->disk_bytes = len;
  }
  kvti_chunk_hdr_free(&h);
  return rc;
}

int kvti_chunkstore_adopt(kvti_chunkstore *cs, const void *bytes, size_t len,
                          const kvti_chain_rec *rec) {
  kvti_chains *ch = kvti_chunkstore_chains(cs);
  if (kvti_chains_find(ch, rec->key, NULL))
    return 0; /* stored meanwhile: never written twice */
  kvti_chunkstore_opts o;
  kvti_chunkstore_get_opts(cs, &o);
  char path[4096], tmp[4200];
  int rc = kvti_chunkstore_path(cs, rec->key, path, sizeof path);
  if (rc)
    return rc;
  snprintf(tmp, sizeof tmp, "%.*s.tmp", (int)(strlen(path) - 4), path);
  /* Every name is resolved in chunks/<kk>'s descriptor, reached from
   * cache_dir's without following links (as a spill's chunk writes): a
   * link at chunks/, chunks/<kk>, the tmp or the final name is never
   * followed. */
  const char *name = strrchr(path, '/') + 1, *tname = strrchr(tmp, '/') + 1;
  int dfd = kvti_chunkstore_make_subdir(cs, rec->key[0]);
  if (dfd < 0)
    return dfd;
  kvti_unlinkat(dfd, tname, tmp); /* a stale one from a crash */
  kvt_clear_error();
  int fd =
      kvti_openat(dfd, tname, O_WRONLY | O_CREAT | O_EXCL, o.file_mode, tmp);
  if (fd < 0) {
    kvti_close(dfd);
    return fd;
  }
  rc = kvti_pwrite_all(fd, bytes, len, 0, tmp);
  if (rc == 0 && o.do_fsync)
    rc = kvti_fsync(fd, tmp);
  int crc = kvti_close(fd);
  if (rc == 0)
    rc = crc;
  if (rc == 0)
    rc = kvti_renameat(dfd, tname, dfd, name, tmp, path);
  if (rc == 0 && o.do_fsync)
    rc = kvti_fsync(dfd, path);
  /* Durable before indexed, as a spill's chunks. */
  if (rc == 0 && (rc = kvti_chains_put(ch, rec, 1)) != 0) {
    kvti_error_state es;
    kvti_error_state_capture(&es, rc);
    kvti_unlinkat(dfd, name, path);
    kvti_error_state_restore(&es);
  }
  if (rc) {
    kvti_error_state es;
    kvti_error_state_capture(&es, rc);
    kvti_unlinkat(dfd, tname, tmp);
    kvti_error_state_restore(&es);
  }
  kvti_close(dfd);
  return rc;
}
