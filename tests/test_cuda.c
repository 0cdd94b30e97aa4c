/* test_cuda.c: the GPU suite. The CUDA backend against the CPU backend on the tiny fixtures (OPT's
 * and the LLaMA family's), over
 * the runtime's placements, with CPU delegation, 4-bit weights and cache (§5) and top-K sparse
 * attention. It runs natively on a GPU and, on every machine, on the emulated GPU of tests/cuda_emu
 * (build-emu/test_flexgen: the same flexgen.cu, its kernels run thread by thread on the CPU).
 *
 * What is compared. The CPU runs greedy; the CUDA backend is fed the CPU's tokens (teacher
 * forcing), so that every step's logits are comparable however the two round. Each case prints
 * its largest logit difference as a share of the largest |logit|, and holds it to its bound; the
 * CUDA backend's own greedy token (the argmax of its logits) must be the CPU's wherever the CPU's
 * top two logits are further apart than twice the bound (the others are near ties, counted).
 *
 * The fp16 bound. The CUDA backend keeps the hidden states and each operation's output in fp16
 * (the CPU keeps fp32), a relative error of at most 2^-11 each; a logit passes through a few dozen
 * such roundings on a tiny fixture (each linear rounds twice: its GEMM, then its bias), and their
 * errors add up to well under 1% of the largest logit: B16 = 1e-2 x max|logit|, with room for the
 * order of sums, far below what a wrong kernel gives (O(1) relative). Measured here too: the CPU
 * with fp16 activations (--device cpu-fp16) against the CPU gives fp16's own cost on each fixture,
 * which must be under B16.
 *
 * The 4-bit cache bound. A 4-bit level is a step of L = range / 15 of its group: where a K or V
 * value before compression lies within d of a level's edge, a change of d moves its entry by a
 * whole level, where the compression's own rounding moves each entry by up to L/2, spread evenly
 * (a spread of L / sqrt(12)). The two backends' K and V differ by a few fp16 roundings, d < L/24
 * (a few ulps of a group's range, as the fp16 cases' logits differ by ~2 ulps), so at most a
 * share f = 2d/L < 1/12 of the entries moves a level. With the logits linear in small cache
 * errors, a sum of independent entry errors, the two caches' difference moves them by sqrt(f) L
 * against the compression's L / sqrt(12): at most the compression's own effect Q (the CPU with a
 * 4-bit cache against the CPU with an fp16 cache, measured here on each fixture). B4 = B16 + Q.
 * The CPU holds itself to it too (--device cpu-fp16 against cpu, both with a 4-bit cache). The
 * 4-bit kernels' real test is bit for bit: test_kernels.cu holds the cache store to q4_compress
 * and the decompression to q4_decompress.
 *
 * The sparse attention bound. Top-K is a step too: where two weights at the cut are nearer than
 * the backends' rounding (fp16 queries on CUDA, fp32 on the CPU), each may keep a different key,
 * and the output moves by that key's weighted value. Dropping the past's smaller half of weights
 * moves it by more, so the CPU's own sparsity effect S (sparse against dense, measured here)
 * bounds it: BS = B16 + S. test_kernels.cu holds top-K to the CPU's kept set exactly, over ties.
 *
 * Without a GPU (natively) each test prints why and checks that the CPU fallback is clean
 * instead: --device cuda is refused with the reason, the default device runs on the CPU. */
#define _GNU_SOURCE
#include "flexgen.h"
#include "tests.h"

#include <dirent.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#ifdef FLEXGEN_CUDA_EMU
#include "tests/cuda_emu/cuda_emu.h"
#endif

enum { N_SEQ = 5, GEN = 6 };

