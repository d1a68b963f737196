/*
 * entry_restore.c - puts back <hash>.old.tmp when <hash> is missing (see
 * entry_restore.h). Why it is safe: <hash>.old.tmp is only ever made by
 * renaming a complete, published <hash> aside (entry.c removes any stale one
 * first, while <hash> still exists), and the index row, written after the new
 * version is published, still describes the old one. So when <hash> is absent
 * the aside copy is the entry the index knows; when <hash> exists the aside
 * copy is stale and the purge of temporaries removes it.
 */
#include "format/entry_restore.h"
#include "base/error.h"
#include "base/hash.h"
#include "base/io.h"
#include "kvtier.h"

#include <errno.h>
#include <string.h>

#define ASIDE_SUFFIX ".old.tmp"

int kvti_entry_restore_aside(const char *data_dir, int do_fsync,
                             uint64_t *restored) {
  if (restored)
    *restored = 0;
  DIR *d = kvti_io->opendir(data_dir);
  if (!d)
    return errno == ENOENT ? 0 : KVT_ERR_OS(errno, "opendir %s", data_dir);
  const size_t sl = strlen(ASIDE_SUFFIX);
  uint64_t n = 0;
  int rc = 0;
  struct dirent *de;
  errno = 0;
  while (rc == 0 && (de = kvti_io->readdir(d)) != NULL) {
    size_t l = strlen(de->d_name);
    char hash[KVT_HASH_HEX_LEN + 1];
    if (l != KVT_HASH_HEX_LEN + sl ||
        memcmp(de->d_name + KVT_HASH_HEX_LEN, ASIDE_SUFFIX, sl) != 0)
      continue;
    memcpy(hash, de->d_name, KVT_HASH_HEX_LEN);
    hash[KVT_HASH_HEX_LEN] = '\0';
    if (!kvti_is_hash_name(hash))
      continue;
    char *live = kvti_path_join(data_dir, hash);
    char *aside = kvti_path_join(data_dir, de->d_name);
    struct stat st;
    if (!live || !aside) {
      rc = KVT_ERR_NOMEM();
    } else if (kvti_io->lstat(live, &st) == 0) {
      /* the replace completed: the aside copy is stale (purged later) */
    } else if (errno != ENOENT) {
      rc = KVT_ERR_OS(errno, "stat %s", live);
    } else if ((rc = kvti_rename(aside, live)) == 0) {
      n++;
    }
    kvti_free(live);
    kvti_free(aside);
    errno = 0;
  }
  if (rc == 0 && errno != 0)
    rc = KVT_ERR_OS(errno, "readdir %s", data_dir);
  kvti_io->closedir(d);
  if (rc == 0 && n > 0 && do_fsync)
    rc = kvti_fsync_dir(data_dir);
  if (restored)
    *restored = n;
  return rc;
}
