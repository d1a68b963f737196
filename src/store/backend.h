/*
 * backend.h - the storage-backend seam of the tier. The tier logic (queue,
 * locks, index, capacity, retention, budget, stats) talks to entry storage only
 * through this vtable, so a shared remote tier (e.g. Redis or an object store)
 * can be added later as another implementation without touching tier.c,
 * writer.c or promote.c. backend_local.c implements it over a local cache
 * directory in the reference's layout (data/<hash>/..., quarantine/<hash>).
 *
 * Contract for every implementation: entries are named by their 64-hex token
 * hash; put publishes an entry atomically (readers see the old complete entry
 * or the new complete one, never a mix) and on failure leaves no trace of the
 * new one; get never returns data that failed verification. The tier serialises
 * all mutating calls (put, remove, quarantine, purge) and excludes readers of
 * the same entry with its striped locks, so a backend needs no locking of its
 * own beyond what concurrent gets of different entries require. All functions
 * return 0 or a negative KVT_E* code with the thread's error message set.
 */
#ifndef KVT_BACKEND_H
#define KVT_BACKEND_H

#include "format/entry.h"
#include "kvtier.h"

#include <stdint.h>

typedef struct kvti_backend kvti_backend;

/* Kinds reported by list(). */
enum {
  KVTI_BK_ENTRY = 1, /* a published entry (name = 64-hex hash) */
  KVTI_BK_TMP = 2,   /* an unfinished or stale temporary (name ends ".tmp") */
  KVTI_BK_OTHER = 3  /* anything else; the tier leaves it alone */
};

/* Called by list() once per stored name; nonzero stops the walk (returned by
 * list). */
typedef int (*kvti_backend_list_fn)(void *ctx, const char *name, int kind);

/* One put in progress, split in steps (see the ops below); backend-owned. */
typedef struct kvti_put_txn kvti_put_txn;

typedef struct kvti_backend_ops {
  const char *name; /* "local" */
  /* Publishes snapshot s under its hash, replacing an existing entry
   * atomically. *disk_bytes = bytes stored. */
  int (*put)(kvti_backend *b, uint64_t *disk_bytes, const kvti_snapshot *s,
             const kvti_write_opts *o);
  /* Reads and verifies an entry (see kvti_entry_read for codes). */
  int (*get)(kvti_backend *b, kvt_entry **out, const char *hash,
             const kvti_read_opts *o);
  /* Deletes an entry. A missing entry is success. */
  int (*remove)(kvti_backend *b, const char *hash);
  /* 1 when the entry is present and complete enough to read (dir + manifest), 0
   * when not, or a negative code. */
  int (*exists)(kvti_backend *b, const char *hash);
  /* 1 when anything at all is stored under hash (even an incomplete entry), 0
   * when nothing, or a negative code. */
  int (*present)(kvti_backend *b, const char *hash);
  /* JSON description (manifest + headers, no tensor data); *json malloc'ed via
   * kvti_malloc. */
  int (*describe)(kvti_backend *b, char **json, const char *hash);
  /* Calls fn for every stored name (entries, temporaries, other). */
  int (*list)(kvti_backend *b, kvti_backend_list_fn fn, void *ctx);
  /* Removes a temporary or other non-entry name reported by list(). */
  int (*purge)(kvti_backend *b, const char *name);
  /* Moves a corrupt entry out of the way (kept for inspection, bounded to
   * keep_max, oldest dropped first; keep_max 0 deletes it). A missing entry is
   * success. */
  int (*quarantine)(kvti_backend *b, const char *hash, uint32_t keep_max);
  /* Frees the backend. */
  void (*destroy)(kvti_backend *b);
  /* Last, so positional initialisers of older backends stay valid. The
   * same put in steps, so that the tier can order a replacement's
   * publication and its index commit safely (the commit may fail after the
   * publish: busy, EIO, ENOSPC). stage writes the new version where no
   * reader sees it (on failure nothing remains and *txn is NULL); publish
   * makes it the live version atomically while keeping the previous one;
   * then exactly one of commit (drops the previous version) or rollback
   * (puts the previous version back, or removes the new entry when there was
   * none; also valid after a failed publish) ends the txn and frees it. The
   * previous version is readable again as soon as rollback returns 0; a
   * failed rollback leaves the new complete version live. The local backend
   * has them (the writer requires them); a backend only ever written through
   * put (the Redis one: uploads) leaves them NULL. */
  int (*stage)(kvti_backend *b, kvti_put_txn **txn, uint64_t *disk_bytes,
               const kvti_snapshot *s, const kvti_write_opts *o);
  int (*publish)(kvti_backend *b, kvti_put_txn *txn);
  void (*commit)(kvti_backend *b, kvti_put_txn *txn);
  int (*rollback)(kvti_backend *b, kvti_put_txn *txn);
  /* What the index needs of a stored entry, from the entry alone
   * (kvti_entry_probe: the index is rebuilt from these). KVT_ECORRUPT: the
   * entry is invalid. NULL where entries cannot be listed and adopted. */
  int (*probe)(kvti_backend *b, const char *hash, kvti_entry_probe_info *out);
} kvti_backend_ops;

struct kvti_backend {
  const kvti_backend_ops *ops;
};

/* The local-directory backend over cache_dir (data/ and quarantine/ below it).
 * data/ must exist. dir_mode is used for quarantine/. Returns 0, KVT_ENOMEM. */
int kvti_backend_local_new(kvti_backend **out, const char *cache_dir,
                           uint32_t dir_mode);
/* The local backend's data directory (for the index's disk-byte measurement).
 */
const char *kvti_backend_local_data_dir(const kvti_backend *b);

#endif
