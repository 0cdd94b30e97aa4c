/* test_policy.c: the policy search of §4.3 (lp.c) on this runtime.
 *
 * Every policy the search returns must pass the runtime's plan check (fg_check_plan) for the
 * capacities it was given, and the placement it reports must be the one the runtime realizes.
 * The search must also be at least as good, by its own cost model, as every policy of a grid a
 * user could try by hand (up to what rounding to percentages and tensors can cost), honor the
 * block and latency bounds, and fail with one line when nothing fits.
 */
#include "tests.h"

#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A thin, deep model: what fits where changes with every capacity below. */
static const model_config CFG = OPT_SHAPE("policy-test", 8, 128, 4, 512, 1000, 256, 128, 1);
/* Rates of a machine with a slow disk and a fast compute device. */
static const fg_hardware HW = {.ctog_bdw = 8e9, .gtoc_bdw_cache = 4e9, .gtoc_bdw_hidden = 8e9,
    .dtoc_bdw = 1e9, .ctod_bdw_cache_p = 5e8, .ctod_bdw_hidden_p = 5e8, .ctod_bdw_g = 5e8,
    .mm_flops_p = 1e11, .mm_flops_g = 5e10, .bmm_flops_p = 5e10, .bmm_flops_g = 1e10,
    .cpu_flops = 1e10, .dequant_bdw = 4e9, .mem_bdw = 8e9, .gpu_is_host = 1};

static char *offload;

static int policy_init(void) { offload = make_temp_dir(); return 0; }
static int policy_clean(void) { rm_tree(offload); free(offload); return 0; }

static fg_policy base_policy(double gpu, double cpu, double disk, int compress) {
    fg_policy p = fg_default_policy();
    p.capacity[TIER_GPU] = gpu, p.capacity[TIER_CPU] = cpu, p.capacity[TIER_DISK] = disk;
    p.compress_weight = p.compress_cache = compress;
    p.offload_dir = p.weight_dir = offload;
    return p;
}

/* The runtime's plan check of p (model cfg) for its block, and the placement it realizes (x, if
 * not NULL). */
static int plan_check(const model_config *cfg, const fg_policy *p, int s, int n, double x[N_X], char *err) {
    int bls = p->gpu_batch_size * p->num_gpu_batches;
    return fg_runtime_check(cfg, 0, p, bls, s, n, 1, x, NULL, err);
}

static const double MiB = 1 << 20;

/* Capacities from "all fits on the gpu tier" to "weights and cache must go to disk". */
static const struct { double gpu, cpu, disk; } BUDGETS[] = {
    {512 * MiB, 512 * MiB, 1024 * MiB}, {24 * MiB, 512 * MiB, 1024 * MiB},
    {16 * MiB, 8 * MiB, 1024 * MiB}, {12 * MiB, 6 * MiB, 256 * MiB}, {40 * MiB, 4 * MiB, 64 * MiB},
};
enum { N_BUDGETS = sizeof BUDGETS / sizeof *BUDGETS };

static void test_search_passes_plan_check(void) {
    char err[FG_ERR_LEN];
    for (int b = 0; b < N_BUDGETS; b++)
        for (int compress = 0; compress < 2; compress++)
            for (int shape = 0; shape < 2; shape++) {
                fg_policy base = base_policy(BUDGETS[b].gpu, BUDGETS[b].cpu, BUDGETS[b].disk, compress);
                fg_search_request req = {.s = shape ? 64 : 16, .n = shape ? 8 : 32, .check = fg_runtime_check,
                                         .max_block = shape ? 48 : 0};
                fg_search_result r;
                int rc = fg_policy_search(&CFG, &HW, &base, &req, &r, err);
                CU_ASSERT_EQUAL(rc, 0);
                if (rc) { fprintf(stderr, "\n    budget %d: %s\n", b, err); continue; }
                double x[N_X];
                rc = plan_check(&CFG, &r.policy, req.s, req.n, x, err);
                CU_ASSERT_EQUAL(rc, 0);
                if (rc) fprintf(stderr, "\n    budget %d compress %d: %s\n", b, compress, err);
                for (int k = 0; rc == 0 && k < N_X; k++) CU_ASSERT_DOUBLE_EQUAL(x[k], r.x[k], 1e-12);
                int bls = r.policy.gpu_batch_size * r.policy.num_gpu_batches;
                CU_ASSERT(req.max_block == 0 || bls <= req.max_block);
                CU_ASSERT(r.throughput > 0 && isfinite(r.throughput));
                CU_ASSERT(r.seconds < 1.0);
                /* the other fields stay the caller's */
                CU_ASSERT_EQUAL(r.policy.compress_weight, compress);
                CU_ASSERT_DOUBLE_EQUAL(r.policy.capacity[TIER_CPU], BUDGETS[b].cpu, 0);
            }
}

