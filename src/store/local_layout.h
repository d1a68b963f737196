/*
 * local_layout.h - the names of everything kvtier keeps under a cache
 * directory, and the calls that turn them into paths. Only store/local*
 * files build a path inside the cache directory; every other layer asks
 * them (the tier passes its policy in: modes, fsync, bounds), so the layout
 * is written down once. The reference's part of it (data/<hash>/ and
 * index.db) is fixed by compatibility; the rest is ours.
 */
#ifndef KVT_STORE_LOCAL_LAYOUT_H
#define KVT_STORE_LOCAL_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#define KVTI_LOCAL_DATA "data"             /* data/<hash>/: entries */
#define KVTI_LOCAL_CHUNKS "chunks"         /* chunks/<kk>/<key>.kvc */
#define KVTI_LOCAL_QUARANTINE "quarantine" /* moved-aside entries, chunks */
#define KVTI_LOCAL_LOCK "kvtier.lock"      /* the one writer's flock */
#define KVTI_LOCAL_STAGE "remote.tmp"      /* remote fetches being staged */
#define KVTI_LOCAL_INDEX "index.db"        /* SQLite, with -wal and -shm */
#define KVTI_LOCAL_STATS "stats.bin"       /* the live stats mapping */
/* quarantine/chunk-<key hex>[.<n>]/: one quarantined chunk file. */
#define KVTI_LOCAL_CHUNK_QDIR "chunk-"
#define KVTI_LOCAL_CHUNK_EXT ".kvc"
/* chunks/sweep.pos: where the writer's lazy sweep stopped (not a chunk name:
 * only chunks/<kk> is listed, so nothing else reads it). */
#define KVTI_LOCAL_SWEEP_POS "sweep.pos"

/* The default cache directory of a model: $XDG_CACHE_HOME/kvtier/<model>,
 * else $HOME/.cache/kvtier/<model> (only an absolute variable counts).
 * *out allocated (kvti_free). 0, KVT_EINVAL (neither is absolute),
 * KVT_ENOMEM. */
int kvti_local_default_dir(char **out, const char *model);

/* dir made absolute against the working directory (allocated; NULL with the
 * error set). */
char *kvti_local_absolute_dir(const char *dir);

/* cache_dir/name for one of the names above, allocated (kvti_free), or
 * NULL with KVT_ENOMEM set. */
char *kvti_local_path(const char *cache_dir, const char *name);

/* Where a chunk file named by its key's hex is staged under a staging root
 * (kvti_backend_local_stage_root): <root>/<hex>.kvc and its temporary
 * <root>/<hex>.tmp. 0, or KVT_EINVAL when a buffer of n bytes is too small
 * (both then hold ""). */
int kvti_local_stage_chunk_paths(char *path, char *tmp, size_t n,
                                 const char *stage_root, const char *key_hex);

/* ---- chunk files: chunks/<kk>/<key hex>.kvc ----
 * kk is the key's first byte as two lowercase hex digits, the first two of
 * the file name: 256 directories, so a million chunks make about 4000 files
 * in each. */

/* Room for a chunk file's name and its NUL ("<64 hex>.kvc", or ".tmp"). */
#define KVTI_LOCAL_CHUNK_NAME_MAX 72
/* chunks/<kk> (kk < 256) or chunks itself (kk >= 256), relative to the cache
 * directory, into out (n bytes). 0, or KVT_EINVAL when out is too small
 * (then ""). */
int kvti_local_chunk_dir_rel(char *out, size_t n, unsigned kk);
/* The file name of chunk key inside its chunks/<kk>: "<hex>.kvc", or with
 * tmp "<hex>.tmp", the name it is written under before its rename. */
void kvti_local_chunk_name(char out[KVTI_LOCAL_CHUNK_NAME_MAX],
                           const uint8_t key[32], int tmp);
/* chunks/<kk>/<hex>.kvc of chunk key, relative to the cache directory. 0 or
 * KVT_EINVAL (out too small: ""). */
int kvti_local_chunk_rel(char *out, size_t n, const uint8_t key[32]);
/* <chunks_dir>/<kk>/<hex>.kvc, chunks_dir being the cache directory's
 * chunks/ (kvti_local_path(cache_dir, KVTI_LOCAL_CHUNKS)). 0 or KVT_ERANGE
 * (out too small). */
int kvti_local_chunk_path(char *out, size_t n, const char *chunks_dir,
                          const uint8_t key[32]);
/* The key a chunk file name "<64 lowercase hex>.kvc" stands for (it belongs
 * in chunks/<hex of key[0]>). 0, or -1 for any other name. */
int kvti_local_chunk_key(uint8_t key[32], const char *name);

/* ---- index.db's files ---- */

/* 1 when cache_dir/index.db exists, of any type. */
int kvti_local_index_present(const char *cache_dir);
/* 1 when index.db, -wal or -shm exists but is not a regular file (a FIFO
 * there would stall SQLite's first read forever). */
int kvti_local_index_hostile(const char *cache_dir);
/* Called once per file moved by kvti_local_index_set_aside. */
typedef void (*kvti_local_moved_fn)(void *ctx, const char *from,
                                    const char *to);
/* Renames index.db (and its -wal) to index.db.<why>-<UTC time>[.<n>][-wal]
 * (never over an earlier one) and deletes its -shm, so a fresh index starts
 * clean: a WAL left next to a new database would be replayed into it. The
 * index must not be open. 0 or the error; files moved before a failure stay
 * moved (each move is reported to note). */
int kvti_local_index_set_aside(const char *cache_dir, const char *why,
                               kvti_local_moved_fn note, void *note_ctx);

#endif
