/*
 * chainrec.c - the chain record data/<hash>/chain.kvr (chainrec.h,
 * docs/FORMAT.md section 10): its byte layout (a fixed 136-byte part, the
 * namespace, the tokens, an XXH3-64 of everything before it), the strict
 * parser, its staging as an entry version (kvti_entry_stage writes it in
 * place of layer files, manifest and tokens.bin when the snapshot carries a
 * record; the entry publisher then exchanges it in) and the probe reconcile
 * adopts it with. One file and three fsyncs (file, staged
 * directory, data/) replace the 35 files of a tail entry that holds no rows.
 */
#include "format/chainrec.h"

#include "base/error.h"
#include "base/hash.h"
#include "base/io.h"
#include "base/strbuf.h"
#include "base/salt.h"
#include "engine/fwriter.h"
#include "engine/syncset.h"
#include "format/chunk.h"
#include "format/entry_int.h"
#include "format/layer.h"
#include "format/le.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static uint64_t pad4(uint64_t v) {
  return (v + 3) / 4 * 4;
}

uint64_t kvti_chainrec_size(size_t ns_len, uint64_t n_tokens) {
  return KVTI_CHAINREC_FIXED + pad4(ns_len) + 4 * n_tokens + 8;
}

#define BAD(...) KVT_ERR(KVT_ECORRUPT, __VA_ARGS__)

/* Encodes r into a kvti_malloc'ed buffer of exactly kvti_chainrec_size. */
static int encode(uint8_t **out, size_t *len, const kvti_chainrec *r) {
  if (r->n_tokens > KVTI_CHAINREC_MAX_TOKENS || r->ns_len > KVTI_CHUNK_MAX_NS ||
      (!r->tokens && r->n_tokens) || (!r->ns && r->ns_len) ||
      !kvti_chunk_tokens_ok(r->chunk_tokens) || r->chunks == 0 ||
      r->total_rows != r->chunks * r->chunk_tokens ||
      r->total_rows > r->n_tokens || r->num_layers == 0 ||
      r->num_layers > KVTI_MAX_LAYERS)
    return KVT_ERR(KVT_EINVAL, "chain record: invalid fields");
  size_t n = (size_t)kvti_chainrec_size(r->ns_len, r->n_tokens);
  uint8_t *b = kvti_calloc(1, n);
  if (!b)
    return KVT_ERR_NOMEM();
  memcpy(b, KVTI_CHAINREC_MAGIC, 8);
  kvti_le_put32(b + 8, KVTI_CHAINREC_VERSION);
  kvti_le_put32(b + 12, 0);
  memcpy(b + 16, r->hash, 32);
  memcpy(b + 48, r->last_key, 32);
  kvti_le_put64(b + 80, r->n_tokens);
  kvti_le_put64(b + 88, r->memory_bytes);
  kvti_le_put64(b + 96, r->chunks);
  kvti_le_put32(b + 104, r->chunk_tokens);
  kvti_le_put32(b + 108, r->num_layers);
  kvti_le_put64(b + 112, r->layout_hash);
  kvti_le_put64(b + 120, r->total_rows);
  kvti_le_put32(b + 128, (uint32_t)r->ns_len);
  kvti_le_put32(b + 132, 0);
  if (r->ns_len)
    memcpy(b + KVTI_CHAINREC_FIXED, r->ns, r->ns_len);
  uint8_t *tk = b + KVTI_CHAINREC_FIXED + pad4(r->ns_len);
  for (uint64_t i = 0; i < r->n_tokens; i++)
    kvti_le_put32(tk + 4 * i, (uint32_t)r->tokens[i]);
  kvti_le_put64(b + n - 8, kvti_xxh3(b, n - 8));
  *out = b;
  *len = n;
  return 0;
}

void kvti_chainrec_free(kvti_chainrec *r) {
  if (!r)
    return;
  kvti_free(r->mem_);
  memset(r, 0, sizeof *r);
}

