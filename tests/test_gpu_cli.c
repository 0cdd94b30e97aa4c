/* test_gpu_cli.c: the whole program on the GPU against the CPU, in the GPU suite. Each test runs
 * the flexgen binary ($FLEXGEN_BIN: ./flexgen-emu on the emulated GPU of tests/cuda_emu, ./flexgen
 * on a real one) with --device cuda and again with --device cpu and the same flags, and compares
 * what the program puts out: the dumped logits (--dump-logits), the greedy tokens (each step's
 * argmax), the printed text, a job's records, a pipeline's logits, a perplexity. test_cuda.c holds
 * the backend to the CPU through the library, teacher forced; these hold everything around it too:
 * the command line, the checkpoint, the disk tier's files, the I/O threads with overlap on and off,
 * the paged cache under --refill, the job runner, MPI stages, perplexity's windows, and the check
 * of the GPU's compute capability.
 *
 * The bounds, shares of the largest |logit| of the steps compared (each case prints its share):
 *   B16 = 1e-2   fp16 activations, derived in test_cuda.c's header
 *   B4 = B16 + Q a 4-bit cache, as test_cuda.c computes it: Q is the CPU's own 4-bit cache effect,
 *                measured here on each model (the CPU with and without --compress-cache)
 *   BS = B16 + S top-K sparse attention. Top-K is not continuous: where the weights of the K-th and
 *                the next earlier key are within fp16's rounding of each other (relative gaps of
 *                1e-5 to 1e-4 occur among opt-kjv's decode steps at 0.5), the GPU, whose queries
 *                are fp16, keeps the other key, and the output moves by that key's share of the
 *                attention, up to B16 and beyond (2e-2 of max|logit| on opt-kjv's prompts.jsonl). An
 *                exchange of two keys at the threshold moves the output by about as much as
 *                dropping the keys below it, which is S, the CPU's own sparsity effect (the CPU
 *                with and without --attn-sparsity). Loose: test_kernels.cu holds the kernel's
 *                choice to the CPU's on the same fp16 rows, exactly.
 *
 * Tokens. The runs are greedy, each fed its own tokens. On models/opt-kjv, trained, with the
 * reference's prompts (tests/fixtures/opt-kjv, chosen where PyTorch's greedy steps are far from
 * ties), the tokens and the printed text must be identical, but with sparse attention, whose
 * flipped choices move logits by more than those prompts' smallest gaps. Elsewhere (the tiny
 * fixtures have random weights and near ties) a prompt's logits are compared while the two runs'
 * tokens agree: the step where they first differ still counts (its context is the same), the
 * later ones do not. Such a parting is within the bound: two runs within b x max|logit| of each
 * other choose differently only where the CPU's top two are within 2 b x max|logit|, which each
 * parting prints.
 *
 * Without a GPU (a native build on a machine without one) each test returns at once; test_cuda.c
 * says why the suite skips.
 */
#define _GNU_SOURCE
#include "tests.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define B16 1e-2f

#define ARGS(...) ((const char *const[]){__VA_ARGS__, NULL})

static int gpu_here(void) {
    char why[FG_ERR_LEN];
    setenv("OMP_WAIT_POLICY", "passive", 0); /* the children's idle threads sleep, as in test_cli.c */
    if (fg_cuda_backend(why)) return 1;
    test_skip(why);
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Running the binary
 * --------------------------------------------------------------------------------------------- */


typedef struct {
    int rc;
    char *out, *err;
} run;

static run run_args(const arglist *a) {
    run r;
    r.rc = run_command(a->v, NULL, &r.out, &r.err);
    return r;
}

static void run_free(run *r) { free(r->out), free(r->err); }

/* The report names the device that ran: its last line, or --json's "device". */
static int names_device(const char *out, const char *device) {
    char line[64], json[64];
    snprintf(line, sizeof line, "device: %s\n", device);
    snprintf(json, sizeof json, "\"device\":\"%s\"", device);
    return strstr(out, line) || strstr(out, json);
}

/* The float32 file at path, which must hold n floats; NULL (and a failure) if it does not. */
static float *read_floats(const char *path, size_t n) {
    size_t len = 0;
    char *data = slurp(path, &len);
    EXPECT(data && len == n * sizeof(float), "%s: expected %zu bytes of logits, got %zu", path,
           n * sizeof(float), data ? len : 0);
    if (data && len == n * sizeof(float)) return (float *)(void *)data;
    free(data);
    return NULL;
}

/* The generated text of a run: stdout up to the report (malloc'd). */
static char *texts(const char *out) {
    const char *end = strstr(out, "model size:");
    return strndup(out, end ? (size_t)(end - out) : strlen(out));
}

/* ---------------------------------------------------------------------------------------------
 * The models and their prompts
 * --------------------------------------------------------------------------------------------- */

typedef struct {
    const char *name, *prompt_flag; /* --prompt-ids, or --prompt-file for a job's JSONL */
    char dir[4200], prompts[4200];
    int n_prompts, gen_len, vocab;
    char gen_len_arg[16];
    int same_tokens; /* a trained model: greedy tokens (and text) must be identical */
    float q, sparse; /* the CPU's own effects of a 4-bit cache and of sparsity; < 0 until measured */
} model;

enum { KJV, PRE_LN, POST_LN, N_MODELS };
static model MODELS[N_MODELS];

/* The lines of a file that hold something: its prompts. */
static int count_prompts(const char *path) {
    char *text = slurp(path, NULL);
    CU_ASSERT_PTR_NOT_NULL_FATAL(text);
    int n = 0;
    for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) n += strspn(line, " \t\r") < strlen(line);
    free(text);
    return n;
}

static void model_init(model *m, const char *name, const char *dir, const char *prompt_flag,
                       const char *prompts, int gen_len, int same_tokens) {
    char err[FG_ERR_LEN];
    model_config cfg;
    m->name = name, m->prompt_flag = prompt_flag;
    snprintf(m->dir, sizeof m->dir, "%s", fixture(dir));
    snprintf(m->prompts, sizeof m->prompts, "%s", fixture(prompts));
    CU_ASSERT_EQUAL_FATAL(model_config_from_json(join(m->dir, "config.json"), &cfg, err), 0);
    m->vocab = cfg.vocab;
    m->n_prompts = count_prompts(m->prompts);
    m->gen_len = gen_len, m->same_tokens = same_tokens, m->q = m->sparse = -1;
    snprintf(m->gen_len_arg, sizeof m->gen_len_arg, "%d", gen_len);
}

