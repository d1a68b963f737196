/*
 * index.c - the SQLite index of a cache directory (the reference's SSDIndex,
 * schema byte for byte) and its in-memory mirror. SQLite is the durable record
 * and the format the reference reads; every lookup is answered from the mirror
 * without SQL.
 *   Exact: a multimap keyed by the first 8 bytes of the binary SHA-256 (the
 * entry key); the candidate is confirmed against all 32 bytes.
 *   Longest prefix: a "block trie" that stores no tokens. A sequence of n
 * tokens has k = n/16 full blocks and a tail of t = n%16 tokens. hb_0 is a
 * constant and hb_{i+1} = XXH3(block i, seed hb_i) chains the block hashes; an
 * entry hangs off node hb_k (a map from hb_k to a count and a bit mask of the
 * tail lengths present there) and is found by its sequence key hf = XXH3(tail,
 * seed hb_k ^ f(t)). A query computes its chained block hashes once, visits the
 * nodes deepest first and, for each tail length present, probes hf. The cost is
 * O(query_len/16 + tail probes), independent of how many entries share a
 * prefix; the final candidate is confirmed by SHA-256 of the query prefix
 * against the entry's key, so a 64-bit collision never serves a wrong entry.
 *   Memory per entry, whatever its length (tokens stay in SQLite;
 * kvti_index_tokens reads them): struct mirror_ent 136 bytes + one pair in the
 * exact map and one in the sequence map (16-byte slots at 35-70% load: 23-46
 * bytes each) + at most one node pair (same) + two heap slots (8-16 bytes):
 * 190-290 bytes; measured 252 (1M entries) and 294 (100k) bytes per entry.
 *   LRU victim and oldest-created are the tops of two binary min-heaps (O(log
 * n) updates). Touches update the mirror at once and are written to SQLite in
 * batches (due at 256 touches or after 1 s; written by the writer's next
 * put, by a toucher that finds SQLite free, by kvti_index_flush or at close)
 * with "accessed_at = max(old, new)" so a late batch never rewinds an entry
 * re-inserted meanwhile.
 *   Locks: db_mu serialises SQLite; rw protects the mirror; pend_mu the pending
 * touches. Order is always db_mu -> rw -> pend_mu. Rows read from index.db are
 * untrusted: a row whose file_path is not the 64-hex token_hash, whose blob
 * length is not num_tokens*4, or with negative/ill-typed numbers is skipped
 * (counted, error message set) and never served.
 */
#include "index.h"

#include "error.h"
#include "hash.h"
#include "hashmap.h"
#include "io.h"

#include <math.h>
#include <openssl/evp.h>
#include <pthread.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#define BLK 16 /* tokens per trie block (== the reference's prefix filter) */
#define HB0 0x6b7674696572ull /* hb_0, "kvtier" */
#define TOUCH_BATCH 256
#define TOUCH_MAX_AGE 1.0 /* seconds a touch may wait before being written */
#define BUSY_TIMEOUT_MS 5000
#define MAX_TOKENS                                                             \
  ((uint64_t)1 << 28) /* 1 GiB blob: SQLite's default length limit */

/* ---- SQL text (the reference's, verbatim) ---- */

static const char SCHEMA_SQL[] =
    "\n"
    "        CREATE TABLE IF NOT EXISTS schema_version (\n"
    "            version INTEGER NOT NULL\n"
    "        );\n"
    "\n"
    "        CREATE TABLE IF NOT EXISTS entries (\n"
    "            token_hash   TEXT PRIMARY KEY,\n"
    "            tokens_blob  BLOB NOT NULL,\n"
    "            prefix_hash  TEXT,\n"
    "            num_tokens   INTEGER NOT NULL,\n"
    "            file_path    TEXT NOT NULL,\n"
    "            memory_bytes INTEGER NOT NULL,\n"
    "            created_at   REAL NOT NULL,\n"
    "            accessed_at  REAL NOT NULL\n"
    "        );\n"
    "\n"
    "        ";

static const char INDEX_SQL[] =
    "\n"
    "        CREATE INDEX IF NOT EXISTS idx_entries_accessed\n"
    "            ON entries(accessed_at);\n"
    "\n"
    "        CREATE INDEX IF NOT EXISTS idx_entries_num_tokens\n"
    "            ON entries(num_tokens);\n"
    "\n"
    "        CREATE INDEX IF NOT EXISTS idx_entries_prefix_hash_num_tokens\n"
    "            ON entries(prefix_hash, num_tokens);\n"
    "        ";

static const char META_SQL[] =
    "CREATE TABLE IF NOT EXISTS kvtier_meta (token_hash TEXT PRIMARY KEY, "
    "disk_bytes INTEGER "
    "NOT NULL, storage_mode INTEGER NOT NULL)";

enum {
  ST_INSERT, /* the reference's INSERT OR REPLACE */
  ST_META_PUT,
  ST_META_DEL,
  ST_DELETE,
  ST_TOUCH,
  ST_TOKENS,
  ST_BEGIN,
  ST_COMMIT,
  ST_ROLLBACK,
  ST_COUNT
};

static const char *const STMT_SQL[ST_COUNT] = {
    [ST_INSERT] =
        "\n            INSERT OR REPLACE INTO entries\n"
        "                (token_hash, tokens_blob, prefix_hash, num_tokens, "
        "file_path,\n                 memory_bytes, created_at, accessed_at)\n"
        "            VALUES (?, ?, ?, ?, ?, ?, ?, ?)\n            ",
    [ST_META_PUT] =
        "INSERT OR REPLACE INTO kvtier_meta (token_hash, disk_bytes, "
        "storage_mode) VALUES (?, ?, ?)",
    [ST_META_DEL] = "DELETE FROM kvtier_meta WHERE token_hash = ?",
    [ST_DELETE] = "DELETE FROM entries WHERE token_hash = ?",
    [ST_TOUCH] = "UPDATE entries SET accessed_at = ? WHERE token_hash = ? AND "
                 "accessed_at < ?",
    [ST_TOKENS] = "SELECT tokens_blob, num_tokens, file_path FROM entries "
                  "WHERE token_hash = ?",
    [ST_BEGIN] = "BEGIN IMMEDIATE",
    [ST_COMMIT] = "COMMIT",
    [ST_ROLLBACK] = "ROLLBACK",
};

/* ---- the mirror ---- */

typedef struct mirror_ent {
  uint8_t sha[32];  /* SHA-256 of the tokens: the key */
  uint8_t psha[32]; /* SHA-256 of the first min(n,16) tokens (prefix_hash) */
  uint64_t hb;      /* node key: chained hash of the full blocks */
  uint64_t hf;      /* sequence key (hb + tail) */
  uint64_t num_tokens;
  uint64_t memory_bytes;
  uint64_t disk_bytes;
  double created_at;
  double accessed_at;
  uint32_t heap_pos[2]; /* positions in the LRU / created heaps; heap_pos[0] =
                           next free */
  int32_t storage_mode;
  uint32_t live;
} mirror_ent;
_Static_assert(sizeof(mirror_ent) == 136,
               "per-entry memory stated in the file comment");

enum { H_LRU = 0, H_CREATED = 1 };

typedef struct touch_rec {
  uint8_t sha[32];
  double t;
} touch_rec;

struct kvt_index {
  sqlite3 *db;
  sqlite3_stmt *st[ST_COUNT];
  pthread_mutex_t db_mu;
  int readonly;
  char *data_dir;
  char *db_path;

  pthread_rwlock_t rw;
  mirror_ent *ents;
  uint32_t n_ents, cap_ents; /* slots used (live or free) / allocated */
  uint32_t free_head;        /* 1-based id of a free slot, 0 = none */
  uint32_t *heap[2];
  uint32_t heap_n, heap_cap;
  kvti_hm exact; /* sha[0..8) -> id */
  kvti_hm seq;   /* hf -> id */
  kvti_hm nodes; /* hb -> count | tailmask << 32 */
  uint64_t n_live, sum_disk, sum_mem;
  uint64_t skipped;

  pthread_mutex_t pend_mu;
  touch_rec *pend;
  size_t pend_n, pend_cap;
  double pend_first;
};

/* ---- small helpers ---- */

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int sha256_bin(uint8_t out[32], const void *data, size_t len) {
  unsigned int mdlen = 0;
  if (!EVP_Digest(len ? data : (const void *)"", len, out, &mdlen, EVP_sha256(),
                  NULL) ||
      mdlen != 32)
    return KVT_ERR(KVT_ENOMEM, "SHA-256 computation failed");
  return 0;
}

static void hex_of(char out[65], const uint8_t b[32]) {
  static const char hx[] = "0123456789abcdef";
  for (int i = 0; i < 32; i++) {
    out[2 * i] = hx[b[i] >> 4];
    out[2 * i + 1] = hx[b[i] & 15];
  }
  out[64] = '\0';
}

static int unhex_of(uint8_t out[32], const char *s) {
  if (!s || !kvti_is_hash_name(s))
    return -1;
  for (int i = 0; i < 32; i++) {
    int v = 0;
    for (int j = 0; j < 2; j++) {
      char c = s[2 * i + j];
      v = v * 16 + (c <= '9' ? c - '0' : c - 'a' + 10);
    }
    out[i] = (uint8_t)v;
  }
  return 0;
}

static uint64_t key64(const uint8_t sha[32]) {
  uint64_t k;
  memcpy(&k, sha, 8);
  return k;
}

