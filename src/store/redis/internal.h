/*
 * internal.h - private to src/store/redis/: the Redis backend's object
 * (redis_backend), its key, batch and remote-manifest types, and the helpers
 * that the put and the vtable (backend.c), the read path (fetch.c), the
 * lookups (find.c) and the shared chunks (chunks.c) use: keys, commands and
 * batches (keys.c), the remote manifest (rmanifest.c), deletion (remove.c),
 * staging (stage.c). Key layout and the entry's protocol are described at the
 * top of backend.c. Nothing here is seen outside this folder.
 */
#ifndef KVT_STORE_REDIS_INTERNAL_H
#define KVT_STORE_REDIS_INTERNAL_H

#include "store/backend.h"
#include "store/redis/mirror.h"
#include "store/redis/rclient.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#define RB_MAX_FILES 4096
#define RB_BATCH_BYTES (64ull << 20) /* bytes of chunks per pipeline */
#define RB_PREFIX_BLOCK 16           /* tokens of the reference's prefix_hash */

/* Short-lived negative cache of the lookup round trip (used while the mirror
 * is not in sync): direct-mapped by the query's 64-bit key. */
#define RB_NEG_SLOTS 512
#define RB_NEG_TTL 1.0 /* seconds */
typedef struct neg_slot {
  uint64_t key;
  uint64_t gen; /* the mirror's generation when cached */
  double until; /* monotonic seconds */
} neg_slot;

typedef struct redis_backend {
  kvti_backend base;
  kvti_chunk_backend chunks; /* the shared chunks behind the chunk seam */
  kvr_client *cl;            /* data: remote_timeout_ms */
  kvr_client *lcl;           /* lookups: remote_lookup_timeout_ms */
  kvr_mirror *mirror;
  pthread_mutex_t neg_mu;
  neg_slot neg[RB_NEG_SLOTS];
  char *prefix;
  uint64_t chunk_bytes;
  int64_t ttl_ms;
  char *stage_root;
  uint32_t file_mode, dir_mode;
  atomic_uint_fast64_t stage_seq;
} redis_backend;

static inline redis_backend *kvti_rb(kvti_backend *b) {
  return (redis_backend *)b;
}

typedef struct rkey {
  char s[512];
  size_t n;
} rkey;

/* One pipelined batch of commands on chunks [base, base + n) of a generation:
 * their keys (all in the entry's slot, so one kvr_exec), the commands the
 * caller fills in, and the replies. */
typedef struct chunk_batch {
  rkey *keys;
  kvr_cmd *cmds;
  redisReply **rep;
  uint64_t n;
} chunk_batch;

typedef struct rfile {
  char name[128];
  uint64_t size;
} rfile;

typedef struct rmanifest {
  char gen[17];
  kvti_backend_meta meta;
  uint64_t chunk_bytes, total, n_chunks;
  rfile *files;
  size_t n_files;
  uint64_t *sums; /* n_chunks */
  char *raw;      /* the manifest text as stored (for compare-and-delete) */
  size_t raw_len;
} rmanifest;

/* ---- keys (keys.c) ---- */

