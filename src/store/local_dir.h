/*
 * local_dir.h - walking the cache directory by directory descriptor
 * (local_dir.c), part of the local layout's ownership (local.h): a path
 * below cache_dir is reached from a descriptor of cache_dir itself, one
 * component at a time with openat(O_DIRECTORY | O_NOFOLLOW), and files are
 * opened, listed, stat'ed and unlinked relative to the descriptor of their
 * own directory. So a symbolic link planted anywhere below cache_dir (a
 * chunks/ or chunks/<kk> pointing elsewhere) is refused, never followed, and
 * nothing outside the cache can be read or removed through it.
 */
#ifndef KVT_STORE_LOCAL_DIR_H
#define KVT_STORE_LOCAL_DIR_H

#include <stddef.h>

/* Opens cache_dir itself (O_DIRECTORY, O_NOFOLLOW on its last component:
 * the layout checks at open refuse a linked cache_dir). fd or a negative
 * kvt code (error set). */
int kvti_dir_open_root(const char *cache_dir);
/* Opens directory rel ("a/b", no leading '/', no "." or "..") below base_fd
 * without following any link. fd, or KVT_ENOTFOUND (a component missing),
 * KVT_EPERM (a component is a link or not a directory: the message names
 * it), another negative code. where names base in messages. */
int kvti_dir_open_rel(int base_fd, const char *rel, const char *where);
/* kvti_dir_open_rel that creates the missing components (mkdirat with
 * mode, relative to the descriptor of the component above; with do_fsync
 * that descriptor is fsynced after a creation, so the new directory entry is
 * durable before anything goes in). Something other than a directory on the
 * way - a link above all - is refused (KVT_EPERM, nothing created below it).
 * fd or a negative code. */
int kvti_dir_open_mk(int base_fd, const char *rel, unsigned mode, int do_fsync,
                     const char *where);
/* Unlinks file rel ("a/b/name") below base_fd, reaching its directory as
 * kvti_dir_open_rel does. 0 (also when it is missing), KVT_EPERM (a link on
 * the way: nothing removed), another code. */
int kvti_dir_unlink_rel(int base_fd, const char *rel, const char *where);
/* Bounds directory dirfd to keep names starting with prefix (NULL: every
 * name), removing the oldest by ctime (ties by name) first; except (may be
 * NULL: the name just made) counts toward keep and is never removed; a removed
 * directory is emptied through its own descriptor, a link is unlinked and
 * its target never touched. *removed (may be NULL) receives how many went.
 * 0 or the first failure's code (where names dirfd in messages). */
int kvti_dir_bound(int dirfd, size_t keep, const char *prefix,
                   const char *except, size_t *removed, const char *where);
/* The same bound over the names NOT starting with others: quarantine/
 * holds entries and chunk-* directories, each kind bounded on its own so
 * neither evicts (nor counts toward) the other. */
int kvti_dir_bound_others(int dirfd, size_t keep, const char *others,
                          const char *except, size_t *removed,
                          const char *where);

#endif
