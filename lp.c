/* lp.c: a dense two-phase simplex (lp_solve), the solver of the placement LP of the paper's §4.3
 * ("Policy Search"; policy.c builds the LP, cost_model.c its coefficients).
 *
 * §4.3 enumerates the block shape (bls, gbs) and, for each, finds the placement
 * p = (wg, wc, wn, cg, cc, cn, hg, hc, hn) by linear programming, Eq. (1): minimize T / bls such
 * that each tier's peak memory fits its capacity and each triple sums to 1. A.3 writes T from
 * max(...)es of a layer's five latencies (ctog, gtoc, dtoc, ctod, comp) in prefill and in decode;
 * each max becomes linear as one more variable that is >= every one of its terms. That LP has a few
 * tens of variables and rows, all of them dense: a full tableau is the simplest method there is
 * and, at this size, also the fastest (no factorization to keep, nothing sparse to index).
 *
 * The problem (lp_problem in flexgen.h): minimize c.x subject to A_i . x {<=, =, >=} b_i, x >= 0.
 *
 * Standard form. Each row is negated when b_i < 0 (<= and >= swap), so that every right-hand side
 * is >= 0 (a >= row with b_i = 0 too: as a <= row it starts with its slack basic), and divided by
 * its largest |A_ij| (see Tolerances). Then
 *     a <= row gets a slack    s >= 0:   A_i . x + s = b_i    s is its first basic variable
 *     a >= row gets a surplus  s >= 0:   A_i . x - s = b_i    and an artificial a_i >= 0
 *     an = row                           A_i . x     = b_i    and an artificial a_i >= 0
 * The artificial is the first basic variable of its row: x = 0, s = b on the <= rows, a = b on the
 * others is a vertex of the enlarged problem, though a point of the real one only if every a = 0.
 *
 * The tableau: m constraint rows and one row of reduced costs, w = n + 1 doubles each, where n
 * counts the columns of x and then of the slacks and surpluses:
 *     row i < m:   T_ij, row i of B^-1 A  | B^-1 b_i, the value of row i's basic variable (rhs)
 *     row d:       reduced costs d_j      | -(the objective at the current vertex)
 * basis[i] names row i's basic variable: a column, or ART for row i's artificial. Artificial
 * columns are not stored: while an artificial is basic its column is a unit vector, and once it
 * has left the basis it is never let back in (it only served to find a first vertex), so nothing
 * would read them.
 *
 * A pivot on (p, q) makes column q basic in row p: row p is divided by T_pq, and T_iq times row p
 * is subtracted from every other row, the reduced costs included. Column q becomes a unit vector.
 *
 * Phase 1 minimizes the sum of the artificials from the slack/artificial basis; its reduced costs
 * are d_j = -(sum of T_ij over the rows whose basic variable is artificial). A minimum above zero
 * means no x satisfies the rows: LP_INFEASIBLE. At zero, artificials may still be basic, at value 0
 * (a degenerate vertex). Each is pivoted out on its row's largest entry, a pivot that moves nothing
 * since its rhs is 0; a row with no entry above the pivot tolerance is a combination of other rows
 * (a duplicated equality, say) and is dropped.
 *
 * Phase 2 minimizes c.x from phase 1's vertex, with d_j = c_j - sum_i c_basis(i) T_ij. When no
 * d_j < 0 the vertex is optimal. A column with d_j < 0 and no positive entry is a ray along which
 * c.x falls without end: LP_UNBOUNDED.
 *
 * Pivot rules. The entering column has the most negative d_j (Dantzig's rule, few pivots), except
 * right after a degenerate pivot (one whose step was 0, so the objective did not move), where it is
 * the first column with d_j < 0 (Bland's rule). The leaving row has the least ratio rhs_i / T_iq
 * over T_iq > 0, ties to the lowest basic variable (artificials first). Dantzig's rule alone can
 * cycle (Beale's example; tests/test_lp.c has an LP on which it cycles in this tableau), but only
 * through degenerate pivots: any other pivot lowers the objective strictly, so no earlier basis
 * can come back. A cycle would then be degenerate pivots each following a degenerate pivot, all of
 * them Bland's, and Bland's rule never cycles. So every solve ends, in about as many pivots as
 * Dantzig's rule alone takes (Bland's rule alone takes 2.7 times as many on the 40 x 40 LPs of
 * scripts/bench_lp.sh: 249 against 91).
 *
 * Tolerances (relative: 1e-9 for pivots, 1e-11 for values). Rounding in double precision is 1.1e-16
 * per operation and grows with the entries a pivot multiplies, so after the O(m) pivots of a solve
 * an entry that should be 0 is noise of around 1e-14 to 1e-12 of the largest numbers it was
 * computed from. Every comparison with 0 is therefore made relative to the scale of the numbers
 * compared, and each tolerance sits between that noise and the smallest real values:
 *     pivot entries T_iq   rows are divided by their largest |A_ij| up front; an entry at or under
 *                          1e-9 of the largest in its column is never a pivot (dividing by noise
 *                          makes x jump by 1e9 and more). The policy LP's widest spread in a row,
 *                          one token's activations against a layer's weights, 2 h1 / (8 h1^2 +
 *                          4 h1 h2), is 7e-6 for OPT-175B: far above 1e-9.
 *     right-hand sides     at or under 1e-11 x max|b_i| (of the scaled rows) are 0, and are set to
 *                          0: below 0 it can only be rounding (or an entry under the pivot
 *                          tolerance that the ratio test skipped), and a vertex must stay in
 *                          x >= 0; above 0, setting it makes the near-ties of a degenerate vertex
 *                          exact ties, with a step of exactly 0. (Only reading it as 0 in the
 *                          ratio test, then pivoting on its real value, would step rhs / T_pq, far
 *                          when T_pq is small, and push the other rows that far below 0.) The same
 *                          bound is the largest phase 1 minimum that still counts as feasible.
 *     reduced costs d_j    < -1e-11 x max|c_j| to enter (phase 1 costs are 1: 1e-11).
 * The values are those that sit mid-way in what the tests accept: on 30000 of tests/test_lp.c's
 * random LPs against GLPK, every answer agrees with a pivot tolerance anywhere from 1e-11 to 1e-7
 * (1e-12 pivots on noise) and a value tolerance from 1e-12 to 1e-9 (1e-13 misses noise, 1e-8 zeroes
 * real right-hand sides).
 */
