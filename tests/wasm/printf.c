/* A pre-processor that prints to stdout with printf: it imports wasi_snapshot_preview1.fd_write,
 * so the host refuses it unless the caller grants WASI (and then its stdout goes nowhere). */
#include <stdio.h>
#include "seedance.h"

SEEDANCE_EXPORT("seedance_preprocess") int32_t preprocess(char *text, uint32_t len) {
    printf("a prompt of %u bytes\n", (unsigned)len);
    fflush(stdout);
    seedance_output(text, len);
    free(text);
    return 0;
}
