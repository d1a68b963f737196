/*
 * local.h - the local-directory backend (store/local.c), the tier's own store
 * and the one owner of the cache directory's layout: cache_dir itself (the
 * ownership, permission and symlink checks), data/<hash>/ (entries),
 * quarantine/, index.db's creation mode, the one-writer kvtier.lock, the
 * measuring of data/<hash> for the index, and the staging root where remote
 * entries are fetched to be adopted into data/ by rename. The tier opens it
 * with kvti_backend_local_open and otherwise reaches it through the vtable of
 * backend.h, apart from the few layout steps of open and close below.
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

/* The local chunk store (the chunked store's, kvti_chunked_chunks: opened
 * over the index, after this backend) handed out by the backend's chunks op,
 * so the tier reaches local chunks as it reaches a remote backend's; NULL
 * detaches it (before the chunked store closes). Borrowed, not owned. */
void kvti_backend_local_set_chunks(kvti_backend *b, kvti_chunk_backend *cb);

#endif
