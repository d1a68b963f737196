/*
 * chain_db.c - the SQL half of the chain table (chain.h): tables
 * kvtier_chunks and kvtier_chained_entries in index.db, open and load (rows
 * checked, parents resolved, unreachable rows dropped), inserts of chains,
 * subtree removal, chained-entry records and the batched write of touches.
 * It shares the index's SQLite connection and db_mu (so its transactions
 * never interleave with the index's own); the mirror (chain_mirror.c) is
 * changed only after a commit succeeded, under the table's own rwlock.
 */
#include "index/chain_int.h"

#include "base/clock.h"
#include "base/error.h"
#include "base/io.h"
#include "base/vec.h"
#include "format/chunk.h"

#include <pthread.h>
#include <sqlite3.h>
#include <string.h>

static const char CHUNKS_SQL[] =
    "CREATE TABLE IF NOT EXISTS kvtier_chunks (chunk_key BLOB PRIMARY KEY, "
    "parent_key BLOB NOT NULL, chunk_index INTEGER NOT NULL, num_tokens "
    "INTEGER NOT NULL, layout_hash INTEGER NOT NULL, ck_lo INTEGER NOT NULL, "
    "ck_hi INTEGER NOT NULL, disk_bytes INTEGER NOT NULL, memory_bytes "
    "INTEGER NOT NULL, created_at REAL NOT NULL, accessed_at REAL NOT NULL, "
    "pure INTEGER NOT NULL)";
static const char INS_SQL[] =
    "INSERT OR IGNORE INTO kvtier_chunks (chunk_key, parent_key, chunk_index, "
    "num_tokens, layout_hash, ck_lo, ck_hi, disk_bytes, memory_bytes, "
    "created_at, accessed_at, pure) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)";
static const char DEL_SQL[] = "DELETE FROM kvtier_chunks WHERE chunk_key = ?";
static const char UPD_SQL[] =
    "UPDATE kvtier_chunks SET accessed_at = ? WHERE chunk_key = ?";
static const char ENT_SQL[] =
    "CREATE TABLE IF NOT EXISTS kvtier_chained_entries (token_hash BLOB "
    "PRIMARY KEY, chunks INTEGER NOT NULL, chunk_tokens INTEGER NOT NULL, "
    "last_key BLOB NOT NULL, layout_hash INTEGER NOT NULL, total_rows "
    "INTEGER NOT NULL)";
static const char EPUT_SQL[] =
    "INSERT OR REPLACE INTO kvtier_chained_entries (token_hash, chunks, "
    "chunk_tokens, last_key, layout_hash, total_rows) VALUES (?,?,?,?,?,?)";
static const char EDEL_SQL[] =
    "DELETE FROM kvtier_chained_entries WHERE token_hash = ?";
static const char ELOAD_SQL[] = "SELECT token_hash, chunks, chunk_tokens, "
                                "last_key, layout_hash, total_rows FROM "
                                "kvtier_chained_entries";
static const char LOAD_SQL[] =
    "SELECT chunk_key, parent_key, chunk_index, num_tokens, layout_hash, "
    "ck_lo, ck_hi, disk_bytes, memory_bytes, created_at, accessed_at, pure "
    "FROM kvtier_chunks";

/* ---- SQL ---- */

/* Keys are stored as 32-byte blobs (half the size of hex, no parsing at
 * open). buf is unused (kept so callers own no lifetime question). */
static int bind_key(sqlite3_stmt *s, int col, const uint8_t k[32],
                    char buf[65]) {
  (void)buf;
  return sqlite3_bind_blob(s, col, k, 32, SQLITE_STATIC);
}

static int run(kvti_chains *c, sqlite3_stmt *s, const char *what) {
  int rc = sqlite3_step(s);
  int ret = rc == SQLITE_DONE ? 0 : kvti_idx_db_err(c->idx, rc, what);
  sqlite3_reset(s);
  sqlite3_clear_bindings(s);
  return ret;
}

static int begin(kvti_chains *c) {
  return kvti_idx_step(c->idx, ST_BEGIN, "begin (chains)");
}
static int commit(kvti_chains *c) {
  int rc = kvti_idx_step(c->idx, ST_COMMIT, "commit (chains)");
  if (rc)
    kvti_idx_rollback(c->idx);
  return rc;
}

