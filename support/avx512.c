/* support/avx512.c: the decode products' AVX-512 kernels, the fast path of support/matmul.c on CPUs
 * with AVX-512 F, BW, DQ and VL. One source, built twice: here natively (the target is switched on
 * for this file alone, and matmul.c calls in only where cpuid says the CPU has it), and again in
 * support/avx512_simde.c on SIMDe's portable C, which runs on every machine. So the tests hold
 * these kernels to the portable path's bits everywhere, and where the CPU has AVX-512, the native
 * build too. The intrinsics are Intel's names; SIMDe maps each to the instruction when the target
 * has it.
 *
 * A band is kc rows of W (k0 .. k0 + kc) across whole groups of 64 columns, for every row of x.
 * Each element of y is one chain of fused multiply-adds over k in increasing order, started at 0 or
 * at y (for 4-bit, matmul.c's band_q4_portable's sums), as in matmul.c's portable loops, so every
 * path gives the same bits.
 *
 *   fp16   W's rows widened in the registers (vcvtph2ps); tiles of 1 row x 128 columns, or of up to
 *          6 rows x 64 (24 accumulators of the 32 registers).
 *   4-bit  matmul.c's scheme: the codes times a = x scale, given with each band's min term
 *          (q4_terms); per byte b of the codes, sums of a b (b converted) and of a (b & 15) (a
 *          lookup in the table 0 .. 15: vpermps reads the low 4 bits of each lane), from which the
 *          odd column (the low nibble) and the even one ((sum a b - sum a (b & 15)) / 16) come,
 *          put in order with the min term added when they are stored. Tiles: 1 row x 256
 *          columns, 2 x 128, up to 4 x 64, up to 8 x 32. The codes are read once per tile, and no
 *          fp32 copy of W is ever written.
 *   Each tile of the first rows of x prefetches the same columns of the next band's rows, kc rows
 *   on: the rows of a band are kc separate streams, too many for the hardware's prefetcher alone.
 *   int8   --int8-activations' integer sums with VNNI (int8.c's scheme): on a panel of quads that
 *          int8.c packs (int8_sums), and for decode's few rows without one (int8_pairs).
 */
#include "support/support.h"

#include <string.h>

#ifndef AVX512_SIMDE
/* The file's target, for every function in it: clang's attribute pushed (and popped at the file's
 * end), or GCC's pragma (which takes no macro: the same list, written out). */
#define AVX512_TARGET "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c"
#if defined(__x86_64__) && defined(__clang__)
#pragma clang attribute push(__attribute__((target(AVX512_TARGET))), apply_to = function)
#define AVX512_BUILT 1
#define AVX512_CLANG_TARGET 1
#elif defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c") /* AVX512_TARGET */
#define AVX512_BUILT 1
#endif
#else
#define AVX512_BUILT 1
#endif

#ifdef AVX512_BUILT
#pragma GCC diagnostic ignored "-Wpsabi" /* zmm arguments of static functions: no ABI to keep */
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <simde/x86/f16c.h>

#define INLINE static inline __attribute__((always_inline))

#ifndef SIMDE_X86_AVX512F_NATIVE
/* SIMDe 0.7's portable vfmadd rounds twice (the product, then the sum); the instruction rounds
 * once, as fmaf does. */
#undef _mm512_fmadd_ps
#define _mm512_fmadd_ps fused_multiply_add
INLINE __m512 fused_multiply_add(__m512 a, __m512 b, __m512 c) {
    float fa[16], fb[16], fc[16];
    _mm512_storeu_ps(fa, a), _mm512_storeu_ps(fb, b), _mm512_storeu_ps(fc, c);
    for (int i = 0; i < 16; i++) fc[i] = fmaf(fa[i], fb[i], fc[i]);
    return _mm512_loadu_ps(fc);
}
#endif

/* 16 fp16 values widened. */
INLINE __m512 widen16(const fp16 *h) {
#ifdef SIMDE_X86_AVX512F_NATIVE
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
#else /* SIMDe 0.7 has no 512-bit cvtph: two halves */
    __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
    __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + 8)));
    return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
#endif
}

/* 16 bytes, each in a lane of 32 bits. */
INLINE __m512i widen_bytes(const uint8_t *b) {
#ifdef SIMDE_X86_AVX512F_NATIVE
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
#else /* nor vpmovzxbd */
    return _mm512_setr_epi32(b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10],
                             b[11], b[12], b[13], b[14], b[15]);
#endif
}

/* i (|i| < 2^22) as a float, exactly. */
INLINE __m512 int_to_float(__m512i i) {
#ifdef SIMDE_X86_AVX512F_NATIVE
    return _mm512_cvtepi32_ps(i);
#else /* SIMDe 0.7 has no 512-bit vcvtdq2ps: 1.5 x 2^23 + i, less 1.5 x 2^23 */
    __m512i bits = _mm512_add_epi32(i, _mm512_set1_epi32(0x4b400000));
    return _mm512_sub_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(12582912.0f));
#endif
}

INLINE void prefetch(const void *p) { _mm_prefetch((const char *)p, _MM_HINT_T1); }    /* into L2 */
INLINE void prefetch_l1(const void *p) { _mm_prefetch((const char *)p, _MM_HINT_T0); } /* into L1 */

