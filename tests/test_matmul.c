/* test_matmul.c: the fast products of support/matmul.c held to opt_model.c's reference products
 * (matmul_reference, embed_t_reference), and both to a plain triple loop in double, on fp16 and
 * 4-bit weights, on the AVX2 path and the portable one.
 *
 * Tolerance: each element is a sum of n = in products (n + 1 terms when adding to y) formed and
 * added in fp32, each operation rounding once with unit roundoff u = 2^-24. Whatever the order of
 * the sums, the error is at most gamma_n = n u / (1 - n u) times the sum of the terms' magnitudes
 * (Higham, "Accuracy and Stability of Numerical Algorithms", §3.1). The reference computes that
 * magnitude alongside the exact sum, so every element gets its own bound. */
#include "tests.h"

#include <math.h>
#include <cblas.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

static double gamma_n(int n) {
    double u = 0x1p-24;
    return n * u / (1 - n * u);
}

/* Weights W[in][out] as fp16 and, compressed, as 4-bit bytes in `parts` parts side by side (each
 * [in][out / parts] grouped on its own, as q|k|v); both with their fp32 values, and for 4-bit the
 * magnitudes of what decode sums (support/matmul.c), |scale| (q + 2) + |min| (count_apart_terms). */
typedef struct {
    int in, out;
    fp16 *w16;
    uint8_t *w4;
    float *v16, *v4; /* [in][out]: the values the products must use */
    float *terms4;   /* [in][out] */
} weights;

static void q4_parts_at(const uint8_t *w4, int parts, int out, int k, int c, int *q, float *scale, float *min);

static void weights_make(weights *w, int in, int out, int parts, uint64_t seed) {
    size_t n = (size_t)in * out;
    w->in = in, w->out = out;
    w->w16 = malloc(n * sizeof *w->w16);
    w->w4 = malloc(q4_bytes((size_t)in * parts, (size_t)(out / parts), 1));
    w->v16 = malloc(n * sizeof *w->v16);
    w->v4 = malloc(n * sizeof *w->v4);
    for (size_t i = 0; i < n; i++) {
        w->w16[i] = fp32_to_fp16((test_uniform(&seed) - 0.5f) * 0.2f);
        w->v16[i] = fp16_to_fp32(w->w16[i]);
    }
    q4_compress(w->v16, (size_t)in * parts, (size_t)(out / parts), 1, w->w4);
    q4_decompress(w->w4, (size_t)in * parts, (size_t)(out / parts), 1, w->v4);
    w->terms4 = malloc(n * sizeof *w->terms4);
    for (int k = 0; k < in; k++)
        for (int c = 0; c < out; c++) {
            int q;
            float scale, min;
            q4_parts_at(w->w4, parts, out, k, c, &q, &scale, &min);
            w->terms4[(size_t)k * out + c] = fabsf(scale) * (float)(q + 2) + fabsf(min);
        }
}

static void weights_free(weights *w) {
    free(w->w16);
    free(w->w4);
    free(w->v16);
    free(w->v4);
    free(w->terms4);
}

static float *random_floats(size_t n, uint64_t seed) {
    float *x = malloc(n * sizeof *x);
    for (size_t i = 0; i < n; i++) x[i] = test_uniform(&seed) * 2 - 1;
    return x;
}

/* y (from y0 when given) against sum_k x[r][k] v[k][c] in double, within gamma of its terms'
 * magnitudes, or, given ref, against ref within twice that (both are within gamma of the exact
 * sum); counts the elements outside.
 *
 * terms: 4-bit decode's magnitudes, or NULL. Decode sums a q, a = x scale rounded once, and x min
 * apart (support/matmul.c), so a term's magnitude is |x| (|scale q| + |min|), which |x v| can be
 * far below (v = min + q scale near 0); and in the linear layers an even column's sum is taken
 * from its bytes' (b = 16 q + q_odd: (sum a b - sum a q_odd) / 16), whose terms are |a| (q +
 * q_odd / 8) < |a| (q + 2) after the division (weights.terms4 counts that). Each term passes
 * through at most in + in / 32 + 5 roundings (a's rounding, a band's chain, the subtraction, the
 * min term and y at each of the bands of 32 rows; lm_head's dots, in 8 lanes, fewer); and the
 * exact min + q scale differs from v, its fp32 value, by at most u of it: one more. */
static int count_apart_terms(const float *x, int rows, int in, const float *v, const float *terms, int out,
                             const float *y0, const float *y, const float *ref) {
    int bad = 0, n = terms ? in + in / 32 + 6 : in + 1;
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < out; c++) {
            double exact = y0 ? y0[(size_t)r * out + c] : 0, mag = fabs(exact);
            for (int k = 0; k < in; k++) {
                double xk = x[(size_t)r * in + k], t = xk * v[(size_t)k * out + c];
                exact += t, mag += terms ? fabs(xk) * terms[(size_t)k * out + c] : fabs(t);
            }
            double err = fabs(y[(size_t)r * out + c] - (ref ? ref[(size_t)r * out + c] : exact));
            if (err > (ref ? 2 : 1) * gamma_n(n) * mag) bad++;
        }
    return bad;
}

static int count_apart(const float *x, int rows, int in, const float *v, int out, const float *y0,
                       const float *y, const float *ref) {
    return count_apart_terms(x, rows, in, v, NULL, out, y0, y, ref);
}

/* Shapes with tails everywhere: rows 1, 2, 3, 8, 13, 17, 64 (the decode kernel: every tile
 * shape, tiles of 6 and a rest) and 65, 70, 100 (panels and sgemm); in across bands of 64 and
 * not a multiple of 8, 16 or 64; out in whole blocks of 64 and not. The last two: int8's pairs of
 * groups (the path's int8_pairs: support/avx512.c's, or int8.c's AVX2 one) with a group left over
 * on a thread, and past a chunk of 16 groups and a span of 16 blocks. */
static const int SHAPES[][3] = {{1, 7, 5},     {3, 64, 17},    {1, 300, 200},  {17, 100, 130},
                                {64, 129, 64}, {65, 70, 300},  {100, 257, 77}, {8, 512, 1000},
                                {2, 130, 192}, {13, 65, 128},  {70, 100, 136}, {3, 256, 448},
                                {1, 1088, 2560}};
/* q|k|v (3 parts): parts of 96 and 100 columns, whose groups end inside a 64-column block, and of
 * 64 and 128, whose groups are the blocks. */
static const int PARTS_SHAPES[][3] = {{1, 100, 288}, {8, 64, 300}, {70, 130, 288}, {3, 65, 192}, {65, 70, 384},
                                      {13, 129, 300}, {2, 128, 384}};
enum { N_SHAPES = sizeof SHAPES / sizeof *SHAPES, N_PARTS_SHAPES = sizeof PARTS_SHAPES / sizeof *PARTS_SHAPES };
static const int *shape_of(int q4, size_t s) { return q4 == 3 ? PARTS_SHAPES[s] : SHAPES[s]; }

static int count_outside(const float *x, int rows, int in, const float *v, int out, const float *y0,
                         const float *y) {
    return count_apart(x, rows, in, v, out, y0, y, NULL);
}

static void check_products(int q4) {
    for (size_t s = 0; s < (q4 == 3 ? N_PARTS_SHAPES : N_SHAPES); s++) {
        int rows = shape_of(q4, s)[0], in = shape_of(q4, s)[1], out = shape_of(q4, s)[2];
        weights w;
        weights_make(&w, in, out, q4 ? q4 : 1, 7 + s);
        float *x = random_floats((size_t)rows * in, 11 + s), *y0 = random_floats((size_t)rows * out, 13 + s);
        float *y = malloc((size_t)rows * out * sizeof *y), *scratch = malloc(matmul_scratch_floats(in, out) * sizeof *scratch);
        const void *W = q4 ? (const void *)w.w4 : (const void *)w.w16;
        const float *v = q4 ? w.v4 : w.v16;
        const float *terms = q4 && rows <= MATMUL_DECODE_ROWS ? w.terms4 : NULL; /* prefill: v's sums */
        for (int acc = 0; acc < 2; acc++) {
            memcpy(y, y0, (size_t)rows * out * sizeof *y);
            matmul_weights(x, rows, in, W, q4, out, y, acc, 0, rows > MATMUL_DECODE_ROWS, scratch, NULL, NULL);
            int bad = count_apart_terms(x, rows, in, v, terms, out, acc ? y0 : NULL, y, NULL);
            EXPECT(bad == 0, "%s, %d part(s), rows %d, in %d, out %d%s: %d elements outside the bound",
                   q4 ? "4-bit" : "fp16", q4, rows, in, out, acc ? ", adding" : "", bad);
            float *ref = malloc((size_t)rows * out * sizeof *ref);
            memcpy(ref, y0, (size_t)rows * out * sizeof *ref);
            matmul_reference(x, rows, in, W, q4, out, ref, acc);
            int ref_bad = count_outside(x, rows, in, v, out, acc ? y0 : NULL, ref);
            int apart = count_apart_terms(x, rows, in, v, terms, out, acc ? y0 : NULL, y, ref);
            EXPECT(ref_bad == 0 && apart == 0, "%s, rows %d, in %d, out %d%s: matmul_reference has %d "
                   "elements outside the bound, the kernel %d apart from it", q4 ? "4-bit" : "fp16", rows,
                   in, out, acc ? ", adding" : "", ref_bad, apart);
            free(ref);
        }
        free(x), free(y0), free(y), free(scratch);
        weights_free(&w);
    }
}

