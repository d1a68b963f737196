/*
 * chunked.c - the chunked native store over a storage backend (chunked.h):
 * the store object (its chunk store, namespace, chunk size, data/ for chain
 * records) and its accessors; spill = chain (chunkstore.c, only missing
 * chunks written) + chained-entry record + tail entry (backend put), in
 * steps the tier drives; what removal, capacity and lookups ask of it (the
 * chunk bytes, whether an entry is chained, its record dropped, the longest
 * pure chain over a prompt, touches along a chain). The reads are
 * chunked_read.c's, which calls this file and never the other way round.
 */
#include "index/chain_walk.h"
#include "store/local_layout.h"
#include "store/chunked.h"
#include "store/chunked_rec.h"

#include "base/error.h"
#include "base/hash.h"
#include "base/io.h"

#include <string.h>

struct kvti_chunked {
  kvti_chunkstore *cs;
  kvti_chunkstore_seam seam; /* cs behind the chunk-store seam */
  uint8_t *ns;               /* the namespace of unsalted spills */
  size_t ns_len;
  uint32_t C;
  char *model_id; /* for the namespaces of salted ones */
  char *data_dir; /* <cache_dir>/data: chain records (chunked_rec.h) */
};

int kvti_chunked_ns_of(const kvti_chunked *c, const kvti_salt *s,
                       kvti_chunk_ns *ns) {
  ns->own = NULL;
  ns->p = c->ns;
  ns->len = c->ns_len;
  if (!s || !s->has)
    return 0;
  char d[65];
  kvti_hex32(d, s->d);
  int rc = kvti_chunk_ns_encode(&ns->own, &ns->len, c->model_id, d);
  ns->p = ns->own;
  return rc;
}

void kvti_chunk_ns_free(kvti_chunk_ns *ns) {
  kvti_free(ns->own);
  ns->own = NULL;
}

int kvti_chunked_open(kvti_chunked **out, const char *cache_dir, kvt_index *idx,
                      uint32_t chunk_tokens, const char *model_id,
                      const kvti_chunkstore_opts *o) {
  *out = NULL;
  if (!kvti_chunk_tokens_ok(chunk_tokens))
    return KVT_ERR(KVT_EINVAL,
                   "chunk_tokens must be 0 or a power of two in [%u, %u], "
                   "got %u",
                   KVTI_CHUNK_TOKENS_MIN, KVTI_CHUNK_TOKENS_MAX, chunk_tokens);
  kvti_chunked *c = kvti_calloc(1, sizeof *c);
  if (!c)
    return KVT_ERR_NOMEM();
  c->C = chunk_tokens;
  c->model_id = kvti_strdup(model_id ? model_id : "");
  int rc = c->model_id
               ? kvti_chunk_ns_encode(&c->ns, &c->ns_len, model_id, NULL)
               : KVT_ERR_NOMEM();
  if (rc == 0)
    rc = kvti_chunkstore_open(&c->cs, cache_dir, idx, o);
  if (rc == 0)
    kvti_chunkstore_seam_init(&c->seam, c->cs);
  if (rc == 0 && !(c->data_dir = kvti_path_join(cache_dir, KVTI_LOCAL_DATA)))
    rc = KVT_ERR_NOMEM();
  if (rc) {
    kvti_chunked_close(c);
    return rc;
  }
  *out = c;
  return 0;
}

void kvti_chunked_close(kvti_chunked *c) {
  if (!c)
    return;
  kvti_chunkstore_close(c->cs);
  kvti_free(c->data_dir);
  kvti_free(c->ns);
  kvti_free(c->model_id);
  kvti_free(c);
}

kvti_chunkstore *kvti_chunked_store(kvti_chunked *c) {
  return c->cs;
}
kvti_chunk_backend *kvti_chunked_chunks(kvti_chunked *c) {
  return &c->seam.base;
}
uint32_t kvti_chunked_chunk_tokens(const kvti_chunked *c) {
  return c->C;
}
const uint8_t *kvti_chunked_ns(const kvti_chunked *c, size_t *len) {
  *len = c->ns_len;
  return c->ns;
}

