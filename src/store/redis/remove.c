/*
 * remove.c - deleting an entry from the Redis server: one version's keys,
 * manifest first (compare-and-delete, so a reader cleaning up a damaged
 * version never deletes a newer one a writer has just committed), then the
 * chunks of its generation; a stale member of a prefix set; the lookup
 * mirrors told that the entry is gone. Used by removal and quarantine (the
 * vtable), by readers that found an entry damaged or incomplete, and by a put
 * dropping the generation it replaced.
 */
#include "base/error.h"
#include "base/io.h"
#include "store/redis/internal.h"

#include <string.h>

/* Deletes chunks [0, n) of generation gen (pipelined, one slot). */
int kvti_rb_del_chunks(redis_backend *rb, const char *hash, const char *gen,
                       uint64_t n) {
  int rc = 0;
  for (uint64_t base = 0; base < n && rc == 0; base += 256) {
    chunk_batch bt;
    if ((rc = kvti_rb_batch_open(&bt, rb, hash, gen, base,
                                 n - base < 256 ? n - base : 256)) != 0)
      break;
    for (uint64_t i = 0; i < bt.n; i++)
      kvti_rb_cmd2(&bt.cmds[i], "UNLINK", bt.keys[i].s, bt.keys[i].n);
    rc = kvti_rb_batch_exec(rb, &bt);
    kvti_rb_batch_close(&bt);
  }
  return rc;
}

/* Removes hash from the prefix set for its length (needs the first tokens,
 * which only the entry's files know; callers with a manifest pass its
 * pset key when known, else nothing is done: stale members are dropped by
 * lookups anyway). */
int kvti_rb_zrem(redis_backend *rb, const rkey *pset, const char *hash) {
  kvr_cmd c;
  kvti_rb_cmd2(&c, "ZREM", pset->s, pset->n);
  kvti_rb_cmd_arg(&c, hash, KVT_HASH_HEX_LEN);
  redisReply *r = NULL;
  int rc = kvr_exec(rb->cl, pset->s, pset->n, &c, 1, &r);
  if (rc == 0)
    freeReplyObject(r);
  return rc;
}

/* Deletes the manifest only if it is still exactly raw (atomically, one key):
 * a reader cleaning up a damaged version must never delete a newer version a
 * writer has just committed. */
static int manifest_cad(redis_backend *rb, const char *hash, const char *raw,
                        size_t len) {
  static const char script[] =
      "if redis.call('GET', KEYS[1]) == ARGV[1] then "
      "return redis.call('DEL', KEYS[1]) else return 0 end";
  rkey k;
  kvti_rb_key_manifest(&k, rb, hash);
  kvr_cmd c;
  kvti_rb_cmd2(&c, "EVAL", script, sizeof script - 1);
  kvti_rb_cmd_arg(&c, "1", 1);
  kvti_rb_cmd_arg(&c, k.s, k.n);
  kvti_rb_cmd_arg(&c, raw, len);
  redisReply *r = NULL;
  int rc = kvr_exec(rb->cl, k.s, k.n, &c, 1, &r);
  if (rc == 0) {
    rc = kvti_rb_reply_err(r, "EVAL (manifest compare-and-delete)");
    freeReplyObject(r);
  }
  return rc;
}

/* Tells the lookup mirrors that hash is gone (best effort: a mirror that
 * misses it finds the manifest gone at its next confirmation). */
static void publish_removal(redis_backend *rb, const char *hash) {
  char chan[400], ev[256];
  size_t chl = kvr_mirror_channel(chan, sizeof chan, rb->prefix);
  size_t evl = kvr_mirror_event(ev, sizeof ev, hash, NULL, 0);
  kvr_cmd c;
  kvti_rb_cmd2(&c, "PUBLISH", chan, chl);
  kvti_rb_cmd_arg(&c, ev, evl);
  redisReply *r = NULL;
  rkey k;
  kvti_rb_key_manifest(&k, rb, hash);
  if (kvr_exec(rb->cl, k.s, k.n, &c, 1, &r) == 0)
    freeReplyObject(r);
  else
    kvt_clear_error();
  kvr_mirror_del(rb->mirror, hash);
}

/* Deletes every key of one version of an entry: its manifest first (only if
 * it is still that version: readers stop finding it), then the chunks of its
 * generation. known: the version a reader found damaged; NULL: whatever
 * version is stored now (removal, quarantine). */
int kvti_rb_remove_entry(redis_backend *rb, const char *hash,
                         const rmanifest *known) {
  rmanifest m;
  memset(&m, 0, sizeof m);
  const rmanifest *mp = known;
  char *raw = NULL;
  size_t len = 0;
  int rc = 0;
  if (!mp) {
    rc = kvti_rb_rman_get_raw(rb, rb->cl, hash, &raw, &len);
    if (rc == KVT_ENOTFOUND) {
      kvt_clear_error();
      return 0;
    }
    if (rc != 0)
      return rc;
    if (kvti_rb_rman_parse(&m, raw, len, hash, 512ull << 20) == 0)
      mp = &m; /* else a damaged manifest: delete it, no chunks known */
    kvt_clear_error();
  } else {
    raw = mp->raw;
    len = mp->raw_len;
  }
  if (raw)
    rc = manifest_cad(rb, hash, raw, len);
  if (rc == 0 && mp)
    rc = kvti_rb_del_chunks(rb, hash, mp->gen, mp->n_chunks);
  if (rc == 0)
    publish_removal(rb, hash);
  if (!known)
    kvti_free(raw);
  kvti_rb_rman_free(&m);
  return rc;
}
