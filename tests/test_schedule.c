/* test_schedule.c: the diagonal block schedule (Appendix A.2, Fig. 6) against the zig-zag one
 * (§4.2): every prompt computes the same numbers in another order, so the tokens are the same and
 * the logits within the fp32 bound of the other suites; the GPU batches are staggered by steps
 * and prompts stream through one block; each layer's weights load once a step for every batch;
 * the KV cache's pools hold the staggered sequences' peak, less than zig-zag's. */
#define _GNU_SOURCE
#include "flexgen.h"
#include "tests.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { N_PROMPTS = 13, GEN = 6, GBS = 2, NGB = 3 }; /* 13 prompts through blocks of 2 x 3 */

typedef struct {
    int tokens[N_PROMPTS * GEN], finish[N_PROMPTS];
    float *logits;
    int weight_loads, batch_steps; /* "load weights" events; input embeddings computed */
    int rc;
    char err[FG_ERR_LEN];
} result;

static void run(const fixture_prompts *f, fg_policy p, fg_schedule schedule, const gen_options *given, result *r) {
    fg_runtime *rt = NULL;
    fg_model *m = NULL;
    gen_options opt = *given;
    gen_timing t;
    memset(r, 0, sizeof *r);
    opt.finish_step = r->finish;
    p.schedule = schedule, p.trace = 1;
    r->logits = malloc((size_t)N_PROMPTS * GEN * f->cfg.vocab * sizeof(float));
    r->rc = fg_runtime_open(&p, &rt, r->err) || fg_model_open(rt, f->dir, 0, &m, r->err) ||
            generate(m, &opt, f->n, (int *const *)f->prompts, f->lens, r->tokens, r->logits, &t, r->err);
    for (int k = 0; rt && k < N_TRACKS; k++)
        for (size_t i = 0; i < rt->trace.tracks[k].n; i++) {
            r->weight_loads += !strcmp(rt->trace.tracks[k].events[i].name, "load weights");
            r->batch_steps += !strcmp(rt->trace.tracks[k].events[i].name, "input embedding");
        }
    fg_model_close(m);
    fg_stats st;
    if (rt) fg_runtime_stats(rt, &st);
    for (int tier = 0; rt && tier < N_TIERS; tier++) CU_ASSERT_EQUAL(st.current[tier], 0); /* all given back */
    fg_runtime_close(rt);
}

static fg_policy policy(fg_percent percent, int overlap) {
    fg_policy p = fg_default_policy();
    p.gpu_batch_size = GBS, p.num_gpu_batches = NGB, p.percent = percent, p.overlap = overlap;
    return p;
}

/* Diagonal against zig-zag on the same prompts: the same tokens and the same logits, bit for bit,
 * in every placement and mode of the runtime (each schedule pads a GPU batch's prompts to its own
 * longest, so a prompt meets the same rows in both; padded to the block's longest, prefill's sums
 * grouped otherwise, and the integer and bf16 modes chose other tokens). */
static void test_diagonal_matches_zigzag(void) {
    fixture_prompts f;
    fixture_prompts_open("opt-tiny", N_PROMPTS, &f);
    static const struct {
        const char *what;
        fg_percent percent;
    } placements[] = {
        {"everything on the gpu tier", {100, 0, 100, 0, 100, 0}}, {"weights on cpu", {0, 100, 100, 0, 100, 0}},
        {"weights on disk", {0, 0, 100, 0, 100, 0}},              {"KV cache on cpu", {100, 0, 0, 100, 100, 0}},
        {"KV cache on disk", {100, 0, 0, 0, 100, 0}},             {"everything split", {20, 30, 30, 40, 30, 40}},
        {"everything on disk", {0, 0, 0, 0, 0, 0}},
    };
    static const char *const modes[] = {"plain", "overlap 0", "--cpu-cache-compute", "--compress-weight",
                                        "--compress-cache", "--attn-sparsity 0.5", "sampling, seed 5",
                                        "--int8-activations", "--bf16-prefill"};
    size_t n_logits = (size_t)N_PROMPTS * GEN * f.cfg.vocab;
    for (size_t pl = 0; pl < sizeof placements / sizeof *placements; pl++)
        for (size_t mode = 0; mode < sizeof modes / sizeof *modes; mode++) {
            fg_policy p = policy(placements[pl].percent, mode != 1);
            p.cpu_cache_compute = mode == 2, p.compress_weight = mode == 3 || mode == 7, p.compress_cache = mode == 4;
            p.int8_activations = mode == 7, p.bf16_prefill = mode == 8;
            p.attn_sparsity = mode == 5 ? 0.5f : 1;
            gen_options opt = {.gen_len = GEN, .top_p = 1};
            if (mode == 6) opt.temperature = 0.8f, opt.top_p = 0.9f, opt.seed = 5;
            result zigzag, diagonal;
            run(&f, p, FG_SCHEDULE_ZIGZAG, &opt, &zigzag);
            run(&f, p, FG_SCHEDULE_DIAGONAL, &opt, &diagonal);
            float worst = 0;
            for (size_t i = 0; i < n_logits; i++) worst = fmaxf(worst, fabsf(zigzag.logits[i] - diagonal.logits[i]));
            int diff = 0;
            for (int i = 0; i < N_PROMPTS * GEN; i++) diff += zigzag.tokens[i] != diagonal.tokens[i];
            EXPECT(zigzag.rc == 0 && diagonal.rc == 0 && diff == 0 &&
                       memcmp(zigzag.logits, diagonal.logits, n_logits * sizeof(float)) == 0,
                   "%s, %s: diagonal against zigzag: rc %d and %d (%s%s), %d tokens differ, logits by up to %g",
                   placements[pl].what, modes[mode], zigzag.rc, diagonal.rc, zigzag.err, diagonal.err, diff, worst);
            free(zigzag.logits), free(diagonal.logits);
        }
    fixture_prompts_close(&f);
}

