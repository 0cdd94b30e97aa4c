/* support/int8.c: 4-bit weights times int8 activations, an opt-in numeric scheme beside §5's
 * (--int8-activations, the CPU backend only), in two forms: decode's blocks, described first, and
 * prefill's rows rounded once (the end of this file).
 *
 * §5 keeps the activations in fp32 and widens each 4-bit weight, min + q scale, to fp32 before
 * multiplying (support/matmul.c). Here the activations are rounded to int8 instead, so the inner
 * loops multiply integers: the 4-bit codes q (0 .. 15) by 8-bit activations, summed exactly in
 * int32, with AVX2's vpmaddubsw (32 products an instruction, against 8 for an fp32 FMA).
 *
 * A linear weight W[in][out] is grouped along out (quant.c's layout): row k's 64 columns of group
 * g share a min m[k][g] and a scale s[k][g]. So, for a column j of group g,
 *
 *   y[r][j] = sum_k x[r][k] (q[k][j] s[k][g] + m[k][g])
 *           = sum_k a[k] q[k][j]  +  sum_k x[r][k] m[k][g],      a[k] = x[r][k] s[k][g].
 *
 * The sum over k runs in blocks of 64. In each block, for each row and group, a is rounded to
 * int8 with one scale, the block's largest |a| becoming 127:
 *
 *   alpha = max|a| / 127,    a8[k] = round(a[k] (127 / max|a|))     (|a8| <= 127)
 *
 * and y gains fmaf(alpha, isum[j], msum), where isum[j] = sum_k a8[k] q[k][j], exact in int32,
 * and msum = sum_k x[r][k] m[k][g] in fp32, in 8 lanes (lane l sums the k = l mod 8 in order; the
 * lanes are added as AVX2's halving reduction adds them). Rounding a is the one new error: at
 * most alpha / 2 for each a[k], so |y - exact| <= sum over blocks of (alpha / 2) sum_k q[k][j],
 * plus fp32's rounding. tests/test_matmul.c holds the kernel to that, against a double-precision
 * sum of the same int8 operands.
 *
 * The portable path, the AVX2 one and the VNNI one give the same bits: the integer sums are exact,
 * and the floating-point steps (a, max|a|, alpha, the rounding to nearest even, msum's lanes, the
 * fmaf) are the same operations in the same order. tests/test_matmul.c holds the kernels to that.
 * A whole run needs more: the rounding to int8 (below) turns a last-bit difference in any input
 * row into a whole step, so everything upstream must give the same bits on every path too. It
 * does (docs/DESIGN.md, "Same bits"), decode attention included, whose plain loop once summed
 * in another order than its AVX2 twin and moved FLEXGEN_ISA=portable's logits by up to 0.09 on
 * models/opt-kjv; tests/test_cli.c's "FLEXGEN_ISA: every path to the same logits" compares whole
 * runs in this mode byte for byte.
 *
 * What is rounded: the input rows of the linear layers that take 4-bit weights (q/k/v, out_proj,
 * fc1, fc2; project_in and project_out where a model has them), each row on its own. lm_head and
 * attention keep fp32, and the KV cache is fp16 as in every mode. On models/opt-kjv
 * (scripts/accuracy_table.py; BENCHMARKS.md has the tables) the mode changes about 1% of the 4-bit
 * run's next-token predictions (395 of 42,101 in prefill, 408 in decode), but the changes go both
 * ways, away from fp16's token and back to it, so the top-1 agreement with fp16 moves by 0.01
 * points (0.8862 to 0.8861, in prefill and in decode).
 *
 * Why a difference in the last bit grows here. Rounding to int8 is a step function. Attention sums
 * in another order in prefill (sgemm over all queries) than in decode (one query's dot products),
 * so the same token's attention output can differ in its last fp32 bit. With fp32 products such a
 * difference stays in the last bits: with fp16 or 4-bit weights, decode predicts prefill's token
 * at every position. Here out_proj rounds that output to int8: a value at a rounding boundary
 * (a8 + 1/2) can land on either side, and then a8 moves by a whole step, alpha = max|a| / 127
 * (about 2^-7 of the block's largest value, where a last bit is 2^-24 of the value); if the value
 * is the block's largest, alpha and every a8 of the block move with it. The layer's outputs, the
 * next layer's K, V and inputs, then differ by that much, and every later linear layer rounds them
 * again; and prefill's products round once per row where decode's round per block. So with int8
 * activations decode and prefill predict differently at 555 of 42,101 positions. That is the
 * scheme's rounding, not a bug in the kernel (tests/test_matmul.c holds it to its bound): compare
 * this mode's runs within one mode; anything that changes an fp32 sum upstream (another OpenBLAS
 * core, another order) can move a few predictions, which is why a job's line names the OpenBLAS
 * core (app/jobs.c), and why every path of our own kernels sums in one order.
 *
 * The kernel. Threads share the groups (64 columns of y, or a part's last, narrower group). For
 * each pass of up to 64 rows of x, each block of 64 k, and each group:
 *   pack      the block's codes into a panel of quads, [k / 4][64 columns][4 codes of k]: 4 KiB
 *             in L1, so that one vpmaddubsw multiplies 8 columns by 4 values of k (the columns
 *             in the order the bytes interleave into, put back in order at the end);
 *   quantize  each row's a into a8, alpha and msum, four rows side by side (their chains overlap);
 *   tile      isum of 4 rows by 16 columns at a time: per 4 k, vpmaddubsw of two vectors of the
 *             panel with the row's 4 values of a8 broadcast, summed in int16 over 32 k (at most
 *             8 x 2 x 15 x 127 = 30480: no overflow), then widened to int32 (vpmaddwd by ones);
 *             on AVX-512 with VNNI (support/avx512.c's int8_sums, on SIMDe too), one vpdpbusd
 *             multiplies 16 slots' quads by the row's 4 values and adds them into int32 at once;
 *             with AVX-VNNI (CPUs without AVX-512: vnni256_sums below), 8 slots' in 256 bits;
 *   finish    y (0, or y when adding, in the first block) + fmaf(alpha, isum, msum).
 * The panel pays when many rows of x share it. For up to 8 rows (decode's batches), the wide
 * paths do the same operations with no panel, taking the codes straight from W, quads built by
 * four unpacks (groups_in_pairs below hands each run of whole groups to the path's
 * int8_pairs): on the path with AVX-512 VNNI (or SIMDe), support/avx512.c's, two groups a register
 * and vpdpbusd; on the avx2 path, int8_pairs_avx2 below, one group a register and vpmaddubsw as
 * in tile_avx2, which needs no VNNI (a laptop's CPU).
 */
#include "support/support.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_AVX2_PATH 1
#endif

enum { KB = 64, PASS_ROWS = 64, TR = 4 }; /* k in a block; rows of x in a pass; rows in a tile */
/* Up to this many rows of x (decode's batches), the path's kernel without a panel is faster than
 * packing a panel for them: at 8 rows, 1.14 to 1.67x on opt-125m's and opt-1.3b's shapes on the
 * AVX-512 VNNI path and the avx2 one, but for 0.95x on opt-125m's fc2 on the avx2 one. At 16 and
 * 32 it was faster on wide W (8192 columns) and slower on narrow (768) on the VNNI path, and whole
 * runs moved within the noise (BENCHMARKS.md, "The integer mode's decode without a panel") */
enum { NO_PANEL_ROWS = 8 };

/* One group of y's columns: n (<= 64) columns from col; in each row of W (row_bytes long), its
 * codes start at byte `codes`, its min and scale (fp16) at bytes `min` and `scale`. */
typedef struct {
    int col, n;
    size_t row_bytes, codes, min, scale;
} q4_group;

