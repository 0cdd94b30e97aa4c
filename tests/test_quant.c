/* test_quant.c: the 4-bit group-wise compression of quant.c (paper §5): the round-trip error of
 * every element against its group's range, constant groups, a partial last group, and the byte
 * layout (nibble order, where min and scale sit), read back here by a decoder written from the
 * layout's description rather than from quant.c; and the CUDA decompression kernel's per-value
 * body (model.h's q4_value), built for the host, against quant.c's decompression. */
#include "tests.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Element (o, r, i) of a [outer][len][inner] tensor, decoded from quant.c's documented layout. */
static float decode_documented(const uint8_t *q, size_t len, size_t inner, size_t o, size_t r, size_t i) {
    size_t G = (len + 63) / 64, g = r / 64, p = (r % 64) / 2;
    const uint8_t *blob = q + o * G * inner * 36;
    uint8_t byte = blob[(g * 32 + p) * inner + i];
    int nib = r % 2 ? byte & 15 : byte >> 4;
    const fp16 *mins = (const fp16 *)(blob + G * 32 * inner), *scales = mins + G * inner;
    return fp16_to_fp32(mins[g * inner + i]) + nib * fp16_to_fp32(scales[g * inner + i]);
}

/* Compresses x [outer][len][inner], decompresses it, and checks every element against its
 * group's bound: (max - min) / 30 from the rounding to 16 levels, plus what fp16 min and scale
 * cost (relative 2^-11 on the min, 2^-10 on the scale, rounded up). Returns the largest error
 * as a fraction of its bound. */
static double round_trip(const float *x, size_t outer, size_t len, size_t inner) {
    size_t n = outer * len * inner, bytes = q4_bytes(outer, len, inner);
    CU_ASSERT_EQUAL(bytes, outer * ((len + 63) / 64) * inner * 36);
    uint8_t *q = malloc(bytes);
    float *y = malloc(n * sizeof *y);
    q4_compress(x, outer, len, inner, q);
    q4_decompress(q, outer, len, inner, y);
    double worst = 0;
    int bad = 0, mismatch = 0;
    char first_bad[400] = "", first_mismatch[400] = "";
    for (size_t o = 0; o < outer; o++)
        for (size_t g = 0; g * 64 < len; g++)
            for (size_t i = 0; i < inner; i++) {
                float lo = INFINITY, hi = -INFINITY;
                size_t end = (g + 1) * 64 < len ? (g + 1) * 64 : len;
                for (size_t r = g * 64; r < end; r++) {
                    float v = x[(o * len + r) * inner + i];
                    lo = v < lo ? v : lo;
                    hi = v > hi ? v : hi;
                }
                double range = (double)hi - lo;
                double bound = range / 30 * (1 + 0x1p-10) + 0x1p-11 * fabs(lo) + 1e-6 * (fabs(lo) + fabs(hi));
                for (size_t r = g * 64; r < end; r++) {
                    size_t at = (o * len + r) * inner + i;
                    double e = fabs((double)y[at] - x[at]);
                    float documented = decode_documented(q, len, inner, o, r, i);
                    if (!(e <= bound) && !bad++) /* NaN fails too */
                        snprintf(first_bad, sizeof first_bad, "element [%zu][%zu][%zu] of [%zu][%zu][%zu]: "
                                 "expected %g within %.3g, decompressed %g", o, r, i, outer, len, inner,
                                 x[at], bound, y[at]);
                    if (y[at] != documented && !(isnan(y[at]) && isnan(documented)) && !mismatch++)
                        snprintf(first_mismatch, sizeof first_mismatch, "element [%zu][%zu][%zu]: the "
                                 "documented layout decodes %g, q4_decompress gave %g", o, r, i, documented, y[at]);
                    if (e / bound > worst) worst = e / bound;
                }
            }
    EXPECT(bad == 0, "round trip: %d elements off; the first: %s", bad, first_bad);
    EXPECT(mismatch == 0, "layout: %d elements differ; the first: %s", mismatch, first_mismatch);
    free(q);
    free(y);
    return worst;
}

