/* A pipeline that calls served models through WASI-NN. The input's first byte picks what it
 * does, the rest is the prompt:
 *   c  compute: load_by_name "echo", set_input, compute, get_output (first with a 1-byte
 *      buffer, which must be too_large and say the size needed)
 *   s  stream: compute_single / get_output_single until end_of_sequence, tokens joined by "|"
 *   f  stream two tokens, then fini_single (the backend's stream must be closed)
 *   g  load_by_name_with_config "echo" with {"upper": true}, then as c; and a bad config
 *   t  an f32 tensor of dims [2, 3] to "sum", whose output is one f32 (4 bytes, sent raw)
 *   n  the errnos of loading "nope" and "secret"
 *   b  the errnos of calls given bad pointers and bad tensors
 *   h  load "echo" until busy; the errno and how many loads succeeded
 *   w  stream "slow" without end (the wall-clock bound must stop it)
 */
#include "seedance.h"
#include "wasi_nn.h"

static void out_int(int32_t v) {
    char buf[12];
    int n = 0;
    uint32_t u = v < 0 ? (uint32_t)-v : (uint32_t)v;
    do { buf[n++] = (char)('0' + u % 10); u /= 10; } while (u);
    if (v < 0) buf[n++] = '-';
    char rev[12];
    for (int i = 0; i < n; i++) rev[i] = buf[n - 1 - i];
    seedance_output(rev, (uint32_t)n);
}

static int32_t open_text(const char *model, const char *prompt, uint32_t len, nn_ctx *ctx) {
    nn_graph g;
    int32_t rc = nn_load_by_name(model, (uint32_t)strlen(model), &g);
    if (rc) return rc;
    if ((rc = nn_init_execution_context(g, ctx))) return rc;
    uint32_t dims[1] = {len};
    nn_tensor t = {dims, 1, NN_U8, prompt, len};
    return nn_set_input(*ctx, 0, &t);
}

static int32_t compute_and_send(nn_ctx ctx) {
    int32_t rc = nn_compute(ctx);
    if (rc) return rc;
    char small[1];
    uint32_t needed = 0;
    rc = nn_get_output(ctx, 0, small, 1, &needed);
    if (rc == NN_SUCCESS) { seedance_output(small, needed); return 0; }
    if (rc != NN_TOO_LARGE) return 1000 + rc;
    char *buf = malloc(needed);
    uint32_t written = 0;
    if ((rc = nn_get_output(ctx, 0, buf, needed, &written))) return 2000 + rc;
    if (written != needed) return 3000;
    seedance_output(buf, written);
    free(buf);
    return 0;
}

static int32_t stream(nn_ctx ctx, int max_tokens) {
    char token[256];
    for (int i = 0; max_tokens < 0 || i < max_tokens; i++) {
        int32_t rc = nn_compute_single(ctx);
        if (rc == NN_END_OF_SEQUENCE) return 0;
        if (rc) return 1000 + rc;
        uint32_t written = 0;
        if ((rc = nn_get_output_single(ctx, 0, token, sizeof token, &written))) return 2000 + rc;
        if (i) out_str("|");
        seedance_output(token, written);
    }
    return nn_fini_single(ctx) ? 4000 : 0;
}

