/*
 * fetch.c - the Redis backend's read path (the vtable's fetch and get): read
 * the remote manifest, then the chunks of its generation in pipelined batches
 * to the entry's slot, check each chunk's size and xxh3 against the manifest,
 * scatter the bytes into the entry's files in a local staging directory, and
 * let entry.c's reader verify them as it verifies a local entry. A chunk that
 * is missing (evicted) or damaged makes the entry a miss and deletes what is
 * left of it on the server: a partial entry is never served.
 */
#include "base/error.h"
#include "base/hash.h"
#include "base/io.h"
#include "store/redis/internal.h"

#include <fcntl.h>
#include <inttypes.h>
#include <string.h>

/* ------------------------------------------------------------------------ */
/* fetch / get                                                              */
/* ------------------------------------------------------------------------ */

/* Writes bytes [off, off+len) of the entry's concatenated files into the open
 * files (fds[i] for files[i]). */
static int scatter(const rmanifest *m, const int *fds, const char *dir,
                   uint64_t off, const char *data, uint64_t len) {
  uint64_t fstart = 0;
  for (size_t i = 0; i < m->n_files && len > 0; i++) {
    uint64_t fend = fstart + m->files[i].size;
    if (off < fend) {
      uint64_t in = off - fstart;
      uint64_t take = fend - off < len ? fend - off : len;
      int rc = kvti_pwrite_all(fds[i], data, (size_t)take, in, dir);
      if (rc != 0)
        return rc;
      off += take;
      data += take;
      len -= take;
    }
    fstart = fend;
  }
  return 0;
}

int kvti_rb_fetch(kvti_backend *b, kvti_backend_meta *out, const char *hash,
                  const char *dest_data_dir) {
  redis_backend *rb = kvti_rb(b);
  if (!kvti_is_hash_name(hash))
    return KVT_ERR(KVT_EINVAL, "invalid entry name");
  rmanifest m;
  int rc = kvti_rb_rman_get(rb, rb->cl, &m, hash);
  if (rc == KVT_ECORRUPT) {
    kvti_rb_remove_entry(rb, hash, NULL);
    return rc;
  }
  if (rc != 0)
    return rc;
  char *dir = kvti_path_join(dest_data_dir, hash);
  int *fds = kvti_malloc(m.n_files * sizeof *fds);
  size_t opened = 0;
  int gone = 0; /* a chunk missing or damaged: clean up the remote entry */
  if (!dir || !fds) {
    rc = KVT_ERR_NOMEM();
    goto out;
  }
  if ((rc = kvti_mkdir(dir, rb->dir_mode)) != 0)
    goto out;
  for (; opened < m.n_files; opened++) {
    char *p = kvti_path_join(dir, m.files[opened].name);
    if (!p) {
      rc = KVT_ENOMEM;
      goto out;
    }
    int fd = kvti_open(p, O_WRONLY | O_CREAT | O_TRUNC, rb->file_mode);
    kvti_free(p);
    if (fd < 0) {
      rc = fd;
      goto out;
    }
    fds[opened] = fd;
  }
  uint64_t per =
      RB_BATCH_BYTES / m.chunk_bytes ? RB_BATCH_BYTES / m.chunk_bytes : 1;
  for (uint64_t base = 0; base < m.n_chunks && rc == 0; base += per) {
    chunk_batch bt;
    if ((rc = kvti_rb_batch_open(&bt, rb, hash, m.gen, base,
                                 m.n_chunks - base < per ? m.n_chunks - base
                                                         : per)) != 0)
      break;
    for (uint64_t i = 0; i < bt.n; i++)
      kvti_rb_cmd2(&bt.cmds[i], "GET", bt.keys[i].s, bt.keys[i].n);
    rc = kvti_rb_batch_exec(rb, &bt);
    for (uint64_t i = 0; rc == 0 && i < bt.n; i++) {
      uint64_t ci = base + i;
      uint64_t want = m.total - ci * m.chunk_bytes < m.chunk_bytes
                          ? m.total - ci * m.chunk_bytes
                          : m.chunk_bytes;
      redisReply *r = bt.rep[i];
      if ((rc = kvti_rb_reply_err(r, "GET chunk")) != 0)
        break;
      if (r->type == REDIS_REPLY_NIL) {
        gone = 1;
        rc = KVT_ERR(KVT_ENOTFOUND,
                     "remote entry %.16s is incomplete: chunk %" PRIu64
                     " of %" PRIu64 " is gone (evicted or deleted)",
                     hash, ci, m.n_chunks);
      } else if (r->type != REDIS_REPLY_STRING || (uint64_t)r->len != want ||
                 kvti_xxh3(r->str, r->len) != m.sums[ci]) {
        gone = 1;
        rc = KVT_ERR(KVT_ECORRUPT,
                     "remote entry %.16s: chunk %" PRIu64
                     " is damaged (size or xxh3 mismatch)",
                     hash, ci);
      } else {
        rc = scatter(&m, fds, dir, ci * m.chunk_bytes, r->str, want);
      }
    }
    kvti_rb_batch_close(&bt);
  }
  if (rc == 0 && out)
    *out = m.meta;
out:
  for (size_t i = 0; i < opened; i++)
    kvti_io->close(fds[i]);
  kvti_free(fds);
  kvti_free(dir);
  if (gone) {
    kvti_error_state es;
    kvti_error_state_capture(&es, rc);
    kvti_rb_remove_entry(rb, hash, &m);
    kvti_error_state_restore(&es);
  }
  kvti_rb_rman_free(&m);
  return rc;
}

int kvti_rb_get(kvti_backend *b, kvt_entry **out, const char *hash,
                const kvti_read_opts *o) {
  char *stage = NULL;
  int rc = kvti_rb_stage(b, &stage);
  if (rc != 0)
    return rc;
  kvti_backend_meta meta;
  rc = kvti_rb_fetch(b, &meta, hash, stage);
  if (rc == 0 && meta.chained)
    rc = KVT_ERR(KVT_EUNSUPPORTED,
                 "remote entry %.16s is a chained entry's tail: it is read "
                 "with its chunks by the tier (docs/REMOTE.md)",
                 hash);
  else if (rc == 0) {
    rc = kvti_entry_read(out, stage, hash, o);
    if (rc == KVT_ECORRUPT || rc == KVT_ENOTFOUND) {
      kvti_error_state es;
      kvti_error_state_capture(&es, rc);
      kvti_rb_remove_entry(kvti_rb(b), hash, NULL);
      KVT_ERR(rc, "remote entry: %s", es.msg);
    }
  }
  kvti_rmtree(stage);
  kvti_free(stage);
  return rc;
}