static uint64_t tail_seed(uint64_t hb, size_t t) {
  return hb ^ (0x9E3779B97F4A7C15ull * (uint64_t)(t + 1));
}

/* Trie keys of a sequence: hb of its full blocks and hf of the whole. */
static void seq_keys(uint64_t *hb, uint64_t *hf, const int32_t *tok, size_t n) {
  uint64_t h = HB0;
  size_t k = n / BLK;
  for (size_t i = 0; i < k; i++)
    h = XXH3_64bits_withSeed(tok + i * BLK, BLK * sizeof(int32_t), h);
  size_t t = n % BLK;
  *hb = h;
  *hf =
      XXH3_64bits_withSeed(tok + k * BLK, t * sizeof(int32_t), tail_seed(h, t));
}

static int db_err(kvt_index *idx, int rc, const char *what) {
  int prim = rc & 0xff;
  const char *msg =
      idx && idx->db ? sqlite3_errmsg(idx->db) : sqlite3_errstr(rc);
  int code = prim == SQLITE_FULL    ? KVT_ENOSPC
             : prim == SQLITE_IOERR ? KVT_EIO
             : prim == SQLITE_NOMEM ? KVT_ENOMEM
                                    : KVT_EDB;
  return KVT_ERR(code, "index.db: %s: %s (SQLite %d)", what, msg, rc);
}

static int exec_sql(kvt_index *idx, const char *sql, const char *what) {
  char *em = NULL;
  int rc = sqlite3_exec(idx->db, sql, NULL, NULL, &em);
  if (rc != SQLITE_OK) {
    int prim = rc & 0xff;
    int code = prim == SQLITE_FULL    ? KVT_ENOSPC
               : prim == SQLITE_IOERR ? KVT_EIO
               : prim == SQLITE_NOMEM ? KVT_ENOMEM
                                      : KVT_EDB;
    KVT_ERR(code, "index.db: %s: %s (SQLite %d)", what,
            em ? em : sqlite3_errmsg(idx->db), rc);
    sqlite3_free(em);
    return code;
  }
  return 0;
}

/* Runs a prepared statement that returns no rows, then resets it. */
static int step_done(kvt_index *idx, int which, const char *what) {
  sqlite3_stmt *s = idx->st[which];
  int rc = sqlite3_step(s);
  int out = 0;
  if (rc != SQLITE_DONE && rc != SQLITE_ROW)
    out = db_err(idx, rc, what);
  sqlite3_reset(s);
  sqlite3_clear_bindings(s);
  return out;
}

static void rollback(kvt_index *idx) {
  if (!sqlite3_get_autocommit(idx->db)) {
    sqlite3_step(idx->st[ST_ROLLBACK]);
    sqlite3_reset(idx->st[ST_ROLLBACK]);
  }
}

static int flush_locked(kvt_index *idx);
static int touches_due(kvt_index *idx, double t);

/* ---- heaps ---- */

static double hkey(const kvt_index *idx, int h, uint32_t id) {
  const mirror_ent *e = &idx->ents[id];
  return h == H_LRU ? e->accessed_at : e->created_at;
}

static void heap_set(kvt_index *idx, int h, uint32_t pos, uint32_t id) {
  idx->heap[h][pos] = id;
  idx->ents[id].heap_pos[h] = pos;
}

static void heap_fix(kvt_index *idx, int h, uint32_t pos) {
  uint32_t *a = idx->heap[h];
  uint32_t id = a[pos];
  double k = hkey(idx, h, id);
  while (pos > 0) { /* up */
    uint32_t p = (pos - 1) / 2;
    if (hkey(idx, h, a[p]) <= k)
      break;
    heap_set(idx, h, pos, a[p]);
    pos = p;
  }
  for (;;) { /* down */
    uint32_t c = 2 * pos + 1;
    if (c >= idx->heap_n)
      break;
    if (c + 1 < idx->heap_n && hkey(idx, h, a[c + 1]) < hkey(idx, h, a[c]))
      c++;
    if (hkey(idx, h, a[c]) >= k)
      break;
    heap_set(idx, h, pos, a[c]);
    pos = c;
  }
  heap_set(idx, h, pos, id);
}

/* Removes id from both heaps (heap_n is shared: both hold every live entry). */
static void heaps_remove(kvt_index *idx, uint32_t id) {
  uint32_t last = idx->heap_n - 1, pos[2];
  for (int h = 0; h < 2; h++) {
    pos[h] = idx->ents[id].heap_pos[h];
    if (pos[h] != last)
      heap_set(idx, h, pos[h], idx->heap[h][last]);
  }
  idx->heap_n--;
  for (int h = 0; h < 2; h++)
    if (pos[h] < idx->heap_n)
      heap_fix(idx, h, pos[h]);
}

/* ---- mirror maintenance (callers hold rw for writing) ---- */

static int mirror_find(const kvt_index *idx, const uint8_t sha[32],
                       uint32_t *id) {
  size_t pos = 0;
  kvti_hm_slot *s;
  while ((s = kvti_hm_next(&idx->exact, key64(sha), &pos)) != NULL) {
    const mirror_ent *e = &idx->ents[s->val];
    if (e->live && memcmp(e->sha, sha, 32) == 0) {
      *id = (uint32_t)s->val;
      return 1;
    }
  }
  return 0;
}

static int mirror_reserve(kvt_index *idx) {
  if (idx->free_head == 0 && idx->n_ents == idx->cap_ents) {
    uint32_t cap = idx->cap_ents ? idx->cap_ents * 2 : 64;
    if (cap > UINT32_MAX / 2)
      return KVT_ERR(KVT_ENOMEM, "index mirror: too many entries");
    mirror_ent *e = kvti_realloc(idx->ents, (size_t)cap * sizeof *e);
    if (!e)
      return KVT_ERR_NOMEM();
    idx->ents = e;
    idx->cap_ents = cap;
  }
  if (idx->heap_n == idx->heap_cap) {
    uint32_t cap = idx->heap_cap ? idx->heap_cap * 2 : 64;
    for (int h = 0; h < 2; h++) {
      uint32_t *a = kvti_realloc(idx->heap[h], (size_t)cap * sizeof *a);
      if (!a)
        return KVT_ERR_NOMEM();
      idx->heap[h] = a;
    }
    idx->heap_cap = cap;
  }
  /* Reserve map room now so the insert below cannot fail half-way. */
  int rc = kvti_hm_reserve(&idx->exact, idx->exact.n + 1);
  if (!rc)
    rc = kvti_hm_reserve(&idx->seq, idx->seq.n + 1);
  if (!rc)
    rc = kvti_hm_reserve(&idx->nodes, idx->nodes.n + 1);
  return rc;
}

/* Inserts a new entry (not present). mirror_reserve must have succeeded. */
static void mirror_add(kvt_index *idx, const mirror_ent *src) {
  uint32_t id;
  if (idx->free_head) {
    id = idx->free_head - 1;
    idx->free_head = idx->ents[id].heap_pos[0];
  } else {
    id = idx->n_ents++;
  }
  mirror_ent *e = &idx->ents[id];
  *e = *src;
  e->live = 1;
  kvti_hm_add(&idx->exact, key64(e->sha), id);
  if (e->num_tokens > 0) {
    kvti_hm_add(&idx->seq, e->hf, id);
    size_t pos = 0;
    kvti_hm_slot *s = kvti_hm_next(&idx->nodes, e->hb, &pos);
    uint64_t bit = (uint64_t)1 << (32 + e->num_tokens % BLK);
    if (s)
      s->val = (s->val + 1) | bit;
    else
      kvti_hm_add(&idx->nodes, e->hb, 1 | bit);
  }
  uint32_t pos = idx->heap_n++;
  for (int h = 0; h < 2; h++) {
    heap_set(idx, h, pos, id);
    heap_fix(idx, h, pos);
  }
  idx->n_live++;
  idx->sum_disk += e->disk_bytes;
  idx->sum_mem += e->memory_bytes;
}

static void mirror_del(kvt_index *idx, uint32_t id) {
  mirror_ent *e = &idx->ents[id];
  kvti_hm_remove(&idx->exact, key64(e->sha), id);
  if (e->num_tokens > 0) {
    kvti_hm_remove(&idx->seq, e->hf, id);
    size_t pos = 0;
    kvti_hm_slot *s = kvti_hm_next(&idx->nodes, e->hb, &pos);
    /* The tail mask is not narrowed on removal: a stale bit costs one probe,
     * never a wrong answer; the node goes away with its last entry. */
    if (s) {
      if ((s->val & 0xffffffffu) <= 1)
        kvti_hm_remove_slot(&idx->nodes, s);
      else
        s->val--;
    }
  }
  heaps_remove(idx, id);
  idx->n_live--;
  idx->sum_disk -= e->disk_bytes;
  idx->sum_mem -= e->memory_bytes;
  e->live = 0;
  e->heap_pos[0] = idx->free_head;
  idx->free_head = id + 1;
}

static void fill_info(kvt_entry_info *out, const mirror_ent *e) {
  memset(out, 0, sizeof *out);
  hex_of(out->token_hash, e->sha);
  hex_of(out->prefix_hash, e->psha);
  out->num_tokens = e->num_tokens;
  out->memory_bytes = e->memory_bytes;
  out->disk_bytes = e->disk_bytes;
  out->created_at = e->created_at;
  out->accessed_at = e->accessed_at;
}

