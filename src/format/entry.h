/*
 * entry.h - one cache entry on disk: the producer-side snapshot of an engine's
 * layers, the atomic+durable publication of data/<hash>/
 * (layer_<i>.safetensors, manifest.json, tokens.bin) and the verified read back
 * into a kvt_entry. Both storage modes (native, compat) and every layer kind
 * are handled here; the exact byte format is specified in docs/FORMAT.md.
 *
 * Invariants: a reader never returns data that failed validation (structure,
 * sizes, xxh3 checksums when the manifest has them, tokens.bin against the
 * expected hash); a failed write leaves no data/<hash>.tmp and no change to an
 * existing data/<hash>; paths are built only from validated 64-hex entry names.
 *
 * Implemented by entry.c (the kvt_entry object), snapshot.c, manifest.c,
 * entry_write.c, entry_read.c (the layer-by-layer reader), entry_par.c
 * (kvti_entry_read) and describe.c, on top of layer.h (one layer file); the
 * names inside an entry directory come from layout.h.
 */
#ifndef KVT_ENTRY_H
#define KVT_ENTRY_H

#include "base/salt.h"
#include "kvtier.h"

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

/* The public kvt_entry. Everything it points to is owned by it. */
struct kvt_entry {
  char hash[KVT_HASH_HEX_LEN + 1];
  int32_t *tokens;
  size_t n_tokens;
  uint32_t num_layers;
  kvt_layer *layers; /* tensors/orig_dtypes arrays owned by the entry */
  uint64_t memory_bytes;
  uint64_t reserved_bytes; /* set by the tier after a budgeted promote */
  uint64_t disk_bytes;     /* bytes read from disk */
  int storage_mode;
  /* Tensor buffers from a caller's alloc callback are returned through
   * free_buf. */
  kvt_free_fn free_buf;
  void *alloc_ctx;
  /* The host RAM tier (tier/hostcache.h). recycle, when set, is offered the
   * entry by kvt_entry_free first; it returns 1 when it took everything
   * (layers into the cache, the rest freed). from: where the data came from
   * (KVTI_FROM_*), for the promote counters. */
  int (*recycle)(kvt_entry *e);
  void *recycle_ctx;
  uint64_t recycle_id;
  int from;
  kvti_salt salt; /* the cache_salt it was stored under (has = 0: none) */
};

enum { KVTI_FROM_OTHER = 0, KVTI_FROM_DISK = 1, KVTI_FROM_RAM = 2 };

/* Immutable producer-side copy of a spill, handed to the writer thread. */
typedef struct kvti_snapshot kvti_snapshot;

/* What a tail entry of the chunked native store says of its chain
 * (manifest.json "kvtier"."chain", docs/FORMAT.md section 10): the tail is
 * not a complete entry, its rows [0, chunks * chunk_tokens) live in the chain
 * ending at last_key. Kept in the entry's own files so that the chained-entry
 * record can be rebuilt when index.db is lost, and so that no reader takes a
 * tail for a whole entry. present = 0: a whole entry. */
typedef struct kvti_chain_mark {
  int present;
  uint64_t chunks;
  uint32_t chunk_tokens;
  uint8_t last_key[32];
  uint64_t layout_hash;
  uint64_t total_rows;
} kvti_chain_mark;

/* Validates the layers (kinds, tensor counts, dtypes, shapes vs nbytes,
 * quantized bits and group_size) and copies them. With copy == 0 the tensor
 * data is referenced, not copied, and release(release_ctx) runs when the
 * snapshot is freed (also on failure here). Returns 0, KVT_EINVAL (message
 * names the layer and the problem), KVT_ENOMEM. */
int kvti_snapshot_create(kvti_snapshot **out, const int32_t *tokens,
                         size_t n_tokens, const kvt_layer *layers,
                         uint32_t n_layers, uint64_t memory_bytes, int copy,
                         void (*release)(void *), void *release_ctx);
