/*
 * local_chunks.c - the chunk files' places in the cache directory
 * (local_chunks.h): presence probes, the quarantine move and its records, and
 * the scan of chunks/<kk> for what the chain table does not index. Every
 * file is reached from a directory descriptor opened without following
 * links (the chunk store's root, chunks/<kk>, quarantine/).
 */
#include "store/local_chunks.h"
#include "store/local_dir.h"
#include "store/local_layout.h"
#include "base/error.h"
#include "base/hash.h"
#include "base/io.h"
#include "index/chain_walk.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

int kvti_local_chunk_present(kvti_chunkstore *cs, const uint8_t key[32],
                             int regular_only) {
  char name[KVTI_LOCAL_CHUNK_NAME_MAX];
  kvti_local_chunk_name(name, key, 0);
  int sfd = kvti_chunkstore_open_subdir(cs, key[0]);
  if (sfd == KVT_ENOTFOUND) {
    kvt_clear_error();
    return 0;
  }
  if (sfd < 0)
    return sfd;
  struct stat st;
  int there = kvti_lstatat(sfd, name, &st, name) == 0 &&
              (!regular_only || S_ISREG(st.st_mode));
  if (!there)
    kvt_clear_error();
  kvti_close(sfd);
  return there;
}

const char *kvti_local_chunk_quarantine(kvti_chunkstore *cs,
                                        const uint8_t key[32],
                                        const kvti_chunk_qpolicy *p,
                                        size_t *bounded) {
  char name[KVTI_LOCAL_CHUNK_NAME_MAX], kh[65], qdir[100], path[4096],
      dst[4400];
  kvti_local_chunk_name(name, key, 0);
  kvti_hex32(kh, key);
  *bounded = 0;
  if (kvti_chunkstore_path(cs, key, path, sizeof path) != 0)
    return "left in chunks/ (path too long)";
  int sfd = kvti_chunkstore_open_subdir(cs, key[0]);
  if (sfd < 0)
    return "left where it is (its directory is a link or not a directory: "
           "never followed)";
  const char *fate;
  if (p->quarantine_max == 0) {
    fate = kvti_unlinkat(sfd, name, path) == 0
               ? "deleted (quarantine_max 0)"
               : "left in chunks/ (unlink failed)";
    kvti_close(sfd);
    return fate;
  }
  int root = kvti_chunkstore_root_fd(cs), qfd = -1, cfd = -1, made = -1;
  if (kvti_mkdirat(root, KVTI_LOCAL_QUARANTINE, p->dir_mode, NULL) >= 0)
    qfd = kvti_dir_open_rel(root, KVTI_LOCAL_QUARANTINE, KVTI_LOCAL_QUARANTINE);
  /* The first free record name: a key quarantined before keeps its record. */
  for (unsigned a = 0; qfd >= 0 && a < 1000 && made != 0; a++) {
    if (a == 0)
      snprintf(qdir, sizeof qdir, "%s%s", KVTI_LOCAL_CHUNK_QDIR, kh);
    else
      snprintf(qdir, sizeof qdir, "%s%s.%u", KVTI_LOCAL_CHUNK_QDIR, kh, a);
    made = kvti_mkdirat(qfd, qdir, p->dir_mode, qdir);
    if (made < 0)
      break;
  }
  if (made == 0)
    cfd = kvti_dir_open_rel(qfd, qdir, qdir);
  snprintf(dst, sizeof dst, "%s/%s/%s", KVTI_LOCAL_QUARANTINE, qdir, name);
  if (cfd >= 0 && kvti_renameat(sfd, name, cfd, name, path, dst) == 0) {
    fate = "moved to quarantine/";
    if (p->do_fsync)
      kvti_fsync(cfd, dst);
    /* quarantine_max bounds chunk moves as it bounds entry moves: the
     * oldest go first, never the one just made. */
    if (kvti_dir_bound(qfd, p->quarantine_max, KVTI_LOCAL_CHUNK_QDIR, qdir,
                       bounded, KVTI_LOCAL_QUARANTINE) != 0)
      *bounded = 0;
  } else {
    /* Unreadable as it is: it must not be read again nor kept where a
     * rewrite would find the name taken. */
    fate = kvti_unlinkat(sfd, name, path) == 0
               ? "deleted (could not be moved)"
               : "left in chunks/ (could not be moved)";
  }
  if (cfd >= 0)
    kvti_close(cfd);
  if (qfd >= 0)
    kvti_close(qfd);
  kvti_close(sfd);
  return fate;
}

