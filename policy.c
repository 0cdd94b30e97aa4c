/* policy.c: the policy search of the paper's §4.3 ("Policy Search"): for each block shape, the
 * LP of Eq. (1) over the placement (solved by lp.c, with cost_model.c's coefficients), its
 * optimum rounded to percentages, each choice checked with a plan check it is given, the best
 * kept.
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include "flexgen.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ============================================================================================
 * The policy search (§4.3, "Policy Search"). For a block shape (gbs, ngb), whether decode
 * attention is delegated to the CPU, and whether weights pass through staging, Eq. (1) is the LP
 *     minimize   (l T_pre + l (n - 1) T_gen + n head) / bls
 *     subject to T_pre >= each prefill term, T_gen >= each decode term  (linear in x)
 *                wg + wc + wn = 1, cg + cc + cn = 1, hg + hc + hn = 1
 *                peak bytes of each tier (and of host memory) <= its capacity
 *                l T_pre + l (n - 1) T_gen + n head <= max_latency          (when asked)
 * over x (9 fractions) and T_pre, T_gen, once for each case of where the weights may go
 * (FG_W_GPU: wg = 1, FG_W_MEMORY: wn = 0, FG_W_DISK: anywhere). Its optimum is rounded to integer percentages, the
 * runtime realizes those at tensor and row granularity, and that realized placement is what
 * is checked and evaluated. The shapes' LP optima are tried best first (equal ones: the smaller
 * block first); a rounded plan that does not fit first has its weight percentages stepped down
 * to what the LP asked for (snap_weights), then is retried with a GPU batch one smaller.
 * ============================================================================================ */

enum { V_PRE = N_X, V_GEN, N_VARS, MAX_ROWS = 2 * N_TERMS + 3 + N_TIERS + 3 };

typedef struct {
    int gbs, ngb, cpu_cache_compute, weights; /* weights: FG_W_GPU, _MEMORY or _DISK */
    double objective;   /* the LP's T / bls */
    double x[N_X];
} candidate;

typedef struct {
    const opt_config *cfg;   /* what the cost and memory models see: a pipeline stage's share of
                                the decoder layers (§4.4: a stage is an l/m-layer model) */
    const opt_config *model; /* the whole model, which the runtime check opens (as its stage) */
    opt_config stage_cfg;
    const fg_hardware *hw;
    const fg_policy *base;
    const fg_search_request *req;
    double capacity[N_TIERS], host_memory;
    int lps, checks;
} search;

static fg_workload workload_of(const search *S, int gbs, int ngb, int cpu_cache_compute) {
    return (fg_workload){.s = S->req->s, .n = S->req->n, .gbs = gbs, .ngb = ngb,
                         .cpu_cache_compute = cpu_cache_compute,
                         .compress_weight = S->base->compress_weight,
                         .compress_cache = S->base->compress_cache, .micro = S->base->n_stages};
}

/* The LP's rows, one at a time: coefficients over x (and T_pre, T_gen), sense, right side. */
typedef struct {
    double A[MAX_ROWS][N_VARS], b[MAX_ROWS];
    lp_sense sense[MAX_ROWS];
    int n;
} lp_rows;

static double *row_add(lp_rows *r, lp_sense sense, double b) {
    r->sense[r->n] = sense;
    r->b[r->n] = b;
    return r->A[r->n++];
}

/* coef . x (+ t T) <= bound - constant */
static void row_le(lp_rows *r, const fg_linear *f, int t_var, double bound) {
    double *a = row_add(r, LP_LE, bound - f->constant);
    memcpy(a, f->coef, sizeof f->coef);
    if (t_var >= 0) a[t_var] = -1;
}

