/*
 * options.c - kvt_options defaults, validation (the reference's
 * SSDCacheConfig.__post_init__ checks, with the same messages, plus kvtier's
 * own fields) and resolution of the default cache directory ($XDG_CACHE_HOME or
 * ~/.cache, then kvtier/<model name>).
 */
#include "store/local_layout.h"
#include "tier/options.h"
#include "base/error.h"
#include "base/io.h"
#include "store/backend.h"

#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Bytes of kvt_options as each version declared it (fields are only ever
 * appended; see kvtier.h), 0 for an unknown version. A new version adds one
 * case here. */
static size_t options_size(unsigned int version) {
  switch (version) {
  case 1:
    return offsetof(kvt_options, read_threads);
  case 2:
    return offsetof(kvt_options, host_cache_bytes);
  case 3:
    return offsetof(kvt_options, remote_lookup_timeout_ms);
  case 4:
    return offsetof(kvt_options, admission_policy);
  case 5:
    return sizeof(kvt_options);
  default:
    return 0;
  }
}

int kvt_options_init(kvt_options *opts, unsigned int version) {
  if (!opts)
    return KVT_ERR(KVT_EINVAL, "kvt_options_init: opts is NULL");
  size_t n = options_size(version);
  if (n == 0)
    return KVT_ERR(KVT_EINVAL,
                   "kvt_options_init: unknown version %u (this "
                   "library knows 1..%u)",
                   version, KVT_OPTIONS_VERSION);
  kvt_options d = KVT_OPTIONS_INIT;
  d.version = version;
  memcpy(opts, &d, n); /* only what a caller of that version has */
  return 0;
}

int kvti_options_upgrade(kvt_options *out, const kvt_options *in) {
  if (!in)
    return KVT_ERR(KVT_EINVAL, "options is NULL");
  size_t n = options_size(in->version);
  if (n == 0)
    return KVT_ERR(KVT_EINVAL, "options version must be 1..%u, got %u",
                   KVT_OPTIONS_VERSION, in->version);
  kvt_options d = KVT_OPTIONS_INIT;
  memcpy(&d, in, n);
  d.version = KVT_OPTIONS_VERSION;
  *out = d;
  return 0;
}

size_t kvt_options_size(void) {
  return sizeof(kvt_options);
}

size_t kvti_stats_size(unsigned int version) {
  switch (version) {
  case 1:
    return offsetof(kvt_stats, tokens_requested);
  case 2:
    return offsetof(kvt_stats, spill_refused_unsupported);
  case 3:
    return sizeof(kvt_stats);
  default:
    return 0;
  }
}

int kvt_stats_init(kvt_stats *s, unsigned int version) {
  size_t n = kvti_stats_size(version);
  if (!s || n == 0)
    return KVT_ERR(KVT_EINVAL, "kvt_stats_init: NULL or unknown version %u",
                   version);
  memset(s, 0, n);
  s->version = version;
  return 0;
}

size_t kvt_stats_size(void) {
  return sizeof(kvt_stats);
}

int kvt_promote_opts_init(kvt_promote_opts *opts, unsigned int version) {
  if (!opts || version < 1 || version > KVT_PROMOTE_OPTS_VERSION)
    return KVT_ERR(KVT_EINVAL,
                   "kvt_promote_opts_init: NULL or unknown version");
  kvt_promote_opts d = KVT_PROMOTE_OPTS_INIT;
  /* Only the caller's version's fields exist. */
  memcpy(opts, &d,
         version == 1 ? offsetof(kvt_promote_opts, cache_salt) : sizeof d);
  opts->version = version;
  return 0;
}

static int valid_model_name(const char *m) {
  return m[0] && !strchr(m, '/') && strcmp(m, ".") && strcmp(m, "..");
}

