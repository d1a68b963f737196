/*
 * ssdprefix.c - the candidate map behind the public kvt_index_lookup_prefix.
 * The reference's query reads every row sharing the query's first 16 tokens
 * (at 10,000 rows sharing a system prompt: 10,000 blobs read, sorted and
 * compared per lookup). This map finds, without reading any row, the rowids
 * whose stored tokens can be a prefix of the query: it maps (length, rolling
 * hash of the tokens) of every row whose tokens_blob holds exactly num_tokens
 * tokens (no other row can ever match) to its rowid, and keeps the set of
 * stored lengths. A lookup rolls the hash over the query once, probes at each
 * stored length, then reads only the candidate rows by rowid and applies the
 * reference's whole condition to each as stored now (num_tokens, prefix_hash
 * among the query's 1..16-token prefix hashes, the blob equal to the query's
 * first num_tokens tokens), so what comes back is exactly the rows the
 * reference's SQL returns, with every column as stored.
 *
 * Invariant: every current row that could match has its pair in the map.
 * Extra pairs (rows since deleted or replaced, hash collisions) cost one
 * rowid read and are rejected by the checks, so the map may be stale in that
 * direction only. It is rebuilt from the table when another connection
 * committed (PRAGMA data_version changed: the reference or a tier writing
 * the same index.db) or once the own writes since the last build outnumber
 * the rows built from (so the stale pairs stay bounded); the own inserts add
 * their pair at once. All of it runs under the index's db_mu, like every
 * kvt_index_* call.
 */
#include "index/internal.h"

#include "base/error.h"
#include "base/io.h"
#include "kvtier.h"

#include <sqlite3.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PFX_TOKENS 16 /* the reference's _PREFIX_FILTER_TOKENS */
#define PFX_H0 0x243f6a8885a308d3ull
#define PFX_SLACK 4096 /* own writes tolerated beyond the built rows */

struct kvti_pfx {
  int built;
  int64_t data_version;
  kvti_hm map;    /* pfx_key(len, hash) -> rowid */
  uint64_t *lens; /* distinct stored lengths, ascending */
  size_t n_lens, cap_lens;
  size_t built_rows, changes; /* rows of the last build; own writes since */
  sqlite3_stmt *dv, *scan, *by_rowid;
};

/* Rows kvt_index_row can represent (ssdindex.c's VALID, the same text). */
#define PFX_VALID                                                              \
  " typeof(token_hash) = 'text' AND length(token_hash) = 64"                   \
  " AND typeof(tokens_blob) = 'blob' AND length(tokens_blob) % 4 = 0"          \
  " AND typeof(num_tokens) = 'integer' AND num_tokens >= 0"                    \
  " AND typeof(memory_bytes) = 'integer' AND memory_bytes >= 0"                \
  " AND typeof(file_path) = 'text' "

static const char SCAN_SQL[] =
    "SELECT rowid, num_tokens, tokens_blob FROM entries WHERE" PFX_VALID
    "AND length(tokens_blob) = 4 * num_tokens";
static const char ROWID_SQL[] =
    "SELECT token_hash, tokens_blob, num_tokens, file_path, memory_bytes, "
    "created_at, accessed_at, prefix_hash FROM entries WHERE rowid = ? "
    "AND" PFX_VALID;

/* One step of the rolling hash over a token sequence. */
static inline uint64_t pfx_roll(uint64_t h, int32_t t) {
  h ^= (uint32_t)t;
  h *= 0x9e3779b97f4a7c15ull;
  return h ^ (h >> 29);
}

/* The map key of a sequence of len tokens whose rolling hash is h. */
static inline uint64_t pfx_key(uint64_t len, uint64_t h) {
  uint64_t k = h ^ (len * 0xbf58476d1ce4e5b9ull);
  k ^= k >> 31;
  k *= 0x94d049bb133111ebull;
  k ^= k >> 29;
  return kvti_hm_key(k);
}

static uint64_t pfx_hash_blob(const unsigned char *b, uint64_t n) {
  uint64_t h = PFX_H0;
  for (uint64_t i = 0; i < n; i++) {
    int32_t t;
    memcpy(&t, b + 4 * i, 4); /* a blob has no alignment */
    h = pfx_roll(h, t);
  }
  return h;
}

/* Adds len to the set of stored lengths. Returns 0 or KVT_ENOMEM. */
static int lens_add(struct kvti_pfx *p, uint64_t len) {
  size_t lo = 0, hi = p->n_lens;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (p->lens[mid] < len)
      lo = mid + 1;
    else
      hi = mid;
  }
  if (lo < p->n_lens && p->lens[lo] == len)
    return 0;
  if (p->n_lens == p->cap_lens) {
    size_t nc = p->cap_lens ? p->cap_lens * 2 : 64;
    uint64_t *v = kvti_realloc(p->lens, nc * sizeof *v);
    if (!v)
      return KVT_ERR_NOMEM();
    p->lens = v;
    p->cap_lens = nc;
  }
  memmove(p->lens + lo + 1, p->lens + lo, (p->n_lens - lo) * sizeof *p->lens);
  p->lens[lo] = len;
  p->n_lens++;
  return 0;
}

