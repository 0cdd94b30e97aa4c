/* support/matmul.c: products of fp32 activations with weights as they are stored, fp16 or 4-bit
 * (§5), accumulated in fp32: the CPU backend's linear layers and its lm_head.
 *
 *   matmul_weights   y[rows][out] (= or +=) x[rows][in] W[in][out]   linear weights, [in][out]
 *   matmul_embed_t   y[rows][n] = x[rows][dim] E^T, E [n][dim]        the embedding as lm_head
 *
 * Decode (up to MATMUL_DECODE_ROWS rows) reads every weight once per step for a few rows, so it
 * is bound by memory or, from about 8 rows on this kind of CPU, by the FMA units. Reading the 2
 * bytes a weight is stored in (0.56 when 4-bit) instead of a 4-byte fp32 copy is the point, and
 * the kernel must keep the FMA units busy while the bytes stream in. Its blocking:
 *
 *   threads         each owns a contiguous run of 64-column blocks of y.
 *   bands           a thread walks W in bands of kc rows (k), each band across its columns: kc
 *                   streams of W's rows that advance together. The hardware's prefetcher does
 *                   not follow that many streams far enough ahead, so the tiles of a band's first
 *                   rows prefetch the same columns of the next band, kc rows on, into L2 (measured
 *                   on 2 threads: 1.3x the read rate for fp16, 2x for 4-bit; into L2 rather than
 *                   L1, another 1.1-1.2x for fp16 at one row of x). kc is decode_kc's, as
 *                   measured on one layer's product (fc1 of opt-1.3b, 2048 x 8192): fp16 reads
 *                   at 29-32 GB/s in bands of 8 rows against 23-24 in bands of 16 for one or two
 *                   rows of x, and 4-bit ran fastest in bands of 32 from the cache (its
 *                   conversions bound it there); from memory, bands of 16 and 32 read alike, 8
 *                   slower. An fp16 band does not change a bit of y; a 4-bit one adds its min
 *                   term (below), so its 32 rows are part of the arithmetic. The CPU backend's
 *                   weights lie in huge pages (app/cpu_backend.c): a band's rows are in as many
 *                   4 KiB pages, and in huge pages 4-bit read 1.13-1.15x as fast from memory.
 *   register tile   mr rows by a few vectors of y stay in registers while k runs over the band:
 *                   per k, the weights of the tile are widened to fp32 in the registers, one
 *                   broadcast of x (for 4-bit, of a) per row, mr x nv FMAs. AVX2 (here): 1 x 64,
 *                   2 x 32, up to 6 x 16 (8 to 12 accumulators of the 16 registers; the FMA's
 *                   latency, 5 cycles at 2 a cycle, wants 10). AVX-512 (avx512.c): wider tiles,
 *                   in 32 registers.
 *   4-bit, from the codes   row k's 64 columns of group g share a min m[k][g] and a scale
 *                   s[k][g] (§5's groups), and a weight is m + q s for its code q (0 .. 15). So,
 *                   for a column j of group g,
 *
 *                     y[r][j] = sum_k x[r][k] (m[k][g] + q[k][j] s[k][g])
 *                             = sum_k a[r][k][g] q[k][j]  +  sum_k x[r][k] m[k][g],   a = x s,
 *
 *                   and the codes are multiplied as they are stored: per row of W, 8 bytes (16
 *                   codes) widened to 32-bit lanes and converted to fp32 in the registers, one
 *                   FMA a code for each row of x. A byte b holds the codes of two columns, b = 16
 *                   q_even + q_odd, so a band sums a b and a q_odd (b & 15) for each byte, and
 *                   the even column's sum is (sum a b - sum a q_odd) / 16: no shift to take the
 *                   high nibble out. Widening m + q s first would cost a second FMA a weight,
 *                   and on AVX2 the ports that convert and multiply are the bound (1.5x the
 *                   kernel that did, measured from L2 on one thread; the shift saved, another
 *                   1.1-1.15x on two). The terms that do not depend on the column, a and each
 *                   band's sum of x m (the min term), come first, for a chunk of 8 groups and
 *                   up to 8 rows of x (q4_terms: the groups side by side in a register), at a
 *                   64th of the products' cost. No fp32 copy of W is ever written.
 *
 * Every element of y is one chain of fused multiply-adds over k in increasing order, started at 0
 * (or at y, to add) and carried from one band to the next through y itself; for 4-bit weights,
 * each band of 32 rows sums its own chains from 0 (band_q4_portable has the steps), adds its min
 * term (one fmaf chain over the band's k) and then y. So its bits do not depend on the number of
 * rows, the threads or the path: the
 * portable C path (the same chains with fmaf; over a panel for fp16), the AVX2 one and the
 * AVX-512 one, native or on SIMDe, give the same results bit for bit (tests/test_matmul.c runs
 * every one this machine has; tests/test_cli.c's "FLEXGEN_ISA: every path to the same logits"
 * runs whole jobs on each and compares their logits byte for byte). The path is fg_isa_active's:
 * the CPU's widest, or FLEXGEN_ISA's. Columns that are not a whole block of 64 (fp16) or a whole
 * group (4-bit) take the portable path's loops.
 *
 * Prefill (more rows) is bound by arithmetic, and there OpenBLAS's sgemm is faster than this
 * kernel: a panel of W (32 MiB of fp32, whole groups of columns) is widened by every thread,
 * then one threaded sgemm runs on it. It differs from an fp32 sgemm only in the order of the sums.
 * The two opt-in prefill schemes take W to a denser product (support/onednn.c: oneDNN's AMX or
 * VNNI kernels where the CPU has them, else that file's own paths with the same promise):
 * --int8-activations rounds x's rows and W's columns to int8 (int8.c), the columns straight from
 * the codes, 64 rows at a time in L1, with no fp32 panel (product_int8_rows); --bf16-prefill
 * rounds x and the same fp32 panels to bf16 (product_bf16). Those two take every prompt, however
 * short, so that a prompt is rounded the same way whatever GPU batch it is in, and a decode step
 * past MATMUL_DECODE_ROWS rows (matmul_weights).
 *
 * lm_head reads E by rows (the table is [n][dim]), eight rows of E at a time (for 4-bit, rows of
 * one group: one min and one scale per d): each dot product in 8 lanes (lane l sums d = l mod 8),
 * the lanes added pairwise at the end; the portable path keeps the same lanes and the same order.
 * fp16: AVX2 takes three rows of E against four rows of x (twelve chains); AVX-512 two rows of E
 * to a register, four such pairs against four rows of x; the rows are widened in the registers.
 * 4-bit: from the codes, as the linear layers (embed_t_q4 and the comment above dots_q4_portable):
 * per group, a = x scale and the min term first, then the dots of a with the codes, a byte row
 * (two rows of E) at a time; one row of x takes AVX2's kernel on the AVX-512 paths too
 * (matmul_embed_t says why). Many rows (prefill's logits at every position) go through sgemm on
 * blocks of MATMUL_EMBED_BLOCK widened rows.
 */
#include "support/support.h"
#include "support/tools.h"

#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_AVX2_PATH 1
#endif

enum { KC = 64, NC = 64, MR = 6, DECODE_KC_MAX = 32 };

/* Rows are taken MR at a time, the rest in one tile. A tile of mr rows spans 64 columns for one
 * row, 32 for two, 16 for more: 8 to 12 accumulators. */
static int tile_rows(int n) { return n < MR ? n : MR; }
static int tile_cols(int mr) { return mr == 1 ? 64 : mr == 2 ? 32 : 16; }

/* Rows of W a decode band spans (the blocking comment above says why these). */
static int decode_kc(int q4, int rows) { return q4 ? Q4_BAND : rows <= 2 ? 8 : 16; }

/* The path: fg_isa_active's, or the tests' choice. */
static int forced_isa = -1;
void matmul_force_isa(int isa) { forced_isa = isa; }
static fg_isa isa_now(void) { return forced_isa >= 0 ? (fg_isa)forced_isa : fg_isa_active(); }
/* AVX2 for widening and for lm_head (every path but the portable one, where the CPU has it). */
static int use_simd(void) { return isa_now() != FG_ISA_PORTABLE && fg_cpu_has_avx2(); }
static const matmul_kernels *wide_kernels(void);

/* ============================================================================================
 * Widening a block of W[in][out] (rows k0 .. k0 + kc, columns j0 .. j0 + 64) into the panel
 * [KC][NC] floats. The block's columns are one group of 64: for 4-bit weights, one min and one
 * scale per row. Columns past out are zeros.
 * ============================================================================================ */

/* 4-bit W[in][out] (q4 > 0) is q4 parts [in][out / q4] side by side, each grouped along its own
 * columns in quant.c's layout (q4 = 3: q, k and v, as FlexGen compresses w_q, w_k, w_v): row k
 * holds, part after part, G groups of 32 bytes, then G mins and G scales (fp16). */
static size_t q4_part_bytes(int q4, int out) { return q4_bytes(1, (size_t)(out / q4), 1); }
static size_t q4_row_bytes(int q4, int out) { return (size_t)q4 * q4_part_bytes(q4, out); }

/* Column c of a 4-bit row: fmaf(q, scale, min), as q4_decompress computes it. */
static float q4_column(const uint8_t *row, int q4, int out, int c) {
    int part = out / q4, s = c / part;
    return q4_value(row + s * q4_part_bytes(q4, out), (size_t)part, 1, (size_t)(c - s * part));
}

/* Whether columns 64 g .. 64 g + 63 are one group of one part (always, when a part's columns are
 * a multiple of 64, as in every OPT size). */