/* Against every policy of a grid (block shapes x placements in steps of 25%), by the same cost
 * model at the placement each realizes: the search may lose only what rounding the LP's
 * fractions to percentages, rows and tensors costs. */
static void test_search_beats_hand_grid(void) {
    static const int gbs[] = {1, 4, 8, 16, 32}, ngb[] = {1, 2, 4, 8};
    char err[FG_ERR_LEN];
    for (int b = 1; b < N_BUDGETS; b++) {
        fg_policy base = base_policy(BUDGETS[b].gpu, BUDGETS[b].cpu, BUDGETS[b].disk, 0);
        fg_search_request req = {.s = 32, .n = 8, .check = fg_runtime_check, .max_block = 256};
        fg_search_result best;
        CU_ASSERT_EQUAL_FATAL(fg_policy_search(&CFG, &HW, &base, &req, &best, err), 0);
        double grid_best = 0;
        fg_policy grid_choice = base;
        for (int i = 0; i < 5; i++)
            for (int j = 0; j < 4; j++)
                for (int w = 0; w <= 4; w++)
                    for (int c = 0; c <= 4; c++)
                        for (int d = 0; d < 2; d++) {
                            fg_policy p = base;
                            p.gpu_batch_size = gbs[i], p.num_gpu_batches = ngb[j];
                            /* the rest of the weights and cache on cpu */
                            p.percent = (fg_percent){.wg = 25 * w, .wc = 100 - 25 * w, .cg = 25 * c,
                                                     .cc = 100 - 25 * c, .hg = 100};
                            p.cpu_cache_compute = d;
                            fg_search_result r;
                            if (fg_policy_evaluate(&CFG, &HW, &p, &req, &r, err) == 0 && r.throughput > grid_best)
                                grid_best = r.throughput, grid_choice = p;
                        }
        CU_ASSERT(grid_best > 0);
        CU_ASSERT(best.throughput >= 0.9 * grid_best);
        if (!(best.throughput >= 0.9 * grid_best))
            fprintf(stderr, "\n    budget %d: search %.4g token/s (%d x %d), grid %.4g (%d x %d, %d %d %d %d)\n",
                    b, best.throughput, best.policy.gpu_batch_size, best.policy.num_gpu_batches,
                    grid_best, grid_choice.gpu_batch_size, grid_choice.num_gpu_batches,
                    grid_choice.percent.wg, grid_choice.percent.wc, grid_choice.percent.cg,
                    grid_choice.percent.cc);
    }
}

/* opt-1.3b's shapes, 32 sequences, capacities where whole tensors overshoot the LP's fractions
 * (a weight percentage realizes up to half a tensor more) and the embedding, a whole layer, is
 * in flight from disk: the search still finds a policy, and it passes the plan check. (Nothing
 * is allocated: the plan is checked, about 2.5 GB of it against this machine's free memory.) */
static void test_search_tensor_granularity(void) {
    model_config cfg;
    char err[FG_ERR_LEN];
    CU_ASSERT_EQUAL_FATAL(model_config_by_name("opt-1.3b", &cfg, err), 0);
    static const double caps[][2] = {{1.5, 1}, {2, 0.5}, {1, 1}};
    for (int i = 0; i < 3; i++) {
        fg_policy base = base_policy(caps[i][0] * 1024 * MiB, caps[i][1] * 1024 * MiB, 100.0 * 1024 * MiB, 0);
        fg_search_request req = {.s = 16, .n = 4, .check = fg_runtime_check, .max_block = 32};
        fg_search_result r;
        int rc = fg_policy_search(&cfg, &HW, &base, &req, &r, err);
        CU_ASSERT_EQUAL(rc, 0);
        if (rc) { fprintf(stderr, "\n    gpu %g GiB, cpu %g GiB: %s\n", caps[i][0], caps[i][1], err); continue; }
        CU_ASSERT_EQUAL(plan_check(&cfg, &r.policy, 16, 4, NULL, err), 0);
    }
}

