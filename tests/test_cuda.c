/* test_cuda.c: the GPU suite. The CUDA backend against the CPU backend on
 * the tiny fixtures, over the runtime's placements, with CPU delegation, 4-bit weights and cache
 * (§5) and top-K sparse attention: the same tokens, and logits within a bound for fp16.
 *
 * The bound: the CUDA backend keeps the hidden states and each operation's output in fp16 (the
 * CPU keeps fp32) and, with --compress-weight, rounds each decompressed weight too, a relative
 * error of at most 2^-11 each; a logit passes through a few dozen such roundings on a tiny
 * fixture, and their errors add up to well under 1% of the largest logit. 1e-2 x max|logit| is
 * that with room for the order of the sums, and far below what a wrong kernel gives (O(1)
 * relative).
 *
 * Without a GPU (CI) each test prints why and checks that the CPU fallback is clean instead:
 * --device cuda is refused with the reason, the default device runs on the CPU. */
#define _GNU_SOURCE
#include "flexgen.h"
#include "tests.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { N_SEQ = 5, GEN = 6 };

static int gpu_present(void) {
    static int said;
    char why[FG_ERR_LEN];
    if (fg_cuda_backend(why)) return 1;
    if (!said++) printf("\n  GPU suite skipped: %s\n", why);
    return 0;
}

typedef struct {
    const char *what;
    fg_percent percent;
    int delegate, compress_weight, compress_cache;
    float sparsity;
} gpu_case;

static const gpu_case CASES[] = {
    {"everything on the gpu tier", {100, 0, 100, 0, 100, 0}, 0, 0, 0, 1},
    {"weights on cpu", {0, 100, 100, 0, 100, 0}, 0, 0, 0, 1},
    {"weights 20/30/50 gpu/cpu/disk", {20, 30, 100, 0, 100, 0}, 0, 0, 0, 1},
    {"KV cache split 30/40/30", {100, 0, 30, 40, 100, 0}, 0, 0, 0, 1},
    {"KV cache split, delegated", {100, 0, 30, 40, 100, 0}, 1, 0, 0, 1},
    {"activations split 30/40/30", {100, 0, 100, 0, 30, 40}, 0, 0, 0, 1},
    {"everything on disk", {0, 0, 0, 0, 0, 0}, 0, 0, 0, 1},
    {"everything on disk, delegated", {0, 0, 0, 0, 0, 0}, 1, 0, 0, 1},
    {"4-bit weights on the gpu tier", {100, 0, 100, 0, 100, 0}, 0, 1, 0, 1},
    {"4-bit weights on cpu and disk", {0, 50, 100, 0, 100, 0}, 0, 1, 0, 1},
    {"4-bit cache on the gpu tier", {100, 0, 100, 0, 100, 0}, 0, 0, 1, 1},
    {"4-bit cache split, delegated", {100, 0, 30, 40, 100, 0}, 1, 0, 1, 1},
    {"4-bit weights and cache, split", {30, 30, 30, 40, 50, 20}, 0, 1, 1, 1},
    {"sparse attention, cache on gpu", {100, 0, 100, 0, 100, 0}, 0, 0, 0, 0.5f},
    {"sparse attention, cache on cpu", {100, 0, 0, 100, 100, 0}, 0, 0, 0, 0.5f},
};
enum { N_CASES = sizeof CASES / sizeof CASES[0] };

static fg_policy case_policy(const gpu_case *c, fg_device device) {
    fg_policy p = fg_default_policy();
    p.device = device;
    p.gpu_batch_size = 2;
    p.num_gpu_batches = 3;
    p.percent = c->percent;
    p.cpu_cache_compute = c->delegate;
    p.compress_weight = c->compress_weight;
    p.compress_cache = c->compress_cache;
    p.attn_sparsity = c->sparsity;
    return p;
}

