/* support/onednn.c: the two products of the CPU's opt-in prefill schemes (int8.c's rows rounded
 * once, matmul.c's bf16), each on the fastest path this CPU and this build have that keeps its
 * promise:
 *
 *   gemm_s8     c[m][n] = sum_k a[m][k] b[k][n]    int8 operands (|b| <= b_max), int32 sums
 *                                                  (exact)
 *   gemm_bf16   c[m][n] = sum_k a[m][k] b[k][n]    bf16 operands, fp32 sums
 *
 * All three matrices are dense, row after row: oneDNN's fastest kernels (brgemm) take no gaps
 * between c's rows, so the callers write a panel's c contiguously and add it into y themselves.
 *
 * Prefill is bound by the CPU's arithmetic (§3's roofline: hundreds of rows of x per weight read).
 * oneDNN (Intel's deep-learning kernels, Debian's libdnnl-dev) picks the fastest instructions this
 * CPU has at run time: AMX tiles (Sapphire Rapids and later: int8 and bf16 products in 1 KiB
 * tiles), AVX-512 VNNI or BF16, AVX2. Its kernels want W in a blocked layout of their own, so each
 * call reorders b into it (one pass over the panel; prefill reuses it for every row of a), unless
 * b was kept in that layout once (gemm_s8_keep: W's int8 columns made with the weights, which
 * gemm_s8_with_kept then reads as they are).
 * docs/DESIGN.md ("Prefill's products on a library") says why a library, not AMX by hand.
 *
 * Not every kernel oneDNN 2.6 picks keeps the promise, so each shape's choice is read
 * (dnnl_query_impl_info_str) before it runs:
 *   int8   a is made unsigned, a + 128 (the instructions take unsigned x signed bytes), and
 *          128 sum_k b taken off at the end (unsigned_product). VNNI's vpdpbusd and AMX's tiles
 *          sum the products in int32, exactly; without them (AVX2, AVX-512 without VNNI:
 *          "gemm:jit") vpmaddubsw sums each pair of products in int16 and saturates, and
 *          (a + 128) b pairs reach 2 x 255 x 127 = 64770: most sums of full-range operands come
 *          out wrong. With |b| <= 64 (b_max: the prefill scheme's W in 7 bits) a pair stays
 *          within 2 x 255 x 64 = 32640, int16's range, and those kernels are exact too. So a
 *          kernel whose name says VNNI or AMX ("brg:avx512_core_vnni",
 *          "brg:avx512_core_amx_int8") runs for any b, any other for b_max <= 64 alone;
 *          otherwise gemm_s8_pairs below, this file's exact AVX2 kernel, and where the CPU has
 *          no AVX2 (or FLEXGEN_ISA=portable) the plain loops.
 *   bf16   oneDNN has no bf16 product without AVX-512 (it answers "unimplemented"). Then a and b
 *          are widened to fp32 (exactly) and OpenBLAS's sgemm sums the same products in fp32
 *          (without memory for the widened copies, the plain loops), with one line on stderr
 *          the first time.
 * A failure of oneDNN (an error status, or no memory for its copy of b) takes the same way round,
 * with one line on stderr the first time: nothing here ends the process. gemm_path names the path
 * the last product took.
 *
 * The plain loops beside them are the references the tests hold every path to: gemm_s8's sums are
 * integers, so every path gives the same bits; gemm_bf16's fp32 sums may be added in any order,
 * so the tests hold it to the bound of that order. A build without oneDNN (FLEXGEN_ONEDNN unset:
 * no libdnnl-dev where it was built) runs gemm_s8_pairs (the same int8 bits) and the sgemm.
 */
#include "support/support.h"
#include "support/tools.h"

#include <cblas.h>
#ifdef FLEXGEN_ONEDNN
#include <oneapi/dnnl/dnnl.h>
#endif
#include <omp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_AVX2_PAIRS 1
#endif

/* ---- The references ---- */

void gemm_s8_reference(int m, int n, int k, const int8_t *a, const int8_t *b, int32_t *c) {
#pragma omp parallel for schedule(static)
    for (int i = 0; i < m; i++) {
        int32_t *row = c + (size_t)i * n;
        memset(row, 0, (size_t)n * sizeof *row);
        for (int p = 0; p < k; p++) {
            int32_t av = a[(size_t)i * k + p];
            const int8_t *brow = b + (size_t)p * n;
            for (int j = 0; j < n; j++) row[j] += av * brow[j];
        }
    }
}

void gemm_bf16_reference(int m, int n, int k, const uint16_t *a, const uint16_t *b, float *c) {
#pragma omp parallel for schedule(static)
    for (int i = 0; i < m; i++) {
        float *row = c + (size_t)i * n;
        memset(row, 0, (size_t)n * sizeof *row);
        for (int p = 0; p < k; p++) {
            float av = bf16_to_fp32(a[(size_t)i * k + p]);
            const uint16_t *brow = b + (size_t)p * n;
            for (int j = 0; j < n; j++) row[j] += av * bf16_to_fp32(brow[j]);
        }
    }
}

