/*
 * sqlvfs.h - the SQLite VFS that puts index.db's file I/O behind kvtier's I/O
 * seam (io.h). kvtier registers it once, under a name of its own and NOT as
 * SQLite's default, so other SQLite users in the process are unaffected; the
 * index opens index.db through it by name. The database, its WAL and its
 * rollback journal are then read, written, synced, truncated, sized, opened,
 * deleted and probed through kvti_io, so a test's fault-injecting or
 * crash-recording I/O table reaches the index too. Locking, the WAL's
 * shared-memory index, randomness, time and path resolution stay with the
 * VFS that was SQLite's default at registration (the unix VFS): the I/O table
 * has no equivalent for them (see sqlvfs.c).
 */
#ifndef KVT_SQLVFS_H
#define KVT_SQLVFS_H

/* The registered name. */
#define KVTI_SQLVFS_NAME "kvtier-io"

/* Registers the VFS (once per process, thread-safe) and returns its name for
 * sqlite3_open_v2, or NULL when SQLite could not register it (the kvtier
 * error is then set, KVT_EDB). */
const char *kvti_sqlvfs_name(void);

#endif
