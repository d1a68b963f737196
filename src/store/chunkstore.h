/*
 * chunkstore.h - the chunk store of the chunked native store: chunk files under
 * <cache_dir>/chunks/<kk>/<key>.kvc (format/chunk.h) and their chain table in
 * the index (index/chain.h), kept consistent. A spill becomes a chain of full
 * chunks of which only the missing ones are written; a lookup returns the
 * longest stored chain over a prompt; reads open a chunk file, check its key,
 * layout and tokens against what the chain promises and verify every block;
 * removal takes a chunk and everything below it, rows first, then files.
 *
 * Invariants: files are made durable before their rows are inserted, parents
 * before children, so after any crash every indexed chunk has its file and
 * every ancestor (a crash can leave only unindexed files, which gc removes);
 * a chunk is never rewritten. Open lists nothing under chunks/. The tier
 * serialises puts and removals (its mut_mu); lookups and reads may run
 * concurrently from any thread (reads of shared chunks take no common lock).
 */
#ifndef KVT_STORE_CHUNKS_H
#define KVT_STORE_CHUNKS_H

#include "format/chunk.h"
#include "index/chain.h"
#include "index/index.h"
#include "store/chunk_backend.h"

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

typedef struct kvti_chunkstore kvti_chunkstore;

typedef struct kvti_chunkstore_opts {
  uint32_t file_mode, dir_mode;
  int do_fsync; /* durability FSYNC: files, then their directory */
} kvti_chunkstore_opts;

/* Opens the store over cache_dir and an open index (which must outlive the
 * store). chunks/ is created lazily by the first put. Returns 0, KVT_EINVAL,
 * KVT_ENOMEM, KVT_EDB. */
int kvti_chunkstore_open(kvti_chunkstore **out, const char *cache_dir,
                         kvt_index *idx, const kvti_chunkstore_opts *o);
/* Frees the store (flushes chain touches). NULL is a no-op. */
void kvti_chunkstore_close(kvti_chunkstore *cs);
kvti_chains *kvti_chunkstore_chains(kvti_chunkstore *cs);

/* Indexes every valid chunk file under cache_dir/chunks that the chain table
 * lacks, parents first (chunkstore_rebuild.c): for an index rebuilt from the
 * files (missing, damaged, reindex), never an ordinary open. Chunks whose
 * chain is cut and invalid files are left out (*skipped; gc removes them).
 * Returns 0, KVT_ENOMEM, KVT_EDB, KVT_EPERM. */
int kvti_chunkstore_rebuild(kvti_chunkstore *cs, size_t *indexed,
                            size_t *skipped);
/* The chain row a chunk file's parsed header h stands for
 * (chunkstore_rebuild.c; also the tools' adoption of orphans,
 * tier/chunk_tools.c): ck continues parent_ck (chunk 0: the seed of its
 * namespace, and its parent must be the seed of its namespace and layout), pure
 * from its layers, disk_bytes = file_size. Returns 0 or KVT_ECORRUPT (path
 * names the file). */
int kvti_chunk_rec_of(kvti_chain_rec *r, const kvti_chunk_hdr *h,
                      const kvti_ck *parent_ck, uint64_t file_size,
                      const char *path);

/* Descriptor of chunks/<kk> (kk < 256) or of chunks/ itself (kk = 256),
 * reached from cache_dir's descriptor without following any link (the
 * caller closes it). fd, KVT_ENOTFOUND, KVT_EPERM (a link or a non-directory
 * on the way: refused, the message names it), another negative code. */
int kvti_chunkstore_open_subdir(kvti_chunkstore *cs, unsigned kk);
/* The same for chunks/<kk> (kk < 256), made (with chunks/) when missing,
 * relative to the descriptor above it, with the store's dir_mode and, with
 * do_fsync, that descriptor fsynced after a creation: where chunk files are
 * written. A link or non-directory on the way is KVT_EPERM, nothing made. */
int kvti_chunkstore_make_subdir(kvti_chunkstore *cs, unsigned kk);
/* The same, the parent fsynced after a creation only when do_fsync (a
 * batch fsyncs it with its other directories, chunkstore_write.c). */
int kvti_chunkstore_make_subdir_ex(kvti_chunkstore *cs, unsigned kk,
                                   int do_fsync);
