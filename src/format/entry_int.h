/*
 * entry_int.h - private to the entry files of src/format: the snapshot's
 * layout (built by snapshot.c, written by entry_write.c and manifest.c) and
 * the entry reader's state (entry_read.c), which the parallel read
 * (entry_par.c) drives from several threads.
 */
#ifndef KVT_ENTRY_INT_H
#define KVT_ENTRY_INT_H

#include "base/salt.h"
#include "format/entry.h"
#include "format/manifest.h"

#include <pthread.h>
#include <stdint.h>

struct kvti_snapshot {
  char hash[KVT_HASH_HEX_LEN + 1];
  int32_t *tokens;
  size_t n_tokens;
  kvt_layer *layers;
  uint32_t n_layers;
  uint64_t memory_bytes;
  int copy;
  int has_quant;
  void (*release)(void *);
  void *release_ctx;
  uint64_t held;
  kvti_salt salt; /* the spill's cache_salt (hash is then the salted key) */
  kvti_chain_mark chain; /* a tail of the chunked store (present) */
  /* Non-NULL: stage this chain record (format/chainrec.h) instead of the
   * layers, manifest and tokens.bin: the entry is its chain alone. */
  uint8_t *chainrec;
  size_t chainrec_len;
};

struct kvti_entry_reader {
  kvti_manifest m;
  kvt_entry *e;
  kvti_read_opts o;
  kvti_dir_id id;
  uint64_t base_bytes; /* manifest, manifest.sum, tokens.bin */
  uint64_t *layer_bytes;
  unsigned char *done;
  /* Layers may be read from several threads at once: the caller's alloc/free
   * callbacks are called under this lock, so never concurrently. */
  pthread_mutex_t cb_mu;
};

/* kvti_entry_reader_open, also filling *id with the entry directory's
 * identity as soon as it is known (even when opening fails later), so that the
 * caller can tell a replacement from corruption. */
int kvti_entry_reader_open_id(kvti_entry_reader **out, const char *data_dir,
                              const char *hash, const kvti_read_opts *o,
                              kvti_dir_id *id);

/* Threads per entry read (2, or KVT_READ_THREADS from the environment, 1..8,
 * read once); at most KVTI_MAX_READ_THREADS. */
#define KVTI_MAX_READ_THREADS 8
unsigned kvti_entry_read_threads(void);

/* 0: the entry directory dir is the one identified by id; 1: replaced; 2:
 * gone. */
int kvti_entry_dir_state(const char *dir, const kvti_dir_id *id);

#endif