static int gpu_present(void) {
    static int said;
    char why[FG_ERR_LEN];
    if (fg_cuda_backend(why)) {
#ifdef FLEXGEN_CUDA_EMU
        if (!said++) printf("\n  GPU suite on the emulated GPU (tests/cuda_emu), threads in %s order\n", cuda_emu_order_name());
#endif
        return 1;
    }
    if (!said++) printf("\n  GPU suite skipped: %s\n", why);
    test_skip(why);
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
/* Cases run again with the diagonal schedule (Appendix A.2): all on the gpu tier, a split cache
 * delegated, 4-bit weights and cache split. */
static const int DIAGONAL_CASES[] = {0, 4, 12};
enum { N_RUNS = N_CASES + sizeof DIAGONAL_CASES / sizeof DIAGONAL_CASES[0] };

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

/* One run of the fixture's prompts under p: its tokens and logits ([N_SEQ][GEN][vocab]). With
 * `forced`, those tokens are fed back instead of its own (teacher forcing). */
static int run_fixture(const fixture_prompts *f, const fg_policy *p, const int *forced, int *tokens,
                       float *logits, fg_stats *st, char *err) {
    return generate_forced(f->dir, p, GEN, f->n, f->prompts, f->lens, forced, tokens, logits, st, err);
}

typedef struct {
    float worst, max_abs;   /* the largest |difference| and |reference logit| */
    int steps, near_ties, wrong_tokens;
} comparison;

/* logits against the reference's, step by step; a step's argmax must be the reference's token
 * where the reference's top two are more than 2 bound x max|logit| apart. */
static comparison compare_logits(const float *ref, const float *logits, int vocab, float bound) {
    comparison c = {0, 0, N_SEQ * GEN, 0, 0};
    size_t n = (size_t)N_SEQ * GEN * vocab;
    for (size_t j = 0; j < n; j++) {
        c.max_abs = fmaxf(c.max_abs, fabsf(ref[j]));
        c.worst = fmaxf(c.worst, logit_gap(ref[j], logits[j]));
    }
    for (int s = 0; s < c.steps; s++) {
        const float *r = ref + (size_t)s * vocab, *l = logits + (size_t)s * vocab;
        int top = 0, second = -1, mine = 0;
        for (int v = 1; v < vocab; v++) {
            if (r[v] > r[top]) second = top, top = v;
            else if (second < 0 || r[v] > r[second]) second = v;
            if (l[v] > l[mine]) mine = v;
        }
        if (r[top] - r[second] <= 2 * bound * c.max_abs) c.near_ties++;
        else c.wrong_tokens += mine != top;
    }
    return c;
}

/* The CPU under p (fp32, or fp16 activations), greedy, and the device under p fed its tokens. */
typedef struct {
    const fixture_prompts *f;
    float *ref_logits, *logits;
    int ref_tokens[N_SEQ * GEN], tokens[N_SEQ * GEN];
} backend_pair;

static int run_pair(backend_pair *r, fg_policy p, fg_device ref, fg_device device, fg_stats *st, char *err) {
    p.device = ref;
    if (run_fixture(r->f, &p, NULL, r->ref_tokens, r->ref_logits, NULL, err)) return -1;
    p.device = device;
    return run_fixture(r->f, &p, r->ref_tokens, r->tokens, r->logits, st, err);
}

/* The bounds of a fixture (shares of max|logit|), measured as the header says: fp16's own cost and
 * the 4-bit cache's own effect Q on the CPU. */
typedef struct { float b16, b4, bs, fp16_cost, fp16_cost_q4, q, sparsity; } fixture_bounds;

static fixture_bounds measure_bounds(backend_pair *r, const char *name) {
    fixture_bounds b = {1e-2f, 0, 0, 0, 0, 0, 0};
    char err[FG_ERR_LEN];
    fg_policy p = case_policy(&CASES[0], FG_DEVICE_CPU);
    CU_ASSERT_EQUAL_FATAL(run_pair(r, p, FG_DEVICE_CPU, FG_DEVICE_CPU_FP16, NULL, err), 0);
    comparison c = compare_logits(r->ref_logits, r->logits, r->f->cfg.vocab, b.b16);
    b.fp16_cost = c.worst / c.max_abs;
    p.compress_cache = 1; /* the 4-bit cache against the fp16 one, on the CPU's own tokens */
    CU_ASSERT_EQUAL_FATAL(run_fixture(r->f, &p, r->ref_tokens, r->tokens, r->logits, NULL, err), 0);
    c = compare_logits(r->ref_logits, r->logits, r->f->cfg.vocab, b.b16);
    b.q = c.worst / c.max_abs;
    b.b4 = b.b16 + b.q;
    CU_ASSERT_EQUAL_FATAL(run_pair(r, p, FG_DEVICE_CPU, FG_DEVICE_CPU_FP16, NULL, err), 0);
    c = compare_logits(r->ref_logits, r->logits, r->f->cfg.vocab, b.b4);
    b.fp16_cost_q4 = c.worst / c.max_abs;
    p.compress_cache = 0; /* sparse attention against dense, on the dense run's tokens */
    CU_ASSERT_EQUAL_FATAL(run_fixture(r->f, &p, NULL, r->ref_tokens, r->ref_logits, NULL, err), 0);
    p.attn_sparsity = 0.5f;
    CU_ASSERT_EQUAL_FATAL(run_fixture(r->f, &p, r->ref_tokens, r->tokens, r->logits, NULL, err), 0);
    c = compare_logits(r->ref_logits, r->logits, r->f->cfg.vocab, b.b16);
    b.sparsity = c.worst / c.max_abs;
    b.bs = b.b16 + b.sparsity;
    EXPECT(b.fp16_cost <= b.b16 && b.fp16_cost_q4 <= b.b4, "%s: the CPU against itself with fp16 activations: "
           "%.2e (fp16 cache), %.2e (4-bit cache) of max|logit|; bounds %.2e, %.2e", name, b.fp16_cost,
           b.fp16_cost_q4, b.b16, b.b4);
    printf("\n  %s: bounds B16 %.1e, B4 %.2e (the 4-bit cache's own effect Q %.2e), BS %.2e (sparsity's "
           "own S %.2e); cpu-fp16 against cpu %.2e, with a 4-bit cache %.2e", name, b.b16, b.b4, b.q, b.bs,
           b.sparsity, b.fp16_cost, b.fp16_cost_q4);
    return b;
}

/* Every `every`-th case of the matrix on a fixture, from `first`; under the sanitizers
 * (SANITIZERS_ONE_DIAGONAL, tests.h) every other one of those: the OPT fixtures pre-LN and post-LN
 * take turns, so each case still runs on OPT, and the LLaMA fixture runs half. */
static void compare_backends_every(const char *fixture_name, int first, int every) {
    if (!gpu_present()) return;
    fixture_prompts f;
    fixture_prompts_open(fixture_name, N_SEQ, &f);
    size_t n_logits = (size_t)N_SEQ * GEN * f.cfg.vocab;
    backend_pair r = {&f, malloc(n_logits * sizeof(float)), malloc(n_logits * sizeof(float)), {0}, {0}};
    CU_ASSERT_FATAL(r.ref_logits && r.logits);
    fixture_bounds b = measure_bounds(&r, fixture_name);
    float worst_share[3] = {0, 0, 0}; /* fp16 cache, 4-bit cache, sparse attention */
    for (int i = 0; i < N_RUNS; i++) {
        if (i % (SANITIZERS_ONE_DIAGONAL ? 2 * every : every) != first) continue;
        fg_stats st;
        char err[FG_ERR_LEN], what[160];
        const gpu_case *k = &CASES[i < N_CASES ? i : DIAGONAL_CASES[i - N_CASES]];
        snprintf(what, sizeof what, "%s%s", i < N_CASES ? "" : "diagonal schedule, ", k->what);
        fg_policy p = case_policy(k, FG_DEVICE_CPU);
        p.schedule = i < N_CASES ? FG_SCHEDULE_ZIGZAG : FG_SCHEDULE_DIAGONAL;
        int rc = run_pair(&r, p, FG_DEVICE_CPU, FG_DEVICE_CUDA, &st, err);
        EXPECT(rc == 0, "%s, %s: %s", fixture_name, what, err);
        if (rc) continue;
        float bound = k->compress_cache ? b.b4 : k->sparsity < 1 ? b.bs : b.b16;
        comparison c = compare_logits(r.ref_logits, r.logits, f.cfg.vocab, bound);
        float share = c.worst / c.max_abs;
        int kind = k->compress_cache ? 1 : k->sparsity < 1 ? 2 : 0;
        worst_share[kind] = fmaxf(worst_share[kind], share);
        EXPECT(share <= bound && c.wrong_tokens == 0, "%s, %s: logits differ by %.2e of max|logit| (bound %.2e); "
               "%d of %d tokens differ away from a near tie", fixture_name, what, share, bound,
               c.wrong_tokens, c.steps - c.near_ties);
        printf("\n  %s, %s: %.2e of max|logit| %.2f (bound %.2e); tokens %d/%d%s", fixture_name, what,
               share, c.max_abs, bound, c.steps - c.near_ties - c.wrong_tokens, c.steps - c.near_ties,
               c.near_ties ? ", near ties skipped" : "");
        if (c.near_ties) printf(" %d", c.near_ties);
        for (int t = 0; t < N_TIERS; t++) {
            CU_ASSERT(st.peak[t] <= st.capacity[t]);
            CU_ASSERT_EQUAL(st.current[t], 0);
        }
    }
    printf("\n  %s: worst share, fp16 cache %.2e, 4-bit cache %.2e, sparse attention %.2e", fixture_name,
           worst_share[0], worst_share[1], worst_share[2]);
#ifdef FLEXGEN_CUDA_EMU
    cuda_emu_stats emu;
    cuda_emu_get_stats(&emu);
    printf("\n  emulated so far: %lld kernels (%lld blocks, %lld threads, %lld switches), %lld GEMMs, %lld copies, "
           "%lld host waits, %lld allocations opened", emu.kernels, emu.blocks, emu.threads, emu.switches, emu.gemms,
           emu.copies, emu.host_waits, emu.opened);
#endif
    free(r.ref_logits);
    free(r.logits);
    fixture_prompts_close(&f);
}

static void compare_backends(const char *fixture_name, int first) {
    compare_backends_every(fixture_name, SANITIZERS_ONE_DIAGONAL ? first : 0, 1);
}

static void test_pre_ln(void) { compare_backends("opt-tiny", 0); }
static void test_post_ln(void) { compare_backends("opt-tiny-350m", 1); }
/* 20 layers, words (72) wider than the hidden states (40): project_in and project_out on the GPU;
 * every sixth case (all on the gpu tier, all on disk, 4-bit weights and cache split). */
static void test_deep(void) { compare_backends_every("opt-deep", 0, 6); }
/* The LLaMA family: LLaMA with one K/V head for 8 query heads of 24 and every bias, Mistral's
 * 16 heads on 2 K/V heads, Qwen2's q, k, v biases (bf16 checkpoint). */
static void test_llama(void) { compare_backends("llama-tiny-mqa-bias", 0); }
#ifndef __SANITIZE_ADDRESS__ /* make test-san: the LLaMA family's paths once, on the LLaMA fixture */
static void test_mistral(void) { compare_backends("mistral-tiny-gqa8", 0); }
static void test_qwen2(void) { compare_backends("qwen2-tiny", 0); }
/* RoPE's scaling on CUDA, LLaMA 3's (factor 8 over 32 original positions, theta 5e5) and linear
 * (factor 2): the default frequencies in their place move the logits by 0.46 and 0.49 of
 * max|logit| on these fixtures, against a bound of 1e-2. */
static void test_llama3_rope(void) { compare_backends("llama-tiny-gqa2-llama3", 0); }
static void test_linear_rope(void) { compare_backends("llama-tiny-gqa4-linear", 0); }
#endif

/* Sparse attention on the GPU keeps what the CPU keeps however the prompts (1 to 14 tokens) are
 * grouped into blocks: each grouping's tokens equal the CPU's with all five in one block, and
 * its logits are within the bound above. */
static void test_sparse_grouping(void) {
    if (!gpu_present()) return;
    fixture_prompts f;
    fixture_prompts_open("opt-tiny", N_SEQ, &f);
    size_t n = (size_t)N_SEQ * GEN * f.cfg.vocab;
    backend_pair r = {&f, malloc(n * sizeof(float)), malloc(n * sizeof(float)), {0}, {0}};
    CU_ASSERT_FATAL(r.ref_logits && r.logits);
    float bound = measure_bounds(&r, "opt-tiny").bs;
    char err[FG_ERR_LEN];
    static const int shapes[][2] = {{5, 1}, {1, 1}, {2, 3}, {3, 2}};
    for (int cache_on_cpu = 0; cache_on_cpu < 2; cache_on_cpu++) {
        fg_policy p = case_policy(&CASES[N_CASES - 2 + cache_on_cpu], FG_DEVICE_CPU);
        p.gpu_batch_size = N_SEQ, p.num_gpu_batches = 1;
        CU_ASSERT_EQUAL_FATAL(run_fixture(&f, &p, NULL, r.ref_tokens, r.ref_logits, NULL, err), 0);
        for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
            p.device = FG_DEVICE_CUDA;
            p.gpu_batch_size = shapes[s][0], p.num_gpu_batches = shapes[s][1];
            int rc = run_fixture(&f, &p, r.ref_tokens, r.tokens, r.logits, NULL, err);
            EXPECT(rc == 0, "sparse, blocks of %d x %d: %s", shapes[s][0], shapes[s][1], err);
            if (rc) continue;
            comparison c = compare_logits(r.ref_logits, r.logits, f.cfg.vocab, bound);
            EXPECT(c.worst <= bound * c.max_abs && c.wrong_tokens == 0, "sparse, cache on %s, blocks of %d x %d "
                   "on the GPU against one block on the CPU: %.2e of max|logit| (bound %.2e), %d tokens differ "
                   "away from a near tie", cache_on_cpu ? "cpu" : "gpu", shapes[s][0], shapes[s][1],
                   c.worst / c.max_abs, bound, c.wrong_tokens);
        }
    }
    free(r.ref_logits);
    free(r.logits);
    fixture_prompts_close(&f);
}