static void models_init(void) {
    static int done;
    if (done++) return;
    model_init(&MODELS[KJV], "opt-kjv", "../../models/opt-kjv", "--prompt-ids", "opt-kjv/prompts.txt", 8, 1);
    model_init(&MODELS[PRE_LN], "opt-tiny", "opt-tiny", "--prompt-ids", "opt-tiny/prompts.txt", 6, 0);
    model_init(&MODELS[POST_LN], "opt-tiny-350m", "opt-tiny-350m", "--prompt-ids",
               "opt-tiny-350m/prompts.txt", 6, 0);
}

static size_t n_logits(const model *m) { return (size_t)m->n_prompts * m->gen_len * m->vocab; }

/* The model, its prompts and --gen-len. */
static void model_args(arglist *a, const model *m) {
    arglist_add(a, ARGS("--model", m->dir, m->prompt_flag, m->prompts, "--gen-len", m->gen_len_arg));
}

/* m's prompts on `device` with `flags`, greedy, its logits dumped to dir/DEVICE.bin: those logits
 * (NULL, and a failure, unless it exits 0 with a report naming the device). text: NULL, or gets
 * the generated text. */
static float *run_model(const model *m, const char *device, const char *const *flags, const char *dir,
                        char **text) {
    char dump[4200];
    snprintf(dump, sizeof dump, "%s/%s.bin", dir, device);
    arglist a = {.n = 0};
    arglist_add(&a, ARGS(flexgen_bin(), "--device", device, "--quiet", "--dump-logits", dump));
    model_args(&a, m);
    arglist_add(&a, flags);
    run r = run_args(&a);
    int ok = r.rc == 0 && names_device(r.out, device);
    EXPECT(ok, "%s on %s: expected exit 0 and a report naming %s, got exit %d: %s", m->name, device, device,
           r.rc, r.err);
    float *logits = ok ? read_floats(dump, n_logits(m)) : NULL;
    if (text) *text = texts(r.out);
    run_free(&r);
    unlink(dump);
    return logits;
}

/* ---------------------------------------------------------------------------------------------
 * Comparing two runs
 * --------------------------------------------------------------------------------------------- */

static void top_two(const float *row, int vocab, int *top, int *second) {
    *top = 0, *second = -1;
    for (int v = 1; v < vocab; v++) {
        if (row[v] > row[*top]) *second = *top, *top = v;
        else if (*second < 0 || row[v] > row[*second]) *second = v;
    }
}

typedef struct {
    float share, max_abs; /* the largest |difference| over the compared steps / their max|logit| */
    int steps, compared;  /* steps in all; compared (while the tokens agree) */
    int parted;           /* prompts whose tokens differ at some step */
    int first_prompt, first_step;
    float first_gap;      /* there, the CPU's top two apart, as a share of max|logit| */
} comparison;

/* Each prompt's steps up to and including the first whose greedy tokens differ. */
static comparison compare_logits(const float *cpu, const float *gpu, int n_prompts, int gen_len, int vocab) {
    comparison c = {0, 0, n_prompts * gen_len, 0, 0, -1, -1, 0};
    float worst = 0, parted_gap = 0;
    for (int p = 0; p < n_prompts; p++)
        for (int s = 0; s < gen_len; s++) {
            const float *r = cpu + ((size_t)p * gen_len + s) * vocab, *g = gpu + ((size_t)p * gen_len + s) * vocab;
            for (int v = 0; v < vocab; v++) {
                c.max_abs = fmaxf(c.max_abs, fabsf(r[v]));
                worst = fmaxf(worst, logit_gap(r[v], g[v]));
            }
            c.compared++;
            int rt, rs, gt, gs;
            top_two(r, vocab, &rt, &rs);
            top_two(g, vocab, &gt, &gs);
            if (rt == gt) continue;
            if (c.parted++ == 0) c.first_prompt = p + 1, c.first_step = s + 1, parted_gap = r[rt] - r[rs];
            break;
        }
    c.share = c.max_abs > 0 ? worst / c.max_abs : (worst > 0 ? INFINITY : 0);
    c.first_gap = c.max_abs > 0 ? parted_gap / c.max_abs : 0;
    return c;
}

/* The logits of a cuda run against the CPU's: within bound, and with same_tokens the same tokens.
 * Prints the share. */
static comparison expect_close(const model *m, const char *what, const float *cpu, const float *gpu, float bound,
                               int same_tokens) {
    comparison c = compare_logits(cpu, gpu, m->n_prompts, m->gen_len, m->vocab);
    EXPECT(c.share <= bound && (!same_tokens || c.parted == 0), "%s, %s: expected logits within %.2e of "
           "max|logit|%s; got %.2e of %.2f, %d of %d prompts' tokens part (first: prompt %d, step %d)", m->name,
           what, bound, same_tokens ? " and the same tokens" : "", c.share, c.max_abs, c.parted, m->n_prompts,
           c.first_prompt, c.first_step);
    printf("\n  %s, %s: %.2e of max|logit| %.2f (bound %.2e), %d/%d steps", m->name, what, c.share, c.max_abs,
           bound, c.compared, c.steps);
    if (c.parted)
        printf("; %d prompts part, first prompt %d step %d, the CPU's top two %.2e apart", c.parted,
               c.first_prompt, c.first_step, c.first_gap);
    return c;
}

/* Both runs of m with flags, compared; with same_tokens the printed text too. */
static void expect_same_run(const model *m, const char *what, const char *const *flags, const char *dir, float bound,
                            int same_tokens) {
    char *cpu_text = NULL, *gpu_text = NULL;
    float *cpu = run_model(m, "cpu", flags, dir, &cpu_text);
    float *gpu = run_model(m, "cuda", flags, dir, &gpu_text);
    if (cpu && gpu) expect_close(m, what, cpu, gpu, bound, same_tokens);
    if (same_tokens)
        EXPECT(!strcmp(cpu_text, gpu_text) && strlen(cpu_text) > 0, "%s, %s: the printed text differs: expected\n"
               "%s got\n%s", m->name, what, cpu_text, gpu_text);
    free(cpu), free(gpu), free(cpu_text), free(gpu_text);
}