/* The salt a record's name is keyed with, from its namespace encoding
 * (u32 len | model_id | u32 len | salt field): an empty salt field is no
 * salt (the name is SHA-256 of the tokens), otherwise it is the hex of the
 * salt's digest D (the name is SHA-256(D || tokens), base/salt.h). Anything
 * else is a damaged record. */
static int ns_salt(kvti_salt *out, const uint8_t *ns, size_t len,
                   const char *what) {
  memset(out, 0, sizeof *out);
  if (len == 0)
    return 0; /* no namespace at all: unsalted */
  if (len < 8)
    return BAD("%s: namespace of %zu bytes", what, len);
  uint32_t a = kvti_le_get32(ns);
  if (a > len - 8)
    return BAD("%s: namespace lengths inconsistent", what);
  uint32_t b = kvti_le_get32(ns + 4 + a);
  if ((size_t)a + b + 8 != len)
    return BAD("%s: namespace lengths inconsistent", what);
  if (b == 0)
    return 0;
  char hex[65];
  if (b != 64)
    return BAD("%s: namespace salt field of %u bytes", what, b);
  memcpy(hex, ns + 8 + a, 64);
  hex[64] = 0;
  if (kvti_unhex32(out->d, hex) != 0)
    return BAD("%s: namespace salt field is not a digest", what);
  out->has = 1;
  return 0;
}

int kvti_chainrec_parse(kvti_chainrec *r, const uint8_t *buf, size_t len,
                        const char *expect_hash, const char *what) {
  memset(r, 0, sizeof *r);
  if (len < KVTI_CHAINREC_FIXED + 8 || memcmp(buf, KVTI_CHAINREC_MAGIC, 8))
    return BAD("%s: not a chain record (bad magic or truncated)", what);
  uint32_t ver = kvti_le_get32(buf + 8);
  if (ver != KVTI_CHAINREC_VERSION)
    return KVT_ERR(KVT_EUNSUPPORTED, "%s: chain record version %u unsupported",
                   what, ver);
  if (kvti_le_get32(buf + 12) != 0 || kvti_le_get32(buf + 132) != 0)
    return BAD("%s: unknown flags", what);
  memcpy(r->hash, buf + 16, 32);
  memcpy(r->last_key, buf + 48, 32);
  r->n_tokens = kvti_le_get64(buf + 80);
  r->memory_bytes = kvti_le_get64(buf + 88);
  r->chunks = kvti_le_get64(buf + 96);
  r->chunk_tokens = kvti_le_get32(buf + 104);
  r->num_layers = kvti_le_get32(buf + 108);
  r->layout_hash = kvti_le_get64(buf + 112);
  r->total_rows = kvti_le_get64(buf + 120);
  r->ns_len = kvti_le_get32(buf + 128);
  if (r->n_tokens > KVTI_CHAINREC_MAX_TOKENS || r->ns_len > KVTI_CHUNK_MAX_NS)
    return BAD("%s: counts out of range", what);
  if (len != kvti_chainrec_size(r->ns_len, r->n_tokens))
    return BAD("%s: %zu bytes, the record announces %llu", what, len,
               (unsigned long long)kvti_chainrec_size(r->ns_len, r->n_tokens));
  if (kvti_le_get64(buf + len - 8) != kvti_xxh3(buf, len - 8))
    return BAD("%s: checksum mismatch", what);
  if (!kvti_chunk_tokens_ok(r->chunk_tokens) || r->chunks == 0 ||
      r->chunks > r->n_tokens || r->total_rows != r->chunks * r->chunk_tokens ||
      r->total_rows > r->n_tokens || r->num_layers == 0 ||
      r->num_layers > KVTI_MAX_LAYERS)
    return BAD("%s: chain fields inconsistent", what);
  size_t pos_tok = KVTI_CHAINREC_FIXED + (size_t)pad4(r->ns_len);
  for (size_t i = KVTI_CHAINREC_FIXED + r->ns_len; i < pos_tok; i++)
    if (buf[i])
      return BAD("%s: non-zero padding", what);
  uint8_t *m = kvti_malloc(r->ns_len + 4 * (size_t)r->n_tokens + 1);
  if (!m)
    return KVT_ERR_NOMEM();
  int32_t *tok = (int32_t *)m; /* first: aligned */
  for (uint64_t i = 0; i < r->n_tokens; i++)
    tok[i] = (int32_t)kvti_le_get32(buf + pos_tok + 4 * i);
  uint8_t *ns = m + 4 * (size_t)r->n_tokens;
  if (r->ns_len)
    memcpy(ns, buf + KVTI_CHAINREC_FIXED, r->ns_len);
  r->mem_ = m;
  r->tokens = tok;
  r->ns = ns;
  char hex[65], name[65];
  kvti_salt salt;
  int rc = ns_salt(&salt, ns, r->ns_len, what);
  if (rc == 0)
    rc = kvti_salt_hex(hex, &salt, tok, (size_t)r->n_tokens);
  kvti_hex32(name, r->hash);
  if (rc == 0 && strcmp(hex, name) != 0)
    rc = BAD("%s: tokens do not hash to the record's name", what);
  if (rc == 0 && expect_hash && strcmp(hex, expect_hash) != 0)
    rc = BAD("%s: record of another entry (%.16s)", what, hex);
  if (rc)
    kvti_chainrec_free(r);
  return rc;
}