/* ============================================================================================
 * gemm_s8_pairs: int8 sums on AVX2, exact
 *
 * vpmaddwd multiplies 16 int16 by 16 int16 and adds each pair of neighbouring products into an
 * int32: |a b + a' b'| <= 2 x 128 x 128 = 2^15, no saturation and no rounding. So int8 widened to
 * int16 makes exact pairs along k: row i of a widened as it is (a[i][2p], a[i][2p + 1] is one
 * int32, broadcast), rows 2p and 2p + 1 of b interleaved column by column and widened, once a
 * call, into strips of 16 columns, each [k / 2][16][2] (an odd k ends on a pair with a 0).
 *
 *   register tile   4 rows x 16 columns of c: 8 accumulators of 8 int32, 2 vectors of b, a
 *                   broadcast and each vpmaddwd's result, 12 of AVX2's 16 registers. A pair of
 *                   k: 2 loads of b, 4 broadcasts, 8 vpmaddwd and 8 vpaddd (half the
 *                   multiply-adds an instruction of vpmaddubsw's, the price of exact sums). 6
 *                   rows would need all 16 registers, and GCC spills some of them to the stack
 *                   where the tile is inlined; 4 rows ran faster here.
 *   blocks          each thread owns tiles of PAIRS_RB rows x PAIRS_CB columns of c. For each
 *                   block of PAIRS_KC of k it widens the tile's rows of a (96 KiB, in L2), then
 *                   runs every block of 4 rows against one strip's pairs (16 KiB, in L1) before
 *                   the next strip. The tile's c gathers the blocks' sums.
 *
 * Integers add exactly in any order, so every blocking and thread count gives the plain loops'
 * bits (tests/test_matmul.c holds it to them, operands of -128 and 127 included).
 * ============================================================================================ */

enum { PAIRS_MR = 4, PAIRS_NR = 16, PAIRS_KC = 512, PAIRS_RB = 96, PAIRS_CB = 128 };

/* b packed, and each thread's widened rows of a: kept from call to call (prefill's shapes
 * repeat). */
static struct {
    pthread_mutex_t lock;
    void *buffer;
    size_t cap;
} pairs_scratch = {.lock = PTHREAD_MUTEX_INITIALIZER};

#ifdef HAVE_AVX2_PAIRS

/* Columns j0 .. j0 + 16 of b (zeros past n) as pairs: out[p][j][2] = b[2p][j], b[2p + 1][j]. */
__attribute__((target("avx2"))) static void pack_strip(const int8_t *b, int n, int k, int j0,
                                                       int16_t *out) {
    int cols = n - j0 < PAIRS_NR ? n - j0 : PAIRS_NR;
    for (int p = 0; 2 * p < k; p++) {
        _Alignas(16) int8_t even[PAIRS_NR] = {0}, odd[PAIRS_NR] = {0};
        memcpy(even, b + (size_t)(2 * p) * n + j0, (size_t)cols);
        if (2 * p + 1 < k) memcpy(odd, b + (size_t)(2 * p + 1) * n + j0, (size_t)cols);
        __m128i e = _mm_load_si128((const __m128i *)even), o = _mm_load_si128((const __m128i *)odd);
        _mm256_store_si256((__m256i *)(out + (size_t)p * 32),
                           _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(e, o)));
        _mm256_store_si256((__m256i *)(out + (size_t)p * 32 + 16),
                           _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(e, o)));
    }
}

/* rows rows of a, columns k0 .. k0 + kc, widened to int16 [rows rounded up to PAIRS_MR][PAIRS_KC]
 * (an odd kc padded with a 0, the rows past rows zeros). */
__attribute__((target("avx2"))) static void widen_rows_of_a(const int8_t *a, int k, int rows,
                                                            int k0, int kc, int16_t *a16) {
    int kc_even = (kc + 1) / 2 * 2, padded = (rows + PAIRS_MR - 1) / PAIRS_MR * PAIRS_MR;
    for (int r = 0; r < padded; r++) {
        int16_t *out = a16 + (size_t)r * PAIRS_KC;
        if (r >= rows) {
            memset(out, 0, (size_t)kc_even * sizeof *out);
            continue;
        }
        const int8_t *in = a + (size_t)r * k + k0;
        int q = 0;
        for (; q + 16 <= kc; q += 16)
            _mm256_storeu_si256((__m256i *)(out + q),
                                _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(in + q))));
        for (; q < kc; q++) out[q] = in[q];
        if (kc < kc_even) out[kc] = 0;
    }
}

static inline int32_t pair_at(const int16_t *row, int p) {
    int32_t pair;
    memcpy(&pair, row + 2 * p, sizeof pair);
    return pair;
}

