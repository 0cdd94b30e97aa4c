/* support/simd.c: the AVX2 twins of the paper files' plain loops: 4-bit compression and
 * decompression (quant.c) and decode attention's two products over an fp16 cache (opt_model.c's
 * attend_one); and of the dummy weights' hash (checkpoint.c's dummy_value), which makes OPT-175B's
 * 98 GB of 4-bit weights on the machine that runs them. Each does exactly the arithmetic of the
 * loop it stands in for, so both give the same bits: the attention loops' 8 lanes of fused
 * multiply-adds and their pairwise sum are opt_model.c's dot8_fma, and axpy is one fmaf per value.
 * The paper files reach the twins through fg_simd_kernels(), whose entries are NULL where the CPU
 * lacks AVX2, FMA and F16C, where FLEXGEN_ISA=portable, or where FLEXGEN_NO_SIMD is set (util.c's
 * fg_cpu_has_avx2): the plain loops run then. So tests/test_cli.c holds the twins to the plain
 * loops on whole jobs, logits compared bit for bit: "FLEXGEN_ISA: every path to the same logits"
 * (fp16 cache, fp16 and 4-bit weights, int8 activations) and "portable (non-SIMD) paths match the
 * reference" (4-bit cache); tests/test_model.c holds the attention twins alone at head sizes the
 * fixtures lack. Beside the arithmetic, the attention loops ask for the next run of the cache's
 * rows as they read this one's (fg_prefetch_ahead; support/kv_pages.c's kv_head_run says why),
 * which changes no value.
 */
#include "support/support.h"

#include <math.h>
#include <string.h>

/* Asks for the cache line at `at` ahead of its use. An asm statement on x86-64: gcc takes a
 * function that only prefetches (as __builtin_prefetch) for one without effects and drops the
 * calls to it. */
static inline void prefetch_line(const void *at) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __asm__ volatile("prefetcht0 %0" : : "m"(*(const char *)at));
#else
    __builtin_prefetch(at);
#endif
}

/* Row j of `ahead` (n_ahead rows of hd fp16 values, `stride` values apart), if it has one, asked
 * for: its first and last cache line (a head's 64 or 128 values: 2 or 4 lines, and the CPU
 * fetches lines in pairs). */
void fg_prefetch_ahead(const fp16 *ahead, int n_ahead, int j, size_t stride, int hd) {
    if (j >= n_ahead) return;
    const fp16 *row = ahead + (size_t)j * stride;
    prefetch_line(row);
    prefetch_line(row + hd - 1);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#define AVX2 __attribute__((target("avx2,fma,f16c")))

/* The min and max of 64 contiguous values. */
AVX2 static void q4_range64(const float *x, float *lo_out, float *hi_out) {
    __m256 lo = _mm256_loadu_ps(x), hi = lo;
    for (int i = 8; i < Q4_GROUP; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        lo = _mm256_min_ps(lo, v);
        hi = _mm256_max_ps(hi, v);
    }
    float l[8], h[8];
    _mm256_storeu_ps(l, lo);
    _mm256_storeu_ps(h, hi);
    for (int i = 1; i < 8; i++) l[0] = l[i] < l[0] ? l[i] : l[0], h[0] = h[i] > h[0] ? h[i] : h[0];
    *lo_out = l[0];
    *hi_out = h[0];
}

/* 32 levels (four vectors of 8, in order) to 32 bytes in order: the packs interleave lanes. */
AVX2 static __m256i levels_to_bytes(const __m256i *q) {
    __m256i b = _mm256_packus_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* 64 contiguous values to their levels round((x - min) inv), two to a byte. */
AVX2 static void q4_pack64(const float *x, float min, float inv, uint8_t *bytes) {
    __m256 vmin = _mm256_set1_ps(min), vinv = _mm256_set1_ps(inv), half = _mm256_set1_ps(0.5f);
    __m256 zero = _mm256_setzero_ps(), top = _mm256_set1_ps(15);
    __m256i q[8];
    for (int k = 0; k < 8; k++) {
        __m256 t = _mm256_add_ps(
            _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + 8 * k), vmin), vinv), half);
        q[k] = _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(t, zero), top));
    }
    /* pairs (2p, 2p + 1) -> 16 (2p) + (2p + 1), then to bytes, in order */
    __m256i weights = _mm256_set1_epi16(0x0110);
    __m256i first = _mm256_maddubs_epi16(levels_to_bytes(q), weights);
    __m256i second = _mm256_maddubs_epi16(levels_to_bytes(q + 4), weights);
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi16(first, second), 0xD8);
    _mm256_storeu_si256((__m256i *)bytes, packed);
}

/* 8 nibbles (as 32-bit lanes) to min + q * scale. */
AVX2 static inline __m256 nibbles_to_ps(__m256i q, __m256 min, __m256 scale) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), scale, min);
}

/* The whole groups of contiguous values (inner == 1): 32 bytes -> 64 floats each. Returns the
 * values decoded; the caller decodes a partial last group. */
