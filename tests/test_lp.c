/* test_lp.c: lp.c's simplex (the solver of the placement LP, paper §4.3 and Appendix A.3) against
 * GLPK on seeded random LPs of up to 40 variables and 40 rows, of every kind the simplex has a
 * path for: plain random ones, feasible ones built around a known point, degenerate ones (integer
 * data, many zero right-hand sides, tight and duplicated rows), infeasible ones (a row that
 * contradicts a combination of two others) and unbounded ones (a descending ray kept feasible by
 * every row); a third of those with fractional data are rescaled by powers of two (rows 2^24 apart,
 * columns 2^12), the spread of the bytes, FLOPs and seconds in the policy LP. GLPK's primal
 * simplex (presolve off) gives the reference status and objective, and on integer data its exact
 * rational simplex confirms it. Then small LPs with optimal points worked out by hand, two that
 * cycle under the largest-coefficient rule among them, and the sizes lp_solve refuses. */
#include "tests.h"

#include <glpk.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_N 40
#define MAX_M 43 /* 40 random rows, the two of a built contradiction or bounding row, a far one */
#ifndef N_RANDOM
#define N_RANDOM 1500
#endif

static const char *status_name[] = {"optimal", "infeasible", "unbounded"};

static uint64_t next(uint64_t *s) {
    *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
    return *s >> 33;
}
/* Uniform in [lo, hi] on multiples of (hi - lo) / 2^20. With lo and hi small dyadic numbers, the
 * sums of products that build right-hand sides below are exact in double: each LP is exactly the
 * feasible, infeasible or unbounded LP it was built to be, not one rounding away from another. */
static double uniform(uint64_t *s, double lo, double hi) {
    return lo + (hi - lo) * (double)(next(s) >> 11) / (double)(1 << 20);
}
static int below(uint64_t *s, int n) { return (int)(next(s) % (uint64_t)n); }

typedef struct {
    int n, m;
    int integer; /* all data small integers */
    int bounded; /* a row sum(x) <= bound */
    double c[MAX_N], A[MAX_M * MAX_N], b[MAX_M];
    lp_sense sense[MAX_M];
} lp_case;

static lp_problem problem_of(const lp_case *k) {
    return (lp_problem){.n_vars = k->n, .n_rows = k->m, .c = k->c, .A = k->A, .sense = k->sense,
                        .b = k->b};
}

/* ---- GLPK as the reference ---------------------------------------------------------------- */

/* Status from GLPK's primal and dual statuses: both feasible is optimal, no primal feasible point
 * is infeasible, a feasible primal with no feasible dual is unbounded. -1 for anything else (a
 * solver failure). With presolve off, glp_simplex and glp_exact return 0 whenever they reach a
 * conclusion and the statuses say which; the presolver would instead return GLP_ENOPFS or
 * GLP_ENODFS with no statuses set, and the latter does not tell unbounded from infeasible. */
static int glpk_status(glp_prob *lp, int ret) {
    if (ret != 0) return -1;
    int prim = glp_get_prim_stat(lp), dual = glp_get_dual_stat(lp), st = glp_get_status(lp);
    if (st == GLP_OPT && prim == GLP_FEAS && dual == GLP_FEAS) return LP_OPTIMAL;
    if (st == GLP_NOFEAS && prim == GLP_NOFEAS) return LP_INFEASIBLE;
    if (st == GLP_UNBND && prim == GLP_FEAS && dual == GLP_NOFEAS) return LP_UNBOUNDED;
    return -1;
}

/* Solves k with GLPK: the status (-1 if GLPK failed or its two simplexes disagree), and the
 * objective when optimal. */