/* The 4 x 16 register tile over pairs pairs: tile = a16's 4 rows (PAIRS_KC apart) times strip. */
__attribute__((target("avx2"), noinline)) static void tile_pairs(const int16_t *a16,
                                                                 const int16_t *strip, int pairs,
                                                                 int32_t tile[PAIRS_MR][PAIRS_NR]) {
    __m256i c00 = _mm256_setzero_si256(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
            c30 = c00, c31 = c00;
    const int16_t *a0 = a16, *a1 = a0 + PAIRS_KC, *a2 = a1 + PAIRS_KC, *a3 = a2 + PAIRS_KC;
    for (int p = 0; p < pairs; p++) {
        __m256i b0 = _mm256_load_si256((const __m256i *)(strip + (size_t)p * 32));
        __m256i b1 = _mm256_load_si256((const __m256i *)(strip + (size_t)p * 32 + 16));
        __m256i av = _mm256_set1_epi32(pair_at(a0, p));
        c00 = _mm256_add_epi32(c00, _mm256_madd_epi16(av, b0));
        c01 = _mm256_add_epi32(c01, _mm256_madd_epi16(av, b1));
        av = _mm256_set1_epi32(pair_at(a1, p));
        c10 = _mm256_add_epi32(c10, _mm256_madd_epi16(av, b0));
        c11 = _mm256_add_epi32(c11, _mm256_madd_epi16(av, b1));
        av = _mm256_set1_epi32(pair_at(a2, p));
        c20 = _mm256_add_epi32(c20, _mm256_madd_epi16(av, b0));
        c21 = _mm256_add_epi32(c21, _mm256_madd_epi16(av, b1));
        av = _mm256_set1_epi32(pair_at(a3, p));
        c30 = _mm256_add_epi32(c30, _mm256_madd_epi16(av, b0));
        c31 = _mm256_add_epi32(c31, _mm256_madd_epi16(av, b1));
    }
    __m256i *t = (__m256i *)tile;
    _mm256_store_si256(t + 0, c00);
    _mm256_store_si256(t + 1, c01);
    _mm256_store_si256(t + 2, c10);
    _mm256_store_si256(t + 3, c11);
    _mm256_store_si256(t + 4, c20);
    _mm256_store_si256(t + 5, c21);
    _mm256_store_si256(t + 6, c30);
    _mm256_store_si256(t + 7, c31);
}

/* c's tile of rows i0 .. i0 + rows, columns j0 .. j0 + cols (j0 a multiple of 16), over all of
 * k. */
__attribute__((target("avx2"))) static void tile_of_c(int n, int k, const int8_t *a,
                                                      const int16_t *b_pairs, int i0, int rows,
                                                      int j0, int cols, int16_t *a16, int32_t *c) {
    int k_pairs = (k + 1) / 2;
    for (int k0 = 0; k0 < k; k0 += PAIRS_KC) {
        int kc = k - k0 < PAIRS_KC ? k - k0 : PAIRS_KC;
        widen_rows_of_a(a + (size_t)i0 * k, k, rows, k0, kc, a16);
        for (int j = j0; j < j0 + cols; j += PAIRS_NR) {
            const int16_t *strip =
                b_pairs + (size_t)(j / PAIRS_NR) * k_pairs * 32 + (size_t)(k0 / 2) * 32;
            int nr = j0 + cols - j < PAIRS_NR ? j0 + cols - j : PAIRS_NR;
            for (int r = 0; r < rows; r += PAIRS_MR) {
                _Alignas(32) int32_t tile[PAIRS_MR][PAIRS_NR];
                tile_pairs(a16 + (size_t)r * PAIRS_KC, strip, (kc + 1) / 2, tile);
                int mr = rows - r < PAIRS_MR ? rows - r : PAIRS_MR;
                for (int t = 0; t < mr; t++) {
                    int32_t *row = c + (size_t)(i0 + r + t) * n + j;
                    if (nr == PAIRS_NR && k0 > 0) {
                        __m256i *v = (__m256i *)row, *w = (__m256i *)tile[t];
                        _mm256_storeu_si256(
                            v, _mm256_add_epi32(_mm256_loadu_si256(v), _mm256_load_si256(w)));
                        _mm256_storeu_si256(v + 1, _mm256_add_epi32(_mm256_loadu_si256(v + 1),
                                                                    _mm256_load_si256(w + 1)));
                    } else if (k0 > 0) {
                        for (int q = 0; q < nr; q++) row[q] += tile[t][q];
                    } else {
                        memcpy(row, tile[t], (size_t)nr * sizeof *row);
                    }
                }
            }
        }
    }
}

int gemm_s8_pairs(int m, int n, int k, const int8_t *a, const int8_t *b, int32_t *c) {
    /* fg_isa_of_cpu caches its answer: cpuid is slow in a VM, and this runs once a panel */
    if (fg_isa_of_cpu() < FG_ISA_AVX2) return -1;
    if (m <= 0 || n <= 0) return 0;
    if (k <= 0) {
        memset(c, 0, (size_t)m * n * sizeof *c);
        return 0;
    }
    int strips = (n + PAIRS_NR - 1) / PAIRS_NR, k_pairs = (k + 1) / 2,
        threads = omp_get_max_threads();
    size_t b_bytes = (size_t)strips * k_pairs * 32 * sizeof(int16_t);
    size_t a_bytes = (size_t)PAIRS_RB * PAIRS_KC * sizeof(int16_t); /* a thread's widened rows */
    size_t bytes = b_bytes + (size_t)threads * a_bytes;
    pthread_mutex_lock(&pairs_scratch.lock);
    if (bytes > pairs_scratch.cap) {
        free(pairs_scratch.buffer);
        pairs_scratch.buffer = aligned_alloc(64, (bytes + 63) / 64 * 64);
        pairs_scratch.cap = pairs_scratch.buffer ? bytes : 0;
        if (!pairs_scratch.buffer) {
            pthread_mutex_unlock(&pairs_scratch.lock);
            return -1;
        }
    }
    int16_t *b_pairs = pairs_scratch.buffer;
    char *a_rows = (char *)pairs_scratch.buffer + b_bytes;
#pragma omp parallel for schedule(static)
    for (int s = 0; s < strips; s++)
        pack_strip(b, n, k, s * PAIRS_NR, b_pairs + (size_t)s * k_pairs * 32);
    int row_tiles = (m + PAIRS_RB - 1) / PAIRS_RB, col_tiles = (n + PAIRS_CB - 1) / PAIRS_CB;
#pragma omp parallel num_threads(threads)
    {
        int16_t *a16 = (int16_t *)(a_rows + (size_t)omp_get_thread_num() * a_bytes);
#pragma omp for collapse(2) schedule(static)
        for (int rt = 0; rt < row_tiles; rt++)
            for (int ct = 0; ct < col_tiles; ct++) {
                int i0 = rt * PAIRS_RB, j0 = ct * PAIRS_CB;
                tile_of_c(n, k, a, b_pairs, i0, m - i0 < PAIRS_RB ? m - i0 : PAIRS_RB, j0,
                          n - j0 < PAIRS_CB ? n - j0 : PAIRS_CB, a16, c);
            }
    }
    pthread_mutex_unlock(&pairs_scratch.lock);
    return 0;
}

#else

int gemm_s8_pairs(int m, int n, int k, const int8_t *a, const int8_t *b, int32_t *c) {
    (void)m;
    (void)n;
    (void)k;
    (void)a;
    (void)b;
    (void)c;
    return -1;
}

#endif

/* ============================================================================================
 * gemm_bf16 without a bf16 product: the operands widened to fp32 (bf16 is fp32's top half, so
 * exactly), then OpenBLAS's sgemm. Each product of two 8-bit significands is exact in fp32, so
 * this is a bf16 product's result, its fp32 sums in OpenBLAS's order.
 * ============================================================================================ */

static struct {
    void *a, *b; /* float */
    size_t a_cap, b_cap;
} wide_operands;

/* *at holding at least bytes (cap: what it holds), or NULL without memory; on whole cache lines
 * (line_alloc), where oneDNN's int8 product of opt-1.3b's shapes ran 1.25x faster than on
 * malloc's 16-byte alignment. */
static void *grown(void **at, size_t *cap, size_t bytes) {
    if (bytes <= *cap) return *at;
    free(*at);
    *at = line_alloc(bytes);
    *cap = *at ? bytes : 0;
    return *at;
}

static void widen_bf16(const uint16_t *src, float *dst, size_t n) {
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        uint32_t bits = (uint32_t)src[i] << 16;
        memcpy(dst + i, &bits, sizeof bits);
    }
}