/* Group u of W's q4 parts (each [in][out / q4] grouped on its own, side by side in a row). */
static q4_group group_of(int q4, int out, int u) {
    int part = out / q4, G = (part + Q4_GROUP - 1) / Q4_GROUP, s = u / G, g = u % G;
    size_t part_bytes = q4_bytes(1, (size_t)part, 1), at = (size_t)s * part_bytes;
    return (q4_group){.col = s * part + g * Q4_GROUP,
                      .n = part - g * Q4_GROUP < Q4_GROUP ? part - g * Q4_GROUP : Q4_GROUP,
                      .row_bytes = (size_t)q4 * part_bytes,
                      .codes = at + (size_t)g * (Q4_GROUP / 2),
                      .min = at + (size_t)G * (Q4_GROUP / 2) + 2 * (size_t)g,
                      .scale = at + (size_t)G * (Q4_GROUP / 2 + 2) + 2 * (size_t)g};
}

static float fp16_at(const uint8_t *p) {
    fp16 h;
    memcpy(&h, p, sizeof h);
    return fp16_to_fp32(h);
}

/* A block's operands: the codes of rows k .. k + 3 of one column side by side (a quad), the
 * quads of rows 4i .. 4i + 3 at quads[i][slot], and the rows' scales and mins; zeros past the
 * block's rows and the group's columns. The slots hold the columns in the order that four rows'
 * bytes interleave into (pack_avx2): slot_column maps them back. */
typedef struct {
    _Alignas(32) uint8_t quads[KB / 4][64][4];
    _Alignas(32) float scale[KB], min[KB];
} block_panel;

/* Slot s: in each 16 slots, 8 even columns then 8 odd ones; byte p of a row holds columns 2p (its
 * high nibble) and 2p + 1, and slots 16i .. 16i + 15 take bytes 4i .. 4i + 3 and 16 + 4i .. 19 +
 * 4i. */
static int slot_column(int s) {
    int i = s / 16, odd = s / 8 % 2, j = s % 8;
    return 2 * (j < 4 ? 4 * i + j : 16 + 4 * i + j - 4) + odd;
}

/* One pass's rows, quantized for a block: a8[r][k], alpha[r], msum[r]. */
typedef struct {
    _Alignas(32) int8_t a8[PASS_ROWS][KB];
    float alpha[PASS_ROWS], msum[PASS_ROWS];
} block_rows;

/* ---- The plain path, which the AVX2 one is held to, bit for bit ---- */

static void pack_portable(const uint8_t *W, const q4_group *gr, int k0, int kc, block_panel *p) {
    memset(p, 0, sizeof *p);
    for (int k = 0; k < kc; k++) {
        const uint8_t *row = W + (size_t)(k0 + k) * gr->row_bytes;
        p->scale[k] = fp16_at(row + gr->scale);
        p->min[k] = fp16_at(row + gr->min);
        for (int s = 0; s < 64; s++) {
            int c = slot_column(s);
            uint8_t byte = row[gr->codes + c / 2];
            if (c < gr->n) p->quads[k / 4][s][k % 4] = c % 2 ? byte & 15 : byte >> 4;
        }
    }
}

static float lanes_add(const float lane[8]) {
    return ((lane[0] + lane[4]) + (lane[2] + lane[6])) +
           ((lane[1] + lane[5]) + (lane[3] + lane[7]));
}

/* alpha and 127 / max|a| from max|a|; a block of zeros (or of values too small to scale) is 0. */
static float scales_of(float big, float *inv) {
    *inv = big >= 0x1p-100f ? 127 / big : 0;
    return big >= 0x1p-100f ? big / 127 : 0;
}

/* Row x of the block (its 64 values, zeros past the block's rows). */
static void quantize_portable(const float *x, const block_panel *p, int8_t *a8, float *alpha,
                              float *msum) {
    float a[KB], big = 0, lane[8] = {0}, inv;
    for (int k = 0; k < KB; k++) {
        a[k] = x[k] * p->scale[k];
        big = fmaxf(big, fabsf(a[k]));
        lane[k % 8] = fmaf(x[k], p->min[k], lane[k % 8]);
    }
    *msum = lanes_add(lane);
    *alpha = scales_of(big, &inv);
    for (int k = 0; k < KB; k++) a8[k] = (int8_t)nearbyintf(a[k] * inv);
}

/* isum[r][s]: row r0 + r's sum over the block for slot s. */
static void tile_portable(const block_panel *p, const block_rows *q, int r0, int mr,
                          int32_t isum[TR][64]) {
    for (int r = 0; r < mr; r++)
        for (int s = 0; s < 64; s++) {
            int32_t sum = 0;
            for (int k = 0; k < KB; k++) sum += q->a8[r0 + r][k] * p->quads[k / 4][s][k % 4];
            isum[r][s] = sum;
        }
}

static void finish_portable(const block_rows *q, int r0, int mr, int32_t isum[TR][64], int n,
                            float *y, size_t ldy, int from_y) {
    for (int r = 0; r < mr; r++)
        for (int s = 0; s < 64; s++) {
            int c = slot_column(s);
            if (c >= n) continue;
            float base = from_y ? y[r * ldy + c] : 0;
            y[r * ldy + c] = base + fmaf(q->alpha[r0 + r], (float)isum[r][s], q->msum[r0 + r]);
        }
}

#ifdef HAVE_AVX2_PATH
/* ---- AVX2 ---- */

/* A whole group (n == 64), four rows at a time: their bytes interleaved into 32-bit lanes (byte p
 * of rows k .. k + 3), whose high nibbles are the quads of column 2p and low nibbles of 2p + 1.
 * The same group's rows of the next block (`ahead` of them) are prefetched into L2: a block's 64
 * rows are 64 streams, more than the hardware's prefetcher follows (as in support/matmul.c). */
__attribute__((target("avx2,f16c"))) static void pack_avx2(const uint8_t *W, const q4_group *gr,
                                                           int k0, int kc, int ahead,
                                                           block_panel *p) {
    for (int k = 0; k < ahead; k++) {
        const char *next = (const char *)W + (size_t)(k0 + KB + k) * gr->row_bytes;
        _mm_prefetch(next + gr->codes, _MM_HINT_T1);
        if (gr->col / Q4_GROUP % 8 == 0) /* mins and scales: 8 groups' are 16 bytes of a line */
            _mm_prefetch(next + gr->min, _MM_HINT_T1), _mm_prefetch(next + gr->scale, _MM_HINT_T1);
    }
    const __m256i low4 = _mm256_set1_epi8(15);
    _Alignas(16) fp16 scales[KB] = {0}, mins[KB] = {0};
    for (int k4 = 0; k4 < KB; k4 += 4) {
        __m256i b[4];
        for (int i = 0; i < 4; i++) {
            int k = k4 + i;
            if (k >= kc) {
                b[i] = _mm256_setzero_si256();
                continue;
            }
            const uint8_t *row = W + (size_t)(k0 + k) * gr->row_bytes;
            b[i] = _mm256_loadu_si256((const __m256i *)(row + gr->codes));
            memcpy(&scales[k], row + gr->scale, 2);
            memcpy(&mins[k], row + gr->min, 2);
        }
        __m256i lo01 = _mm256_unpacklo_epi8(b[0], b[1]), hi01 = _mm256_unpackhi_epi8(b[0], b[1]);
        __m256i lo23 = _mm256_unpacklo_epi8(b[2], b[3]), hi23 = _mm256_unpackhi_epi8(b[2], b[3]);
        __m256i v[4] = {_mm256_unpacklo_epi16(lo01, lo23), _mm256_unpackhi_epi16(lo01, lo23),
                        _mm256_unpacklo_epi16(hi01, hi23), _mm256_unpackhi_epi16(hi01, hi23)};
        for (int i = 0; i < 4; i++) {
            _mm256_store_si256((__m256i *)p->quads[k4 / 4][16 * i],
                               _mm256_and_si256(_mm256_srli_epi16(v[i], 4), low4));
            _mm256_store_si256((__m256i *)p->quads[k4 / 4][16 * i + 8],
                               _mm256_and_si256(v[i], low4));
        }
    }
    for (int k = 0; k < KB; k += 8) {
        _mm256_store_ps(p->scale + k,
                        _mm256_cvtph_ps(_mm_load_si128((const __m128i *)(scales + k))));
        _mm256_store_ps(p->min + k, _mm256_cvtph_ps(_mm_load_si128((const __m128i *)(mins + k))));
    }
}

