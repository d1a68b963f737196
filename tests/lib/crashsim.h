/*
 * crashsim.h - the power-loss simulator shared by the crash-simulation tests
 * (crashsim.c has the model). Usage: set g_base (the state before the
 * write), g_live (a copy of it the write runs in) and g_replay (where crash
 * states are rebuilt); rec_install() before the write, kvti_io_set(NULL)
 * after it; then for K = 0 .. g_nlog, replay(K, rng) rebuilds in g_replay the
 * state a power loss after the first K logged operations may leave (paths
 * under g_live are mapped to g_replay). g_fsync_files = 0 makes file fsyncs
 * no-ops (a deliberately wrong order the simulator must catch); g_exch_ok =
 * 0 makes rename-exchange unsupported (the portable publish path).
 */
#ifndef KVT_CRASHSIM_H
#define KVT_CRASHSIM_H

#include "testutil.h"

#include <stddef.h>
#include <stdint.h>

extern char g_base[4096], g_live[4096], g_replay[4096];
extern size_t g_nlog;
extern int g_fsync_files, g_exch_ok;

/* Optional: paths for which g_cs_skip returns 1 are not logged (their
 * durability is modelled by the caller); a skipped path's fsync calls
 * g_cs_on_fsync(path, n) with n = the number of operations logged so far
 * (so a crash after K >= n operations happened after that fsync). */
extern int (*g_cs_skip)(const char *path);
extern void (*g_cs_on_fsync)(const char *path, size_t op);
/* Optional: a skipped path's writes call g_cs_on_write with the bytes
 * written and op as above (the caller's model of that file may need them). */
extern void (*g_cs_on_write)(const char *path, uint64_t off, const void *data,
                             size_t n, size_t op);

void rec_install(void);
void log_clear(void);
void replay(size_t K, kvt_rng *rng);
void crashsim_free(void);

#endif
