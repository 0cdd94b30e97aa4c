/* quant.c: group-wise 4-bit compression of weights and the KV cache, and the top-K selection of
 * sparse attention (paper §5, "Approximate Methods").
 *
 * §5 compresses a tensor in groups of 64 consecutive values along one dimension: each group keeps
 * its min and a scale, and every value becomes a 4-bit integer
 *     x_q = round((x - min) / (max - min) * 15),  x ~ min + x_q * scale,  scale = (max - min) / 15
 * two to a byte. That cuts weights and cache about 3.6x against fp16 (36 bytes per 64 values),
 * which is what lets larger blocks and models fit (Table 2's "(c)" rows).
 *
 * The layout (FlexGen's groups and nibble order, not its bytes): a tensor of shape
 * [outer][len][inner] is grouped along len, padded to a multiple of 64 (G groups), and stored per
 * outer index as
 *     nibbles [G][32][inner] bytes: byte (g, p, i) holds element 64 g + 2 p in its high nibble
 *                                   and element 64 g + 2 p + 1 in its low nibble, at inner index i
 *     min     [G][inner] fp16
 *     scale   [G][inner] fp16
 * Weights: a linear layer stored [in][out] is [in][out][1] (groups along out, dim 0 of the
 * checkpoint's [out, in]), and q|k|v [in][3][h] (each projection grouped on its own, as FlexGen
 * does); an embedding table [vocab][dim] is [1][vocab][dim]. The KV cache: a token's row of heads
 * is [heads][head_dim][1]. Padding nibbles are 0 and never read back; min and max come from the
 * real values only. Whole groups of contiguous values run on simd.c's AVX2 twins, to the bit.
 * Dummy weights (a model's shape without its checkpoint) are made straight in this form, a row or
 * a group at a time (q4_compress_dummy), with the bytes compressing their fp16 values gives.
 * ============================================================================================ */
#include "model.h"
#include "support/support.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static size_t n_groups(size_t len) { return (len + Q4_GROUP - 1) / Q4_GROUP; }

/* The smallest fp16 at or above x >= 0 (so that min + 15 scale reaches the group's max). */
static fp16 fp16_at_least(float x) {
    fp16 h = fp32_to_fp16(x);
    if (fp16_to_fp32(h) < x) h++;
    if ((h & 0x7c00) == 0x7c00) h = 0x7bff; /* beyond fp16: the largest finite, never Inf */
    return h;
}

/* A group's fp16 min and scale from its range [lo, hi], and what quantizing uses of them. */
static void group_range(float lo, float hi, fp16 *min16, fp16 *scale16, float *min, float *inv) {
    *min16 = fp32_to_fp16(lo);
    *min = fp16_to_fp32(*min16);
    *scale16 = hi > *min ? fp16_at_least((hi - *min) / 15) : 0;
    float scale = fp16_to_fp32(*scale16);
    *inv = scale > 0 ? 1 / scale : 0;
}

/* One group: n values, `stride` apart, into 32 bytes `inner` apart, with its min and scale; a value
 * halfway between two levels goes up, (int)(t + 0.5f). A whole group of contiguous values runs on
 * support/simd.c's twins where the CPU has them, which round so too. */
static void compress_group(const float *x, size_t stride, size_t n, uint8_t *bytes, size_t inner,
                           fp16 *min_out, fp16 *scale_out) {
    const fg_simd *simd = fg_simd_kernels();
    int whole = stride == 1 && n == Q4_GROUP && simd->q4_range;
    float lo = x[0], hi = x[0], min, inv;
    if (whole) simd->q4_range(x, &lo, &hi);
    for (size_t e = 1; e < n && !whole; e++) {
        float v = x[e * stride];
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
    }
    group_range(lo, hi, min_out, scale_out, &min, &inv);
    if (whole) {
        simd->q4_pack(x, min, inv, bytes);
        return;
    }
    for (size_t p = 0; p < Q4_GROUP / 2; p++) {
        int q[2] = {0, 0};
        for (int half = 0; half < 2; half++) {
            size_t e = 2 * p + half;
            if (e >= n) break;
            float t = (x[e * stride] - min) * inv + 0.5f;
            q[half] = t <= 0 ? 0 : t >= 15 ? 15 : (int)t;
        }
        bytes[p * inner] = (uint8_t)(q[0] << 4 | q[1]);
    }
}

/* Groups g0 .. g1 - 1 along len of every outer index, parallel over them, into the whole
 * tensor's layout: src is [outer][rows][inner], its rows those of the groups, from g0 on. */
