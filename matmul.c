/* matmul.c: products of fp32 activations with weights as they are stored, fp16 or 4-bit (§5),
 * accumulated in fp32: the CPU backend's linear layers and its lm_head.
 *
 *   matmul_weights   y[rows][out] (= or +=) x[rows][in] W[in][out]   linear weights, [in][out]
 *   matmul_embed_t   y[rows][n] = x[rows][dim] E^T, E [n][dim]        the embedding as lm_head
 *
 * Decode (up to MATMUL_DECODE_ROWS = 64 rows) reads every weight once per step for a few rows,
 * so it is bound by memory: reading the 2 bytes a weight is stored in (0.56 when 4-bit) instead
 * of a 4-byte fp32 copy is the point. Its kernel:
 *
 *   cache blocking  W is walked in blocks of KC = 32 rows (k) by NC = 256 columns; threads take
 *                   column blocks of y. Each row k of a block is 512 contiguous bytes of fp16,
 *                   and the next block's rows are prefetched while this one is widened.
 *   packing         a block is widened to fp32 once into a panel (33 KiB, on the thread's stack,
 *                   so in L1) of NC / 16 strips of [KC][16] floats, which every row of x then
 *                   uses: the inner loop reads 64 contiguous bytes per k. Widening is exact:
 *                   fp16 -> fp32 (F16C's cvtph), or a 4-bit value's fmaf(q, scale, min), the
 *                   value q4_decompress gives (64 columns of W[in][out] are one group of a row).
 *   register tile   up to MR = 6 rows by 16 columns of y stay in 12 AVX registers while k runs
 *                   over the block: per k, two loads of the panel, a broadcast of x per row, two
 *                   FMAs per row. Rows are split into tiles as evenly as they go (8 = 4 + 4).
 *
 * Every element of y is one chain of fused multiply-adds over k in increasing order, started at 0
 * (or at y, to add) and carried from one k block to the next through y itself. So its bits do not
 * depend on the number of rows, the threads or the path: the portable C path (the same loops with
 * fmaf) gives the AVX2 path's results bit for bit.
 *
 * Prefill (more rows) is bound by arithmetic, and there OpenBLAS's sgemm is faster than this
 * kernel: each thread widens a column panel of W (all of k, 256 columns) into its part of a
 * scratch buffer and calls sgemm on it. Measured on opt-1.3b's fc1 (2048 x 8192) and fc2
 * (8192 x 2048), 1024 rows, on a 2-core machine busy with other work (so noisy, +-20%): the
 * kernel reached 0.72-0.79 of cblas_sgemm on fp32 copies of the weights, the panels and sgemm
 * 0.84-0.95. Both differ from an fp32 sgemm only in the order of the sums.
 *
 * lm_head reads E by rows (the table is [n][dim]): each row is widened into a buffer and dotted
 * with x's rows in 8 lanes (lane l sums k = l mod 8), which are added pairwise at the end; the
 * portable path keeps the same lanes and the same order.
 */
#include "flexgen.h"

#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_AVX2_PATH 1
#endif

enum { MR = 6, NR = 16, KC = 32, NC = 256 };

static int portable_only;
void matmul_force_portable(int on) { portable_only = on; }
static int use_simd(void) { return !portable_only && fg_cpu_has_avx2(); }

/* ============================================================================================
 * Widening a block of W[in][out] (rows k0 .. k0 + kc, columns j0 .. j0 + nc) into the panel:
 * strip s holds columns j0 + 16 s .. as [kcap][16] floats, zeros past out. A block's columns are
 * whole groups of 64: for 4-bit weights, one min and one scale per row.
 * ============================================================================================ */

typedef struct {
    float *p;
    int kcap; /* rows of a strip */
} panel;

/* Strips are one cache line more than kcap rows apart: at a power-of-two distance the stores of
 * one row k to every strip would alias (4 KiB apart) and stall the loads of the next. */
static float *strip_at(panel P, int s, int k) { return P.p + (size_t)s * (P.kcap + 1) * NR + (size_t)k * NR; }

/* 4-bit W[in][out] is [in][out][1] in quant.c's layout: row k is G groups of 32 bytes, then G
 * mins and G scales (fp16). */