/* cache_dir's own descriptor (borrowed: valid until the store closes), for
 * other walks below cache_dir (quarantine/). */
int kvti_chunkstore_root_fd(const kvti_chunkstore *cs);
/* Whether chunks_fd (chunks/ itself) is the directory whose name in
 * cache_dir this store already made durable (a round of directory fsyncs
 * that included cache_dir succeeded after it was made): then a new
 * chunks/<kk> needs chunks/ fsynced, not cache_dir again. Noted by
 * kvti_chunkstore_note_chunks_durable; kept by (device, inode), so a chunks/
 * removed and made again is fsynced into cache_dir again. */
int kvti_chunkstore_chunks_durable(const kvti_chunkstore *cs, int chunks_fd);
void kvti_chunkstore_note_chunks_durable(kvti_chunkstore *cs, int chunks_fd);
/* Unlinks rel ("chunks/<kk>/<name>") or chunk key's file the same way: 0
 * (missing too), KVT_EPERM (a link on the way: nothing removed), a code. */
int kvti_chunkstore_unlink_rel(kvti_chunkstore *cs, const char *rel);
int kvti_chunkstore_unlink(kvti_chunkstore *cs, const uint8_t key[32]);

/* Where the writer's sweep stopped, kept in chunks/sweep.pos so a process
 * that lives shorter than a full round continues its predecessor's: the
 * next chunks/<kk> and the position in the chained-entry records. get
 * yields 0, 0 when there is none (or it is unreadable); set returns 0 or a
 * code (nothing is fsynced: a lost position only restarts the round). */
void kvti_chunkstore_sweep_pos_get(kvti_chunkstore *cs, unsigned *kk,
                                   uint64_t *cursor);
int kvti_chunkstore_sweep_pos_set(kvti_chunkstore *cs, unsigned kk,
                                  uint64_t cursor);

/* Path of a chunk file: <cache_dir>/chunks/<kk>/<hex>.kvc into out (cap
 * bytes). Returns 0 or KVT_ERANGE. */
int kvti_chunkstore_path(const kvti_chunkstore *cs, const uint8_t key[32],
                         char *out, size_t cap);

/* A spill to store as chunks: the full chunks of tokens[0, n) (n / C of
 * them, C = chunk_tokens) over layers layer_ids (trimmable, validated). */
typedef struct kvti_chunkstore_spill {
  const uint8_t *ns;
  size_t ns_len;
  const int32_t *tokens;
  size_t n;
  uint32_t chunk_tokens;
  const kvt_layer *layers;
  const uint32_t *layer_ids;
  uint32_t n_layers;
  uint32_t spill_layers; /* layers of the whole spill (kvti_chunk_src) */
  /* Optional (NULL: none): the spill's chained-entry record, hash,
   * chunk_tokens and total_rows set by the caller; when every chunk is
   * stored, put fills chunks, last_key and layout_hash and commits it in the
   * same transaction as the new chunk rows (result.recorded). */
  kvti_chained_entry *rec;
} kvti_chunkstore_spill;

typedef struct kvti_chunkstore_result {
  size_t chunks;          /* full chunks of the spill (its chain length) */
  size_t written;         /* of which newly written */
  uint64_t bytes_written; /* file bytes written */
  uint64_t layout_hash;
  uint8_t last_key[32]; /* key of the last chunk (valid when chunks > 0) */
  /* Indexed chunks marked damaged (kvti_chains_set_damaged) whose file this
   * spill wrote again: the chains and entries through them serve again. */
  size_t rewritten;
  int recorded; /* sp->rec was committed (with the new chunk rows) */
} kvti_chunkstore_result;

/* Stores the spill's chain (chunkstore_write.c): only missing chunks are
 * written, all in one write group, fsynced together, renamed into place, their
 * directories fsynced together, then indexed in one transaction. A failure
 * leaves every chunk already indexed as it was, no row without its file and
 * none of this spill's files. Returns 0, KVT_EINVAL (a layer cannot be cut,
 * bad chunk_tokens), KVT_ENOSPC, KVT_EIO, KVT_EDB, KVT_ENOMEM. */
int kvti_chunkstore_put(kvti_chunkstore *cs, const kvti_chunkstore_spill *sp,
                        kvti_chunkstore_result *res);