/* ---- fp16: y[mr][16 nv] over kc rows of w (ldw apart) ---- */
INLINE void tile_f16(const float *x, size_t ldx, const fp16 *w, size_t ldw, int kc, float *y,
                     size_t ldy, int from_y, int ahead, const int mr, const int nv) {
    __m512 acc[6][8];
#pragma GCC unroll 6
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 8
        for (int v = 0; v < nv; v++)
            acc[r][v] = from_y ? _mm512_loadu_ps(y + r * ldy + 16 * v) : _mm512_setzero_ps();
    for (int k = 0; k < kc; k++) {
        const fp16 *row = w + k * ldw;
        if (ahead)
#pragma GCC unroll 4
            for (int v = 0; v < nv; v += 2)
                prefetch(row + (size_t)kc * ldw + 16 * v); /* a line: 32 values */
        __m512 wv[8];
#pragma GCC unroll 8
        for (int v = 0; v < nv; v++) wv[v] = widen16(row + 16 * v);
#pragma GCC unroll 6
        for (int r = 0; r < mr; r++) {
            __m512 xr = _mm512_set1_ps(x[r * ldx + k]);
#pragma GCC unroll 8
            for (int v = 0; v < nv; v++) acc[r][v] = _mm512_fmadd_ps(xr, wv[v], acc[r][v]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 8
        for (int v = 0; v < nv; v++) _mm512_storeu_ps(y + r * ldy + 16 * v, acc[r][v]);
}

static void band_f16(const float *x, int rows, size_t ldx, const fp16 *w, size_t ldw, int kc,
                     int cols, float *y, size_t ldy, int from_y, int ahead) {
    for (int r = 0, mr; r < rows; r += mr) {
        mr = rows - r < 6 ? rows - r : 6;
        const float *xr = x + r * ldx;
        float *yr = y + r * ldy;
        int pf = ahead && r == 0;
        for (int c = 0; c < cols; c += mr == 1 && cols - c >= 128 ? 128 : 64) {
            if (mr == 1 && cols - c >= 128) {
                tile_f16(xr, ldx, w + c, ldw, kc, yr + c, ldy, from_y, pf, 1, 8);
                continue;
            }
            switch (mr) {
            case 1: tile_f16(xr, ldx, w + c, ldw, kc, yr + c, ldy, from_y, pf, 1, 4); break;
            case 2: tile_f16(xr, ldx, w + c, ldw, kc, yr + c, ldy, from_y, pf, 2, 4); break;
            case 3: tile_f16(xr, ldx, w + c, ldw, kc, yr + c, ldy, from_y, pf, 3, 4); break;
            case 4: tile_f16(xr, ldx, w + c, ldw, kc, yr + c, ldy, from_y, pf, 4, 4); break;
            case 5: tile_f16(xr, ldx, w + c, ldw, kc, yr + c, ldy, from_y, pf, 5, 4); break;
            default: tile_f16(xr, ldx, w + c, ldw, kc, yr + c, ldy, from_y, pf, 6, 4); break;
            }
        }
    }
}

/* ---- 4-bit: y[mr][32 nh] over kc rows of 4-bit bytes (stride apart, G groups to a row's part),
 * from half-group h0 (columns 32 h0 ..) of the part ---- */

/* 32 columns of y, in order, from their even and odd columns (16 each). */
INLINE void join_even_odd(__m512 even, __m512 odd, __m512 *front, __m512 *back) {
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi =
        _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    *front = _mm512_permutex2var_ps(even, lo, odd);
    *back = _mm512_permutex2var_ps(even, hi, odd);
}

/* matmul.c's band_q4_portable's sums, a half-group (16 bytes) to a register: each byte b as it is,
 * and its low nibble (vpermps of the table 0 .. 15 reads a lane's low 4 bits). */
INLINE void tile_q4(const q4_terms *t, int r0, int h0, const uint8_t *codes, size_t stride, int kc,
                    float *y, size_t ldy, int from_y, int ahead, const int mr, const int nh) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 acc[8][16]; /* [row][2 h: sum_b of half-group h, 2 h + 1: sum_odd] */
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 8
        for (int h = 0; h < nh; h++) acc[r][2 * h] = acc[r][2 * h + 1] = _mm512_setzero_ps();
    for (int k = 0; k < kc; k++) {
        const uint8_t *row = codes + k * stride + 16 * h0;
        if (ahead) /* the codes of the same columns, kc rows on */
#pragma GCC unroll 4
            for (int b = 0; b < 16 * nh; b += 64) prefetch(row + (size_t)kc * stride + b);
#pragma GCC unroll 8
        for (int h = 0; h < nh; h++) {
            __m512i bytes = widen_bytes(row + 16 * h);
            __m512 byte = int_to_float(bytes), odd = _mm512_permutexvar_ps(bytes, iota);
#pragma GCC unroll 8
            for (int r = 0; r < mr; r++) {
                __m512 a = _mm512_set1_ps(t->a[r0 + r][k][(h0 + h) / 2]);
                acc[r][2 * h] = _mm512_fmadd_ps(a, byte, acc[r][2 * h]);
                acc[r][2 * h + 1] = _mm512_fmadd_ps(a, odd, acc[r][2 * h + 1]);
            }
        }
    }
    const __m512 sixteenth = _mm512_set1_ps(0.0625f);
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 8
        for (int h = 0; h < nh; h++) {
            __m512 min_term = _mm512_set1_ps(t->min_term[r0 + r][(h0 + h) / 2]), front, back;
            __m512 even = _mm512_mul_ps(_mm512_sub_ps(acc[r][2 * h], acc[r][2 * h + 1]), sixteenth);
            join_even_odd(_mm512_add_ps(even, min_term), _mm512_add_ps(acc[r][2 * h + 1], min_term),
                          &front, &back);
            float *yc = y + r * ldy + 32 * h;
            if (from_y) {
                front = _mm512_add_ps(_mm512_loadu_ps(yc), front);
                back = _mm512_add_ps(_mm512_loadu_ps(yc + 16), back);
            }
            _mm512_storeu_ps(yc, front);
            _mm512_storeu_ps(yc + 16, back);
        }
}

/* Tiles over the chunk's ng groups: the widest tile whose columns are left. */
static void band_q4(const q4_terms *t, int rows, const uint8_t *codes, size_t stride, int ng,
                    int kc, float *y, size_t ldy, int from_y, int ahead) {
    for (int r = 0, mr; r < rows; r += mr) {
        mr = rows - r < 8 ? rows - r : 8;
        float *yr = y + r * ldy;
        int pf = ahead && r == 0, halves = 2 * ng;
        for (int h = 0, nh; h < halves; h += nh) {
            int left = halves - h;
            float *yt = yr + 32 * h;
            if (mr == 1 && left >= 8) {
                nh = 8;
                tile_q4(t, r, h, codes, stride, kc, yt, ldy, from_y, pf, 1, 8);
            } else if (mr == 1) {
                nh = 2;
                tile_q4(t, r, h, codes, stride, kc, yt, ldy, from_y, pf, 1, 2);
            } else if (mr == 2 && left >= 4) {
                nh = 4;
                tile_q4(t, r, h, codes, stride, kc, yt, ldy, from_y, pf, 2, 4);
            } else if (mr == 2) {
                nh = 2;
                tile_q4(t, r, h, codes, stride, kc, yt, ldy, from_y, pf, 2, 2);
            } else if (mr == 3) {
                nh = 2;
                tile_q4(t, r, h, codes, stride, kc, yt, ldy, from_y, pf, 3, 2);
            } else if (mr == 4) {
                nh = 2;
                tile_q4(t, r, h, codes, stride, kc, yt, ldy, from_y, pf, 4, 2);
            } else if (mr == 5) {
                nh = 1;
                tile_q4(t, r, h, codes, stride, kc, yt, ldy, from_y, pf, 5, 1);
            } else if (mr == 6) {
                nh = 1;
                tile_q4(t, r, h, codes, stride, kc, yt, ldy, from_y, pf, 6, 1);
            } else if (mr == 7) {
                nh = 1;
                tile_q4(t, r, h, codes, stride, kc, yt, ldy, from_y, pf, 7, 1);
            } else {
                nh = 1;
                tile_q4(t, r, h, codes, stride, kc, yt, ldy, from_y, pf, 8, 1);
            }
        }
    }
}

/* ---- lm_head: y[r][v] = x[r] . E[v], rows of E taken two to a register: lanes 0-7 hold one
 * row's d .. d + 7 and lanes 8-15 the other's, so each dot is the 8-lane chain of matmul.c's
 * dot_portable (lane l sums d = l mod 8 in d's order), added as it adds them ---- */

/* The two 8-lane chains of a register, each added as dot_portable adds its lanes, then the tail
 * d = vec .. dim of rows a and b (fp16 when e16, else 4-bit through q4_value). */
INLINE float lanes_added(const float *l) {
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

/* Rows a and b of E, d .. d + 7, widened: fp16, or 4-bit byte row (both rows' nibbles). */
INLINE __m512 pair_f16(const fp16 *a, const fp16 *b) {
    __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)a));
    __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b));
    return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}

