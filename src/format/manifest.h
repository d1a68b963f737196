/*
 * manifest.h - private to the entry files of src/format: manifest.json of one
 * entry, as built by the writer and as loaded (and fully validated) by the
 * reader and describe. The format is specified in docs/FORMAT.md; the
 * standalone validator for fuzzing and tools is kvti_manifest_validate
 * (entry.h).
 */
#ifndef KVT_MANIFEST_H
#define KVT_MANIFEST_H

#include "format/entry.h"
#include "format/layer.h"

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

struct cJSON;

/* Bytes of manifest.sum: "xxh3:" + 16 hex + "\n". */
#define KVTI_SUM_LEN 22

/* A loaded manifest (kvti_manifest_load). Owns everything it points to. */
typedef struct kvti_manifest {
  struct cJSON *root; /* the parsed document */
  char *dir;          /* the entry directory */
  uint32_t num_layers;
  uint64_t memory_bytes;
  uint64_t num_tokens;
  int has_sums; /* kvtier-written */
  int mode;
  uint64_t *sums; /* num_layers + 1 (tokens.bin last) */
  /* Format 2: per-block hashes of layer i are blk_all[blk_off[i] ..
   * blk_off[i + 1]); block_size 0 for format 1 and reference entries. */
  uint64_t block_size;
  uint64_t *blk_all;
  size_t *blk_off; /* num_layers + 1 */
  kvti_layer_meta *metas;
  uint64_t bytes;        /* manifest + sum */
  kvti_chain_mark chain; /* "kvtier"."chain": a chained entry's tail */
} kvti_manifest;

/* Identity of an entry directory. kvti_manifest_load fills it (when given) as
 * soon as it is known, even when loading fails later: the reader compares it
 * afterwards to detect a replacement. */
typedef struct kvti_dir_id {
  int known;
  dev_t dev;
  ino_t ino;
} kvti_dir_id;

/* Python json.dump(manifest) with default separators, plus kvtier's key, for
 * snapshot s written in mode. metas: the layer objects (kvti_layer_plan);
 * sums: n_layers layer checksums then the tokens.bin checksum; blk[i] /
 * nblk[i]: the block list of layer i (blk NULL or blk[i] NULL: zeros of that
 * length, for size computations). Returns kvti_malloc'ed text or NULL. */
char *kvti_manifest_build(const kvti_snapshot *s, char **metas,
                          const uint64_t *sums, int mode,
                          const uint64_t *const *blk, const size_t *nblk);

/* Loads data_dir/<hash>/manifest.json, checks it against manifest.sum when
 * present and validates it completely. Returns 0, KVT_EINVAL (hash is not an
 * entry name), KVT_ENOTFOUND, KVT_ECORRUPT, KVT_EUNSUPPORTED, KVT_EIO,
 * KVT_ENOMEM; on failure m holds nothing. */
int kvti_manifest_load(kvti_manifest *m, const char *data_dir, const char *hash,
                       kvti_dir_id *id);
void kvti_manifest_free(kvti_manifest *m);

#endif