/* Rows x[0 .. mr) of the block, mr <= TR, quantized together: each row's chains (its msum's 8
 * lanes, its max) are 8 dependent steps, so four rows' side by side keep the FMA units busy. a is
 * computed twice, once for max|a| and once to round it, the same product both times. */
__attribute__((target("avx2,fma"), always_inline)) static inline void quantize_rows_avx2(
    const float *const x[TR], const block_panel *p, block_rows *q, int r0, const int mr) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 big[TR], lanes[TR];
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++) big[r] = lanes[r] = _mm256_setzero_ps();
    for (int k = 0; k < KB; k += 8) {
        __m256 scale = _mm256_load_ps(p->scale + k), min = _mm256_load_ps(p->min + k);
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++) {
            __m256 xv = _mm256_loadu_ps(x[r] + k);
            big[r] = _mm256_max_ps(big[r], _mm256_and_ps(_mm256_mul_ps(xv, scale), magnitude));
            lanes[r] = _mm256_fmadd_ps(xv, min, lanes[r]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++) {
        __m128 l4 =
            _mm_add_ps(_mm256_castps256_ps128(lanes[r]), _mm256_extractf128_ps(lanes[r], 1));
        l4 = _mm_add_ps(l4, _mm_movehl_ps(l4, l4)); /* (l0 + l4) + (l2 + l6), (l1 + l5) + (l3 +
                                                       l7) */
        q->msum[r0 + r] = _mm_cvtss_f32(_mm_add_ss(l4, _mm_movehdup_ps(l4)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(big[r]),
                               _mm256_extractf128_ps(big[r], 1)); /* exact */
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        float inv;
        q->alpha[r0 + r] = scales_of(_mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4))), &inv);
        __m256 invv = _mm256_set1_ps(inv);
        for (int k = 0; k < KB; k += 16) { /* 16 values: int32 -> int16 -> int8, in order */
            __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(x[r] + k), _mm256_load_ps(p->scale + k));
            __m256 a1 =
                _mm256_mul_ps(_mm256_loadu_ps(x[r] + k + 8), _mm256_load_ps(p->scale + k + 8));
            __m256i v0 = _mm256_cvtps_epi32(_mm256_mul_ps(a0, invv)),
                    v1 = _mm256_cvtps_epi32(_mm256_mul_ps(a1, invv));
            __m128i w0 =
                _mm_packs_epi32(_mm256_castsi256_si128(v0), _mm256_extracti128_si256(v0, 1));
            __m128i w1 =
                _mm_packs_epi32(_mm256_castsi256_si128(v1), _mm256_extracti128_si256(v1, 1));
            _mm_storeu_si128((__m128i *)(q->a8[r0 + r] + k), _mm_packs_epi16(w0, w1));
        }
    }
}

__attribute__((target("avx2,fma"))) static void quantize_avx2(const float *const x[TR],
                                                              const block_panel *p, block_rows *q,
                                                              int r0, int mr) {
    switch (mr) {
    case 1: quantize_rows_avx2(x, p, q, r0, 1); break;
    case 2: quantize_rows_avx2(x, p, q, r0, 2); break;
    case 3: quantize_rows_avx2(x, p, q, r0, 3); break;
    default: quantize_rows_avx2(x, p, q, r0, 4); break;
    }
}

/* isum for mr rows (a constant at each call, so the loops unroll) and the 16 slots from s. */
__attribute__((target("avx2"), always_inline)) static inline void tile_avx2_rows(
    const block_panel *p, const block_rows *q, int r0, const int mr, int s, int32_t isum[TR][64]) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc32[TR][2];
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++) acc32[r][0] = acc32[r][1] = _mm256_setzero_si256();
    for (int k32 = 0; k32 < KB; k32 += 32) {
        __m256i acc16[TR][2];
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++) acc16[r][0] = acc16[r][1] = _mm256_setzero_si256();
        for (int k4 = k32; k4 < k32 + 32; k4 += 4) {
            __m256i w0 = _mm256_load_si256((const __m256i *)p->quads[k4 / 4][s]);
            __m256i w1 = _mm256_load_si256((const __m256i *)p->quads[k4 / 4][s + 8]);
#pragma GCC unroll 4
            for (int r = 0; r < mr; r++) {
                int32_t four;
                memcpy(&four, q->a8[r0 + r] + k4, 4);
                __m256i b = _mm256_set1_epi32(four);
                acc16[r][0] = _mm256_add_epi16(acc16[r][0], _mm256_maddubs_epi16(w0, b));
                acc16[r][1] = _mm256_add_epi16(acc16[r][1], _mm256_maddubs_epi16(w1, b));
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++)
#pragma GCC unroll 2
            for (int v = 0; v < 2; v++)
                acc32[r][v] = _mm256_add_epi32(acc32[r][v], _mm256_madd_epi16(acc16[r][v], ones));
    }
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 2
        for (int v = 0; v < 2; v++)
            _mm256_storeu_si256((__m256i *)(isum[r] + s + 8 * v), acc32[r][v]);
}

__attribute__((target("avx2"))) static void tile_avx2(const block_panel *p, const block_rows *q,
                                                      int r0, int mr, int32_t isum[TR][64]) {
    for (int s = 0; s < 64; s += 16) switch (mr) {
        case 1: tile_avx2_rows(p, q, r0, 1, s, isum); break;
        case 2: tile_avx2_rows(p, q, r0, 2, s, isum); break;
        case 3: tile_avx2_rows(p, q, r0, 3, s, isum); break;
        default: tile_avx2_rows(p, q, r0, 4, s, isum); break;
        }
}

/* ---- AVX-VNNI: vpdpbusd in 256 bits (VEX), on CPUs that have it without AVX-512 ----
 * The same sums as support/avx512.c's int8_sums, a tile of up to 4 rows x 16 slots at a time (8
 * int32 accumulators, a quarter of the 512-bit tile's, which fits AVX2's 16 registers). The
 * tile is written once and built twice: with the instruction, and with an exact AVX2 stand-in
 * for it (dpbusd_avx2), which every machine with AVX2 runs, so the tests hold the tile to the
 * other paths' bits everywhere and the instruction itself where the CPU has it. */
#define VNNI256_SUMS(name, isa, dpbusd)                                                            \
    __attribute__((target(isa))) static void name(const uint8_t *quads, const int8_t *a8, int mr,  \
                                                  int32_t(*isum)[64]) {                            \
        for (int s = 0; s < 64; s += 16) {                                                         \
            __m256i acc[TR][2];                                                                    \
            for (int r = 0; r < TR; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();           \
            for (int k4 = 0; k4 < KB; k4 += 4) {                                                   \
                __m256i w0 = _mm256_loadu_si256((const __m256i *)(quads + 4 * (16 * k4 + s)));     \
                __m256i w1 = _mm256_loadu_si256((const __m256i *)(quads + 4 * (16 * k4 + s + 8))); \
                for (int r = 0; r < TR; r++) { /* rows past mr: a8's rows are there, their sums    \
                                                  unused */                                        \
                    int32_t four;                                                                  \
                    memcpy(&four, a8 + KB * r + k4, 4);                                            \
                    __m256i b = _mm256_set1_epi32(four);                                           \
                    acc[r][0] = dpbusd(acc[r][0], w0, b);                                          \
                    acc[r][1] = dpbusd(acc[r][1], w1, b);                                          \
                }                                                                                  \
            }                                                                                      \
            for (int r = 0; r < mr; r++)                                                           \
                for (int v = 0; v < 2; v++)                                                        \
                    _mm256_storeu_si256((__m256i *)(isum[r] + s + 8 * v), acc[r][v]);              \
        }                                                                                          \
    }

/* vpdpbusd exactly: each 32-bit lane gains the 4 products of its unsigned bytes of u by the signed
 * bytes of s. Bytes 0 and 2 (and 1 and 3) widen to 16 bits, where a product of a byte by a byte
 * fits; vpmaddwd adds each pair into 32 bits. */
__attribute__((target("avx2"), always_inline)) static inline __m256i dpbusd_avx2(__m256i acc,
                                                                                 __m256i u,
                                                                                 __m256i s) {
    __m256i u_even = _mm256_and_si256(u, _mm256_set1_epi16(0xff)), u_odd = _mm256_srli_epi16(u, 8);
    __m256i s_even = _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8), s_odd = _mm256_srai_epi16(s, 8);
    return _mm256_add_epi32(
        acc, _mm256_add_epi32(_mm256_madd_epi16(u_even, s_even), _mm256_madd_epi16(u_odd, s_odd)));
}

