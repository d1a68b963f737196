/*
 * publish.h - the publication of a staged entry directory as the live one, in
 * steps that can be undone: data/<hash>.tmp (complete, durable when asked)
 * becomes data/<hash> while the version it replaces is kept aside, so that the
 * caller can commit its index row and only then drop the previous version
 * (kvti_publish_commit) - or, if the index commit fails, put the previous
 * version back (kvti_publish_rollback). This is what lets a replacement never
 * lose the acknowledged version: whatever fails after the publish, the old
 * files are still there to restore. kvti_entry_write (stage + publish +
 * commit in one call) and the local backend's stage/publish/commit/rollback
 * both use it.
 *
 * How the previous version is kept: with an atomic exchange (Linux
 * renameat2(RENAME_EXCHANGE), macOS renamex_np(RENAME_SWAP)) it simply ends
 * up at data/<hash>.tmp; without one it is renamed to data/<hash>.old.tmp
 * before the new one is renamed in (a crash between the two leaves it there,
 * where the next open's purge of temporaries removes it: the entry is then
 * missing, never torn - docs/RELIABILITY.md, known limits). With durability,
 * every step fsyncs data/ before it returns, so after a power loss the state
 * is the one of the last completed step, or the one before it.
 */
#ifndef KVT_PUBLISH_H
#define KVT_PUBLISH_H

#include <stdint.h>

enum {
  KVTI_PUB_NONE = 0,  /* nothing published (yet, or any more) */
  KVTI_PUB_NEW,       /* published; there was no previous version */
  KVTI_PUB_EXCHANGED, /* published; the previous version is at tmp */
  KVTI_PUB_ASIDE      /* published; the previous version is at old */
};

typedef struct kvti_publish {
  char *tmp;  /* data/<hash>.tmp: the staged version */
  char *live; /* data/<hash> */
  char *old;  /* data/<hash>.old.tmp (the portable fallback) */
  char *data_dir;
  int state; /* KVTI_PUB_* */
  int durable;
} kvti_publish;

/* Prepares the paths for data_dir/<hash>. Returns 0 or KVT_ENOMEM. */
int kvti_publish_init(kvti_publish *p, const char *data_dir, const char *hash,
                      int durable);
/* Makes the staged tmp the live version, keeping any previous one aside.
 * On failure nothing changed (the staged version is still at tmp, the
 * previous one still live). Returns 0 or a negative code. */
int kvti_publish_do(kvti_publish *p);
/* Drops the previous version kept aside (best effort: a leftover *.tmp is
 * purged at the next open). */
void kvti_publish_commit(kvti_publish *p);
/* Undoes a publish: the previous version is live again (or, when there was
 * none, the new one is removed) and the new version deleted. Returns 0, or
 * a negative code when the undo itself failed (the new version then stays
 * live: a complete entry either way). No-op when nothing was published. */
int kvti_publish_rollback(kvti_publish *p);
void kvti_publish_free(kvti_publish *p);

#endif
