/*
 * hostcache_limit.c - the host RAM cache's default bound: a share of the
 * memory this process may use, read from its cgroup's limit (v2, then v1)
 * and bounded by the machine's physical memory where no cgroup limit is set.
 */
#include "tier/hostcache.h"
#include "base/error.h"
#include "base/hashmap.h"
#include "base/io.h"
#include "format/dtype.h"
#include "format/layer.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "tier/hostcache_int.h"

/* ---- default bound ------------------------------------------------------ */

/* A cgroup limit file's value in bytes, or UINT64_MAX (absent, "max",
 * unparsable; cgroup v1 reports "no limit" as a huge page-rounded number). */
static uint64_t read_limit(const char *path) {
  if (!path)
    return UINT64_MAX;
  FILE *f = fopen(path, "r"); /* a /sys file, not cache data: no io seam */
  if (!f)
    return UINT64_MAX;
  char buf[64] = {0};
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = '\0';
  char *end;
  unsigned long long v = strtoull(buf, &end, 10);
  if (end == buf || (*end && *end != '\n'))
    return UINT64_MAX;
  if (v >= (1ull << 62))
    return UINT64_MAX;
  return (uint64_t)v;
}

uint64_t kvti_hc_memory_limit(const char *v2, const char *v1, uint64_t phys) {
  uint64_t m = phys ? phys : UINT64_MAX;
  uint64_t a = read_limit(v2), b = read_limit(v1);
  if (a < m)
    m = a;
  if (b < m)
    m = b;
  return m == UINT64_MAX ? 0 : m;
}

uint64_t kvti_hc_default_bytes(void) {
  long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
  uint64_t phys =
      pages > 0 && psz > 0 ? (uint64_t)pages * (uint64_t)psz : UINT64_MAX;
  uint64_t m =
      kvti_hc_memory_limit("/sys/fs/cgroup/memory.max",
                           "/sys/fs/cgroup/memory/memory.limit_in_bytes",
                           phys == UINT64_MAX ? 0 : phys);
  if (m == 0) /* nothing known: a conservative 1 GiB */
    return (uint64_t)1 << 30;
  return m / 8;
}