/* Rows 2p and 2p + 1 of a 4-bit table, d .. d + 7: the byte row's high nibbles, then its low,
 * as fp32 codes. */
INLINE __m512 pair_q4(const uint8_t *bytes) {
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)bytes));
    __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
    __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
    return _mm512_insertf32x8(_mm512_castps256_ps512(hi), lo, 1);
}

/* mr <= 4 rows of x against np <= 4 pairs of rows of E, v0 + 2 i and v0 + 2 i + 1: fp16 rows
 * e16[2 np], or the codes of 4-bit byte rows (E4; v0 a multiple of 8), whose x is matmul.c's a.
 * dot[r][j]: row j's 8 lanes added. 4-bit byte rows ask for the next call's byte rows a line
 * ahead, as matmul.c's dots_q4_avx2_shape does (fp16 rows run at the read rate without it). */
INLINE void dots_shape(const float *x, int dim, const fp16 *const *e16, const uint8_t *E4, int v0,
                       float dot[4][8], const int mr, const int np) {
    __m512 acc[4][4];
    int vec = dim / 8 * 8;
    const uint8_t *bytes = E4 ? E4 + (size_t)(v0 / 2) * dim : NULL;
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
        for (int i = 0; i < np; i++) acc[r][i] = _mm512_setzero_ps();
    for (int d = 0; d < vec; d += 8) {
        if (E4 && d % 64 == 0)
#pragma GCC unroll 4
            for (int i = 0; i < np; i++) prefetch_l1(bytes + (size_t)(np + i) * dim + d);
        __m512 e[4];
#pragma GCC unroll 4
        for (int i = 0; i < np; i++)
            e[i] = E4 ? pair_q4(bytes + (size_t)i * dim + d)
                      : pair_f16(e16[2 * i] + d, e16[2 * i + 1] + d);
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++) {
            __m512 xr = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + (size_t)r * dim + d));
