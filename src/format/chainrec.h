/*
 * chainrec.h - the chain record of the chunked native store
 * (data/<hash>/chain.kvr, docs/FORMAT.md section 10, "Chain records"): the
 * whole on-disk form of an entry whose state lies entirely in its chain - no
 * tail rows, every layer chunked, pure KV - so the entry needs no per-layer
 * files, no manifest and no tokens.bin: one small file in the entry's
 * directory, published like any entry version (staged in data/<hash>.tmp/,
 * fsynced, exchanged in, data/ fsynced). It carries the entry's tokens, its
 * memory estimate, the namespace and the chain's identity (chunk count,
 * chunk_tokens, layout hash, last key), so the index rows of the entry and of
 * its chain can be rebuilt from it and the chunk files alone: the chunk keys
 * follow from the namespace, the layout hash and the tokens, and each chunk
 * file is opened by its key (nothing under chunks/ is listed).
 *
 * Invariants: a record is complete or absent (one file, checksummed, written
 * before the directory is published); its tokens hash to its name; it never
 * describes rows beyond its chain (total_rows = chunks * chunk_tokens).
 */
#ifndef KVT_FORMAT_CHAINREC_H
#define KVT_FORMAT_CHAINREC_H

#include "format/entry.h"

#include <stddef.h>
#include <stdint.h>

#define KVTI_CHAINREC_FILE "chain.kvr"
#define KVTI_CHAINREC_MAGIC "KVTCHREC"
#define KVTI_CHAINREC_VERSION 1u
#define KVTI_CHAINREC_FIXED 136u /* bytes before the namespace */
/* Reader bound on the token count (the file is read whole). */
#define KVTI_CHAINREC_MAX_TOKENS ((uint64_t)1 << 24)

typedef struct kvti_chainrec {
  uint8_t hash[32];     /* SHA-256 of the tokens: the entry's name */
  uint8_t last_key[32]; /* key of chunk chunks - 1 */
  uint64_t n_tokens, memory_bytes, chunks, layout_hash, total_rows;
  uint32_t chunk_tokens, num_layers;
  const uint8_t *ns; /* namespace encoding (format/chunk.h) */
  size_t ns_len;
  const int32_t *tokens; /* n_tokens */
  void *mem_;            /* owned storage of a parsed record */
} kvti_chainrec;

/* Exact file size of a record with ns_len namespace bytes and n tokens. */
uint64_t kvti_chainrec_size(size_t ns_len, uint64_t n_tokens);

/* Parses buf[0, len) (hostile input). expect_hash (may be NULL) is the hex
 * name the record was found under. Checks magic, version, zero flags and
 * padding, exact size, checksum, counts (chunk_tokens a power of two in
 * [16, 4096], chunks >= 1, total_rows = chunks * chunk_tokens <= n_tokens,
 * layers in [1, KVTI_MAX_LAYERS]) and SHA-256(tokens) = hash = the name. *r
 * owns copies (kvti_chainrec_free). Returns 0, KVT_ECORRUPT,
 * KVT_EUNSUPPORTED (another version), KVT_ENOMEM. */
int kvti_chainrec_parse(kvti_chainrec *r, const uint8_t *buf, size_t len,
                        const char *expect_hash, const char *what);
void kvti_chainrec_free(kvti_chainrec *r); /* accepts a zeroed r */

/* Makes snapshot s (a spill's tail, whose tokens hash to r->hash) stage as
 * the chain record r instead of layer files: kvti_entry_stage then writes
 * only data_dir/<hash>.tmp/chain.kvr (file and directory fsynced with
 * do_fsync) and the usual publication (format/publish.h: atomic exchange
 * with an older version, data_dir fsynced, rollback) applies. Returns 0,
 * KVT_EINVAL, KVT_ENOMEM. */
int kvti_snapshot_set_chainrec(kvti_snapshot *s, const kvti_chainrec *r);
/* The staging step itself (kvti_entry_stage): creates dir/chain.kvr with
 * s's record. *disk receives its bytes. 0, KVT_ENOSPC, KVT_EIO, ... */
int kvti_chainrec_stage(uint64_t *disk, const char *dir, const kvti_snapshot *s,
                        const kvti_write_opts *o);

/* Reads and parses data_dir/<hash>/chain.kvr. Returns 0, KVT_ENOTFOUND (no
 * record: not such an entry), KVT_ECORRUPT, KVT_EIO, KVT_ENOMEM. */
int kvti_chainrec_read(kvti_chainrec *r, const char *data_dir,
                       const char *hash);

/* 1 when data_dir/<hash>/chain.kvr exists (a regular file), 0 when not, or a
 * negative code. */
int kvti_chainrec_present(const char *data_dir, const char *hash);

/* What reconcile's adoption needs from a record entry (as kvti_entry_probe):
 * tokens, memory_bytes, disk_bytes (the record's; its chunks are counted by
 * the chain table), storage mode native, the directory's mtime, and its
 * chain as out->chain (present), as a tail's manifest gives it. Returns 0,
 * KVT_ENOTFOUND, KVT_ECORRUPT, KVT_EIO, KVT_ENOMEM. */
int kvti_chainrec_probe(kvti_entry_probe_info *out, const char *data_dir,
                        const char *hash);

/* kvti_entry_describe's document for a record entry (token_hash,
 * storage_mode, num_layers, num_tokens, memory_bytes, disk_bytes, no layer
 * files; "manifest"."kvtier"."chain" = the record's chain). Returns 0,
 * KVT_ENOTFOUND, KVT_ECORRUPT, KVT_EIO, KVT_ENOMEM. */
int kvti_chainrec_describe(char **json, const char *data_dir, const char *hash);

#endif
