/* test_cost.c: the cost model of §4.3 and Appendix A.3 (lp.c) against values worked out by hand
 * below for one small configuration, and the hardware file's bad input. */
#define _GNU_SOURCE
#include "tests.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>

/* h1 = 4, h2 = 16, 2 layers; s = 3, n = 5, bls = 2 x 3 = 6. Per layer:
 *   weights     8 h1^2 + 4 h1 h2 = 128 + 256 = 384 bytes
 *   activations 2 s h1 bls = 144 (prefill), 2 h1 bls = 48 (decode)
 *   KV cache    4 (s + 1) h1 bls = 384 written in prefill; 4 bls (s + n/2) h1 = 528 read per
 *               decode step; 4 bls h1 = 96 written per step
 *   FLOPs       prefill bls (8 s h1^2 + 4 s h1 h2) = 6912, attention 4 bls s^2 h1 = 864;
 *               decode bls (8 h1^2 + 4 h1 h2) = 2304, attention 528
 *   output layer  2 bls vocab word_dim = 1536 FLOPs per generated token (vocab 32, word_dim 4)
 * Rates are distinct powers of two, so every quotient is exact. */
static const model_config CFG = OPT_SHAPE("hand", 2, 4, 2, 16, 32, 16, 4, 1);
static const fg_hardware HW = {.ctog_bdw = 2, .gtoc_bdw_cache = 4, .gtoc_bdw_hidden = 8,
    .dtoc_bdw = 16, .ctod_bdw_cache_p = 32, .ctod_bdw_hidden_p = 64, .ctod_bdw_g = 128,
    .mm_flops_p = 256, .mm_flops_g = 512, .bmm_flops_p = 1024, .bmm_flops_g = 2048,
    .cpu_flops = 4096};
/* wg wc wn, cg cc cn, hg hc hn */
static const double X[N_X] = {0.5, 0.25, 0.25, 0.5, 0.25, 0.25, 0.5, 0.25, 0.25};

static void expect_terms_at(const fg_linear *term, double want, const char *what) {
    double got = fg_linear_eval(term, X);
    EXPECT(fabs(got - want) <= 1e-12, "%s: expected %.10g (by hand), got %.10g", what, want, got);
}

static void expect_terms(const fg_linear *terms, const double want[N_TERMS], const char *what) {
    for (int i = 0; i < N_TERMS; i++) {
        double got = fg_linear_eval(&terms[i], X);
        EXPECT(fabs(got - want[i]) <= 1e-12 * fabs(want[i]), "%s, term %s: expected %.10g (by hand), "
               "got %.10g", what, fg_cost_term_names[i], want[i], got);
    }
}