/* Builds the mirror record of a token sequence (hashes computed here, outside
 * any lock). full_sha = 0 leaves e->sha for the caller (rows loaded from SQLite
 * carry their key). */
static int make_ent(mirror_ent *e, const int32_t *tokens, size_t n,
                    int full_sha) {
  memset(e, 0, sizeof *e);
  int rc = full_sha ? sha256_bin(e->sha, tokens, n * sizeof(int32_t)) : 0;
  if (!rc)
    rc = sha256_bin(e->psha, tokens, (n < BLK ? n : BLK) * sizeof(int32_t));
  if (rc)
    return rc;
  seq_keys(&e->hb, &e->hf, tokens, n);
  e->num_tokens = n;
  return 0;
}

/* ---- open ---- */

static int prepare_all(kvt_index *idx) {
  for (int i = 0; i < ST_COUNT; i++) {
    if (idx->readonly && (i == ST_INSERT || i == ST_META_PUT ||
                          i == ST_META_DEL || i == ST_DELETE || i == ST_TOUCH))
      continue; /* never used read-only, and a legacy DB lacks
                   prefix_hash/kvtier_meta */
    int rc = sqlite3_prepare_v3(idx->db, STMT_SQL[i], -1,
                                SQLITE_PREPARE_PERSISTENT, &idx->st[i], NULL);
    if (rc != SQLITE_OK)
      return db_err(idx, rc, "prepare");
  }
  return 0;
}

static int has_column(kvt_index *idx, const char *table, const char *col,
                      int *out) {
  char sql[128];
  snprintf(sql, sizeof sql, "PRAGMA table_info(%s)", table);
  sqlite3_stmt *s = NULL;
  int rc = sqlite3_prepare_v2(idx->db, sql, -1, &s, NULL);
  if (rc != SQLITE_OK)
    return db_err(idx, rc, "table_info");
  *out = 0;
  while ((rc = sqlite3_step(s)) == SQLITE_ROW) {
    const unsigned char *name = sqlite3_column_text(s, 1);
    if (name && strcmp((const char *)name, col) == 0)
      *out = 1;
  }
  int ret = rc == SQLITE_DONE ? 0 : db_err(idx, rc, "table_info");
  sqlite3_finalize(s);
  return ret;
}

/* The reference's _backfill_prefix_hashes: prefix_hash for rows lacking it.
 * Rows whose blob is not a whole number of int32 (which the reference could not
 * parse either) are left NULL. */
static int backfill(kvt_index *idx) {
  sqlite3_stmt *sel = NULL, *upd = NULL;
  int rc = sqlite3_prepare_v2(
      idx->db,
      "SELECT token_hash, tokens_blob FROM entries WHERE prefix_hash "
      "IS NULL",
      -1, &sel, NULL);
  if (rc == SQLITE_OK)
    rc = sqlite3_prepare_v2(
        idx->db, "UPDATE entries SET prefix_hash = ? WHERE token_hash = ?", -1,
        &upd, NULL);
  int ret = 0;
  if (rc != SQLITE_OK) {
    ret = db_err(idx, rc, "backfill prepare");
    goto out;
  }
  /* Collect first: updating the table while stepping over it is not
   * well-defined. */
  typedef struct {
    char th[65];
    char ph[65];
  } bf_row;
  bf_row *rows = NULL;
  size_t n = 0, cap = 0;
  while ((rc = sqlite3_step(sel)) == SQLITE_ROW) {
    const unsigned char *th = sqlite3_column_text(sel, 0);
    int thlen = sqlite3_column_bytes(sel, 0);
    const void *blob = sqlite3_column_blob(sel, 1);
    int blen = sqlite3_column_bytes(sel, 1);
    if (!th || thlen > 64 || blen < 0 || blen % 4)
      continue;
    if (n == cap) {
      size_t nc = cap ? cap * 2 : 64;
      bf_row *r = kvti_realloc(rows, nc * sizeof *r);
      if (!r) {
        ret = KVT_ERR_NOMEM();
        break;
      }
      rows = r;
      cap = nc;
    }
    memcpy(rows[n].th, th, (size_t)thlen);
    rows[n].th[thlen] = '\0';
    size_t nt = (size_t)blen / 4;
    ret = sha256_bin((uint8_t *)rows[n].ph, blob, (nt < BLK ? nt : BLK) * 4);
    if (ret)
      break;
    uint8_t b[32];
    memcpy(b, rows[n].ph, 32);
    hex_of(rows[n].ph, b);
    n++;
  }
  if (!ret && rc != SQLITE_ROW && rc != SQLITE_DONE)
    ret = db_err(idx, rc, "backfill select");
  for (size_t i = 0; !ret && i < n; i++) {
    sqlite3_bind_text(upd, 1, rows[i].ph, 64, SQLITE_STATIC);
    sqlite3_bind_text(upd, 2, rows[i].th, -1, SQLITE_STATIC);
    rc = sqlite3_step(upd);
    if (rc != SQLITE_DONE)
      ret = db_err(idx, rc, "backfill update");
    sqlite3_reset(upd);
  }
  kvti_free(rows);
out:
  sqlite3_finalize(sel);
  sqlite3_finalize(upd);
  return ret;
}

/* The reference's _create_tables (plus kvtier_meta and removal of stale meta
 * rows), in one transaction. */
static int create_tables(kvt_index *idx) {
  int rc = exec_sql(idx, "BEGIN IMMEDIATE", "begin");
  if (rc)
    return rc;
  rc = exec_sql(idx, SCHEMA_SQL, "create tables");
  int has = 0;
  if (!rc)
    rc = has_column(idx, "entries", "prefix_hash", &has);
  if (!rc && !has)
    rc = exec_sql(idx, "ALTER TABLE entries ADD COLUMN prefix_hash TEXT",
                  "add prefix_hash");
  if (!rc)
    rc = exec_sql(idx, INDEX_SQL, "create indexes");
  if (!rc) {
    sqlite3_stmt *s = NULL;
    int r = sqlite3_prepare_v2(idx->db, "SELECT COUNT(*) FROM schema_version",
                               -1, &s, NULL);
    if (r == SQLITE_OK && (r = sqlite3_step(s)) == SQLITE_ROW) {
      if (sqlite3_column_int64(s, 0) == 0)
        rc = exec_sql(idx, "INSERT INTO schema_version (version) VALUES (1)",
                      "schema_version");
    } else {
      rc = db_err(idx, r, "schema_version");
    }
    sqlite3_finalize(s);
  }
  if (!rc)
    rc = backfill(idx);
  if (!rc)
    rc = exec_sql(idx, META_SQL, "create kvtier_meta");
  if (!rc)
    rc = exec_sql(idx,
                  "DELETE FROM kvtier_meta WHERE token_hash NOT IN (SELECT "
                  "token_hash FROM "
                  "entries)",
                  "remove stale kvtier_meta rows");
  if (!rc)
    rc = exec_sql(idx, "COMMIT", "commit");
  if (rc)
    sqlite3_exec(idx->db, "ROLLBACK", NULL, NULL, NULL);
  return rc;
}

static int table_exists(kvt_index *idx, const char *name, int *out) {
  sqlite3_stmt *s = NULL;
  int rc = sqlite3_prepare_v2(
      idx->db, "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?",
      -1, &s, NULL);
  if (rc != SQLITE_OK)
    return db_err(idx, rc, "sqlite_master");
  sqlite3_bind_text(s, 1, name, -1, SQLITE_STATIC);
  rc = sqlite3_step(s);
  *out = rc == SQLITE_ROW;
  int ret = (rc == SQLITE_ROW || rc == SQLITE_DONE)
                ? 0
                : db_err(idx, rc, "sqlite_master");
  sqlite3_finalize(s);
  return ret;
}

static int skip_row(uint64_t *skipped, const char *th, const char *why) {
  if (skipped)
    (*skipped)++;
  KVT_ERR(KVT_ECORRUPT, "index.db: row %.64s skipped: %s", th ? th : "(null)",
          why);
  return 0;
}

/* Validates a row of entries (columns: token_hash, tokens_blob, num_tokens,
 * file_path, memory_bytes[, created_at, accessed_at]) from SQLite. On success
 * fills e (hashes from blob) and returns 1; returns 0 (and counts/logs) for a
 * hostile or damaged row. */
static int row_valid(uint64_t *skipped, sqlite3_stmt *s, int col_th,
                     int col_blob, int col_n, int col_fp, char th[65]) {
  const unsigned char *t = sqlite3_column_text(s, col_th);
  int tl = sqlite3_column_bytes(s, col_th);
  if (!t || tl != 64) {
    th[0] = '\0';
    return skip_row(skipped, NULL, "token_hash is not 64 hex digits");
  }
  memcpy(th, t, 64);
  th[64] = '\0';
  if (!kvti_is_hash_name(th))
    return skip_row(skipped, NULL, "token_hash is not 64 lowercase hex digits");
  const unsigned char *fp = sqlite3_column_text(s, col_fp);
  int fl = sqlite3_column_bytes(s, col_fp);
  if (!fp || fl != 64 || memcmp(fp, th, 64) != 0)
    return skip_row(skipped, th, "file_path is not the entry's token_hash");
  if (sqlite3_column_type(s, col_n) != SQLITE_INTEGER)
    return skip_row(skipped, th, "num_tokens is not an integer");
  sqlite3_int64 n = sqlite3_column_int64(s, col_n);
  if (n < 0 || (uint64_t)n > MAX_TOKENS)
    return skip_row(skipped, th, "num_tokens out of range");
  if (sqlite3_column_type(s, col_blob) != SQLITE_BLOB &&
      sqlite3_column_bytes(s, col_blob))
    return skip_row(skipped, th, "tokens_blob is not a blob");
  int bl = sqlite3_column_bytes(s, col_blob);
  if (bl < 0 || bl % 4 || (uint64_t)bl != (uint64_t)n * 4)
    return skip_row(skipped, th, "tokens_blob length is not num_tokens*4");
  return 1;
}

