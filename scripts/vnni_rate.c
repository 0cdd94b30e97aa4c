/* vnni_rate: this machine's peak rate of 8-bit integer products with AVX-512 VNNI (vpdpbusd), the
 * integer counterpart of scripts/sgemm_rate.c: what the 4-bit x int8 products (support/int8.c,
 * support/avx512.c's int8_sums) are measured against.
 *
 *   vnni_rate [seconds]        (default 1: the length of each of 5 passes; the best is printed)
 *
 * Each OpenMP thread runs chains of vpdpbusd on registers alone (16 independent accumulators, so
 * the instruction's latency is hidden and nothing waits on memory); one vpdpbusd is 64 products of
 * an unsigned by a signed byte, added into 16 int32 sums. Printed as one JSON line:
 *
 *   {"threads":T,"gmacs":G,"gops":2G}    G: 10^9 products a second over all threads
 *
 * On a CPU without AVX-512 VNNI it says so and exits 1. Build (x86-64, gcc):
 *   gcc -O2 -std=c11 -Wall -Wextra -Werror -fopenmp -o build/vnni_rate scripts/vnni_rate.c
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

enum { CHAINS = 16, STEPS = 1 << 16 };

/* STEPS rounds of CHAINS vpdpbusd; returns a value of the sums so the work is kept. */
__attribute__((target("avx512f,avx512vnni"))) static int32_t run(int64_t rounds, int seed) {
    __m512i acc[CHAINS], a = _mm512_set1_epi8((char)(seed | 1)), b = _mm512_set1_epi8(3);
    for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_set1_epi32(i);
    for (int64_t r = 0; r < rounds; r++)
        for (int s = 0; s < STEPS; s++)
#pragma GCC unroll 16
            for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
    __m512i all = acc[0];
    for (int i = 1; i < CHAINS; i++) all = _mm512_xor_si512(all, acc[i]);
    return _mm512_reduce_add_epi32(all);
}

int main(int argc, char **argv) {
    double seconds = argc > 1 ? atof(argv[1]) : 1.0;
    if (argc > 2 || !(seconds > 0 && seconds <= 60)) {
        fprintf(stderr, "usage: vnni_rate [seconds, 0 < s <= 60]\n");
        return 2;
    }
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512vnni")) {
        fprintf(stderr, "vnni_rate: this CPU has no AVX-512 VNNI (vpdpbusd)\n");
        return 1;
    }
    int64_t rounds = 1; /* grown until one pass of one thread takes about `seconds` */
    int threads = 1, sink = 0;
    for (;;) {
        double t0 = now();
        sink ^= run(rounds, 1);
        if (now() - t0 >= seconds / 8) break;
        rounds *= 2;
    }
    rounds *= 8;
    double best = 0;
    for (int pass = 0; pass < 5; pass++) {
        double t0 = now();
#pragma omp parallel reduction(^ : sink)
        {
            sink ^= run(rounds, omp_get_thread_num());
#pragma omp single
            threads = omp_get_num_threads();
        }
        double macs = (double)threads * rounds * STEPS * CHAINS * 64 / (now() - t0);
        best = macs > best ? macs : best;
    }
    printf("{\"threads\":%d,\"gmacs\":%.1f,\"gops\":%.1f,\"check\":%d}\n", threads, best / 1e9,
           2 * best / 1e9, sink & 1);
    return 0;
}
