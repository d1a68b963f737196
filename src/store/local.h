/*
 * local.h - the local-directory backend (store/local.c), the tier's own store
 * and the one owner of the cache directory's layout: cache_dir itself (the
 * ownership, permission and symlink checks), data/<hash>/ (entries),
 * quarantine/, index.db's creation mode, the one-writer kvtier.lock, the
 * measuring of data/<hash> for the index, and the staging root where remote
 * entries are fetched to be adopted into data/ by rename. The tier opens it
 * with kvti_backend_local_open and reaches it through the entry-store seam
 * of backend.h, plus the local-only operations below: the layout steps of
 * open and close, and what only a directory of entries does (a put in
 * steps, probing an entry for the index, adopting a staged entry, measuring
 * one). The tier's own store is always this backend, so it calls these
 * directly; each takes a kvti_backend that kvti_backend_is_local says is
 * local (anything else is a caller's bug).
 */
#ifndef KVT_STORE_LOCAL_H
#define KVT_STORE_LOCAL_H

#include "store/backend.h"

#include <stdint.h>

typedef struct kvti_local_cfg {
  const char *dir; /* absolute cache directory */
  uint32_t dir_mode, file_mode;
  int readonly;   /* create nothing, take no lock */
  int skip_owner; /* KVT_OPEN_SKIP_OWNER_CHECK */
} kvti_local_cfg;

/* Opens the layout: checks cache_dir and data/ (creating them with exactly
 * dir_mode unless read-only; refusing a symlink, a non-directory, another
 * owner or group/other write beyond dir_mode unless skip_owner) and, unless
 * read-only, takes kvtier.lock (flock, held until kvti_backend_local_unlock or
 * destroy; a second writer, in this process or another, gets KVT_EBUSY).
 * Returns 0, KVT_EPERM, KVT_EIO, KVT_EBUSY, KVT_ENOMEM or an OS error. */
int kvti_backend_local_open(kvti_backend **out, const kvti_local_cfg *cfg);
/* Releases kvtier.lock (close: the backend is no longer written). */
void kvti_backend_local_unlock(kvti_backend *b);
/* Open's recovery: entries an interrupted portable replace left only at
 * data/<hash>.old.tmp are put back (see format/entry_restore.h); *restored
 * counts them. */
int kvti_backend_local_recover(kvti_backend *b, int do_fsync,
                               uint64_t *restored);
/* Creates an empty index.db with file_mode when there is none (SQLite would
 * create it 0644 minus the umask; an empty file is a valid empty database).
 * An existing one is left as it is. */
int kvti_backend_local_prepare_index(kvti_backend *b);
/* The staging root, made on first call: cache_dir/remote.tmp/ (a stale one
 * removed first) for a writer, a private mkdtemp under $TMPDIR for a
 * read-only backend. Removed with everything in it at destroy. *root stays
 * owned by the backend. */
int kvti_backend_local_stage_root(kvti_backend *b, const char **root);
/* Checks an in-memory copy of entry hash (the host RAM tier's) against the
 * stored manifest, tokens and block checksums, as a read of data/<hash>
 * would (kvti_entry_verify_mem). Returns 0 or why the copy must not be
 * served. */
int kvti_backend_local_verify_mem(kvti_backend *b, const char *hash,
                                  kvt_layer *layers, uint32_t n_layers,
                                  const kvti_read_opts *o);

/* 1 when b is a local-directory backend (made by kvti_backend_local_open). */
int kvti_backend_is_local(const kvti_backend *b);

/* ---- a put in steps ----
 * The same put as the seam's, in steps, so that the tier can order a
 * replacement's publication and its index commit safely (the commit may fail
 * after the publish: busy, EIO, ENOSPC). put_stage writes the new version
 * where no reader sees it (on failure nothing remains and *txn is NULL);
 * put_publish makes it the live version atomically while keeping the
 * previous one; then exactly one of put_commit (drops the previous version)
 * or put_rollback (puts the previous version back, or removes the new entry
 * when there was none; also valid after a failed publish) ends the txn and
 * frees it. The previous version is readable again as soon as rollback
 * returns 0; a failed rollback leaves the new complete version live. A
 * remote store is only ever written whole (uploads), so it has no steps. */
typedef struct kvti_put_txn kvti_put_txn;
int kvti_backend_local_put_stage(kvti_backend *b, kvti_put_txn **txn,
                                 uint64_t *disk_bytes, const kvti_snapshot *s,
                                 const kvti_write_opts *o);
int kvti_backend_local_put_publish(kvti_backend *b, kvti_put_txn *txn);
void kvti_backend_local_put_commit(kvti_backend *b, kvti_put_txn *txn);
int kvti_backend_local_put_rollback(kvti_backend *b, kvti_put_txn *txn);
/* Makes every put_publish since the last sync durable (one fsync of data/),
 * for publishes staged with kvti_write_opts.defer_dir_sync. 0 or a code
 * (then none of them may be counted durable). */
int kvti_backend_local_put_sync(kvti_backend *b);

/* What the index needs of a stored entry, from the entry alone
 * (kvti_entry_probe, or the chain record of an entry that is its chain
 * alone: the index is rebuilt from these). KVT_ECORRUPT: the entry is
 * invalid. */
int kvti_backend_local_probe(kvti_backend *b, const char *hash,
                             kvti_entry_probe_info *out);
/* Takes stage_dir/<hash>/ (a verified entry, e.g. fetched from a remote
 * store into the staging root) in as entry hash, by rename: nothing is
 * copied. Fails when an entry is stored under hash. */
int kvti_backend_local_adopt(kvti_backend *b, const char *stage_dir,
                             const char *hash);
/* Bytes stored for entry hash (the index's measuring callback): 1 with
 * *bytes set, 0 when it cannot be measured, or KVT_ENOMEM. */
int kvti_backend_local_measure(kvti_backend *b, const char *hash,
                               uint64_t *bytes);

/* The local chunk store (the chunked store's, kvti_chunked_chunks: opened
 * over the index, after this backend) handed out by the backend's chunks op,
 * so the tier reaches local chunks as it reaches a remote backend's; NULL
 * detaches it (before the chunked store closes). Borrowed, not owned. */
void kvti_backend_local_set_chunks(kvti_backend *b, kvti_chunk_backend *cb);

#endif
