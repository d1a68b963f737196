/*
 * redis.h - the Redis/Valkey implementation of the storage-backend seam
 * (store/redis/, built only when hiredis is found: KVT_HAVE_REDIS): its
 * configuration, the metadata a remote lookup learns from an entry's remote
 * manifest, and the calls beyond the generic backend vtable (find, fetch,
 * stat, staging). It knows nothing of the tier; tier/remote.c is the glue.
 */
#ifndef KVT_STORE_REDIS_H
#define KVT_STORE_REDIS_H

#include "store/backend.h"
#include "kvtier.h"

#include <stdint.h>

/* What a remote lookup learns from an entry's remote manifest. */
typedef struct kvti_remote_meta {
  char hash[KVT_HASH_HEX_LEN + 1];
  uint64_t num_tokens;
  uint64_t memory_bytes;
  uint64_t total_bytes; /* bytes of the entry's files */
  double created_at;
  int storage_mode;
} kvti_remote_meta;

/* Configuration of the Redis backend. */
typedef struct kvti_redis_cfg {
  const char *url;
  const char *prefix; /* key prefix ("kvt:" when NULL) */
  uint32_t timeout_ms;
  uint64_t chunk_bytes;
  int64_t ttl_ms;         /* 0 = keys do not expire */
  const char *stage_root; /* local directory for staging entry files */
  uint32_t file_mode, dir_mode;
  uint32_t lookup_timeout_ms; /* lookups' own deadline (0 = timeout_ms) */
  const char *tls_ca_file;    /* rediss:// only; NULL = system store */
  const char *tls_cert_file;  /* client certificate (with tls_key_file) */
  const char *tls_key_file;
  int mirror; /* keep a local mirror of the remote keys for lookups */
} kvti_redis_cfg;

#if KVT_HAVE_REDIS
/* The Redis backend (vtable of backend.h; put/get stage files in stage_root).
 * No connection is made here. Returns 0, KVT_EINVAL (URL), KVT_ENOMEM. */
int kvti_backend_redis_new(kvti_backend **out, const kvti_redis_cfg *cfg);
/* Exact (prefix 0) or longest-prefix lookup of tokens among entries of at
 * least min_len tokens, without scanning the keyspace. Returns 0 and *out,
 * KVT_ENOTFOUND, or a connection error. */
int kvti_redis_find(kvti_backend *b, kvti_remote_meta *out,
                    const int32_t *tokens, size_t n, int prefix,
                    uint64_t min_len);
/* The cheap lookup for kvt_tier_lookup* (same answers as kvti_redis_find):
 * while the key mirror is in sync, a miss costs no I/O and a hit one GET of
 * its manifest (lookup deadline), which confirms what a following promote
 * will find; otherwise one bounded round trip, whose misses are cached for a
 * second. Returns 0 and *out, KVT_ENOTFOUND, or a connection error. */
int kvti_redis_lookup(kvti_backend *b, kvti_remote_meta *out,
                      const int32_t *tokens, size_t n, int prefix,
                      uint64_t min_len);
/* 1 while the lookup mirror is in sync (*entries: entries mirrored). */
int kvti_redis_mirror_state(kvti_backend *b, size_t *entries);
/* Contacts the store now: 0, KVT_EPERM (credentials / certificate refused),
 * KVT_EIO / KVT_ETIMEDOUT (unreachable). */
int kvti_redis_probe(kvti_backend *b);
/* Downloads entry hash into dest_data_dir/<hash>/ (files verified against the
 * remote manifest's chunk checksums). A missing or damaged part cleans up the
 * remote entry and returns KVT_ENOTFOUND / KVT_ECORRUPT. */
int kvti_redis_fetch(kvti_backend *b, kvti_remote_meta *out, const char *hash,
                     const char *dest_data_dir);
/* The remote manifest of entry hash: 0 and *out, KVT_ENOTFOUND, KVT_ECORRUPT
 * (a damaged manifest), or a connection error. */
int kvti_redis_stat(kvti_backend *b, kvti_remote_meta *out, const char *hash);
/* Makes a unique empty staging directory below stage_root (malloc'ed path). */
int kvti_redis_stage_dir(kvti_backend *b, char **out);
#endif

#endif