static void test_cost_by_hand(void) {
    fg_workload w = {.s = 3, .n = 5, .gbs = 2, .ngb = 3, .cpu_cache_compute = 1};
    fg_cost_model m;
    fg_cost_model_build(&CFG, &w, &HW, &m);
    const double pre[N_TERMS] = {
        (0.5 * 384 + 0.5 * 144) / 2,        /* ctog: (wc + wn) weights + (hc + hn) activations */
        0.5 * 384 / 4 + 0.5 * 144 / 8,      /* gtoc: (cc + cn) cache, (hc + hn) activations */
        (0.25 * 384 + 0.25 * 144) / 16,     /* dtoc: wn weights + hn activations */
        0.25 * 384 / 32 + 0.25 * 144 / 64,  /* ctod: cn cache, hn activations */
        6912.0 / 256 + 864.0 / 1024};       /* comp */
    const double gen[N_TERMS] = {
        (0.5 * 384 + 0.5 * 48) / 2,                   /* ctog */
        0.5 * 48 / 8,                                 /* gtoc: activations only (delegated) */
        (0.25 * 528 + 0.25 * 384 + 0.25 * 48) / 16,   /* dtoc: cn cache, wn weights, hn act. */
        (0.25 * 96 + 0.25 * 48) / 128,                /* ctod: new cache rows, activations */
        2304.0 / 512 + 0.5 * 528 / 2048 + 0.5 * 528 / 4096}; /* comp: gpu, cg on gpu, cc+cn on cpu */
    expect_terms(m.pre, pre, "prefill");
    expect_terms(m.gen, gen, "decode");
    double t_pre, t_gen;
    double per_token = fg_cost_per_token(&m, &CFG, &w, X, &t_pre, &t_gen);
    CU_ASSERT_DOUBLE_EQUAL(t_pre, 132, 1e-12);
    CU_ASSERT_DOUBLE_EQUAL(t_gen, 108, 1e-12);
    CU_ASSERT_DOUBLE_EQUAL(m.head, 1536.0 / 512, 1e-12);
    /* T / bls = (T_pre l + T_gen (n - 1) l + head n) / bls */
    CU_ASSERT_DOUBLE_EQUAL(per_token, (132.0 * 2 + 108.0 * 4 * 2 + 3.0 * 5) / 6, 1e-12);

    /* not delegated: the off-gpu cache crosses cpu -> gpu, its new rows come back, and the
     * compute device attends over all of it */
    w.cpu_cache_compute = 0;
    fg_cost_model_build(&CFG, &w, &HW, &m);
    const double gen_moved[N_TERMS] = {108 + 0.5 * 528 / 2, 3 + 0.5 * 96 / 4, gen[T_DTOC], gen[T_CTOD],
                                       2304.0 / 512 + 528.0 / 2048};
    expect_terms(m.pre, pre, "prefill, not delegated");
    expect_terms(m.gen, gen_moved, "decode, not delegated");
    double moved = fg_cost_per_token(&m, &CFG, &w, X, NULL, NULL), by_hand = (264 + 240.0 * 8 + 15) / 6;
    EXPECT(fabs(moved - by_hand) <= 1e-12, "not delegated, T / bls: expected %.10g (by hand), got %.10g",
           by_hand, moved);

    /* 4-bit weights and cache: their bytes times 36/128 (384 -> 108, 528 -> 148.5, 96 -> 27) */
    w.cpu_cache_compute = 1;
    w.compress_weight = w.compress_cache = 1;
    fg_cost_model_build(&CFG, &w, &HW, &m);
    const double pre_q4[N_TERMS] = {(0.5 * 108 + 0.5 * 144) / 2, 0.5 * 108 / 4 + 0.5 * 144 / 8,
                                    (0.25 * 108 + 0.25 * 144) / 16, 0.25 * 108 / 32 + 0.25 * 144 / 64,
                                    pre[T_COMP]};
    const double gen_q4[N_TERMS] = {(0.5 * 108 + 0.5 * 48) / 2, gen[T_GTOC],
                                    (0.25 * 148.5 + 0.25 * 108 + 0.25 * 48) / 16,
                                    (0.25 * 27 + 0.25 * 48) / 128, gen[T_COMP]};
    expect_terms(m.pre, pre_q4, "prefill, 4-bit");
    expect_terms(m.gen, gen_q4, "decode, 4-bit");

    /* decompression (fp16 bytes / dequant_bdw: weights 384, cache 384 in prefill and 528 per
     * step) and the working weights read once per GPU batch (ngb 3 x 384 / mem_bdw) join the
     * compute term. On a GPU, prefill widens the 4-bit weights and reads them as fp16, decode's
     * products read the codes (36 / 128 of the bytes) and decode them in registers (no
     * decompression term), and so does its attention the cache's: only the half of the cache the
     * CPU attends (delegated, cc + cn) is decompressed; the CPU backend's products read the codes
     * in both, decoding them as they go (at dequant_bdw), and it attends over all of the cache */
    fg_hardware hw = HW;
    hw.dequant_bdw = 8192, hw.mem_bdw = 16384;
    fg_cost_model_build(&CFG, &w, &hw, &m);
    double codes = 36.0 / 128 * 3 * 384.0 / 16384;
    double pre_comp = pre[T_COMP] + 384.0 / 8192 + 384.0 / 8192 + 3 * 384.0 / 16384;
    double gen_comp = gen[T_COMP] + 0.5 * 528.0 / 8192 + codes;
    expect_terms_at(&m.pre[T_COMP], pre_comp, "prefill with decompression and weight reads, term comp");
    expect_terms_at(&m.gen[T_COMP], gen_comp, "decode with the codes read as stored, term comp");
    w.cpu_cache_compute = 0; /* the GPU attends over all of the cache: nothing decompressed */
    fg_cost_model_build(&CFG, &w, &hw, &m);
    expect_terms_at(&m.gen[T_COMP], gen_moved[T_COMP] + codes, "decode, not delegated, 4-bit cache, term comp");
    w.cpu_cache_compute = 1;
    hw.gpu_is_host = 1;
    fg_cost_model_build(&CFG, &w, &hw, &m);
    double host_gen_comp = gen[T_COMP] + 384.0 / 8192 + 528.0 / 8192 + codes;
    expect_terms_at(&m.gen[T_COMP], host_gen_comp, "decode, 4-bit working weights read as stored, term comp");

    /* --int8-activations: without its measured rates, costed as 4-bit; with them, its products at
     * those rates and no decompression of the weights (the integer products read the codes) */
    w.int8 = 1;
    fg_cost_model_build(&CFG, &w, &hw, &m);
    expect_terms_at(&m.gen[T_COMP], host_gen_comp, "int8, no rates, decode, term comp");
    hw.mm_flops_int8_p = 128, hw.mm_flops_int8_g = 1024;
    fg_cost_model_build(&CFG, &w, &hw, &m);
    double mem = 36.0 / 128 * 3 * 384.0 / 16384;
    expect_terms_at(&m.pre[T_COMP], 6912.0 / 128 + 864.0 / 1024 + 384.0 / 8192 + mem, "int8, prefill, term comp");
    expect_terms_at(&m.gen[T_COMP], 2304.0 / 1024 + 0.5 * 528 / 2048 + 0.5 * 528 / 4096 + 528.0 / 8192 + mem,
                    "int8, decode, term comp");
}

