/*
 * mirror.c - the in-memory mirror of index.db that answers every lookup
 * without SQL, and the key/hash helpers the other index files share.
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
 * n) updates). rw protects everything here: lookups take it shared, the
 * maintenance functions expect it held exclusive.
 */
#include "index/internal.h"

#include "base/error.h"
#include "base/hash.h"
#include "base/hashmap.h"
#include "base/io.h"
#include "base/vec.h"

#include <openssl/evp.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

/* ---- keys and hashes ---- */

int kvti_idx_sha256(uint8_t out[32], const void *data, size_t len) {
  unsigned int mdlen = 0;
  if (!EVP_Digest(len ? data : (const void *)"", len, out, &mdlen, EVP_sha256(),
                  NULL) ||
      mdlen != 32)
    return KVT_ERR(KVT_ENOMEM, "SHA-256 computation failed");
  return 0;
}

void kvti_idx_hex(char out[65], const uint8_t b[32]) {
  static const char hx[] = "0123456789abcdef";
  for (int i = 0; i < 32; i++) {
    out[2 * i] = hx[b[i] >> 4];
    out[2 * i + 1] = hx[b[i] & 15];
  }
  out[64] = '\0';
}

int kvti_idx_unhex(uint8_t out[32], const char *s) {
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

/* ---- heaps ---- */

static double hkey(const kvt_index *idx, int h, uint32_t id) {
  const mirror_ent *e = &idx->ents[id];
  return h == H_LRU ? e->accessed_at : e->created_at;
}

static void heap_set(kvt_index *idx, int h, uint32_t pos, uint32_t id) {
  idx->heap[h][pos] = id;
  idx->ents[id].heap_pos[h] = pos;
}

void kvti_idx_heap_fix(kvt_index *idx, int h, uint32_t pos) {
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
      kvti_idx_heap_fix(idx, h, pos[h]);
}

/* ---- mirror maintenance (callers hold rw for writing) ---- */

int kvti_idx_mirror_find(const kvt_index *idx, const uint8_t sha[32],
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

int kvti_idx_mirror_reserve(kvt_index *idx) {
  int rc;
  if (idx->free_head == 0 && idx->n_ents == idx->cap_ents) {
    /* Entry ids are 32-bit. */
    size_t cap = kvti_vec_cap(idx->cap_ents, (size_t)idx->n_ents + 1,
                              sizeof *idx->ents, 64);
    if (cap > UINT32_MAX / 2)
      return KVT_ERR(KVT_ENOMEM, "index mirror: too many entries");
    if ((rc = KVTI_VEC_RESIZE(&idx->ents, cap)) != 0)
      return rc;
    idx->cap_ents = (uint32_t)cap;
  }
  if (idx->heap_n == idx->heap_cap) {
    /* The two heaps share one capacity: each grows to it in turn. */
    size_t cap = kvti_vec_cap(idx->heap_cap, (size_t)idx->heap_n + 1,
                              sizeof(uint32_t), 64);
    for (int h = 0; h < 2; h++)
      if ((rc = KVTI_VEC_RESIZE(&idx->heap[h], cap)) != 0)
        return rc;
    idx->heap_cap = (uint32_t)cap;
  }
  /* Reserve map room now so the insert below cannot fail half-way. */
  rc = kvti_hm_reserve(&idx->exact, idx->exact.n + 1);
  if (!rc)
    rc = kvti_hm_reserve(&idx->seq, idx->seq.n + 1);
  if (!rc)
    rc = kvti_hm_reserve(&idx->nodes, idx->nodes.n + 1);
  return rc;
}

/* Inserts a new entry (not present). kvti_idx_mirror_reserve must have
 * succeeded. */
void kvti_idx_mirror_add(kvt_index *idx, const mirror_ent *src) {
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
    kvti_idx_heap_fix(idx, h, pos);
  }
  idx->n_live++;
  idx->sum_disk += e->disk_bytes;
  idx->sum_mem += e->memory_bytes;
}

void kvti_idx_mirror_del(kvt_index *idx, uint32_t id) {
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
  kvti_idx_hex(out->token_hash, e->sha);
  kvti_idx_hex(out->prefix_hash, e->psha);
  out->num_tokens = e->num_tokens;
  out->memory_bytes = e->memory_bytes;
  out->disk_bytes = e->disk_bytes;
  out->created_at = e->created_at;
  out->accessed_at = e->accessed_at;
}

int kvti_idx_check_tokens(const int32_t *tokens, size_t n) {
  if (!tokens && n > 0)
    return KVT_ERR(KVT_EINVAL, "index: NULL tokens");
  if (n > MAX_TOKENS)
    return KVT_ERR(KVT_EINVAL, "index: too many tokens (%zu)", n);
  return 0;
}

/* kvti_idx_check_tokens, then the sequence's key (SHA-256 of its int32 bytes).
 */
int kvti_idx_tokens_sha(uint8_t sha[32], const int32_t *tokens, size_t n) {
  int rc = kvti_idx_check_tokens(tokens, n);
  return rc ? rc : kvti_idx_sha256(sha, tokens, n * sizeof(int32_t));
}

/* Builds the mirror record of a token sequence (hashes computed here, outside
 * any lock). full_sha = 0 leaves e->sha for the caller (rows loaded from SQLite
 * carry their key). */
int kvti_idx_make_ent(mirror_ent *e, const int32_t *tokens, size_t n,
                      int full_sha) {
  memset(e, 0, sizeof *e);
  int rc = full_sha ? kvti_idx_sha256(e->sha, tokens, n * sizeof(int32_t)) : 0;
  if (!rc)
    rc =
        kvti_idx_sha256(e->psha, tokens, (n < BLK ? n : BLK) * sizeof(int32_t));
  if (rc)
    return rc;
  seq_keys(&e->hb, &e->hf, tokens, n);
  e->num_tokens = n;
  return 0;
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
  int found = kvti_idx_mirror_find(idx, sha, &id) &&
              visible(&idx->ents[id], created_before);
  if (found)
    fill_info(out, &idx->ents[id]);
  pthread_rwlock_unlock(&idx->rw);
  return found ? 0 : KVT_ERR(KVT_ENOTFOUND, "index: no such entry");
}

int kvti_index_find(kvt_entry_info *out, kvt_index *idx, const int32_t *tokens,
                    size_t n, double created_before) {
  return kvti_index_find_salted(out, idx, tokens, n, created_before, NULL);
}

int kvti_index_find_salted(kvt_entry_info *out, kvt_index *idx,
                           const int32_t *tokens, size_t n,
                           double created_before, const kvti_salt *salt) {
  if (!out || !idx)
    return KVT_ERR(KVT_EINVAL, "kvti_index_find: NULL argument");
  uint8_t sha[32];
  int rc = kvti_idx_check_tokens(tokens, n);
  if (rc == 0)
    rc = kvti_salt_sha(sha, salt, tokens, n * sizeof(int32_t));
  return rc ? rc : find_info(out, idx, sha, created_before);
}

int kvti_index_find_hash(kvt_entry_info *out, kvt_index *idx,
                         const char *hash) {
  uint8_t sha[32];
  if (!out || !idx || kvti_idx_unhex(sha, hash) != 0)
    return KVT_ERR(KVT_EINVAL, "kvti_index_find_hash: bad argument");
  return find_info(out, idx, sha, 0);
}

/* Calls fn(ctx, id) for each stored non-empty sequence that is a prefix of
 * tokens, longest first, until fn returns nonzero. Caller holds rw (read).
 * Returns 0 or a negative code. */
typedef int (*kvti_idx_prefix_fn)(void *ctx, kvt_index *idx, uint32_t id);

int kvti_idx_prefix_walk(kvt_index *idx, const int32_t *tokens, size_t n,
                         double created_before, kvti_idx_prefix_fn fn,
                         void *ctx, const kvti_salt *salt) {
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
        /* The key under the query's salt: rows of another salt (or none)
         * never match. */
        if ((rc = kvti_salt_sha(sha, salt, tokens,
                                (base + t) * sizeof(int32_t))) != 0) {
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
  return kvti_index_find_prefix_salted(out, idx, tokens, n, created_before,
                                       NULL);
}

int kvti_index_find_prefix_salted(kvt_entry_info *out, kvt_index *idx,
                                  const int32_t *tokens, size_t n,
                                  double created_before,
                                  const kvti_salt *salt) {
  if (!out || !idx)
    return KVT_ERR(KVT_EINVAL, "kvti_index_find_prefix: NULL argument");
  int rc = kvti_idx_check_tokens(tokens, n);
  if (rc)
    return rc;
  kvt_entry_info info;
  info.token_hash[0] = '\0';
  pthread_rwlock_rdlock(&idx->rw);
  rc = kvti_idx_prefix_walk(idx, tokens, n, created_before, first_fn, &info,
                            salt);
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

int kvti_index_bench_add(kvt_index *idx, const int32_t *tokens, size_t n,
                         double t) {
  if (!idx)
    return KVT_ERR(KVT_EINVAL, "kvti_index_bench_add: NULL index");
  mirror_ent e;
  int rc = kvti_idx_check_tokens(tokens, n);
  if (rc || (rc = kvti_idx_make_ent(&e, tokens, n, 1)) != 0)
    return rc;
  e.created_at = e.accessed_at = t;
  pthread_rwlock_wrlock(&idx->rw);
  uint32_t id;
  if (!kvti_idx_mirror_find(idx, e.sha, &id) &&
      (rc = kvti_idx_mirror_reserve(idx)) == 0)
    kvti_idx_mirror_add(idx, &e);
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