static size_t q4_row_bytes(int out) { return q4_bytes(1, (size_t)out, 1); }

/* Column c of group g of a 4-bit row: fmaf(q, scale, min), as q4_decompress computes it. */
static float q4_value(const uint8_t *row, int out, int g, int c) {
    int G = (out + Q4_GROUP - 1) / Q4_GROUP;
    const fp16 *mins = (const fp16 *)(row + (size_t)G * (Q4_GROUP / 2)), *scales = mins + G;
    const uint8_t *bytes = row + (size_t)g * (Q4_GROUP / 2); /* value 2p: high nibble of byte p */
    return fmaf((float)((bytes[c / 2] >> (c % 2 ? 0 : 4)) & 15), fp16_to_fp32(scales[g]),
                fp16_to_fp32(mins[g]));
}

/* Group g (columns 64 g ..) of row k into dst: n values, zeros after them. */
static void widen_group_scalar(const void *W, int q4, int out, int k, int g, int n, float *dst) {
    const uint8_t *row4 = (const uint8_t *)W + (size_t)k * q4_row_bytes(out);
    const fp16 *row16 = (const fp16 *)W + (size_t)k * out + (size_t)g * Q4_GROUP;
    for (int c = 0; c < Q4_GROUP; c++)
        dst[c] = c >= n ? 0 : q4 ? q4_value(row4, out, g, c) : fp16_to_fp32(row16[c]);
}

#ifdef HAVE_AVX2_PATH
/* A whole group (n == 64). */
__attribute__((target("avx2,fma,f16c"))) static void widen_group_avx2(const void *W, int q4, int out,
                                                                      int k, int g, float *dst) {
    if (!q4) {
        const fp16 *row = (const fp16 *)W + (size_t)k * out + (size_t)g * Q4_GROUP;
        for (int i = 0; i < Q4_GROUP; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + i))));
        return;
    }
    /* 32 bytes -> 64 values in order, as quant.c's decode_groups_avx2 */
    const uint8_t *row = (const uint8_t *)W + (size_t)k * q4_row_bytes(out);
    int G = (out + Q4_GROUP - 1) / Q4_GROUP;
    const fp16 *mins = (const fp16 *)(row + (size_t)G * (Q4_GROUP / 2)), *scales = mins + G;
    __m256 min = _mm256_set1_ps(fp16_to_fp32(mins[g])), scale = _mm256_set1_ps(fp16_to_fp32(scales[g]));
    const uint8_t *b = row + (size_t)g * (Q4_GROUP / 2);
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
#endif

static void widen_group(const void *W, int q4, int out, int k, int g, int n, float *dst, int simd) {
#ifdef HAVE_AVX2_PATH
    if (simd && n == Q4_GROUP) { widen_group_avx2(W, q4, out, k, g, dst); return; }
#endif
    (void)simd;
    widen_group_scalar(W, q4, out, k, g, n, dst);
}

/* Asks for the bytes of group g of row k ahead of their use (W's rows are read in short runs,
 * too short for the hardware's stream prefetch to reach ahead by itself). */
static void prefetch_group(const void *W, int q4, int out, int k, int g) {
    const char *at = q4 ? (const char *)W + (size_t)k * q4_row_bytes(out) + (size_t)g * (Q4_GROUP / 2)
                        : (const char *)((const fp16 *)W + (size_t)k * out + (size_t)g * Q4_GROUP);
    __builtin_prefetch(at);
    if (!q4) __builtin_prefetch(at + 64);
}

static void widen_block(const void *W, int q4, int in, int out, int k0, int kc, int j0, int nc,
                        panel P, int simd) {
    float group[Q4_GROUP];
    for (int k = 0; k < kc; k++)
        for (int c = 0; c < nc; c += Q4_GROUP) {
            int g = (j0 + c) / Q4_GROUP, n = nc - c < Q4_GROUP ? nc - c : Q4_GROUP;
            if (k0 + k + kc < in) prefetch_group(W, q4, out, k0 + k + kc, g); /* the next block's */
            widen_group(W, q4, out, k0 + k, g, n, group, simd);
            for (int i = 0; i < Q4_GROUP / NR; i++) memcpy(strip_at(P, c / NR + i, k), group + NR * i, sizeof(float) * NR);
        }
}

