/* bench_matmul.c: one product alone, support/matmul.c's matmul_weights on weights as stored (fp16
 * or 4-bit), in GB/s of weight bytes read: a decode product's share of a decode step, beside
 * scripts/stream_rate.c's read rate (BENCHMARKS.md, "Decode at the read limit"); with more than
 * 64 rows (prefill's), its multiply-adds a second (GMAC/s) tell the arithmetic's pace.
 *
 *   bench_matmul ROWS FORMAT [IN OUT [MATRICES [REPEATS]]]
 *
 * ROWS rows of x (the batch) times W[IN][OUT] (default 2048 x 8192, fc1 of opt-1.3b), FORMAT fp16,
 * 4-bit, int8 (4-bit weights times int8 activations, --int8-activations' products: decode's blocks
 * up to 64 rows, prefill's rows rounded once past that, W's int8 columns made from the codes in
 * each call), int8-kept (the same, W's int8 columns made once before the timing, as the runtime
 * keeps them for weights that stay put: the product a prefill runs), or int8-blocks (decode's
 * blocks of 64, support/int8.c, at any number of rows: the scheme beside prefill's), or lm_head
 * (decode's logits, matmul_embed_t: x times the 4-bit table E[OUT][IN] as --compress-weight stores
 * the embedding, grouped along OUT; opt-1.3b's is 2048 50272). MATRICES distinct copies of W
 * (default: as many as make 1 GiB, as stream_rate reads, past every cache: a server's last level
 * can hold 480 MiB, where 12 copies of fc1 in fp16 would stay) are multiplied in turn, REPEATS
 * times (default 1) per timed pass; best of 8 passes. One matrix of a few hundred KiB with many
 * repeats measures the kernel from cache: its arithmetic alone. W is allocated as the CPU backend
 * allocates a tier's memory (fg_cpu_backend.alloc: huge pages where the kernel gives them). The
 * path is the CPU's widest, or FLEXGEN_ISA's; threads: OMP_NUM_THREADS. `make build/bench_matmul`
 * builds it with ./flexgen's flags and objects: with oneDNN where the Makefile finds it; built
 * without oneDNN, int8's prefill rows take support/onednn.c's exact AVX2 kernel, what a CPU without
 * VNNI runs. One JSON line per run. scripts/bench_matmul.sh builds it and runs the set
 * BENCHMARKS.md quotes; by hand:
 *
 *   OMP_NUM_THREADS=2 build/bench_matmul 1 4-bit
 *   OMP_NUM_THREADS=2 build/bench_matmul 1 4-bit 256 4096 1 500      (from L2)
 *   OMP_NUM_THREADS=2 build/bench_matmul 1024 int8-kept 2048 8192 1 1     (prefill's rows)
 *   OMP_NUM_THREADS=2 build/bench_matmul 1024 int8-blocks 2048 8192 1 1   (decode's scheme)
 *   OMP_NUM_THREADS=2 build/bench_matmul 1 lm_head 2048 50272
 */
#define _POSIX_C_SOURCE 200809L
#include "flexgen.h"
#include "support/support.h"

#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int arg(int argc, char **argv, int i, int fallback) {
    int v = argc > i ? atoi(argv[i]) : fallback;
    if (v < 1) {
        fprintf(stderr, "bench_matmul: argument %d: expected a positive integer, got '%s'\n", i,
                argv[i]);
        exit(2);
    }
    return v;
}