/* The order, in steps. GPU batch k of 3 starts at step k GEN / 3 (0, 2, 4) and takes new prompts
 * every GEN steps, the prompts in turn: batch 0 takes prompts 0-1 at step 0 and 6-7 at 6, batch 1
 * 2-3 at 2 and 8-9 at 8, batch 2 4-5 at 4 and 10-11 at 10, batch 0 prompt 12 at 12 (alone). A
 * prompt started at step s ends after step s + GEN. Zig-zag runs blocks of 6 in turn: prompts
 * 0-5 end at GEN, 6-11 at 2 GEN, 12 at 3 GEN. (All prompts given at once, the same block: the
 * diagonal's warm-up makes its later batches wait. Its gain is the larger block that the same
 * memory holds.) Each step loads every layer's weights once (weights
 * on the cpu tier), whatever the number of batches it computes: the diagonal's 24 steps compute
 * 2 + 6 + ... batch steps for 24 x layers loads. */
static void test_diagonal_order(void) {
    fixture_prompts f;
    fixture_prompts_open("opt-tiny", N_PROMPTS, &f);
    static const int starts[N_PROMPTS] = {0, 0, 2, 2, 4, 4, 6, 6, 8, 8, 10, 10, 12};
    gen_options opt = {.gen_len = GEN, .top_p = 1};
    result zigzag, diagonal;
    fg_percent weights_on_cpu = {0, 100, 100, 0, 100, 0};
    run(&f, policy(weights_on_cpu, 1), FG_SCHEDULE_ZIGZAG, &opt, &zigzag);
    run(&f, policy(weights_on_cpu, 1), FG_SCHEDULE_DIAGONAL, &opt, &diagonal);
    CU_ASSERT_EQUAL_FATAL(zigzag.rc, 0);
    CU_ASSERT_EQUAL_FATAL(diagonal.rc, 0);
    int bad = 0;
    for (int p = 0; p < N_PROMPTS; p++)
        bad += diagonal.finish[p] != starts[p] + GEN || zigzag.finish[p] != (p / (GBS * NGB) + 1) * GEN;
    EXPECT(bad == 0, "%d prompts finish after another step than the schedule's (prompt 0: zigzag %d, diagonal %d)",
           bad, zigzag.finish[0], diagonal.finish[0]);
    /* the diagonal's steps: 0 .. 18 (prompt 12 ends after 18); batches computed at each step: 1 at
     * 0-1, 2 at 2-3, 3 from 4 to 11, then 12-17: batches 0 (prompt 12), 1 until 13, 2 until 15 */
    int steps = 18, batch_steps = 2 * 1 + 2 * 2 + 8 * 3 + 2 * 3 + 2 * 2 + 2 * 1;
    int layers = f.cfg.n_layers + 2;
    EXPECT(diagonal.batch_steps == batch_steps && diagonal.weight_loads == steps * layers,
           "diagonal: expected %d batch steps and each of the %d layers' weights loaded once a step (%d), got %d "
           "and %d", batch_steps, layers, steps * layers, diagonal.batch_steps, diagonal.weight_loads);
    free(zigzag.logits), free(diagonal.logits);
    fixture_prompts_close(&f);
}

