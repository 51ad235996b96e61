/* A pipeline that misbehaves as its input asks: each mode breaks one rule of the sandbox.
 *   ok      outputs "fine" (the good call after each bad one)
 *   trap    __builtin_trap()                      -> trap
 *   div     divides by zero                       -> trap
 *   oob     writes past the end of its memory     -> trap
 *   loop    loops forever                         -> fuel
 *   spin    loops forever (given huge fuel)       -> timeout
 *   bomb    mallocs 1 MiB until NULL, then writes through the NULL and returns -> memory
 *   bigout  outputs 64 KiB at a time forever      -> output_too_large
 *   badptr  passes seedance.output a pointer outside its memory -> trap
 *   logspam logs 1000 lines, then outputs "logged"
 *   refuse  returns 42 after writing a reason
 */
#include "seedance.h"

static int eq(const char *input, uint32_t len, const char *mode) {
    return strlen(mode) == len && memcmp(input, mode, len) == 0;
}

SEEDANCE_EXPORT("seedance_run") int32_t run(const char *in, uint32_t len) {
    if (eq(in, len, "ok")) {
        out_str("fine");
    } else if (eq(in, len, "trap")) {
        __builtin_trap();
    } else if (eq(in, len, "div")) {
        volatile int one = 1, zero = 0; /* volatile: clang folds 1/x into a select */
        return one / zero;
    } else if (eq(in, len, "oob")) {
        *(volatile int *)0xFFFFFFF0u = 1;
    } else if (eq(in, len, "loop") || eq(in, len, "spin")) {
        volatile uint32_t n = 0;
        for (;;) n++;
    } else if (eq(in, len, "bomb")) {
        /* volatile: else clang drops the unused blocks, then the loop, then this branch */
        static char *volatile block;
        while ((block = malloc(1 << 20)) != NULL) block[0] = 1;
        /* The careless write through NULL: it does not even trap (address 0 is memory in
         * wasm32), the module goes on and returns. */
        block[0] = 1;
    } else if (eq(in, len, "bigout")) {
        char *chunk = calloc(1, 65536);
        for (;;) seedance_output(chunk, 65536);
    } else if (eq(in, len, "badptr")) {
        seedance_output((const void *)0xFFFFFF00u, 1000);
        out_str("still here");
    } else if (eq(in, len, "logspam")) {
        for (int i = 0; i < 1000; i++) log_str("spam");
        out_str("logged");
    } else if (eq(in, len, "refuse")) {
        out_str("not today");
        return 42;
    } else {
        return 99;
    }
    return 0;
}