/* ============================================================================================
 * The register tile: y[mr][16] (=, or from y) + x[mr][k0 .. k0 + kc] strip[kc][16], one fused
 * chain per element. x rows are ldx apart, y rows ldy apart.
 * ============================================================================================ */

static void tile_portable(const float *x, size_t ldx, const float *strip, int kc, float *y,
                          size_t ldy, int from_y, int mr) {
    for (int r = 0; r < mr; r++) {
        float acc[NR];
        for (int c = 0; c < NR; c++) acc[c] = from_y ? y[r * ldy + c] : 0;
        for (int k = 0; k < kc; k++) {
            float xr = x[r * ldx + k];
            for (int c = 0; c < NR; c++) acc[c] = fmaf(xr, strip[k * NR + c], acc[c]);
        }
        memcpy(y + r * ldy, acc, sizeof acc);
    }
}

#ifdef HAVE_AVX2_PATH
/* mr is a constant at each call (tile_avx2), so the rows past it vanish and the twelve
 * accumulators are named, not an array: the compiler keeps them in registers. */
#define ROW_LOAD(r) \
    __m256 a##r##0 = _mm256_setzero_ps(), a##r##1 = a##r##0; \
    if (mr > r && from_y) a##r##0 = _mm256_loadu_ps(y + r * ldy), a##r##1 = _mm256_loadu_ps(y + r * ldy + 8);
#define ROW_FMA(r) \
    if (mr > r) { \
        __m256 xr = _mm256_broadcast_ss(x + r * ldx + k); \
        a##r##0 = _mm256_fmadd_ps(xr, w0, a##r##0); \
        a##r##1 = _mm256_fmadd_ps(xr, w1, a##r##1); \
    }