/* ---------------------------------------------------------------------------------------------
 * Greedy runs over placements, overlap, delegation and section 5
 * --------------------------------------------------------------------------------------------- */

#define ON_GPU "--percent", "100", "0", "100", "0", "100", "0"
#define SPLIT "--percent", "0", "50", "30", "40", "50", "20"
#define ON_DISK "--percent", "0", "0", "0", "0", "0", "0"

enum { FP16, CACHE4, SPARSE }; /* which bound: B16, B4 = B16 + Q, BS = B16 + S */
enum { ALL = 7, TRAINED = 1 << KJV, FIXTURES = 1 << PRE_LN | 1 << POST_LN };

/* The trained model, whose tokens must agree, runs most cases. The fixtures differ from it in their
 * layers (post-LN, a projected embedding), not in what moves, so the placements that only move
 * bytes otherwise run on one of them; and 4-bit weights on the gpu tier run on them alone, since
 * opt-kjv's 4M weights, decompressed at every step, take seconds a run on the emulated GPU. */
typedef struct {
    const char *what;
    const char *flags[12];
    int bound, models; /* a set of 1 << KJV, PRE_LN, POST_LN */
} cli_case;

static const cli_case CASES[] = {
    {"everything on the gpu tier", {ON_GPU}, FP16, ALL},
    {"over gpu, cpu and disk", {SPLIT}, FP16, TRAINED | 1 << PRE_LN},
    {"everything on disk", {ON_DISK}, FP16, TRAINED | 1 << PRE_LN},
    {"over gpu, cpu and disk, no overlap", {SPLIT, "--overlap", "0"}, FP16, 1 << PRE_LN},
    {"over gpu, cpu and disk, delegated", {SPLIT, "--cpu-cache-compute"}, FP16, ALL},
    {"everything on disk, delegated, no overlap", {ON_DISK, "--cpu-cache-compute", "--overlap", "0"}, FP16, ALL},
    {"4-bit weights over gpu, cpu and disk", {SPLIT, "--compress-weight"}, FP16, ALL},
    {"4-bit weights on the gpu tier", {ON_GPU, "--compress-weight"}, FP16, FIXTURES},
    {"4-bit cache on the gpu tier", {ON_GPU, "--compress-cache"}, CACHE4, ALL},
    {"4-bit cache over gpu, cpu and disk, delegated", {SPLIT, "--compress-cache", "--cpu-cache-compute"}, CACHE4,
     TRAINED | 1 << PRE_LN},
    {"4-bit weights and cache on disk", {ON_DISK, "--compress-weight", "--compress-cache"}, CACHE4, FIXTURES},
    {"sparse attention 0.5 on the gpu tier", {ON_GPU, "--attn-sparsity", "0.5"}, SPARSE, ALL},
    {"sparse attention 0.5 over the tiers, delegated", {SPLIT, "--attn-sparsity", "0.5", "--cpu-cache-compute"},
     SPARSE, TRAINED | 1 << PRE_LN},
};
enum { N_CASES = sizeof CASES / sizeof CASES[0] };

/* A block of two GPU batches of 3 (the second partly filled: 4 or 5 prompts); the disk tier in dir. */
static void block_flags(arglist *a, const char *dir) {
    arglist_add(a, ARGS("--gpu-batch-size", "3", "--num-gpu-batches", "2", "--offload-dir", dir));
}

/* The CPU with `flag` against the CPU without, on the gpu tier: an approximation's own effect, a
 * share of max|logit| (-1: a run failed). */
static float cpu_effect(const model *m, const char *const *flag, const char *dir) {
    arglist exact = {.n = 0}, approx = {.n = 0};
    block_flags(&exact, dir), block_flags(&approx, dir);
    arglist_add(&exact, ARGS(ON_GPU));
    arglist_add(&approx, ARGS(ON_GPU));
    arglist_add(&approx, flag);
    float *a = run_model(m, "cpu", exact.v, dir, NULL), *b = a ? run_model(m, "cpu", approx.v, dir, NULL) : NULL;
    float share = -1;
    if (a && b) share = compare_logits(a, b, m->n_prompts, m->gen_len, m->vocab).share;
    free(a), free(b);
    return share;
}

/* B16, or B16 plus the CPU's own effect of the approximation (measured once a model). */
static float case_bound(model *m, int bound, const char *dir) {
    if (bound == CACHE4 && m->q < 0) {
        m->q = cpu_effect(m, ARGS("--compress-cache"), dir);
        printf("\n  %s: the CPU's 4-bit cache effect Q %.2e of max|logit|, B4 %.2e", m->name, m->q, B16 + m->q);
    }
    if (bound == SPARSE && m->sparse < 0) {
        m->sparse = cpu_effect(m, ARGS("--attn-sparsity", "0.5"), dir);
        printf("\n  %s: the CPU's sparsity 0.5 effect S %.2e of max|logit|, BS %.2e", m->name, m->sparse,
               B16 + m->sparse);
    }
    float effect = bound == CACHE4 ? m->q : bound == SPARSE ? m->sparse : 0;
    return effect < 0 ? -1 : B16 + effect;
}

static void expect_cases(model *m) {
    if (!gpu_here()) return;
    char *dir = make_temp_dir();
    for (int i = 0; i < N_CASES; i++) {
        if (!(CASES[i].models & 1 << (m - MODELS))) continue;
        /* make test-san: the trained model's every other case (each of its cases runs on the pre-LN
           fixture too; make test checks the numbers of all) */
        if (SANITIZERS_ONE_DIAGONAL && m == &MODELS[KJV] && i % 2) continue;
        float bound = case_bound(m, CASES[i].bound, dir);
        if (bound < 0) continue; /* the CPU's run failed, said */
        arglist a = {.n = 0};
        block_flags(&a, dir);
        arglist_add(&a, CASES[i].flags);
        expect_same_run(m, CASES[i].what, a.v, dir, bound, m->same_tokens && CASES[i].bound != SPARSE);
    }
    EXPECT(dir_entries(dir) == 0, "%s: expected the offload dir empty after the runs, %d files left", m->name,
           dir_entries(dir));
    rm_tree(dir);
    free(dir);
}