#pragma GCC unroll 4
            for (int i = 0; i < np; i++) acc[r][i] = _mm512_fmadd_ps(xr, e[i], acc[r][i]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int i = 0; i < np; i++) {
            float l[16];
            _mm512_storeu_ps(l, acc[r][i]);
            dot[r][2 * i] = lanes_added(l);
            dot[r][2 * i + 1] = lanes_added(l + 8);
        }
}

/* The tail d = vec .. dim of a dot with row v of E (fp16, or 4-bit codes), one fmaf at a time, as
 * matmul.c's dot_portable. */
static float tail_of(float s, const float *x, int dim, const fp16 *e16, const uint8_t *E4, int v) {
    for (int d = dim / 8 * 8; d < dim; d++) {
        uint8_t byte = E4 ? E4[(size_t)(v / 2) * dim + d] : 0;
        float e =
            E4 ? (float)(v % 2 ? byte & 15 : byte >> 4) : fp16_to_fp32(e16[(size_t)v * dim + d]);
        s = fmaf(x[d], e, s);
    }
    return s;
}

/* Rows v0 .. v0 + ne (ne <= 8, v0 a multiple of 8) of E, fp16 (E16) or 4-bit codes (E4, x then
 * being matmul.c's a, and each dot gaining min_term[r]), against every row of x, 4 at a time. A
 * lone last row is paired with itself (a 4-bit one with the other nibble of its byte row, padding
 * past n), and the extra dot is not stored. */
static void dots(const float *x, int rows, int dim, const fp16 *E16, const uint8_t *E4,
                 const float *min_term, int v0, int ne, float *y, size_t ldy) {
    int np = (ne + 1) / 2;
    const fp16 *e16[8];
    for (int j = 0; j < 8; j++)
        e16[j] = E16 ? E16 + (size_t)(v0 + (j < ne ? j : ne - 1)) * dim : NULL;
    for (int r = 0, mr; r < rows; r += mr) {
        mr = rows - r < 4 ? rows - r : 4;
        float dot[4][8];
        const float *xr = x + (size_t)r * dim;
#define DOTS(m)                                             \
    np == 1   ? dots_shape(xr, dim, e16, E4, v0, dot, m, 1) \
    : np == 2 ? dots_shape(xr, dim, e16, E4, v0, dot, m, 2) \
    : np == 3 ? dots_shape(xr, dim, e16, E4, v0, dot, m, 3) \
              : dots_shape(xr, dim, e16, E4, v0, dot, m, 4)
        if (mr == 4) DOTS(4);
        else if (mr == 3) DOTS(3);
        else if (mr == 2) DOTS(2);
        else DOTS(1);
#undef DOTS
        for (int i = 0; i < mr; i++)
            for (int j = 0; j < ne; j++) {
                float dot_ij = tail_of(dot[i][j], xr + (size_t)i * dim, dim, E16, E4, v0 + j);
                y[(size_t)(r + i) * ldy + j] = E4 ? dot_ij + min_term[r + i] : dot_ij;
            }
    }
}

static void dots_f16(const float *x, int rows, int dim, const fp16 *E, int v0, int ne, float *y,
                     size_t ldy) {
    dots(x, rows, dim, E, NULL, NULL, v0, ne, y, ldy);
}

static void dots_q4(const float *a, const float *min_term, int rows, int dim, const uint8_t *E,
                    int v0, int ne, float *y, size_t ldy) {
    dots(a, rows, dim, NULL, E, min_term, v0, ne, y, ldy);
}

/* ---- 4-bit x int8 with VNNI: one vpdpbusd multiplies 16 slots' quads (4 codes of k, unsigned) by
 * a row's 4 values of a8 (signed) and adds the 4 products into each slot's int32 sum, exactly ----
 */

#ifndef AVX512_SIMDE
/* The file's target leaves VNNI out (AVX-512 CPUs without it run the rest), so SIMDe's alias is its
 * portable form: these functions take the target and call the instruction itself. They run only
 * where cpuid says the CPU has it (matmul.c's matmul_int8_sums). */
#undef _mm512_dpbusd_epi32
#define VNNI __attribute__((target(AVX512_TARGET ",avx512vnni"))) /* the file's and VNNI */
/* sum + the products of u8's and s8's quads, in place. GCC 12's intrinsic copies the sum to
 * another register and back around each instruction (two moves a product in pair_half's loop);
 * the instruction as assembly keeps it where it is. */
VNNI INLINE __m512i dpbusd(__m512i sum, __m512i u8, __m512i s8) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(sum) : "v"(u8), "v"(s8));
    return sum;
}
#else
#define VNNI
#define dpbusd _mm512_dpbusd_epi32
#endif

