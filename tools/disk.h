/*
 * disk.h - sequential limits of the disk under a directory (fio when
 * installed, else a built-in O_DIRECT loop), for `kvtier bench` ratios.
 */
#ifndef KVT_CLI_DISK_H
#define KVT_CLI_DISK_H

#include "cli.h"

typedef struct disk_result {
  int ok;
  int used_fio;
  char tool[128];  /* "fio-3.33" or "builtin" */
  char engine[64]; /* fio ioengine or the builtin's method */
  int iodepth;
  uint64_t size;                                   /* bytes per job */
  uint32_t block;                                  /* bytes per request */
  double write_direct, read_direct, read_buffered; /* bytes per second */
  char note[512];
} disk_result;

/* Measures with a scratch file in dir (removed afterwards). Returns 0, or -1
 * with r->note saying why (r->ok == 0). progress: allow the stderr bar. */
int disk_measure(disk_result *r, const char *dir, uint64_t size, int progress);
/* Measures the O_DIRECT and the cached read again (fio only; a fresh scratch
 * file, removed) and keeps the faster of each pair in r->read_direct and
 * r->read_buffered, saying so in r->note:
 * a shared disk's speed drifts between a limit taken before a phase and the
 * phase. Nothing changes when r was not measured with fio. */
void disk_measure_read_again(disk_result *r, const char *dir);

#endif