static void test_trained_model(void) { models_init(), expect_cases(&MODELS[KJV]); }
static void test_pre_ln(void) { models_init(), expect_cases(&MODELS[PRE_LN]); }
static void test_post_ln(void) { models_init(), expect_cases(&MODELS[POST_LN]); }

/* ---------------------------------------------------------------------------------------------
 * The paged cache under --refill
 * --------------------------------------------------------------------------------------------- */

/* A number of a --json object (NaN: none). */
static double number(const cJSON *o, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsNumber(v) ? v->valuedouble : NAN;
}

typedef struct {
    float *logits;
    double rows_computed, kv_cache_rows, kv_cache_tokens, longest;
} refill_run;

static refill_run run_refill(const model *m, const char *device, const char *const *prompts, const char *dir) {
    char dump[4200];
    snprintf(dump, sizeof dump, "%s/%s.bin", dir, device);
    arglist a = {.n = 0};
    arglist_add(&a, ARGS(flexgen_bin(), "--model", m->dir, "--gen-len", m->gen_len_arg, "--device", device,
                 "--gpu-batch-size", "2", "--num-gpu-batches", "1", "--stop-at-eos", "--refill", "--json",
                 "--quiet", "--dump-logits", dump));
    arglist_add(&a, prompts);
    run r = run_args(&a);
    refill_run f = {NULL, NAN, NAN, NAN, NAN};
    int ok = r.rc == 0 && names_device(r.out, device);
    EXPECT(ok, "%s, --refill on %s: expected exit 0, got %d: %s", m->name, device, r.rc, r.err);
    if (ok) {
        cJSON *o = cJSON_Parse(r.out);
        f.logits = read_floats(dump, n_logits(m));
        f.rows_computed = number(o, "rows_computed");
        f.kv_cache_rows = number(o, "kv_cache_rows");
        f.kv_cache_tokens = number(o, "kv_cache_tokens");
        f.longest = number(o, "prompt_len");
        cJSON_Delete(o);
    }
    run_free(&r);
    unlink(dump);
    return f;
}

/* The same logits (B16), rows computed and cache rows; `paged`: those rows in pages of
 * FG_PAGE_TOKENS, fewer than a whole longest sequence for every prompt. Returns cuda's logits. */
static float *expect_same_refill(const model *m, const char *const *prompts, int paged, const char *dir) {
    refill_run cpu = run_refill(m, "cpu", prompts, dir), gpu = run_refill(m, "cuda", prompts, dir);
    if (cpu.logits && gpu.logits) {
        expect_close(m, "--stop-at-eos --refill", cpu.logits, gpu.logits, B16, m->same_tokens);
        double whole = m->n_prompts * (cpu.longest + m->gen_len);
        EXPECT(gpu.rows_computed == cpu.rows_computed && gpu.kv_cache_rows == cpu.kv_cache_rows &&
               (!paged || (fmod(gpu.kv_cache_rows, FG_PAGE_TOKENS) == 0 && gpu.kv_cache_rows < whole)),
               "%s, --refill: expected the CPU's %g rows computed and its %g cache rows%s, got %g and %g", m->name,
               cpu.rows_computed, cpu.kv_cache_rows, paged ? ", in pages, fewer than whole sequences take" : "",
               gpu.rows_computed, gpu.kv_cache_rows);
        printf("; cache rows %g (tokens %g), rows computed %g", gpu.kv_cache_rows, gpu.kv_cache_tokens,
               gpu.rows_computed);
    }
    free(cpu.logits);
    return gpu.logits;
}

static const int EOS_PROMPT = 3; /* opt-tiny's fourth prompt generates </s> first */

/* Two long prompts (about 30 tokens: three pages of 16 when done) among three short ones (one page). */
static const char *const REFILL_PROMPTS[] = {
    "--prompt", "In the beginning God created the heaven and the earth. And the earth was without form, and void; "
                "and darkness was upon the face of the deep.",
    "--prompt", "And the LORD said unto Moses",
    "--prompt", "The LORD is my shepherd; I shall not want. He maketh me to lie down in green pastures: he "
                "leadeth me beside the still waters.",
    "--prompt", "Blessed are the meek",
    "--prompt", "In the beginning was the Word",
    NULL,
};

/* opt-tiny's prompts in the order 4, 2, 1, 3, 5, so that the first slot refills beside a slot that
 * decodes: prompt 4 ends at its first step (</s>) in slot 0, and slot 0 takes prompt 1 (3 tokens:
 * its prefill) while prompt 2 in slot 1 decodes in the same GPU batch. Its prompt file, in dir. */
static const char *slot0_refill_prompts(const model *tiny, const char *dir) {
    static char path[4200];
    static const int order[] = {3, 1, 0, 2, 4};
    char *text = slurp(tiny->prompts, NULL), *lines[8], out[4096] = "";
    int n = 0;
    CU_ASSERT_PTR_NOT_NULL_FATAL(text);
    for (char *line = strtok(text, "\n"); line && n < 8; line = strtok(NULL, "\n")) lines[n++] = line;
    CU_ASSERT_FATAL(n == 5);
    for (int i = 0; i < 5; i++) snprintf(out + strlen(out), sizeof out - strlen(out), "%s\n", lines[order[i]]);
    snprintf(path, sizeof path, "%s/slot0-refill.txt", dir);
    write_text_file(path, out);
    free(text);
    return path;
}

/* opt-kjv: five prompts in two slots, each slot taken by the next prompt as its sequence ends, the
 * cache in pages. opt-tiny: its fourth prompt ends at its first step (</s>) and its slot goes to
 * the fifth; on cuda too, its later rows are zero. The same prompts reordered so that slot 0
 * prefills a new prompt beside slot 1's decoding (slot0_refill_prompts): CUDA's logits the CPU's. */