#include "flexgen.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define LP_PIVOT_TOL 1e-9 /* see Tolerances above */
#define LP_ZERO_TOL 1e-11
#define ART (-1) /* basis[i] of a row whose artificial is basic; lowest in Bland's order */

typedef struct {
    int m;          /* constraint rows still in the tableau (redundant ones are dropped) */
    int n;          /* columns: n_vars of x, then the slacks and surpluses; column n is the rhs */
    int w;          /* row length, n + 1 */
    double *T;      /* [m][w] constraint rows */
    double *d;      /* [w] reduced costs; d[n] = -objective */
    int *basis;     /* [m] */
    double eps_b;   /* right-hand sides at or under this are zero */
} tableau;

static int check_problem(const lp_problem *p, char *err) {
    if (!p) return fg_fail(err, "lp_solve: no problem");
    if (p->n_vars < 1) return fg_fail(err, "lp_solve: n_vars is %d, needs at least 1", p->n_vars);
    if (p->n_rows < 0) return fg_fail(err, "lp_solve: n_rows is %d, needs at least 0", p->n_rows);
    if (!p->c) return fg_fail(err, "lp_solve: c is NULL");
    if (p->n_rows > 0 && (!p->A || !p->sense || !p->b))
        return fg_fail(err, "lp_solve: A, sense or b is NULL with %d rows", p->n_rows);
    for (int j = 0; j < p->n_vars; j++)
        if (!isfinite(p->c[j])) return fg_fail(err, "lp_solve: c[%d] is not finite", j);
    for (int i = 0; i < p->n_rows; i++) {
        if (p->sense[i] != LP_LE && p->sense[i] != LP_EQ && p->sense[i] != LP_GE)
            return fg_fail(err, "lp_solve: sense[%d] is %d, not LP_LE, LP_EQ or LP_GE", i,
                           (int)p->sense[i]);
        if (!isfinite(p->b[i])) return fg_fail(err, "lp_solve: b[%d] is not finite", i);
        for (int j = 0; j < p->n_vars; j++)
            if (!isfinite(p->A[(size_t)i * p->n_vars + j]))
                return fg_fail(err, "lp_solve: A[%d][%d] is not finite", i, j);
    }
    return 0;
}

/* The standard form above, in one allocation: rows negated to b >= 0 and scaled to max |A_ij| 1,
 * a slack or surplus column per inequality, the slack/artificial basis. */