/* 0, or -1 without memory for the widened operands (the caller holds products.lock). */
static int gemm_bf16_sgemm(int m, int n, int k, const uint16_t *a, const uint16_t *b, float *c) {
    float *a32 = grown(&wide_operands.a, &wide_operands.a_cap, (size_t)m * k * sizeof(float));
    float *b32 = grown(&wide_operands.b, &wide_operands.b_cap, (size_t)k * n * sizeof(float));
    if (!a32 || !b32) return -1;
    widen_bf16(a, a32, (size_t)m * k);
    widen_bf16(b, b32, (size_t)k * n);
    sgemm_fixed_tiles(m, n, k, a32, k, b32, n, 0, c, n);
    return 0;
}

/* ============================================================================================
 * oneDNN's matmul, where the build has it: 0 when it ran the product, else why not
 * ============================================================================================ */

/* sums128[j] = 128 sum_k b[k][j]: what an int8 product of unsigned a (a + 128) takes off c. */
static void column_sums128(int n, int k, const int8_t *b, int32_t *sums128) {
#pragma omp parallel for schedule(static)
    for (int j0 = 0; j0 < n; j0 += 64) {
        int nj = n - j0 < 64 ? n - j0 : 64;
        int32_t sums[64] = {0};
        for (int kk = 0; kk < k; kk++) {
            const int8_t *row = b + (size_t)kk * n + j0;
#pragma omp simd
            for (int j = 0; j < nj; j++) sums[j] += row[j];
        }
        for (int j = 0; j < nj; j++) sums128[j0 + j] = 128 * sums[j];
    }
}

enum { ONEDNN_RAN, ONEDNN_NONE, ONEDNN_FAILED }; /* none: no kernel that keeps the promise */

static struct {
    pthread_mutex_t lock; /* one product at a time: the scratch, the plans and the paths */
    char path[2][96];     /* what the last product ran on, int8 and bf16 */
    int told[2];          /* the fallback's line printed, int8 and bf16 */
} products = {.lock = PTHREAD_MUTEX_INITIALIZER, .path = {"none ran", "none ran"}};

/* b kept for many products (gemm_s8_keep): in oneDNN's layout for its kernel, with 128 sum_k b,
 * or, where oneDNN has no kernel for it, as it is. */
struct gemm_s8_kept {
    int n, k, b_max;
    void *blocked;    /* oneDNN's layout, or NULL */
    int32_t *sums128; /* [n]: 128 sum_k b[k][j], beside blocked */
    int8_t *plain;    /* [k][n], where not blocked */
    size_t bytes;     /* of the copies */
#ifdef FLEXGEN_ONEDNN
    dnnl_memory_desc_t layout; /* blocked's */
#endif
};

#ifndef FLEXGEN_ONEDNN

static int onednn_product(int bf16, int m, int n, int k, const void *a, const void *b, int b_max,
                          void *c, char *why, size_t why_len) {
    (void)bf16;
    (void)b_max;
    (void)m;
    (void)n;
    (void)k;
    (void)a;
    (void)b;
    (void)c;
    snprintf(why, why_len, "this build has no oneDNN");
    return ONEDNN_NONE;
}

static int unsigned_product(int m, int n, int k, const int8_t *a, const int8_t *b, int b_max,
                            int32_t *c, char *why, size_t why_len) {
    return onednn_product(0, m, n, k, a, b, b_max, c, why, why_len);
}

static void onednn_keep(gemm_s8_kept *kept, const int8_t *b) {
    (void)kept;
    (void)b;
}

static int onednn_kept_product(int m, const int8_t *a, const gemm_s8_kept *b, int32_t *c) {
    (void)m;
    (void)a;
    (void)b;
    (void)c;
    return ONEDNN_NONE;
}

