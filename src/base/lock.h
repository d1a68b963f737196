/*
 * lock.h - the per-entry reader/writer locks of the tier. A fixed array of
 * read-write locks
 * ("stripes") is indexed by the first hex digits of an entry's token hash.
 * Readers of an entry (promote, read_entry, describe, verify) hold its stripe
 * shared for the whole read; everything that changes an entry's files (the
 * writer's publish, eviction, expiry, removal, quarantine) holds it exclusive.
 * So no reader ever sees an entry half-replaced, half-evicted or
 * half-quarantined. Locks are writer-preferring where the platform allows it,
 * so a stream of promotes cannot starve the writer.
 *
 * Lock order (whole tier): tier->mut_mu (serialises mutations of data/) -> one
 * stripe -> the index's internal locks. Nobody holds two stripes at once.
 */
#ifndef KVT_LOCK_H
#define KVT_LOCK_H

#include <pthread.h>

#define KVTI_STRIPES 64

typedef struct kvti_stripes {
  pthread_rwlock_t locks[KVTI_STRIPES];
  int inited;
} kvti_stripes;

/* Returns 0 or KVT_ENOMEM/KVT_EIO (message set). */
int kvti_stripes_init(kvti_stripes *s);
void kvti_stripes_destroy(kvti_stripes *s);
/* hash: 64-hex token hash (anything shorter still maps to a stripe). */
void kvti_stripe_rdlock(kvti_stripes *s, const char *hash);
void kvti_stripe_wrlock(kvti_stripes *s, const char *hash);
void kvti_stripe_unlock(kvti_stripes *s, const char *hash);

#endif