static int one_group(int q4, int out, int g) {
    int part = q4 ? out / q4 : out, c = g * Q4_GROUP % part;
    return !q4 || (c % Q4_GROUP == 0 && c + Q4_GROUP <= part);
}

/* Group g (columns 64 g ..) of row k into dst: n values, zeros after them. */
static void widen_group_scalar(const void *W, int q4, int out, int k, int g, int n, float *dst) {
    const uint8_t *row4 = (const uint8_t *)W + (q4 ? (size_t)k * q4_row_bytes(q4, out) : 0);
    const fp16 *row16 = (const fp16 *)W + (size_t)k * out + (size_t)g * Q4_GROUP;
    for (int c = 0; c < Q4_GROUP; c++)
        dst[c] = c >= n ? 0
                 : q4   ? q4_column(row4, q4, out, g * Q4_GROUP + c)
                        : fp16_to_fp32(row16[c]);
}

#ifdef HAVE_AVX2_PATH
/* A whole group (n == 64) of a row of W: fp16 values, or a 4-bit row of G groups. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void widen_group_avx2(
    const void *row, int q4, int G, int g, float *dst) {
    if (!q4) {
        const fp16 *h = (const fp16 *)row + (size_t)g * Q4_GROUP;
        for (int i = 0; i < Q4_GROUP; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
        return;
    }
    /* 32 bytes -> 64 values in order, as quant.c's decode_groups_avx2 */
    const uint8_t *b = (const uint8_t *)row + (size_t)g * (Q4_GROUP / 2);
    const fp16 *mins = (const fp16 *)((const uint8_t *)row + (size_t)G * (Q4_GROUP / 2)),
               *scales = mins + G;
    __m256 min = _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(mins[g])));
    __m256 scale = _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(scales[g])));
    const __m128i low4 = _mm_set1_epi8(15);
    for (int half = 0; half < 2; half++) { /* 16 bytes = 32 values */
        __m128i v = _mm_loadu_si128((const __m128i *)(b + 16 * half));
        __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4), lo = _mm_and_si128(v, low4);
        __m128i e0 = _mm_unpacklo_epi8(hi, lo), e1 = _mm_unpackhi_epi8(hi, lo);
        __m128i parts[4] = {e0, _mm_srli_si128(e0, 8), e1, _mm_srli_si128(e1, 8)};
        for (int i = 0; i < 4; i++) {
            __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i]));
            _mm256_storeu_ps(dst + 32 * half + 8 * i, _mm256_fmadd_ps(q, scale, min));
        }
    }
}

/* Group g of rows k0 .. k0 + kc into dst, ldd floats apart (one group of one part, for 4-bit). */
__attribute__((target("avx2,fma,f16c"))) static void widen_rows_avx2(const void *W, int q4, int out,
                                                                     int k0, int kc, int g,
                                                                     float *dst, size_t ldd) {
    size_t stride = q4 ? q4_row_bytes(q4, out) : (size_t)out * sizeof(fp16);
    int part = q4 ? out / q4 : out, s = g * Q4_GROUP / part, G = (part + Q4_GROUP - 1) / Q4_GROUP;
    const char *row = (const char *)W + (size_t)k0 * stride + (q4 ? s * q4_part_bytes(q4, out) : 0);
    for (int k = 0; k < kc; k++, row += stride, dst += ldd)
        widen_group_avx2(row, q4, G, (g * Q4_GROUP - s * part) / Q4_GROUP, dst);
}
#endif

/* Group g of rows k0 .. k0 + kc, n values of it (zeros after them), into dst, ldd floats apart. */
static void widen_rows(const void *W, int q4, int out, int k0, int kc, int g, int n, float *dst,
                       size_t ldd, int simd) {
#ifdef HAVE_AVX2_PATH
    if (simd && n == Q4_GROUP && one_group(q4, out, g)) {
        widen_rows_avx2(W, q4, out, k0, kc, g, dst, ldd);
        return;
    }
#endif
    (void)simd;
    for (int k = 0; k < kc; k++)
        widen_group_scalar(W, q4, out, k0 + k, g, n, dst + (size_t)k * ldd);
}

/* ============================================================================================
 * The register tile: y[mr][16 nv] (=, or from y) + x[mr][k0 .. k0 + kc] P[kc][16 nv], one fused
 * chain per element; P's rows are NC floats apart, x's ldx, y's ldy.
 * ============================================================================================ */

static void tile_portable(const float *x, size_t ldx, const float *p, int kc, float *y, size_t ldy,
                          int from_y, int mr, int cols) {
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < cols; c++) {
            float acc = from_y ? y[r * ldy + c] : 0;
            for (int k = 0; k < kc; k++) acc = fmaf(x[r * ldx + k], p[(size_t)k * NC + c], acc);
            y[r * ldy + c] = acc;
        }
}

#ifdef HAVE_AVX2_PATH
/* mr and nv are constants at each call (tile_avx2), so the loops over them unroll and the
 * accumulators (mr x nv <= 12 of the 16 AVX registers) are never stored inside the k loop.
 * f16: the rows of w are fp16, widened as they are loaded; else fp32. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void tile_avx2_shape(
    const float *x, size_t ldx, const void *w, size_t ldw, int kc, float *y, size_t ldy, int from_y,
    int ahead, const int mr, const int nv, const int f16) {
    __m256 acc[MR][8];
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 8
        for (int v = 0; v < nv; v++)
            acc[r][v] = from_y ? _mm256_loadu_ps(y + r * ldy + 8 * v) : _mm256_setzero_ps();
    for (int k = 0; k < kc; k++) {
        __m256 wv[8];
        if (f16 && ahead) /* the same columns of the next band: a line holds 4 vectors */
#pragma GCC unroll 2
            for (int v = 0; v < nv; v += 4)
                _mm_prefetch((const char *)((const fp16 *)w + (k + kc) * ldw + 8 * v), _MM_HINT_T1);
#pragma GCC unroll 8
        for (int v = 0; v < nv; v++)
            wv[v] = f16 ? _mm256_cvtph_ps(
                              _mm_loadu_si128((const __m128i *)((const fp16 *)w + k * ldw + 8 * v)))
                        : _mm256_load_ps((const float *)w + k * ldw + 8 * v);
#pragma GCC unroll 8
        for (int r = 0; r < mr; r++) {
            __m256 xr = _mm256_broadcast_ss(x + r * ldx + k);
#pragma GCC unroll 8
            for (int v = 0; v < nv; v++) acc[r][v] = _mm256_fmadd_ps(xr, wv[v], acc[r][v]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 8
        for (int v = 0; v < nv; v++) _mm256_storeu_ps(y + r * ldy + 8 * v, acc[r][v]);
}

#define TILE_CASES(f16)                                                                    \
    switch (mr) {                                                                          \
    case 1: tile_avx2_shape(x, ldx, w, ldw, kc, y, ldy, from_y, ahead, 1, 8, f16); break;  \
    case 2: tile_avx2_shape(x, ldx, w, ldw, kc, y, ldy, from_y, ahead, 2, 4, f16); break;  \
    case 3: tile_avx2_shape(x, ldx, w, ldw, kc, y, ldy, from_y, ahead, 3, 2, f16); break;  \
    case 4: tile_avx2_shape(x, ldx, w, ldw, kc, y, ldy, from_y, ahead, 4, 2, f16); break;  \
    case 5: tile_avx2_shape(x, ldx, w, ldw, kc, y, ldy, from_y, ahead, 5, 2, f16); break;  \
    default: tile_avx2_shape(x, ldx, w, ldw, kc, y, ldy, from_y, ahead, 6, 2, f16); break; \
    }

__attribute__((target("avx2,fma,f16c"))) static void tile_avx2(const float *x, size_t ldx,
                                                               const void *w, size_t ldw, int kc,
                                                               float *y, size_t ldy, int from_y,
                                                               int ahead, int mr, int f16) {
    if (f16) {
        TILE_CASES(1);
    } else {
        TILE_CASES(0);
    }
}

/* 16 columns of y, in order, from their even and odd columns (8 each). */
__attribute__((target("avx2"), always_inline)) static inline void join_even_odd_avx2(__m256 even,
                                                                                     __m256 odd,
                                                                                     __m256 *front,
                                                                                     __m256 *back) {
    __m256 low = _mm256_unpacklo_ps(even, odd), high = _mm256_unpackhi_ps(even, odd);
    *front = _mm256_permute2f128_ps(low, high, 0x20);
    *back = _mm256_permute2f128_ps(low, high, 0x31);
}

/* 4-bit, from the codes: y[mr][16 nb] from code byte `codes` of a group (column 2 x that byte in
 * it) over kc rows (stride bytes apart), for rows r0 .. r0 + mr of the band's terms t, group gi of
 * their chunk: band_q4_portable's sums. Per row of W, 8 bytes at a time are widened to 32-bit lanes
 * (vpmovzxbd), each byte b and its low nibble (b & 15) converted to fp32, and each row of x's a
 * multiplies both there: one conversion and one FMA a code, with no shift to take the high
 * nibble out (the even column's sum comes from the byte's). The accumulators hold a tile's
 * bytes in order; the columns are put in order when they are stored. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void tile_q4_avx2_shape(
    const q4_terms *t, int r0, int gi, const uint8_t *codes, size_t stride, int kc, float *y,
    size_t ldy, int from_y, int ahead, const int mr, const int nb) {
    const __m256i low4 = _mm256_set1_epi32(15);
    __m256 sum_b[MR][4], sum_odd[MR][4];
#pragma GCC unroll 6
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
        for (int i = 0; i < nb; i++) sum_b[r][i] = sum_odd[r][i] = _mm256_setzero_ps();
    for (int k = 0; k < kc; k++) {
        const uint8_t *row = codes + k * stride;
        if (ahead)
            _mm_prefetch((const char *)(row + (size_t)kc * stride), _MM_HINT_T1); /* the next
                                                                                     band's */
        if (mr == 1) { /* one row of x: each 8 bytes multiplied as soon as they are widened, in
                          the 16 registers (widening all first spilled: 1.05x, from L2) */
            __m256 a = _mm256_broadcast_ss(&t->a[r0][k][gi]);
#pragma GCC unroll 4
            for (int i = 0; i < nb; i++) {
                __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + 8 * i)));
                sum_b[0][i] = _mm256_fmadd_ps(a, _mm256_cvtepi32_ps(b), sum_b[0][i]);
                __m256 odd = _mm256_cvtepi32_ps(_mm256_and_si256(b, low4));
                sum_odd[0][i] = _mm256_fmadd_ps(a, odd, sum_odd[0][i]);
            }
            continue;
        }
        __m256 byte[4], odd[4];