#else

/* One shape's primitives: the product, and the reorder of b into the product's layout; or, where
 * oneDNN has no kernel for it, nothing (status). */
typedef struct {
    int used, bf16, m, n, k;
    int kept;             /* b comes in a kept layout (gemm_s8_keep's), not reordered per call */
    dnnl_status_t status; /* dnnl_success, or what oneDNN answered */
    const char *failed;   /* the step that answered it */
    int int16_pairs;      /* the int8 kernel sums pairs of products in int16 (no VNNI, no AMX) */
    char impl[64];        /* oneDNN's name for the kernel */
    dnnl_primitive_t product, reorder;
    dnnl_memory_desc_t a_md, b_md, b_blocked_md, c_md;
    size_t b_blocked_bytes;
} gemm_plan;

enum {
    N_PLANS = 32
}; /* prefill's shapes: 4 to 6 products a layer, times a full and a last batch, with b
        reordered per call or kept */

static struct {
    dnnl_engine_t engine;
    dnnl_stream_t stream;
    dnnl_status_t engine_status;
    gemm_plan plans[N_PLANS];
    int next_evicted;
    void *b_blocked; /* the reordered b, shared by the plans (one call at a time) */
    size_t b_blocked_cap;
} dnnl;

static dnnl_status_t engine_once(void) {
    if (dnnl.engine || dnnl.engine_status != dnnl_success) return dnnl.engine_status;
    dnnl_status_t status = dnnl_engine_create(&dnnl.engine, dnnl_cpu, 0);
    if (status == dnnl_success)
        status = dnnl_stream_create(&dnnl.stream, dnnl.engine, dnnl_stream_default_flags);
    if (status != dnnl_success && dnnl.engine) dnnl_engine_destroy(dnnl.engine);
    if (status != dnnl_success) dnnl.engine = NULL;
    dnnl.engine_status = status;
    return status;
}

static void plan_free(gemm_plan *p) {
    if (p->product) dnnl_primitive_destroy(p->product);
    if (p->reorder) dnnl_primitive_destroy(p->reorder);
    memset(p, 0, sizeof *p);
}

/* Records a failed step in p: 1 if status is one. */
static int failed(gemm_plan *p, dnnl_status_t status, const char *step) {
    if (status == dnnl_success) return 0;
    p->status = status;
    p->failed = step;
    return 1;
}

/* The product's primitive for this shape, b's layout left to oneDNN ("any") or, for b kept in a
 * layout (b_kept), that one; and the reorder from plain [k][n] into it. */
static void plan_make(gemm_plan *p, int bf16, int m, int n, int k,
                      const dnnl_memory_desc_t *b_kept) {
    /* int8: a unsigned (a + 128, unsigned_product below), b signed */
    dnnl_data_type_t a_in = bf16 ? dnnl_bf16 : dnnl_u8, in = bf16 ? dnnl_bf16 : dnnl_s8;
    dnnl_data_type_t out = bf16 ? dnnl_f32 : dnnl_s32;
    dnnl_dims_t a_dims = {m, k}, b_dims = {k, n}, c_dims = {m, n};
    dnnl_memory_desc_t b_any;
    dnnl_matmul_desc_t desc;
    dnnl_primitive_desc_t product_pd = NULL, reorder_pd = NULL;
    *p = (gemm_plan){.used = 1, .bf16 = bf16, .m = m, .n = n, .k = k, .kept = b_kept != NULL};
    if (failed(p, dnnl_memory_desc_init_by_tag(&p->a_md, 2, a_dims, a_in, dnnl_ab), "a") ||
        failed(p, dnnl_memory_desc_init_by_tag(&p->b_md, 2, b_dims, in, dnnl_ab), "b") ||
        failed(p, dnnl_memory_desc_init_by_tag(&b_any, 2, b_dims, in, dnnl_format_tag_any),
               "b, any layout") ||
        failed(p, dnnl_memory_desc_init_by_tag(&p->c_md, 2, c_dims, out, dnnl_ab), "c") ||
        failed(p, dnnl_matmul_desc_init(&desc, &p->a_md, b_kept ? b_kept : &b_any, NULL, &p->c_md),
               "matmul") ||
        failed(p, dnnl_primitive_desc_create(&product_pd, &desc, NULL, dnnl.engine, NULL),
               "matmul"))
        return;
    const char *impl = "";
    dnnl_primitive_desc_query(product_pd, dnnl_query_impl_info_str, 0, &impl);
    snprintf(p->impl, sizeof p->impl, "%s", impl ? impl : "");
    /* int8: VNNI's and AMX's sums are int32; the others sum pairs in int16 (top comment) */
    p->int16_pairs = !bf16 && !strstr(p->impl, "vnni") && !strstr(p->impl, "amx");
    p->b_blocked_md = *dnnl_primitive_desc_query_md(product_pd, dnnl_query_weights_md, 0);
    p->b_blocked_bytes = dnnl_memory_desc_get_size(&p->b_blocked_md);
    if (!failed(p, dnnl_primitive_create(&p->product, product_pd), "matmul") &&
        !failed(p,
                dnnl_reorder_primitive_desc_create(&reorder_pd, &p->b_md, dnnl.engine,
                                                   &p->b_blocked_md, dnnl.engine, NULL),
                "reorder"))
        failed(p, dnnl_primitive_create(&p->reorder, reorder_pd), "reorder");
    dnnl_primitive_desc_destroy(product_pd);
    if (reorder_pd) dnnl_primitive_desc_destroy(reorder_pd);
}