static int num_ok(sqlite3_stmt *s, int col) {
  int ty = sqlite3_column_type(s, col);
  if (ty == SQLITE_INTEGER)
    return sqlite3_column_int64(s, col) >= 0;
  if (ty == SQLITE_FLOAT) {
    double d = sqlite3_column_double(s, col);
    return isfinite(d) && d >= 0;
  }
  return 0;
}

typedef struct meta_fix {
  char th[65];
  uint64_t disk_bytes;
} meta_fix;

static int load_mirror(kvt_index *idx) {
  int has_meta = 0;
  int rc = table_exists(idx, "kvtier_meta", &has_meta);
  if (rc)
    return rc;
  const char *sql =
      has_meta
          ? "SELECT e.token_hash, e.tokens_blob, e.num_tokens, e.file_path, "
            "e.memory_bytes, e.created_at, e.accessed_at, m.disk_bytes, "
            "m.storage_mode "
            "FROM entries e LEFT JOIN kvtier_meta m ON m.token_hash = "
            "e.token_hash"
          : "SELECT token_hash, tokens_blob, num_tokens, file_path, "
            "memory_bytes, "
            "created_at, accessed_at, NULL, NULL FROM entries";
  sqlite3_stmt *s = NULL;
  rc = sqlite3_prepare_v2(idx->db, sql, -1, &s, NULL);
  if (rc != SQLITE_OK)
    return db_err(idx, rc, "load");
  meta_fix *fix = NULL;
  size_t nfix = 0, capfix = 0;
  int ret = 0;
  char th[65];
  while ((rc = sqlite3_step(s)) == SQLITE_ROW) {
    if (!row_valid(&idx->skipped, s, 0, 1, 2, 3, th))
      continue;
    if (!num_ok(s, 4) || sqlite3_column_type(s, 4) != SQLITE_INTEGER) {
      skip_row(&idx->skipped, th, "memory_bytes is not a non-negative integer");
      continue;
    }
    if (!num_ok(s, 5) || !num_ok(s, 6)) {
      skip_row(&idx->skipped, th,
               "created_at/accessed_at is not a non-negative number");
      continue;
    }
    mirror_ent e;
    size_t n = (size_t)sqlite3_column_int64(s, 2);
    const int32_t *tok = sqlite3_column_blob(s, 1);
    /* SQLite blobs are not guaranteed 4-byte aligned: hash from the bytes, copy
     * for the block hashes only when misaligned. */
    int32_t *copy = NULL;
    if (n && ((uintptr_t)tok % sizeof(int32_t))) {
      copy = kvti_malloc(n * sizeof(int32_t));
      if (!copy) {
        ret = KVT_ERR_NOMEM();
        break;
      }
      memcpy(copy, tok, n * sizeof(int32_t));
      tok = copy;
    }
    ret = make_ent(&e, tok, n, 0);
    kvti_free(copy);
    if (ret)
      break;
    /* The key is the stored token_hash (what the reference and the files use);
     * lookups confirm candidates by hashing the query, so a blob that does not
     * hash to it is never served under another key. */
    if (unhex_of(e.sha, th) != 0) {
      skip_row(&idx->skipped, th, "bad token_hash");
      continue;
    }
    e.memory_bytes = (uint64_t)sqlite3_column_int64(s, 4);
    e.created_at = sqlite3_column_double(s, 5);
    e.accessed_at = sqlite3_column_double(s, 6);
    if (sqlite3_column_type(s, 7) != SQLITE_NULL) {
      if (sqlite3_column_type(s, 7) != SQLITE_INTEGER ||
          sqlite3_column_int64(s, 7) < 0 ||
          sqlite3_column_type(s, 8) != SQLITE_INTEGER ||
          (sqlite3_column_int64(s, 8) != KVT_STORAGE_NATIVE &&
           sqlite3_column_int64(s, 8) != KVT_STORAGE_COMPAT)) {
        skip_row(&idx->skipped, th, "kvtier_meta values out of range");
        continue;
      }
      e.disk_bytes = (uint64_t)sqlite3_column_int64(s, 7);
      e.storage_mode = (int32_t)sqlite3_column_int64(s, 8);
    } else {
      /* Written by the reference: measure the files (its mode is compat). */
      e.storage_mode = KVT_STORAGE_COMPAT;
      if (idx->data_dir) {
        char *dir = kvti_path_join(idx->data_dir, th);
        uint64_t b = 0;
        if (!dir) {
          ret = KVT_ENOMEM;
          break;
        }
        if (kvti_dir_bytes(&b, dir, 1) == 0) {
          e.disk_bytes = b;
          if (!idx->readonly) {
            if (nfix == capfix) {
              size_t nc = capfix ? capfix * 2 : 64;
              meta_fix *f = kvti_realloc(fix, nc * sizeof *f);
              if (!f) {
                kvti_free(dir);
                ret = KVT_ERR_NOMEM();
                break;
              }
              fix = f;
              capfix = nc;
            }
            memcpy(fix[nfix].th, th, 65);
            fix[nfix].disk_bytes = b;
            nfix++;
          }
        }
        kvti_free(dir);
      }
    }
    uint32_t dup;
    if (mirror_find(idx, e.sha, &dup)) {
      skip_row(&idx->skipped, th, "duplicate token_hash");
      continue;
    }
    if ((ret = mirror_reserve(idx)) != 0)
      break;
    mirror_add(idx, &e);
  }
  if (!ret && rc != SQLITE_ROW && rc != SQLITE_DONE)
    ret = db_err(idx, rc, "load");
  sqlite3_finalize(s);
  if (!ret && nfix) {
    ret = step_done(idx, ST_BEGIN, "begin");
    for (size_t i = 0; !ret && i < nfix; i++) {
      sqlite3_stmt *m = idx->st[ST_META_PUT];
      sqlite3_bind_text(m, 1, fix[i].th, 64, SQLITE_STATIC);
      sqlite3_bind_int64(m, 2, (sqlite3_int64)fix[i].disk_bytes);
      sqlite3_bind_int64(m, 3, KVT_STORAGE_COMPAT);
      ret = step_done(idx, ST_META_PUT, "record disk bytes");
    }
    if (!ret)
      ret = step_done(idx, ST_COMMIT, "commit");
    if (ret)
      rollback(idx);
  }
  kvti_free(fix);
  return ret;
}

static void index_destroy(kvt_index *idx) {
  if (!idx)
    return;
  for (int i = 0; i < ST_COUNT; i++)
    sqlite3_finalize(idx->st[i]);
  if (idx->db)
    sqlite3_close(idx->db);
  kvti_free(idx->ents);
  kvti_free(idx->heap[0]);
  kvti_free(idx->heap[1]);
  kvti_hm_free(&idx->exact);
  kvti_hm_free(&idx->seq);
  kvti_hm_free(&idx->nodes);
  kvti_free(idx->pend);
  kvti_free(idx->data_dir);
  kvti_free(idx->db_path);
  pthread_mutex_destroy(&idx->db_mu);
  pthread_mutex_destroy(&idx->pend_mu);
  pthread_rwlock_destroy(&idx->rw);
  kvti_free(idx);
}

int kvti_index_open(kvt_index **out, const char *cache_dir,
                    const char *data_dir, int readonly) {
  if (!out || !cache_dir || !*cache_dir)
    return KVT_ERR(KVT_EINVAL, "kvti_index_open: NULL argument");
  *out = NULL;
  kvt_index *idx = kvti_calloc(1, sizeof *idx);
  if (!idx)
    return KVT_ERR_NOMEM();
  pthread_mutex_init(&idx->db_mu, NULL);
  pthread_mutex_init(&idx->pend_mu, NULL);
  pthread_rwlock_init(&idx->rw, NULL);
  idx->readonly = readonly != 0;
  int rc = 0;
  idx->db_path = kvti_path_join(cache_dir, "index.db");
  if (!idx->db_path || (data_dir && !(idx->data_dir = kvti_strdup(data_dir)))) {
    rc = KVT_ENOMEM;
    goto fail;
  }
  int flags = (readonly ? SQLITE_OPEN_READONLY
                        : SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE) |
              SQLITE_OPEN_NOMUTEX | SQLITE_OPEN_NOFOLLOW;
  int src = sqlite3_open_v2(idx->db_path, &idx->db, flags, NULL);
  if (src != SQLITE_OK) {
    rc = db_err(idx, src, idx->db_path);
    goto fail;
  }
  sqlite3_busy_timeout(idx->db, BUSY_TIMEOUT_MS);
  sqlite3_extended_result_codes(idx->db, 1);
  if (!readonly) {
    if ((rc = exec_sql(idx, "PRAGMA journal_mode=WAL", "journal_mode")) != 0 ||
        (rc = exec_sql(idx, "PRAGMA synchronous=NORMAL", "synchronous")) != 0 ||
        (rc = create_tables(idx)) != 0)
      goto fail;
  }
  if ((rc = prepare_all(idx)) != 0 || (rc = load_mirror(idx)) != 0)
    goto fail;
  *out = idx;
  return 0;
fail:
  index_destroy(idx);
  return rc;
}

