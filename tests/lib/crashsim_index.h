/*
 * crashsim_index.h - the index as SQLite guarantees it, for the crash
 * simulator (crashsim.h): a transaction is durable once its WAL is synced
 * (synchronous=FULL syncs at each commit; a group commit turns that off for
 * its records, which its rows' commit then syncs), and a commit written but not
 * yet synced may survive a crash or not - but only as a prefix: SQLite recovers
 * the WAL's frames up to the first that does not check, so a later commit never
 * survives without the earlier ones. index.db and its WAL are not replayed
 * write by write (the simulator's torn-write model is not SQLite's, whose own
 * tests cover it); instead a copy of both is taken at every WAL fsync and at
 * the end of every commit written to the WAL, and a crash after K operations
 * finds the copy of the last fsync before K (or g_base's index, the one
 * before the write) or, drawn at random, one of the commits written after
 * that fsync and before K. Usage: cs_index_install() before rec_install();
 * cs_index_restore(K, rng) after replay(K, ...).
 */
#ifndef KVT_CRASHSIM_INDEX_H
#define KVT_CRASHSIM_INDEX_H

#include "testutil.h"

#include <stddef.h>

/* Forgets earlier copies and routes the index's files to this model
 * (g_cs_skip, g_cs_on_fsync, g_cs_on_write). */
void cs_index_install(void);
/* Puts into g_replay the index a crash after K operations leaves: the last
 * synced state, or (rng non-NULL) a state with some of the unsynced commits
 * after it, drawn uniformly. */
void cs_index_restore(size_t K, kvt_rng *rng);
/* Commits written to the WAL and WAL fsyncs seen since cs_index_install. */
void cs_index_counts(size_t *commits, size_t *syncs);
/* Commits since cs_index_install that another commit followed before any
 * WAL fsync: the ones a crash may lose while keeping nothing later. */
size_t cs_index_unsynced(void);

#endif