#pragma GCC unroll 4
        for (int i = 0; i < nb; i++) {
            __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + 8 * i)));
            byte[i] = _mm256_cvtepi32_ps(b);
            odd[i] = _mm256_cvtepi32_ps(_mm256_and_si256(b, low4));
        }
#pragma GCC unroll 6
        for (int r = 0; r < mr; r++) {
            __m256 a = _mm256_broadcast_ss(&t->a[r0 + r][k][gi]);
#pragma GCC unroll 4
            for (int i = 0; i < nb; i++) {
                sum_b[r][i] = _mm256_fmadd_ps(a, byte[i], sum_b[r][i]);
                sum_odd[r][i] = _mm256_fmadd_ps(a, odd[i], sum_odd[r][i]);
            }
        }
    }
    const __m256 sixteenth = _mm256_set1_ps(0.0625f);
#pragma GCC unroll 6
    for (int r = 0; r < mr; r++) {
        __m256 min_term = _mm256_broadcast_ss(&t->min_term[r0 + r][gi]);
#pragma GCC unroll 4
        for (int i = 0; i < nb; i++) {
            __m256 even = _mm256_mul_ps(_mm256_sub_ps(sum_b[r][i], sum_odd[r][i]), sixteenth);
            even = _mm256_add_ps(even, min_term);
            __m256 front, back;
            join_even_odd_avx2(even, _mm256_add_ps(sum_odd[r][i], min_term), &front, &back);
            float *yc = y + r * ldy + 16 * i;
            if (from_y) {
                front = _mm256_add_ps(_mm256_loadu_ps(yc), front);
                back = _mm256_add_ps(_mm256_loadu_ps(yc + 8), back);
            }
            _mm256_storeu_ps(yc, front);
            _mm256_storeu_ps(yc + 8, back);
        }
    }
}

/* The AVX2 bands: tiles of 1 x 64, 2 x 32 and up to 6 x 16, as for the panel; the first rows'
 * tiles prefetch the next band. */
__attribute__((target("avx2,fma,f16c"))) static void band_f16_avx2(const float *x, int rows,
                                                                   size_t ldx, const fp16 *w,
                                                                   size_t ldw, int kc, int cols,
                                                                   float *y, size_t ldy, int from_y,
                                                                   int ahead) {
    for (int r = 0, mr; r < rows; r += mr) {
        mr = rows - r < MR ? rows - r : MR;
        for (int c = 0; c < cols; c += mr == 1 ? 64 : mr == 2 ? 32 : 16)
            tile_avx2(x + r * ldx, ldx, w + c, ldw, kc, y + r * ldy + c, ldy, from_y,
                      ahead && r == 0, mr, 1);
    }
}

#define TILE_Q4_CASES                                                                        \
    switch (mr) {                                                                            \
    case 1: tile_q4_avx2_shape(t, r, gi, at, stride, kc, yt, ldy, from_y, pf, 1, 4); break;  \
    case 2: tile_q4_avx2_shape(t, r, gi, at, stride, kc, yt, ldy, from_y, pf, 2, 2); break;  \
    case 3: tile_q4_avx2_shape(t, r, gi, at, stride, kc, yt, ldy, from_y, pf, 3, 1); break;  \
    case 4: tile_q4_avx2_shape(t, r, gi, at, stride, kc, yt, ldy, from_y, pf, 4, 1); break;  \
    case 5: tile_q4_avx2_shape(t, r, gi, at, stride, kc, yt, ldy, from_y, pf, 5, 1); break;  \
    default: tile_q4_avx2_shape(t, r, gi, at, stride, kc, yt, ldy, from_y, pf, 6, 1); break; \
    }

__attribute__((target("avx2,fma,f16c"))) static void band_q4_avx2(const q4_terms *t, int rows,
                                                                  const uint8_t *codes,
                                                                  size_t stride, int ng, int kc,
                                                                  float *y, size_t ldy, int from_y,
                                                                  int ahead) {
    for (int r = 0, mr; r < rows; r += mr) {
        mr = rows - r < MR ? rows - r : MR;
        for (int c = 0; c < ng * Q4_GROUP; c += tile_cols(mr)) {
            int gi = c / Q4_GROUP, pf = ahead && r == 0 && c % Q4_GROUP == 0; /* once per group */
            const uint8_t *at = codes + c / 2;
            float *yt = y + r * ldy + c;
            TILE_Q4_CASES;
        }
    }
}

#endif

/* A tile of mr rows and tile_cols(mr) columns of the panel; only the first nc of them exist in y
 * (a narrower tile goes through a copy). */
static void tile(const float *x, size_t ldx, const float *p, int kc, float *y, size_t ldy,
                 int from_y, int mr, int nc, int simd) {
    int cols = tile_cols(mr);
    if (nc < cols || !simd) {
        float narrow[MR * 64];
        for (int r = 0; r < mr && from_y; r++)
            memcpy(narrow + r * cols, y + r * ldy, nc * sizeof *y);
        tile_portable(x, ldx, p, kc, narrow, (size_t)cols, from_y, mr, cols);
        for (int r = 0; r < mr; r++) memcpy(y + r * ldy, narrow + r * cols, nc * sizeof *y);
        return;
    }
#ifdef HAVE_AVX2_PATH
    tile_avx2(x, ldx, p, NC, kc, y, ldy, from_y, 0, mr, 0);
#endif
}

/* ============================================================================================
 * The products
 * ============================================================================================ */

/* Rows k0 .. k0 + kc of fp16 W, columns j0 .. j0 + nc (nc <= NC), widened into the panel, and
 * every row of x's product with it added to y: the portable path, and the columns that are not a
 * whole block. */
static void product_block(const float *x, int rows, int in, const fp16 *W, int out, float *y,
                          int from_y, int k0, int kc, int j0, int nc, int simd) {
    _Alignas(64) float panel[DECODE_KC_MAX * NC];
    widen_rows(W, 0, out, k0, kc, j0 / Q4_GROUP, nc, panel, NC, simd);
    for (int r = 0, mr; r < rows; r += mr) {
        mr = tile_rows(rows - r);
        for (int c = 0; c < nc; c += tile_cols(mr))
            tile(x + (size_t)r * in + k0, (size_t)in, panel + c, kc, y + (size_t)r * out + j0 + c,
                 (size_t)out, from_y, mr, nc - c < tile_cols(mr) ? nc - c : tile_cols(mr), simd);
    }
}

/* How many columns from j (before j1) the fp16 wide kernels take in one call: whole blocks of 64;
 * 0 where j starts none. */
static int whole_blocks(int j, int j1) { return j % NC ? 0 : (j1 - j) / NC * NC; }

/* One band of fp16 W: rows k0 .. k0 + kc, columns j0 .. j1, every row of x; the wide kernels take
 * the whole blocks, the panel the rest. ahead: the next band is whole (its rows may be prefetched).
 */
static void product_band_f16(const float *x, int rows, int in, const fp16 *W, int out, float *y,
                             int from_y, int k0, int kc, int j0, int j1, int ahead,
                             const matmul_kernels *wide, int simd) {
    for (int j = j0, n; j < j1; j += n) {
        n = wide ? whole_blocks(j, j1) : 0;
        if (n) {
            wide->band_f16(x + k0, rows, (size_t)in, W + (size_t)k0 * out + j, (size_t)out, kc, n,
                           y + j, (size_t)out, from_y, ahead);
        } else {
            n = j1 - j < NC ? j1 - j : NC;
            product_block(x, rows, in, W, out, y, from_y, k0, kc, j, n, simd);
        }
    }
}

/* ---- 4-bit: a band's terms (q4_terms), then the chains over the codes ---- */

/* The fp16 at byte `at` of a row, widened. */
static float half_at(const uint8_t *row, size_t at) {
    fp16 h;
    memcpy(&h, row + at, sizeof h);
    return fp16_to_fp32(h);
}

/* The terms for rows of x (ldx apart, from the band's first k) over kc rows of one part's bytes
 * (w: row k0's, stride bytes a row, G groups), groups g .. g + ng (ng <= Q4_CHUNK). */
static void q4_terms_portable(const float *x, size_t ldx, int rows, const uint8_t *w, size_t stride,
                              int G, int g, int ng, int kc, q4_terms *t) {
    size_t mins = (size_t)G * (Q4_GROUP / 2), scales = mins + 2 * (size_t)G;
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < ng; i++) {
            float min_term = 0;
            for (int k = 0; k < kc; k++) {
                const uint8_t *row = w + (size_t)k * stride;
                float xk = x[r * ldx + k];
                t->a[r][k][i] = xk * half_at(row, scales + 2 * (size_t)(g + i));
                min_term = fmaf(xk, half_at(row, mins + 2 * (size_t)(g + i)), min_term);
            }
            t->min_term[r][i] = min_term;
        }
}

