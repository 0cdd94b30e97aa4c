/* support/nfc.c: Unicode NFC normalization of UTF-8 text (Unicode Standard Annex #15), as HF
 * tokenizers' NFC normalizer does it, in UAX #15's three steps:
 *   1. full canonical decomposition, recursive over nfc_tables.h's mappings;
 *   2. canonical ordering: each run of non-starters stably sorted by combining class;
 *   3. canonical composition: each character not blocked from the last starter is merged into it
 *      where the two have a primary composite.
 * Hangul syllables are decomposed (S -> L V [T]) and composed (L V -> LV, LV T -> LVT) by
 * arithmetic, not tables. Bytes that are not valid UTF-8 (bad lead bytes, truncated sequences,
 * overlongs, surrogates, values past U+10FFFF) pass through unchanged one by one: each is a
 * starter (class 0) that never composes, so it also blocks composition across it.
 * The tables come from scripts/gen_nfc_tables.py (NFC_UNIDATA_VERSION).
 */
#include "support/nfc.h"
#include "support/nfc_tables.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { /* Hangul syllables' arithmetic (Unicode chapter 3.12) */
       S_BASE = 0xAC00,
       L_BASE = 0x1100,
       V_BASE = 0x1161,
       T_BASE = 0x11A7,
       L_COUNT = 19,
       V_COUNT = 21,
       T_COUNT = 28,
       N_COUNT = V_COUNT * T_COUNT,
       S_COUNT = L_COUNT * N_COUNT
};

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))
/* A unit is a code point (>= 0) or an invalid byte b kept as RAW_BYTE(b) (< 0). */
#define RAW_BYTE(b) (-1 - (int32_t)(b))

/* Length of the UTF-8 sequence at s (n > 0 bytes left) and its unit in *u: the code point, or
 * RAW_BYTE of the first byte alone (length 1) when the sequence is not valid UTF-8. */
size_t utf8_next(const unsigned char *s, size_t n, int32_t *u) {
    unsigned c = s[0];
    size_t len;
    uint32_t v, min;
    *u = RAW_BYTE(c);
    if (c < 0x80) {
        *u = (int32_t)c;
        return 1;
    }
    if (c >= 0xC2 && c <= 0xDF) {
        len = 2;
        v = c & 0x1F;
        min = 0x80;
    } else if (c >= 0xE0 && c <= 0xEF) {
        len = 3;
        v = c & 0x0F;
        min = 0x800;
    } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4;
        v = c & 0x07;
        min = 0x10000;
    } else return 1;
    if (n < len) return 1;
    for (size_t k = 1; k < len; k++) {
        if ((s[k] & 0xC0) != 0x80) return 1;
        v = (v << 6) | (s[k] & 0x3F);
    }
    if (v < min || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) return 1;
    *u = (int32_t)v;
    return len;
}

/* Writes unit u as UTF-8 (an invalid byte as itself) at dst; returns the bytes written. */
static size_t utf8_put(unsigned char *dst, int32_t u) {
    static const unsigned char lead[5] = {0, 0, 0xC0, 0xE0, 0xF0};
    if (u < 0x80) {
        dst[0] = (unsigned char)(u < 0 ? -1 - u : u);
        return 1;
    }
    size_t len = u < 0x800 ? 2 : u < 0x10000 ? 3 : 4;
    for (size_t k = len - 1; k > 0; k--, u >>= 6) dst[k] = (unsigned char)(0x80 | (u & 0x3F));
    dst[0] = (unsigned char)(lead[len] | u);
    return len;
}

/* The canonical combining class of unit u (0 for invalid bytes). */
static int ccc_of(int32_t u) {
    if (u < 0x300) return 0;
    size_t lo = 0, hi = COUNT(nfc_ccc);
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if ((uint32_t)u < nfc_ccc[mid].first) hi = mid;
        else if ((uint32_t)u > nfc_ccc[mid].last) lo = mid + 1;
        else return nfc_ccc[mid].ccc;
    }
    return 0;
}

/* The canonical decomposition mapping of u (not a Hangul syllable), or NULL when it has none. */
static const nfc_decomp_entry *decomp_of(int32_t u) {
    if (u < 0xC0) return NULL;
    size_t lo = 0, hi = COUNT(nfc_decomp);
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if ((uint32_t)u < nfc_decomp[mid].cp) hi = mid;
        else if ((uint32_t)u > nfc_decomp[mid].cp) lo = mid + 1;
        else return &nfc_decomp[mid];
    }
    return NULL;
}