/* One greedy run of the fixture's prompts under p, with the device's counts and the runtime's link
 * bytes. */
static int run_counted(const fixture_prompts *f, const fg_policy *p, int *tokens, float *logits, gen_timing *t,
                       fg_stats *st, char *err) {
    fg_runtime *rt = NULL;
    fg_model *m = NULL;
    gen_options opt = {.gen_len = GEN, .top_p = 1};
    int rc = fg_runtime_open(p, &rt, err);
    if (rc == 0) rc = fg_model_open(rt, f->dir, 0, &m, err);
    if (rc == 0) rc = generate(m, &opt, f->n, f->prompts, f->lens, tokens, logits, t, err);
    if (rc == 0) fg_runtime_stats(rt, st);
    fg_model_close(m);
    fg_runtime_close(rt);
    return rc;
}

/* §5's kept V rows read where they lie: with the cache on the cpu tier, sparse attention on the GPU
 * reads V from the tier's pinned pool, so its logits are the bits of the cache on the gpu tier,
 * and of V only the kept rows cross the link. The runtime counts the past's K rows and the kept V
 * rows (each query head's floor(s past) + 1, a sequence, layer and decode step); dense, all of K
 * and V. The device's copies in are the gpu tier run's and K's rows, where dense they are V's
 * rows more. One GPU batch, so that a layer's cache table serves the next: staged K rows and V
 * rows in place lie different distances on. */