/* opt-125m, whose embedding (77 MB) is five decoder layers, with the gpu tier a little short of
 * all the weights and the cpu tier short of them all too: only a placement with most weights on
 * the gpu tier fits, where staging holds part of a decoder layer. The search finds one (it said
 * "no policy fits" while it charged two arenas of the embedding), and it passes the plan check. */
static void test_search_mostly_on_gpu(void) {
    model_config cfg;
    char err[FG_ERR_LEN] = "";
    CU_ASSERT_EQUAL_FATAL(model_config_by_name("opt-125m", &cfg, err), 0);
    fg_policy base = base_policy(200 * MiB, 150 * MiB, 0, 0);
    fg_search_request req = {.s = 32, .n = 8, .check = fg_runtime_check};
    fg_search_result r;
    int rc = fg_policy_search(&cfg, &HW, &base, &req, &r, err);
    EXPECT(rc == 0, "gpu 200 MiB, cpu 150 MiB: expected a policy, got: %s", err);
    if (rc) return;
    CU_ASSERT_EQUAL(plan_check(&cfg, &r.policy, 32, 8, NULL, err), 0);
    EXPECT(r.policy.percent.wg >= 50, "expected most weights on the gpu tier, got --percent %d %d", r.policy.percent.wg,
           r.policy.percent.wc);
}

static void test_latency_bound(void) {
    char err[FG_ERR_LEN];
    fg_policy base = base_policy(16 * MiB, 8 * MiB, 1024 * MiB, 0);
    fg_search_request req = {.s = 32, .n = 8, .check = fg_runtime_check};
    fg_search_result free_run, bounded;
    CU_ASSERT_EQUAL_FATAL(fg_policy_search(&CFG, &HW, &base, &req, &free_run, err), 0);
    req.max_latency = free_run.block_latency / 4;
    CU_ASSERT_EQUAL_FATAL(fg_policy_search(&CFG, &HW, &base, &req, &bounded, err), 0);
    CU_ASSERT(bounded.block_latency <= req.max_latency);
    CU_ASSERT(bounded.throughput <= free_run.throughput);
    req.max_latency = 1e-9;
    CU_ASSERT_EQUAL(fg_policy_search(&CFG, &HW, &base, &req, &bounded, err), -1);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "--max-latency"));
}

/* What a policy search chooses: the block shape, placement, schedule and attention's device. */
static void policy_text(const fg_policy *p, char out[256]) {
    const fg_percent *c = &p->percent;
    snprintf(out, 256, "%d x %d, %d %d %d %d %d %d, schedule %d, cpu-cache-compute %d", p->gpu_batch_size,
             p->num_gpu_batches, c->wg, c->wc, c->cg, c->cc, c->hg, c->hc, (int)p->schedule, p->cpu_cache_compute);
}

/* A bound no block comes near (1e9 s, the most --max-latency takes) chooses what no bound does:
 * its row in the LP, with a right-hand side 1e9 times the others', changes no other row's. */
static void test_far_latency_bound(void) {
    char err[FG_ERR_LEN];
    for (int b = 0; b < N_BUDGETS; b++)
        for (int shape = 0; shape < 3; shape++) {
            fg_policy base = base_policy(BUDGETS[b].gpu, BUDGETS[b].cpu, BUDGETS[b].disk, 0);
            static const int s[] = {16, 64, 32}, n[] = {32, 8, 1};
            fg_search_request req = {.s = s[shape], .n = n[shape], .check = fg_runtime_check};
            fg_search_result free_run, far;
            CU_ASSERT_EQUAL_FATAL(fg_policy_search(&CFG, &HW, &base, &req, &free_run, err), 0);
            req.max_latency = 1e9;
            CU_ASSERT_EQUAL_FATAL(fg_policy_search(&CFG, &HW, &base, &req, &far, err), 0);
            char with[256], without[256];
            policy_text(&far.policy, with);
            policy_text(&free_run.policy, without);
            EXPECT(strcmp(with, without) == 0, "budget %d, prompt %d, gen %d: --max-latency 1e9 chose %s, no bound "
                   "%s", b, s[shape], n[shape], with, without);
        }
}