/* k = <prefix> followed by fmt (the caller keeps it under 512 bytes). */
void kvti_rb_key_fmt(rkey *k, const redis_backend *rb, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* <P>{<hash>}:m, the manifest key (the entry's commit marker). */
void kvti_rb_key_manifest(rkey *k, const redis_backend *rb, const char *hash);
/* <P>{<hash>}:<gen>:<i>, chunk i of generation gen. */
void kvti_rb_key_chunk(rkey *k, const redis_backend *rb, const char *hash,
                       const char *gen, uint64_t i);
/* The id of the prefix set an entry of these tokens belongs to: "z:<sha256
 * of the first 16 tokens>" or, shorter than 16, "s:<first token>". */
int kvti_rb_pset_id(char id[80], const int32_t *tokens, size_t n);
/* The prefix set key <P>{<id>} an entry of these tokens belongs to. */
int kvti_rb_key_pset(rkey *k, const redis_backend *rb, const int32_t *tokens,
                     size_t n);

/* ---- commands and replies (keys.c) ---- */

/* Appends an argument of len bytes to c (fewer than KVR_MAX_ARGS). */
void kvti_rb_cmd_arg(kvr_cmd *c, const char *a, size_t len);
/* Starts c as the command a with the argument b of bl bytes. */
void kvti_rb_cmd2(kvr_cmd *c, const char *a, const char *b, size_t bl);
/* Appends "PX ttl" to a SET when entries expire. */
void kvti_rb_cmd_px(kvr_cmd *c, const redis_backend *rb, const char *ttl);
/* 0, or the error (KVT_ENOSPC for OOM, else KVT_EIO) an error reply is. */
int kvti_rb_reply_err(const redisReply *r, const char *what);
void kvti_rb_free_replies(redisReply **r, size_t n);
/* A batch of n (>= 1) chunk commands from chunk base: open fills the keys,
 * the caller fills cmds, exec runs them as one pipeline, close frees. */
int kvti_rb_batch_open(chunk_batch *b, const redis_backend *rb,
                       const char *hash, const char *gen, uint64_t base,
                       uint64_t n);
int kvti_rb_batch_exec(redis_backend *rb, chunk_batch *b);
void kvti_rb_batch_close(chunk_batch *b);

/* ---- the remote manifest (rmanifest.c) ---- */

void kvti_rb_rman_free(rmanifest *m);
/* 1 when s may name a file of a remote entry (what a manifest may list and a
 * put may upload): [A-Za-z0-9_.-], not empty, no leading dot, shorter than
 * rfile.name. */
int kvti_rb_safe_file_name(const char *s);
/* Parses and validates a remote manifest for entry hash. */
int kvti_rb_rman_parse(rmanifest *m, const char *txt, size_t len,
                       const char *hash, uint64_t chunk_limit);
/* GET of the manifest's text: 0 and *raw (kvti_malloc'ed, NUL-terminated),
 * KVT_ENOTFOUND, KVT_ECORRUPT (not a string), I/O errors. */
int kvti_rb_rman_get_raw(redis_backend *rb, kvr_client *cl, const char *hash,
                         char **raw, size_t *len);
/* GET and parse of the manifest on client cl. 0 and *m, KVT_ENOTFOUND,
 * KVT_ECORRUPT, I/O errors. */
int kvti_rb_rman_get(redis_backend *rb, kvr_client *cl, rmanifest *m,
                     const char *hash);

/* ---- deleting (remove.c) ---- */

/* Deletes chunks [0, n) of generation gen (pipelined, one slot). */
int kvti_rb_del_chunks(redis_backend *rb, const char *hash, const char *gen,
                       uint64_t n);
/* ZREM of hash from the prefix set pset (a stale member). */
int kvti_rb_zrem(redis_backend *rb, const rkey *pset, const char *hash);
/* Deletes every key of one version of an entry (known: the version a reader
 * found damaged; NULL: whatever version is stored now). */
int kvti_rb_remove_entry(redis_backend *rb, const char *hash,
                         const rmanifest *known);

/* ---- staging (stage.c) ---- */

/* The vtable's stage: a fresh local staging directory (*out kvti_malloc'ed). */
int kvti_rb_stage(kvti_backend *b, char **out);

/* ---- the vtable's read path (fetch.c) and lookups (find.c) ---- */

int kvti_rb_fetch(kvti_backend *b, kvti_backend_meta *out, const char *hash,
                  const char *dest_data_dir);
int kvti_rb_get(kvti_backend *b, kvt_entry **out, const char *hash,
                const kvti_read_opts *o);
int kvti_rb_find(kvti_backend *b, kvti_backend_meta *out, const int32_t *tokens,
                 size_t n, int prefix, uint64_t min_len);
int kvti_rb_reach(kvti_backend *b);

/* ---- chunks of the chunked store (chunks.c) ---- */

/* Sets rb->chunks up as the chunk-store seam's Redis store
 * (store/chunk_backend.h). */
void kvti_rb_chunks_init(redis_backend *rb);

#endif