static void test_refill(void) {
    if (!gpu_here()) return;
    models_init();
    char *dir = make_temp_dir();
    model kjv = MODELS[KJV];
    kjv.n_prompts = 5;
    free(expect_same_refill(&kjv, REFILL_PROMPTS, 1, dir));
    const model *tiny = &MODELS[PRE_LN];
    float *gpu = expect_same_refill(tiny, ARGS("--prompt-ids", tiny->prompts), 0, dir);
    int zero = gpu != NULL;
    for (size_t i = ((size_t)EOS_PROMPT * tiny->gen_len + 1) * tiny->vocab;
         gpu && i < (size_t)(EOS_PROMPT + 1) * tiny->gen_len * tiny->vocab; i++)
        zero &= gpu[i] == 0;
    EXPECT(zero, "opt-tiny, --stop-at-eos --refill on cuda: expected prompt %d's rows after its </s> zero",
           EOS_PROMPT + 1);
    free(gpu);
    const char *reordered = slot0_refill_prompts(tiny, dir);
    free(expect_same_refill(tiny, ARGS("--prompt-ids", reordered), 0, dir));
    unlink(reordered);
    rm_tree(dir);
    free(dir);
}

/* ---------------------------------------------------------------------------------------------
 * A batch job
 * --------------------------------------------------------------------------------------------- */

/* --output of opt-kjv's prompts.jsonl in windows of blocks, longest first: every record (id,
 * completion, tokens, stop) the same on both devices, byte for byte; the job lines name each. */
static void test_job(void) {
    if (!gpu_here()) return;
    models_init();
    model job = MODELS[KJV]; /* its prompts as a job's file: text and ids, each with an id */
    snprintf(job.prompts, sizeof job.prompts, "%s", fixture("../../models/opt-kjv/prompts.jsonl"));
    job.n_prompts = count_prompts(job.prompts);
    const model *m = &job;
    char *dir = make_temp_dir();
    char *records[2] = {NULL, NULL};
    static const char *const devices[2] = {"cpu", "cuda"};
    for (int d = 0; d < 2; d++) {
        char output[4200];
        snprintf(output, sizeof output, "%s/%s.jsonl", dir, devices[d]);
        arglist a = {.n = 0};
        arglist_add(&a, ARGS(flexgen_bin(), "--model", m->dir, "--prompt-file", m->prompts, "--gen-len", "6",
                     "--gpu-batch-size", "2", "--num-gpu-batches", "2", "--stop-at-eos", "--device", devices[d],
                     "--quiet", "--output", output));
        run r = run_args(&a);
        EXPECT(r.rc == 0 && names_device(r.out, devices[d]), "a job on %s: expected exit 0 and a report naming it, "
               "got %d: %s", devices[d], r.rc, r.err);
        run_free(&r);
        records[d] = slurp(output, NULL);
    }
    const char *after[2]; /* the records, after the job lines, which name the device */
    for (int d = 0; d < 2; d++) after[d] = records[d] && strchr(records[d], '\n') ? strchr(records[d], '\n') + 1 : "";
    int same = records[0] && records[1] && !strcmp(after[0], after[1]) && count_lines(records[0]) == m->n_prompts + 1;
    EXPECT(same && strstr(records[1], "\"device\":\"cuda\""), "a job: expected the CPU's %d records on cuda, and "
           "a job line naming cuda, got:\n%s\nthe CPU's:\n%s", m->n_prompts, records[1] ? records[1] : "(no file)",
           records[0] ? records[0] : "(no file)");
    printf("\n  %s, a job of %d prompts: the records %s", m->name, m->n_prompts, same ? "agree" : "differ");
    free(records[0]), free(records[1]);
    rm_tree(dir);
    free(dir);
}

/* ---------------------------------------------------------------------------------------------
 * Two pipeline stages
 * --------------------------------------------------------------------------------------------- */

/* Why the pipeline cannot run here ("" where it can). */
static const char *pipeline_missing(void) {
    static char why[256];
    static int checked;
    if (checked++) return why;
    setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 0); /* CI runs as root, which Open MPI refuses unless told */
    setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 0);
    arglist version = {.n = 0}, help = {.n = 0};
    arglist_add(&version, ARGS("mpirun", "--version"));
    arglist_add(&help, ARGS(flexgen_bin(), "--help"));
    run r = run_args(&version);
    if (r.rc != 0) snprintf(why, sizeof why, "no mpirun (install openmpi-bin)");
    run_free(&r);
    r = run_args(&help);
    if (!why[0] && !strstr(r.out, "this build: with MPI"))
        snprintf(why, sizeof why, "%s was built without MPI (no mpicc)", flexgen_bin());
    run_free(&r);
    return why;
}

/* mpirun -np 2 of the binary on cuda, with what each stage's environment needs under the
 * sanitizers (test_pipeline.c's: full stacks on malloc, Open MPI's leaks suppressed). */
static run two_stages(const char *const *args) {
    static char asan[4400], lsan[4400];
    const char *asan_options = getenv("ASAN_OPTIONS");
    char supp[4096];
    if (!realpath("tests/lsan-mpi.supp", supp)) snprintf(supp, sizeof supp, "tests/lsan-mpi.supp");
    snprintf(asan, sizeof asan, "ASAN_OPTIONS=%s%sfast_unwind_on_malloc=0", asan_options ? asan_options : "",
             asan_options && *asan_options ? ":" : "");
    snprintf(lsan, sizeof lsan, "LSAN_OPTIONS=suppressions=%s", supp);
    arglist a = {.n = 0};
    arglist_add(&a, ARGS("mpirun", "--oversubscribe", "--bind-to", "none", "--timeout", "120", "-np", "2", "-x",
                 "OMP_NUM_THREADS=1", "-x", asan, "-x", lsan, "-x", "OMPI_MCA_mca_base_component_disable_dlclose=1",
                 flexgen_bin(), "--device", "cuda"));
    arglist_add(&a, args);
    return run_args(&a);
}

/* Two stages on cuda against one process on the CPU, half of the weights, cache and activations on
 * the cpu tier: the logits, and on opt-kjv the text. */