/* The primary composite of starter a and b (Hangul by arithmetic), or -1 when there is none. */
static int32_t compose_pair(int32_t a, int32_t b) {
    if (a < 0 || b < 0x300) return -1; /* invalid bytes never compose; no second is below U+0300 */
    if (a >= L_BASE && a < L_BASE + L_COUNT && b >= V_BASE && b < V_BASE + V_COUNT)
        return S_BASE + ((a - L_BASE) * V_COUNT + (b - V_BASE)) * T_COUNT;
    if (a >= S_BASE && a < S_BASE + S_COUNT && (a - S_BASE) % T_COUNT == 0 && b > T_BASE &&
        b < T_BASE + T_COUNT)
        return a + (b - T_BASE);
    size_t lo = 0, hi = COUNT(nfc_comp);
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        const nfc_comp_entry *e = &nfc_comp[mid];
        if ((uint32_t)a < e->first || ((uint32_t)a == e->first && (uint32_t)b < e->second))
            hi = mid;
        else if ((uint32_t)a > e->first || (uint32_t)b > e->second) lo = mid + 1;
        else return (int32_t)e->composite;
    }
    return -1;
}

/* Writes the full canonical decomposition of unit u at out; returns the units written. */
static size_t decompose(int32_t u, int32_t *out) {
    if (u >= S_BASE && u < S_BASE + S_COUNT) {
        int32_t s = u - S_BASE, t = s % T_COUNT;
        out[0] = L_BASE + s / N_COUNT;
        out[1] = V_BASE + (s % N_COUNT) / T_COUNT;
        if (t) out[2] = T_BASE + t;
        return t ? 3 : 2;
    }
    const nfc_decomp_entry *d = decomp_of(u);
    if (!d) {
        out[0] = u;
        return 1;
    }
    size_t k = decompose((int32_t)d->first, out);
    if (d->second) k += decompose((int32_t)d->second, out + k);
    return k;
}

/* Canonical ordering: stably sorts each run of non-starters in u[0..n) by combining class. */
static void reorder(int32_t *u, size_t n) {
    for (size_t i = 1; i < n; i++) {
        int32_t c = u[i];
        int cc = ccc_of(c);
        if (cc == 0) continue;
        size_t j = i;
        for (; j > 0 && ccc_of(u[j - 1]) > cc; j--) u[j] = u[j - 1]; /* a starter stops it */
        u[j] = c;
    }
}

/* Canonical composition of the ordered units u[0..n) in place; returns the units left. A unit C is
 * blocked from the last starter S when some B kept between them has ccc(B) == 0 or >= ccc(C):
 * the kept units after S ascend in class, so the last one kept (last_ccc) decides. */
static size_t compose(int32_t *u, size_t n) {
    size_t w = 0, starter = SIZE_MAX;
    int last_ccc = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t c = u[i];
        int cc = ccc_of(c);
        if (starter != SIZE_MAX && (w == starter + 1 || last_ccc < cc)) {
            int32_t merged = compose_pair(u[starter], c);
            if (merged >= 0) {
                u[starter] = merged;
                continue;
            }
        }
        if (cc == 0) starter = w;
        last_ccc = cc;
        u[w++] = c;
    }
    return w;
}

/* Decodes s[0..n) and decomposes each character into u (room for NFC_MAX_UNITS_PER_BYTE units a
 * byte); returns the units written. */
static size_t decode_decomposed(const unsigned char *s, size_t n, int32_t *u) {
    size_t w = 0;
    for (size_t i = 0; i < n;) {
        int32_t c;
        i += utf8_next(s + i, n - i, &c);
        if (c < 0) u[w++] = c;
        else w += decompose(c, u + w);
    }
    return w;
}

/* A malloc'd copy of s[0..n), NUL-terminated, its length in *out_n. */
static char *copy_bytes(const char *s, size_t n, size_t *out_n) {
    char *out = malloc(n + 1);
    if (!out) return NULL;
    if (n) memcpy(out, s, n);
    out[n] = '\0';
    if (out_n) *out_n = n;
    return out;
}

/* The NFC form of s[0..n), malloc'd and NUL-terminated (see nfc.h). */
char *utf8_nfc(const char *s, size_t n, size_t *out_n) {
    const unsigned char *b = (const unsigned char *)s;
    size_t i = 0;
    while (i < n && b[i] < 0xCC) i++; /* every character below U+0300 is already NFC */
    if (i == n) return copy_bytes(s, n, out_n);
    /* room for the units, then for 4 bytes out per unit */
    if (n > SIZE_MAX / (4 * sizeof(int32_t) * NFC_MAX_UNITS_PER_BYTE)) return NULL;
    int32_t *u = malloc(n * NFC_MAX_UNITS_PER_BYTE * sizeof *u);
    if (!u) return NULL;
    size_t m = decode_decomposed(b, n, u);
    reorder(u, m);
    m = compose(u, m);
    unsigned char *out = malloc(4 * m + 1);
    if (out) {
        size_t k = 0;
        for (size_t j = 0; j < m; j++) k += utf8_put(out + k, u[j]);
        out[k] = '\0';
        if (out_n) *out_n = k;
    }
    free(u);
    return (char *)out;
}