VNNI INLINE void int8_sums_rows(const uint8_t *quads, const int8_t *a8, int32_t (*isum)[64],
                                const int mr) {
    __m512i acc[4][4];
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++) acc[r][v] = _mm512_setzero_si512();
    for (int k4 = 0; k4 < 64; k4 += 4) {
        __m512i w[4];
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++)
            w[v] = _mm512_loadu_si512((const void *)(quads + 4 * (16 * k4 + 16 * v)));
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++) {
            int32_t four;
            memcpy(&four, a8 + 64 * r + k4, 4);
            __m512i b = _mm512_set1_epi32(four);
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++) acc[r][v] = dpbusd(acc[r][v], w[v], b);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++) _mm512_storeu_si512((void *)(isum[r] + 16 * v), acc[r][v]);
}

VNNI static void int8_sums(const uint8_t *quads, const int8_t *a8, int mr, int32_t (*isum)[64]) {
    if (mr >= 4) int8_sums_rows(quads, a8, isum, 4);
    else if (mr == 3) int8_sums_rows(quads, a8, isum, 3);
    else if (mr == 2) int8_sums_rows(quads, a8, isum, 2);
    else int8_sums_rows(quads, a8, isum, 1);
}

/* ---- 4-bit x int8 for decode, fused: a row of x against whole groups, with no panel ----
 * int8.c's block scheme (its comment has it), with the same operations in the same order, so the
 * same bits; what changes is where the work happens. int8.c packs each block's codes into a
 * panel of quads, for every step, which costs more than the sums when one row of x uses it. Here
 * two neighbouring groups (128 columns, 64 bytes of a row) go straight from W into registers:
 *   rows      a row's four unpacks (bytes, then pairs of bytes) interleave the codes of k .. k + 3
 *             into 32-bit quads, whose high nibbles are the even columns and low ones the odd;
 *   sums      one vpdpbusd for each 16 quads, against the row's 4 values of a8 of that group;
 *   y         kept in the order the quads come out (the slots) for the whole product, gaining
 *             alpha isum + msum at each block; put back in column order once, at the end.
 * The rounding of a (alpha, msum, a8) runs first for 16 groups side by side, one group a lane:
 * their mins and scales are 32 contiguous bytes of a row of W, widened once a block for all the
 * pass's rows (widen_block). The avx2 path's twin, without VNNI, is int8.c's int8_pairs_avx2 (one
 * group a 256-bit register, vpmaddubsw). */
enum { SPAN_BLOCKS = 4, CHUNK_GROUPS = 16, FUSED_ROWS = 4 }; /* FUSED_ROWS: rows of x a pass */

/* One row's rounded operands for a span of blocks and a chunk of up to 16 groups: the 4 values of
 * a8 of k .. k + 3 in one int32 (k's byte lowest), and alpha and msum, each [block][group]. */
typedef struct {
    int32_t a8_quads[SPAN_BLOCKS][16][CHUNK_GROUPS];
    float alpha[SPAN_BLOCKS][CHUNK_GROUPS], msum[SPAN_BLOCKS][CHUNK_GROUPS];
} rounded_span;

/* The n (<= 16) fp16 values at p, widened; zeros after them. */
INLINE __m512 widen_groups(const uint8_t *p, int n) {
    if (n == CHUNK_GROUPS) return widen16((const fp16 *)p);
#ifdef SIMDE_X86_AVX512BW_NATIVE /* a masked load: a copy to the stack would stall its load */
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1), p));
#endif
    fp16 h[CHUNK_GROUPS] = {0};
    memcpy(h, p, (size_t)n * sizeof *h);
    return widen16(h);
}

/* v (|v| < 2^22) to the nearest integer, ties to even, as nearbyintf: vcvtps2dq under the default
 * rounding mode, or on SIMDe (whose 0.7 lacks its intrinsic) by adding 1.5 x 2^23, which leaves
 * the integer in the low bits. */
INLINE __m512i round_to_int(__m512 v) {
#ifdef SIMDE_X86_AVX512F_NATIVE
    return _mm512_cvtps_epi32(v);
#else
    __m512i bits = _mm512_castps_si512(_mm512_add_ps(v, _mm512_set1_ps(12582912.0f)));
    return _mm512_sub_epi32(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffff)),
                            _mm512_set1_epi32(0x400000));
#endif
}

/* A block's mins and scales, widened, [k][group]: the same for every row of x. */
typedef struct {
    float min[64][CHUNK_GROUPS], scale[64][CHUNK_GROUPS];
} widened_block;

/* The block's (w at its first k) for ng (<= 16) groups; zeros past them. ahead: prefetch the
 * next block's. */
static void widen_block(const uint8_t *w, size_t stride, size_t mins, size_t scales, int ng,
                        int ahead, widened_block *wb) {
    for (int k = 0; k < 64; k++) {
        const uint8_t *row = w + (size_t)k * stride;
        if (ahead) {
            prefetch(row + 64 * stride + mins);
            prefetch(row + 64 * stride + scales);
        }
        _mm512_store_ps(wb->min[k], widen_groups(row + mins, ng));
        _mm512_store_ps(wb->scale[k], widen_groups(row + scales, ng));
    }
}

/* Block b of the span for one row (x at its first k): int8.c's quantize, a group a lane; a is
 * kept between its two uses. max |a| in four chains (a max of numbers is exact: any order gives
 * it), msum in eight (int8.c's order). Each 4 k's values of a8 become their groups' quads by two
 * saturating packs (|a8| <= 127: none saturates), which leave each 128-bit lane's bytes
 * [k][4 groups], and one byte shuffle to [group][4 k]. */