/* §5's top-K attention at --attn-sparsity 0.5 on the configuration above: every key is scored
 * and half of V is read, so decode attention's FLOPs and the cache it reads are 3/4 of the dense
 * ones. Not delegated, the cpu tier's share (cc) sends all of K and the kept V rows cpu -> gpu
 * (3/4 of its 528 bytes a step), the disk share (cn) is staged whole:
 *   ctog       108 + (0.25 x 3/4 + 0.25) x 528 / 2 = 223.5
 *   comp       2304 / 512 + 3/4 x 528 / 2048
 * delegated, the CPU's attention over cc + cn takes 3/4 of its FLOPs too, and a 4-bit cache is
 * decompressed only where the CPU reads it (half of 3/4 x 528 / 8192 more: the GPU's attention
 * decodes its half in registers); prefill is dense. F = 1 is dense. */
static void test_cost_sparse_attention(void) {
    fg_workload w = {.s = 3, .n = 5, .gbs = 2, .ngb = 3, .attn_sparsity = 0.5f};
    fg_workload dense_w = w;
    dense_w.attn_sparsity = 1;
    fg_cost_model m, dense;
    fg_cost_model_build(&CFG, &w, &HW, &m);
    fg_cost_model_build(&CFG, &dense_w, &HW, &dense);
    const double gen[N_TERMS] = {223.5, 3 + 0.5 * 96 / 4, fg_linear_eval(&dense.gen[T_DTOC], X),
                                 fg_linear_eval(&dense.gen[T_CTOD], X), 2304.0 / 512 + 0.75 * 528 / 2048};
    expect_terms(m.gen, gen, "decode, sparsity 0.5, not delegated");
    const fg_linear *ctog = &m.gen[T_CTOG];
    EXPECT(ctog->coef[X_CC] == 0.75 * 528 / 2 && ctog->coef[X_CN] == 528.0 / 2, "decode, sparsity 0.5, "
           "term ctog: expected 198 a unit of cc (K and the kept V) and 264 of cn (staged whole), got %g "
           "and %g", ctog->coef[X_CC], ctog->coef[X_CN]);
    for (int i = 0; i < N_TERMS; i++)
        EXPECT(fg_linear_eval(&m.pre[i], X) == fg_linear_eval(&dense.pre[i], X),
               "prefill, sparsity 0.5: term %s changed", fg_cost_term_names[i]);
    dense_w.attn_sparsity = 0;
    fg_cost_model zero;
    fg_cost_model_build(&CFG, &dense_w, &HW, &zero);
    expect_terms_at(&zero.gen[T_CTOG], 108 + 0.5 * 528 / 2, "decode, sparsity 0 (unset: dense), term ctog");

    w.cpu_cache_compute = 1;
    fg_cost_model_build(&CFG, &w, &HW, &m);
    double delegated = 2304.0 / 512 + 0.75 * (0.5 * 528 / 2048 + 0.5 * 528 / 4096);
    expect_terms_at(&m.gen[T_COMP], delegated, "decode, sparsity 0.5, delegated, term comp");
    expect_terms_at(&m.gen[T_CTOG], 108, "decode, sparsity 0.5, delegated, term ctog");
    w.compress_cache = 1;
    fg_hardware hw = HW;
    hw.dequant_bdw = 8192;
    fg_cost_model_build(&CFG, &w, &hw, &m);
    expect_terms_at(&m.gen[T_COMP], delegated + 0.5 * 0.75 * 528 / 8192,
                    "decode, sparsity 0.5, 4-bit cache decompressed where the CPU reads it, term comp");
}