static int glpk_solve(const lp_case *k, double *objective) {
    glp_prob *lp = glp_create_prob();
    glp_set_obj_dir(lp, GLP_MIN);
    glp_add_cols(lp, k->n);
    for (int j = 0; j < k->n; j++) {
        glp_set_col_bnds(lp, j + 1, GLP_LO, 0, 0);
        glp_set_obj_coef(lp, j + 1, k->c[j]);
    }
    int ia[1 + MAX_M * MAX_N], ja[1 + MAX_M * MAX_N], ne = 0;
    double ar[1 + MAX_M * MAX_N];
    if (k->m > 0) glp_add_rows(lp, k->m);
    for (int i = 0; i < k->m; i++) {
        int type = k->sense[i] == LP_LE ? GLP_UP : k->sense[i] == LP_GE ? GLP_LO : GLP_FX;
        glp_set_row_bnds(lp, i + 1, type, k->b[i], k->b[i]);
        for (int j = 0; j < k->n; j++)
            if (k->A[i * k->n + j] != 0) ne++, ia[ne] = i + 1, ja[ne] = j + 1, ar[ne] = k->A[i * k->n + j];
    }
    glp_load_matrix(lp, ne, ia, ja, ar);
    glp_scale_prob(lp, GLP_SF_AUTO); /* unscaled, glp_simplex stalls on the rescaled LPs below */
    glp_smcp parm;
    glp_init_smcp(&parm);
    parm.msg_lev = GLP_MSG_OFF;
    parm.presolve = GLP_OFF;
    parm.it_lim = 100000; /* a stall is a GLPK failure, never a hung test */
    int status = glpk_status(lp, glp_simplex(lp, &parm));
    /* On integer data glp_exact, warm-started from that basis, confirms it in rational arithmetic
     * (it needs a row). Not on the others: it reads each double as a nearby simple fraction (within
     * 1e-9), which turns rows that meet exactly at a built point into rows that just miss, and
     * its fractions grow to thousands of digits (seconds an LP). */
    if (status >= 0 && k->integer && k->m > 0 && glpk_status(lp, glp_exact(lp, &parm)) != status)
        status = -1;
    *objective = glp_get_obj_val(lp);
    glp_delete_prob(lp);
    return status;
}

/* ---- random LPs ---------------------------------------------------------------------------- */

enum { RANDOM, FEASIBLE, DEGENERATE, INFEASIBLE, UNBOUNDED, N_KINDS };
static const char *kind_name[] = {"random", "feasible", "degenerate", "infeasible", "unbounded"};

/* A coefficient: uniform in [-1, 1], or (integer data) a small integer, often 0. */
static double coef(uint64_t *s, int integer) {
    return integer ? (double)(below(s, 7) - 3) : uniform(s, -1, 1);
}

/* b from a point x0 >= 0: rows tight at x0 with probability `tight`, else with room. */
static void rhs_around(lp_case *k, const double *x0, uint64_t *s, int integer, double tight) {
    for (int i = 0; i < k->m; i++) {
        double room = uniform(s, 0, 1) < tight ? 0 : integer ? 1 + below(s, 3) : uniform(s, 0.125, 2);
        double ax = 0;
        for (int j = 0; j < k->n; j++) ax += k->A[i * k->n + j] * x0[j];
        k->b[i] = k->sense[i] == LP_LE ? ax + room : k->sense[i] == LP_GE ? ax - room : ax;
    }
}

/* A row sum(x) <= bound, keeping minimization bounded most of the time. */
static void add_bounding_row(lp_case *k, double bound) {
    for (int j = 0; j < k->n; j++) k->A[k->m * k->n + j] = 1;
    k->sense[k->m] = LP_LE;
    k->b[k->m++] = bound;
    k->bounded = 1;
}

/* Kinds. Each starts from random rows (k's senses and A), c, and a point x0 >= 0. */

static void make_random(lp_case *k, uint64_t *s) { /* b at random too: often infeasible */
    for (int i = 0; i < k->m; i++) k->b[i] = coef(s, k->integer);
    if (below(s, 2)) add_bounding_row(k, k->integer ? 10 : uniform(s, 1, 10));
}