static void test_fp16_products(void) { check_products(0); }
static void test_q4_products(void) { check_products(1); }
static void test_q4_parts_products(void) { check_products(3); }

/* The paths this machine can run: the portable one first, then AVX2 and AVX-512 where the CPU has
 * them, and the AVX-512 kernels on SIMDe's portable C everywhere. */
static int paths_here(fg_isa *paths) {
    int n = 0;
    paths[n++] = FG_ISA_PORTABLE;
    if (fg_isa_of_cpu() >= FG_ISA_AVX2) paths[n++] = FG_ISA_AVX2;
    if (fg_isa_of_cpu() >= FG_ISA_AVX512 && matmul_avx512()) paths[n++] = FG_ISA_AVX512;
    paths[n++] = FG_ISA_AVX512_SIMDE;
    return n;
}

/* lm_head: y = x E^T for E [n][dim], fp16 and 4-bit ([1][n][dim], grouped along n). */
static void check_embed_t(int q4) {
    /* rows 1 .. 9 and 64: the dot products (tiles of 4 rows, E 3 rows at a time, 70 = 3 x 23 + 1);
     * 65: sgemm on widened blocks. dim: tails after the 8 lanes. */
    static const int shapes[][3] = {{1, 13, 70},  {3, 64, 129}, {5, 100, 64}, {9, 37, 200}, {64, 24, 71},
                                    {65, 40, 130}, {1, 64, 131}, {2, 19, 67},  {4, 32, 65}, {7, 48, 66}};
    for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
        int rows = shapes[s][0], dim = shapes[s][1], n = shapes[s][2];
        uint64_t seed = 3 + s;
        fp16 *e16 = malloc((size_t)n * dim * sizeof *e16);
        float *ev = malloc((size_t)n * dim * sizeof *ev), *vt = malloc((size_t)n * dim * sizeof *vt);
        uint8_t *e4 = malloc(q4_bytes(1, (size_t)n, (size_t)dim));
        for (size_t i = 0; i < (size_t)n * dim; i++) ev[i] = fp16_to_fp32(e16[i] = fp32_to_fp16(test_uniform(&seed) - 0.5f));
        q4_compress(ev, 1, (size_t)n, (size_t)dim, e4);
        if (q4) q4_decompress(e4, 1, (size_t)n, (size_t)dim, ev);
        float *terms = malloc((size_t)n * dim * sizeof *terms); /* 4-bit: |scale q| + |min|, [dim][n] */
        size_t G = ((size_t)n + Q4_GROUP - 1) / Q4_GROUP;
        const fp16 *mins = (const fp16 *)(e4 + G * (Q4_GROUP / 2) * dim), *scales = mins + G * dim;
        for (int v = 0; v < n; v++) /* the reference multiplies by [dim][n] */
            for (int d = 0; d < dim; d++) {
                vt[(size_t)d * n + v] = ev[(size_t)v * dim + d];
                uint8_t byte = e4[(size_t)(v / 2) * dim + d];
                int q = v % 2 ? byte & 15 : byte >> 4;
                size_t at = (size_t)(v / Q4_GROUP) * dim + d;
                terms[(size_t)d * n + v] = fabsf(fp16_to_fp32(scales[at]) * (float)q) + fabsf(fp16_to_fp32(mins[at]));
            }
        const float *decode_terms = q4 && rows <= MATMUL_EMBED_DOT_ROWS ? terms : NULL; /* from the codes */
        float *x = random_floats((size_t)rows * dim, 5 + s), *y = malloc((size_t)rows * n * sizeof *y);
        size_t stride = (size_t)MATMUL_EMBED_BLOCK * dim;
        float *scratch = malloc(stride * omp_get_max_threads() * sizeof *scratch);
        matmul_embed_t(x, rows, dim, q4 ? (const void *)e4 : (const void *)e16, q4, n, y, scratch, stride);
        int bad = count_apart_terms(x, rows, dim, vt, decode_terms, n, NULL, y, NULL);
        EXPECT(bad == 0, "%s embedding, rows %d, dim %d, n %d: %d elements outside the bound",
               q4 ? "4-bit" : "fp16", rows, dim, n, bad);
        float *ref = malloc((size_t)rows * n * sizeof *ref);
        embed_t_reference(x, rows, dim, q4 ? (const void *)e4 : (const void *)e16, q4, n, ref);
        int ref_bad = count_outside(x, rows, dim, vt, n, NULL, ref);
        int apart = count_apart_terms(x, rows, dim, vt, decode_terms, n, NULL, y, ref);
        EXPECT(ref_bad == 0 && apart == 0, "%s embedding, rows %d, dim %d, n %d: embed_t_reference has %d "
               "elements outside the bound, the kernel %d apart from it", q4 ? "4-bit" : "fp16", rows, dim, n,
               ref_bad, apart);
        free(ref);
        fg_isa paths[4];
        for (int p = 0, n_paths = paths_here(paths); p < n_paths; p++) { /* every path: the same bits */
            float *yp = malloc((size_t)rows * n * sizeof *yp);
            matmul_force_isa(paths[p]);
            matmul_embed_t(x, rows, dim, q4 ? (const void *)e4 : (const void *)e16, q4, n, yp, scratch, stride);
            matmul_force_isa(-1);
            EXPECT(!memcmp(y, yp, (size_t)rows * n * sizeof *y), "%s embedding, rows %d, dim %d, n %d: the %s path differs",
                   q4 ? "4-bit" : "fp16", rows, dim, n, fg_isa_name(paths[p]));
            free(yp);
        }
        float *row = malloc((size_t)dim * sizeof *row); /* and a row looked up */
        matmul_embed_row(q4 ? (const void *)e4 : (const void *)e16, q4, n, dim, n - 1, row);
        EXPECT(!memcmp(row, ev + (size_t)(n - 1) * dim, (size_t)dim * sizeof *row), "%s row %d differs",
               q4 ? "4-bit" : "fp16", n - 1);
        free(e16), free(ev), free(vt), free(terms), free(e4), free(x), free(y), free(scratch), free(row);
    }
}

static void test_fp16_embed_t(void) { check_embed_t(0); }
static void test_q4_embed_t(void) { check_embed_t(1); }

/* Every product of check_products, and the decode shapes of every tile, on each path: the same
 * bits as the portable path (each element is the same chain of fused multiply-adds). check_embed_t
 * compares lm_head's paths. */
static const int DECODE_SHAPES[][3] = {{1, 40, 512}, {2, 33, 448}, {3, 70, 320}, {4, 17, 256}, {5, 48, 192},
                                       {6, 20, 128}, {7, 35, 640}, {8, 64, 576}, {9, 19, 384}, {16, 50, 256}};
enum { N_DECODE_SHAPES = sizeof DECODE_SHAPES / sizeof *DECODE_SHAPES };

static void paths_agree_on(int q4, const int *shape, uint64_t seed, const fg_isa *paths, int n_paths) {
    int rows = shape[0], in = shape[1], out = shape[2];
    weights w;
    weights_make(&w, in, out, q4 ? q4 : 1, seed);
    float *x = random_floats((size_t)rows * in, seed + 2), *y[4];
    float *scratch = malloc(matmul_scratch_floats(in, out) * sizeof *scratch);
    for (int p = 0; p < n_paths; p++) {
        y[p] = random_floats((size_t)rows * out, seed + 6);
        matmul_force_isa(paths[p]);
        matmul_weights(x, rows, in, q4 ? (const void *)w.w4 : (const void *)w.w16, q4, out, y[p], 1, 0, rows > MATMUL_DECODE_ROWS, scratch, NULL, NULL);
        matmul_force_isa(-1);
        EXPECT(!memcmp(y[0], y[p], (size_t)rows * out * sizeof(float)),
               "%s, %d part(s), rows %d, in %d, out %d: the %s path differs from the portable one",
               q4 ? "4-bit" : "fp16", q4, rows, in, out, fg_isa_name(paths[p]));
    }
    for (int p = 0; p < n_paths; p++) free(y[p]);
    free(x), free(scratch);
    weights_free(&w);
}

static void test_paths_agree(void) {
    fg_isa paths[4];
    int n = paths_here(paths);
    printf("\n    paths: portable%s%s, avx512-simde; native AVX-512 %s; native VNNI %s; native AVX-VNNI %s\n",
           n > 2 ? ", avx2" : "", n > 3 ? ", avx512" : "", n > 3 ? "tested" : "not on this CPU",
           n > 3 && (fg_cpu_features() & FG_CPU_AVX512VNNI) ? "tested (int8 suites)" : "not on this CPU",
           fg_cpu_features() & FG_CPU_AVXVNNI ? "tested (int8 suites)" : "not on this CPU");
    for (int q4 = 0; q4 < 4; q4 += q4 == 1 ? 2 : 1) { /* fp16, 4-bit, 4-bit in 3 parts */
        for (size_t s = 0; s < (q4 == 3 ? N_PARTS_SHAPES : N_SHAPES); s++) paths_agree_on(q4, shape_of(q4, s), 17 + s, paths, n);
        for (size_t s = 0; s < N_DECODE_SHAPES && q4 < 3; s++) paths_agree_on(q4, DECODE_SHAPES[s], 41 + s, paths, n);
    }
}