/* Writes pending touches. Caller holds db_mu. */
static int flush_locked(kvti_chains *c) {
  if (c->idx->readonly)
    return 0;
  pthread_rwlock_wrlock(&c->rw);
  size_t n = c->ndirty;
  uint32_t *ids = c->dirty;
  struct {
    uint8_t key[32];
    double t;
  } *w = n ? kvti_malloc(n * sizeof *w) : NULL;
  size_t m = 0;
  for (size_t i = 0; w && i < n; i++) {
    node *x = &c->nodes[ids[i]];
    if (x->live && x->dirty) {
      memcpy(w[m].key, x->r.key, 32);
      w[m++].t = x->r.accessed_at;
    }
    x->dirty = 0;
  }
  if (w || !n)
    c->ndirty = 0;
  pthread_rwlock_unlock(&c->rw);
  if (n && !w)
    return KVT_ERR_NOMEM();
  int rc = m ? begin(c) : 0;
  for (size_t i = 0; rc == 0 && i < m; i++) {
    char h[65];
    sqlite3_bind_double(c->upd, 1, w[i].t);
    bind_key(c->upd, 2, w[i].key, h);
    rc = run(c, c->upd, "update kvtier_chunks");
  }
  if (m && rc == 0)
    rc = commit(c);
  else if (m)
    kvti_idx_rollback(c->idx);
  kvti_free(w);
  return rc;
}

int kvti_chains_flush(kvti_chains *c) {
  pthread_mutex_lock(&c->idx->db_mu);
  int rc = flush_locked(c);
  pthread_mutex_unlock(&c->idx->db_mu);
  return rc;
}

static int table_present(kvti_chains *c, int *present) {
  sqlite3_stmt *s = NULL;
  int rc = sqlite3_prepare_v2(
      c->idx->db,
      "SELECT 1 FROM sqlite_master WHERE type='table' AND name='kvtier_chunks'",
      -1, &s, NULL);
  if (rc != SQLITE_OK)
    return kvti_idx_db_err(c->idx, rc, "kvtier_chunks lookup");
  rc = sqlite3_step(s);
  *present = rc == SQLITE_ROW;
  int ret = rc == SQLITE_ROW || rc == SQLITE_DONE
                ? 0
                : kvti_idx_db_err(c->idx, rc, "kvtier_chunks lookup");
  sqlite3_finalize(s);
  return ret;
}

static int row_u64(sqlite3_stmt *s, int col, uint64_t *out) {
  if (sqlite3_column_type(s, col) != SQLITE_INTEGER)
    return -1;
  *out = (uint64_t)sqlite3_column_int64(s, col);
  return 0;
}

static int push_orph(uint8_t (**orph)[32], size_t *norph, size_t *cap,
                     const uint8_t key[32]) {
  int rc = KVTI_VEC_RESERVE(orph, cap, *norph + 1, 16);
  if (rc)
    return rc;
  memcpy((*orph)[(*norph)++], key, 32);
  return 0;
}

/* Loads the table: rows in storage order (no sort), then parents resolved by
 * key, then reachability from a chain's first chunk. Unreachable rows (parent
 * missing, wrong index or layout) are collected in *orph and left out. */
