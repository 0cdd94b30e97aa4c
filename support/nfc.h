/* support/nfc.h: Unicode NFC normalization of UTF-8 text (support/nfc.c), as HF tokenizers' NFC
 * normalizer (Qwen2's tokenizer.json: "normalizer": {"type": "NFC"}). */
#ifndef FLEXGEN_NFC_H
#define FLEXGEN_NFC_H

#include <stddef.h>

/* The NFC form of the n bytes at s, malloc'd and NUL-terminated, its length in *out_n (when
 * out_n is not NULL). Bytes that are not valid UTF-8 pass through unchanged, each one a starter
 * that never composes. NULL when out of memory. */
char *utf8_nfc(const char *s, size_t n, size_t *out_n);

#endif