static void compress_groups(const float *src, size_t rows, size_t outer, size_t len, size_t inner,
                            size_t g0, size_t g1, uint8_t *dst) {
    size_t G = n_groups(len), span = g1 - g0;
#pragma omp parallel for schedule(static) if (outer * span * inner >= 4096)
    for (size_t og = 0; og < outer * span; og++) {
        size_t o = og / span, g = g0 + og % span,
               n = len - g * Q4_GROUP < Q4_GROUP ? len - g * Q4_GROUP : Q4_GROUP;
        const float *x = src + (o * rows + (g - g0) * Q4_GROUP) * inner;
        uint8_t *bytes = dst + o * G * inner * (Q4_GROUP / 2 + 4);
        fp16 *mins = (fp16 *)(bytes + G * inner * (Q4_GROUP / 2)), *scales = mins + G * inner;
        for (size_t i = 0; i < inner; i++)
            compress_group(x + i, inner, n, bytes + g * (Q4_GROUP / 2) * inner + i, inner,
                           &mins[g * inner + i], &scales[g * inner + i]);
    }
}

/* The whole tensor (the KV cache's new rows at every step; weights once, at load). */
void q4_compress(const float *src, size_t outer, size_t len, size_t inner, uint8_t *dst) {
    compress_groups(src, len, outer, len, inner, 0, n_groups(len), dst);
}

/* The same bytes from fp16 values (a weight as loaded), widened a few groups at a time: a large
 * tensor such as a vocabulary's embedding needs no fp32 copy of itself. -1: out of memory. */
int q4_compress_fp16(const fp16 *src, size_t outer, size_t len, size_t inner, uint8_t *dst) {
    size_t G = n_groups(len), step = ((size_t)1 << 22) / (outer * Q4_GROUP * inner);
    step = step < 1 ? 1 : step > G ? G : step;
    float *wide = malloc(outer * step * Q4_GROUP * inner * sizeof *wide);
    for (size_t g0 = 0; wide && g0 < G; g0 += step) {
        size_t g1 = g0 + step < G ? g0 + step : G, r0 = g0 * Q4_GROUP;
        size_t rows = (g1 * Q4_GROUP < len ? g1 * Q4_GROUP : len) - r0;
        for (size_t o = 0; o < outer; o++)
            fp16_to_fp32_n(src + (o * len + r0) * inner, wide + o * rows * inner, rows * inner);
        compress_groups(wide, rows, outer, len, inner, g0, g1, dst);
    }
    free(wide);
    return wide ? 0 : -1;
}

/* A dummy matrix [in][out] of `parts` parts side by side (outer in parts, len out / parts, inner
 * 1): outer index o is row k = o / parts of part o % parts, whose value j is element j in + k of
 * the part's checkpoint tensor [out][in]. A thread a row at a time. */
static int compress_dummy_matrix(const opt_layout *l, int t, uint64_t seed, uint8_t *dst) {
    const opt_tensor *ten = &l->tensors[t];
    size_t parts = (size_t)ten->n_specs, outer = ten->group_outer, len = ten->group_len;
    size_t in = outer / parts, row_bytes = q4_bytes(1, len, 1);
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        float *row = malloc(len * sizeof *row);
        fp16 *halves = malloc(len * sizeof *halves);
        failed = !row || !halves;
#pragma omp for schedule(dynamic, 8)
        for (size_t o = 0; o < outer; o++) {
            if (failed) continue;
            opt_tensor_dummy_values(l, t, (int)(o % parts), seed, o / parts, in, len, row, halves);
            compress_groups(row, len, 1, len, 1, 0, n_groups(len), dst + o * row_bytes);
        }
        free(row);
        free(halves);
    }
    return failed ? -1 : 0;
}

/* A dummy embedding [len][inner] (outer 1): group g is rows 64 g on of every column, elements
 * (64 g + r) inner + i in checkpoint order. A thread a group at a time. */
static int compress_dummy_table(const opt_layout *l, int t, uint64_t seed, uint8_t *dst) {
    const opt_tensor *ten = &l->tensors[t];
    size_t len = ten->group_len, inner = ten->group_inner, groups = n_groups(len);
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        float *group_values = malloc(Q4_GROUP * inner * sizeof *group_values);
        fp16 *halves = malloc(Q4_GROUP * inner * sizeof *halves);
        failed = !group_values || !halves;
#pragma omp for schedule(dynamic, 1)
        for (size_t g = 0; g < groups; g++) {
            if (failed) continue;
            size_t rows = len - g * Q4_GROUP < Q4_GROUP ? len - g * Q4_GROUP : Q4_GROUP;
            opt_tensor_dummy_values(l, t, 0, seed, g * Q4_GROUP * inner, 1, rows * inner,
                                    group_values, halves);
            compress_groups(group_values, rows, 1, len, inner, g, g + 1, dst);
        }
        free(group_values);
        free(halves);
    }
    return failed ? -1 : 0;
}

/* Dummy tensor t (seed) made straight in its 4-bit stored form, in parallel: the bytes
 * q4_compress_fp16 makes of opt_tensor_fill's fp16 values, without a copy of those (a 98 GB
 * OPT-175B made at the cores' speed). -1: out of memory. */
