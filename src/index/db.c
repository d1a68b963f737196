/*
 * db.c - the SQLite side of the index: the reference's SQL text (its SSDIndex
 * schema byte for byte) plus kvtier's side table, the shared statement and
 * error helpers, open with schema creation and migration (prefix_hash added
 * and backfilled, stale kvtier_meta rows removed), loading the mirror from the
 * rows, close, and the reads that need SQL (kvti_index_tokens). SQLite is the
 * durable record and the format the reference reads; lookups never come here.
 *   Rows read from index.db are untrusted: a row whose file_path is not the
 * 64-hex token_hash, whose blob length is not num_tokens*4, or with
 * negative/ill-typed numbers is skipped (counted, error message set) and never
 * served. A row without kvtier_meta (the reference wrote it) gets its disk
 * bytes from the caller's measuring callback; the index knows no file layout.
 *   Locks: db_mu serialises SQLite; rw protects the mirror; pend_mu the pending
 * touches. Order is always db_mu -> rw -> pend_mu.
 */
#include "index/internal.h"

#include "base/error.h"
#include "base/hash.h"
#include "base/hashmap.h"
#include "base/io.h"
#include "base/vec.h"
#include "base/sqlvfs.h"

#include <math.h>
#include <pthread.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

int kvti_idx_code(int rc) {
  switch (rc & 0xff) {
  case SQLITE_FULL:
    return KVT_ENOSPC;
  case SQLITE_IOERR:
    return KVT_EIO;
  case SQLITE_NOMEM:
    return KVT_ENOMEM;
  case SQLITE_BUSY:
  case SQLITE_LOCKED:
    return KVT_EBUSY;
  default:
    return KVT_EDB;
  }
}

/* The last SQLite result code an index error reported on this thread. */
static _Thread_local int tl_last_rc;

int kvti_index_error_is_damage(void) {
  int p = tl_last_rc & 0xff;
  return p == SQLITE_NOTADB || p == SQLITE_CORRUPT;
}

int kvti_idx_db_err(kvt_index *idx, int rc, const char *what) {
  tl_last_rc = rc;
  if (idx && ((rc & 0xff) == SQLITE_CORRUPT || (rc & 0xff) == SQLITE_NOTADB))
    atomic_store(&idx->damaged, 1);
  const char *msg =
      idx && idx->db ? sqlite3_errmsg(idx->db) : sqlite3_errstr(rc);
  int code = kvti_idx_code(rc);
  return KVT_ERR(code, "index.db: %s: %s (SQLite %d)", what, msg, rc);
}

int kvti_index_damaged(kvt_index *idx) {
  return idx && atomic_load(&idx->damaged);
}

/* One row of PRAGMA quick_check: "ok", or a description of damage. */
static int qc_row(void *ctx, int n, char **v, char **names) {
  (void)names;
  char **first = ctx;
  if (n > 0 && v[0] && !*first)
    *first = sqlite3_mprintf("%s", v[0]);
  return 0;
}

int kvti_index_quick_check(kvt_index *idx) {
  if (!idx)
    return KVT_ERR(KVT_EINVAL, "kvti_index_quick_check: NULL index");
  pthread_mutex_lock(&idx->db_mu);
  /* The check is of the file, not of pages this connection has cached. */
  sqlite3_db_release_memory(idx->db);
  char *first = NULL, *em = NULL;
  int rc = sqlite3_exec(idx->db, "PRAGMA quick_check(1)", qc_row, &first, &em);
  int ret = 0;
  if (rc != SQLITE_OK) {
    ret = kvti_idx_db_err(idx, rc, "quick_check");
  } else if (!first || strcmp(first, "ok") != 0) {
    atomic_store(&idx->damaged, 1);
    tl_last_rc = SQLITE_CORRUPT;
    ret = KVT_ERR(KVT_ECORRUPT, "%s is damaged (quick_check: %s)",
                  idx->db_path ? idx->db_path : "index.db",
                  first ? first : "no result");
  }
  sqlite3_free(first);
  sqlite3_free(em);
  pthread_mutex_unlock(&idx->db_mu);
  return ret;
}

int kvti_idx_exec(kvt_index *idx, const char *sql, const char *what) {
  char *em = NULL;
  int rc = sqlite3_exec(idx->db, sql, NULL, NULL, &em);
  if (rc != SQLITE_OK) {
    tl_last_rc = rc;
    if ((rc & 0xff) == SQLITE_CORRUPT || (rc & 0xff) == SQLITE_NOTADB)
      atomic_store(&idx->damaged, 1);
    int code = kvti_idx_code(rc);
    KVT_ERR(code, "index.db: %s: %s (SQLite %d)", what,
            em ? em : sqlite3_errmsg(idx->db), rc);
    sqlite3_free(em);
    return code;
  }
  return 0;
}