/* Completion times, in steps (Appendix A.2: "the first bls/n samples finish with latency T/n").
 * Zig-zag's block of 6 completes all at once, every GEN = 6 steps; the diagonal's 3 batches, once
 * the first has completed, complete in turn every GEN / 3 = 2 steps, so from any step on the next
 * completion is at most a third of a block's steps away. (Counted from the start, the warm-up
 * delays the later batches: the mean completion step is the diagonal's 150 / 13 against 126 / 13.) */
static void completion_steps(const result *r, int *widest, int *sum) {
    *widest = *sum = 0;
    for (int step = GEN, last = GEN; step <= 3 * GEN; step++) { /* the widest gap between completions */
        int any = 0;
        for (int p = 0; p < N_PROMPTS; p++) any |= r->finish[p] == step;
        if (any) *widest = step - last > *widest ? step - last : *widest, last = step;
    }
    for (int p = 0; p < N_PROMPTS; p++) *sum += r->finish[p];
}

/* The diagonal run: 0, or 1 and what differs in err. */
static int diagonal_completions(const fixture_prompts *prompts, char *err) {
    gen_options opt = {.gen_len = GEN, .top_p = 1};
    result r;
    int widest, sum;
    run(prompts, policy((fg_percent){100, 0, 100, 0, 100, 0}, 1), FG_SCHEDULE_DIAGONAL, &opt, &r);
    free(r.logits);
    if (r.rc) return snprintf(err, FG_ERR_LEN, "%s", r.err), 1;
    completion_steps(&r, &widest, &sum);
    if (widest == GEN / NGB && sum == 150) return 0;
    snprintf(err, FG_ERR_LEN, "expected a completion every %d steps (finish steps summing to 150), got gaps of "
             "up to %d steps (summing to %d)", GEN / NGB, widest, sum);
    return 1;
}

static void test_diagonal_completions(void) {
    fixture_prompts f;
    fixture_prompts_open("opt-tiny", N_PROMPTS, &f);
    gen_options opt = {.gen_len = GEN, .top_p = 1};
    result zigzag;
    int widest, sum;
    char err[FG_ERR_LEN];
    run(&f, policy((fg_percent){100, 0, 100, 0, 100, 0}, 1), FG_SCHEDULE_ZIGZAG, &opt, &zigzag);
    CU_ASSERT_EQUAL_FATAL(zigzag.rc, 0);
    completion_steps(&zigzag, &widest, &sum);
    free(zigzag.logits);
    EXPECT(widest == GEN && sum == 126, "zig-zag: expected a block completing every %d steps (126 summed), got gaps "
           "of up to %d (%d)", GEN, widest, sum);
    int rc = diagonal_completions(&f, err);
    EXPECT(rc == 0, "diagonal, 13 prompts through 3 GPU batches of 2, %d tokens each: %s", GEN, err);
    fixture_prompts_close(&f);
}

/* The pools, by hand: prompts of 30 tokens, 40 generated, 4 GPU batches of 1 sequence, pages of
 * 16 tokens. Staggered by 10 steps, the batches hold sequences at steps i, i - 10, i - 20 and
 * i - 30 of theirs; at the most, the first in its last step, 30 + 39 = 69 tokens (5 pages), the
 * others 59, 49 and 39 (4, 4 and 3): 16 pages, where zig-zag's four hold 70 each. */
static void test_diagonal_pools(void) {
    row_split all_gpu = {{1, 0, 0}};
    int lens[8] = {30, 30, 30, 30, 30, 30, 30, 30};
    int starts[4];
    for (int k = 0; k < 4; k++) starts[k] = diagonal_start(k, 4, 40);
    kv_pool_size diagonal = kv_pool_shape(&all_gpu, 1, 4, 70, 8, lens, 40, 1, starts);
    kv_pool_size zigzag = kv_pool_shape(&all_gpu, 1, 4, 70, 8, lens, 40, 0, NULL);
    EXPECT(diagonal.page_tokens == 16 && diagonal.pool_pages[TIER_GPU] == 16 && diagonal.pool_pages[TIER_CPU] == 0,
           "diagonal: expected 16 pages of 16 tokens on the gpu tier, got %d of %d (cpu %d)",
           diagonal.pool_pages[TIER_GPU], diagonal.page_tokens, diagonal.pool_pages[TIER_CPU]);
    long zigzag_tokens = (long)zigzag.pool_pages[TIER_GPU] * zigzag.page_tokens;
    EXPECT(zigzag_tokens == 4 * 70, "zigzag: expected room for 4 x 70 tokens, got %ld", zigzag_tokens);
}