static void make_feasible(lp_case *k, const double *x0, uint64_t *s) {
    rhs_around(k, x0, s, k->integer, 0.3);
    if (below(s, 4)) add_bounding_row(k, 4 * k->n);
}

/* Most rows tight at x0, a third of the time x0 = 0 (every rhs 0: a cone at the origin), and
 * duplicated rows, some multiplied by -1 (the sense flips) or 2. */
static void make_degenerate(lp_case *k, double *x0, uint64_t *s) {
    if (below(s, 3) == 0) memset(x0, 0, k->n * sizeof *x0);
    rhs_around(k, x0, s, k->integer, 0.8);
    for (int i = 1; i < k->m; i++) {
        if (below(s, 3)) continue;
        int from = below(s, i), f = below(s, 3) == 0 ? -1 : 2;
        for (int j = 0; j < k->n; j++) k->A[i * k->n + j] = f * k->A[from * k->n + j];
        k->b[i] = f * k->b[from];
        lp_sense flipped = k->sense[from] == LP_LE ? LP_GE : LP_LE;
        k->sense[i] = k->sense[from] == LP_EQ || f > 0 ? k->sense[from] : flipped;
    }
    if (below(s, 2)) add_bounding_row(k, 3 * k->n);
}

/* Rows 0 and 1 are <= rows with positive coefficients; a last row alpha row 0 + beta row 1 >=
 * alpha b_0 + beta b_1 + delta contradicts them, whatever the other rows say. */
static void make_infeasible(lp_case *k, const double *x0, uint64_t *s) {
    if (k->m < 2) k->m = 2;
    for (int j = 0; j < k->n; j++)
        k->A[j] = fabs(k->A[j]) + 1, k->A[k->n + j] = fabs(k->A[k->n + j]) + 1;
    k->sense[0] = k->sense[1] = LP_LE;
    rhs_around(k, x0, s, k->integer, 0.3);
    double alpha = 1 + below(s, 3), beta = below(s, 3), delta = k->integer ? 1 : uniform(s, 0.125, 1);
    for (int j = 0; j < k->n; j++) k->A[k->m * k->n + j] = alpha * k->A[j] + beta * k->A[k->n + j];
    k->b[k->m] = alpha * k->b[0] + beta * k->b[1] + delta;
    k->sense[k->m++] = LP_GE;
}

/* A ray r >= 0 (0/1 entries) that x0 + t r follows in every row, and c . r = -1 along it. */
static void make_unbounded(lp_case *k, const double *x0, uint64_t *s) {
    double r[MAX_N] = {0};
    int lead = below(s, k->n);
    for (int j = 0; j < k->n; j++) r[j] = j == lead || below(s, 4) == 0;
    for (int i = 0; i < k->m; i++) {
        double *a = k->A + i * k->n, ar = 0;
        if (k->sense[i] == LP_EQ) { /* a . r = 0 exactly: the ray's variables are not in the row */
            for (int j = 0; j < k->n; j++)
                if (r[j]) a[j] = 0;
            continue;
        }
        for (int j = 0; j < k->n; j++) ar += a[j] * r[j];
        double sign = k->sense[i] == LP_LE ? 1 : -1; /* the row needs sign * a . r <= 0 */
        if (sign * ar > 0) a[lead] -= ar + sign * (k->integer ? 1 : 0.125); /* now -1 or -1/8 */
    }
    rhs_around(k, x0, s, k->integer, 0.3);
    double cr = 0;
    for (int j = 0; j < k->n; j++) cr += k->c[j] * r[j];
    if (cr >= 0) k->c[lead] -= cr + 1;
}

/* Rows (with b), columns (with c) and c by powers of two, from 2^-8 to 2^16, 2^-6 to 2^6 and
 * 2^-8 to 2^16: the same LP exactly, with x and objective rescaled, but with coefficients of the
 * spread the policy LP has (bytes, FLOPs and seconds), which the tolerances have to take. */
