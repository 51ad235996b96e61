/* The Seedance module ABI for C test modules (see src/seedance/wasm/__init__.py).
 * Build: clang --target=wasm32-wasi -O2 -nostartfiles -Wl,--no-entry -Wl,--export-dynamic */
#ifndef SEEDANCE_H
#define SEEDANCE_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define SEEDANCE_IMPORT(name) __attribute__((import_module("seedance"), import_name(name)))
#define SEEDANCE_EXPORT(name) __attribute__((export_name(name)))

SEEDANCE_IMPORT("output") void seedance_output(const void *ptr, uint32_t len);
SEEDANCE_IMPORT("log") void seedance_log(const void *ptr, uint32_t len);

/* The host writes each input into a buffer from here; the module frees it. */
SEEDANCE_EXPORT("seedance_alloc") void *seedance_alloc(uint32_t size) { return malloc(size); }

static inline void out_str(const char *s) { seedance_output(s, (uint32_t)strlen(s)); }
static inline void log_str(const char *s) { seedance_log(s, (uint32_t)strlen(s)); }

#endif
