/*
 * chunked_read.c - the reads of the chunked native store (chunked.h): an
 * entry read back as its tail entry (backend get, no on_layer) completed with
 * its chain prefix (chunked_chain.c) in the caller's buffers
 * (chunkstore_entry.c), on_layer fired per layer once everything verified;
 * record entries read by chunked_rec.c, trimmed reads reaching past the chain
 * by chunked_trim.c; a pure chain's prefix read as an entry of its own; the
 * chain a read of an entry is served from, resolved for the host RAM tier. It
 * reaches the store object only through chunked.c's accessors, so chunked.c
 * (the spill side and the bookkeeping a removal or a lookup needs) never
 * depends on the read path.
 */
#include "store/chunked.h"
#include "store/chunked_chain.h"
#include "store/chunked_rec.h"
#include "store/local.h"

#include "base/error.h"
#include "base/hash.h"
#include "base/io.h"
#include "index/chain_walk.h"

#include <string.h>

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
  kvti_chain_mark mark;
  kvt_entry *e = NULL;
  int rc = kvti_chunked_get_tail(be, &e, hash, o, ce.chunks * ce.chunk_tokens,
                                 &mark);
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
      (rc = kvti_chains_path(kvti_chunkstore_chains(kvti_chunked_store(c)),
                             ce.last_key, (size_t)ce.chunks, recs)) == 0)
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
    rc = kvti_chunked_read_chain(kvti_chunked_store(c), recs, m, e->tokens, &ro,
                                 &p, bad_chunk, chunk_bad);
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

/* kvti_chunked_entry_chain of a chained entry; out zeroed by the caller. */
static int entry_chain(kvti_chunked *c, const char *hash, const int32_t *tokens,
                       size_t n, kvti_chunked_chain *out) {
  uint8_t hb[32];
  kvti_chained_entry ce;
  if (kvti_unhex32(hb, hash) != 0)
    return 0; /* not a name the chunked store gives: stored whole */
  kvti_chainrec rec;
  int rc = kvti_chunked_record(c, hash, &rec);
  if (rc == 0) {
    kvti_chunked_rec_row(&ce, &rec); /* its hash is hb: named by it */
    out->rec.is_record = 1;
    out->rec.rows = rec.total_rows;
    out->rec.layers = rec.num_layers;
    out->rec.tokens_match =
        tokens && rec.n_tokens == n &&
        (n == 0 || memcmp(rec.tokens, tokens, n * sizeof *tokens) == 0);
    kvti_chainrec_free(&rec);
  } else if (rc != KVT_ENOTFOUND) {
    return rc;
  } else {
    kvt_clear_error();
    if (!kvti_chains_entry_get(kvti_chunkstore_chains(kvti_chunked_store(c)),
                               hb, &ce))
      return 0; /* stored whole */
  }
  if (ce.chunks == 0 || (uint64_t)ce.chunks * ce.chunk_tokens > n)
    return KVT_ERR(KVT_ECORRUPT, "chained entry %.16s: bad record", hash);
  out->recs = kvti_malloc((size_t)ce.chunks * sizeof *out->recs);
  if (!out->recs)
    return KVT_ERR_NOMEM();
  out->m = (size_t)ce.chunks;
  rc = kvti_chains_path(kvti_chunkstore_chains(kvti_chunked_store(c)),
                        ce.last_key, out->m, out->recs);
  if (rc == 0 && out->recs[0].layout_hash != ce.layout_hash)
    rc = KVT_ERR(KVT_ENOTFOUND, "chained entry %.16s: chain replaced", hash);
  return rc;
}