/* The same in steps, for several spills at once (the writer's group commit):
 * the chains of a batch's spills are written into one syncset
 * (engine/syncset.h), made durable by its two rounds, and indexed spill by
 * spill in FIFO order, each spill's rows (and its chained-entry record) in one
 * transaction:
 *   put      writes the spill's missing chunks under their tmp names into the
 *            set's group (nothing durable, renamed or indexed yet; a chunk an
 *            earlier spill of the batch wrote counts as stored) and fills res
 *            as kvti_chunkstore_put does (recorded 0); *member names the
 *            spill for index. A failure leaves the batch unusable (the set's
 *            group may be failed): free it (the set first);
 *   publish  after kvti_syncset_files: renames every chunk file into place
 *            and lists its directory (and chunks/ and cache_dir when the batch
 *            made a directory) with the set for kvti_syncset_dirs;
 *   index    after kvti_syncset_dirs: member's rows, and e (NULL: none) in
 *            the same transaction (*recorded = 1 then); damaged chunks it
 *            wrote again are marked whole. Members in put's order: a chunk's
 *            parent is indexed by an earlier member or earlier in the same
 *            rows.
 * free removes the renamed files of members never indexed (they would be
 * orphans) and closes the batch's directories; free the set before it (an
 * aborted set removes the unrenamed files through those directories). The
 * caller serialises the batch with other puts and removals (the tier's
 * mut_mu). */
typedef struct kvti_chunkstore_batch kvti_chunkstore_batch;
struct kvti_syncset;
int kvti_chunkstore_batch_new(kvti_chunkstore_batch **out, kvti_chunkstore *cs,
                              struct kvti_syncset *set);
int kvti_chunkstore_batch_put(kvti_chunkstore_batch *b,
                              const kvti_chunkstore_spill *sp,
                              kvti_chunkstore_result *res, size_t *member);
int kvti_chunkstore_batch_publish(kvti_chunkstore_batch *b);
int kvti_chunkstore_batch_index(kvti_chunkstore_batch *b, size_t member,
                                const struct kvti_chained_entry *e,
                                int *recorded);
void kvti_chunkstore_batch_free(kvti_chunkstore_batch *b);

/* Longest stored chain over tokens (kvti_chains_lookup). */
int kvti_chunkstore_lookup(kvti_chunkstore *cs, const uint8_t *ns,
                           size_t ns_len, const int32_t *tokens, size_t n,
                           uint32_t chunk_tokens, kvti_chain_rec *out,
                           size_t max, size_t *m);

/* Opens chunk rec for reading: the file's key and layout must be the
 * record's and its tokens must equal tokens (the prompt's rows for this
 * chunk; NULL: not compared). *fd and *h stay valid until the caller closes
 * and frees them; the file may be unlinked meanwhile. Returns 0,
 * KVT_ENOTFOUND (file missing: evicted), KVT_ECORRUPT, KVT_EIO, KVT_ENOMEM. */
int kvti_chunkstore_open_chunk(kvti_chunkstore *cs, const kvti_chain_rec *rec,
                               const int32_t *tokens, int *fd,
                               kvti_chunk_hdr *h);

/* Opens chunk key's file from cache_dir's descriptor without following
 * links and parses its header (kvti_chunk_open_fd; layout 0 = any): the
 * part of open_chunk that needs no row. KVT_EPERM: a link on the way. */
int kvti_chunkstore_open_key(kvti_chunkstore *cs, const uint8_t key[32],
                             uint64_t layout, int *fd, kvti_chunk_hdr *h);

/* Reads chunk key's whole file (at most max bytes) into a malloc'ed buffer
 * (kvti_read_fd: NUL appended, not counted), opened from cache_dir's
 * descriptor without following links and refused when sparse. Nothing is
 * parsed: the caller verifies. 0, KVT_ENOTFOUND, KVT_EPERM (a link on the
 * way or at the name), KVT_ECORRUPT (too large, sparse, not a regular
 * file), KVT_EIO, KVT_ENOMEM. */
int kvti_chunkstore_read_bytes(kvti_chunkstore *cs, const uint8_t key[32],
                               char **out, size_t *len, size_t max);

/* Removes key and every chunk below it (rows first, then files). *n (may be
 * NULL) receives how many; *bytes (may be NULL) their disk bytes. Returns 0,
 * KVT_ENOTFOUND, KVT_EDB, KVT_ENOMEM. */