static void round_block(const float *x, const widened_block *wb, int b, rounded_span *q) {
    const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    __m512 big[4], lane[8];
    _Alignas(64) float a[64][CHUNK_GROUPS];
    for (int l = 0; l < 4; l++) big[l] = _mm512_setzero_ps();
    for (int l = 0; l < 8; l++) lane[l] = _mm512_setzero_ps();
    for (int k0 = 0; k0 < 64; k0 += 8)
#pragma GCC unroll 8
        for (int l = 0; l < 8; l++) { /* unrolled: big and lane stay in registers */
            int k = k0 + l;
            __m512 xk = _mm512_set1_ps(x[k]);
            __m512 ak = _mm512_mul_ps(xk, _mm512_load_ps(wb->scale[k]));
            _mm512_store_ps(a[k], ak);
            big[l % 4] = _mm512_max_ps(big[l % 4], _mm512_and_ps(ak, magnitude));
            lane[l] = _mm512_fmadd_ps(xk, _mm512_load_ps(wb->min[k]), lane[l]);
        }
    __m512 low = _mm512_add_ps(_mm512_add_ps(lane[0], lane[4]), _mm512_add_ps(lane[2], lane[6]));
    __m512 high = _mm512_add_ps(_mm512_add_ps(lane[1], lane[5]), _mm512_add_ps(lane[3], lane[7]));
    _mm512_storeu_ps(q->msum[b], _mm512_add_ps(low, high));
    __m512 largest = _mm512_max_ps(_mm512_max_ps(big[0], big[1]), _mm512_max_ps(big[2], big[3]));
    simde__mmask16 scaled = _mm512_cmp_ps_mask(largest, _mm512_set1_ps(0x1p-100f), _CMP_GE_OQ);
    __m512 inv = _mm512_maskz_div_ps(scaled, _mm512_set1_ps(127), largest);
    _mm512_storeu_ps(q->alpha[b], _mm512_maskz_div_ps(scaled, largest, _mm512_set1_ps(127)));
    const __m512i to_quads = _mm512_set4_epi32(0x0f0b0703, 0x0e0a0602, 0x0d090501, 0x0c080400);
    for (int k4 = 0; k4 < 16; k4++) {
        __m512i a8[4];
        for (int i = 0; i < 4; i++)
            a8[i] = round_to_int(_mm512_mul_ps(_mm512_load_ps(a[4 * k4 + i]), inv));
        __m512i bytes =
            _mm512_packs_epi16(_mm512_packs_epi32(a8[0], a8[1]), _mm512_packs_epi32(a8[2], a8[3]));
        _mm512_storeu_si512((void *)q->a8_quads[b][k4], _mm512_shuffle_epi8(bytes, to_quads));
    }
}

/* Groups u and u + 1's values of one [group] row of the span, in the low and the high 8 lanes. */
INLINE __m512i pair_of_ints(const int32_t *at) {
    return _mm512_mask_blend_epi32(0xff00, _mm512_set1_epi32(at[0]), _mm512_set1_epi32(at[1]));
}

INLINE __m512 pair_of_floats(const float *at) {
    return _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(at[0]), _mm512_set1_ps(at[1]));
}

/* Half h (0 or 1) of block b for the pair of groups u, u + 1 (codes: their first byte in the
 * block's first row) and mr (<= 4) rows: y_slots[r]'s slots 64h .. 64h + 63 += alpha isum + msum.
 * The half's slots come from the low (h = 0) or the high bytes of each 128-bit lane of the rows'
 * unpacks; its quads serve every row from registers (4 rows of 4 sums: 16 registers). ahead:
 * prefetch the next block's rows of the pair, which are many streams, as in int8.c's pack. */
VNNI INLINE void pair_half(const uint8_t *codes, size_t stride, int ahead,
                           const rounded_span *const *q, int b, int u, float *const *y_slots,
                           const int mr, const int h) {
    const __m512i low4 = _mm512_set1_epi8(15);
    __m512i sums[FUSED_ROWS][4];
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++) sums[r][v] = _mm512_setzero_si512();
    for (int k4 = 0; k4 < 16; k4++) {
        const uint8_t *row = codes + (size_t)(4 * k4) * stride;
        __m512i b0 = _mm512_loadu_si512((const void *)row);
        __m512i b1 = _mm512_loadu_si512((const void *)(row + stride));
        __m512i b2 = _mm512_loadu_si512((const void *)(row + 2 * stride));
        __m512i b3 = _mm512_loadu_si512((const void *)(row + 3 * stride));
        if (ahead)
            for (int i = 0; i < 4; i++) prefetch(row + (64 + i) * stride);
        __m512i b01 = h ? _mm512_unpackhi_epi8(b0, b1) : _mm512_unpacklo_epi8(b0, b1);
        __m512i b23 = h ? _mm512_unpackhi_epi8(b2, b3) : _mm512_unpacklo_epi8(b2, b3);
        __m512i quads[2] = {_mm512_unpacklo_epi16(b01, b23), _mm512_unpackhi_epi16(b01, b23)};
        __m512i w[4] = {_mm512_and_si512(_mm512_srli_epi16(quads[0], 4), low4),
                        _mm512_and_si512(quads[0], low4),
                        _mm512_and_si512(_mm512_srli_epi16(quads[1], 4), low4),
                        _mm512_and_si512(quads[1], low4)};
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++) {
            __m512i a8 = pair_of_ints(&q[r]->a8_quads[b][k4][u]);
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++) sums[r][v] = dpbusd(sums[r][v], w[v], a8);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++) {
        __m512 alpha = pair_of_floats(&q[r]->alpha[b][u]);
        __m512 msum = pair_of_floats(&q[r]->msum[b][u]);
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++) {
            float *y = y_slots[r] + 16 * (4 * h + v);
            __m512 gain = _mm512_fmadd_ps(alpha, int_to_float(sums[r][v]), msum);
            _mm512_storeu_ps(y, _mm512_add_ps(_mm512_loadu_ps(y), gain));
        }
    }
}