VNNI256_SUMS(vnni256_sums, "avx2,avxvnni", _mm256_dpbusd_avx_epi32)
VNNI256_SUMS(vnni256_sums_on_avx2, "avx2", dpbusd_avx2)
#endif

/* The AVX-VNNI sums (support/matmul.c gives them to the avx2 path where cpuid has AVX-VNNI), or,
 * not native, their stand-in on AVX2; NULL where this build has no x86 kernels. */
fg_int8_sums *int8_sums_vnni256(int native) {
#ifdef HAVE_AVX2_PATH
    return native ? vnni256_sums : vnni256_sums_on_avx2;
#else
    (void)native;
    return NULL;
#endif
}

#ifdef HAVE_AVX2_PATH
/* A whole group: slots 16i .. 16i + 15 (8 even columns, then 8 odd) interleave back into columns
 * 8i .. 8i + 7 and 32 + 8i .. 39 + 8i. */
__attribute__((target("avx2,fma"))) static void finish_avx2(const block_rows *q, int r0, int mr,
                                                            int32_t isum[TR][64], float *y,
                                                            size_t ldy, int from_y) {
    for (int r = 0; r < mr; r++) {
        __m256 alpha = _mm256_set1_ps(q->alpha[r0 + r]), msum = _mm256_set1_ps(q->msum[r0 + r]);
        float *yr = y + r * ldy;
        for (int i = 0; i < 4; i++) {
            __m256i even = _mm256_loadu_si256((const __m256i *)(isum[r] + 16 * i));
            __m256i odd = _mm256_loadu_si256((const __m256i *)(isum[r] + 16 * i + 8));
            __m256i lo = _mm256_unpacklo_epi32(even, odd), hi = _mm256_unpackhi_epi32(even, odd);
            __m256i cols[2] = {_mm256_permute2x128_si256(lo, hi, 0x20),
                               _mm256_permute2x128_si256(lo, hi, 0x31)};
            for (int h = 0; h < 2; h++) {
                float *yc = yr + 8 * i + 32 * h;
                __m256 t = _mm256_fmadd_ps(alpha, _mm256_cvtepi32_ps(cols[h]), msum);
                _mm256_storeu_ps(
                    yc, _mm256_add_ps(from_y ? _mm256_loadu_ps(yc) : _mm256_setzero_ps(), t));
            }
        }
    }
}

/* ---- AVX2 for decode, fused: a row of x against whole groups, with no panel ----
 * What support/avx512.c's int8_pairs does with VNNI, here with vpmaddubsw, which every CPU with
 * AVX2 has (a laptop's, with no VNNI): the same operations in the same order, so the same bits.
 * block_product packs each block of codes into a panel, with its mins and scales, for every pass
 * of rows, which costs more than the sums when few rows of x use it; here the rounding reads the
 * mins and scales from W, and each group's block of codes is unpacked once for all the rows:
 *   round     a row's a rounded for a span of blocks and 8 groups side by side, one group a
 *             lane (their mins and scales are 16 contiguous bytes of a row of W, widened once a
 *             block for all the pass's rows): quantize's steps, lane[k % 8] for msum's lanes,
 *             added as lanes_add adds them;
 *   quads     per 4 k, the group's 4 rows of 32 bytes interleaved (bytes, then pairs) as pack_avx2
 *             does: 64 slots, in two halves of 32 (the low and the high bytes of each 128-bit
 *             lane), whose high nibbles are the even columns and low ones the odd; the block's
 *             4 KiB of them stored once and read from L1 by every row of x (up to 8 rows, two at
 *             a time: on opt-1.3b's products at 8 rows 1.13-1.20x faster than unpacking them in
 *             the registers for each two rows and passes of 4 rows, and as fast at one row);
 *   sums      vpmaddubsw of each 8 slots' quads by the row's 4 values of a8 broadcast, summed in
 *             int16 over 32 k (8 x 2 x 15 x 127 = 30480: no overflow), then widened to int32
 *             (vpmaddwd by ones), as tile_avx2 does;
 *   y         each block's sums put back in column order in the registers (finish_avx2's
 *             interleave), y (0 or y in the first block) + fmaf(alpha, isum, msum).
 * Unlike the 512-bit kernel, whose register holds a pair of groups and whose y stays in slot
 * order until the end, a 256-bit register holds one group's row, so the pair's two groups run
 * one after the other and each block's sums go to y in column order at once: no reordering pass
 * over y before and after. */
enum {
    PAIR_SPAN = 4,
    PAIR_CHUNK = 8,
    PAIR_PASS = 8
}; /* blocks a span; groups a chunk; rows of x a pass */

/* One row's rounded operands for a span of blocks and a chunk of up to 8 groups: the 4 values of
 * a8 of k .. k + 3 in one int32 (k's byte lowest), and alpha and msum, each [block][group]. */
typedef struct {
    int32_t a8_quads[PAIR_SPAN][KB / 4][PAIR_CHUNK];
    float alpha[PAIR_SPAN][PAIR_CHUNK], msum[PAIR_SPAN][PAIR_CHUNK];
} rounded_chunk;

/* The n (<= 8, even: whole pairs of groups) fp16 values at p, widened; zeros after them. A masked
 * load of n / 2 32-bit words: a copy to the stack would stall the load that reads it back. */
__attribute__((target("avx2,f16c"), always_inline)) static inline __m256 widen_groups_avx2(
    const uint8_t *p, int n) {
    if (n == PAIR_CHUNK) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    __m128i words = _mm_setr_epi32(0, 1, 2, 3);
    __m128i mask = _mm_cmplt_epi32(words, _mm_set1_epi32(n / 2));
    return _mm256_cvtph_ps(_mm_maskload_epi32((const int *)p, mask));
}

/* A block's mins and scales for a chunk's n groups, [k][group], widened once for all the pass's
 * rows (widening them for each row was a fifth of the rounding's work at 8 rows). */
typedef struct {
    float min[KB][PAIR_CHUNK], scale[KB][PAIR_CHUNK];
} widened_chunk;

/* The block's (w at its first k; mins and scales: the chunk's first group's, from w). ahead:
 * prefetch the next block's into L2. */
__attribute__((target("avx2,f16c"))) static void widen_chunk_avx2(const uint8_t *w, size_t stride,
                                                                  size_t mins, size_t scales, int n,
                                                                  int ahead, widened_chunk *wc) {
    for (int k = 0; k < KB; k++) {
        const uint8_t *row = w + (size_t)k * stride;
        if (ahead) {
            _mm_prefetch((const char *)row + KB * stride + mins, _MM_HINT_T1);
            _mm_prefetch((const char *)row + KB * stride + scales, _MM_HINT_T1);
        }
        _mm256_store_ps(wc->min[k], widen_groups_avx2(row + mins, n));
        _mm256_store_ps(wc->scale[k], widen_groups_avx2(row + scales, n));
    }
}