static int load(kvti_chains *c, uint8_t (**orph)[32], size_t *norph) {
  sqlite3_stmt *s = NULL;
  int rc = sqlite3_prepare_v2(c->idx->db, "SELECT COUNT(*) FROM kvtier_chunks",
                              -1, &s, NULL);
  if (rc != SQLITE_OK)
    return kvti_idx_db_err(c->idx, rc, "count kvtier_chunks");
  uint64_t total =
      sqlite3_step(s) == SQLITE_ROW ? (uint64_t)sqlite3_column_int64(s, 0) : 0;
  sqlite3_finalize(s);
  int ret =
      kvti_chain_reserve_nodes(c, (size_t)(total < UINT32_MAX ? total : 0));
  if (ret)
    return ret;
  if ((rc = sqlite3_prepare_v2(c->idx->db, LOAD_SQL, -1, &s, NULL)) !=
      SQLITE_OK)
    return kvti_idx_db_err(c->idx, rc, "load kvtier_chunks");
  size_t cap = 0;
  while ((rc = sqlite3_step(s)) == SQLITE_ROW) {
    kvti_chain_rec r;
    memset(&r, 0, sizeof r);
    uint64_t idxv, nt, ck_lo, ck_hi, lay, disk, mem, pure;
    if (sqlite3_column_type(s, 0) != SQLITE_BLOB ||
        sqlite3_column_bytes(s, 0) != 32 ||
        sqlite3_column_type(s, 1) != SQLITE_BLOB ||
        sqlite3_column_bytes(s, 1) != 32 || row_u64(s, 2, &idxv) ||
        row_u64(s, 3, &nt) || row_u64(s, 4, &lay) || row_u64(s, 5, &ck_lo) ||
        row_u64(s, 6, &ck_hi) || row_u64(s, 7, &disk) || row_u64(s, 8, &mem) ||
        row_u64(s, 11, &pure) || pure > 1 || nt == 0 ||
        nt > KVTI_CHUNK_MAX_TOKENS || disk > INT64_MAX || mem > INT64_MAX ||
        !kvti_idx_num_ok(s, 9) || !kvti_idx_num_ok(s, 10)) {
      c->idx->skipped++;
      continue; /* a damaged row: never served (files are checked anyway) */
    }
    memcpy(r.key, sqlite3_column_blob(s, 0), 32);
    memcpy(r.parent, sqlite3_column_blob(s, 1), 32);
    r.index = idxv;
    r.n_tokens = (uint32_t)nt;
    r.layout_hash = lay;
    r.pure = (uint8_t)pure;
    r.ck = (kvti_ck){ck_lo, ck_hi};
    r.disk_bytes = disk;
    r.mem_bytes = mem;
    r.created_at = sqlite3_column_double(s, 9);
    r.accessed_at = sqlite3_column_double(s, 10);
    /* Keys are the table's primary key: no duplicates to check for. */
    if ((ret = kvti_chain_reserve_nodes(c, 1)) != 0)
      break;
    kvti_chain_add_node(c, &r, 0);
  }
  if (ret == 0 && rc != SQLITE_DONE)
    ret = kvti_idx_db_err(c->idx, rc, "load kvtier_chunks");
  sqlite3_finalize(s);
  if (ret)
    return ret;
  /* Parents. */
  for (uint32_t i = 0; i < c->n; i++) {
    node *x = &c->nodes[i];
    if (!x->live || x->r.index == 0)
      continue;
    uint32_t p = kvti_chain_find_key(c, x->r.parent);
    if (p && c->nodes[p - 1].r.index == x->r.index - 1 &&
        c->nodes[p - 1].r.layout_hash == x->r.layout_hash) {
      x->parent = p;
      c->nodes[p - 1].children++;
    }
  }
  /* Reachability (state in dirty: 0 unknown, 1 reachable, 2 not; reset after):
   * each node's path up is walked once thanks to the memo. */
  uint32_t *path = kvti_malloc(((size_t)c->n + 1) * sizeof *path);
  if (!path)
    return KVT_ERR_NOMEM();
  for (uint32_t i = 0; i < c->n; i++) {
    size_t np = 0;
    uint32_t id = i + 1;
    uint8_t st = 0;
    while (c->nodes[id - 1].live && !(st = c->nodes[id - 1].dirty)) {
      path[np++] = id;
      const node *x = &c->nodes[id - 1];
      if (x->r.index == 0) {
        st = 1;
        break;
      }
      if (!x->parent) {
        st = 2;
        break;
      }
      id = x->parent;
    }
    while (np)
      c->nodes[path[--np] - 1].dirty = st ? st : 2;
  }
  kvti_free(path);
  for (uint32_t i = 0; i < c->n && ret == 0; i++) {
    node *x = &c->nodes[i];
    if (x->live && x->dirty == 2 &&
        (ret = push_orph(orph, norph, &cap, x->r.key)) == 0)
      x->dirty = 3; /* to delete below */
  }
  /* Children before parents does not matter: all of them go. */
  for (uint32_t i = 0; i < c->n && ret == 0; i++)
    if (c->nodes[i].live && c->nodes[i].dirty == 3)
      kvti_chain_del_node(c, i + 1);
  for (uint32_t i = 0; i < c->n; i++)
    c->nodes[i].dirty = 0;
  return ret;
}