int kvti_index_set_durable(kvt_index *idx, int durable) {
  if (!idx)
    return KVT_ERR(KVT_EINVAL, "index is NULL");
  if (idx->readonly)
    return 0;
  pthread_mutex_lock(&idx->db_mu);
  int rc = exec_sql(
      idx, durable ? "PRAGMA synchronous=FULL" : "PRAGMA synchronous=NORMAL",
      "synchronous");
  /* On macOS SQLite's syncs are plain fsync(2), which does not flush the
   * drive's cache, unless fullfsync (and, in WAL mode, checkpoint_fullfsync)
   * make them F_FULLFSYNC. Elsewhere SQLite accepts and ignores both, so the
   * same statements run (and are tested) on every platform. */
  if (rc == 0)
    rc = exec_sql(idx, durable ? "PRAGMA fullfsync=ON" : "PRAGMA fullfsync=OFF",
                  "fullfsync");
  if (rc == 0)
    rc = exec_sql(idx,
                  durable ? "PRAGMA checkpoint_fullfsync=ON"
                          : "PRAGMA checkpoint_fullfsync=OFF",
                  "checkpoint_fullfsync");
  pthread_mutex_unlock(&idx->db_mu);
  return rc;
}

uint64_t kvti_index_skipped(kvt_index *idx) {
  if (!idx)
    return 0;
  pthread_rwlock_rdlock(&idx->rw);
  uint64_t n = idx->skipped;
  pthread_rwlock_unlock(&idx->rw);
  return n;
}

/* ---- writes ---- */

static int check_tokens(const int32_t *tokens, size_t n) {
  if (!tokens && n > 0)
    return KVT_ERR(KVT_EINVAL, "index: NULL tokens");
  if (n > MAX_TOKENS)
    return KVT_ERR(KVT_EINVAL, "index: too many tokens (%zu)", n);
  return 0;
}

/* check_tokens, then the sequence's key (SHA-256 of its int32 bytes). */
static int tokens_sha(uint8_t sha[32], const int32_t *tokens, size_t n) {
  int rc = check_tokens(tokens, n);
  return rc ? rc : sha256_bin(sha, tokens, n * sizeof(int32_t));
}

/* INSERT OR REPLACE as the reference; with_meta writes kvtier_meta too,
 * otherwise removes it (a reference-style row: disk bytes get measured at the
 * next open). */
/* Validates one put and builds its mirror record (hashes computed outside any
 * lock). */
static int put_prepare(mirror_ent *e, const kvti_index_put_args *a) {
  int rc = check_tokens(a->tokens, a->n);
  if (rc)
    return rc;
  if (a->memory_bytes > INT64_MAX || a->disk_bytes > INT64_MAX)
    return KVT_ERR(KVT_EINVAL, "index: byte count out of range");
  if (a->storage_mode != KVT_STORAGE_NATIVE &&
      a->storage_mode != KVT_STORAGE_COMPAT)
    return KVT_ERR(KVT_EINVAL, "index: bad storage_mode %d", a->storage_mode);
  if ((rc = make_ent(e, a->tokens, a->n, 1)) != 0)
    return rc;
  char th[65];
  hex_of(th, e->sha);
  if (a->hash && strcmp(a->hash, th) != 0)
    return KVT_ERR(KVT_EINVAL, "index: hash %.64s is not the tokens' hash %s",
                   a->hash, th);
  e->memory_bytes = a->memory_bytes;
  e->disk_bytes = a->disk_bytes;
  e->storage_mode = a->storage_mode;
  return 0;
}

/* The SQL of one put inside the open transaction: INSERT OR REPLACE as the
 * reference; with_meta writes kvtier_meta too, otherwise removes it (a
 * reference-style row: disk bytes get measured at the next open). */
static int put_sql(kvt_index *idx, const mirror_ent *e,
                   const kvti_index_put_args *a, int with_meta) {
  char th[65], ph[65];
  hex_of(th, e->sha);
  hex_of(ph, e->psha);
  sqlite3_stmt *s = idx->st[ST_INSERT];
  sqlite3_bind_text(s, 1, th, 64, SQLITE_STATIC);
  sqlite3_bind_blob(s, 2, a->n ? (const void *)a->tokens : "", (int)(a->n * 4),
                    SQLITE_STATIC);
  sqlite3_bind_text(s, 3, ph, 64, SQLITE_STATIC);
  sqlite3_bind_int64(s, 4, (sqlite3_int64)a->n);
  sqlite3_bind_text(s, 5, th, 64, SQLITE_STATIC);
  sqlite3_bind_int64(s, 6, (sqlite3_int64)e->memory_bytes);
  sqlite3_bind_double(s, 7, e->created_at);
  sqlite3_bind_double(s, 8, e->accessed_at);
  int rc = step_done(idx, ST_INSERT, "insert");
  if (!rc && with_meta) {
    s = idx->st[ST_META_PUT];
    sqlite3_bind_text(s, 1, th, 64, SQLITE_STATIC);
    sqlite3_bind_int64(s, 2, (sqlite3_int64)e->disk_bytes);
    sqlite3_bind_int64(s, 3, e->storage_mode);
    rc = step_done(idx, ST_META_PUT, "insert kvtier_meta");
  } else if (!rc) {
    sqlite3_bind_text(idx->st[ST_META_DEL], 1, th, 64, SQLITE_STATIC);
    rc = step_done(idx, ST_META_DEL, "delete kvtier_meta");
  }
  return rc;
}

/* Applies a committed put to the mirror. Caller holds rw (write). */
static int put_mirror(kvt_index *idx, const mirror_ent *e) {
  uint32_t id;
  if (mirror_find(idx, e->sha, &id)) {
    mirror_ent *o = &idx->ents[id];
    idx->sum_disk += e->disk_bytes - o->disk_bytes;
    idx->sum_mem += e->memory_bytes - o->memory_bytes;
    o->memory_bytes = e->memory_bytes;
    o->disk_bytes = e->disk_bytes;
    o->storage_mode = e->storage_mode;
    o->created_at = e->created_at;
    o->accessed_at = e->accessed_at;
    heap_fix(idx, H_LRU, o->heap_pos[H_LRU]);
    heap_fix(idx, H_CREATED, o->heap_pos[H_CREATED]);
    return 0;
  }
  int rc = mirror_reserve(idx);
  if (!rc)
    mirror_add(idx, e);
  return rc;
}

/* count puts in one SQLite transaction (all or none), then the mirror. */
static int put_common(kvt_index *idx, const kvti_index_put_args *a,
                      size_t count, int with_meta) {
  if (idx->readonly)
    return KVT_ERR(KVT_EPERM, "index: opened read-only");
  if (count == 0)
    return 0;
  mirror_ent one, *e = &one;
  if (count > 1) {
    if (count > SIZE_MAX / sizeof *e || !(e = kvti_malloc(count * sizeof *e)))
      return KVT_ERR_NOMEM();
  }
  int rc = 0;
  double now = now_s();
  for (size_t i = 0; !rc && i < count; i++) {
    rc = put_prepare(&e[i], &a[i]);
    e[i].created_at = e[i].accessed_at = now;
  }
  if (rc)
    goto out;
  pthread_mutex_lock(&idx->db_mu);
  rc = step_done(idx, ST_BEGIN, "begin");
  for (size_t i = 0; !rc && i < count; i++)
    rc = put_sql(idx, &e[i], &a[i], with_meta);
  if (!rc)
    rc = step_done(idx, ST_COMMIT, "commit");
  if (rc) {
    rollback(idx);
    pthread_mutex_unlock(&idx->db_mu);
    goto out;
  }
  pthread_rwlock_wrlock(&idx->rw);
  /* On ENOMEM here SQLite has the rows but the mirror lacks some: they are
   * served after reopen. */
  for (size_t i = 0; i < count; i++) {
    int r = put_mirror(idx, &e[i]);
    if (r && !rc)
      rc = r;
  }
  pthread_rwlock_unlock(&idx->rw);
  if (touches_due(idx, now))
    flush_locked(idx); /* a failure here loses only accessed_at updates */
  pthread_mutex_unlock(&idx->db_mu);
out:
  if (e != &one)
    kvti_free(e);
  return rc;
}

int kvti_index_put(kvt_index *idx, const int32_t *tokens, size_t n,
                   const char *hash, uint64_t memory_bytes, uint64_t disk_bytes,
                   int storage_mode) {
  if (!idx)
    return KVT_ERR(KVT_EINVAL, "kvti_index_put: NULL index");
  kvti_index_put_args a = {tokens,       n,          hash,
                           memory_bytes, disk_bytes, storage_mode};
  return put_common(idx, &a, 1, 1);
}

int kvti_index_put_many(kvt_index *idx, const kvti_index_put_args *puts,
                        size_t count) {
  if (!idx || (!puts && count))
    return KVT_ERR(KVT_EINVAL, "kvti_index_put_many: NULL argument");
  return put_common(idx, puts, count, 1);
}

