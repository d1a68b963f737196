/*
 * syncset.h - files and directories written now and made durable together
 * later. A set holds one write group (fwriter.h) for the files and a list of
 * directories; kvti_syncset_files fsyncs every file of the group at once, and
 * kvti_syncset_dirs every listed directory at once, each once (io_uring runs a
 * round in parallel, which the file system's journal commits together). The
 * writer's group commit writes every spill of a batch into one set, so a batch
 * pays one round of file fsyncs and one or two of directory fsyncs, where
 * spills written one by one pay a round per file and per directory.
 *
 * The caller orders the rounds: a name is made durable (its directory synced)
 * only after the file it names is (kvti_syncset_files first), and nothing that
 * points at a file (an index row) is committed before both rounds returned. A
 * set is used by one thread. Without do_fsync both rounds only close.
 */
#ifndef KVT_ENGINE_SYNCSET_H
#define KVT_ENGINE_SYNCSET_H

#include "engine/fwriter.h"

typedef struct kvti_syncset kvti_syncset;

/* backend: kvt_io_backend of the set's engine (0 = AUTO). Returns 0,
 * KVT_ENOMEM, KVT_EUNSUPPORTED. */
int kvti_syncset_open(kvti_syncset **out, int backend, int do_fsync);
/* The same with its write group's depth (kvti_wgroup_open_depth). */
int kvti_syncset_open_depth(kvti_syncset **out, int backend, int do_fsync,
                            unsigned depth);
/* The group the set's files are written into (kvti_wgroup_file*). Its files
 * stay open until kvti_syncset_files (or a checkpoint of the group, which
 * fsyncs the files it closes: syncing early is always allowed). NULL once
 * kvti_syncset_files ran. */
kvti_wgroup *kvti_syncset_group(kvti_syncset *s);
int kvti_syncset_do_fsync(const kvti_syncset *s);
/* Adds a directory for the next kvti_syncset_dirs: by path (opened then), or
 * by descriptor (borrowed: it must stay open until kvti_syncset_dirs
 * returned). A directory already listed (the same path, the same descriptor)
 * is not added twice. 0 or KVT_ENOMEM. */
int kvti_syncset_dir(kvti_syncset *s, const char *path);
int kvti_syncset_dirfd(kvti_syncset *s, int dirfd, const char *path);
/* Waits for every write of the group, fsyncs all its files at once
 * (do_fsync) and closes them; the group is gone afterwards. On failure (or
 * after a failure of the group) every file the group created is removed.
 * Returns 0 or the first error. A second call returns 0. */
int kvti_syncset_files(kvti_syncset *s);
/* fsyncs every directory listed since the last call at once (do_fsync) and
 * empties the list. Returns 0 or the first error. */
int kvti_syncset_dirs(kvti_syncset *s);
/* Frees the set; a group whose files were not synced is aborted (its files
 * removed). NULL is a no-op. */
void kvti_syncset_free(kvti_syncset *s);

#endif
