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