static int solve_shape(search *S, candidate *cd, char *err) {
    fg_workload w = workload_of(S, cd->gbs, cd->ngb, cd->cpu_cache_compute);
    fg_cost_model cm;
    fg_memory_model mm;
    fg_cost_model_build(S->cfg, &w, S->hw, &cm);
    fg_memory_model_build(S->cfg, &w, S->hw, cd->weights, &mm);
    double l = S->cfg->n_layers, n = w.n, bls = (double)w.gbs * w.ngb;
    lp_rows r = {.n = 0};
    for (int i = 0; i < N_TERMS; i++) row_le(&r, &cm.pre[i], V_PRE, 0), row_le(&r, &cm.gen[i], V_GEN, 0);
    for (int k = 0; k < 3; k++) {
        double *a = row_add(&r, LP_EQ, 1);
        a[3 * k] = a[3 * k + 1] = a[3 * k + 2] = 1;
    }
    for (int t = 0; t < N_TIERS; t++) row_le(&r, &mm.tier[t], -1, S->capacity[t]);
    if (S->host_memory > 0) row_le(&r, &mm.host, -1, S->host_memory);
    if (cd->weights == FG_W_GPU) row_add(&r, LP_EQ, 1)[X_WG] = 1;
    if (cd->weights == FG_W_MEMORY) row_add(&r, LP_EQ, 0)[X_WN] = 1;
    if (S->req->max_latency > 0) {
        double *a = row_add(&r, LP_LE, S->req->max_latency - n * cm.head);
        a[V_PRE] = l, a[V_GEN] = l * (n - 1);
    }
    double c[N_VARS] = {0}, x[N_VARS], z;
    c[V_PRE] = l / bls, c[V_GEN] = l * (n - 1) / bls;
    /* Among placements of equal T (a term that does not bound T is free), prefer the faster
     * tiers: the model leaves out what each small transfer costs. The nudge is 1e-4 of the
     * compute time per tier step, and is not part of the objective reported. */
    double nudge = 1e-4 * (c[V_PRE] * cm.pre[T_COMP].constant + c[V_GEN] * cm.gen[T_COMP].constant);
    for (int k = 0; k < 3; k++) c[3 * k + 1] = nudge, c[3 * k + 2] = 2 * nudge;
    lp_problem p = {N_VARS, r.n, c, &r.A[0][0], r.sense, r.b};
    lp_status status;
    S->lps++;
    if (lp_solve(&p, &status, x, &z, err)) return -1;
    if (status != LP_OPTIMAL) return 0;
    cd->objective = c[V_PRE] * x[V_PRE] + c[V_GEN] * x[V_GEN] + n * cm.head / bls;
    memcpy(cd->x, x, sizeof cd->x);
    return 1;
}

/* Integer percentages near the fractions on the gpu and cpu tiers, the pair at most 100. */
static void round_pair(double gpu, double cpu, int *g, int *c) {
    *g = (int)lround(100 * gpu), *c = (int)lround(100 * cpu);
    *g = *g < 0 ? 0 : *g > 100 ? 100 : *g;
    *c = *c < 0 ? 0 : *c > 100 - *g ? 100 - *g : *c;
}

static fg_percent round_percent(const double x[N_X]) {
    fg_percent pc;
    round_pair(x[X_WG], x[X_WC], &pc.wg, &pc.wc);
    round_pair(x[X_CG], x[X_CC], &pc.cg, &pc.cc);
    round_pair(x[X_HG], x[X_HC], &pc.hg, &pc.hc);
    return pc;
}

static fg_policy policy_of(const search *S, const candidate *cd) {
    fg_policy p = *S->base;
    p.gpu_batch_size = cd->gbs, p.num_gpu_batches = cd->ngb;
    p.cpu_cache_compute = cd->cpu_cache_compute;
    p.percent = round_percent(cd->x);
    return p;
}

/* This runtime's verdict on policy p (the check the search was given) for blocks of bls
 * sequences, one for each stage of a pipeline (§4.4). */
static int runtime_check(const search *S, const fg_policy *p, int bls, int check, double x[N_X],
                         fg_stats *st, char *err) {
    int sequences = bls * (p->n_stages > 1 ? p->n_stages : 1);
    if (S->req->check) return S->req->check(S->model, S->req->seed, p, sequences, S->req->s, S->req->n, check, x, st, err);
    fg_policy there = *p; /* another machine: where this runtime would place the weights there */
    there.device = FG_DEVICE_CPU;
    return S->req->place(S->model, S->req->seed, &there, sequences, S->req->s, S->req->n, 0, x, st, err);
}