static int remove_sha(kvt_index *idx, const uint8_t sha[32]) {
  if (idx->readonly)
    return KVT_ERR(KVT_EPERM, "index: opened read-only");
  char th[65];
  hex_of(th, sha);
  pthread_mutex_lock(&idx->db_mu);
  int rc = step_done(idx, ST_BEGIN, "begin");
  int changed = 0;
  if (!rc) {
    sqlite3_bind_text(idx->st[ST_DELETE], 1, th, 64, SQLITE_STATIC);
    rc = step_done(idx, ST_DELETE, "delete");
    changed = sqlite3_changes(idx->db);
  }
  if (!rc) {
    sqlite3_bind_text(idx->st[ST_META_DEL], 1, th, 64, SQLITE_STATIC);
    rc = step_done(idx, ST_META_DEL, "delete kvtier_meta");
  }
  if (!rc)
    rc = step_done(idx, ST_COMMIT, "commit");
  if (rc) {
    rollback(idx);
    pthread_mutex_unlock(&idx->db_mu);
    return rc;
  }
  pthread_rwlock_wrlock(&idx->rw);
  uint32_t id;
  int found = mirror_find(idx, sha, &id);
  if (found)
    mirror_del(idx, id);
  pthread_rwlock_unlock(&idx->rw);
  pthread_mutex_unlock(&idx->db_mu);
  if (!found && !changed)
    return KVT_ERR(KVT_ENOTFOUND, "index: no entry %s", th);
  return 0;
}

int kvti_index_remove_hash(kvt_index *idx, const char *hash) {
  uint8_t sha[32];
  if (!idx || unhex_of(sha, hash) != 0)
    return KVT_ERR(KVT_EINVAL, "kvti_index_remove_hash: bad argument");
  return remove_sha(idx, sha);
}

/* ---- touches ---- */

static int touch_cmp(const void *a, const void *b) {
  return memcmp(((const touch_rec *)a)->sha, ((const touch_rec *)b)->sha, 32);
}

/* Writes the pending touches in one transaction. Caller holds db_mu. */
static int flush_locked(kvt_index *idx) {
  pthread_mutex_lock(&idx->pend_mu);
  touch_rec *batch = idx->pend;
  size_t n = idx->pend_n;
  idx->pend = NULL;
  idx->pend_n = idx->pend_cap = 0;
  pthread_mutex_unlock(&idx->pend_mu);
  int rc = 0;
  if (n > 1) { /* one UPDATE per entry (SQLite rewrites the whole row, blob
                  included) */
    qsort(batch, n, sizeof *batch, touch_cmp);
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
      if (m && memcmp(batch[m - 1].sha, batch[i].sha, 32) == 0) {
        if (batch[i].t > batch[m - 1].t)
          batch[m - 1].t = batch[i].t;
      } else {
        batch[m++] = batch[i];
      }
    }
    n = m;
  }
  if (n && !idx->readonly) {
    rc = step_done(idx, ST_BEGIN, "begin");
    for (size_t i = 0; !rc && i < n; i++) {
      char th[65];
      hex_of(th, batch[i].sha);
      sqlite3_stmt *s = idx->st[ST_TOUCH];
      sqlite3_bind_double(s, 1, batch[i].t);
      sqlite3_bind_text(s, 2, th, 64, SQLITE_TRANSIENT);
      sqlite3_bind_double(s, 3, batch[i].t);
      rc = step_done(idx, ST_TOUCH, "touch");
    }
    if (!rc)
      rc = step_done(idx, ST_COMMIT, "commit");
    if (rc)
      rollback(idx);
  }
  kvti_free(batch);
  return rc;
}

int kvti_index_flush(kvt_index *idx) {
  if (!idx)
    return KVT_ERR(KVT_EINVAL, "kvti_index_flush: NULL index");
  pthread_mutex_lock(&idx->db_mu);
  int rc = flush_locked(idx);
  pthread_mutex_unlock(&idx->db_mu);
  return rc;
}

/* True when the pending touches are due (a full batch, or the oldest waited
 * TOUCH_MAX_AGE). */
static int touches_due(kvt_index *idx, double t) {
  pthread_mutex_lock(&idx->pend_mu);
  int due = idx->pend_n >= TOUCH_BATCH ||
            (idx->pend_n > 0 && t - idx->pend_first >= TOUCH_MAX_AGE);
  pthread_mutex_unlock(&idx->pend_mu);
  return due;
}

static int touch_sha(kvt_index *idx, const uint8_t sha[32]) {
  double t = now_s();
  pthread_rwlock_wrlock(&idx->rw);
  uint32_t id;
  if (!mirror_find(idx, sha, &id)) {
    pthread_rwlock_unlock(&idx->rw);
    char th[65];
    hex_of(th, sha);
    return KVT_ERR(KVT_ENOTFOUND, "index: no entry %s", th);
  }
  mirror_ent *e = &idx->ents[id];
  if (t > e->accessed_at) {
    e->accessed_at = t;
    heap_fix(idx, H_LRU, e->heap_pos[H_LRU]);
  } else {
    t = e->accessed_at;
  }
  pthread_mutex_lock(&idx->pend_mu);
  int rc = 0, need_flush = 0, must_flush = 0;
  if (idx->pend_n == idx->pend_cap) {
    size_t nc = idx->pend_cap ? idx->pend_cap * 2 : 64;
    touch_rec *p = kvti_realloc(idx->pend, nc * sizeof *p);
    if (!p)
      rc = KVT_ERR_NOMEM();
    else {
      idx->pend = p;
      idx->pend_cap = nc;
    }
  }
  if (!rc) {
    if (idx->pend_n == 0)
      idx->pend_first = t;
    memcpy(idx->pend[idx->pend_n].sha, sha, 32);
    idx->pend[idx->pend_n].t = t;
    idx->pend_n++;
    need_flush =
        idx->pend_n >= TOUCH_BATCH || t - idx->pend_first >= TOUCH_MAX_AGE;
    must_flush = idx->pend_n >= 16 * TOUCH_BATCH;
  }
  pthread_mutex_unlock(&idx->pend_mu);
  pthread_rwlock_unlock(&idx->rw);
  /* A touching (lookup) thread writes the batch only when SQLite is free;
   * otherwise the writer thread's next put/remove (or a later touch) does it.
   * Past 16 batches it waits, so the pending list stays bounded. */
  if (must_flush) {
    rc = kvti_index_flush(idx);
  } else if (need_flush && pthread_mutex_trylock(&idx->db_mu) == 0) {
    rc = flush_locked(idx);
    pthread_mutex_unlock(&idx->db_mu);
  }
  return rc;
}

int kvti_index_touch_hash(kvt_index *idx, const char *hash) {
  uint8_t sha[32];
  if (!idx || unhex_of(sha, hash) != 0)
    return KVT_ERR(KVT_EINVAL, "kvti_index_touch_hash: bad argument");
  return touch_sha(idx, sha);
}

/* ---- lookups ---- */

static int visible(const mirror_ent *e, double created_before) {
  return !(created_before > 0 && e->created_at < created_before);
}

/* The entry with key sha (if visible at created_before; 0: any) into out,
 * under the read lock. */
static inline int find_info(kvt_entry_info *out, kvt_index *idx,
                            const uint8_t sha[32], double created_before) {
  pthread_rwlock_rdlock(&idx->rw);
  uint32_t id;
  int found =
      mirror_find(idx, sha, &id) && visible(&idx->ents[id], created_before);
  if (found)
    fill_info(out, &idx->ents[id]);
  pthread_rwlock_unlock(&idx->rw);
  return found ? 0 : KVT_ERR(KVT_ENOTFOUND, "index: no such entry");
}

int kvti_index_find(kvt_entry_info *out, kvt_index *idx, const int32_t *tokens,
                    size_t n, double created_before) {
  if (!out || !idx)
    return KVT_ERR(KVT_EINVAL, "kvti_index_find: NULL argument");
  uint8_t sha[32];
  int rc = tokens_sha(sha, tokens, n);
  return rc ? rc : find_info(out, idx, sha, created_before);
}

int kvti_index_find_hash(kvt_entry_info *out, kvt_index *idx,
                         const char *hash) {
  uint8_t sha[32];
  if (!out || !idx || unhex_of(sha, hash) != 0)
    return KVT_ERR(KVT_EINVAL, "kvti_index_find_hash: bad argument");
  return find_info(out, idx, sha, 0);
}

/* Calls fn(ctx, id) for each stored non-empty sequence that is a prefix of
 * tokens, longest first, until fn returns nonzero. Caller holds rw (read).
 * Returns 0 or a negative code. */
typedef int (*prefix_fn)(void *ctx, kvt_index *idx, uint32_t id);