/* Up to MATMUL_DECODE_ROWS rows, a row's result does not depend on the rows beside it: decode of
 * one sequence gives the same bits in a GPU batch of any size. */
static void test_rows_independent(void) {
    int rows = MATMUL_DECODE_ROWS, in = 300, out = 130;
    weights w;
    weights_make(&w, in, out, 1, 31);
    float *x = random_floats((size_t)rows * in, 37), *all = malloc((size_t)rows * out * sizeof *all);
    float *one = malloc((size_t)out * sizeof *one);
    matmul_weights(x, rows, in, w.w16, 0, out, all, 0, 0, 0, NULL, NULL, NULL);
    int differ = 0;
    for (int r = 0; r < rows; r++) {
        matmul_weights(x + (size_t)r * in, 1, in, w.w16, 0, out, one, 0, 0, 0, NULL, NULL, NULL);
        differ += memcmp(one, all + (size_t)r * out, (size_t)out * sizeof *one) != 0;
    }
    EXPECT(differ == 0, "%d of %d rows differ computed alone", differ, rows);
    free(x), free(all), free(one);
    weights_free(&w);
}

/* Prefill's products give the same bits on 1, 2 and 3 threads: fp16 and 4-bit weights, fp32 and
 * bf16 prefill, and lm_head past its dot rows, on shapes whose k is not a multiple of 32 and whose
 * rows and columns are more than one of sgemm_fixed_tiles' tiles. A threaded sgemm splits the
 * sums by the thread count (OpenBLAS's Haswell and Zen cores always; every core from k = 336);
 * make test's matrix runs this on each OpenBLAS core the CPU can run. */
static void test_threads_change_no_bit(void) {
    static const int shapes[][3] = {{600, 336, 1100}, {MATMUL_DECODE_ROWS + 1, 100, 200}, {300, 2050, 130}};
    static const char *const names[] = {"fp16", "4-bit", "bf16 prefill on fp16"};
    int saved = omp_get_max_threads();
    for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
        int rows = shapes[s][0], in = shapes[s][1], out = shapes[s][2];
        weights w;
        weights_make(&w, in, out, 1, 61 + s);
        float *x = random_floats((size_t)rows * in, 67 + s);
        float *scratch = malloc(matmul_scratch_floats(in, out) * sizeof *scratch);
        size_t n = (size_t)rows * out, embed_stride = (size_t)MATMUL_EMBED_BLOCK * in;
        float *y[3], *embed[3], *embed_scratch = malloc(embed_stride * 3 * sizeof *embed_scratch);
        for (int mode = 0; mode < 3; mode++) {
            for (int t = 0; t < 3; t++) {
                omp_set_num_threads(t + 1);
                y[t] = malloc(n * sizeof *y[t]);
                matmul_weights(x, rows, in, mode == 1 ? (const void *)w.w4 : w.w16, mode == 1, out, y[t], 0,
                               mode == 2 ? PRODUCTS_BF16_PREFILL : PRODUCTS_FP32, 1, scratch, NULL, NULL);
            }
            for (int t = 1; t < 3; t++)
                EXPECT(!memcmp(y[0], y[t], n * sizeof *y[0]), "%s, rows %d, in %d, out %d: %d threads give other bits "
                       "than 1 (OpenBLAS's %s core)", names[mode], rows, in, out, t + 1, openblas_get_corename());
            for (int t = 0; t < 3; t++) free(y[t]);
        }
        /* lm_head: x [rows][in] times the table [out][in] (its rows as in) */
        for (int t = 0; t < 3; t++) {
            omp_set_num_threads(t + 1);
            embed[t] = malloc(n * sizeof *embed[t]);
            matmul_embed_t(x, rows, in, w.w16, 0, out, embed[t], embed_scratch, embed_stride);
        }
        for (int t = 1; t < 3; t++)
            EXPECT(!memcmp(embed[0], embed[t], n * sizeof *embed[0]), "lm_head, rows %d, dim %d, vocabulary %d: %d "
                   "threads give other bits than 1", rows, in, out, t + 1);
        for (int t = 0; t < 3; t++) free(embed[t]);
        free(x), free(scratch), free(embed_scratch);
        weights_free(&w);
    }
    omp_set_num_threads(saved);
}

/* The int8 rounding loops (int8.c: prefill's rows and columns, and the finish) run the build of
 * the path, as the rest of the kernels: FLEXGEN_ISA's, or the CPU's widest held to AVX2 by
 * FLEXGEN_TEST_CPU (make test's matrix), not the CPU's by cpuid alone; every build the same bits. */
static void test_int8_rounding_path(void) {
    enum { ROWS = 3, IN = 200 };
    float *x = random_floats(ROWS * IN, 71), alpha[ROWS];
    int8_t x8[ROWS * IN];
    int8_round_rows(x, ROWS, IN, x8, alpha);
    fg_isa isa = fg_isa_active();
    const char *want = isa == FG_ISA_AVX512 ? "avx512" : isa != FG_ISA_PORTABLE && fg_cpu_has_avx2() ? "avx2" : "default";
    EXPECT(!strcmp(int8_rounding_path(), want), "FLEXGEN_ISA's path %s: the int8 rounding ran its %s build, expected %s",
           fg_isa_name(isa), int8_rounding_path(), want);
    free(x);
}

/* ---- 4-bit weights times int8 activations (support/int8.c) ---- */

/* Code, scale and min of W[k][c] in 4-bit bytes of `parts` parts side by side (quant.c's layout). */
static void q4_parts_at(const uint8_t *w4, int parts, int out, int k, int c, int *q, float *scale, float *min) {
    int part = out / parts, G = (part + Q4_GROUP - 1) / Q4_GROUP, s = c / part, j = c % part, g = j / Q4_GROUP;
    size_t part_bytes = q4_bytes(1, (size_t)part, 1);
    const uint8_t *p = w4 + (size_t)k * parts * part_bytes + s * part_bytes;
    fp16 h[2];
    memcpy(&h[0], p + G * (Q4_GROUP / 2) + 2 * g, 2);
    memcpy(&h[1], p + G * (Q4_GROUP / 2 + 2) + 2 * g, 2);
    *min = fp16_to_fp32(h[0]), *scale = fp16_to_fp32(h[1]);
    *q = (p[g * (Q4_GROUP / 2) + j % Q4_GROUP / 2] >> (j % 2 ? 0 : 4)) & 15;
}

/* What the scheme computes for y[r][c], in double, from the same int8 operands as the kernel:
 * per block of 64 k, a = x s in fp32, alpha = max|a| / 127, a8 = round(a (127 / max|a|)); the
 * sum of alpha sum a8 q + sum x m. Also its bound from fp32 (msum in 64 terms, the fmaf, nb + 1
 * additions into y) and the bound from rounding a to int8, against the exact sum *exact. */
static double int8_scheme(const float *xr, int in, const uint8_t *w4, int parts, int out, int c, double y0,
                          double *fp_bound, double *q_bound, double *exact) {
    double y = y0, mag = fabs(y0), msum_mag = 0, u = 0x1p-24;
    *q_bound = 0, *exact = y0;
    for (int k0 = 0; k0 < in; k0 += 64) {
        int kc = in - k0 < 64 ? in - k0 : 64, q[64];
        float a[64], s, m, big = 0;
        double msum = 0, mm = 0;
        for (int k = 0; k < kc; k++) {
            q4_parts_at(w4, parts, out, k0 + k, c, &q[k], &s, &m);
            a[k] = xr[k0 + k] * s;
            big = fmaxf(big, fabsf(a[k]));
            msum += (double)xr[k0 + k] * m, mm += fabs((double)xr[k0 + k] * m);
            *exact += (double)xr[k0 + k] * ((double)q[k] * s + m);
        }
        float alpha = big / 127, inv = 127 / big;
        long isum = 0;
        for (int k = 0; k < kc && big > 0; k++) {
            isum += (long)nearbyintf(a[k] * inv) * q[k];
            *q_bound += (alpha * (0.5 + 127 * u) + 3.1 * u * fabs(a[k])) * q[k];
        }
        double t = (big > 0 ? (double)alpha * isum : 0) + msum;
        y += t, mag += fabs(t) + mm, msum_mag += mm;
    }
    int nb = (in + 63) / 64;
    *fp_bound = gamma_n(65) * msum_mag + gamma_n(nb + 2) * mag;
    return y;
}

/* Decode without a panel (rows 1 .. 8, in a multiple of 64: the path's int8_pairs, support/avx512.c's
 * or int8.c's AVX2 one, for the runs of whole groups, in pairs), alone and as q|k|v, run on one
 * thread, so that each part's groups are one run however many cores there are: first where a
 * part's last group is narrower than 64 columns (100, 136, 228 and 200 columns a part: a narrow
 * group after one, two, three and three whole ones); then parts of whole groups, 448 columns (7
 * groups: three pairs and one left over) over one block of k, 128 (a single pair), 640 (5 pairs,
 * past a chunk of 8 groups) over 5 blocks (past a span of 4), and 1088 (17 groups: 8 pairs, past
 * two chunks, and one left over) over 9 blocks; last, more rows than the kernels take in a pass
 * (4): 7 (a pass of 4, then 3) and 8, then 32, past them, on the panel. */
