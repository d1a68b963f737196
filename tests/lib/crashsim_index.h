/*
 * crashsim_index.h - the index as SQLite guarantees it, for the crash
 * simulator (crashsim.h): with synchronous=FULL a transaction is durable once
 * its WAL is synced. index.db and its WAL are not replayed write by write
 * (the simulator's torn-write model is not SQLite's, whose own tests cover
 * it); instead a copy of both is taken at every WAL fsync, and a crash after
 * K operations finds the copy of the last fsync before K (or g_base's index,
 * the one before the write). Usage: cs_index_install() before rec_install();
 * cs_index_restore(K) after replay(K, ...).
 */
#ifndef KVT_CRASHSIM_INDEX_H
#define KVT_CRASHSIM_INDEX_H

#include <stddef.h>

/* Forgets earlier copies and routes the index's files to this model
 * (g_cs_skip, g_cs_on_fsync). */
void cs_index_install(void);
/* Puts into g_replay the index a crash after K operations leaves. */
void cs_index_restore(size_t K);

#endif