int main(int argc, char **argv) {
    const char *formats[] = {"fp16", "4-bit", "int8", "int8-blocks", "lm_head", "int8-kept"};
    int format = -1;
    for (int f = 0; f < 6 && argc >= 3; f++)
        if (!strcmp(argv[2], formats[f])) format = f;
    if (format < 0) {
        fprintf(stderr, "usage: bench_matmul ROWS fp16|4-bit|int8|int8-kept|int8-blocks|lm_head "
                        "[IN OUT [MATRICES [REPEATS]]]\n");
        return 2;
    }
    int rows = arg(argc, argv, 1, 1), kept = format == 5, int8 = format == 2 || kept;
    int q4 = format > 0, lm_head = format == 4, blocks = format == 3;
    int products = int8 ? PRODUCTS_INT8 : PRODUCTS_FP32;
    int in = arg(argc, argv, 3, 2048), out = arg(argc, argv, 4, 8192);
    if (q4 && !lm_head && out % Q4_GROUP) {
        fprintf(stderr, "bench_matmul: OUT must be a multiple of %d for 4-bit weights\n", Q4_GROUP);
        return 2;
    }
    size_t n = (size_t)in * out;
    size_t bytes = lm_head ? q4_bytes(1, (size_t)out, (size_t)in)
                   : q4    ? q4_bytes((size_t)in, (size_t)out, 1)
                           : n * sizeof(fp16);
    int gib_of_copies = (int)(((size_t)1 << 30) / bytes) + 1;
    int matrices = arg(argc, argv, 5, gib_of_copies), repeats = arg(argc, argv, 6, 1);
    float *w32 = malloc(n * sizeof *w32), *x = malloc((size_t)rows * in * sizeof *x);
    float *y = malloc((size_t)rows * out * sizeof *y);
    size_t lm_head_stride = (size_t)MATMUL_EMBED_BLOCK * in; /* a thread's rows of E, widened */
    size_t scratch_floats = matmul_scratch_floats(in, out);  /* prefill's panel */
    if (lm_head) scratch_floats = lm_head_stride * (size_t)omp_get_max_threads();
    float *scratch = malloc(scratch_floats * sizeof *scratch);
    uint8_t **W = calloc((size_t)matrices, sizeof *W);
    if (!w32 || !x || !y || !scratch || !W) {
        fprintf(stderr, "bench_matmul: out of memory\n");
        return 1;
    }
    for (size_t i = 0; i < n; i++) w32[i] = (float)((i * 2654435761u) % 1000) / 1000.0f - 0.5f;
    for (int i = 0; i < rows * in; i++) x[i] = 0.01f * (float)(i % 7);
    for (int m = 0; m < matrices; m++) {
        W[m] = fg_cpu_backend.alloc(bytes);
        if (!W[m]) {
            fprintf(stderr, "bench_matmul: out of memory\n");
            return 1;
        }
        if (m > 0) memcpy(W[m], W[0], bytes); /* the same values, other memory */
        else if (lm_head) q4_compress(w32, 1, (size_t)out, (size_t)in, W[m]);
        else if (q4) q4_compress(w32, (size_t)in, (size_t)out, 1, W[m]);
        else fp32_to_fp16_n(w32, (fp16 *)W[m], n);
    }
    int8_column_set columns = {0};
    for (int m = 0; kept && m < matrices; m++)
        if (int8_column_set_add(&columns, W[m], 1, in, out)) {
            fprintf(stderr, "bench_matmul: out of memory for W's int8 columns\n");
            return 1;
        }
    double best = 1e30;
    for (int pass = 0; pass < 8; pass++) {
        double t0 = now_seconds();
        for (int r = 0; r < repeats; r++)
            for (int m = 0; m < matrices; m++)
                if (blocks) matmul_int8_blocks(x, rows, in, W[m], 1, out, y, 0);
                else if (lm_head)
                    matmul_embed_t(x, rows, in, W[m], 1, out, y, scratch, lm_head_stride);
                else
                    matmul_weights(x, rows, in, W[m], q4, out, y, 0, products,
                                   rows > MATMUL_DECODE_ROWS, scratch, NULL,
                                   kept ? &columns : NULL);
        double dt = now_seconds() - t0;
        best = dt < best ? dt : best;
    }
    double each = best / matrices / repeats;
    printf("{\"rows\":%d,\"format\":\"%s\",\"in\":%d,\"out\":%d,\"bytes\":%zu,\"ms\":%.4f,\"gbs\":%"
           ".2f,\"gmacs\":%.1f,\"path\":\"%s\"}\n",
           rows, argv[2], in, out, bytes, each * 1e3, (double)bytes / each / 1e9,
           (double)rows * (double)n / each / 1e9, matmul_path());
    int8_column_set_free(&columns);
    for (int m = 0; m < matrices; m++) fg_cpu_backend.free(W[m]);
    free(W);
    free(scratch);
    free(w32);
    free(x);
    free(y);
    return 0;
}