int kvti_chunkstore_remove(kvti_chunkstore *cs, const uint8_t key[32],
                           size_t *n, uint64_t *bytes);

/* ---- chunks from another node (chunkstore_adopt.c) ---- */

/* What the chain expects of a chunk fetched by key. */
typedef struct kvti_chunk_expect {
  uint8_t key[32], parent[32];
  uint64_t index;
  uint32_t n_tokens;
  const int32_t *tokens; /* the prompt's n_tokens tokens of this chunk */
  const uint8_t *ns;     /* NULL: not compared (the key chain binds it) */
  size_t ns_len;
  uint64_t layout_hash; /* 0 = any (then the caller checks one per chain) */
  kvti_ck ck;           /* copied into the record */
} kvti_chunk_expect;

/* Verifies a whole chunk file given as bytes: header (checksum, key against
 * parent + tokens, descriptor, size), what x expects, every data block.
 * *out (may be NULL) receives its chain record. 0, KVT_ECORRUPT, KVT_ENOMEM,
 * KVT_EUNSUPPORTED (another format version). */
int kvti_chunk_verify_bytes(const void *bytes, size_t len,
                            const kvti_chunk_expect *x, kvti_chain_rec *out);
/* Stores a verified chunk (rec from kvti_chunk_verify_bytes) as a spill
 * stores one (durable, then indexed; its parent must be indexed unless it is
 * chunk 0). Already indexed: 0, nothing written. The tier serialises it with
 * puts and removals (mut_mu). 0, KVT_EINVAL (parent missing), KVT_ENOSPC,
 * KVT_EIO, KVT_EDB, KVT_ENOMEM. */
int kvti_chunkstore_adopt(kvti_chunkstore *cs, const void *bytes, size_t len,
                          const kvti_chain_rec *rec);
/* The options the store was opened with. */
void kvti_chunkstore_get_opts(const kvti_chunkstore *cs,
                              kvti_chunkstore_opts *o);

/* ---- the store behind the chunk seam (chunkstore_seam.c) ---- */

/* The local store as store/chunk_backend.h's kvti_chunk_backend: has is the
 * chain table's answer, get reads the file's bytes, put adopts a verified
 * chunk (kvti_chunkstore_adopt), remove takes the chunk with everything
 * below it (kvti_chunkstore_remove), lookup is kvti_chunkstore_lookup. Owned
 * by whoever owns cs (the chunked store), valid while cs is open. */
typedef struct kvti_chunkstore_seam {
  kvti_chunk_backend base;
  kvti_chunkstore *cs;
} kvti_chunkstore_seam;
void kvti_chunkstore_seam_init(kvti_chunkstore_seam *s, kvti_chunkstore *cs);

/* ---- assembling a prefix from chunks (chunkstore_read.c) ---- */

typedef struct kvti_chunk_read_opts {
  kvt_alloc_fn alloc; /* NULL: kvtier allocates (kvti_buf_alloc) */
  kvt_free_fn free_buf;
  void *alloc_ctx;
  atomic_int *cancel; /* checked between chunks; NULL = never */
  /* Rows of the destination tensors: > m * C leaves rows [m*C, total_rows)
   * for the caller (the entry's tail); in ((m-1)*C, m*C) keeps only the first
   * total_rows (a trimmed read; the whole last chunk is still verified).
   * 0 = m * C. */
  uint64_t total_rows;
  int page_cache; /* 1: never O_DIRECT (KVT_PROMOTE_PAGE_CACHE) */
} kvti_chunk_read_opts;

/* The assembled layers of a chain: layers[k] is spill layer layer_idx[k]
 * (kind KV, rotating KV or quantized KV; offset = total_rows; bits and
 * group_size set; rotating attributes absent: the entry has them). */
typedef struct kvti_chunk_prefix {
  kvt_layer *layers;
  uint32_t *layer_idx;
  uint32_t n_layers, spill_layers;
  uint64_t bytes_read; /* file bytes read */
  int caller_alloc;
} kvti_chunk_prefix;