AVX2 static size_t q4_decode_groups(const uint8_t *bytes, const fp16 *mins, const fp16 *scales,
                                    size_t len, float *out) {
    size_t full = len / Q4_GROUP;
    const __m128i low4 = _mm_set1_epi8(15);
    for (size_t g = 0; g < full; g++) {
        __m256 min = _mm256_set1_ps(fp16_to_fp32(mins[g])),
               scale = _mm256_set1_ps(fp16_to_fp32(scales[g]));
        const uint8_t *b = bytes + g * (Q4_GROUP / 2);
        float *o = out + g * Q4_GROUP;
        for (int half = 0; half < 2; half++) { /* 16 bytes = 32 values */
            __m128i v = _mm_loadu_si128((const __m128i *)(b + 16 * half));
            __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4), lo = _mm_and_si128(v, low4);
            __m128i e0 = _mm_unpacklo_epi8(hi, lo), e1 = _mm_unpackhi_epi8(hi, lo); /* in order */
            __m128i parts[4] = {e0, _mm_srli_si128(e0, 8), e1, _mm_srli_si128(e1, 8)};
            for (int k = 0; k < 4; k++)
                _mm256_storeu_ps(o + 32 * half + 8 * k,
                                 nibbles_to_ps(_mm256_cvtepu8_epi32(parts[k]), min, scale));
        }
    }
    return full * Q4_GROUP;
}

/* Row r of groups across rows (inner > 1): row 64 g + 2 p and the next from byte row (g, p). */
AVX2 static void q4_decode_row(const uint8_t *bytes, const fp16 *mins, const fp16 *scales, size_t r,
                               size_t inner, float *o) {
    size_t vec = inner / 8 * 8, g = r / Q4_GROUP, p = (r % Q4_GROUP) / 2;
    int shift = r % 2 ? 0 : 4;
    const uint8_t *b = bytes + (g * (Q4_GROUP / 2) + p) * inner;
    const fp16 *mn = mins + g * inner, *sc = scales + g * inner;
    for (size_t i = 0; i < vec; i += 8) {
        __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + i)));
        q = _mm256_and_si256(_mm256_srli_epi32(q, shift), _mm256_set1_epi32(15));
        __m256 min = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mn + i)));
        __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + i)));
        _mm256_storeu_ps(o + i, nibbles_to_ps(q, min, scale));
    }
    for (size_t i = vec; i < inner; i++)
        o[i] = fmaf((float)((b[i] >> shift) & 15), fp16_to_fp32(sc[i]), fp16_to_fp32(mn[i]));
}

/* One key's 8 lanes added as dot8_fma adds them: pairwise, halving. */
AVX2 static float lanes_sum(__m256 acc) {
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
    return _mm_cvtss_f32(s4);
}

AVX2 static inline __m256 fp16x8(const fp16 *at) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)at));
}

/* scores[j] = scale q.K_j over nk fp16 rows `stride` apart, hd a multiple of 8. Four keys a pass:
 * one key's chain of fused multiply-adds waits on each step (hd / 8 of them in a row), so four
 * independent chains keep the unit busy; each key's sum is the same chain in the same order. */
AVX2 static void dot_f16_rows(const float *q, const fp16 *K, size_t stride, int nk, int hd,
                              float scale, float *scores, const fp16 *ahead, int n_ahead) {
    int j = 0;
    for (; j + 4 <= nk; j += 4) {
        for (int i = 0; i < 4; i++) fg_prefetch_ahead(ahead, n_ahead, j + i, stride, hd);
        const fp16 *k0 = K + (size_t)j * stride, *k1 = k0 + stride, *k2 = k1 + stride,
                   *k3 = k2 + stride;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int d = 0; d < hd; d += 8) {
            __m256 qd = _mm256_loadu_ps(q + d);
            a0 = _mm256_fmadd_ps(qd, fp16x8(k0 + d), a0);
            a1 = _mm256_fmadd_ps(qd, fp16x8(k1 + d), a1);
            a2 = _mm256_fmadd_ps(qd, fp16x8(k2 + d), a2);
            a3 = _mm256_fmadd_ps(qd, fp16x8(k3 + d), a3);
        }
        scores[j] = lanes_sum(a0) * scale;
        scores[j + 1] = lanes_sum(a1) * scale;
        scores[j + 2] = lanes_sum(a2) * scale;
        scores[j + 3] = lanes_sum(a3) * scale;
    }
    for (; j < nk; j++) {
        fg_prefetch_ahead(ahead, n_ahead, j, stride, hd);
        __m256 acc = _mm256_setzero_ps();
        for (int d = 0; d < hd; d += 8)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), fp16x8(K + (size_t)j * stride + d), acc);
        scores[j] = lanes_sum(acc) * scale;
    }
}

/* out += sum_j p[j] V_j over nk fp16 rows `stride` apart, hd a multiple of 8: 32 values of out at
 * a time held in registers over every row (out stored back and loaded again for each row waited
 * on the store), one fused multiply-add per value and row, the rows in order. */