/* Block b of the span for one row (x at the block's first k; wc: the block's mins and scales):
 * quantize_portable's steps for the chunk's groups, one a lane; a is kept between its two uses. */
__attribute__((target("avx2,fma"))) static void round_chunk_avx2(const float *x,
                                                                 const widened_chunk *wc, int b,
                                                                 rounded_chunk *q) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 big[4], lane[8];
    _Alignas(32) float a[KB][PAIR_CHUNK];
    for (int l = 0; l < 4; l++) big[l] = _mm256_setzero_ps();
    for (int l = 0; l < 8; l++) lane[l] = _mm256_setzero_ps();
    for (int k0 = 0; k0 < KB; k0 += 8)
#pragma GCC unroll 8
        for (int l = 0; l < 8; l++) { /* unrolled: big and lane stay in registers */
            int k = k0 + l;
            __m256 xk = _mm256_set1_ps(x[k]);
            __m256 ak = _mm256_mul_ps(xk, _mm256_load_ps(wc->scale[k]));
            _mm256_store_ps(a[k], ak);
            big[l % 4] = _mm256_max_ps(big[l % 4], _mm256_and_ps(ak, magnitude));
            lane[l] = _mm256_fmadd_ps(xk, _mm256_load_ps(wc->min[k]), lane[l]);
        }
    __m256 low = _mm256_add_ps(_mm256_add_ps(lane[0], lane[4]), _mm256_add_ps(lane[2], lane[6]));
    __m256 high = _mm256_add_ps(_mm256_add_ps(lane[1], lane[5]), _mm256_add_ps(lane[3], lane[7]));
    _mm256_storeu_ps(q->msum[b], _mm256_add_ps(low, high));
    /* max |a| in four chains: a max of numbers is exact, any order gives it */
    __m256 largest = _mm256_max_ps(_mm256_max_ps(big[0], big[1]), _mm256_max_ps(big[2], big[3]));
    __m256 scaled = _mm256_cmp_ps(largest, _mm256_set1_ps(0x1p-100f), _CMP_GE_OQ); /* scales_of's
                                                                                      test */
    __m256 inv = _mm256_and_ps(scaled, _mm256_div_ps(_mm256_set1_ps(127), largest));
    _mm256_storeu_ps(q->alpha[b],
                     _mm256_and_ps(scaled, _mm256_div_ps(largest, _mm256_set1_ps(127))));
    /* each 4 k's a8 into their groups' quads: two saturating packs (|a8| <= 127: none saturates)
     * leave each 128-bit lane's bytes [k][4 groups], one byte shuffle makes them [group][4 k] */
    const __m256i to_quads = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                              0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    for (int k4 = 0; k4 < KB / 4; k4++) {
        __m256i a8[4];
        for (int i = 0; i < 4; i++) /* vcvtps2dq rounds to nearest even, as nearbyintf */
            a8[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(a[4 * k4 + i]), inv));
        __m256i bytes =
            _mm256_packs_epi16(_mm256_packs_epi32(a8[0], a8[1]), _mm256_packs_epi32(a8[2], a8[3]));
        _mm256_storeu_si256((__m256i *)q->a8_quads[b][k4], _mm256_shuffle_epi8(bytes, to_quads));
    }
}

/* A group's block of codes unpacked into quads, [half][k4][v]: per 4 k, the group's 4 rows of 32
 * bytes interleaved (bytes, then pairs) as pack_avx2 does, 64 slots in two halves of 32 (the low
 * and the high bytes of each 128-bit lane); v 0 and 1 the high and low nibbles of the first 8
 * slots' quads, 2 and 3 of the next 8. 4 KiB, in L1 for every row of x that uses it. */
typedef struct {
    __m256i w[2][KB / 4][4];
} group_quads;

/* The block of group u (codes: its first byte in the block's first row), unpacked. ahead: the
 * next block's rows of the group are asked for into L2: a block's 64 rows are 64 streams, more
 * than the hardware's prefetcher follows (as in pack_avx2). */
__attribute__((target("avx2"))) static void unpack_group_avx2(const uint8_t *codes, size_t stride,
                                                              int ahead, group_quads *p) {
    const __m256i low4 = _mm256_set1_epi8(15);
    for (int k4 = 0; k4 < KB / 4; k4++) {
        const uint8_t *row = codes + (size_t)(4 * k4) * stride;
        __m256i b0 = _mm256_loadu_si256((const __m256i *)row);
        __m256i b1 = _mm256_loadu_si256((const __m256i *)(row + stride));
        __m256i b2 = _mm256_loadu_si256((const __m256i *)(row + 2 * stride));
        __m256i b3 = _mm256_loadu_si256((const __m256i *)(row + 3 * stride));
        if (ahead)
            for (int i = 0; i < 4; i++)
                _mm_prefetch((const char *)row + (KB + i) * stride, _MM_HINT_T1);
        for (int half = 0; half < 2; half++) {
            __m256i b01 = half ? _mm256_unpackhi_epi8(b0, b1) : _mm256_unpacklo_epi8(b0, b1);
            __m256i b23 = half ? _mm256_unpackhi_epi8(b2, b3) : _mm256_unpacklo_epi8(b2, b3);
            __m256i quads[2] = {_mm256_unpacklo_epi16(b01, b23), _mm256_unpackhi_epi16(b01, b23)};
            p->w[half][k4][0] = _mm256_and_si256(_mm256_srli_epi16(quads[0], 4), low4);
            p->w[half][k4][1] = _mm256_and_si256(quads[0], low4);
            p->w[half][k4][2] = _mm256_and_si256(_mm256_srli_epi16(quads[1], 4), low4);
            p->w[half][k4][3] = _mm256_and_si256(quads[1], low4);
        }
    }
}

/* Block b for group u of the chunk (its quads unpacked) and mr (<= 2) rows: y[r] (the group's 64
 * columns) = (y[r] if from_y, else 0) + alpha isum + msum. */
__attribute__((target("avx2,fma"), always_inline)) static inline void group_block_avx2(
    const group_quads *p, const rounded_chunk *const *q, int b, int u, float *const *y, int from_y,
    const int mr) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int half = 0; half < 2; half++) { /* slots 0 .. 31, then 32 .. 63 */
        __m256i acc32[2][4];
#pragma GCC unroll 2
        for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++) acc32[r][v] = _mm256_setzero_si256();
        for (int k32 = 0; k32 < KB; k32 += 32) {
            __m256i acc16[2][4];
#pragma GCC unroll 2
            for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
                for (int v = 0; v < 4; v++) acc16[r][v] = _mm256_setzero_si256();
            for (int k4 = k32 / 4; k4 < k32 / 4 + 8; k4++)
#pragma GCC unroll 2
                for (int r = 0; r < mr; r++) {
                    __m256i a8 = _mm256_set1_epi32(q[r]->a8_quads[b][k4][u]);
#pragma GCC unroll 4
                    for (int v = 0; v < 4; v++)
                        acc16[r][v] = _mm256_add_epi16(acc16[r][v],
                                                       _mm256_maddubs_epi16(p->w[half][k4][v], a8));
                }
#pragma GCC unroll 2
            for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
                for (int v = 0; v < 4; v++)
                    acc32[r][v] =
                        _mm256_add_epi32(acc32[r][v], _mm256_madd_epi16(acc16[r][v], ones));
        }