static int pfx_add(struct kvti_pfx *p, int64_t rowid, const void *blob,
                   uint64_t n) {
  int rc = lens_add(p, n);
  if (!rc)
    rc = kvti_hm_add(&p->map, pfx_key(n, pfx_hash_blob(blob, n)),
                     (uint64_t)rowid);
  return rc;
}

static int prep_once(kvt_index *idx, sqlite3 *db, sqlite3_stmt **s,
                     const char *sql) {
  if (*s)
    return 0;
  int rc = sqlite3_prepare_v2(db, sql, -1, s, NULL);
  return rc == SQLITE_OK ? 0 : kvti_index_sql_err(idx, rc, "prepare");
}

/* The connection's PRAGMA data_version into *v. */
static int data_version(kvt_index *idx, sqlite3 *db, struct kvti_pfx *p,
                        int64_t *v) {
  int rc = prep_once(idx, db, &p->dv, "PRAGMA data_version");
  if (rc)
    return rc;
  int src = sqlite3_step(p->dv);
  if (src == SQLITE_ROW)
    *v = sqlite3_column_int64(p->dv, 0);
  sqlite3_reset(p->dv);
  return src == SQLITE_ROW ? 0 : kvti_index_sql_err(idx, src, "data_version");
}

static void pfx_clear(struct kvti_pfx *p) {
  kvti_hm_free(&p->map);
  memset(&p->map, 0, sizeof p->map);
  p->n_lens = 0;
  p->built = 0;
  p->built_rows = p->changes = 0;
}

/* Rebuilds the map from the table. The data version is read first: a commit
 * by another connection after it makes the next lookup rebuild again. */
static int pfx_build(kvt_index *idx, sqlite3 *db, struct kvti_pfx *p) {
  pfx_clear(p);
  int64_t v = 0;
  int rc = data_version(idx, db, p, &v);
  if (!rc)
    rc = prep_once(idx, db, &p->scan, SCAN_SQL);
  if (rc)
    return rc;
  size_t rows = 0;
  int src;
  while ((src = sqlite3_step(p->scan)) == SQLITE_ROW) {
    int64_t rowid = sqlite3_column_int64(p->scan, 0);
    uint64_t n = (uint64_t)sqlite3_column_int64(p->scan, 1);
    const void *b = sqlite3_column_blob(p->scan, 2);
    if (n && !b) {
      rc = KVT_ERR_NOMEM();
      break;
    }
    if ((rc = pfx_add(p, rowid, b, n)) != 0)
      break;
    rows++;
  }
  if (!rc && src != SQLITE_DONE)
    rc = kvti_index_sql_err(idx, src, "select");
  sqlite3_reset(p->scan);
  if (rc) {
    pfx_clear(p);
    return rc;
  }
  p->data_version = v;
  p->built_rows = rows;
  p->built = 1;
  return 0;
}

/* A map ready for a lookup: built, and no other connection committed since
 * (else rebuilt now). */
static int pfx_ready(kvt_index *idx, sqlite3 *db, struct kvti_pfx *p) {
  if (p->built && p->changes > p->built_rows + PFX_SLACK)
    p->built = 0; /* too many stale pairs: start over */
  if (p->built) {
    int64_t v = 0;
    int rc = data_version(idx, db, p, &v);
    if (rc)
      return rc;
    if (v == p->data_version)
      return 0;
  }
  return pfx_build(idx, db, p);
}

void kvti_pfx_attach(kvt_index *idx) {
  idx->pfx = kvti_calloc(1, sizeof *idx->pfx);
}

void kvti_pfx_free(kvt_index *idx) {
  struct kvti_pfx *p = idx ? idx->pfx : NULL;
  if (!p)
    return;
  sqlite3_finalize(p->dv);
  sqlite3_finalize(p->scan);
  sqlite3_finalize(p->by_rowid);
  kvti_hm_free(&p->map);
  kvti_free(p->lens);
  kvti_free(p);
  idx->pfx = NULL;
}

void kvti_pfx_inserted(kvt_index *idx, int64_t rowid, const int32_t *tokens,
                       size_t n, uint64_t num_tokens) {
  struct kvti_pfx *p = idx->pfx;
  if (!p || !p->built)
    return;
  p->changes++;
  /* A row whose blob is not num_tokens tokens never matches; and a failed
   * add cannot leave the map short of a row: it is rebuilt instead. */
  if (num_tokens == n && pfx_add(p, rowid, tokens, n) != 0)
    p->built = 0;
}

void kvti_pfx_removed(kvt_index *idx) {
  if (idx->pfx && idx->pfx->built)
    idx->pfx->changes++;
}

typedef struct cand {
  uint64_t len;
  int64_t rowid;
} cand;

static int cand_cmp(const void *a, const void *b) {
  const cand *x = a, *y = b;
  if (x->len != y->len)
    return x->len < y->len ? 1 : -1; /* longest first */
  return (x->rowid > y->rowid) - (x->rowid < y->rowid);
}