static const int NARROW_SHAPES[][3] = {{1, 128, 100}, {2, 128, 136}, {3, 192, 228},  {4, 128, 200}, {1, 64, 448},
                                       {2, 64, 128},  {3, 320, 640}, {4, 576, 1088}, {7, 320, 640}, {32, 128, 1088}};
static const int NARROW_PARTS_SHAPES[][3] = {{1, 128, 300},  {2, 128, 408}, {3, 128, 684},  {4, 256, 600},
                                             {4, 64, 1344},  {3, 64, 384},  {2, 320, 1920}, {1, 576, 3264},
                                             {8, 128, 684}, {32, 64, 384}};
enum { N_NARROW = sizeof NARROW_SHAPES / sizeof *NARROW_SHAPES };

/* y of n floats with a tail of CANARY floats past them, each of the bytes 0xa5, which a kernel
 * that writes past y changes; guarded_copy fills y from y0 and sets the tail again. */
enum { CANARY = 64 };
static float *guarded_floats(size_t n) { return malloc((n + CANARY) * sizeof(float)); }

static void guarded_copy(float *y, const float *y0, size_t n) {
    memcpy(y, y0, n * sizeof *y);
    memset(y + n, 0xa5, CANARY * sizeof *y);
}

static int tail_intact(const float *y, size_t n) {
    const unsigned char *tail = (const unsigned char *)(y + n);
    for (size_t i = 0; i < CANARY * sizeof *y; i++)
        if (tail[i] != 0xa5) return 0;
    return 1;
}

/* The kernel (on the path the CPU takes) against int8_scheme, and against the exact product
 * within the int8 rounding's bound; then every other path this machine runs (the integer sums by
 * VNNI on the AVX-512 ones, native where the CPU has it, and on SIMDe everywhere), which must give
 * the same bits. No path writes past y. */
static void check_int8_products(int parts) {
    size_t n_shapes = parts == 3 ? N_PARTS_SHAPES : N_SHAPES;
    for (size_t s = 0; s < n_shapes + N_NARROW; s++) {
        const int *shape = s < n_shapes ? shape_of(parts, s) : parts == 3 ? NARROW_PARTS_SHAPES[s - n_shapes]
                                                                           : NARROW_SHAPES[s - n_shapes];
        int rows = shape[0], in = shape[1], out = shape[2];
        size_t n = (size_t)rows * out;
        weights w;
        weights_make(&w, in, out, parts, 41 + s);
        float *x = random_floats((size_t)rows * in, 43 + s), *y0 = random_floats(n, 47 + s);
        float *y = guarded_floats(n), *yp = guarded_floats(n);
        int threads = omp_get_max_threads();
        if (s >= n_shapes) omp_set_num_threads(1); /* each part's whole groups one run, whatever the cores */
        for (int acc = 0; acc < 2; acc++) {
            guarded_copy(y, y0, n);
            matmul_int8_blocks(x, rows, in, w.w4, parts, out, y, acc);
            EXPECT(tail_intact(y, n), "int8 x 4-bit, %d part(s), rows %d, in %d, out %d%s: the CPU's own path wrote "
                   "past y", parts, rows, in, out, acc ? ", adding" : "");
            int fp_bad = 0, q_bad = 0;
            double worst = 0;
            for (int r = 0; r < rows; r++)
                for (int c = 0; c < out; c++) {
                    double fp_bound, q_bound, exact, got = y[(size_t)r * out + c];
                    double want = int8_scheme(x + (size_t)r * in, in, w.w4, parts, out, c, acc ? y0[(size_t)r * out + c] : 0,
                                              &fp_bound, &q_bound, &exact);
                    fp_bad += fabs(got - want) > fp_bound;
                    q_bad += fabs(got - exact) > q_bound + fp_bound;
                    if (q_bound > 0 && fabs(got - exact) / q_bound > worst) worst = fabs(got - exact) / q_bound;
                }
            EXPECT(fp_bad == 0 && q_bad == 0, "int8 x 4-bit, %d part(s), rows %d, in %d, out %d%s: %d elements "
                   "apart from the scheme in double beyond fp32's bound, %d from the exact product beyond the "
                   "int8 rounding's bound (the worst at %.2f of it)", parts, rows, in, out, acc ? ", adding" : "",
                   fp_bad, q_bad, worst);
            fg_isa paths[4];
            for (int p = 0, n_paths = paths_here(paths); p < n_paths; p++) {
                guarded_copy(yp, y0, n);
                matmul_force_isa(paths[p]);
                int vnni = matmul_int8_sums() != NULL;
                matmul_int8_blocks(x, rows, in, w.w4, parts, out, yp, acc);
                matmul_force_isa(-1);
                EXPECT(!memcmp(y, yp, (size_t)rows * out * sizeof *y), "int8 x 4-bit, %d part(s), rows %d, in %d, "
                       "out %d%s: the %s path%s differs from the CPU's own", parts, rows, in, out,
                       acc ? ", adding" : "", fg_isa_name(paths[p]), vnni ? " (VNNI)" : "");
                EXPECT(tail_intact(yp, n), "int8 x 4-bit, %d part(s), rows %d, in %d, out %d%s: the %s path%s wrote "
                       "past y", parts, rows, in, out, acc ? ", adding" : "", fg_isa_name(paths[p]), vnni ? " (VNNI)" : "");
            }
            /* AVX-VNNI's sums on the avx2 path: their AVX2 stand-in everywhere, the instruction where
             * the CPU has it */
            for (int native = 0; native < 2 && fg_isa_of_cpu() >= FG_ISA_AVX2; native++) {
                if (native && !(fg_cpu_features() & FG_CPU_AVXVNNI)) break;
                guarded_copy(yp, y0, n);
                matmul_q4_int8(x, rows, in, w.w4, parts, out, yp, acc, 1, int8_sums_vnni256(native), NULL);
                EXPECT(!memcmp(y, yp, (size_t)rows * out * sizeof *y), "int8 x 4-bit, %d part(s), rows %d, in %d, "
                       "out %d%s: the AVX-VNNI sums (%s) differ from the CPU's own path", parts, rows, in, out,
                       acc ? ", adding" : "", native ? "native" : "on AVX2");
                EXPECT(tail_intact(yp, n), "int8 x 4-bit, %d part(s), rows %d, in %d, out %d%s: the AVX-VNNI sums "
                       "(%s) wrote past y", parts, rows, in, out, acc ? ", adding" : "", native ? "native" : "on AVX2");
            }
        }
        omp_set_num_threads(threads);
        free(x), free(y0), free(y), free(yp);
        weights_free(&w);
    }
}

static void test_int8_products(void) { check_int8_products(1); }
static void test_int8_parts_products(void) { check_int8_products(3); }

/* Activations with one large value in a block (as OPT's outlier features): the block's other
 * values keep only 127 levels of it, and the result still keeps the bound. A block of zeros
 * gives alpha 0, not a division by zero. Every path gives the same bits (4 rows over 5 groups:
 * int8_pairs on each thread's pair, 2 or 3 groups, and the group left over block by block). */
static void test_int8_outliers_and_zeros(void) {
    int rows = 4, in = 192, out = 320;
    weights w;
    weights_make(&w, in, out, 1, 53);
    float *x = random_floats((size_t)rows * in, 59), *y = malloc((size_t)rows * out * sizeof *y);
    x[5] = 60.0f, x[in + 70] = -300.0f;                  /* outliers in rows 0 and 1 */
    for (int k = 64; k < 128; k++) x[2 * in + k] = 0;    /* row 2's second block: zeros */
    for (int k = 0; k < in; k++) x[3 * in + k] = 0;      /* row 3: all zeros */
    matmul_int8_blocks(x, rows, in, w.w4, 1, out, y, 0);
    int bad = 0, finite = 1;
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < out; c++) {
            double fp_bound, q_bound, exact, got = y[(size_t)r * out + c];
            int8_scheme(x + (size_t)r * in, in, w.w4, 1, out, c, 0, &fp_bound, &q_bound, &exact);
            bad += fabs(got - exact) > q_bound + fp_bound;
            finite &= isfinite(got);
            if (r == 3) bad += got != 0;
        }
    EXPECT(bad == 0 && finite, "%d elements beyond the bound (row 3, all zeros, must give 0), finite: %d", bad, finite);
    fg_isa paths[4];
    float *yp = malloc((size_t)rows * out * sizeof *yp);
    for (int p = 0, n_paths = paths_here(paths); p < n_paths; p++) {
        matmul_force_isa(paths[p]);
        matmul_int8_blocks(x, rows, in, w.w4, 1, out, yp, 0);
        matmul_force_isa(-1);
        EXPECT(!memcmp(y, yp, (size_t)rows * out * sizeof *y), "outliers and zeros: the %s path differs from the CPU's own",
               fg_isa_name(paths[p]));
    }
    free(x), free(y), free(yp);
    weights_free(&w);
}

/* ============================================================================================
 * The opt-in prefill schemes: onednn.c's two products, int8.c's rows rounded once, bf16
 * ============================================================================================ */

static int8_t random_int8(uint64_t *seed) { return (int8_t)((int)(test_uniform(seed) * 255.0f) - 127); }

