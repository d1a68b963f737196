/*
 * statsfile.h - the live stats file, <cache_dir>/stats.bin: the tier that has
 * a directory open for writing (the holder of kvtier.lock, so one process at
 * a time) maps a 4 KiB file and copies its kvt_stats into it at every counter
 * update, so `kvtier stats DIR` in another process can show the live figures.
 * A seqlock makes each snapshot consistent: the writer makes the sequence odd,
 * stores the words, makes it even; a reader retries while it is odd or moved.
 * The layout (docs/FORMAT.md, "stats.bin") is fixed: a 64-byte header, then
 * kvt_stats word by word. Nothing here is durable or fsynced: the file
 * describes a running process, not stored data.
 */
#ifndef KVT_STATSFILE_H
#define KVT_STATSFILE_H

#include "kvtier.h"
#include "kvtier_sys.h"

#include <stdint.h>
#include <sys/types.h>

#define KVTI_STATSFILE_MAGIC "KVTSTAT" /* 8 bytes with its NUL */
#define KVTI_STATSFILE_VERSION 1u
#define KVTI_STATSFILE_SIZE 4096u
#define KVTI_STATSFILE_HEADER 64u
#define KVTI_STATSFILE_OPEN 1u   /* state: a tier has it open */
#define KVTI_STATSFILE_CLOSED 2u /* state: closed cleanly */

typedef struct kvti_statsfile kvti_statsfile;

/* Creates (or takes over) dir's stats file (store/local_layout.h), stamps it
 * with this process's pid and publishes s. Returns 0 or a negative code (error
 * set). */
int kvti_statsfile_open(kvti_statsfile **out, const char *dir, mode_t mode,
                        const kvt_stats *s);
/* Publishes s. Callers serialise calls (the tier's stats mutex). */
void kvti_statsfile_publish(kvti_statsfile *f, const kvt_stats *s);
/* Publishes s one last time, marks the file closed and unmaps it. NULL is a
 * no-op. */
void kvti_statsfile_close(kvti_statsfile *f, const kvt_stats *s);

#endif