/* Reads chunks recs[0, m) (a chain from kvti_chunkstore_lookup over tokens)
 * into freshly allocated full tensors, verifying every chunk (key, layout,
 * tokens against tokens[i*C, (i+1)*C), every block) before its rows are
 * copied. All buffers are allocated (alloc) before the first read. Every
 * chunk file is opened (and its header checked) before any data is read
 * (chains beyond 256 chunks: 256 at a time), so an eviction may unlink them
 * meanwhile; cold chunks are read with O_DIRECT, in vectored requests of
 * 1 MiB into the destination, the reads of the next chunks (up to 128 MiB)
 * in flight while the current one is verified. No lock is taken:
 * concurrent reads of shared chunks proceed in parallel. Returns 0,
 * KVT_ENOTFOUND (a chunk file vanished: evicted), KVT_ECORRUPT (the message
 * names the chunk; *bad_index (may be NULL) receives its position), KVT_EIO,
 * KVT_ENOMEM, KVT_ECANCELED, KVT_EINVAL. On failure nothing is returned
 * (buffers freed through free_buf). */
int kvti_chunkstore_read_prefix(kvti_chunkstore *cs, const kvti_chain_rec *recs,
                                size_t m, const int32_t *tokens,
                                const kvti_chunk_read_opts *o,
                                kvti_chunk_prefix *out, size_t *bad_index);
/* Frees what read_prefix returned (buffers through free_buf when the caller
 * allocated them). Accepts a zeroed prefix. */
void kvti_chunk_prefix_free(kvti_chunk_prefix *p,
                            const kvti_chunk_read_opts *o);
/* What a promote of m chunks of chain recs reserves: the sum of the rows'
 * mem_bytes (kvti_chunk_mem_bytes: the dense size, which is what the read
 * allocates unless a layer is quantized, then more than it). */
uint64_t kvti_chunk_prefix_bytes(const kvti_chain_rec *recs, size_t m);

/* ---- entries over chains (chunkstore_entry.c) ---- */

/* How a spill is cut: layers ids[0, n_ids) give their rows [0, rows) (=
 * chunks * C) to the chain; the tail snapshot holds everything else. Chunked
 * layers are the cuttable ones (kvti_chunk_layer_ok) whose tensors all have
 * the token extent T of the first of them, so a promote allocates every
 * chunked tensor with T rows at once; rows = the largest multiple of C valid
 * (below offset) in all of them and within the spill's tokens. */
typedef struct kvti_chunk_split {
  uint32_t *ids;
  uint32_t n_ids;
  uint64_t rows, T;
  size_t chunks;
  /* The tail layers for kvti_snapshot_create: a chunked layer keeps its kind
   * and attributes (offset included) with tensors of rows [rows, T), copied;
   * other layers are shallow copies of the caller's. */
  kvt_layer *tail;
  uint32_t n_layers;
} kvti_chunk_split;

/* Cuts layers (validated) of a spill of n_tokens. chunks == 0 means nothing
 * to chunk (the tail is then the whole spill). Returns 0, KVT_ENOMEM. */
int kvti_chunk_split_make(kvti_chunk_split *sp, const kvt_layer *layers,
                          uint32_t n_layers, size_t n_tokens, uint32_t C);
void kvti_chunk_split_free(kvti_chunk_split *sp); /* accepts a zeroed sp */

/* Completes a tail entry read back (with the same alloc/free_buf as the
 * prefix) with its chain's prefix, read with total_rows = the tail layers' T
 * + rows: each chunked layer gets the tail rows copied in after the chain's
 * and the tail layer's attributes (offset, rotating attributes), and replaces
 * the tail layer in e. The prefix is consumed (its layers move into e) on
 * success and on failure (then freed). Returns 0 or KVT_ECORRUPT (the tail
 * and the chain disagree: kinds, dtypes, shapes, rows). */
struct kvt_entry;
int kvti_chunk_join(struct kvt_entry *e, kvti_chunk_prefix *p, uint64_t rows,
                    const kvti_chunk_read_opts *o);

/* A new entry made of a pure chain's prefix alone (every layer chunked):
 * tokens = tokens[0, rows), named by their hash, memory_bytes = the bytes
 * allocated. The prefix is consumed. Returns 0, KVT_ECORRUPT (not pure),
 * KVT_ENOMEM. */
int kvti_chunk_prefix_entry(struct kvt_entry **out, kvti_chunk_prefix *p,
                            const int32_t *tokens, uint64_t rows,
                            const kvti_chunk_read_opts *o);

#endif