#pragma GCC unroll 2
        for (int r = 0; r < mr; r++) {
            __m256 alpha = _mm256_set1_ps(q[r]->alpha[b][u]),
                   msum = _mm256_set1_ps(q[r]->msum[b][u]);
#pragma GCC unroll 2
            for (int i = 0; i < 2; i++) { /* slots 16i' .. 16i' + 15, i' = 2 half + i: finish_avx2's
                                             columns */
                __m256i even = acc32[r][2 * i], odd = acc32[r][2 * i + 1];
                __m256i lo = _mm256_unpacklo_epi32(even, odd),
                        hi = _mm256_unpackhi_epi32(even, odd);
                __m256i cols[2] = {_mm256_permute2x128_si256(lo, hi, 0x20),
                                   _mm256_permute2x128_si256(lo, hi, 0x31)};
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++) {
                    float *yc = y[r] + 8 * (2 * half + i) + 32 * h;
                    __m256 gain = _mm256_fmadd_ps(alpha, _mm256_cvtepi32_ps(cols[h]), msum);
                    _mm256_storeu_ps(
                        yc,
                        _mm256_add_ps(from_y ? _mm256_loadu_ps(yc) : _mm256_setzero_ps(), gain));
                }
            }
        }
    }
}

/* Rows r0 .. r0 + nr (nr <= PAIR_PASS) of x over the span's blocks b0 .. b0 + nb and the chunk's
 * n groups from g: their a rounded, then each block's groups unpacked once and summed into y, two
 * rows of x at a time. from_y: y's first block starts from y. */
__attribute__((target("avx2,fma,f16c"))) static void chunk_rows_avx2(
    const float *x, size_t ldx, int r0, int nr, const uint8_t *w, size_t stride, size_t mins,
    size_t scales, int blocks, int b0, int nb, int g, int n, float *y, size_t ldy, int from_y) {
    rounded_chunk chunks[PAIR_PASS];
    const rounded_chunk *q[PAIR_PASS];
    _Alignas(32) widened_chunk wc;
    int first_rows = r0 == 0; /* later passes find the span in L2 */
    for (int r = 0; r < nr; r++) q[r] = &chunks[r];
    for (int b = 0; b < nb; b++) {
        const uint8_t *block = w + (size_t)(KB * (b0 + b)) * stride;
        widen_chunk_avx2(block, stride, mins + 2 * (size_t)g, scales + 2 * (size_t)g, n,
                         first_rows && b0 + b + 1 < blocks, &wc);
        for (int r = 0; r < nr; r++)
            round_chunk_avx2(x + (r0 + r) * ldx + KB * (b0 + b), &wc, b, &chunks[r]);
    }
    for (int b = 0; b < nb; b++) {
        int ahead = first_rows && b0 + b + 1 < blocks, add = from_y || b0 + b > 0;
        const uint8_t *block = w + (size_t)(KB * (b0 + b)) * stride + (Q4_GROUP / 2) * (size_t)g;
        for (int u = 0; u < n; u++) {
            group_quads quads;
            unpack_group_avx2(block + (Q4_GROUP / 2) * (size_t)u, stride, ahead, &quads);
            for (int r = 0; r < nr; r += 2) {
                float *yg = y + (r0 + r) * ldy + Q4_GROUP * u;
                float *rows_y[2] = {yg, nr - r > 1 ? yg + ldy : NULL};
                if (nr - r == 1) group_block_avx2(&quads, q + r, b, u, rows_y, add, 1);
                else group_block_avx2(&quads, q + r, b, u, rows_y, add, 2);
            }
        }
    }
}

/* fg_int8_pairs (support/support.h) on AVX2: ng (even) whole groups of one part from group g0,
 * for rows of x over in (a multiple of 64) rows of W, in the order of support/avx512.c's
 * int8_pairs: spans of a few blocks, each across the groups in chunks (a row's codes read from
 * left to right, as the memory's prefetcher follows best). Each group's block serves 8 rows of x;
 * more rows take further passes over the span, whose codes come from L2 then. */
__attribute__((target("avx2,fma,f16c"))) void int8_pairs_avx2(const float *x, int rows, size_t ldx,
                                                              int in, const uint8_t *w,
                                                              size_t stride, int G, int g0, int ng,
                                                              float *y, size_t ldy, int from_y) {
    size_t mins = (size_t)G * (Q4_GROUP / 2), scales = mins + 2 * (size_t)G;
    int blocks = in / KB;
    for (int b0 = 0; b0 < blocks; b0 += PAIR_SPAN) {
        int nb = blocks - b0 < PAIR_SPAN ? blocks - b0 : PAIR_SPAN;
        for (int c = 0; c < ng; c += PAIR_CHUNK) {
            int n = ng - c < PAIR_CHUNK ? ng - c : PAIR_CHUNK;
            for (int r0 = 0; r0 < rows; r0 += PAIR_PASS) {
                int nr = rows - r0 < PAIR_PASS ? rows - r0 : PAIR_PASS;
                chunk_rows_avx2(x, ldx, r0, nr, w, stride, mins, scales, blocks, b0, nb, g0 + c, n,
                                y + Q4_GROUP * c, ldy, from_y);
            }
        }
    }
}
#endif

/* ---- The product ---- */

/* One block (k0 .. k0 + kc) of one group for rows r0 .. r0 + nr of x, added into y; the integer
 * sums by VNNI where vnni is given (support/avx512.c), which gives them exactly, as every path. */
static void block_product(const float *x, int in, const uint8_t *W, const q4_group *gr, int r0,
                          int nr, int k0, int kc, float *y, int ldy, int from_y, int simd,
                          fg_int8_sums *vnni) {
    block_panel p;
    block_rows q;
    int32_t isum[TR][64];
    int whole = simd && gr->n == Q4_GROUP;
    (void)whole;
#ifdef HAVE_AVX2_PATH
    int next = in - (k0 + KB); /* rows of the next block, to prefetch */
    if (whole) pack_avx2(W, gr, k0, kc, next < 0 ? 0 : next < KB ? next : KB, &p);
    else
#endif
        pack_portable(W, gr, k0, kc, &p);
    for (int r = 0, mr; r < nr; r += mr) {
        mr = nr - r < TR ? nr - r : TR;
        _Alignas(32) float padded[TR][KB]; /* a last block of fewer rows: zeros after them */
        const float *xr[TR];
        for (int i = 0; i < mr; i++) {
            xr[i] = x + (size_t)(r0 + r + i) * in + k0;
            if (kc == KB) continue;
            memset(padded[i], 0, sizeof padded[i]);
            memcpy(padded[i], xr[i], (size_t)kc * sizeof **padded);
            xr[i] = padded[i];
        }
#ifdef HAVE_AVX2_PATH
        if (simd) {
            quantize_avx2(xr, &p, &q, r, mr);
            continue;
        }
#endif
        for (int i = 0; i < mr; i++)
            quantize_portable(xr[i], &p, q.a8[r + i], &q.alpha[r + i], &q.msum[r + i]);
    }
    for (int r = 0, mr; r < nr; r += mr) {
        mr = nr - r < TR ? nr - r : TR;
        float *yr = y + (size_t)(r0 + r) * ldy + gr->col;
        int summed = vnni != NULL;
        if (vnni) vnni(&p.quads[0][0][0], q.a8[r], mr, isum);
#ifdef HAVE_AVX2_PATH
        if (!summed && simd) {
            tile_avx2(&p, &q, r, mr, isum);
            summed = 1;
        }
        if (whole) {
            finish_avx2(&q, r, mr, isum, yr, (size_t)ldy, from_y);
            continue;
        }
#endif
        if (!summed) tile_portable(&p, &q, r, mr, isum);
        finish_portable(&q, r, mr, isum, gr->n, yr, (size_t)ldy, from_y);
    }
}

/* Groups u0 .. u1 of a product of few rows (decode) without a panel: each run of whole groups
 * of one part, in pairs, by the path's kernel (support/avx512.c's int8_pairs, or int8_pairs_avx2
 * above); a group left over
 * (the run's odd one, or a narrower last group of a part) block by block as below. */