int q4_compress_dummy(const opt_layout *l, int t, uint64_t seed, uint8_t *dst) {
    if (l->tensors[t].group_inner == 1) return compress_dummy_matrix(l, t, seed, dst);
    return compress_dummy_table(l, t, seed, dst);
}

/* ---- decompression: the hot path (every compressed weight, every token) ---- */

/* Groups along contiguous values (inner == 1): 32 bytes -> up to 64 floats. */
static void decode_groups_scalar(const uint8_t *bytes, const fp16 *mins, const fp16 *scales,
                                 size_t len, float *out) {
    for (size_t g = 0; g * Q4_GROUP < len; g++) {
        float min = fp16_to_fp32(mins[g]), scale = fp16_to_fp32(scales[g]);
        size_t n = len - g * Q4_GROUP < Q4_GROUP ? len - g * Q4_GROUP : Q4_GROUP;
        const uint8_t *b = bytes + g * (Q4_GROUP / 2);
        float *o = out + g * Q4_GROUP;
        for (size_t e = 0; e < n; e++)
            o[e] = fmaf((float)((b[e / 2] >> (e % 2 ? 0 : 4)) & 15), scale, min);
    }
}

/* Groups across rows (inner > 1): row 64 g + 2 p and the next from byte row (g, p). */
static void decode_row_scalar(const uint8_t *bytes, const fp16 *mins, const fp16 *scales, size_t r,
                              size_t inner, float *o) {
    size_t g = r / Q4_GROUP, p = (r % Q4_GROUP) / 2, shift = r % 2 ? 0 : 4;
    const uint8_t *b = bytes + (g * (Q4_GROUP / 2) + p) * inner;
    const fp16 *mn = mins + g * inner, *sc = scales + g * inner;
    for (size_t i = 0; i < inner; i++)
        o[i] = fmaf((float)((b[i] >> shift) & 15), fp16_to_fp32(sc[i]), fp16_to_fp32(mn[i]));
}

/* Row r of groups across rows, on the path this CPU has. */
static void decode_row(const uint8_t *bytes, const fp16 *mins, const fp16 *scales, size_t r,
                       size_t inner, float *o) {
    const fg_simd *simd = fg_simd_kernels();
    if (simd->q4_decode_row) simd->q4_decode_row(bytes, mins, scales, r, inner, o);
    else decode_row_scalar(bytes, mins, scales, r, inner, o);
}

void q4_decompress(const uint8_t *src, size_t outer, size_t len, size_t inner, float *dst) {
    size_t G = n_groups(len);
    const fg_simd *simd = fg_simd_kernels();
    for (size_t o = 0; o < outer; o++) {
        const uint8_t *bytes = src + o * G * inner * (Q4_GROUP / 2 + 4);
        const fp16 *mins = (const fp16 *)(bytes + G * inner * (Q4_GROUP / 2)),
                   *scales = mins + G * inner;
        float *out = dst + o * len * inner;
        if (inner > 1) {
            for (size_t r = 0; r < len; r++)
                decode_row(bytes, mins, scales, r, inner, out + r * inner);
            continue;
        }
        size_t done =
            simd->q4_decode_groups ? simd->q4_decode_groups(bytes, mins, scales, len, out) : 0;
        size_t g = done / Q4_GROUP; /* the partial last group, or every group without SIMD */
        decode_groups_scalar(bytes + g * (Q4_GROUP / 2), mins + g, scales + g, len - done,
                             out + done);
    }
}

/* ============================================================================================
 * Top-K sparse attention (§5): which earlier tokens a decode query keeps.
 * ============================================================================================ */

/* The k-th largest of x[0 .. n) (k >= 1), by quickselect; x is reordered. */
static float kth_largest(float *x, int n, int k) {
    int lo = 0, hi = n - 1, want = k - 1; /* position want in descending order */
    while (lo < hi) {
        float pivot = x[lo + (hi - lo) / 2];
        int i = lo, j = hi;
        while (i <= j) {
            while (x[i] > pivot) i++;
            while (x[j] < pivot) j--;
            if (i <= j) {
                float t = x[i];
                x[i++] = x[j];
                x[j--] = t;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else break; /* between j and i everything equals the pivot */
    }
    return x[want];
}

int topk_keep(const float *w, int n, int k, int *keep, float *scratch) {
    if (k > n) k = n;
    if (k <= 0) return 0;
    memcpy(scratch, w, (size_t)n * sizeof *w);
    float threshold = kth_largest(scratch, n, k);
    int above = 0, m = 0;
    for (int i = 0; i < n; i++) above += w[i] > threshold;
    int ties = k - above; /* how many equal to the threshold still fit, earliest first */
    for (int i = 0; i < n; i++)
        if (w[i] > threshold || (w[i] == threshold && ties-- > 0)) keep[m++] = i;
    return m;
}