static void test_round_trip_error(void) {
    static const size_t shapes[][3] = {{3, 200, 1}, {1, 64, 1}, {2, 130, 5}, {1, 70, 17}, {4, 1000, 1}};
    uint64_t seed = 7;
    for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
        size_t outer = shapes[s][0], len = shapes[s][1], inner = shapes[s][2], n = outer * len * inner;
        float *x = malloc(n * sizeof *x);
        /* values of mixed scale and sign, some groups far from zero */
        for (size_t e = 0; e < n; e++) x[e] = (test_uniform(&seed) - 0.3f) * (1 + (e / 64 % 5) * 7.5f) + (e / 640 % 2) * 40;
        double worst = round_trip(x, outer, len, inner);
        /* random data comes close to the bound: 32 levels would stay near half of it */
        EXPECT(worst > 0.8, "[%zu][%zu][%zu]: the largest error is %.2f of the bound, expected above 0.8 "
               "(16 levels)", outer, len, inner, worst);
        free(x);
    }
}

/* A group whose max equals its min decodes exactly to that value: no NaN, no Inf. */
static void test_constant_groups(void) {
    enum { LEN = 64 * 3 + 10 };
    float x[2 * LEN];
    static const float values[] = {0.0f, -3.25f, 1e-3f, 65504.0f, 0.5f};
    for (int o = 0; o < 2; o++) /* group g of outer o holds one value (fp16, as stored) */
        for (int r = 0; r < LEN; r++) x[o * LEN + r] = fp16_to_fp32(fp32_to_fp16(values[(4 * o + r / 64) % 5]));
    uint8_t q[2 * 4 * 36];
    float y[2 * LEN];
    q4_compress(x, 2, LEN, 1, q);
    q4_decompress(q, 2, LEN, 1, y);
    int inexact = 0, first = -1;
    for (int e = 0; e < 2 * LEN; e++)
        if (y[e] != x[e] && inexact++ == 0) first = e;
    EXPECT(inexact == 0, "constant groups: %d of %d values not exact; value %d: expected %g, got %g",
           inexact, 2 * LEN, first, first < 0 ? 0 : x[first], first < 0 ? 0 : y[first]);
}

/* The layout: a group of 0..15 twice (min 0, scale 1) packs element 2p in the high nibble;
 * min and scale follow all the nibbles; the partial last group's padding nibbles are 0. The
 * array holding the tensor goes on past its end with values far outside its range (1000), which
 * neither the partial last group's range nor its padding nibbles may take in. */