/* The query's prefix hashes, computed when a candidate first needs one. */
typedef struct qhash {
  const int32_t *tokens;
  size_t m; /* min(n, 16) */
  char hex[PFX_TOKENS][KVT_HASH_HEX_LEN + 1];
  int have[PFX_TOKENS];
} qhash;

/* 1 when ph (64 bytes) is the hash of the query's first k tokens for some k
 * in 1..m (the reference's IN list), 0 when not, or an error code. The row's
 * own length is tried first: an untampered row's prefix_hash is that one. */
static int qhash_has(qhash *q, const unsigned char *ph, uint64_t row_n) {
  size_t first = row_n < q->m ? (size_t)row_n : q->m;
  for (size_t i = 0; i <= q->m; i++) {
    size_t k = i == 0 ? first : i; /* first, then 1..m (first skipped) */
    if (k == 0 || (i > 0 && k == first))
      continue;
    if (!q->have[k - 1]) {
      int rc = kvt_token_hash(q->hex[k - 1], q->tokens, k);
      if (rc)
        return rc;
      q->have[k - 1] = 1;
    }
    if (memcmp(q->hex[k - 1], ph, 64) == 0)
      return 1;
  }
  return 0;
}

int kvti_pfx_lookup(kvt_index_rows *out, kvt_index *idx, sqlite3 *db,
                    const int32_t *tokens, size_t n) {
  struct kvti_pfx *p = idx->pfx;
  int rc = pfx_ready(idx, db, p);
  if (rc)
    return rc;
  /* Candidates: one pass of the rolling hash over the query, a probe at each
   * stored length it reaches. */
  cand *cv = NULL;
  size_t nc = 0, cc = 0;
  uint64_t h = PFX_H0;
  size_t j = 0;
  for (uint64_t len = 0; len <= n && j < p->n_lens; len++) {
    if (len > 0)
      h = pfx_roll(h, tokens[len - 1]);
    if (p->lens[j] != len)
      continue;
    j++;
    size_t pos = 0;
    kvti_hm_slot *sl;
    uint64_t key = pfx_key(len, h);
    while ((sl = kvti_hm_next(&p->map, key, &pos)) != NULL) {
      if (nc == cc) {
        size_t ncap = cc ? cc * 2 : 8;
        cand *v = kvti_realloc(cv, ncap * sizeof *v);
        if (!v) {
          kvti_free(cv);
          return KVT_ERR_NOMEM();
        }
        cv = v;
        cc = ncap;
      }
      cv[nc].len = len;
      cv[nc].rowid = (int64_t)sl->val;
      nc++;
    }
  }
  if (nc > 1)
    qsort(cv, nc, sizeof *cv, cand_cmp);
  rc = nc ? prep_once(idx, db, &p->by_rowid, ROWID_SQL) : 0;
  kvt_index_row *rows = NULL;
  size_t nr = 0;
  qhash q = {.tokens = tokens, .m = n < PFX_TOKENS ? n : PFX_TOKENS};
  for (size_t i = 0; !rc && i < nc; i++) {
    if (i > 0 && cv[i].rowid == cv[i - 1].rowid && cv[i].len == cv[i - 1].len)
      continue; /* the same pair twice (a replaced row's rowid reused) */
    sqlite3_stmt *s = p->by_rowid;
    sqlite3_bind_int64(s, 1, cv[i].rowid);
    int src = sqlite3_step(s);
    if (src == SQLITE_ROW) {
      /* The reference's condition on the row as stored now. */
      uint64_t num = (uint64_t)sqlite3_column_int64(s, 2);
      size_t bl = (size_t)sqlite3_column_bytes(s, 1);
      /* The type first: reading a BLOB as text would convert it, and the
       * reference's IN compares text with text only. */
      int ph_text = sqlite3_column_type(s, 7) == SQLITE_TEXT;
      const unsigned char *ph = ph_text ? sqlite3_column_text(s, 7) : NULL;
      int ok = num == cv[i].len && num <= n && bl == num * 4 && ph &&
               sqlite3_column_bytes(s, 7) == 64;
      if (ok && num) {
        const void *b = sqlite3_column_blob(s, 1);
        ok = b && memcmp(b, tokens, bl) == 0;
      }
      if (ok) {
        int hit = qhash_has(&q, ph, num);
        if (hit < 0)
          rc = hit;
        ok = hit == 1;
      }
      if (ok && !rc) {
        kvt_index_row *nrw = kvti_realloc(rows, (nr + 1) * sizeof *nrw);
        if (!nrw)
          rc = KVT_ERR_NOMEM();
        else {
          rows = nrw;
          if ((rc = kvti_ssd_read_row(&rows[nr], s, 1)) == 0)
            nr++;
        }
      }
    } else if (src != SQLITE_DONE) {
      rc = kvti_index_sql_err(idx, src, "select");
    }
    sqlite3_reset(s);
  }
  kvti_free(cv);
  kvt_index_rows res = {rows, nr};
  if (rc) {
    kvt_index_rows_free(&res);
    return rc;
  }
  *out = res;
  return 0;
}