/* The plan of this shape (and b's kept layout, or none): kept, or made in the place of the
 * oldest. */
static gemm_plan *plan_for(int bf16, int m, int n, int k, const dnnl_memory_desc_t *b_kept) {
    for (int i = 0; i < N_PLANS; i++) {
        gemm_plan *p = &dnnl.plans[i];
        if (p->used && p->bf16 == bf16 && p->m == m && p->n == n && p->k == k &&
            p->kept == (b_kept != NULL) &&
            (!b_kept || dnnl_memory_desc_equal(&p->b_blocked_md, b_kept)))
            return p;
    }
    gemm_plan *p = &dnnl.plans[dnnl.next_evicted];
    dnnl.next_evicted = (dnnl.next_evicted + 1) % N_PLANS;
    plan_free(p);
    plan_make(p, bf16, m, n, k, b_kept);
    return p;
}

static dnnl_status_t memory_at(dnnl_memory_t *mem, const dnnl_memory_desc_t *md, const void *at) {
    return dnnl_memory_create(mem, md, dnnl.engine, (void *)at);
}

/* Whether plan p runs a product of b up to b_max: 1, or 0 with why (ONEDNN_NONE or _FAILED in
 * *verdict). */
static int plan_runs(const gemm_plan *p, int b_max, int *verdict, char *why, size_t why_len) {
    *verdict = ONEDNN_NONE;
    if (p->status == dnnl_unimplemented) {
        const char *cap = getenv("ONEDNN_MAX_CPU_ISA");
        if (cap && *cap)
            snprintf(why, why_len, "oneDNN held to ONEDNN_MAX_CPU_ISA=%.40s has no %s product", cap,
                     p->bf16 ? "bf16" : "int8");
        else
            snprintf(why, why_len, "this CPU has no %s product in oneDNN",
                     p->bf16 ? "bf16" : "int8");
        return 0;
    }
    /* a kernel that would saturate is no failure of oneDNN's: it is not for this b */
    if (p->int16_pairs && 2 * 255 * b_max > INT16_MAX) {
        snprintf(why, why_len, "oneDNN's %s saturates int8 sums of |b| up to %d", p->impl, b_max);
        return 0;
    }
    if (p->status != dnnl_success) {
        snprintf(why, why_len, "oneDNN failed (%s: status %d)", p->failed, (int)p->status);
        *verdict = ONEDNN_FAILED;
        return 0;
    }
    return 1;
}

/* b (plain [k][n]) into b_blocked, in the plan's layout. */
static dnnl_status_t reorder_b(const gemm_plan *p, const void *b, void *b_blocked) {
    dnnl_memory_t b_mem = NULL, blocked_mem = NULL;
    dnnl_status_t status = memory_at(&b_mem, &p->b_md, b);
    if (status == dnnl_success) status = memory_at(&blocked_mem, &p->b_blocked_md, b_blocked);
    if (status == dnnl_success) {
        dnnl_exec_arg_t args[2] = {{DNNL_ARG_FROM, b_mem}, {DNNL_ARG_TO, blocked_mem}};
        status = dnnl_primitive_execute(p->reorder, dnnl.stream, 2, args);
    }
    if (status == dnnl_success) status = dnnl_stream_wait(dnnl.stream);
    dnnl_memory_destroy(b_mem); /* NULL where not made: oneDNN takes it */
    dnnl_memory_destroy(blocked_mem);
    return status;
}

/* c = a b, b in the plan's layout. */
static dnnl_status_t run_plan(const gemm_plan *p, const void *a, const void *b_blocked, void *c) {
    dnnl_memory_t a_mem = NULL, blocked_mem = NULL, c_mem = NULL;
    dnnl_status_t status = memory_at(&a_mem, &p->a_md, a);
    if (status == dnnl_success) status = memory_at(&blocked_mem, &p->b_blocked_md, b_blocked);
    if (status == dnnl_success) status = memory_at(&c_mem, &p->c_md, c);
    if (status == dnnl_success) {
        dnnl_exec_arg_t args[3] = {
            {DNNL_ARG_SRC, a_mem}, {DNNL_ARG_WEIGHTS, blocked_mem}, {DNNL_ARG_DST, c_mem}};
        status = dnnl_primitive_execute(p->product, dnnl.stream, 3, args);
    }
    if (status == dnnl_success) status = dnnl_stream_wait(dnnl.stream);
    dnnl_memory_destroy(a_mem);
    dnnl_memory_destroy(blocked_mem);
    dnnl_memory_destroy(c_mem);
    return status;
}

/* b reordered into the plan's layout, then c = a b (the caller holds products.lock). */
static int onednn_product(int bf16, int m, int n, int k, const void *a, const void *b, int b_max,
                          void *c, char *why, size_t why_len) {
    dnnl_status_t status = engine_once();
    if (status != dnnl_success) {
        snprintf(why, why_len, "oneDNN failed (engine: status %d)", (int)status);
        return ONEDNN_FAILED;
    }
    gemm_plan *p = plan_for(bf16, m, n, k, NULL);
    int verdict;
    if (!plan_runs(p, b_max, &verdict, why, why_len)) return verdict;
    if (p->b_blocked_bytes > dnnl.b_blocked_cap) {
        free(dnnl.b_blocked);
        dnnl.b_blocked = line_alloc(p->b_blocked_bytes);
        dnnl.b_blocked_cap = dnnl.b_blocked ? p->b_blocked_bytes : 0;
        if (!dnnl.b_blocked) {
            snprintf(why, why_len, "no memory for oneDNN's copy of the weights (%s)",
                     human((double)p->b_blocked_bytes).s);
            return ONEDNN_FAILED;
        }
    }
    const char *step = "reorder";
    status = reorder_b(p, b, dnnl.b_blocked);
    if (status == dnnl_success) {
        step = "matmul";
        status = run_plan(p, a, dnnl.b_blocked, c);
    }
    if (status != dnnl_success) {
        snprintf(why, why_len, "oneDNN failed (%s: status %d)", step, (int)status);
        return ONEDNN_FAILED;
    }
    snprintf(products.path[bf16], sizeof products.path[bf16], "onednn %s", p->impl);
    return ONEDNN_RAN;
}

