/*
 * options.h - internal helpers over the public kvt_options: reading a struct
 * of any known version, byte capacity as the reference computes it and the
 * default cache directory.
 */
#ifndef KVT_OPTIONS_H
#define KVT_OPTIONS_H

#include "kvtier.h"

/* Most threads one entry read may use (kvt_options.read_threads). */
#define KVTI_MAX_READ_THREADS 8u

/* *out = *in as a current-version struct: the fields in's version has, the
 * defaults for newer ones. 0 or KVT_EINVAL (NULL, unknown version). */
int kvti_options_upgrade(kvt_options *out, const kvt_options *in);
/* int(max_size_gb * 2^30), as SSDCacheConfig.max_size_bytes. */
uint64_t kvti_options_max_bytes(const kvt_options *o);
/* The cache directory to use (malloc'ed): cache_dir, or
 * $XDG_CACHE_HOME|~/.cache + /kvtier/<model>. Does not create it. Returns 0,
 * KVT_EINVAL, KVT_ENOMEM. */
int kvti_options_resolve_dir(char **out, const kvt_options *o);

#endif
