/*
 * layer_int.h - private to the layer_*.c files of src/format: the helpers one
 * layer file shares with another (the quantization bit widths kvtier accepts,
 * and the format-2 trimmed read of verified blocks that layer_read.c hands to
 * layer_blocks.c). Nothing outside the layer files includes it.
 */
#ifndef KVT_LAYER_INT_H
#define KVT_LAYER_INT_H

#include "engine/iobatch.h"
#include "format/layer.h"
#include "format/safetensors.h"

#include <stdint.h>

/* bits is one of the widths a quantized layer may have: 2, 3, 4, 5, 6, 8. */
int kvti_quant_bits_ok(int bits);

/* Reads and verifies the blocks covering the safetensors header [0, 8 + N) of
 * the file open as fd (size bytes, o->block_size / o->blocks its block list),
 * then parses the header from memory: nothing of it, not even N, is used
 * before the block holding it matched. *hbuf (kvti_malloc) receives the
 * verified blocks, *hlen bytes from offset 0. Returns 0 or KVT_ECORRUPT,
 * KVT_EIO, KVT_ENOMEM. */
int kvti_layer_read_header_blocks(kvti_st_header *hd, char **hbuf,
                                  uint64_t *hlen, int fd, uint64_t size,
                                  const kvti_layer_read_opts *o,
                                  const char *path);

/* Reads the kept rows of every tensor of a format-2 file through its verified
 * blocks into l's buffers (tbytes: per layer tensor j, tbytes[2j] = bytes of
 * one head's token rows in the file, tbytes[2j + 1] = bytes of its kept rows;
 * slot as kvti_layer_check_header; hbuf/hlen from
 * kvti_layer_read_header_blocks). *eng is the I/O engine, taken on first use
 * when NULL (the caller puts it back). *nread accumulates the bytes read.
 * Returns 0, KVT_ECORRUPT, KVT_EIO, KVT_ENOMEM, KVT_ECANCELED. */
int kvti_layer_read_trim_blocks(kvt_layer *l, const kvti_st_header *hd,
                                const kvti_st_tensor **slot,
                                const uint64_t *tbytes, const char *hbuf,
                                uint64_t hlen, int fd, uint64_t size,
                                kvti_iobatch **eng,
                                const kvti_layer_read_opts *o, const char *path,
                                uint64_t *nread);

#endif