static void rescale(lp_case *k, uint64_t *s) {
    for (int i = 0; i < k->m; i++) {
        double f = ldexp(1, below(s, 25) - 8);
        for (int j = 0; j < k->n; j++) k->A[i * k->n + j] *= f;
        k->b[i] *= f;
    }
    double fc = ldexp(1, below(s, 25) - 8);
    for (int j = 0; j < k->n; j++) {
        double f = ldexp(1, below(s, 13) - 6);
        for (int i = 0; i < k->m; i++) k->A[i * k->n + j] *= f;
        k->c[j] *= f * fc;
    }
}

/* A bound no point comes near, as the policy LP's --max-latency often is: sum(x) <= 2^20 to 2^50
 * beside a row sum(x) <= 160 at most (or in an LP with no point at all). It changes no answer, and
 * no other row's right-hand side may be read against its scale. */
static void add_far_row(lp_case *k, uint64_t *s) {
    add_bounding_row(k, ldexp(1, 20 + below(s, 31)));
}

static void random_case(lp_case *k, int kind, uint64_t seed) {
    uint64_t s = seed * 0x9E3779B97F4A7C15ULL + 7;
    k->integer = kind == DEGENERATE || below(&s, 4) == 0;
    k->bounded = 0;
    k->n = 1 + below(&s, MAX_N);
    k->m = below(&s, 41);
    if (below(&s, 8) == 0) k->n = MAX_N, k->m = 40; /* the full size often */
    for (int i = 0; i < k->m; i++) {
        k->sense[i] = (lp_sense)below(&s, 3);
        for (int j = 0; j < k->n; j++) k->A[i * k->n + j] = coef(&s, k->integer);
    }
    for (int j = 0; j < k->n; j++) k->c[j] = coef(&s, k->integer);
    double x0[MAX_N];
    for (int j = 0; j < k->n; j++) /* half of them 0 */
        x0[j] = below(&s, 2) ? 0 : k->integer ? 1 + below(&s, 3) : below(&s, 16) / 8.0;
    if (kind == RANDOM) make_random(k, &s);
    else if (kind == FEASIBLE) make_feasible(k, x0, &s);
    else if (kind == DEGENERATE) make_degenerate(k, x0, &s);
    else if (kind == INFEASIBLE) make_infeasible(k, x0, &s);
    else make_unbounded(k, x0, &s);
    if (!k->integer && below(&s, 3) == 0) rescale(k, &s);
    if ((k->bounded || kind == INFEASIBLE) && below(&s, 3) == 0) add_far_row(k, &s);
}

/* lp_solve's point: x >= -1e-9, every row within 1e-7 of the scale of its terms, c.x = objective. */
static int point_ok(const lp_case *k, const double *x, double objective) {
    double cx = 0;
    for (int j = 0; j < k->n; j++) {
        if (!(x[j] >= -1e-9)) return 0;
        cx += k->c[j] * x[j];
    }
    if (!(fabs(cx - objective) <= 1e-9 * fmax(1, fabs(objective)))) return 0;
    for (int i = 0; i < k->m; i++) {
        double ax = 0, scale = fmax(1, fabs(k->b[i]));
        for (int j = 0; j < k->n; j++) {
            double term = k->A[i * k->n + j] * x[j];
            ax += term;
            scale += fabs(term);
        }
        double over = k->sense[i] == LP_LE ? ax - k->b[i] : k->sense[i] == LP_GE ? k->b[i] - ax
                                                                                 : fabs(ax - k->b[i]);
        if (!(over <= 1e-7 * scale)) return 0;
    }
    return 1;
}