#ifdef HAVE_AVX2_PATH
/* n <= 8 fp16 values at p, widened; zeros after them (a chunk at a part's end reads no further). */
__attribute__((target("avx2,f16c"), always_inline)) static inline __m256 halves_avx2(
    const uint8_t *p, int n) {
    if (n == Q4_CHUNK) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    uint16_t h[Q4_CHUNK] = {0};
    for (int i = 0; i < n; i++) h[i] = (uint16_t)(p[2 * i] | p[2 * i + 1] << 8);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
}

/* The same, the chunk's groups side by side in the 8 lanes (their mins and scales are 16 bytes of
 * a row each); the same operations, so the same bits. ahead: the same groups' mins and scales kc
 * rows on (the next band's) are asked for into L2, as the band kernels ask for its codes: they lie
 * apart from the codes' stream, and without it their loads waited on memory (on a Zen 4, 11% of
 * a batch-1 decode step; the products 1.09x to 1.31x faster with it). */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void q4_terms_avx2_rows(
    const float *x, size_t ldx, const uint8_t *w, size_t stride, int G, int g, int ng, int kc,
    int ahead, q4_terms *t, const int rows) {
    size_t mins = (size_t)G * (Q4_GROUP / 2) + 2 * (size_t)g, scales = mins + 2 * (size_t)G;
    __m256 min_term[Q4_CHUNK];
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++) min_term[r] = _mm256_setzero_ps();
    for (int k = 0; k < kc; k++) { /* a row's mins and scales widened once for every row of x */
        const uint8_t *row = w + (size_t)k * stride;
        if (ahead) {
            _mm_prefetch((const char *)(row + (size_t)kc * stride + mins), _MM_HINT_T1);
            _mm_prefetch((const char *)(row + (size_t)kc * stride + scales), _MM_HINT_T1);
        }
        __m256 scale = halves_avx2(row + scales, ng), min = halves_avx2(row + mins, ng);
#pragma GCC unroll 8
        for (int r = 0; r < rows; r++) {
            __m256 xk = _mm256_broadcast_ss(x + r * ldx + k);
            _mm256_storeu_ps(t->a[r][k], _mm256_mul_ps(xk, scale));
            min_term[r] = _mm256_fmadd_ps(xk, min, min_term[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++) _mm256_storeu_ps(t->min_term[r], min_term[r]);
}

/* rows a constant in each call, so that the min terms' chains stay in registers */
__attribute__((target("avx2,fma,f16c"))) static void q4_terms_avx2(const float *x, size_t ldx,
                                                                   int rows, const uint8_t *w,
                                                                   size_t stride, int G, int g,
                                                                   int ng, int kc, int ahead,
                                                                   q4_terms *t) {
    switch (rows) {
    case 1: q4_terms_avx2_rows(x, ldx, w, stride, G, g, ng, kc, ahead, t, 1); break;
    case 2: q4_terms_avx2_rows(x, ldx, w, stride, G, g, ng, kc, ahead, t, 2); break;
    case 3: q4_terms_avx2_rows(x, ldx, w, stride, G, g, ng, kc, ahead, t, 3); break;
    case 4: q4_terms_avx2_rows(x, ldx, w, stride, G, g, ng, kc, ahead, t, 4); break;
    case 5: q4_terms_avx2_rows(x, ldx, w, stride, G, g, ng, kc, ahead, t, 5); break;
    case 6: q4_terms_avx2_rows(x, ldx, w, stride, G, g, ng, kc, ahead, t, 6); break;
    case 7: q4_terms_avx2_rows(x, ldx, w, stride, G, g, ng, kc, ahead, t, 7); break;
    default: q4_terms_avx2_rows(x, ldx, w, stride, G, g, ng, kc, ahead, t, 8); break;
    }
}
#endif

/* The portable chains, and the columns that are not whole groups: columns c0 .. c0 + n (n <= 64)
 * of group i of the terms' chunk, whose codes start at `codes` (row k0, stride bytes a row). Per
 * byte of the codes, b = 16 q_even + q_odd (the even column's code is the high nibble), two chains
 * over the band's k in order, from 0: sum_b = sum a b and sum_odd = sum a q_odd; then
 *   band(even) = (sum_b - sum_odd) / 16 + min term,   band(odd) = sum_odd + min term,
 * and y = band, or y + band when adding (from_y). */
static void band_q4_portable(const q4_terms *t, int rows, int i, const uint8_t *codes,
                             size_t stride, int c0, int n, int kc, float *y, size_t ldy,
                             int from_y) {
    int p0 = c0 / 2, p1 = (c0 + n - 1) / 2; /* the bytes the columns are in */
    for (int r = 0; r < rows; r++) {
        float sum_b[Q4_GROUP / 2] = {0}, sum_odd[Q4_GROUP / 2] = {0};
        for (int k = 0; k < kc; k++) {
            const uint8_t *row = codes + (size_t)k * stride;
            for (int p = p0; p <= p1; p++) {
                sum_b[p] = fmaf(t->a[r][k][i], (float)row[p], sum_b[p]);
                sum_odd[p] = fmaf(t->a[r][k][i], (float)(row[p] & 15), sum_odd[p]);
            }
        }
        for (int c = 0; c < n; c++) {
            int column = c0 + c, p = column / 2;
            float band = column % 2 ? sum_odd[p] : (sum_b[p] - sum_odd[p]) * 0.0625f;
            band = band + t->min_term[r][i];
            y[r * ldy + c] = from_y ? y[r * ldy + c] + band : band;
        }
    }
}

/* One band of 4-bit W, as product_band_f16: columns j0 .. j1 in pieces inside one part, each a
 * chunk of whole groups for the wide kernels, or (the portable path, and columns that are not a
 * whole group) what is left of one group; rows of x Q4_CHUNK at a time, each with its terms. */
static void product_band_q4(const float *x, int rows, int in, const uint8_t *W, int q4, int out,
                            float *y, int from_y, int k0, int kc, int j0, int j1, int ahead,
                            const matmul_kernels *wide, int simd) {
    int part = out / q4, G = (part + Q4_GROUP - 1) / Q4_GROUP;
    size_t stride = q4_row_bytes(q4, out);
    for (int j = j0, n; j < j1; j += n) {
        int s = j / part, c = j - s * part, g = c / Q4_GROUP;
        int left = ((s + 1) * part < j1 ? (s + 1) * part : j1) - j; /* columns of this part */
        int whole = wide && c % Q4_GROUP == 0 ? left / Q4_GROUP : 0;
        whole = whole < Q4_CHUNK ? whole : Q4_CHUNK;
        n = whole                           ? whole * Q4_GROUP
            : (g + 1) * Q4_GROUP - c < left ? (g + 1) * Q4_GROUP - c
                                            : left;
        const uint8_t *w = W + (size_t)k0 * stride + (size_t)s * q4_part_bytes(q4, out);
        for (int r0 = 0; r0 < rows; r0 += Q4_CHUNK) {
            int nr = rows - r0 < Q4_CHUNK ? rows - r0 : Q4_CHUNK, first = ahead && r0 == 0;
            const float *xr = x + (size_t)r0 * in + k0;
            int groups = whole ? whole : 1;
            q4_terms t;
#ifdef HAVE_AVX2_PATH
            if (simd) q4_terms_avx2(xr, (size_t)in, nr, w, stride, G, g, groups, kc, first, &t);
            else
#endif
                q4_terms_portable(xr, (size_t)in, nr, w, stride, G, g, groups, kc, &t);
            const uint8_t *codes = w + (size_t)g * (Q4_GROUP / 2);
            float *yr = y + (size_t)r0 * out + j;
            if (whole)
                wide->band_q4(&t, nr, codes, stride, whole, kc, yr, (size_t)out, from_y, first);
            else
                band_q4_portable(&t, nr, 0, codes, stride, c - g * Q4_GROUP, n, kc, yr, (size_t)out,
                                 from_y);
        }
    }
}

/* One band, either format. */
static void product_band(const float *x, int rows, int in, const void *W, int q4, int out, float *y,
                         int from_y, int k0, int kc, int j0, int j1, int ahead,
                         const matmul_kernels *wide, int simd) {
    if (q4) product_band_q4(x, rows, in, W, q4, out, y, from_y, k0, kc, j0, j1, ahead, wide, simd);
    else product_band_f16(x, rows, in, W, out, y, from_y, k0, kc, j0, j1, ahead, wide, simd);
}

/* Decode: each thread owns a contiguous run of 64-column blocks of y and walks W in bands of
 * decode_kc rows, each band across its columns from left to right. */
static void product_decode(const float *x, int rows, int in, const void *W, int q4, int out,
                           float *y, int accumulate, int simd) {
    const matmul_kernels *wide = wide_kernels();
    int blocks = (out + NC - 1) / NC;
#pragma omp parallel
    {
        int threads = omp_get_num_threads(), t = omp_get_thread_num();
        int b0 = (int)((long)blocks * t / threads), b1 = (int)((long)blocks * (t + 1) / threads);
        int j1 = b1 * NC < out ? b1 * NC : out;
        int band = decode_kc(q4, rows);
        for (int k0 = 0; k0 < in && b0 < b1; k0 += band) {
            int kc = in - k0 < band ? in - k0 : band;
            product_band(x, rows, in, W, q4, out, y, accumulate || k0 > 0, k0, kc, b0 * NC, j1,
                         k0 + 2 * kc <= in, wide, simd);
        }
    }
}

/* Prefill's panels: as many whole groups of columns of W as SGEMM_PANEL floats hold (at least
 * one group), widened in the caller's scratch; a small model's matrices go in one panel. */
enum { SGEMM_PANEL = 1 << 23 };

static int panel_cols(int in) {
    int cols = SGEMM_PANEL / in / Q4_GROUP * Q4_GROUP;
    return cols > Q4_GROUP ? cols : Q4_GROUP;
}

/* The width of prefill's panels for W[in][out]. */
static int panel_width(int in, int out) { return out < panel_cols(in) ? out : panel_cols(in); }

size_t matmul_scratch_floats(int in, int out) { return (size_t)in * panel_width(in, out); }

/* Prefill's panel: columns j0 .. j0 + nc of W widened to fp32, wide[in][nc], by every thread. */
static void widen_panel(const void *W, int q4, int in, int out, int j0, int nc, float *wide,
                        int simd) {
#pragma omp parallel for schedule(static)
    for (int k0 = 0; k0 < in; k0 += KC)
        for (int c = 0; c < nc; c += Q4_GROUP) {
            int kc = in - k0 < KC ? in - k0 : KC, n = nc - c < Q4_GROUP ? nc - c : Q4_GROUP;
            if (n == Q4_GROUP) { /* straight into the panel */
                widen_rows(W, q4, out, k0, kc, (j0 + c) / Q4_GROUP, n, wide + (size_t)k0 * nc + c,
                           nc, simd);
                continue;
            }
            _Alignas(32) float group[KC * Q4_GROUP]; /* a group is widened whole, past out too */
            widen_rows(W, q4, out, k0, kc, (j0 + c) / Q4_GROUP, n, group, Q4_GROUP, simd);
            for (int k = 0; k < kc; k++)
                memcpy(wide + (size_t)(k0 + k) * nc + c, group + k * Q4_GROUP, n * sizeof *group);
        }
}

/* Prefill: a panel of W widened by every thread, then the sgemm on it in fixed tiles. */
static void product_sgemm(const float *x, int rows, int in, const void *W, int q4, int out,
                          float *y, int accumulate, float *wide, int simd) {
    int cols = panel_width(in, out);
    for (int j0 = 0; j0 < out; j0 += cols) {
        int nc = out - j0 < cols ? out - j0 : cols;
        widen_panel(W, q4, in, out, j0, nc, wide, simd);
        sgemm_fixed_tiles(rows, nc, in, x, in, wide, nc, accumulate, y + j0, out);
    }
}

/* Prefill in bf16 (PRODUCTS_BF16_PREFILL): x and each widened panel of W rounded to bf16 (to
 * nearest, ties to even), the products summed in fp32 by gemm_bf16 (onednn.c: oneDNN's bf16
 * kernel, or, where oneDNN has none, as on CPUs without AVX-512, OpenBLAS's sgemm of the bf16
 * values widened back to fp32). A bf16 value keeps 8 bits of significand, so each operand moves
 * by at most 2^-9 of itself; the products of two of them are exact in fp32. scratch: the
 * caller's room for the widened panel, or NULL (a workspace of no more than decode's rows, whose
 * short prompts prefill here too): then a panel of its own. */
static void product_bf16(const float *x, int rows, int in, const void *W, int q4, int out, float *y,
                         int accumulate, float *scratch) {
    int cols = panel_width(in, out);
    uint16_t *x16 = line_alloc((size_t)rows * in * sizeof *x16), /* oneDNN's operands */
        *w16 = line_alloc((size_t)in * cols * sizeof *w16);
    float *panel = line_alloc((size_t)rows * cols * sizeof *panel);
    float *own = scratch ? NULL : line_alloc((size_t)in * cols * sizeof *own);
    float *wide = scratch ? scratch : own;
    if (!x16 || !w16 || !panel || !wide) {
        fprintf(stderr, "flexgen: out of memory for a bf16 product of %d x %d x %d\n", rows, in,
                out);
        abort();
    }
    fp32_to_bf16_n(x, x16, (size_t)rows * in);
    for (int j0 = 0; j0 < out; j0 += cols) {
        int nc = out - j0 < cols ? out - j0 : cols;
        widen_panel(W, q4, in, out, j0, nc, wide, use_simd());
        fp32_to_bf16_n(wide, w16, (size_t)in * nc);
        gemm_bf16(rows, nc, in, x16, w16, panel);
#pragma omp parallel for schedule(static)
        for (int r = 0; r < rows; r++) {
            float *yr = y + (size_t)r * out + j0;
            const float *pr = panel + (size_t)r * nc;
            for (int j = 0; j < nc; j++) yr[j] = accumulate ? yr[j] + pr[j] : pr[j];
        }
    }
    free(x16);
    free(w16);
    free(panel);
    free(own);
}

/* W's 7-bit columns j0 .. j0 + nc (int8.c's int8_column_block steps) straight from the codes, a
 * group of 64 columns to a thread: each block of 64 rows is widened into L1 twice, once for the
 * columns' largest values and once to round them, so no fp32 panel is written (that was a pass
 * over 32 MiB a panel, and two more to round it). */
static void int8_columns_of_codes(const void *W, int q4, int in, int out, int j0, int nc,
                                  int8_t *w8, float *scale, int simd) {
#pragma omp parallel for schedule(static)
    for (int c = 0; c < nc; c += Q4_GROUP) {
        int n = nc - c < Q4_GROUP ? nc - c : Q4_GROUP, g = (j0 + c) / Q4_GROUP;
        _Alignas(64) float block[KC * Q4_GROUP];
        int8_column_block columns;
        int8_column_block_begin(&columns, n);
        for (int k0 = 0; k0 < in; k0 += KC) {
            int kc = in - k0 < KC ? in - k0 : KC;
            widen_rows(W, q4, out, k0, kc, g, n, block, Q4_GROUP, simd);
            int8_column_block_tops(&columns, block, kc, Q4_GROUP);
        }
        int8_column_block_scales(&columns, scale + c);
        for (int k0 = 0; k0 < in; k0 += KC) {
            int kc = in - k0 < KC ? in - k0 : KC;
            widen_rows(W, q4, out, k0, kc, g, n, block, Q4_GROUP, simd);
            int8_column_block_round(&columns, block, kc, Q4_GROUP, w8 + (size_t)k0 * nc + c,
                                    (size_t)nc);
        }
    }
}

/* Prefill's int8 buffers, kept from one product to the next and grown when a product needs more
 * (a fresh 32 MiB buffer a call cost its page faults every call); one product at a time. */
static struct {
    pthread_mutex_t lock;
    int8_t *x8, *w8;
    float *alpha, *scale;
    int32_t *isum;
    size_t x8_bytes, w8_bytes, alpha_bytes, scale_bytes, isum_bytes;
} int8_buffers = {.lock = PTHREAD_MUTEX_INITIALIZER};

static void *grown(void *buffer, size_t *bytes, size_t need) {
    if (need <= *bytes) return buffer;
    free(buffer);
    buffer = line_alloc(need); /* oneDNN's operands */
    *bytes = buffer ? need : 0;
    if (!buffer) {
        fprintf(stderr, "flexgen: out of memory for an int8 product's buffer of %zu bytes\n", need);
        abort();
    }
    return buffer;
}

/* The buffers for a product of rows x in x (panels of) cols. */
static void int8_buffers_hold(int rows, int in, int cols) {
    size_t r = (size_t)rows, c = (size_t)cols;
    int8_buffers.x8 = grown(int8_buffers.x8, &int8_buffers.x8_bytes, r * in);
    int8_buffers.w8 = grown(int8_buffers.w8, &int8_buffers.w8_bytes, (size_t)in * c);
    int8_buffers.alpha = grown(int8_buffers.alpha, &int8_buffers.alpha_bytes, r * sizeof(float));
    int8_buffers.scale = grown(int8_buffers.scale, &int8_buffers.scale_bytes, c * sizeof(float));
    int8_buffers.isum = grown(int8_buffers.isum, &int8_buffers.isum_bytes, r * c * sizeof(int32_t));
}

/* W's 7-bit columns made once, for weights that stay put (the runtime keeps them with the 4-bit
 * matrices resident in its working tier): for each panel of product_int8_rows, the columns'
 * scales and gemm_s8's kept copy (in the layout its kernel reads, so no product reorders it).
 * Made by the steps the product takes per call, so the product gives the same bits either way. */
struct int8_columns {
    const void *W;
    int q4_parts, in, out, cols, panels;
    float *scale;         /* [out] */
    gemm_s8_kept **panel; /* [panels] */
    size_t bytes;
};

static void int8_columns_free(int8_columns *kept) {
    if (!kept) return;
    for (int p = 0; p < kept->panels && kept->panel; p++) gemm_s8_kept_free(kept->panel[p]);
    free(kept->panel);
    free(kept->scale);
    free(kept);
}

static int8_columns *int8_columns_make(const void *W, int q4, int in, int out) {
    int cols = panel_width(in, out), panels = (out + cols - 1) / cols;
    int8_columns *kept = calloc(1, sizeof *kept);
    int8_t *w8 = malloc((size_t)in * cols);
    if (kept) {
        *kept = (int8_columns){
            .W = W, .q4_parts = q4, .in = in, .out = out, .cols = cols, .panels = panels};
        kept->scale = malloc((size_t)out * sizeof *kept->scale);
        kept->panel = calloc((size_t)panels, sizeof *kept->panel);
    }
    int ok = kept && w8 && kept->scale && kept->panel;
    for (int p = 0; p < panels && ok; p++) {
        int j0 = p * cols, nc = out - j0 < cols ? out - j0 : cols;
        int8_columns_of_codes(W, q4, in, out, j0, nc, w8, kept->scale + j0, use_simd());
        kept->panel[p] = gemm_s8_keep(nc, in, w8, INT8_W_MAX);
        ok = kept->panel[p] != NULL;
        if (ok) kept->bytes += gemm_s8_kept_bytes(kept->panel[p]);
    }
    free(w8);
    if (!ok) {
        int8_columns_free(kept);
        return NULL;
    }
    kept->bytes += (size_t)out * sizeof *kept->scale;
    return kept;
}

size_t int8_columns_estimate(int in, int out) {
    int cols = panel_width(in, out), panels = (out + cols - 1) / cols;
    /* oneDNN's layouts pad k and n to its blocks (64 at most) */
    size_t k = ((size_t)in + 63) / 64 * 64, n = ((size_t)cols + 63) / 64 * 64;
    return (size_t)panels * (k * n + n * sizeof(int32_t)) + (size_t)out * sizeof(float);
}

int int8_column_set_add(int8_column_set *set, const void *W, int q4_parts, int in, int out) {
    if (set->n == set->cap) {
        int cap = set->cap ? 2 * set->cap : 64;
        int8_columns **items = realloc(set->items, (size_t)cap * sizeof *items);
        if (!items) return -1;
        set->items = items;
        set->cap = cap;
    }
    int8_columns *kept = int8_columns_make(W, q4_parts, in, out);
    if (!kept) return -1;
    set->items[set->n++] = kept;
    set->bytes += kept->bytes;
    return 0;
}

const int8_columns *int8_column_set_find(const int8_column_set *set, const void *W) {
    for (int i = 0; set && i < set->n; i++)
        if (set->items[i]->W == W) return set->items[i];
    return NULL;
}

void int8_column_set_free(int8_column_set *set) {
    for (int i = 0; i < set->n; i++) int8_columns_free(set->items[i]);
    free(set->items);
    memset(set, 0, sizeof *set);
}

/* Prefill with --int8-activations: int8.c's rows rounded once, W's columns once (straight from the
 * codes, or kept: made once with the weights), one integer product per panel (gemm_s8, onednn.c:
 * exact int32 sums on whichever path runs), and the finish (the scales, then linear_layer's bias
 * and ReLU) in one pass over y; int8.c's comment has the scheme and its bound. */
static void product_int8_rows(const float *x, int rows, int in, const void *W, int q4, int out,
                              float *y, int accumulate, const matmul_epilogue *after, int simd,
                              const int8_column_set *kept_set) {
    int cols = panel_width(in, out);
    const int8_columns *kept = int8_column_set_find(kept_set, W);
    if (kept && (kept->q4_parts != q4 || kept->in != in || kept->out != out))
        kept = NULL; /* W's as another shape */
    pthread_mutex_lock(&int8_buffers.lock);
    int8_buffers_hold(rows, in, cols);
    int8_t *x8 = int8_buffers.x8, *w8 = int8_buffers.w8;
    float *alpha = int8_buffers.alpha;
    int32_t *isum = int8_buffers.isum;
    int8_round_rows(x, rows, in, x8, alpha);
    for (int j0 = 0, p = 0; j0 < out; j0 += cols, p++) {
        int nc = out - j0 < cols ? out - j0 : cols;
        const float *scale = kept ? kept->scale + j0 : int8_buffers.scale;
        if (!kept || gemm_s8_with_kept(rows, x8, kept->panel[p], isum) != 0) {
            int8_columns_of_codes(W, q4, in, out, j0, nc, w8, int8_buffers.scale, simd);
            scale = int8_buffers.scale;
            gemm_s8(rows, nc, in, x8, w8, INT8_W_MAX, isum);
        }
        int8_finish_rows(isum, alpha, scale, rows, nc, y + j0, out, accumulate,
                         after && after->bias ? after->bias + j0 : NULL, after && after->relu);
    }
    pthread_mutex_unlock(&int8_buffers.lock);
}

void matmul_int8_blocks(const float *x, int rows, int in, const void *W, int q4_parts, int out,
                        float *y, int accumulate) {
    fg_int8_sums *sums = matmul_int8_sums();
    const matmul_kernels *wide = wide_kernels();
    /* the avx512 path's pairs need VNNI, so they run where its sums do; the avx2 path's need AVX2
     * alone */
    int pairs_run = wide && (wide->int8_sums ? sums == wide->int8_sums : 1);
    fg_int8_pairs *pairs = pairs_run ? wide->int8_pairs : NULL;
    matmul_q4_int8(x, rows, in, W, q4_parts, out, y, accumulate, use_simd(), sums, pairs);
}

/* v + bias, then ReLU where relu: v > 0 ? v : 0 (NaN and -0 give 0). */
static inline float bias_relu_one(float v, float bias, int relu) {
    v += bias;
    return relu && !(v > 0) ? 0 : v;
}

/* y[0 .. n) through bias_relu_one. y and bias never overlap (restrict), and 8 values make one
 * fixed-length loop: the compiler turns it into vector instructions, ReLU's test without a branch
 * (y + bias falls either side of 0 at random, a branch mispredicted half the time). */
static void bias_relu(float *restrict y, const float *restrict bias, int n, int relu) {
    for (; n >= 8; n -= 8, y += 8, bias += 8)
        for (int l = 0; l < 8; l++) y[l] = bias_relu_one(y[l], bias[l], relu);
    for (int l = 0; l < n; l++) y[l] = bias_relu_one(y[l], bias[l], relu);
}

/* linear_layer's steps after a product that has not taken them (matmul_epilogue). Each thread
 * takes a run of whole groups of 64 columns in every row, as decode's products split y among
 * their threads, so that it finds its columns in its own core's cache. */
static void apply_epilogue(float *y, int rows, int out, const matmul_epilogue *after) {
    int groups = (out + 63) / 64;
#pragma omp parallel
    {
        int threads = omp_get_num_threads(), t = omp_get_thread_num();
        int c0 = 64 * (int)((long)groups * t / threads);
        int c1 = 64 * (int)((long)groups * (t + 1) / threads);
        c1 = c1 < out ? c1 : out;
        for (int r = 0; r < rows && c0 < c1; r++)
            bias_relu(y + (size_t)r * out + c0, after->bias + c0, c1 - c0, after->relu);
    }
}

/* The opt-in schemes: prefill's (int8 rows rounded once, or bf16) for a prompt of any length, so
 * that a prompt is rounded the same way whatever GPU batch it is in; decode's (int8 blocks, or
 * fp32) for a decode step of up to MATMUL_DECODE_ROWS rows, and prefill's past that, where its
 * denser product runs faster (docs/DESIGN.md, "Same bits"). fp32's own kernels go by rows too
 * (sgemm's panel pays past MATMUL_DECODE_ROWS): the two differ only in the order of their sums. */
void matmul_weights(const float *x, int rows, int in, const void *W, int q4_parts, int out,
                    float *y, int accumulate, int products, int prefill, float *scratch,
                    const matmul_epilogue *after, const int8_column_set *kept) {
    int simd = use_simd();
    int many = rows > MATMUL_DECODE_ROWS;
    int scheme = prefill || many; /* the opt-in scheme's prefill products */
    if (products == PRODUCTS_INT8 && q4_parts && scheme) {
        product_int8_rows(x, rows, in, W, q4_parts, out, y, accumulate, after, simd, kept);
        return; /* the epilogue ran in the finish */
    }
    if (products == PRODUCTS_INT8 && q4_parts)
        matmul_int8_blocks(x, rows, in, W, q4_parts, out, y, accumulate);
    else if (products == PRODUCTS_BF16_PREFILL && scheme)
        product_bf16(x, rows, in, W, q4_parts, out, y, accumulate, scratch);
    else if (many) product_sgemm(x, rows, in, W, q4_parts, out, y, accumulate, scratch, simd);
    else product_decode(x, rows, in, W, q4_parts, out, y, accumulate, simd);
    if (after && after->bias) apply_epilogue(y, rows, out, after);
}

/* ---- lm_head: E read by rows ---- */

/* x . e over dim values in 8 lanes, added as AVX2's halving reduction adds them, then the tail. */
static float dot_portable(const float *x, const float *e, int dim) {
    float lane[8] = {0};
    int vec = dim / 8 * 8;
    for (int d = 0; d < vec; d += 8)
        for (int l = 0; l < 8; l++) lane[l] = fmaf(x[d + l], e[d + l], lane[l]);
    float s =
        ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
    for (int d = vec; d < dim; d++) s = fmaf(x[d], e[d], s);
    return s;
}

static void dots_portable(const float *x, int rows, int dim, const float *e, float *y, size_t ldy) {
    for (int r = 0; r < rows; r++) y[r * ldy] = dot_portable(x + (size_t)r * dim, e, dim);
}

/* The same with e fp16, widened as it is read. */
static float dot_portable_f16(const float *x, const fp16 *e, int dim) {
    float lane[8] = {0};
    int vec = dim / 8 * 8;
    for (int d = 0; d < vec; d += 8)
        for (int l = 0; l < 8; l++) lane[l] = fmaf(x[d + l], fp16_to_fp32(e[d + l]), lane[l]);
    float s =
        ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
    for (int d = vec; d < dim; d++) s = fmaf(x[d], fp16_to_fp32(e[d]), s);
    return s;
}

/* 4-bit lm_head. E [n][dim] is grouped along n: rows 64 g .. 64 g + 63 share, at each d, a min
 * m[g][d] and a scale s[g][d]; byte row p of the codes holds rows 2p (high nibbles) and 2p + 1. As
 * in the linear layers (the top of this file), a dot is taken from the codes:
 *   y[r][v] = sum_d a[r][d] q[v][d] + sum_d x[r][d] m[g][d],    a[r][d] = x[r][d] s[g][d],
 * the first sum in dot_portable's 8 lanes and tail, then the min term (the second sum, the same
 * way) added. */

/* The tail d = vec .. dim of a dot of a with the codes of a byte row (its low nibbles, or high). */
static float q4_dot_tail(float s, const float *a, int dim, const uint8_t *byte_row, int low) {
    for (int d = dim / 8 * 8; d < dim; d++) {
        int q = low ? byte_row[d] & 15 : byte_row[d] >> 4;
        s = fmaf(a[d], (float)q, s);
    }
    return s;
}

static void dots_q4_portable(const float *a, const float *min_term, int rows, int dim,
                             const uint8_t *E, int v0, int ne, float *y, size_t ldy) {
    int vec = dim / 8 * 8;
    for (int j = 0; j < ne; j++) {
        const uint8_t *byte_row = E + (size_t)((v0 + j) / 2) * dim;
        int low = (v0 + j) % 2;
        for (int r = 0; r < rows; r++) {
            const float *ar = a + (size_t)r * dim;
            float lane[8] = {0};
            for (int d = 0; d < vec; d += 8)
                for (int l = 0; l < 8; l++) {
                    int q = low ? byte_row[d + l] & 15 : byte_row[d + l] >> 4;
                    lane[l] = fmaf(ar[d + l], (float)q, lane[l]);
                }
            float s = ((lane[0] + lane[4]) + (lane[2] + lane[6])) +
                      ((lane[1] + lane[5]) + (lane[3] + lane[7]));
            y[r * ldy + j] = q4_dot_tail(s, ar, dim, byte_row, low) + min_term[r];
        }
    }
}

#ifdef HAVE_AVX2_PATH
__attribute__((target("avx2,fma"))) static float lanes_sum(__m256 acc) {
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
    return _mm_cvtss_f32(s4);
}

/* ne <= 3 rows of E (fp16 when f16, else fp32; lde apart) against mr <= 4 rows of x: twelve
 * chains of 8 lanes at most, in 16 registers with the three rows of E and one of x. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void dots_avx2_shape(
    const float *x, int dim, const void *e, size_t lde, float *y, size_t ldy, const int mr,
    const int ne, const int f16) {
    __m256 acc[4][3];
    int vec = dim / 8 * 8;
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 3
        for (int v = 0; v < ne; v++) acc[r][v] = _mm256_setzero_ps();
    for (int d = 0; d < vec; d += 8) {
        __m256 ev[3];
#pragma GCC unroll 3
        for (int v = 0; v < ne; v++)
            ev[v] = f16 ? _mm256_cvtph_ps(
                              _mm_loadu_si128((const __m128i *)((const fp16 *)e + v * lde + d)))
                        : _mm256_loadu_ps((const float *)e + v * lde + d);
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++) {
            __m256 xv = _mm256_loadu_ps(x + (size_t)r * dim + d);
#pragma GCC unroll 3
            for (int v = 0; v < ne; v++) acc[r][v] = _mm256_fmadd_ps(xv, ev[v], acc[r][v]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < ne; v++) {
            float s = lanes_sum(acc[r][v]);
            for (int d = vec; d < dim; d++) {
                float ed = f16 ? fp16_to_fp32(((const fp16 *)e)[v * lde + d])
                               : ((const float *)e)[v * lde + d];
                s = fmaf(x[(size_t)r * dim + d], ed, s);
            }
            y[r * ldy + v] = s;
        }
}

#define DOTS_CASE(mr, f16)                                               \
    switch (ne) {                                                        \
    case 1: dots_avx2_shape(x, dim, e, lde, y, ldy, mr, 1, f16); break;  \
    case 2: dots_avx2_shape(x, dim, e, lde, y, ldy, mr, 2, f16); break;  \
    default: dots_avx2_shape(x, dim, e, lde, y, ldy, mr, 3, f16); break; \
    }

/* All rows of x against ne <= 3 rows of E, 4 rows of x at a time. */
__attribute__((target("avx2,fma,f16c"))) static void dots_avx2(const float *x, int rows, int dim,
                                                               const void *e, size_t lde, int ne,
                                                               int f16, float *y, size_t ldy) {
    for (int r = 0; r < rows; r += 4, x += (size_t)4 * dim, y += 4 * ldy) {
        int mr = rows - r < 4 ? rows - r : 4;
        if (f16) {
            switch (mr) {
            case 4: DOTS_CASE(4, 1); break;
            case 3: DOTS_CASE(3, 1); break;
            case 2: DOTS_CASE(2, 1); break;
            default: DOTS_CASE(1, 1); break;
            }
        } else {
            switch (mr) {
            case 4: DOTS_CASE(4, 0); break;
            case 3: DOTS_CASE(3, 0); break;
            case 2: DOTS_CASE(2, 0); break;
            default: DOTS_CASE(1, 0); break;
            }
        }
    }
}

/* 4-bit, from the codes: byte rows 0 .. nb of `bytes` (dim apart; byte row p holds rows 2p, its
 * high nibbles, and 2p + 1, its low ones) against mr rows of a: per 8 d, 8 bytes widened to 32-bit
 * lanes, their two nibbles converted to fp32, and each row of a multiplies both. dot[r][2 p + h]:
 * the lanes of row 2p + h, added. Each line of a byte row asks for the same line of the next nb
 * byte rows (the next call's) into L1: nb streams dim bytes apart are more than the hardware's
 * prefetcher follows (batch 1, opt-1.3b's table: 1.5x with it on a Zen 4). */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void dots_q4_avx2_shape(
    const float *a, int dim, const uint8_t *bytes, float dot[4][8], const int mr, const int nb) {
    const __m256i low4 = _mm256_set1_epi32(15);
    __m256 acc[4][8];
    int vec = dim / 8 * 8;
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 8
        for (int j = 0; j < 2 * nb; j++) acc[r][j] = _mm256_setzero_ps();
    for (int d = 0; d < vec; d += 8) {
        if (d % 64 == 0)
#pragma GCC unroll 4
            for (int p = 0; p < nb; p++)
                _mm_prefetch((const char *)(bytes + (size_t)(p + nb) * dim + d), _MM_HINT_T0);
#pragma GCC unroll 4
        for (int p = 0; p < nb; p++) {
            __m256i b = _mm256_cvtepu8_epi32(
                _mm_loadl_epi64((const __m128i *)(bytes + (size_t)p * dim + d)));
            __m256 high = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
            __m256 low = _mm256_cvtepi32_ps(_mm256_and_si256(b, low4));
#pragma GCC unroll 4
            for (int r = 0; r < mr; r++) {
                __m256 av = _mm256_loadu_ps(a + (size_t)r * dim + d);
                acc[r][2 * p] = _mm256_fmadd_ps(av, high, acc[r][2 * p]);
                acc[r][2 * p + 1] = _mm256_fmadd_ps(av, low, acc[r][2 * p + 1]);
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 8
        for (int j = 0; j < 2 * nb; j++) dot[r][j] = lanes_sum(acc[r][j]);
}

/* The kernel table's 4-bit dots: rows of a, up to 4 at a time, against the block's byte rows
 * (as many at a time as 8 accumulators hold); each dot then gains its tail and the min term. */
__attribute__((target("avx2,fma,f16c"))) static void dots_q4_avx2(const float *a,
                                                                  const float *min_term, int rows,
                                                                  int dim, const uint8_t *E, int v0,
                                                                  int ne, float *y, size_t ldy) {
    const uint8_t *bytes = E + (size_t)(v0 / 2) * dim;
    int pairs = (ne + 1) / 2;
    for (int r = 0, mr; r < rows; r += mr) {
        mr = rows - r < 4 ? rows - r : 4;
        for (int p = 0, nb; p < pairs; p += nb) {
            float dot[4][8];
            const float *ar = a + (size_t)r * dim;
            const uint8_t *bp = bytes + (size_t)p * dim;
            nb = mr == 1 && pairs - p >= 4 ? 4 : mr == 2 && pairs - p >= 2 ? 2 : 1;
            if (mr == 1 && nb == 4) dots_q4_avx2_shape(ar, dim, bp, dot, 1, 4);
            else if (mr == 1) dots_q4_avx2_shape(ar, dim, bp, dot, 1, 1);
            else if (mr == 2 && nb == 2) dots_q4_avx2_shape(ar, dim, bp, dot, 2, 2);
            else if (mr == 2) dots_q4_avx2_shape(ar, dim, bp, dot, 2, 1);
            else if (mr == 3) dots_q4_avx2_shape(ar, dim, bp, dot, 3, 1);
            else dots_q4_avx2_shape(ar, dim, bp, dot, 4, 1);
            for (int i = 0; i < mr; i++)
                for (int j = 0; j < 2 * nb && 2 * p + j < ne; j++)
                    y[(size_t)(r + i) * ldy + 2 * p + j] =
                        q4_dot_tail(dot[i][j], ar + (size_t)i * dim, dim,
                                    bp + (size_t)(j / 2) * dim, j % 2) +
                        min_term[r + i];
        }
    }
}

/* a[r][d] = x[r][d] scale[d] for every row of x, the scales fp16 (8 at a time, the tail alone). */
__attribute__((target("avx2,f16c"))) static void scale_rows_avx2(const float *x, int rows, int dim,
                                                                 const fp16 *scale, float *a) {
    int vec = dim / 8 * 8;
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * dim;
        float *ar = a + (size_t)r * dim;
        for (int d = 0; d < vec; d += 8)
            _mm256_storeu_ps(
                ar + d,
                _mm256_mul_ps(_mm256_loadu_ps(xr + d),
                              _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scale + d)))));
        for (int d = vec; d < dim; d++) ar[d] = xr[d] * fp16_to_fp32(scale[d]);
    }
}

/* The kernel table's dots: fp16 rows of E three at a time (twelve chains). */
static void dots_f16_avx2(const float *x, int rows, int dim, const fp16 *E, int v0, int ne,
                          float *y, size_t ldy) {
    for (int j = 0; j < ne; j += 3)
        dots_avx2(x, rows, dim, E + (size_t)(v0 + j) * dim, (size_t)dim, ne - j < 3 ? ne - j : 3, 1,
                  y + j, ldy);
}

static const matmul_kernels avx2_kernels = {
    "avx2", band_f16_avx2, band_q4_avx2, dots_f16_avx2, dots_q4_avx2, NULL, int8_pairs_avx2};
#endif

/* The wide kernels of the path: NULL for the portable one (and for a path this CPU or this build
 * lacks, which main refuses before). */
static const matmul_kernels *wide_kernels(void) {
    switch (isa_now()) {
#ifdef HAVE_AVX2_PATH
    case FG_ISA_AVX512:
        if (fg_isa_of_cpu() == FG_ISA_AVX512 && matmul_avx512()) return matmul_avx512();
        /* fall through */
    case FG_ISA_AVX2: return fg_isa_of_cpu() >= FG_ISA_AVX2 ? &avx2_kernels : NULL;
#endif
    case FG_ISA_AVX512_SIMDE: return matmul_avx512_simde();
    default: return NULL;
    }
}

/* VNNI's integer sums: the 512-bit form on the avx512 path, the 256-bit one (AVX-VNNI) on the avx2
 * path, each where cpuid has it; on SIMDe, always. */
fg_int8_sums *matmul_int8_sums(void) {
    static int features = -1; /* written once, same value from any thread (cpuid is slow in a VM) */
    if (features < 0) features = (int)fg_cpu_features();
    const matmul_kernels *wide = wide_kernels();
#ifdef HAVE_AVX2_PATH
    if (wide == &avx2_kernels) return features & FG_CPU_AVXVNNI ? int8_sums_vnni256(1) : NULL;
#endif
    return wide && (features & FG_CPU_AVX512VNNI || wide != matmul_avx512()) ? wide->int8_sums
                                                                             : NULL;
}

/* The instructions of the path's integer sums (--int8-activations): avx512-vnni, the same on
 * SIMDe (avx512-vnni-simde), avx-vnni, avx2 (vpmaddubsw) or portable. */
const char *matmul_int8_path(void) {
    fg_int8_sums *sums = matmul_int8_sums();
#ifdef HAVE_AVX2_PATH
    if (sums && sums == int8_sums_vnni256(1)) return "avx-vnni";
#endif
    if (sums && wide_kernels() != matmul_avx512()) return "avx512-vnni-simde";
    return sums ? "avx512-vnni" : use_simd() ? "avx2" : "portable";
}

const char *matmul_path(void) {
    const matmul_kernels *wide = wide_kernels();
    return wide ? wide->name : "portable";
}

/* Row r of E widened (fp16_to_fp32 and q4 decoding are exact on every path). */
static void embed_row(const void *E, int q4, int n, int dim, int r, float *dst, int simd) {
    const fg_simd *twin = fg_simd_kernels();
    if (q4 && twin->q4_decode_row) {
        const fp16 *mins = q4_mins(E, (size_t)n, (size_t)dim);
        size_t groups = ((size_t)n + Q4_GROUP - 1) / Q4_GROUP;
        twin->q4_decode_row(E, mins, mins + groups * dim, (size_t)r, (size_t)dim, dst);
    } else if (q4) {
        q4_decompress_row(E, (size_t)n, (size_t)dim, (size_t)r, dst);
    } else if (simd) {
        fp16_to_fp32_n((const fp16 *)E + (size_t)r * dim, dst, (size_t)dim);
    } else {
        const fp16 *row = (const fp16 *)E + (size_t)r * dim;
        for (int d = 0; d < dim; d++) dst[d] = fp16_to_fp32(row[d]);
    }
}

void matmul_embed_row(const void *E, int q4_parts, int n, int dim, int r, float *dst) {
    embed_row(E, q4_parts, n, dim, r, dst, use_simd());
}

/* More rows than a few: blocks of MATMUL_EMBED_BLOCK rows of E widened, then sgemm. */
static void embed_t_sgemm(const float *x, int rows, int dim, const void *E, int q4, int n, float *y,
                          float *scratch, size_t scratch_stride, int simd) {
#pragma omp parallel for schedule(dynamic)
    for (int v0 = 0; v0 < n; v0 += MATMUL_EMBED_BLOCK) {
        int nb = n - v0 < MATMUL_EMBED_BLOCK ? n - v0 : MATMUL_EMBED_BLOCK;
        float *e = scratch + scratch_stride * omp_get_thread_num();
        for (int v = 0; v < nb; v++) embed_row(E, q4, n, dim, v0 + v, e + (size_t)v * dim, simd);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, nb, dim, 1.0f, x, dim, e, dim,
                    0.0f, y + v0, n);
    }
}