/* Block b for the pair of groups u, u + 1 and mr rows: y_slots[r] (128 floats, in slot order) +=
 * alpha isum + msum, a half at a time; the second half finds the block's codes in L1. Both halves
 * ask for the next block's rows: a Zen 4 drops some prefetches into L2 (those that meet a full
 * miss queue, it seems), and asking again a half later catches them. There, one row of x against
 * opt-1.3b's products from memory (bench_matmul 1 int8): fc2 0.41 -> 0.32 ms, fc1 0.41 -> 0.35,
 * 2048 x 2048 0.104 -> 0.084, on one thread fc2 0.70 -> 0.37; asking once in each half for half
 * the rows was no faster than once. int8.c's avx2 twin asks twice as it is: two groups share a
 * line and each asks for it. */
VNNI INLINE void pair_block(const uint8_t *codes, size_t stride, int ahead,
                            const rounded_span *const *q, int b, int u, float *const *y_slots,
                            const int mr) {
    pair_half(codes, stride, ahead, q, b, u, y_slots, mr, 0);
    pair_half(codes, stride, ahead, q, b, u, y_slots, mr, 1);
}

/* A 4 x 4 transpose of 128-bit lanes: r[i] lane a to r[a] lane i. */
INLINE void transpose_lanes(__m512i r[4]) {
    __m512i t0 = _mm512_shuffle_i32x4(r[0], r[1], 0x44); /* lanes 0, 1 of r[0], then of r[1] */
    __m512i t1 = _mm512_shuffle_i32x4(r[0], r[1], 0xee); /* lanes 2, 3 */
    __m512i t2 = _mm512_shuffle_i32x4(r[2], r[3], 0x44);
    __m512i t3 = _mm512_shuffle_i32x4(r[2], r[3], 0xee);
    r[0] = _mm512_shuffle_i32x4(t0, t2, 0x88);
    r[1] = _mm512_shuffle_i32x4(t0, t2, 0xdd);
    r[2] = _mm512_shuffle_i32x4(t1, t3, 0x88);
    r[3] = _mm512_shuffle_i32x4(t1, t3, 0xdd);
}

/* Elements 0 and 2 of each 128-bit lane of a, then of b's; and elements 1 and 3. */
INLINE __m512i even_elements(__m512i a, __m512i b) {
    return _mm512_castps_si512(
        _mm512_shuffle_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b), 0x88));
}

INLINE __m512i odd_elements(__m512i a, __m512i b) {
    return _mm512_castps_si512(
        _mm512_shuffle_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b), 0xdd));
}

/* The slots: sums[v] lane 4a + j (128-bit lane a) holds byte p = 16a + 4(v / 2) + j of a row's
 * 64, whose high nibble (v even) is column 2p and low one 2p + 1. So half h's slots (v = 4h + i,
 * i = 0 .. 3, at 64h + 16i) hold in lane 4a + j the columns 32a + 16h + 8(i / 2) + 2j + i % 2: an
 * unpack of the slots of i = 0 and 1, and of 2 and 3, puts each 128-bit lane a's columns in
 * order, and a transpose of the lanes moves lane a to vector a, the 16 columns from 32a + 16h.
 * Into slot order, the same steps backwards. The values are moved, never changed. */
INLINE void slots_to_columns(__m512i v[4]) {
    __m512i s0 = v[0], s1 = v[1], s2 = v[2], s3 = v[3];
    v[0] = _mm512_unpacklo_epi32(s0, s1);
    v[1] = _mm512_unpackhi_epi32(s0, s1);
    v[2] = _mm512_unpacklo_epi32(s2, s3);
    v[3] = _mm512_unpackhi_epi32(s2, s3);
    transpose_lanes(v);
}

INLINE void columns_to_slots(__m512i v[4]) {
    transpose_lanes(v);
    __m512i lo01 = v[0], hi01 = v[1], lo23 = v[2], hi23 = v[3];
    v[0] = even_elements(lo01, hi01);
    v[1] = odd_elements(lo01, hi01);
    v[2] = even_elements(lo23, hi23);
    v[3] = odd_elements(lo23, hi23);
}

/* y's 128 columns of each of n pairs into slot order (zeros unless from_y), or (back) out of it,
 * a half's 4 vectors at a time, both halves loaded before either is stored. */