void kvti_snapshot_free(kvti_snapshot *s); /* accepts NULL */
/* Marks s as the tail of a chained entry: its manifest records m. */
void kvti_snapshot_set_chain(kvti_snapshot *s, const kvti_chain_mark *m);
const char *kvti_snapshot_hash(const kvti_snapshot *s);
/* Moves a copy-mode snapshot's layers (kvti_buf_alloc'ed data, kvti_malloc'ed
 * arrays: a read's layout) to the caller, leaving the snapshot without layers
 * (its tokens stay). Returns 1, or 0 for a zero-copy snapshot (its data is
 * the caller's) or one already taken. */
int kvti_snapshot_take_layers(kvti_snapshot *s, kvt_layer **layers,
                              uint32_t *n_layers);
const int32_t *kvti_snapshot_tokens(const kvti_snapshot *s, size_t *n);
/* The entry's memory_bytes: the caller's estimate unless
 * kvti_snapshot_report_dense replaced it. */
uint64_t kvti_snapshot_memory_bytes(const kvti_snapshot *s);
/* For an entry holding a quantized layer, makes memory_bytes
 * kvti_layers_dense_bytes of its layers: the caller's estimate is of the
 * packed form, a native entry is promoted dense by the drop-in, and the
 * scheduler reserves this figure before the read. Other entries keep the
 * caller's. Native storage only (the tier's writer calls it); compat entries
 * keep the reference's manifest figure. */
void kvti_snapshot_report_dense(kvti_snapshot *s);
/* Keys the snapshot by cache_salt salt (base/salt.h): its hash becomes
 * SHA-256(D || tokens) and its manifest records D. Returns 0 or KVT_ENOMEM. */
int kvti_snapshot_set_salt(kvti_snapshot *s, const kvti_salt *salt);
/* The snapshot's salt (has = 0: none). */
const kvti_salt *kvti_snapshot_salt(const kvti_snapshot *s);
/* The snapshot's validated layers (owned by it; read-only). For the chunked
 * store, which cuts them into chain rows and a tail. */
const kvt_layer *kvti_snapshot_layers(const kvti_snapshot *s, uint32_t *n);
/* Heap bytes the snapshot holds (0 data bytes for a no-copy snapshot). */
uint64_t kvti_snapshot_held_bytes(const kvti_snapshot *s);
/* Exact bytes the entry will take on disk in mode (file sizes, before block
 * rounding). */
uint64_t kvti_snapshot_disk_bytes(const kvti_snapshot *s, int mode);

typedef struct kvti_write_opts {
  int storage_mode; /* kvt_storage_mode */
  int do_fsync;     /* durability == FSYNC */
  uint32_t file_mode;
  uint32_t dir_mode;
  int io_backend; /* kvt_io_backend for the layer files (0 = AUTO) */
  /* 1: a publish through the local store's steps (store/local.h's
   * put_stage/put_publish) does not fsync data/ itself; the caller makes
   * every rename of its batch durable with one put_sync before it commits
   * any index row for them (a group commit).
   * The staged files and their directory are still synced when do_fsync. */
  int defer_dir_sync;
  /* Non-NULL (a group commit's set, engine/syncset.h): a stage writes its
   * files into the set's group and lists its tmp directory with the set
   * instead of syncing either; the caller runs the set's rounds before it
   * publishes the staged version. do_fsync is then the set's. */
  struct kvti_syncset *sync;
} kvti_write_opts;

/* Writes data_dir/<hash>.tmp/ (removing a stale one first), fsyncs each file
 * and the tmp dir when do_fsync, publishes it as data_dir/<hash> by rename - an
 * existing entry is swapped out atomically with kvti_rename_exchange (tmp then
 * holds the old version), or where that is unsupported first renamed aside to
 * <hash>.old.tmp - fsyncs data_dir, and removes the old version. At every
 * moment one complete version is in place. *disk_bytes receives the sum of the
 * file sizes written. On failure nothing new remains visible and an existing
 * entry is unchanged. Returns 0, KVT_EIO, KVT_ENOSPC, KVT_ENOMEM, KVT_EPERM. */
int kvti_entry_write(uint64_t *disk_bytes, const char *data_dir,
                     const kvti_snapshot *s, const kvti_write_opts *o);
/* The first half of kvti_entry_write: writes the complete entry at
 * data_dir/<hash>.tmp/ (durable when do_fsync) and publishes nothing; the
 * caller publishes it with format/publish.h (which can be undone until
 * committed). On failure no tmp remains. Same codes. */
