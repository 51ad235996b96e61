/* A pipeline that asks a served model through WASI-NN. Its input is "MODE MODEL\nTEXT":
 *   c  compute: the model's whole output (a text model's reply, an embedding model's f32
 *      vector as raw bytes)
 *   s  stream: compute_single / get_output_single to end_of_sequence, tokens joined by "|"
 *   f  stream two tokens, then fini_single (the generation is cancelled)
 * A WASI-NN error ends the call with 100 + its errno (the host says "refused").
 */
#include "seedance.h"
#include "wasi_nn.h"

static int32_t open_model(const char *model, uint32_t mlen, const char *text, uint32_t tlen,
                          nn_ctx *ctx) {
    nn_graph g;
    int32_t rc = nn_load_by_name(model, mlen, &g);
    if (rc) return rc;
    if ((rc = nn_init_execution_context(g, ctx))) return rc;
    uint32_t dims[1] = {tlen};
    nn_tensor t = {dims, 1, NN_U8, text, tlen};
    return nn_set_input(*ctx, 0, &t);
}

SEEDANCE_EXPORT("seedance_run") int32_t run(const char *input, uint32_t len) {
    if (len < 3) return 99;
    char mode = input[0];
    const char *model = input + 2;
    const char *end = memchr(model, '\n', len - 2);
    if (!end) return 98;
    uint32_t mlen = (uint32_t)(end - model);
    const char *text = end + 1;
    uint32_t tlen = len - (uint32_t)(text - input);
    nn_ctx ctx;
    int32_t rc = open_model(model, mlen, text, tlen, &ctx);
    if (rc) { out_str("nn error"); return 100 + rc; }
    if (mode == 'c') {
        if ((rc = nn_compute(ctx))) { out_str("nn error"); return 100 + rc; }
        uint32_t size = 0;
        char probe[1];
        rc = nn_get_output(ctx, 0, probe, 0, &size);
        if (rc != NN_TOO_LARGE && rc != NN_SUCCESS) return 100 + rc;
        char *buf = malloc(size ? size : 1);
        if ((rc = nn_get_output(ctx, 0, buf, size, &size))) return 100 + rc;
        seedance_output(buf, size);
        return 0;
    }
    char token[256];
    int limit = mode == 'f' ? 2 : -1;
    for (int i = 0; limit < 0 || i < limit; i++) {
        rc = nn_compute_single(ctx);
        if (rc == NN_END_OF_SEQUENCE) return 0;
        if (rc) return 100 + rc;
        uint32_t written = 0;
        if ((rc = nn_get_output_single(ctx, 0, token, sizeof token, &written))) return 100 + rc;
        if (i) out_str("|");
        seedance_output(token, written);
    }
    return nn_fini_single(ctx) ? 97 : 0;
}