static void test_sparse_v_in_place(void) {
    if (!gpu_present()) return;
    fixture_prompts f;
    fixture_prompts_open("opt-tiny", N_SEQ, &f);
    size_t n = (size_t)N_SEQ * GEN * f.cfg.vocab;
    float *logits[3] = {malloc(n * sizeof(float)), malloc(n * sizeof(float)), malloc(n * sizeof(float))};
    CU_ASSERT_FATAL(logits[0] && logits[1] && logits[2]);
    int tokens[3][N_SEQ * GEN];
    gen_timing t[3];
    fg_stats st[3];
    static const char *const what[] = {"sparse, cache on gpu", "sparse, cache on cpu", "dense, cache on cpu"};
    char err[FG_ERR_LEN];
    for (int r = 0; r < 3; r++) {
        fg_policy p = case_policy(&CASES[N_CASES - 2 + (r > 0)], FG_DEVICE_CUDA);
        p.gpu_batch_size = N_SEQ, p.num_gpu_batches = 1; /* a layer's cache table serves the next, shifted */
        if (r == 2) p.attn_sparsity = 1;
        int rc = run_counted(&f, &p, tokens[r], logits[r], &t[r], &st[r], err);
        CU_ASSERT_EQUAL_FATAL(rc, 0);
        printf("\n  %s: cpu->gpu link %.0f bytes; decode copies in %lld, %lld bytes", what[r],
               st[r].link_bytes[LINK_CPU_TO_GPU], (long long)t[r].decode_counts.copies_in,
               (long long)t[r].decode_counts.bytes_in);
    }
    EXPECT(memcmp(logits[0], logits[1], n * sizeof(float)) == 0, "sparse attention with the cache on the cpu tier "
           "gave other logits than with the cache on the gpu tier");
    double past_rows = 0, kept_rows = 0; /* over decode steps 1 .. GEN - 1, sequences, layers */
    for (int i = 1; i < GEN; i++)
        for (int s = 0; s < f.n; s++) {
            int past = f.lens[s] + i - 1;
            past_rows += (double)past * f.cfg.n_layers;
            kept_rows += (double)f.cfg.n_heads * ((int)floorf(0.5f * (float)past) + 1) * f.cfg.n_layers;
        }
    double k_bytes = past_rows * f.cfg.hidden * sizeof(fp16), kept_bytes = kept_rows * cfg_head_dim(&f.cfg) * sizeof(fp16);
    EXPECT(st[2].link_bytes[LINK_CPU_TO_GPU] == 2 * k_bytes && st[1].link_bytes[LINK_CPU_TO_GPU] == k_bytes + kept_bytes,
           "cpu->gpu link bytes: dense %.0f, sparse %.0f; expected K and V %.0f, then K and the kept V rows %.0f",
           st[2].link_bytes[LINK_CPU_TO_GPU], st[1].link_bytes[LINK_CPU_TO_GPU], 2 * k_bytes, k_bytes + kept_bytes);
    int64_t in[3] = {t[0].decode_counts.bytes_in, t[1].decode_counts.bytes_in, t[2].decode_counts.bytes_in};
    EXPECT(in[1] - in[0] == (int64_t)k_bytes && in[2] - in[1] == (int64_t)k_bytes, "bytes copied to the device in "
           "decode: %lld with the cache on the gpu tier, %lld sparse and %lld dense with it on cpu; expected K's %.0f "
           "bytes more, then V's as many more", (long long)in[0], (long long)in[1], (long long)in[2], k_bytes);
    free(logits[0]), free(logits[1]), free(logits[2]);
    fixture_prompts_close(&f);
}