/* The measured peak of each tier's cache against the memory model's diagonal formula (lp.c's
 * fg_diagonal_rows): 24 prompts of 8 tokens, 56 generated, through 4 GPU batches of 2 sequences,
 * one on the gpu tier and one on cpu. The pools' most pages in use, as rows, are at least the
 * formula's rows (a page holds whole tokens) and at most a page per sequence more; zig-zag's
 * peak is every sequence at 8 + 56 rows' pages. */
static void test_diagonal_measured_peak(void) {
    enum { PROMPTS = 24, S = 8, N = 56, K = 4 };
    fixture_prompts f;
    fixture_prompts_open("opt-tiny", PROMPTS, &f);
    for (int i = 0; i < PROMPTS; i++) { /* all S long */
        f.prompts[i] = realloc(f.prompts[i], S * sizeof(int));
        for (int j = 0; j < (f.lens[i] = S); j++) f.prompts[i][j] = 3 + (7 * i + 5 * j) % (f.cfg.vocab - 3);
    }
    fg_policy p = policy((fg_percent){100, 0, 50, 50, 100, 0}, 1);
    p.gpu_batch_size = 2, p.num_gpu_batches = K;
    gen_options opt = {.gen_len = N, .top_p = 1};
    int tokens[PROMPTS * N];
    gen_timing t[2];
    for (int diagonal = 0; diagonal < 2; diagonal++) {
        fg_runtime *rt = NULL;
        fg_model *m = NULL;
        char err[FG_ERR_LEN] = "";
        p.schedule = diagonal ? FG_SCHEDULE_DIAGONAL : FG_SCHEDULE_ZIGZAG;
        int rc = fg_runtime_open(&p, &rt, err) || fg_model_open(rt, f.dir, 0, &m, err) ||
                 generate(m, &opt, PROMPTS, (int *const *)f.prompts, f.lens, tokens, NULL, &t[diagonal], err);
        EXPECT(rc == 0, "%s: %s", diagonal ? "diagonal" : "zigzag", err);
        fg_model_close(m);
        fg_runtime_close(rt);
        if (rc) { fixture_prompts_close(&f); return; }
    }
    double rows = fg_diagonal_rows(S, N, K) * K; /* one sequence of each GPU batch on each tier */
    int page = t[1].page_tokens, whole = K * kv_pages_for(S + N, t[0].page_tokens) * t[0].page_tokens;
    for (int tier = TIER_GPU; tier <= TIER_CPU; tier++) {
        double measured = (double)t[1].cache_peak_rows[tier], zigzag = (double)t[0].cache_peak_rows[tier];
        EXPECT(measured >= rows && measured <= rows + K * (page - 1) && zigzag == whole,
               "%s tier: the diagonal's peak %.0f rows, the formula's %.0f (+ up to %d for pages of %d); zig-zag's "
               "%.0f, expected %d", fg_tier_names[tier], measured, rows, K * (page - 1), page, zigzag, whole);
    }
    fixture_prompts_close(&f);
}

/* With --stop-at-eos a batch's sequences can all end before their turn to take new prompts is
 * due: the block waits for it, and the prompts left still run. GPU batches of 1, 2 of them; the
 * fixture's fourth prompt generates </s> at once and goes first, so after step 0 no sequence
 * runs while 4 prompts wait. Each prompt's tokens: zig-zag's. */
static void test_diagonal_all_ended(void) {
    fixture_prompts f;
    fixture_prompts_open("opt-tiny", 5, &f);
    int *first = f.prompts[0], first_len = f.lens[0];
    f.prompts[0] = f.prompts[3], f.lens[0] = f.lens[3], f.prompts[3] = first, f.lens[3] = first_len;
    fg_policy p = fg_default_policy();
    p.gpu_batch_size = 1, p.num_gpu_batches = 2;
    gen_options opt = {.gen_len = GEN, .top_p = 1, .stop_at_eos = 1};
    int tokens[2][5 * GEN];
    for (int diagonal = 0; diagonal < 2; diagonal++) {
        fg_runtime *rt = NULL;
        fg_model *m = NULL;
        char err[FG_ERR_LEN] = "";
        gen_timing t;
        p.schedule = diagonal ? FG_SCHEDULE_DIAGONAL : FG_SCHEDULE_ZIGZAG;
        int rc = fg_runtime_open(&p, &rt, err) || fg_model_open(rt, f.dir, 0, &m, err) ||
                 generate(m, &opt, f.n, (int *const *)f.prompts, f.lens, tokens[diagonal], NULL, &t, err);
        EXPECT(rc == 0, "%s: %s", diagonal ? "diagonal" : "zigzag", err);
        fg_model_close(m);
        fg_runtime_close(rt);
    }
    int diff = 0;
    for (int i = 0; i < 5 * GEN; i++) diff += tokens[0][i] != tokens[1][i];
    EXPECT(tokens[0][0] == OPT_EOS_ID && diff == 0, "--stop-at-eos: the first prompt's first token %d (expected "
           "</s>), %d tokens of the diagonal run differ from zig-zag's", tokens[0][0], diff);
    fixture_prompts_close(&f);
}

