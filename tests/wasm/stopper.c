/* A stream filter that ends the reply at the first "STOP" (not sent), wherever the deltas split
 * it: text that may be the start of "STOP" is held back until the next delta decides. */
#include "seedance.h"

static const char pattern[] = "STOP";
#define PATTERN_LEN 4
static char held[PATTERN_LEN];
static uint32_t held_len;

SEEDANCE_EXPORT("seedance_filter") int32_t filter(const char *delta, uint32_t len) {
    /* held + delta, scanned as one text */
    char *text = malloc(held_len + len + 1);
    memcpy(text, held, held_len);
    memcpy(text + held_len, delta, len);
    uint32_t n = held_len + len;
    free((void *)delta);
    for (uint32_t i = 0; i + PATTERN_LEN <= n; i++) {
        if (memcmp(text + i, pattern, PATTERN_LEN) == 0) {
            seedance_output(text, i);
            log_str("stopper: STOP seen");
            free(text);
            held_len = 0;
            return 1;
        }
    }
    /* keep the longest tail that is a prefix of the pattern */
    uint32_t keep = 0;
    for (uint32_t k = PATTERN_LEN - 1; k > 0; k--) {
        if (k <= n && memcmp(text + n - k, pattern, k) == 0) { keep = k; break; }
    }
    seedance_output(text, n - keep);
    memcpy(held, text + n - keep, keep);
    held_len = keep;
    free(text);
    return 0;
}

SEEDANCE_EXPORT("seedance_filter_end") int32_t filter_end(void) {
    seedance_output(held, held_len);
    held_len = 0;
    return 0;
}