/* The int8 product on oneDNN with a made unsigned here: c = (a + 128) b - 128 sum_k b[k][j].
 * Given signed a, oneDNN 2.6's AVX2 kernel ("gemm:jit") makes the same copy of a one byte at a time
 * and takes the column sums off c one element at a time through a call each, plain loops that
 * were a tenth of a prefill's time on AVX2; here both are loops the compiler vectorizes. The sums
 * are the same integers (every step is exact in int32: |c| <= k 255 64). */
static struct {
    void *a, *b_sums; /* uint8_t, int32_t */
    size_t a_cap, b_sums_cap;
} unsigned_a;

/* a + 128, in unsigned_a.a: NULL without memory. */
static const uint8_t *a_made_unsigned(int m, int k, const int8_t *a) {
    size_t a_bytes = (size_t)m * k;
    uint8_t *a_unsigned = grown(&unsigned_a.a, &unsigned_a.a_cap, a_bytes);
    if (!a_unsigned) return NULL;
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < a_bytes; i++) a_unsigned[i] = (uint8_t)(a[i] + 128);
    return a_unsigned;
}

/* c[i][j] -= sums128[j]. */
static void take_off_sums(int m, int n, const int32_t *sums128, int32_t *c) {
#pragma omp parallel for schedule(static)
    for (int i = 0; i < m; i++) {
        int32_t *row = c + (size_t)i * n;
#pragma omp simd
        for (int j = 0; j < n; j++) row[j] -= sums128[j];
    }
}

static int unsigned_product(int m, int n, int k, const int8_t *a, const int8_t *b, int b_max,
                            int32_t *c, char *why, size_t why_len) {
    const uint8_t *a_unsigned = a_made_unsigned(m, k, a);
    int32_t *sums128 =
        grown(&unsigned_a.b_sums, &unsigned_a.b_sums_cap, (size_t)n * sizeof(int32_t));
    if (!a_unsigned || !sums128) {
        snprintf(why, why_len, "no memory for the unsigned copy of a (%s)", human((double)m * k).s);
        return ONEDNN_FAILED;
    }
    int ran = onednn_product(0, m, n, k, a_unsigned, b, b_max, c, why, why_len);
    if (ran != ONEDNN_RAN) return ran;
    column_sums128(n, k, b, sums128);
    take_off_sums(m, n, sums128, c);
    return ONEDNN_RAN;
}

/* kept->blocked: b in the layout of oneDNN's int8 kernel for about KEEP_ROWS rows of a (prefill's
 * products: hundreds); NULL where oneDNN has no kernel for it. */
enum { KEEP_ROWS = 256 };

static void onednn_keep(gemm_s8_kept *kept, const int8_t *b) {
    if (engine_once() != dnnl_success) return;
    gemm_plan *p = plan_for(0, KEEP_ROWS, kept->n, kept->k, NULL);
    int verdict;
    char why[160];
    if (!plan_runs(p, kept->b_max, &verdict, why, sizeof why)) return;
    kept->blocked = line_alloc(p->b_blocked_bytes);
    if (kept->blocked && reorder_b(p, b, kept->blocked) != dnnl_success) {
        free(kept->blocked);
        kept->blocked = NULL;
    }
    kept->layout = p->b_blocked_md;
    kept->bytes = kept->blocked ? p->b_blocked_bytes : 0;
}

/* c = a b with b kept in its layout: ONEDNN_RAN, or why not (no kernel for this m in that
 * layout). */
static int onednn_kept_product(int m, const int8_t *a, const gemm_s8_kept *b, int32_t *c) {
    gemm_plan *p = plan_for(0, m, b->n, b->k, &b->layout);
    int verdict;
    char why[160];
    if (!plan_runs(p, b->b_max, &verdict, why, sizeof why)) return verdict;
    const uint8_t *a_unsigned = a_made_unsigned(m, b->k, a);
    if (!a_unsigned || run_plan(p, a_unsigned, b->blocked, c) != dnnl_success) return ONEDNN_FAILED;
    take_off_sums(m, b->n, b->sums128, c);
    snprintf(products.path[0], sizeof products.path[0], "onednn %s, W kept", p->impl);
    return ONEDNN_RAN;
}
#endif

/* ============================================================================================
 * The products: oneDNN where it keeps the promise, else this file's paths
 * ============================================================================================ */

