/*
 * layout.c - builds the layer file and tensor names of an entry directory
 * (see layout.h); the only place that spells them.
 */
#include "format/layout.h"
#include "kvtier.h"

#include <stdio.h>

void kvti_layer_file_name(char out[KVTI_LAYER_FILE_MAX], uint32_t i) {
  snprintf(out, KVTI_LAYER_FILE_MAX, "layer_%u.safetensors", i);
}

void kvti_tensor_name(char out[KVTI_NAME_MAX], int kind, uint32_t layer_idx,
                      uint32_t j) {
  static const char *suf[6] = {"keys",   "keys_scales",   "keys_biases",
                               "values", "values_scales", "values_biases"};
  if (kind == KVT_LAYER_ARRAYS)
    snprintf(out, KVTI_NAME_MAX, "layer_%u_state_%u", layer_idx, j);
  else if (kind == KVT_LAYER_QUANTIZED_KV)
    snprintf(out, KVTI_NAME_MAX, "layer_%u_%s", layer_idx, suf[j % 6]);
  else
    snprintf(out, KVTI_NAME_MAX, "layer_%u_%s", layer_idx,
             j ? "values" : "keys");
}