/* A GPU's host, launch 2^-10 s and wait 2^-8 s, on the configuration above (an OPT layer: 16
 * launches a GPU batch, 11 kernels and products and 5 calls of the iteration's copies and join;
 * decode's attention one more, its spans and their merge):
 *   host       prefill (3 batches x 16 + 6 sequences x 3) x 2^-10 = 66 / 1024; decode 51 / 1024
 *   head       + one wait a step, for the logits: 3 + 1 / 256
 *   delegated  decode comp + 3 batches x 2^-8 on the cpu and disk cache (cc + cn = 0.5 at X)
 *   moved      decode ctog + 2 x 6 x (1 + 5 / 32) = 13.875 copies of runs of pages x 2^-10, cc + cn;
 *              with top-K the cpu tier's V is read in place: 6.9375 copies (K's) for cc
 * and none of it where the gpu tier is host memory (the CPU backend queues nothing). */
static void test_cost_host(void) {
    fg_workload w = {.s = 3, .n = 5, .gbs = 2, .ngb = 3, .cpu_cache_compute = 1};
    fg_hardware hw = HW;
    hw.launch_seconds = 1.0 / 1024, hw.wait_seconds = 1.0 / 256;
    fg_cost_model m, none;
    fg_cost_model_build(&CFG, &w, &hw, &m);
    fg_cost_model_build(&CFG, &w, &HW, &none);
    expect_terms_at(&m.pre[T_HOST], 66.0 / 1024, "prefill, term host");
    expect_terms_at(&m.gen[T_HOST], 51.0 / 1024, "decode, term host");
    CU_ASSERT_DOUBLE_EQUAL(m.head, 3 + 1.0 / 256, 1e-12);
    expect_terms_at(&m.gen[T_COMP], fg_linear_eval(&none.gen[T_COMP], X) + 0.5 * 3 / 256, "delegated decode, term comp");
    w.cpu_cache_compute = 0;
    fg_cost_model_build(&CFG, &w, &hw, &m);
    fg_cost_model_build(&CFG, &w, &HW, &none);
    expect_terms_at(&m.gen[T_CTOG], fg_linear_eval(&none.gen[T_CTOG], X) + 0.5 * 13.875 / 1024,
                    "decode, the cache moved in runs of pages, term ctog");
    hw.gpu_is_host = 1;
    fg_cost_model_build(&CFG, &w, &hw, &m);
    for (int i = 0; i < N_TERMS; i++)
        EXPECT(fg_linear_eval(&m.gen[i], X) == fg_linear_eval(&none.gen[i], X) && m.head == none.head,
               "the CPU backend: the host's seconds charged to term %s", fg_cost_term_names[i]);
    hw.gpu_is_host = 0;
    w.attn_sparsity = 0.5f; /* top-K: the cpu tier's V is read in place, only its K is copied */
    fg_cost_model_build(&CFG, &w, &hw, &m);
    fg_cost_model_build(&CFG, &w, &HW, &none);
    expect_terms_at(&m.gen[T_CTOG], fg_linear_eval(&none.gen[T_CTOG], X) + (0.25 * 6.9375 + 0.25 * 13.875) / 1024,
                    "decode, sparsity 0.5, K alone moved from the cpu tier, term ctog");
    double copies_cc = m.gen[T_CTOG].coef[X_CC] - none.gen[T_CTOG].coef[X_CC];
    double copies_cn = m.gen[T_CTOG].coef[X_CN] - none.gen[T_CTOG].coef[X_CN];
    EXPECT(copies_cc == 6.9375 / 1024 && copies_cn == 13.875 / 1024, "decode, sparsity 0.5, the "
           "copies' seconds a unit of cc and cn: expected %g and %g, got %g and %g", 6.9375 / 1024,
           13.875 / 1024, copies_cc, copies_cn);
}

