/*
 * ssdrows.c - the rows of the public kvt_index_* API (ssdindex.c,
 * ssdprefix.c): one row read from a statement over the reference's columns
 * (token_hash, tokens_blob, num_tokens, file_path, memory_bytes, created_at,
 * accessed_at), a statement stepped to the end into a list of rows with an
 * optional filter, a row's whole file_path, and the release of a list. A
 * list row holds its tokens and its whole file_path in one allocation (the
 * path after the tokens), which kvt_index_rows_free releases with them.
 */
#include "index/internal.h"

#include "base/vec.h"
#include "base/error.h"
#include "base/io.h"
#include "kvtier.h"

#include <sqlite3.h>
#include <stdint.h>
#include <string.h>

typedef struct row_list {
  kvt_index_row *rows;
  size_t n, cap;
} row_list;

int kvti_ssd_read_row(kvt_index_row *r, sqlite3_stmt *s, int with_tokens) {
  memset(r, 0, sizeof *r);
  memcpy(r->token_hash, sqlite3_column_text(s, 0), 64);
  r->num_tokens = (uint64_t)sqlite3_column_int64(s, 2);
  r->memory_bytes = (uint64_t)sqlite3_column_int64(s, 4);
  r->created_at = sqlite3_column_double(s, 5);
  r->accessed_at = sqlite3_column_double(s, 6);
  const unsigned char *fp = sqlite3_column_text(s, 3);
  size_t fl = (size_t)sqlite3_column_bytes(s, 3);
  if (!fp)
    return KVT_ERR_NOMEM();
  if (fl < sizeof r->file_path)
    memcpy(r->file_path, fp, fl + 1);
  if (!with_tokens) {
    if (fl >= sizeof r->file_path)
      return KVT_ERR(KVT_ERANGE,
                     "index: file_path of %zu bytes does not fit "
                     "kvt_index_row.file_path; use kvt_index_get",
                     fl);
    return 0;
  }
  size_t bl = (size_t)sqlite3_column_bytes(s, 1);
  char *block = kvti_malloc(bl + fl + 1);
  if (!block)
    return KVT_ERR_NOMEM();
  if (bl)
    memcpy(block, sqlite3_column_blob(s, 1), bl);
  memcpy(block + bl, fp, fl);
  block[bl + fl] = '\0';
  r->tokens = (const int32_t *)(void *)block;
  r->n_tokens = bl / 4;
  return 0;
}

static int list_add(row_list *l, sqlite3_stmt *s) {
  if (KVTI_VEC_RESERVE(&l->rows, &l->cap, l->n + 1, 8) != 0)
    return KVT_ENOMEM;
  int rc = kvti_ssd_read_row(&l->rows[l->n], s, 1);
  if (rc == 0)
    l->n++;
  return rc;
}

int kvti_ssd_collect(kvt_index_rows *out, kvt_index *idx, sqlite3_stmt *s,
                     int (*keep)(const kvt_index_row *, const void *),
                     const void *kctx) {
  row_list l = {0};
  int rc = 0, src;
  while ((src = sqlite3_step(s)) == SQLITE_ROW) {
    if ((rc = list_add(&l, s)) != 0)
      break;
    if (keep && !keep(&l.rows[l.n - 1], kctx)) {
      kvti_free((void *)l.rows[l.n - 1].tokens);
      l.n--;
    }
  }
  if (!rc && src != SQLITE_DONE)
    rc = kvti_index_sql_err(idx, src, "select");
  kvt_index_rows rows = {l.rows, l.n};
  if (rc)
    kvt_index_rows_free(&rows);
  else
    *out = rows;
  return rc;
}

const char *kvt_index_row_file_path(const kvt_index_row *row) {
  if (!row)
    return NULL;
  return row->tokens ? (const char *)(row->tokens + row->n_tokens)
                     : row->file_path;
}

void kvt_index_rows_free(kvt_index_rows *rows) {
  if (!rows)
    return;
  for (size_t i = 0; i < rows->count; i++)
    kvti_free((void *)rows->rows[i].tokens);
  kvti_free(rows->rows);
  rows->rows = NULL;
  rows->count = 0;
}