#define ROW_STORE(r) \
    if (mr > r) _mm256_storeu_ps(y + r * ldy, a##r##0), _mm256_storeu_ps(y + r * ldy + 8, a##r##1);

__attribute__((target("avx2,fma"), always_inline)) static inline void tile_avx2_rows(
    const float *x, size_t ldx, const float *strip, int kc, float *y, size_t ldy, int from_y,
    const int mr) {
    ROW_LOAD(0) ROW_LOAD(1) ROW_LOAD(2) ROW_LOAD(3) ROW_LOAD(4) ROW_LOAD(5)
#pragma GCC unroll 4
    for (int k = 0; k < kc; k++, strip += NR) {
        __m256 w0 = _mm256_load_ps(strip), w1 = _mm256_load_ps(strip + 8);
        ROW_FMA(0) ROW_FMA(1) ROW_FMA(2) ROW_FMA(3) ROW_FMA(4) ROW_FMA(5)
    }
    ROW_STORE(0) ROW_STORE(1) ROW_STORE(2) ROW_STORE(3) ROW_STORE(4) ROW_STORE(5)
}

__attribute__((target("avx2,fma"))) static void tile_avx2(const float *x, size_t ldx, const float *strip,
                                                          int kc, float *y, size_t ldy, int from_y, int mr) {
    switch (mr) {
    case 1: tile_avx2_rows(x, ldx, strip, kc, y, ldy, from_y, 1); break;
    case 2: tile_avx2_rows(x, ldx, strip, kc, y, ldy, from_y, 2); break;
    case 3: tile_avx2_rows(x, ldx, strip, kc, y, ldy, from_y, 3); break;
    case 4: tile_avx2_rows(x, ldx, strip, kc, y, ldy, from_y, 4); break;
    case 5: tile_avx2_rows(x, ldx, strip, kc, y, ldy, from_y, 5); break;
    default: tile_avx2_rows(x, ldx, strip, kc, y, ldy, from_y, MR); break;
    }
}
#endif

/* A tile of y with nr <= 16 columns: a narrower one goes through a [mr][16] copy. */
static void tile(const float *x, size_t ldx, const float *strip, int kc, float *y, size_t ldy,
                 int from_y, int mr, int nr, int simd) {
    float narrow[MR * NR];
    float *t = nr < NR ? narrow : y;
    size_t ldt = nr < NR ? NR : ldy;
    for (int r = 0; r < mr && from_y && nr < NR; r++) memcpy(narrow + r * NR, y + r * ldy, nr * sizeof *y);
#ifdef HAVE_AVX2_PATH
    if (simd) tile_avx2(x, ldx, strip, kc, t, ldt, from_y, mr);
    else
#endif
        tile_portable(x, ldx, strip, kc, t, ldt, from_y, mr);
    (void)simd;
    for (int r = 0; r < mr && nr < NR; r++) memcpy(y + r * ldy, narrow + r * NR, nr * sizeof *y);
}

/* ============================================================================================
 * The products
 * ============================================================================================ */

/* Rows 0 .. rows of y, columns j0 .. j0 + nc (one column block), over all of k. */
static void product_block(const float *x, int rows, int in, const void *W, int q4, int out,
                          float *y, int accumulate, int j0, int nc, int simd) {
    _Alignas(64) float buf[(KC + 1) * NC]; /* strips a line apart: strip_at */
    panel P = {buf, KC};
    int tiles = (rows + MR - 1) / MR;
    for (int k0 = 0; k0 < in; k0 += KC) {
        int kc = in - k0 < KC ? in - k0 : KC;
        widen_block(W, q4, in, out, k0, kc, j0, nc, P, simd);
        for (int t = 0, r = 0; t < tiles; t++) {
            int mr = (rows - r + (tiles - t) - 1) / (tiles - t); /* as even as they go */
            for (int s = 0; s * NR < nc; s++) {
                int nr = nc - s * NR < NR ? nc - s * NR : NR;
                tile(x + (size_t)r * in + k0, (size_t)in, strip_at(P, s, 0), kc,
                     y + (size_t)r * out + j0 + s * NR, (size_t)out, accumulate || k0 > 0, mr, nr, simd);
            }
            r += mr;
        }
    }
}

/* Many rows: each thread takes a column panel of W, SGEMM_COLS wide, widens it to fp32 [in][cols]
 * in its part of scratch and calls sgemm on it (OpenBLAS runs one thread inside a parallel
 * region); threads take panels as they finish, which suits a machine shared with other work. */
enum { SGEMM_COLS = 1024 };

size_t matmul_scratch_floats(int in) { return (size_t)in * SGEMM_COLS; }

/* Prefill: a panel of SGEMM_COLS columns of W widened by every thread, then one sgemm on it
 * (OpenBLAS threads it). */
static void product_sgemm(const float *x, int rows, int in, const void *W, int q4, int out, float *y,
                          int accumulate, float *wide, int simd) {
    for (int j0 = 0; j0 < out; j0 += SGEMM_COLS) {
        int nc = out - j0 < SGEMM_COLS ? out - j0 : SGEMM_COLS;
#pragma omp parallel for schedule(static)
        for (int k = 0; k < in; k++)
            for (int c = 0; c < nc; c += Q4_GROUP) {
                int n = nc - c < Q4_GROUP ? nc - c : Q4_GROUP;
                float group[Q4_GROUP]; /* a group is widened whole, past out too */
                widen_group(W, q4, out, k, (j0 + c) / Q4_GROUP, n, group, simd);
                memcpy(wide + (size_t)k * nc + c, group, n * sizeof *group);
            }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, nc, in, 1.0f, x, in, wide, nc,
                    accumulate ? 1.0f : 0.0f, y + j0, out);
    }
}

void matmul_weights(const float *x, int rows, int in, const void *W, int q4, int out, float *y,
                    int accumulate, float *scratch) {
    int simd = use_simd();
    if (rows > MATMUL_DECODE_ROWS) {
        product_sgemm(x, rows, in, W, q4, out, y, accumulate, scratch, simd);
        return;
    }
#pragma omp parallel for schedule(dynamic)
    for (int j0 = 0; j0 < out; j0 += NC)
        product_block(x, rows, in, W, q4, out, y, accumulate, j0, out - j0 < NC ? out - j0 : NC, simd);
}

/* ---- lm_head: E read by rows ---- */