static void groups_in_pairs(const float *x, int rows, int in, const uint8_t *W, int q4_parts,
                            int out, float *y, int accumulate, int u0, int u1, int simd,
                            fg_int8_sums *vnni, fg_int8_pairs *pairs) {
    int part = out / q4_parts, G = (part + Q4_GROUP - 1) / Q4_GROUP, whole = part / Q4_GROUP;
    for (int u = u0; u < u1;) {
        q4_group gr = group_of(q4_parts, out, u);
        int g = u % G, run_end = u - g + whole < u1 ? u - g + whole : u1;
        int ng = (run_end - u) / 2 * 2;
        if (ng > 0) {
            const uint8_t *part_start = W + gr.codes - (size_t)g * (Q4_GROUP / 2);
            pairs(x, rows, (size_t)in, in, part_start, gr.row_bytes, G, g, ng, y + gr.col,
                  (size_t)out, accumulate);
            u += ng;
            continue;
        }
        for (int k0 = 0; k0 < in; k0 += KB)
            block_product(x, in, W, &gr, 0, rows, k0, KB, y, out, accumulate || k0 > 0, simd, vnni);
        u++;
    }
}

/* Each thread owns a contiguous run of groups and walks W in blocks of 64 rows, each block across
 * its groups from left to right (the order of support/matmul.c's decode). vnni: the integer sums
 * with VNNI, which support/matmul.c passes where the path has them (matmul_int8_sums), and pairs
 * the same path's kernel without a panel, for few rows. */
void matmul_q4_int8(const float *x, int rows, int in, const void *W, int q4_parts, int out,
                    float *y, int accumulate, int simd, fg_int8_sums *vnni, fg_int8_pairs *pairs) {
    int part = out / q4_parts, groups = q4_parts * ((part + Q4_GROUP - 1) / Q4_GROUP);
    int no_panel = pairs && rows <= NO_PANEL_ROWS && in % KB == 0;
#pragma omp parallel
    {
        int threads = omp_get_num_threads(), t = omp_get_thread_num();
        int u0 = (int)((long)groups * t / threads), u1 = (int)((long)groups * (t + 1) / threads);
        if (no_panel)
            groups_in_pairs(x, rows, in, (const uint8_t *)W, q4_parts, out, y, accumulate, u0, u1,
                            simd, vnni, pairs);
        for (int r0 = 0; r0 < rows && !no_panel; r0 += PASS_ROWS)
            for (int k0 = 0; k0 < in; k0 += KB)
                for (int u = u0; u < u1; u++) {
                    q4_group gr = group_of(q4_parts, out, u);
                    block_product(x, in, (const uint8_t *)W, &gr, r0,
                                  rows - r0 < PASS_ROWS ? rows - r0 : PASS_ROWS, k0,
                                  in - k0 < KB ? in - k0 : KB, y, out, accumulate || k0 > 0, simd,
                                  vnni);
                }
    }
}

/* ============================================================================================
 * Prefill: each row of x rounded once, W widened to int8 with one scale per column
 *
 * Where hundreds of rows share each weight (prefill; support/matmul.c's product_int8_rows runs
 * the steps): the rows of x are rounded to int8 once (int8_round_rows: alpha[r] = max|x[r]| /
 * 127), each column of W (exactly q4_value's values) is rounded to 7 bits with one scale per
 * column (scale[j] = max_k |w[k][j]| / INT8_W_MAX, |w8| <= 64: the int8_column_block steps,
 * which matmul.c feeds 64 rows of widened codes at a time from L1, per product or once for weights
 * that stay put: matmul.c's int8_columns), one integer product gives
 * exact int32 sums (gemm_s8, onednn.c: oneDNN's kernels, else that file's AVX2 kernel of int16
 * pairs or plain loops), and int8_finish_rows applies the scales: y = alpha[r] scale[j]
 * isum[r][j] (y plus that, when adding), then a linear layer's bias and ReLU, in the same pass.
 * Rounding x[r][k] moves it by at most alpha[r] / 2 and w[k][j] by at most scale[j] / 2, so,
 * before fp32's last roundings,
 *   |y - x W| <= sum_k (|x[r][k]| scale[j] + alpha[r] |w[k][j]| + alpha[r] scale[j] / 2) / 2,
 * which tests/test_matmul.c holds the product to, with its bits against a plain reference.
 * Why W in 7 bits: AVX2's vpmaddubsw (unsigned x signed bytes, the instruction int8 GEMMs without
 * VNNI are built on) sums each pair of products in int16. oneDNN makes x unsigned (x + 128 <= 255),
 * and 2 x 255 x 64 = 32640 stays within int16 where 2 x 255 x 127 does not: so every kernel,
 * VNNI, AMX and AVX2's alike, gives the same exact sums. W's values are 4-bit codes already: its
 * 129 levels a column add an error far below the 4-bit step.
 * ============================================================================================ */

/* The loops below are built three times, for AVX-512, AVX2 and plain x86-64 (each a body,
 * inlined into one function a width: ROUNDING_WIDTHS; rounding_loops, at the end, holds each
 * build), and the path picks one as the rest of the kernels are picked: fg_isa_active's path
 * (FLEXGEN_ISA, or the CPU's widest, held to AVX2 by FLEXGEN_TEST_CPU), so that make test's matrix
 * runs each. Every step is one IEEE operation, so each build gives the same bits. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define ROUNDING_WIDTHS 1
#endif
#define ROUNDING_BODY __attribute__((always_inline)) static inline

/* v (|v| <= 127 expected) to the nearest integer, ties to even, clamped to +-127. Adding
 * 1.5 x 2^23 to a float of magnitude below 2^22 leaves round(v) + 2^22 in its low 23 bits (the
 * default rounding mode); the clamp is on integers, so the loops vectorize. */
static inline int8_t round_int8(float v) {
    float shifted = v + 12582912.0f;
    uint32_t bits;
    memcpy(&bits, &shifted, sizeof bits);
    int32_t i = (int32_t)(bits & 0x7fffff) - 0x400000;
    i = i < 127 ? i : 127;
    i = i > -127 ? i : -127;
    return (int8_t)i;
}

/* |v|'s bits: for floats of one sign, the order of their bits as integers is their order. */
static inline uint32_t magnitude_bits(float v) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    return bits & 0x7fffffff;
}