static int prefix_walk(kvt_index *idx, const int32_t *tokens, size_t n,
                       double created_before, prefix_fn fn, void *ctx) {
  if (n == 0 || idx->n_live == 0)
    return 0;
  size_t kmax = n / BLK;
  uint64_t stackbuf[256];
  uint64_t *hb = stackbuf;
  if (kmax + 1 > sizeof stackbuf / sizeof stackbuf[0]) {
    hb = kvti_malloc((kmax + 1) * sizeof *hb);
    if (!hb)
      return KVT_ERR_NOMEM();
  }
  hb[0] = HB0;
  /* All chained block hashes of the query: nodes exist only where entries end,
   * so an absent node at depth k says nothing about depth k+1 and every depth
   * is probed (deepest first). */
  for (size_t k = 0; k < kmax; k++)
    hb[k + 1] =
        XXH3_64bits_withSeed(tokens + k * BLK, BLK * sizeof(int32_t), hb[k]);
  int rc = 0, stop = 0;
  for (size_t kk = kmax + 1; kk-- > 0 && !stop;) {
    size_t pos = 0;
    kvti_hm_slot *node = kvti_hm_next(&idx->nodes, hb[kk], &pos);
    if (!node)
      continue;
    uint32_t mask = (uint32_t)(node->val >> 32);
    size_t base = kk * BLK;
    size_t tmax = n - base < BLK ? n - base : BLK - 1;
    for (size_t t = tmax + 1; t-- > 0 && !stop;) {
      if (!(mask & (1u << t)) || base + t == 0)
        continue;
      uint64_t hf = XXH3_64bits_withSeed(tokens + base, t * sizeof(int32_t),
                                         tail_seed(hb[kk], t));
      size_t p2 = 0;
      kvti_hm_slot *s;
      while (!stop && (s = kvti_hm_next(&idx->seq, hf, &p2)) != NULL) {
        const mirror_ent *e = &idx->ents[s->val];
        if (!e->live || e->num_tokens != base + t || e->hb != hb[kk] ||
            !visible(e, created_before))
          continue;
        uint8_t sha[32];
        if ((rc = sha256_bin(sha, tokens, (base + t) * sizeof(int32_t))) != 0) {
          stop = 1;
          break;
        }
        if (memcmp(sha, e->sha, 32) != 0)
          continue; /* 64-bit collision: not this entry */
        int r = fn(ctx, idx, (uint32_t)s->val);
        if (r < 0) {
          rc = r;
          stop = 1;
        } else if (r > 0) {
          stop = 1;
        }
        break; /* one entry per length */
      }
    }
  }
  if (hb != stackbuf)
    kvti_free(hb);
  return rc;
}

static int first_fn(void *ctx, kvt_index *idx, uint32_t id) {
  fill_info(ctx, &idx->ents[id]);
  return 1;
}

int kvti_index_find_prefix(kvt_entry_info *out, kvt_index *idx,
                           const int32_t *tokens, size_t n,
                           double created_before) {
  if (!out || !idx)
    return KVT_ERR(KVT_EINVAL, "kvti_index_find_prefix: NULL argument");
  int rc = check_tokens(tokens, n);
  if (rc)
    return rc;
  kvt_entry_info info;
  info.token_hash[0] = '\0';
  pthread_rwlock_rdlock(&idx->rw);
  rc = prefix_walk(idx, tokens, n, created_before, first_fn, &info);
  pthread_rwlock_unlock(&idx->rw);
  if (rc)
    return rc;
  if (!info.token_hash[0])
    return KVT_ERR(KVT_ENOTFOUND, "index: no such entry");
  *out = info;
  return 0;
}

void kvti_index_totals(kvt_index *idx, uint64_t *entries, uint64_t *disk_bytes,
                       uint64_t *memory_bytes) {
  uint64_t a = 0, b = 0, c = 0;
  if (idx) {
    pthread_rwlock_rdlock(&idx->rw);
    a = idx->n_live;
    b = idx->sum_disk;
    c = idx->sum_mem;
    pthread_rwlock_unlock(&idx->rw);
  }
  if (entries)
    *entries = a;
  if (disk_bytes)
    *disk_bytes = b;
  if (memory_bytes)
    *memory_bytes = c;
}

int kvti_index_lru_victim(kvt_entry_info *out, kvt_index *idx) {
  if (!out || !idx)
    return KVT_ERR(KVT_EINVAL, "kvti_index_lru_victim: NULL argument");
  pthread_rwlock_rdlock(&idx->rw);
  int found = idx->heap_n > 0;
  if (found)
    fill_info(out, &idx->ents[idx->heap[H_LRU][0]]);
  pthread_rwlock_unlock(&idx->rw);
  return found ? 0 : KVT_ERR(KVT_ENOTFOUND, "index: no such entry");
}

int kvti_index_oldest_before(kvt_entry_info *out, kvt_index *idx,
                             double cutoff) {
  if (!out || !idx)
    return KVT_ERR(KVT_EINVAL, "kvti_index_oldest_before: NULL argument");
  pthread_rwlock_rdlock(&idx->rw);
  int found =
      idx->heap_n > 0 && idx->ents[idx->heap[H_CREATED][0]].created_at < cutoff;
  if (found)
    fill_info(out, &idx->ents[idx->heap[H_CREATED][0]]);
  pthread_rwlock_unlock(&idx->rw);
  return found ? 0 : KVT_ERR(KVT_ENOTFOUND, "index: no such entry");
}

static int by_accessed_desc(const void *a, const void *b) {
  const kvt_entry_info *x = a, *y = b;
  if (x->accessed_at != y->accessed_at)
    return x->accessed_at < y->accessed_at ? 1 : -1;
  return strcmp(x->token_hash, y->token_hash);
}

int kvti_index_foreach(kvt_index *idx, kvt_entry_visit_fn fn, void *ctx) {
  if (!idx || !fn)
    return KVT_ERR(KVT_EINVAL, "kvti_index_foreach: NULL argument");
  pthread_rwlock_rdlock(&idx->rw);
  size_t n = idx->heap_n;
  kvt_entry_info *snap = kvti_malloc((n ? n : 1) * sizeof *snap);
  if (!snap) {
    pthread_rwlock_unlock(&idx->rw);
    return KVT_ERR_NOMEM();
  }
  for (size_t i = 0; i < n; i++)
    fill_info(&snap[i], &idx->ents[idx->heap[H_LRU][i]]);
  pthread_rwlock_unlock(&idx->rw);
  qsort(snap, n, sizeof *snap, by_accessed_desc);
  int rc = 0;
  for (size_t i = 0; i < n; i++)
    if (fn(ctx, &snap[i]) != 0)
      break;
  kvti_free(snap);
  return rc;
}

int kvti_index_tokens(int32_t **tokens, size_t *n, kvt_index *idx,
                      const char *hash) {
  if (!tokens || !n || !idx || !hash || !kvti_is_hash_name(hash))
    return KVT_ERR(KVT_EINVAL, "kvti_index_tokens: bad argument");
  pthread_mutex_lock(&idx->db_mu);
  sqlite3_stmt *s = idx->st[ST_TOKENS];
  sqlite3_bind_text(s, 1, hash, 64, SQLITE_STATIC);
  int rc = sqlite3_step(s), ret = 0;
  if (rc == SQLITE_ROW) {
    const unsigned char *fp = sqlite3_column_text(s, 2);
    int fl = sqlite3_column_bytes(s, 2);
    int bl = sqlite3_column_bytes(s, 0);
    sqlite3_int64 nt = sqlite3_column_int64(s, 1);
    if (!fp || fl != 64 || memcmp(fp, hash, 64) != 0 ||
        sqlite3_column_type(s, 1) != SQLITE_INTEGER || nt < 0 ||
        (uint64_t)nt > MAX_TOKENS || bl % 4 || (sqlite3_int64)bl != nt * 4) {
      ret = KVT_ERR(KVT_ECORRUPT, "index.db: row %s is malformed", hash);
    } else {
      int32_t *t = kvti_malloc(bl ? (size_t)bl : 1);
      if (!t)
        ret = KVT_ERR_NOMEM();
      else {
        if (bl)
          memcpy(t, sqlite3_column_blob(s, 0), (size_t)bl);
        *tokens = t;
        *n = (size_t)nt;
      }
    }
  } else if (rc == SQLITE_DONE) {
    ret = KVT_ERR(KVT_ENOTFOUND, "index: no entry %s", hash);
  } else {
    ret = db_err(idx, rc, "read tokens");
  }
  sqlite3_reset(s);
  sqlite3_clear_bindings(s);
  pthread_mutex_unlock(&idx->db_mu);
  return ret;
}

int kvti_index_bench_add(kvt_index *idx, const int32_t *tokens, size_t n,
                         double t) {
  if (!idx)
    return KVT_ERR(KVT_EINVAL, "kvti_index_bench_add: NULL index");
  mirror_ent e;
  int rc = check_tokens(tokens, n);
  if (rc || (rc = make_ent(&e, tokens, n, 1)) != 0)
    return rc;
  e.created_at = e.accessed_at = t;
  pthread_rwlock_wrlock(&idx->rw);
  uint32_t id;
  if (!mirror_find(idx, e.sha, &id) && (rc = mirror_reserve(idx)) == 0)
    mirror_add(idx, &e);
  pthread_rwlock_unlock(&idx->rw);
  return rc;
}

/* Memory held by the lookup structures (bench/diagnostics). */
uint64_t kvti_index_mem_bytes(kvt_index *idx) {
  if (!idx)
    return 0;
  pthread_rwlock_rdlock(&idx->rw);
  uint64_t b = (uint64_t)idx->cap_ents * sizeof(mirror_ent) +
               2ull * idx->heap_cap * sizeof(uint32_t) +
               kvti_hm_bytes(&idx->exact) + kvti_hm_bytes(&idx->seq) +
               kvti_hm_bytes(&idx->nodes);
  pthread_rwlock_unlock(&idx->rw);
  return b;
}

/* ---- the public SSDIndex API ---- */

void kvt_index_rows_free(kvt_index_rows *rows) {
  if (!rows)
    return;
  for (size_t i = 0; i < rows->count; i++)
    kvti_free((void *)rows->rows[i].tokens);
  kvti_free(rows->rows);
  rows->rows = NULL;
  rows->count = 0;
}