static char *rec_path(const char *data_dir, const char *name) {
  return kvti_strfmt("%s/%s/%s", data_dir, name, KVTI_CHAINREC_FILE);
}

int kvti_snapshot_set_chainrec(kvti_snapshot *s, const kvti_chainrec *r) {
  if (!s || !r)
    return KVT_ERR(KVT_EINVAL, "chain record: NULL argument");
  char hash[65];
  kvti_hex32(hash, r->hash);
  if (strcmp(hash, s->hash) != 0)
    return KVT_ERR(KVT_EINVAL, "chain record of another entry");
  uint8_t *buf = NULL;
  size_t len = 0;
  int rc = encode(&buf, &len, r);
  if (rc)
    return rc;
  kvti_free(s->chainrec);
  s->chainrec = buf;
  s->chainrec_len = len;
  return 0;
}

/* kvti_chainrec_stage into a group commit's set: the record is a file of
 * the set's group and dir is listed with the set (synced by its rounds). */
static int stage_in_set(const char *file, const char *dir,
                        const kvti_snapshot *s, const kvti_write_opts *o) {
  kvti_wgroup *g = kvti_syncset_group(o->sync);
  if (!g)
    return KVT_ERR(KVT_EINVAL, "chain record: the set's files were synced");
  kvti_fwriter_opts fo = KVTI_FWRITER_OPTS_INIT;
  fo.hash = 0;
  fo.no_direct = 1; /* a few KiB */
  fo.excl = 1;
  fo.file_mode = o->file_mode;
  kvti_fwriter *w = NULL;
  int rc = kvti_wgroup_file(&w, g, file, &fo);
  if (rc == 0)
    rc = kvti_fwriter_append(w, s->chainrec, s->chainrec_len);
  if (rc == 0)
    rc = kvti_fwriter_close(w, NULL, NULL);
  if (rc == 0)
    rc = kvti_syncset_dir(o->sync, dir);
  return rc;
}

