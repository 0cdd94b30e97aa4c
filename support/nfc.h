/* support/nfc.h: Unicode NFC normalization of UTF-8 text (support/nfc.c), as HF tokenizers' NFC
 * normalizer (Qwen2's tokenizer.json: "normalizer": {"type": "NFC"}). */
#ifndef FLEXGEN_NFC_H
#define FLEXGEN_NFC_H

#include <stddef.h>
#include <stdint.h>

/* The NFC form of the n bytes at s, malloc'd and NUL-terminated, its length in *out_n (when
 * out_n is not NULL). Bytes that are not valid UTF-8 pass through unchanged, each one a starter
 * that never composes. NULL when out of memory. */
char *utf8_nfc(const char *s, size_t n, size_t *out_n);

/* Length of the UTF-8 sequence at s (n > 0 bytes left) and its code point in *u; where the
 * sequence is not valid UTF-8 (overlong, a surrogate, past U+10FFFF, cut short), the first byte
 * alone, length 1, with *u negative (-1 - the byte), so that every byte stays encodable. */
size_t utf8_next(const unsigned char *s, size_t n, int32_t *u);

#endif