uint64_t kvti_chunked_disk_bytes(kvti_chunked *c) {
  kvti_chains_totals t;
  kvti_chains_totals_get(kvti_chunkstore_chains(c->cs), &t);
  return t.disk_bytes;
}

int kvti_chunked_is_chained(kvti_chunked *c, const char *hash) {
  uint8_t h[32];
  return kvti_unhex32(h, hash) == 0 &&
         kvti_chains_entry_get(kvti_chunkstore_chains(c->cs), h, NULL);
}

void kvti_chunked_forget(kvti_chunked *c, const char *hash) {
  uint8_t h[32];
  if (kvti_unhex32(h, hash) == 0)
    kvti_chains_entry_del(kvti_chunkstore_chains(c->cs), h);
}

/* kvti_chunked_prepare (b NULL) and kvti_chunked_prepare_in. */
static int prepare(kvti_chunked *c, kvti_chunked_prep *p,
                   const kvti_snapshot *s, int with_record,
                   kvti_chunkstore_batch *b) {
  memset(p, 0, sizeof *p);
  uint32_t L;
  const kvt_layer *layers = kvti_snapshot_layers(s, &L);
  size_t n;
  const int32_t *tokens = kvti_snapshot_tokens(s, &n);
  p->n_tokens = n;
  if (kvti_unhex32(p->rec.hash, kvti_snapshot_hash(s)) != 0)
    return KVT_ERR(KVT_EINVAL, "chunked put: bad hash");
  kvti_chains *ch = kvti_chunkstore_chains(c->cs);
  p->had_old = kvti_chains_entry_get(ch, p->rec.hash, &p->old);
  kvti_chunk_split sp;
  int rc = kvti_chunk_split_make(&sp, layers, L, n, c->C);
  if (rc)
    return rc;
  if (sp.chunks == 0) { /* nothing to chunk: the entry is stored whole */
    kvti_chunk_split_free(&sp);
    return 0;
  }
  p->split = sp; /* the tail snapshot points into it */
  p->has_split = 1;
  kvti_chunk_ns ns;
  if ((rc = kvti_chunked_ns_of(c, kvti_snapshot_salt(s), &ns)) != 0)
    return rc;
  p->rec.chunk_tokens = c->C;
  p->rec.total_rows = sp.T;
  kvti_chunkstore_spill csp = {ns.p,   ns.len,
                               tokens, (size_t)sp.rows,
                               c->C,   layers,
                               sp.ids, sp.n_ids,
                               L,      with_record && !b ? &p->rec : NULL};
  kvti_chunkstore_result cr;
  if (b) { /* the rows and the record commit in prep_record */
    p->batch = b;
    rc = kvti_chunkstore_batch_put(b, &csp, &cr, &p->member);
  } else {
    rc = kvti_chunkstore_put(c->cs, &csp, &cr);
  }
  p->recorded = cr.recorded;
  p->res.chunk_bytes = cr.bytes_written;
  p->res.written = cr.written;
  p->res.chunks = cr.chunks;
  p->res.rewritten = cr.rewritten;
  if (rc == 0 && cr.chunks != sp.chunks)
    rc = KVT_ERR(KVT_EIO, "chunked put: %zu of %zu chunks stored", cr.chunks,
                 sp.chunks);
  if (rc == 0) {
    p->chained = 1;
    p->rec.chunks = sp.chunks;
    p->rec.chunk_tokens = c->C;
    memcpy(p->rec.last_key, cr.last_key, 32);
    p->rec.layout_hash = cr.layout_hash;
    p->rec.total_rows = sp.T;
    rc = kvti_snapshot_create(&p->tail, tokens, n, sp.tail, L,
                              kvti_snapshot_memory_bytes(s), 0, NULL, NULL);
    if (rc == 0) /* named like the spill it stands for */
      rc = kvti_snapshot_set_salt(p->tail, kvti_snapshot_salt(s));
    if (rc == 0) {
      /* The tail says what it is in its own files (rebuild, readers). */
      kvti_chain_mark mk = {1,   p->rec.chunks,      p->rec.chunk_tokens,
                            {0}, p->rec.layout_hash, p->rec.total_rows};
      memcpy(mk.last_key, p->rec.last_key, 32);
      kvti_snapshot_set_chain(p->tail, &mk);
    }
  }
  if (rc == 0 && p->chained && kvti_chunked_rec_ok(&sp, layers, L)) {
    /* Nothing left for a tail: the entry is staged as one chain record
     * (chunked_rec.h), not as a directory of empty layer files; the record
     * carries the chain as a tail's manifest mark does. */
    kvti_chainrec r = {.n_tokens = n,
                       .memory_bytes = kvti_snapshot_memory_bytes(s),
                       .chunks = sp.chunks,
                       .layout_hash = cr.layout_hash,
                       .total_rows = sp.T,
                       .chunk_tokens = c->C,
                       .num_layers = L,
                       /* the chain's own namespace (salted or not): the
                        * record's name is recomputed from it */
                       .ns = ns.p,
                       .ns_len = ns.len,
                       .tokens = tokens};
    memcpy(r.hash, p->rec.hash, 32);
    memcpy(r.last_key, cr.last_key, 32);
    rc = kvti_snapshot_set_chainrec(p->tail, &r);
  }
  kvti_chunk_ns_free(&ns);
  if (rc != 0 && p->recorded) {
    /* Nothing of this spill is published: the record goes back to what it
     * was (a failure here leaves the new record over the old version, which
     * fails verification: never a wrong state). */
    kvti_error_state es;
    kvti_error_state_capture(&es, rc);
    if (p->had_old)
      kvti_chains_entry_put(ch, &p->old);
    else
      kvti_chains_entry_del(ch, p->rec.hash);
    kvti_error_state_restore(&es);
    p->recorded = 0;
  }
  return rc;
}