/* A path of gemm_s8 that may run for b within +-b_max: oneDNN's on a kernel whose int8 sums
 * are int32 (VNNI or AMX), or on any of its kernels where b_max <= INT8_W_MAX (their int16 pairs
 * cannot saturate); else the AVX2 kernel where the CPU's kernels may use AVX2, else the plain
 * loops. */
static int s8_path_allowed(const char *path, int b_max) {
    if (!strncmp(path, "onednn ", 7)) return b_max <= INT8_W_MAX || strstr(path, "vnni") || strstr(path, "amx");
    return !strcmp(path, fg_cpu_has_avx2() ? "avx2 (exact int16 pairs)" : "portable");
}

/* Integer sums are exact: gemm_s8 (on oneDNN where the build has it and its kernel for this CPU
 * keeps int8 sums exact for b's range, else on this project's kernels) gives the plain loops'
 * bits, on full-range operands and on the prefill scheme's 7-bit b, whose worst case (a's rows all
 * -127 or all 127 against b's columns all -64 or all 64: pairs of (a + 128) b reach 2 x 255 x 64)
 * comes first; and gemm_path names a path that may run. */
static void test_gemm_s8(void) {
    static const int shapes[][3] = {{65, 64, 64}, {67, 130, 75}, {300, 256, 1000}, {128, 8, 3}, {1, 1, 1}};
    uint64_t seed = 61;
    for (int narrow = 0; narrow < 2; narrow++)
        for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
            int m = shapes[s][0], n = shapes[s][1], k = shapes[s][2], b_max = narrow ? INT8_W_MAX : 127;
            int8_t *a = malloc((size_t)m * k), *b = malloc((size_t)k * n);
            int32_t *c = malloc((size_t)m * n * sizeof *c), *want = malloc((size_t)m * n * sizeof *want);
            for (size_t i = 0; i < (size_t)m * k; i++) a[i] = random_int8(&seed);
            for (size_t i = 0; i < (size_t)k * n; i++) b[i] = (int8_t)(random_int8(&seed) * b_max / 127);
            for (int p = 0; p < k; p++) { /* row 0 of a all 127, column 0 of b all b_max, and the negatives */
                a[p] = 127;
                b[(size_t)p * n] = (int8_t)b_max;
                if (m > 1) a[(size_t)k + p] = -127;
                if (n > 1) b[(size_t)p * n + 1] = (int8_t)-b_max;
            }
            gemm_s8(m, n, k, a, b, b_max, c);
            gemm_s8_reference(m, n, k, a, b, want);
            EXPECT(!memcmp(c, want, (size_t)m * n * sizeof *c), "gemm_s8 %d x %d x %d, |b| <= %d, on %s: sums differ "
                   "from the plain loops'", m, n, k, b_max, gemm_path(0));
            EXPECT(s8_path_allowed(gemm_path(0), b_max), "gemm_s8 %d x %d x %d, |b| <= %d: gemm_path says it ran on "
                   "'%s', not a path that keeps int8 sums exact here", m, n, k, b_max, gemm_path(0));
            free(a);
            free(b);
            free(c);
            free(want);
        }
}

/* gemm_s8_pairs, the AVX2 kernel of int16 pairs, against the plain loops: the worst operands for
 * sums in int16 (rows of a and columns of b all -128 or all 127, whose pairs of products reach
 * +-2^15), full-range random ones, and shapes that end inside a register tile (4 x 16), a tile
 * of c (96 x 128), a block of k (512) and a pair of k. */
static void test_gemm_s8_pairs(void) {
    static const int shapes[][3] = {{1, 1, 1}, {5, 17, 3}, {4, 16, 2}, {97, 129, 513}, {203, 301, 1101}, {66, 40, 1024}};
    if (!(fg_cpu_features() & FG_CPU_AVX2)) {
        int32_t c = 0;
        int8_t one = 1;
        EXPECT(gemm_s8_pairs(1, 1, 1, &one, &one, &c) == -1, "gemm_s8_pairs ran on a CPU without AVX2");
        return;
    }
    uint64_t seed = 63;
    for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
        int m = shapes[s][0], n = shapes[s][1], k = shapes[s][2];
        int8_t *a = malloc((size_t)m * k), *b = malloc((size_t)k * n);
        int32_t *c = malloc((size_t)m * n * sizeof *c), *want = malloc((size_t)m * n * sizeof *want);
        for (int i = 0; i < m; i++) /* rows: -128s, 127s, then random */
            for (int p = 0; p < k; p++)
                a[(size_t)i * k + p] = i % 3 == 0 ? -128 : i % 3 == 1 ? 127 : (int8_t)(test_uniform(&seed) * 256 - 128);
        for (int p = 0; p < k; p++) /* columns: 127s, -128s, alternating, then random */
            for (int j = 0; j < n; j++)
                b[(size_t)p * n + j] = j % 4 == 0 ? 127 : j % 4 == 1 ? -128 : j % 4 == 2 ? (p % 2 ? 127 : -128)
                                                                       : (int8_t)(test_uniform(&seed) * 256 - 128);
        memset(c, 0x5a, (size_t)m * n * sizeof *c); /* every sum must be written */
        int rc = gemm_s8_pairs(m, n, k, a, b, c);
        gemm_s8_reference(m, n, k, a, b, want);
        int differ = 0;
        for (size_t i = 0; i < (size_t)m * n; i++) differ += c[i] != want[i];
        EXPECT(rc == 0 && differ == 0, "gemm_s8_pairs %d x %d x %d: returned %d, %d of %d sums differ from the plain "
               "loops'", m, n, k, rc, differ, m * n);
        free(a);
        free(b);
        free(c);
        free(want);
    }
}

/* bf16 operands: each product is exact in fp32 (8-bit significands), so oneDNN and the plain
 * loops differ only in the order of the fp32 sums: both within gamma_k of the terms' magnitudes
 * of the exact sum. */
static void test_gemm_bf16(void) {
    static const int shapes[][3] = {{65, 64, 64}, {67, 130, 75}, {200, 256, 1000}, {1, 3, 1}};
    uint64_t seed = 67;
    for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
        int m = shapes[s][0], n = shapes[s][1], k = shapes[s][2];
        uint16_t *a = malloc((size_t)m * k * sizeof *a), *b = malloc((size_t)k * n * sizeof *b);
        for (size_t i = 0; i < (size_t)m * k; i++) a[i] = fp32_to_bf16(test_uniform(&seed) * 2 - 1);
        for (size_t i = 0; i < (size_t)k * n; i++) b[i] = fp32_to_bf16(test_uniform(&seed) * 2 - 1);
        float *c = malloc((size_t)m * n * sizeof *c), *ref = malloc((size_t)m * n * sizeof *ref);
        gemm_bf16(m, n, k, a, b, c);
        gemm_bf16_reference(m, n, k, a, b, ref);
        int bad = 0;
        for (int i = 0; i < m; i++)
            for (int j = 0; j < n; j++) {
                double exact = 0, mag = 0;
                for (int p = 0; p < k; p++) {
                    double t = (double)bf16_to_fp32(a[(size_t)i * k + p]) * bf16_to_fp32(b[(size_t)p * n + j]);
                    exact += t;
                    mag += fabs(t);
                }
                bad += fabs(c[(size_t)i * n + j] - exact) > gamma_n(k) * mag;
                bad += fabs(ref[(size_t)i * n + j] - exact) > gamma_n(k) * mag;
            }
        EXPECT(bad == 0, "gemm_bf16 %d x %d x %d on %s: %d sums beyond the fp32 bound", m, n, k, gemm_path(1), bad);
        EXPECT(!strncmp(gemm_path(1), "onednn ", 7) || !strcmp(gemm_path(1), "fp32 sgemm of bf16 operands"),
               "gemm_bf16 %d x %d x %d: gemm_path says it ran on '%s'", m, n, k, gemm_path(1));
        free(a);
        free(b);
        free(c);
        free(ref);
    }
}

/* fp32 to bf16: to nearest, ties to even; infinities and signed zeros kept; a NaN stays a NaN. */
static void test_bf16_rounding(void) {
    static const struct { uint32_t in; uint16_t out; } cases[] = {
        {0x3f800000, 0x3f80}, {0x3f808000, 0x3f80}, {0x3f818000, 0x3f82}, {0x3f808001, 0x3f81},
        {0x3f807fff, 0x3f80}, {0xbf818000, 0xbf82}, {0x80000000, 0x8000}, {0x7f800000, 0x7f80},
        {0x7f7fffff, 0x7f80}, {0x00000001, 0x0000}, {0x00018000, 0x0002}};
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        float f;
        memcpy(&f, &cases[i].in, 4);
        EXPECT(fp32_to_bf16(f) == cases[i].out, "fp32_to_bf16(0x%08x) = 0x%04x; want 0x%04x", cases[i].in,
               fp32_to_bf16(f), cases[i].out);
    }
    float nan = NAN;
    EXPECT(isnan(bf16_to_fp32(fp32_to_bf16(nan))), "a NaN rounded to bf16 is no longer a NaN");
}

/* int8.c's prefill scheme as its comment defines it, on the widened values v[in][out]: x's row
 * rounded once, v's column once, the exact integer sum, then the two scales. */
static int8_t scheme_round(float v) {
    v = v < 127.0f ? v : 127.0f;
    v = v > -127.0f ? v : -127.0f;
    return (int8_t)nearbyintf(v);
}

