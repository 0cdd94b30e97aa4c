/* bench_quant.c: throughput of quant.c's 4-bit compressor and decompressor against a plain memcpy
 * of the same bytes (BENCHMARKS.md, "Compression"). Built and run by scripts/bench_quant.sh.
 *
 *   bench_quant [MiB of fp32 values, default 256]
 *
 * For each grouping the runtime uses (a linear layer's groups along contiguous values, an
 * embedding's groups across rows), it times compress (fp32 -> 4-bit, on every core: weights are
 * compressed once, at load), decompress (4-bit -> fp32, one thread: the weight load of every
 * layer, on its I/O thread) and a one-thread memcpy of the fp32 bytes, best of 5.
 * GB/s count the fp32 side: the bytes the compute device works with. */
#define _POSIX_C_SOURCE 200809L
#include "flexgen.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

typedef enum { COMPRESS, DECOMPRESS, MEMCPY } op;

static double best_seconds(op o, float *x, uint8_t *q, float *y, size_t outer, size_t len,
                           size_t inner) {
    double best = 1e30;
    for (int rep = 0; rep < 5; rep++) {
        double t0 = now_seconds();
        if (o == COMPRESS) q4_compress(x, outer, len, inner, q);
        else if (o == DECOMPRESS) q4_decompress(q, outer, len, inner, y);
        else memcpy(y, x, outer * len * inner * sizeof *x);
        double dt = now_seconds() - t0;
        best = dt < best ? dt : best;
    }
    return best;
}

int main(int argc, char **argv) {
    size_t mib = argc > 1 ? strtoul(argv[1], NULL, 10) : 256, n = mib << 18; /* floats */
    float *x = malloc(n * sizeof *x), *y = malloc(n * sizeof *y);
    uint8_t *q = malloc(q4_bytes(1, n, 1) + q4_bytes(1, n / 4096, 4096));
    if (!x || !y || !q) {
        fprintf(stderr, "bench_quant: out of memory\n");
        return 1;
    }
    uint64_t s = 1;
    for (size_t i = 0; i < n; i++) {
        s = s * 6364136223846793005ULL + 1442695040888963407ULL;
        x[i] = (float)(s >> 40) / (1 << 24) - 0.5f;
    }
    memset(y, 0, n * sizeof *y);
    static const struct {
        const char *what;
        size_t inner;
    } shapes[] = {{"linear [in][out], groups along out", 1},
                  {"embedding [vocab][4096], groups across rows", 4096}};
    printf("%zu MiB of fp32 values, %d cores, best of 5; GB/s of fp32 bytes\n", mib,
           omp_get_max_threads());
    printf("%-46s %10s %10s %10s %12s\n", "grouping", "compress", "decompress", "memcpy",
           "decomp/memcpy");
    for (int k = 0; k < 2; k++) {
        size_t inner = shapes[k].inner, outer = inner == 1 ? n / 4096 : 1,
               len = inner == 1 ? 4096 : n / inner;
        double gb = n * sizeof(float) / 1e9;
        double c = best_seconds(COMPRESS, x, q, y, outer, len, inner);
        double d = best_seconds(DECOMPRESS, x, q, y, outer, len, inner);
        double m = best_seconds(MEMCPY, x, q, y, outer, len, inner);
        printf("%-46s %10.2f %10.2f %10.2f %12.2f\n", shapes[k].what, gb / c, gb / d, gb / m,
               m / d);
    }
    free(x);
    free(y);
    free(q);
    return 0;
}
