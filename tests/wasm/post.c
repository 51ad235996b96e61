/* A post-processor: the reply with every "\r\n" made "\n", then a footer counting its lines. */
#include "seedance.h"

SEEDANCE_EXPORT("seedance_postprocess") int32_t postprocess(char *text, uint32_t len) {
    uint32_t lines = len ? 1 : 0, start = 0;
    for (uint32_t i = 0; i < len; i++) {
        if (text[i] == '\r' && i + 1 < len && text[i + 1] == '\n') {
            seedance_output(text + start, i - start);
            start = i + 1;
        } else if (text[i] == '\n') {
            lines++;
        }
    }
    seedance_output(text + start, len - start);
    char footer[32] = "\n-- lines: ";
    char digits[12];
    int n = 0;
    do { digits[n++] = (char)('0' + lines % 10); lines /= 10; } while (lines);
    size_t at = strlen(footer);
    while (n) footer[at++] = digits[--n];
    seedance_output(footer, (uint32_t)at);
    free(text);
    return 0;
}