static float int8_rows_scheme(const float *xr, int in, const float *v, int out, int c, float y0, int acc,
                              double *bound, double *exact) {
    float top = 0, col = 0;
    for (int k = 0; k < in; k++) top = fabsf(xr[k]) > top ? fabsf(xr[k]) : top;
    for (int k = 0; k < in; k++) col = fabsf(v[(size_t)k * out + c]) > col ? fabsf(v[(size_t)k * out + c]) : col;
    float alpha = top / 127.0f, scale = col / (float)INT8_W_MAX; /* W's columns in 7 bits */
    float inv = top > 0 ? 127.0f / top : 0.0f, inv_col = col > 0 ? (float)INT8_W_MAX / col : 0.0f;
    int64_t isum = 0;
    double q_bound = 0;
    *exact = acc ? y0 : 0;
    for (int k = 0; k < in; k++) {
        float w = v[(size_t)k * out + c];
        isum += (int64_t)scheme_round(xr[k] * inv) * scheme_round(w * inv_col);
        *exact += (double)xr[k] * w;
        q_bound += (fabs(xr[k]) * scale + alpha * fabs(w) + alpha * scale / 2) / 2;
    }
    float step = alpha * scale;
    float want = acc ? y0 + step * (float)isum : step * (float)isum;
    *bound = q_bound + 4 * 0x1p-24 * (fabs((double)step * isum) + fabs(y0));
    return want;
}

/* --int8-activations' prefill (any rows: a short prompt's too): the scheme's bits, and within its
 * rounding bound of the exact product; a row with an outlier, a row of zeros. */
static void check_int8_rows(int parts) {
    static const int shapes[][3] = {{2, 70, 384}, {9, 130, 288}, {65, 70, 384}, {70, 130, 288}, {100, 64, 192}, {129, 200, 96}};
    for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
        int rows = shapes[s][0], in = shapes[s][1], out = shapes[s][2];
        weights w;
        weights_make(&w, in, out, parts, 73 + s);
        float *x = random_floats((size_t)rows * in, 79 + s), *y0 = random_floats((size_t)rows * out, 83 + s);
        float *y = malloc((size_t)rows * out * sizeof *y), *scratch = malloc(matmul_scratch_floats(in, out) * sizeof *scratch);
        x[3] = 40.0f;                                   /* an outlier in row 0 */
        memset(x + in, 0, (size_t)in * sizeof *x);      /* row 1: zeros */
        float *bias = random_floats((size_t)out, 89 + s);
        /* variant 0: the product alone; 1: adding to y; 2: a bias in the finish; 3: a bias, then ReLU */
        for (int variant = 0; variant < 4; variant++) {
            int acc = variant == 1;
            matmul_epilogue after = {bias, variant == 3};
            memcpy(y, y0, (size_t)rows * out * sizeof *y);
            matmul_weights(x, rows, in, w.w4, parts, out, y, acc, PRODUCTS_INT8, 1, scratch, variant >= 2 ? &after : NULL,
                           NULL);
            int differ = 0, beyond = 0;
            for (int r = 0; r < rows; r++)
                for (int c = 0; c < out; c++) {
                    size_t at = (size_t)r * out + c;
                    double bound, exact;
                    float want = int8_rows_scheme(x + (size_t)r * in, in, w.v4, out, c, y0[at], acc, &bound, &exact);
                    if (variant >= 2) {
                        want = want + bias[c];
                        exact += bias[c];
                        bound += 0x1p-24 * fabs(want);
                    }
                    if (variant == 3) want = want > 0 ? want : 0, exact = exact > 0 ? exact : 0;
                    differ += memcmp(&want, &y[at], sizeof want) != 0;
                    beyond += fabs(y[at] - exact) > bound;
                }
            static const char *const variants[] = {"", ", adding", ", with a bias", ", with a bias and ReLU"};
            EXPECT(differ == 0 && beyond == 0, "int8 prefill, %d part(s), rows %d, in %d, out %d%s on %s: %d elements "
                   "differ from the scheme's bits, %d beyond its rounding bound", parts, rows, in, out,
                   variants[variant], gemm_path(0), differ, beyond);
        }
        free(bias);
        free(x);
        free(y0);
        free(y);
        free(scratch);
        weights_free(&w);
    }
}

static void test_int8_rows(void) { check_int8_rows(1); }

/* The opt-in schemes take prefill's products for a prompt of any rows, the workspace's panel or
 * none (a workspace of few rows has none); a decode step of up to MATMUL_DECODE_ROWS rows takes
 * decode's (int8 blocks, fp32), past that prefill's. And a prefill row's int8 bits do not depend
 * on the rows beside it, so a prompt is rounded the same way in any GPU batch. */
static void test_schemes_follow_phase(void) {
    enum { ROWS = MATMUL_DECODE_ROWS + 16, FEW = 5 };
    int in = 200, out = 192;
    size_t n = (size_t)ROWS * out;
    weights w;
    weights_make(&w, in, out, 1, 211);
    float *x = random_floats((size_t)ROWS * in, 223), *scratch = malloc(matmul_scratch_floats(in, out) * sizeof *scratch);
    float *y = malloc(n * sizeof *y), *want = malloc(n * sizeof *want);
    size_t few = (size_t)FEW * out;
    matmul_weights(x, FEW, in, w.w4, 1, out, y, 0, PRODUCTS_INT8, 0, NULL, NULL, NULL);
    matmul_int8_blocks(x, FEW, in, w.w4, 1, out, want, 0);
    EXPECT(!memcmp(y, want, few * sizeof *y), "int8 decode of %d rows: not the blocks' bits", FEW);
    matmul_weights(x, FEW, in, w.w4, 1, out, y, 0, PRODUCTS_BF16_PREFILL, 0, NULL, NULL, NULL);
    matmul_weights(x, FEW, in, w.w4, 1, out, want, 0, PRODUCTS_FP32, 0, NULL, NULL, NULL);
    EXPECT(!memcmp(y, want, few * sizeof *y), "bf16 prefill's decode of %d rows: not the fp32 bits", FEW);
    matmul_weights(x, ROWS, in, w.w4, 1, out, y, 0, PRODUCTS_INT8, 0, scratch, NULL, NULL);
    matmul_weights(x, ROWS, in, w.w4, 1, out, want, 0, PRODUCTS_INT8, 1, scratch, NULL, NULL);
    EXPECT(!memcmp(y, want, n * sizeof *y), "int8 decode of %d rows: not prefill's scheme", ROWS);
    matmul_weights(x, ROWS, in, w.w4, 1, out, y, 0, PRODUCTS_INT8, 1, scratch, NULL, NULL);
    int differ = 0;
    for (int r = 0; r < ROWS; r++) {
        matmul_weights(x + (size_t)r * in, 1, in, w.w4, 1, out, want, 0, PRODUCTS_INT8, 1, NULL, NULL, NULL);
        differ += memcmp(want, y + (size_t)r * out, (size_t)out * sizeof *y) != 0;
    }
    EXPECT(differ == 0, "int8 prefill: %d of %d rows differ from the row computed alone", differ, ROWS);
    matmul_weights(x, FEW, in, w.w4, 1, out, y, 0, PRODUCTS_BF16_PREFILL, 1, scratch, NULL, NULL);
    matmul_weights(x, FEW, in, w.w4, 1, out, want, 0, PRODUCTS_BF16_PREFILL, 1, NULL, NULL, NULL);
    EXPECT(!memcmp(y, want, few * sizeof *y), "bf16 prefill of %d rows: another panel, other bits", FEW);
    matmul_weights(x, FEW, in, w.w4, 1, out, want, 0, PRODUCTS_FP32, 1, scratch, NULL, NULL);
    EXPECT(memcmp(y, want, few * sizeof *y) != 0, "bf16 prefill of %d rows: fp32's bits, not bf16's", FEW);
    free(x), free(scratch), free(y), free(want);
    weights_free(&w);
}

/* W's int8 columns kept (made once, as the runtime keeps them with resident weights): every
 * product gives the bits of the columns made per call, over two panels of W, in 3 parts, with
 * rows that are not the kept layout's, adding or with a bias and ReLU; and a set finds each W. */