/* The remote-tier fields (see kvt_options). */
static int validate_remote(const kvt_options *o) {
  if (o->remote_mode < KVT_REMOTE_LOCAL || o->remote_mode > KVT_REMOTE_ONLY)
    return KVT_ERR(KVT_EINVAL,
                   "remote_mode must be KVT_REMOTE_LOCAL, "
                   "KVT_REMOTE_LOCAL_AND_REMOTE or KVT_REMOTE_ONLY, "
                   "got %d",
                   o->remote_mode);
  if (o->remote_mode != KVT_REMOTE_LOCAL && !o->remote_url)
    return KVT_ERR(KVT_EINVAL, "remote_mode needs a remote_url");
  if (o->remote_url && o->remote_mode == KVT_REMOTE_LOCAL)
    return KVT_ERR(KVT_EINVAL,
                   "remote_url is set but remote_mode is "
                   "KVT_REMOTE_LOCAL; choose "
                   "KVT_REMOTE_LOCAL_AND_REMOTE or KVT_REMOTE_ONLY");
  if (o->remote_url && kvti_backend_remote_check_url(o->remote_url) != 0)
    return KVT_EINVAL;
  if (o->remote_prefix &&
      (strlen(o->remote_prefix) > 128 || strpbrk(o->remote_prefix, "{}")))
    return KVT_ERR(KVT_EINVAL, "remote_prefix must be at most 128 bytes "
                               "without '{' or '}'");
  if (o->remote_timeout_ms < 1 || o->remote_timeout_ms > 600000)
    return KVT_ERR(KVT_EINVAL, "remote_timeout_ms must be in 1..600000, got %u",
                   o->remote_timeout_ms);
  if (o->remote_queue_size < 1)
    return KVT_ERR(KVT_EINVAL, "remote_queue_size must be >= 1, got %u",
                   o->remote_queue_size);
  if (o->remote_chunk_bytes < 4096 || o->remote_chunk_bytes > (512ull << 20))
    return KVT_ERR(KVT_EINVAL,
                   "remote_chunk_bytes must be in 4 KiB..512 MiB, "
                   "got %llu",
                   (unsigned long long)o->remote_chunk_bytes);
  if (o->remote_lookup_timeout_ms < 1 || o->remote_lookup_timeout_ms > 600000)
    return KVT_ERR(KVT_EINVAL,
                   "remote_lookup_timeout_ms must be in 1..600000, got %u",
                   o->remote_lookup_timeout_ms);
  int tls = o->remote_url && !strncmp(o->remote_url, "rediss://", 9);
  if (!tls && (o->remote_tls_ca_file || o->remote_tls_cert_file ||
               o->remote_tls_key_file))
    return KVT_ERR(KVT_EINVAL, "remote_tls_* files need a rediss:// "
                               "remote_url");
  if (!o->remote_tls_cert_file != !o->remote_tls_key_file)
    return KVT_ERR(KVT_EINVAL, "remote_tls_cert_file and remote_tls_key_file "
                               "go together");
  if (o->remote_flags & ~KVT_REMOTE_NO_LOCAL_COPY)
    return KVT_ERR(KVT_EINVAL, "remote_flags has unknown bits 0x%x",
                   o->remote_flags);
  return 0;
}

/* Admission and the write budget (see kvt_options). */
static int validate_admission(const kvt_options *o) {
  if (o->admission_policy < KVT_ADMIT_WRITE_ALL ||
      o->admission_policy > KVT_ADMIT_ADAPTIVE)
    return KVT_ERR(KVT_EINVAL,
                   "admission_policy must be KVT_ADMIT_WRITE_ALL, "
                   "KVT_ADMIT_SECOND_SIGHTING or KVT_ADMIT_ADAPTIVE, got %d",
                   o->admission_policy);
  if (o->admission_memory_bytes && (o->admission_memory_bytes < (64u << 10) ||
                                    o->admission_memory_bytes > (1ull << 30)))
    return KVT_ERR(KVT_EINVAL,
                   "admission_memory_bytes must be 0 (default) or in "
                   "64 KiB..1 GiB, got %llu",
                   (unsigned long long)o->admission_memory_bytes);
  if (o->write_budget_bytes_per_day > 1000000000000000000ull)
    return KVT_ERR(KVT_EINVAL,
                   "write_budget_bytes_per_day must be at most 10^18, got "
                   "%llu",
                   (unsigned long long)o->write_budget_bytes_per_day);
  double tbw = o->write_budget_tbw, years = o->write_budget_years;
  if (!isfinite(tbw) || tbw < 0 || tbw > 1e6)
    return KVT_ERR(KVT_EINVAL,
                   "write_budget_tbw must be 0 (none) or in (0, 10^6] "
                   "terabytes, got %g",
                   tbw);
  if (!isfinite(years) || years < 0 || years > 100)
    return KVT_ERR(KVT_EINVAL,
                   "write_budget_years must be 0 (none) or in (0, 100], got "
                   "%g",
                   years);
  if ((tbw > 0) != (years > 0))
    return KVT_ERR(KVT_EINVAL, "write_budget_tbw and write_budget_years go "
                               "together (the rating and the lifetime)");
  if (tbw > 0 && o->write_budget_bytes_per_day)
    return KVT_ERR(KVT_EINVAL,
                   "give write_budget_bytes_per_day or write_budget_tbw with "
                   "write_budget_years, not both");
  if (tbw > 0 && tbw * 1e12 / (years * 365.25) < 1)
    return KVT_ERR(KVT_EINVAL,
                   "write_budget_tbw / write_budget_years gives less than one "
                   "byte a day");
  return 0;
}