static int load_entries(kvti_chains *c) {
  sqlite3_stmt *s = NULL;
  int rc = sqlite3_prepare_v2(c->idx->db, ELOAD_SQL, -1, &s, NULL);
  if (rc != SQLITE_OK) /* a read-only index of an older build: none */
    return 0;
  int ret = 0;
  while (ret == 0 && (rc = sqlite3_step(s)) == SQLITE_ROW) {
    kvti_chained_entry e;
    uint64_t ch, ct, lay, tr;
    if (sqlite3_column_type(s, 0) != SQLITE_BLOB ||
        sqlite3_column_bytes(s, 0) != 32 ||
        sqlite3_column_type(s, 3) != SQLITE_BLOB ||
        sqlite3_column_bytes(s, 3) != 32 || row_u64(s, 1, &ch) ||
        row_u64(s, 2, &ct) || row_u64(s, 4, &lay) || row_u64(s, 5, &tr) ||
        ch == 0 || tr < ch * ct || !kvti_chunk_tokens_ok(ct)) {
      c->idx->skipped++;
      continue;
    }
    memcpy(e.hash, sqlite3_column_blob(s, 0), 32);
    memcpy(e.last_key, sqlite3_column_blob(s, 3), 32);
    e.chunks = ch;
    e.chunk_tokens = (uint32_t)ct;
    e.layout_hash = lay;
    e.total_rows = tr;
    ret = kvti_chain_ent_add(c, &e);
  }
  if (ret == 0 && rc != SQLITE_DONE && rc != SQLITE_ROW)
    ret = kvti_idx_db_err(c->idx, rc, "load kvtier_chained_entries");
  sqlite3_finalize(s);
  return ret;
}

int kvti_chains_entry_put(kvti_chains *c, const kvti_chained_entry *e) {
  return kvti_chains_entry_put_ex(c, e, 1);
}

int kvti_chains_entry_put_ex(kvti_chains *c, const kvti_chained_entry *e,
                             int wait) {
  if (c->idx->readonly || !c->e_put)
    return KVT_ERR(KVT_EPERM, "chain table: opened read-only");
  pthread_mutex_lock(&c->idx->db_mu);
  if (!wait)
    sqlite3_busy_timeout(c->idx->db, 0);
  sqlite3_stmt *s = c->e_put;
  sqlite3_bind_blob(s, 1, e->hash, 32, SQLITE_STATIC);
  sqlite3_bind_int64(s, 2, (sqlite3_int64)e->chunks);
  sqlite3_bind_int64(s, 3, e->chunk_tokens);
  sqlite3_bind_blob(s, 4, e->last_key, 32, SQLITE_STATIC);
  sqlite3_bind_int64(s, 5, (sqlite3_int64)e->layout_hash);
  sqlite3_bind_int64(s, 6, (sqlite3_int64)e->total_rows);
  int rc = run(c, s, "insert kvtier_chained_entries");
  if (!wait)
    sqlite3_busy_timeout(c->idx->db, BUSY_TIMEOUT_MS);
  if (rc == 0) {
    pthread_rwlock_wrlock(&c->rw);
    rc = kvti_chain_ent_add(c, e);
    pthread_rwlock_unlock(&c->rw);
  }
  pthread_mutex_unlock(&c->idx->db_mu);
  return rc;
}

int kvti_chains_entry_del(kvti_chains *c, const uint8_t hash[32]) {
  if (c->idx->readonly || !c->e_del)
    return KVT_ERR(KVT_EPERM, "chain table: opened read-only");
  pthread_mutex_lock(&c->idx->db_mu);
  sqlite3_bind_blob(c->e_del, 1, hash, 32, SQLITE_STATIC);
  int rc = run(c, c->e_del, "delete kvtier_chained_entries");
  if (rc == 0) {
    pthread_rwlock_wrlock(&c->rw);
    kvti_chain_ent_del(c, hash);
    pthread_rwlock_unlock(&c->rw);
  }
  pthread_mutex_unlock(&c->idx->db_mu);
  return rc;
}