int kvti_entry_stage(uint64_t *disk_bytes, const char *data_dir,
                     const kvti_snapshot *s, const kvti_write_opts *o);

typedef struct kvti_read_opts {
  /* Expected tokens: tokens.bin must match (when present) and hash to the entry
   * name. NULL: the tokens come from tokens.bin, which then must exist and hash
   * to the name. */
  const int32_t *tokens;
  size_t n_tokens;
  atomic_int *cancel; /* checked between layers/chunks; NULL = never */
  kvt_alloc_fn alloc; /* NULL: kvtier allocates */
  kvt_free_fn free_buf;
  void *alloc_ctx;
  kvt_layer_ready_fn on_layer; /* NULL: none */
  void *layer_ctx;
  int verify_only; /* read and verify everything, keep no data */
  int io_backend;  /* kvt_io_backend of the reads (0 = AUTO) */
  /* > 0 (and < the entry's tokens): a trimmed read of the first keep_tokens
   * tokens (see kvti_layer_read_opts.keep_tokens); the entry then holds
   * tokens[0, keep_tokens), is named by their hash, and its memory_bytes is
   * scaled by keep_tokens / num_tokens. 0: everything. */
  uint64_t keep_tokens;
  int page_cache; /* 1: never O_DIRECT (kvti_layer_read_opts.page_cache) */
  unsigned read_threads; /* threads per entry read, 1..8; 0: the default */
  /* A chained entry's tail (store/chunked.c): its KV layers' first
   * chain_rows rows are in the chain, so their offset may exceed the tail's
   * rows by that much (kvti_layer_read_opts.row_base). 0: a whole entry. */
  uint64_t chain_rows;
  /* The caller's cache_salt (has = 0: none): a trimmed read names its result
   * SHA-256(D || kept tokens), and a chained read seeds its chain with it. */
  kvti_salt salt;
  /* 1: salt (with the reader's model_id) is the namespace the entry was
   * stored in - a promote or read_entry by tokens computed the name from it
   * - so a chained entry's chain must be rooted there when the name is
   * salted (store/chunked.c); 0: unknown (tools, verify), not checked. */
  int ns_check;
  /* 1: the caller completes a tail entry with its chain (store/chunked.c);
   * 0: a tail is refused (KVT_EUNSUPPORTED), never served as an entry. */
  int tail_ok;
  /* With tail_ok (may be NULL): receives the chain mark of the manifest the
   * read used (present = 0: none), so the caller can check it against the
   * row it read by. Backends that read no manifest leave it untouched. */
  kvti_chain_mark *tail_mark;
  /* kvti_entry_verify_mem only: per layer, the first cached row the entry's
   * file holds (kvti_layer_read_opts.mem_row0); NULL: all 0. */
  const uint64_t *mem_row0;
} kvti_read_opts;

/* Reads and fully validates data_dir/<hash>. Returns 0 and *out; KVT_ENOTFOUND
 * (no such entry directory or manifest, or it was removed during the read),
 * KVT_ECORRUPT (anything malformed or a checksum mismatch; message says which
 * file and why), KVT_EIO, KVT_ENOMEM, KVT_ECANCELED, KVT_EAGAIN (the entry was
 * replaced by a new version during the read after on_layer had already reported
 * layers of the old one: not corruption, retry). A replacement seen before any
 * on_layer call is retried internally. Never returns partial or mixed data.
 * With verify_only, *out (out may be NULL) is set to NULL on success. */
int kvti_entry_read(kvt_entry **out, const char *data_dir, const char *hash,
                    const kvti_read_opts *o);

/* What an index row needs of a stored entry, read from its files alone (the
 * index is rebuilt from these when it is lost): the manifest is loaded and
 * validated, tokens.bin checked against the manifest and the entry name
 * (bounded and streamed as every read), the layer files' presence and sizes
 * taken; layer data is not read (a full check is kvt_tier_verify's). tokens
 * is kvti_malloc'ed (the caller frees it). Returns 0, KVT_ECORRUPT (invalid:
 * quarantine it), KVT_ENOTFOUND, KVT_EIO, KVT_ENOMEM. */
