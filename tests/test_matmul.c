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
#include <omp.h>
#include <stdlib.h>
#include <string.h>

static double gamma_n(int n) {
    double u = 0x1p-24;
    return n * u / (1 - n * u);
}

/* Weights W[in][out] as fp16 and, compressed, as 4-bit bytes in `parts` parts side by side (each
 * [in][out / parts] grouped on its own, as q|k|v); both with their fp32 values. */
typedef struct {
    int in, out;
    fp16 *w16;
    uint8_t *w4;
    float *v16, *v4; /* [in][out]: the values the products must use */
} weights;

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
}

static void weights_free(weights *w) {
    free(w->w16);
    free(w->w4);
    free(w->v16);
    free(w->v4);
}

static float *random_floats(size_t n, uint64_t seed) {
    float *x = malloc(n * sizeof *x);
    for (size_t i = 0; i < n; i++) x[i] = test_uniform(&seed) * 2 - 1;
    return x;
}

/* y (from y0 when given) against sum_k x[r][k] v[k][c] in double, within gamma of its terms'
 * magnitudes, or, given ref, against ref within twice that (both are within gamma of the exact
 * sum); counts the elements outside. */
static int count_apart(const float *x, int rows, int in, const float *v, int out, const float *y0,
                       const float *y, const float *ref) {
    int bad = 0;
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < out; c++) {
            double exact = y0 ? y0[(size_t)r * out + c] : 0, mag = fabs(exact);
            for (int k = 0; k < in; k++) {
                double t = (double)x[(size_t)r * in + k] * v[(size_t)k * out + c];
                exact += t, mag += fabs(t);
            }
            double err = fabs(y[(size_t)r * out + c] - (ref ? ref[(size_t)r * out + c] : exact));
            if (err > (ref ? 2 : 1) * gamma_n(in + 1) * mag) bad++;
        }
    return bad;
}

/* Shapes with tails everywhere: rows 1, 2, 3, 8, 13, 17, 64 (the decode kernel: every tile
 * shape, tiles of 6 and a rest) and 65, 70, 100 (panels and sgemm); in across bands of 64 and
 * not a multiple of 8, 16 or 64; out in whole blocks of 64 and not. */
static const int SHAPES[][3] = {{1, 7, 5},    {3, 64, 17},   {1, 300, 200}, {17, 100, 130}, {64, 129, 64},
                                {65, 70, 300}, {100, 257, 77}, {8, 512, 1000}, {2, 130, 192}, {13, 65, 128},
                                {70, 100, 136}};
/* q|k|v (3 parts): parts of 96 and 100 columns, whose groups end inside a 64-column block, and of
 * 64 and 128, whose groups are the blocks. */