static void test_layout(void) {
    enum { LEN = 64 + 6 };
    float x[128];
    for (int e = 0; e < 128; e++) x[e] = e < 64 ? (float)(e % 16) : e < LEN ? 100 + 2 * (e - 64) : 1000;
    uint8_t q[2 * 36];
    CU_ASSERT_EQUAL_FATAL(q4_bytes(1, LEN, 1), sizeof q);
    q4_compress(x, 1, LEN, 1, q);
    for (int p = 0; p < 32; p++) {
        uint8_t want = (uint8_t)((2 * p % 16) << 4 | (2 * p + 1) % 16);
        if (q[p] == want) continue;
        EXPECT(0, "layout: byte %d of group 0 (levels %d and %d): expected 0x%02X (the first in the "
               "high nibble), got 0x%02X", p, 2 * p % 16, (2 * p + 1) % 16, want, q[p]);
        break;
    }
    /* second group: 100, 102, ..., 110: min 100, scale 10 / 15 rounded up in fp16 */
    static const uint8_t second[3] = {0x03, 0x69, 0xCF}; /* 100, 102 -> 0, 3; 104, 106 -> 6, 9; ... */
    for (int p = 0; p < 3; p++)
        EXPECT(q[32 + p] == second[p], "layout: byte %d of group 1 (100, 102, ..., 110): expected 0x%02X, "
               "got 0x%02X", p, second[p], q[32 + p]);
    const fp16 *mins = (const fp16 *)(q + 64), *scales = mins + 2;
    EXPECT(fp16_to_fp32(mins[0]) == 0.0f, "group 0's min: expected 0, got %g", fp16_to_fp32(mins[0]));
    EXPECT(fp16_to_fp32(scales[0]) == 1.0f, "group 0's scale: expected 1, got %g", fp16_to_fp32(scales[0]));
    EXPECT(fp16_to_fp32(mins[1]) == 100.0f, "group 1's min: expected 100, got %g", fp16_to_fp32(mins[1]));
    float s1 = fp16_to_fp32(scales[1]);
    EXPECT(s1 >= 10.0f / 15 && s1 < 10.0f / 15 * (1 + 0x1p-9), "group 1's scale: expected 10/15 rounded up "
           "to fp16 (0.6670), got %.4f", s1);
    int pad = 0;
    for (int p = 3; p < 32; p++) pad += q[32 + p] != 0;
    EXPECT(pad == 0, "layout: %d padding bytes of the partial group 1 are not 0", pad);
    float y[LEN];
    q4_decompress(q, 1, LEN, 1, y);
    for (int e = 0; e < 64; e++)
        if (y[e] != x[e]) {
            EXPECT(0, "decompressed value %d of group 0 (min 0, scale 1): expected %g, got %g", e, x[e], y[e]);
            break;
        }

    /* grouped across rows: [1][64][2], element (r, i) in byte (r / 2, i) */
    float z[64 * 2];
    for (int r = 0; r < 64; r++) z[2 * r] = (float)(r % 16), z[2 * r + 1] = (float)(15 - r % 16);
    uint8_t qz[2 * 36];
    CU_ASSERT_EQUAL_FATAL(q4_bytes(1, 64, 2), sizeof qz);
    q4_compress(z, 1, 64, 2, qz);
    int wrong = 0;
    for (int p = 0; p < 32; p++)
        for (int i = 0; i < 2; i++) {
            int a = (2 * p) % 16, b = (2 * p + 1) % 16;
            if (i) a = 15 - a, b = 15 - b;
            uint8_t want = (uint8_t)(a << 4 | b);
            if (qz[p * 2 + i] != want && !wrong++)
                EXPECT(0, "layout across rows [1][64][2]: byte (%d, %d): expected 0x%02X, got 0x%02X", p, i,
                       want, qz[p * 2 + i]);
        }
}

/* flexgen.cu's 4-bit decompression kernel gives each value a thread, which computes it with
 * model.h's q4_value; built here for the host, it must give q4_decompress's bits for every
 * value: groups along contiguous values (inner 1) and across rows, several outer indices, and
 * partial last groups. */
static void test_kernel_dequant_body(void) {
    static const size_t shapes[][3] = {{1, 64, 1}, {3, 150, 1}, {2, 100, 5}, {1, 7, 9}, {2, 200, 33}};
    uint64_t seed = 11;
    for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
        size_t outer = shapes[s][0], len = shapes[s][1], inner = shapes[s][2], n = outer * len * inner;
        float *x = malloc(n * sizeof *x), *y = malloc(n * sizeof *y);
        uint8_t *q = malloc(q4_bytes(outer, len, inner));
        for (size_t e = 0; e < n; e++) x[e] = (test_uniform(&seed) - 0.4f) * (1 + (e / 97 % 4) * 9.0f);
        q4_compress(x, outer, len, inner, q);
        q4_decompress(q, outer, len, inner, y);
        size_t differ = 0, first = 0;
        float got = 0;
        for (size_t e = 0; e < n; e++) {
            float v = q4_value(q, len, inner, e);
            if (memcmp(&v, &y[e], sizeof v) && !differ++) first = e, got = v;
        }
        EXPECT(differ == 0, "[%zu][%zu][%zu]: %zu of %zu values differ; value %zu ([%zu][%zu][%zu]): "
               "q4_decompress gives %g, the kernel's q4_value %g", outer, len, inner, differ, n, first,
               first / (len * inner), first / inner % len, first % inner, y[first], got);
        free(x), free(y), free(q);
    }
}