static void expect_pipeline(const model *m, const char *dir) {
    char dump[4200];
    snprintf(dump, sizeof dump, "%s/stages.bin", dir);
    const char *const flags[] = {"--gpu-batch-size", "2", "--num-gpu-batches", "2", "--percent", "50", "50", "50",
                                 "50", "50", "50", "--offload-dir", dir, NULL};
    char *cpu_text = NULL;
    float *cpu = run_model(m, "cpu", flags, dir, &cpu_text);
    arglist a = {.n = 0};
    model_args(&a, m);
    arglist_add(&a, flags);
    arglist_add(&a, ARGS("--quiet", "--dump-logits", dump));
    run r = two_stages(a.v);
    int ok = r.rc == 0 && names_device(r.out, "cuda");
    EXPECT(ok, "%s, two stages on cuda: expected exit 0 and a report naming cuda, got %d: %s", m->name, r.rc, r.err);
    float *gpu = ok ? read_floats(dump, n_logits(m)) : NULL;
    if (cpu && gpu) expect_close(m, "two pipeline stages on cuda", cpu, gpu, B16, m->same_tokens);
    char *gpu_text = texts(r.out);
    if (m->same_tokens)
        EXPECT(cpu_text && !strcmp(cpu_text, gpu_text), "%s, two stages: the printed text differs: expected\n%s"
               "got\n%s", m->name, cpu_text, gpu_text);
    free(cpu), free(gpu), free(cpu_text), free(gpu_text);
    run_free(&r);
    unlink(dump);
}

static void test_pipeline(void) {
    if (!gpu_here()) return;
    if (*pipeline_missing()) {
        printf("\n  two stages on cuda skipped: %s", pipeline_missing());
        test_skip(pipeline_missing());
        return;
    }
    models_init();
    char *dir = make_temp_dir();
    expect_pipeline(&MODELS[KJV], dir);
    expect_pipeline(&MODELS[POST_LN], dir);
    EXPECT(dir_entries(dir) == 0, "two stages: expected the offload dir empty, %d files left", dir_entries(dir));
    rm_tree(dir);
    free(dir);
}

/* ---------------------------------------------------------------------------------------------
 * flexgen perplexity
 * --------------------------------------------------------------------------------------------- */

/* The excerpt's first `chars` characters, cut before a space, so that its tokens are the first of
 * the excerpt's: windows of 64 advancing by 16 over them are the excerpt's windows cut short, and
 * each of their logits is one that the reference (tests/fixtures/opt-kjv/reference.json) bounds. */
static void write_excerpt_head(const char *path, size_t chars) {
    char *text = slurp(fixture("opt-kjv/excerpt.txt"), NULL);
    CU_ASSERT_PTR_NOT_NULL_FATAL(text);
    size_t n = strlen(text) < chars ? strlen(text) : chars;
    while (n > 0 && text[n] != ' ') n--;
    FILE *f = fopen(path, "w");
    CU_ASSERT_PTR_NOT_NULL_FATAL(f);
    fwrite(text, 1, n, f);
    CU_ASSERT_EQUAL(fclose(f), 0);
    free(text);
}

/* The reference's max|logit| over the excerpt in windows of 64 advancing by 16. */
static double reference_max_logit(void) {
    char *text = slurp(fixture("opt-kjv/reference.json"), NULL);
    cJSON *o = cJSON_Parse(text), *setting;
    double max_abs = NAN;
    cJSON_ArrayForEach(setting, cJSON_GetObjectItemCaseSensitive(o, "perplexity")) {
        if (cJSON_GetNumberValue(cJSON_GetObjectItem(setting, "window")) == 64 &&
            cJSON_GetNumberValue(cJSON_GetObjectItem(setting, "stride")) == 16)
            max_abs = cJSON_GetNumberValue(cJSON_GetObjectItem(setting, "max_abs_logit"));
    }
    cJSON_Delete(o);
    free(text);
    CU_ASSERT_FATAL(max_abs > 0);
    return max_abs;
}

/* flexgen perplexity on `device`: its --json object (NULL, and a failure, unless it exits 0). */
static cJSON *perplexity_on(const char *device, const char *text, const char *const *extra) {
    arglist a = {.n = 0};
    arglist_add(&a, ARGS(flexgen_bin(), "perplexity", "--model", MODELS[KJV].dir, "--text", text, "--window", "64",
                 "--stride", "16", "--json", "--quiet", "--device", device));
    arglist_add(&a, extra);
    run r = run_args(&a);
    cJSON *o = r.rc == 0 ? cJSON_Parse(r.out) : NULL;
    int ok = o && names_device(r.out, device);
    EXPECT(ok, "flexgen perplexity on %s: expected exit 0 and a JSON object naming it, got %d: %s %s", device,
           r.rc, r.out, r.err);
    run_free(&r);
    if (!ok) cJSON_Delete(o);
    return ok ? o : NULL;
}

/* Each log-probability is a logit less a log-sum-exp, so it moves at most twice as far as the
 * largest logit does: with logits within B16 x max|logit|, |ln ppl_cuda - ln ppl_cpu| <= 2 B16
 * max|logit|, max|logit| the reference's. Prefill and decode; top-1 agreement printed. */
static void test_perplexity(void) {
    if (!gpu_here()) return;
    models_init();
    char *dir = make_temp_dir(), text[4200], top1[4200];
    snprintf(text, sizeof text, "%s", join(dir, "head.txt"));
    snprintf(top1, sizeof top1, "%s", join(dir, "top1.txt"));
    write_excerpt_head(text, 200);
    double bound = 2 * B16 * reference_max_logit();
    for (int decode = 0; decode < 2; decode++) {
        const char *mode = decode ? "--decode" : NULL;
        cJSON *cpu = perplexity_on("cpu", text, ARGS("--predictions", top1, mode));
        cJSON *gpu = perplexity_on("cuda", text, ARGS("--compare", top1, mode));
        if (cpu && gpu) {
            double a = number(cpu, "perplexity"), b = number(gpu, "perplexity");
            double scored = number(cpu, "scored_tokens"), windows = number(cpu, "windows");
            EXPECT(fabs(log(b / a)) <= bound && number(gpu, "scored_tokens") == scored && windows > 1,
                   "perplexity, %s: expected the CPU's %.6f within |ln ratio| %.3g over its %g tokens and %g "
                   "windows; got %.6f over %g tokens", decode ? "decode" : "prefill", a, bound, scored, windows,
                   b, number(gpu, "scored_tokens"));
            printf("\n  perplexity, %s: cpu %.6f, cuda %.6f, |ln ratio| %.2e (bound %.2e), %g tokens in %g windows, "
                   "top-1 agreement %.4f", decode ? "decode" : "prefill", a, b, fabs(log(b / a)), bound, scored,
                   windows, number(gpu, "top1_agreement"));
        }
        cJSON_Delete(cpu), cJSON_Delete(gpu);
    }
    rm_tree(dir);
    free(dir);
}

