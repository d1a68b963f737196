/*
 * local_chunks.h - the chunk files' places in the cache directory, as the
 * tier's chunk maintenance needs them: whether a chunk's file is there, its
 * move into quarantine/chunk-<key>[.n]/ (the persistent record of a damaged
 * chunk), the listing of those records, and the scan of one chunks/<kk>
 * subdirectory for what the chain table does not index. The policy (what to
 * quarantine, adopt or remove, and when) is the caller's; every name and
 * every directory walk is here. All of it reaches files relative to the
 * cache directory's own descriptor, never following a link: a chunks/,
 * chunks/<kk> or quarantine/ replaced by a link is refused, nothing outside
 * the cache is moved, removed or read.
 */
#ifndef KVT_STORE_LOCAL_CHUNKS_H
#define KVT_STORE_LOCAL_CHUNKS_H

#include "format/chunk.h"
#include "store/chunkstore.h"

#include <stdint.h>

/* Is chunk key's file in chunks/<kk>? 1 yes (regular_only: a regular file;
 * else anything at the name, a link included), 0 no, KVT_EPERM when
 * chunks/ or chunks/<kk> is a link or not a directory (error set). */
int kvti_local_chunk_present(kvti_chunkstore *cs, const uint8_t key[32],
                             int regular_only);

/* How a damaged chunk's file is set aside. */
typedef struct kvti_chunk_qpolicy {
  uint32_t quarantine_max; /* 0: delete instead of moving */
  uint32_t dir_mode;       /* of quarantine/ and its chunk-<key> dirs */
  int do_fsync;            /* sync the move */
} kvti_chunk_qpolicy;

/* Sets chunk key's file aside: moved to quarantine/chunk-<hex>[.n]/ (the
 * first free name; then the oldest chunk-* moves beyond quarantine_max are
 * removed, never the one just made, *bounded counting them), deleted when
 * quarantine_max is 0, or deleted when it cannot be moved (it must not stay
 * where a rewrite would find the name taken). Returns what happened, as a
 * phrase for the log ("moved to quarantine/", "deleted (...)", "left in
 * chunks/ (...)"); failures met are described there, not left as this
 * thread's error. The caller holds the tier's mutation lock. */
const char *kvti_local_chunk_quarantine(kvti_chunkstore *cs,
                                        const uint8_t key[32],
                                        const kvti_chunk_qpolicy *p,
                                        size_t *bounded);

/* Calls fn for the key of every quarantine/chunk-<hex>[.n] record (a key
 * quarantined twice: once per record). 0, or fn's nonzero value. Nothing
 * there (no quarantine/) is 0. */
int kvti_local_chunks_quarantined(kvti_chunkstore *cs,
                                  int (*fn)(void *ctx, const uint8_t key[32]),
                                  void *ctx);

/* One name met by kvti_local_chunks_scan. */
enum {
  KVTI_SCAN_TMP = 1, /* <...>.tmp: an interrupted chunk write */
  KVTI_SCAN_STRAY,   /* not a chunk file (why says what), or a subdir that
                        is a link: never entered */
  KVTI_SCAN_ORPHAN,  /* an unindexed chunk file, verified completely */
  KVTI_SCAN_DAMAGED  /* an unindexed chunk file that fails verification */
};
typedef struct kvti_chunk_scan_item {
  int kind;
  const char *rel;    /* "chunks/<kk>/<name>" (or "chunks/<kk>") */
  const char *why;    /* STRAY, DAMAGED: what is wrong */
  uint64_t size;      /* bytes of the file */
  uint8_t key[32];    /* ORPHAN, DAMAGED */
  kvti_chunk_hdr hdr; /* ORPHAN: its parsed header; the callback may take
                         it (then it zeroes hdr), else it is freed */
} kvti_chunk_scan_item;
/* nonzero stops the scan (returned by it). */
typedef int (*kvti_chunk_scan_fn)(void *ctx, kvti_chunk_scan_item *it);

/* Scans chunks/<kk> (kk < 256): every name that is not an indexed chunk file
 * (those cost no system call) is handed to fn. A missing chunks/<kk> is
 * nothing to scan. 0, fn's nonzero value, or an error (KVT_ENOMEM, an OS
 * error listing the directory). */
int kvti_local_chunks_scan(kvti_chunkstore *cs, unsigned kk,
                           kvti_chunk_scan_fn fn, void *ctx);

#endif