static int32_t bad_pointers(void) {
    nn_graph g;
    nn_ctx ctx;
    uint32_t dims[2] = {2, 2};
    uint8_t data[4] = {1, 2, 3, 4};
    char *far = (char *)0xFFFFFF00u;
    /* 1: name out of bounds; 2: graph_out out of bounds */
    out_int(nn_load_by_name(far, 100, &g)); out_str(",");
    out_int(nn_load_by_name("echo", 4, (nn_graph *)far)); out_str(",");
    /* 3: a graph that was never loaded */
    out_int(nn_init_execution_context(12345, &ctx)); out_str(",");
    if (nn_load_by_name("echo", 4, &g) || nn_init_execution_context(g, &ctx)) return 90;
    /* 4: tensor struct out of bounds; 5: dims out of bounds; 6: data out of bounds */
    out_int(nn_set_input(ctx, 0, (nn_tensor *)far)); out_str(",");
    nn_tensor t = {(uint32_t *)far, 2, NN_U8, data, 4};
    out_int(nn_set_input(ctx, 0, &t)); out_str(",");
    t = (nn_tensor){dims, 2, NN_U8, far, 4};
    out_int(nn_set_input(ctx, 0, &t)); out_str(",");
    /* 7: data_len is not 2*2*1; 8: an unknown type; 9: a huge length that wraps */
    t = (nn_tensor){dims, 2, NN_U8, data, 3};
    out_int(nn_set_input(ctx, 0, &t)); out_str(",");
    t = (nn_tensor){dims, 2, 9, data, 4};
    out_int(nn_set_input(ctx, 0, &t)); out_str(",");
    t = (nn_tensor){dims, 2, NN_U8, data, 0xFFFFFFFFu};
    out_int(nn_set_input(ctx, 0, &t)); out_str(",");
    /* 10: a good input; then get_output's buffer and bytes_written out of bounds (11, 12) */
    t = (nn_tensor){dims, 2, NN_U8, data, 4};
    out_int(nn_set_input(ctx, 0, &t)); out_str(",");
    if (nn_compute(ctx)) return 91;
    uint32_t written;
    out_int(nn_get_output(ctx, 0, far, 200, &written)); out_str(",");
    char buf[8];
    out_int(nn_get_output(ctx, 0, buf, sizeof buf, (uint32_t *)far)); out_str(",");
    /* 13: a context handle never made; 14: load is not offered */
    out_int(nn_compute(777)); out_str(",");
    out_int(nn_load(far, 1, 0, 0, &g));
    return 0;
}

SEEDANCE_EXPORT("seedance_run") int32_t run(const char *input, uint32_t len) {
    if (len == 0) return 99;
    char mode = input[0];
    const char *prompt = input + 1;
    uint32_t plen = len - 1;
    nn_ctx ctx;
    int32_t rc;
    switch (mode) {
    case 'c':
        if ((rc = open_text("echo", prompt, plen, &ctx))) return 100 + rc;
        return compute_and_send(ctx);
    case 's':
        if ((rc = open_text("echo", prompt, plen, &ctx))) return 100 + rc;
        return stream(ctx, -1);
    case 'f':
        if ((rc = open_text("echo", prompt, plen, &ctx))) return 100 + rc;
        return stream(ctx, 2);
    case 'g': {
        nn_graph g;
        const char *config = "{\"upper\": true}";
        out_int(nn_load_by_name_with_config("echo", 4, "[1]", 3, &g)); out_str(":");
        if ((rc = nn_load_by_name_with_config("echo", 4, config, (uint32_t)strlen(config), &g)))
            return 100 + rc;
        if ((rc = nn_init_execution_context(g, &ctx))) return 200 + rc;
        uint32_t dims[1] = {plen};
        nn_tensor t = {dims, 1, NN_U8, prompt, plen};
        if ((rc = nn_set_input(ctx, 0, &t))) return 300 + rc;
        return compute_and_send(ctx);
    }
    case 't': {
        nn_graph g;
        if ((rc = nn_load_by_name("sum", 3, &g))) return 100 + rc;
        if ((rc = nn_init_execution_context(g, &ctx))) return 200 + rc;
        static const float values[6] = {0.5f, 1.5f, 2.0f, 3.0f, 4.0f, -1.0f};
        uint32_t dims[2] = {2, 3};
        nn_tensor t = {dims, 2, NN_F32, values, sizeof values};
        if ((rc = nn_set_input(ctx, 0, &t))) return 300 + rc;
        if ((rc = nn_compute(ctx))) return 400 + rc;
        float sum;
        uint32_t written;
        if ((rc = nn_get_output(ctx, 0, &sum, sizeof sum, &written))) return 500 + rc;
        seedance_output(&sum, written);
        return 0;
    }
    case 'n': {
        nn_graph g;
        out_int(nn_load_by_name("nope", 4, &g)); out_str(",");
        out_int(nn_load_by_name("secret", 6, &g));
        return 0;
    }
    case 'b':
        return bad_pointers();
    case 'h': {
        nn_graph g;
        int n = 0;
        while ((rc = nn_load_by_name("echo", 4, &g)) == NN_SUCCESS && n < 1000) n++;
        out_int(rc); out_str(",");
        out_int(n);
        return 0;
    }
    case 'w':
        if ((rc = open_text("slow", prompt, plen, &ctx))) return 100 + rc;
        for (;;) {
            if ((rc = nn_compute_single(ctx)) && rc != NN_END_OF_SEQUENCE) return 1000 + rc;
        }
    }
    return 98;
}