/* ---------------------------------------------------------------------------------------------
 * The compute capability check (the emulated GPU's capability is set by FLEXGEN_EMU_CC)
 * --------------------------------------------------------------------------------------------- */

#ifdef FLEXGEN_CUDA_EMU
static run run_with_capability(const char *cc, const char *device) {
    arglist a = {.n = 0};
    arglist_add(&a, ARGS(flexgen_bin(), "--model", MODELS[KJV].dir, "--prompt", "In the beginning", "--gen-len", "4",
                 "--device", device));
    setenv("FLEXGEN_EMU_CC", cc, 1);
    run r = run_args(&a);
    unsetenv("FLEXGEN_EMU_CC");
    return r;
}

/* The report's compute line, the one before its last (the blas line); "" if the last line is
 * not the blas line. */
static const char *compute_line(const char *s) {
    size_t n = strlen(s);
    if (n > 0 && s[n - 1] == '\n') n--;
    while (n > 0 && s[n - 1] != '\n') n--;
    if (strncmp(s + n, "blas: ", 6) || n == 0) return "";
    n--;
    while (n > 0 && s[n - 1] != '\n') n--;
    return s + n;
}

/* A GTX 10xx (6.1) has no code in this build: --device cuda exits 2 with one line naming its
 * capability and the built ones; auto runs on the CPU. A GPU newer than the build (12.0) runs the
 * PTX. */
static void test_compute_capability(void) {
    if (!gpu_here()) return;
    models_init();
    run r = run_with_capability("6.1", "cuda");
    EXPECT(r.rc == 2 && count_lines(r.err) == 1 && !strncmp(r.err, "flexgen: ", 9) &&
           strstr(r.err, "compute capability 6.1") && strstr(r.err, "7.5") && !r.out[0],
           "--device cuda on compute capability 6.1: expected exit 2 and one line naming 6.1 and 7.5, got %d: %s",
           r.rc, r.err);
    run_free(&r);
    r = run_with_capability("6.1", "auto");
    EXPECT(r.rc == 0 && !strncmp(compute_line(r.out), "compute:", 8) && strstr(compute_line(r.out), "device: cpu"),
           "--device auto on compute capability 6.1: expected exit 0 on the CPU, got %d, compute line '%s': %s", r.rc,
           compute_line(r.out), r.err);
    run_free(&r);
    r = run_with_capability("12.0", "cuda");
    EXPECT(r.rc == 0 && !strncmp(compute_line(r.out), "compute:", 8) && strstr(compute_line(r.out), "device: cuda"),
           "--device cuda on compute capability 12.0: expected exit 0 on cuda, got %d, compute line '%s': %s", r.rc,
           compute_line(r.out), r.err);
    run_free(&r);
}

/* ---------------------------------------------------------------------------------------------
 * Top-K on a card its blocks would not fill (the emulated GPU reporting an H200's multiprocessors)
 * --------------------------------------------------------------------------------------------- */

/* opt-kjv at 2 x 1, prompts of 200 tokens, --attn-sparsity 0.3, on an emulated GPU of `sms`
 * multiprocessors: its dumped logits (NULL, and a failure, unless it exits 0) and the blocks the
 * harness ran and the K and V bytes attention loaded (FLEXGEN_EMU_STATS). */
static float *run_top_k_on(const char *sms, const char *dir, long long *blocks, long long *kv_bytes) {
    char dump[4200], stats[4200];
    snprintf(dump, sizeof dump, "%s/sms%s.bin", dir, sms);
    snprintf(stats, sizeof stats, "%s/sms%s.txt", dir, sms);
    arglist a = {.n = 0};
    arglist_add(&a, ARGS(flexgen_bin(), "--model", MODELS[KJV].dir, "--device", "cuda",
                         "--gpu-batch-size", "2", "--num-gpu-batches", "1", "--prompt-len", "200", "--gen-len", "8",
                         "--attn-sparsity", "0.3", "--quiet", "--dump-logits", dump));
    setenv("FLEXGEN_EMU_SMS", sms, 1);
    setenv("FLEXGEN_EMU_STATS", stats, 1);
    run r = run_args(&a);
    unsetenv("FLEXGEN_EMU_SMS");
    unsetenv("FLEXGEN_EMU_STATS");
    EXPECT(r.rc == 0, "top-K on %s multiprocessors: exit %d: %s", sms, r.rc, r.err);
    size_t n = (size_t)2 * 8 * MODELS[KJV].vocab;
    float *logits = r.rc == 0 ? read_floats(dump, n) : NULL;
    char *line = slurp(stats, NULL);
    *blocks = *kv_bytes = -1;
    const char *at = line ? strstr(line, "blocks ") : NULL, *kv = line ? strstr(line, "kv_load_bytes ") : NULL;
    if (at) *blocks = atoll(at + 7);
    if (kv) *kv_bytes = atoll(kv + 14);
    free(line);
    run_free(&r);
    unlink(dump), unlink(stats);
    return logits;
}

/* With one multiprocessor reported a layer's top-K attention is a block a query head; with an
 * H200's 132 the split's spans score the keys first, in more blocks, and attention_kernel chooses:
 * the same logits, bit for bit, and the same K and V bytes loaded. */
static void test_top_k_split(void) {
    if (!gpu_here()) return;
    models_init();
    char *dir = make_temp_dir();
    long long blocks[2], kv_bytes[2];
    float *one = run_top_k_on("1", dir, &blocks[0], &kv_bytes[0]);
    float *card = run_top_k_on("132", dir, &blocks[1], &kv_bytes[1]);
    size_t n = (size_t)2 * 8 * MODELS[KJV].vocab;
    if (one && card)
        EXPECT(memcmp(one, card, n * sizeof(float)) == 0, "top-K split over spans on 132 multiprocessors: other "
               "logits than a block a query on 1");
    EXPECT(blocks[1] > blocks[0] && blocks[0] > 0 && kv_bytes[0] == kv_bytes[1] && kv_bytes[0] > 0, "top-K on 1 "
           "and 132 multiprocessors: %lld and %lld blocks, %lld and %lld bytes of K and V rows loaded; expected "
           "more blocks on 132 and the same bytes", blocks[0], blocks[1], kv_bytes[0], kv_bytes[1]);
    free(one), free(card);
    rmdir(dir);
    free(dir);
}
#endif