int kvti_chunked_prepare(kvti_chunked *c, kvti_chunked_prep *p,
                         const kvti_snapshot *s, int with_record) {
  return prepare(c, p, s, with_record, NULL);
}

int kvti_chunked_prepare_in(kvti_chunked *c, kvti_chunked_prep *p,
                            const kvti_snapshot *s, kvti_chunkstore_batch *b) {
  if (!b)
    return KVT_ERR(KVT_EINVAL, "chunked prepare: no batch");
  return prepare(c, p, s, 1, b);
}

const kvti_snapshot *kvti_chunked_prep_snapshot(const kvti_chunked_prep *p,
                                                const kvti_snapshot *s) {
  return p->tail ? p->tail : s;
}

int kvti_chunked_prep_record(kvti_chunked *c, kvti_chunked_prep *p) {
  if (!p->chained || p->recorded)
    return 0;
  if (p->batch) /* the chunk rows first become visible here, with it */
    return kvti_chunkstore_batch_index(p->batch, p->member, &p->rec,
                                       &p->recorded);
  /* Before the tail is published: a tail is never visible without it. */
  return kvti_chains_entry_put_ex(kvti_chunkstore_chains(c->cs), &p->rec, 0);
}

void kvti_chunked_prep_commit(kvti_chunked *c, kvti_chunked_prep *p) {
  kvti_chains *ch = kvti_chunkstore_chains(c->cs);
  if (p->chained) { /* the chain is as recent as its newest entry */
    kvti_chains_touch(ch, p->rec.last_key);
    kvti_chains_set_class(ch, p->rec.last_key, kvti_len_class(p->n_tokens));
  } else if (p->had_old)
    /* A chained version replaced by a whole one loses its record only once
     * the whole one is committed (a crash in between leaves record + whole
     * entry, which fails verification: never a wrong state). */
    kvti_chains_entry_del(ch, p->rec.hash);
}

void kvti_chunked_prep_undo(kvti_chunked *c, kvti_chunked_prep *p) {
  if (!p->chained)
    return; /* the record (if any) was never changed */
  kvti_chains *ch = kvti_chunkstore_chains(c->cs);
  /* The old version stays served: its record as it was. A failure here
   * leaves the new record over the old tail, which fails verification (never
   * a wrong state). */
  if (p->had_old)
    kvti_chains_entry_put(ch, &p->old);
  else
    kvti_chains_entry_del(ch, p->rec.hash);
}

void kvti_chunked_prep_free(kvti_chunked_prep *p) {
  kvti_snapshot_free(p->tail);
  p->tail = NULL;
  if (p->has_split)
    kvti_chunk_split_free(&p->split);
  p->has_split = 0;
}

