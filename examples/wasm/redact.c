/* redact: a Seedance stream filter that replaces e-mail addresses and runs of 6 or more digits
 * with "[redacted]" in a reply, as it streams.
 *
 * The rule, on the whole reply: a *token* is a maximal run of the characters an address may
 * hold, [A-Za-z0-9._%+@-]. A token is an address when, its trailing dots left aside (they end a
 * sentence), it is local@domain: one '@', a non-empty local part, and a domain of labels
 * [A-Za-z0-9-]+ joined by single dots whose last label is 2 or more letters; and when it is at
 * most 256 bytes long. An address becomes "[redacted]" (its trailing dots kept). In any other
 * token, every maximal run of 6 or more digits becomes one "[redacted]".
 *
 * Streaming: a delta may end inside a token that the next delta turns into an address, or inside
 * a digit run that is not yet 6 long, so the filter holds back the token it is in until a
 * character that is not a token character arrives (or the reply ends: seedance_filter_end).
 * What it holds is bounded: a token longer than 256 bytes cannot be an address, so from then on
 * only a digit run (at most 5 digits) is held. Whatever the deltas, the output is the rule
 * applied to the whole reply.
 *
 * Build (see README.md):
 *   clang --target=wasm32-wasi -O2 -nostartfiles -Wl,--no-entry -Wl,--export-dynamic \
 *       -o redact.wasm redact.c
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

__attribute__((import_module("seedance"), import_name("output")))
void seedance_output(const void *ptr, uint32_t len);

/* The host writes each delta into a buffer from here; seedance_filter frees it. */
__attribute__((export_name("seedance_alloc"))) void *seedance_alloc(uint32_t size) {
    return malloc(size);
}

#define MAX_TOKEN 256 /* a longer token is not an address */
#define MIN_DIGITS 6  /* a run this long is redacted */
static const char MARK[] = "[redacted]";

/* Output is gathered and sent in one seedance.output call per delta (or per 4 KiB). */
static char out_buf[4096];
static uint32_t out_len;

static void flush(void) {
    if (out_len) seedance_output(out_buf, out_len);
    out_len = 0;
}

static void emit(const char *p, uint32_t n) {
    if (out_len + n > sizeof out_buf) flush();
    if (n > sizeof out_buf) {
        seedance_output(p, n);
        return;
    }
    memcpy(out_buf + out_len, p, n);
    out_len += n;
}

static void emit_char(char c) { emit(&c, 1); }

static int is_alpha(unsigned char c) { return (c | 0x20) >= 'a' && (c | 0x20) <= 'z'; }
static int is_digit(unsigned char c) { return c >= '0' && c <= '9'; }
static int is_token_char(unsigned char c) {
    return is_alpha(c) || is_digit(c) || (c && strchr("._%+-@", c) != NULL);
}

/* The state kept across deltas. */
static char token[MAX_TOKEN]; /* the token being read, while it may still be an address */
static uint32_t token_len;
static int too_long;            /* the current token passed MAX_TOKEN: digits rule only */
static char digits[MIN_DIGITS]; /* a digit run shorter than MIN_DIGITS, held */
static uint32_t digits_len;
static int in_long_run; /* "[redacted]" was sent for the current digit run */

/* The digits rule, one character of a token that is not an address at a time. */
static void digits_rule(char c) {
    if (is_digit((unsigned char)c)) {
        if (in_long_run) return;
        digits[digits_len++] = c;
        if (digits_len == MIN_DIGITS) {
            emit(MARK, sizeof MARK - 1);
            in_long_run = 1;
            digits_len = 0;
        }
        return;
    }
    emit(digits, digits_len);
    digits_len = 0;
    in_long_run = 0;
    emit_char(c);
}

static void digits_rule_end(void) {
    emit(digits, digits_len);
    digits_len = 0;
    in_long_run = 0;
}

static int is_address(const char *t, uint32_t n) {
    uint32_t at = n;
    for (uint32_t i = 0; i < n; i++) {
        if (t[i] != '@') continue;
        if (at != n) return 0; /* a second '@' */
        at = i;
    }
    if (at == 0 || at == n) return 0;
    const char *domain = t + at + 1;
    uint32_t len = n - at - 1, label = 0, dots = 0, letters_only = 1;
    if (len == 0) return 0;
    for (uint32_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)domain[i];
        if (c == '.') {
            if (label == 0) return 0; /* a leading dot, or two in a row */
            dots++;
            label = 0;
            letters_only = 1;
        } else if (is_alpha(c) || is_digit(c) || c == '-') {
            label++;
            if (!is_alpha(c)) letters_only = 0;
        } else {
            return 0;
        }
    }
    return dots > 0 && label >= 2 && letters_only;
}

static void end_token(void) {
    if (too_long) {
        digits_rule_end();
        too_long = 0;
        return;
    }
    uint32_t core = token_len;
    while (core && token[core - 1] == '.') core--;
    if (core && is_address(token, core)) {
        emit(MARK, sizeof MARK - 1);
        emit(token + core, token_len - core);
    } else {
        for (uint32_t i = 0; i < token_len; i++) digits_rule(token[i]);
        digits_rule_end();
    }
    token_len = 0;
}

static void feed(char c) {
    if (!is_token_char((unsigned char)c)) {
        end_token();
        emit_char(c);
    } else if (too_long) {
        digits_rule(c);
    } else if (token_len == MAX_TOKEN) {
        too_long = 1; /* not an address: what was held goes through the digits rule */
        for (uint32_t i = 0; i < token_len; i++) digits_rule(token[i]);
        token_len = 0;
        digits_rule(c);
    } else {
        token[token_len++] = c;
    }
}

__attribute__((export_name("seedance_filter"))) int32_t filter(char *delta, uint32_t len) {
    for (uint32_t i = 0; i < len; i++) feed(delta[i]);
    free(delta);
    flush();
    return 0;
}

__attribute__((export_name("seedance_filter_end"))) int32_t filter_end(void) {
    end_token();
    flush();
    return 0;
}