static void test_random_against_glpk(void) {
    glp_term_out(GLP_OFF);
    int count[3] = {0}, by_kind[N_KINDS][3] = {{0}}, wrong = 0, glpk_failed = 0;
    lp_case *k = malloc(sizeof *k);
    for (int seed = 0; seed < N_RANDOM; seed++) {
        int kind = seed % N_KINDS;
        random_case(k, kind, (uint64_t)seed);
        double ref = 0, x[MAX_N], obj = 0;
        int want = glpk_solve(k, &ref);
        if (want < 0) {
            fprintf(stderr, "\n  seed %d (%s, %d x %d): GLPK failed", seed, kind_name[kind], k->m, k->n);
            glpk_failed++;
            continue;
        }
        lp_status got;
        char err[FG_ERR_LEN] = "";
        lp_problem p = problem_of(k);
        int rc = lp_solve(&p, &got, x, &obj, err);
        count[want]++;
        by_kind[kind][want]++;
        int ok = rc == 0 && (int)got == want;
        if (ok && want == LP_OPTIMAL)
            ok = fabs(obj - ref) <= 1e-7 * fmax(1, fabs(ref)) && point_ok(k, x, obj);
        if (!ok && wrong++ < 5)
            fprintf(stderr, "\n  seed %d (%s, %d x %d): GLPK %s %.12g, lp_solve rc %d %s %.12g %s", seed,
                    kind_name[kind], k->m, k->n, status_name[want], ref, rc,
                    rc ? "-" : status_name[got], obj, err);
    }
    free(k);
    fprintf(stderr, "\n  %d random LPs: %d optimal, %d infeasible, %d unbounded (by GLPK); by kind:",
            N_RANDOM, count[0], count[1], count[2]);
    for (int kind = 0; kind < N_KINDS; kind++)
        fprintf(stderr, "\n    %-10s %4d %4d %4d", kind_name[kind], by_kind[kind][0], by_kind[kind][1],
                by_kind[kind][2]);
    fprintf(stderr, "\n");
    CU_ASSERT_EQUAL(glpk_failed, 0);
    EXPECT(wrong == 0, "%d of %d random LPs got another status or optimum than GLPK's (the lines "
           "above name each: seed, kind, size, GLPK's answer, lp_solve's)", wrong, N_RANDOM);
    for (int st = 0; st < 3; st++) CU_ASSERT(count[st] >= 50);
    CU_ASSERT(by_kind[DEGENERATE][LP_OPTIMAL] >= 50);
}

/* ---- LPs solved by hand --------------------------------------------------------------------- */

/* Solves an LP written out below and checks its status, and when optimal its x and objective to
 * 1e-9 (hand solutions are exact). */
static void expect(int n, int m, const double *c, const double *A, const lp_sense *sense,
                   const double *b, lp_status want, const double *x_want, double obj_want) {
    lp_problem p = {.n_vars = n, .n_rows = m, .c = c, .A = A, .sense = sense, .b = b};
    lp_status got = (lp_status)-1;
    double x[8], obj = 0;
    char err[FG_ERR_LEN] = "";
    static const char *const names[] = {"optimal", "infeasible", "unbounded"};
    int rc = lp_solve(&p, &got, x, &obj, err);
    EXPECT(rc == 0, "lp_solve failed: %s", err);
    if (rc) return;
    EXPECT(got == want, "status: expected %s, got %s", names[want], got <= LP_UNBOUNDED ? names[got] : "none");
    if (got != LP_OPTIMAL || want != LP_OPTIMAL) return;
    EXPECT(fabs(obj - obj_want) <= 1e-9, "objective: expected %.10g, got %.10g", obj_want, obj);
    for (int j = 0; j < n; j++) EXPECT(fabs(x[j] - x_want[j]) <= 1e-9, "x[%d]: expected %.10g, got %.10g", j, x_want[j], x[j]);
}

/* Hillier and Lieberman's Wyndor Glass: max 3 x1 + 5 x2, x1 <= 4, 2 x2 <= 12, 3 x1 + 2 x2 <= 18;
 * optimum 36 at (2, 6). As a minimization, -36. */