/* A few rows of x against the 4-bit table, group by group: each group's a and min terms into the
 * thread's scratch, then its rows' dots from the codes (the comment above dots_q4_portable). */
static void embed_t_q4(const float *x, int rows, int dim, const uint8_t *E, int n, float *y,
                       float *scratch, size_t scratch_stride, const matmul_kernels *wide,
                       int simd) {
    int G = (n + Q4_GROUP - 1) / Q4_GROUP;
    const fp16 *mins = (const fp16 *)(E + (size_t)G * (Q4_GROUP / 2) * dim),
               *scales = mins + (size_t)G * dim;
#pragma omp parallel for schedule(static)
    for (int g = 0; g < G; g++) {
        float *a = scratch + scratch_stride * omp_get_thread_num(), min_term[MATMUL_EMBED_DOT_ROWS];
#ifdef HAVE_AVX2_PATH
        if (simd) scale_rows_avx2(x, rows, dim, scales + (size_t)g * dim, a);
        else
#endif
            for (int r = 0; r < rows; r++)
                for (int d = 0; d < dim; d++) {
                    size_t at = (size_t)r * dim + d;
                    a[at] = x[at] * fp16_to_fp32(scales[(size_t)g * dim + d]);
                }
        const fp16 *group_mins = mins + (size_t)g * dim;
        if (wide) wide->dots_f16(x, rows, dim, mins, g, 1, min_term, 1);
        else
            for (int r = 0; r < rows; r++)
                min_term[r] = dot_portable_f16(x + (size_t)r * dim, group_mins, dim);
        int end = (g + 1) * Q4_GROUP < n ? (g + 1) * Q4_GROUP : n;
        for (int v0 = g * Q4_GROUP; v0 < end; v0 += 8) {
            int ne = end - v0 < 8 ? end - v0 : 8;
            if (wide) wide->dots_q4(a, min_term, rows, dim, E, v0, ne, y + v0, (size_t)n);
            else dots_q4_portable(a, min_term, rows, dim, E, v0, ne, y + v0, (size_t)n);
        }
    }
    (void)simd;
}

