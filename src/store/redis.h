/*
 * redis.h - the constructor of the Redis/Valkey implementation of the
 * storage-backend seam (store/redis/, built only when hiredis is found:
 * KVT_HAVE_REDIS). Everything else it offers - find, stat, stage, fetch - is
 * in its vtable (backend.h); only the constructor table (store/registry.c)
 * names this header. It knows nothing of the tier.
 */
#ifndef KVT_STORE_REDIS_H
#define KVT_STORE_REDIS_H

#include "store/backend.h"

/* The Redis backend (vtable of backend.h; put/get/fetch stage files below
 * cfg->stage_root). No connection is made here. Returns 0, KVT_EINVAL (URL),
 * KVT_ENOMEM. */
int kvti_backend_redis_new(kvti_backend **out, const kvti_remote_cfg *cfg);

#endif