/* ============================================================================================
 * The host's work on the GPU, counted (docs/GPU.md, "Where the host waits"): a decode step on the gpu tier
 * asks of the device no more than docs/GPU.md derives.
 * ============================================================================================ */

/* The most kernels and cuBLAS products a GPU batch's decode step on the gpu tier launches: per
 * decoder layer (OPT: two layer norms, the qkv bias, the cache store, attention's two (its spans
 * of keys, then their merge), the fc1 and fc2 biases, out's bias fused into the second norm;
 * LLaMA: two RMSNorms, RoPE, the store, attention's two, SwiGLU and a kernel for each bias), the
 * embedding (rows, then positions) and the output (the final norm; lm_head a product). */
typedef struct { int64_t launches, blas_calls; } step_budget;

static step_budget decode_step_budget(const model_config *c) {
    int64_t L = c->n_layers;
    if (c->family == FAMILY_OPT)
        return (step_budget){8 * L + 2 + c->pre_ln, 4 * L + 1 + 2 * (c->word_dim != c->hidden)};
    int64_t per_layer = 7 + 3 * c->qkv_bias + c->o_bias + 3 * c->mlp_bias;
    return (step_budget){per_layer * L + 2, 7 * L + 1};
}

/* Every decode step of the fixture's prompts, all on the gpu tier in blocks of 2 x ngb: the busiest
 * step waits for the host exactly once (for the logits, which the host must read, so a counter
 * that never counts fails too), no copy from pageable memory, no device allocation, the rows'
 * tables uploaded once a step and GPU batch (a token table and a cache table), and the launches
 * of the budget. With 4-bit weights (q4) the products read the codes: no slice widened to fp16,
 * no cuBLAS product, one kernel for each (whose blocks add their chunks' sums; lm_head's too). Each
 * decoder layer's kernels go to the GPU as one CUDA Graph, every step (graphs_on), or each on its
 * own (FLEXGEN_CUDA_GRAPHS=0): the budget holds either way. The CPU counts nothing. */
static void expect_steady_decode(const char *fixture_name, int ngb, int q4, int graphs_on) {
    fixture_prompts f;
    fixture_prompts_open(fixture_name, N_SEQ, &f);
    int tokens[N_SEQ * GEN];
    for (int device = FG_DEVICE_CPU; device <= FG_DEVICE_CUDA; device++) {
        fg_policy p = case_policy(&CASES[0], (fg_device)device);
        p.num_gpu_batches = ngb;
        p.compress_weight = q4;
        gen_timing t;
        fg_stats st;
        char err[FG_ERR_LEN] = "";
        int rc = run_counted(&f, &p, tokens, NULL, &t, &st, err);
        EXPECT(rc == 0, "%s: %s", fixture_name, err);
        if (rc) continue;
        if (device == FG_DEVICE_CPU) {
            EXPECT(!t.device_counted, "%s: the CPU backend counted device work", fixture_name);
            continue;
        }
        const fg_device_counts *most = &t.decode_step_most;
        step_budget budget = decode_step_budget(&f.cfg); /* a GPU batch's */
        budget.launches *= ngb;
        budget.blas_calls *= ngb;
        if (q4) {
            budget.launches += budget.blas_calls;
            budget.blas_calls = 0;
        }
        printf("\n  %s%s, blocks of 2 x %d: a decode step at most: %lld host waits, %lld launches (budget %lld), %lld "
               "cuBLAS products (%lld), %lld widened, %lld copies in, %lld out, %lld on the device, %lld pageable, "
               "%lld allocations", fixture_name, q4 ? " (4-bit)" : "", ngb, (long long)most->host_waits, (long long)most->launches, (long long)budget.launches,
               (long long)most->blas_calls, (long long)budget.blas_calls, (long long)most->widened,
               (long long)most->copies_in,
               (long long)most->copies_out, (long long)most->copies_on_device, (long long)most->pageable_copies,
               (long long)most->allocations);
        CU_ASSERT(t.device_counted && t.decode_steps > 0);
        EXPECT(most->host_waits == 1, "%s, blocks of 2 x %d: a decode step waited %lld times for the GPU; exactly "
               "once, for the logits", fixture_name, ngb, (long long)most->host_waits);
        EXPECT(most->pageable_copies == 0 && most->allocations == 0, "%s, blocks of 2 x %d: a decode step made %lld "
               "copies of pageable memory and %lld device allocations; expected none", fixture_name, ngb,
               (long long)most->pageable_copies, (long long)most->allocations);
        EXPECT(most->copies_in <= 2 * ngb, "%s, blocks of 2 x %d: a decode step made %lld copies to the device; at "
               "most %d (each GPU batch's token table and cache table)", fixture_name, ngb,
               (long long)most->copies_in, 2 * ngb);
        EXPECT(most->launches <= budget.launches && most->blas_calls <= budget.blas_calls, "%s, blocks of 2 x %d: a "
               "decode step launched %lld kernels and %lld cuBLAS products; at most %lld and %lld", fixture_name, ngb,
               (long long)most->launches, (long long)most->blas_calls, (long long)budget.launches,
               (long long)budget.blas_calls);
        EXPECT(most->widened == 0, "%s, blocks of 2 x %d%s: a decode step widened %lld slices of 4-bit weights "
               "to fp16; expected none", fixture_name, ngb, q4 ? ", 4-bit" : "", (long long)most->widened);
        /* a block's last GPU batches may be idle (fewer prompts than slots): whole layers, at most */
        int64_t graphs = graphs_on ? (int64_t)f.cfg.n_layers * ngb : 0, all = t.decode_counts.graph_launches;
        EXPECT(most->graph_launches == graphs && all % f.cfg.n_layers == 0 && (all > 0) == graphs_on,
               "%s, blocks of 2 x %d, graphs %s: expected one graph launch a decoder layer and GPU batch, %lld in "
               "the busiest step, got %lld (%lld in %lld steps)", fixture_name, ngb, graphs_on ? "on" : "off",
               (long long)graphs, (long long)most->graph_launches, (long long)all, (long long)t.decode_steps);
    }
    fixture_prompts_close(&f);
}

