/* test_compress.c: §5's compression end to end. With --compress-weight the runtime must compute
 * exactly what the plain forward pass computes on the weights' 4-bit bytes (compression changes
 * the weights' values and nothing else), in every placement; and the result stays close to
 * fp16's. */
#define _GNU_SOURCE /* qsort_r */
#include "tests.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* N_SEQ prompts, or SCHEME_SEQ where prefill's products must take more rows than
 * MATMUL_DECODE_ROWS (the fixtures' longest prompts have 12 to 14 tokens) */
enum { N_SEQ = 5, SCHEME_SEQ = 6, GEN = 6 };

/* Greedy generation straight through the CPU's embed, layer and output of the model's family, one
 * batch of all the prompts, the KV cache in one fp16 array: the forward pass with no runtime around it. */
static void plain_generate(const model_weights *w, const fixture_prompts *f, int *tokens, float *logits) {
    const model_config *c = &w->cfg;
    int padded = 0, V = c->vocab;
    for (int b = 0; b < f->n; b++) padded = f->lens[b] > padded ? f->lens[b] : padded;
    int max_len = padded + GEN;
    const fg_forward *fw = &fg_cpu_backend.forward[c->family];
    size_t h = (size_t)c->hidden, rows = (size_t)max_len * (h > (size_t)kv_width(c) ? h : (size_t)kv_width(c));
    gpu_batch gb;
    model_workspace ws;
    char err[FG_ERR_LEN];
    CU_ASSERT_EQUAL_FATAL(gpu_batch_init(&gb, f->n, max_len, padded, err), 0);
    CU_ASSERT_EQUAL_FATAL(model_workspace_init(&ws, c, (size_t)f->n * padded, padded, max_len, err), 0);
    float *x = malloc((size_t)f->n * padded * h * sizeof *x), *step = malloc((size_t)f->n * V * sizeof *step);
    fp16 *cache = malloc((size_t)c->n_layers * 2 * f->n * rows * sizeof *cache);
    gb.x = x;
    gb.n_new = padded;
    for (int b = 0; b < f->n; b++) {
        gb.pad[b] = padded - f->lens[b];
        for (int t = 0; t < padded; t++)
            gb.tokens[b * padded + t] = t < gb.pad[b] ? OPT_PAD_ID : f->prompts[b][t - gb.pad[b]];
    }
    for (int i = 0; i < GEN; i++) {
        fw->embed(w, &gb, &ws);
        for (int l = 0; l < c->n_layers; l++) {
            for (int b = 0; b < f->n; b++) {
                gb.k[b] = cache + (((size_t)l * 2 + 0) * f->n + b) * rows;
                gb.v[b] = cache + (((size_t)l * 2 + 1) * f->n + b) * rows;
            }
            fw->layer(w, l, &gb, &ws);
        }
        fw->output(w, &gb, &ws, step);
        gpu_batch_advance(&gb);
        for (int b = 0; b < f->n; b++) {
            const float *row = step + (size_t)b * V;
            int best = 0;
            for (int v = 1; v < V; v++) best = row[v] > row[best] ? v : best;
            tokens[b * GEN + i] = gb.tokens[b] = best;
            memcpy(logits + ((size_t)b * GEN + i) * V, row, V * sizeof *row);
        }
    }
    free(x);
    free(step);
    free(cache);
    model_workspace_free(&ws);
    gpu_batch_free(&gb);
}

/* A tensor's fp16 values replaced, in place, by their 4-bit bytes (which take less room). */
static void compress_in_place(const fp16 *first, size_t outer, size_t len, size_t inner) {
    size_t n = outer * len * inner;
    float *values = malloc(n * sizeof *values);
    uint8_t *q = malloc(q4_bytes(outer, len, inner));
    fp16_to_fp32_n(first, values, n);
    q4_compress(values, outer, len, inner, q);
    memcpy((fp16 *)first, q, q4_bytes(outer, len, inner));
    free(values);
    free(q);
}

/* Every matrix of w (embeddings included) replaced by its 4-bit bytes, grouped as the runtime
 * groups it (the weight table's group shapes): the view the CPU's products read with q4. */
static void compress_weights(model_weights *w) {
    model_weights view;
    opt_layout l;
    char err[FG_ERR_LEN];
    CU_ASSERT_EQUAL_FATAL(opt_layout_init(&l, &view, &w->cfg, 0, err), 0);
    for (int i = 0; i < l.n_tensors; i++) {
        const opt_tensor *t = &l.tensors[i];
        const fp16 *first;
        size_t rs, cs;
        if (t->group_len == 0 || t->tied_to >= 0) continue;
        CU_ASSERT_EQUAL_FATAL(opt_weight_locate(w, t->name, &first, &rs, &cs), 0);
        compress_in_place(first, t->group_outer, t->group_len, t->group_inner);
    }
    if (w->lm_head != w->embed_tokens) compress_in_place(w->lm_head, 1, (size_t)w->cfg.vocab, (size_t)w->cfg.word_dim);
    w->q4 = 1;
    opt_layout_free(&l);
}

/* Dummy weights made straight in their 4-bit stored form (q4_compress_dummy) are the bytes that
 * compressing the fp16 dummy values gives (q4_compress_fp16 of opt_tensor_fill's), for every
 * grouped tensor: OPT's q|k|v of 3 parts, opt-350m's projections and rows of 20 (groups of 64
 * across fewer), a vocabulary not a multiple of 64; LLaMA's untied lm_head and grouped k, v. */
static void test_dummy_q4(void) {
    model_config configs[2] = {OPT_SHAPE("dummy-q4", 2, 96, 3, 200, 130, 70, 20, 0)};
    char err[FG_ERR_LEN];
    CU_ASSERT_EQUAL_FATAL(model_config_by_name("tinyllama-1.1b", &configs[1], err), 0);
    configs[1].n_layers = 1; /* its shapes, one layer of them */
    for (int c = 0; c < 2; c++) {
        model_weights view;
        opt_layout l;
        CU_ASSERT_EQUAL_FATAL(opt_layout_init(&l, &view, &configs[c], 0, err), 0);
        int grouped = 0;
        for (int i = 0; i < l.n_tensors; i++) {
            const opt_tensor *t = &l.tensors[i];
            if (t->group_len == 0 || t->tied_to >= 0) continue;
            size_t bytes = q4_bytes(t->group_outer, t->group_len, t->group_inner);
            fp16 *values = malloc(t->count * sizeof *values);
            uint8_t *want = malloc(bytes), *got = malloc(bytes);
            weight_source src = {NULL, 5};
            CU_ASSERT_EQUAL_FATAL(opt_tensor_fill(&l, i, &src, NULL, values, err), 0);
            CU_ASSERT_EQUAL_FATAL(q4_compress_fp16(values, t->group_outer, t->group_len, t->group_inner, want), 0);
            memset(got, 0xa5, bytes);
            CU_ASSERT_EQUAL_FATAL(q4_compress_dummy(&l, i, 5, got), 0);
            size_t at = 0;
            while (at < bytes && got[at] == want[at]) at++;
            EXPECT(at == bytes, "%s, %s ([%zu][%zu][%zu], %d part(s)): byte %zu of %zu differs from the "
                   "compressed fp16 values' (0x%02x, expected 0x%02x)", configs[c].name, t->name, t->group_outer,
                   t->group_len, t->group_inner, t->n_specs, at, bytes, at < bytes ? got[at] : 0,
                   at < bytes ? want[at] : 0);
            grouped++;
            free(values);
            free(want);
            free(got);
        }
        CU_ASSERT(grouped >= 6);
        opt_layout_free(&l);
    }
}

static int runtime_generate(const fixture_prompts *f, const fg_policy *p, int *tokens, float *logits) {
    return generate_with(f->dir, NULL, 0, p, GEN, f->n, (int *const *)f->prompts, f->lens, tokens,
                         logits, NULL, NULL);
}

static fg_policy policy_of(int gbs, int ngb, fg_percent percent) {
    fg_policy p = fg_default_policy();
    p.gpu_batch_size = gbs;
    p.num_gpu_batches = ngb;
    p.percent = percent;
    return p;
}

static fg_policy compressed(int gbs, int ngb, fg_percent percent) {
    fg_policy p = policy_of(gbs, ngb, percent);
    p.compress_weight = 1;
    return p;
}

/* The plain pass on the fixture's weights, compressed to 4-bit (q4) or not, multiplied as products
 * says (fg_products). */
static void plain_with(const fixture_prompts *f, int q4, int products, int *tokens, float *logits) {
    model_weights w;
    char err[FG_ERR_LEN];
    CU_ASSERT_EQUAL_FATAL(model_weights_load(f->dir, &w, err), 0);
    if (q4) compress_weights(&w);
    w.products = products;
    plain_generate(&w, f, tokens, logits);
    model_weights_free(&w);
}

/* The plain pass on the fixture's weights compressed to 4-bit, §5's products or (int8) int8.c's. */
static void plain_compressed(const fixture_prompts *f, int int8, int *tokens, float *logits) {
    plain_with(f, 1, int8 ? PRODUCTS_INT8 : PRODUCTS_FP32, tokens, logits);
}

/* The relative RMS of the first step's logits of a against ref (the same n_seq inputs in both). */
static double first_step_rms(const float *a, const float *ref, int n_seq, int vocab) {
    double diff = 0, norm = 0;
    for (int b = 0; b < n_seq; b++)
        for (int v = 0; v < vocab; v++) {
            size_t at = ((size_t)b * GEN) * vocab + v;
            diff += (a[at] - ref[at]) * (a[at] - ref[at]);
            norm += ref[at] * ref[at];
        }
    return sqrt(diff / norm);
}

static void check_weights(const char *name) {
    fixture_prompts f;
    fixture_prompts_open(name, N_SEQ, &f);
    size_t n = (size_t)N_SEQ * GEN * f.cfg.vocab;
    float *plain = malloc(n * sizeof *plain), *fp16_run = malloc(n * sizeof *fp16_run), *r = malloc(n * sizeof *r);
    int plain_tokens[N_SEQ * GEN], tokens[N_SEQ * GEN];
    plain_compressed(&f, 0, plain_tokens, plain);

    /* one batch of all prompts, as the plain pass: the same numbers, bit for bit */
    static const fg_percent all_gpu = {100, 0, 100, 0, 100, 0};
    fg_policy p = compressed(N_SEQ, 1, all_gpu);
    CU_ASSERT_EQUAL_FATAL(runtime_generate(&f, &p, tokens, r), 0);
    CU_ASSERT_EQUAL(memcmp(tokens, plain_tokens, sizeof tokens), 0);
    CU_ASSERT_EQUAL(memcmp(r, plain, n * sizeof *r), 0);

    /* a tier holds 36 bytes per 64 values of a matrix instead of 128 (plus fp16 vectors), and
     * that much moves: weights on cpu (the disk tier rounds each tensor up to pages), then disk */
    static const fg_percent on_cpu = {0, 100, 100, 0, 100, 0}, on_disk = {0, 0, 100, 0, 100, 0};
    for (int tier = TIER_CPU; tier <= TIER_DISK; tier++) {
        fg_stats st16, st4;
        p = compressed(N_SEQ, 1, tier == TIER_CPU ? on_cpu : on_disk);
        CU_ASSERT_EQUAL(generate_with(f.dir, NULL, 0, &p, GEN, N_SEQ, (int *const *)f.prompts, f.lens, tokens, r, &st4, NULL), 0);
        p.compress_weight = 0;
        CU_ASSERT_EQUAL(generate_with(f.dir, NULL, 0, &p, GEN, N_SEQ, (int *const *)f.prompts, f.lens, tokens, r, &st16, NULL), 0);
        if (tier == TIER_CPU) CU_ASSERT(st4.peak[TIER_CPU] < 0.33 * st16.peak[TIER_CPU]);
        fg_link link = tier == TIER_CPU ? LINK_CPU_TO_GPU : LINK_DISK_TO_CPU;
        CU_ASSERT(st4.link_bytes[link] < 0.33 * st16.link_bytes[link]);
    }

    /* compressed weights on cpu, disk, split: still the same bits */
    static const fg_percent placements[] = {{0, 100, 100, 0, 100, 0}, {0, 0, 100, 0, 100, 0},
                                        {30, 30, 100, 0, 100, 0}, {0, 0, 0, 0, 0, 0}};
    for (size_t k = 0; k < sizeof placements / sizeof *placements; k++) {
        for (int overlap = 0; overlap < 2; overlap++) {
            p = compressed(N_SEQ, 1, placements[k]);
            p.overlap = overlap;
            CU_ASSERT_EQUAL(runtime_generate(&f, &p, tokens, r), 0);
            CU_ASSERT_EQUAL(memcmp(r, plain, n * sizeof *r), 0);
        }
    }

    /* against fp16 weights. The fixtures' matrices are N(0, 0.02) (HF's init): the 64 values of
     * a group span about 4.8 sigma, so the 16 levels are 0.32 sigma apart and the rounding noise
     * is 0.32 / sqrt(12) = 9% of a weight's size, independent across weights. Each matrix on the
     * path to a logit (embedding, the layers' products, project_in/out for 350m, lm_head) adds
     * about that much relative noise, in quadrature: sqrt(6) x 9% = 0.23 for 350m's path. We
     * require the first step's logits to move by at most 0.35 in relative RMS. */
    p = policy_of(N_SEQ, 1, all_gpu);
    CU_ASSERT_EQUAL_FATAL(runtime_generate(&f, &p, tokens, fp16_run), 0);
    double rms = first_step_rms(plain, fp16_run, f.n, f.cfg.vocab);
    fprintf(stderr, "[%s: rms change %.3f] ", name, rms);
    CU_ASSERT(rms <= 0.35);
    free(plain);
    free(fp16_run);
    free(r);
    fixture_prompts_close(&f);
}

/* Dummy weights of cfg (seed 5) on a runtime of policy p, loaded into their homes. */
static fg_model *loaded_dummy(const model_config *cfg, const fg_policy *p, fg_runtime **rt) {
    char err[FG_ERR_LEN];
    fg_model *m;
    CU_ASSERT_EQUAL_FATAL(fg_runtime_open(p, rt, err), 0);
    CU_ASSERT_EQUAL_FATAL(fg_model_open_dummy(*rt, cfg, 5, &m, err), 0);
    CU_ASSERT_EQUAL_FATAL(fg_model_load(m, err), 0);
    return m;
}

/* W[in][3 h]'s q, k and v ([in][h] each) compressed each on its own and decoded: FlexGen's rule. */
static void round_trip_projections(const fp16 *w, size_t in, size_t h, float *out) {
    float *part = malloc(in * h * sizeof *part);
    uint8_t *q = malloc(q4_bytes(in, h, 1));
    for (size_t j = 0; j < 3; j++) {
        for (size_t k = 0; k < in * h; k++) part[k] = fp16_to_fp32(w[k / h * 3 * h + j * h + k % h]);
        q4_compress(part, in, h, 1, q);
        q4_decompress(q, in, h, 1, part);
        for (size_t k = 0; k < in * h; k++) out[k / h * 3 * h + j * h + k % h] = part[k];
    }
    free(part);
    free(q);
}

/* FlexGen compresses w_q, w_k and w_v each on its own. With hidden 96 (3 heads of 32), groups of
 * the fused q|k|v taken as one would cross from q into k and from k into v. Each layer's stored
 * 4-bit q|k|v decodes to the round trip of each projection alone; and the runtime computes the
 * plain pass on those bytes, with the weights in every tier. */
static void test_qkv_groups(void) {
    static const model_config cfg = OPT_SHAPE("qkv96", 2, 96, 3, 384, 512, 128, 96, 1);
    static const fg_percent all_gpu = {100, 0, 100, 0, 100, 0};
    size_t h = (size_t)cfg.hidden, n = 3 * h * h;
    fg_policy p = compressed(N_SEQ, 1, all_gpu), p16 = policy_of(N_SEQ, 1, all_gpu);
    fg_runtime *rt, *rt16;
    fg_model *m = loaded_dummy(&cfg, &p, &rt), *m16 = loaded_dummy(&cfg, &p16, &rt16);
    float *want = malloc(n * sizeof *want), *got = malloc(n * sizeof *got);
    int layers = 0;
    for (int i = 0; i < m->layout.n_tensors; i++) {
        const opt_tensor *t = &m->layout.tensors[i];
        if (t->n_specs != 3 || t->group_len == 0) continue;
        round_trip_projections(m16->homes[i].gpu, h, h, want);
        q4_decompress(m->homes[i].stored, t->group_outer, t->group_len, t->group_inner, got);
        size_t differ = 0;
        for (size_t e = 0; e < n; e++) differ += got[e] != want[e];
        EXPECT(differ == 0, "layer %d's q|k|v, hidden 96: %zu of %zu 4-bit values differ from w_q, w_k and "
               "w_v compressed each on its own", layers, differ, n);
        layers++;
    }
    CU_ASSERT_EQUAL(layers, cfg.n_layers);
    fixture_prompts f;
    fixture_prompts_open("opt-tiny", N_SEQ, &f);
    size_t nl = (size_t)N_SEQ * GEN * cfg.vocab;
    float *plain = malloc(nl * sizeof *plain), *r = malloc(nl * sizeof *r);
    int plain_tokens[N_SEQ * GEN], tokens[N_SEQ * GEN];
    plain_generate(&m->view, &f, plain_tokens, plain);
    static const fg_percent placements[] = {{100, 0, 100, 0, 100, 0}, {0, 100, 100, 0, 100, 0}, {30, 30, 100, 0, 100, 0}};
    char *dir = make_temp_dir(); /* the dummy-weight file of the disk tier */
    for (size_t k = 0; k < sizeof placements / sizeof *placements; k++) {
        fg_policy pk = compressed(N_SEQ, 1, placements[k]);
        pk.weight_dir = pk.offload_dir = dir;
        CU_ASSERT_EQUAL(generate_with(NULL, &cfg, 5, &pk, GEN, N_SEQ, (int *const *)f.prompts, f.lens, tokens, r, NULL, NULL), 0);
        EXPECT(!memcmp(r, plain, nl * sizeof *r), "hidden 96, 4-bit weights %d%% gpu, %d%% cpu: the runtime's "
               "logits differ from the plain pass on the same bytes", placements[k].wg, placements[k].wc);
    }
    rm_tree(dir);
    free(dir);
    fixture_prompts_close(&f);
    free(plain), free(r), free(want), free(got);
    fg_model_close(m), fg_model_close(m16);
    fg_runtime_close(rt), fg_runtime_close(rt16);
}

/* An opt-in scheme of the CPU's products (fg_products): the runtime computes the plain pass with
 * the same scheme, bit for bit, with the weights on every tier, overlapped or not; and the first
 * step's logits (prefill's, above MATMUL_DECODE_ROWS rows) move from fp32 products of the
 * same weights by more than 0 (the flag takes effect) and at most max_rms in relative RMS.
 *
 * --int8-activations (support/int8.c), on 4-bit weights: each activation a product reads is
 * rounded by at most 1/254 of its row's (decode: its block's) largest, each widened weight by
 * 1/254 of its column's, a few products in a row on a logit's path, in quadrature: a few percent
 * at most. max_rms 0.05: a seventh of what 4-bit weights are allowed against fp16 (measured:
 * 0.029 pre-LN, 0.042 post-LN).
 * --bf16-prefill (support/matmul.c), on fp16 weights: each operand moves by at most 2^-9 of
 * itself (RMS about 2^-9 / sqrt 3, 0.0011), a few products in a row: max_rms 0.01. */
static void check_scheme(const char *name, int products, double max_rms) {
    const char *flag = products == PRODUCTS_INT8 ? "int8 activations" : "bf16 prefill";
    int q4 = products == PRODUCTS_INT8;
    fixture_prompts f;
    fixture_prompts_open(name, SCHEME_SEQ, &f);
    size_t n = (size_t)SCHEME_SEQ * GEN * f.cfg.vocab;
    float *plain = malloc(n * sizeof *plain), *fp32_run = malloc(n * sizeof *fp32_run), *r = malloc(n * sizeof *r);
    int plain_tokens[SCHEME_SEQ * GEN], tokens[SCHEME_SEQ * GEN];
    plain_with(&f, q4, products, plain_tokens, plain);
    plain_with(&f, q4, PRODUCTS_FP32, plain_tokens, fp32_run);
    static const fg_percent placements[] = {{100, 0, 100, 0, 100, 0}, {0, 100, 100, 0, 100, 0},
                                            {0, 0, 100, 0, 100, 0}, {30, 30, 100, 0, 100, 0}};
    for (size_t k = 0; k < sizeof placements / sizeof *placements; k++)
        for (int overlap = 0; overlap < 2; overlap++) {
            if (SANITIZERS_ONE_DIAGONAL && overlap != (int)k % 2) continue;
            fg_policy p = policy_of(SCHEME_SEQ, 1, placements[k]);
            p.compress_weight = q4;
            p.overlap = overlap;
            p.int8_activations = products == PRODUCTS_INT8;
            p.bf16_prefill = products == PRODUCTS_BF16_PREFILL;
            CU_ASSERT_EQUAL(runtime_generate(&f, &p, tokens, r), 0);
            EXPECT(!memcmp(r, plain, n * sizeof *r), "%s, %s, weights %d%% gpu %d%% cpu, overlap %d: "
                   "the runtime's logits differ from the plain pass's", name, flag, placements[k].wg,
                   placements[k].wc, overlap);
        }
    double rms = first_step_rms(plain, fp32_run, f.n, f.cfg.vocab);
    EXPECT(rms > 0 && rms <= max_rms, "%s: %s moved the first step's logits by %.4f in relative RMS from fp32 "
           "products; expected more than 0 and at most %.2f", name, flag, rms, max_rms);
    fprintf(stderr, "[%s: rms change %.4f] ", name, rms);
    free(plain);
    free(fp32_run);
    free(r);
    fixture_prompts_close(&f);
}

/* The relative RMS of a's logits from ref's over every (sequence, step) whose tokens so far agree
 * in both runs (the first step always: prefill's; then decode's, while the two pick alike). */
static double agreeing_rms(const float *a, const float *ref, const int *a_tokens, const int *ref_tokens,
                           int n_seq, int vocab, int first_step, int *rows) {
    double diff = 0, norm = 0;
    *rows = 0;
    for (int b = 0; b < n_seq; b++)
        for (int t = first_step; t < GEN; t++) {
            int agree = 1;
            for (int u = 0; u < t; u++) agree &= a_tokens[b * GEN + u] == ref_tokens[b * GEN + u];
            if (!agree) break;
            ++*rows;
            for (int v = 0; v < vocab; v++) {
                size_t at = ((size_t)b * GEN + t) * vocab + v;
                diff += (a[at] - ref[at]) * (a[at] - ref[at]);
                norm += ref[at] * ref[at];
            }
        }
    return *rows ? sqrt(diff / norm) : 0;
}

/* --int8-activations where a few hidden dimensions carry activations 24 to 56 times the rest
 * (tests/fixtures/opt-outlier; scripts/make_reference.py says how HF's model was made so; OPT's
 * models from 6.7B up have such dimensions, LLM.int8, Dettmers et al. 2022). Rounding each row of
 * x to int8 with one scale (prefill), or each block of 64 (decode), gives the rest of the row the
 * steps of its largest value: they keep about 127 / 56, 2 to 5 levels, where rows without
 * outliers keep most of 127. The logits' move from fp32 products of the same 4-bit weights,
 * prefill's step and decode's (while the tokens agree), in relative RMS, against opt-tiny's (no
 * outliers): measured 0.166 and 0.173 here, 0.030 and 0.023 there (docs/DESIGN.md says what this
 * means for the real models). Held: more than twice opt-tiny's move (the outliers' cost is real),
 * and at most 0.2 (what was measured, with room for fp32's other orders of summing). */
static void test_int8_outliers(void) {
    double rms[2][2]; /* [fixture][prefill, decode] */
    static const char *const names[] = {"opt-tiny", "opt-outlier"};
    for (int i = 0; i < 2; i++) {
        fixture_prompts f;
        fixture_prompts_open(names[i], SCHEME_SEQ, &f);
        size_t n = (size_t)SCHEME_SEQ * GEN * f.cfg.vocab;
        float *int8_run = malloc(n * sizeof *int8_run), *fp32_run = malloc(n * sizeof *fp32_run);
        int int8_tokens[SCHEME_SEQ * GEN], fp32_tokens[SCHEME_SEQ * GEN];
        plain_with(&f, 1, PRODUCTS_INT8, int8_tokens, int8_run);
        plain_with(&f, 1, PRODUCTS_FP32, fp32_tokens, fp32_run);
        int decode_rows;
        rms[i][0] = first_step_rms(int8_run, fp32_run, f.n, f.cfg.vocab);
        rms[i][1] = agreeing_rms(int8_run, fp32_run, int8_tokens, fp32_tokens, f.n, f.cfg.vocab, 1, &decode_rows);
        fprintf(stderr, "[%s: int8 against fp32 products, rms %.4f prefill, %.4f decode over %d steps] ", names[i],
                rms[i][0], rms[i][1], decode_rows);
        EXPECT(decode_rows >= f.n, "%s: only %d decode steps agree in tokens; too few to measure", names[i],
               decode_rows);
        free(int8_run);
        free(fp32_run);
        fixture_prompts_close(&f);
    }
    for (int step = 0; step < 2; step++)
        EXPECT(rms[1][step] > 2 * rms[0][step] && rms[1][step] <= 0.2,
               "%s: int8 activations moved opt-outlier's logits by %.4f in relative RMS, opt-tiny's by %.4f; "
               "expected more than twice opt-tiny's and at most 0.2", step ? "decode" : "prefill", rms[1][step],
               rms[0][step]);
}

static void test_int8_pre_ln(void) { check_scheme("opt-tiny", PRODUCTS_INT8, 0.05); }
static void test_int8_post_ln(void) { check_scheme("opt-tiny-350m", PRODUCTS_INT8, 0.05); }

/* --int8-activations with the 4-bit weights resident on the gpu tier: W's int8 columns are made
 * once where the plan has room for them beside everything else, counted on the tier, and not
 * where it has no room for them (the products then make them per call); the runtime's logits are
 * the plain pass's bits either way. */
static void test_int8_columns_room(void) {
    static const fg_percent all_gpu = {100, 0, 100, 0, 100, 0};
    fixture_prompts f;
    fixture_prompts_open("opt-tiny", SCHEME_SEQ, &f);
    size_t n = (size_t)SCHEME_SEQ * GEN * f.cfg.vocab;
    float *plain = malloc(n * sizeof *plain), *r = malloc(n * sizeof *r);
    int plain_tokens[SCHEME_SEQ * GEN], tokens[SCHEME_SEQ * GEN], longest = 0;
    for (int b = 0; b < f.n; b++) longest = f.lens[b] > longest ? f.lens[b] : longest;
    plain_compressed(&f, 1, plain_tokens, plain);
    double without = 0, kept_bytes = 0; /* the plan's gpu tier without the columns; theirs */
    double peak[3];
    /* room: as much as the machine has; less than the columns need; just what they need */
    for (int room = 0; room < 3; room++) {
        fg_policy p = compressed(SCHEME_SEQ, 1, all_gpu);
        p.int8_activations = 1;
        if (room) p.capacity[TIER_GPU] = without + (room == 1 ? kept_bytes / 2 : 2 * kept_bytes);
        char err[FG_ERR_LEN];
        fg_runtime *rt;
        fg_model *m;
        gen_timing t;
        gen_options opt = {.gen_len = GEN, .top_p = 1};
        CU_ASSERT_EQUAL_FATAL(fg_runtime_open(&p, &rt, err), 0);
        CU_ASSERT_EQUAL_FATAL(fg_model_open(rt, f.dir, 0, &m, err), 0);
        double total[N_TIERS], weights[N_TIERS];
        fg_plan_bytes(m, f.n, f.lens, longest, GEN, total, weights);
        if (room == 0) without = total[TIER_GPU];
        int rc = generate(m, &opt, f.n, (int *const *)f.prompts, f.lens, tokens, r, &t, err);
        fg_stats st;
        fg_runtime_stats(rt, &st);
        if (room == 0) kept_bytes = m->int8_columns_bytes;
        int want_kept = room != 1;
        EXPECT(rc == 0 && (m->int8_columns.n > 0) == want_kept && (m->int8_columns_bytes > 0) == want_kept,
               "--int8-activations, gpu tier %s: expected W's int8 columns %s, got exit %d and %d of them (%.0f "
               "bytes): %s", room == 0 ? "as the machine's" : room == 1 ? "without room for the int8 columns"
               : "with room for them", want_kept ? "kept" : "made per call", rc, m->int8_columns.n,
               m->int8_columns_bytes, err);
        peak[room] = st.peak[TIER_GPU];
        EXPECT(st.peak[TIER_GPU] <= st.capacity[TIER_GPU], "--int8-activations, room %d: the gpu tier's peak %.0f "
               "over its capacity %.0f", room, st.peak[TIER_GPU], st.capacity[TIER_GPU]);
        EXPECT(!memcmp(r, plain, n * sizeof *r), "--int8-activations, room %d: the runtime's logits differ from the "
               "plain pass's", room);
        fg_model_close(m);
        fg_runtime_close(rt);
    }
    EXPECT(peak[0] == peak[1] + kept_bytes && peak[2] == peak[0], "--int8-activations: the gpu tier's peaks %.0f "
           "(int8 columns kept), %.0f (made per call), %.0f (kept): the columns' %.0f bytes not counted once", peak[0],
           peak[1], peak[2], kept_bytes);
    free(plain);
    free(r);
    fixture_prompts_close(&f);
}

static void test_bf16_pre_ln(void) { check_scheme("opt-tiny", PRODUCTS_BF16_PREFILL, 0.01); }
static void test_bf16_post_ln(void) { check_scheme("opt-tiny-350m", PRODUCTS_BF16_PREFILL, 0.01); }

static void test_weights_pre_ln(void) { check_weights("opt-tiny"); }
static void test_weights_post_ln(void) { check_weights("opt-tiny-350m"); }
/* The LLaMA family: q, k, v, gate, up and down each grouped on its own, an untied lm_head. */
static void test_weights_llama(void) { check_weights("llama-tiny-gqa4-linear"); }
static void test_int8_llama(void) { check_scheme("llama-tiny-mqa-bias", PRODUCTS_INT8, 0.05); }

/* Mistral's k and v are 16 wide: a 4-bit group of 64 holds such a row in 36 bytes, more than its
 * 32 of fp16, and staged for the CPU's products (which read the 4-bit bytes) it must not run into
 * the next tensor: weights on cpu, on disk and split give the bits of weights on the gpu tier. */
static void test_weights_narrow_rows(void) {
    fixture_prompts f;
    fixture_prompts_open("mistral-tiny-gqa8", N_SEQ, &f);
    size_t n = (size_t)N_SEQ * GEN * f.cfg.vocab;
    float *ref = malloc(n * sizeof *ref), *r = malloc(n * sizeof *r);
    int ref_tokens[N_SEQ * GEN], tokens[N_SEQ * GEN];
    static const fg_percent placements[] = {{100, 0, 100, 0, 100, 0}, {0, 100, 100, 0, 100, 0},
                                            {0, 0, 100, 0, 100, 0}, {30, 30, 100, 0, 100, 0}};
    for (size_t k = 0; k < sizeof placements / sizeof *placements; k++) {
        fg_policy p = compressed(2, 2, placements[k]);
        CU_ASSERT_EQUAL_FATAL(runtime_generate(&f, &p, k ? tokens : ref_tokens, k ? r : ref), 0);
        if (k) CU_ASSERT(!memcmp(tokens, ref_tokens, sizeof tokens) && !memcmp(r, ref, n * sizeof *r));
    }
    for (size_t i = 0; i < n; i++) CU_ASSERT_FATAL(isfinite(ref[i]));
    free(ref), free(r);
    fixture_prompts_close(&f);
}

/* ---- the KV cache ---- */

static fg_policy cache_policy(int gbs, int ngb, fg_percent percent, int overlap, int delegate) {
    fg_policy p = policy_of(gbs, ngb, percent);
    p.compress_cache = 1;
    p.overlap = overlap;
    p.cpu_cache_compute = delegate;
    return p;
}

/* The same prompts in GPU batches of 4 and of 2 (4 x 30 rows of prefill go through sgemm, 2 x 30
 * through the FMA kernel: sums in another order). With an fp16 cache the logits agree within
 * 1e-4 x max|logit|; with a 4-bit cache some K and V values cross a rounding boundary and they
 * differ by 1.5e-3 x max|logit| here, within the 1e-2 that docs/PIPELINE.md states. */
static void test_cache_batch_shape(void) {
    enum { N = 4, LEN = 30, STEPS = 6 };
    fixture_prompts f;
    fixture_prompts_open("opt-tiny", N, &f);
    for (int p = 0; p < N; p++) { /* BOS and 29 ids */
        f.lens[p] = LEN;
        for (int t = 0; t < LEN; t++) f.prompts[p][t] = t ? 3 + (p * 131 + (t - 1) * 17) % 500 : OPT_BOS_ID;
    }
    size_t n = (size_t)N * STEPS * f.cfg.vocab;
    float *logits[2] = {malloc(n * sizeof(float)), malloc(n * sizeof(float))};
    int tokens[2][N * STEPS];
    static const fg_percent all_gpu = {100, 0, 100, 0, 100, 0};
    for (int q4 = 0; q4 < 2; q4++) {
        for (int shape = 0; shape < 2; shape++) {
            fg_policy p = compressed(shape ? 2 : 4, shape ? 2 : 1, all_gpu);
            p.compress_cache = q4;
            CU_ASSERT_EQUAL_FATAL(generate_with(f.dir, NULL, 0, &p, STEPS, N, (int *const *)f.prompts, f.lens,
                                                tokens[shape], logits[shape], NULL, NULL), 0);
        }
        float worst = 0, max_abs = 0, bound = q4 ? 1e-2f : 1e-4f;
        for (size_t i = 0; i < n; i++) {
            worst = fmaxf(worst, fabsf(logits[0][i] - logits[1][i]));
            max_abs = fmaxf(max_abs, fabsf(logits[0][i]));
        }
        fprintf(stderr, "[%s cache: %.3g] ", q4 ? "4-bit" : "fp16", worst / max_abs);
        EXPECT(worst <= bound * max_abs, "%s cache, GPU batches of 4 against 2: logits differ by %g x "
               "max|logit|, bound %g", q4 ? "4-bit" : "fp16", worst / max_abs, bound);
    }
    free(logits[0]), free(logits[1]);
    fixture_prompts_close(&f);
}

/* A 4-bit cache gives the same bits wherever it lives, moved or read in place; and stays close
 * to the fp16 cache. */
static void check_cache(const char *name) {
    fixture_prompts f;
    fixture_prompts_open(name, N_SEQ, &f);
    size_t n = (size_t)N_SEQ * GEN * f.cfg.vocab;
    float *base = malloc(n * sizeof *base), *fp16_run = malloc(n * sizeof *fp16_run), *r = malloc(n * sizeof *r);
    int base_tokens[N_SEQ * GEN], tokens[N_SEQ * GEN];
    static const fg_percent all_gpu = {100, 0, 100, 0, 100, 0};
    static const fg_percent placements[] = {{100, 0, 0, 100, 100, 0}, {100, 0, 0, 0, 100, 0},
                                        {100, 0, 30, 40, 100, 0}, {0, 0, 0, 0, 0, 0}};
    static const int shapes[2][2] = {{N_SEQ, 1}, {2, 2}};
    for (int sh = 0; sh < 2; sh++) {
        fg_policy p = cache_policy(shapes[sh][0], shapes[sh][1], all_gpu, 1, 0);
        CU_ASSERT_EQUAL_FATAL(runtime_generate(&f, &p, base_tokens, base), 0);
        for (size_t k = 0; k < sizeof placements / sizeof *placements; k++)
            for (int variant = 0; variant < 4; variant++) {
                if (SANITIZERS_ONE_DIAGONAL && variant != (int)k % 4) continue;
                p = cache_policy(shapes[sh][0], shapes[sh][1], placements[k], variant & 1, variant >> 1);
                CU_ASSERT_EQUAL(runtime_generate(&f, &p, tokens, r), 0);
                CU_ASSERT_EQUAL(memcmp(tokens, base_tokens, sizeof tokens), 0);
                CU_ASSERT_EQUAL(memcmp(r, base, n * sizeof *r), 0);
            }
    }
    /* Against the fp16 cache. Only decode reads the compressed past (the prefill attends with
     * its own fp16 K and V), so the prefill's logits must be bit-identical. In decode, each K
     * and V value of the past is off by up to 1/30 of its group's range: the fixtures' heads
     * have 16 dims, whose range is about 3.5 sigma, so the rounding noise is 3.5 / 15 / sqrt(12)
     * = 7% of a value's size. Scores see that noise once through K; outputs average many noisy
     * V rows, which shrinks it; through two layers we allow 0.15 in relative RMS. */
    fg_policy p = cache_policy(N_SEQ, 1, all_gpu, 1, 0);
    CU_ASSERT_EQUAL_FATAL(runtime_generate(&f, &p, base_tokens, base), 0);
    p.compress_cache = 0;
    CU_ASSERT_EQUAL_FATAL(runtime_generate(&f, &p, tokens, fp16_run), 0);
    double diff = 0, norm = 0;
    int prefill_same = 1;
    for (int b = 0; b < N_SEQ; b++)
        for (int v = 0; v < f.cfg.vocab; v++) {
            size_t first = (size_t)b * GEN * f.cfg.vocab + v, second = first + f.cfg.vocab;
            prefill_same &= base[first] == fp16_run[first];
            /* the second step's logits, fed the same first token */
            if (base_tokens[b * GEN] == tokens[b * GEN]) {
                diff += (base[second] - fp16_run[second]) * (base[second] - fp16_run[second]);
                norm += fp16_run[second] * fp16_run[second];
            }
        }
    CU_ASSERT(prefill_same);
    CU_ASSERT(norm > 0);
    fprintf(stderr, "[%s: rms change %.3f] ", name, sqrt(diff / norm));
    CU_ASSERT(sqrt(diff / norm) <= 0.15);
    CU_ASSERT(diff > 0); /* the cache is compressed at all */
    free(base);
    free(fp16_run);
    free(r);
    fixture_prompts_close(&f);
}

static void test_cache_pre_ln(void) { check_cache("opt-tiny"); }
static void test_cache_post_ln(void) { check_cache("opt-tiny-350m"); }
static void test_cache_gqa(void) { check_cache("mistral-tiny-gqa8"); } /* 2 K/V heads of 8 for 16 queries */

/* ---- top-K sparse attention ---- */

static int by_weight_desc(const void *a, const void *b, void *w) {
    const float *s = w;
    float x = s[*(const int *)a], y = s[*(const int *)b];
    return x > y ? -1 : x < y ? 1 : *(const int *)a - *(const int *)b;
}

/* The decode attention of one head, written out: softmax over all keys, sort the earlier keys
 * by weight, keep the first floor(F (nk - 1)) and the new one, sum their weighted V rows. */
static void plain_sparse(const float *q, const float *K, const float *V, int nk, int hd, float F,
                         float *out) {
    float scores[256], m = -INFINITY, sum = 0;
    int order[256];
    for (int j = 0; j < nk; j++) {
        float dot = 0;
        for (int d = 0; d < hd; d++) dot += q[d] * K[j * hd + d];
        scores[j] = dot / sqrtf((float)hd);
        m = fmaxf(m, scores[j]);
    }
    for (int j = 0; j < nk; j++) sum += scores[j] = expf(scores[j] - m);
    for (int j = 0; j < nk; j++) scores[j] /= sum, order[j] = j;
    qsort_r(order, nk - 1, sizeof *order, by_weight_desc, scores);
    int k = (int)floorf(F * (float)(nk - 1));
    order[k] = nk - 1;
    memset(out, 0, hd * sizeof *out);
    for (int i = 0; i <= k; i++)
        for (int d = 0; d < hd; d++) out[d] += scores[order[i]] * V[order[i] * hd + d];
}

/* Sparse decode attention against plain_sparse, on random keys, or (tied) on keys that repeat
 * rows 0, 1 and 2 of the cache (key j is key j % 3): the weights of the 36 earlier keys then take
 * three values, 12 keys each, and every top-K below cuts through a tie, which goes to the
 * earlier keys (their V rows differ). */
static void check_sparse(int q4, int tied) {
    enum { NK = 37, HEADS = 2, HD = 16, H = HEADS * HD };
    float q[HD], K[NK * HD], V[NK * HD], out[HD], ref[HD], scratch[3 * NK + HD], row[H];
    size_t row_bytes = q4 ? q4_bytes(HEADS, HD, 1) : 2 * H;
    char *kc = malloc(NK * row_bytes), *vc = malloc(NK * row_bytes);
    uint64_t seed = 3 + q4;
    for (int d = 0; d < HD; d++) q[d] = 4 * (test_uniform(&seed) - 0.5f);
    /* cache rows of two heads; the test reads back head 1, as stored */
    for (int kv = 0; kv < 2; kv++)
        for (int j = 0; j < NK; j++) {
            for (int d = 0; d < H; d++) row[d] = fp16_to_fp32(fp32_to_fp16(2 * (test_uniform(&seed) - 0.5f)));
            char *dst = (kv ? vc : kc) + j * row_bytes;
            if (q4) q4_compress(row, HEADS, HD, 1, (uint8_t *)dst);
            else fp32_to_fp16_n(row, (fp16 *)dst, H);
            if (tied && kv == 0 && j >= 3) memcpy(dst, kc + (j % 3) * row_bytes, row_bytes);
            float back[H];
            if (q4) q4_decompress((const uint8_t *)dst, HEADS, HD, 1, back);
            else fp16_to_fp32_n((const fp16 *)dst, back, H);
            memcpy((kv ? V : K) + j * HD, back + HD, HD * sizeof(float));
        }
    opt_kv_rows kr = {kc, NULL, 0, row_bytes, q4, 1, HD, INT32_MAX, NULL, 0}, vr = kr;
    vr.rows = vc;
    static const float fractions[] = {0.05f, 0.3f, 0.5f, 0.99f, 1.0f};
    for (int i = 0; i < 5; i++) {
        float F = fractions[i];
        int read = opt_attend_decode(q, &kr, &vr, NK, 1 / sqrtf((float)HD), F, scratch, out);
        plain_sparse(q, K, V, NK, HD, F, ref);
        int keep = (int)floorf(F * (NK - 1)), want = keep + 1;
        EXPECT(read == want, "%s cache%s, F = %g, %d keys: V rows read: expected %d (the top "
               "floor(F (keys - 1)) = %d earlier keys and the new one), got %d",
               q4 ? "4-bit" : "fp16", tied ? " with tied keys" : "", F, NK, want, keep, read);
        float worst = 0, scale = 0;
        int at = 0;
        for (int d = 0; d < HD; d++) {
            if (fabsf(out[d] - ref[d]) > worst) worst = fabsf(out[d] - ref[d]), at = d;
            scale = fmaxf(scale, fabsf(ref[d]));
        }
        EXPECT(worst <= 1e-6f * scale, "%s cache%s, F = %g: attention output [%d]: expected %g (a top-K "
               "written out in the test, ties to the earlier key), got %g", q4 ? "4-bit" : "fp16",
               tied ? " with tied keys" : "", F, at, ref[at], out[at]);
    }
    free(kc);
    free(vc);
}

static void test_sparse_fp16(void) { check_sparse(0, 0); }
static void test_sparse_q4(void) { check_sparse(1, 0); }
static void test_sparse_ties(void) { check_sparse(0, 1), check_sparse(1, 1); }

/* In the runtime: F = 1 is the dense attention, bit for bit; F < 1 gives the same bits in every
 * placement; with the cache on the cpu tier only the kept V rows cross the cpu -> gpu link,
 * which the test counts from the rule itself. */
static void test_sparse_runtime(void) {
    fixture_prompts f;
    fixture_prompts_open("opt-tiny", N_SEQ, &f);
    const model_config *c = &f.cfg;
    size_t n = (size_t)N_SEQ * GEN * c->vocab;
    float *dense = malloc(n * sizeof *dense), *base = malloc(n * sizeof *base), *r = malloc(n * sizeof *r);
    int dense_tokens[N_SEQ * GEN], base_tokens[N_SEQ * GEN], tokens[N_SEQ * GEN];
    static const fg_percent all_gpu = {100, 0, 100, 0, 100, 0}, cpu_cache = {100, 0, 0, 100, 100, 0};
    fg_policy p = policy_of(N_SEQ, 1, all_gpu);
    CU_ASSERT_EQUAL_FATAL(runtime_generate(&f, &p, dense_tokens, dense), 0);
    p.attn_sparsity = 1;
    CU_ASSERT_EQUAL_FATAL(runtime_generate(&f, &p, tokens, r), 0);
    CU_ASSERT_EQUAL(memcmp(r, dense, n * sizeof *r), 0);

    for (int q4 = 0; q4 < 2; q4++) {
        p = policy_of(N_SEQ, 1, all_gpu);
        p.compress_cache = q4;
        p.attn_sparsity = 0.3f;
        CU_ASSERT_EQUAL_FATAL(runtime_generate(&f, &p, base_tokens, base), 0);
        CU_ASSERT(memcmp(base, dense, n * sizeof *base) != 0); /* it does drop something */
        static const fg_percent placements[] = {{100, 0, 0, 100, 100, 0}, {100, 0, 0, 0, 100, 0},
                                            {100, 0, 30, 40, 100, 0}, {0, 0, 0, 0, 0, 0}};
        for (size_t k = 0; k < sizeof placements / sizeof *placements; k++)
            for (int variant = 0; variant < 4; variant++) {
                if (SANITIZERS_ONE_DIAGONAL && variant != (int)k % 4) continue;
                fg_policy v = p;
                v.percent = placements[k];
                v.overlap = variant & 1;
                v.cpu_cache_compute = variant >> 1;
                CU_ASSERT_EQUAL(runtime_generate(&f, &v, tokens, r), 0);
                CU_ASSERT_EQUAL(memcmp(tokens, base_tokens, sizeof tokens), 0);
                CU_ASSERT_EQUAL(memcmp(r, base, n * sizeof *r), 0);
            }

        /* bytes: cache on cpu, not delegated */
        fg_policy v = p;
        v.percent = cpu_cache;
        fg_stats st;
        CU_ASSERT_EQUAL(generate_with(f.dir, NULL, 0, &v, GEN, N_SEQ, (int *const *)f.prompts, f.lens,
                                      tokens, r, &st, NULL), 0);
        double row = (double)opt_kv_row_bytes(c, q4), in = 0, dense_in = 0;
        for (int i = 1; i < GEN; i++)
            for (int b = 0; b < N_SEQ; b++) { /* the cache holds a sequence's own tokens, no padding */
                int past = f.lens[b] + i - 1, keep = (int)floorf(v.attn_sparsity * (float)past) + 1;
                in += c->n_layers * row * (past + keep);       /* all of K, the kept rows of V */
                dense_in += c->n_layers * row * 2 * past;
            }
        EXPECT(st.link_bytes[LINK_CPU_TO_GPU] == in, "%s cache on cpu, sparsity %g: cpu->gpu bytes: "
               "expected %.0f (all of K, the kept rows of V), got %.0f", q4 ? "4-bit" : "fp16",
               v.attn_sparsity, in, st.link_bytes[LINK_CPU_TO_GPU]);
        CU_ASSERT(in < 0.8 * dense_in);
    }
    free(dense);
    free(base);
    free(r);
    fixture_prompts_close(&f);
}

/* The largest |logit| difference between a run with policy p and one block of all the prompts
 * (logits base, tokens base_tokens), or -1 when the tokens differ. */
static double grouping_change(const fixture_prompts *f, const fg_policy *p, const int *base_tokens,
                              const float *base, float *r) {
    int tokens[N_SEQ * GEN];
    if (runtime_generate(f, p, tokens, r)) return INFINITY;
    if (memcmp(tokens, base_tokens, sizeof tokens)) return -1;
    double worst = 0;
    for (size_t i = 0; i < (size_t)N_SEQ * GEN * f->cfg.vocab; i++) worst = fmax(worst, fabs(r[i] - base[i]));
    return worst;
}

/* Which prompts share a block, and so how far each is left-padded, does not change the sparse
 * result: the rule counts a sequence's own tokens. The prompts have 3, 9, 14, 6 and 1 tokens;
 * the blocks hold all five, one each, 2 x 3 (the second block half empty), and so on. The dense
 * path's logits already move a little with the grouping (padding rows change how the products
 * round, and then which fp16 the cache stores), so the sparse path is held to the same tokens and
 * to 4x the dense path's own change; a rule that counted padding keeps other keys and moves the
 * logits by far more. */
static void test_sparse_grouping(void) {
    fixture_prompts f;
    fixture_prompts_open("opt-tiny", N_SEQ, &f);
    size_t n = (size_t)N_SEQ * GEN * f.cfg.vocab;
    float *dense = malloc(n * sizeof *dense), *sparse = malloc(n * sizeof *sparse), *r = malloc(n * sizeof *r);
    int dense_tokens[N_SEQ * GEN], sparse_tokens[N_SEQ * GEN];
    static const fg_percent all_gpu = {100, 0, 100, 0, 100, 0}, cpu_cache = {100, 0, 0, 100, 100, 0};
    static const int shapes[][2] = {{1, 1}, {2, 1}, {1, 3}, {2, 3}, {3, 2}};
    for (int q4 = 0; q4 < 2; q4++) {
        fg_policy p = policy_of(N_SEQ, 1, all_gpu);
        p.compress_cache = q4;
        CU_ASSERT_EQUAL_FATAL(runtime_generate(&f, &p, dense_tokens, dense), 0);
        p.attn_sparsity = 0.5f;
        CU_ASSERT_EQUAL_FATAL(runtime_generate(&f, &p, sparse_tokens, sparse), 0);
        for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++)
            for (int cpu = 0; cpu < 2; cpu++) {
                if (SANITIZERS_ONE_DIAGONAL && cpu != (int)s % 2) continue;
                fg_policy v = policy_of(shapes[s][0], shapes[s][1], cpu ? cpu_cache : all_gpu);
                v.compress_cache = q4;
                double dense_change = grouping_change(&f, &v, dense_tokens, dense, r);
                v.attn_sparsity = p.attn_sparsity;
                double change = grouping_change(&f, &v, sparse_tokens, sparse, r);
                EXPECT(dense_change >= 0 && change >= 0 && change <= 4 * dense_change,
                       "%s cache %s, blocks of %d x %d against one block of all 5 prompts: sparsity "
                       "0.5 %s (largest logit change %g), dense %s (%g)", q4 ? "4-bit" : "fp16",
                       cpu ? "on cpu" : "on gpu", shapes[s][0], shapes[s][1],
                       change < 0 ? "changes tokens" : "keeps the tokens", change,
                       dense_change < 0 ? "changes tokens" : "keeps the tokens", dense_change);
            }
    }
    free(dense);
    free(sparse);
    free(r);
    fixture_prompts_close(&f);
}