static const int PARTS_SHAPES[][3] = {{1, 100, 288}, {8, 64, 300}, {70, 130, 288}, {3, 65, 192}, {65, 70, 384},
                                      {13, 129, 300}};
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
        for (int acc = 0; acc < 2; acc++) {
            memcpy(y, y0, (size_t)rows * out * sizeof *y);
            matmul_weights(x, rows, in, W, q4, out, y, acc, 0, scratch);
            int bad = count_outside(x, rows, in, v, out, acc ? y0 : NULL, y);
            EXPECT(bad == 0, "%s, %d part(s), rows %d, in %d, out %d%s: %d elements outside the bound",
                   q4 ? "4-bit" : "fp16", q4, rows, in, out, acc ? ", adding" : "", bad);
            float *ref = malloc((size_t)rows * out * sizeof *ref);
            memcpy(ref, y0, (size_t)rows * out * sizeof *ref);
            matmul_reference(x, rows, in, W, q4, out, ref, acc);
            int ref_bad = count_outside(x, rows, in, v, out, acc ? y0 : NULL, ref);
            int apart = count_apart(x, rows, in, v, out, acc ? y0 : NULL, y, ref);
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
        for (int v = 0; v < n; v++) /* the reference multiplies by [dim][n] */
            for (int d = 0; d < dim; d++) vt[(size_t)d * n + v] = ev[(size_t)v * dim + d];
        float *x = random_floats((size_t)rows * dim, 5 + s), *y = malloc((size_t)rows * n * sizeof *y);
        size_t stride = (size_t)MATMUL_EMBED_BLOCK * dim;
        float *scratch = malloc(stride * omp_get_max_threads() * sizeof *scratch);
        matmul_embed_t(x, rows, dim, q4 ? (const void *)e4 : (const void *)e16, q4, n, y, scratch, stride);
        int bad = count_outside(x, rows, dim, vt, n, NULL, y);
        EXPECT(bad == 0, "%s embedding, rows %d, dim %d, n %d: %d elements outside the bound",
               q4 ? "4-bit" : "fp16", rows, dim, n, bad);
        float *ref = malloc((size_t)rows * n * sizeof *ref);
        embed_t_reference(x, rows, dim, q4 ? (const void *)e4 : (const void *)e16, q4, n, ref);
        int ref_bad = count_outside(x, rows, dim, vt, n, NULL, ref), apart = count_apart(x, rows, dim, vt, n, NULL, y, ref);
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
        free(e16), free(ev), free(vt), free(e4), free(x), free(y), free(scratch), free(row);
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
        matmul_weights(x, rows, in, q4 ? (const void *)w.w4 : (const void *)w.w16, q4, out, y[p], 1, 0, scratch);
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
    matmul_weights(x, rows, in, w.w16, 0, out, all, 0, 0, NULL);
    int differ = 0;
    for (int r = 0; r < rows; r++) {
        matmul_weights(x + (size_t)r * in, 1, in, w.w16, 0, out, one, 0, 0, NULL);
        differ += memcmp(one, all + (size_t)r * out, (size_t)out * sizeof *one) != 0;
    }
    EXPECT(differ == 0, "%d of %d rows differ computed alone", differ, rows);
    free(x), free(all), free(one);
    weights_free(&w);
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

/* The kernel (on the path the CPU takes) against int8_scheme, and against the exact product
 * within the int8 rounding's bound; then every other path this machine runs (the integer sums by
 * VNNI on the AVX-512 ones, native where the CPU has it, and on SIMDe everywhere), which must give
 * the same bits. */
static void check_int8_products(int parts) {
    for (size_t s = 0; s < (parts == 3 ? N_PARTS_SHAPES : N_SHAPES); s++) {
        int rows = shape_of(parts, s)[0], in = shape_of(parts, s)[1], out = shape_of(parts, s)[2];
        weights w;
        weights_make(&w, in, out, parts, 41 + s);
        float *x = random_floats((size_t)rows * in, 43 + s), *y0 = random_floats((size_t)rows * out, 47 + s);
        float *y = malloc((size_t)rows * out * sizeof *y), *yp = malloc((size_t)rows * out * sizeof *yp);
        for (int acc = 0; acc < 2; acc++) {
            memcpy(y, y0, (size_t)rows * out * sizeof *y);
            memcpy(yp, y0, (size_t)rows * out * sizeof *yp);
            matmul_weights(x, rows, in, w.w4, parts, out, y, acc, 1, NULL);
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
                memcpy(yp, y0, (size_t)rows * out * sizeof *yp);
                matmul_force_isa(paths[p]);
                int vnni = matmul_int8_sums() != NULL;
                matmul_weights(x, rows, in, w.w4, parts, out, yp, acc, 1, NULL);
                matmul_force_isa(-1);
                EXPECT(!memcmp(y, yp, (size_t)rows * out * sizeof *y), "int8 x 4-bit, %d part(s), rows %d, in %d, "
                       "out %d%s: the %s path%s differs from the CPU's own", parts, rows, in, out,
                       acc ? ", adding" : "", fg_isa_name(paths[p]), vnni ? " (VNNI)" : "");
            }
            /* AVX-VNNI's sums on the avx2 path: their AVX2 stand-in everywhere, the instruction where
             * the CPU has it */
            for (int native = 0; native < 2 && fg_isa_of_cpu() >= FG_ISA_AVX2; native++) {
                if (native && !(fg_cpu_features() & FG_CPU_AVXVNNI)) break;
                memcpy(yp, y0, (size_t)rows * out * sizeof *yp);
                matmul_q4_int8(x, rows, in, w.w4, parts, out, yp, acc, 1, int8_sums_vnni256(native));
                EXPECT(!memcmp(y, yp, (size_t)rows * out * sizeof *y), "int8 x 4-bit, %d part(s), rows %d, in %d, "
                       "out %d%s: the AVX-VNNI sums (%s) differ from the CPU's own path", parts, rows, in, out,
                       acc ? ", adding" : "", native ? "native" : "on AVX2");
            }
        }
        free(x), free(y0), free(y), free(yp);
        weights_free(&w);
    }
}

static void test_int8_products(void) { check_int8_products(1); }
static void test_int8_parts_products(void) { check_int8_products(3); }

/* Activations with one large value in a block (as OPT's outlier features): the block's other
 * values keep only 127 levels of it, and the result still keeps the bound. A block of zeros
 * gives alpha 0, not a division by zero. */
static void test_int8_outliers_and_zeros(void) {
    int rows = 4, in = 192, out = 128;
    weights w;
    weights_make(&w, in, out, 1, 53);
    float *x = random_floats((size_t)rows * in, 59), *y = malloc((size_t)rows * out * sizeof *y);
    x[5] = 60.0f, x[in + 70] = -300.0f;                  /* outliers in rows 0 and 1 */
    for (int k = 64; k < 128; k++) x[2 * in + k] = 0;    /* row 2's second block: zeros */
    for (int k = 0; k < in; k++) x[3 * in + k] = 0;      /* row 3: all zeros */
    matmul_weights(x, rows, in, w.w4, 1, out, y, 0, 1, NULL);
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
    free(x), free(y);
    weights_free(&w);
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
    CU_add_test(s, "int8 activations x 4-bit: the scheme in double, the int8 bound, the paths' bits",
                test_int8_products);
    CU_add_test(s, "int8 activations x 4-bit q|k|v in 3 parts: the same", test_int8_parts_products);
    CU_add_test(s, "int8 activations: an outlier in a block, and blocks of zeros", test_int8_outliers_and_zeros);
}
