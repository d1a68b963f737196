/*
 * publish.c - publishing a staged entry directory in undoable steps (see
 * publish.h): exchange (or the two-rename fallback) with the previous version
 * kept aside, then commit (drop it) or rollback (put it back). Every name
 * change of data/ is followed by an fsync of data/ when durable, so a power
 * loss leaves the state of the last step or of the one before.
 */
#include "format/publish.h"
#include "base/error.h"
#include "base/io.h"
#include "kvtier.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

static char *suffixed(const char *dir, const char *hash, const char *suf) {
  char name[KVT_HASH_HEX_LEN + 16];
  snprintf(name, sizeof name, "%.64s%s", hash, suf);
  return kvti_path_join(dir, name);
}

int kvti_publish_init(kvti_publish *p, const char *data_dir, const char *hash,
                      int durable) {
  memset(p, 0, sizeof *p);
  p->durable = durable;
  p->tmp = suffixed(data_dir, hash, ".tmp");
  p->live = suffixed(data_dir, hash, "");
  p->old = suffixed(data_dir, hash, ".old.tmp");
  p->data_dir = kvti_strdup(data_dir);
  if (!p->tmp || !p->live || !p->old || !p->data_dir) {
    kvti_publish_free(p);
    return KVT_ERR_NOMEM();
  }
  return 0;
}

void kvti_publish_free(kvti_publish *p) {
  kvti_free(p->tmp);
  kvti_free(p->live);
  kvti_free(p->old);
  kvti_free(p->data_dir);
  memset(p, 0, sizeof *p);
}

/* The renames of a publish, undone in reverse. Returns 0 when the previous
 * state (previous version live, new one at tmp) is back. */
static int unpublish(kvti_publish *p) {
  switch (p->state) {
  case KVTI_PUB_EXCHANGED:
    if (!kvti_io->rename_exchange || kvti_io->rename_exchange(p->tmp, p->live))
      return KVT_ERR_OS(errno, "rename-exchange %s <-> %s (undo)", p->tmp,
                        p->live);
    break;
  case KVTI_PUB_NEW:
    if (kvti_io->rename(p->live, p->tmp) != 0)
      return KVT_ERR_OS(errno, "rename %s -> %s (undo)", p->live, p->tmp);
    break;
  case KVTI_PUB_ASIDE:
    if (kvti_io->rename(p->live, p->tmp) != 0)
      return KVT_ERR_OS(errno, "rename %s -> %s (undo)", p->live, p->tmp);
    if (kvti_io->rename(p->old, p->live) != 0) {
      int e = errno;
      /* The previous version stays aside; put the new one back instead of
       * leaving no entry at all. */
      if (kvti_io->rename(p->tmp, p->live) != 0)
        p->state = KVTI_PUB_NONE;
      return KVT_ERR_OS(e, "rename %s -> %s (undo)", p->old, p->live);
    }
    break;
  default:
    return 0;
  }
  p->state = KVTI_PUB_NONE;
  return 0;
}

int kvti_publish_do(kvti_publish *p) {
  if (p->state != KVTI_PUB_NONE)
    return KVT_ERR(KVT_EINVAL, "publish: already published");
  /* Preferred: atomic exchange with a live version (tmp then holds it). */
  int rc = kvti_rename_exchange(p->tmp, p->live);
  if (rc == 0) {
    p->state = KVTI_PUB_EXCHANGED;
  } else if (rc == KVT_ENOTFOUND) {
    if ((rc = kvti_rename(p->tmp, p->live)) == 0)
      p->state = KVTI_PUB_NEW;
  } else if (rc == KVT_EUNSUPPORTED) {
    struct stat st;
    if (kvti_io->lstat(p->live, &st) == 0) {
      /* Portable fallback: previous version aside, new one into place. */
      if ((rc = kvti_rmtree(p->old)) == 0 &&
          (rc = kvti_rename(p->live, p->old)) == 0) {
        if ((rc = kvti_rename(p->tmp, p->live)) == 0)
          p->state = KVTI_PUB_ASIDE;
        else
          kvti_io->rename(p->old, p->live);
      }
    } else if ((rc = kvti_rename(p->tmp, p->live)) == 0) {
      p->state = KVTI_PUB_NEW;
    }
  }
  if (rc)
    return rc;
  if (p->durable && (rc = kvti_fsync_dir(p->data_dir)) != 0) {
    /* Not durable: undo, so the caller reports a failure that changed
     * nothing. When the undo fails the new complete version stays live and
     * the publish counts as done. */
    char msg[512];
    snprintf(msg, sizeof msg, "%s", kvt_last_error());
    if (unpublish(p) != 0)
      return 0;
    return KVT_ERR(rc, "%s", msg);
  }
  return 0;
}

void kvti_publish_commit(kvti_publish *p) {
  if (p->state == KVTI_PUB_EXCHANGED)
    kvti_rmtree(p->tmp);
  else if (p->state == KVTI_PUB_ASIDE)
    kvti_rmtree(p->old);
  p->state = KVTI_PUB_NONE;
}

int kvti_publish_rollback(kvti_publish *p) {
  if (p->state == KVTI_PUB_NONE)
    return 0;
  int rc = unpublish(p);
  if (rc != 0)
    return rc;
  if (p->durable && (rc = kvti_fsync_dir(p->data_dir)) != 0)
    return rc;         /* the undo is in place, maybe not yet durable */
  kvti_rmtree(p->tmp); /* the new version */
  return 0;
}
