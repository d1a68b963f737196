/*
 * backend.h - the entry-store seam of the tier (its chunk-store seam is
 * store/chunk_backend.h). The tier logic (queue,
 * locks, index, capacity, retention, budget, stats, the remote upload queue
 * and back-off) talks to entry storage only through this vtable, the remote
 * stores' own operations (kvti_remote_ops) and the constructors below: the
 * local backend (store/local.h, which alone knows the cache directory's
 * layout and has the local-only operations) and the remote constructor table
 * (kvti_backend_remote_new, store/registry.c), so adding a remote store
 * (another key-value server, an object store) touches no tier file.
 * store/local.c implements it over a local cache directory in the reference's
 * layout; store/redis/ over Redis / Valkey.
 *
 * Contract for every implementation: entries are named by their 64-hex token
 * hash; put publishes an entry atomically (readers see the old complete entry
 * or the new complete one, never a mix) and on failure leaves no trace of the
 * new one; get never returns data that failed verification. The tier serialises
 * all mutating calls (put, remove, quarantine, purge, adopt) and excludes
 * readers of the same entry with its striped locks, so a backend needs no
 * locking of its own beyond what concurrent gets of different entries require.
 * All functions return 0 or a negative KVT_E* code with the thread's error
 * message set.
 */
#ifndef KVT_BACKEND_H
#define KVT_BACKEND_H

#include "format/entry.h"
#include "index/chain.h"
#include "kvtier.h"
#include "store/chunk_backend.h"

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

/* What a store that answers lookups itself (find, stat, fetch) knows of an
 * entry without reading it: its remote manifest, for the Redis backend. */
typedef struct kvti_backend_meta {
  char hash[KVT_HASH_HEX_LEN + 1];
  uint64_t num_tokens;
  uint64_t memory_bytes;
  uint64_t total_bytes; /* bytes of the entry's files */
  double created_at;
  int storage_mode;
  /* A chunked entry's tail (the chunked native store shared between nodes:
   * docs/REMOTE.md "Chunks"): its files hold only the rows past the chain,
   * which chain says where to find. Never served without it. */
  int chained;
  kvti_chained_entry chain;
  uint8_t chain_seed[32]; /* its chain's key_{-1}: namespace + layout */
} kvti_backend_meta;

/* The entry-store seam proper: every operation here is filled by every
 * backend (tests/arch/entry_seam.py fails on a backend that leaves one out),
 * so the tier drives both stores the same way. What only one kind of store
 * has sits outside it: the steps of a local put, probing, adoption and
 * measuring are the local directory's (store/local.h, kvti_backend_local_*;
 * the tier's own store t->be is always local), and lookups by tokens,
 * staging and fetching, reachability and chained uploads are a remote
 * store's (kvti_remote_ops below, reached through kvti_backend.remote). */
typedef struct kvti_backend_ops {
  const char *name; /* "local", "redis" */
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
  /* The chunk store beside this backend's entries, behind the chunk-store
   * seam (store/chunk_backend.h; chunks shared between nodes: docs/REMOTE.md
   * "Chunks"). The op is always there; its answer is NULL when the store
   * holds no chunks: the Redis backend's own (valid until destroy); the
   * local backend's is the chunked store's (kvti_chunked_chunks, opened over
   * the index after the backend and attached with
   * kvti_backend_local_set_chunks: NULL while chunking is off). */
  kvti_chunk_backend *(*chunks)(kvti_backend *b);
  /* Frees the backend. */
  void (*destroy)(kvti_backend *b);
} kvti_backend_ops;

/* What only a remote store does: it answers lookups itself (there is no
 * tier index in front of it), its entries reach the local store by staging
 * and fetching, it can be unreachable, and it keeps chained entries' tails
 * for other nodes. Every remote backend fills every operation (the Redis
 * one: tests/arch/entry_seam.py); the local backend has none
 * (kvti_backend.remote NULL). */