int kvt_index_open(kvt_index **out, const char *cache_dir) {
  return kvti_index_open(out, cache_dir, NULL, 0);
}

void kvt_index_close(kvt_index *idx) {
  if (!idx)
    return;
  kvti_index_flush(idx);
  index_destroy(idx);
}

int kvt_index_insert(kvt_index *idx, const int32_t *tokens, size_t n,
                     const char *file_path, uint64_t memory_bytes,
                     uint64_t num_tokens) {
  if (!idx || !file_path)
    return KVT_ERR(KVT_EINVAL, "kvt_index_insert: NULL argument");
  /* kvtier only ever stores entries under their own hash: any other file_path
   * would be an arbitrary path handed to readers of the index. */
  if (num_tokens != n)
    return KVT_ERR(KVT_EINVAL,
                   "kvt_index_insert: num_tokens %llu != %zu tokens",
                   (unsigned long long)num_tokens, n);
  if (!kvti_is_hash_name(file_path))
    return KVT_ERR(KVT_EINVAL,
                   "kvt_index_insert: file_path must be the token hash");
  kvti_index_put_args a = {tokens,       n, file_path,
                           memory_bytes, 0, KVT_STORAGE_COMPAT};
  return put_common(idx, &a, 1, 0);
}

static void row_from_ent(kvt_index_row *r, const mirror_ent *e) {
  memset(r, 0, sizeof *r);
  hex_of(r->token_hash, e->sha);
  memcpy(r->file_path, r->token_hash, 65);
  r->num_tokens = e->num_tokens;
  r->memory_bytes = e->memory_bytes;
  r->created_at = e->created_at;
  r->accessed_at = e->accessed_at;
}

int kvt_index_lookup_exact(kvt_index_row *out, kvt_index *idx,
                           const int32_t *tokens, size_t n) {
  if (!out || !idx)
    return KVT_ERR(KVT_EINVAL, "kvt_index_lookup_exact: NULL argument");
  uint8_t sha[32];
  int rc = tokens_sha(sha, tokens, n);
  if (rc)
    return rc;
  pthread_rwlock_rdlock(&idx->rw);
  uint32_t id;
  int found = mirror_find(idx, sha, &id);
  if (found)
    row_from_ent(out, &idx->ents[id]);
  pthread_rwlock_unlock(&idx->rw);
  return found ? 0 : KVT_ERR(KVT_ENOTFOUND, "index: no such entry");
}

typedef struct collect_ctx {
  kvt_index_row *rows;
  size_t n, cap;
} collect_ctx;

/* Room for one more row at c->rows[c->n] (the capacity doubles, starting at
 * first_cap); NULL when out of memory. */
static kvt_index_row *collect_slot(collect_ctx *c, size_t first_cap) {
  if (c->n == c->cap) {
    size_t nc = c->cap ? c->cap * 2 : first_cap;
    kvt_index_row *r = kvti_realloc(c->rows, nc * sizeof *r);
    if (!r)
      return NULL;
    c->rows = r;
    c->cap = nc;
  }
  return &c->rows[c->n];
}

static int collect_fn(void *ctx, kvt_index *idx, uint32_t id) {
  collect_ctx *c = ctx;
  kvt_index_row *r = collect_slot(c, 8);
  if (!r)
    return KVT_ERR_NOMEM();
  row_from_ent(r, &idx->ents[id]);
  c->n++;
  return 0;
}

/* Hands the collected rows to out, or (rc != 0) releases them with their
 * tokens. Returns rc. */
static int collect_finish(kvt_index_rows *out, collect_ctx *c, int rc) {
  kvt_index_rows rows = {c->rows, c->n};
  if (rc)
    kvt_index_rows_free(&rows);
  else
    *out = rows;
  return rc;
}

int kvt_index_lookup_prefix(kvt_index_rows *out, kvt_index *idx,
                            const int32_t *tokens, size_t n) {
  if (!out || !idx)
    return KVT_ERR(KVT_EINVAL, "kvt_index_lookup_prefix: NULL argument");
  int rc = check_tokens(tokens, n);
  if (rc)
    return rc;
  collect_ctx c = {0};
  pthread_rwlock_rdlock(&idx->rw);
  rc = prefix_walk(idx, tokens, n, 0, collect_fn, &c);
  pthread_rwlock_unlock(&idx->rw);
  /* The matched rows' tokens are the query's prefixes: copy them. */
  for (size_t i = 0; !rc && i < c.n; i++) {
    size_t nt = (size_t)c.rows[i].num_tokens;
    int32_t *t = kvti_malloc(nt * sizeof(int32_t));
    if (!t) {
      rc = KVT_ERR_NOMEM();
      break;
    }
    memcpy(t, tokens, nt * sizeof(int32_t));
    c.rows[i].tokens = t;
    c.rows[i].n_tokens = nt;
  }
  return collect_finish(out, &c, rc);
}

int kvt_index_delete(kvt_index *idx, const int32_t *tokens, size_t n) {
  if (!idx)
    return KVT_ERR(KVT_EINVAL, "kvt_index_delete: NULL index");
  uint8_t sha[32];
  int rc = tokens_sha(sha, tokens, n);
  if (rc == 0)
    rc = remove_sha(idx, sha);
  return rc == KVT_ENOTFOUND ? 0 : rc; /* the reference's DELETE is silent */
}

/* Rows from SQLite in accessed_at order (after flushing touches), validated as
 * at open. */
static int sql_rows(kvt_index_rows *out, kvt_index *idx, const char *sql,
                    int64_t limit) {
  int rc = kvti_index_flush(idx);
  if (rc)
    return rc;
  collect_ctx c = {0};
  pthread_mutex_lock(&idx->db_mu);
  sqlite3_stmt *s = NULL;
  int src = sqlite3_prepare_v2(idx->db, sql, -1, &s, NULL);
  if (src != SQLITE_OK) {
    rc = db_err(idx, src, "select");
    goto out;
  }
  if (limit >= 0)
    sqlite3_bind_int64(s, 1, limit);
  while ((src = sqlite3_step(s)) == SQLITE_ROW) {
    char th[65];
    /* Invalid rows were counted at open; here they are only left out. */
    int ok = row_valid(NULL, s, 0, 1, 2, 3, th) && num_ok(s, 4) &&
             num_ok(s, 5) && num_ok(s, 6);
    if (!ok)
      continue;
    kvt_index_row *r = collect_slot(&c, 16);
    if (!r) {
      rc = KVT_ERR_NOMEM();
      goto out;
    }
    memset(r, 0, sizeof *r);
    memcpy(r->token_hash, th, 65);
    memcpy(r->file_path, th, 65);
    r->num_tokens = (uint64_t)sqlite3_column_int64(s, 2);
    r->memory_bytes = (uint64_t)sqlite3_column_int64(s, 4);
    r->created_at = sqlite3_column_double(s, 5);
    r->accessed_at = sqlite3_column_double(s, 6);
    size_t bl = (size_t)sqlite3_column_bytes(s, 1);
    int32_t *t = kvti_malloc(bl ? bl : 1);
    if (!t) {
      rc = KVT_ERR_NOMEM();
      goto out;
    }
    if (bl)
      memcpy(t, sqlite3_column_blob(s, 1), bl);
    r->tokens = t;
    r->n_tokens = bl / 4;
    c.n++;
  }
  if (src != SQLITE_DONE)
    rc = db_err(idx, src, "select");
out:
  sqlite3_finalize(s);
  pthread_mutex_unlock(&idx->db_mu);
  return collect_finish(out, &c, rc);
}

int kvt_index_lru(kvt_index_rows *out, kvt_index *idx, size_t limit) {
  if (!out || !idx)
    return KVT_ERR(KVT_EINVAL, "kvt_index_lru: NULL argument");
  return sql_rows(
      out, idx,
      "SELECT token_hash, tokens_blob, num_tokens, file_path, memory_bytes, "
      "created_at, accessed_at FROM entries ORDER BY accessed_at ASC LIMIT ?",
      limit > INT64_MAX ? INT64_MAX : (int64_t)limit);
}

int kvt_index_all(kvt_index_rows *out, kvt_index *idx) {
  if (!out || !idx)
    return KVT_ERR(KVT_EINVAL, "kvt_index_all: NULL argument");
  return sql_rows(
      out, idx,
      "SELECT token_hash, tokens_blob, num_tokens, file_path, memory_bytes, "
      "created_at, accessed_at FROM entries ORDER BY accessed_at DESC",
      -1);
}

int kvt_index_total_bytes(uint64_t *out, kvt_index *idx) {
  if (!out || !idx)
    return KVT_ERR(KVT_EINVAL, "kvt_index_total_bytes: NULL argument");
  kvti_index_totals(idx, NULL, NULL, out);
  return 0;
}

int kvt_index_count(uint64_t *out, kvt_index *idx) {
  if (!out || !idx)
    return KVT_ERR(KVT_EINVAL, "kvt_index_count: NULL argument");
  kvti_index_totals(idx, out, NULL, NULL);
  return 0;
}

int kvt_index_touch(kvt_index *idx, const int32_t *tokens, size_t n) {
  if (!idx)
    return KVT_ERR(KVT_EINVAL, "kvt_index_touch: NULL index");
  uint8_t sha[32];
  int rc = tokens_sha(sha, tokens, n);
  if (rc == 0)
    rc = touch_sha(idx, sha);
  return rc == KVT_ENOTFOUND ? 0 : rc; /* the reference's UPDATE is silent */
}