void kvti_chains_close(kvti_chains *c) {
  if (!c)
    return;
  if (c->idx) {
    pthread_mutex_lock(&c->idx->db_mu);
    flush_locked(c);
    pthread_mutex_unlock(&c->idx->db_mu);
  }
  sqlite3_finalize(c->ins);
  sqlite3_finalize(c->del);
  sqlite3_finalize(c->upd);
  sqlite3_finalize(c->e_put);
  sqlite3_finalize(c->e_del);
  kvti_hm_free(&c->byent);
  kvti_free(c->ents);
  kvti_hm_free(&c->bykey);
  kvti_hm_free(&c->byck);
  kvti_free(c->nodes);
  kvti_free(c->freel);
  kvti_free(c->dirty);
  pthread_rwlock_destroy(&c->rw);
  kvti_free(c);
}

int kvti_chains_open(kvti_chains **out, kvt_index *idx) {
  if (!out || !idx)
    return KVT_ERR(KVT_EINVAL, "kvti_chains_open: NULL argument");
  *out = NULL;
  kvti_chains *c = kvti_calloc(1, sizeof *c);
  if (!c)
    return KVT_ERR_NOMEM();
  pthread_rwlock_init(&c->rw, NULL);
  uint8_t(*orph)[32] = NULL;
  size_t norph = 0;
  int present = 0, rc;
  c->idx = idx;
  pthread_mutex_lock(&idx->db_mu);
  if (!idx->readonly) {
    rc = kvti_idx_exec(idx, CHUNKS_SQL, "create kvtier_chunks");
    if (rc == 0)
      rc = kvti_idx_exec(idx, ENT_SQL, "create kvtier_chained_entries");
  } else {
    rc = 0;
  }
  if (rc == 0)
    rc = table_present(c, &present);
  if (rc == 0 && present && !idx->readonly) {
    const char *sql[5] = {INS_SQL, DEL_SQL, UPD_SQL, EPUT_SQL, EDEL_SQL};
    sqlite3_stmt **st[5] = {&c->ins, &c->del, &c->upd, &c->e_put, &c->e_del};
    for (int i = 0; rc == 0 && i < 5; i++) {
      int src = sqlite3_prepare_v2(idx->db, sql[i], -1, st[i], NULL);
      if (src != SQLITE_OK)
        rc = kvti_idx_db_err(idx, src, "prepare (chains)");
    }
  }
  if (rc == 0 && present)
    rc = load(c, &orph, &norph);
  if (rc == 0 && present)
    rc = load_entries(c);
  /* Unreachable rows: their chunks can never be served; drop the rows (the
   * files become orphans that gc removes). */
  if (rc == 0 && norph && !idx->readonly && (rc = begin(c)) == 0) {
    for (size_t i = 0; rc == 0 && i < norph; i++) {
      char h[65];
      bind_key(c->del, 1, orph[i], h);
      rc = run(c, c->del, "delete kvtier_chunks");
    }
    rc = rc ? (kvti_idx_rollback(idx), rc) : commit(c);
  }
  pthread_mutex_unlock(&idx->db_mu);
  kvti_free(orph);
  if (rc) {
    c->idx = NULL;
    kvti_chains_close(c);
    return rc;
  }
  *out = c;
  return 0;
}

int kvti_chains_put(kvti_chains *c, const kvti_chain_rec *recs, size_t n) {
  return kvti_chains_put_with_entry(c, recs, n, NULL);
}

