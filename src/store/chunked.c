/*
 * chunked.c - the chunked native store over a storage backend (chunked.h):
 * spill = chain (chunks.c, only missing chunks written) + chained-entry record
 * + tail entry (backend put); read = tail entry (backend get, no on_layer) +
 * chain prefix (chunked_chain.c) joined in the caller's buffers
 * (chunkstore_entry.c), on_layer fired per layer once everything verified, with
 * record entries read by chunked_rec.c and trimmed reads reaching past the
 * chain by chunked_trim.c; prefix lookups and reads of pure chains; touches
 * along a chain.
 */
#include "store/local_layout.h"
#include "store/chunked.h"
#include "store/chunked_chain.h"
#include "store/chunked_rec.h"

#include "base/error.h"
#include "base/hash.h"
#include "base/io.h"
#include "format/layer.h"
#include "index/chain_walk.h"

#include <string.h>

struct kvti_chunked {
  kvti_chunkstore *cs;
  uint8_t *ns; /* the namespace of unsalted spills */
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

/* Fires on_layer for every layer in order (the read is complete). */
static void fire(const kvt_entry *e, const kvti_read_opts *o) {
  if (!o->on_layer)
    return;
  for (uint32_t i = 0; i < e->num_layers; i++)
    o->on_layer(o->layer_ctx, i, &e->layers[i]);
}

/* With o->ns_check and a salted name (a cache_salt or a model_id): the
 * chain recs[0] starts must be rooted in the namespace the entry was named
 * in (its first chunk's parent is that namespace's seed for the chain's
 * layout); the chunk keys, each checked against its parent and tokens, then
 * bind every chunk to it. A chain of another namespace is the entry's fault
 * (its files name it), never the chunks'. An unsalted name carries no
 * namespace to check against: directories written before model_id entered
 * the names root their chains in the directory's old model name and are
 * served as they are. */
static int root_ok(kvti_chunked *c, const kvti_read_opts *o,
                   const kvti_chain_rec *r0, const char *hash) {
  if (!o->ns_check || !o->salt.has)
    return 0;
  kvti_chunk_ns ns;
  uint8_t seed[32];
  int rc = kvti_chunked_ns_of(c, &o->salt, &ns);
  if (rc == 0)
    rc = kvti_chunk_seed(seed, ns.p, ns.len, r0->layout_hash);
  kvti_chunk_ns_free(&ns);
  if (rc == 0 && (r0->index != 0 || memcmp(seed, r0->parent, 32) != 0))
    rc = KVT_ERR(KVT_ECORRUPT,
                 "chained entry %.16s: its chain belongs to another namespace "
                 "(model_id or cache_salt)",
                 hash);
  return rc;
}

/* A tail entry (be->get, tail_ok) completed with the chain ce names. */
static int read_tail(kvti_chunked *c, kvti_backend *be, kvt_entry **out,
                     const char *hash, const kvti_chained_entry *cep,
                     const kvti_read_opts *o, uint8_t bad_chunk[32],
                     int *chunk_bad) {
  kvti_chained_entry ce = *cep;
  *out = NULL;
  kvti_read_opts o2 = *o;
  o2.on_layer = NULL;
  o2.chain_rows =
      ce.chunks * ce.chunk_tokens; /* the tail's offsets count them */
  o2.tail_ok = 1;                  /* completed with its chain below */
  kvti_chain_mark mark;
  mark.present = -1; /* left so by a backend that reads no manifest */
  o2.tail_mark = &mark;
  kvt_entry *e = NULL;
  int rc = be->ops->get(be, &e, hash, &o2);
  if (rc)
    return rc;
  if (mark.present == 1 && !kvti_chunked_mark_is(&mark, &ce)) {
    /* The row names another chain than the tail's own manifest (a crash
     * between a replacement's row and its publication, or a damaged row):
     * the caller retries with the manifest's chain, never with the row's. */
    kvt_entry_free(e);
    return KVT_ERR(KVT_ECORRUPT,
                   "chained entry %.16s: the row names another chain than "
                   "the tail's manifest",
                   hash);
  }
  if (ce.chunks == 0 || ce.chunks > e->n_tokens)
    rc = KVT_ERR(KVT_ECORRUPT, "chained entry %.16s: bad chain length", hash);
  kvti_chain_rec *recs =
      rc ? NULL : kvti_malloc((size_t)ce.chunks * sizeof *recs);
  size_t m = 0;
  if (rc == 0 && !recs)
    rc = KVT_ERR_NOMEM();
  /* The record names the chain exactly (its last chunk): walked up by
   * parent links, so the read needs neither this tier's namespace nor the
   * spill's salt (a tool opening the directory knows neither). The chunk
   * files' tokens are compared with the entry's below. */
  if (rc == 0 &&
      (rc = kvti_chains_path(kvti_chunkstore_chains(c->cs), ce.last_key,
                             (size_t)ce.chunks, recs)) == 0)
    m = (size_t)ce.chunks;
  if (rc == 0 && (recs[0].layout_hash != ce.layout_hash ||
                  recs[m - 1].n_tokens != ce.chunk_tokens ||
                  (uint64_t)m * ce.chunk_tokens > e->n_tokens))
    rc = KVT_ERR(KVT_ENOTFOUND,
                 "chained entry %.16s: chain incomplete "
                 "(evicted)",
                 hash);
  if (rc == 0)
    rc = root_ok(c, o, &recs[0], hash);
  kvti_chunk_read_opts ro = kvti_chunked_read_opts(o, ce.total_rows);
  kvti_chunk_prefix p;
  if (rc == 0) {
    rc = kvti_chunked_read_chain(c->cs, recs, m, e->tokens, &ro, &p, bad_chunk,
                                 chunk_bad);
  }
  if (rc == 0) {
    uint64_t read = p.bytes_read;
    rc = kvti_chunk_join(e, &p, (uint64_t)m * ce.chunk_tokens, &ro);
    e->disk_bytes += read;
  }
  kvti_free(recs);
  if (rc) {
    kvt_entry_free(e);
    return rc;
  }
  *out = e;
  return 0;
}

int kvti_chunked_record(kvti_chunked *c, const char *hash, kvti_chainrec *r) {
  return kvti_chainrec_read(r, c->data_dir, hash);
}

int kvti_chunked_get(kvti_chunked *c, kvti_backend *be, kvt_entry **out,
                     const char *hash, const kvti_read_opts *o,
                     uint8_t bad_chunk[32], int *chunk_bad) {
  if (chunk_bad)
    *chunk_bad = 0;
  uint8_t h[32];
  kvti_chained_entry ce;
  if (kvti_unhex32(h, hash) != 0)
    return be->ops->get(be, out, hash, o);
  /* A chain record (chunked_rec.h) is the entry's own file: it is read even
   * when the index lost the chained-entry row. */
  kvti_chainrec rec;
  int rrc = kvti_chainrec_read(&rec, c->data_dir, hash);
  if (rrc != 0 && rrc != KVT_ENOTFOUND)
    return rrc;
  int has_ce = kvti_chains_entry_get(kvti_chunkstore_chains(c->cs), h, &ce);
  if (rrc == 0) {
    memcpy(ce.hash, h, 32);
    ce.chunks = rec.chunks;
    ce.chunk_tokens = rec.chunk_tokens;
    memcpy(ce.last_key, rec.last_key, 32);
    ce.layout_hash = rec.layout_hash;
    ce.total_rows = rec.total_rows;
    has_ce = 1; /* the entry's own record rules over the row */
    if (!o->keep_tokens) {
      /* verify_only: everything read and verified into kvtier's own
       * buffers, then freed. */
      kvti_read_opts v = *o;
      if (o->verify_only) {
        v.verify_only = 0;
        v.alloc = NULL;
        v.free_buf = NULL;
        v.on_layer = NULL;
      }
      kvt_entry *e = NULL;
      int rc = kvti_chunked_rec_get(c->cs, &e, &rec, &v, bad_chunk, chunk_bad);
      kvti_chainrec_free(&rec);
      if (rc == 0 && o->verify_only) {
        kvt_entry_free(e);
        e = NULL;
      }
      if (out)
        *out = e;
      if (rc == 0 && e)
        fire(e, o);
      return rc;
    }
    kvti_chainrec_free(&rec);
  } else if (!has_ce)
    return be->ops->get(be, out, hash, o);
  return kvti_chunked_get_record(c, be, out, hash, &ce, o, bad_chunk,
                                 chunk_bad);
}

int kvti_chunked_get_record(kvti_chunked *c, kvti_backend *be, kvt_entry **out,
                            const char *hash, const kvti_chained_entry *cep,
                            const kvti_read_opts *o, uint8_t bad_chunk[32],
                            int *chunk_bad) {
  if (chunk_bad)
    *chunk_bad = 0;
  kvti_chained_entry ce = *cep; /* may be corrected from the tail */
  if (o->verify_only) {
    /* Everything read and verified into kvtier's own buffers, then freed. */
    kvti_read_opts v = *o;
    v.verify_only = 0;
    v.alloc = NULL;
    v.free_buf = NULL;
    v.on_layer = NULL;
    kvt_entry *tmp = NULL;
    int vrc = kvti_chunked_get_record(c, be, &tmp, hash, &ce, &v, bad_chunk,
                                      chunk_bad);
    kvt_entry_free(tmp);
    if (out)
      *out = NULL;
    return vrc;
  }
  if (o->keep_tokens && be->ops->probe) {
    /* The tail's own manifest rules over the row (which a tier without
     * chunks may have left behind, or damage changed): a trimmed read that
     * would take its rows from the chain alone checks it first. A record
     * entry has no manifest: its chain is the record's. */
    kvti_entry_probe_info pi;
    memset(&pi, 0, sizeof pi);
    if (be->ops->probe(be, hash, &pi) == 0) {
      if (pi.chain.present && !kvti_chunked_mark_is(&pi.chain, &ce)) {
        ce.chunks = pi.chain.chunks;
        ce.chunk_tokens = pi.chain.chunk_tokens;
        memcpy(ce.last_key, pi.chain.last_key, 32);
        ce.layout_hash = pi.chain.layout_hash;
        ce.total_rows = pi.chain.total_rows;
      }
      kvti_free(pi.tokens);
    }
  }
  if (o->keep_tokens) {
    /* Trimmed: served from the chain alone when the kept tokens lie within
     * it and the chain holds every layer (a trim needs every layer
     * trimmable anyway); else chain + tail (chunked_trim.c). */
    uint64_t rows = ce.chunks * ce.chunk_tokens;
    if (o->keep_tokens > rows || !o->tokens || o->n_tokens < o->keep_tokens)
      return kvti_chunked_get_trim(c->cs, be, out, hash, &ce, o, bad_chunk,
                                   chunk_bad);
    size_t k =
        (size_t)((o->keep_tokens + ce.chunk_tokens - 1) / ce.chunk_tokens);
    kvti_chain_rec *r = kvti_malloc(k * sizeof *r);
    size_t m = 0;
    kvti_chunk_ns ns;
    int trc = kvti_chunked_ns_of(c, &o->salt, &ns);
    if (trc == 0)
      trc = r ? kvti_chunkstore_lookup(c->cs, ns.p, ns.len, o->tokens,
                                       (size_t)(k * ce.chunk_tokens),
                                       ce.chunk_tokens, r, k, &m)
              : KVT_ERR_NOMEM();
    kvti_chunk_ns_free(&ns);
    if (trc == 0 && (m != k || r[0].layout_hash != ce.layout_hash))
      trc = KVT_ERR(KVT_ENOTFOUND, "chain incomplete (evicted)");
    if (trc == 0 && !r[0].pure) {
      kvti_free(r);
      return kvti_chunked_get_trim(c->cs, be, out, hash, &ce, o, bad_chunk,
                                   chunk_bad);
    }
    kvti_chunk_read_opts ro = kvti_chunked_read_opts(o, o->keep_tokens);
    kvti_chunk_prefix p;
    if (trc == 0)
      trc = kvti_chunked_read_chain(c->cs, r, m, o->tokens, &ro, &p, bad_chunk,
                                    chunk_bad);
    kvt_entry *e = NULL;
    if (trc == 0)
      trc = kvti_chunk_prefix_entry(&e, &p, o->tokens, o->keep_tokens, &ro);
    if (trc == 0 && o->salt.has) {
      e->salt = o->salt;
      trc = kvti_salt_hex(e->hash, &e->salt, e->tokens, e->n_tokens);
      if (trc) {
        kvt_entry_free(e);
        e = NULL;
      }
    }
    kvti_free(r);
    if (trc)
      return trc;
    fire(e, o);
    *out = e;
    return 0;
  }
  kvt_entry *e = NULL;
  int rc = read_tail(c, be, &e, hash, &ce, o, bad_chunk, chunk_bad);
  if (rc != 0 && rc != KVT_ENOMEM && rc != KVT_ECANCELED &&
      !(chunk_bad && *chunk_bad) && be->ops->probe) {
    /* The tail's own manifest names its chain (kvtier.chain). It differs
     * from the row when a crash (or a failed replacement) came between a new
     * version's chained-entry row and its publication: the files are the
     * acknowledged old version, read with the chain they name. */
    kvti_entry_probe_info pi;
    memset(&pi, 0, sizeof pi);
    if (rc == KVT_ECORRUPT && be->ops->probe(be, hash, &pi) == 0 &&
        !pi.chain.present) {
      /* Files that do not complete with the row's chain and carry no chain
       * mark: a whole entry under a stale row (a tier without chunks
       * published it and crashed before dropping the row). Read as one;
       * its own checks decide. (A tail fetched from a remote carries no
       * mark either, but it completes with its row.) */
      kvti_read_opts w = *o;
      w.on_layer = NULL;
      rc = be->ops->get(be, &e, hash, &w);
    } else if (pi.chain.present &&
               (pi.chain.chunks != ce.chunks ||
                pi.chain.chunk_tokens != ce.chunk_tokens ||
                memcmp(pi.chain.last_key, ce.last_key, 32) ||
                pi.chain.layout_hash != ce.layout_hash ||
                pi.chain.total_rows != ce.total_rows)) {
      ce.chunks = pi.chain.chunks;
      ce.chunk_tokens = pi.chain.chunk_tokens;
      memcpy(ce.last_key, pi.chain.last_key, 32);
      ce.layout_hash = pi.chain.layout_hash;
      ce.total_rows = pi.chain.total_rows;
      rc = read_tail(c, be, &e, hash, &ce, o, bad_chunk, chunk_bad);
    }
    kvti_free(pi.tokens);
  }
  if (rc)
    return rc;
  fire(e, o);
  *out = e;
  return 0;
}

/* The longest chain; *m chunks, only when pure. */
static int pure_chain(kvti_chunked *c, const kvti_salt *salt,
                      const int32_t *tokens, size_t n, kvti_chain_rec **recs,
                      size_t *m) {
  size_t max = n / c->C;
  *recs = NULL;
  *m = 0;
  if (max == 0)
    return 0;
  kvti_chain_rec *r = kvti_malloc(max * sizeof *r);
  if (!r)
    return KVT_ERR_NOMEM();
  kvti_chunk_ns ns;
  int rc = kvti_chunked_ns_of(c, salt, &ns);
  if (rc == 0)
    rc =
        kvti_chunkstore_lookup(c->cs, ns.p, ns.len, tokens, n, c->C, r, max, m);
  kvti_chunk_ns_free(&ns);
  if (rc || *m == 0 || !r[0].pure) {
    kvti_free(r);
    *m = 0;
    return rc;
  }
  *recs = r;
  return 0;
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
  return kvti_salt_hex(hash, salt, tokens, (size_t)*m);
}

int kvti_chunked_get_prefix(kvti_chunked *c, const kvti_salt *salt,
                            kvt_entry **out, const int32_t *tokens, uint64_t m,
                            const kvti_read_opts *o, uint8_t bad_chunk[32],
                            int *chunk_bad) {
  if (chunk_bad)
    *chunk_bad = 0;
  if (m == 0 || m % c->C)
    return KVT_ERR(KVT_EINVAL, "prefix of %llu tokens is not chunk aligned",
                   (unsigned long long)m);
  kvti_chain_rec *r;
  size_t k;
  int rc = pure_chain(c, salt, tokens, (size_t)m, &r, &k);
  if (rc)
    return rc;
  if ((uint64_t)k * c->C != m) {
    kvti_free(r);
    return KVT_ERR(KVT_ENOTFOUND, "no stored chain of %llu tokens",
                   (unsigned long long)m);
  }
  kvti_chunk_read_opts ro = kvti_chunked_read_opts(o, 0);
  kvti_chunk_prefix p;
  rc = kvti_chunked_read_chain(c->cs, r, k, tokens, &ro, &p, bad_chunk,
                               chunk_bad);
  kvti_free(r);
  kvt_entry *e = NULL;
  if (rc == 0)
    rc = kvti_chunk_prefix_entry(&e, &p, tokens, m, &ro);
  if (rc == 0 && salt && salt->has) {
    e->salt = *salt;
    if ((rc = kvti_salt_hex(e->hash, salt, tokens, (size_t)m)) != 0)
      kvt_entry_free(e);
  }
  if (rc)
    return rc;
  fire(e, o);
  *out = e;
  return 0;
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