int kvti_chunked_put(kvti_chunked *c, kvti_backend *be,
                     kvti_chunked_put_result *res, const kvti_snapshot *s,
                     const kvti_write_opts *wo) {
  kvti_chunked_prep p;
  int rc = kvti_chunked_prepare(c, &p, s, 1);
  if (rc == 0)
    rc = kvti_chunked_prep_record(c, &p);
  if (rc == 0) {
    rc = be->ops->put(be, &p.res.entry_bytes, kvti_chunked_prep_snapshot(&p, s),
                      wo);
    if (rc == 0)
      kvti_chunked_prep_commit(c, &p);
    else
      kvti_chunked_prep_undo(c, &p); /* nothing published: record back */
  }
  *res = p.res;
  kvti_chunked_prep_free(&p);
  return rc;
}

int kvti_chunked_record(kvti_chunked *c, const char *hash, kvti_chainrec *r) {
  return kvti_chainrec_read(r, c->data_dir, hash);
}

int kvti_chunked_adopt_record(kvti_chunked *c, const kvti_chained_entry *ce) {
  return kvti_chains_entry_put(kvti_chunkstore_chains(c->cs), ce);
}

/* The longest chain; *m chunks, only when pure. */
static int pure_chain(kvti_chunked *c, const kvti_salt *salt,
                      const int32_t *tokens, size_t n, kvti_chain_rec **recs,
                      size_t *m) {
  *recs = NULL;
  *m = 0;
  kvti_chunk_ns ns;
  int rc = kvti_chunked_ns_of(c, salt, &ns);
  if (rc == 0)
    rc = kvti_chunk_backend_pure(&c->seam.base, ns.p, ns.len, tokens, n, c->C,
                                 recs, m);
  kvti_chunk_ns_free(&ns);
  return rc;
}

int kvti_chunked_lookup_prefix(kvti_chunked *c, const kvti_salt *salt,
                               const int32_t *tokens, size_t n, uint64_t *m,
                               uint64_t *mem, char hash[65]) {
  kvti_chain_rec *r;
  size_t k;
  *m = 0;
  *mem = 0;
  int rc = pure_chain(c, salt, tokens, n, &r, &k);
  if (rc || k == 0)
    return rc;
  *m = (uint64_t)k * c->C;
  *mem = kvti_chunk_prefix_bytes(r, k);
  kvti_free(r);
  return hash ? kvti_salt_hex(hash, salt, tokens, (size_t)*m) : 0;
}

int kvti_chunked_touch(kvti_chunked *c, const kvti_salt *salt,
                       const int32_t *tokens, size_t n) {
  size_t max = n / c->C;
  if (max == 0)
    return KVT_ENOTFOUND;
  kvti_chain_rec *r = kvti_malloc(max * sizeof *r);
  if (!r)
    return KVT_ERR_NOMEM();
  size_t m = 0;
  kvti_chunk_ns ns;
  int rc = kvti_chunked_ns_of(c, salt, &ns);
  if (rc == 0)
    rc = kvti_chunkstore_lookup(c->cs, ns.p, ns.len, tokens, n, c->C, r, max,
                                &m);
  kvti_chunk_ns_free(&ns);
  if (rc == 0)
    rc = m ? kvti_chains_touch(kvti_chunkstore_chains(c->cs), r[m - 1].key)
           : KVT_ENOTFOUND;
  kvti_free(r);
  return rc;
}

int kvti_chunked_prefix_chain(kvti_chunked *c, const kvti_salt *salt,
                              const int32_t *tokens, uint64_t m,
                              kvti_chain_rec **recs, size_t *k) {
  *recs = NULL;
  *k = 0;
  if (m == 0 || m % c->C)
    return KVT_ERR(KVT_ENOTFOUND, "prefix of %llu tokens is not chunk aligned",
                   (unsigned long long)m);
  int rc = pure_chain(c, salt, tokens, (size_t)m, recs, k);
  if (rc == 0 && (uint64_t)*k * c->C != m) {
    kvti_free(*recs);
    *recs = NULL;
    *k = 0;
    rc = KVT_ERR(KVT_ENOTFOUND, "no stored chain of %llu tokens",
                 (unsigned long long)m);
  }
  return rc;
}