/* Top-K of sparse attention (§5) with ties at the threshold: they go to the earlier index, and
 * exactly k are kept. */
static void test_topk_ties(void) {
    static const struct { float w[4]; int n, k, want[4], n_want; } cases[] = {
        {{3, 1, 3, 3}, 4, 2, {0, 2}, 2},
        {{3, 1, 3, 3}, 4, 3, {0, 2, 3}, 3},
        {{3, 1, 3, 3}, 4, 1, {0}, 1},
        {{5, 5, 5, 0}, 3, 2, {0, 1}, 2},
        {{1, 4, 2, 4}, 4, 1, {1}, 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        int keep[4] = {-1, -1, -1, -1};
        float scratch[4];
        const float *w = cases[i].w;
        int got = topk_keep(w, cases[i].n, cases[i].k, keep, scratch);
        int same = got == cases[i].n_want && !memcmp(keep, cases[i].want, (size_t)got * sizeof *keep);
        EXPECT(same, "topk_keep({%g, %g, %g, %g} of %d, k = %d): expected %d indices {%d, %d, %d}, got "
               "%d {%d, %d, %d}", w[0], w[1], w[2], w[3], cases[i].n, cases[i].k, cases[i].n_want,
               cases[i].want[0], cases[i].want[1], cases[i].want[2], got, keep[0], keep[1], keep[2]);
    }
}

/* q4_compress_fp16 (weights at load) widens a few groups at a time: on fp16 values its bytes are
 * q4_compress's of the same values in fp32, byte for byte, at shapes that take several slices:
 * an embedding-like [1][1000][8192] (16 groups in slices of 8, the last partial) and a matrix-like
 * [66000][70][1] (one group a slice, the second of 6 values). */
static void test_compress_fp16(void) {
    static const size_t shapes[][3] = {{1, 1000, 8192}, {66000, 70, 1}, {3, 130, 5}};
    for (size_t c = 0; c < sizeof shapes / sizeof *shapes; c++) {
        size_t outer = shapes[c][0], len = shapes[c][1], inner = shapes[c][2], n = outer * len * inner;
        size_t bytes = q4_bytes(outer, len, inner);
        fp16 *h = malloc(n * sizeof *h);
        float *x = malloc(n * sizeof *x);
        uint8_t *want = malloc(bytes), *got = malloc(bytes);
        uint64_t seed = 7 + c;
        for (size_t e = 0; e < n; e++) h[e] = fp32_to_fp16(4 * test_uniform(&seed) - 2), x[e] = fp16_to_fp32(h[e]);
        q4_compress(x, outer, len, inner, want);
        memset(got, 0xa5, bytes);
        CU_ASSERT_EQUAL(q4_compress_fp16(h, outer, len, inner, got), 0);
        EXPECT(memcmp(want, got, bytes) == 0, "[%zu][%zu][%zu]: q4_compress_fp16's bytes differ from q4_compress's",
               outer, len, inner);
        free(h), free(x), free(want), free(got);
    }
}

void add_quant_tests(void) {
    CU_pSuite s = CU_add_suite("quant", NULL, NULL);
    CU_add_test(s, "round trip within (max - min) / 30 plus fp16 rounding", test_round_trip_error);
    CU_add_test(s, "fp16 input compressed a slice of groups at a time: q4_compress's bytes", test_compress_fp16);
    CU_add_test(s, "constant groups decode exactly", test_constant_groups);
    CU_add_test(s, "layout: nibble order, min and scale, padding", test_layout);
    CU_add_test(s, "the CUDA decompression kernel's body, on the host, as q4_decompress",
                test_kernel_dequant_body);
    CU_add_test(s, "top-K with ties keeps exactly k, the earlier first", test_topk_ties);
}
