/* sgemm_rate: this machine's single-precision GEMM rate at one shape, for scripts/bench_cpu.sh.
 *
 *   sgemm_rate M N K [reps]
 *
 * Times cblas_sgemm(RowMajor, NoTrans, NoTrans, M, N, K): activations A[M][K] times weights stored
 * B[K][N] into C[M][N], the layout ./flexgen's linear layers use. After a warm-up call, each of
 * `reps` repetitions (default 5) runs the GEMM enough times back to back to last about 0.1 s,
 * and the best (highest) rate of the repetitions is printed as one JSON line:
 *
 *   {"m":M,"n":N,"k":K,"reps":R,"gflops":G,"core":"SkylakeX"}
 *
 * Best-of is the usual way to get a machine's rate on a noisy, shared host. Threads: OpenBLAS's
 * OpenMP build, so OMP_NUM_THREADS sets them, as for ./flexgen. OpenBLAS's core is the one
 * ./flexgen runs on: it starts itself again on a better one where the library picked a core of an
 * older instruction set than the CPU has, by the same rule (support/blas_core.c); "core" names it.
 *
 * Built by `make build/sgemm_rate` (with ./flexgen's flags, and support/blas_core.o).
 */
#define _GNU_SOURCE
#include "support/tools.h"

#include <cblas.h>
#include <errno.h>
#include <limits.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define MIN_REP_SECONDS 0.1

static int parse_pos(const char *s, const char *what, int *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *s == 0 || *end || v < 1 || v > INT_MAX) {
        fprintf(stderr, "sgemm_rate: %s: expected a positive integer, got '%s'\n", what, s);
        return -1;
    }
    *out = (int)v;
    return 0;
}

/* 64-byte aligned, filled with values in [-1, 1) from a small LCG (no denormals, no NaNs). */
static float *random_matrix(size_t n, uint64_t seed) {
    size_t bytes = (n * sizeof(float) + 63) / 64 * 64;
    float *m = aligned_alloc(64, bytes);
    if (!m) return NULL;
    uint64_t s = seed * 6364136223846793005ULL + 1442695040888963407ULL;
    for (size_t i = 0; i < n; i++) {
        s = s * 6364136223846793005ULL + 1442695040888963407ULL;
        m[i] = (float)((s >> 40) & 0xFFFFFF) / (float)(1 << 23) - 1.0f;
    }
    return m;
}

static void gemm(int m, int n, int k, const float *a, const float *b, float *c) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, k, 1.0f, a, k, b, n, 0.0f, c, n);
}

int main(int argc, char **argv) {
    const char *core = fg_blas_core_force();
    if (core) {
        execv("/proc/self/exe", argv);
        fg_blas_core_unforce(core, errno);
    }
    int m, n, k, reps = 5;
    if (argc < 4 || argc > 5) {
        fprintf(stderr,
                "usage: sgemm_rate M N K [reps]\n"
                "  times cblas_sgemm(RowMajor, NoTrans, NoTrans, M, N, K) and prints\n"
                "  {\"m\":..,\"n\":..,\"k\":..,\"reps\":..,\"gflops\":..} (best of reps)\n");
        return 2;
    }
    if (parse_pos(argv[1], "M", &m) || parse_pos(argv[2], "N", &n) || parse_pos(argv[3], "K", &k) ||
        (argc == 5 && parse_pos(argv[4], "reps", &reps)))
        return 2;

    float *a = random_matrix((size_t)m * k, 1), *b = random_matrix((size_t)n * k, 2);
    float *c = random_matrix((size_t)m * n, 3);
    if (!a || !b || !c) {
        fprintf(stderr, "sgemm_rate: out of memory for M=%d N=%d K=%d\n", m, n, k);
        free(a);
        free(b);
        free(c);
        return 1;
    }
    double flops = 2.0 * m * n * k;

    /* Warm-up (thread pool start, page faults, caches), which also sizes the inner loop. */
    gemm(m, n, k, a, b, c);
    double t0 = omp_get_wtime();
    gemm(m, n, k, a, b, c);
    double once = omp_get_wtime() - t0;
    long inner = once > 0 ? (long)(MIN_REP_SECONDS / once) + 1 : 1000;
    if (inner < 1) inner = 1;
    if (inner > 1000000) inner = 1000000;

    double best = 0;
    for (int r = 0; r < reps; r++) {
        t0 = omp_get_wtime();
        for (long i = 0; i < inner; i++) gemm(m, n, k, a, b, c);
        double dt = omp_get_wtime() - t0;
        double rate = dt > 0 ? flops * (double)inner / dt / 1e9 : 0;
        if (rate > best) best = rate;
    }
    /* Reading C keeps the GEMMs observable. */
    volatile float sink = c[(size_t)m * n - 1];
    (void)sink;
    printf("{\"m\":%d,\"n\":%d,\"k\":%d,\"reps\":%d,\"gflops\":%.3f,\"core\":\"%s\"}\n", m, n, k,
           reps, best, openblas_get_corename());
    free(a);
    free(b);
    free(c);
    return 0;
}
