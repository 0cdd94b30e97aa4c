/* bench_lp.c: time per lp_solve (lp.c, the simplex of the policy search, §4.3) on random LPs of
 * the size the placement LP grows to with its latency variables: 40 variables, 40 rows. Built and
 * run by scripts/bench_lp.sh.
 *
 *   bench_lp [number of LPs, default 2000]
 *
 * Each LP has mixed senses (<=, >= and =) built around a random point x0 >= 0, so it is feasible,
 * a first row sum(x) <= 4 n that keeps it bounded, and a cost c of either sign: both phases run.
 * Every LP is generated first, then each is solved once and timed alone (wall clock); the median
 * and the maximum are printed, in microseconds, with how many came out optimal. */
#define _POSIX_C_SOURCE 200809L
#include "flexgen.h"

#include <stdio.h>
#include <stdlib.h>

#define N 40
#define M 40

static double uniform(uint64_t *s, double lo, double hi) {
    *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
    return lo + (hi - lo) * (double)(*s >> 11) / (double)(1ULL << 53);
}

typedef struct {
    double c[N], A[M * N], b[M];
    lp_sense sense[M];
} lp_data;

static void random_lp(lp_data *d, uint64_t *s) {
    double x0[N];
    for (int j = 0; j < N; j++) x0[j] = uniform(s, 0, 1) < 0.5 ? 0 : uniform(s, 0, 2);
    for (int j = 0; j < N; j++) d->c[j] = uniform(s, -1, 1);
    for (int i = 0; i < M; i++) {
        double u = uniform(s, 0, 1), ax = 0, room = uniform(s, 0, 1) < 0.3 ? 0 : uniform(s, 0.1, 2);
        d->sense[i] = i == 0 || u < 0.45 ? LP_LE : u < 0.9 ? LP_GE : LP_EQ;
        for (int j = 0; j < N; j++) {
            d->A[i * N + j] = i == 0 ? 1 : uniform(s, -1, 1);
            ax += d->A[i * N + j] * x0[j];
        }
        if (i == 0) d->b[i] = 4 * N; /* sum(x) <= 4 N */
        else d->b[i] = d->sense[i] == LP_LE ? ax + room : d->sense[i] == LP_GE ? ax - room : ax;
    }
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    int count = argc > 1 ? atoi(argv[1]) : 2000;
    if (count < 1) {
        fprintf(stderr, "bench_lp: the number of LPs must be at least 1\n");
        return 1;
    }
    lp_data *lps = malloc(count * sizeof *lps);
    double *us = malloc(count * sizeof *us);
    if (!lps || !us) {
        fprintf(stderr, "bench_lp: out of memory\n");
        return 1;
    }
    uint64_t s = 1;
    for (int k = 0; k < count; k++) random_lp(&lps[k], &s);
    int optimal = 0;
    for (int k = 0; k < count; k++) {
        lp_problem p = {.n_vars = N,
                        .n_rows = M,
                        .c = lps[k].c,
                        .A = lps[k].A,
                        .sense = lps[k].sense,
                        .b = lps[k].b};
        lp_status st;
        double x[N], obj;
        char err[FG_ERR_LEN];
        double t0 = now_seconds();
        if (lp_solve(&p, &st, x, &obj, err)) {
            fprintf(stderr, "bench_lp: %s\n", err);
            return 1;
        }
        us[k] = (now_seconds() - t0) * 1e6;
        optimal += st == LP_OPTIMAL;
    }
    qsort(us, count, sizeof *us, by_value);
    printf("%d random LPs of %d variables x %d rows (%d optimal): lp_solve median %.1f us, max "
           "%.1f us\n",
           count, N, M, optimal, us[count / 2], us[count - 1]);
    free(lps);
    free(us);
    return 0;
}