AVX2 static void axpy_f16_rows(const float *p, const fp16 *V, size_t stride, int nk, int hd,
                               float *out, const fp16 *ahead, int n_ahead) {
    int d = 0; /* the first pass over the rows (d = 0) asks for the rows ahead */
    for (; d + 32 <= hd; d += 32) {
        __m256 o0 = _mm256_loadu_ps(out + d), o1 = _mm256_loadu_ps(out + d + 8),
               o2 = _mm256_loadu_ps(out + d + 16), o3 = _mm256_loadu_ps(out + d + 24);
        for (int j = 0; j < nk; j++) {
            if (d == 0) fg_prefetch_ahead(ahead, n_ahead, j, stride, hd);
            __m256 w = _mm256_set1_ps(p[j]);
            const fp16 *v = V + (size_t)j * stride + d;
            o0 = _mm256_fmadd_ps(w, fp16x8(v), o0);
            o1 = _mm256_fmadd_ps(w, fp16x8(v + 8), o1);
            o2 = _mm256_fmadd_ps(w, fp16x8(v + 16), o2);
            o3 = _mm256_fmadd_ps(w, fp16x8(v + 24), o3);
        }
        _mm256_storeu_ps(out + d, o0);
        _mm256_storeu_ps(out + d + 8, o1);
        _mm256_storeu_ps(out + d + 16, o2);
        _mm256_storeu_ps(out + d + 24, o3);
    }
    for (; d < hd; d += 8) {
        __m256 o = _mm256_loadu_ps(out + d);
        for (int j = 0; j < nk; j++) {
            if (d == 0) fg_prefetch_ahead(ahead, n_ahead, j, stride, hd);
            o = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), fp16x8(V + (size_t)j * stride + d), o);
        }
        _mm256_storeu_ps(out + d, o);
    }
}

/* The low 64 bits of a b, lane by lane: AVX2 multiplies 32 bits by 32, so three of those. */
AVX2 static __m256i mul64(__m256i a, __m256i b) {
    __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), b),
                                     _mm256_mul_epu32(a, _mm256_srli_epi64(b, 32)));
    return _mm256_add_epi64(_mm256_mul_epu32(a, b), _mm256_slli_epi64(cross, 32));
}

/* fg_mix64 (support.h) of four lanes, its top 24 bits. */
AVX2 static __m256i mix64_top24(__m256i x) {
    x = _mm256_xor_si256(x, _mm256_srli_epi64(x, 30));
    x = mul64(x, _mm256_set1_epi64x((long long)0xbf58476d1ce4e5b9ULL));
    x = _mm256_xor_si256(x, _mm256_srli_epi64(x, 27));
    x = mul64(x, _mm256_set1_epi64x((long long)0x94d049bb133111ebULL));
    x = _mm256_xor_si256(x, _mm256_srli_epi64(x, 31));
    return _mm256_srli_epi64(x, 40);
}

/* checkpoint.c's dummy_value, 8 at a time: u = (mix64(base + i) >> 40) 2^-23, exact in fp32, then
 * center + scale (u - 1) as its separate multiply and add, rounded to fp16 (F16C, to nearest even,
 * as fp32_to_fp16) and back. */
AVX2 static size_t dummy_values8(uint64_t base, size_t first, size_t apart, size_t n, float center,
                                 float scale, float *out) {
    uint64_t at = base + first;
    __m256i idx = _mm256_set_epi64x((long long)(at + 3 * apart), (long long)(at + 2 * apart),
                                    (long long)(at + apart), (long long)at);
    __m256i four = _mm256_set1_epi64x((long long)(4 * apart));
    __m256 unit = _mm256_set1_ps(2.0f / 16777216.0f), one = _mm256_set1_ps(1.0f);
    __m256 c = _mm256_set1_ps(center), s = _mm256_set1_ps(scale);
    size_t j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256i lo = mix64_top24(idx);
        idx = _mm256_add_epi64(idx, four);
        __m256i hi = mix64_top24(idx);
        idx = _mm256_add_epi64(idx, four);
        /* each lane's low 32 bits, in order: lo 0..3, then hi 0..3 */
        __m256 pairs = _mm256_shuffle_ps(_mm256_castsi256_ps(lo), _mm256_castsi256_ps(hi), 0x88);
        __m256i bits = _mm256_permute4x64_epi64(_mm256_castps_si256(pairs), 0xd8);
        __m256 u = _mm256_mul_ps(_mm256_cvtepi32_ps(bits), unit);
        __m256 v = _mm256_add_ps(c, _mm256_mul_ps(s, _mm256_sub_ps(u, one)));
        _mm256_storeu_ps(out + j, _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT)));
    }
    return j;
}

static const fg_simd avx2 = {q4_range64,   q4_pack64,     q4_decode_groups, q4_decode_row,
                             dot_f16_rows, axpy_f16_rows, dummy_values8};
#endif

const fg_simd *fg_simd_kernels(void) {
    static const fg_simd none;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (fg_cpu_has_avx2()) return &avx2;
#endif
    return &none;
}