int kvt_options_validate(const kvt_options *opts) {
  kvt_options cur = KVT_OPTIONS_INIT; /* set by upgrade; init for -O3 */
  int rc = kvti_options_upgrade(&cur, opts);
  if (rc != 0)
    return rc;
  const kvt_options *o = &cur;
  /* Same wording as the reference's ValueErrors. */
  if (!(o->max_size_gb > 0) || !isfinite(o->max_size_gb))
    return KVT_ERR(KVT_EINVAL, "max_size_gb must be > 0, got %g",
                   o->max_size_gb);
  if (o->max_size_gb * 1073741824.0 > 9.0e18)
    return KVT_ERR(KVT_EINVAL, "max_size_gb is too large, got %g",
                   o->max_size_gb);
  if (o->max_entries < 1)
    return KVT_ERR(KVT_EINVAL, "max_entries must be >= 1, got %lld",
                   (long long)o->max_entries);
  if (o->spill_queue_size < 1)
    return KVT_ERR(KVT_EINVAL, "spill_queue_size must be >= 1, got %u",
                   o->spill_queue_size);
  if (o->retention_seconds < 0)
    return KVT_ERR(KVT_EINVAL,
                   "retention_seconds must be >= 0 (0 = no expiry), "
                   "got %lld",
                   (long long)o->retention_seconds);
  if (o->file_mode > 07777)
    return KVT_ERR(KVT_EINVAL,
                   "file_mode must be a permission mode <= 07777, "
                   "got %o",
                   o->file_mode);
  if (o->dir_mode > 07777 || (o->dir_mode & 0700) != 0700)
    return KVT_ERR(KVT_EINVAL,
                   "dir_mode must be <= 07777 and include 0700 "
                   "(owner rwx), got %o",
                   o->dir_mode);
  if ((o->file_mode & 0600) != 0600)
    return KVT_ERR(KVT_EINVAL, "file_mode must include 0600 (owner rw), got %o",
                   o->file_mode);
  if (o->storage_mode != KVT_STORAGE_NATIVE &&
      o->storage_mode != KVT_STORAGE_COMPAT)
    return KVT_ERR(KVT_EINVAL,
                   "storage_mode must be KVT_STORAGE_NATIVE or "
                   "KVT_STORAGE_COMPAT, got %d",
                   o->storage_mode);
  if (o->durability != KVT_DURABILITY_FSYNC &&
      o->durability != KVT_DURABILITY_NONE)
    return KVT_ERR(KVT_EINVAL,
                   "durability must be KVT_DURABILITY_FSYNC or "
                   "KVT_DURABILITY_NONE, got %d",
                   o->durability);
  if (o->io_backend < KVT_IO_AUTO || o->io_backend > KVT_IO_URING)
    return KVT_ERR(KVT_EINVAL,
                   "io_backend must be AUTO, PORTABLE or URING, got %d",
                   o->io_backend);
  if (o->promote_threads < 1 || o->promote_threads > 256)
    return KVT_ERR(KVT_EINVAL, "promote_threads must be in 1..256, got %u",
                   o->promote_threads);
  if (o->read_threads > KVTI_MAX_READ_THREADS)
    return KVT_ERR(KVT_EINVAL,
                   "read_threads must be in 0..%u (0 = default), got %u",
                   KVTI_MAX_READ_THREADS, o->read_threads);
  if (o->log_level < KVT_LOG_DEBUG || o->log_level > KVT_LOG_NONE)
    return KVT_ERR(KVT_EINVAL, "log_level must be in 0..4, got %d",
                   o->log_level);
  if (o->flags & ~(KVT_OPEN_READONLY | KVT_OPEN_NO_RECONCILE |
                   KVT_OPEN_SKIP_OWNER_CHECK | KVT_OPEN_REINDEX))
    return KVT_ERR(KVT_EINVAL, "flags has unknown bits 0x%x", o->flags);
  if (o->cache_dir && !o->cache_dir[0])
    return KVT_ERR(KVT_EINVAL, "cache_dir must not be empty (NULL = default)");
  if (o->chunk_tokens && (o->chunk_tokens < 16 || o->chunk_tokens > 4096 ||
                          (o->chunk_tokens & (o->chunk_tokens - 1))))
    return KVT_ERR(KVT_EINVAL,
                   "chunk_tokens must be 0 or a power of two in 16..4096, "
                   "got %u",
                   o->chunk_tokens);
  if (o->model_id && strlen(o->model_id) > 4000)
    return KVT_ERR(KVT_EINVAL, "model_id must be at most 4000 bytes");
  /* A model_id namespaces kvtier's own names; a compat directory holds the
   * reference's, which has none (one directory per model): refused rather
   * than silently shared with every other model_id. */
  if (o->model_id && o->model_id[0] && o->storage_mode == KVT_STORAGE_COMPAT)
    return KVT_ERR(KVT_EINVAL,
                   "model_id is not supported with storage_mode compat (the "
                   "reference's directory is its namespace: one per model)");
  int rrc = validate_remote(o);
  if (rrc == 0)
    rrc = validate_admission(o);
  if (rrc != 0)
    return rrc;
  if (!o->cache_dir && o->model_name && !valid_model_name(o->model_name))
    return KVT_ERR(KVT_EINVAL,
                   "model_name must be a single path component, got "
                   "'%s'",
                   o->model_name);
  return 0;
}

uint64_t kvti_options_max_bytes(const kvt_options *o) {
  /* int(max_size_gb * _BYTES_PER_GB), as the reference's max_size_bytes. */
  return (uint64_t)(o->max_size_gb * 1073741824.0);
}

int kvti_options_resolve_dir(char **out, const kvt_options *o) {
  if (o->cache_dir) {
    *out = kvti_strdup(o->cache_dir);
    return *out ? 0 : KVT_ENOMEM;
  }
  /* The reference's default place, under the user's cache directory. */
  return kvti_local_default_dir(out, o->model_name ? o->model_name : "default");
}