static int tableau_build(tableau *t, const lp_problem *p, char *err) {
    int nv = p->n_vars, m = p->n_rows, n_slack = 0;
    for (int i = 0; i < m; i++) n_slack += p->sense[i] != LP_EQ;
    t->m = m;
    t->n = nv + n_slack;
    t->w = t->n + 1;
    size_t doubles = (size_t)(m + 1) * t->w;
    t->T = calloc(1, doubles * sizeof(double) + (size_t)m * sizeof(int));
    if (!t->T) return fg_fail(err, "lp_solve: out of memory for a %d x %d tableau", m + 1, t->w);
    t->d = t->T + (size_t)m * t->w;
    t->basis = (int *)(t->T + doubles);

    double bmax = 0;
    for (int i = 0, s = nv; i < m; i++) {
        const double *a = p->A + (size_t)i * nv;
        double *row = t->T + (size_t)i * t->w, amax = 0;
        for (int j = 0; j < nv; j++) amax = fmax(amax, fabs(a[j]));
        /* negated when b < 0, and also a >= row with b = 0: as a <= row it needs no artificial */
        lp_sense sense = p->sense[i];
        int negate = p->b[i] < 0 || (p->b[i] == 0 && sense == LP_GE);
        double scale = (amax > 0 ? 1 / amax : 1) * (negate ? -1 : 1);
        if (negate && sense != LP_EQ) sense = sense == LP_LE ? LP_GE : LP_LE;
        for (int j = 0; j < nv; j++) row[j] = a[j] * scale;
        row[t->n] = p->b[i] * scale;
        bmax = fmax(bmax, row[t->n]);
        if (sense == LP_LE) row[s] = 1, t->basis[i] = s++;
        else if (sense == LP_GE) row[s++] = -1, t->basis[i] = ART;
        else t->basis[i] = ART;
    }
    t->eps_b = LP_ZERO_TOL * bmax;
    for (int i = 0; i < m; i++) /* see Tolerances */
        if (t->T[(size_t)i * t->w + t->n] <= t->eps_b) t->T[(size_t)i * t->w + t->n] = 0;
    return 0;
}

/* Subtracts f = row[q] times the pivot row rp from row, leaving row[q] exactly 0. */
static void eliminate(double *row, const double *rp, int q, int w) {
    double f = row[q];
    if (f == 0) return;
    for (int j = 0; j < w; j++) row[j] -= f * rp[j];
    row[q] = 0;
}

static void pivot(tableau *t, int p, int q) {
    int w = t->w;
    double *rp = t->T + (size_t)p * w, inv = 1 / rp[q];
    for (int j = 0; j < w; j++) rp[j] *= inv;
    rp[q] = 1;
    if (rp[t->n] <= t->eps_b) rp[t->n] = 0;
    for (int i = 0; i < t->m; i++) {
        if (i == p) continue;
        double *row = t->T + (size_t)i * w;
        eliminate(row, rp, q, w);
        if (row[t->n] <= t->eps_b) row[t->n] = 0; /* see Tolerances */
    }
    eliminate(t->d, rp, q, w);
    t->basis[p] = q;
}

/* Dantzig: the most negative reduced cost; Bland: the first negative one. -1: optimal. */
static int entering(const tableau *t, double eps_d, int bland) {
    int q = -1;
    for (int j = 0; j < t->n; j++)
        if (t->d[j] < -eps_d && (q < 0 || t->d[j] < t->d[q])) {
            q = j;
            if (bland) break;
        }
    return q;
}

/* The minimum ratio rhs_i / T_iq over T_iq > 0, ties to the lowest basic variable. -1: a ray. */
static int leaving(const tableau *t, int q) {
    double colmax = 1; /* see Tolerances */
    for (int i = 0; i < t->m; i++) colmax = fmax(colmax, fabs(t->T[(size_t)i * t->w + q]));
    int p = -1;
    double best = 0;
    for (int i = 0; i < t->m; i++) {
        const double *row = t->T + (size_t)i * t->w;
        if (row[q] <= LP_PIVOT_TOL * colmax) continue;
        double r = row[t->n] / row[q];
        if (p < 0 || r < best || (r == best && t->basis[i] < t->basis[p])) p = i, best = r;
    }
    return p;
}

/* Pivots until the current reduced costs say optimal (LP_OPTIMAL) or a ray shows (LP_UNBOUNDED).
 * Returns -1 past 1000 (m + n + 10) pivots, over 500 times the most any phase of the random LPs of
 * tests/test_lp.c takes: only numerical trouble could get there. */