static void percent_fractions(const fg_percent *pc, double x[N_X]) {
    x[X_WG] = pc->wg / 100.0, x[X_WC] = pc->wc / 100.0, x[X_WN] = 1 - x[X_WG] - x[X_WC];
    x[X_CG] = pc->cg / 100.0, x[X_CC] = pc->cc / 100.0, x[X_CN] = 1 - x[X_CG] - x[X_CC];
    x[X_HG] = pc->hg / 100.0, x[X_HC] = pc->hc / 100.0, x[X_HN] = 1 - x[X_HG] - x[X_HC];
}

/* For another machine: the first tier whose memory model exceeds its capacity at the placement
 * the rounded percentages realize (N_TIERS: the host's memory), or -1; *need its bytes. */
static int tier_over(const search *S, const fg_policy *p, double x[N_X], double *need) {
    char err[FG_ERR_LEN];
    percent_fractions(&p->percent, x);
    if (S->req->place) runtime_check(S, p, p->gpu_batch_size * p->num_gpu_batches, 0, x, NULL, err);
    fg_workload w = workload_of(S, p->gpu_batch_size, p->num_gpu_batches, p->cpu_cache_compute);
    fg_memory_model mm;
    fg_memory_model_build(S->cfg, &w, S->hw, fg_weights_case(x, p->compress_weight && !S->hw->gpu_is_host), &mm);
    for (int t = 0; t < N_TIERS; t++)
        if ((*need = fg_linear_eval(&mm.tier[t], x)) > S->capacity[t]) return t;
    if (S->host_memory > 0 && (*need = fg_linear_eval(&mm.host, x)) > S->host_memory) return N_TIERS;
    return -1;
}

/* Does policy p fit? On this machine the runtime's plan check says, and x becomes the placement
 * it realizes; for another machine, the memory model at the rounded percentages. */
static int plan_fits(search *S, const fg_policy *p, double x[N_X]) {
    char err[FG_ERR_LEN];
    double need;
    S->checks++;
    if (S->req->check)
        return runtime_check(S, p, p->gpu_batch_size * p->num_gpu_batches, 1, x, NULL, err) == 0;
    return tier_over(S, p, x, &need) < 0;
}

/* Best objective first; among equal ones (to 1e-6: a compute-bound block gains nothing from
 * growing) the smaller block, whose latency and memory are less. */
static int same_cost(double a, double b) { return isfinite(a) && isfinite(b) && fabs(a - b) <= 1e-6 * fmax(a, b); }
/* The runtime places whole tensors, each on the tier where its midpoint falls, so a weight
 * percentage can realize up to half a tensor more than asked on the gpu or cpu tier (a third of
 * a decoder layer, for fc1). When the rounded plan does not fit, its gpu, then cpu, percentage
 * steps down until the realized fraction is no more than the LP's. */
static void snap_weights(search *S, fg_policy *p, const double lp_x[N_X]) {
    char err[FG_ERR_LEN];
    double x[N_X];
    int bls = p->gpu_batch_size * p->num_gpu_batches;
    int *percent[2] = {&p->percent.wg, &p->percent.wc};
    for (int t = 0; t < 2; t++)
        while (*percent[t] > 0 && runtime_check(S, p, bls, 0, x, NULL, err) == 0 &&
               x[X_WG + t] > lp_x[X_WG + t] + 1e-9)
            (*percent[t])--;
}

static int by_objective(const void *a, const void *b) {
    const candidate *x = a, *y = b;
    if (!same_cost(x->objective, y->objective)) return x->objective < y->objective ? -1 : 1;
    return x->gbs * x->ngb - y->gbs * y->ngb;
}

/* GPU batch sizes tried: 1, 2, 4, 8, then steps of a quarter of the power of two below
 * (multiples of 4, as §4.3 suggests: 12, 16, 20, ..., 32, 40, ..., 64, 80, ...). */
static int next_gbs(int g) {
    if (g < 8) return 2 * g;
    int p = 1;
    while (2 * p <= g) p *= 2;
    return g + p / 4;
}