typedef struct kvti_entry_probe_info {
  int32_t *tokens;
  size_t n_tokens;
  uint64_t memory_bytes;
  uint64_t disk_bytes;
  int storage_mode;
  double mtime;   /* the entry directory's, wall-clock seconds */
  kvti_salt salt; /* the cache_salt it is keyed by (its index row's too) */
  kvti_chain_mark chain; /* a tail of the chunked store: its chain */
} kvti_entry_probe_info;
int kvti_entry_probe(kvti_entry_probe_info *out, const char *data_dir,
                     const char *hash);

/* Layer-by-layer reading, for callers that read layers in parallel or stream
 * them: open validates the manifest and tokens.bin (as kvti_entry_read);
 * read_layer reads and verifies one layer into the entry being built and may be
 * called concurrently from several threads for DISTINCT layers (any order);
 * finish hands the entry over once every layer is read. Returns as
 * kvti_entry_read, except that nothing is retried: KVT_EAGAIN from finish (or
 * KVT_ECORRUPT / KVT_ENOTFOUND from a layer while the directory was being
 * replaced) means "read again". The reader must be freed in every case (it
 * frees whatever was read, through free_buf). */
typedef struct kvti_entry_reader kvti_entry_reader;
int kvti_entry_reader_open(kvti_entry_reader **out, const char *data_dir,
                           const char *hash, const kvti_read_opts *o);
uint32_t kvti_entry_reader_num_layers(const kvti_entry_reader *r);
/* *layer (may be NULL) receives the verified layer, owned by the entry being
 * built. */
int kvti_entry_reader_read_layer(kvti_entry_reader *r, uint32_t i,
                                 const kvt_layer **layer);
int kvti_entry_reader_finish(kvt_entry **out, kvti_entry_reader *r);
void kvti_entry_reader_free(kvti_entry_reader *r); /* accepts NULL */

/* Validates manifest.json text on its own, exactly as the reader does (JSON
 * types, counts, layer objects, the kvtier key, its checksums list and, in
 * format 2, block_size and the per-block lists - whose lengths against the file
 * sizes are checked only when the files are read); for
 * fuzzing and tools. Returns 0, KVT_ECORRUPT, KVT_EUNSUPPORTED (a kvtier format
 * this build does not know), KVT_ENOMEM, KVT_EINVAL. */
int kvti_manifest_validate(const char *text, size_t len);

/* Describes data_dir/<hash> as JSON (see kvt_tier_describe) without reading
 * tensor data. */
int kvti_entry_describe(char **json, const char *data_dir, const char *hash);

/* The free_buf of an entry built in caller buffers (kvti_read_opts.alloc)
 * without a free_buf: those buffers stay the caller's, never freed by
 * kvtier. */
void kvti_keep_caller_buf(void *ctx, void *buf);

/* Allocates an empty entry (all zero) or NULL with the error set. */
kvt_entry *kvti_entry_new(void);

/* Checks that layers (n_layers cached layers, e.g. a host RAM copy) hold
 * exactly what data_dir/<hash> holds, as kvti_entry_read would return it,
 * reading only the small files and each layer file's header: manifest and
 * manifest.sum, tokens.bin against o->tokens (required), then per layer
 * kvti_layer_verify_mem (header against the manifest and the cached tensors,
 * every block checksum over the cached bytes; attributes set from the
 * manifest). Layers are checked in parallel (KVT_READ_THREADS). Only tokens,
 * n_tokens, cancel, read_threads, tail_ok and mem_row0 of o are used
 * (mem_row0 with tail_ok: a chained entry's tail, whose files hold only the
 * rows past its chain). Returns
 * 0; KVT_ENOTFOUND, KVT_ECORRUPT, KVT_EIO, KVT_ENOMEM, KVT_ECANCELED as a read;
 * KVT_EAGAIN (replaced during the check); KVT_EUNSUPPORTED (no kvtier
 * checksums). Any nonzero return means: do not serve the copy. */
int kvti_entry_verify_mem(const char *data_dir, const char *hash,
                          kvt_layer *layers, uint32_t n_layers,
                          const kvti_read_opts *o);

#endif