void add_compress_tests(void) {
    CU_pSuite s = CU_add_suite("compress", NULL, NULL);
    CU_add_test(s, "--compress-weight computes the plain pass on round-tripped weights, pre-LN",
                test_weights_pre_ln);
    CU_add_test(s, "--compress-weight computes the plain pass on round-tripped weights, post-LN",
                test_weights_post_ln);
    CU_add_test(s, "--compress-weight groups q, k and v each on its own (hidden 96)", test_qkv_groups);
    CU_add_test(s, "dummy 4-bit weights made in their stored form: the compressed fp16 values' bytes", test_dummy_q4);
    CU_add_test(s, "--compress-weight on LLaMA (GQA 4, untied): the plain pass's bits, close to fp16",
                test_weights_llama);
    CU_add_test(s, "--int8-activations on LLaMA (MQA, biases): the plain pass's bits", test_int8_llama);
    CU_add_test(s, "--compress-weight on Mistral (k, v rows of 16): the gpu tier's bits staged from cpu and disk",
                test_weights_narrow_rows);
    CU_add_test(s, "--compress-cache on Mistral (GQA 8): same bits in every placement, close to fp16",
                test_cache_gqa);
    CU_add_test(s, "--int8-activations: the plain pass's bits on every tier, close to section 5's, pre-LN",
                test_int8_pre_ln);
    CU_add_test(s, "--int8-activations: the same, post-LN (opt-350m's shape)", test_int8_post_ln);
    CU_add_test(s, "--int8-activations: W's int8 columns kept where the gpu tier has room, the same bits",
                test_int8_columns_room);
    CU_add_test(s, "--int8-activations on outlier dimensions (24 to 56x the rest): the logits' move, prefill and "
                "decode", test_int8_outliers);
    CU_add_test(s, "--bf16-prefill: the plain pass's bits on every tier, and its change from fp32 products",
                test_bf16_pre_ln);
    CU_add_test(s, "--bf16-prefill: the same, post-LN (opt-350m's shape)", test_bf16_post_ln);
    CU_add_test(s, "--compress-cache: same bits in every placement, close to fp16, pre-LN", test_cache_pre_ln);
    CU_add_test(s, "--compress-cache: same bits in every placement, close to fp16, post-LN", test_cache_post_ln);
    CU_add_test(s, "--compress-cache: another GPU batch size, within the stated bound", test_cache_batch_shape);
    CU_add_test(s, "sparse attention equals a plain top-K, fp16 cache", test_sparse_fp16);
    CU_add_test(s, "sparse attention: the same result however prompts are grouped into blocks",
                test_sparse_grouping);
    CU_add_test(s, "sparse attention equals a plain top-K, 4-bit cache", test_sparse_q4);
    CU_add_test(s, "sparse attention with tied weights keeps the earlier keys, exactly k", test_sparse_ties);
    CU_add_test(s, "sparse attention in the runtime: F = 1 is dense, same bits everywhere, V bytes",
                test_sparse_runtime);
}