static void test_textbook_max(void) {
    double c[] = {-3, -5}, A[] = {1, 0, 0, 2, 3, 2}, b[] = {4, 12, 18}, x[] = {2, 6};
    lp_sense s[] = {LP_LE, LP_LE, LP_LE};
    expect(2, 3, c, A, s, b, LP_OPTIMAL, x, -36);
}

/* min x1 + 2 x2 + 3 x3, x1 + x2 + x3 = 1, x1 - x2 = 0: on the line x1 = x2 = t, x3 = 1 - 2t, the
 * objective is 3 - 3t, least at t = 1/2: (1/2, 1/2, 0), 3/2. */
static void test_equalities(void) {
    double c[] = {1, 2, 3}, A[] = {1, 1, 1, 1, -1, 0}, b[] = {1, 0}, x[] = {0.5, 0.5, 0};
    lp_sense s[] = {LP_EQ, LP_EQ};
    expect(3, 2, c, A, s, b, LP_OPTIMAL, x, 1.5);
}

/* A diet: min 2 x1 + 3 x2, x1 + x2 >= 4, x1 + 3 x2 >= 6. The origin is not feasible, so phase 1
 * has work; the vertices are (0, 4): 12, (3, 1): 9, (6, 0): 12. The same with the first row
 * written -x1 - x2 <= -4 (a negative rhs). */
static void test_phase1_ge_rows(void) {
    double c[] = {2, 3}, A[] = {1, 1, 1, 3}, b[] = {4, 6}, x[] = {3, 1};
    lp_sense s[] = {LP_GE, LP_GE};
    expect(2, 2, c, A, s, b, LP_OPTIMAL, x, 9);
    double A2[] = {-1, -1, 1, 3}, b2[] = {-4, 6};
    lp_sense s2[] = {LP_LE, LP_GE};
    expect(2, 2, c, A2, s2, b2, LP_OPTIMAL, x, 9);
}

/* x1 + x2 <= 1 and x1 + x2 >= 2; the same with a gap of 1e-6 (well above lp.c's tolerance of
 * 1e-9), while an overlap of 1e-6 is feasible; and 0 . x = 1. */
static void test_infeasible(void) {
    double c[] = {1, 1}, A[] = {1, 1, 1, 1}, b[] = {1, 2};
    lp_sense s[] = {LP_LE, LP_GE};
    expect(2, 2, c, A, s, b, LP_INFEASIBLE, NULL, 0);
    double gap[] = {1, 1 + 1e-6}, overlap[] = {1, 1 - 1e-6}, x[] = {1 - 1e-6, 0};
    expect(2, 2, c, A, s, gap, LP_INFEASIBLE, NULL, 0);
    expect(2, 2, c, A, s, overlap, LP_OPTIMAL, x, 1 - 1e-6);
    double A0[] = {0, 0}, b0[] = {1};
    lp_sense s0[] = {LP_EQ};
    expect(2, 1, c, A0, s0, b0, LP_INFEASIBLE, NULL, 0);
}

/* min -x1, x1 - x2 <= 1: the ray (1, 1) from (1, 0). And min -x1 with no rows at all. */
static void test_unbounded(void) {
    double c[] = {-1, 0}, A[] = {1, -1}, b[] = {1};
    lp_sense s[] = {LP_LE};
    expect(2, 1, c, A, s, b, LP_UNBOUNDED, NULL, 0);
    expect(2, 0, c, NULL, NULL, NULL, LP_UNBOUNDED, NULL, 0);
    double c0[] = {1, 0}, x0[] = {0, 0};
    expect(2, 0, c0, NULL, NULL, NULL, LP_OPTIMAL, x0, 0); /* and with c >= 0: the origin */
}

/* Beale (1955): min -3/4 x4 + 20 x5 - 1/2 x6 + 6 x7 (here x1 .. x4), with
 *     1/4 x4 -  8 x5 -   x6 + 9 x7 <= 0
 *     1/2 x4 - 12 x5 - 1/2 x6 + 3 x7 <= 0
 *                          x6       <= 1
 * The textbook tableau with the largest-coefficient rule and the lowest-index tie-break cycles
 * through six degenerate bases at the origin forever. (lp.c's rows are equilibrated first, which
 * changes the slacks' reduced costs and happens to break this cycle; the next test has one that
 * survives.) The optimum is -5/4 at x4 = 1, x6 = 1. */