/* Runs a prepared statement that returns no rows, then resets it. */
int kvti_idx_step(kvt_index *idx, int which, const char *what) {
  sqlite3_stmt *s = idx->st[which];
  int rc = sqlite3_step(s);
  int out = 0;
  if (rc != SQLITE_DONE && rc != SQLITE_ROW)
    out = kvti_idx_db_err(idx, rc, what);
  sqlite3_reset(s);
  sqlite3_clear_bindings(s);
  return out;
}

void kvti_idx_rollback(kvt_index *idx) {
  if (!sqlite3_get_autocommit(idx->db)) {
    sqlite3_step(idx->st[ST_ROLLBACK]);
    sqlite3_reset(idx->st[ST_ROLLBACK]);
  }
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
      return kvti_idx_db_err(idx, rc, "prepare");
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
    return kvti_idx_db_err(idx, rc, "table_info");
  *out = 0;
  while ((rc = sqlite3_step(s)) == SQLITE_ROW) {
    const unsigned char *name = sqlite3_column_text(s, 1);
    if (name && strcmp((const char *)name, col) == 0)
      *out = 1;
  }
  int ret = rc == SQLITE_DONE ? 0 : kvti_idx_db_err(idx, rc, "table_info");
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
    ret = kvti_idx_db_err(idx, rc, "backfill prepare");
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
    if ((ret = KVTI_VEC_RESERVE(&rows, &cap, n + 1, 64)) != 0)
      break;
    memcpy(rows[n].th, th, (size_t)thlen);
    rows[n].th[thlen] = '\0';
    size_t nt = (size_t)blen / 4;
    ret =
        kvti_idx_sha256((uint8_t *)rows[n].ph, blob, (nt < BLK ? nt : BLK) * 4);
    if (ret)
      break;
    uint8_t b[32];
    memcpy(b, rows[n].ph, 32);
    kvti_idx_hex(rows[n].ph, b);
    n++;
  }
  if (!ret && rc != SQLITE_ROW && rc != SQLITE_DONE)
    ret = kvti_idx_db_err(idx, rc, "backfill select");
  for (size_t i = 0; !ret && i < n; i++) {
    sqlite3_bind_text(upd, 1, rows[i].ph, 64, SQLITE_STATIC);
    sqlite3_bind_text(upd, 2, rows[i].th, -1, SQLITE_STATIC);
    rc = sqlite3_step(upd);
    if (rc != SQLITE_DONE)
      ret = kvti_idx_db_err(idx, rc, "backfill update");
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
  int rc = kvti_idx_exec(idx, "BEGIN IMMEDIATE", "begin");
  if (rc)
    return rc;
  rc = kvti_idx_exec(idx, SCHEMA_SQL, "create tables");
  int has = 0;
  if (!rc)
    rc = has_column(idx, "entries", "prefix_hash", &has);
  if (!rc && !has)
    rc = kvti_idx_exec(idx, "ALTER TABLE entries ADD COLUMN prefix_hash TEXT",
                       "add prefix_hash");
  if (!rc)
    rc = kvti_idx_exec(idx, INDEX_SQL, "create indexes");
  if (!rc) {
    sqlite3_stmt *s = NULL;
    int r = sqlite3_prepare_v2(idx->db, "SELECT COUNT(*) FROM schema_version",
                               -1, &s, NULL);
    if (r == SQLITE_OK && (r = sqlite3_step(s)) == SQLITE_ROW) {
      if (sqlite3_column_int64(s, 0) == 0)
        rc = kvti_idx_exec(idx,
                           "INSERT INTO schema_version (version) VALUES (1)",
                           "schema_version");
    } else {
      rc = kvti_idx_db_err(idx, r, "schema_version");
    }
    sqlite3_finalize(s);
  }
  if (!rc)
    rc = backfill(idx);
  if (!rc)
    rc = kvti_idx_exec(idx, META_SQL, "create kvtier_meta");
  if (!rc)
    rc =
        kvti_idx_exec(idx,
                      "DELETE FROM kvtier_meta WHERE token_hash NOT IN (SELECT "
                      "token_hash FROM "
                      "entries)",
                      "remove stale kvtier_meta rows");
  if (!rc)
    rc = kvti_idx_exec(idx, "COMMIT", "commit");
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
    return kvti_idx_db_err(idx, rc, "sqlite_master");
  sqlite3_bind_text(s, 1, name, -1, SQLITE_STATIC);
  rc = sqlite3_step(s);
  *out = rc == SQLITE_ROW;
  int ret = (rc == SQLITE_ROW || rc == SQLITE_DONE)
                ? 0
                : kvti_idx_db_err(idx, rc, "sqlite_master");
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
int kvti_idx_row_valid(uint64_t *skipped, sqlite3_stmt *s, int col_th,
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

int kvti_idx_num_ok(sqlite3_stmt *s, int col) {
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
    return kvti_idx_db_err(idx, rc, "load");
  meta_fix *fix = NULL;
  size_t nfix = 0, capfix = 0;
  int ret = 0;
  char th[65];
  while ((rc = sqlite3_step(s)) == SQLITE_ROW) {
    if (!kvti_idx_row_valid(&idx->skipped, s, 0, 1, 2, 3, th))
      continue;
    if (!kvti_idx_num_ok(s, 4) || sqlite3_column_type(s, 4) != SQLITE_INTEGER) {
      skip_row(&idx->skipped, th, "memory_bytes is not a non-negative integer");
      continue;
    }
    if (!kvti_idx_num_ok(s, 5) || !kvti_idx_num_ok(s, 6)) {
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
    ret = kvti_idx_make_ent(&e, tok, n, 0);
    kvti_free(copy);
    if (ret)
      break;
    /* The key is the stored token_hash (what the reference and the files use);
     * lookups confirm candidates by hashing the query, so a blob that does not
     * hash to it is never served under another key. */
    if (kvti_idx_unhex(e.sha, th) != 0) {
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
      /* Written by the reference (its mode is compat): the caller measures
       * the stored entry. */
      e.storage_mode = KVT_STORAGE_COMPAT;
      if (idx->measure.fn) {
        uint64_t b = 0;
        int m = idx->measure.fn(idx->measure.ctx, th, &b);
        if (m < 0) {
          ret = m;
          break;
        }
        if (m == 1) {
          e.disk_bytes = b;
          if (!idx->readonly) {
            if ((ret = KVTI_VEC_RESERVE(&fix, &capfix, nfix + 1, 64)) != 0)
              break;
            memcpy(fix[nfix].th, th, 65);
            fix[nfix].disk_bytes = b;
            nfix++;
          }
        }
      }
    }
    uint32_t dup;
    if (kvti_idx_mirror_find(idx, e.sha, &dup)) {
      skip_row(&idx->skipped, th, "duplicate token_hash");
      continue;
    }
    if ((ret = kvti_idx_mirror_reserve(idx)) != 0)
      break;
    kvti_idx_mirror_add(idx, &e);
  }
  if (!ret && rc != SQLITE_ROW && rc != SQLITE_DONE)
    ret = kvti_idx_db_err(idx, rc, "load");
  sqlite3_finalize(s);
  if (!ret && nfix) {
    ret = kvti_idx_step(idx, ST_BEGIN, "begin");
    for (size_t i = 0; !ret && i < nfix; i++) {
      sqlite3_stmt *m = idx->st[ST_META_PUT];
      sqlite3_bind_text(m, 1, fix[i].th, 64, SQLITE_STATIC);
      sqlite3_bind_int64(m, 2, (sqlite3_int64)fix[i].disk_bytes);
      sqlite3_bind_int64(m, 3, KVT_STORAGE_COMPAT);
      ret = kvti_idx_step(idx, ST_META_PUT, "record disk bytes");
    }
    if (!ret)
      ret = kvti_idx_step(idx, ST_COMMIT, "commit");
    if (ret)
      kvti_idx_rollback(idx);
  }
  kvti_free(fix);
  return ret;
}

void kvti_idx_destroy(kvt_index *idx) {
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
  kvti_free(idx->db_path);
  pthread_mutex_destroy(&idx->db_mu);
  pthread_mutex_destroy(&idx->pend_mu);
  pthread_rwlock_destroy(&idx->rw);
  kvti_free(idx);
}

/* A read-only open of an index.db whose tables do not exist yet (an empty
 * file: the writer that created it has not created the schema yet) would
 * fail every statement with "no such table". Such an index is empty: it is
 * served from an empty in-memory database with the schema instead. */
static int readonly_schema(kvt_index *idx) {
  sqlite3_stmt *s = NULL;
  int rc = sqlite3_prepare_v2(idx->db,
                              "SELECT count(*) FROM sqlite_master WHERE "
                              "type = 'table' AND name = 'entries'",
                              -1, &s, NULL);
  if (rc != SQLITE_OK)
    return kvti_idx_db_err(idx, rc, "schema");
  rc = sqlite3_step(s);
  int have = rc == SQLITE_ROW && sqlite3_column_int(s, 0) > 0;
  sqlite3_finalize(s);
  if (rc != SQLITE_ROW)
    return kvti_idx_db_err(idx, rc, "schema");
  if (have)
    return 0;
  sqlite3_close(idx->db);
  idx->db = NULL;
  rc = sqlite3_open_v2(":memory:", &idx->db,
                       SQLITE_OPEN_READWRITE | SQLITE_OPEN_NOMUTEX, NULL);
  if (rc != SQLITE_OK)
    return kvti_idx_db_err(idx, rc, "in-memory index");
  return create_tables(idx);
}

int kvti_index_open(kvt_index **out, const char *cache_dir,
                    const kvti_index_measure *measure, int mode) {
  int readonly = (mode & KVTI_INDEX_READONLY) != 0;
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
  idx->db_path = kvti_path_join(cache_dir, KVTI_INDEX_DB_FILE);
  if (measure)
    idx->measure = *measure;
  if (!idx->db_path) {
    rc = KVT_ENOMEM;
    goto fail;
  }
  int flags = (readonly ? SQLITE_OPEN_READONLY
                        : SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE) |
              SQLITE_OPEN_NOMUTEX | SQLITE_OPEN_NOFOLLOW;
  tl_last_rc = 0;
  /* Through kvtier's VFS: index.db's file I/O goes through the I/O seam. */
  const char *vfs = kvti_sqlvfs_name();
  if (!vfs) {
    rc = KVT_EDB;
    goto fail;
  }
  int src = sqlite3_open_v2(idx->db_path, &idx->db, flags, vfs);
  if (src != SQLITE_OK) {
    rc = kvti_idx_db_err(idx, src, idx->db_path);
    goto fail;
  }
  sqlite3_busy_timeout(idx->db, BUSY_TIMEOUT_MS);
  sqlite3_extended_result_codes(idx->db, 1);
  if (readonly && (rc = readonly_schema(idx)) != 0)
    goto fail;
  if (!readonly) {
    if ((rc = kvti_idx_exec(idx, "PRAGMA journal_mode=WAL", "journal_mode")) !=
            0 ||
        (rc = kvti_idx_exec(idx, "PRAGMA synchronous=NORMAL", "synchronous")) !=
            0 ||
        (rc = create_tables(idx)) != 0)
      goto fail;
  }
  if ((rc = prepare_all(idx)) != 0 ||
      (!(mode & KVTI_INDEX_SQL_ONLY) && (rc = load_mirror(idx)) != 0))
    goto fail;
  *out = idx;
  return 0;
fail:
  kvti_idx_destroy(idx);
  return rc;
}

int kvti_index_set_durable(kvt_index *idx, int durable) {
  if (!idx)
    return KVT_ERR(KVT_EINVAL, "index is NULL");
  if (idx->readonly)
    return 0;
  pthread_mutex_lock(&idx->db_mu);
  int rc = kvti_idx_exec(
      idx, durable ? "PRAGMA synchronous=FULL" : "PRAGMA synchronous=NORMAL",
      "synchronous");
  /* On macOS SQLite's syncs are plain fsync(2), which does not flush the
   * drive's cache, unless fullfsync (and, in WAL mode, checkpoint_fullfsync)
   * make them F_FULLFSYNC. Elsewhere SQLite accepts and ignores both, so the
   * same statements run (and are tested) on every platform. */
  if (rc == 0)
    rc = kvti_idx_exec(idx,
                       durable ? "PRAGMA fullfsync=ON" : "PRAGMA fullfsync=OFF",
                       "fullfsync");
  if (rc == 0)
    rc = kvti_idx_exec(idx,
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
    ret = kvti_idx_db_err(idx, rc, "read tokens");
  }
  sqlite3_reset(s);
  sqlite3_clear_bindings(s);
  pthread_mutex_unlock(&idx->db_mu);
  return ret;
}

/* ---- raw SQL access for the public SSDIndex API (ssdindex.c) ---- */

sqlite3 *kvti_index_sql_begin(kvt_index *idx) {
  pthread_mutex_lock(&idx->db_mu);
  return idx->db;
}

void kvti_index_sql_end(kvt_index *idx) {
  pthread_mutex_unlock(&idx->db_mu);
}

int kvti_index_sql_err(kvt_index *idx, int rc, const char *what) {
  return kvti_idx_db_err(idx, rc, what);
}