static int simplex(tableau *t, double eps_d, lp_status *status) {
    long limit = 1000L * (t->m + t->n + 10);
    int degenerate = 0;
    for (long it = 0; it < limit; it++) {
        int q = entering(t, eps_d, degenerate);
        if (q < 0) return *status = LP_OPTIMAL, 0;
        int p = leaving(t, q);
        if (p < 0) return *status = LP_UNBOUNDED, 0;
        degenerate = t->T[(size_t)p * t->w + t->n] == 0;
        pivot(t, p, q);
    }
    return -1;
}

/* Phase 1's reduced costs: minus the sum of the rows whose artificial is basic. */
static void phase1_costs(tableau *t) {
    memset(t->d, 0, t->w * sizeof(double));
    for (int i = 0; i < t->m; i++)
        if (t->basis[i] == ART) {
            const double *row = t->T + (size_t)i * t->w;
            for (int j = 0; j < t->w; j++) t->d[j] -= row[j];
        }
}

/* Phase 1's objective at the current vertex, summed afresh (d[n] has it too, but without the
 * right-hand sides that pivots set to 0). */
static double artificial_sum(const tableau *t) {
    double sum = 0;
    for (int i = 0; i < t->m; i++)
        if (t->basis[i] == ART) sum += t->T[(size_t)i * t->w + t->n];
    return sum;
}

/* After a phase 1 that reached zero: every artificial still basic (at 0) is pivoted out on its
 * row's largest entry, or its row, all zeros, is dropped (the last row takes its place). */
static void drive_out_artificials(tableau *t) {
    for (int i = 0; i < t->m;) {
        double *row = t->T + (size_t)i * t->w;
        if (t->basis[i] != ART) { i++; continue; }
        int q = 0;
        for (int j = 1; j < t->n; j++)
            if (fabs(row[j]) > fabs(row[q])) q = j;
        row[t->n] = 0;
        if (fabs(row[q]) > LP_PIVOT_TOL) {
            pivot(t, i, q);
            i++;
        } else {
            t->m--;
            memmove(row, t->T + (size_t)t->m * t->w, t->w * sizeof(double));
            t->basis[i] = t->basis[t->m];
        }
    }
}

/* Phase 2's reduced costs: c, minus c_basis(i) times row i for every row. */
static void phase2_costs(tableau *t, const double *c, int n_vars) {
    memset(t->d, 0, t->w * sizeof(double));
    memcpy(t->d, c, n_vars * sizeof(double));
    for (int i = 0; i < t->m; i++) {
        int k = t->basis[i];
        if (k >= n_vars) continue; /* a slack or surplus: cost 0 (no artificial is left) */
        const double *row = t->T + (size_t)i * t->w;
        for (int j = 0; j < t->w; j++) t->d[j] -= c[k] * row[j];
    }
}

/* Runs both phases on a built tableau. Returns -1 only past simplex()'s bound. */
static int solve_phases(tableau *t, const lp_problem *p, lp_status *status) {
    int has_artificial = 0;
    for (int i = 0; i < t->m; i++) has_artificial |= t->basis[i] == ART;
    if (has_artificial) {
        /* Phase 1 is bounded below by 0: a "ray" there can only be a column whose entries all
         * fell under the pivot tolerance, and phase 1 then ends where it is. */
        phase1_costs(t);
        if (simplex(t, LP_ZERO_TOL, status)) return -1;
        if (artificial_sum(t) > t->eps_b) return *status = LP_INFEASIBLE, 0;
        drive_out_artificials(t);
    }
    double cmax = 0;
    for (int j = 0; j < p->n_vars; j++) cmax = fmax(cmax, fabs(p->c[j]));
    phase2_costs(t, p->c, p->n_vars);
    return simplex(t, LP_ZERO_TOL * cmax, status);
}

int lp_solve(const lp_problem *p, lp_status *status, double *x, double *objective, char *err) {
    if (check_problem(p, err)) return -1;
    tableau t = {0};
    if (tableau_build(&t, p, err)) return -1;
    int rc = solve_phases(&t, p, status);
    if (rc) fg_fail(err, "lp_solve: the simplex did not end within its pivot bound on a %d x %d LP "
                    "(numerical trouble)", p->n_rows, p->n_vars);
    else if (*status == LP_OPTIMAL) {
        memset(x, 0, p->n_vars * sizeof(double));
        for (int i = 0; i < t.m; i++) /* x_j is its row's rhs when basic, else 0 */
            if (t.basis[i] >= 0 && t.basis[i] < p->n_vars)
                x[t.basis[i]] = t.T[(size_t)i * t.w + t.n];
        double z = 0;
        for (int j = 0; j < p->n_vars; j++) z += p->c[j] * x[j];
        *objective = z;
    }
    free(t.T);
    return rc;
}