static void test_beale(void) {
    double c[] = {-0.75, 20, -0.5, 6};
    double A[] = {0.25, -8, -1, 9, 0.5, -12, -0.5, 3, 0, 0, 1, 0}, b[] = {0, 0, 1}, x[] = {1, 0, 1, 0};
    lp_sense s[] = {LP_LE, LP_LE, LP_LE};
    expect(4, 3, c, A, s, b, LP_OPTIMAL, x, -1.25);
}

/* An LP on which lp.c's own pivots cycle when they never switch to Bland's rule: three degenerate
 * rows through the origin, found by a seeded search over small integer LPs with lp.c's entering
 * rule forced to Dantzig's (it then ran into the iteration bound: six bases at the origin, over
 * and over). A fourth row, sum(x) <= 1, bounds it. Enumerating the vertices in rationals gives the
 * unique optimum -4/25 at (4/25, 16/75, 14/75, 0, 11/25, 0). */
static void test_cycling(void) {
    double c[] = {4, -2, -2, 0, 0, 7}, b[] = {0, 0, 0, 1};
    double A[] = {0, -5, 1, 8, 2, -7, -4, 8, -1, -5, -2, 5, -7, 5, 5, -7, -2, -8, 1, 1, 1, 1, 1, 1};
    double x[] = {4.0 / 25, 16.0 / 75, 14.0 / 75, 0, 11.0 / 25, 0};
    lp_sense s[] = {LP_LE, LP_LE, LP_LE, LP_LE};
    expect(6, 4, c, A, s, b, LP_OPTIMAL, x, -4.0 / 25);
}

/* Redundant rows, which phase 1 must drop: x1 + x2 = 2 three times over (once doubled, once
 * negated), min x1 - x2: (0, 2), -2. And an all-zero row 0 . x = 0, and 0 . x >= 0. */
static void test_redundant_rows(void) {
    double c[] = {1, -1}, A[] = {1, 1, 2, 2, -1, -1, 0, 0, 0, 0}, b[] = {2, 4, -2, 0, 0}, x[] = {0, 2};
    lp_sense s[] = {LP_EQ, LP_EQ, LP_EQ, LP_EQ, LP_GE};
    expect(2, 5, c, A, s, b, LP_OPTIMAL, x, -2);
}

/* A right-hand side pushed below 0 by an entry the ratio test skips: min -x1 with x1 + x2 <= 100
 * and 5e-10 x1 + x3 - x4 = 0, whose 5e-10 is under lp.c's pivot tolerance (1e-9 of its column).
 * Phase 1 makes x3 basic in row 2 at 0; x1 enters on row 1 with a step of 100, which would leave
 * x3 at -5e-8, 50 times below what the suite accepts as x >= 0. lp.c sets such right-hand sides
 * to 0 (its Tolerances): x = (100, 0, 0, 0), row 2 off by 5e-8, within the rows' 1e-7. GLPK,
 * exact or not: -100 at (100, 0, 0, 5e-8). */