static void test_nothing_fits(void) {
    char err[FG_ERR_LEN] = "";
    fg_search_request req = {.s = 32, .n = 8, .check = fg_runtime_check};
    fg_search_result r;
    /* the weights alone are 8.7 MiB of fp16: a 2 MiB disk cannot hold them */
    fg_policy base = base_policy(1 * MiB, 1 * MiB, 2 * MiB, 0);
    CU_ASSERT_EQUAL(fg_policy_search(&CFG, &HW, &base, &req, &r, err), -1);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "no policy fits"));
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "tier"));
    CU_ASSERT_PTR_NULL(strchr(err, '\n'));
    /* planning for another machine needs its capacities */
    fg_hardware gpu = HW;
    gpu.gpu_is_host = 0;
    req.check = NULL;
    base.capacity[TIER_DISK] = 0;
    CU_ASSERT_EQUAL(fg_policy_search(&CFG, &gpu, &base, &req, &r, err), -1);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "--disk-mem"));
}

/* For another machine (a GPU: fp16 weights on the gpu tier, no shared host memory, the device's
 * reserve and the pinned copy buffers) the memory model stands in for the plan check, at the placement the runtime would
 * realize there: the choice fits it. */
static void test_search_for_gpu(void) {
    char err[FG_ERR_LEN];
    fg_hardware gpu = HW;
    gpu.gpu_is_host = 0;
    fg_policy base = base_policy(16 * MiB + FG_CUDA_RESERVE, 32 * MiB + FG_CUDA_HOST_RESERVE, 1024 * MiB, 0);
    fg_search_request req = {.s = 32, .n = 8, .place = fg_runtime_check};
    fg_search_result r;
    CU_ASSERT_EQUAL_FATAL(fg_policy_search(&CFG, &gpu, &base, &req, &r, err), 0);
    fg_memory_model mm;
    fg_memory_model_build(&CFG, &r.workload, &gpu, fg_weights_case(&CFG, r.x), &mm);
    for (int t = 0; t < N_TIERS; t++) CU_ASSERT(fg_linear_eval(&mm.tier[t], r.x) <= base.capacity[t]);
    /* without the runtime's placement to ask, the placement is the percentages themselves */
    req.place = NULL;
    CU_ASSERT_EQUAL_FATAL(fg_policy_search(&CFG, &gpu, &base, &req, &r, err), 0);
    const fg_percent *pc = &r.policy.percent;
    const double want[N_X] = {pc->wg / 100.0, pc->wc / 100.0, 1 - pc->wg / 100.0 - pc->wc / 100.0,
                              pc->cg / 100.0, pc->cc / 100.0, 1 - pc->cg / 100.0 - pc->cc / 100.0,
                              pc->hg / 100.0, pc->hc / 100.0, 1 - pc->hg / 100.0 - pc->hc / 100.0};
    for (int k = 0; k < N_X; k++)
        EXPECT(fabs(r.x[k] - want[k]) < 1e-12, "another machine, no placement asked: x[%d] is %g, its "
               "percentages give %g", k, r.x[k], want[k]);
    fg_memory_model_build(&CFG, &r.workload, &gpu, fg_weights_case(&CFG, r.x), &mm);
    for (int t = 0; t < N_TIERS; t++) CU_ASSERT(fg_linear_eval(&mm.tier[t], r.x) <= base.capacity[t]);
}

/* A block shape given (a resumed job keeps its own) is searched whatever its size, also beyond
 * the grid's 4096 sequences a GPU batch and 32 GPU batches. */
static void test_given_shape_beyond_grid(void) {
    static const int shapes[][2] = {{4100, 1}, {1, 40}};
    for (int i = 0; i < 2; i++) {
        char err[FG_ERR_LEN] = "";
        fg_policy base = base_policy(BUDGETS[0].gpu, BUDGETS[0].cpu, BUDGETS[0].disk, 0);
        fg_search_request req = {.s = 8, .n = 2, .check = fg_runtime_check, .gbs = shapes[i][0], .ngb = shapes[i][1]};
        fg_search_result r;
        int rc = fg_policy_search(&CFG, &HW, &base, &req, &r, err);
        EXPECT(rc == 0 && r.policy.gpu_batch_size == shapes[i][0] && r.policy.num_gpu_batches == shapes[i][1],
               "the block %d x %d given: expected it searched and kept, got %d (%d x %d) %s", shapes[i][0],
               shapes[i][1], rc, r.policy.gpu_batch_size, r.policy.num_gpu_batches, err);
    }
}

