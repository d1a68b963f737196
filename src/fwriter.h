/*
 * fwriter.h - a staged, pipelined writer for one file, used for layer files.
 * Bytes appended from anywhere (the safetensors header, then each tensor) are
 * copied into 4096-aligned pooled staging buffers and hashed (XXH3-64) while
 * they are hot in cache; each full staging buffer is written at an aligned file
 * offset through O_DIRECT with several writes in flight (iobatch push/wait)
 * while the caller fills the next one. Only the final partial block goes
 * through the page cache. The file is preallocated to the expected size so the
 * direct writes do not extend it (ext4 serialises extending direct writes).
 * Buffered write + fsync reaches ~30-40% of the disk's speed on the target VMs;
 * this path reaches the O_DIRECT speed.
 *
 * A writer is used by one thread. On any failure (and on abort) the file is
 * closed and removed.
 */
#ifndef KVT_FWRITER_H
#define KVT_FWRITER_H

#include "bufpool.h"

#include <stddef.h>
#include <stdint.h>

typedef struct kvti_fwriter kvti_fwriter;

typedef struct kvti_fwriter_opts {
  int backend;        /* kvt_io_backend of the engine (KVT_IO_AUTO) */
  int no_direct;      /* 1: never O_DIRECT (page cache only) */
  int hash;           /* 1: compute the XXH3-64 of every byte written */
  uint64_t size_hint; /* expected final size (preallocated); 0 = unknown */
  uint32_t file_mode; /* 0 = 0600 */
  int excl;           /* 1: O_EXCL (fail if the file exists), else O_TRUNC */
  kvti_bufpool *pool; /* staging buffers; NULL = the default pool */
} kvti_fwriter_opts;
#define KVTI_FWRITER_OPTS_INIT                                                 \
  { 0, 0, 1, 0, 0600, 0, NULL }

/* Creates path (O_WRONLY|O_CREAT, + O_EXCL or O_TRUNC). Returns 0 and *out, or
 * the open's error (KVT_EIO, KVT_EPERM, KVT_ENOSPC...), KVT_ENOMEM,
 * KVT_EUNSUPPORTED (backend). */
int kvti_fwriter_open(kvti_fwriter **out, const char *path,
                      const kvti_fwriter_opts *o);
/* Appends len bytes (copied before return). Returns 0 or the write error (the
 * writer is then failed: every later call returns the error; finish/abort still
 * required). */
int kvti_fwriter_append(kvti_fwriter *w, const void *data, size_t len);
/* Writes what is staged, waits for every write, trims any preallocation beyond
 * the bytes written, fsyncs when do_fsync, closes, frees w. *size / *xxh3 (may
 * be NULL) receive the file size and checksum. On failure the file is removed.
 * Returns 0 or the error. */
int kvti_fwriter_finish(kvti_fwriter *w, uint64_t *size, uint64_t *xxh3,
                        int do_fsync);
/* Closes, removes the file and frees w. Accepts NULL. */
void kvti_fwriter_abort(kvti_fwriter *w);

#endif
