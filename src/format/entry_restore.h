/*
 * entry_restore.h - crash recovery of the portable replace (entry.c's
 * two-rename fallback where RENAME_EXCHANGE is unavailable): between renaming
 * data/<hash> aside to <hash>.old.tmp and the new version into place, a crash
 * leaves no <hash> and the only complete copy at <hash>.old.tmp. Opening a
 * writable tier puts such a copy back before stale temporaries are purged.
 */
#ifndef KVT_ENTRY_RESTORE_H
#define KVT_ENTRY_RESTORE_H

#include <stdint.h>

/* For every data_dir/<hash>.old.tmp whose data_dir/<hash> does not exist,
 * renames it back to <hash> (through the I/O seam; the directory is fsynced
 * afterwards when do_fsync and something was restored). *restored (may be
 * NULL) receives the count. Returns 0 or a negative kvt code with the error
 * set; on error nothing further is restored - the caller must not purge
 * temporaries then, or it would delete the only copy. No writer may run. */
int kvti_entry_restore_aside(const char *data_dir, int do_fsync,
                             uint64_t *restored);

#endif