enum { MAX_NGB = 32, MAX_GBS = 4096, MAX_SHRINK = 16 };

static double seconds_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Every shape's LP optimum, into *out (malloc'd). */
static int enumerate(search *S, candidate **out, int *n_out, char *err) {
    int cap = 256, n = 0, max_block = S->req->max_block > 0 ? S->req->max_block : MAX_GBS * MAX_NGB;
    candidate *all = malloc(cap * sizeof *all);
    if (!all) return fg_fail(err, "out of memory");
    const fg_search_request *r = S->req;
    for (int gbs = r->gbs ? r->gbs : 1; gbs <= MAX_GBS && gbs <= max_block; gbs = r->gbs ? MAX_GBS + 1 : next_gbs(gbs)) {
        int any = 0;
        for (int ngb = r->ngb ? r->ngb : 1; ngb <= MAX_NGB && gbs * ngb <= max_block; ngb = r->ngb ? MAX_NGB + 1 : ngb + 1) {
            int fits = 0;
            for (int v = 0; v < 2 * FG_W_CASES; v++) {
                candidate cd = {.gbs = gbs, .ngb = ngb, .cpu_cache_compute = v & 1, .weights = v >> 1};
                if (cd.weights == FG_W_GPU && S->base->compress_weight && !S->hw->gpu_is_host)
                    continue; /* 4-bit, decompressed into staging */
                int rc = solve_shape(S, &cd, err);
                if (rc < 0) { free(all); return -1; }
                if (rc == 0) continue;
                fits = 1;
                if (n == cap) {
                    candidate *more = realloc(all, 2 * cap * sizeof *all);
                    if (!more) { free(all); return fg_fail(err, "out of memory"); }
                    all = more, cap *= 2;
                }
                all[n++] = cd;
            }
            if (!fits) break; /* memory only grows with ngb */
            any = 1;
        }
        if (!any) break;      /* and with gbs */
    }
    *out = all, *n_out = n;
    return 0;
}

/* The reason nothing fits: the plan check of the smallest block with everything off the gpu. */
static int explain_nothing_fits(search *S, char *err) {
    if (S->req->max_latency > 0)
        return fg_fail(err, "--max-latency %g: no policy fits the capacities within that block latency",
                       S->req->max_latency);
    fg_policy p = *S->base;
    p.gpu_batch_size = p.num_gpu_batches = 1;
    p.percent = (fg_percent){0};
    char why[FG_ERR_LEN] = "";
    if (S->req->check && runtime_check(S, &p, 1, 1, NULL, NULL, why))
        return fg_fail(err, "no policy fits %s: even one sequence with everything off the gpu tier: %s",
                       S->cfg->name, why);
    return fg_fail(err, "no policy fits %s in --gpu-mem, --cpu-mem and --disk-mem (prompt %d + %d tokens)",
                   S->cfg->name, S->req->s, S->req->n);
}

/* The capacities the plan must fit: on this machine the runtime's (defaults filled in). */
static int search_init(search *S, const opt_config *cfg, const fg_hardware *hw, const fg_policy *base,
                       const fg_search_request *req, char *err) {
    *S = (search){.cfg = cfg, .model = cfg, .stage_cfg = *cfg, .hw = hw, .base = base, .req = req};
    if (base->n_stages > 1) {
        int first, end;
        fg_stage_layers(cfg, base->stage, base->n_stages, &first, &end);
        S->stage_cfg.n_layers = (end > cfg->n_layers + 1 ? cfg->n_layers + 1 : end) - (first > 0 ? first : 1);
        S->cfg = &S->stage_cfg;
    }
    if (req->s < 1 || req->n < 1) return fg_fail(err, "policy search: prompt and generation lengths must be at least 1");
    if (!req->check) {
        for (int t = 0; t < N_TIERS; t++)
            if (!(base->capacity[t] > 0))
                return fg_fail(err, "planning for another machine (the hardware file is not this one's): "
                                    "give --gpu-mem, --cpu-mem and --disk-mem");
        memcpy(S->capacity, base->capacity, sizeof S->capacity);
        return 0;
    }
    fg_stats st = {0};
    int rc = runtime_check(S, base, 0, 0, NULL, &st, err);
    memcpy(S->capacity, st.capacity, sizeof S->capacity);
    S->host_memory = hw->gpu_is_host ? st.host_memory : 0;
    return rc;
}

