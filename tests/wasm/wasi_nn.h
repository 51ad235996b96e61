/* wasi_ephemeral_nn as WasmEdge's wasi-nn plugin declares it (the subset the tests use). */
#ifndef WASI_NN_H
#define WASI_NN_H

#include <stdint.h>

#define NN_IMPORT(name) __attribute__((import_module("wasi_ephemeral_nn"), import_name(name)))

typedef uint32_t nn_graph;
typedef uint32_t nn_ctx;

enum { NN_SUCCESS = 0, NN_INVALID_ARGUMENT = 1, NN_BUSY = 4, NN_RUNTIME_ERROR = 5,
       NN_UNSUPPORTED = 6, NN_TOO_LARGE = 7, NN_END_OF_SEQUENCE = 100,
       NN_MODEL_NOT_FOUND = 103 };
enum { NN_F16 = 0, NN_F32 = 1, NN_F64 = 2, NN_U8 = 3, NN_I32 = 4, NN_I64 = 5 };

typedef struct {
    const uint32_t *dims;  /* @0 */
    uint32_t dims_len;     /* @4 */
    uint8_t type;          /* @8, then 3 bytes of padding */
    const void *data;      /* @12 */
    uint32_t data_len;     /* @16 */
} nn_tensor;
_Static_assert(sizeof(nn_tensor) == 20, "the tensor struct is 20 bytes");

NN_IMPORT("load") int32_t nn_load(const void *builders, uint32_t n, uint32_t encoding,
                                  uint32_t target, nn_graph *graph);
NN_IMPORT("load_by_name") int32_t nn_load_by_name(const char *name, uint32_t len, nn_graph *graph);
NN_IMPORT("load_by_name_with_config")
int32_t nn_load_by_name_with_config(const char *name, uint32_t len, const char *config,
                                    uint32_t config_len, nn_graph *graph);
NN_IMPORT("init_execution_context") int32_t nn_init_execution_context(nn_graph g, nn_ctx *ctx);
NN_IMPORT("set_input") int32_t nn_set_input(nn_ctx ctx, uint32_t index, const nn_tensor *t);
NN_IMPORT("compute") int32_t nn_compute(nn_ctx ctx);
NN_IMPORT("get_output") int32_t nn_get_output(nn_ctx ctx, uint32_t index, void *out,
                                              uint32_t out_max, uint32_t *written);
NN_IMPORT("compute_single") int32_t nn_compute_single(nn_ctx ctx);
NN_IMPORT("get_output_single") int32_t nn_get_output_single(nn_ctx ctx, uint32_t index, void *out,
                                                            uint32_t out_max, uint32_t *written);
NN_IMPORT("fini_single") int32_t nn_fini_single(nn_ctx ctx);
NN_IMPORT("unload") int32_t nn_unload(nn_graph g);
NN_IMPORT("finalize_execution_context") int32_t nn_finalize_execution_context(nn_ctx ctx);

#endif