typedef struct kvti_remote_ops {
  /* Lookup by tokens: exact (prefix 0) or the longest stored prefix of
   * tokens among entries of at least min_len tokens. 0 and *out,
   * KVT_ENOTFOUND, or a connection error. */
  int (*find)(kvti_backend *b, kvti_backend_meta *out, const int32_t *tokens,
              size_t n, int prefix, uint64_t min_len);
  /* The stored metadata of entry hash: 0 and *out, KVT_ENOTFOUND,
   * KVT_ECORRUPT (damaged metadata), or a connection error. */
  int (*stat)(kvti_backend *b, kvti_backend_meta *out, const char *hash);
  /* Makes a unique empty staging directory (malloc'ed path via kvti_malloc;
   * the caller removes it with kvti_rmtree) for fetch. */
  int (*stage)(kvti_backend *b, char **dir);
  /* Copies entry hash into stage_dir/<hash>/ (files checked against the
   * store's own checksums; the caller then verifies them with the entry
   * reader). out (may be NULL) receives the metadata. A missing or damaged
   * part cleans up the stored entry and returns KVT_ENOTFOUND /
   * KVT_ECORRUPT. */
  int (*fetch)(kvti_backend *b, kvti_backend_meta *out, const char *hash,
               const char *stage_dir);
  /* Contacts the store now: 0, KVT_EPERM (credentials / certificates
   * refused: a configuration error), KVT_EIO / KVT_ETIMEDOUT (unreachable). */
  int (*reach)(kvti_backend *b);
  /* put of a chained entry's tail snapshot s: ce and its chain's seed are
   * stored with it (meta's chain, chain_seed) so that no reader serves the
   * tail alone. */
  int (*put_chained)(kvti_backend *b, uint64_t *disk_bytes,
                     const kvti_snapshot *s, const kvti_write_opts *o,
                     const kvti_chained_entry *ce, const uint8_t seed[32]);
} kvti_remote_ops;

struct kvti_backend {
  const kvti_backend_ops *ops;
  /* A remote store's own operations; NULL for the local backend and for
   * read-only shims over a staging directory. */
  const kvti_remote_ops *remote;
};

/* b's chunk store behind the chunk-store seam, or NULL (none, or b NULL). */
static inline kvti_chunk_backend *kvti_backend_chunks(kvti_backend *b) {
  return b ? b->ops->chunks(b) : NULL;
}

/* ---- the remote constructor table (store/registry.c) ---- */

/* Configuration of a remote store; the URL's scheme picks the backend. */
typedef struct kvti_remote_cfg {
  const char *url;
  const char *prefix; /* key prefix (the backend's default when NULL) */
  uint32_t timeout_ms;
  uint64_t chunk_bytes;
  int64_t ttl_ms;         /* 0 = stored entries do not expire */
  const char *stage_root; /* local directory for staging entry files (the
                             local backend's, kvti_backend_local_stage_root) */
  uint32_t file_mode, dir_mode;
  uint32_t lookup_timeout_ms; /* find's own deadline (0 = timeout_ms) */
  const char *tls_ca_file;    /* rediss:// only; NULL = system store */
  const char *tls_cert_file;  /* client certificate (with tls_key_file) */
  const char *tls_key_file;
  int mirror; /* keep a local mirror of the remote keys for find */
} kvti_remote_cfg;

/* Validates a remote URL (its scheme names a known backend, the rest parses)
 * without connecting, the same in every build. 0 or KVT_EINVAL. */
int kvti_backend_remote_check_url(const char *url);
/* Makes the remote backend cfg->url names. No connection is made here. The
 * backend's remote is set (every kvti_remote_ops operation filled). Returns 0,
 * KVT_EINVAL (URL), KVT_EUNSUPPORTED (a backend this build does not include:
 * the message says how to get it), KVT_ENOMEM. */
int kvti_backend_remote_new(kvti_backend **out, const kvti_remote_cfg *cfg);

#endif