/* ---------------------------------------------------------------------------------------------
 * FLEXGEN_CUDA_PRODUCTS: decode's fp16 products timed (the default), cuBLAS's default, cublasLt's
 * first
 * --------------------------------------------------------------------------------------------- */

static run run_with_products(const char *mode) {
    arglist a = {.n = 0};
    arglist_add(&a, ARGS(flexgen_bin(), "--model", MODELS[KJV].dir, "--prompt", "In the beginning", "--gen-len", "6",
                 "--device", "cuda"));
    setenv("FLEXGEN_CUDA_PRODUCTS", mode, 1);
    run r = run_args(&a);
    unsetenv("FLEXGEN_CUDA_PRODUCTS");
    return r;
}

/* A mode it does not know: exit 2 and one line naming the variable and its value, nothing run.
 * Each mode it knows runs; opt-kjv's greedy text is the same in each (its logits keep the top two
 * tokens far apart, as the kjv step of gpu_laptop_run.sh relies on). */
static void test_products_mode(void) {
    if (!gpu_here()) return;
    models_init();
    run r = run_with_products("fastest");
    EXPECT(r.rc == 2 && count_lines(r.err) == 1 && strstr(r.err, "FLEXGEN_CUDA_PRODUCTS=fastest") && !r.out[0],
           "FLEXGEN_CUDA_PRODUCTS=fastest: expected exit 2 and one line naming it, got %d: %s", r.rc, r.err);
    run_free(&r);
    run timed = run_with_products("timed");
    CU_ASSERT_FATAL(timed.rc == 0);
    char *want = texts(timed.out);
    for (int i = 0; i < 2; i++) {
        const char *mode = i ? "cublaslt" : "cublas";
        r = run_with_products(mode);
        char *got = texts(r.out);
        EXPECT(r.rc == 0 && want[0] && !strcmp(got, want), "FLEXGEN_CUDA_PRODUCTS=%s: exit %d, text '%s' against "
               "timed's '%s': %s", mode, r.rc, got, want, r.err);
        free(got);
        run_free(&r);
    }
    free(want);
    run_free(&timed);
}

/* The CUDA backend's settings of the environment, misspelt: refused with exit 2 and one line
 * naming the variable and its value wherever CUDA may run (--device cuda, and auto, the default,
 * which would otherwise run on the CPU backend without a word), flexgen profile's hardware file
 * left unwritten; --device cpu reads none of them. Runs with a GPU (the emulated one) and
 * without. */
static void test_cuda_settings_misspelt(void) {
    static const char *const settings[][2] = {
        {"FLEXGEN_CUDA_PRODUCTS", "fastest"}, {"FLEXGEN_CUDA_SYNC", "false"}, {"FLEXGEN_CUDA_GRAPHS", "off"}};
    static const char *const devices[] = {"auto", "cuda", "cpu"};
    char *dir = make_temp_dir(), hw[4200], want[64];
    snprintf(hw, sizeof hw, "%s/hw.json", dir);
    for (size_t i = 0; i < sizeof settings / sizeof *settings; i++) {
        setenv(settings[i][0], settings[i][1], 1);
        snprintf(want, sizeof want, "%s=%s", settings[i][0], settings[i][1]);
        for (int d = 0; d < 3; d++) {
            arglist a = {.n = 0};
            arglist_add(&a, ARGS(flexgen_bin(), "--model", fixture("opt-tiny"), "--prompt-len", "4", "--gen-len", "2",
                                 "--gpu-batch-size", "2", "--num-gpu-batches", "1", "--device", devices[d], "--json"));
            run r = run_args(&a);
            int refused = r.rc == 2 && count_lines(r.err) == 1 && strstr(r.err, want) && !r.out[0];
            EXPECT(d == 2 ? r.rc == 0 : refused, "%s, --device %s: expected %s, got exit %d: %s", want, devices[d],
                   d == 2 ? "a run on the CPU" : "exit 2 and one line naming it", r.rc, r.err);
            run_free(&r);
        }
        arglist a = {.n = 0};
        arglist_add(&a, ARGS(flexgen_bin(), "profile", "--device", "auto", "--offload-dir", dir, "--out", hw));
        run r = run_args(&a);
        EXPECT(r.rc == 2 && strstr(r.err, want) && access(hw, F_OK) != 0, "%s, flexgen profile --device auto: expected "
               "exit 2 naming it and no %s, got exit %d: %s", want, hw, r.rc, r.err);
        run_free(&r);
        unsetenv(settings[i][0]);
    }
    rm_tree(dir);
    free(dir);
}

void add_gpu_cli_tests(void) {
    CU_pSuite s = CU_get_suite("gpu");
    CU_add_test(s, "the CLI on CUDA against the CPU: opt-kjv over placements and section 5", test_trained_model);
    CU_add_test(s, "the CLI on CUDA against the CPU: pre-LN fixture", test_pre_ln);
    CU_add_test(s, "the CLI on CUDA against the CPU: post-LN fixture", test_post_ln);
    CU_add_test(s, "the CLI on CUDA against the CPU: the paged cache with --refill", test_refill);
    CU_add_test(s, "the CLI on CUDA against the CPU: a batch job's records", test_job);
    CU_add_test(s, "the CLI on CUDA against the CPU: two pipeline stages", test_pipeline);
    CU_add_test(s, "the CLI on CUDA against the CPU: flexgen perplexity", test_perplexity);
    CU_add_test(s, "FLEXGEN_CUDA_PRODUCTS: a mode it does not know refused; each it knows, the same text",
                test_products_mode);
    CU_add_test(s, "FLEXGEN_CUDA_* misspelt: refused wherever CUDA may run, --device auto too",
                test_cuda_settings_misspelt);
#ifdef FLEXGEN_CUDA_EMU
    CU_add_test(s, "the compute capability check: 6.1 refused, auto on the CPU, 12.0 runs", test_compute_capability);
    CU_add_test(s, "top-K on 132 multiprocessors, split over spans: the logits of a block a query", test_top_k_split);
#endif
}