/* Everything on the gpu tier, a GPU batch of 16 given: every number of GPU batches costs the same
 * per token (the block's work grows with it), and the search takes the smallest block of equal
 * cost, whose latency and memory are least. */
static void test_equal_cost_smaller_block(void) {
    char err[FG_ERR_LEN];
    fg_policy base = base_policy(BUDGETS[0].gpu, BUDGETS[0].cpu, BUDGETS[0].disk, 0);
    fg_search_request req = {.s = 32, .n = 8, .check = fg_runtime_check, .max_block = 256, .gbs = 16};
    fg_search_result r, two;
    CU_ASSERT_EQUAL_FATAL(fg_policy_search(&CFG, &HW, &base, &req, &r, err), 0);
    fg_policy p = r.policy;
    p.num_gpu_batches = 2;
    CU_ASSERT_EQUAL_FATAL(fg_policy_evaluate(&CFG, &HW, &p, &req, &two, err), 0);
    EXPECT(fabs(two.throughput - r.throughput) <= 1e-6 * r.throughput, "16 x 2 against 16 x 1, all on the "
           "gpu tier: expected equal costs, got %.9g and %.9g token/s", two.throughput, r.throughput);
    EXPECT(r.policy.num_gpu_batches == 1, "equal costs from 16 x 1 to 16 x 16: expected the smallest block, "
           "16 x 1, got 16 x %d", r.policy.num_gpu_batches);
}

/* The choice between the schedules (Appendix A.2), on a GPU machine that must offload the
 * weights (a 12-layer model of hidden size 1024, 290 MiB of fp16, in 192 MiB of GPU memory): with
 * 2048 prompts and n >> s the diagonal's block, larger in the same memory, loads the weights for
 * more tokens, and it wins; at FlexGen's benchmark shape (s = 512, n = 32: a staggered block
 * holds little less), or with one block of prompts (its warm-up doubles the steps), zig-zag
 * wins. Each schedule's best is reported, and the choice fits the memory model. */
static void test_schedule_choice(void) {
    static const model_config LONG = OPT_SHAPE("schedule-test", 12, 1024, 16, 4096, 1000, 1024, 1024, 1);
    static const struct { int s, n, prompts; fg_schedule wins; } cases[] = {
        {16, 256, 2048, FG_SCHEDULE_DIAGONAL}, {512, 32, 2048, FG_SCHEDULE_ZIGZAG}, {16, 256, 0, FG_SCHEDULE_ZIGZAG},
    };
    fg_hardware gpu = HW;
    gpu.gpu_is_host = 0, gpu.mm_flops_p = gpu.mm_flops_g = gpu.bmm_flops_p = gpu.bmm_flops_g = 1e12, gpu.mem_bdw = 1e12;
    fg_policy base = base_policy(192 * MiB + FG_CUDA_RESERVE, 512 * MiB + FG_CUDA_HOST_RESERVE, 4096 * MiB, 0);
    char err[FG_ERR_LEN];
    /* the plans are checked on this process's backend, whose workspace holds a scratch a thread:
       the cases are sized for 2 threads, whatever this machine has (32 would take a fifth of the
       192 MiB at s = 512) */
    int threads = omp_get_max_threads();
    omp_set_num_threads(2);
    for (int i = 0; i < 3; i++) {
        fg_search_request req = {.s = cases[i].s, .n = cases[i].n, .place = fg_runtime_check,
                                 .max_block = cases[i].prompts, .schedules = 3};
        fg_search_result r;
        int rc = fg_policy_search(&LONG, &gpu, &base, &req, &r, err);
        CU_ASSERT_EQUAL(rc, 0);
        if (rc) { fprintf(stderr, "\n    case %d: %s\n", i, err); continue; }
        CU_ASSERT(r.best[0].found && r.best[1].found);
        double won = r.best[cases[i].wins].throughput, lost = r.best[!cases[i].wins].throughput;
        EXPECT(r.policy.schedule == cases[i].wins && won > 1.1 * lost && r.throughput == won,
               "s %d, n %d, %d prompts: expected %s to win by 10%%, got zigzag %.4g token/s (%d x %d), diagonal "
               "%.4g (%d x %d), chose %s", cases[i].s, cases[i].n, cases[i].prompts,
               fg_schedule_names[cases[i].wins], r.best[0].throughput, r.best[0].policy.gpu_batch_size,
               r.best[0].policy.num_gpu_batches, r.best[1].throughput, r.best[1].policy.gpu_batch_size,
               r.best[1].policy.num_gpu_batches, fg_schedule_names[r.policy.schedule]);
        CU_ASSERT_EQUAL(r.workload.schedule, r.policy.schedule);
        fg_memory_model mm;
        fg_memory_model_build(&LONG, &r.workload, &gpu, fg_weights_case(&LONG, r.x), &mm);
        for (int t = 0; t < N_TIERS; t++) CU_ASSERT(fg_linear_eval(&mm.tier[t], r.x) <= base.capacity[t]);
    }
    /* one schedule asked for: only it is searched */
    fg_search_request one = {.s = 16, .n = 256, .place = fg_runtime_check, .max_block = 2048,
                             .schedules = 1 << FG_SCHEDULE_ZIGZAG};
    fg_search_result r;
    int rc = fg_policy_search(&LONG, &gpu, &base, &one, &r, err);
    omp_set_num_threads(threads);
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    CU_ASSERT(r.policy.schedule == FG_SCHEDULE_ZIGZAG && r.best[0].found && !r.best[1].found);
}

