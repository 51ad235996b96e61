/* A stream filter that misbehaves when the reply says so: a delta holding "TRAP" traps,
 * "SPIN" loops forever (fuel), "BOMB" grows its memory without end, "HUGE" outputs without
 * end; anything else passes through unchanged. */
#include "seedance.h"

static int has(const char *text, uint32_t len, const char *word) {
    uint32_t n = (uint32_t)strlen(word);
    for (uint32_t i = 0; i + n <= len; i++)
        if (memcmp(text + i, word, n) == 0) return 1;
    return 0;
}

SEEDANCE_EXPORT("seedance_filter") int32_t filter(char *delta, uint32_t len) {
    if (has(delta, len, "TRAP")) __builtin_trap();
    if (has(delta, len, "SPIN")) { volatile uint32_t n = 0; for (;;) n++; }
    if (has(delta, len, "BOMB")) {
        static char *volatile block;
        while ((block = malloc(1 << 20)) != NULL) block[0] = 1;
        block[0] = 1;
        return 0;
    }
    if (has(delta, len, "HUGE")) {
        char *chunk = calloc(1, 65536);
        for (;;) seedance_output(chunk, 65536);
    }
    seedance_output(delta, len);
    free(delta);
    return 0;
}