static void test_steady_decode(void) {
    if (!gpu_present()) return;
    expect_steady_decode("opt-tiny", 1, 0, 1);
    expect_steady_decode("opt-tiny", 2, 0, 1);
    expect_steady_decode("opt-tiny-350m", 1, 0, 1);
    expect_steady_decode("llama-tiny-mqa-bias", 1, 0, 1);
    expect_steady_decode("opt-tiny", 1, 1, 1);
    expect_steady_decode("opt-tiny-350m", 1, 1, 1);
    expect_steady_decode("llama-tiny-mqa-bias", 1, 1, 1);
    setenv("FLEXGEN_CUDA_GRAPHS", "0", 1); /* each kernel launched on its own: the same budget */
    expect_steady_decode("opt-tiny", 2, 0, 0);
    expect_steady_decode("llama-tiny-mqa-bias", 1, 1, 0);
    unsetenv("FLEXGEN_CUDA_GRAPHS");
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

/* A device smaller than the plan (FLEXGEN_EMU_MEMORY): the plan is refused naming the gpu tier,
 * before a byte moves; with --gpu-mem above the device, the allocation that fails is one line,
 * exit 2, and the offload dir is left empty. */
static void test_device_out_of_memory(void) {
#ifdef FLEXGEN_CUDA_EMU
    char *dir = make_temp_dir(), *out = NULL, *err = NULL;
    const char *argv[] = {"env", "FLEXGEN_EMU_MEMORY=100M", flexgen_bin(), "--model", "models/opt-kjv", "--device", "cuda",
                          "--prompt-len", "4", "--gen-len", "2", "--offload-dir", dir, NULL, NULL, NULL};
    int rc = run_command(argv, NULL, &out, &err);
    EXPECT(rc == 2 && strstr(err, "flexgen: gpu tier: the plan needs"), "a device of 100 MiB: expected the plan "
           "refused naming the gpu tier, exit 2; got %d: %.300s", rc, err);
    free(out), free(err);
    argv[1] = "FLEXGEN_EMU_MEMORY=4M", argv[13] = "--gpu-mem", argv[14] = "2G";
    rc = run_command(argv, NULL, &out, &err);
    EXPECT(rc == 2 && strstr(err, "flexgen: gpu tier: out of memory allocating") && dir_entries(dir) == 0,
           "a device of 4 MiB under --gpu-mem 2G: expected one line, exit 2, no files; got %d, %d files: %.300s",
           rc, dir_entries(dir), err);
    free(out), free(err);
    rm_tree(dir);
    free(dir);
#endif
}

/* scripts/gpu_laptop_run.sh's kjv step on the emulated GPU, opt-kjv and llama-kjv: the same text
 * from cuda and cpu for each, exit 0; a binary that fails is one FAIL line naming it, exit 1; its
 * files go to OUT alone. */
static void test_laptop_run(void) {
#ifdef FLEXGEN_CUDA_EMU
    char *dir = make_temp_dir(), *out = NULL, *err = NULL, flexgen[4200], out_dir[4200];
    snprintf(flexgen, sizeof flexgen, "FLEXGEN=%s", flexgen_bin());
    snprintf(out_dir, sizeof out_dir, "OUT=%s/run", dir);
    const char *argv[] = {"env", flexgen, "STEPS=kjv", "MODELS=opt-kjv llama-kjv", out_dir, "bash",
                          "scripts/gpu_laptop_run.sh", NULL};
    int rc = run_command(argv, NULL, &out, &err);
    const char *second = out ? strstr(out, "identical") : NULL;
    EXPECT(rc == 0 && second && strstr(second + 1, "identical") && strstr(out, "llama-kjv, --device cuda"),
           "gpu_laptop_run.sh on %s: expected exit 0 and identical texts for opt-kjv and llama-kjv, got %d: %.600s "
           "%.300s", flexgen_bin(), rc, out, err);
    free(out), free(err);
    argv[1] = "FLEXGEN=/bin/false";
    rc = run_command(argv, NULL, &out, &err);
    EXPECT(rc == 1 && strstr(out, "FAIL opt-kjv-cuda: /bin/false failed"), "gpu_laptop_run.sh with FLEXGEN=/bin/false: "
           "expected exit 1 and a FAIL line, got %d: %.300s", rc, out);
    free(out), free(err);
    rm_tree(dir);
    free(dir);
#endif
}

/* scripts/gpu_check.sh --dry, the prepared check of a GPU rental run on the emulated GPU: the
 * checks pass (compute-sanitizer skips), the speed and big tables have a row of ours for each run
 * with a decode step's counters, the cost model's prediction of the T4's 4-bit OPT-175B row is
 * the one BENCHMARKS.md gives, and a bad argument is one line and exit 2. Not under the sanitizers:
 * the script runs ./flexgen-emu and build-emu/test_flexgen. */
static void test_gpu_check_dry(void) {
#if defined(FLEXGEN_CUDA_EMU) && !defined(__SANITIZE_ADDRESS__)
    char *dir = make_temp_dir(), *out = NULL, *err = NULL, out_dir[4200];
    snprintf(out_dir, sizeof out_dir, "OUT=%s/check", dir);
    const char *argv[] = {"env", out_dir, "bash", "scripts/gpu_check.sh", "--dry", NULL};
    int rc = run_command(argv, NULL, &out, &err);
    EXPECT(rc == 0, "gpu_check.sh --dry: exit %d: %.600s %.300s", rc, out, err);
    char *md = slurp(join(dir, "check/gpu-check.md"), NULL);
    CU_ASSERT_FATAL(md != NULL);
    static const char *const want[] = {"| check | build | pass |", "| check | suites | pass |", "| check | kjv | pass |",
                                       "| check | sanitizer | skip |", "| speed | table | pass |", "| big | table | pass |",
                                       "| opt-1.3b-4x1 |", "| opt-1.3b-4x1-no-graphs |", "| opt-1.3b-32x1 |",
                                       "| opt-6.7b-4x1 | 4 x 1, 100 0 100 0 100 0, gen 4 | this",
                                       "| opt-6.7b-4bit | 4 x 1, 100 0 100 0 100 0 --compress-weight, gen 4 | this",
                                       "| opt-13b-offloaded |", "| llama-2-7b-4bit |", "| opt-175b-4bit-gpu | 32 x 1",
                                       "| opt-175b-4bit-t4 | 8 x 2, 0 100 50 50 100 0", "| opt-13b-diagonal |",
                                       "| opt-6.7b-auto |", "| opt-30b-offloaded |",
                                       "| opt-6.7b-32x1-topk | 4 x 1, 100 0 100 0 100 0 --attn-sparsity 0.1, gen 4 |",
                                       "| opt-6.7b-4x1-topk | 4 x 1, 100 0 100 0 100 0 --attn-sparsity 0.1, gen 4 |",
                                       "| opt-6.7b-cpu-cache-topk | 4 x 1, 100 0 0 100 100 0 --attn-sparsity 0.1, gen 4 |", "| 1 / ",
                                       "| OPT-175B 4bit | 14 x 8, --percent 0 100 8 92 100 0, 4-bit weights and cache | 1.12 | 2.666 |",
                                       "## One prefill layer's kernels by GPU time (opt-6.7b, 32 x 1"};
    for (size_t i = 0; i < sizeof want / sizeof *want; i++)
        EXPECT(strstr(md, want[i]) != NULL, "gpu_check.sh --dry: no \"%s\" in its markdown:\n%s", want[i], md);
    free(md), free(out), free(err);
    const char *bad[] = {"bash", "scripts/gpu_check.sh", "--fast", NULL};
    rc = run_command(bad, NULL, &out, &err);
    EXPECT(rc == 2 && strstr(err, "gpu_check.sh: unknown argument '--fast'"), "gpu_check.sh --fast: expected exit 2 "
           "and one line, got %d: %s", rc, err);
    free(out), free(err);
    rm_tree(dir);
    free(dir);
#endif
}

#if defined(FLEXGEN_CUDA_EMU) && !defined(__SANITIZE_ADDRESS__)
/* The live processes (not zombies) whose SID (setsid's group of process groups) is sid, or only
 * those whose name is `name`; each killed with SIGKILL if kill_them. */
static int processes_of_sid(pid_t sid, const char *name, int kill_them) {
    DIR *d = opendir("/proc");
    int found = 0;
    for (struct dirent *e; d && (e = readdir(d));) {
        if (e->d_name[0] < '1' || e->d_name[0] > '9') continue;
        char path[300], line[1024] = "", state = 0;
        snprintf(path, sizeof path, "/proc/%s/stat", e->d_name);
        FILE *f = fopen(path, "r");
        size_t n = f ? fread(line, 1, sizeof line - 1, f) : 0;
        if (f) fclose(f);
        line[n] = 0;
        char *open_paren = strchr(line, '('), *close_paren = strrchr(line, ')'); /* the name may hold spaces */
        int ppid, pgrp, their_sid;
        if (!open_paren || !close_paren || sscanf(close_paren + 1, " %c %d %d %d", &state, &ppid, &pgrp, &their_sid) != 4)
            continue;
        *close_paren = 0;
        if (their_sid != sid || state == 'Z' || (name && strcmp(open_paren + 1, name))) continue;
        found++;
        if (kill_them) kill(atoi(e->d_name), SIGKILL);
    }
    if (d) closedir(d);
    return found;
}

static double seconds_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* gpu_check.sh --dry check under setsid (a SID of its own), signalled while its suites step runs the
 * test binary (its log begun, a second into the step): SIGINT to its process group (a terminal's
 * Ctrl-C), SIGTERM to the script alone (kill PID), SIGHUP to the script (its terminal hung up). */
static void interrupt_gpu_check(const char *dir, int sig) {
    const char *tag = sig == SIGINT ? "int" : sig == SIGTERM ? "term" : "hup";
    char out_dir[4200], next_log[4300], err_path[4300], suites_log[4300];
    snprintf(out_dir, sizeof out_dir, "OUT=%s/%s", dir, tag);
    snprintf(next_log, sizeof next_log, "%s/sanitizer.log", out_dir + 4);
    snprintf(suites_log, sizeof suites_log, "%s/suites.log", out_dir + 4);
    snprintf(err_path, sizeof err_path, "%s/%s.err", dir, tag);
    pid_t pid = fork();
    CU_ASSERT_FATAL(pid >= 0);
    if (pid == 0) {
        setsid();
        signal(SIGINT, SIG_DFL); /* a signal ignored on entry cannot be trapped by the script */
        signal(SIGHUP, SIG_DFL);
        int null = open("/dev/null", O_RDWR), err = open(err_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        dup2(null, 0), dup2(null, 1), dup2(err, 2);
        execlp("env", "env", out_dir, "bash", "scripts/gpu_check.sh", "--dry", "check", (char *)NULL);
        _exit(127);
    }
    int status = 0, running = 0;
    pid_t ended = 0;
    for (double start = seconds_now(); !running && !ended && seconds_now() - start < 180; usleep(20000)) {
        running = access(suites_log, F_OK) == 0 && processes_of_sid(pid, "test_flexgen", 0) > 0;
        ended = waitpid(pid, &status, WNOHANG);
    }
    EXPECT(running, "gpu_check.sh --dry check: its suites step never ran build-emu/test_flexgen");
    usleep(1000000);
    kill(sig == SIGINT ? -pid : pid, sig);
    double signalled = seconds_now();
    while (!ended && seconds_now() - signalled < 20) {
        ended = waitpid(pid, &status, WNOHANG);
        if (!ended) usleep(20000);
    }
    double took = seconds_now() - signalled;
    int left = 0;
    for (double start = seconds_now(); (left = processes_of_sid(pid, NULL, 0)) > (ended ? 0 : 1) &&
                                        seconds_now() - start < 2;)
        usleep(20000); /* the processes killed last a moment longer than the script */
    const char *name = sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : "SIGHUP";
    EXPECT(ended && WIFEXITED(status) && WEXITSTATUS(status) == 128 + sig, "gpu_check.sh, %s mid-step: expected exit "
           "%d within 20 s; got %s %d after %.1f s", name, 128 + sig, !ended ? "still running" :
           WIFEXITED(status) ? "exit" : "signal", !ended ? 0 : WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status),
           took);
    EXPECT(left == (ended ? 0 : 1), "gpu_check.sh, %s mid-step: %d of its processes left running", name,
           left - !ended);
    EXPECT(access(next_log, F_OK) != 0, "gpu_check.sh, %s mid-step: it went on to its next step", name);
    char *err = slurp(err_path, NULL), said[64];
    snprintf(said, sizeof said, "gpu_check.sh: stopped by %s;", name);
    EXPECT(err && strstr(err, said) && count_lines(err) == 1, "gpu_check.sh, %s mid-step: expected one line on its "
           "stderr, \"%s ...\"; got '%s'", name, said, err ? err : "(none)");
    free(err);
    if (!ended) kill(-pid, SIGKILL), waitpid(pid, &status, 0);
    processes_of_sid(pid, NULL, 1);
}
#endif

/* scripts/gpu_check.sh stopped by Ctrl-C (SIGINT to its process group), SIGTERM or SIGHUP (to the
 * script) while a step runs: the step's processes end (they lead a process group of their own,
 * which no such signal reaches), the script exits 130, 143 or 129 within seconds and starts no
 * next step. */
static void test_gpu_check_interrupted(void) {
#if defined(FLEXGEN_CUDA_EMU) && !defined(__SANITIZE_ADDRESS__)
    char *dir = make_temp_dir();
    interrupt_gpu_check(dir, SIGINT);
    interrupt_gpu_check(dir, SIGTERM);
    interrupt_gpu_check(dir, SIGHUP);
    rm_tree(dir);
    free(dir);
#endif
}

void add_cuda_tests(void) {
    CU_pSuite s = CU_add_suite("gpu", NULL, NULL);
    CU_add_test(s, "CUDA against CPU, pre-LN fixture, policy matrix", test_pre_ln);
    CU_add_test(s, "CUDA against CPU, post-LN fixture, policy matrix", test_post_ln);
    CU_add_test(s, "CUDA against CPU, 20 layers with words wider than the hidden states, every sixth case of the matrix", test_deep);
    CU_add_test(s, "CUDA against CPU, LLaMA fixture (MQA, head_dim 24, biases), policy matrix", test_llama);
#ifndef __SANITIZE_ADDRESS__
    CU_add_test(s, "CUDA against CPU, Mistral fixture (GQA 8), policy matrix", test_mistral);
    CU_add_test(s, "CUDA against CPU, Qwen2 fixture, policy matrix", test_qwen2);
    CU_add_test(s, "CUDA against CPU, LLaMA 3's RoPE scaling (GQA 2), policy matrix", test_llama3_rope);
    CU_add_test(s, "CUDA against CPU, linear RoPE scaling (GQA 4), policy matrix", test_linear_rope);
#endif
    CU_add_test(s, "sparse attention: the same result however prompts are grouped", test_sparse_grouping);
    CU_add_test(s, "sparse attention over the cpu tier reads the kept V rows where they lie", test_sparse_v_in_place);
    CU_add_test(s, "a decode step on the gpu tier: one host wait, no pageable copy or allocation, its launches; "
                "4-bit weights read as stored",
                test_steady_decode);
    CU_add_test(s, "--gpu-mem caps device memory", test_gpu_mem_cap);
    CU_add_test(s, "--gpu-mem's plan with CUDA's sizes, on the CPU", test_gpu_mem_cap_plan);
    CU_add_test(s, "no GPU: --device cuda refused, auto falls back to the CPU", test_no_gpu_fallback);
    CU_add_test(s, "a device smaller than the plan, or than --gpu-mem: one line, exit 2", test_device_out_of_memory);
    CU_add_test(s, "scripts/gpu_laptop_run.sh's kjv step on the emulated GPU, OPT and LLaMA", test_laptop_run);
    CU_add_test(s, "scripts/gpu_check.sh --dry: the checks and the speed table on the emulated GPU", test_gpu_check_dry);
    CU_add_test(s, "scripts/gpu_check.sh stopped by SIGINT, SIGTERM or SIGHUP mid-step: exit 130, 143 or 129, no process left",
                test_gpu_check_interrupted);
}