/* The LP's fractions become whole percentages, each the nearest (halves away from zero), the cpu
 * tier's cut so that gpu + cpu never passes 100: 0.505 and 0.495 round to 51 and 50, and the cpu
 * tier gets 49. Over a grid of pairs (halves of a percent included), the sum stays within 100 and
 * each percentage within one of its fraction. */
static void test_round_pair(void) {
    static const struct { double gpu, cpu; int g, c; } cases[] = {
        {0.505, 0.495, 51, 49}, {0.5, 0.5, 50, 50}, {0.335, 0.665, 34, 66}, {0.004, 0.999, 0, 100},
        {1.2, -0.1, 100, 0}, {0.0049, 0.0051, 0, 1}, {0, 0, 0, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        int g, c;
        fg_round_pair(cases[i].gpu, cases[i].cpu, &g, &c);
        EXPECT(g == cases[i].g && c == cases[i].c, "fractions %g (gpu) and %g (cpu): expected %d%% and %d%%, "
               "got %d%% and %d%%", cases[i].gpu, cases[i].cpu, cases[i].g, cases[i].c, g, c);
    }
    int over = 0, far = 0;
    for (int i = 0; i <= 200; i++)
        for (int j = 0; i + j <= 200; j++) {
            double gpu = i / 200.0, cpu = j / 200.0;
            int g, c;
            fg_round_pair(gpu, cpu, &g, &c);
            over += g + c > 100 || g < 0 || c < 0;
            far += fabs(g - 100 * gpu) > 0.5 + 1e-9 || fabs(c - 100 * cpu) > 1 + 1e-9;
        }
    EXPECT(over == 0 && far == 0, "halves of a percent: %d pairs over 100 or below 0, %d rounded more than "
           "a point away", over, far);
}

void add_policy_tests(void) {
    CU_pSuite s = CU_add_suite("policy", policy_init, policy_clean);
    CU_add_test(s, "a block shape given is searched beyond the grid", test_given_shape_beyond_grid);
    CU_add_test(s, "every policy found passes the runtime's plan check", test_search_passes_plan_check);
    CU_add_test(s, "the search is no worse than a hand grid", test_search_beats_hand_grid);
    CU_add_test(s, "tensors larger than the LP's fractions still give a policy", test_search_tensor_granularity);
    CU_add_test(s, "most weights on the gpu tier: staging of a part of a layer", test_search_mostly_on_gpu);
    CU_add_test(s, "--max-latency bounds the block latency", test_latency_bound);
    CU_add_test(s, "a latency bound no block nears changes no choice", test_far_latency_bound);
    CU_add_test(s, "nothing fits: one line naming the tier", test_nothing_fits);
    CU_add_test(s, "fractions round to percentages whose gpu + cpu is at most 100", test_round_pair);
    CU_add_test(s, "of policies of equal cost, the smaller block", test_equal_cost_smaller_block);
    CU_add_test(s, "planning for a GPU machine fits its memory model", test_search_for_gpu);
    CU_add_test(s, "the search chooses the schedule: each one wins a case", test_schedule_choice);
}
