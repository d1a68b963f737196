/*
 * options.h - internal helpers over the public kvt_options: byte capacity as
 * the reference computes it and the default cache directory.
 */
#ifndef KVT_OPTIONS_H
#define KVT_OPTIONS_H

#include "kvtier.h"

/* int(max_size_gb * 2^30), as SSDCacheConfig.max_size_bytes. */
uint64_t kvti_options_max_bytes(const kvt_options *o);
/* The cache directory to use (malloc'ed): cache_dir, or
 * $XDG_CACHE_HOME|~/.cache + /kvtier/<model>. Does not create it. Returns 0,
 * KVT_EINVAL, KVT_ENOMEM. */
int kvti_options_resolve_dir(char **out, const kvt_options *o);

#endif