static void test_int8_rows_kept(void) {
    int wide = (int)(matmul_scratch_floats(1024, 1 << 20) / 1024); /* a panel's columns at in 1024 */
    const int shapes[][4] = {{65, 70, 384, 1}, {300, 1024, wide + 64, 1}, {129, 200, 288, 3}, {1000, 130, 192, 1}};
    for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
        int rows = shapes[s][0], in = shapes[s][1], out = shapes[s][2], parts = shapes[s][3];
        weights w, other;
        weights_make(&w, in, out, parts, 131 + s);
        weights_make(&other, in, out, parts, 137 + s);
        int8_column_set set = {0};
        EXPECT(int8_column_set_add(&set, other.w4, parts, in, out) == 0 &&
               int8_column_set_add(&set, w.w4, parts, in, out) == 0, "int8 columns of W [%d][%d]: not made", in, out);
        const int8_columns *kept = int8_column_set_find(&set, w.w4);
        EXPECT(kept && kept != int8_column_set_find(&set, other.w4) && !int8_column_set_find(&set, w.w16),
               "int8 columns of W [%d][%d]: the set finds another W's", in, out);
        float *x = random_floats((size_t)rows * in, 139 + s), *y0 = random_floats((size_t)rows * out, 149 + s);
        float *bias = random_floats((size_t)out, 151 + s);
        float *want = malloc((size_t)rows * out * sizeof *want), *y = malloc((size_t)rows * out * sizeof *y);
        float *scratch = malloc(matmul_scratch_floats(in, out) * sizeof *scratch);
        for (int variant = 0; variant < 3 && kept; variant++) {
            int acc = variant == 1;
            matmul_epilogue after = {bias, 1};
            memcpy(want, y0, (size_t)rows * out * sizeof *want);
            memcpy(y, y0, (size_t)rows * out * sizeof *y);
            matmul_weights(x, rows, in, w.w4, parts, out, want, acc, PRODUCTS_INT8, 1, scratch, variant == 2 ? &after : NULL, NULL);
            matmul_weights(x, rows, in, w.w4, parts, out, y, acc, PRODUCTS_INT8, 1, scratch, variant == 2 ? &after : NULL, &set);
            size_t differ = 0;
            for (size_t i = 0; i < (size_t)rows * out; i++) differ += memcmp(&want[i], &y[i], sizeof *y) != 0;
            EXPECT(strstr(gemm_path(0), ", W kept") != NULL, "int8 prefill, rows %d, "
                   "W [%d][%d], columns kept: the product ran on '%s', not on the kept copy", rows, in, out,
                   gemm_path(0));
            EXPECT(differ == 0, "int8 prefill, rows %d, W [%d][%d] in %d part(s), variant %d, columns kept, on %s: "
                   "%zu elements differ from the columns made per call", rows, in, out, parts, variant, gemm_path(0),
                   differ);
        }
        int8_column_set_free(&set);
        EXPECT(set.n == 0 && !int8_column_set_find(&set, w.w4), "int8 columns: the set still finds W after its free");
        free(x);
        free(y0);
        free(bias);
        free(want);
        free(y);
        free(scratch);
        weights_free(&w);
        weights_free(&other);
    }
}
static void test_int8_rows_parts(void) { check_int8_rows(3); }

/* --bf16-prefill: above MATMUL_DECODE_ROWS rows, within fp32's bound of the product of the
 * operands rounded to bf16; at or below it, the bits of the fp32 products (decode keeps them). */
static void check_bf16_prefill(int q4) {
    static const int shapes[][3] = {{65, 70, 384}, {70, 130, 192}, {129, 200, 96}};
    for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
        int rows = shapes[s][0], in = shapes[s][1], out = shapes[s][2];
        weights w;
        weights_make(&w, in, out, 1, 89 + s);
        const void *W = q4 ? (const void *)w.w4 : (const void *)w.w16;
        const float *v = q4 ? w.v4 : w.v16;
        float *x = random_floats((size_t)rows * in, 97 + s), *y0 = random_floats((size_t)rows * out, 101 + s);
        float *y = malloc((size_t)rows * out * sizeof *y), *y32 = malloc((size_t)rows * out * sizeof *y32);
        float *scratch = malloc(matmul_scratch_floats(in, out) * sizeof *scratch);
        for (int acc = 0; acc < 2; acc++) {
            memcpy(y, y0, (size_t)rows * out * sizeof *y);
            matmul_weights(x, rows, in, W, q4, out, y, acc, PRODUCTS_BF16_PREFILL, 1, scratch, NULL, NULL);
            int beyond = 0;
            for (int r = 0; r < rows; r++)
                for (int c = 0; c < out; c++) {
                    size_t at = (size_t)r * out + c;
                    double exact = acc ? y0[at] : 0, mag = acc ? fabs(y0[at]) : 0;
                    for (int k = 0; k < in; k++) {
                        double t = (double)bf16_to_fp32(fp32_to_bf16(x[(size_t)r * in + k])) *
                                   bf16_to_fp32(fp32_to_bf16(v[(size_t)k * out + c]));
                        exact += t;
                        mag += fabs(t);
                    }
                    beyond += fabs(y[at] - exact) > gamma_n(in + 1) * mag;
                }
            EXPECT(beyond == 0, "bf16 prefill, %s weights, rows %d, in %d, out %d%s on %s: %d elements beyond fp32's "
                   "bound of the bf16 operands' product", q4 ? "4-bit" : "fp16", rows, in, out, acc ? ", adding" : "",
                   gemm_path(1), beyond);
            int decode_rows = MATMUL_DECODE_ROWS;
            memcpy(y, y0, (size_t)decode_rows * out * sizeof *y);
            memcpy(y32, y0, (size_t)decode_rows * out * sizeof *y32);
            matmul_weights(x, decode_rows, in, W, q4, out, y, acc, PRODUCTS_BF16_PREFILL, 0, scratch, NULL, NULL);
            matmul_weights(x, decode_rows, in, W, q4, out, y32, acc, PRODUCTS_FP32, 0, scratch, NULL, NULL);
            EXPECT(!memcmp(y, y32, (size_t)decode_rows * out * sizeof *y), "bf16 prefill, %s weights, %d rows (decode): "
                   "not the fp32 products' bits", q4 ? "4-bit" : "fp16", decode_rows);
        }
        free(x);
        free(y0);
        free(y);
        free(y32);
        free(scratch);
        weights_free(&w);
    }
}

/* A linear layer's bias and ReLU (matmul_epilogue) on every product: in the int8 prefill
 * product's finish, after the others, and over W wider than one of prefill's panels (the second
 * panel's columns take their own bias): the bits of the product without them, then y + bias[j],
 * then max(0, y), as opt_model.c's linear_layer did in a pass of its own. */
static void test_epilogue(void) {
    int in = 1024, panel = (int)(matmul_scratch_floats(in, 1 << 20) / in), out = panel + 64;
    weights w;
    weights_make(&w, in, out, 1, 131);
    float *bias = random_floats((size_t)out, 137);
    float *scratch = malloc(matmul_scratch_floats(in, out) * sizeof *scratch);
    static const int row_counts[] = {3, MATMUL_DECODE_ROWS + 2};
    static const int products[] = {PRODUCTS_FP32, PRODUCTS_INT8, PRODUCTS_BF16_PREFILL};
    for (int ri = 0; ri < 2; ri++)
        for (int pi = 0; pi < 3; pi++)
            for (int q4 = 0; q4 < 2; q4++)
                for (int relu = 0; relu < 2; relu++) {
                    int rows = row_counts[ri];
                    size_t n = (size_t)rows * out;
                    float *x = random_floats((size_t)rows * in, 139 + ri);
                    float *want = random_floats(n, 149), *y = malloc(n * sizeof *y);
                    memcpy(y, want, n * sizeof *y);
                    const void *W = q4 ? (const void *)w.w4 : (const void *)w.w16;
                    matmul_weights(x, rows, in, W, q4, out, want, relu, products[pi], rows > MATMUL_DECODE_ROWS, scratch, NULL, NULL);
                    for (size_t i = 0; i < n; i++) {
                        float v = want[i] + bias[i % out];
                        want[i] = relu ? (v > 0 ? v : 0) : v;
                    }
                    matmul_epilogue after = {bias, relu};
                    matmul_weights(x, rows, in, W, q4, out, y, relu, products[pi], rows > MATMUL_DECODE_ROWS, scratch, &after, NULL);
                    size_t differ = 0;
                    for (size_t i = 0; i < n; i++) differ += memcmp(&want[i], &y[i], sizeof *y) != 0;
                    EXPECT(differ == 0, "%d rows, products %d, %s weights, %s: %zu of %zu elements differ from the "
                           "product, then the bias%s", rows, products[pi], q4 ? "4-bit" : "fp16",
                           relu ? "adding, ReLU" : "setting", differ, n, relu ? " and ReLU" : "");
                    free(x);
                    free(want);
                    free(y);
                }
    free(bias);
    free(scratch);
    weights_free(&w);
}

static void test_bf16_prefill_fp16(void) { check_bf16_prefill(0); }
static void test_bf16_prefill_q4(void) { check_bf16_prefill(1); }

/* --bf16-prefill over W wider than one of prefill's panels (matmul.c widens W a panel of whole
 * groups of columns at a time, matmul_scratch_floats / in of them, and multiplies each on its
 * own): every panel's columns within fp32's bound, in their own place. Any in gives about 2^23
 * weights for two panels; the second here is 40 columns, not a whole group. */