static void pairs_to_slots(float *y, int n, int from_y, int back) {
    for (int p = 0; p < n; p++) {
        float *pair = y + 128 * p;
        if (!back && !from_y) {
            for (int v = 0; v < 8; v++) _mm512_storeu_ps(pair + 16 * v, _mm512_setzero_ps());
            continue;
        }
        __m512i half[2][4];
        for (int h = 0; h < 2; h++)
            for (int i = 0; i < 4; i++) {
                int slots = 64 * h + 16 * i, columns = 32 * i + 16 * h;
                half[h][i] = _mm512_loadu_si512(pair + (back ? slots : columns));
            }
        for (int h = 0; h < 2; h++) {
            if (back) slots_to_columns(half[h]);
            else columns_to_slots(half[h]);
        }
        for (int h = 0; h < 2; h++)
            for (int i = 0; i < 4; i++) {
                int slots = 64 * h + 16 * i, columns = 32 * i + 16 * h;
                _mm512_storeu_si512(pair + (back ? columns : slots), half[h][i]);
            }
    }
}

/* Rows r0 .. r0 + nr (nr <= FUSED_ROWS) of x over the span's blocks b0 .. b0 + nb and the chunk's
 * n groups from g: their a rounded, then each block's pairs summed into y (in slot order). */
VNNI static void span_rows(const float *x, size_t ldx, int r0, int nr, const uint8_t *w,
                           size_t stride, size_t mins, size_t scales, int blocks, int b0, int nb,
                           int g, int n, float *y, size_t ldy, int first_rows) {
    rounded_span spans[FUSED_ROWS];
    const rounded_span *q[FUSED_ROWS];
    _Alignas(64) widened_block wb;
    for (int r = 0; r < nr; r++) q[r] = &spans[r];
    for (int b = 0; b < nb; b++) {
        widen_block(w + (size_t)(64 * (b0 + b)) * stride, stride, mins + 2 * (size_t)g,
                    scales + 2 * (size_t)g, n, first_rows && b0 + b + 1 < blocks, &wb);
        for (int r = 0; r < nr; r++)
            round_block(x + (r0 + r) * ldx + 64 * (b0 + b), &wb, b, &spans[r]);
    }
    for (int b = 0; b < nb; b++) {
        int ahead = first_rows && b0 + b + 1 < blocks; /* later rows find the span in L2 */
        const uint8_t *block = w + (size_t)(64 * (b0 + b)) * stride + 32 * (size_t)g;
        for (int p = 0; p < n / 2; p++) {
            float *y_slots[FUSED_ROWS];
            for (int r = 0; r < nr; r++) y_slots[r] = y + (r0 + r) * ldy + 64 * (2 * p);
            const uint8_t *codes = block + 64 * p;
            switch (nr) { /* the row count a constant, so that the sums stay in registers */
            case 1: pair_block(codes, stride, ahead, q, b, 2 * p, y_slots, 1); break;
            case 2: pair_block(codes, stride, ahead, q, b, 2 * p, y_slots, 2); break;
            case 3: pair_block(codes, stride, ahead, q, b, 2 * p, y_slots, 3); break;
            default: pair_block(codes, stride, ahead, q, b, 2 * p, y_slots, 4); break;
            }
        }
    }
}

/* ng (even) whole groups of one part from group g0, for rows of x (ldx apart) over in (a multiple
 * of 64) rows of W: w is the part's first byte of row 0, stride bytes a row, G groups; y (ldy
 * apart) at group g0's first column, = or += x W. y holds the sums in slot order while they run.
 * Spans of a few blocks, each across all the groups (a row's codes read from left to right, as
 * the memory's prefetcher follows best), and in each, the rows of x four at a time: the span's
 * codes come from memory once, and from L2 for the next rows. */
VNNI static void int8_pairs(const float *x, int rows, size_t ldx, int in, const uint8_t *w,
                            size_t stride, int G, int g0, int ng, float *y, size_t ldy,
                            int from_y) {
    size_t mins = (size_t)G * 32, scales = mins + 2 * (size_t)G;
    int blocks = in / 64;
    for (int r = 0; r < rows; r++) pairs_to_slots(y + r * ldy, ng / 2, from_y, 0);
    for (int b0 = 0; b0 < blocks; b0 += SPAN_BLOCKS) {
        int nb = blocks - b0 < SPAN_BLOCKS ? blocks - b0 : SPAN_BLOCKS;
        for (int c = 0; c < ng; c += CHUNK_GROUPS) {
            int n = ng - c < CHUNK_GROUPS ? ng - c : CHUNK_GROUPS;
            for (int r0 = 0; r0 < rows; r0 += FUSED_ROWS) {
                int nr = rows - r0 < FUSED_ROWS ? rows - r0 : FUSED_ROWS;
                span_rows(x, ldx, r0, nr, w, stride, mins, scales, blocks, b0, nb, g0 + c, n,
                          y + 64 * c, ldy, r0 == 0);
            }
        }
    }
    for (int r = 0; r < rows; r++) pairs_to_slots(y + r * ldy, ng / 2, 0, 1);
}

#ifdef AVX512_SIMDE
static const matmul_kernels kernels = {"avx512-simde", band_f16,  band_q4,   dots_f16,
                                       dots_q4,        int8_sums, int8_pairs};
const matmul_kernels *matmul_avx512_simde(void) { return &kernels; }
#else
static const matmul_kernels kernels = {"avx512", band_f16,  band_q4,   dots_f16,
                                       dots_q4,  int8_sums, int8_pairs};
const matmul_kernels *matmul_avx512(void) { return &kernels; }
#endif
#ifdef AVX512_CLANG_TARGET
#pragma clang attribute pop
#endif

#elif !defined(AVX512_SIMDE)
const matmul_kernels *matmul_avx512(void) { return NULL; } /* not built for this compiler */
#endif
