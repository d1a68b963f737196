/*
 * fwriter.h - a staged, pipelined writer for the files of an entry. Bytes
 * appended from anywhere (a safetensors header, then each tensor) are copied
 * into 4096-aligned pooled staging buffers and hashed (XXH3-64 of the whole
 * file, or per block through a caller's kvti_blkhash) while they are hot in
 * cache; each full staging buffer is written at an aligned file offset
 * through O_DIRECT with several writes in flight (iobatch push/wait) while the
 * caller fills the next one. Only a file's final partial block goes through the
 * page cache. Bytes the caller keeps until the group finishes may skip the
 * copy (kvti_fwriter_append_held): aligned runs of them are written from where
 * they lie where the stages are not huge pages (kvti_wgroup_in_place). Files
 * are preallocated to their expected size so direct writes do not extend them
 * (ext4 serialises extending direct writes).
 *
 * Files are written in a group (one entry = one group): closing a file does not
 * wait for its writes, so the pipeline stays full across the 32+ layer files of
 * an entry, and the group's finish waits once, then fsyncs every file at once
 * (io_uring fsyncs in parallel, which the journal commits together) - per-file
 * write-then-fsync costs ~3 ms per file on the target VMs, more than writing a
 * 4 MiB layer. Buffered write + fsync reaches ~30-40% of the disk's speed
 * there; this path reaches the O_DIRECT speed.
 *
 * A group (and its files) is used by one thread. One file of a group is
 * appended to at a time (open the next after closing the previous). On any
 * failure the group is failed: every later call returns the error and
 * finish/abort remove every file the group created.
 */
#ifndef KVT_FWRITER_H
#define KVT_FWRITER_H

#include "base/bufpool.h"
#include "base/hash.h"

#include <stddef.h>
#include <stdint.h>

typedef struct kvti_wgroup kvti_wgroup;
typedef struct kvti_fwriter kvti_fwriter;

typedef struct kvti_fwriter_opts {
  int backend;        /* kvt_io_backend of the engine (KVT_IO_AUTO) */
  int no_direct;      /* 1: never O_DIRECT (page cache only) */
  int hash;           /* 1: compute the XXH3-64 of every byte written */
  uint64_t size_hint; /* expected final size (preallocated); 0 = unknown */
  uint32_t file_mode; /* 0 = 0600; applied with chmod (umask-independent) */
  int excl;           /* 1: O_EXCL (fail if the file exists), else O_TRUNC */
  kvti_bufpool *pool; /* staging buffers; NULL = the default pool */
  /* Non-NULL: every byte is fed (once, while hot) to this caller-owned block
   * hasher instead of the whole-file hash (`hash` is then ignored and close
   * reports no checksum: the caller finalizes the hasher after close). */
  kvti_blkhash *blocks;
  /* > 0: the file's first head_reserve bytes are left for a header that is
   * only known once the data is written (its checksums): appends start at
   * offset head_reserve (a multiple of 4096 keeps them O_DIRECT) and the
   * header is written by kvti_fwriter_put_head before the file is closed. The
   * hash options cover the appended bytes only. */
  uint64_t head_reserve;
} kvti_fwriter_opts;
#define KVTI_FWRITER_OPTS_INIT                                                 \
  { 0, 0, 1, 0, 0600, 0, NULL, NULL, 0 }

/* Group: backend/pool as above; do_fsync: files are fsynced at finish (and at
 * the internal checkpoints that bound the number of open files). Returns 0,
 * KVT_ENOMEM, KVT_EUNSUPPORTED. */
int kvti_wgroup_open(kvti_wgroup **out, int backend, kvti_bufpool *pool,
                     int do_fsync);
/* The same with depth writes in flight (0: the engine's default of 8). A
 * group of many large files gains from 16 (512 KiB tensors written from
 * where they lie then keep 8 MiB in flight); a single spill's group measured
 * slower with 16 on the 2-core VM (docs/PERFORMANCE.md). */
int kvti_wgroup_open_depth(kvti_wgroup **out, int backend, kvti_bufpool *pool,
                           int do_fsync, unsigned depth);