/* x . e over dim values in 8 lanes, added as AVX2's halving reduction adds them, then the tail. */
static float dot_portable(const float *x, const float *e, int dim) {
    float lane[8] = {0};
    int vec = dim / 8 * 8;
    for (int d = 0; d < vec; d += 8)
        for (int l = 0; l < 8; l++) lane[l] = fmaf(x[d + l], e[d + l], lane[l]);
    float s = ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
    for (int d = vec; d < dim; d++) s = fmaf(x[d], e[d], s);
    return s;
}

static void dots_portable(const float *x, int rows, int dim, const float *e, float *y, size_t ldy) {
    for (int r = 0; r < rows; r++) y[r * ldy] = dot_portable(x + (size_t)r * dim, e, dim);
}

#ifdef HAVE_AVX2_PATH
__attribute__((target("avx2,fma"))) static float lanes_sum(__m256 acc) {
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
    return _mm_cvtss_f32(s4);
}

/* Up to 4 rows of x against one row e at once: four independent chains. */
__attribute__((target("avx2,fma"), always_inline)) static inline void dots_avx2_rows(
    const float *x, int dim, const float *e, float *y, size_t ldy, const int n) {
    __m256 acc[4];
    int vec = dim / 8 * 8;
    for (int r = 0; r < n; r++) acc[r] = _mm256_setzero_ps();
    for (int d = 0; d < vec; d += 8) {
        __m256 ev = _mm256_loadu_ps(e + d);
        for (int r = 0; r < n; r++) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + (size_t)r * dim + d), ev, acc[r]);
    }
    for (int r = 0; r < n; r++) {
        float s = lanes_sum(acc[r]);
        for (int d = vec; d < dim; d++) s = fmaf(x[(size_t)r * dim + d], e[d], s);
        y[r * ldy] = s;
    }
}

__attribute__((target("avx2,fma"))) static void dots_avx2(const float *x, int rows, int dim,
                                                          const float *e, float *y, size_t ldy) {
    for (int r = 0; r < rows; r += 4) {
        const float *xr = x + (size_t)r * dim;
        switch (rows - r < 4 ? rows - r : 4) {
        case 1: dots_avx2_rows(xr, dim, e, y + r * ldy, ldy, 1); break;
        case 2: dots_avx2_rows(xr, dim, e, y + r * ldy, ldy, 2); break;
        case 3: dots_avx2_rows(xr, dim, e, y + r * ldy, ldy, 3); break;
        default: dots_avx2_rows(xr, dim, e, y + r * ldy, ldy, 4); break;
        }
    }
}
#endif

/* Row r of E widened (fp16_to_fp32 and q4 decoding are exact on every path). */
static void embed_row(const void *E, int q4, int n, int dim, int r, float *dst, int simd) {
    if (q4) {
        q4_decompress_row(E, (size_t)n, (size_t)dim, (size_t)r, dst);
    } else if (simd) {
        fp16_to_fp32_n((const fp16 *)E + (size_t)r * dim, dst, (size_t)dim);
    } else {
        const fp16 *row = (const fp16 *)E + (size_t)r * dim;
        for (int d = 0; d < dim; d++) dst[d] = fp16_to_fp32(row[d]);
    }
}

void matmul_embed_row(const void *E, int q4, int n, int dim, int r, float *dst) {
    embed_row(E, q4, n, dim, r, dst, use_simd());
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

void matmul_embed_t(const float *x, int rows, int dim, const void *E, int q4, int n, float *y,
                    float *scratch, size_t scratch_stride) {
    int simd = use_simd();
    if (rows > MATMUL_EMBED_DOT_ROWS) {
        embed_t_sgemm(x, rows, dim, E, q4, n, y, scratch, scratch_stride, simd);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int v = 0; v < n; v++) {
        float *e = scratch + scratch_stride * omp_get_thread_num();
        embed_row(E, q4, n, dim, v, e, simd);
#ifdef HAVE_AVX2_PATH
        if (simd) { dots_avx2(x, rows, dim, e, y + v, (size_t)n); continue; }
#endif
        dots_portable(x, rows, dim, e, y + v, (size_t)n);
    }
}