static inline float float_of_bits(uint32_t bits) {
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* One row: row8[k] = round_int8(row[k] (127 / max|row|)); returns alpha = max|row| / 127 (0 for
 * 0s). */
ROUNDING_BODY float round_row_body(const float *row, int in, int8_t *row8) {
    uint32_t top_bits = 0;
#pragma omp simd reduction(max : top_bits)
    for (int k = 0; k < in; k++)
        top_bits = magnitude_bits(row[k]) > top_bits ? magnitude_bits(row[k]) : top_bits;
    float top = float_of_bits(top_bits);
    float inv = top > 0 ? 127.0f / top : 0.0f;
#pragma omp simd
    for (int k = 0; k < in; k++) row8[k] = round_int8(row[k] * inv);
    return top / 127.0f;
}

static float round_row_default(const float *row, int in, int8_t *row8) {
    return round_row_body(row, in, row8);
}
#ifdef ROUNDING_WIDTHS
__attribute__((target("avx2"))) static float round_row_avx2(const float *row, int in,
                                                            int8_t *row8) {
    return round_row_body(row, in, row8);
}
__attribute__((target("avx512f"))) static float round_row_avx512(const float *row, int in,
                                                                 int8_t *row8) {
    return round_row_body(row, in, row8);
}
#endif

/* The same for n (<= 64) columns of W, in 7 bits, in two steps over blocks of its rows, so that
 * the rows may come a block at a time (matmul.c widens a block of 64 rows of 4-bit codes into L1
 * and hands it here, twice, and never writes an fp32 panel):
 *   column_tops   top_bits[j] = the largest |w[k][j]|'s bits so far, over kc rows of w[kc][ldw];
 *   round_columns w8[k][j] = round_int8(w[k][j] inv[j]), inv[j] = INT8_W_MAX / max_k |w[k][j]|
 *                 (int8_column_block_scales, below, gives inv, and scale[j] = max_k |w[k][j]| /
 *                 INT8_W_MAX). */
ROUNDING_BODY void column_tops_body(const float *w, int kc, size_t ldw, int n, uint32_t *top_bits) {
    for (int k = 0; k < kc; k++) {
        const float *row = w + (size_t)k * ldw;
#pragma omp simd
        for (int j = 0; j < n; j++)
            top_bits[j] =
                magnitude_bits(row[j]) > top_bits[j] ? magnitude_bits(row[j]) : top_bits[j];
    }
}

ROUNDING_BODY void round_columns_body(const float *w, int kc, size_t ldw, int n, const float *inv,
                                      int8_t *w8, size_t ldw8) {
    for (int k = 0; k < kc; k++) {
        const float *row = w + (size_t)k * ldw;
        int8_t *row8 = w8 + (size_t)k * ldw8;
#pragma omp simd
        for (int j = 0; j < n; j++) row8[j] = round_int8(row[j] * inv[j]);
    }
}

static void column_tops_default(const float *w, int kc, size_t ldw, int n, uint32_t *top_bits) {
    column_tops_body(w, kc, ldw, n, top_bits);
}
static void round_columns_default(const float *w, int kc, size_t ldw, int n, const float *inv,
                                  int8_t *w8, size_t ldw8) {
    round_columns_body(w, kc, ldw, n, inv, w8, ldw8);
}
#ifdef ROUNDING_WIDTHS
__attribute__((target("avx2"))) static void column_tops_avx2(const float *w, int kc, size_t ldw,
                                                             int n, uint32_t *top_bits) {
    column_tops_body(w, kc, ldw, n, top_bits);
}
__attribute__((target("avx2"))) static void round_columns_avx2(const float *w, int kc, size_t ldw,
                                                               int n, const float *inv, int8_t *w8,
                                                               size_t ldw8) {
    round_columns_body(w, kc, ldw, n, inv, w8, ldw8);
}
__attribute__((target("avx512f"))) static void column_tops_avx512(const float *w, int kc,
                                                                  size_t ldw, int n,
                                                                  uint32_t *top_bits) {
    column_tops_body(w, kc, ldw, n, top_bits);
}
__attribute__((target("avx512f"))) static void round_columns_avx512(const float *w, int kc,
                                                                    size_t ldw, int n,
                                                                    const float *inv, int8_t *w8,
                                                                    size_t ldw8) {
    round_columns_body(w, kc, ldw, n, inv, w8, ldw8);
}
#endif

/* One row of y: y[j] = (alpha scale[j]) isum[j], or y[j] plus that when accumulating; then the
 * bias (bias[j] added, when there is one) and ReLU (max(0, y[j]), when relu): linear_layer's
 * steps after the product (opt_model.c), the same operations in the same order, in this pass. */
ROUNDING_BODY void finish_row_body(const int32_t *isum, float alpha, const float *scale, int nc,
                                   float *y, int accumulate, const float *bias, int relu) {
#pragma omp simd
    for (int j = 0; j < nc; j++) {
        float v = alpha * scale[j] * (float)isum[j];
        if (accumulate) v = y[j] + v;
        if (bias) v = v + bias[j];
        if (relu) v = v > 0 ? v : 0;
        y[j] = v;
    }
}

static void finish_row_default(const int32_t *isum, float alpha, const float *scale, int nc,
                               float *y, int accumulate, const float *bias, int relu) {
    finish_row_body(isum, alpha, scale, nc, y, accumulate, bias, relu);
}
#ifdef ROUNDING_WIDTHS
__attribute__((target("avx2"))) static void finish_row_avx2(const int32_t *isum, float alpha,
                                                            const float *scale, int nc, float *y,
                                                            int accumulate, const float *bias,
                                                            int relu) {
    finish_row_body(isum, alpha, scale, nc, y, accumulate, bias, relu);
}
__attribute__((target("avx512f"))) static void finish_row_avx512(const int32_t *isum, float alpha,
                                                                 const float *scale, int nc,
                                                                 float *y, int accumulate,
                                                                 const float *bias, int relu) {
    finish_row_body(isum, alpha, scale, nc, y, accumulate, bias, relu);
}
#endif

/* The three builds, and the one the path runs (FLEXGEN_ISA's; avx2 also for SIMDe's AVX-512,
 * which runs on AVX2 hardware). */
struct rounding_loops {
    const char *name;
    float (*round_row)(const float *row, int in, int8_t *row8);
    void (*column_tops)(const float *w, int kc, size_t ldw, int n, uint32_t *top_bits);
    void (*round_columns)(const float *w, int kc, size_t ldw, int n, const float *inv, int8_t *w8,
                          size_t ldw8);
    void (*finish_row)(const int32_t *isum, float alpha, const float *scale, int nc, float *y,
                       int accumulate, const float *bias, int relu);
};
typedef struct rounding_loops rounding_loops;

static const rounding_loops ROUNDING_DEFAULT = {"default", round_row_default, column_tops_default,
                                                round_columns_default, finish_row_default};
#ifdef ROUNDING_WIDTHS
static const rounding_loops ROUNDING_AVX2 = {"avx2", round_row_avx2, column_tops_avx2,
                                             round_columns_avx2, finish_row_avx2};
static const rounding_loops ROUNDING_AVX512 = {"avx512", round_row_avx512, column_tops_avx512,
                                               round_columns_avx512, finish_row_avx512};
#endif

static const rounding_loops *rounding_ran; /* the build of the last rounding */

static const rounding_loops *rounding_loops_now(void) {
#ifdef ROUNDING_WIDTHS
    fg_isa isa = fg_isa_active();
    if (isa == FG_ISA_AVX512) return &ROUNDING_AVX512;
    if (isa != FG_ISA_PORTABLE && fg_cpu_has_avx2()) return &ROUNDING_AVX2;
#endif
    return &ROUNDING_DEFAULT;
}

const char *int8_rounding_path(void) { return rounding_ran ? rounding_ran->name : "none ran"; }

void int8_round_rows(const float *x, int rows, int in, int8_t *x8, float *alpha) {
    const rounding_loops *loops = rounding_loops_now();
    rounding_ran = loops;
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++)
        alpha[r] = loops->round_row(x + (size_t)r * in, in, x8 + (size_t)r * in);
}

void int8_column_block_begin(int8_column_block *b, int n) {
    memset(b, 0, sizeof *b);
    b->n = n;
    b->loops = rounding_loops_now();
}

void int8_column_block_tops(int8_column_block *b, const float *w, int kc, size_t ldw) {
    const rounding_loops *loops = b->loops;
    loops->column_tops(w, kc, ldw, b->n, b->top_bits);
}

void int8_column_block_scales(int8_column_block *b, float *scale) {
    for (int j = 0; j < b->n; j++) {
        float top = float_of_bits(b->top_bits[j]);
        b->inv[j] = top > 0 ? (float)INT8_W_MAX / top : 0.0f;
        scale[j] = top / (float)INT8_W_MAX;
    }
}

void int8_column_block_round(const int8_column_block *b, const float *w, int kc, size_t ldw,
                             int8_t *w8, size_t ldw8) {
    const rounding_loops *loops = b->loops;
    loops->round_columns(w, kc, ldw, b->n, b->inv, w8, ldw8);
}

void int8_finish_rows(const int32_t *isum, const float *alpha, const float *scale, int rows, int nc,
                      float *y, int ldy, int accumulate, const float *bias, int relu) {
    const rounding_loops *loops = rounding_loops_now();
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++)
        loops->finish_row(isum + (size_t)r * nc, alpha[r], scale, nc, y + (size_t)r * ldy,
                          accumulate, bias, relu);
}