/* Whether held appends are written from the caller's memory (1) or copied
 * into the stages like any append (0). The default is 0 where the pool's
 * stage buffers are huge pages (kvti_bufpool_huge_bytes: a disk takes writes
 * from them in fewer, larger requests, which outweighs the copy), 1 where
 * they are not (no copy for nothing). set_in_place changes it for later
 * appends (either way the file's bytes are the same); accepts NULL. */
void kvti_wgroup_set_in_place(kvti_wgroup *g, int in_place);
int kvti_wgroup_in_place(const kvti_wgroup *g);
/* Starts a file in the group (o->backend/pool are ignored: the group's). */
int kvti_wgroup_file(kvti_fwriter **out, kvti_wgroup *g, const char *path,
                     const kvti_fwriter_opts *o);
/* The same for file name (no '/') in directory descriptor dirfd: created
 * with O_NOFOLLOW relative to dirfd (a link planted at name is refused,
 * never followed: KVT_EPERM), and chmod'ed, opened for O_DIRECT and removed
 * on failure through dirfd, never by path. dirfd is borrowed: it must stay
 * open until the group finishes or aborts. path (may be NULL: name) names
 * the file in messages. KVT_EINVAL: dirfd < 0 or a bad name. */
int kvti_wgroup_file_at(kvti_fwriter **out, kvti_wgroup *g, int dirfd,
                        const char *name, const char *path,
                        const kvti_fwriter_opts *o);
/* Writes the reserved head (opts.head_reserve) of an open file: len must
 * equal head_reserve. Written through the page cache at offset 0 (synchronous,
 * a few KiB) and made durable with the file by the group's fsync. A file opened
 * with a reserve cannot be closed before its head is put (KVT_EINVAL, and the
 * group fails). Returns 0, KVT_EINVAL, or the I/O error (the group fails). */
int kvti_fwriter_put_head(kvti_fwriter *w, const void *head, size_t len);
/* Ends the current file: its last bytes are queued, *size / *xxh3 (may be NULL)
 * receive its size and checksum now; the writes complete by kvti_wgroup_finish.
 */
int kvti_fwriter_close(kvti_fwriter *w, uint64_t *size, uint64_t *xxh3);
/* Waits for every write, trims preallocation beyond each file's size, fsyncs
 * every file (when the group was opened with do_fsync), closes them and frees
 * the group. On failure every file of the group is removed. Returns 0 or the
 * first error. */
int kvti_wgroup_finish(kvti_wgroup *g);
/* Waits for writes in flight, closes and removes every file, frees. Accepts
 * NULL. */
void kvti_wgroup_abort(kvti_wgroup *g);

/* Single-file convenience (a private group of one). */
int kvti_fwriter_open(kvti_fwriter **out, const char *path,
                      const kvti_fwriter_opts *o);
/* Single file in a directory descriptor (kvti_wgroup_file_at's rules). */
int kvti_fwriter_open_at(kvti_fwriter **out, int dirfd, const char *name,
                         const char *path, const kvti_fwriter_opts *o);
/* Appends len bytes (copied before return). Returns 0 or the error. */
int kvti_fwriter_append(kvti_fwriter *w, const void *data, size_t len);
/* Appends len bytes the caller keeps untouched (and allocated) until the
 * group finishes or aborts: hashed at once, then, in a group that writes in
 * place (kvti_wgroup_in_place), written with O_DIRECT straight from there -
 * no copy - when they start at a 4096-aligned address
 * and file offset and appends adjacent in memory add up to a long enough run
 * (else copied as kvti_fwriter_append does). The file's bytes are the same
 * either way. Returns 0 or the error. */
int kvti_fwriter_append_held(kvti_fwriter *w, const void *data, size_t len);
/* For a writer from kvti_fwriter_open: close + finish of its group (fsync when
 * do_fsync). */
int kvti_fwriter_finish(kvti_fwriter *w, uint64_t *size, uint64_t *xxh3,
                        int do_fsync);
/* The group w writes in (for a writer from kvti_fwriter_open, its private
 * one: kvti_wgroup_set_in_place applies to it). */
kvti_wgroup *kvti_fwriter_group(kvti_fwriter *w);
/* For a writer from kvti_fwriter_open: abort of its group. Accepts NULL. */
void kvti_fwriter_abort(kvti_fwriter *w);

#endif