void gemm_s8(int m, int n, int k, const int8_t *a, const int8_t *b, int b_max, int32_t *c) {
    char why[160];
    pthread_mutex_lock(&products.lock);
    int ran = unsigned_product(m, n, k, a, b, b_max, c, why, sizeof why);
    if (ran != ONEDNN_RAN) {
        /* the AVX2 kernel where the CPU's kernels may use AVX2 (not FLEXGEN_ISA=portable) */
        int pairs = fg_cpu_has_avx2() && gemm_s8_pairs(m, n, k, a, b, c) == 0;
        if (!pairs) gemm_s8_reference(m, n, k, a, b, c);
        snprintf(products.path[0], sizeof products.path[0], "%s",
                 pairs ? "avx2 (exact int16 pairs)" : "portable");
        /* a kernel that saturates, or none at all, is no news: the sums are the same integers */
        if (ran == ONEDNN_FAILED && !products.told[0])
            fprintf(stderr, "flexgen: --int8-activations: %s; using %s\n", why, products.path[0]);
        products.told[0] |= ran == ONEDNN_FAILED;
    }
    pthread_mutex_unlock(&products.lock);
}

gemm_s8_kept *gemm_s8_keep(int n, int k, const int8_t *b, int b_max) {
    gemm_s8_kept *kept = calloc(1, sizeof *kept);
    if (!kept) return NULL;
    kept->n = n;
    kept->k = k;
    kept->b_max = b_max;
    pthread_mutex_lock(&products.lock);
    onednn_keep(kept, b);
    pthread_mutex_unlock(&products.lock);
    size_t plain_bytes = (size_t)k * n, sums_bytes = (size_t)n * sizeof(int32_t);
    if (kept->blocked) {
        kept->sums128 = malloc(sums_bytes);
        if (kept->sums128) column_sums128(n, k, b, kept->sums128);
        kept->bytes += sums_bytes;
    } else {
        kept->plain = malloc(plain_bytes);
        if (kept->plain) memcpy(kept->plain, b, plain_bytes);
        kept->bytes = plain_bytes;
    }
    if (kept->blocked ? !kept->sums128 : !kept->plain) {
        gemm_s8_kept_free(kept);
        return NULL;
    }
    return kept;
}

size_t gemm_s8_kept_bytes(const gemm_s8_kept *kept) { return kept ? kept->bytes : 0; }

void gemm_s8_kept_free(gemm_s8_kept *kept) {
    if (!kept) return;
    free(kept->blocked);
    free(kept->sums128);
    free(kept->plain);
    free(kept);
}

int gemm_s8_with_kept(int m, const int8_t *a, const gemm_s8_kept *b, int32_t *c) {
    if (b->plain) {
        gemm_s8(m, b->n, b->k, a, b->plain, b->b_max, c);
        pthread_mutex_lock(&products.lock);
        size_t len = strlen(products.path[0]);
        snprintf(products.path[0] + len, sizeof products.path[0] - len, ", W kept");
        pthread_mutex_unlock(&products.lock);
        return 0;
    }
    pthread_mutex_lock(&products.lock);
    int ran = onednn_kept_product(m, a, b, c);
    pthread_mutex_unlock(&products.lock);
    return ran == ONEDNN_RAN ? 0 : -1;
}

void gemm_bf16(int m, int n, int k, const uint16_t *a, const uint16_t *b, float *c) {
    char why[160];
    pthread_mutex_lock(&products.lock);
    if (onednn_product(1, m, n, k, a, b, 0, c, why, sizeof why) != ONEDNN_RAN) {
        int sgemm = gemm_bf16_sgemm(m, n, k, a, b, c) == 0;
        if (!sgemm) gemm_bf16_reference(m, n, k, a, b, c);
        snprintf(products.path[1], sizeof products.path[1], "%s",
                 sgemm ? "fp32 sgemm of bf16 operands" : "portable");
        if (!products.told[1])
            fprintf(stderr, "flexgen: --bf16-prefill: %s; using fp32 sums of the bf16 operands%s\n",
                    why, sgemm ? "" : " (plain loops: no memory for sgemm's copies)");
        products.told[1] = 1;
    }
    pthread_mutex_unlock(&products.lock);
}

/* The path the last product of the kind took, e.g. "onednn brg:avx512_core_amx_int8", "avx2
 * (exact int16 pairs)", "fp32 sgemm of bf16 operands", "portable"; "none ran" before the first. */
const char *gemm_path(int bf16) {
    static char path[2][96];
    bf16 = bf16 != 0;
    pthread_mutex_lock(&products.lock);
    snprintf(path[bf16], sizeof path[bf16], "%s", products.path[bf16]);
    pthread_mutex_unlock(&products.lock);
    return path[bf16];
}

/* The instructions oneDNN's kernels may use in this process (the CPU's, or fewer under
 * ONEDNN_MAX_CPU_ISA): with a product's shape, they decide which kernel oneDNN picks, so a job
 * with --bf16-prefill (whose fp32 sums go in the kernel's order) names them. Asking plans no
 * product. "none" in a build without oneDNN. */
const char *gemm_library_isa(void) {
#ifndef FLEXGEN_ONEDNN
    return "none";
#else
    switch (dnnl_get_effective_cpu_isa()) {
    case dnnl_cpu_isa_sse41: return "onednn sse41";
    case dnnl_cpu_isa_avx: return "onednn avx";
    case dnnl_cpu_isa_avx2: return "onednn avx2";
    case dnnl_cpu_isa_avx2_vnni: return "onednn avx2_vnni";
    case dnnl_cpu_isa_avx512_core: return "onednn avx512_core";
    case dnnl_cpu_isa_avx512_core_vnni: return "onednn avx512_core_vnni";
    case dnnl_cpu_isa_avx512_core_bf16: return "onednn avx512_core_bf16";
    case dnnl_cpu_isa_avx512_core_amx: return "onednn avx512_core_amx";
    default: return "onednn other";
    }
#endif
}