/* A job of mixed lengths (--output runs its prompts by length): the costs take the prompts' mean
 * length, the memory the longest (every block must fit it). */
static void test_cost_mean_prompt(void) {
    fg_workload mixed = {.s = 7, .s_mean = 3, .n = 5, .gbs = 2, .ngb = 3}, mean = mixed, longest = mixed;
    mean.s = 3, mean.s_mean = longest.s_mean = 0;
    fg_cost_model cm, cw, cl;
    fg_cost_model_build(&CFG, &mixed, &HW, &cm);
    fg_cost_model_build(&CFG, &mean, &HW, &cw);
    fg_cost_model_build(&CFG, &longest, &HW, &cl);
    for (int i = 0; i < N_TERMS; i++) {
        EXPECT(fg_linear_eval(&cm.pre[i], X) == fg_linear_eval(&cw.pre[i], X) &&
               fg_linear_eval(&cm.gen[i], X) == fg_linear_eval(&cw.gen[i], X),
               "term %s: a mean prompt of 3 (longest 7) costs as prompts of 3", fg_cost_term_names[i]);
    }
    double t_mixed = fg_cost_per_token(&cm, &CFG, &mixed, X, NULL, NULL), t_longest = fg_cost_per_token(&cl, &CFG, &longest, X, NULL, NULL);
    EXPECT(t_mixed < t_longest, "T / bls: a mean prompt of 3 gives %g, prompts of 7 %g: expected less", t_mixed, t_longest);
    fg_memory_model mm, ml;
    fg_memory_model_build(&CFG, &mixed, &HW, FG_W_DISK, &mm);
    fg_memory_model_build(&CFG, &longest, &HW, FG_W_DISK, &ml);
    for (int t = 0; t < N_TIERS; t++)
        EXPECT(fg_linear_eval(&mm.tier[t], X) == fg_linear_eval(&ml.tier[t], X),
               "%s tier: the memory of a mean prompt of 3 is that of the longest, 7", fg_tier_names[t]);
}

#define FULL "{\"ctog_bdw\": 2, \"gtoc_bdw_cache\": 4, \"gtoc_bdw_hidden\": 8, \"dtoc_bdw\": 16," \
    " \"ctod_bdw_cache_p\": 32, \"ctod_bdw_hidden_p\": 64, \"ctod_bdw_g\": 128," \
    " \"mm_flops_p\": 256, \"mm_flops_g\": 512, \"bmm_flops_p\": 1024," \
    " \"bmm_flops_g\": 2048, \"cpu_flops\": 4096"

