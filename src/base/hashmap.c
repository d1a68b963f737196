/*
 * hashmap.c - the open-addressing multimap of hashmap.h: linear probing over a
 * power-of-two table, growth by doubling at 70% load, and backward-shift
 * deletion so that no tombstones accumulate (a probe sequence always ends at
 * the first empty slot).
 */
#include "base/hashmap.h"

#include "base/error.h"
#include "base/io.h"
#include "kvtier.h"

#include <string.h>

static int hm_rehash(kvti_hm *m, size_t cap) {
  kvti_hm_slot *s = kvti_calloc(cap, sizeof *s);
  if (!s)
    return KVT_ERR_NOMEM();
  size_t mask = cap - 1;
  if (m->s) {
    for (size_t i = 0; i <= m->mask; i++) {
      if (!m->s[i].key)
        continue;
      size_t j = m->s[i].key & mask;
      while (s[j].key)
        j = (j + 1) & mask;
      s[j] = m->s[i];
    }
  }
  kvti_free(m->s);
  m->s = s;
  m->mask = mask;
  return 0;
}

int kvti_hm_reserve(kvti_hm *m, size_t n) {
  size_t cap = m->s ? m->mask + 1 : 0;
  size_t want = 16;
  while (want * 7 / 10 < n) {
    if (want > SIZE_MAX / 4 / sizeof(kvti_hm_slot))
      return KVT_ERR_NOMEM();
    want *= 2;
  }
  if (want <= cap)
    return 0;
  return hm_rehash(m, want);
}

void kvti_hm_free(kvti_hm *m) {
  kvti_free(m->s);
  memset(m, 0, sizeof *m);
}

int kvti_hm_add(kvti_hm *m, uint64_t key, uint64_t val) {
  int rc = kvti_hm_reserve(m, m->n + 1);
  if (rc)
    return rc;
  key = kvti_hm_key(key);
  size_t j = key & m->mask;
  while (m->s[j].key)
    j = (j + 1) & m->mask;
  m->s[j].key = key;
  m->s[j].val = val;
  m->n++;
  return 0;
}

kvti_hm_slot *kvti_hm_next(const kvti_hm *m, uint64_t key, size_t *pos) {
  if (!m->s)
    return NULL;
  key = kvti_hm_key(key);
  /* *pos counts probed slots from the home slot, so iteration survives no
   * mutation but needs no extra state. */
  for (size_t i = *pos; i <= m->mask; i++) {
    kvti_hm_slot *s = &m->s[(key + i) & m->mask];
    if (!s->key)
      return NULL;
    if (s->key == key) {
      *pos = i + 1;
      return s;
    }
  }
  return NULL;
}

void kvti_hm_remove_slot(kvti_hm *m, kvti_hm_slot *slot) {
  size_t i = (size_t)(slot - m->s);
  size_t j = i;
  for (;;) {
    j = (j + 1) & m->mask;
    if (!m->s[j].key)
      break;
    size_t home = m->s[j].key & m->mask;
    /* Move s[j] back into the hole at i unless its home lies cyclically in (i,
     * j]. */
    int in_range = (i <= j) ? (home > i && home <= j) : (home > i || home <= j);
    if (!in_range) {
      m->s[i] = m->s[j];
      i = j;
    }
  }
  m->s[i].key = 0;
  m->s[i].val = 0;
  m->n--;
}

int kvti_hm_remove(kvti_hm *m, uint64_t key, uint64_t val) {
  size_t pos = 0;
  kvti_hm_slot *s;
  while ((s = kvti_hm_next(m, key, &pos)) != NULL) {
    if (s->val == val) {
      kvti_hm_remove_slot(m, s);
      return 1;
    }
  }
  return 0;
}

size_t kvti_hm_bytes(const kvti_hm *m) {
  return m->s ? (m->mask + 1) * sizeof(kvti_hm_slot) : 0;
}