static void compare_backends(const char *fixture_name) {
    if (!gpu_present()) return;
    fixture_prompts f;
    fixture_prompts_open(fixture_name, N_SEQ, &f);
    size_t n_logits = (size_t)N_SEQ * GEN * f.cfg.vocab;
    float *cpu_logits = malloc(n_logits * sizeof(float)), *gpu_logits = malloc(n_logits * sizeof(float));
    CU_ASSERT_FATAL(cpu_logits && gpu_logits);
    for (int i = 0; i < N_CASES; i++) {
        int cpu_tokens[N_SEQ * GEN], gpu_tokens[N_SEQ * GEN];
        fg_stats st;
        char err[FG_ERR_LEN];
        fg_policy p = case_policy(&CASES[i], FG_DEVICE_CPU);
        int rc = generate_with(f.dir, NULL, 0, &p, GEN, f.n, (int *const *)f.prompts, f.lens, cpu_tokens,
                               cpu_logits, NULL, err);
        CU_ASSERT_EQUAL_FATAL(rc, 0);
        p.device = FG_DEVICE_CUDA;
        rc = generate_with(f.dir, NULL, 0, &p, GEN, f.n, (int *const *)f.prompts, f.lens, gpu_tokens,
                           gpu_logits, &st, err);
        CU_ASSERT_EQUAL(rc, 0);
        if (rc) {
            fprintf(stderr, "\n  %s, %s: %s\n", fixture_name, CASES[i].what, err);
            continue;
        }
        float max_abs = 0, worst = 0;
        for (size_t j = 0; j < n_logits; j++) {
            max_abs = fmaxf(max_abs, fabsf(cpu_logits[j]));
            worst = fmaxf(worst, fabsf(cpu_logits[j] - gpu_logits[j]));
        }
        int same = !memcmp(cpu_tokens, gpu_tokens, sizeof cpu_tokens);
        CU_ASSERT(same);
        CU_ASSERT(worst <= 1e-2f * max_abs);
        printf("\n  %s, %s: max |logit difference| %.2e of max |logit| %.2f%s", fixture_name,
               CASES[i].what, worst, max_abs, same ? "" : ", TOKENS DIFFER");
        for (int t = 0; t < N_TIERS; t++) {
            CU_ASSERT(st.peak[t] <= st.capacity[t]);
            CU_ASSERT_EQUAL(st.current[t], 0);
        }
    }
    free(cpu_logits);
    free(gpu_logits);
    fixture_prompts_close(&f);
}

static void test_pre_ln(void) { compare_backends("opt-tiny"); }
static void test_post_ln(void) { compare_backends("opt-tiny-350m"); }

/* Sparse attention on the GPU keeps what the CPU keeps however the prompts (1 to 14 tokens) are
 * grouped into blocks: each grouping's tokens equal the CPU's with all five in one block, and
 * its logits are within the bound above. */
static void test_sparse_grouping(void) {
    if (!gpu_present()) return;
    fixture_prompts f;
    fixture_prompts_open("opt-tiny", N_SEQ, &f);
    size_t n = (size_t)N_SEQ * GEN * f.cfg.vocab;
    float *cpu_logits = malloc(n * sizeof(float)), *gpu_logits = malloc(n * sizeof(float));
    int cpu_tokens[N_SEQ * GEN], gpu_tokens[N_SEQ * GEN];
    char err[FG_ERR_LEN];
    static const int shapes[][2] = {{5, 1}, {1, 1}, {2, 3}, {3, 2}};
    for (int cache_on_cpu = 0; cache_on_cpu < 2; cache_on_cpu++) {
        fg_policy p = case_policy(&CASES[N_CASES - 2 + cache_on_cpu], FG_DEVICE_CPU);
        p.gpu_batch_size = N_SEQ, p.num_gpu_batches = 1;
        CU_ASSERT_EQUAL_FATAL(generate_with(f.dir, NULL, 0, &p, GEN, f.n, (int *const *)f.prompts, f.lens,
                                            cpu_tokens, cpu_logits, NULL, err), 0);
        for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
            p.device = FG_DEVICE_CUDA;
            p.gpu_batch_size = shapes[s][0], p.num_gpu_batches = shapes[s][1];
            int rc = generate_with(f.dir, NULL, 0, &p, GEN, f.n, (int *const *)f.prompts, f.lens, gpu_tokens,
                                   gpu_logits, NULL, err);
            EXPECT(rc == 0, "sparse, blocks of %d x %d: %s", shapes[s][0], shapes[s][1], err);
            if (rc) continue;
            float max_abs = 0, worst = 0;
            for (size_t j = 0; j < n; j++) {
                max_abs = fmaxf(max_abs, fabsf(cpu_logits[j]));
                worst = fmaxf(worst, fabsf(cpu_logits[j] - gpu_logits[j]));
            }
            EXPECT(!memcmp(cpu_tokens, gpu_tokens, sizeof cpu_tokens) && worst <= 1e-2f * max_abs,
                   "sparse, cache on %s, blocks of %d x %d on the GPU against one block on the CPU: "
                   "tokens %s, max |logit difference| %g of %g", cache_on_cpu ? "cpu" : "gpu",
                   shapes[s][0], shapes[s][1],
                   memcmp(cpu_tokens, gpu_tokens, sizeof cpu_tokens) ? "differ" : "agree", worst, max_abs);
        }
    }
    free(cpu_logits);
    free(gpu_logits);
    fixture_prompts_close(&f);
}

/* --gpu-mem caps device memory like any tier: a plan over it is refused before a byte moves,
 * and a run under it stays within it. */
/* --gpu-mem of 4096 bytes is refused, naming the gpu tier; MEM_CAP, the device reserve and 64 MiB,
 * runs, and the runtime's own bytes stay within the 64 MiB. */
