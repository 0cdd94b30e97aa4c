/* stream_rate: this machine's memory read bandwidth, for scripts/bench_roofline.sh.
 *
 *   stream_rate [MIB] [reps]
 *
 * Reads a buffer of MIB MiB (default 1024, far larger than any cache) from start to end, the
 * OpenMP threads each taking a contiguous share, as a decode step reads weights. After a warm-up
 * pass (which also faults the pages in), each of `reps` passes (default 5) is timed, and the best
 * rate is printed as one JSON line:
 *
 *   {"mib":MIB,"reps":R,"threads":T,"gbs":G}        G in 10^9 bytes per second
 *
 * Threads: OMP_NUM_THREADS, as for ./flexgen. Built by `make build/stream_rate` (with
 * ./flexgen's flags; it links nothing of the project).
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include <errno.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int parse_pos(const char *s, const char *what, long *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *s == 0 || *end || v < 1 || v > 1 << 20) {
        fprintf(stderr, "stream_rate: %s: expected a positive integer, got '%s'\n", what, s);
        return -1;
    }
    *out = v;
    return 0;
}

/* XOR of every 8-byte word, four chains so the loads are independent (and vectorized). */
static uint64_t read_all(const uint64_t *p, size_t words) {
    uint64_t all = 0;
#pragma omp parallel reduction(^ : all)
    {
        int t = omp_get_thread_num(), n = omp_get_num_threads();
        size_t from = words / 4 * t / n * 4, to = words / 4 * (t + 1) / n * 4;
        uint64_t a = 0, b = 0, c = 0, d = 0;
        for (size_t i = from; i < to; i += 4)
            a ^= p[i], b ^= p[i + 1], c ^= p[i + 2], d ^= p[i + 3];
        all ^= a ^ b ^ c ^ d;
    }
    return all;
}

int main(int argc, char **argv) {
    long mib = 1024, reps = 5;
    if (argc > 3 || (argc > 1 && parse_pos(argv[1], "MIB", &mib)) ||
        (argc > 2 && parse_pos(argv[2], "reps", &reps))) {
        if (argc > 3) fprintf(stderr, "usage: stream_rate [MIB] [reps]\n");
        return 2;
    }
    size_t bytes = (size_t)mib << 20, words = bytes / 8;
    uint64_t *p = aligned_alloc(64, bytes);
    if (!p) {
        fprintf(stderr, "stream_rate: cannot allocate %ld MiB\n", mib);
        return 1;
    }
#pragma omp parallel for schedule(static) /* each thread touches the share it will read */
    for (size_t i = 0; i < words; i++) p[i] = i * 0x9E3779B97F4A7C15ULL;
    uint64_t sink = read_all(p, words);
    double best = 0;
    for (long r = 0; r < reps; r++) {
        double t = now();
        sink ^= read_all(p, words);
        t = now() - t;
        if (bytes / t > best) best = bytes / t;
    }
    printf("{\"mib\":%ld,\"reps\":%ld,\"threads\":%d,\"gbs\":%.3f}\n", mib, reps,
           omp_get_max_threads(), best / 1e9);
    free(p);
    return sink == 42; /* keeps the reads */
}