static void test_bf16_prefill_panels(void) {
    int rows = MATMUL_DECODE_ROWS + 1, in = 1024;
    int panel = (int)(matmul_scratch_floats(in, 1 << 20) / in), out = panel + 40;
    EXPECT((int)(matmul_scratch_floats(in, out) / in) < out, "W [%d][%d]: one panel of %d columns", in, out,
           (int)(matmul_scratch_floats(in, out) / in));
    uint64_t seed = 107;
    fp16 *w = malloc((size_t)in * out * sizeof *w);
    float *wt = malloc((size_t)out * in * sizeof *wt), *xb = malloc((size_t)rows * in * sizeof *xb); /* bf16's values */
    for (int k = 0; k < in; k++)
        for (int c = 0; c < out; c++) {
            w[(size_t)k * out + c] = fp32_to_fp16((test_uniform(&seed) - 0.5f) * 0.2f);
            wt[(size_t)c * in + k] = bf16_to_fp32(fp32_to_bf16(fp16_to_fp32(w[(size_t)k * out + c])));
        }
    float *x = random_floats((size_t)rows * in, 109), *y0 = random_floats((size_t)rows * out, 113);
    for (size_t i = 0; i < (size_t)rows * in; i++) xb[i] = bf16_to_fp32(fp32_to_bf16(x[i]));
    double *exact = malloc((size_t)rows * out * sizeof *exact), *mag = malloc((size_t)rows * out * sizeof *mag);
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < out; c++) {
            double sum = 0, size = 0;
            for (int k = 0; k < in; k++) {
                double t = (double)xb[(size_t)r * in + k] * wt[(size_t)c * in + k];
                sum += t, size += fabs(t);
            }
            exact[(size_t)r * out + c] = sum, mag[(size_t)r * out + c] = size;
        }
    float *y = malloc((size_t)rows * out * sizeof *y), *scratch = malloc(matmul_scratch_floats(in, out) * sizeof *scratch);
    for (int acc = 0; acc < 2; acc++) {
        memcpy(y, y0, (size_t)rows * out * sizeof *y);
        matmul_weights(x, rows, in, w, 0, out, y, acc, PRODUCTS_BF16_PREFILL, 1, scratch, NULL, NULL);
        int beyond[2] = {0, 0}; /* first panel, the rest */
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < out; c++) {
                size_t at = (size_t)r * out + c;
                double want = exact[at] + (acc ? y0[at] : 0), bound = gamma_n(in + 1) * (mag[at] + (acc ? fabs(y0[at]) : 0));
                beyond[c >= panel] += !(fabs(y[at] - want) <= bound);
            }
        EXPECT(beyond[0] == 0 && beyond[1] == 0, "bf16 prefill, rows %d, in %d, out %d in panels of %d%s on %s: %d "
               "elements of the first panel and %d of the second beyond fp32's bound of the bf16 operands' product",
               rows, in, out, panel, acc ? ", adding" : "", gemm_path(1), beyond[0], beyond[1]);
    }
    free(w), free(wt), free(xb), free(x), free(y0), free(exact), free(mag), free(y), free(scratch);
}

/* gemm_path names the path each kind of product took last. Where oneDNN is held to AVX2
 * (ONEDNN_MAX_CPU_ISA=AVX2, a laptop's CPU), its int8 kernel saturates full-range b and it has no
 * bf16 product: those run on this project's kernels and on sgemm; 7-bit b runs on oneDNN. Where the
 * CPU has VNNI or AVX-512 and oneDNN is not held back, oneDNN runs them. */
static void test_gemm_paths(void) {
    int m = MATMUL_DECODE_ROWS + 1, n = 48, k = 40;
    int8_t *a8 = malloc((size_t)m * k), *b8 = malloc((size_t)k * n);
    uint16_t *a16 = malloc((size_t)m * k * sizeof *a16), *b16 = malloc((size_t)k * n * sizeof *b16);
    int32_t *c8 = malloc((size_t)m * n * sizeof *c8);
    float *c16 = malloc((size_t)m * n * sizeof *c16);
    uint64_t seed = 127;
    for (size_t i = 0; i < (size_t)m * k; i++) a8[i] = random_int8(&seed), a16[i] = fp32_to_bf16(test_uniform(&seed));
    for (size_t i = 0; i < (size_t)k * n; i++) b8[i] = random_int8(&seed), b16[i] = fp32_to_bf16(test_uniform(&seed));
    gemm_s8(m, n, k, a8, b8, 127, c8);
    gemm_bf16(m, n, k, a16, b16, c16);
    char s8[96], bf16[96];
    snprintf(s8, sizeof s8, "%s", gemm_path(0));
    snprintf(bf16, sizeof bf16, "%s", gemm_path(1));
    EXPECT(s8_path_allowed(s8, 127), "gemm_s8: gemm_path says '%s', not a path that keeps int8 sums exact here", s8);
    EXPECT(!strncmp(bf16, "onednn ", 7) || !strcmp(bf16, "fp32 sgemm of bf16 operands"), "gemm_bf16: gemm_path says "
           "'%s'", bf16);
    const char *held = getenv("ONEDNN_MAX_CPU_ISA");
    if (held && !strcmp(held, "AVX2")) {
        EXPECT(strncmp(s8, "onednn ", 7) != 0, "ONEDNN_MAX_CPU_ISA=AVX2: gemm_s8 ran on %s, which saturates", s8);
        EXPECT(!strcmp(bf16, "fp32 sgemm of bf16 operands"), "ONEDNN_MAX_CPU_ISA=AVX2: gemm_bf16 ran on '%s'; "
               "oneDNN has no bf16 product there", bf16);
#ifdef FLEXGEN_ONEDNN
        /* W in 7 bits: oneDNN's AVX2 kernel cannot saturate, so it runs (test_gemm_s8 holds its bits) */
        for (size_t i = 0; i < (size_t)k * n; i++) b8[i] = (int8_t)(b8[i] / 2);
        gemm_s8(m, n, k, a8, b8, INT8_W_MAX, c8);
        EXPECT(!strncmp(gemm_path(0), "onednn ", 7), "ONEDNN_MAX_CPU_ISA=AVX2, |b| <= %d: gemm_s8 ran on '%s', not "
               "oneDNN", INT8_W_MAX, gemm_path(0));
#endif
    }
#ifdef FLEXGEN_ONEDNN
    if (!held && (fg_cpu_features() & FG_CPU_AVX512VNNI))
        EXPECT(!strncmp(s8, "onednn ", 7), "a CPU with AVX-512 VNNI: gemm_s8 ran on '%s', not oneDNN", s8);
    if (!held && fg_isa_of_cpu() >= FG_ISA_AVX512)
        EXPECT(!strncmp(bf16, "onednn ", 7), "a CPU with AVX-512: gemm_bf16 ran on '%s', not oneDNN", bf16);
#endif
    free(a8), free(b8), free(a16), free(b16), free(c8), free(c16);
}

void add_matmul_tests(void) {
    CU_pSuite s = CU_add_suite("matmul", NULL, NULL);
    CU_add_test(s, "fp16 weights: products within the fp32 summation bound", test_fp16_products);
    CU_add_test(s, "4-bit weights: products within the bound, on q4_decompress's values", test_q4_products);
    CU_add_test(s, "4-bit q|k|v, each part grouped on its own: the same bound", test_q4_parts_products);
    CU_add_test(s, "fp16 embedding table as lm_head, and its rows", test_fp16_embed_t);
    CU_add_test(s, "4-bit embedding table as lm_head, and its rows", test_q4_embed_t);
    CU_add_test(s, "every path (portable, AVX2, AVX-512 native and on SIMDe) gives the same bits", test_paths_agree);
    CU_add_test(s, "decode: a row's result does not depend on the rows beside it", test_rows_independent);
    CU_add_test(s, "the int8 rounding loops run the path's build (FLEXGEN_ISA, FLEXGEN_TEST_CPU)",
                test_int8_rounding_path);
    CU_add_test(s, "prefill and lm_head: the threads change no bit (1, 2, 3; k not a multiple of 32)",
                test_threads_change_no_bit);
    CU_add_test(s, "int8 activations x 4-bit: the scheme in double, the int8 bound, the paths' bits",
                test_int8_products);
    CU_add_test(s, "int8 activations x 4-bit q|k|v in 3 parts: the same", test_int8_parts_products);
    CU_add_test(s, "int8 activations: an outlier in a block, and blocks of zeros", test_int8_outliers_and_zeros);
    CU_add_test(s, "gemm_s8 (oneDNN where its kernel is exact): the plain loops' integer sums, bit for bit",
                test_gemm_s8);
    CU_add_test(s, "gemm_s8's AVX2 kernel (int16 pairs): the plain loops' sums on -128s and 127s, odd shapes",
                test_gemm_s8_pairs);
    CU_add_test(s, "gemm_bf16 (oneDNN where built): within fp32's bound, like its plain loops", test_gemm_bf16);
    CU_add_test(s, "gemm_path names the path each product took: not oneDNN's saturating int8 kernel",
                test_gemm_paths);
    CU_add_test(s, "fp32 to bf16: to nearest, ties to even, NaN kept", test_bf16_rounding);
    CU_add_test(s, "int8 prefill, each row rounded once: the scheme's bits and its rounding bound", test_int8_rows);
    CU_add_test(s, "int8 and bf16: prefill's scheme for a prompt of any rows; a prefill row's int8 bits alone",
                test_schemes_follow_phase);
    CU_add_test(s, "int8 prefill on 4-bit q|k|v in 3 parts: the same", test_int8_rows_parts);
    CU_add_test(s, "int8 prefill with W's columns kept: the bits of the columns made per call", test_int8_rows_kept);
    CU_add_test(s, "bf16 prefill on fp16 weights: fp32's bound of the bf16 product; decode's rows keep fp32",
                test_bf16_prefill_fp16);
    CU_add_test(s, "bf16 prefill on 4-bit weights: the same", test_bf16_prefill_q4);
    CU_add_test(s, "bf16 prefill over two panels of W: each panel's columns within fp32's bound", test_bf16_prefill_panels);
    CU_add_test(s, "a linear layer's bias and ReLU on every product, over two panels: the product's bits, then "
                "the bias, then ReLU", test_epilogue);
}
