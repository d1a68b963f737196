/*
 * layout.h - the names inside one entry directory, spelled in one place: the
 * layer files (layer_<i>.safetensors), the tensor names inside them
 * (layer_<i>_keys/_values, layer_<i>_state_<j>, and the native quantized
 * layer_<i>_{keys,values}{,_scales,_biases}) and the entry's small files
 * (tokens.bin, manifest.json, manifest.sum). They are the reference's names
 * (docs/FORMAT.md): writer, reader, manifest and describe all build them here
 * so that they cannot drift apart.
 */
#ifndef KVT_LAYOUT_H
#define KVT_LAYOUT_H

#include <stdint.h>

/* Room for any tensor name kvti_tensor_name builds. */
#define KVTI_NAME_MAX 64
/* Room for any layer file name ("layer_4294967295.safetensors"). */
#define KVTI_LAYER_FILE_MAX 40

#define KVTI_TOKENS_FILE "tokens.bin"
#define KVTI_MANIFEST_FILE "manifest.json"
#define KVTI_MANIFEST_SUM_FILE "manifest.sum"

/* File name of layer i inside an entry directory ("layer_3.safetensors"). */
void kvti_layer_file_name(char out[KVTI_LAYER_FILE_MAX], uint32_t i);

/* Name of tensor j of layer layer_idx as stored in a file holding a layer of
 * the given kvt_layer_kind (the stored kind: a compat-mode dequantized layer
 * is stored as KVT_LAYER_KV). Arrays: "layer_3_state_<j>"; quantized KV: one of
 * "layer_3_keys", "_keys_scales", "_keys_biases", "_values", "_values_scales",
 * "_values_biases" (j = 0..5); KV and rotating KV: "layer_3_keys" (j = 0),
 * "layer_3_values" (j = 1). */
void kvti_tensor_name(char out[KVTI_NAME_MAX], int kind, uint32_t layer_idx,
                      uint32_t j);

#endif
