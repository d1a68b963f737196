/*
 * salt.c - the public cache_salt of a call (kvt_call_opts, kvt_promote_opts
 * version 2) turned into the tier's kvti_salt (base/salt.h): validated (struct
 * version, length), refused with a remote tier (the remote store is keyed by
 * unsalted names, so a salted entry must never reach it), and digested once
 * per call.
 */
#include "tier/tier.h"

#include "base/error.h"

#include <string.h>

int kvt_call_opts_init(kvt_call_opts *o, unsigned int version) {
  if (!o || version < 1 || version > KVT_CALL_OPTS_VERSION)
    return KVT_ERR(KVT_EINVAL, "kvt_call_opts_init: bad argument");
  kvt_call_opts d = KVT_CALL_OPTS_INIT;
  d.version = version;
  *o = d;
  return 0;
}

int kvti_tier_salt(kvti_salt *out, const kvt_tier *t, const void *salt,
                   size_t len) {
  int rc = kvti_salt_make(out, salt, len);
  if (rc == 0 && out->has && t && t->opts.remote_mode != KVT_REMOTE_LOCAL) {
    out->has = 0;
    rc = KVT_ERR(KVT_EUNSUPPORTED,
                 "cache_salt is not supported with a remote tier (the remote "
                 "store is keyed by unsalted names)");
  }
  if (rc == 0 && t)
    rc = kvti_salt_join(out, &t->ns, out);
  return rc;
}

int kvti_tier_ns_init(kvt_tier *t) {
  memset(&t->ns, 0, sizeof t->ns);
  /* Only where the names are ours: compat mode writes the reference's
   * names (one directory per model, as it reads them), and the remote
   * store is keyed by unsalted names shared between nodes. */
  if (t->opts.storage_mode != KVT_STORAGE_NATIVE ||
      t->opts.remote_mode != KVT_REMOTE_LOCAL)
    return 0;
  return kvti_salt_model(&t->ns, t->opts.model_id);
}

int kvti_call_salt(kvti_salt *out, const kvt_tier *t, const kvt_call_opts *co) {
  out->has = 0;
  if (!co)
    return kvti_tier_salt(out, t, NULL, 0);
  if (co->version < 1 || co->version > KVT_CALL_OPTS_VERSION)
    return KVT_ERR(KVT_EINVAL, "kvt_call_opts: unknown version %u",
                   co->version);
  return kvti_tier_salt(out, t, co->cache_salt, co->cache_salt_len);
}
