/* A pre-processor: the prompt in upper case (ASCII letters); a prompt that says "forbidden" is
 * refused with code 7 and a reason. */
#include "seedance.h"

SEEDANCE_EXPORT("seedance_preprocess") int32_t preprocess(char *text, uint32_t len) {
    static const char word[] = "forbidden";
    for (uint32_t i = 0; i + sizeof word - 1 <= len; i++) {
        if (memcmp(text + i, word, sizeof word - 1) == 0) {
            free(text);
            out_str("prompt refused: it says forbidden");
            return 7;
        }
    }
    for (uint32_t i = 0; i < len; i++) {
        if (text[i] >= 'a' && text[i] <= 'z') text[i] = (char)(text[i] - 'a' + 'A');
    }
    log_str("upper: one prompt");
    seedance_output(text, len);
    free(text);
    return 0;
}