/* Policy p's prediction at the placement it realizes, into *out; 0 when it does not fit. */
static int evaluate(search *S, const fg_policy *p, fg_search_result *out) {
    double x[N_X];
    if (!plan_fits(S, p, x)) return 0;
    out->policy = *p;
    memcpy(out->x, x, sizeof out->x);
    out->workload = workload_of(S, p->gpu_batch_size, p->num_gpu_batches, p->cpu_cache_compute);
    fg_cost_model_build(S->cfg, &out->workload, S->hw, &out->cost);
    double per_seq = fg_cost_per_token(&out->cost, S->cfg, &out->workload, x, &out->t_pre, &out->t_gen);
    out->block_latency = per_seq * p->gpu_batch_size * p->num_gpu_batches;
    out->throughput = S->req->n / per_seq;
    return 1;
}

int fg_policy_evaluate(const opt_config *cfg, const fg_hardware *hw, const fg_policy *p,
                       const fg_search_request *req, fg_search_result *out, char *err) {
    search S;
    memset(out, 0, sizeof *out);
    if (search_init(&S, cfg, hw, p, req, err)) return -1;
    if (evaluate(&S, p, out)) return 0;
    if (req->check) return runtime_check(&S, p, p->gpu_batch_size * p->num_gpu_batches, 1, NULL, NULL, err);
    static const char *const flags[N_TIERS + 1] = {"--gpu-mem", "--cpu-mem", "--disk-mem", "memory"};
    double x[N_X], need;
    int t = tier_over(&S, p, x, &need);
    if (t < 0) return fg_fail(err, "the policy does not fit"); /* not reached: evaluate() fit it */
    return fg_fail(err, "%s tier: the memory model needs %.2f GiB, %s gives %.2f GiB",
                   t < N_TIERS ? fg_tier_names[t] : "host", need / (1 << 30), flags[t],
                   (t < N_TIERS ? S.capacity[t] : S.host_memory) / (1 << 30));
}

int fg_policy_search(const opt_config *cfg, const fg_hardware *hw, const fg_policy *base,
                     const fg_search_request *req, fg_search_result *out, char *err) {
    double t0 = seconds_now();
    search S;
    memset(out, 0, sizeof *out);
    if (search_init(&S, cfg, hw, base, req, err)) return -1;
    candidate *all = NULL;
    int n = 0;
    if (enumerate(&S, &all, &n, err)) return -1;
    qsort(all, (size_t)n, sizeof *all, by_objective);
    double best = INFINITY;
    for (int i = 0; i < n && all[i].objective < best && !same_cost(all[i].objective, best); i++) {
        candidate cd = all[i];
        int shrinks = req->gbs ? 1 : MAX_SHRINK; /* a given block shape stays */
        for (int shrink = 0; shrink < shrinks && cd.gbs >= 1; shrink++, cd.gbs--) {
            int rc = shrink ? solve_shape(&S, &cd, err) : 1;
            if (rc < 0) { free(all); return -1; }
            fg_search_result r;
            fg_policy p = policy_of(&S, &cd);
            if (rc == 0) continue;
            if (!evaluate(&S, &p, &r)) {
                if (!req->check && !req->place) continue;
                snap_weights(&S, &p, cd.x);
                if (!evaluate(&S, &p, &r)) continue;
            }
            if (req->max_latency > 0 && r.block_latency > req->max_latency) continue;
            double per_seq = r.block_latency / (cd.gbs * cd.ngb);
            if (per_seq < best && !same_cost(per_seq, best)) best = per_seq, *out = r;
            break;
        }
    }
    free(all);
    out->lps = S.lps, out->checks = S.checks;
    out->seconds = seconds_now() - t0;
    if (best == INFINITY) return explain_nothing_fits(&S, err);
    return 0;
}