int kvti_chainrec_stage(uint64_t *disk, const char *dir, const kvti_snapshot *s,
                        const kvti_write_opts *o) {
  char *file = kvti_path_join(dir, KVTI_CHAINREC_FILE);
  if (!file)
    return KVT_ERR_NOMEM();
  if (o->sync) {
    int rc = stage_in_set(file, dir, s, o);
    kvti_free(file);
    if (rc == 0 && disk)
      *disk = s->chainrec_len;
    return rc;
  }
  int rc = 0,
      fd = kvti_open(file, O_WRONLY | O_CREAT | O_EXCL, (mode_t)o->file_mode);
  if (fd < 0)
    rc = fd;
  if (rc == 0 && kvti_io->chmod(file, (mode_t)o->file_mode) != 0)
    rc = KVT_ERR_OS(errno, "chmod %s", file);
  if (rc == 0)
    rc = kvti_pwrite_all(fd, s->chainrec, s->chainrec_len, 0, file);
  if (rc == 0 && o->do_fsync)
    rc = kvti_fsync(fd, file);
  if (fd >= 0) {
    int crc = kvti_close(fd);
    if (rc == 0)
      rc = crc;
  }
  if (rc == 0 && o->do_fsync)
    rc = kvti_fsync_dir(dir);
  kvti_free(file);
  if (rc == 0 && disk)
    *disk = s->chainrec_len;
  return rc;
}

int kvti_chainrec_present(const char *data_dir, const char *hash) {
  if (!kvti_is_hash_name(hash))
    return KVT_ERR(KVT_EINVAL, "invalid entry name");
  char *p = rec_path(data_dir, hash);
  if (!p)
    return KVT_ERR_NOMEM();
  struct stat st;
  int rc = 1;
  if (kvti_io->lstat(p, &st) != 0)
    rc = errno == ENOENT || errno == ENOTDIR ? 0
                                             : KVT_ERR_OS(errno, "stat %s", p);
  else if (!S_ISREG(st.st_mode))
    rc = 0;
  kvti_free(p);
  return rc;
}

static int read_file(kvti_chainrec *r, const char *path, const char *hash,
                     double *mtime) {
  /* Quiet: "no record here" is the common answer for entries with files. */
  int fd = kvti_open_quiet(path, O_RDONLY, 0);
  if (fd < 0) {
    int e = errno;
    if (e == ENOENT || e == ENOTDIR)
      return KVT_ENOTFOUND;
    return e == EINVAL ? BAD("%s: not a regular file", path)
                       : KVT_ERR_OS(e, "open %s", path);
  }
  struct stat st;
  char *buf = NULL;
  size_t len = 0;
  int rc = kvti_read_fd(
      &buf, &len, fd, path,
      (size_t)kvti_chainrec_size(KVTI_CHUNK_MAX_NS, KVTI_CHAINREC_MAX_TOKENS),
      &st);
  kvti_close(fd);
  if (rc == 0)
    rc = kvti_chainrec_parse(r, (const uint8_t *)buf, len, hash, path);
  if (rc == 0 && mtime)
    *mtime = (double)st.st_mtim.tv_sec + st.st_mtim.tv_nsec / 1e9;
  kvti_free(buf);
  return rc;
}

int kvti_chainrec_read(kvti_chainrec *r, const char *data_dir,
                       const char *hash) {
  memset(r, 0, sizeof *r);
  if (!kvti_is_hash_name(hash))
    return KVT_ERR(KVT_EINVAL, "invalid entry name");
  char *p = rec_path(data_dir, hash);
  if (!p)
    return KVT_ERR_NOMEM();
  int rc = read_file(r, p, hash, NULL);
  kvti_free(p);
  return rc;
}