static void test_hardware_file(void) {
    char *dir = make_temp_dir(), path[4200], err[FG_ERR_LEN];
    snprintf(path, sizeof path, "%s/hw.json", dir);
    fg_hardware hw;
    write_text_file(path, FULL "}");
    CU_ASSERT_EQUAL(fg_hardware_read(path, &hw, err), 0);
    CU_ASSERT_EQUAL(memcmp(&hw, &HW, sizeof hw), 0); /* the optional keys default to 0, false, "" */
    /* written and read back */
    fg_hardware with = HW, back;
    with.dequant_bdw = 3.25e9, with.mem_bdw = 1e9 / 3, with.gpu_is_host = 1;
    with.launch_seconds = 3.5e-6, with.wait_seconds = 1e-5 / 3;
    snprintf(with.blas_core, sizeof with.blas_core, "SkylakeX");
    CU_ASSERT_EQUAL(fg_hardware_write(path, &with, err), 0);
    CU_ASSERT_EQUAL(fg_hardware_read(path, &back, err), 0);
    CU_ASSERT_EQUAL(memcmp(&back, &with, sizeof back), 0);
    /* a key given twice takes its last value, as Python's json */
    write_text_file(path, FULL ", \"ctog_bdw\": 3, \"gpu_is_host\": false, \"gpu_is_host\": true}");
    CU_ASSERT_EQUAL(fg_hardware_read(path, &back, err), 0);
    EXPECT(back.ctog_bdw == 3 && back.gpu_is_host == 1, "ctog_bdw 2 then 3, gpu_is_host false then true: "
           "expected the last values, got %g and %d", back.ctog_bdw, back.gpu_is_host);
    static const struct { const char *text, *says; } bad[] = {
        {"{\"ctog_bdw\": 2", "malformed JSON"},
        {"[1, 2]", "not a JSON object"},
        {FULL "} {}", "data after the value"},
        {FULL ", \"ctog_bdw\\u0000\": 1}", "line 1: a string holds \\u0000"},
        {"{\"ctog_bdw\": 2}", "\"gtoc_bdw_cache\" is missing"},
        {"{\"ctog_bdw\": \"fast\"}", "\"ctog_bdw\" is missing or not a number"},
        {"{\"ctog_bdw\": -1}", "\"ctog_bdw\" must be a rate in [1, 1e+18]"},
        {FULL ", \"dequant_bdw\": -1}", "\"dequant_bdw\" must be 0 or a rate in [1, 1e+18]"},
        {FULL ", \"mem_bdw\": \"fast\"}", "\"mem_bdw\" must be 0 or a rate in [1, 1e+18]"},
        {FULL ", \"gpu_is_host\": 1}", "\"gpu_is_host\" must be true or false"},
        {FULL ", \"launch_seconds\": 2}", "\"launch_seconds\" must be seconds in [0, 1]"},
        {FULL ", \"wait_seconds\": \"slow\"}", "\"wait_seconds\" must be seconds in [0, 1]"},
        {FULL ", \"blas_core\": 3}", "\"blas_core\" must be an OpenBLAS core's name"},
        {FULL ", \"gpu_is_host\": 1, \"blas_core\": 3}", "\"gpu_is_host\" must be true or false"},
        {FULL ", \"blas_core\": \"a name far longer than any core of OpenBLAS\"}", "\"blas_core\" must be"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        write_text_file(path, bad[i].text);
        err[0] = 0;
        CU_ASSERT_EQUAL(fg_hardware_read(path, &hw, err), -1);
        CU_ASSERT_PTR_NOT_NULL(strstr(err, path));
        CU_ASSERT_PTR_NOT_NULL(strstr(err, bad[i].says));
    }
    snprintf(path, sizeof path, "%s/missing.json", dir);
    CU_ASSERT_EQUAL(fg_hardware_read(path, &hw, err), -1);
    CU_ASSERT_PTR_NOT_NULL(strstr(err, path));
    rm_tree(dir);
    free(dir);
}

/* The FULL file with `key` set to the number `value`. */
static void write_with(const char *path, const char *key, double value) {
    cJSON *o = cJSON_Parse(FULL "}");
    cJSON_DeleteItemFromObjectCaseSensitive(o, key);
    cJSON_AddNumberToObject(o, key, value);
    char *text = cJSON_PrintUnformatted(o);
    write_text_file(path, text);
    free(text);
    cJSON_Delete(o);
}

/* Rates outside [1, 1e18] a second are refused on read with the file and the key, before the
 * cost model divides by them (1e-300 made the LP's coefficients infinite). */
static void test_hardware_extremes(void) {
    char *dir = make_temp_dir(), err[FG_ERR_LEN];
    const char *path = join(dir, "hw.json");
    fg_hardware hw;
    static const char *const keys[] = {"ctog_bdw", "dtoc_bdw", "mm_flops_g", "cpu_flops",
                                       "dequant_bdw", "mem_bdw"};
    static const double values[] = {1e-300, 0.5, 2e18, 1e300, -0.0};
    for (size_t k = 0; k < sizeof keys / sizeof *keys; k++)
        for (size_t v = 0; v < sizeof values / sizeof *values; v++) {
            if (k >= 4 && values[v] == 0) continue; /* 0: the optional rate is not modeled */
            write_with(path, keys[k], values[v]);
            err[0] = 0;
            int rc = fg_hardware_read(path, &hw, err);
            EXPECT(rc == -1 && strstr(err, path) && strstr(err, keys[k]),
                   "%s = %g: expected -1 and a line naming the file and key, got %d \"%s\"", keys[k],
                   values[v], rc, err);
        }
    static const double fine[] = {1, 1e18};
    for (size_t k = 0; k < sizeof keys / sizeof *keys; k++)
        for (size_t v = 0; v < 2; v++) {
            write_with(path, keys[k], fine[v]);
            int rc = fg_hardware_read(path, &hw, err);
            EXPECT(rc == 0, "%s = %g: expected it to be read, got \"%s\"", keys[k], fine[v], err);
        }
    rm_tree(dir);
    free(dir);
}

static int read_hw(void *path, char *err) {
    fg_hardware hw;
    return fg_hardware_read(path, &hw, err);
}

/* A FIFO (which no one writes: opening it must not block) or a device as the hardware file is
 * refused at once, with one line naming it. */
static void test_hardware_not_regular(void) {
    char *dir = make_temp_dir(), err[FG_ERR_LEN];
    const char *path = join(dir, "hw.json");
    CU_ASSERT_EQUAL_FATAL(mkfifo(path, 0600), 0);
    int rc = run_bounded(read_hw, (void *)path, 10, err);
    EXPECT(rc == -1 && strstr(err, path) && strstr(err, "not a regular file"),
           "FIFO: expected -1 and \"not a regular file\", got %d \"%s\"", rc, err);
    rc = run_bounded(read_hw, "/dev/null", 10, err);
    EXPECT(rc == -1 && strstr(err, "/dev/null") && strstr(err, "not a regular file"),
           "/dev/null: expected -1 and \"not a regular file\", got %d \"%s\"", rc, err);
    rm_tree(dir);
    free(dir);
}

/* fg_hardware_write with files limited to 64 bytes: the write fails part way. */
static int write_hw_limited(void *path, char *err) {
    signal(SIGXFSZ, SIG_IGN);
    struct rlimit small = {64, 64};
    if (setrlimit(RLIMIT_FSIZE, &small)) return fg_fail(err, "setrlimit: %s", strerror(errno));
    return fg_hardware_write(path, &HW, err);
}

/* A write that fails part way (as an interrupted `flexgen profile` does) leaves the previous
 * hardware file as it was, and no temp file beside it. */
static void test_hardware_write_atomic(void) {
    char *dir = make_temp_dir(), err[FG_ERR_LEN];
    const char *path = join(dir, "hardware.json");
    write_text_file(path, FULL "}");
    int rc = run_bounded(write_hw_limited, (void *)path, 10, err);
    EXPECT(rc == -1 && strstr(err, path), "expected -1 and a line naming the file, got %d \"%s\"",
           rc, err);
    char *text = slurp(path, NULL);
    EXPECT(text && !strcmp(text, FULL "}"), "expected the previous file, got \"%.40s\"",
           text ? text : "(no file)");
    free(text);
    EXPECT(dir_entries(dir) == 1, "expected the hardware file alone, got %d entries", dir_entries(dir));
    rm_tree(dir);
    free(dir);
}

/* The profile's line through two decode runs (profile_decode_line). A layer bound by its
 * arithmetic at both batches (times proportional to the sequences: no intercept) reads its
 * weights no faster than the memory's read rate where they are in host memory; a clear intercept
 * gives the read rate it implies; a GPU's (no read rate given) keeps the 1% floor. */
static void test_profile_decode_line(void) {
    const double working = 1e8, mm_token = 4e9, per_seq = 1e-3, memory = 2e10;
    double mem_bdw, flops;
    decode_runs proportional = {{8 * per_seq, 64 * per_seq}, {8, 64}, working, mm_token, memory};
    profile_decode_line(&proportional, &mem_bdw, &flops);
    EXPECT(mem_bdw == memory, "times proportional to the batch: weights read at %g B/s, above the "
           "memory's %g", mem_bdw, memory);
    EXPECT(fabs(flops - mm_token / per_seq) <= 1e-9 * flops, "products at %g FLOP/s, expected %g", flops,
           mm_token / per_seq);
    const double slow_read = 1e10; /* an intercept of working / slow_read seconds */
    decode_runs intercept = {{working / slow_read + 8 * per_seq, working / slow_read + 64 * per_seq}, {8, 64},
                             working, mm_token, memory};
    profile_decode_line(&intercept, &mem_bdw, &flops);
    EXPECT(fabs(mem_bdw - slow_read) <= 1e-9 * slow_read, "an intercept of %g s: weights read at %g B/s, "
           "expected %g", working / slow_read, mem_bdw, slow_read);
    decode_runs gpu = proportional;
    gpu.read_rate = 0;
    profile_decode_line(&gpu, &mem_bdw, &flops);
    EXPECT(fabs(mem_bdw - working / (0.01 * 8 * per_seq)) <= 1e-9 * mem_bdw, "no read rate: weights read at "
           "%g B/s, expected the 1%% floor's %g", mem_bdw, working / (0.01 * 8 * per_seq));
}

void add_cost_tests(void) {
    CU_pSuite s = CU_add_suite("cost", NULL, NULL);
    CU_add_test(s, "terms, T_pre, T_gen and T / bls against values worked out by hand", test_cost_by_hand);
    CU_add_test(s, "top-K attention: its share of the cache read and of the FLOPs, by hand", test_cost_sparse_attention);
    CU_add_test(s, "a job's mean prompt length for the costs, the longest for the memory", test_cost_mean_prompt);
    CU_add_test(s, "a GPU's host: its launches and waits, worked out by hand; none on the CPU", test_cost_host);
    CU_add_test(s, "the profile's decode line reads no faster than the memory", test_profile_decode_line);
    CU_add_test(s, "hardware file: read, and its bad input", test_hardware_file);
    CU_add_test(s, "hardware file: rates outside [1, 1e18] name the key", test_hardware_extremes);
    CU_add_test(s, "hardware file: FIFO or device refused at once", test_hardware_not_regular);
    CU_add_test(s, "hardware file: a failed write keeps the previous file", test_hardware_write_atomic);
}