#define MEM_CAP (FG_CUDA_RESERVE + (64 << 20))
static void test_gpu_mem_cap(void) {
    if (!gpu_present()) return;
    fixture_prompts f;
    fixture_prompts_open("opt-tiny", N_SEQ, &f);
    int tokens[N_SEQ * GEN];
    char err[FG_ERR_LEN];
    fg_stats st;
    fg_policy p = case_policy(&CASES[0], FG_DEVICE_CUDA);
    p.capacity[TIER_GPU] = 4096;
    CU_ASSERT_NOT_EQUAL(generate_with(f.dir, NULL, 0, &p, GEN, f.n, (int *const *)f.prompts, f.lens,
                                      tokens, NULL, NULL, err), 0);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "gpu tier"));
    p.capacity[TIER_GPU] = MEM_CAP;
    int rc = generate_with(f.dir, NULL, 0, &p, GEN, f.n, (int *const *)f.prompts, f.lens, tokens,
                           NULL, &st, err);
    EXPECT(rc == 0, "--gpu-mem %.0f: expected a run, got: %s", MEM_CAP, err);
    if (rc == 0)
        EXPECT(st.peak[TIER_GPU] > 0 && st.peak[TIER_GPU] <= 64 << 20, "gpu tier peak %.0f bytes: "
               "expected within the 64 MiB beside the reserve", st.peak[TIER_GPU]);
    fixture_prompts_close(&f);
}

/* The plan of test_gpu_mem_cap's two runs, checked on the CPU with the CUDA backend's sizes: the
 * same verdicts, whether or not a GPU is here. */
static void test_gpu_mem_cap_plan(void) {
    fixture_prompts f;
    fixture_prompts_open("opt-tiny", N_SEQ, &f);
    int max_prompt = 0;
    for (int i = 0; i < f.n; i++) max_prompt = f.lens[i] > max_prompt ? f.lens[i] : max_prompt;
    static const double caps[] = {4096, MEM_CAP};
    for (int i = 0; i < 2; i++) {
        fg_policy p = case_policy(&CASES[0], FG_DEVICE_CPU);
        p.capacity[TIER_GPU] = caps[i];
        fg_runtime *rt;
        fg_model *m;
        char err[FG_ERR_LEN] = "";
        CU_ASSERT_EQUAL_FATAL(fg_runtime_open(&p, &rt, err), 0);
        rt->backend = cuda_sized_backend();
        CU_ASSERT_EQUAL_FATAL(fg_model_open(rt, f.dir, 0, &m, err), 0);
        int fits = fg_check_plan(m, f.n, NULL, max_prompt, GEN, err) == 0;
        EXPECT(fits == (i == 1) && (fits || strstr(err, "gpu tier")), "--gpu-mem %.0f with CUDA's "
               "sizes: expected %s, got %s %s", caps[i], i ? "a plan that fits" : "a gpu tier error",
               fits ? "a plan that fits" : "refused:", err);
        fg_model_close(m);
        fg_runtime_close(rt);
    }
    fixture_prompts_close(&f);
}

/* Without a GPU: --device cuda is an error naming the flag and the reason; auto is the CPU. */
static void test_no_gpu_fallback(void) {
    char why[FG_ERR_LEN], err[FG_ERR_LEN] = "";
    if (fg_cuda_backend(why)) return; /* the other tests cover a GPU */
    fg_policy p = fg_default_policy();
    fg_runtime *rt = NULL;
    p.device = FG_DEVICE_CUDA;
    CU_ASSERT_NOT_EQUAL(fg_runtime_open(&p, &rt, err), 0);
    CU_ASSERT_PTR_NULL(rt);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, "--device cuda: "));
    CU_ASSERT_PTR_NOT_NULL(strstr(err, why));
    p.device = FG_DEVICE_AUTO;
    CU_ASSERT_EQUAL_FATAL(fg_runtime_open(&p, &rt, err), 0);
    CU_ASSERT_STRING_EQUAL(fg_runtime_backend(rt)->name, "cpu");
    fg_runtime_close(rt);
}

void add_cuda_tests(void) {
    CU_pSuite s = CU_add_suite("gpu", NULL, NULL);
    CU_add_test(s, "CUDA against CPU, pre-LN fixture, policy matrix", test_pre_ln);
    CU_add_test(s, "CUDA against CPU, post-LN fixture, policy matrix", test_post_ln);
    CU_add_test(s, "sparse attention: the same result however prompts are grouped", test_sparse_grouping);
    CU_add_test(s, "--gpu-mem caps device memory", test_gpu_mem_cap);
    CU_add_test(s, "--gpu-mem's plan with CUDA's sizes, on the CPU", test_gpu_mem_cap_plan);
    CU_add_test(s, "no GPU: --device cuda refused, auto falls back to the CPU", test_no_gpu_fallback);
}