int kvti_chainrec_probe(kvti_entry_probe_info *out, const char *data_dir,
                        const char *hash) {
  memset(out, 0, sizeof *out);
  if (!kvti_is_hash_name(hash))
    return KVT_ERR(KVT_EINVAL, "invalid entry name");
  char *p = rec_path(data_dir, hash);
  if (!p)
    return KVT_ERR_NOMEM();
  kvti_chainrec r;
  double mt = 0;
  int rc = read_file(&r, p, hash, &mt);
  kvti_free(p);
  if (rc)
    return rc;
  out->tokens = kvti_malloc(4 * (size_t)(r.n_tokens ? r.n_tokens : 1));
  if (!out->tokens) {
    kvti_chainrec_free(&r);
    return KVT_ERR_NOMEM();
  }
  memcpy(out->tokens, r.tokens, 4 * (size_t)r.n_tokens);
  out->n_tokens = (size_t)r.n_tokens;
  out->memory_bytes = r.memory_bytes;
  out->disk_bytes = kvti_chainrec_size(r.ns_len, r.n_tokens);
  out->storage_mode = KVT_STORAGE_NATIVE;
  out->mtime = mt;
  /* Keyed by the salt its namespace names (parse checked it does). */
  rc = ns_salt(&out->salt, r.ns, r.ns_len, hash);
  if (rc) {
    kvti_free(out->tokens);
    out->tokens = NULL;
    kvti_chainrec_free(&r);
    return rc;
  }
  /* Adopted like a tail: reconcile restores its chained-entry row from
   * this (tier/chunks.c kvti_tier_chunks_adopt). */
  out->chain.present = 1;
  out->chain.chunks = r.chunks;
  out->chain.chunk_tokens = r.chunk_tokens;
  memcpy(out->chain.last_key, r.last_key, 32);
  out->chain.layout_hash = r.layout_hash;
  out->chain.total_rows = r.total_rows;
  kvti_chainrec_free(&r);
  return 0;
}

int kvti_chainrec_describe(char **json, const char *data_dir,
                           const char *hash) {
  if (!json)
    return KVT_ERR(KVT_EINVAL, "describe: NULL out");
  *json = NULL;
  kvti_chainrec r;
  int rc = kvti_chainrec_read(&r, data_dir, hash);
  if (rc)
    return rc;
  /* Shaped like kvti_entry_describe's document: the layers live in the
   * chain's chunks (no layer files), the chain in "manifest"."kvtier"
   * like a tail's mark. */
  cJSON *d = cJSON_CreateObject();
  cJSON *man = d ? cJSON_AddObjectToObject(d, "manifest") : NULL;
  cJSON *kv = man ? cJSON_AddObjectToObject(man, "kvtier") : NULL;
  cJSON *ch = kv ? cJSON_AddObjectToObject(kv, "chain") : NULL;
  char key[65], lay[32];
  kvti_hex32(key, r.last_key);
  snprintf(lay, sizeof lay, "xxh3:%016llx", (unsigned long long)r.layout_hash);
  if (ch && cJSON_AddStringToObject(d, "token_hash", hash) &&
      cJSON_AddStringToObject(d, "storage_mode", "native") &&
      cJSON_AddBoolToObject(d, "checksums", 1) &&
      cJSON_AddNumberToObject(d, "num_layers", r.num_layers) &&
      cJSON_AddNumberToObject(d, "num_tokens", (double)r.n_tokens) &&
      cJSON_AddNumberToObject(d, "memory_bytes", (double)r.memory_bytes) &&
      cJSON_AddArrayToObject(d, "layers") &&
      cJSON_AddNumberToObject(
          d, "disk_bytes", (double)kvti_chainrec_size(r.ns_len, r.n_tokens)) &&
      cJSON_AddStringToObject(kv, "format", "chain-record") &&
      cJSON_AddStringToObject(kv, "file", KVTI_CHAINREC_FILE) &&
      cJSON_AddNumberToObject(ch, "chunks", (double)r.chunks) &&
      cJSON_AddNumberToObject(ch, "chunk_tokens", r.chunk_tokens) &&
      cJSON_AddStringToObject(ch, "last_key", key) &&
      cJSON_AddStringToObject(ch, "layout_hash", lay) &&
      cJSON_AddNumberToObject(ch, "total_rows", (double)r.total_rows)) {
    char *s = cJSON_PrintUnformatted(d);
    if (s) {
      *json = kvti_strdup(s);
      cJSON_free(s);
    }
  }
  cJSON_Delete(d);
  kvti_chainrec_free(&r);
  return *json ? 0 : KVT_ERR_NOMEM();
}