void matmul_embed_t(const float *x, int rows, int dim, const void *E, int q4_parts, int n, float *y,
                    float *scratch, size_t scratch_stride) {
    int simd = use_simd();
    const matmul_kernels *wide = wide_kernels();
    if (rows > MATMUL_EMBED_DOT_ROWS) {
        embed_t_sgemm(x, rows, dim, E, q4_parts, n, y, scratch, scratch_stride, simd);
        return;
    }
    if (q4_parts) {
#ifdef HAVE_AVX2_PATH
        /* One row: the 256-bit dots on the AVX-512 paths too. AVX-512's put two rows of E in a
         * register, which saves no instruction at one row (an insert a pair for an FMA) and on a
         * CPU that runs 512-bit operations as two halves costs time: 3.27 against 2.50 ms for
         * opt-1.3b's table on a Zen 4. The same bits, as on every path. */
        if (rows == 1 && wide && simd) wide = &avx2_kernels;
#endif
        embed_t_q4(x, rows, dim, (const uint8_t *)E, n, y, scratch, scratch_stride, wide, simd);
        return;
    }
    /* fp16: the wide kernels read E as stored; the portable path widens rows of E into the
     * scratch. */
#pragma omp parallel for schedule(static)
    for (int v0 = 0; v0 < n; v0 += 8) {
        int ne = n - v0 < 8 ? n - v0 : 8;
        if (wide) {
            wide->dots_f16(x, rows, dim, (const fp16 *)E, v0, ne, y + v0, (size_t)n);
            continue;
        }
        float *e = scratch + scratch_stride * omp_get_thread_num();
        for (int v = 0; v < ne; v++) embed_row(E, 0, n, dim, v0 + v, e + (size_t)v * dim, simd);
        for (int v = 0; v < ne; v++)
            dots_portable(x, rows, dim, e + (size_t)v * dim, y + v0 + v, (size_t)n);
    }
}