/* A batch job appends a group's records as it ends (generate's group_done): 13 prompts through 3
 * GPU batches of 2 end in the order they started, {0, 2}, {2, 2}, ... {12, 1}, each called when its
 * prompts have taken their last tokens and the next group's have not: in the middle of the run. */
typedef struct {
    int n, first[8], count[8], out_of_time;
    const int *finish; /* the run's finish_step */
} groups_seen;

static void group_seen(void *ctx, int first, int count) {
    groups_seen *g = ctx;
    if (g->n < 8) g->first[g->n] = first, g->count[g->n] = count;
    g->n++;
    for (int p = first; p < first + count; p++) g->out_of_time += g->finish[p] == 0;
    g->out_of_time += first + count < N_PROMPTS && g->finish[first + count] != 0;
}

static void test_diagonal_groups_done(void) {
    fixture_prompts f;
    fixture_prompts_open("opt-tiny", N_PROMPTS, &f);
    result r;
    groups_seen g = {.finish = r.finish};
    gen_options opt = {.gen_len = GEN, .top_p = 1, .group_done = group_seen, .group_ctx = &g};
    run(&f, policy((fg_percent){0, 100, 100, 0, 100, 0}, 1), FG_SCHEDULE_DIAGONAL, &opt, &r);
    CU_ASSERT_EQUAL_FATAL(r.rc, 0);
    int bad = g.n != 7 || g.out_of_time;
    for (int i = 0; i < 7 && i < g.n; i++) bad += g.first[i] != 2 * i || g.count[i] != (i < 6 ? 2 : 1);
    EXPECT(!bad, "expected 7 groups ({0, 2} ... {12, 1}) in order, each as it ended; got %d calls, the first {%d, %d}, "
           "%d out of time", g.n, g.first[0], g.count[0], g.out_of_time);
    free(r.logits);
    fixture_prompts_close(&f);
}

/* Bad input: --refill with the diagonal schedule (which refills its GPU batches itself) is
 * refused with one line naming the schedule. */
static void test_diagonal_refusals(void) {
    fixture_prompts f;
    fixture_prompts_open("opt-tiny", 2, &f);
    gen_options opt = {.gen_len = 2, .top_p = 1, .stop_at_eos = 1, .refill = 1};
    fg_policy p = policy((fg_percent){100, 0, 100, 0, 100, 0}, 1);
    p.schedule = FG_SCHEDULE_DIAGONAL;
    fg_runtime *rt = NULL;
    fg_model *m = NULL;
    char err[FG_ERR_LEN] = "";
    int tokens[4];
    gen_timing t;
    int rc = fg_runtime_open(&p, &rt, err) || fg_model_open(rt, f.dir, 0, &m, err) ||
             generate(m, &opt, f.n, (int *const *)f.prompts, f.lens, tokens, NULL, &t, err);
    EXPECT(rc != 0 && strstr(err, "diagonal"), "diagonal with refill: expected a refusal naming the schedule, got "
           "%d: %s", rc, err);
    fg_model_close(m);
    fg_runtime_close(rt);
    fixture_prompts_close(&f);
}

void add_schedule_tests(void) {
    CU_pSuite s = CU_add_suite("schedule", NULL, NULL);
    CU_add_test(s, "diagonal against zigzag: the same tokens and logits, bit for bit, in every placement and mode", test_diagonal_matches_zigzag);
    CU_add_test(s, "diagonal: batches staggered by steps, weights loaded once a step", test_diagonal_order);
    CU_add_test(s, "diagonal: a batch completes every n / K steps, zig-zag's block every n", test_diagonal_completions);
    CU_add_test(s, "diagonal: the KV cache pools hold the staggered peak, by hand", test_diagonal_pools);
    CU_add_test(s, "diagonal: each tier's measured peak is the memory model's", test_diagonal_measured_peak);
    CU_add_test(s, "diagonal: every sequence ended before a batch's turn, the prompts left still run",
                test_diagonal_all_ended);
    CU_add_test(s, "diagonal: a group is handed back as it ends, in the order groups started", test_diagonal_groups_done);
    CU_add_test(s, "diagonal: what it does not run is refused", test_diagonal_refusals);
}