int kvti_chunked_entry_chain(kvti_chunked *c, const char *hash,
                             const int32_t *tokens, size_t n,
                             kvti_chunked_chain *out) {
  memset(out, 0, sizeof *out);
  int rc = entry_chain(c, hash, tokens, n, out);
  if (rc != 0) {
    kvti_free(out->recs);
    memset(out, 0, sizeof *out);
  }
  return rc;
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
  int rrc = kvti_chunked_record(c, hash, &rec);
  if (rrc != 0 && rrc != KVT_ENOTFOUND)
    return rrc;
  int has_ce = kvti_chains_entry_get(
      kvti_chunkstore_chains(kvti_chunked_store(c)), h, &ce);
  if (rrc == 0) {
    kvti_chunked_rec_row(&ce, &rec); /* its hash is h: named by it */
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
      int rc = kvti_chunked_rec_get(kvti_chunked_store(c), &e, &rec, &v,
                                    bad_chunk, chunk_bad);
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
  if (o->keep_tokens && kvti_backend_is_local(be)) {
    /* The tail's own manifest rules over the row (which a tier without
     * chunks may have left behind, or damage changed): a trimmed read that
     * would take its rows from the chain alone checks it first. A record
     * entry has no manifest: its chain is the record's. */
    kvti_entry_probe_info pi;
    memset(&pi, 0, sizeof pi);
    if (kvti_backend_local_probe(be, hash, &pi) == 0) {
      if (pi.chain.present && !kvti_chunked_mark_is(&pi.chain, &ce))
        kvti_chunked_mark_row(&ce, &pi.chain);
      kvti_free(pi.tokens);
    }
  }
  if (o->keep_tokens) {
    /* Trimmed: served from the chain alone when the kept tokens lie within
     * it and the chain holds every layer (a trim needs every layer
     * trimmable anyway); else chain + tail (chunked_trim.c). */
    uint64_t rows = ce.chunks * ce.chunk_tokens;
    if (o->keep_tokens > rows || !o->tokens || o->n_tokens < o->keep_tokens)
      return kvti_chunked_get_trim(kvti_chunked_store(c), be, out, hash, &ce, o,
                                   bad_chunk, chunk_bad);
    size_t k =
        (size_t)((o->keep_tokens + ce.chunk_tokens - 1) / ce.chunk_tokens);
    kvti_chain_rec *r = kvti_malloc(k * sizeof *r);
    size_t m = 0;
    kvti_chunk_ns ns;
    int trc = kvti_chunked_ns_of(c, &o->salt, &ns);
    if (trc == 0)
      trc = r ? kvti_chunkstore_lookup(kvti_chunked_store(c), ns.p, ns.len,
                                       o->tokens, (size_t)(k * ce.chunk_tokens),
                                       ce.chunk_tokens, r, k, &m)
              : KVT_ERR_NOMEM();
    kvti_chunk_ns_free(&ns);
    if (trc == 0 && (m != k || r[0].layout_hash != ce.layout_hash))
      trc = KVT_ERR(KVT_ENOTFOUND, "chain incomplete (evicted)");
    if (trc == 0 && !r[0].pure) {
      kvti_free(r);
      return kvti_chunked_get_trim(kvti_chunked_store(c), be, out, hash, &ce, o,
                                   bad_chunk, chunk_bad);
    }
    kvti_chunk_read_opts ro = kvti_chunked_read_opts(o, o->keep_tokens);
    kvti_chunk_prefix p;
    if (trc == 0)
      trc = kvti_chunked_read_chain(kvti_chunked_store(c), r, m, o->tokens, &ro,
                                    &p, bad_chunk, chunk_bad);
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
      !(chunk_bad && *chunk_bad) && kvti_backend_is_local(be)) {
    /* The tail's own manifest names its chain (kvtier.chain). It differs
     * from the row when a crash (or a failed replacement) came between a new
     * version's chained-entry row and its publication: the files are the
     * acknowledged old version, read with the chain they name. */
    kvti_entry_probe_info pi;
    memset(&pi, 0, sizeof pi);
    if (rc == KVT_ECORRUPT && kvti_backend_local_probe(be, hash, &pi) == 0 &&
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
      kvti_chunked_mark_row(&ce, &pi.chain);
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

int kvti_chunked_get_prefix(kvti_chunked *c, const kvti_salt *salt,
                            kvt_entry **out, const int32_t *tokens, uint64_t m,
                            const kvti_read_opts *o, uint8_t bad_chunk[32],
                            int *chunk_bad) {
  if (chunk_bad)
    *chunk_bad = 0;
  if (m == 0 || m % kvti_chunked_chunk_tokens(c))
    return KVT_ERR(KVT_EINVAL, "prefix of %llu tokens is not chunk aligned",
                   (unsigned long long)m);
  kvti_chain_rec *r;
  size_t k;
  int rc = kvti_chunked_prefix_chain(c, salt, tokens, m, &r, &k);
  if (rc)
    return rc;
  kvti_chunk_read_opts ro = kvti_chunked_read_opts(o, 0);
  kvti_chunk_prefix p;
  rc = kvti_chunked_read_chain(kvti_chunked_store(c), r, k, tokens, &ro, &p,
                               bad_chunk, chunk_bad);
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