static void test_skipped_entry_keeps_x_nonnegative(void) {
    lp_case k = {.n = 4, .m = 2, .c = {-1, 0, 0, 0}, .A = {1, 1, 0, 0, 5e-10, 0, 1, -1}, .b = {100, 0},
                 .sense = {LP_LE, LP_EQ}};
    double ref = 0, x[4] = {0}, obj = 0;
    CU_ASSERT_EQUAL_FATAL(glpk_solve(&k, &ref), LP_OPTIMAL);
    lp_problem p = problem_of(&k);
    lp_status got = (lp_status)-1;
    char err[FG_ERR_LEN] = "";
    int rc = lp_solve(&p, &got, x, &obj, err);
    EXPECT(rc == 0 && got == LP_OPTIMAL, "status: expected optimal, got rc %d, status %d %s", rc, (int)got, err);
    if (rc || got != LP_OPTIMAL) return;
    EXPECT(fabs(obj - ref) <= 1e-7 * fmax(1, fabs(ref)), "objective: expected %.10g (GLPK), got %.10g", ref, obj);
    int low = 0;
    for (int j = 1; j < k.n; j++) low = x[j] < x[low] ? j : low;
    EXPECT(x[low] >= -1e-9, "x >= 0: expected every x_j >= -1e-9, got x[%d] = %.3g (a right-hand side below "
           "0 left in the tableau)", low, x[low]);
    EXPECT(point_ok(&k, x, obj), "x = (%g, %g, %g, %g): expected x >= -1e-9 and both rows within 1e-7 of "
           "their scale", x[0], x[1], x[2], x[3]);
}

/* Right-hand sides 1e13 apart: x1 + x2 = 1 and x1 + x2 <= 1/2 contradict each other whatever a
 * row x3 <= 1e13 says; with x1 + x2 <= 3/2 instead, min x1 + 2 x2 - x3 is -1e13 + 1 at
 * (1, 0, 1e13). Each row's right-hand side is read against its own scale, not the largest's. */
static void test_far_right_hand_sides(void) {
    double c[] = {1, 2, -1}, A[] = {1, 1, 0, 1, 1, 0, 0, 0, 1}, x[] = {1, 0, 1e13};
    lp_sense s[] = {LP_EQ, LP_LE, LP_LE};
    double contradicting[] = {1, 0.5, 1e13}, consistent[] = {1, 1.5, 1e13};
    expect(3, 3, c, A, s, contradicting, LP_INFEASIBLE, NULL, 0);
    expect(3, 3, c, A, s, consistent, LP_OPTIMAL, x, -1e13 + 1);
}

static void test_bad_sizes(void) {
    double c[] = {1}, A[] = {1}, b[] = {1}, x[1], obj;
    lp_sense s[] = {LP_LE};
    lp_status st;
    struct { int n, m; } bad[] = {{0, 1}, {-3, 1}, {1, -1}};
    for (int k = 0; k < 3; k++) {
        lp_problem p = {.n_vars = bad[k].n, .n_rows = bad[k].m, .c = c, .A = A, .sense = s, .b = b};
        char err[FG_ERR_LEN] = "";
        CU_ASSERT_EQUAL(lp_solve(&p, &st, x, &obj, err), -1);
        CU_ASSERT(strlen(err) > 0 && strchr(err, '\n') == NULL);
    }
}

void add_lp_tests(void) {
    CU_pSuite s = CU_add_suite("lp", NULL, NULL);
    CU_add_test(s, "random LPs: status, objective and a feasible x as GLPK", test_random_against_glpk);
    CU_add_test(s, "textbook maximization (Wyndor Glass)", test_textbook_max);
    CU_add_test(s, "equality rows", test_equalities);
    CU_add_test(s, ">= rows need phase 1; a negative rhs", test_phase1_ge_rows);
    CU_add_test(s, "infeasible rows", test_infeasible);
    CU_add_test(s, "unbounded ray; no rows", test_unbounded);
    CU_add_test(s, "Beale's example", test_beale);
    CU_add_test(s, "an LP Dantzig's rule alone cycles on ends at its optimum", test_cycling);
    CU_add_test(s, "redundant and zero rows are dropped", test_redundant_rows);
    CU_add_test(s, "an entry under the pivot tolerance leaves no x below 0",
                test_skipped_entry_keeps_x_nonnegative);
    CU_add_test(s, "right-hand sides 1e13 apart", test_far_right_hand_sides);
    CU_add_test(s, "bad sizes give -1 and an error line", test_bad_sizes);
}