int kvti_chains_put_with_entry(kvti_chains *c, const kvti_chain_rec *recs,
                               size_t n, const kvti_chained_entry *e) {
  if (c->idx->readonly || !c->ins || (e && !c->e_put))
    return KVT_ERR(KVT_EPERM, "chain table: opened read-only");
  if (n == 0)
    return e ? kvti_chains_entry_put(c, e) : 0;
  if (!recs)
    return KVT_ERR(KVT_EINVAL, "kvti_chains_put: NULL records");
  pthread_mutex_lock(&c->idx->db_mu);
  int rc = 0;
  /* Parents must be indexed or come earlier in this batch. */
  pthread_rwlock_rdlock(&c->rw);
  for (size_t i = 0; rc == 0 && i < n; i++) {
    const kvti_chain_rec *r = &recs[i];
    if (r->n_tokens == 0 || r->n_tokens > KVTI_CHUNK_MAX_TOKENS ||
        r->disk_bytes > INT64_MAX || r->mem_bytes > INT64_MAX)
      rc = KVT_ERR(KVT_EINVAL, "chain table: bad record");
    if (rc || r->index == 0)
      continue;
    uint32_t p = kvti_chain_find_key(c, r->parent);
    int ok = p && c->nodes[p - 1].r.index == r->index - 1;
    /* Backwards: a spill lists each chunk right after its parent, so this
     * finds it at once (a forward scan made deep batches quadratic). */
    for (size_t j = i; !ok && j-- > 0;)
      ok = !memcmp(recs[j].key, r->parent, 32) && recs[j].index == r->index - 1;
    if (!ok)
      rc = KVT_ERR(KVT_EINVAL, "chain table: chunk %llu has no indexed parent",
                   (unsigned long long)r->index);
  }
  pthread_rwlock_unlock(&c->rw);
  double now = kvti_index_now(c->idx);
  if (rc == 0)
    rc = begin(c);
  for (size_t i = 0; rc == 0 && i < n; i++) {
    const kvti_chain_rec *r = &recs[i];
    char h1[65], h2[65];
    sqlite3_stmt *s = c->ins;
    bind_key(s, 1, r->key, h1);
    bind_key(s, 2, r->parent, h2);
    sqlite3_bind_int64(s, 3, (sqlite3_int64)r->index);
    sqlite3_bind_int64(s, 4, r->n_tokens);
    sqlite3_bind_int64(s, 5, (sqlite3_int64)r->layout_hash);
    sqlite3_bind_int64(s, 6, (sqlite3_int64)r->ck.lo);
    sqlite3_bind_int64(s, 7, (sqlite3_int64)r->ck.hi);
    sqlite3_bind_int64(s, 8, (sqlite3_int64)r->disk_bytes);
    sqlite3_bind_int64(s, 9, (sqlite3_int64)r->mem_bytes);
    sqlite3_bind_double(s, 10, now);
    sqlite3_bind_double(s, 11, now);
    sqlite3_bind_int(s, 12, r->pure ? 1 : 0);
    rc = run(c, s, "insert kvtier_chunks");
  }
  if (rc == 0 && e) {
    sqlite3_stmt *s = c->e_put;
    sqlite3_bind_blob(s, 1, e->hash, 32, SQLITE_STATIC);
    sqlite3_bind_int64(s, 2, (sqlite3_int64)e->chunks);
    sqlite3_bind_int64(s, 3, e->chunk_tokens);
    sqlite3_bind_blob(s, 4, e->last_key, 32, SQLITE_STATIC);
    sqlite3_bind_int64(s, 5, (sqlite3_int64)e->layout_hash);
    sqlite3_bind_int64(s, 6, (sqlite3_int64)e->total_rows);
    rc = run(c, s, "insert kvtier_chained_entries");
  }
  if (rc == 0) {
    pthread_rwlock_wrlock(&c->rw);
    rc = kvti_chain_reserve_nodes(c, n);
    pthread_rwlock_unlock(&c->rw);
  }
  if (rc == 0)
    rc = commit(c);
  else
    kvti_idx_rollback(c->idx);
  if (rc == 0) {
    pthread_rwlock_wrlock(&c->rw);
    for (size_t i = 0; i < n; i++) {
      if (kvti_chain_find_key(c, recs[i].key))
        continue;
      uint32_t p = recs[i].index ? kvti_chain_find_key(c, recs[i].parent) : 0;
      kvti_chain_rec r = recs[i];
      r.created_at = r.accessed_at = now;
      kvti_chain_add_node(c, &r, p);
    }
    /* The record after its chain: a reader resolving it finds every node. */
    if (e)
      rc = kvti_chain_ent_add(c, e);
    pthread_rwlock_unlock(&c->rw);
  }
  pthread_mutex_unlock(&c->idx->db_mu);
  return rc;
}

/* The node ids of key's subtree (key first), rw held. *set kvti_malloc'ed.
 * 0, KVT_ENOTFOUND, KVT_ENOMEM. */