int kvti_local_chunks_quarantined(kvti_chunkstore *cs,
                                  int (*fn)(void *ctx, const uint8_t key[32]),
                                  void *ctx) {
  int qfd = kvti_dir_open_rel(kvti_chunkstore_root_fd(cs),
                              KVTI_LOCAL_QUARANTINE, KVTI_LOCAL_QUARANTINE);
  if (qfd < 0) {
    kvt_clear_error(); /* no records: nothing quarantined */
    return 0;
  }
  int sfd =
      kvti_openat(qfd, ".", O_RDONLY | O_DIRECTORY, 0, KVTI_LOCAL_QUARANTINE);
  DIR *d = sfd >= 0 ? kvti_fdopendir(sfd) : NULL;
  if (!d && sfd >= 0)
    kvti_close(sfd);
  kvti_close(qfd);
  if (!d) {
    kvt_clear_error();
    return 0;
  }
  size_t pl = strlen(KVTI_LOCAL_CHUNK_QDIR);
  int rc = 0;
  struct dirent *de;
  while (rc == 0 && (de = kvti_io->readdir(d)) != NULL) {
    /* chunk-<64 hex>, or chunk-<64 hex>.<n> for a second move of one key */
    const char *nm = de->d_name;
    char hex[65];
    uint8_t key[32];
    if (strncmp(nm, KVTI_LOCAL_CHUNK_QDIR, pl) != 0 || strlen(nm) < pl + 64 ||
        (nm[pl + 64] != '\0' && nm[pl + 64] != '.'))
      continue;
    memcpy(hex, nm + pl, 64);
    hex[64] = '\0';
    if (kvti_unhex32(key, hex) == 0)
      rc = fn(ctx, key);
  }
  kvti_io->closedir(d);
  return rc;
}

int kvti_local_chunks_scan(kvti_chunkstore *cs, unsigned kk,
                           kvti_chunk_scan_fn fn, void *ctx) {
  kvti_chains *ch = kvti_chunkstore_chains(cs);
  char rel[64];
  kvti_local_chunk_dir_rel(rel, sizeof rel, kk); /* kk < 256: it fits */
  int rc = 0;
  DIR *d = NULL;
  int dfd = kvti_chunkstore_open_subdir(cs, kk);
  if (dfd == KVT_EPERM) {
    kvti_chunk_scan_item it;
    memset(&it, 0, sizeof it);
    it.kind = KVTI_SCAN_STRAY;
    it.rel = rel;
    it.why = kvt_last_error();
    rc = fn(ctx, &it);
    kvt_clear_error();
    return rc;
  }
  if (dfd == KVT_ENOTFOUND) {
    kvt_clear_error();
    return 0;
  }
  if (dfd < 0)
    return dfd;
  if (!(d = kvti_fdopendir(dfd))) {
    rc = KVT_ERR_OS(errno, "opendir %s", rel);
    kvti_close(dfd);
    return rc;
  }
  struct dirent *de;
  while (rc == 0 && (de = kvti_io->readdir(d)) != NULL) {
    const char *nm = de->d_name;
    if (!strcmp(nm, ".") || !strcmp(nm, ".."))
      continue;
    /* An indexed chunk - nearly every name - costs no system call: the
     * writer's lazy sweep runs this under the tier's mutation lock. */
    kvti_chunk_scan_item it;
    memset(&it, 0, sizeof it);
    int named = kvti_local_chunk_key(it.key, nm) == 0 && it.key[0] == kk;
    if (named && kvti_chains_find(ch, it.key, NULL))
      continue;
    /* The name relative to the cache directory: what reports and error
     * messages show, and what an unlink through the store is given. */
    char path[400];
    snprintf(path, sizeof path, "%s/%.300s", rel, nm);
    it.rel = path;
    struct stat st;
    if (kvti_lstatat(dfd, nm, &st, path) != 0) {
      kvt_clear_error();
      continue; /* gone meanwhile */
    }
    it.size = (uint64_t)st.st_size;
    size_t len = strlen(nm);
    int reg = S_ISREG(st.st_mode);
    if (reg && len > 4 && !strcmp(nm + len - 4, ".tmp")) {
      it.kind = KVTI_SCAN_TMP;
      it.why = "interrupted chunk write";
      rc = fn(ctx, &it);
      continue;
    }
    if (!reg || !named) {
      it.kind = KVTI_SCAN_STRAY;
      it.why = reg ? "not a chunk file name" : "not a regular file";
      rc = fn(ctx, &it);
      continue;
    }
    /* An orphan: verified completely before anyone acts on it. */
    int fd = -1;
    int vrc = kvti_openat(dfd, nm, O_RDONLY, 0, path);
    if (vrc >= 0)
      vrc = kvti_chunk_open_fd(vrc, &fd, &it.hdr, path, it.key, 0);
    if (vrc == 0) {
      vrc = kvti_chunk_verify_data(fd, &it.hdr, path); /* bounded memory */
      kvti_close(fd);
    }
    if (vrc == KVT_ENOTFOUND) { /* gone meanwhile */
      kvti_chunk_hdr_free(&it.hdr);
      kvt_clear_error();
      continue;
    }
    if (vrc == KVT_ENOMEM) {
      kvti_chunk_hdr_free(&it.hdr);
      rc = vrc;
      break;
    }
    if (vrc != 0) {
      kvti_chunk_hdr_free(&it.hdr);
      memset(&it.hdr, 0, sizeof it.hdr);
      it.kind = KVTI_SCAN_DAMAGED;
      it.why = kvt_last_error();
    } else {
      it.kind = KVTI_SCAN_ORPHAN;
    }
    rc = fn(ctx, &it);
    kvti_chunk_hdr_free(&it.hdr); /* unless the callback took it */
  }
  kvti_io->closedir(d);
  return rc;
}