static int subtree_ids(kvti_chains *c, const uint8_t key[32], uint32_t **setp,
                       size_t *nsp) {
  uint32_t root = kvti_chain_find_key(c, key);
  uint32_t *set = NULL;
  size_t ns = 0;
  int rc = root ? 0 : KVT_ENOTFOUND;
  if (rc == 0 && c->nodes[root - 1].children == 0) {
    set = kvti_malloc(sizeof *set);
    if (set)
      set[ns++] = root;
  } else if (rc == 0) {
    /* Descendants, in time linear in the table: one pass threads every live
     * node onto its parent's child list (head/next, ids 1-based, 0 ends a
     * list), then a breadth-first walk from the root over those lists. set
     * doubles as the walk's queue, so it lists parents before children. */
    uint32_t *head = kvti_calloc(c->n ? c->n : 1, sizeof *head);
    uint32_t *next = kvti_calloc(c->n ? c->n : 1, sizeof *next);
    set = kvti_malloc((c->tot.chunks + 1) * sizeof *set);
    if (head && next && set) {
      for (uint32_t i = 0; i < c->n; i++) {
        const node *x = &c->nodes[i];
        if (x->live && x->parent) {
          next[i] = head[x->parent - 1];
          head[x->parent - 1] = i + 1;
        }
      }
      set[ns++] = root;
      for (size_t q = 0; q < ns; q++)
        for (uint32_t ch = head[set[q] - 1]; ch; ch = next[ch - 1])
          if (ns <= c->tot.chunks)
            set[ns++] = ch;
    }
    if (!head || !next || !set)
      rc = KVT_ERR_NOMEM();
    kvti_free(head);
    kvti_free(next);
  }
  if (rc == 0 && !set)
    rc = KVT_ERR_NOMEM();
  if (rc) {
    kvti_free(set);
    set = NULL;
    ns = 0;
  }
  *setp = set;
  *nsp = ns;
  return rc;
}

int kvti_chains_subtree(kvti_chains *c, const uint8_t key[32],
                        kvti_chain_rec **out, size_t *n) {
  *out = NULL;
  *n = 0;
  pthread_rwlock_rdlock(&c->rw);
  uint32_t *set = NULL;
  size_t ns = 0;
  int rc = subtree_ids(c, key, &set, &ns);
  kvti_chain_rec *o = NULL;
  if (rc == 0 && !(o = kvti_malloc((ns ? ns : 1) * sizeof *o)))
    rc = KVT_ERR_NOMEM();
  for (size_t i = 0; rc == 0 && i < ns; i++)
    o[i] = c->nodes[set[i] - 1].r;
  pthread_rwlock_unlock(&c->rw);
  kvti_free(set);
  if (rc == 0) {
    *out = o;
    *n = ns;
  }
  return rc;
}

int kvti_chains_remove_tree(kvti_chains *c, const uint8_t key[32],
                            kvti_chain_rec **removed, size_t *nrem) {
  if (c->idx->readonly || !c->del)
    return KVT_ERR(KVT_EPERM, "chain table: opened read-only");
  *removed = NULL;
  *nrem = 0;
  pthread_mutex_lock(&c->idx->db_mu);
  pthread_rwlock_rdlock(&c->rw);
  uint32_t *set = NULL;
  size_t ns = 0;
  int rc = subtree_ids(c, key, &set, &ns);
  kvti_chain_rec *out = NULL;
  if (rc == 0 && !(out = kvti_malloc(ns * sizeof *out)))
    rc = KVT_ERR_NOMEM();
  for (size_t i = 0; rc == 0 && i < ns; i++)
    out[i] = c->nodes[set[i] - 1].r;
  pthread_rwlock_unlock(&c->rw);
  int began = 0;
  if (rc == 0)
    began = (rc = begin(c)) == 0;
  /* Leaves first, so even a partial delete never cuts a chain in the middle
   * (the transaction makes it all or none anyway). */
  for (size_t i = ns; rc == 0 && i-- > 0;) {
    char h[65];
    bind_key(c->del, 1, out[i].key, h);
    rc = run(c, c->del, "delete kvtier_chunks");
  }
  if (rc == 0)
    rc = commit(c);
  else if (began)
    kvti_idx_rollback(c->idx);
  if (rc == 0) {
    pthread_rwlock_wrlock(&c->rw);
    for (size_t i = ns; i-- > 0;)
      kvti_chain_del_node(c, set[i]);
    pthread_rwlock_unlock(&c->rw);
    *removed = out;
    *nrem = ns;
  } else {
    kvti_free(out);
  }
  pthread_mutex_unlock(&c->idx->db_mu);
  kvti_free(set);
  return rc;
}
